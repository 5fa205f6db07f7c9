//! The whole training step as one CUDA graph ([`GpuLlama::train_step`], `--cuda-graphs`).
//!
//! A step of the engine is a fixed sequence of some hundreds to thousands of launches over
//! buffers allocated at build (the arena, the gradients, the scratch, the cuBLASLt workspace):
//! nothing is allocated or freed inside it, and with the inputs already uploaded it takes no
//! host decision. So the step is recorded once with stream capture (zero the gradients,
//! forward, chunked loss head, backward, gradient norm, fused AdamW with clipping) and then
//! replayed with one `cuGraphLaunch` per step, which removes the host's per-launch cost and
//! the gaps between kernels that it leaves at small shapes.
//!
//! What changes every step reaches the graph through memory, never through a kernel argument
//! baked in at capture:
//! * token ids and shifted targets: the model's fixed device buffers, uploaded from their
//!   page-locked staging buffers before the launch (as an eager step does);
//! * the loss head's gradient factor `1 / denominator` (the batch's valid targets): one f32
//!   that the fused cross entropy reads when it runs (`cross_entropy_fused_device_scale`);
//! * the optimizer's per-group scalars (learning rate, bias corrections, decay factor): a
//!   device table the fused AdamW reads when it runs (`adam_step_device_groups`).
//!
//! Both are computed on the host exactly as an eager step computes its kernel arguments and
//! copied up before each launch, so a replayed step gives the eager step's bits.
//!
//! The loss and the gradient norm are read after the launch (the only synchronisation of the
//! step, as in an eager step). Capture runs with cudarc's event tracking switched off: its
//! per-buffer events were recorded outside the capture, and waiting on such an event inside
//! one is illegal; every buffer of the step is used on the one compute stream, whose order is
//! what the graph records. The first step of a shape (batch × seq) and precision runs eagerly
//! (it loads the kernels and makes cuBLASLt's algorithm choices outside any capture), the next
//! one of that key is captured and launched, the later ones replay. One graph is kept: a step
//! of another key warms up and captures anew; a new optimizer drops the graph.
//!
//! A CUDA error during capture or instantiation does not end the run under `auto`: the step
//! runs eagerly, the reason is kept ([`GpuLlama::cuda_graph_fallback`]) and no capture is tried
//! again. Under `on` it is an error naming the failure.

use cudarc::driver::{CudaGraph, CudaSlice, PinnedHostSlice, sys};
use tilearn_ops::DType;

use super::{GpuLlama, cuda_err, invalid, pinned, train_pass, weights, with_elem};
use crate::cuda_graphs::{CudaGraphs, GraphDecision, StepConditions};
use crate::error::{EngineError, Result};
use crate::model::LossStats;

use super::lce::GradFactor;
use super::sink::Handoff;

/// How one [`GpuLlama::train_step`] ran.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StepRun {
    /// One launch per kernel.
    Eager,
    /// Recorded into a new graph, then launched.
    Captured,
    /// One launch of the graph recorded earlier.
    Replayed,
}

/// The result of one whole training step.
#[derive(Clone, Debug, PartialEq)]
pub struct TrainStep {
    /// The loss sum and the valid targets of the batch.
    pub loss: LossStats,
    /// The global gradient norm before clipping.
    pub grad_norm: f64,
    pub run: StepRun,
    /// Why the step ran eagerly although graphs were asked for (`None` otherwise, and for the
    /// eager warm-up step before the first capture).
    pub eager_reason: Option<String>,
}

/// Counts of the steps of each kind since the model was built.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GraphStats {
    pub eager: u64,
    pub captures: u64,
    pub replays: u64,
}

/// What a graph was recorded for: a step of another shape or precision records anew.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct GraphKey {
    batch: usize,
    seq: usize,
    precision: DType,
}

/// The recorded step and the device scalars it reads.
pub(crate) struct StepGraph {
    captured: Option<(CudaGraph, GraphKey)>,
    /// The loss head's gradient factor (one f32) and its page-locked staging.
    factor: CudaSlice<f32>,
    host_factor: PinnedHostSlice<f32>,
    /// The optimizer's group table and its staging.
    groups: CudaSlice<u32>,
    host_groups: PinnedHostSlice<u32>,
}

