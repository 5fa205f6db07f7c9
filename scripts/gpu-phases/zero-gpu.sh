# ZeRO stages 1 and 2 on the GPU engine (sourced by scripts/gpu-call.sh: uses run, $B, $OUT).
# 1. The GPU data-parallel tests: ZeRO-1/2 with two ranks sharing the GPU over the host
#    communicator against one process, the bf16 sharded-master path, a 2-rank ZeRO checkpoint
#    resumed on 2 and on 1, ZeRO over NCCL with one rank; NCCL's reduce and batch_p2p.
# 2. Peak GPU memory per rank, plain DP vs ZeRO-1 vs ZeRO-2, two ranks sharing the GPU over the
#    host communicator, llama-134m's shape in bf16 (3 steps): each rank's own model-state line
#    and the per-process peak that nvidia-smi reports (sampled every 0.2 s once both ranks have
#    printed their model-state line, i.e. after ZeRO cut the optimizer: the build allocates the
#    whole optimizer first; it includes the CUDA context), summarised in $OUT/zero_memory.txt.
run zero_gpu_tests "$B/tests/gpu_data_parallel-test" --include-ignored --test-threads=1 --nocapture
# tilearn-parallel's NCCL test with one rank: ncclReduce (ZeRO-2's reduction to the owner) and
# batch_p2p as one NCCL group (the filter matches nothing in other crates' gpu test files).
for t in "$B"/tests/gpu-test*; do
  [ -x "$t" ] && run "zero_gpu_nccl_$(basename "$t")" "$t" --include-ignored --test-threads=1 \
    --nocapture nccl_with_one_rank_runs_every_collective
done
Z="$OUT/zero-mem"; mkdir -p "$Z"
cat > "$Z/llama-134m.json" <<'JSON'
{"architectures": ["LlamaForCausalLM"], "hidden_size": 768, "intermediate_size": 2048,
 "num_hidden_layers": 12, "num_attention_heads": 12, "num_key_value_heads": 12,
 "vocab_size": 32000, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5,
 "rope_theta": 10000.0}
JSON
: > "$OUT/zero_memory.txt"
for stage in 0 1 2; do
  samples="$Z/smi-$stage.csv"; : > "$samples"
  log="$OUT/zero_mem_stage$stage.log"
  ( while true; do
      if [ "$(grep -c "model states on rank" "$log" 2>/dev/null)" -ge 2 ]; then
        nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits >> "$samples" 2>/dev/null
      fi
      sleep 0.2
    done ) &
  sampler=$!
  run "zero_mem_stage$stage" timeout 100 "$B/bin/tilearn" launch --nproc-per-node 2 --standalone \
    train --config "$Z/llama-134m.json" --device cuda --bf16 --seq-len 1024 \
    --per-device-train-batch-size 4 --max-steps 3 --save-strategy no --ddp-backend host \
    --zero-stage "$stage" --output-dir "$Z/run-$stage"
  kill "$sampler" 2>/dev/null; wait "$sampler" 2>/dev/null
  {
    echo "== ZeRO stage $stage (2 ranks on one GPU, llama-134m shape, bf16)"
    grep -h "model states on rank" "$OUT/zero_mem_stage$stage.log"
    awk -F', *' 'NF == 2 && $2 + 0 > peak[$1] { peak[$1] = $2 + 0 }
      END { n = 0; for (p in peak) { n++; printf "  nvidia-smi peak, process %d: %d MiB\n", n, peak[p] }
            if (n == 0) print "  nvidia-smi gave no per-process samples" }' "$samples"
  } >> "$OUT/zero_memory.txt"
  rm -rf "$Z/run-$stage"
done
cat "$OUT/zero_memory.txt"
