"""Build / train byte-level BPE tokenizers with exactly the pipeline of Qwen's tokenizer.json.

Pipeline (as in Qwen2 / Qwen3 / Qwen3.5 / Qwen3.6 tokenizer.json and transformers'
Qwen2Tokenizer / Qwen3_5Tokenizer):
  added tokens   <|endoftext|>, <|im_start|>, <|im_end|> (special, normalized=False: matched on the raw
                 text before anything else, never split)
  normalizer     NFC
  pre_tokenizer  Sequence[ Split(Regex(PATTERN), behavior="isolated", invert=False),
                           ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False) ]
  model          BPE(byte_fallback=False, unk_token=None, dropout=None, continuing_subword_prefix="",
                     end_of_word_suffix="", fuse_unk=False)
  post_processor ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)  (adds no tokens)
  decoder        ByteLevel (its flags are serialised as true; they do not affect decoding)

Split patterns:
  QWEN35_PATTERN -- Qwen3.5 / Qwen3.6 (transformers models/qwen3_5/tokenization_qwen3_5.py
                    PRETOKENIZE_REGEX; llama.cpp pre-tokenizer type "qwen35"): letters are widened to
                    letters + combining marks ([\\p{L}\\p{M}]+) and marks are excluded from the
                    punctuation class.
  QWEN2_PATTERN  -- Qwen2 / Qwen2.5 / Qwen3 (transformers models/qwen2/tokenization_qwen2.py).
Both split digits one by one (\\p{N}, no {1,3}).

Reusable by a later training script:
    from qwen_tokenizer import train_tokenizer
    tok = train_tokenizer(texts, vocab_size=32000)
    tok.save("tokenizer.json")
"""
import unicodedata
from typing import Iterable

from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors
from tokenizers.models import BPE
from tokenizers.trainers import BpeTrainer

QWEN35_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
                  r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def _pipeline(tok: Tokenizer, pattern: str) -> Tokenizer:
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def build_tokenizer(vocab: dict, merges: list, special_tokens=SPECIAL_TOKENS,
                    pattern: str = QWEN35_PATTERN) -> Tokenizer:
    """Tokenizer from a byte-level vocab {token_string: id} and ranked merges [(a, b), ...].
    Special tokens are appended after the largest id (as in Qwen: 151643, 151644, 151645)."""
    model = BPE(vocab=vocab, merges=[tuple(m) for m in merges], dropout=None, unk_token=None,
                continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False, byte_fallback=False)
    tok = _pipeline(Tokenizer(model), pattern)
    tok.add_special_tokens([AddedToken(t, single_word=False, lstrip=False, rstrip=False, normalized=False,
                                       special=True) for t in special_tokens])
    return tok


def byte_tokenizer(pattern: str = QWEN35_PATTERN) -> Tokenizer:
    """The 256 byte symbols as ids 0..255 (id = byte value), no merges, no special tokens: a valid
    Qwen-pipeline tokenizer for the tiny fixture models, whose vocabulary is 256."""
    from tokenizers.pre_tokenizers import ByteLevel
    del ByteLevel  # the byte -> symbol map below is GPT-2's bytes_to_unicode, as ByteLevel uses
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    symbol, extra = {}, 0
    for b in range(256):
        if b in printable:
            symbol[b] = chr(b)
        else:
            symbol[b] = chr(256 + extra)
            extra += 1
    return build_tokenizer({symbol[b]: b for b in range(256)}, [], special_tokens=[], pattern=pattern)


def train_tokenizer(texts: Iterable[str], vocab_size: int, min_frequency: int = 2,
                    special_tokens=SPECIAL_TOKENS, pattern: str = QWEN35_PATTERN,
                    show_progress: bool = False) -> Tokenizer:
    """Train the BPE merges on `texts` through the same normalizer / pre-tokenizer, then rebuild the
    tokenizer with build_tokenizer().  vocab_size counts the 256 byte symbols and merges, not the
    special tokens.  The 256 byte symbols are always present (no unknown bytes, no byte fallback)."""
    tok = _pipeline(Tokenizer(BPE(unk_token=None, byte_fallback=False)), pattern)
    trainer = BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency, show_progress=show_progress,
                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[])
    tok.train_from_iterator(texts, trainer=trainer)
    import json
    m = json.loads(tok.to_str())["model"]
    merges = [tuple(x.split(" ", 1)) if isinstance(x, str) else tuple(x) for x in m["merges"]]
    return build_tokenizer(m["vocab"], merges, special_tokens=special_tokens, pattern=pattern)


def nfc(s: str) -> str:
    return unicodedata.normalize("NFC", s)


def roundtrip_ok(tok: Tokenizer, text: str) -> bool:
    """decode(encode(x)) == NFC(x) (special tokens kept)"""
    ids = tok.encode(text, add_special_tokens=False).ids
    return tok.decode(ids, skip_special_tokens=False) == nfc(text)


def split_pieces(text: str, special_tokens=SPECIAL_TOKENS, pattern: str = QWEN35_PATTERN) -> list:
    """The pre-tokenization pieces (before the byte-level mapping): special tokens are cut out of the
    raw text first, every other segment is NFC-normalised then split by the regex."""
    splitter = pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False)
    out = []
    i = 0
    seg_start = 0
    while i <= len(text):
        hit = next((t for t in special_tokens if text.startswith(t, i)), None) if i < len(text) else None
        if hit is not None or i == len(text):
            seg = text[seg_start:i]
            if seg:
                out.extend(p for p, _ in splitter.pre_tokenize_str(nfc(seg)))
            if hit is None:
                break
            out.append(hit)
            i += len(hit)
            seg_start = i
        else:
            i += 1
    return out
