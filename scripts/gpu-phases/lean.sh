# Phase `lean` (sourced by scripts/gpu-call.sh; uses its `run`, $B and $OUT): issue 13 goal 4,
# the lean memory mode (`--memory lean`: fp32 master weights and AdamW moments in host memory,
# stepped on the CPU; the MLP activation recomputed in the backward). About 4 minutes:
#   1. tests/gpu_lean.rs: lean vs default steps (bounds in the file), refusals;
#   2. tilearn bench, both presets, default and lean (peak GiB, tokens/s), next to Liger-Kernel
#      with pure bf16 weights in the same call (the memory target);
#   3. loss tracking: the embedded default (300 steps) in both modes, and a TinyLlama-shaped
#      model (22 x 2048, vocab 32 000) for 20 steps at 8 x 512 in both modes; logs compared by
#      scripts/lean_compare.py into $OUT/lean_summary.jsonl.
run gpu_lean "$B/tests/gpu_lean-test" --include-ignored --test-threads=1 --nocapture
if ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
for preset in llama-134m tinyllama-1.1b; do
  for memory in default lean; do
    run "lean_bench_${preset}_$memory" timeout 120 "$B/bin/tilearn" bench --preset "$preset" \
      --steps 5 --memory "$memory" --json
    grep -h '"impl"' "$OUT/lean_bench_${preset}_$memory.log" >> "$OUT/lean_table.jsonl"
  done
  run "lean_liger_${preset}" timeout 150 python3 benches/pytorch_baseline.py \
    --preset "$preset" --mode liger --weights bf16 --steps 5
  grep -h '"impl"' "$OUT/lean_liger_${preset}.log" >> "$OUT/lean_table.jsonl"
done
L="$OUT/lean_runs"; mkdir -p "$L"
lean_train() { # name, memory, flags...
  local name=$1 memory=$2; shift 2
  run "lean_train_${name}_$memory" timeout 150 "$B/bin/tilearn" train --device cuda \
    --output-dir "/tmp/lean_${name}_${memory}" --save-steps 0 --logging-steps 1 --memory "$memory" "$@"
  cp "/tmp/lean_${name}_${memory}/train_log.jsonl" "$L/${name}_$memory.jsonl" 2>/dev/null
  rm -rf "/tmp/lean_${name}_${memory}"
}
for memory in default lean; do lean_train embedded "$memory"; done
for memory in default lean; do
  lean_train tinyllama "$memory" --config scripts/gpu-phases/tinyllama-shape.json --max-steps 20 \
    --per-device-train-batch-size 8 --seq-len 512 --learning-rate 3e-4 --warmup-steps 5
done
for name in embedded tinyllama; do
  python3 scripts/lean_compare.py "$name" "$L/${name}_default.jsonl" "$L/${name}_lean.jsonl" \
    | tee -a "$OUT/lean_summary.jsonl"
done
(cd "$OUT" && tar -cf lean_runs.tar lean_runs && rm -rf lean_runs)
