//! DeepFM and Wide & Deep on the CPU: the fused embedding bag (sparse part, updated inside its
//! backward by a [`SparseOptimizer`]), the head of [`head`] (dense part, stepped by
//! tilearn-optim's AdamW over one flat buffer), and the BCE-with-logits loss.

pub mod config;
pub mod head;
pub mod io;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use tilearn_optim::{AdamW, AdamWConfig};

pub use config::{CtrConfig, DenseLayout, LinearLayer, ModelKind};
pub use head::{HeadCache, bce_with_logits, head_backward, head_forward};

use crate::data::CtrBatch;
use crate::embedding_bag::{embedding_bag_backward_update, embedding_bag_forward};
use crate::error::{RecsysError, Result};
use crate::jagged::JaggedBatch;
use crate::sparse_optim::{SparseOptimizer, SparseState};
use crate::tables::EmbeddingTables;

/// A CTR model with its optimizers' state.
#[derive(Debug)]
pub struct CtrModel {
    pub config: CtrConfig,
    pub layout: DenseLayout,
    pub tables: EmbeddingTables,
    pub sparse: SparseState,
    /// The flat dense parameters ([`DenseLayout`]).
    pub dense: Vec<f32>,
    pub adamw: AdamW,
}

/// What one training step measured.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepStats {
    pub loss: f64,
    /// Distinct embedding rows the sparse optimizer updated (`None` on the GPU, whose fused
    /// backward keeps the count on the device).
    pub rows_updated: Option<usize>,
}

/// PyTorch's `nn.Linear` initialisation: weight and bias uniform in `±1/sqrt(fan_in)`.
pub fn init_dense(layout: &DenseLayout, num_dense: usize, rng: &mut impl Rng) -> Vec<f32> {
    let mut dense = vec![0.0f32; layout.numel];
    let bound = 1.0 / (num_dense.max(1) as f32).sqrt();
    for w in &mut dense[layout.dense_weights.clone()] {
        *w = rng.random_range(-bound..bound);
    }
    for layer in &layout.layers {
        let bound = 1.0 / (layer.fan_in as f32).sqrt();
        for w in &mut dense[layer.weight.start..layer.bias.end] {
            *w = rng.random_range(-bound..bound);
        }
    }
    dense
}

impl CtrModel {
    /// A freshly initialised model (seeded): tables as [`EmbeddingTables::new`], dense
    /// parameters as [`init_dense`].
    pub fn new(
        config: CtrConfig,
        sparse: SparseOptimizer,
        dense_optimizer: AdamWConfig,
        seed: u64,
    ) -> Result<Self> {
        config.validate()?;
        let table_layout = config.table_layout()?;
        let tables = EmbeddingTables::new(table_layout.clone(), seed);
        let layout = config.dense_layout();
        let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0x5eed_d3a5e);
        let dense = init_dense(&layout, config.num_dense, &mut rng);
        let adamw = AdamW::with_single_group(dense_optimizer, layout.numel)?;
        Ok(CtrModel {
            sparse: SparseState::new(sparse, &table_layout)?,
            config,
            layout,
            tables,
            dense,
            adamw,
        })
    }

    /// Fails unless `batch` has this model's numbers of dense and categorical features.
    pub fn check_batch(&self, batch: &CtrBatch) -> Result<()> {
        if batch.num_dense != self.config.num_dense || batch.num_fields != self.config.num_fields()
        {
            return Err(RecsysError::invalid(
                "batch",
                format!(
                    "{} dense and {} categorical features per sample; the model takes {} and {}",
                    batch.num_dense,
                    batch.num_fields,
                    self.config.num_dense,
                    self.config.num_fields()
                ),
            ));
        }
        Ok(())
    }

    fn pooled(&self, batch: &CtrBatch) -> Result<(JaggedBatch, Vec<f32>)> {
        self.check_batch(batch)?;
        let jagged = self.config.jagged(batch)?;
        let mut emb = vec![0.0f32; batch.len() * self.tables.layout.total_dim()];
        embedding_bag_forward(&self.tables, &jagged, &mut emb)?;
        Ok((jagged, emb))
    }

    /// Logits of every sample.
    pub fn predict(&self, batch: &CtrBatch) -> Result<Vec<f32>> {
        let (_, emb) = self.pooled(batch)?;
        let (logits, _) = head_forward(
            &self.config,
            &self.layout,
            &self.dense,
            &emb,
            &batch.dense,
            batch.len(),
        )?;
        Ok(logits)
    }

    /// One step: forward, mean BCE loss, backward; the embedding rows of the batch are updated
    /// inside the embedding backward, the dense parameters by AdamW at `dense_lr`.
    pub fn train_step(&mut self, batch: &CtrBatch, dense_lr: f32) -> Result<StepStats> {
        self.check_batch(batch)?;
        let jagged = self.config.jagged(batch)?;
        self.train_step_jagged(batch, &jagged, dense_lr)
    }

    /// [`train_step`](Self::train_step) with the batch's jagged ids already built by
    /// `self.config.jagged(batch)` (the training loop builds them on its loader thread).
    pub fn train_step_jagged(
        &mut self,
        batch: &CtrBatch,
        jagged: &JaggedBatch,
        dense_lr: f32,
    ) -> Result<StepStats> {
        self.check_batch(batch)?;
        let mut emb = vec![0.0f32; batch.len() * self.tables.layout.total_dim()];
        embedding_bag_forward(&self.tables, jagged, &mut emb)?;
        let n = batch.len();
        let (logits, cache) = head_forward(
            &self.config,
            &self.layout,
            &self.dense,
            &emb,
            &batch.dense,
            n,
        )?;
        let loss = bce_with_logits(&logits, &batch.labels);
        let scale = 1.0 / n.max(1) as f32;
        let dlogits: Vec<f32> = logits
            .iter()
            .zip(&batch.labels)
            .map(|(&z, &y)| (sigmoid(z) - y) * scale)
            .collect();
        let mut dparams = vec![0.0f32; self.layout.numel];
        let mut demb = vec![0.0f32; emb.len()];
        head_backward(
            &self.config,
            &self.layout,
            &self.dense,
            &emb,
            &batch.dense,
            &cache,
            &dlogits,
            &mut dparams,
            &mut demb,
        )?;
        let rows_updated =
            embedding_bag_backward_update(&mut self.tables, jagged, &demb, &mut self.sparse)?;
        self.adamw.step(&mut self.dense, &dparams, dense_lr)?;
        Ok(StepStats {
            loss,
            rows_updated: Some(rows_updated),
        })
    }
}

/// The logistic function, stable for large |z|.
pub fn sigmoid(z: f32) -> f32 {
    if z >= 0.0 {
        1.0 / (1.0 + (-z).exp())
    } else {
        let e = z.exp();
        e / (1.0 + e)
    }
}
