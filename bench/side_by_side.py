#!/usr/bin/env python3
"""llama-bench and `qflash bench` on the same GGUF, interleaved, in one table of ratios.

    bench/side_by_side.py --llama-bench ~/llama.cpp/build --gguf model-Q4_K_M.gguf \\
        -p 512 -n 128 -t 1,2 -r 5 --rounds 3

Runs the two benches in alternating rounds (llama-bench, qflash, llama-bench, qflash, ...)
so that both see the same machine state, reads llama-bench's `-o jsonl` and qflash's `--json`
lines, and prints one markdown table: per test (ppN, tgN) and thread count the median over
rounds of each engine's mean tok/s and the ratio qflash / llama.cpp. Decode rows also show
the fraction of the read-bandwidth roofline (qflash measures the bandwidth in its rounds);
llama.cpp's fraction uses qflash's bytes per token, which is its own when qflash reads the
GGUF's tensors as stored (--weights auto, the default).

It uses the llama.cpp build you have: it never downloads or builds llama.cpp. Python 3
standard library only.
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def fail(msg):
    sys.exit(f"side_by_side: {msg}")


def int_list(text):
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a comma-separated list of integers")
    if any(v < 0 for v in values):
        raise argparse.ArgumentTypeError(f"'{text}': counts must be >= 0")
    return values


def find_llama_bench(path):
    """The llama-bench binary: PATH itself, or inside a llama.cpp build (or source) directory."""
    p = Path(path).expanduser()
    candidates = [p] if p.is_file() else [p / "bin" / "llama-bench", p / "llama-bench",
                                          p / "build" / "bin" / "llama-bench"]
    for c in candidates:
        if c.is_file() and os.access(c, os.X_OK):
            return str(c)
    fail(f"no llama-bench at '{path}' (give the binary or a llama.cpp build directory, e.g. "
         "after `cmake --build build --target llama-bench`; this script neither downloads nor builds llama.cpp)")


def find_qflash(path):
    if path:
        p = Path(path).expanduser()
        if p.is_file() and os.access(p, os.X_OK):
            return str(p)
        fail(f"--qflash: '{path}' is not an executable")
    for c in sorted(REPO.glob("build/*/bin/qflash")):
        if os.access(c, os.X_OK):
            return str(c)
    found = shutil.which("qflash")
    if found:
        return found
    fail("no qflash binary under build/*/bin/ or on PATH; build it (cmake --workflow --preset cpu-release) or pass --qflash")


def run_jsonl(cmd, what):
    """Runs cmd and returns its stdout's JSON lines; stderr passes through (progress)."""
    print(f"side_by_side: {what}: {' '.join(cmd)}", file=sys.stderr, flush=True)
    try:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
    except OSError as e:
        fail(f"cannot run {cmd[0]}: {e}")
    if proc.returncode != 0:
        fail(f"{what} failed with exit status {proc.returncode}")
    rows = []
    for line in proc.stdout.splitlines():
        line = line.strip()
        if line.startswith("{"):
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                fail(f"{what}: a line of its output is not JSON ({e}): {line[:120]}")
    if not rows:
        fail(f"{what} printed no JSON results")
    return rows


