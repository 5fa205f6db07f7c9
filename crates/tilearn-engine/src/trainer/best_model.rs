//! `--load-best-model-at-end` (Hugging Face's `load_best_model_at_end`, `metric_for_best_model`
//! and `best_model_checkpoint`): the checkpoint with the best eval metric is remembered in the
//! trainer state, never deleted by `--save-total-limit`, and its weights are loaded before the
//! final model is written.
//!
//! Only checkpoints written at a step that was also evaluated can be judged, so (as Hugging
//! Face requires) checkpoints must come at multiples of the evaluation interval.

use adaptfp16::GradScaler;
use tilearn_optim::LrSchedule;

use super::args::{EvalStrategy, SaveStrategy, TrainingArguments};
use super::log::EvalRecord;
use super::state::BestCheckpoint;
use super::{ProgressSink, Trainer, TrainerState, checkpoint};
use crate::{EngineError, Result};

/// The metric that picks the best checkpoint; lower is better for both (perplexity is the
/// exponential of the loss, so both pick the same checkpoint; the name is the one the user asked
/// for, in the log and the state).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BestMetric {
    EvalLoss,
    EvalPerplexity,
}

impl BestMetric {
    /// `--metric-for-best-model`: Hugging Face's names with or without the `eval_` prefix;
    /// `None` is its default, the loss.
    pub fn parse(name: Option<&str>) -> Result<BestMetric> {
        match name.map(|n| n.strip_prefix("eval_").unwrap_or(n)) {
            None | Some("loss") => Ok(BestMetric::EvalLoss),
            Some("perplexity") => Ok(BestMetric::EvalPerplexity),
            Some(other) => Err(EngineError::InvalidArgument {
                argument: "--metric-for-best-model".into(),
                message: format!(
                    "`{other}` is not a metric tilearn evaluates; use eval_loss or eval_perplexity"
                ),
            }),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            BestMetric::EvalLoss => "eval_loss",
            BestMetric::EvalPerplexity => "eval_perplexity",
        }
    }

    pub fn value(self, record: &EvalRecord) -> f64 {
        match self {
            BestMetric::EvalLoss => record.eval_loss,
            BestMetric::EvalPerplexity => record.eval_perplexity,
        }
    }

    /// Whether `candidate` beats the best so far (lower is better; NaN never wins).
    pub fn improves(self, candidate: f64, best: Option<f64>) -> bool {
        candidate.is_finite() && best.is_none_or(|b| candidate < b)
    }
}

/// Checks that every checkpoint comes at an evaluated step, naming the flags to change.
pub fn validate(args: &TrainingArguments) -> Result<()> {
    BestMetric::parse(args.metric_for_best_model.as_deref())?;
    if !args.load_best_model_at_end {
        return Ok(());
    }
    let bad = |argument: &str, message: String| {
        Err(EngineError::InvalidArgument {
            argument: argument.into(),
            message,
        })
    };
    if args.save_strategy == SaveStrategy::No || args.save_steps == 0 {
        return bad(
            "--load-best-model-at-end",
            "needs checkpoints to choose from; set --save-steps to a multiple of --eval-steps"
                .into(),
        );
    }
    let every = match args.eval_strategy {
        EvalStrategy::No => {
            return bad(
                "--load-best-model-at-end",
                "needs evaluation; add --eval-strategy steps --eval-steps N with --eval-data DIR \
                 or --validation-split-percentage P"
                    .into(),
            );
        }
        EvalStrategy::Epoch => {
            return bad(
                "--load-best-model-at-end",
                "needs checkpoints at evaluated steps, and checkpoints are written every \
                 --save-steps; use --eval-strategy steps with --save-steps a multiple of \
                 --eval-steps"
                    .into(),
            );
        }
        EvalStrategy::Steps => args.eval_steps.unwrap_or(args.logging_steps),
    };
    if every == 0 || !args.save_steps.is_multiple_of(every) {
        return bad(
            "--save-steps",
            format!(
                "is {}, not a multiple of the evaluation interval {every} (--eval-steps, else \
                 --logging-steps); --load-best-model-at-end can only judge checkpoints written at \
                 evaluated steps",
                args.save_steps
            ),
        );
    }
    Ok(())
}

/// The last evaluation's step and metric value, kept until the checkpoint of that step.
#[derive(Clone, Copy, Debug, Default)]
pub struct LastEval {
    evaluated: Option<(u64, f64)>,
}

impl LastEval {
    pub fn record(&mut self, step: u64, value: f64) {
        self.evaluated = Some((step, value));
    }

    /// The metric of `step`, if it was evaluated last.
    pub fn at(&self, step: u64) -> Option<f64> {
        self.evaluated.filter(|&(s, _)| s == step).map(|(_, v)| v)
    }
}

