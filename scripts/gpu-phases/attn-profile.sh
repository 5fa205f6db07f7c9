# Phase `attn-profile` (sourced by scripts/gpu-call.sh; uses its `run` and $OUT): Nsight Compute
# on the Hopper attention kernels at 1 x 16 K (bf16, 32/4 heads, head_dim 64), where the forward
# trails SDPA's cuDNN (2.19 against 2.08 ms forward, 6.86 against 6.75 backward, 2026-12-03):
# the development harness's
# `profile16k` mode runs the forward and the one-pass backward twice; the second launch of each
# is profiled with the sections that say where a kernel waits (throughput against the SM's
# peaks, pipe utilisation, warp stall reasons, occupancy, memory traffic), to $OUT/attn_ncu.csv.
# Then the SASS of the harness's sm_90a kernels (cuobjdump) to $OUT/harness_sass.txt.xz, to count
# what each step issues. Needs hopper-bin/harness (scripts/flash_harness.sh). About a minute.
ncu_bin=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
if [ ! -x hopper-bin/harness ]; then
  echo "attn-profile: hopper-bin/harness not carried (build it with scripts/flash_harness.sh)"
elif [ -z "$ncu_bin" ]; then
  echo "attn-profile: ncu not found (not run)"
else
  run attn_ncu timeout 300 "$ncu_bin" --clock-control none -k regex:"fwd_tma_kernel|dkdv_ws_kernel" \
    --launch-skip 2 --launch-count 2 --section SpeedOfLight --section ComputeWorkloadAnalysis \
    --section MemoryWorkloadAnalysis --section Occupancy --section SchedulerStats \
    --section WarpStateStats --section LaunchStats --section InstructionStats --csv --page details \
    hopper-bin/harness profile16k
  grep -h '^"' "$OUT/attn_ncu.log" > "$OUT/attn_ncu.csv"
  grep -h -E 'Duration|Compute \(SM\) Throughput|Issue Slots Busy|Stall|Warp Cycles Per Issued|Achieved Occupancy' \
    "$OUT/attn_ncu.csv" | cut -c1-200 | head -60
  cuobjdump_bin=$(command -v cuobjdump || ls /usr/local/cuda/bin/cuobjdump 2>/dev/null | head -1)
  if [ -n "$cuobjdump_bin" ]; then
    "$cuobjdump_bin" -sass hopper-bin/harness | xz -T4 -6 > "$OUT/harness_sass.txt.xz"
  else
    echo "attn-profile: cuobjdump not found (no SASS)"
  fi
fi
