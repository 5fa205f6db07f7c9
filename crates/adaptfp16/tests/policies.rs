//! Every policy as a decision table over a whole schedule: the precision at every period is
//! compared with an expected timeline written by hand as segments (from the rules in the crate
//! docs, not computed by the same code), with the first mismatch reported.

use DType::{BF16, F16, F32};
use adaptfp16::policy::AutoMode;
use adaptfp16::{
    AmpPolicy, CpuGrads, DType, Error, GradScaler, Param, PolicyBuilder, PolicyId, Signals,
    TimeUnit,
};

/// `[(end_exclusive, precision)]` → one precision per period from 0.
fn timeline(segments: &[(u64, DType)]) -> Vec<DType> {
    let mut out = Vec::new();
    for &(end, p) in segments {
        assert!(end as usize > out.len(), "segments must increase");
        out.resize(end as usize, p);
    }
    out
}

fn assert_timeline(name: &str, got: &[DType], want: &[DType]) {
    assert_eq!(got.len(), want.len(), "{name}: length");
    if let Some(t) = (0..got.len()).find(|&t| got[t] != want[t]) {
        let ctx: Vec<String> = (t.saturating_sub(3)..(t + 4).min(got.len()))
            .map(|i| format!("{i}:{}/{}", got[i], want[i]))
            .collect();
        panic!(
            "{name}: period {t}: got {} want {} (got/want around: {})",
            got[t],
            want[t],
            ctx.join(" ")
        );
    }
    let switches = want.windows(2).filter(|w| w[0] != w[1]).count();
    eprintln!("{name}: {} periods match, {switches} switches", got.len());
}

fn run(policy: &mut AmpPolicy, n: u64, signals: impl Fn(u64) -> Signals) -> Vec<DType> {
    (0..n)
        .map(|t| policy.decide(t, signals(t), None).unwrap())
        .collect()
}

// ---------------------------------------------------------------- policy 0

#[test]
fn policy0_time_window_inclusive() {
    let mut p = PolicyBuilder::new(PolicyId::Time)
        .end(2000)
        .build()
        .unwrap();
    let got = run(&mut p, 3000, |_| Signals::default());
    let want = timeline(&[(10, F32), (2001, F16), (3000, F32)]);
    assert_timeline("policy 0 (default start 10, end 2000)", &got, &want);

    let mut p = PolicyBuilder::new(PolicyId::Time)
        .start(0)
        .end(0)
        .mixed(BF16)
        .unit(TimeUnit::Epoch)
        .build()
        .unwrap();
    assert_eq!(p.unit(), TimeUnit::Epoch);
    let got = run(&mut p, 5, |_| Signals::default());
    assert_timeline(
        "policy 0 one-period window",
        &got,
        &timeline(&[(1, BF16), (5, F32)]),
    );
}

// ---------------------------------------------------------------- policy 1

/// Step decays, a 5% wiggle that is below the tolerance, a change during a hold, a warm
/// restart into a smooth cosine that must not trigger, and a drop just before `end`.
fn lr_schedule(t: u64) -> f64 {
    match t {
        0..80 => 2e-3,
        80..300 => 1e-3,
        300..600 => 1.05e-3,
        600..1000 => 1e-4,
        1000..1010 => 1e-5,
        1010..1500 => 2e-5,
        _ => {
            let x = (t.min(3000) - 1500) as f64 / 1500.0;
            let cosine = 1e-4 + 0.9e-3 * 0.5 * (1.0 + (std::f64::consts::PI * x).cos());
            if t < 2480 { cosine } else { cosine / 3.0 }
        }
    }
}

