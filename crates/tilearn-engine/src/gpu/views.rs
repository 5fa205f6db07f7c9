//! Disjoint mutable views of one device allocation that keep the allocation's lifetime.
//!
//! cudarc's `CudaViewMut::split_at_mut` borrows the view it splits, so its halves cannot outlive
//! a local: carving one arena into dozens of named buffers inside a function and handing them
//! out is impossible with it alone. [`split_owned`] is the consuming split cudarc lacks; every
//! other helper here is built on it, so the only `unsafe` of the arena lives in one place.

use std::ops::Range;

use cudarc::driver::{CudaView, CudaViewMut};
use tilearn_ops::OpsError;

use crate::error::{EngineError, Result};

/// Splits `view` at `mid` into two disjoint views that live as long as the allocation.
/// Fails (never panics) when `mid > view.len()`.
pub(crate) fn split_owned<'a, T>(
    mut view: CudaViewMut<'a, T>,
    mid: usize,
) -> Result<(CudaViewMut<'a, T>, CudaViewMut<'a, T>)> {
    let len = view.len();
    let Some((head, tail)) = view.try_split_at_mut(mid) else {
        return Err(arena_error(format!(
            "cannot split a view of {len} elements at {mid}"
        )));
    };
    // SAFETY: `head` and `tail` borrow the local `view` only because cudarc's signature ties
    // them to `&mut view`; their fields are copies of `view`'s fields, which point into the
    // allocation borrowed for `'a` (device pointer, length, and `&'a` references to the
    // allocation's events and stream). `view` is consumed by this function and never used
    // again (a `CudaViewMut` has no destructor), and the two halves cover disjoint element
    // ranges, so extending their lifetime to `'a` creates no aliasing mutable access. The
    // transmutes change only the lifetime parameter (same type, same layout).
    let (head, tail) = unsafe {
        (
            std::mem::transmute::<CudaViewMut<'_, T>, CudaViewMut<'a, T>>(head),
            std::mem::transmute::<CudaViewMut<'_, T>, CudaViewMut<'a, T>>(tail),
        )
    };
    Ok((head, tail))
}

/// The sub-view `range` of `view`, consuming it (keeps the allocation's lifetime).
pub(crate) fn sub_mut<'a, T>(
    view: CudaViewMut<'a, T>,
    range: Range<usize>,
) -> Result<CudaViewMut<'a, T>> {
    if range.start > range.end || range.end > view.len() {
        return Err(arena_error(format!(
            "range {range:?} lies outside a view of {} elements",
            view.len()
        )));
    }
    let (_, rest) = split_owned(view, range.start)?;
    let (mid, _) = split_owned(rest, range.end - range.start)?;
    Ok(mid)
}

/// The sub-view `r` of `v`, borrowing it; an error (not a panic) when `r` lies outside.
pub(crate) fn view<'b, T>(v: &'b CudaView<'_, T>, r: Range<usize>) -> Result<CudaView<'b, T>> {
    let len = v.len();
    v.try_slice(r.clone())
        .ok_or_else(|| arena_error(format!("range {r:?} lies outside a view of {len}")))
}

/// [`view`] of a writable view, to read.
pub(crate) fn view_of<'b, T>(
    v: &'b CudaViewMut<'_, T>,
    r: Range<usize>,
) -> Result<CudaView<'b, T>> {
    let len = v.len();
    v.try_slice(r.clone())
        .ok_or_else(|| arena_error(format!("range {r:?} lies outside a view of {len}")))
}

/// [`view`], to write.
pub(crate) fn view_mut<'b, T>(
    v: &'b mut CudaViewMut<'_, T>,
    r: Range<usize>,
) -> Result<CudaViewMut<'b, T>> {
    let len = v.len();
    v.try_slice_mut(r.clone())
        .ok_or_else(|| arena_error(format!("range {r:?} lies outside a view of {len}")))
}

/// Two disjoint sub-views `a` and `b` of `view` (`a` must end before `b` starts, as a weight
/// precedes its bias in the parameter layout).
pub(crate) fn two_mut<'a, T>(
    view: CudaViewMut<'a, T>,
    a: Range<usize>,
    b: Range<usize>,
) -> Result<(CudaViewMut<'a, T>, CudaViewMut<'a, T>)> {
    if a.start > a.end || b.start > b.end || a.end > b.start || b.end > view.len() {
        return Err(arena_error(format!(
            "ranges {a:?} and {b:?} are not ordered, disjoint and within {} elements",
            view.len()
        )));
    }
    let (lo, hi) = split_owned(view, b.start)?;
    Ok((sub_mut(lo, a)?, sub_mut(hi, 0..b.end - b.start)?))
}

/// Hands out consecutive views of one allocation in a fixed order.
pub(crate) struct Carver<'a, T> {
    rest: Option<CudaViewMut<'a, T>>,
}

impl<'a, T> Carver<'a, T> {
    pub(crate) fn new(view: CudaViewMut<'a, T>) -> Self {
        Carver { rest: Some(view) }
    }

    /// The next `len` elements.
    pub(crate) fn take(&mut self, len: usize) -> Result<CudaViewMut<'a, T>> {
        let rest = self
            .rest
            .take()
            .ok_or_else(|| arena_error("carver used after a failed take".to_string()))?;
        let (head, tail) = split_owned(rest, len)?;
        self.rest = Some(tail);
        Ok(head)
    }
}

/// A carving that does not fit: the arena was sized by a different formula than it is carved
/// with (a bug in this module, reported instead of a panic).
pub(crate) fn arena_error(message: String) -> EngineError {
    EngineError::Ops(OpsError::Cuda {
        context: "tilearn_engine::gpu arena",
        message,
    })
}
