//! Wrappers of tilearn-kernels' `rope.cu`: rotary position embedding (Hugging Face `rotate_half`
//! convention: element `i` of a head pairs with `i + head_dim/2`), in place on `[batch, seq,
//! heads, head_dim]`, for every [`DeviceFloat`] (f32, bf16, f16) with f32 arithmetic and f32
//! cos/sin tables. Same contract as [`crate::cpu::rope_forward`] / [`crate::cpu::rope_backward`];
//! the backward rewrites the gradient in place (`=`) with the inverse rotation.

use std::ffi::{c_int, c_void};
use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut};
use tilearn_kernels::ffi;

use super::dtype::DeviceFloat;
use super::launch::Launch;
use crate::cpu::RopeTable;
use crate::shape::expect_len;
use crate::{OpsError, Result};

/// The signature shared by `tilearn_rope_forward` (rotation by +angle) and
/// `tilearn_rope_backward` (by -angle).
type Launcher = unsafe extern "C" fn(
    c_int,
    *mut c_void,
    *const f32,
    *const f32,
    *const i32,
    usize,
    usize,
    usize,
    usize,
    usize,
    ffi::cudaStream_t,
) -> c_int;

/// A [`RopeTable`] on the device: `cos` and `sin`, `[seq_len, half_dim]` row-major, computed on
/// the host in f64 (with the config's `rope_scaling`) and rounded to f32 once at upload.
#[derive(Debug)]
pub struct GpuRopeTable {
    half_dim: usize,
    seq_len: usize,
    cos: CudaSlice<f32>,
    sin: CudaSlice<f32>,
}

impl GpuRopeTable {
    /// Copies `table` to the device of `stream` (the copy is ordered on `stream`).
    pub fn upload(stream: &Arc<CudaStream>, table: &RopeTable) -> Result<Self> {
        let op = "GpuRopeTable::upload";
        let len = table.seq_len * table.half_dim;
        expect_len(op, len, table.cos.len())?;
        expect_len(op, len, table.sin.len())?;
        let to_f32 = |v: &[f64]| -> Vec<f32> { v.iter().map(|&x| x as f32).collect() };
        let copy = |host: Vec<f32>| {
            stream.clone_htod(&host).map_err(|e| OpsError::Cuda {
                context: op,
                message: format!("cannot copy a {len}-element table to the device: {e}"),
            })
        };
        Ok(GpuRopeTable {
            half_dim: table.half_dim,
            seq_len: table.seq_len,
            cos: copy(to_f32(&table.cos))?,
            sin: copy(to_f32(&table.sin))?,
        })
    }

    /// `head_dim / 2` of the heads this table rotates.
    pub fn half_dim(&self) -> usize {
        self.half_dim
    }

    /// Number of positions (rows) in the table: the longest sequence it can rotate.
    pub fn seq_len(&self) -> usize {
        self.seq_len
    }
}

/// Checks `(batch, seq, heads, head_dim)` against the table; returns the element count of `x`.
fn check_shape(
    op: &'static str,
    batch: usize,
    seq: usize,
    heads: usize,
    head_dim: usize,
    table: &GpuRopeTable,
) -> Result<usize> {
    let invalid = |message: String| OpsError::Cuda {
        context: op,
        message,
    };
    if head_dim != 2 * table.half_dim {
        return Err(invalid(format!(
            "head_dim {head_dim} does not match the table (half_dim {}, so head_dim {})",
            table.half_dim,
            2 * table.half_dim
        )));
    }
    if seq > table.seq_len {
        return Err(invalid(format!(
            "seq {seq} exceeds the table's {} positions (build the RopeTable for the longest \
             sequence)",
            table.seq_len
        )));
    }
    batch
        .checked_mul(seq)
        .and_then(|v| v.checked_mul(heads))
        .and_then(|v| v.checked_mul(head_dim))
        .ok_or_else(|| {
            invalid(format!(
                "shape [{batch}, {seq}, {heads}, {head_dim}] overflows usize"
            ))
        })
}

/// One launch of `launcher` over `x` with the tables read from row `first_row` on (the rows a
/// chunk of generated tokens starts at; 0 otherwise) and optional per-token `positions` into
/// those rows. Callers check `first_row + seq <= table.seq_len`.
#[allow(clippy::too_many_arguments)]
fn rotate<T: DeviceFloat, P: DevicePtr<i32>>(
    op: &'static str,
    launcher: Launcher,
    stream: &Arc<CudaStream>,
    x: &mut impl DevicePtrMut<T>,
    (batch, seq, heads, head_dim): (usize, usize, usize, usize),
    table: &GpuRopeTable,
    first_row: usize,
    positions: Option<&P>,
) -> Result<()> {
    let elems = check_shape(op, batch, seq, heads, head_dim, table)?;
    let rows = table.seq_len - first_row;
    // `upload` built both tables with exactly seq_len * half_dim elements.
    let from = first_row * table.half_dim;
    let (cos, sin) = (table.cos.slice(from..), table.sin.slice(from..));
    let table_len = rows * table.half_dim;
    Launch::new(op, stream)
        .output("x", x, elems)
        .input("table.cos", &cos, table_len)
        .input("table.sin", &sin, table_len)
        .optional_input("positions", positions, batch * seq)
        .skip_launch_if(elems == 0)
        .run(|[cos, sin, positions], [x], stream| {
            // SAFETY: the launcher rewrites batch * seq * heads * head_dim elements of T
            // (`T::DTYPE`) of x in place, reads batch * seq positions when not null (clamping
            // each to the rows given) and rows t < rows of the [rows, head_dim / 2] f32 tables
            // starting at row first_row (head_dim == 2 * half_dim checked; first_row + seq <=
            // table.seq_len checked by the callers, first_row = 0 where positions are given).
            unsafe {
                launcher(
                    T::DTYPE,
                    x,
                    cos.cast(),
                    sin.cast(),
                    positions.cast(),
                    batch,
                    seq,
                    heads,
                    head_dim,
                    rows,
                    stream,
                )
            }
        })
}

