//! The loss plot of a run (`loss.png`): training and evaluation loss against optimizer steps,
//! and the learning rate in a second panel below, read from the run's `train_log.jsonl`.
//!
//! Drawn with plotters' bitmap backend; text uses DejaVu Sans embedded in the binary (the
//! `dejavu` crate) through plotters' `ab_glyph` renderer, so neither the build nor the run needs
//! a system font library.

use std::ops::Range;
use std::path::{Path, PathBuf};

use plotters::prelude::*;
use plotters::style::{FontStyle, register_font};
use tilearn_engine::trainer::log::{LOG_FILE, LogLine, read_log_lines};

use crate::{LlmError, Result};

/// The plot's file name in a run's output directory.
pub const PLOT_FILE: &str = "loss.png";
/// Pixels of the image: the loss panel takes the upper two thirds, the learning rate the rest.
pub const PLOT_SIZE: (u32, u32) = (1000, 720);

const FONT: &str = "sans-serif";
const TRAIN_COLOR: RGBColor = RGBColor(31, 119, 180);
const EVAL_COLOR: RGBColor = RGBColor(214, 39, 40);
const LR_COLOR: RGBColor = RGBColor(44, 160, 44);

/// What a plot was drawn from.
#[derive(Clone, Debug, PartialEq)]
pub struct PlotSummary {
    pub output: PathBuf,
    pub train_points: usize,
    pub eval_points: usize,
}

/// The series of a log: (step, value) of the training loss, the eval loss and the learning
/// rate. Non-finite values (a diverged eval, written as `null`) are left out of the lines.
struct Series {
    train: Vec<(f64, f64)>,
    eval: Vec<(f64, f64)>,
    lr: Vec<(f64, f64)>,
}

fn read_series(log: &Path) -> Result<Series> {
    let mut series = Series {
        train: Vec::new(),
        eval: Vec::new(),
        lr: Vec::new(),
    };
    for line in read_log_lines(log)? {
        match line {
            LogLine::Train(r) => {
                series.train.push((r.step as f64, r.loss));
                series.lr.push((r.step as f64, r.lr));
            }
            LogLine::Eval(r) => series.eval.push((r.step as f64, r.eval_loss)),
        }
    }
    for points in [&mut series.train, &mut series.eval, &mut series.lr] {
        points.retain(|(_, v)| v.is_finite());
    }
    if series.train.is_empty() {
        return Err(LlmError::Input {
            file: log.to_path_buf(),
            message: "no training record with a finite loss to plot; train for at least \
                      --logging-steps steps first"
                .into(),
        });
    }
    Ok(series)
}

/// `lo..hi` around `values` with a margin, never empty.
fn padded_range(values: impl Iterator<Item = f64>) -> Range<f64> {
    let (lo, hi) = values.fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), v| {
        (lo.min(v), hi.max(v))
    });
    let span = hi - lo;
    let pad = if span > 0.0 {
        0.05 * span
    } else {
        0.05 * lo.abs().max(1e-12)
    };
    (lo - pad)..(hi + pad)
}

/// Draws `<run_dir>/train_log.jsonl` into `output` (a PNG).
pub fn plot_run(run_dir: &Path, output: &Path) -> Result<PlotSummary> {
    let log = run_dir.join(LOG_FILE);
    if !log.is_file() {
        return Err(LlmError::Input {
            file: log,
            message: "no training log here; pass the --output-dir of a `tilearn train` run".into(),
        });
    }
    let series = read_series(&log)?;
    draw(&series, output).map_err(|message| LlmError::Plot {
        file: output.to_path_buf(),
        message,
    })?;
    Ok(PlotSummary {
        output: output.to_path_buf(),
        train_points: series.train.len(),
        eval_points: series.eval.len(),
    })
}

fn draw(series: &Series, output: &Path) -> std::result::Result<(), String> {
    // Registering replaces the same entry, so repeated plots in one process are fine.
    register_font(FONT, FontStyle::Normal, dejavu::sans::regular())
        .map_err(|_| "the embedded DejaVu Sans font did not load".to_string())?;
    let e = |e: DrawingAreaErrorKind<_>| e.to_string();

    let root = BitMapBackend::new(output, PLOT_SIZE).into_drawing_area();
    root.fill(&WHITE).map_err(e)?;
    let (upper, lower) = root.split_vertically(PLOT_SIZE.1 * 2 / 3);

    let all_steps = series.train.iter().chain(&series.eval).map(|p| p.0);
    let mut steps = padded_range(all_steps);
    steps.start = steps.start.max(0.0);
    let losses = padded_range(series.train.iter().chain(&series.eval).map(|p| p.1));

    let mut chart = ChartBuilder::on(&upper)
        .caption("Loss", (FONT, 24))
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(64)
        .build_cartesian_2d(steps.clone(), losses)
        .map_err(e)?;
    chart
        .configure_mesh()
        .x_desc("step")
        .x_label_formatter(&|step| format!("{step:.0}"))
        .y_desc("loss")
        .label_style((FONT, 14))
        .draw()
        .map_err(e)?;
    chart
        .draw_series(LineSeries::new(
            series.train.iter().copied(),
            TRAIN_COLOR.stroke_width(2),
        ))
        .map_err(e)?
        .label("training loss")
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], TRAIN_COLOR.stroke_width(2)));
    if !series.eval.is_empty() {
        chart
            .draw_series(
                LineSeries::new(series.eval.iter().copied(), EVAL_COLOR.stroke_width(2))
                    .point_size(4),
            )
            .map_err(e)?
            .label("evaluation loss")
            .legend(|(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], EVAL_COLOR.stroke_width(2))
            });
    }
    chart
        .configure_series_labels()
        .label_font((FONT, 14))
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .position(SeriesLabelPosition::UpperRight)
        .draw()
        .map_err(e)?;

    let mut lr_chart = ChartBuilder::on(&lower)
        .caption("Learning rate", (FONT, 20))
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(64)
        .build_cartesian_2d(steps, padded_range(series.lr.iter().map(|p| p.1)))
        .map_err(e)?;
    lr_chart
        .configure_mesh()
        .x_desc("step")
        .x_label_formatter(&|step| format!("{step:.0}"))
        .y_desc("lr")
        .label_style((FONT, 14))
        .y_label_formatter(&|v| format!("{v:.1e}"))
        .draw()
        .map_err(e)?;
    lr_chart
        .draw_series(LineSeries::new(
            series.lr.iter().copied(),
            LR_COLOR.stroke_width(2),
        ))
        .map_err(e)?;
    root.present().map_err(e)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_are_padded_and_never_empty() {
        let r = padded_range([1.0, 3.0].into_iter());
        assert!((r.start - 0.9).abs() < 1e-12 && (r.end - 3.1).abs() < 1e-12);
        let single = padded_range([2.0].into_iter());
        assert!(single.start < 2.0 && single.end > 2.0);
        let zero = padded_range([0.0].into_iter());
        assert!(zero.start < zero.end);
    }
}
