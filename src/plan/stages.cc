// The stages pass (stages.h).
#include "plan/stages.h"

#include <algorithm>
#include <string>

namespace shardlm::plan {

// The buffer of a staged unit's routed rows on one end (send, recv) of one of its exchanges.
int UnitStages::routed(int u, int m, int exchange, bool reverse, const char* end, int64_t bytes) {
  return d_.buffer(std::string(end) + " " + d_.uname(u) + " x" + std::to_string(exchange) + (reverse ? " grads" : "") + PlanDraft::tag(m),
                Role::routed, MemCategory::activations, bytes, u, DType::int8);
}

// A staged unit's pass (model::UnitCosts::exchanges): `first`, built as the whole pass, becomes
// its first stage (the last one in a backward, which runs the stages in reverse), and the other
// stages follow, each after the exchange that feeds it: the stage `after` stages back (the one just
// before, or earlier for a prefetch) writes the exchange's `send` (from `written_from` stages back
// on), the exchange fills `recv`, which the stage after reads and frees. An exchange that
// `forwards` sends on an earlier exchange's `recv` instead, which then lives until its own stage.
// An exchange over axes of one rank is left out (the stage after reads `send`); a `none` route has
// no exchange. Everything `first` freed, the last stage frees instead, and it is the pass's
// consumer of gathered parameters. Returns it.
int UnitStages::split(int first, bool reverse) {
  const int u = d_.at(first).unit, m = d_.at(first).micro;
  const model::UnitCosts& c = costs_[u];
  const std::vector<model::Exchange>& exchanges = c.exchanges_of(reverse);
  const int S = c.stages(reverse);
  if (S == 1) return first;
  using Route = model::Exchange::Route;
  // Each exchange runs over its own axis (a MoE block under cp: the attention's and the routing
  // counts' over cp, the routed rows' over ep); one over an axis of one rank is left out. The
  // stages name stage_axes.
  auto axes_of = [&](const model::Exchange& x) { return exchange_axes(x); };
  auto spans_of = [&](const model::Exchange& x) { return plan_.mesh.group_size(axes_of(x)) > 1; };
  const std::vector<int> axes = stage_axes(u, reverse);
  d_.at(first).axes = axes;
  const Task whole = d_.at(first);
  d_.at(first).frees.clear();
  d_.at(first).stage = reverse ? S - 1 : 0;
  d_.at(first).flops = whole.flops * c.share(d_.at(first).stage, reverse);
  auto exchange_into = [&](int i) -> const model::Exchange& { return exchanges[reverse ? S - 1 - i : i - 1]; };
  // Per position i in the pass: its stage's task, what its stage reads (the receive, or the send
  // of an exchange left out), its exchange, and the position whose stage frees that receive (its
  // own, or a later one whose exchange sends it on).
  std::vector<int> line{first}, feed(S, -1), xts(S, -1), freed_by(S), source(S, -1), ready(S, 0), freed_at_consumer(S, -1);
  for (int i = 0; i < S; ++i) freed_by[i] = i;
  // Each exchange is listed right after the last task it waits on (its `after` stage, and the
  // exchange whose receive it sends on), so the plan's walk counts its receive from the earliest
  // moment it can be allocated: the stages between may still hold what they free.
  for (int i = 1; i < S; ++i) {
    const model::Exchange& x = exchange_into(i);
    if (x.route == Route::none) continue;
    ready[i] = std::max(0, i - x.after);
    if (x.forwards > 0 && i - x.forwards >= 1 && spans_of(x)) {
      source[i] = i - x.forwards;
      freed_by[source[i]] = i;
      ready[i] = std::max(ready[i], ready[source[i]]);
    }
  }
  auto add_exchange = [&](int i) {
    const int e = reverse ? S - 1 - i : i - 1;
    const model::Exchange& x = exchange_into(i);
    const int producer = std::max(0, i - x.after);
    const bool forward_on = source[i] >= 0 && xts[source[i]] >= 0;
    int send = forward_on ? feed[source[i]] : -1;
    if (!forward_on) {
      send = routed(u, m, e, reverse, "send", x.bound_bytes);
      const int from = std::max(0, i - std::max(x.after, x.written_from));
      d_.alloc(line[from], send);
      for (int w = from; w <= producer; ++w) d_.at(line[w]).io.send = send;
    }
    feed[i] = send;
    if (!spans_of(x)) return;
    const int xt = d_.add(Op::exchange, u, m,
                       forward_on ? std::vector<int>{xts[source[i]], line[producer]} : std::vector<int>{line[producer]});
    d_.at(xt).stage = e, d_.at(xt).reverse = reverse, d_.at(xt).axes = axes_of(x);
    d_.at(xt).ring_step = x.route == Route::ring_next ? 1 : x.route == Route::ring_prev ? -1 : 0;
    d_.at(xt).bytes = x.expected_bytes;
    d_.at(xt).carries = x.carries;
    d_.at(xt).io.send = send;
    d_.at(xt).io.recv = feed[i] = routed(u, m, e, reverse, "recv", x.bound_bytes);
    // An exchange started stages ahead of its consumer runs beside those stages: its buffers
    // then live from its producer stage to its consumer stage, so they come and go with the
    // compute stream, and the plan's walk holds them alive with what those stages allocate.
    const bool beside = x.after >= 2;
    d_.alloc(beside ? line[producer] : xt, feed[i]);
    if (!forward_on) beside ? void(freed_at_consumer[i] = send) : d_.free(xt, send);
    xts[i] = xt;
  };
  auto add_exchanges_ready_at = [&](int j) {
    for (int i = j + 1; i < S; ++i)
      if (exchange_into(i).route != Route::none && ready[i] == j) add_exchange(i);
  };
  add_exchanges_ready_at(0);
  for (int i = 1; i < S; ++i) {
    const int s = reverse ? S - 1 - i : i;
    const int t = d_.add(whole.op, u, m, {xts[i] >= 0 ? xts[i] : line.back()});
    d_.at(t).stage = s, d_.at(t).axes = axes;
    d_.at(t).flops = whole.flops * c.share(s, reverse);
    d_.at(t).io = whole.io;
    d_.at(t).io.send = -1;
    d_.at(t).io.recv = feed[i];
    line.push_back(t);
    for (int j = 1; j <= i; ++j)
      if (freed_by[j] == i && feed[j] >= 0) d_.free(t, feed[j]);
    if (freed_at_consumer[i] >= 0) d_.free(t, freed_at_consumer[i]);
    add_exchanges_ready_at(i);
  }
  const int last = line.back();
  for (int f : whole.frees) d_.free(last, f);
  return last;
}

}  // namespace shardlm::plan
