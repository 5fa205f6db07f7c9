# Phase gpu-generate (issue 15, generation on the GPU), sourced by scripts/gpu-call.sh (uses its
# `run`, $B and $OUT). About 2 minutes:
# 1. the generation kernels against the CPU references (cached attention, RoPE at a position);
# 2. GPU greedy generation against transformers' fixtures, GPU cached logits against the CPU's;
# 3. decode speed of a llama-134m-shaped random model, batch 1, 256 new tokens: transformers'
#    `generate` and `tilearn generate` on the same weights and prompt, fp32 and bf16;
# 4. a short default training run on the GPU, which ends by printing samples generated there.
run gpu_cached_attention "$B/tests/gpu_cached_attention-test" --include-ignored --test-threads=1 --nocapture
run gpu_generate "$B/tests/gpu_generate-test" --include-ignored --test-threads=1 --nocapture
G="$OUT/gen134m"
run gen_torch timeout 150 python3 benches/generate_baseline.py --dir "$G" --precision fp32 bf16
if [ -f "$G/prompt_ids.txt" ]; then
  for p in fp32 bf16; do
    run "gen_tilearn_$p" "$B/bin/tilearn" generate --model "$G" --prompt-ids "$(cat "$G/prompt_ids.txt")" \
      --max-new-tokens 256 --device cuda --precision "$p"
    grep -h "tokens/s" "$OUT/gen_tilearn_$p.log"
    python3 benches/generate_baseline.py --compare "$OUT/gen_tilearn_$p.log" --with "$OUT/gen_torch.log" \
      --precision "$p"
  done
fi
rm -rf "$G"
run gen_train_samples "$B/bin/tilearn" train --device cuda --max-steps 30 --save-steps 0 --output-dir "$OUT/gen-run"
grep -A8 -i "samples" "$OUT/gen_train_samples.log" | head -12
rm -rf "$OUT/gen-run"