#[test]
fn policy1_holds_fp32_after_learning_rate_changes() {
    let mut p = PolicyBuilder::new(PolicyId::TimeLr)
        .start(100)
        .end(2500)
        .hold(50)
        .build()
        .unwrap();
    let got = run(&mut p, 3000, |t| Signals {
        lr: Some(lr_schedule(t)),
        loss: None,
    });
    let want = timeline(&[
        (130, F32), // before start, then the hold of the change at 80 runs into the window
        (600, F16), // the 5% wiggle at 300 is below the 10% tolerance
        (650, F32), // drop at 600
        (1000, F16),
        (1060, F32), // drop at 1000, restarted by the change at 1010
        (1500, F16),
        (1550, F32), // warm restart at 1500; the cosine after it never triggers
        (2480, F16),
        (3000, F32), // drop at 2480, held past end (2500), then after end
    ]);
    assert_timeline("policy 1", &got, &want);
}

#[test]
fn policy1_end_is_inclusive_and_lr_is_required() {
    let mut p = PolicyBuilder::new(PolicyId::TimeLr)
        .start(2)
        .end(4)
        .hold(1)
        .mixed(BF16)
        .build()
        .unwrap();
    let got = run(&mut p, 7, |_| Signals {
        lr: Some(0.1),
        loss: None,
    });
    assert_timeline(
        "policy 1 small",
        &got,
        &timeline(&[(2, F32), (5, BF16), (7, F32)]),
    );
    let err = p.decide(7, Signals::default(), None).unwrap_err();
    assert!(
        matches!(err, Error::MissingSignal { signal: "lr", .. }),
        "{err}"
    );
    let err = p
        .decide(
            8,
            Signals {
                lr: Some(f64::NAN),
                loss: None,
            },
            None,
        )
        .unwrap_err();
    assert!(matches!(err, Error::NonFiniteSignal { .. }), "{err}");
}

// ---------------------------------------------------------------- policy 2

fn base_loss(t: u64) -> f64 {
    5.0 - t as f64 * 0.001
}

#[test]
fn policy2_loss_trend_decides_inside_windows_only() {
    let mut p = PolicyBuilder::new(PolicyId::Loss).build().unwrap();
    let r = base_loss(2000); // window 2's reference: the loss given when it opens
    let loss = |t: u64| -> Option<f64> {
        Some(match t {
            0..5 => return None,    // no loss yet at the very start
            700..800 => 50.0,       // a spike between windows changes nothing
            2040..2045 => r * 1.01, // 1% above the reference: within 2%
            2050..2070 => r * 1.05, // rising: off
            2090..2100 => r * 1.03, // rising at the window's end: off and stays off
            _ => base_loss(t),
        })
    };
    let got = run(&mut p, 3050, |t| Signals {
        lr: None,
        loss: loss(t),
    });
    let want = timeline(&[
        (10, F32), // before the default start
        (2050, F16),
        (2070, F32),
        (2090, F16),
        (3000, F32), // the last decision of window 2 stands until window 3 opens
        (3050, F16), // window 3 switches mixed precision back on
    ]);
    assert_timeline("policy 2 defaults", &got, &want);
}

#[test]
fn policy2_non_finite_absent_loss_and_end() {
    let mut p = PolicyBuilder::new(PolicyId::Loss)
        .start(0)
        .end(2600)
        .interval(500)
        .interval_hold(50)
        .mixed(BF16)
        .build()
        .unwrap();
    let r = base_loss(2001); // window 4's reference: its first given loss (2000 gives none)
    let loss = |t: u64| -> Option<f64> {
        Some(match t {
            1510 => f64::NAN,
            2000 => return None,
            2020..2030 => r * 1.1,
            _ => base_loss(t),
        })
    };
    let got = run(&mut p, 3000, |t| Signals {
        lr: None,
        loss: loss(t),
    });
    let want = timeline(&[
        (1510, BF16),
        (1511, F32),  // NaN loss inside window 3
        (2020, BF16), // recovers at once: the next loss is below the reference
        (2030, F32),
        (2601, BF16), // window 5 (2500..2550) sees a falling loss
        (3000, F32),  // after end
    ]);
    assert_timeline("policy 2 interval 500/50, end 2600", &got, &want);
}

