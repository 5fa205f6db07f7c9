# Phase `memory` (sourced by scripts/gpu-call.sh; uses its `run`, $B and $OUT): issue 13 goals
# 4 and 5 after the per-layer weight copy (`--weight-copy`), the checkpoint offload
# (`--offload-checkpoints`) and the MLP activation recomputed under checkpointing:
#   1. GPU tests: the two new files (bit-for-bit against the whole copy / the on-device
#      checkpoints) and the engine tests whose paths they touch;
#   2. TinyLlama with gradient checkpointing at 1 x T: tilearn bench in the default (per-layer
#      copy, `--offload-checkpoints auto`), with the checkpoints kept on the GPU (`off`), with
#      the whole copy (for the cast's cost), beside Liger-Kernel in the long-context setting (fp32 master
#      weights under bf16 autocast), all in this call, to $OUT/mem_table.jsonl;
#   3. the two presets with checkpointing (the advisor's calibration runs), per-layer and
#      whole copy.
#   4. `long`: one step each (no warm-up) at the MEMORY_LONG_SEQS lengths, tilearn with the
#      offload beside Liger (the longest-context search; a failure is logged, not fatal).
# MEMORY_PARTS picks parts (default "tests bench presets"); MEMORY_TESTS names the test binaries;
# MEMORY_SEQS the lengths (default "16384 32768"); MEMORY_STEPS the timed steps (default 5),
# MEMORY_WARMUP / MEMORY_LIGER_WARMUP the untimed ones (default 3 / 5); MEMORY_WHOLE=0 skips
# the whole-copy run.
if ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export TILEARN_BIN_DIR=${TILEARN_BIN_DIR:-$PWD/$B/bin}
parts=" ${MEMORY_PARTS:-tests bench presets} "
[[ $parts == *" tests "* ]] && for t in ${MEMORY_TESTS:-gpu_weight_copy gpu_checkpoint_offload gpu_lean gpu_model gpu_cuda_graph gpu_precision gpu_pipeline_parallel gpu_data_parallel gpu_model_parallel}; do
  [ -x "$B/tests/$t-test" ] || { echo "=== $t: not in the bundle (not run)"; continue; }
  run "$t" timeout 300 "$B/tests/$t-test" --include-ignored --test-threads=1 --nocapture
done
steps=${MEMORY_STEPS:-5}
mem() { # name, tool (tilearn|liger), seq, extra flags...
  local name=$1 tool=$2 seq=$3; shift 3
  if [ "$tool" = tilearn ]; then
    run "mem_$name" timeout 400 "$B/bin/tilearn" bench --preset tinyllama-1.1b --batch 1 \
      --seq "$seq" --gradient-checkpointing --steps "$steps" --warmup "${MEMORY_WARMUP:-3}" \
      --json "$@"
  else
    run "mem_$name" timeout 400 python3 benches/pytorch_baseline.py --mode liger \
      --preset tinyllama-1.1b --weights fp32 --batch 1 --seq "$seq" --gradient-checkpointing \
      --steps "$steps" --warmup "${MEMORY_LIGER_WARMUP:-5}" "$@"
  fi
  grep -h '"impl"' "$OUT/mem_$name.log" | sed "s/^{/{\"case\":\"$name\",/" >> "$OUT/mem_table.jsonl"
}
if [[ $parts == *" bench "* ]]; then
  for seq in ${MEMORY_SEQS:-16384 32768}; do
    # The default (`--offload-checkpoints auto`: the JSON line says what it chose) and the
    # checkpoints kept on the GPU.
    mem "tilearn_$seq" tilearn "$seq"
    mem "tilearn_off_$seq" tilearn "$seq" --offload-checkpoints off
    [ "$seq" = 16384 ] && [ "${MEMORY_WHOLE:-1}" = 1 ] && \
      mem "tilearn_whole_$seq" tilearn "$seq" --weight-copy whole
    mem "liger_$seq" liger "$seq"
  done
fi
if [[ $parts == *" presets "* ]]; then
  for preset in llama-134m tinyllama-1.1b; do
    for copy in auto whole; do
      run "mem_${preset}_ckpt_$copy" timeout 200 "$B/bin/tilearn" bench --preset "$preset" \
        --gradient-checkpointing --weight-copy "$copy" --steps 10 --json
      grep -h '"impl"' "$OUT/mem_${preset}_ckpt_$copy.log" \
        | sed "s/^{/{\"case\":\"${preset}_ckpt_$copy\",/" >> "$OUT/mem_table.jsonl"
    done
  done
fi
if [[ $parts == *" long "* ]]; then
  for seq in ${MEMORY_LONG_SEQS:-131072}; do
    MEMORY_WARMUP=0 MEMORY_LIGER_WARMUP=0 steps=1 mem "long_tilearn_$seq" tilearn "$seq" \
      --offload-checkpoints on
    MEMORY_WARMUP=0 MEMORY_LIGER_WARMUP=0 steps=1 mem "long_liger_$seq" liger "$seq"
  done
fi
