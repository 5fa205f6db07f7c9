//! `tilearn ctr`: prepare synthetic shards and a Criteo TSV with malformed lines, train both
//! models briefly (JSONL log with loss, held-out AUC and samples/s; a saved model), and evaluate
//! the saved model.

mod support;

use std::path::Path;
use std::process::{Command, Output};

fn tilearn(args: &[&str]) -> Output {
    let out = Command::new(support::bin("tilearn", env!("CARGO_BIN_EXE_tilearn")))
        .args(args)
        .output()
        .expect("the tilearn binary runs");
    assert!(
        out.status.success(),
        "tilearn {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

fn json(bytes: &[u8]) -> serde_json::Value {
    serde_json::from_slice(bytes).expect("one JSON object")
}

fn p(path: &Path) -> &str {
    path.to_str().unwrap()
}

#[test]
fn prepare_train_and_eval_on_synthetic_shards() {
    let dir = tempfile::tempdir().unwrap();
    let shards = dir.path().join("shards");
    let run = dir.path().join("run");
    let out = tilearn(&[
        "ctr",
        "prepare",
        "--synthetic",
        "6000",
        "--synthetic-vocab",
        "50",
        "--output",
        p(&shards),
        "--samples-per-shard",
        "2500",
    ]);
    let report = json(&out.stdout);
    assert_eq!(
        (report["samples"].as_u64(), report["shards"].as_u64()),
        (Some(6000), Some(3))
    );
    for model in ["deepfm", "wide-deep"] {
        tilearn(&[
            "ctr",
            "train",
            "--model",
            model,
            "--data",
            p(&shards),
            "--output-dir",
            p(&run),
            "--steps",
            "60",
            "--batch-size",
            "128",
            "--hash-rows",
            "500",
            "--embed-dim",
            "4",
            "--hidden",
            "16,8",
            "--eval-every",
            "30",
        ]);
        let log = std::fs::read_to_string(run.join("train_log.jsonl")).unwrap();
        let lines: Vec<serde_json::Value> = log.lines().map(|l| json(l.as_bytes())).collect();
        assert_eq!(lines.len(), 2, "{log}");
        for line in &lines {
            assert_eq!(line["model"], model);
            assert!(line["loss"].as_f64().unwrap().is_finite());
            assert!(line["samples_per_sec"].as_f64().unwrap() > 0.0);
            assert!(line["eval_auc"].as_f64().unwrap() > 0.55, "{line}");
        }
        let eval =
            json(&tilearn(&["ctr", "eval", "--model-dir", p(&run), "--data", p(&shards)]).stdout);
        assert_eq!(eval["samples"], 6000);
        assert!(eval["auc"].as_f64().unwrap() > 0.55, "{eval}");
    }
}

#[test]
fn prepare_reports_malformed_criteo_lines() {
    let dir = tempfile::tempdir().unwrap();
    let tsv = dir.path().join("day_0.tsv");
    let good = format!("1{}{}", "\t3".repeat(13), "\t68fd1e64".repeat(26));
    let empty = format!("0{}{}", "\t".repeat(13), "\t".repeat(26));
    std::fs::write(
        &tsv,
        format!("{good}\nnot a line\n{empty}\n2{}\n", &good[1..]),
    )
    .unwrap();
    let out = tilearn(&[
        "ctr",
        "prepare",
        "--input",
        p(&tsv),
        "--output",
        p(&dir.path().join("s")),
    ]);
    let report = json(&out.stdout);
    assert_eq!(report["samples"], 2);
    let file = &report["files"][0]["report"];
    assert_eq!(
        (file["lines"].as_u64(), file["malformed"].as_u64()),
        (Some(4), Some(2))
    );
    assert_eq!(file["first_errors"][0][0], 2);
    assert_eq!(file["first_errors"][1][0], 4);
}

#[test]
fn bad_ctr_input_is_a_clear_error() {
    let out = Command::new(support::bin("tilearn", env!("CARGO_BIN_EXE_tilearn")))
        .args([
            "ctr",
            "eval",
            "--model-dir",
            "/nonexistent/ctr-model",
            "--synthetic-samples",
            "10",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("/nonexistent/ctr-model/model.safetensors"),
        "{err}"
    );
}

/// `ctr train` on small synthetic data with `extra` flags, into `out`.
fn small_train(out: &Path, steps: &str, extra: &[&str]) -> Output {
    let mut args = vec![
        "ctr",
        "train",
        "--synthetic-samples",
        "700",
        "--synthetic-vocab",
        "30",
        "--hash-rows",
        "100",
        "--embed-dim",
        "4",
        "--hidden",
        "8",
        "--batch-size",
        "64",
        "--output-dir",
        p(out),
        "--steps",
        steps,
    ];
    args.extend_from_slice(extra);
    Command::new(support::bin("tilearn", env!("CARGO_BIN_EXE_tilearn")))
        .args(&args)
        .output()
        .unwrap()
}

#[test]
fn train_checkpoints_and_resumes_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let (straight, resumed) = (dir.path().join("straight"), dir.path().join("resumed"));
    let ok = |out: Output| assert!(out.status.success(), "{out:?}");
    ok(small_train(
        &straight,
        "16",
        &["--save-steps", "5", "--save-total-limit", "2"],
    ));
    let kept: Vec<bool> = [5, 10, 15]
        .map(|s| straight.join(format!("checkpoint-{s}")).is_dir())
        .into();
    assert_eq!(kept, [false, true, true]);

    ok(small_train(&resumed, "10", &["--save-steps", "10"]));
    let checkpoint = resumed.join("checkpoint-10");
    ok(small_train(
        &resumed,
        "16",
        &["--resume-from-checkpoint", p(&checkpoint)],
    ));
    assert_eq!(
        std::fs::read(straight.join("model.safetensors")).unwrap(),
        std::fs::read(resumed.join("model.safetensors")).unwrap(),
        "16 steps straight and 10 + resume + 6 differ"
    );
    let log = std::fs::read_to_string(resumed.join("train_log.jsonl")).unwrap();
    let steps: Vec<u64> = log
        .lines()
        .map(|l| json(l.as_bytes())["step"].as_u64().unwrap())
        .collect();
    assert_eq!(steps, [10, 16], "{log}");

    // Another model than the checkpoint's: refused, naming the field.
    let out = small_train(
        &dir.path().join("other"),
        "16",
        &[
            "--model",
            "wide-deep",
            "--resume-from-checkpoint",
            p(&checkpoint),
        ],
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("`model`"), "{err}");
}

#[test]
fn bench_reports_throughput_and_auc_and_exports_its_batches() {
    let dir = tempfile::tempdir().unwrap();
    let export = dir.path().join("export");
    let out = tilearn(&[
        "ctr",
        "bench",
        "--device",
        "cpu",
        "--batch-size",
        "256",
        "--steps",
        "12",
        "--warmup",
        "2",
        "--eval-samples",
        "2048",
        "--synthetic-vocab",
        "50",
        "--hash-rows",
        "500",
        "--embed-dim",
        "4",
        "--hidden",
        "16",
        "--export",
        p(&export),
    ]);
    let record = json(&out.stdout);
    assert_eq!(record["impl"], "tilearn");
    assert_eq!(record["device"], "cpu");
    assert_eq!(record["samples"], 12 * 256);
    for field in [
        "samples_per_sec",
        "steady_samples_per_sec",
        "step_ms_median",
    ] {
        assert!(record[field].as_f64().unwrap() > 0.0, "{field}: {record}");
    }
    let (auc, truth) = (
        record["eval_auc"].as_f64().unwrap(),
        record["ground_truth_auc"].as_f64().unwrap(),
    );
    assert!(auc > 0.6 && auc <= truth + 0.02, "{record}");
    // The baseline's inputs: every split's arrays at their sizes, and what it needs to know.
    let meta = json(&std::fs::read(export.join("meta.json")).unwrap());
    assert_eq!(meta["train_samples"], 12 * 256);
    assert_eq!(meta["eval_samples"], 2048);
    assert_eq!(meta["field_rows"].as_array().unwrap().len(), 26);
    for (split, n) in [("train", 12 * 256), ("eval", 2048)] {
        let size = |name: &str| {
            std::fs::metadata(export.join(format!("{split}_{name}")))
                .unwrap()
                .len()
        };
        assert_eq!(size("ids.u32"), n * 26 * 4);
        assert_eq!(size("dense.f32"), n * 13 * 4);
        assert_eq!(size("labels.f32"), n * 4);
    }
    let ids = std::fs::read(export.join("train_ids.u32")).unwrap();
    let ids: Vec<u32> = ids
        .chunks(4)
        .map(|b| u32::from_le_bytes(b.try_into().unwrap()))
        .collect();
    assert!(ids.iter().all(|&id| id < 500 || id == u32::MAX));
    assert!(ids.contains(&u32::MAX), "no empty field among 3072 samples");
}

/// The GPU-only flags of `ctr train` (row cache placement, bf16 MLP) on a CPU run: refused,
/// naming the flag and the fix; `--host-rows` without a budget is a usage error; a bad size is
/// refused with the accepted forms.
#[test]
fn gpu_only_ctr_flags_are_refused_on_the_cpu() {
    let dir = tempfile::tempdir().unwrap();
    let run = |extra: &[&str]| {
        let out_dir = dir.path().join("run");
        let mut args = vec![
            "ctr",
            "train",
            "--device",
            "cpu",
            "--steps",
            "1",
            "--synthetic-samples",
            "64",
            "--output-dir",
            p(&out_dir),
        ];
        args.extend_from_slice(extra);
        let out = Command::new(support::bin("tilearn", env!("CARGO_BIN_EXE_tilearn")))
            .args(&args)
            .output()
            .unwrap();
        assert!(!out.status.success(), "{extra:?} was accepted");
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let err = run(&["--gpu-embedding-budget", "1GiB"]);
    assert!(
        err.contains("--gpu-embedding-budget") && err.contains("--device cuda"),
        "{err}"
    );
    let err = run(&["--precision", "bf16"]);
    assert!(
        err.contains("--precision bf16") && err.contains("--device cuda"),
        "{err}"
    );
    let err = run(&["--host-rows", "auto"]);
    assert!(err.contains("--gpu-embedding-budget"), "{err}");
    let err = run(&["--gpu-embedding-budget", "lots"]);
    assert!(err.contains("2GiB"), "{err}");
}
