#!/usr/bin/python3
"""A plain PyTorch Mixtral (Hugging Face MixtralForCausalLM's forward, fp32) built from
llama_reference's attention and norms, for reading shardlm's Hugging Face export
(hf_export_check.py). A module, not a program.

Config: LlamaConfig's keys (intermediate_size is an expert's width) and num_local_experts,
num_experts_per_tok. Mixtral has a MoE block in every layer and no capacity: a config with
shardlm_moe_every other than 1 or shardlm_capacity_factor is refused; shardlm_norm_topk false
keeps the softmax weights unnormalised (shardlm's --no-norm-topk; Mixtral always normalises).

Parameters (Hugging Face names, nn.Linear layout (out, in)): LLaMA's, with each layer's mlp
replaced by model.layers.N.block_sparse_moe.gate.weight (E, C) and, for each expert J,
block_sparse_moe.experts.J.{w1 (F, C) gate, w3 (F, C) up, w2 (C, F) down}.weight.

The MoE block (MixtralSparseMoeBlock): router softmax over the E experts in fp32, the top k per
token (ties to the lower expert index, as shardlm; torch.topk leaves their order open), the k
weights renormalised to sum 1, and out = sum_k weight * w2(silu(w1 h) * w3 h).
"""
import json

import torch
import torch.nn as nn
import torch.nn.functional as F

import llama_reference as llama
from reference_common import load_params_


class MixtralConfig(llama.LlamaConfig):
    def __init__(self, num_local_experts, num_experts_per_tok, norm_topk=True, **kw):
        super().__init__(**kw)
        self.num_local_experts, self.num_experts_per_tok = int(num_local_experts), int(num_experts_per_tok)
        self.norm_topk = bool(norm_topk)
        if not 1 <= self.num_experts_per_tok <= self.num_local_experts:
            raise ValueError(f"num_experts_per_tok {num_experts_per_tok} must be in [1, num_local_experts "
                             f"= {num_local_experts}]")

    @classmethod
    def from_dict(cls, d, source="config"):
        if d.get("model_type") != "mixtral":
            raise ValueError(f"{source}: model_type is {d.get('model_type')!r}, not 'mixtral'")
        if d.get("shardlm_moe_every", 1) != 1:
            raise ValueError(f"{source}: shardlm_moe_every is {d['shardlm_moe_every']}; Mixtral has MoE in every layer")
        if d.get("shardlm_capacity_factor", 0) not in (0, None):
            raise ValueError(f"{source}: shardlm_capacity_factor is set; Mixtral drops no tokens")
        for k in ("num_local_experts", "num_experts_per_tok"):
            if k not in d:
                raise ValueError(f"{source}: missing key {k!r}")
        dense = llama.LlamaConfig.from_dict(dict(d, model_type="llama"), source)
        try:
            return cls(d["num_local_experts"], d["num_experts_per_tok"], d.get("shardlm_norm_topk", True),
                       **{k: getattr(dense, k) for k in llama.LlamaConfig.REQUIRED})
        except (TypeError, ValueError) as e:
            raise ValueError(f"{source}: {e}") from None

    @classmethod
    def from_json(cls, path):
        with open(path) as f:
            return cls.from_dict(json.load(f), source=path)


class Expert(nn.Module):
    def __init__(self, C, Fd):
        super().__init__()
        self.w1 = nn.Linear(C, Fd, bias=False)
        self.w3 = nn.Linear(C, Fd, bias=False)
        self.w2 = nn.Linear(Fd, C, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class SparseMoeBlock(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.top_k, self.norm_topk = cfg.num_experts_per_tok, cfg.norm_topk
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_local_experts, bias=False)
        self.experts = nn.ModuleList([Expert(cfg.hidden_size, cfg.intermediate_size)
                                      for _ in range(cfg.num_local_experts)])

    def forward(self, x):
        B, T, C = x.shape
        h = x.reshape(-1, C)
        probs = F.softmax(self.gate(h), dim=-1, dtype=torch.float)
        chosen = torch.sort(probs, dim=-1, descending=True, stable=True).indices[:, :self.top_k]
        weights = probs.gather(1, chosen)
        if self.norm_topk:
            weights = weights / weights.sum(-1, keepdim=True)
        out = torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            tok, slot = torch.where(chosen == e)
            if len(tok):
                out.index_add_(0, tok, expert(h[tok]) * weights[tok, slot, None].to(h.dtype))
        return out.view(B, T, C)


class MixtralDecoderLayer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.input_layernorm = llama.RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = llama.LlamaAttention(cfg)
        self.post_attention_layernorm = llama.RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.block_sparse_moe = SparseMoeBlock(cfg)

    def forward(self, x, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.block_sparse_moe(self.post_attention_layernorm(x))


class Mixtral(llama.Llama):
    """Parameter names: Hugging Face MixtralForCausalLM's. forward(idx) -> (logits, loss) as Llama's
    (the language loss only: no router losses)."""

    def __init__(self, cfg):
        super().__init__(cfg)
        self.model.layers = nn.ModuleList([MixtralDecoderLayer(cfg) for _ in range(cfg.num_hidden_layers)])

    def load_numpy_(self, weights):
        return load_params_(self, weights)
