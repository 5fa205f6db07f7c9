//! CPU reference implementations of every op, generic over [`Real`] (f32 in training,
//! f64 in the finite-difference tests).
//!
//! Gradient convention for every backward: gradients of *activations* are written (`=`),
//! gradients of *parameters* are accumulated (`+=`).
//!
//! Determinism: every op gives bit-identical results run to run and for any rayon thread
//! count. Matmuls go through `matrixmultiply` (each output element is computed by one thread
//! in a fixed order); other loops are parallel over rows or heads, and every reduction across
//! rows is done in a fixed order (serially, or per fixed block and then blocks in order).
//!
//! Errors: every op checks its lengths before writing anything and returns
//! [`OpsError::ShapeMismatch`](crate::OpsError::ShapeMismatch) naming the op and the argument, as
//! the CUDA wrappers do; none panics on a caller's lengths.

pub mod attention;
pub mod cached_attention;
pub mod cross_entropy;
pub mod embedding;
pub mod gelu;
pub mod layernorm;
pub mod linear;
pub mod real;
pub mod reduce;
pub mod residual;
pub mod rmsnorm;
pub mod rope;
pub mod row_normalize;
pub mod swiglu;
pub mod vocab_slice;
pub mod z_loss;

pub use attention::{
    AttnShape, HostKeyMask, attention_backward, attention_backward_alibi,
    attention_backward_masked, attention_forward, attention_forward_alibi,
    attention_forward_masked,
};
pub use cached_attention::{CachedAttnShape, cached_attention, cached_attention_alibi};
pub use cross_entropy::{CeStats, IGNORE_INDEX, cross_entropy_forward, cross_entropy_fused};
pub use embedding::{check_token_ids, embedding_backward, embedding_forward};
pub use gelu::{GELU_TANH_A, GELU_TANH_C, gelu_tanh_backward, gelu_tanh_forward};
pub use layernorm::{layernorm_backward, layernorm_forward};
pub use linear::{linear_backward, linear_forward};
pub use real::Real;
pub use reduce::{global_norm, unscale_and_check};
pub use residual::add_inplace;
pub use rmsnorm::{rmsnorm_backward, rmsnorm_forward};
pub use rope::{
    RopeScaling, RopeTable, rope_backward, rope_backward_at, rope_forward, rope_forward_at,
    rope_inv_freq,
};
pub use row_normalize::{ROW_NORMALIZE_EPS, row_normalize_backward, row_normalize_forward};
pub use swiglu::{swiglu_backward, swiglu_forward};
pub use vocab_slice::{
    VocabSlice, embedding_backward_slice, embedding_forward_slice, vocab_ce_fused_finish,
    vocab_ce_loss_finish, vocab_ce_partials, vocab_ce_rescale,
};
pub use z_loss::{z_loss_apply, z_loss_rows};
