//! The GPU CTR trainer at scale: tables larger than the GPU (a row cache in pinned host
//! memory) and the MLP in bf16. One file, so the GPU bundle carries one executable.
//!
//! ## Row cache
//!
//! Tables larger than the GPU, on the GPU: rows in pinned host memory behind a device cache of
//! hot rows (`cuda::DeviceCachedEmbeddingBag`, used by `GpuCtrTrainer::with_row_cache` and
//! `tilearn ctr train --gpu-embedding-budget`).
//!
//! * `row_copy.cu` against its host reference (`cache::copy_elements`): random rows of mixed
//!   lengths (float4 and scalar paths) both ways between device memory and mapped pinned host
//!   memory; bit copies, so compared exactly.
//! * DeepFM trained through the cache (every other table in host memory with a cache of 64
//!   rows, one batch's worth, so rows are evicted and written back as the batches go) against
//!   the same model with
//!   every row on the GPU, for row-wise Adagrad and SparseAdam: every step's loss, the held-out
//!   loss and AUC, and after the run every table row, optimizer state and dense parameter,
//!   compared bit for bit (tolerance 0: each row's update sees the same contributions in the
//!   same order, only the rows' places differ, and every kernel is deterministic).
//!
//! ## bf16 MLP
//!
//! The MLP's GEMMs in bf16 (`cuda::MlpPrecision::Bf16`, `tilearn ctr train --precision bf16`)
//! against the f32 GPU model, which itself follows the CPU model to 1e-5 (`ctr_gpu.rs`).
//!
//! * Gradients of one batch, same weights: loss within 1e-2 relative, the dense gradient and
//!   the pooled embeddings' gradient within 5e-2 relative (‖bf16 − f32‖ / ‖f32‖). bf16 keeps 8
//!   significant bits (relative rounding 2^-9 ≈ 2e-3 per input); products of rounded inputs
//!   accumulated in f32 over a few hundred terms stay near that, and the ReLU masks agree except
//!   at pre-activations within rounding of 0, so a few 1e-3 are expected; 5e-2 leaves room,
//!   while a wrong layout or a missing cast gives errors of order 1.
//! * Training: DeepFM on the synthetic generator, 300 steps of 512 samples, the same batches in
//!   both precisions: held-out AUC within 0.01 and the last 50 steps' mean loss within 2 %
//!   (bf16 changes each step's rounding, not what is learned). The master weights stay f32:
//!   after training most dense parameters are not bf16-representable.
//!
//! Without a GPU or driver each test prints `skipped: <reason>` to stderr and passes.
#![cfg(feature = "cuda")]

use std::io::Write;
use std::sync::Arc;

use half::bf16;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use tilearn_ops::cuda::GpuDevice;
use tilearn_optim::AdamWConfig;
use tilearn_recsys::cache::{RowCacheReport, copy_elements};
use tilearn_recsys::cuda::row_copy::{
    MappedHost, copy_rows_to_device, copy_rows_to_host, upload_words,
};
use tilearn_recsys::cuda::{DeviceCtrModel, GpuCtrTrainer, MlpPrecision};
use tilearn_recsys::data::SyntheticCriteo;
use tilearn_recsys::train::{LogRecord, TrainOptions, train};
use tilearn_recsys::{CtrConfig, CtrModel, CtrStepper, ModelKind, SparseOptimizer};

fn gpu_or_skip(test: &str) -> Option<GpuDevice> {
    match GpuDevice::new(0) {
        Ok(dev) => Some(dev),
        Err(e) => {
            let _ = writeln!(std::io::stderr().lock(), "skipped: {test}: {e}");
            None
        }
    }
}

