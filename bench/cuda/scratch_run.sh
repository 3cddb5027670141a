#!/bin/bash
# A device budget on the GPU (docs/cuda.md): the kernels' own scratch sized by the plan,
# so a device budget holds to the byte, and the offload tier's copies on a lane of their own. Run on
# the device machine with DIR packed by bench/cuda/ranks_pack.sh (carried):
#   1. cuda_tests (every kernel; each call's scratch against the plan's figure; the copy lane);
#   2. MEM runs, one process each: the plan's peak (`explain`, the same flags) against the
#      allocator's in each step (metrics' mem.total; the run's, evaluation included, beside it), any
#      scratch overflow, losses against the run named as its reference, median step_ms of steps 2+;
#   3. offload runs of `small` (fp32 GEMMs, 10 steps) against the resident one: the same losses.
# Settings: TESTS=0 skips 1; MEM / OFFLOAD override the runs (NAME:REF:RANKS:FLAGS;...).
set -o pipefail
D=$(cd "${DIR:-bench/out/devranks}" && pwd)
R=/tmp/scratch_run; rm -rf "$R"; mkdir -p "$R"
O=${OUT:-/tmp/scratch_out}; mkdir -p "$O"
source "$(dirname "$0")/packed_env.sh"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$R/gpu.txt"

if [ "${TESTS:-1}" = 1 ]; then
  timeout 240 cuda_tests > "$R/cuda_tests.log" 2>&1; echo "cuda_tests rc=$?"
  grep -E "^\[  (PASSED|FAILED) |tests? ran|^SCRATCH" "$R/cuda_tests.log" | head -60
fi

# NAME:REF:RANKS:FLAGS — REF the run whose losses it must equal (- for none).
big="--batch 16 --seq 1024 --steps ${STEPS:-8} --strategy ddp"
MEM=${MEM:-"gpt2-bf16:-:1:--model gpt2-124m $big;\
gpt2-fp32:-:1:--model gpt2-124m $big --compute-dtype fp32;\
gpt2-fp32-6GB:gpt2-fp32:1:--model gpt2-124m $big --compute-dtype fp32 --memory-budget 6GB;\
gpt2-fp32-act:gpt2-fp32:1:--model gpt2-124m $big --compute-dtype fp32 --offload activations;\
llama-fp32:-:1:--model llama-small $big --compute-dtype fp32;\
llama-fp32-2000MB:llama-fp32:1:--model llama-small $big --compute-dtype fp32 --memory-budget 2000MB"}
small="--model small --seq 256 --steps 10 --compute-dtype fp32"
OFFLOAD=${OFFLOAD:-"small:-:1:$small --batch 8 --strategy ddp;\
small-off-all:small:1:$small --batch 8 --strategy ddp --offload params,grads,optimizer,activations;\
small-fsdp2-off-state:small:2:$small --batch 4 --strategy fsdp --offload params,grads,optimizer"}
common="--data $D/data/kjv --lr 1e-3 --min-lr 1e-4 --warmup 10 --eval-every 0 --eval-windows 4 --sample-tokens 0
        --seed 1337 --threads 2 --device ${DEVICE:-cuda}"
IFS=';' read -ra runs <<< "$MEM;$OFFLOAD"
for spec in "${runs[@]}"; do
  name=${spec%%:*}; rest=${spec#*:}; ref=${rest%%:*}; rest=${rest#*:}; np=${rest%%:*}; flags=${rest#*:}
  echo "$name:$ref" >> "$R/names.txt"
  # explain takes the plan's flags (not --steps).
  eflags=$(echo "$flags" | sed 's/--steps [0-9]*//')
  shardlm explain --ranks "$np" $eflags --device ${DEVICE:-cuda} > "$R/$name.explain" 2>&1
  if [ "$np" = 1 ]; then
    timeout 120 shardlm train $common $flags --out "$R/$name" > "$R/$name.log" 2>&1
  else
    timeout 120 mpirun -np "$np" shardlm train $common $flags --out "$R/$name" > "$R/$name.log" 2>&1
  fi
  echo "$name rc=$? ($flags)"; grep -E "accounted peak|warning|error" "$R/$name.log" | head -3
done
python3 - "$R" <<'PY' | tee "$R/compare.txt"
import json, re, sys
R = sys.argv[1]
def rows(name):
    try:
        return [json.loads(l) for l in open(f"{R}/{name}/metrics.jsonl") if '"step"' in l and '"loss"' in l]
    except OSError:
        return []
def grab(path, pattern):
    try:
        m = re.search(pattern, open(path).read())
        return int(m.group(1)) if m else None
    except OSError:
        return None
print(f"{'run':24} {'plan peak':>14} {'step peak':>14} {'diff':>10} {'run peak':>14} {'overflow':>8} {'max|dloss| vs ref':>18} {'median ms':>10}")
for line in open(f"{R}/names.txt"):
    name, ref = line.strip().split(":")
    plan = grab(f"{R}/{name}.explain", r"total at peak: (\d+)")
    run = grab(f"{R}/{name}.log", r"accounted peak memory over the run: (\d+)")
    over = grab(f"{R}/{name}.log", r"warning: (\d+) kernel calls")
    mine = rows(name)
    got = max((r["mem"]["total"] for r in mine), default=None)  # the allocator's, each step
    ms = sorted(r["step_ms"] for r in mine[1:])
    med = f"{ms[len(ms)//2]:.1f}" if ms else "n/a"
    dl = "-"
    if ref != "-":
        other = rows(ref)
        dl = f"{max((abs(a['loss'] - b['loss']) for a, b in zip(mine, other)), default=float('nan')):.2e}" if mine and other else "n/a"
    diff = got - plan if plan is not None and got is not None else None
    print(f"{name:24} {plan!s:>14} {got!s:>14} {diff!s:>10} {run!s:>14} {over or 0!s:>8} {dl:>18} {med:>10}")
    print("  losses:", " ".join(f"{r['loss']:.6f}" for r in mine))
PY
cp "$R/compare.txt" "$R/cuda_tests.log" "$O/" 2>/dev/null
tar czf "$O/scratch_runs.tgz" -C "$R" --exclude='*.trace.json' . 2>/dev/null; ls -la "$O"
