// Calibration: times this machine's kernels and collectives and fits them into a hardware
// profile (the JSON sim/ reads, every figure with "measured by shardlm calibrate" as its source).
//  - GEMM: the best of repeated 2048³ GEMMs is the peak (what `train` uses for MFU); the model's
//    block GEMM shapes against it give the achievable efficiency;
//  - pointwise bandwidth: a residual add over 64 MiB arrays (3 × 4 bytes per element moved);
//  - each collective at sizes from 4 KiB up: α and busBw fitted by least squares to
//    t = α + S·factor(n)/busBw over the medians (nccl-tests' S and factor);
//  - the slowdown of a GEMM while a large all-reduce runs beside it.
// Every rank takes part (collectives span the world); rank 0's figures are the result.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "kernels/backend.h"

namespace shardlm::run {

struct CalibrateOptions {
  int threads = 1;
  std::vector<int64_t> sizes;  // collective buffer sizes S in bytes; empty: 4 KiB .. 256 MiB by ×4
  int iters = 5;               // timed repetitions per size (after one untimed)
  std::string name = "cpu-local";
  // Models whose weight GEMMs (at B = 4, T = 256) are timed into gemm_rates, at 1 thread and at
  // `threads`; empty: none.
  std::vector<std::string> gemm_models{"small", "llama-small"};
};

// One fitted line t = alpha + x / bw (x = S·factor), from (x, t) points.
struct LineFit {
  double alpha = 0, bw = 0;
};
LineFit fit_alpha_beta(const std::vector<double>& x, const std::vector<double>& t);

// Runs the measurements (collective: every rank calls it) and returns the profile as JSON text.
std::string calibrate(const kernels::Backend& backend, comm::Communicator& world, const CalibrateOptions& o);

}  // namespace shardlm::run
