#!/usr/bin/python3
"""Per-rank memory of every strategy at 1-4 ranks: measured (metrics.jsonl) against the plan.

  /usr/bin/python3 bench/memory_table.py     # small, B=1 per rank, T=64, one step each

For each strategy and rank count it runs one training step of `small` and prints, per rank, the
bytes of params / grads / optimizer held between steps (mem_between_steps: the sharded or
replicated state) and the params / grads at the step's peak (state + gathered units and
unsharded gradient buffers alive at once), beside what `shardlm explain` says for the same plan.
"""
import json
import os
import re
import subprocess
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.join(ROOT, "build", "shardlm")
ENV = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")


def explain(strategy, ranks, group):
    cmd = [BIN, "explain", "--model", "small", "--batch", "1", "--seq", "64", "--strategy", strategy,
           "--ranks", str(ranks)] + (["--shard-group", str(group)] if group else [])
    text = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    static = {k: int(v) for k, v in re.findall(r"^  (\w+): static (\d+)", text, re.M)}
    return static


def measure(strategy, ranks, group, data):
    with tempfile.TemporaryDirectory(prefix="shardlm_mem_") as out:
        return measure_in(strategy, ranks, group, data, out)


def measure_in(strategy, ranks, group, data, out):
    cmd = ([] if ranks == 1 else ["mpirun", "--oversubscribe", "-np", str(ranks)]) + [
        BIN, "train", "--model", "small", "--data", data, "--batch", "1", "--seq", "64", "--threads", "1",
        "--steps", "1", "--strategy", strategy, "--eval-every", "0", "--eval-windows", "1", "--sample-tokens", "0",
        "--peak-gflops", "100", "--out", out, "--quiet"] + (["--shard-group", str(group)] if group else [])
    subprocess.run(cmd, check=True, env=ENV)
    row = [json.loads(l) for l in open(os.path.join(out, "metrics.jsonl")) if '"loss"' in l][0]
    return row["mem_between_steps"], row["mem"]


def main():
    import vs_torch
    data = os.path.join(ROOT, "data", "bench")
    vs_torch.ensure_data(data, 200_000)
    mib = lambda b: f"{b / 1048576:.1f}"
    print("| strategy | ranks | params | grads | optimizer | = plan | params at peak | grads at peak |")
    print("|---|---|---|---|---|---|---|---|")
    for strategy in ("ddp", "zero1", "zero2", "fsdp", "hybrid"):
        for ranks in (1, 2, 3, 4):
            group = 2 if strategy == "hybrid" and ranks == 4 else 0
            if strategy == "hybrid" and ranks != 4:
                continue
            held, peak = measure(strategy, ranks, group, data)
            plan = explain(strategy, ranks, group)
            same = all(held[k] == plan[k] for k in ("params", "grads", "optimizer"))
            name = strategy + (f" (G={group})" if group else "")
            print(f"| {name} | {ranks} | {mib(held['params'])} | {mib(held['grads'])} | {mib(held['optimizer'])} | "
                  f"{'yes' if same else 'NO'} | {mib(peak['params'])} | {mib(peak['grads'])} |", flush=True)


if __name__ == "__main__":
    import sys
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main()
