//! The JSON-lines training log (`train_log.jsonl` in the output directory).

use std::fs::{File, OpenOptions};
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::{EngineError, Result};

/// File name of the log inside the output directory.
pub const LOG_FILE: &str = "train_log.jsonl";

/// One logged optimizer step. Field names follow what Hugging Face's Trainer logs.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LogRecord {
    pub step: u64,
    pub epoch: f64,
    pub loss: f64,
    pub lr: f64,
    /// NaN (written as JSON `null`) when every step of the window was skipped.
    #[serde(deserialize_with = "nan_if_null")]
    pub grad_norm: f64,
    pub tokens_per_sec: f64,
    /// The compute precision of the last step in the window (`fp32`, `bf16`, `fp16`).
    #[serde(default)]
    pub precision: String,
    /// The GradScaler's scale after the window (1 when no scaler is in use).
    #[serde(default)]
    pub loss_scale: f64,
    /// Steps in the window whose update the GradScaler skipped.
    #[serde(default)]
    pub skipped_steps: u64,
    /// Data-parallel ranks of the run (1 alone); `loss` is the mean over all of them and
    /// `tokens_per_sec` their combined rate.
    #[serde(default = "one")]
    pub world_size: usize,
    /// Data parallel with the all-reduce overlapped: its mean time per step (ms) and the
    /// share of it hidden behind the backward.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub allreduce_ms: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub allreduce_hidden: Option<f64>,
}

/// One evaluation of the eval set (Hugging Face logs `eval_loss` in its own record too).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct EvalRecord {
    pub step: u64,
    pub epoch: f64,
    /// Mean token loss over the eval set (all ranks' windows); NaN (JSON `null`) when the
    /// model diverged.
    #[serde(deserialize_with = "nan_if_null")]
    pub eval_loss: f64,
    /// `exp(eval_loss)`.
    #[serde(deserialize_with = "nan_if_null")]
    pub eval_perplexity: f64,
    /// Targets the mean is over.
    pub eval_tokens: u64,
    /// The precision the forward ran in.
    pub precision: String,
}

impl EvalRecord {
    /// The human-readable form printed to the terminal.
    pub fn display_line(&self) -> String {
        format!(
            "eval   step {}  eval_loss {:.4}  perplexity {:.3}",
            self.step, self.eval_loss, self.eval_perplexity
        )
    }
}

/// Either kind of line of the log. Eval records are told apart by their `eval_loss`, which a
/// training record never has.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum LogLine {
    Eval(EvalRecord),
    Train(LogRecord),
}

impl LogLine {
    pub fn step(&self) -> u64 {
        match self {
            LogLine::Eval(r) => r.step,
            LogLine::Train(r) => r.step,
        }
    }
}

fn one() -> usize {
    1
}

/// JSON has no NaN: serde_json writes it as `null`, so read `null` back as NaN.
fn nan_if_null<'de, D: serde::Deserializer<'de>>(d: D) -> std::result::Result<f64, D::Error> {
    Ok(Option::<f64>::deserialize(d)?.unwrap_or(f64::NAN))
}

impl LogRecord {
    /// The human-readable form printed to the terminal.
    pub fn display_line(&self) -> String {
        let mut line = format!(
            "step {:>6}  loss {:.4}  lr {:.3e}  grad_norm {:.3}  tokens/s {:.0}  {}",
            self.step, self.loss, self.lr, self.grad_norm, self.tokens_per_sec, self.precision
        );
        if self.precision == "fp16" {
            line.push_str(&format!(" scale {}", self.loss_scale));
        }
        if self.skipped_steps > 0 {
            line.push_str(&format!("  skipped {}", self.skipped_steps));
        }
        if self.world_size > 1 {
            line.push_str(&format!("  ranks {}", self.world_size));
        }
        if let (Some(ms), Some(hidden)) = (self.allreduce_ms, self.allreduce_hidden) {
            line.push_str(&format!(
                "  all-reduce {ms:.1} ms ({:.0}% hidden)",
                100.0 * hidden
            ));
        }
        line
    }
}

