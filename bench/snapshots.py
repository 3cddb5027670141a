#!/usr/bin/python3
"""In-memory snapshots: their cost per step and how fast a crashed run comes back.

  /usr/bin/python3 bench/snapshots.py                  # small, fsdp, 2 ranks x 1 thread, B=4 T=256
  /usr/bin/python3 bench/snapshots.py --steps 8 --model tiny

Every run: mpirun --oversubscribe -np 2 build/shardlm train --model M --data /work/main/data/bench
  --batch 4 --seq 256 --threads 1 --strategy fsdp --steps N --eval-every 0 --eval-windows 1
  --sample-tokens 0 --peak-gflops 100 [--snapshot-every K]
Overhead: the median step_ms (metrics.jsonl; the step alone) and the median time `train` prints
per snapshot (copy + xxh64 + partner copy over MPI), skipping the first step; per step at K it
costs snapshot_ms / K, so the ratio is 1 + snapshot_ms / (K * step_ms).
Recovery: a run with --snapshot-every 1 --save-every 2 has rank 1 killed at step 4
(SHARDLM_FAULT_KILL=1:4); the relaunch with --resume auto (the snapshot of step 4) and one with
--resume DIR/ckpt/step_4 (the disk checkpoint of the same step), neither taking snapshots or
checkpoints, print how long loading took; the wall time of each relaunch to the end of the run
is measured too.
"""
import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")


def train(args, out, extra, env_extra=None, check=True):
    cmd = (["mpirun", "--oversubscribe", "-np", "2"] + (["-x", env_extra] if env_extra else []) +
           [os.path.join(ROOT, "build", "shardlm"), "train", "--model", args.model, "--data", args.data,
            "--batch", "4", "--seq", "256", "--threads", "1", "--strategy", "fsdp", "--steps", str(args.steps),
            "--eval-every", "0", "--eval-windows", "1", "--sample-tokens", "0", "--peak-gflops", "100",
            "--out", out] + extra)
    t0 = time.time()
    p = subprocess.run(cmd, env=ENV, capture_output=True, text=True)
    if check and p.returncode != 0:
        raise SystemExit(" ".join(cmd) + "\n" + p.stdout + p.stderr)
    return p.stdout + p.stderr, time.time() - t0


def step_ms(out):
    rows = [json.loads(l) for l in open(os.path.join(out, "metrics.jsonl")) if '"loss"' in l]
    return statistics.median(r["step_ms"] for r in rows[1:])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="small")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--data", default="/work/main/data/bench")
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix="shardlm_snapbench_")
    try:
        base = os.path.join(work, "base")
        train(args, base, [])
        print(f"no snapshots: step {step_ms(base):.0f} ms (median)")
        for k in (1, 5):
            out = os.path.join(work, f"k{k}")
            text, _ = train(args, out, ["--snapshot-every", str(k)])
            snaps = [float(m) for m in re.findall(r"snapshot of step \d+: [\d.]+ MB per rank into shared memory, (\d+) ms", text)]
            s, st = statistics.median(snaps[1:] or snaps), step_ms(out)
            print(f"--snapshot-every {k}: step {st:.0f} ms, snapshot {s:.0f} ms (median of {len(snaps)}), "
                  f"overhead {1 + s / (k * st):.3f}x")
        crash = os.path.join(work, "crash")
        train(args, crash, ["--snapshot-every", "1", "--save-every", "2"], "SHARDLM_FAULT_KILL=1:4", check=False)
        disk = os.path.join(work, "disk")
        shutil.copytree(crash, disk, ignore=shutil.ignore_patterns("*.lock"))
        for name, out, extra in (("snapshot", crash, ["--resume", "auto"]),
                                 ("disk", disk, ["--resume", os.path.join(disk, "ckpt", "step_4")])):
            text, wall = train(args, out, extra)
            loaded = re.search(r"resumed from .* in (\d+) ms", text)
            print(f"recovery from {name}: loading {loaded.group(1) if loaded else '?'} ms; relaunch to end of run "
                  f"({args.steps - 4} steps) {wall:.1f} s")
    finally:
        for run in ("base", "k1", "k5", "crash", "disk"):  # this bench's segments only
            subprocess.run([os.path.join(ROOT, "build", "shardlm"), "ckpt", "snapshots", "--clear", "--out",
                            os.path.join(work, run)], capture_output=True)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
