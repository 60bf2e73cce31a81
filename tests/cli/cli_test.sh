#!/usr/bin/env bash
# cli_test.sh QFLASH FIXTURES CASE: runs one end-to-end case of the qflash program and checks
# what it printed and its exit status.
set -uo pipefail
qflash=$1 fixtures=$2 case=$3
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

fail() { echo "FAIL ($case): $*"; echo "--- stdout"; cat "$tmp/out"; echo "--- stderr"; cat "$tmp/err"; exit 1; }
run() { "$qflash" "$@" >"$tmp/out" 2>"$tmp/err"; echo $? >"$tmp/rc"; }
expect_rc() { [[ $(cat "$tmp/rc") == "$1" ]] || fail "exit status $(cat "$tmp/rc"), expected $1"; }
expect_out() { grep -Eq -- "$1" "$tmp/out" || fail "stdout lacks /$1/"; }
expect_err() { grep -Eq -- "$1" "$tmp/err" || fail "stderr lacks /$1/"; }

tiny=$fixtures/qwen3_5_moe_tiny
edit=$(dirname "$0")/edit_model.py
case $case in
  inspect_qwen36)  # MODELS.md §6: 34.66B parameters, 20,480 B/token of BF16 KV, 62.8 MiB f32 state
    run inspect --model "$fixtures/qwen3_6_35b_a3b_config"
    expect_rc 0
    expect_out "layers +40 \(10 full attention, 30 Gated DeltaNet\)"
    expect_out "parameters +34\.66B total, 2\.95B active"
    expect_out "kv cache +20480 bytes/token"
    expect_out "deltanet state +62\.8[0-9] MiB per sequence"
    ;;
  inspect_tiny)
    run inspect --model "$fixtures/qwen3_moe_tiny"
    expect_rc 0
    expect_out "model_type +qwen3_moe"
    expect_out "layer pattern +FFFF"
    ;;
  run_greedy)
    run run --model "$tiny" --prompt "Hello" --max-tokens 8
    expect_rc 0
    expect_out "^Hello"
    expect_err "prompt: 5 tokens, .* tok/s \| generation: 8 tokens, .* tok/s \| finish: length"
    ;;
  run_sampled)
    run run --model "$fixtures/qwen3_moe_tiny" --prompt "abc" -n 6 --temperature 0.9 --top-k 40 \
      --top-p 0.95 --min-p 0.01 --repetition-penalty 1.1 --seed 7 --weights bf16 --threads 1
    expect_rc 0
    expect_err "generation: 6 tokens"
    ;;
  run_gguf)  # the F32 GGUF converted from $tiny generates what $tiny generates
    run run --model "$tiny" --prompt "Hello" --max-tokens 12
    expect_rc 0
    cp "$tmp/out" "$tmp/want"
    run run --model "$fixtures/gguf/qwen3_5_moe_tiny-F32.gguf" --prompt "Hello" --max-tokens 12
    expect_rc 0
    cmp -s "$tmp/out" "$tmp/want" || fail "GGUF output differs from the HF directory's: $(cat "$tmp/want")"
    ;;
  weights_schemes)  # every --weights scheme runs; inspect sizes it from the config alone
    for w in f32 bf16 fp8 q8_0 q4_k q6_k q4_k_m int4; do
      run run --model "$tiny" --prompt "Hello" -n 4 --weights "$w"
      expect_rc 0
      expect_err "generation: 4 tokens"
    done
    run inspect --model "$fixtures/qwen3_6_35b_a3b_config" --weights q4_k_m
    expect_rc 0
    expect_out "resident \(q4_k_m\) +18\.55 GiB total \(bf16 40\.16 MiB, q4_k 17\.37 GiB, q6_k 1\.14 GiB\)"
    ;;
  logits | logits_incremental)
    flag=""
    [[ $case == logits_incremental ]] && flag=--incremental
    run logits --model "$tiny" --prompt-ids 171,56,115,66,64,182,125,75,29,93 --output "$tmp/l.npy" $flag
    expect_rc 0
    expect_err "wrote logits \[10, 256\]"
    # .npy: a 128-byte header for this shape, then 10 x 256 float32
    [[ $(head -c 6 "$tmp/l.npy" | tail -c 5) == NUMPY ]] || fail "not a .npy file"
    [[ $(stat -c %s "$tmp/l.npy") == $((128 + 10 * 256 * 4)) ]] || fail "unexpected .npy size"
    head -c 128 "$tmp/l.npy" | grep -q "'shape': (10, 256)" || fail "wrong shape in header"
    ;;
  perplexity)
    printf 'The quick brown fox jumps over the lazy dog. %.0s' {1..10} >"$tmp/text.txt"
    run perplexity --model "$tiny" --text "$tmp/text.txt" --context 64
    expect_rc 0
    expect_out "^perplexity [0-9.]+ over 442 predicted tokens \(8 windows of 64\)"
    ;;
  routing)  # --routing on perplexity and run; route-stats' tables and JSON; --kl-base; bad values name the flag
    printf 'The quick brown fox jumps over the lazy dog. %.0s' {1..10} >"$tmp/text.txt"
    run perplexity --model "$tiny" --text "$tmp/text.txt" --context 64
    expect_rc 0
    top_k=$(grep -Eo '^perplexity [0-9.]+' "$tmp/out")
    run perplexity --model "$tiny" --text "$tmp/text.txt" --context 64 --routing top_k=1 --kl-base bf16
    expect_rc 0
    expect_out "^mean KL [0-9.e+-]+ nats/token from --kv bf16"
    [[ $(grep -Eo '^perplexity [0-9.]+' "$tmp/out") != "$top_k" ]] || fail "--routing top_k=1 changed nothing"
    run route-stats --model "$tiny" --text "$tmp/text.txt" -c 64 --routing top_p=0.5 --routing top_k=1 \
      --json "$tmp/rs.json"
    expect_rc 0
    expect_out "^\| top_k \| 2\.00 \| 1\.000 \| [0-9.]+ \| \+0\.00% \| 0 \|"
    expect_out "^\| top_k=1 \| 1\.00 \| 0\.500 \| [0-9.]+ \| [+-][0-9.]+% \| [0-9.e+-]+ \|"
    expect_out "^\| top_p=0\.5 \| 1\.[0-9]+ \| 0\.[5-9][0-9]+ \|"
    expect_out "^\| 0 \| [0-9.]+ \| [0-9]+ \| 0\.[0-9]+ \|"
    python3 - "$tmp/rs.json" <<'PY' || fail "route-stats JSON"
