#!/usr/bin/python3
"""A plain PyTorch GPT-2: the correctness reference for shardlm (and the speed baseline in bench/).

Run by /usr/bin/python3 (Debian's python3-torch). As a program:

  gpt2_reference.py --model-dir DIR --batch BATCH.safetensors --out OUT.safetensors
                    [--adam-steps K --lr LR --beta1 B1 --beta2 B2 --eps EPS
                     --weight-decay WD --grad-clip G] [--dump-params]

  DIR/model.safetensors  fp32 weights with Hugging Face GPT-2 names (no "transformer." prefix),
                         wte with exactly vocab_size rows
  DIR/config.json        Hugging Face keys: n_layer, n_head, n_embd, vocab_size, n_positions
  BATCH                  "inputs" and "targets", int32 (B, T)
  OUT                    "logits" (B,T,V) fp32, "loss" [1] (mean cross-entropy),
                         "grad.<name>" for every parameter (at the loaded weights), and when K > 0:
                         "adam_losses" [K] (loss of each of K AdamW steps on the same batch, taken
                         before its update) and "adam_grad_norms" [K] (global grad norm before
                         clipping); with --dump-params also "param.<name>" after the K steps.

As a module (bench/vs_torch.py imports it): GPT2Config, GPT2, init_gpt2_, make_adamw,
load_safetensors, save_safetensors.

The model: token + position embedding; L pre-LN blocks (causal self-attention whose c_attn
produces [q|k|v] along the last dim, head h taking columns h*HS..(h+1)*HS of each; tanh-GELU MLP;
residuals); final layer norm; head tied to wte. Linear layers use the Hugging Face Conv1D layout:
weight (in, out), y = x @ W + b. Layer norms use eps 1e-5. No dropout.
"""
import json
import math
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

# safetensors I/O, weight loading, AdamW set-up and the command line live in reference_common.py
# (shared with llama_reference.py); re-exported here under the names bench/ and the tests use.
from reference_common import (load_params_, load_safetensors, make_adamw,  # noqa: F401
                              reference_main, save_safetensors)

# ---------------------------------------------------------------- the model


class GPT2Config:
    def __init__(self, n_layer=12, n_head=12, n_embd=768, vocab_size=50257, n_positions=1024):
        self.n_layer, self.n_head, self.n_embd = int(n_layer), int(n_head), int(n_embd)
        self.vocab_size, self.n_positions = int(vocab_size), int(n_positions)
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd {self.n_embd} is not a multiple of n_head {self.n_head}")

    @classmethod
    def from_json(cls, path):
        with open(path) as f:
            d = json.load(f)
        return cls(**{k: d[k] for k in ("n_layer", "n_head", "n_embd", "vocab_size", "n_positions")})

    def to_dict(self):
        return {"model_type": "gpt2", "n_layer": self.n_layer, "n_head": self.n_head,
                "n_embd": self.n_embd, "vocab_size": self.vocab_size, "n_positions": self.n_positions,
                "n_ctx": self.n_positions, "layer_norm_epsilon": 1e-5,
                "activation_function": "gelu_new", "tie_word_embeddings": True}


class Conv1D(nn.Module):
    """Hugging Face's linear layer: weight (in, out), y = x @ W + b."""

    def __init__(self, n_in, n_out):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_in, n_out))
        self.bias = nn.Parameter(torch.zeros(n_out))

    def forward(self, x):
        return torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.weight).view(*x.shape[:-1], -1)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.n_head, self.n_embd = cfg.n_head, cfg.n_embd
        self.c_attn = Conv1D(cfg.n_embd, 3 * cfg.n_embd)
        self.c_proj = Conv1D(cfg.n_embd, cfg.n_embd)

    def forward(self, x):
        B, T, C = x.shape
        NH, HS = self.n_head, C // self.n_head
        q, k, v = self.c_attn(x).split(C, dim=2)  # [q|k|v]
        # head h takes columns h*HS..(h+1)*HS of q, k and v
        q = q.view(B, T, NH, HS).transpose(1, 2)
        k = k.view(B, T, NH, HS).transpose(1, 2)
        v = v.view(B, T, NH, HS).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(HS))
        mask = torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1)
        att = att.masked_fill(mask, float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).reshape(B, T, C)
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.c_fc = Conv1D(cfg.n_embd, 4 * cfg.n_embd)
        self.c_proj = Conv1D(4 * cfg.n_embd, cfg.n_embd)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, eps=1e-5)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, eps=1e-5)
        self.mlp = MLP(cfg)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT2(nn.Module):
    """Parameter names: Hugging Face GPT-2's without the "transformer." prefix."""

    def __init__(self, cfg):
        super().__init__()
        self.config = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.n_positions, cfg.n_embd)
        self.h = nn.ModuleList([Block(cfg) for _ in range(cfg.n_layer)])
        self.ln_f = nn.LayerNorm(cfg.n_embd, eps=1e-5)

    def forward(self, idx, targets=None):
        B, T = idx.shape
        if T > self.config.n_positions:
            raise ValueError(f"sequence length {T} > n_positions {self.config.n_positions}")
        pos = torch.arange(T, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        x = self.ln_f(x)
        logits = x @ self.wte.weight.t()  # tied head
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1).long())
        return logits, loss

    def load_numpy_(self, weights):
        """Copies {name: array} into the parameters; every parameter must be present, shapes exact."""
        return load_params_(self, weights)


def init_gpt2_(model, seed=0, std=0.02):
    """GPT-2 initialisation: normal(0, 0.02) matrices and embeddings, the residual projections
    (attn.c_proj, mlp.c_proj) scaled by 1/sqrt(2L); zero biases; layer norms weight 1 bias 0."""
    g = torch.Generator().manual_seed(seed)
    L = model.config.n_layer
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                s = std / math.sqrt(2 * L) if name.endswith("c_proj.weight") else std
                p.copy_(torch.randn(p.shape, generator=g) * s)
            elif name.endswith("ln_1.weight") or name.endswith("ln_2.weight") or name == "ln_f.weight":
                p.fill_(1.0)
            else:
                p.zero_()
    return model


# ---------------------------------------------------------------- the program


def build_from_dir(model_dir):
    cfg = GPT2Config.from_json(os.path.join(model_dir, "config.json"))
    weights, _ = load_safetensors(os.path.join(model_dir, "model.safetensors"))
    return GPT2(cfg).load_numpy_(weights), cfg.vocab_size


def main(argv=None):
    return reference_main(argv, __doc__.split("\n\n")[0], "tests/reference/gpt2_reference.py", build_from_dir)


if __name__ == "__main__":
    sys.exit(main())
