//! What a policy is told at each decision.

/// What the trainer knows at a decision: the learning rate of the period about to run and the
/// loss of the previous period (the seed's `lr` and `loss` arguments).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Signals {
    pub lr: Option<f64>,
    pub loss: Option<f64>,
}
