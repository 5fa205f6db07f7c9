#!/usr/bin/env bash
# A Llama-2-7B-shaped run on one GPU around its steps (issue 18): the output disk's write and
# read bandwidth (dd, same call), time to first step and host peak RSS from a random init and
# from an HF checkpoint on disk, the final model's and a checkpoint's write time, and the disk
# check refusing a run whose checkpoints cannot fit. About 3-5 minutes on one H200 (64 GiB disk,
# 128 GiB RAM); needs about 45 GB free under $LM_DIR.
#
#   scripts/large_model_run.sh TILEARN_BINARY      (scripts/gpu-call.sh largemodel runs it)
#
# Writes $OUT/large_model_summary.txt (the numbers for bench/RESULTS.md) and one log per run.
set -uo pipefail
BIN=${1:?usage: large_model_run.sh TILEARN_BINARY}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
DIR=${LM_DIR:-/var/tmp/tilearn-large}
rm -rf "$DIR"; mkdir -p "$DIR"
S="$OUT/large_model_summary.txt"; : > "$S"
say() { echo "$*" | tee -a "$S"; }
# Drops the page cache so a read comes from the disk (root only; noted when refused).
drop_caches() { sync; echo 3 > /proc/sys/vm/drop_caches 2>/dev/null && echo dropped || echo "not dropped (no permission)"; }
TIME=/usr/bin/time; [ -x "$TIME" ] || TIME=""
# Runs `tilearn train` under /usr/bin/time -v when present; logs to $OUT/<name>.log.
train() { # name, flags...
  local name=$1; shift
  local start=$(date +%s%N)
  if [ -n "$TIME" ]; then "$TIME" -v "$BIN" train --device cuda "$@" > "$OUT/$name.log" 2>&1
  else "$BIN" train --device cuda "$@" > "$OUT/$name.log" 2>&1; fi
  local rc=$?
  local ms=$(( ($(date +%s%N) - start) / 1000000 ))
  say "== $name: exit $rc, $((ms / 1000)).$(printf %03d $((ms % 1000))) s wall"
  grep -E "^model:|first step done|saved |done:|warning|error|Maximum resident" "$OUT/$name.log" | sed 's/^/   /' | tee -a "$S"
  return $rc
}

say "# tilearn large-model run $(date -u +%FT%TZ) on $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)"
say "disk: $(df -h --output=source,size,avail "$DIR" | tail -1)  ($DIR)"

# 1. The disk's bandwidth: 8 GiB written through the page cache + fdatasync (how saves write)
#    and with O_DIRECT, then read back cold.
say "dd write (8 GiB, conv=fdatasync): $(dd if=/dev/zero of="$DIR/dd.bin" bs=64M count=128 conv=fdatasync 2>&1 | tail -1)"
rm -f "$DIR/dd.bin"
say "dd write (8 GiB, oflag=direct): $(dd if=/dev/zero of="$DIR/dd.bin" bs=64M count=128 oflag=direct 2>&1 | tail -1)"
say "page cache $(drop_caches)"
say "dd read (8 GiB, cold): $(dd if="$DIR/dd.bin" of=/dev/null bs=64M 2>&1 | tail -1)"
rm -f "$DIR/dd.bin"

# 2. The Llama-2-7B shape (6.74 B parameters), bf16 on disk.
cat > "$DIR/llama2-7b.json" <<'JSON'
{"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
 "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32,
 "num_key_value_heads": 32, "vocab_size": 32000, "max_position_embeddings": 4096,
 "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": false,
 "initializer_range": 0.02, "dtype": "bfloat16"}
JSON
COMMON=(--per-device-train-batch-size 1 --seq-len 2048 --max-steps 4 --logging-steps 1 --learning-rate 1e-5)

# 3. From a random init, no checkpoint (--save-steps 0): time to first step, final model save.
train random_init --config "$DIR/llama2-7b.json" --output-dir "$DIR/a" "${COMMON[@]}" --save-steps 0
DATA="$DIR/a/data"
ls -l "$DIR/a" | grep -E "safetensors|config" | sed 's/^/   /' | tee -a "$S"

# 4. A full checkpoint (f32 weights + AdamW state, ~81 GB) cannot fit: the run is refused at
#    start with both numbers, before any step.
train refused --config "$DIR/llama2-7b.json" --output-dir "$DIR/b" --data "$DATA" "${COMMON[@]}" --save-steps 4
rm -rf "$DIR/b"

# 5. From the HF checkpoint written in 3, read cold: time to first step against the time to
#    read the weights; then a --save-only-model checkpoint and the final model (bf16 each).
say "page cache $(drop_caches)"
say "dd read of the weights (cold): $(dd if="$DIR/a/model.safetensors" of=/dev/null bs=64M 2>&1 | tail -1)"
say "page cache $(drop_caches)"
train from_checkpoint --model "$DIR/a" --output-dir "$DIR/c" --data "$DATA" "${COMMON[@]}" \
  --save-steps 4 --save-only-model --save-dtype bf16
du -sh "$DIR/c/checkpoint-4" 2>/dev/null | sed 's/^/   checkpoint: /' | tee -a "$S"

rm -rf "$DIR"
(cd "$OUT" && tar -cf large_model_logs.tar random_init.log refused.log from_checkpoint.log && rm -f random_init.log refused.log from_checkpoint.log)
