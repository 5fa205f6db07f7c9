# Issue 16 (tilearn-recsys) on one GPU, sourced by scripts/gpu-call.sh (uses run, $B, $OUT);
# about 1-2 minutes:
#   * the GPU tests: the embedding-bag kernels and the GPU DeepFM / Wide & Deep step against the
#     CPU (gradients, 60-step loss curves, exact resume);
#   * DeepFM end to end on synthetic Criteo-shaped data (100 steps of 16384 samples, then exact
#     AUC on 131072 held-out samples): `tilearn ctr bench`, then the PyTorch DeepFM of
#     benches/pytorch_recsys_baseline.py on the same batches (exported by the first);
#   * the embedding operator beside FBGEMM's TBE when fbgemm_gpu imports (or a wheel of it is
#     found and installs): 26 tables of 10^5 rows, dim 128, batch 16384, row-wise Adagrad.
run recsys_embedding_bag_gpu "$B/tests/embedding_bag_gpu-test" --include-ignored --test-threads=1 --nocapture
run recsys_ctr_gpu "$B/tests/ctr_gpu-test" --include-ignored --test-threads=1 --nocapture

ctr_data="$OUT/ctr_bench_data"
run recsys_ctr_bench_tilearn "$B/bin/tilearn" ctr bench --device cuda --batch-size 16384 --steps 100 \
  --export "$ctr_data"
run recsys_ctr_bench_torch timeout 240 python3 benches/pytorch_recsys_baseline.py --deepfm-data "$ctr_data"
grep -h '^{' "$OUT/recsys_ctr_bench_tilearn.log" "$OUT/recsys_ctr_bench_torch.log" > "$OUT/recsys_ctr_bench.jsonl" 2>/dev/null
rm -rf "$ctr_data"

if ! python3 -c "import fbgemm_gpu" > /dev/null 2>&1; then
  for wheel in .whl/fbgemm_gpu-*.whl shared/wheels/fbgemm_gpu-*.whl wheels/fbgemm_gpu-*.whl /work/wheels/fbgemm_gpu-*.whl; do
    [ -f "$wheel" ] || continue
    python3 -m pip install --no-deps --no-index --target /tmp/recsys_fbgemm "$wheel" > "$OUT/recsys_fbgemm_install.log" 2>&1 \
      && export PYTHONPATH="/tmp/recsys_fbgemm${PYTHONPATH:+:$PYTHONPATH}"
    break
  done
fi
a=(--tables 26 --rows 100000 --dim 128 --batch 16384 --zipf 1.05 --optimizer adagrad)
run recsys_op_tilearn timeout 120 "$B/bin/recsys-bench" "${a[@]}"
run recsys_op_torch_fbgemm timeout 120 python3 benches/pytorch_recsys_baseline.py --op --fbgemm "${a[@]}"