import json, sys
j = json.load(open(sys.argv[1]))
assert j["n_expert"] == 8 and j["top_k"] == 2, j
p = {x["routing"]: x for x in j["policies"]}
assert list(p) == ["top_k", "top_p=0.5", "top_k=1"], list(p)
assert p["top_k=1"]["experts_per_token_histogram"][1] > 0 and p["top_k=1"]["mean_experts_per_token"] == 1
assert all(len(l["expert_load"]) == 8 for l in p["top_k"]["layers"])
assert p["top_k"]["mean_kl_vs_top_k"] == 0 and p["top_k=1"]["mean_kl_vs_top_k"] > 0
PY
    run run --model "$tiny" --routing top_q=1 -n 2
    expect_rc 2
    expect_err "error: --routing: routing 'top_q=1': unknown policy 'top_q'; expected top_k, top_p or threshold"
    run route-stats --model "$tiny" --text "$tmp/text.txt" --routing top_p=1.5
    expect_rc 2
    expect_err "error: --routing: routing 'top_p=1.5': top_p must be in \(0, 1\]"
    run route-stats --model "$tiny" --text "$tmp/text.txt" --routing top_k=9
    expect_rc 2
    expect_err "error: --routing: routing 'top_k=9': 9 experts per token, the model has 8"
    run perplexity --model "$tiny" --text "$tmp/text.txt" --kl-base int5
    expect_rc 2
    expect_err "error: --kl-base: "
    ;;
  lora)  # --lora on run / perplexity, unmerged and merged alike; bad adapters name what is wrong
    moe=$fixtures/qwen3_moe_tiny adapter=$fixtures/lora/tiny_qwen3_moe
    run run --model "$moe" --prompt "abc" -n 12 --temp 0
    expect_rc 0
    cp "$tmp/out" "$tmp/base"
    run run --model "$moe" --prompt "abc" -n 12 --temp 0 --lora "$adapter"
    expect_rc 0
    cp "$tmp/out" "$tmp/lora"
    cmp -s "$tmp/base" "$tmp/lora" && fail "--lora changed nothing: $(cat "$tmp/base")"
    run run --model "$moe" --prompt "abc" -n 12 --temp 0 --lora "$adapter:1" --lora-merge --weights f32
    expect_rc 0
    cmp -s "$tmp/out" "$tmp/lora" || fail "merged output differs from unmerged: $(cat "$tmp/lora")"
    micro=$fixtures/../../models/qwen3_5_moe-micro  # an adapter without modules_to_save: scale 0 is the base
    run run --model "$micro" --prompt "It was" -n 8 --temp 0
    cp "$tmp/out" "$tmp/base"
    run run --model "$micro" --prompt "It was" -n 8 --temp 0 --lora "$fixtures/lora/austen:0"
    expect_rc 0
    cmp -s "$tmp/out" "$tmp/base" || fail "--lora DIR:0 is not the base model"
    printf 'The quick brown fox jumps over the lazy dog. %.0s' {1..10} >"$tmp/text.txt"
    run perplexity --model "$moe" --text "$tmp/text.txt" --context 64 --lora "$adapter"
    expect_rc 0
    expect_out "^perplexity [0-9.]+ over"
    run run --model "$moe" --lora "$tmp/none" -n 2
    expect_rc 2
    expect_err "error: --lora '.*/none': '.*/none' is not a directory"
    run run --model "$moe" --lora-merge -n 2
    expect_rc 2
    expect_err "error: --lora-merge: no --lora adapter to merge"
    run serve --model "$moe" --lora "bad name=$adapter"
    expect_rc 2
    expect_err "LoRA adapter name 'bad name' must be"
    run run --model "$tiny" --lora "$fixtures/lora/austen" -n 2
    expect_rc 1
    expect_err "austen/adapter_model.safetensors: tensor '.*' has shape \[4096, 192\]|lora_A is"
    ;;
  kv_schemes)  # --kv on logits, perplexity and run: compressed KV changes the numbers, f32 is the default
    ids=171,56,115,66,64,182,125,75,29,93
    run logits --model "$tiny" --prompt-ids $ids --output "$tmp/f32.npy"
    expect_rc 0
    run logits --model "$tiny" --prompt-ids $ids --output "$tmp/default.npy" --kv f32
    expect_rc 0
    cmp -s "$tmp/f32.npy" "$tmp/default.npy" || fail "--kv f32 is not the default"
    run logits --model "$tiny" --prompt-ids $ids --output "$tmp/int6.npy" --kv bf16:int6
    expect_rc 0
    cmp -s "$tmp/f32.npy" "$tmp/int6.npy" && fail "--kv bf16:int6 gave the f32 logits"
    printf 'The quick brown fox jumps over the lazy dog. %.0s' {1..4} >"$tmp/text.txt"
    run perplexity --model "$tiny" --text "$tmp/text.txt" --context 64 --kv int8
    expect_rc 0
    expect_out "^perplexity [0-9.]+ over"
    run run --model "$tiny" -p "Hello" -n 4 --temp 0 --kv fp8
    expect_rc 0
    run logits --model "$tiny" --prompt-ids $ids --output "$tmp/x.npy" --kv int5
    expect_rc 2
    expect_err "error: --kv: unknown KV format 'int5' \(expected one of: f32, bf16, fp8_e4m3, int8, int6\)"
    run run --model "$tiny" -p "Hello" --kv bf16:
    expect_rc 2
    expect_err "error: --kv: unknown KV format ''"
    ;;
  calibrate)  # per-head sensitivity, the map beside the model, and --kv / --kv-map over it
    cp -r "$tiny" "$tmp/m"
    printf 'The quick brown fox jumps over the lazy dog. %.0s' {1..12} >"$tmp/cal.txt"
    ids=171,56,115,66,64,182,125,75,29,93
    run logits --model "$tmp/m" --prompt-ids $ids --output "$tmp/exact.npy"
    expect_rc 0
    run calibrate --model "$tmp/m" --text "$tmp/cal.txt" --budget 0.6 -c 64
    expect_rc 0
    expect_out "^\| 3 \| 1 \| V \|"
    expect_out "wrote .*m/kv_compression_map.json: [0-9]+ KV bytes/token, 0\.[0-9]+ x bf16 \(budget 0\.6\)"
    python3 - "$tmp/m/kv_compression_map.json" <<'PY' || fail "bad map file"
