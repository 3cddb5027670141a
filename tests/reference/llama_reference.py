#!/usr/bin/python3
"""A plain PyTorch LLaMA: the correctness reference for shardlm's LLaMA (and a speed baseline in bench/).

Run by /usr/bin/python3 (Debian's python3-torch). As a program, the same interface as
gpt2_reference.py:

  llama_reference.py --model-dir DIR --batch BATCH.safetensors --out OUT.safetensors
                     [--adam-steps K --lr LR --beta1 B1 --beta2 B2 --eps EPS
                      --weight-decay WD --grad-clip G] [--dump-params]

  DIR/config.json        Hugging Face LlamaConfig keys, all required: vocab_size, hidden_size,
                         intermediate_size, num_hidden_layers, num_attention_heads,
                         num_key_value_heads, rms_norm_eps, rope_theta, max_position_embeddings,
                         tie_word_embeddings. Where present, model_type must be "llama",
                         hidden_act "silu", attention_bias and mlp_bias false, head_dim
                         hidden_size / num_attention_heads, rope_scaling null or Llama 3.1's
                         ({"rope_type": "llama3", "factor", "low_freq_factor", "high_freq_factor",
                         "original_max_position_embeddings"}).
  DIR/model.safetensors  fp32 weights with Hugging Face LLaMA names, nn.Linear layout (out, in):
                         model.embed_tokens.weight (V, C); per layer N model.layers.N.
                         {input_layernorm, post_attention_layernorm}.weight (C),
                         self_attn.{q_proj (NH*HS, C), k_proj (NKV*HS, C), v_proj (NKV*HS, C),
                         o_proj (C, NH*HS)}.weight, mlp.{gate_proj, up_proj (F, C), down_proj (C, F)}.weight;
                         model.norm.weight (C); lm_head.weight (V, C) unless tie_word_embeddings
                         (then the head is embed_tokens and there is no lm_head tensor).
  BATCH                  "inputs" and "targets", int32 (B, T), ids in [0, V)
  OUT                    "logits" (B,T,V) fp32, "loss" [1] (mean cross-entropy), "grad.<name>"
                         for every parameter of DIR/model.safetensors (at the loaded weights; a
                         tied model's embedding gradient includes the head's), and when K > 0:
                         "adam_losses" [K], "adam_grad_norms" [K] (global norm before clipping);
                         with --dump-params "param.<name>" after the K steps. AdamW as
                         gpt2_reference.py's: decay on the 2-D tensors (embedding, head, all
                         projections), not on the norm weights.

As a module (bench/vs_torch.py imports it): LlamaConfig, Llama, init_llama_, and, shared with
gpt2_reference.py, make_adamw, load_safetensors, save_safetensors.

The model (Hugging Face's LlamaForCausalLM, fp32, no biases, no dropout): token embedding; L
pre-norm blocks x = x + o_proj(attention(rmsnorm(x))), x = x + down_proj(silu(gate_proj(h)) *
up_proj(h)) with h = rmsnorm(x); final rmsnorm; head. RMSNorm(x) = x * rsqrt(mean(x^2) + eps) *
weight. Attention: head h takes rows h*HS..(h+1)*HS of q_proj (k_proj, v_proj likewise for kv
heads); rotary embedding on q and k in the "rotate_half" convention (dimension i pairs with
i + HS/2): inv_freq = 1/theta^(2j/HS) for j < HS/2, angle(t, j) = t * inv_freq[j] for positions
t = 0..T-1, both computed in float32 as Hugging Face does (rope_dtype), Llama 3.1's rescaling
of inv_freq where rope_scaling asks for it (wavelength 2 pi / inv_freq below
original_max_position_embeddings / high_freq_factor: kept; above original_max_position_embeddings
/ low_freq_factor: divided by factor; between: (1 - s) inv_freq / factor + s inv_freq with
s = (original_max_position_embeddings / wavelength - low_freq_factor) / (high_freq_factor -
low_freq_factor)), cos/sin of
cat(angle, angle), q' = q*cos + rotate_half(q)*sin, rotate_half(x) = cat(-x[HS/2:], x[:HS/2]);
grouped-query attention: query head h reads kv head h // (NH/NKV); causal softmax of
q.k / sqrt(HS).
"""
import json
import math
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

from reference_common import (load_params_, load_safetensors, make_adamw,  # noqa: F401
                              reference_main, save_safetensors)

# ---------------------------------------------------------------- configuration


