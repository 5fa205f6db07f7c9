//! LAMB (Apex FusedLAMB semantics): an f64 reference with per-tensor trust ratios over groups
//! and chunks, clipping, the trust-ratio rules (zero norms, no-decay groups, nvlamb), tensor
//! range validation, thread-count independence, state save/load.

// Groups take a list of ranges; a list holding a single range is intended here.
#![allow(clippy::single_range_in_vec_init)]

use std::ops::Range;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use tilearn_optim::{
    Lamb, LambConfig, LambStepScalars, OptimError, ParamGroup, lamb_clip_divisor, lamb_trust_ratio,
};

fn random(rng: &mut ChaCha8Rng, n: usize, scale: f32) -> Vec<f32> {
    (0..n)
        .map(|_| rng.random_range(-1.0f32..1.0) * scale)
        .collect()
}

fn rel_err(a: &[f32], b: &[f64]) -> f64 {
    let num: f64 = a
        .iter()
        .zip(b)
        .map(|(&x, &y)| (f64::from(x) - y).powi(2))
        .sum::<f64>()
        .sqrt();
    let den: f64 = b.iter().map(|y| y * y).sum::<f64>().sqrt();
    assert!(num.is_finite() && den > 0.0);
    num / den
}

/// Textbook Apex FusedLAMB (adam_w_mode) in f64 over `tensors` (each with its weight decay).
struct Reference {
    p: Vec<f64>,
    m: Vec<f64>,
    v: Vec<f64>,
}

impl Reference {
    fn step(
        &mut self,
        c: &LambConfig,
        tensors: &[(Range<usize>, f64)],
        g: &[f32],
        lr: f64,
        t: i32,
    ) {
        let (b1, b2, eps) = (0.9f64, 0.999f64, 1e-6f64);
        let norm: f64 = tensors
            .iter()
            .flat_map(|(r, _)| g[r.clone()].iter())
            .map(|&x| f64::from(x).powi(2))
            .sum::<f64>()
            .sqrt();
        let clip = match c.max_grad_norm {
            Some(max) if norm > f64::from(max) => norm / f64::from(max),
            _ => 1.0,
        };
        let beta3 = if c.grad_averaging { 1.0 - b1 } else { 1.0 };
        let (bc1, bc2) = (1.0 - b1.powi(t), 1.0 - b2.powi(t));
        for (r, wd) in tensors {
            let mut u = vec![0.0; r.len()];
            for (k, i) in r.clone().enumerate() {
                let s = f64::from(g[i]) / clip;
                self.m[i] = b1 * self.m[i] + beta3 * s;
                self.v[i] = b2 * self.v[i] + (1.0 - b2) * s * s;
                u[k] = (self.m[i] / bc1) / ((self.v[i] / bc2).sqrt() + eps) + wd * self.p[i];
            }
            let pn = self.p[r.clone()].iter().map(|x| x * x).sum::<f64>().sqrt();
            let un = u.iter().map(|x| x * x).sum::<f64>().sqrt();
            let ratio = if (c.use_nvlamb || *wd != 0.0) && pn != 0.0 && un != 0.0 {
                lr * pn / un
            } else {
                lr
            };
            for (k, i) in r.clone().enumerate() {
                self.p[i] -= ratio * u[k];
            }
        }
    }
}

const N: usize = 50_000;

/// Tensors (some spanning several 16 384-element chunks) in two groups, a frozen tensor
/// outside every group at the end. Returns groups, tensor ranges, and (range, wd) of the
/// stepped tensors.
#[allow(clippy::type_complexity)]
fn layout() -> (Vec<ParamGroup>, Vec<Range<usize>>, Vec<(Range<usize>, f64)>) {
    let tensors = vec![
        0..20_000,
        20_000..20_017,
        20_017..37_000,
        37_000..37_300,
        37_300..49_990,
        49_990..N,
    ];
    let groups = vec![
        ParamGroup::new(
            "decay",
            vec![0..20_000, 20_017..37_000, 37_300..49_990],
            0.01,
        ),
        ParamGroup::new("no_decay", vec![20_000..20_017, 37_000..37_300], 0.0),
    ];
    let stepped = vec![
        (0..20_000, 0.01),
        (20_000..20_017, 0.0),
        (20_017..37_000, 0.01),
        (37_000..37_300, 0.0),
        (37_300..49_990, 0.01),
    ];
    (groups, tensors, stepped)
}

