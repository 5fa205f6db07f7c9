# Phase `tma-bwd` (sourced by scripts/gpu-call.sh; uses its `run`, $B and $OUT): the seventh
# session's two changes, each against what it replaces, in one call:
#   * the one-pass backward's Q / dO by TMA (the default) against its cp.async loads
#     (TILEARN_FLASH_SM90_BWD_TMA=0): the harness (correctness at every shape, both timed
#     alternately), gpu_flash_sm90 (the TMA test among them), gemm-bench attention beside SDPA
#     and end to end (TinyLlama preset, 1 x 16 K with checkpointing, llama-134m);
#   * the RMSNorm backward with its dweight sums in shared memory (168 registers, three blocks an
#     SM, instead of 244 and two): gpu-test's RMSNorm cases against the CPU reference, its
#     kernel times under Nsight Compute in one TinyLlama step, and end to end, against the
#     previous build's CLI when the bundle carries it as prev/tilearn;
#   * the TMA forward end to end against its cp.async loads (TILEARN_FLASH_SM90_FWD_TMA=0),
#     which the sixth session measured only in the harness.
# About 7 minutes.
if [ -x hopper-bin/harness ]; then
  run flash_harness timeout 240 hopper-bin/harness
else
  echo "tma-bwd: hopper-bin/harness not carried (build it with scripts/flash_harness.sh)"
fi
for t in gpu_flash_sm90 gpu_matmul_attention gpu_cuda_graph; do
  run "$t" timeout 240 "$B/tests/$t-test" --include-ignored --test-threads=1 --nocapture
done
run gpu_rmsnorm timeout 120 "$B/tests/gpu-test" rmsnorm --include-ignored --test-threads=1 --nocapture

run attn_default timeout 180 "$B/bin/gemm-bench" attention
run attn_bwd_cpasync timeout 180 env TILEARN_FLASH_SM90_BWD_TMA=0 "$B/bin/gemm-bench" attention
run attn_sdpa timeout 180 python3 benches/sdpa_baseline.py
grep -h '"bench":"attention"\|"bench": "attention"' "$OUT"/attn_*.log > "$OUT/attn_table.jsonl"

e2e() { # name, binary, env..., then bench flags after --
  local name=$1 bin=$2; shift 2
  local envs=()
  while [ "$1" != "--" ]; do envs+=("$1"); shift; done
  shift
  run "e2e_$name" timeout 150 env "${envs[@]}" "$bin" bench --json "$@"
}
long=(--preset tinyllama-1.1b --batch 1 --seq 16384 --gradient-checkpointing --steps 4 --warmup 2)
for rep in 1 2; do
  e2e "16k_default_$rep" "$B/bin/tilearn" -- "${long[@]}"
  e2e "16k_bwdcp_$rep" "$B/bin/tilearn" TILEARN_FLASH_SM90_BWD_TMA=0 -- "${long[@]}"
done
e2e 16k_fwdcp "$B/bin/tilearn" TILEARN_FLASH_SM90_FWD_TMA=0 -- "${long[@]}"
for preset in tinyllama-1.1b llama-134m; do
  e2e "${preset}_default" "$B/bin/tilearn" -- --preset "$preset" --steps 10
  e2e "${preset}_bwdcp" "$B/bin/tilearn" TILEARN_FLASH_SM90_BWD_TMA=0 -- --preset "$preset" --steps 10
  if [ -x "$B/prev/tilearn" ]; then
    e2e "${preset}_prev" "$B/prev/tilearn" -- --preset "$preset" --steps 10
  fi
done
e2e tinyllama_fwdcp "$B/bin/tilearn" TILEARN_FLASH_SM90_FWD_TMA=0 -- --preset tinyllama-1.1b --steps 10
grep -h '"impl"' "$OUT"/e2e_*.log > "$OUT/e2e_table.jsonl"
for f in "$OUT"/e2e_*.log; do
  printf '%s %s\n' "$(basename "$f" .log)" "$(grep -h -o '"tokens_per_s[^,]*' "$f" | head -1)"
done

ncu_bin=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
if [ -n "$ncu_bin" ]; then
  for which in new prev; do
    bin="$B/bin/tilearn"; [ "$which" = prev ] && bin="$B/prev/tilearn"
    [ -x "$bin" ] || continue
    run "norm_ncu_$which" timeout 200 "$ncu_bin" --csv --page raw -k regex:rmsnorm_backward \
      --launch-skip 88 --launch-count 44 --metrics gpu__time_duration.sum,dram__bytes.sum \
      --cache-control none --clock-control none "$bin" bench --preset tinyllama-1.1b --steps 1 --json
    python3 scripts/ncu_kernel_sum.py "$OUT/norm_ncu_$which.log" "rmsnorm backward ($which)"
  done
else
  echo "tma-bwd: ncu not found (no RMSNorm kernel times)"
fi
