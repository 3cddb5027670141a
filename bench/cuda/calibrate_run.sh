#!/bin/bash
# `shardlm calibrate --device cuda` writes a GPU profile, and the simulator's
# prediction from it is checked against measured steps. Run on the device machine with DIR packed
# by bench/cuda/ranks_pack.sh (carried; cuBLAS, cudart and NCCL are found in the machine's own
# install, as nccl_run.sh finds them). One GPU, one process:
#   1. calibrate --device cuda once per GEMM dtype the runs use (bf16: the default; fp32:
#      --compute-dtype fp32), timing each run's model at its own batch and sequence
#      (--gemm-models NAME:BxT): profiles gpu-bf16.json, gpu-fp32.json;
#   2. each run trains STEPS steps (--device cuda, ddp, one process) and is simulated with its
#      dtype's profile (the same model, batch, sequence and strategy);
#   3. compare.txt: measured (median step_ms and compute_ms of steps 2..STEPS) against predicted.
# Step 0 runs cuda_tests' DeviceInfoAndSynchronize (what calibrate reads of the backend).
# Settings: RUNS="NAME:MODEL:BATCH:SEQ:DTYPE ..." (default: gpt2-124m B16 T1024 bf16, as
# docs/cuda.md measured 65.4 ms on an H100; small B8 T256 bf16 and fp32, section
# 5's 4.2 / 14.2 ms on an H200); STEPS (12); DEVICE (cuda; cpu with SHARDLM_TEST_CPU_AS_DEVICE=1
# tries the script's logic on a machine without a GPU). Outputs under $OUT: compare.txt, the
# profiles, runs.tgz (logs, metrics, simulated traces).
set -o pipefail
D=$(cd "${DIR:-bench/out/devranks}" && pwd)
R=/tmp/calibrate_run; rm -rf "$R"; mkdir -p "$R"
O=${OUT:-/tmp/calibrate_out}; mkdir -p "$O"
DEVICE=${DEVICE:-cuda}
STEPS=${STEPS:-12}
RUNS=${RUNS:-"gpt2-124m-bf16:gpt2-124m:16:1024:bf16 small-bf16:small:8:256:bf16 small-fp32:small:8:256:fp32"}
if [ "$DEVICE" = cuda ]; then
  CUB=$(dirname "$(find / -xdev -name 'libcublas.so.13*' 2>/dev/null | head -1)")
  CRT=$(dirname "$(find / -xdev -name 'libcudart.so.13*' 2>/dev/null | head -1)")
  NCCL=$(dirname "$(find / -xdev -name 'libnccl.so.2*' -not -path '/tmp/*' 2>/dev/null | head -1)")
  echo "cublas $CUB, cudart $CRT, nccl $NCCL" | tee "$R/libs.txt"
  export LD_LIBRARY_PATH=$D/lib:$CUB:$CRT:$NCCL:$LD_LIBRARY_PATH
  nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,power.limit,driver_version --format=csv,noheader | tee "$R/gpu.txt"
  ldd "$D/bin/shardlm" | grep -E "not found" | tee -a "$R/libs.txt"
else
  export LD_LIBRARY_PATH=$D/lib:$LD_LIBRARY_PATH
fi
export PATH=$D/bin:$PATH
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OPAL_PREFIX=$D/ompi PMIX_PREFIX=$D/pmix
export PMIX_PKGDATADIR=$D/pmix/share/pmix PMIX_PKGLIBDIR=$D/pmix/lib/pmix

# 0. What calibrate reads of the backend (name, memory, GEMM dtype, synchronize): one cuda test.
if [ "$DEVICE" = cuda ]; then
  timeout 60 cuda_tests --gtest_filter='CudaBackendTest.DeviceInfoAndSynchronize' > "$R/cuda_tests.log" 2>&1
  echo "cuda_tests DeviceInfoAndSynchronize rc=$?: $(grep -E '^DEVICE|^\[  (PASSED|FAILED) ' "$R/cuda_tests.log" | tr '\n' ' ')"
fi

# 1. One profile per dtype, each with the GEMM shapes of that dtype's runs.
for dtype in bf16 fp32; do
  models=""
  for run in $RUNS; do
    IFS=: read -r name model batch seq dt <<< "$run"
    [ "$dt" = "$dtype" ] && models="${models:+$models,}$model:${batch}x$seq"
  done
  [ -z "$models" ] && continue
  t0=$SECONDS
  timeout 120 shardlm calibrate --device "$DEVICE" --compute-dtype "$dtype" --gemm-models "$models" \
    --out "$R/gpu-$dtype.json" > "$R/calibrate-$dtype.log" 2>&1
  echo "calibrate $dtype ($models) rc=$? in $((SECONDS - t0)) s: $(tail -2 "$R/calibrate-$dtype.log" | cut -c1-300)"
done

