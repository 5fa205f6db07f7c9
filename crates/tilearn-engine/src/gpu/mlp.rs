//! The decoder block's MLP on the device, chunk by chunk of tokens:
//!
//! ```text
//! out[r] = down_proj(act[r])      act[r] = silu(gate_proj(xn2[r])) * up_proj(xn2[r])   (or gelu(up_proj(xn2[r])))
//! ```
//!
//! The MLP is token-wise, so a chunk `r` of rows needs nothing from the others: under gradient
//! checkpointing the arena holds `gate`, `up` and the backward's `dgate`, `dup`, `dact` for one
//! chunk of `Bufs::mlp_rows` tokens only (see [`crate::mlp_chunk`]), and the backward
//! recomputes each chunk's `gate` and `up` from the kept `xn2` before differentiating it. The
//! weight gradients are `+=` products anyway, so the chunks add theirs in turn. Without
//! checkpointing (or when a call fits in one chunk) there is one chunk of every row, and the
//! ops are the unchunked block's, in its order.

use cudarc::driver::{CudaView, CudaViewMut};
use tilearn_ops::cuda::{self as k, DeviceFloat};

use super::arena::Dims;
use super::cx::Cx;
use super::linear::{linear_bwd, linear_bwd_add_dx, linear_fwd};
use super::sink::GradParts;
use super::views::{view, view_mut, view_of};
use super::weights::Weights;
use crate::error::Result;
use crate::lce_chunk::chunk_ranges;
use crate::model::LayerLayout;

/// Forward: `out = down(act)` (`=`; the caller completes a row-parallel product and adds the
/// residual), with `gate` and `up` written for each chunk of `rows` tokens and the activation
/// into `act` (the layer buffers' whole `[N, I]` when they keep it, else one chunk's scratch).
#[allow(clippy::too_many_arguments)]
pub(super) fn mlp_forward<T: DeviceFloat>(
    cx: &mut Cx<'_>,
    d: &Dims,
    lay: &LayerLayout,
    w: &Weights<'_, T>,
    rows: usize,
    xn2: &CudaView<'_, T>,
    gate: &mut CudaViewMut<'_, T>,
    up: &mut CudaViewMut<'_, T>,
    act: &mut CudaViewMut<'_, T>,
    out: &mut CudaViewMut<'_, T>,
) -> Result<()> {
    let (c, inter) = (d.c, d.inter);
    for r in chunk_ranges(d.n, rows) {
        let m = r.len();
        let x = view(xn2, r.start * c..r.end * c)?;
        let mut act_r = view_mut(act, 0..m * inter)?;
        gate_up_forward(cx, lay, w, &x, m, c, inter, gate, up, &mut act_r)?;
        let mut out_r = view_mut(out, r.start * c..r.end * c)?;
        linear_fwd(cx, w, &lay.down, &act_r.as_view(), m, inter, c, &mut out_r)?;
    }
    Ok(())
}

/// One chunk's `up = up_proj(x)`, `gate = gate_proj(x)` (gated MLPs) and the activation into
/// `act`, for `m` rows.
#[allow(clippy::too_many_arguments)]
fn gate_up_forward<T: DeviceFloat>(
    cx: &mut Cx<'_>,
    lay: &LayerLayout,
    w: &Weights<'_, T>,
    x: &CudaView<'_, T>,
    m: usize,
    c: usize,
    inter: usize,
    gate: &mut CudaViewMut<'_, T>,
    up: &mut CudaViewMut<'_, T>,
    act: &mut CudaViewMut<'_, T>,
) -> Result<()> {
    let mut up_r = view_mut(up, 0..m * inter)?;
    linear_fwd(cx, w, &lay.up, x, m, c, inter, &mut up_r)?;
    match &lay.gate {
        Some(g) => {
            let mut gate_r = view_mut(gate, 0..m * inter)?;
            linear_fwd(cx, w, g, x, m, c, inter, &mut gate_r)?;
            k::swiglu_forward(cx.stream, &gate_r, &up_r, act)?;
        }
        None => k::gelu_tanh_forward(cx.stream, &up_r, act)?,
    }
    Ok(())
}

/// The MLP's buffers in a backward: `gate` and `up` (the layer's, or one chunk's in the
/// scratch), the kept activation (empty when recomputed), one chunk's gradients, and whether
/// `gate`/`up` must be recomputed (under checkpointing the block's recomputation stops before
/// the MLP).
pub(super) struct MlpBackward<'s, T> {
    pub gate: CudaViewMut<'s, T>,
    pub up: CudaViewMut<'s, T>,
    pub act: CudaView<'s, T>,
    pub dgate: CudaViewMut<'s, T>,
    pub dup: CudaViewMut<'s, T>,
    pub dact: CudaViewMut<'s, T>,
    pub recompute_gate_up: bool,
}

