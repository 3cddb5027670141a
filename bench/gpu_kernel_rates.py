#!/usr/bin/env python3
"""Kernel rates of one GPU at the shapes of the published H100 runs (bench/published_runs.py), as
eager PyTorch runs them in bf16: the raw measurements bench/gpu_profile_from_rates.py turns into a
hardware profile (gemm_rates, attention_rates, pointwise_bw) for `shardlm simulate`.

  python3 bench/gpu_kernel_rates.py --out rates.json            # on the GPU, about a minute
  /usr/bin/python3 bench/gpu_kernel_rates.py --cpu-smoke --out /tmp/smoke.json   # tiny shapes on CPU
  /usr/bin/python3 bench/gpu_kernel_rates.py --fake-h100 --out /tmp/fake.json    # no run: invented times

For each distinct (model, micro-batch B, sequence T) of the H100 rows of bench/published_runs.py:
  gemms      each weight GEMM the simulator counts (src/model/{llama,gpt2}.cc UnitCosts::gemms),
             forward (F.linear) and backward (autograd: the input's and the weight's gradients), as
             the run's framework issues it: torchtitan splits q|k|v into wq, wk, wv and gate|up into
             w1, w3; fms-fsdp and llm-foundry fuse them (one GEMM each). The head's vocabulary GEMM too.
  attention  F.scaled_dot_product_attention, causal, flash backend, on (B, NH, T, HS) views of
             (B, T, NH, HS) tensors (keys and values repeated to NH heads first, as repeat_kv does),
             forward and backward.
  block      one transformer block forward and backward (autograd, every weight's gradient and the
             input's), eager, written as the frameworks write it: Llama (torchtitan / Meta reference):
             RMSNorm as x.float() * rsqrt(mean(x^2) + eps), type_as, * weight; rotary embedding
             through view_as_complex in fp32; repeat_kv; SDPA; SwiGLU silu(w1 x) * w3 x; residual
             adds. MPT (llm-foundry): bf16 LayerNorm without bias, fused Wqkv, SDPA, GELU MLP,
             residual adds. Also its forward alone (with autograd recording, as a recompute runs it).
  pointwise  the same block with every GEMM and the attention taken out (their outputs are leaf
             tensors): its norms, rotary, activation, residual adds, casts and layout copies alone,
             forward and backward.
  head       final norm, vocabulary GEMM, .float(), cross-entropy, forward and backward.
And for reference: a device-to-device copy, an 8192^3 bf16 GEMM, a fused AdamW step.

Times are CUDA-event medians after warm-up (perf_counter on CPU). The JSON is rewritten after each
model, so a run cut short still leaves what it measured. No rate is computed here: the converter
applies the simulator's own FLOP and byte counts.
"""
import argparse
import datetime
import importlib.util
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
SCHEMA = "shardlm-gpu-kernel-rates/1"

# The Llama presets' dimensions as src/model/model.cc defines them: (L, C, NH, NKV, F, V).
LLAMA = {
    "llama2-7b": (32, 4096, 32, 32, 11008, 32000),
    "llama2-13b": (40, 5120, 40, 40, 13824, 32000),
    "llama2-70b": (80, 8192, 64, 8, 28672, 32000),
    "llama3-8b": (32, 4096, 32, 8, 14336, 128256),
    "llama3-70b": (80, 8192, 64, 8, 28672, 128256),
}


def flag(flags, name, default=None):
    return flags[flags.index(name) + 1] if name in flags else default


def published_shapes():
    """The distinct model shapes of bench/published_runs.py's H100 rows, each with the framework
    that ran it (torchtitan splits its projections, fms-fsdp and llm-foundry fuse them)."""
    spec = importlib.util.spec_from_file_location("published_runs", os.path.join(HERE, "published_runs.py"))
    pr = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pr)
    shapes, seen = [], set()
    for label, _, source, _, flags in pr.RUNS:
        if flag(flags, "--hardware") != "h100-80gb":
            continue
        model, B, T = flag(flags, "--model"), int(flag(flags, "--batch")), int(flag(flags, "--seq"))
        if model in LLAMA:
            L, C, NH, NKV, Fd, V = LLAMA[model]
            family, name = "llama", model
        else:  # the GPT-2 family with MPT's dimensions (published_runs.MPT7 / MPT13)
            L, C, NH = int(flag(flags, "--n-layer")), int(flag(flags, "--n-embd")), int(flag(flags, "--n-head"))
            NKV, Fd, V = NH, 4 * C, int(flag(flags, "--vocab"))
            family, name = "gpt2", {4096: "mpt-7b", 5120: "mpt-13b"}.get(C, f"gpt2-{C}")
        split = "torchtitan" in source.lower()
        key = (name, B, T)
        if key in seen:
            continue
        seen.add(key)
        shapes.append(dict(name=name, family=family, B=B, T=T, C=C, NH=NH, NKV=NKV, HS=C // NH, F=Fd, V=V,
                           split=split, L=L,
                           framework="torchtitan" if split else ("llm-foundry" if family == "gpt2" else "fms-fsdp"),
                           rows=[label]))
    return shapes


