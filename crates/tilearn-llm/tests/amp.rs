//! Mixed precision in training, end to end through the CLI: the GradScaler skips an overflowing
//! fp16 step and backs off, policy 0 switches precision at its start, and the auto policy falls
//! back when the loss scale collapses and returns to fp16 after its hold.

mod support;

use std::path::Path;
use std::process::{Command, Output};

fn tilearn(args: &[&str]) -> Output {
    Command::new(support::bin("tilearn", env!("CARGO_BIN_EXE_tilearn")))
        .args(args)
        .output()
        .expect("the tilearn binary runs")
}

fn train(dir: &Path, extra: &[&str]) -> Vec<serde_json::Value> {
    let mut args = vec![
        "train",
        "--output-dir",
        dir.to_str().unwrap(),
        "--per-device-train-batch-size",
        "4",
        "--seq-len",
        "64",
        "--logging-steps",
        "1",
        "--save-steps",
        "0",
        "--device",
        "cpu",
    ];
    args.extend_from_slice(extra);
    let out = tilearn(&args);
    assert!(
        out.status.success(),
        "train failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    std::fs::read_to_string(dir.join("train_log.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

fn precisions(log: &[serde_json::Value]) -> Vec<String> {
    log.iter()
        .map(|r| r["precision"].as_str().unwrap().to_string())
        .collect()
}

/// Every weight of the saved model is finite.
fn assert_finite_weights(dir: &Path) {
    let bytes = std::fs::read(dir.join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    for (name, view) in st.tensors() {
        for c in view.data().chunks_exact(4) {
            let v = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            assert!(v.is_finite(), "{name} holds {v}");
        }
    }
}

#[test]
fn fp16_overflow_skips_the_step_and_backs_off() {
    let dir = tempfile::tempdir().unwrap();
    let log = train(
        dir.path(),
        &["--max-steps", "8", "--fp16", "--debug-inject-overflow", "3"],
    );
    assert_eq!(log.len(), 8);
    assert!(precisions(&log).iter().all(|p| p == "fp16"));
    let scale = |i: usize| log[i]["loss_scale"].as_f64().unwrap();
    let skipped = |i: usize| log[i]["skipped_steps"].as_u64().unwrap();
    // torch's GradScaler: init 65536, backoff 0.5 on an overflow, growth only after 2000 clean steps.
    assert_eq!((scale(1), skipped(1)), (65536.0, 0));
    assert_eq!((scale(2), skipped(2)), (32768.0, 1), "step 3 overflowed");
    for i in 3..8 {
        assert_eq!((scale(i), skipped(i)), (32768.0, 0), "step {}", i + 1);
    }
    let last = log[7]["loss"].as_f64().unwrap();
    assert!(last.is_finite() && last < log[0]["loss"].as_f64().unwrap());
    assert_finite_weights(dir.path());
}

#[test]
fn policy_0_is_fp32_before_start_and_mixed_after() {
    let dir = tempfile::tempdir().unwrap();
    let log = train(
        dir.path(),
        &[
            "--max-steps",
            "8",
            "--amp-policy",
            "0",
            "--amp-start",
            "3",
            "--amp-end",
            "5",
            "--bf16",
        ],
    );
    // Periods are 0-based steps: periods 3..=5 are logged steps 4..=6.
    let expected = [
        "fp32", "fp32", "fp32", "bf16", "bf16", "bf16", "fp32", "fp32",
    ];
    assert_eq!(precisions(&log), expected);
    assert_finite_weights(dir.path());
}

#[test]
fn auto_policy_falls_back_on_recurring_overflows_and_returns() {
    let dir = tempfile::tempdir().unwrap();
    // Overflows at steps 2..=19 (only fp16 steps can overflow): auto's default rule (10
    // overflows within 100 steps) sends it to the bf16 fallback for --amp-hold 5 steps.
    let overflow: Vec<String> = (2..=19).map(|s| s.to_string()).collect();
    let overflow = overflow.join(",");
    let log = train(
        dir.path(),
        &[
            "--max-steps",
            "40",
            "--amp-policy",
            "auto",
            "--amp-hold",
            "5",
            "--amp-fallback",
            "bf16",
            "--debug-inject-overflow",
            &overflow,
        ],
    );
    let p = precisions(&log);
    let first_fallback = p
        .iter()
        .position(|x| x == "bf16")
        .expect("auto fell back to bf16");
    let back = p[first_fallback..]
        .iter()
        .position(|x| x == "fp16")
        .map(|i| i + first_fallback)
        .expect("auto returned to fp16 after its hold");
    assert!(p[..first_fallback].iter().all(|x| x == "fp16"));
    assert_eq!(
        back - first_fallback,
        5,
        "held the fallback for 5 steps: {p:?}"
    );
    // After the last injected overflow (step 19) fp16 steps run clean with a usable scale.
    assert!(
        log[19..]
            .iter()
            .all(|r| r["skipped_steps"] == 0 && r["precision"] == "fp16")
    );
    let scale_after = log.last().unwrap()["loss_scale"].as_f64().unwrap();
    assert!(scale_after >= 1.0, "scale after recovery {scale_after}");
    let last = log.last().unwrap()["loss"].as_f64().unwrap();
    assert!(
        last < log[0]["loss"].as_f64().unwrap(),
        "did not learn: {p:?}"
    );
    assert_finite_weights(dir.path());
}

#[test]
fn contradictory_precision_flags_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().to_str().unwrap();
    for (flags, needle) in [
        (vec!["--fp16", "--bf16"], "mutually exclusive"),
        (
            vec!["--amp-policy", "1", "--amp-start", "1", "--amp-end", "9"],
            "--amp-hold",
        ),
        (
            vec!["--amp-policy", "0", "--amp-start", "9", "--amp-end", "2"],
            "--amp-end",
        ),
    ] {
        let mut args = vec!["train", "--output-dir", d, "--max-steps", "1"];
        args.extend(flags);
        let out = tilearn(&args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{err}");
        assert!(err.contains(needle), "{err}");
        assert!(!err.contains("panicked"), "{err}");
    }
}
