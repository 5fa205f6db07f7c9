//! Pipeline-parallel schedules as data: for every stage (pipeline rank), the ordered list of
//! forwards, backwards and batched point-to-point transfers of one training step. Nothing here
//! communicates or computes; the executor runs what [`Schedule::build`] returns.
//!
//! * [`Schedule::build`]: GPipe, 1F1B and Megatron's interleaved 1F1B; every built schedule is
//!   validated.
//! * [`Schedule::validate`]: ordering, pairing and deadlock checks for any schedule, hand-made ones
//!   included.
//! * [`Schedule::simulate`] with [`Costs`] → [`Timeline`] (rendezvous semantics, deadlock
//!   detection), [`render_timeline`] to print it, [`Timeline::bubble_fraction`] to compare with
//!   [`Schedule::bubble_fraction_formula`].
//!
//! See "Pipeline schedules" in docs/ARCHITECTURE.md for the vocabulary, why the placed
//! communication cannot deadlock, and the bubble's definition.

mod build;
mod dataflow;
mod error;
mod gpipe;
mod interleaved;
mod one_f_one_b;
mod pairing;
mod placement;
mod render;
mod schedule;
mod simulate;
mod timeline;
mod validate;

pub use error::{Result, ScheduleError};
pub use render::render_timeline;
pub use schedule::{Action, P2p, P2pKind, Schedule, ScheduleKind};
pub use simulate::Costs;
pub use timeline::{Activity, Span, Timeline};
