// The CUDA kernels' own scratch, as model::KernelScratch describes it. Each figure follows the
// allocations of one Backend method in kernels/cuda_*.cu, in the order that method makes and drops
// them: a piece lives until the end of its statement (an operand built inside a GEMM's argument
// list) or of the call, and the region they come from hands memory back last in, first out.
#include <algorithm>

#include "model/model.h"

namespace shardlm::model {

namespace {

int64_t piece(int64_t bytes) { return bytes > 0 ? (bytes + 511) / 512 * 512 : 0; }
int64_t bf16s(int64_t n) { return piece(2 * n); }
int64_t floats(int64_t n) { return piece(4 * n); }

// Which attention kernels a call runs (cuda_backend.cu's use_attention_mma / attention_gemm_fits).
enum class AttentionPath { mma, gemm, flash };
AttentionPath attention_path(const KernelScratch& k, int64_t T, int64_t NH, int64_t NKV, int64_t HS) {
  const int64_t heads = NKV == NH ? NH : NH / NKV;
  if (k.bf16_gemm && k.mma_attention && (HS == 32 || HS == 48 || HS == 64 || HS == 128)) return AttentionPath::mma;
  if (k.gemm_attention && 2 * heads * T * T * 4 <= (int64_t(1) << 31)) return AttentionPath::gemm;
  return AttentionPath::flash;
}

}  // namespace

int64_t KernelScratch::column_sums(int64_t N, int64_t C) const {
  if (!cuda || N <= 0 || C <= 0) return 0;
  // Partial sums over slabs of rows: enough slabs for ~1056 blocks of 32 columns, of 64 rows or more.
  const int64_t col_blocks = (C + 31) / 32;
  const int64_t slabs = std::max<int64_t>(1, std::min((1056 + col_blocks - 1) / col_blocks, (N + 63) / 64));
  return floats(slabs * C);
}

int64_t KernelScratch::linear_forward(int64_t N, int64_t C, int64_t OC, bool) const {
  if (!cuda || !bf16_gemm || !bf16_operands) return 0;
  return bf16s(N * C) + bf16s(C * OC);  // x and the weight, both operands of the one GEMM
}

int64_t KernelScratch::linear_backward(int64_t N, int64_t C, int64_t OC, bool bias) const {
  if (!cuda) return 0;
  if (!bf16_gemm || !bf16_operands) return bias ? column_sums(N, OC) : 0;
  // dout's copy (its pass also sums dbias through partial rows), then the weight's copy for dinp
  // and x's for dweight, one after the other.
  return bf16s(N * OC) + std::max({bias ? column_sums(N, OC) : 0, bf16s(C * OC), bf16s(N * C)});
}

int64_t KernelScratch::dense_forward(int64_t N, int64_t C, int64_t OC) const { return linear_forward(N, C, OC, false); }

int64_t KernelScratch::dense_backward(int64_t N, int64_t C, int64_t OC) const {
  return linear_backward(N, C, OC, false);
}

int64_t KernelScratch::attention_forward(int64_t B, int64_t T, int64_t NH, int64_t NKV, int64_t HS) const {
  if (!cuda || B * T <= 0) return 0;
  const int64_t W = (NH + 2 * NKV) * HS, heads = NKV == NH ? NH : NH / NKV;
  switch (attention_path(*this, T, NH, NKV, HS)) {
    case AttentionPath::mma: return bf16s(B * T * W);         // q|k|v in bf16
    case AttentionPath::gemm: return floats(heads * T * T);  // scores
    case AttentionPath::flash: return 0;
  }
  return 0;
}

int64_t KernelScratch::attention_backward(int64_t B, int64_t T, int64_t NH, int64_t NKV, int64_t HS) const {
  if (!cuda || B * T <= 0) return 0;
  const int64_t W = (NH + 2 * NKV) * HS, heads = NKV == NH ? NH : NH / NKV, rows = B * T * NH;
  switch (attention_path(*this, T, NH, NKV, HS)) {
    // dout . out per row, then dout and q|k|v in bf16, or the probabilities and their gradient.
    case AttentionPath::mma: return floats(rows) + bf16s(rows * HS) + bf16s(B * T * W);
    case AttentionPath::gemm: return floats(rows) + 2 * floats(heads * T * T);
    case AttentionPath::flash: return floats(rows);
  }
  return floats(rows);
}

int64_t KernelScratch::attention_chunked_backward(int64_t B, int64_t NH, int64_t rows) const {
  return cuda ? floats(std::max<int64_t>(1, B * NH * rows)) : 0;
}

int64_t KernelScratch::head(int64_t N, int64_t C, int64_t Vp, int64_t chunk, bool train, bool host_targets) const {
  if (!cuda || N <= 0) return 0;
  if (chunk <= 0 || chunk > N) chunk = N;
  int64_t bytes = 0;
  // Slabs of head_rows rows of logits (and their row losses in double) where the plan's are thinner.
  if (const int64_t big = std::min(N, head_rows); big > chunk) {
    bytes += floats(big * Vp + 2 * big);
    chunk = big;
  }
  if (host_targets) bytes += piece(4 * N);
  if (bf16_gemm && bf16_operands) {
    bytes += bf16s(Vp * C) + bf16s(N * C);  // the embedding matrix and x, rounded once for every slab
    if (train) bytes += bf16s(chunk * Vp);  // a slab's logits gradient
  }
  return bytes;
}

namespace detail {

void add_kernel_scratch(const ModelDesc& desc, const UnitDesc& unit, const Shape& s, UnitCosts& costs) {
  const KernelScratch& k = s.kernels;
  if (!k.cuda) return;
  const ModelConfig& c = desc.config;
  const int64_t BT = s.B * s.T, C = c.n_embd, NH = c.n_head, NKV = c.n_kv_head, HS = c.head_size();
  int64_t fwd = 0, bwd = 0;
  const auto forward = [&](int64_t bytes) { fwd = std::max(fwd, bytes); };
  const auto backward = [&](int64_t bytes) { bwd = std::max(bwd, bytes); };
  if (is_head(unit.kind)) {
    // Loss and logits (generation hands host targets); training's head runs in the backward's place.
    forward(k.head(BT, C, c.padded_vocab(), detail::head_chunk_rows(BT), false, true));
    backward(k.head(BT, C, c.padded_vocab(), detail::head_chunk_rows(BT), true, false));
    backward(k.column_sums(BT, C));  // the final norm's weight (and bias) gradient
  } else if (is_block(unit.kind)) {
    const bool bias = unit.kind == UnitKind::gpt2_block;  // GPT-2's Conv1D linears; LLaMA's dense ones have none
    for (const GemmShape& g : costs.gemms) {
      forward(bias ? k.linear_forward(g.M, g.K, g.N, true) : k.dense_forward(g.M, g.K, g.N));
      backward(bias ? k.linear_backward(g.M, g.K, g.N, true) : k.dense_backward(g.M, g.K, g.N));
    }
    // Under cp the attention runs over a rank's rows as chunks (ring) or over the whole sequence
    // for a share of the heads (all-to-all): the larger of the forms bounds either.
    forward(k.attention_forward(s.B, s.T, NH, NKV, HS));
    backward(k.attention_backward(s.B, s.T, NH, NKV, HS));
    if (s.cp > 1) {
      const int64_t nh = std::max<int64_t>(1, NH / s.cp), nkv = std::max<int64_t>(1, NKV / s.cp);
      forward(k.attention_forward(s.B, s.T * s.cp, nh, nkv, HS));
      backward(k.attention_backward(s.B, s.T * s.cp, nh, nkv, HS));
      backward(k.attention_chunked_backward(s.B, NH, s.T));
    }
    backward(k.column_sums(BT, C));  // the norms' weight gradients
  }
  costs.forward_kernel_scratch = fwd;
  // A block's backward may rerun forward kernels; the training head's task is its own.
  costs.backward_kernel_scratch = is_head(unit.kind) ? bwd : std::max(fwd, bwd);
}

}  // namespace detail
}  // namespace shardlm::model
