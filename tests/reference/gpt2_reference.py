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
import argparse
import json
import math
import os
import struct
import sys

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

# ---------------------------------------------------------------- safetensors by hand

_ST_TO_NP = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "I64": np.int64,
             "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "U16": np.uint16,
             "U32": np.uint32, "U64": np.uint64, "BOOL": np.bool_, "BF16": np.uint16}
_NP_TO_ST = {np.dtype(np.float64): "F64", np.dtype(np.float32): "F32", np.dtype(np.float16): "F16",
             np.dtype(np.int64): "I64", np.dtype(np.int32): "I32", np.dtype(np.int16): "I16",
             np.dtype(np.int8): "I8", np.dtype(np.uint8): "U8", np.dtype(np.bool_): "BOOL"}


def load_safetensors(path):
    """Returns ({name: numpy array}, metadata). BF16 tensors are widened to float32."""
    with open(path, "rb") as f:
        raw = f.read()
    if len(raw) < 8:
        raise ValueError(f"{path}: too short for a safetensors file")
    (n,) = struct.unpack("<Q", raw[:8])
    if n > len(raw) - 8:
        raise ValueError(f"{path}: header length {n} beyond the file")
    header = json.loads(raw[8:8 + n].decode("utf-8"))
    data = memoryview(raw)[8 + n:]
    meta = header.pop("__metadata__", {}) or {}
    out = {}
    for name, e in header.items():
        begin, end = e["data_offsets"]
        if not 0 <= begin <= end <= len(data):
            raise ValueError(f"{path}: tensor {name}: data_offsets out of range")
        dt = e["dtype"]
        if dt not in _ST_TO_NP:
            raise ValueError(f"{path}: tensor {name}: unsupported dtype {dt}")
        arr = np.frombuffer(data[begin:end], dtype=np.dtype(_ST_TO_NP[dt]).newbyteorder("<"))
        if dt == "BF16":
            arr = (arr.astype(np.uint32) << 16).view(np.float32)
        out[name] = arr.reshape(e["shape"]).copy()
    return out, meta


def save_safetensors(path, tensors, metadata=None):
    """tensors: {name: numpy array or torch tensor}. Writes path + ".tmp", then renames."""
    arrays = {}
    for name, t in tensors.items():
        if isinstance(t, torch.Tensor):
            t = t.detach().cpu().numpy()
        a = np.ascontiguousarray(t)
        if a.dtype not in _NP_TO_ST:
            raise ValueError(f"{path}: tensor {name}: dtype {a.dtype} not supported")
        arrays[name] = a.astype(a.dtype.newbyteorder("<"), copy=False)
    # Largest element first, then by name: keeps every tensor aligned to its element size.
    order = sorted(arrays, key=lambda k: (-arrays[k].dtype.itemsize, k))
    header = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    off = 0
    for name in order:
        nb = arrays[name].nbytes
        header[name] = {"dtype": _NP_TO_ST[np.dtype(arrays[name].dtype.newbyteorder("="))],
                        "shape": list(arrays[name].shape), "data_offsets": [off, off + nb]}
        off += nb
    h = json.dumps(header, separators=(",", ":")).encode("utf-8")
    h += b" " * ((8 - (8 + len(h)) % 8) % 8)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for name in order:
            f.write(arrays[name].tobytes())
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


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
        params = dict(self.named_parameters())
        missing = sorted(set(params) - set(weights))
        extra = sorted(set(weights) - set(params))
        if missing or extra:
            raise ValueError(f"weights do not match the model: missing {missing[:5]}, unexpected {extra[:5]}")
        with torch.no_grad():
            for name, p in params.items():
                w = weights[name]
                if tuple(w.shape) != tuple(p.shape):
                    raise ValueError(f"{name}: shape {tuple(w.shape)}, model wants {tuple(p.shape)}")
                p.copy_(torch.from_numpy(np.asarray(w)).to(p.dtype))


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


def make_adamw(model, lr, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0):
    """AdamW with weight decay on the 2-D tensors only (matrices, wte, wpe)."""
    decay = [p for _, p in model.named_parameters() if p.dim() == 2]
    no_decay = [p for _, p in model.named_parameters() if p.dim() != 2]
    groups = [{"params": decay, "weight_decay": weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(beta1, beta2), eps=eps)


# ---------------------------------------------------------------- the program


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--batch", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--adam-steps", type=int, default=0)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--beta1", type=float, default=0.9)
    ap.add_argument("--beta2", type=float, default=0.999)
    ap.add_argument("--eps", type=float, default=1e-8)
    ap.add_argument("--weight-decay", type=float, default=0.0)
    ap.add_argument("--grad-clip", type=float, default=0.0, help="max global grad norm; 0 = off")
    ap.add_argument("--dump-params", action="store_true", help="also write param.<name> after the Adam steps")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cfg = GPT2Config.from_json(os.path.join(args.model_dir, "config.json"))
    weights, _ = load_safetensors(os.path.join(args.model_dir, "model.safetensors"))
    model = GPT2(cfg)
    model.load_numpy_(weights)

    batch, _ = load_safetensors(args.batch)
    for key in ("inputs", "targets"):
        if key not in batch:
            raise SystemExit(f"{args.batch}: no tensor '{key}'")
    inputs = torch.from_numpy(batch["inputs"].astype(np.int64))
    targets = torch.from_numpy(batch["targets"].astype(np.int64))
    if inputs.dim() != 2 or inputs.shape != targets.shape:
        raise SystemExit(f"{args.batch}: inputs {tuple(inputs.shape)} and targets {tuple(targets.shape)} must be equal (B,T)")
    V = cfg.vocab_size
    for key, t in (("inputs", inputs), ("targets", targets)):
        if t.numel() and (int(t.min()) < 0 or int(t.max()) >= V):
            raise SystemExit(f"{args.batch}: {key} holds ids outside [0, {V})")

    out = {}
    logits, loss = model(inputs, targets)
    loss.backward()
    out["logits"] = logits.detach().numpy().astype(np.float32)
    out["loss"] = np.array([loss.item()], dtype=np.float32)
    for name, p in model.named_parameters():
        out["grad." + name] = p.grad.detach().numpy().astype(np.float32).copy()

    if args.adam_steps > 0:
        opt = make_adamw(model, args.lr, args.beta1, args.beta2, args.eps, args.weight_decay)
        losses, norms = [], []
        for _ in range(args.adam_steps):
            opt.zero_grad(set_to_none=True)
            _, loss = model(inputs, targets)
            loss.backward()
            losses.append(loss.item())
            if args.grad_clip > 0:
                norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
            else:
                norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))
            norms.append(float(norm))
            opt.step()
        out["adam_losses"] = np.array(losses, dtype=np.float32)
        out["adam_grad_norms"] = np.array(norms, dtype=np.float32)
        if args.dump_params:
            for name, p in model.named_parameters():
                out["param." + name] = p.detach().numpy().astype(np.float32).copy()

    save_safetensors(args.out, out, {"producer": "tests/reference/gpt2_reference.py",
                                     "torch": torch.__version__})
    return 0


if __name__ == "__main__":
    sys.exit(main())
