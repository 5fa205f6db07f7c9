//! TensorBoard scalars of a run (`--report-to tensorboard`), written beside the JSON-lines log
//! at the step of each log record, with the tags Hugging Face's Trainer uses (`train/loss`,
//! `eval/loss`, …), so dashboards built for Trainer runs read tilearn's.
//!
//! Only rank 0 writes (the Trainer opens the writer where it opens the JSONL log).

pub mod event_file;

use std::path::{Path, PathBuf};
use std::str::FromStr;

use tilearn_ops::DType;

pub use event_file::{Event, EventFile, read_events};
use event_file::{
    PluginData, SCALARS_PLUGIN, SESSION_START, SessionLog, Summary, SummaryMetadata, SummaryValue,
    What,
};

use super::log::{EvalRecord, LogRecord};
use crate::{EngineError, Result};

/// Where the events go when `--logging-dir` is not given: `<output_dir>/runs/<time>_<host>`,
/// as Hugging Face's Trainer names it (local time, `Dec01_20-13-27`), so every run — a resumed
/// one too — is its own TensorBoard run under `<output_dir>/runs`.
pub fn default_logging_dir(output_dir: &Path) -> PathBuf {
    let time = chrono::Local::now().format("%b%d_%H-%M-%S");
    output_dir
        .join("runs")
        .join(format!("{time}_{}", hostname()))
}

fn hostname() -> String {
    gethostname::gethostname().to_string_lossy().into_owned()
}

/// `train/precision`: the compute format's precision in the IEEE 754 sense, the significand's
/// bits including the implicit one — fp32 24, fp16 11, bf16 8 — so the chart steps down when a
/// mixed-precision policy switches to a narrower format.
pub fn precision_bits(precision: DType) -> u32 {
    match precision {
        DType::F32 => 24,
        DType::F16 => 11,
        DType::BF16 => 8,
    }
}

/// What each tag means, sent once per tag as its TensorBoard description.
fn description(tag: &str) -> Option<&'static str> {
    Some(match tag {
        "train/loss" => "Mean token loss over the optimizer steps since the last log record",
        "train/learning_rate" => "Learning rate of the last step",
        "train/grad_norm" => "Mean global gradient norm before clipping (NaN: every step skipped)",
        "train/tokens_per_second" => "Tokens per second over all ranks",
        "train/loss_scale" => "fp16 GradScaler scale after the window",
        "train/precision" => "Significand bits of the compute format: fp32 24, fp16 11, bf16 8",
        "train/epoch" => "Epochs done",
        "eval/loss" => "Mean token loss over the eval set",
        "eval/perplexity" => "exp(eval/loss)",
        _ => return None,
    })
}

/// Writes a run's log records as TensorBoard scalars into one event file.
pub struct TensorBoardLog {
    events: EventFile,
    described: Vec<String>,
}

impl TensorBoardLog {
    /// Creates `dir` and a new event file in it for a run whose first optimizer step is
    /// `first_step + 1` (`first_step` > 0: resumed from that checkpoint step). The file opens
    /// with a `SessionLog START` at that step: TensorBoard takes a run's first START as its
    /// beginning and a later one (a resumed run writing into the same directory) as a restart,
    /// dropping what an earlier attempt logged at or past its step.
    pub fn create(dir: &Path, first_step: u64) -> Result<TensorBoardLog> {
        std::fs::create_dir_all(dir).map_err(|e| {
            EngineError::io(dir, "create the TensorBoard logging dir (--logging-dir)", e)
        })?;
        let now = event_file::wall_time_now();
        // TensorBoard finds files by the `tfevents` in the name; the rest keeps concurrent
        // writers (other hosts, processes) apart, as TensorFlow and PyTorch name them.
        let name = format!(
            "events.out.tfevents.{}.{}.{}.0",
            now as u64,
            hostname(),
            std::process::id()
        );
        let mut events = EventFile::create(&dir.join(name))?;
        events.write(&Event {
            wall_time: now,
            step: first_step as i64 + 1,
            what: Some(What::SessionLog(SessionLog {
                status: SESSION_START,
            })),
        })?;
        Ok(TensorBoardLog {
            events,
            described: Vec::new(),
        })
    }

    /// The scalars of a training record.
    pub fn write(&mut self, r: &LogRecord) -> Result<()> {
        let mut scalars = vec![
            ("train/loss", r.loss),
            ("train/learning_rate", r.lr),
            ("train/grad_norm", r.grad_norm),
            ("train/tokens_per_second", r.tokens_per_sec),
            ("train/epoch", r.epoch),
        ];
        if let Ok(precision) = DType::from_str(&r.precision) {
            scalars.push(("train/precision", precision_bits(precision) as f64));
            if precision.needs_loss_scaling() {
                scalars.push(("train/loss_scale", r.loss_scale));
            }
        }
        self.write_scalars(r.step, &scalars)
    }

    /// The scalars of an eval record.
    pub fn write_eval(&mut self, r: &EvalRecord) -> Result<()> {
        self.write_scalars(
            r.step,
            &[
                ("eval/loss", r.eval_loss),
                ("eval/perplexity", r.eval_perplexity),
            ],
        )
    }

