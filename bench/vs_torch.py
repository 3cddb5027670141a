#!/usr/bin/python3
"""Training speed, shardlm against PyTorch, on the same model, batch and sequence length.

  /usr/bin/python3 bench/vs_torch.py                  # both configs, 3 rounds, alternating
  /usr/bin/python3 bench/vs_torch.py --torch-only     # no shardlm binary needed
  /usr/bin/python3 bench/vs_torch.py --configs small --rounds 2 --steps 6
  bench/vs_torch.sh ...                               # the same, through /usr/bin/python3

Each round runs, one after the other: shardlm (2 threads), then torch with 1 and 2 threads, each
with glibc's malloc as is and tuned (see below), each a fresh process doing --steps training
steps of which the first --warmup are not timed. Rounds alternate so that drift of the machine
(thermal, neighbours) hits both sides alike. Reported: the median ms/step over all timed steps
of all rounds (and the fastest round's median); torch at its best variant; ratio = shardlm /
best torch (below 1: shardlm faster). Each run's cpu/wall is printed: a run that got much less
than its threads' worth of CPU ran on a busy machine, and the script warns.

shardlm:  build/shardlm train --model PRESET --data data/bench --steps N --batch B --seq T
          --threads 2 --seed 1 --out DIR --eval-every 0 --save-every 0
          (reads step_ms from DIR/metrics.jsonl)
torch:    tests/reference/gpt2_reference.py's GPT2, GPT-2 init, AdamW (decay on 2-D tensors),
          grad clip 1.0, fp32, torch.set_flush_denormal(True); OPENBLAS_CORETYPE=SkylakeX in its
          environment where /proc/cpuinfo shows avx512f (OpenBLAS reads it when it loads);
          OMP_NUM_THREADS / OPENBLAS_NUM_THREADS = its thread count. "tuned" malloc sets
          GLIBC_TUNABLES so that glibc stops returning large blocks to the kernel (otherwise torch
          page-faults its logits-sized buffers in every step, ~3-4x slower on 2 cores); pass
          --torch-malloc default to measure only glibc as is.
Data:     data/bench_{train,val}.bin, llm.c token shards of random tokens < 50257, made here.
Run by /usr/bin/python3 (the one with torch).
"""
import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REF_DIR = os.path.join(ROOT, "tests", "reference")

CONFIGS = {
    # name (also shardlm's --model preset): shape and the benchmarked batch B and sequence T
    "small": dict(n_layer=6, n_head=6, n_embd=384, batch=4, seq=256),
    "gpt2-124m": dict(n_layer=12, n_head=12, n_embd=768, batch=4, seq=64),
}
VOCAB = 50257
N_POSITIONS = 1024
MAGIC, VERSION = 20240520, 1


# ---------------------------------------------------------------- data


def write_token_file(path, n_tokens, seed):
    import numpy as np
    rng = np.random.default_rng(seed)
    header = np.zeros(256, dtype="<i4")
    header[0], header[1], header[2] = MAGIC, VERSION, n_tokens
    toks = rng.integers(0, VOCAB, n_tokens, dtype=np.int64).astype("<u2")
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(header.tobytes())
        f.write(toks.tobytes())
    os.replace(tmp, path)


def read_token_file(path):
    import numpy as np
    header = np.fromfile(path, dtype="<i4", count=256)
    if header[0] != MAGIC or header[1] != VERSION:
        raise SystemExit(f"{path}: not an llm.c token file (magic {header[0]}, version {header[1]})")
    return np.memmap(path, dtype="<u2", mode="r", offset=256 * 4, shape=(int(header[2]),))


def ensure_data(prefix, n_tokens):
    for split, seed in (("train", 1), ("val", 2)):
        path = f"{prefix}_{split}.bin"
        ok = False
        if os.path.exists(path):
            import numpy as np
            h = np.fromfile(path, dtype="<i4", count=256)
            ok = (len(h) == 256 and h[0] == MAGIC and h[1] == VERSION and h[2] == n_tokens
                  and os.path.getsize(path) == 1024 + 2 * n_tokens)
        if not ok:
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            write_token_file(path, n_tokens, seed)
            print(f"wrote {path} ({n_tokens} random tokens)", flush=True)


