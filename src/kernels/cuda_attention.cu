// CUDA backend: causal grouped-query attention, flash style, in fp32. Keys and values stream
// through shared memory in tiles of 32 rows; each warp owns one query row (forward, dQ) or one
// key row (dK/dV), a lane owns one key (or query) of the tile for the scores and HS/32 head
// dimensions of the accumulators. Softmax is online in fp32; no (T, T) matrix is stored. The
// backward recomputes the probabilities from lse and splits into a dQ pass over keys and a dK/dV
// pass over queries, so nothing is added by atomics and the result does not depend on scheduling.
// Rows may be sequence chunks at any positions (context parallelism's ring steps and head-split
// form: kernels/cpu.h's attention_chunked_*); a whole packed sequence is one chunk at 0.
#include <climits>
#include <cmath>

#include "kernels/cuda_internal.cuh"

namespace shardlm::kernels::cuda {

namespace {

constexpr int kTile = 32;  // keys (queries) per shared-memory tile: one per lane
constexpr int kRows = 8;   // warps per block: query (key) rows per block
constexpr int kMaxChunks = 8;

__device__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// A side's rows (queries or keys) of one sequence: `count` chunks of `rows` consecutive positions,
// chunk c starting at position pos[c], stored one after another.
struct Chunks {
  int count, rows;
  int pos[kMaxChunks];
  __host__ __device__ int total() const { return count * rows; }
  __device__ int position(int r) const { return pos[r / rows] + r % rows; }
  // The smallest and the largest position among rows [r0, r1].
  __device__ int first_position(int r0, int r1) const {
    int p = INT_MAX;
    for (int c = r0 / rows; c <= r1 / rows; ++c) p = min(p, position(max(r0, c * rows)));
    return p;
  }
  __device__ int last_position(int r0, int r1) const {
    int p = INT_MIN;
    for (int c = r0 / rows; c <= r1 / rows; ++c) p = max(p, position(min(r1, c * rows + rows - 1)));
    return p;
  }
};

Chunks chunks_of(const SeqChunks& s) {
  if (s.count < 1 || s.count > kMaxChunks || s.rows < 1 || s.total() > INT_MAX)
    throw std::invalid_argument("attention: 1.." + std::to_string(kMaxChunks) + " chunks of at least one row");
  Chunks c{int(s.count), int(s.rows), {}};
  for (int i = 0; i < c.count; ++i) c.pos[i] = int(s.pos[i]);
  return c;
}

// A launch's shapes. Query row r of sequence b, head h starts at q + (b Tq + r) ldq + h HS; key
// row c of key/value head g at k + (b Tk + c) ldkv + g HS (v alike); out and dout rows are
// NH HS floats; lse and the backward's D are (B, NH, Tq). The backward's dq, dk, dv have pitches
// of their own.
struct Attn {
  int NH, NKV, HS;
  Chunks qc, kc;
  int64_t ldq, ldkv, lddq, lddkv;
  __host__ __device__ int group() const { return NH / NKV; }
  __host__ __device__ int64_t ldo() const { return int64_t(NH) * HS; }
  // Blocks of kRows rows of `rows` rows, for each of `heads` heads of each of B sequences.
  static dim3 grid(int rows, int heads, int64_t B) { return dim3((rows + kRows - 1) / kRows, heads, unsigned(B)); }
  // Shared memory of a block: two tiles of kTile rows (pitch HS + 1), `row_buffers` buffers of
  // the block's kRows rows, and `extra` floats.
  size_t smem(int row_buffers, int extra = 0) const {
    return sizeof(float) * (2 * kTile * (HS + 1) + row_buffers * kRows * HS + extra);
  }
  float scale() const { return 1.0f / std::sqrt(float(HS)); }  // of the scores q.k
};

// Copies rows r0.. r0+31 (zeros past `rows`) of HS columns of src (row pitch src_stride) into
// dst (pitch HS+1).
__device__ void load_tile(float* dst, const float* src, int64_t src_stride, int r0, int rows, int HS) {
  const int P = HS + 1, tid = threadIdx.y * 32 + threadIdx.x;
  for (int idx = tid; idx < kTile * HS; idx += kRows * 32) {
    const int r = idx / HS, d = idx % HS;
    dst[r * P + d] = r0 + r < rows ? src[int64_t(r0 + r) * src_stride + d] : 0.0f;
  }
}

__device__ float dot_row(const float* a, const float* b, int HS) {
  float s = 0;
  for (int d = 0; d < HS; ++d) s += a[d] * b[d];
  return s;
}

// With `accumulate`, out and lse already hold the result over earlier keys and this launch's keys
// merge into it (an empty row has lse -inf).
template <int DPL>
__global__ void attn_fwd_kernel(float* out, float* lse, const float* q, const float* k, const float* v, Attn A,
                                float scale, bool accumulate) {
  extern __shared__ float sm[];
  const int HS = A.HS, P = HS + 1, Tq = A.qc.total(), Tk = A.kc.total();
  float *sK = sm, *sV = sK + kTile * P, *sQ = sV + kTile * P;
  const int b = blockIdx.z, h = blockIdx.y, lane = threadIdx.x, i0 = blockIdx.x * kRows;
  const int i = i0 + threadIdx.y, g = h / A.group();
  const bool valid = i < Tq;
  const int qp = valid ? A.qc.position(i) : INT_MIN, q_last = A.qc.last_position(i0, min(Tq, i0 + kRows) - 1);
  float* sq = sQ + threadIdx.y * HS;
  float* o = out + (int64_t(b) * Tq + i) * A.ldo() + h * HS;
  float* ls = lse + (int64_t(b) * A.NH + h) * Tq + i;
  float m = -INFINITY, l = 0, acc[DPL] = {};
  if (valid) {
    for (int d = lane; d < HS; d += 32) sq[d] = q[(int64_t(b) * Tq + i) * A.ldq + h * HS + d];
    if (accumulate && *ls != -INFINITY) {
      m = *ls, l = 1;
#pragma unroll
      for (int c = 0; c < DPL; ++c)
        if (lane + 32 * c < HS) acc[c] = o[lane + 32 * c];
    }
  }
  const float *kb = k + int64_t(b) * Tk * A.ldkv + g * HS, *vb = v + int64_t(b) * Tk * A.ldkv + g * HS;
  for (int j0 = 0; j0 < Tk; j0 += kTile) {
    if (A.kc.first_position(j0, min(Tk, j0 + kTile) - 1) > q_last) continue;  // masked for the whole block
    __syncthreads();
    load_tile(sK, kb, A.ldkv, j0, Tk, HS);
    load_tile(sV, vb, A.ldkv, j0, Tk, HS);
    __syncthreads();
    if (!valid) continue;
    const int j = j0 + lane;
    const bool seen = j < Tk && A.kc.position(j) <= qp;
    const float s = seen ? dot_row(sq, sK + lane * P, HS) * scale : -INFINITY;
    const float mn = fmaxf(m, warp_max(s));
    if (mn == -INFINITY) continue;  // no key of this row seen yet
    const float p = seen ? expf(s - mn) : 0.0f, corr = expf(m - mn);
    l = l * corr + warp_sum(p);
#pragma unroll
    for (int c = 0; c < DPL; ++c) acc[c] *= corr;
    const int n = min(kTile, Tk - j0);
    for (int jj = 0; jj < n; ++jj) {
      const float pj = __shfl_sync(0xffffffffu, p, jj);
#pragma unroll
      for (int c = 0; c < DPL; ++c)
        if (lane + 32 * c < HS) acc[c] += pj * sV[jj * P + lane + 32 * c];
    }
    m = mn;
  }
  if (!valid) return;
  const bool empty = !(l > 0.0f);
#pragma unroll
  for (int c = 0; c < DPL; ++c)
    if (lane + 32 * c < HS) o[lane + 32 * c] = empty ? 0.0f : acc[c] / l;
  if (lane == 0) *ls = empty ? -INFINITY : m + logf(l);
}

// D[b,h,i] = dout_i . out_i (one warp per row).
__global__ void attn_rowdot_kernel(float* D, const float* dout, const float* out, int64_t rows, int T, int NH,
                                   int HS) {
  const int64_t r = blockIdx.x * int64_t(blockDim.y) + threadIdx.y;  // r = (b, i, h) in out's order
  if (r >= rows) return;
  float s = 0;
  for (int d = threadIdx.x; d < HS; d += 32) s += dout[r * HS + d] * out[r * HS + d];
  s = warp_sum(s);
  const int64_t h = r % NH, bi = r / NH, b = bi / T, i = bi % T;
  if (threadIdx.x == 0) D[(b * NH + h) * T + i] = s;
}

// dQ_i += scale sum_j P_ij (dP_ij - D_i) k_j, P_ij = exp(scale q_i.k_j - lse_i), dP_ij = dout_i.v_j,
// over the keys j this launch holds that query i sees.
template <int DPL>
__global__ void attn_dq_kernel(float* dq, const float* dout, const float* q, const float* k, const float* v,
                               const float* lse, const float* D, Attn A, float scale) {
  extern __shared__ float sm[];
  const int HS = A.HS, P = HS + 1, Tq = A.qc.total(), Tk = A.kc.total();
  float *sK = sm, *sV = sK + kTile * P, *sQ = sV + kTile * P, *sO = sQ + kRows * HS;
  const int b = blockIdx.z, h = blockIdx.y, lane = threadIdx.x, i0 = blockIdx.x * kRows;
  const int i = i0 + threadIdx.y, g = h / A.group();
  const bool valid = i < Tq;
  const int qp = valid ? A.qc.position(i) : INT_MIN, q_last = A.qc.last_position(i0, min(Tq, i0 + kRows) - 1);
  float *sq = sQ + threadIdx.y * HS, *dO = sO + threadIdx.y * HS;
  if (valid)
    for (int d = lane; d < HS; d += 32) {
      sq[d] = q[(int64_t(b) * Tq + i) * A.ldq + h * HS + d];
      dO[d] = dout[(int64_t(b) * Tq + i) * A.ldo() + h * HS + d];
    }
  const float li = valid ? lse[(int64_t(b) * A.NH + h) * Tq + i] : 0.0f;
  const float Di = valid ? D[(int64_t(b) * A.NH + h) * Tq + i] : 0.0f;
  float acc[DPL] = {};
  const float *kb = k + int64_t(b) * Tk * A.ldkv + g * HS, *vb = v + int64_t(b) * Tk * A.ldkv + g * HS;
  for (int j0 = 0; j0 < Tk; j0 += kTile) {
    if (A.kc.first_position(j0, min(Tk, j0 + kTile) - 1) > q_last) continue;
    __syncthreads();
    load_tile(sK, kb, A.ldkv, j0, Tk, HS);
    load_tile(sV, vb, A.ldkv, j0, Tk, HS);
    __syncthreads();
    if (!valid) continue;
    const int j = j0 + lane;
    float ds = 0;
    if (j < Tk && A.kc.position(j) <= qp) {  // seen: lse is finite
      const float p = expf(dot_row(sq, sK + lane * P, HS) * scale - li);
      ds = p * (dot_row(dO, sV + lane * P, HS) - Di);
    }
    const int n = min(kTile, Tk - j0);
    for (int jj = 0; jj < n; ++jj) {
      const float dj = __shfl_sync(0xffffffffu, ds, jj);
#pragma unroll
      for (int c = 0; c < DPL; ++c)
        if (lane + 32 * c < HS) acc[c] += dj * sK[jj * P + lane + 32 * c];
    }
  }
  if (!valid) return;
  float* dqi = dq + (int64_t(b) * Tq + i) * A.lddq + h * HS;
#pragma unroll
  for (int c = 0; c < DPL; ++c)
    if (lane + 32 * c < HS) dqi[lane + 32 * c] += scale * acc[c];
}

// dV_j += sum_i P_ij dout_i ; dK_j += scale sum_i dS_ij q_i, over the queries i this launch holds
// that see key j, of every query head of key/value head g.
template <int DPL>
__global__ void attn_dkv_kernel(float* dk, float* dv, const float* dout, const float* q, const float* k,
                                const float* v, const float* lse, const float* D, Attn A, float scale) {
  extern __shared__ float sm[];
  const int HS = A.HS, P = HS + 1, Tq = A.qc.total(), Tk = A.kc.total();
  float *sQ = sm, *sO = sQ + kTile * P, *sKr = sO + kTile * P, *sVr = sKr + kRows * HS;
  float *sL = sVr + kRows * HS, *sD = sL + kTile;
  const int b = blockIdx.z, g = blockIdx.y, lane = threadIdx.x, j0b = blockIdx.x * kRows;
  const int j = j0b + threadIdx.y;
  const bool valid = j < Tk;
  const int kp = valid ? A.kc.position(j) : INT_MAX, k_first = A.kc.first_position(j0b, min(Tk, j0b + kRows) - 1);
  float *kj = sKr + threadIdx.y * HS, *vj = sVr + threadIdx.y * HS;
  if (valid)
    for (int d = lane; d < HS; d += 32) {
      kj[d] = k[(int64_t(b) * Tk + j) * A.ldkv + g * HS + d];
      vj[d] = v[(int64_t(b) * Tk + j) * A.ldkv + g * HS + d];
    }
  float dK[DPL] = {}, dV[DPL] = {};
  for (int h = g * A.group(); h < (g + 1) * A.group(); ++h) {
    const float* lse_h = lse + (int64_t(b) * A.NH + h) * Tq;
    const float* D_h = D + (int64_t(b) * A.NH + h) * Tq;
    for (int i0 = 0; i0 < Tq; i0 += kTile) {
      if (A.qc.last_position(i0, min(Tq, i0 + kTile) - 1) < k_first) continue;  // no query sees the block
      __syncthreads();
      load_tile(sQ, q + int64_t(b) * Tq * A.ldq + h * HS, A.ldq, i0, Tq, HS);
      load_tile(sO, dout + int64_t(b) * Tq * A.ldo() + h * HS, A.ldo(), i0, Tq, HS);
      const int tid = threadIdx.y * 32 + lane;
      if (tid < kTile) {
        sL[tid] = i0 + tid < Tq ? lse_h[i0 + tid] : 0.0f;
        sD[tid] = i0 + tid < Tq ? D_h[i0 + tid] : 0.0f;
      }
      __syncthreads();
      if (!valid) continue;
      const int i = i0 + lane;
      float p = 0, ds = 0;
      if (i < Tq && A.qc.position(i) >= kp) {
        p = expf(dot_row(sQ + lane * P, kj, HS) * scale - sL[lane]);
        ds = p * (dot_row(sO + lane * P, vj, HS) - sD[lane]);
      }
      const int n = min(kTile, Tq - i0);
      for (int ii = 0; ii < n; ++ii) {
        const float pi = __shfl_sync(0xffffffffu, p, ii), di = __shfl_sync(0xffffffffu, ds, ii);
#pragma unroll
        for (int c = 0; c < DPL; ++c)
          if (lane + 32 * c < HS) {
            dV[c] += pi * sO[ii * P + lane + 32 * c];
            dK[c] += di * sQ[ii * P + lane + 32 * c];
          }
      }
    }
  }
  if (!valid) return;
  float *dKj = dk + (int64_t(b) * Tk + j) * A.lddkv + g * HS, *dVj = dv + (int64_t(b) * Tk + j) * A.lddkv + g * HS;
#pragma unroll
  for (int c = 0; c < DPL; ++c)
    if (lane + 32 * c < HS) {
      dKj[lane + 32 * c] += scale * dK[c];
      dVj[lane + 32 * c] += dV[c];
    }
}

// kernel<<<grid, (32, kRows), smem>>>(args...) on the stream, above the default 48 KiB of
// dynamic shared memory where `smem` needs it.
template <class K, class... Args>
void launch(K kernel, dim3 grid, size_t smem, Args... args) {
  if (smem > 48 * 1024)
    SHARDLM_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  kernel<<<grid, dim3(32, kRows), smem, stream()>>>(args...);
  SHARDLM_CUDA_LAUNCHED();
}

Attn attn(int64_t NH, int64_t NKV, int64_t HS, Chunks qc, Chunks kc, int64_t ldq, int64_t ldkv) {
  if (NH <= 0 || NKV <= 0 || NH % NKV != 0) throw std::invalid_argument("attention: NKV must be positive and divide NH");
  if (HS <= 0 || HS > 256) throw std::invalid_argument("attention: head size must be in 1..256");
  return Attn{int(NH), int(NKV), int(HS), qc, kc, ldq, ldkv, ldq, ldkv};
}
// A packed sequence of T rows of q|k|v: one chunk at 0 on both sides.
Attn packed(int64_t T, int64_t NH, int64_t NKV, int64_t HS) {
  const Chunks whole{1, int(T), {0}};
  return attn(NH, NKV, HS, whole, whole, (NH + 2 * NKV) * HS, (NH + 2 * NKV) * HS);
}

// Picks the instantiation whose accumulators hold HS (HS/32 dims per lane, rounded up).
#define SHARDLM_BY_DPL(HS, KERNEL, ...)                    \
  do {                                                      \
    const int dpl_ = int((HS + 31) / 32);                   \
    if (dpl_ <= 1) KERNEL<1>(__VA_ARGS__);                  \
    else if (dpl_ <= 2) KERNEL<2>(__VA_ARGS__);             \
    else if (dpl_ <= 4) KERNEL<4>(__VA_ARGS__);             \
    else KERNEL<8>(__VA_ARGS__);                            \
  } while (0)

template <int DPL>
void fwd(float* out, float* lse, const float* q, const float* k, const float* v, int64_t B, Attn A, bool accumulate) {
  launch(attn_fwd_kernel<DPL>, Attn::grid(A.qc.total(), A.NH, B), A.smem(1), out, lse, q, k, v, A, A.scale(),
         accumulate);
}

template <int DPL>
void bwd(float* dq, float* dk, float* dv, const float* dout, const float* q, const float* k, const float* v,
         const float* lse, const float* D, int64_t B, Attn A) {
  launch(attn_dq_kernel<DPL>, Attn::grid(A.qc.total(), A.NH, B), A.smem(2), dq, dout, q, k, v, lse, D, A, A.scale());
  launch(attn_dkv_kernel<DPL>, Attn::grid(A.kc.total(), A.NKV, B), A.smem(2, 2 * kTile), dk, dv, dout, q, k, v, lse,
         D, A, A.scale());
}

// D = rowsum(dout * out) over (B, Tq, NH) rows of HS, into `D` (B, NH, Tq).
void rowdot(float* D, const float* dout, const float* out, int64_t B, int64_t Tq, int64_t NH, int64_t HS) {
  const int64_t rows = B * Tq * NH;
  attn_rowdot_kernel<<<unsigned((rows + kRows - 1) / kRows), dim3(32, kRows), 0, stream()>>>(D, dout, out, rows,
                                                                                           int(Tq), int(NH), int(HS));
  SHARDLM_CUDA_LAUNCHED();
}

}  // namespace

void attention_forward(float* out, float* lse, const float* qkv, int64_t B, int64_t T, int64_t NH, int64_t NKV,
                       int64_t HS) {
  if (B * T == 0) return;
  const Attn A = packed(T, NH, NKV, HS);
  SHARDLM_BY_DPL(HS, fwd, out, lse, qkv, qkv + NH * HS, qkv + (NH + NKV) * HS, B, A, false);
}

void attention_backward(float* dqkv, const float* dout, const float* qkv, const float* out, const float* lse,
                        int64_t B, int64_t T, int64_t NH, int64_t NKV, int64_t HS, float* scratch) {
  if (B * T == 0) return;
  const Attn A = packed(T, NH, NKV, HS);
  rowdot(scratch, dout, out, B, T, NH, HS);
  SHARDLM_BY_DPL(HS, bwd, dqkv, dqkv + NH * HS, dqkv + (NH + NKV) * HS, dout, qkv, qkv + NH * HS,
                 qkv + (NH + NKV) * HS, lse, scratch, B, A);
}

void attention_chunked_forward(float* out, float* lse, const float* q, int64_t ldq, SeqChunks qc, const float* k,
                               const float* v, int64_t ldkv, SeqChunks kc, int64_t B, int64_t NH, int64_t NKV,
                               int64_t HS, bool accumulate) {
  const Attn A = attn(NH, NKV, HS, chunks_of(qc), chunks_of(kc), ldq, ldkv);
  if (B == 0) return;
  SHARDLM_BY_DPL(HS, fwd, out, lse, q, k, v, B, A, accumulate);
}

void attention_chunked_backward(float* dq, int64_t lddq, float* dk, float* dv, int64_t lddkv, const float* dout,
                                const float* q, int64_t ldq, const float* out, const float* lse, SeqChunks qc,
                                const float* k, const float* v, int64_t ldkv, SeqChunks kc, int64_t B, int64_t NH,
                                int64_t NKV, int64_t HS, float* scratch) {
  Attn A = attn(NH, NKV, HS, chunks_of(qc), chunks_of(kc), ldq, ldkv);
  A.lddq = lddq, A.lddkv = lddkv;
  if (B == 0) return;
  rowdot(scratch, dout, out, B, A.qc.total(), NH, HS);
  SHARDLM_BY_DPL(HS, bwd, dq, dk, dv, dout, q, k, v, lse, scratch, B, A);
}

}  // namespace shardlm::kernels::cuda
