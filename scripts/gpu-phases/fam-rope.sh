# Phase `fam-rope` (sourced by scripts/gpu-call.sh; uses its `run`, $B and $OUT): the RoPE model
# families of issue 14 (Qwen2, Mistral, Baichuan-7B, Baichuan2-7B) on the GPU.
#   1. the NormHead row-normalise kernel against the CPU reference (f32, bf16, f16);
#   2. the device model on the family goldens (f32 logits/loss/gradients, bf16 loss; loss head
#      unchunked and in 5-token chunks) and random head_dim-64 models of each family against
#      the CPU engine (bf16 takes the flash kernels with the sliding window as key mask);
#   3. `tilearn bench --preset qwen2-0.5b` next to the PyTorch eager baseline of the same shape,
#      and the Baichuan2-7B-shaped preset at 8 layers (no PyTorch baseline: Baichuan's modeling
#      code is not in transformers).
# (The CPU goldens and the Python reference's check of saved checkpoints run on the CPU:
# tests/golden_families.rs.) About 2-3 minutes.
run fam_row_normalize "$B/tests/gpu_row_normalize-test" --include-ignored --test-threads=1 --nocapture
run fam_gpu_families "$B/tests/gpu_families-test" --include-ignored --test-threads=1 --nocapture
run fam_bench_qwen2 "$B/bin/tilearn" bench --preset qwen2-0.5b --steps 10 --json
run fam_torch_qwen2 timeout 240 python3 benches/pytorch_baseline.py --preset qwen2-0.5b --mode eager --steps 10
run fam_bench_baichuan2 "$B/bin/tilearn" bench --preset baichuan2-7b-8l --steps 5 --json
grep -h '"impl"' "$OUT"/fam_bench_*.log "$OUT"/fam_torch_*.log > "$OUT/fam_rope_bench.jsonl" 2>/dev/null
