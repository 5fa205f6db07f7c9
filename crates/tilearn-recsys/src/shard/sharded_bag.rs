//! The fused embedding bag sharded over the ranks of a communicator (model parallel), each rank
//! feeding its own data-parallel batch:
//!
//! 1. ids to their rows' owners (one exchange): for every shard table of rank `d`, the ids of
//!    each local bag that fall in its rows, as rows of the shard;
//! 2. each owner runs the fused forward on its shard for every rank's samples (rank 0's first)
//!    and sends each rank its pooled shard rows (second exchange); a rank adds them into its
//!    `[batch, total_dim]` output (one term per table-wise table, one per row range otherwise);
//! 3. backward: each rank sends each owner the output gradient of that owner's tables (third
//!    exchange), and the owner runs the fused backward + sparse rule on its shard.
//!
//! The owner's batch is the concatenation of the ranks' batches, so it sees every row's
//! contributions in the order one process would over the concatenated batch: weights and
//! optimizer state equal the single-process run's bit for bit; the forward too for table-wise
//! tables (row-wise ones add per-rank partial sums, a different order of the same sum).

use tilearn_parallel::Communicator;

use super::columns::{apply_copies, assemble, assemble_rounds, scatter_copies};
use super::exchange::{exchange_f32, exchange_u32};
use super::plan::ShardPlan;
use crate::embedding_bag::{embedding_bag_backward_update, embedding_bag_forward};
use crate::error::{RecsysError, Result};
use crate::jagged::JaggedBatch;
use crate::sparse_optim::{SparseOptimizer, SparseState};
use crate::tables::EmbeddingTables;

/// This rank's shard: its tables (`None` when the plan gives it none) and their state.
#[derive(Debug)]
pub struct ShardedEmbeddingBag {
    plan: ShardPlan,
    rank: usize,
    optimizer: SparseOptimizer,
    shard: Option<(EmbeddingTables, SparseState)>,
}

/// Every table whole, gathered from the shards ([`ShardedEmbeddingBag::gather_full`]): the
/// weights and the rule's state buffers (as `SparseState` lays them out; empty where the rule
/// keeps none) and the optimizer steps taken.
#[derive(Debug, Clone, PartialEq)]
pub struct GatheredTables {
    pub weights: Vec<f32>,
    pub state1: Vec<f32>,
    pub state2: Vec<f32>,
    pub steps: u64,
}

/// What a forward leaves for its backward: the shard's batch over every rank's samples and
/// each rank's number of samples.
#[derive(Debug)]
pub struct ShardedForward {
    shard_batch: Option<JaggedBatch>,
    samples: Vec<usize>,
}

/// Each owner's ids of this rank's `batch`: `[samples, per (shard table, sample) bag length..,
/// ids..]`, ids as rows of the owner's shard.
pub(crate) fn route_ids(plan: &ShardPlan, batch: &JaggedBatch) -> Vec<Vec<u32>> {
    let b = batch.batch();
    (0..plan.world())
        .map(|d| {
            let shard = plan.shard(d);
            let mut lens = Vec::with_capacity(1 + shard.len() * b);
            let mut ids = Vec::new();
            lens.push(b as u32);
            for s in shard {
                for sample in 0..b {
                    let before = ids.len();
                    ids.extend(
                        batch.ids()[batch.bag(s.table, sample)]
                            .iter()
                            .filter(|&&id| s.rows.contains(&(id as usize)))
                            .map(|&id| id - s.rows.start as u32),
                    );
                    lens.push((ids.len() - before) as u32);
                }
            }
            lens.extend(ids);
            lens
        })
        .collect()
}

