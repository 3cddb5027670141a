// A hardware profile: the figures the cost model prices a plan with, read from JSON. Every figure
// in the file is {"value": V, "source": "..."} in SI units (FLOP/s, bytes/s, seconds, bytes), so
// a reader can tell a datasheet number from a measurement from an assumption.
//
// Bundled presets live in configs/hardware/NAME.json (h100-80gb and a100-80gb: kernel rates
// measured on a GPU and carried to them; h100-80gb-datasheet and a100-80gb-datasheet: datasheet
// figures alone; cpu-local); `--hardware` takes a preset name or a path to such a file.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace shardlm::sim {

// The collectives a plan emits, as the cost model groups them (nccl-tests' names). all_to_all
// prices the variable-count exchange of expert parallelism (comm's all_to_all_v) too.
enum class Collective { all_gather, reduce_scatter, all_reduce, all_to_all };
inline constexpr int kNumCollectives = 4;
const char* to_string(Collective c);

// One collective on one link tier: time(S) = latency + S · factor(n) / bus_bw; for all_to_all,
// whose every rank sends a message to each of the n−1 others, latency · (n−1) + S · factor(n) /
// bus_bw (sim/cost.h).
struct LinkCost {
  double latency_s = 0;  // α: a small message's time, seconds (all_to_all: per peer message)
  double bus_bw = 0;     // busBw as nccl-tests reports it, bytes/s
};
// The most a profile may give as a collective's latency: a small message taking longer is no
// link this cost model describes (a profile saying so is a typo or a failed measurement).
inline constexpr double kMaxLatencySeconds = 1.0;

// At what fraction of its busBw a tier moves a collective's bytes at one message size, beyond its
// latency. NCCL reaches its peak only gradually between ~64 KiB and ~1 GiB (protocol and channel
// choices), which one latency and one bandwidth cannot express. From a published nccl-tests
// all_reduce table over a node's devices: the time it gives, less the node's all-reduce latency,
// is the time its bytes took (sim/cost.h ring_seconds).
struct SizeEfficiency {
  double bytes = 0;     // message size S as nccl-tests counts it (the whole buffer)
  double fraction = 1;  // in (0, 1]: S · factor / busBw over (the table's time − latency)
};

// A tier's figures as measured on groups of one shape: `ranks` ranks, at most `per_node` of them
// on one node. How a group lies matters as much as its size: two ranks of a node that cross the
// network together share their node's link, and an MPI picks its algorithm by the group's size.
struct GroupCost {
  int ranks = 0, per_node = 0;
  LinkCost op[kNumCollectives];
};

// A link tier: inside a node (NVLink, shared memory) or across nodes (the network).
struct Tier {
  LinkCost op[kNumCollectives];
  // Optional (the intra tier of the GPU presets, from its all_reduce_by_size table), sizes
  // increasing: empty where the tier moves bytes at its bus_bw at every size.
  std::vector<SizeEfficiency> by_size;
  // Optional (calibrate across machines writes them, as "groups"): figures of the group shapes
  // measured. A group of a shape listed takes its row's figures, any other the tier's own.
  std::vector<GroupCost> groups;
  const LinkCost& of(Collective c) const { return op[static_cast<int>(c)]; }
  const LinkCost& of(Collective c, int ranks, int per_node) const {
    for (const GroupCost& g : groups)
      if (g.ranks == ranks && g.per_node == per_node) return g.op[static_cast<int>(c)];
    return of(c);
  }
};

// A measured GEMM rate: one rank running an (M, K) × (K, N) GEMM with `threads` compute threads,
// FLOP/s of the forward and of the backward (its two gradient GEMMs together).
struct GemmRate {
  int64_t M = 0, K = 0, N = 0;
  int threads = 1;
  double forward = 0, backward = 0;
};

// A measured causal attention rate: one rank, sequence length T, head size HS, `threads` compute
// threads; FLOP/s of the forward (2·B·T·T·C as the model counts it) and of the backward (twice).
struct AttentionRate {
  int64_t T = 0, HS = 0;
  int threads = 1;
  double forward = 0, backward = 0;
};