import json, sys
m = json.load(open(sys.argv[1]))
assert (m["qflash_kv_map"], m["n_layer"], m["n_head_kv"], m["d_head"]) == (1, 4, 2, 32), m
assert list(m["layers"]) == ["3"] and len(m["layers"]["3"]["k"]) == 2, m
assert m["calibration"]["bytes_vs_bf16"] <= 0.6 and len(m["calibration"]["units"]) == 4, m
PY
    # The map beside the model applies by default; --kv f32 and --kv-map choose otherwise.
    run logits --model "$tmp/m" --prompt-ids $ids --output "$tmp/mapped.npy"
    expect_rc 0
    cmp -s "$tmp/exact.npy" "$tmp/mapped.npy" && fail "the map beside the model was not used"
    run logits --model "$tmp/m" --prompt-ids $ids --output "$tmp/f32.npy" --kv f32
    expect_rc 0
    cmp -s "$tmp/exact.npy" "$tmp/f32.npy" || fail "--kv f32 did not override the map"
    mv "$tmp/m/kv_compression_map.json" "$tmp/map.json"
    run logits --model "$tmp/m" --prompt-ids $ids --output "$tmp/explicit.npy" --kv-map "$tmp/map.json"
    expect_rc 0
    cmp -s "$tmp/mapped.npy" "$tmp/explicit.npy" || fail "--kv-map gave other logits than the same map beside the model"
    run budget --model "$tmp/m" --kv-map "$tmp/map.json"
    expect_rc 0
    expect_out "^KV (mixed|int8|int6|fp8_e4m3|bf16[:a-z0-9_]*): [0-9]+ bytes/token"
    # Mistakes: each named.
    run calibrate --model "$tmp/m" --text "$tmp/cal.txt" --budget 0.3
    expect_rc 1
    expect_err "a budget of 0.3 x bf16 KV is below what int6 everywhere takes"
    run calibrate --model "$tmp/m" --text "$tmp/cal.txt" --budget 1.5
    expect_rc 2
    run calibrate --model "$tmp/m" --text "$tmp/cal.txt" --formats bf16,q4
    expect_rc 2
    expect_err "error: --formats: unknown KV format 'q4'"
    run logits --model "$tmp/m" --prompt-ids $ids --output "$tmp/x.npy" --kv int6 --kv-map "$tmp/map.json"
    expect_rc 2
    expect_err "excludes"
    run run --model "$tmp/m" --kv-map "$tmp/none.json"
    expect_rc 2
    expect_err "error: --kv-map: '.*none.json' is not a file"
    printf '{"qflash_kv_map": 1, "n_layer": 4, "n_head_kv": 2, "d_head": 32, "layers": {"3": {"k": ["bf16"], "v": []}}}' >"$tmp/bad.json"
    run logits --model "$tmp/m" --prompt-ids $ids --output "$tmp/x.npy" --kv-map "$tmp/bad.json"
    expect_rc 1
    expect_err "bad.json: field 'layers.3.k' lists 1 formats, expected one per KV head \(2\)"
    ;;
  bad_ids)
    run logits --model "$tiny" --prompt-ids 1,x,3 --output "$tmp/l.npy"
    expect_rc 2
    expect_err "error: --prompt-ids: 'x' is not a token id"
    run logits --model "$tiny" --prompt-ids 1,999 --output "$tmp/l.npy"
    expect_rc 2
    expect_err "token id 999 is outside the vocabulary \[0, 256\)"
    for id in 4294967296 2147483648 -1; do  # once wrapped to 0 or went negative
      run logits --model "$tiny" --prompt-ids "1,$id" --output "$tmp/l.npy"
      expect_rc 2
      expect_err "error: --prompt-ids: '$id' is not a token id \(expected integers in \[0, 2147483647\]"
    done
    ;;
  missing_model)
    run run --model "$tmp/nothing" --prompt hi
    expect_rc 1
    expect_err "model '.*nothing' does not exist"
    ;;
  bad_flag)
    run run --model "$tiny" --weights f64
    [[ $(cat "$tmp/rc") != 0 ]] || fail "accepted --weights f64"
    expect_err "f64"
    run run --model "$tiny" --top-p 0
    expect_rc 2
    expect_err "error: --top-p: must be a number in \(0, 1\], got '0'"
    ;;
  config_only_run)
    run run --model "$fixtures/qwen3_6_35b_a3b_config" --prompt hi
    expect_rc 1
    expect_err "no weights"
    ;;
  # --- hardening: bad files -------------------------------------------------------------
  deep_json)  # 100k nested lists in each JSON file the loader reads: an error, not a crash
    for f_key in config.json:model_type tokenizer.json:model generation_config.json:eos_token_id; do
      f=${f_key%%:*}
      rm -rf "$tmp/m"; cp -r "$tiny" "$tmp/m"
      python3 "$edit" nest "$tmp/m/$f" "${f_key#*:}" 100000
      run run --model "$tmp/m" -n 2
      expect_rc 1
      expect_err "$f: .*(must be|invalid JSON|expected).*\[\[\[\[.*\.\.\."
    done
    rm -rf "$tmp/m"; cp -r "$tiny" "$tmp/m"  # a safetensors header, then a shard index
    python3 -c 'import struct,sys; h=b"{\"t\": " + b"[" * 100000 + b"]" * 100000 + b"}"; sys.stdout.buffer.write(struct.pack("<Q", len(h)) + h)' > "$tmp/m/model.safetensors"
    run run --model "$tmp/m" -n 2
    expect_rc 1
    expect_err "model.safetensors: .*\[\[\[\[.*\.\.\."
    mv "$tmp/m/model.safetensors" "$tmp/m/model-00001-of-00001.safetensors"
    printf '{"weight_map": %s}' "$(head -c 100000 /dev/zero | tr '\0' '[')$(head -c 100000 /dev/zero | tr '\0' ']')" \
      > "$tmp/m/model.safetensors.index.json"
    run run --model "$tmp/m" -n 2
    expect_rc 1
    expect_err "model.safetensors.index.json: .*weight_map.*\[\[\[\[.*\.\.\."
    ;;
  special_files)  # a FIFO must not hang open(); a directory is named as one
    rm -rf "$tmp/m"; cp -r "$tiny" "$tmp/m"
    rm "$tmp/m/model.safetensors"; mkfifo "$tmp/m/model.safetensors"
    "$qflash" run --model "$tmp/m" -n 2 >"$tmp/out" 2>"$tmp/err" & pid=$!
    for _ in $(seq 100); do kill -0 $pid 2>/dev/null || break; sleep 0.1; done
    kill -0 $pid 2>/dev/null && { kill $pid; fail "hangs on a FIFO"; }
    wait $pid; echo $? >"$tmp/rc"
    expect_rc 1
    expect_err "model.safetensors: is a FIFO, expected a regular file"
    rm "$tmp/m/model.safetensors"; mkdir "$tmp/m/model.safetensors"
    run run --model "$tmp/m" -n 2
    expect_rc 1
    expect_err "model.safetensors: is a directory, expected a regular file"
    ;;
  nonfinite_weights)  # NaN/Inf named at load when read, else the logits say so; never exit 0
    rm -rf "$tmp/m"; cp -r "$tiny" "$tmp/m"
    python3 "$edit" poison "$tmp/m" model.layers.0.input_layernorm.weight nan
    run run --model "$tmp/m" -n 2
    expect_rc 1
    expect_err "tensor 'model.layers.0.input_layernorm.weight' holds a non-finite value \(nan\) at index 0"
    rm -rf "$tmp/m"; cp -r "$tiny" "$tmp/m"
    python3 "$edit" poison "$tmp/m" model.layers.3.self_attn.q_proj.weight inf
    run run --model "$tmp/m" -n 2  # kept as stored (f32): found in the logits
    expect_rc 1
    expect_err "logits of batch row 0 are not finite.*inspect --check-weights"
    run run --model "$tmp/m" -n 2 --weights q8_0  # converted: found and named at load
    expect_rc 1
    expect_err "tensor 'model.layers.3.self_attn.q_proj.weight': row 0 holds a non-finite value"
    run inspect --model "$tmp/m" --check-weights
    expect_rc 1
    expect_err "tensor 'layers\.3\.attention\.q': row 0 holds a non-finite value"
    run inspect --model "$tiny" --check-weights
    expect_rc 0
    expect_out "weights checked +every value finite"
    ;;
  absent_sizes)  # a config.json without a size says so, before the errors the defaults then make
    rm -rf "$tmp/m"; cp -r "$tiny" "$tmp/m"
    python3 -c 'import json, sys
c = json.load(open(sys.argv[1])); del c["hidden_size"]; del c["num_experts_per_tok"]
json.dump(c, open(sys.argv[1], "w"))' "$tmp/m/config.json"
    run run --model "$tmp/m" -n 2
    expect_rc 1
    expect_err "config.json: no hidden_size, num_experts_per_tok; taking the transformers defaults \(save_pretrained writes every size"
    expect_err "model.embed_tokens.weight' has shape \[256, 32\], expected \[256, 2048\]"
    # head_dim (256 by default on qwen3_5_moe) fails the RoPE sections' check in config.json itself.
    python3 -c 'import json, sys
