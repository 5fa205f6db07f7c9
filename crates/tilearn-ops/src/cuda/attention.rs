//! Causal grouped-query attention on the GPU, forward and backward, generic over the element
//! type ([`DeviceFloat`]: f32, bf16 or f16). Same contract as [`crate::cpu::attention_forward`] /
//! [`crate::cpu::attention_backward`]: `q`/`out` `[B, T, Hq, D]`, `k`/`v` `[B, T, Hkv, D]`,
//! scale `1/sqrt(D)`, query head `h` reads kv head `h / (Hq/Hkv)`; the forward writes `out` and
//! the log-sum-exp `lse` `[B, Hq, T]` (f32 whatever the element type); the backward writes
//! (`=`) `dq`, `dk`, `dv`.
//!
//! Two implementations ([`AttentionImpl`]; the plain functions take `Auto`):
//! * **Flash** (`crates/tilearn-kernels/kernels/flash_attention.cu`): fused
//!   FlashAttention-2-style kernels on tensor cores for bf16 and f16 at head_dim 64 and 128
//!   ([`flash_attention_supports`]) with 16-byte aligned tensors. The forward keeps S and P on
//!   chip (online softmax) and scores only the key blocks up to the diagonal; the backward
//!   recomputes P from `lse` in two deterministic kernels (dK/dV per key block, summing the GQA
//!   group's heads in a fixed order; dQ per query block) after the `delta` kernel below. No
//!   workspace regions beyond `delta`, except that a workspace built for
//!   [`FlashBackward::OnePass`] also holds an f32 `dq_accum`: where the Hopper kernels run,
//!   one kernel then computes dK, dV and dQ, dQ by f32 atomic adds (faster; dq differs from
//!   run to run at the level of f32 rounding; see `flash_backward.rs`).
//! * **Gemm**: cuBLASLt batched GEMMs for the six matrix products and the row kernels of
//!   `crates/tilearn-kernels/kernels/attention.cu` (causal softmax, probability recomputation,
//!   dS, delta, permutes);
//!   every type and shape, and the exact f32 path. Described below.
//!
//! `Auto` takes the flash kernels wherever they apply. Measured on an H200 (`gemm-bench
//! attention`, bf16, medians of 10; causal FLOPs, backward counted as 2.5× the forward) at
//! llama-134m (B 16, T 1024, Hq = Hkv = 12, D 64) and TinyLlama (B 8, T 2048, Hq 32, Hkv 4,
//! D 64):
//!
//! | shape | path | forward | backward |
//! | --- | --- | --- | --- |
//! | llama-134m | gemm | 0.858 ms, 30 TFLOP/s | 1.441 ms, 45 TFLOP/s |
//! | llama-134m | flash | 0.123 ms, 210 TFLOP/s | 0.476 ms, 135 TFLOP/s |
//! | TinyLlama | gemm | 4.208 ms, 33 TFLOP/s | 6.423 ms, 54 TFLOP/s |
//! | TinyLlama | flash | 0.500 ms, 275 TFLOP/s | 1.980 ms, 174 TFLOP/s |
//!
//! The flash backward recomputes S and dP in both of its kernels (seven products where
//! FlashAttention-2 does five with atomic dQ adds), the price of determinism without atomics.
//!
//! GEMM path algorithm:
//! 1. Permute Q, K, V from `[B, T, H, D]` to per-head `[B, H, T, D]`. The query heads of one
//!    GQA group are then adjacent, so the group's queries form one `[G·T, D]` matrix (G =
//!    Hq/Hkv) that meets its single kv head in *one* GEMM per (batch, kv head): all products
//!    are strided-batched GEMMs with batch B·Hkv and uniform strides.
//! 2. `S = scale · Q_g·K_gᵀ` (`[G·T, T]`, f32), then one warp per row: causal mask, online
//!    max/sum, `P = exp(S − lse)` (exact zeros above the diagonal), `lse`.
//! 3. `O_g = P_g·V_g`, permuted back to `[B, T, Hq, D]`.
//!
//! Backward (P is recomputed from `lse`, never stored between the passes):
//! `S` and `P` again; `dP = dO_g·V_gᵀ`; `dV_g = P_gᵀ·dO_g`; `delta = rowsum(dO ∘ O)`;
//! `dS = P ∘ (dP − delta) · scale`; `dK_g = dS_gᵀ·Q_g`; `dQ_g = dS_g·K_g`. In `dV` and `dK`
//! the sum over the group's query heads is part of the GEMM's reduction (k = G·T): a fixed
//! order, no atomics, so the result is bit-identical from run to run (the cuBLASLt algorithm is
//! cached per shape, see [`super::Gemm`]).
//!
//! Work: the score GEMMs compute the full `T×T` square, so half of their flops (the masked
//! upper triangle) are wasted; the flash kernels skip them.
//!
//! Memory: one [`AttentionWorkspace`], a single untyped device buffer, holds `S` (f32) and
//! `P`/`dS` (element type) for a chunk of the batch, `O(chunk · Hq · T²)` — e.g. 6 bytes · 12 ·
//! 1024² = 75 MB per sequence with 16-bit elements — plus seven per-head copies of Q/K/V-sized
//! tensors. It is sized for a largest shape and a widest element size and carved into typed
//! regions on every call, so one workspace serves f32, bf16 and f16 calls alike (the engine
//! switches precision without reallocating). Batches larger than the chunk that fits run in
//! several passes.
//!
//! ALiBi (the `_alibi` functions, Bloom and Baichuan-13B): f32 slopes `[Hq]` on the device;
//! head `h` adds `slope_h · (j − i)` to its scaled scores. The flash kernels take it in their
//! ALiBi instantiations (built on the masked ones; the plain and masked kernels are unchanged),
//! the cuBLASLt path in its softmax and probability row kernels. Without slopes every call runs
//! exactly the kernels it ran before.
//!
//! Key masks ([`KeyMask`], the `_masked` functions): packed examples (restarting `position_ids`
//! `[B, T]` i32 on the device) and a sliding window. Both implementations honour them: the
//! flash kernels in their masked instantiations (key tiles that no query of a tile sees are
//! skipped), the cuBLASLt path in its row kernels (still computing the full score square). The
//! positions must be a restart sequence (`crate::check_positions` on the host: the engine
//! checks them before upload); the kernels clamp a bad one so that no read leaves the buffers.
//! Without a mask every call runs exactly the unmasked kernels. Measured (H200, bf16 flash,
//! fwd + bwd): rows packed with examples of 256 tokens 0.327 ms at llama-134m and 0.662 ms at
//! TinyLlama (causal: 0.588 / 2.468 ms); a sliding window of 512 keys 0.515 / 1.424 ms.
//!
//! Precision: all products accumulate in f32 (`CUBLAS_COMPUTE_32F`, no TF32); scores, dP, lse
//! and delta are f32. f32 path: everything f32. bf16 / f16 paths: 16-bit Q/K/V/dO, P and dS
//! rounded once to the element type before their GEMMs (as FlashAttention does; P lies in
//! [0, 1], which f16 holds, and the smallest dS values become f16 subnormals, negligible in
//! the sums), outputs rounded once to the element type. The flash kernels round the same
//! quantities once each (P and dS as 16-bit tensor-core operands, f32 accumulation, f32
//! softmax through `ex2.approx`, relative error ~2^-22), so both paths meet the same bounds
//! against an f64 reference.

use std::ffi::c_void;
use std::mem::size_of;
use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, CudaViewMut, DevicePtr, DevicePtrMut};
use tilearn_kernels::ffi;

use super::DeviceFloat;
use super::flash_backward::{FlashBackward, FlashRegions, flash_dq_accum_len};
use super::gemm::{Epilogue, Gemm, MatmulSpec, Operand};
use super::launch::{Launch, check, raw_stream};
use crate::cpu::AttnShape;
use crate::key_mask::KeyMask;
use crate::shape::expect_len;
use crate::{OpsError, Result};

