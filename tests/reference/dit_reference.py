#!/usr/bin/python3
"""A plain PyTorch DiT trained by rectified flow: the correctness reference for shardlm's dit family.

Run by /usr/bin/python3 (Debian's python3-torch), in float64 so that its error is far below the
engine's fp32 one:

  dit_reference.py --weights W.safetensors --batch BATCH.safetensors --out OUT.safetensors
                   --layers L --heads NH --width C --frames F --height H --width-px W
                   --channels CH --patch pf,ph,pw --classes K

  W      every parameter under shardlm's names and shapes: linear weights (in, out), the transpose
         of nn.Linear's; x_embedder.proj.weight (CH·pf·ph·pw, C), Conv3d's (C, CH, pf, ph, pw)
         flattened and transposed; pos_embed (T, C)
  BATCH  "x0", "noise" (B, CH, F, H, W) fp32, "t" (B) fp32, "y" (B) int32 (K: the null class)
  OUT    "loss" [1] (mean squared error over every value), "pred" (B, CH, F, H, W) the predicted
         velocity, and "grad.<name>" for every parameter, in W's layout

The model follows the DiT paper (Peebles & Xie 2023) and its reference code: Conv3d patch
embedding of x_t = (1 − t)·x0 + t·noise plus learned positions; timestep embedding of t·1000
(cos | sin at frequencies 10000^(−i/128), then Linear, SiLU, Linear) plus the label's row of a
table with a null class; adaLN-Zero blocks (LayerNorm without affine, eps 1e-6; SiLU, Linear to
shift, scale, gate for attention and MLP; bidirectional multi-head attention with a fused qkv;
GELU-tanh MLP of 4C); final LayerNorm, adaLN shift and scale, Linear to pf·ph·pw·CH values per
patch in (pf, ph, pw, CH) order, unpatchified. The target is noise − x0.
"""
import argparse
import math
import os
import sys

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from reference_common import load_safetensors, save_safetensors  # noqa: E402


def modulate(x, shift, scale):
    return x * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)


def timestep_features(t, dim=256, max_period=10000):
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=t.dtype) / half)
    args = t[:, None] * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


class Attention(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        w = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(C // self.heads), dim=-1)
        return self.proj((w @ v).transpose(1, 2).reshape(B, N, C))


class Mlp(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class DiTBlock(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.attn = Attention(dim, heads)
        self.norm2 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.mlp = Mlp(dim, 4 * dim)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(dim, 6 * dim))

    def forward(self, x, c):
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.adaLN_modulation(c).chunk(6, dim=1)
        x = x + gate_msa.unsqueeze(1) * self.attn(modulate(self.norm1(x), shift_msa, scale_msa))
        return x + gate_mlp.unsqueeze(1) * self.mlp(modulate(self.norm2(x), shift_mlp, scale_mlp))


class FinalLayer(nn.Module):
    def __init__(self, dim, out):
        super().__init__()
        self.norm_final = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.linear = nn.Linear(dim, out)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(dim, 2 * dim))

    def forward(self, x, c):
        shift, scale = self.adaLN_modulation(c).chunk(2, dim=1)
        return self.linear(modulate(self.norm_final(x), shift, scale))


class TimestepEmbedder(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(256, dim), nn.SiLU(), nn.Linear(dim, dim))

    def forward(self, t):
        return self.mlp(timestep_features(t * 1000))


class LabelEmbedder(nn.Module):
    def __init__(self, classes, dim):
        super().__init__()
        self.embedding_table = nn.Embedding(classes + 1, dim)

    def forward(self, y):
        return self.embedding_table(y)


class PatchEmbed(nn.Module):
    def __init__(self, channels, dim, patch):
        super().__init__()
        self.proj = nn.Conv3d(channels, dim, kernel_size=patch, stride=patch)

    def forward(self, x):
        return self.proj(x).flatten(2).transpose(1, 2)


class DiT(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.a = a
        self.tokens = (a.frames // a.patch[0]) * (a.height // a.patch[1]) * (a.width_px // a.patch[2])
        self.x_embedder = PatchEmbed(a.channels, a.width, a.patch)
        self.pos_embed = nn.Parameter(torch.zeros(1, self.tokens, a.width))
        self.t_embedder = TimestepEmbedder(a.width)
        self.y_embedder = LabelEmbedder(a.classes, a.width)
        self.blocks = nn.ModuleList([DiTBlock(a.width, a.heads) for _ in range(a.layers)])
        self.final_layer = FinalLayer(a.width, a.patch[0] * a.patch[1] * a.patch[2] * a.channels)

    def unpatchify(self, x):
        a, (pf, ph, pw) = self.a, self.a.patch
        f, h, w = a.frames // pf, a.height // ph, a.width_px // pw
        x = x.reshape(x.shape[0], f, h, w, pf, ph, pw, a.channels)
        x = x.permute(0, 7, 1, 4, 2, 5, 3, 6)
        return x.reshape(x.shape[0], a.channels, a.frames, a.height, a.width_px)

    def forward(self, x, t, y):
        x = self.x_embedder(x) + self.pos_embed
        c = self.t_embedder(t) + self.y_embedder(y)
        for block in self.blocks:
            x = block(x, c)
        return self.unpatchify(self.final_layer(x, c))


# shardlm's layout of a parameter <-> PyTorch's.
def to_torch(name, v, model):
    target = dict(model.named_parameters())[name]
    if name == "x_embedder.proj.weight":
        return v.T.reshape(target.shape)
    if name == "pos_embed":
        return v.reshape(target.shape)
    if v.ndim == 2 and not name.startswith("y_embedder"):
        return v.T
    return v


def from_torch(name, g):
    if name == "x_embedder.proj.weight":
        return g.reshape(g.shape[0], -1).T
    if name == "pos_embed":
        return g[0]
    if g.ndim == 2 and not name.startswith("y_embedder"):
        return g.T
    return g


def main(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    p.add_argument("--weights", required=True)
    p.add_argument("--batch", required=True)
    p.add_argument("--out", required=True)
    for k in ("layers", "heads", "width", "frames", "height", "width-px", "channels", "classes"):
        p.add_argument("--" + k, type=int, required=True)
    p.add_argument("--patch", type=lambda s: tuple(int(v) for v in s.split(",")), required=True)
    a = p.parse_args(argv)
    torch.set_default_dtype(torch.float64)
    model = DiT(a)
    weights, _ = load_safetensors(a.weights)
    names = {n for n, _ in model.named_parameters()}
    if names != set(weights):
        raise SystemExit(f"weights: missing {sorted(names - set(weights))}, unexpected {sorted(set(weights) - names)}")
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(torch.from_numpy(to_torch(name, weights[name].astype(np.float64), model)))
    batch, _ = load_safetensors(a.batch)
    x0, noise = (torch.from_numpy(batch[k].astype(np.float64)) for k in ("x0", "noise"))
    t = torch.from_numpy(batch["t"].astype(np.float64))
    y = torch.from_numpy(batch["y"].astype(np.int64))
    tt = t.reshape(-1, 1, 1, 1, 1)
    x_t = (1 - tt) * x0 + tt * noise
    pred = model(x_t, t, y)
    loss = F.mse_loss(pred, noise - x0)
    loss.backward()
    out = {"loss": np.array([loss.item()], dtype=np.float32), "pred": pred.detach().numpy().astype(np.float32)}
    for name, param in model.named_parameters():
        out["grad." + name] = from_torch(name, param.grad.detach()).numpy().astype(np.float32)
    save_safetensors(a.out, out)


if __name__ == "__main__":
    main(sys.argv[1:])
