//! (in progress) Installs the pinned nvcc.
use std::path::PathBuf;

/// Installs (or finds) nvcc and returns its path.
pub fn run(_args: &[String]) -> Result<PathBuf, String> {
    Err("setup-cuda is not written yet".into())
}

/// Finds nvcc through NVCC, CUDA_HOME, PATH or the pinned install, without installing.
pub fn find_nvcc() -> Option<PathBuf> {
    None
}
