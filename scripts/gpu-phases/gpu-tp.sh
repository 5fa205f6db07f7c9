# Tensor parallelism on the GPU engine (sourced by scripts/gpu-call.sh: uses run, $B, $OUT).
# 1. crates/tilearn-engine/tests/gpu_model_parallel.rs: tp 2 (two ranks on threads sharing the
#    GPU over the host communicator) against the single-rank engine in fp32 and bf16, and tp 2
#    checkpoints resuming on one rank and back.
# 2. Through the real launcher: `train --device cuda --tp-size 2` with two processes against one
#    process, fp32 and bf16, 12 steps of a small Llama (embedded default data); then the tp 2
#    run's checkpoint resumed by one process. Step losses compared in $OUT/gpu_tp_summary.txt.
run gpu_tp_tests "$B/tests/gpu_model_parallel-test" --include-ignored --test-threads=1 --nocapture
T="$OUT/gpu-tp"; mkdir -p "$T"
cat > "$T/small.json" <<'JSON'
{"architectures": ["LlamaForCausalLM"], "hidden_size": 256, "intermediate_size": 512,
 "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
 "vocab_size": 32000, "max_position_embeddings": 256, "rms_norm_eps": 1e-5,
 "rope_theta": 10000.0, "tie_word_embeddings": false}
JSON
common=(train --config "$T/small.json" --device cuda --seq-len 128 --per-device-train-batch-size 4
  --max-steps 12 --logging-steps 1 --save-steps 6 --no-samples)
for p in fp32 bf16; do
  run "gpu_tp_one_$p" timeout 120 "$B/bin/tilearn" "${common[@]}" "--$p" --output-dir "$T/one-$p"
  run "gpu_tp_two_$p" timeout 150 "$B/bin/tilearn" launch --nproc-per-node 2 --standalone \
    "${common[@]}" "--$p" --tp-size 2 --output-dir "$T/tp2-$p"
done
# The tp 2 fp32 checkpoint of step 6 resumed by one process for steps 7-12.
run gpu_tp_resume_one timeout 120 "$B/bin/tilearn" "${common[@]}" --fp32 --output-dir "$T/resumed" \
  --data "$T/tp2-fp32/data" --resume-from-checkpoint "$T/tp2-fp32/checkpoint-6"
python3 scripts/compare_step_losses.py "$T" \
  "one-fp32:tp2-fp32:fp32 tp2 vs one" \
  "one-bf16:tp2-bf16:bf16 tp2 vs one" \
  "one-fp32:resumed:fp32 tp2 ckpt-6 resumed on one vs one" > "$OUT/gpu_tp_summary.txt" 2>&1
cat "$OUT/gpu_tp_summary.txt"
grep -h "tensor-parallel\|hybrid parallel" "$OUT"/gpu_tp_two_*.log | sort -u | head -4
rm -rf "$T"
