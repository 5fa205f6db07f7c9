# Phase `ws` (sourced by scripts/gpu-call.sh; uses its `run`, $B and $OUT): issue 13 goal 1, the
# Hopper attention kernels (the TMA forward, the warp-specialised one-pass backward
# dkdv_ws_kernel and the two-kernel dK/dV sharing its step), in one call:
#   1. the development harness (hopper-bin/harness, when carried): every shape's correctness
#      (one-pass dk / dv bit for bit against the deterministic backward, which is bit for bit
#      mma.sync's; dq within its bound; the TMA forward bit for bit against the cp.async one),
#      then the timings of mma.sync, deterministic, one-pass, and of both forwards;
#   2. GPU tests of the attention kernels and of the models that train through them (WS_TESTS);
#   3. attention alone: gemm-bench attention beside torch SDPA's cuDNN and FlashAttention-2
#      backends, to $OUT/attn_table.jsonl;
#   4. end to end: tilearn bench, TinyLlama at 1 x 16 K with checkpointing and at its preset
#      (8 x 2048), with the one-pass and the deterministic backward, and with the forward's
#      cp.async loads instead of TMA (TILEARN_FLASH_SM90_FWD_TMA=0), to $OUT/e2e_table.jsonl.
if [ -x hopper-bin/harness ]; then
  run flash_harness timeout 240 hopper-bin/harness
else
  echo "flash harness: hopper-bin/harness not carried (build it with scripts/flash_harness.sh)"
fi
for t in ${WS_TESTS:-gpu_flash_sm90 gpu_matmul_attention gpu_attention_mask gpu_lent_dq_accum gpu_model gpu_cuda_graph}; do
  run "$t" timeout 240 "$B/tests/$t-test" --include-ignored --test-threads=1 --nocapture
done
if [ "${WS_BENCH:-1}" = 1 ]; then
  run attn_default timeout 180 "$B/bin/gemm-bench" attention
  run attn_sdpa timeout 180 python3 benches/sdpa_baseline.py
  grep -h '"bench":"attention"\|"bench": "attention"' "$OUT"/attn_*.log > "$OUT/attn_table.jsonl"
  for flags in "" "--deterministic"; do
    v=${flags:+det}; v=${v:-onepass}
    run "e2e_16k_$v" timeout 150 "$B/bin/tilearn" bench --preset tinyllama-1.1b --batch 1 \
      --seq 16384 --gradient-checkpointing --steps 4 --warmup 2 --json $flags
    run "e2e_tinyllama_$v" timeout 150 "$B/bin/tilearn" bench --preset tinyllama-1.1b --steps 10 \
      --json $flags
  done
  # The forward's cp.async loads (TILEARN_FLASH_SM90_FWD_TMA=0) against the default TMA ones.
  run e2e_16k_cpasync timeout 150 env TILEARN_FLASH_SM90_FWD_TMA=0 "$B/bin/tilearn" bench \
    --preset tinyllama-1.1b --batch 1 --seq 16384 --gradient-checkpointing --steps 4 --warmup 2 \
    --json
  run e2e_tinyllama_cpasync timeout 150 env TILEARN_FLASH_SM90_FWD_TMA=0 "$B/bin/tilearn" bench \
    --preset tinyllama-1.1b --steps 10 --json
  run attn_cpasync timeout 180 env TILEARN_FLASH_SM90_FWD_TMA=0 "$B/bin/gemm-bench" attention
  grep -h '"bench":"attention"\|"bench": "attention"' "$OUT"/attn_*.log > "$OUT/attn_table.jsonl"
  grep -h '"impl"' "$OUT"/e2e_*.log > "$OUT/e2e_table.jsonl"
fi
