# Phase `unmeasured` (sourced by scripts/gpu-call.sh; uses its `run`, $B and $OUT): what the
# sessions of 2026-12-03 without device time built, in one single-GPU call (about 8 minutes):
#   1. tests: the launcher's model-parallel wiring (gpu_model_parallel_launch: tp 2 x dp 2 on
#      one GPU, the two-GPU cases skip saying so), the Hopper attention (gpu_flash_sm90, with the
#      experimental head_dim-128 forward against mma.sync), the lean mode after its one-pass
#      host step (gpu_lean), data parallelism's default backend (gpu_data_parallel), GPU tensor
#      and pipeline parallelism over the host communicator as before (gpu_model_parallel,
#      gpu_pipeline_parallel);
#   2. attention alone at the four shapes (7B's head_dim 128 included): gemm-bench with the
#      device's default kernels and with TILEARN_FLASH_SM90_HD128=1, beside SDPA's cuDNN and
#      FlashAttention-2 backends; and the flash harness (scripts/flash_harness.sh, carried as
#      hopper-bin/) when present; all attention lines to $OUT/attn_table.jsonl;
#   3. the lean mode's step at both presets (tilearn bench --memory lean) against the default,
#      to compare with bench/RESULTS.md's 167.1 K / 20.7 K tok/s before the one-pass host step.
. scripts/gpu-phases/unmeasured-tests.sh
. scripts/gpu-phases/unmeasured-bench.sh
