// Every op the plan can hold, declared once. Adding an op is one line here plus its handler:
// the Op enum, its name, the stream builders put it on, the collective the simulator prices it
// as and the work its compute cost counts are all generated from this list, and the executor's
// handler table is too (an op without an Executor member of its name does not compile).
//
// X(name, stream, collective, work)
//   stream      compute | comm | exchange (a stream, and communicators, of its own: an exchange
//               never waits behind a prefetched gather) | copy (the disk tier's reads and writes,
//               --offload: no collective, no compute work) | send | recv (pipeline stages'
//               activations and gradients, each way a stream of its own, so a rank's sends never
//               wait behind its receives)
//   collective  none (compute ops) | all_gather | reduce_scatter | all_reduce | all_to_all |
//               point_to_point (one rank to one other)
//   work        what a compute op's cost counts (sim::CostModel):
//                 none        nothing beyond its FLOPs
//                 unit_fwd    the unit's forward GEMMs and pointwise passes
//                 unit_bwd    the unit's backward GEMMs (2× forward) and pointwise passes (2×)
//                 unit_fwd_bwd  forward and backward fused (the training head)
//                 unit_rebuild  what recompute rebuilds (the forward's GEMMs only for full recompute)
//                 grads_pass  one pass over this rank's gradients
//                 adamw       AdamW's passes over params, grads and both moments
#pragma once

#define SHARDLM_OPS(X)                                                                                  \
  X(zero_grads, compute, none, grads_pass)     /* the run-long gradient buffer to zero */              \
  X(forward, compute, none, unit_fwd)          /* unit forward of one micro-step */                    \
  X(recompute, compute, none, unit_rebuild)    /* rebuild a unit's dropped activations */              \
  X(head, compute, none, unit_fwd_bwd)         /* head forward + loss + its backward (training) */     \
  X(loss, compute, none, unit_fwd)             /* head forward + loss (evaluation) */                  \
  X(logits, compute, none, unit_fwd)           /* head forward, last position's logits (generation) */ \
  X(backward, compute, none, unit_bwd)         /* unit backward of one micro-step */                   \
  X(grad_norm, compute, none, grads_pass)      /* this rank's sum of squares of its gradients */       \
  X(optimizer, compute, none, adamw)           /* clip by the global norm, AdamW on this rank's part */ \
  X(optimizer_commit, compute, none, none)     /* keep, redo clipped or undo the speculative updates */ \
  X(all_gather, comm, all_gather, none)        /* a unit's parameter shards -> gathered parameters */  \
  X(reduce_scatter, comm, reduce_scatter, none) /* a unit's full gradients -> summed shard */          \
  X(all_reduce, comm, all_reduce, none)        /* a gradient bucket, or a shard across replicas */     \
  X(param_gather, comm, all_gather, none)      /* ZeRO-1/2: updated shards -> every rank's full copy */ \
  X(norm_reduce, comm, all_gather, none)       /* every rank's norm and loss sums to every rank */     \
  X(loss_reduce, comm, all_reduce, none)       /* the ranks' losses summed */                          \
  X(exchange, exchange, all_to_all, none)      /* a staged unit's routed rows between its stages */ \
  X(send, send, point_to_point, none)         /* a stage's activations (or gradients) to its neighbour */ \
  X(recv, recv, point_to_point, none)         /* the neighbour's, into this stage's buffer */          \
  X(reload, copy, none, none)                  /* a unit's offloaded state from disk into its window */ \
  X(write_back, copy, none, none)              /* a window's state back to disk */                    \
  X(window_sync, compute, none, none)          /* the compute stream's point to bring into being, or  \
                                                  let go, windows no other compute task can (--offload) */

namespace shardlm::plan {

enum class Op {
#define SHARDLM_OP_ENUM(name, stream, collective, work) name,
  SHARDLM_OPS(SHARDLM_OP_ENUM)
#undef SHARDLM_OP_ENUM
};

enum class OpStream { compute, comm, exchange, copy, send, recv };
enum class OpCollective { none, all_gather, reduce_scatter, all_reduce, all_to_all, point_to_point };
enum class OpWork { none, unit_fwd, unit_bwd, unit_fwd_bwd, unit_rebuild, grads_pass, adamw };

struct OpInfo {
  const char* name;
  OpStream stream;
  OpCollective collective;
  OpWork work;
};

inline constexpr OpInfo kOps[] = {
#define SHARDLM_OP_INFO(name, stream, collective, work) \
  {#name, OpStream::stream, OpCollective::collective, OpWork::work},
    SHARDLM_OPS(SHARDLM_OP_INFO)
#undef SHARDLM_OP_INFO
};
inline constexpr int kNumOps = static_cast<int>(sizeof(kOps) / sizeof(kOps[0]));

constexpr const OpInfo& info(Op op) { return kOps[static_cast<int>(op)]; }
constexpr const char* to_string(Op op) { return info(op).name; }

// A comm op names its collective and a compute op none; a copy op neither, nor compute work.
constexpr bool well_formed(const OpInfo& o) {
  if (o.stream == OpStream::copy) return o.collective == OpCollective::none && o.work == OpWork::none;
  return (o.stream != OpStream::compute) == (o.collective != OpCollective::none) &&
         (o.stream == OpStream::compute || o.work == OpWork::none);
}
constexpr bool all_well_formed() {
  for (const OpInfo& o : kOps)
    if (!well_formed(o)) return false;
  return true;
}
static_assert(all_well_formed(), "ops.h: a comm op needs a collective and no compute work; a compute op no collective; a copy op neither");

}  // namespace shardlm::plan
