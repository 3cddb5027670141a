// Internal helpers of the CPU kernels: a branch-free vectorisable exp and a small register-
// blocked GEMM on GCC vector extensions (portable: GCC splits 64-byte vectors on targets
// without AVX-512). Not part of the public API.
#pragma once

#include <cstdint>
#include <cstring>

namespace shardlm::kernels::detail {

inline float bits_to_float(int32_t i) {
  float f;
  std::memcpy(&f, &i, sizeof f);
  return f;
}
inline int32_t float_to_bits(float f) {
  int32_t i;
  std::memcpy(&i, &f, sizeof i);
  return i;
}

// e^x with ~1 ulp error on [-87.3, 88.3]; returns exactly 0 for x < -87.3 (and for -inf),
// saturates at e^88.3 above. Written without branches so that loops calling it vectorise.
// Range reduction: x = n ln2 + r, |r| <= ln2/2 (n rounded with the 1.5*2^23 trick, valid in
// the default round-to-nearest mode); e^r by a degree-7 polynomial (the Cephes expf
// minimax coefficients); 2^n built from the exponent bits.
inline float exp_fast(float x) {
  const bool under = x < -87.3f;
  x = x > 88.3f ? 88.3f : x;
  x = x < -87.3f ? -87.3f : x;
  const float magic = 12582912.0f;  // 1.5 * 2^23
  const float t = x * 1.44269504088896341f + magic;
  const float n = t - magic;
  const int32_t ni = float_to_bits(t) - float_to_bits(magic);
  float r = x - n * 0.693359375f;      // ln2 high part (exact in few bits)
  r = r - n * -2.12194440e-4f;         // ln2 low part
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float y = p * (r * r) + r + 1.0f;
  const float s = bits_to_float((ni + 127) << 23);
  return under ? 0.0f : y * s;
}

// ---------------------------------------------------------------------------------------------
// Small GEMM for attention tiles: C (M,N) (+)= A (M,K) * B (K,N).
// A's element (i,k) is A[i*rsa + k*csa] (any layout: it is only ever broadcast), B and C are
// row-major with leading dimensions ldb, ldc. Vectorised over N, register block 4 x 64.
// ---------------------------------------------------------------------------------------------

typedef float v16 __attribute__((vector_size(64)));
typedef float v16u __attribute__((vector_size(64), aligned(4), may_alias));

inline v16 vload(const float* p) { return *reinterpret_cast<const v16u*>(p); }
inline void vstore(float* p, v16 x) { *reinterpret_cast<v16u*>(p) = x; }

template <int R, int NV, bool ACC>
inline void gemm_micro(int64_t K, const float* A, int64_t rsa, int64_t csa, const float* B,
                       int64_t ldb, float* C, int64_t ldc) {
  v16 c[R][NV];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) c[r][v] = ACC ? vload(C + r * ldc + 16 * v) : v16{};
  for (int64_t k = 0; k < K; ++k) {
    const float* b = B + k * ldb;
    v16 bv[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) {
      bv[v] = vload(b + 16 * v);
#if defined(__GNUC__) && defined(__AVX512F__)
      // Keep the B row in registers: otherwise GCC folds the load into every FMA, R times
      // as many loads, and the loop becomes load-port bound.
      asm("" : "+v"(bv[v]));
#endif
    }
    const float* a = A + k * csa;
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const float av = a[r * rsa];  // vector * scalar: a plain broadcast
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) c[r][v] += bv[v] * av;
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) vstore(C + r * ldc + 16 * v, c[r][v]);
}

template <int NV, bool ACC>
inline void gemm_rows(int64_t M, int64_t K, const float* A, int64_t rsa, int64_t csa,
                      const float* B, int64_t ldb, float* C, int64_t ldc) {
  int64_t i = 0;
  for (; i + 4 <= M; i += 4) gemm_micro<4, NV, ACC>(K, A + i * rsa, rsa, csa, B, ldb, C + i * ldc, ldc);
  switch (M - i) {
    case 3: gemm_micro<3, NV, ACC>(K, A + i * rsa, rsa, csa, B, ldb, C + i * ldc, ldc); break;
    case 2: gemm_micro<2, NV, ACC>(K, A + i * rsa, rsa, csa, B, ldb, C + i * ldc, ldc); break;
    case 1: gemm_micro<1, NV, ACC>(K, A + i * rsa, rsa, csa, B, ldb, C + i * ldc, ldc); break;
    default: break;
  }
}

// ACC = true: C += A B; ACC = false: C = A B.
template <bool ACC>
inline void small_gemm(int64_t M, int64_t N, int64_t K, const float* A, int64_t rsa,
                       int64_t csa, const float* B, int64_t ldb, float* C, int64_t ldc) {
  int64_t n0 = 0;
  for (; n0 + 64 <= N; n0 += 64) gemm_rows<4, ACC>(M, K, A, rsa, csa, B + n0, ldb, C + n0, ldc);
  switch ((N - n0) / 16) {
    case 3: gemm_rows<3, ACC>(M, K, A, rsa, csa, B + n0, ldb, C + n0, ldc); n0 += 48; break;
    case 2: gemm_rows<2, ACC>(M, K, A, rsa, csa, B + n0, ldb, C + n0, ldc); n0 += 32; break;
    case 1: gemm_rows<1, ACC>(M, K, A, rsa, csa, B + n0, ldb, C + n0, ldc); n0 += 16; break;
    default: break;
  }
  if (n0 < N) {  // fewer than 16 columns left (odd head sizes only)
    for (int64_t i = 0; i < M; ++i)
      for (int64_t n = n0; n < N; ++n) {
        float s = ACC ? C[i * ldc + n] : 0.0f;
        for (int64_t k = 0; k < K; ++k) s += A[i * rsa + k * csa] * B[k * ldb + n];
        C[i * ldc + n] = s;
      }
  }
}

}  // namespace shardlm::kernels::detail
