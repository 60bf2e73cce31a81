#!/usr/bin/env python3
"""Load benchmark for `qflash serve` (or any OpenAI-compatible server): streaming
/v1/completions requests from asyncio tasks over raw HTTP/1.1 (standard library only).

Scenarios, the Flash design's four dimensions plus a concurrency sweep:
  sweep     aggregate decode throughput, TTFT and ITL at 1, 4, 16, 64 concurrent streams
  baseline  one stream of ~128-token prompts: the unloaded latency
  jitter    16 streams sustained for a while: ITL percentiles and their spread between windows
  tail      16 streams where 1 request in 10 has a long prompt: the short requests' P99 ITL
            against the same load without long prompts
  prefix    a customer-service workload: one shared system prompt, short varied user turns;
            kv_shared_hit_rate and TTFT from the server's /metrics (--chat: as chat messages)
  tenants   timing isolation: each fresh prompt (--system-prompt-tokens long) sent by tenant A,
            then by tenant B (another cache_salt), then by A again; TTFT and cached tokens of each

Every request and scenario is bounded in count and time; traffic goes only to the URL given
(start the server on loopback), or to a server this script starts itself on 127.0.0.1:

  bench/serve/serve_bench.py --qflash build/cpu-release/bin/qflash --model models/qwen3_5_moe-micro \\
      --scenario all --out docs/serve_bench.json
  bench/serve/serve_bench.py --url http://127.0.0.1:8000 --scenario sweep

Writes one JSON document (--out) and prints a markdown table per scenario; --plot draws a PNG
(matplotlib, from tools/setup_venv's venv).
"""

import argparse
import asyncio
import json
import math
import os
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.parse
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
CORPUS = os.path.join(ROOT, "models", "qwen3_5_moe-micro", "validation.txt")


# ---- text for prompts ------------------------------------------------------------------

class Corpus:
    """Slices of an English text, sized in characters (about 4 per token)."""

    def __init__(self, path, seed):
        with open(path, encoding="utf-8") as f:
            self.words = f.read().split()
        self.rng = random.Random(seed)

    def text(self, approx_tokens):
        n = max(1, int(approx_tokens * 0.75))  # ~1.3 tokens per English word
        start = self.rng.randrange(0, max(1, len(self.words) - n))
        return " ".join(self.words[start:start + n])


# ---- one streaming request ---------------------------------------------------------------

async def stream_completion(url, body, api_key, timeout):
    """POSTs body to /v1/completions (/v1/chat/completions when it holds messages) with
    stream=true; returns timings and usage."""
    u = urllib.parse.urlsplit(url)
    host, port = u.hostname, u.port or 80
    payload = json.dumps(dict(body, stream=True, stream_options={"include_usage": True})).encode()
    endpoint = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    headers = [f"POST {u.path.rstrip('/')}{endpoint} HTTP/1.1", f"Host: {host}:{port}",
               "Content-Type: application/json", f"Content-Length: {len(payload)}",
               "Accept: text/event-stream", "Connection: close"]
    if api_key:
        headers.append(f"Authorization: Bearer {api_key}")
    t0 = time.perf_counter()
    reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
    try:
        writer.write(("\r\n".join(headers) + "\r\n\r\n").encode() + payload)
        await writer.drain()
        status = (await asyncio.wait_for(reader.readline(), timeout)).decode()
        if " 200 " not in status:
            rest = await asyncio.wait_for(reader.read(), timeout)
            raise RuntimeError(f"{status.strip()}: {rest[-300:].decode(errors='replace')}")
        chunked = False
        while True:  # headers
            line = (await asyncio.wait_for(reader.readline(), timeout)).decode().strip()
            if not line:
                break
            if line.lower().startswith("transfer-encoding:") and "chunked" in line.lower():
                chunked = True
        token_times, usage, buf = [], None, b""
        async for data in _body(reader, chunked, timeout):
            buf += data
            while b"\n\n" in buf:
                event, buf = buf.split(b"\n\n", 1)
                for line in event.split(b"\n"):
                    if not line.startswith(b"data:"):
                        continue
                    value = line[5:].strip()
                    if value == b"[DONE]":
                        continue
                    msg = json.loads(value)
                    if msg.get("usage"):
                        usage = msg["usage"]
                    for c in msg.get("choices", []):
                        if c.get("text") or (c.get("delta") or {}).get("content"):
                            token_times.append(time.perf_counter())
        t1 = time.perf_counter()
    finally:
        writer.close()
    return {"start": t0, "end": t1, "token_times": token_times, "usage": usage or {}}


