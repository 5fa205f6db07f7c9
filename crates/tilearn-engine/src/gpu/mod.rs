//! The Llama training step on a CUDA device (feature `cuda`).
//!
//! [`GpuLlama`] takes a [`LlamaForCausalLM`]'s parameters to the device once and runs the same
//! computation as the CPU engine with the hand-written kernels and cuBLASLt of
//! `tilearn_ops::cuda`:
//!
//! * **Parameters**: the fp32 master weights in one flat device buffer laid out exactly as
//!   [`ParamStore`] (Hugging Face order), and when a 16-bit precision may run, a working copy
//!   in a second flat buffer (bf16 or f16, the current period's type), which the forward and
//!   backward read and the fused AdamW rewrites.
//! * **Gradients**: one flat f32 buffer with the same layout; every call of
//!   [`GpuLlama::forward_backward`] adds (`+=`) into it, so gradient accumulation over
//!   micro-batches is a sequence of calls followed by one [`GpuLlama::step`]
//!   ([`GpuLlama::zero_grad`] clears it).
//! * **Activations** and their gradients: one arena sized for the widest activation type the
//!   model may run in plus one f32 arena for per-row statistics, allocated at build for
//!   (batch, seq) and carved per call as the current type; a step
//!   allocates no device memory of its own (the RMSNorm backward's dweight partials and the
//!   embedding backward's sort buffers are scratch allocated at build too, see [`GpuMemory`]).
//!
//! Precision (a [`DType`], the workspace's one precision type): [`DType::F32`] runs everything
//! in f32 (the exactness tests compare it with the CPU engine and transformers); [`DType::BF16`]
//! and [`DType::F16`] keep activations and the working weights in 16 bits with f32
//! accumulation inside every kernel, f32 parameter gradients, f32 master weights and f32
//! optimizer moments (mixed precision as `torch.autocast` + fp32 master weights). A model built
//! with [`GpuLlama::with_precisions`] switches between its precisions per call
//! ([`GpuLlama::set_precision`]) without allocating: adaptive mixed precision changes the mode
//! between periods. f16 needs loss scaling: [`GpuLlama::forward_backward_scaled`] multiplies
//! the loss by the GradScaler's scale, [`GpuLlama::unscale_and_check`] is its unscale and
//! non-finite check, and [`GpuLlama::step`] then applies `1/scale` inside the fused kernel.
//!
//! Synchronisation: everything is queued on the device's one stream. The only host wait of a
//! training step is [`GpuLlama::forward_backward`] reading back the loss sum (a 32-byte copy of
//! the cross-entropy totals, which also reports out-of-range labels), plus, in a loss-scaled
//! step, [`GpuLlama::unscale_and_check`] reading the unscaled gradient norm; [`GpuLlama::step`]
//! never waits. Token ids and labels are validated on the host before upload, so a bad id is a typed
//! error before any launch.

mod arena;
mod compute;
mod cx;
mod decode;
mod graph;
mod inputs;
mod layer_copy;
mod lce;
mod linalg;
mod linear;
mod mlp;
mod norms;
mod offload;
mod optim;
mod precision;
mod resid_offload;
mod sink;
mod stage;
mod staging;
mod tensor_parallel;
mod transfer;
mod views;
mod vocab_parallel;
mod vocab_shard;
mod weights;
mod zero;

use std::sync::Arc;

pub use decode::GpuDecoder;
pub use graph::{GraphStats, StepRun, TrainStep};
pub use sink::GradientSink;
use sink::Handoff;
pub use stage::StageBuffer;
pub use tensor_parallel::{DeviceSums, GroupDeviceSums};

use cudarc::driver::{
    CudaContext, CudaSlice, CudaView, CudaViewMut, DeviceRepr, DriverError, PinnedHostSlice,
    ValidAsZeroBits, sys,
};
use tilearn_ops::cpu::{IGNORE_INDEX, RopeTable};
use tilearn_ops::cuda::{
    CeTotals, CudaStream, DeviceFloat, EmbeddingBackwardScratch, FlashBackward, GpuDevice,
    GpuRopeTable, LayerNormScratch, RmsNormScratch, TokenIdCheck, ZLossScratch,
};
use tilearn_ops::{DType, OpsError};
use tilearn_optim::cuda::ParamCopy;
use tilearn_optim::{AdamWConfig, ParamGroup};

pub use optim::GpuAdamW;
pub use precision::HalfViewMut;
pub use zero::GatheredWeights;
use zero::GradWindow;

use arena::{ActStore, Arena, ArenaPlan, Dims};
use compute::Cx;
use graph::GraphState;
use lce::GradFactor;
use linalg::Matmul;
use offload::Offload;
use precision::{WorkingCopy, with_elem};
use weights::{Weights, weights};

use crate::config::{LlamaConfig, NormKind, PositionEncoding, RopeScalingConfig};
use crate::error::{EngineError, Result};
use crate::lce_chunk::LceChunk;
use crate::memory_mode::MemoryMode;
use crate::mlp_chunk::mlp_chunk_rows;
use crate::model::{LlamaForCausalLM, LossStats, ModelLayout};
use crate::params::{ParamSpec, ParamStore};

/// Device memory of a [`GpuLlama`], in bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GpuMemory {
    /// fp32 master weights.
    pub master_bytes: usize,
    /// 16-bit working copy (0 when built for f32 only).
    pub working_copy_bytes: usize,
    /// fp32 gradient buffer: the whole model's, or under ZeRO-2 the owned shard's
    /// accumulator plus the backward's window (`grad_window_bytes` of it).
    pub grad_bytes: usize,
    /// Under ZeRO-2: the window the backward writes its parts in (part of `grad_bytes`).
    pub grad_window_bytes: usize,
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

