#!/usr/bin/env python3
"""Plot `qflash bench --json` results: tok/s per weight format and thread count, as a PNG.

    qflash bench --synthetic qwen3_6_35b_a3b --weights q4_k -t 1,2 --json > q4_k.jsonl
    tools/.venv/bin/python tools/plot_bench.py --out bench.png bf16.jsonl q4_k.jsonl

(`qflash bench --plot FILE` runs this on its own results.) One panel per kind of test present,
decode (tgN) and prefill (ppN); one group of bars per model and format, one bar per test and
thread count, with the standard deviation as an error bar. Decode bars are labelled with their
roofline fraction (decode tok/s x bytes per token / measured read bandwidth).
"""
import argparse
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 (the backend must be chosen first)


def read_rows(paths):
    rows = []
    for path in paths:
        f = sys.stdin if path == "-" else open(path, encoding="utf-8")
        with f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    sys.exit(f"plot_bench: {path}:{n}: not a JSON line ({e})")
                missing = {"model", "format", "threads", "test", "stddev_tok_s"} - row.keys()
                if missing:
                    sys.exit(f"plot_bench: {path}:{n}: no {', '.join(sorted(missing))} (is it qflash bench --json output?)")
                rows.append(row)
    if not rows:
        sys.exit("plot_bench: no results to plot")
    return rows


def group_of(row, one_model):
    """A bar group's label: the format, after the model when the results mix models."""
    return row["format"] if one_model else f"{row['model']}\n{row['format']}"


def panel(ax, rows, key, title, one_model):
    groups = list(dict.fromkeys(group_of(r, one_model) for r in rows))
    series = list(dict.fromkeys((r["test"], r["threads"]) for r in rows))
    width = 0.8 / len(series)
    for i, (test, threads) in enumerate(series):
        xs, ys, errs, notes = [], [], [], []
        for g, group in enumerate(groups):
            for r in rows:
                if group_of(r, one_model) == group and (r["test"], r["threads"]) == (test, threads):
                    xs.append(g - 0.4 + width * (i + 0.5))
                    ys.append(r[key])
                    errs.append(r["stddev_tok_s"])
                    notes.append(r.get("roofline_fraction"))
        bars = ax.bar(xs, ys, width, yerr=errs, capsize=3, label=f"{test}, {threads} thread{'s' if threads > 1 else ''}")
        if key == "decode_tok_s":
            ax.bar_label(bars, labels=[f"{n:.2f}" if n is not None else "" for n in notes], fontsize=7, padding=2)
    ax.set_xticks(range(len(groups)), groups, fontsize=8)
    ax.set_ylabel("tok/s")
    ax.set_title(title)
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="PNG file to write")
    ap.add_argument("results", nargs="+", help="qflash bench --json output files ('-': standard input)")
    args = ap.parse_args()

    rows = read_rows(args.results)
    kinds = [(key, title) for key, title in (("decode_tok_s", "decode (label: fraction of the read-bandwidth roofline)"),
                                             ("prefill_tok_s", "prefill"))
             if any(r.get(key) is not None for r in rows)]
    fig, axes = plt.subplots(len(kinds), 1, figsize=(max(6, 1.8 * len({(r["model"], r["format"]) for r in rows}) + 3),
                                                     4 * len(kinds)), squeeze=False)
    models = list(dict.fromkeys(r["model"] for r in rows))
    one_model = len(models) == 1
    for ax, (key, title) in zip(axes[:, 0], kinds):
        panel(ax, [r for r in rows if r.get(key) is not None], key, title, one_model)
    fig.suptitle("qflash bench" + (f": {models[0]}" if one_model else ""))
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)


if __name__ == "__main__":
    main()