impl std::fmt::Debug for StepGraph {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StepGraph")
            .field("captured", &self.captured.as_ref().map(|(_, k)| *k))
            .finish_non_exhaustive()
    }
}

/// The graph state of a [`GpuLlama`]: the setting, the recorded step, why graphs were given up.
#[derive(Debug, Default)]
pub(crate) struct GraphState {
    pub mode: CudaGraphs,
    graph: Option<StepGraph>,
    /// The shape and precision of the last eager warm-up step: a step is captured only after
    /// one eager step of its key (kernels loaded, cuBLASLt's choices made outside capture).
    warmed: Option<GraphKey>,
    /// A capture or instantiation failed: why (no capture is tried again).
    failed: Option<String>,
    pub stats: GraphStats,
}

impl GraphState {
    /// Drops the recorded graph (its buffers are about to be replaced).
    pub(crate) fn invalidate(&mut self) {
        if let Some(g) = self.graph.as_mut() {
            g.captured = None;
        }
    }
}

impl GpuLlama {
    /// Sets `--cuda-graphs` for the following [`GpuLlama::train_step`] calls.
    /// A lean model (`--memory lean`) always runs eagerly: its optimizer step is host work
    /// between the backward and the next forward, which a graph cannot hold; so does one
    /// that offloads its checkpoints (copies on a second stream, see
    /// [`GpuLlama::set_offload_checkpoints`]).
    pub fn set_cuda_graphs(&mut self, mode: CudaGraphs) {
        self.graphs.mode = if self.is_lean() || self.offload_checkpoints() {
            CudaGraphs::Off
        } else {
            mode
        };
    }

    /// The `--cuda-graphs` setting.
    pub fn cuda_graphs(&self) -> CudaGraphs {
        self.graphs.mode
    }

    /// Why graph capture was given up (a CUDA error during capture or instantiation), if it
    /// was.
    pub fn cuda_graph_fallback(&self) -> Option<&str> {
        self.graphs.failed.as_deref()
    }

    /// How many steps ran eagerly, were captured and were replayed.
    pub fn cuda_graph_stats(&self) -> GraphStats {
        self.graphs.stats
    }

    /// What the `--cuda-graphs` setting says for a step of `conditions` on this model (the
    /// engine's own reasons added, and a failed capture under `auto`): `Err` names why `on`
    /// refuses it.
    pub fn cuda_graph_decision(
        &self,
        conditions: StepConditions,
    ) -> std::result::Result<GraphDecision, String> {
        let decision = self.graphs.mode.decide(&self.step_conditions(conditions))?;
        Ok(match (decision, &self.graphs.failed) {
            (GraphDecision::Graph, Some(why)) => GraphDecision::Eager {
                reason: Some(why.clone()),
            },
            (d, _) => d,
        })
    }

    /// The engine's own reasons a step cannot be replayed (the caller's, such as gradient
    /// accumulation, are in the [`StepConditions`] it passes).
    fn step_conditions(&self, mut given: StepConditions) -> StepConditions {
        given.packed_rows |= self.position_ids.is_some();
        // No optimizer yet is not a shard (train_step refuses to run without one).
        let shard = self
            .optimizer
            .as_ref()
            .is_some_and(|o| o.shard() != (0..self.layout.numel));
        given.sharded_optimizer |=
            self.master_shard.is_some() || self.grad_window.is_some() || shard;
        given
    }

