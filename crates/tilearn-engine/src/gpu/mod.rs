//! The Llama training step on a CUDA device (feature `cuda`).
//!
//! [`GpuLlama`] takes a [`LlamaForCausalLM`]'s parameters to the device once and runs the same
//! computation as the CPU engine with the hand-written kernels and cuBLASLt of
//! `tilearn_ops::cuda`:
//!
//! * **Parameters**: the fp32 master weights in one flat device buffer laid out exactly as
//!   [`ParamStore`] (Hugging Face order), and in [`Precision::Bf16`] a bf16 working copy in a
//!   second flat buffer, which the forward and backward read and the fused AdamW rewrites.
//! * **Gradients**: one flat f32 buffer with the same layout; every call of
//!   [`GpuLlama::forward_backward`] adds (`+=`) into it, so gradient accumulation over
//!   micro-batches is a sequence of calls followed by one [`GpuLlama::step`]
//!   ([`GpuLlama::zero_grad`] clears it).
//! * **Activations** and their gradients: one arena of the activation type plus one f32 arena
//!   for per-row statistics, allocated at build for (batch, seq) and carved per call; a step
//!   allocates no device memory of its own (the RMSNorm backward's dweight partials and the
//!   embedding backward's sort buffers are scratch allocated at build too, see [`GpuMemory`]).
//!
//! Precision: [`Precision::F32`] runs everything in f32 (the exactness tests compare it with the
//! CPU engine and transformers); [`Precision::Bf16`] keeps activations and the working weights in
//! bf16 with f32 accumulation inside every kernel, f32 parameter gradients, f32 master weights
//! and f32 optimizer moments (mixed precision as `torch.autocast` + fp32 master weights).
//!
//! Synchronisation: everything is queued on the device's one stream. The only host wait of a
//! training step is [`GpuLlama::forward_backward`] reading back the loss sum (a 32-byte copy of
//! the cross-entropy totals, which also reports out-of-range labels); [`GpuLlama::step`] never
//! waits. Token ids and labels are validated on the host before upload, so a bad id is a typed
//! error before any launch.

mod arena;
mod compute;
mod elem;
mod linalg;
mod optim;
mod views;

use std::sync::Arc;

use cudarc::driver::{
    CudaContext, CudaSlice, CudaView, DeviceRepr, DriverError, PinnedHostSlice, ValidAsZeroBits,
};
use half::bf16;
use tilearn_ops::OpsError;
use tilearn_ops::cpu::{IGNORE_INDEX, RopeTable};
use tilearn_ops::cuda::{
    CeTotals, CudaStream, EmbeddingBackwardScratch, GpuDevice, GpuRopeTable, RmsNormScratch,
    TokenIdCheck, cast_f32_to_bf16,
};
use tilearn_optim::{AdamWConfig, ParamGroup};

pub use optim::GpuAdamW;

use arena::{Arena, Dims};
use compute::Cx;
use linalg::{GpuLinalg, Matmul};

use crate::config::{LlamaConfig, RopeScalingConfig};
use crate::error::{EngineError, Result};
use crate::model::{LlamaForCausalLM, LossStats, ModelLayout, count_valid_targets};
use crate::params::{ParamSpec, ParamStore};

/// Numeric mode of a [`GpuLlama`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Precision {
    /// Weights, activations and gradients in f32 (TF32 off): the reference mode.
    F32,
    /// bf16 activations and working weights, f32 accumulation, f32 master weights and
    /// gradients.
    Bf16,
}

