//! Whether a training step on the GPU engine runs as one replayed CUDA graph
//! (`--cuda-graphs on|off|auto`): the setting, and the rule that says which steps can be
//! captured. This module has no device code, so the setting parses and the rule is tested on
//! any machine; the capture itself is `gpu::graph`.
//!
//! A whole-step graph records the zeroing of the gradients, the forward, the fused loss head,
//! the backward, the gradient norm and the fused AdamW once, and replays them with one launch
//! per step. What changes from step to step must then live in device buffers the host fills
//! before the replay (token ids, targets, the loss factor `1 / denominator`, the optimizer's
//! learning rate and bias corrections), and nothing in the step may depend on a host decision
//! taken between its kernels. The rule below names the configurations where that does not
//! hold; such a step runs eagerly (`auto`, with the reason logged once) or the run is refused
//! (`on`).

use std::fmt;

use serde::{Deserialize, Serialize};

/// The setting a run gets when it names none: `Auto`, since the H200 runs showed replayed steps
/// bit-identical to eager ones (engine test in f32, bf16 and bf16 with checkpointing; 40/40
/// identical losses of the embedded default; same final loss at both bench presets) and
/// slightly faster (+1.2 % llama-134m, +0.9 % TinyLlama). Ineligible steps run eagerly with
/// the reason logged once.
pub const DEFAULT_CUDA_GRAPHS: CudaGraphs = CudaGraphs::Auto;

/// `--cuda-graphs`: whether training steps are captured once and replayed as a CUDA graph.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum CudaGraphs {
    /// Every step runs eagerly (one launch per kernel).
    Off,
    /// Every step is replayed from a graph; a configuration that cannot be captured is an
    /// error naming the reason.
    On,
    /// Steps are replayed where they can be captured; the others run eagerly and the reason
    /// is logged once.
    Auto,
}

impl Default for CudaGraphs {
    fn default() -> Self {
        DEFAULT_CUDA_GRAPHS
    }
}

impl CudaGraphs {
    /// Parses the flag's text (`on`, `off`, `auto`; case-insensitive). The error says what
    /// the flag accepts.
    pub fn parse(text: &str) -> Result<CudaGraphs, String> {
        match text.trim().to_ascii_lowercase().as_str() {
            "on" => Ok(CudaGraphs::On),
            "off" => Ok(CudaGraphs::Off),
            "auto" => Ok(CudaGraphs::Auto),
            _ => Err(format!(
                "`{text}` is not a CUDA graph setting; use `on` (capture every step, refuse \
                 what cannot be captured), `off` (eager steps) or `auto` (capture where the \
                 step's shapes and decisions are static)"
            )),
        }
    }

    /// What to do with a step of `conditions`: [`GraphDecision::Graph`], or eager with the
    /// reasons (`Auto`; none for `Off`), or, for `On`, an error message naming the reasons
    /// and the way out.
    pub fn decide(self, conditions: &StepConditions) -> Result<GraphDecision, String> {
        let blockers = conditions.blockers();
        match self {
            CudaGraphs::Off => Ok(GraphDecision::Eager { reason: None }),
            _ if blockers.is_empty() => Ok(GraphDecision::Graph),
            CudaGraphs::Auto => Ok(GraphDecision::Eager {
                reason: Some(describe(&blockers)),
            }),
            CudaGraphs::On => Err(format!(
                "--cuda-graphs on: this step cannot be captured as one CUDA graph: {}; use \
                 --cuda-graphs auto (eager for such steps) or off",
                describe(&blockers)
            )),
        }
    }
}

impl fmt::Display for CudaGraphs {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            CudaGraphs::Off => "off",
            CudaGraphs::On => "on",
            CudaGraphs::Auto => "auto",
        })
    }
}

/// What one step looks like, as far as capturing it as a graph cares.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StepConditions {
    /// Micro-batches accumulated into the step (gradient accumulation).
    pub micro_batches: usize,
    /// Processes taking part in the step (data, tensor or pipeline parallel ranks).
    pub world_size: usize,
    /// The step runs with a GradScaler (fp16): whether it is skipped is decided on the host
    /// from the unscaled gradient norm, between the backward and the optimizer.
    pub loss_scaling: bool,
    /// The batch packs several examples per row: their position ids are a per-batch upload
    /// into a buffer sized by the batch.
    pub packed_rows: bool,
    /// The optimizer steps a shard of the parameters (ZeRO): the clip norm is gathered from
    /// the ranks by the host.
    pub sharded_optimizer: bool,
}

impl StepConditions {
    /// A single-process step of one unpacked micro-batch without loss scaling: capturable.
    pub fn single() -> StepConditions {
        StepConditions {
            micro_batches: 1,
            world_size: 1,
            loss_scaling: false,
            packed_rows: false,
            sharded_optimizer: false,
        }
    }

    /// Every reason this step cannot be one graph, in a fixed order (empty: it can).
    pub fn blockers(&self) -> Vec<GraphBlocker> {
        let mut out = Vec::new();
        if self.world_size > 1 {
            out.push(GraphBlocker::MultiRank(self.world_size));
        }
        if self.sharded_optimizer {
            out.push(GraphBlocker::ShardedOptimizer);
        }
        if self.micro_batches > 1 {
            out.push(GraphBlocker::Accumulation(self.micro_batches));
        }
        if self.loss_scaling {
            out.push(GraphBlocker::LossScaling);
        }
        if self.packed_rows {
            out.push(GraphBlocker::PackedRows);
        }
        out
    }
}

