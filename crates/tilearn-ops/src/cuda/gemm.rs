//! Matrix products on cuBLASLt: the [`Gemm`] handle (one per stream), a safe strided-batched
//! row-major matmul ([`Gemm::matmul`]) and the linear layer built on it ([`linear_forward`],
//! [`linear_backward`], generic over the element type [`DeviceFloat`]: f32, bf16 or f16), with
//! the contract of [`crate::cpu::linear_forward`] / [`crate::cpu::linear_backward`]:
//! `out = x·Wᵀ + b`, `dx` written (`=`), `dW` and `db` accumulated (`+=`, always f32).
//!
//! Precision: compute type `CUBLAS_COMPUTE_32F` everywhere (f32 accumulation, f32 alpha/beta).
//! For f32 inputs that means *no TF32*: TF32 rounds the inputs to 10 mantissa bits (~1e-3
//! relative), which would break the 1e-5 parity of the f32 path with the CPU reference;
//! cuBLASLt only uses TF32 when asked for `CUBLAS_COMPUTE_32F_FAST_TF32`. bf16 and f16 inputs
//! (`CUDA_R_16BF` / `CUDA_R_16F`) are multiplied exactly and summed in f32; the output is
//! rounded once to the input type, or kept f32 (the weight gradient).
//!
//! cuBLASLt is column-major; a row-major `C[m,n] = op(A)[m,k]·op(B)[k,n]` is the column-major
//! `Cᵀ[n,m] = op(B)ᵀ·op(A)ᵀ`, so [`Gemm::matmul`] swaps the operands and keeps the transpose
//! flags (a row-major matrix read column-major is its transpose). The linear forward is then the
//! "TN" product cuBLASLt is fastest at, and its bias goes through the `BIAS` epilogue (added
//! in f32 inside the GEMM, no extra pass).
//!
//! Algorithm choice: the first call of each problem (shape, types, transposes, strides,
//! pointer alignment, epilogue) asks cuBLASLt's heuristic for its best algorithm and caches it,
//! so later calls spend no host time on the search and — since the algorithm is fixed — give
//! bit-identical results from run to run.

use std::cell::RefCell;
use std::collections::HashMap;
use std::ffi::c_void;
use std::mem::size_of;
use std::sync::Arc;

use cudarc::cublaslt::result as lt;
use cudarc::cublaslt::sys;
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut};
use tilearn_kernels::ffi;

use super::DeviceFloat;
use super::launch::{bind, check, raw_stream, same_device};
use crate::shape::expect_len;
use crate::{OpsError, Result};

/// Bytes of the cuBLASLt workspace every [`Gemm`] allocates once: NVIDIA's recommendation for
/// Hopper (enough for split-K and stream-K algorithms); older GPUs use part of it.
pub const GEMM_WORKSPACE_BYTES: usize = 32 << 20;

/// Whether an operand enters the product as stored or transposed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Transpose {
    No,
    Yes,
}

/// One input of a row-major matmul: a row-major matrix with `ld` elements between consecutive
/// rows, used as stored ([`Transpose::No`]) or transposed; in a batch, matrix `i` starts
/// `i * batch_stride` elements after the first (0: every batch entry reads the same matrix).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Operand {
    pub transpose: Transpose,
    pub ld: usize,
    pub batch_stride: usize,
}

impl Operand {
    /// Used as stored, leading dimension `ld`, no batch stride.
    pub fn plain(ld: usize) -> Operand {
        Operand {
            transpose: Transpose::No,
            ld,
            batch_stride: 0,
        }
    }

    /// Used transposed, leading dimension `ld` (of the stored matrix), no batch stride.
    pub fn transposed(ld: usize) -> Operand {
        Operand {
            transpose: Transpose::Yes,
            ld,
            batch_stride: 0,
        }
    }

    /// The same operand with batch stride `stride` (elements).
    pub fn strided(self, stride: usize) -> Operand {
        Operand {
            batch_stride: stride,
            ..self
        }
    }

    /// (rows, cols) of the stored matrix when `op(X)` is `rows_op × cols_op`.
    fn stored_dims(&self, rows_op: usize, cols_op: usize) -> (usize, usize) {
        match self.transpose {
            Transpose::No => (rows_op, cols_op),
            Transpose::Yes => (cols_op, rows_op),
        }
    }
}

/// A strided-batched row-major matmul: for `i < batch`,
/// `C_i[m,n] = alpha · op(A_i)[m,k] · op(B_i)[k,n] + beta · C_i` (with `beta == 0`, `C` is not
/// read, so it may hold garbage or NaN). `C_i` has leading dimension `c_ld` and starts
/// `i * c_batch_stride` elements after `C_0`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MatmulSpec {
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub batch: usize,
    pub a: Operand,
    pub b: Operand,
    pub c_ld: usize,
    pub c_batch_stride: usize,
    pub alpha: f32,
    pub beta: f32,
}

