#!/usr/bin/env python3
"""PEFT LoRA adapters and PEFT's own outputs with them, for qflash's --lora tests.

    tools/setup_venv && tools/.venv/bin/python tools/make_lora_fixture.py [--out tests/fixtures/lora]

Writes two adapters, each as PEFT's save_pretrained writes it (adapter_config.json +
adapter_model.safetensors) plus reference.json / reference.safetensors:

  austen/   on the default model (models/qwen3_5_moe-micro): rank 4, alpha 8, every projection the
            Flash design lets LoRA touch (attention q/k/v/o, Gated DeltaNet in_proj_qkv/z/a/b and
            out_proj, the shared expert's gate/up/down, and the routed experts' stacked gate_up_proj
            and down_proj through target_parameters); the router is frozen. Trained with AdamW for
            STEPS steps on random 128-token windows of the first half of the model's validation.txt
            (a fixture, not a useful fine-tune: every LoRA weight moves away from its init), then
            rounded to and stored in bfloat16.
  tiny_qwen3_moe/   on tests/fixtures/qwen3_moe_tiny: rank 2, rsLoRA scaling, q/k/v/o and the routed
            experts, modules_to_save lm_head and embed_tokens (their copies perturbed), random LoRA
            weights (init_lora_weights=False): the other family, the other scaling and modules_to_save.

reference.safetensors holds PEFT's logits for every token of a prompt (unmerged adapter, float32,
eager attention): `logits` [n_prompt, vocab]; reference.json the prompt ids and the greedy continuation
generate() makes with the adapter (do_sample=False, repetition_penalty=1.0), and the versions used.
"""
import argparse
import json
import os
import platform
import sys

import numpy as np
import torch
import transformers
import peft
import safetensors
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file, save_file

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
STEPS = 40
GREEDY_NEW_TOKENS = 16

FLASH_TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkv", "in_proj_z", "in_proj_a",
                        "in_proj_b", "out_proj", "gate_proj", "up_proj", "down_proj"]
EXPERT_PARAMETERS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def versions():
    return {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
            "peft": peft.__version__, "safetensors": safetensors.__version__, "numpy": np.__version__}


def load_base(path):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")


def write_reference(out, model, prompt_ids, base_rel, note):
    model.eval()
    x = torch.tensor([prompt_ids])
    with torch.no_grad():
        logits = model(input_ids=x).logits[0].float().contiguous()
        g = model.generate(input_ids=x, attention_mask=torch.ones_like(x), do_sample=False, repetition_penalty=1.0,
                           max_new_tokens=GREEDY_NEW_TOKENS, use_cache=True)
    greedy = g[0, len(prompt_ids):].tolist()
    save_file({"logits": logits}, os.path.join(out, "reference.safetensors"))
    with open(os.path.join(out, "reference.json"), "w") as f:
        json.dump({"format_version": 1, "generator": "tools/make_lora_fixture.py", "base_model": base_rel,
                   "note": note, "prompt_ids": prompt_ids, "greedy_ids": greedy, "versions": versions()}, f, indent=1)
        f.write("\n")
    print(f"{out}: {len(prompt_ids)} prompt tokens, greedy {greedy}")


def round_lora_to_bf16(model):
    """The austen adapter is stored in bfloat16 (half the bytes); the reference uses the rounded values."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(p.to(torch.bfloat16).float())


def save_adapter(model, out, dtype=torch.float32):
    model.save_pretrained(out)
    os.remove(os.path.join(out, "README.md"))  # PEFT's model-card template
    if dtype != torch.float32:
        path = os.path.join(out, "adapter_model.safetensors")
        tensors = load_file(path)
        save_file({k: v.to(dtype).contiguous() for k, v in tensors.items()}, path, metadata={"format": "pt"})
    # save_pretrained records the base's path as given; keep it relative to the repository.
    cfg_path = os.path.join(out, "adapter_config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg["base_model_name_or_path"] = os.path.relpath(cfg["base_model_name_or_path"], ROOT)
    with open(cfg_path, "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
        f.write("\n")


def austen(out):
    base_dir = os.path.join(ROOT, "models", "qwen3_5_moe-micro")
    sys.path.insert(0, HERE)
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(os.path.join(base_dir, "tokenizer.json"))
    text = open(os.path.join(base_dir, "validation.txt"), encoding="utf-8").read()
    train_ids = tok.encode(text[: len(text) // 2]).ids
    prompt_ids = tok.encode("Elizabeth could not but smile at the thought of Mr. Darcy").ids

    torch.manual_seed(0)
    model = get_peft_model(load_base(base_dir), LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.0, target_modules=FLASH_TARGET_MODULES, target_parameters=EXPERT_PARAMETERS))
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    gen = torch.Generator().manual_seed(1)
    window = 128
    for step in range(STEPS):
        starts = torch.randint(0, len(train_ids) - window - 1, (4,), generator=gen).tolist()
        batch = torch.tensor([train_ids[s: s + window + 1] for s in starts])
        loss = model(input_ids=batch[:, :-1], labels=batch[:, :-1].clone()).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 10 == 0 or step == STEPS - 1:
            print(f"austen: step {step} loss {loss.item():.4f}")
    round_lora_to_bf16(model)
    save_adapter(model, out, torch.bfloat16)
    write_reference(out, model, prompt_ids, "models/qwen3_5_moe-micro",
                    f"rank 4 LoRA trained {STEPS} steps on the first half of validation.txt")


def tiny_qwen3_moe(out):
    base_dir = os.path.join(ROOT, "tests", "fixtures", "qwen3_moe_tiny")
    torch.manual_seed(2)
    model = get_peft_model(load_base(base_dir), LoraConfig(
        r=2, lora_alpha=3, use_rslora=True, init_lora_weights=False, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
        target_parameters=EXPERT_PARAMETERS, modules_to_save=["lm_head", "embed_tokens"]))
    with torch.no_grad():  # random LoRA weights of a visible size, and changed copies of the saved modules
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn_like(p) * 0.2)
            elif "modules_to_save" in name:
                p.add_(torch.randn_like(p) * 0.05)
    save_adapter(model, out)
    write_reference(out, model, [3, 17, 250, 42, 9, 128, 77, 5, 201, 64, 11, 190], "tests/fixtures/qwen3_moe_tiny",
                    "rank 2 rsLoRA with random weights; lm_head and embed_tokens saved (perturbed)")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(ROOT, "tests", "fixtures", "lora"))
    args = ap.parse_args()
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    for name, make in (("austen", austen), ("tiny_qwen3_moe", tiny_qwen3_moe)):
        out = os.path.join(args.out, name)
        os.makedirs(out, exist_ok=True)
        make(out)


if __name__ == "__main__":
    main()
