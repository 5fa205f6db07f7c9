//! `tilearn train` precision flags → AmpPlan, and the exact messages of invalid combinations.

use adaptfp16::cli::{AmpArgs, plan_from_args};
use adaptfp16::{AmpPlan, DType, PolicyId, Rule, TimeUnit};

fn err(args: AmpArgs) -> String {
    match plan_from_args(&args) {
        Ok(plan) => panic!("{args:?} was accepted: {plan:?}"),
        Err(e) => e.to_string(),
    }
}

fn policy(id: &str) -> Option<PolicyId> {
    Some(id.parse().unwrap())
}

#[test]
fn fixed_precisions() {
    let plan = |a: AmpArgs| plan_from_args(&a).unwrap();
    assert_eq!(plan(AmpArgs::default()), AmpPlan::Fixed(DType::F32));
    assert_eq!(
        plan(AmpArgs {
            fp32: true,
            ..Default::default()
        }),
        AmpPlan::Fixed(DType::F32)
    );
    assert_eq!(
        plan(AmpArgs {
            bf16: true,
            ..Default::default()
        }),
        AmpPlan::Fixed(DType::BF16)
    );
    let fp16 = plan(AmpArgs {
        fp16: true,
        ..Default::default()
    });
    assert_eq!(fp16, AmpPlan::Fixed(DType::F16));
    assert!(fp16.needs_scaler() && fp16.new_scaler().is_enabled());
    assert!(
        !plan(AmpArgs {
            bf16: true,
            ..Default::default()
        })
        .new_scaler()
        .is_enabled()
    );
}

#[test]
fn policies_from_flags() {
    let p = plan_from_args(&AmpArgs {
        policy: policy("1"),
        bf16: true,
        start: Some(5),
        end: Some(90),
        hold: Some(7),
        unit: Some("epoch".parse().unwrap()),
        ..Default::default()
    })
    .unwrap();
    let AmpPlan::Adaptive(p) = p else {
        panic!("{p:?}")
    };
    assert_eq!(
        (p.id(), p.mixed(), p.unit()),
        (PolicyId::TimeLr, DType::BF16, TimeUnit::Epoch)
    );
    match p.rule() {
        Rule::TimeLr(r) => assert_eq!((r.window().start(), r.window().end(), r.hold()), (5, 90, 7)),
        other => panic!("{other:?}"),
    }

    // A policy without --fp16/--bf16 mixes in fp16, counts steps.
    let p = plan_from_args(&AmpArgs {
        policy: policy("0"),
        end: Some(100),
        ..Default::default()
    })
    .unwrap();
    assert_eq!(p.possible_precisions(), vec![DType::F32, DType::F16]);
    assert_eq!(p.unit(), TimeUnit::Step);
    assert!(p.needs_scaler());

    let p = plan_from_args(&AmpArgs {
        policy: policy("2"),
        interval: Some(200),
        interval_hold: Some(20),
        ..Default::default()
    })
    .unwrap();
    let AmpPlan::Adaptive(p) = p else { panic!() };
    assert!(matches!(p.rule(), Rule::Loss(l) if l.interval() == 200 && l.interval_hold() == 20));

    let p = plan_from_args(&AmpArgs {
        policy: policy("auto"),
        fp16: true,
        hold: Some(50),
        fallback: Some(DType::F32),
        ..Default::default()
    })
    .unwrap();
    assert_eq!(p.possible_precisions(), vec![DType::F16, DType::F32]);
}

