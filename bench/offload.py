#!/usr/bin/env python3
"""The disk tier against the resident run (BENCHMARKS.md, "Memory").

For one process and for fsdp at 2 ranks: STEPS steps of MODEL resident, then with parameters,
gradients and AdamW moments all on disk (--offload params,grads,optimizer). Checks the losses and
the final checkpoint files are bitwise equal, and prints the median step time of each, the bytes
a step reads and writes (the plan's, from `explain`) and the disk bandwidth that implies, and the
memory held between steps and at the peak per category.

  python3 bench/offload.py --data /tmp/kjv [--model small --steps 20 --batch 8 --seq 128 --threads 2]
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.join(ROOT, "build", "shardlm")
ENV = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
ALL = ["--offload", "params,grads,optimizer"]


def run(cmd):
    r = subprocess.run(cmd, env=ENV, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"failed ({r.returncode}): {' '.join(cmd)}\n{r.stdout}\n{r.stderr}")
    return r.stdout


def rows(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, f) if "loss" in r]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--model", default="small")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="/tmp/shardlm_offload_bench")
    ap.add_argument("--offload-dir", default="")
    a = ap.parse_args()
    ok = True
    for ranks in (1, 2):
        threads = max(1, a.threads // ranks)
        batch = a.batch // ranks  # the same global batch
        common = ["train", "--model", a.model, "--data", a.data, "--steps", str(a.steps), "--batch", str(batch),
                  "--seq", str(a.seq), "--threads", str(threads), "--seed", "1337", "--lr", "1e-3", "--warmup", "5",
                  "--eval-every", "0", "--sample-tokens", "0", "--save-every", str(a.steps), "--overwrite", "--quiet",
                  "--strategy", "fsdp"]
        launch = [BIN] if ranks == 1 else ["mpirun", "--oversubscribe", "-np", "2", BIN]
        res, off = f"{a.out}/resident_{ranks}", f"{a.out}/offloaded_{ranks}"
        run(launch + common + ["--out", res])
        extra = ALL + (["--offload-dir", a.offload_dir] if a.offload_dir else [])
        run(launch + common + ["--out", off] + extra)
        r, o = rows(res), rows(off)
        same_loss = [x["loss"] for x in r] == [x["loss"] for x in o]
        step = f"ckpt/step_{a.steps}"
        same_files = all(
            open(os.path.join(res, step, n), "rb").read() == open(os.path.join(off, step, n), "rb").read()
            for n in os.listdir(os.path.join(res, step)) if n.endswith(".safetensors"))
        ok = ok and same_loss and same_files
        med = lambda rr: statistics.median(x["step_ms"] for x in rr[2:])
        plan = run([BIN, "explain", "--model", a.model, "--batch", str(batch), "--seq", str(a.seq), "--threads",
                    str(threads), "--strategy", "fsdp", "--ranks", str(ranks)] + ALL)
        m = re.search(r"a step reads ([\d.]+) MiB and writes ([\d.]+) MiB", plan)
        read_mib, write_mib = float(m.group(1)), float(m.group(2))
        tr, to = med(r), med(o)
        print(f"{a.model} B={a.batch} (global) T={a.seq}, {ranks} rank(s) x {threads} thread(s), fsdp:")
        print(f"  losses bitwise equal: {same_loss}; step-{a.steps} checkpoint files bitwise equal: {same_files}")
        print(f"  median step: resident {tr:.0f} ms, offloaded {to:.0f} ms ({to / tr:.2f}x)")
        print(f"  a step moves (per rank, plan): read {read_mib:.1f} MiB, write {write_mib:.1f} MiB; "
              f"over the offloaded step time {(read_mib + write_mib) / (to / 1000):.0f} MiB/s")
        for cat in ("params", "grads", "optimizer"):
            print(f"  {cat}: between steps {r[-1]['mem_between_steps'][cat] / 2**20:.1f} -> "
                  f"{o[-1]['mem_between_steps'][cat] / 2**20:.1f} MiB, step peak {r[-1]['mem_max'][cat] / 2**20:.1f} -> "
                  f"{o[-1]['mem_max'][cat] / 2**20:.1f} MiB")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
