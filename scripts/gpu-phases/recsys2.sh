# Issue 16, second round (tilearn-recsys): tables larger than the GPU and the bf16 MLP, on one
# GPU; sourced by scripts/gpu-call.sh (uses run, $B, $OUT); about 2 minutes:
#   * the GPU tests: row_copy.cu against its host reference, DeepFM trained through the row
#     cache (pinned host rows) bit for bit equal to all rows on the GPU, bf16 MLP against f32
#     (gradients, 300-step training); the embedding-bag tests (their cache test changed API);
#   * `tilearn ctr bench`, 26 tables of 10^6 rows (dim 16, row-wise Adagrad: ~1.9 GB of
#     embeddings) with every row on the GPU, then with a 1 GiB embedding budget (about half of
#     the tables in pinned host memory behind GPU caches): samples/s, hit rate, row traffic and
#     its bandwidth, held-out AUC after the same samples;
#   * `tilearn ctr bench` with the MLP in fp32 and bf16, at the default widths (256,128) and a
#     wide MLP (1024,1024,512): samples/s and AUC after the same samples;
#   * `tilearn ctr train` through the cache (64 MiB budget): the log's per-window row_cache;
#   * NCCL's new all_to_all (tilearn-parallel's one-rank NCCL test; the bundle names that file
#     gpu-test or gpu-test-N, so every gpu-test* runs with the test's name as filter).
run recsys2_scale_gpu "$B/tests/ctr_scale_gpu-test" --include-ignored --test-threads=1 --nocapture
run recsys2_embedding_bag_gpu "$B/tests/embedding_bag_gpu-test" --include-ignored --test-threads=1 --nocapture

big=(--batch-size 16384 --steps 60 --warmup 5 --hash-rows 1000000 --synthetic-vocab 1000000 --eval-samples 65536)
run recsys2_bench_all_on_gpu timeout 150 "$B/bin/tilearn" ctr bench --device cuda "${big[@]}"
run recsys2_bench_row_cache timeout 150 "$B/bin/tilearn" ctr bench --device cuda "${big[@]}" \
  --gpu-embedding-budget 1GiB

for h in 256,128 1024,1024,512; do
  for p in fp32 bf16; do
    run "recsys2_bench_${p}_${h//,/x}" timeout 120 "$B/bin/tilearn" ctr bench --device cuda \
      --batch-size 16384 --steps 60 --hidden "$h" --precision "$p"
  done
done

run recsys2_train_row_cache timeout 150 "$B/bin/tilearn" ctr train --device cuda \
  --output-dir "$OUT/recsys2_cache_run" --steps 300 --eval-every 100 --batch-size 4096 \
  --hash-rows 200000 --synthetic-vocab 200000 --synthetic-samples 400000 \
  --gpu-embedding-budget 64MiB
cp "$OUT/recsys2_cache_run/train_log.jsonl" "$OUT/recsys2_train_row_cache.jsonl" 2>/dev/null
rm -rf "$OUT/recsys2_cache_run"
grep -h '^{' "$OUT"/recsys2_bench_*.log > "$OUT/recsys2_bench.jsonl" 2>/dev/null
for t in "$B"/tests/gpu-test*; do
  [ -x "$t" ] || continue  # not packed in this bundle
  run "recsys2_nccl_$(basename "$t")" "$t" nccl_with_one_rank_runs_every_collective --include-ignored --test-threads=1 --nocapture
done
