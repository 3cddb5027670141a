// Which positions of a sequence a rank's rows hold, for attention over a sequence split among
// ranks (context parallelism): `count` chunks of `rows` consecutive positions each, chunk c
// starting at position pos[c], stored one after another. A whole sequence is one chunk at 0.
#pragma once

#include <cstdint>

namespace shardlm::kernels {

struct SeqChunks {
  int64_t count = 1;
  int64_t rows = 0;
  const int64_t* pos = nullptr;  // count starting positions
  int64_t total() const { return count * rows; }
};

}  // namespace shardlm::kernels
