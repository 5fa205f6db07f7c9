# Phase `dq-accum` (sourced by scripts/gpu-call.sh; uses its `run`, $B and $OUT): the one-pass
# Hopper flash backward (dQ by f32 atomic adds into the workspace's dq_accum) and
# `--deterministic`. About 2 minutes:
#  1. gpu_flash_sm90: the Hopper kernels against the mma.sync ones, and the one-pass backward
#     against the deterministic one (dq within 2e-3 bf16 / 1e-3 f16, dk dv within 1e-6, two
#     one-pass runs alike; a too-small workspace and a masked call deterministic bit for bit);
#  2. the engine tests that compare GPU runs bit for bit, now built deterministic (CUDA graph vs
#     eager, checkpointing, precision switching, lean vs default);
#  3. tilearn bench, both presets, default (one-pass) vs --deterministic: tokens/s and peak
#     memory (the JSON line's `deterministic` says which), to $OUT/dq_accum_bench.jsonl.
run dq_flash_sm90 timeout 240 "$B/tests/gpu_flash_sm90-test" --include-ignored --test-threads=1 \
  --nocapture
run dq_cuda_graph timeout 200 "$B/tests/gpu_cuda_graph-test" --include-ignored \
  --test-threads=1 --nocapture
run dq_model_checkpointing timeout 120 "$B/tests/gpu_model-test" gradient_checkpointing \
  --include-ignored --test-threads=1 --nocapture
run dq_precision timeout 150 "$B/tests/gpu_precision-test" --include-ignored --test-threads=1 \
  --nocapture
run dq_lean timeout 200 "$B/tests/gpu_lean-test" --include-ignored --test-threads=1 --nocapture
for preset in llama-134m tinyllama-1.1b; do
  for mode in one-pass deterministic; do
    flags=(); [ "$mode" = deterministic ] && flags=(--deterministic)
    run "dq_bench_${preset}_$mode" timeout 150 "$B/bin/tilearn" bench --preset "$preset" \
      --steps 10 "${flags[@]}" --json
    grep -h '"impl"' "$OUT/dq_bench_${preset}_$mode.log" >> "$OUT/dq_accum_bench.jsonl"
  done
done
