#!/usr/bin/env python3
"""GPT-2 training-step speed on one GPU in PyTorch, the baseline for `shardlm train --device cuda`.

  python3 bench/cuda_vs_torch.py --batch 16 --seq 1024 --steps 20 --warmup 5 [--compile]

GPT-2 124M (12 layers, 12 heads, 768 channels, vocabulary 50257, tied head), as a user would write
it in PyTorch: bf16 autocast (fp32 master weights), F.scaled_dot_product_attention (causal, flash),
fused AdamW, gradient clipping at 1.0. Random tokens. Prints the median ms/step over the timed steps
(timed with CUDA events around each step), tokens/s and MFU against 989 TFLOP/s (H100 SXM bf16
dense), using 6 N + 6 L T C FLOPs per token (N = non-embedding parameters + the head, the
attention term as nanoGPT/llm.c count it), the same count shardlm's metrics use is printed too.
"""
import argparse
import json
import math
import statistics

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, C, NH):
        super().__init__()
        self.NH = NH
        self.ln_1, self.ln_2 = nn.LayerNorm(C), nn.LayerNorm(C)
        self.c_attn, self.c_proj = nn.Linear(C, 3 * C), nn.Linear(C, C)
        self.c_fc, self.c_proj2 = nn.Linear(C, 4 * C), nn.Linear(4 * C, C)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.NH, C // self.NH).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C)
        x = x + self.c_proj(y)
        return x + self.c_proj2(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class GPT2(nn.Module):
    def __init__(self, L=12, NH=12, C=768, V=50257, P=1024):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(V, C), nn.Embedding(P, C)
        self.h = nn.ModuleList([Block(C, NH) for _ in range(L)])
        self.ln_f = nn.LayerNorm(C)
        for p in self.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02)

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for b in self.h:
            x = b(x)
        logits = self.ln_f(x) @ self.wte.weight.t()
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.view(-1))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    torch.manual_seed(0)
    dev = "cuda"
    model = GPT2().to(dev)
    step_model = torch.compile(model) if a.compile else model
    decay = [p for p in model.parameters() if p.dim() == 2]
    other = [p for p in model.parameters() if p.dim() != 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}],
                            lr=6e-4, betas=(0.9, 0.95), fused=True)
    B, T = a.batch, a.seq
    x = torch.randint(0, 50257, (B, T), device=dev)
    y = torch.randint(0, 50257, (B, T), device=dev)
    times = []
    for s in range(a.warmup + a.steps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = step_model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        e1.record()
        torch.cuda.synchronize()
        if s >= a.warmup:
            times.append(e0.elapsed_time(e1))
    n_params = sum(p.numel() for p in model.parameters())
    n_emb = model.wpe.weight.numel()  # the tied wte is the head's matrix: counted
    flops_per_token = 6 * (n_params - n_emb) + 6 * 12 * T * 768
    ms = statistics.median(times)
    tok_s = B * T / (ms * 1e-3)
    mfu = flops_per_token * tok_s / 989e12
    name = "torch.compile" if a.compile else "torch eager"
    print(f"{name}: B={B} T={T} median {ms:.1f} ms/step (min {min(times):.1f}) {tok_s:.0f} tok/s MFU {100 * mfu:.1f}% "
          f"(loss {loss.item():.3f}, {torch.cuda.get_device_name()}, torch {torch.__version__})")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"variant": name, "ms": times, "tokens_per_s": tok_s, "mfu": mfu}, f)


if __name__ == "__main__":
    main()
