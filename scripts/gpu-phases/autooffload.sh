# Phase `autooffload` (sourced by scripts/gpu-call.sh; uses its `run`, $B and $OUT): issue 13
# goals 4 and 5 after `--offload-checkpoints auto` (the default from 16 K tokens), the smaller
# scratch (128 MiB logits, 32 MiB MLP chunks) and the embedding cast into the layer window:
#   AUTOOFFLOAD_PARTS="tests presets bench" (default) or "long":
#   tests, presets, bench — as scripts/gpu-phases/mlpchunk.sh (bench: the default, `off` and
#            HF + Liger under autocast at 16/32/64 K, all in this call);
#   long   — the longest context of each in one call: the phase `longest` (tilearn at 1 M,
#            Liger at 512 K and 256 K, tilearn's default at 512 K with the time left).
auto_parts=" ${AUTOOFFLOAD_PARTS:-tests presets bench} "
export MEMORY_TESTS=${MEMORY_TESTS:-"gpu_weight_copy gpu_checkpoint_offload gpu_mlp_chunk gpu_lce \
gpu_model gpu_cuda_graph gpu_lean gpu_families gpu_pipeline_parallel gpu_model_parallel gpu_precision"}
mlp=""
[[ $auto_parts == *" tests "* ]] && mlp+=" tests"
[[ $auto_parts == *" presets "* ]] && mlp+=" presets"
[[ $auto_parts == *" bench "* ]] && mlp+=" bench"
[ -n "$mlp" ] && MLPCHUNK_PARTS="$mlp" . scripts/gpu-phases/mlpchunk.sh
if [[ $auto_parts == *" long "* ]]; then
  . scripts/gpu-phases/longest.sh
fi
