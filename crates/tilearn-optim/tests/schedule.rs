//! Learning-rate schedules against values computed by hand from transformers' lr lambdas.

use std::f64::consts::PI;

use tilearn_optim::{LrSchedule, OptimError, SchedulerType};

fn sched(kind: SchedulerType, warmup: u64, total: u64) -> LrSchedule {
    LrSchedule::new(kind, 1.0, warmup, total).unwrap()
}

fn close(a: f64, b: f64) {
    assert!((a - b).abs() <= 1e-12, "{a} vs {b}");
}

#[test]
fn linear_values() {
    // step < warmup: step / max(1, warmup); else max(0, (total - step) / max(1, total - warmup))
    let s = sched(SchedulerType::Linear, 10, 110);
    close(s.lambda(0), 0.0); // 0/10
    close(s.lambda(5), 0.5); // 5/10
    close(s.lambda(10), 1.0); // (110-10)/100
    close(s.lambda(60), 0.5); // (110-60)/100
    close(s.lambda(109), 0.01); // 1/100
    close(s.lambda(110), 0.0); // 0/100
    close(s.lambda(200), 0.0); // max(0, -90/100)
}

#[test]
fn cosine_values() {
    // progress = (step - warmup) / max(1, total - warmup);
    // lambda = max(0, 0.5 * (1 + cos(pi * 0.5 * 2 * progress)))
    let s = sched(SchedulerType::Cosine, 10, 110);
    close(s.lambda(5), 0.5); // warmup 5/10
    close(s.lambda(10), 1.0); // progress 0 → 0.5 * (1 + 1)
    close(s.lambda(35), 0.5 + 2f64.sqrt() / 4.0); // progress 0.25 → 0.5 * (1 + cos(pi/4))
    close(s.lambda(60), 0.5); // progress 0.5 → 0.5 * (1 + cos(pi/2))
    close(s.lambda(110), 0.0); // progress 1 → 0.5 * (1 + cos(pi))
    // transformers does not clamp after total: progress 1.5 → 0.5 * (1 + cos(1.5 pi)) = 0.5.
    close(s.lambda(160), 0.5);
}

#[test]
fn cosine_with_restarts_values() {
    // progress as cosine; progress >= 1 → 0;
    // else max(0, 0.5 * (1 + cos(pi * ((num_cycles * progress) % 1))))
    let s = sched(
        SchedulerType::CosineWithRestarts { num_cycles: 2.0 },
        0,
        100,
    );
    close(s.lambda(0), 1.0); // (2*0)%1 = 0 → 1
    close(s.lambda(10), 0.5 * (1.0 + (PI * 0.2).cos())); // (2*0.1)%1 = 0.2
    close(s.lambda(25), 0.5); // (2*0.25)%1 = 0.5 → 0.5 * (1 + cos(pi/2))
    close(s.lambda(50), 1.0); // (2*0.5)%1 = 0 → restart
    close(s.lambda(75), 0.5); // (2*0.75)%1 = 0.5
    close(s.lambda(100), 0.0); // progress 1
    close(s.lambda(150), 0.0);
    // Default from the name: one cycle, which equals "cosine" before total.
    let parsed: SchedulerType = "cosine_with_restarts".parse().unwrap();
    assert_eq!(
        parsed,
        SchedulerType::CosineWithRestarts { num_cycles: 1.0 }
    );
    let one = sched(parsed, 10, 110);
    let cos = sched(SchedulerType::Cosine, 10, 110);
    for step in 0..110 {
        close(one.lambda(step), cos.lambda(step));
    }
}