impl MatmulSpec {
    /// A single (unbatched) product with `alpha = 1`, `beta = 0` and a dense `C` (`c_ld = n`).
    pub fn new(m: usize, n: usize, k: usize, a: Operand, b: Operand) -> MatmulSpec {
        MatmulSpec {
            m,
            n,
            k,
            batch: 1,
            a,
            b,
            c_ld: n,
            c_batch_stride: 0,
            alpha: 1.0,
            beta: 0.0,
        }
    }

    /// Checks the spec and returns the element counts `(a, b, c)` the buffers must hold at least.
    pub(super) fn required_lens(&self, op: &'static str) -> Result<(usize, usize, usize)> {
        let bad = |message: String| OpsError::Cuda {
            context: op,
            message,
        };
        if self.m == 0 || self.n == 0 || self.k == 0 || self.batch == 0 {
            return Err(bad(format!(
                "matmul dimensions must be positive, got m={} n={} k={} batch={}",
                self.m, self.n, self.k, self.batch
            )));
        }
        if i32::try_from(self.batch).is_err() {
            return Err(bad(format!("batch {} exceeds i32::MAX", self.batch)));
        }
        if !self.alpha.is_finite() || !self.beta.is_finite() {
            return Err(bad(format!(
                "alpha ({}) and beta ({}) must be finite",
                self.alpha, self.beta
            )));
        }
        let extent = |name: &str, rows: usize, cols: usize, ld: usize, stride: usize| {
            if ld < cols {
                return Err(bad(format!(
                    "{name}: leading dimension {ld} is smaller than its {cols} columns"
                )));
            }
            // (batch - 1) * stride + (rows - 1) * ld + cols, overflow-checked.
            (self.batch - 1)
                .checked_mul(stride)
                .and_then(|s| (rows - 1).checked_mul(ld).and_then(|r| r.checked_add(s)))
                .and_then(|x| x.checked_add(cols))
                .filter(|&x| i64::try_from(x).is_ok())
                .ok_or_else(|| bad(format!("{name}: extent overflows")))
        };
        let (ar, ac) = self.a.stored_dims(self.m, self.k);
        let (br, bc) = self.b.stored_dims(self.k, self.n);
        let a = extent("A", ar, ac, self.a.ld, self.a.batch_stride)?;
        let b = extent("B", br, bc, self.b.ld, self.b.batch_stride)?;
        let c = extent("C", self.m, self.n, self.c_ld, self.c_batch_stride)?;
        // Distinct batch entries of C must not overlap, or concurrent writes race.
        if self.batch > 1 && self.c_batch_stride < (self.m - 1) * self.c_ld + self.n {
            return Err(bad(format!(
                "C: batch stride {} is smaller than one {}x{} matrix (ld {}): entries overlap",
                self.c_batch_stride, self.m, self.n, self.c_ld
            )));
        }
        Ok((a, b, c))
    }
}

/// What cuBLASLt applies after the product.
#[derive(Clone, Copy, Debug)]
pub(super) enum Epilogue {
    None,
    /// `D[:, j] += bias[j]` per output column (row-major view), `bias` a device pointer of
    /// the output type.
    Bias(u64),
}

/// Everything the algorithm heuristic looks at; the cache key.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct AlgoKey {
    a_type: u32,
    c_type: u32,
    m: usize,
    n: usize,
    k: usize,
    batch: usize,
    a: (Transpose, usize, usize),
    b: (Transpose, usize, usize),
    c: (usize, usize),
    bias: bool,
    beta_zero: bool,
    align: [u32; 4],
}

/// A cuBLASLt handle bound to one stream, with its workspace (allocated once) and the cache of
/// chosen algorithms. Every product it runs is ordered on [`stream`](Self::stream).
#[derive(Debug)]
pub struct Gemm {
    handle: sys::cublasLtHandle_t,
    workspace: CudaSlice<u8>,
    stream: Arc<CudaStream>,
    algos: RefCell<HashMap<AlgoKey, sys::cublasLtMatmulAlgo_t>>,
}

// SAFETY: the handle is an opaque pointer to cuBLASLt's host-side state, which may be used
// from any thread (one at a time); every use enqueues work on `self.stream` only. `Gemm` is
// deliberately not `Sync`: cuBLAS does not promise that one handle may be used by several
// threads at the same time, so sharing across threads needs a lock around the whole handle.
unsafe impl Send for Gemm {}

/// Whether libcublasLt can be loaded (never panics; cuBLASLt is loaded at run time).
pub fn cublaslt_available() -> bool {
    // SAFETY: only tries to dlopen the library under its known names, and closes it again.
    unsafe { sys::is_culib_present() }
}

fn lt_err(context: &'static str, what: &str) -> impl Fn(lt::CublasError) -> OpsError {
    let what = what.to_string();
    move |e| OpsError::Cuda {
        context,
        message: format!("{what}: {e}"),
    }
}

/// Largest power of two (at most 256) dividing `ptr` and, for batched operands, the batch stride
/// in bytes: what the matrix pointers of every batch entry are aligned to.
fn alignment(ptr: u64, stride_bytes: u64) -> u32 {
    let x = ptr | stride_bytes | 256;
    (x & x.wrapping_neg()) as u32
}

