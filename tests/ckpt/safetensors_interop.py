"""Python side of the safetensors interop test: json + struct + numpy only (no safetensors package).

  safetensors_interop.py check FILE   verify the file the C++ test writes (see expected_cpp())
  safetensors_interop.py write FILE   write a file with the content expected_py() describes

Exits non-zero with a message on any mismatch; prints OK on success.
"""
import json
import struct
import sys

import numpy as np

NP = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "I64": np.int64, "I32": np.int32,
      "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BF16": np.uint16, "BOOL": np.bool_}


def read(path):
    with open(path, "rb") as f:
        raw = f.read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n].decode("utf-8"))
    data = raw[8 + n:]
    meta = header.pop("__metadata__", {})
    out = {}
    for name, e in header.items():
        b, end = e["data_offsets"]
        arr = np.frombuffer(data[b:end], dtype=np.dtype(NP[e["dtype"]]).newbyteorder("<"))
        out[name] = (e["dtype"], arr.reshape(e["shape"]))
    return out, meta, n


def bf16_to_f32(u16):
    return (u16.astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16_bits(x):
    return (np.asarray(x, np.float32).view(np.uint32) >> 16).astype(np.uint16)  # exact values only


def expected_cpp():
    return {
        "w": ("F32", (np.arange(24, dtype=np.float32) * 0.5 - 3).reshape(2, 3, 4)),
        "ids": ("I32", np.arange(-5, 5, dtype=np.int32).reshape(2, 5)),
        "half": ("BF16", f32_to_bf16_bits([1.0, -2.0, 0.15625, 2.0 ** 100, 0.0, -0.5])),
        "d": ("F64", np.array([1.0 / 3, -1e300], dtype=np.float64)),
        "bytes": ("U8", np.array([0, 1, 255], dtype=np.uint8)),
        "scalar": ("F32", np.array(7.25, dtype=np.float32)),
        "empty": ("F32", np.zeros((0, 4), dtype=np.float32)),
    }


def expected_py():
    return {
        "a.weight": ("F32", np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4)),
        "b": ("I64", np.array([1, -2, 1 << 40], dtype=np.int64)),
        "c": ("F16", np.array([1.0, -2.5, 65504.0, 2.0 ** -24], dtype=np.float16)),
        "e": ("BF16", f32_to_bf16_bits([0.5, -1.0, 256.0])),
        "k": ("I8", np.array([-128, 0, 127], dtype=np.int8)),
    }


def check(path):
    tensors, meta, n = read(path)
    fail = []
    if (8 + n) % 8:
        fail.append(f"header length {n}: 8 + N not a multiple of 8")
    if meta != {"format": "pt", "step": "42"}:
        fail.append(f"metadata {meta}")
    exp = expected_cpp()
    if set(tensors) != set(exp):
        fail.append(f"names {sorted(tensors)} != {sorted(exp)}")
    for name, (dt, arr) in exp.items():
        if name not in tensors:
            continue
        got_dt, got = tensors[name]
        if got_dt != dt or got.shape != arr.shape or not np.array_equal(got, arr):
            fail.append(f"{name}: got {got_dt} {got.shape} {got.ravel()[:6]}, want {dt} {arr.shape} {arr.ravel()[:6]}")
    # the bf16 values read as float must be what was written
    if "half" in tensors and not np.array_equal(bf16_to_f32(tensors["half"][1]),
                                                np.array([1.0, -2.0, 0.15625, 2.0 ** 100, 0.0, -0.5], np.float32)):
        fail.append("half: bf16 values")
    if fail:
        print("\n".join(fail))
        sys.exit(1)
    print("OK")


def write(path):
    # Insertion order, unsorted, header NOT padded: readers must not rely on our writer's habits.
    header = {"__metadata__": {"source": "python", "n": "5"}}
    blobs = []
    off = 0
    for name, (dt, arr) in expected_py().items():
        b = np.ascontiguousarray(arr).astype(np.dtype(arr.dtype).newbyteorder("<")).tobytes()
        header[name] = {"dtype": dt, "shape": list(arr.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    h = json.dumps(header).encode("utf-8")
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)
    print("OK")


if __name__ == "__main__":
    {"check": check, "write": write}[sys.argv[1]](sys.argv[2])
