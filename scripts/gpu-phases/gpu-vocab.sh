# Vocabulary-parallel embedding, lm_head and cross entropy under tensor parallelism on the GPU
# engine (sourced by scripts/gpu-call.sh: uses run, $B, $OUT). About a minute of device time.
# 1. crates/tilearn-ops/tests/gpu_vocab_parallel.rs: the new kernels (embedding slices, the
#    vocabulary-parallel cross entropy's three steps) against their CPU reference, and the
#    whole pipeline against the whole-vocabulary fused kernel, f32/bf16/f16 (~seconds).
# 2. crates/tilearn-engine/tests/gpu_model_parallel.rs: tp 2 (two ranks sharing the GPU over the
#    host communicator) with the vocabulary-parallel head against one rank: fp32, bf16, fp32
#    with gradient checkpointing, fp32 with tied embeddings (vocab 257 = 129 + 128: uneven),
#    the per-rank logits-chunk bytes, and tp 2 checkpoints resumed on one rank, on tp 2 (bit
#    for bit) and from one rank.
run gpu_vocab_kernels "$B/tests/gpu_vocab_parallel-test" --include-ignored --test-threads=1 --nocapture
run gpu_vocab_tp_tests "$B/tests/gpu_model_parallel-test" --include-ignored --test-threads=1 --nocapture
grep -hE "logits chunk|rel|bit|differ|step [0-9]" "$OUT/gpu_vocab_tp_tests.log" > "$OUT/gpu_vocab_summary.txt" 2>/dev/null || true
