#!/usr/bin/python3
"""The planner against the default flags, measured: for a model on N ranks under a memory budget
that rules out DDP, the planner's pick (trained by `plan --run`) against `train --strategy fsdp`
with default flags at the same global batch, run in turn, and the planner's predicted step time
against its measured one.

  /usr/bin/python3 bench/plan_vs_default.py                      # small, 2 ranks x 1 thread
  /usr/bin/python3 bench/plan_vs_default.py --hardware cal.json --rounds 3

budget:    simulate --strategy ddp --batch 1 --recompute full (DDP's least memory) minus 1 byte.
planner:   mpirun -np N build/shardlm plan --model M --ranks N --threads K --seq T --global-batch
           N·B·T --memory-per-rank BUDGET --hardware PROFILE --run --data PREFIX --run-steps STEPS
           (its "best (...): predicted X ms/step, measured Y" line).
default:   mpirun -np N build/shardlm train --model M --threads K --batch B --seq T --strategy fsdp
           --steps STEPS (median step_ms after 2 untimed).
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.join(ROOT, "build", "shardlm")
ENV = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")


def mpirun(ranks, args):
    return subprocess.run(["mpirun", "--oversubscribe", "-np", str(ranks), BIN, *args], check=True, env=ENV,
                          capture_output=True, text=True).stdout


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="small")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batch", type=int, default=4, help="sequences per rank of the default run")
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=2, help="planner and default runs, in turn")
    ap.add_argument("--hardware", default="cpu-local")
    ap.add_argument("--data", default=os.path.join(ROOT, "data", "bench"))
    a = ap.parse_args()
    common = ["--model", a.model, "--threads", str(a.threads), "--seq", str(a.seq)]
    ddp = json.loads(subprocess.run([BIN, "simulate", *common, "--ranks", str(a.ranks), "--strategy", "ddp", "--batch", "1",
                                     "--recompute", "full", "--hardware", a.hardware, "--json"],
                                    check=True, capture_output=True, text=True).stdout)
    budget = ddp["mem"]["total"] - 1
    tokens = a.ranks * a.batch * a.seq
    print(f"{a.model}, {a.ranks} ranks x {a.threads} thread(s), {tokens} tokens/step, T={a.seq}, budget {budget} bytes "
          f"(DDP's least memory - 1), profile {a.hardware}")
    planned, predicted, default, flags = [], [], [], ""
    with tempfile.TemporaryDirectory(prefix="plan_vs_default_") as tmp:
        for r in range(a.rounds):
            out = mpirun(a.ranks, ["plan", *common, "--ranks", str(a.ranks), "--global-batch", str(tokens),
                                   "--memory-per-rank", str(budget), "--hardware", a.hardware, "--top", "1", "--run",
                                   "--data", a.data, "--out", os.path.join(tmp, f"plan{r}"), "--overwrite",
                                   "--run-steps", str(a.steps)])
            m = re.search(r"best \((.*)\): predicted ([\d.]+) ms/step, measured ([\d.]+) ms/step", out)
            flags, predicted_ms, measured_ms = m.group(1), float(m.group(2)), float(m.group(3))
            planned.append(measured_ms), predicted.append(predicted_ms)
            run = os.path.join(tmp, f"default{r}")
            mpirun(a.ranks, ["train", *common, "--batch", str(a.batch), "--strategy", "fsdp", "--steps", str(a.steps),
                             "--data", a.data, "--out", run, "--eval-every", "0", "--eval-windows", "1",
                             "--sample-tokens", "0", "--quiet"])
            rows = [json.loads(l) for l in open(os.path.join(run, "metrics.jsonl")) if '"loss"' in l]
            default.append(statistics.median(row["step_ms"] for row in rows[2:]))
            print(f"round {r + 1}: planner {measured_ms:.0f} ms (predicted {predicted_ms:.0f}), default fsdp {default[-1]:.0f} ms",
                  flush=True)
    p, d = statistics.median(planned), statistics.median(default)
    print(f"planner's pick: {flags}")
    print(f"measured: planner {p:.0f} ms/step, default fsdp {d:.0f} ms/step, ratio {p / d:.3f}; "
          f"predicted {statistics.median(predicted):.0f} ms ({100 * (statistics.median(predicted) - p) / p:+.1f}% of measured)")


if __name__ == "__main__":
    main()
