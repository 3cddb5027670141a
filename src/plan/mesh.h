// A device mesh: the world's ranks laid out on named axes (torchtitan's DeviceMesh, as data).
// Axes are listed outermost first and ranks fill the mesh in row-major order, so the innermost
// axis holds consecutive ranks (a hybrid shard group within a node). Every collective names the
// axes it spans; its group is the ranks that agree with the caller on every other axis.
#pragma once

#include <string>
#include <vector>

namespace shardlm::plan {

// The axes shardlm knows: data parallel (replicated, sharded), expert and context parallel.
inline constexpr const char* kDpReplicate = "dp_replicate";
inline constexpr const char* kDpShard = "dp_shard";
inline constexpr const char* kExpert = "ep";
inline constexpr const char* kContext = "cp";

struct MeshAxis {
  std::string name;
  int size = 1;
};

class Mesh {
 public:
  Mesh() = default;
  // Throws std::invalid_argument for a size < 1 or a name used twice.
  explicit Mesh(std::vector<MeshAxis> axes);

  const std::vector<MeshAxis>& axes() const { return axes_; }
  const MeshAxis& operator[](int axis) const { return axes_.at(axis); }
  int rank_count() const;
  // The axis of this name; -1 when the mesh has none.
  int find(const std::string& name) const;
  // The axis of this name; throws std::logic_error when the mesh has none.
  int axis(const std::string& name) const;
  // Ranks in one group over `axes`: the product of their sizes.
  int group_size(const std::vector<int>& axes) const;

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
