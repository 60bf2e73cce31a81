#!/usr/bin/env python3
"""Train the default model shipped in models/qwen3_5_moe-micro/: a small qwen3_5_moe (Qwen3.5/3.6 MoE
architecture: 3:1 Gated-DeltaNet / gated full attention, routed experts + shared expert) trained on Jane
Austen's six novels, on the CPU, in about half an hour on 2 cores.

    tools/setup_venv && tools/.venv/bin/python tools/train_default.py [--out models/qwen3_5_moe-micro]

Steps (everything seeded; the run is deterministic for a given CPU / thread count / library versions):
  1. corpus      tools/austen_corpus.py: Debian package r-cran-janeaustenr (Project Gutenberg texts, public
                 domain).  Gutenberg's hard line wraps are undone (one paragraph per line, paragraphs separated
                 by a blank line), the _italics_ underscores are dropped.  The last ~15,000 characters
                 (whole paragraphs) of every novel are held out: they make validation.txt.
  2. tokenizer   tools/qwen_tokenizer.py train_tokenizer(): byte-level BPE with Qwen3.5's exact tokenizer.json
                 pipeline, 4093 byte/merge tokens + <|endoftext|> <|im_start|> <|im_end|> = 4096, trained on the
                 training part only; saved with a ChatML chat template (CHAT_TEMPLATE) as chat_template.jinja.
  3. model       transformers Qwen3_5MoeForCausalLM (Qwen3_5MoeTextConfig, see model_config()), fp32, AdamW,
                 warmup + cosine, random 256-token windows of the training stream (novels separated by
                 <|endoftext|>), next-token loss + router load-balancing loss (output_router_logits=True).
  4. output      save_pretrained() of the model cast to bfloat16, tokenizer.json / tokenizer_config.json,
                 validation.txt, train_log.{txt,json}, loss_curve.png, reference.{json,safetensors}, README.md,
                 SHA256SUMS.  The reference is computed by transformers from the SAVED checkpoint reloaded with
                 from_pretrained(dtype=float32, attn_implementation="eager").

--arch qwen3_moe trains models/qwen3_moe-micro/ instead: a Qwen3MoeForCausalLM (every layer attention, 4 KV heads,
16 experts top-4, no shared expert) on the same text with the default model's tokenizer, for KV calibration and
routing studies (about 20 minutes).

Options for quick checks: --steps N (a short run), --out DIR.
"""
import os

# Before torch loads OpenMP: with other processes competing for the 2 cores, OpenMP's default spin-waiting
# makes 2-thread training ~5x slower (measured); passive waiting does not.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import ctypes  # noqa: E402
import datetime  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import platform  # noqa: E402
import re  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
import tokenizers  # noqa: E402
import safetensors  # noqa: E402
from safetensors import safe_open  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from transformers import (GenerationConfig, PreTrainedTokenizerFast, Qwen3_5MoeForCausalLM,  # noqa: E402
                          Qwen3_5MoeTextConfig, Qwen3MoeConfig, Qwen3MoeForCausalLM)

HERE = os.path.dirname(os.path.abspath(__file__))
MODELS = os.path.join(HERE, "..", "models")
sys.path.insert(0, HERE)
import austen_corpus  # noqa: E402
import qwen_tokenizer  # noqa: E402

# ----------------------------------------------------------------------------- settings
SEED = 4  # issue #4
THREADS = 2
VAL_CHARS_PER_BOOK = 15000  # held out from the end of every novel (whole paragraphs)
VOCAB_MERGES = 4093  # byte symbols + merges; + 3 special tokens = 4096
SEQ_LEN = 256
BATCH = 8
STEPS = 700  # 700 x 8 x 256 = 1.43M tokens, about 1.5 passes over the training text
LR_PEAK = 2e-3
LR_FINAL = 2e-4
WARMUP = 30
WEIGHT_DECAY = 0.1
BETAS = (0.9, 0.95)
GRAD_CLIP = 1.0
ROUTER_AUX_COEF = 0.01
EVAL_EVERY = 50
LOG_EVERY = 10
PPL_CONTEXT = 256
GREEDY_NEW_TOKENS = 32
LOGIT_GAP_MIN = 1e-3
# the C++ CLI's default prompt first; the others only if a greedy step is a near-tie
PROMPTS = ["Once upon a time", "It was a fine morning", "My dear Emma", "The next day"]
# repetition_penalty explicit: generate() would otherwise take generation_config.json's
SAMPLE = dict(do_sample=True, temperature=0.8, top_p=0.95, repetition_penalty=1.0, max_new_tokens=96)
# generation_config.json's sampling, what `qflash run` and `qflash serve` use when a request sets
# none: greedy decoding of a model this small loops on one phrase.
GENERATION_DEFAULTS = dict(do_sample=True, temperature=0.8, top_p=0.95, repetition_penalty=1.1)
SAMPLE_SEED = 1811
MAX_POSITIONS = 1024
# ChatML with the tokenizer's <|im_start|> / <|im_end|>, so that chat serving has a template to
# render; the model was trained on plain text and never saw it.
CHAT_TEMPLATE = ("{%- for message in messages %}\n"
                 "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}\n"
                 "{%- endfor %}\n"
                 "{%- if add_generation_prompt %}\n"
                 "{{- '<|im_start|>assistant\\n' }}\n"
                 "{%- endif %}\n")


