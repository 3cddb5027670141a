#!/bin/bash
# Staged ranks on one GPU (docs/cuda.md). Run on the device machine from
# the repository root with DIR packed by bench/cuda/ranks_pack.sh (carried): cuda_tests, then GPT-2
# "small" in fp32 mode, 10 steps: one process ddp (--batch 8) against 2 ranks sharing the GPU
# (--batch 4 each, the same global batch) under ddp, zero2 and fsdp, collectives staged through
# host memory and the carried Open MPI. Prints each run's losses and the largest |difference| to
# the one-process run; logs and metrics under $OUT. Settings: TESTS=0 skips cuda_tests;
# COMPUTE=fp32|bf16 (the GEMMs); MODEL (default small); RUNS="NAME:RANKS:FLAGS;..." the multi-rank
# runs (default the three above; RANKS may be N/DP, N ranks of which DP read different batches, as
# under --cp); TAG names this invocation's outputs (default COMPUTE), so one call can run it twice.
set -o pipefail
D=$(cd "${DIR:-bench/out/devranks}" && pwd)
R=/tmp/ranks_run-${TAG:-${COMPUTE:-fp32}}; rm -rf "$R"; mkdir -p "$R"  # $OUT takes 8 files: summaries and tarballs
source "$(dirname "$0")/packed_env.sh"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$R/gpu.txt"
mpirun --version 2>&1 | head -1
mpirun -np 2 hostname 2>&1 | head -4 | tee "$R/mpi_check.txt"

if [ "${TESTS:-1}" = 1 ]; then
  timeout 120 cuda_tests > "$R/cuda_tests.log" 2>&1; echo "cuda_tests rc=$?"
  grep -E "^\[  (PASSED|FAILED) |tests? ran" "$R/cuda_tests.log" | head -8
fi

compute=${COMPUTE:-fp32}; tag=${TAG:-$compute}
common="--model ${MODEL:-small} --data $D/data/kjv --steps ${STEPS:-10} --seq 256 --lr 1e-3 --min-lr 1e-4 --warmup 10
        --eval-every 0 --eval-windows 4 --sample-tokens 0 --seed 1337 --threads 2 --device cuda --compute-dtype $compute"
timeout 90 shardlm train $common --batch 8 --strategy ddp --out "$R/one-ddp" > "$R/one-ddp.log" 2>&1
echo "one process ddp ($compute) rc=$?"; tail -2 "$R/one-ddp.log"
# RUNS: NAME:RANKS[/DP]:FLAGS entries separated by ';', each at --batch 8/DP (the same global batch;
# DP defaults to RANKS).
IFS=';' read -ra runs <<< "${RUNS:-two-ddp:2:--strategy ddp;two-zero2:2:--strategy zero2;two-fsdp:2:--strategy fsdp}"
names=()
for spec in "${runs[@]}"; do
  name=${spec%%:*}; rest=${spec#*:}; np=${rest%%:*}; flags=${rest#*:}; names+=("$name")
  dp=${np#*/}; np=${np%/*}
  timeout 80 mpirun -np $np shardlm train $common --batch $((8 / dp)) $flags --out "$R/$name" > "$R/$name.log" 2>&1
  echo "$np ranks $name ($flags) rc=$?"; tail -2 "$R/$name.log"
done
python3 - "$R" "${names[@]}" <<'PY' | tee "$R/compare.txt"
import json, sys
R, names = sys.argv[1], sys.argv[2:]
def rows(name):
    try:
        return [json.loads(l) for l in open(f"{R}/{name}/metrics.jsonl") if '"step"' in l and '"loss"' in l]
    except OSError:
        return []
def median(rs):
    ms = sorted(r["step_ms"] for r in rs[1:])
    return round(ms[len(ms) // 2], 1) if ms else "n/a"
ref = rows("one-ddp")
print("one-ddp loss:", " ".join(f"{r['loss']:.6f}" for r in ref), "| median step_ms (steps 2+)", median(ref))
for s in names:
    got = rows(s)
    n = min(len(ref), len(got))
    dl = max((abs(a["loss"] - b["loss"]) for a, b in zip(ref, got)), default=float("nan"))
    dn = max((abs(a["grad_norm"] - b["grad_norm"]) / abs(a["grad_norm"]) for a, b in zip(ref, got)), default=float("nan"))
    print(f"{s} ({n} steps) loss:", " ".join(f"{r['loss']:.6f}" for r in got))
    print(f"{s}: max |loss diff| {dl:.3e}, max rel grad-norm diff {dn:.3e}, median step_ms (steps 2+) {median(got)}, "
          f"comm exposed ms (last) {got[-1]['comm_exposed_ms'] if got else 'n/a'}")
PY
O=${OUT:-/tmp/ranks_out}; mkdir -p "$O"
cp "$R/compare.txt" "$O/compare-$tag.txt"; cp "$R/cuda_tests.log" "$O/" 2>/dev/null
tar czf "$O/runs-$tag.tgz" -C "$R" --exclude='*.trace.json' . 2>/dev/null; ls -la "$O"
