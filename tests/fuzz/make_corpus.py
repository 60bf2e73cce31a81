#!/usr/bin/env python3
"""Writes the seed corpora tests/fuzz/corpus/<target>/ (small valid and near-valid inputs):
gguf, safetensors, checksums (SHA256SUMS text), config (config.json, "\0", then
generation_config.json), tokenizer (tokenizer.json), jinja (a template, "\0", then variables)
and openai_request (HTTP request bodies). Standard library only; rerun after changing it:

    python3 tests/fuzz/make_corpus.py

GGUF layout as in llama.cpp ggml/include/gguf.h (v2/v3, little-endian); safetensors as in
io/safetensors.hpp. The config and tokenizer seeds start from the files in tests/fixtures/
(minified). The files are deterministic, so a rerun leaves git clean.
"""
import json
import os
import struct

HERE = os.path.dirname(os.path.abspath(__file__))

# gguf value type ids
U8, I8, U16, I16, U32, I32, F32, BOOL, STR, ARR, U64, I64, F64 = range(13)
SCALAR_FMT = {U8: "<B", I8: "<b", U16: "<H", I16: "<h", U32: "<I", I32: "<i", F32: "<f",
              BOOL: "<B", U64: "<Q", I64: "<q", F64: "<d"}
# ggml type id -> (block size, block bytes)
GGML = {"F32": (0, 1, 4), "F16": (1, 1, 2), "BF16": (30, 1, 2), "Q8_0": (8, 32, 34),
        "Q4_K": (12, 256, 144), "Q6_K": (14, 256, 210)}


def gstr(s):
    b = s.encode() if isinstance(s, str) else s
    return struct.pack("<Q", len(b)) + b


def value(t, v):
    if t == STR:
        return gstr(v)
    return struct.pack(SCALAR_FMT[t], v)


def kv(key, t, v):
    if t == ARR:
        et, items = v
        body = struct.pack("<IQ", et, len(items)) + b"".join(value(et, x) for x in items)
        return gstr(key) + struct.pack("<I", ARR) + body
    return gstr(key) + struct.pack("<I", t) + value(t, v)


def gguf(kvs, tensors=(), version=3, alignment=32):
    """tensors: (name, ne, type name, data bytes)"""
    out = b"GGUF" + struct.pack("<IQQ", version, len(tensors), len(kvs)) + b"".join(kvs)
    off, infos, blobs = 0, b"", []
    for name, ne, tname, data in tensors:
        tid = GGML[tname][0]
        infos += gstr(name) + struct.pack("<I", len(ne)) + b"".join(struct.pack("<q", d) for d in ne)
        infos += struct.pack("<IQ", tid, off)
        pad = (-len(data)) % alignment
        blobs.append(data + b"\0" * pad)
        off += len(data) + pad
    out += infos
    if tensors:
        out += b"\0" * ((-len(out)) % alignment)
    return out + b"".join(blobs)


def nbytes(ne, tname):
    _, bs, bb = GGML[tname]
    n = 1
    for d in ne:
        n *= d
    return n // bs * bb


def data_for(ne, tname, seed):
    return bytes((i * 7 + seed) & 0xFF for i in range(nbytes(ne, tname)))