/// A Llama causal LM on one GPU: parameters, gradients, activations and (once configured)
/// AdamW state in device memory.
#[derive(Debug)]
pub struct GpuLlama {
    device: GpuDevice,
    config: LlamaConfig,
    layout: ModelLayout,
    specs: Vec<ParamSpec>,
    /// The precisions it was built for, and the one the next call runs in.
    precisions: Vec<DType>,
    precision: DType,
    gradient_checkpointing: bool,
    /// `--deterministic`: the flash attention backward without atomics (see
    /// [`GpuLlama::set_deterministic`]).
    deterministic: bool,
    /// Tokens per chunk of the loss head at capacity, and the bytes of its logits buffer.
    lce_rows: usize,
    logits_buffer_bytes: usize,
    /// Capacity of the arena.
    batch: usize,
    seq: usize,
    /// Whether the rope table of a shorter sequence is a prefix of the built one (false only
    /// for dynamic NTK scaling beyond `original_max_position_embeddings`).
    rope_prefix_ok: bool,
    /// The fp32 master weights: the whole flat buffer, or under ZeRO with a 16-bit working
    /// copy only the elements `master_shard` (see `zero.rs`).
    master: CudaSlice<f32>,
    master_shard: Option<std::ops::Range<usize>>,
    /// The fp32 gradients: the whole flat buffer, or under ZeRO-2 (`grad_window`) only the
    /// owned shard's accumulated gradients (global elements `grad_window.owned`).
    grads: CudaSlice<f32>,
    /// ZeRO-2: the window the backward writes its parts in (see `zero.rs`).
    grad_window: Option<GradWindow>,
    /// The whole model's fp32 weights are readable (gathered for a save, or loaded) while the
    /// master weights are sharded: in the gradient buffer, or under ZeRO-2 in `whole_staging`
    /// (cleared by the next backward or `zero_grad`).
    grads_hold_params: bool,
    /// Under ZeRO-2, where a save gathers and a load streams the whole fp32 weights when the
    /// idle activation arena is too small for them (`whole_in_arena` otherwise): allocated for
    /// that and freed by the next backward or `zero_grad` (the gradient buffer is too short).
    whole_staging: Option<CudaSlice<f32>>,
    /// Under ZeRO-2 the whole fp32 weights are in the idle activation arena (see `zero.rs`);
    /// the next forward's carving clears this and `grads_hold_params`.
    whole_in_arena: bool,
    arena: Arena,
    /// Present when a 16-bit precision is among `precisions`.
    work: Option<WorkingCopy>,
    rope: GpuRopeTable,
    ids: CudaSlice<u32>,
    targets: CudaSlice<i32>,
    /// Page-locked host staging of the ids and shifted targets (capacity-sized, allocated at
    /// build): copies from pageable memory would make the driver wait for the stream before
    /// each upload, a second synchronisation per step. Each buffer's own event makes a rewrite
    /// wait only for that buffer's previous copy.
    host_ids: PinnedHostSlice<u32>,
    host_targets: PinnedHostSlice<i32>,
    /// Position ids of packed rows for the calls of their shape (see
    /// [`GpuLlama::set_position_ids`]), with that `(batch, seq)`.
    position_ids: Option<(CudaSlice<i32>, usize, usize)>,
    check: TokenIdCheck,
    totals: CeTotals,
    mm: Matmul,
    /// dweight partials of every RMSNorm backward (sized for `batch * seq` rows at build).
    norm_scratch: RmsNormScratch,
    /// Sort buffers of the embedding backward (sized for `batch * seq` tokens at build).
    embed_scratch: EmbeddingBackwardScratch,
    /// ALiBi slopes `[q_heads]` (Baichuan-13B), `None` for RoPE models.
    alibi: Option<CudaSlice<f32>>,
    /// Row maxima of Baichuan2's z-loss, when `z_loss_weight` is non-zero.
    z_loss: Option<ZLossScratch>,
    /// dweight/dbias partials of the LayerNorm backwards (Bloom).
    ln_scratch: Option<LayerNormScratch>,
    optimizer: Option<GpuAdamW>,
    /// The lean memory mode's host master weights and optimizer (`None`: default mode).
    offload: Option<Offload>,
    /// Checkpoint offload's host copies and copy stream (`None`: off; see
    /// [`GpuLlama::set_offload_checkpoints`]).
    resid_offload: Option<resid_offload::ResidOffload>,
    memory: GpuMemory,
    /// `--cuda-graphs` and the recorded step (see `graph.rs`).
    graphs: GraphState,
    /// Tensor parallelism: the group completing the partial sums of this rank's slices (see
    /// `tensor_parallel.rs`); `None` for the whole model.
    tp: Option<Box<dyn DeviceSums>>,
    /// The rank's rows of the vocabulary under tensor parallelism (see `vocab_parallel.rs`).
    vocab: Option<vocab_shard::VocabShard>,
}

/// The model's buffers split for one forward (and backward) pass: what every op needs, and the
/// buffers the pass reads and writes (disjoint borrows of one [`GpuLlama`]).
struct Pass<'a> {
    cx: Cx<'a>,
    master: &'a CudaSlice<f32>,
    work: Option<&'a mut WorkingCopy>,
    numel: usize,
    precision: DType,
    arena: &'a mut Arena,
    grads: &'a mut CudaSlice<f32>,
    window: Option<&'a mut GradWindow>,
    totals: &'a mut CeTotals,
    ids: &'a CudaSlice<u32>,
    targets: &'a CudaSlice<i32>,
}

/// A page-locked, write-combined host buffer of `len` elements filled with `fill`: for data the
/// host writes and the device reads.
fn pinned<T: DeviceRepr + ValidAsZeroBits + Copy>(
    ctx: &Arc<CudaContext>,
    len: usize,
    fill: T,
) -> Result<PinnedHostSlice<T>> {
    pinned_with_flags(ctx, len, fill, sys::CU_MEMHOSTALLOC_WRITECOMBINED)
}

/// A page-locked host buffer of `len` elements allocated with `cuMemHostAlloc` `flags`, filled
/// with `fill`. Leave out `CU_MEMHOSTALLOC_WRITECOMBINED` when the host reads the buffer: reads
/// of write-combined memory bypass the CPU caches and are many times slower.
fn pinned_with_flags<T: DeviceRepr + ValidAsZeroBits + Copy>(
    ctx: &Arc<CudaContext>,
    len: usize,
    fill: T,
    flags: u32,
) -> Result<PinnedHostSlice<T>> {
    // SAFETY: the allocation is uninitialised; it is filled below before anything (host code
    // or a copy) reads it.
    let mut buf = unsafe { ctx.alloc_pinned_with_flags::<T>(len.max(1), flags) }
        .map_err(|e| cuda_err("allocating page-locked staging memory", e))?;
    buf.as_mut_slice()
        .map_err(|e| cuda_err("initialising page-locked staging memory", e))?
        .fill(fill);
    Ok(buf)
}

