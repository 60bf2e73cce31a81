#!/usr/bin/env python3
"""Make the llama.cpp GGUF fixtures in tests/fixtures/gguf/ from the HF fixtures, with
llama.cpp's own converter and quantizer, plus the logits llama.cpp computes on each file.

    tools/.venv/bin/python tools/make_gguf_fixtures.py LLAMA_CPP_DIR [--out tests/fixtures/gguf]

LLAMA_CPP_DIR is a llama.cpp checkout at LLAMA_CPP_COMMIT (below; checked), built CPU-only
beforehand; this script builds nothing of llama.cpp and downloads nothing:

    cmake -B build -DGGML_NATIVE=OFF -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF \\
          -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DCMAKE_BUILD_TYPE=Release
    cmake --build build -j2 --target llama-quantize llama

Python: tools/.venv (tools/setup_venv) has what convert_hf_to_gguf.py needs (torch,
transformers, numpy); the checkout's gguf-py is put on the path.

What it writes (tests/fixtures/gguf/README.md explains each file; manifest.json records the
commands, hashes, tensor types and how far llama.cpp's logits are from transformers'):
  qwen3_5_moe_tiny-{F32,BF16}.gguf   convert_hf_to_gguf.py --outtype f32|bf16 --no-mtp
  qwen3_moe_tiny-{F32,BF16}.gguf     convert_hf_to_gguf.py --outtype f32|bf16
  qwen3_5_moe_256-{Q8_0,Q4_K,Q6_K}.gguf
                                     convert (f32, not kept) then llama-quantize --pure
  tokenizer-qwen35.gguf              convert_hf_to_gguf.py --vocab-only of tests/fixtures/tokenizer
  <each model>.logits.npy            [80, vocab] float32: llama.cpp's logits for every position of
                                     the fixture's reference.json prompts[2] (80 token ids), one
                                     batch, F32 KV cache, no flash attention, 1 thread

Three things a scratch conversion of these random fixtures needs, done here without editing
the llama.cpp tree (a wrapper patches the converter in memory):
  - the converter maps a tokenizer to its `tokenizer.ggml.pre` name by hashing how it encodes a
    test text, and refuses unknown hashes; the fixtures' tokenizers are made up, so the name is
    chosen from the Split regex in their tokenizer.json ("qwen35" or "qwen2");
  - transformers' Qwen tokenizer classes add a default <|endoftext|> token when there is no
    tokenizer_config.json, so the staged copy gets one that sets no special tokens;
  - the tiny models' byte-level tokenizers have no merges; gguf-py drops empty arrays, but
    llama.cpp refuses a "gpt2" vocabulary without the tokenizer.ggml.merges key, so an empty
    string array is written.
"""
import argparse
import hashlib
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
from collections import Counter

import numpy as np
from safetensors.numpy import load_file

LLAMA_CPP_COMMIT = "3f545beccee69d9975f466ec7e45fd9aacd8ba90"  # ngxson/llama.cpp mirror, b10573-14
LOGITS_PROMPT = 2  # reference.json prompts[2]: 80 tokens, crosses the 64-token DeltaNet chunk

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURES = os.path.normpath(os.path.join(HERE, "..", "tests", "fixtures"))
sys.path.insert(0, HERE)
import qwen_tokenizer  # noqa: E402

PRE_BY_PATTERN = {qwen_tokenizer.QWEN35_PATTERN: "qwen35", qwen_tokenizer.QWEN2_PATTERN: "qwen2"}

# Runs convert_hf_to_gguf.py with the three in-memory patches described above.
CONVERT_WRAPPER = r'''
import runpy, struct, sys
llama, pre = sys.argv[1], sys.argv[2]
sys.path[:0] = [llama + "/gguf-py", llama]
import gguf
import conversion.base as base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: pre
_add_to_gguf = gguf.SpecialVocab.add_to_gguf
def add_to_gguf(self, gw, quiet=False):
    _add_to_gguf(self, gw, quiet)
    if not self.merges:
        gw.add_key_value(gguf.Keys.Tokenizer.MERGES, [], gguf.GGUFValueType.ARRAY,
                         sub_type=gguf.GGUFValueType.STRING)
gguf.SpecialVocab.add_to_gguf = add_to_gguf
_pack_val = gguf.GGUFWriter._pack_val
def pack_val(self, val, vtype, add_vtype, sub_type=None):
    if vtype == gguf.GGUFValueType.ARRAY and len(val) == 0 and sub_type is not None:
        return (struct.pack("<I", vtype) if add_vtype else b"") + struct.pack("<IQ", sub_type, 0)
    return _pack_val(self, val, vtype, add_vtype, sub_type)
gguf.GGUFWriter._pack_val = pack_val
sys.argv = [llama + "/convert_hf_to_gguf.py"] + sys.argv[3:]
runpy.run_path(llama + "/convert_hf_to_gguf.py", run_name="__main__")
'''

