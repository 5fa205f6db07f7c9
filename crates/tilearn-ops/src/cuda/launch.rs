//! What every launcher wrapper does before and after the FFI call: check that buffers have
//! their lengths and live on the stream's device, make the context current, hold the
//! stream-order guards, and turn the returned status into an error. [`Launch`] does all of it
//! for one call; the free functions are its pieces, for the few calls that are not one launch
//! over checked buffers (cuBLASLt products, size queries, host reads).
//!
//! The builder follows cudarc's `launch_builder().arg()` (each buffer argument takes its
//! `device_ptr` guard, kept until the launch is enqueued), with two differences for
//! `extern "C"` launchers: the buffers are registered with their expected lengths and checked
//! before anything touches the stream, and the launcher call itself is a closure that receives
//! the raw pointers.
//!
//! Public (`tilearn_ops::cuda::launch`) so that crates with their own kernels (tilearn-recsys)
//! wrap them the same way; the free helpers stay private to tilearn-ops.

use std::ffi::{c_int, c_void};

use cudarc::driver::sys::CUdeviceptr;
use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut, DeviceSlice, SyncOnDrop};
use tilearn_kernels::ffi;

use crate::shape::expect_len;
use crate::{OpsError, Result};

/// Yields one operand's device address on the launch stream and the guard that orders the
/// launch after earlier users of the buffer and before later ones (`device_ptr` /
/// `device_ptr_mut`, taken only once every check has passed).
type Pointer<'a> = Box<dyn FnOnce(&'a CudaStream) -> (CUdeviceptr, SyncOnDrop<'a>) + 'a>;

/// One call of an `extern "C"` launcher over device buffers:
///
/// ```ignore
/// Launch::new("tilearn_residual_add", stream)
///     .input("a", a, n)
///     .input("b", b, n)
///     .output("out", out, n)
///     .skip_launch_if(n == 0)
///     .run(|[a, b], [out], stream| {
///         // SAFETY: the launcher reads n elements of T (T::DTYPE) from a and b, writes n to out.
///         unsafe { ffi::tilearn_residual_add(T::DTYPE, a, b, out, n, stream) }
///     })
/// ```
///
/// [`run`](Self::run) first reports the first length mismatch
/// ([`OpsError::ShapeMismatch`], in registration order), then the first buffer on another
/// device ([`OpsError::Cuda`] naming it); then, unless [`skip_launch_if`](Self::skip_launch_if)
/// was true, it makes the context current, takes every buffer's pointer and guard, calls the
/// closure with the inputs' and outputs' pointers (in registration order) and the raw stream,
/// and maps the returned `cudaError_t` with [`check`]. The guards are dropped after the closure
/// returns.
///
/// What the builder guarantees to the closure, so that a call site's `// SAFETY:` only states
/// what its launcher reads and writes:
/// * every pointer is the address of a live allocation of the stream's context holding exactly
///   the registered number of elements of the registered type (a [`workspace`](Self::workspace)
///   any number, which the call site states);
/// * outputs come from `&mut` borrows, so no output overlaps another operand;
/// * the stream's context is current on this thread (the runtime API in the launcher uses it);
/// * the stream waited for earlier writers (for outputs, also readers) of every buffer, the
///   buffers stay borrowed until the guards record the launch, and cudarc frees device memory
///   stream-ordered, so the work the launcher enqueues on the stream sees live, ordered buffers.
#[must_use = "a Launch does nothing until `run`"]
pub struct Launch<'a> {
    op: &'static str,
    stream: &'a CudaStream,
    inputs: Vec<Pointer<'a>>,
    outputs: Vec<Pointer<'a>>,
    /// The first length mismatch and the first buffer on another device, in registration order.
    len_error: Option<OpsError>,
    device_error: Option<OpsError>,
    skip_launch: bool,
}

impl<'a> Launch<'a> {
    /// A launch of the launcher `op` (the name errors carry) on `stream`.
    pub fn new(op: &'static str, stream: &'a CudaStream) -> Self {
        Launch {
            op,
            stream,
            inputs: Vec::with_capacity(8),
            outputs: Vec::with_capacity(4),
            len_error: None,
            device_error: None,
            skip_launch: false,
        }
    }

    /// A buffer the launcher reads: `len` elements of `T`, named `name` in errors.
    pub fn input<T, P>(mut self, name: &'static str, buf: &'a P, len: usize) -> Self
    where
        P: DevicePtr<T> + ?Sized,
    {
        self.check(name, buf, Some(len));
        self.inputs
            .push(Box::new(move |stream| buf.device_ptr(stream)));
        self
    }

    /// A buffer the launcher reads when present (`len` elements of `T`); `None` passes a null
    /// pointer, which the launcher must accept for this operand.
    pub fn optional_input<T, P>(self, name: &'static str, buf: Option<&'a P>, len: usize) -> Self
    where
        P: DevicePtr<T> + ?Sized,
    {
        match buf {
            Some(buf) => self.input(name, buf, len),
            None => {
                let mut this = self;
                this.inputs.push(Box::new(|_| (0, SyncOnDrop::Sync(None))));
                this
            }
        }
    }

    /// A buffer the launcher writes (or reads and writes): `len` elements of `T`.
    pub fn output<T, P>(mut self, name: &'static str, buf: &'a mut P, len: usize) -> Self
    where
        P: DevicePtrMut<T> + ?Sized,
    {
        self.check(name, buf, Some(len));
        self.outputs
            .push(Box::new(move |stream| buf.device_ptr_mut(stream)));
        self
    }

