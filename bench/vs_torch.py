#!/usr/bin/python3
"""Training speed, shardlm against PyTorch, on the same model, batch and sequence length.

  /usr/bin/python3 bench/vs_torch.py                  # GPT-2 configs, 3 rounds, alternating
  /usr/bin/python3 bench/vs_torch.py --torch-only     # no shardlm binary needed
  /usr/bin/python3 bench/vs_torch.py --configs small,llama-small --rounds 2
  bench/vs_torch.sh ...                               # the same, through /usr/bin/python3

Each round runs, one after the other: shardlm (2 threads), then every PyTorch variant: intra-op
threads (--torch-threads: torch.set_num_threads and OMP_NUM_THREADS) x OpenBLAS threads
(--blas-threads: OPENBLAS_NUM_THREADS) x malloc (--torch-malloc: "tuned" by default, glibc's
"default" only when asked), each a fresh process doing --steps training steps of which the
first --warmup are not timed (default 4: PyTorch's steps 1-4 run 1.5-4x slower than the rest,
page-faulting in its growing heap; timing them inflates the baseline). Rounds alternate so that
drift of the machine (thermal, neighbours) hits both sides alike. Reported: the median ms/step over all timed steps of all
rounds (and the fastest round's median) of every variant; PyTorch's best variant, named; ratio
= shardlm / best torch (below 1: shardlm faster). Each run prints its cpu/wall and how many
cores other processes used meanwhile (from /proc/stat): a run next to a busy neighbour is
flagged and the script warns at the end.

Why two thread counts: Debian's torch calls OpenBLAS (libblas.so.3 -> openblas-pthread) for its
GEMMs, and OpenBLAS-pthread keeps its own thread pool, sized when it loads from
OPENBLAS_NUM_THREADS (then GOTO_NUM_THREADS, then OMP_NUM_THREADS); torch.set_num_threads sizes
only the OpenMP pool of torch's own (element-wise, softmax, reduction) kernels. The script
checks this at start by timing a 1024^3 SGEMM in fresh processes (--blas-check) and reading
openblas_get_num_threads() from the loaded library; every worker checks the latter too. On 2
cores the two pools spin-wait against each other: 1 intra-op thread with OpenBLAS on 2 threads
measured fastest.

shardlm:  build/shardlm train --model PRESET --data data/bench --steps N --batch B --seq T
          --threads 2 --seed 1 --out DIR --eval-every 0 --save-every 0
          (reads compute_ms, the step itself, from DIR/metrics.jsonl)
torch:    GPT-2 configs: tests/reference/gpt2_reference.py's GPT2 and GPT-2 init; llama configs:
          tests/reference/llama_reference.py's Llama and init (normal 0.02, norms 1); moe configs:
          that Llama with bench/moe_torch.py's sparse MoE in place of each MLP (router softmax,
          top-k, renormalise, a loop over experts with index_select / index_add; aux and z-loss
          as shardlm's defaults), same init; AdamW (decay
          on 2-D tensors), grad clip 1.0, fp32, torch.set_flush_denormal(True);
          OPENBLAS_CORETYPE=SkylakeX in its environment where /proc/cpuinfo shows avx512f (OpenBLAS
          reads it when it loads). "tuned" malloc sets GLIBC_TUNABLES so that glibc stops
          returning large blocks to the kernel (otherwise torch page-faults its logits-sized
          buffers in every step, ~3-4x slower on 2 cores); --torch-malloc default,tuned measures
          glibc as is too.
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
    "small": dict(arch="gpt2", n_layer=6, n_head=6, n_embd=384, batch=4, seq=256),
    "gpt2-124m": dict(arch="gpt2", n_layer=12, n_head=12, n_embd=768, batch=4, seq=64),
    "llama-small": dict(arch="llama", n_layer=6, n_head=6, n_kv_head=2, n_embd=384, ffn=1024,
                        rope_theta=10000.0, eps=1e-5, tied=False, batch=4, seq=256),
    # llama-small with every block's MLP a mixture of 8 SwiGLU experts of width 512, top-2
    "moe-small": dict(arch="moe", n_layer=6, n_head=6, n_kv_head=2, n_embd=384, ffn=1024,
                      rope_theta=10000.0, eps=1e-5, tied=False, experts=8, top_k=2, moe_ffn=512,
                      batch=4, seq=256),
}
DEFAULT_CONFIGS = "small,gpt2-124m"
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


# ---------------------------------------------------------------- torch side (subprocesses)


def openblas_info():
    """(threads, core name, path) of the OpenBLAS loaded in this process, or (None, None, None).
    torch's libblas.so.3 (openblas-pthread) links libopenblas.so.0; dlopen of the path already
    mapped returns that same instance, so openblas_get_num_threads() is the pool torch's GEMMs use."""
    import ctypes
    with open("/proc/self/maps") as f:
        paths = sorted({line.split()[-1] for line in f if "libopenblas" in line and "/" in line})
    if not paths:
        return None, None, None
    lib = ctypes.CDLL(paths[0])
    lib.openblas_get_corename.restype = ctypes.c_char_p
    return int(lib.openblas_get_num_threads()), lib.openblas_get_corename().decode(), paths[0]


