// The parameter gather pass (gather_chain.h).
#include "plan/gather_chain.h"

#include <algorithm>
#include <cstdlib>
#include <stdexcept>

namespace shardlm::plan {

GatherChain::GatherChain(PlanDraft& draft, std::vector<char> backward_reads_params, bool train)
    : d_(draft), desc_(draft.desc()), cfg_(draft.config()), plan_(draft.plan()),
      backward_reads_params_(std::move(backward_reads_params)) {
  const int U = static_cast<int>(desc_.units.size());
  kept_.assign(U, 0);
  part_.assign(U, 0);
  kept_gather_.assign(U, -1);
  for (int u = 0; u < U; ++u)
    if (desc_.units[u].borrows >= 0) kept_[desc_.units[u].borrows] = 1;
  keep_units(cfg_.keep_gathered);
  keep_parts(train);
}

int GatherChain::gathered(int u) {
  return d_.buffer("gathered " + d_.uname(u), Role::gathered, MemCategory::params, d_.unit_bytes(u, 4), u);
}

int GatherChain::kept_part(int u) {
  return d_.buffer("kept " + d_.uname(u), Role::kept_part, MemCategory::params,
                   plan_.kept_elems[u] * plan_.shard_size * cfg_.param_bytes, u, float_dtype(cfg_.param_bytes));
}

GatherChain::Forward GatherChain::before_forward(int u, int borrowed, int m) {
  Forward f;
  if (sharded(u) && kept_[u]) {
    if (m == 0) f.gather = gather_kept(u);
  } else if (sharded(u)) {
    // The backward's last gathered unit, all of its bucket consumed, is this forward's first.
    // (Not a partly kept unit: its forward gather also sets its kept part aside.)
    f.held = m > 0 && !chain_.empty() && chain_.back().units.back() == u && chain_.back().done() >= 0 && !partly_kept(u);
    if (!f.held) f.gather = gather(u, m, cfg_.prefetch_forward, +1);
  }
  // A borrowed state-only unit (a MoE block's experts) is gathered once per step, like the tied
  // embedding, by its borrower's first forward.
  const int bg = borrowed >= 0 && sharded(borrowed) && kept_gather_[borrowed] < 0 ? gather_kept(borrowed) : -1;
  f.deps = {f.gather, bg};
  return f;
}

void GatherChain::forward_added(int t, int u, const Forward& f) {
  if (f.held) d_.at(t).deps.push_back(reuse(t));
  else if (f.gather >= 0 && !kept_[u]) consume(t, u);
}

int GatherChain::before_backward(int u, int m) {
  return sharded(u) && chain_gathered(u, -1) ? gather(u, m, cfg_.prefetch_backward, -1) : -1;
}

void GatherChain::backward_added(int t, int u) {
  if (backward_params(u) < 0) return;
  if (!kept_[u]) consume(t, u);
  if (partly_kept(u)) d_.free(t, kept_part(u));
}

// An all-gather in the rotating chain: at most `max_gathers_in_flight` gathers (buckets) whose
// buffers are alive, and issued at most `prefetch` gathers ahead of its consumer. A unit's
// gathered buffer is one buffer, so a unit is never gathered twice at once: its gather waits for
// the consumer of its previous gather. With --gather-bucket-mb the gather takes the units after
// u in this pass (`direction` +1: a forward, -1: a backward) into one bucket; their compute
// tasks then find u's bucket already issued.
int GatherChain::gather(int u, int micro, int prefetch, int direction) {
  if (!chain_.empty() && chain_.back().pending(u) >= 0) return chain_.back().gather;
  const std::vector<int> units = bucket_from(u, direction);
  std::vector<int> deps;
  const int j = static_cast<int>(chain_.size());
  const int limit = cfg_.max_gathers_in_flight;
  if (j - limit >= 0) deps.push_back(chain_[j - limit].done());
  if (j - 1 - prefetch >= 0) deps.push_back(chain_[j - 1 - prefetch].done());
  for (int v : units)
    for (int k = j - 1; k >= 0; --k) {
      const auto& g = chain_[k];
      const auto i = std::find(g.units.begin(), g.units.end(), v) - g.units.begin();
      if (i < static_cast<int64_t>(g.units.size())) {
        deps.push_back(g.consumers[i]);
        break;
      }
    }
  if (deps.empty() && start_ >= 0) deps.push_back(start_);
  // Every dependency is a compute task, and the compute stream runs in order: the latest implies
  // the others (and a gather then never waits on a task two micro-steps back, as Repeat needs).
  if (!deps.empty()) deps = {*std::max_element(deps.begin(), deps.end())};
  const bool bucket = units.size() > 1;
  const int t = d_.add(Op::all_gather, bucket ? -1 : u, micro, deps);
  d_.at(t).axes = d_.within_slice(plan_.placed(State::params, u).axes, u);
  for (int v : units) {
    d_.at(t).bytes += d_.unit_bytes(v, cfg_.param_bytes);
    // The compute task the gather waits for brings its buffers into being as it ends.
    if (deps.empty()) d_.alloc(t, gathered(v));
    else d_.at(deps.back()).hands_off.push_back(gathered(v));
  }
  if (bucket) {
    d_.at(t).first_unit = units.front(), d_.at(t).last_unit = units.back();
    for (int v : units) d_.at(t).io.bucket.push_back(gathered(v));
    stage_bucket(t, units);
  } else {
    d_.at(t).io.params = gathered(u);
    if (partly_kept(u)) gather_part(t, u, direction, deps.empty() ? -1 : deps.back());
    else d_.stage(t, d_.compute_elems(u), d_.shard_elems(u), cfg_.param_bytes);
  }
  chain_.push_back({t, units, std::vector<int>(units.size(), -1)});
  return t;
}

// Whether this pass gathers unit u through the chain (not kept; in a backward, only the units
// whose backward reads parameters or rebuilds activations, the head's ran with its forward).
bool GatherChain::chain_gathered(int u, int direction) const {
  if (u < 0 || u >= static_cast<int>(desc_.units.size()) || kept_[u]) return false;
  return direction > 0 || (!model::is_head(desc_.units[u].kind) && backward_reads_params_[u]);
}

// u and the units gathered right after it in this pass while their wire bytes together stay
// within --gather-bucket-mb (u alone when it is larger, or bucketing is off). A bucket ends at a
// unit the pass does not gather, so it is one run of consecutive units.
std::vector<int> GatherChain::bucket_from(int u, int direction) const {
  std::vector<int> units{u};
  if (partly_kept(u)) return units;  // its gathers move a part of it: never in a bucket
  const double limit = cfg_.gather_bucket_mb * 1048576.0;
  double bytes = static_cast<double>(d_.unit_bytes(u, cfg_.param_bytes));
  for (int v = u + direction; limit > 0 && chain_gathered(v, direction) && !partly_kept(v); v += direction) {
    bytes += static_cast<double>(d_.unit_bytes(v, cfg_.param_bytes));
    if (bytes > limit) break;
    units.push_back(v);
  }
  return units;
}

// A bucket's staging (comm): its units' gathered concatenation, rank after rank, in the wire
// dtype (this rank's concatenated shards are packed in place, at its own slot); alive inside
// the gather.
void GatherChain::stage_bucket(int t, const std::vector<int>& units) {
  int64_t shards = 0;
  for (int v : units) shards += d_.shard_elems(v);
  const int b = d_.buffer("staging " + d_.at(t).name(&desc_), Role::staging, MemCategory::comm,
                       shards * plan_.shard_size * cfg_.param_bytes, -1,
                       float_dtype(cfg_.param_bytes));
  d_.scratch(t, b);
  d_.at(t).io.staging = b;
  for (int v : units) d_.at(t).copy_bytes += d_.unit_bytes(v, 4);
}

// A partly kept unit's gather. In a forward it gathers the whole unit and copies the kept part
// aside (allocated with the gathered buffer, by the compute task the gather waits for); in a
// backward it gathers the rest of each shard into staging (its concatenation, rank after rank)
// and puts the unit together from the two. The backward's consumer frees the kept part.
void GatherChain::gather_part(int t, int u, int direction, int deps_last) {
  const int64_t shard = d_.shard_elems(u), kept = plan_.kept_elems[u], rest = shard - kept;
  const int S = plan_.shard_size, elem = cfg_.param_bytes;
  if (direction > 0) {
    d_.stage(t, d_.compute_elems(u), shard, elem);
    d_.at(t).io.keep_into = kept_part(u);
    if (deps_last < 0) d_.alloc(t, kept_part(u));
    else d_.at(deps_last).hands_off.push_back(kept_part(u));
    d_.at(t).copy_bytes += kept * S * elem;
    return;
  }
  d_.at(t).bytes = rest * S * elem;
  d_.at(t).io.restore_from = kept_part(u);
  const int b = d_.buffer("staging " + d_.at(t).name(&desc_) + " rest", Role::staging, MemCategory::comm, rest * S * elem, u,
                       float_dtype(elem));
  d_.scratch(t, b);
  d_.at(t).io.staging = b;
  d_.at(t).copy_bytes = d_.unit_bytes(u, 4);
}

int GatherChain::gather_kept(int u) {
  const int t = d_.add(Op::all_gather, u, 0, {start_});
  d_.at(t).axes = d_.within_slice(plan_.placed(State::params, u).axes, u);
  d_.at(t).bytes = d_.unit_bytes(u, cfg_.param_bytes);
  d_.at(t).io.params = gathered(u);
  if (start_ < 0) d_.alloc(t, gathered(u));
  else d_.at(start_).hands_off.push_back(gathered(u));
  d_.stage(t, d_.compute_elems(u), d_.shard_elems(u), cfg_.param_bytes);
  kept_gather_[u] = t;
  return t;
}

// The consumer frees unit u's gathered buffer (u is in the chain's latest bucket).
void GatherChain::consume(int compute_task, int u) {
  Gathered& g = chain_.back();
  const auto i = std::find(g.units.begin(), g.units.end(), u) - g.units.begin();
  d_.free(compute_task, gathered(u));
  g.consumers[i] = compute_task;
}

// Between micro-steps the parameters do not change, and the last unit the backward gathered is
// the first the next forward needs when it is the same unit: keep it instead of gathering it
// again. Returns the gather the compute task now depends on.
int GatherChain::reuse(int compute_task) {
  Gathered& g = chain_.back();
  const int u = g.units.back();
  auto& frees = d_.at(g.done()).frees;
  frees.erase(std::remove(frees.begin(), frees.end(), gathered(u)), frees.end());
  consume(compute_task, u);
  return g.gather;
}


// Marks the units --keep-gathered names as kept: gathered once per step, freed after their last
// use (the last micro-step's backward), as the borrowed embedding is. NAME:FRACTION marks a part.
void GatherChain::keep_units(const std::vector<std::string>& names) {
  for (const std::string& entry : names) {
    const size_t colon = entry.find(':');
    const std::string name = entry.substr(0, colon);
    double fraction = 1;
    if (colon != std::string::npos) {
      const std::string f = entry.substr(colon + 1);
      char* end = nullptr;
      fraction = std::strtod(f.c_str(), &end);
      if (f.empty() || *end != '\0' || !(fraction > 0 && fraction < 1))
        throw std::invalid_argument("keep_gathered (--keep-gathered): '" + entry +
                                    "': the part to keep must be a fraction between 0 and 1, as in h.3:0.5");
    }
    bool found = false;
    for (size_t u = 0; u < desc_.units.size(); ++u)
      if (name == "all" || desc_.units[u].name == name) {
        found = true;
        if (fraction < 1) part_[u] = fraction;
        else kept_[u] = 1;
      }
    if (!found) {
      std::string all;
      for (const auto& ud : desc_.units) all += (all.empty() ? "" : ", ") + ud.name;
      throw std::invalid_argument("keep_gathered (--keep-gathered): no unit named '" + name + "' (units: " + all + "; or all, none)");
    }
  }
}

// A part kept counts where a training step gathers the unit again for its backward; it is the
// fraction of each shard, rounded down to 16 elements.
void GatherChain::keep_parts(bool train) {
  plan_.kept_elems.assign(desc_.units.size(), 0);
  if (!train) return;
  for (size_t u = 0; u < desc_.units.size(); ++u) {
    const int i = static_cast<int>(u);
    if (part_[u] > 0 && sharded(i) && chain_gathered(i, -1))
      plan_.kept_elems[u] = static_cast<int64_t>(part_[u] * static_cast<double>(d_.shard_elems(i)) / 16) * 16;
  }
}


// A staged pass's last stage frees what its first task consumed (add_stages). Apart from
// add_stages, which the recompute pass reruns once the walk's gather chain is done.
void GatherChain::consumed_by_last_stage(int first, int last) {
  for (Gathered& g : chain_)
    for (int& consumer : g.consumers)
      if (consumer == first) consumer = last;
}

}  // namespace shardlm::plan
