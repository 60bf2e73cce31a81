#!/usr/bin/env python3
"""Write a random checkpoint with a real model's layer shapes, for memory and speed runs.

    tools/.venv/bin/python tools/make_random_checkpoint.py \
        --config tests/fixtures/qwen3_6_35b_a3b_config --layers 4 --out /tmp/qwen36-4l

Keeps the config's shapes (hidden size, heads, experts, vocabulary) and its layer pattern,
cut to --layers layers, and fills every tensor with seeded normal noise in bf16 (A_log in f32,
as Qwen3.6 checkpoints store it), in the Hugging Face qwen3_5_moe / qwen3_moe layout with
per-expert tensors. The values mean nothing: use it to measure resident memory and decode
speed per --weights scheme, never quality.
"""
import argparse
import json
import pathlib

import numpy as np
import torch
from safetensors.torch import save_file


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True, help="model directory with config.json")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    src = json.loads((pathlib.Path(args.config) / "config.json").read_text())
    cfg = dict(src.get("text_config", src))
    cfg["model_type"] = cfg.get("model_type", src["model_type"]).replace("_text", "")
    qwen35 = cfg["model_type"] == "qwen3_5_moe"
    n = args.layers
    if qwen35:
        types = cfg.get("layer_types") or [
            "full_attention" if (i + 1) % cfg.get("full_attention_interval", 4) == 0 else "linear_attention"
            for i in range(cfg["num_hidden_layers"])]
        types = types[:n]
        if "full_attention" not in types:
            types[-1] = "full_attention"
        cfg["layer_types"] = types
    cfg["num_hidden_layers"] = n
    cfg["dtype"] = "bfloat16"

    gen = torch.Generator().manual_seed(args.seed)
    tensors = {}

    def t(name, *shape, scale=0.02, dtype=torch.bfloat16):
        tensors[name] = (torch.randn(*shape, generator=gen) * scale).to(dtype)

    d = cfg["hidden_size"]
    vocab = cfg["vocab_size"]
    t("model.embed_tokens.weight", vocab, d)
    t("lm_head.weight", vocab, d)
    t("model.norm.weight", d, scale=0.1)
    hd = cfg.get("head_dim", d // cfg["num_attention_heads"])
    n_exp = cfg.get("num_experts", cfg.get("num_local_experts"))
    ff = cfg["moe_intermediate_size"]
    for l in range(n):
        p = f"model.layers.{l}."
        t(p + "input_layernorm.weight", d, scale=0.1)
        t(p + "post_attention_layernorm.weight", d, scale=0.1)
        full = not qwen35 or cfg["layer_types"][l] == "full_attention"
        if full:
            a = p + "self_attn."
            t(a + "q_proj.weight", cfg["num_attention_heads"] * hd * (2 if qwen35 else 1), d)
            t(a + "k_proj.weight", cfg["num_key_value_heads"] * hd, d)
            t(a + "v_proj.weight", cfg["num_key_value_heads"] * hd, d)
            t(a + "o_proj.weight", d, cfg["num_attention_heads"] * hd)
            t(a + "q_norm.weight", hd, scale=0.1)
            t(a + "k_norm.weight", hd, scale=0.1)
        else:
            a = p + "linear_attn."
            hk, hv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
            dk, dv = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
            conv = 2 * hk * dk + hv * dv
            t(a + "in_proj_qkv.weight", conv, d)
            t(a + "in_proj_z.weight", hv * dv, d)
            t(a + "in_proj_b.weight", hv, d)
            t(a + "in_proj_a.weight", hv, d)
            t(a + "conv1d.weight", conv, 1, cfg["linear_conv_kernel_dim"], scale=0.3)
            t(a + "dt_bias", hv, scale=1.0)
            t(a + "A_log", hv, scale=1.0, dtype=torch.float32)
            t(a + "norm.weight", dv, scale=0.1)
            t(a + "out_proj.weight", d, hv * dv)
        m = p + "mlp."
        t(m + "gate.weight", n_exp, d)
        for e in range(n_exp):
            t(m + f"experts.{e}.gate_proj.weight", ff, d)
            t(m + f"experts.{e}.up_proj.weight", ff, d)
            t(m + f"experts.{e}.down_proj.weight", d, ff)
        if qwen35:
            sff = cfg["shared_expert_intermediate_size"]
            t(m + "shared_expert.gate_proj.weight", sff, d)
            t(m + "shared_expert.up_proj.weight", sff, d)
            t(m + "shared_expert.down_proj.weight", d, sff)
            t(m + "shared_expert_gate.weight", 1, d)

    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for k in ("auto_map", "quantization_config"):
        cfg.pop(k, None)
    # A text-only config that transformers and llama.cpp's converter read as written: with a
    # flat "qwen3_5_moe" config they take text_config's defaults (40 layers, theta 1e4) instead.
    if qwen35:
        cfg["model_type"] = "qwen3_5_moe_text"
        cfg["architectures"] = ["Qwen3_5MoeForCausalLM"]
    else:
        cfg["architectures"] = ["Qwen3MoeForCausalLM"]
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    total = sum(v.numel() for v in tensors.values())
    print(f"wrote {out} ({total / 1e9:.2f}B parameters, {n} layers)")


if __name__ == "__main__":
    main()
