//! DeepFM and Wide & Deep trained on the GPU: the step of [`crate::CtrModel::train_step`] with
//! every buffer on the device.
//!
//! One step: upload the batch (dense features, labels, jagged ids) → fused embedding-bag
//! forward → MLP (cuBLASLt linear layers, `ctr_head.cu`'s ReLU) → logits, BCE terms and
//! d loss / d logit (`ctr_head.cu`) → dense-feature and bias gradients and the loss sum (one
//! reduction launch) → MLP backward (cuBLASLt) → the pooled embeddings' gradient (FM + MLP
//! input) → embedding backward fused with the sparse optimizer → tilearn-optim's fused CUDA
//! AdamW over the flat dense buffer. The only host round trip is the loss (8 bytes).
//!
//! All f32 (no TF32): the same arithmetic as the CPU model up to the order of sums, so a GPU run
//! follows the CPU run's loss curve (`tests/ctr_gpu.rs` states the tolerance).

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, CudaView, CudaViewMut, DevicePtr, DevicePtrMut};
use tilearn_ops::cuda::{Gemm, linear_backward, linear_forward};
use tilearn_optim::cuda::{AdamState, Grads, SegmentPlan, StepIo, adamw_step};
use tilearn_optim::{AdamWConfig, AdamWStepScalars, ParamGroup, decimal_f64};

use super::ctr_head::{self, HeadParams, HeadShape, LossOutputs};
use super::device_rows::DeviceRows;
use super::embedding_bag::DeviceJaggedBatch;
use super::mlp_bf16::{Bf16Mlp, MlpPrecision};
use crate::cache::RowCacheReport;
use crate::data::CtrBatch;
use crate::error::{RecsysError, Result};
use crate::jagged::JaggedBatch;
use crate::model::{CtrConfig, CtrModel, DenseLayout, StepStats};
use crate::stepper::CtrStepper;

fn driver(context: &'static str) -> impl Fn(cudarc::driver::DriverError) -> RecsysError {
    move |e| {
        RecsysError::Ops(tilearn_ops::OpsError::Cuda {
            context,
            message: e.to_string(),
        })
    }
}

/// The activations of a batch of up to `capacity` samples (grown when a larger batch comes).
#[derive(Debug)]
struct Activations {
    capacity: usize,
    emb: CudaSlice<f32>,
    demb: CudaSlice<f32>,
    dense: CudaSlice<f32>,
    labels: CudaSlice<f32>,
    x0: CudaSlice<f32>,
    /// Each layer's output before the ReLU.
    z: Vec<CudaSlice<f32>>,
    /// `relu(z[l])` for every hidden layer: the input of layer `l + 1`.
    a: Vec<CudaSlice<f32>>,
    /// The MLP backward's input gradients, alternating between the two.
    dx: [CudaSlice<f32>; 2],
    logits: CudaSlice<f32>,
    dlogits: CudaSlice<f32>,
    loss_terms: CudaSlice<f64>,
    loss_sum: CudaSlice<f64>,
}

impl Activations {
    fn new(
        stream: &Arc<CudaStream>,
        config: &CtrConfig,
        layout: &DenseLayout,
        width: usize,
        capacity: usize,
    ) -> Result<Self> {
        let err = driver("DeviceCtrModel activations");
        // The driver refuses empty allocations: every buffer holds at least one element.
        let f32s = |n: usize| stream.alloc_zeros::<f32>(n.max(1)).map_err(&err);
        let widest = layout.layers.iter().map(|l| l.fan_in).max().unwrap_or(1);
        let hidden = &layout.layers[..layout.layers.len() - 1];
        Ok(Activations {
            capacity,
            emb: f32s(capacity * width)?,
            demb: f32s(capacity * width)?,
            dense: f32s(capacity * config.num_dense)?,
            labels: f32s(capacity)?,
            x0: f32s(capacity * config.mlp_input())?,
            z: (layout.layers.iter())
                .map(|l| f32s(capacity * l.fan_out))
                .collect::<Result<_>>()?,
            a: (hidden.iter())
                .map(|l| f32s(capacity * l.fan_out))
                .collect::<Result<_>>()?,
            dx: [f32s(capacity * widest)?, f32s(capacity * widest)?],
            logits: f32s(capacity)?,
            dlogits: f32s(capacity)?,
            loss_terms: stream.alloc_zeros::<f64>(capacity.max(1)).map_err(&err)?,
            loss_sum: stream.alloc_zeros::<f64>(1).map_err(&err)?,
        })
    }
}

