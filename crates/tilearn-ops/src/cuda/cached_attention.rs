//! Wrapper of tilearn-kernels' `cached_attention.cu`: causal grouped-query attention of `n` new
//! queries against a key/value cache (generation), for every [`DeviceFloat`] with f32
//! arithmetic. Same contract as [`crate::cpu::cached_attention`] (and, with slopes,
//! [`crate::cpu::cached_attention_alibi`]); `out` is written (`=`).

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut};
use tilearn_kernels::ffi;

use super::dtype::DeviceFloat;
use super::launch::Launch;
use crate::cpu::CachedAttnShape;
use crate::{OpsError, Result};

/// Largest head size the kernel serves (8 elements per lane of a warp).
pub const CACHED_ATTENTION_MAX_HEAD_DIM: usize = 256;

/// `out[i, h, :] = softmax_j(q[i,h]·k[j,g] / sqrt(head_dim)) v[j,g]` over `j <= start + i`:
/// `q`/`out` `[n, q_heads, head_dim]`, `k`/`v` caches `[positions, kv_heads, head_dim]` holding
/// at least `start + n` positions (longer caches are fine: only those are read).
///
/// Precision: scores, softmax and the weighted sum in f32 (an online softmax per warp, merged
/// in a fixed order); each output rounded once to `T`.
pub fn cached_attention_forward<T: DeviceFloat>(
    stream: &Arc<CudaStream>,
    shape: CachedAttnShape,
    q: &impl DevicePtr<T>,
    k: &impl DevicePtr<T>,
    v: &impl DevicePtr<T>,
    out: &mut impl DevicePtrMut<T>,
) -> Result<()> {
    cached_attention_alibi_forward(stream, shape, None::<&CudaSlice<f32>>, q, k, v, out)
}

/// [`cached_attention_forward`] with ALiBi: `alibi` holds `q_heads` f32 slopes and head `h`
/// adds `alibi[h] · (j − (start + i))` to its scaled scores (`None`: no bias, the same bits).
pub fn cached_attention_alibi_forward<T: DeviceFloat, A: DevicePtr<f32>>(
    stream: &Arc<CudaStream>,
    shape: CachedAttnShape,
    alibi: Option<&A>,
    q: &impl DevicePtr<T>,
    k: &impl DevicePtr<T>,
    v: &impl DevicePtr<T>,
    out: &mut impl DevicePtrMut<T>,
) -> Result<()> {
    const OP: &str = "tilearn_cached_attention";
    shape.check()?;
    let invalid = |message: String| OpsError::Cuda {
        context: OP,
        message,
    };
    if shape.head_dim > CACHED_ATTENTION_MAX_HEAD_DIM {
        return Err(invalid(format!(
            "head_dim {} exceeds the kernel's {CACHED_ATTENTION_MAX_HEAD_DIM}",
            shape.head_dim
        )));
    }
    if shape.n > 65535 {
        return Err(invalid(format!(
            "{} new queries in one call exceed 65535; feed the prompt in chunks",
            shape.n
        )));
    }
    for (name, len) in [("k", k.len()), ("v", v.len())] {
        if len < shape.kv_len() {
            return Err(invalid(format!(
                "the {name} cache holds {len} elements, fewer than the {} of start + n = {} \
                 positions",
                shape.kv_len(),
                shape.start + shape.n
            )));
        }
    }
    let scale = 1.0 / (shape.head_dim as f32).sqrt();
    Launch::new(OP, stream)
        .input("q", q, shape.q_len())
        .input("k", k, k.len())
        .input("v", v, v.len())
        .optional_input("alibi_slopes", alibi, shape.q_heads)
        .output("out", out, shape.q_len())
        .skip_launch_if(shape.q_len() == 0)
        .run(|[q, k, v, slopes], [out], stream| {
            // SAFETY: the launcher reads n * q_heads * head_dim elements of T (`T::DTYPE`) from
            // q, at most (start + n) * kv_heads * head_dim (= kv_len <= their lengths, checked
            // above) from k and v, q_heads f32 slopes when given (null otherwise), and writes
            // n * q_heads * head_dim to out; the shape limits
            // the kernel needs (head_dim, n, the head grouping) were checked above.
            unsafe {
                ffi::tilearn_cached_attention(
                    T::DTYPE,
                    q,
                    k,
                    v,
                    out,
                    shape.n,
                    shape.start,
                    shape.q_heads,
                    shape.kv_heads,
                    shape.head_dim,
                    scale,
                    slopes.cast(),
                    stream,
                )
            }
        })
}
