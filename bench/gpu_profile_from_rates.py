#!/usr/bin/env python3
"""A measured H100 hardware profile from bench/gpu_kernel_rates.py's output: a copy of a preset
(configs/hardware/h100-80gb-datasheet.json) whose gemm_rates, attention_rates and pointwise_bw are
the measured ones, each with its source (device, software, date); its provenance says measured
(on the GPU it describes) or derived (carried from another), with the measurement's date.

  python3 bench/gpu_profile_from_rates.py rates.json --out configs/hardware/h100-80gb.json
  python3 bench/published_runs.py

How each measurement becomes the figure the simulator reads (src/sim/cost.cc, src/model/*.cc):
  gemm_rates       a row per weight GEMM the simulator counts, keyed (m, k, n) as the model's
                   UnitCosts::gemms name it; forward = 2mkn / the forward's seconds, backward =
                   2 x 2mkn / the backward's (the simulator prices a unit's backward GEMMs at twice
                   the forward FLOPs). Where the framework splits the GEMM (torchtitan's wq, wk, wv;
                   w1, w3), the seconds are those of its pieces together. threads 1 (a GPU profile).
  attention_rates  a row per (T, HS): forward = 2·B·T·T·C / seconds (the causal FLOPs the model
                   counts, C = NH·HS), backward = 2 x that / seconds; rows of equal (T, HS) from
                   several models merged as total FLOPs over total seconds.
  pointwise_bw     bytes the simulator counts for a unit's pointwise work over the seconds the
                   measured eager unit spends outside its GEMMs and attention. The simulator
                   charges a unit P / pointwise_bw forward and 2P / pointwise_bw backward, P the
                   model's pointwise_bytes at 4 bytes per element (cost.cc builds the shape with
                   elem 4 whatever the dtype), so the figure is 3P / (the block's forward+backward
                   seconds − its GEMMs' − its attention's). The head's forward+backward is one task
                   charged its pointwise bytes once (cost.cc, unit_fwd_bwd): P_head / its seconds
                   outside the vocabulary GEMM. One figure serves every unit and model:
                   --pointwise step (default) takes the measured models' whole steps (L blocks and
                   the head each, all models together: total bytes over total seconds); blocks:
                   the blocks alone; isolated: the pointwise-only graphs (no subtraction);
                   model:NAME one model's blocks (a diagnosis, not a profile to publish).
A GPU other than an H100 SXM: an H200 (the same GH100 compute at the same clocks) keeps GEMM and
attention rates as measured and scales the memory-bound figures (pointwise_bw) by the datasheet
HBM bandwidth ratio, 3.35 / 4.8 TB/s; any other GPU is refused (--force takes it as is).

--target h100-hbm2e writes the H100 that torchtitan's paper ran on (96 GB HBM2e, 2.4 TB/s, capped
at 500 W; default --name h100-96gb-hbm2e): the H100 profile with every memory-bound figure
(pointwise_bw, memory_bw) scaled by 2.4 TB/s over the measuring GPU's (memory_bw: over the SXM
preset's 3.35) and 96 GB of memory; GEMM and attention as the 700 W SXM's, an upper bound for a
500 W part (no published figure gives its clocks).

--target a100 writes an A100 profile from the same measurement instead (default --base
configs/hardware/a100-80gb-datasheet.json, --name a100-80gb): only pointwise_bw carries over,
scaled by the datasheet HBM ratio (A100 SXM 80 GB: 2.039 TB/s over the measuring GPU's). What it
carries is how many passes over its bytes the frameworks' eager kernels make (unfused norms,
rotary, casts, residual adds), each a memory-bound kernel at about the same fraction of its HBM
bandwidth on Ampere as on Hopper. GEMM and attention rates do not carry (another generation's
tensor cores): the preset's gemm_efficiency and attention_efficiency, with their published
sources, stay.
"""
import argparse
import copy
import json
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCHEMA = "shardlm-gpu-kernel-rates/1"
H100_SXM_HBM = 3.35e12  # NVIDIA H100 datasheet, SXM5: HBM3 3.35 TB/s
H200_HBM = 4.8e12       # NVIDIA H200 datasheet: HBM3e 4.8 TB/s
A100_SXM_HBM = 2.039e12  # NVIDIA A100 datasheet, 80 GB SXM: HBM2e 2,039 GB/s
H100_HBM2E = 2.4e12      # torchtitan paper (arXiv 2410.06511), its H100s: 96 GB HBM2e, 2.4 TB/s, 500 W
ELEM = 4                # src/sim/cost.cc: plan.unit_shape(4, ...) counts pointwise bytes at 4 per element


