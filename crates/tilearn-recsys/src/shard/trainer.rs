//! DeepFM / Wide & Deep trained over the ranks of a communicator (`tilearn launch
//! --nproc-per-node N ctr train`): the embedding tables sharded ([`ShardedEmbeddingBag`],
//! table-wise and row-wise, lookups and gradients exchanged with all-to-all), the dense part
//! (MLP, dense-feature weights, bias) replicated and data parallel.
//!
//! Every rank feeds the same global batch (the loader is seeded alike) and takes its own
//! contiguous part of it (rank r the r-th of N nearly equal parts). A step: the sharded
//! forward; the head forward and backward on the rank's samples with d loss / d logit scaled by
//! 1 / (global batch), so that the dense gradients summed by one all-reduce are the global
//! batch's mean-loss gradient; the same AdamW step on every rank; the sharded backward + sparse
//! rule, whose owners see the global batch in rank order, i.e. in the single process's order.
//! One process on the same global batches therefore computes the same step; sums run in other
//! orders (the all-reduce, row-wise partial bags), so results agree to rounding, which AdamW
//! may enlarge for near-zero gradient elements. Evaluation splits each chunk the same way and
//! sums the logits back into place with an all-reduce. Checkpoints are the single process's
//! files: every rank gathers the whole model, rank 0 writes it; a resume re-shards it.

use std::ops::Range;
use std::sync::Arc;

use tilearn_parallel::{Communicator, ReduceOp};

use super::exchange::{join_f64, split_f64};
use super::plan::ShardPlan;
use super::sharded_bag::ShardedEmbeddingBag;
use crate::data::CtrBatch;
use crate::error::{RecsysError, Result};
use crate::jagged::JaggedBatch;
use crate::model::{
    CtrConfig, CtrModel, StepStats, bce_with_logits, head_backward, head_forward, sigmoid,
};
use crate::stepper::CtrStepper;

/// One rank's view of a sharded CTR model.
pub struct ShardedCtrTrainer {
    comm: Arc<dyn Communicator>,
    /// Config, dense parameters and AdamW (replicated); its tables are filled from the shards
    /// only when [`CtrStepper::host`] asks.
    model: CtrModel,
    bag: ShardedEmbeddingBag,
    host_current: bool,
}

impl std::fmt::Debug for ShardedCtrTrainer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShardedCtrTrainer")
            .field("rank", &self.comm.rank())
            .field("world", &self.comm.world_size())
            .field("plan", self.bag.plan())
            .finish()
    }
}

fn comm_error(e: tilearn_parallel::ParallelError) -> RecsysError {
    RecsysError::invalid("sharded training", e.to_string())
}

impl ShardedCtrTrainer {
    /// This rank's part of `model` (the same model on every rank: freshly initialised with the
    /// same config and seed, or read from the same checkpoint) placed by `plan`. The full
    /// tables are dropped once sharded.
    pub fn new(comm: Arc<dyn Communicator>, mut model: CtrModel, plan: ShardPlan) -> Result<Self> {
        if plan.world() != comm.world_size() || *plan.layout() != model.tables.layout {
            return Err(RecsysError::invalid(
                "sharded training",
                format!(
                    "a plan for {} ranks and other tables than the model's, on {} ranks",
                    plan.world(),
                    comm.world_size()
                ),
            ));
        }
        let bag =
            ShardedEmbeddingBag::from_full_state(plan, comm.rank(), &model.tables, &model.sparse)?;
        model.tables.weights = Vec::new();
        Ok(ShardedCtrTrainer {
            comm,
            model,
            bag,
            host_current: false,
        })
    }

    pub fn plan(&self) -> &ShardPlan {
        self.bag.plan()
    }

    /// This rank's samples of a global batch of `n`.
    fn local(&self, n: usize) -> Range<usize> {
        let (r, world) = (self.comm.rank(), self.comm.world_size());
        r * n / world..(r + 1) * n / world
    }

    fn all_reduce_sum(&self, buf: &mut [f32]) -> Result<()> {
        (self.comm.all_reduce(buf.into(), ReduceOp::Sum))
            .and_then(|w| w.wait())
            .map_err(comm_error)
    }

