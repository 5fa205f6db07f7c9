# Phase `onepass` (sourced by scripts/gpu-call.sh; uses its `run`, $B and $OUT): issue 13 goals
# 1 and 6 after the one-pass Hopper backward, the three-CTA forward and the vectorised delta:
#   1. GPU tests: the Hopper kernels (one-pass vs deterministic, deterministic vs mma.sync), the
#      attention files against the f64 CPU reference, and the engine tests that train through
#      the attention (some now in --deterministic mode where they compare bits);
#   2. attention alone: gemm-bench attention (one-pass and deterministic backward, and the
#      mma.sync kernels) beside torch SDPA's cuDNN / FlashAttention-2 backends, to
#      $OUT/attn_table.jsonl;
#   3. end to end on both presets: tilearn bench (default = one-pass, and --deterministic)
#      beside Liger-Kernel with pure bf16 weights, to $OUT/e2e_table.jsonl.
# ONEPASS_PARTS picks parts (default "tests attn e2e"); ONEPASS_TESTS names the test binaries.
if ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
# The CLI tests (gpu_data_parallel) run the bundle's `tilearn`, not cargo's.
export TILEARN_BIN_DIR=${TILEARN_BIN_DIR:-$PWD/$B/bin}
parts=" ${ONEPASS_PARTS:-tests attn e2e} "
[[ $parts == *" tests "* ]] && for t in ${ONEPASS_TESTS:-gpu_flash_sm90 gpu_matmul_attention gpu_attention_mask gpu_family_ops gpu_model gpu_cuda_graph gpu_precision gpu_lean gpu_model_parallel gpu_pipeline_parallel gpu_data_parallel}; do
  [ -x "$B/tests/$t-test" ] || { echo "=== $t: not in the bundle (not run)"; continue; }
  run "$t" timeout 300 "$B/tests/$t-test" --include-ignored --test-threads=1 --nocapture
done
if [[ $parts == *" attn "* ]]; then
  run attn_sm80 timeout 120 env TILEARN_FLASH_SM80=1 "$B/bin/gemm-bench" attention
  run attn_wgmma timeout 120 "$B/bin/gemm-bench" attention
  run attn_sdpa timeout 120 python3 benches/sdpa_baseline.py
  grep -h '"bench":"attention"\|"bench": "attention"' "$OUT"/attn_*.log > "$OUT/attn_table.jsonl"
fi
e2e() { # name, tilearn bench flags...
  local name=$1; shift
  run "e2e_$name" timeout 200 "$B/bin/tilearn" bench "$@" --json
  grep -h '"impl"' "$OUT/e2e_$name.log" | sed "s/^{/{\"case\":\"$name\",/" >> "$OUT/e2e_table.jsonl"
}
liger() { # name, baseline flags...
  local name=$1; shift
  run "liger_$name" timeout 240 python3 benches/pytorch_baseline.py --mode liger "$@"
  grep -h '"impl"' "$OUT/liger_$name.log" | sed "s/^{/{\"case\":\"$name\",/" >> "$OUT/e2e_table.jsonl"
}
if [[ $parts == *" e2e "* ]]; then
  e2e llama-134m --preset llama-134m --steps 10
  e2e tinyllama --preset tinyllama-1.1b --steps 10
  e2e llama-134m-det --preset llama-134m --steps 10 --deterministic
  e2e tinyllama-det --preset tinyllama-1.1b --steps 10 --deterministic
  liger llama-134m --preset llama-134m --weights bf16 --steps 10
  liger tinyllama --preset tinyllama-1.1b --weights bf16 --steps 10
fi
