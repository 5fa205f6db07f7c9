//! Global gradient norm and clipping (`torch.nn.utils.clip_grad_norm_` semantics, L2 norm).
//!
//! The norm is deterministic: the buffer is cut into fixed chunks of [`NORM_CHUNK`] elements,
//! each chunk's sum of squares is accumulated in f64 over [`NORM_LANES`] interleaved partial
//! sums (element `i` of a chunk into lane `i mod NORM_LANES`) that are then added in a fixed
//! order, and the chunk sums are added in chunk order. Only the per-chunk work runs in
//! parallel, so the result does not depend on the thread count or on rayon's scheduling. The
//! lanes are independent chains of additions, which the compiler keeps in vector registers:
//! one chain per chunk made the norm latency-bound, slower than the AdamW step it feeds.

use rayon::prelude::*;

/// Elements per chunk of the deterministic sum of squares. Part of the numeric contract:
/// changing it changes the last bits of the norm.
pub const NORM_CHUNK: usize = 1 << 14;

/// Partial sums per chunk of the sum of squares. Part of the numeric contract, as
/// [`NORM_CHUNK`].
pub const NORM_LANES: usize = 8;

/// Sum of squares of `grads` in f64, deterministic (fixed chunks and lanes summed in order).
///
/// Exposed so sharded gradients (ZeRO, tensor parallelism) can compute partial sums to be
/// all-reduced before the square root.
pub fn sum_of_squares(grads: &[f32]) -> f64 {
    let partial: Vec<f64> = grads
        .par_chunks(NORM_CHUNK)
        .map(chunk_sum_of_squares)
        .collect();
    partial.iter().sum()
}

/// One chunk's sum of squares: [`NORM_LANES`] interleaved f64 sums, then the lanes in order.
fn chunk_sum_of_squares(chunk: &[f32]) -> f64 {
    let mut lanes = [0.0f64; NORM_LANES];
    let mut groups = chunk.chunks_exact(NORM_LANES);
    for group in &mut groups {
        for (lane, &g) in lanes.iter_mut().zip(group) {
            let g = f64::from(g);
            *lane += g * g;
        }
    }
    for (lane, &g) in lanes.iter_mut().zip(groups.remainder()) {
        let g = f64::from(g);
        *lane += g * g;
    }
    lanes.iter().sum()
}

/// The L2 norm of `grads`, accumulated in f64 (deterministic, see [`sum_of_squares`]).
/// NaN or infinite gradients give a NaN or infinite norm.
pub fn global_grad_norm(grads: &[f32]) -> f64 {
    sum_of_squares(grads).sqrt()
}

/// The factor `clip_grad_norm` multiplies gradients by for a given pre-clip `norm`:
/// `max_norm / (norm + 1e-6)` when `norm > max_norm`, otherwise `None` (no scaling). Also
/// `None` for a non-finite norm (the caller decides what to do with such a step).
pub fn clip_coefficient(norm: f64, max_norm: f64) -> Option<f64> {
    // Not `f64::max`: that would turn a NaN `max_norm` into 0.
    let max_norm = if max_norm < 0.0 { 0.0 } else { max_norm };
    (norm.is_finite() && norm > max_norm).then(|| max_norm / (norm + 1e-6))
}

/// Clips `grads` in place to total L2 norm `max_norm` and returns the norm before clipping.
///
/// As `torch.nn.utils.clip_grad_norm_`: with `norm > max_norm` every gradient is multiplied by
/// `max_norm / (norm + 1e-6)` (the coefficient is rounded to f32, the product is f32).
/// Otherwise nothing changes (torch multiplies by a clamped coefficient of exactly 1, which
/// is the same). A non-finite norm is returned and the gradients are left unscaled.
/// A negative `max_norm` is treated as 0 (gradients are zeroed when the norm is positive);
/// a NaN `max_norm` never clips.
pub fn clip_grad_norm(grads: &mut [f32], max_norm: f64) -> f64 {
    let norm = global_grad_norm(grads);
    if let Some(coef) = clip_coefficient(norm, max_norm) {
        scale_grads(grads, coef as f32);
    }
    norm
}

/// Multiplies every gradient by `factor` (elementwise, parallel, deterministic).
pub fn scale_grads(grads: &mut [f32], factor: f32) {
    grads
        .par_chunks_mut(NORM_CHUNK)
        .for_each(|chunk| chunk.iter_mut().for_each(|g| *g *= factor));
}