#[test]
fn invalid_combinations_name_the_flags() {
    let d = AmpArgs::default;
    let cases = [
        (
            AmpArgs {
                fp16: true,
                bf16: true,
                ..d()
            },
            "--fp16 and --bf16 are mutually exclusive",
        ),
        (
            AmpArgs {
                bf16: true,
                fp32: true,
                ..d()
            },
            "--bf16 and --fp32 are mutually exclusive",
        ),
        (
            AmpArgs {
                fp16: true,
                fp32: true,
                ..d()
            },
            "--fp16 and --fp32 are mutually exclusive",
        ),
        (
            AmpArgs {
                policy: policy("1"),
                start: Some(1),
                end: Some(9),
                ..d()
            },
            "--amp-policy 1 requires --amp-hold",
        ),
        (
            AmpArgs {
                policy: policy("0"),
                ..d()
            },
            "--amp-policy 0 requires --amp-end",
        ),
        (
            AmpArgs {
                policy: policy("1"),
                end: Some(9),
                hold: Some(2),
                ..d()
            },
            "--amp-policy 1 requires --amp-start",
        ),
        (
            AmpArgs {
                policy: policy("0"),
                start: Some(10),
                end: Some(5),
                ..d()
            },
            "--amp-end 5 is before --amp-start 10",
        ),
        (
            AmpArgs {
                policy: policy("0"),
                end: Some(5),
                ..d()
            },
            "--amp-end 5 is before the default --amp-start 10",
        ),
        (
            AmpArgs {
                start: Some(3),
                ..d()
            },
            "--amp-start requires --amp-policy",
        ),
        (
            AmpArgs {
                unit: Some(TimeUnit::Epoch),
                fp16: true,
                ..d()
            },
            "--amp-unit requires --amp-policy",
        ),
        (
            AmpArgs {
                policy: policy("0"),
                end: Some(50),
                interval: Some(5),
                ..d()
            },
            "--amp-interval does not apply to --amp-policy 0",
        ),
        (
            AmpArgs {
                policy: policy("0"),
                end: Some(50),
                hold: Some(5),
                ..d()
            },
            "--amp-hold does not apply to --amp-policy 0",
        ),
        (
            AmpArgs {
                policy: policy("2"),
                fallback: Some(DType::F32),
                ..d()
            },
            "--amp-fallback does not apply to --amp-policy 2",
        ),
        (
            AmpArgs {
                policy: policy("auto"),
                end: Some(5),
                ..d()
            },
            "--amp-end does not apply to --amp-policy auto",
        ),
        (
            AmpArgs {
                policy: policy("1"),
                start: Some(1),
                end: Some(9),
                hold: Some(0),
                ..d()
            },
            "--amp-hold must be at least 1",
        ),
        (
            AmpArgs {
                policy: policy("2"),
                interval: Some(100),
                interval_hold: Some(150),
                ..d()
            },
            "--amp-interval-hold 150 is longer than --amp-interval 100",
        ),
        (
            AmpArgs {
                policy: policy("auto"),
                fallback: Some(DType::F16),
                ..d()
            },
            "--amp-fallback must be bf16 or fp32, not fp16",
        ),
        (
            AmpArgs {
                policy: policy("auto"),
                bf16: true,
                ..d()
            },
            "--amp-policy auto watches the fp16 loss scale: use it with --fp16 (default), not --bf16",
        ),
    ];
    for (args, message) in cases {
        assert_eq!(err(args.clone()), message, "{args:?}");
    }
    let e = err(AmpArgs {
        policy: policy("0"),
        fp32: true,
        end: Some(9),
        ..d()
    });
    assert!(
        e.starts_with("--amp-policy switches between fp32 and mixed precision"),
        "{e}"
    );
}

#[test]
fn flag_values_parse_with_clear_errors() {
    assert_eq!("auto".parse::<PolicyId>().unwrap(), PolicyId::Auto);
    assert_eq!("2".parse::<PolicyId>().unwrap(), PolicyId::Loss);
    assert_eq!(
        "3".parse::<PolicyId>().unwrap_err().to_string(),
        "mixed-precision policy `3` is not one of: 0 (time), 1 (time + learning rate), 2 (loss), auto"
    );
    assert_eq!(
        "epochs".parse::<TimeUnit>().unwrap_err().to_string(),
        "unit `epochs` is not one of: step, epoch"
    );
    assert_eq!("bf16".parse::<DType>().unwrap(), DType::BF16);
    assert!("half".parse::<DType>().is_err());
}
