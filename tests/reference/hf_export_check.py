#!/usr/bin/python3
"""Reads a Hugging Face model directory the way transformers' from_pretrained does — config.json,
then model.safetensors or model.safetensors.index.json and the files its weight_map names —
loads the tensors by their Hugging Face names into the PyTorch reference model of config.json's
model_type (gpt2_reference.GPT2, llama_reference.Llama, mixtral_reference.Mixtral), runs a forward and compares its logits
with shardlm's.

  hf_export_check.py --model-dir DIR --batch BATCH.safetensors --logits SHARDLM.safetensors --tol TOL

  BATCH    "inputs" int32 (B, T)
  SHARDLM  "logits" fp32 (B, T, V), shardlm's for the same inputs and parameters
  TOL      max |shardlm - reference| allowed, relative to max(1, max |reference|)

Checks on the way, each failing with one line: every safetensors file carries "format": "pt"
(transformers refuses others), the index's weight_map names every tensor of every file and only
those, its metadata.total_size is their bytes, and for a GPT-2 tokenizer vocab.json and
merges.txt are what GPT2Tokenizer reads. Exits 0 and prints the difference when within TOL.
Run by /usr/bin/python3 (Debian's python3-torch); transformers itself is not needed.
"""
import argparse
import json
import os
import sys

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import gpt2_reference  # noqa: E402
import llama_reference  # noqa: E402
import mixtral_reference  # noqa: E402
from reference_common import load_safetensors  # noqa: E402

_BYTES = {"F32": 4, "BF16": 2, "F16": 2}


def read_header(path):
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        return json.loads(f.read(n))


def load_weights(model_dir):
    """{name: float32 array} from the directory, as from_pretrained finds the files."""
    index_path = os.path.join(model_dir, "model.safetensors.index.json")
    if not os.path.exists(index_path):
        files = {"model.safetensors": None}
    else:
        with open(index_path) as f:
            index = json.load(f)
        files = {}
        for name, file in index["weight_map"].items():
            files.setdefault(file, set()).add(name)
    weights, total = {}, 0
    for file, names in files.items():
        path = os.path.join(model_dir, file)
        header = read_header(path)
        if header.get("__metadata__", {}).get("format") != "pt":
            raise SystemExit(f"{path}: __metadata__ lacks \"format\": \"pt\"")
        held = {k for k in header if k != "__metadata__"}
        if names is not None and held != names:
            raise SystemExit(f"{path}: holds {sorted(held ^ names)[:3]}... other than the index's weight_map says")
        total += sum(int(np.prod(e["shape"], dtype=np.int64)) * _BYTES[e["dtype"]]
                     for k, e in header.items() if k != "__metadata__")
        tensors, _ = load_safetensors(path)
        for name, t in tensors.items():
            if name in weights:
                raise SystemExit(f"{path}: tensor {name} is in two files")
            weights[name] = t.astype(np.float32)
    if os.path.exists(index_path) and index["metadata"]["total_size"] != total:
        raise SystemExit(f"{index_path}: metadata.total_size {index['metadata']['total_size']} but the tensors hold {total} bytes")
    return weights


def check_gpt2_tokenizer(model_dir, vocab_size):
    with open(os.path.join(model_dir, "vocab.json"), encoding="utf-8") as f:
        vocab = json.load(f)
    if len(vocab) != vocab_size or sorted(vocab.values()) != list(range(vocab_size)):
        raise SystemExit(f"{model_dir}/vocab.json: not {vocab_size} tokens with ids 0..{vocab_size - 1}")
    with open(os.path.join(model_dir, "merges.txt"), encoding="utf-8") as f:
        first = f.readline()
    if not first.startswith("#version"):
        raise SystemExit(f"{model_dir}/merges.txt: does not start with a #version line")
    with open(os.path.join(model_dir, "tokenizer_config.json")) as f:
        if json.load(f).get("tokenizer_class") != "GPT2Tokenizer":
            raise SystemExit(f"{model_dir}/tokenizer_config.json: tokenizer_class is not GPT2Tokenizer")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--batch", required=True)
    ap.add_argument("--logits", required=True)
    ap.add_argument("--tol", type=float, required=True)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    config_path = os.path.join(args.model_dir, "config.json")
    with open(config_path) as f:
        config = json.load(f)
    kind = config.get("model_type")
    if kind == "gpt2":
        model = gpt2_reference.GPT2(gpt2_reference.GPT2Config.from_json(config_path))
    elif kind == "llama":
        model = llama_reference.Llama(llama_reference.LlamaConfig.from_json(config_path))
    elif kind == "mixtral":
        try:
            model = mixtral_reference.Mixtral(mixtral_reference.MixtralConfig.from_json(config_path))
        except ValueError as e:
            raise SystemExit(str(e)) from None
    else:
        raise SystemExit(f"{config_path}: model_type {kind!r} is not gpt2, llama or mixtral")
    try:
        model.load_numpy_(load_weights(args.model_dir))
    except ValueError as e:  # names or shapes not the model's
        raise SystemExit(f"{args.model_dir}: {e}") from None
    if config.get("shardlm_tokenizer") == "gpt2" or os.path.exists(os.path.join(args.model_dir, "vocab.json")):
        check_gpt2_tokenizer(args.model_dir, 50257)

    batch, _ = load_safetensors(args.batch)
    inputs = torch.from_numpy(batch["inputs"].astype(np.int64))
    with torch.no_grad():
        ref, _ = model(inputs)
    ref = ref.numpy().astype(np.float64)
    got = load_safetensors(args.logits)[0]["logits"].astype(np.float64)
    if got.shape != ref.shape:
        raise SystemExit(f"{args.logits}: logits of shape {got.shape}, the reference's are {ref.shape}")
    diff, scale = float(np.abs(got - ref).max()), max(1.0, float(np.abs(ref).max()))
    verdict = "within" if diff <= args.tol * scale else "BEYOND"
    print(f"{args.model_dir}: {kind}, max |shardlm - reference| {diff:.3g}, max |reference| {scale:.3g}: "
          f"{verdict} {args.tol:g}")
    return 0 if verdict == "within" else 1


if __name__ == "__main__":
    sys.exit(main())
