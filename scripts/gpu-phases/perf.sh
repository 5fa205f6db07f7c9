# Phase `perf` (sourced by scripts/gpu-call.sh; uses its `run`, $B and $OUT): issue 13's
# side-by-side throughput table without the profile (scripts/gpu-phases/breakdown.sh has it):
# tilearn bench on both presets (bf16 default mode) next to PyTorch eager with Liger-Kernel's
# Llama patch in both weight settings, same call. Needs the Liger wheel carried as .whl/.
# About 2 minutes.
if ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
for preset in llama-134m tinyllama-1.1b; do
  run "perf_bench_$preset" "$B/bin/tilearn" bench --preset "$preset" --steps 10 --json
  grep -h '"impl"' "$OUT/perf_bench_$preset.log" >> "$OUT/perf_table.jsonl"
  for weights in bf16 fp32; do
    run "perf_liger_${preset}_$weights" timeout 200 python3 benches/pytorch_baseline.py \
      --preset "$preset" --mode liger --weights "$weights" --steps 10
    grep -h '"impl"' "$OUT/perf_liger_${preset}_$weights.log" >> "$OUT/perf_table.jsonl"
  done
done