def byte_level_symbols():
    """GPT-2 bytes_to_unicode"""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def gguf_seeds():
    sym = byte_level_symbols()
    all_types = [
        kv("general.architecture", STR, "qwen35moe"),
        kv("t.u8", U8, 200), kv("t.i8", I8, -5), kv("t.u16", U16, 60000), kv("t.i16", I16, -300),
        kv("t.u32", U32, 7), kv("t.i32", I32, -7), kv("t.f32", F32, 1.5), kv("t.bool", BOOL, 1),
        kv("t.u64", U64, 1 << 40), kv("t.i64", I64, -(1 << 40)), kv("t.f64", F64, 0.25),
        kv("t.arr_i32", ARR, (I32, [11, 11, 10, 0])),
        kv("t.arr_str", ARR, (STR, ["a", "", "<|im_end|>"])),
        kv("t.arr_empty", ARR, (F32, [])),
    ]
    tensors = [
        ("token_embd.weight", [8, 4], "F32", data_for([8, 4], "F32", 1)),
        ("output_norm.weight", [8], "BF16", data_for([8], "BF16", 2)),
        ("blk.0.attn_q.weight", [64, 2], "Q8_0", data_for([64, 2], "Q8_0", 3)),
        ("blk.0.ffn_down_exps.weight", [256, 1, 2], "Q4_K", data_for([256, 1, 2], "Q4_K", 4)),
        ("blk.0.ffn_up_exps.weight", [256], "Q6_K", data_for([256], "Q6_K", 5)),
    ]
    seeds = {
        "empty_v3.gguf": gguf([]),
        "metadata_all_types_v2.gguf": gguf(all_types, version=2),
        "tensors.gguf": gguf(all_types[:2], tensors),
        "align64.gguf": gguf([kv("general.alignment", U32, 64)], tensors[:3], alignment=64),
    }
    # A tiny byte-level BPE tokenizer: 256 byte symbols, two merges, two special tokens.
    tokens = [sym[b] for b in range(256)] + [sym[ord("h")] + sym[ord("e")], sym[ord(" ")] + sym[ord("w")],
                                             "<|endoftext|>", "<|im_end|>", "[PAD260]"]
    types = [1] * 258 + [3, 3, 5]
    tok = [
        kv("tokenizer.ggml.model", STR, "gpt2"), kv("tokenizer.ggml.pre", STR, "qwen35"),
        kv("tokenizer.ggml.tokens", ARR, (STR, tokens)),
        kv("tokenizer.ggml.token_type", ARR, (I32, types)),
        kv("tokenizer.ggml.merges", ARR, (STR, [sym[ord("h")] + " " + sym[ord("e")],
                                                 sym[ord(" ")] + " " + sym[ord("w")]])),
        kv("tokenizer.ggml.eos_token_id", U32, 259), kv("tokenizer.ggml.add_bos_token", BOOL, 0),
    ]
    seeds["tokenizer.gguf"] = gguf(tok)
    # Near-valid inputs: one field wrong each.
    t = seeds["tensors.gguf"]
    seeds["near_truncated.gguf"] = t[: len(t) - 40]
    seeds["near_version1.gguf"] = b"GGUF" + struct.pack("<I", 1) + t[8:200]
    seeds["near_bad_type.gguf"] = gguf([], [("x", [4], "F32", b"\0" * 16)]).replace(
        struct.pack("<IQ", 0, 0), struct.pack("<IQ", 99, 0), 1)
    seeds["near_nested_array.gguf"] = gguf([gstr("x") + struct.pack("<IIQ", ARR, ARR, 0)])
    seeds["near_huge_count.gguf"] = gguf([gstr("x") + struct.pack("<IIQ", ARR, U32, 1 << 60)])
    seeds["near_tokenizer_pre.gguf"] = gguf(tok).replace(b"qwen35", b"qwen99")
    return seeds


def safetensors(entries, metadata=None, pad_to=8):
    """entries: (name, dtype, shape, data bytes)"""
    header, off, blob = {}, 0, b""
    for name, dtype, shape, data in entries:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [off, off + len(data)]}
        off += len(data)
        blob += data
    if metadata:
        header["__metadata__"] = metadata
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * ((-len(text)) % pad_to)
    return struct.pack("<Q", len(text)) + text + blob


def safetensors_seeds():
    f32 = struct.pack("<6f", 1, -2, 0.5, 3, 4, -1)
    bf16 = bytes([0x80, 0x3F, 0x00, 0xC0, 0x00, 0x3F, 0x40, 0x40])
    seeds = {
        "empty_header.safetensors": safetensors([]),
        "tensors.safetensors": safetensors(
            [("a", "F32", [2, 3], f32), ("b", "BF16", [4], bf16), ("c", "F16", [2], bf16[:4]),
             ("ids", "I64", [1], struct.pack("<q", 7)), ("u", "U8", [3], b"\x01\x02\x03"),
             ("scalar", "F32", [], f32[:4]), ("empty", "F32", [0, 4], b"")],
            metadata={"format": "pt"}),
        "rank5.safetensors": safetensors([("conv", "BF16", [1, 1, 1, 2, 2], bf16)]),
        "fp8.safetensors": safetensors([("w", "F8_E4M3", [2, 2], b"\x38\x40\xb8\x00")]),
    }
    t = seeds["tensors.safetensors"]
    seeds["near_truncated.safetensors"] = t[: len(t) - 5]
    seeds["near_overlap.safetensors"] = safetensors([("a", "F32", [2], f32[:8]), ("b", "F32", [2], f32[:8])]).replace(
        b'"data_offsets":[8,16]', b'"data_offsets":[4,12]')
    seeds["near_bad_dtype.safetensors"] = t.replace(b'"BF16"', b'"Q4KK"')
    seeds["near_shape_mismatch.safetensors"] = t.replace(b'"shape":[2,3]', b'"shape":[3,3]')
    seeds["nano_qwen3_moe.safetensors"] = nano_qwen3_moe()
    return seeds


