//! `tilearn plan --schedule`: a pipeline schedule's timeline per stage and its bubble, from the
//! schedule itself (`tilearn_parallel::pipeline`: the actions the executor runs, simulated with
//! a backward costing twice a forward and free transfers).

use tilearn_parallel::pipeline::{Costs, Schedule, ScheduleKind, render_timeline};

use crate::{LlmError, Result};

/// Characters per row of the printed timeline.
const WIDTH: usize = 96;

/// Prints the timeline of `kind` with `stages` stages and `micro_batches` micro-batches, the
/// simulated bubble and the formula's.
pub fn print(kind: ScheduleKind, stages: usize, micro_batches: usize) -> Result<()> {
    let schedule_error = |e: tilearn_parallel::pipeline::ScheduleError| LlmError::Usage {
        flag: "--schedule".into(),
        message: e.to_string(),
    };
    let schedule = Schedule::build(kind, stages, micro_batches).map_err(schedule_error)?;
    let timeline = schedule
        .simulate(&Costs::default())
        .map_err(schedule_error)?;
    println!(
        "{kind}: {stages} stages, {micro_batches} micro-batches (forward 1, backward 2, transfers free)"
    );
    println!("{}", render_timeline(&timeline, WIDTH));
    println!(
        "bubble: simulated {:.4}, formula (p-1)/(m·v) = {:.4}; peak micro-batches in flight per stage: {}",
        timeline.bubble_fraction(),
        schedule.bubble_fraction_formula(),
        (0..stages)
            .map(|s| schedule.peak_in_flight(s).to_string())
            .collect::<Vec<_>>()
            .join(", ")
    );
    Ok(())
}