/// Leading dimension of the score rows: `seq` rounded up to 8 elements (32 bytes of f32, 16 of
/// a 16-bit type), so every row starts aligned for cuBLASLt's vectorised kernels.
fn score_ld(seq: usize) -> usize {
    seq.div_ceil(8) * 8
}

/// Byte alignment of every workspace region (cuBLASLt's and the kernels' widest access is 16
/// bytes; 256 is what `cudaMalloc` guarantees and keeps every region on its own cache lines).
const REGION_ALIGN: usize = 256;

/// Element counts one batch entry needs in each workspace region.
#[derive(Clone, Copy, Debug)]
struct PerBatch {
    scores: usize,
    q: usize,
    kv: usize,
    rows: usize,
}

fn per_batch(op: &'static str, s: &AttnShape) -> Result<PerBatch> {
    let overflow = || OpsError::Cuda {
        context: op,
        message: format!("attention shape {s:?} overflows usize"),
    };
    let rows = s.q_heads.checked_mul(s.seq).ok_or_else(overflow)?;
    Ok(PerBatch {
        scores: rows.checked_mul(score_ld(s.seq)).ok_or_else(overflow)?,
        q: rows.checked_mul(s.head_dim).ok_or_else(overflow)?,
        kv: s
            .kv_heads
            .checked_mul(s.seq)
            .and_then(|x| x.checked_mul(s.head_dim))
            .ok_or_else(overflow)?,
        rows,
    })
}

fn check_shape(op: &'static str, s: &AttnShape) -> Result<()> {
    if s.head_dim == 0 || s.kv_heads == 0 || !s.q_heads.is_multiple_of(s.kv_heads) {
        return Err(OpsError::Cuda {
            context: op,
            message: format!(
                "attention needs head_dim > 0 and q_heads ({}) a multiple of kv_heads ({}), got \
                 head_dim {}",
                s.q_heads, s.kv_heads, s.head_dim
            ),
        });
    }
    Ok(())
}

/// Fails unless `bytes` is the size of a [`DeviceFloat`] type (2 or 4).
fn check_elem_bytes(op: &'static str, bytes: usize) -> Result<()> {
    if bytes == 2 || bytes == 4 {
        Ok(())
    } else {
        Err(OpsError::Cuda {
            context: op,
            message: format!(
                "max_elem_bytes must be the size of an element type (2 for bf16/f16, 4 for \
                 f32), got {bytes}"
            ),
        })
    }
}

/// Byte offsets (from the aligned start of the workspace) of the regions for `nb` sequences of
/// one shape with elements of `elem` bytes; every region starts on a [`REGION_ALIGN`] boundary.
#[derive(Clone, Copy, Debug)]
struct Regions {
    /// `S` (and, in the backward, `dP`): f32 `[nb, Hq, T, ld]`.
    scores: usize,
    /// `P` (and `dS`, in place): `[nb, Hq, T, ld]` elements.
    probs: usize,
    /// Per-head `Q` `[nb, Hq, T, D]`; in the backward `dQ` once `dK` has read `Q`.
    q: usize,
    /// Per-head `K` `[nb, Hkv, T, D]`.
    k: usize,
    /// Per-head `V`; in the backward `dV` once `dP` has read `V`.
    v: usize,
    /// Per-head `O` (forward) or `dO` (backward) `[nb, Hq, T, D]`.
    o: usize,
    /// Per-head `dK` `[nb, Hkv, T, D]`.
    dk: usize,
    /// `delta` `[nb, Hq, T]` f32.
    delta: usize,
    /// Bytes up to the end of the last region.
    end: usize,
}

impl Regions {
    /// `None` when the sizes overflow usize.
    fn new(p: &PerBatch, elem: usize, nb: usize) -> Option<Regions> {
        let mut at = 0usize;
        let mut take = |count: usize, size: usize| -> Option<usize> {
            let start = at;
            let bytes = count.checked_mul(nb)?.checked_mul(size)?;
            at = start
                .checked_add(bytes)?
                .checked_next_multiple_of(REGION_ALIGN)?;
            Some(start)
        };
        let f32_bytes = size_of::<f32>();
        Some(Regions {
            scores: take(p.scores, f32_bytes)?,
            probs: take(p.scores, elem)?,
            q: take(p.q, elem)?,
            k: take(p.kv, elem)?,
            v: take(p.kv, elem)?,
            o: take(p.q, elem)?,
            dk: take(p.kv, elem)?,
            delta: take(p.rows, f32_bytes)?,
            end: at,
        })
    }
}

/// Device scratch of the attention passes: one untyped buffer, allocated once for the largest
/// shape and the widest element type it must serve, and reused by every layer, forward and
/// backward, in any precision whose elements are at most `max_elem_bytes` wide. A call carves
/// it into typed regions for its own shape and element size; the shape's `batch` at
/// construction is the number of sequences one pass handles at that element size (a narrower
/// type or a smaller shape may fit more; larger batches run in several passes).
///
/// A flash workspace ([`for_flash`](Self::for_flash)) built for [`FlashBackward::OnePass`]
/// also holds the one-pass backward's f32 `dq_accum` after the `delta` rows; every other
/// workspace runs the deterministic flash backward.
#[derive(Debug)]
pub struct AttentionWorkspace {
    buf: CudaSlice<u8>,
    max_elem_bytes: usize,
    backward: FlashBackward,
    /// A one-pass workspace without its own `dq_accum`: each backward call lends one
    /// ([`for_flash_lent`](Self::for_flash_lent)).
    lent_dq_accum: bool,
}

impl AttentionWorkspace {
    /// Allocates the workspace for shapes up to `max` and element types of at most
    /// `max_elem_bytes` bytes (4 to serve f32 as well as bf16/f16, 2 for bf16/f16 only) on
    /// `stream`'s device; [`bytes_for`](Self::bytes_for) gives its size.
    pub fn new(stream: &Arc<CudaStream>, max: AttnShape, max_elem_bytes: usize) -> Result<Self> {
        const OP: &str = "AttentionWorkspace::new";
        let bytes = Self::bytes_for(max, max_elem_bytes)?;
        // Zero-filled (safe allocation): every element a pass reads is written earlier in it.
        let buf = stream.alloc_zeros::<u8>(bytes).map_err(|e| OpsError::Cuda {
            context: OP,
            message: format!(
                "cannot allocate the attention workspace for {max:?} with {max_elem_bytes}-byte \
                 elements ({bytes} bytes): {e}"
            ),
        })?;
        Ok(AttentionWorkspace {
            buf,
            max_elem_bytes,
            backward: FlashBackward::Deterministic,
            lent_dq_accum: false,
        })
    }

    /// A workspace for the flash path only (bf16 / f16 at shapes [`flash_attention_supports`]
    /// accepts, up to `max`): the backward's f32 `delta` rows, `B·Hq·T` floats instead of the
    /// GEMM path's `Hq·T²` scores per sequence, and with [`FlashBackward::OnePass`] the
    /// one-pass backward's f32 `dq_accum` ([`flash_dq_accum_len`](super::flash_dq_accum_len),
    /// `B·Hq·D·round_up(T, 64)` floats); [`flash_bytes_for`](Self::flash_bytes_for) gives its
    /// size. A call that resolves to the GEMM path (another type or shape, or a misaligned
    /// tensor) is refused by it as too small.
    pub fn for_flash(
        stream: &Arc<CudaStream>,
        max: AttnShape,
        backward: FlashBackward,
    ) -> Result<Self> {
        const OP: &str = "AttentionWorkspace::for_flash";
        let bytes = Self::flash_bytes_for(max, backward)?;
        let buf = stream
            .alloc_zeros::<u8>(bytes)
            .map_err(|e| OpsError::Cuda {
                context: OP,
                message: format!(
                    "cannot allocate the flash attention workspace for {max:?} with the \
                     {backward:?} backward ({bytes} bytes): {e}; FlashBackward::Deterministic \
                     needs no dq_accum"
                ),
            })?;
        Ok(AttentionWorkspace {
            buf,
            max_elem_bytes: 2,
            backward,
            lent_dq_accum: false,
        })
    }

