#!/usr/bin/env python3
"""End to end: `qflash serve` on the embedded default model, driven by the official `openai`
Python client (chat and completions, streamed and not, n=2, stop, logprobs and top_logprobs,
stream_options.include_usage, seeds, errors as the client's exception classes) and by curl (or
http.client without it) for /health, /metrics, /generate and the SSE framing; last, SIGTERM
drains a stream in progress and the server exits 0.

    tests/serve/.venv/bin/python tests/serve/openai_client_test.py QFLASH MODEL_DIR

QFLASH is the qflash program; tests/serve/setup_client_venv makes the venv. The server listens
on a free loopback port; every request has a timeout, and the server is killed at the end
whatever happened. ctest runs this as serve_openai_client (label serve).
"""
import http.client
import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import unittest

import openai

QFLASH, MODEL = sys.argv[1], sys.argv[2]
del sys.argv[1:3]  # the rest is unittest's
KEY = "sk-qflash-test"
NAME = "micro"
READY = re.compile(r"^serving (\S+) on http://127\.0\.0\.1:(\d+)$")
os.environ["NO_PROXY"] = os.environ["no_proxy"] = "127.0.0.1,localhost"  # loopback only, never a proxy

server = None  # the qflash process
port = 0
log = tempfile.TemporaryFile(mode="w+")


def start_server():
    global server, port
    env = dict(os.environ, QFLASH_API_KEY=KEY)
    server = subprocess.Popen(
        [QFLASH, "serve", "--model", MODEL, "--port", "0", "--host", "127.0.0.1", "--threads", "1",
         "--served-model-name", NAME, "--max-n", "4", "--max-tokens-limit", "256",
         "--lora", "austen=" + os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "fixtures", "lora", "austen")],
        stdout=subprocess.PIPE, stderr=log, env=env, text=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        ready, _, _ = select.select([server.stdout], [], [], 1.0)
        if ready:
            line = server.stdout.readline()
            if not line:
                break
            m = READY.match(line.rstrip("\n"))
            if m:
                assert m.group(1) == NAME, line
                port = int(m.group(2))
                return
        if server.poll() is not None:
            break
    raise RuntimeError("qflash serve did not become ready:\n" + server_log())


def server_log():
    log.seek(0)
    return log.read()[-4000:]


def stop_server():
    if server is not None and server.poll() is None:
        server.kill()
        server.wait(10)


def setUpModule():
    try:
        start_server()
    except Exception:
        stop_server()
        raise


def tearDownModule():
    stop_server()


def client(key=KEY):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, timeout=60, max_retries=0)


def raw(method, path, body=None, headers=None):
    """(status, headers with lower-case names, body) of one request: curl when installed."""
    headers = dict(headers or {})
    data = None if body is None else (body if isinstance(body, str) else json.dumps(body))
    if data is not None:
        headers.setdefault("Content-Type", "application/json")
    url = f"http://127.0.0.1:{port}{path}"
    if shutil.which("curl"):
        cmd = ["curl", "-sS", "--max-time", "60", "--noproxy", "*", "-D", "-", "-X", method, url]
        for k, v in headers.items():
            cmd += ["-H", f"{k}: {v}"]
        if data is not None:
            cmd += ["--data-binary", "@-"]
        out = subprocess.run(cmd, input=(data or "").encode(), capture_output=True, timeout=90, check=True).stdout
        head, _, content = out.decode().partition("\r\n\r\n")
        lines = head.split("\r\n")
        status = int(lines[0].split()[1])
        hdrs = {k.strip().lower(): v.strip() for k, _, v in (l.partition(":") for l in lines[1:])}
        return status, hdrs, content
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request(method, path, body=data, headers=headers)
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read().decode()
    finally:
        conn.close()


def sse_events(body):
    """The JSON of each data event of an SSE body; asserts its framing and the final [DONE]."""
    events = [e for e in body.split("\n\n") if e and not e.startswith(":")]
    assert body.endswith("data: [DONE]\n\n"), body[-200:]
    assert events[-1] == "data: [DONE]", events[-1]
    for e in events:
        assert e.startswith("data: ") and "\n" not in e, e
    return [json.loads(e[len("data: "):]) for e in events[:-1]]


