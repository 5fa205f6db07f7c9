//! Rotary position embedding, Hugging Face Llama convention (`rotate_half`): element `i` of a
//! head pairs with element `i + head_dim/2`, both rotated by angle `t * inv_freq[i]`:
//!
//! ```text
//! y[i]     = x[i] * cos - x[i+h] * sin
//! y[i+h]   = x[i+h] * cos + x[i] * sin          (h = head_dim / 2, i < h)
//! ```
//!
//! Tables are computed in f64. `rope_scaling` types `linear`, `dynamic` (NTK) and `llama3`
//! modify `inv_freq` as transformers' `ROPE_INIT_FUNCTIONS` do; their `attention_scaling` is 1.
//!
//! The `_at` variants take explicit `position_ids` (`[batch, seq]`, e.g. restarting at 0 for
//! each packed example) instead of the row index `t`.
//!
//! Gradient convention: `rope_backward` *writes* (`=`, in place) the activation gradient: it
//! applies the inverse (transposed) rotation to the incoming gradient. No parameters.

use rayon::prelude::*;

use super::Real;
use crate::shape::{expect_len, expect_product};
use crate::{OpsError, Result};

/// `rope_scaling` of a Llama config.
#[derive(Clone, Debug, PartialEq)]
pub enum RopeScaling {
    None,
    /// Positions divided by `factor` (equivalently `inv_freq / factor`).
    Linear {
        factor: f64,
    },
    /// Dynamic NTK: for `seq_len > original_max_position_embeddings`,
    /// `base = theta * ((factor * seq_len / orig) - (factor - 1)) ^ (d / (d - 2))`.
    /// An `original_max_position_embeddings` of 0 means "use `max_position_embeddings`".
    Dynamic {
        factor: f64,
        original_max_position_embeddings: usize,
    },
    /// Llama 3 wavelength-dependent smoothing (transformers' `_compute_llama3_parameters`).
    Llama3 {
        factor: f64,
        low_freq_factor: f64,
        high_freq_factor: f64,
        original_max_position_embeddings: usize,
    },
}

/// `cos` / `sin` of `t * inv_freq[i]`, `[seq_len, half_dim]` row-major, in f64.
#[derive(Clone, Debug, PartialEq)]
pub struct RopeTable {
    pub half_dim: usize,
    pub seq_len: usize,
    pub cos: Vec<f64>,
    pub sin: Vec<f64>,
}

/// The (scaled) inverse frequencies `inv_freq[i]`, `i < head_dim/2`, for a table of `seq_len`
/// positions. Default: `1 / theta^(2i / head_dim)`.
pub fn rope_inv_freq(
    head_dim: usize,
    theta: f64,
    scaling: &RopeScaling,
    seq_len: usize,
    max_position_embeddings: usize,
) -> Vec<f64> {
    assert!(
        head_dim >= 2 && head_dim.is_multiple_of(2),
        "rope: head_dim must be even, got {head_dim}"
    );
    let d = head_dim as f64;
    let default = |base: f64| -> Vec<f64> {
        (0..head_dim / 2)
            .map(|i| 1.0 / base.powf((2 * i) as f64 / d))
            .collect()
    };
    match *scaling {
        RopeScaling::None => default(theta),
        RopeScaling::Linear { factor } => default(theta).into_iter().map(|f| f / factor).collect(),
        RopeScaling::Dynamic {
            factor,
            original_max_position_embeddings,
        } => {
            let orig = if original_max_position_embeddings == 0 {
                max_position_embeddings
            } else {
                original_max_position_embeddings
            };
            if seq_len > orig {
                let ratio = factor * seq_len as f64 / orig as f64 - (factor - 1.0);
                default(theta * ratio.powf(d / (d - 2.0)))
            } else {
                default(theta)
            }
        }
        RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position_embeddings,
        } => {
            let old = original_max_position_embeddings as f64;
            let low_freq_wavelen = old / low_freq_factor;
            let high_freq_wavelen = old / high_freq_factor;
            default(theta)
                .into_iter()
                .map(|f| {
                    let wavelen = 2.0 * std::f64::consts::PI / f;
                    if wavelen < high_freq_wavelen {
                        f
                    } else if wavelen > low_freq_wavelen {
                        f / factor
                    } else {
                        let smooth = (old / wavelen - low_freq_factor)
                            / (high_freq_factor - low_freq_factor);
                        (1.0 - smooth) * f / factor + smooth * f
                    }
                })
                .collect()
        }
    }
}

impl RopeTable {
    /// Builds the table for positions `0..seq_len`.
    pub fn new(
        head_dim: usize,
        theta: f64,
        scaling: &RopeScaling,
        seq_len: usize,
        max_position_embeddings: usize,
    ) -> RopeTable {
        let inv_freq = rope_inv_freq(head_dim, theta, scaling, seq_len, max_position_embeddings);
        let half_dim = head_dim / 2;
        let mut cos = Vec::with_capacity(seq_len * half_dim);
        let mut sin = Vec::with_capacity(seq_len * half_dim);
        for t in 0..seq_len {
            for &f in &inv_freq {
                let angle = t as f64 * f;
                cos.push(angle.cos());
                sin.push(angle.sin());
            }
        }
        RopeTable {
            half_dim,
            seq_len,
            cos,
            sin,
        }
    }
}