    /// A flash workspace for the one-pass backward that holds only the `delta` rows: each
    /// backward call lends its f32 `dq_accum` ([`attention_backward_lent`]), memory the caller
    /// has idle during the call (the engine: the layer's post-attention buffers, dead once the
    /// MLP's backward ran). A call that lends none, or too little for its shape, runs the
    /// deterministic backward, as a [`FlashBackward::Deterministic`] workspace does.
    pub fn for_flash_lent(stream: &Arc<CudaStream>, max: AttnShape) -> Result<Self> {
        let mut ws = Self::for_flash(stream, max, FlashBackward::Deterministic)?;
        ws.backward = FlashBackward::OnePass;
        ws.lent_dq_accum = true;
        Ok(ws)
    }

    /// Whether backward calls lend the one-pass `dq_accum` ([`for_flash_lent`](Self::for_flash_lent)).
    pub fn lends_dq_accum(&self) -> bool {
        self.lent_dq_accum
    }

    /// Device bytes [`for_flash`](Self::for_flash) allocates for `max` and `backward`: the
    /// `delta` rows, for `OnePass` the `dq_accum` on the next 256-byte boundary, and 256 bytes
    /// of slack to align the first region whatever the allocation's alignment.
    pub fn flash_bytes_for(max: AttnShape, backward: FlashBackward) -> Result<usize> {
        const OP: &str = "AttentionWorkspace::flash_bytes_for";
        check_shape(OP, &max)?;
        FlashRegions::new(max, backward, REGION_ALIGN)
            .and_then(|r| r.end.checked_add(REGION_ALIGN))
            .ok_or_else(|| OpsError::Cuda {
                context: OP,
                message: format!(
                    "flash attention workspace for {max:?} with the {backward:?} backward \
                     overflows usize"
                ),
            })
    }

    /// The flash backward this workspace was built for (`Deterministic` unless
    /// [`for_flash`](Self::for_flash) was asked for `OnePass`).
    pub fn flash_backward(&self) -> FlashBackward {
        self.backward
    }

    /// Where the flash backward of a call of shape `s` finds its one-pass `dq_accum`: a byte
    /// offset from the workspace's first aligned byte and an f32 length, or `None` when the
    /// call runs the deterministic backward (a workspace built for it, or one too small for
    /// `s`: a call larger than the workspace's `max`).
    fn dq_accum_region(&self, s: AttnShape) -> Option<(usize, usize)> {
        if self.backward != FlashBackward::OnePass || self.lent_dq_accum {
            return None;
        }
        FlashRegions::new(s, FlashBackward::OnePass, REGION_ALIGN)
            .filter(|r| r.end <= self.usable())
            .and_then(|r| r.dq_accum)
    }

    /// The backward a flash call in `T` of shape `s`, with a key mask or ALiBi slopes
    /// (`masked`) or without, runs with this workspace on the current device: `OnePass` where
    /// the one-pass Hopper kernel serves it ([`flash_attention_one_pass`]) and the workspace holds its
    /// `dq_accum`, else `Deterministic`.
    /// (A lending workspace answers for a call that lends enough.)
    pub fn flash_backward_for<T: DeviceFloat>(&self, s: AttnShape, masked: bool) -> FlashBackward {
        let lent = self.lent_dq_accum && self.backward == FlashBackward::OnePass;
        let one_pass = (self.dq_accum_region(s).is_some() || lent)
            && flash_attention_supports::<T>(s)
            && flash_attention_one_pass::<T>(s.head_dim, masked);
        FlashBackward::from_deterministic(!one_pass)
    }

    /// Device bytes [`new`](Self::new) allocates for `max` and `max_elem_bytes`: the regions
    /// for `max.batch` sequences (at least one), each rounded up to 256 bytes, plus 256 bytes
    /// of slack to align the first region whatever the allocation's alignment.
    pub fn bytes_for(max: AttnShape, max_elem_bytes: usize) -> Result<usize> {
        const OP: &str = "AttentionWorkspace::bytes_for";
        check_shape(OP, &max)?;
        check_elem_bytes(OP, max_elem_bytes)?;
        let p = per_batch(OP, &max)?;
        Regions::new(&p, max_elem_bytes, max.batch.max(1))
            .and_then(|r| r.end.checked_add(REGION_ALIGN))
            .ok_or_else(|| OpsError::Cuda {
                context: OP,
                message: format!("attention workspace for {max:?} overflows usize"),
            })
    }

    /// Device bytes this workspace holds.
    pub fn bytes(&self) -> usize {
        self.buf.len()
    }

    /// The widest element (bytes) this workspace serves: calls with wider types are refused.
    pub fn max_elem_bytes(&self) -> usize {
        self.max_elem_bytes
    }

    /// Bytes usable for regions whatever the allocation's alignment (see `bytes_for`).
    fn usable(&self) -> usize {
        self.buf.len().saturating_sub(REGION_ALIGN)
    }

    /// Fails unless `T` is at most [`max_elem_bytes`](Self::max_elem_bytes) wide.
    fn check_elem<T: DeviceFloat>(&self, op: &'static str) -> Result<()> {
        if size_of::<T>() <= self.max_elem_bytes {
            return Ok(());
        }
        Err(OpsError::Cuda {
            context: op,
            message: format!(
                "this attention workspace was built for elements of at most {} bytes, but {} \
                 elements have {}: build it with AttentionWorkspace::new(.., max_elem_bytes >= \
                 {})",
                self.max_elem_bytes,
                T::NAME,
                size_of::<T>(),
                size_of::<T>()
            ),
        })
    }

    /// How many sequences of shape `s` in element type `T` one pass handles (at most
    /// `s.batch`, at least 1); an error when `T` is wider than the workspace serves or not
    /// even one sequence fits.
    pub fn batch_chunk<T: DeviceFloat>(&self, s: AttnShape) -> Result<usize> {
        const OP: &str = "AttentionWorkspace::batch_chunk";
        self.check_elem::<T>(OP)?;
        check_shape(OP, &s)?;
        let p = per_batch(OP, &s)?;
        let usable = self.usable();
        let fits =
            |nb: usize| Regions::new(&p, size_of::<T>(), nb).is_some_and(|r| r.end <= usable);
        if !fits(1) {
            return Err(OpsError::Cuda {
                context: OP,
                message: format!(
                    "the attention workspace ({} bytes) is too small for one sequence of {s:?} \
                     in {}: build it with AttentionWorkspace::new for at least this seq, heads \
                     and head_dim",
                    self.bytes(),
                    T::NAME
                ),
            });
        }
        // The largest nb in [1, batch] that fits (the region sizes grow with nb).
        let (mut lo, mut hi) = (1usize, s.batch.max(1));
        while lo < hi {
            let mid = lo + (hi - lo).div_ceil(2);
            if fits(mid) {
                lo = mid;
            } else {
                hi = mid - 1;
            }
        }
        Ok(lo)
    }
}

/// Raw device addresses of the workspace regions, valid while the workspace's guard lives.
struct WsPtrs {
    scores: u64,
    probs: u64,
    q: u64,
    k: u64,
    v: u64,
    o: u64,
    dk: u64,
    delta: u64,
}

/// How many sequences of shape `s` (per-batch sizes `p`) one pass takes in type `T`
/// ([`AttentionWorkspace::batch_chunk`]) and the workspace's regions for them, each inside the
/// usable bytes.
fn ws_layout<T: DeviceFloat>(
    op: &'static str,
    ws: &AttentionWorkspace,
    s: AttnShape,
    p: &PerBatch,
) -> Result<(usize, Regions)> {
    let chunk = ws.batch_chunk::<T>(s)?;
    let usable = ws.usable();
    let regions = Regions::new(p, size_of::<T>(), chunk)
        .filter(|r| r.end <= usable)
        .ok_or_else(|| OpsError::Cuda {
            context: op,
            message: format!("{chunk} sequences do not fit the attention workspace"),
        })?;
    Ok((chunk, regions))
}

