#!/usr/bin/env bash
# Builds the development harnesses for sm_90a into OUT_DIR (default hopper-bin/, which git
# ignores: carry it to the device with the `run` tool's `carry`): scripts/flash_harness.cu (the
# flash kernels) as `harness`, scripts/elementwise_harness.cu (the MLP's memory-bound kernels)
# as `elementwise`. Uses $NVCC, else the pinned nvcc that `cargo xtask setup-cuda` installs.
set -euo pipefail
cd "$(dirname "$0")/.."
NVCC=${NVCC:-target/cuda/bin/nvcc}
OUT_DIR=${OUT_DIR:-hopper-bin}
K=crates/tilearn-kernels/kernels
mkdir -p "$OUT_DIR"
"$NVCC" -std=c++17 -O3 -I"$K/include" -gencode=arch=compute_90a,code=sm_90a \
  scripts/flash_harness.cu "$K/flash_attention.cu" "$K/flash_attention_sm90.cu" \
  "$K/attention.cu" -o "$OUT_DIR/harness"
"$NVCC" -std=c++17 -O3 -I"$K/include" -gencode=arch=compute_90a,code=sm_90a \
  scripts/elementwise_harness.cu "$K/activation.cu" -o "$OUT_DIR/elementwise"
echo "built $OUT_DIR/harness and $OUT_DIR/elementwise"
