#!/usr/bin/env python3
"""Generate tiny reference checkpoints + reference outputs for the qflash C++ tests.

    tools/setup_venv && tools/.venv/bin/python tools/make_fixtures.py [--out tests/fixtures]

Writes (see tools/README.md and each reference.json for the exact meaning of every key):
  tests/fixtures/qwen3_5_moe_tiny/     Qwen3_5MoeForCausalLM (model_type qwen3_5_moe_text), fp32,
                                       exactly as save_pretrained writes it
  tests/fixtures/qwen3_moe_tiny/       Qwen3MoeForCausalLM (model_type qwen3_moe), fp32, save_pretrained
  tests/fixtures/qwen3_5_moe_256/      Qwen3_5MoeForCausalLM with every matrix width a multiple of 256 (so
                                       llama-quantize can make Q4_K/Q6_K of it: tools/make_gguf_fixtures.py),
                                       2 layers (linear, full), weights rounded to bf16 and stored BF16
                                       (A_log F32), save_pretrained; config.json adds full_attention_interval
  tests/fixtures/qwen3_5_moe_tiny_vl/  same text weights as qwen3_5_moe_tiny, re-laid-out like the
                                       published Qwen3.5/3.6 checkpoints: model_type qwen3_5_moe with
                                       text_config, model.language_model.* names, stacked experts, BF16
                                       (A_log F32), 2 shards + index, plus model.visual.* and mtp.* tensors

Everything runs on CPU in float32 with attn_implementation="eager" (so the pure-torch chunked /
recurrent gated-delta-rule fallbacks of transformers are the reference).  Weights are re-randomised
with explicit scales (the default init makes the norms trivial and the routing near-uniform), and
model seeds are retried until no routing decision (k-th vs (k+1)-th router probability) and no
greedy decision (top-1 vs top-2 logit) is a near-tie, so fp rounding differences in other
implementations cannot flip them.
"""
import argparse
import json
import math
import os
import platform
import shutil
import sys
import tempfile

import numpy as np
import torch
import transformers
import safetensors
from safetensors import safe_open
from safetensors.torch import save_file, load_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import check_fixtures
import qwen_tokenizer  # noqa: E402

from transformers import (
    Qwen3_5MoeConfig,
    Qwen3_5MoeForCausalLM,
    Qwen3_5MoeForConditionalGeneration,
    Qwen3_5MoeTextConfig,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

# ----------------------------------------------------------------------------- settings
PROMPT_SEED = 1234
FIRST_MODEL_SEED = {"qwen3_5_moe": 1000, "qwen3_moe": 2000, "qwen3_5_moe_256": 3000}
MAX_ATTEMPTS = 200
PROMPT_LENGTHS = [1, 10, 80]  # prompt 2 (80 tokens) crosses the 64-token DeltaNet chunk
GREEDY_PROMPT = 1
GREEDY_NEW_TOKENS = 32
HIDDEN_PROMPT = 1
INCREMENTAL_PROMPT = 2
# Near-tie thresholds.  Top-k on softmax probabilities == top-k on the raw router logits, and an fp
# perturbation of the logits flips a choice only if it exceeds the logit gap, so the routing check is
# on router LOGITS: min over tokens/layers of l_(k) - l_(k+1) (sorted descending).  (A gap on the
# probabilities p_(k) - p_(k+1) is not a usable criterion: with decisive routing p_(k) and p_(k+1)
# are often both ~1e-4 although the logits are far apart.  It is recorded for information.)
ROUTER_LOGIT_GAP_MIN = 1e-3
LOGIT_GAP_MIN = 1e-3  # min over greedy steps of logit_(1) - logit_(2)

VOCAB = 256
EOS_Q35 = 255  # Qwen3.6 uses bos == eos (248044) in text_config
BOS_Q3, EOS_Q3 = 254, 255  # Qwen3: bos <|endoftext|> 151643, eos <|im_end|> 151645
PROMPT_TOKEN_MAX = 250  # prompts use ids [0, 250): no special ids

ROPE_Q35 = {
    "rope_type": "default",
    "rope_theta": 1e7,
    "partial_rotary_factor": 0.25,  # head_dim 32 -> 8 rotary dims
    "mrope_section": [2, 1, 1],  # sums to rotary_dim / 2
    "mrope_interleaved": True,
}


def q35_text_config_kwargs():
    return dict(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=4,  # layer_types default: [linear, linear, linear, full]
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        linear_num_key_heads=2,
        linear_num_value_heads=4,  # 2 value heads per key head, like the real 16/32
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=32,  # deliberately != moe_intermediate_size
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        rope_parameters=dict(ROPE_Q35),
        bos_token_id=EOS_Q35,
        eos_token_id=EOS_Q35,
    )


def q35_256_config_kwargs():
    """qwen3_5_moe whose every projection has an input width (ggml ne[0]) that is a multiple of 256:
    hidden 256, 4 x 64 attention heads, 4 x 64 DeltaNet value heads, expert and shared-expert FFN 256."""
    return dict(
        vocab_size=VOCAB,
        hidden_size=256,
        num_hidden_layers=2,
        layer_types=["linear_attention", "full_attention"],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,  # 4 x 64 = 256 = attn_output's ne[0]
        linear_num_key_heads=2,
        linear_num_value_heads=4,  # 4 x 64 = 256 = ssm_out's ne[0]
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        linear_conv_kernel_dim=4,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=256,
        shared_expert_intermediate_size=256,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        rope_parameters=dict(ROPE_Q35, mrope_section=[3, 3, 2]),  # head_dim 64 -> 16 rotary dims
        bos_token_id=EOS_Q35,
        eos_token_id=EOS_Q35,
    )


def q3_config_kwargs():
    return dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=96,  # dense-MLP size: unused (every layer is MoE), kept for realism
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,  # deliberately != hidden_size
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        bos_token_id=BOS_Q3,
        eos_token_id=EOS_Q3,
    )


