//! Progress output for `tilearn train`: a bar on a terminal, plain log lines otherwise.

use std::io::IsTerminal;

use indicatif::{ProgressBar, ProgressStyle};
use tilearn_engine::trainer::{LogRecord, PrintLogs, ProgressSink};

/// A progress bar over optimizer steps that also prints each logged record above the bar.
pub struct Bar {
    bar: Option<ProgressBar>,
}

impl ProgressSink for Bar {
    fn start(&mut self, total_steps: u64, first_step: u64) {
        let bar = ProgressBar::new(total_steps).with_position(first_step);
        bar.set_style(
            ProgressStyle::with_template(
                "{elapsed_precise} [{bar:30}] {pos}/{len} steps  {msg}  eta {eta}",
            )
            .expect("template is valid")
            .progress_chars("=> "),
        );
        self.bar = Some(bar);
    }
    fn step(&mut self, step: u64, loss: f64, lr: f64) {
        if let Some(bar) = &self.bar {
            bar.set_position(step);
            bar.set_message(format!("loss {loss:.4} lr {lr:.2e}"));
        }
    }
    fn log(&mut self, r: &LogRecord) {
        if let Some(bar) = &self.bar {
            bar.println(r.display_line());
        }
    }
    fn finish(&mut self) {
        if let Some(bar) = self.bar.take() {
            bar.finish_and_clear();
        }
    }
    fn note(&mut self, line: &str) {
        match &self.bar {
            Some(bar) => bar.println(line),
            None => println!("{line}"),
        }
    }
    fn warn(&mut self, line: &str) {
        match &self.bar {
            Some(bar) => bar.suspend(|| eprintln!("warning: {line}")),
            None => eprintln!("warning: {line}"),
        }
    }
}

/// A bar when stderr is a terminal, else one printed line per logged step.
pub fn sink() -> Box<dyn ProgressSink> {
    if std::io::stderr().is_terminal() {
        Box::new(Bar { bar: None })
    } else {
        Box::new(PrintLogs)
    }
}