    /// One whole training step on `ids` / unshifted `labels`: zero the gradients, forward and
    /// backward (loss over `loss_denominator` targets, default this batch's), then AdamW at
    /// `lr` with the configured clipping. Eager, or one launch of a CUDA graph as the
    /// `--cuda-graphs` setting ([`GpuLlama::set_cuda_graphs`]) and `conditions` (the caller's
    /// view of the step: accumulation, ranks, loss scaling) decide; both give the same bits.
    /// Synchronises once, to read the loss and the gradient norm.
    #[allow(clippy::too_many_arguments)]
    pub fn train_step(
        &mut self,
        ids: &[u32],
        labels: &[i32],
        batch: usize,
        seq: usize,
        loss_denominator: Option<f64>,
        lr: f32,
        conditions: StepConditions,
    ) -> Result<TrainStep> {
        if self.optimizer.is_none() && self.host_optimizer().is_none() {
            return Err(invalid(
                "GpuLlama::train_step",
                "no optimizer: call configure_optimizer first".into(),
            ));
        }
        let conditions = self.step_conditions(conditions);
        let decision = self
            .graphs
            .mode
            .decide(&conditions)
            .map_err(|message| invalid("--cuda-graphs", message))?;
        let mut reason = match decision {
            GraphDecision::Eager { reason } => Some(reason),
            GraphDecision::Graph => None,
        };
        if reason.is_none()
            && let Some(why) = self.graphs.failed.clone()
        {
            reason = Some(Some(why));
        }
        if reason.is_none()
            && self
                .optimizer
                .as_ref()
                .is_some_and(|o| o.has_prepared_norm())
        {
            reason = Some(Some(
                "a gradient norm or unscale was prepared on the host for this step".into(),
            ));
        }
        let key = GraphKey {
            batch,
            seq,
            precision: self.precision,
        };
        let captured = self
            .graphs
            .graph
            .as_ref()
            .and_then(|g| g.captured.as_ref().map(|(_, k)| *k));
        if reason.is_none() && captured != Some(key) && self.graphs.warmed != Some(key) {
            // Eager by design before a capture (the kernels of this shape loaded, cuBLASLt's
            // algorithms chosen outside the capture), not a fallback: no reason.
            self.graphs.warmed = Some(key);
            reason = Some(None);
        }
        if let Some(reason) = reason {
            return self.eager_step(ids, labels, batch, seq, loss_denominator, lr, reason);
        }
        match self.graph_step(ids, labels, batch, seq, loss_denominator, lr) {
            Ok(step) => Ok(step),
            Err(GraphFailure::Step(e)) => Err(e),
            Err(GraphFailure::Capture(why)) => {
                if self.graphs.mode == CudaGraphs::On {
                    return Err(invalid(
                        "--cuda-graphs",
                        format!(
                            "on: capturing the step as a CUDA graph failed: {why}; use \
                             --cuda-graphs auto (eager steps after such a failure) or off"
                        ),
                    ));
                }
                let why = format!("CUDA graph capture failed, steps run eagerly: {why}");
                self.graphs.failed = Some(why.clone());
                self.eager_step(ids, labels, batch, seq, loss_denominator, lr, Some(why))
            }
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn eager_step(
        &mut self,
        ids: &[u32],
        labels: &[i32],
        batch: usize,
        seq: usize,
        loss_denominator: Option<f64>,
        lr: f32,
        eager_reason: Option<String>,
    ) -> Result<TrainStep> {
        self.zero_grad()?;
        let loss = self.forward_backward(ids, labels, batch, seq, loss_denominator)?;
        self.step(lr)?;
        let grad_norm = self.last_grad_norm()?;
        self.graphs.stats.eager += 1;
        Ok(TrainStep {
            loss,
            grad_norm,
            run: StepRun::Eager,
            eager_reason,
        })
    }

    /// The step as a graph launch (captured first when none matches). Inputs and scalars are
    /// uploaded eagerly before the launch.
    fn graph_step(
        &mut self,
        ids: &[u32],
        labels: &[i32],
        batch: usize,
        seq: usize,
        loss_denominator: Option<f64>,
        lr: f32,
    ) -> std::result::Result<TrainStep, GraphFailure> {
        let d = self.prepare(ids, batch, seq)?;
        let valid = self.upload_targets(labels, &d)?;
        let denominator = super::denominator_or_valid(loss_denominator, valid)?;
        // The eager step's factor, rounded to f32 as its launch wrapper rounds it.
        let factor = if denominator > 0.0 {
            (1.0 / denominator) as f32
        } else {
            0.0
        };
        let words = match self.optimizer.as_ref() {
            Some(opt) => opt.next_group_words(lr)?,
            None => return Err(invalid("GpuLlama::train_step", "no optimizer".into()).into()),
        };
        let mut graph = match self.graphs.graph.take() {
            Some(g) => g,
            None => self.new_step_graph(words.len())?,
        };
        let result = self.launch_graph(&mut graph, &d, factor, &words);
        self.graphs.graph = Some(graph);
        let run = result?;
        // What an eager step's host side records after queuing the same work.
        self.grads_hold_params = false;
        let precision = self.precision;
        if let Some(w) = self.work.as_mut() {
            w.written_as(precision);
        }
        if let Some(opt) = self.optimizer.as_mut() {
            opt.replayed_step();
        }
        let stats = self.totals.read(self.device.stream())?;
        let grad_norm = self.last_grad_norm()?;
        self.sample_memory()?;
        match run {
            StepRun::Captured => self.graphs.stats.captures += 1,
            _ => self.graphs.stats.replays += 1,
        }
        Ok(TrainStep {
            loss: LossStats {
                loss_sum: stats.loss_sum,
                valid_tokens: stats.valid,
            },
            grad_norm,
            run,
            eager_reason: None,
        })
    }

    fn new_step_graph(&self, group_words: usize) -> Result<StepGraph> {
        let stream = self.device.stream();
        let ctx = self.device.ctx();
        Ok(StepGraph {
            captured: None,
            factor: stream
                .alloc_zeros::<f32>(1)
                .map_err(|e| cuda_err("allocating the graph's loss factor", e))?,
            host_factor: pinned(ctx, 1, 0.0f32)?,
            groups: stream
                .alloc_zeros::<u32>(group_words.max(1))
                .map_err(|e| cuda_err("allocating the graph's optimizer table", e))?,
            host_groups: pinned(ctx, group_words.max(1), 0u32)?,
        })
    }

    /// Uploads the step's scalars, records the graph if none matches, and launches it.
    fn launch_graph(
        &mut self,
        graph: &mut StepGraph,
        d: &super::arena::Dims,
        factor: f32,
        words: &[u32],
    ) -> std::result::Result<StepRun, GraphFailure> {
        let stream = self.device.stream().clone();
        graph
            .host_factor
            .as_mut_slice()
            .map_err(|e| cuda_err("staging the loss factor", e))?[0] = factor;
        graph
            .host_groups
            .as_mut_slice()
            .map_err(|e| cuda_err("staging the optimizer scalars", e))?[..words.len()]
            .copy_from_slice(words);
        stream
            .memcpy_htod(&graph.host_factor, &mut graph.factor)
            .map_err(|e| cuda_err("uploading the loss factor", e))?;
        stream
            .memcpy_htod(&graph.host_groups, &mut graph.groups)
            .map_err(|e| cuda_err("uploading the optimizer scalars", e))?;
        let key = GraphKey {
            batch: d.batch,
            seq: d.seq,
            precision: self.precision,
        };
        let mut run = StepRun::Replayed;
        if graph.captured.as_ref().map(|(_, k)| *k) != Some(key) {
            graph.captured = None;
            let recorded = self.capture(d, &graph.factor, &graph.groups)?;
            graph.captured = Some((recorded, key));
            run = StepRun::Captured;
        }
        if let Some((g, _)) = graph.captured.as_ref() {
            g.launch()
                .map_err(|e| cuda_err("launching the step's CUDA graph", e))?;
        }
        Ok(run)
    }

    /// Records the step's device work into a graph (nothing runs).
    fn capture(
        &mut self,
        d: &super::arena::Dims,
        factor: &CudaSlice<f32>,
        table: &CudaSlice<u32>,
    ) -> std::result::Result<CudaGraph, GraphFailure> {
        let stream = self.device.stream().clone();
        let ctx = stream.context().clone();
        // Everything queued so far must not be part of the capture's dependencies: finish it.
        self.device.synchronize()?;
        let tracking = ctx.is_event_tracking();
        // SAFETY: tracking is off only while the step is recorded on this thread, and restored
        // below on every path. Inside a capture nothing executes; every buffer the step uses
        // is used on the one compute stream, whose order the graph keeps, and the graph's
        // launches are ordered on that same stream with every later use (reads of the loss,
        // saves, evaluation); multi-stream runs (data parallel) never capture.
        unsafe { ctx.disable_event_tracking() };
        let began = stream
            .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(|e| format!("cuStreamBeginCapture: {e}"));
        let recorded = match &began {
            Ok(()) => self
                .record_step(d, factor, table)
                .map_err(|e| e.to_string()),
            Err(e) => Err(e.clone()),
        };
        // End a begun capture whatever happened inside it, so the stream leaves capture mode.
        let ended = began
            .is_ok()
            .then(|| stream.end_capture(sys::CUgraphInstantiate_flags(0)));
        if tracking {
            // SAFETY: restores the context's setting for every later use.
            unsafe { ctx.enable_event_tracking() };
        }
        recorded.map_err(GraphFailure::Capture)?;
        match ended {
            Some(Ok(Some(graph))) => {
                graph
                    .upload()
                    .map_err(|e| GraphFailure::Capture(format!("cuGraphUpload: {e}")))?;
                Ok(graph)
            }
            Some(Ok(None)) => Err(GraphFailure::Capture("the capture recorded no work".into())),
            Some(Err(e)) => Err(GraphFailure::Capture(format!(
                "cuStreamEndCapture / cuGraphInstantiate: {e}"
            ))),
            None => Err(GraphFailure::Capture("the capture did not begin".into())),
        }
    }

    /// Queues the step's device work (what `eager_step` queues after its uploads), with the
    /// loss factor and the optimizer's scalars read from `factor` and `table`.
    fn record_step(
        &mut self,
        d: &super::arena::Dims,
        factor: &CudaSlice<f32>,
        table: &CudaSlice<u32>,
    ) -> Result<()> {
        let stream = self.device.stream().clone();
        // No zeroing pass: the backward writes each weight's gradient with its first product
        // and zeroes the rest itself (`Handoff::unzeroed`).
        let factor_view = factor.slice(..1);
        {
            let p = self.pass();
            let mut cx = p.cx;
            let stream = cx.stream;
            with_elem!(p.precision, T => train_pass::<T>(
                &mut cx,
                d,
                &mut weights::<T>(stream, p.master, p.work, p.numel)?,
                Handoff::unzeroed(p.grads.as_view_mut(), stream),
                &p.ids.slice(..d.n),
                &p.targets.slice(..d.n),
                GradFactor::Device(&factor_view),
                p.totals,
                p.arena,
            ))?;
        }
        let GpuLlama {
            master,
            grads,
            work,
            optimizer,
            precision,
            ..
        } = self;
        let Some(opt) = optimizer.as_mut() else {
            return Err(invalid("GpuLlama::train_step", "no optimizer".into()));
        };
        let shard = opt.shard();
        let params = master.slice_mut(shard.clone());
        let g = grads.slice(shard.clone());
        match work.as_mut() {
            Some(w) => {
                let copy = w.param_copy(*precision, shard)?;
                opt.queue_device_step(&stream, params, g, copy, table)
            }
            None => opt.queue_device_step(
                &stream,
                params,
                g,
                tilearn_optim::cuda::ParamCopy::None,
                table,
            ),
        }
    }
}

/// Why a graph step did not run: an error of the step itself (bad input, a failed upload), or
/// a failed capture, which `auto` answers with an eager step.
enum GraphFailure {
    Step(EngineError),
    Capture(String),
}

impl From<EngineError> for GraphFailure {
    fn from(e: EngineError) -> Self {
        GraphFailure::Step(e)
    }
}

impl From<tilearn_ops::OpsError> for GraphFailure {
    fn from(e: tilearn_ops::OpsError) -> Self {
        GraphFailure::Step(e.into())
    }
}