/// `n` disjoint copies between buffers of `len` elements: rows of 1..=40 elements (some
/// multiples of 4, some not) at random places, each destination range used once.
fn random_copies(len: usize, n: usize, seed: u64) -> Vec<[u64; 3]> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let row = 40;
    let rows = len / row;
    let mut dst_rows: Vec<usize> = (0..rows).collect();
    for i in (1..rows).rev() {
        dst_rows.swap(i, rng.random_range(0..=i));
    }
    (0..n)
        .map(|i| {
            let size = if rng.random_bool(0.5) {
                4 * rng.random_range(1..=10)
            } else {
                rng.random_range(1..=row)
            };
            let src = rng.random_range(0..rows) * row;
            // Unaligned starts too (a row of an odd-dim table).
            let shift = if size % 4 == 0 {
                0
            } else {
                rng.random_range(0..row - size + 1)
            };
            [
                (src + shift) as u64,
                (dst_rows[i] * row + shift) as u64,
                size as u64,
            ]
        })
        .collect()
}

#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn row_copy_kernel_matches_the_host_copies() {
    let Some(dev) = gpu_or_skip("row_copy_kernel_matches_the_host_copies") else {
        return;
    };
    let stream = dev.stream();
    let len = 40 * 997;
    let mut rng = ChaCha8Rng::seed_from_u64(3);
    let device_values: Vec<f32> = (0..len).map(|_| rng.random_range(-1.0..1.0)).collect();
    let host_values: Vec<f32> = (0..len).map(|_| rng.random_range(-1.0..1.0)).collect();
    let mut device = stream.clone_htod(&device_values).unwrap();
    let mut host = MappedHost::new(stream, &host_values).unwrap();
    let mut words = stream.alloc_zeros::<u64>(3).unwrap();

    // Device → host.
    let copies = random_copies(len, 700, 4);
    let flat: Vec<u64> = copies.iter().flatten().copied().collect();
    upload_words(stream, &mut words, &flat).unwrap();
    let list = words.slice(..flat.len());
    copy_rows_to_host(stream, &device, &mut host, &list, copies.len()).unwrap();
    stream.synchronize().unwrap();
    let mut want = host_values.clone();
    copy_elements(&device_values, &mut want, &copies);
    assert!(
        host.as_slice().unwrap() == want.as_slice(),
        "device → host copies differ"
    );

    // Host → device.
    let copies = random_copies(len, 500, 5);
    let flat: Vec<u64> = copies.iter().flatten().copied().collect();
    upload_words(stream, &mut words, &flat).unwrap();
    let list = words.slice(..flat.len());
    copy_rows_to_device(stream, &host, &mut device, &list, copies.len()).unwrap();
    let got = stream.clone_dtoh(&device).unwrap();
    let mut want_device = device_values.clone();
    copy_elements(&want, &mut want_device, &copies);
    assert!(got == want_device, "host → device copies differ");
}

fn small_deepfm(sparse: SparseOptimizer) -> CtrModel {
    // 13 dense features, 26 fields of 3,001 rows (odd), dim 8; 52 tables with first-order.
    let config = CtrConfig::for_fields(ModelKind::DeepFm, 13, 26, 3001, 8, vec![32, 16]);
    let dense = AdamWConfig {
        lr: 3e-3,
        weight_decay: 0.0,
        ..AdamWConfig::default()
    };
    CtrModel::new(config, sparse, dense, 11).unwrap()
}

struct Run {
    losses: Vec<f64>,
    records: Vec<LogRecord>,
    model: CtrModel,
    report: Option<RowCacheReport>,
}

fn run(mut trainer: GpuCtrTrainer) -> Run {
    // A wide vocabulary, so the hashed rows spread over the tables and the caches churn.
    let generator = SyntheticCriteo::criteo_shaped(21, 200_000);
    let data = Arc::new(generator.generate(0, 64 * 40).0);
    // At most 64 distinct rows per table in one evaluation chunk, as in a training batch.
    let eval = generator.generate(1 << 30, 64).0;
    let options = TrainOptions {
        steps: 40,
        batch_size: 64,
        dense_lr: 3e-3,
        eval_every: 20,
        seed: 5,
        save: None,
        resume: None,
    };
    let mut losses = Vec::new();
    let records = train(
        &mut trainer,
        data,
        &eval,
        &options,
        |_, loss| losses.push(loss),
        |_| Ok(()),
    )
    .unwrap();
    let report = trainer.row_cache().unwrap();
    Run {
        losses,
        records,
        model: trainer.into_host().unwrap(),
        report,
    }
}