/// From every rank's [`route_ids`] message to `rank`: each rank's number of samples, and the
/// shard's batch over all of them (rank 0's first, table-major; checked against
/// `shard_layout`, `None` when `rank` holds no shard).
pub(crate) fn shard_batch(
    plan: &ShardPlan,
    rank: usize,
    shard_layout: Option<&crate::tables::TableLayout>,
    received: &[Vec<u32>],
) -> Result<(Vec<usize>, Option<JaggedBatch>)> {
    let bad = |m: String| RecsysError::invalid("sharded ids", m);
    let samples: Vec<usize> = (received.iter())
        .map(|m| {
            m.first()
                .map(|&n| n as usize)
                .ok_or_else(|| bad("an empty message".into()))
        })
        .collect::<Result<_>>()?;
    let Some(shard_layout) = shard_layout else {
        return Ok((samples, None));
    };
    let total: usize = samples.iter().sum();
    let my_tables = plan.shard(rank).len();
    let mut offsets = vec![0u32];
    let mut ids = Vec::new();
    for lt in 0..my_tables {
        for (m, &n) in received.iter().zip(&samples) {
            let lens = (m.get(1..1 + my_tables * n))
                .ok_or_else(|| bad(format!("{} words for {n} samples", m.len())))?;
            let mut at =
                1 + my_tables * n + lens[..lt * n].iter().map(|&l| l as usize).sum::<usize>();
            for &len in &lens[lt * n..(lt + 1) * n] {
                let bag = (m.get(at..at + len as usize))
                    .ok_or_else(|| bad(format!("{} words, a bag ends past them", m.len())))?;
                ids.extend_from_slice(bag);
                at += len as usize;
                offsets.push(ids.len() as u32);
            }
        }
    }
    Ok((
        samples,
        Some(JaggedBatch::new(shard_layout, total, offsets, ids)?),
    ))
}

impl ShardedEmbeddingBag {
    /// Rank `rank`'s shard of `full` (the whole tables, e.g. the same seeded initialisation on
    /// every rank) with fresh `optimizer` state.
    pub fn from_full(
        plan: ShardPlan,
        rank: usize,
        full: &EmbeddingTables,
        optimizer: SparseOptimizer,
    ) -> Result<Self> {
        let state = SparseState::new(optimizer, &full.layout)?;
        Self::from_full_state(plan, rank, full, &state)
    }

    /// Rank `rank`'s shard of `full` and of its optimizer `state` (a fresh one, or one read
    /// from a checkpoint: its step count carries over).
    pub fn from_full_state(
        plan: ShardPlan,
        rank: usize,
        full: &EmbeddingTables,
        state: &SparseState,
    ) -> Result<Self> {
        if full.layout != *plan.layout() || rank >= plan.world() {
            return Err(RecsysError::invalid(
                "sharded embedding bag",
                format!(
                    "rank {rank} of {} with tables of another layout than the plan's",
                    plan.world()
                ),
            ));
        }
        state.check_layout(&full.layout)?;
        let optimizer = *state.optimizer();
        let per_row = matches!(optimizer, SparseOptimizer::RowWiseAdagrad { .. });
        let (uses1, uses2) = optimizer.state_buffers();
        let shard = match plan.shard_layout(rank)? {
            None => None,
            Some(layout) => {
                let mut weights = Vec::with_capacity(layout.total_elements());
                let (mut state1, mut state2) = (Vec::new(), Vec::new());
                for s in plan.shard(rank) {
                    let first = full.layout.row_range(s.table, s.rows.start).start;
                    let len = s.rows.len() * full.layout.specs()[s.table].dim;
                    weights.extend_from_slice(&full.weights[first..first + len]);
                    if uses1 && per_row {
                        let row = full.layout.row_base()[s.table] + s.rows.start;
                        state1.extend_from_slice(&state.state1()[row..row + s.rows.len()]);
                    } else if uses1 {
                        state1.extend_from_slice(&state.state1()[first..first + len]);
                    }
                    if uses2 {
                        state2.extend_from_slice(&state.state2()[first..first + len]);
                    }
                }
                let mut shard_state = SparseState::new(optimizer, &layout)?;
                shard_state.set_state(state1, state2, state.step())?;
                Some((EmbeddingTables::from_weights(layout, weights)?, shard_state))
            }
        };
        Ok(ShardedEmbeddingBag {
            plan,
            rank,
            optimizer,
            shard,
        })
    }

    pub fn plan(&self) -> &ShardPlan {
        &self.plan
    }

    /// This rank's shard tables and state (`None` when it holds none).
    pub fn shard(&self) -> Option<&(EmbeddingTables, SparseState)> {
        self.shard.as_ref()
    }

