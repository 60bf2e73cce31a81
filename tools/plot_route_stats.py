#!/usr/bin/env python3
"""Draw `qflash route-stats --json` output: router entropy per layer, expert load per layer under
top-k, and experts per token under each policy.

    tools/.venv/bin/python tools/plot_route_stats.py --out route_stats.png STATS.json
"""
import argparse
import json
import math

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="PNG to write")
    ap.add_argument("stats", help="qflash route-stats --json output")
    args = ap.parse_args()
    with open(args.stats, encoding="utf-8") as f:
        s = json.load(f)
    policies = s["policies"]
    top_k = policies[0]
    layers = [entry for entry in top_k["layers"] if sum(entry["expert_load"]) > 0]
    n_expert = s["n_expert"]

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.6), dpi=100)
    name = s["model"].rstrip("/").split("/")[-1]

    ax = axes[0]
    ax.bar([entry["layer"] for entry in layers], [entry["router_entropy"] for entry in layers], color="#3182bd")
    ax.axhline(math.log(n_expert), color="#e6550d", linestyle="--", linewidth=1.2,
               label=f"uniform over {n_expert} experts")
    ax.set_xlabel("layer")
    ax.set_ylabel("router entropy (nats)")
    ax.set_title("router entropy per layer (top-k)", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")

    ax = axes[1]
    load = np.array([entry["expert_load"] for entry in layers], dtype=float)
    share = load / load.sum(axis=1, keepdims=True) * n_expert  # 1 = an even share
    im = ax.imshow(share, aspect="auto", cmap="viridis", interpolation="nearest")
    ax.set_yticks(range(len(layers)), [str(entry["layer"]) for entry in layers])
    ax.set_xlabel("expert")
    ax.set_ylabel("layer")
    ax.set_title("expert load under top-k (1 = even share)", fontsize=10)
    fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04)

    ax = axes[2]
    width = max(len(p["experts_per_token_histogram"]) for p in policies)
    bar = 0.8 / len(policies)
    for i, p in enumerate(policies):
        h = np.array(p["experts_per_token_histogram"] + [0] * (width - len(p["experts_per_token_histogram"])),
                     dtype=float)
        h = h / h.sum()
        ax.bar(np.arange(width) + (i - (len(policies) - 1) / 2) * bar, h, width=bar,
               label=f"{p['routing']} (mean {p['mean_experts_per_token']:.2f}, ppl {p['perplexity']:.2f})")
    ax.set_xticks(range(1, width))
    ax.set_xlim(0.4, width - 0.4)
    ax.set_xlabel("experts per token")
    ax.set_ylabel("share of token-layers")
    ax.set_title("experts per token by routing policy", fontsize=10)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3, axis="y")

    fig.suptitle(f"{name}: {s['tokens']} tokens of {s['text'].split('/')[-1]}, top-{s['top_k']} of {n_expert}",
                 fontsize=11)
    fig.tight_layout()
    fig.savefig(args.out, metadata={"Software": None})


if __name__ == "__main__":
    main()
