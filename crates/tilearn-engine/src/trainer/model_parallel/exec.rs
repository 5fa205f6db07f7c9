//! The pipeline executor: runs this stage's actions of a [`Schedule`] (forwards, backwards and
//! batched transfers) over the step's micro-batches, and the forward-only pass of evaluation.
//!
//! Tensors between chunks are kept by (micro-batch, local chunk): a forward's output waits in
//! the outbox until its `Comm` sends it, a received activation in the inbox until its forward
//! takes it (gradients likewise). With one stage (interleaved chunks on one rank) a chunk's
//! output goes straight to the next chunk's inbox.

use std::collections::HashMap;

use tilearn_ops::DType;
use tilearn_parallel::buffer::{HostSlice, HostSliceMut};
use tilearn_parallel::pipeline::{Action, P2p, P2pKind, Schedule};
use tilearn_parallel::{Communicator, P2pOp, scalars};

use super::ModelParallelCpuBackend;
use crate::data::Batch;
use crate::model::{Activations, LossStats};
use crate::{EngineError, Result};

type Tensors = HashMap<(usize, usize), Vec<f32>>;

fn schedule_error(message: String) -> EngineError {
    EngineError::InvalidArgument {
        argument: "--pp-schedule".into(),
        message,
    }
}

/// This stage's actions for `micro_batches`: the schedule's, or forward then backward of each
/// micro-batch when the model is in one piece on this rank.
fn actions(b: &ModelParallelCpuBackend, micro_batches: usize) -> Result<Vec<Action>> {
    if !b.is_pipelined() {
        return Ok((0..micro_batches)
            .flat_map(|mb| {
                [
                    Action::Forward {
                        micro_batch: mb,
                        chunk: 0,
                    },
                    Action::Backward {
                        micro_batch: mb,
                        chunk: 0,
                    },
                ]
            })
            .collect());
    }
    let pipe = &b.layout.pipe;
    let schedule = Schedule::build(b.layout.schedule, pipe.stages, micro_batches).map_err(|e| {
        schedule_error(format!("{e} (gradient accumulation steps = micro-batches)"))
    })?;
    if schedule.model_chunks() != pipe.chunks {
        return Err(schedule_error(format!(
            "the {} schedule runs {} chunks per stage but the model was cut into {}",
            b.layout.schedule,
            schedule.model_chunks(),
            pipe.chunks
        )));
    }
    Ok(schedule.actions[pipe.stage].clone())
}

fn missing(what: &str, mb: usize, chunk: usize) -> EngineError {
    schedule_error(format!(
        "the schedule reached the {what} of micro-batch {mb} chunk {chunk} before its input \
         arrived; this is a bug in the schedule"
    ))
}