HI = [{"role": "user", "content": "Who is Mr. Darcy?"}]


class OpenAIClient(unittest.TestCase):
    def test_models(self):
        self.assertEqual([m.id for m in client().models.list()], [NAME, "austen"])
        self.assertEqual(client().models.retrieve(NAME).id, NAME)

    def test_completion_greedy_and_streamed(self):
        c = client()
        a = c.completions.create(model=NAME, prompt="It was a truth", max_tokens=16, temperature=0)
        b = c.completions.create(model=NAME, prompt="It was a truth", max_tokens=16, temperature=0)
        self.assertEqual(a.object, "text_completion")
        self.assertTrue(a.id.startswith("cmpl-"))
        self.assertEqual(a.model, NAME)
        self.assertEqual(len(a.choices), 1)
        self.assertEqual(a.choices[0].text, b.choices[0].text)
        self.assertIn(a.choices[0].finish_reason, ("stop", "length"))
        u = a.usage
        self.assertEqual(u.prompt_tokens, 4)
        self.assertLessEqual(u.completion_tokens, 16)
        self.assertEqual(u.total_tokens, u.prompt_tokens + u.completion_tokens)
        self.assertIsNotNone(u.prompt_tokens_details.cached_tokens)
        chunks = list(c.completions.create(model=NAME, prompt="It was a truth", max_tokens=16, temperature=0,
                                           stream=True, stream_options={"include_usage": True}))
        self.assertEqual("".join(ch.choices[0].text for ch in chunks if ch.choices), a.choices[0].text)
        self.assertEqual(chunks[-1].choices, [])
        self.assertEqual(chunks[-1].usage.completion_tokens, u.completion_tokens)
        self.assertEqual([ch.choices[0].finish_reason for ch in chunks if ch.choices][-1], a.choices[0].finish_reason)

    def test_chat_greedy_and_streamed(self):
        c = client()
        r = c.chat.completions.create(model=NAME, messages=HI, max_tokens=24, temperature=0)
        self.assertEqual(r.object, "chat.completion")
        self.assertTrue(r.id.startswith("chatcmpl-"))
        msg = r.choices[0].message
        self.assertEqual(msg.role, "assistant")
        self.assertIsInstance(msg.content, str)
        self.assertGreater(len(msg.content), 0)
        self.assertIn(r.choices[0].finish_reason, ("stop", "length"))
        self.assertGreater(r.usage.prompt_tokens, 5)
        stream = c.chat.completions.create(model=NAME, messages=HI, max_tokens=24, temperature=0, stream=True,
                                           stream_options={"include_usage": True})
        chunks = list(stream)
        self.assertEqual(chunks[0].choices[0].delta.role, "assistant")
        self.assertEqual("".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices), msg.content)
        self.assertEqual(chunks[-1].choices, [])
        self.assertEqual(chunks[-1].usage.total_tokens, r.usage.total_tokens)
        self.assertTrue(all(ch.object == "chat.completion.chunk" for ch in chunks))

    def test_n2(self):
        r = client().completions.create(model=NAME, prompt="Elizabeth", max_tokens=12, n=2, temperature=1.0, seed=7)
        self.assertEqual(sorted(ch.index for ch in r.choices), [0, 1])
        self.assertLessEqual(r.usage.completion_tokens, 24)
        r = client().chat.completions.create(model=NAME, messages=HI, max_tokens=8, n=2, temperature=1.0, seed=7)
        self.assertEqual(sorted(ch.index for ch in r.choices), [0, 1])

    def test_stop(self):
        r = client().completions.create(model=NAME, prompt="It was a truth universally", max_tokens=64,
                                        temperature=0, stop=["e"])
        self.assertNotIn("e", r.choices[0].text)
        self.assertEqual(r.choices[0].finish_reason, "stop")
        r = client().chat.completions.create(model=NAME, messages=HI, max_tokens=64, temperature=0, stop=["e", "a"])
        self.assertNotIn("e", r.choices[0].message.content)
        self.assertNotIn("a", r.choices[0].message.content)

    def test_logprobs(self):
        r = client().completions.create(model=NAME, prompt="It was a truth", max_tokens=10, temperature=0,
                                        logprobs=2, stop=None)
        lp = r.choices[0].logprobs
        n = r.usage.completion_tokens
        self.assertEqual(len(lp.tokens), n)
        self.assertEqual(len(lp.token_logprobs), n)
        self.assertEqual(len(lp.top_logprobs), n)
        self.assertEqual(len(lp.text_offset), n)
        self.assertEqual(lp.text_offset[0], 0)
        self.assertEqual(lp.text_offset, sorted(lp.text_offset))
        self.assertTrue(all(x <= 0 for x in lp.token_logprobs))
        for tok, top in zip(lp.tokens, lp.top_logprobs):
            self.assertIn(tok, top)  # the sampled token, besides the 2 alternatives
            self.assertTrue(1 <= len(top) <= 3)
        # Greedy: the sampled token is the most likely one.
        for value, top in zip(lp.token_logprobs, lp.top_logprobs):
            self.assertAlmostEqual(value, max(top.values()), places=5)

        r = client().chat.completions.create(model=NAME, messages=HI, max_tokens=10, temperature=0, logprobs=True,
                                             top_logprobs=3)
        content = r.choices[0].logprobs.content
        self.assertEqual(len(content), r.usage.completion_tokens)
        for e in content:
            self.assertEqual(len(e.top_logprobs), 3)
            self.assertLessEqual(e.logprob, 0)
            if not e.token.startswith("bytes:"):
                self.assertEqual(bytes(e.bytes).decode(), e.token)
            self.assertAlmostEqual(e.logprob, e.top_logprobs[0].logprob, places=5)

    def test_seed(self):
        def sample(seed):
            return client().completions.create(model=NAME, prompt="She", max_tokens=24, temperature=1.0,
                                               top_p=0.95, seed=seed).choices[0].text
        self.assertEqual(sample(1234), sample(1234))
        self.assertEqual(len({sample(s) for s in (1, 2, 3, 4)}) > 1, True)

    def test_routing_per_request(self):
        c = client()

        def greedy(routing=None):
            extra = {"routing": routing} if routing else None
            return c.completions.create(model=NAME, prompt="It was a truth", max_tokens=12, temperature=0,
                                        extra_body=extra).choices[0].text
        self.assertEqual(greedy("top_k"), greedy())
        self.assertEqual(greedy("top_p=0.5"), greedy("top_p=0.5"))
        self.assertNotEqual(greedy("top_k=1"), greedy())
        with self.assertRaises(openai.BadRequestError) as e:
            greedy("top_p=1.5")
        self.assertIn("top_p must be in (0, 1]", str(e.exception))
        with self.assertRaises(openai.BadRequestError) as e:
            greedy("top_k=99")
        self.assertIn("the model has 16", str(e.exception))

    def test_lora_per_request(self):
        c = client()

        def greedy(model=NAME, extra=None):
            r = c.completions.create(model=model, prompt="Elizabeth could not but smile", max_tokens=12,
                                     temperature=0, extra_body=extra)
            return r.model, r.choices[0].text
        base = greedy()
        adapted = greedy("austen")
        self.assertEqual(adapted[0], "austen")
        self.assertNotEqual(adapted[1], base[1])
        self.assertEqual(greedy(extra={"lora": "austen"})[1], adapted[1])
        self.assertEqual(greedy()[1], base[1])
        chat = c.chat.completions.create(model="austen", messages=[{"role": "user", "content": "Hello"}],
                                         max_tokens=4, temperature=0)
        self.assertEqual(chat.model, "austen")
        with self.assertRaises(openai.NotFoundError):
            greedy("nope")
        with self.assertRaises(openai.BadRequestError) as e:
            greedy(extra={"lora": "nope"})
        self.assertIn("names no loaded adapter", str(e.exception))

    def test_errors(self):
        c = client()
        with self.assertRaises(openai.BadRequestError) as e:
            c.completions.create(model=NAME, prompt="x", temperature=5)
        self.assertEqual(e.exception.status_code, 400)
        self.assertIn("'temperature' must be a number in [0, 2], got 5", str(e.exception))
        with self.assertRaises(openai.BadRequestError) as e:
            c.chat.completions.create(model=NAME, messages=HI, extra_body={"best_of_all": 1})
        self.assertIn("unrecognized request argument 'best_of_all'", str(e.exception))
        with self.assertRaises(openai.BadRequestError) as e:
            c.chat.completions.create(model=NAME, messages=HI, tools=[
                {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}])
        self.assertIn("tool calls are not supported", str(e.exception))
        with self.assertRaises(openai.BadRequestError):
            c.completions.create(model=NAME, prompt="x", max_tokens=1000)
        with self.assertRaises(openai.NotFoundError):
            c.completions.create(model="gpt-4o", prompt="x")
        with self.assertRaises(openai.AuthenticationError) as e:
            client("sk-wrong").completions.create(model=NAME, prompt="x")
        self.assertEqual(e.exception.status_code, 401)

    def test_http_endpoints(self):
        status, _, body = raw("GET", "/health")
        self.assertEqual((status, json.loads(body)), (200, {"status": "ok"}))
        auth = {"Authorization": f"Bearer {KEY}"}
        status, _, body = raw("POST", "/generate", {"prompt": "Elizabeth", "max_tokens": 8, "temperature": 0}, auth)
        self.assertEqual(status, 200, body)
        g = json.loads(body)
        self.assertEqual(sorted(g), ["finish_reason", "flash_used", "text", "usage"])
        self.assertIsInstance(g["flash_used"], bool)
        self.assertIn(g["finish_reason"], ("stop", "length"))
        self.assertEqual(g["usage"]["total_tokens"], g["usage"]["prompt_tokens"] + g["usage"]["completion_tokens"])
        status, _, body = raw("POST", "/generate", {"prompt": "x"})
        self.assertEqual(status, 401)
        self.assertEqual(json.loads(body)["error"]["code"], "invalid_api_key")
        status, _, body = raw("POST", "/v1/completions", "{not json", auth)
        self.assertEqual(status, 400)
        self.assertEqual(json.loads(body)["error"]["type"], "invalid_request_error")

        status, hdrs, body = raw("POST", "/v1/chat/completions",
                                 {"model": NAME, "messages": HI, "max_tokens": 6, "stream": True}, auth)
        self.assertEqual(status, 200)
        self.assertEqual(hdrs["content-type"], "text/event-stream")
        events = sse_events(body)
        self.assertEqual(events[0]["choices"][0]["delta"], {"role": "assistant", "content": ""})
        self.assertIsNotNone(events[-1]["choices"][0]["finish_reason"])

        status, hdrs, body = raw("GET", "/metrics")
        self.assertEqual(status, 200)
        self.assertTrue(hdrs["content-type"].startswith("text/plain"))
        for name in ("qflash:num_requests_running", 'qflash:http_requests_total{endpoint="/generate",status="200"}',
                     'qflash:http_requests_total{endpoint="/generate",status="401"}',
                     "qflash:http_request_duration_seconds_bucket"):
            self.assertIn(name, body)

    def test_zz_sigterm_drains(self):  # last: the server exits
        auth = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        conn.request("POST", "/v1/completions", body=json.dumps(
            {"model": NAME, "prompt": "It was", "max_tokens": 256, "stream": True, "ignore_eos": True}), headers=auth)
        r = conn.getresponse()
        self.assertEqual(r.status, 200)
        first = r.readline()
        self.assertTrue(first.startswith(b"data: "), first)
        server.send_signal(signal.SIGTERM)
        body = first + r.read()  # the stream goes on to its end
        conn.close()
        events = sse_events(body.decode())
        self.assertEqual(events[-1]["choices"][0]["finish_reason"], "length")
        self.assertEqual(server.wait(60), 0, server_log())
        self.assertIn("SIGTERM: draining", server_log())


if __name__ == "__main__":
    unittest.main(verbosity=2)