c = json.load(open(sys.argv[1])); del c["head_dim"]
json.dump(c, open(sys.argv[1], "w"))' "$tmp/m/config.json"
    run inspect --model "$tmp/m"
    expect_rc 1
    expect_err "config.json: no hidden_size, head_dim, num_experts_per_tok; taking the transformers defaults"
    ;;
  vocab_mismatch)
    rm -rf "$tmp/m"; cp -r "$tiny" "$tmp/m"
    python3 "$edit" add-token "$tmp/m" 300  # the model embeds 256 ids
    run run --model "$tmp/m" -n 2
    expect_rc 1
    expect_err "tokenizer.json: the tokenizer has ids up to 300, but the model's vocabulary is 256"
    rm -rf "$tmp/m"; cp -r "$tiny" "$tmp/m"
    python3 "$edit" config "$tmp/m" eos_token_id 256
    run run --model "$tmp/m" -n 2
    expect_rc 1
    expect_err "eos_token_id 256 .* is outside the vocabulary \[0, 256\)"
    python3 "$edit" config "$tmp/m" eos_token_id 255
    python3 "$edit" config "$tmp/m" vocab_size null
    run run --model "$tmp/m" -n 2
    expect_rc 1
    expect_err "field 'vocab_size' must be a positive integer, got null"
    ;;
  escapes_in_files)  # strings from files reach the terminal with control characters escaped
    rm -rf "$tmp/m"; cp -r "$tiny" "$tmp/m"
    python3 "$edit" config "$tmp/m" model_type '"\u001b]0;pwned\u0007\u001b[31mqwen\u009b"'
    run run --model "$tmp/m" -n 2
    expect_rc 1
    expect_err "model_type '\\\\x1b\]0;pwned\\\\x07\\\\x1b\[31mqwen\\\\u009b' is not supported"
    if grep -q $'\x1b' "$tmp/err"; then fail "raw ESC on stderr"; fi
    ;;
  not_utf8)  # text that is not UTF-8 names its flag and file, before any weights are read
    printf 'Hello \xff world' > "$tmp/bad.txt"
    run run --model "$tiny" -f "$tmp/bad.txt"
    expect_rc 2
    expect_err "-f/--file: '.*bad\.txt' is not valid UTF-8 \(byte 6 of 13\)"
    run run --model "$tiny" -p $'\xfe'
    expect_rc 2
    expect_err "-p: the prompt is not valid UTF-8 \(byte 0 of 1\)"
    run run --model "$tiny" -p - < "$tmp/bad.txt"
    expect_rc 2
    expect_err "-p: standard input is not valid UTF-8"
    run perplexity --model "$tiny" --text "$tmp/bad.txt"
    expect_rc 2
    expect_err "--text: '.*bad\.txt' is not valid UTF-8"
    ;;
  checksums)  # SHA256SUMS: paths stay inside the model directory; CRLF; files not covered
    rm -rf "$tmp/m"; cp -r "$tiny" "$tmp/m"
    (cd "$tmp/m" && sha256sum config.json generation_config.json model.safetensors tokenizer.json > SHA256SUMS)
    run run --model "$tmp/m" -n 2
    expect_rc 0
    grep -q "does not list" "$tmp/err" && fail "warned although every file read is listed"
    sed -i 's/$/\r/' "$tmp/m/SHA256SUMS"
    run run --model "$tmp/m" -n 2
    expect_rc 0
    (cd "$tmp/m" && sha256sum config.json > SHA256SUMS)
    run run --model "$tmp/m" -n 2
    expect_rc 0
    expect_err "warning: .*SHA256SUMS does not list .*model.safetensors"
    for bad in ../../../../etc/passwd /etc/passwd; do
      echo "$(sha256sum /etc/passwd | cut -c1-64)  $bad" > "$tmp/m/SHA256SUMS"
      run run --model "$tmp/m" -n 2
      expect_rc 1
      expect_err "SHA256SUMS:1: .*'$bad'"
      grep -q "$(sha256sum /etc/passwd | cut -c1-64)" "$tmp/err" && fail "printed the hash of a file outside the model"
    done
    ;;

  # --- hardening: generation limits and flags -------------------------------------------
  context_limit)  # the model's max positions or -c end generation with finish: length
    run run --model "$tiny" --prompt "Hello" -n 100 -c 9  # 5 prompt tokens
    expect_rc 0
    expect_err "generation: 4 tokens, .* \| finish: length"
    rm -rf "$tmp/m"; cp -r "$tiny" "$tmp/m"
    python3 "$edit" config "$tmp/m" max_position_embeddings 12
    run run --model "$tmp/m" --prompt "Hello" -n -1 --ignore-eos
    expect_rc 0
    expect_err "generation: 7 tokens, .* \| finish: length"
    run run --model "$tmp/m" -c 13
    expect_rc 2
    expect_err "-c/--ctx-size 13 is above the model's limit of 12 tokens"
    printf 'The quick brown fox jumps over the lazy dog. %.0s' {1..3} >"$tmp/text.txt"
    run perplexity --model "$tmp/m" --text "$tmp/text.txt" --context 64
    expect_rc 2
    expect_err "-c/--context 64 is above the model's limit of 12 tokens"
    ;;
  flags_before_load)  # a bad flag is reported before the (here broken) weights are read
    rm -rf "$tmp/m"; cp -r "$tiny" "$tmp/m"
    head -c 100 "$tiny/model.safetensors" > "$tmp/m/model.safetensors"
    for flags in "--temp -1" "--top-p 1.5" "--min-p 2" "--top-k -3" "--repeat-penalty 0" "-n -2" \
                 "-t -1" "--stop a\\q" "-s -5" "--weights f64" "--device tpu" "--device cuda:x"; do
      run run --model "$tmp/m" $flags
      expect_rc 2
      grep -q "model.safetensors" "$tmp/err" && fail "$flags: the model was read first"
      expect_err "^qflash: error: .*"
    done
    run run --model "$tmp/m" -t 99999999999
    expect_rc 2
    expect_err "error: --threads: '99999999999' is too large \(at most 2147483647\)"
    run run --model "$tmp/m" -n 2  # the same model without the bad flag: a load error, exit 1
    expect_rc 1
    expect_err "model.safetensors"
    ;;
  device)  # --device: its values, the commands that run on CUDA, and what a build without a GPU says
    run run --model "$tiny" --device cuda:1x
    expect_rc 2
    expect_err "error: --device: expected cpu, cuda or cuda:N \(N a device index\), not 'cuda:1x'"
    run run --model "$tiny" --prompt "Hello" -n 8 --ignore-eos
    expect_rc 0
    cp "$tmp/out" "$tmp/cpu"
    run run --model "$tiny" --prompt "Hello" -n 8 --ignore-eos --device cuda:0
    if "$qflash" run --help | grep -q "this build: cpu and cuda"; then
      if [[ $(cat "$tmp/rc") == 0 ]]; then  # a GPU: the same greedy text as the CPU, and a server
        cmp -s "$tmp/out" "$tmp/cpu" || fail "--device cuda wrote $(cat "$tmp/out"), the CPU $(cat "$tmp/cpu")"
        "$qflash" serve --model "$tiny" --port 0 --device cuda >"$tmp/out" 2>"$tmp/err" & pid=$!
        for _ in $(seq 300); do grep -q "^serving" "$tmp/out" && break; sleep 0.1; done
        kill -TERM "$pid"; wait "$pid"; echo $? >"$tmp/rc"
        expect_rc 0
        expect_err "engine: spec .* on sm(80|90a), .*KV cache"
        lora=(--model "$fixtures/qwen3_moe_tiny" --lora "$fixtures/lora/tiny_qwen3_moe" --prompt "Hello" -n 8 --ignore-eos)
        run run "${lora[@]}"
        cp "$tmp/out" "$tmp/cpu"
        run run "${lora[@]}" --device cuda
        expect_rc 0
        cmp -s "$tmp/out" "$tmp/cpu" || fail "--lora on cuda wrote $(cat "$tmp/out"), the CPU $(cat "$tmp/cpu")"
      else
        expect_rc 1
        expect_err "error: (no CUDA device is available|CUDA device 0 .*runs none of the compiled archs)"
        grep -q "loading" "$tmp/err" && fail "the model was loaded before the device was checked"
        for cmd in "serve --port 0" chat "run --lora $fixtures/lora/tiny_qwen3_moe"; do  # said before anything loads
          run $cmd --model "$tiny" --device cuda
          expect_rc 1
          expect_err "error: (no CUDA device is available|CUDA device 0 .*runs none of the compiled archs)"
          grep -qE "loading|listening" "$tmp/err" && fail "$cmd: the model was loaded or the port bound first"
        done
      fi
      run run --model "$tiny" -n 2 --device cuda:4096
      expect_rc 1
      expect_err "error: (no CUDA device is available|CUDA device 4096 does not exist)"
      run bench --synthetic qwen3_6_35b_a3b --layers 1 --vocab 64 -p 4 -n 2 -r 1 --device cuda -t 1,2
      expect_rc 2
      expect_err "error: -t: one thread count with --device cuda"
      run bench --synthetic qwen3_6_35b_a3b --layers 1 --vocab 64 -p 4 -n 2 -r 1 --device cuda --json
      if [[ $(cat "$tmp/rc") == 0 ]]; then
        expect_out '"device":"cuda [^"]+".*"roofline_fraction":[0-9.]+'
      else
        expect_rc 1
        expect_err "error: (no CUDA device is available|CUDA device 0 .*runs none of the compiled archs)"
        grep -q "generated" "$tmp/err" && fail "bench made the weights before checking the device"
      fi
    else
      expect_rc 2
      expect_err "error: --device cuda:0: this build has no CUDA kernels \(configure with -DQFLASH_ENABLE_CUDA=ON"
      run bench --synthetic qwen3_6_35b_a3b --layers 1 --vocab 64 -p 4 -n 2 -r 1 --device cuda
      expect_rc 2
      expect_err "error: --device cuda: this build has no CUDA kernels"
      for cmd in serve "run --lora $fixtures/lora/tiny_qwen3_moe"; do
        run $cmd --model "$tiny" --device cuda
        expect_rc 2
        expect_err "error: --device cuda: this build has no CUDA kernels"
      done
    fi
    run bench --model "$tiny" -p 4 -n 2 -r 1 --json --device cpu
    expect_rc 0
    expect_out '"device":"cpu"' 
    ;;
  threads)  # more threads than CPUs: reduced to the CPUs, with a warning
    run run --model "$tiny" -n 2 -t 100000
    expect_rc 0
    expect_err "warning: -t 100000 is more than the [0-9]+ CPUs this process may use; using [0-9]+ threads"
    expect_err "generation: 2 tokens"
    ;;
  llama_cpp_flags)  # llama-cli spellings
    printf 'Hello' > "$tmp/prompt.txt"
    run run --model "$tiny" -f "$tmp/prompt.txt" -n 4 --temp 0.8 -s 3 --repeat-penalty 1.1 -c 64 --ignore-eos
    expect_rc 0
    expect_out "^Hello"
    expect_err "generation: 4 tokens"
    cp "$tmp/out" "$tmp/want"
    printf 'Hello' | "$qflash" run --model "$tiny" -p - -n 4 --temperature 0.8 --seed 3 \
      --repetition-penalty 1.1 --ignore-eos >"$tmp/out" 2>"$tmp/err"
    cmp -s "$tmp/out" "$tmp/want" || fail "-p - differs from -f: $(cat "$tmp/want")"
    run run --model "$tiny" -ngl 99
    expect_rc 2
    expect_err "error: -ngl: qflash does not split layers between CPU and GPU.*--device"
    run frobnicate --model "$tiny"
    expect_rc 2
    expect_err "error: unknown command 'frobnicate' \(commands: run, inspect, logits, perplexity, calibrate, route-stats, bench, serve, chat, budget\)"
    run --version
    expect_rc 0
    expect_out "^qflash [0-9]+\.[0-9]+\.[0-9]+"
    run run --model "$tiny" -n 2 --temp 1 -v  # -v after the command; random seed logged
    expect_rc 0
    expect_err "info: sampling: temperature 1, .*, seed [0-9]+"
    expect_err "info: threads: [0-9]+ \([0-9]+ physical cores"
    ;;
  stop_escapes)  # --stop "\n" is a newline; the stop string itself is not printed
    run run --model "$tiny" --prompt "Hello" -n 40 --ignore-eos
    expect_rc 0
    # the generated text (after the prompt) up to its first byte that --stop can name
    want=$(head -c 200 "$tmp/out" | tail -c +6 | head -c 3)
    esc=$(printf '%s' "$want" | od -An -tx1 | tr -s ' ' | sed 's/ /\\x/g')
    run run --model "$tiny" --prompt "Hello" -n 40 --ignore-eos --stop "$esc"
    expect_rc 0
    expect_err "finish: stop"
    [[ $(cat "$tmp/out") == Hello ]] || fail "--stop '$esc' should stop right after the prompt"
    run run --model "$tiny" --prompt "Hello" -n 4 --stop 'a\'
    expect_rc 2
    expect_err "error: --stop: 'a\\\\' ends in a lone"
    ;;
  timing_lines)  # logits and perplexity print a timing line like run
    run logits --model "$tiny" --prompt-ids 1,2,3 --output "$tmp/l.npy"
    expect_rc 0
    expect_err "^logits: 3 tokens in [0-9.]+ s, [0-9.]+ tok/s"
    printf 'The quick brown fox jumps over the lazy dog. %.0s' {1..3} >"$tmp/text.txt"
    run perplexity --model "$tiny" --text "$tmp/text.txt"
    expect_rc 0
    expect_err "^perplexity: [0-9]+ tokens in [0-9.]+ s, [0-9.]+ tok/s"
    ;;
  # --- qflash bench ----------------------------------------------------------------------
  bench_json)  # the embedded default model: one JSON object per test with the issue's keys
    run bench -p 8 -n 4 -r 1 -t 1 --json
    expect_rc 0
    python3 - "$tmp/out" <<'PY' || fail "bad JSON lines"
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
assert [r["test"] for r in rows] == ["pp8", "tg4"], rows
for r in rows:
    for k in ("model", "format", "threads", "cpu_isa", "prefill_tok_s", "decode_tok_s", "bytes_per_token",
              "bandwidth_gbs", "roofline_fraction", "peak_rss_bytes"):
        assert k in r, k
    assert r["model"] == "qwen3_5_moe-micro" and r["format"] == "bf16" and r["threads"] == 1, r
    assert r["cpu_isa"] in ("scalar", "avx2", "avx512", "avx512_vnni", "avx512_bf16", "amx"), r
    assert r["bytes_per_token"] > 0 and r["bandwidth_gbs"] > 0 and r["peak_rss_bytes"] > 0, r
    assert len(r["samples_tok_s"]) == 1 and r["stddev_tok_s"] == 0, r
