# Phase `hd128` (sourced by scripts/gpu-call.sh; uses its `run`, $B and $OUT): issue 13 goal 1,
# the head_dim-128 Hopper kernels (forward and the two-kernel backward), in one call:
#   1. the development harness (hopper-bin/harness, when carried): every shape's correctness,
#      then the timings of head_dim 64 (mma.sync, deterministic, one-pass) and 128 (mma.sync,
#      wgmma);
#   2. GPU tests: the Hopper kernels against the mma.sync ones (gpu_flash_sm90), the attention
#      files against the f64 CPU reference, and the model tests that train through them
#      (HD128_TESTS names them);
#   3. attention alone: gemm-bench attention with the device's choice and with head_dim 128 on
#      mma.sync (TILEARN_FLASH_SM90_HD128=0), beside torch SDPA's cuDNN and FlashAttention-2
#      backends, to $OUT/attn_table.jsonl.
if [ -x hopper-bin/harness ]; then
  run flash_harness timeout 200 hopper-bin/harness
else
  echo "flash harness: hopper-bin/harness not carried (build it with scripts/flash_harness.sh)"
fi
for t in ${HD128_TESTS:-gpu_flash_sm90 gpu_matmul_attention gpu_attention_mask gpu_family_ops gpu_lent_dq_accum gpu_model gpu_families}; do
  run "$t" timeout 240 "$B/tests/$t-test" --include-ignored --test-threads=1 --nocapture
done
run attn_default timeout 180 "$B/bin/gemm-bench" attention
run attn_hd128_mma timeout 180 env TILEARN_FLASH_SM90_HD128=0 "$B/bin/gemm-bench" attention
run attn_sdpa timeout 180 python3 benches/sdpa_baseline.py
grep -h '"bench":"attention"\|"bench": "attention"' "$OUT"/attn_*.log > "$OUT/attn_table.jsonl"