/// A driver error as an engine error.
/// Allocates with cudarc's event tracking off, for the gradient buffer (see `sink.rs`: the
/// data-parallel collectives on finished parts must not make the backward's later kernels
/// wait). Every use of it is on the compute stream, except those collectives, which order
/// themselves after it and are ordered before the next reader by hand.
pub(crate) fn untracked<T>(
    stream: &Arc<CudaStream>,
    alloc: impl FnOnce() -> std::result::Result<T, DriverError>,
) -> std::result::Result<T, DriverError> {
    let ctx = stream.context();
    let was = ctx.is_event_tracking();
    // SAFETY: tracking is off only for this one allocation (the flag is read when a slice is
    // created) and restored at once; the model is built on one thread. The slice's cross-stream
    // uses are ordered by hand as described above.
    unsafe { ctx.disable_event_tracking() };
    let out = alloc();
    if was {
        // SAFETY: restores the context's default for every later allocation.
        unsafe { ctx.enable_event_tracking() };
    }
    out
}

/// The gradients of the global elements `range` from the buffer `grads` holds: the whole
/// model, or under ZeRO-2 (`window`) the owned shard.
fn held_grads<'a>(
    grads: &'a CudaSlice<f32>,
    window: Option<&GradWindow>,
    range: std::ops::Range<usize>,
) -> Result<CudaView<'a, f32>> {
    let base = window.map_or(0, |w| w.owned.start);
    let end = window.map_or(grads.len(), |w| w.owned.end);
    if range.start < base || range.end > end || range.start > range.end {
        return Err(invalid(
            "gradients",
            format!(
                "elements {range:?} are not held here (this rank holds {base}..{end}; ZeRO-2 \
                 keeps only the owned shard)"
            ),
        ));
    }
    Ok(grads.slice(range.start - base..range.end - base))
}

/// The loss denominator of a step: the given token count (a non-negative finite number, the
/// accumulated batch's) or, when none is given, this call's `valid` targets.
pub(crate) fn denominator_or_valid(given: Option<f64>, valid: usize) -> Result<f64> {
    match given {
        None => Ok(valid as f64),
        Some(x) if x >= 0.0 && x.is_finite() => Ok(x),
        Some(x) => Err(invalid(
            "loss_denominator",
            format!("{x} is not a non-negative finite number; pass the token count"),
        )),
    }
}

pub(crate) fn cuda_err(what: &str, e: DriverError) -> EngineError {
    EngineError::Ops(OpsError::Cuda {
        context: "tilearn_engine::gpu",
        message: format!("{what}: {e}"),
    })
}

/// [`cuda_err`] for an allocation of `bytes` for a step of `tokens` tokens: out of memory, the
/// message says how much was asked, how much the device has free and what needs less, rather
/// than the driver's bare `CUDA_ERROR_OUT_OF_MEMORY`.
pub(crate) fn step_alloc_err(
    what: &str,
    bytes: usize,
    tokens: usize,
    stream: &CudaStream,
    e: DriverError,
) -> EngineError {
    alloc_err(
        what,
        &format!("{:.1} GiB for {tokens} tokens a step", gib(bytes)),
        STEP_NEEDS_LESS,
        stream,
        e,
    )
}

/// [`cuda_err`] for an allocation of `bytes` of the model's own state (master weights,
/// gradients, the 16-bit copy, optimizer moments, their shards): out of memory, the message
/// says how much was asked, how much is free and what keeps less of the model on each GPU.
pub(crate) fn model_alloc_err(
    what: &str,
    bytes: usize,
    stream: &CudaStream,
    e: DriverError,
) -> EngineError {
    alloc_err(
        what,
        &format!("{:.1} GiB", gib(bytes)),
        MODEL_NEEDS_LESS,
        stream,
        e,
    )
}

const STEP_NEEDS_LESS: &str = "a step of fewer tokens (a shorter sequence or a smaller batch), \
     --gradient-checkpointing, or with it --offload-checkpoints on (layer inputs in page-locked \
     host memory) needs less";

const MODEL_NEEDS_LESS: &str = "--memory lean (fp32 master weights and optimizer state in host \
     memory), --zero-stage 1 or 2 over data-parallel ranks, or --tp-size / --pp-size keep less \
     of the model on each GPU (`tilearn plan` estimates each)";

fn gib(bytes: usize) -> f64 {
    bytes as f64 / (1u64 << 30) as f64
}

fn alloc_err(
    what: &str,
    asked: &str,
    needs_less: &str,
    stream: &CudaStream,
    e: DriverError,
) -> EngineError {
    if e.0 != cudarc::driver::sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY {
        return cuda_err(what, e);
    }
    let free = stream.context().mem_get_info().ok();
    EngineError::Ops(OpsError::Cuda {
        context: "tilearn_engine::gpu",
        message: out_of_memory_message(what, asked, free, needs_less),
    })
}

/// "{what}: {asked} do not fit ({free} of the GPU's {total} GiB are free); {needs_less}".
fn out_of_memory_message(
    what: &str,
    asked: &str,
    free_total: Option<(usize, usize)>,
    needs_less: &str,
) -> String {
    let free = match free_total {
        Some((free, total)) => format!(
            "{:.1} of the GPU's {:.1} GiB are free",
            gib(free),
            gib(total)
        ),
        None => "the GPU has less free".into(),
    };
    format!("{what}: {asked} do not fit ({free}); {needs_less}")
}

fn invalid(argument: &str, message: String) -> EngineError {
    EngineError::InvalidArgument {
        argument: argument.to_string(),
        message,
    }
}

impl GpuLlama {
    /// Uploads `model`'s parameters to `device` and allocates gradients and the activation
    /// arena for calls of up to `batch` sequences of `seq` tokens, in one fixed `precision`.
    pub fn new(
        device: &GpuDevice,
        model: &LlamaForCausalLM,
        batch: usize,
        seq: usize,
        precision: DType,
    ) -> Result<GpuLlama> {
        Self::with_precisions(device, model, batch, seq, &[precision])
    }

    /// As [`GpuLlama::new`], for a model that may run any of `precisions` (switched with
    /// [`GpuLlama::set_precision`]; it starts in the first). Buffers are sized for the widest.
    pub fn with_precisions(
        device: &GpuDevice,
        model: &LlamaForCausalLM,
        batch: usize,
        seq: usize,
        precisions: &[DType],
    ) -> Result<GpuLlama> {
        Self::with_options(device, model, batch, seq, precisions, false)
    }

