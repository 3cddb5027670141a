#!/usr/bin/python3
"""How much of the communication in a shardlm trace runs under compute.

  python3 bench/trace_overlap.py bench/out/fsdp_trace.json [--from-step K]

For each rank, each communication stream (every stream but "compute": "comm" for the strategy's
collectives, "exchange" for a mixture of experts' all-to-alls over ep) and each collective kind:
the time that stream's slices were in flight, and how much of it a compute-stream slice of the
same rank covered. A collective's slice runs from its issue to its completion, so time spent
waiting for a slower peer counts as communication too. Each stream ends with an "all" row; a
stream none of whose time ran under compute was exposed: the step waited for it. Only the
training steps' slices count (args.step >= K, default 0): the passes of evaluation and sampling
(step -1) are left out, and --from-step 1 leaves out the first step's warm-up too.
"""
import argparse
import collections
import json


def covered(interval, busy):
    """Length of `interval` covered by the sorted, disjoint intervals `busy`."""
    a, b = interval
    return sum(max(0, min(b, y) - max(a, x)) for x, y in busy if y > a and x < b)


def share(part, whole):
    return f"{part / whole:.0%}" if whole > 0 else "—"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace")
    ap.add_argument("--from-step", type=int, default=0, help="count the slices of steps >= this")
    args = ap.parse_args()
    events = json.load(open(args.trace))["traceEvents"]
    thread = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
              if e.get("ph") == "M" and e["name"] == "thread_name"}
    slices = [e for e in events if e.get("ph") == "X" and e.get("args", {}).get("step", 0) >= args.from_step]
    print("| rank | stream | collective | in flight ms | under compute ms | share |")
    print("|---|---|---|---|---|---|")
    for rank in sorted({e["pid"] for e in slices}):
        mine = [e for e in slices if e["pid"] == rank]
        busy = sorted((e["ts"], e["ts"] + e["dur"]) for e in mine if thread[(rank, e["tid"])] == "compute")
        flight, under = collections.Counter(), collections.Counter()
        for e in mine:
            stream = thread[(rank, e["tid"])]
            if stream == "compute":
                continue
            key = (stream, e["name"].split(" ")[0])
            flight[key] += e["dur"] / 1e3
            under[key] += covered((e["ts"], e["ts"] + e["dur"]), busy) / 1e3
        for stream in sorted({s for s, _ in flight}):
            kinds = sorted(k for s, k in flight if s == stream)
            for kind in kinds:
                f, u = flight[(stream, kind)], under[(stream, kind)]
                print(f"| {rank} | {stream} | {kind} | {f:.0f} | {u:.0f} | {share(u, f)} |")
            total = sum(flight[(stream, k)] for k in kinds)
            total_under = sum(under[(stream, k)] for k in kinds)
            print(f"| {rank} | {stream} | all | {total:.0f} | {total_under:.0f} | {share(total_under, total)} |")


if __name__ == "__main__":
    main()
