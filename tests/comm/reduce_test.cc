// bf16 conversions and the element-wise sums the reductions use.
#include "comm/reduce.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

namespace shardlm::comm {
namespace {

float from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

TEST(Bf16, RoundsToNearestEven) {
  EXPECT_EQ(float_to_bf16(1.0f), 0x3f80);
  // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties to the even (1.0).
  EXPECT_EQ(float_to_bf16(from_bits(0x3f808000)), 0x3f80);
  // 1 + 3·2^-8 is halfway between 1 + 2^-7 (odd) and 1 + 2^-6: rounds up to even.
  EXPECT_EQ(float_to_bf16(from_bits(0x3f818000)), 0x3f82);
  // Just above halfway rounds up, just below rounds down.
  EXPECT_EQ(float_to_bf16(from_bits(0x3f808001)), 0x3f81);
  EXPECT_EQ(float_to_bf16(from_bits(0x3f807fff)), 0x3f80);
  EXPECT_EQ(float_to_bf16(-2.5f), 0xc020);
}

TEST(Bf16, SpecialValues) {
  const float inf = std::numeric_limits<float>::infinity();
  EXPECT_EQ(float_to_bf16(inf), 0x7f80);
  EXPECT_EQ(float_to_bf16(-inf), 0xff80);
  EXPECT_EQ(float_to_bf16(0.0f), 0x0000);
  EXPECT_EQ(float_to_bf16(-0.0f), 0x8000);
  // Above the largest bf16 (0x7f7f) by more than half an ulp: +inf.
  EXPECT_EQ(float_to_bf16(from_bits(0x7f7fffff)), 0x7f80);
  const uint16_t nan = float_to_bf16(std::numeric_limits<float>::quiet_NaN());
  EXPECT_TRUE(std::isnan(bf16_to_float(nan)));
  // A signalling NaN whose payload sits in the low bits stays a NaN (rounding must not carry it
  // into inf).
  EXPECT_TRUE(std::isnan(bf16_to_float(float_to_bf16(from_bits(0x7f800001)))));
  EXPECT_TRUE(std::isnan(bf16_to_float(float_to_bf16(from_bits(0xff800001)))));
  // Subnormals round like everything else.
  EXPECT_EQ(float_to_bf16(from_bits(0x00008000)), 0x0000);
  EXPECT_EQ(float_to_bf16(from_bits(0x00018000)), 0x0002);
}

TEST(Bf16, WideningIsExact) {
  for (uint32_t h = 0; h < 0x10000; h += 7) {
    const float f = bf16_to_float(static_cast<uint16_t>(h));
    if (std::isnan(f)) continue;
    EXPECT_EQ(float_to_bf16(f), h);
  }
}

TEST(SumN, Fp32LeftToRightAnyAliasing) {
  const int64_t n = 3000;  // spans blocks of the implementation
  std::vector<float> a(n), b(n), c(n);
  for (int64_t i = 0; i < n; ++i) {
    a[i] = 1e8f;
    b[i] = 1.0f;
    c[i] = -1e8f + static_cast<float>(i);
  }
  std::vector<float> out(n);
  const void* ins[3] = {a.data(), b.data(), c.data()};
  sum_n(DType::fp32, out.data(), ins, 3, n);
  for (int64_t i = 0; i < n; ++i) ASSERT_EQ(out[i], (a[i] + b[i]) + c[i]);
  // Output aliasing the last input gives the same.
  std::vector<float> c2 = c;
  const void* ins2[3] = {a.data(), b.data(), c2.data()};
  sum_n(DType::fp32, c2.data(), ins2, 3, n);
  EXPECT_EQ(c2, out);
}

TEST(SumN, Bf16AccumulatesInFp32AndRoundsOnce) {
  // 256 + 1 + 1: rounding after each addition gives 256 (256 + 1 ties to even 256 twice);
  // one rounding of the fp32 sum 258 gives 258.
  const int64_t n = 5;
  std::vector<uint16_t> a(n, float_to_bf16(256.0f)), b(n, float_to_bf16(1.0f)), c(n, float_to_bf16(1.0f));
  std::vector<uint16_t> out(n);
  const void* ins[3] = {a.data(), b.data(), c.data()};
  sum_n(DType::bf16, out.data(), ins, 3, n);
  for (auto v : out) EXPECT_EQ(bf16_to_float(v), 258.0f);
  // Two at a time (what the ring and the MPI_Op do) rounds each step.
  std::vector<uint16_t> acc = a;
  sum_into(DType::bf16, acc.data(), b.data(), n);
  sum_into(DType::bf16, acc.data(), c.data(), n);
  for (auto v : acc) EXPECT_EQ(bf16_to_float(v), 256.0f);
}

TEST(SumN, RejectsOtherDtypes) {
  int8_t x[4] = {};
  const void* ins[1] = {x};
  EXPECT_THROW(sum_n(DType::int8, x, ins, 1, 4), std::invalid_argument);
}

}  // namespace
}  // namespace shardlm::comm