/// Device memory of a [`GpuLlama`], in bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GpuMemory {
    /// fp32 master weights.
    pub master_bytes: usize,
    /// bf16 working copy (0 in f32 mode).
    pub working_copy_bytes: usize,
    /// fp32 gradient buffer.
    pub grad_bytes: usize,
    /// Activation and statistics arenas, ids, targets.
    pub activation_bytes: usize,
    /// cuBLASLt and attention workspaces, and the RMSNorm and embedding backward scratch.
    pub workspace_bytes: usize,
    /// Optimizer moments (0 until [`GpuLlama::configure_optimizer`]).
    pub optimizer_bytes: usize,
    /// Sum of the above: what this model allocated itself.
    pub own_bytes: usize,
    /// Device memory in use (all processes, `cuMemGetInfo`) just before the build.
    pub device_used_before: usize,
    /// Highest device memory in use observed: sampled after the build, after every
    /// `forward_backward` (at its synchronisation point) and after every `step`.
    pub device_used_peak: usize,
    /// Total device memory.
    pub device_total: usize,
}

impl GpuMemory {
    /// Peak device memory attributable to this model: the observed peak minus what was in use
    /// before the build.
    pub fn peak_bytes(&self) -> usize {
        self.device_used_peak
            .saturating_sub(self.device_used_before)
    }
}

/// The activation arena and, in bf16 mode, the working copy of the weights.
#[derive(Debug)]
enum Engine {
    F32 {
        arena: Arena<f32>,
    },
    Bf16 {
        arena: Arena<bf16>,
        work: CudaSlice<bf16>,
    },
}

/// A Llama causal LM on one GPU: parameters, gradients, activations and (once configured)
/// AdamW state in device memory.
#[derive(Debug)]
pub struct GpuLlama {
    device: GpuDevice,
    config: LlamaConfig,
    layout: ModelLayout,
    specs: Vec<ParamSpec>,
    precision: Precision,
    /// Capacity of the arena.
    batch: usize,
    seq: usize,
    /// Whether the rope table of a shorter sequence is a prefix of the built one (false only
    /// for dynamic NTK scaling beyond `original_max_position_embeddings`).
    rope_prefix_ok: bool,
    master: CudaSlice<f32>,
    grads: CudaSlice<f32>,
    engine: Engine,
    rope: GpuRopeTable,
    ids: CudaSlice<u32>,
    targets: CudaSlice<i32>,
    /// Page-locked host staging of the ids and shifted targets (capacity-sized, allocated at
    /// build): copies from pageable memory would make the driver wait for the stream before
    /// each upload, a second synchronisation per step. Each buffer's own event makes a rewrite
    /// wait only for that buffer's previous copy.
    host_ids: PinnedHostSlice<u32>,
    host_targets: PinnedHostSlice<i32>,
    check: TokenIdCheck,
    totals: CeTotals,
    mm: Matmul,
    /// dweight partials of every RMSNorm backward (sized for `batch * seq` rows at build).
    norm_scratch: RmsNormScratch,
    /// Sort buffers of the embedding backward (sized for `batch * seq` tokens at build).
    embed_scratch: EmbeddingBackwardScratch,
    optimizer: Option<GpuAdamW>,
    memory: GpuMemory,
}

/// A page-locked host buffer of `len` elements filled with `fill`.
fn pinned<T: DeviceRepr + ValidAsZeroBits + Copy>(
    ctx: &Arc<CudaContext>,
    len: usize,
    fill: T,
) -> Result<PinnedHostSlice<T>> {
    // SAFETY: the allocation is uninitialised; it is filled below before anything (host code
    // or a copy) reads it.
    let mut buf = unsafe { ctx.alloc_pinned::<T>(len.max(1)) }
        .map_err(|e| cuda_err("allocating page-locked staging memory", e))?;
    buf.as_mut_slice()
        .map_err(|e| cuda_err("initialising page-locked staging memory", e))?
        .fill(fill);
    Ok(buf)
}

/// A driver error as an engine error.
pub(crate) fn cuda_err(what: &str, e: DriverError) -> EngineError {
    EngineError::Ops(OpsError::Cuda {
        context: "tilearn_engine::gpu",
        message: format!("{what}: {e}"),
    })
}

fn invalid(argument: &str, message: String) -> EngineError {
    EngineError::InvalidArgument {
        argument: argument.to_string(),
        message,
    }
}