    /// Overwrites this rank's shard weights and optimizer state (e.g. with a GPU rank's
    /// trained copy before [`gather_full`](Self::gather_full)); the lengths must be the
    /// shard's.
    pub fn set_shard_state(
        &mut self,
        weights: Vec<f32>,
        state1: Vec<f32>,
        state2: Vec<f32>,
        step: u64,
    ) -> Result<()> {
        let Some((tables, state)) = &mut self.shard else {
            return Err(RecsysError::invalid(
                "sharded embedding bag",
                format!("rank {} holds no shard to set", self.rank),
            ));
        };
        if weights.len() != tables.weights.len() {
            return Err(RecsysError::invalid(
                "sharded embedding bag",
                format!(
                    "{} weights for a shard of {}",
                    weights.len(),
                    tables.weights.len()
                ),
            ));
        }
        state.set_state(state1, state2, step)?;
        tables.weights = weights;
        Ok(())
    }

    /// The forward of this rank's `batch` (ids of the whole tables) into `out` (`[batch,
    /// total_dim]`, written `=`). Collective: every rank calls it, each with its own batch.
    pub fn forward(
        &mut self,
        comm: &dyn Communicator,
        batch: &JaggedBatch,
        out: &mut [f32],
    ) -> Result<ShardedForward> {
        let layout = self.plan.layout().clone();
        batch.check_layout(&layout)?;
        let (world, b) = (self.plan.world(), batch.batch());
        if out.len() != b * layout.total_dim() || comm.world_size() != world {
            return Err(RecsysError::invalid(
                "sharded forward",
                format!(
                    "{} outputs for {b} x {} and {} ranks for a plan of {world}",
                    out.len(),
                    layout.total_dim(),
                    comm.world_size()
                ),
            ));
        }
        // 1. Each owner's ids.
        let received = exchange_u32(comm, &route_ids(&self.plan, batch))?;
        let shard_layout = self.shard.as_ref().map(|(tables, _)| &tables.layout);
        let (samples, shard_batch) = shard_batch(&self.plan, self.rank, shard_layout, &received)?;
        let width = self.plan.shard_width(self.rank);
        // 2. The shard's pooled rows over every rank's samples; each rank's part back to it.
        let pooled = match (&self.shard, &shard_batch) {
            (Some((tables, _)), Some(shard_batch)) => {
                let mut pooled = vec![0.0f32; shard_batch.batch() * width];
                embedding_bag_forward(tables, shard_batch, &mut pooled)?;
                pooled
            }
            _ => Vec::new(),
        };
        let mut first = 0;
        let replies: Vec<Vec<f32>> = (samples.iter())
            .map(|&n| {
                let rows = pooled[first * width..(first + n) * width].to_vec();
                first += n;
                rows
            })
            .collect();
        let pooled_parts = exchange_f32(comm, &replies)?;
        // Added into the output's columns (`columns`: the copies the GPU ranks run too).
        let bases: Vec<usize> = (pooled_parts.iter())
            .scan(0, |at, part| {
                let base = *at;
                *at += part.len();
                Some(base)
            })
            .collect();
        let rounds = assemble_rounds(&self.plan, b, &bases);
        assemble(&rounds, &pooled_parts.concat(), out);
        Ok(ShardedForward {
            shard_batch,
            samples,
        })
    }

    /// The backward of [`forward`](Self::forward) fused with the sparse rule: `dout` is this
    /// rank's `[batch, total_dim]` output gradient. Collective. Counts one optimizer step on
    /// every rank holding a shard.
    pub fn backward_update(
        &mut self,
        comm: &dyn Communicator,
        forward: &ShardedForward,
        dout: &[f32],
    ) -> Result<()> {
        let layout = self.plan.layout();
        let total_dim = layout.total_dim();
        let b = forward.samples[self.rank];
        if dout.len() != b * total_dim {
            return Err(RecsysError::invalid(
                "sharded backward",
                format!("{} gradients for {b} x {total_dim}", dout.len()),
            ));
        }
        // 3. Each owner gets the columns of its shard tables, [batch, shard width].
        let world = self.plan.world();
        let mut bases = Vec::with_capacity(world);
        let mut len = 0;
        for d in 0..world {
            bases.push(len);
            len += b * self.plan.shard_width(d);
        }
        let mut blocks = vec![0.0f32; len];
        apply_copies(dout, &mut blocks, &scatter_copies(&self.plan, b, &bases));
        let messages: Vec<Vec<f32>> = (0..world)
            .map(|d| blocks[bases[d]..bases[d] + b * self.plan.shard_width(d)].to_vec())
            .collect();
        let received = exchange_f32(comm, &messages)?;
        if let (Some((tables, state)), Some(shard_batch)) = (&mut self.shard, &forward.shard_batch)
        {
            let shard_dout: Vec<f32> = received.concat();
            embedding_bag_backward_update(tables, shard_batch, &shard_dout, state)?;
        }
        Ok(())
    }

