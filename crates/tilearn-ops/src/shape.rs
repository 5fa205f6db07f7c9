//! The length checks of every op, CPU and CUDA alike. A bad length is an [`OpsError::ShapeMismatch`] naming the
//! op and the argument (`"linear_forward (w)"`), the same variant the CUDA wrappers return, so a
//! caller handles one error whichever backend runs; no op panics on a caller's lengths.
//!
//! Every check runs before an op writes anything, so an op that fails leaves its outputs as they
//! were.

use crate::{OpsError, Result};

/// Fails unless `actual == expected`.
pub(crate) fn expect_len(op: &'static str, expected: usize, actual: usize) -> Result<()> {
    if expected == actual {
        Ok(())
    } else {
        Err(OpsError::ShapeMismatch {
            op,
            expected,
            actual,
        })
    }
}

/// Fails unless `actual` is the product of `dims`. A product that overflows `usize` is reported
/// as expecting `usize::MAX` elements (no slice can hold that many).
pub(crate) fn expect_product(op: &'static str, dims: &[usize], actual: usize) -> Result<()> {
    let expected = dims
        .iter()
        .try_fold(1usize, |acc, &d| acc.checked_mul(d))
        .unwrap_or(usize::MAX);
    expect_len(op, expected, actual)
}

/// The number of rows of `[rows, dim]` data held in `len` elements. A `dim` of 0 is reported as
/// expecting 1 (a row needs at least one element), a `len` that is not whole rows as expecting
/// the next multiple of `dim`: the conventions of the CUDA wrappers.
pub(crate) fn rows_of(op: &'static str, len: usize, dim: usize) -> Result<usize> {
    if dim == 0 {
        return Err(OpsError::ShapeMismatch {
            op,
            expected: 1,
            actual: 0,
        });
    }
    if !len.is_multiple_of(dim) {
        return Err(OpsError::ShapeMismatch {
            op,
            expected: len.div_ceil(dim) * dim,
            actual: len,
        });
    }
    Ok(len / dim)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mismatch(r: Result<impl std::fmt::Debug>) -> (&'static str, usize, usize) {
        match r {
            Err(OpsError::ShapeMismatch {
                op,
                expected,
                actual,
            }) => (op, expected, actual),
            other => panic!("expected a shape mismatch, got {other:?}"),
        }
    }

    #[test]
    fn checks_report_what_was_expected() {
        assert!(expect_len("a", 3, 3).is_ok());
        assert_eq!(mismatch(expect_len("a", 3, 4)), ("a", 3, 4));
        assert!(expect_product("p", &[2, 3, 4], 24).is_ok());
        assert!(expect_product("p", &[], 1).is_ok());
        assert_eq!(mismatch(expect_product("p", &[2, 3], 5)), ("p", 6, 5));
        assert_eq!(
            mismatch(expect_product("p", &[usize::MAX, 2], 0)),
            ("p", usize::MAX, 0)
        );
        assert_eq!(rows_of("r", 12, 4).unwrap(), 3);
        assert_eq!(rows_of("r", 0, 4).unwrap(), 0);
        assert_eq!(mismatch(rows_of("r", 13, 4)), ("r", 16, 13));
        assert_eq!(mismatch(rows_of("r", 8, 0)), ("r", 1, 0));
    }
}
