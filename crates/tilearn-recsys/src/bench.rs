//! End-to-end CTR training throughput (`tilearn ctr bench`): a model trained on synthetic
//! Criteo-shaped data for a fixed number of batches, timed step by step, then evaluated on a
//! held-out split (exact AUC beside the generator's ground truth). The same samples, in the same
//! batches, can be exported ([`crate::data::export`]) for the PyTorch DeepFM of
//! `benches/pytorch_recsys_baseline.py`, so both report samples/s and AUC after the same
//! samples.

use std::sync::Arc;
use std::time::Instant;

use serde::Serialize;

use crate::cache::RowCacheLog;
use crate::data::{CtrBatch, SyntheticCriteo, epoch_order, gather};
use crate::error::Result;
use crate::metrics::auc;
use crate::stepper::CtrStepper;
use crate::train::{TrainOptions, train};

/// What to run.
#[derive(Debug, Clone, PartialEq)]
pub struct CtrBenchOptions {
    pub batch_size: usize,
    /// Timed steps (one epoch of `steps * batch_size` samples).
    pub steps: usize,
    /// Steps left out of the steady-state rate (first-call setup: allocation, GEMM heuristics).
    pub warmup: usize,
    pub eval_samples: usize,
    pub seed: u64,
    pub dense_lr: f32,
}

/// The samples of a run: training (generation order), held-out, and the ground truth's AUC.
#[derive(Debug)]
pub struct CtrBenchData {
    pub train: Arc<CtrBatch>,
    pub eval: CtrBatch,
    pub truth_auc: Option<f64>,
}

impl CtrBenchData {
    /// `steps * batch_size` training and `eval_samples` held-out samples of `generator`.
    pub fn generate(generator: &SyntheticCriteo, options: &CtrBenchOptions) -> Self {
        let n = options.steps * options.batch_size;
        let (train, _) = generator.generate_parallel(0, n);
        let (eval, logits) = generator.generate_parallel(1 << 40, options.eval_samples);
        let scores: Vec<f32> = logits.iter().map(|&z| z as f32).collect();
        CtrBenchData {
            train: Arc::new(train),
            truth_auc: auc(&scores, &eval.labels),
            eval,
        }
    }

    /// The training samples in the order the loop consumes them (the seeded shuffle of epoch
    /// 0), so a baseline reading them sequentially in batches sees the same batches.
    pub fn train_in_step_order(&self, seed: u64) -> CtrBatch {
        gather(&self.train, &epoch_order(self.train.len(), seed, 0))
    }
}

/// One JSON line of `tilearn ctr bench`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CtrBenchRecord {
    pub bench: &'static str,
    #[serde(rename = "impl")]
    pub implementation: &'static str,
    pub device: String,
    pub model: String,
    pub batch: usize,
    pub steps: usize,
    pub samples: usize,
    /// Wall clock over every step (first-call setup and waits for the loader included).
    pub samples_per_sec: f64,
    /// Wall clock over the steps after the warm-up (loader waits included).
    pub steady_samples_per_sec: f64,
    /// Inside the steps only (the training loop's own figure: loader waits excluded).
    pub step_samples_per_sec: f64,
    pub step_ms_median: f64,
    pub final_train_loss: f64,
    pub eval_loss: Option<f64>,
    pub eval_auc: Option<f64>,
    pub ground_truth_auc: Option<f64>,
    /// The row cache over the timed steps (tables over the device's embedding budget).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub row_cache: Option<RowCacheLog>,
    /// Set by the caller: the MLP's GEMM precision on the GPU (`fp32`, `bf16`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mlp_precision: Option<String>,
    /// Set by the caller: where the tables lived (e.g. which were in host memory).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub placement: Option<serde_json::Value>,
}

/// Trains `model` on `data` as `options` say and measures it.
pub fn run_bench(
    model: &mut impl CtrStepper,
    data: &CtrBenchData,
    options: &CtrBenchOptions,
    device: &str,
) -> Result<CtrBenchRecord> {
    let train_options = TrainOptions {
        steps: options.steps,
        batch_size: options.batch_size,
        dense_lr: options.dense_lr,
        eval_every: options.steps,
        seed: options.seed,
        save: None,
        resume: None,
    };
    let started = Instant::now();
    let mut step_ends = Vec::with_capacity(options.steps);
    let mut last_loss = f64::NAN;
    let records = train(
        model,
        data.train.clone(),
        &data.eval,
        &train_options,
        |_, loss| {
            step_ends.push(started.elapsed().as_secs_f64());
            last_loss = loss;
        },
        |_| Ok(()),
    )?;
    let record = records.last();
    let mut durations: Vec<f64> = std::iter::once(0.0)
        .chain(step_ends.iter().copied())
        .collect::<Vec<_>>()
        .windows(2)
        .map(|w| w[1] - w[0])
        .collect();
    let warmup = options.warmup.min(step_ends.len().saturating_sub(1));
    let steady_time = step_ends.last().copied().unwrap_or(0.0)
        - if warmup == 0 {
            0.0
        } else {
            step_ends[warmup - 1]
        };
    let steady_samples = (step_ends.len() - warmup) * options.batch_size;
    durations.sort_by(f64::total_cmp);
    Ok(CtrBenchRecord {
        bench: "ctr_e2e",
        implementation: "tilearn",
        device: device.to_string(),
        model: format!("{:?}", model.config().model),
        batch: options.batch_size,
        steps: step_ends.len(),
        samples: step_ends.len() * options.batch_size,
        samples_per_sec: (step_ends.len() * options.batch_size) as f64
            / step_ends.last().copied().unwrap_or(0.0).max(1e-9),
        step_samples_per_sec: record.map_or(0.0, |r| r.samples_per_sec),
        steady_samples_per_sec: steady_samples as f64 / steady_time.max(1e-9),
        step_ms_median: durations.get(durations.len() / 2).copied().unwrap_or(0.0) * 1e3,
        final_train_loss: last_loss,
        eval_loss: record.and_then(|r| r.eval_loss),
        eval_auc: record.and_then(|r| r.eval_auc),
        ground_truth_auc: data.truth_auc,
        row_cache: record.and_then(|r| r.row_cache.clone()),
        mlp_precision: None,
        placement: None,
    })
}
