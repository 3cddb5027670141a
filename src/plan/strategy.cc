// The plan builders: one walk over the step (micro-steps × units, forward then backward) that
// emits compute tasks and, depending on the strategy, the collectives around them.
#include <algorithm>
#include <stdexcept>

#include "plan/plan.h"

namespace shardlm::plan {

namespace {

class Builder {
 public:
  Builder(const model::ModelDesc& desc, const PlanConfig& cfg) : desc_(desc), cfg_(cfg) {}

  Plan build();

 private:
  int add(Op op, Stream stream, int unit, int micro, std::vector<int> deps = {}) {
    Task t;
    t.id = static_cast<int>(tasks_.size());
    t.op = op, t.stream = stream, t.unit = unit, t.micro = micro, t.deps = std::move(deps);
    t.group = stream == Stream::comm ? Group::shard : Group::world;
    tasks_.push_back(std::move(t));
    return tasks_.back().id;
  }
  int64_t unit_bytes(int u, int elem) const { return plan_.layout.units[u].padded * elem; }
  std::string gathered(int u) const { return "gathered u" + std::to_string(u); }
  std::string full_grad(int u) const { return "grad u" + std::to_string(u); }
  // bf16 collectives cast through a staging buffer (comm): the whole unit and one shard.
  void stage(int t, int64_t full_elems, int64_t shard_elems, int elem) {
    if (elem == 4) return;
    const std::string name = tasks_[t].staging_buffer();
    tasks_[t].allocs.push_back({name, MemCategory::comm, (full_elems + shard_elems) * elem});
    tasks_[t].frees.push_back(name);
  }

  // An all-gather in the rotating chain: at most `max_gathers_in_flight` gathered buffers, and
  // issued at most `prefetch` compute tasks ahead of its consumer. consume() names the consumer.
  // A unit's gathered buffer is one named buffer, so a unit is never gathered twice at once: its
  // gather waits for the consumer of its previous gather.
  int gather(int u, int micro, int prefetch) {
    std::vector<int> deps;
    const int j = static_cast<int>(chain_.size());
    const int limit = cfg_.max_gathers_in_flight;
    if (j - limit >= 0) deps.push_back(chain_[j - limit].consumer);
    if (j - 1 - prefetch >= 0) deps.push_back(chain_[j - 1 - prefetch].consumer);
    for (int k = j - 1; k >= 0; --k)
      if (chain_[k].unit == u) {
        deps.push_back(chain_[k].consumer);
        break;
      }
    std::sort(deps.begin(), deps.end());
    deps.erase(std::unique(deps.begin(), deps.end()), deps.end());
    const int t = add(Op::all_gather, Stream::comm, u, micro, deps);
    tasks_[t].bytes = unit_bytes(u, cfg_.param_bytes);
    tasks_[t].allocs.push_back({gathered(u), MemCategory::params, unit_bytes(u, 4)});
    stage(t, plan_.layout.units[u].padded, plan_.layout.units[u].padded / plan_.shard_size, cfg_.param_bytes);
    chain_.push_back({t, -1, u});
    return t;
  }
  // The consumer frees the gathered buffer.
  void consume(int compute_task) {
    tasks_[compute_task].frees.push_back(gathered(chain_.back().unit));
    chain_.back().consumer = compute_task;
  }
  // Between micro-steps the parameters do not change, and the last unit the backward gathered
  // (h.0) is the first the next forward needs: keep it instead of gathering it again. Returns the
  // gather the compute task now depends on.
  int reuse(int compute_task) {
    auto& frees = tasks_[chain_.back().consumer].frees;
    frees.erase(std::remove(frees.begin(), frees.end(), gathered(chain_.back().unit)), frees.end());
    consume(compute_task);
    return chain_.back().gather;
  }

  // After unit u's gradient is final on the last micro-step: reduce it the strategy's way.
  void reduce_grad(int u, int producer);
  void close_bucket(int producer);
  std::vector<Task> schedule();

