# Phase `regress` (sourced by scripts/gpu-call.sh; uses its `run`, $B and $OUT): the engine's
# GPU tests not covered by the `kernels` and `model` phases or by a feature's own phase.
for t in gpu_lce gpu_sft gpu_generate gpu_data_parallel gpu_eval ctr_gpu; do
  [ -x "$B/tests/$t-test" ] && run "regress_$t" "$B/tests/$t-test" --include-ignored \
    --test-threads=1 --nocapture
done
