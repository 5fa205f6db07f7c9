//! GradScaler semantics beyond the PyTorch trajectory: defaults, the exact growth boundary, the
//! step state machine and its misuse errors, the one-read-per-step found_inf contract, the
//! fused-optimizer path, disabled scalers, and state dict validation.

use adaptfp16::{
    BackendError, CpuGrads, Error, GradScaler, ScalerConfig, ScalerState, UnscaleTarget,
    unscale_and_check_slice,
};

/// A fake device backend: counts host reads of the flag, can fail on demand.
#[derive(Default)]
struct CountingTarget {
    grads: Vec<f32>,
    found: bool,
    passes: usize,
    host_reads: usize,
    fail: bool,
}

impl UnscaleTarget for CountingTarget {
    fn unscale_and_check(&mut self, inv_scale: f32) -> Result<(), BackendError> {
        if self.fail {
            return Err("launch failed: out of memory".into());
        }
        self.passes += 1;
        self.found = unscale_and_check_slice(&mut self.grads, inv_scale);
        Ok(())
    }
    fn found_inf(&mut self) -> Result<bool, BackendError> {
        self.host_reads += 1;
        Ok(self.found)
    }
}

fn clean_step(s: &mut GradScaler) -> adaptfp16::StepOutcome {
    let mut g = vec![1.0f32, -2.0, 3.5];
    let mut t = CpuGrads::flat(&mut g);
    s.unscale(&mut t).unwrap();
    s.update(&mut t).unwrap()
}

fn inf_step(s: &mut GradScaler) -> adaptfp16::StepOutcome {
    let mut g = vec![1.0f32, f32::INFINITY, 3.5];
    let mut t = CpuGrads::flat(&mut g);
    s.unscale(&mut t).unwrap();
    s.update(&mut t).unwrap()
}

#[test]
fn defaults_are_torchs() {
    let s = GradScaler::new();
    let c = s.config();
    assert_eq!(
        (
            c.init_scale,
            c.growth_factor,
            c.backoff_factor,
            c.growth_interval,
            c.enabled
        ),
        (65536.0, 2.0, 0.5, 2000, true)
    );
    assert_eq!(s.get_scale(), 65536.0);
    assert_eq!(s.inv_scale(), 1.0 / 65536.0);
    assert_eq!(s.scale(0.75), 0.75 * 65536.0);
    assert_eq!(s.growth_tracker(), 0);
}

#[test]
fn grows_after_exactly_growth_interval_clean_steps() {
    let mut s = GradScaler::new();
    for i in 1..2000 {
        let o = clean_step(&mut s);
        assert_eq!(o.scale_after, 65536.0, "step {i}");
        assert_eq!(o.growth_tracker, i);
    }
    let o = clean_step(&mut s);
    assert_eq!(
        (o.scale_before, o.scale_after, o.growth_tracker),
        (65536.0, 131072.0, 0)
    );
    assert_eq!((s.update_count(), s.overflow_count()), (2000, 0));
}

#[test]
fn overflow_backs_off_and_resets_tracker() {
    let mut s = GradScaler::new();
    for _ in 0..5 {
        clean_step(&mut s);
    }
    assert_eq!(s.growth_tracker(), 5);
    let o = inf_step(&mut s);
    assert!(o.found_inf && o.skipped());
    assert_eq!((o.scale_after, o.growth_tracker), (32768.0, 0));
    assert_eq!(s.overflow_count(), 1);
}

#[test]
fn unscale_multiplies_by_the_rounded_f64_reciprocal() {
    let mut s = GradScaler::with_config(ScalerConfig {
        init_scale: 3.0,
        ..ScalerConfig::default()
    })
    .unwrap();
    let inv = (1.0f64 / 3.0) as f32;
    assert_eq!(s.inv_scale(), inv);
    let mut g = vec![3.0f32, 1e-38, -7.25, 0.0];
    let want: Vec<f32> = g.iter().map(|&x| x * inv).collect();
    let mut t = CpuGrads::flat(&mut g);
    s.unscale(&mut t).unwrap();
    assert!(!s.should_skip_step(&mut t).unwrap());
    drop(t);
    assert_eq!(g, want);
    assert!(
        g[1] != 0.0 && g[1].is_subnormal(),
        "subnormal kept: {:e}",
        g[1]
    );
}