impl Gemm {
    /// Creates a cuBLASLt handle and a [`GEMM_WORKSPACE_BYTES`] workspace on `stream`'s device.
    /// Without libcublasLt (e.g. a machine with only the NVIDIA driver) this returns
    /// [`OpsError::Cuda`] naming the missing library, never panics.
    pub fn new(stream: &Arc<CudaStream>) -> Result<Gemm> {
        const OP: &str = "Gemm::new";
        if !cublaslt_available() {
            return Err(OpsError::Cuda {
                context: OP,
                message: "libcublasLt not found: install the CUDA 13 cuBLAS library (the \
                          nvidia-cublas wheel or a CUDA toolkit) and put the directory of \
                          libcublasLt.so.13 on LD_LIBRARY_PATH"
                    .into(),
            });
        }
        bind(stream, OP)?;
        let workspace = stream
            .alloc_zeros::<u8>(GEMM_WORKSPACE_BYTES)
            .map_err(|e| OpsError::Cuda {
                context: OP,
                message: format!("cannot allocate the cuBLASLt workspace: {e}"),
            })?;
        let handle = lt::create_handle().map_err(lt_err(OP, "cublasLtCreate"))?;
        Ok(Gemm {
            handle,
            workspace,
            stream: stream.clone(),
            algos: RefCell::new(HashMap::new()),
        })
    }

    /// The stream every product of this handle runs on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Bytes of device memory the handle holds (its workspace).
    pub fn workspace_bytes(&self) -> usize {
        GEMM_WORKSPACE_BYTES
    }

    /// The strided-batched row-major matmul of `spec` (see [`MatmulSpec`]). Input and output
    /// types: f32 → f32, bf16 → bf16 or f32, f16 → f16 or f32, all with f32 accumulation
    /// (`CUBLAS_COMPUTE_32F`, no TF32); any other pair is an error. `c` must not overlap `a`
    /// or `b` (it is borrowed mutably, so safe code cannot make it).
    pub fn matmul<I: DeviceFloat, O: DeviceFloat>(
        &self,
        spec: &MatmulSpec,
        a: &impl DevicePtr<I>,
        b: &impl DevicePtr<I>,
        c: &mut impl DevicePtrMut<O>,
    ) -> Result<()> {
        const OP: &str = "Gemm::matmul";
        self.check_types::<I, O>(OP)?;
        let (a_len, b_len, c_len) = spec.required_lens(OP)?;
        at_least(OP, "A", a_len, a.len())?;
        at_least(OP, "B", b_len, b.len())?;
        at_least(OP, "C", c_len, c.len())?;
        same_device(&self.stream, OP, "A", a)?;
        same_device(&self.stream, OP, "B", b)?;
        same_device(&self.stream, OP, "C", c)?;
        bind(&self.stream, OP)?;
        let (a_ptr, _a) = a.device_ptr(&self.stream);
        let (b_ptr, _b) = b.device_ptr(&self.stream);
        let (c_ptr, _c) = c.device_ptr_mut(&self.stream);
        // SAFETY: the three buffers live on the handle's device and hold at least the elements
        // the spec addresses (checked above, for every batch entry); `c` is borrowed mutably
        // so it overlaps neither input; the guards order the product after earlier writers and
        // before later users on this stream, and the buffers outlive the enqueue.
        unsafe { self.launch::<I, O>(OP, spec, a_ptr, b_ptr, c_ptr, Epilogue::None) }
    }

    /// The (input, output) type pairs cuBLASLt supports with `CUBLAS_COMPUTE_32F` and an f32
    /// scale type that the crate uses: a product keeps its input type or widens to f32.
    fn check_types<I: DeviceFloat, O: DeviceFloat>(&self, op: &'static str) -> Result<()> {
        use sys::cudaDataType::{CUDA_R_16BF, CUDA_R_16F, CUDA_R_32F};
        let ok = matches!(
            (I::CUDA_DATA_TYPE, O::CUDA_DATA_TYPE),
            (CUDA_R_32F, CUDA_R_32F)
                | (CUDA_R_16BF, CUDA_R_16BF | CUDA_R_32F)
                | (CUDA_R_16F, CUDA_R_16F | CUDA_R_32F)
        );
        if ok {
            Ok(())
        } else {
            Err(OpsError::Cuda {
                context: op,
                message: format!(
                    "unsupported matmul types {} -> {} (supported: f32 -> f32, bf16 -> bf16, \
                     bf16 -> f32, f16 -> f16, f16 -> f32)",
                    I::NAME,
                    O::NAME
                ),
            })
        }
    }

