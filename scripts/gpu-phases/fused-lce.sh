# Phase `fused-lce` (sourced by scripts/gpu-call.sh; uses its `run`, $B and $OUT): the chunked
# loss head (fused linear + cross entropy, issue 13 goal 2). The op-level chunked cross entropy
# and the engine's chunked-vs-unchunked tests first, then both bench presets with the default
# chunking (auto: 4 096 tokens of bf16 logits at vocab 32 000) and unchunked
# (--lce-chunk-tokens 0): tokens/s and peak memory (`peak_mem_gib`: the device memory in use
# beyond what was in use before the model was built, the highest value sampled after the build,
# after every forward/backward and after every step). About 2 minutes.
run lce_ops_chunked "$B/tests/gpu_loss-test" cross_entropy_in_chunks --include-ignored \
  --test-threads=1 --nocapture
run lce_engine "$B/tests/gpu_lce-test" --include-ignored --test-threads=1 --nocapture
for preset in llama-134m tinyllama-1.1b; do
  for chunk in auto 0; do
    run "lce_bench_${preset}_chunk_$chunk" "$B/bin/tilearn" bench --preset "$preset" --steps 10 \
      --lce-chunk-tokens "$chunk" --json
    grep -h '"impl"' "$OUT/lce_bench_${preset}_chunk_$chunk.log" >> "$OUT/lce_bench.jsonl"
  done
done
