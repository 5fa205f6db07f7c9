#!/usr/bin/env bash
# The fused embedding-bag operator (issue 16) beside PyTorch's nn.EmbeddingBag with sparse
# gradients and the matching optimizer, same shapes, same GPU, one call: 26 tables, zipf(1.05)
# ids, row-wise Adagrad, forward and forward + backward + update.
#
#   scripts/recsys_bench.sh RECSYS_BENCH_BINARY [ROWS...]      (default rows: 100000 1000000)
#
# One JSON line per run in $OUT/recsys_bench.jsonl (tilearn's lines, then torch's).
set -uo pipefail
BIN=${1:?usage: recsys_bench.sh RECSYS_BENCH_BINARY [ROWS...]}; shift
ROWS=("$@"); [ ${#ROWS[@]} -gt 0 ] || ROWS=(100000 1000000)
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; LOG="$OUT/recsys_bench.jsonl"; : > "$LOG"
for dim in 16 128; do for rows in "${ROWS[@]}"; do for batch in 16384 65536; do
  a=(--tables 26 --rows "$rows" --dim "$dim" --batch "$batch" --zipf 1.05 --optimizer adagrad)
  timeout 120 "$BIN" "${a[@]}" 2>/dev/null | grep '^{' | sed 's/^{/{"impl":"tilearn",/' >> "$LOG"
  timeout 120 python3 benches/pytorch_recsys_baseline.py --op "${a[@]}" 2>/dev/null | grep '^{' >> "$LOG"
done; done; done
echo "recsys_bench: $(wc -l < "$LOG") lines in $LOG"
