# Phase `tbe-speed` (sourced by scripts/gpu-call.sh; uses its `run`, $B and $OUT), ~2-3 min: the
# embedding-bag backward with hot rows split into 32-entry chunks (issue 16, "embedding operator
# >= FBGEMM"). The GPU tests (SGD / SparseAdam bit-identical with the CPU reference's chunked
# order, runs crossing every chunk boundary, Adagrad within 1e-5, bit-identical reruns; the GPU
# DeepFM / Wide & Deep steps that use the operator), then the operator's forward + backward +
# update at the four configurations measured against FBGEMM's TBE (tilearn 1.98 / 8.99 / 1.49 /
# 6.10 ms vs FBGEMM 0.82 / 1.84 / 1.26 / 1.16 ms before this change), and one SparseAdam config.
run tbe_embedding_bag_gpu "$B/tests/embedding_bag_gpu-test" --include-ignored --test-threads=1 --nocapture
run tbe_ctr_gpu "$B/tests/ctr_gpu-test" --include-ignored --test-threads=1 --nocapture
for cfg in "100000 128 16384" "1000000 128 65536" "1000000 16 16384" "10000000 16 65536"; do
  read -r rows dim batch <<< "$cfg"
  run "tbe_bench_adagrad_r${rows}_d${dim}_b${batch}" timeout 100 "$B/bin/recsys-bench" \
    --tables 26 --rows "$rows" --dim "$dim" --batch "$batch" --zipf 1.05 --optimizer adagrad
done
run tbe_bench_adam_r100000_d128_b65536 timeout 100 "$B/bin/recsys-bench" \
  --tables 26 --rows 100000 --dim 128 --batch 65536 --zipf 1.05 --optimizer adam
grep -h '^{' "$OUT"/tbe_bench_*.log > "$OUT/tbe_bench.jsonl" 2>/dev/null
