//! What this build and this machine can run: whether the CUDA path was compiled in, the driver,
//! the devices, and whether the libraries loaded at run time (cuBLASLt, NCCL) are present.
//! `tilearn info` prints [`probe`]. Probing never panics and needs no GPU.

use std::fmt;

/// The result of [`probe`].
#[derive(Debug, Clone)]
pub struct BackendInfo {
    /// Whether tilearn-ops was built with the `cuda` feature (kernels compiled and linked).
    pub cuda_compiled: bool,
    /// One line per device: name, memory and compute capability.
    pub devices: Vec<String>,
    /// The driver's CUDA version (e.g. "13.0"), or why there is no usable driver.
    pub cuda_driver: Result<String, String>,
    /// Whether cuBLASLt (matmuls) can be loaded, or why not.
    pub cublaslt: Result<(), String>,
    /// Whether NCCL (multi-GPU communication) can be loaded, or why not.
    pub nccl: Result<(), String>,
}

#[cfg(not(feature = "cuda"))]
const NOT_COMPILED: &str = "built without the `cuda` feature";

/// Probes the CUDA backend. Never panics: every failure becomes a reason string.
pub fn probe() -> BackendInfo {
    #[cfg(feature = "cuda")]
    {
        match std::panic::catch_unwind(cuda_probe::probe) {
            Ok(info) => info,
            Err(panic) => {
                let what = panic
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_else(|| "unknown panic".into());
                let reason = format!("probing the CUDA driver failed: {what}");
                BackendInfo {
                    cuda_compiled: true,
                    devices: Vec::new(),
                    cuda_driver: Err(reason.clone()),
                    cublaslt: Err(reason.clone()),
                    nccl: Err(reason),
                }
            }
        }
    }
    #[cfg(not(feature = "cuda"))]
    {
        BackendInfo {
            cuda_compiled: false,
            devices: Vec::new(),
            cuda_driver: Err(NOT_COMPILED.into()),
            cublaslt: Err(NOT_COMPILED.into()),
            nccl: Err(NOT_COMPILED.into()),
        }
    }
}

impl BackendInfo {
    /// Whether at least one GPU can run the CUDA path.
    pub fn cuda_usable(&self) -> bool {
        self.cuda_compiled && self.cuda_driver.is_ok() && !self.devices.is_empty()
    }
}

impl fmt::Display for BackendInfo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fn line<T>(
            f: &mut fmt::Formatter<'_>,
            what: &str,
            r: &Result<T, String>,
            ok: &str,
        ) -> fmt::Result {
            match r {
                Ok(_) => writeln!(f, "{what:<14}{ok}"),
                Err(why) => writeln!(f, "{what:<14}unavailable: {why}"),
            }
        }
        let compiled = if self.cuda_compiled {
            "yes (kernels for sm_80, sm_90a, compute_80 PTX)"
        } else {
            "no (rebuild with `--features cuda`)"
        };
        writeln!(f, "{:<14}{compiled}", "CUDA kernels")?;
        match &self.cuda_driver {
            Ok(version) => writeln!(f, "{:<14}CUDA {version}", "CUDA driver")?,
            Err(why) => writeln!(f, "{:<14}unavailable: {why}", "CUDA driver")?,
        }
        if self.devices.is_empty() {
            writeln!(f, "{:<14}none", "GPUs")?;
        }
        for (i, device) in self.devices.iter().enumerate() {
            writeln!(f, "{:<14}{device}", format!("GPU {i}"))?;
        }
        line(f, "cuBLASLt", &self.cublaslt, "found")?;
        line(f, "NCCL", &self.nccl, "found")
    }
}

#[cfg(feature = "cuda")]
mod cuda_probe {
    use std::ffi::{CString, c_char, c_int, c_void};

    use cudarc::driver::{result, sys};

    use super::BackendInfo;

