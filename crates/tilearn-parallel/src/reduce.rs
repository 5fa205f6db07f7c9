//! Reduction operators and the f32 arithmetic the host backend reduces with.

use std::fmt;

/// How a reducing collective combines the ranks' elements.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum ReduceOp {
    Sum,
    /// The sum divided by the group size, folded into the collective (data-parallel gradients).
    Avg,
    /// The sum times a factor, folded into the collective (e.g. 1 / (world × accumulation)).
    ScaledSum(f32),
    Max,
    Min,
}

impl ReduceOp {
    /// Combines `incoming` into `acc` elementwise (the step of a ring or tree reduction).
    pub(crate) fn combine(self, acc: &mut [f32], incoming: &[f32]) {
        debug_assert_eq!(acc.len(), incoming.len());
        match self {
            ReduceOp::Sum | ReduceOp::Avg | ReduceOp::ScaledSum(_) => {
                acc.iter_mut().zip(incoming).for_each(|(a, &b)| *a += b);
            }
            ReduceOp::Max => acc
                .iter_mut()
                .zip(incoming)
                .for_each(|(a, &b)| *a = a.max(b)),
            ReduceOp::Min => acc
                .iter_mut()
                .zip(incoming)
                .for_each(|(a, &b)| *a = a.min(b)),
        }
    }

    /// The factor applied once to the fully reduced value, if any.
    pub(crate) fn final_scale(self, world_size: usize) -> Option<f32> {
        match self {
            ReduceOp::Avg => Some(1.0 / world_size as f32),
            ReduceOp::ScaledSum(s) => Some(s),
            ReduceOp::Sum | ReduceOp::Max | ReduceOp::Min => None,
        }
    }

    /// Applies [`ReduceOp::final_scale`] to a fully reduced chunk.
    pub(crate) fn finish(self, reduced: &mut [f32], world_size: usize) {
        if let Some(scale) = self.final_scale(world_size) {
            reduced.iter_mut().for_each(|x| *x *= scale);
        }
    }

    /// Reduces `inputs` (one slice per rank, in rank order) sequentially in f32: the reference the
    /// property tests compare every backend with.
    pub fn reference(self, inputs: &[Vec<f32>]) -> Vec<f32> {
        let Some((first, rest)) = inputs.split_first() else {
            return Vec::new();
        };
        let mut acc = first.clone();
        for input in rest {
            self.combine(&mut acc, input);
        }
        self.finish(&mut acc, inputs.len());
        acc
    }
}

impl fmt::Display for ReduceOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ReduceOp::Sum => f.write_str("sum"),
            ReduceOp::Avg => f.write_str("avg"),
            ReduceOp::ScaledSum(s) => write!(f, "sum×{s}"),
            ReduceOp::Max => f.write_str("max"),
            ReduceOp::Min => f.write_str("min"),
        }
    }
}
