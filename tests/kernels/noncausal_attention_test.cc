// The attention kernels' bidirectional mode (causal = false, a diffusion transformer's) against
// PyTorch (tests/reference/attention_reference.py: softmax attention in float64 by autograd):
// the whole-sequence kernels on packed q|k|v, and the chunked kernels as context parallelism runs
// them (a rank's load-balanced query chunks over two key/value blocks, merged by log-sum-exp).
#include <gtest/gtest.h>
#include <omp.h>
#include <sys/wait.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "kernels/cpu.h"
#include "kernels/kernel_test_util.h"

namespace k = shardlm::kernels;
namespace fs = std::filesystem;
using namespace kernel_test;

namespace {

std::string python() {
  if (const char* p = std::getenv("SHARDLM_PYTHON")) return p;
  return "/usr/bin/python3";
}
std::string reference_script() {
  const char* s = std::getenv("SHARDLM_SOURCE_DIR");
  const fs::path src = s ? fs::path(s) : fs::path(__FILE__).parent_path().parent_path().parent_path();
  return (src / "tests" / "reference" / "attention_reference.py").string();
}

void write_f32(const fs::path& p, const fvec& v) {
  std::ofstream f(p, std::ios::binary);
  f.write(reinterpret_cast<const char*>(v.data()), static_cast<std::streamsize>(v.size() * sizeof(float)));
}
fvec read_f32(const fs::path& p, size_t n) {
  fvec v(n);
  std::ifstream f(p, std::ios::binary);
  f.read(reinterpret_cast<char*>(v.data()), static_cast<std::streamsize>(n * sizeof(float)));
  EXPECT_EQ(static_cast<size_t>(f.gcount()), n * sizeof(float)) << p;
  return v;
}

// Columns [at, at + w) of rows (n, ld) as (n, w).
fvec columns(const fvec& rows, int64_t n, int64_t ld, int64_t at, int64_t w) {
  fvec out(n * w);
  for (int64_t r = 0; r < n; ++r)
    for (int64_t c = 0; c < w; ++c) out[r * w + c] = rows[r * ld + at + c];
  return out;
}
fvec concat(const fvec& a, const fvec& b) {
  fvec out(a);
  out.insert(out.end(), b.begin(), b.end());
  return out;
}

struct Torch {
  fvec out, lse, dq, dk, dv;
};
// q, dout (B, TQ, NH, HS); k, v (B, TK, NKV, HS).
Torch torch_attention(const fvec& q, const fvec& kk, const fvec& v, const fvec& dout, int64_t B, int64_t TQ,
                      int64_t TK, int64_t NH, int64_t NKV, int64_t HS) {
  std::string tmpl = (fs::temp_directory_path() / "shardlm_attn_XXXXXX").string();
  EXPECT_NE(mkdtemp(tmpl.data()), nullptr);
  const fs::path dir = tmpl;
  write_f32(dir / "q.f32", q);
  write_f32(dir / "k.f32", kk);
  write_f32(dir / "v.f32", v);
  write_f32(dir / "dout.f32", dout);
  const std::string cmd = python() + " " + reference_script() + " " + dir.string() + " " + std::to_string(B) + " " +
                          std::to_string(TQ) + " " + std::to_string(TK) + " " + std::to_string(NH) + " " +
                          std::to_string(NKV) + " " + std::to_string(HS) + " 2>&1";
  const int st = std::system(cmd.c_str());
  EXPECT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 0) << cmd;
  Torch t{read_f32(dir / "out.f32", q.size()), read_f32(dir / "lse.f32", B * NH * TQ),
          read_f32(dir / "dq.f32", q.size()), read_f32(dir / "dk.f32", kk.size()), read_f32(dir / "dv.f32", v.size())};
  fs::remove_all(dir);
  return t;
}

struct Shape {
  int64_t B, T, NH, NKV, HS;
};