    /// Runs one product on the stream.
    ///
    /// # Safety
    /// `a`, `b`, `c` (and the bias pointer of the epilogue) are device pointers of this
    /// handle's context, of element types `I`, `I`, `O` (`O` for the bias), holding every
    /// element `spec` addresses (the bias: `spec.n` elements); `c` overlaps neither input; they
    /// stay allocated until the enqueued work has run (stream order); `spec` passed
    /// `required_lens`, and the context is current.
    pub(super) unsafe fn launch<I: DeviceFloat, O: DeviceFloat>(
        &self,
        op: &'static str,
        spec: &MatmulSpec,
        a: u64,
        b: u64,
        c: u64,
        epilogue: Epilogue,
    ) -> Result<()> {
        self.check_types::<I, O>(op)?;
        let (ia, ic) = (size_of::<I>() as u64, size_of::<O>() as u64);
        let batched = spec.batch > 1;
        let stride_bytes = |s: usize, elem: u64| if batched { s as u64 * elem } else { 0 };
        let align = [
            alignment(a, stride_bytes(spec.a.batch_stride, ia)),
            alignment(b, stride_bytes(spec.b.batch_stride, ia)),
            alignment(c, stride_bytes(spec.c_batch_stride, ic)),
            match epilogue {
                Epilogue::Bias(p) => alignment(p, 0),
                Epilogue::None => 256,
            },
        ];
        let key = AlgoKey {
            a_type: I::CUDA_DATA_TYPE as u32,
            c_type: O::CUDA_DATA_TYPE as u32,
            m: spec.m,
            n: spec.n,
            k: spec.k,
            batch: spec.batch,
            a: (spec.a.transpose, spec.a.ld, spec.a.batch_stride),
            b: (spec.b.transpose, spec.b.ld, spec.b.batch_stride),
            c: (spec.c_ld, spec.c_batch_stride),
            bias: matches!(epilogue, Epilogue::Bias(_)),
            beta_zero: spec.beta == 0.0,
            align,
        };

        // Column-major view: D (n×m) = op(B)ᵀ (n×k) · op(A)ᵀ (k×m). cuBLASLt's first operand is
        // our B, its second our A; a stored row-major R×C matrix is a column-major C×R one.
        let (br, bc) = spec.b.stored_dims(spec.k, spec.n);
        let (ar, ac) = spec.a.stored_dims(spec.m, spec.k);
        let lay_first = Layout::new(op, I::CUDA_DATA_TYPE, bc, br, spec.b.ld)?;
        let lay_second = Layout::new(op, I::CUDA_DATA_TYPE, ac, ar, spec.a.ld)?;
        let lay_c = Layout::new(op, O::CUDA_DATA_TYPE, spec.n, spec.m, spec.c_ld)?;
        if batched {
            lay_first.set_batch(op, spec.batch, spec.b.batch_stride)?;
            lay_second.set_batch(op, spec.batch, spec.a.batch_stride)?;
            lay_c.set_batch(op, spec.batch, spec.c_batch_stride)?;
        }
        let desc = Desc::new(op)?;
        desc.set_transpose(
            op,
            sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSA,
            spec.b.transpose,
        )?;
        desc.set_transpose(
            op,
            sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSB,
            spec.a.transpose,
        )?;
        if let Epilogue::Bias(ptr) = epilogue {
            // Column-major D has n rows; the BIAS epilogue adds bias[row] to every column,
            // which is bias[j] to every row-major output row.
            desc.set(
                op,
                sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_EPILOGUE,
                &sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_BIAS,
            )?;
            let bias_ptr = ptr as *const c_void;
            desc.set(
                op,
                sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                &bias_ptr,
            )?;
            // The bias has the output's type (cuBLASLt's default for f32, bf16 and f16 outputs
            // with compute 32F; set explicitly so the contract does not rest on the default).
            // The attribute is an int32 cudaDataType.
            let bias_type = O::CUDA_DATA_TYPE as i32;
            desc.set(
                op,
                sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE,
                &bias_type,
            )?;
        }

        let cached = self.algos.borrow().get(&key).copied();
        let algo = match cached {
            Some(algo) => algo,
            None => {
                let algo =
                    self.heuristic(op, &desc, &lay_first, &lay_second, &lay_c, align, spec)?;
                self.algos.borrow_mut().insert(key, algo);
                algo
            }
        };

        let (ws_ptr, _ws) = self.workspace.device_ptr(&self.stream);
        // SAFETY: the descriptors are live (dropped at the end of this function, after the
        // enqueue, which copies what it needs); the pointers satisfy this function's contract;
        // alpha and beta are host f32 values (the default host pointer mode with scale type
        // 32F); the workspace is this handle's, used only on this stream.
        unsafe {
            lt::matmul(
                self.handle,
                desc.0,
                (&spec.alpha) as *const f32 as *const c_void,
                (&spec.beta) as *const f32 as *const c_void,
                b as *const c_void,
                lay_first.0,
                a as *const c_void,
                lay_second.0,
                c as *const c_void,
                lay_c.0,
                c as *mut c_void,
                lay_c.0,
                &algo,
                ws_ptr as *mut c_void,
                GEMM_WORKSPACE_BYTES,
                self.stream.cu_stream() as sys::cudaStream_t,
            )
        }
        .map_err(|e| OpsError::Cuda {
            context: op,
            message: format!(
                "cublasLtMatmul {}->{} m={} n={} k={} batch={}: {e}",
                I::NAME,
                O::NAME,
                spec.m,
                spec.n,
                spec.k,
                spec.batch
            ),
        })
    }

