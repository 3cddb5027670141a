// Reduction handlers: gradients reduced (scattered or whole), and the step's figures every rank
// needs (the norm's sums, the loss, routing statistics) gathered and added in rank order.
#include "run/executor.h"

#include <algorithm>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "run/executor_run.h"

namespace shardlm::run {

using plan::State;
using plan::Task;

comm::Scratch Executor::comm_scratch(const Task& t, Run& r) {
  if (t.io.comm_scratch < 0) return {};
  Buffer& b = r.live[t.io.comm_scratch];
  return {b.data(), static_cast<int64_t>(b.bytes())};
}

// Sums a double over a communicator exactly and identically on every rank: gather every rank's
// bits, add in rank order.
double Executor::sum_over(comm::Communicator& c, double local, const std::string& label) {
  std::vector<double> all(c.size());
  c.all_gather(&local, all.data(), 2, DType::fp32, label)->wait(timeout_);
  double sum = 0;
  for (double v : all) sum += v;
  return sum;
}

void Executor::reduce_scatter(const Task& t, Run& r) {
  comm::Communicator& c = comms_.get(t.axes);
  const std::string lbl = label(t, r.step);
  const Shard s = shard_of(State::grads, t.unit);
  float* full = r.f32(t.io.grads);
  float* mine = held(State::grads, t.unit, &r);
  // Reduced each micro-step, the shard adds to the sum of the earlier ones (zero at the start):
  // in fp32 the held sum joins this rank's part of the scatter, in bf16 (which would round it) the
  // fp32 result is added after, in the full gradients' bytes (dead once cast to the wire).
  const bool accumulate = r.plan.config.reduce_each_micro_step;
  const comm::Scratch scratch = comm_scratch(t, r);
  if (t.io.staging < 0) {
    float* own_part = full + c.rank() * s.len;
    if (accumulate) backend_.residual_forward(own_part, own_part, mine, s.len);
    c.reduce_scatter(full, mine, s.len, DType::fp32, lbl, scratch)->wait(timeout_);
    return;
  }
  uint16_t* whole = r.live[t.io.staging].as<uint16_t>();
  uint16_t* own = whole + s.len * c.size();
  backend_.fp32_to_bf16(whole, full, s.len * c.size());
  c.reduce_scatter(whole, own, s.len, DType::bf16, lbl, scratch)->wait(timeout_);
  if (!accumulate) return backend_.bf16_to_fp32(mine, own, s.len);
  backend_.bf16_to_fp32(full, own, s.len);
  backend_.residual_forward(mine, mine, full, s.len);
}

void Executor::all_reduce(const Task& t, Run& r) {
  comm::Communicator& c = comms_.get(t.axes);
  const std::string lbl = label(t, r.step);
  float* buf;
  int64_t n;
  if (t.first_unit >= 0) {  // a bucket: consecutive units in memory, one contiguous range; or one unit's window
    const int64_t begin = plan_.held_offset(State::grads, t.first_unit);
    buf = held(State::grads, t.first_unit, &r);
    n = plan_.held_offset(State::grads, t.last_unit) + plan_.held_elems(State::grads, t.last_unit) - begin;
  } else {  // hybrid: this rank's gradient shard across the replicas
    const Shard s = shard_of(State::grads, t.unit);
    buf = held(State::grads, t.unit, &r);
    n = s.len;
  }
  const comm::Scratch scratch = comm_scratch(t, r);
  if (t.io.staging < 0) return c.all_reduce(buf, n, DType::fp32, lbl, scratch)->wait(timeout_);
  uint16_t* tmp = r.live[t.io.staging].as<uint16_t>();
  backend_.fp32_to_bf16(tmp, buf, n);
  c.all_reduce(tmp, n, DType::bf16, lbl, scratch)->wait(timeout_);
  backend_.bf16_to_fp32(buf, tmp, n);
}

// Every rank's (squared-gradient sum, loss sum) reaches every rank of the plan's communicator (the
// world): the norm adds, in rank order, the sums of the ranks holding this replica's gradient
// shards (only this rank's own when gradients are whole), and every rank learns, identically and
// before any optimizer task runs, which ranks' loss or gradients went non-finite.
void Executor::norm_reduce(const Task& t, Run& r) {
  comm::Communicator& c = comms_.host(t.axes);  // host sums
  const int K = static_cast<int>(grad_classes_.size()), n = K + 1;
  std::vector<double> mine(r.class_sums);
  mine.push_back(r.result.loss_sum);
  std::vector<double> all(n * c.size());
  c.all_gather(mine.data(), all.data(), 2 * n, DType::fp32, "grad_norm step " + std::to_string(r.step))->wait(timeout_);
  // Member i of the group (row-major over its axes) is the world rank with my coordinates
  // elsewhere; a class's sum adds the members that differ from me only on the class's axes.
  const plan::Mesh& mesh = plan_.mesh;
  const std::vector<int> me = mesh.coords(rank_);
  std::vector<std::vector<int>> member(c.size(), me);
  for (int i = 0; i < c.size(); ++i)
    for (int a = static_cast<int>(t.axes.size()) - 1, rest = i; a >= 0; --a) {
      member[i][t.axes[a]] = rest % mesh[t.axes[a]].size;
      rest /= mesh[t.axes[a]].size;
    }
  auto same_outside = [&](const std::vector<int>& coords, const std::vector<int>& axes) {
    for (int a : t.axes)
      if (std::find(axes.begin(), axes.end(), a) == axes.end() && coords[a] != me[a]) return false;
    return true;
  };
  r.sum_squares = 0;
  for (int k = 0; k < K; ++k) {
    double sum = 0;
    for (int i = 0; i < c.size(); ++i)
      if (same_outside(member[i], grad_classes_[k].axes)) sum += all[n * i + k];
    r.sum_squares += sum;
  }
  for (int i = 0; i < c.size(); ++i) {
    double squares = 0;
    for (int k = 0; k < K; ++k) squares += all[n * i + k];
    note_nonfinite(r, mesh.rank_of(member[i]), squares, all[n * i + K]);
  }
  r.finiteness_known = true;
}

namespace {

// How the ranks' values of one reduced field combine, in rank order.
enum class Reduce {
  sum,
  max,
  min_present,  // the least of the values >= 0; -1 when no rank has one (MoeStats's min_load)
};

// A figure of the step's result that the ranks reduce: read as a double (the counts are exact in
// one) and written back as the field's type. Adding a figure is one line of kReducedFields.
struct ReducedField {
  const char* name;
  Reduce how;
  double (*get)(const StepResult&);
  void (*set)(StepResult&, double);
};

template <auto Member>  // a member of layers::MoeStats
ReducedField moe_field(const char* name, Reduce how) {
  using T = std::remove_reference_t<decltype(std::declval<layers::MoeStats&>().*Member)>;
  return {name, how, [](const StepResult& r) { return static_cast<double>(r.moe.*Member); },
          [](StepResult& r, double v) { r.moe.*Member = static_cast<T>(v); }};
}

// The loss with every rank's routing figures (a mixture-of-experts model's).
const ReducedField kReducedFields[] = {
    {"loss_sum", Reduce::sum, [](const StepResult& r) { return r.loss_sum; }, [](StepResult& r, double v) { r.loss_sum = v; }},
    moe_field<&layers::MoeStats::aux_loss>("aux_loss", Reduce::sum),
    moe_field<&layers::MoeStats::z_loss>("z_loss", Reduce::sum),
    moe_field<&layers::MoeStats::routed>("routed", Reduce::sum),
    moe_field<&layers::MoeStats::dropped>("dropped", Reduce::sum),
    moe_field<&layers::MoeStats::min_load>("min_load", Reduce::min_present),
    moe_field<&layers::MoeStats::max_load>("max_load", Reduce::max),
    moe_field<&layers::MoeStats::imbalance_sum>("imbalance_sum", Reduce::sum),
    moe_field<&layers::MoeStats::routings>("routings", Reduce::sum),
};
constexpr int kNumReducedFields = static_cast<int>(sizeof(kReducedFields) / sizeof(kReducedFields[0]));

// The field's reduction of `n` ranks' values, `stride` apart.
double reduce(Reduce how, const double* v, int n, int stride) {
  double out = how == Reduce::sum ? 0.0 : -1.0;
  for (int i = 0; i < n; ++i) {
    const double x = v[i * stride];
    if (how == Reduce::sum) out += x;
    else if (how == Reduce::max) out = std::max(out, x);
    else if (x >= 0) out = out < 0 ? x : std::min(out, x);
  }
  return out;
}

}  // namespace

void Executor::loss_reduce(const Task& t, Run& r) {
  comm::Communicator& c = comms_.host(t.axes);  // host sums
  const std::string lbl = "loss step " + std::to_string(r.step);
  if (desc_.config.family != model::Family::moe) {
    r.result.loss_sum = sum_over(c, r.result.loss_sum, lbl);
    return;
  }
  reduce_fields(c, lbl, r);
}

// Every rank's fields of kReducedFields to every rank, each reduced in rank order.
void Executor::reduce_fields(comm::Communicator& c, const std::string& label, Run& r) {
  constexpr int n = kNumReducedFields;
  double mine[n];
  for (int f = 0; f < n; ++f) mine[f] = kReducedFields[f].get(r.result);
  std::vector<double> all(n * c.size());
  c.all_gather(mine, all.data(), 2 * n, DType::fp32, label)->wait(timeout_);
  for (int f = 0; f < n; ++f) kReducedFields[f].set(r.result, reduce(kReducedFields[f].how, all.data() + f, c.size(), n));
}

}  // namespace shardlm::run