def qwen3_5_moe_config(vocab_size, eos_id):
    """8 layers in the 3:1 pattern of the real model (lin,lin,lin,full x2), 16 experts top-2 + shared expert.
    Sized so that BF16 weights stay ~13.5 MB and one 2048-token step takes a few seconds on 2 cores."""
    return Qwen3_5MoeTextConfig(
        vocab_size=vocab_size,
        hidden_size=192,
        num_hidden_layers=8,
        layer_types=["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + ["full_attention"],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        linear_num_key_heads=4,
        linear_num_value_heads=8,
        linear_key_head_dim=32,
        linear_value_head_dim=32,
        linear_conv_kernel_dim=4,
        num_experts=16,
        num_experts_per_tok=2,
        moe_intermediate_size=40,
        shared_expert_intermediate_size=128,
        max_position_embeddings=MAX_POSITIONS,
        rms_norm_eps=1e-6,
        hidden_act="silu",
        tie_word_embeddings=False,
        initializer_range=0.02,
        # rotary dim = 64 * 0.25 = 16 -> mrope_section sums to 8; theta 1e4 suits the short context
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                         "mrope_section": [3, 3, 2], "mrope_interleaved": True},
        output_router_logits=True,
        router_aux_loss_coef=ROUTER_AUX_COEF,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
    )



def qwen3_moe_config(vocab_size, eos_id):
    """8 layers of plain GQA attention (8 query heads, 4 KV heads of 64: 32 KV heads in all, for KV
    calibration), 16 experts top-4 with no shared expert. Sized so that BF16 weights stay ~14 MB."""
    return Qwen3MoeConfig(
        vocab_size=vocab_size,
        hidden_size=192,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
        num_experts=16,
        num_experts_per_tok=4,
        moe_intermediate_size=40,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        max_position_embeddings=MAX_POSITIONS,
        rms_norm_eps=1e-6,
        hidden_act="silu",
        tie_word_embeddings=False,
        initializer_range=0.02,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        output_router_logits=True,
        router_aux_loss_coef=ROUTER_AUX_COEF,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
    )


class Arch:
    """What differs between the models this script trains."""

    def __init__(self, name, model_type, config, cls, tokenizer_from=None):
        self.name, self.model_type, self.config, self.cls = name, model_type, config, cls
        self.tokenizer_from = tokenizer_from  # a model dir whose tokenizer.json is reused, else one is trained


ARCHS = {
    "qwen3_5_moe": Arch("qwen3_5_moe-micro", "qwen3_5_moe_text", qwen3_5_moe_config, Qwen3_5MoeForCausalLM),
    # same corpus and tokenizer as the default model
    "qwen3_moe": Arch("qwen3_moe-micro", "qwen3_moe", qwen3_moe_config, Qwen3MoeForCausalLM,
                      tokenizer_from="qwen3_5_moe-micro"),
}
ARCH = ARCHS["qwen3_5_moe"]

# ----------------------------------------------------------------------------- helpers
class Tee:
    def __init__(self, path):
        self.f = open(path, "w", encoding="utf-8")

    def __call__(self, *args):
        s = " ".join(str(a) for a in args)
        print(s, flush=True)
        self.f.write(s + "\n")
        self.f.flush()

    def close(self):
        self.f.close()


def versions():
    return {"python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "tokenizers": tokenizers.__version__,
            "safetensors": safetensors.__version__, "numpy": np.__version__,
            "machine": platform.machine(), "processor": _cpu_name(), "torch_threads": torch.get_num_threads()}


