//! One decoder layer, forward and backward, on prefixes of the arena's buffers.
//!
//! ```text
//! h   = x + o_proj(attn(rope(q_proj(n1)), rope(k_proj(n1)), v_proj(n1)))   n1 = input_layernorm(x)
//! out = h + down_proj(silu(gate_proj(n2)) * up_proj(n2))                    n2 = post_attention_layernorm(h)
//! ```
//! with the family's parts from the layout: RMSNorm or LayerNorm (a norm bias), RoPE or ALiBi
//! (slopes in [`Positions`]), SwiGLU or Bloom's `down(gelu_tanh(up(n2)))` (no gate).
//! Gradient convention: `dres` holds d(loss)/d(out) on entry and d(loss)/d(x) on return
//! (written); parameter gradients are accumulated (`+=`).

use std::ops::Range;

use tilearn_ops::KeyMask;
use tilearn_ops::cpu::{
    AttnShape, Real, RopeTable, add_inplace, attention_backward_alibi, attention_forward_alibi,
    gelu_tanh_backward, gelu_tanh_forward, linear_backward, linear_forward, rope_backward_at,
    rope_forward_at, swiglu_backward, swiglu_forward,
};

use super::activations::{GradScratch, LayerActs};
use super::layout::{LayerLayout, LinearLayout};
use super::norm::{NormAt, norm_backward, norm_forward};
use super::partial_sums::RowSplit;
use crate::config::LlamaConfig;
use crate::error::Result;

/// Sizes of one call: `n = batch * seq` rows plus the model widths.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Dims {
    pub batch: usize,
    pub seq: usize,
    pub n: usize,
    pub c: usize,
    pub q: usize,
    pub kv: usize,
    pub inter: usize,
    pub vocab: usize,
    pub q_heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub eps: f64,
    /// Whether the lm_head rows are normalised before the product (Baichuan2's NormHead).
    pub norm_head: bool,
    /// Baichuan2's z-loss weight (0: none).
    pub z_loss_weight: f64,
}

impl Dims {
    pub fn new(config: &LlamaConfig, batch: usize, seq: usize) -> Dims {
        Dims {
            batch,
            seq,
            n: batch * seq,
            c: config.hidden_size,
            q: config.q_dim(),
            kv: config.kv_dim(),
            inter: config.intermediate_size,
            vocab: config.vocab_size,
            q_heads: config.num_attention_heads,
            kv_heads: config.num_key_value_heads,
            head_dim: config.head_dim,
            eps: config.rms_norm_eps,
            norm_head: config.norm_head(),
            z_loss_weight: config.z_loss_weight,
        }
    }

    fn attn(&self) -> AttnShape {
        AttnShape {
            batch: self.batch,
            seq: self.seq,
            q_heads: self.q_heads,
            kv_heads: self.kv_heads,
            head_dim: self.head_dim,
        }
    }
}

fn linear_fwd<R: Real>(
    p: &[R],
    l: &LinearLayout,
    x: &[R],
    rows: usize,
    in_f: usize,
    out_f: usize,
    out: &mut [R],
) -> tilearn_ops::Result<()> {
    let bias = l.bias.as_ref().map(|b| &p[b.clone()]);
    linear_forward(x, &p[l.weight.clone()], bias, rows, in_f, out_f, out)
}

/// Two disjoint mutable ranges of `g` (the weight before its bias, as in the layout).
fn two_mut<R>(g: &mut [R], a: Range<usize>, b: Range<usize>) -> (&mut [R], &mut [R]) {
    assert!(
        a.end <= b.start,
        "two_mut: ranges must be ordered and disjoint"
    );
    let (lo, hi) = g.split_at_mut(b.start);
    (&mut lo[a], &mut hi[..b.end - b.start])
}

#[allow(clippy::too_many_arguments)]
fn linear_bwd<R: Real>(
    p: &[R],
    g: &mut [R],
    l: &LinearLayout,
    dout: &[R],
    x: &[R],
    rows: usize,
    in_f: usize,
    out_f: usize,
    dx: Option<&mut [R]>,
) -> tilearn_ops::Result<()> {
    let w = &p[l.weight.clone()];
    match &l.bias {
        Some(b) => {
            let (dw, db) = two_mut(g, l.weight.clone(), b.clone());
            linear_backward(dout, x, w, rows, in_f, out_f, dx, dw, Some(db))
        }
        None => linear_backward(
            dout,
            x,
            w,
            rows,
            in_f,
            out_f,
            dx,
            &mut g[l.weight.clone()],
            None,
        ),
    }
}

fn input_norm(lay: &LayerLayout) -> NormAt<'_> {
    NormAt {
        weight: &lay.input_norm,
        bias: lay.input_norm_bias.as_ref(),
    }
}