def make_model(kind):
    if kind == "qwen3_5_moe":
        cfg = Qwen3_5MoeTextConfig(**q35_text_config_kwargs())
        cls = Qwen3_5MoeForCausalLM
    elif kind == "qwen3_5_moe_256":
        cfg = Qwen3_5MoeTextConfig(**q35_256_config_kwargs())
        cls = Qwen3_5MoeForCausalLM
    else:
        cfg = Qwen3MoeConfig(**q3_config_kwargs())
        cls = Qwen3MoeForCausalLM
    cfg._attn_implementation = "eager"
    model = cls(cfg).float().eval()
    model.config._attn_implementation = "eager"
    return model


# ----------------------------------------------------------------------------- randomisation
RANDOMISATION_RULES = {
    "zero-centred RMSNorm weights w (qwen3_5_moe: input/post_attention/final norm, q_norm, k_norm; used as 1+w)": "U(-0.5, 0.5)",
    "plain RMSNorm weights (qwen3_moe: all norms; qwen3_5_moe: linear_attn.norm)": "U(0.5, 1.5)",
    "linear_attn.A_log": "log(A), A log-uniform in [0.02, 2]",
    "linear_attn.dt_bias": "U(-1.5, 1.5)",
    "linear_attn.conv1d.weight": "N(0, 0.5^2)",
    "model.embed_tokens.weight": "N(0, 1)",
    "lm_head.weight": "N(0, (2/sqrt(hidden))^2)",
    "mlp.gate.weight (router)": "N(0, (3/sqrt(hidden))^2)  (= default N(0,0.02^2) init scaled ~x26)",
    "mlp.shared_expert_gate.weight": "N(0, (2/sqrt(hidden))^2)",
    "every other matrix / stacked expert tensor [.., out, in]": "N(0, 1/in)",
}


@torch.no_grad()
def randomise(model, kind, seed):
    g = torch.Generator().manual_seed(seed)
    H = model.config.hidden_size

    def normal(shape, std):
        return torch.randn(shape, generator=g, dtype=torch.float64) * std

    def uniform(shape, lo, hi):
        return lo + (hi - lo) * torch.rand(shape, generator=g, dtype=torch.float64)

    for name, p in model.named_parameters():
        s = p.shape
        if name.endswith("norm.weight"):
            if kind == "qwen3_5_moe" and "linear_attn.norm" not in name:
                v = uniform(s, -0.5, 0.5)
            else:
                v = uniform(s, 0.5, 1.5)
        elif name.endswith("A_log"):
            v = uniform(s, math.log(0.02), math.log(2.0))
        elif name.endswith("dt_bias"):
            v = uniform(s, -1.5, 1.5)
        elif name.endswith("conv1d.weight"):
            v = normal(s, 0.5)
        elif name.endswith("embed_tokens.weight"):
            v = normal(s, 1.0)
        elif name == "lm_head.weight":
            v = normal(s, 2.0 / math.sqrt(H))
        elif name.endswith("mlp.gate.weight"):
            v = normal(s, 3.0 / math.sqrt(H))
        elif name.endswith("shared_expert_gate.weight"):
            v = normal(s, 2.0 / math.sqrt(H))
        elif p.dim() >= 2:
            v = normal(s, 1.0 / math.sqrt(s[-1]))
        else:
            raise RuntimeError(f"no randomisation rule for 1-D parameter {name}")
        p.copy_(v.to(p.dtype))