def nano_qwen3_moe():
    """Weights for safetensors_fuzz.cpp's kNanoConfig: a checkpoint the binder accepts."""
    d, heads, kv, hd, experts, ff, vocab = 8, 2, 1, 4, 2, 4, 16
    shapes = {"model.embed_tokens.weight": [vocab, d], "model.norm.weight": [d],
              "lm_head.weight": [vocab, d]}
    L = "model.layers.0."
    shapes.update({L + "input_layernorm.weight": [d], L + "post_attention_layernorm.weight": [d],
                   L + "self_attn.q_proj.weight": [heads * hd, d], L + "self_attn.k_proj.weight": [kv * hd, d],
                   L + "self_attn.v_proj.weight": [kv * hd, d], L + "self_attn.o_proj.weight": [d, heads * hd],
                   L + "self_attn.q_norm.weight": [hd], L + "self_attn.k_norm.weight": [hd],
                   L + "mlp.gate.weight": [experts, d]})
    for e in range(experts):
        E = f"{L}mlp.experts.{e}."
        shapes.update({E + "gate_proj.weight": [ff, d], E + "up_proj.weight": [ff, d],
                       E + "down_proj.weight": [d, ff]})
    entries = []
    for i, (name, shape) in enumerate(sorted(shapes.items())):
        n = 1
        for s in shape:
            n *= s
        values = [((i * 7 + k * 3) % 11 - 5) / 8 for k in range(n)]  # small, varied, exact in bf16
        entries.append((name, "BF16", shape, b"".join(struct.pack("<f", v)[2:] for v in values)))
    return safetensors(entries)


ABC = "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"  # SHA-256("abc")


def checksums_seeds():
    gnu = f"{ABC}  model-00001-of-00002.safetensors\n{ABC} *config.json\n"
    return {
        "gnu.txt": gnu.encode(),
        "gnu_crlf.txt": gnu.replace("\n", "\r\n").encode(),
        "tag.txt": f"SHA256 (sub/dir/tokenizer.json) = {ABC.upper()}\n\n".encode(),
        "duplicate_same.txt": f"{ABC}  a.bin\n{ABC}  ./a.bin\n".encode(),
        "near_duplicate.txt": f"{ABC}  a.bin\n{'0' * 64}  a.bin\n".encode(),
        "near_traversal.txt": f"{ABC}  ../../etc/passwd\n{ABC}  /etc/passwd\n".encode(),
        "near_short_digest.txt": f"{ABC[:63]}  a.bin\n".encode(),
        "near_blank.txt": b" \r\n\t\n",
    }


def minified(path):
    with open(os.path.join(HERE, "..", "fixtures", path), encoding="utf-8") as f:
        return json.dumps(json.load(f), separators=(",", ":"), ensure_ascii=False).encode()


def nested(depth):
    """JSON nested `depth` deep: a parser or an error message that recurses must not overflow."""
    return b"[" * depth + b"]" * depth