    #[allow(clippy::too_many_arguments)]
    fn heuristic(
        &self,
        op: &'static str,
        desc: &Desc,
        first: &Layout,
        second: &Layout,
        c: &Layout,
        align: [u32; 4],
        spec: &MatmulSpec,
    ) -> Result<sys::cublasLtMatmulAlgo_t> {
        let pref = Pref::new(op)?;
        use sys::cublasLtMatmulPreferenceAttributes_t as P;
        pref.set(
            op,
            P::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
            &(GEMM_WORKSPACE_BYTES as u64),
        )?;
        // cuBLASLt's first operand is our B (align[1]), its second our A (align[0]).
        pref.set(op, P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &align[1])?;
        pref.set(op, P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &align[0])?;
        pref.set(op, P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &align[2])?;
        pref.set(op, P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &align[2])?;
        // SAFETY: every descriptor is live for the call; the result is plain data.
        let found = unsafe {
            lt::get_matmul_algo_heuristic(self.handle, desc.0, first.0, second.0, c.0, c.0, pref.0)
        };
        found.map(|h| h.algo).map_err(|e| OpsError::Cuda {
            context: op,
            message: format!(
                "cuBLASLt has no algorithm for m={} n={} k={} batch={} (A {:?} ld {}, B {:?} ld \
                 {}, C ld {}, alignments {:?}): {e}",
                spec.m,
                spec.n,
                spec.k,
                spec.batch,
                spec.a.transpose,
                spec.a.ld,
                spec.b.transpose,
                spec.b.ld,
                spec.c_ld,
                align
            ),
        })
    }

    /// The workspace as f32 scratch for kernels that run on this stream between products
    /// (stream order keeps them from overlapping cuBLASLt's own use).
    fn scratch_f32(&self) -> (u64, usize) {
        let (ptr, _guard) = self.workspace.device_ptr(&self.stream);
        (ptr, GEMM_WORKSPACE_BYTES / size_of::<f32>())
    }
}

impl Drop for Gemm {
    fn drop(&mut self) {
        // Work still queued may use the handle; cuBLASLt's destroy synchronises with it. An
        // error here cannot be reported from drop and must not panic.
        let _ = bind(&self.stream, "Gemm::drop");
        // SAFETY: the handle was created by `create_handle` and is destroyed exactly once.
        let _ = unsafe { lt::destroy_handle(self.handle) };
    }
}

fn at_least(op: &'static str, what: &str, need: usize, have: usize) -> Result<()> {
    if have >= need {
        Ok(())
    } else {
        Err(OpsError::Cuda {
            context: op,
            message: format!("{what} holds {have} elements but the product addresses {need}"),
        })
    }
}

/// A column-major matrix layout descriptor, destroyed on drop.
struct Layout(sys::cublasLtMatrixLayout_t);

impl Layout {
    fn new(
        op: &'static str,
        ty: sys::cudaDataType,
        rows: usize,
        cols: usize,
        ld: usize,
    ) -> Result<Layout> {
        lt::create_matrix_layout(ty, rows as u64, cols as u64, ld as i64)
            .map(Layout)
            .map_err(lt_err(op, "cublasLtMatrixLayoutCreate"))
    }

    fn set_batch(&self, op: &'static str, batch: usize, stride: usize) -> Result<()> {
        use sys::cublasLtMatrixLayoutAttribute_t as A;
        // Both fit: checked by `required_lens` (batch <= i32::MAX, extents <= i64::MAX).
        let count = batch as i32;
        let stride = stride as i64;
        // SAFETY: the layout is live; the buffers are the attribute's documented types
        // (int32 count, int64 offset) and sizes.
        unsafe {
            lt::set_matrix_layout_attribute(
                self.0,
                A::CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT,
                (&count) as *const i32 as *const c_void,
                size_of::<i32>(),
            )
            .and_then(|()| {
                lt::set_matrix_layout_attribute(
                    self.0,
                    A::CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET,
                    (&stride) as *const i64 as *const c_void,
                    size_of::<i64>(),
                )
            })
        }
        .map_err(lt_err(op, "cublasLtMatrixLayoutSetAttribute"))
    }
}

impl Drop for Layout {
    fn drop(&mut self) {
        // SAFETY: created by `create_matrix_layout`, destroyed once; failure cannot be
        // reported from drop (and only leaks a few bytes).
        let _ = unsafe { lt::destroy_matrix_layout(self.0) };
    }
}

/// A matmul descriptor (compute 32F, scale 32F), destroyed on drop.
struct Desc(sys::cublasLtMatmulDesc_t);

impl Desc {
    fn new(op: &'static str) -> Result<Desc> {
        lt::create_matmul_desc(
            sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            sys::cudaDataType::CUDA_R_32F,
        )
        .map(Desc)
        .map_err(lt_err(op, "cublasLtMatmulDescCreate"))
    }

    fn set<T>(
        &self,
        op: &'static str,
        attr: sys::cublasLtMatmulDescAttributes_t,
        value: &T,
    ) -> Result<()> {
        // SAFETY: the descriptor is live; `value` is the attribute's documented type (an
        // enum, an int32 or a pointer), read for size_of::<T>() bytes during the call.
        unsafe {
            lt::set_matmul_desc_attribute(
                self.0,
                attr,
                value as *const T as *const c_void,
                size_of::<T>(),
            )
        }
        .map_err(lt_err(op, "cublasLtMatmulDescSetAttribute"))
    }

