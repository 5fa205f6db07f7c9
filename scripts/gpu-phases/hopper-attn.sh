# Phase `hopper` (sourced by scripts/gpu-call.sh; uses its `run`, $B and $OUT): issue 13 goal 1,
# the Hopper (wgmma) flash-attention kernels, in one call:
#   1. GPU tests: the Hopper kernels against the mma.sync ones (gpu_flash_sm90), the attention
#      files against the f64 CPU reference (which run the Hopper kernels where they apply), the
#      model and CUDA-graph tests that train through them;
#   2. attention alone: gemm-bench attention with the mma.sync kernels (TILEARN_FLASH_SM80=1)
#      and with the device's choice, beside torch SDPA's cuDNN / FlashAttention-2 / efficient
#      backends (benches/sdpa_baseline.py), all to $OUT/attn_table.jsonl;
#   3. end to end: tilearn bench on both presets and at 1 x 16 K with checkpointing, beside
#      Liger-Kernel (pure bf16 presets; autocast at 16 K, as the long-context table),
#      then the presets again with the mma.sync kernels; all to $OUT/e2e_table.jsonl.
# HOPPER_TESTS names the test binaries (default: all six).
if ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
for t in ${HOPPER_TESTS:-gpu_flash_sm90 gpu_matmul_attention gpu_attention_mask gpu_family_ops gpu_model gpu_cuda_graph}; do
  run "$t" timeout 240 "$B/tests/$t-test" --include-ignored --test-threads=1 --nocapture
done
run attn_sm80 timeout 120 env TILEARN_FLASH_SM80=1 "$B/bin/gemm-bench" attention
run attn_wgmma timeout 120 "$B/bin/gemm-bench" attention
run attn_sdpa timeout 120 python3 benches/sdpa_baseline.py
grep -h '"bench":"attention"\|"bench": "attention"' "$OUT"/attn_*.log > "$OUT/attn_table.jsonl"
e2e() { # name, kernels (sm80|wgmma), tilearn bench flags...
  local name=$1 kernels=$2; shift 2
  local sw=(); [ "$kernels" = sm80 ] && sw=(env TILEARN_FLASH_SM80=1)
  run "e2e_${name}_$kernels" timeout 150 "${sw[@]}" "$B/bin/tilearn" bench "$@" --json
  grep -h '"impl"' "$OUT/e2e_${name}_$kernels.log" | sed "s/^{/{\"kernels\":\"$kernels\",\"case\":\"$name\",/" >> "$OUT/e2e_table.jsonl"
}
liger() { # name, baseline flags...
  local name=$1; shift
  run "liger_$name" timeout 200 python3 benches/pytorch_baseline.py --mode liger "$@"
  grep -h '"impl"' "$OUT/liger_$name.log" | sed "s/^{/{\"case\":\"$name\",/" >> "$OUT/e2e_table.jsonl"
}
for k in wgmma sm80; do
  e2e llama-134m "$k" --preset llama-134m --steps 10
  e2e tinyllama "$k" --preset tinyllama-1.1b --steps 10
  [ "$k" = wgmma ] && e2e long16k "$k" --preset tinyllama-1.1b --batch 1 --seq 16384 \
    --gradient-checkpointing --steps 5
  [ "$k" = wgmma ] && { liger llama-134m --preset llama-134m --weights bf16 --steps 10
    liger tinyllama --preset tinyllama-1.1b --weights bf16 --steps 10
    liger long16k --preset tinyllama-1.1b --weights fp32 --batch 1 --seq 16384 \
      --gradient-checkpointing --steps 5; }
done