/// One reason a step cannot be captured.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GraphBlocker {
    /// Several processes: their collectives run on other streams between the step's kernels.
    MultiRank(usize),
    /// ZeRO's optimizer shard: the host gathers the global gradient norm.
    ShardedOptimizer,
    /// Gradient accumulation over this many micro-batches.
    Accumulation(usize),
    /// fp16 with the GradScaler: the host decides whether the optimizer runs.
    LossScaling,
    /// Packed rows: per-batch position ids.
    PackedRows,
}

impl fmt::Display for GraphBlocker {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            GraphBlocker::MultiRank(n) => write!(
                f,
                "{n} processes (their collectives are not captured, single-GPU runs only)"
            ),
            GraphBlocker::ShardedOptimizer => {
                f.write_str("a ZeRO optimizer shard (the host gathers the global gradient norm)")
            }
            GraphBlocker::Accumulation(n) => write!(
                f,
                "gradient accumulation over {n} micro-batches (the graph holds one forward \
                 and backward)"
            ),
            GraphBlocker::LossScaling => f.write_str(
                "fp16 loss scaling (the GradScaler decides on the host whether the optimizer \
                 step runs)",
            ),
            GraphBlocker::PackedRows => {
                f.write_str("packed rows (their position ids are uploaded per batch)")
            }
        }
    }
}

fn describe(blockers: &[GraphBlocker]) -> String {
    blockers
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join("; ")
}

/// How a step runs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum GraphDecision {
    /// Replayed from a graph (captured first when none matches).
    Graph,
    /// One launch per kernel; `reason` says why when graphs were asked for.
    Eager { reason: Option<String> },
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_three_settings_and_names_them_back() {
        for (text, mode) in [
            ("on", CudaGraphs::On),
            ("OFF", CudaGraphs::Off),
            (" auto ", CudaGraphs::Auto),
        ] {
            let parsed = CudaGraphs::parse(text).unwrap();
            assert_eq!(parsed, mode);
            assert_eq!(CudaGraphs::parse(&parsed.to_string()).unwrap(), mode);
        }
        let err = CudaGraphs::parse("yes").unwrap_err();
        assert!(err.contains("`yes`") && err.contains("auto"), "{err}");
    }

    #[test]
    fn a_single_static_step_is_captured_unless_graphs_are_off() {
        let c = StepConditions::single();
        assert!(c.blockers().is_empty());
        assert_eq!(CudaGraphs::On.decide(&c), Ok(GraphDecision::Graph));
        assert_eq!(CudaGraphs::Auto.decide(&c), Ok(GraphDecision::Graph));
        assert_eq!(
            CudaGraphs::Off.decide(&c),
            Ok(GraphDecision::Eager { reason: None })
        );
    }

    #[test]
    fn each_dynamic_feature_blocks_capture_with_its_own_reason() {
        let cases = [
            (
                StepConditions {
                    world_size: 2,
                    ..StepConditions::single()
                },
                GraphBlocker::MultiRank(2),
                "2 processes",
            ),
            (
                StepConditions {
                    sharded_optimizer: true,
                    ..StepConditions::single()
                },
                GraphBlocker::ShardedOptimizer,
                "ZeRO",
            ),
            (
                StepConditions {
                    micro_batches: 4,
                    ..StepConditions::single()
                },
                GraphBlocker::Accumulation(4),
                "accumulation over 4",
            ),
            (
                StepConditions {
                    loss_scaling: true,
                    ..StepConditions::single()
                },
                GraphBlocker::LossScaling,
                "GradScaler",
            ),
            (
                StepConditions {
                    packed_rows: true,
                    ..StepConditions::single()
                },
                GraphBlocker::PackedRows,
                "packed rows",
            ),
        ];
        for (conditions, blocker, words) in cases {
            assert_eq!(conditions.blockers(), vec![blocker]);
            match CudaGraphs::Auto.decide(&conditions).unwrap() {
                GraphDecision::Eager { reason: Some(r) } => assert!(r.contains(words), "{r}"),
                other => panic!("{conditions:?}: auto gave {other:?}"),
            }
            let err = CudaGraphs::On.decide(&conditions).unwrap_err();
            assert!(
                err.contains(words) && err.contains("--cuda-graphs auto"),
                "{err}"
            );
            assert_eq!(
                CudaGraphs::Off.decide(&conditions),
                Ok(GraphDecision::Eager { reason: None })
            );
        }
    }

    #[test]
    fn several_blockers_are_all_reported_in_a_fixed_order() {
        let c = StepConditions {
            micro_batches: 2,
            world_size: 8,
            loss_scaling: true,
            packed_rows: true,
            sharded_optimizer: true,
        };
        assert_eq!(
            c.blockers(),
            vec![
                GraphBlocker::MultiRank(8),
                GraphBlocker::ShardedOptimizer,
                GraphBlocker::Accumulation(2),
                GraphBlocker::LossScaling,
                GraphBlocker::PackedRows,
            ]
        );
        let Ok(GraphDecision::Eager { reason: Some(r) }) = CudaGraphs::Auto.decide(&c) else {
            panic!("auto must fall back with a reason");
        };
        assert_eq!(r.matches("; ").count(), 4, "{r}");
    }

    #[test]
    fn the_default_is_the_named_constant() {
        assert_eq!(CudaGraphs::default(), DEFAULT_CUDA_GRAPHS);
    }
}
