#include "comm/communicator.h"

#include <utility>

namespace shardlm::comm {

std::vector<int64_t> exchange_counts(Communicator& comm, const std::vector<int64_t>& send_counts,
                                     const std::string& label, std::chrono::milliseconds timeout) {
  const int n = comm.size();
  if (static_cast<int>(send_counts.size()) != n)
    throw Error("comm: exchange_counts: send_counts has " + std::to_string(send_counts.size()) +
                " entries for " + std::to_string(n) + " ranks");
  for (int j = 0; j < n; ++j)
    if (send_counts[j] < 0) throw Error("comm: exchange_counts: send_counts[" + std::to_string(j) + "] is negative");
  // No int64 DType: each count travels as its 8 bytes.
  std::vector<int64_t> recv_counts(n, 0);
  comm.all_to_all(send_counts.data(), recv_counts.data(), sizeof(int64_t), DType::int8, label)->wait(timeout);
  return recv_counts;
}

std::vector<int64_t> packed_displs(const std::vector<int64_t>& counts) {
  std::vector<int64_t> displs(counts.size(), 0);
  for (size_t j = 1; j < counts.size(); ++j) displs[j] = displs[j - 1] + counts[j - 1];
  return displs;
}

void check_all_to_all_v(const char* what, int size, const std::vector<int64_t>& send_counts,
                        const std::vector<int64_t>& send_displs, const std::vector<int64_t>& recv_counts,
                        const std::vector<int64_t>& recv_displs) {
  const std::pair<const char*, const std::vector<int64_t>*> fields[] = {
      {"send_counts", &send_counts}, {"send_displs", &send_displs}, {"recv_counts", &recv_counts}, {"recv_displs", &recv_displs}};
  for (const auto& [name, v] : fields) {
    if (static_cast<int>(v->size()) != size)
      throw Error(std::string("comm: ") + what + ": " + name + " has " + std::to_string(v->size()) + " entries for " +
                  std::to_string(size) + " ranks");
    for (int j = 0; j < size; ++j)
      if ((*v)[j] < 0) throw Error(std::string("comm: ") + what + ": " + name + "[" + std::to_string(j) + "] is negative");
  }
}

}  // namespace shardlm::comm
