//! The executor of a pipeline schedule for an engine whose stage keeps one micro-batch's
//! activations at a time (the CUDA engine's one arena): it runs this stage's actions of a
//! [`Schedule`] (one model chunk per stage) and keeps, per micro-batch in flight, only the
//! stage's *input*; a backward that does not directly follow its own forward first recomputes
//! that forward (stage-granular activation checkpointing, see "Pipeline parallelism on the GPU
//! engine" in `docs/ARCHITECTURE.md`).
//!
//! Tensors between stages are kept by micro-batch: a forward's output waits in the outbox until
//! its `Comm` sends it, a received activation in the inbox until the backward that consumes it
//! last (its forward reads it first), a received gradient until its backward. Boundary buffers
//! come from a pool that keeps what a step used, so a steady run allocates nothing.
//!
//! The compute and the transfers are the [`StageCompute`]'s: device buffers through
//! [`tilearn_parallel::Communicator::batch_p2p`] on the GPU, host vectors in this file's tests.

use std::collections::HashMap;

use tilearn_parallel::pipeline::{Action, P2p, P2pKind, Schedule, ScheduleKind};

use crate::{EngineError, Result};

/// One pipeline stage's compute, as the executor drives it. Every call gets the micro-batch
/// index (the compute holds the step's batches).
pub trait StageCompute {
    /// Activations (or their gradients) between two stages.
    type Buffer;
    /// Whether this stage embeds the tokens (has no input from another stage).
    fn first(&self) -> bool;
    /// Whether this stage computes the loss (has no output to another stage).
    fn last(&self) -> bool;
    /// A new boundary buffer (large enough for any micro-batch of the run).
    fn buffer(&mut self) -> Result<Self::Buffer>;
    /// The forward of micro-batch `mb` (from `input` unless first); unless last, its output
    /// into `output`, which is `None` when the forward is a recomputation.
    fn forward(
        &mut self,
        mb: usize,
        input: Option<&Self::Buffer>,
        output: Option<&mut Self::Buffer>,
    ) -> Result<()>;
    /// The backward of micro-batch `mb`, whose forward was the stage's last call: from `dout`
    /// unless last, its input gradient into `din` unless first. Returns the micro-batch's loss
    /// sum on the last stage.
    fn backward(
        &mut self,
        mb: usize,
        dout: Option<&Self::Buffer>,
        din: Option<&mut Self::Buffer>,
    ) -> Result<Option<f64>>;
    /// Runs one batch of transfers together: each send reads, each receive writes, its buffer
    /// (the micro-batch's size of it).
    fn exchange(&mut self, transfers: &mut [(P2p, &mut Self::Buffer)]) -> Result<()>;
}

fn schedule_error(message: String) -> EngineError {
    EngineError::InvalidArgument {
        argument: "--pp-schedule".into(),
        message,
    }
}

/// Stage `stage`'s actions of `kind` for `stages` stages and `micro_batches` micro-batches
/// (the gradient accumulation steps), one model chunk per stage.
pub fn stage_actions(
    kind: ScheduleKind,
    stage: usize,
    stages: usize,
    micro_batches: usize,
) -> Result<Vec<Action>> {
    if let ScheduleKind::Interleaved { .. } = kind {
        return Err(schedule_error(
            "interleaved runs on the CPU engine only so far; use 1f1b or gpipe, or --device cpu"
                .into(),
        ));
    }
    let schedule = Schedule::build(kind, stages, micro_batches).map_err(|e| {
        schedule_error(format!("{e} (gradient accumulation steps = micro-batches)"))
    })?;
    schedule
        .actions
        .into_iter()
        .nth(stage)
        .ok_or_else(|| schedule_error(format!("stage {stage} of a {stages}-stage schedule")))
}

/// Which micro-batch's forward the stage's activation store holds: a backward of another (or
/// of none: a backward leaves the store stale) must recompute the forward first.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ArenaHolds(Option<usize>);

impl ArenaHolds {
    /// A forward of `mb` ran.
    pub fn forward(&mut self, mb: usize) {
        self.0 = Some(mb);
    }

    /// The backward of `mb` is next: whether its forward must run again first. Afterwards the
    /// store holds no micro-batch's forward (the backward reuses parts of it, and a
    /// recomputing backward leaves other blocks' values behind).
    pub fn backward(&mut self, mb: usize) -> bool {
        let recompute = self.0 != Some(mb);
        self.0 = None;
        recompute
    }
}

