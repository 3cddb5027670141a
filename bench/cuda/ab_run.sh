#!/bin/bash
# A kernel change on one GPU, before against after in one lease (docs/cuda.md).
# Run on the device machine with DIR packed by bench/cuda/ranks_pack.sh (carried; its shardlm is
# "after") and BEFORE a shardlm built without the change: cuda_tests (TESTS=0 skips; GREP picks
# the lines shown), then each of MODELS (default gpt2-124m) at B16 T1024 (bf16 GEMMs, 12 steps)
# with each binary in turn, ROUNDS times; compare.txt: the median step_ms of steps 2..12 and the
# losses of steps 1, 4, 7, 10 of every run.
set -o pipefail
D=$(cd "${DIR:-bench/out/devranks}" && pwd)
R=/tmp/ab_run; rm -rf "$R"; mkdir -p "$R"
O=${OUT:-/tmp/ab_out}; mkdir -p "$O"
source "$(dirname "$0")/packed_env.sh"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$R/gpu.txt"
if [ "${TESTS:-1}" = 1 ]; then
  timeout 240 cuda_tests > "$R/cuda_tests.log" 2>&1; echo "cuda_tests rc=$?"
  grep -E "^\[  (PASSED|FAILED) |tests? ran|${GREP:-KERNEL lm_head}" "$R/cuda_tests.log"
fi
run="--batch 16 --seq 1024 --steps 12 --strategy ddp --lr 6e-4 --warmup 2 --data $D/data/kjv
     --eval-every 0 --eval-windows 4 --sample-tokens 0 --seed 1337 --threads 2 --device cuda"
for model in ${MODELS:-gpt2-124m}; do
  for round in $(seq 1 "${ROUNDS:-2}"); do
    for which in before after; do
      bin=shardlm; [ "$which" = before ] && bin=$BEFORE
      timeout 120 $bin train --model $model $run --out "$R/$model-$which-$round" > "$R/$model-$which-$round.log" 2>&1
      echo "$model $which round $round rc=$?"
    done
  done
done
python3 - "$R" <<'PY' | tee "$R/compare.txt"
import glob, json, sys
for d in sorted(glob.glob(f"{sys.argv[1]}/*-before-*") + glob.glob(f"{sys.argv[1]}/*-after-*")):
    if d.endswith(".log"):
        continue
    r = [json.loads(l) for l in open(f"{d}/metrics.jsonl") if '"loss"' in l and '"step"' in l]
    ms = sorted(x["step_ms"] for x in r[1:])
    print(d.split("/")[-1], "median step_ms", round(ms[len(ms) // 2], 2) if ms else "n/a",
          "losses", " ".join(f"{x['loss']:.6f}" for x in r[:12:3]))
PY
cp "$R/compare.txt" "$R/cuda_tests.log" "$O/" 2>/dev/null
tar czf "$O/ab_runs.tgz" -C "$R" --exclude='*.trace.json' . 2>/dev/null; ls -la "$O"
