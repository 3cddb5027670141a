#!/usr/bin/env bash
# The simulator against real runs on a cluster of namespaced hosts (scripts/cluster.sh), as root:
#  - 2 hosts x 1 rank at each link rate (default 1gbit and 10gbit): calibrate on the cluster, then
#    `small` under fsdp and ddp, each run REPEATS times, against `simulate` with that profile;
#  - 2 hosts x 2 ranks at 1gbit: fsdp against hybrid (shard inside a host), measured and
#    simulated, and which of the two `plan` ranks first.
#
#   bench/cluster_sim.sh OUT_DIR [RATE ...]
#
# Everything (profiles, runs, logs, summary.txt) goes to OUT_DIR, outside the repository. Knobs
# (environment): SHARDLM (build/shardlm), STEPS (6; the first 2 are left out of the medians),
# REPEATS (2), BATCH (1), SEQ (256), THREADS (1), SIZES_KIB (calibrate's collective sizes, from
# 1 MiB up: tbf's bucket lets a burst of 256 KiB through at memory speed, so smaller messages time
# the bucket, not the link), SHARDLM_CLUSTER (simbench). The cluster is removed on any exit.
set -euo pipefail

OUT="${1:?usage: bench/cluster_sim.sh OUT_DIR [RATE ...]}"
shift
RATES=("$@")
((${#RATES[@]})) || RATES=(1gbit 10gbit)
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SHARDLM="${SHARDLM:-$ROOT/build/shardlm}"
CLUSTER_SH="$ROOT/scripts/cluster.sh"
STEPS="${STEPS:-6}" REPEATS="${REPEATS:-2}" BATCH="${BATCH:-1}" SEQ="${SEQ:-256}" THREADS="${THREADS:-1}"
SIZES_KIB="${SIZES_KIB:-16384,65536}"
export SHARDLM_CLUSTER="${SHARDLM_CLUSTER:-simbench}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
export OMPI_MCA_orte_tmpdir_base="$OUT/ompi"
mkdir -p "$OMPI_MCA_orte_tmpdir_base"
trap '"$CLUSTER_SH" down >/dev/null 2>&1 || true' EXIT
trap 'exit 1' INT TERM

DATA="$OUT/kjv"
[[ -f "${DATA}_train.bin" ]] || "$SHARDLM" tokenize --tokenizer gpt2 --in "$ROOT/data/kjv/kjv.txt" --out "$DATA" >/dev/null

# calibrate DIR: the cluster's profile into DIR/profile.json.
calibrate() {
  "$CLUSTER_SH" run -- mpirun "$SHARDLM" calibrate --out "$1/profile.json" --threads "$THREADS" \
    --gemm-models "small:${BATCH}x$SEQ" --iters 9 --sizes-kib "$SIZES_KIB" >"$1/calibrate.log" 2>&1
}

# train DIR STRATEGY: STEPS steps of small on the cluster into DIR.
train() {
  "$CLUSTER_SH" run -- mpirun "$SHARDLM" train --model small --strategy "$2" --threads "$THREADS" --data "$DATA" \
    --steps "$STEPS" --batch "$BATCH" --seq "$SEQ" --eval-every 0 --eval-windows 2 --sample-tokens 0 \
    --out "$1" --overwrite >"$1.log" 2>&1
}

# simulate DIR STRATEGY RANKS: the profile's prediction as JSON into DIR/STRATEGY.sim.json.
simulate() {
  "$SHARDLM" simulate --hardware "$1/profile.json" --model small --strategy "$2" --ranks "$3" --threads "$THREADS" \
    --batch "$BATCH" --seq "$SEQ" --json >"$1/$2.sim.json"
}

# measure DIR HOSTS PER_HOST RATE STRATEGY...: a cluster, its profile, the runs and predictions.
measure() {
  local dir="$1" hosts="$2" per_host="$3" rate="$4" s r
  shift 4
  mkdir -p "$dir"
  "$CLUSTER_SH" up --hosts "$hosts" --ranks-per-host "$per_host" --link "$rate" >/dev/null
  calibrate "$dir"
  for s in "$@"; do
    simulate "$dir" "$s" $((hosts * per_host))
    for r in $(seq "$REPEATS"); do train "$dir/$s-$r" "$s"; done
  done
  "$CLUSTER_SH" down >/dev/null
  echo "done: $dir"
}

for rate in "${RATES[@]}"; do measure "$OUT/2x1-$rate" 2 1 "$rate" fsdp ddp; done
measure "$OUT/2x2-1gbit" 2 2 1gbit fsdp hybrid
# plan's ranking on the 2 x 2 profile, at the runs' batch (one configuration of tokens per rank).
"$SHARDLM" plan --hardware "$OUT/2x2-1gbit/profile.json" --model small --ranks 4 --threads "$THREADS" \
  --global-batch $((4 * BATCH * SEQ)) --seq "$SEQ" --top 400 >"$OUT/2x2-1gbit/plan.txt"

python3 - "$OUT" "$STEPS" "${RATES[@]}" <<'EOF' | tee "$OUT/summary.txt"
import glob, json, os, re, statistics, sys
out, steps, rates = sys.argv[1], int(sys.argv[2]), sys.argv[3:]

def measured(dir, strategy):
    """Per repeat: median step_ms, compute_ms and comm_exposed_ms over the steps after the first 2."""
    rows = []
    for run in sorted(glob.glob(f"{dir}/{strategy}-*/metrics.jsonl")):
        steps_ = [r for r in map(json.loads, open(run)) if "step_ms" in r][2:]
        rows.append({k: statistics.median(r[k] for r in steps_) for k in ("step_ms", "compute_ms", "comm_exposed_ms")})
    return rows

def line(dir, strategy):
    sim = json.load(open(f"{dir}/{strategy}.sim.json"))
    runs = measured(dir, strategy)
    step = statistics.median(r["compute_ms"] for r in runs)
    wall = statistics.median(r["step_ms"] for r in runs)
    exposed = statistics.median(r["comm_exposed_ms"] for r in runs)
    each = ", ".join(f"{r['compute_ms']:.0f}" for r in runs)
    err = 100 * (sim["step_ms"] - step) / step
    print(f"  {strategy:7s} measured step {step:7.0f} ms (repeats {each}; wall {wall:.0f}), exposed comm {exposed:6.0f} ms | "
          f"simulated step {sim['step_ms']:7.0f} ms ({err:+.1f}%), exposed comm {sim['comm_exposed_ms']:6.0f} ms")
    return step, sim["step_ms"], exposed, sim["comm_exposed_ms"]

def profile(dir):
    j = json.load(open(f"{dir}/profile.json"))
    for g in j["inter_node"].get("groups", []):
        figs = ", ".join(f"{op} {g[op]['latency_s']['value'] * 1e3:.2f} ms {g[op]['bus_bw']['value'] / 1e6:.0f} MB/s"
                         for op in ("all_gather", "reduce_scatter", "all_reduce"))
        print(f"  inter_node {g['ranks']} ranks, {g['per_node']} a node: {figs}")
    if j["devices_per_node"]["value"] > 1:
        figs = ", ".join(f"{op} {j['intra_node'][op]['bus_bw']['value'] / 1e6:.0f} MB/s" for op in ("all_gather", "reduce_scatter", "all_reduce"))
        print(f"  intra_node: {figs}")

results = {}
for rate in rates:
    d = f"{out}/2x1-{rate}"
    print(f"2 hosts x 1 rank at {rate}:")
    profile(d)
    for s in ("fsdp", "ddp"):
        results[(rate, s)] = line(d, s)
if len(rates) >= 2:
    a, b = rates[0], rates[-1]
    for s in ("fsdp", "ddp"):
        print(f"exposed comm {s}, {a} -> {b}: measured {results[(a, s)][2]:.0f} -> {results[(b, s)][2]:.0f} ms, "
              f"simulated {results[(a, s)][3]:.0f} -> {results[(b, s)][3]:.0f} ms")
d = f"{out}/2x2-1gbit"
print("2 hosts x 2 ranks at 1gbit:")
profile(d)
f = line(d, "fsdp")
h = line(d, "hybrid")
print(f"hybrid / fsdp step: measured {h[0] / f[0]:.3f}, simulated {h[1] / f[1]:.3f}")
best = {}
for l in open(f"{d}/plan.txt"):
    m = re.match(r"\s*(\d+)\s+([\d.]+)\s+\d+\s+[\d.]+%\s+[\d.]+\s+\d+\s+(\w+)", l)
    if m and m.group(3) in ("fsdp", "hybrid") and m.group(3) not in best:
        best[m.group(3)] = (int(m.group(1)), float(m.group(2)))
if len(best) == 2:
    choice = min(best, key=lambda s: best[s][0])
    faster = "hybrid" if h[0] < f[0] else "fsdp"
    print(f"plan: best fsdp row {best['fsdp'][0]} ({best['fsdp'][1]:.0f} ms), best hybrid row {best['hybrid'][0]} "
          f"({best['hybrid'][1]:.0f} ms): plan chooses {choice}; measured faster: {faster}")
EOF