impl GpuLlama {
    /// Uploads `model`'s parameters to `device` and allocates gradients and the activation
    /// arena for calls of up to `batch` sequences of `seq` tokens.
    pub fn new(
        device: &GpuDevice,
        model: &LlamaForCausalLM,
        batch: usize,
        seq: usize,
        precision: Precision,
    ) -> Result<GpuLlama> {
        if batch == 0 || seq == 0 {
            return Err(invalid("batch/seq", "must both be positive".into()));
        }
        let config = model.config.clone();
        let layout = model.layout();
        if model.params.numel() != layout.numel {
            return Err(invalid(
                "params",
                format!(
                    "has {} entries but the config describes {}",
                    model.params.numel(),
                    layout.numel
                ),
            ));
        }
        let stream = device.stream().clone();
        let ctx = device.ctx();
        ctx.bind_to_thread()
            .map_err(|e| cuda_err("binding the device context", e))?;
        let (free_before, total) = ctx
            .mem_get_info()
            .map_err(|e| cuda_err("querying device memory", e))?;

        let cap = Dims::new(&config, batch, seq);
        let n = cap.n;
        let numel = layout.numel;
        let master = stream
            .clone_htod(&model.params.data)
            .map_err(|e| cuda_err("uploading the parameters", e))?;
        let grads = stream
            .alloc_zeros::<f32>(numel.max(1))
            .map_err(|e| cuda_err("allocating the gradient buffer", e))?;
        let (engine, work_bytes, arena_bytes) = match precision {
            Precision::F32 => {
                let arena = Arena::<f32>::new(&stream, &cap)?;
                let bytes = arena.bytes();
                (Engine::F32 { arena }, 0, bytes)
            }
            Precision::Bf16 => {
                let arena = Arena::<bf16>::new(&stream, &cap)?;
                let bytes = arena.bytes();
                let mut work = stream
                    .alloc_zeros::<bf16>(numel.max(1))
                    .map_err(|e| cuda_err("allocating the bf16 working copy", e))?;
                cast_f32_to_bf16(
                    &stream,
                    &master.slice(..numel),
                    &mut work.slice_mut(..numel),
                )?;
                (Engine::Bf16 { arena, work }, numel.max(1) * 2, bytes)
            }
        };
        let rope_table = RopeTable::new(
            config.head_dim,
            config.rope_theta,
            &config.rope_scaling.to_ops(),
            seq,
            config.max_position_embeddings,
        );
        let rope = GpuRopeTable::upload(&stream, &rope_table)?;
        let rope_prefix_ok = match config.rope_scaling {
            RopeScalingConfig::Dynamic {
                original_max_position_embeddings,
                ..
            } => seq <= original_max_position_embeddings,
            _ => true,
        };
        let ids = stream
            .alloc_zeros::<u32>(n)
            .map_err(|e| cuda_err("allocating the token ids", e))?;
        let targets = stream
            .alloc_zeros::<i32>(n)
            .map_err(|e| cuda_err("allocating the targets", e))?;
        let host_ids = pinned(ctx, n, 0u32)?;
        let host_targets = pinned(ctx, n, IGNORE_INDEX)?;
        let check = TokenIdCheck::new(&stream, config.vocab_size)?;
        let totals = CeTotals::new(&stream)?;
        let mm = Matmul::new(&stream, &cap, precision)?;
        let norm_scratch = RmsNormScratch::new(&stream, n, config.hidden_size)?;
        let embed_scratch = EmbeddingBackwardScratch::new(&stream, n, config.vocab_size)?;

        let master_bytes = master.num_bytes();
        let grad_bytes = grads.num_bytes();
        let activation_bytes = arena_bytes + ids.num_bytes() + targets.num_bytes();
        let workspace_bytes = mm.bytes() + norm_scratch.bytes() + embed_scratch.bytes();
        let mut gpu = GpuLlama {
            device: device.clone(),
            specs: model.params.specs.clone(),
            layout,
            precision,
            batch,
            seq,
            rope_prefix_ok,
            master,
            grads,
            engine,
            rope,
            ids,
            targets,
            host_ids,
            host_targets,
            check,
            totals,
            mm,
            norm_scratch,
            embed_scratch,
            optimizer: None,
            memory: GpuMemory {
                master_bytes,
                working_copy_bytes: work_bytes,
                grad_bytes,
                activation_bytes,
                workspace_bytes,
                optimizer_bytes: 0,
                own_bytes: master_bytes
                    + work_bytes
                    + grad_bytes
                    + activation_bytes
                    + workspace_bytes,
                device_used_before: total.saturating_sub(free_before),
                device_used_peak: 0,
                device_total: total,
            },
            config,
        };
        // Surface a failed upload or cast here rather than at the first step.
        gpu.device.synchronize()?;
        gpu.sample_memory()?;
        Ok(gpu)
    }