    /// As [`GpuLlama::with_precisions`], optionally with gradient checkpointing: the arena
    /// keeps every block's input but only one set of per-layer activations, and the backward
    /// recomputes each block's forward before differentiating it (one more forward per step,
    /// the same results bit for bit, a fraction of the activation memory).
    pub fn with_options(
        device: &GpuDevice,
        model: &LlamaForCausalLM,
        batch: usize,
        seq: usize,
        precisions: &[DType],
        gradient_checkpointing: bool,
    ) -> Result<GpuLlama> {
        Self::with_lce_chunk(
            device,
            model,
            batch,
            seq,
            precisions,
            gradient_checkpointing,
            LceChunk::Auto,
        )
    }

    /// As [`GpuLlama::with_options`], with the loss head's chunking `lce` (how many tokens'
    /// logits exist at once; see [`crate::lce_chunk`]).
    pub fn with_lce_chunk(
        device: &GpuDevice,
        model: &LlamaForCausalLM,
        batch: usize,
        seq: usize,
        precisions: &[DType],
        gradient_checkpointing: bool,
        lce: LceChunk,
    ) -> Result<GpuLlama> {
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
        let mut gpu = Self::for_config_with_lce_chunk(
            device,
            &model.config,
            batch,
            seq,
            precisions,
            gradient_checkpointing,
            lce,
        )?;
        gpu.upload_params(&model.params)?;
        gpu.device.synchronize()?;
        Ok(gpu)
    }

    /// As [`GpuLlama::with_options`] for the model `config` describes, with zeroed parameters:
    /// fill them with [`GpuLlama::fill_params`] (a checkpoint streamed from disk, or the random
    /// initialisation) without a host copy of the model.
    pub fn for_config(
        device: &GpuDevice,
        config: &LlamaConfig,
        batch: usize,
        seq: usize,
        precisions: &[DType],
        gradient_checkpointing: bool,
    ) -> Result<GpuLlama> {
        Self::for_config_with_lce_chunk(
            device,
            config,
            batch,
            seq,
            precisions,
            gradient_checkpointing,
            LceChunk::Auto,
        )
    }

    /// As [`GpuLlama::for_config`], with the loss head's chunking `lce`: the arena holds the
    /// logits of `lce.rows(batch * seq, vocab, widest element)` tokens instead of all of them.
    pub fn for_config_with_lce_chunk(
        device: &GpuDevice,
        config: &LlamaConfig,
        batch: usize,
        seq: usize,
        precisions: &[DType],
        gradient_checkpointing: bool,
        lce: LceChunk,
    ) -> Result<GpuLlama> {
        Self::for_config_with_memory(
            device,
            config,
            batch,
            seq,
            precisions,
            gradient_checkpointing,
            lce,
            MemoryMode::Default,
        )
    }

    /// As [`GpuLlama::with_lce_chunk`], in memory mode `memory` (see [`crate::memory_mode`]).
    #[allow(clippy::too_many_arguments)]
    pub fn with_memory(
        device: &GpuDevice,
        model: &LlamaForCausalLM,
        batch: usize,
        seq: usize,
        precisions: &[DType],
        gradient_checkpointing: bool,
        lce: LceChunk,
        memory: MemoryMode,
    ) -> Result<GpuLlama> {
        let mut gpu = Self::for_config_with_memory(
            device,
            &model.config,
            batch,
            seq,
            precisions,
            gradient_checkpointing,
            lce,
            memory,
        )?;
        gpu.upload_params(&model.params)?;
        Ok(gpu)
    }

    /// As [`GpuLlama::for_config_with_lce_chunk`], in memory mode `memory`: `Lean` keeps
    /// the fp32 master weights and the AdamW moments in host memory and recomputes the MLP
    /// activation in the backward (see [`crate::memory_mode`]); it runs bf16 alone.
    #[allow(clippy::too_many_arguments)]
    pub fn for_config_with_memory(
        device: &GpuDevice,
        config: &LlamaConfig,
        batch: usize,
        seq: usize,
        precisions: &[DType],
        gradient_checkpointing: bool,
        lce: LceChunk,
        memory: MemoryMode,
    ) -> Result<GpuLlama> {
        Self::build_with_tensors(
            device,
            config,
            None,
            batch,
            seq,
            precisions,
            gradient_checkpointing,
            lce,
            memory,
        )
    }

