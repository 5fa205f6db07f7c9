# Phase `zero-split` (sourced by scripts/gpu-call.sh; uses its `run`, $B and $OUT): ZeRO around
# tensor and pipeline parallelism on the GPU engine (the ranks sharing one GPU):
#   1. the engine's rank-on-thread tests of the split backends (gpu_model_parallel,
#      gpu_pipeline_parallel), whose weight loading the ZeRO change rewrote;
#   2. the launcher tests with ZeRO in their name (gpu_model_parallel_launch): ZeRO-1/2 around
#      tp 2 and ZeRO-1 around pp 2 against one process, a ZeRO-2 tp 2 × dp 2 checkpoint resumed
#      on its layout and in one process, bf16 ZeRO-1 around tp 2 against plain replicas.
for t in gpu_model_parallel gpu_pipeline_parallel; do
  run "$t" timeout 240 "$B/tests/$t-test" --include-ignored --test-threads=1 --nocapture
done
run zero_launch timeout 300 "$B/tests/gpu_model_parallel_launch-test" zero --include-ignored \
  --test-threads=1 --nocapture