fn run_against_reference(config: LambConfig, label: &str) {
    let (groups, tensors, stepped) = layout();
    let mut opt = Lamb::new(config, groups, N, tensors).unwrap();
    let mut rng = ChaCha8Rng::seed_from_u64(17);
    let mut p = random(&mut rng, N, 1.0);
    let p0 = p.clone();
    let mut r = Reference {
        p: p.iter().map(|&x| f64::from(x)).collect(),
        m: vec![0.0; N],
        v: vec![0.0; N],
    };
    for t in 1..=15 {
        // Mostly norms far above max_grad_norm (clipping), every third step a small gradient
        // (norm ~0.6 < 1: no clipping).
        let scale = if t % 3 == 0 { 5e-3 } else { 1.0 };
        let g = random(&mut rng, N, scale);
        opt.step(&mut p, &g, 1e-2).unwrap();
        r.step(&config, &stepped, &g, 1e-2, t);
    }
    let (ep, em, ev) = (
        rel_err(&p, &r.p),
        rel_err(opt.exp_avg(), &r.m),
        rel_err(opt.exp_avg_sq(), &r.v),
    );
    let d32: Vec<f32> = p.iter().zip(&p0).map(|(a, b)| a - b).collect();
    let d64: Vec<f64> =
        r.p.iter()
            .zip(&p0)
            .map(|(a, &b)| a - f64::from(b))
            .collect();
    let ed = rel_err(&d32, &d64);
    eprintln!("{label}: rel err params {ep:e}, m {em:e}, v {ev:e}, displacement {ed:e}");
    // ~15 f32 roundings per element and step on O(1) values; the norms are f64.
    assert!(ep <= 1e-6 && em <= 1e-6 && ev <= 1e-6, "{label}");
    assert!(ed <= 1e-4, "{label}: displacement {ed:e}");
    assert_eq!(bits(&p[49_990..]), bits(&p0[49_990..]), "frozen tensor");
    assert_eq!(opt.last_ratios().len(), 5);
}

#[test]
fn matches_f64_reference_apex_defaults() {
    run_against_reference(
        LambConfig {
            lr: 1e-2,
            ..LambConfig::default()
        },
        "defaults",
    );
}

#[test]
fn matches_f64_reference_nvlamb_without_clipping_or_averaging() {
    run_against_reference(
        LambConfig {
            lr: 1e-2,
            use_nvlamb: true,
            grad_averaging: false,
            max_grad_norm: None,
            ..LambConfig::default()
        },
        "nvlamb",
    );
}

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

#[test]
fn clipping_makes_the_step_scale_invariant() {
    // With max_grad_norm, any gradient whose norm exceeds it is divided down to the same
    // direction and norm, so g and 8·g give the same step (8 is a power of two: exact).
    let run = |scale: f32| {
        let mut opt =
            Lamb::with_single_group(LambConfig::default(), 100, vec![0..60, 60..100]).unwrap();
        let mut rng = ChaCha8Rng::seed_from_u64(4);
        let mut p = random(&mut rng, 100, 1.0);
        let g = random(&mut rng, 100, scale);
        opt.step(&mut p, &g, 1e-3).unwrap();
        p
    };
    let (a, b) = (run(1.0), run(8.0));
    let e = a
        .iter()
        .zip(&b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0f32, f32::max);
    assert!(e <= 1e-6, "{e}");
}

