//! Causal grouped-query attention on the GPU, forward and backward, f32 and bf16: cuBLASLt
//! batched GEMMs for the six matrix products and the row kernels of `kernels/attention.cu`
//! (causal softmax, probability recomputation, dS, delta, permutes). Same contract as
//! [`crate::cpu::attention_forward`] / [`crate::cpu::attention_backward`]: `q`/`out`
//! `[B, T, Hq, D]`, `k`/`v` `[B, T, Hkv, D]`, scale `1/sqrt(D)`, query head `h` reads kv head
//! `h / (Hq/Hkv)`; the forward writes `out` and the log-sum-exp `lse` `[B, Hq, T]` (f32 in
//! both precisions); the backward writes (`=`) `dq`, `dk`, `dv`.
//!
//! Algorithm (a first version; the FlashAttention-style fused kernel is a later issue):
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
//! upper triangle) are wasted; the fused kernel of the performance issue skips them.
//!
//! Memory: the workspace holds `S` (f32) and `P`/`dS` (f32 or bf16) for a chunk of the batch,
//! `O(chunk · Hq · T²)` — e.g. 6 bytes · 12 · 1024² = 75 MB per sequence in bf16 — plus seven
//! per-head copies of Q/K/V-sized tensors. Batches larger than the workspace's chunk run in
//! several passes. Precision: f32 path all f32 (no TF32); bf16 path: bf16 Q/K/V/dO, f32 scores,
//! dP, lse, delta and accumulators, P and dS rounded to bf16 before their GEMMs (as
//! FlashAttention does), outputs rounded once to bf16.

use std::ffi::c_int;
use std::mem::size_of;
use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut, ValidAsZeroBits};
use half::bf16;

use super::ffi;
use super::gemm::{Epilogue, Gemm, GemmElement, MatmulSpec, Operand};
use super::launch::{bind, check, expect_len, raw_stream, same_device};
use crate::cpu::AttnShape;
use crate::{OpsError, Result};

type SoftmaxFn<F> = unsafe extern "C" fn(
    *const f32,
    usize,
    usize,
    usize,
    *mut F,
    *mut f32,
    ffi::cudaStream_t,
) -> c_int;
type ProbsFn<F> = unsafe extern "C" fn(
    *const f32,
    usize,
    usize,
    usize,
    *const f32,
    *mut F,
    ffi::cudaStream_t,
) -> c_int;
type DscoresFn<F> = unsafe extern "C" fn(
    *mut F,
    *const f32,
    usize,
    usize,
    usize,
    *const f32,
    f32,
    ffi::cudaStream_t,
) -> c_int;
type DeltaFn<F> = unsafe extern "C" fn(
    *const F,
    *const F,
    usize,
    usize,
    usize,
    usize,
    *mut f32,
    ffi::cudaStream_t,
) -> c_int;

/// An element type attention runs in (f32 or bf16), with its kernel launchers.
pub trait AttnElement: GemmElement + ValidAsZeroBits {
    /// The launchers' storage type.
    type Ffi;
    const SOFTMAX: SoftmaxFn<Self::Ffi>;
    const PROBS: ProbsFn<Self::Ffi>;
    const DSCORES: DscoresFn<Self::Ffi>;
    const DELTA: DeltaFn<Self::Ffi>;
}

impl AttnElement for f32 {
    type Ffi = f32;
    const SOFTMAX: SoftmaxFn<f32> = ffi::tilearn_attention_softmax_f32;
    const PROBS: ProbsFn<f32> = ffi::tilearn_attention_probs_f32;
    const DSCORES: DscoresFn<f32> = ffi::tilearn_attention_dscores_f32;
    const DELTA: DeltaFn<f32> = ffi::tilearn_attention_delta_f32;
}

impl AttnElement for bf16 {
    type Ffi = ffi::tilearn_bf16;
    const SOFTMAX: SoftmaxFn<ffi::tilearn_bf16> = ffi::tilearn_attention_softmax_bf16;
    const PROBS: ProbsFn<ffi::tilearn_bf16> = ffi::tilearn_attention_probs_bf16;
    const DSCORES: DscoresFn<ffi::tilearn_bf16> = ffi::tilearn_attention_dscores_bf16;
    const DELTA: DeltaFn<ffi::tilearn_bf16> = ffi::tilearn_attention_delta_bf16;
}

/// Leading dimension of the score rows: `seq` rounded up to 8 elements (32 bytes of f32, 16 of
/// bf16), so every row starts aligned for cuBLASLt's vectorised kernels.
fn score_ld(seq: usize) -> usize {
    seq.div_ceil(8) * 8
}

