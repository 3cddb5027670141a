#include "layers/context.h"

#include <stdexcept>
#include <string>

namespace shardlm::layers::context {

namespace {

// Every rank's payload is the same size here: B·T rows of `width` floats.
char* payload(char* buf, int q, int64_t width, const Split& s) {
  return buf + model::exchange_header_bytes(s.P) + static_cast<int64_t>(q) * s.B * s.T * width * 4;
}
const char* payload(const char* buf, int q, int64_t width, const Split& s) {
  return payload(const_cast<char*>(buf), q, width, s);
}
void write_sizes(const kernels::Backend& be, char* send, int64_t width, const Split& s) {
  const std::vector<int64_t> bytes(s.P, s.B * s.T * width * 4);
  be.upload(send, bytes.data(), 8 * s.P);
}

// Column segments of a row, each split evenly over the P ranks by heads: q|k|v is three (q over
// NH heads, k and v over NKV), an attention output one.
struct Segment {
  int64_t at, width;  // floats, in the whole row
};
std::vector<Segment> qkv_segments(const Split& s) {
  return {{0, s.NH * s.HS}, {s.NH * s.HS, s.NKV * s.HS}, {(s.NH + s.NKV) * s.HS, s.NKV * s.HS}};
}

// Rank q's columns of rows (B·T, full width) into its payload (B·T, full / P), or back.
void columns_to_payloads(const kernels::Backend& be, char* send, const float* rows, const std::vector<Segment>& seg,
                         int64_t full, const Split& s) {
  const int64_t mine = full / s.P, n = s.B * s.T;
  write_sizes(be, send, mine, s);
  for (int q = 0; q < s.P; ++q) {
    float* out = reinterpret_cast<float*>(payload(send, q, mine, s));
    for (const Segment& g : seg) {
      const int64_t w = g.width / s.P;
      be.copy_rows(out, 4 * mine, rows + g.at + q * w, 4 * full, 4 * w, n);
      out += w;
    }
  }
}
void payloads_to_columns(const kernels::Backend& be, float* rows, const char* recv, const std::vector<Segment>& seg,
                         int64_t full, const Split& s) {
  const int64_t mine = full / s.P, n = s.B * s.T;
  for (int q = 0; q < s.P; ++q) {
    const float* in = reinterpret_cast<const float*>(payload(recv, q, mine, s));
    for (const Segment& g : seg) {
      const int64_t w = g.width / s.P;
      be.copy_rows(rows + g.at + q * w, 4 * full, in, 4 * mine, 4 * w, n);
      in += w;
    }
  }
}

// Rank q's rows of the whole sequence (B, T·P, width) into its payload (B, T, width), or back.
void sequence_to_payloads(const kernels::Backend& be, char* send, const float* seq, int64_t width, const Split& s) {
  write_sizes(be, send, width, s);
  for (int q = 0; q < s.P; ++q)
    for (int64_t b = 0; b < s.B; ++b)
      be.copy(payload(send, q, width, s) + 4 * b * s.T * width, seq + (b * s.P + q) * s.T * width,
              4 * s.T * width);
}
void payloads_to_sequence(const kernels::Backend& be, float* seq, const char* recv, int64_t width, const Split& s) {
  for (int q = 0; q < s.P; ++q)
    for (int64_t b = 0; b < s.B; ++b)
      be.copy(seq + (b * s.P + q) * s.T * width, payload(recv, q, width, s) + 4 * b * s.T * width,
              4 * s.T * width);
}

// The whole sequence, one chunk.
struct Whole {
  int64_t start = 0;
  kernels::SeqChunks chunks;
  explicit Whole(int64_t positions) : chunks{1, positions, &start} {}
};

}  // namespace

Positions positions(const UnitArgs& a) {
  const int64_t seq = a.T * a.cp;
  return {model::context_chunk_starts(seq, a.cp, a.cp_index, a.cp_impl),
          model::context_chunk_rows(seq, a.cp, a.cp_impl)};
}

kernels::Rope rope_of(const model::ModelConfig& c) {
  const auto& r = c.rope_scaling;
  // theta rounded to fp32 first, as torch takes a Python float beside an fp32 tensor.
  return {static_cast<float>(c.rope_theta), r.factor, r.low_freq_factor, r.high_freq_factor,
          static_cast<double>(r.original_max_seq)};
}

void rotate(const kernels::Backend& be, float* qkv, const UnitArgs& a, int64_t width, int64_t heads, int64_t HS,
            const float* table, bool back) {
  const Positions pos = positions(a);
  const bool whole = pos.starts.size() == 1;  // one chunk: every sequence at once
  for (int64_t b = 0; b < (whole ? 1 : a.B); ++b)
    for (size_t c = 0; c < pos.starts.size(); ++c) {
      float* x = qkv + (b * a.T + static_cast<int64_t>(c) * pos.rows) * width;
      const float* rows = table + be.rope_table_floats(pos.starts[c], HS);  // row p of the table
      const int64_t B = whole ? a.B : 1;
      if (back)
        be.rope_backward(x, B, pos.rows, heads, HS, width, rows);
      else
        be.rope_forward(x, B, pos.rows, heads, HS, width, rows);
    }
}

Split split_of(const UnitArgs& a) {
  const auto& c = a.desc->config;
  if (a.cp_impl != model::ContextImpl::all_to_all)
    throw std::logic_error("context split: only the all-to-all form runs as layers' stages");
  return {a.cp, a.cp_index, a.B, a.T, c.n_head, c.n_kv_head, c.head_size(), c.causal};
}

void send_qkv(const kernels::Backend& be, char* send, const float* qkv, const Split& s) {
  columns_to_payloads(be, send, qkv, qkv_segments(s), s.qkv(), s);
}

void attention_forward(const kernels::Backend& be, float* qkv_split, float* out_split, float* lse, const char* recv,
                       char* send, const Split& s) {
  const int64_t W = s.qkv_split(), q_cols = s.heads() * s.HS;
  payloads_to_sequence(be, qkv_split, recv, W, s);
  const Whole all(s.T * s.P);
  be.attention_chunked_forward(out_split, lse, qkv_split, W, all.chunks, qkv_split + q_cols,
                               qkv_split + q_cols + s.kv_heads() * s.HS, W, all.chunks, s.B, s.heads(), s.kv_heads(),
                               s.HS, false, s.causal);
  sequence_to_payloads(be, send, out_split, s.out_split(), s);
}

void take_outputs(const kernels::Backend& be, float* out, const char* recv, const Split& s) {
  payloads_to_columns(be, out, recv, {{0, s.NH * s.HS}}, s.NH * s.HS, s);
}

void send_output_grads(const kernels::Backend& be, char* send, const float* dout, const Split& s) {
  columns_to_payloads(be, send, dout, {{0, s.NH * s.HS}}, s.NH * s.HS, s);
}

void attention_backward(const kernels::Backend& be, float* dqkv_split, float* dout_split, const float* qkv_split,
                        const float* out_split, const float* lse, const char* recv, char* send, float* scratch,
                        const Split& s) {
  const int64_t W = s.qkv_split(), q_cols = s.heads() * s.HS, kv_cols = s.kv_heads() * s.HS;
  payloads_to_sequence(be, dout_split, recv, s.out_split(), s);
  be.zero(dqkv_split, sizeof(float) * s.B * s.T * s.P * W);
  const Whole all(s.T * s.P);
  be.attention_chunked_backward(dqkv_split, W, dqkv_split + q_cols, dqkv_split + q_cols + kv_cols, W, dout_split,
                                qkv_split, W, out_split, lse, all.chunks, qkv_split + q_cols,
                                qkv_split + q_cols + kv_cols, W, all.chunks, s.B, s.heads(), s.kv_heads(), s.HS,
                                scratch, s.causal);
  sequence_to_payloads(be, send, dqkv_split, W, s);
}

void take_qkv_grads(const kernels::Backend& be, float* dqkv, const char* recv, const Split& s) {
  payloads_to_columns(be, dqkv, recv, qkv_segments(s), s.qkv(), s);
}

Ring ring_of(const UnitArgs& a) {
  const auto& c = a.desc->config;
  if (a.cp_impl != model::ContextImpl::ring) throw std::logic_error("context ring: the plan splits the heads, not a ring");
  Ring r{a.cp, a.cp_index, a.B, a.T, c.n_head, c.n_kv_head, c.head_size(), {}, 0, c.causal};
  const int64_t seq = a.T * a.cp;
  for (int j = 0; j < a.cp; ++j) r.starts.push_back(model::context_chunk_starts(seq, a.cp, j, a.cp_impl));
  r.rows = model::context_chunk_rows(seq, a.cp, a.cp_impl);
  return r;
}

void ring_send_own(const kernels::Backend& be, char* send, const float* qkv, const Ring& r) {
  be.copy_rows(send, 4 * r.kv(), qkv + r.NH * r.HS, 4 * r.qkv(), 4 * r.kv(), r.B * r.T);  // k|v adjacent in q|k|v
}

void ring_forward(const kernels::Backend& be, float* out, float* lse, const float* qkv, const char* recv,
                  float* kv_last, int stage, const Ring& r) {
  const int64_t BT = r.B * r.T, KV = r.kv(), W = r.qkv(), v_at = r.NKV * r.HS;
  const bool own = stage == 1;
  const float* kv = own ? qkv + r.NH * r.HS : reinterpret_cast<const float*>(recv);
  be.attention_chunked_forward(out, lse, qkv, W, r.chunks(r.me), kv, kv + v_at, own ? W : KV, r.chunks(r.block(stage)),
                               r.B, r.NH, r.NKV, r.HS, !own, r.causal);
  if (stage == r.P) be.copy(kv_last, recv, 4 * BT * KV);
}

void ring_send_kept(const kernels::Backend& be, char* send, const float* kv_last, const Ring& r) {
  be.copy(send, kv_last, sizeof(float) * r.B * r.T * r.kv());
}

void ring_backward_block(const kernels::Backend& be, float* dqkv, const float* dout, const float* qkv, const float* out,
                         const float* lse, const float* kv_last, const char* recv, char* send, float* scratch, int t,
                         const Ring& r) {
  const int64_t BT = r.B * r.T, KV = r.kv(), W = r.qkv(), k_at = r.NH * r.HS, v_at = r.NKV * r.HS;
  if (t == r.P) be.zero(dqkv, sizeof(float) * BT * W);
  // Block t's keys and values and where its d k|v goes, each with its row pitch.
  const float* k = qkv + k_at;
  float* dk = dqkv + k_at;
  int64_t ld_k = W, ld_dk = W;
  if (t > 1) {
    k = t == r.P ? kv_last : reinterpret_cast<const float*>(recv);
    dk = reinterpret_cast<float*>(send);
    ld_k = ld_dk = KV;
    be.zero(dk, sizeof(float) * BT * KV);
  }
  be.attention_chunked_backward(dqkv, W, dk, dk + v_at, ld_dk, dout, qkv, W, out, lse, r.chunks(r.me), k, k + v_at, ld_k,
                                r.chunks(r.block(t)), r.B, r.NH, r.NKV, r.HS, scratch, r.causal);
}

void ring_backward_fold(const kernels::Backend& be, char* send, const char* recv, const Ring& r) {
  float* acc = reinterpret_cast<float*>(send);
  be.residual_forward(acc, acc, reinterpret_cast<const float*>(recv), r.B * r.T * r.kv());
}

void ring_backward_home(const kernels::Backend& be, float* dqkv, const char* recv, const Ring& r) {
  be.add_rows(dqkv + r.NH * r.HS, r.qkv(), reinterpret_cast<const float*>(recv), r.kv(), r.kv(), r.B * r.T);
}

void ring_backward_stage(const UnitArgs& a, float* dqkv, const float* dout, const float* qkv, const float* out,
                         const float* lse, const float* kv_last, float* scratch, const std::function<void()>& mlp,
                         const std::function<void()>& qkv_backward) {
  using Role = model::RingBackwardStage::Role;
  const kernels::Backend& be = *a.backend;
  const Ring r = ring_of(a);
  const model::RingBackwardStage st = model::ring_backward_stage(a.stage, r.P);
  switch (st.role) {
    case Role::send_kept: return ring_send_kept(be, a.send, kv_last, r);
    case Role::fold: return ring_backward_fold(be, a.send, a.recv, r);
    case Role::home:
      ring_backward_home(be, dqkv, a.recv, r);
      return qkv_backward();
    case Role::compute:
      if (st.block == r.P) mlp();
      return ring_backward_block(be, dqkv, dout, qkv, out, lse, kv_last, a.recv, a.send, scratch, st.block, r);
  }
}

void ring_backward_stage(const UnitArgs& a, float* dqkv, const float* dout, const Kept& qkv, const Kept& out,
                         float* qkv_scratch, const float* out_scratch, const float* lse, const float* kv_last,
                         float* scratch, const std::function<void()>& mlp, const std::function<void()>& qkv_backward) {
  const auto mlp_then_qkv = [&] {
    mlp();
    load(a, qkv, qkv_scratch);
  };
  ring_backward_stage(a, dqkv, dout, qkv.quantized() ? qkv_scratch : qkv.f, out.quantized() ? out_scratch : out.f, lse,
                      kv_last, scratch, mlp_then_qkv, qkv_backward);
}

void split_forward(const UnitArgs& a, const SplitAttention& s, const std::function<void(float*)>& qkv,
                   const std::function<void()>& rest) {
  const kernels::Backend& be = *a.backend;
  if (a.cp_impl == model::ContextImpl::ring) {
    const Ring ring = ring_of(a);
    if (a.stage == 0) {
      qkv(s.qkv.f);
      return ring_send_own(be, a.send, s.qkv.f, ring);
    }
    ring_forward(be, s.atty.f, s.lse, s.qkv.f, a.recv, s.kv_last, a.stage, ring);
    if (a.stage < ring.P) return;
    store(a, s.qkv, "qkv");
    return rest();
  }
  const Split sp = split_of(a);
  if (a.stage == 0) {
    qkv(s.qkv_rows);
    return send_qkv(be, a.send, s.qkv_rows, sp);
  }
  if (a.stage == 1) {
    attention_forward(be, s.qkv.f, s.out_split, s.lse, a.recv, a.send, sp);
    return store(a, s.qkv, "qkv");  // this rank's heads, every position
  }
  take_outputs(be, s.atty.f, a.recv, sp);
  rest();
}

void split_backward(const UnitArgs& a, const SplitAttention& s, const SplitAttentionGrads& w,
                    const std::function<void()>& after, const std::function<void()>& qkv_backward) {
  const kernels::Backend& be = *a.backend;
  if (a.cp_impl == model::ContextImpl::ring)
    return ring_backward_stage(a, w.dqkv, w.datty, s.qkv, s.atty, w.wide, w.narrow, s.lse, s.kv_last, w.scratch,
                               after, qkv_backward);
  const Split sp = split_of(a);
  if (a.stage == 2) {
    after();
    return send_output_grads(be, a.send, w.datty, sp);
  }
  if (a.stage == 1)
    return attention_backward(be, w.dqkv_split, w.dout_split, load(a, s.qkv, w.wide), s.out_split, s.lse, a.recv,
                              a.send, w.scratch, sp);
  take_qkv_grads(be, w.dqkv, a.recv, sp);
  qkv_backward();
}

}  // namespace shardlm::layers::context
