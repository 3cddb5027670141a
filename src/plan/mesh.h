// A device mesh: the world's ranks laid out on axes (torchtitan's DeviceMesh, as data), each axis
// declared by its role. Axes are listed outermost first and ranks fill the mesh in row-major
// order, so the innermost axis holds consecutive ranks (a hybrid shard group within a node).
// Every collective names the axes it spans; its group is the ranks that agree with the caller on
// every other axis. Which axes split the data, reduce gradients and sum the loss and the gradient
// norm follows from the roles alone (the queries below); nothing else names an axis.
#pragma once

#include <initializer_list>
#include <string>
#include <vector>

#include "model/model.h"

namespace shardlm::plan {

// What the ranks along an axis differ in. A mesh holds each role at most once.
enum class AxisRole {
  replicate,  // dp_replicate: data-parallel replicas of the state (or of a whole shard group's)
  shard,      // dp_shard: data-parallel ranks among which a sharding strategy splits each unit's state
  expert,     // ep: data-parallel ranks that also split each MoE layer's experts
  context,    // cp: ranks holding different positions of the same sequences
  pipe,       // pp: pipeline stages, each holding its own units and passing activations on
};
inline constexpr AxisRole kAxisRoles[] = {AxisRole::replicate, AxisRole::shard, AxisRole::expert, AxisRole::context,
                                          AxisRole::pipe};
// The axis's name, as plans, traces and checkpoints print it: "dp_replicate", "dp_shard", "ep", "cp", "pp".
const char* to_string(AxisRole role);
// The role of the ranks a model's exchange travels between, or its unit is sliced over.
AxisRole role_of(model::Split split);

// Parameters as the mesh sees them: dense ones are used whole by every rank that holds them;
// expert ones are sliced over the expert axis, each rank computing with its own experts.
enum class ParamKind { dense, expert };

struct MeshAxis {
  AxisRole role = AxisRole::replicate;
  int size = 1;
  const char* name() const { return to_string(role); }
};

class Mesh {
 public:
  Mesh() = default;
  // Throws std::invalid_argument for a size < 1 or a role held twice.
  explicit Mesh(std::vector<MeshAxis> axes);

  const std::vector<MeshAxis>& axes() const { return axes_; }
  const MeshAxis& operator[](int axis) const { return axes_.at(axis); }
  int rank_count() const;
  // The axis of this role (of the role splitting `split`); -1 when the mesh has none.
  int find(AxisRole role) const;
  int find(model::Split split) const { return split == model::Split::none ? -1 : find(role_of(split)); }
  // The axis of this role; throws std::logic_error when the mesh has none.
  int axis(AxisRole role) const;
  // The axes of these roles the mesh has, in mesh order.
  std::vector<int> axes_of(std::initializer_list<AxisRole> roles) const;
  // Ranks in one group over `axes`: the product of their sizes.
  int group_size(const std::vector<int>& axes) const;

  // The queries that follow from the roles, each in mesh order. `sequence_split` says whether the
  // plan splits sequences over the context axis (training does; evaluation and generation run
  // whole sequences on every rank of it, which then computes what its neighbours compute).
  // The axes that split the data: ranks differing on them read different batches (replicate,
  // shard, expert); context ranks read the same batch, pipeline stages the same micro-batches.
  std::vector<int> data_axes() const;
  // The axes a parameter's gradients are summed over: every axis whose ranks computed different
  // contributions to the same parameter (the data axes and, where sequences are split, context),
  // less the expert axis for expert parameters (a rank's experts are its own). Never pipe: a
  // stage's parameters are its own.
  std::vector<int> grad_axes(ParamKind kind, bool sequence_split) const;
  // The axes the step's loss is summed over (then divided by its tokens): the ranks holding
  // different tokens' losses, and the pipeline stages (the last one holds them).
  std::vector<int> loss_axes(bool sequence_split) const;
  // The axes each rank's squared gradient sums are gathered over into the norm: the gradient
  // axes and the pipeline stages (which hold different parameters' gradients).
  std::vector<int> norm_axes(bool sequence_split) const;
  // The axes a unit's state splits over when the strategy shards it: shard, and expert and
  // context, whose ranks hold the same dense units; the axes those parts are replicated over.
  // Under a strategy that does not shard (DDP) expert and context replicate with the replicas.
  std::vector<int> shard_axes(bool strategy_shards) const;
  std::vector<int> replicate_axes(bool strategy_shards) const;
  // The axes a model's exchanges run over within a step (a MoE layer's routed rows, a split
  // attention's blocks): expert and context.
  std::vector<int> exchange_axes() const;

  // A rank's coordinate on every axis, and back.
  std::vector<int> coords(int rank) const;
  int rank_of(const std::vector<int>& coords) const;
  // Its position within its group over `axes` (row-major over those axes), and a number the
  // same for all ranks of that group and different for other groups (Communicator::split's color).
  int index_in(int rank, const std::vector<int>& axes) const;
  int group_of(int rank, const std::vector<int>& axes) const;

  // "dp_replicate=2 × dp_shard=4".
  std::string to_string() const;

 private:
  std::vector<MeshAxis> axes_;
};

}  // namespace shardlm::plan
