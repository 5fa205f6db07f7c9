//! AdamW state save/load: bitwise resume, atomic writes, and errors (never panics) on
//! corrupt or mismatched files.

// Groups take a list of ranges; a list holding a single range is intended here.
#![allow(clippy::single_range_in_vec_init)]

use std::path::Path;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use tilearn_optim::{AdamW, AdamWConfig, OptimError, ParamGroup};

const NUMEL: usize = 20_011;

fn groups() -> Vec<ParamGroup> {
    vec![
        ParamGroup::new("decay", vec![0..12_000, 15_000..NUMEL], 0.05),
        ParamGroup::new("no_decay", vec![12_000..14_500], 0.0),
    ]
}

fn config(amsgrad: bool) -> AdamWConfig {
    AdamWConfig {
        lr: 3e-4,
        weight_decay: 0.05,
        amsgrad,
        ..AdamWConfig::default()
    }
}

fn data(steps: usize) -> (Vec<f32>, Vec<Vec<f32>>) {
    let mut rng = ChaCha8Rng::seed_from_u64(42);
    let p: Vec<f32> = (0..NUMEL).map(|_| rng.random_range(-1.0f32..1.0)).collect();
    let g = (0..steps)
        .map(|s| {
            let scale = if s % 4 == 1 { 3.0f32 } else { 0.2 };
            (0..NUMEL)
                .map(|_| rng.random_range(-1.0f32..1.0) * scale)
                .collect()
        })
        .collect();
    (p, g)
}

fn lr_at(step: usize) -> f32 {
    3e-4 * (1.0 - step as f32 / 20.0)
}

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

fn resume_is_bitwise(amsgrad: bool) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("optimizer.safetensors");
    let (p0, grads) = data(10);

    // 10 uninterrupted steps.
    let mut full = AdamW::new(config(amsgrad), groups(), NUMEL).unwrap();
    let mut p_full = p0.clone();
    for (s, g) in grads.iter().enumerate() {
        full.step(&mut p_full, g, lr_at(s)).unwrap();
    }

    // 5 steps, save, load into a fresh optimizer, 5 more steps.
    let mut first = AdamW::new(config(amsgrad), groups(), NUMEL).unwrap();
    let mut p = p0.clone();
    for (s, g) in grads.iter().enumerate().take(5) {
        first.step(&mut p, g, lr_at(s)).unwrap();
    }
    first.save_state(&path).unwrap();
    assert!(path.exists());
    assert!(
        !Path::new(&format!("{}.tmp", path.display())).exists(),
        "the temporary file is renamed away"
    );
    drop(first);
    let mut resumed = AdamW::new(config(amsgrad), groups(), NUMEL).unwrap();
    resumed.load_state(&path).unwrap();
    assert_eq!(resumed.step_count(), 5);
    for (s, g) in grads.iter().enumerate().skip(5) {
        resumed.step(&mut p, g, lr_at(s)).unwrap();
    }

    assert_eq!(resumed.step_count(), 10);
    assert_eq!(bits(&p), bits(&p_full), "parameters");
    assert_eq!(bits(resumed.exp_avg()), bits(full.exp_avg()), "exp_avg");
    assert_eq!(
        bits(resumed.exp_avg_sq()),
        bits(full.exp_avg_sq()),
        "exp_avg_sq"
    );
    assert_eq!(
        resumed.max_exp_avg_sq().map(bits),
        full.max_exp_avg_sq().map(bits)
    );
}

#[test]
fn resume_after_save_load_is_bitwise_identical() {
    resume_is_bitwise(false);
}

#[test]
fn resume_with_amsgrad_is_bitwise_identical() {
    resume_is_bitwise(true);
}

/// An optimizer after two steps, saved to `dir/name`.
fn saved(dir: &Path, name: &str, amsgrad: bool) -> (AdamW, std::path::PathBuf) {
    let (mut p, grads) = data(2);
    let mut opt = AdamW::new(config(amsgrad), groups(), NUMEL).unwrap();
    for g in &grads {
        opt.step(&mut p, g, 1e-3).unwrap();
    }
    let path = dir.join(name);
    opt.save_state(&path).unwrap();
    (opt, path)
}

#[test]
fn file_layout_is_plain_safetensors_with_metadata() {
    let dir = tempfile::tempdir().unwrap();
    let (opt, path) = saved(dir.path(), "opt.safetensors", true);
    let bytes = std::fs::read(&path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut names = st.names();
    names.sort();
    assert_eq!(names, vec!["exp_avg", "exp_avg_sq", "max_exp_avg_sq"]);
    let view = st.tensor("exp_avg").unwrap();
    assert_eq!(view.dtype(), safetensors::Dtype::F32);
    assert_eq!(view.shape(), &[NUMEL]);
    assert_eq!(&view.data()[..4], &opt.exp_avg()[0].to_le_bytes());
    let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
    let meta = meta.metadata().as_ref().unwrap();
    assert_eq!(meta["step"], "2");
    assert_eq!(meta["numel"], NUMEL.to_string());
    let cfg: AdamWConfig = serde_json::from_str(&meta["config"]).unwrap();
    assert_eq!(cfg, config(true));
    let groups: serde_json::Value = serde_json::from_str(&meta["groups"]).unwrap();
    assert_eq!(groups[0]["name"], "decay");
}

fn view(dtype: safetensors::Dtype, n: usize, data: &[u8]) -> safetensors::tensor::TensorView<'_> {
    safetensors::tensor::TensorView::new(dtype, vec![n], data).unwrap()
}

