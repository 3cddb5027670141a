#!/bin/bash
# Packs what bench/cuda/ranks_run.sh needs on the device machine into DIR (default /tmp/devranks),
# then DIR as one gzipped tarball into CARRY/devranks.tgz (default bench/out/devranks_carry, an
# ignored path the device tool can carry: oneDNN alone is 38 MB, so the tree is over the carry
# limit uncompressed). On the device: tar xzf CARRY/devranks.tgz -C /tmp; DIR=/tmp/devranks bash
# /tmp/devranks/run.sh (or nccl_run.sh, calibrate_run.sh). Contents: shardlm and cuda_tests from
# BUILD (default build-cuda), Open MPI 4.1 (orterun as mpirun, its MCA plugins laid out under
# DIR/ompi as OPAL_PREFIX expects: lib/x86_64-linux-gnu/openmpi/lib/openmpi3, share/openmpi),
# every shared library `ldd` names except glibc's and CUDA's own (the device machine has CUDA 13),
# and the KJV shards (GPT-2 tokens) from DATA (default data/kjv_*).
set -euo pipefail
BUILD=${BUILD:-build-cuda}
DIR=${1:-/tmp/devranks}
CARRY=${CARRY:-bench/out/devranks_carry}
DATA=${DATA:-data/kjv}
OMPI=/usr/lib/x86_64-linux-gnu/openmpi
rm -rf "$DIR"; mkdir -p "$DIR/bin" "$DIR/lib" "$DIR/data" "$DIR/ompi/lib/x86_64-linux-gnu/openmpi/lib/openmpi3" "$DIR/ompi/share"
cp "$BUILD/shardlm" "$BUILD/tests/cuda_tests" "$DIR/bin/"
cp "$(readlink -f /usr/bin/orterun)" "$DIR/bin/mpirun"
cp -r /usr/share/openmpi "$DIR/ompi/share/openmpi"
# PMIx (Open MPI's launch protocol) is Debian's separate install: its plugins and help texts,
# found through PMIX_PKGLIBDIR / PMIX_PKGDATADIR (ranks_run.sh).
mkdir -p "$DIR/pmix/lib" "$DIR/pmix/share"
cp -r /usr/lib/x86_64-linux-gnu/pmix2/lib/pmix "$DIR/pmix/lib/"
cp -r /usr/lib/x86_64-linux-gnu/pmix2/share/pmix "$DIR/pmix/share/"
# The plugins that need fabrics (UCX, libfabric, PSM, verbs) or Java are left out: two ranks on one
# machine use the shared-memory and self transports (ranks_run.sh names them).
for p in "$OMPI"/lib/openmpi3/*.so; do
  case "$(basename "$p")" in *ucx*|*ofi*|*psm*|*openib*|*verbs*|*java*|*usnic*|*portals*) continue;; esac
  cp "$p" "$DIR/ompi/lib/x86_64-linux-gnu/openmpi/lib/openmpi3/"
done
# libnccl (218 MB, over the carry limit) is found on the device in PyTorch's install (nccl_run.sh).
skip='^(linux-vdso|libc\.so|libm\.so|libdl\.so|librt\.so|libpthread\.so|ld-linux|libcuda\.so|libcudart|libcublas|libnvidia|libnccl)'
for f in "$DIR"/bin/* "$DIR"/ompi/lib/x86_64-linux-gnu/openmpi/lib/openmpi3/*.so "$DIR"/pmix/lib/pmix/*.so; do
  ldd "$f" | awk '$2 == "=>" && $3 ~ /^\// {print $1, $3}'
done | sort -u | while read -r name path; do
  [[ "$name" =~ $skip ]] && continue
  [ -e "$DIR/lib/$name" ] || cp -L "$path" "$DIR/lib/$name"
done
cp "$DATA"_train.bin "$DATA"_val.bin "$DATA"_meta.json "$DIR/data/"
cp bench/cuda/ranks_run.sh "$DIR/run.sh"
cp bench/cuda/packed_env.sh "$DIR/packed_env.sh"
cp bench/cuda/nccl_run.sh "$DIR/nccl_run.sh"
cp bench/cuda/calibrate_run.sh "$DIR/calibrate_run.sh"
[ "$(basename "$DIR")" = devranks ] || { echo "DIR must end in /devranks (run.sh's instructions say so)"; exit 1; }
mkdir -p "$CARRY"
tar czf "$CARRY/devranks.tgz" -C "$(dirname "$DIR")" devranks
du -sh "$DIR"/* "$CARRY/devranks.tgz"
