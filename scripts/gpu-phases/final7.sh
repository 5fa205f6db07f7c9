# Phase `final7` (sourced by scripts/gpu-call.sh; uses its `run`, $B and $OUT): the seventh
# session's last build checked on the GPU before its figures are quoted:
#   * the kernel tests its changes touch: gpu-test (every op against the CPU reference, the
#     SwiGLU and RMSNorm kernels among them), gpu_flash_sm90, gpu_matmul_attention, gpu_model,
#     gpu_cuda_graph;
#   * the main job (`tilearn train`, the embedded default, on the GPU, 60 steps);
#   * TinyLlama at 1 x 16 K with checkpointing (tilearn bench, the default kernels).
# Run it with the `breakdown` phase (the side-by-side table beside Liger-Kernel and the step's
# time breakdown). About 3 minutes without `breakdown`.
for t in gpu gpu_flash_sm90 gpu_matmul_attention gpu_model gpu_cuda_graph; do
  run "final_$t" timeout 240 "$B/tests/$t-test" --include-ignored --test-threads=1
done
run final_train timeout 200 "$B/bin/tilearn" train --device cuda --output-dir "$OUT/run" \
  --max-steps 60 --save-steps 0 --logging-steps 10
cp "$OUT/run/train_log.jsonl" "$OUT/final_train_log.jsonl" 2>/dev/null
rm -rf "$OUT/run"
run final_16k timeout 150 "$B/bin/tilearn" bench --preset tinyllama-1.1b --batch 1 --seq 16384 \
  --gradient-checkpointing --steps 4 --warmup 2 --json