pp, tg = rows
assert pp["prefill_tok_s"] > 0 and pp["decode_tok_s"] is None and pp["roofline_fraction"] is None, pp
assert tg["decode_tok_s"] > 0 and tg["prefill_tok_s"] is None and tg["roofline_fraction"] > 0, tg
assert (pp["n_prompt"], pp["n_gen"], tg["n_prompt"], tg["n_gen"]) == (8, 0, 0, 4)
PY
    expect_err "read bandwidth [0-9.]+ GB/s \(1 threads?"
    run bench -p 8 -n 4,2 -r 2 -t 1  # the markdown table: a header and one row per test
    expect_rc 0
    expect_out "^\| model +\| format +\| +size \| threads \| +test \| +t/s \| bytes/token \| read GB/s \| roofline"
    expect_out "^\| qwen3_5_moe-micro +\| bf16 +\| .* \| +1 \| +pp8 \| +[0-9.]+ ± [0-9.]+ \| .* \| +- \|"
    expect_out "^\| qwen3_5_moe-micro +\| bf16 +\| .* \| +1 \| +tg2 \| +[0-9.]+ ± [0-9.]+ \| .* \| +[0-9.]+ \|"
    [[ $(grep -c '^| qwen3_5_moe-micro' "$tmp/out") == 3 ]] || fail "expected 3 rows"
    run bench -p 8 -n 4 -r 1 -t 1 -b 1,3 --json  # batches: every sequence's tokens counted
    expect_rc 0
    python3 - "$tmp/out" <<'PY' || fail "bad JSON lines for -b"
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
assert [(r["test"], r["batch"]) for r in rows] == [("pp8", 1), ("tg4", 1), ("pp8 b3", 3), ("tg4 b3", 3)], rows
assert rows[1]["roofline_fraction"] > 0 and rows[3]["roofline_fraction"] is None, rows
assert rows[2]["prefill_tok_s"] > 0 and rows[3]["decode_tok_s"] > 0, rows
PY
    run bench -p 8 -n 0 -b 0
    expect_rc 2
    expect_err "error: --batch: must be an integer in \[1, 4096\]"
    ;;
  bench_synthetic)  # a preset's real shapes built in memory: 1 layer (full attention), q4_k
    run bench --synthetic qwen3_6_35b_a3b --layers 1 --vocab 1024 --weights q4_k -p 8 -n 4 -r 1 -t 1 --json
    expect_rc 0
    # Weights per decoded token, q4_k rows of 2048 (4096, 512) values are 1152 (2304, 288)
    # bytes: q 8192 + k 512 + v 512 rows, o 2048 rows of 4096; the router's 257 bf16 rows;
    # 8 experts' and the shared expert's gate and up (512 rows) and down (2048 rows of 512);
    # lm_head 1024 rows; one embedding row. Decode adds the KV at its mean context: 2.5
    # positions of 2 heads' K and V of 256 f32 values.
    want=$(( 9216 * 1152 + 2048 * 2304 + 257 * 4096 + 9 * (1024 * 1152 + 2048 * 288) + 1024 * 1152 + 1152 ))
    python3 - "$tmp/out" "$want" 10240 <<'PY' || fail "bad JSON lines"
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
assert [r["test"] for r in rows] == ["pp8", "tg4"], rows
for r in rows:
    assert r["model"] == "qwen3_6_35b_a3b synthetic 1L v1024" and r["format"] == "q4_k", r
    assert (r["n_layer"], r["vocab"], r["kv"], r["n_depth"]) == (1, 1024, "f32", 0), r