#[test]
fn trust_ratio_rules() {
    assert_eq!(lamb_trust_ratio(0.1, 2.0, 4.0, true), 0.05);
    assert_eq!(lamb_trust_ratio(0.1, 2.0, 4.0, false), 0.1);
    assert_eq!(lamb_trust_ratio(0.1, 0.0, 4.0, true), 0.1);
    assert_eq!(lamb_trust_ratio(0.1, 2.0, 0.0, true), 0.1);
    assert_eq!(lamb_clip_divisor(5.0, Some(1.0)), 5.0);
    assert_eq!(lamb_clip_divisor(0.5, Some(1.0)), 1.0);
    assert_eq!(lamb_clip_divisor(f64::NAN, Some(1.0)), 1.0);
    assert_eq!(lamb_clip_divisor(5.0, None), 1.0);

    // A tensor of zeros (param norm 0) moves by lr·u; a no-decay tensor by lr·u as well; a
    // decay tensor by lr·||p||/||u||·u.
    let groups = vec![
        ParamGroup::new("decay", vec![0..4], 0.01),
        ParamGroup::new("no_decay", vec![4..8], 0.0),
    ];
    let config = LambConfig {
        max_grad_norm: None,
        ..LambConfig::default()
    };
    let mut opt = Lamb::new(config, groups, 12, vec![0..2, 2..4, 4..8]).unwrap();
    let mut p = [
        0.0f32, 0.0, 3.0, 4.0, 1.0, 1.0, 1.0, 1.0, 9.0, 9.0, 9.0, 9.0,
    ];
    opt.step(&mut p, &[1.0; 12], 0.5).unwrap();
    let ratios = opt.last_ratios();
    assert_eq!(ratios[0], 0.5, "zero parameter norm: plain lr");
    assert_eq!(ratios[2], 0.5, "no weight decay: plain lr");
    // Tensor 1: u = 1/(1+1e-6) + 0.01·p; ratio = lr·||p||/||u||.
    let u: Vec<f64> = [3.0f64, 4.0]
        .iter()
        .map(|&x| 1.0 / (1.0 + 1e-6) + 0.01 * x)
        .collect();
    let un = u.iter().map(|x| x * x).sum::<f64>().sqrt();
    assert!((f64::from(ratios[1]) - 0.5 * 5.0 / un).abs() < 1e-6);
    assert_eq!(&p[8..], &[9.0; 4], "outside every group");
    let s = opt.step_scalars(0, 0.5, 3.0).unwrap();
    assert_eq!(s.clip_divisor, 1.0);
    assert!(s.use_trust_ratio);
    assert!(!opt.step_scalars(1, 0.5, 3.0).unwrap().use_trust_ratio);
}

#[test]
fn step_scalars_match_apex_formulas() {
    let c = LambConfig::default();
    let s = LambStepScalars::new(&c, 1e-3, 0.01, 2, 3.5);
    assert_eq!(s.clip_divisor, 3.5);
    assert_eq!(s.beta3, (1.0f64 - 0.9) as f32);
    assert_eq!(s.bias_correction1, (1.0f64 - 0.81) as f32);
    assert_eq!(s.bias_correction2, (1.0f64 - 0.999f64 * 0.999) as f32);
    assert_eq!(s.eps, 1e-6);
    let no_avg = LambConfig {
        grad_averaging: false,
        bias_correction: false,
        ..c
    };
    let s = LambStepScalars::new(&no_avg, 1e-3, 0.0, 2, 1.0);
    assert_eq!(
        (s.beta3, s.bias_correction1, s.bias_correction2),
        (1.0, 1.0, 1.0)
    );
    assert!(!s.use_trust_ratio);
}

#[test]
fn tensor_range_validation() {
    let c = LambConfig::default();
    let groups = || {
        vec![
            ParamGroup::new("a", vec![0..10], 0.01),
            ParamGroup::new("b", vec![10..20], 0.0),
        ]
    };
    let bad = |tensors: Vec<Range<usize>>, needle: &str| match Lamb::new(c, groups(), 25, tensors) {
        Err(OptimError::InvalidTensorRange { message, .. }) => {
            assert!(message.contains(needle), "`{message}` lacks `{needle}`")
        }
        other => panic!("expected InvalidTensorRange({needle}), got {other:?}"),
    };
    bad(vec![0..12, 12..20], "straddles the end");
    bad(vec![0..10, 10..15], "covered by no tensor");
    bad(vec![0..10, 10..20, 8..9], "overlaps");
    #[allow(clippy::reversed_empty_ranges)]
    bad(vec![0..10, 20..10], "reversed");
    bad(vec![0..10, 10..20, 18..24], "overlaps");
    // Straddling a group's start from outside (groups begin at 3 here).
    match Lamb::new(
        c,
        vec![ParamGroup::new("a", vec![3..10], 0.01)],
        10,
        vec![0..5, 5..10],
    ) {
        Err(OptimError::InvalidTensorRange { message, .. }) => {
            assert!(message.contains("straddles the start"))
        }
        other => panic!("{other:?}"),
    }
    assert!(matches!(
        Lamb::new(c, groups(), 25, vec![0..10, 10..20, 20..26]),
        Err(OptimError::RangeOutOfBounds { .. })
    ));
    // Empty, unordered and frozen (outside every group) tensors are fine.
    #[allow(clippy::reversed_empty_ranges)]
    let ok = Lamb::new(c, groups(), 25, vec![20..25, 10..20, 3..3, 0..10]).unwrap();
    assert_eq!(ok.tensors().len(), 2);
    assert_eq!(ok.tensors()[1], (10..20, 1));
}

