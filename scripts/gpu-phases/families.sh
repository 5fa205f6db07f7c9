# Phase `families` (sourced by scripts/gpu-call.sh; uses its `run`, $B and $OUT): issue 14's
# ALiBi families on the GPU (Baichuan-13B, Baichuan2-13B with NormHead and z-loss; Bloom when
# its tests are in the bundle), about 2-3 minutes:
#   1. the z-loss kernels (and the other family ops) against the f64 CPU reference;
#   2. the device model on every family golden (f32 logits/loss/gradients, bf16 loss; loss head
#      unchunked and in 5-token chunks) and random head_dim-64 models of each family against
#      the CPU engine (bf16 takes the flash kernels' ALiBi instantiation), the GPU decoder;
#   3. the new family goldens (13B Baichuans, Bloom) regenerated here with this machine's
#      torch/transformers, diffed against the committed fixtures (compare_family_goldens.py);
#   4. benches: the Baichuan2-13B-shaped preset at 4 layers; bloom-560m next to the PyTorch
#      eager Bloom baseline of the same shape, in this same call;
#   5. Llama unchanged: gpu_model and the llama-134m bench.
run families_ops "$B/tests/gpu_family_ops-test" --include-ignored --test-threads=1 --nocapture
run families_gpu "$B/tests/gpu_families-test" --include-ignored --test-threads=1 --nocapture
NEW_CASES="baichuan_13b baichuan2_13b bloom_tied bloom_v4config"
run families_golden_regen python3 tests/golden_families/make_family_golden.py --out "$OUT/famgold" --only $NEW_CASES
run families_golden_diff python3 scripts/compare_family_goldens.py tests/golden_families "$OUT/famgold" $NEW_CASES
(cd "$OUT" && tar -cf famgold.tar famgold && rm -rf famgold)
run families_bench_baichuan2_13b "$B/bin/tilearn" bench --preset baichuan2-13b-4l --steps 5 --json
# Batch 4 x 2048 on both sides: PyTorch's eager Bloom keeps every layer's f32 scores.
run families_bench_bloom "$B/bin/tilearn" bench --preset bloom-560m --batch 4 --steps 5 --json
run families_torch_bloom timeout 200 python3 benches/pytorch_baseline.py --preset bloom-560m --mode eager --batch 4 --steps 5
# Llama unchanged: its device-model tests and its bench (compare with earlier RESULTS).
run families_gpu_model "$B/tests/gpu_model-test" --include-ignored --test-threads=1 --nocapture
run families_bench_llama "$B/bin/tilearn" bench --preset llama-134m --steps 10 --json
grep -h '"impl"' "$OUT"/families_bench_*.log "$OUT"/families_torch_*.log > "$OUT/families_bench.jsonl" 2>/dev/null