assert rows[0]["bytes_per_token"] == int(sys.argv[2]), (rows[0]["bytes_per_token"], sys.argv[2])
assert rows[1]["bytes_per_token"] == int(sys.argv[2]) + int(sys.argv[3]), (rows[1]["bytes_per_token"], sys.argv[2])
assert rows[1]["decode_tok_s"] > 0 and rows[1]["roofline_fraction"] > 0
PY
    # With 16 positions already cached in int6 (208 bytes per head vector): 18.5 positions.
    run bench --synthetic qwen3_6_35b_a3b --layers 1 --vocab 1024 --weights q4_k -p 0 -n 4 -d 16 --kv int6 -r 1 -t 1 --json
    expect_rc 0
    python3 - "$tmp/out" "$want" <<'PY' || fail "bad JSON lines with -d 16 --kv int6"
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
assert [(r["test"], r["kv"], r["n_depth"]) for r in rows] == [("tg4 @ d16", "int6", 16)], rows
assert rows[0]["bytes_per_token"] == int(sys.argv[2]) + 37 * 2 * 2 * 208 // 2, rows[0]["bytes_per_token"]
PY
    run bench --synthetic qwen3_30b_a3b --layers 1 --vocab 512 -p 4 -n 0 -r 1 -t 1
    expect_rc 0
    expect_out "^\| qwen3_30b_a3b synthetic 1L v512 +\| bf16 +\| .* \| +pp4 \|"
    ;;
  bench_bad_input)  # command-line mistakes: exit 2 with a message, before any weights
    run bench --model "$tiny" --synthetic qwen3_6_35b_a3b
    expect_rc 2
    expect_err "error: --model and --synthetic exclude each other"
    run bench --synthetic qwen3_8b
    expect_rc 2
    expect_err "error: --synthetic: unknown synthetic preset 'qwen3_8b' \(known: qwen3_6_35b_a3b, qwen3_30b_a3b\)"
    run bench --model "$tiny" --layers 2
    expect_rc 2
    expect_err "error: --layers: only for --synthetic"
    run bench --model "$tiny" --vocab 100
    expect_rc 2
    expect_err "error: --vocab: only for --synthetic"
    run bench --synthetic qwen3_6_35b_a3b --layers 41
    expect_rc 2
    expect_err "error: --layers: 41 is more than the 40 layers of qwen3_6_35b_a3b"
    run bench --model "$tiny" -t 0
    expect_rc 2
    expect_err "error: --threads: must be an integer >= 1, got '0'"
    run bench --model "$tiny" -t 1,x
    expect_rc 2
    expect_err "error: --threads: must be an integer >= 1, got 'x'"
    run bench --model "$tiny" -p 0 -n 0
    expect_rc 2
    expect_err "error: -p and -n are all 0"
    run bench --model "$tiny" -p 1000
    expect_rc 2
    expect_err "error: -p 1000 is above the model's limit of 256 tokens"
    run bench --model "$tiny" -p 200 -n 0 -d 100
    expect_rc 2
    expect_err "error: -p 200 after -d 100 is above the model's limit of 256 tokens"
    run bench --model "$tiny" --kv q4
    expect_rc 2
    expect_err "error: --kv: unknown KV format 'q4'"
    run bench --model "$tiny" -r 0
    expect_rc 2
    expect_err "error: --repetitions: must be an integer >= 1"
    run bench --model "$tiny" -p 4 --plot "$tmp/no/such/dir/p.png"
    expect_rc 2
    expect_err "error: --plot: directory '.*no/such/dir' does not exist"
    run bench --model "$tmp/nothing"
    expect_rc 1
    expect_err "model '.*nothing' does not exist"
    ;;
  bench_plot)  # --plot draws a PNG with the tools venv, or says how to make the venv
    venv_python=$(dirname "$0")/../../tools/.venv/bin/python
    run bench --model "$tiny" -p 4 -n 2 -r 1 -t 1 --plot "$tmp/b.png"
    if [[ -x $venv_python ]] && "$venv_python" -c "import matplotlib" 2>/dev/null; then
      expect_rc 0
      [[ $(head -c 4 "$tmp/b.png" | tail -c 3) == PNG ]] || fail "no PNG written"
      expect_err "bench: wrote .*b.png"
    else
      expect_rc 1
      expect_err "--plot needs matplotlib from the tools venv.*create the venv with: .*tools/setup_venv"
    fi
    ;;
  bench_side_by_side)  # bench/side_by_side.py against a stand-in llama-bench that prints jsonl
    script=$(dirname "$0")/../../bench/side_by_side.py
    gguf=$fixtures/gguf/qwen3_5_moe_tiny-F32.gguf
    cat >"$tmp/llama-bench" <<'PY'
