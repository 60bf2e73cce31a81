#!/usr/bin/env python3
"""Independent float64 re-implementation of the qwen3_5_moe / qwen3_moe text forward pass, written from
the formulas in shared/MODELS.md section 3/4 (NOT from transformers' code), used to cross-check the
fixtures written by make_fixtures.py: it loads each fixture directory like a C++ loader would (plain or
VL-style config, model. or model.language_model. prefix, stacked or per-expert experts, F32 or BF16,
single file or sharded with an index, skipping model.visual.* and mtp.*), recomputes the logits of
every prompt (DeltaNet with the token-by-token recurrence) and compares them with reference.safetensors.

    tools/.venv/bin/python tools/check_fixtures.py [tests/fixtures]
"""
import json
import math
import os
import sys

import torch
from safetensors import safe_open

F = torch.float64


def load_checkpoint(d):
    cfg = json.load(open(os.path.join(d, "config.json")))
    text = cfg.get("text_config", cfg)
    idx = os.path.join(d, "model.safetensors.index.json")
    files = sorted(set(json.load(open(idx))["weight_map"].values())) if os.path.exists(idx) else ["model.safetensors"]
    raw = {}
    for fn in files:
        with safe_open(os.path.join(d, fn), "pt") as f:
            for k in f.keys():
                raw[k] = f.get_tensor(k)
    w, dtypes = {}, {}
    for k, v in raw.items():
        if k.startswith("model.visual.") or k.startswith("mtp."):
            continue
        name = k.replace("model.language_model.", "model.", 1)
        w[name] = v.to(F)
        dtypes[name] = str(v.dtype).replace("torch.", "")
    # per-expert -> stacked
    E = text.get("num_experts", text.get("num_local_experts"))
    for L in range(text["num_hidden_layers"]):
        p = f"model.layers.{L}.mlp.experts."
        if p + "0.gate_proj.weight" in w:
            g = torch.stack([w.pop(f"{p}{e}.gate_proj.weight") for e in range(E)])
            u = torch.stack([w.pop(f"{p}{e}.up_proj.weight") for e in range(E)])
            w[p + "gate_up_proj"] = torch.cat([g, u], 1)
            w[p + "down_proj"] = torch.stack([w.pop(f"{p}{e}.down_proj.weight") for e in range(E)])
    return text, w, dtypes


def rms(x, eps):
    return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps)


def rope(x, pos, theta, rot):
    """NeoX half-split rotation of the first `rot` dims of x [T, heads, d]"""
    half = rot // 2
    inv = theta ** (-torch.arange(0, rot, 2, dtype=F) / rot)
    ang = pos[:, None].to(F) * inv[None, :]  # [T, half]
    c, s = ang.cos()[:, None, :], ang.sin()[:, None, :]
    x1, x2 = x[..., :half], x[..., half:rot]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s, x[..., rot:]], -1)