// Inside a node, beyond the per-collective figures of the intra tier: the fabric's line rate, and
// NVLink SHARP (NVLS: the switch reduces, so an all-reduce's bytes cross each GPU's link about once
// instead of twice) where the hardware has it.
struct Fabric {
  double link_bw = 0;       // per GPU, per direction, bytes/s (datasheet): a ring's busBw is below it
  bool has_nvls = false;
  LinkCost nvls_all_reduce;  // all-reduce through the switch, a whole node's devices (busBw as nccl-tests)
};

// The network between nodes, described as the machine is built rather than as one figure: a
// group that spans nodes uses the NICs of the devices it has on each node in parallel (NCCL runs
// one ring per NIC), capped by the fabric inside the node. Absent (the `inter_node` tier instead):
// a flat two-tier model, as a calibrated single machine has.
struct Network {
  bool present = false;
  int nics_per_node = 0;
  double nic_bw = 0;          // line rate of one NIC, per direction, bytes/s
  double nic_efficiency = 1;  // the fraction of it a collective achieves (nccl-tests per-NIC busBw ÷ line rate)
  double ring_step_latency_s = 0;  // added per ring step that crosses the network
  double tree_step_latency_s = 0;  // added per tree level across nodes (up and down each)
  double message_latency_s = 0;    // one point-to-point message across the network (all-to-all: per remote peer)
  double tree_efficiency = 1;      // a tree's achieved bandwidth relative to the ring's links
  // Optional: NCCL's LL protocol, which it picks for small messages across nodes: each 8-byte
  // store carries its own flag, so a step waits on no separate synchronisation (less latency)
  // and half of every line is flags (a fraction of the bandwidth). Absent: not priced.
  struct LowLatency {
    bool present = false;
    double ring_step_latency_s = 0, tree_step_latency_s = 0;
    double bandwidth_fraction = 1;  // of the ring's or tree's bandwidth (fabric and network alike)
  } low_latency;
  // One device's share of the node's achievable NIC bandwidth, bytes/s.
  double per_device_bw(int devices_per_node) const {
    return nics_per_node * nic_bw * nic_efficiency / devices_per_node;
  }
};

// Where a profile's figures as a whole come from, so that what simulate and plan predict says how
// far to trust it: {"source": "measured" | "derived" | "datasheet", "date": "YYYY-MM-DD",
// "detail": "..."} under "provenance", required in every profile.
//   measured   timed on the hardware it describes (what `calibrate` writes)
//   derived    a measured profile carried to other hardware (an H200's kernel rates as an H100's)
//   datasheet  vendors' peaks and published efficiencies, nothing of a training step timed: its
//              predictions run optimistic (datasheet_caution)
// date: of the measurement (measured, derived) or of the figures' last revision (datasheet).
struct Provenance {
  std::string source, date, detail;  // detail: optional, how it was measured or derived
};