#!/usr/bin/env python3
import json, sys
a = sys.argv
arg = lambda flag: a[a.index(flag) + 1]
assert arg("-o") == "jsonl" and arg("-m").endswith(".gguf")
for t in map(int, arg("-t").split(",")):
    for kind, flag in (("pp", "-p"), ("tg", "-n")):
        for n in map(int, arg(flag).split(",")):
            print(json.dumps({"build_commit": "fake", "build_number": 1, "cpu_info": "cpu", "model_type": "qwen35moe",
                              "n_threads": t, "n_prompt": n if kind == "pp" else 0, "n_gen": n if kind == "tg" else 0,
                              "n_depth": 0, "avg_ts": 100.0 * t, "stddev_ts": 1.0}))
PY
    chmod +x "$tmp/llama-bench"
    "$script" --llama-bench "$tmp/llama-bench" --gguf "$gguf" --qflash "$qflash" -p 8 -n 4 -t 1 -r 1 --rounds 2 \
      >"$tmp/out" 2>"$tmp/err"; echo $? >"$tmp/rc"
    expect_rc 0
    expect_out "^llama.cpp: qwen35moe, build 1 \(fake\)"
    expect_out "^\| test \| threads \| llama.cpp t/s \| qflash t/s \| qflash / llama.cpp \|"
    expect_out "^\| pp8 \| 1 \| 100.00 \| [0-9.]+ \| [0-9.]+ \| [0-9.]+ \| - \| - \|$"
    expect_out "^\| tg4 \| 1 \| 100.00 \| [0-9.]+ \| [0-9.]+ \| [0-9.]+ \| [0-9.]+ \| [0-9.]+ \|$"
    [[ $(grep -c "round [12]/2, " "$tmp/err") == 4 ]] || fail "expected 2 interleaved rounds of each"
    "$script" --llama-bench "$tmp/none" --gguf "$gguf" >"$tmp/out" 2>"$tmp/err"; echo $? >"$tmp/rc"
    expect_rc 1
    expect_err "side_by_side: no llama-bench at '.*none'.*neither downloads nor builds llama.cpp"
    ;;
  budget_qwen36)  # MODELS.md §6: 20,480 B/token of bf16 KV in 10 of 40 layers, 62.8 MiB of state
    run budget --model "$fixtures/qwen3_6_35b_a3b_config" --weights q4_k_m -c 4096,32768 --memory 24GiB
    expect_rc 0
    expect_out "KV bf16: 20480 bytes/token \(10 of 40 layers hold KV, 2 KV heads x 256\); DeltaNet state 62\.8[0-9] MiB per sequence"
    expect_out "^\| 4096 \| 80\.00 MiB \| 62\.8[0-9] MiB \| [0-9.]+ GiB \| [0-9.]+ GiB \| [0-9]+ \|$"
    expect_out "^\| 32768 \| 640\.00 MiB \|"
    run budget --preset qwen3_6_35b_a3b --kv int6 -c 4096
    expect_rc 0
    expect_out "KV int6: 8320 bytes/token"
    run budget --preset qwen3_6_35b_a3b --kv bf16:int6 -c 4096 --seqs 4
    expect_rc 0
    expect_out "KV bf16:int6: 14400 bytes/token"
    expect_out "total, 4 seqs"
    ;;
  budget_tiny)  # a small memory: negative headroom and no sequence fits, stated, not an error
    run budget --model "$tiny" -c 256 --memory 1KiB
    expect_rc 0
    expect_out "^\| 256 \| .* \| -[0-9.]+ [KM]iB \| 0 \|$"
    ;;
  budget_bad_input)
    run budget --model "$tiny" --memory 24XB
    expect_rc 2
    expect_err "error: --memory: '24XB' is not a memory size \(expected e\.g\. 24GiB"
    run budget --model "$tiny" --kv int5
    expect_rc 2
    expect_err "error: --kv: unknown KV format 'int5' \(expected one of: f32, bf16, fp8_e4m3, int8, int6\)"
    run budget --model "$tiny" --kv bf16:
    expect_rc 2
    expect_err "error: --kv: unknown KV format ''"
    run budget --model "$tiny" --preset qwen3_6_35b_a3b
    expect_rc 2
    expect_err "error: --preset and --model exclude each other"
    run budget --preset qwen3_8b
    expect_rc 2
    expect_err "error: --preset: unknown synthetic preset 'qwen3_8b'"
    run budget --model "$tiny" -c 0
    expect_rc 2
    ;;
  serve_flags)  # qflash serve: bad flags exit 2 before the (here broken) weights are read; a load
                # failure after the port is bound exits 1; a port in use exits 1
    rm -rf "$tmp/m"; cp -r "$tiny" "$tmp/m"
    head -c 100 "$tiny/model.safetensors" > "$tmp/m/model.safetensors"
    for flags in "--port 70000" "--max-num-seqs 0" "--max-body-bytes lots" "--kv-cache-memory -1" \
                 "--eviction mru" "--max-n 0" "--max-model-len 100000" "--kv int5" "--http-threads -1" \
                 "--max-tokens-limit -1" "--log-router-decisions $tmp/no/such/dir/log.jsonl" \
                 "--gpu-memory-utilization 0" "--gpu-memory-utilization 1.5" "--gpu-memory-utilization 0.5" \
                 "--gpu-memory-utilization 0.5 --kv-cache-memory 1GiB"; do
      run serve --model "$tmp/m" $flags
      expect_rc 2
      grep -q "model.safetensors" "$tmp/err" && fail "$flags: the model was read first"
      expect_err "^qflash: error: .*"
    done
    run serve --model "$tmp/m" --max-body-bytes lots
    expect_err "error: --max-body-bytes: 'lots' is not a memory size"
    run serve --model "$tmp/m" --max-model-len 100000
    expect_err "error: --max-model-len 100000 is above the model's limit of [0-9]+ tokens"
    run serve --model "$tmp/m" --gpu-memory-utilization 0
    expect_err "error: --gpu-memory-utilization: must be a number in \(0, 1\], got '0'"
    run serve --model "$tmp/m" --gpu-memory-utilization 0.5
    expect_err "error: --gpu-memory-utilization .*applies to a model on a GPU: add --device cuda"
    run serve --model "$tmp/m" --gpu-memory-utilization 0.5 --kv-cache-memory 1GiB
    expect_err "error: --(gpu-memory-utilization|kv-cache-memory) excludes --(kv-cache-memory|gpu-memory-utilization)"
    run serve --model "$tmp/m" --served-model-name ''
    expect_rc 2
    expect_err "error: --served-model-name: must not be empty"
    run serve --model "$tiny" --port 0 --kv-cache-memory 100TiB  # more blocks than block ids
    expect_rc 1
    expect_err "the KV cache budget of [0-9]+ bytes is [0-9]+ blocks of [0-9]+ bytes, more than the pool's 2147483647; give it at most [0-9]+ bytes"
    run serve --model "$tmp/m" --port 0
    expect_rc 1
    expect_err "listening on http://127\.0\.0\.1:[0-9]+ while m loads"
    expect_err "model.safetensors"
    [[ -s "$tmp/out" ]] && fail "printed a ready line for a model that did not load"
    python3 -c 'import socket, time
