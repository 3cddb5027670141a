"""Published 8-GPU nccl-tests all_reduce tables against `shardlm simulate --collective`.

Prints the markdown tables of docs/CLUSTER.md ("8 GPUs in one node, all_reduce, by message
size"): each preset's prediction against the table its profile holds (intra_node.all_reduce_by_size),
against a second table of the same NVLink 4 node (ND H200 v5, a later NCCL), and each published
size predicted by the preset with that size taken out of its table (its neighbours alone): how
well the interpolation between published sizes does.

  /usr/bin/python3 bench/nccl_tables.py [--shardlm build/shardlm]
"""
import argparse
import json
import math
import subprocess
import tempfile

K = 1024
SIZES = [K << i for i in range(24)]  # the tables' 1K .. 8G rows: 2^10 .. 2^33 bytes
# busBw, GB/s, in-place (Azure/AI-benchmarking-guide). The A100 and H100 tables are the ones the
# presets hold (intra_node.all_reduce_by_size), read from them; the H200's is a second run of the
# H100's fabric that no profile holds.


def preset_table(preset):
    with open("configs/hardware/%s.json" % preset) as f:
        rows = json.load(f)["intra_node"]["all_reduce_by_size"]["value"]
    assert [r["bytes"] for r in rows] == SIZES, preset
    return [r["bus_bw"] / 1e9 for r in rows]


A100 = ("Azure_Results/ND_A100_v4_results.md (8x A100-SXM4-80GB, NCCL 2.18.5)", preset_table("a100-80gb"))
H100 = ("'Azure Results/ND_H100_v5_results.md' (8x H100 80GB HBM3, NCCL 2.18.5)", preset_table("h100-80gb"))
H200 = ("Azure_Results/ND_H200_v5_results.md (8x H200 141GB, same NVLink 4 and NVSwitch, NCCL 2.20.5)",
        [0.06, 0.12, 0.23, 0.47, 0.93, 1.84, 3.72, 7.39, 14.75, 29.38, 52.96, 88.78,
         138.44, 181.94, 240.41, 300.91, 368.11, 412.45, 432.24, 442.72, 467.58, 472.57, 477.41, 479.98])


def predicted(shardlm, hardware, sizes=SIZES):
    out = subprocess.run([shardlm, "simulate", "--collective", "all-reduce", "--ranks", "8", "--hardware", hardware,
                          "--bytes", "%d:%d" % (sizes[0], sizes[-1]), "--json"], check=True, capture_output=True, text=True)
    rows = {r["bytes"]: r["busbw_gbs"] for r in json.loads(out.stdout)["rows"]}
    return [rows[s] for s in sizes]


def left_out(shardlm, preset, i):
    """The prediction at SIZES[i] of the preset with that row taken out of its table."""
    with open("configs/hardware/%s.json" % preset) as f:
        profile = json.load(f)
    del profile["intra_node"]["all_reduce_by_size"]["value"][i]
    with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
        json.dump(profile, f)
        f.flush()
        return predicted(shardlm, f.name, [SIZES[i]])[0]


def label(s):
    return "%d GiB" % (s >> 30) if s >= 1 << 30 else "%d MiB" % (s >> 20) if s >= 1 << 20 else "%d KiB" % (s >> 10)


def err(p, q):
    return "%+.1f%%" % (100 * (p / q - 1))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shardlm", default="build/shardlm")
    args = ap.parse_args()
    a, h = predicted(args.shardlm, "a100-80gb"), predicted(args.shardlm, "h100-80gb")
    print("| size | A100 published | predicted | error | A100 left out | H100 published | predicted | error "
          "| H100 left out | H200 published | H100 predicted | error |")
    print("|---:" * 12 + "|")
    for i, s in enumerate(SIZES):
        inner = 0 < i < len(SIZES) - 1
        la = err(left_out(args.shardlm, "a100-80gb", i), A100[1][i]) if inner else "—"
        lh = err(left_out(args.shardlm, "h100-80gb", i), H100[1][i]) if inner else "—"
        print("| %s | %.2f | %.2f | %s | %s | %.2f | %.2f | %s | %s | %.2f | %.2f | %s |" % (
            label(s), A100[1][i], a[i], err(a[i], A100[1][i]), la, H100[1][i], h[i], err(h[i], H100[1][i]), lh,
            H200[1][i], h[i], err(h[i], H200[1][i])))
    print()
    for name, (src, _) in (("A100", A100), ("H100", H100), ("H200", H200)):
        print("%s: Azure/AI-benchmarking-guide %s" % (name, src))


if __name__ == "__main__":
    main()