/// Rotates `x` (`[batch, seq, heads, head_dim]`) in place (`=`); position `t` uses row `t` of
/// `table`, `head_dim` must be `2 * table.half_dim()` and `seq <= table.seq_len()`.
///
/// Precision: f32 arithmetic with the f32 tables; each element rounded once to `T`.
pub fn rope_forward<T: DeviceFloat>(
    stream: &Arc<CudaStream>,
    x: &mut impl DevicePtrMut<T>,
    batch: usize,
    seq: usize,
    heads: usize,
    head_dim: usize,
    table: &GpuRopeTable,
) -> Result<()> {
    rope_forward_at::<T, CudaSlice<i32>>(stream, x, batch, seq, heads, head_dim, table, None)
}

/// [`rope_forward`] with explicit `positions` (`[batch, seq]` i32, e.g. restarting at 0 for
/// each packed example; each `< table.seq_len()`, which the caller checks: the kernel clamps a
/// bad one to the table instead of reading past it), or the row index without.
#[allow(clippy::too_many_arguments)]
pub fn rope_forward_at<T: DeviceFloat, P: DevicePtr<i32>>(
    stream: &Arc<CudaStream>,
    x: &mut impl DevicePtrMut<T>,
    batch: usize,
    seq: usize,
    heads: usize,
    head_dim: usize,
    table: &GpuRopeTable,
    positions: Option<&P>,
) -> Result<()> {
    rotate(
        "tilearn_rope_forward",
        ffi::tilearn_rope_forward,
        stream,
        x,
        (batch, seq, heads, head_dim),
        table,
        0,
        positions,
    )
}

/// Rotates `x` (`[seq, heads, head_dim]`, one sequence) in place (`=`) as the positions
/// `first_position..first_position + seq`: row `t` uses row `first_position + t` of `table`,
/// which must hold them. For generation, whose new tokens sit after the cached ones; the same
/// kernel and precision as [`rope_forward`] (the tables are read from row `first_position` on).
pub fn rope_forward_from<T: DeviceFloat>(
    stream: &Arc<CudaStream>,
    x: &mut impl DevicePtrMut<T>,
    seq: usize,
    heads: usize,
    head_dim: usize,
    table: &GpuRopeTable,
    first_position: usize,
) -> Result<()> {
    const OP: &str = "tilearn_rope_forward (at a position)";
    let end = first_position.checked_add(seq);
    if end.is_none_or(|end| end > table.seq_len) {
        return Err(OpsError::Cuda {
            context: OP,
            message: format!(
                "positions {first_position}..{first_position}+{seq} exceed the table's {} \
                 positions (build the RopeTable for the longest sequence)",
                table.seq_len
            ),
        });
    }
    rotate::<T, CudaSlice<i32>>(
        OP,
        ffi::tilearn_rope_forward,
        stream,
        x,
        (1, seq, heads, head_dim),
        table,
        first_position,
        None,
    )
}

/// Backward of [`rope_forward`], in place (`dx` replaces `dy`): `dx = Rᵀ · dy`, the rotation by
/// the opposite angle. Same shape rules and precision as the forward.
pub fn rope_backward<T: DeviceFloat>(
    stream: &Arc<CudaStream>,
    dx: &mut impl DevicePtrMut<T>,
    batch: usize,
    seq: usize,
    heads: usize,
    head_dim: usize,
    table: &GpuRopeTable,
) -> Result<()> {
    rope_backward_at::<T, CudaSlice<i32>>(stream, dx, batch, seq, heads, head_dim, table, None)
}

/// [`rope_backward`] with the forward's `positions` (see [`rope_forward_at`]).
#[allow(clippy::too_many_arguments)]
pub fn rope_backward_at<T: DeviceFloat, P: DevicePtr<i32>>(
    stream: &Arc<CudaStream>,
    dx: &mut impl DevicePtrMut<T>,
    batch: usize,
    seq: usize,
    heads: usize,
    head_dim: usize,
    table: &GpuRopeTable,
    positions: Option<&P>,
) -> Result<()> {
    rotate(
        "tilearn_rope_backward",
        ffi::tilearn_rope_backward,
        stream,
        dx,
        (batch, seq, heads, head_dim),
        table,
        0,
        positions,
    )
}