s = socket.socket(); s.bind(("127.0.0.1", 0)); s.listen(); print(s.getsockname()[1], flush=True); time.sleep(60)' \
      > "$tmp/port" &
    holder=$!
    for _ in $(seq 100); do [[ -s "$tmp/port" ]] && break; sleep 0.1; done
    port=$(cat "$tmp/port")
    run serve --model "$tiny" --port "$port"
    kill "$holder"
    expect_rc 1
    expect_err "error: cannot listen on 127\.0\.0\.1:$port \(is the port in use"
    ;;
  chat)  # qflash chat: lines in, answers out; /reset forgets; the second turn reuses the first's KV
    micro=$(dirname "$fixtures")/../models/qwen3_5_moe-micro
    printf 'Hello\nHow are you?\n/reset\nHello\n' | "$qflash" chat --model "$micro" --temp 0 -n 12 -v \
      >"$tmp/out" 2>"$tmp/err"
    echo $? >"$tmp/rc"
    expect_rc 0
    [[ $(wc -l < "$tmp/out") -ge 3 ]] || fail "expected three answers"
    first=$(sed -n 1p "$tmp/out") third=$(tail -n 1 "$tmp/out")
    [[ -n "$first" && "$first" == "$third" ]] || fail "after /reset, 'Hello' should get the first answer again"
    expect_err "sampling: temperature 0,"
    printf 'Hi\n' | "$qflash" chat --model "$micro" -n 4 -v >"$tmp/out" 2>"$tmp/err"
    expect_err "sampling: temperature 0\.8, top-k 0, top-p 0\.95, min-p 0, repetition penalty 1\.1"
    # A line that is not UTF-8 is refused; the conversation goes on (-v logs each turn).
    printf 'Hi\n\xff\xfe\nHello\n' | "$qflash" chat --model "$micro" --temp 0 -n 4 -v >"$tmp/out" 2>"$tmp/err"
    echo $? >"$tmp/rc"
    expect_rc 0
    expect_err "the line is not valid UTF-8; it was not sent"
    [[ $(grep -c "chat turn [0-9]*:" "$tmp/err") == 2 ]] || fail "expected a turn before and after the refused line"
    # A short context: the oldest turns make room for the next answer; a line too long alone is
    # refused, and the turn after it still has the conversation (one message alone is ~15 tokens).
    long=$(printf 'the quick brown fox jumps over the lazy dog %.0s' $(seq 8))
    printf 'Hello there\nHow are you today?\nTell me more\nAnd then?\n%s\nBye\n' "$long" |
      "$qflash" chat --model "$micro" --temp 0 -n 10 -c 100 -v >"$tmp/out" 2>"$tmp/err"
    echo $? >"$tmp/rc"
    expect_rc 0
    expect_err "\(the oldest turn was dropped to fit the context of 100 tokens\)"
    expect_err "the prompt has [0-9]+ tokens, which leaves no room to generate in a context of 100 tokens; the message was not sent"
    [[ $(grep -c "chat turn [0-9]*:" "$tmp/err") == 5 ]] || fail "expected five turns"
    last=$(sed -n 's/.*chat turn 5: \([0-9]*\) prompt tokens.*/\1/p' "$tmp/err")
    [[ -n "$last" && "$last" -gt 30 ]] || fail "the turn after the refused line lost the conversation ($last prompt tokens)"
    # Answers as long as the context: half of it stays for the conversation's last message.
    printf 'Hello\nHow are you?\n' | "$qflash" chat --model "$micro" --temp 0 -n 64 -c 64 -v >"$tmp/out" 2>"$tmp/err"
    echo $? >"$tmp/rc"
    expect_rc 0
    expect_err "\(the earlier conversation was dropped to fit the context of 64 tokens\)"
    [[ $(grep -c "chat turn [0-9]*:" "$tmp/err") == 2 ]] || fail "expected two turns"
    run chat --model "$micro" -c 100000 </dev/null
    expect_rc 2
    expect_err "--context 100000 is above the model's limit"
    run chat --model "$tiny" </dev/null  # the tiny fixture has no chat template
    expect_rc 1
    expect_err "has no chat template"
    run chat --model "$tiny" --top-p 2
    expect_rc 2
    ;;
  serve_flash_config)  # flash_config.json beside the model: its settings unless a flag says otherwise
    micro=$(dirname "$fixtures")/../models/qwen3_5_moe-micro
    rm -rf "$tmp/m"; cp -r "$micro" "$tmp/m"; rm -f "$tmp/m/SHA256SUMS"
    printf '{"enable_prefix_caching": false, "max_num_seqs": 3, "kv_cache_dtype": "int6"}\n' > "$tmp/m/flash_config.json"
    "$qflash" serve --model "$tmp/m" --port 0 >"$tmp/out" 2>"$tmp/err" & pid=$!
    for _ in $(seq 150); do grep -q "^serving" "$tmp/out" && break; sleep 0.1; done
    kill -TERM "$pid"; wait "$pid"; echo $? >"$tmp/rc"
    expect_rc 0
    expect_err "settings from .*flash_config\.json \(command-line flags win\)"
    expect_err "prefix cache off, compressed KV yes"
    "$qflash" serve --model "$tmp/m" --port 0 --kv f32 >"$tmp/out" 2>"$tmp/err" & pid=$!
    for _ in $(seq 150); do grep -q "^serving" "$tmp/out" && break; sleep 0.1; done
    kill -TERM "$pid"; wait "$pid"
    expect_err "compressed KV no"
    for bad in '{"frobnicate": 1}|unknown key .frobnicate. \(known: max_num_seqs' \
               '{"max_num_seqs": "many"}|field .max_num_seqs. must be an integer >= 1' \
               '{"kv_cache_dtype": "int5"}|field .kv_cache_dtype.' \
               '{"kv_cache_eviction_policy": "mru"}|field .kv_cache_eviction_policy. must be "lru" or "lru_with_age"' \
               '{"kv_cache_dtype": "int6", "kv_compression_map": "m.json"}|exclude each other' \
               '{"gpu_memory_utilization": 2}|field .gpu_memory_utilization. must be a number in \(0, 1\]' \
               '{"gpu_memory_utilization": 0.5, "kv_cache_memory": "1GiB"}|exclude each other' \
               '[1]|the top level must be a JSON object'; do
      printf '%s\n' "${bad%%|*}" > "$tmp/m/flash_config.json"
      run serve --model "$tmp/m" --port 0
      expect_rc 1
      expect_err "flash_config\.json: .*${bad#*|}"
    done
    printf '{"gpu_memory_utilization": 0.5}\n' > "$tmp/m/flash_config.json"
    run serve --model "$tmp/m" --port 0
    expect_rc 2
    expect_err "flash_config\.json's gpu_memory_utilization\) applies to a model on a GPU"
    rm "$tmp/m/flash_config.json"
    printf '{"flash_kernel_fallback": false}\n' > "$tmp/fc.json"
    run serve --model "$fixtures/qwen3_moe_tiny" --port 0 --flash-config "$tmp/fc.json"
    expect_rc 1
    expect_err "flash_kernel_fallback is false, but no specialised instance runs this model"
    ;;
  run_generation_defaults)  # run samples with generation_config.json's settings unless a flag says otherwise
    rm -rf "$tmp/m"; cp -r "$tiny" "$tmp/m"; rm -f "$tmp/m/SHA256SUMS"
    printf '{"do_sample": true, "temperature": 0.7, "top_k": 20, "eos_token_id": 0}\n' > "$tmp/m/generation_config.json"
    run run --model "$tmp/m" -p Hello -n 2 -v
    expect_rc 0
    expect_err "sampling: temperature 0\.7, top-k 20, top-p 1,"
    run run --model "$tmp/m" -p Hello -n 2 -v --temp 0
    expect_err "sampling: temperature 0, top-k 20,"
    printf '{"do_sample": true, "top_p": 1.5}\n' > "$tmp/m/generation_config.json"
    run run --model "$tmp/m" -p Hello -n 2
    expect_rc 1
    expect_err "generation_config.json: field 'top_p' must be a number in \(0, 1\]"
    ;;
  *) echo "unknown case $case"; exit 2 ;;
esac
echo "PASS ($case)"