impl WsPtrs {
    /// The regions' addresses in the workspace allocation at `base`: from its first aligned
    /// address (`bytes_for` reserved REGION_ALIGN bytes for this skew, so every region lies
    /// inside the buffer and starts aligned for any element type).
    fn at(base: u64, regions: &Regions) -> WsPtrs {
        let start = base.next_multiple_of(REGION_ALIGN as u64);
        let at = |offset: usize| start + offset as u64;
        WsPtrs {
            scores: at(regions.scores),
            probs: at(regions.probs),
            q: at(regions.q),
            k: at(regions.k),
            v: at(regions.v),
            o: at(regions.o),
            dk: at(regions.dk),
            delta: at(regions.delta),
        }
    }
}

/// The per-call constants of one attention launch.
#[derive(Clone, Copy)]
struct Plan {
    s: AttnShape,
    group: usize,
    ld: usize,
    scale: f32,
    elem: usize,
}

impl Plan {
    fn new<T>(s: AttnShape) -> Plan {
        Plan {
            s,
            group: s.q_heads / s.kv_heads,
            ld: score_ld(s.seq),
            scale: (1.0 / (s.head_dim as f64).sqrt()) as f32,
            elem: size_of::<T>(),
        }
    }

    /// `[nb, x, y, D]` → `[nb, y, x, D]` of `T` elements.
    ///
    /// # Safety
    /// `src` and `dst` are distinct live device buffers of the stream's context holding
    /// `nb·x·y·D` elements of size `self.elem`.
    #[allow(clippy::too_many_arguments)]
    unsafe fn swap(
        &self,
        op: &'static str,
        stream: &CudaStream,
        src: u64,
        dst: u64,
        nb: usize,
        x: usize,
        y: usize,
    ) -> Result<()> {
        // SAFETY: per this function's contract.
        let status = unsafe {
            ffi::tilearn_attention_swap_axes(
                src as *const _,
                dst as *mut _,
                nb,
                x,
                y,
                self.s.head_dim * self.elem,
                raw_stream(stream),
            )
        };
        check(op, status)
    }

    /// `S = alpha · X_g·Y_gᵀ` per (batch, kv head): X is q-shaped per head `[nb, Hq, T, D]`
    /// (`x`), Y kv-shaped `[nb, Hkv, T, D]` (`y`), S f32 `[nb, Hq, T, ld]`.
    ///
    /// # Safety
    /// The pointers are live device buffers of the gemm's context of those sizes; `scores`
    /// overlaps neither input.
    #[allow(clippy::too_many_arguments)]
    unsafe fn scores_gemm<T: DeviceFloat>(
        &self,
        op: &'static str,
        gemm: &Gemm,
        nb: usize,
        x: u64,
        y: u64,
        scores: u64,
        alpha: f32,
    ) -> Result<()> {
        let (t, d, g) = (self.s.seq, self.s.head_dim, self.group);
        let mut spec = MatmulSpec::new(
            g * t,
            t,
            d,
            Operand::plain(d).strided(g * t * d),
            Operand::transposed(d).strided(t * d),
        );
        spec.batch = nb * self.s.kv_heads;
        spec.c_ld = self.ld;
        spec.c_batch_stride = g * t * self.ld;
        spec.alpha = alpha;
        spec.required_lens(op)?;
        // SAFETY: per this function's contract (sizes match the spec's extents).
        unsafe { gemm.launch::<T, f32>(op, &spec, x, y, scores, Epilogue::None) }
    }
}

/// Which implementation an attention call runs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum AttentionImpl {
    /// The fused flash kernels where they apply (a 16-bit type, a shape that
    /// [`flash_attention_supports`] accepts, every tensor on a 16-byte boundary), else the
    /// cuBLASLt path.
    #[default]
    Auto,
    /// The cuBLASLt path (every type and shape; the reference for the flash kernels).
    Gemm,
    /// The fused flash kernels; an error where they do not apply.
    Flash,
}

impl AttentionImpl {
    /// The implementation a call with `self` runs for element type `T` at shape `s` when every
    /// tensor is 16-byte aligned: `Auto` becomes `Flash` or `Gemm`; `Gemm` and `Flash` stay
    /// (a forced `Flash` that does not apply is an error at the call).
    pub fn resolve<T: DeviceFloat>(self, s: AttnShape) -> AttentionImpl {
        match self {
            AttentionImpl::Auto if AUTO_USES_FLASH && flash_attention_supports::<T>(s) => {
                AttentionImpl::Flash
            }
            AttentionImpl::Auto => AttentionImpl::Gemm,
            forced => forced,
        }
    }
}

/// Whether [`AttentionImpl::Auto`] prefers the flash kernels where they apply. Measured on an
/// H200 (gemm-bench attention): see the module documentation.
const AUTO_USES_FLASH: bool = true;

/// Largest batch, sequence and `batch · q_heads` the flash kernels take (their indices are
/// 32-bit), and the most CTAs of one launch (CUDA's grid limit); their smallest tile is 64 rows.
const FLASH_MAX_DIM: usize = (1 << 30) - 1;
const FLASH_MAX_GRID: usize = i32::MAX as usize;
const FLASH_MIN_TILE: usize = 64;

/// Whether the fused flash kernels serve element type `T` at shape `s`: bf16 or f16,
/// `head_dim` 64 or 128, `q_heads` a multiple of `kv_heads`, and sizes within the kernels'
/// 32-bit indexing. (A call also needs every tensor to start on a 16-byte boundary.)
pub fn flash_attention_supports<T: DeviceFloat>(s: AttnShape) -> bool {
    // SAFETY: a pure host function of its two integer arguments.
    let kernels = unsafe { ffi::tilearn_flash_attention_supported(T::DTYPE, s.head_dim) } != 0;
    let heads_ok = s.kv_heads > 0 && s.q_heads.is_multiple_of(s.kv_heads);
    let rows = s.batch.checked_mul(s.q_heads);
    let grid = rows.and_then(|r| r.checked_mul(s.seq.div_ceil(FLASH_MIN_TILE)));
    kernels
        && heads_ok
        && s.batch <= FLASH_MAX_DIM
        && s.seq <= FLASH_MAX_DIM
        && s.q_heads <= FLASH_MAX_DIM
        && rows.is_some_and(|r| r <= FLASH_MAX_DIM)
        && grid.is_some_and(|g| g <= FLASH_MAX_GRID)
}

/// Whether a flash call of `T` at `head_dim`, with a key mask or ALiBi slopes (`masked`) or
/// without, runs the Hopper kernels (wgmma, `flash_attention_sm90.cu`) on the current device
/// rather than the mma.sync ones, forward and backward: compute capability 9.0, bf16 or f16,
/// head_dim 64 or 128 (128 unless `TILEARN_FLASH_SM90_HD128=0`), unmasked, and
/// `TILEARN_FLASH_SM80` unset. Their deterministic backward computes the mma.sync backward's
/// products in the same order (their one-pass backward, with a [`FlashBackward::OnePass`]
/// workspace, agrees to the rounding); their forward walks keys in other blocks, so it agrees
/// to the rounding.
pub fn flash_attention_uses_wgmma<T: DeviceFloat>(head_dim: usize, masked: bool) -> bool {
    // SAFETY: a host function of integers; it reads the current device's compute capability.
    unsafe { ffi::tilearn_flash_attention_uses_wgmma(T::DTYPE, head_dim, i32::from(masked)) != 0 }
}

/// Whether such a call, besides, has the one-pass backward (the Hopper kernels at head_dim 64):
/// what decides whether a [`FlashBackward::OnePass`] workspace's `dq_accum` is used.
pub fn flash_attention_one_pass<T: DeviceFloat>(head_dim: usize, masked: bool) -> bool {
    // SAFETY: as above.
    unsafe { ffi::tilearn_flash_attention_one_pass(T::DTYPE, head_dim, i32::from(masked)) != 0 }
}