class LlamaConfig:
    # every key config.json must have (Hugging Face LlamaConfig names)
    REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "rms_norm_eps", "rope_theta",
                "max_position_embeddings", "tie_word_embeddings")

    def __init__(self, vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=None, rms_norm_eps=1e-6, rope_theta=10000.0,
                 max_position_embeddings=2048, tie_word_embeddings=False, rope_scaling=None):
        self.vocab_size, self.hidden_size = int(vocab_size), int(hidden_size)
        self.intermediate_size, self.num_hidden_layers = int(intermediate_size), int(num_hidden_layers)
        self.num_attention_heads = int(num_attention_heads)
        self.num_key_value_heads = int(num_attention_heads if num_key_value_heads is None else num_key_value_heads)
        self.rms_norm_eps, self.rope_theta = float(rms_norm_eps), float(rope_theta)
        self.max_position_embeddings = int(max_position_embeddings)
        if not isinstance(tie_word_embeddings, bool):
            raise ValueError(f"tie_word_embeddings must be true or false, not {tie_word_embeddings!r}")
        self.tie_word_embeddings = tie_word_embeddings
        self.rope_scaling = rope_scaling
        if rope_scaling is not None:
            keys = {"rope_type", "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}
            if set(rope_scaling) != keys or rope_scaling["rope_type"] != "llama3":
                raise ValueError(f"rope_scaling {rope_scaling!r}: this reference supports Llama 3.1's, "
                                 f"with exactly the keys {sorted(keys)}")
        for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "max_position_embeddings"):
            if getattr(self, k) <= 0:
                raise ValueError(f"{k} must be positive, not {getattr(self, k)}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not a multiple of num_attention_heads "
                             f"{self.num_attention_heads}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads {self.num_key_value_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head size {self.head_dim} is odd; rotary embedding needs it even")
        if not (self.rms_norm_eps > 0 and self.rope_theta > 0):
            raise ValueError(f"rms_norm_eps {self.rms_norm_eps} and rope_theta {self.rope_theta} must be positive")

    @property
    def head_dim(self):
        return self.hidden_size // self.num_attention_heads

    @classmethod
    def from_dict(cls, d, source="config"):
        missing = [k for k in cls.REQUIRED if k not in d]
        if missing:
            raise ValueError(f"{source}: missing key{'s' if len(missing) > 1 else ''} " +
                             ", ".join(repr(k) for k in missing))
        checks = (("model_type", "llama"), ("hidden_act", "silu"), ("attention_bias", False),
                  ("mlp_bias", False))
        for k, want in checks:
            if k in d and d[k] != want:
                raise ValueError(f"{source}: {k} is {d[k]!r}; this reference supports only {want!r}")
        try:
            cfg = cls(**{k: d[k] for k in cls.REQUIRED}, rope_scaling=d.get("rope_scaling"))
        except (TypeError, ValueError) as e:
            raise ValueError(f"{source}: {e}") from None
        if d.get("head_dim") is not None and int(d["head_dim"]) != cfg.head_dim:
            raise ValueError(f"{source}: head_dim {d['head_dim']} differs from hidden_size / num_attention_heads "
                             f"= {cfg.head_dim}; not supported")
        return cfg

    @classmethod
    def from_json(cls, path):
        with open(path) as f:
            return cls.from_dict(json.load(f), source=path)

    def to_dict(self):
        return {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
                "intermediate_size": self.intermediate_size, "num_hidden_layers": self.num_hidden_layers,
                "num_attention_heads": self.num_attention_heads, "num_key_value_heads": self.num_key_value_heads,
                "rms_norm_eps": self.rms_norm_eps, "rope_theta": self.rope_theta,
                "max_position_embeddings": self.max_position_embeddings,
                "tie_word_embeddings": self.tie_word_embeddings, "hidden_act": "silu",
                "attention_bias": False, "torch_dtype": "float32", "rope_scaling": self.rope_scaling}


# ---------------------------------------------------------------- the model


class RMSNorm(nn.Module):
    def __init__(self, n, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(n))

    def forward(self, x):
        # at least float32 inside, as Hugging Face's (which upcasts half precision)
        h = x.to(torch.promote_types(x.dtype, torch.float32))
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def llama31_rescaled(inv_freq, scaling):
    """Llama 3.1's inv_freq for long context, by wavelength against the original context."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    context = scaling["original_max_position_embeddings"]
    wavelength = 2 * math.pi / inv_freq
    long_waves = wavelength > context / low
    short_waves = wavelength < context / high
    s = (context / wavelength - low) / (high - low)
    between = (1 - s) * inv_freq / factor + s * inv_freq
    return torch.where(long_waves, inv_freq / factor, torch.where(short_waves, inv_freq, between))


def rope_cos_sin(T, head_dim, theta, dtype=torch.float32, scaling=None):
    """cos, sin (T, head_dim) of the rotary angles, computed in `dtype` (Hugging Face: float32)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).to(dtype) / head_dim))
    if scaling is not None:
        inv_freq = llama31_rescaled(inv_freq, scaling)
    angles = torch.outer(torch.arange(T, dtype=torch.int64).to(dtype), inv_freq)  # (T, HS/2)
    emb = torch.cat((angles, angles), dim=-1)
    return emb.cos(), emb.sin()


def rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def apply_rope(x, cos, sin):
    """x (..., T, HS); cos, sin (T, HS)."""
    return x * cos + rotate_half(x) * sin


def repeat_kv(x, n_rep):
    """(B, NKV, T, HS) -> (B, NKV*n_rep, T, HS), kv head j repeated as heads j*n_rep..(j+1)*n_rep-1."""
    if n_rep == 1:
        return x
    B, NKV, T, HS = x.shape
    return x[:, :, None].expand(B, NKV, n_rep, T, HS).reshape(B, NKV * n_rep, T, HS)


class LlamaAttention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        C, NH, NKV, HS = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.n_head, self.n_kv_head, self.head_dim = NH, NKV, HS
        self.q_proj = nn.Linear(C, NH * HS, bias=False)
        self.k_proj = nn.Linear(C, NKV * HS, bias=False)
        self.v_proj = nn.Linear(C, NKV * HS, bias=False)
        self.o_proj = nn.Linear(NH * HS, C, bias=False)

    def forward(self, x, cos, sin):
        B, T, _ = x.shape
        NH, NKV, HS = self.n_head, self.n_kv_head, self.head_dim
        q = self.q_proj(x).view(B, T, NH, HS).transpose(1, 2)
        k = self.k_proj(x).view(B, T, NKV, HS).transpose(1, 2)
        v = self.v_proj(x).view(B, T, NKV, HS).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        k, v = repeat_kv(k, NH // NKV), repeat_kv(v, NH // NKV)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(HS))
        mask = torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1)
        att = att.masked_fill(mask, float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).reshape(B, T, NH * HS)
        return self.o_proj(y)


class LlamaMLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        C, Fd = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = nn.Linear(C, Fd, bias=False)
        self.up_proj = nn.Linear(C, Fd, bias=False)
        self.down_proj = nn.Linear(Fd, C, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = LlamaAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = LlamaMLP(cfg)

    def forward(self, x, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList([LlamaDecoderLayer(cfg) for _ in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Llama(nn.Module):
    """Parameter names: Hugging Face LlamaForCausalLM's ("model.…", "lm_head.weight" unless tied).

    rope_dtype: the dtype the rotary angles and their cos/sin are computed in before being cast
    to the activations' dtype; float32 as Hugging Face (a float64 model may set float64)."""

    def __init__(self, cfg, rope_dtype=torch.float32):
        super().__init__()
        self.config = cfg
        self.rope_dtype = rope_dtype
        self.model = LlamaModel(cfg)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def head_weight(self):
        return self.model.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight

    def forward(self, idx, targets=None):
        B, T = idx.shape
        cfg = self.config
        if T > cfg.max_position_embeddings:
            raise ValueError(f"sequence length {T} > max_position_embeddings {cfg.max_position_embeddings}")
        x = self.model.embed_tokens(idx)
        cos, sin = rope_cos_sin(T, cfg.head_dim, cfg.rope_theta, self.rope_dtype, cfg.rope_scaling)
        cos, sin = cos.to(device=x.device, dtype=x.dtype), sin.to(device=x.device, dtype=x.dtype)
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        x = self.model.norm(x)
        logits = F.linear(x, self.head_weight())
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1).long())
        return logits, loss

    def load_numpy_(self, weights):
        """Copies {name: array} into the parameters; every parameter must be present (and no
        lm_head.weight for a tied model), shapes exact."""
        return load_params_(self, weights)


def init_llama_(model, seed=0, std=0.02):
    """Hugging Face's LLaMA initialisation: normal(0, std) for every matrix and the embedding
    (initializer_range 0.02, no residual scaling); RMSNorm weights 1."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=g) * std)
            else:
                p.fill_(1.0)
    return model


# ---------------------------------------------------------------- the program


def build_from_dir(model_dir):
    try:
        cfg = LlamaConfig.from_json(os.path.join(model_dir, "config.json"))
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    weights, _ = load_safetensors(os.path.join(model_dir, "model.safetensors"))
    return Llama(cfg).load_numpy_(weights), cfg.vocab_size


def main(argv=None):
    return reference_main(argv, __doc__.split("\n\n")[0], "tests/reference/llama_reference.py", build_from_dir)


if __name__ == "__main__":
    sys.exit(main())
