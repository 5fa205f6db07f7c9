//! Residual addition.
//!
//! Gradient convention: there is no backward op; the gradient of a residual add is the identity,
//! which the model applies by adding (`+=`) branch gradients into the stream with this function.

use rayon::prelude::*;

use super::Real;
use crate::Result;
use crate::shape::expect_len;

const CHUNK: usize = 1 << 14;

/// `acc += x`, element-wise; both have the same length.
pub fn add_inplace<R: Real>(acc: &mut [R], x: &[R]) -> Result<()> {
    expect_len("add_inplace (x)", acc.len(), x.len())?;
    acc.par_chunks_mut(CHUNK)
        .zip(x.par_chunks(CHUNK))
        .for_each(|(a, b)| {
            for (ai, bi) in a.iter_mut().zip(b) {
                *ai += *bi;
            }
        });
    Ok(())
}
