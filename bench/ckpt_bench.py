#!/usr/bin/python3
"""Sharded checkpoints: save and load time and bytes per rank; --async-save's cost to the steps.

  /usr/bin/python3 bench/ckpt_bench.py                       # small, llama-small at 1, 2, 4 ranks
  /usr/bin/python3 bench/ckpt_bench.py --models small --ranks 2 --data /work/main/data/bench

For each model and rank count N (fsdp, B=2 per rank, T=128, 1 thread per rank):
  save   mpirun -np N shardlm train --steps 4 --save-every 2: the time `train` prints for the
         second checkpoint (write, fsync, checksum read-back, barrier, index, rename, latest; the
         first warms the page cache); bytes per rank from the step directory's files.
  load   the same run resumed from that checkpoint (--resume DIR --steps 5): the time `train`
         prints for reading it (every rank checks every N-th file and reads its own ranges).
  async  --steps 12 --save-every 6 --async-save: step_ms (metrics.jsonl) of the steps that ran
         while a checkpoint was being written (from its start until `train` printed its commit)
         against the other steps (the first step excluded: warm-up), medians; and the time the
         training thread paused to copy the shard into staging (what `train` prints).
  control  (--control) the same 12 steps without checkpoints: the same steps against the same
         others, so the ratio this machine's noise gives with no save at all.
Nothing here is asserted; the table goes to BENCHMARKS.md with the machine's description.
"""
import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CKPT_RE = re.compile(r"^checkpoint (\S+): ([\d.]+) MB in (\d+) file\(s\), at most ([\d.]+) MB per rank, (\d+) ms"
                     r"(?: \(written in the background: training paused (\d+) ms to stage it, waited (\d+) ms)?")
STEP_RE = re.compile(r"^step\s+(\d+)/(\d+) ")
RESUMED_RE = re.compile(r"^resumed from \S+ in (\d+) ms")


def train(args, ranks, out, extra):
    cmd = ["mpirun", "--oversubscribe", "-np", str(ranks), args.binary, "train", "--model", args.model,
           "--data", args.data, "--batch", str(args.batch), "--seq", str(args.seq), "--threads", str(args.threads),
           "--strategy", "fsdp", "--eval-every", "0", "--eval-windows", "1", "--sample-tokens", "0", "--seed", "1",
           "--peak-gflops", "100", "--timeout", "600", "--out", out] + extra
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if r.returncode != 0:
        raise SystemExit(f"failed ({r.returncode}): {' '.join(cmd)}\n{r.stdout}\n{r.stderr}")
    return r.stdout.splitlines()


def step_ms(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return {row["step"]: row["step_ms"] for row in map(json.loads, f) if "loss" in row}


def measure(args, ranks, work):
    out = os.path.join(work, f"{args.model}_{ranks}")
    saves = [m for m in map(CKPT_RE.match, train(args, ranks, out, ["--steps", "4", "--save-every", "2"])) if m]
    step_dir = os.path.join(out, "ckpt", "step_4")
    sizes = [os.path.getsize(os.path.join(step_dir, f)) for f in os.listdir(step_dir) if f.endswith(".safetensors")]
    loaded = [m for m in map(RESUMED_RE.match, train(args, ranks, out, ["--steps", "5", "--save-every", "2",
                                                                         "--resume", out, "--resume-override",
                                                                         "steps"])) if m]
    shutil.rmtree(out)
    # --async-save: which steps ran while a write was in flight.
    total, every = 12, 6
    writing, during, stage = False, set(), []
    for line in train(args, ranks, out, ["--steps", str(total), "--save-every", str(every), "--async-save"]):
        if m := STEP_RE.match(line):
            n = int(m.group(1))
            if writing:
                during.add(n - 1)  # metrics.jsonl counts from 0
            writing = writing or (n % every == 0 and n < total)
        elif m := CKPT_RE.match(line):
            writing = False
            stage.append(float(m.group(6)))
    ms = step_ms(out)
    shutil.rmtree(out)
    normal = [v for s, v in ms.items() if s not in during and s > 0]
    busy = [v for s, v in ms.items() if s in during]
    control = float("nan")
    if args.control and busy:
        train(args, ranks, out, ["--steps", str(total)])
        c = step_ms(out)
        shutil.rmtree(out)
        control = (statistics.median([v for s, v in c.items() if s in during]) /
                   statistics.median([v for s, v in c.items() if s not in during and s > 0]))
    return {"control": control,
        "files": len(sizes), "max_bytes": max(sizes), "total_bytes": sum(sizes),
        "save_ms": float(saves[-1].group(5)), "load_ms": float(loaded[0].group(1)),
        "normal_ms": statistics.median(normal), "writing_ms": statistics.median(busy) if busy else float("nan"),
        "writing_steps": len(busy), "stage_ms": statistics.median(stage),
    }


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--binary", default=os.path.join(ROOT, "build", "shardlm"))
    p.add_argument("--data", default=os.path.join(ROOT, "data", "bench"))
    p.add_argument("--models", default="small,llama-small")
    p.add_argument("--ranks", default="1,2,4")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--control", action="store_true", help="also the same steps of a run without checkpoints")
    args = p.parse_args()
    work = tempfile.mkdtemp(prefix="shardlm_ckpt_bench_")
    print(f"fsdp, B={args.batch} per rank, T={args.seq}, {args.threads} thread(s) per rank, data {args.data}")
    print("| model | ranks | files | bytes per rank (max) | total | save | load | step (normal) | step while "
          "writing (async) | ratio | async stage pause |" + (" control ratio (no saves) |" if args.control else ""))
    print("|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" if args.control else ""))
    try:
        for model in args.models.split(","):
            for ranks in map(int, args.ranks.split(",")):
                args.model = model
                r = measure(args, ranks, work)
                print(f"| {model} | {ranks} | {r['files']} | {r['max_bytes'] / 1e6:.1f} MB | {r['total_bytes'] / 1e6:.1f} MB "
                      f"| {r['save_ms']:.0f} ms | {r['load_ms']:.0f} ms | {r['normal_ms']:.0f} ms "
                      f"| {r['writing_ms']:.0f} ms ({r['writing_steps']} steps) | {r['writing_ms'] / r['normal_ms']:.2f}x "
                      f"| {r['stage_ms']:.0f} ms |" + (f" {r['control']:.2f}x |" if args.control else ""), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
