//! What can be wrong with a schedule: a shape that cannot be built, an action out of place, sends
//! and receives that do not pair up, or a program that deadlocks.

/// Everything that can fail in [`super`].
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ScheduleError {
    /// A size or cost that cannot make a schedule.
    #[error("{field} = {value}: {reason}")]
    Config {
        field: &'static str,
        value: String,
        reason: String,
    },
    /// One action of one stage is out of place (used before it exists, repeated, misaddressed).
    #[error("stage {stage}, action {action}: {reason}")]
    Invalid {
        stage: usize,
        action: usize,
        reason: String,
    },
    /// A stage's program ends with work missing.
    #[error("stage {stage} ends without {missing}")]
    Incomplete { stage: usize, missing: String },
    /// Sends and receives of a link that do not pair up, in number or in order.
    #[error("link stage {from} -> stage {to}: {reason}")]
    Unpaired {
        from: usize,
        to: usize,
        reason: String,
    },
    /// No stage can move: each waits on a partner that has not posted its side.
    #[error("deadlock: {0}")]
    Deadlock(String),
}

/// The result type of [`super`].
pub type Result<T> = std::result::Result<T, ScheduleError>;