    /// [`GpuLlama::for_config_with_memory`] for the tensors `tensors` lists (their specs and
    /// layout: a pipeline stage's, see `stage.rs`), or `config`'s whole model when `None`.
    #[allow(clippy::too_many_arguments)]
    fn build_with_tensors(
        device: &GpuDevice,
        config: &LlamaConfig,
        tensors: Option<(Vec<ParamSpec>, ModelLayout)>,
        batch: usize,
        seq: usize,
        precisions: &[DType],
        gradient_checkpointing: bool,
        lce: LceChunk,
        memory: MemoryMode,
    ) -> Result<GpuLlama> {
        if batch == 0 || seq == 0 {
            return Err(invalid("batch/seq", "must both be positive".into()));
        }
        let mut allowed: Vec<DType> = Vec::new();
        for &p in precisions {
            if !allowed.contains(&p) {
                allowed.push(p);
            }
        }
        let Some(&precision) = allowed.first() else {
            return Err(invalid(
                "precisions",
                "is empty; name at least one precision".into(),
            ));
        };
        let widest = allowed.iter().map(|p| p.size_in_bytes()).max().unwrap_or(4);
        let config = config.clone();
        let (specs, layout) = tensors.unwrap_or_else(|| {
            (
                ParamStore::specs_for(&config),
                ModelLayout::from_config(&config),
            )
        });
        let stream = device.stream().clone();
        let ctx = device.ctx();
        ctx.bind_to_thread()
            .map_err(|e| cuda_err("binding the device context", e))?;
        let (free_before, total) = ctx
            .mem_get_info()
            .map_err(|e| cuda_err("querying device memory", e))?;

        memory.check(&allowed, 1)?;
        let lean = memory.is_lean();
        let cap = Dims::new(&config, batch, seq);
        let n = cap.n;
        let numel = layout.numel;
        // Lean: one element, never read (the master weights are on the host; the empty
        // shard below marks the buffer so, see `offload.rs`).
        let master_len = if lean { 1 } else { numel.max(1) };
        let master = stream.alloc_zeros::<f32>(master_len).map_err(|e| {
            model_alloc_err("allocating the master weights", 4 * master_len, &stream, e)
        })?;
        let grads =
            untracked(&stream, || stream.alloc_zeros::<f32>(numel.max(1))).map_err(|e| {
                model_alloc_err("allocating the gradient buffer", 4 * numel, &stream, e)
            })?;
        let lce_rows = lce.rows(n, config.vocab_size, widest);
        let logits_buffer_bytes = cap.logits_len(lce_rows) * widest;
        // Lean, and checkpointing (one shared layer set, recomputed in the backward anyway):
        // the backward recomputes `silu(gate) * up` instead of keeping `[N, I]` for it.
        let act = if lean || gradient_checkpointing {
            ActStore::Recomputed
        } else {
            ActStore::Kept
        };
        let plan = ArenaPlan {
            checkpointing: gradient_checkpointing,
            act,
            logit_rows: lce_rows,
            mlp_rows: mlp_chunk_rows(n, config.intermediate_size, widest, gradient_checkpointing),
            resid_slots: None,
        };
        let arena = Arena::new(&stream, &cap, widest, plan)?;
        let arena_bytes = arena.bytes();
        let mut work = if allowed.iter().any(|p| p.is_half()) {
            Some(WorkingCopy::new(&stream, numel)?)
        } else {
            None
        };
        match work.as_mut() {
            // Zeros, as the host master until the first upload or load.
            Some(w) if lean => w.written_as(precision),
            Some(w) => w.refresh(&stream, &master, precision)?,
            None => {}
        }
        let offload = if lean {
            Some(Offload::new(ctx, numel)?)
        } else {
            None
        };
        let work_bytes = work.as_ref().map_or(0, WorkingCopy::bytes);
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
        let mm = Matmul::new(&stream, &cap, widest, FlashBackward::OnePass)?;
        let norm_scratch = RmsNormScratch::new(&stream, n, config.hidden_size)?;
        let embed_scratch = EmbeddingBackwardScratch::new(&stream, n, config.vocab_size)?;
        let alibi = match config.family.position_encoding() {
            PositionEncoding::Alibi => Some(
                stream
                    .clone_htod(&tilearn_ops::alibi_slopes(config.num_attention_heads))
                    .map_err(|e| cuda_err("uploading the ALiBi slopes", e))?,
            ),
            PositionEncoding::Rope => None,
        };
        let ln_scratch = if config.family.norm_kind() == NormKind::Layer {
            Some(LayerNormScratch::new(&stream, n, config.hidden_size)?)
        } else {
            None
        };
        let z_loss = if config.z_loss_weight != 0.0 {
            Some(ZLossScratch::new(&stream, n)?)
        } else {
            None
        };

        let master_bytes = master.num_bytes();
        let grad_bytes = grads.num_bytes();
        let activation_bytes = arena_bytes + ids.num_bytes() + targets.num_bytes();
        let workspace_bytes = mm.bytes()
            + norm_scratch.bytes()
            + embed_scratch.bytes()
            + z_loss.as_ref().map_or(0, ZLossScratch::bytes)
            + ln_scratch
                .as_ref()
                .map_or(0, |_| 4 * LayerNormScratch::len_for(n, config.hidden_size));
        let mut gpu = GpuLlama {
            device: device.clone(),
            specs,
            layout,
            precisions: allowed,
            precision,
            gradient_checkpointing,
            deterministic: false,
            lce_rows,
            logits_buffer_bytes,
            batch,
            seq,
            rope_prefix_ok,
            master,
            master_shard: lean.then_some(0..0),
            grads,
            grad_window: None,
            grads_hold_params: false,
            whole_staging: None,
            whole_in_arena: false,
            arena,
            work,
            rope,
            ids,
            targets,
            host_ids,
            host_targets,
            position_ids: None,
            check,
            totals,
            mm,
            norm_scratch,
            embed_scratch,
            alibi,
            z_loss,
            ln_scratch,
            optimizer: None,
            offload,
            resid_offload: None,
            graphs: GraphState::default(),
            tp: None,
            vocab: None,
            memory: GpuMemory {
                master_bytes,
                working_copy_bytes: work_bytes,
                grad_bytes,
                grad_window_bytes: 0,
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

    /// The numeric mode the next call runs in.
    pub fn precision(&self) -> DType {
        self.precision
    }

    /// The precisions this model was built for.
    pub fn precisions(&self) -> &[DType] {
        &self.precisions
    }

    /// Whether the backward recomputes each block's forward (see [`GpuLlama::with_options`]).
    pub fn gradient_checkpointing(&self) -> bool {
        self.gradient_checkpointing
    }

    /// Makes the following backwards bit-reproducible (`true`) or lets the flash attention
    /// backward take its one-pass form (`false`, the default; see
    /// `tilearn_ops::cuda::FlashBackward`): where the Hopper kernels run, one kernel computes
    /// dK, dV and dQ, summing dQ with f32 atomic adds, which is faster but rounds differently
    /// from run to run. Reallocates the attention workspace when its one-pass scratch is added
    /// or dropped (and then recaptures a CUDA graph at the next step).
    pub fn set_deterministic(&mut self, deterministic: bool) -> Result<()> {
        let before = self.mm.bytes();
        let stream = self.device.stream().clone();
        let backward = FlashBackward::from_deterministic(deterministic);
        if self.mm.set_flash_backward(&stream, backward)? {
            self.graphs.invalidate();
            let after = self.mm.bytes();
            for bytes in [&mut self.memory.workspace_bytes, &mut self.memory.own_bytes] {
                *bytes = (*bytes + after).saturating_sub(before);
            }
        }
        self.deterministic = deterministic;
        Ok(())
    }

    /// Whether the backward is bit-reproducible (see [`GpuLlama::set_deterministic`]).
    pub fn deterministic(&self) -> bool {
        self.deterministic
    }

    /// The flash attention backward an unmasked 16-bit call runs: `OnePass` only when the
    /// model is not deterministic, the flash kernels serve its shape and the device runs their
    /// Hopper form; otherwise `Deterministic`.
    pub fn flash_backward(&self) -> FlashBackward {
        self.mm.flash_backward()
    }

    /// Tokens per chunk of the fused linear + cross entropy for a full-capacity call (equal to
    /// `batch * seq` when unchunked).
    pub fn lce_chunk_tokens(&self) -> usize {
        self.lce_rows
    }

    /// Bytes of the arena's logits buffer (one chunk of `lce_chunk_tokens` tokens, in the
    /// widest element type the model may run in); part of
    /// [`GpuMemory::activation_bytes`].
    pub fn logits_buffer_bytes(&self) -> usize {
        self.logits_buffer_bytes
    }

    /// Whether 16-bit periods run attention through the fused flash kernels at this model's
    /// shape (bf16/f16 at head_dim 64 or 128); f32 periods and other shapes use the cuBLASLt
    /// path.
    pub fn flash_attention(&self) -> bool {
        let d = Dims::new(&self.config, self.batch, self.seq);
        tilearn_ops::cuda::flash_attention_supports::<half::bf16>(tilearn_ops::cpu::AttnShape {
            batch: d.batch,
            seq: d.seq,
            q_heads: d.q_heads,
            kv_heads: d.kv_heads,
            head_dim: d.head_dim,
        })
    }

    /// Runs the following calls in `precision`, which must be one the model was built for.
    /// Allocates nothing; entering a 16-bit precision casts the master weights into the
    /// working copy (queued) unless it already holds them in that type.
    pub fn set_precision(&mut self, precision: DType) -> Result<()> {
        if !self.precisions.contains(&precision) {
            let built: Vec<String> = self.precisions.iter().map(|p| p.to_string()).collect();
            return Err(invalid(
                "precision",
                format!(
                    "{precision} was not among the precisions this device model was built for \
                     ({}); build it with GpuLlama::with_precisions including {precision}",
                    built.join(", ")
                ),
            ));
        }
        if self.master_shard.is_some() {
            // Only a whole master can be re-cast; a sharded one was chosen because the model
            // runs one 16-bit precision, which its working copy always holds.
            if self.work.as_ref().and_then(WorkingCopy::holds) != Some(precision) {
                return Err(invalid(
                    "precision",
                    format!(
                        "{precision}: the fp32 master weights are sharded (ZeRO) and the \
                         working copy holds another type; run ZeRO with one 16-bit precision"
                    ),
                ));
            }
        } else if let Some(w) = self.work.as_mut() {
            w.refresh(self.device.stream(), &self.master, precision)?;
        }
        self.precision = precision;
        Ok(())
    }

    /// Makes this model one rank of a tensor-parallel group: it must have been built for the
    /// rank's local config ([`ShardPlan::local_config`](crate::model::tensor_parallel::ShardPlan::local_config))
    /// and hold the rank's slices; `sums` completes the row-parallel outputs and the
    /// column-parallel input gradients (and, after [`set_vocab_slice`](Self::set_vocab_slice),
    /// the vocabulary-parallel embedding and loss head). Every call of a pass then
    /// communicates, so CUDA graphs are turned off.
    pub fn set_tensor_parallel(&mut self, sums: Box<dyn DeviceSums>) {
        self.graphs.invalidate();
        self.set_cuda_graphs(crate::cuda_graphs::CudaGraphs::Off);
        self.tp = Some(sums);
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

    /// Splits the model into the borrows of one pass.
    fn pass(&mut self) -> Pass<'_> {
        let GpuLlama {
            device,
            layout,
            master,
            grads,
            grad_window,
            arena,
            work,
            rope,
            ids,
            targets,
            check,
            totals,
            mm,
            norm_scratch,
            embed_scratch,
            precision,
            position_ids,
            tp,
            vocab,
            alibi,
            z_loss,
            ln_scratch,
            resid_offload,
            ..
        } = self;
        Pass {
            cx: Cx {
                stream: device.stream(),
                layout,
                rope,
                mm,
                check,
                norm_scratch,
                embed_scratch,
                positions: position_ids.as_ref().map(|(p, _, _)| p.as_view()),
                tp: tp.as_deref(),
                vocab: vocab.as_mut(),
                alibi: alibi.as_ref().map(|a| a.as_view()),
                z_loss: z_loss.as_mut(),
                ln_scratch: ln_scratch.as_mut(),
                resid_offload: resid_offload.as_mut(),
            },
            master,
            work: work.as_mut(),
            numel: layout.numel,
            precision: *precision,
            arena,
            grads,
            window: grad_window.as_mut(),
            totals,
            ids,
            targets,
        }
    }

    /// Bytes of the widest element type the model may run in (its activation buffers' unit).
    fn widest_elem_bytes(&self) -> usize {
        self.precisions
            .iter()
            .map(|p| p.size_in_bytes())
            .max()
            .unwrap_or(4)
    }

    /// Books a set-up reallocation of one part of the model (`part` of [`GpuMemory`], from
    /// `before` to `after` bytes) and restarts the observed peak, which the replaced
    /// allocation would otherwise keep (waits for the device, so the pool has let it go).
    fn rebooked(
        &mut self,
        part: fn(&mut GpuMemory) -> &mut usize,
        before: usize,
        after: usize,
    ) -> Result<()> {
        let resize = |bytes: &mut usize| *bytes = (*bytes + after).saturating_sub(before);
        resize(part(&mut self.memory));
        resize(&mut self.memory.own_bytes);
        self.device.synchronize()?;
        self.memory.device_used_peak = 0;
        self.sample_memory()
    }

    /// Replaces the activation arena by one sized as `plan` says (set-up work: CUDA graphs
    /// captured over the old one are dropped) and books the change. The old arena goes first
    /// (its readers are queued on the stream, its memory returns to the pool in stream order),
    /// so the two never exist together: at long contexts they would not fit. A failed
    /// allocation leaves the placeholder, whose carving fails with an error at the next call.
    fn rebuild_arena(&mut self, plan: ArenaPlan) -> Result<()> {
        let stream = self.device.stream().clone();
        let cap = Dims::new(&self.config, self.batch, self.seq);
        let widest = self.widest_elem_bytes();
        let before = self.arena.bytes();
        self.graphs.invalidate();
        self.arena = Arena::placeholder(&stream, plan)?;
        self.device.synchronize()?;
        self.arena = Arena::new(&stream, &cap, widest, plan)?;
        let after = self.arena.bytes();
        self.rebooked(|m| &mut m.activation_bytes, before, after)
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

    /// Forward and backward on the device with Hugging Face *unshifted* `labels` (`-100` =
    /// ignore): the same contract as [`LlamaForCausalLM::forward_backward`]. The loss is
    /// `loss_sum / loss_denominator` (default: this call's valid targets; pass the whole
    /// accumulated batch's [`count_valid_targets`](crate::model::count_valid_targets) when
    /// accumulating); parameter gradients are added into the device gradient buffer.
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
        self.forward_backward_scaled(ids, labels, batch, seq, loss_denominator, 1.0)
    }

    /// [`forward_backward`](Self::forward_backward) of `loss * loss_scale` (the GradScaler's
    /// `scale(loss)`): the gradients added are `loss_scale` times the loss's. The returned loss
    /// is unscaled. In f16 a large scale can overflow activation gradients to inf;
    /// [`unscale_and_check`](Self::unscale_and_check) reports it.
    pub fn forward_backward_scaled(
        &mut self,
        ids: &[u32],
        labels: &[i32],
        batch: usize,
        seq: usize,
        loss_denominator: Option<f64>,
        loss_scale: f32,
    ) -> Result<LossStats> {
        self.forward_backward_into(ids, labels, batch, seq, loss_denominator, loss_scale, None)
    }

    /// [`forward_backward_scaled`](Self::forward_backward_scaled) that hands the finished
    /// parts of the gradient buffer to `sink` during the backward (see [`GradientSink`]);
    /// on return the compute stream is ordered after the sink's work.
    #[allow(clippy::too_many_arguments)]
    pub fn forward_backward_into(
        &mut self,
        ids: &[u32],
        labels: &[i32],
        batch: usize,
        seq: usize,
        loss_denominator: Option<f64>,
        loss_scale: f32,
        sink: Option<&mut dyn GradientSink>,
    ) -> Result<LossStats> {
        if !(loss_scale.is_finite() && loss_scale > 0.0) {
            return Err(invalid(
                "loss_scale",
                format!("is {loss_scale}; use a finite value > 0 (1 = no scaling)"),
            ));
        }
        let d = self.prepare(ids, batch, seq)?;
        let valid = self.upload_targets(labels, &d)?;
        let denominator = denominator_or_valid(loss_denominator, valid)?;
        let grad_scale = if denominator > 0.0 {
            f64::from(loss_scale) / denominator
        } else {
            0.0
        };
        self.grads_hold_params = false;
        self.whole_staging = None;
        self.whole_in_arena = false;
        let p = self.pass();
        let mut cx = p.cx;
        let stream = cx.stream;
        let layout = cx.layout;
        let grads = match (p.window, sink) {
            (None, sink) => Handoff::new(p.grads.as_view_mut(), sink, layout),
            (
                Some(GradWindow {
                    plan,
                    window,
                    owned,
                }),
                Some(sink),
            ) => Handoff::windowed(
                plan,
                window.as_view_mut(),
                p.grads.slice_mut(..owned.len()),
                owned.clone(),
                sink,
                cx.stream,
            )?,
            (Some(_), None) => {
                return Err(invalid(
                    "GpuLlama::forward_backward",
                    "under ZeRO-2 this rank keeps only its owned gradients: the backward must \
                     reduce each part through a GradientSink (forward_backward_into)"
                        .into(),
                ));
            }
        };
        with_elem!(p.precision, T => train_pass::<T>(
            &mut cx,
            &d,
            &mut weights::<T>(stream, p.master, p.work, p.numel)?,
            grads,
            &p.ids.slice(..d.n),
            &p.targets.slice(..d.n),
            GradFactor::Host(grad_scale),
            p.totals,
            p.arena,
        ))?;
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
        let p = self.pass();
        let mut cx = p.cx;
        let stream = cx.stream;
        with_elem!(p.precision, T => logits_pass::<T>(
            &mut cx,
            &d,
            &mut weights::<T>(stream, p.master, p.work, p.numel)?,
            &p.ids.slice(..d.n),
            p.arena,
        ))
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
        let p = self.pass();
        let mut cx = p.cx;
        let stream = cx.stream;
        with_elem!(p.precision, T => loss_pass::<T>(
            &mut cx,
            &d,
            &mut weights::<T>(stream, p.master, p.work, p.numel)?,
            &p.ids.slice(..d.n),
            &p.targets.slice(..d.n),
            p.totals,
            p.arena,
        ))?;
        let stats = self.totals.read(self.device.stream())?;
        Ok(LossStats {
            loss_sum: stats.loss_sum,
            valid_tokens: stats.valid,
        })
    }

    /// The flat gradient buffer and the stream the backward writes it on, for data parallelism
    /// to reduce it in place (cudarc's events order the communication after the backward).
    /// Under ZeRO-2 ([`GpuLlama::shard_gradients`]) it is the owned shard's gradients only.
    pub fn gradients_mut(&mut self) -> (CudaViewMut<'_, f32>, Arc<CudaStream>) {
        let stream = self.device.stream().clone();
        (self.grads.as_view_mut(), stream)
    }

    /// Zeroes the gradient buffer (queued, no wait).
    pub fn zero_grad(&mut self) -> Result<()> {
        self.grads_hold_params = false;
        self.whole_staging = None;
        self.whole_in_arena = false;
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
        let numel = self.layout.numel;
        self.configure_optimizer_for(config, groups, max_grad_norm, 0..numel)
    }

    /// [`configure_optimizer`](Self::configure_optimizer) for the parameters `shard` only
    /// (ZeRO: the moments are allocated for the shard alone, never for the whole model).
    pub fn configure_optimizer_for(
        &mut self,
        config: AdamWConfig,
        groups: Vec<ParamGroup>,
        max_grad_norm: f64,
        shard: std::ops::Range<usize>,
    ) -> Result<()> {
        let numel = self.layout.numel;
        if shard.start > shard.end || shard.end > numel {
            return Err(invalid(
                "shard",
                format!("{shard:?} is not a range of the model's {numel} parameters"),
            ));
        }
        // Free a previous optimizer's state before allocating the new one; a recorded step
        // graph points at it.
        self.graphs.invalidate();
        self.optimizer = None;
        if self.is_lean() {
            return self.configure_offloaded(config, groups, max_grad_norm, shard);
        }
        let opt = GpuAdamW::new(self.stream(), config, groups, (numel, shard), max_grad_norm)?;
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

    /// The GradScaler's unscale and non-finite check of the accumulated gradients, which
    /// hold `scale` times the true ones: computes the global norm of `grads * inv_scale` and
    /// reads it back (one synchronisation). Returns whether any gradient is inf or NaN; if not,
    /// the next [`step`](Self::step) unscales inside the fused kernel (the gradient buffer is
    /// never rewritten) and clips with this norm. After a `true`, skip the step and call
    /// [`zero_grad`](Self::zero_grad) as usual.
    pub fn unscale_and_check(&mut self, inv_scale: f32) -> Result<bool> {
        let stream = self.device.stream().clone();
        let Some(opt) = self.optimizer.as_mut() else {
            return Err(invalid(
                "GpuLlama::unscale_and_check",
                "no optimizer: call configure_optimizer first".into(),
            ));
        };
        let grads = held_grads(&self.grads, self.grad_window.as_ref(), opt.shard())?;
        let norm = opt.unscaled_norm(&stream, grads, inv_scale)?;
        let found_inf = !norm.is_finite();
        if found_inf {
            opt.discard_prepared();
        }
        Ok(found_inf)
    }

    /// One AdamW step at learning rate `lr` with the accumulated gradients (unscaled when
    /// [`unscale_and_check`](Self::unscale_and_check) prepared it, clipped to the configured
    /// norm inside the kernel), updating the master weights and, in a 16-bit precision, the
    /// working copy in the same launch. Queued; does not wait. Does not zero the gradients.
    /// A lean model steps on the host instead (waits for the backward; see `offload.rs`).
    pub fn step(&mut self, lr: f32) -> Result<()> {
        if self.is_lean() {
            return self.offloaded_step(lr);
        }
        let GpuLlama {
            device,
            master,
            master_shard,
            grads,
            grad_window,
            work,
            optimizer,
            precision,
            ..
        } = self;
        let Some(opt) = optimizer.as_mut() else {
            return Err(invalid(
                "GpuLlama::step",
                "no optimizer: call configure_optimizer first".into(),
            ));
        };
        // The optimizer's shard (all of it without ZeRO); a sharded master holds only it.
        let shard = opt.shard();
        let params = match master_shard {
            Some(_) => master.slice_mut(..shard.len()),
            None => master.slice_mut(shard.clone()),
        };
        let g = held_grads(grads, grad_window.as_ref(), shard.clone())?;
        match work.as_mut() {
            Some(w) => {
                opt.step(
                    device.stream(),
                    params,
                    g,
                    w.param_copy(*precision, shard)?,
                    lr,
                )?;
                w.written_as(*precision);
            }
            None => opt.step(device.stream(), params, g, ParamCopy::None, lr)?,
        }
        self.sample_memory()
    }

    /// Sets one gradient to +inf (fault injection for tests of the loss-scaling path): the
    /// first one this rank holds (under ZeRO-2 the first of its owned shard).
    pub fn plant_infinite_gradient(&mut self) -> Result<()> {
        let stream = self.device.stream().clone();
        stream
            .memcpy_htod(&[f32::INFINITY], &mut self.grads.slice_mut(..1))
            .map_err(|e| cuda_err("planting an infinite gradient", e))
    }

    /// The global gradient norm (before clipping) of the last [`step`](Self::step).
    /// Synchronises the stream.
    pub fn last_grad_norm(&self) -> Result<f64> {
        if let Some(norm) = self.offloaded_grad_norm() {
            return Ok(norm);
        }
        match &self.optimizer {
            Some(opt) => opt.last_grad_norm(self.stream()),
            None => Err(invalid(
                "GpuLlama::last_grad_norm",
                "no optimizer: call configure_optimizer first".into(),
            )),
        }
    }
}

/// Forward, fused cross entropy and backward of one call.
#[allow(clippy::too_many_arguments)]
fn train_pass<T: DeviceFloat>(
    cx: &mut Cx<'_>,
    d: &Dims,
    w: &mut Weights<'_, T>,
    grads: Handoff<'_, '_>,
    ids: &CudaView<'_, u32>,
    targets: &CudaView<'_, i32>,
    factor: GradFactor<'_>,
    totals: &mut CeTotals,
    arena: &mut Arena,
) -> Result<()> {
    let mut b = arena.carve::<T>(d)?;
    compute::forward(cx, d, w, ids, &mut b)?;
    let mut grads = grads;
    lce::loss_and_head_backward(
        cx,
        d,
        w,
        &mut grads.grads()?,
        targets,
        factor,
        totals,
        &mut b,
    )?;
    compute::backward(cx, d, w, grads, ids, &mut b)
}

/// Forward only; downloads the logits chunk by chunk (synchronises).
fn logits_pass<T: DeviceFloat>(
    cx: &mut Cx<'_>,
    d: &Dims,
    w: &mut Weights<'_, T>,
    ids: &CudaView<'_, u32>,
    arena: &mut Arena,
) -> Result<Vec<f32>> {
    let mut b = arena.carve::<T>(d)?;
    compute::forward(cx, d, w, ids, &mut b)?;
    lce::logits_to_host(cx, d, w, &mut b)
}

/// Forward and the loss-only cross entropy.
fn loss_pass<T: DeviceFloat>(
    cx: &mut Cx<'_>,
    d: &Dims,
    w: &mut Weights<'_, T>,
    ids: &CudaView<'_, u32>,
    targets: &CudaView<'_, i32>,
    totals: &mut CeTotals,
    arena: &mut Arena,
) -> Result<()> {
    let mut b = arena.carve::<T>(d)?;
    compute::forward(cx, d, w, ids, &mut b)?;
    lce::loss_only(cx, d, w, targets, totals, &mut b)
}

#[cfg(test)]
mod out_of_memory_tests {
    use super::{MODEL_NEEDS_LESS, out_of_memory_message};

    #[test]
    fn the_message_names_the_buffer_the_size_the_free_memory_and_the_ways_out() {
        let gib = 1usize << 30;
        let m = out_of_memory_message(
            "allocating the master weights",
            "28.0 GiB",
            Some((gib * 3 / 2, 140 * gib)),
            MODEL_NEEDS_LESS,
        );
        assert!(
            m.starts_with("allocating the master weights: 28.0 GiB do not fit (1.5 of the GPU's 140.0 GiB are free); "),
            "{m}"
        );
        for way in ["--memory lean", "--zero-stage", "--tp-size", "tilearn plan"] {
            assert!(m.contains(way), "{way} missing from: {m}");
        }
        let unknown = out_of_memory_message("x", "1.0 GiB", None, "y");
        assert_eq!(unknown, "x: 1.0 GiB do not fit (the GPU has less free); y");
    }
}
