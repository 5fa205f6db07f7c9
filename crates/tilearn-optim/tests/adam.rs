//! Adam (torch L2 semantics) against a textbook f64 reference, groups, amsgrad, thread-count
//! independence, state save/load and validation errors.

// Groups take a list of ranges; a list holding a single range is intended here.
#![allow(clippy::single_range_in_vec_init)]

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use tilearn_optim::{Adam, AdamConfig, AdamStepScalars, OptimError, ParamGroup, Sgd, SgdConfig};

const NUMEL: usize = 40_000;

/// Two groups with a gap between them and a tail outside every group; spans several of the
/// optimizer's parallel chunks (16 384 elements). Returns the groups and each element's
/// weight decay (NaN: in no group).
fn two_groups() -> (Vec<ParamGroup>, Vec<f64>) {
    let (a, b, c) = (0..20_000, 20_100..35_000, 36_000..NUMEL - 500);
    let groups = vec![
        ParamGroup::new("decay", vec![a.clone(), c.clone()], 0.01),
        ParamGroup::new("no_decay", vec![b.clone()], 0.0),
    ];
    let mut wd = vec![f64::NAN; NUMEL];
    for r in [a, c] {
        wd[r].iter_mut().for_each(|w| *w = 0.01);
    }
    wd[b].iter_mut().for_each(|w| *w = 0.0);
    (groups, wd)
}

/// Textbook torch.optim.Adam for one element, in f64.
#[derive(Clone, Copy, Default)]
struct RefElem {
    p: f64,
    m: f64,
    v: f64,
    vmax: f64,
}

impl RefElem {
    fn step(&mut self, g: f64, t: i32, lr: f64, wd: f64, amsgrad: bool) {
        let g = g + wd * self.p;
        self.m = 0.9 * self.m + 0.1 * g;
        self.v = 0.999 * self.v + (1.0 - 0.999) * g * g;
        self.vmax = self.vmax.max(self.v);
        let second = if amsgrad { self.vmax } else { self.v };
        let m_hat = self.m / (1.0 - 0.9f64.powi(t));
        let v_hat = second / (1.0 - 0.999f64.powi(t));
        self.p -= lr * m_hat / (v_hat.sqrt() + 1e-8);
    }
}

fn rel_err(a: &[f32], b: &[f64]) -> f64 {
    let num: f64 = a
        .iter()
        .zip(b)
        .map(|(&x, &y)| (f64::from(x) - y).powi(2))
        .sum::<f64>()
        .sqrt();
    let den: f64 = b.iter().map(|y| y * y).sum::<f64>().sqrt();
    assert!(num.is_finite() && den > 0.0, "NaN never passes");
    num / den
}

fn random(rng: &mut ChaCha8Rng, n: usize, scale: f32) -> Vec<f32> {
    (0..n)
        .map(|_| rng.random_range(-1.0f32..1.0) * scale)
        .collect()
}

fn run_against_reference(amsgrad: bool) {
    let config = AdamConfig {
        amsgrad,
        ..AdamConfig::default()
    };
    let (groups, wd) = two_groups();
    let mut opt = Adam::new(config, groups, NUMEL).unwrap();
    let mut rng = ChaCha8Rng::seed_from_u64(7);
    let mut params = random(&mut rng, NUMEL, 1.0);
    let initial = params.clone();
    let mut refs: Vec<RefElem> = params
        .iter()
        .map(|&p| RefElem {
            p: f64::from(p),
            ..RefElem::default()
        })
        .collect();
    for t in 1..=20 {
        let scale = if t % 3 == 0 { 0.05 } else { 1.0 };
        let grads = random(&mut rng, NUMEL, scale);
        opt.step(&mut params, &grads, 1e-3).unwrap();
        for (i, e) in refs.iter_mut().enumerate() {
            if !wd[i].is_nan() {
                e.step(f64::from(grads[i]), t, 1e-3, wd[i], amsgrad);
            }
        }
    }
    assert_eq!(opt.step_count(), 20);
    // Tolerance 1e-6: about ten f32 operations per element and step, each rounding by at most
    // 2^-24 of its result; the parameters are O(1). Measured ~1e-7 (v: ~2e-7).
    let p_ref: Vec<f64> = refs.iter().map(|e| e.p).collect();
    let m_ref: Vec<f64> = refs.iter().map(|e| e.m).collect();
    let v_ref: Vec<f64> = refs.iter().map(|e| e.v).collect();
    let (ep, em, ev) = (
        rel_err(&params, &p_ref),
        rel_err(opt.exp_avg(), &m_ref),
        rel_err(opt.exp_avg_sq(), &v_ref),
    );
    eprintln!("amsgrad={amsgrad}: rel err params {ep:e}, m {em:e}, v {ev:e}");
    assert!(ep <= 1e-6 && em <= 1e-6 && ev <= 1e-6);
    if amsgrad {
        let x_ref: Vec<f64> = refs.iter().map(|e| e.vmax).collect();
        assert!(rel_err(opt.max_exp_avg_sq().unwrap(), &x_ref) <= 1e-6);
    } else {
        assert!(opt.max_exp_avg_sq().is_none());
    }
    for (i, w) in wd.iter().enumerate() {
        if w.is_nan() {
            assert_eq!(params[i].to_bits(), initial[i].to_bits(), "element {i}");
            assert_eq!(opt.exp_avg()[i], 0.0);
        }
    }
}