/// A CTR model and its optimizers' state on one GPU.
#[derive(Debug)]
pub struct DeviceCtrModel {
    config: CtrConfig,
    layout: DenseLayout,
    stream: Arc<CudaStream>,
    gemm: Gemm,
    /// The embedding rows; `None` for the dense part of a sharded model, whose pooled
    /// embeddings come from the ranks' shards (`cuda::sharded_trainer`).
    bags: Option<DeviceRows>,
    /// Columns of the pooled embeddings (every table's dim).
    width: usize,
    params: CudaSlice<f32>,
    grads: CudaSlice<f32>,
    exp_avg: CudaSlice<f32>,
    exp_avg_sq: CudaSlice<f32>,
    max_exp_avg_sq: Option<CudaSlice<f32>>,
    plan: SegmentPlan,
    adamw: AdamWConfig,
    groups: Vec<ParamGroup>,
    /// Dense optimizer steps taken (continues the host AdamW's count).
    dense_steps: u64,
    acts: Activations,
    /// The MLP's bf16 shadow weights and activations (`--precision bf16`), or `None` for f32.
    bf16: Option<Bf16Mlp>,
}

impl DeviceCtrModel {
    /// Uploads `model`: tables and sparse state, dense parameters and AdamW's moments (its step
    /// count continues on the device).
    pub fn new(stream: &Arc<CudaStream>, model: &CtrModel) -> Result<Self> {
        let bags = DeviceRows::whole(stream, &model.tables, &model.sparse)?;
        Self::with_rows(stream, model, Some(bags))
    }

    /// [`new`](Self::new) with the embedding rows in pinned host memory behind a device cache
    /// of `slots[t]` rows of table `t` (a table given all its rows stays on the device whole).
    /// The host model's table weights are moved out (into the pinned memory), so they are held
    /// once; [`download_into`](Self::download_into) gives them back. (The sparse state is
    /// copied: `SparseState` keeps its buffers' lengths fixed.)
    pub fn with_row_cache(
        stream: &Arc<CudaStream>,
        model: &mut CtrModel,
        slots: &[usize],
    ) -> Result<Self> {
        let tables = crate::EmbeddingTables {
            layout: model.tables.layout.clone(),
            weights: std::mem::take(&mut model.tables.weights),
        };
        let state = model.sparse.clone();
        let bags = DeviceRows::cached(stream, tables, state, slots)?;
        Self::with_rows(stream, model, Some(bags))
    }

    /// The dense part of `model` alone (MLP, dense-feature weights, bias and their AdamW): the
    /// pooled embeddings are written into it by a sharded lookup ([`Self::emb_mut`]).
    pub(crate) fn dense_part(stream: &Arc<CudaStream>, model: &CtrModel) -> Result<Self> {
        Self::with_rows(stream, model, None)
    }

    fn with_rows(
        stream: &Arc<CudaStream>,
        model: &CtrModel,
        bags: Option<DeviceRows>,
    ) -> Result<Self> {
        let err = driver("DeviceCtrModel::new");
        let layout = model.layout.clone();
        let numel = layout.numel;
        let plan = SegmentPlan::whole(
            stream,
            model.adamw.segments(),
            numel,
            model.adamw.groups().len(),
        )?;
        let max_exp_avg_sq = match model.adamw.max_exp_avg_sq() {
            Some(m) => Some(stream.clone_htod(m).map_err(&err)?),
            None => None,
        };
        let width = model.tables.layout.total_dim();
        Ok(DeviceCtrModel {
            gemm: Gemm::new(stream)?,
            params: stream.clone_htod(&model.dense).map_err(&err)?,
            grads: stream.alloc_zeros::<f32>(numel).map_err(&err)?,
            exp_avg: stream.clone_htod(model.adamw.exp_avg()).map_err(&err)?,
            exp_avg_sq: stream.clone_htod(model.adamw.exp_avg_sq()).map_err(&err)?,
            max_exp_avg_sq,
            plan,
            adamw: *model.adamw.config(),
            groups: model.adamw.groups().to_vec(),
            dense_steps: model.adamw.step_count(),
            acts: Activations::new(stream, &model.config, &layout, width, 1)?,
            bf16: None,
            bags,
            width,
            layout,
            config: model.config.clone(),
            stream: stream.clone(),
        })
    }