def blas_check_worker(args):
    """Times a 1024^3 SGEMM (torch.mm, i.e. OpenBLAS) under this process's thread settings."""
    import torch
    torch.set_num_threads(args.threads)
    n = 1024
    g = torch.Generator().manual_seed(0)
    a, b, c = torch.randn(n, n, generator=g), torch.randn(n, n, generator=g), torch.empty(n, n)
    for _ in range(3):
        torch.mm(a, b, out=c)
    wall, cpu = [], []
    for _ in range(15):
        c0, t0 = time.process_time(), time.perf_counter()
        torch.mm(a, b, out=c)
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    threads, core, path = openblas_info()
    med = statistics.median(wall)
    print(json.dumps({"gflops": 2 * n ** 3 / med / 1e9, "cpu_per_wall": sum(cpu) / sum(wall),
                      "intra_op": torch.get_num_threads(), "openblas_threads": threads,
                      "openblas_core": core, "openblas": path}))


def build_torch_model(config):
    c = CONFIGS[config]
    sys.path.insert(0, REF_DIR)
    if c["arch"] == "gpt2":
        import gpt2_reference as ref
        cfg = ref.GPT2Config(c["n_layer"], c["n_head"], c["n_embd"], VOCAB, N_POSITIONS)
        return ref, ref.init_gpt2_(ref.GPT2(cfg), seed=1)
    if c["arch"] == "moe":
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import moe_torch
        return moe_torch.build(c, VOCAB, N_POSITIONS)
    import llama_reference as ref
    cfg = ref.LlamaConfig(vocab_size=VOCAB, hidden_size=c["n_embd"], intermediate_size=c["ffn"],
                          num_hidden_layers=c["n_layer"], num_attention_heads=c["n_head"],
                          num_key_value_heads=c["n_kv_head"], rms_norm_eps=c["eps"], rope_theta=c["rope_theta"],
                          max_position_embeddings=N_POSITIONS, tie_word_embeddings=c["tied"])
    return ref, ref.init_llama_(ref.Llama(cfg), seed=1)


def torch_worker(args):
    import numpy as np
    import torch

    torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)
    blas_threads, blas_core, _ = openblas_info()
    c = CONFIGS[args.config]
    ref, model = build_torch_model(args.config)
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
                      "blas_threads": blas_threads, "openblas_core": blas_core, "torch": torch.__version__,
                      "params": sum(p.numel() for p in model.parameters()),
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


def torch_env(intra, blas, malloc):
    """intra: OMP_NUM_THREADS (torch's own OpenMP pool; the worker also calls set_num_threads);
    blas: OPENBLAS_NUM_THREADS, which openblas-pthread reads before GOTO_/OMP_NUM_THREADS."""
    env = dict(os.environ)
    if has_avx512f():
        env["OPENBLAS_CORETYPE"] = "SkylakeX"
    env["OMP_NUM_THREADS"] = str(intra)
    env["OPENBLAS_NUM_THREADS"] = str(blas)
    env.pop("GOTO_NUM_THREADS", None)
    if malloc == "tuned":
        env["GLIBC_TUNABLES"] = TUNED_MALLOC
    else:
        env.pop("GLIBC_TUNABLES", None)
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