    /// The model's configuration.
    pub fn config(&self) -> &LlamaConfig {
        &self.config
    }

    /// The numeric mode.
    pub fn precision(&self) -> Precision {
        self.precision
    }

    /// Largest batch and the sequence length the arena was built for.
    pub fn capacity(&self) -> (usize, usize) {
        (self.batch, self.seq)
    }

    /// The device.
    pub fn device(&self) -> &GpuDevice {
        &self.device
    }

    /// Device memory held and observed (see [`GpuMemory`]).
    pub fn memory(&self) -> GpuMemory {
        self.memory
    }

    /// The AdamW state, once configured.
    pub fn optimizer(&self) -> Option<&GpuAdamW> {
        self.optimizer.as_ref()
    }

    fn stream(&self) -> &Arc<CudaStream> {
        self.device.stream()
    }

    /// Updates the observed peak with the device's current use (no synchronisation).
    fn sample_memory(&mut self) -> Result<()> {
        let (free, total) = self
            .device
            .ctx()
            .mem_get_info()
            .map_err(|e| cuda_err("querying device memory", e))?;
        let used = total.saturating_sub(free);
        self.memory.device_used_peak = self.memory.device_used_peak.max(used);
        Ok(())
    }

    /// Checks a call's shape against the arena and the token ids against the vocabulary,
    /// uploads the ids (one host-to-device copy) and returns the call's dims.
    fn prepare(&mut self, ids: &[u32], batch: usize, seq: usize) -> Result<Dims> {
        if batch == 0 || seq == 0 {
            return Err(invalid("batch/seq", "must both be positive".into()));
        }
        if ids.len() != batch * seq {
            return Err(invalid(
                "ids",
                format!(
                    "has {} entries but batch * seq = {}",
                    ids.len(),
                    batch * seq
                ),
            ));
        }
        let prefix_ok = seq == self.seq || (seq < self.seq && self.rope_prefix_ok);
        if batch > self.batch || !prefix_ok {
            return Err(invalid(
                "batch/seq",
                format!(
                    "the device model was built for batch {} x seq {}, called with batch \
                     {batch} x seq {seq}; build GpuLlama::new(.., {batch}, {seq}, ..)",
                    self.batch, self.seq
                ),
            ));
        }
        let vocab = self.config.vocab_size;
        if let Some((position, &id)) = ids
            .iter()
            .enumerate()
            .find(|&(_, &id)| id as usize >= vocab)
        {
            return Err(OpsError::TokenOutOfRange {
                id,
                position,
                vocab,
            }
            .into());
        }
        let n = batch * seq;
        self.host_ids
            .as_mut_slice()
            .map_err(|e| cuda_err("staging the token ids", e))?[..n]
            .copy_from_slice(ids);
        // The whole (capacity-sized) staging buffer goes up in one copy; only the first `n`
        // ids are read by this call.
        let stream = self.device.stream().clone();
        stream
            .memcpy_htod(&self.host_ids, &mut self.ids)
            .map_err(|e| cuda_err("uploading the token ids", e))?;
        Ok(Dims::new(&self.config, batch, seq))
    }

