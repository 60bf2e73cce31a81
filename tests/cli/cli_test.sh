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
  bad_ids)
    run logits --model "$tiny" --prompt-ids 1,x,3 --output "$tmp/l.npy"
    expect_rc 1
    expect_err "error: --prompt-ids: 'x' is not a non-negative integer"
    run logits --model "$tiny" --prompt-ids 1,999 --output "$tmp/l.npy"
    expect_rc 1
    expect_err "token id 999 is outside the vocabulary \[0, 256\)"
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
    expect_rc 1
    expect_err "top_p must be in \(0, 1\]"
    ;;
  config_only_run)
    run run --model "$fixtures/qwen3_6_35b_a3b_config" --prompt hi
    expect_rc 1
    expect_err "no weights"
    ;;
  *) echo "unknown case $case"; exit 2 ;;
esac
echo "PASS ($case)"
