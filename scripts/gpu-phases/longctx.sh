# Phase `longctx` (sourced by scripts/gpu-call.sh; uses its `run`, $B and $OUT): issue 13 goal 5,
# TinyLlama at 1 x 16 K / 32 K / 64 K tokens with gradient checkpointing: tilearn bench (the
# one-pass backward; --deterministic at 16 K) beside Liger-Kernel in the long-context
# setting (fp32 master weights under bf16 autocast), all in this call, to $OUT/long_table.jsonl.
# LONG_SEQS overrides the lengths.
if ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
long() { # name, tool (tilearn|liger), seq, extra flags...
  local name=$1 tool=$2 seq=$3; shift 3
  if [ "$tool" = tilearn ]; then
    run "long_$name" timeout 240 "$B/bin/tilearn" bench --preset tinyllama-1.1b --batch 1 \
      --seq "$seq" --gradient-checkpointing --steps 5 --json "$@"
  else
    run "long_$name" timeout 300 python3 benches/pytorch_baseline.py --mode liger \
      --preset tinyllama-1.1b --weights fp32 --batch 1 --seq "$seq" --gradient-checkpointing \
      --steps 5 "$@"
  fi
  grep -h '"impl"' "$OUT/long_$name.log" | sed "s/^{/{\"case\":\"$name\",/" >> "$OUT/long_table.jsonl"
}
for seq in ${LONG_SEQS:-16384 32768 65536}; do
  long "tilearn_$seq" tilearn "$seq"
  [ "$seq" = 16384 ] && long "tilearn_det_$seq" tilearn "$seq" --deterministic
  long "liger_$seq" liger "$seq"
done
