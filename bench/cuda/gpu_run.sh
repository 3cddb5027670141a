#!/usr/bin/env bash
# One device-machine run (docs/cuda.md): the CUDA kernel tests, 50-step training runs of
# small and llama-small (bf16 and fp32 GEMMs), then GPT-2 124M B=16 T=1024 against PyTorch.
# Run from the repository root with the binaries in .gpu/ (see the notes); writes to $OUT.
. .gpu/env.sh
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.limit --format=csv > $R/gpu.txt
if [ "${SKIP_TESTS:-0}" != 1 ]; then .gpu/cuda_tests > $R/cuda_tests.log 2>&1; echo "cuda_tests rc=$?"; fi
common="--data .gpu/data/kjv --steps 50 --batch 8 --seq 256 --lr 1e-3 --min-lr 1e-4 --warmup 10 --eval-every 0
        --eval-windows 8 --sample-tokens 0 --strategy ddp --seed 1337 --threads 2 --device cuda"
for m in ${MODELS:-small llama-small}; do
  for dt in ${DTYPES:-bf16 fp32}; do
    timeout 120 .gpu/shardlm train --model $m $common --compute-dtype $dt --out $R/$m-$dt > $R/$m-$dt.log 2>&1
    echo "$m $dt rc=$? $(grep -c '"step"' $R/$m-$dt/metrics.jsonl 2>/dev/null) steps; $(tail -2 $R/$m-$dt.log | head -1)"
  done
done
if [ "${BENCH:-1}" = 1 ]; then
  timeout 200 .gpu/shardlm train --model gpt2-124m --data .gpu/data/kjv --steps 12 --batch 16 --seq 1024 --eval-every 0 \
    --eval-windows 1 --sample-tokens 0 --strategy ddp --seed 1 --device cuda --out $R/bench124m > $R/bench124m.log 2>&1
  echo "shardlm 124m rc=$?"; tail -4 $R/bench124m.log
  python3 .gpu/cuda_vs_torch.py --batch 16 --seq 1024 --steps 20 --warmup 5 --json $R/torch_eager.json 2>&1 | tail -1
  [ "${COMPILE:-1}" = 1 ] && timeout 240 python3 .gpu/cuda_vs_torch.py --compile --batch 16 --seq 1024 --steps 20 \
    --warmup 5 --json $R/torch_compile.json 2>&1 | tail -1
fi
tar czf $OUT/results.tgz -C $OUT r