    fn set_transpose(
        &self,
        op: &'static str,
        attr: sys::cublasLtMatmulDescAttributes_t,
        t: Transpose,
    ) -> Result<()> {
        // cublasOperation_t (an int32 enum; cudarc's cuBLASLt bindings do not export it):
        // CUBLAS_OP_N = 0, CUBLAS_OP_T = 1.
        let value: i32 = match t {
            Transpose::No => 0,
            Transpose::Yes => 1,
        };
        self.set(op, attr, &value)
    }
}

impl Drop for Desc {
    fn drop(&mut self) {
        // SAFETY: created by `create_matmul_desc`, destroyed once.
        let _ = unsafe { lt::destroy_matmul_desc(self.0) };
    }
}

/// A heuristic preference descriptor, destroyed on drop.
struct Pref(sys::cublasLtMatmulPreference_t);

impl Pref {
    fn new(op: &'static str) -> Result<Pref> {
        lt::create_matmul_pref()
            .map(Pref)
            .map_err(lt_err(op, "cublasLtMatmulPreferenceCreate"))
    }

    fn set<T>(
        &self,
        op: &'static str,
        attr: sys::cublasLtMatmulPreferenceAttributes_t,
        value: &T,
    ) -> Result<()> {
        // SAFETY: the preference is live; `value` is the attribute's documented type (uint64
        // workspace bytes, uint32 alignments).
        unsafe {
            lt::set_matmul_pref_attribute(
                self.0,
                attr,
                value as *const T as *const c_void,
                size_of::<T>(),
            )
        }
        .map_err(lt_err(op, "cublasLtMatmulPreferenceSetAttribute"))
    }
}

impl Drop for Pref {
    fn drop(&mut self) {
        // SAFETY: created by `create_matmul_pref`, destroyed once.
        let _ = unsafe { lt::destroy_matmul_pref(self.0) };
    }
}

// ---- the linear layer ----

/// Checks the linear-layer lengths shared by forward and backward.
fn linear_dims(
    op: &'static str,
    x_len: usize,
    w_len: usize,
    rows: usize,
    in_f: usize,
    out_f: usize,
) -> Result<()> {
    let prod = |a: usize, b: usize| {
        a.checked_mul(b).ok_or(OpsError::Cuda {
            context: op,
            message: format!("{a} x {b} elements overflow usize"),
        })
    };
    expect_len(op, prod(rows, in_f)?, x_len)?;
    expect_len(op, prod(out_f, in_f)?, w_len)?;
    if in_f == 0 && rows > 0 && out_f > 0 {
        return Err(OpsError::Cuda {
            context: op,
            message: "in_features must be positive".into(),
        });
    }
    Ok(())
}

/// `out = x·Wᵀ (+ bias)`: `x` `[rows, in_f]`, `w` `[out_f, in_f]`, `bias` `[out_f]`, `out`
/// `[rows, out_f]` written (`=`), all of one element type `T` (f32, bf16 or f16).
///
/// Precision: f32 accumulation (`CUBLAS_COMPUTE_32F`; for f32 inputs no TF32, so the f32 path
/// matches an f32 reference to ~1e-5); the bias (of type `T`) is added in f32 by the GEMM's
/// `BIAS` epilogue, and `out` is rounded once to `T`.
#[allow(clippy::too_many_arguments)]
pub fn linear_forward<T: DeviceFloat>(
    gemm: &Gemm,
    x: &impl DevicePtr<T>,
    w: &impl DevicePtr<T>,
    bias: Option<&dyn DevicePtr<T>>,
    rows: usize,
    in_f: usize,
    out_f: usize,
    out: &mut impl DevicePtrMut<T>,
) -> Result<()> {
    const OP: &str = "linear_forward";
    linear_dims(OP, x.len(), w.len(), rows, in_f, out_f)?;
    expect_len(OP, rows * out_f, out.len())?;
    let stream = &gemm.stream;
    same_device(stream, OP, "x", x)?;
    same_device(stream, OP, "w", w)?;
    same_device(stream, OP, "out", out)?;
    if let Some(bias) = bias {
        expect_len(OP, out_f, bias.len())?;
        if **bias.stream().context() != **stream.context() {
            return Err(OpsError::Cuda {
                context: OP,
                message: "`bias` lives on another device than the launch stream".into(),
            });
        }
    }
    if rows == 0 || out_f == 0 {
        return Ok(());
    }
    // out (rows×out_f) = x (rows×in_f) · Wᵀ, W stored out_f×in_f.
    let spec = MatmulSpec::new(
        rows,
        out_f,
        in_f,
        Operand::plain(in_f),
        Operand::transposed(in_f),
    );
    spec.required_lens(OP)?;
    gemm.check_types::<T, T>(OP)?;
    bind(stream, OP)?;
    let (x_ptr, _x) = x.device_ptr(stream);
    let (w_ptr, _w) = w.device_ptr(stream);
    let (o_ptr, _o) = out.device_ptr_mut(stream);
    let bias_guard = bias.map(|b| b.device_ptr(stream));
    let epilogue = match &bias_guard {
        Some((ptr, _)) => Epilogue::Bias(*ptr),
        None => Epilogue::None,
    };
    // SAFETY: x, w, out (and bias) live on the handle's device with exactly the lengths the
    // product addresses (checked above: rows*in_f, out_f*in_f, rows*out_f, out_f), all of
    // element type T; out is borrowed mutably so it overlaps no input; the guards (including
    // `bias_guard`) are held until after the enqueue.
    let result = unsafe { gemm.launch::<T, T>(OP, &spec, x_ptr, w_ptr, o_ptr, epilogue) };
    drop(bias_guard);
    result
}

