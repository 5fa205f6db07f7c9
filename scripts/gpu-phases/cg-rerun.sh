# Phase `cg-rerun`: the CUDA-graph engine test and a 40-step train under auto (the first-step
# note), without the benches (scripts/gpu-phases/cuda-graphs.sh has them).
run cg_engine "$B/tests/gpu_cuda_graph-test" --include-ignored --test-threads=1 --nocapture
run cg_train_auto "$B/bin/tilearn" train --device cuda --bf16 --max-steps 40 --logging-steps 1 \
  --save-steps 0 --output-dir "$OUT/cg_run_auto" --cuda-graphs auto --no-samples
grep -h "CUDA graphs" "$OUT/cg_train_auto.log" | head -5
rm -rf "$OUT/cg_run_auto"
