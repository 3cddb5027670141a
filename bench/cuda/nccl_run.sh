#!/bin/bash
# NCCL behind the communicator (docs/cuda.md). Run on the device
# machine with DIR packed by bench/cuda/ranks_pack.sh (carried; libnccl.so.2 is not in it, 218 MB:
# it is found in the machine's PyTorch install, as cuBLAS is). One GPU, so world size 1:
#   1. cuda_tests (NcclTest.*: every NcclCommunicator collective at world size 1 against expected
#      results, through split, the timeout of a held-back collective; and the backend's tests);
#   2. GPT-2 "small" fp32, 10 steps: one process with the default collectives against one process
#      --comm nccl (single-rank bootstrap) and mpirun -np 1 --comm nccl (MPI bootstrap) under ddp,
#      zero2 and fsdp (world 1 plans have no collectives: this proves the wiring and the losses);
#   3. the refusal: mpirun -np 2 --comm nccl on one GPU must end with one line on every rank.
# Outputs under $OUT: compare.txt, cuda_tests.log, runs.tgz.
set -o pipefail
D=$(cd "${DIR:-bench/out/devranks}" && pwd)
R=/tmp/nccl_run; rm -rf "$R"; mkdir -p "$R"
CUB=$(dirname "$(find / -xdev -name 'libcublas.so.13*' 2>/dev/null | head -1)")
CRT=$(dirname "$(find / -xdev -name 'libcudart.so.13*' 2>/dev/null | head -1)")
NCCL=$(dirname "$(find / -xdev -name 'libnccl.so.2*' -not -path '/tmp/*' 2>/dev/null | head -1)")
echo "cublas $CUB, cudart $CRT, nccl $NCCL" | tee "$R/libs.txt"
export LD_LIBRARY_PATH=$D/lib:$CUB:$CRT:$NCCL:$LD_LIBRARY_PATH
export PATH=$D/bin:$PATH OPAL_PREFIX=$D/ompi PMIX_PREFIX=$D/pmix PMIX_PKGDATADIR=$D/pmix/share/pmix PMIX_PKGLIBDIR=$D/pmix/lib/pmix
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_plm=isolated OMPI_MCA_pml=ob1 OMPI_MCA_btl=self,vader,tcp OMPI_MCA_btl_vader_single_copy_mechanism=none
export OMPI_MCA_rmaps_base_oversubscribe=1 OMPI_MCA_hwloc_base_binding_policy=none
export NCCL_DEBUG=${NCCL_DEBUG:-VERSION}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$R/gpu.txt"
ldd "$D/bin/shardlm" | grep -E "nccl|not found" | tee -a "$R/libs.txt"

timeout 150 cuda_tests > "$R/cuda_tests.log" 2>&1; echo "cuda_tests rc=$?"
grep -E "^\[  (PASSED|FAILED|SKIPPED) |tests? ran|Nccl|NCCL version" "$R/cuda_tests.log" | head -20

common="--model small --data $D/data/kjv --steps ${STEPS:-10} --seq 256 --batch 8 --lr 1e-3 --min-lr 1e-4 --warmup 10
        --eval-every 0 --eval-windows 4 --sample-tokens 0 --seed 1337 --threads 2 --device cuda --compute-dtype fp32"
run() {  # NAME LAUNCH... -- FLAGS...
  local name=$1; shift
  timeout 90 "$@" --out "$R/$name" > "$R/$name.log" 2>&1
  echo "$name rc=$?"; grep -E "collectives|error" "$R/$name.log" | head -2 | cut -c1-300; tail -1 "$R/$name.log" | cut -c1-200
}
run default shardlm train $common --strategy ddp
run nccl-ddp shardlm train $common --strategy ddp --comm nccl
run mpi1-nccl-ddp mpirun -np 1 shardlm train $common --strategy ddp --comm nccl
run mpi1-nccl-zero2 mpirun -np 1 shardlm train $common --strategy zero2 --comm nccl
run mpi1-nccl-fsdp mpirun -np 1 shardlm train $common --strategy fsdp --comm nccl
# Two ranks on the one GPU: refused (one line per rank), not hung.
timeout 60 mpirun -np 2 shardlm train $common --batch 4 --strategy fsdp --comm nccl --out "$R/two-nccl" > "$R/two-nccl.log" 2>&1
echo "two ranks --comm nccl on one GPU rc=$? (expected non-zero)"; grep -E "error" "$R/two-nccl.log" | head -3 | cut -c1-300
python3 - "$R" default nccl-ddp mpi1-nccl-ddp mpi1-nccl-zero2 mpi1-nccl-fsdp <<'PY' | tee "$R/compare.txt"
import json, sys
R, names = sys.argv[1], sys.argv[2:]
def rows(name):
    try:
        return [json.loads(l) for l in open(f"{R}/{name}/metrics.jsonl") if '"step"' in l and '"loss"' in l]
    except OSError:
        return []
ref = rows(names[0])
print(f"{names[0]} loss:", " ".join(f"{r['loss']:.6f}" for r in ref))
for s in names[1:]:
    got = rows(s)
    same = len(got) == len(ref) > 0 and all(a["loss"] == b["loss"] and a["grad_norm"] == b["grad_norm"] for a, b in zip(ref, got))
    dl = max((abs(a["loss"] - b["loss"]) for a, b in zip(ref, got)), default=float("nan"))
    print(f"{s}: {len(got)} steps, bit-equal losses and grad norms: {same}, max |loss diff| {dl:.3e}")
PY
O=${OUT:-/tmp/nccl_out}; mkdir -p "$O"
cp "$R/compare.txt" "$R/cuda_tests.log" "$R/libs.txt" "$R/gpu.txt" "$O/" 2>/dev/null
tar czf "$O/runs.tgz" -C "$R" --exclude='*.trace.json' . 2>/dev/null; ls -la "$O"
