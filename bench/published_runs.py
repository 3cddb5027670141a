#!/usr/bin/env python3
"""Published FSDP-style training runs as `shardlm simulate` configurations: predicted against
published throughput (tokens/s per GPU), one markdown row each (docs/CLUSTER.md).

  /usr/bin/python3 bench/published_runs.py [--shardlm build/shardlm] [--hardware-h100 PROFILE.json]
      [--hardware-a100 PROFILE.json] [--hardware-h100-hbm2e PROFILE.json]

Unset, a row runs on its preset: h100-80gb and a100-80gb (kernel rates measured on a GPU with
bench/gpu_kernel_rates.py and carried to them by bench/gpu_profile_from_rates.py), and the rows
torchtitan ran on its 96 GB HBM2e H100s on h100-96gb-hbm2e. --hardware-h100 runs the H100 rows on
another profile, --hardware-a100 the A100 rows, --hardware-h100-hbm2e the HBM2e rows (by default
--hardware-h100's profile where that is given). The datasheet presets' table, for comparison:
  --hardware-h100 h100-80gb-datasheet --hardware-a100 a100-80gb-datasheet

Each configuration is what the source states (model shape, GPUs, local batch, sequence length,
sharding, activation checkpointing; bf16 parameters and reductions, as these runs' mixed
precision does; IBM's network, 2 NICs a node, on its fms-fsdp rows). Nothing is adjusted per row: every row uses the unchanged preset. What the
sources leave open is taken as written in the NOTES column.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

BF16 = ["--param-dtype", "bf16", "--reduce-dtype", "bf16"]
# MosaicML MPT shapes (llm-foundry scripts/train/yamls/pretrain/mpt-*.yaml): GELU MLP x4, vocab
# 50368, no biases, ALiBi; shardlm's GPT-2 family is the nearest (it has biases and learned
# positions: < 0.1% of the FLOPs at these sizes).
MPT7 = ["--model", "gpt2-124m", "--n-layer", "32", "--n-embd", "4096", "--n-head", "32", "--max-seq", "2048",
        "--vocab", "50368", "--seq", "2048"]
MPT13 = ["--model", "gpt2-124m", "--n-layer", "40", "--n-embd", "5120", "--n-head", "40", "--max-seq", "2048",
         "--vocab", "50368", "--seq", "2048"]
IBM = "IBM fms-fsdp README, training throughput table"
# An earlier version of the same table (every row on 128 A100s), the one this workplace holds a
# copy of: foundation-model-stack/fms-fsdp README.md at commit 0d319983c4b3b7f7b3b5e2c5e7f746746b6f73a9.
IBM_0D3 = "IBM fms-fsdp README at commit 0d31998 (128 A100)"
# IBM's clusters as the README version of the IBM rows states them: "400 Gbps" of network a node of
# 8 A100s and "800 Gbps" a node of 8 H100s, two NICs at the line rate of the profile's (HDR 200,
# NDR 400 Gb/s; the presets have 8). Every fms-fsdp row runs on its profile with that many.
IBM_NICS_PER_NODE = 2
# fms-fsdp's llama2_34b (get_model_config): CodeLlama-34B's shape.
LLAMA34 = ["--model", "llama2-70b", "--n-layer", "48", "--n-embd", "8192", "--n-head", "64", "--n-kv-head", "8",
           "--ffn-dim", "22016", "--rope-theta", "1000000"]
TITAN_A = "torchtitan docs/performance.md (64 A100-80GB)"
TITAN_H = "torchtitan paper arXiv 2410.06511 / docs/performance.md"
HBM2E = "h100-96gb-hbm2e"  # torchtitan's H100s: a preset of their own
MOSAIC = "llm-foundry scripts/train/benchmarking/README.md"
# Composer (llm-foundry's trainer) skips gradient synchronisation on the micro-batches before the
# last only for a DDP-wrapped model (composer's ddp_sync_context returns at once for any other), so
# under FSDP every micro-batch's backward reduce-scatters: shardlm's --reduce-each-micro-step.
REDUCE_EACH = ["--reduce-each-micro-step"]
COMPOSER_ACCUM = "Composer reduce-scatters every micro-batch under FSDP (its no_sync is for DDP only)"

RUNS = [
    # (label, published tok/s/GPU, source, notes, flags)
    ("fms-fsdp Llama2-7B, 128 A100, HSDP, bs 2", 3650, IBM, "HSDP shards within a node of 8 (fms-fsdp docs/configurations.md); seq 4096 (Llama 2)",
     ["--model", "llama2-7b", "--hardware", "a100-80gb", "--ranks", "128", "--strategy", "hybrid", "--shard-group", "8",
      "--batch", "2", "--seq", "4096"]),
    ("fms-fsdp Llama2-7B, 96 H100, HSDP, bs 2", 7500, IBM, "as above",
     ["--model", "llama2-7b", "--hardware", "h100-80gb", "--ranks", "96", "--strategy", "hybrid", "--shard-group", "8",
      "--batch", "2", "--seq", "4096"]),
    ("fms-fsdp Llama2-13B, 128 A100, FSDP, selective AC", 1800, IBM, "their selective AC checkpoints a fraction of the blocks whole; run as shardlm's selective recompute, which reruns less",
     ["--model", "llama2-13b", "--hardware", "a100-80gb", "--ranks", "128", "--batch", "2", "--seq", "4096",
      "--recompute", "selective"]),
    ("fms-fsdp Llama2-13B, 96 H100, FSDP, selective AC", 3800, IBM, "as above",
     ["--model", "llama2-13b", "--hardware", "h100-80gb", "--ranks", "96", "--batch", "2", "--seq", "4096",
      "--recompute", "selective"]),
    ("fms-fsdp Llama2-70B, 128 A100, FSDP, full AC", 370, IBM, "",
     ["--model", "llama2-70b", "--hardware", "a100-80gb", "--ranks", "128", "--batch", "2", "--seq", "4096",
      "--recompute", "full"]),
    ("fms-fsdp Llama2-7B, 128 A100, HSDP, no AC, bs 2 (earlier table)", 3760, IBM_0D3,
     "the row above, as this version states it",
     ["--model", "llama2-7b", "--hardware", "a100-80gb", "--ranks", "128", "--batch", "2", "--seq", "4096",
      "--strategy", "hybrid", "--shard-group", "8"]),
    ("fms-fsdp Llama2-13B, 128 A100, HSDP, no AC, bs 1 (earlier table)", 1700, IBM_0D3, "HSDP: a node of 8",
     ["--model", "llama2-13b", "--hardware", "a100-80gb", "--ranks", "128", "--batch", "1", "--seq", "4096",
      "--strategy", "hybrid", "--shard-group", "8"]),
    ("fms-fsdp 34B (CodeLlama shape), 128 A100, FSDP, full AC, bs 8 (earlier table)", 772, IBM_0D3,
     "AC with selective_checkpointing 1: every block", LLAMA34 +
     ["--hardware", "a100-80gb", "--ranks", "128", "--batch", "8", "--seq", "4096", "--recompute", "full"]),
    ("fms-fsdp Llama2-70B, 128 A100, FSDP, full AC, bs 6 (earlier table)", 380, IBM_0D3, "",
     ["--model", "llama2-70b", "--hardware", "a100-80gb", "--ranks", "128", "--batch", "6", "--seq", "4096",
      "--recompute", "full"]),
    ("fms-fsdp Llama2-70B, 96 H100, FSDP, full AC", 800, IBM, "",
     ["--model", "llama2-70b", "--hardware", "h100-80gb", "--ranks", "96", "--batch", "2", "--seq", "4096",
      "--recompute", "full"]),
    ("torchtitan Llama3-8B, 64 A100, FSDP2, selective layer AC, bs 1", 2904, TITAN_A,
     "seq 8192 (llama3_8b.toml); selective layer: every second block checkpointed whole (selective_ac_option 2)",
     ["--model", "llama3-8b", "--hardware", "a100-80gb", "--ranks", "64", "--batch", "1", "--seq", "8192",
      "--recompute", "full", "--recompute-blocks", "16"]),
    ("torchtitan Llama3-70B, 64 A100, FSDP2, full AC, bs 1", 331, TITAN_A, "seq 8192",
     ["--model", "llama3-70b", "--hardware", "a100-80gb", "--ranks", "64", "--batch", "1", "--seq", "8192",
      "--recompute", "full"]),
    ("torchtitan Llama2-13B, 64 A100, FSDP2, no AC, bs 2", 2162, TITAN_A, "",
     ["--model", "llama2-13b", "--hardware", "a100-80gb", "--ranks", "64", "--batch", "2", "--seq", "4096"]),
    ("torchtitan Llama2-13B, 64 A100, FSDP2, selective layer AC, bs 2", 1914, TITAN_A, "every second block checkpointed whole",
     ["--model", "llama2-13b", "--hardware", "a100-80gb", "--ranks", "64", "--batch", "2", "--seq", "4096",
      "--recompute", "full", "--recompute-blocks", "20"]),
    ("torchtitan Llama3-8B, 64 A100, FSDP2, selective op AC, bs 1", 2973, TITAN_A,
     "seq 8192; selective op: torchtitan's op policy (attention and every other matmul's output kept), --recompute selective-op",
     ["--model", "llama3-8b", "--hardware", "a100-80gb", "--ranks", "64", "--batch", "1", "--seq", "8192",
      "--recompute", "selective-op"]),
    ("torchtitan Llama2-13B, 64 A100, FSDP2, selective op AC, bs 2", 1904, TITAN_A, "as above",
     ["--model", "llama2-13b", "--hardware", "a100-80gb", "--ranks", "64", "--batch", "2", "--seq", "4096",
      "--recompute", "selective-op"]),
    ("torchtitan Llama2-70B, 64 A100, FSDP2, selective op AC, bs 1", 355, TITAN_A, "as above; batch 1 (2 ran out of memory, their footnote)",
     ["--model", "llama2-70b", "--hardware", "a100-80gb", "--ranks", "64", "--batch", "1", "--seq", "4096",
      "--recompute", "selective-op"]),
    ("torchtitan Llama2-70B, 64 A100, FSDP2, full AC, bs 2", 353, TITAN_A, "",
     ["--model", "llama2-70b", "--hardware", "a100-80gb", "--ranks", "64", "--batch", "2", "--seq", "4096",
      "--recompute", "full"]),
    ("torchtitan Llama3.1-8B, 8 H100, FSDP2, selective AC, bs 2, eager", 5762, TITAN_H,
     "their H100s: 96 GB HBM2e, 2.4 TB/s, 500 W cap (the h100-80gb preset: SXM 80 GB HBM3, 700 W); selective: "
     "llama3_8b.toml of the time sets selective_ac_option 'op', --recompute selective-op",
     ["--model", "llama3-8b", "--hardware", HBM2E, "--ranks", "8", "--batch", "2", "--seq", "8192",
      "--recompute", "selective-op"]),
    ("torchtitan Llama3.1-8B, 128 H100, FSDP2, selective AC, bs 2, eager", 5605, TITAN_H, "as above",
     ["--model", "llama3-8b", "--hardware", HBM2E, "--ranks", "128", "--batch", "2", "--seq", "8192",
      "--recompute", "selective-op"]),
    ("MPT-7B, 8 H100, FULL_SHARD, mb 6", 10643, MOSAIC, "MPT shape as GPT-2 family", MPT7 +
     ["--hardware", "h100-80gb", "--ranks", "8", "--batch", "6"]),
    ("MPT-13B, 8 H100, FULL_SHARD, mb 2", 4792, MOSAIC, "", MPT13 + ["--hardware", "h100-80gb", "--ranks", "8", "--batch", "2"]),
    ("MPT-13B, 64 H100, FULL_SHARD, mb 2", 4800, MOSAIC, "", MPT13 + ["--hardware", "h100-80gb", "--ranks", "64", "--batch", "2"]),
    ("MPT-7B, 8 A100, FULL_SHARD, mb 6, grad-acc 2", 4641, MOSAIC, COMPOSER_ACCUM,
     MPT7 + ["--hardware", "a100-80gb", "--ranks", "8", "--batch", "6", "--grad-accum", "2"] + REDUCE_EACH),
    ("MPT-13B, 8 A100, FULL_SHARD, mb 2, grad-acc 3", 2262, MOSAIC, COMPOSER_ACCUM,
     MPT13 + ["--hardware", "a100-80gb", "--ranks", "8", "--batch", "2", "--grad-accum", "3"] + REDUCE_EACH),
]


def with_nics(profile, nics, tmp, a100_nic_efficiency=None):
    """A copy of `profile` (a preset name or a JSON file) whose nodes have `nics` NICs, in `tmp`;
    on an A100 profile, at `a100_nic_efficiency` of their line rate where given."""
    path = profile if profile.endswith(".json") else os.path.join("configs", "hardware", profile + ".json")
    j = json.load(open(path))
    j["network"]["nics_per_node"] = {
        "value": nics,
        "source": "IBM fms-fsdp README: 400 Gbps a node of 8 A100s, 800 Gbps a node of 8 H100s; "
                  "NICs at the line rate of " + os.path.basename(path)}
    if a100_nic_efficiency is not None and "a100" in os.path.basename(path):
        j["network"]["nic_efficiency"] = {
            "value": a100_nic_efficiency,
            "source": "what-if (--ibm-a100-nic-efficiency): NCCL over AWS EFA, which fms-fsdp's launch scripts use"}
    out = os.path.join(tmp, "ibm-" + os.path.basename(path))
    with open(out, "w") as f:
        json.dump(j, f, indent=1)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shardlm", default="build/shardlm")
    ap.add_argument("--hardware-h100", help="a profile for the H100 rows in place of the h100-80gb preset")
    ap.add_argument("--hardware-a100", help="a profile for the A100 rows in place of the a100-80gb preset")
    ap.add_argument("--hardware-h100-hbm2e", help="a profile for the rows on torchtitan's 96 GB HBM2e H100s in place "
                    "of the h100-96gb-hbm2e preset (default: --hardware-h100's where given)")
    ap.add_argument("--ibm-a100-nic-efficiency", type=float,
                    help="a what-if: the IBM A100 rows' NICs at this fraction of their line rate "
                    "(default: the profile's; docs/CLUSTER.md, 'The IBM A100 rows' network')")
    a = ap.parse_args()
    swap = {"h100-80gb": a.hardware_h100, "a100-80gb": a.hardware_a100,
            HBM2E: a.hardware_h100_hbm2e or a.hardware_h100}
    print(f"H100 rows on {a.hardware_h100 or 'h100-80gb'}; torchtitan's HBM2e H100 rows on {swap[HBM2E] or HBM2E}; "
          f"A100 rows on {a.hardware_a100 or 'a100-80gb'}\n")
    print("| run | published tok/s/GPU | predicted | error | predicted MFU | comm exposed | source | notes |")
    print("|---|---:|---:|---:|---:|---:|---|---|")
    tmp = tempfile.mkdtemp(prefix="published_runs_")
    for label, published, source, notes, flags in RUNS:
        flags = [swap.get(f) or f for f in flags]
        if source in (IBM, IBM_0D3):
            at = flags.index("--hardware") + 1
            flags[at] = with_nics(flags[at], IBM_NICS_PER_NODE, tmp, a.ibm_a100_nic_efficiency)
        if any(f.endswith(".json") for f in flags):
            # A GPU's measured rates are per device: one compute thread, so that a simulator that
            # scales measured rates by --threads (2 by default) on any profile leaves them as measured.
            flags += ["--threads", "1"]
        cmd = [a.shardlm, "simulate", "--json"] + flags + BF16
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode != 0:
            sys.exit(f"{' '.join(cmd)}: {out.stdout}{out.stderr}")
        j = json.loads(out.stdout)
        per_gpu = j["tokens_per_s"] / j["ranks"]
        err = 100 * (per_gpu - published) / published
        exposed = 100 * j["comm_exposed_ms"] / j["step_ms"]
        print(f"| {label} | {published} | {per_gpu:.0f} | {err:+.1f}% | {100 * j['mfu']:.1f}% | {exposed:.1f}% of the step "
              f"| {source} | {notes} |")
    shutil.rmtree(tmp)


if __name__ == "__main__":
    main()
