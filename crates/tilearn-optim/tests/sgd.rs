//! SGD (torch semantics): exact small cases of torch's rules (first-step buffer, dampening,
//! nesterov, L2 decay), an f64 reference over groups and chunks, thread-count independence,
//! state save/load and validation errors.

// Groups take a list of ranges; a list holding a single range is intended here.
#![allow(clippy::single_range_in_vec_init)]

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use tilearn_optim::{OptimError, ParamGroup, Sgd, SgdConfig, SgdStepScalars};

fn cfg(momentum: f32, dampening: f32, nesterov: bool, wd: f32) -> SgdConfig {
    SgdConfig {
        lr: 0.1,
        momentum,
        dampening,
        weight_decay: wd,
        nesterov,
    }
}

#[test]
fn first_step_initialises_the_buffer_to_the_gradient_without_dampening() {
    // torch: buf = grad.clone() on the first step, whatever the dampening.
    let mut opt = Sgd::with_single_group(cfg(0.9, 0.5, false, 0.0), 2).unwrap();
    let mut p = [1.0f32, 1.0];
    opt.step(&mut p, &[2.0, -4.0], 0.1).unwrap();
    assert_eq!(opt.momentum_buffer().unwrap(), &[2.0, -4.0]);
    assert_eq!(p, [1.0 - 0.1f32 * 2.0, 1.0 + 0.1f32 * 4.0]);
    // Second step: buf = 0.9*buf + (1-0.5)*g.
    opt.step(&mut p, &[1.0, 1.0], 0.1).unwrap();
    let b = opt.momentum_buffer().unwrap();
    assert_eq!(b[0], 2.0 * 0.9f32 + 0.5 * 1.0);
    assert_eq!(b[1], -4.0 * 0.9f32 + 0.5 * 1.0);
    assert_eq!(opt.step_count(), 2);
}

#[test]
fn nesterov_and_weight_decay_follow_torch() {
    let mut opt = Sgd::with_single_group(cfg(0.9, 0.0, true, 0.1), 1).unwrap();
    let mut p = [2.0f32];
    // g' = g + wd*p = 1 + 0.2 = 1.2; buf = 1.2; update = g' + 0.9*buf = 2.28.
    opt.step(&mut p, &[1.0], 0.1).unwrap();
    let g = 1.0f32 + 0.1f32 * 2.0;
    let d = g + 0.9f32 * g;
    assert_eq!(p[0], 2.0 + (-0.1f32) * d);
    // Plain SGD: no buffer at all.
    let mut plain = Sgd::with_single_group(cfg(0.0, 0.0, false, 0.0), 1).unwrap();
    let mut q = [2.0f32];
    plain.step(&mut q, &[1.0], 0.5).unwrap();
    assert_eq!(q[0], 1.5);
    assert!(plain.momentum_buffer().is_none());
}

