#!/usr/bin/python3
"""Activation recompute: step time and peak activation bytes for none, selective and full.

  /usr/bin/python3 bench/recompute.py [--model llama-small --batch 8 --seq 256 --steps 5 --rounds 2]

Each mode is a fresh `build/shardlm train` process on data/bench (random GPT-2 tokens, made by
bench/vs_torch.py or here) with 2 threads; modes alternate within a round so that drift of the
machine falls on all alike. Reported: the median step_ms over the steps after the first two of
every round, the activations category's own peak (`mem_max`, from the allocator) and the ratios
to `none`.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import vs_torch  # noqa: E402  (its token-file helpers)


def run(mode, args, out):
    cmd = [os.path.join(ROOT, "build", "shardlm"), "train", "--model", args.model, "--data", args.data,
           "--steps", str(args.steps), "--batch", str(args.batch), "--seq", str(args.seq), "--threads", "2",
           "--seed", "1", "--out", out, "--eval-every", "0", "--eval-windows", "1", "--sample-tokens", "0",
           "--peak-gflops", "100", "--quiet", "--recompute", mode]
    subprocess.run(cmd, check=True)
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl")) if '"loss"' in line]
    return [r["step_ms"] for r in rows[2:]], rows[-1]["mem_max"]["activations"], [r["loss"] for r in rows]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="llama-small")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--data", default=os.path.join(ROOT, "data", "bench"))
    p.add_argument("--tokens", type=int, default=200_000)  # as bench/vs_torch.py makes it
    args = p.parse_args()
    vs_torch.ensure_data(args.data, args.tokens)
    modes = ["none", "selective", "full"]
    ms = {m: [] for m in modes}
    act, losses = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for m in modes:
                t, a, l = run(m, args, os.path.join(tmp, f"{m}{r}"))
                ms[m] += t
                act[m], losses[m] = a, l
    print(f"{args.model} B={args.batch} T={args.seq}, 2 threads, {args.rounds} rounds x {args.steps - 2} timed steps")
    print("| recompute | ms/step (median) | vs none | peak activations MiB | vs none | losses equal to none |")
    print("|---|---|---|---|---|---|")
    base_ms, base_act = statistics.median(ms["none"]), act["none"]
    for m in modes:
        med = statistics.median(ms[m])
        print(f"| {m} | {med:.0f} | {med / base_ms:.2f} | {act[m] / 2**20:.1f} | {act[m] / base_act:.2f} | "
              f"{'bitwise' if losses[m] == losses['none'] else 'NO'} |")


if __name__ == "__main__":
    main()