def _cpu_name():
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def tune_malloc():
    """Keep freed activation buffers in the heap instead of returning them to the kernel (fewer page faults)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 32 << 20)  # M_MMAP_THRESHOLD
        libc.mallopt(-1, 1 << 30)  # M_TRIM_THRESHOLD
    except OSError:
        pass


def clean_book(text):
    """Paragraphs of a Gutenberg text: hard wraps joined, runs of spaces collapsed, _italic_ marks dropped."""
    paras = []
    for block in re.split(r"\n[ \t]*\n", text):
        p = " ".join(line.strip() for line in block.split("\n") if line.strip())
        p = re.sub(r"\s+", " ", p.replace("_", "")).strip()
        if p:
            paras.append(p)
    return paras


def split_book(paras):
    """(train paragraphs, held-out paragraphs): whole paragraphs from the end, >= VAL_CHARS_PER_BOOK chars."""
    n, k = 0, len(paras)
    while k > 0 and n < VAL_CHARS_PER_BOOK:
        k -= 1
        n += len(paras[k]) + 2
    return paras[:k], paras[k:]


def lr_at(step):
    if step < WARMUP:
        return LR_PEAK * (step + 1) / WARMUP
    t = (step - WARMUP) / max(1, STEPS - WARMUP)
    return LR_FINAL + 0.5 * (LR_PEAK - LR_FINAL) * (1 + math.cos(math.pi * t))


def windows(ids, ctx):
    """The windows of `qflash perplexity --context ctx`: consecutive, non-overlapping, the last one may be
    shorter, skipped if it has < 2 tokens."""
    out = []
    for b in range(0, len(ids), ctx):
        w = ids[b:b + ctx]
        if len(w) >= 2:
            out.append(w)
    return out


@torch.no_grad()
def window_nll(model, ids, ctx, batch=16):
    """(total NLL in float64, number of predicted tokens) over the perplexity windows; every window is a
    fresh sequence.  batch=1 runs each window on its own (used for the reference)."""
    model.eval()
    total, count = 0.0, 0
    ws = windows(ids, ctx)
    i = 0
    while i < len(ws):
        group = [ws[i]]
        while batch > 1 and i + len(group) < len(ws) and len(group) < batch and len(ws[i + len(group)]) == len(ws[i]):
            group.append(ws[i + len(group)])
        x = torch.tensor(group)
        logits = model(input_ids=x, use_cache=False).logits.double()
        lp = torch.log_softmax(logits[:, :-1], dim=-1)
        tgt = x[:, 1:]
        total += -lp.gather(-1, tgt.unsqueeze(-1)).sum().item()
        count += tgt.numel()
        i += len(group)
    return total, count


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def param_counts(model):
    cfg = model.config
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".mlp.experts." in n)
    embed = model.model.embed_tokens.weight.numel()
    active = total - experts + experts * cfg.num_experts_per_tok // cfg.num_experts
    return {"total": total, "routed_experts": experts, "embedding": embed,
            "lm_head": model.lm_head.weight.numel(),
            "active_per_token": active, "active_per_token_excluding_embedding": active - embed}


# ----------------------------------------------------------------------------- plot
def plot_losses(path, train_steps, train_loss, eval_steps, eval_loss, title):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
    ax.plot(train_steps, train_loss, color="#9ecae1", linewidth=0.8, label="train (per step)")
    if len(train_loss) >= 20:
        k = 20
        sm = np.convolve(np.array(train_loss), np.ones(k) / k, mode="valid")
        ax.plot(train_steps[k - 1:], sm, color="#3182bd", linewidth=1.6, label=f"train ({k}-step mean)")
    ax.plot(eval_steps, eval_loss, "o-", color="#e6550d", linewidth=1.6, markersize=4,
            label=f"validation ({PPL_CONTEXT}-token windows)")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats / token)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, metadata={"Software": None})
    plt.close(fig)


# ----------------------------------------------------------------------------- main
def main():
    global STEPS, ARCH
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", choices=sorted(ARCHS), default="qwen3_5_moe",
                    help="qwen3_5_moe: the default model; qwen3_moe: the KV calibration model (default qwen3_5_moe)")
    ap.add_argument("--out", help="output directory (default models/<model name>)")
    ap.add_argument("--steps", type=int, default=STEPS, help=f"training steps (default {STEPS})")
    args = ap.parse_args()
    STEPS = args.steps
    ARCH = ARCHS[args.arch]
    out_dir = os.path.abspath(args.out or os.path.join(MODELS, ARCH.name))
    tmp_dir = out_dir + ".tmp"
    shutil.rmtree(tmp_dir, ignore_errors=True)
    os.makedirs(tmp_dir)

    tune_malloc()
    torch.set_num_threads(THREADS)
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(SEED)
    log = Tee(os.path.join(tmp_dir, "train_log.txt"))
    t_start = time.time()
    log(f"train_default.py  {datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%d %H:%M:%S UTC')}")
    log("versions: " + json.dumps(versions()))

    # ---- 1. corpus
    root, deb = austen_corpus.ensure_package()
    books = austen_corpus.load_books()
    train_texts, val_texts, corpus_info = [], [], []
    for title, text in books:
        tr, va = split_book(clean_book(text))
        train_texts.append("\n\n".join(tr))
        val_texts.append("\n\n".join(va))
        corpus_info.append({"title": title, "raw_chars": len(text), "train_paragraphs": len(tr),
                            "train_chars": len(train_texts[-1]), "validation_paragraphs": len(va),
                            "validation_chars": len(val_texts[-1])})
    val_text = "\n\n".join(val_texts) + "\n"
    with open(os.path.join(tmp_dir, "validation.txt"), "w", encoding="utf-8", newline="") as f:
        f.write(val_text)
    n_train_chars = sum(len(t) for t in train_texts)
    log(f"corpus: {austen_corpus.DEB_PACKAGE} {austen_corpus.DEB_VERSION} ({deb}); "
        f"train {n_train_chars} chars, validation {len(val_text)} chars")
    for c in corpus_info:
        log(f"  {c['title']}: train {c['train_chars']} chars / {c['train_paragraphs']} paragraphs, "
            f"validation {c['validation_chars']} chars / {c['validation_paragraphs']} paragraphs")

    # ---- 2. tokenizer
    t0 = time.time()
    if ARCH.tokenizer_from:
        tok = tokenizers.Tokenizer.from_file(os.path.join(MODELS, ARCH.tokenizer_from, "tokenizer.json"))
        log(f"tokenizer: models/{ARCH.tokenizer_from}/tokenizer.json")
    else:
        tok = qwen_tokenizer.train_tokenizer(train_texts, VOCAB_MERGES)
    vocab_size = tok.get_vocab_size()
    eos_id = tok.token_to_id("<|endoftext|>")
    special = {t: tok.token_to_id(t) for t in qwen_tokenizer.SPECIAL_TOKENS}
    assert vocab_size == 4096 and eos_id == 4093, (vocab_size, special)
    for t in train_texts + [val_text]:
        assert qwen_tokenizer.roundtrip_ok(tok, t[:20000])
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                                     model_max_length=MAX_POSITIONS, chat_template=CHAT_TEMPLATE)
    hf_tok.save_pretrained(tmp_dir)
    stream = []
    for t in train_texts:
        stream += tok.encode(t, add_special_tokens=False).ids + [eos_id]
    train_ids = torch.tensor(stream, dtype=torch.long)
    val_ids = tok.encode(val_text, add_special_tokens=False).ids
    log(f"tokenizer: vocab {vocab_size} (special {special}), {'loaded' if ARCH.tokenizer_from else 'trained'} in {time.time() - t0:.1f}s; "
        f"train {len(train_ids)} tokens ({n_train_chars / len(train_ids):.2f} chars/token), "
        f"validation {len(val_ids)} tokens")

    # ---- 3. model + training
    cfg = ARCH.config(vocab_size, eos_id)
    cfg._attn_implementation = "eager"
    torch.manual_seed(SEED)
    model = ARCH.cls(cfg).float()
    model.config._attn_implementation = "eager"
    counts = param_counts(model)
    log(f"model: {json.dumps(counts)}")
    decay, no_decay = [], []
    for n, p in model.named_parameters():
        (decay if p.dim() >= 2 and "embed_tokens" not in n and "conv1d" not in n else no_decay).append(p)
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": WEIGHT_DECAY},
                             {"params": no_decay, "weight_decay": 0.0}], lr=LR_PEAK, betas=BETAS, eps=1e-8)
    gen = torch.Generator().manual_seed(SEED)
    tokens_per_step = BATCH * SEQ_LEN
    hyper = {"seed": SEED, "steps": STEPS, "batch": BATCH, "seq_len": SEQ_LEN, "tokens_per_step": tokens_per_step,
             "optimizer": "AdamW", "lr_peak": LR_PEAK, "lr_final": LR_FINAL, "warmup_steps": WARMUP,
             "schedule": "linear warmup, cosine decay to lr_final", "weight_decay": WEIGHT_DECAY,
             "weight_decay_on": "matrices except embed_tokens and conv1d", "betas": list(BETAS),
             "grad_clip": GRAD_CLIP, "router_aux_loss_coef": ROUTER_AUX_COEF, "dtype": "float32",
             "batches": "random 256-token windows of the training token stream (torch.Generator seeded)",
             "eval_every": EVAL_EVERY, "threads": THREADS}
    log("training: " + json.dumps(hyper))
    step_log, eval_log = [], []

    def evaluate(step):
        t = time.time()
        nll, n = window_nll(model, val_ids, PPL_CONTEXT)
        model.train()
        eval_log.append({"step": step, "val_loss": nll / n, "val_ppl": math.exp(nll / n), "tokens": n})
        log(f"  eval step {step}: validation loss {nll / n:.4f} (ppl {math.exp(nll / n):.2f}) "
            f"over {n} tokens [{time.time() - t:.1f}s]")

    t_train = time.time()
    evaluate(0)
    model.train()
    train_time = 0.0
    for step in range(1, STEPS + 1):
        ts = time.time()
        lr = lr_at(step - 1)
        for g in opt.param_groups:
            g["lr"] = lr
        starts = torch.randint(0, len(train_ids) - SEQ_LEN, (BATCH,), generator=gen)
        x = torch.stack([train_ids[s:s + SEQ_LEN] for s in starts.tolist()])
        out = model(input_ids=x, labels=x, output_router_logits=True)
        aux = out.aux_loss.item()
        ce = out.loss.item() - ROUTER_AUX_COEF * aux
        if not math.isfinite(out.loss.item()):
            raise SystemExit(f"step {step}: loss is {out.loss.item()}")
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP).item()
        opt.step()
        train_time += time.time() - ts
        step_log.append({"step": step, "loss": ce, "aux_loss": aux, "lr": lr, "grad_norm": gnorm,
                         "elapsed_s": round(time.time() - t_train, 2)})
        if step % LOG_EVERY == 0 or step == 1 or step == STEPS:
            recent = step_log[-LOG_EVERY:]
            tps = tokens_per_step * step / train_time
            eta = (STEPS - step) * train_time / step
            log(f"step {step:4d}/{STEPS}  loss {ce:.4f} (mean of last {len(recent)}: "
                f"{sum(r['loss'] for r in recent) / len(recent):.4f})  aux {aux:.3f}  lr {lr:.2e}  "
                f"gnorm {gnorm:.2f}  {tps:.0f} tok/s  elapsed {time.time() - t_train:.0f}s  ETA {eta:.0f}s")
        if step % EVAL_EVERY == 0 or step == STEPS:
            evaluate(step)
    train_wall = time.time() - t_train
    final_train = sum(r["loss"] for r in step_log[-20:]) / len(step_log[-20:])
    log(f"training done in {train_wall:.0f}s ({train_wall / 60:.1f} min): train loss (mean of last 20 steps) "
        f"{final_train:.4f}, validation loss {eval_log[-1]['val_loss']:.4f}")

    # ---- 4. save (bf16)
    model.eval()
    model.config.output_router_logits = False  # a training switch; the saved config describes inference
    model.to(torch.bfloat16)
    # <|im_end|> ends a chat answer too (the chat template's turns end with it).
    model.generation_config = GenerationConfig(bos_token_id=eos_id, eos_token_id=[eos_id, special["<|im_end|>"]],
                                               pad_token_id=eos_id, **GENERATION_DEFAULTS)
    model.save_pretrained(tmp_dir)
    tensors = {}
    with safe_open(os.path.join(tmp_dir, "model.safetensors"), "pt") as f:
        for k in f.keys():
            tensors[k] = f.get_slice(k).get_dtype()
    dtypes = sorted(set(tensors.values()))
    a_log_dtypes = sorted({v for k, v in tensors.items() if k.endswith("A_log")})
    log(f"saved model.safetensors: {len(tensors)} tensors, dtypes {dtypes}, A_log stored as {a_log_dtypes}")
    per_expert = "model.layers.0.mlp.experts.0.gate_proj.weight" in tensors
    layout = ("names `model.layers.L.*` (no `language_model.`), experts per-expert "
              "(`mlp.experts.E.{gate,up,down}_proj.weight`)" if per_expert else
              "names `model.layers.L.*`, experts stacked (`mlp.experts.gate_up_proj`, `mlp.experts.down_proj`)")
    log(f"tensor layout: {layout}")

    # ---- 5. reference, from the saved checkpoint
    ref_model = ARCH.cls.from_pretrained(tmp_dir, dtype=torch.float32,
                                                      attn_implementation="eager").eval()
    sd_saved = model.state_dict()
    for k, v in ref_model.state_dict().items():
        assert torch.equal(v, sd_saved[k].float()), f"reload mismatch {k}"
    from transformers import AutoTokenizer
    rtok = AutoTokenizer.from_pretrained(tmp_dir)
    with open(os.path.join(tmp_dir, "validation.txt"), encoding="utf-8", newline="") as f:
        vtext = f.read()
    v_ids = rtok.encode(vtext, add_special_tokens=False, verbose=False)
    assert v_ids == val_ids
    t0 = time.time()
    nll, n = window_nll(ref_model, v_ids, PPL_CONTEXT, batch=1)
    ppl = math.exp(nll / n)
    log(f"reference: validation perplexity {ppl:.4f} (mean NLL {nll / n:.6f}) over {n} predicted tokens, "
        f"windows of {PPL_CONTEXT} [{time.time() - t0:.1f}s]")

    chosen = None
    tried = []
    for prompt in PROMPTS:
        ids = rtok.encode(prompt, add_special_tokens=False)
        x = torch.tensor([ids])
        with torch.no_grad():
            g = ref_model.generate(input_ids=x, attention_mask=torch.ones_like(x), do_sample=False,
                                   repetition_penalty=1.0, max_new_tokens=GREEDY_NEW_TOKENS, use_cache=True, output_logits=True,
                                   return_dict_in_generate=True, pad_token_id=eos_id)
        new = g.sequences[0, len(ids):].tolist()
        gaps = [(lambda t: (t[0] - t[1]).item())(sl[0].float().topk(2).values) for sl in g.logits]
        seq = ids + new
        with torch.no_grad():
            full = ref_model(input_ids=torch.tensor([seq[:-1]]), use_cache=False, output_router_logits=True)
        argmax = full.logits[0, len(ids) - 1:].argmax(-1).tolist()
        k = ref_model.config.num_experts_per_tok
        rgap = min((rl.double().sort(-1, descending=True).values[:, k - 1]
                    - rl.double().sort(-1, descending=True).values[:, k]).min().item() for rl in full.router_logits)
        ok = (len(new) == GREEDY_NEW_TOKENS and eos_id not in new and min(gaps) >= LOGIT_GAP_MIN
              and argmax == new)
        tried.append({"prompt": prompt, "min_gap": min(gaps), "ok": ok})
        log(f"greedy '{prompt}': min top-1/top-2 logit gap {min(gaps):.4g}, min router logit gap {rgap:.4g}, "
            f"argmax of full forward == greedy: {argmax == new}, {'accepted' if ok else 'rejected'}")
        if ok:
            chosen = dict(prompt=prompt, ids=ids, new=new, gaps=gaps, rgap=rgap)
            break
    if chosen is None:
        raise SystemExit("no prompt without a near-tie greedy step")
    with torch.no_grad():
        logits = ref_model(input_ids=torch.tensor([chosen["ids"]]), use_cache=False).logits[0].float().contiguous()
    greedy_text = rtok.decode(chosen["new"])
    torch.manual_seed(SAMPLE_SEED)
    x = torch.tensor([chosen["ids"]])
    with torch.no_grad():
        s = ref_model.generate(input_ids=x, attention_mask=torch.ones_like(x), pad_token_id=eos_id, **SAMPLE)
    sample_new = s[0, len(chosen["ids"]):].tolist()
    sample_text = rtok.decode(sample_new, skip_special_tokens=False)
    log(f"greedy:  {chosen['prompt']}{greedy_text!r}")
    log(f"sample:  {chosen['prompt']}{sample_text!r}")

    save_file({"logits": logits}, os.path.join(tmp_dir, "reference.safetensors"), metadata={"format": "pt"})
    reference = {
        "format_version": 1,
        "generator": "tools/train_default.py",
        "versions": versions(),
        "compute": {"what": f"transformers {ARCH.cls.__name__}.from_pretrained(this dir, dtype=torch.float32, "
                            "attn_implementation='eager'): the BF16 weights upcast to fp32, fp32 compute, CPU, batch 1",
                    "torch_num_threads": torch.get_num_threads()},
        "tokenizer": {"file": "tokenizer.json", "vocab_size": vocab_size, "special_tokens": special,
                      "eos_token_id": eos_id, "pad_token_id": eos_id, "bos": "none is added"},
        "validation_perplexity": {
            "text_file": "validation.txt",
            "text_sha256": sha256(os.path.join(tmp_dir, "validation.txt")),
            "definition": ("tokenize the whole file (no BOS, no special tokens added); consecutive non-overlapping "
                           "windows of `context` tokens, the last one may be shorter (skipped if < 2 tokens); every "
                           "window a fresh sequence (no state carried); NLL of token t+1 given tokens 0..t for "
                           "t = 0..len-2; perplexity = exp(total NLL / predicted tokens). Same as "
                           "`qflash perplexity --text validation.txt --context 256`."),
            "context": PPL_CONTEXT,
            "text_tokens": len(v_ids),
            "windows": len(windows(v_ids, PPL_CONTEXT)),
            "predicted_tokens": n,
            "mean_nll": nll / n,
            "total_nll": nll,
            "perplexity": ppl,
        },
        "prompt": chosen["prompt"],
        "prompt_ids": chosen["ids"],
        "logits": {"file": "reference.safetensors", "key": "logits", "dtype": "float32",
                   "shape": list(logits.shape),
                   "meaning": "full forward of prompt_ids (no cache): row t = logits for the token after prompt_ids[t]"},
        "greedy": {
            "call": (f"model.generate(prompt_ids, attention_mask=ones, do_sample=False, repetition_penalty=1.0, "
                     f"max_new_tokens={GREEDY_NEW_TOKENS}, use_cache=True)"),
            "new_tokens": chosen["new"],
            "text": greedy_text,
            "min_top1_top2_logit_gap": min(chosen["gaps"]),
            "logit_gap_threshold": LOGIT_GAP_MIN,
            "equals_argmax_of_full_forward": True,
            "min_router_logit_gap_info_only": chosen["rgap"],
            "prompts_tried": tried,
        },
        "sample": {"call": f"torch.manual_seed({SAMPLE_SEED}); model.generate(prompt_ids, "
                           + ", ".join(f"{k}={v}" for k, v in SAMPLE.items()) + ")",
                   "new_tokens": sample_new, "text": sample_text,
                   "note": "informative only: another sampler's random numbers differ"},
    }
    with open(os.path.join(tmp_dir, "reference.json"), "w", encoding="utf-8") as f:
        json.dump(reference, f, indent=1, ensure_ascii=False)
        f.write("\n")

    # ---- 6. log, plot, README, checksums
    total_wall = time.time() - t_start
    plot_losses(os.path.join(tmp_dir, "loss_curve.png"), [r["step"] for r in step_log], [r["loss"] for r in step_log],
                [e["step"] for e in eval_log], [e["val_loss"] for e in eval_log],
                f"{ARCH.name}: {counts['total'] / 1e6:.2f}M params ({counts['active_per_token'] / 1e6:.2f}M active), "
                f"{STEPS} steps x {tokens_per_step} tokens")
    train_log = {"generator": "tools/train_default.py", "versions": versions(), "seed": SEED,
                 "corpus": {"debian_package": austen_corpus.DEB_PACKAGE, "version": austen_corpus.DEB_VERSION,
                            "deb_sha256": austen_corpus.DEB_SHA256, "books": corpus_info,
                            "train_tokens": len(train_ids), "validation_tokens": len(val_ids)},
                 "config": json.loads(open(os.path.join(tmp_dir, "config.json")).read()),
                 "params": counts, "hyperparameters": hyper,
                 "training_wall_s": round(train_wall, 1), "training_step_time_s": round(train_time, 1),
                 "total_wall_s": round(total_wall, 1),
                 "final_train_loss_mean_last_20": final_train,
                 "final_validation_loss_fp32": eval_log[-1]["val_loss"],
                 "final_validation_loss_bf16_reference": nll / n,
                 "evals": eval_log, "steps": step_log}
    with open(os.path.join(tmp_dir, "train_log.json"), "w", encoding="utf-8") as f:
        json.dump(train_log, f, indent=1)
        f.write("\n")
    summary = dict(counts=counts, cfg=model.config, hyper=hyper, corpus_info=corpus_info, train_wall=train_wall,
                   total_wall=total_wall, final_train=final_train, final_val=eval_log[-1]["val_loss"],
                   ref=reference, a_log_dtypes=a_log_dtypes, dtypes=dtypes, layout=layout, n_train_tokens=len(train_ids),
                   n_val_tokens=len(val_ids), n_train_chars=n_train_chars, val_chars=len(val_text))
    log(f"done in {total_wall:.0f}s")
    log.close()
    with open(os.path.join(tmp_dir, "README.md"), "w", encoding="utf-8") as f:
        f.write(readme(summary))
    files = sorted(fn for fn in os.listdir(tmp_dir) if fn != "SHA256SUMS")
    with open(os.path.join(tmp_dir, "SHA256SUMS"), "w") as f:
        for fn in files:
            f.write(f"{sha256(os.path.join(tmp_dir, fn))}  {fn}\n")
    shutil.rmtree(out_dir, ignore_errors=True)
    os.rename(tmp_dir, out_dir)
    total = 0
    for fn in sorted(os.listdir(out_dir)):
        sz = os.path.getsize(os.path.join(out_dir, fn))
        total += sz
        print(f"  {fn}: {sz} bytes")
    print(f"{out_dir}: {total} bytes in all")


def readme_intro_shape(s):
    """The README's opening paragraphs and its shape table (with the paragraph after it), per architecture."""
    c, cfg = s["counts"], s["cfg"]
    if ARCH.model_type == "qwen3_5_moe_text":
        return f"""# qwen3_5_moe-micro

A small **trained** model with the Qwen3.5 / Qwen3.6 MoE architecture (HF `model_type`
`qwen3_5_moe_text`, class `Qwen3_5MoeForCausalLM`), trained from scratch on Jane Austen's six novels. It
writes recognisable, Austen-flavoured English (grammatical in stretches, rarely sensible for long). It is
qflash's default model for
tests and demos: small enough to ship in the repository ({c['total'] * 2 / 1e6:.1f} MB of BF16 weights), big enough
to exercise every part of the architecture (Gated DeltaNet and gated full attention in the 3:1 pattern,
partial RoPE, zero-centred RMSNorms, top-k routed experts plus the gated shared expert).

""", f"""| layers | {cfg.num_hidden_layers}: `{', '.join('full' if t == 'full_attention' else 'lin' for t in cfg.layer_types)}` |
| hidden size | {cfg.hidden_size} |
| full attention | {cfg.num_attention_heads} query heads, {cfg.num_key_value_heads} KV heads, head_dim {cfg.head_dim}, output gate, partial RoPE ({cfg.rope_parameters['partial_rotary_factor']} -> {int(cfg.head_dim * cfg.rope_parameters['partial_rotary_factor'])} rotary dims, theta {cfg.rope_parameters['rope_theta']:g}) |
| Gated DeltaNet | {cfg.linear_num_key_heads} key heads x {cfg.linear_key_head_dim}, {cfg.linear_num_value_heads} value heads x {cfg.linear_value_head_dim}, conv kernel {cfg.linear_conv_kernel_dim} |
| MoE | {cfg.num_experts} experts, top-{cfg.num_experts_per_tok}, expert intermediate {cfg.moe_intermediate_size}; shared expert intermediate {cfg.shared_expert_intermediate_size} |
| vocabulary | {cfg.vocab_size} (byte-level BPE, Qwen3.5 pipeline), untied embedding / lm_head |
| max_position_embeddings | {cfg.max_position_embeddings} (trained on 256-token windows) |
| parameters | **{c['total']:,} total**; **{c['active_per_token']:,} active per token** ({c['active_per_token_excluding_embedding']:,} without the embedding table); routed experts {c['routed_experts']:,}, embedding {c['embedding']:,}, lm_head {c['lm_head']:,} |

Why this shape: 8 layers in the real model's lin,lin,lin,full pattern and every feature of the real
config, scaled so that the whole directory stays under 16 MB and training fits in ~35 minutes on 2 busy CPU
cores with transformers' pure-PyTorch code paths (chunked gated-delta rule, eager expert loop). Compute per
token, not parameters, is the constraint there: 16 small experts with top-2 routing keep the active
parameters at about half the total, and the 4096-token vocabulary keeps the lm_head cheap.

"""
    return f"""# {ARCH.name}

A small **trained** model with the Qwen3-MoE architecture (HF `model_type` `qwen3_moe`, class
`Qwen3MoeForCausalLM`, the architecture of Qwen3-30B-A3B), trained from scratch on the same Jane Austen
text with the same tokenizer as the default model `qwen3_5_moe-micro`. Every layer is full attention, so it
has {cfg.num_hidden_layers * cfg.num_key_value_heads} KV heads where the default model has 4: it is the model on which
`qflash calibrate` chooses per-head KV formats (docs/kv_cache.md), and it tests the qwen3_moe path
on trained weights ({c['total'] * 2 / 1e6:.1f} MB of BF16 weights).

""", f"""| layers | {cfg.num_hidden_layers}, all full attention |
| hidden size | {cfg.hidden_size} |
| attention | {cfg.num_attention_heads} query heads, {cfg.num_key_value_heads} KV heads, head_dim {cfg.head_dim}, q/k RMSNorm, RoPE theta {cfg.rope_parameters['rope_theta']:g} over all {cfg.head_dim} dims, no output gate |
| MoE | {cfg.num_experts} experts, top-{cfg.num_experts_per_tok} (renormalised: norm_topk_prob {cfg.norm_topk_prob}), expert intermediate {cfg.moe_intermediate_size}; no shared expert |
| vocabulary | {cfg.vocab_size} (the default model's tokenizer), untied embedding / lm_head |
| max_position_embeddings | {cfg.max_position_embeddings} (trained on 256-token windows) |
| parameters | **{c['total']:,} total**; **{c['active_per_token']:,} active per token** ({c['active_per_token_excluding_embedding']:,} without the embedding table); routed experts {c['routed_experts']:,}, embedding {c['embedding']:,}, lm_head {c['lm_head']:,} |

Why this shape: {cfg.num_hidden_layers} x {cfg.num_key_value_heads} KV heads of {cfg.head_dim} give calibration {2 * cfg.num_hidden_layers * cfg.num_key_value_heads} units (K and V of
every head) to choose among, head_dim 64 makes int6 (52 bytes per head with its scale and min) 0.41x bf16,
and top-{cfg.num_experts_per_tok} of {cfg.num_experts} leaves a dynamic router room to use fewer experts. The whole directory stays under
16 MB and training fits in about half an hour on 2 CPU cores.

"""


