//! NCCL loaded at run time with libloading. cudarc 0.19's NCCL bindings only try the names its
//! `get_lib_name_candidates` builds (`libnccl.so`, `libnccl.so.13`, `.12`, … but not
//! `libnccl.so.2`, the only name pip's `nvidia-nccl-cu*` wheels ship) and panic when none loads,
//! so tilearn binds the few functions it needs itself and turns a missing library into
//! [`ParallelError::NcclNotFound`].

use std::ffi::{CStr, c_char, c_int, c_void};
use std::sync::OnceLock;

use crate::error::{ParallelError, Result};

/// Overrides where NCCL is loaded from (a path or a file name).
pub const NCCL_LIBRARY_ENV: &str = "TILEARN_NCCL_LIBRARY";
/// The names tried, in order, when [`NCCL_LIBRARY_ENV`] is not set.
pub const NCCL_NAMES: [&str; 2] = ["libnccl.so.2", "libnccl.so"];

pub type Comm = *mut c_void;
pub type Stream = *mut c_void;
pub type NcclResult = c_int;
pub type DataType = c_int;
pub type RedOp = c_int;
/// `ncclAllReduce` and `ncclReduceScatter`: (send, recv, count, type, op, comm, stream).
pub type ReduceFn = unsafe extern "C" fn(
    *const c_void,
    *mut c_void,
    usize,
    DataType,
    RedOp,
    Comm,
    Stream,
) -> NcclResult;

/// `ncclUniqueId`: 128 opaque bytes, passed by value.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct UniqueId {
    pub internal: [c_char; 128],
}

pub const SUCCESS: NcclResult = 0;
pub const IN_PROGRESS: NcclResult = 7;
pub const FLOAT16: DataType = 6;
pub const FLOAT32: DataType = 7;
pub const BFLOAT16: DataType = 9;
pub const SUM: RedOp = 0;
pub const MAX: RedOp = 2;
pub const MIN: RedOp = 3;
pub const AVG: RedOp = 4;
/// `ncclScalarHostImmediate`: the pre-multiplication scalar is read from host memory at the call.
pub const SCALAR_HOST_IMMEDIATE: c_int = 1;
/// `NCCL_SPLIT_NOCOLOR`: this rank joins no group in `ncclCommSplit`.
pub const SPLIT_NOCOLOR: c_int = -1;

/// The NCCL functions tilearn calls.
pub struct Nccl {
    _library: libloading::Library,
    pub name: String,
    pub get_version: unsafe extern "C" fn(*mut c_int) -> NcclResult,
    pub get_unique_id: unsafe extern "C" fn(*mut UniqueId) -> NcclResult,
    pub comm_init_rank: unsafe extern "C" fn(*mut Comm, c_int, UniqueId, c_int) -> NcclResult,
    pub comm_destroy: unsafe extern "C" fn(Comm) -> NcclResult,
    pub comm_abort: unsafe extern "C" fn(Comm) -> NcclResult,
    pub comm_split: unsafe extern "C" fn(Comm, c_int, c_int, *mut Comm, *mut c_void) -> NcclResult,
    pub comm_get_async_error: unsafe extern "C" fn(Comm, *mut NcclResult) -> NcclResult,
    pub get_error_string: unsafe extern "C" fn(NcclResult) -> *const c_char,
    pub all_reduce: ReduceFn,
    pub reduce_scatter: ReduceFn,
    pub all_gather: unsafe extern "C" fn(
        *const c_void,
        *mut c_void,
        usize,
        DataType,
        Comm,
        Stream,
    ) -> NcclResult,
    pub broadcast: unsafe extern "C" fn(
        *const c_void,
        *mut c_void,
        usize,
        DataType,
        c_int,
        Comm,
        Stream,
    ) -> NcclResult,
    /// `ncclReduce`: (send, recv, count, type, op, root, comm, stream).
    pub reduce: unsafe extern "C" fn(
        *const c_void,
        *mut c_void,
        usize,
        DataType,
        RedOp,
        c_int,
        Comm,
        Stream,
    ) -> NcclResult,
    pub send:
        unsafe extern "C" fn(*const c_void, usize, DataType, c_int, Comm, Stream) -> NcclResult,
    pub recv: unsafe extern "C" fn(*mut c_void, usize, DataType, c_int, Comm, Stream) -> NcclResult,
    pub group_start: unsafe extern "C" fn() -> NcclResult,
    pub group_end: unsafe extern "C" fn() -> NcclResult,
    pub red_op_create_pre_mul_sum:
        unsafe extern "C" fn(*mut RedOp, *mut c_void, DataType, c_int, Comm) -> NcclResult,
    pub red_op_destroy: unsafe extern "C" fn(RedOp, Comm) -> NcclResult,
}

impl std::fmt::Debug for Nccl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Nccl")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

fn candidates() -> Vec<String> {
    match std::env::var(NCCL_LIBRARY_ENV) {
        Ok(path) if !path.is_empty() => vec![path],
        _ => NCCL_NAMES.iter().map(|s| s.to_string()).collect(),
    }
}