    pub fn config(&self) -> &CtrConfig {
        &self.config
    }

    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Runs the MLP's GEMMs in `precision` from the next step on (bf16: cuBLASLt bf16 inputs,
    /// f32 accumulation and master weights; see `mlp_bf16`).
    pub fn set_mlp_precision(&mut self, precision: MlpPrecision) -> Result<()> {
        self.bf16 = match precision {
            MlpPrecision::F32 => None,
            MlpPrecision::Bf16 => Some(Bf16Mlp::new(
                &self.stream,
                &self.layout,
                &self.params,
                self.acts.capacity,
            )?),
        };
        Ok(())
    }

    pub fn mlp_precision(&self) -> MlpPrecision {
        match self.bf16 {
            Some(_) => MlpPrecision::Bf16,
            None => MlpPrecision::F32,
        }
    }

    fn width(&self) -> usize {
        self.width
    }

    fn rows(&mut self) -> Result<&mut DeviceRows> {
        self.bags.as_mut().ok_or_else(|| {
            RecsysError::invalid(
                "DeviceCtrModel",
                "this is the dense part of a sharded model; its tables live in the shards",
            )
        })
    }

    /// The row cache's counts and traffic so far (`None` when every row is on the device).
    pub fn row_cache_report(&mut self) -> Result<Option<RowCacheReport>> {
        match &mut self.bags {
            Some(bags) => bags.cache_report(),
            None => Ok(None),
        }
    }

    /// Copies the weights and both optimizers' state into `model` (built with the same config
    /// and optimizers), so it can be saved or evaluated on the host.
    pub fn download_into(&mut self, model: &mut CtrModel) -> Result<()> {
        let stream = self.stream.clone();
        let bags = self.rows()?;
        let (weights, state1, state2) = bags.download(&stream)?;
        model.sparse.set_state(state1, state2, bags.step())?;
        model.tables.weights = weights;
        self.download_dense_into(model)
    }

    /// Copies the dense parameters and AdamW's state into `model` (the tables untouched).
    pub(crate) fn download_dense_into(&mut self, model: &mut CtrModel) -> Result<()> {
        let err = driver("DeviceCtrModel::download_into");
        model.dense = self.stream.clone_dtoh(&self.params).map_err(&err)?;
        let max = match &self.max_exp_avg_sq {
            Some(m) => Some(self.stream.clone_dtoh(m).map_err(&err)?),
            None => None,
        };
        model.adamw.set_state(
            self.stream.clone_dtoh(&self.exp_avg).map_err(&err)?,
            self.stream.clone_dtoh(&self.exp_avg_sq).map_err(&err)?,
            max,
            self.dense_steps,
        )?;
        Ok(())
    }

    /// Uploads `batch` (features, labels) and its jagged ids (through the row cache, if any:
    /// `training` marks the rows as changed); grows the activations to fit.
    fn upload(
        &mut self,
        batch: &CtrBatch,
        jagged: &JaggedBatch,
        training: bool,
    ) -> Result<DeviceJaggedBatch> {
        if jagged.batch() != batch.len() {
            return Err(RecsysError::invalid(
                "batch",
                format!(
                    "{} samples with jagged ids of {} samples; pass the ids built from this batch",
                    batch.len(),
                    jagged.batch()
                ),
            ));
        }
        self.upload_features(batch)?;
        let stream = self.stream.clone();
        self.rows()?.upload(&stream, jagged, training)
    }

