#!/usr/bin/env bash
# Runs on a multi-GPU machine (nvidia-h200-x2 and up) from the repository root, with
# target/gpu-bundle carried (../shared/gpu/bundle.sh --bins) and, for the Liger-Kernel baseline,
# the wheels in .whl. Phases are named on the command line; each writes its logs under $OUT/multi
# and a failing phase does not stop the others. The figures go to bench/RESULTS.md (issue 17).
#   scripts/multi_gpu_call.sh tests comm dp zero torchddp split mfu7b launcher faults
# (PRESETS=llama-134m limits the dp and zero phases; on one GPU dp compares a plain run with
# launched world-size-1 runs, overlapped and not.)
# NVLink multicast stays off in every process (the machines' rule): NCCL_NVLS_ENABLE=0 etc.
set -uo pipefail
B=target/gpu-bundle
. "$B/env.sh"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
NCCL_DIR=$(python3 -c "import nvidia.nccl as n; print(list(n.__path__)[0] + '/lib')" 2>/dev/null)
export LD_LIBRARY_PATH="${NCCL_DIR}:${LD_LIBRARY_PATH:-}" TILEARN_NCCL_LIBRARY="$NCCL_DIR/libnccl.so.2"
export TILEARN_BIN_DIR="$PWD/$B/bin"
T="$B/bin/tilearn"
GPUS=$(nvidia-smi -L | wc -l)
OUT=${OUT:-/tmp/out}; L="$OUT/multi"; W=/tmp/multi-work; mkdir -p "$L" "$W"
status=0
run() { # name, command...
  local name=$1; shift
  echo "=== $name: $*"
  local t0=$SECONDS
  if "$@" > "$L/$name.log" 2>&1; then echo "--- $name ok ($((SECONDS - t0)) s)"; else echo "--- $name FAILED ($?, $((SECONDS - t0)) s)"; status=1; fi
  grep -E "test result|FAILED|panicked|skipped|max \|Δw\||\"impl\"|done:|error" "$L/$name.log" | tail -30
}
config() { # preset -> config.json path
  local f="$W/$1.json"
  case $1 in
    llama-134m) echo '{"architectures":["LlamaForCausalLM"],"vocab_size":32000,"hidden_size":768,"num_hidden_layers":12,"num_attention_heads":12,"num_key_value_heads":12,"intermediate_size":2048,"max_position_embeddings":2048,"tie_word_embeddings":false,"rms_norm_eps":1e-5}' > "$f";;
    tinyllama-1.1b) echo '{"architectures":["LlamaForCausalLM"],"vocab_size":32000,"hidden_size":2048,"num_hidden_layers":22,"num_attention_heads":32,"num_key_value_heads":4,"intermediate_size":5632,"max_position_embeddings":2048,"tie_word_embeddings":false,"rms_norm_eps":1e-5}' > "$f";;
  esac
  echo "$f"
}
shape() { # preset -> per-GPU batch and sequence, the presets of tilearn bench
  case $1 in llama-134m) echo "16 1024";; tinyllama-1.1b) echo "8 2048";; esac
}
train() { # name, launch-prefix-or-"", preset, steps, extra train flags...
  # BATCH, LOGSTEPS and SAVE (flags) override the per-GPU batch, logging interval and saving.
  local name=$1 prefix=$2 preset=$3 steps=$4; shift 4
  read -r batch seq <<< "$(shape "$preset")"
  run "$name" $prefix "$T" train --config "$(config "$preset")" --data "$W/random" \
    --output-dir "$W/$name" --device cuda --bf16 --per-device-train-batch-size "${BATCH:-$batch}" \
    --seq-len "$seq" --max-steps "$steps" --logging-steps "${LOGSTEPS:-5}" --warmup-steps 0 \
    --learning-rate 1e-4 ${SAVE:---save-strategy no} "$@"
  cp "$W/$name/train_log.jsonl" "$L/$name.jsonl" 2>/dev/null; rm -rf "$W/$name"
}
prepare() { # the random-token corpus the training phases read (40 M tokens, vocabulary 32 000)
  [ -d "$W/random" ] || "$T" prepare-data --random-tokens 40000000 --vocab-size 32000 \
    --output "$W/random" > "$L/prepare.log" 2>&1
}
echo "GPUs: $GPUS"; nvidia-smi topo -m > "$L/topology.txt" 2>&1
for phase in "$@"; do
  case $phase in
    tests)
      run gpu_data_parallel "$B/tests/gpu_data_parallel-test" --include-ignored --test-threads=1 --nocapture
      run parallel_gpu "$B/tests/gpu-test" --include-ignored --test-threads=1 --nocapture
      run gpu_streaming "$B/tests/gpu_streaming-test" --include-ignored --test-threads=1 --nocapture
      run gpu_model_parallel_launch "$B/tests/gpu_model_parallel_launch-test" --include-ignored \
        --test-threads=1 --nocapture;;
    comm)
      # tilearn's NCCL and torch.distributed's, same GPUs, same sizes and timing (1 MiB … 1 GiB).
      run comm_tilearn "$T" launch --standalone --nproc-per-node "$GPUS" -- \
        "$B/bin/tilearn-comm-check" --backend nccl --bench
      run comm_torch torchrun --standalone --nproc-per-node "$GPUS" benches/pytorch_comm_baseline.py;;
    dp)
      prepare
      for preset in ${PRESETS:-llama-134m tinyllama-1.1b}; do
        steps=40; [ "$preset" = tinyllama-1.1b ] && steps=20
        train "one_$preset" "" "$preset" "$steps"
        train "dp${GPUS}_$preset" "$T launch --standalone --nproc-per-node $GPUS" "$preset" "$steps"
        train "dp${GPUS}_after_$preset" "$T launch --standalone --nproc-per-node $GPUS" "$preset" "$steps" --no-ddp-overlap
      done
      # The same global batch on one GPU (accumulation) and on all: the losses must agree.
      BATCH=4 LOGSTEPS=1 train loss_one "" llama-134m 20 --gradient-accumulation-steps "$GPUS"
      BATCH=4 LOGSTEPS=1 train loss_all "$T launch --standalone --nproc-per-node $GPUS" llama-134m 20
      python3 scripts/dp_summary.py "$L" | tee "$L/dp_summary.txt";;
    zero)
      # ZeRO-0/1/2 over NCCL on every GPU: each rank's model-state bytes against the formula,
      # rank 0's peak memory and tokens/s (PyTorch's ZeroRedundancyOptimizer and FSDP2 beside
      # them: phase torchddp). Summarised with the dp runs by dp_summary.py.
      prepare
      for preset in ${PRESETS:-llama-134m tinyllama-1.1b}; do
        steps=30; [ "$preset" = tinyllama-1.1b ] && steps=15
        for stage in 0 1 2; do
          train "zero${stage}_$preset" "$T launch --standalone --nproc-per-node $GPUS" "$preset" \
            "$steps" --zero-stage "$stage"
        done
      done
      python3 scripts/dp_summary.py "$L" | tee "$L/dp_summary.txt";;
    split)
      # Tensor and pipeline parallelism with device buffers over NCCL: TinyLlama at TP = the
      # GPUs up to 4 (its 4 kv heads; data parallelism around it beyond), and at PP = the GPUs
      # (8 micro-batches of 1 × 2048), and on 4 GPUs or more TP 2 × PP 2 (data parallelism
      # around it beyond 4).
      if [ "$GPUS" -lt 2 ]; then echo "split: skipped, one GPU (nothing to split over)"; continue; fi
      prepare
      tp=$(( GPUS < 4 ? GPUS : 4 ))
      train "tp${tp}_tinyllama-1.1b" "$T launch --standalone --nproc-per-node $GPUS" tinyllama-1.1b 20 \
        --tp-size "$tp"
      BATCH=1 train "pp${GPUS}_tinyllama-1.1b" "$T launch --standalone --nproc-per-node $GPUS" \
        tinyllama-1.1b 20 --pp-size "$GPUS" --gradient-accumulation-steps 8
      if [ "$GPUS" -ge 4 ]; then
        BATCH=1 train "tp2pp2_tinyllama-1.1b" "$T launch --standalone --nproc-per-node $GPUS" \
          tinyllama-1.1b 20 --tp-size 2 --pp-size 2 --gradient-accumulation-steps 8
      fi
      grep -h "hybrid parallel" "$L"/tp*_tinyllama-1.1b.log "$L"/pp*_tinyllama-1.1b.log | head -2
      python3 scripts/dp_summary.py "$L" | tee "$L/dp_summary.txt";;
    mfu7b)
      # Llama-2-7B's shape (random weights, sequences of 4096) with the advisor's recommended
      # layout for these GPUs at 16 sequences per GPU and step, launched with its flags;
      # MFU against the prediction by scripts/mfu_summary.py.
      prepare
      "$T" plan --model tests/plan/llama2-7b.json --gpus "$GPUS" --seq-len 4096 \
        --global-batch-size $((16 * GPUS)) --json > "$L/plan7b.json"
      flags=$(python3 -c 'import json, sys; print(" ".join(json.load(open(sys.argv[1]))["recommended_train_flags"]))' "$L/plan7b.json")
      echo "advisor: $flags"
      run mfu7b "$T" launch --standalone --nproc-per-node "$GPUS" train --config tests/plan/llama2-7b.json \
        --data "$W/random" --output-dir "$W/mfu7b" --device cuda --bf16 $flags --max-steps 6 \
        --logging-steps 1 --warmup-steps 0 --learning-rate 1e-5 --save-strategy no --no-samples
      cp "$W/mfu7b/train_log.jsonl" "$L/mfu7b.jsonl" 2>/dev/null
      python3 scripts/mfu_summary.py "$L/plan7b.json" "$L/mfu7b.jsonl" | tee "$L/mfu7b.txt"
      rm -rf "$W/mfu7b";;
    torchddp)
      if ls .whl/*.whl > /dev/null 2>&1; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
          && export PYTHONPATH=/tmp/site
      fi
      for n in 1 "$GPUS"; do
        run "torch_ddp$n" torchrun --standalone --nproc-per-node "$n" benches/pytorch_ddp_baseline.py \
          --preset llama-134m tinyllama-1.1b --mode ddp ddp-liger zero1 fsdp2
      done;;
    launcher)
      # Two "nodes" on one host: two launchers, node ranks 0 and 1, one GPU each.
      port=29611
      CUDA_VISIBLE_DEVICES=1 "$T" launch --nnodes 2 --node-rank 1 --master-addr 127.0.0.1 \
        --master-port $port --nproc-per-node 1 -- "$B/bin/tilearn-comm-check" --backend nccl \
        > "$L/nodes_1.log" 2>&1 &
      CUDA_VISIBLE_DEVICES=0 run nodes_0 "$T" launch --nnodes 2 --node-rank 0 --master-addr 127.0.0.1 \
        --master-port $port --nproc-per-node 1 -- "$B/bin/tilearn-comm-check" --backend nccl
      wait; tail -3 "$L/nodes_1.log";;
    faults)
      # A rank killed mid-job: the launcher ends every rank, names the rank, frees the GPUs.
      t0=$SECONDS
      "$T" launch --standalone --nproc-per-node "$GPUS" --comm-timeout 60 -- "$B/bin/tilearn-comm-check" \
        --backend nccl --rounds 5 --fail-rank 1 --fail-mode kill > "$L/fault_kill.log" 2>&1
      echo "kill: exit $? after $((SECONDS - t0)) s"; tail -4 "$L/fault_kill.log"
      sleep 2; nvidia-smi --query-compute-apps=pid,used_memory --format=csv | tee "$L/fault_gpu_apps.txt"
      # A failing step with --max-restarts 1: the group resumes from the last checkpoint.
      prepare
      SAVE="--save-strategy steps --save-steps 3" train restart \
        "$T launch --standalone --nproc-per-node $GPUS --max-restarts 1" llama-134m 8 --debug-fail-after-step 4
      grep -E "restart|resum|step +8" "$L/restart.log" | tail -5;;
  esac
done
(cd "$OUT" && tar -cJf multi.tar.xz multi && rm -rf multi)
exit $status
