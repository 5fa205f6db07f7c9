//! `ctr train` checkpoints resume exactly: N steps, a checkpoint, N more steps after a resume
//! give byte-identical files to 2N steps straight (DeepFM with row-wise Adagrad and with Adam);
//! a damaged or missing checkpoint file, or a checkpoint of another config, is refused with an
//! error naming the file or field.

use std::path::Path;
use std::sync::Arc;

use tilearn_optim::AdamWConfig;
use tilearn_recsys::checkpoint::{
    OPTIMIZER_FILE, SPARSE_OPTIMIZER_FILE, TRAINER_STATE_FILE, TrainerState, checkpoint_dir,
    checkpoints, load_checkpoint,
};
use tilearn_recsys::data::SyntheticCriteo;
use tilearn_recsys::model::io::{MODEL_FILE, save_model};
use tilearn_recsys::train::{SavePolicy, TrainOptions, train};
use tilearn_recsys::{CtrBatch, CtrConfig, CtrModel, ModelKind, SparseOptimizer};

/// Steps before the checkpoint (and after the resume); 1100 samples / 64 = 18 batches per
/// epoch, so the resumed half crosses an epoch boundary.
const HALF: usize = 12;

fn data() -> CtrBatch {
    SyntheticCriteo::criteo_shaped(3, 40).generate(0, 1100).0
}

fn model(sparse: SparseOptimizer, embed_dim: usize) -> CtrModel {
    let config = CtrConfig::for_fields(ModelKind::DeepFm, 13, 26, 97, embed_dim, vec![16, 8]);
    let dense = AdamWConfig {
        lr: 3e-3,
        weight_decay: 0.01,
        ..AdamWConfig::default()
    };
    CtrModel::new(config, sparse, dense, 7).unwrap()
}

fn options(steps: usize, out: &Path, every: usize) -> TrainOptions {
    TrainOptions {
        steps,
        batch_size: 64,
        dense_lr: 3e-3,
        eval_every: 1000,
        seed: 9,
        save: Some(SavePolicy {
            output_dir: out.to_path_buf(),
            every,
            keep: None,
        }),
        resume: None,
    }
}

fn run(ctr: &mut CtrModel, options: &TrainOptions) {
    let empty = CtrBatch::new(13, 26);
    train(
        ctr,
        Arc::new(data()),
        &empty,
        options,
        |_, _| {},
        |_| Ok(()),
    )
    .unwrap();
}