#[test]
fn validation_and_length_errors() {
    let d = LambConfig::default();
    assert_eq!(
        (d.beta1, d.beta2, d.eps, d.weight_decay, d.max_grad_norm),
        (0.9, 0.999, 1e-6, 0.01, Some(1.0))
    );
    assert!(d.grad_averaging && d.bias_correction && !d.use_nvlamb);
    for (bad, name) in [
        (LambConfig { lr: f32::NAN, ..d }, "lr"),
        (LambConfig { beta1: 1.0, ..d }, "beta1"),
        (LambConfig { beta2: 2.0, ..d }, "beta2"),
        (LambConfig { eps: -1e-6, ..d }, "eps"),
        (
            LambConfig {
                weight_decay: f32::INFINITY,
                ..d
            },
            "weight_decay",
        ),
        (
            LambConfig {
                max_grad_norm: Some(0.0),
                ..d
            },
            "max_grad_norm",
        ),
    ] {
        match Lamb::with_single_group(bad, 4, vec![0..4]) {
            Err(OptimError::InvalidHyperParameter { name: n, .. }) => assert_eq!(n, name),
            other => panic!("{name}: {other:?}"),
        }
    }
    let mut opt = Lamb::with_single_group(d, 4, vec![0..4]).unwrap();
    let mut p = [1.0f32; 4];
    assert!(matches!(
        opt.step(&mut p, &[1.0; 3], 1e-3),
        Err(OptimError::LengthMismatch { .. })
    ));
    assert!(matches!(
        opt.step(&mut p, &[1.0; 4], f32::NAN),
        Err(OptimError::InvalidHyperParameter { name: "lr", .. })
    ));
    assert!(matches!(
        opt.global_grad_norm(&[1.0; 5]),
        Err(OptimError::LengthMismatch { .. })
    ));
    assert_eq!(p, [1.0; 4]);
    assert_eq!(opt.step_count(), 0);
}

#[test]
fn thread_independent_and_resumable() {
    let (groups, tensors, _) = layout();
    let mut rng = ChaCha8Rng::seed_from_u64(23);
    let p0 = random(&mut rng, N, 1.0);
    let grads: Vec<Vec<f32>> = (0..6).map(|_| random(&mut rng, N, 1.0)).collect();
    let config = LambConfig::default();
    let run = |threads: usize| {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        pool.install(|| {
            let mut opt = Lamb::new(config, groups.clone(), N, tensors.clone()).unwrap();
            let mut p = p0.clone();
            for g in &grads {
                opt.step(&mut p, g, 1e-3).unwrap();
            }
            p
        })
    };
    let full = run(1);
    assert_eq!(bits(&full), bits(&run(4)));

    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("lamb.safetensors");
    let mut opt = Lamb::new(config, groups.clone(), N, tensors.clone()).unwrap();
    let mut p = p0.clone();
    for g in &grads[..3] {
        opt.step(&mut p, g, 1e-3).unwrap();
    }
    opt.save_state(&path).unwrap();
    let mut resumed = Lamb::new(config, groups.clone(), N, tensors.clone()).unwrap();
    resumed.load_state(&path).unwrap();
    assert_eq!(resumed.step_count(), 3);
    for g in &grads[3..] {
        resumed.step(&mut p, g, 1e-3).unwrap();
    }
    assert_eq!(bits(&p), bits(&full));
    // A garbage file is an error that leaves the optimizer as it was.
    let junk = dir.path().join("junk");
    std::fs::write(&junk, b"nope").unwrap();
    assert!(matches!(
        resumed.load_state(&junk),
        Err(OptimError::State { .. })
    ));
    assert_eq!(resumed.step_count(), 6);
}
