//! Training on the synthetic Criteo-shaped data reaches an AUC close to the generator's ground
//! truth (the AUC of the true logits on the same held-out samples), for both models, and a saved
//! model predicts exactly what the trained one does.

use std::sync::Arc;

use tilearn_optim::AdamWConfig;
use tilearn_recsys::data::SyntheticCriteo;
use tilearn_recsys::model::io::{load_model, save_model};
use tilearn_recsys::train::{TrainOptions, train};
use tilearn_recsys::{CtrConfig, CtrModel, ModelKind, SparseOptimizer, auc};

/// How far below the ground-truth AUC a short CPU run may end.
const MARGIN: f64 = 0.035;

fn run(model: ModelKind) -> (CtrModel, f64, f64) {
    let generator = SyntheticCriteo::criteo_shaped(11, 50);
    let (train_data, _) = generator.generate(0, 60_000);
    let (eval_data, true_logits) = generator.generate(1_000_000, 4_000);
    let scores: Vec<f32> = true_logits.iter().map(|&z| z as f32).collect();
    let truth = auc(&scores, &eval_data.labels).unwrap();
    let config = CtrConfig::for_fields(model, 13, 26, 1000, 8, vec![32, 16]);
    let dense = AdamWConfig {
        lr: 3e-3,
        ..AdamWConfig::default()
    };
    let mut ctr = CtrModel::new(config, SparseOptimizer::row_wise_adagrad(0.02), dense, 1).unwrap();
    let options = TrainOptions {
        steps: 900,
        batch_size: 256,
        dense_lr: 3e-3,
        eval_every: 450,
        seed: 5,
        save: None,
        resume: None,
    };
    let records = train(
        &mut ctr,
        Arc::new(train_data),
        &eval_data,
        &options,
        |_, _| {},
        |_| Ok(()),
    )
    .unwrap();
    assert_eq!(records.len(), 2);
    assert!(records[1].loss < records[0].loss, "{records:?}");
    let got = records[1].eval_auc.unwrap();
    eprintln!("{model:?}: held-out AUC {got:.4}, ground truth {truth:.4}");
    (ctr, got, truth)
}

#[test]
fn deepfm_approaches_the_ground_truth_auc() {
    let (_, got, truth) = run(ModelKind::DeepFm);
    assert!(
        got > truth - MARGIN,
        "DeepFM AUC {got:.4}, ground truth {truth:.4}"
    );
}

#[test]
fn wide_deep_approaches_the_ground_truth_auc_and_saves() {
    let (model, got, truth) = run(ModelKind::WideDeep);
    assert!(
        got > truth - MARGIN,
        "Wide & Deep AUC {got:.4}, ground truth {truth:.4}"
    );
    let dir = tempfile::tempdir().unwrap();
    save_model(dir.path(), &model.config, &model.tables, &model.dense).unwrap();
    let saved = load_model(dir.path()).unwrap();
    assert_eq!(
        (&saved.config, &saved.tables, &saved.dense),
        (&model.config, &model.tables, &model.dense)
    );
}
