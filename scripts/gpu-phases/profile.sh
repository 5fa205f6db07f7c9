# Phase `profile` (sourced by scripts/gpu-call.sh; uses its `run`, $B and $OUT): the step
# breakdown of scripts/gpu-phases/breakdown.sh without the PyTorch runs: tilearn bench and one
# ncu-profiled step per preset, grouped by scripts/step_breakdown.py. About 3 minutes.
declare -A EMB=([llama-134m]=24576000 [tinyllama-1.1b]=65536000)
ncu_bin=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
for preset in llama-134m tinyllama-1.1b; do
  run "pf_bench_$preset" "$B/bin/tilearn" bench --preset "$preset" --steps 10 --json
  if [ -z "$ncu_bin" ]; then echo "profile: ncu not found (skipped)"; continue; fi
  run "pf_ncu_$preset" timeout 400 "$ncu_bin" --csv --page raw \
    --metrics gpu__time_duration.sum,dram__bytes.sum --cache-control none \
    --clock-control none "$B/bin/tilearn" bench --preset "$preset" --steps 1 --json
  run "pf_split_$preset" python3 scripts/step_breakdown.py --kernels "$OUT/pf_ncu_$preset.log" \
    --bench "$OUT/pf_bench_$preset.log" --embedding-params "${EMB[$preset]}" --label "$preset"
  grep -h '^{' "$OUT/pf_split_$preset.log" >> "$OUT/profile.jsonl"
  grep -h '^#' "$OUT/pf_split_$preset.log"
done
