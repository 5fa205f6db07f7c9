# Phase `dxadd` (sourced by scripts/gpu-call.sh; uses its `run`, $B and $OUT): the block
# backward with the k, v and up projections' input gradients added by their GEMMs (beta = 1)
# instead of written to scratch and summed by a residual kernel, end to end against the build
# before it, in the same call: $B/bin/tilearn-base (carried beside the bundle's tilearn) and
# $B/bin/tilearn alternate, twice each, at both presets (bf16, default mode), to
# $OUT/dxadd_table.jsonl. Skipped (said so) when tilearn-base is not carried.
if [ ! -x "$B/bin/tilearn-base" ]; then
  echo "dxadd: $B/bin/tilearn-base not carried (not run)"
else
  for preset in tinyllama-1.1b llama-134m; do
    for rep in 1 2; do
      for bin in tilearn-base tilearn; do
        run "dxadd_${preset}_${bin}_$rep" timeout 150 "$B/bin/$bin" bench --preset "$preset" \
          --steps 10 --json
        sed "s/^{/{\"binary\":\"$bin\",/" "$OUT/dxadd_${preset}_${bin}_$rep.log" | grep -h '"impl"' \
          >> "$OUT/dxadd_table.jsonl"
      done
    done
  done
fi
