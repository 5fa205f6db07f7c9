# Phase `longest` (sourced by scripts/gpu-call.sh; uses its `run`, $B and $OUT): issue 13 goal 5's
# longest context of each, in one call, TinyLlama with gradient checkpointing at 1 x T, one step
# each (no warm-up; a failure is logged, not fatal), to $OUT/mem_table.jsonl:
#   tilearn's default (`--offload-checkpoints auto`) at 512 K, the longest it trained before;
#   HF + Liger-Kernel under autocast at 256 K and 512 K (its longest before, and the double);
#   tilearn at 1 M with what is left of LONGEST_BUDGET seconds (default 570), the double.
# Carry .whl/ with the Liger-Kernel wheel (see memory.sh).
MEMORY_PARTS=" none " . scripts/gpu-phases/memory.sh
MEMORY_WARMUP=0 MEMORY_LIGER_WARMUP=0 steps=1 mem "long_tilearn_524288" tilearn 524288
for seq in 262144 524288; do
  MEMORY_WARMUP=0 MEMORY_LIGER_WARMUP=0 steps=1 mem "long_liger_$seq" liger "$seq"
done
left=$(( ${LONGEST_BUDGET:-570} - SECONDS ))
if [ "$left" -gt 30 ]; then
  run long_tilearn_1048576 timeout "$left" "$B/bin/tilearn" bench --preset tinyllama-1.1b \
    --batch 1 --seq 1048576 --gradient-checkpointing --steps 1 --warmup 0 --json
  echo "tilearn at 1 M: exit within ${left} s (124 = timed out, not concluded)"
else
  echo "tilearn at 1 M: not run, ${left} s left"
fi