# llama_logits MODEL OUT.npy ID...: the logits of every position of one batch, as .npy.
LOGITS_TOOL = r'''
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>
#include "llama.h"

static void quiet(ggml_log_level level, const char* text, void*) {
  if (level >= GGML_LOG_LEVEL_ERROR) std::fputs(text, stderr);
}

int main(int argc, char** argv) {
  if (argc < 4) { std::fprintf(stderr, "usage: %s MODEL OUT.npy ID...\n", argv[0]); return 2; }
  llama_log_set(quiet, nullptr);
  llama_backend_init();
  std::vector<llama_token> ids;
  for (int i = 3; i < argc; ++i) ids.push_back(std::atoi(argv[i]));
  llama_model* model = llama_model_load_from_file(argv[1], llama_model_default_params());
  if (!model) { std::fprintf(stderr, "cannot load %s\n", argv[1]); return 1; }
  auto cp = llama_context_default_params();
  cp.n_ctx = 256;
  cp.n_batch = cp.n_ubatch = 256;
  cp.n_seq_max = 1;
  cp.n_threads = cp.n_threads_batch = 1;
  cp.type_k = cp.type_v = GGML_TYPE_F32;
  cp.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_DISABLED;
  llama_context* ctx = llama_init_from_model(model, cp);
  if (!ctx) { std::fprintf(stderr, "cannot create a context\n"); return 1; }
  int const n = static_cast<int>(ids.size());
  llama_batch batch = llama_batch_init(n, 0, 1);
  for (int i = 0; i < n; ++i) {
    batch.token[i] = ids[i];
    batch.pos[i] = i;
    batch.n_seq_id[i] = 1;
    batch.seq_id[i][0] = 0;
    batch.logits[i] = 1;
  }
  batch.n_tokens = n;
  if (llama_decode(ctx, batch) != 0) { std::fprintf(stderr, "llama_decode failed\n"); return 1; }
  int const n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
  std::string dict = "{'descr': '<f4', 'fortran_order': False, 'shape': (" + std::to_string(n) +
                     ", " + std::to_string(n_vocab) + "), }";
  std::size_t const total = 10 + dict.size() + 1;
  dict.append((64 - total % 64) % 64, ' ');
  dict += '\n';
  std::FILE* f = std::fopen(argv[2], "wb");
  if (!f) { std::perror(argv[2]); return 1; }
  std::fwrite("\x93NUMPY\x01\x00", 1, 8, f);
  unsigned char const len[2] = {static_cast<unsigned char>(dict.size() & 0xFF),
                                static_cast<unsigned char>(dict.size() >> 8)};
  std::fwrite(len, 1, 2, f);
  std::fwrite(dict.data(), 1, dict.size(), f);
  for (int i = 0; i < n; ++i) std::fwrite(llama_get_logits_ith(ctx, i), sizeof(float), n_vocab, f);
  std::fclose(f);
  llama_batch_free(batch);
  llama_free(ctx);
  llama_model_free(model);
  llama_backend_free();
  return 0;
}
'''

# Transformers' Qwen tokenizer classes add <|endoftext|> (bos/eos/unk/pad) by default.
NO_SPECIAL_TOKENIZER_CONFIG = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None,
                               "eos_token": None, "unk_token": None, "pad_token": None}

MODELS = [
    # (HF fixture dir, extra converter flags, outputs: ("convert", outtype) | ("quantize", type))
    ("qwen3_5_moe_tiny", ["--no-mtp"], [("convert", "F32"), ("convert", "BF16")]),
    ("qwen3_moe_tiny", [], [("convert", "F32"), ("convert", "BF16")]),
    ("qwen3_5_moe_256", ["--no-mtp"], [("quantize", "Q8_0"), ("quantize", "Q4_K"), ("quantize", "Q6_K")]),
]