def config_seeds():
    seeds = {}
    for d in ("qwen3_moe_tiny", "qwen3_5_moe_tiny", "qwen3_5_moe_tiny_vl"):
        seeds[d + ".json"] = minified(d + "/config.json") + b"\0" + minified(d + "/generation_config.json")
    seeds["qwen3_6_35b_a3b.json"] = minified("qwen3_6_35b_a3b_config/config.json")
    seeds["defaults_qwen3_moe.json"] = b'{"model_type":"qwen3_moe"}'
    seeds["defaults_qwen3_5_moe.json"] = b'{"model_type":"qwen3_5_moe","text_config":{}}'
    seeds["near_rope_scaling.json"] = (b'{"model_type":"qwen3_moe","rope_scaling":{"type":"yarn",'
                                       b'"factor":4},"eos_token_id":[1,2]}')
    seeds["near_layer_types.json"] = (b'{"model_type":"qwen3_5_moe","num_hidden_layers":2,'
                                      b'"layer_types":["full_attention","mamba"],'
                                      b'"rope_parameters":{"mrope_section":[11,11,10]}}')
    seeds["near_nested.json"] = b'{"model_type":' + nested(5000) + b"}"
    seeds["near_nested_generation.json"] = b'{"model_type":"qwen3_moe"}\0' + nested(5000)
    return seeds


def tokenizer_seeds():
    sym = byte_level_symbols()
    vocab = {sym[b]: b for b in range(256)}
    for i, (a, b) in enumerate([("h", "e"), (" ", "w"), ("he", "l"), ("hel", "l")]):
        a = "".join(sym[ord(c)] for c in a)
        b = "".join(sym[ord(c)] for c in b)
        vocab[a + b] = 300 + i  # ids 256..299 are holes
    merges = [f"{sym[ord('h')]} {sym[ord('e')]}", [sym[ord(" ")], sym[ord("w")]],
              f"{sym[ord('h')]}{sym[ord('e')]} {sym[ord('l')]}", "#version: 0.2"]
    tok = {
        "version": "1.0",
        "added_tokens": [
            {"id": 310, "content": "<|im_end|>", "special": True},
            {"id": 311, "content": "<tool>", "special": False, "lstrip": True, "rstrip": True,
             "single_word": True, "normalized": True},
        ],
        "normalizer": {"type": "Sequence", "normalizers": [{"type": "NFC"}]},
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"String": "\n"}, "behavior": "MergedWithPrevious"},
            {"type": "Split", "pattern": {"Regex": "\\d{1,3}"}, "behavior": "Contiguous",
             "invert": True},
            {"type": "ByteLevel", "add_prefix_space": True, "use_regex": True}]},
        "post_processor": None,
        "decoder": {"type": "Sequence", "decoders": [{"type": "ByteLevel"}]},
        "model": {"type": "BPE", "dropout": None, "unk_token": sym[ord("?")], "fuse_unk": True,
                  "ignore_merges": True, "vocab": vocab, "merges": merges},
    }
    dump = lambda t: json.dumps(t, separators=(",", ":"), ensure_ascii=False).encode()
    seeds = {
        "qwen_fixture.json": minified("tokenizer/tokenizer.json"),
        "byte_level_no_merges.json": minified("qwen3_moe_tiny/tokenizer.json"),
        "variants.json": dump(tok),
    }
    bad = json.loads(dump(tok))
    bad["model"]["merges"].append(f"{sym[ord('x')]} {sym[ord('y')]}")
    seeds["near_merge_result_missing.json"] = dump(bad)
    bad = json.loads(dump(tok))
    bad["pre_tokenizer"]["pretokenizers"][1]["pattern"]["Regex"] = "(a+)+$("
    seeds["near_bad_regex.json"] = dump(bad)
    bad = json.loads(dump(tok))
    bad["added_tokens"][0]["id"] = 1 << 24
    seeds["near_added_id_range.json"] = dump(bad)
    seeds["near_nested.json"] = b'{"model":' + nested(5000) + b"}"
    deep = {"type": "ByteLevel"}
    for _ in range(200):
        deep = {"type": "Sequence", "pretokenizers": [deep]}
    bad = json.loads(dump(tok))
    bad["pre_tokenizer"] = deep
    seeds["near_deep_sequence.json"] = dump(bad)
    return seeds