/// Whether a call with `imp` should try the flash kernels (alignment is checked once the
/// pointers are known); an error when `imp` forces them and they do not serve `T` at `s`.
fn wants_flash<T: DeviceFloat>(
    op: &'static str,
    imp: AttentionImpl,
    s: &AttnShape,
) -> Result<bool> {
    match imp.resolve::<T>(*s) {
        AttentionImpl::Gemm => Ok(false),
        _ if flash_attention_supports::<T>(*s) => Ok(true),
        _ => Err(OpsError::Cuda {
            context: op,
            message: format!(
                "AttentionImpl::Flash does not serve {} at {s:?}: it needs bf16 or f16, \
                 head_dim 64 or 128 and q_heads a multiple of kv_heads",
                T::NAME
            ),
        }),
    }
}

/// Whether every tensor address in `ptrs` is 16-byte aligned (the flash kernels' cp.async
/// width); when not, `Auto` falls back to the cuBLASLt path and `Flash` is an error.
fn flash_aligned(op: &'static str, imp: AttentionImpl, ptrs: &[u64]) -> Result<bool> {
    if ptrs.iter().all(|p| p.is_multiple_of(16)) {
        return Ok(true);
    }
    if imp == AttentionImpl::Flash {
        return Err(OpsError::Cuda {
            context: op,
            message: "AttentionImpl::Flash needs every tensor to start on a 16-byte boundary \
                      (a view at an odd element offset does not)"
                .to_string(),
        });
    }
    Ok(false)
}

/// The checks both passes start with: `ws` serves `T`, the shape is valid, and its sizes fit
/// `usize`. Returns the per-sequence sizes and the element counts of the whole batch's q-like
/// (q, out, dout, dq), kv-like (k, v, dk, dv) and row (lse, delta) tensors.
fn checked_sizes<T: DeviceFloat>(
    op: &'static str,
    ws: &AttentionWorkspace,
    s: &AttnShape,
) -> Result<(PerBatch, [usize; 3])> {
    ws.check_elem::<T>(op)?;
    check_shape(op, s)?;
    let p = per_batch(op, s)?;
    let lens = [p.q, p.kv, p.rows].map(|n| n.checked_mul(s.batch));
    let [Some(q_len), Some(kv_len), Some(rows_len)] = lens else {
        return Err(OpsError::Cuda {
            context: op,
            message: format!("attention shape {s:?} overflows usize"),
        });
    };
    Ok((p, [q_len, kv_len, rows_len]))
}

/// The launchers' form of `mask` with its positions at `positions` and ALiBi slopes at
/// `slopes` (null when absent), or `None` for plain causal attention (a null mask pointer).
fn ffi_mask<P>(
    mask: &KeyMask<&P>,
    positions: *const c_void,
    slopes: *const c_void,
) -> Option<ffi::tilearn_key_mask> {
    (!mask.is_causal() || !slopes.is_null()).then(|| ffi::tilearn_key_mask {
        positions: positions.cast(),
        sliding_window: mask.sliding_window.unwrap_or(0),
        alibi_slopes: slopes.cast(),
    })
}

/// A pointer to `m`, or null.
fn mask_ptr(m: &Option<ffi::tilearn_key_mask>) -> *const ffi::tilearn_key_mask {
    m.as_ref().map_or(std::ptr::null(), |m| m as *const _)
}

/// `m` for the batch rows from `b0` on (positions advanced by `b0 · seq`).
fn mask_from(
    m: &Option<ffi::tilearn_key_mask>,
    b0: usize,
    seq: usize,
) -> Option<ffi::tilearn_key_mask> {
    m.map(|m| ffi::tilearn_key_mask {
        positions: if m.positions.is_null() {
            m.positions
        } else {
            m.positions.wrapping_add(b0 * seq)
        },
        ..m
    })
}

/// Fails on a window of 0 keys or a window the kernels' 32-bit indexing cannot hold.
fn check_mask<P>(op: &'static str, mask: &KeyMask<&P>) -> Result<()> {
    mask.check_window(op)?;
    if mask.sliding_window.is_some_and(|w| w > FLASH_MAX_DIM) {
        return Err(OpsError::Cuda {
            context: op,
            message: format!(
                "sliding_window {:?} exceeds {FLASH_MAX_DIM} keys; leave it unset for an \
                 unbounded window",
                mask.sliding_window
            ),
        });
    }
    Ok(())
}

/// Whether the problem is empty (nothing to launch).
fn is_empty(s: &AttnShape) -> bool {
    s.batch == 0 || s.seq == 0 || s.q_heads == 0
}

/// Rows of the `[rows, ld]` score buffers for `nb` sequences: one per (sequence, query head,
/// query position).
fn row_count(plan: &Plan, nb: usize) -> usize {
    nb * plan.s.q_heads * plan.s.seq
}

/// Causal GQA forward in element type `T` (f32, bf16 or f16): writes `out` `[B, T, Hq, D]`
/// (`=`, type `T`) and `lse` `[B, Hq, T]` (`=`, f32). `ws` must serve `T`
/// ([`AttentionWorkspace::max_elem_bytes`] >= its size) and hold at least one sequence of `s`.
/// Runs the fused flash kernels where they apply, else the cuBLASLt path
/// ([`AttentionImpl::Auto`]; see [`attention_forward_with`]). Precision: see the module
/// documentation (f32: no TF32, ~1e-5 of an f32 reference; 16-bit: f32 scores, softmax and
/// accumulation, P and `out` rounded once to `T`).
#[allow(clippy::too_many_arguments)]
pub fn attention_forward<T: DeviceFloat>(
    gemm: &Gemm,
    ws: &mut AttentionWorkspace,
    s: AttnShape,
    q: &impl DevicePtr<T>,
    k: &impl DevicePtr<T>,
    v: &impl DevicePtr<T>,
    out: &mut impl DevicePtrMut<T>,
    lse: &mut impl DevicePtrMut<f32>,
) -> Result<()> {
    attention_forward_with(AttentionImpl::Auto, gemm, ws, s, q, k, v, out, lse)
}

/// [`attention_forward`] through the implementation `imp`: [`AttentionImpl::Gemm`] forces the
/// cuBLASLt path, [`AttentionImpl::Flash`] the fused kernels (an error where they do not apply:
/// see [`flash_attention_supports`]; tensors must start on 16-byte boundaries). Same contract
/// and checks whatever the implementation (the workspace must serve `T` and one sequence even
/// when the flash path leaves it unused).
#[allow(clippy::too_many_arguments)]
pub fn attention_forward_with<T: DeviceFloat>(
    imp: AttentionImpl,
    gemm: &Gemm,
    ws: &mut AttentionWorkspace,
    s: AttnShape,
    q: &impl DevicePtr<T>,
    k: &impl DevicePtr<T>,
    v: &impl DevicePtr<T>,
    out: &mut impl DevicePtrMut<T>,
    lse: &mut impl DevicePtrMut<f32>,
) -> Result<()> {
    attention_forward_masked(
        imp,
        gemm,
        ws,
        s,
        KeyMask::<&CudaSlice<i32>>::causal(),
        q,
        k,
        v,
        out,
        lse,
    )
}

/// [`attention_forward_with`] under `mask` (see [`KeyMask`]): query `i` of row `b` attends to
/// the keys `key_start(i) ..= i` only. `mask.positions`, when set, holds `B·T` i32.
#[allow(clippy::too_many_arguments)]
pub fn attention_forward_masked<T: DeviceFloat, P: DevicePtr<i32>>(
    imp: AttentionImpl,
    gemm: &Gemm,
    ws: &mut AttentionWorkspace,
    s: AttnShape,
    mask: KeyMask<&P>,
    q: &impl DevicePtr<T>,
    k: &impl DevicePtr<T>,
    v: &impl DevicePtr<T>,
    out: &mut impl DevicePtrMut<T>,
    lse: &mut impl DevicePtrMut<f32>,
) -> Result<()> {
    attention_forward_alibi(
        imp,
        gemm,
        ws,
        s,
        mask,
        None::<&CudaSlice<f32>>,
        q,
        k,
        v,
        out,
        lse,
    )
}

