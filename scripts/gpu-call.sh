#!/usr/bin/env bash
# Runs on the GPU machine from the repository root, with target/gpu-bundle carried (see
# ../shared/gpu/bundle.sh). Phases are named on the command line; every phase writes its log
# under $OUT and a failure in one phase does not stop the others.
#   scripts/gpu-call.sh kernels goldens host largemodel
set -uo pipefail
B=target/gpu-bundle
. "$B/env.sh"
# The launcher-level tests run the bundled CLI.
export TILEARN_BIN_DIR="$PWD/$B/bin"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
status=0
run() { # name, command...
  local name=$1; shift
  echo "=== $name: $*"
  if "$@" > "$OUT/$name.log" 2>&1; then echo "--- $name ok"; else echo "--- $name FAILED ($?)"; status=1; fi
  grep -E "test result|rel err|error|FAILED|panicked|tflops|GB/s|gb_per_s|\"impl\"|skipped" "$OUT/$name.log" | tail -40
}
for phase in "$@"; do
  case $phase in
    kernels)
      for t in $(cd "$B/tests" && ls | grep -E "^gpu(-test|_elementwise|_loss|_matmul)"); do
        [ -x "$B/tests/$t" ] && run "$t" "$B/tests/$t" --include-ignored --test-threads=1 --nocapture
      done;;
    model)
      run gpu_model "$B/tests/gpu_model-test" --include-ignored --test-threads=1 --nocapture
      run gpu_precision "$B/tests/gpu_precision-test" --include-ignored --test-threads=1 --nocapture
      run gpu_streaming "$B/tests/gpu_streaming-test" --include-ignored --test-threads=1 --nocapture;;
    amp)
      # One GPU run of the embedded default per mixed-precision policy, next to plain bf16 and
      # fp16; logs summarised by scripts/amp_timeline.py, kept in one tar (few files return).
      D="$OUT/amp"; mkdir -p "$D"; sums=()
      amp_run() { # name, flags...
        local name=$1; shift
        run "amp_$name" "$B/bin/tilearn" train --device cuda --output-dir "$D/$name" --save-steps 0 \
          --logging-steps 1 "$@"
        cp "$D/$name/train_log.jsonl" "$D/$name.jsonl" 2>/dev/null; rm -rf "$D/$name"
        sums+=("$name=$D/$name.jsonl")
      }
      amp_run bf16 --bf16
      amp_run fp16 --fp16
      amp_run policy0 --amp-policy 0 --amp-start 30 --amp-end 270
      amp_run policy1 --amp-policy 1 --amp-start 30 --amp-end 300 --amp-hold 20
      amp_run policy2 --amp-policy 2 --amp-start 10 --amp-interval 100 --amp-interval-hold 20
      amp_run auto --amp-policy auto
      amp_run auto_injected --amp-policy auto --amp-hold 30 --debug-inject-overflow "$(seq -s, 40 57)"
      python3 scripts/amp_timeline.py "${sums[@]}" | tee "$OUT/amp_summary.jsonl"
      # Throughput of fp16 (GradScaler included) against bf16, ours and PyTorch's, same call.
      for p in bf16 fp16; do
        for preset in llama-134m tinyllama-1.1b; do
          run "bench_${preset}_$p" "$B/bin/tilearn" bench --preset "$preset" --precision "$p" --steps 10 --json
        done
        run "torch_eager_$p" timeout 200 python3 benches/pytorch_baseline.py --mode eager --steps 10 --precision "$p"
      done
      (cd "$OUT" && tar -cf amp.tar amp && rm -rf amp);;
    goldens)
      run optim_golden python3 tests/optim_golden/make_optim_golden.py --device cuda --out "$OUT/optim_golden_cuda"
      TILEARN_OPTIM_GOLDEN_DIR="$OUT/optim_golden_cuda" run optim_replay "$B/tests/torch_trajectories-test" --nocapture
      run amp_golden python3 tests/amp_golden/make_scaler_golden.py --device cuda --out "$OUT/amp_golden"
      AMP_GOLDEN_DIR="$OUT/amp_golden" run amp_replay "$B/tests/torch_trajectory-test" --nocapture
      (cd "$OUT" && tar -cf goldens.tar optim_golden_cuda amp_golden && rm -rf optim_golden_cuda amp_golden);;
    host)
      run affinity_host "$B/tests/host-test" --nocapture --test-threads=1
      run hostbench "$B/bin/tilearn-hostbench" --loader-batches 500 --repeats 3;;
    train)
      # The main job on the GPU: the embedded default, bf16, then a resume from its checkpoint.
      run train_gpu "$B/bin/tilearn" train --device cuda --output-dir "$OUT/run" --save-steps 150
      run train_gpu_resume "$B/bin/tilearn" train --device cuda --output-dir "$OUT/run-resumed" \
        --data "$OUT/run/data" --max-steps 300 --resume-from-checkpoint "$OUT/run/checkpoint-150"
      cp "$OUT/run/train_log.jsonl" "$OUT/train_gpu_log.jsonl" 2>/dev/null
      rm -rf "$OUT/run" "$OUT/run-resumed";;
    largemodel)
      # Issue 18: a Llama-2-7B-shaped run around its steps (disk bandwidth, time to first
      # step, host RSS, save times); summary in $OUT/large_model_summary.txt, ~3-5 min.
      run large_model scripts/large_model_run.sh "$B/bin/tilearn";;
    e2e)
      for p in llama-134m tinyllama-1.1b; do
        run "bench_$p" "$B/bin/tilearn" bench --preset "$p" --steps 10 --json
      done
      run torch_eager timeout 240 python3 benches/pytorch_baseline.py --mode eager --steps 10
      run torch_compile timeout 300 python3 benches/pytorch_baseline.py --mode compile --steps 10;;
    ceilings)
      run gemm_bench "$B/bin/gemm-bench"
      run optim_bench "$B/bin/optim-bench" --steps 20
      run torch_optim timeout 300 python3 benches/pytorch_optim_baseline.py --steps 20;;
    *)
      # A phase of its own file (scripts/gpu-phases/NAME.sh, sourced here: it may use run, $B, $OUT),
      # so that work on separate issues adds phases without editing this list.
      if [ -f "scripts/gpu-phases/$phase.sh" ]; then . "scripts/gpu-phases/$phase.sh"
      else echo "unknown phase: $phase"; status=1; fi;;
  esac
done
# Only a few files come back from the device: every log travels in one tar, appended to (a
# command that runs this script twice keeps the first run's logs).
(cd "$OUT" && ls *.log > /dev/null 2>&1 && tar -rf logs.tar *.log && rm -f *.log)
exit $status