#[test]
fn polynomial_values() {
    // base 0.5, lr_end 0.125, power 2, warmup 10, total 110 (all exact in binary):
    // step > total: lr_end / lr_init; else pct_remaining = 1 - (step - warmup) / (total - warmup),
    // decay = (lr_init - lr_end) * pct_remaining^power + lr_end, lambda = decay / lr_init.
    let kind = SchedulerType::Polynomial {
        power: 2.0,
        lr_end: 0.125,
    };
    let s = LrSchedule::new(kind, 0.5, 10, 110).unwrap();
    close(s.lambda(5), 0.5); // warmup
    close(s.lambda(10), 1.0); // pct 1 → (0.375 + 0.125) / 0.5
    close(s.lambda(60), 0.4375); // pct 0.5 → (0.375 * 0.25 + 0.125) / 0.5 = 0.21875 / 0.5
    close(s.lambda(110), 0.25); // pct 0 → 0.125 / 0.5
    close(s.lambda(111), 0.25); // after total: lr_end / lr_init
    assert_eq!(s.lr_at(60), 0.21875);
    assert_eq!(s.lr_at(1000), 0.125);
    // Defaults from the name: power 1, lr_end 1e-7.
    assert_eq!(
        "polynomial".parse::<SchedulerType>().unwrap(),
        SchedulerType::Polynomial {
            power: 1.0,
            lr_end: 1e-7
        }
    );
}

#[test]
fn inverse_sqrt_values() {
    // timescale = warmup or 10_000; shift = timescale - warmup;
    // after warmup: 1 / sqrt((step + shift) / timescale)
    let s = sched(SchedulerType::InverseSqrt, 100, 1000);
    close(s.lambda(50), 0.5); // warmup 50/100
    close(s.lambda(100), 1.0); // 1/sqrt(100/100)
    close(s.lambda(400), 0.5); // 1/sqrt(400/100)
    close(s.lambda(10_000), 0.1); // 1/sqrt(100); total_steps plays no part
    let s0 = sched(SchedulerType::InverseSqrt, 0, 1000);
    close(s0.lambda(0), 1.0); // 1/sqrt((0 + 10000)/10000)
    close(s0.lambda(30_000), 0.5); // 1/sqrt(40000/10000)
}

#[test]
fn constant_values() {
    // "constant" ignores warmup (transformers' get_scheduler does not pass it on).
    let s = LrSchedule::new(SchedulerType::Constant, 3e-4, 10, 100).unwrap();
    for step in [0, 1, 5, 10, 100, 1_000_000] {
        assert_eq!(s.lr_at(step), 3e-4);
    }
    // "constant_with_warmup": step / max(1, warmup) during warmup, then 1.
    let w = sched(SchedulerType::ConstantWithWarmup, 4, 100);
    close(w.lambda(0), 0.0);
    close(w.lambda(1), 0.25);
    close(w.lambda(3), 0.75);
    close(w.lambda(4), 1.0);
    close(w.lambda(1_000_000), 1.0);
}

#[test]
fn warmup_stable_decay_values() {
    // warmup: factor = step / max(1, warmup), lambda = factor * (1 - r) + r;
    // stable: 1; decay: progress = (step - warmup - stable) / max(1, decay),
    // factor = 0.5 * (1 + cos(pi * 0.5 * 2 * progress)), lambda = factor * (1 - r) + r;
    // afterwards r. Here warmup 10, stable 20, decay 10, r = 0.1.
    let kind = SchedulerType::WarmupStableDecay {
        num_stable_steps: 20,
        num_decay_steps: 10,
        min_lr_ratio: 0.1,
    };
    let s = sched(kind, 10, 40);
    close(s.lambda(0), 0.1); // 0 * 0.9 + 0.1
    close(s.lambda(5), 0.55); // 0.5 * 0.9 + 0.1
    close(s.lambda(10), 1.0);
    close(s.lambda(29), 1.0);
    close(s.lambda(30), 1.0); // progress 0 → 1 * 0.9 + 0.1
    close(s.lambda(35), 0.55); // progress 0.5 → 0.5 * 0.9 + 0.1
    close(s.lambda(39), 0.5 * (1.0 + (PI * 0.9).cos()) * 0.9 + 0.1);
    close(s.lambda(40), 0.1);
    close(s.lambda(10_000), 0.1);

    // The stable phase fills the rest when derived from the total (as get_wsd_schedule does
    // without num_stable_steps).
    assert_eq!(
        SchedulerType::warmup_stable_decay(100, 10, 20, 0.0),
        SchedulerType::WarmupStableDecay {
            num_stable_steps: 70,
            num_decay_steps: 20,
            min_lr_ratio: 0.0
        }
    );
    assert_eq!(
        SchedulerType::warmup_stable_decay(10, 10, 20, 0.0),
        SchedulerType::WarmupStableDecay {
            num_stable_steps: 0,
            num_decay_steps: 20,
            min_lr_ratio: 0.0
        }
    );
}