    /// Scratch the launcher writes, of any length: the call site checks (or the launcher
    /// checks and reports) that it is large enough. Passed among the outputs.
    pub fn workspace<T, P>(mut self, name: &'static str, buf: &'a mut P) -> Self
    where
        P: DevicePtrMut<T> + ?Sized,
    {
        self.check(name, buf, None);
        self.outputs
            .push(Box::new(move |stream| buf.device_ptr_mut(stream)));
        self
    }

    /// After the checks, launch nothing and return `Ok` when `nothing_to_do` (empty tensors).
    pub fn skip_launch_if(mut self, nothing_to_do: bool) -> Self {
        self.skip_launch = nothing_to_do;
        self
    }

    /// Runs the checks, then calls `launcher` (one `extern "C"` launcher call) with the inputs'
    /// and outputs' pointers and the raw stream, and maps the status it returns.
    pub fn run<const I: usize, const O: usize>(
        self,
        launcher: impl FnOnce([*const c_void; I], [*mut c_void; O], ffi::cudaStream_t) -> c_int,
    ) -> Result<()> {
        let op = self.op;
        self.run_steps(|inputs, outputs, stream| check(op, launcher(inputs, outputs, stream)))
    }

    /// [`run`](Self::run) for a body of several launches (each mapped with [`check`] by the
    /// body); the guards are held until the body returns.
    pub fn run_steps<const I: usize, const O: usize>(
        self,
        steps: impl FnOnce([*const c_void; I], [*mut c_void; O], ffi::cudaStream_t) -> Result<()>,
    ) -> Result<()> {
        let Launch {
            op,
            stream,
            inputs,
            outputs,
            len_error,
            device_error,
            skip_launch,
        } = self;
        let arity = |what: &str, registered: usize, taken: usize| OpsError::Cuda {
            context: op,
            message: format!(
                "internal error: {registered} {what} registered but the launch body takes {taken}"
            ),
        };
        if inputs.len() != I {
            return Err(arity("inputs", inputs.len(), I));
        }
        if outputs.len() != O {
            return Err(arity("outputs", outputs.len(), O));
        }
        if let Some(e) = len_error.or(device_error) {
            return Err(e);
        }
        if skip_launch {
            return Ok(());
        }
        bind(stream, op)?;
        let mut guards = Vec::with_capacity(I + O);
        let mut pointer = |operand: Pointer<'a>| {
            let (ptr, guard) = operand(stream);
            guards.push(guard);
            ptr
        };
        let inputs: Vec<*const c_void> = inputs
            .into_iter()
            .map(|p| pointer(p) as *const c_void)
            .collect();
        let outputs: Vec<*mut c_void> = outputs
            .into_iter()
            .map(|p| pointer(p) as *mut c_void)
            .collect();
        let inputs: [*const c_void; I] = inputs
            .try_into()
            .map_err(|v: Vec<_>| arity("inputs", v.len(), I))?;
        let outputs: [*mut c_void; O] = outputs
            .try_into()
            .map_err(|v: Vec<_>| arity("outputs", v.len(), O))?;
        let result = steps(inputs, outputs, raw_stream(stream));
        // The guards record the enqueued work on drop: later users of the buffers wait for it.
        drop(guards);
        result
    }

    fn check<T, P>(&mut self, name: &'static str, buf: &P, len: Option<usize>)
    where
        P: DeviceSlice<T> + ?Sized,
    {
        if self.len_error.is_none()
            && let Some(len) = len
        {
            self.len_error = expect_len(self.op, len, buf.len()).err();
        }
        if self.device_error.is_none() {
            self.device_error = same_device(self.stream, self.op, name, buf).err();
        }
    }
}

/// The runtime's stream handle for a cudarc stream. The driver's `CUstream` and the runtime's
/// `cudaStream_t` are the same handle (CUDA documents them as interchangeable).
pub(super) fn raw_stream(stream: &CudaStream) -> ffi::cudaStream_t {
    stream.cu_stream() as ffi::cudaStream_t
}

/// Makes the stream's context current on this thread, so the runtime API inside the launcher
/// uses it (the runtime picks up a driver context that is current; cudarc's is the primary one).
pub fn bind(stream: &CudaStream, op: &'static str) -> Result<()> {
    stream
        .context()
        .bind_to_thread()
        .map_err(|e| OpsError::Cuda {
            context: op,
            message: format!("cannot make the device context current: {e}"),
        })
}

/// Fails unless `buf` was allocated on the same device (context) as `stream`.
pub(super) fn same_device<T>(
    stream: &CudaStream,
    op: &'static str,
    what: &str,
    buf: &(impl DeviceSlice<T> + ?Sized),
) -> Result<()> {
    if **buf.stream().context() == **stream.context() {
        Ok(())
    } else {
        Err(OpsError::Cuda {
            context: op,
            message: format!(
                "`{what}` lives on device {} but the launch stream is on device {}",
                buf.stream().context().ordinal(),
                stream.context().ordinal()
            ),
        })
    }
}

/// Turns a launcher's return value (a `cudaError_t`) into a result.
pub(super) fn check(op: &'static str, status: c_int) -> Result<()> {
    match tilearn_kernels::status_message(status) {
        None => Ok(()),
        Some(message) => Err(OpsError::Cuda {
            context: op,
            message,
        }),
    }
}