#[test]
fn matches_f64_reference_over_20_steps() {
    run_against_reference(false);
}

#[test]
fn amsgrad_matches_f64_reference_over_20_steps() {
    run_against_reference(true);
}

#[test]
fn l2_decay_enters_the_moments_not_the_parameters_directly() {
    // Zero gradient, weight decay: Adam's gradient becomes wd*p, so the first step moves p by
    // about -lr*sign(p) (bias-corrected m̂/sqrt(v̂) = ±1) — unlike AdamW, whose decay would move
    // it by lr*wd*p only.
    let config = AdamConfig {
        lr: 0.01,
        weight_decay: 0.1,
        ..AdamConfig::default()
    };
    let mut opt = Adam::with_single_group(config, 2).unwrap();
    let mut p = [2.0f32, -3.0];
    opt.step(&mut p, &[0.0, 0.0], 0.01).unwrap();
    assert!((p[0] - 1.99).abs() < 1e-6, "{}", p[0]);
    assert!((p[1] + 2.99).abs() < 1e-6, "{}", p[1]);
    assert!((opt.exp_avg()[0] - 0.1 * 0.2).abs() < 1e-7);
}

#[test]
fn step_scalars_follow_torch_formulas() {
    let config = AdamConfig::default();
    let s = AdamStepScalars::new(&config, 1e-3, 0.01, 3);
    assert_eq!(s.weight_decay, 0.01f32);
    assert_eq!(s.one_minus_beta1, (1.0f64 - 0.9) as f32);
    assert_eq!(s.one_minus_beta2, (1.0f64 - 0.999) as f32);
    assert_eq!(
        s.bias_correction2_sqrt,
        (1.0f64 - 0.999f64.powi(3)).sqrt() as f32
    );
    assert_eq!(s.neg_step_size, (-(1e-3 / (1.0 - 0.9f64.powi(3)))) as f32);
    let opt = Adam::new(
        config,
        vec![ParamGroup::new("a", vec![0..2], 0.5).with_lr_scale(2.0)],
        2,
    )
    .unwrap();
    let s = opt.step_scalars(0, 1e-3).unwrap();
    assert_eq!(s.weight_decay, 0.5);
    assert_eq!(s.neg_step_size, (-(2e-3 / (1.0 - 0.9))) as f32);
    assert!(opt.step_scalars(1, 1e-3).is_none());
}

#[test]
fn step_is_bitwise_independent_of_thread_count() {
    let numel = 100_003;
    let mut rng = ChaCha8Rng::seed_from_u64(11);
    let p0 = random(&mut rng, numel, 1.0);
    let grads: Vec<Vec<f32>> = (0..3).map(|_| random(&mut rng, numel, 1.0)).collect();
    let run = |threads: usize| {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        pool.install(|| {
            let config = AdamConfig {
                weight_decay: 0.01,
                amsgrad: true,
                ..AdamConfig::default()
            };
            let mut opt = Adam::with_single_group(config, numel).unwrap();
            let mut p = p0.clone();
            for g in &grads {
                opt.step(&mut p, g, 1e-3).unwrap();
            }
            p
        })
    };
    let (a, b) = (run(1), run(4));
    assert!(a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()));
}

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

#[test]
fn resume_after_save_load_is_bitwise_identical() {
    for amsgrad in [false, true] {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("adam.safetensors");
        let config = AdamConfig {
            amsgrad,
            weight_decay: 0.01,
            ..AdamConfig::default()
        };
        let mut rng = ChaCha8Rng::seed_from_u64(5);
        let p0 = random(&mut rng, 20_011, 1.0);
        let grads: Vec<Vec<f32>> = (0..8).map(|_| random(&mut rng, 20_011, 1.0)).collect();
        let mut full = Adam::with_single_group(config, 20_011).unwrap();
        let mut p_full = p0.clone();
        for g in &grads {
            full.step(&mut p_full, g, 1e-3).unwrap();
        }
        let mut first = Adam::with_single_group(config, 20_011).unwrap();
        let mut p = p0.clone();
        for g in &grads[..4] {
            first.step(&mut p, g, 1e-3).unwrap();
        }
        first.save_state(&path).unwrap();
        let mut resumed = Adam::with_single_group(config, 20_011).unwrap();
        resumed.load_state(&path).unwrap();
        assert_eq!(resumed.step_count(), 4);
        for g in &grads[4..] {
            resumed.step(&mut p, g, 1e-3).unwrap();
        }
        assert_eq!(bits(&p), bits(&p_full));
        assert_eq!(bits(resumed.exp_avg()), bits(full.exp_avg()));
        assert_eq!(bits(resumed.exp_avg_sq()), bits(full.exp_avg_sq()));
        assert_eq!(
            resumed.max_exp_avg_sq().map(bits),
            full.max_exp_avg_sq().map(bits)
        );
    }
}

