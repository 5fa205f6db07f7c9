//! What the Trainer needs from a device to run one optimizer step, so the same loop drives the
//! CPU reference engine and the CUDA engine.

use std::ops::Range;
use std::path::{Path, PathBuf};

use tilearn_ops::DType;

use super::flat_buffer::FlatBuffer;
use super::optimizer_shards::OptimizerCheckpoint;
use super::zero::{RankState, StateBytes};
use crate::config::LlamaConfig;
use crate::cuda_graphs::StepConditions;
use crate::data::Batch;
use crate::model::{LlamaForCausalLM, LossStats};
use crate::params::ParamSpec;
use crate::{EngineError, Result};

/// Where a run's starting weights come from.
#[derive(Clone, Debug, PartialEq)]
pub enum ModelInit {
    /// Hugging Face's initialisation with this seed
    /// ([`ParamStore::init_random_with_pad`](crate::params::ParamStore::init_random_with_pad)).
    Random { seed: u64 },
    /// A Hugging Face checkpoint directory's safetensors weights.
    Pretrained(PathBuf),
}

impl ModelInit {
    /// The model on the host (the CPU engine); the CUDA engine streams `self` into device
    /// memory instead.
    pub fn build_host(&self, config: LlamaConfig) -> Result<LlamaForCausalLM> {
        match self {
            ModelInit::Random { seed } => Ok(LlamaForCausalLM::from_config(config, *seed)),
            ModelInit::Pretrained(dir) => {
                let params = crate::checkpoint::load_params(dir, &config)?;
                Ok(LlamaForCausalLM { config, params })
            }
        }
    }
}

/// What [`StepBackend::whole_step`] returns.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct WholeStep {
    /// The step's summed token losses (as [`StepBackend::forward_backward`] returns them).
    pub loss_sum: f64,
    /// The global gradient norm before clipping.
    pub grad_norm: f64,
}

/// One device's model, gradients and optimizer state.
pub trait StepBackend {
    /// e.g. `cpu (f32 reference)` or `cuda:0 NVIDIA H200`.
    fn describe(&self) -> String;

    /// Whether this backend can run a period in `precision` (the CPU emulates all three; the
    /// CUDA engine runs those it was built for).
    fn supports(&self, precision: DType) -> bool {
        let _ = precision;
        true
    }

    /// Clears the gradient buffer before the micro-batches of one optimizer step.
    fn zero_grads(&mut self);

    /// Forward and backward of one micro-batch in `precision`. Gradients of
    /// `loss_sum * loss_scale / denominator` are added into the gradient buffer; returns the
    /// micro-batch's (unscaled) sum of token losses.
    fn forward_backward(
        &mut self,
        batch: &Batch,
        denominator: f64,
        precision: DType,
        loss_scale: f32,
    ) -> Result<f64>;

    /// The forwards and backwards of all of a step's micro-batches at once, for a backend
    /// that orders them itself (a pipeline schedule interleaves the micro-batches' forwards and
    /// backwards across stages); returns the step's summed token losses as
    /// [`StepBackend::forward_backward`] does per micro-batch. `None`: the Trainer calls
    /// `forward_backward` once per micro-batch.
    fn forward_backward_step(
        &mut self,
        batches: &[Batch],
        denominator: f64,
        precision: DType,
        loss_scale: f32,
    ) -> Option<Result<f64>> {
        let _ = (batches, denominator, precision, loss_scale);
        None
    }

    /// The whole optimizer step in one call (zero the gradients, forward and backward of the
    /// step's one micro-batch, the optimizer at `lr` with the configured clipping), for a
    /// backend that replays it as a CUDA graph (`--cuda-graphs`). `conditions` is the
    /// Trainer's view of the step (accumulation, ranks, loss scaling, packing). `None`: the
    /// backend does not take this step whole, and the Trainer runs it piece by piece.
    fn whole_step(
        &mut self,
        batches: &[Batch],
        denominator: f64,
        precision: DType,
        lr: f32,
        conditions: StepConditions,
    ) -> Option<Result<WholeStep>> {
        let _ = (batches, denominator, precision, lr, conditions);
        None
    }

    /// A message for the run's log, once per new message (e.g. why steps run eagerly though
    /// CUDA graphs were asked for).
    fn take_note(&mut self) -> Option<String> {
        None
    }