    /// Shifts Hugging Face *unshifted* `labels` into targets (position `t` predicts
    /// `labels[t + 1]`, the last position of a sequence nothing), checks them and uploads them
    /// (one host-to-device copy). Returns the number of valid targets.
    fn upload_targets(&mut self, labels: &[i32], d: &Dims) -> Result<usize> {
        let (n, seq, vocab) = (d.n, d.seq, d.vocab);
        if labels.len() != n {
            return Err(invalid(
                "labels",
                format!("has {} entries but batch * seq = {n}", labels.len()),
            ));
        }
        // Validate from `labels` (the staging buffer is write-combined: slow to read back).
        // Target `t` of a row is the row's label `t + 1`; the first label is never a target.
        for (r, row) in labels.chunks(seq).enumerate() {
            if let Some((t, &label)) = row
                .iter()
                .enumerate()
                .skip(1)
                .find(|&(_, &l)| l != IGNORE_INDEX && (l < 0 || l as usize >= vocab))
            {
                return Err(OpsError::LabelOutOfRange {
                    label,
                    position: r * seq + t - 1,
                    vocab,
                }
                .into());
            }
        }
        let host = &mut self
            .host_targets
            .as_mut_slice()
            .map_err(|e| cuda_err("staging the targets", e))?[..n];
        for (trow, lrow) in host.chunks_mut(seq).zip(labels.chunks(seq)) {
            trow[..seq - 1].copy_from_slice(&lrow[1..]);
            trow[seq - 1] = IGNORE_INDEX;
        }
        let stream = self.device.stream().clone();
        stream
            .memcpy_htod(&self.host_targets, &mut self.targets)
            .map_err(|e| cuda_err("uploading the targets", e))?;
        Ok(count_valid_targets(labels, d.batch, seq))
    }

    /// Forward and backward on the device with Hugging Face *unshifted* `labels` (`-100` =
    /// ignore): the same contract as [`LlamaForCausalLM::forward_backward`]. The loss is
    /// `loss_sum / loss_denominator` (default: this call's valid targets; pass the whole
    /// accumulated batch's [`count_valid_targets`] when accumulating); parameter gradients are
    /// added into the device gradient buffer.
    ///
    /// Synchronises once: the loss sum is read back at the end (see the module docs).
    pub fn forward_backward(
        &mut self,
        ids: &[u32],
        labels: &[i32],
        batch: usize,
        seq: usize,
        loss_denominator: Option<f64>,
    ) -> Result<LossStats> {
        let d = self.prepare(ids, batch, seq)?;
        let valid = self.upload_targets(labels, &d)?;
        let denominator = match loss_denominator {
            None => valid as f64,
            Some(x) if x >= 0.0 && x.is_finite() => x,
            Some(x) => {
                return Err(invalid(
                    "loss_denominator",
                    format!("{x} is not a non-negative finite number; pass the token count"),
                ));
            }
        };
        let grad_scale = if denominator > 0.0 {
            1.0 / denominator
        } else {
            0.0
        };
        let GpuLlama {
            device,
            layout,
            master,
            grads,
            engine,
            rope,
            ids: ids_dev,
            targets,
            check,
            totals,
            mm,
            norm_scratch,
            embed_scratch,
            ..
        } = self;
        let stream = device.stream();
        let mut cx = Cx {
            stream,
            layout,
            rope,
            mm,
            check,
            norm_scratch,
            embed_scratch,
        };
        let n = d.n;
        let ids_v = ids_dev.slice(..n);
        let targets_v = targets.slice(..n);
        match engine {
            Engine::F32 { arena } => train_pass(
                &mut cx,
                &d,
                &master.slice(..layout.numel),
                grads,
                &ids_v,
                &targets_v,
                grad_scale,
                totals,
                arena,
            )?,
            Engine::Bf16 { arena, work } => train_pass(
                &mut cx,
                &d,
                &work.slice(..layout.numel),
                grads,
                &ids_v,
                &targets_v,
                grad_scale,
                totals,
                arena,
            )?,
        }
        let stats = self.totals.read(self.device.stream())?;
        self.sample_memory()?;
        Ok(LossStats {
            loss_sum: stats.loss_sum,
            valid_tokens: stats.valid,
        })
    }

