#!/usr/bin/python3
"""Distributed training speed: every shardlm strategy against PyTorch DDP (gloo), same model.

  /usr/bin/python3 bench/strategies.py                 # small, B=4 per rank, T=256, 2 ranks x 1 thread
  /usr/bin/python3 bench/strategies.py --steps 6 --strategies fsdp,ddp

shardlm:  mpirun --oversubscribe -np 2 build/shardlm train --model small --data data/bench
          --batch 4 --seq 256 --threads 1 --strategy S --steps N --eval-every 0 --sample-tokens 0
          (median step_ms of the timed steps from metrics.jsonl; tokens/s = 2·B·T / step time).
          The fsdp run also writes bench/out/fsdp_trace.json (open it in Perfetto).
torch:    torch.distributed (gloo; Debian's torch has no CPU FSDP and its gloo no reduce-scatter)
          DistributedDataParallel over tests/reference/gpt2_reference.py's GPT2, AdamW, clip 1.0,
          2 processes x 1 thread, flush-denormal on, OPENBLAS_CORETYPE=SkylakeX where the CPU has
          AVX-512, glibc malloc kept from returning memory to the kernel (vs_torch.TUNED_MALLOC).
          Same random llm.c token data.
Runs alternate between shardlm and torch so machine drift hits both.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import vs_torch  # noqa: E402  (token data helpers)

B, T, RANKS, VOCAB = 4, 256, 2, 50257


def run_shardlm(strategy, steps, warmup, out_dir, trace=None):
    out = os.path.join(out_dir, strategy)
    cmd = ["mpirun", "--oversubscribe", "-np", str(RANKS), os.path.join(ROOT, "build", "shardlm"), "train",
           "--model", "small", "--data", os.path.join(ROOT, "data", "bench"), "--batch", str(B), "--seq", str(T),
           "--threads", "1", "--strategy", strategy, "--steps", str(steps), "--eval-every", "0",
           "--eval-windows", "1", "--sample-tokens", "0", "--seed", "1", "--out", out, "--quiet"]
    if trace:
        cmd += ["--trace", trace]
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    subprocess.run(cmd, check=True, env=env)
    rows = [json.loads(l) for l in open(os.path.join(out, "metrics.jsonl")) if '"loss"' in l]
    timed = rows[warmup:]
    return ([r["step_ms"] for r in timed], [r["comm_exposed_ms"] for r in timed])


def torch_ddp_worker(rank, port, steps, result_path):
    import numpy as np
    import torch
    import torch.distributed as dist
    sys.path.insert(0, os.path.join(ROOT, "tests", "reference"))
    import gpt2_reference as ref
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=RANKS)
    cfg = ref.GPT2Config(6, 6, 384, VOCAB, 1024)
    model = ref.init_gpt2_(ref.GPT2(cfg), seed=1)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = ref.make_adamw(model, lr=3e-4, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
    tokens = vs_torch.read_token_file(os.path.join(ROOT, "data", "bench_train.bin"))
    rng = np.random.default_rng(rank)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        offs = rng.integers(0, len(tokens) - T - 1, size=B)
        x = torch.from_numpy(np.stack([tokens[o:o + T] for o in offs]).astype(np.int64))
        y = torch.from_numpy(np.stack([tokens[o + 1:o + T + 1] for o in offs]).astype(np.int64))
        _, loss = ddp(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        times.append((time.perf_counter() - t0) * 1000)
    if rank == 0:
        with open(result_path, "w") as f:
            json.dump(times, f)
    dist.destroy_process_group()


def run_torch_ddp(steps, warmup, out_dir):
    env = dict(os.environ)
    if "avx512f" in open("/proc/cpuinfo").read():
        env["OPENBLAS_CORETYPE"] = "SkylakeX"
    env["OMP_NUM_THREADS"] = env["OPENBLAS_NUM_THREADS"] = "1"
    # Keep freed memory in the heap (as a caching allocator would), or torch page-faults its
    # logits-sized buffers in again every step; see vs_torch.TUNED_MALLOC.
    env["GLIBC_TUNABLES"] = vs_torch.TUNED_MALLOC
    result = os.path.join(out_dir, "torch_ddp.json")
    port = 29500 + os.getpid() % 1000
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--torch-rank", str(r), "--port", str(port),
                               "--steps", str(steps), "--result", result], env=env) for r in range(RANKS)]
    for p in procs:
        if p.wait() != 0:
            raise SystemExit("torch DDP worker failed")
    return json.load(open(result))[warmup:]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--strategies", default="ddp,zero1,zero2,fsdp")
    ap.add_argument("--torch-rank", type=int, default=-1)
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--result", default="")
    args = ap.parse_args()
    if args.torch_rank >= 0:
        return torch_ddp_worker(args.torch_rank, args.port, args.steps, args.result)

    if not os.path.exists(os.path.join(ROOT, "build", "shardlm")):
        raise SystemExit("build/shardlm is missing: run bash scripts/setup.sh first")
    vs_torch.ensure_data(os.path.join(ROOT, "data", "bench"), 200_000)
    print("torch BLAS: " + vs_torch.require_openblas(), flush=True)
    out_dir = os.path.join(ROOT, "bench", "out")
    os.makedirs(out_dir, exist_ok=True)
    strategies = args.strategies.split(",")
    ours = {s: ([], []) for s in strategies}
    torch_ms = []
    for _ in range(args.rounds):
        for s in strategies:
            trace = os.path.join(out_dir, "fsdp_trace.json") if s == "fsdp" else None
            with tempfile.TemporaryDirectory(dir=out_dir) as run_dir:
                ms, exposed = run_shardlm(s, args.steps, args.warmup, run_dir, trace)
            ours[s][0].extend(ms)
            ours[s][1].extend(exposed)
        torch_ms.extend(run_torch_ddp(args.steps, args.warmup, out_dir))

    tokens = RANKS * B * T
    t_ms = statistics.median(torch_ms)
    print(f"\nsmall (L=6 C=384 NH=6 V=50257), B={B} per rank, T={T}, {RANKS} ranks x 1 thread, "
          f"{args.steps} steps ({args.warmup} untimed) x {args.rounds} round(s)\n")
    print("| run | ms/step | tokens/s | comm exposed ms/step | tokens/s vs torch DDP |")
    print("|---|---|---|---|---|")
    print(f"| PyTorch DDP (gloo) | {t_ms:.0f} | {tokens / t_ms * 1000:.0f} | - | 1.00 |")
    ddp_tps = None
    for s in strategies:
        ms = statistics.median(ours[s][0])
        tps = tokens / ms * 1000
        if s == "ddp":
            ddp_tps = tps
        print(f"| shardlm {s} | {ms:.0f} | {tps:.0f} | {statistics.median(ours[s][1]):.0f} | {t_ms / ms:.2f} |")
    if ddp_tps and "fsdp" in strategies:
        f_ms = statistics.median(ours["fsdp"][0])
        print(f"\nfsdp / ddp tokens/s: {tokens / f_ms * 1000 / ddp_tps:.2f}")


if __name__ == "__main__":
    main()
