#!/usr/bin/python3
"""llm.c's GPT-2 model file, written from a Hugging Face GPT-2 directory: the independent side of
shardlm's llm.c export and import (ckpt/llmc_model.h), written from the format as llm.c defines
it (train_gpt2.py's write_model, train_gpt2.cu's gpt2_build_from_checkpoint), not from shardlm.

  llmc_format.py --hf-dir DIR --out FILE [--bf16]

DIR holds config.json (GPT2Config: n_layer, n_head, n_embd, n_positions, vocab_size; n_inner
absent or 4 n_embd) and model.safetensors (fp32 or bf16; names with or without "transformer.").
FILE: a header of 256 little-endian int32 — 20240326, version 3 (fp32) or 5 (bf16), max_seq_len,
vocab_size, num_layers, num_heads, channels, padded_vocab_size (vocab_size rounded up to a
multiple of 128), zeros — then the parameters: wte (Vp, C) with rows past vocab_size zero, wpe
(maxT, C), then for each kind all layers in order ln_1 weight, ln_1 bias, c_attn weight (3C, C),
c_attn bias, attn c_proj weight (C, C), its bias, ln_2 weight and bias, c_fc weight (4C, C), its
bias, mlp c_proj weight (C, 4C), its bias, then ln_f weight and bias. Hugging Face's GPT-2 keeps
its matrices as Conv1D (in, out); llm.c as nn.Linear (out, in), so each is transposed. bf16 is
round to nearest even.

Run by /usr/bin/python3 (numpy).
"""
import argparse
import json
import os
import struct
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from reference_common import load_safetensors  # noqa: E402

PER_LAYER = [("ln_1.weight", False), ("ln_1.bias", False), ("attn.c_attn.weight", True), ("attn.c_attn.bias", False),
             ("attn.c_proj.weight", True), ("attn.c_proj.bias", False), ("ln_2.weight", False), ("ln_2.bias", False),
             ("mlp.c_fc.weight", True), ("mlp.c_fc.bias", False), ("mlp.c_proj.weight", True), ("mlp.c_proj.bias", False)]


def bf16_bits(a):
    """float32 array -> uint16 bits, rounded to nearest even (finite values)."""
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hf-dir", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--bf16", action="store_true")
    a = ap.parse_args()
    cfg = json.load(open(os.path.join(a.hf_dir, "config.json")))
    L, NH, C, T, V = (cfg[k] for k in ("n_layer", "n_head", "n_embd", "n_positions", "vocab_size"))
    if cfg.get("n_inner") not in (None, 4 * C):
        raise SystemExit(f"error: n_inner {cfg['n_inner']}: llm.c's MLP is 4 n_embd")
    Vp = (V + 127) // 128 * 128
    raw, _ = load_safetensors(os.path.join(a.hf_dir, "model.safetensors"))
    w = {k[len("transformer."):] if k.startswith("transformer.") else k: v.astype(np.float32) for k, v in raw.items()}

    wte = np.zeros((Vp, C), dtype=np.float32)
    wte[:V] = w["wte.weight"][:V]
    tensors = [wte, w["wpe.weight"]]
    for name, transposed in PER_LAYER:
        for layer in range(L):
            t = w[f"h.{layer}.{name}"]
            tensors.append(t.T if transposed else t)
    tensors += [w["ln_f.weight"], w["ln_f.bias"]]

    header = np.zeros(256, dtype="<i4")
    header[:8] = [20240326, 5 if a.bf16 else 3, T, V, L, NH, C, Vp]
    with open(a.out, "wb") as f:
        f.write(header.tobytes())
        for t in tensors:
            f.write(bf16_bits(t).astype("<u2").tobytes() if a.bf16 else np.ascontiguousarray(t, dtype="<f4").tobytes())
    print(f"wrote {a.out}: {struct.calcsize('<256i')} header bytes, {sum(t.size for t in tensors)} parameters")


if __name__ == "__main__":
    main()
