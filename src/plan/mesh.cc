#include "plan/mesh.h"

#include <algorithm>
#include <stdexcept>

namespace shardlm::plan {

Mesh::Mesh(std::vector<MeshAxis> axes) : axes_(std::move(axes)) {
  for (size_t a = 0; a < axes_.size(); ++a) {
    if (axes_[a].size < 1)
      throw std::invalid_argument("mesh: axis " + axes_[a].name + " has size " + std::to_string(axes_[a].size));
    for (size_t b = 0; b < a; ++b)
      if (axes_[b].name == axes_[a].name) throw std::invalid_argument("mesh: axis " + axes_[a].name + " named twice");
  }
}

int Mesh::rank_count() const {
  int n = 1;
  for (const MeshAxis& a : axes_) n *= a.size;
  return n;
}

int Mesh::find(const std::string& name) const {
  for (size_t a = 0; a < axes_.size(); ++a)
    if (axes_[a].name == name) return static_cast<int>(a);
  return -1;
}

int Mesh::axis(const std::string& name) const {
  const int a = find(name);
  if (a < 0) throw std::logic_error("mesh: no axis " + name + " in " + to_string());
  return a;
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
  for (const MeshAxis& a : axes_) s += (s.empty() ? "" : " × ") + a.name + "=" + std::to_string(a.size);
  return s.empty() ? "(one rank)" : s;
}

}  // namespace shardlm::plan