    /// One event holding every scalar; values are written as they are, NaN included (a
    /// diverged eval or an all-skipped window is information, and TensorBoard shows it).
    fn write_scalars(&mut self, step: u64, scalars: &[(&str, f64)]) -> Result<()> {
        let value = scalars
            .iter()
            .map(|&(tag, v)| {
                let first = !self.described.iter().any(|t| t == tag);
                if first {
                    self.described.push(tag.to_string());
                }
                SummaryValue {
                    tag: tag.to_string(),
                    simple_value: Some(v as f32),
                    // Metadata names the plugin too: readers that keep metadata (the
                    // legacy `EventAccumulator`) expect one.
                    metadata: description(tag).filter(|_| first).map(|d| SummaryMetadata {
                        plugin_data: Some(PluginData {
                            plugin_name: SCALARS_PLUGIN.into(),
                        }),
                        summary_description: d.to_string(),
                    }),
                }
            })
            .collect();
        self.events.write(&Event {
            wall_time: event_file::wall_time_now(),
            step: step as i64,
            what: Some(What::Summary(Summary { value })),
        })
    }

    /// The event file.
    pub fn path(&self) -> &Path {
        self.events.path()
    }
}

/// One scalar of an event file, as a reader sees it.
#[derive(Clone, Debug, PartialEq)]
pub struct Scalar {
    pub step: u64,
    pub tag: String,
    pub value: f32,
}

/// Every scalar of an event file in order (CRCs checked by [`read_events`]).
pub fn read_scalars(path: &Path) -> Result<Vec<Scalar>> {
    Ok(read_events(path)?
        .into_iter()
        .filter_map(|event| match event.what {
            Some(What::Summary(summary)) => Some((event.step, summary)),
            _ => None,
        })
        .flat_map(|(step, summary)| {
            summary.value.into_iter().filter_map(move |v| {
                Some(Scalar {
                    step: step as u64,
                    tag: v.tag,
                    value: v.simple_value?,
                })
            })
        })
        .collect())
}

/// The event files of a logging directory (`events.out.tfevents.*`), oldest name first.
pub fn event_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let entries = std::fs::read_dir(dir)
        .map_err(|e| EngineError::io(dir, "list the TensorBoard logging dir", e))?;
    let mut files: Vec<PathBuf> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("events.out.tfevents."))
        })
        .collect();
    files.sort();
    Ok(files)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(step: u64, precision: &str) -> LogRecord {
        LogRecord {
            step,
            epoch: step as f64 / 10.0,
            loss: 5.0 - step as f64,
            lr: 1e-3,
            grad_norm: 0.5,
            tokens_per_sec: 1000.0,
            precision: precision.into(),
            loss_scale: 65536.0,
            skipped_steps: 0,
            world_size: 1,
            allreduce_ms: None,
            allreduce_hidden: None,
        }
    }

    #[test]
    fn records_become_tagged_scalars_at_their_steps() {
        let dir = tempfile::tempdir().unwrap();
        let mut tb = TensorBoardLog::create(dir.path(), 0).unwrap();
        tb.write(&record(1, "fp32")).unwrap();
        tb.write(&record(2, "fp16")).unwrap();
        tb.write_eval(&EvalRecord {
            step: 2,
            epoch: 0.2,
            eval_loss: 3.0,
            eval_perplexity: 3f64.exp(),
            eval_tokens: 10,
            precision: "fp16".into(),
        })
        .unwrap();
        let files = event_files(dir.path()).unwrap();
        assert_eq!(files, [tb.path().to_path_buf()]);

        let scalars = read_scalars(tb.path()).unwrap();
        let at = |tag: &str| -> Vec<(u64, f32)> {
            scalars
                .iter()
                .filter(|s| s.tag == tag)
                .map(|s| (s.step, s.value))
                .collect()
        };
        assert_eq!(at("train/loss"), [(1, 4.0), (2, 3.0)]);
        assert_eq!(at("train/learning_rate"), [(1, 1e-3), (2, 1e-3)]);
        assert_eq!(at("train/precision"), [(1, 24.0), (2, 11.0)]);
        // The scale only where fp16 ran.
        assert_eq!(at("train/loss_scale"), [(2, 65536.0)]);
        assert_eq!(at("eval/loss"), [(2, 3.0)]);
        assert_eq!(at("eval/perplexity"), [(2, 3f32.exp())]);
        assert_eq!(at("train/tokens_per_second").len(), 2);
        assert_eq!(at("train/grad_norm").len(), 2);

        // Descriptions go with a tag's first value only.
        let events = read_events(tb.path()).unwrap();
        let described: Vec<usize> = events
            .iter()
            .filter_map(|e| match &e.what {
                Some(What::Summary(s)) => {
                    Some(s.value.iter().filter(|v| v.metadata.is_some()).count())
                }
                _ => None,
            })
            .collect();
        assert_eq!(
            described,
            [6, 1, 2],
            "6 new tags, then loss_scale, then eval's two"
        );
    }

    #[test]
    fn a_run_starts_with_a_session_start_at_its_first_step() {
        let dir = tempfile::tempdir().unwrap();
        let start_steps = |first_step| {
            let tb = TensorBoardLog::create(&dir.path().join("nested/runs"), first_step).unwrap();
            let events = read_events(tb.path()).unwrap();
            assert_eq!(events.len(), 2, "file_version, then the START");
            assert_eq!(
                events[1].what,
                Some(What::SessionLog(SessionLog {
                    status: SESSION_START
                }))
            );
            events[1].step
        };
        assert_eq!(start_steps(0), 1);
        assert_eq!(start_steps(40), 41, "resumed after step 40");
    }

    #[test]
    fn default_dir_is_runs_time_host_under_the_output_dir() {
        let dir = default_logging_dir(Path::new("out"));
        assert_eq!(dir.parent(), Some(Path::new("out/runs")));
        let name = dir.file_name().unwrap().to_str().unwrap();
        // `Dec01_20-13-27_host`: month, day, time, then the host name.
        let (time, host) = name.split_at(14);
        assert_eq!(time.len(), 14, "{name}");
        assert_eq!(&time[5..6], "_", "{name}");
        assert_eq!(host, format!("_{}", hostname()));
    }
}