    /// The loss of one evaluation batch with the forward only, in `precision` (the weights the
    /// training steps of that precision use); leaves the gradients alone.
    fn eval_loss(&mut self, batch: &Batch, precision: DType) -> Result<LossStats>;

    /// The stream the backend computes on, when it is a GPU backend that also implements
    /// [`forward_backward_into`](Self::forward_backward_into): the data-parallel overlap orders
    /// its collectives against it, and `None` tells it to reduce after the backward instead.
    #[cfg(feature = "cuda")]
    fn compute_stream(&self) -> Option<std::sync::Arc<tilearn_ops::cuda::CudaStream>> {
        None
    }

    /// [`forward_backward`](Self::forward_backward) that hands the finished parts of the
    /// gradient buffer to `sink` while the backward runs (data-parallel overlap). `None` when
    /// the backend cannot (the CPU engine); then the caller runs the plain call and reduces
    /// afterwards.
    #[cfg(feature = "cuda")]
    fn forward_backward_into(
        &mut self,
        batch: &Batch,
        denominator: f64,
        precision: DType,
        loss_scale: f32,
        sink: &mut dyn crate::gpu::GradientSink,
    ) -> Option<Result<f64>> {
        let _ = (batch, denominator, precision, loss_scale, sink);
        None
    }

    /// The GradScaler's unscale: the gradients are to be multiplied by `inv_scale` before the
    /// optimizer uses them (in place, or inside the optimizer step); reports whether any is
    /// infinite or NaN.
    fn unscale_and_check(&mut self, inv_scale: f32) -> Result<bool>;

    /// Clips the global gradient norm to `max_norm` (0 = no clipping); returns the norm before
    /// clipping. A backend that clips inside its optimizer kernel returns 0 here and reports
    /// the norm from [`StepBackend::optimizer_step`]. Collective where the model is split
    /// over ranks (tensor parallelism).
    fn clip_grad_norm(&mut self, max_norm: f64) -> Result<f64>;

    /// Applies the optimizer with learning rate `lr`; returns the pre-clip gradient norm when
    /// the backend measured it inside the step.
    fn optimizer_step(&mut self, lr: f32) -> Result<Option<f64>>;

    /// The model with the current weights (the CUDA engine downloads a host copy: for
    /// evaluation and tests, never used by saves).
    fn model(&mut self) -> Result<&LlamaForCausalLM>;

    /// The parameters' tensors (Hugging Face names, shapes, flat ranges) of the flat buffers
    /// this backend holds.
    fn specs(&self) -> &[ParamSpec];

    /// The tensors of the model [`StepBackend::save_model`] writes: the whole model's, where
    /// this backend holds only slices of it (tensor parallelism).
    fn saved_specs(&self) -> &[ParamSpec] {
        self.specs()
    }

    /// Writes the current weights as a Hugging Face model directory (`config.json` from
    /// `config`, weights in `dtype`, sharded above `max_shard_bytes`), streamed tensor by
    /// tensor.
    fn save_model(
        &mut self,
        dir: &Path,
        config: &LlamaConfig,
        dtype: DType,
        max_shard_bytes: Option<usize>,
    ) -> Result<()>;

    /// Writes the optimizer state it holds (all of it, or its ZeRO shard after
    /// [`StepBackend::shard_optimizer`]) in the format of [`super::optimizer_file`].
    fn save_optimizer(&mut self, path: &Path) -> Result<()>;

    /// Replaces the weights with those of checkpoint directory `dir` (whose config the Trainer
    /// has checked) and the optimizer state it holds with `optimizer`'s (re-sharded if the
    /// checkpoint was cut differently).
    fn restore(&mut self, dir: &Path, optimizer: &OptimizerCheckpoint) -> Result<()>;

    /// The flat gradient buffer (data parallelism reduces it in place, bucket by bucket).
    fn flat_gradients(&mut self) -> Result<FlatBuffer<'_>>;

    /// Replaces the weights with the model files of a checkpoint `dir`, leaving the optimizer
    /// state as it is (`--load-best-model-at-end`, after the last step).
    fn load_weights(&mut self, dir: &Path) -> Result<()> {
        let _ = dir;
        Err(EngineError::InvalidArgument {
            argument: "--load-best-model-at-end".into(),
            message: format!("{} cannot load weights after training yet", self.describe()),
        })
    }

