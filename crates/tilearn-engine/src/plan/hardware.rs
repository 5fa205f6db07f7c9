//! The machine the advisor plans for: GPU memory, how the GPUs sit in nodes, and the ceilings
//! the cost model divides by. Measured figures say where they were measured; the interconnect
//! figures are assumptions (no multi-GPU run of this project has measured them yet) and say so.

use serde::Serialize;

const GIB: f64 = (1u64 << 30) as f64;

/// bf16 GEMM throughput of the engine's cuBLASLt path on one H200 (8192³, random inputs,
/// median of 10; `gemm-bench`, bench/RESULTS.md "Measured ceilings").
pub const H200_BF16_GEMM_FLOPS: f64 = 795.8e12;

/// Device-to-device copy bandwidth of one H200, read + write (`cuMemcpyDtoD` of 4 GiB,
/// bench/RESULTS.md "Measured ceilings").
pub const H200_COPY_BYTES_PER_S: f64 = 4.26e12;

/// The fused AdamW's measured bandwidth on 1.1 × 10⁹ parameters (86 % of the copy; bench/RESULTS.md
/// "Fused optimizers").
pub const H200_FUSED_ADAMW_BYTES_PER_S: f64 = 3.659e12;

/// The portable (mma.sync) flash attention kernels' forward and backward throughput at the
/// TinyLlama shape (B 8, T 2048, 32/4 heads, D 64; causal FLOPs, the backward counted as 2.5×
/// the forward; bench/RESULTS.md, `gemm-bench attention`): what head_dim 128 runs on an H200.
pub const H200_FLASH_FORWARD_FLOPS: f64 = 275.0e12;
pub const H200_FLASH_BACKWARD_FLOPS: f64 = 173.5e12;

/// The Hopper (wgmma) flash kernels that serve head_dim 64 on an H200: forward and one-pass
/// backward throughput at T = 2048 (the TinyLlama shape) and at T = 16 384 (one sequence,
/// 32/4 heads), same counting (bench/RESULTS.md "One-pass Hopper backward", `gemm-bench
/// attention`). Longer key walks amortise each CTA's prologue, so the rate grows with T; the
/// cost model interpolates in log T between the two and holds the end values outside.
pub const H200_HOPPER_FLASH_SEQS: [f64; 2] = [2048.0, 16384.0];
pub const H200_HOPPER_FLASH_FORWARD_FLOPS: [f64; 2] = [330.7e12, 430.5e12];
pub const H200_HOPPER_FLASH_BACKWARD_FLOPS: [f64; 2] = [273.1e12, 335.8e12];

/// The cuBLASLt attention path (head sizes the flash kernels do not serve, or fp32), same
/// measurement.
pub const H200_GEMM_ATTENTION_FORWARD_FLOPS: f64 = 32.7e12;
pub const H200_GEMM_ATTENTION_BACKWARD_FLOPS: f64 = 53.5e12;

/// Dense bf16 datasheet peak of an H100/H200 SXM: the MFU denominator (as `tilearn bench`).
pub const H200_PEAK_BF16_FLOPS: f64 = 989e12;

/// **Assumption**: NCCL all-reduce bus bandwidth inside one NVLink-4 node of 8 GPUs
/// (900 GB/s bidirectional per GPU; nccl-tests typically report 350–480 GB/s bus bandwidth).
/// Not measured by this project yet (issue 17's multi-GPU runs will).
pub const NVLINK_BUS_BYTES_PER_S: f64 = 360e9;

/// **Assumption**: bus bandwidth of a collective that crosses nodes, one 400 Gb/s NDR
/// InfiniBand adapter per GPU (50 GB/s line rate, ~80 % reached).
pub const INFINIBAND_BUS_BYTES_PER_S: f64 = 40e9;

/// **Assumption**: the fixed cost of one collective or send/receive (launch and latency).
pub const COLLECTIVE_LATENCY_S: f64 = 20e-6;

/// Memory the plan keeps free on each GPU besides what the model allocates: the CUDA context
/// (about 0.5 GiB on an H200), modules loaded after the build and allocator slack.
pub const RESERVED_BYTES: f64 = 1.0 * GIB;

/// Device memory of one NCCL communicator (its buffers and channels): measured as the
/// difference between a launched world-size-1 run and a plain one on the H200 (8.76 − 8.19 GiB,
/// bench/RESULTS.md "Data parallel on the GPU engine"). Counted once per group of more than one
/// rank.
pub const NCCL_COMMUNICATOR_BYTES: f64 = 0.57 * GIB;