def forward(text, w, ids):
    q35 = text["model_type"].startswith("qwen3_5")
    eps = text["rms_norm_eps"]
    H = text["hidden_size"]
    T = len(ids)
    nn = (lambda x, wt: rms(x, eps) * (1.0 + wt)) if q35 else (lambda x, wt: rms(x, eps) * wt)
    rp = text.get("rope_parameters") or {}
    theta = rp.get("rope_theta", text.get("rope_theta"))
    prf = rp.get("partial_rotary_factor", text.get("partial_rotary_factor", 1.0)) if q35 else 1.0
    layer_types = text.get("layer_types") or ["full_attention"] * text["num_hidden_layers"]
    pos = torch.arange(T)
    h = w["model.embed_tokens.weight"][ids]
    for L in range(text["num_hidden_layers"]):
        P = f"model.layers.{L}."
        x = nn(h, w[P + "input_layernorm.weight"])
        if layer_types[L] == "full_attention":
            nh, nkv, hd = text["num_attention_heads"], text["num_key_value_heads"], text["head_dim"]
            qg = (x @ w[P + "self_attn.q_proj.weight"].T)
            if q35:
                qg = qg.view(T, nh, 2 * hd)
                q, gate = qg[..., :hd], qg[..., hd:].reshape(T, nh * hd)
            else:
                q, gate = qg.view(T, nh, hd), None
            k = (x @ w[P + "self_attn.k_proj.weight"].T).view(T, nkv, hd)
            v = (x @ w[P + "self_attn.v_proj.weight"].T).view(T, nkv, hd)
            q = nn(q, w[P + "self_attn.q_norm.weight"])
            k = nn(k, w[P + "self_attn.k_norm.weight"])
            rot = int(hd * prf)
            q, k = rope(q, pos, theta, rot), rope(k, pos, theta, rot)
            o = torch.zeros(T, nh, hd, dtype=F)
            mask = torch.full((T, T), -math.inf, dtype=F).triu(1)
            for i in range(nh):
                j = i // (nh // nkv)
                s = (q[:, i] @ k[:, j].T) / math.sqrt(hd) + mask
                o[:, i] = torch.softmax(s, -1) @ v[:, j]
            o = o.reshape(T, nh * hd)
            if gate is not None:
                o = o * torch.sigmoid(gate)
            mix = o @ w[P + "self_attn.o_proj.weight"].T
        else:
            A = P + "linear_attn."
            nk, nv = text["linear_num_key_heads"], text["linear_num_value_heads"]
            dk, dv = text["linear_key_head_dim"], text["linear_value_head_dim"]
            m = x @ w[A + "in_proj_qkv.weight"].T  # [T, C]
            cw = w[A + "conv1d.weight"][:, 0, :]  # [C, K]
            K = cw.shape[1]
            mp = torch.cat([torch.zeros(K - 1, m.shape[1], dtype=F), m], 0)
            c = sum(cw[:, j] * mp[j:j + T] for j in range(K))
            c = c * torch.sigmoid(c)
            q = c[:, :nk * dk].view(T, nk, dk)
            k = c[:, nk * dk:2 * nk * dk].view(T, nk, dk)
            v = c[:, 2 * nk * dk:].view(T, nv, dv)
            z = (x @ w[A + "in_proj_z.weight"].T).view(T, nv, dv)
            beta = torch.sigmoid(x @ w[A + "in_proj_b.weight"].T)
            a = x @ w[A + "in_proj_a.weight"].T
            g = -torch.exp(w[A + "A_log"]) * torch.nn.functional.softplus(a + w[A + "dt_bias"])
            l2 = lambda t: t * torch.rsqrt((t * t).sum(-1, keepdim=True) + 1e-6)
            q, k = l2(q) / math.sqrt(dk), l2(k)
            o = torch.zeros(T, nv, dv, dtype=F)
            for j in range(nv):
                kh = j // (nv // nk)
                S = torch.zeros(dk, dv, dtype=F)
                for t in range(T):
                    S = math.exp(g[t, j]) * S
                    u = S.T @ k[t, kh]
                    delta = beta[t, j] * (v[t, j] - u)
                    S = S + torch.outer(k[t, kh], delta)
                    o[t, j] = S.T @ q[t, kh]
            o = rms(o, eps) * w[A + "norm.weight"] * (z * torch.sigmoid(z))
            mix = o.reshape(T, nv * dv) @ w[A + "out_proj.weight"].T
        h = h + mix
        x = nn(h, w[P + "post_attention_layernorm.weight"])
        M = P + "mlp."
        p = torch.softmax(x @ w[M + "gate.weight"].T, -1)
        top = p.topk(text["num_experts_per_tok"], -1)
        wts = top.values
        if not q35 and not text.get("norm_topk_prob", False):
            pass
        else:
            wts = wts / wts.sum(-1, keepdim=True)
        gu, dn = w[M + "experts.gate_up_proj"], w[M + "experts.down_proj"]
        I = dn.shape[2]
        y = torch.zeros(T, H, dtype=F)
        for t in range(T):
            for r in range(top.indices.shape[1]):
                e = top.indices[t, r]
                gg = gu[e, :I] @ x[t]
                uu = gu[e, I:] @ x[t]
                y[t] += wts[t, r] * (dn[e] @ (gg * torch.sigmoid(gg) * uu))
        if q35:
            S_ = M + "shared_expert."
            gg = x @ w[S_ + "gate_proj.weight"].T
            uu = x @ w[S_ + "up_proj.weight"].T
            s = (gg * torch.sigmoid(gg) * uu) @ w[S_ + "down_proj.weight"].T
            y = y + torch.sigmoid(x @ w[M + "shared_expert_gate.weight"].T) * s
        h = h + y
    return nn(h, w["model.norm.weight"]) @ w["lm_head.weight"].T


def check_dir(d):
    text, w, dtypes = load_checkpoint(d)
    ref = json.load(open(os.path.join(d, "reference.json")))
    worst = 0.0
    with safe_open(os.path.join(d, "reference.safetensors"), "pt") as f:
        for i, ids in enumerate(ref["prompts"]):
            want = f.get_tensor(f"logits.{i}").to(F)
            got = forward(text, w, ids)
            diff = (got - want).abs().max().item()
            worst = max(worst, diff)
        if "greedy" in ref:
            seq = ref["prompts"][ref["greedy"]["prompt_index"]] + ref["greedy"]["new_tokens"]
            lg = forward(text, w, seq[:-1])
            n = len(ref["prompts"][ref["greedy"]["prompt_index"]])
            assert lg[n - 1:].argmax(-1).tolist() == ref["greedy"]["new_tokens"], "greedy tokens differ"
    non_f32 = sorted({v for v in dtypes.values()})
    print(f"{os.path.basename(d)}: max |float64 re-implementation - reference logits| = {worst:.3e}; "
          f"greedy continuation reproduced; tensor dtypes {non_f32}")
    return worst


def main():
    root = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(os.path.abspath(__file__)), "..",
                                                              "tests", "fixtures")
    bad = []
    for name in ("qwen3_5_moe_tiny", "qwen3_5_moe_tiny_vl", "qwen3_moe_tiny"):
        d = os.path.join(root, name)
        if os.path.isdir(d):
            if check_dir(d) > 1e-4:
                bad.append(name)
    if bad:
        sys.exit(f"MISMATCH: {bad}")


if __name__ == "__main__":
    main()