#[test]
fn slice_pass_checks_inputs_not_products() {
    // A finite input whose product overflows is not flagged (torch checks the input).
    let mut g = vec![3.0e38f32, 1.0];
    assert!(!unscale_and_check_slice(&mut g, 4.0));
    assert_eq!(g[0], f32::INFINITY);
    // Every element is still multiplied when a non-finite one is present.
    let mut g = vec![2.0f32, f32::NAN, -f32::INFINITY, 8.0];
    assert!(unscale_and_check_slice(&mut g, 0.5));
    assert_eq!((g[0], g[3]), (1.0, 4.0));
    assert!(g[1].is_nan() && g[2] == f32::NEG_INFINITY);
    // inv_scale 1: a pure check, values untouched bit for bit.
    let mut g = vec![-0.0f32, 1.5, f32::INFINITY];
    assert!(unscale_and_check_slice(&mut g, 1.0));
    assert_eq!(g[0].to_bits(), (-0.0f32).to_bits());
}

#[test]
fn cpu_grads_flag_covers_all_tensors_and_resets_each_step() {
    let mut a = vec![1.0f32; 5];
    let mut b = vec![1.0f32, f32::NAN];
    let mut t = CpuGrads::new(vec![&mut a, &mut b]);
    t.unscale_and_check(0.5).unwrap();
    assert!(t.found_inf().unwrap());
    assert_eq!(t.tensors().len(), 2);
    drop(t);
    assert_eq!(a, vec![0.5; 5]);
    let mut c = vec![4.0f32];
    let mut t = CpuGrads::flat(&mut c);
    t.unscale_and_check(0.25).unwrap();
    assert!(!t.found_inf().unwrap());
}

#[test]
fn host_reads_found_inf_once_per_step() {
    let mut s = GradScaler::new();
    // CPU path: should_skip_step and update share one read.
    let mut t = CountingTarget {
        grads: vec![1.0, f32::NAN],
        ..Default::default()
    };
    s.unscale(&mut t).unwrap();
    assert!(s.should_skip_step(&mut t).unwrap());
    assert!(s.should_skip_step(&mut t).unwrap());
    let o = s.update(&mut t).unwrap();
    assert!(o.found_inf);
    assert_eq!((t.passes, t.host_reads), (1, 1));
    // GPU path: no should_skip_step; the only read is in update.
    let mut t = CountingTarget {
        grads: vec![1.0, 2.0],
        ..Default::default()
    };
    s.unscale(&mut t).unwrap();
    assert_eq!(
        t.host_reads, 0,
        "unscale must not read the flag to the host"
    );
    assert!(!s.update(&mut t).unwrap().found_inf);
    assert_eq!((t.passes, t.host_reads), (1, 1));
}

#[test]
fn step_state_machine_rejects_misuse() {
    let mut s = GradScaler::new();
    let mut g = vec![1.0f32];
    let mut t = CpuGrads::flat(&mut g);
    assert!(matches!(s.update(&mut t), Err(Error::NoInfCheck)));
    assert!(matches!(
        s.update_with_found_inf(false),
        Err(Error::NoInfCheck)
    ));
    s.unscale(&mut t).unwrap();
    assert!(matches!(s.unscale(&mut t), Err(Error::AlreadyUnscaled)));
    assert!(matches!(
        s.check_for_fused_step(&mut t),
        Err(Error::AlreadyUnscaled)
    ));
    s.update(&mut t).unwrap();
    // The next step may unscale again.
    s.unscale(&mut t).unwrap();
    drop(t);
    assert_eq!(g[0], 1.0 / 65536.0 / 65536.0);
}

