# Phase `unmeasured-bench`: parts 2 and 3 of `unmeasured` (see unmeasured.sh).
run attn_default timeout 180 "$B/bin/gemm-bench" attention
run attn_hd128 timeout 180 env TILEARN_FLASH_SM90_HD128=1 "$B/bin/gemm-bench" attention
run attn_sdpa timeout 180 python3 benches/sdpa_baseline.py
grep -h '"bench":"attention"\|"bench": "attention"' "$OUT"/attn_*.log > "$OUT/attn_table.jsonl"
for preset in llama-134m tinyllama-1.1b; do
  for memory in default lean; do
    run "lean_bench_${preset}_$memory" timeout 150 "$B/bin/tilearn" bench --preset "$preset" \
      --steps 5 --memory "$memory" --json
  done
done
grep -h '"impl"' "$OUT"/lean_bench_*.log > "$OUT/lean_table.jsonl"
if [ -x hopper-bin/harness ]; then
  run flash_harness timeout 150 hopper-bin/harness
else
  echo "flash harness: hopper-bin/harness not carried (build it with scripts/flash_harness.sh)"
fi