    /// The sharded lookup of this rank's part of `batch`: (its samples, their ids, pooled
    /// embeddings, what the backward needs). Collective.
    fn lookup(&mut self, batch: &CtrBatch) -> Result<(CtrBatch, super::ShardedForward, Vec<f32>)> {
        self.model.check_batch(batch)?;
        let local = batch.slice(self.local(batch.len()));
        let jagged: JaggedBatch = self.model.config.jagged(&local)?;
        let mut emb = vec![0.0f32; local.len() * self.model.tables.layout.total_dim()];
        let forward = self.bag.forward(&*self.comm, &jagged, &mut emb)?;
        Ok((local, forward, emb))
    }

    /// The trained model, whole, on every rank (collective).
    pub fn into_host(mut self) -> Result<CtrModel> {
        self.host()?;
        Ok(self.model)
    }
}

impl CtrStepper for ShardedCtrTrainer {
    fn config(&self) -> &CtrConfig {
        &self.model.config
    }

    fn step(
        &mut self,
        batch: &CtrBatch,
        _jagged: &JaggedBatch,
        dense_lr: f32,
    ) -> Result<StepStats> {
        let n = batch.len();
        if n < self.comm.world_size() {
            return Err(RecsysError::invalid(
                "--batch-size",
                format!(
                    "a global batch of {n} samples for {} ranks; each rank needs >= 1 sample",
                    self.comm.world_size()
                ),
            ));
        }
        let (local, forward, emb) = self.lookup(batch)?;
        let m = &self.model;
        let nl = local.len();
        let (logits, cache) = head_forward(&m.config, &m.layout, &m.dense, &emb, &local.dense, nl)?;
        let loss_sum = bce_with_logits(&logits, &local.labels) * nl as f64;
        let scale = 1.0 / n as f32;
        let dlogits: Vec<f32> = (logits.iter().zip(&local.labels))
            .map(|(&z, &y)| (sigmoid(z) - y) * scale)
            .collect();
        let numel = m.layout.numel;
        // The dense gradient, then the loss sum as three f32 parts (`split_f64`), reduced
        // together.
        let mut reduced = vec![0.0f32; numel + 3];
        let mut demb = vec![0.0f32; emb.len()];
        head_backward(
            &m.config,
            &m.layout,
            &m.dense,
            &emb,
            &local.dense,
            &cache,
            &dlogits,
            &mut reduced[..numel],
            &mut demb,
        )?;
        reduced[numel..].copy_from_slice(&split_f64(loss_sum));
        self.all_reduce_sum(&mut reduced)?;
        let parts = [reduced[numel], reduced[numel + 1], reduced[numel + 2]];
        let loss = join_f64(parts) / n as f64;
        let model = &mut self.model;
        model
            .adamw
            .step(&mut model.dense, &reduced[..numel], dense_lr)?;
        self.bag.backward_update(&*self.comm, &forward, &demb)?;
        self.host_current = false;
        Ok(StepStats {
            loss,
            rows_updated: None,
        })
    }

    fn predict(&mut self, batch: &CtrBatch) -> Result<Vec<f32>> {
        let range = self.local(batch.len());
        let (local, _, emb) = self.lookup(batch)?;
        let mut logits = vec![0.0f32; batch.len()];
        if !local.is_empty() {
            let m = &self.model;
            let (mine, _) = head_forward(
                &m.config,
                &m.layout,
                &m.dense,
                &emb,
                &local.dense,
                local.len(),
            )?;
            logits[range].copy_from_slice(&mine);
        }
        // Each logit is non-zero on one rank only: the sum puts every one in place exactly.
        self.all_reduce_sum(&mut logits)?;
        Ok(logits)
    }

    fn writes_checkpoints(&self) -> bool {
        // Every rank gathers the model (collective); rank 0 alone writes it.
        self.comm.rank() == 0
    }

    fn host(&mut self) -> Result<&CtrModel> {
        if !self.host_current {
            let full = self.bag.gather_full(&*self.comm)?;
            self.model.tables.weights = full.weights;
            (self.model.sparse).set_state(full.state1, full.state2, full.steps)?;
            self.host_current = true;
        }
        Ok(&self.model)
    }
}