/// Checks `x` (`[batch, seq, heads, head_dim]`) and `table` against each other: the table's
/// rows are `head_dim / 2` wide, cover positions `0..seq`, and hold that many cos and sin.
fn check_shape<R>(
    x: &[R],
    batch: usize,
    seq: usize,
    heads: usize,
    head_dim: usize,
    table: &RopeTable,
) -> Result<()> {
    expect_product(
        "rope (x = batch x seq x heads x head_dim)",
        &[batch, seq, heads, head_dim],
        x.len(),
    )?;
    expect_len(
        "rope (head_dim = 2 x table half_dim)",
        2 * table.half_dim,
        head_dim,
    )?;
    if seq > table.seq_len {
        return Err(OpsError::ShapeMismatch {
            op: "rope (table positions: at least seq; build the RopeTable for the longest sequence)",
            expected: seq,
            actual: table.seq_len,
        });
    }
    let cells = table.seq_len.saturating_mul(table.half_dim);
    expect_len(
        "rope (table cos = seq_len x half_dim)",
        cells,
        table.cos.len(),
    )?;
    expect_len(
        "rope (table sin = seq_len x half_dim)",
        cells,
        table.sin.len(),
    )
}

/// Fails unless `positions` holds `batch * seq` entries, each a row of `table`.
fn check_positions_in_table(
    positions: &[i32],
    batch: usize,
    seq: usize,
    table: &RopeTable,
) -> Result<()> {
    expect_product(
        "rope (positions = batch x seq)",
        &[batch, seq],
        positions.len(),
    )?;
    if let Some(&bad) = positions
        .iter()
        .find(|&&p| usize::try_from(p).map_or(true, |p| p >= table.seq_len))
    {
        return Err(OpsError::ShapeMismatch {
            op: "rope (a position id outside the table's positions 0..seq_len; build the RopeTable for the longest example)",
            expected: table.seq_len,
            actual: usize::try_from(bad).unwrap_or(usize::MAX),
        });
    }
    Ok(())
}

/// Rotates `x` (`[batch, seq, heads, head_dim]`) by `sign * angle`; token `(b, t)` by the
/// angle of `positions[b * seq + t]`, or of `t` without positions.
#[allow(clippy::too_many_arguments)]
fn rotate<R: Real>(
    x: &mut [R],
    batch: usize,
    seq: usize,
    heads: usize,
    head_dim: usize,
    table: &RopeTable,
    positions: Option<&[i32]>,
    inverse: bool,
) -> Result<()> {
    check_shape(x, batch, seq, heads, head_dim, table)?;
    if let Some(pos) = positions {
        check_positions_in_table(pos, batch, seq, table)?;
    }
    let h = table.half_dim;
    let row = heads * head_dim;
    if row == 0 {
        return Ok(());
    }
    x.par_chunks_mut(row)
        .enumerate()
        .with_min_len(4)
        .for_each(|(bt, xr)| {
            // Checked above: every position is a row of the table.
            let t = positions.map_or(bt % seq, |p| p[bt] as usize);
            let cos: Vec<R> = table.cos[t * h..(t + 1) * h]
                .iter()
                .map(|&c| R::from_f64(c))
                .collect();
            let sin: Vec<R> = table.sin[t * h..(t + 1) * h]
                .iter()
                .map(|&s| R::from_f64(if inverse { -s } else { s }))
                .collect();
            for head in xr.chunks_mut(head_dim) {
                let (a, b) = head.split_at_mut(h);
                for i in 0..h {
                    let (x1, x2) = (a[i], b[i]);
                    a[i] = x1 * cos[i] - x2 * sin[i];
                    b[i] = x2 * cos[i] + x1 * sin[i];
                }
            }
        });
    Ok(())
}

/// Applies the rotation in place to `x` (`[batch, seq, heads, head_dim]`), position `t` using
/// row `t` of the table.
pub fn rope_forward<R: Real>(
    x: &mut [R],
    batch: usize,
    seq: usize,
    heads: usize,
    head_dim: usize,
    table: &RopeTable,
) -> Result<()> {
    rotate(x, batch, seq, heads, head_dim, table, None, false)
}

/// [`rope_forward`] with explicit `positions` (`[batch, seq]`, each `< table.seq_len`).
pub fn rope_forward_at<R: Real>(
    x: &mut [R],
    batch: usize,
    seq: usize,
    heads: usize,
    head_dim: usize,
    table: &RopeTable,
    positions: Option<&[i32]>,
) -> Result<()> {
    rotate(x, batch, seq, heads, head_dim, table, positions, false)
}

/// [`rope_backward`] with explicit `positions` (those of the forward).
pub fn rope_backward_at<R: Real>(
    dx: &mut [R],
    batch: usize,
    seq: usize,
    heads: usize,
    head_dim: usize,
    table: &RopeTable,
    positions: Option<&[i32]>,
) -> Result<()> {
    rotate(dx, batch, seq, heads, head_dim, table, positions, true)
}

/// Backward of [`rope_forward`], in place: `dx = Rᵀ · dy` (rotation by the opposite angle).
pub fn rope_backward<R: Real>(
    dx: &mut [R],
    batch: usize,
    seq: usize,
    heads: usize,
    head_dim: usize,
    table: &RopeTable,
) -> Result<()> {
    rotate(dx, batch, seq, heads, head_dim, table, None, true)
}
