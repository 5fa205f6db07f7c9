# Issue 16: the embedding operator beside PyTorch's nn.EmbeddingBag and FBGEMM's TBE in one call;
# sourced by scripts/gpu-call.sh (uses run, $B, $OUT); about 2 minutes.
# fbgemm-gpu 1.6.0 (the cp312 release built against torch 2.11 / CUDA 13) is a 465 MB wheel,
# over what one device call carries, so it travels as parts of an xz tar (.fbg/part-NN, carried
# in consecutive calls to the same warm machine) of the wheel's files without the three
# libraries a training benchmark never loads (tbe_inference, tbe_training_backward_gwd and _vbe:
# inference, global weight decay and variable batch sizes); their names are dropped from the
# package's load list, nothing else is changed.
F=/tmp/fbgemm_slim
if [ ! -d "$F/fbgemm_gpu" ] && ls .fbg/part-* > /dev/null 2>&1; then
  mkdir -p "$F" && cat .fbg/part-* | xz -dc | tar -x -C "$F" \
    && sed -i '/"fbgemm_gpu_tbe_inference",/d; /"fbgemm_gpu_tbe_training_backward_gwd",/d; /"fbgemm_gpu_tbe_training_backward_vbe",/d' \
      "$F/fbgemm_gpu/__init__.py"
fi
export PYTHONPATH="$F${PYTHONPATH:+:$PYTHONPATH}"
run fbgemm_import python3 -c "import torch, fbgemm_gpu; print('fbgemm_gpu', fbgemm_gpu.__version__, 'torch', torch.__version__)"
# (dim, rows per table, batch): 26 tables, one id per bag, zipf(1.05), row-wise Adagrad.
for cfg in 128,100000,16384 128,1000000,65536 16,1000000,16384 16,10000000,65536; do
  IFS=, read -r dim rows batch <<< "$cfg"
  a=(--tables 26 --rows "$rows" --dim "$dim" --batch "$batch" --zipf 1.05 --optimizer adagrad)
  run "fbgemm_op_tilearn_${dim}_${rows}_${batch}" timeout 120 "$B/bin/recsys-bench" "${a[@]}"
  run "fbgemm_op_torch_${dim}_${rows}_${batch}" timeout 150 python3 benches/pytorch_recsys_baseline.py --op --fbgemm "${a[@]}"
done
grep -h '^{' "$OUT"/fbgemm_op_*.log > "$OUT/fbgemm_op.jsonl" 2>/dev/null