/// How many of `actions`' backwards recompute their forward (for reports and tests).
pub fn recomputed_forwards(actions: &[Action]) -> usize {
    let mut holds = ArenaHolds::default();
    let mut count = 0;
    for action in actions {
        match action {
            Action::Forward { micro_batch, .. } => holds.forward(*micro_batch),
            Action::Backward { micro_batch, .. } => {
                count += usize::from(holds.backward(*micro_batch))
            }
            Action::Comm(_) => {}
        }
    }
    count
}

fn missing(what: &str, mb: usize) -> EngineError {
    schedule_error(format!(
        "the schedule reached the {what} of micro-batch {mb} before its input arrived; this is \
         a bug in the schedule"
    ))
}

/// Runs one training step's `actions` on `stage`; returns the loss sum of this stage's
/// micro-batches (non-zero on the last stage only), and leaves the step's boundary buffers in
/// `pool`.
pub fn run_actions<S: StageCompute>(
    stage: &mut S,
    actions: &[Action],
    pool: &mut Vec<S::Buffer>,
) -> Result<f64> {
    let (first, last) = (stage.first(), stage.last());
    fn take<S: StageCompute>(pool: &mut Vec<S::Buffer>, stage: &mut S) -> Result<S::Buffer> {
        match pool.pop() {
            Some(b) => Ok(b),
            None => stage.buffer(),
        }
    }
    let mut inputs: HashMap<usize, S::Buffer> = HashMap::new();
    let mut grads_in: HashMap<usize, S::Buffer> = HashMap::new();
    let mut outbox_act: HashMap<usize, S::Buffer> = HashMap::new();
    let mut outbox_grad: HashMap<usize, S::Buffer> = HashMap::new();
    let mut holds = ArenaHolds::default();
    let mut loss_sum = 0.0;
    for action in actions {
        match action {
            Action::Forward {
                micro_batch: mb, ..
            } => {
                let mb = *mb;
                let input = if first {
                    None
                } else {
                    Some(inputs.get(&mb).ok_or_else(|| missing("forward", mb))?)
                };
                let mut output = if last { None } else { Some(take(pool, stage)?) };
                stage.forward(mb, input, output.as_mut())?;
                holds.forward(mb);
                if let Some(out) = output {
                    outbox_act.insert(mb, out);
                }
            }
            Action::Backward {
                micro_batch: mb, ..
            } => {
                let mb = *mb;
                let input = if first {
                    None
                } else {
                    Some(inputs.remove(&mb).ok_or_else(|| missing("backward", mb))?)
                };
                let dout = if last {
                    None
                } else {
                    Some(
                        grads_in
                            .remove(&mb)
                            .ok_or_else(|| missing("backward", mb))?,
                    )
                };
                if holds.backward(mb) {
                    stage.forward(mb, input.as_ref(), None)?;
                }
                let mut din = if first {
                    None
                } else {
                    Some(take(pool, stage)?)
                };
                if let Some(loss) = stage.backward(mb, dout.as_ref(), din.as_mut())? {
                    loss_sum += loss;
                }
                pool.extend(input);
                pool.extend(dout);
                if let Some(d) = din {
                    outbox_grad.insert(mb, d);
                }
            }
            Action::Comm(ops) => {
                let mut buffers = Vec::with_capacity(ops.len());
                for op in ops {
                    let mb = op.micro_batch;
                    buffers.push(match op.kind {
                        P2pKind::SendActivation => {
                            outbox_act.remove(&mb).ok_or_else(|| missing("send", mb))?
                        }
                        P2pKind::SendGradient => {
                            outbox_grad.remove(&mb).ok_or_else(|| missing("send", mb))?
                        }
                        P2pKind::RecvActivation | P2pKind::RecvGradient => take(pool, stage)?,
                    });
                }
                {
                    let mut transfers: Vec<(P2p, &mut S::Buffer)> =
                        ops.iter().copied().zip(buffers.iter_mut()).collect();
                    stage.exchange(&mut transfers)?;
                }
                for (op, buf) in ops.iter().zip(buffers) {
                    match op.kind {
                        P2pKind::SendActivation | P2pKind::SendGradient => pool.push(buf),
                        P2pKind::RecvActivation => {
                            inputs.insert(op.micro_batch, buf);
                        }
                        P2pKind::RecvGradient => {
                            grads_in.insert(op.micro_batch, buf);
                        }
                    }
                }
            }
        }
    }
    let left = inputs.len() + grads_in.len() + outbox_act.len() + outbox_grad.len();
    if left > 0 {
        return Err(schedule_error(format!(
            "internal: {left} boundary tensors were never consumed or sent; this is a bug in \
             the schedule"
        )));
    }
    Ok(loss_sum)
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use tilearn_parallel::buffer::{HostSlice, HostSliceMut};
    use tilearn_parallel::host::{HostCommunicator, run_on_threads};
    use tilearn_parallel::{Communicator, P2pOp};

    use super::*;

    #[test]
    fn one_f_one_b_recomputes_everywhere_but_on_the_last_stage() {
        for p in 2..=4 {
            for m in [1, 2, 4, 7] {
                for s in 0..p {
                    // The last stage runs each backward right after its forward; the others
                    // run another micro-batch's forward (or a backward) in between, except
                    // with a single micro-batch (forward, transfers, backward).
                    let actions = stage_actions(ScheduleKind::OneFOneB, s, p, m).unwrap();
                    let want = if s + 1 == p || m == 1 { 0 } else { m };
                    assert_eq!(recomputed_forwards(&actions), want, "p {p} m {m} stage {s}");
                    // GPipe runs every backward after all forwards, in micro-batch order.
                    let gpipe = stage_actions(ScheduleKind::GPipe, s, p, m).unwrap();
                    let want = if m == 1 { 0 } else { m };
                    assert_eq!(
                        recomputed_forwards(&gpipe),
                        want,
                        "gpipe p {p} m {m} stage {s}"
                    );
                }
            }
        }
    }

    #[test]
    fn the_tracker_forgets_after_a_backward() {
        let mut h = ArenaHolds::default();
        assert!(h.backward(0));
        h.forward(3);
        assert!(h.backward(2));
        h.forward(2);
        assert!(!h.backward(2));
        assert!(h.backward(2), "a backward leaves the store stale");
    }

    #[test]
    fn interleaving_is_refused_with_the_way_out() {
        let err = stage_actions(ScheduleKind::Interleaved { virtual_stages: 2 }, 0, 2, 4)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("1f1b") && err.contains("--pp-schedule"),
            "{err}"
        );
    }

    /// A toy pipeline: stage s multiplies its input vector by `w[s]`; the last stage's loss is
    /// the dot product of its output with the micro-batch's target. Its "arena" holds the last
    /// forward's input and is checked by every backward, so a missed recomputation fails.
    struct Toy<'c> {
        stage: usize,
        stages: usize,
        w: f32,
        inputs: Vec<Vec<f32>>,
        targets: Vec<Vec<f32>>,
        arena: Option<(usize, Vec<f32>)>,
        grad: f32,
        comm: &'c dyn Communicator,
        forwards: usize,
    }

    const LEN: usize = 5;

    impl StageCompute for Toy<'_> {
        type Buffer = Vec<f32>;

        fn first(&self) -> bool {
            self.stage == 0
        }

        fn last(&self) -> bool {
            self.stage + 1 == self.stages
        }

        fn buffer(&mut self) -> Result<Vec<f32>> {
            Ok(vec![f32::NAN; LEN])
        }

        fn forward(
            &mut self,
            mb: usize,
            input: Option<&Vec<f32>>,
            output: Option<&mut Vec<f32>>,
        ) -> Result<()> {
            let x = match input {
                Some(x) => x.clone(),
                None => self.inputs[mb].clone(),
            };
            assert!(
                x.iter().all(|v| v.is_finite()),
                "stage {} read garbage",
                self.stage
            );
            if let Some(out) = output {
                for (o, v) in out.iter_mut().zip(&x) {
                    *o = v * self.w;
                }
            }
            self.forwards += 1;
            self.arena = Some((mb, x));
            Ok(())
        }

        fn backward(
            &mut self,
            mb: usize,
            dout: Option<&Vec<f32>>,
            din: Option<&mut Vec<f32>>,
        ) -> Result<Option<f64>> {
            let (held, x) = self.arena.take().expect("the forward is in the arena");
            assert_eq!(
                held, mb,
                "stage {} backward of another micro-batch",
                self.stage
            );
            let dy = match dout {
                Some(d) => d.clone(),
                None => self.targets[mb].clone(),
            };
            self.grad += dy.iter().zip(&x).map(|(d, v)| d * v).sum::<f32>();
            if let Some(din) = din {
                for (g, d) in din.iter_mut().zip(&dy) {
                    *g = d * self.w;
                }
            }
            Ok(self.last().then(|| {
                x.iter()
                    .zip(&dy)
                    .map(|(v, t)| f64::from(v * self.w * t))
                    .sum()
            }))
        }

        fn exchange(&mut self, transfers: &mut [(P2p, &mut Vec<f32>)]) -> Result<()> {
            let mut ops: Vec<P2pOp<'_>> = transfers
                .iter_mut()
                .map(|(op, buf)| {
                    if op.kind.is_send() {
                        P2pOp::Send {
                            buf: HostSlice::F32(buf),
                            peer: op.peer_stage,
                        }
                    } else {
                        P2pOp::Recv {
                            buf: HostSliceMut::F32(buf),
                            peer: op.peer_stage,
                        }
                    }
                })
                .collect();
            self.comm.batch_p2p(&mut ops)?;
            Ok(())
        }
    }

    fn data(m: usize) -> (Vec<Vec<f32>>, Vec<Vec<f32>>) {
        let v = |mb: usize, k: f32| -> Vec<f32> {
            (0..LEN).map(|i| (mb * LEN + i) as f32 * 0.25 - k).collect()
        };
        (
            (0..m).map(|mb| v(mb, 1.0)).collect(),
            (0..m).map(|mb| v(mb, 2.5)).collect(),
        )
    }

    /// (loss, gradient of every w) of the whole toy model, micro-batch by micro-batch.
    fn sequential(ws: &[f32], m: usize) -> (f64, Vec<f32>) {
        let (inputs, targets) = data(m);
        let mut grads = vec![0f32; ws.len()];
        let mut loss = 0.0;
        for mb in 0..m {
            let mut acts = vec![inputs[mb].clone()];
            for w in ws {
                let next = acts.last().unwrap().iter().map(|v| v * w).collect();
                acts.push(next);
            }
            let out = acts.last().unwrap();
            loss += out
                .iter()
                .zip(&targets[mb])
                .map(|(o, t)| f64::from(o * t))
                .sum::<f64>();
            let mut dy = targets[mb].clone();
            for s in (0..ws.len()).rev() {
                grads[s] += dy.iter().zip(&acts[s]).map(|(d, v)| d * v).sum::<f32>();
                dy = dy.iter().map(|d| d * ws[s]).collect();
            }
        }
        (loss, grads)
    }

    #[test]
    fn the_executor_trains_the_toy_pipeline_as_one_process() {
        let ws = [1.5f32, -0.75, 2.0];
        for kind in [ScheduleKind::OneFOneB, ScheduleKind::GPipe] {
            for p in [2usize, 3] {
                for m in [1usize, 3, 4, 5] {
                    let (want_loss, want_grads) = sequential(&ws[..p], m);
                    let results = run_on_threads(
                        p,
                        Duration::from_secs(30),
                        |stage, comm: HostCommunicator| {
                            let (inputs, targets) = data(m);
                            let mut toy = Toy {
                                stage,
                                stages: p,
                                w: ws[stage],
                                inputs,
                                targets,
                                arena: None,
                                grad: 0.0,
                                comm: &comm,
                                forwards: 0,
                            };
                            let actions = stage_actions(kind, stage, p, m).unwrap();
                            let mut pool = Vec::new();
                            // Two steps: the second reuses the first's buffers.
                            let mut loss = 0.0;
                            for _ in 0..2 {
                                toy.grad = 0.0;
                                loss = run_actions(&mut toy, &actions, &mut pool).unwrap();
                            }
                            let peak = Schedule::build(kind, p, m).unwrap().peak_in_flight(stage);
                            assert!(
                                pool.len() <= 2 * peak + 2,
                                "{kind} stage {stage}: {} buffers kept",
                                pool.len()
                            );
                            let recomputed = recomputed_forwards(&actions);
                            assert_eq!(toy.forwards, 2 * (m + recomputed), "{kind} stage {stage}");
                            (loss, toy.grad)
                        },
                    )
                    .unwrap();
                    let what = format!("{kind} p {p} m {m}");
                    let loss: f64 = results.iter().map(|r| r.0).sum();
                    assert!(
                        (loss - want_loss).abs() <= 1e-9 * want_loss.abs().max(1.0),
                        "{what}: loss {loss} vs {want_loss}"
                    );
                    for (s, r) in results.iter().enumerate() {
                        if s + 1 < p {
                            assert_eq!(r.0, 0.0, "{what}: only the last stage has a loss");
                        }
                        // GPipe's backwards may run in another order than the sequential sum.
                        let tol = 1e-5 * want_grads[s].abs().max(1.0);
                        assert!(
                            (r.1 - want_grads[s]).abs() <= tol,
                            "{what}: gradient of stage {s}: {} vs {}",
                            r.1,
                            want_grads[s]
                        );
                    }
                }
            }
        }
    }
}