/// [`attention_forward_masked`] with ALiBi: `alibi`, when set, holds `Hq` f32 slopes
/// ([`crate::alibi_slopes`]) and head `h` adds `alibi[h] · (j − i)` to its scaled scores (both
/// implementations: the flash kernels' ALiBi instantiations, the cuBLASLt path's row kernels);
/// `lse` is that of the biased scores. `None` is exactly [`attention_forward_masked`].
#[allow(clippy::too_many_arguments)]
pub fn attention_forward_alibi<T: DeviceFloat, P: DevicePtr<i32>, A: DevicePtr<f32>>(
    imp: AttentionImpl,
    gemm: &Gemm,
    ws: &mut AttentionWorkspace,
    s: AttnShape,
    mask: KeyMask<&P>,
    alibi: Option<&A>,
    q: &impl DevicePtr<T>,
    k: &impl DevicePtr<T>,
    v: &impl DevicePtr<T>,
    out: &mut impl DevicePtrMut<T>,
    lse: &mut impl DevicePtrMut<f32>,
) -> Result<()> {
    let op = "attention_forward";
    check_mask(op, &mask)?;
    let (p, [q_len, kv_len, rows_len]) = checked_sizes::<T>(op, ws, &s)?;
    let flash = wants_flash::<T>(op, imp, &s)?;
    // Only the GEMM path carves the workspace, so only it reports a workspace too small.
    let layout = ws_layout::<T>(op, ws, s, &p);
    let plan = Plan::new::<T>(s);
    let (t, d, g, hq, hkv) = (s.seq, s.head_dim, plan.group, s.q_heads, s.kv_heads);
    let e = plan.elem as u64;
    let stream = gemm.stream().clone();
    Launch::new(op, &stream)
        .input("q", q, q_len)
        .input("k", k, kv_len)
        .input("v", v, kv_len)
        .optional_input("positions", mask.positions, s.batch * s.seq)
        .optional_input("alibi_slopes", alibi, s.q_heads)
        .output("out", out, q_len)
        .output("lse", lse, rows_len)
        .workspace("workspace", &mut ws.buf)
        .skip_launch_if(is_empty(&s))
        .run_steps(|[q, k, v, positions, slopes], [out, lse, ws_base], raw| {
            let [q0, k0, v0] = [q, k, v].map(|ptr| ptr as u64);
            let [o0, l0] = [out, lse].map(|ptr| ptr as u64);
            let km = ffi_mask(&mask, positions, slopes);
            if flash && flash_aligned(op, imp, &[q0, k0, v0, o0])? {
                // SAFETY: the launcher reads q (`q_len` elements of T, `T::DTYPE`), k and v
                // (`kv_len`), the mask's B·T positions and Hq slopes when present, and writes out (`q_len`)
                // and lse (`rows_len` f32) for shape `s`; `km` outlives the call.
                let status = unsafe {
                    ffi::tilearn_flash_attention_forward(
                        T::DTYPE,
                        q,
                        k,
                        v,
                        out,
                        lse.cast(),
                        s.batch,
                        s.seq,
                        s.q_heads,
                        s.kv_heads,
                        s.head_dim,
                        plan.scale,
                        mask_ptr(&km),
                        raw,
                    )
                };
                return check(op, status);
            }
            // The GEMM path: the workspace must hold at least one sequence of this shape.
            let (chunk, regions) = layout?;
            let w = WsPtrs::at(ws_base as u64, &regions);

            let mut b0 = 0;
            while b0 < s.batch {
                let nb = chunk.min(s.batch - b0);
                let q_off = (b0 * p.q) as u64 * e;
                let kv_off = (b0 * p.kv) as u64 * e;
                let rows = row_count(&plan, nb);
                let km_chunk = mask_from(&km, b0, t);
                // SAFETY (whole block): the user buffers hold `batch` sequences (the builder
                // checked their lengths), so the offsets of sequences [b0, b0 + nb) stay inside
                // them; the workspace holds `chunk >= nb` sequences of this shape in type T
                // (`batch_chunk`, `ws_layout`: disjoint regions, each aligned for any element
                // type); inputs and outputs of each step are distinct buffers (user inputs are
                // shared borrows, outputs mutable ones, and the workspace regions overlap neither
                // each other nor the user buffers); every pointer handed to a GEMM or a launcher
                // holds elements of the type its call states (T, or f32 for S, dP, lse and
                // delta).
                unsafe {
                    plan.swap(op, &stream, q0 + q_off, w.q, nb, t, hq)?;
                    plan.swap(op, &stream, k0 + kv_off, w.k, nb, t, hkv)?;
                    plan.swap(op, &stream, v0 + kv_off, w.v, nb, t, hkv)?;
                    plan.scores_gemm::<T>(op, gemm, nb, w.q, w.k, w.scores, plan.scale)?;
                    let status = ffi::tilearn_attention_softmax(
                        T::DTYPE,
                        w.scores as *const f32,
                        plan.ld,
                        rows,
                        t,
                        w.probs as *mut c_void,
                        (l0 + (b0 * p.rows * 4) as u64) as *mut f32,
                        mask_ptr(&km_chunk),
                        hq,
                        raw,
                    );
                    check(op, status)?;
                    // O_g [G·T, D] = P_g [G·T, T] · V_g [T, D].
                    let mut spec = MatmulSpec::new(
                        g * t,
                        d,
                        t,
                        Operand::plain(plan.ld).strided(g * t * plan.ld),
                        Operand::plain(d).strided(t * d),
                    );
                    spec.batch = nb * hkv;
                    spec.c_ld = d;
                    spec.c_batch_stride = g * t * d;
                    spec.required_lens(op)?;
                    gemm.launch::<T, T>(op, &spec, w.probs, w.v, w.o, Epilogue::None)?;
                    plan.swap(op, &stream, w.o, o0 + q_off, nb, hq, t)?;
                }
                b0 += nb;
            }
            Ok(())
        })
}

/// Causal GQA backward in element type `T`: writes (`=`) `dq`, `dk`, `dv` (type `T`) from
/// `dout`, the inputs and the forward's `out` and `lse`. Deterministic (bit-identical from run
/// to run) except for `dq` where a [`FlashBackward::OnePass`] workspace lets the Hopper kernels
/// sum it with f32 atomic adds (see [`AttentionWorkspace::flash_backward_for`]). Same workspace
/// contract as [`attention_forward`]; the fused flash kernels where
/// they apply, else the cuBLASLt path ([`AttentionImpl::Auto`]). Precision: f32 dP, delta and
/// accumulation; P and dS rounded once to `T` before their products, outputs rounded once to
/// `T`.
#[allow(clippy::too_many_arguments)]
pub fn attention_backward<T: DeviceFloat>(
    gemm: &Gemm,
    ws: &mut AttentionWorkspace,
    s: AttnShape,
    dout: &impl DevicePtr<T>,
    q: &impl DevicePtr<T>,
    k: &impl DevicePtr<T>,
    v: &impl DevicePtr<T>,
    out: &impl DevicePtr<T>,
    lse: &impl DevicePtr<f32>,
    dq: &mut impl DevicePtrMut<T>,
    dk: &mut impl DevicePtrMut<T>,
    dv: &mut impl DevicePtrMut<T>,
) -> Result<()> {
    attention_backward_with(
        AttentionImpl::Auto,
        gemm,
        ws,
        s,
        dout,
        q,
        k,
        v,
        out,
        lse,
        dq,
        dk,
        dv,
    )
}

/// [`attention_backward`] through the implementation `imp` (see [`attention_forward_with`]).
/// Either implementation accepts the other's forward outputs (same `lse` convention). The flash
/// path keeps `delta` (f32 `[B, Hq, T]`) at the start of the workspace, or in a temporary
/// device buffer when the workspace is smaller than that.
#[allow(clippy::too_many_arguments)]
pub fn attention_backward_with<T: DeviceFloat>(
    imp: AttentionImpl,
    gemm: &Gemm,
    ws: &mut AttentionWorkspace,
    s: AttnShape,
    dout: &impl DevicePtr<T>,
    q: &impl DevicePtr<T>,
    k: &impl DevicePtr<T>,
    v: &impl DevicePtr<T>,
    out: &impl DevicePtr<T>,
    lse: &impl DevicePtr<f32>,
    dq: &mut impl DevicePtrMut<T>,
    dk: &mut impl DevicePtrMut<T>,
    dv: &mut impl DevicePtrMut<T>,
) -> Result<()> {
    attention_backward_masked(
        imp,
        gemm,
        ws,
        s,
        KeyMask::<&CudaSlice<i32>>::causal(),
        dout,
        q,
        k,
        v,
        out,
        lse,
        dq,
        dk,
        dv,
    )
}