// ---------------------------------------------------------------- auto

/// Steps where an fp16 step's gradients overflow (only fp16 steps use the scaler).
fn planted_overflow(t: u64) -> bool {
    // A fresh start backs off a few times; then 10 overflows in 20 steps; then every step (the
    // scale collapses); then rare overflows that the scale never recovers from (slow collapse).
    t < 5
        || ((500..520).contains(&t) && t.is_multiple_of(2))
        || (1000..1100).contains(&t)
        || (t >= 2000 && t.is_multiple_of(50))
}

fn auto_loss(t: u64) -> Option<f64> {
    (1500..1510).contains(&t).then_some(f64::NAN)
}

/// Runs the auto policy with a real GradScaler; returns the timeline and the scale at each
/// decision. `resume_at`: save and restore policy + scaler at that step.
fn run_auto(n: u64, resume_at: Option<u64>) -> (Vec<DType>, Vec<f32>) {
    let build = || PolicyBuilder::new(PolicyId::Auto).build().unwrap();
    let mut policy = build();
    let mut scaler = GradScaler::new();
    let (mut got, mut scales) = (Vec::new(), Vec::new());
    for t in 0..n {
        if resume_at == Some(t) {
            let saved_policy = policy.state_json().unwrap();
            let saved_scaler = scaler.state_dict().unwrap();
            policy = build();
            policy.load_state_json(&saved_policy).unwrap();
            scaler = GradScaler::new();
            scaler.load_state_dict(&saved_scaler).unwrap();
        }
        let signals = Signals {
            lr: None,
            loss: auto_loss(t),
        };
        let p = policy.decide(t, signals, Some(&mut scaler)).unwrap();
        // Asking again for the same period neither changes the answer nor counts twice.
        assert_eq!(policy.decide(t, signals, Some(&mut scaler)).unwrap(), p);
        got.push(p);
        scales.push(scaler.get_scale());
        if p == F16 {
            let mut g = vec![
                0.5f32,
                if planted_overflow(t) {
                    f32::INFINITY
                } else {
                    1.0
                },
            ];
            let mut target = CpuGrads::flat(&mut g);
            scaler.unscale(&mut target).unwrap();
            scaler.update(&mut target).unwrap();
        }
    }
    (got, scales)
}

fn auto_expected() -> Vec<DType> {
    timeline(&[
        (519, F16),   // 5 start-up overflows are not enough
        (719, BF16),  // the 10th overflow of 500..518 is counted at 519: hold 200
        (1002, F16),  // back; scale 2 is above the floor, no restart
        (1202, BF16), // 1000 and 1001 overflow: scale 0.5 < 1 at 1002 (collapse)
        (1509, F16),  // back with the scale restarted at 65536
        (1709, BF16), // 10 NaN losses 1500..1509
        (2801, F16),  // an overflow every 50 steps: only 2 per window of 100 ...
        (3000, BF16), // ... but the 17th (at 2800) takes 65536 below 1: collapse at 2801
    ])
}

#[test]
fn auto_falls_back_on_recurring_overflows_and_scale_collapse() {
    let (got, scales) = run_auto(3000, None);
    assert_timeline("auto", &got, &auto_expected());
    assert_eq!(
        scales[719], 2.0,
        "no restart when the scale is above the floor"
    );
    assert_eq!(scales[1002], 0.5, "the collapse that triggered");
    assert_eq!(scales[1202], 65536.0, "restarted at resume_scale on return");
    assert_eq!(scales[2801], 0.5);
}