fn post_attention_norm(lay: &LayerLayout) -> NormAt<'_> {
    NormAt {
        weight: &lay.post_attention_norm,
        bias: lay.post_attention_norm_bias.as_ref(),
    }
}

/// Where the tokens of a call sit: the rotary table and, for packed rows, the position ids
/// `[batch, seq]` (restarting per example: RoPE rotates by them and attention stays inside
/// each example). With ALiBi slopes the model encodes positions by the attention bias instead
/// and q and k are not rotated.
#[derive(Clone, Copy)]
pub(crate) struct Positions<'a> {
    pub rope: &'a RopeTable,
    pub ids: Option<&'a [i32]>,
    pub alibi: Option<&'a [f32]>,
}

impl Positions<'_> {
    /// The mask of a layer with sliding window `window` (`None`: full causal attention).
    fn mask(&self, window: Option<usize>) -> KeyMask<&[i32]> {
        KeyMask {
            positions: self.ids,
            sliding_window: window,
        }
    }
}

/// Forward of one block from `x` (`[n, C]`) into `a`. `out` (`[n, C]`) receives the block
/// output; `None` (recomputation inside the backward) skips `down_proj`, which the backward
/// does not need. Under tensor parallelism `rows` completes the row-parallel `o_proj` and
/// `down_proj` outputs before their residual adds; with sequence parallelism `x`, the norms and
/// the residual adds hold only this rank's rows (at the front of each buffer; `out` keeps room
/// for all rows) and the norms' outputs are all-gathered before the column-parallel products.
#[allow(clippy::too_many_arguments)]
pub(crate) fn block_forward<R: Real>(
    d: &Dims,
    lay: &LayerLayout,
    p: &[R],
    pos: Positions<'_>,
    x: &[R],
    a: &mut LayerActs<R>,
    out: Option<&mut [R]>,
    rows: RowSplit<'_, R>,
) -> Result<()> {
    let (n, c, q, kv, inter) = (d.n, d.c, d.q, d.kv, d.inter);
    let nl = rows.local_rows(n)?;
    norm_forward(
        input_norm(lay),
        p,
        &x[..nl * c],
        c,
        d.eps,
        &mut a.xn1[..nl * c],
        &mut a.mean1[..nl],
        &mut a.rstd1[..nl],
    )?;
    rows.gather(&mut a.xn1[..n * c])?;
    let xn1 = &a.xn1[..n * c];
    let qb = &mut a.q[..n * q];
    let kb = &mut a.k[..n * kv];
    let vb = &mut a.v[..n * kv];
    linear_fwd(p, &lay.q, xn1, n, c, q, qb)?;
    linear_fwd(p, &lay.k, xn1, n, c, kv, kb)?;
    linear_fwd(p, &lay.v, xn1, n, c, kv, vb)?;
    if pos.alibi.is_none() {
        let rope = pos.rope;
        rope_forward_at(qb, d.batch, d.seq, d.q_heads, d.head_dim, rope, pos.ids)?;
        rope_forward_at(kb, d.batch, d.seq, d.kv_heads, d.head_dim, rope, pos.ids)?;
    }
    let att = &mut a.att[..n * q];
    let lse = &mut a.lse[..n * d.q_heads];
    let mask = pos.mask(lay.sliding_window);
    attention_forward_alibi(d.attn(), mask, pos.alibi, qb, kb, vb, att, lse)?;
    linear_fwd(p, &lay.o, att, n, q, c, &mut a.h[..n * c])?;
    rows.complete(&mut a.h[..n * c])?;
    let h = &mut a.h[..nl * c];
    add_inplace(h, &x[..nl * c])?;
    norm_forward(
        post_attention_norm(lay),
        p,
        h,
        c,
        d.eps,
        &mut a.xn2[..nl * c],
        &mut a.mean2[..nl],
        &mut a.rstd2[..nl],
    )?;
    rows.gather(&mut a.xn2[..n * c])?;
    let xn2 = &a.xn2[..n * c];
    let (gate, up, act) = (
        &mut a.gate[..n * inter],
        &mut a.up[..n * inter],
        &mut a.act[..n * inter],
    );
    linear_fwd(p, &lay.up, xn2, n, c, inter, up)?;
    match &lay.gate {
        Some(g) => {
            linear_fwd(p, g, xn2, n, c, inter, gate)?;
            swiglu_forward(gate, up, act)?;
        }
        None => gelu_tanh_forward(up, act)?,
    }
    if let Some(out) = out {
        linear_fwd(p, &lay.down, act, n, inter, c, &mut out[..n * c])?;
        rows.complete(&mut out[..n * c])?;
        add_inplace(&mut out[..nl * c], &a.h[..nl * c])?;
    }
    Ok(())
}

