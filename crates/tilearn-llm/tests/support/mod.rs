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

/// The bound on max |Δw| between a run that splits the model (tensor or pipeline parallelism,
/// with or without data parallelism around it) and one process with the same global batch,
/// after 4 steps at lr 1e-2. The split reorders f32 sums (~1e-7 relative on the gradients),
/// and AdamW's `m / (√v + 1e-8)` turns that into up to ~2e-4 on the few weights whose
/// gradients are near 1e-8 (see data_parallel.rs's
/// `tensor_and_pipeline_parallel_with_data_parallel_and_zero_equal_one_process` for what was
/// observed where); a wrong slice or a missed reduction moves weights by ~lr, and
/// [`assert_logs_agree`] catches what this bound lets through.
pub const SPLIT_TOLERANCE: f32 = 2e-4;

/// The records of `dir/train_log.jsonl`.
pub fn train_log(dir: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(dir.join("train_log.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// The logged loss and gradient norm of the runs in `one` and `split` agree to `rel` relative
/// at every logged step (the norm counts replicated tensors once, so a missed or doubled
/// reduction shows there first).
pub fn assert_logs_agree(one: &Path, split: &Path, rel: f64) {
    let (a_log, b_log) = (train_log(one), train_log(split));
    assert_eq!(
        a_log.len(),
        b_log.len(),
        "{one:?} vs {split:?}: logged steps"
    );
    for (a, b) in a_log.iter().zip(&b_log) {
        for key in ["loss", "grad_norm"] {
            let (x, y) = (a[key].as_f64().unwrap(), b[key].as_f64().unwrap());
            assert!(
                (x - y).abs() <= rel * x.abs(),
                "{split:?} step {}: {key} {y} vs one process {x}",
                a["step"]
            );
        }
    }
}