/// Element counts one batch entry needs in each workspace buffer.
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

/// Device scratch of the attention passes, allocated once for the largest shape (its `batch` is
/// the number of sequences one pass handles; larger batches run in several passes) and reused
/// by every layer, forward and backward.
#[derive(Debug)]
pub struct AttentionWorkspace<T: AttnElement> {
    /// `S` (and, in the backward, `dP`): f32 `[chunk, Hq, T, ld]`.
    scores: CudaSlice<f32>,
    /// `P` (and `dS`, in place): `[chunk, Hq, T, ld]`.
    probs: CudaSlice<T>,
    /// Per-head `Q` `[chunk, Hq, T, D]`; in the backward `dQ` once `dK` has read `Q`.
    q: CudaSlice<T>,
    /// Per-head `K` `[chunk, Hkv, T, D]`.
    k: CudaSlice<T>,
    /// Per-head `V`; in the backward `dV` once `dP` has read `V`.
    v: CudaSlice<T>,
    /// Per-head `O` (forward) or `dO` (backward) `[chunk, Hq, T, D]`.
    o: CudaSlice<T>,
    /// Per-head `dK` `[chunk, Hkv, T, D]`.
    dk: CudaSlice<T>,
    /// `delta` `[chunk, Hq, T]` f32.
    delta: CudaSlice<f32>,
}

impl<T: AttnElement> AttentionWorkspace<T> {
    /// Allocates the workspace for shapes up to `max` on `stream`'s device (see
    /// [`bytes_for`](Self::bytes_for) for the size).
    pub fn new(stream: &Arc<CudaStream>, max: AttnShape) -> Result<Self> {
        const OP: &str = "AttentionWorkspace::new";
        check_shape(OP, &max)?;
        let need = per_batch(OP, &max)?;
        let chunk = max.batch.max(1);
        let total = |x: usize| {
            x.checked_mul(chunk).ok_or_else(|| OpsError::Cuda {
                context: OP,
                message: format!("attention workspace for {max:?} overflows usize"),
            })
        };
        let alloc_err = |e: cudarc::driver::DriverError| OpsError::Cuda {
            context: OP,
            message: format!(
                "cannot allocate the attention workspace for {max:?} ({} bytes): {e}",
                Self::bytes_for(max).unwrap_or(usize::MAX)
            ),
        };
        // Zero-filled (safe allocation): every element a pass reads is written earlier in it.
        Ok(AttentionWorkspace {
            scores: stream.alloc_zeros(total(need.scores)?).map_err(alloc_err)?,
            probs: stream.alloc_zeros(total(need.scores)?).map_err(alloc_err)?,
            q: stream.alloc_zeros(total(need.q)?).map_err(alloc_err)?,
            k: stream.alloc_zeros(total(need.kv)?).map_err(alloc_err)?,
            v: stream.alloc_zeros(total(need.kv)?).map_err(alloc_err)?,
            o: stream.alloc_zeros(total(need.q)?).map_err(alloc_err)?,
            dk: stream.alloc_zeros(total(need.kv)?).map_err(alloc_err)?,
            delta: stream.alloc_zeros(total(need.rows)?).map_err(alloc_err)?,
        })
    }

    /// Device bytes [`new`](Self::new) allocates for `max`.
    pub fn bytes_for(max: AttnShape) -> Result<usize> {
        const OP: &str = "AttentionWorkspace::bytes_for";
        check_shape(OP, &max)?;
        let p = per_batch(OP, &max)?;
        let t = size_of::<T>();
        let per = p.scores * (4 + t) + (2 * p.q + 3 * p.kv) * t + p.rows * 4;
        per.checked_mul(max.batch.max(1))
            .ok_or_else(|| OpsError::Cuda {
                context: OP,
                message: format!("attention workspace for {max:?} overflows usize"),
            })
    }

    /// Device bytes this workspace holds.
    pub fn bytes(&self) -> usize {
        self.scores.len() * 4
            + (self.probs.len()
                + self.q.len()
                + self.k.len()
                + self.v.len()
                + self.o.len()
                + self.dk.len())
                * size_of::<T>()
            + self.delta.len() * 4
    }