#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn training_through_the_row_cache_equals_all_rows_on_the_gpu() {
    let Some(dev) = gpu_or_skip("training_through_the_row_cache_equals_all_rows_on_the_gpu") else {
        return;
    };
    let stream = dev.stream();
    for sparse in [
        SparseOptimizer::row_wise_adagrad(0.05),
        SparseOptimizer::adam(2e-3),
    ] {
        let whole = run(GpuCtrTrainer::new(stream, small_deepfm(sparse)).unwrap());
        // Every other table in host memory with a cache of 64 of its 3,001 rows (the most
        // distinct rows a batch or the evaluation chunk can use: the first-seen rows of a
        // field evict others soon); the rest whole on the device.
        let model = small_deepfm(sparse);
        let slots: Vec<usize> = (model.tables.layout.specs().iter().enumerate())
            .map(|(t, s)| if t % 2 == 0 { 64 } else { s.rows })
            .collect();
        let cached = run(GpuCtrTrainer::with_row_cache(stream, model, &slots).unwrap());

        let first_diff = (cached.losses.iter().zip(&whole.losses)).position(|(c, w)| c != w);
        assert!(
            first_diff.is_none() && cached.losses.len() == whole.losses.len(),
            "{sparse:?}: step losses differ from step {first_diff:?}: {:?} vs {:?}",
            first_diff.map(|i| cached.losses[i]),
            first_diff.map(|i| whole.losses[i]),
        );
        for (c, w) in cached.records.iter().zip(&whole.records) {
            assert_eq!(
                c.eval_loss, w.eval_loss,
                "{sparse:?}: held-out loss differs"
            );
            assert_eq!(c.eval_auc, w.eval_auc, "{sparse:?}: held-out AUC differs");
        }
        let (c, w) = (&cached.model, &whole.model);
        let rows_differ = (c.tables.weights.iter().zip(&w.tables.weights))
            .filter(|(a, b)| a != b)
            .count();
        assert!(
            rows_differ == 0 && c.tables.weights.len() == w.tables.weights.len(),
            "{sparse:?}: {rows_differ} table elements differ"
        );
        assert_eq!(
            c.sparse, w.sparse,
            "{sparse:?}: sparse optimizer state differs"
        );
        assert!(c.dense == w.dense, "{sparse:?}: dense parameters differ");

        let report = cached.report.expect("a cached run reports its cache");
        let log = cached.records[0]
            .row_cache
            .clone()
            .expect("records carry the cache");
        eprintln!("{sparse:?}: {report:?}\nfirst window: {log:?}");
        assert!(whole.report.is_none() && whole.records[0].row_cache.is_none());
        let stats = report.stats;
        assert!(stats.evictions > 0 && stats.write_backs > 0, "{stats:?}");
        let rate = report.hit_rate().unwrap();
        assert!(rate > 0.0 && rate < 1.0, "hit rate {rate}");
        assert!(log.copy_gb_per_s.is_some_and(|g| g > 0.0), "{log:?}");
    }
}

fn rel_err(got: &[f32], want: &[f32]) -> f64 {
    assert_eq!(got.len(), want.len());
    assert!(got.iter().all(|x| x.is_finite()), "non-finite GPU value");
    let diff: f64 = (got.iter().zip(want))
        .map(|(&g, &w)| (g as f64 - w as f64).powi(2))
        .sum();
    let norm: f64 = want.iter().map(|&w| (w as f64).powi(2)).sum();
    (diff / norm.max(1e-30)).sqrt()
}

fn deepfm(seed: u64) -> CtrModel {
    let config = CtrConfig::for_fields(ModelKind::DeepFm, 13, 26, 2003, 16, vec![256, 128]);
    let dense = AdamWConfig {
        lr: 3e-3,
        weight_decay: 0.0,
        ..AdamWConfig::default()
    };
    CtrModel::new(config, SparseOptimizer::row_wise_adagrad(0.05), dense, seed).unwrap()
}

