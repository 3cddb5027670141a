// Start-up agreement between ranks. Every rank of a job must run the same model, plan, data and
// optimizer; ranks started with different settings (an MPMD launch, a stale config file on one
// machine) otherwise corrupt each other's buffers in the first collective or train silently
// inconsistent replicas. check_ranks_agree() compares the settings before any other collective.
//
// Failures every rank learns of at once end the job without MPI_Abort: each rank throws
// AgreedFailure, only rank 0 reports it, and every rank finalizes MPI and exits non-zero.
#pragma once

#include <chrono>
#include <functional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "comm/communicator.h"
#include "data/corpus.h"
#include "train/config.h"

namespace shardlm::train {

// A failure that every rank of the job knows of: no rank waits for another, so the job can end
// cleanly. report() is true on the one rank that should print what().
class AgreedFailure : public std::runtime_error {
 public:
  AgreedFailure(const std::string& what, bool report) : std::runtime_error(what), report_(report) {}
  bool report() const { return report_; }

 private:
  bool report_;
};

// (flag name, value) of every setting that must be the same on every rank: everything in
// TrainConfig but the per-process ones (--threads, --quiet, --timeout, --peak-gflops, output
// paths, and the run-directory decisions rank 0 takes alone). A field added to TrainConfig that
// shapes the step or its collectives belongs here.
std::vector<std::pair<std::string, std::string>> rank_settings(const TrainConfig& cfg);

// Collective, and the job's first: all-gathers a hash of rank_settings(); on a mismatch gathers
// per-field hashes and the differing values, and throws AgreedFailure naming each differing
// field with its value on each rank, e.g.
//   ranks disagree on settings: n-layer (0 on rank 0, 3 on rank 1)
void check_ranks_agree(const TrainConfig& cfg, comm::Communicator& world, std::chrono::milliseconds timeout);

// Collective: runs `fn` on rank 0 alone and tells every rank whether it threw. When it did,
// rank 0 throws AgreedFailure(what, report) and every other rank AgreedFailure(…, quiet), so a
// rank-0-only failure (a locked run directory) ends every rank instead of leaving them waiting.
void on_lead_or_all_fail(comm::Communicator& world, std::chrono::milliseconds timeout, const std::function<void()>& fn);

// Collective, after rank 0 has taken the run directory (RunDirectory::open): every rank must
// find, at its own `out`, the DIR/.lock rank 0 holds, since every rank writes its checkpoint
// files there and rank 0 commits them. Otherwise (an --out on each machine's own disk) every
// checkpoint would be committed without the other machines' files; throws AgreedFailure naming
// the ranks that do not see it. A rank that does not see it yet retries for a few seconds (a
// network filesystem's caches).
void check_out_shared(comm::Communicator& world, std::chrono::milliseconds timeout, const std::string& out);

// Collective: throws unless every token of `corpora` is below vocab_size. Each rank scans its
// 1/N share of their tokens (taken in order, as one sequence), so a job reads its corpus once, not
// once a rank: a FineWeb-sized corpus is 20 GB, read from a shared filesystem at every start.
// On a bad token every rank throws AgreedFailure with the line of the first found (the lowest
// rank's), which rank 0 reports: "token shard F: token id 50300 at position P is >= ...".
void check_token_ids(comm::Communicator& world, std::chrono::milliseconds timeout,
                     const std::vector<const data::TokenCorpus*>& corpora, int32_t vocab_size);

// Collective: every rank's `text`, in rank order (`label` names the exchange in a timeout).
std::vector<std::string> all_texts(comm::Communicator& world, std::chrono::milliseconds timeout,
                                   const std::string& text, const std::string& label);

// Collective: rank 0's `text` on every rank (what the other ranks pass is ignored).
std::string lead_text(comm::Communicator& world, std::chrono::milliseconds timeout, std::string text);

}  // namespace shardlm::train
