//! [`Schedule::build`]: checks the sizes, asks the kind's generator for each stage's compute
//! order, places the communication, and validates the result, so a generator bug is an error
//! here and never a hang in the executor.

use super::dataflow::Shape;
use super::error::{Result, ScheduleError};
use super::schedule::{Schedule, ScheduleKind};
use super::{gpipe, interleaved, one_f_one_b, placement};

impl Schedule {
    /// The `kind` schedule for `stages` pipeline ranks and `micro_batches` micro-batches per step
    /// (= gradient accumulation steps). Interleaving needs `micro_batches` to be a multiple of
    /// `stages` (as Megatron does) and at least 1 virtual stage.
    pub fn build(kind: ScheduleKind, stages: usize, micro_batches: usize) -> Result<Schedule> {
        // The sizes are checked before anything is allocated for them.
        let shape: Shape = Schedule::checked_sizes(kind, stages, micro_batches)?;
        let steps = match kind {
            ScheduleKind::GPipe => gpipe::steps(stages, micro_batches),
            ScheduleKind::OneFOneB => one_f_one_b::steps(stages, micro_batches),
            ScheduleKind::Interleaved { virtual_stages } => {
                if !micro_batches.is_multiple_of(stages) {
                    let below = micro_batches / stages * stages;
                    let above = below + stages;
                    let nearest = if below == 0 {
                        format!("{above}")
                    } else {
                        format!("{below} or {above}")
                    };
                    return Err(ScheduleError::Config {
                        field: "micro_batches",
                        value: micro_batches.to_string(),
                        reason: format!(
                            "interleaved 1F1B runs micro-batches in groups of the {stages} \
                             stages, so it needs a multiple of {stages} (as Megatron does): use \
                             {nearest}"
                        ),
                    });
                }
                interleaved::steps(stages, micro_batches, virtual_stages)
            }
        };
        let schedule = Schedule {
            kind,
            stages,
            micro_batches,
            actions: placement::place(shape, &steps)?,
        };
        schedule.validate()?;
        Ok(schedule)
    }
}
