#include "train/agreement.h"

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <fstream>
#include <sstream>
#include <thread>
#include <xxhash.h>

#include "data/corpus.h"

namespace shardlm::train {

namespace {

using Settings = std::vector<std::pair<std::string, std::string>>;

// FNV-1a: a hash that is the same in every build and on every machine (std::hash is neither).
uint64_t fnv1a(const std::string& s, uint64_t h = 1469598103934665603ull) {
  for (unsigned char c : s) h = (h ^ c) * 1099511628211ull;
  return h;
}

uint64_t field_hash(const std::pair<std::string, std::string>& f) { return fnv1a(f.second, fnv1a(f.first + "=")); }

// Every rank's values of `mine`, as one all-gather of fixed-size byte blocks.
template <class T>
std::vector<T> gather(comm::Communicator& world, const std::vector<T>& mine, std::chrono::milliseconds timeout,
                      const std::string& label) {
  std::vector<T> all(mine.size() * world.size());
  world.all_gather(mine.data(), all.data(), static_cast<int64_t>(sizeof(T) * mine.size()), DType::int8, label)
      ->wait(timeout);
  return all;
}

// "0 on rank 0, 3 on ranks 1, 2": the ranks grouped by value, in rank order of first holder.
std::string describe_values(const std::vector<std::string>& values) {
  std::vector<std::pair<std::string, std::vector<int>>> groups;
  for (int r = 0; r < static_cast<int>(values.size()); ++r) {
    auto it = std::find_if(groups.begin(), groups.end(), [&](const auto& g) { return g.first == values[r]; });
    if (it == groups.end()) groups.push_back({values[r], {r}});
    else it->second.push_back(r);
  }
  std::string out;
  for (const auto& [value, ranks] : groups) {
    if (!out.empty()) out += ", ";
    out += fmt::format("{} on rank{} {}", value.empty() ? "\"\"" : value, ranks.size() > 1 ? "s" : "",
                       fmt::join(ranks, ", "));
  }
  return out;
}

// A token file's size and an XXH3 of 16 blocks of 4 KiB spread over it, the first and the last
// among them ("absent" where it is missing): ranks on machines holding different files under one
// name are told apart, a copy still being written (its tail not there yet, or preallocated as
// zeros) or one of the same size made from another text too. 64 KiB read, before any rank reads
// its data.
std::string data_file_digest(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::error_code ec;
  const auto bytes = std::filesystem::file_size(path, ec);
  if (!f || ec) return "absent";
  constexpr uint64_t kBlock = 4096, kBlocks = 16;
  const uint64_t span = bytes > kBlock ? bytes - kBlock : 0;
  std::string sampled;
  for (uint64_t i = 0; i < kBlocks; ++i) {
    std::string block(kBlock, '\0');
    f.seekg(static_cast<std::streamoff>(span * i / (kBlocks - 1)));
    f.read(block.data(), kBlock);
    sampled.append(block.data(), static_cast<size_t>(f.gcount()));
    f.clear();
  }
  const uint64_t digest = XXH3_64bits(sampled.data(), sampled.size());
  return fmt::format("{} bytes, {:016x}", bytes, digest);
}

// A split's files (data/corpus.h): one file's digest, or of numbered shards the count and an
// XXH3 of every one's.
std::string split_digest(const std::string& prefix, const std::string& split) {
  const std::vector<std::string> files = data::split_files(prefix, split);
  if (files.size() == 1) return data_file_digest(files[0]);
  std::string each;
  for (const std::string& f : files) each += f.substr(f.find_last_of('/') + 1) + " " + data_file_digest(f) + "\n";
  return fmt::format("{} files, {:016x}", files.size(), XXH3_64bits(each.data(), each.size()));
}

// A directory is a diffusion model's latent sets (DIR/train.bin, DIR/val.bin; data/latents.h).
std::string data_file_digests(const std::string& prefix) {
  std::error_code ec;
  if (std::filesystem::is_directory(prefix, ec))
    return data_file_digest(prefix + "/train.bin") + " / " + data_file_digest(prefix + "/val.bin");
  return split_digest(prefix, "train") + " / " + split_digest(prefix, "val");
}

}  // namespace

Settings rank_settings(const TrainConfig& c) {
  auto s = [](const auto& v) { return fmt::format("{}", v); };
  Settings settings = {
      {"model", c.model},
      {"n-layer", s(c.n_layer)},
      {"n-head", s(c.n_head)},
      {"n-kv-head", s(c.n_kv_head)},
      {"n-embd", s(c.n_embd)},
      {"ffn-dim", s(c.ffn_dim)},
      {"max-seq", s(c.max_seq)},
      {"vocab", s(c.vocab)},
      {"rope-theta", s(c.rope_theta)},
      {"norm-eps", s(c.norm_eps)},
      {"tie-embeddings", s(c.tie_embeddings)},
      {"experts", s(c.experts)},
      {"top-k", s(c.top_k)},
      {"moe-ffn-dim", s(c.moe_ffn_dim)},
      {"moe-every", s(c.moe_every)},
      {"capacity-factor", s(c.capacity_factor)},
      {"no-norm-topk", s(c.no_norm_topk)},
      {"aux-loss-coef", s(c.aux_loss_coef)},
      {"z-loss-coef", s(c.z_loss_coef)},
      {"cond-drop", s(c.cond_drop)},
      {"frames", s(c.frames)},
      {"height", s(c.height)},
      {"width", s(c.width)},
      {"channels", s(c.channels)},
      {"classes", s(c.classes)},
      {"patch", c.patch},
      {"data", c.data},
      {"data files (train / val: size, sampled XXH3)", data_file_digests(c.data)},
      {"resume", c.resume},
      {"init-from", c.init_from},
      {"steps", s(c.steps)},
      {"seed", s(c.seed)},
      {"lr", s(c.lr)},
      {"min-lr", s(c.min_lr)},
      {"warmup", s(c.warmup)},
      {"lr-decay", c.lr_decay},
      {"decay-fraction", s(c.decay_fraction)},
      {"weight-decay", s(c.weight_decay)},
      {"beta1", s(c.beta1)},
      {"beta2", s(c.beta2)},
      {"eps", s(c.eps)},
      {"grad-clip", s(c.grad_clip)},
      {"on-nonfinite", c.on_nonfinite},
      {"max-skipped-steps", s(c.max_skipped_steps)},
      // These decide when the job runs evaluations, checkpoints (gathers) and sampling: collectives.
      {"eval-every", s(c.eval_every)},
      {"eval-windows", s(c.eval_windows)},
      {"save-every", s(c.save_every)},
      {"keep-last", s(c.keep_last)},
      {"snapshot-every", s(c.snapshot_every)},
      {"snapshot-parity", s(c.snapshot_parity)},
      {"sample-tokens", s(c.sample_tokens)},
      {"samples-per-class", s(c.samples_per_class)},
      {"sample-steps", s(c.sample_steps)},
      {"sample-cfg", s(c.sample_cfg)},
      {"compute-dtype", c.compute_dtype},
      {"device", c.device},
      {"comm", c.comm_backend},
      // The path is rank 0's alone, but whether there is one decides the trace's gathers.
      {"trace (on or off)", c.trace.empty() ? "off" : "on"},
  };
  // The plan's options, each as its table entry says (plan/options.h); every rank's plan places
  // the same state on disk (the directory may differ: a node's own disk).
  for (const plan::PlanOption& o : plan::plan_options())
    if (o.ranks_agree) settings.emplace_back(o.flag, plan::option_text(o, c));
  return settings;
}

void check_ranks_agree(const TrainConfig& cfg, comm::Communicator& world, std::chrono::milliseconds timeout) {
  if (world.size() == 1) return;
  const Settings mine = rank_settings(cfg);
  uint64_t whole = 0;
  for (const auto& f : mine) whole = fnv1a(std::to_string(field_hash(f)), whole);
  // The field count travels with the hash so that the per-field gather below has one size on
  // every rank even if the ranks run different builds.
  const auto all = gather<uint64_t>(world, {whole, mine.size()}, timeout, "settings hash");
  bool same = true, same_count = true;
  for (int r = 0; r < world.size(); ++r) {
    same = same && all[2 * r] == whole;
    same_count = same_count && all[2 * r + 1] == mine.size();
  }
  if (same) return;
  const bool lead = world.rank() == 0;
  if (!same_count)
    throw AgreedFailure("ranks disagree on settings: they run different shardlm builds (different setting lists)", lead);

  std::vector<uint64_t> hashes;
  for (const auto& f : mine) hashes.push_back(field_hash(f));
  const auto every = gather<uint64_t>(world, hashes, timeout, "settings field hashes");
  std::vector<std::string> differ;
  for (size_t i = 0; i < mine.size(); ++i) {
    bool equal = true;
    for (int r = 1; r < world.size(); ++r) equal = equal && every[r * mine.size() + i] == every[i];
    if (equal) continue;
    // Every rank walks the same fields in the same order, so these gathers match up.
    const auto values = all_texts(world, timeout, mine[i].second, "settings: values");
    differ.push_back(fmt::format("{} ({})", mine[i].first, describe_values(values)));
  }
  throw AgreedFailure(fmt::format("ranks disagree on settings: {}; every rank must be started with the same model, "
                                  "plan, data and optimizer settings",
                                  fmt::join(differ, "; ")),
                      lead);
}

void on_lead_or_all_fail(comm::Communicator& world, std::chrono::milliseconds timeout, const std::function<void()>& fn) {
  std::string failure;
  int32_t failed = 0;
  if (world.rank() == 0) {
    try {
      fn();
    } catch (const std::exception& e) {
      failure = e.what();
      failed = 1;
    }
  }
  if (world.size() > 1) world.broadcast(&failed, 4, DType::int8, 0, "rank 0's start-up outcome")->wait(timeout);
  if (!failed) return;
  if (world.rank() == 0) throw AgreedFailure(failure, true);
  throw AgreedFailure("rank 0 failed at start-up", false);
}

void check_token_ids(comm::Communicator& world, std::chrono::milliseconds timeout,
                     const std::vector<const data::TokenCorpus*>& corpora, int32_t vocab_size) {
  int64_t total = 0;
  for (const data::TokenCorpus* c : corpora) total += c->size();
  const auto [first, end] = data::share_of(total, world.rank(), world.size());
  std::string error;
  try {
    int64_t start = 0;  // of the corpus in the sequence of all of them
    for (const data::TokenCorpus* c : corpora) {
      const int64_t from = std::max(first, start), to = std::min(end, start + c->size());
      if (from < to) c->validate_tokens(vocab_size, from - start, to - from);
      start += c->size();
    }
  } catch (const std::exception& e) {
    error = e.what();
  }
  const std::vector<std::string> errors = all_texts(world, timeout, error, "token ids checked");
  for (const std::string& e : errors)
    if (!e.empty()) throw AgreedFailure(e, world.rank() == 0);
}

// Lengths first, then the texts padded to the longest.
std::vector<std::string> all_texts(comm::Communicator& world, std::chrono::milliseconds timeout,
                                   const std::string& text, const std::string& label) {
  const auto lens = gather<int64_t>(world, {static_cast<int64_t>(text.size())}, timeout, label + ": lengths");
  const int64_t most = *std::max_element(lens.begin(), lens.end());
  std::vector<char> padded(text.begin(), text.end());
  padded.resize(most, ' ');
  const auto all = gather<char>(world, padded, timeout, label);
  std::vector<std::string> out;
  for (int r = 0; r < world.size(); ++r) out.emplace_back(all.data() + r * most, lens[r]);
  return out;
}

void check_out_shared(comm::Communicator& world, std::chrono::milliseconds timeout, const std::string& out) {
  if (world.size() == 1) return;
  const auto lock_text = [&] {
    std::ifstream f(out + "/.lock");
    std::stringstream text;
    text << f.rdbuf();
    return text.str();
  };
  const std::string held = lead_text(world, timeout, lock_text());
  bool sees = lock_text() == held;
  for (int tries = 0; !sees && tries < 20; ++tries) {
    std::this_thread::sleep_for(std::chrono::milliseconds(250));
    sees = lock_text() == held;
  }
  const auto all = gather<uint8_t>(world, {static_cast<uint8_t>(sees)}, timeout, "run directory: seen");
  std::vector<int> blind;
  for (int r = 0; r < world.size(); ++r)
    if (!all[r]) blind.push_back(r);
  if (blind.empty()) return;
  std::string mine = held;
  if (!mine.empty() && mine.back() == '\n') mine.pop_back();
  throw AgreedFailure(fmt::format("--out: rank{} {} do{} not see the run directory rank 0 holds ({}/.lock: {}); every "
                                  "rank writes its checkpoint files there, so every rank's --out must be that "
                                  "directory, on a filesystem all the machines share",
                                  blind.size() > 1 ? "s" : "", fmt::join(blind, ", "), blind.size() > 1 ? "" : "es",
                                  out, mine),
                      world.rank() == 0);
}

std::string lead_text(comm::Communicator& world, std::chrono::milliseconds timeout, std::string text) {
  if (world.size() == 1) return text;
  int64_t bytes = static_cast<int64_t>(text.size());
  world.broadcast(&bytes, 8, DType::int8, 0, "rank 0's text size")->wait(timeout);
  text.resize(bytes);
  if (bytes > 0) world.broadcast(text.data(), bytes, DType::int8, 0, "rank 0's text")->wait(timeout);
  return text;
}

}  // namespace shardlm::train