/// Backward of one block: `s.dres` holds d/d(out) on entry and d/d(x) on return; parameter
/// gradients are added into `g`. Under tensor parallelism `rows` completes the input gradients
/// of the column-parallel projections (gate/up, then q/k/v) before the norms' backward; with
/// sequence parallelism `s.dres` holds this rank's rows, all-gathered before the row-parallel
/// products' backward, and the norms' weight gradients are this rank's rows' share (the caller
/// sums them over the ranks).
#[allow(clippy::too_many_arguments)]
pub(crate) fn block_backward<R: Real>(
    d: &Dims,
    lay: &LayerLayout,
    p: &[R],
    g: &mut [R],
    pos: Positions<'_>,
    x: &[R],
    a: &LayerActs<R>,
    s: &mut GradScratch<R>,
    rows: RowSplit<'_, R>,
) -> Result<()> {
    let (n, c, q, kv, inter) = (d.n, d.c, d.q, d.kv, d.inter);
    let nl = rows.local_rows(n)?;
    let (dgate, dup, dact) = (
        &mut s.dgate[..n * inter],
        &mut s.dup[..n * inter],
        &mut s.dact[..n * inter],
    );
    let xn1 = &a.xn1[..n * c];
    let xn2 = &a.xn2[..n * c];

    // MLP: out = h + down(silu(gate(n2)) * up(n2)).
    let dout = rows.gathered(&s.dres[..n * c], &mut s.dtmp[..n * c])?;
    linear_bwd(
        p,
        g,
        &lay.down,
        dout,
        &a.act[..n * inter],
        n,
        inter,
        c,
        Some(&mut *dact),
    )?;
    let dxn = &mut s.dxn[..n * c];
    let dtmp = &mut s.dtmp[..n * c];
    match &lay.gate {
        Some(gl) => {
            swiglu_backward(dact, &a.gate[..n * inter], &a.up[..n * inter], dgate, dup)?;
            linear_bwd(p, g, gl, dgate, xn2, n, c, inter, Some(&mut *dxn))?;
            linear_bwd(p, g, &lay.up, dup, xn2, n, c, inter, Some(&mut *dtmp))?;
            add_inplace(dxn, dtmp)?;
        }
        None => {
            gelu_tanh_backward(dact, &a.up[..n * inter], dup)?;
            linear_bwd(p, g, &lay.up, dup, xn2, n, c, inter, Some(&mut *dxn))?;
        }
    }
    rows.complete(dxn)?;
    norm_backward(
        post_attention_norm(lay),
        p,
        g,
        &dxn[..nl * c],
        &a.h[..nl * c],
        &a.mean2[..nl],
        &a.rstd2[..nl],
        c,
        &mut dtmp[..nl * c],
    )?;
    add_inplace(&mut s.dres[..nl * c], &dtmp[..nl * c])?; // dres = d/dh

    // Attention: h = x + o(attn(...)).
    let datt = &mut s.datt[..n * q];
    let (dq, dk, dv) = (&mut s.dq[..n * q], &mut s.dk[..n * kv], &mut s.dv[..n * kv]);
    let att = &a.att[..n * q];
    let dh = rows.gathered(&s.dres[..n * c], &mut s.dtmp[..n * c])?;
    linear_bwd(p, g, &lay.o, dh, att, n, q, c, Some(&mut *datt))?;
    attention_backward_alibi(
        d.attn(),
        pos.mask(lay.sliding_window),
        pos.alibi,
        datt,
        &a.q[..n * q],
        &a.k[..n * kv],
        &a.v[..n * kv],
        att,
        &a.lse[..n * d.q_heads],
        dq,
        dk,
        dv,
    )?;
    if pos.alibi.is_none() {
        rope_backward_at(dq, d.batch, d.seq, d.q_heads, d.head_dim, pos.rope, pos.ids)?;
        rope_backward_at(
            dk, d.batch, d.seq, d.kv_heads, d.head_dim, pos.rope, pos.ids,
        )?;
    }
    let dxn = &mut s.dxn[..n * c];
    let dtmp = &mut s.dtmp[..n * c];
    linear_bwd(p, g, &lay.q, dq, xn1, n, c, q, Some(&mut *dxn))?;
    linear_bwd(p, g, &lay.k, dk, xn1, n, c, kv, Some(&mut *dtmp))?;
    add_inplace(dxn, dtmp)?;
    linear_bwd(p, g, &lay.v, dv, xn1, n, c, kv, Some(&mut *dtmp))?;
    add_inplace(dxn, dtmp)?;
    rows.complete(dxn)?;
    norm_backward(
        input_norm(lay),
        p,
        g,
        &dxn[..nl * c],
        &x[..nl * c],
        &a.mean1[..nl],
        &a.rstd1[..nl],
        c,
        &mut dtmp[..nl * c],
    )?;
    add_inplace(&mut s.dres[..nl * c], &dtmp[..nl * c])?; // dres = d/dx
    Ok(())
}
