//! Helpers of the CLI test binaries: which binary to run, running it, comparing saved weights.
#![allow(dead_code)] // each test binary uses a different subset

#[cfg(feature = "cuda")]
pub mod gpu_runs;

use std::ffi::OsString;
use std::path::Path;
use std::process::Output;

/// The binary to run: `$TILEARN_BIN_DIR/<name>` when set (the GPU machine runs bundled test
/// executables, where Cargo's build path does not exist), else the one Cargo built for the test.
pub fn bin(name: &str, cargo_built: &str) -> OsString {
    match std::env::var_os("TILEARN_BIN_DIR") {
        Some(dir) => std::path::Path::new(&dir).join(name).into_os_string(),
        None => cargo_built.into(),
    }
}

/// The stdout of a successful run; fails the test with both streams otherwise.
pub fn ok(out: Output) -> String {
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    stdout
}

/// Every tensor of `dir/model.safetensors` (f32), in name order, as one vector.
pub fn weights(dir: &Path) -> Vec<f32> {
    let bytes = std::fs::read(dir.join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut names: Vec<String> = st.names().into_iter().map(str::to_string).collect();
    names.sort();
    names
        .iter()
        .flat_map(|n| {
            st.tensor(n)
                .unwrap()
                .data()
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect::<Vec<_>>()
        })
        .collect()
}

/// The largest elementwise |a − b|.
pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}
