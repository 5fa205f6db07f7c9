//! Token embedding lookup.
//!
//! Gradient convention: `embedding_backward` *accumulates* into `dtable` (`+=`), since the table
//! is a parameter (and, with tied embeddings, also receives the lm_head gradient).

use rayon::prelude::*;

use super::Real;
use crate::shape::{expect_product, rows_of};
use crate::{OpsError, Result};

/// Fails with [`OpsError::TokenOutOfRange`] naming the first id `>= vocab` (and its position).
/// The CPU lookup and the GPU engine's upload both check with it before touching anything.
pub fn check_token_ids(ids: &[u32], vocab: usize) -> Result<()> {
    match ids.iter().position(|&id| id as usize >= vocab) {
        Some(position) => Err(OpsError::TokenOutOfRange {
            id: ids[position],
            position,
            vocab,
        }),
        None => Ok(()),
    }
}

/// `out[r, :] = table[ids[r], :]`. `table` is `[vocab, dim]`, `out` is `[ids.len(), dim]`.
///
/// Every id is checked before anything is written: an id `>= vocab` returns
/// [`OpsError::TokenOutOfRange`] and leaves `out` untouched.
pub fn embedding_forward<R: Real>(
    ids: &[u32],
    table: &[R],
    dim: usize,
    out: &mut [R],
) -> Result<()> {
    let vocab = rows_of("embedding_forward (table)", table.len(), dim)?;
    expect_product("embedding_forward (out)", &[ids.len(), dim], out.len())?;
    check_token_ids(ids, vocab)?;
    out.par_chunks_mut(dim)
        .with_min_len(16)
        .zip(ids.par_iter())
        .for_each(|(row, &id)| {
            let id = id as usize;
            row.copy_from_slice(&table[id * dim..(id + 1) * dim]);
        });
    Ok(())
}

/// `dtable[ids[r], :] += dout[r, :]` for every row `r`, in row order. `dtable` is
/// `[vocab, dim]`, `dout` `[ids.len(), dim]`.
///
/// Rows are added serially in order (two rows may hit the same id), so the result is
/// bit-reproducible. Lengths and ids are checked before anything is added, as in the forward.
pub fn embedding_backward<R: Real>(
    ids: &[u32],
    dout: &[R],
    dim: usize,
    dtable: &mut [R],
) -> Result<()> {
    let vocab = rows_of("embedding_backward (dtable)", dtable.len(), dim)?;
    expect_product("embedding_backward (dout)", &[ids.len(), dim], dout.len())?;
    check_token_ids(ids, vocab)?;
    for (r, &id) in ids.iter().enumerate() {
        let id = id as usize;
        let src = &dout[r * dim..(r + 1) * dim];
        for (d, s) in dtable[id * dim..(id + 1) * dim].iter_mut().zip(src) {
            *d += *s;
        }
    }
    Ok(())
}
