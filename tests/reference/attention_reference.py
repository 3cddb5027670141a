"""Bidirectional (unmasked) grouped-query attention in PyTorch, the reference of the kernels'
non-causal mode (tests/kernels/noncausal_attention_test.cc).

  attention_reference.py DIR B TQ TK NH NKV HS

reads DIR/{q,k,v,dout}.f32 (raw little-endian float32: q and dout (B, TQ, NH, HS), k and v
(B, TK, NKV, HS)) and writes DIR/{out,lse,dq,dk,dv}.f32: the attention output (B, TQ, NH, HS),
the log-sum-exp of each query row's scaled scores (B, NH, TQ) and the gradients of
sum(out * dout), all computed in float64 by autograd. Query head h reads key/value head
h // (NH // NKV); scores are scaled by 1 / sqrt(HS).
"""
import os
import sys

import numpy as np
import torch


def read(d, name, shape):
    a = np.fromfile(os.path.join(d, name + ".f32"), dtype="<f4")
    return torch.tensor(a.astype(np.float64).reshape(shape), requires_grad=True)


def write(d, name, t):
    t.detach().numpy().astype("<f4").tofile(os.path.join(d, name + ".f32"))


def main():
    d = sys.argv[1]
    B, TQ, TK, NH, NKV, HS = (int(x) for x in sys.argv[2:8])
    q = read(d, "q", (B, TQ, NH, HS))
    k = read(d, "k", (B, TK, NKV, HS))
    v = read(d, "v", (B, TK, NKV, HS))
    dout = read(d, "dout", (B, TQ, NH, HS)).detach()
    group = NH // NKV
    kh = k.repeat_interleave(group, dim=2).transpose(1, 2)  # (B, NH, TK, HS)
    vh = v.repeat_interleave(group, dim=2).transpose(1, 2)
    scores = q.transpose(1, 2) @ kh.transpose(2, 3) / HS ** 0.5  # (B, NH, TQ, TK)
    lse = torch.logsumexp(scores, dim=-1)  # (B, NH, TQ)
    out = (torch.softmax(scores, dim=-1) @ vh).transpose(1, 2)  # (B, TQ, NH, HS)
    (out * dout).sum().backward()
    write(d, "out", out)
    write(d, "lse", lse)
    write(d, "dq", q.grad)
    write(d, "dk", k.grad)
    write(d, "dv", v.grad)


if __name__ == "__main__":
    main()
