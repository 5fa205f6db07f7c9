# Phase `kernel-profile` (sourced by scripts/gpu-call.sh; uses its `run`, $B and $OUT): every
# kernel of a TinyLlama-preset `tilearn bench --steps 1` under Nsight Compute (time and DRAM
# bytes, one at a time), grouped by scripts/step_breakdown.py, with the raw CSV kept as
# $OUT/kernels_tinyllama.csv.xz so the largest kernels can be ranked afterwards. About 2 minutes.
ncu_bin=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
if [ -z "$ncu_bin" ]; then
  echo "kernel-profile: ncu not found (not run)"
else
  run kp_bench "$B/bin/tilearn" bench --preset tinyllama-1.1b --steps 10 --json
  run kp_ncu timeout 400 "$ncu_bin" --csv --page raw \
    --metrics gpu__time_duration.sum,dram__bytes.sum --cache-control none \
    --clock-control none "$B/bin/tilearn" bench --preset tinyllama-1.1b --steps 1 --json
  run kp_split python3 scripts/step_breakdown.py --kernels "$OUT/kp_ncu.log" \
    --bench "$OUT/kp_bench.log" --embedding-params 65536000 --label tinyllama-1.1b
  cat "$OUT/kp_split.log"
  grep '^"' "$OUT/kp_ncu.log" | xz -T4 -6 > "$OUT/kernels_tinyllama.csv.xz"
fi