async def _body(reader, chunked, timeout):
    if not chunked:
        while True:
            data = await asyncio.wait_for(reader.read(65536), timeout)
            if not data:
                return
            yield data
    while True:
        size_line = await asyncio.wait_for(reader.readline(), timeout)
        size = int(size_line.strip().split(b";")[0] or b"0", 16)
        if size == 0:
            return
        data = await asyncio.wait_for(reader.readexactly(size + 2), timeout)
        yield data[:-2]


# ---- statistics ----------------------------------------------------------------------------

def percentile(values, p):
    if not values:
        return float("nan")
    s = sorted(values)
    k = (len(s) - 1) * p / 100
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def summarize(results, wall):
    ttft = [r["token_times"][0] - r["start"] for r in results if r["token_times"]]
    itl = [b - a for r in results for a, b in zip(r["token_times"], r["token_times"][1:])]
    gen = sum(r["usage"].get("completion_tokens", len(r["token_times"])) for r in results)
    prompt = [r["usage"].get("prompt_tokens", 0) for r in results]
    return {
        "requests": len(results),
        "wall_s": wall,
        "output_tok_s": gen / wall if wall > 0 else 0.0,
        "mean_prompt_tokens": statistics.mean(prompt) if prompt else 0,
        "ttft_p50_ms": 1e3 * percentile(ttft, 50), "ttft_p90_ms": 1e3 * percentile(ttft, 90),
        "ttft_p99_ms": 1e3 * percentile(ttft, 99),
        "itl_p50_ms": 1e3 * percentile(itl, 50), "itl_p90_ms": 1e3 * percentile(itl, 90),
        "itl_p99_ms": 1e3 * percentile(itl, 99),
    }


# ---- load generation -------------------------------------------------------------------------

async def run_load(args, concurrency, make, n, max_seconds):
    """`concurrency` streams issue requests make(0), make(1), ... one after another until n are
    done or the time is up; returns (results, wall seconds). Each result keeps its body's _tag."""
    results, lock, issued = [], asyncio.Lock(), [0]
    deadline = time.perf_counter() + max_seconds

    async def worker():
        while True:
            async with lock:
                if issued[0] >= n or time.perf_counter() > deadline:
                    return
                i = issued[0]
                issued[0] += 1
            b = make(i)
            r = await stream_completion(args.url, strip_private(b), args.api_key, args.request_timeout)
            r["tag"] = b.get("_tag", "")
            results.append(r)

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return results, time.perf_counter() - t0


# The requests' sampling fields (--temperature, --top-p); greedy by default.
SAMPLING = {"temperature": 0}


def body(model, prompt, max_tokens, tag="", salt=None):
    b = {"model": model, "prompt": prompt, "max_tokens": max_tokens, **SAMPLING,
         "ignore_eos": True, "_tag": tag}
    if salt:
        b["cache_salt"] = salt
    return b


def strip_private(b):
    return {k: v for k, v in b.items() if not k.startswith("_")}


async def scenario_sweep(args, corpus):
    rows = []
    for c in args.concurrency:
        n = max(2 * c, args.requests)
        res, wall = await run_load(args, c, lambda i: body(args.model, corpus.text(128), args.max_tokens),
                                   n, args.max_seconds)
        rows.append(dict(concurrency=c, **summarize(res, wall)))
    one = rows[0]["output_tok_s"] if rows and rows[0]["concurrency"] == 1 else None
    for r in rows:
        r["speedup_vs_1"] = r["output_tok_s"] / one if one else None
    return rows


