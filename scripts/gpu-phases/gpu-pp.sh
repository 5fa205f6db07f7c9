# Pipeline parallelism on the GPU engine (sourced by scripts/gpu-call.sh: uses run, $B, $OUT).
# 1. crates/tilearn-engine/tests/gpu_pipeline_parallel.rs (and tilearn-parallel's host-staged
#    device batch_p2p test): pp 2 (two ranks on threads sharing the
#    GPU over the host communicator) against the single-rank engine in fp32 and bf16 with 1F1B,
#    GPipe with gradient checkpointing, pp 3, the evaluation loss, and pp 2 checkpoints resuming
#    bit for bit on pp 2 and on one rank.
# 2. Through the real launcher: `train --device cuda --pp-size 2` with two processes against one
#    process (bf16, 20 steps of 4 micro-batches of a small untied Llama on the embedded default
#    data: the embedded default model ties its embeddings, which pipeline parallelism refuses),
#    pp 2 × dp 2 with four processes against the same one-process run (same global batch), and
#    the pp 2 run's checkpoint of step 10 resumed on pp 2 (steps 11-20 must repeat the
#    uninterrupted run's losses exactly). Step losses compared in $OUT/gpu_pp_summary.txt,
#    throughput from each run's closing line (two processes share the one GPU and exchange
#    activations through host memory: a functional figure, not NCCL's).
run gpu_pp_tests "$B/tests/gpu_pipeline_parallel-test" --include-ignored --test-threads=1 --nocapture
# tilearn-parallel's tests/gpu.rs: device buffers in one batch_p2p over the host communicator
# (several crates have a tests/gpu.rs, bundled as gpu-test*: the filter picks the one test).
for t in $(cd "$B/tests" && ls | grep -E "^gpu-test"); do
  run "gpu_pp_host_p2p_$t" "$B/tests/$t" --include-ignored --test-threads=1 --nocapture \
    two_ranks_exchange_device_buffers
done
T="$OUT/gpu-pp"; mkdir -p "$T"
cat > "$T/small.json" <<'JSON'
{"architectures": ["LlamaForCausalLM"], "hidden_size": 256, "intermediate_size": 512,
 "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
 "vocab_size": 32000, "max_position_embeddings": 256, "rms_norm_eps": 1e-5,
 "rope_theta": 10000.0, "tie_word_embeddings": false}
JSON
common=(train --config "$T/small.json" --device cuda --bf16 --seq-len 128
  --per-device-train-batch-size 4 --logging-steps 1 --no-samples)
steps=(--gradient-accumulation-steps 4 --max-steps 20)
run gpu_pp_one timeout 100 "$B/bin/tilearn" "${common[@]}" "${steps[@]}" --save-steps 0 \
  --output-dir "$T/one"
run gpu_pp_two timeout 120 "$B/bin/tilearn" launch --nproc-per-node 2 --standalone \
  "${common[@]}" "${steps[@]}" --pp-size 2 --save-steps 10 --output-dir "$T/pp2"
# pp 2 × dp 2 (four processes): 2 micro-batches per rank and step, the global batch of one
# process's 4, so the same windows in the same steps (and the same learning-rate schedule).
run gpu_pp_dp2 timeout 120 "$B/bin/tilearn" launch --nproc-per-node 4 --standalone \
  "${common[@]}" --pp-size 2 --gradient-accumulation-steps 2 --max-steps 20 --save-steps 0 \
  --output-dir "$T/pp2dp2"
# The pp 2 checkpoint of step 10 resumed on pp 2 for steps 11-20.
run gpu_pp_resume_pp2 timeout 120 "$B/bin/tilearn" launch --nproc-per-node 2 --standalone \
  "${common[@]}" "${steps[@]}" --pp-size 2 --save-steps 0 --output-dir "$T/resumed" --data "$T/pp2/data" \
  --resume-from-checkpoint "$T/pp2/checkpoint-10"
python3 scripts/compare_step_losses.py "$T" \
  "one:pp2:bf16 pp2 vs one process" \
  "one:pp2dp2:bf16 pp2 x dp2 vs one process" \
  "pp2:resumed:bf16 pp2 checkpoint-10 resumed on pp2 vs uninterrupted pp2" > "$OUT/gpu_pp_summary.txt" 2>&1
cat "$OUT/gpu_pp_summary.txt"
grep -h "pipeline stage\|hybrid\|^done:" "$OUT"/gpu_pp_one.log "$OUT"/gpu_pp_two.log "$OUT"/gpu_pp_dp2.log \
  "$OUT"/gpu_pp_resume_pp2.log | sort -u | head -16
rm -rf "$T"