# ---------------------------------------------------------------- torch worker (a subprocess)


def torch_worker(args):
    import numpy as np
    import torch
    sys.path.insert(0, REF_DIR)
    import gpt2_reference as ref

    torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)
    c = CONFIGS[args.config]
    cfg = ref.GPT2Config(c["n_layer"], c["n_head"], c["n_embd"], VOCAB, N_POSITIONS)
    model = ref.init_gpt2_(ref.GPT2(cfg), seed=1)
    opt = ref.make_adamw(model, lr=3e-4, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
    tokens = read_token_file(args.data + "_train.bin")
    B, T = c["batch"], c["seq"]
    pos = 0
    times, losses, cpu = [], [], []
    for _ in range(args.steps):
        c0 = time.process_time()
        t0 = time.perf_counter()
        if pos + B * T + 1 > len(tokens):
            pos = 0
        buf = torch.from_numpy(np.asarray(tokens[pos:pos + B * T + 1], dtype=np.int64))
        pos += B * T
        x, y = buf[:-1].view(B, T), buf[1:].view(B, T)
        opt.zero_grad(set_to_none=True)
        _, loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        times.append((time.perf_counter() - t0) * 1e3)
        cpu.append((time.process_time() - c0) * 1e3)
    print(json.dumps({"step_ms": times, "cpu_ms": cpu, "losses": losses, "threads": torch.get_num_threads(),
                      "torch": torch.__version__,
                      "openblas_coretype": os.environ.get("OPENBLAS_CORETYPE")}))


# ---------------------------------------------------------------- driver


def has_avx512f():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return "avx512f" in line.split()
    except OSError:
        pass
    return False


# glibc returns every large block (>= 32 MiB at most) to the kernel with munmap, so each step
# page-faults its logits-sized buffers in again (zeroing them). "tuned" keeps freed memory in the
# heap instead, as a caching allocator would.
TUNED_MALLOC = "glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=1000000000000"


def torch_env(threads, malloc):
    env = dict(os.environ)
    if has_avx512f():
        env["OPENBLAS_CORETYPE"] = "SkylakeX"
    env["OMP_NUM_THREADS"] = str(threads)
    env["OPENBLAS_NUM_THREADS"] = str(threads)
    if malloc == "tuned":
        env["GLIBC_TUNABLES"] = TUNED_MALLOC
    return env


def require_openblas():
    """PyTorch's BLAS: Debian's torch links libblas.so.3, which a bare system resolves to the
    reference BLAS (~25x slower than OpenBLAS here). Refuse to benchmark a handicapped baseline."""
    probe = ("import torch; torch.ones(64, 64) @ torch.ones(64, 64); "
             "print('\\n'.join(l.split()[-1] for l in open('/proc/self/maps') if 'blas' in l))")
    p = subprocess.run(["/usr/bin/python3", "-c", probe], capture_output=True, text=True)
    libs = sorted(set(p.stdout.split()))
    openblas = [lib for lib in libs if "openblas" in lib]
    if not openblas:
        raise SystemExit("error: PyTorch's BLAS is not OpenBLAS (" + (", ".join(libs) or "none found") +
                         "): install libopenblas0-pthread (bash scripts/setup.sh does) so the baseline is fair")
    return openblas[0]


def loadavg():
    try:
        with open("/proc/loadavg") as f:
            return float(f.read().split()[0])
    except OSError:
        return float("nan")


def run_torch(args, config, threads, malloc):
    cmd = [sys.executable, os.path.abspath(__file__), "--torch-worker", "--config", config,
           "--threads", str(threads), "--steps", str(args.steps), "--data", args.data]
    p = subprocess.run(cmd, env=torch_env(threads, malloc), capture_output=True, text=True, errors="replace")
    if p.returncode != 0:
        raise SystemExit(f"torch run failed ({shlex.join(cmd)}):\n{p.stdout}{p.stderr}")
    r = json.loads(p.stdout.strip().splitlines()[-1])
    if r["threads"] != threads:
        raise SystemExit(f"torch ran with {r['threads']} threads, asked for {threads}")
    return r["step_ms"][args.warmup:], r


def shardlm_cmd(args, config, out_dir):
    c = CONFIGS[config]
    return [args.binary, "train", "--model", config, "--data", args.data, "--steps", str(args.steps),
            "--batch", str(c["batch"]), "--seq", str(c["seq"]), "--threads", str(args.threads),
            "--seed", "1", "--out", out_dir, "--eval-every", "0", "--save-every", "0"]


def run_shardlm(args, config):
    with tempfile.TemporaryDirectory(prefix=f"shardlm_bench_{config}_") as out_dir:
        cmd = shardlm_cmd(args, config, out_dir)
        t0 = os.times()
        p = subprocess.run(cmd, capture_output=True, text=True, errors="replace")
        t1 = os.times()
        if p.returncode != 0:
            raise SystemExit(f"shardlm run failed (exit {p.returncode}): {shlex.join(cmd)}\n"
                             f"{p.stdout[-3000:]}{p.stderr[-3000:]}")
        path = os.path.join(out_dir, "metrics.jsonl")
        if not os.path.exists(path):
            raise SystemExit(f"shardlm wrote no {path}: {shlex.join(cmd)}")
        steps = []
        with open(path) as f:
            for line in f:
                line = line.strip()
                if not line:
                    continue
                rec = json.loads(line)
                if "step_ms" in rec:
                    steps.append(float(rec["step_ms"]))
        if len(steps) <= args.warmup:
            raise SystemExit(f"{path}: {len(steps)} records with step_ms, need more than --warmup {args.warmup}")
        cpu = (t1.children_user - t0.children_user) + (t1.children_system - t0.children_system)
        wall = t1.elapsed - t0.elapsed
        return steps[args.warmup:], cpu / wall if wall > 0 else float("nan")


def fmt(x):
    return "—" if x is None else f"{x:.1f}"


def variant_name(v):
    t, m = v
    return f"{t} thr" + (", tuned malloc" if m == "tuned" else "")


def main():
    ap = argparse.ArgumentParser(description="shardlm vs PyTorch training speed",
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--configs", default="small,gpt2-124m", help="comma list of " + ", ".join(CONFIGS))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8, help="steps per run, warm-up included")
    ap.add_argument("--warmup", type=int, default=2, help="steps per run not timed")
    ap.add_argument("--threads", type=int, default=2, help="shardlm threads")
    ap.add_argument("--torch-threads", default="1,2")
    ap.add_argument("--torch-malloc", default="default,tuned",
                    help="comma list: default (glibc as is), tuned (GLIBC_TUNABLES keeps freed memory; "
                         "much faster torch on CPU). torch's best over all variants is used for the ratio")
    ap.add_argument("--binary", default=os.path.join(ROOT, "build", "shardlm"))
    ap.add_argument("--data", default=os.path.join(ROOT, "data", "bench"), help="token file prefix")
    ap.add_argument("--tokens", type=int, default=200_000)
    ap.add_argument("--torch-only", action="store_true", help="skip shardlm (no binary needed)")
    ap.add_argument("--json", help="also write the results here")
    # internal: one torch measurement in a fresh process
    ap.add_argument("--torch-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--config", help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.torch_worker:
        return torch_worker(args)

    configs = [c for c in args.configs.split(",") if c]
    for c in configs:
        if c not in CONFIGS:
            raise SystemExit(f"unknown config {c!r}; known: {', '.join(CONFIGS)}")
    if args.steps <= args.warmup:
        raise SystemExit("--steps must exceed --warmup")
    if not args.torch_only and not (os.path.isfile(args.binary) and os.access(args.binary, os.X_OK)):
        raise SystemExit(f"error: shardlm binary not found at {args.binary}; build it first "
                         f"(cmake -S . -B build && cmake --build build -j2), pass --binary, or run with --torch-only")
    mallocs = [m for m in args.torch_malloc.split(",") if m]
    for m in mallocs:
        if m not in ("default", "tuned"):
            raise SystemExit(f"--torch-malloc: unknown {m!r} (default, tuned)")
    variants = [(int(t), m) for m in mallocs for t in args.torch_threads.split(",") if t]

    ensure_data(args.data, args.tokens)
    blas = require_openblas()
    avx512 = has_avx512f()
    print("command: " + shlex.join([sys.executable] + sys.argv), flush=True)
    print("torch: OPENBLAS_CORETYPE=" + ("SkylakeX (avx512f present)" if avx512 else
                                          f"{os.environ.get('OPENBLAS_CORETYPE')} (inherited; no avx512f)") +
          f", {blas}, set_flush_denormal(True), OMP/OPENBLAS_NUM_THREADS = threads"
          + (f"; tuned malloc = GLIBC_TUNABLES={TUNED_MALLOC}" if "tuned" in mallocs else ""), flush=True)
    if not args.torch_only:
        print("shardlm: " + shlex.join(shardlm_cmd(args, configs[0], "DIR")) + "  (per config)", flush=True)
    print(f"machine: {os.cpu_count()} cpus, load average {loadavg():.2f} at start", flush=True)

    results = {}
    starved = False
    for config in configs:
        sl, tt = [], {v: [] for v in variants}
        sl_rounds, tt_rounds = [], {v: [] for v in variants}  # per-round medians
        for r in range(args.rounds):
            if not args.torch_only:
                s, util = run_shardlm(args, config)
                sl += s
                sl_rounds.append(statistics.median(s))
                print(f"[{config} round {r + 1}] shardlm {args.threads} thr: {statistics.median(s):.1f} ms/step "
                      f"(cpu/wall {util:.2f}, load {loadavg():.2f})", flush=True)
            for v in variants:
                s, info = run_torch(args, config, *v)
                tt[v] += s
                tt_rounds[v].append(statistics.median(s))
                util = sum(info["cpu_ms"][args.warmup:]) / sum(info["step_ms"][args.warmup:])
                starved |= util < 0.8 * v[0]
                print(f"[{config} round {r + 1}] torch {variant_name(v)}: {statistics.median(s):.1f} ms/step "
                      f"(cpu/wall {util:.2f}, load {loadavg():.2f}; loss {info['losses'][0]:.3f} -> "
                      f"{info['losses'][-1]:.3f})", flush=True)
        med_t = {v: statistics.median(x) for v, x in tt.items()}
        best = min(med_t, key=med_t.get)
        med_s = statistics.median(sl) if sl else None
        results[config] = {"shardlm_ms": med_s, "shardlm_best_round_ms": min(sl_rounds) if sl_rounds else None,
                           "torch_ms": {variant_name(v): m for v, m in med_t.items()},
                           "torch_best_round_ms": {variant_name(v): min(x) for v, x in tt_rounds.items()},
                           "torch_best": variant_name(best), "best_v": best,
                           "ratio": (med_s / med_t[best]) if med_s else None, "shape": CONFIGS[config]}

    print()
    print(f"median ms/step over {args.rounds} rounds × {args.steps - args.warmup} timed steps "
          f"(first {args.warmup} of each run skipped), in brackets the fastest round's median; "
          f"ratio = shardlm / best torch (* = best torch), both medians")
    print()
    print("| config | B×T | shardlm threads | shardlm ms/step | " +
          " | ".join(f"torch ms/step ({variant_name(v)})" for v in variants) + " | ratio |")
    print("|" + "---|" * (5 + len(variants)))
    for config in configs:
        r, c = results[config], CONFIGS[config]
        tcols = " | ".join(f"{fmt(r['torch_ms'][variant_name(v)])} ({fmt(r['torch_best_round_ms'][variant_name(v)])})"
                           + (" *" if v == r["best_v"] else "") for v in variants)
        scol = fmt(r["shardlm_ms"]) + ("" if r["shardlm_ms"] is None else f" ({fmt(r['shardlm_best_round_ms'])})")
        ratio = "—" if r["ratio"] is None else f"{r['ratio']:.2f}"
        print(f"| {config} | {c['batch']}×{c['seq']} | {args.threads} | {scol} | {tcols} | {ratio} |")
    print(f"\nload average {loadavg():.2f} at end")
    if starved:
        print("WARNING: some torch runs got well under their threads' worth of CPU (cpu/wall above): "
              "the machine was busy; the figures are not clean")
    if args.json:
        for r in results.values():
            del r["best_v"]
        with open(args.json, "w") as f:
            json.dump({"command": sys.argv, "avx512f": avx512, "results": results}, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