/// Backward of [`attention_forward_masked`] under the same `mask`.
#[allow(clippy::too_many_arguments)]
pub fn attention_backward_masked<T: DeviceFloat, P: DevicePtr<i32>>(
    imp: AttentionImpl,
    gemm: &Gemm,
    ws: &mut AttentionWorkspace,
    s: AttnShape,
    mask: KeyMask<&P>,
    dout: &impl DevicePtr<T>,
    q: &impl DevicePtr<T>,
    k: &impl DevicePtr<T>,
    v: &impl DevicePtr<T>,
    out: &impl DevicePtr<T>,
    lse: &impl DevicePtr<f32>,
    dq: &mut impl DevicePtrMut<T>,
    dk: &mut impl DevicePtrMut<T>,
    dv: &mut impl DevicePtrMut<T>,
) -> Result<()> {
    attention_backward_alibi(
        imp,
        gemm,
        ws,
        s,
        mask,
        None::<&CudaSlice<f32>>,
        dout,
        q,
        k,
        v,
        out,
        lse,
        dq,
        dk,
        dv,
    )
}

/// Backward of [`attention_forward_alibi`] under the same `mask` and slopes (its `lse`).
#[allow(clippy::too_many_arguments)]
pub fn attention_backward_alibi<T: DeviceFloat, P: DevicePtr<i32>, A: DevicePtr<f32>>(
    imp: AttentionImpl,
    gemm: &Gemm,
    ws: &mut AttentionWorkspace,
    s: AttnShape,
    mask: KeyMask<&P>,
    alibi: Option<&A>,
    dout: &impl DevicePtr<T>,
    q: &impl DevicePtr<T>,
    k: &impl DevicePtr<T>,
    v: &impl DevicePtr<T>,
    out: &impl DevicePtr<T>,
    lse: &impl DevicePtr<f32>,
    dq: &mut impl DevicePtrMut<T>,
    dk: &mut impl DevicePtrMut<T>,
    dv: &mut impl DevicePtrMut<T>,
) -> Result<()> {
    attention_backward_lent(
        imp, gemm, ws, s, mask, alibi, dout, q, k, v, out, lse, dq, dk, dv, None,
    )
}