async def scenario_baseline(args, corpus):
    res, wall = await run_load(args, 1, lambda i: body(args.model, corpus.text(128), args.max_tokens),
                               args.requests, args.max_seconds)
    return [summarize(res, wall)]


async def scenario_jitter(args, corpus):
    res, wall = await run_load(args, 16, lambda i: body(args.model, corpus.text(128), args.max_tokens),
                               10 ** 6, args.jitter_seconds)
    s = summarize(res, wall)
    # ITL p99 per 5-second window: how much the tail moves while the load stays the same.
    windows = {}
    t0 = min(r["start"] for r in res) if res else 0
    for r in res:
        for a, b in zip(r["token_times"], r["token_times"][1:]):
            windows.setdefault(int((b - t0) // 5), []).append(b - a)
    p99s = [1e3 * percentile(v, 99) for v in windows.values() if len(v) >= 20]
    s["window_itl_p99_ms_min"] = min(p99s) if p99s else float("nan")
    s["window_itl_p99_ms_max"] = max(p99s) if p99s else float("nan")
    s["window_itl_p99_ms_stdev"] = statistics.pstdev(p99s) if len(p99s) > 1 else 0.0
    return [s]


async def scenario_tail(args, corpus):
    out = []
    for with_long in (False, True):
        def make(i, with_long=with_long):
            if with_long and i % 10 == 0:
                return body(args.model, corpus.text(args.long_prompt_tokens), args.max_tokens, "long")
            return body(args.model, corpus.text(128), args.max_tokens, "short")
        res, wall = await run_load(args, 16, make, 10 * 16, args.max_seconds)
        short = [r for r in res if r["tag"] == "short"]
        s = summarize(short, wall)
        s["long_prompts"] = with_long
        s["long_prompt_tokens"] = statistics.mean(
            [r["usage"].get("prompt_tokens", 0) for r in res if r["tag"] == "long"]) if with_long else 0
        out.append(s)
    if len(out) == 2 and out[0]["itl_p99_ms"] > 0:
        out[1]["short_itl_p99_increase"] = out[1]["itl_p99_ms"] / out[0]["itl_p99_ms"] - 1
    return out


def scrape(url, name):
    """A gauge or counter from /metrics (sum over its label sets), or None."""
    with urllib.request.urlopen(url.rstrip("/") + "/metrics", timeout=30) as r:
        text = r.read().decode()
    vals = [float(m.group(1)) for m in re.finditer(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)]
    return sum(vals) if vals else None


async def scenario_prefix(args, corpus):
    system = "You are the customer service assistant of Pemberley Goods. Be brief and polite. " + corpus.text(
        args.system_prompt_tokens)
    q0, h0 = scrape(args.url, "qflash:prefix_cache_queries_total"), scrape(args.url, "qflash:prefix_cache_hits_total")

    def make(i):
        user = corpus.text(args.user_turn_tokens)
        if args.chat:  # the server renders the chat template and marks where the system prompt ends
            b = body(args.model, None, args.max_tokens, "turn")
            del b["prompt"]
            b["messages"] = [{"role": "system", "content": system}, {"role": "user", "content": user}]
            return b
        return body(args.model, f"{system}\nCustomer: {user}\nAssistant:", args.max_tokens, "turn")
    res, wall = await run_load(args, 4, make, args.requests, args.max_seconds)
    s = summarize(res, wall)
    q1, h1 = scrape(args.url, "qflash:prefix_cache_queries_total"), scrape(args.url, "qflash:prefix_cache_hits_total")
    if None not in (q0, h0, q1, h1) and q1 > q0:
        s["kv_shared_hit_rate"] = (h1 - h0) / (q1 - q0)
    cached = [r["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0) for r in res]
    prompt = [r["usage"].get("prompt_tokens", 0) for r in res]
    s["cached_token_share"] = sum(cached) / sum(prompt) if sum(prompt) else 0.0
    s["api"] = "chat" if args.chat else "completions"
    s["system_prompt_tokens"] = args.system_prompt_tokens
    s["user_turn_tokens"] = args.user_turn_tokens
    return [s]


async def scenario_tenants(args, corpus):
    """Per trial, one fresh prompt sent three times, one request at a time: by tenant A (a miss),
    by tenant B with another cache_salt (must be a miss too, and as slow), by A again (a hit).
    Compares TTFT by kind: B's should be A's first, not A's second."""
    kinds = {"first (tenant A)": [], "other tenant (B)": [], "same tenant again (A)": []}
    cached = {k: [] for k in kinds}
    for i in range(args.requests):
        prompt = corpus.text(args.system_prompt_tokens)
        for kind, salt in zip(kinds, (f"tenant-a-{args.seed}", f"tenant-b-{args.seed}", f"tenant-a-{args.seed}")):
            r = await stream_completion(args.url, strip_private(body(args.model, prompt, 4, salt=salt)), args.api_key,
                                        args.request_timeout)
            if r["token_times"]:
                kinds[kind].append(r["token_times"][0] - r["start"])
            cached[kind].append(r["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0))
    first = statistics.median(kinds["first (tenant A)"])
    rows = []
    for kind, ttft in kinds.items():
        rows.append({"request": kind, "trials": len(ttft), "mean_cached_tokens": statistics.mean(cached[kind]),
                     "ttft_p10_ms": 1e3 * percentile(ttft, 10), "ttft_p50_ms": 1e3 * percentile(ttft, 50),
                     "ttft_p90_ms": 1e3 * percentile(ttft, 90),
                     "p50_vs_first": statistics.median(ttft) / first if first > 0 else float("nan")})
    return rows


SCENARIOS = {"sweep": scenario_sweep, "baseline": scenario_baseline, "jitter": scenario_jitter,
             "tail": scenario_tail, "prefix": scenario_prefix, "tenants": scenario_tenants}


# ---- the server, when this script starts it ---------------------------------------------------

def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args):
    port = free_port()
    cmd = [args.qflash, "serve", "--model", args.model_dir, "--host", "127.0.0.1", "--port", str(port)]
    cmd += args.server_arg
    log = open(args.server_log, "w")  # a pipe nobody reads would fill and stop the server
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 300
    while time.time() < deadline:
        if proc.poll() is not None:
            with open(args.server_log) as f:
                sys.exit(f"serve_bench: the server exited: {f.read()[-2000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return proc, f"http://127.0.0.1:{port}"
        except OSError:
            time.sleep(0.2)
    proc.kill()
    sys.exit("serve_bench: the server did not become healthy within 300 s")


def table(name, rows):
    if not rows:
        return
    keys = list(rows[0].keys())
    print(f"\n### {name}\n")
    print("| " + " | ".join(keys) + " |")
    print("|" + "---|" * len(keys))
    for r in rows:
        print("| " + " | ".join(f"{r.get(k):.4g}" if isinstance(r.get(k), float) else str(r.get(k)) for k in keys)
              + " |")


def plot(results, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    sweep = results.get("sweep", [])
    if sweep:
        c = [r["concurrency"] for r in sweep]
        axes[0].plot(c, [r["output_tok_s"] for r in sweep], "o-", label="aggregate output tok/s")
        axes[0].set_xscale("log", base=2)
        axes[0].set_xlabel("concurrent streams")
        axes[0].set_ylabel("tok/s")
        axes[0].set_ylim(bottom=0)
        axes[0].set_title("aggregate output tok/s")
        axes[1].plot(c, [r["itl_p50_ms"] for r in sweep], "o-", label="ITL p50")
        axes[1].plot(c, [r["itl_p99_ms"] for r in sweep], "o-", label="ITL p99")
        axes[1].plot(c, [r["ttft_p99_ms"] for r in sweep], "o-", label="TTFT p99")
        axes[1].set_xscale("log", base=2)
        axes[1].set_yscale("log")
        axes[1].set_xlabel("concurrent streams")
        axes[1].set_ylabel("ms")
        axes[1].set_title("latency")
        axes[1].legend()
    fig.suptitle(results.get("title", "qflash serve"))
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", help="a running server, e.g. http://127.0.0.1:8000")
    ap.add_argument("--qflash", help="the qflash binary: start `qflash serve` on 127.0.0.1 for the run")
    ap.add_argument("--model-dir", "--model-path", dest="model_dir", default=os.path.join(ROOT, "models", "qwen3_5_moe-micro"))
    ap.add_argument("--server-arg", action="append", default=[], help="an extra argument for `qflash serve` (repeatable)")
    ap.add_argument("--server-log", default="serve_bench_server.log", help="where the started server's output goes")
    ap.add_argument("--model", help="the request's model field (default: the first of the server's /v1/models)")
    ap.add_argument("--api-key", default=os.environ.get("QFLASH_API_KEY"))
    ap.add_argument("--scenario", default="all", choices=["all"] + list(SCENARIOS))
    ap.add_argument("--concurrency", default="1,4,16,64", type=lambda s: [int(x) for x in s.split(",")])
    ap.add_argument("--requests", type=int, default=32, help="requests per run (sweep: at least 2 per stream)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--long-prompt-tokens", type=int, default=700,
                    help="tail: the long prompts' size (~tokens; the embedded model's context is 1024)")
    ap.add_argument("--system-prompt-tokens", type=int, default=300)
    ap.add_argument("--user-turn-tokens", type=int, default=32)
    ap.add_argument("--chat", action="store_true",
                    help="prefix: send /v1/chat/completions with a system message (the server snapshots hybrid "
                         "models' states where it ends) instead of one /v1/completions text")
    ap.add_argument("--jitter-seconds", type=float, default=30)
    ap.add_argument("--max-seconds", type=float, default=300, help="cap per run")
    ap.add_argument("--request-timeout", type=float, default=600)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--temperature", type=float, default=0,
                    help="the requests' temperature (default 0: greedy)")
    ap.add_argument("--top-p", type=float, help="the requests' top_p (default: the server's)")
    ap.add_argument("--out", help="write the results as JSON here")
    ap.add_argument("--plot", help="write a PNG of the sweep here")
    args = ap.parse_args()
    SAMPLING["temperature"] = args.temperature
    if args.top_p is not None:
        SAMPLING["top_p"] = args.top_p
    if bool(args.url) == bool(args.qflash):
        ap.error("give exactly one of --url and --qflash")
    host = urllib.parse.urlsplit(args.url).hostname if args.url else "127.0.0.1"
    if host not in ("127.0.0.1", "localhost", "::1"):
        ap.error("this bench only sends traffic to a server on this machine (127.0.0.1, localhost, ::1)")

    proc = None
    if args.qflash:
        proc, args.url = start_server(args)
    try:
        if not args.model:
            req = urllib.request.Request(args.url.rstrip("/") + "/v1/models")
            if args.api_key:
                req.add_header("Authorization", f"Bearer {args.api_key}")
            with urllib.request.urlopen(req, timeout=30) as r:
                args.model = json.load(r)["data"][0]["id"]
        corpus = Corpus(CORPUS, args.seed)
        names = list(SCENARIOS) if args.scenario == "all" else [args.scenario]
        results = {"title": f"qflash serve, {os.path.basename(args.model_dir)}", "max_tokens": args.max_tokens}
        for name in names:
            rows = asyncio.run(SCENARIOS[name](args, corpus))
            results[name] = rows
            table(name, rows)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(results, f, indent=1)
        if args.plot:
            plot(results, args.plot)
    finally:
        if proc:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()


if __name__ == "__main__":
    main()
