# Phase `fam-ops` (sourced by scripts/gpu-call.sh; uses its `run`, $B and $OUT), ~1-2 min: the ops
# Bloom and Baichuan-13B add (ALiBi attention in the flash and cuBLASLt paths, LayerNorm with
# bias, tanh-GeLU) against the f64 CPU reference, the CPU LayerNorm/GeLU against PyTorch, the
# hard-coded ALiBi slopes against transformers' build_alibi_tensor, the existing masked-attention
# and cached-attention tests (the plain and masked kernels must be unchanged), and attention fwd+bwd timings at the
# preset shapes (llama-134m, TinyLlama) causal vs ALiBi vs packed + ALiBi, bf16.
run famops_gpu_family_ops "$B/tests/gpu_family_ops-test" --include-ignored --test-threads=1 --nocapture
run famops_alibi_slopes python3 scripts/alibi_slopes_reference.py --check
run famops_gpu_attention_mask "$B/tests/gpu_attention_mask-test" --include-ignored --test-threads=1 --nocapture
run famops_gpu_cached_attention "$B/tests/gpu_cached_attention-test" --include-ignored --test-threads=1 --nocapture
run famops_bench_causal "$B/bin/gemm-bench" attention --dtype bf16
run famops_bench_alibi "$B/bin/gemm-bench" attention --dtype bf16 --alibi
run famops_bench_alibi_packed_256 "$B/bin/gemm-bench" attention --dtype bf16 --alibi --example-len 256