def cpu_busy_seconds():
    """Seconds all CPUs spent busy since boot (/proc/stat: user nice system irq softirq steal;
    steal counts, as time the hypervisor gave to someone else)."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return float("nan")
    user, nice, system, _idle, _iowait, irq, softirq, steal = (v + [0] * 8)[:8]
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


BUSY_OTHERS = 0.15  # cores used by other processes during a run above which it is flagged


def run_measured(cmd, env=None):
    """Runs cmd; returns (CompletedProcess, its cpu/wall, cores the rest of the machine used)."""
    b0, t0 = cpu_busy_seconds(), os.times()
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, errors="replace")
    t1, b1 = os.times(), cpu_busy_seconds()
    child = (t1.children_user - t0.children_user) + (t1.children_system - t0.children_system)
    wall = t1.elapsed - t0.elapsed
    if wall <= 0:
        return p, float("nan"), float("nan")
    return p, child / wall, max(0.0, (b1 - b0) - child) / wall


def check_blas_threads():
    """Times an SGEMM in fresh processes: does OPENBLAS_NUM_THREADS (and not torch's intra-op
    count) set the threads OpenBLAS computes with? Returns the records; exits if OpenBLAS reports
    a thread count other than the one asked for (the variants would be mislabelled)."""
    recs = []
    for intra, blas in ((1, 1), (1, 2), (2, 1)):
        cmd = [sys.executable, os.path.abspath(__file__), "--blas-check-worker", "--threads", str(intra)]
        p, _, others = run_measured(cmd, torch_env(intra, blas, "tuned"))
        if p.returncode != 0:
            raise SystemExit(f"BLAS check failed ({shlex.join(cmd)}):\n{p.stdout}{p.stderr}")
        r = json.loads(p.stdout.strip().splitlines()[-1])
        r.update(intra_asked=intra, blas_asked=blas, others=others)
        recs.append(r)
        print(f"  SGEMM 1024^3, intra {intra} thr, OPENBLAS_NUM_THREADS={blas}: {r['gflops']:.0f} GFLOP/s, "
              f"cpu/wall {r['cpu_per_wall']:.2f}, openblas_get_num_threads() = {r['openblas_threads']} "
              f"(core {r['openblas_core']}; others {others:.2f} cores)", flush=True)
        if r["openblas_threads"] != blas:
            raise SystemExit(f"error: OpenBLAS reports {r['openblas_threads']} threads with OPENBLAS_NUM_THREADS={blas}")
    one, two, intra2 = recs
    ok = (two["cpu_per_wall"] > 1.5 and two["gflops"] > 1.3 * one["gflops"] and intra2["cpu_per_wall"] < 1.3)
    print("  -> " + ("OPENBLAS_NUM_THREADS sets OpenBLAS's threads; torch's intra-op count does not"
                     if ok else "WARNING: the GEMM timings do not show OPENBLAS_NUM_THREADS controlling "
                                "OpenBLAS's threads (busy machine?); variant labels may be wrong"), flush=True)
    return recs, ok


def variant_name(v):
    intra, blas, malloc = v
    return f"intra-op {intra} thr, BLAS {blas} thr, " + ("tuned malloc" if malloc == "tuned" else "glibc malloc")


def run_torch(args, config, v):
    intra, blas, malloc = v
    cmd = [sys.executable, os.path.abspath(__file__), "--torch-worker", "--config", config,
           "--threads", str(intra), "--steps", str(args.steps), "--data", args.data]
    p, _, others = run_measured(cmd, torch_env(intra, blas, malloc))
    if p.returncode != 0:
        raise SystemExit(f"torch run failed ({shlex.join(cmd)}):\n{p.stdout}{p.stderr}")
    r = json.loads(p.stdout.strip().splitlines()[-1])
    if r["threads"] != intra:
        raise SystemExit(f"torch ran with {r['threads']} intra-op threads, asked for {intra}")
    if r["blas_threads"] != blas:
        raise SystemExit(f"OpenBLAS ran with {r['blas_threads']} threads, asked for {blas}")
    r["others"] = others
    return r["step_ms"][args.warmup:], r


def shardlm_cmd(args, config, out_dir):
    c = CONFIGS[config]
    return [args.binary, "train", "--model", config, "--data", args.data, "--steps", str(args.steps),
            "--batch", str(c["batch"]), "--seq", str(c["seq"]), "--threads", str(args.threads),
            "--seed", "1", "--out", out_dir, "--eval-every", "0", "--save-every", "0"]


def run_shardlm(args, config):
    with tempfile.TemporaryDirectory(prefix=f"shardlm_bench_{config}_") as out_dir:
        cmd = shardlm_cmd(args, config, out_dir)
        p, util, others = run_measured(cmd)
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
                if "step_ms" in rec:  # the step itself, as the torch loop times it
                    steps.append(float(rec.get("compute_ms", rec["step_ms"])))
        if len(steps) <= args.warmup:
            raise SystemExit(f"{path}: {len(steps)} records with step_ms, need more than --warmup {args.warmup}")
        return steps[args.warmup:], util, others


def fmt(x):
    return "—" if x is None else f"{x:.1f}"


def int_list(text, flag):
    try:
        out = [int(t) for t in text.split(",") if t]
    except ValueError:
        raise SystemExit(f"{flag}: not a comma list of integers: {text!r}") from None
    if not out or min(out) < 1:
        raise SystemExit(f"{flag}: need thread counts >= 1, got {text!r}")
    return out


def main():
    ap = argparse.ArgumentParser(description="shardlm vs PyTorch training speed",
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--configs", default=DEFAULT_CONFIGS, help="comma list of " + ", ".join(CONFIGS))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10, help="steps per run, warm-up included")
    ap.add_argument("--warmup", type=int, default=4,
                    help="steps per run not timed (torch's first 4 steps page-fault its heap in, 1.5-4x slower)")
    ap.add_argument("--threads", type=int, default=2, help="shardlm threads")
    ap.add_argument("--torch-threads", default="1,2",
                    help="comma list of torch intra-op thread counts (torch.set_num_threads, OMP_NUM_THREADS)")
    ap.add_argument("--blas-threads", default="1,2", help="comma list of OpenBLAS thread counts (OPENBLAS_NUM_THREADS)")
    ap.add_argument("--torch-malloc", default="tuned",
                    help="comma list: tuned (GLIBC_TUNABLES keeps freed memory; much faster torch on CPU), "
                         "default (glibc as is). torch's best over all variants is used for the ratio")
    ap.add_argument("--binary", default=os.path.join(ROOT, "build", "shardlm"))
    ap.add_argument("--data", default=os.path.join(ROOT, "data", "bench"), help="token file prefix")
    ap.add_argument("--tokens", type=int, default=200_000)
    ap.add_argument("--torch-only", action="store_true", help="skip shardlm (no binary needed)")
    ap.add_argument("--json", help="also write the results here")
    # internal: one torch measurement in a fresh process
    ap.add_argument("--torch-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--blas-check-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--config", help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.torch_worker:
        return torch_worker(args)
    if args.blas_check_worker:
        return blas_check_worker(args)

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
    variants = [(i, b, m) for m in mallocs for i in int_list(args.torch_threads, "--torch-threads")
                for b in int_list(args.blas_threads, "--blas-threads")]

    ensure_data(args.data, args.tokens)
    blas = require_openblas()
    avx512 = has_avx512f()
    print("command: " + shlex.join([sys.executable] + sys.argv), flush=True)
    print("torch: OPENBLAS_CORETYPE=" + ("SkylakeX (avx512f present)" if avx512 else
                                          f"{os.environ.get('OPENBLAS_CORETYPE')} (inherited; no avx512f)") +
          f", {blas}, set_flush_denormal(True); variants: intra-op threads (set_num_threads, OMP_NUM_THREADS) "
          f"{args.torch_threads} x OPENBLAS_NUM_THREADS {args.blas_threads} x malloc {','.join(mallocs)}"
          + (f"; tuned malloc = GLIBC_TUNABLES={TUNED_MALLOC}" if "tuned" in mallocs else ""), flush=True)
    if not args.torch_only:
        print("shardlm: " + shlex.join(shardlm_cmd(args, configs[0], "DIR")) + "  (per config)", flush=True)
    print(f"machine: {os.cpu_count()} cpus, load average {loadavg():.2f} at start", flush=True)
    print("OpenBLAS threads check:", flush=True)
    blas_check, blas_ok = check_blas_threads()

    results = {}
    busy_runs = []
    for config in configs:
        sl, tt = [], {v: [] for v in variants}
        sl_rounds, tt_rounds = [], {v: [] for v in variants}  # per-round medians
        tt_util = {v: [] for v in variants}
        for r in range(args.rounds):
            if not args.torch_only:
                s, util, others = run_shardlm(args, config)
                sl += s
                sl_rounds.append(statistics.median(s))
                if others > BUSY_OTHERS:
                    busy_runs.append(f"{config} round {r + 1} shardlm")
                print(f"[{config} round {r + 1}] shardlm {args.threads} thr: {statistics.median(s):.1f} ms/step "
                      f"(cpu/wall {util:.2f}, others {others:.2f} cores, load {loadavg():.2f})", flush=True)
            for v in variants:
                s, info = run_torch(args, config, v)
                tt[v] += s
                tt_rounds[v].append(statistics.median(s))
                util = sum(info["cpu_ms"][args.warmup:]) / sum(info["step_ms"][args.warmup:])
                tt_util[v].append(util)
                if info["others"] > BUSY_OTHERS or util < 0.8:
                    busy_runs.append(f"{config} round {r + 1} torch {variant_name(v)}")
                print(f"[{config} round {r + 1}] torch {variant_name(v)}: {statistics.median(s):.1f} ms/step "
                      f"(cpu/wall {util:.2f}, others {info['others']:.2f} cores, load {loadavg():.2f}; "
                      f"loss {info['losses'][0]:.3f} -> {info['losses'][-1]:.3f})", flush=True)
        med_t = {v: statistics.median(x) for v, x in tt.items()}
        best = min(med_t, key=med_t.get)
        med_s = statistics.median(sl) if sl else None
        results[config] = {"shardlm_ms": med_s, "shardlm_best_round_ms": min(sl_rounds) if sl_rounds else None,
                           "torch_ms": {variant_name(v): m for v, m in med_t.items()},
                           "torch_best_round_ms": {variant_name(v): min(x) for v, x in tt_rounds.items()},
                           "torch_cpu_per_wall": {variant_name(v): statistics.median(x) for v, x in tt_util.items()},
                           "torch_timed_steps_ms": {variant_name(v): x for v, x in tt.items()},
                           "shardlm_timed_steps_ms": sl,
                           "torch_best": variant_name(best), "torch_best_ms": med_t[best], "best_v": best,
                           "ratio": (med_s / med_t[best]) if med_s else None, "shape": CONFIGS[config]}

    print()
    print(f"median ms/step over {args.rounds} round(s) × {args.steps - args.warmup} timed steps "
          f"(first {args.warmup} of each run skipped), in brackets the fastest round's median, then "
          f"cpu/wall of the timed steps; * = the config's best torch variant")
    print()
    print("| torch variant | " + " | ".join(f"{c} {CONFIGS[c]['batch']}×{CONFIGS[c]['seq']}" for c in configs) + " |")
    print("|---|" + "---|" * len(configs))
    for v in variants:
        cells = []
        for config in configs:
            r = results[config]
            n = variant_name(v)
            cells.append(f"{fmt(r['torch_ms'][n])} ({fmt(r['torch_best_round_ms'][n])}; "
                         f"{r['torch_cpu_per_wall'][n]:.2f})" + (" *" if v == r["best_v"] else ""))
        print(f"| {variant_name(v)} | " + " | ".join(cells) + " |")
    print()
    print("ratio = shardlm / best torch, both medians")
    print()
    print("| config | B×T | shardlm threads | shardlm ms/step | best torch ms/step | best torch variant | ratio |")
    print("|---|---|---|---|---|---|---|")
    for config in configs:
        r, c = results[config], CONFIGS[config]
        scol = fmt(r["shardlm_ms"]) + ("" if r["shardlm_ms"] is None else f" ({fmt(r['shardlm_best_round_ms'])})")
        ratio = "—" if r["ratio"] is None else f"{r['ratio']:.2f}"
        print(f"| {config} | {c['batch']}×{c['seq']} | {args.threads} | {scol} | {fmt(r['torch_best_ms'])} | "
              f"{r['torch_best']} | {ratio} |")
    print(f"\nload average {loadavg():.2f} at end")
    if not blas_ok:
        print("WARNING: the OpenBLAS thread check did not come out as expected (see above)")
    if busy_runs:
        print(f"WARNING: the machine was busy (other processes above {BUSY_OTHERS} cores, or a torch run "
              f"under 0.8 cpu/wall) during: " + "; ".join(busy_runs) + ". The figures are not clean; re-run.")
    if args.json:
        for r in results.values():
            r["best_v"] = list(r["best_v"])
        with open(args.json, "w") as f:
            json.dump({"command": sys.argv, "avx512f": avx512, "blas_check": blas_check, "results": results},
                      f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