#[test]
fn should_skip_step_unscales_when_not_yet_done() {
    let mut s = GradScaler::new();
    let mut g = vec![65536.0f32];
    let mut t = CpuGrads::flat(&mut g);
    assert!(!s.should_skip_step(&mut t).unwrap());
    s.update(&mut t).unwrap();
    drop(t);
    assert_eq!(g[0], 1.0);
}

#[test]
fn fused_path_checks_without_touching_grads() {
    let mut s = GradScaler::new();
    let mut t = CountingTarget {
        grads: vec![65536.0, f32::INFINITY],
        ..Default::default()
    };
    let inv = s.check_for_fused_step(&mut t).unwrap();
    assert_eq!(inv, 1.0 / 65536.0);
    assert_eq!(t.grads[0], 65536.0, "the check-only pass must not scale");
    let o = s.update(&mut t).unwrap();
    assert!(o.found_inf);
    assert_eq!(o.scale_after, 32768.0);
}

#[test]
fn update_with_combined_flag() {
    // Rank 0 saw no inf, another rank did: the all-reduced flag decides.
    let mut s = GradScaler::new();
    let mut g = vec![1.0f32];
    s.unscale(&mut CpuGrads::flat(&mut g)).unwrap();
    let o = s.update_with_found_inf(true).unwrap();
    assert_eq!((o.found_inf, o.scale_after), (true, 32768.0));
}

#[test]
fn backend_errors_propagate() {
    let mut s = GradScaler::new();
    let mut t = CountingTarget {
        fail: true,
        ..Default::default()
    };
    let e = s.unscale(&mut t).unwrap_err();
    assert!(matches!(e, Error::Backend(_)));
    assert!(e.to_string().contains("out of memory"), "{e}");
    // A failed pass did not arm the step.
    assert!(matches!(s.update(&mut t), Err(Error::NoInfCheck)));
}

#[test]
fn disabled_scaler_is_the_identity() {
    let mut s = GradScaler::disabled();
    assert!(!s.is_enabled());
    assert_eq!(
        (s.get_scale(), s.inv_scale(), s.scale(2.5)),
        (1.0, 1.0, 2.5)
    );
    let mut g = vec![3.0f32, f32::INFINITY];
    let mut t = CpuGrads::flat(&mut g);
    s.unscale(&mut t).unwrap();
    s.unscale(&mut t).unwrap(); // no state machine when disabled
    assert!(!s.should_skip_step(&mut t).unwrap());
    let o = s.update(&mut t).unwrap();
    assert_eq!((o.found_inf, o.scale_after), (false, 1.0));
    drop(t);
    assert_eq!(g[0], 3.0);
    assert_eq!(s.state_dict(), None);
    assert_eq!(s.state_dict_json().to_string(), "{}");
    // Loading into a disabled scaler is a no-op, like torch.
    s.load_state_dict_json(&serde_json::json!({})).unwrap();
}

#[test]
fn config_validation() {
    let bad = [
        (
            ScalerConfig {
                growth_factor: 1.0,
                ..Default::default()
            },
            "growth_factor",
        ),
        (
            ScalerConfig {
                growth_factor: f64::NAN,
                ..Default::default()
            },
            "growth_factor",
        ),
        (
            ScalerConfig {
                backoff_factor: 1.0,
                ..Default::default()
            },
            "backoff_factor",
        ),
        (
            ScalerConfig {
                backoff_factor: 0.0,
                ..Default::default()
            },
            "backoff_factor",
        ),
        (
            ScalerConfig {
                growth_interval: 0,
                ..Default::default()
            },
            "growth_interval",
        ),
        (
            ScalerConfig {
                init_scale: 0.0,
                ..Default::default()
            },
            "init_scale",
        ),
        (
            ScalerConfig {
                init_scale: 1e39,
                ..Default::default()
            },
            "init_scale",
        ),
    ];
    for (config, field) in bad {
        match GradScaler::with_config(config) {
            Err(Error::InvalidScalerConfig { field: f, .. }) => assert_eq!(f, field),
            other => panic!("{config:?}: {other:?}"),
        }
    }
    // A disabled scaler does not care about its factors (torch only checks when enabled).
    let off = ScalerConfig {
        growth_factor: 0.5,
        enabled: false,
        ..Default::default()
    };
    assert!(GradScaler::with_config(off).is_ok());
}

