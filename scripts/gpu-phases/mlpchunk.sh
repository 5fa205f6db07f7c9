# Phase `mlpchunk` (sourced by scripts/gpu-call.sh; uses its `run`, $B and $OUT): issue 13 goals
# 4 and 5 after the MLP chunks under checkpointing and the shared scratch (logits, one MLP
# chunk and the attention gradients in one region):
#   MLPCHUNK_PARTS="tests presets" (default) or "bench":
#   tests   — gpu_mlp_chunk (chunked against whole and against the CPU) and the engine tests
#             whose paths the change touches (see MEMORY_TESTS below);
#   presets — the advisor's calibration runs: both presets with and without checkpointing;
#   bench   — TinyLlama 1 x T with checkpointing (T from MEMORY_SEQS, default 16/32/64 K):
#             tilearn's default, tilearn with --offload-checkpoints, HF + Liger under autocast
#             with fp32 master weights, all in this call (scripts/gpu-phases/memory.sh's bench).
mlp_parts=" ${MLPCHUNK_PARTS:-tests presets} "
export MEMORY_TESTS=${MEMORY_TESTS:-"gpu_mlp_chunk gpu_model gpu_weight_copy gpu_checkpoint_offload \
gpu_lean gpu_cuda_graph gpu_precision gpu_pipeline_parallel gpu_model_parallel gpu_families gpu_sft \
gpu_lce gpu_eval"}
export MEMORY_SEQS=${MEMORY_SEQS:-"16384 32768 65536"} MEMORY_WHOLE=0
export MEMORY_LIGER_WARMUP=${MEMORY_LIGER_WARMUP:-2}
memory_parts=""
[[ $mlp_parts == *" tests "* ]] && memory_parts+=" tests"
[[ $mlp_parts == *" bench "* ]] && memory_parts+=" bench"
# (memory.sh reads an empty MEMORY_PARTS as its default, so it is sourced only with parts.)
[ -n "$memory_parts" ] && MEMORY_PARTS="$memory_parts" . scripts/gpu-phases/memory.sh
if [[ $mlp_parts == *" presets "* ]]; then
  for preset in llama-134m tinyllama-1.1b; do
    for ckpt in "" --gradient-checkpointing; do
      name="preset_${preset}${ckpt:+_ckpt}"
      run "$name" timeout 200 "$B/bin/tilearn" bench --preset "$preset" $ckpt --steps 10 --json
      grep -h '"impl"' "$OUT/$name.log" | sed "s/^{/{\"case\":\"$name\",/" >> "$OUT/mem_table.jsonl"
    done
  done
fi