/// Whether a weight gradient's product adds onto what the gradient holds (`+=`, beta = 1: the
/// parameter-gradient convention, so micro-batches add up) or writes it (`=`, beta = 0: the
/// first product into a gradient buffer nobody zeroed, which then needs neither the zeroing
/// pass nor the product's read of the old values).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WeightGrad {
    Add,
    Write,
}

/// Backward of [`linear_forward`]: `dx = dout·W` (written, `=`, rounded once to `T`; skipped
/// when `dx` is `None`), `dw += doutᵀ·x` (f32, accumulated by the GEMM with beta = 1, so
/// micro-batches add up without 16-bit rounding), `db += column sums of dout` (f32, accumulated
/// by a deterministic reduction kernel, if given). `dout` `[rows, out_f]`, `x` `[rows, in_f]`,
/// `w` `[out_f, in_f]` of type `T`; `dw` `[out_f, in_f]` and `db` `[out_f]` f32 whatever `T`.
/// Every product accumulates in f32 (no TF32). Uses the handle's workspace as the reduction's
/// scratch.
#[allow(clippy::too_many_arguments)]
pub fn linear_backward<T: DeviceFloat>(
    gemm: &Gemm,
    dout: &impl DevicePtr<T>,
    x: &impl DevicePtr<T>,
    w: &impl DevicePtr<T>,
    rows: usize,
    in_f: usize,
    out_f: usize,
    dx: Option<&mut dyn DevicePtrMut<T>>,
    dw: &mut impl DevicePtrMut<f32>,
    db: Option<&mut dyn DevicePtrMut<f32>>,
) -> Result<()> {
    linear_backward_with(
        gemm,
        dout,
        x,
        w,
        rows,
        in_f,
        out_f,
        dx,
        dw,
        db,
        WeightGrad::Add,
    )
}

