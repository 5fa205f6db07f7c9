# Phase `lean1000` (sourced by scripts/gpu-call.sh; uses its `run`, $B and $OUT): issue 13 goal 4's
# 1 000-step TinyLlama-shaped run (tinyllama-shape.json: 22 x 2048, vocab 32 000; 8 x 512
# tokens a step, lr 3e-4, 20 warm-up steps) in the modes LEAN1000_MODES names (default "default lean"; a lean step waits
# for the host AdamW, ~0.5 s, so the two may need a call each). Each run's train_log.jsonl goes
# to $OUT/lean1000_<mode>.jsonl; compare them with
#   python3 scripts/lean_compare.py tinyllama1000 lean1000_default.jsonl lean1000_lean.jsonl
for memory in ${LEAN1000_MODES:-default lean}; do
  run "lean1000_$memory" timeout "${LEAN1000_TIMEOUT:-560}" "$B/bin/tilearn" train --device cuda \
    --output-dir "/tmp/lean1000_$memory" --save-steps 0 --logging-steps 1 --memory "$memory" \
    --config scripts/gpu-phases/tinyllama-shape.json --max-steps 1000 \
    --per-device-train-batch-size 8 --seq-len 512 --learning-rate 3e-4 --warmup-steps 20
  cp "/tmp/lean1000_$memory/train_log.jsonl" "$OUT/lean1000_$memory.jsonl" 2>/dev/null
  tail -2 "$OUT/lean1000_$memory.jsonl" 2>/dev/null
  rm -rf "/tmp/lean1000_$memory"
done
