# Phase `breakdown` (sourced by scripts/gpu-call.sh; uses its `run`, $B and $OUT): issue 13's
# side-by-side table and the step's time breakdown, in one call. Needs the Liger-Kernel wheel
# carried as .whl/ (see the device README; installed to /tmp/site here).
#  1. tilearn bench, both presets, bf16 default mode;
#  2. PyTorch eager with Liger-Kernel's Llama patch, pure-bf16 weights and fp32 masters +
#     autocast (the HF Trainer's --bf16), and plain eager, same shapes;
#  3. one profiled tilearn bench per preset under ncu (kernel times and DRAM bytes), grouped by
#     scripts/step_breakdown.py into GEMMs, attention, norms+elementwise, loss, optimizer, idle.
# About 5 minutes.
if ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
declare -A EMB=([llama-134m]=24576000 [tinyllama-1.1b]=65536000)
for preset in llama-134m tinyllama-1.1b; do
  run "bd_bench_$preset" "$B/bin/tilearn" bench --preset "$preset" --steps 10 --json
  grep -h '"impl"' "$OUT/bd_bench_$preset.log" >> "$OUT/breakdown_table.jsonl"
  for weights in bf16 fp32; do
    run "bd_torch_${preset}_$weights" timeout 300 python3 benches/pytorch_baseline.py \
      --preset "$preset" --mode eager liger --weights "$weights" --steps 10
    grep -h '"impl"' "$OUT/bd_torch_${preset}_$weights.log" >> "$OUT/breakdown_table.jsonl"
  done
  ncu_bin=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
  if [ -n "$ncu_bin" ]; then
    run "bd_ncu_$preset" timeout 400 "$ncu_bin" --csv --page raw \
      --metrics gpu__time_duration.sum,dram__bytes.sum --cache-control none \
      --clock-control none "$B/bin/tilearn" bench --preset "$preset" --steps 1 --json
    run "bd_split_$preset" python3 scripts/step_breakdown.py --kernels "$OUT/bd_ncu_$preset.log" \
      --bench "$OUT/bd_bench_$preset.log" --embedding-params "${EMB[$preset]}" --label "$preset"
    grep -h '^{' "$OUT/bd_split_$preset.log" >> "$OUT/breakdown.jsonl"
    cat "$OUT/bd_split_$preset.log"
  else
    echo "breakdown: ncu not found, no profile (skipped)"
  fi
done