    /// Uploads `batch`'s dense features and labels; grows the activations to fit.
    pub(crate) fn upload_features(&mut self, batch: &CtrBatch) -> Result<()> {
        let n = batch.len();
        if n == 0 {
            return Err(RecsysError::invalid(
                "batch",
                "an empty batch; a step needs >= 1 sample",
            ));
        }
        if n > self.acts.capacity {
            let width = self.width();
            self.acts = Activations::new(&self.stream, &self.config, &self.layout, width, n)?;
            if self.bf16.is_some() {
                self.bf16 = Some(Bf16Mlp::new(&self.stream, &self.layout, &self.params, n)?);
            }
        }
        let err = driver("DeviceCtrModel::upload");
        let nd = self.config.num_dense;
        if nd > 0 {
            let mut dst = self.acts.dense.slice_mut(..n * nd);
            self.stream
                .memcpy_htod(&batch.dense, &mut dst)
                .map_err(&err)?;
        }
        let mut dst = self.acts.labels.slice_mut(..n);
        self.stream
            .memcpy_htod(&batch.labels, &mut dst)
            .map_err(&err)?;
        Ok(())
    }

    /// The pooled embeddings of the uploaded batch of `n` samples (`[n, width]`), for a
    /// sharded lookup to write.
    pub(crate) fn emb_mut(&mut self, n: usize) -> CudaViewMut<'_, f32> {
        let width = self.width;
        self.acts.emb.slice_mut(..n * width)
    }

    /// Their gradient after [`head_forward_backward`](Self::head_forward_backward).
    pub(crate) fn demb(&self, n: usize) -> CudaView<'_, f32> {
        self.acts.demb.slice(..n * self.width)
    }

    /// The flat dense gradient (for a data-parallel all-reduce before
    /// [`dense_step`](Self::dense_step)).
    pub(crate) fn grads_mut(&mut self) -> &mut CudaSlice<f32> {
        &mut self.grads
    }

    /// The loss sum of the last forward-backward (one 8-byte download).
    pub(crate) fn loss_sum(&self) -> Result<f64> {
        let loss = (self.stream.clone_dtoh(&self.acts.loss_sum))
            .map_err(driver("DeviceCtrModel::loss_sum"))?;
        Ok(loss[0])
    }

    /// The embedding lookup of the uploaded batch of `n` samples: fills `emb` (the MLP runs in
    /// [`head_logits`](Self::head_logits) or
    /// [`head_forward_backward`](Self::head_forward_backward)).
    fn embed(&mut self, jagged: &DeviceJaggedBatch, n: usize) -> Result<()> {
        let stream = self.stream.clone();
        let width = self.width;
        let emb = &mut self.acts.emb.slice_mut(..n * width);
        let bags = self.bags.as_ref().ok_or_else(|| {
            RecsysError::invalid("DeviceCtrModel", "a sharded model's lookup is the shards'")
        })?;
        bags.forward(&stream, jagged, emb)
    }

    /// The MLP of the uploaded batch of `n` samples from its pooled embeddings in `emb`: fills
    /// `x0`, `z`, `a`.
    fn mlp_forward(&mut self, n: usize) -> Result<HeadShape> {
        let s = HeadShape::new(&self.config, self.width(), n);
        let stream = &self.stream;
        let acts = &mut self.acts;
        ctr_head::mlp_input(
            stream,
            s,
            &acts.emb.slice(..n * s.width),
            &acts.dense.slice(..n * s.num_dense),
            &mut acts.x0.slice_mut(..n * s.mlp_in()),
        )?;
        let last = self.layout.layers.len() - 1;
        for (l, layer) in self.layout.layers.iter().enumerate() {
            let out_len = n * layer.fan_out;
            if let Some(h) = self.bf16.as_mut() {
                let x0 = (l == 0).then(|| acts.x0.slice(..n * layer.fan_in));
                let mut z = acts.z[l].slice_mut(..out_len);
                h.forward_layer(&self.gemm, l, layer, x0.as_ref(), n, &mut z)?;
            } else {
                let input: CudaView<'_, f32> = if l == 0 {
                    acts.x0.slice(..n * layer.fan_in)
                } else {
                    acts.a[l - 1].slice(..n * layer.fan_in)
                };
                linear_forward(
                    &self.gemm,
                    &input,
                    &self.params.slice(layer.weight.clone()),
                    Some(&self.params.slice(layer.bias.clone()) as &dyn DevicePtr<f32>),
                    n,
                    layer.fan_in,
                    layer.fan_out,
                    &mut acts.z[l].slice_mut(..out_len),
                )?;
            }
            if l < last {
                ctr_head::relu_forward(
                    stream,
                    &acts.z[l].slice(..out_len),
                    &mut acts.a[l].slice_mut(..out_len),
                    out_len,
                )?;
                if let Some(h) = self.bf16.as_mut() {
                    h.keep_hidden(stream, l, &acts.a[l].slice(..out_len), out_len)?;
                }
            }
        }
        Ok(s)
    }

    /// Logits of every sample of `batch` (ids `jagged`).
    pub fn predict(&mut self, batch: &CtrBatch, jagged: &JaggedBatch) -> Result<Vec<f32>> {
        let djag = self.upload(batch, jagged, false)?;
        let n = batch.len();
        self.embed(&djag, n)?;
        self.head_logits(n)
    }

    /// The logits of the uploaded batch of `n` samples whose pooled embeddings are in `emb`.
    pub(crate) fn head_logits(&mut self, n: usize) -> Result<Vec<f32>> {
        let s = self.mlp_forward(n)?;
        let last = self.layout.layers.len() - 1;
        let bias = self.layout.bias;
        let w_dense = self.params.slice(self.layout.dense_weights.clone());
        let bias_param = self.params.slice(bias..bias + 1);
        let acts = &mut self.acts;
        ctr_head::logits(
            &self.stream,
            s,
            &acts.emb.slice(..n * s.width),
            &acts.dense.slice(..n * s.num_dense),
            HeadParams {
                w_dense: &w_dense,
                bias: &bias_param,
            },
            &acts.z[last].slice(..n),
            &mut acts.logits.slice_mut(..n),
        )?;
        let mut out = vec![0.0f32; n];
        self.stream
            .memcpy_dtoh(&self.acts.logits.slice(..n), &mut out)
            .map_err(driver("DeviceCtrModel::predict"))?;
        Ok(out)
    }

    /// Loss and gradients of `batch` without updating anything (what the CPU's `head_forward`
    /// and `head_backward` give): the mean BCE loss, the dense parameters' gradient (flat, as
    /// [`DenseLayout`]) and the pooled embeddings' gradient (`[batch, width]`).
    pub fn gradients(
        &mut self,
        batch: &CtrBatch,
        jagged: &JaggedBatch,
    ) -> Result<(f64, Vec<f32>, Vec<f32>)> {
        let djag = self.upload(batch, jagged, false)?;
        let n = batch.len();
        let s = self.forward_backward(&djag, n)?;
        let err = driver("DeviceCtrModel::gradients");
        let loss = self.stream.clone_dtoh(&self.acts.loss_sum).map_err(&err)?;
        let dense = self.stream.clone_dtoh(&self.grads).map_err(&err)?;
        let mut demb = vec![0.0f32; n * s.width];
        self.stream
            .memcpy_dtoh(&self.acts.demb.slice(..n * s.width), &mut demb)
            .map_err(&err)?;
        Ok((loss[0] / n as f64, dense, demb))
    }

    /// One training step (what [`CtrModel::train_step_jagged`] does on the CPU): the embedding
    /// rows of the batch are updated inside the embedding backward, the dense parameters by the
    /// fused AdamW at `dense_lr`. Returns the mean BCE loss of the batch.
    pub fn train_step(
        &mut self,
        batch: &CtrBatch,
        jagged: &JaggedBatch,
        dense_lr: f32,
    ) -> Result<f64> {
        let djag = self.upload(batch, jagged, true)?;
        let n = batch.len();
        let s = self.forward_backward(&djag, n)?;
        let stream = self.stream.clone();
        let demb = self.acts.demb.slice(..n * s.width);
        let bags = self.bags.as_mut().ok_or_else(|| {
            RecsysError::invalid("DeviceCtrModel", "a sharded model's update is the shards'")
        })?;
        bags.backward_update(&stream, &djag, &demb)?;
        self.dense_step(dense_lr)?;
        Ok(self.loss_sum()? / n as f64)
    }

    /// Forward and backward of the uploaded batch of `n` samples: leaves the loss sum in
    /// `loss_sum`, the dense gradient in `grads` and the pooled embeddings' gradient in `demb`.
    fn forward_backward(&mut self, djag: &DeviceJaggedBatch, n: usize) -> Result<HeadShape> {
        self.embed(djag, n)?;
        self.head_forward_backward(n, 1.0 / n as f32)
    }

    /// The head's forward and backward of the uploaded batch of `n` samples from its pooled
    /// embeddings in `emb`, d loss / d logit scaled by `scale` (1 / n for the batch's mean
    /// loss; 1 / the global batch for a data-parallel rank's part): leaves the loss sum in
    /// `loss_sum`, the dense gradient in `grads` and the pooled embeddings' gradient in `demb`.
    pub(crate) fn head_forward_backward(&mut self, n: usize, scale: f32) -> Result<HeadShape> {
        let s = self.mlp_forward(n)?;
        let stream = self.stream.clone();
        let layers = self.layout.layers.clone();
        let last = layers.len() - 1;
        let (bias, nd) = (self.layout.bias, s.num_dense);
        {
            let (w_dense, bias_param) = (
                self.params.slice(self.layout.dense_weights.clone()),
                self.params.slice(bias..bias + 1),
            );
            let acts = &mut self.acts;
            ctr_head::logits_loss(
                &stream,
                s,
                &acts.emb.slice(..n * s.width),
                &acts.dense.slice(..n * nd),
                HeadParams {
                    w_dense: &w_dense,
                    bias: &bias_param,
                },
                &acts.z[last].slice(..n),
                &acts.labels.slice(..n),
                scale,
                LossOutputs {
                    logits: &mut acts.logits.slice_mut(..n),
                    dlogits: &mut acts.dlogits.slice_mut(..n),
                    loss_terms: &mut acts.loss_terms.slice_mut(..n),
                },
            )?;
        }
        stream
            .memset_zeros(&mut self.grads)
            .map_err(driver("DeviceCtrModel::forward_backward"))?;
        let acts = &mut self.acts;
        {
            // The dense weights come first in the flat buffer, the bias right after them.
            let (mut dw_dense, mut rest) = self.grads.split_at_mut(nd);
            ctr_head::batch_sums(
                &stream,
                s,
                &acts.dlogits.slice(..n),
                &acts.dense.slice(..n * nd),
                &acts.loss_terms.slice(..n),
                &mut dw_dense,
                &mut rest.slice_mut(bias - nd..bias - nd + 1),
                &mut acts.loss_sum,
            )?;
        }
        // The MLP, from the output layer down; dz of the output layer is dlogits.
        let [dx_a, dx_b] = &mut acts.dx;
        let (mut cur, mut next) = (dx_a, dx_b);
        for (l, layer) in layers.iter().enumerate().rev() {
            let (weight, bias_range) = (layer.weight.clone(), layer.bias.clone());
            let mut span = self.grads.slice_mut(weight.start..bias_range.end);
            let (mut dw, mut db) = span.split_at_mut(weight.len());
            let dout = if l == last {
                acts.dlogits.slice(..n)
            } else {
                cur.slice(..n * layer.fan_out)
            };
            let input = if l == 0 {
                acts.x0.slice(..n * layer.fan_in)
            } else {
                acts.a[l - 1].slice(..n * layer.fan_in)
            };
            let mut dx = next.slice_mut(..n * layer.fan_in);
            if let Some(h) = self.bf16.as_mut() {
                h.backward_layer(&self.gemm, l, layer, n, &dout, &mut dw, &mut db, &mut dx)?;
            } else {
                linear_backward(
                    &self.gemm,
                    &dout,
                    &input,
                    &self.params.slice(weight),
                    n,
                    layer.fan_in,
                    layer.fan_out,
                    Some(&mut dx as &mut dyn DevicePtrMut<f32>),
                    &mut dw,
                    Some(&mut db as &mut dyn DevicePtrMut<f32>),
                )?;
            }
            if l > 0 {
                ctr_head::relu_backward(
                    &stream,
                    &mut dx,
                    &acts.z[l - 1].slice(..n * layer.fan_in),
                    n * layer.fan_in,
                )?;
            }
            std::mem::swap(&mut cur, &mut next);
        }
        // `cur` now holds d loss / d x0.
        ctr_head::head_backward(
            &stream,
            s,
            &acts.emb.slice(..n * s.width),
            &acts.dlogits.slice(..n),
            &cur.slice(..n * s.mlp_in()),
            &mut acts.demb.slice_mut(..n * s.width),
        )?;
        Ok(s)
    }

    /// One fused AdamW step of the dense buffer from `grads`, with the scalars the host AdamW
    /// would use (`AdamW::step_scalars`) for the next step.
    pub(crate) fn dense_step(&mut self, lr: f32) -> Result<()> {
        if !(lr.is_finite() && lr >= 0.0) {
            return Err(RecsysError::invalid(
                "dense learning rate",
                format!("{lr}; it must be finite and >= 0"),
            ));
        }
        let step = self.dense_steps + 1;
        let scalars: Vec<AdamWStepScalars> = (self.groups.iter())
            .map(|g| {
                let group_lr = decimal_f64(lr) * decimal_f64(g.lr_scale);
                AdamWStepScalars::new(&self.adamw, group_lr, decimal_f64(g.weight_decay), step)
            })
            .collect();
        let state = AdamState {
            params: self.params.as_view_mut(),
            exp_avg: self.exp_avg.as_view_mut(),
            exp_avg_sq: self.exp_avg_sq.as_view_mut(),
            max_exp_avg_sq: self.max_exp_avg_sq.as_mut().map(|m| m.as_view_mut()),
        };
        let mut io = StepIo::new(Grads::F32(self.grads.as_view()));
        io.step = step;
        adamw_step(&self.stream, &self.plan, &scalars, state, io)?;
        self.dense_steps = step;
        if let Some(h) = self.bf16.as_mut() {
            h.refresh(&self.stream, &self.params)?;
        }
        Ok(())
    }
}

