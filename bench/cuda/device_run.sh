#!/bin/bash
# One device run: CUDA tests, kernel bench, 50-step small/llama-small (bf16) vs CPU curves,
# GPT-2 124M B16 T1024 training bench, PyTorch eager. Logs in /tmp/r, tarred to $OUT/results.tgz.
set -o pipefail
. .devcarry/env.sh  # bench/cuda/device_env.sh, carried as .devcarry/env.sh
export SHARDLM_DATA_DIR=$(pwd)/.devcarry/data
D=.devcarry; R=/tmp/r; rm -rf $R; mkdir -p $R  # a warm machine keeps /tmp between calls
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.limit --format=csv | tee $R/gpu.txt
if [ "${TESTS:-1}" = 1 ]; then
  timeout 300 $D/cuda_tests ${FILTER:+--gtest_filter=$FILTER} > $R/cuda_tests.log 2>&1; echo "cuda_tests rc=$?"
  grep -E "FAILED|PASSED|Failure" $R/cuda_tests.log | head -20
  grep -E "^KERNEL (linear|dense|lm_head)" $R/cuda_tests.log | head -30
fi
if [ "${KB:-1}" = 1 ]; then
  timeout 120 $D/cuda_kernels_bench > $R/kernels_bench.txt 2>&1; echo "kernels_bench rc=$?"
  cat $R/kernels_bench.txt
fi
if [ "${CONV:-1}" = 1 ]; then
  for m in small llama-small; do
    timeout 120 $D/shardlm train --model $m --data $D/data/kjv --steps 50 --batch 8 --seq 256 --lr 1e-3 --min-lr 1e-4 \
      --warmup 10 --eval-every 0 --eval-windows 8 --sample-tokens 0 --strategy ddp --seed 1337 --threads 2 --device cuda \
      --compute-dtype bf16 --out $R/$m-bf16 > $R/$m-bf16.log 2>&1
    echo "$m bf16 rc=$? $(tail -2 $R/$m-bf16.log | head -1)"
  done
fi
if [ "${TRAIN:-1}" = 1 ]; then
  # name=ENV settings (comma-separated) of each 124M run; "default" runs as shipped.
  for v in ${VARIANTS:-default}; do
    name=${v%%=*}; envs=""; [ "$name" != "$v" ] && envs=$(echo ${v#*=} | tr ',' ' ')
    env $envs timeout 200 $D/shardlm train --model gpt2-124m --data $D/data/kjv --steps 12 --batch 16 \
      --seq 1024 --eval-every 0 --eval-windows 1 --sample-tokens 0 --strategy ddp --seed 1 --device cuda \
      --out $R/bench124m-$name > $R/bench124m-$name.log 2>&1
    echo "shardlm 124m $name ($envs) rc=$? median step ms: $(python3 -c "import json,statistics; ms=[json.loads(l)['step_ms'] for l in open('$R/bench124m-$name/metrics.jsonl') if 'step_ms' in l]; print(round(statistics.median(ms[1:]),2))")"
    tail -1 $R/bench124m-$name.log
  done
fi
if [ "${TORCH:-1}" = 1 ]; then
  python3 $D/cuda_vs_torch.py --batch 16 --seq 1024 --steps 20 --warmup 5 --json $R/torch_eager.json 2>&1 | tail -2
  [ "${COMPILE:-0}" = 1 ] && timeout 300 python3 $D/cuda_vs_torch.py --compile --batch 16 --seq 1024 --steps 20 \
    --warmup 5 --json $R/torch_compile.json 2>&1 | tail -1
fi
rm -rf $R/*/ckpt* $R/*/step_* 2>/dev/null
tar czf $OUT/results.tgz -C /tmp r; ls -la $OUT
