//! tilearn-kernels: the CUDA kernels of the workspace and nothing else.
//!
//! `kernels/*.cu` (with `kernels/include/`) are compiled by this crate's `build.rs` with nvcc
//! when the `cuda` feature is on, and [`ffi`] declares their `extern "C"` launchers (generated
//! from `kernels/include/tilearn_kernels.h` by `cargo xtask build-kernels`, committed). The safe,
//! typed wrappers live with their users: the model ops in `tilearn_ops::cuda`, the fused
//! optimizers in `tilearn_optim::cuda`. Without the `cuda` feature the crate is empty.
//!
//! Every `.cu` file opens with a comment that states what the kernel fuses, its memory layout,
//! its precision and what it writes (`=`) or accumulates (`+=`); `cargo xtask build-kernels`
//! refuses a file without it.

#[cfg(feature = "cuda")]
#[allow(
    non_camel_case_types,
    non_snake_case,
    non_upper_case_globals,
    dead_code,
    clippy::all
)]
/// The raw `extern "C"` launchers of `kernels/*.cu` (generated from the header).
pub mod ffi;

#[cfg(feature = "cuda")]
mod status;

#[cfg(feature = "cuda")]
pub use status::status_message;