@torch.no_grad()
def round_to_bf16_like_vl(model):
    """In place: round every parameter to bf16 and back, except A_log (stored F32 in the real checkpoints)."""
    for name, p in model.named_parameters():
        if not name.endswith("A_log"):
            p.copy_(p.to(torch.bfloat16).to(torch.float32))


# ----------------------------------------------------------------------------- running
def make_prompts():
    g = torch.Generator().manual_seed(PROMPT_SEED)
    return [torch.randint(0, PROMPT_TOKEN_MAX, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


def router_gap(router_logits, k):
    """min over tokens and layers of l_(k) - l_(k+1) (router logits sorted descending), and the same
    for the softmax probabilities; router_logits: tuple of [n_tokens, E]"""
    lg, pg = [], []
    for rl in router_logits:
        l = rl.double().sort(dim=-1, descending=True).values
        lg.append((l[:, k - 1] - l[:, k]).min().item())
        p = torch.softmax(rl.double(), dim=-1).sort(dim=-1, descending=True).values
        pg.append((p[:, k - 1] - p[:, k]).min().item())
    return min(lg), min(pg)


@torch.no_grad()
def full_forward(model, ids, hidden=False):
    x = torch.tensor([ids])
    captured = {}
    hooks = []
    if hidden:
        for j, layer in enumerate(model.model.layers):
            hooks.append(layer.register_forward_hook(
                lambda mod, inp, out, j=j: captured.__setitem__(j, (out[0] if isinstance(out, tuple) else out).clone())))
    out = model(input_ids=x, use_cache=False, output_router_logits=True, output_hidden_states=hidden)
    for hk in hooks:
        hk.remove()
    res = {
        "logits": out.logits[0].float().clone(),
        "router_logits": [r.float().clone() for r in out.router_logits],
    }
    if hidden:
        L = model.config.num_hidden_layers
        res["hidden"] = [h[0].float().clone() for h in out.hidden_states]
        res["last_layer_out"] = captured[L - 1][0].float()
        # pin down what hidden_states[j] means (documented in reference.json)
        assert len(res["hidden"]) == L + 1
        assert torch.equal(res["hidden"][0], model.model.embed_tokens(x)[0])
        for j in range(L - 1):
            assert torch.equal(res["hidden"][j + 1], captured[j][0]), f"hidden.{j + 1} != output of layer {j}"
        assert not torch.equal(res["hidden"][L], res["last_layer_out"])
        assert torch.allclose(model.model.norm(res["last_layer_out"]), res["hidden"][L], atol=1e-6)
        assert torch.allclose(model.lm_head(res["hidden"][L]), res["logits"], atol=1e-5)
    return res


@torch.no_grad()
def incremental_logits(model, ids):
    """one token at a time, use_cache=True, the cache carried between calls"""
    cache = None
    rows = []
    for t in range(len(ids)):
        out = model(input_ids=torch.tensor([[ids[t]]]), cache=cache, use_cache=True)
        cache = out.cache
        rows.append(out.logits[0, -1].float().clone())
    return torch.stack(rows)


@torch.no_grad()
def greedy(model, prompt):
    x = torch.tensor([prompt])
    eos = model.config.eos_token_id
    out = model.generate(
        input_ids=x,
        attention_mask=torch.ones_like(x),
        do_sample=False,
        max_new_tokens=GREEDY_NEW_TOKENS,
        min_new_tokens=0,
        use_cache=True,
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=eos if isinstance(eos, int) else eos[0],
    )
    new = out.sequences[0, len(prompt):].tolist()
    gaps = []
    for step_logits in out.logits:
        top2 = step_logits[0].float().topk(2).values
        gaps.append((top2[0] - top2[1]).item())
    return new, min(gaps) if gaps else float("inf")


def evaluate(model, prompts):
    """All reference outputs + the near-tie checks. Returns (ok, result dict)."""
    k = model.config.num_experts_per_tok
    eos = model.config.eos_token_id
    eos_set = {eos} if isinstance(eos, int) else set(eos or [])
    res = {"full": [], "router_gap": float("inf"), "router_prob_gap": float("inf")}
    for i, ids in enumerate(prompts):
        f = full_forward(model, ids, hidden=(i == HIDDEN_PROMPT))
        res["full"].append(f)
        lg, pg = router_gap(f["router_logits"], k)
        res["router_gap"] = min(res["router_gap"], lg)
        res["router_prob_gap"] = min(res["router_prob_gap"], pg)
    new, lgap = greedy(model, prompts[GREEDY_PROMPT])
    res["greedy"] = new
    res["greedy_logit_gap"] = lgap
    # The generated sequence, re-run as a full forward: routing of the generated tokens must be
    # decisive too, and the full-forward argmax must reproduce the greedy tokens.
    seq = prompts[GREEDY_PROMPT] + new
    f = full_forward(model, seq[:-1])
    res["router_gap_greedy_seq"], res["router_prob_gap_greedy_seq"] = router_gap(f["router_logits"], k)
    plen = len(prompts[GREEDY_PROMPT])
    argmax = f["logits"][plen - 1:].argmax(-1).tolist()
    res["greedy_matches_full_forward_argmax"] = argmax == new
    res["incremental"] = incremental_logits(model, prompts[INCREMENTAL_PROMPT])
    full2 = res["full"][INCREMENTAL_PROMPT]["logits"]
    res["incremental_max_abs_diff"] = (res["incremental"] - full2).abs().max().item()
    res["incremental_max_rel_diff"] = ((res["incremental"] - full2).abs().max() / full2.abs().max()).item()
    reasons = []
    if res["router_gap"] < ROUTER_LOGIT_GAP_MIN:
        reasons.append(f"router logit gap {res['router_gap']:.2e} (prompts)")
    if res["router_gap_greedy_seq"] < ROUTER_LOGIT_GAP_MIN:
        reasons.append(f"router logit gap {res['router_gap_greedy_seq']:.2e} (greedy sequence)")
    if lgap < LOGIT_GAP_MIN:
        reasons.append(f"greedy top-2 logit gap {lgap:.2e}")
    if len(new) != GREEDY_NEW_TOKENS or eos_set & set(new):
        reasons.append("greedy run hit eos")
    if not res["greedy_matches_full_forward_argmax"]:
        reasons.append("full-forward argmax != greedy tokens")
    if res["incremental_max_abs_diff"] > 1e-3:
        reasons.append(f"full vs incremental diff {res['incremental_max_abs_diff']:.2e}")
    return not reasons, res, reasons


# ----------------------------------------------------------------------------- writing
def versions():
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "safetensors": safetensors.__version__,
        "numpy": np.__version__,
    }


def tensor_summary(path):
    rows = []
    with safe_open(path, "pt") as f:
        for k in f.keys():
            sl = f.get_slice(k)
            rows.append((k, sl.get_dtype(), list(sl.get_shape())))
    return rows


def write_reference(out_dir, model, prompts, res, seed, attempts, extra_json, with_hidden=True,
                    with_incremental=True):
    L = model.config.num_hidden_layers
    tensors = {}
    for i, f in enumerate(res["full"]):
        tensors[f"logits.{i}"] = f["logits"]
    if with_incremental:
        tensors[f"logits_incremental.{INCREMENTAL_PROMPT}"] = res["incremental"]
    if with_hidden:
        hf = res["full"][HIDDEN_PROMPT]
        for j, h in enumerate(hf["hidden"]):
            tensors[f"hidden.{j}"] = h
        tensors["hidden_last_layer_prenorm"] = hf["last_layer_out"]
        for l, rl in enumerate(hf["router_logits"]):
            tensors[f"router_logits.{l}"] = rl
    tensors = {k: v.contiguous().to(torch.float32) for k, v in tensors.items()}
    save_file(tensors, os.path.join(out_dir, "reference.safetensors"), metadata={"format": "pt"})

    keys = {}
    for i, ids in enumerate(prompts):
        keys[f"logits.{i}"] = (f"[{len(ids)}, vocab] full-sequence forward (no cache) of prompts[{i}]; "
                               f"row t = next-token logits after prompts[{i}][0..t]")
    if with_incremental:
        keys[f"logits_incremental.{INCREMENTAL_PROMPT}"] = (
            f"[{len(prompts[INCREMENTAL_PROMPT])}, vocab] same as logits.{INCREMENTAL_PROMPT} but computed "
            "token by token with use_cache=True (DeltaNet: recurrent rule + conv state update; attention: KV cache)")
    if with_hidden:
        n = len(prompts[HIDDEN_PROMPT])
        keys.update({
            "hidden.0": f"[{n}, hidden] prompts[{HIDDEN_PROMPT}]: token embeddings (input of layer 0; no scaling)",
            "hidden.j (1 <= j < n_layers)": "output of decoder layer j-1 (= input of layer j), residual stream, before any norm",
            f"hidden.{L}": f"AFTER the final norm (model.norm): transformers overwrites hidden_states[-1] with "
                           f"last_hidden_state. lm_head(hidden.{L}) == logits.{HIDDEN_PROMPT}",
            "hidden_last_layer_prenorm": f"[{n}, hidden] output of the last decoder layer {L - 1} BEFORE the final "
                                        "norm (captured with a forward hook; not part of output_hidden_states)",
            "router_logits.l": f"[{n}, num_experts] prompts[{HIDDEN_PROMPT}], layer l: raw router logits "
                               "W_gate . post_attention_layernorm(h) (before softmax / top-k)",
        })
    ref = {
        "format_version": 1,
        "generator": "tools/make_fixtures.py",
        "versions": versions(),
        "compute": {"device": "cpu", "dtype": "float32", "attn_implementation": "eager", "batch_size": 1,
                    "torch_num_threads": torch.get_num_threads()},
        "seeds": {"prompt_seed": PROMPT_SEED, "model_seed": seed,
                  "attempts_until_no_near_ties": attempts, "torch_generator": "torch.Generator().manual_seed"},
        "randomisation": RANDOMISATION_RULES,
        "config": model.config.to_dict(),
        "prompts": prompts,
        "greedy": {
            "prompt_index": GREEDY_PROMPT,
            "call": f"model.generate(input_ids, attention_mask=ones, do_sample=False, max_new_tokens={GREEDY_NEW_TOKENS}, use_cache=True)",
            "new_tokens": res["greedy"],
            "min_top1_top2_logit_gap": res["greedy_logit_gap"],
            "contains_eos": False,
            "equals_argmax_of_full_forward": res["greedy_matches_full_forward_argmax"],
        },
        "near_tie_checks": {
            "router_logit_gap_definition": ("min over tokens and layers of l_(k) - l_(k+1), l = raw router logits "
                                            "sorted descending, k = num_experts_per_tok (top-k of softmax == top-k "
                                            "of logits; a perturbation smaller than this gap cannot flip a choice)"),
            "router_logit_gap_threshold": ROUTER_LOGIT_GAP_MIN,
            "router_logit_gap_min_prompts": res["router_gap"],
            "router_logit_gap_min_greedy_sequence": res["router_gap_greedy_seq"],
            "router_prob_gap_min_prompts_info_only": res["router_prob_gap"],
            "router_prob_gap_min_greedy_sequence_info_only": res["router_prob_gap_greedy_seq"],
            "greedy_logit_gap_threshold": LOGIT_GAP_MIN,
        },
        "tensors_file": "reference.safetensors (all float32)",
        "tensors": keys,
    }
    if with_incremental:
        ref["incremental"] = {
            "prompt_index": INCREMENTAL_PROMPT,
            "max_abs_diff_full_vs_incremental": res["incremental_max_abs_diff"],
            "max_abs_diff_over_max_abs_logit": res["incremental_max_rel_diff"],
            "max_abs_logit": res["full"][INCREMENTAL_PROMPT]["logits"].abs().max().item(),
        }
    ref.update(extra_json)
    with open(os.path.join(out_dir, "reference.json"), "w") as f:
        json.dump(ref, f, indent=1)
        f.write("\n")
    return ref


def find_seed(kind, prompts, also_bf16=False, bf16_master=False):
    """bf16_master: the weights themselves are rounded to bf16 (A_log excepted) before evaluating"""
    seed = FIRST_MODEL_SEED[kind]
    for attempt in range(1, MAX_ATTEMPTS + 1):
        model = make_model(kind)
        randomise(model, "qwen3_5_moe" if kind == "qwen3_5_moe_256" else kind, seed)
        if bf16_master:
            round_to_bf16_like_vl(model)
        ok, res, reasons = evaluate(model, prompts)
        res_bf16 = None
        if ok and also_bf16:
            mb = make_model(kind)
            mb.load_state_dict(model.state_dict())
            round_to_bf16_like_vl(mb)
            ok, res_bf16, reasons = evaluate(mb, prompts)
            reasons = [r + " (bf16-rounded weights)" for r in reasons]
        if ok:
            print(f"{kind}: seed {seed} accepted after {attempt} attempt(s)")
            return model, res, res_bf16, seed, attempt
        print(f"{kind}: seed {seed} rejected: {'; '.join(reasons)}")
        seed += 1
    raise SystemExit(f"{kind}: no acceptable seed in {MAX_ATTEMPTS} attempts")


def save_plain(model, out_dir):
    if os.path.exists(out_dir):
        shutil.rmtree(out_dir)
    model.save_pretrained(out_dir)  # safetensors, fp32 (model is fp32)
    files = sorted(os.listdir(out_dir))
    assert "model.safetensors" in files, files
    # round-trip: transformers must reload it to identical weights
    cls = type(model)
    m2 = cls.from_pretrained(out_dir, dtype=torch.float32, attn_implementation="eager")
    sd1, sd2 = model.state_dict(), m2.state_dict()
    assert sd1.keys() == sd2.keys()
    for k in sd1:
        assert torch.equal(sd1[k], sd2[k]), k


def save_bf16(model, out_dir, extra_config):
    """save_pretrained with every parameter stored BF16 except A_log (F32, as in the published
    checkpoints); the fp32 `model` must already hold bf16-representable values. `extra_config` is
    merged into config.json (keys transformers does not write back, e.g. full_attention_interval)."""
    if os.path.exists(out_dir):
        shutil.rmtree(out_dir)
    m = make_model("qwen3_5_moe_256")
    m.load_state_dict(model.state_dict())
    with torch.no_grad():
        for name, p in m.named_parameters():
            if not name.endswith("A_log"):
                p.data = p.data.to(torch.bfloat16)
    m.config.dtype = "bfloat16"
    m.save_pretrained(out_dir)
    path = os.path.join(out_dir, "config.json")
    with open(path) as f:
        config = json.load(f)
    config.update(extra_config)
    with open(path, "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")
    dtypes = {r[1] for r in tensor_summary(os.path.join(out_dir, "model.safetensors"))}
    assert dtypes == {"BF16", "F32"}, dtypes
    # round-trip: loaded in fp32, the weights must be exactly the bf16-rounded master weights
    m2 = type(model).from_pretrained(out_dir, dtype=torch.float32, attn_implementation="eager")
    assert m2.config.layer_types == model.config.layer_types
    sd1, sd2 = model.state_dict(), m2.state_dict()
    assert sd1.keys() == sd2.keys()
    for k in sd1:
        assert torch.equal(sd1[k], sd2[k]), k


# ----------------------------------------------------------------------------- VL-style variant
VISION_TINY = dict(depth=1, hidden_size=16, num_heads=2, intermediate_size=16, patch_size=2,
                   spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16)


def write_vl_variant(text_model, out_dir, prompts, seed, attempts):
    """Mimic the published Qwen3.5/3.6-35B-A3B checkpoint layout with the tiny text weights."""
    tc = text_model.config
    text_kwargs = q35_text_config_kwargs()
    cfg = Qwen3_5MoeConfig(
        text_config=text_kwargs,
        vision_config=dict(VISION_TINY, out_hidden_size=tc.hidden_size),
        image_token_id=250, video_token_id=251, vision_start_token_id=252, vision_end_token_id=253,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed + 7)
    vl = Qwen3_5MoeForConditionalGeneration(cfg).float().eval()
    missing, unexpected = vl.model.language_model.load_state_dict(text_model.model.state_dict(), strict=True)
    vl.lm_head.load_state_dict(text_model.lm_head.state_dict())

    tmp = tempfile.mkdtemp()
    try:
        vl.save_pretrained(tmp)
        with open(os.path.join(tmp, "config.json")) as f:
            config = json.load(f)
        gen_cfg_path = os.path.join(tmp, "generation_config.json")
        gen_cfg = json.load(open(gen_cfg_path)) if os.path.exists(gen_cfg_path) else None
        saved = load_file(os.path.join(tmp, "model.safetensors"))
    finally:
        shutil.rmtree(tmp)

    # --- config.json: as Qwen3_5MoeConfig writes it, plus what the published one has
    config["dtype"] = "bfloat16"
    config["text_config"]["dtype"] = "bfloat16"
    config["text_config"]["mtp_num_hidden_layers"] = 1
    config["text_config"]["mtp_use_dedicated_embeddings"] = False
    config["text_config"]["mamba_ssm_dtype"] = "float32"

    # --- tensors: stacked experts (save_pretrained wrote per-expert), bf16 except A_log
    E = tc.num_experts
    out = {}
    per_expert = {}
    for k, v in saved.items():
        parts = k.split(".")
        if ".mlp.experts." in k and parts[-1] == "weight":
            # model.language_model.layers.L.mlp.experts.E.{gate,up,down}_proj.weight
            i = parts.index("experts")
            prefix = ".".join(parts[:i + 1])
            per_expert.setdefault(prefix, {}).setdefault(parts[i + 2], {})[int(parts[i + 1])] = v
        else:
            out[k] = v
    for prefix, d in per_expert.items():
        gate = torch.stack([d["gate_proj"][e] for e in range(E)])
        up = torch.stack([d["up_proj"][e] for e in range(E)])
        down = torch.stack([d["down_proj"][e] for e in range(E)])
        out[prefix + ".gate_up_proj"] = torch.cat([gate, up], dim=1)  # [E, 2I, H]: rows 0..I-1 gate, I..2I-1 up
        out[prefix + ".down_proj"] = down  # [E, H, I]
    # MTP tensors (skipped by text-only loaders); per-expert like the real mtp block
    g = torch.Generator().manual_seed(seed + 11)
    H, I = tc.hidden_size, tc.moe_intermediate_size
    out["mtp.fc.weight"] = torch.randn(H, 2 * H, generator=g) / math.sqrt(2 * H)
    out["mtp.pre_fc_norm_embedding.weight"] = torch.rand(H, generator=g) - 0.5
    out["mtp.pre_fc_norm_hidden.weight"] = torch.rand(H, generator=g) - 0.5
    out["mtp.norm.weight"] = torch.rand(H, generator=g) - 0.5
    out["mtp.layers.0.mlp.experts.0.gate_proj.weight"] = torch.randn(I, H, generator=g) / math.sqrt(H)
    for k in list(out):
        out[k] = out[k].contiguous().to(torch.float32 if k.endswith("A_log") else torch.bfloat16)

    # --- 2 shards + index
    if os.path.exists(out_dir):
        shutil.rmtree(out_dir)
    os.makedirs(out_dir)
    keys = sorted(out)

    def shard_of(k):
        if k.startswith("model.language_model.layers."):
            return 1 if int(k.split(".")[3]) < 2 else 2
        if k.startswith("model.language_model.embed_tokens"):
            return 1
        return 2

    names = {1: "model-00001-of-00002.safetensors", 2: "model-00002-of-00002.safetensors"}
    weight_map = {}
    total = 0
    for s in (1, 2):
        part = {k: out[k] for k in keys if shard_of(k) == s}
        save_file(part, os.path.join(out_dir, names[s]), metadata={"format": "pt"})
        for k, v in part.items():
            weight_map[k] = names[s]
            total += v.numel() * v.element_size()
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, f, indent=2)
        f.write("\n")
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")
    if gen_cfg is not None:
        with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
            json.dump(gen_cfg, f, indent=2)
            f.write("\n")

    # --- reference: transformers loads the variant (prefix change, stacked experts, bf16 -> fp32 upcast,
    # skipping model.visual.* and mtp.*), and the result must equal the bf16-rounded plain weights.
    m, info = Qwen3_5MoeForCausalLM.from_pretrained(out_dir, dtype=torch.float32, attn_implementation="eager",
                                                    output_loading_info=True)
    m.eval()
    assert not info["missing_keys"], info["missing_keys"]
    rounded = make_model("qwen3_5_moe")
    rounded.load_state_dict(text_model.state_dict())
    round_to_bf16_like_vl(rounded)
    sd_a, sd_b = m.state_dict(), rounded.state_dict()
    assert sd_a.keys() == sd_b.keys()
    for k in sd_a:
        assert torch.equal(sd_a[k], sd_b[k]), f"variant weight mismatch {k}"
    ok, res, reasons = evaluate(m, prompts)
    assert ok, reasons

    # cross-check: the full multimodal class, text-only input, gives the same logits
    vl_loaded = Qwen3_5MoeForConditionalGeneration.from_pretrained(out_dir, dtype=torch.float32,
                                                                   attn_implementation="eager").eval()
    with torch.no_grad():
        cg_diff = max(
            (vl_loaded(input_ids=torch.tensor([ids])).logits[0].float() - res["full"][i]["logits"]).abs().max().item()
            for i, ids in enumerate(prompts))

    extra = {
        "variant_of": "qwen3_5_moe_tiny (same seed / same fp32 master weights)",
        "weights_note": ("Weights are the qwen3_5_moe_tiny fp32 weights rounded to bfloat16 (round-to-nearest-even) and "
                         "stored as BF16, except every linear_attn.A_log which is stored as F32 (unrounded). The reference "
                         "outputs were computed by transformers Qwen3_5MoeForCausalLM.from_pretrained(this dir, "
                         "dtype=float32): bf16 weights upcast to fp32, fp32 compute. They are NOT equal to "
                         "qwen3_5_moe_tiny's reference outputs."),
        "layout_note": ("config.json: model_type qwen3_5_moe with nested text_config/vision_config (as "
                        "Qwen3_5MoeConfig.save_pretrained writes it; dtype set to bfloat16, mtp_* keys added). "
                        "Tensors: model.language_model.* prefix, lm_head.weight at top level, experts STACKED "
                        "(mlp.experts.gate_up_proj [E, 2*I, H] = concat(gate, up) along dim 1; mlp.experts.down_proj "
                        "[E, H, I]; no .weight suffix), 2 shards + model.safetensors.index.json. model.visual.* (a "
                        "real tiny 1-block vision tower) and mtp.* tensors are present and must be skipped by a "
                        "text-only loader."),
        "conditional_generation_class_max_abs_logit_diff": cg_diff,
    }
    write_reference(out_dir, m, prompts, res, seed, attempts, extra, with_hidden=False, with_incremental=True)
    return res


