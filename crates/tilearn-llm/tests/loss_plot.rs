//! The loss plot: a PNG of the expected size that shows the training loss, the evaluation loss
//! only where the log has some, and clear errors for a missing or empty log.

use std::path::Path;

use tilearn_llm::loss_plot::{PLOT_SIZE, plot_run};

/// A log of `steps` training records and, with `eval`, an eval record every 5 steps.
fn write_log(dir: &Path, steps: u64, eval: bool) {
    let mut text = String::new();
    for step in 1..=steps {
        let loss = 5.5 * (-(step as f64) / 30.0).exp() + 1.0;
        let lr = 3e-3 * (step as f64 / steps as f64);
        text.push_str(&format!(
            r#"{{"step":{step},"epoch":0.1,"loss":{loss},"lr":{lr},"grad_norm":1.0,"tokens_per_sec":900.0,"precision":"fp32","loss_scale":1.0,"skipped_steps":0,"world_size":1}}"#
        ));
        text.push('\n');
        if eval && step % 5 == 0 {
            text.push_str(&format!(
                r#"{{"step":{step},"epoch":0.1,"eval_loss":{},"eval_perplexity":9.0,"eval_tokens":100,"precision":"fp32"}}"#,
                loss + 0.2
            ));
            text.push('\n');
        }
    }
    std::fs::write(dir.join("train_log.jsonl"), text).unwrap();
}

/// The decoded RGB pixels of a PNG, checking its size.
fn pixels(path: &Path) -> Vec<[u8; 3]> {
    let decoder = png::Decoder::new(std::fs::File::open(path).unwrap());
    let mut reader = decoder.read_info().unwrap();
    let mut buf = vec![0; reader.output_buffer_size()];
    let info = reader.next_frame(&mut buf).unwrap();
    assert_eq!((info.width, info.height), PLOT_SIZE);
    assert_eq!(info.color_type, png::ColorType::Rgb, "plotters writes RGB");
    buf[..info.buffer_size()]
        .chunks_exact(3)
        .map(|p| [p[0], p[1], p[2]])
        .collect()
}

fn count(pixels: &[[u8; 3]], color: [u8; 3]) -> usize {
    pixels.iter().filter(|&&p| p == color).count()
}

// The series' colors in loss_plot.rs.
const TRAIN: [u8; 3] = [31, 119, 180];
const EVAL: [u8; 3] = [214, 39, 40];
const LR: [u8; 3] = [44, 160, 44];

#[test]
fn plot_shows_training_and_eval_loss_and_the_learning_rate() {
    let dir = tempfile::tempdir().unwrap();
    write_log(dir.path(), 60, true);
    let out = dir.path().join("plot.png");
    let summary = plot_run(dir.path(), &out).unwrap();
    assert_eq!((summary.train_points, summary.eval_points), (60, 12));
    let px = pixels(&out);
    let white = count(&px, [255, 255, 255]);
    assert!(white > px.len() / 2, "mostly white background");
    assert!(white < px.len(), "not blank");
    // Each line is hundreds of pixels long (the legend adds a few of each).
    assert!(count(&px, TRAIN) > 300, "training loss line");
    assert!(count(&px, EVAL) > 100, "evaluation loss line");
    assert!(count(&px, LR) > 300, "learning rate line");
}

#[test]
fn a_log_without_eval_records_plots_only_the_training_loss() {
    let dir = tempfile::tempdir().unwrap();
    write_log(dir.path(), 1, false);
    let out = dir.path().join("plot.png");
    let summary = plot_run(dir.path(), &out).unwrap();
    assert_eq!((summary.train_points, summary.eval_points), (1, 0));
    let px = pixels(&out);
    assert!(
        count(&px, TRAIN) > 0,
        "the one training point shows in the legend"
    );
    assert_eq!(count(&px, EVAL), 0, "no eval series, no eval legend");
}

#[test]
fn missing_and_empty_logs_are_named() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("plot.png");
    let err = plot_run(dir.path(), &out).unwrap_err().to_string();
    assert!(
        err.contains("train_log.jsonl") && err.contains("--output-dir"),
        "{err}"
    );

    std::fs::write(dir.path().join("train_log.jsonl"), "").unwrap();
    let err = plot_run(dir.path(), &out).unwrap_err().to_string();
    assert!(
        err.contains("train_log.jsonl") && err.contains("no training record"),
        "{err}"
    );
    assert!(!out.exists());
}