    /// Logits `[batch * seq * vocab]` (widened to f32) of `ids`, for evaluation and tests.
    pub fn forward_logits(&mut self, ids: &[u32], batch: usize, seq: usize) -> Result<Vec<f32>> {
        let d = self.prepare(ids, batch, seq)?;
        let GpuLlama {
            device,
            layout,
            master,
            engine,
            rope,
            ids: ids_dev,
            check,
            mm,
            norm_scratch,
            embed_scratch,
            ..
        } = self;
        let stream = device.stream();
        let mut cx = Cx {
            stream,
            layout,
            rope,
            mm,
            check,
            norm_scratch,
            embed_scratch,
        };
        let ids_v = ids_dev.slice(..d.n);
        match engine {
            Engine::F32 { arena } => {
                logits_pass(&mut cx, &d, &master.slice(..layout.numel), &ids_v, arena)
            }
            Engine::Bf16 { arena, work } => {
                logits_pass(&mut cx, &d, &work.slice(..layout.numel), &ids_v, arena)
            }
        }
    }

    /// Loss of `ids` against unshifted `labels` without gradients (evaluation); synchronises
    /// once to read it.
    pub fn forward_loss(
        &mut self,
        ids: &[u32],
        labels: &[i32],
        batch: usize,
        seq: usize,
    ) -> Result<LossStats> {
        let d = self.prepare(ids, batch, seq)?;
        self.upload_targets(labels, &d)?;
        let GpuLlama {
            device,
            layout,
            master,
            engine,
            rope,
            ids: ids_dev,
            targets,
            check,
            totals,
            mm,
            norm_scratch,
            embed_scratch,
            ..
        } = self;
        let stream = device.stream();
        let mut cx = Cx {
            stream,
            layout,
            rope,
            mm,
            check,
            norm_scratch,
            embed_scratch,
        };
        let ids_v = ids_dev.slice(..d.n);
        let targets_v = targets.slice(..d.n);
        match engine {
            Engine::F32 { arena } => loss_pass(
                &mut cx,
                &d,
                &master.slice(..layout.numel),
                &ids_v,
                &targets_v,
                totals,
                arena,
            )?,
            Engine::Bf16 { arena, work } => loss_pass(
                &mut cx,
                &d,
                &work.slice(..layout.numel),
                &ids_v,
                &targets_v,
                totals,
                arena,
            )?,
        }
        let stats = self.totals.read(self.device.stream())?;
        Ok(LossStats {
            loss_sum: stats.loss_sum,
            valid_tokens: stats.valid,
        })
    }

    /// Zeroes the gradient buffer (queued, no wait).
    pub fn zero_grad(&mut self) -> Result<()> {
        let stream = self.device.stream().clone();
        stream
            .memset_zeros(&mut self.grads)
            .map_err(|e| cuda_err("zeroing the gradients", e))
    }

    /// Sets up AdamW on the device (moments zeroed, step count 0) with `groups` over the flat
    /// parameter buffer (e.g. [`GpuLlama::default_groups`]) and global-norm clipping to
    /// `max_grad_norm` (0 disables).
    pub fn configure_optimizer(
        &mut self,
        config: AdamWConfig,
        groups: Vec<ParamGroup>,
        max_grad_norm: f64,
    ) -> Result<()> {
        let opt = GpuAdamW::new(
            self.stream(),
            config,
            groups,
            self.layout.numel,
            max_grad_norm,
        )?;
        self.memory.optimizer_bytes = opt.bytes();
        self.memory.own_bytes = self.memory.master_bytes
            + self.memory.working_copy_bytes
            + self.memory.grad_bytes
            + self.memory.activation_bytes
            + self.memory.workspace_bytes
            + self.memory.optimizer_bytes;
        self.optimizer = Some(opt);
        self.sample_memory()
    }

