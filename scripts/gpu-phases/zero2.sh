# ZeRO-2 keeping only the owned gradients on the GPU engine (sourced by scripts/gpu-call.sh:
# uses run, $B, $OUT).
# 1. The ZeRO tests of gpu_data_parallel: two ranks sharing the GPU over the host communicator,
#    ZeRO-2 with the gradient window against one process (fp32, bf16 with accumulation), against
#    the whole-buffer ZeRO-2 (--no-ddp-overlap) bit for bit (untied and tied lm_head), the
#    model-state lines (held gradients = owned shard + window), bf16 and fp32 ZeRO-2
#    checkpoints resumed; ZeRO over NCCL with one rank (no window: the whole buffer is the shard);
#    the overlapped DDP all-reduce (the whole-buffer hand-off) against the one after the backward.
# 2. Peak GPU memory per rank, plain DP vs ZeRO-1 vs ZeRO-2, as scripts/gpu-phases/zero-gpu.sh
#    measured it (two ranks sharing the GPU over the host communicator, llama-134m's shape,
#    bf16, batch 4 x 1024, 2 steps, per-process nvidia-smi peak sampled after both ranks printed
#    their model-state line), summarised in $OUT/zero2_memory.txt.
run zero2_tests "$B/tests/gpu_data_parallel-test" --include-ignored --test-threads=1 --nocapture \
  zero nccl_with_one_rank the_overlapped_all_reduce
Z="$OUT/zero2-mem"; mkdir -p "$Z"
cat > "$Z/llama-134m.json" <<'JSON'
{"architectures": ["LlamaForCausalLM"], "hidden_size": 768, "intermediate_size": 2048,
 "num_hidden_layers": 12, "num_attention_heads": 12, "num_key_value_heads": 12,
 "vocab_size": 32000, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5,
 "rope_theta": 10000.0}
JSON
: > "$OUT/zero2_memory.txt"
for stage in 0 1 2; do
  samples="$Z/smi-$stage.csv"; : > "$samples"
  log="$OUT/zero2_mem_stage$stage.log"
  ( while true; do
      if [ "$(grep -c "model states on rank" "$log" 2>/dev/null)" -ge 2 ]; then
        nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits >> "$samples" 2>/dev/null
      fi
      sleep 0.2
    done ) &
  sampler=$!
  run "zero2_mem_stage$stage" timeout 100 "$B/bin/tilearn" launch --nproc-per-node 2 --standalone \
    train --config "$Z/llama-134m.json" --device cuda --bf16 --seq-len 1024 \
    --per-device-train-batch-size 4 --max-steps 2 --save-strategy no --ddp-backend host \
    --zero-stage "$stage" --output-dir "$Z/run-$stage"
  kill "$sampler" 2>/dev/null; wait "$sampler" 2>/dev/null
  {
    echo "== ZeRO stage $stage (2 ranks on one GPU, llama-134m shape, bf16)"
    grep -h "model states on rank" "$log"
    grep -h "tokens/s" "$log" | tail -1
    awk -F', *' 'NF == 2 && $2 + 0 > peak[$1] { peak[$1] = $2 + 0 }
      END { n = 0; for (p in peak) { n++; printf "  nvidia-smi peak, process %d: %d MiB\n", n, peak[p] }
            if (n == 0) print "  nvidia-smi gave no per-process samples" }' "$samples"
  } >> "$OUT/zero2_memory.txt"
  rm -rf "$Z/run-$stage"
done
cat "$OUT/zero2_memory.txt"
