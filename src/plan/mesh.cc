#include "plan/mesh.h"

#include <algorithm>
#include <stdexcept>

namespace shardlm::plan {

namespace {

// How a dense unit's state lies across an axis's ranks.
enum class DenseState {
  replicated,     // the same on every rank
  sharded,        // split among them (under DDP the axis has one rank)
  with_strategy,  // split with dp_shard under a sharding strategy, replicated with the replicas under DDP
  own,            // each rank holds other units
};

// What each role's ranks share, from which every query follows.
struct RoleTraits {
  AxisRole role;
  const char* name;
  bool splits_data;      // its ranks read different batches
  bool splits_sequence;  // its ranks hold different positions of the same sequences (where the plan splits them)
  bool owns_experts;     // its ranks hold different experts: expert gradients are not summed over it
  DenseState dense;
  bool exchanges;  // a model's exchanges run over it within a step
};

constexpr RoleTraits kTraits[] = {
    {AxisRole::replicate, "dp_replicate", true, false, false, DenseState::replicated, false},
    {AxisRole::shard, "dp_shard", true, false, false, DenseState::sharded, false},
    {AxisRole::expert, "ep", true, false, true, DenseState::with_strategy, true},
    {AxisRole::context, "cp", false, true, false, DenseState::with_strategy, true},
    {AxisRole::pipe, "pp", false, false, false, DenseState::own, false},
};

const RoleTraits& traits(AxisRole role) {
  for (const RoleTraits& t : kTraits)
    if (t.role == role) return t;
  throw std::logic_error("mesh: an axis role without traits");
}

// Its ranks computed different contributions to the same dense parameter's gradient.
bool sums_gradients(const RoleTraits& t, bool sequence_split) {
  return t.splits_data || (sequence_split && t.splits_sequence);
}

// Its ranks hold different terms of a whole-model total (the loss, the squared gradients): the
// gradient axes and the pipeline stages, whose losses and gradients are their own.
bool sums_totals(const RoleTraits& t, bool sequence_split) {
  return sums_gradients(t, sequence_split) || t.dense == DenseState::own;
}

// The axes whose role's traits satisfy `keep`, in mesh order.
template <typename Keep>
std::vector<int> axes_where(const std::vector<MeshAxis>& axes, Keep keep) {
  std::vector<int> kept;
  for (size_t a = 0; a < axes.size(); ++a)
    if (keep(traits(axes[a].role))) kept.push_back(static_cast<int>(a));
  return kept;
}

}  // namespace

const char* to_string(AxisRole role) { return traits(role).name; }

AxisRole role_of(model::Split split) {
  switch (split) {
    case model::Split::experts: return AxisRole::expert;
    case model::Split::sequence: return AxisRole::context;
    case model::Split::none: break;
  }
  throw std::logic_error("mesh: no axis splits nothing");
}

Mesh::Mesh(std::vector<MeshAxis> axes) : axes_(std::move(axes)) {
  for (size_t a = 0; a < axes_.size(); ++a) {
    const std::string name = axes_[a].name();
    if (axes_[a].size < 1) throw std::invalid_argument("mesh: axis " + name + " has size " + std::to_string(axes_[a].size));
    for (size_t b = 0; b < a; ++b)
      if (axes_[b].role == axes_[a].role) throw std::invalid_argument("mesh: axis " + name + " given twice");
  }
}

int Mesh::rank_count() const {
  int n = 1;
  for (const MeshAxis& a : axes_) n *= a.size;
  return n;
}

int Mesh::find(AxisRole role) const {
  for (size_t a = 0; a < axes_.size(); ++a)
    if (axes_[a].role == role) return static_cast<int>(a);
  return -1;
}

int Mesh::axis(AxisRole role) const {
  const int a = find(role);
  if (a < 0) throw std::logic_error(std::string("mesh: no axis ") + plan::to_string(role) + " in " + to_string());
  return a;
}

std::vector<int> Mesh::axes_of(std::initializer_list<AxisRole> roles) const {
  std::vector<int> axes;
  for (size_t a = 0; a < axes_.size(); ++a)
    if (std::find(roles.begin(), roles.end(), axes_[a].role) != roles.end()) axes.push_back(static_cast<int>(a));
  return axes;
}

std::vector<int> Mesh::data_axes() const {
  return axes_where(axes_, [](const RoleTraits& t) { return t.splits_data; });
}
std::vector<int> Mesh::grad_axes(ParamKind kind, bool sequence_split) const {
  return axes_where(axes_, [&](const RoleTraits& t) {
    return sums_gradients(t, sequence_split) && !(kind == ParamKind::expert && t.owns_experts);
  });
}
std::vector<int> Mesh::loss_axes(bool sequence_split) const {
  return axes_where(axes_, [&](const RoleTraits& t) { return sums_totals(t, sequence_split); });
}
std::vector<int> Mesh::norm_axes(bool sequence_split) const {
  return axes_where(axes_, [&](const RoleTraits& t) { return sums_totals(t, sequence_split); });
}
std::vector<int> Mesh::shard_axes(bool strategy_shards) const {
  return axes_where(axes_, [&](const RoleTraits& t) {
    return t.dense == DenseState::sharded || (strategy_shards && t.dense == DenseState::with_strategy);
  });
}
std::vector<int> Mesh::replicate_axes(bool strategy_shards) const {
  return axes_where(axes_, [&](const RoleTraits& t) {
    return t.dense == DenseState::replicated || (!strategy_shards && t.dense == DenseState::with_strategy);
  });
}
std::vector<int> Mesh::exchange_axes() const {
  return axes_where(axes_, [](const RoleTraits& t) { return t.exchanges; });
}

int Mesh::group_size(const std::vector<int>& axes) const {
  int n = 1;
  for (int a : axes) n *= axes_.at(a).size;
  return n;
}

std::vector<int> Mesh::coords(int rank) const {
  std::vector<int> c(axes_.size());
  for (int a = static_cast<int>(axes_.size()) - 1; a >= 0; --a) {
    c[a] = rank % axes_[a].size;
    rank /= axes_[a].size;
  }
  return c;
}

int Mesh::rank_of(const std::vector<int>& coords) const {
  int rank = 0;
  for (size_t a = 0; a < axes_.size(); ++a) rank = rank * axes_[a].size + coords.at(a);
  return rank;
}

int Mesh::index_in(int rank, const std::vector<int>& axes) const {
  const std::vector<int> c = coords(rank);
  int index = 0;
  for (size_t a = 0; a < axes_.size(); ++a)
    if (std::find(axes.begin(), axes.end(), static_cast<int>(a)) != axes.end()) index = index * axes_[a].size + c[a];
  return index;
}

int Mesh::group_of(int rank, const std::vector<int>& axes) const {
  std::vector<int> c = coords(rank);
  for (int a : axes) c.at(a) = 0;
  return rank_of(c);
}

std::string Mesh::to_string() const {
  std::string s;
  for (const MeshAxis& a : axes_) s += (s.empty() ? "" : " × ") + std::string(a.name()) + "=" + std::to_string(a.size);
  return s.empty() ? "(one rank)" : s;
}

}  // namespace shardlm::plan