def llama_test(row):
    """('pp', 512) or ('tg', 128) for llama-bench's plain tests; None for pp+tg or depth tests."""
    n_prompt, n_gen = row.get("n_prompt", 0), row.get("n_gen", 0)
    if row.get("n_depth", 0):
        return None
    if n_prompt > 0 and n_gen == 0:
        return "pp", n_prompt
    if n_gen > 0 and n_prompt == 0:
        return "tg", n_gen
    return None


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n".join(__doc__.splitlines()[2:]))
    ap.add_argument("--llama-bench", required=True, help="llama-bench binary, or a llama.cpp build directory")
    ap.add_argument("--gguf", required=True, help="the GGUF file llama-bench runs")
    ap.add_argument("--model", help="what qflash runs: a model directory or GGUF (default: --gguf)")
    ap.add_argument("--qflash", help="the qflash binary (default: build/*/bin/qflash, then PATH)")
    ap.add_argument("--weights", default="auto", help="qflash's --weights (default: auto, the GGUF's own formats)")
    ap.add_argument("-p", "--n-prompt", type=int_list, default=[512], help="prompt lengths (default 512)")
    ap.add_argument("-n", "--n-gen", type=int_list, default=[128], help="decode lengths (default 128)")
    ap.add_argument("-t", "--threads", type=int_list, help="thread counts (default: each engine's default)")
    ap.add_argument("-r", "--repetitions", type=int, default=5, help="runs per test inside each round (default 5)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds of each engine (default 3)")
    ap.add_argument("--llama-arg", action="append", default=[], help="extra llama-bench argument (repeatable)")
    ap.add_argument("--qflash-arg", action="append", default=[], help="extra qflash bench argument (repeatable)")
    args = ap.parse_args()

    if args.repetitions < 1 or args.rounds < 1:
        fail("-r and --rounds must be >= 1")
    if args.threads is not None and 0 in args.threads:
        fail("-t: thread counts must be >= 1")
    llama_bench = find_llama_bench(args.llama_bench)
    qflash = find_qflash(args.qflash)
    gguf = Path(args.gguf)
    if not gguf.is_file():
        fail(f"--gguf: '{gguf}' is not a file")
    model = args.model or str(gguf)
    if not Path(model).exists():
        fail(f"--model: '{model}' does not exist")

    lists = ["-p", ",".join(map(str, args.n_prompt)), "-n", ",".join(map(str, args.n_gen))]
    if args.threads:
        lists += ["-t", ",".join(map(str, args.threads))]
    reps = ["-r", str(args.repetitions)]
    llama_cmd = [llama_bench, "-m", str(gguf), *lists, *reps, "-o", "jsonl", *args.llama_arg]
    qflash_cmd = [qflash, "bench", "--model", model, "--weights", args.weights, *lists, *reps, "--json",
                  *args.qflash_arg]

    llama, ours = {}, {}  # (kind, n, threads) -> [tok/s of each round]
    qflash_rows = {}      # (kind, n, threads) -> [the round's row]
    llama_info = {}
    for r in range(1, args.rounds + 1):
        for row in run_jsonl(llama_cmd, f"round {r}/{args.rounds}, llama-bench"):
            test = llama_test(row)
            if test:
                llama.setdefault((*test, row["n_threads"]), []).append(row["avg_ts"])
                llama_info = row
        for row in run_jsonl(qflash_cmd, f"round {r}/{args.rounds}, qflash"):
            kind = "pp" if row["n_prompt"] > 0 else "tg"
            key = (kind, row["n_prompt"] or row["n_gen"], row["threads"])
            ours.setdefault(key, []).append(row["prefill_tok_s"] if kind == "pp" else row["decode_tok_s"])
            qflash_rows.setdefault(key, []).append(row)

    def fmt(x, digits=2):
        return "-" if x is None else f"{x:.{digits}f}"

    print(f"llama.cpp: {llama_info.get('model_type', '?')}, build {llama_info.get('build_number', '?')} "
          f"({llama_info.get('build_commit', '?')}), {llama_info.get('cpu_info', '?')}")
    any_q = next(iter(qflash_rows.values()))[0] if qflash_rows else {}
    print(f"qflash: {any_q.get('model', '?')}, {any_q.get('format', '?')}; "
          f"medians of {args.rounds} interleaved rounds of {args.repetitions} runs each")
    print()
    print("| test | threads | llama.cpp t/s | qflash t/s | qflash / llama.cpp | read GB/s | llama.cpp roofline | qflash roofline |")
    print("| ---- | ------: | ------------: | ---------: | -----------------: | --------: | -----------------: | --------------: |")
    keys = sorted(set(llama) | set(ours), key=lambda k: (k[2], k[0] != "pp", k[1]))
    for key in keys:
        kind, n, threads = key
        lt = statistics.median(llama[key]) if key in llama else None
        qt = statistics.median(ours[key]) if key in ours else None
        ratio = qt / lt if lt and qt else None
        rows = qflash_rows.get(key, [])
        bw = statistics.median(r["bandwidth_gbs"] for r in rows) if rows else None
        bytes_per_token = rows[0]["bytes_per_token"] if rows else None
        roof_l = roof_q = None
        if kind == "tg" and bw and bytes_per_token:
            roof_q = qt * bytes_per_token / (bw * 1e9) if qt else None
            roof_l = lt * bytes_per_token / (bw * 1e9) if lt else None
        print(f"| {kind}{n} | {threads} | {fmt(lt)} | {fmt(qt)} | {fmt(ratio)} | {fmt(bw, 1)} | {fmt(roof_l)} | {fmt(roof_q)} |")


if __name__ == "__main__":
    main()