/// One training step's forwards and backwards over `batches`; returns the step's loss sum
/// (summed over the stages, so every rank gets it).
pub(super) fn run_step(
    b: &mut ModelParallelCpuBackend,
    batches: &[Batch],
    denominator: f64,
    precision: DType,
    loss_scale: f32,
) -> Result<f64> {
    // The gradients of loss_sum · loss_scale / denominator.
    let grad_scale = if denominator > 0.0 {
        loss_scale as f64 / denominator
    } else {
        0.0
    };
    b.round_working(precision);
    let partial_before = b.partial_snapshot();
    let stages = b.layout.pipe.stages;
    let (mut inbox_act, mut inbox_grad) = (Tensors::new(), Tensors::new());
    let (mut outbox_act, mut outbox_grad) = (Tensors::new(), Tensors::new());
    let mut live = HashMap::new();
    let mut loss_sum = 0.0;
    for action in actions(b, batches.len())? {
        match action {
            Action::Forward {
                micro_batch: mb,
                chunk,
            } => {
                let batch = &batches[mb];
                let rows = batch.batch * batch.seq_len;
                let input = if b.model.starts_model(chunk) {
                    None
                } else {
                    Some(
                        inbox_act
                            .remove(&(mb, chunk))
                            .ok_or_else(|| missing("forward", mb, chunk))?,
                    )
                };
                let acts = forward_chunk(b, chunk, batch, input.as_deref(), precision)?;
                if !b.model.ends_model(chunk) {
                    let out = b.model.output(chunk, &acts, rows).to_vec();
                    if stages == 1 {
                        inbox_act.insert((mb, chunk + 1), out);
                    } else {
                        outbox_act.insert((mb, chunk), out);
                    }
                }
                live.insert((mb, chunk), acts);
            }
            Action::Backward {
                micro_batch: mb,
                chunk,
            } => {
                let batch = &batches[mb];
                let rows = batch.batch * batch.seq_len;
                let mut acts = live
                    .remove(&(mb, chunk))
                    .ok_or_else(|| missing("backward", mb, chunk))?;
                let dout = if b.model.ends_model(chunk) {
                    None
                } else {
                    Some(
                        inbox_grad
                            .remove(&(mb, chunk))
                            .ok_or_else(|| missing("backward", mb, chunk))?,
                    )
                };
                let params = if precision == DType::F32 {
                    &b.model.params.data
                } else {
                    &b.working
                };
                let loss = b.model.backward(
                    chunk,
                    params,
                    &mut b.grads,
                    &batch.input_ids,
                    (batch.batch, batch.seq_len),
                    dout.as_deref(),
                    grad_scale,
                    &mut acts,
                    b.sums.as_ref(),
                )?;
                if let Some(loss) = loss {
                    loss_sum += loss.loss_sum;
                }
                if !b.model.starts_model(chunk) {
                    let grad = b.model.input_grad(&acts, rows).to_vec();
                    if stages == 1 {
                        inbox_grad.insert((mb, chunk - 1), grad);
                    } else {
                        outbox_grad.insert((mb, chunk), grad);
                    }
                }
                b.pool[chunk].push(acts);
            }
            Action::Comm(ops) => {
                let pp = b.comms.pp.as_deref().expect("a pipeline of several stages");
                let model = &b.model;
                let slab = |mb: usize| model.boundary_len(batches[mb].batch * batches[mb].seq_len);
                let mut boxes = Boxes {
                    outbox_act: &mut outbox_act,
                    outbox_grad: &mut outbox_grad,
                    inbox_act: &mut inbox_act,
                    inbox_grad: &mut inbox_grad,
                };
                exchange(pp, &ops, slab, &mut boxes)?;
            }
        }
    }
    b.sum_partial_gradients(&partial_before)?;
    if precision == DType::F16 {
        for g in &mut b.grads {
            *g = half::f16::from_f32(*g).to_f32();
        }
    }
    // Only the last stage computed the loss.
    match &b.comms.pp {
        Some(pp) => Ok(scalars::sum_f64(pp.as_ref(), loss_sum)?),
        None => Ok(loss_sum),
    }
}

/// The forward of `batch` through local chunk `chunk` (from `input` unless the chunk embeds the
/// tokens), in an activation arena from the chunk's pool.
fn forward_chunk(
    b: &mut ModelParallelCpuBackend,
    chunk: usize,
    batch: &Batch,
    input: Option<&[f32]>,
    precision: DType,
) -> Result<Activations<f32>> {
    let mut acts = b.pool[chunk]
        .pop()
        .unwrap_or_else(|| b.model.activations(chunk, b.batch, b.seq, b.recompute));
    let params = if precision == DType::F32 {
        &b.model.params.data
    } else {
        &b.working
    };
    acts.set_position_ids(batch.positions.as_deref(), batch.batch, batch.seq_len)?;
    b.model.forward(
        chunk,
        params,
        &batch.input_ids,
        &batch.labels,
        (batch.batch, batch.seq_len),
        input,
        &mut acts,
        b.sums.as_ref(),
    )?;
    Ok(acts)
}

struct Boxes<'a> {
    outbox_act: &'a mut Tensors,
    outbox_grad: &'a mut Tensors,
    inbox_act: &'a mut Tensors,
    inbox_grad: &'a mut Tensors,
}