impl Trainer {
    /// The checkpoint of `state.global_step`. With `--load-best-model-at-end` it is first
    /// recorded as the best when this step's evaluation beats the best so far (so its own
    /// trainer state says so), and the record is undone when it could not be written.
    pub(super) fn checkpoint_judged(
        &mut self,
        state: &mut TrainerState,
        last_eval: LastEval,
        schedule: &LrSchedule,
        scaler: &GradScaler,
        sink: &mut dyn ProgressSink,
    ) -> Result<std::result::Result<(), String>> {
        let metric = BestMetric::parse(self.args.metric_for_best_model.as_deref())?;
        let previous = state.best.clone();
        if self.args.load_best_model_at_end
            && let Some(value) = last_eval.at(state.global_step)
            && metric.improves(value, state.best.best_metric)
        {
            state.best = BestCheckpoint {
                best_metric: Some(value),
                best_model_checkpoint: Some(checkpoint::checkpoint_dir(
                    &self.args.output_dir,
                    state.global_step,
                )),
            };
        }
        let saved = self.try_checkpoint(state, schedule, scaler, sink)?;
        // Only rank 0 knows whether the files were written; every rank keeps the same record.
        let failed = if self.args.load_best_model_at_end {
            self.dp.any(saved.is_err())?
        } else {
            saved.is_err()
        };
        if failed {
            state.best = previous;
        }
        Ok(saved)
    }

    /// Loads the best checkpoint's weights on every rank (unless the weights are already the
    /// last step's and that step was the best), saying which it loaded; whether it loaded.
    /// Collective: every rank holds the same record.
    pub(super) fn load_best_model(
        &mut self,
        state: &TrainerState,
        metric: BestMetric,
        sink: &mut dyn ProgressSink,
    ) -> Result<bool> {
        let (Some(dir), Some(value)) = (
            state.best.best_model_checkpoint.as_deref(),
            state.best.best_metric,
        ) else {
            sink.warn(
                "--load-best-model-at-end: no checkpoint was written at an evaluated step, so                  the final model is the last step's",
            );
            return Ok(false);
        };
        let name = dir.file_name().map_or_else(
            || dir.display().to_string(),
            |n| n.to_string_lossy().into_owned(),
        );
        if dir == checkpoint::checkpoint_dir(&self.args.output_dir, state.global_step) {
            sink.note(&format!(
                "the last checkpoint ({name}, {} {value:.6}) is the best; the final model is the \
                 last step's",
                metric.name()
            ));
            return Ok(false);
        }
        self.backend
            .load_weights(dir)
            .map_err(|e| EngineError::InvalidArgument {
                argument: "--load-best-model-at-end".into(),
                message: format!(
                    "the best checkpoint {} could not be loaded ({e}); it is still on disk, \
                     pass it to --model to use it",
                    dir.display()
                ),
            })?;
        sink.note(&format!(
            "loaded the best model ({name}, {} {value:.6}) for the final save",
            metric.name()
        ));
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(save: u64, eval: Option<u64>, strategy: EvalStrategy) -> TrainingArguments {
        TrainingArguments {
            load_best_model_at_end: true,
            save_steps: save,
            eval_steps: eval,
            eval_strategy: strategy,
            logging_steps: 5,
            ..TrainingArguments::default()
        }
    }

    fn refused_flag(a: &TrainingArguments) -> String {
        match validate(a) {
            Err(EngineError::InvalidArgument { argument, .. }) => argument,
            other => panic!("expected a refusal, got {other:?}"),
        }
    }

    #[test]
    fn checkpoints_must_fall_on_evaluated_steps() {
        assert!(validate(&args(20, Some(10), EvalStrategy::Steps)).is_ok());
        assert!(validate(&args(10, None, EvalStrategy::Steps)).is_ok());
        assert_eq!(
            refused_flag(&args(15, Some(10), EvalStrategy::Steps)),
            "--save-steps"
        );
        assert_eq!(
            refused_flag(&args(10, None, EvalStrategy::No)),
            "--load-best-model-at-end"
        );
        assert_eq!(
            refused_flag(&args(10, None, EvalStrategy::Epoch)),
            "--load-best-model-at-end"
        );
        assert_eq!(
            refused_flag(&args(0, Some(10), EvalStrategy::Steps)),
            "--load-best-model-at-end"
        );
    }

    #[test]
    fn metric_names_and_ordering() {
        assert_eq!(BestMetric::parse(None).unwrap(), BestMetric::EvalLoss);
        assert_eq!(
            BestMetric::parse(Some("loss")).unwrap(),
            BestMetric::EvalLoss
        );
        assert_eq!(
            BestMetric::parse(Some("eval_perplexity")).unwrap(),
            BestMetric::EvalPerplexity
        );
        assert!(BestMetric::parse(Some("accuracy")).is_err());
        let m = BestMetric::EvalLoss;
        assert!(m.improves(2.0, None));
        assert!(m.improves(1.5, Some(2.0)));
        assert!(!m.improves(2.0, Some(2.0)));
        assert!(!m.improves(f64::NAN, None));
    }
}