/// Appends records to the log, flushing each line so a crash loses nothing already logged.
pub struct TrainLog {
    path: PathBuf,
    out: BufWriter<File>,
}

impl TrainLog {
    /// Opens `<dir>/train_log.jsonl`; with `truncate` a fresh run starts an empty log, while a
    /// resumed run appends.
    pub fn open(dir: &Path, truncate: bool) -> Result<TrainLog> {
        let path = dir.join(LOG_FILE);
        let file = OpenOptions::new()
            .create(true)
            .write(true)
            .append(!truncate)
            .truncate(truncate)
            .open(&path)
            .map_err(|e| EngineError::io(&path, "open the training log", e))?;
        Ok(TrainLog {
            path,
            out: BufWriter::new(file),
        })
    }

    pub fn write(&mut self, record: &LogRecord) -> Result<()> {
        self.write_line(&serde_json::to_string(record).expect("LogRecord serialises"))
    }

    pub fn write_eval(&mut self, record: &EvalRecord) -> Result<()> {
        self.write_line(&serde_json::to_string(record).expect("EvalRecord serialises"))
    }

    fn write_line(&mut self, line: &str) -> Result<()> {
        writeln!(self.out, "{line}")
            .and_then(|_| self.out.flush())
            .map_err(|e| EngineError::io(&self.path, "write the training log", e))
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// Reads a log's lines back, both kinds in order (used by resume to trim records past the
/// checkpoint).
pub fn read_log_lines(path: &Path) -> Result<Vec<LogLine>> {
    let text =
        std::fs::read_to_string(path).map_err(|e| EngineError::io(path, "read the log", e))?;
    text.lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(i, l)| {
            serde_json::from_str(l).map_err(|e| EngineError::Data {
                file: path.to_path_buf(),
                message: format!("line {}: not a log record: {e}", i + 1),
            })
        })
        .collect()
}

/// The training records of a log (logs written before evaluation existed hold only these).
pub fn read_log(path: &Path) -> Result<Vec<LogRecord>> {
    Ok(read_log_lines(path)?
        .into_iter()
        .filter_map(|line| match line {
            LogLine::Train(r) => Some(r),
            LogLine::Eval(_) => None,
        })
        .collect())
}

/// The eval records of a log.
pub fn read_eval_log(path: &Path) -> Result<Vec<EvalRecord>> {
    Ok(read_log_lines(path)?
        .into_iter()
        .filter_map(|line| match line {
            LogLine::Eval(r) => Some(r),
            LogLine::Train(_) => None,
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn training_and_eval_records_read_back_apart_and_old_logs_still_read() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(LOG_FILE);
        // An old record (no precision, scale or world size), a current one, and two eval
        // records, the second of a diverged model (NaN written as null).
        let old =
            r#"{"step":1,"epoch":0.1,"loss":5.5,"lr":0.001,"grad_norm":null,"tokens_per_sec":9.0}"#;
        let eval = EvalRecord {
            step: 2,
            epoch: 0.2,
            eval_loss: 5.0,
            eval_perplexity: 5f64.exp(),
            eval_tokens: 62,
            precision: "bf16".into(),
        };
        let diverged = EvalRecord {
            step: 3,
            eval_loss: f64::NAN,
            eval_perplexity: f64::NAN,
            ..eval.clone()
        };
        std::fs::write(&path, format!("{old}\n")).unwrap();
        let mut log = TrainLog::open(dir.path(), false).unwrap();
        log.write_eval(&eval).unwrap();
        log.write_eval(&diverged).unwrap();
        drop(log);

        let train = read_log(&path).unwrap();
        assert_eq!(train.len(), 1);
        assert_eq!((train[0].world_size, train[0].precision.as_str()), (1, ""));
        assert!(train[0].grad_norm.is_nan());
        let evals = read_eval_log(&path).unwrap();
        assert_eq!(evals[0], eval);
        assert!(evals[1].eval_loss.is_nan() && evals[1].eval_perplexity.is_nan());
        let steps: Vec<u64> = read_log_lines(&path)
            .unwrap()
            .iter()
            .map(LogLine::step)
            .collect();
        assert_eq!(steps, [1, 2, 3]);
    }
}