def smoke_shapes(shapes):
    """The same models shrunk for a CPU dry run (same head ratios, kinds and frameworks)."""
    out = []
    for s in shapes:
        s = dict(s)
        NH = 4
        NKV = max(1, NH * s["NKV"] // s["NH"])
        s.update(NH=NH, NKV=NKV, HS=16, C=64, F=(172 if s["family"] == "llama" else 256), V=500, B=2,
                 T=64 if s["T"] <= 4096 else 128)
        out.append(s)
    return out


class CpuEvent:
    """torch.cuda.Event's interface on the host clock: the CPU dry run takes the GPU's code path."""

    def __init__(self, enable_timing=True):
        self.t = None

    def record(self):
        self.t = time.perf_counter()

    def synchronize(self):
        pass

    def elapsed_time(self, end):
        return (end.t - self.t) * 1e3  # milliseconds, as CUDA's


class Timer:
    """Median seconds of a callable between two events (CUDA's on a GPU). `setup` runs before each
    timed call, outside the timed span (its result is the call's argument)."""

    def __init__(self, device, target_s, min_reps, max_reps):
        self.cuda = device.type == "cuda"
        self.Event = torch.cuda.Event if self.cuda else CpuEvent
        self.target_s, self.min_reps, self.max_reps = target_s, min_reps, max_reps
        self.scale = 1.0  # the budget shrinks the reps

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def _once(self, fn, setup):
        arg = setup() if setup else None
        self.sync()
        a, b = self.Event(enable_timing=True), self.Event(enable_timing=True)
        a.record()
        fn(arg)
        b.record()
        b.synchronize()
        return a.elapsed_time(b) / 1e3

    def median(self, fn, setup=None, warmup=2):
        for _ in range(warmup):
            self._once(fn, setup)
        first = self._once(fn, setup)
        reps = int(min(self.max_reps, max(self.min_reps, self.target_s / max(first, 1e-6))) * self.scale)
        reps = max(3, reps)
        starts = [self.Event(enable_timing=True) for _ in range(reps)]
        ends = [self.Event(enable_timing=True) for _ in range(reps)]
        for i in range(reps):
            arg = setup() if setup else None
            starts[i].record()
            fn(arg)
            ends[i].record()
            del arg
        self.sync()
        return statistics.median([a.elapsed_time(b) / 1e3 for a, b in zip(starts, ends)]), reps


# ---- the pointwise pieces, as the frameworks write them -------------------------------------

def rmsnorm(x, w, eps=1e-5):
    """torchtitan / Meta's Llama reference RMSNorm: fp32 normalisation, cast back, scale."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).type_as(x) * w


def rope_table(T, HS, theta, device):
    freqs = 1.0 / (theta ** (torch.arange(0, HS, 2, device=device)[: HS // 2].float() / HS))
    t = torch.arange(T, device=device, dtype=torch.float32)
    return torch.polar(torch.ones(T, HS // 2, device=device), torch.outer(t, freqs))  # complex64 (T, HS/2)


def rope(xq, xk, freqs_cis):
    """torchtitan's apply_rotary_emb: (B, T, H, HS) through complex fp32, cast back."""
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    f = freqs_cis.view(1, xq_.shape[1], 1, xq_.shape[-1])
    return torch.view_as_real(xq_ * f).flatten(3).type_as(xq), torch.view_as_real(xk_ * f).flatten(3).type_as(xk)


def repeat_kv(x, n_rep):
    if n_rep == 1:
        return x
    B, T, H, HS = x.shape
    return x.unsqueeze(3).expand(B, T, H, n_rep, HS).reshape(B, T, H * n_rep, HS)


def sdpa(q, k, v):
    """(B, H, T, HS) causal attention: SDPA where this torch has it (the flash backend is chosen by
    the caller), else the plain formula (the CPU dry run's old torch)."""
    if hasattr(F, "scaled_dot_product_attention"):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    T = q.shape[-2]
    s = (q.float() @ k.float().transpose(-1, -2)) / math.sqrt(q.shape[-1])
    s = s.masked_fill(torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    return (s.softmax(-1) @ v.float()).type_as(q)


class Shapes:
    """One model's dimensions and the weights of one block (bf16)."""

    def __init__(self, s, device, dtype):
        self.__dict__.update(s)
        self.device, self.dtype = device, dtype
        self.M = self.B * self.T
        self.QKV = (self.NH + 2 * self.NKV) * self.HS

    def rand(self, *shape, std=1.0, grad=False):
        t = torch.randn(*shape, device=self.device, dtype=self.dtype) * std
        return t.requires_grad_(grad)

    def projections(self):
        """The block's weight GEMMs as (role, simulator key (M, K, N), the GEMMs the framework runs)."""
        M, C, F_, QKV = self.M, self.C, self.F, self.QKV
        kv = self.NKV * self.HS
        if self.family == "llama":
            qkv = [(M, C, C), (M, C, kv), (M, C, kv)] if self.split else [(M, C, QKV)]
            up = [(M, C, F_), (M, C, F_)] if self.split else [(M, C, 2 * F_)]
            return [("qkv", (M, C, QKV), qkv), ("o", (M, C, C), [(M, C, C)]), ("gate_up", (M, C, 2 * F_), up),
                    ("down", (M, F_, C), [(M, F_, C)])]
        return [("qkv", (M, C, 3 * C), [(M, C, 3 * C)]), ("o", (M, C, C), [(M, C, C)]),
                ("fc", (M, C, F_), [(M, C, F_)]), ("proj", (M, F_, C), [(M, F_, C)])]


class Block(torch.nn.Module):
    """One block as the run's framework writes it (see the module docstring)."""

    def __init__(self, m):
        super().__init__()
        self.m = m
        w = lambda n, k: torch.nn.Parameter(m.rand(n, k, std=0.02))
        ones = lambda n: torch.nn.Parameter(torch.ones(n, device=m.device, dtype=m.dtype))
        C, kv = m.C, m.NKV * m.HS
        self.n1, self.n2 = ones(C), ones(C)
        if m.family == "llama" and m.split:
            self.wq, self.wk, self.wv = w(C, C), w(kv, C), w(kv, C)
            self.w1, self.w3 = w(m.F, C), w(m.F, C)
        elif m.family == "llama":
            self.wqkv, self.w13 = w(m.QKV, C), w(2 * m.F, C)
        else:
            self.wqkv, self.w_up = w(3 * C, C), w(m.F, C)
        self.wo, self.w_down = w(C, C), w(C, m.F)

    def norm(self, x, w):
        return rmsnorm(x, w) if self.m.family == "llama" else F.layer_norm(x, (self.m.C,), w, None, 1e-5)

    def qkv(self, h):
        m = self.m
        if m.family == "llama" and m.split:
            return F.linear(h, self.wq), F.linear(h, self.wk), F.linear(h, self.wv)
        kv = m.NKV * m.HS
        return F.linear(h, self.wqkv).split([m.NH * m.HS, kv, kv], dim=-1)

    def forward(self, x, freqs_cis):
        m = self.m
        B, T = x.shape[:2]
        q, k, v = self.qkv(self.norm(x, self.n1))
        q, k, v = q.view(B, T, m.NH, m.HS), k.view(B, T, m.NKV, m.HS), v.view(B, T, m.NKV, m.HS)
        if m.family == "llama":
            q, k = rope(q, k, freqs_cis)
        k, v = repeat_kv(k, m.NH // m.NKV), repeat_kv(v, m.NH // m.NKV)
        o = sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        h = x + F.linear(o.transpose(1, 2).contiguous().view(B, T, -1), self.wo)
        n = self.norm(h, self.n2)
        if m.family == "llama" and m.split:
            a = F.silu(F.linear(n, self.w1)) * F.linear(n, self.w3)
        elif m.family == "llama":
            g, u = F.linear(n, self.w13).chunk(2, dim=-1)
            a = F.silu(g) * u
        else:
            a = F.gelu(F.linear(n, self.w_up))
        return h + F.linear(a, self.w_down)


def pointwise_only(m, blk, freqs_cis):
    """The block's forward with each GEMM's and the attention's output a leaf tensor: returns the
    leaves (their gradients are the backward's outputs) and a function running the forward, which
    returns (outputs, gradients for them): every tensor a GEMM or the attention would read."""
    B, T, C, kv = m.B, m.T, m.C, m.NKV * m.HS
    x = m.rand(B, T, C, grad=True)
    if m.family == "llama" and m.split:
        qkv_out = [m.rand(B, T, C, grad=True), m.rand(B, T, kv, grad=True), m.rand(B, T, kv, grad=True)]
    else:
        qkv_out = [m.rand(B, T, m.QKV if m.family == "llama" else 3 * C, grad=True)]
    attn_out = m.rand(B, m.NH, T, m.HS, grad=True)  # SDPA's output, (B, NH, T, HS) as it writes it
    wo_out = m.rand(B, T, C, grad=True)
    if m.family == "llama" and m.split:
        up_out = [m.rand(B, T, m.F, grad=True), m.rand(B, T, m.F, grad=True)]
    else:
        up_out = [m.rand(B, T, 2 * m.F if m.family == "llama" else m.F, grad=True)]
    down_out = m.rand(B, T, C, grad=True)
    leaves = [x] + qkv_out + [attn_out, wo_out] + up_out + [down_out] + [blk.n1, blk.n2]

    def forward():
        outs = []
        outs.append(blk.norm(x, blk.n1))  # read by the q|k|v GEMM(s)
        if len(qkv_out) == 3:
            q, k, v = qkv_out
        else:
            q, k, v = qkv_out[0].split([m.NH * m.HS, kv, kv], dim=-1)
        q, k, v = q.view(B, T, m.NH, m.HS), k.view(B, T, m.NKV, m.HS), v.view(B, T, m.NKV, m.HS)
        if m.family == "llama":
            q, k = rope(q, k, freqs_cis)
        k, v = repeat_kv(k, m.NH // m.NKV), repeat_kv(v, m.NH // m.NKV)
        outs += [q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)]  # read by the attention
        outs.append(attn_out.transpose(1, 2).contiguous().view(B, T, -1))  # read by the o GEMM
        h = x + wo_out
        outs.append(blk.norm(h, blk.n2))  # read by the up GEMM(s)
        if len(up_out) == 2:
            outs.append(F.silu(up_out[0]) * up_out[1])
        elif m.family == "llama":
            g, u = up_out[0].chunk(2, dim=-1)
            outs.append(F.silu(g) * u)
        else:
            outs.append(F.gelu(up_out[0]))
        outs.append(h + down_out)  # the block's output
        return outs

    return leaves, forward


def head_forward(m, h, w_norm, w_out, labels):
    n = rmsnorm(h, w_norm) if m.family == "llama" else F.layer_norm(h, (m.C,), w_norm, None, 1e-5)
    logits = F.linear(n, w_out).float()
    return F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1))


def attention_backend(device, HS, dtype):
    """A context choosing SDPA's flash kernel (what these runs used on H100), or nothing on CPU;
    SDPA's own choice where flash refuses the shape (said in the backend's name)."""
    import contextlib
    if device.type != "cuda":
        return contextlib.nullcontext, "cpu"
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
        ctx, name = (lambda: sdpa_kernel([SDPBackend.FLASH_ATTENTION])), "flash (sdpa_kernel FLASH_ATTENTION)"
    except ImportError:
        ctx = lambda: torch.backends.cuda.sdp_kernel(enable_flash=True, enable_math=False, enable_mem_efficient=False)
        name = "flash (sdp_kernel)"
    try:
        q = torch.randn(1, 2, 256, HS, device=device, dtype=dtype, requires_grad=True)
        with ctx():
            sdpa(q, q, q).sum().backward()
        return ctx, name
    except RuntimeError as e:
        return contextlib.nullcontext, f"SDPA default (flash refused: {str(e).splitlines()[0][:120]})"


def measure_model(s, device, dtype, timer, log):
    m = Shapes(s, device, dtype)
    out = dict(s)
    out.update(M=m.M, QKV=m.QKV)

    # (a) the weight GEMMs, forward and backward, one GEMM shape at a time.
    gemm_cache = {}

    def gemm(M, K, N):
        if (M, K, N) in gemm_cache:
            return gemm_cache[(M, K, N)]
        x, w, dy = m.rand(M, K, grad=True), m.rand(N, K, std=0.02, grad=True), m.rand(M, N)
        fwd, rf = timer.median(lambda _: F.linear(x, w))
        bwd, rb = timer.median(lambda y: torch.autograd.grad(y, (x, w), dy), setup=lambda: F.linear(x, w))
        del x, w, dy
        gemm_cache[(M, K, N)] = (fwd, bwd, rf, rb)
        return gemm_cache[(M, K, N)]

    out["gemms"] = []
    for role, key, pieces in m.projections() + [("head", (m.M, m.C, m.V), [(m.M, m.C, m.V)])]:
        times = [gemm(*p) for p in pieces]
        out["gemms"].append(dict(role=role, key=list(key), pieces=[list(p) for p in pieces],
                                 forward_s=sum(t[0] for t in times), backward_s=sum(t[1] for t in times),
                                 reps=min(min(t[2], t[3]) for t in times)))
    log(f"  gemms: " + ", ".join(f"{g['role']} {g['forward_s'] * 1e3:.2f}+{g['backward_s'] * 1e3:.2f} ms"
                                  for g in out["gemms"]))

    ctx, backend = attention_backend(device, m.HS, dtype)
    with ctx():
        # (b) attention: q, k, v as (B, T, NH, HS) seen as (B, NH, T, HS), keys and values repeated.
        q, k, v = (m.rand(m.B, m.T, m.NH, m.HS, grad=True) for _ in range(3))
        do = m.rand(m.B, m.NH, m.T, m.HS)
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
        fwd, _ = timer.median(lambda _: sdpa(qt, kt, vt))
        bwd, reps = timer.median(lambda o: torch.autograd.grad(o, (q, k, v), do), setup=lambda: sdpa(qt, kt, vt))
        out["attention"] = dict(B=m.B, NH=m.NH, T=m.T, HS=m.HS, forward_s=fwd, backward_s=bwd, reps=reps, backend=backend)
        del q, k, v, do, qt, kt, vt
        log(f"  attention: {fwd * 1e3:.2f} + {bwd * 1e3:.2f} ms ({backend})")

        # (c) the whole block, and its pointwise work alone.
        blk = Block(m)
        params = list(blk.parameters())
        freqs = rope_table(m.T, m.HS, 500000.0 if m.name.startswith("llama3") else 10000.0, device)
        x = m.rand(m.B, m.T, m.C, grad=True)
        dy = m.rand(m.B, m.T, m.C)
        fwd, _ = timer.median(lambda _: blk(x, freqs))
        both, reps = timer.median(lambda _: torch.autograd.grad(blk(x, freqs), [x] + params, dy))
        out["block"] = dict(forward_s=fwd, fwd_bwd_s=both, reps=reps)
        del x, dy
        log(f"  block: forward {fwd * 1e3:.2f} ms, forward+backward {both * 1e3:.2f} ms")

        leaves, forward = pointwise_only(m, blk, freqs)
        grads = [torch.randn_like(o) for o in forward()]

        def run(_):
            torch.autograd.grad(forward(), leaves, grads)

        fwd, _ = timer.median(lambda _: forward())
        both, reps = timer.median(run)
        out["pointwise"] = dict(forward_s=fwd, fwd_bwd_s=both, reps=reps)
        del leaves, forward, grads, blk, params
        log(f"  pointwise alone: forward {fwd * 1e3:.2f} ms, forward+backward {both * 1e3:.2f} ms")

    # The head: final norm, vocabulary GEMM, fp32 logits, cross-entropy; forward and backward.
    try:
        h = m.rand(m.B, m.T, m.C, grad=True)
        w_norm = torch.ones(m.C, device=device, dtype=dtype, requires_grad=True)
        w_out = m.rand(m.V, m.C, std=0.02, grad=True)
        labels = torch.randint(0, m.V, (m.B, m.T), device=device)
        both, reps = timer.median(lambda _: torch.autograd.grad(head_forward(m, h, w_norm, w_out, labels), (h, w_norm, w_out)),
                                  warmup=1)
        out["head"] = dict(fwd_bwd_s=both, reps=reps)
        log(f"  head: forward+backward {both * 1e3:.2f} ms")
    except RuntimeError as e:  # torch.cuda.OutOfMemoryError is one
        out["head"] = dict(error=str(e).splitlines()[0])
        log(f"  head: {out['head']['error']}")
    finally:
        h = w_out = None
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return out


def reference(device, dtype, timer, smoke, log):
    ref = {}
    n = (1 << 20) if smoke else (1 << 29)  # bf16 elements: 1 GiB a buffer on the GPU
    a = torch.empty(n, device=device, dtype=dtype).normal_()
    b = torch.empty_like(a)
    t, reps = timer.median(lambda _: b.copy_(a))
    ref["copy"] = dict(bytes_each_way=a.numel() * a.element_size(), seconds=t, reps=reps,
                       note="read + write: 2 x bytes_each_way per copy")
    del a, b
    S = 256 if smoke else 8192
    x, w = torch.randn(S, S, device=device, dtype=dtype), torch.randn(S, S, device=device, dtype=dtype)
    t, reps = timer.median(lambda _: x @ w)
    ref["gemm"] = dict(m=S, k=S, n=S, seconds=t, reps=reps, layout="x @ w, both row-major")
    t, reps = timer.median(lambda _: F.linear(x, w))
    ref["gemm_nt"] = dict(m=S, k=S, n=S, seconds=t, reps=reps, layout="F.linear(x, w): x @ w.T")
    del x, w
    # A fused AdamW step over fp32 parameters (the frameworks' sharded optimizer state).
    N = (1 << 16) if smoke else (1 << 27)
    p = torch.zeros(N, device=device, dtype=torch.float32, requires_grad=True)
    p.grad = torch.randn_like(p)
    fused = device.type == "cuda"
    opt = torch.optim.AdamW([p], lr=1e-4, **({"fused": True} if fused else {}))
    t, reps = timer.median(lambda _: opt.step())
    ref["adamw"] = dict(params=N, dtype="fp32", fused=fused, seconds=t, reps=reps)
    del p, opt
    log(f"reference: copy {2 * ref['copy']['bytes_each_way'] / ref['copy']['seconds'] / 1e9:.0f} GB/s, "
        f"GEMM {2 * S ** 3 / ref['gemm']['seconds'] / 1e12:.0f} TFLOP/s, "
        f"AdamW {28 * N / ref['adamw']['seconds'] / 1e9:.0f} GB/s (28 B/param)")
    return ref


def sustained_gemm(device, dtype, seconds, smoke, timer, log):
    """A block-sized GEMM back to back for `seconds` (the GPU at training's steady power and clocks,
    not a short burst's): its rate in each quarter of the span, and timed the way every other figure
    here is (the median of a short burst) just before."""
    M, K, N = (256, 256, 256) if smoke else (8192, 4096, 14336)
    x, w = torch.randn(M, K, device=device, dtype=dtype), torch.randn(N, K, device=device, dtype=dtype)
    burst, _ = timer.median(lambda _: F.linear(x, w))
    cuda = device.type == "cuda"
    batch = 20
    windows, t0 = [], time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
        c0 = time.perf_counter()
        for _ in range(batch):
            F.linear(x, w)
        if cuda:
            b.record()
            b.synchronize()
            windows.append((time.perf_counter() - t0, a.elapsed_time(b) / 1e3))
        else:
            windows.append((time.perf_counter() - t0, time.perf_counter() - c0))
    flops = 2.0 * M * K * N * batch
    q = max(1, len(windows) // 4)
    quarters = [flops * len(windows[i:i + q]) / sum(w[1] for w in windows[i:i + q]) for i in range(0, len(windows), q)][:4]
    log(f"sustained {M}x{K}x{N} GEMM over {windows[-1][0]:.1f} s: " + ", ".join(f"{r / 1e12:.0f}" for r in quarters) +
        f" TFLOP/s (burst median {2.0 * M * K * N / burst / 1e12:.0f})")
    return dict(m=M, k=K, n=N, seconds=windows[-1][0], quarters_flops_per_s=quarters,
                first_window_flops_per_s=flops / windows[0][1], burst_flops_per_s=2.0 * M * K * N / burst)


def nvidia_smi():
    try:
        q = "name,clocks.max.sm,clocks.sm,clocks.max.mem,power.limit,power.max_limit,power.draw,temperature.gpu,memory.total,mig.mode.current,driver_version"
        return subprocess.run(["nvidia-smi", f"--query-gpu={q}", "--format=csv"], capture_output=True, text=True,
                              timeout=15).stdout.strip()
    except Exception as e:  # the figures stand without it
        return f"unavailable: {e}"


def device_info(device):
    info = dict(type=device.type, torch=torch.__version__, python=platform.python_version())
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        info.update(name=p.name, sm_count=p.multi_processor_count, total_memory=p.total_memory,
                    capability=list(torch.cuda.get_device_capability(device)), cuda=torch.version.cuda,
                    cudnn=torch.backends.cudnn.version())
        info["nvidia_smi"] = nvidia_smi()
    else:
        info.update(name=f"CPU ({platform.processor() or platform.machine()})", threads=torch.get_num_threads())
    return info


def fake_h100(shapes):
    """Invented times at the real shapes, for proving the pipeline without a GPU: GEMMs at 640 (forward)
    and 600 (backward) TFLOP/s, a little less for the smallest, attention at 330 / 260, the pointwise
    work at 0.9 TB/s (Llama) or 1.6 TB/s (MPT) of the bytes the simulator counts, the head's at
    1.2 TB/s. Nothing here is a measurement."""
    models = []
    for s in shapes:
        m = Shapes(s, torch.device("cpu"), torch.bfloat16)
        o = dict(s)
        o.update(M=m.M, QKV=m.QKV, gemms=[])
        gemm_s = 0
        for role, key, pieces in m.projections() + [("head", (m.M, m.C, m.V), [(m.M, m.C, m.V)])]:
            f = sum(2 * a * b * c for a, b, c in pieces)
            small = 0.92 if min(key) < 4096 else 1.0
            g = dict(role=role, key=list(key), pieces=[list(p) for p in pieces], forward_s=f / (640e12 * small),
                     backward_s=2 * f / (600e12 * small), reps=10)
            o["gemms"].append(g)
            if role != "head":
                gemm_s += g["forward_s"] + g["backward_s"]
        af = 2 * m.B * m.T * m.T * m.C
        o["attention"] = dict(B=m.B, NH=m.NH, T=m.T, HS=m.HS, forward_s=af / 330e12, backward_s=2 * af / 260e12, reps=10,
                              backend="fake")
        e, BT = 4, m.M
        if m.family == "llama":
            P = (8 * BT * m.C + 2 * BT * (m.NH + m.NKV) * m.HS + 3 * BT * m.F) * e
            bw = 0.9e12
        else:
            P = (8 * BT * m.C + 2 * BT * m.F) * e
            bw = 1.6e12
        pw = 3 * P / bw
        att = o["attention"]["forward_s"] + o["attention"]["backward_s"]
        o["block"] = dict(forward_s=(gemm_s + att) / 3 + P / bw, fwd_bwd_s=gemm_s + att + pw, reps=10)
        o["pointwise"] = dict(forward_s=P / bw * 0.9, fwd_bwd_s=pw * 0.9, reps=10)
        head = o["gemms"][-1]
        o["head"] = dict(fwd_bwd_s=head["forward_s"] + head["backward_s"] + 3 * (2 * BT * m.C + BT * m.V) * e / 1.2e12,
                         reps=10)
        models.append(o)
    return dict(schema=SCHEMA, fake=True, mode="fake", date=datetime.date.today().isoformat(),
                device=dict(type="cuda", name="NVIDIA H100 80GB HBM3", sm_count=132, note="FAKE: no measurement"),
                reference=dict(copy=dict(bytes_each_way=1 << 30, seconds=2 * (1 << 30) / 3.0e12, reps=10),
                               gemm=dict(m=8192, k=8192, n=8192, seconds=2 * 8192 ** 3 / 790e12, reps=10),
                               adamw=dict(params=1 << 27, dtype="fp32", fused=True, seconds=28 * (1 << 27) / 2.4e12, reps=10)),
                models=models, wall_s=0)


def write(path, doc):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1)
    os.replace(tmp, path)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="the JSON to write")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on the CPU: a dry run of every code path")
    ap.add_argument("--fake-h100", action="store_true", help="write invented times at the real shapes (no measurement)")
    ap.add_argument("--budget-s", type=float, default=100, help="wall-clock budget: past 60%% of it, fewer repetitions")
    ap.add_argument("--target-s", type=float, default=0.12, help="time spent per timed callable (sets its repetitions)")
    ap.add_argument("--sustained-s", type=float, default=6, help="seconds of back-to-back GEMMs at the end (steady clocks)")
    ap.add_argument("--models", help="comma list of model names to measure (default: every H100 shape)")
    a = ap.parse_args()
    t0 = time.time()
    shapes = published_shapes()
    if a.models:
        shapes = [s for s in shapes if s["name"] in a.models.split(",")]
    if a.fake_h100:
        write(a.out, fake_h100(shapes))
        print(f"wrote {a.out} (FAKE times, {len(shapes)} models)")
        return
    if a.cpu_smoke:
        device = torch.device("cpu")
        shapes = smoke_shapes(shapes)
    else:
        if not torch.cuda.is_available():
            sys.exit("no CUDA device (use --cpu-smoke for a dry run)")
        device = torch.device("cuda")
    dtype = torch.bfloat16
    torch.manual_seed(0)

    def log(msg):
        print(f"[{time.time() - t0:6.1f}s] {msg}", flush=True)

    timer = Timer(device, a.target_s if not a.cpu_smoke else 0.01, min_reps=5, max_reps=25)
    doc = dict(schema=SCHEMA, fake=False, mode="cpu-smoke" if a.cpu_smoke else "cuda",
               date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               device=device_info(device), dtype="bf16",
               settings=dict(target_s=timer.target_s, min_reps=timer.min_reps, max_reps=timer.max_reps, warmup=2,
                             statistic="median"), models=[], errors=[])
    log(f"device: {doc['device'].get('name')}; torch {torch.__version__}; {len(shapes)} model shapes")
    if "nvidia_smi" in doc["device"]:
        log("nvidia-smi: " + doc["device"]["nvidia_smi"].replace("\n", " | "))
    write(a.out, doc)
    try:
        doc["reference"] = reference(device, dtype, timer, a.cpu_smoke, log)
    except Exception as e:
        doc["errors"].append(f"reference: {type(e).__name__}: {e}")
        log(doc["errors"][-1])
    write(a.out, doc)
    for s in shapes:
        elapsed = time.time() - t0
        if elapsed > a.budget_s:
            doc["errors"].append(f"{s['name']}: skipped, past the {a.budget_s:.0f} s budget")
            log(doc["errors"][-1])
            continue
        if elapsed > 0.6 * a.budget_s:
            timer.scale = 0.4
        log(f"{s['name']} ({s['framework']}): B={s['B']} T={s['T']} C={s['C']} NH={s['NH']} NKV={s['NKV']} F={s['F']} V={s['V']}")
        try:
            doc["models"].append(measure_model(s, device, dtype, timer, log))
        except Exception as e:  # keep the others
            doc["errors"].append(f"{s['name']}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
            log(doc["errors"][-1])
        if device.type == "cuda":
            torch.cuda.empty_cache()
            doc["device"]["max_memory_allocated"] = torch.cuda.max_memory_allocated()
        doc["wall_s"] = time.time() - t0
        write(a.out, doc)
    if time.time() - t0 < a.budget_s - a.sustained_s - 5:
        try:
            doc["reference"]["sustained_gemm"] = sustained_gemm(device, dtype, a.sustained_s, a.cpu_smoke, timer, log)
        except Exception as e:
            doc["errors"].append(f"sustained: {type(e).__name__}: {e}")
    if device.type == "cuda":
        doc["device"]["nvidia_smi_after"] = nvidia_smi()
        log("nvidia-smi after: " + doc["device"]["nvidia_smi_after"].replace("\n", " | "))
    doc["wall_s"] = time.time() - t0
    write(a.out, doc)
    log(f"wrote {a.out}" + (f" ({len(doc['errors'])} error(s))" if doc["errors"] else ""))


if __name__ == "__main__":
    main()