fn assert_non_increasing(s: &LrSchedule, from: u64, to: u64) {
    for step in from..to {
        assert!(
            s.lr_at(step + 1) <= s.lr_at(step),
            "{:?}: lr rises from step {step} to {}",
            s.kind,
            step + 1
        );
    }
}

fn assert_non_decreasing(s: &LrSchedule, from: u64, to: u64) {
    for step in from..to {
        assert!(
            s.lr_at(step + 1) >= s.lr_at(step),
            "{:?}: lr falls from step {step} to {}",
            s.kind,
            step + 1
        );
    }
}

#[test]
fn monotonic_phases() {
    let wsd = SchedulerType::warmup_stable_decay(300, 30, 100, 0.05);
    let kinds = [
        SchedulerType::Linear,
        SchedulerType::Cosine,
        SchedulerType::ConstantWithWarmup,
        SchedulerType::Polynomial {
            power: 1.5,
            lr_end: 1e-7,
        },
        SchedulerType::InverseSqrt,
        wsd,
    ];
    for kind in kinds {
        let s = LrSchedule::new(kind, 1e-3, 30, 300).unwrap();
        assert_non_decreasing(&s, 0, 30);
        assert_non_increasing(&s, 30, 300);
        assert!(s.lr_at(30) == 1e-3, "{kind:?}: peak at the end of warmup");
        for step in 0..400 {
            let lr = s.lr_at(step);
            assert!((0.0..=1e-3).contains(&lr), "{kind:?} {step}: {lr}");
        }
    }
    // Linear and cosine reach 0 at total.
    for kind in [SchedulerType::Linear, SchedulerType::Cosine] {
        assert_eq!(sched(kind, 30, 300).lr_at(300), 0.0);
    }
}

#[test]
fn edge_cases() {
    // warmup 0: the first step already has the full learning rate.
    for kind in [
        SchedulerType::Linear,
        SchedulerType::Cosine,
        SchedulerType::ConstantWithWarmup,
        SchedulerType::CosineWithRestarts { num_cycles: 3.0 },
        SchedulerType::Polynomial {
            power: 1.0,
            lr_end: 0.0,
        },
        SchedulerType::InverseSqrt,
    ] {
        close(sched(kind, 0, 100).lambda(0), 1.0);
    }

    // total == warmup: warmup as usual, then
    //   linear: max(0, 0 / max(1, 0)) = 0 at step == total;
    //   cosine: progress = 0 / max(1, 0) = 0 → 1 at step == total, then progress ≥ 1 → 0;
    //   polynomial: transformers divides by zero here; we give lr_end / lr_init.
    let lin = sched(SchedulerType::Linear, 10, 10);
    close(lin.lambda(9), 0.9);
    close(lin.lambda(10), 0.0);
    close(lin.lambda(11), 0.0);
    let cos = sched(SchedulerType::Cosine, 10, 10);
    close(cos.lambda(9), 0.9);
    close(cos.lambda(10), 1.0);
    close(cos.lambda(11), 0.0);
    let poly = LrSchedule::new(
        SchedulerType::Polynomial {
            power: 1.0,
            lr_end: 0.25,
        },
        1.0,
        10,
        10,
    )
    .unwrap();
    close(poly.lambda(10), 0.25);

    // total < warmup: warmup still governs the first steps, then linear is clamped at 0.
    let short = sched(SchedulerType::Linear, 10, 5);
    close(short.lambda(7), 0.7);
    close(short.lambda(10), 0.0);

    // total 0, warmup 0.
    close(sched(SchedulerType::Linear, 0, 0).lambda(0), 0.0);
    close(sched(SchedulerType::Constant, 0, 0).lambda(0), 1.0);

    // Huge step numbers do not overflow.
    let s = sched(SchedulerType::Linear, 10, 100);
    close(s.lambda(u64::MAX), 0.0);
    let wsd = sched(
        SchedulerType::warmup_stable_decay(u64::MAX, 1, 1, 0.5),
        1,
        u64::MAX,
    );
    close(wsd.lambda(u64::MAX - 2), 1.0); // stable until warmup + stable = MAX - 1
    close(wsd.lambda(u64::MAX - 1), 1.0); // decay progress 0
    close(wsd.lambda(u64::MAX), 0.5); // after the decay: min_lr_ratio
}