/// Backward: `dres` holds d/d(out); on return `dxn` holds d/d(xn2) (`=`, before a
/// column-parallel completion), and the three products' weight gradients are added into `g`.
#[allow(clippy::too_many_arguments)]
pub(super) fn mlp_backward<T: DeviceFloat>(
    cx: &mut Cx<'_>,
    d: &Dims,
    lay: &LayerLayout,
    w: &Weights<'_, T>,
    g: &mut GradParts<'_>,
    rows: usize,
    xn2: &CudaView<'_, T>,
    dres: &CudaView<'_, T>,
    bufs: MlpBackward<'_, T>,
    dxn: &mut CudaViewMut<'_, T>,
) -> Result<()> {
    let (c, inter) = (d.c, d.inter);
    let s = cx.stream;
    let MlpBackward {
        mut gate,
        mut up,
        act,
        mut dgate,
        mut dup,
        mut dact,
        recompute_gate_up,
    } = bufs;
    let kept_act = !act.is_empty();
    for r in chunk_ranges(d.n, rows) {
        let m = r.len();
        let rc = r.start * c..r.end * c;
        let x = view(xn2, rc.clone())?;
        let mi = 0..m * inter;
        // The activation: kept, or recomputed into dgate (written `=` by the SwiGLU backward
        // only after the down projection's backward has read it; the GeLU backward writes
        // dup instead).
        let mut dgate = view_mut(&mut dgate, mi.clone())?;
        if recompute_gate_up {
            gate_up_forward(cx, lay, w, &x, m, c, inter, &mut gate, &mut up, &mut dgate)?;
        } else if !kept_act {
            let up_r = view_of(&up, mi.clone())?;
            match &lay.gate {
                Some(_) => {
                    let gate_r = view_of(&gate, mi.clone())?;
                    k::swiglu_forward(s, &gate_r, &up_r, &mut dgate)?;
                }
                None => k::gelu_tanh_forward(s, &up_r, &mut dgate)?,
            }
        }
        let act_r = if kept_act {
            view(&act, mi.clone())?
        } else {
            dgate.as_view()
        };
        let mut dact = view_mut(&mut dact, mi.clone())?;
        let dres_r = view(dres, rc.clone())?;
        linear_bwd(
            cx,
            w,
            g,
            &lay.down,
            &dres_r,
            &act_r,
            m,
            inter,
            c,
            Some(&mut dact),
        )?;
        let up_r = view_of(&up, mi.clone())?;
        let mut dup = view_mut(&mut dup, mi.clone())?;
        let mut dxn_r = view_mut(dxn, rc.clone())?;
        match &lay.gate {
            Some(gw) => {
                let gate_r = view_of(&gate, mi.clone())?;
                k::swiglu_backward(s, &dact, &gate_r, &up_r, &mut dgate, &mut dup)?;
                linear_bwd(
                    cx,
                    w,
                    g,
                    gw,
                    &dgate.as_view(),
                    &x,
                    m,
                    c,
                    inter,
                    Some(&mut dxn_r),
                )?;
                // dxn += up's input gradient (added by its GEMM).
                linear_bwd_add_dx(
                    cx,
                    w,
                    g,
                    &lay.up,
                    &dup.as_view(),
                    &x,
                    m,
                    c,
                    inter,
                    &mut dxn_r,
                )?;
            }
            None => {
                k::gelu_tanh_backward(s, &dact, &up_r, &mut dup)?;
                linear_bwd(
                    cx,
                    w,
                    g,
                    &lay.up,
                    &dup.as_view(),
                    &x,
                    m,
                    c,
                    inter,
                    Some(&mut dxn_r),
                )?;
            }
        }
    }
    Ok(())
}

impl super::GpuLlama {
    /// Tokens per MLP chunk of a full-capacity call (`batch * seq` when the MLP runs whole;
    /// see [`crate::mlp_chunk`]).
    pub fn mlp_chunk_tokens(&self) -> usize {
        self.arena.plan().mlp_rows.min(self.batch * self.seq)
    }

    /// Runs the MLP in chunks of `tokens` tokens (at least 1, at most the capacity) instead of
    /// [`crate::mlp_chunk::mlp_chunk_rows`]'s. Set-up work: reallocates the activation arena.
    /// Refused without gradient checkpointing, where every layer keeps its whole MLP for the
    /// backward.
    pub fn set_mlp_chunk_tokens(&mut self, tokens: usize) -> Result<()> {
        if !self.gradient_checkpointing {
            return Err(super::invalid(
                "MLP chunk tokens",
                "chunk the MLP under gradient checkpointing only (without it every layer \
                 keeps its whole MLP for the backward)"
                    .into(),
            ));
        }
        let rows = tokens.clamp(1, (self.batch * self.seq).max(1));
        let plan = self.arena.plan();
        if rows == plan.mlp_rows {
            return Ok(());
        }
        self.rebuild_arena(super::arena::ArenaPlan {
            mlp_rows: rows,
            ..plan
        })
    }
}