  const model::ModelDesc& desc_;
  const PlanConfig& cfg_;
  Plan plan_;
  std::vector<Task> tasks_;
  struct Gathered {
    int gather, consumer, unit;
  };
  std::vector<Gathered> chain_;  // every all_gather of a block or the final unit, in issue order
  std::vector<int> reductions_;             // every gradient collective
  int bucket_first_ = -1, bucket_last_ = -1;
  int64_t bucket_bytes_ = 0;
  bool sharded_params_ = false, sharded_grads_ = false;
};

void Builder::reduce_grad(int u, int producer) {
  if (cfg_.world == 1) return;
  if (sharded_grads_) {
    const int rs = add(Op::reduce_scatter, Stream::comm, u, cfg_.grad_accum - 1, {producer});
    tasks_[rs].bytes = unit_bytes(u, cfg_.reduce_bytes);
    tasks_[rs].frees.push_back(full_grad(u));
    stage(rs, plan_.layout.units[u].padded, plan_.layout.units[u].padded / plan_.shard_size, cfg_.reduce_bytes);
    reductions_.push_back(rs);
    if (cfg_.strategy == Strategy::hybrid && cfg_.world > plan_.shard_size) {
      const int ar = add(Op::all_reduce, Stream::comm, u, cfg_.grad_accum - 1, {rs});
      tasks_[ar].group = Group::replicate;
      tasks_[ar].bytes = unit_bytes(u, cfg_.reduce_bytes) / plan_.shard_size;
      stage(ar, plan_.layout.units[u].padded / plan_.shard_size, 0, cfg_.reduce_bytes);
      reductions_.push_back(ar);
    }
    return;
  }
  // DDP and ZeRO-1: units join a bucket in the order their gradients become final; a bucket of
  // consecutive units is one contiguous range of the flat gradient buffer.
  bucket_first_ = u;
  if (bucket_last_ < 0) bucket_last_ = u;
  bucket_bytes_ += unit_bytes(u, cfg_.reduce_bytes);
  if (bucket_bytes_ >= cfg_.bucket_mb * 1048576.0 || u == 0) close_bucket(producer);
}

void Builder::close_bucket(int producer) {
  const int ar = add(Op::all_reduce, Stream::comm, -1, cfg_.grad_accum - 1, {producer});
  tasks_[ar].group = Group::world;
  tasks_[ar].first_unit = bucket_first_;
  tasks_[ar].last_unit = bucket_last_;
  tasks_[ar].bytes = bucket_bytes_;
  stage(ar, bucket_bytes_ / cfg_.reduce_bytes, 0, cfg_.reduce_bytes);
  reductions_.push_back(ar);
  bucket_first_ = bucket_last_ = -1;
  bucket_bytes_ = 0;
}

Plan Builder::build() {
  const auto& c = desc_.config;
  const Strategy s = cfg_.strategy;
  plan_.config = cfg_;
  plan_.shard_size = s == Strategy::ddp ? 1 : s == Strategy::hybrid ? cfg_.shard_group : cfg_.world;
  plan_.layout = model::flat_layout(desc_, plan_.shard_size);
  sharded_params_ = s == Strategy::fsdp || s == Strategy::hybrid;
  sharded_grads_ = sharded_params_ || s == Strategy::zero2;
  const bool sharded_optimizer = s != Strategy::ddp;

  const int64_t full = plan_.layout.total * 4, shard = full / plan_.shard_size;
  plan_.static_memory.params = sharded_params_ ? shard : full;
  plan_.static_memory.grads = sharded_grads_ ? shard : full;
  plan_.static_memory.optimizer = 2 * (sharded_optimizer ? shard : full);
  plan_.static_memory.activations = desc_.activation_bytes(cfg_.batch, cfg_.seq);

  const int U = static_cast<int>(desc_.units.size()), emb = 0, fin = U - 1;
  const double BT = static_cast<double>(cfg_.batch * cfg_.seq), C = static_cast<double>(c.n_embd);
  const double block_fwd = 2 * BT * 12 * C * C + 2 * BT * cfg_.seq * C;
  const double head_flops = 6 * BT * C * static_cast<double>(c.vocab_size);
  const int last_micro = static_cast<int>(cfg_.grad_accum) - 1;

  int emb_gather = -1;
  for (int m = 0; m <= last_micro; ++m) {
    // Forward.
    if (sharded_params_ && m == 0) {
      emb_gather = add(Op::all_gather, Stream::comm, emb, 0);
      tasks_[emb_gather].bytes = unit_bytes(emb, cfg_.param_bytes);
      tasks_[emb_gather].allocs.push_back({gathered(emb), MemCategory::params, unit_bytes(emb, 4)});
      stage(emb_gather, plan_.layout.units[emb].padded, plan_.layout.units[emb].padded / plan_.shard_size,
            cfg_.param_bytes);
    }
    int f = add(Op::forward, Stream::compute, emb, m, m == 0 && emb_gather >= 0 ? std::vector<int>{emb_gather} : std::vector<int>{});
    for (int u = 1; u < fin; ++u) {
      const bool held = sharded_params_ && m > 0 && !chain_.empty() && chain_.back().unit == u;
      const int ag = sharded_params_ && !held ? gather(u, m, cfg_.prefetch_forward) : -1;
      f = add(Op::forward, Stream::compute, u, m, ag >= 0 ? std::vector<int>{ag} : std::vector<int>{});
      tasks_[f].flops = block_fwd;
      if (held) {
        tasks_[f].deps.push_back(reuse(f));
      } else if (ag >= 0) {
        consume(f);
      }
    }
    const int ag_fin = sharded_params_ ? gather(fin, m, cfg_.prefetch_forward) : -1;
    const int head = add(Op::head, Stream::compute, fin, m, ag_fin >= 0 ? std::vector<int>{ag_fin} : std::vector<int>{});
    tasks_[head].flops = head_flops;
    if (ag_fin >= 0) consume(head);
    if (sharded_grads_ && m == 0) {
      tasks_[head].allocs.push_back({full_grad(fin), MemCategory::grads, unit_bytes(fin, 4)});
      tasks_[head].allocs.push_back({full_grad(emb), MemCategory::grads, unit_bytes(emb, 4)});
    }
    if (m == last_micro) reduce_grad(fin, head);

    // Backward, last block first.
    for (int u = fin - 1; u >= 1; --u) {
      const int ag = sharded_params_ ? gather(u, m, cfg_.prefetch_backward) : -1;
      const int b = add(Op::backward, Stream::compute, u, m, ag >= 0 ? std::vector<int>{ag} : std::vector<int>{});
      tasks_[b].flops = 2 * block_fwd;
      if (sharded_grads_ && m == 0) tasks_[b].allocs.push_back({full_grad(u), MemCategory::grads, unit_bytes(u, 4)});
      if (ag >= 0) consume(b);
      if (m == last_micro) reduce_grad(u, b);
    }
    const int b_emb = add(Op::backward, Stream::compute, emb, m);
    if (sharded_params_ && m == last_micro) tasks_[b_emb].frees.push_back(gathered(emb));
    if (m == last_micro) reduce_grad(emb, b_emb);
  }

  const int norm = add(Op::grad_norm, Stream::compute, -1, last_micro, reductions_);
  const int opt = add(Op::optimizer, Stream::compute, -1, last_micro, {norm});
  tasks_[opt].flops = 10.0 * static_cast<double>(sharded_optimizer ? plan_.layout.total / plan_.shard_size : plan_.layout.total);
  if (s == Strategy::zero1 || s == Strategy::zero2) {
    for (int u = 0; u < U; ++u) {
      const int pg = add(Op::param_gather, Stream::comm, u, last_micro, {opt});
      tasks_[pg].bytes = unit_bytes(u, cfg_.param_bytes);
    }
  }
  plan_.tasks = schedule();
  return plan_;
}

// Orders the comm stream: each collective goes right after the compute task that makes it
// ready (the latest compute task it depends on, directly or through other collectives), so an
// all-gather prefetched for the next unit is queued ahead of the reduce-scatter of the unit
// that just finished. Compute keeps its order. Ids are renumbered to list order.
std::vector<Task> Builder::schedule() {
  const int n = static_cast<int>(tasks_.size());
  std::vector<int> pos(n, -1), ready(n, -1);
  int next = 0;
  for (const Task& t : tasks_)
    if (t.stream == Stream::compute) pos[t.id] = next++;
  for (const Task& t : tasks_) {  // deps always precede their task in creation order
    if (t.stream != Stream::comm) continue;
    for (int d : t.deps) ready[t.id] = std::max(ready[t.id], tasks_[d].stream == Stream::compute ? pos[d] : ready[d]);
  }
  std::vector<int> comm_order;
  for (const Task& t : tasks_)
    if (t.stream == Stream::comm) comm_order.push_back(t.id);
  std::stable_sort(comm_order.begin(), comm_order.end(), [&](int a, int b) { return ready[a] < ready[b]; });

  std::vector<int> order;
  size_t ci = 0;
  int compute_seen = 0;
  for (const Task& t : tasks_) {
    if (t.stream != Stream::compute) continue;
    while (ci < comm_order.size() && ready[comm_order[ci]] < compute_seen) order.push_back(comm_order[ci++]);
    order.push_back(t.id);
    ++compute_seen;
  }
  while (ci < comm_order.size()) order.push_back(comm_order[ci++]);

  std::vector<int> new_id(n);
  for (int i = 0; i < n; ++i) new_id[order[i]] = i;
  std::vector<Task> out;
  for (int old : order) {
    Task t = tasks_[old];
    t.id = new_id[old];
    for (int& d : t.deps) d = new_id[d];
    std::sort(t.deps.begin(), t.deps.end());
    out.push_back(std::move(t));
  }
  return out;
}

void validate(const PlanConfig& c) {
  auto need = [](bool ok, const std::string& msg) {
    if (!ok) throw std::invalid_argument(msg);
  };
  need(c.world >= 1, "world size must be >= 1");
  need(c.batch > 0 && c.seq > 0 && c.grad_accum > 0, "batch, seq and grad-accum must be positive");
  need(c.prefetch_forward >= 0 && c.prefetch_backward >= 0, "prefetch-forward and prefetch-backward must be >= 0");
  need(c.max_gathers_in_flight >= 1, "max-gathers-in-flight must be >= 1");
  need(c.bucket_mb > 0, "bucket-mb must be positive");
  need(c.param_bytes == 4 || c.param_bytes == 2, "param dtype must be fp32 or bf16");
  need(c.reduce_bytes == 4 || c.reduce_bytes == 2, "reduce dtype must be fp32 or bf16");
  // ZeRO-1/2 and DDP keep no separate fp32 master copy of the parameters: gathering them in
  // bf16 would round the replicas apart. Their mixed precision is bf16 reduction.
  need(c.param_bytes == 4 || c.strategy == Strategy::fsdp || c.strategy == Strategy::hybrid,
       "param-dtype bf16 needs a sharded-parameter strategy (fsdp or hybrid); use reduce-dtype bf16 with " +
           std::string(to_string(c.strategy)));
  if (c.strategy == Strategy::hybrid) {
    need(c.shard_group >= 1, "hybrid needs --shard-group G >= 1");
    need(c.world % c.shard_group == 0, "shard-group " + std::to_string(c.shard_group) +
                                           " does not divide the number of ranks " + std::to_string(c.world));
  }
}

}  // namespace

Plan build_plan(const model::ModelDesc& desc, const PlanConfig& config) {
  PlanConfig c = config;
  // One rank has nothing to shard or reduce: every strategy is DDP's compute without collectives
  // (a sharded plan would only copy parameters into gathered buffers and back).
  if (c.world == 1) c.strategy = Strategy::ddp, c.param_bytes = c.reduce_bytes = 4;
  if (c.strategy == Strategy::hybrid && c.shard_group == 0) c.shard_group = c.world;
  validate(c);
  return Builder(desc, c).build();
}

}  // namespace shardlm::plan
