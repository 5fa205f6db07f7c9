//! tilearn-optim: optimizers over flat parameter buffers, gradient clipping and LR schedules.
//! Usable alone: it takes flat `&mut [f32]` buffers and index ranges, not model types.

pub mod error;

pub use error::{OptimError, Result};