def gemm_flops(m, k, n):
    return 2.0 * m * k * n


def attention_flops(m):
    """src/model/{llama,gpt2}.cc: attention = 2 · BT · T · C (causal half of QK^T and AV)."""
    return 2.0 * m["B"] * m["T"] * m["T"] * m["NH"] * m["HS"]


def block_pointwise_bytes(m):
    """The block's UnitCosts::pointwise_bytes (src/model/llama.cc, gpt2.cc) at ELEM bytes."""
    BT, C, F = m["B"] * m["T"], m["C"], m["F"]
    if m["family"] == "llama":
        return (2 * 2 * BT * C + 2 * 2 * BT * C + 2 * (BT * (m["NH"] + m["NKV"]) * m["HS"]) + 3 * BT * F) * ELEM
    return (2 * 2 * BT * C + 2 * 2 * BT * C + 2 * BT * F) * ELEM


def head_pointwise_bytes(m):
    BT = m["B"] * m["T"]
    return (2 * BT * m["C"] + BT * m["V"]) * ELEM


TARGET_HBM = {"h100": H100_SXM_HBM, "h100-hbm2e": H100_HBM2E, "a100": A100_SXM_HBM}


def transfer(dev, target, force):
    """(memory-bound scale, words saying how the figures transfer to `target`): the memory-bound
    figures by the target's datasheet HBM bandwidth over the measuring GPU's (an H100 SXM or an
    H200); GEMM and attention rates carry to the H100s (the same GH100 compute), not to an A100."""
    name, sms = dev.get("name", ""), dev.get("sm_count")
    measured = f"measured on an {name} ({sms} SMs)"
    hbm = H200_HBM if "H200" in name else H100_SXM_HBM if ("H100" in name and "HBM3" in name and sms == 132) else None
    if hbm is None and force and target == "h100":
        return 1.0, measured + ", taken as an H100 SXM unchanged (--force)"
    if hbm is None:
        sys.exit(f"{name} ({sms} SMs) is neither an H100 SXM (132 SMs, HBM3) nor an H200: its figures do not transfer "
                 "(--force takes them as they are, for --target h100)")
    scale = TARGET_HBM[target] / hbm
    if scale == 1:
        return 1.0, measured
    compute = {"h100": "GEMM and attention rates as measured (the same GH100 compute)",
               "h100-hbm2e": "GEMM and attention rates as measured (the same GH100 compute, at the 700 W SXM's clocks: "
                             "torchtitan's 96 GB HBM2e parts are capped at 500 W)",
               "a100": "GEMM and attention left at the A100 preset's published efficiencies"}[target]
    return scale, (f"{measured}: {compute}, memory-bound figures x {TARGET_HBM[target] / 1e12:.4g}/{hbm / 1e12:.4g} "
                   f"(datasheet HBM of the {target} over the measuring GPU's)")