/// [`linear_backward`] with the weight gradient added or written as `dw_grad` says (the same
/// product either way, so the same bits as adding onto zeros); the bias gradient is always
/// added.
#[allow(clippy::too_many_arguments)]
pub fn linear_backward_with<T: DeviceFloat>(
    gemm: &Gemm,
    dout: &impl DevicePtr<T>,
    x: &impl DevicePtr<T>,
    w: &impl DevicePtr<T>,
    rows: usize,
    in_f: usize,
    out_f: usize,
    dx: Option<&mut dyn DevicePtrMut<T>>,
    dw: &mut impl DevicePtrMut<f32>,
    db: Option<&mut dyn DevicePtrMut<f32>>,
    dw_grad: WeightGrad,
) -> Result<()> {
    const OP: &str = "linear_backward";
    linear_dims(OP, x.len(), w.len(), rows, in_f, out_f)?;
    expect_len(OP, rows * out_f, dout.len())?;
    expect_len(OP, out_f * in_f, dw.len())?;
    let stream = &gemm.stream;
    same_device(stream, OP, "dout", dout)?;
    same_device(stream, OP, "x", x)?;
    same_device(stream, OP, "w", w)?;
    same_device(stream, OP, "dw", dw)?;
    let other_device = |what: &str| OpsError::Cuda {
        context: OP,
        message: format!("`{what}` lives on another device than the launch stream"),
    };
    if let Some(dx) = &dx {
        expect_len(OP, rows * in_f, dx.len())?;
        if **dx.stream().context() != **stream.context() {
            return Err(other_device("dx"));
        }
    }
    if let Some(db) = &db {
        expect_len(OP, out_f, db.len())?;
        if **db.stream().context() != **stream.context() {
            return Err(other_device("db"));
        }
    }
    if rows == 0 || out_f == 0 || in_f == 0 {
        // Nothing accumulates. A non-empty dx would be a product over zero out_features;
        // no layer has those, so it is refused rather than silently zero-filled.
        if dx.as_ref().is_some_and(|dx| dx.len() > 0) {
            return Err(OpsError::Cuda {
                context: OP,
                message: "out_features must be positive when dx is requested".into(),
            });
        }
        if dw_grad == WeightGrad::Write && dw.len() > 0 {
            // A sum over zero rows, written: zeros.
            bind(stream, OP)?;
            let bytes = dw.len() * size_of::<f32>();
            let (dw_ptr, _dw) = dw.device_ptr_mut(stream);
            // SAFETY: dw holds out_f*in_f f32 (checked above) on the stream's device and is
            // borrowed mutably; the guard is held past the enqueue.
            unsafe {
                cudarc::driver::result::memset_d8_async(dw_ptr, 0, bytes, stream.cu_stream())
            }
            .map_err(|e| OpsError::Cuda {
                context: OP,
                message: format!("zeroing dw: {e}"),
            })?;
        }
        return Ok(());
    }
    gemm.check_types::<T, T>(OP)?;
    gemm.check_types::<T, f32>(OP)?;
    bind(stream, OP)?;
    let (dout_ptr, _dout) = dout.device_ptr(stream);
    if let Some(dx) = dx {
        let spec = input_grad_spec(rows, in_f, out_f, 0.0);
        spec.required_lens(OP)?;
        let (w_ptr, _w) = w.device_ptr(stream);
        let (dx_ptr, _dx) = dx.device_ptr_mut(stream);
        // SAFETY: lengths checked above (rows*out_f, out_f*in_f, rows*in_f), element type T;
        // dx is borrowed mutably; all on the handle's device; guards held past the enqueue.
        unsafe { gemm.launch::<T, T>(OP, &spec, dout_ptr, w_ptr, dx_ptr, Epilogue::None)? };
    }
    // dW (out_f×in_f) += (or =) doutᵀ (out_f×rows) · x (rows×in_f), accumulated in f32.
    let mut spec = MatmulSpec::new(
        out_f,
        in_f,
        rows,
        Operand::transposed(out_f),
        Operand::plain(in_f),
    );
    spec.beta = match dw_grad {
        WeightGrad::Add => 1.0,
        WeightGrad::Write => 0.0,
    };
    spec.required_lens(OP)?;
    {
        let (x_ptr, _x) = x.device_ptr(stream);
        let (dw_ptr, _dw) = dw.device_ptr_mut(stream);
        // SAFETY: lengths checked above (rows*out_f, rows*in_f, out_f*in_f); dw (f32) is
        // borrowed mutably; all on the handle's device; guards held past the enqueue.
        unsafe { gemm.launch::<T, f32>(OP, &spec, dout_ptr, x_ptr, dw_ptr, Epilogue::None)? };
    }
    if let Some(db) = db {
        // SAFETY: a pure function of its arguments.
        let need = unsafe { ffi::tilearn_bias_grad_scratch_len(rows, out_f) };
        let (scratch, scratch_len) = gemm.scratch_f32();
        if need > scratch_len {
            return Err(OpsError::Cuda {
                context: OP,
                message: format!(
                    "the bias gradient of {out_f} features needs {need} f32 of scratch, more \
                     than the {scratch_len} of the cuBLASLt workspace"
                ),
            });
        }
        let (db_ptr, _db) = db.device_ptr_mut(stream);
        // SAFETY: dout holds rows*out_f elements of type T (T::DTYPE tells the launcher which)
        // and db out_f f32 (checked above), both on the stream's device, db borrowed mutably;
        // the scratch is the handle's workspace, which only work on this same stream uses, so
        // stream order keeps this kernel from overlapping a cuBLASLt product; it holds
        // `scratch_len >= need` f32.
        let status = unsafe {
            ffi::tilearn_bias_grad(
                T::DTYPE,
                dout_ptr as *const c_void,
                rows,
                out_f,
                db_ptr as *mut f32,
                scratch as *mut f32,
                scratch_len,
                raw_stream(stream),
            )
        };
        check(OP, status)?;
    }
    Ok(())
}

/// `dx (rows×in_f) = dout (rows×out_f) · W (out_f×in_f) + beta · dx`: the input gradient's
/// product, written (`beta = 0`) by [`linear_backward`] or added (`beta = 1`) by
/// [`linear_input_grad_add`].
fn input_grad_spec(rows: usize, in_f: usize, out_f: usize, beta: f32) -> MatmulSpec {
    let mut spec = MatmulSpec::new(
        rows,
        in_f,
        out_f,
        Operand::plain(out_f),
        Operand::plain(in_f),
    );
    spec.beta = beta;
    spec
}

/// `dx += dout·W`: a linear layer's input gradient added onto another layer's that read the same
/// input (the f32 product plus the widened `dx`, rounded once to `T`: the GEMM's beta = 1),
/// where [`linear_backward`]'s written `dx` and a separate sum would round twice and pass over
/// `dx` twice more. `dout` `[rows, out_f]`, `w` `[out_f, in_f]`, `dx` `[rows, in_f]`, all `T`.
#[allow(clippy::too_many_arguments)]
pub fn linear_input_grad_add<T: DeviceFloat>(
    gemm: &Gemm,
    dout: &impl DevicePtr<T>,
    w: &impl DevicePtr<T>,
    rows: usize,
    in_f: usize,
    out_f: usize,
    dx: &mut impl DevicePtrMut<T>,
) -> Result<()> {
    const OP: &str = "linear_input_grad_add";
    linear_dims(OP, dx.len(), w.len(), rows, in_f, out_f)?;
    expect_len(OP, rows * out_f, dout.len())?;
    gemm.matmul::<T, T>(&input_grad_spec(rows, in_f, out_f, 1.0), dout, w, dx)
}
