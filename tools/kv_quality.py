#!/usr/bin/env python3
"""KV cache formats against quality: for each embedded model, calibrate a per-head map on one
text, then measure every KV scheme's perplexity and mean KL from bf16 KV on the model's held-out
validation.txt (another text), with its KV bytes per token. Writes a JSON of the results, a
Markdown table on standard output and a PNG of perplexity against KV bytes.

    tools/.venv/bin/python tools/kv_quality.py --qflash build/cpu-release/bin/qflash \\
        --out docs/kv_quality.json --plot docs/kv_quality.png
"""
import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
MODELS = ["qwen3_5_moe-micro", "qwen3_moe-micro"]
SCHEMES = ["f32", "bf16", "fp8_e4m3", "int8", "bf16:int6", "int8:int6", "int6"]


def run(cmd):
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed ({p.returncode}):\n{p.stderr}")
    return p.stdout


def kv_bytes(qflash, model, kv_args):
    """KV bytes per token from `qflash budget`'s table."""
    out = run([qflash, "budget", "--model", model, *kv_args, "--context", "1024", "--seqs", "1"])
    m = re.search(r"KV bytes/token\s*[:|]\s*([0-9,]+)", out) or re.search(r"([0-9,]+) bytes/token", out)
    if not m:
        sys.exit(f"no KV bytes/token in qflash budget's output:\n{out}")
    return int(m.group(1).replace(",", ""))


def perplexity(qflash, model, kv_args, text, context, threads):
    out = run([qflash, "perplexity", "--model", model, "--text", text, "--context", str(context), "-t", str(threads),
               "--kl-base", "bf16", *kv_args])
    ppl = float(re.search(r"perplexity ([0-9.]+)", out).group(1))
    kl = float(re.search(r"mean KL ([0-9.eE+-]+)", out).group(1))
    return ppl, kl


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--qflash", required=True, help="the qflash binary (a release build)")
    ap.add_argument("--calibration-text", default=os.path.join(HERE, "tokenizer_corpus.txt"))
    ap.add_argument("--budget", type=float, default=0.45, help="the map's KV bytes relative to bf16")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", required=True, help="JSON to write")
    ap.add_argument("--plot", help="PNG to write")
    args = ap.parse_args()

    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in MODELS:
            model = os.path.join(ROOT, "models", name)
            text = os.path.join(model, "validation.txt")
            kv_map = os.path.join(tmp, name + ".kv_compression_map.json")
            print(f"{name}: calibrating (budget {args.budget})", file=sys.stderr)
            run([args.qflash, "calibrate", "--model", model, "--text", args.calibration_text, "--budget",
                 str(args.budget), "--context", str(args.context), "-t", str(args.threads), "--output", kv_map])
            bf16_bytes = kv_bytes(args.qflash, model, ["--kv", "bf16"])
            rows = [(s, ["--kv", s]) for s in SCHEMES] + [(f"map {args.budget}", ["--kv-map", kv_map])]
            for label, kv_args in rows:
                ppl, kl = perplexity(args.qflash, model, kv_args, text, args.context, args.threads)
                b = kv_bytes(args.qflash, model, kv_args)
                results.append({"model": name, "kv": label, "perplexity": ppl, "mean_kl_vs_bf16": kl,
                                "kv_bytes_per_token": b, "vs_bf16_bytes": b / bf16_bytes})
                print(f"  {label}: ppl {ppl:.4f}, KL {kl:.3g}, {b} B/token", file=sys.stderr)
            with open(kv_map, encoding="utf-8") as f:
                results[-1]["map"] = json.load(f)["layers"]

    with open(args.out, "w", encoding="utf-8") as f:
        json.dump({"calibration_text": os.path.relpath(args.calibration_text, ROOT), "budget": args.budget,
                   "context": args.context, "evaluation_text": "models/<model>/validation.txt", "results": results},
                  f, indent=1)
        f.write("\n")

    print("| model | --kv | KV bytes/token | vs bf16 | perplexity | vs f32 | mean KL vs bf16 KV |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for r in results:
        base = next(x for x in results if x["model"] == r["model"] and x["kv"] == "f32")["perplexity"]
        print(f"| {r['model']} | {r['kv']} | {r['kv_bytes_per_token']} | {r['vs_bf16_bytes']:.3f} | "
              f"{r['perplexity']:.4f} | {100 * (r['perplexity'] / base - 1):+.3f}% | {r['mean_kl_vs_bf16']:.3g} |")

    if args.plot:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), dpi=100)
        for ax, name in zip(axes, MODELS):
            rs = [r for r in results if r["model"] == name and r["kv"] != "f32"]
            base = next(r for r in results if r["model"] == name and r["kv"] == "f32")["perplexity"]
            for r in rs:
                mapped = r["kv"].startswith("map")
                ax.scatter(r["vs_bf16_bytes"], 100 * (r["perplexity"] / base - 1), s=60 if mapped else 36,
                           color="#e6550d" if mapped else "#3182bd", zorder=3)
                ax.annotate(r["kv"], (r["vs_bf16_bytes"], 100 * (r["perplexity"] / base - 1)), fontsize=8,
                            xytext=(4, 4), textcoords="offset points")
            ax.axhline(0, color="gray", linewidth=0.8)
            ax.set_xlabel("KV bytes per token, relative to bf16")
            ax.set_ylabel("perplexity vs f32 KV (%)")
            ax.set_title(f"{name} (validation.txt, context {args.context})", fontsize=10)
            ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(args.plot, metadata={"Software": None})


if __name__ == "__main__":
    main()