/// The GPUs a plan is for and the rates it assumes.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Hardware {
    /// All GPUs of the job.
    pub gpus: usize,
    /// GPUs of one node (`gpus / nnodes`): tensor parallelism stays inside a node.
    pub gpus_per_node: usize,
    /// Memory of one GPU, bytes.
    pub gpu_memory_bytes: f64,
    pub gemm_flops: f64,
    pub copy_bytes_per_s: f64,
    pub optimizer_bytes_per_s: f64,
    pub flash_forward_flops: f64,
    pub flash_backward_flops: f64,
    /// The Hopper kernels' (head_dim 64) rates at the sequence lengths `hopper_flash_seqs`.
    pub hopper_flash_seqs: [f64; 2],
    pub hopper_flash_forward_flops: [f64; 2],
    pub hopper_flash_backward_flops: [f64; 2],
    pub gemm_attention_forward_flops: f64,
    pub gemm_attention_backward_flops: f64,
    pub peak_flops: f64,
    pub intra_node_bus_bytes_per_s: f64,
    pub inter_node_bus_bytes_per_s: f64,
    pub collective_latency_s: f64,
    pub reserved_bytes: f64,
    pub nccl_communicator_bytes: f64,
}

impl Hardware {
    /// `gpus` H200-class GPUs of `gpu_memory_bytes` each in `nnodes` nodes (the caller checks
    /// that `nnodes` divides `gpus`).
    pub fn h200(gpus: usize, nnodes: usize, gpu_memory_bytes: f64) -> Hardware {
        Hardware {
            gpus,
            gpus_per_node: gpus / nnodes.max(1),
            gpu_memory_bytes,
            gemm_flops: H200_BF16_GEMM_FLOPS,
            copy_bytes_per_s: H200_COPY_BYTES_PER_S,
            optimizer_bytes_per_s: H200_FUSED_ADAMW_BYTES_PER_S,
            flash_forward_flops: H200_FLASH_FORWARD_FLOPS,
            flash_backward_flops: H200_FLASH_BACKWARD_FLOPS,
            hopper_flash_seqs: H200_HOPPER_FLASH_SEQS,
            hopper_flash_forward_flops: H200_HOPPER_FLASH_FORWARD_FLOPS,
            hopper_flash_backward_flops: H200_HOPPER_FLASH_BACKWARD_FLOPS,
            gemm_attention_forward_flops: H200_GEMM_ATTENTION_FORWARD_FLOPS,
            gemm_attention_backward_flops: H200_GEMM_ATTENTION_BACKWARD_FLOPS,
            peak_flops: H200_PEAK_BF16_FLOPS,
            intra_node_bus_bytes_per_s: NVLINK_BUS_BYTES_PER_S,
            inter_node_bus_bytes_per_s: INFINIBAND_BUS_BYTES_PER_S,
            collective_latency_s: COLLECTIVE_LATENCY_S,
            reserved_bytes: RESERVED_BYTES,
            nccl_communicator_bytes: NCCL_COMMUNICATOR_BYTES,
        }
    }

    /// Forward and backward FLOP/s of causal attention at head dimension `head_dim` over
    /// sequences of `seq` tokens: the Hopper kernels' rates (interpolated in log T) at 64, the
    /// portable flash kernels' at 128, the cuBLASLt path's otherwise.
    pub fn attention_flops(&self, head_dim: usize, seq: usize) -> (f64, f64) {
        match head_dim {
            64 => {
                let [t0, t1] = self.hopper_flash_seqs;
                let x = ((seq.max(1) as f64).ln() - t0.ln()) / (t1.ln() - t0.ln());
                let x = x.clamp(0.0, 1.0);
                let lerp = |r: [f64; 2]| r[0] + x * (r[1] - r[0]);
                (
                    lerp(self.hopper_flash_forward_flops),
                    lerp(self.hopper_flash_backward_flops),
                )
            }
            128 => (self.flash_forward_flops, self.flash_backward_flops),
            _ => (
                self.gemm_attention_forward_flops,
                self.gemm_attention_backward_flops,
            ),
        }
    }

    /// Bus bandwidth of a group whose ranks span `span` consecutive ranks (TP innermost, so a
    /// group of stride s and size k spans s·k): NVLink when that fits in a node.
    pub fn bus_bytes_per_s(&self, span: usize) -> f64 {
        if span <= self.gpus_per_node {
            self.intra_node_bus_bytes_per_s
        } else {
            self.inter_node_bus_bytes_per_s
        }
    }

    /// Memory a plan may fill on one GPU.
    pub fn usable_bytes(&self) -> f64 {
        (self.gpu_memory_bytes - self.reserved_bytes).max(0.0)
    }
}