# 2. Each run measured, then simulated with its dtype's profile.
for run in $RUNS; do
  IFS=: read -r name model batch seq dtype <<< "$run"
  t0=$SECONDS
  timeout 150 shardlm train --model "$model" --data "$D/data/kjv" --steps "$STEPS" --batch "$batch" --seq "$seq" \
    --eval-every 0 --eval-windows 1 --sample-tokens 0 --strategy ddp --seed 1 --device "$DEVICE" --compute-dtype "$dtype" \
    --out "$R/$name" > "$R/$name.log" 2>&1
  echo "train $name rc=$? in $((SECONDS - t0)) s: $(grep -m1 -o 'kernels [^,]*' "$R/$name.log") $(grep -E 'error' "$R/$name.log" | head -2 | cut -c1-300)"
  timeout 60 shardlm simulate --model "$model" --batch "$batch" --seq "$seq" --strategy ddp --ranks 1 \
    --hardware "$R/gpu-$dtype.json" --json --trace "$R/sim-$name.trace.json" > "$R/sim-$name.json" 2> "$R/sim-$name.err"
  echo "simulate $name rc=$?: $(head -c 200 "$R/sim-$name.json") $(head -c 300 "$R/sim-$name.err")"
done

# 3. The table.
python3 - "$R" $RUNS <<'PY' | tee "$R/compare.txt"
import json, os, statistics, sys
from collections import defaultdict
R, runs = sys.argv[1], sys.argv[2:]
def load(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None
for dtype in ("bf16", "fp32"):
    p = load(f"{R}/gpu-{dtype}.json")
    if not p:
        continue
    g = lambda k: p[k]["value"] if k in p else float("nan")
    print(f"profile {dtype}: {p['name']} ({p['compute_dtype']}): peak {g('peak_flops')/1e12:.1f} TFLOP/s, gemm_efficiency "
          f"{g('gemm_efficiency'):.3f}, memory_bw {g('memory_bw')/1e9:.0f} GB/s, pointwise_bw {g('pointwise_bw')/1e9:.0f} GB/s, "
          f"host_link_bw {g('host_link_bw')/1e9:.1f} GB/s, device_memory {g('device_memory')/2**30:.1f} GiB")
    for r in p.get("gemm_rates", {}).get("value", []):
        print(f"  gemm {r['m']}x{r['k']}x{r['n']}: forward {r['forward']/1e12:.1f}, backward {r['backward']/1e12:.1f} TFLOP/s")
    for r in p.get("attention_rates", {}).get("value", []):
        print(f"  attention T={r['t']} HS={r['hs']}: forward {r['forward']/1e12:.1f}, backward {r['backward']/1e12:.1f} TFLOP/s")
print()
print("| run | measured step_ms | measured compute_ms | predicted step_ms | predicted / measured step | "
      "accounted peak GB measured / predicted |")
print("| --- | --- | --- | --- | --- | --- |")
for run in runs:
    name = run.split(":")[0]
    rows = []
    try:
        with open(f"{R}/{name}/metrics.jsonl") as f:
            rows = [json.loads(l) for l in f if '"step_ms"' in l]
    except OSError:
        pass
    rows = sorted(rows, key=lambda r: r["step"])[1:]  # steps 2.. (the first pays the start-up)
    step = statistics.median(r["step_ms"] for r in rows) if rows else float("nan")
    comp = statistics.median(r.get("compute_ms", r["step_ms"]) for r in rows) if rows else float("nan")
    mem = max((r["mem"]["total"] for r in rows if "mem" in r), default=0)
    sim = load(f"{R}/sim-{name}.json") or {}
    pred = sim.get("step_ms", float("nan"))
    pmem = sim.get("mem", {}).get("total", 0)
    print(f"| {name} | {step:.2f} ({len(rows)} steps) | {comp:.2f} | {pred:.2f} | {pred / step:.3f} | "
          f"{mem / 1e9:.2f} / {pmem / 1e9:.2f} |")
print()
# Where the prediction puts the time: the simulated trace's compute slices by kind of task.
for run in runs:
    name = run.split(":")[0]
    t = load(f"{R}/sim-{name}.trace.json")
    if not t:
        continue
    by = defaultdict(float)
    for e in t.get("traceEvents", []):
        if e.get("ph") == "X":
            by[e["name"].split(" ")[0]] += e.get("dur", 0) / 1e3
    print(f"{name} predicted ms by task kind: " + ", ".join(f"{k} {v:.2f}" for k, v in sorted(by.items(), key=lambda kv: -kv[1])))
PY
cp "$R/compare.txt" "$R"/gpu-*.json "$R/gpu.txt" "$R/libs.txt" "$R/cuda_tests.log" "$O/" 2>/dev/null
tar czf "$O/runs.tgz" -C "$R" --exclude='ckpt*' --exclude='step_*' . 2>/dev/null
ls -la "$O"
echo "total $SECONDS s"
