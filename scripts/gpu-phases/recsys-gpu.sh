# Issue 16, third round (tilearn-recsys): sharded training with GPU ranks; sourced by
# scripts/gpu-call.sh (uses run, $B, $OUT); about 2 minutes:
#   * tests/ctr_sharded_gpu.rs: two ranks sharing the GPU (host communicator, device buffers
#     staged through pinned memory) against one GPU rank, table-wise and row-wise, Adagrad and
#     SparseAdam (losses, AUC, every table row); exact resume of a 2-rank GPU checkpoint (and
#     the same checkpoint continued on one GPU); the sharded trainer over one-rank NCCL;
#   * tests/ctr_gpu.rs again (DeviceCtrModel was split into embedding and dense parts);
#   * samples/s of `tilearn ctr train --device cuda` on one GPU rank against
#     `tilearn launch --nproc-per-node 2 ctr train --device cuda --ddp-backend host` (both ranks
#     on this one GPU, --shard table and --shard row) on the same data and flags. On one shared
#     GPU the 2-rank figure measures the sharding's overhead (ids over TCP, device buffers staged
#     through the host for every all-to-all and the all-reduce), not a speed-up.
run recsys_gpu_sharded "$B/tests/ctr_sharded_gpu-test" --include-ignored --test-threads=1 --nocapture
run recsys_gpu_ctr "$B/tests/ctr_gpu-test" --include-ignored --test-threads=1 --nocapture

shard_flags=(ctr train --device cuda --steps 120 --eval-every 60 --batch-size 8192
  --synthetic-samples 400000 --hash-rows 100000)
run recsys_gpu_train_one_rank timeout 60 "$B/bin/tilearn" "${shard_flags[@]}" \
  --output-dir "$OUT/rg_one"
for mode in table row; do
  run "recsys_gpu_train_two_ranks_$mode" timeout 90 "$B/bin/tilearn" launch --nproc-per-node 2 \
    --standalone "${shard_flags[@]}" --shard "$mode" --ddp-backend host \
    --output-dir "$OUT/rg_two_$mode"
done
for d in rg_one rg_two_table rg_two_row; do
  cp "$OUT/$d/train_log.jsonl" "$OUT/recsys_gpu_$d.jsonl" 2>/dev/null
  rm -rf "${OUT:?}/$d"
done
# The last window's samples/s of each run, one line each.
for d in rg_one rg_two_table rg_two_row; do
  echo "$d $(tail -n 1 "$OUT/recsys_gpu_$d.jsonl" 2>/dev/null)"
done | tee "$OUT/recsys_gpu_samples_per_sec.txt"
