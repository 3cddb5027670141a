#!/usr/bin/python3
"""How much of the communication in a shardlm trace runs under compute.

  python3 bench/trace_overlap.py bench/out/fsdp_trace.json

For each rank and each collective kind: the time comm-stream slices were in flight, and how much
of it a compute-stream slice of the same rank covered. A collective's slice runs from its issue
to its completion, so time spent waiting for a slower peer counts as communication too.
"""
import collections
import json
import sys


def covered(interval, busy):
    """Length of `interval` covered by the sorted, disjoint intervals `busy`."""
    a, b = interval
    return sum(max(0, min(b, y) - max(a, x)) for x, y in busy if y > a and x < b)


def main():
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    events = json.load(open(sys.argv[1]))["traceEvents"]
    thread = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
              if e.get("ph") == "M" and e["name"] == "thread_name"}
    slices = [e for e in events if e.get("ph") == "X"]
    print("| rank | collective | in flight ms | under compute ms | share |")
    print("|---|---|---|---|---|")
    for rank in sorted({e["pid"] for e in slices}):
        mine = [e for e in slices if e["pid"] == rank]
        busy = sorted((e["ts"], e["ts"] + e["dur"]) for e in mine if thread[(rank, e["tid"])] == "compute")
        flight, under = collections.Counter(), collections.Counter()
        for e in mine:
            if thread[(rank, e["tid"])] != "comm":
                continue
            kind = e["name"].split(" ")[0]
            flight[kind] += e["dur"] / 1e3
            under[kind] += covered((e["ts"], e["ts"] + e["dur"]), busy) / 1e3
        for kind in sorted(flight):
            print(f"| {rank} | {kind} | {flight[kind]:.0f} | {under[kind]:.0f} | {under[kind] / flight[kind]:.0%} |")
        total, total_under = sum(flight.values()), sum(under.values())
        print(f"| {rank} | all | {total:.0f} | {total_under:.0f} | {total_under / total:.0%} |")


if __name__ == "__main__":
    main()
