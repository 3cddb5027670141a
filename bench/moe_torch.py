"""A plain PyTorch mixture-of-experts LLaMA (Mixtral style) for bench/vs_torch.py's moe configs.

tests/reference/llama_reference.py's Llama with every block's MLP replaced by a sparse MoE layer
written the usual way (as Hugging Face's MixtralSparseMoeBlock): router linear (no bias), fp32
softmax, top-k, weights renormalised to sum 1, then a loop over the experts: index_select the
tokens routed to the expert, its SwiGLU MLP (w2(silu(w1 x) * w3 x)), index_add the outputs,
each weighted by its routing weight, into the block's output. Dropless (no capacity), as shardlm's
default. The loss adds, as shardlm's trainer does by default, the Switch load-balancing loss
(coefficient 0.01: E sum_e f_e P_e) and the router z-loss (0.001: mean logsumexp(logits)^2).
Parameter names follow Hugging Face's Mixtral (block_sparse_moe.gate, .experts.J.w1/w2/w3).
"""
import os
import sys

import torch
import torch.nn as nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "reference"))
import llama_reference as ref  # noqa: E402
from mixtral_reference import Expert  # noqa: E402  (one SwiGLU expert: w1 gate, w3 up, w2 down)


class SparseMoe(nn.Module):
    """forward(x (B, T, C)) -> (B, T, C); leaves this pass's aux and z losses in .aux, .z."""

    def __init__(self, C, E, k, FE):
        super().__init__()
        self.n_experts, self.top_k = E, k
        self.gate = nn.Linear(C, E, bias=False)
        self.experts = nn.ModuleList([Expert(C, FE) for _ in range(E)])
        self.aux = self.z = None

    def forward(self, x):
        B, T, C = x.shape
        E, k = self.n_experts, self.top_k
        h = x.reshape(B * T, C)
        logits = self.gate(h).float()
        probs = logits.softmax(-1)
        weight, chosen = probs.topk(k, dim=-1)
        weight = weight / weight.sum(-1, keepdim=True)
        out = torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            tok, slot = torch.where(chosen == e)
            if tok.numel() == 0:
                continue
            y = expert(h.index_select(0, tok)) * weight[tok, slot, None].to(h.dtype)
            out.index_add_(0, tok, y)
        share = torch.bincount(chosen.reshape(-1), minlength=E).float() / (B * T * k)
        self.aux = E * (share * probs.mean(0)).sum()
        self.z = (torch.logsumexp(logits, -1) ** 2).mean()
        return out.view(B, T, C)


class MoeLlama(nn.Module):
    def __init__(self, cfg, n_experts, top_k, moe_ffn, aux_coef=0.01, z_coef=0.001):
        super().__init__()
        self.llama = ref.Llama(cfg)
        for layer in self.llama.model.layers:
            layer.mlp = SparseMoe(cfg.hidden_size, n_experts, top_k, moe_ffn)
        self.aux_coef, self.z_coef = aux_coef, z_coef

    def forward(self, idx, targets=None):
        logits, loss = self.llama(idx, targets)
        if loss is not None:
            moes = [layer.mlp for layer in self.llama.model.layers]
            loss = loss + self.aux_coef * sum(m.aux for m in moes) + self.z_coef * sum(m.z for m in moes)
        return logits, loss


def build(c, vocab, n_positions, seed=1):
    """c: vs_torch.py's config entry (arch "moe")."""
    cfg = ref.LlamaConfig(vocab_size=vocab, hidden_size=c["n_embd"], intermediate_size=c["ffn"],
                          num_hidden_layers=c["n_layer"], num_attention_heads=c["n_head"],
                          num_key_value_heads=c["n_kv_head"], rms_norm_eps=c["eps"], rope_theta=c["rope_theta"],
                          max_position_embeddings=n_positions, tie_word_embeddings=c["tied"])
    model = MoeLlama(cfg, c["experts"], c["top_k"], c["moe_ffn"])
    return ref, ref.init_llama_(model, seed=seed)