def analyse(doc):
    """Per model: rates, the pointwise residuals and what they imply."""
    out = []
    for m in doc["models"]:
        r = dict(name=m["name"], family=m["family"], framework=m.get("framework", ""), L=m["L"], B=m["B"], T=m["T"],
                 rows=[], notes=[])
        block_gemm_s = 0.0
        for g in m["gemms"]:
            f = gemm_flops(*g["key"])
            r["rows"].append(dict(key=tuple(g["key"]), role=g["role"], flops=f, fwd_s=g["forward_s"], bwd_s=g["backward_s"]))
            if g["role"] != "head":
                block_gemm_s += g["forward_s"] + g["backward_s"]
            else:
                r["head_gemm_s"] = g["forward_s"] + g["backward_s"]
        a = m["attention"]
        r["attention"] = dict(T=a["T"], HS=a["HS"], flops=attention_flops(m), fwd_s=a["forward_s"], bwd_s=a["backward_s"],
                              backend=a.get("backend", ""))
        att_s = a["forward_s"] + a["backward_s"]
        r["P"] = block_pointwise_bytes(m)
        r["block_s"] = m["block"]["fwd_bwd_s"]
        r["block_gemm_s"], r["attention_s"] = block_gemm_s, att_s
        r["residual_s"] = r["block_s"] - block_gemm_s - att_s
        r["isolated_s"] = m["pointwise"]["fwd_bwd_s"]
        if r["residual_s"] <= 0.2 * r["isolated_s"]:
            r["notes"].append(f"residual {r['residual_s'] * 1e3:.2f} ms is under a fifth of the pointwise work alone: "
                              "the isolated figure stands in")
            r["residual_s"] = r["isolated_s"]
        r["bw_residual"] = 3 * r["P"] / r["residual_s"]
        r["bw_isolated"] = 3 * r["P"] / r["isolated_s"]
        h = m.get("head", {})
        r["Ph"] = head_pointwise_bytes(m)
        if "fwd_bwd_s" in h and "head_gemm_s" in r:
            r["head_residual_s"] = h["fwd_bwd_s"] - r["head_gemm_s"]
            r["bw_head"] = r["Ph"] / r["head_residual_s"] if r["head_residual_s"] > 0 else None
        out.append(r)
    return out


def pointwise_figure(models, how):
    if how == "step":
        have = [r for r in models if r.get("bw_head")]
        b = sum(r["L"] * 3 * r["P"] + r["Ph"] for r in have)
        s = sum(r["L"] * r["residual_s"] + r["head_residual_s"] for r in have)
        return b / s, (f"every measured model's step ({', '.join(r['name'] for r in have)}: L blocks and the head each), "
                       "the bytes the simulator charges them (a block 3P, the head P) over their seconds outside GEMMs "
                       "and attention, all together")
    if how == "blocks":
        return (sum(3 * r["P"] for r in models) / sum(r["residual_s"] for r in models),
                "the measured models' blocks (one each), 3 x the counted bytes over the seconds outside GEMMs and attention")
    if how == "isolated":
        return (sum(3 * r["P"] for r in models) / sum(r["isolated_s"] for r in models),
                "the measured models' blocks' pointwise work alone (GEMM and attention outputs as leaves), 3 x the counted bytes over its seconds")
    if how.startswith("model:"):
        r = next((r for r in models if r["name"] == how[6:]), None)
        if not r:
            sys.exit(f"--pointwise {how}: no such model measured ({', '.join(r['name'] for r in models)})")
        return r["bw_residual"], f"{r['name']}'s block alone (a diagnosis: one model's figure)"
    sys.exit(f"--pointwise {how}: step, blocks, isolated or model:NAME")