fn read(path: &Path) -> Vec<u8> {
    std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Fails with the first differing byte (not the whole files) unless `a` and `b` are equal.
fn assert_same_bytes(a: &Path, b: &Path, what: &str) {
    let (a, b) = (read(a), read(b));
    let first = a.iter().zip(&b).position(|(x, y)| x != y);
    assert!(
        a.len() == b.len() && first.is_none(),
        "{what}: {} vs {} bytes, first difference at {first:?}",
        a.len(),
        b.len()
    );
}

/// Trains 2·HALF steps straight and HALF + resume + HALF; returns both output dirs.
fn straight_and_resumed(sparse: SparseOptimizer) -> (tempfile::TempDir, tempfile::TempDir) {
    let straight = tempfile::tempdir().unwrap();
    let mut ctr = model(sparse, 4);
    run(&mut ctr, &options(2 * HALF, straight.path(), HALF));
    save_model(straight.path(), &ctr.config, &ctr.tables, &ctr.dense).unwrap();

    let resumed = tempfile::tempdir().unwrap();
    let mut first = model(sparse, 4);
    run(&mut first, &options(HALF, resumed.path(), HALF));
    drop(first);
    let mut ctr = model(sparse, 4);
    let state = load_checkpoint(&checkpoint_dir(resumed.path(), HALF), &mut ctr).unwrap();
    assert_eq!(state.step, HALF);
    assert_eq!(state.samples_seen, (HALF * 64) as u64);
    let mut opts = options(2 * HALF, resumed.path(), HALF);
    opts.resume = Some(state);
    run(&mut ctr, &opts);
    save_model(resumed.path(), &ctr.config, &ctr.tables, &ctr.dense).unwrap();
    (straight, resumed)
}

fn assert_exact_resume(sparse: SparseOptimizer) {
    let (straight, resumed) = straight_and_resumed(sparse);
    assert_same_bytes(
        &straight.path().join(MODEL_FILE),
        &resumed.path().join(MODEL_FILE),
        &format!("final model after a resume ({sparse:?})"),
    );
    for file in [
        MODEL_FILE,
        OPTIMIZER_FILE,
        SPARSE_OPTIMIZER_FILE,
        TRAINER_STATE_FILE,
    ] {
        let a = checkpoint_dir(straight.path(), 2 * HALF).join(file);
        let b = checkpoint_dir(resumed.path(), 2 * HALF).join(file);
        assert_same_bytes(&a, &b, &format!("{file} after a resume ({sparse:?})"));
    }
    // The straight run's first half really moved the model: the resume restored something.
    assert_ne!(
        read(&checkpoint_dir(straight.path(), HALF).join(MODEL_FILE)),
        read(&straight.path().join(MODEL_FILE))
    );
}

#[test]
fn resume_is_exact_with_row_wise_adagrad() {
    assert_exact_resume(SparseOptimizer::row_wise_adagrad(0.05));
}

#[test]
fn resume_is_exact_with_sparse_adam() {
    assert_exact_resume(SparseOptimizer::adam(0.01));
}

/// A checkpoint after HALF steps of the Adagrad run, in a temp dir.
fn one_checkpoint() -> (tempfile::TempDir, std::path::PathBuf) {
    let out = tempfile::tempdir().unwrap();
    let mut ctr = model(SparseOptimizer::row_wise_adagrad(0.05), 4);
    run(&mut ctr, &options(HALF, out.path(), HALF));
    let dir = checkpoint_dir(out.path(), HALF);
    (out, dir)
}

fn resume_error(dir: &Path, sparse: SparseOptimizer, embed_dim: usize) -> String {
    let mut ctr = model(sparse, embed_dim);
    load_checkpoint(dir, &mut ctr).unwrap_err().to_string()
}

#[test]
fn damaged_or_missing_files_are_refused_naming_them() {
    let adagrad = SparseOptimizer::row_wise_adagrad(0.05);
    for file in [
        MODEL_FILE,
        OPTIMIZER_FILE,
        SPARSE_OPTIMIZER_FILE,
        TRAINER_STATE_FILE,
    ] {
        let (_out, dir) = one_checkpoint();
        let path = dir.join(file);
        let bytes = read(&path);
        std::fs::write(&path, &bytes[..bytes.len() / 2]).unwrap();
        let err = resume_error(&dir, adagrad, 4);
        assert!(err.contains(file), "truncated {file}: {err}");
        assert!(err.contains("resume from another checkpoint"), "{err}");
        std::fs::remove_file(&path).unwrap();
        let err = resume_error(&dir, adagrad, 4);
        assert!(err.contains(file), "missing {file}: {err}");
    }
    let err = resume_error(Path::new("/nonexistent/checkpoint-3"), adagrad, 4);
    assert!(err.contains("not a directory"), "{err}");
}

#[test]
fn another_config_or_optimizer_is_refused_naming_the_field() {
    let (_out, dir) = one_checkpoint();
    let err = resume_error(&dir, SparseOptimizer::row_wise_adagrad(0.05), 8);
    assert!(err.contains("`embed_dim`"), "{err}");
    let err = resume_error(&dir, SparseOptimizer::adam(0.01), 4);
    assert!(err.contains("--sparse-optimizer"), "{err}");

    // Another batch size than the checkpoint's: refused by the training loop, naming it.
    let mut ctr = model(SparseOptimizer::row_wise_adagrad(0.05), 4);
    let state: TrainerState = load_checkpoint(&dir, &mut ctr).unwrap();
    let mut opts = options(2 * HALF, dir.parent().unwrap(), HALF);
    opts.batch_size = 32;
    opts.resume = Some(state);
    let empty = CtrBatch::new(13, 26);
    let err = train(
        &mut ctr,
        Arc::new(data()),
        &empty,
        &opts,
        |_, _| {},
        |_| Ok(()),
    )
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("`batch_size`") && err.contains("--batch-size"),
        "{err}"
    );
}

#[test]
fn save_total_limit_keeps_the_newest_and_staging_is_gone() {
    let out = tempfile::tempdir().unwrap();
    let mut ctr = model(SparseOptimizer::row_wise_adagrad(0.05), 4);
    let mut opts = options(10, out.path(), 2);
    opts.save.as_mut().unwrap().keep = Some(2);
    run(&mut ctr, &opts);
    let steps: Vec<usize> = checkpoints(out.path())
        .into_iter()
        .map(|(s, _)| s)
        .collect();
    assert_eq!(steps, [8, 10]);
    let leftovers: Vec<_> = std::fs::read_dir(out.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .filter(|n| n.to_string_lossy().ends_with(".tmp"))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
}

#[test]
fn a_failed_save_keeps_the_previous_checkpoint() {
    let (out, dir) = one_checkpoint();
    let before: Vec<Vec<u8>> = [MODEL_FILE, OPTIMIZER_FILE]
        .iter()
        .map(|f| read(&dir.join(f)))
        .collect();
    // The next checkpoint's staging path is taken by a file: that save must fail, naming it.
    let blocked = out.path().join(format!("checkpoint-{}.tmp", 2 * HALF));
    std::fs::write(&blocked, b"not a directory").unwrap();
    let mut ctr = model(SparseOptimizer::row_wise_adagrad(0.05), 4);
    let mut opts = options(2 * HALF, out.path(), HALF);
    opts.resume = Some(load_checkpoint(&dir, &mut ctr).unwrap());
    let empty = CtrBatch::new(13, 26);
    let err = train(
        &mut ctr,
        Arc::new(data()),
        &empty,
        &opts,
        |_, _| {},
        |_| Ok(()),
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains(&blocked.display().to_string()), "{err}");
    let steps: Vec<usize> = checkpoints(out.path())
        .into_iter()
        .map(|(s, _)| s)
        .collect();
    assert_eq!(steps, [HALF]);
    for (file, bytes) in [MODEL_FILE, OPTIMIZER_FILE].iter().zip(before) {
        assert_eq!(read(&dir.join(file)), bytes, "{file} changed");
    }
    let mut again = model(SparseOptimizer::row_wise_adagrad(0.05), 4);
    load_checkpoint(&dir, &mut again).unwrap();
}
