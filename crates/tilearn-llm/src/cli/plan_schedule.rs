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
    print!("{}", render_timeline(&timeline, WIDTH));
    let in_flight: Vec<String> = (0..stages)
        .map(|s| schedule.peak_in_flight(s).to_string())
        .collect();
    println!(
        "activation sets (micro-batch, chunk) held at the peak, per stage: {} (forward 1, backward 2, \
         transfers free)",
        in_flight.join(", ")
    );
    Ok(())
}