fn expect_state_error(opt: &mut AdamW, path: &Path, needle: &str) {
    let before_step = opt.step_count();
    let before_m = bits(opt.exp_avg());
    match opt.load_state(path) {
        Err(OptimError::State { file, message }) => {
            assert_eq!(file, path);
            assert!(
                message.contains(needle),
                "message `{message}` should mention `{needle}`"
            );
        }
        other => panic!("expected OptimError::State, got {other:?}"),
    }
    assert_eq!(
        opt.step_count(),
        before_step,
        "a failed load changes nothing"
    );
    assert_eq!(bits(opt.exp_avg()), before_m);
}

#[test]
fn corrupt_and_mismatched_files_give_state_errors() {
    let dir = tempfile::tempdir().unwrap();
    let (_, path) = saved(dir.path(), "good.safetensors", false);
    let good = std::fs::read(&path).unwrap();
    let mut fresh = AdamW::new(config(false), groups(), NUMEL).unwrap();

    // Missing file.
    expect_state_error(
        &mut fresh,
        &dir.path().join("missing.safetensors"),
        "cannot read",
    );

    // Empty, garbage, truncated in the header, truncated in the data.
    let write = |name: &str, bytes: &[u8]| {
        let p = dir.path().join(name);
        std::fs::write(&p, bytes).unwrap();
        p
    };
    expect_state_error(&mut fresh, &write("empty", &[]), "safetensors");
    expect_state_error(
        &mut fresh,
        &write("garbage", b"not a safetensors file at all"),
        "safetensors",
    );
    expect_state_error(
        &mut fresh,
        &write("short_header", &good[..20]),
        "safetensors",
    );
    expect_state_error(
        &mut fresh,
        &write("short_data", &good[..good.len() - 4]),
        "safetensors",
    );

    // A header length that points far beyond the file.
    let mut huge = good.clone();
    huge[..8].copy_from_slice(&u64::MAX.to_le_bytes());
    expect_state_error(&mut fresh, &write("huge_header", &huge), "safetensors");

    // Valid safetensors, but not ours / wrong contents.
    let foreign = safetensors::serialize(
        [("weight", view(safetensors::Dtype::F32, 1, &[0u8; 4]))],
        None,
    )
    .unwrap();
    expect_state_error(&mut fresh, &write("foreign", &foreign), "metadata");

    // Another parameter count.
    let mut other = AdamW::new(config(false), vec![ParamGroup::whole("all", 10, 0.0)], 10).unwrap();
    expect_state_error(&mut other, &path, "parameters");

    // amsgrad mismatch in both directions.
    let mut ams = AdamW::new(config(true), groups(), NUMEL).unwrap();
    expect_state_error(&mut ams, &path, "amsgrad");
    let (_, ams_path) = saved(dir.path(), "ams.safetensors", true);
    expect_state_error(&mut fresh, &ams_path, "amsgrad");

    // Right metadata, wrong tensor length / dtype / missing tensor.
    let meta_of = |bytes: &[u8]| {
        let (_, m) = safetensors::SafeTensors::read_metadata(bytes).unwrap();
        m.metadata().clone()
    };
    let zeros = vec![0u8; 4 * NUMEL];
    let short = vec![0u8; 4 * (NUMEL - 1)];
    let wrong_len = safetensors::serialize(
        [
            ("exp_avg", view(safetensors::Dtype::F32, NUMEL - 1, &short)),
            ("exp_avg_sq", view(safetensors::Dtype::F32, NUMEL, &zeros)),
        ],
        meta_of(&good),
    )
    .unwrap();
    expect_state_error(&mut fresh, &write("wrong_len", &wrong_len), "shape");
    let wrong_dtype = safetensors::serialize(
        [
            ("exp_avg", view(safetensors::Dtype::I32, NUMEL, &zeros)),
            ("exp_avg_sq", view(safetensors::Dtype::F32, NUMEL, &zeros)),
        ],
        meta_of(&good),
    )
    .unwrap();
    expect_state_error(&mut fresh, &write("wrong_dtype", &wrong_dtype), "dtype");
    let missing = safetensors::serialize(
        [("exp_avg", view(safetensors::Dtype::F32, NUMEL, &zeros))],
        meta_of(&good),
    )
    .unwrap();
    expect_state_error(&mut fresh, &write("missing_tensor", &missing), "exp_avg_sq");

    // Bad step metadata.
    let mut meta = meta_of(&good).unwrap();
    meta.insert("step".into(), "five".into());
    let bad_step = safetensors::serialize(
        [
            ("exp_avg", view(safetensors::Dtype::F32, NUMEL, &zeros)),
            ("exp_avg_sq", view(safetensors::Dtype::F32, NUMEL, &zeros)),
        ],
        Some(meta),
    )
    .unwrap();
    expect_state_error(&mut fresh, &write("bad_step", &bad_step), "step");

    // The good file still loads after all that.
    fresh.load_state(&path).unwrap();
    assert_eq!(fresh.step_count(), 2);
}

#[test]
fn save_replaces_an_existing_file_and_fails_cleanly_on_a_bad_directory() {
    let dir = tempfile::tempdir().unwrap();
    let (mut opt, path) = saved(dir.path(), "opt.safetensors", false);
    let mut p = vec![0.0f32; NUMEL];
    opt.step(&mut p, &vec![0.5; NUMEL], 1e-3).unwrap();
    opt.save_state(&path).unwrap();
    let mut fresh = AdamW::new(config(false), groups(), NUMEL).unwrap();
    fresh.load_state(&path).unwrap();
    assert_eq!(fresh.step_count(), 3);

    let bad = dir.path().join("no_such_dir").join("opt.safetensors");
    assert!(matches!(
        opt.save_state(&bad),
        Err(OptimError::State { .. })
    ));
}