def readme(s):
    c, cfg, h, ref = s["counts"], s["cfg"], s["hyper"], s["ref"]
    vp, gr, sm = ref["validation_perplexity"], ref["greedy"], ref["sample"]
    books = "\n".join(f"| {b['title']} | {b['raw_chars']:,} | {b['train_chars']:,} | {b['validation_chars']:,} |"
                      for b in s["corpus_info"])
    a_log = ", ".join(s["a_log_dtypes"])
    a_log_note = ("the model was cast with `.to(torch.bfloat16)` and save_pretrained wrote A_log as BF16 like every "
                  "other tensor; the published Qwen3.5/3.6 checkpoints store it as F32" if s["a_log_dtypes"] == ["BF16"]
                  else "save_pretrained kept it in that dtype although the model was cast to bfloat16")
    a_log_sentence = f"; `A_log` is stored as {a_log} ({a_log_note})" if s["a_log_dtypes"] else ""
    tokenizer_origin = (f"the tokenizer of `{ARCH.tokenizer_from}`" if ARCH.tokenizer_from
                        else "the trained tokenizer (`tools/qwen_tokenizer.py`)")
    arch_flag = "" if ARCH is ARCHS["qwen3_5_moe"] else f" --arch {next(k for k, v in ARCHS.items() if v is ARCH)}"
    intro, shape = readme_intro_shape(s)
    return f"""{intro}Everything here is written by `tools/train_default.py`; do not edit it by hand.

## Shape

| | |
|---|---|
{shape}## Files

| file | |
|---|---|
| `config.json`, `generation_config.json`, `model.safetensors` | `save_pretrained()` of the model cast to bfloat16. Tensor {s['layout']}; dtypes in the file: {', '.join(s['dtypes'])}{a_log_sentence}. `generation_config.json`: bos = pad = {ref['tokenizer']['eos_token_id']} (`<|endoftext|>`), eos = `<|endoftext|>` and `<|im_end|>`, sampling defaults {', '.join(f'{k} {v}' for k, v in GENERATION_DEFAULTS.items())}. |
| `tokenizer.json`, `tokenizer_config.json` | {tokenizer_origin}, special tokens {', '.join(f'`{k}` = {v}' for k, v in ref['tokenizer']['special_tokens'].items())} |
| `chat_template.jinja` | a ChatML chat template (`<|im_start|>role\\ncontent<|im_end|>\\n`, generation prompt `<|im_start|>assistant\\n`) written by the tokenizer's `save_pretrained`; the model was trained on plain text, not on chats |
| `validation.txt` | the held-out text ({s['val_chars']:,} characters, {s['n_val_tokens']:,} tokens) |
| `reference.json`, `reference.safetensors` | reference outputs for the C++ tests (below) |
| `train_log.txt`, `train_log.json`, `loss_curve.png` | the training run: progress lines; config, hyperparameters, per-step losses and evaluations; the loss curve |
| `SHA256SUMS` | `sha256sum -c SHA256SUMS` |

## Corpus

Debian package **`{austen_corpus.DEB_PACKAGE}` {austen_corpus.DEB_VERSION}** (the CRAN package janeaustenr 1.0.0 by
Julia Silge), file `/usr/lib/R/site-library/janeaustenr/data/Rdata.rdb` (+ `Rdata.rdx`): the six novels as R
character vectors, one element per line of the Project Gutenberg e-texts. The texts are Project Gutenberg
transcriptions of works published 1811-1818 and are in the **public domain**; the R package and its Debian
packaging are MIT-licensed (`/usr/share/doc/r-cran-janeaustenr/copyright`). `tools/austen_corpus.py` fetches the
.deb with `apt-get download`, checks its SHA-256 (`{austen_corpus.DEB_SHA256}`), unpacks it with
`dpkg-deb -x` and reads the R lazy-load database itself (R is not needed).

Preprocessing: Gutenberg's hard line wraps are joined (one paragraph per line, paragraphs separated by a
blank line) and the `_italics_` underscores are removed. The last ~{VAL_CHARS_PER_BOOK:,} characters of every novel
(whole paragraphs) are held out; together they are `validation.txt` (about 2.5% of the text). Neither the
tokenizer nor the model saw them. In training the novels are separated by `<|endoftext|>`.

| novel | raw characters | training characters | held-out characters |
|---|---|---|---|
{books}

Training text: {s['n_train_chars']:,} characters = {s['n_train_tokens']:,} tokens.

## Training

transformers `{ARCH.cls.__name__}` in fp32 on the CPU ({h['threads']} threads), seed {h['seed']},
`torch.use_deterministic_algorithms(True)`. AdamW (betas {tuple(h['betas'])}, weight decay {h['weight_decay']} on
matrices except the embedding and the conv), learning rate {h['lr_peak']:g} after {h['warmup_steps']} warmup steps, cosine decay
to {h['lr_final']:g}, gradient clipping {h['grad_clip']}, {h['steps']} steps of {h['batch']} random {h['seq_len']}-token windows
({h['steps'] * h['tokens_per_step']:,} tokens, about {h['steps'] * h['tokens_per_step'] / s['n_train_tokens']:.1f} passes over the training text). Loss: next-token
cross-entropy + {h['router_aux_loss_coef']} x the router load-balancing loss (`output_router_logits=True`).

- training time: **{s['train_wall'] / 60:.1f} min** (whole script {s['total_wall'] / 60:.1f} min) on {ref['versions']['processor']}
- final train loss (mean of the last 20 steps): **{s['final_train']:.3f}**
- final validation loss (fp32 weights, {PPL_CONTEXT}-token windows): **{s['final_val']:.3f}**
- versions: {', '.join(f'{k} {v}' for k, v in ref['versions'].items() if k in ('python', 'torch', 'transformers', 'tokenizers', 'safetensors', 'numpy'))}

![loss curve](loss_curve.png)

## Reference outputs (`reference.json`)

All computed by transformers from the saved BF16 checkpoint reloaded with
`from_pretrained(dir, dtype=torch.float32, attn_implementation="eager")` (weights upcast to fp32, fp32
compute), which is what the C++ side does.

- **Validation perplexity: {vp['perplexity']:.4f}** (mean NLL {vp['mean_nll']:.5f} nats/token) with context
  C = {vp['context']}: {vp['text_tokens']:,} tokens, {vp['windows']} windows, {vp['predicted_tokens']:,} predicted tokens. Computed exactly like
  `qflash perplexity --text validation.txt --context {vp['context']}`.
- Prompt `{ref['prompt']!r}` = ids `{ref['prompt_ids']}`; `reference.safetensors` `logits` {ref['logits']['shape']} float32.
- Greedy continuation, {len(gr['new_tokens'])} new tokens (`model.generate(do_sample=False)`; smallest top-1/top-2 logit
  gap {gr['min_top1_top2_logit_gap']:.3g}): ids `{gr['new_tokens']}`

## Sample generations

Greedy ({len(gr['new_tokens'])} tokens):

> {ref['prompt']}{gr['text'].replace(chr(10), ' ')}

Sampled (temperature {SAMPLE['temperature']}, top-p {SAMPLE['top_p']}, {SAMPLE['max_new_tokens']} tokens, `torch.manual_seed({SAMPLE_SEED})`):

> {ref['prompt']}{sm['text'].replace(chr(10), ' ')}

## Regenerate

```sh
tools/setup_venv && tools/.venv/bin/python tools/train_default.py{arch_flag}
```

About 40 minutes on 2 cores. The script needs `apt-get download` to work (run `apt-get update` once)
unless the package is installed. With the same CPU, thread count and pinned versions the weights come out
the same; timings in the logs differ.
"""


if __name__ == "__main__":
    main()
