#!/usr/bin/env bash
# The same benchmarks from two builds of tilearn, alternated in one call on one GPU, so a
# refactor's "no behaviour change, same speed" is measured rather than assumed: `tilearn bench`
# for both presets (bf16), the attention microbenchmark and the fused optimizers.
#
#   scripts/compare_builds.sh BEFORE_DIR AFTER_DIR [REPEATS]
#
# Each DIR holds `tilearn`, `gemm-bench` and `optim-bench`. Every benchmark runs REPEATS times
# (default 3) per build, the builds alternating, so clock drift hits both alike; the JSON lines
# go to $OUT/compare_builds.jsonl tagged with the build and the repeat.
set -uo pipefail
BEFORE=${1:?usage: compare_builds.sh BEFORE_DIR AFTER_DIR [REPEATS]}
AFTER=${2:?usage: compare_builds.sh BEFORE_DIR AFTER_DIR [REPEATS]}
REPEATS=${3:-3}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
LOG="$OUT/compare_builds.jsonl"; : > "$LOG"
# Runs one benchmark and tags each JSON line it prints.
bench() { # build label, repeat, command...
  local build=$1 rep=$2; shift 2
  "$@" 2>/dev/null | grep '^{' | sed "s/^{/{\"build\":\"$build\",\"repeat\":$rep,/" >> "$LOG"
}
for rep in $(seq 1 "$REPEATS"); do
  for build in before after; do
    dir=$BEFORE; [ "$build" = after ] && dir=$AFTER
    for preset in llama-134m tinyllama-1.1b; do
      bench "$build" "$rep" "$dir/tilearn" bench --preset "$preset" --steps 10 --json
    done
    bench "$build" "$rep" "$dir/gemm-bench" attention
    bench "$build" "$rep" "$dir/optim-bench" --steps 20
  done
done
echo "compare_builds: $(wc -l < "$LOG") result lines in $LOG"
