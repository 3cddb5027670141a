// Calibration: times this machine's kernels and collectives and fits them into a hardware
// profile (the JSON sim/ reads, every figure with "measured by shardlm calibrate" as its source).
//  - GEMM: the best of repeated 2048³ GEMMs is the peak (what `train` uses for MFU); the model's
//    block GEMM shapes against it give the achievable efficiency;
//  - pointwise bandwidth: a residual add over 64 MiB arrays (3 × 4 bytes per element moved);
//  - each collective (all_gather, reduce_scatter, all_reduce, all_to_all) at sizes from 4 KiB
//    up: α and busBw fitted by least squares to t = α + S·factor(n)/busBw over the medians
//    (nccl-tests' S and factor; all_to_all's α is per peer message, the intercept over n−1,
//    as sim prices it α·(n−1) + S·factor(n)/busBw); a fit that is not a
//    link (no bandwidth, one above what the ranks' measured memory bandwidth allows, a latency over a second) is an
//    error, never a profile. On one rank there is nothing to time: the profile says so
//    (collectives_measured false) and simulate prices one rank only with it;
//    Across machines (ranks the launcher placed on several, Communicator::machine) two tiers:
//    intra_node on each machine's ranks (every machine at once), inter_node across them: on one
//    rank a machine (every such group at once, as hybrid shard's replicate groups run) and on
//    the whole world where a machine holds several, each group shape a row of inter_node.groups;
//  - the slowdown of a GEMM while a large all-reduce runs beside it.
// Every rank takes part (collectives span the world); rank 0's figures are the result.
// On a device (`calibrate --device cuda`) every kernel is timed in back-to-back batches of about a
// millisecond between synchronisations, as a step queues them; collectives and the disk are not.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "kernels/backend.h"

namespace shardlm::run {

// What a bandwidth fit needs of the sizes (--sizes-kib): at least two different ones, the largest
// at least kMinLargestSize (its time is then mostly bandwidth: 1 MiB at a few GB/s takes ~10x
// a shared-memory latency) and at least kMinSizeSpread times the smallest (a slope needs a
// spread); none above kMaxSize (each rank holds two buffers of the size).
inline constexpr int64_t kMinLargestSize = int64_t{1} << 20;
inline constexpr int64_t kMinSizeSpread = 4;
inline constexpr int64_t kMaxSize = int64_t{1} << 30;
inline constexpr int kMaxIters = 1000;
// The longest latency a fit may give (the bound sim/'s profile reader holds too).
inline constexpr double kMaxLatencySeconds = 1.0;

// A model whose GEMMs and attention calibrate times, at `batch` sequences of `seq` tokens (the
// rows of its GEMMs are batch x seq): --gemm-models NAME or NAME:BxT.
struct GemmModel {
  std::string name;
  int64_t batch = 4, seq = 256;
};
// Throws std::invalid_argument, one line naming --gemm-models, unless `text` is NAME or NAME:BxT
// with B and T positive whole numbers (B x T at most kMaxGemmRows) and NAME a model preset.
inline constexpr int64_t kMaxGemmRows = int64_t{1} << 20;
GemmModel parse_gemm_model(const std::string& text);

struct CalibrateOptions {
  int threads = 1;
  std::vector<int64_t> sizes;  // collective buffer sizes S in bytes, whole KiB; empty: 4 KiB .. 256 MiB by ×4
  int iters = 5;               // timed repetitions per size (after one untimed)
  // The profile's name; empty: cpu-local on the host, the device's name on a device.
  std::string name;
  // Which --device the backend is (named in the figures' sources).
  std::string device = "cpu";
  // Models whose weight GEMMs (at B = 4, T = 256 unless NAME:BxT says otherwise) are timed into
  // gemm_rates, at 1 thread and at `threads` (on a device: once); none: no rates. The first one's
  // block also sets the shapes of gemm_efficiency and pointwise_bw.
  std::vector<std::string> gemm_models{"small", "llama-small"};
  // Where the disk tier's files would go (--offload-dir): its direct-I/O read and write bandwidth
  // and a 4 KiB read's latency are timed there (through DiskStore, as the run does); empty: not.
  std::string offload_dir;
  // The kernel this rank runs on (train::kernel_id: its boot id). Machines the launcher placed
  // ranks on that share one kernel (network namespaces, containers) share its cores too, which
  // the profile's cores_per_node then says. Empty: each machine its own kernel.
  std::string kernel_id;
};

// Throws std::invalid_argument, one line naming --sizes-kib or --iters, for options the
// measurement cannot fit a bandwidth from (see kMinLargestSize) or that would not end.
void check_calibrate_options(const CalibrateOptions& o);

// One fitted line t = alpha + x / bw (x = S·factor), from (x, t) points. Times that do not grow
// with x have no bandwidth: bw is then infinite.
struct LineFit {
  double alpha = 0, bw = 0;
};
LineFit fit_alpha_beta(const std::vector<double>& x, const std::vector<double>& t);
// Throws std::runtime_error naming `what` (the collective) and the figure unless the fit is a
// link: bw finite, positive and at most memory_bw; alpha in [0, 1 s].
void check_fit(const LineFit& f, double memory_bw, const std::string& what);

// Runs the measurements (collective: every rank calls it) and returns the profile as JSON text.
// A backend whose memory is not the host's (a GPU) is timed through its own buffers, uploads and
// synchronize(), on one rank and without --offload-dir (std::invalid_argument otherwise): its
// profile is per device (per_thread false), its peak in the backend's GEMM dtype, with the
// device's memory and its host link's bandwidth (host_link_bw).
std::string calibrate(const kernels::Backend& backend, comm::Communicator& world, const CalibrateOptions& o);

}  // namespace shardlm::run