#[test]
fn policies_resume_from_saved_state_mid_schedule() {
    for at in [519, 1100, 1505, 2400] {
        let (got, _) = run_auto(3000, Some(at));
        assert_timeline(&format!("auto resumed at {at}"), &got, &auto_expected());
    }
    // Policies 1 and 2 saved in the middle of a hold / a window.
    let make1 = || {
        PolicyBuilder::new(PolicyId::TimeLr)
            .start(100)
            .end(2500)
            .hold(50)
            .build()
            .unwrap()
    };
    let make2 = || PolicyBuilder::new(PolicyId::Loss).build().unwrap();
    let sig1 = |t| Signals {
        lr: Some(lr_schedule(t)),
        loss: None,
    };
    let sig2 = |t| Signals {
        lr: None,
        loss: Some(if (2050..2070).contains(&t) {
            9.0
        } else {
            base_loss(t)
        }),
    };
    type Sig = dyn Fn(u64) -> Signals;
    let cases: [(&str, &dyn Fn() -> AmpPolicy, &Sig, u64); 2] = [
        ("policy 1", &make1, &sig1, 1020),
        ("policy 2", &make2, &sig2, 2060),
    ];
    for (name, make, sig, at) in cases {
        let whole = run(&mut make(), 3000, sig);
        let mut p = make();
        let mut got: Vec<DType> = (0..at)
            .map(|t| p.decide(t, sig(t), None).unwrap())
            .collect();
        let saved = p.state_json().unwrap();
        let mut q = make();
        q.load_state_json(&saved).unwrap();
        got.extend((at..3000).map(|t| q.decide(t, sig(t), None).unwrap()));
        assert_timeline(&format!("{name} resumed at {at}"), &got, &whole);
    }
    // State saved with other parameters is refused.
    let saved = make2().state_json().unwrap();
    let mut other = PolicyBuilder::new(PolicyId::Loss)
        .interval(10)
        .interval_hold(5)
        .build()
        .unwrap();
    assert!(matches!(
        other.load_state_json(&saved),
        Err(Error::StateMismatch { .. })
    ));
}

#[test]
fn auto_with_fp32_fallback_and_its_requirements() {
    let mut p = PolicyBuilder::new(PolicyId::Auto)
        .fallback(F32)
        .hold(3)
        .overflow_window(4)
        .max_overflows(2)
        .build()
        .unwrap();
    assert_eq!(p.possible_precisions(), vec![F16, F32]);
    let mut s = GradScaler::new();
    let mut got = Vec::new();
    for t in 0..12 {
        let prec = p.decide(t, Signals::default(), Some(&mut s)).unwrap();
        got.push(prec);
        if prec == F16 {
            let overflow = t == 1 || t == 4;
            let mut g = vec![if overflow { f32::NAN } else { 1.0 }];
            let mut target = CpuGrads::flat(&mut g);
            s.unscale(&mut target).unwrap();
            s.update(&mut target).unwrap();
        }
    }
    // Overflows at 1 and 4 are counted at 2 and 5, both inside the window (1, 5]: fall back at
    // 5 for 3 periods.
    let want = timeline(&[(5, F16), (8, F32), (12, F16)]);
    assert_timeline("auto fp32 fallback", &got, &want);
    assert!(matches!(p.rule(), adaptfp16::Rule::Auto(a) if a.state().mode == AutoMode::Fp16));

    let err = p.decide(12, Signals::default(), None).unwrap_err();
    assert!(
        matches!(
            err,
            Error::MissingSignal {
                policy: PolicyId::Auto,
                ..
            }
        ),
        "{err}"
    );
}

// ---------------------------------------------------------------- API rules

#[test]
fn decisions_are_asked_in_time_order() {
    let mut p = PolicyBuilder::new(PolicyId::Time)
        .start(0)
        .end(5)
        .build()
        .unwrap();
    assert_eq!(p.decide(3, Signals::default(), None).unwrap(), F16);
    assert_eq!(p.decide(3, Signals::default(), None).unwrap(), F16);
    assert_eq!(p.decide(9, Signals::default(), None).unwrap(), F32); // gaps are fine
    assert!(matches!(
        p.decide(4, Signals::default(), None),
        Err(Error::PeriodWentBack { last: 9, got: 4 })
    ));
    // The seed's boolean form.
    let mut p = PolicyBuilder::new(PolicyId::Time).end(20).build().unwrap();
    assert!(!p.enable_mixed_precision(9, None, None, None).unwrap());
    assert!(
        p.enable_mixed_precision(10, Some(0.01), Some(0.1), None)
            .unwrap()
    );
}