    /// Every table's weights and optimizer state, whole, on every rank (collective): each
    /// rank sends its shard (weights, then the state buffers its rule keeps) to all, in chunks
    /// below the exchange's message limit, and every rank places each shard's rows, laid out
    /// as the plan's full tables.
    pub fn gather_full(&self, comm: &dyn Communicator) -> Result<GatheredTables> {
        const CHUNK: usize = 1 << 22;
        let layout = self.plan.layout();
        let world = self.plan.world();
        let (uses1, uses2) = self.optimizer.state_buffers();
        let per_row = matches!(self.optimizer, SparseOptimizer::RowWiseAdagrad { .. });
        let shard_layouts: Vec<_> = (0..world)
            .map(|r| self.plan.shard_layout(r))
            .collect::<Result<_>>()?;
        let sizes = |l: &Option<crate::tables::TableLayout>| -> (usize, usize, usize) {
            let Some(l) = l else { return (0, 0, 0) };
            let s1 = match (uses1, per_row) {
                (false, _) => 0,
                (true, true) => l.total_rows(),
                (true, false) => l.total_elements(),
            };
            let s2 = if uses2 { l.total_elements() } else { 0 };
            (l.total_elements(), s1, s2)
        };
        let mine: Vec<f32> = match &self.shard {
            None => Vec::new(),
            Some((tables, state)) => {
                let (_, s1, s2) = sizes(&shard_layouts[self.rank]);
                let mut m = tables.weights.clone();
                m.extend_from_slice(&state.state1()[..s1]);
                m.extend_from_slice(&state.state2()[..s2]);
                m
            }
        };
        let total = |r: usize| {
            let (w, s1, s2) = sizes(&shard_layouts[r]);
            w + s1 + s2
        };
        let longest = (0..world).map(total).max().unwrap_or(0);
        let mut received = vec![Vec::new(); world];
        for round in 0..longest.div_ceil(CHUNK) {
            let part = mine[(round * CHUNK).min(mine.len())..((round + 1) * CHUNK).min(mine.len())]
                .to_vec();
            for (r, got) in exchange_f32(comm, &vec![part; world])?
                .into_iter()
                .enumerate()
            {
                received[r].extend(got);
            }
        }
        let full = SparseState::new(self.optimizer, layout)?;
        let mut weights = vec![0.0f32; layout.total_elements()];
        let (mut state1, mut state2) = (full.state1().to_vec(), full.state2().to_vec());
        for (r, shard_layout) in shard_layouts.iter().enumerate() {
            let Some(shard_layout) = shard_layout else {
                continue;
            };
            let (w, s1, _) = sizes(&Some(shard_layout.clone()));
            let buf = &received[r];
            for (i, s) in self.plan.shard(r).iter().enumerate() {
                let dim = layout.specs()[s.table].dim;
                let (len, src) = (s.rows.len() * dim, shard_layout.weight_offset()[i]);
                let dst = layout.row_range(s.table, s.rows.start).start;
                weights[dst..dst + len].copy_from_slice(&buf[src..src + len]);
                if uses1 && per_row {
                    let (src, dst) = (shard_layout.row_base()[i], layout.row_base()[s.table]);
                    let (src, dst) = (w + src, dst + s.rows.start);
                    state1[dst..dst + s.rows.len()].copy_from_slice(&buf[src..src + s.rows.len()]);
                } else if uses1 {
                    state1[dst..dst + len].copy_from_slice(&buf[w + src..w + src + len]);
                }
                if uses2 {
                    let at = w + s1 + src;
                    state2[dst..dst + len].copy_from_slice(&buf[at..at + len]);
                }
            }
        }
        // Every rank holding a shard has taken every step; one without takes none.
        let mut steps = [self.shard.as_ref().map_or(0.0, |(_, st)| st.step() as f32)];
        (comm.all_reduce((&mut steps[..]).into(), tilearn_parallel::ReduceOp::Max))
            .and_then(|w| w.wait())
            .map_err(|e| RecsysError::invalid("sharded gather", e.to_string()))?;
        Ok(GatheredTables {
            weights,
            state1,
            state2,
            steps: steps[0] as u64,
        })
    }
}
