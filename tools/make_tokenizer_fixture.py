#!/usr/bin/env python3
"""Train a tiny Qwen3.5-style byte-level BPE tokenizer and write tokenizer test fixtures.

    tools/.venv/bin/python tools/make_tokenizer_fixture.py [--out tests/fixtures/tokenizer]

Writes
  tokenizer.json   Qwen3.5/3.6 pipeline (see tools/qwen_tokenizer.py): NFC, Split(QWEN35_PATTERN,
                   isolated) + ByteLevel(no prefix space, no regex), BPE without byte fallback,
                   special tokens <|endoftext|> <|im_start|> <|im_end|> appended after the BPE vocab.
                   Trained on tools/tokenizer_corpus.txt (written for this project, CC0).
  encodings.json   [{"name", "text", "ids", "tokens", "pieces", "decoded", "roundtrip_nfc"}, ...]:
                   ids = tokenizer.encode(text, add_special_tokens=False).ids (no BOS/EOS is ever
                   added by this pipeline); decoded = decode(ids) == NFC(text).
  meta.json        versions, the split pattern and its source, special token ids, field meanings.
"""
import argparse
import json
import os
import platform
import re
import unicodedata

import tokenizers

import qwen_tokenizer as qt

HERE = os.path.dirname(os.path.abspath(__file__))
VOCAB_SIZE = 1024  # byte symbols + merges; the 3 special tokens come on top (ids 1024..1026)