#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn bf16_mlp_gradients_are_close_to_f32() {
    let Some(dev) = gpu_or_skip("bf16_mlp_gradients_are_close_to_f32") else {
        return;
    };
    let stream = dev.stream();
    let model = deepfm(3);
    let generator = SyntheticCriteo::criteo_shaped(4, 5000);
    let batch = generator.generate(0, 777).0;
    let jagged = model.config.jagged(&batch).unwrap();
    let mut f32_model = DeviceCtrModel::new(stream, &model).unwrap();
    let mut bf16_model = DeviceCtrModel::new(stream, &model).unwrap();
    bf16_model.set_mlp_precision(MlpPrecision::Bf16).unwrap();
    assert_eq!(bf16_model.mlp_precision(), MlpPrecision::Bf16);
    let (loss, dense, demb) = f32_model.gradients(&batch, &jagged).unwrap();
    let (loss_h, dense_h, demb_h) = bf16_model.gradients(&batch, &jagged).unwrap();
    let (e_dense, e_emb) = (rel_err(&dense_h, &dense), rel_err(&demb_h, &demb));
    let e_loss = ((loss_h - loss) / loss).abs();
    eprintln!("bf16 vs f32: loss {e_loss:e}, dense grad {e_dense:e}, embedding grad {e_emb:e}");
    assert!(e_loss <= 1e-2, "loss {loss_h} vs {loss}");
    assert!(e_dense <= 5e-2, "dense gradient relative error {e_dense:e}");
    assert!(e_emb <= 5e-2, "embedding gradient relative error {e_emb:e}");
    // Not the f32 result: the products really ran in bf16.
    assert!(e_dense > 0.0);
}

#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn bf16_mlp_trains_as_well_as_f32() {
    let Some(dev) = gpu_or_skip("bf16_mlp_trains_as_well_as_f32") else {
        return;
    };
    let generator = SyntheticCriteo::criteo_shaped(6, 1000);
    let data = Arc::new(generator.generate_parallel(0, 512 * 300).0);
    let eval = generator.generate_parallel(1 << 32, 20_000).0;
    let options = TrainOptions {
        steps: 300,
        batch_size: 512,
        dense_lr: 3e-3,
        eval_every: 300,
        seed: 7,
        save: None,
        resume: None,
    };
    let mut results = Vec::new();
    for precision in [MlpPrecision::F32, MlpPrecision::Bf16] {
        let mut trainer = GpuCtrTrainer::new(dev.stream(), deepfm(9)).unwrap();
        trainer.device().set_mlp_precision(precision).unwrap();
        let mut losses = Vec::new();
        let records = train(
            &mut trainer,
            data.clone(),
            &eval,
            &options,
            |_, loss| losses.push(loss),
            |_| Ok(()),
        )
        .unwrap();
        let tail = losses[losses.len() - 50..].iter().sum::<f64>() / 50.0;
        let auc = records.last().unwrap().eval_auc.unwrap();
        let rate = records.last().unwrap().samples_per_sec;
        eprintln!(
            "{precision:?}: last-50 loss {tail:.5}, held-out AUC {auc:.5}, {rate:.0} samples/s"
        );
        results.push((tail, auc, trainer.into_host().unwrap()));
    }
    let ((loss32, auc32, _), (loss16, auc16, model16)) = (&results[0], &results[1]);
    assert!(
        (auc16 - auc32).abs() <= 0.01,
        "AUC {auc16} (bf16) vs {auc32} (f32)"
    );
    assert!(
        ((loss16 - loss32) / loss32).abs() <= 0.02,
        "loss {loss16} (bf16) vs {loss32} (f32)"
    );
    let not_bf16 = (model16.dense.iter())
        .filter(|&&w| bf16::from_f32(w).to_f32() != w)
        .count();
    assert!(
        not_bf16 > model16.dense.len() / 2,
        "only {not_bf16} of {} master weights are off the bf16 grid",
        model16.dense.len()
    );
}