    pub(super) fn probe() -> BackendInfo {
        let (cuda_driver, devices) = driver_and_devices();
        // SAFETY: only tries to dlopen the library under its candidate names.
        let cublaslt = if unsafe { cudarc::cublaslt::sys::is_culib_present() } {
            Ok(())
        } else {
            Err(
                "libcublasLt not found (libcublasLt.so.13 or another name cudarc tries): install \
                 the CUDA 13 cuBLAS libraries or add their directory to LD_LIBRARY_PATH"
                    .into(),
            )
        };
        let nccl = if library_loadable("nccl") {
            Ok(())
        } else {
            Err(
                "libnccl not found (tried libnccl.so, libnccl.so.2, …): install NCCL or add its \
                 directory to LD_LIBRARY_PATH"
                    .into(),
            )
        };
        BackendInfo {
            cuda_compiled: true,
            devices,
            cuda_driver,
            cublaslt,
            nccl,
        }
    }

    fn driver_and_devices() -> (Result<String, String>, Vec<String>) {
        // SAFETY: only tries to dlopen the driver library under its candidate names.
        if !unsafe { sys::is_culib_present() } {
            return (
                Err(
                    "no CUDA driver found (libcuda.so could not be loaded: is the NVIDIA driver \
                     installed?)"
                        .into(),
                ),
                Vec::new(),
            );
        }
        if let Err(e) = result::init() {
            return (Err(format!("cuInit failed: {e}")), Vec::new());
        }
        let mut version: c_int = 0;
        // SAFETY: cuDriverGetVersion writes one int through the valid pointer it is given.
        let status = unsafe { sys::cuDriverGetVersion(&mut version) };
        let driver = if status == sys::CUresult::CUDA_SUCCESS {
            Ok(format!("{}.{}", version / 1000, (version % 1000) / 10))
        } else {
            Err(format!("cuDriverGetVersion failed: {status:?}"))
        };
        let count = match result::device::get_count() {
            Ok(n) => n,
            Err(e) => return (driver, vec![format!("cannot count devices: {e}")]),
        };
        let devices = (0..count).map(describe_device).collect();
        (driver, devices)
    }

    fn describe_device(ordinal: c_int) -> String {
        let dev = match result::device::get(ordinal) {
            Ok(dev) => dev,
            Err(e) => return format!("device {ordinal}: {e}"),
        };
        let name = result::device::get_name(dev).unwrap_or_else(|e| format!("unknown ({e})"));
        // SAFETY: `dev` is a valid device handle returned by cuDeviceGet after cuInit.
        let memory = unsafe { result::device::total_mem(dev) }
            .map(|b| format!("{:.1} GiB", b as f64 / (1u64 << 30) as f64))
            .unwrap_or_else(|e| format!("memory unknown ({e})"));
        let attribute = |a| {
            // SAFETY: as above; reading an attribute has no other precondition.
            unsafe { result::device::get_attribute(dev, a) }.ok()
        };
        let major =
            attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR);
        let minor =
            attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR);
        let cc = match (major, minor) {
            (Some(major), Some(minor)) => format!("sm_{major}{minor}"),
            _ => "compute capability unknown".into(),
        };
        format!("{name}, {memory}, {cc}")
    }

    const RTLD_NOW: c_int = 2;

    unsafe extern "C" {
        fn dlopen(filename: *const c_char, flag: c_int) -> *mut c_void;
        fn dlclose(handle: *mut c_void) -> c_int;
    }

    /// Whether the shared library `name` loads under one of the names cudarc would try. (cudarc's
    /// own `is_culib_present` for NCCL needs its `nccl` feature, which this crate does not use.)
    fn library_loadable(name: &str) -> bool {
        cudarc::get_lib_name_candidates(name)
            .iter()
            .any(|candidate| {
                let Ok(c) = CString::new(candidate.as_str()) else {
                    return false;
                };
                // SAFETY: `c` is a NUL-terminated path; dlopen runs the library's initialisers, as
                // loading it for real would; the handle is closed right away.
                unsafe {
                    let handle = dlopen(c.as_ptr(), RTLD_NOW);
                    if handle.is_null() {
                        false
                    } else {
                        dlclose(handle);
                        true
                    }
                }
            })
    }
}