    /// The Trainer's two groups: tensors with weight decay (`weight_decay`) and norms/biases
    /// without, as Hugging Face's Trainer groups them.
    pub fn default_groups(&self, weight_decay: f32) -> Vec<ParamGroup> {
        let store = ParamStore {
            specs: self.specs.clone(),
            data: Vec::new(),
        };
        vec![
            ParamGroup {
                name: "decay".into(),
                ranges: store.decay_ranges(),
                weight_decay,
                lr_scale: 1.0,
            },
            ParamGroup {
                name: "no_decay".into(),
                ranges: store.no_decay_ranges(),
                weight_decay: 0.0,
                lr_scale: 1.0,
            },
        ]
    }

    /// One AdamW step at learning rate `lr` with the accumulated gradients (clipped to the
    /// configured norm inside the kernel), updating the master weights and, in bf16 mode, the
    /// working copy in the same launch. Queued; does not wait. Does not zero the gradients.
    pub fn step(&mut self, lr: f32) -> Result<()> {
        let GpuLlama {
            device,
            master,
            grads,
            engine,
            optimizer,
            ..
        } = self;
        let Some(opt) = optimizer.as_mut() else {
            return Err(invalid(
                "GpuLlama::step",
                "no optimizer: call configure_optimizer first".into(),
            ));
        };
        let work = match engine {
            Engine::F32 { .. } => None,
            Engine::Bf16 { work, .. } => Some(work),
        };
        opt.step(device.stream(), master, grads, work, lr)?;
        self.sample_memory()
    }

    /// The global gradient norm (before clipping) of the last [`step`](Self::step).
    /// Synchronises the stream.
    pub fn last_grad_norm(&self) -> Result<f64> {
        match &self.optimizer {
            Some(opt) => opt.last_grad_norm(self.stream()),
            None => Err(invalid(
                "GpuLlama::last_grad_norm",
                "no optimizer: call configure_optimizer first".into(),
            )),
        }
    }

    /// Downloads the fp32 master weights into a [`ParamStore`] (Hugging Face names and order),
    /// e.g. to save a checkpoint. Synchronises.
    pub fn download_params(&self) -> Result<ParamStore> {
        let data = self.download_f32(&self.master, "downloading the parameters")?;
        Ok(ParamStore {
            specs: self.specs.clone(),
            data,
        })
    }

    /// Downloads the accumulated gradients (flat, the parameters' layout). Synchronises.
    pub fn download_grads(&self) -> Result<Vec<f32>> {
        self.download_f32(&self.grads, "downloading the gradients")
    }

    /// Replaces the device parameters with `params` (same layout), refreshing the bf16 working
    /// copy; the optimizer state is kept.
    pub fn upload_params(&mut self, params: &ParamStore) -> Result<()> {
        let numel = self.layout.numel;
        if params.data.len() != numel || params.specs != self.specs {
            return Err(invalid(
                "params",
                format!(
                    "has {} entries / another layout; the device model has {numel}",
                    params.data.len()
                ),
            ));
        }
        let stream = self.device.stream().clone();
        stream
            .memcpy_htod(&params.data, &mut self.master.slice_mut(..numel))
            .map_err(|e| cuda_err("uploading the parameters", e))?;
        if let Engine::Bf16 { work, .. } = &mut self.engine {
            cast_f32_to_bf16(
                &stream,
                &self.master.slice(..numel),
                &mut work.slice_mut(..numel),
            )?;
        }
        Ok(())
    }

    /// Replaces the accumulated gradients with `grads` (flat, the parameters' layout), e.g. to
    /// step on gradients computed elsewhere.
    pub fn upload_grads(&mut self, grads: &[f32]) -> Result<()> {
        let numel = self.layout.numel;
        if grads.len() != numel {
            return Err(invalid(
                "grads",
                format!(
                    "has {} entries but the model has {numel} parameters",
                    grads.len()
                ),
            ));
        }
        let stream = self.device.stream().clone();
        stream
            .memcpy_htod(grads, &mut self.grads.slice_mut(..numel))
            .map_err(|e| cuda_err("uploading the gradients", e))
    }