/// Runs one `Comm` batch: the listed sends take their tensors out of the outboxes, the receives
/// land in the inboxes.
fn exchange(
    pp: &dyn Communicator,
    ops: &[P2p],
    slab: impl Fn(usize) -> usize,
    boxes: &mut Boxes<'_>,
) -> Result<()> {
    let mut sends = Vec::new();
    let mut recvs = Vec::new();
    for op in ops {
        let key = (op.micro_batch, op.chunk);
        match op.kind {
            P2pKind::SendActivation | P2pKind::SendGradient => {
                let outbox = if op.kind == P2pKind::SendActivation {
                    &mut *boxes.outbox_act
                } else {
                    &mut *boxes.outbox_grad
                };
                let tensor = outbox
                    .remove(&key)
                    .ok_or_else(|| missing("send", op.micro_batch, op.chunk))?;
                sends.push(tensor);
            }
            P2pKind::RecvActivation | P2pKind::RecvGradient => {
                recvs.push(vec![0f32; slab(op.micro_batch)]);
            }
        }
    }
    {
        let (mut send_iter, mut recv_iter) = (sends.iter(), recvs.iter_mut());
        let mut batch: Vec<P2pOp<'_>> = ops
            .iter()
            .map(|op| {
                if op.kind.is_send() {
                    P2pOp::Send {
                        buf: HostSlice::F32(send_iter.next().expect("one tensor per send")),
                        peer: op.peer_stage,
                    }
                } else {
                    P2pOp::Recv {
                        buf: HostSliceMut::F32(recv_iter.next().expect("one buffer per receive")),
                        peer: op.peer_stage,
                    }
                }
            })
            .collect();
        pp.batch_p2p(&mut batch)?;
    }
    let mut received = recvs.into_iter();
    for op in ops.iter().filter(|op| !op.kind.is_send()) {
        let tensor = received.next().expect("one buffer per receive");
        let inbox = if op.kind == P2pKind::RecvActivation {
            &mut *boxes.inbox_act
        } else {
            &mut *boxes.inbox_grad
        };
        inbox.insert((op.micro_batch, op.chunk), tensor);
    }
    Ok(())
}

/// The loss of one evaluation batch with the forward only: the chunks run in model order, each
/// stage receiving its input from the stage before and sending its output on.
pub(super) fn eval(
    b: &mut ModelParallelCpuBackend,
    batch: &Batch,
    precision: DType,
) -> Result<LossStats> {
    b.round_working(precision);
    let (stage, stages) = (b.layout.pipe.stage, b.layout.pipe.stages);
    let total = stages * b.layout.pipe.chunks;
    let rows = batch.batch * batch.seq_len;
    let mut carry: Option<Vec<f32>> = None;
    let mut loss = LossStats::default();
    for global in 0..total {
        if global % stages != stage {
            continue;
        }
        let chunk = global / stages;
        if global > 0 && stages > 1 {
            let pp = b.comms.pp.as_deref().expect("a pipeline of several stages");
            let mut input = vec![0f32; b.model.boundary_len(rows)];
            let from = (global - 1) % stages;
            pp.batch_p2p(&mut [P2pOp::Recv {
                buf: HostSliceMut::F32(&mut input),
                peer: from,
            }])?;
            carry = Some(input);
        }
        let acts = forward_chunk(b, chunk, batch, carry.as_deref(), precision)?;
        if b.model.ends_model(chunk) {
            loss = b.model.loss(chunk, &acts, rows, b.sums.as_ref())?;
        } else {
            let out = b.model.output(chunk, &acts, rows).to_vec();
            if stages > 1 {
                let pp = b.comms.pp.as_deref().expect("a pipeline of several stages");
                pp.batch_p2p(&mut [P2pOp::Send {
                    buf: HostSlice::F32(&out),
                    peer: (global + 1) % stages,
                }])?;
            }
            carry = Some(out);
        }
        b.pool[chunk].push(acts);
    }
    match &b.comms.pp {
        Some(pp) => Ok(LossStats {
            loss_sum: scalars::sum_f64(pp.as_ref(), loss.loss_sum)?,
            valid_tokens: scalars::sum_u64(pp.as_ref(), loss.valid_tokens as u64)? as usize,
        }),
        None => Ok(loss),
    }
}