TEST(NonCausalAttention, WholeSequenceMatchesTorch) {
  // Several query tiles (so keys after a tile's queries count), grouped and plain heads.
  const Shape shapes[] = {{2, 70, 4, 2, 16}, {1, 130, 2, 2, 64}, {1, 9, 3, 1, 24}};
  for (const Shape& s : shapes) {
    SCOPED_TRACE(::testing::Message() << "B=" << s.B << " T=" << s.T << " NH=" << s.NH << " NKV=" << s.NKV
                                      << " HS=" << s.HS);
    const int64_t C = s.NH * s.HS, CK = s.NKV * s.HS, W = C + 2 * CK, BT = s.B * s.T;
    const fvec qkv = randv(BT * W, 90 + s.T, -2.0f, 2.0f), dout = randv(BT * C, 91 + s.T);
    fvec out(BT * C), lse(s.B * s.NH * s.T), dqkv(qkv.size(), kFill);
    k::attention_forward(out.data(), lse.data(), qkv.data(), s.B, s.T, s.NH, s.NKV, s.HS, false);
    fvec scratch = nan_scratch(k::attention_backward_scratch(s.B, s.T, s.NH, s.NKV, s.HS, omp_get_max_threads()));
    k::attention_backward(dqkv.data(), dout.data(), qkv.data(), out.data(), lse.data(), s.B, s.T, s.NH, s.NKV, s.HS,
                          scratch.data(), false);
    const Torch t = torch_attention(columns(qkv, BT, W, 0, C), columns(qkv, BT, W, C, CK),
                                    columns(qkv, BT, W, C + CK, CK), dout, s.B, s.T, s.T, s.NH, s.NKV, s.HS);
    expect_close(out, t.out, 1e-5, 1e-6, "out");
    expect_close(lse, t.lse, 1e-5, 1e-6, "lse");
    const dvec d = minus_fill(dqkv);
    const fvec df(d.begin(), d.end());
    expect_close(columns(df, BT, W, 0, C), t.dq, 1e-4, 1e-6, "dq");
    expect_close(columns(df, BT, W, C, CK), t.dk, 1e-4, 1e-6, "dk");
    expect_close(columns(df, BT, W, C + CK, CK), t.dv, 1e-4, 1e-6, "dv");
  }
}

TEST(NonCausalAttention, ChunkedBlocksMatchTorch) {
  // One cp rank's queries (the load-balanced chunks 1 and 6 of 8 chunks of 40 positions) over two
  // key/value blocks, one of them wholly after the queries' first chunk (causal attention would
  // mask most of it): forward merged by log-sum-exp, backward summed over the blocks.
  const int64_t B = 2, NH = 4, NKV = 2, HS = 32, rows = 40, C = NH * HS, CK = NKV * HS;
  const std::vector<int64_t> qpos = {40, 240}, k0pos = {0, 280}, k1pos = {120, 160};
  const k::SeqChunks qc{2, rows, qpos.data()}, kc0{2, rows, k0pos.data()}, kc1{2, rows, k1pos.data()};
  const int64_t TQ = qc.total(), TK = kc0.total();
  const fvec q = randv(B * TQ * C, 95, -2.0f, 2.0f), dout = randv(B * TQ * C, 96);
  const fvec k0 = randv(B * TK * CK, 97, -2.0f, 2.0f), v0 = randv(B * TK * CK, 98);
  const fvec k1 = randv(B * TK * CK, 99, -2.0f, 2.0f), v1 = randv(B * TK * CK, 100);
  fvec out(q.size()), lse(B * NH * TQ);
  k::attention_chunked_forward(out.data(), lse.data(), q.data(), C, qc, k0.data(), v0.data(), CK, kc0, B, NH, NKV, HS,
                               false, false);
  k::attention_chunked_forward(out.data(), lse.data(), q.data(), C, qc, k1.data(), v1.data(), CK, kc1, B, NH, NKV, HS,
                               true, false);
  fvec dq(q.size(), 0.0f), dk0(k0.size(), 0.0f), dv0(v0.size(), 0.0f), dk1(k1.size(), 0.0f), dv1(v1.size(), 0.0f);
  fvec scratch = nan_scratch(k::attention_chunked_backward_scratch(HS, omp_get_max_threads()));
  k::attention_chunked_backward(dq.data(), C, dk0.data(), dv0.data(), CK, dout.data(), q.data(), C, out.data(),
                                lse.data(), qc, k0.data(), v0.data(), CK, kc0, B, NH, NKV, HS, scratch.data(), false);
  k::attention_chunked_backward(dq.data(), C, dk1.data(), dv1.data(), CK, dout.data(), q.data(), C, out.data(),
                                lse.data(), qc, k1.data(), v1.data(), CK, kc1, B, NH, NKV, HS, scratch.data(), false);

  // The reference sees each sequence's keys as block 0's rows then block 1's.
  auto per_sequence = [&](const fvec& a, const fvec& b) {
    fvec all;
    for (int64_t s = 0; s < B; ++s) {
      all.insert(all.end(), a.begin() + s * TK * CK, a.begin() + (s + 1) * TK * CK);
      all.insert(all.end(), b.begin() + s * TK * CK, b.begin() + (s + 1) * TK * CK);
    }
    return all;
  };
  const Torch t = torch_attention(q, per_sequence(k0, k1), per_sequence(v0, v1), dout, B, TQ, 2 * TK, NH, NKV, HS);
  expect_close(out, t.out, 1e-5, 1e-6, "out");
  expect_close(lse, t.lse, 1e-5, 1e-6, "lse");
  expect_close(dq, t.dq, 1e-4, 1e-6, "dq");
  expect_close(per_sequence(dk0, dk1), t.dk, 1e-4, 1e-6, "dk");
  expect_close(per_sequence(dv0, dv1), t.dv, 1e-4, 1e-6, "dv");
}

}  // namespace
