#!/bin/bash
# Issue 23, staged ranks on one GPU (bench/cuda_notes.md section 5). Run on the device machine from
# the repository root with DIR packed by bench/cuda/ranks_pack.sh (carried): cuda_tests, then GPT-2
# "small" in fp32 mode, 10 steps: one process ddp (--batch 8) against 2 ranks sharing the GPU
# (--batch 4 each, the same global batch) under ddp, zero2 and fsdp, collectives staged through
# host memory and the carried Open MPI. Prints each run's losses and the largest |difference| to
# the one-process run; logs and metrics under $OUT.
set -o pipefail
D=$(cd "${DIR:-bench/out/devranks}" && pwd)
R=/tmp/ranks_run; rm -rf "$R"; mkdir -p "$R"  # $OUT takes 8 files: the summary and a tarball
CUB=$(dirname "$(find / -xdev -name 'libcublas.so.13*' 2>/dev/null | head -1)")
CRT=$(dirname "$(find / -xdev -name 'libcudart.so.13*' 2>/dev/null | head -1)")
export LD_LIBRARY_PATH=$D/lib:$CUB:$CRT:$LD_LIBRARY_PATH
export PATH=$D/bin:$PATH OPAL_PREFIX=$D/ompi PMIX_PREFIX=$D/pmix PMIX_PKGDATADIR=$D/pmix/share/pmix PMIX_PKGLIBDIR=$D/pmix/lib/pmix
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
# One machine, no ssh: the isolated launcher; shared memory without CMA (containers refuse ptrace).
export OMPI_MCA_plm=isolated OMPI_MCA_pml=ob1 OMPI_MCA_btl=self,vader,tcp OMPI_MCA_btl_vader_single_copy_mechanism=none
export OMPI_MCA_rmaps_base_oversubscribe=1 OMPI_MCA_hwloc_base_binding_policy=none
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$R/gpu.txt"
mpirun --version 2>&1 | head -1
mpirun -np 2 hostname 2>&1 | head -4 | tee "$R/mpi_check.txt"

if [ "${TESTS:-1}" = 1 ]; then
  timeout 120 cuda_tests > "$R/cuda_tests.log" 2>&1; echo "cuda_tests rc=$?"
  grep -E "^\[  (PASSED|FAILED) |tests? ran" "$R/cuda_tests.log" | head -8
fi

common="--model small --data $D/data/kjv --steps ${STEPS:-10} --seq 256 --lr 1e-3 --min-lr 1e-4 --warmup 10
        --eval-every 0 --eval-windows 4 --sample-tokens 0 --seed 1337 --threads 2 --device cuda --compute-dtype fp32"
timeout 90 shardlm train $common --batch 8 --strategy ddp --out "$R/one-ddp" > "$R/one-ddp.log" 2>&1
echo "one process ddp rc=$?"; tail -2 "$R/one-ddp.log"
for s in ${STRATEGIES:-ddp zero2 fsdp}; do
  timeout 80 mpirun -np 2 shardlm train $common --batch 4 --strategy $s --out "$R/two-$s" > "$R/two-$s.log" 2>&1
  echo "2 ranks $s rc=$?"; tail -2 "$R/two-$s.log"
done
python3 - "$R" ${STRATEGIES:-ddp zero2 fsdp} <<'EOF' | tee "$R/compare.txt"
import json, sys
R, strategies = sys.argv[1], sys.argv[2:]
def rows(name):
    try:
        return [json.loads(l) for l in open(f"{R}/{name}/metrics.jsonl") if '"step"' in l and '"loss"' in l]
    except OSError as e:
        return []
ref = rows("one-ddp")
print("one-ddp loss:", " ".join(f"{r['loss']:.6f}" for r in ref))
for s in strategies:
    got = rows(f"two-{s}")
    n = min(len(ref), len(got))
    dl = max((abs(a["loss"] - b["loss"]) for a, b in zip(ref, got)), default=float("nan"))
    dn = max((abs(a.get("grad_norm", 0) - b.get("grad_norm", 0)) / max(abs(a.get("grad_norm", 1)), 1e-12)
              for a, b in zip(ref, got)), default=float("nan"))
    print(f"two-{s} ({n} steps) loss:", " ".join(f"{r['loss']:.6f}" for r in got))
    print(f"two-{s}: max |loss diff| {dl:.3e}, max rel grad-norm diff {dn:.3e}, "
          f"median step_ms {sorted(r.get('step_ms', 0) for r in got)[n // 2] if n else 'n/a'}")
print("one-ddp median step_ms", sorted(r.get("step_ms", 0) for r in ref)[len(ref) // 2] if ref else "n/a")
EOF
O=${OUT:-/tmp/ranks_out}; mkdir -p "$O"
cp "$R/compare.txt" "$R/cuda_tests.log" "$O/" 2>/dev/null
tar czf "$O/runs.tgz" -C "$R" --exclude='*.trace.json' . 2>/dev/null; ls -la "$O"
