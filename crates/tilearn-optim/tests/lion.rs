//! Lion: exact small cases (sign update, decoupled decay, momentum), an exact f32 re-statement
//! over groups and chunks, thread-count independence, state save/load and validation.

// Groups take a list of ranges; a list holding a single range is intended here.
#![allow(clippy::single_range_in_vec_init)]

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use tilearn_optim::lion::torch_sign;
use tilearn_optim::{Lion, LionConfig, LionStepScalars, OptimError, ParamGroup};

#[test]
fn sign_update_with_decay_and_momentum() {
    let config = LionConfig {
        lr: 0.01,
        weight_decay: 0.5,
        ..LionConfig::default()
    };
    let mut opt = Lion::with_single_group(config, 3).unwrap();
    let mut p = [1.0f32, -2.0, 0.5];
    // Gradients of very different sizes all move p by exactly lr (plus the decay).
    opt.step(&mut p, &[1e-6, -300.0, 0.0], 0.01).unwrap();
    let f = (1.0f64 - 0.01 * 0.5) as f32;
    assert_eq!(p[0], 1.0 * f - 0.01);
    assert_eq!(p[1], -2.0 * f + 0.01);
    // Zero interpolation: sign 0, only the decay acts.
    assert_eq!(p[2], 0.5 * f);
    // m = beta2*m + (1-beta2)*g with beta2 = 0.99.
    let m = opt.exp_avg();
    assert_eq!(m[1], 0.0 * 0.99 + (1.0f64 - 0.99) as f32 * -300.0);
    // Second step: the interpolation 0.9*m + 0.1*g decides the sign — a small opposite
    // gradient does not flip it.
    let before = p;
    opt.step(&mut p, &[0.0, 1.0, 0.0], 0.01).unwrap();
    assert_eq!(
        p[1],
        before[1] * f + 0.01,
        "still moves up: c = 0.9*(-3) + 0.1*1 < 0"
    );
}

#[test]
fn torch_sign_matches_torch() {
    assert_eq!(torch_sign(3.5), 1.0);
    assert_eq!(torch_sign(-1e-30), -1.0);
    assert_eq!(torch_sign(0.0), 0.0);
    assert_eq!(torch_sign(-0.0), 0.0);
    // torch.sign(nan) == 0 on CPU and CUDA.
    assert_eq!(torch_sign(f32::NAN), 0.0);
}

#[test]
fn scalars() {
    let s = LionStepScalars::new(&LionConfig::default(), 1e-4, 0.1);
    assert!(s.apply_decay);
    assert_eq!(s.decay_factor, (1.0f64 - 1e-4 * 0.1) as f32);
    assert_eq!(s.beta1, 0.9);
    assert_eq!(s.one_minus_beta1, (1.0f64 - 0.9) as f32);
    assert_eq!(s.one_minus_beta2, (1.0f64 - 0.99) as f32);
    assert_eq!(s.neg_lr, -1e-4);
    assert!(!LionStepScalars::new(&LionConfig::default(), 1e-4, 0.0).apply_decay);
}