# ----------------------------------------------------------------------------- main
def describe(out_dir):
    lines = []
    for fn in sorted(os.listdir(out_dir)):
        lines.append(f"  {fn}: {os.path.getsize(os.path.join(out_dir, fn))} bytes")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests",
                                                  "fixtures"))
    ap.add_argument("--only", choices=["qwen3_5_moe", "qwen3_moe", "qwen3_5_moe_256"], default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)  # reproducible reduction order
    torch.use_deterministic_algorithms(True)
    out_root = os.path.abspath(args.out)
    prompts = make_prompts()

    kinds = [args.only] if args.only else ["qwen3_5_moe", "qwen3_moe", "qwen3_5_moe_256"]
    for kind in kinds:
        q256 = kind == "qwen3_5_moe_256"
        model, res, _, seed, attempts = find_seed(kind, prompts, also_bf16=(kind == "qwen3_5_moe"),
                                                  bf16_master=q256)
        if q256:
            out_dir = os.path.join(out_root, kind)
            # llama.cpp's converter ignores layer_types and places full attention every
            # full_attention_interval layers (default 4), which transformers does not save.
            save_bf16(model, out_dir, {"full_attention_interval": 2})
            extra = {
                "checkpoint_note": ("model.safetensors/config.json/generation_config.json written by "
                                    f"{type(model).__name__}.save_pretrained() with every parameter cast to "
                                    "bfloat16 except linear_attn.A_log (float32); config.json gets "
                                    "full_attention_interval = 2 (for llama.cpp's converter, which ignores "
                                    "layer_types). Verified to reload in fp32 bit-identically to the weights "
                                    "the reference ran on."),
                "weights_note": ("The random weights were rounded to bfloat16 (round-to-nearest-even; A_log "
                                 "not rounded) BEFORE the reference outputs were computed, in float32, so the "
                                 "BF16 checkpoint holds exactly the weights the reference used."),
                "purpose": ("every matrix input width (ggml ne[0]) is a multiple of 256, so llama-quantize "
                            "can store every quantizable tensor as Q4_K / Q6_K / Q8_0 "
                            "(tests/fixtures/gguf/, tools/make_gguf_fixtures.py)"),
            }
        else:
            out_dir = os.path.join(out_root, f"{kind}_tiny")
            save_plain(model, out_dir)
            extra = {
                "checkpoint_note": ("model.safetensors/config.json/generation_config.json written by "
                                    f"{type(model).__name__}.save_pretrained() (fp32) and verified to reload "
                                    "bit-identically with from_pretrained()."),
            }
        write_reference(out_dir, model, prompts, res, seed, attempts, extra)
        dirs = [out_dir]
        if kind == "qwen3_5_moe":
            vl_dir = os.path.join(out_root, "qwen3_5_moe_tiny_vl")
            write_vl_variant(model, vl_dir, prompts, seed, attempts)
            dirs.append(vl_dir)
        # a byte-level tokenizer (ids = bytes) so that text commands run on the fixtures
        for d in dirs:
            qwen_tokenizer.byte_tokenizer().save(os.path.join(d, "tokenizer.json"))
        # independent float64 re-implementation (tools/check_fixtures.py, written from MODELS.md)
        for d in dirs:
            diff = check_fixtures.check_dir(d)
            assert diff < 1e-4, f"{d}: float64 re-implementation disagrees ({diff})"
            path = os.path.join(d, "reference.json")
            ref = json.load(open(path))
            ref["independent_float64_check"] = {
                "script": "tools/check_fixtures.py (float64, token-by-token DeltaNet recurrence, loader handles "
                          "both layouts)",
                "max_abs_diff_vs_logits": diff,
                "greedy_tokens_reproduced": True,
            }
            with open(path, "w") as f:
                json.dump(ref, f, indent=1)
                f.write("\n")
            print(f"{d}:\n{describe(d)}")


if __name__ == "__main__":
    main()