CASES = [
    ("empty", ""),
    ("english", "The quick brown fox jumps over the lazy dog."),
    ("english_unseen_words", "Zymurgy and quixotic juxtapositions baffle xylophonists."),
    ("contractions", "It's, they're, we've, I'm, you'll, he'd, don't, can't -- IT'S LOUD, They'Re, WE'VE."),
    ("contractions_edge", "'s at start, O'Neil, rock'n'roll, 'S'T'RE'VE'M'LL'D, it\u2019s (curly)"),
    ("chinese", "你好，世界！今天的天气很好，我们去公园散步吧。"),
    ("chinese_english_mixed", "Qwen模型支持中文和English混合输入，例如GPT-4和BERT。"),
    ("japanese_korean", "こんにちは世界 カタカナ 안녕하세요 세계"),
    ("arabic", "مرحبا بالعالم"),
    ("devanagari_marks", "नमस्ते दुनिया"),  # combining vowel signs / virama: \p{M} (Qwen3.5 vs Qwen2 differ)
    ("thai_marks", "ภาษาไทยง่ายนิดเดียว"),
    ("python_code",
     "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n\n\nprint(fib(10))\n"),
    ("cpp_code_tabs",
     "int main() {\n\tfor (int i = 0; i < 10; ++i) {\n\t\tprintf(\"%d\\n\", i);\n\t}\n\treturn 0;\n}\n"),
    ("json", "{\"name\": \"tiny\", \"layers\": [1, 2, 3], \"ok\": true, \"x\": null}"),
    ("emoji", "I love 🍕 and 🐍! 👍"),
    ("emoji_zwj_modifiers", "👍🏽 👨‍👩‍👧‍👦 🏳️‍🌈 ❤️ 🧑🏿‍💻 🇨🇳🇺🇸🇩🇪"),
    ("whitespace_runs", "a  b   c    d\n\n\ne\t\tf \r\n g   \n   h\t \n"),
    ("leading_trailing_spaces", "   leading and trailing   "),
    ("only_spaces", "     "),
    ("only_newlines", "\n\n\n"),
    ("crlf_cr", "line1\r\nline2\rline3\n\r\n"),
    ("numbers", "In 2024, 3.14159 * 1000000 = 3141590.0; +1-555-0100; 1,234,567; 0x1F; 1e-6"),
    ("digits_letters", "abc123def 4x4 H2O v1.2.3 COVID-19 ١٢٣ ①②"),
    ("punctuation", "Wait... what?!?! (yes) [no] {maybe} <tag/> -- 'single' \"double\" \u00ab\u00bb \u2014 \u2026"),
    ("url_path", "https://example.com/a/b?q=1&r=2#frag C:\\Users\\me\\file.txt ~/.config/x"),
    ("mixed_case", "HeLLo WoRLD, iPhone McDonald's ÉCOLE straße İstanbul ǅemal"),
    ("nfd_accents", "cafe\u0301 Ame\u0301lie man\u0303ana Tie\u0302\u0301ng Vie\u0323\u0302t na\u0308ive"),
    ("nfd_hangul_jamo", "\u1100\u1161\u11a8 \u1112\u1161\u11ab\u1100\u1173\u11af"),
    ("nfc_singletons", "\u2126 \u212b \u0958"),  # OHM -> Omega, ANGSTROM -> A-ring, DEVANAGARI QA -> KA+NUKTA
    ("combining_not_composable", "x\u0301 q\u0323\u0301 \u0301alone a\u20dd"),
    ("fullwidth_not_nfkc", "ＡＢＣ１２３！ ｶﾀｶﾅ ﬁ ²"),  # NFC leaves these (NFKC would not)
    ("unicode_spaces", "a\u00a0b\u3000c\u2009d\u200be\u2028f"),
    ("math_symbols", "∑ᵢ xᵢ² ≤ ∞ — α+β=γ, ∀x∈ℝ: x²≥0"),
    ("special_tokens_chat",
     "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nHi! 你好<|im_end|>\n"
     "<|im_start|>assistant\n"),
    ("special_tokens_glued", "abc<|endoftext|>def<|im_end|><|im_start|> x <|endoftext|>"),
    ("special_tokens_fake", "<|im_start <|unknown|> <|endoftext| <im_end> |<|im_end|>|"),
    ("long_word", "Pneumonoultramicroscopicsilicovolcanoconiosis supercalifragilisticexpialidocious"),
    ("control_chars", "tab\there\x0bvt\x0cff\x1b[0m\x7fdel"),
]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(HERE, "..", "tests", "fixtures", "tokenizer"))
    args = ap.parse_args()
    out_dir = os.path.abspath(args.out)
    os.makedirs(out_dir, exist_ok=True)

    corpus = open(os.path.join(HERE, "tokenizer_corpus.txt"), encoding="utf-8").read()
    corpus = "\n".join(l for l in corpus.split("\n") if not l.startswith("# "))
    # paragraphs, keeping the blank-line separators so that newline / indentation merges are learned
    blocks = [b for b in re.split(r"(?<=\n\n)(?=\S)", corpus) if b]
    tok = qt.train_tokenizer(blocks, vocab_size=VOCAB_SIZE, min_frequency=2)
    tok.save(os.path.join(out_dir, "tokenizer.json"))

    # reload from disk: the fixture must be produced by the file we ship
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(os.path.join(out_dir, "tokenizer.json"))
    special_ids = {t: tok.token_to_id(t) for t in qt.SPECIAL_TOKENS}

    cases = []
    all_ok = True
    for name, text in CASES:
        enc = tok.encode(text, add_special_tokens=False)
        decoded = tok.decode(enc.ids, skip_special_tokens=False)
        ok = decoded == unicodedata.normalize("NFC", text)
        all_ok &= ok
        pieces = qt.split_pieces(text)
        # the pieces re-joined are NFC(text)
        assert "".join(pieces) == unicodedata.normalize("NFC", text)
        cases.append({
            "name": name,
            "text": text,
            "ids": enc.ids,
            "tokens": enc.tokens,
            "pieces": pieces,
            "decoded": decoded,
            "roundtrip_nfc": ok,
        })
    assert all_ok, [c["name"] for c in cases if not c["roundtrip_nfc"]]
    # the Qwen2 pattern gives different pieces on combining marks: keep a record that this fixture
    # distinguishes the two
    differs = [name for name, text in CASES
               if qt.split_pieces(text, pattern=qt.QWEN2_PATTERN) != qt.split_pieces(text)]

    meta = {
        "generator": "tools/make_tokenizer_fixture.py",
        "versions": {"python": platform.python_version(), "tokenizers": tokenizers.__version__},
        "split_pattern": qt.QWEN35_PATTERN,
        "split_pattern_source": ("Qwen3.5/3.6: transformers 5.x models/qwen3_5/tokenization_qwen3_5.py "
                                 "PRETOKENIZE_REGEX (= llama.cpp pre-tokenizer 'qwen35')"),
        "qwen2_qwen3_pattern_for_reference": qt.QWEN2_PATTERN,
        "cases_where_qwen2_pattern_splits_differently": differs,
        "vocab_size_total": tok.get_vocab_size(with_added_tokens=True),
        "bpe_vocab_size": tok.get_vocab_size(with_added_tokens=False),
        "special_token_ids": special_ids,
        "encode_call": "Tokenizer.encode(text, add_special_tokens=False)  (the pipeline adds no BOS/EOS anyway)",
        "decode_call": "Tokenizer.decode(ids, skip_special_tokens=False)",
        "roundtrip": "decode(encode(text)) == NFC(text) for every case: " + str(all_ok),
        "fields": {
            "ids": "expected token ids",
            "tokens": "the byte-level token strings of ids (GPT-2 byte-to-unicode alphabet)",
            "pieces": ("pre-tokenization pieces before the byte-level mapping: special tokens cut out of the raw "
                       "text first, other segments NFC-normalised then split by split_pattern"),
            "decoded": "decode(ids)",
        },
        "training": {"corpus": "tools/tokenizer_corpus.txt (written for this project, CC0)",
                     "trainer": f"tokenizers BpeTrainer(vocab_size={VOCAB_SIZE}, min_frequency=2, "
                                "initial_alphabet=ByteLevel.alphabet())"},
    }
    with open(os.path.join(out_dir, "encodings.json"), "w", encoding="utf-8") as f:
        json.dump(cases, f, ensure_ascii=False, indent=1)
        f.write("\n")
    with open(os.path.join(out_dir, "meta.json"), "w", encoding="utf-8") as f:
        json.dump(meta, f, ensure_ascii=False, indent=1)
        f.write("\n")
    print(f"{out_dir}: vocab {meta['vocab_size_total']} (bpe {meta['bpe_vocab_size']}), special {special_ids}, "
          f"{len(cases)} cases, round-trip ok={all_ok}; qwen2-vs-qwen3.5 pattern differs on {differs}")
    for fn in sorted(os.listdir(out_dir)):
        print(f"  {fn}: {os.path.getsize(os.path.join(out_dir, fn))} bytes")


if __name__ == "__main__":
    main()
