# Phase `longest` (sourced by scripts/gpu-call.sh; uses its `run`, $B and $OUT): issue 13 goal 5's
# longest context of each, in one call: TinyLlama with gradient checkpointing at 1 x T, one step
# each (no warm-up; a failure is logged, not fatal), to $OUT/mem_table.jsonl. The doubling
# search's two ends for each, tilearn's first, each capped by what is left of LONGEST_BUDGET
# seconds (default 585, counted from the start of the call):
#   tilearn at 1 M (fails at set-up in 3 s on an H200 whose host has 125 GiB; 60 s cap);
#   tilearn's default (`--offload-checkpoints auto`) at 512 K (trains: one step about 300 s with
#   the warp-specialised backward, 326 s before it; 400 s cap);
#   HF + Liger-Kernel under autocast at 256 K (trains, about 113 s with start-up; 200 s cap) and
#   512 K (out of memory after about 120 s with start-up; what is left).
# The four need about 560 s: a call of its own. 2026-12-03's fifth-session call ran Liger first
# and cut tilearn's 512 K step at the 331 s left. Carry .whl/ with the Liger-Kernel wheel (see
# memory.sh).
MEMORY_PARTS=" none " . scripts/gpu-phases/memory.sh
longest() { # name, cap seconds, tool (tilearn|liger), seq
  local name=$1 cap=$2 tool=$3 seq=$4
  local left=$(( ${LONGEST_BUDGET:-585} - SECONDS ))
  [ "$cap" -gt "$left" ] && cap=$left
  if [ "$cap" -lt 20 ]; then
    echo "$name: not run, ${left} s of the budget left"
    return
  fi
  local start=$SECONDS
  if [ "$tool" = tilearn ]; then
    run "$name" timeout "$cap" "$B/bin/tilearn" bench --preset tinyllama-1.1b --batch 1 \
      --seq "$seq" --gradient-checkpointing --steps 1 --warmup 0 --json
  else
    run "$name" timeout "$cap" python3 benches/pytorch_baseline.py --mode liger \
      --preset tinyllama-1.1b --weights fp32 --batch 1 --seq "$seq" --gradient-checkpointing \
      --steps 1 --warmup 0
  fi
  echo "$name: ran from $start s to $SECONDS s of the call, cap $cap s (exit 124 = cut by the cap, not concluded)"
  grep -h '"impl"' "$OUT/$name.log" | sed "s/^{/{\"case\":\"$name\",/" >> "$OUT/mem_table.jsonl"
}
longest long_tilearn_1048576 60 tilearn 1048576
longest long_tilearn_524288 400 tilearn 524288
longest long_liger_262144 200 liger 262144
longest long_liger_524288 600 liger 524288