#[test]
fn matches_f32_restatement_over_groups_and_chunks() {
    // Lion's update is a sign, so the only sensible reference is the same f32 formula written
    // out element by element; the optimizer must agree bit for bit (and leave elements outside
    // every group alone).
    const N: usize = 40_000;
    let groups = vec![
        ParamGroup::new("decay", vec![0..17_000, 25_000..N - 3], 0.1),
        ParamGroup::new("no_decay", vec![17_000..24_000], 0.0).with_lr_scale(2.0),
    ];
    let lookup = |i: usize| match i {
        0..17_000 | 25_000..39_997 => Some((0.1f64, 1.0f64)),
        17_000..24_000 => Some((0.0, 2.0)),
        _ => None,
    };
    let config = LionConfig::default();
    let mut opt = Lion::new(config, groups, N).unwrap();
    let mut rng = ChaCha8Rng::seed_from_u64(1);
    let mut p: Vec<f32> = (0..N).map(|_| rng.random_range(-1.0f32..1.0)).collect();
    let p0 = p.clone();
    let mut rp = p.clone();
    let mut rm = vec![0.0f32; N];
    for _ in 0..10 {
        let g: Vec<f32> = (0..N).map(|_| rng.random_range(-1.0f32..1.0)).collect();
        opt.step(&mut p, &g, 3e-4).unwrap();
        for i in 0..N {
            let Some((wd, scale)) = lookup(i) else {
                continue;
            };
            let lr = 3e-4 * scale;
            if wd != 0.0 {
                rp[i] *= (1.0 - lr * wd) as f32;
            }
            let c = rm[i] * 0.9 + (1.0f64 - 0.9) as f32 * g[i];
            rp[i] += (-lr) as f32 * torch_sign(c);
            rm[i] = rm[i] * 0.99 + (1.0f64 - 0.99) as f32 * g[i];
        }
    }
    assert_eq!(bits(&p), bits(&rp));
    assert_eq!(bits(opt.exp_avg()), bits(&rm));
    assert_eq!(bits(&p[N - 3..]), bits(&p0[N - 3..]));
}

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

#[test]
fn thread_independent_and_resumable() {
    let n = 40_003;
    let mut rng = ChaCha8Rng::seed_from_u64(2);
    let p0: Vec<f32> = (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect();
    let grads: Vec<Vec<f32>> = (0..6)
        .map(|_| (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect())
        .collect();
    let config = LionConfig {
        weight_decay: 0.1,
        ..LionConfig::default()
    };
    let run = |threads: usize| {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        pool.install(|| {
            let mut opt = Lion::with_single_group(config, n).unwrap();
            let mut p = p0.clone();
            for g in &grads {
                opt.step(&mut p, g, 1e-4).unwrap();
            }
            p
        })
    };
    let full = run(1);
    assert_eq!(bits(&full), bits(&run(4)));

    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("lion.safetensors");
    let mut opt = Lion::with_single_group(config, n).unwrap();
    let mut p = p0.clone();
    for g in &grads[..2] {
        opt.step(&mut p, g, 1e-4).unwrap();
    }
    opt.save_state(&path).unwrap();
    let mut resumed = Lion::with_single_group(config, n).unwrap();
    resumed.load_state(&path).unwrap();
    assert_eq!(resumed.step_count(), 2);
    for g in &grads[2..] {
        resumed.step(&mut p, g, 1e-4).unwrap();
    }
    assert_eq!(bits(&p), bits(&full));
    // A state for another size is rejected without touching the optimizer.
    let mut other = Lion::with_single_group(config, n + 1).unwrap();
    assert!(matches!(
        other.load_state(&path),
        Err(OptimError::State { .. })
    ));
    assert_eq!(other.step_count(), 0);
}

#[test]
fn validation() {
    let d = LionConfig::default();
    assert_eq!(
        (d.lr, d.beta1, d.beta2, d.weight_decay),
        (1e-4, 0.9, 0.99, 0.0)
    );
    for (bad, name) in [
        (LionConfig { lr: f32::NAN, ..d }, "lr"),
        (LionConfig { beta1: 1.0, ..d }, "beta1"),
        (LionConfig { beta2: -0.01, ..d }, "beta2"),
        (
            LionConfig {
                weight_decay: -1.0,
                ..d
            },
            "weight_decay",
        ),
    ] {
        match Lion::with_single_group(bad, 2) {
            Err(OptimError::InvalidHyperParameter { name: n, .. }) => assert_eq!(n, name),
            other => panic!("{name}: {other:?}"),
        }
    }
    let mut opt = Lion::with_single_group(d, 2).unwrap();
    let mut p = [1.0f32; 2];
    assert!(matches!(
        opt.step(&mut p, &[1.0], 1e-4),
        Err(OptimError::LengthMismatch { .. })
    ));
    assert!(matches!(
        opt.step(&mut p, &[1.0; 2], f32::NEG_INFINITY),
        Err(OptimError::InvalidHyperParameter { name: "lr", .. })
    ));
    assert_eq!(p, [1.0; 2]);
}