#[test]
fn builder_validation() {
    use PolicyId::*;
    let cases: Vec<(PolicyBuilder, &str)> = vec![
        (PolicyBuilder::new(Time), "policy 0 requires end_time"),
        (
            PolicyBuilder::new(TimeLr).start(1).end(5),
            "policy 1 requires hold_time",
        ),
        (
            PolicyBuilder::new(TimeLr).end(5).hold(2),
            "policy 1 requires start_time",
        ),
        (
            PolicyBuilder::new(Time).start(10).end(5),
            "end_time 5 is before start_time 10",
        ),
        (
            PolicyBuilder::new(Time).end(5),
            "end_time 5 is before start_time 10",
        ),
        (
            PolicyBuilder::new(Loss).end(3),
            "end_time 3 is before start_time 10",
        ),
        (
            PolicyBuilder::new(Time).end(50).hold(3),
            "policy 0 does not use hold_time; leave it unset",
        ),
        (
            PolicyBuilder::new(Time).end(50).interval(3),
            "policy 0 does not use interval_time; leave it unset",
        ),
        (
            PolicyBuilder::new(Auto).start(3),
            "policy auto does not use start_time; leave it unset",
        ),
        (
            PolicyBuilder::new(Loss).fallback(F32),
            "policy 2 does not use fallback; leave it unset",
        ),
        (
            PolicyBuilder::new(TimeLr).start(1).end(5).hold(0),
            "hold_time must be at least 1",
        ),
        (
            PolicyBuilder::new(Loss).interval(0),
            "interval_time must be at least 1",
        ),
        (
            PolicyBuilder::new(Loss).interval_hold(0),
            "interval_hold_time must be at least 1",
        ),
        (
            PolicyBuilder::new(Loss).interval(100).interval_hold(101),
            "interval_hold_time 101 is longer than interval_time 100: the loss windows would overlap",
        ),
        (
            PolicyBuilder::new(Time).end(50).mixed(F32),
            "mixed precision must be fp16 or bf16, got fp32",
        ),
        (
            PolicyBuilder::new(Auto).mixed(BF16),
            "policy auto watches the fp16 loss scale, so its mixed precision must be fp16, got bf16",
        ),
        (
            PolicyBuilder::new(Auto).fallback(F16),
            "policy auto falls back to bf16 or fp32, not fp16",
        ),
        (
            PolicyBuilder::new(Auto).overflow_window(5).max_overflows(6),
            "policy auto: max_overflows 6 must be in 1..=window (5)",
        ),
        (
            PolicyBuilder::new(TimeLr)
                .start(1)
                .end(5)
                .hold(2)
                .lr_tolerance(-0.1),
            "lr_tolerance = -0.1 is invalid: it must be finite and >= 0",
        ),
        (
            PolicyBuilder::new(Auto).scale_floor(2.0).resume_scale(1.0),
            "resume_scale = 1 is invalid: it must be finite, > 0 and >= scale_floor",
        ),
    ];
    for (builder, message) in cases {
        let err = builder.clone().build().unwrap_err();
        assert_eq!(err.to_string(), message, "{builder:?}");
    }
    // Optional parameters of policy 2 and auto really are optional; defaults are the seed's.
    let p = PolicyBuilder::new(Loss).build().unwrap();
    match p.rule() {
        adaptfp16::Rule::Loss(l) => {
            assert_eq!(
                (l.start(), l.end(), l.interval(), l.interval_hold()),
                (10, None, 1000, 100)
            )
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(p.possible_precisions(), vec![F32, F16]);
    assert_eq!(PolicyBuilder::accepted(Time), &[Param::Start, Param::End]);
}