fn load() -> std::result::Result<Nccl, String> {
    let names = candidates();
    let mut reasons = Vec::new();
    for name in &names {
        // SAFETY: loading NCCL runs its initialisers, which have no preconditions.
        let library = match unsafe { libloading::Library::new(name) } {
            Ok(l) => l,
            Err(e) => {
                reasons.push(format!("{name}: {e}"));
                continue;
            }
        };
        macro_rules! symbol {
            ($name:literal) => {
                // SAFETY: the symbol is NCCL's C function of this name; the field's type is its
                // prototype from nccl.h (NCCL 2.19+), and the library outlives the pointer because
                // both live in the same `Nccl`.
                match unsafe { library.get($name) } {
                    Ok(s) => *s,
                    Err(e) => {
                        reasons.push(format!("{name}: {e}"));
                        continue;
                    }
                }
            };
        }
        let nccl = Nccl {
            get_version: symbol!(b"ncclGetVersion\0"),
            get_unique_id: symbol!(b"ncclGetUniqueId\0"),
            comm_init_rank: symbol!(b"ncclCommInitRank\0"),
            comm_destroy: symbol!(b"ncclCommDestroy\0"),
            comm_abort: symbol!(b"ncclCommAbort\0"),
            comm_split: symbol!(b"ncclCommSplit\0"),
            comm_get_async_error: symbol!(b"ncclCommGetAsyncError\0"),
            get_error_string: symbol!(b"ncclGetErrorString\0"),
            all_reduce: symbol!(b"ncclAllReduce\0"),
            reduce_scatter: symbol!(b"ncclReduceScatter\0"),
            all_gather: symbol!(b"ncclAllGather\0"),
            broadcast: symbol!(b"ncclBroadcast\0"),
            reduce: symbol!(b"ncclReduce\0"),
            send: symbol!(b"ncclSend\0"),
            recv: symbol!(b"ncclRecv\0"),
            group_start: symbol!(b"ncclGroupStart\0"),
            group_end: symbol!(b"ncclGroupEnd\0"),
            red_op_create_pre_mul_sum: symbol!(b"ncclRedOpCreatePreMulSum\0"),
            red_op_destroy: symbol!(b"ncclRedOpDestroy\0"),
            name: name.clone(),
            _library: library,
        };
        return Ok(nccl);
    }
    Err(reasons.join("; "))
}

/// The process's NCCL, loaded on first use.
pub fn nccl() -> Result<&'static Nccl> {
    static NCCL: OnceLock<std::result::Result<Nccl, String>> = OnceLock::new();
    NCCL.get_or_init(load)
        .as_ref()
        .map_err(|reasons| ParallelError::NcclNotFound {
            tried: reasons.clone(),
        })
}

impl Nccl {
    /// Turns an NCCL status into a result naming the call.
    pub fn check(&self, call: &'static str, code: NcclResult) -> Result<()> {
        if code == SUCCESS {
            return Ok(());
        }
        // SAFETY: ncclGetErrorString returns a pointer to a static NUL-terminated string.
        let message = unsafe {
            let p = (self.get_error_string)(code);
            if p.is_null() {
                "unknown error".to_string()
            } else {
                CStr::from_ptr(p).to_string_lossy().into_owned()
            }
        };
        Err(ParallelError::Nccl {
            call,
            code,
            message,
        })
    }

    /// NCCL's version as `major.minor.patch`.
    pub fn version(&self) -> Result<String> {
        let mut v: c_int = 0;
        // SAFETY: writes one int through a valid pointer.
        self.check("ncclGetVersion", unsafe { (self.get_version)(&mut v) })?;
        Ok(format!("{}.{}.{}", v / 10000, (v % 10000) / 100, v % 100))
    }
}

/// An NCCL communicator pointer shared by the communicator and its work handles.
#[derive(Clone, Copy)]
pub struct CommHandle {
    pub(crate) comm: Comm,
    pub(crate) nccl: &'static Nccl,
}

// SAFETY: an ncclComm_t may be used from any thread; tilearn serialises the calls that enqueue
// work on it (the `enqueue` mutex), and abort/async-error queries are thread-safe in NCCL.
unsafe impl Send for CommHandle {}
// SAFETY: as above.
unsafe impl Sync for CommHandle {}

impl CommHandle {
    pub fn async_error(&self) -> Result<()> {
        let mut code = SUCCESS;
        // SAFETY: `comm` is a live communicator; the status is written through a valid pointer.
        self.nccl.check("ncclCommGetAsyncError", unsafe {
            (self.nccl.comm_get_async_error)(self.comm, &mut code)
        })?;
        if code == IN_PROGRESS {
            return Ok(());
        }
        self.nccl.check("NCCL (asynchronous error)", code)
    }

    pub fn abort(&self) {
        // SAFETY: aborting a live communicator; later calls on it fail, which is the point.
        unsafe {
            (self.nccl.comm_abort)(self.comm);
        }
    }
}