def jinja_seeds():
    """Templates, optionally followed by NUL and the variables as JSON (jinja_fuzz.cpp): the
    chat templates and the engine's cases from tests/fixtures/chat_templates/."""
    d = os.path.join(HERE, "..", "fixtures", "chat_templates")
    seeds = {}
    for fn in sorted(os.listdir(d)):
        with open(os.path.join(d, fn), encoding="utf-8") as f:
            fixture = json.load(f)
        if fn == "jinja_cases.json":
            cases = fixture["cases"]
            variables = {}
            for c in cases:
                for k, v in c["variables"].items():
                    variables.setdefault(k, v)
            tail = b"\0" + json.dumps(variables).encode()
            for kind in ("expected", "error"):  # in pieces that fit scripts/fuzz's max_len
                chunk, n = [], 0
                for c in [c for c in cases if kind in c] + [None]:
                    if c is None or (chunk and len("\n".join(chunk + [c["template"]])) + len(tail) > 12000):
                        seeds[f"cases_{kind}_{n}.jinja"] = "\n".join(chunk).encode() + tail
                        chunk, n = [], n + 1
                    if c is not None:
                        chunk.append(c["template"])
        else:
            seeds[fn.replace(".json", ".jinja")] = fixture["template"]["source"].encode()
    seeds["near_unclosed.jinja"] = b"{% for m in messages %}{{ m.content | trim"
    seeds["near_deep.jinja"] = b"{{ " + b"(" * 120 + b"1" + b")" * 120 + b" }}"
    seeds["near_recursion.jinja"] = b"{% macro f(n) %}{{ f(n ~ 'x') }}{% endmacro %}{{ f('') }}"
    return seeds


def openai_request_seeds():
    """HTTP request bodies of /v1/completions, /v1/chat/completions and /generate."""
    hi = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    bodies = {
        "completion.json": {"model": "micro", "prompt": "It was a truth", "max_tokens": 8, "temperature": 0.7,
                            "top_p": 0.9, "seed": 1, "stop": ["\n", "."], "n": 2, "logprobs": 3},
        "completion_ids.json": {"prompt": [[4094, 10, 20]], "stream": True,
                                "stream_options": {"include_usage": True}, "ignore_eos": True,
                                "stop_token_ids": [4095], "cache_salt": "a", "priority": -1},
        "chat.json": {"model": "micro", "messages": hi, "max_completion_tokens": 16, "logprobs": True,
                      "top_logprobs": 2, "top_k": 5, "min_p": 0.1, "repetition_penalty": 1.1,
                      "frequency_penalty": 0.5, "presence_penalty": -0.5, "user": "u",
                      "response_format": {"type": "text"}, "chat_template_kwargs": {"enable_thinking": False}},
        "chat_parts.json": {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                      {"type": "text", "text": "b"}]}],
                            "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
                            "tool_choice": "none", "add_generation_prompt": False},
        "generate.json": {"prompt": "Once", "max_tokens": 4, "temperature": 0, "stop": "x"},
        "near_refused.json": {"prompt": "x", "echo": True, "best_of": 3, "logit_bias": {"1": 2}},
        "near_tools.json": {"messages": hi, "tools": [{"type": "function"}], "tool_choice": "required"},
        "near_ranges.json": {"prompt": [4096, -1], "temperature": 3, "top_p": 0, "n": 99, "max_tokens": 0},
    }
    seeds = {name: json.dumps(b, separators=(",", ":")).encode() for name, b in bodies.items()}
    seeds["near_nested.json"] = b'{"messages":' + nested(5000) + b"}"
    seeds["near_content.json"] = (b'{"messages":[{"role":"user","content":[{"type":"image_url"}]},'
                                  b'{"role":"assistant","content":null}]}')
    return seeds


def main():
    for sub, seeds in (("gguf", gguf_seeds()), ("safetensors", safetensors_seeds()),
                       ("checksums", checksums_seeds()), ("config", config_seeds()),
                       ("tokenizer", tokenizer_seeds()), ("jinja", jinja_seeds()),
                       ("openai_request", openai_request_seeds())):
        d = os.path.join(HERE, "corpus", sub)
        os.makedirs(d, exist_ok=True)
        for fn in os.listdir(d):
            os.remove(os.path.join(d, fn))
        for name, data in sorted(seeds.items()):
            with open(os.path.join(d, name), "wb") as f:
                f.write(data)
        print(f"{d}: {len(seeds)} files, {sum(map(len, seeds.values()))} bytes")


if __name__ == "__main__":
    main()
