#!/usr/bin/python3
"""An independent PyTorch mixture-of-experts (Mixtral-style) language model, written from the
formulas, for the engine's parity test (tests/train/moe_parity_test.cc).

Reads Hugging Face-named weights (model.safetensors) and a batch (inputs, targets: (G, B, T), G
routing groups = micro-batches), computes in float64: LLaMA attention (RMSNorm, rotate_half rotary
embedding, grouped-query causal attention), and in each MoE block a router softmax, top-k (ties to
the lower expert index), optional renormalisation, capacity (an expert keeps its first
ceil(cf * tokens * k / E) tokens in token order; 0: all), and the experts as the usual loop over
experts with index_select / index_add. The objective is

    sum_g CE_g / (G B T) + aux_coef * mean_g sum_layers aux + z_coef * mean_g sum_layers z

with aux = E sum_e f_e P_e (f_e: share of the group's top-k assignments to e, before
capacity; P_e: mean router probability of e) and z = mean over tokens of logsumexp(logits)^2.
Writes loss (language), aux, z (means over groups of the sums over layers) and grad.NAME for every
weight.
"""
import argparse
import math
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import reference_common as ref  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    for name in ("--weights", "--batch", "--out"):
        ap.add_argument(name, required=True)
    for name in ("--layers", "--heads", "--kv-heads", "--vocab", "--experts", "--top-k", "--moe-every"):
        ap.add_argument(name, type=int, required=True)
    for name in ("--theta", "--eps", "--capacity-factor", "--aux-coef", "--z-coef"):
        ap.add_argument(name, type=float, required=True)
    ap.add_argument("--no-norm-topk", action="store_true")
    a = ap.parse_args()

    raw, _ = ref.load_safetensors(a.weights)
    W = {k: torch.tensor(v, dtype=torch.float64, requires_grad=True) for k, v in raw.items()}
    b, _ = ref.load_safetensors(a.batch)
    inputs = torch.tensor(b["inputs"].astype(np.int64))
    targets = torch.tensor(b["targets"].astype(np.int64))
    G, B, T = inputs.shape
    C = W["model.embed_tokens.weight"].shape[1]
    NH, NKV, E, k = a.heads, a.kv_heads, a.experts, a.top_k
    HS = C // NH

    def rms(x, g):
        return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + a.eps) * g

    inv = 1.0 / a.theta ** (torch.arange(0, HS, 2, dtype=torch.float64) / HS)
    ang = torch.arange(T, dtype=torch.float64)[:, None] * inv[None, :]
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1), torch.cat([ang.sin(), ang.sin()], -1)

    def rope(x):  # (B, H, T, HS)
        h = HS // 2
        rot = torch.cat([-x[..., h:], x[..., :h]], -1)
        return x * cos + rot * sin

    def attention(x, p):
        h = rms(x, W[p + "input_layernorm.weight"])
        q = (h @ W[p + "self_attn.q_proj.weight"].T).view(B, T, NH, HS).transpose(1, 2)
        kk = (h @ W[p + "self_attn.k_proj.weight"].T).view(B, T, NKV, HS).transpose(1, 2)
        v = (h @ W[p + "self_attn.v_proj.weight"].T).view(B, T, NKV, HS).transpose(1, 2)
        q, kk = rope(q), rope(kk)
        kk, v = kk.repeat_interleave(NH // NKV, 1), v.repeat_interleave(NH // NKV, 1)
        s = q @ kk.transpose(-1, -2) / math.sqrt(HS)
        s = s.masked_fill(torch.triu(torch.ones(T, T, dtype=torch.bool), 1), float("-inf"))
        y = (s.softmax(-1) @ v).transpose(1, 2).reshape(B, T, C)
        return x + y @ W[p + "self_attn.o_proj.weight"].T

    def moe(x, p):
        h = rms(x, W[p + "post_attention_layernorm.weight"]).reshape(B * T, C)
        N = B * T
        logits = h @ W[p + "block_sparse_moe.gate.weight"].T
        probs = logits.softmax(-1)
        chosen = torch.sort(probs.detach(), dim=-1, descending=True, stable=True).indices[:, :k]  # ties: lower index
        w = probs.gather(1, chosen)
        if not a.no_norm_topk:
            w = w / w.sum(-1, keepdim=True)
        cap = N if a.capacity_factor <= 0 else min(N, math.ceil(a.capacity_factor * N * k / E))
        out = torch.zeros_like(h)
        for e in range(E):
            tok, slot = torch.nonzero(chosen == e, as_tuple=True)  # token order
            tok, slot = tok[:cap], slot[:cap]
            if len(tok) == 0:
                continue
            xe = h.index_select(0, tok)
            pe = p + f"block_sparse_moe.experts.{e}."
            g = xe @ W[pe + "w1.weight"].T
            ye = (g * torch.sigmoid(g) * (xe @ W[pe + "w3.weight"].T)) @ W[pe + "w2.weight"].T
            out = out.index_add(0, tok, ye * w[tok, slot][:, None])
        f = torch.stack([(chosen == e).sum() for e in range(E)]).double() / (N * k)
        aux = E * (f * probs.mean(0)).sum()
        z = (torch.logsumexp(logits, -1) ** 2).mean()
        return x + out.view(B, T, C), aux, z

    def dense(x, p):
        h = rms(x, W[p + "post_attention_layernorm.weight"])
        g = h @ W[p + "mlp.gate_proj.weight"].T
        return x + (g * torch.sigmoid(g) * (h @ W[p + "mlp.up_proj.weight"].T)) @ W[p + "mlp.down_proj.weight"].T

    head = W["lm_head.weight"] if "lm_head.weight" in W else W["model.embed_tokens.weight"]
    ce, aux_sum, z_sum = 0, 0, 0
    for grp in range(G):
        x = W["model.embed_tokens.weight"][inputs[grp]]
        for l in range(a.layers):
            p = f"model.layers.{l}."
            x = attention(x, p)
            if (l + 1) % a.moe_every == 0:
                x, aux, z = moe(x, p)
                aux_sum, z_sum = aux_sum + aux, z_sum + z
            else:
                x = dense(x, p)
        x = rms(x, W["model.norm.weight"])
        logits = x @ head.T
        ce = ce + torch.nn.functional.cross_entropy(logits.view(-1, a.vocab), targets[grp].reshape(-1), reduction="sum")
    loss = ce / (G * B * T)
    aux, z = aux_sum / G, z_sum / G
    (loss + a.aux_coef * aux + a.z_coef * z).backward()
    out = {"loss": np.array([loss.item()], np.float32), "aux": np.array([float(aux)], np.float32),
           "z": np.array([float(z)], np.float32)}
    for name, t in W.items():
        out["grad." + name] = (t.grad if t.grad is not None else torch.zeros_like(t)).numpy().astype(np.float32)
    ref.save_safetensors(a.out, out)


if __name__ == "__main__":
    main()
