# Phase `unmeasured-tests`: part 1 of `unmeasured` (see unmeasured.sh). TEST_TIMEOUT bounds each
# test binary (default 300 s); UNMEASURED_TESTS replaces the list (e.g. to re-run one).
for t in ${UNMEASURED_TESTS:-gpu_pipeline_parallel gpu_flash_sm90 gpu_model_parallel_launch gpu_lean \
  gpu_model_parallel gpu_data_parallel}; do
  run "$t" timeout "${TEST_TIMEOUT:-300}" "$B/tests/$t-test" --include-ignored --test-threads=1 --nocapture
done