#[test]
fn lr_at_is_base_times_lambda() {
    let s = LrSchedule::new(SchedulerType::Cosine, 3e-4, 7, 93).unwrap();
    for step in 0..100 {
        assert_eq!(s.lr_at(step), (f64::from(3e-4f32) * s.lambda(step)) as f32);
    }
}

#[test]
fn names_parse_and_print() {
    let names = [
        "constant",
        "constant_with_warmup",
        "linear",
        "cosine",
        "cosine_with_restarts",
        "polynomial",
        "inverse_sqrt",
        "warmup_stable_decay",
    ];
    for name in names {
        let kind: SchedulerType = name.parse().unwrap();
        assert_eq!(kind.to_string(), name);
        assert_eq!(kind.hf_name(), name);
    }
    assert!(matches!(
        "cosine_with_min_lr".parse::<SchedulerType>(),
        Err(OptimError::UnknownScheduler(n)) if n == "cosine_with_min_lr"
    ));
    assert!("Linear".parse::<SchedulerType>().is_err());

    // JSON (scheduler.json) round trip, tagged with the Hugging Face name.
    let s = LrSchedule::new(
        SchedulerType::warmup_stable_decay(100, 10, 20, 0.1),
        1e-3,
        10,
        100,
    )
    .unwrap();
    let json = serde_json::to_string(&s).unwrap();
    assert!(json.contains("\"type\":\"warmup_stable_decay\""), "{json}");
    let back: LrSchedule = serde_json::from_str(&json).unwrap();
    assert_eq!(back, s);
}

#[test]
fn validation() {
    // transformers: "lr_end must be smaller than initial lr".
    let poly = |lr_end| SchedulerType::Polynomial { power: 1.0, lr_end };
    assert!(matches!(
        LrSchedule::new(poly(0.5), 0.5, 0, 10),
        Err(OptimError::InvalidHyperParameter { name: "lr_end", .. })
    ));
    assert!(LrSchedule::new(poly(0.75), 0.5, 0, 10).is_err());
    assert!(LrSchedule::new(poly(f64::NAN), 1e-3, 0, 10).is_err());
    assert!(LrSchedule::new(poly(1e-7), 1e-3, 0, 10).is_ok());
    for bad in [f32::NAN, f32::INFINITY, -1e-3] {
        assert!(matches!(
            LrSchedule::new(SchedulerType::Linear, bad, 0, 10),
            Err(OptimError::InvalidHyperParameter { name: "lr", .. })
        ));
    }
    assert!(
        LrSchedule::new(
            SchedulerType::CosineWithRestarts {
                num_cycles: f64::INFINITY
            },
            1e-3,
            0,
            10
        )
        .is_err()
    );
}
