# Phase `unzeroed` (sourced by scripts/gpu-call.sh; uses its `run`, $B and $OUT): the CUDA-graph
# step without its gradient-zeroing pass (`Handoff::unzeroed`: each weight's first product
# writes its gradient), in one call.
#  1. the GPU tests that run graph steps or the weight-gradient products: the written-gradient
#     op test, graph steps against eager steps bit for bit, the Hugging Face goldens, families,
#     per-layer weight copy, fused loss head, checkpoint offload, MLP chunks, SFT masks;
#  2. tilearn bench, this build against the previous one ($B/bin/tilearn-base, carried),
#     alternating: TinyLlama twice each, llama-134m once each;
#  3. gemm-bench step (the step's products, weight gradients written) for 20 s;
#  4. the main job on the GPU.
for t in gpu_matmul_attention gpu_cuda_graph gpu_model gpu_families gpu_weight_copy gpu_lce \
         gpu_checkpoint_offload gpu_mlp_chunk gpu_sft; do
  [ -x "$B/tests/$t-test" ] && run "uz_$t" timeout 240 "$B/tests/$t-test" --include-ignored \
    --test-threads=1 --nocapture
done
grep -h "test result" "$OUT"/uz_gpu_*.log
for round in 1 2; do
  for bin in tilearn-base tilearn; do
    run "uz_bench_tinyllama_${bin}_$round" "$B/bin/$bin" bench --preset tinyllama-1.1b --steps 10 --json
  done
done
for bin in tilearn-base tilearn; do
  run "uz_bench_134m_$bin" "$B/bin/$bin" bench --preset llama-134m --steps 10 --json
done
grep -h '"impl"' "$OUT"/uz_bench_*.log > "$OUT/uz_bench.jsonl"
run uz_step_products timeout 60 "$B/bin/gemm-bench" step --preset tinyllama-1.1b --seconds 20
run uz_train timeout 120 "$B/bin/tilearn" train --device cuda --max-steps 60 --output-dir /tmp/uz_train \
  --save-steps 0 --logging-steps 20
