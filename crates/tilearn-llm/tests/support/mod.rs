//! Helpers of the data-parallel tests: running the binary and comparing saved weights.

use std::path::Path;
use std::process::Output;

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
