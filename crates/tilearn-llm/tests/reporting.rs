//! What a run leaves to look at: TensorBoard event files (`--report-to tensorboard`) and the
//! loss plot (`loss.png`, `tilearn plot`).

mod support;

use std::collections::BTreeMap;
use std::path::Path;
use std::process::{Command, Output};

use tilearn_llm::engine::trainer::tensorboard::{event_files, read_scalars};

fn tilearn(args: &[&str]) -> Output {
    Command::new(support::bin("tilearn", env!("CARGO_BIN_EXE_tilearn")))
        .args(args)
        .output()
        .expect("the tilearn binary runs")
}

fn path_str(p: &Path) -> &str {
    p.to_str().expect("temp paths are UTF-8")
}

/// A 3-step CPU run of the embedded model, evaluating 1 batch of held-out windows at steps 2
/// and 3, with `extra` flags.
fn short_run(out_dir: &Path, extra: &[&str]) -> Output {
    let mut args = vec![
        "train",
        "--output-dir",
        path_str(out_dir),
        "--max-steps",
        "3",
        "--per-device-train-batch-size",
        "4",
        "--seq-len",
        "64",
        "--logging-steps",
        "1",
        "--validation-split-percentage",
        "5",
        "--max-eval-batches",
        "1",
        "--eval-steps",
        "2",
        "--save-strategy",
        "no",
        "--device",
        "cpu",
    ];
    args.extend_from_slice(extra);
    tilearn(&args)
}

/// tag → the steps it was written at.
fn tags_and_steps(events: &Path) -> BTreeMap<String, Vec<u64>> {
    let mut tags: BTreeMap<String, Vec<u64>> = BTreeMap::new();
    for s in read_scalars(events).unwrap() {
        assert!(s.value.is_finite(), "{s:?}");
        tags.entry(s.tag).or_default().push(s.step);
    }
    tags
}

#[test]
fn report_to_tensorboard_writes_the_trainer_tags_and_the_run_ends_with_a_plot() {
    let dir = tempfile::tempdir().unwrap();
    let out_dir = dir.path().join("run");
    let out = short_run(&out_dir, &["--report-to", "tensorboard"]);
    let stdout = support::ok(out);

    // Hugging Face's default: OUTPUT_DIR/runs/<time>_<host>/events.out.tfevents.*
    let runs: Vec<_> = std::fs::read_dir(out_dir.join("runs"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert_eq!(runs.len(), 1, "{runs:?}");
    let files = event_files(&runs[0]).unwrap();
    assert_eq!(files.len(), 1, "{files:?}");
    assert!(
        stdout.contains(path_str(&files[0])),
        "the path is printed: {stdout}"
    );

    let tags = tags_and_steps(&files[0]);
    for tag in [
        "train/loss",
        "train/learning_rate",
        "train/grad_norm",
        "train/tokens_per_second",
        "train/precision",
        "train/epoch",
    ] {
        assert_eq!(tags.get(tag), Some(&vec![1, 2, 3]), "{tag}: {tags:?}");
    }
    for tag in ["eval/loss", "eval/perplexity"] {
        assert_eq!(tags.get(tag), Some(&vec![2, 3]), "{tag}: {tags:?}");
    }
    assert!(!tags.contains_key("train/loss_scale"), "fp32 has no scaler");
    let precision: Vec<f32> = read_scalars(&files[0])
        .unwrap()
        .into_iter()
        .filter(|s| s.tag == "train/precision")
        .map(|s| s.value)
        .collect();
    assert_eq!(precision, [24.0; 3], "fp32: 24 significand bits");

    // The plot at the end of the run, and `tilearn plot` redrawing it elsewhere.
    assert!(out_dir.join("loss.png").is_file(), "{stdout}");
    let redrawn = dir.path().join("again.png");
    let stdout = support::ok(tilearn(&[
        "plot",
        path_str(&out_dir),
        "--output",
        path_str(&redrawn),
    ]));
    assert!(
        stdout.contains("3 training and 2 evaluation points"),
        "{stdout}"
    );
    assert_eq!(
        std::fs::read(&redrawn).unwrap(),
        std::fs::read(out_dir.join("loss.png")).unwrap(),
        "the same log draws the same picture"
    );
}

#[test]
fn logging_dir_is_where_events_go_and_needs_report_to() {
    let dir = tempfile::tempdir().unwrap();
    let out_dir = dir.path().join("run");
    let logs = dir.path().join("tb");
    let out = short_run(&out_dir, &["--logging-dir", path_str(&logs)]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--logging-dir") && err.contains("--report-to tensorboard"),
        "{err}"
    );

    let out = short_run(
        &out_dir,
        &[
            "--logging-dir",
            path_str(&logs),
            "--report-to",
            "tensorboard",
        ],
    );
    support::ok(out);
    assert_eq!(event_files(&logs).unwrap().len(), 1);
    assert!(!out_dir.join("runs").exists());
}

#[test]
fn plot_of_a_directory_without_a_log_names_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let out = tilearn(&["plot", path_str(dir.path())]);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.starts_with("error: ") && err.contains("train_log.jsonl"),
        "{err}"
    );
}