#[test]
fn state_dict_uses_torchs_keys_and_round_trips() {
    let mut s = GradScaler::with_config(ScalerConfig {
        growth_interval: 7,
        ..Default::default()
    })
    .unwrap();
    inf_step(&mut s);
    clean_step(&mut s);
    clean_step(&mut s);
    let json = s.state_dict_json();
    let mut keys: Vec<&String> = json.as_object().unwrap().keys().collect();
    keys.sort();
    assert_eq!(
        keys,
        [
            "_growth_tracker",
            "_overflow_count",
            "_update_count",
            "backoff_factor",
            "growth_factor",
            "growth_interval",
            "scale"
        ]
    );
    assert_eq!(
        (
            json["_update_count"].as_u64(),
            json["_overflow_count"].as_u64()
        ),
        (Some(3), Some(1))
    );
    assert_eq!(json["scale"], 32768.0);
    assert_eq!(json["_growth_tracker"], 2);

    let mut r = GradScaler::new();
    r.load_state_dict_json(&json).unwrap();
    assert_eq!(r.state_dict(), s.state_dict());
    assert_eq!((r.update_count(), r.overflow_count()), (3, 1));
    // torch's own dict (no counters of ours) loads, with the counters at 0.
    let mut torch_dict = json.clone();
    let m = torch_dict.as_object_mut().unwrap();
    m.remove("_update_count");
    m.remove("_overflow_count");
    let mut t = GradScaler::new();
    t.load_state_dict_json(&torch_dict).unwrap();
    assert_eq!(
        (t.get_scale(), t.growth_tracker(), t.overflow_count()),
        (32768.0, 2, 0)
    );
    // Both continue identically: 5 more clean steps reach the interval of 7.
    for _ in 0..5 {
        assert_eq!(clean_step(&mut r), clean_step(&mut s));
    }
    assert_eq!(r.get_scale(), 65536.0);
}

#[test]
fn state_dict_validation() {
    let good = ScalerState {
        scale: 1024.0,
        growth_factor: 2.0,
        backoff_factor: 0.5,
        growth_interval: 10,
        growth_tracker: 3,
        update_count: 40,
        overflow_count: 4,
    };
    let mut s = GradScaler::new();
    s.load_state_dict(&good).unwrap();
    for bad in [
        ScalerState {
            growth_tracker: 10,
            ..good
        },
        ScalerState {
            growth_tracker: -1,
            ..good
        },
        ScalerState {
            scale: f64::INFINITY,
            ..good
        },
        ScalerState {
            scale: -1.0,
            ..good
        },
        ScalerState {
            backoff_factor: 2.0,
            ..good
        },
    ] {
        assert!(
            matches!(s.load_state_dict(&bad), Err(Error::InvalidStateDict(_))),
            "{bad:?}"
        );
    }
    assert!(matches!(
        s.load_state_dict_json(&serde_json::json!({})),
        Err(Error::EmptyStateDict)
    ));
    let extra = serde_json::json!({"scale": 1.0, "growth_factor": 2.0, "backoff_factor": 0.5,
        "growth_interval": 5, "_growth_tracker": 0, "unexpected": 1});
    assert!(matches!(
        s.load_state_dict_json(&extra),
        Err(Error::InvalidStateDict(_))
    ));
    // A failed load leaves the scaler as it was.
    assert_eq!(s.state_dict(), Some(good));
}

#[test]
fn restart_at_starts_a_fresh_phase() {
    let mut s = GradScaler::new();
    clean_step(&mut s);
    inf_step(&mut s);
    clean_step(&mut s);
    s.restart_at(4096.0).unwrap();
    assert_eq!((s.get_scale(), s.growth_tracker()), (4096.0, 0));
    for bad in [0.0, -1.0, f32::NAN, f32::INFINITY] {
        assert!(s.restart_at(bad).is_err(), "{bad}");
    }
}
