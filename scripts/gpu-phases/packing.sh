# Phase `packing` (sourced by scripts/gpu-call.sh; uses its `run`, $B and $OUT), ~1-2 min:
# attention under key masks (packed examples, sliding window) and RoPE at positions against the
# CPU reference, the packed-row == examples-alone check on the GPU engine, and the attention
# bench causal vs packed (examples of 256 and 64 tokens) vs a sliding window of 512, bf16.
run packing_gpu_attention_mask "$B/tests/gpu_attention_mask-test" --include-ignored --test-threads=1 --nocapture
run packing_gpu_sft "$B/tests/gpu_sft-test" --include-ignored --test-threads=1 --nocapture
run packing_bench_causal "$B/bin/gemm-bench" attention --dtype bf16
run packing_bench_examples_256 "$B/bin/gemm-bench" attention --dtype bf16 --example-len 256
run packing_bench_examples_64 "$B/bin/gemm-bench" attention --dtype bf16 --example-len 64
run packing_bench_window_512 "$B/bin/gemm-bench" attention --dtype bf16 --sliding-window 512