/// [`attention_backward_alibi`] with the one-pass backward's f32 `dq_accum` lent by the
/// caller: a workspace built by [`AttentionWorkspace::for_flash_lent`] runs the one-pass
/// backward in `dq_accum` when it holds at least
/// [`flash_dq_accum_len`](super::flash_dq_accum_len)`(s)` floats (its contents on entry do not
/// matter; they are scratch, clobbered), and the deterministic one otherwise. Other
/// workspaces ignore it.
#[allow(clippy::too_many_arguments)]
pub fn attention_backward_lent<T: DeviceFloat, P: DevicePtr<i32>, A: DevicePtr<f32>>(
    imp: AttentionImpl,
    gemm: &Gemm,
    ws: &mut AttentionWorkspace,
    s: AttnShape,
    mask: KeyMask<&P>,
    alibi: Option<&A>,
    dout: &impl DevicePtr<T>,
    q: &impl DevicePtr<T>,
    k: &impl DevicePtr<T>,
    v: &impl DevicePtr<T>,
    out: &impl DevicePtr<T>,
    lse: &impl DevicePtr<f32>,
    dq: &mut impl DevicePtrMut<T>,
    dk: &mut impl DevicePtrMut<T>,
    dv: &mut impl DevicePtrMut<T>,
    dq_accum: Option<&mut CudaViewMut<'_, f32>>,
) -> Result<()> {
    let op = "attention_backward";
    check_mask(op, &mask)?;
    let (p, [q_len, kv_len, rows_len]) = checked_sizes::<T>(op, ws, &s)?;
    for (what, want, have) in [
        ("dout", q_len, dout.len()),
        ("q", q_len, q.len()),
        ("out", q_len, out.len()),
        ("dq", q_len, dq.len()),
        ("k", kv_len, k.len()),
        ("v", kv_len, v.len()),
        ("dk", kv_len, dk.len()),
        ("dv", kv_len, dv.len()),
        ("lse", rows_len, lse.len()),
    ] {
        expect_len(op, want, have).map_err(|e| match e {
            OpsError::ShapeMismatch {
                expected, actual, ..
            } => OpsError::Cuda {
                context: op,
                message: format!("`{what}` holds {actual} elements, expected {expected}"),
            },
            other => other,
        })?;
    }
    let flash = wants_flash::<T>(op, imp, &s)?;
    // Only the GEMM path carves the workspace, so only it reports a workspace too small.
    let layout = ws_layout::<T>(op, ws, s, &p);
    let usable = ws.usable();
    // The one-pass backward's scratch, when the workspace was built for it and holds it for
    // this shape (after the delta rows, which then lie in the workspace too).
    let dq_accum_region = ws.dq_accum_region(s);
    // A lent dq_accum: used when the workspace lends and it holds enough for this shape. Its
    // guard (cudarc's write tracking) lives until after the enqueues.
    let lends = ws.lent_dq_accum && ws.backward == FlashBackward::OnePass;
    let needed = flash_dq_accum_len(s);
    let plan = Plan::new::<T>(s);
    let (t, d, g, hq, hkv) = (s.seq, s.head_dim, plan.group, s.q_heads, s.kv_heads);
    let e = plan.elem as u64;
    let stream = gemm.stream().clone();
    let lent_guard = match (lends, dq_accum, needed) {
        (true, Some(buf), Some(len)) if buf.len() >= len => Some(buf.device_ptr_mut(&stream)),
        _ => None,
    };
    let lent_ptr = lent_guard.as_ref().map(|(ptr, _)| *ptr);
    Launch::new(op, &stream)
        .input("dout", dout, q_len)
        .input("q", q, q_len)
        .input("k", k, kv_len)
        .input("v", v, kv_len)
        .input("out", out, q_len)
        .input("lse", lse, rows_len)
        .optional_input("positions", mask.positions, s.batch * s.seq)
        .optional_input("alibi_slopes", alibi, s.q_heads)
        .output("dq", dq, q_len)
        .output("dk", dk, kv_len)
        .output("dv", dv, kv_len)
        .workspace("workspace", &mut ws.buf)
        .skip_launch_if(is_empty(&s))
        .run_steps(|inputs, outputs, raw| {
            let [do0, q0, k0, v0, o0, l0, pos0, slopes0] = inputs.map(|ptr| ptr as u64);
            let [dq0, dk0, dv0, ws_base] = outputs.map(|ptr| ptr as u64);
            let km = ffi_mask(&mask, pos0 as *const c_void, slopes0 as *const c_void);
            if flash && flash_aligned(op, imp, &[do0, q0, k0, v0, o0, dq0, dk0, dv0])? {
                // delta: the workspace's first aligned bytes when they hold it (always for real
                // shapes: one sequence's score region alone is Hq·T·ld f32), else a temporary
                // buffer.
                let delta_bytes = rows_len.checked_mul(size_of::<f32>());
                let mut scratch =
                    match delta_bytes {
                        Some(bytes) if bytes <= usable => None,
                        _ => Some(stream.alloc_zeros::<f32>(rows_len).map_err(|e| {
                            OpsError::Cuda {
                                context: op,
                                message: format!(
                                    "cannot allocate the {rows_len} f32 of delta: {e}"
                                ),
                            }
                        })?),
                    };
                let scratch_ptr = scratch.as_mut().map(|buf| buf.device_ptr_mut(&stream));
                let ws_start = ws_base.next_multiple_of(REGION_ALIGN as u64);
                let delta = match &scratch_ptr {
                    Some((ptr, _)) => *ptr,
                    None => ws_start,
                };
                // Null: the deterministic backward.
                let dq_accum = match (dq_accum_region, lent_ptr) {
                    (Some((offset, _)), _) => (ws_start + offset as u64) as *mut f32,
                    (None, Some(ptr)) => ptr as *mut f32,
                    (None, None) => std::ptr::null_mut(),
                };
                // SAFETY: the launchers read dout, q and out (`q_len` elements of T, `T::DTYPE`),
                // k and v (`kv_len`) and lse (`rows_len` f32) and write dq (`q_len`), dk and dv
                // (`kv_len`) for shape `s`; delta holds rows_len f32 (`usable` bytes from the
                // workspace's aligned start, or its own allocation, whose guard lives until
                // after the enqueues) and is neither an input nor an output; dq_accum, when
                // set, holds `tilearn_flash_attention_dq_accum_len` f32 for `s` from a
                // 256-byte boundary inside the usable bytes, after delta (`FlashRegions`), or
                // is the caller's lent buffer of at least that many f32 (checked above),
                // borrowed mutably for this call and disjoint from every tensor argument
                // (the borrow checker keeps it apart from them).
                unsafe {
                    let status = ffi::tilearn_attention_delta(
                        T::DTYPE,
                        do0 as *const c_void,
                        o0 as *const c_void,
                        s.batch,
                        t,
                        hq,
                        d,
                        delta as *mut f32,
                        raw,
                    );
                    check(op, status)?;
                    let status = ffi::tilearn_flash_attention_backward(
                        T::DTYPE,
                        do0 as *const c_void,
                        q0 as *const c_void,
                        k0 as *const c_void,
                        v0 as *const c_void,
                        l0 as *const f32,
                        delta as *const f32,
                        dq0 as *mut c_void,
                        dk0 as *mut c_void,
                        dv0 as *mut c_void,
                        s.batch,
                        s.seq,
                        s.q_heads,
                        s.kv_heads,
                        s.head_dim,
                        plan.scale,
                        mask_ptr(&km),
                        dq_accum,
                        raw,
                    );
                    return check(op, status);
                }
            }
            // The GEMM path: the workspace must hold at least one sequence of this shape.
            let (chunk, regions) = layout?;
            let w = WsPtrs::at(ws_base, &regions);

            let mut b0 = 0;
            while b0 < s.batch {
                let nb = chunk.min(s.batch - b0);
                let q_off = (b0 * p.q) as u64 * e;
                let kv_off = (b0 * p.kv) as u64 * e;
                let row_off = (b0 * p.rows * 4) as u64;
                let rows = row_count(&plan, nb);
                let km_chunk = mask_from(&km, b0, t);
                // SAFETY (whole block): as in `attention_forward`: offsets inside the user buffers
                // (lengths checked), the workspace holds `chunk >= nb` sequences, and the inputs
                // and output of every step are distinct buffers — the workspace's reuse (dV into
                // `v` after dP has read V, dQ into `q` after dK has read Q, dS over P after dV has
                // read P) is ordered by the stream.
                unsafe {
                    plan.swap(op, &stream, q0 + q_off, w.q, nb, t, hq)?;
                    plan.swap(op, &stream, k0 + kv_off, w.k, nb, t, hkv)?;
                    plan.swap(op, &stream, v0 + kv_off, w.v, nb, t, hkv)?;
                    plan.swap(op, &stream, do0 + q_off, w.o, nb, t, hq)?;
                    // P = exp(scale·Q·Kᵀ − lse), recomputed.
                    plan.scores_gemm::<T>(op, gemm, nb, w.q, w.k, w.scores, plan.scale)?;
                    let status = ffi::tilearn_attention_probs(
                        T::DTYPE,
                        w.scores as *const f32,
                        plan.ld,
                        rows,
                        t,
                        (l0 + row_off) as *const f32,
                        w.probs as *mut c_void,
                        mask_ptr(&km_chunk),
                        hq,
                        raw,
                    );
                    check(op, status)?;
                    // dP = dO·Vᵀ (f32, over S).
                    plan.scores_gemm::<T>(op, gemm, nb, w.o, w.v, w.scores, 1.0)?;
                    // dV_g [T, D] = P_gᵀ [T, G·T] · dO_g [G·T, D], into `v`.
                    let mut spec = MatmulSpec::new(
                        t,
                        d,
                        g * t,
                        Operand::transposed(plan.ld).strided(g * t * plan.ld),
                        Operand::plain(d).strided(g * t * d),
                    );
                    spec.batch = nb * hkv;
                    spec.c_ld = d;
                    spec.c_batch_stride = t * d;
                    spec.required_lens(op)?;
                    gemm.launch::<T, T>(op, &spec, w.probs, w.o, w.v, Epilogue::None)?;
                    // delta = rowsum(dO ∘ O), then dS = P ∘ (dP − delta) · scale over P.
                    let status = ffi::tilearn_attention_delta(
                        T::DTYPE,
                        (do0 + q_off) as *const c_void,
                        (o0 + q_off) as *const c_void,
                        nb,
                        t,
                        hq,
                        d,
                        w.delta as *mut f32,
                        raw,
                    );
                    check(op, status)?;
                    let status = ffi::tilearn_attention_dscores(
                        T::DTYPE,
                        w.probs as *mut c_void,
                        w.scores as *const f32,
                        plan.ld,
                        rows,
                        t,
                        w.delta as *const f32,
                        plan.scale,
                        mask_ptr(&km_chunk),
                        hq,
                        raw,
                    );
                    check(op, status)?;
                    // dK_g [T, D] = dS_gᵀ [T, G·T] · Q_g [G·T, D] (same shapes as dV).
                    gemm.launch::<T, T>(op, &spec, w.probs, w.q, w.dk, Epilogue::None)?;
                    // dQ_g [G·T, D] = dS_g [G·T, T] · K_g [T, D], into `q` (Q was last read by dK).
                    let mut spec = MatmulSpec::new(
                        g * t,
                        d,
                        t,
                        Operand::plain(plan.ld).strided(g * t * plan.ld),
                        Operand::plain(d).strided(t * d),
                    );
                    spec.batch = nb * hkv;
                    spec.c_ld = d;
                    spec.c_batch_stride = g * t * d;
                    spec.required_lens(op)?;
                    gemm.launch::<T, T>(op, &spec, w.probs, w.k, w.q, Epilogue::None)?;
                    plan.swap(op, &stream, w.q, dq0 + q_off, nb, hq, t)?;
                    plan.swap(op, &stream, w.dk, dk0 + kv_off, nb, hkv, t)?;
                    plan.swap(op, &stream, w.v, dv0 + kv_off, nb, hkv, t)?;
                }
                b0 += nb;
            }
            Ok(())
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flash_workspace_bytes_hold_delta_and_the_one_pass_dq_accum() {
        let s = AttnShape {
            batch: 2,
            seq: 130,
            q_heads: 8,
            kv_heads: 2,
            head_dim: 64,
        };
        // delta: 2·8·130 f32 = 8320 bytes; plus the 256 bytes of alignment slack.
        let det = AttentionWorkspace::flash_bytes_for(s, FlashBackward::Deterministic).unwrap();
        assert_eq!(det, 8320 + 256);
        // dq_accum from the next 256-byte boundary (8448): 2·8·64·192 f32 (T rounded to 64).
        let one = AttentionWorkspace::flash_bytes_for(s, FlashBackward::OnePass).unwrap();
        assert_eq!(one, 8448 + 4 * 2 * 8 * 64 * 192 + 256);
        let huge = AttnShape {
            batch: usize::MAX / 4,
            ..s
        };
        let err = AttentionWorkspace::flash_bytes_for(huge, FlashBackward::OnePass).unwrap_err();
        assert!(err.to_string().contains("overflows usize"), "{err}");
        let bad = AttnShape { kv_heads: 3, ..s };
        let err = AttentionWorkspace::flash_bytes_for(bad, FlashBackward::OnePass).unwrap_err();
        assert!(err.to_string().contains("multiple of kv_heads"), "{err}");
    }
}
