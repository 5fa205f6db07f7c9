# Phase `power-floor` (sourced by scripts/gpu-call.sh; uses its `run`, $B and $OUT): issue 13
# goal 6 at TinyLlama against the board's power limit, in one call. Needs the Liger-Kernel wheel
# carried as .whl/ for the Liger run (see the device README; installed to /tmp/site here).
#  1. benches/power_floor.py floor, both presets: the step's products replayed at the power
#     limit, through torch.mm and through tilearn's own calls (gemm-bench step), and a copy's
#     power, so the energy floor of a step (the attention and memory-bound kernel times are the
#     step's own at full clock, from the last breakdown: RESULTS.md, "Issue 13 goal 6 and the
#     power limit");
#  2. tilearn bench with nvidia-smi sampling (SM clock, power, throttle reasons), then the
#     lm_head chunk at 4 096 tokens against the default 2 048;
#  3. HF + Liger-Kernel (pure bf16) with the same sampling.
# About 5 minutes; PF_FLOOR_ONLY=1 runs step 1 alone.
if ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
run pf_floor_tinyllama timeout 200 python3 benches/power_floor.py floor --preset tinyllama-1.1b \
  --gemm-bench "$B/bin/gemm-bench" --attention-ms 28.30 --memory-bound-ms 27.56
run pf_floor_134m timeout 120 python3 benches/power_floor.py floor --preset llama-134m \
  --gemm-bench "$B/bin/gemm-bench" --seconds 10 --memory-seconds 4 --attention-ms 4.53 \
  --memory-bound-ms 6.00
grep -h '^{' "$OUT"/pf_floor_*.log >> "$OUT/power_floor.jsonl"
if [ "${PF_FLOOR_ONLY:-0}" != 1 ]; then
  run pf_tilearn timeout 200 python3 benches/power_floor.py sample --label tilearn \
    --csv "$OUT/pf_tilearn.csv" -- "$B/bin/tilearn" bench --preset tinyllama-1.1b --steps 30 --json
  for round in 1 2; do
    for chunk in 4096 auto; do
      run "pf_lce_${chunk}_$round" "$B/bin/tilearn" bench --preset tinyllama-1.1b --steps 10 \
        --json --lce-chunk-tokens "$chunk"
      grep -h '"impl"' "$OUT/pf_lce_${chunk}_$round.log" >> "$OUT/power_floor.jsonl"
    done
  done
  run pf_liger timeout 300 python3 benches/power_floor.py sample --label liger \
    --csv "$OUT/pf_liger.csv" -- python3 benches/pytorch_baseline.py --preset tinyllama-1.1b \
    --mode liger --weights bf16 --steps 10
  grep -h '^{' "$OUT/pf_tilearn.log" "$OUT/pf_liger.log" >> "$OUT/power_floor.jsonl"
fi
