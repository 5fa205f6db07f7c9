//! `tilearn plot RUN_DIR`: the loss plot of a run, from its `train_log.jsonl` (the same picture
//! `tilearn train` leaves as `loss.png` at the end of a run).

use std::path::{Path, PathBuf};

use clap::Args;

use crate::Result;
use crate::loss_plot::{PLOT_FILE, plot_run};

#[derive(Debug, Args)]
pub struct PlotArgs {
    /// The --output-dir of a `tilearn train` run (it holds train_log.jsonl).
    pub run_dir: PathBuf,
    /// Where to write the PNG (default: RUN_DIR/loss.png).
    #[arg(long)]
    pub output: Option<PathBuf>,
}

pub fn run(args: PlotArgs) -> Result<()> {
    let output = args.output.unwrap_or_else(|| args.run_dir.join(PLOT_FILE));
    let summary = plot_run(&args.run_dir, &output)?;
    println!(
        "plot: {} ({} training and {} evaluation points)",
        summary.output.display(),
        summary.train_points,
        summary.eval_points
    );
    Ok(())
}

/// The plot at the end of a training run: any failure (even a panic in the drawing library)
/// becomes a warning, since the model is already saved and the plot can be redrawn with
/// `tilearn plot`.
pub fn plot_after_training(run_dir: &Path) {
    let output = run_dir.join(PLOT_FILE);
    let drawn = std::panic::catch_unwind(|| plot_run(run_dir, &output));
    match drawn {
        Ok(Ok(summary)) => println!("plot: {}", summary.output.display()),
        Ok(Err(e)) => eprintln!("warning: no loss plot: {e}"),
        Err(_) => eprintln!(
            "warning: no loss plot: drawing {} failed; try `tilearn plot {}`",
            output.display(),
            run_dir.display()
        ),
    }
}