    /// Downloads the optimizer moments `(exp_avg, exp_avg_sq)`. Synchronises.
    pub fn download_optimizer_moments(&self) -> Result<(Vec<f32>, Vec<f32>)> {
        match &self.optimizer {
            Some(opt) => opt.download_moments(self.stream()),
            None => Err(invalid(
                "GpuLlama::download_optimizer_moments",
                "no optimizer: call configure_optimizer first".into(),
            )),
        }
    }

    /// Replaces the optimizer's moments and step count, e.g. from a checkpoint's
    /// `optimizer.safetensors` read by the CPU AdamW.
    pub fn upload_optimizer_state(
        &mut self,
        exp_avg: &[f32],
        exp_avg_sq: &[f32],
        step: u64,
    ) -> Result<()> {
        let stream = self.device.stream().clone();
        match &mut self.optimizer {
            Some(opt) => opt.upload_moments(&stream, exp_avg, exp_avg_sq, step),
            None => Err(invalid(
                "GpuLlama::upload_optimizer_state",
                "no optimizer: call configure_optimizer first".into(),
            )),
        }
    }

    fn download_f32(&self, buf: &CudaSlice<f32>, what: &str) -> Result<Vec<f32>> {
        let stream = self.stream();
        let host = stream
            .clone_dtoh(&buf.slice(..self.layout.numel))
            .map_err(|e| cuda_err(what, e))?;
        stream.synchronize().map_err(|e| cuda_err(what, e))?;
        Ok(host)
    }
}

/// Forward, fused cross entropy and backward of one call.
#[allow(clippy::too_many_arguments)]
fn train_pass<T: GpuLinalg>(
    cx: &mut Cx<'_>,
    d: &Dims,
    w: &CudaView<'_, T>,
    grads: &mut CudaSlice<f32>,
    ids: &CudaView<'_, u32>,
    targets: &CudaView<'_, i32>,
    grad_scale: f64,
    totals: &mut CeTotals,
    arena: &mut Arena<T>,
) -> Result<()> {
    let mut b = arena.carve(d)?;
    compute::forward(cx, d, w, ids, &mut b)?;
    compute::backward(cx, d, w, grads, ids, targets, grad_scale, totals, &mut b)
}

/// Forward only; downloads the logits (synchronises).
fn logits_pass<T: GpuLinalg>(
    cx: &mut Cx<'_>,
    d: &Dims,
    w: &CudaView<'_, T>,
    ids: &CudaView<'_, u32>,
    arena: &mut Arena<T>,
) -> Result<Vec<f32>> {
    let mut b = arena.carve(d)?;
    compute::forward(cx, d, w, ids, &mut b)?;
    let host = cx
        .stream
        .clone_dtoh(&b.logits)
        .map_err(|e| cuda_err("downloading the logits", e))?;
    cx.stream
        .synchronize()
        .map_err(|e| cuda_err("downloading the logits", e))?;
    Ok(T::host_to_f32(&host))
}

/// Forward and the loss-only cross entropy.
fn loss_pass<T: GpuLinalg>(
    cx: &mut Cx<'_>,
    d: &Dims,
    w: &CudaView<'_, T>,
    ids: &CudaView<'_, u32>,
    targets: &CudaView<'_, i32>,
    totals: &mut CeTotals,
    arena: &mut Arena<T>,
) -> Result<()> {
    let mut b = arena.carve(d)?;
    compute::forward(cx, d, w, ids, &mut b)?;
    T::cross_entropy_forward(
        cx.stream,
        &b.logits,
        targets,
        d.vocab,
        &mut b.row_loss,
        totals,
    )?;
    Ok(())
}