fn expect_state_error(opt: &mut Adam, path: &std::path::Path, needle: &str) {
    match opt.load_state(path) {
        Err(OptimError::State { message, .. }) => {
            assert!(message.contains(needle), "`{message}` lacks `{needle}`")
        }
        other => panic!("expected a state error, got {other:?}"),
    }
    assert_eq!(opt.step_count(), 0, "a failed load changes nothing");
}

#[test]
fn mismatched_state_files_are_rejected() {
    let dir = tempfile::tempdir().unwrap();
    let mut opt = Adam::with_single_group(AdamConfig::default(), 10).unwrap();
    let mut p = [0.5f32; 10];
    opt.step(&mut p, &[0.1; 10], 1e-3).unwrap();
    let plain = dir.path().join("plain.safetensors");
    opt.save_state(&plain).unwrap();

    let ams = AdamConfig {
        amsgrad: true,
        ..AdamConfig::default()
    };
    expect_state_error(
        &mut Adam::with_single_group(ams, 10).unwrap(),
        &plain,
        "amsgrad",
    );
    expect_state_error(
        &mut Adam::with_single_group(AdamConfig::default(), 11).unwrap(),
        &plain,
        "parameters",
    );
    // Another optimizer's state file.
    let sgd = Sgd::with_single_group(
        SgdConfig {
            momentum: 0.9,
            ..SgdConfig::default()
        },
        10,
    )
    .unwrap();
    let sgd_path = dir.path().join("sgd.safetensors");
    sgd.save_state(&sgd_path).unwrap();
    expect_state_error(
        &mut Adam::with_single_group(AdamConfig::default(), 10).unwrap(),
        &sgd_path,
        "format",
    );
    // Truncated and missing files.
    let bytes = std::fs::read(&plain).unwrap();
    let short = dir.path().join("short.safetensors");
    std::fs::write(&short, &bytes[..bytes.len() - 3]).unwrap();
    expect_state_error(
        &mut Adam::with_single_group(AdamConfig::default(), 10).unwrap(),
        &short,
        "safetensors",
    );
    expect_state_error(
        &mut Adam::with_single_group(AdamConfig::default(), 10).unwrap(),
        &dir.path().join("missing"),
        "cannot read",
    );
}

fn expect_hyper(config: AdamConfig, expected: &str) {
    match Adam::with_single_group(config, 4) {
        Err(OptimError::InvalidHyperParameter { name, .. }) => assert_eq!(name, expected),
        other => panic!("expected InvalidHyperParameter({expected}), got {other:?}"),
    }
}

#[test]
fn bad_hyper_parameters_and_buffers_are_typed_errors() {
    let d = AdamConfig::default();
    assert_eq!((d.lr, d.beta1, d.beta2, d.eps), (1e-3, 0.9, 0.999, 1e-8));
    expect_hyper(AdamConfig { lr: f32::NAN, ..d }, "lr");
    expect_hyper(AdamConfig { lr: -1.0, ..d }, "lr");
    expect_hyper(AdamConfig { beta1: 1.0, ..d }, "beta1");
    expect_hyper(AdamConfig { beta2: -0.5, ..d }, "beta2");
    expect_hyper(
        AdamConfig {
            beta2: f32::NAN,
            ..d
        },
        "beta2",
    );
    expect_hyper(AdamConfig { eps: 0.0, ..d }, "eps");
    expect_hyper(
        AdamConfig {
            weight_decay: -1e-2,
            ..d
        },
        "weight_decay",
    );
    assert!(matches!(
        Adam::new(d, vec![ParamGroup::new("g", vec![0..5], 0.0)], 4),
        Err(OptimError::RangeOutOfBounds { .. })
    ));
    let mut opt = Adam::with_single_group(d, 4).unwrap();
    let mut p = [1.0f32; 4];
    assert!(matches!(
        opt.step(&mut p, &[0.1; 3], 1e-3),
        Err(OptimError::LengthMismatch {
            expected: 4,
            actual: 3,
            ..
        })
    ));
    assert!(matches!(
        opt.step(&mut p[..3], &[0.1; 4], 1e-3),
        Err(OptimError::LengthMismatch { .. })
    ));
    assert!(matches!(
        opt.step(&mut p, &[0.1; 4], f32::INFINITY),
        Err(OptimError::InvalidHyperParameter { name: "lr", .. })
    ));
    assert_eq!(p, [1.0; 4]);
    assert_eq!(opt.step_count(), 0);
}
