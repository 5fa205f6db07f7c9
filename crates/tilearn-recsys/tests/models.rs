//! DeepFM and Wide & Deep: the analytic backward of the head (dense parameters and pooled
//! embeddings) against central finite differences in f64 on tiny models, exact AUC on cases
//! with known answers, and the batch's jagged ids.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use tilearn_recsys::data::{CtrBatch, MISSING};
use tilearn_recsys::model::{bce_with_logits, head_backward, head_forward};
use tilearn_recsys::{CtrConfig, ModelKind, auc};

fn tiny(model: ModelKind) -> CtrConfig {
    CtrConfig {
        model,
        num_dense: 2,
        field_rows: vec![5, 7, 3],
        embed_dim: 2,
        hidden: vec![4, 3],
        crosses: if model == ModelKind::WideDeep {
            vec![(0, 1), (1, 2)]
        } else {
            vec![]
        },
        cross_rows: 11,
    }
}

fn random(n: usize, rng: &mut ChaCha8Rng) -> Vec<f64> {
    (0..n).map(|_| rng.random_range(-1.0..1.0)).collect()
}

fn check_gradients(model: ModelKind) {
    let cfg = tiny(model);
    let layout = cfg.dense_layout();
    let width = cfg.table_layout().unwrap().total_dim();
    let batch = 5;
    let mut rng = ChaCha8Rng::seed_from_u64(9);
    let params = random(layout.numel, &mut rng);
    let emb = random(batch * width, &mut rng);
    let dense = random(batch * cfg.num_dense, &mut rng);
    let labels: Vec<f32> = (0..batch).map(|b| (b % 2) as f32).collect();
    let loss = |p: &[f64], e: &[f64]| {
        let (logits, _) = head_forward(&cfg, &layout, p, e, &dense, batch).unwrap();
        bce_with_logits(&logits, &labels)
    };
    let (logits, cache) = head_forward(&cfg, &layout, &params, &emb, &dense, batch).unwrap();
    let dlogits: Vec<f64> = logits
        .iter()
        .zip(&labels)
        .map(|(&z, &y)| (1.0 / (1.0 + (-z).exp()) - y as f64) / batch as f64)
        .collect();
    let mut dparams = vec![0.0; layout.numel];
    let mut demb = vec![f64::NAN; emb.len()];
    head_backward(
        &cfg,
        &layout,
        &params,
        &emb,
        &dense,
        &cache,
        &dlogits,
        &mut dparams,
        &mut demb,
    )
    .unwrap();
    let h = 1e-6;
    let fd = |i: usize, of_params: bool| {
        let (mut p, mut e) = (params.clone(), emb.clone());
        let x = if of_params { &mut p[i] } else { &mut e[i] };
        *x += h;
        let up = loss(&p, &e);
        let x = if of_params { &mut p[i] } else { &mut e[i] };
        *x -= 2.0 * h;
        (up - loss(&p, &e)) / (2.0 * h)
    };
    for (i, &got) in dparams.iter().enumerate() {
        let want = fd(i, true);
        assert!(
            (got - want).abs() < 1e-7 * (1.0 + want.abs()),
            "{model:?} dparam[{i}]: {got} vs {want}"
        );
    }
    for (i, &got) in demb.iter().enumerate() {
        let want = fd(i, false);
        assert!(
            (got - want).abs() < 1e-7 * (1.0 + want.abs()),
            "{model:?} demb[{i}]: {got} vs {want}"
        );
    }
}

#[test]
fn deepfm_backward_matches_finite_differences() {
    check_gradients(ModelKind::DeepFm);
}

#[test]
fn wide_deep_backward_matches_finite_differences() {
    check_gradients(ModelKind::WideDeep);
}

#[test]
fn auc_is_exact_on_known_cases() {
    let labels = [0.0, 0.0, 1.0, 1.0];
    assert_eq!(auc(&[0.1, 0.2, 0.3, 0.4], &labels), Some(1.0));
    assert_eq!(auc(&[0.4, 0.3, 0.2, 0.1], &labels), Some(0.0));
    assert_eq!(auc(&[0.5; 4], &labels), Some(0.5));
    // Pairs (pos, neg): (0.3 > 0.1), (0.3 < 0.35), (0.9 > both) -> 3 of 4; one tie adds 1/2.
    assert_eq!(auc(&[0.1, 0.35, 0.3, 0.9], &labels), Some(0.75));
    assert_eq!(auc(&[0.1, 0.3, 0.3, 0.9], &labels), Some(0.875));
    assert_eq!(auc(&[0.1, 0.2], &[1.0, 1.0]), None);
}

#[test]
fn jagged_ids_follow_the_table_order_and_skip_missing_fields() {
    let cfg = tiny(ModelKind::WideDeep);
    let mut batch = CtrBatch::new(2, 3);
    batch.labels = vec![1.0, 0.0];
    batch.dense = vec![0.0; 4];
    batch.cats = vec![10, MISSING, 12, 20, 21, 22];
    let jagged = cfg.jagged(&batch).unwrap();
    // 3 embedding + 3 first-order + 2 cross tables, 2 samples each.
    assert_eq!(jagged.num_tables(), 8);
    let lens: Vec<usize> = (0..8)
        .flat_map(|t| (0..2).map(move |b| (t, b)))
        .map(|(t, b)| jagged.bag(t, b).len())
        .collect();
    assert_eq!(lens, [1, 1, 0, 1, 1, 1, 1, 1, 0, 1, 1, 1, 0, 1, 0, 1]);
    // The embedding and first-order tables see the same value (same rows when same size).
    assert_eq!(
        jagged.ids()[jagged.bag(0, 0)],
        jagged.ids()[jagged.bag(3, 0)]
    );
}

#[test]
fn jagged_ids_are_each_tables_hash_of_its_value() {
    use tilearn_recsys::data::SyntheticCriteo;
    use tilearn_recsys::hash::{hash_to_row, mix64};
    let (data, _) = SyntheticCriteo::criteo_shaped(3, 50).generate(0, 300);
    assert!(
        data.cats.contains(&MISSING),
        "the sample has no empty field"
    );
    for model in [ModelKind::DeepFm, ModelKind::WideDeep] {
        let cfg = CtrConfig::for_fields(model, 13, 26, 97, 4, vec![8]);
        let jagged = cfg.jagged(&data).unwrap();
        let layout = cfg.table_layout().unwrap();
        let fields = 26;
        for (t, spec) in layout.specs().iter().enumerate() {
            for b in 0..data.len() {
                let cat = |f: usize| Some(data.cats[b * fields + f]).filter(|&v| v != MISSING);
                let value = if t < 2 * fields {
                    cat(t % fields)
                } else {
                    let (fa, fb) = cfg.crosses[t - 2 * fields];
                    cat(fa).zip(cat(fb)).map(|(a, c)| mix64(a) ^ c)
                };
                let want: Vec<u32> = value
                    .map(|v| hash_to_row(v, spec.rows))
                    .into_iter()
                    .collect();
                assert_eq!(
                    jagged.ids()[jagged.bag(t, b)],
                    want[..],
                    "{model:?} table {t} sample {b}"
                );
            }
        }
    }
}