def run(cmd, **kw):
    print("+ " + " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, **kw)


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def check_llama_cpp(llama):
    try:
        head = subprocess.run(["git", "-C", llama, "rev-parse", "HEAD"], check=True, capture_output=True,
                              text=True).stdout.strip()
    except (subprocess.CalledProcessError, FileNotFoundError) as e:
        sys.exit(f"{llama}: not a git checkout of llama.cpp ({e})")
    if head != LLAMA_CPP_COMMIT:
        sys.exit(f"{llama} is at {head}; these fixtures are made with llama.cpp {LLAMA_CPP_COMMIT} "
                 f"(git -C {llama} checkout {LLAMA_CPP_COMMIT}, then rebuild)")
    for rel in ("convert_hf_to_gguf.py", "gguf-py/gguf/__init__.py", "include/llama.h",
                "build/bin/llama-quantize", "build/bin/libllama.so"):
        if not os.path.exists(os.path.join(llama, rel)):
            sys.exit(f"{llama}/{rel} is missing: build llama.cpp first (see this script's docstring)")


def pre_tokenizer_name(hf_dir):
    tok = json.load(open(os.path.join(hf_dir, "tokenizer.json")))
    pats = [p["pattern"]["Regex"] for p in tok["pre_tokenizer"]["pretokenizers"] if p["type"] == "Split"]
    if len(pats) != 1 or pats[0] not in PRE_BY_PATTERN:
        sys.exit(f"{hf_dir}/tokenizer.json: Split regex is not one of the Qwen patterns in tools/qwen_tokenizer.py")
    return PRE_BY_PATTERN[pats[0]]


def stage(hf_dir, scratch, vocab_size=None):
    """A copy of the HF dir with a tokenizer_config.json that adds no special tokens."""
    d = os.path.join(scratch, os.path.basename(hf_dir))
    shutil.copytree(hf_dir, d)
    with open(os.path.join(d, "tokenizer_config.json"), "w") as f:
        json.dump(NO_SPECIAL_TOKENIZER_CONFIG, f)
    if vocab_size is not None:
        cfg = json.load(open(os.path.join(d, "config.json")))
        cfg["vocab_size"] = vocab_size
        json.dump(cfg, open(os.path.join(d, "config.json"), "w"))
    return d


def convert(llama, wrapper, src, pre, out, flags):
    env = dict(os.environ, PYTHONPATH=os.path.join(llama, "gguf-py"))
    cmd = [sys.executable, wrapper, llama, pre, src, "--outfile", out] + flags
    run(cmd, env=env, stdout=subprocess.DEVNULL)


def import_gguf(llama):
    """The checkout's gguf-py, allowed to write empty typed arrays (as the wrapper does)."""
    sys.path.insert(0, os.path.join(llama, "gguf-py"))
    import gguf  # noqa: E402
    if not getattr(gguf.GGUFWriter, "_qflash_patched", False):
        pack_val = gguf.GGUFWriter._pack_val

        def patched(self, val, vtype, add_vtype, sub_type=None):
            if vtype == gguf.GGUFValueType.ARRAY and len(val) == 0 and sub_type is not None:
                return (struct.pack("<I", vtype) if add_vtype else b"") + struct.pack("<IQ", sub_type, 0)
            return pack_val(self, val, vtype, add_vtype, sub_type)

        gguf.GGUFWriter._pack_val = patched
        gguf.GGUFWriter._qflash_patched = True
    return gguf


def dequantized_copy(llama, src, dst):
    """`src` with every quantized tensor dequantized to F32 by gguf-py (metadata unchanged): what
    the quantized weights are exactly, for a reference that does not also round activations."""
    gguf = import_gguf(llama)
    r = gguf.GGUFReader(src)
    arch = bytes(r.fields["general.architecture"].parts[-1]).decode()
    w = gguf.GGUFWriter(dst, arch)
    for name, field in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        vtype = field.types[0]
        sub = None
        if vtype == gguf.GGUFValueType.ARRAY:  # the element type (parts: key len, key, type, elem type, ...)
            sub = gguf.GGUFValueType(int(field.parts[3][0]))
        w.add_key_value(name, field.contents(), vtype, sub_type=sub)
    for t in r.tensors:
        data = t.data
        if t.tensor_type != gguf.GGMLQuantizationType.F32:
            data = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        shape = [int(d) for d in reversed(t.shape)]  # ne reversed = numpy order
        w.add_tensor(t.name, np.ascontiguousarray(data.reshape(shape)))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def gguf_summary(llama, path):
    r = import_gguf(llama).GGUFReader(path)
    types = Counter(t.tensor_type.name for t in r.tensors)
    arch = bytes(r.fields["general.architecture"].parts[-1]).decode()
    return {"architecture": arch, "n_tensors": len(r.tensors), "tensor_types": dict(sorted(types.items())),
            "tensor_type_by_name": {t.name: t.tensor_type.name for t in r.tensors}}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("llama_cpp_dir")
    ap.add_argument("--out", default=os.path.join(FIXTURES, "gguf"))
    args = ap.parse_args()
    llama = os.path.abspath(args.llama_cpp_dir)
    out_dir = os.path.abspath(args.out)
    check_llama_cpp(llama)
    os.makedirs(out_dir, exist_ok=True)
    quantize = os.path.join(llama, "build", "bin", "llama-quantize")
    manifest = {
        "generator": "tools/make_gguf_fixtures.py",
        "llama_cpp_commit": LLAMA_CPP_COMMIT,
        "logits": {"prompt": f"reference.json prompts[{LOGITS_PROMPT}] of the HF fixture",
                   "context": "one llama_decode batch with logits for every position; n_ctx 256, "
                              "KV cache F32, flash attention off, 1 thread, CPU (GGML_NATIVE=OFF)",
                   "reference": f"max_abs_diff_vs_transformers compares with logits.{LOGITS_PROMPT} of the "
                                "HF fixture's reference.safetensors (transformers, fp32)"},
        "files": {},
    }

    with tempfile.TemporaryDirectory(prefix="qflash_gguf_") as scratch:
        wrapper = os.path.join(scratch, "convert_wrapper.py")
        with open(wrapper, "w") as f:
            f.write(CONVERT_WRAPPER)
        tool_src = os.path.join(scratch, "llama_logits.cpp")
        with open(tool_src, "w") as f:
            f.write(LOGITS_TOOL)
        tool = os.path.join(scratch, "llama_logits")
        bin_dir = os.path.join(llama, "build", "bin")
        run(["g++", "-std=c++17", "-O1", tool_src, "-I" + os.path.join(llama, "include"),
             "-I" + os.path.join(llama, "ggml", "include"), "-L" + bin_dir, "-lllama", "-lggml",
             "-lggml-base", "-Wl,-rpath," + bin_dir, "-o", tool])

        for name, flags, outputs in MODELS:
            hf = os.path.join(FIXTURES, name)
            src = stage(hf, scratch)
            pre = pre_tokenizer_name(hf)
            ref = json.load(open(os.path.join(hf, "reference.json")))
            prompt = ref["prompts"][LOGITS_PROMPT]
            want = load_file(os.path.join(hf, "reference.safetensors"))[f"logits.{LOGITS_PROMPT}"]
            f32_scratch = None
            for how, qtype in outputs:
                fn = f"{name}-{qtype}.gguf"
                path = os.path.join(out_dir, fn)
                if how == "convert":
                    cmds = [f"convert_hf_to_gguf.py tests/fixtures/{name} --outtype {qtype.lower()} "
                            + " ".join(flags)]
                    convert(llama, wrapper, src, pre, path, ["--outtype", qtype.lower()] + flags)
                else:
                    if f32_scratch is None:
                        f32_scratch = os.path.join(scratch, f"{name}-F32.gguf")
                        convert(llama, wrapper, src, pre, f32_scratch, ["--outtype", "f32"] + flags)
                    cmds = [f"convert_hf_to_gguf.py tests/fixtures/{name} --outtype f32 " + " ".join(flags),
                            f"llama-quantize --pure {name}-F32.gguf {fn} {qtype}"]
                    q = subprocess.run([quantize, "--pure", f32_scratch, path, qtype], capture_output=True, text=True)
                    print(f"+ {quantize} --pure {f32_scratch} {path} {qtype}", flush=True)
                    if q.returncode != 0:
                        sys.exit(f"llama-quantize failed:\n{q.stdout}\n{q.stderr}")
                logits = os.path.join(out_dir, f"{name}-{qtype}.logits.npy")
                run([tool, path, logits] + [str(t) for t in prompt])
                got = np.load(logits)
                assert got.shape == want.shape, (got.shape, want.shape)
                summary = gguf_summary(llama, path)
                dequant = {}
                if how == "quantize":
                    # llama.cpp's CPU matmuls round activations to q8 blocks for quantized weights;
                    # the same weights dequantized to F32 give the logits of exact weights and
                    # fp32 activations, the tighter reference for a dequantize-then-compute path.
                    deq_path = os.path.join(scratch, f"{name}-{qtype}-dequantized-F32.gguf")
                    dequantized_copy(llama, path, deq_path)
                    deq_logits = os.path.join(out_dir, f"{name}-{qtype}.dequantized_f32.logits.npy")
                    run([tool, deq_path, deq_logits] + [str(t) for t in prompt])
                    d = np.load(deq_logits)
                    dequant = {
                        "dequantized_f32_logits_file": os.path.basename(deq_logits),
                        "dequantized_f32_note": ("the same file with every quantized tensor dequantized to F32 "
                                                 "by gguf-py (gguf.quants.dequantize), metadata unchanged; logits "
                                                 "computed as above"),
                        "max_abs_diff_quantized_vs_dequantized_f32": float(np.abs(got - d).max()),
                        "max_abs_diff_dequantized_f32_vs_transformers": float(np.abs(d - want).max()),
                    }
                manifest["files"][fn] = {
                    "source": f"tests/fixtures/{name}",
                    "commands": cmds,
                    "tokenizer_ggml_pre": pre,
                    "bytes": os.path.getsize(path),
                    "sha256": sha256(path),
                    "logits_file": os.path.basename(logits),
                    "logits_shape": list(got.shape),
                    "max_abs_diff_vs_transformers": float(np.abs(got - want).max()),
                    "max_abs_logit_transformers": float(np.abs(want).max()),
                    "argmax_agreement_vs_transformers": float((got.argmax(-1) == want.argmax(-1)).mean()),
                    **dequant,
                    **summary,
                }
                print(f"{fn}: {summary['tensor_types']}, max |llama.cpp - transformers| logits "
                      f"{manifest['files'][fn]['max_abs_diff_vs_transformers']:.3g}", flush=True)

        # The tokenizer fixture (1024 BPE tokens, 768 merges, 3 special tokens) as a vocab-only file.
        tok_dir = os.path.join(scratch, "tokenizer_model")
        shutil.copytree(os.path.join(FIXTURES, "qwen3_5_moe_tiny"), tok_dir)
        shutil.copy(os.path.join(FIXTURES, "tokenizer", "tokenizer.json"), tok_dir)
        src = stage(tok_dir, os.path.join(scratch, "staged"), vocab_size=1027)
        fn = "tokenizer-qwen35.gguf"
        path = os.path.join(out_dir, fn)
        convert(llama, wrapper, src, pre_tokenizer_name(src), path, ["--vocab-only", "--no-mtp"])
        manifest["files"][fn] = {
            "source": "tests/fixtures/tokenizer/tokenizer.json (with tests/fixtures/qwen3_5_moe_tiny's config.json, "
                      "vocab_size set to 1027)",
            "commands": ["convert_hf_to_gguf.py <that dir> --vocab-only --no-mtp"],
            "tokenizer_ggml_pre": "qwen35",
            "bytes": os.path.getsize(path),
            "sha256": sha256(path),
            **{k: v for k, v in gguf_summary(llama, path).items() if k != "tensor_type_by_name"},
        }

    with open(os.path.join(out_dir, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=False)
        f.write("\n")
    total = sum(os.path.getsize(os.path.join(out_dir, f)) for f in os.listdir(out_dir))
    print(f"{out_dir}: {len(os.listdir(out_dir))} files, {total / 1e6:.1f} MB")


if __name__ == "__main__":
    main()
