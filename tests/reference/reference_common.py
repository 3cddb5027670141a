"""What the PyTorch references (gpt2_reference.py, llama_reference.py) share: safetensors by
hand, copying weights into a model, AdamW with decay on the 2-D tensors, and the program that
turns a model directory and a batch into logits, loss, gradients and AdamW steps.

Run by /usr/bin/python3 (Debian's python3-torch). Imported from the references' own directory
(a script's directory is on sys.path; bench/ and the tests insert tests/reference/ first).
"""
import argparse
import json
import os
import struct

import numpy as np
import torch

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


# ---------------------------------------------------------------- weights and optimizer


def load_params_(model, weights):
    """Copies {name: array} into model's parameters; every parameter must be present and nothing
    else, shapes exact (values are converted to each parameter's dtype)."""
    params = dict(model.named_parameters())
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
    return model


def make_adamw(model, lr, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0):
    """torch.optim.AdamW with weight decay on the 2-D tensors only (matrices and embeddings; not
    biases or norm weights). Group 0 decays, group 1 does not; parameters in named order."""
    decay = [p for _, p in model.named_parameters() if p.dim() == 2]
    no_decay = [p for _, p in model.named_parameters() if p.dim() != 2]
    groups = [{"params": decay, "weight_decay": weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(beta1, beta2), eps=eps)


# ---------------------------------------------------------------- the program


def reference_main(argv, description, producer, build_model):
    """The references' command line (see gpt2_reference.py's docstring for the outputs).

    build_model(model_dir) -> (model, vocab_size): the model with DIR/model.safetensors loaded;
    model(inputs, targets) -> (logits, mean cross-entropy loss)."""
    ap = argparse.ArgumentParser(description=description)
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
    model, V = build_model(args.model_dir)

    batch, _ = load_safetensors(args.batch)
    for key in ("inputs", "targets"):
        if key not in batch:
            raise SystemExit(f"{args.batch}: no tensor '{key}'")
    inputs = torch.from_numpy(batch["inputs"].astype(np.int64))
    targets = torch.from_numpy(batch["targets"].astype(np.int64))
    if inputs.dim() != 2 or inputs.shape != targets.shape:
        raise SystemExit(f"{args.batch}: inputs {tuple(inputs.shape)} and targets {tuple(targets.shape)} must be equal (B,T)")
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

    save_safetensors(args.out, out, {"producer": producer, "torch": torch.__version__})
    return 0
