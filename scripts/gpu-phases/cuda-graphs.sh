# Phase `cuda-graphs` (sourced by scripts/gpu-call.sh; uses its `run`, $B and $OUT): the
# whole-step CUDA graph (issue 13 goal 3, `--cuda-graphs`). About 2-3 minutes:
#  1. the kernels' device-scalar variants against their argument variants / the CPU
#     (cross entropy with the factor in device memory, AdamW with a device group table);
#  2. the engine: graph steps vs eager steps bit for bit, on/auto refusals and fallbacks;
#  3. tilearn bench, both presets, --cuda-graphs on vs off (tokens/s; the JSON line's
#     `cuda_graphs` says how the steps ran and, if capture failed, why);
#  4. tilearn train (embedded default, bf16, 40 steps, --deterministic), --cuda-graphs auto vs
#     off: the logged losses must be identical, and the log's "CUDA graphs:" notes say what was
#     captured.
run cg_ce_device_factor "$B/tests/gpu_loss-test" cross_entropy_device_factor --include-ignored \
  --test-threads=1 --nocapture
for t in "$B"/tests/gpu-test*; do
  [ -x "$t" ] && run "cg_adamw_device_groups_$(basename "$t")" "$t" adamw_with_device_group_table \
    --include-ignored --test-threads=1 --nocapture
done
run cg_engine "$B/tests/gpu_cuda_graph-test" --include-ignored --test-threads=1 --nocapture
for preset in llama-134m tinyllama-1.1b; do
  for g in off on; do
    run "cg_bench_${preset}_$g" "$B/bin/tilearn" bench --preset "$preset" --steps 10 \
      --cuda-graphs "$g" --json
    grep -h '"impl"' "$OUT/cg_bench_${preset}_$g.log" >> "$OUT/cg_bench.jsonl"
  done
done
echo "--- cuda-graphs bench (tokens/s, step ms, how the steps ran):"
python3 - "$OUT/cg_bench.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    g = r.get("cuda_graphs") or {}
    print(f'{r["preset"]:15s} graphs={g.get("mode")} {r["tokens_per_sec"]:10.0f} tok/s '
          f'{r["step_ms"]:8.2f} ms peak {r["peak_mem_gib"]:.2f} GiB loss {r["loss"]:.5f} '
          f'eager={g.get("eager_steps")} captured={g.get("captured_steps")} '
          f'replayed={g.get("replayed_steps")} fallback={g.get("fallback")}')
PY
for g in off auto; do
  run "cg_train_$g" "$B/bin/tilearn" train --device cuda --bf16 --max-steps 40 --logging-steps 1 \
    --save-steps 0 --output-dir "$OUT/cg_run_$g" --cuda-graphs "$g" --deterministic
  cp "$OUT/cg_run_$g/train_log.jsonl" "$OUT/cg_train_$g.jsonl" 2>/dev/null
  grep -h "CUDA graphs" "$OUT/cg_train_$g.log" | head -5
  rm -rf "$OUT/cg_run_$g"
done
echo "--- cuda-graphs train: eager vs auto losses"
python3 - "$OUT/cg_train_off.jsonl" "$OUT/cg_train_auto.jsonl" <<'PY'
import json, sys
def losses(p):
    try:
        return [json.loads(l).get("loss") for l in open(p) if '"loss"' in l]
    except OSError as e:
        return str(e)
a, b = losses(sys.argv[1]), losses(sys.argv[2])
if isinstance(a, str) or isinstance(b, str):
    print("missing log:", a if isinstance(a, str) else b)
else:
    same = sum(x == y for x, y in zip(a, b))
    print(f"{len(a)} / {len(b)} logged steps, {same} identical losses; first {a[:3]} / {b[:3]}; "
          f"last {a[-1:]} / {b[-1:]}")
PY