/// The training loop's GPU model: a [`DeviceCtrModel`] and the host [`CtrModel`] it was
/// uploaded from, which is brought up to date only when asked for (checkpoints, the end).
#[derive(Debug)]
pub struct GpuCtrTrainer {
    host: CtrModel,
    device: DeviceCtrModel,
    host_current: bool,
}

impl GpuCtrTrainer {
    /// Uploads `host` to the device of `stream`.
    pub fn new(stream: &Arc<CudaStream>, host: CtrModel) -> Result<Self> {
        Ok(GpuCtrTrainer {
            device: DeviceCtrModel::new(stream, &host)?,
            host,
            host_current: true,
        })
    }

    /// [`new`](Self::new) with the embedding rows in pinned host memory behind a device cache
    /// of `slots[t]` rows of table `t` ([`DeviceCtrModel::with_row_cache`]).
    pub fn with_row_cache(
        stream: &Arc<CudaStream>,
        mut host: CtrModel,
        slots: &[usize],
    ) -> Result<Self> {
        Ok(GpuCtrTrainer {
            device: DeviceCtrModel::with_row_cache(stream, &mut host, slots)?,
            host,
            // The host's weights moved into the pinned tables.
            host_current: false,
        })
    }

    pub fn device(&mut self) -> &mut DeviceCtrModel {
        &mut self.device
    }

    /// The trained model on the host.
    pub fn into_host(mut self) -> Result<CtrModel> {
        self.host()?;
        Ok(self.host)
    }
}

impl CtrStepper for GpuCtrTrainer {
    fn config(&self) -> &CtrConfig {
        &self.host.config
    }

    fn step(&mut self, batch: &CtrBatch, jagged: &JaggedBatch, dense_lr: f32) -> Result<StepStats> {
        self.host.check_batch(batch)?;
        self.host_current = false;
        let loss = self.device.train_step(batch, jagged, dense_lr)?;
        Ok(StepStats {
            loss,
            rows_updated: None,
        })
    }

    fn predict(&mut self, batch: &CtrBatch) -> Result<Vec<f32>> {
        self.host.check_batch(batch)?;
        if batch.is_empty() {
            return Ok(Vec::new());
        }
        let jagged = self.host.config.jagged(batch)?;
        self.device.predict(batch, &jagged)
    }

    fn row_cache(&mut self) -> Result<Option<RowCacheReport>> {
        self.device.row_cache_report()
    }

    fn host(&mut self) -> Result<&CtrModel> {
        if !self.host_current {
            self.device.download_into(&mut self.host)?;
            self.host_current = true;
        }
        Ok(&self.host)
    }
}
