#!/usr/bin/env python3
"""The longest sequence whose planned per-rank peak fits a memory budget, at each cp.

Reads `shardlm explain` (the plan's figures, which the allocator's equal: the distributed tests
hold them together) for sequence lengths in steps of --step and reports, per cp, the longest one
whose "total at peak" stays within --budget-mib, with its activation bytes.

  python3 bench/cp_longest.py --model llama-small --ranks 4 --cps 1,2,4 --budget-mib 1024
"""
import argparse
import re
import subprocess


def explain(args, cp, seq):
    cmd = [args.shardlm, "explain", "--model", args.model, "--max-seq", str(seq), "--seq", str(seq), "--batch", "1",
           "--strategy", args.strategy, "--ranks", str(args.ranks), "--cp", str(cp), "--cp-impl", args.cp_impl]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"explain failed: {' '.join(cmd)}\n{out.stderr}")
    total = int(re.search(r"total at peak: (\d+)", out.stdout).group(1))
    act = int(re.search(r"activations: static \d+, at peak (\d+)", out.stdout).group(1))
    return total, act


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shardlm", default="build/shardlm")
    p.add_argument("--model", default="llama-small")
    p.add_argument("--strategy", default="fsdp")
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--cps", default="1,2,4")
    p.add_argument("--cp-impl", default="ring")
    p.add_argument("--budget-mib", type=float, default=1024)
    p.add_argument("--step", type=int, default=512)
    a = p.parse_args()
    budget = a.budget_mib * 2**20
    print(f"{a.model} {a.strategy} on {a.ranks} ranks, B=1 a rank, cp-impl {a.cp_impl}, budget {a.budget_mib:g} MiB a rank")
    print("| cp | longest T (multiple of %d) | total at peak MiB | activations MiB |" % a.step)
    print("| --- | --- | --- | --- |")
    for cp in map(int, a.cps.split(",")):
        lo, hi = 0, a.step
        while explain(a, cp, hi)[0] <= budget:  # double until it no longer fits
            lo, hi = hi, 2 * hi
        while hi - lo > a.step:  # then bisect on multiples of step
            mid = (lo + hi) // 2 // a.step * a.step
            lo, hi = (mid, hi) if explain(a, cp, mid)[0] <= budget else (lo, mid)
        total, act = explain(a, cp, lo) if lo else (0, 0)
        print(f"| {cp} | {lo} | {total / 2**20:.1f} | {act / 2**20:.1f} |")


if __name__ == "__main__":
    main()