def check(shardlm, profile, models, doc):
    """The simulator's own times for one block and the head of each measured model on the written
    profile (a 1-layer model, one rank, --threads 1, its trace) against this script's accounting of
    the same figures: proves the FLOP and byte formulas here are the simulator's."""
    prof = json.load(open(profile))
    pw = prof["pointwise_bw"]["value"]
    gr = {(r["m"], r["k"], r["n"]): r for r in prof["gemm_rates"]["value"]}
    ar = {(r["t"], r["hs"]): r for r in prof["attention_rates"]["value"]}
    worst = 0.0
    for r, m in zip(models, doc["models"]):
        shape = ["--n-embd", str(m["C"]), "--n-head", str(m["NH"]), "--vocab", str(m["V"])]  # as measured
        if m["family"] == "llama":
            shape += ["--model", m["name"], "--n-kv-head", str(m["NKV"]), "--ffn-dim", str(m["F"])]
        else:
            shape += ["--model", "gpt2-124m"]
        with tempfile.TemporaryDirectory() as d:
            trace = os.path.join(d, "t.json")
            cmd = [shardlm, "simulate", "--hardware", profile, "--ranks", "1", "--threads", "1", "--n-layer", "1",
                   "--max-seq", str(m["T"]), "--batch", str(m["B"]), "--seq", str(m["T"]), "--param-dtype", "bf16",
                   "--reduce-dtype", "bf16", "--trace", trace] + shape
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
            t = json.load(open(trace))
        ev = [e for e in (t["traceEvents"] if isinstance(t, dict) else t) if e.get("ph") == "X"]
        block = sum(e["dur"] for e in ev if re.match(r"(forward|backward) ", e["name"]) and "embedding" not in e["name"]) / 1e6
        head = sum(e["dur"] for e in ev if e["name"].startswith("head ")) / 1e6
        a = ar[(m["T"], m["HS"])]
        want_block = 3 * r["P"] / pw + r["attention"]["flops"] * (1 / a["forward"] + 2 / a["backward"])
        want_head = r["Ph"] / pw  # the head's forward+backward task: its pointwise bytes once
        for g in r["rows"]:
            x = gr[g["key"]]
            t_g = g["flops"] * (1 / x["forward"] + 2 / x["backward"])
            if g["role"] == "head":
                want_head += t_g
            else:
                want_block += t_g
        err = max(abs(block / want_block - 1), abs(head / want_head - 1))
        worst = max(worst, err)
        print(f"check {m['name']}: simulator block {block * 1e3:.3f} ms (here {want_block * 1e3:.3f}), "
              f"head {head * 1e3:.3f} ms (here {want_head * 1e3:.3f})")
    if worst > 1e-3:
        sys.exit(f"check: the simulator's figures differ from this script's by up to {100 * worst:.2f}%")
    print("check: the simulator prices every measured block and head as this script accounts them")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("rates", help="bench/gpu_kernel_rates.py's JSON")
    ap.add_argument("--target", choices=["h100", "h100-hbm2e", "a100"], default="h100",
                    help="the GPU the profile describes (see above)")
    ap.add_argument("--base", help="the preset to copy (default: the target's datasheet preset, "
                    "configs/hardware/{h100,a100}-80gb-datasheet.json)")
    ap.add_argument("--out", required=True, help="the profile to write")
    ap.add_argument("--name", help="default h100-80gb, h100-96gb-hbm2e, a100-80gb")
    ap.add_argument("--pointwise", default="step", help="step | blocks | isolated | model:NAME (see above)")
    ap.add_argument("--memory-bw", choices=["preset", "measured"], default="preset",
                    help="memory_bw (optimizer, gradient passes, copies): the preset's, or the measured copy")
    ap.add_argument("--clocks", choices=["sustained", "burst"], default="sustained",
                    help="sustained (default): the GEMM and attention rates scaled by the GPU's sustained over burst "
                         "rate (the sustained GEMM's last quarter over its burst median), as hours of training run; "
                         "burst: as timed")
    ap.add_argument("--force", action="store_true", help="take a GPU other than an H100 SXM or H200 as it is")
    ap.add_argument("--allow-fake", action="store_true", help="accept invented times (pipeline tests only)")
    ap.add_argument("--check", metavar="SHARDLM", help="a shardlm binary: compare its pricing of each measured block "
                    "and head on the written profile with this script's")
    a = ap.parse_args()
    a.base = a.base or os.path.join(ROOT, "configs", "hardware", f"{a.target[:4]}-80gb-datasheet.json")
    a.name = a.name or {"h100": "h100-80gb", "h100-hbm2e": "h100-96gb-hbm2e", "a100": "a100-80gb"}[a.target]
    if a.target != "h100" and a.check:
        sys.exit("--check compares measured blocks with the profile's pricing: an H100 SXM profile's (--target h100)")

    doc = json.load(open(a.rates))
    if doc.get("schema") != SCHEMA:
        sys.exit(f"{a.rates}: not {SCHEMA}")
    if (doc.get("fake") or doc.get("mode") != "cuda") and not a.allow_fake:
        sys.exit(f"{a.rates}: mode {doc.get('mode')}{' (FAKE)' if doc.get('fake') else ''}: no GPU measurement (--allow-fake for tests)")
    if not doc["models"]:
        sys.exit(f"{a.rates}: no model measured ({'; '.join(doc.get('errors', []))})")
    dev = doc["device"]
    scale, how = transfer(dev, a.target, a.force or doc.get("mode") == "cpu-smoke")
    fake = "FAKE (invented times, a pipeline test)" if doc.get("fake") else ("CPU SMOKE RUN" if doc.get("mode") != "cuda" else "")
    date = doc.get("date", "")[:10]
    sw = f"torch {dev.get('torch', '?')}, CUDA {dev.get('cuda', '?')}"
    head = (f"{fake}: " if fake else "") + f"{how}; {sw}; {date}"  # every measured figure's source starts so
    models = analyse(doc)
    for r in models:
        for n in r["notes"]:
            print(f"note: {r['name']}: {n}", file=sys.stderr)

    # gemm_rates: one row per simulator key; a key two models share merges (total FLOPs / total seconds).
    rows = {}
    for r in models:
        for g in r["rows"]:
            acc = rows.setdefault(g["key"], [0.0, 0.0, 0.0, []])
            acc[0] += g["flops"]
            acc[1] += g["fwd_s"]
            acc[2] += g["bwd_s"]
            acc[3].append(f"{r['name']} {g['role']}")
    gemm_rates = [dict(m=k[0], k=k[1], n=k[2], threads=1, forward=round(f / fs), backward=round(2 * f / bs))
                  for k, (f, fs, bs, _) in sorted(rows.items())]
    att = {}
    for r in models:
        x = r["attention"]
        acc = att.setdefault((x["T"], x["HS"]), [0.0, 0.0, 0.0])
        acc[0] += x["flops"]
        acc[1] += x["fwd_s"]
        acc[2] += x["bwd_s"]
    attention_rates = [dict(t=k[0], hs=k[1], threads=1, forward=round(f / fs), backward=round(2 * f / bs))
                       for k, (f, fs, bs) in sorted(att.items())]
    # Compute-bound kernels slow to the GPU's sustained clocks under a training run's steady power;
    # each figure above is a short burst's median. The memory-bound pointwise figure is left as is.
    clock, clock_how = 1.0, ""
    sus = doc.get("reference", {}).get("sustained_gemm")
    if a.clocks == "sustained":
        if not sus:
            sys.exit(f"{a.rates}: no sustained GEMM measured (--clocks burst to take the burst rates)")
        clock = sus["quarters_flops_per_s"][-1] / sus["burst_flops_per_s"]
        clock_how = (f"; x {clock:.3f}, the sustained rate: a {sus['m']}x{sus['k']}x{sus['n']} GEMM back to back for "
                     f"{sus['seconds']:.0f} s, its last quarter over its burst median")
        for row in gemm_rates + attention_rates:
            row["forward"], row["backward"] = round(row["forward"] * clock), round(row["backward"] * clock)
    backends = sorted({r["attention"]["backend"] for r in models})
    pw, pw_how = pointwise_figure(models, a.pointwise)
    pw *= scale

    prof = json.load(open(a.base))
    out = copy.deepcopy(prof)
    out["name"] = a.name
    measured = "pointwise_bw" if a.target == "a100" else "gemm_rates, attention_rates and pointwise_bw"
    out["description"] = (prof.get("description", "") + f"; {measured} from bench/gpu_kernel_rates.py (eager bf16): {head}")
    # Measured where the rates are the target's own (an H100 SXM measured as itself), else derived.
    same_gpu = a.target == "h100" and scale == 1 and "H100" in dev.get("name", "")
    out["provenance"] = {"source": "measured" if same_gpu else "derived", "date": date or "unknown",
                         "detail": f"{measured} measured on an {dev.get('name', '?')} by bench/gpu_kernel_rates.py"
                                   + (" at sustained clocks" if a.clocks == "sustained" and a.target != "a100" else "")
                                   + (f", memory-bound figures x {scale:.3f} (the {a.target}'s datasheet HBM over the measuring GPU's)"
                                      if scale != 1 else "")
                                   + f"; the rest as {os.path.splitext(os.path.basename(a.base))[0]}"}
    frameworks = ", ".join(f"{r['name']} ({r['framework']}, B={r['B']} T={r['T']})" for r in models)
    if a.target != "a100":
        out["gemm_rates"] = {"value": gemm_rates, "source": (
            f"{head}: the weight GEMMs of {frameworks} as bench/gpu_kernel_rates.py runs them in "
            "eager bf16 (F.linear forward; autograd backward, input and weight gradients; torchtitan's split q|k|v and "
            "gate|up GEMMs timed as its pieces together), CUDA-event medians; FLOP/s forward and backward (2x the forward's FLOPs)"
            + clock_how)}
        out["attention_rates"] = {"value": attention_rates, "source": (
            f"{head}: F.scaled_dot_product_attention, causal, {'; '.join(backends)}, bf16, at the "
            f"runs' (B, NH, T, HS); FLOP/s of 2·B·T·T·C forward and twice that backward; rows of equal (T, HS) merged"
            + clock_how)}
    out["pointwise_bw"] = {"value": round(pw), "source": (
        f"{head}: eager bf16 blocks and heads as torchtitan / fms-fsdp / llm-foundry write them "
        f"(RMSNorm via fp32, complex rotary, repeat_kv, SwiGLU or GELU, residual adds, fp32 cross-entropy); {pw_how}; "
        f"bytes as src/model counts them at 4 per element" + (f"; x {scale:.3f} for the target's HBM ({a.target})" if scale != 1 else ""))}
    if a.target == "h100-hbm2e":
        out["memory_bw"] = {"value": round(prof["memory_bw"]["value"] * H100_HBM2E / H100_SXM_HBM), "source": (
            "the h100-80gb preset's x 2.4/3.35: torchtitan paper (arXiv 2410.06511), its H100s have 2.4 TB/s HBM2e "
            "against the SXM's 3.35 (datasheet)")}
        out["device_memory"] = {"value": 96 * 1024 ** 3, "source": "torchtitan paper (arXiv 2410.06511): 96 GB HBM2e "
                                "(taken as 96 GiB)"}
    ref = doc.get("reference", {})
    if "copy" in ref:
        copy_bw = 2 * ref["copy"]["bytes_each_way"] / ref["copy"]["seconds"] * scale
        if a.memory_bw == "measured":
            out["memory_bw"] = {"value": round(copy_bw), "source": f"{head}: a 1 GiB device-to-device "
                                "copy, read + write bytes per second" + (f", x {scale:.3f}" if scale != 1 else "")}
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(out, f, indent=2)
        f.write("\n")

    # What the measurement says, model by model (stdout, markdown).
    print(f"{dev.get('name')} ({dev.get('sm_count')} SMs), {sw}, {doc.get('date')}, {doc.get('wall_s', 0):.0f} s {fake}")
    if ref:
        g = ref.get("gemm", {})
        line = []
        if g:
            line.append(f"{g['m']}^3 GEMM {2 * g['m'] * g['k'] * g['n'] / g['seconds'] / 1e12:.0f} TFLOP/s "
                        f"({2 * g['m'] * g['k'] * g['n'] / g['seconds'] / prof['peak_flops']['value']:.3f} of peak)")
        if "gemm_nt" in ref:
            g = ref["gemm_nt"]
            line.append(f"x @ w.T {2 * g['m'] * g['k'] * g['n'] / g['seconds'] / 1e12:.0f}")
        if "copy" in ref:
            line.append(f"copy {2 * ref['copy']['bytes_each_way'] / ref['copy']['seconds'] / 1e9:.0f} GB/s")
        if "sustained_gemm" in ref:
            x = ref["sustained_gemm"]
            line.append(f"{x['m']}x{x['k']}x{x['n']} GEMM sustained {x['seconds']:.0f} s: "
                        + "/".join(f"{q / 1e12:.0f}" for q in x["quarters_flops_per_s"])
                        + f" TFLOP/s by quarter, burst {x['burst_flops_per_s'] / 1e12:.0f} (last quarter / burst "
                        f"{x['quarters_flops_per_s'][-1] / x['burst_flops_per_s']:.3f})")
        if "adamw" in ref:
            x = ref["adamw"]
            line.append(f"fused AdamW {28 * x['params'] / x['seconds'] / 1e9:.0f} GB/s at 28 B/param")
        print("reference: " + ", ".join(line) + (f" (as measured; memory-bound x {scale:.3f} for the target, {a.target})" if scale != 1 else ""))
    if doc.get("errors"):
        print("errors: " + "; ".join(doc["errors"]))
    print()
    print("| model | framework | B x T | GEMMs fwd / bwd TFLOP/s | attention fwd / bwd TFLOP/s | block fwd+bwd ms | "
          "GEMMs | attention | rest | rest's bw (alone) GB/s | block at the profile | head rest, bw GB/s | "
          "L blocks + head at the profile |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in models:
        bf = sum(g["flops"] for g in r["rows"] if g["role"] != "head")
        bfs = sum(g["fwd_s"] for g in r["rows"] if g["role"] != "head")
        bbs = sum(g["bwd_s"] for g in r["rows"] if g["role"] != "head")
        x = r["attention"]
        predicted = r["block_gemm_s"] + r["attention_s"] + 3 * r["P"] / pw * scale  # at the measuring GPU's bandwidth
        head = (f"{r['head_residual_s'] * 1e3:.2f} ms, {r['bw_head'] * scale / 1e9:.0f}" if r.get("bw_head") else "n/a")
        step = "n/a"
        if r.get("bw_head"):
            measured = r["L"] * r["block_s"] + r["head_gemm_s"] + r["head_residual_s"]
            at = r["L"] * predicted + r["head_gemm_s"] + r["Ph"] / pw * scale
            step = f"{100 * (at / measured - 1):+.1f}%"
        print(f"| {r['name']} | {r['framework']} | {r['B']} x {r['T']} | {bf / bfs / 1e12:.0f} / {2 * bf / bbs / 1e12:.0f} | "
              f"{x['flops'] / x['fwd_s'] / 1e12:.0f} / {2 * x['flops'] / x['bwd_s'] / 1e12:.0f} | {r['block_s'] * 1e3:.2f} | "
              f"{r['block_gemm_s'] * 1e3:.2f} | {r['attention_s'] * 1e3:.2f} | {r['residual_s'] * 1e3:.2f} | "
              f"{r['bw_residual'] * scale / 1e9:.0f} ({r['bw_isolated'] * scale / 1e9:.0f}) | "
              f"{100 * (predicted / r['block_s'] - 1):+.1f}% | {head} | {step} |")
    print()
    print(f"pointwise_bw {pw / 1e9:.0f} GB/s ({a.pointwise}); {len(gemm_rates)} GEMM rows, {len(attention_rates)} attention rows")
    print(f"wrote {a.out}")
    if a.check:
        check(a.check, a.out, models, doc)


if __name__ == "__main__":
    main()
