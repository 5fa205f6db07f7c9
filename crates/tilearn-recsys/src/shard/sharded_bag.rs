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
        // 1. Each owner's ids: [samples, per (shard table, sample) bag length.., ids..].
        let messages: Vec<Vec<u32>> = (0..world)
            .map(|d| {
                let shard = self.plan.shard(d);
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
            .collect();
        let received = exchange_u32(comm, &messages)?;
        let samples: Vec<usize> = received.iter().map(|m| m[0] as usize).collect();
        let total: usize = samples.iter().sum();
        let my_tables = self.plan.shard(self.rank).len();
        let width = self.plan.shard_width(self.rank);
        // The shard's batch over every rank's samples (rank 0's first), table-major.
        let (shard_batch, pooled) = match &self.shard {
            None => (None, vec![0.0f32; 0]),
            Some((tables, _)) => {
                let mut offsets = vec![0u32];
                let mut ids = Vec::new();
                for lt in 0..my_tables {
                    for (m, &n) in received.iter().zip(&samples) {
                        let lens = &m[1..1 + my_tables * n];
                        let mut at = 1
                            + my_tables * n
                            + lens[..lt * n].iter().map(|&l| l as usize).sum::<usize>();
                        for &len in &lens[lt * n..(lt + 1) * n] {
                            ids.extend_from_slice(&m[at..at + len as usize]);
                            at += len as usize;
                            offsets.push(ids.len() as u32);
                        }
                    }
                }
                let shard_batch = JaggedBatch::new(&tables.layout, total, offsets, ids)?;
                let mut pooled = vec![0.0f32; total * width];
                embedding_bag_forward(tables, &shard_batch, &mut pooled)?;
                (Some(shard_batch), pooled)
            }
        };
        // 2. Each rank's pooled shard rows back to it; added into the output's columns.
        let mut first = 0;
        let replies: Vec<Vec<f32>> = (samples.iter())
            .map(|&n| {
                let rows = pooled[first * width..(first + n) * width].to_vec();
                first += n;
                rows
            })
            .collect();
        let pooled_parts = exchange_f32(comm, &replies)?;
        out.fill(0.0);
        let total_dim = layout.total_dim();
        for (d, part) in pooled_parts.iter().enumerate() {
            let mut col = 0;
            let w = self.plan.shard_width(d);
            for s in self.plan.shard(d) {
                let (dim, dst) = (layout.specs()[s.table].dim, layout.col_offset()[s.table]);
                for sample in 0..b {
                    let src = &part[sample * w + col..sample * w + col + dim];
                    for (o, &x) in out[sample * total_dim + dst..][..dim].iter_mut().zip(src) {
                        *o += x;
                    }
                }
                col += dim;
            }
        }
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
        let messages: Vec<Vec<f32>> = (0..self.plan.world())
            .map(|d| {
                let mut m = Vec::with_capacity(b * self.plan.shard_width(d));
                for sample in 0..b {
                    for s in self.plan.shard(d) {
                        let (dim, col) =
                            (layout.specs()[s.table].dim, layout.col_offset()[s.table]);
                        m.extend_from_slice(&dout[sample * total_dim + col..][..dim]);
                    }
                }
                m
            })
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
