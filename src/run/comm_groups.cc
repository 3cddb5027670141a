#include "run/comm_groups.h"

#include <stdexcept>

#include "comm/nccl.h"

namespace shardlm::run {

namespace {
// The backend's copies, as the staged communicators want them.
class BackendCopier final : public comm::DeviceCopier {
 public:
  explicit BackendCopier(const kernels::Backend& backend) : backend_(backend) {}
  void to_host(void* host_dst, const void* device_src, size_t bytes) const override {
    backend_.download(host_dst, device_src, bytes);
  }
  void to_device(void* device_dst, const void* host_src, size_t bytes) const override {
    backend_.upload(device_dst, host_src, bytes);
  }

 private:
  const kernels::Backend& backend_;
};
}  // namespace

CommGroups::CommGroups(comm::Communicator& world, const plan::Mesh& mesh, const kernels::Backend* backend,
                       DeviceCollectives device)
    : world_(world), mesh_(mesh) {
  if (mesh.rank_count() != world.size())
    throw std::logic_error("comm groups: a mesh of " + std::to_string(mesh.rank_count()) + " ranks (" +
                           mesh.to_string() + ") over a world of " + std::to_string(world.size()));
  const int A = static_cast<int>(mesh.axes().size());
  for (int a = 0; a < A; ++a)
    if (mesh[a].size > 1) all_ |= 1u << a;
  // The group of this rank over the axes in `set`, split from `from` (a collective call).
  auto split_over = [&](comm::Communicator& from, unsigned set) {
    std::vector<int> axes;
    for (int a = 0; a < A; ++a)
      if (set & (1u << a)) axes.push_back(a);
    return from.split(mesh.group_of(world.rank(), axes), mesh.index_in(world.rank(), axes));
  };
  for (unsigned set = 0; set < all_; ++set)  // every proper subset, in the same order on every rank
    if ((set & ~all_) == 0) groups_[set] = split_over(world, set);
  // Exchanges run over ep (a MoE block's routed rows) or cp (a block's attention split): every set
  // of axes holding one of them gets communicators of its own for the exchange stream.
  unsigned exchange_axes = 0;
  for (int a : mesh.exchange_axes())
    if (mesh[a].size > 1) exchange_axes |= 1u << a;
  for (unsigned set = 1; set <= all_ && exchange_axes != 0; ++set)
    if ((set & ~all_) == 0 && (set & exchange_axes)) exchange_groups_[set] = split_over(world, set);
  // Stages pass activations on from threads of their own: a communicator apart from the
  // collectives' keeps their messages apart.
  const int pipe_axis = mesh.find(plan::AxisRole::pipe);
  if (pipe_axis >= 0 && mesh[pipe_axis].size > 1) pipe_ = split_over(world, 1u << pipe_axis);
  if (backend == nullptr || backend->host_memory()) return;
  if (device == DeviceCollectives::nccl) {
    nccl_world_ = comm::make_nccl_communicator(world, backend->stream_handle());
    for (auto& [set, group] : groups_) nccl_groups_[set] = split_over(*nccl_world_, set);  // same order on every rank
    return;
  }
  copier_ = std::make_unique<BackendCopier>(*backend);
  if (pipe_) staged_pipe_ = std::make_unique<comm::StagedCommunicator>(*pipe_, *copier_, backend->memory());
  staged_world_ = std::make_unique<comm::StagedCommunicator>(world, *copier_, backend->memory());
  for (auto& [set, group] : groups_)
    staged_groups_[set] = std::make_unique<comm::StagedCommunicator>(*group, *copier_, backend->memory());
  for (auto& [set, group] : exchange_groups_)
    staged_exchange_groups_[set] = std::make_unique<comm::StagedCommunicator>(*group, *copier_, backend->memory());
}

CommGroups::~CommGroups() = default;

unsigned CommGroups::key(const std::vector<int>& axes) const {
  unsigned k = 0;
  for (int a : axes) k |= 1u << a;
  return k & all_;
}

comm::Communicator& CommGroups::get(const std::vector<int>& axes) const {
  const unsigned k = key(axes);
  if (nccl_world_) return k == all_ ? *nccl_world_ : *nccl_groups_.at(k);
  if (!copier_) return host(axes);
  return k == all_ ? *staged_world_ : *staged_groups_.at(k);
}

std::string CommGroups::describe() const {
  if (nccl_world_) return "nccl";
  return staged() ? world_.backend() + " staged through host memory" : world_.backend();
}

comm::Communicator& CommGroups::host(const std::vector<int>& axes) const {
  const unsigned k = key(axes);
  return k == all_ ? world_ : *groups_.at(k);
}

comm::Communicator& CommGroups::exchange(const std::vector<int>& axes) const {
  if (!copier_) return exchange_host(axes);
  const auto it = staged_exchange_groups_.find(key(axes));
  if (it == staged_exchange_groups_.end()) throw std::logic_error("comm groups: no exchange communicator over these axes");
  return *it->second;
}

comm::Communicator& CommGroups::exchange_host(const std::vector<int>& axes) const {
  const auto it = exchange_groups_.find(key(axes));
  if (it == exchange_groups_.end()) throw std::logic_error("comm groups: no exchange communicator over these axes");
  return *it->second;
}

}  // namespace shardlm::run

namespace shardlm::run {

comm::Communicator& CommGroups::pipe() const {
  if (!pipe_) throw std::logic_error("comm groups: the mesh has no pipe of more than one stage");
  return staged_pipe_ ? *staged_pipe_ : *pipe_;
}

}  // namespace shardlm::run
