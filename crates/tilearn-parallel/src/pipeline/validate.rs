//! The checks an executor relies on before it runs a schedule: on every stage each forward and
//! backward runs exactly once, a backward after its forward, every compute after its input has
//! arrived (received, or produced earlier on the same stage), every output sent once to the right
//! stage after it exists; sends and receives pair up in the same order on both ends of each link;
//! and the program cannot deadlock (a replay in simulated time finishes).

use super::dataflow::{Compute, Pass, Shape};
use super::error::{Result, ScheduleError};
use super::pairing;
use super::schedule::{Action, P2p, P2pKind, Schedule};
use super::simulate::Costs;

/// What has happened so far to each (chunk, micro-batch) of one stage.
struct Progress {
    shape: Shape,
    forward: Vec<bool>,
    backward: Vec<bool>,
    activation_in: Vec<bool>,
    gradient_in: Vec<bool>,
    activation_out: Vec<bool>,
    gradient_out: Vec<bool>,
}

impl Progress {
    fn new(shape: Shape) -> Self {
        let n = shape.chunks * shape.micro_batches;
        Progress {
            shape,
            forward: vec![false; n],
            backward: vec![false; n],
            activation_in: vec![false; n],
            gradient_in: vec![false; n],
            activation_out: vec![false; n],
            gradient_out: vec![false; n],
        }
    }

    fn index(&self, micro_batch: usize, chunk: usize) -> usize {
        chunk * self.shape.micro_batches + micro_batch
    }

    fn done(&self, compute: Compute) -> bool {
        let i = self.index(compute.micro_batch, compute.chunk);
        match compute.pass {
            Pass::Forward => self.forward[i],
            Pass::Backward => self.backward[i],
        }
    }
}

impl Schedule {
    /// Checks everything an executor relies on (see the module comment); the first problem found
    /// is returned with the stage, the action index and what is wrong.
    pub fn validate(&self) -> Result<()> {
        let shape = self.checked_shape()?;
        for (stage, program) in self.actions.iter().enumerate() {
            check_stage(shape, stage, program)?;
        }
        pairing::pair(shape, &self.actions)?;
        self.simulate(&Costs::default()).map(|_| ())
    }
}

fn invalid(stage: usize, action: usize, reason: String) -> ScheduleError {
    ScheduleError::Invalid {
        stage,
        action,
        reason,
    }
}

/// Whether `micro_batch` and `chunk` exist, as an error naming the sizes when not.
fn in_range(shape: Shape, micro_batch: usize, chunk: usize) -> std::result::Result<(), String> {
    if micro_batch >= shape.micro_batches {
        return Err(format!(
            "micro-batch {micro_batch} does not exist (the schedule has {})",
            shape.micro_batches
        ));
    }
    if chunk >= shape.chunks {
        return Err(format!(
            "chunk {chunk} does not exist (each stage has {})",
            shape.chunks
        ));
    }
    Ok(())
}

fn check_stage(shape: Shape, stage: usize, program: &[Action]) -> Result<()> {
    let mut progress = Progress::new(shape);
    for (index, action) in program.iter().enumerate() {
        let fail = |reason: String| invalid(stage, index, reason);
        if let Some(compute) = Compute::of(action) {
            check_compute(shape, stage, compute, &mut progress)
                .map_err(|r| fail(format!("{action}: {r}")))?;
        } else if let Action::Comm(ops) = action {
            if ops.is_empty() {
                return Err(fail("empty communication batch".into()));
            }
            for op in ops {
                check_p2p(shape, stage, op, &mut progress)
                    .map_err(|r| fail(format!("{op}: {r}")))?;
            }
        }
    }
    for chunk in 0..shape.chunks {
        for micro_batch in 0..shape.micro_batches {
            let i = progress.index(micro_batch, chunk);
            let missing = |what: &str| ScheduleError::Incomplete {
                stage,
                missing: format!("{what} of micro-batch {micro_batch} chunk {chunk}"),
            };
            if !progress.forward[i] {
                return Err(missing("the forward"));
            }
            if !progress.backward[i] {
                return Err(missing("the backward"));
            }
            for (kind, sent, what) in [
                (
                    P2pKind::SendActivation,
                    progress.activation_out[i],
                    "sending the activation",
                ),
                (
                    P2pKind::SendGradient,
                    progress.gradient_out[i],
                    "sending the gradient",
                ),
            ] {
                let remote = shape
                    .partner(stage, chunk, kind)
                    .filter(|to| to.stage != stage);
                if let (Some(to), false) = (remote, sent) {
                    return Err(missing(&format!("{what} (to stage {})", to.stage)));
                }
            }
        }
    }
    Ok(())
}

fn check_compute(
    shape: Shape,
    stage: usize,
    compute: Compute,
    progress: &mut Progress,
) -> std::result::Result<(), String> {
    in_range(shape, compute.micro_batch, compute.chunk)?;
    if progress.done(compute) {
        return Err("runs a second time".into());
    }
    let i = progress.index(compute.micro_batch, compute.chunk);
    if compute.pass == Pass::Backward && !progress.forward[i] {
        return Err("runs before its forward".into());
    }
    match shape.input_of(stage, compute) {
        Some((from, input)) if from == stage && !progress.done(input) => {
            return Err(format!(
                "runs before {} on this stage, which produces its input",
                input.to_action()
            ));
        }
        Some((from, _)) if from != stage => {
            let (arrived, what) = match compute.pass {
                Pass::Forward => (progress.activation_in[i], "activation"),
                Pass::Backward => (progress.gradient_in[i], "gradient"),
            };
            if !arrived {
                return Err(format!(
                    "runs before its {what} from stage {from} is received"
                ));
            }
        }
        _ => {}
    }
    match compute.pass {
        Pass::Forward => progress.forward[i] = true,
        Pass::Backward => progress.backward[i] = true,
    }
    Ok(())
}

fn check_p2p(
    shape: Shape,
    stage: usize,
    op: &P2p,
    progress: &mut Progress,
) -> std::result::Result<(), String> {
    in_range(shape, op.micro_batch, op.chunk)?;
    let global = shape.global(stage, op.chunk);
    let Some(peer) = shape.partner(stage, op.chunk, op.kind) else {
        let position = if global == 0 { "first" } else { "last" };
        return Err(format!(
            "global chunk {global} is the model's {position}: this tensor does not exist"
        ));
    };
    if peer.stage == stage {
        return Err(format!(
            "the other end (chunk {}) is on this stage: the tensor stays local, no message",
            peer.chunk
        ));
    }
    if peer.stage != op.peer_stage {
        return Err(format!(
            "the other end is stage {} (global chunk {}), not stage {}",
            peer.stage,
            shape.global(peer.stage, peer.chunk),
            op.peer_stage
        ));
    }
    let i = progress.index(op.micro_batch, op.chunk);
    let (flag, produced) = match op.kind {
        P2pKind::SendActivation => (&mut progress.activation_out, Some(progress.forward[i])),
        P2pKind::SendGradient => (&mut progress.gradient_out, Some(progress.backward[i])),
        P2pKind::RecvActivation => (&mut progress.activation_in, None),
        P2pKind::RecvGradient => (&mut progress.gradient_in, None),
    };
    if produced == Some(false) {
        return Err("sends a tensor its compute has not produced yet".into());
    }
    if flag[i] {
        return Err("a second time".into());
    }
    flag[i] = true;
    Ok(())
}
