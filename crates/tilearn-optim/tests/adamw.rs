//! AdamW against a textbook f64 reference, group handling, amsgrad, validation errors.

// Groups take a list of ranges; a list holding a single range is intended here.
#![allow(clippy::single_range_in_vec_init)]

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use tilearn_optim::{AdamW, AdamWConfig, OptimError, ParamGroup};

/// Textbook torch.optim.AdamW for one element, in f64 (the hyper-parameters are the Python
/// floats 0.9 / 0.999 / 1e-8 the f32 config was written from).
#[derive(Clone, Copy, Default)]
struct RefElem {
    p: f64,
    m: f64,
    v: f64,
    vmax: f64,
}

struct RefHyper {
    beta1: f64,
    beta2: f64,
    eps: f64,
    amsgrad: bool,
}

impl RefElem {
    fn step(&mut self, g: f64, t: u64, lr: f64, wd: f64, h: &RefHyper) {
        self.p *= 1.0 - lr * wd;
        self.m = h.beta1 * self.m + (1.0 - h.beta1) * g;
        self.v = h.beta2 * self.v + (1.0 - h.beta2) * g * g;
        let second = if h.amsgrad {
            self.vmax = self.vmax.max(self.v);
            self.vmax
        } else {
            self.v
        };
        let bc1 = 1.0 - h.beta1.powi(t as i32);
        let bc2 = 1.0 - h.beta2.powi(t as i32);
        let m_hat = self.m / bc1;
        let v_hat = second / bc2;
        // torch adds eps to sqrt(v)/sqrt(bc2), i.e. to sqrt(v_hat).
        self.p -= lr * m_hat / (v_hat.sqrt() + h.eps);
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

/// Two groups with a gap between them and a tail outside every group; spans several of the
/// optimizer's parallel chunks (16 384 elements).
fn two_groups(numel: usize) -> (Vec<ParamGroup>, Vec<(usize, f64)>) {
    let a = 0..20_000;
    let b = 20_100..35_000;
    let c = 36_000..numel - 500;
    let groups = vec![
        ParamGroup::new("decay", vec![a.clone(), c.clone()], 0.1),
        ParamGroup::new("no_decay", vec![b.clone()], 0.0),
    ];
    // Per element: which weight decay applies (NaN = no group, untouched).
    let mut wd = vec![f64::NAN; numel];
    for r in [a, c] {
        wd[r].iter_mut().for_each(|w| *w = 0.1);
    }
    wd[b].iter_mut().for_each(|w| *w = 0.0);
    (groups, wd.into_iter().enumerate().collect())
}

fn run_against_reference(amsgrad: bool) {
    const NUMEL: usize = 40_000;
    const STEPS: u64 = 20;
    let config = AdamWConfig {
        lr: 1e-3,
        amsgrad,
        ..AdamWConfig::default()
    };
    let h = RefHyper {
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        amsgrad,
    };
    let (groups, wd) = two_groups(NUMEL);
    let mut opt = AdamW::new(config, groups, NUMEL).unwrap();
    let mut rng = ChaCha8Rng::seed_from_u64(7);
    let mut params: Vec<f32> = (0..NUMEL).map(|_| rng.random_range(-1.0f32..1.0)).collect();
    let initial = params.clone();
    let mut refs: Vec<RefElem> = params
        .iter()
        .map(|&p| RefElem {
            p: f64::from(p),
            ..RefElem::default()
        })
        .collect();
    for t in 1..=STEPS {
        // Vary the gradient scale per step so amsgrad's running max matters.
        let scale = if t % 3 == 0 { 0.05f32 } else { 1.0 };
        let grads: Vec<f32> = (0..NUMEL)
            .map(|_| rng.random_range(-1.0f32..1.0) * scale)
            .collect();
        // A decaying learning rate, as a schedule would give; the f64 reference uses the
        // decimal value the f32 was written from.
        let lr_f64 = 1e-3 * (1.0 - (t - 1) as f64 / 40.0);
        let lr = lr_f64 as f32;
        opt.step(&mut params, &grads, lr).unwrap();
        let lr_ref: f64 = lr.to_string().parse().unwrap();
        for (i, e) in refs.iter_mut().enumerate() {
            let w = wd[i].1;
            if !w.is_nan() {
                e.step(f64::from(grads[i]), t, lr_ref, w, &h);
            }
        }
    }
    assert_eq!(opt.step_count(), STEPS);

    // Tolerance 1e-6 (relative, 2-norm): every step does about ten f32 operations per element,
    // each rounding by at most 2^-24 ≈ 6e-8 of its result; the parameters are O(1) and the
    // rounding errors of 20 steps add up to a few 1e-7 at most. Measured: ~1e-7.
    let p_ref: Vec<f64> = refs.iter().map(|e| e.p).collect();
    let err = rel_err(&params, &p_ref);
    assert!(err <= 1e-6, "params rel err {err:e}");

    // The moments on their own (no O(1) parameter to hide behind); same argument.
    let m_ref: Vec<f64> = refs.iter().map(|e| e.m).collect();
    let v_ref: Vec<f64> = refs.iter().map(|e| e.v).collect();
    let em = rel_err(opt.exp_avg(), &m_ref);
    let ev = rel_err(opt.exp_avg_sq(), &v_ref);
    assert!(em <= 1e-6, "exp_avg rel err {em:e}");
    assert!(ev <= 1e-6, "exp_avg_sq rel err {ev:e}");
    if amsgrad {
        let x_ref: Vec<f64> = refs.iter().map(|e| e.vmax).collect();
        let ex = rel_err(opt.max_exp_avg_sq().unwrap(), &x_ref);
        assert!(ex <= 1e-6, "max_exp_avg_sq rel err {ex:e}");
    } else {
        assert!(opt.max_exp_avg_sq().is_none());
    }

    // The change of the parameters alone (~1e-2 of them): storing the O(1) parameter in f32
    // after each step rounds it by up to ~3e-8 absolute, i.e. ~3e-6 of a per-step change of
    // ~1e-3; over 20 steps these add up to ~2e-5 of the total change (measured ~1.7e-5), so
    // the bound here is 1e-4. The per-step update itself is checked at 1e-6 below.
    let d32: Vec<f32> = params.iter().zip(&initial).map(|(a, b)| a - b).collect();
    let d64: Vec<f64> = p_ref
        .iter()
        .zip(&initial)
        .map(|(a, &b)| a - f64::from(b))
        .collect();
    let ed = rel_err(&d32, &d64);
    eprintln!("amsgrad={amsgrad}: rel err params {err:e}, m {em:e}, v {ev:e}, update {ed:e}");
    assert!(ed <= 1e-4, "update rel err {ed:e}");

    // Elements outside every group are untouched, bit for bit.
    for (i, &(_, w)) in wd.iter().enumerate() {
        if w.is_nan() {
            assert_eq!(params[i].to_bits(), initial[i].to_bits(), "element {i}");
            assert_eq!(opt.exp_avg()[i], 0.0);
            assert_eq!(opt.exp_avg_sq()[i], 0.0);
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
fn amsgrad_uses_running_max_of_second_moment() {
    // One element; a large gradient then tiny ones: with amsgrad the denominator keeps the
    // large second moment, so the steps are smaller than without.
    let run = |amsgrad: bool| {
        let config = AdamWConfig {
            lr: 0.1,
            amsgrad,
            ..AdamWConfig::default()
        };
        let mut opt = AdamW::with_single_group(config, 1).unwrap();
        let mut p = [0.0f32];
        opt.step(&mut p, &[10.0], 0.1).unwrap();
        let after_first = p[0];
        for _ in 0..50 {
            opt.step(&mut p, &[1e-3], 0.1).unwrap();
        }
        (after_first, p[0], opt)
    };
    let (a1, a_end, a_opt) = run(true);
    let (b1, b_end, _) = run(false);
    assert_eq!(a1, b1, "the first step is identical");
    assert!(a_end.is_finite() && b_end.is_finite());
    assert!((a_end - a1).abs() < (b_end - b1).abs());
    let vmax = a_opt.max_exp_avg_sq().unwrap()[0];
    assert!(vmax >= a_opt.exp_avg_sq()[0]);
    // max after step 1 is (1-beta2)*100 = 0.1 and never decreases.
    assert!(vmax >= 0.09, "{vmax}");
}

#[test]
fn weight_decay_only_on_decaying_group() {
    // Zero gradients: the Adam update is exactly 0 (m = 0 → 0 / denom), so only decay acts.
    let config = AdamWConfig {
        lr: 0.5,
        ..AdamWConfig::default()
    };
    let groups = vec![
        ParamGroup::new("decay", vec![0..4], 0.1),
        ParamGroup::new("no_decay", vec![4..8], 0.0),
    ];
    let mut opt = AdamW::new(config, groups, 8).unwrap();
    let mut p = [1.0f32, -2.0, 3.0, 0.5, 1.0, -2.0, 3.0, 0.5];
    let before = p;
    opt.step(&mut p, &[0.0; 8], 0.5).unwrap();
    // 1 - lr*wd = 1 - 0.5*0.1 = 0.95, rounded to f32, times p.
    let f = (1.0f64 - 0.5 * 0.1) as f32;
    for i in 0..4 {
        assert_eq!(p[i], before[i] * f, "decayed element {i}");
    }
    for i in 4..8 {
        assert_eq!(
            p[i].to_bits(),
            before[i].to_bits(),
            "non-decayed element {i}"
        );
    }
}

#[test]
fn lr_scale_scales_the_step() {
    // With lr_scale 0 a group does not move at all; with 2 it moves twice as far on step 1
    // (step 1 update = -lr * g/|g| * |g|/(|g| + eps·...) ≈ -lr·sign(g)).
    let config = AdamWConfig::default();
    let groups = vec![
        ParamGroup::new("frozen", vec![0..1], 0.0).with_lr_scale(0.0),
        ParamGroup::new("normal", vec![1..2], 0.0),
        ParamGroup::new("double", vec![2..3], 0.0).with_lr_scale(2.0),
    ];
    let mut opt = AdamW::new(config, groups, 3).unwrap();
    let mut p = [0.0f32; 3];
    opt.step(&mut p, &[1.0, 1.0, 1.0], 1e-2).unwrap();
    assert_eq!(p[0], 0.0);
    assert!((p[1] + 1e-2).abs() < 1e-7, "{}", p[1]);
    assert!((p[2] + 2e-2).abs() < 1e-7, "{}", p[2]);
}

#[test]
fn step_is_bitwise_independent_of_thread_count() {
    let numel = 100_003;
    let mut rng = ChaCha8Rng::seed_from_u64(11);
    let p0: Vec<f32> = (0..numel).map(|_| rng.random_range(-1.0f32..1.0)).collect();
    let grads: Vec<Vec<f32>> = (0..3)
        .map(|_| (0..numel).map(|_| rng.random_range(-1.0f32..1.0)).collect())
        .collect();
    let run = |threads: usize| {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        pool.install(|| {
            let config = AdamWConfig {
                weight_decay: 0.01,
                amsgrad: true,
                ..AdamWConfig::default()
            };
            let mut opt = AdamW::with_single_group(config, numel).unwrap();
            let mut p = p0.clone();
            for g in &grads {
                opt.step(&mut p, g, 1e-3).unwrap();
            }
            p
        })
    };
    let a = run(1);
    let b = run(4);
    assert!(a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()));
}

fn expect_hyper(config: AdamWConfig, expected_name: &str) {
    match AdamW::with_single_group(config, 4) {
        Err(OptimError::InvalidHyperParameter { name, .. }) => assert_eq!(name, expected_name),
        other => panic!("expected InvalidHyperParameter({expected_name}), got {other:?}"),
    }
}

#[test]
fn hyper_parameter_validation() {
    let d = AdamWConfig::default();
    // Hugging Face Trainer defaults.
    assert_eq!(d.beta1, 0.9);
    assert_eq!(d.beta2, 0.999);
    assert_eq!(d.eps, 1e-8);
    assert_eq!(d.weight_decay, 0.0);
    assert!(!d.amsgrad);
    assert!(d.validate().is_ok());

    expect_hyper(AdamWConfig { lr: f32::NAN, ..d }, "lr");
    expect_hyper(
        AdamWConfig {
            lr: f32::INFINITY,
            ..d
        },
        "lr",
    );
    expect_hyper(AdamWConfig { lr: -1e-3, ..d }, "lr");
    expect_hyper(AdamWConfig { beta1: 1.0, ..d }, "beta1");
    expect_hyper(AdamWConfig { beta1: -0.1, ..d }, "beta1");
    expect_hyper(
        AdamWConfig {
            beta1: f32::NAN,
            ..d
        },
        "beta1",
    );
    expect_hyper(AdamWConfig { beta2: 1.0, ..d }, "beta2");
    expect_hyper(AdamWConfig { beta2: 1.5, ..d }, "beta2");
    expect_hyper(AdamWConfig { eps: 0.0, ..d }, "eps");
    expect_hyper(AdamWConfig { eps: -1e-8, ..d }, "eps");
    expect_hyper(AdamWConfig { eps: f32::NAN, ..d }, "eps");
    expect_hyper(
        AdamWConfig {
            weight_decay: -0.1,
            ..d
        },
        "weight_decay",
    );
    expect_hyper(
        AdamWConfig {
            weight_decay: f32::INFINITY,
            ..d
        },
        "weight_decay",
    );
    // beta = 0 is allowed (torch allows it too).
    assert!(AdamW::with_single_group(AdamWConfig { beta1: 0.0, ..d }, 4).is_ok());

    // Per-group hyper-parameters.
    let bad_wd = vec![ParamGroup::new("g", vec![0..4], -0.5)];
    assert!(matches!(
        AdamW::new(d, bad_wd, 4),
        Err(OptimError::InvalidHyperParameter {
            name: "weight_decay",
            ..
        })
    ));
    let bad_scale = vec![ParamGroup::new("g", vec![0..4], 0.0).with_lr_scale(f32::NAN)];
    assert!(matches!(
        AdamW::new(d, bad_scale, 4),
        Err(OptimError::InvalidHyperParameter {
            name: "lr_scale",
            ..
        })
    ));

    // The learning rate of a step.
    let mut opt = AdamW::with_single_group(d, 2).unwrap();
    let mut p = [1.0f32, 2.0];
    for lr in [f32::NAN, f32::INFINITY, -1.0] {
        assert!(matches!(
            opt.step(&mut p, &[0.1, 0.1], lr),
            Err(OptimError::InvalidHyperParameter { name: "lr", .. })
        ));
    }
    assert_eq!(p, [1.0, 2.0]);
    assert_eq!(opt.step_count(), 0);
}

#[test]
fn group_range_validation() {
    let d = AdamWConfig::default();
    let out = vec![ParamGroup::new("g", vec![0..4, 8..11], 0.0)];
    match AdamW::new(d, out, 10) {
        Err(OptimError::RangeOutOfBounds { start, end, len }) => {
            assert_eq!((start, end, len), (8, 11, 10));
        }
        other => panic!("{other:?}"),
    }
    #[allow(clippy::reversed_empty_ranges)]
    let reversed = vec![ParamGroup::new("g", vec![5..2], 0.0)];
    assert!(matches!(
        AdamW::new(d, reversed, 10),
        Err(OptimError::ReversedRange {
            start: 5,
            end: 2,
            ..
        })
    ));
    let overlap_across = vec![
        ParamGroup::new("a", vec![0..5], 0.1),
        ParamGroup::new("b", vec![4..8], 0.0),
    ];
    match AdamW::new(d, overlap_across, 10) {
        Err(OptimError::OverlappingRanges {
            first_group,
            second_group,
            ..
        }) => {
            assert_eq!((first_group.as_str(), second_group.as_str()), ("a", "b"));
        }
        other => panic!("{other:?}"),
    }
    let overlap_within = vec![ParamGroup::new("a", vec![6..9, 0..3, 2..4], 0.1)];
    assert!(matches!(
        AdamW::new(d, overlap_within, 10),
        Err(OptimError::OverlappingRanges { .. })
    ));
    // Adjacent, unordered and empty ranges are fine.
    #[allow(clippy::reversed_empty_ranges)]
    let ok = vec![
        ParamGroup::new("a", vec![5..10, 0..3, 3..3], 0.1),
        ParamGroup::new("b", vec![3..5], 0.0),
    ];
    let opt = AdamW::new(d, ok, 10).unwrap();
    let starts: Vec<usize> = opt.segments().iter().map(|s| s.range.start).collect();
    assert_eq!(starts, vec![0, 3, 5]);
}

#[test]
fn length_mismatch_errors_leave_state_untouched() {
    let mut opt = AdamW::with_single_group(AdamWConfig::default(), 4).unwrap();
    let mut p = [1.0f32; 4];
    let mut short = [1.0f32; 3];
    match opt.step(&mut short, &[0.1; 4], 1e-3) {
        Err(OptimError::LengthMismatch {
            expected, actual, ..
        }) => assert_eq!((expected, actual), (4, 3)),
        other => panic!("{other:?}"),
    }
    match opt.step(&mut p, &[0.1; 5], 1e-3) {
        Err(OptimError::LengthMismatch {
            expected, actual, ..
        }) => assert_eq!((expected, actual), (4, 5)),
        other => panic!("{other:?}"),
    }
    assert_eq!(p, [1.0; 4]);
    assert_eq!(opt.step_count(), 0);
    assert!(opt.exp_avg().iter().all(|&m| m == 0.0));
}

#[test]
fn step_counter_and_bias_correction_of_first_step() {
    // After one step from zero moments, m̂ = g and v̂ = g², so the update is
    // -lr * g / (|g| + eps) ≈ -lr * sign(g), whatever the gradient's size.
    let mut opt = AdamW::with_single_group(AdamWConfig::default(), 3).unwrap();
    let mut p = [0.0f32; 3];
    opt.step(&mut p, &[1e-3, -5.0, 1e3], 0.01).unwrap();
    assert_eq!(opt.step_count(), 1);
    for (x, s) in p.iter().zip([-1.0f32, 1.0, -1.0]) {
        assert!((x - s * 0.01).abs() < 1e-7, "{x}");
    }
    opt.step(&mut p, &[0.0; 3], 0.0).unwrap();
    assert_eq!(opt.step_count(), 2);
}

#[test]
fn empty_optimizer_steps() {
    let mut opt = AdamW::new(AdamWConfig::default(), vec![], 0).unwrap();
    opt.step(&mut [], &[], 1e-3).unwrap();
    assert_eq!(opt.step_count(), 1);
}

#[test]
fn single_update_matches_f64_reference() {
    // Parameters at 0 and no decay: the result is the update alone, with no O(1) value whose
    // f32 storage would dominate. Tolerance 1e-6: the update is a handful of f32 operations
    // (lerp, mul/add, sqrt, div, add, mul, div), each rounding by ≤ 2^-24 ≈ 6e-8 relative.
    let numel = 10_000;
    let mut rng = ChaCha8Rng::seed_from_u64(3);
    let config = AdamWConfig::default();
    let h = RefHyper {
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        amsgrad: false,
    };
    let mut opt = AdamW::with_single_group(config, numel).unwrap();
    let mut refs = vec![RefElem::default(); numel];
    let mut p = vec![0.0f32; numel];
    for t in 1..=5u64 {
        let g: Vec<f32> = (0..numel).map(|_| rng.random_range(-1.0f32..1.0)).collect();
        // Reset the parameters so each step's update is measured on its own.
        p.iter_mut().for_each(|x| *x = 0.0);
        refs.iter_mut().for_each(|e| e.p = 0.0);
        opt.step(&mut p, &g, 1e-3).unwrap();
        for (e, &gi) in refs.iter_mut().zip(&g) {
            e.step(f64::from(gi), t, 1e-3, 0.0, &h);
        }
        let p_ref: Vec<f64> = refs.iter().map(|e| e.p).collect();
        let err = rel_err(&p, &p_ref);
        assert!(err <= 1e-6, "step {t}: update rel err {err:e}");
    }
}

/// `step_fused` (the lean mode's host step) is, bit for bit, the three passes it replaces:
/// gradients multiplied by the clip coefficient, `step`, and the bf16 cast of every parameter
/// (those outside the groups included: two_groups leaves a gap and a tail), with and without
/// amsgrad, with a coefficient of 1 and another, over several steps.
#[test]
fn the_fused_step_is_scale_step_and_cast_in_turn() {
    use tilearn_optim::bf16_copy::cast_to_bf16_bits;
    let numel = 40_000;
    let mut rng = ChaCha8Rng::seed_from_u64(11);
    for amsgrad in [false, true] {
        let config = AdamWConfig {
            amsgrad,
            ..AdamWConfig::default()
        };
        let (groups, _) = two_groups(numel);
        let mut fused = AdamW::new(config, groups.clone(), numel).unwrap();
        let mut passes = AdamW::new(config, groups, numel).unwrap();
        let init: Vec<f32> = (0..numel).map(|_| rng.random_range(-1.0..1.0)).collect();
        let (mut p_fused, mut p_passes) = (init.clone(), init);
        let mut copy_fused = vec![0u16; numel];
        let mut copy_passes = vec![0u16; numel];
        for (step, scale) in [(1, 1.0f32), (2, 0.37), (3, 1.0), (4, 2.5e-3)] {
            let grads: Vec<f32> = (0..numel).map(|_| rng.random_range(-3.0..3.0)).collect();
            let lr = 1e-3 * step as f32;
            fused
                .step_fused(&mut p_fused, &grads, lr, scale, Some(&mut copy_fused))
                .unwrap();
            let scaled: Vec<f32> = grads.iter().map(|&g| g * scale).collect();
            let grads_in = if scale == 1.0 { &grads } else { &scaled };
            passes.step(&mut p_passes, grads_in, lr).unwrap();
            cast_to_bf16_bits(&p_passes, &mut copy_passes);
            let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            assert_eq!(
                bits(&p_fused),
                bits(&p_passes),
                "amsgrad {amsgrad}, step {step}"
            );
            assert_eq!(copy_fused, copy_passes, "amsgrad {amsgrad}, step {step}");
            assert_eq!(bits(fused.exp_avg_sq()), bits(passes.exp_avg_sq()));
        }
        // The copy covers the tail outside every group, which the step leaves alone.
        assert_ne!(copy_fused[numel - 1], 0);
    }
    // A copy of the wrong length is refused before anything changes.
    let (groups, _) = two_groups(numel);
    let mut opt = AdamW::new(AdamWConfig::default(), groups, numel).unwrap();
    let mut p = vec![0.5f32; numel];
    let err = opt
        .step_fused(&mut p, &vec![1.0; numel], 1e-3, 1.0, Some(&mut [0u16; 3]))
        .unwrap_err();
    assert!(matches!(err, OptimError::LengthMismatch { .. }), "{err}");
    assert_eq!(opt.step_count(), 0);
    assert!(p.iter().all(|&x| x == 0.5));
}