    /// How many sequences of shape `s` one pass handles (at most `s.batch`); an error when not
    /// even one fits.
    pub fn batch_chunk(&self, s: AttnShape) -> Result<usize> {
        const OP: &str = "AttentionWorkspace::batch_chunk";
        check_shape(OP, &s)?;
        let p = per_batch(OP, &s)?;
        let fits = [
            (self.scores.len(), p.scores),
            (self.probs.len(), p.scores),
            (self.q.len(), p.q),
            (self.o.len(), p.q),
            (self.k.len(), p.kv),
            (self.v.len(), p.kv),
            (self.dk.len(), p.kv),
            (self.delta.len(), p.rows),
        ]
        .iter()
        .map(|&(have, need)| have.checked_div(need).unwrap_or(usize::MAX))
        .min()
        .unwrap_or(0);
        if fits == 0 {
            return Err(OpsError::Cuda {
                context: OP,
                message: format!(
                    "the attention workspace is too small for one sequence of {s:?}: build it \
                     with AttentionWorkspace::new for at least this seq, heads and head_dim"
                ),
            });
        }
        Ok(fits.min(s.batch.max(1)))
    }
}

/// Raw device addresses of the workspace buffers, valid while the guards of `lock` live.
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
    unsafe fn scores_gemm<T: AttnElement>(
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

/// Rows of the `[rows, ld]` score buffers for `nb` sequences: one per (sequence, query head,
/// query position).
fn row_count(plan: &Plan, nb: usize) -> usize {
    nb * plan.s.q_heads * plan.s.seq
}

#[allow(clippy::too_many_arguments)]
fn forward<T: AttnElement>(
    op: &'static str,
    gemm: &Gemm,
    ws: &mut AttentionWorkspace<T>,
    s: AttnShape,
    q: &impl DevicePtr<T>,
    k: &impl DevicePtr<T>,
    v: &impl DevicePtr<T>,
    out: &mut impl DevicePtrMut<T>,
    lse: &mut impl DevicePtrMut<f32>,
) -> Result<()> {
    check_shape(op, &s)?;
    let p = per_batch(op, &s)?;
    let q_len = p.q.checked_mul(s.batch);
    let kv_len = p.kv.checked_mul(s.batch);
    let rows_len = p.rows.checked_mul(s.batch);
    let (Some(q_len), Some(kv_len), Some(rows_len)) = (q_len, kv_len, rows_len) else {
        return Err(OpsError::Cuda {
            context: op,
            message: format!("attention shape {s:?} overflows usize"),
        });
    };
    expect_len(op, q_len, q.len())?;
    expect_len(op, kv_len, k.len())?;
    expect_len(op, kv_len, v.len())?;
    expect_len(op, q_len, out.len())?;
    expect_len(op, rows_len, lse.len())?;
    let stream = gemm.stream().clone();
    same_device(&stream, op, "q", q)?;
    same_device(&stream, op, "k", k)?;
    same_device(&stream, op, "v", v)?;
    same_device(&stream, op, "out", out)?;
    same_device(&stream, op, "lse", lse)?;
    same_device(&stream, op, "workspace", &ws.scores)?;
    if s.batch == 0 || s.seq == 0 || s.q_heads == 0 {
        return Ok(());
    }
    let chunk = ws.batch_chunk(s)?;
    let plan = Plan::new::<T>(s);
    let (t, d, g, hq, hkv) = (s.seq, s.head_dim, plan.group, s.q_heads, s.kv_heads);
    let e = plan.elem as u64;
    bind(&stream, op)?;
    let (q0, _q) = q.device_ptr(&stream);
    let (k0, _k) = k.device_ptr(&stream);
    let (v0, _v) = v.device_ptr(&stream);
    let (o0, _o) = out.device_ptr_mut(&stream);
    let (l0, _l) = lse.device_ptr_mut(&stream);
    let (w, _guards) = ws_ptrs(ws, &stream);

    let mut b0 = 0;
    while b0 < s.batch {
        let nb = chunk.min(s.batch - b0);
        let q_off = (b0 * p.q) as u64 * e;
        let kv_off = (b0 * p.kv) as u64 * e;
        let rows = row_count(&plan, nb);
        // SAFETY (whole block): every pointer is a live buffer of the stream's context (checked
        // above); the user buffers hold `batch` sequences (lengths checked), so the offsets of
        // sequences [b0, b0 + nb) stay inside them; the workspace holds `chunk >= nb`
        // sequences of this shape (`batch_chunk`); inputs and outputs of each step are
        // distinct buffers (user inputs are shared borrows, outputs mutable ones, and the
        // workspace buffers are separate allocations). The guards outlive the enqueues.
        unsafe {
            plan.swap(op, &stream, q0 + q_off, w.q, nb, t, hq)?;
            plan.swap(op, &stream, k0 + kv_off, w.k, nb, t, hkv)?;
            plan.swap(op, &stream, v0 + kv_off, w.v, nb, t, hkv)?;
            plan.scores_gemm::<T>(op, gemm, nb, w.q, w.k, w.scores, plan.scale)?;
            let status = (T::SOFTMAX)(
                w.scores as *const f32,
                plan.ld,
                rows,
                t,
                w.probs as *mut T::Ffi,
                (l0 + (b0 * p.rows * 4) as u64) as *mut f32,
                raw_stream(&stream),
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
}

#[allow(clippy::too_many_arguments)]
fn backward<T: AttnElement>(
    op: &'static str,
    gemm: &Gemm,
    ws: &mut AttentionWorkspace<T>,
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
    check_shape(op, &s)?;
    let p = per_batch(op, &s)?;
    let q_len = p.q.checked_mul(s.batch);
    let kv_len = p.kv.checked_mul(s.batch);
    let rows_len = p.rows.checked_mul(s.batch);
    let (Some(q_len), Some(kv_len), Some(rows_len)) = (q_len, kv_len, rows_len) else {
        return Err(OpsError::Cuda {
            context: op,
            message: format!("attention shape {s:?} overflows usize"),
        });
    };
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
    let stream = gemm.stream().clone();
    same_device(&stream, op, "dout", dout)?;
    same_device(&stream, op, "q", q)?;
    same_device(&stream, op, "k", k)?;
    same_device(&stream, op, "v", v)?;
    same_device(&stream, op, "out", out)?;
    same_device(&stream, op, "lse", lse)?;
    same_device(&stream, op, "dq", dq)?;
    same_device(&stream, op, "dk", dk)?;
    same_device(&stream, op, "dv", dv)?;
    same_device(&stream, op, "workspace", &ws.scores)?;
    if s.batch == 0 || s.seq == 0 || s.q_heads == 0 {
        return Ok(());
    }
    let chunk = ws.batch_chunk(s)?;
    let plan = Plan::new::<T>(s);
    let (t, d, g, hq, hkv) = (s.seq, s.head_dim, plan.group, s.q_heads, s.kv_heads);
    let e = plan.elem as u64;
    bind(&stream, op)?;
    let (do0, _do) = dout.device_ptr(&stream);
    let (q0, _q) = q.device_ptr(&stream);
    let (k0, _k) = k.device_ptr(&stream);
    let (v0, _v) = v.device_ptr(&stream);
    let (o0, _o) = out.device_ptr(&stream);
    let (l0, _l) = lse.device_ptr(&stream);
    let (dq0, _dq) = dq.device_ptr_mut(&stream);
    let (dk0, _dk) = dk.device_ptr_mut(&stream);
    let (dv0, _dv) = dv.device_ptr_mut(&stream);
    let (w, _guards) = ws_ptrs(ws, &stream);

    let mut b0 = 0;
    while b0 < s.batch {
        let nb = chunk.min(s.batch - b0);
        let q_off = (b0 * p.q) as u64 * e;
        let kv_off = (b0 * p.kv) as u64 * e;
        let row_off = (b0 * p.rows * 4) as u64;
        let rows = row_count(&plan, nb);
        // SAFETY (whole block): as in `forward`: live buffers of the stream's context, offsets
        // inside the user buffers (lengths checked), the workspace holds `chunk >= nb`
        // sequences, and the inputs and output of every step are distinct buffers — the
        // workspace's reuse (dV into `v` after dP has read V, dQ into `q` after dK has read Q,
        // dS over P after dV has read P) is ordered by the stream.
        unsafe {
            plan.swap(op, &stream, q0 + q_off, w.q, nb, t, hq)?;
            plan.swap(op, &stream, k0 + kv_off, w.k, nb, t, hkv)?;
            plan.swap(op, &stream, v0 + kv_off, w.v, nb, t, hkv)?;
            plan.swap(op, &stream, do0 + q_off, w.o, nb, t, hq)?;
            // P = exp(scale·Q·Kᵀ − lse), recomputed.
            plan.scores_gemm::<T>(op, gemm, nb, w.q, w.k, w.scores, plan.scale)?;
            let status = (T::PROBS)(
                w.scores as *const f32,
                plan.ld,
                rows,
                t,
                (l0 + row_off) as *const f32,
                w.probs as *mut T::Ffi,
                raw_stream(&stream),
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
            let status = (T::DELTA)(
                (do0 + q_off) as *const T::Ffi,
                (o0 + q_off) as *const T::Ffi,
                nb,
                t,
                hq,
                d,
                w.delta as *mut f32,
                raw_stream(&stream),
            );
            check(op, status)?;
            let status = (T::DSCORES)(
                w.probs as *mut T::Ffi,
                w.scores as *const f32,
                plan.ld,
                rows,
                t,
                w.delta as *const f32,
                plan.scale,
                raw_stream(&stream),
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
}

/// The workspace's device addresses and the guards that order their use on `stream`.
fn ws_ptrs<'a, T: AttnElement>(
    ws: &'a mut AttentionWorkspace<T>,
    stream: &'a CudaStream,
) -> (WsPtrs, Vec<cudarc::driver::SyncOnDrop<'a>>) {
    let (scores, g0) = ws.scores.device_ptr_mut(stream);
    let (probs, g1) = ws.probs.device_ptr_mut(stream);
    let (q, g2) = ws.q.device_ptr_mut(stream);
    let (k, g3) = ws.k.device_ptr_mut(stream);
    let (v, g4) = ws.v.device_ptr_mut(stream);
    let (o, g5) = ws.o.device_ptr_mut(stream);
    let (dk, g6) = ws.dk.device_ptr_mut(stream);
    let (delta, g7) = ws.delta.device_ptr_mut(stream);
    (
        WsPtrs {
            scores,
            probs,
            q,
            k,
            v,
            o,
            dk,
            delta,
        },
        vec![g0, g1, g2, g3, g4, g5, g6, g7],
    )
}

/// Causal GQA forward in f32 (no TF32): writes `out` `[B, T, Hq, D]` and `lse` `[B, Hq, T]`.
#[allow(clippy::too_many_arguments)]
pub fn attention_forward_f32(
    gemm: &Gemm,
    ws: &mut AttentionWorkspace<f32>,
    s: AttnShape,
    q: &impl DevicePtr<f32>,
    k: &impl DevicePtr<f32>,
    v: &impl DevicePtr<f32>,
    out: &mut impl DevicePtrMut<f32>,
    lse: &mut impl DevicePtrMut<f32>,
) -> Result<()> {
    forward("attention_forward_f32", gemm, ws, s, q, k, v, out, lse)
}

/// Causal GQA forward in bf16 (f32 scores, softmax and accumulation): writes `out` (bf16) and
/// `lse` (f32).
#[allow(clippy::too_many_arguments)]
pub fn attention_forward_bf16(
    gemm: &Gemm,
    ws: &mut AttentionWorkspace<bf16>,
    s: AttnShape,
    q: &impl DevicePtr<bf16>,
    k: &impl DevicePtr<bf16>,
    v: &impl DevicePtr<bf16>,
    out: &mut impl DevicePtrMut<bf16>,
    lse: &mut impl DevicePtrMut<f32>,
) -> Result<()> {
    forward("attention_forward_bf16", gemm, ws, s, q, k, v, out, lse)
}

/// Causal GQA backward in f32: writes (`=`) `dq`, `dk`, `dv` from `dout`, the inputs and the
/// forward's `out` and `lse`. Deterministic (bit-identical from run to run).
#[allow(clippy::too_many_arguments)]
pub fn attention_backward_f32(
    gemm: &Gemm,
    ws: &mut AttentionWorkspace<f32>,
    s: AttnShape,
    dout: &impl DevicePtr<f32>,
    q: &impl DevicePtr<f32>,
    k: &impl DevicePtr<f32>,
    v: &impl DevicePtr<f32>,
    out: &impl DevicePtr<f32>,
    lse: &impl DevicePtr<f32>,
    dq: &mut impl DevicePtrMut<f32>,
    dk: &mut impl DevicePtrMut<f32>,
    dv: &mut impl DevicePtrMut<f32>,
) -> Result<()> {
    backward(
        "attention_backward_f32",
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

/// Causal GQA backward in bf16 (f32 dP, delta and accumulation; P and dS rounded to bf16):
/// writes (`=`) bf16 `dq`, `dk`, `dv`. Deterministic.
#[allow(clippy::too_many_arguments)]
pub fn attention_backward_bf16(
    gemm: &Gemm,
    ws: &mut AttentionWorkspace<bf16>,
    s: AttnShape,
    dout: &impl DevicePtr<bf16>,
    q: &impl DevicePtr<bf16>,
    k: &impl DevicePtr<bf16>,
    v: &impl DevicePtr<bf16>,
    out: &impl DevicePtr<bf16>,
    lse: &impl DevicePtr<f32>,
    dq: &mut impl DevicePtrMut<bf16>,
    dk: &mut impl DevicePtrMut<bf16>,
    dv: &mut impl DevicePtrMut<bf16>,
) -> Result<()> {
    backward(
        "attention_backward_bf16",
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