    /// The flat f32 master weights (ZeRO all-gathers them after each step).
    fn flat_parameters(&mut self) -> Result<FlatBuffer<'_>> {
        Err(unsupported(self.describe(), "ZeRO (--zero-stage)"))
    }

    /// ZeRO: from now on the optimizer holds state for, steps and saves only the parameters
    /// `shard` of the flat buffer.
    fn shard_optimizer(&mut self, shard: Range<usize>) -> Result<()> {
        let _ = shard;
        Err(unsupported(self.describe(), "ZeRO (--zero-stage)"))
    }

    /// ZeRO-2 with the reduction during the backward: from now on the backend may keep only
    /// the gradients `owned` (accumulated over a step's micro-batches) and write the others
    /// in a reusable window, reducing each part through the sink of
    /// [`forward_backward_into`](Self::forward_backward_into), which every backward must then
    /// use. Returns whether it did (the default: no, the whole buffer stays).
    fn shard_gradients(&mut self, owned: Range<usize>) -> Result<bool> {
        let _ = owned;
        Ok(false)
    }

    /// Whether [`shard_gradients`](Self::shard_gradients) took effect: the flat gradients
    /// are then the owned shard's only.
    fn gradients_sharded(&self) -> bool {
        false
    }

    /// The sum of squares of the gradients `range` (ZeRO's partial norm).
    fn grad_sum_of_squares(&mut self, range: Range<usize>) -> Result<f64> {
        let _ = range;
        Err(unsupported(self.describe(), "ZeRO (--zero-stage)"))
    }

    /// Multiplies the gradients `range` by `factor` (ZeRO's clipping of the owned shard).
    fn scale_gradients(&mut self, range: Range<usize>, factor: f32) -> Result<()> {
        let _ = (range, factor);
        Err(unsupported(self.describe(), "ZeRO (--zero-stage)"))
    }

    /// ZeRO's clipping of the owned shard `range`, given the global sum of squares of the
    /// gradients (every rank's shard, summed): the gradients are to be multiplied by
    /// `clip_grad_norm_`'s coefficient when `max_norm > 0` and the norm exceeds it. The default
    /// scales them in place; a backend that clips inside its optimizer kernel takes the sum
    /// instead (and reports its root as the step's norm).
    fn clip_shard(
        &mut self,
        range: Range<usize>,
        sum_of_squares: f64,
        max_norm: f64,
    ) -> Result<()> {
        let norm = sum_of_squares.sqrt();
        if max_norm > 0.0
            && let Some(coef) = tilearn_optim::clip::clip_coefficient(norm, max_norm)
        {
            self.scale_gradients(range, coef as f32)?;
        }
        Ok(())
    }

    /// ZeRO, before a save: when this rank holds only a shard of the fp32 weights, puts that
    /// shard into its place of a whole-model buffer and returns the buffer for the caller to
    /// all-gather the other shards into; the save then reads the weights from it. `None`: the
    /// backend already holds the whole weights.
    fn stage_whole_weights(&mut self) -> Result<Option<FlatBuffer<'_>>> {
        Ok(None)
    }

    /// Bytes per parameter of its model state as the ZeRO paper counts them (working weights,
    /// gradients, optimizer state K), for the per-rank memory report.
    fn state_layout(&self) -> StateBytes;

    /// The model-state bytes it holds now: working weights, the gradient buffer, and the
    /// optimizer state (K: moments, and fp32 master weights where they are separate).
    fn state_held(&self) -> RankState;

    /// Makes the gradients non-finite (at least one infinite): fault injection for testing
    /// the fp16 overflow path (`--debug-inject-overflow`).
    fn poison_gradients(&mut self) -> Result<()>;

    /// Peak memory the backend holds for training (device memory on a GPU).
    fn peak_memory_bytes(&self) -> u64;
}

fn unsupported(backend: String, what: &str) -> EngineError {
    EngineError::InvalidArgument {
        argument: "--zero-stage".into(),
        message: format!(
            "{backend} does not support {what} yet; use --device cpu or drop the flag"
        ),
    }
}