struct HardwareProfile {
  std::string name;
  std::string origin;              // the file it came from
  Provenance provenance;
  bool per_thread = false;         // CPU: compute figures are per compute thread (× --threads)
  std::string compute_dtype;       // dtype the peak applies to: "bf16" (GPU) or "fp32" (CPU)
  // Optional: the dtype activations are stored in, which the plan's memory figures use; absent:
  // compute_dtype (a GPU preset stands for engines that keep bf16 activations). shardlm's own
  // CUDA backend stores fp32 beside bf16 GEMMs, so a profile calibrate measures says "fp32".
  std::string activation_dtype;
  double peak_flops = 0;           // dense peak in compute_dtype, FLOP/s (the MFU denominator)
  double fp32_peak_flops = 0;      // FP32 peak (non-tensor-core on GPUs), FLOP/s
  double gemm_efficiency = 1;      // achieved GEMM FLOP/s ÷ peak_flops
  // Optional: achieved FLOP/s of the blocks' attention kernels ÷ peak_flops (a GPU's fused flash
  // attention reaches less of the peak than its GEMMs). 0: gemm_efficiency. Measured
  // attention_rates take precedence.
  double attention_efficiency = 0;
  double memory_bw = 0;            // streaming bandwidth (optimizer, gradient zeroing and norm, copies), bytes/s
  // Optional: bytes/s of the units' pointwise kernels as the model counts their bytes (per thread
  // on a per_thread profile: norms and activations are partly compute-bound and cache-resident).
  // 0: memory_bw.
  double pointwise_bw = 0;
  int devices_per_node = 1;
  // Optional, for goodput under failures: bytes/s one node writes to (and reads from) the
  // checkpoint storage (0: not given), and one device's link to host memory, per direction, which
  // an in-memory snapshot crosses (0: memory_bw, as on a CPU whose state is in host memory).
  double storage_bw = 0;
  double host_link_bw = 0;
  // Optional, for the disk tier (--offload): one rank's direct-I/O reads and writes to its
  // offload directory, bytes/s, and the fixed time of one reload or write-back (a request's
  // latency). A copy task takes disk_latency_s + bytes / bandwidth on the copy stream. 0
  // bandwidth: not given, copies cost nothing (as before the figures existed).
  double disk_read_bw = 0;
  double disk_write_bw = 0;
  double disk_latency_s = 0;
  // Optional (calibrate writes them): on a machine whose copies and compute share cores and memory
  // bandwidth, compute runs this many times slower while a disk copy runs, and a copy this many
  // times slower while compute runs. 1: not given, no interference.
  double compute_slowdown_beside_disk = 1;
  double disk_slowdown_beside_compute = 1;
  // CPU (per_thread) profiles, optional: cores the ranks of a node share. More compute threads
  // than cores (ranks on the node × --threads) time-slice them: each rank's compute slows by
  // that oversubscription. 0: not given, no slowdown.
  int cores_per_node = 0;
  int64_t device_memory = 0;       // bytes per device (0: unbounded, the host's memory)
  double comm_compute_slowdown = 1;  // compute runs this many times slower while a collective runs
  // Optional (calibrate writes it): a collective runs this many times slower while compute runs,
  // where the CPU drives the transport (TCP's stack and MPI's progress share the cores with the
  // kernels). 1: not given.
  double comm_slowdown_beside_compute = 1;
  // Optional (calibrate writes them): measured rates of the GEMM shapes models use. A unit's
  // weight GEMMs are then priced at the nearest measured shape's rate; other FLOPs, and every GEMM
  // without them, at peak_flops × gemm_efficiency.
  std::vector<GemmRate> gemm_rates;
  std::vector<AttentionRate> attention_rates;  // the same for blocks' attention (nearest T, HS)
  Tier intra, inter;  // inter: only without `network` (a flat model of the network)
  Fabric fabric;      // optional (GPU presets): the intra-node fabric's line rate and NVLS
  Network network;    // optional (GPU presets): NICs per node; replaces the inter tier
  // false where the collective figures are no measurement (calibrate on one rank has none to
  // time): such a profile prices one rank only (require_collectives).
  bool collectives_measured = true;
};

// A preset name (a file in `preset_dir`, see preset_names) or a JSON file path. Throws
// std::runtime_error with one line naming the file and field, or the unknown preset and the
// ones there are. Besides each figure's own range, a collective's bus_bw is at most memory_bw
// (its bytes pass through memory) and its latency_s at most kMaxLatencySeconds.
HardwareProfile load_hardware(const std::string& name_or_path, const std::string& preset_dir);
// Parses a profile from JSON text; `origin` names it in errors.
HardwareProfile parse_hardware(const std::string& text, const std::string& origin);
std::vector<std::string> preset_names(const std::string& preset_dir);
// Throws std::runtime_error (one line naming the profile) when `ranks` > 1 and the profile's
// collectives were not measured: a simulation of several ranks would price them at a guess.
void require_collectives(const HardwareProfile& hw, int ranks);
// One line: the profile's file, where its figures come from and their date (no newline).
std::string provenance_line(const HardwareProfile& hw);
// For a datasheet profile, one line saying by how much its predictions ran optimistic on the
// published-run table (bench/published_runs.py); empty for any other.
std::string datasheet_caution(const HardwareProfile& hw);
// Where the presets are: `chosen` (the user's choice, e.g. $SHARDLM_HARDWARE_DIR, which the command
// line passes in) when not null, else configs/hardware beside the build directory holding this
// executable, else the source tree's.
std::string hardware_dir(const char* chosen);

}  // namespace shardlm::sim