#[test]
fn step_scalars() {
    let s = SgdStepScalars::new(&cfg(0.9, 0.1, false, 0.0), 0.01, 0.001, true);
    assert_eq!(s.momentum, 0.9);
    assert_eq!(s.one_minus_dampening, (1.0f64 - 0.1) as f32);
    assert_eq!(s.neg_lr, -0.01);
    assert_eq!(s.weight_decay, 0.001);
    assert!(s.first_step && !s.nesterov);
    let mut opt = Sgd::with_single_group(cfg(0.9, 0.1, false, 0.0), 3).unwrap();
    assert!(opt.step_scalars(0, 0.1).unwrap().first_step);
    opt.step(&mut [0.0; 3], &[1.0; 3], 0.1).unwrap();
    assert!(!opt.step_scalars(0, 0.1).unwrap().first_step);
    assert!(opt.step_scalars(1, 0.1).is_none());
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

#[test]
fn matches_f64_reference_over_groups_and_chunks() {
    const N: usize = 40_000;
    for (momentum, dampening, nesterov) in [(0.0, 0.0, false), (0.9, 0.2, false), (0.8, 0.0, true)]
    {
        let groups = vec![
            ParamGroup::new("decay", vec![0..18_000, 30_000..N - 7], 1e-2),
            ParamGroup::new("no_decay", vec![18_100..30_000], 0.0).with_lr_scale(0.5),
        ];
        let wd_of = |i: usize| match i {
            0..18_000 => Some((1e-2, 1.0)),
            18_100..30_000 => Some((0.0, 0.5)),
            30_000..39_993 => Some((1e-2, 1.0)),
            _ => None,
        };
        let config = cfg(momentum, dampening, nesterov, 0.0);
        let mut opt = Sgd::new(config, groups, N).unwrap();
        let mut rng = ChaCha8Rng::seed_from_u64(3);
        let mut p: Vec<f32> = (0..N).map(|_| rng.random_range(-1.0f32..1.0)).collect();
        let p0 = p.clone();
        let mut rp: Vec<f64> = p.iter().map(|&x| f64::from(x)).collect();
        let mut rb = vec![0.0f64; N];
        let (m, d) = (f64::from(momentum), f64::from(dampening));
        for t in 0..15 {
            let g: Vec<f32> = (0..N).map(|_| rng.random_range(-1.0f32..1.0)).collect();
            opt.step(&mut p, &g, 0.05).unwrap();
            for i in 0..N {
                let Some((wd, scale)) = wd_of(i) else {
                    continue;
                };
                let mut gi = f64::from(g[i]) + wd * rp[i];
                if m != 0.0 {
                    rb[i] = if t == 0 {
                        gi
                    } else {
                        m * rb[i] + (1.0 - d) * gi
                    };
                    gi = if nesterov { gi + m * rb[i] } else { rb[i] };
                }
                rp[i] -= 0.05 * scale * gi;
            }
        }
        let e = rel_err(&p, &rp);
        eprintln!("momentum {momentum} dampening {dampening} nesterov {nesterov}: rel err {e:e}");
        // A few f32 roundings per step on O(1) values: ~1e-7 after 15 steps.
        assert!(e <= 1e-6, "{e:e}");
        if m != 0.0 {
            let eb = rel_err(opt.momentum_buffer().unwrap(), &rb);
            assert!(eb <= 1e-6, "buffer {eb:e}");
        }
        for i in N - 7..N {
            assert_eq!(p[i].to_bits(), p0[i].to_bits(), "outside every group");
        }
    }
}

#[test]
fn bitwise_independent_of_thread_count_and_resumable() {
    let n = 50_001;
    let mut rng = ChaCha8Rng::seed_from_u64(9);
    let p0: Vec<f32> = (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect();
    let grads: Vec<Vec<f32>> = (0..6)
        .map(|_| (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect())
        .collect();
    let config = cfg(0.9, 0.1, false, 1e-3);
    let run = |threads: usize| {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        pool.install(|| {
            let mut opt = Sgd::with_single_group(config, n).unwrap();
            let mut p = p0.clone();
            for g in &grads {
                opt.step(&mut p, g, 0.01).unwrap();
            }
            p
        })
    };
    let full = run(1);
    assert_eq!(bits(&full), bits(&run(3)));

    // Resume after 3 steps (and the "first step" rule must not fire again after loading).
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("sgd.safetensors");
    let mut opt = Sgd::with_single_group(config, n).unwrap();
    let mut p = p0.clone();
    for g in &grads[..3] {
        opt.step(&mut p, g, 0.01).unwrap();
    }
    opt.save_state(&path).unwrap();
    let mut resumed = Sgd::with_single_group(config, n).unwrap();
    resumed.load_state(&path).unwrap();
    assert_eq!(resumed.step_count(), 3);
    for g in &grads[3..] {
        resumed.step(&mut p, g, 0.01).unwrap();
    }
    assert_eq!(bits(&p), bits(&full));
}

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

#[test]
fn state_without_momentum_and_mismatches() {
    let dir = tempfile::tempdir().unwrap();
    let plain = Sgd::with_single_group(cfg(0.0, 0.0, false, 0.0), 5).unwrap();
    let path = dir.path().join("plain.safetensors");
    plain.save_state(&path).unwrap();
    let mut again = Sgd::with_single_group(cfg(0.0, 0.0, false, 0.0), 5).unwrap();
    again.load_state(&path).unwrap();
    // A momentum optimizer cannot resume from a state without a buffer, nor the reverse.
    let mut with_m = Sgd::with_single_group(cfg(0.9, 0.0, false, 0.0), 5).unwrap();
    match with_m.load_state(&path) {
        Err(OptimError::State { message, .. }) => assert!(message.contains("momentum")),
        other => panic!("{other:?}"),
    }
    let m_path = dir.path().join("m.safetensors");
    with_m.save_state(&m_path).unwrap();
    assert!(matches!(
        again.load_state(&m_path),
        Err(OptimError::State { .. })
    ));
}

fn expect_hyper(config: SgdConfig, expected: &str) {
    match Sgd::with_single_group(config, 4) {
        Err(OptimError::InvalidHyperParameter { name, .. }) => assert_eq!(name, expected),
        other => panic!("expected InvalidHyperParameter({expected}), got {other:?}"),
    }
}

#[test]
fn validation() {
    let d = SgdConfig::default();
    assert!(d.validate().is_ok());
    expect_hyper(SgdConfig { lr: f32::NAN, ..d }, "lr");
    expect_hyper(SgdConfig { momentum: 1.0, ..d }, "momentum");
    expect_hyper(
        SgdConfig {
            momentum: -0.1,
            ..d
        },
        "momentum",
    );
    expect_hyper(
        SgdConfig {
            dampening: 1.5,
            ..d
        },
        "dampening",
    );
    expect_hyper(
        SgdConfig {
            weight_decay: f32::NAN,
            ..d
        },
        "weight_decay",
    );
    // torch: nesterov requires momentum > 0 and zero dampening.
    expect_hyper(cfg(0.0, 0.0, true, 0.0), "momentum");
    expect_hyper(cfg(0.9, 0.1, true, 0.0), "dampening");
    let mut opt = Sgd::with_single_group(cfg(0.9, 0.0, false, 0.0), 4).unwrap();
    let mut p = [1.0f32; 4];
    assert!(matches!(
        opt.step(&mut p, &[1.0; 5], 0.1),
        Err(OptimError::LengthMismatch { .. })
    ));
    assert!(matches!(
        opt.step(&mut p, &[1.0; 4], -0.1),
        Err(OptimError::InvalidHyperParameter { name: "lr", .. })
    ));
    assert_eq!(p, [1.0; 4]);
    assert_eq!(opt.step_count(), 0);
    assert_eq!(opt.momentum_buffer().unwrap(), &[0.0; 4]);
}
