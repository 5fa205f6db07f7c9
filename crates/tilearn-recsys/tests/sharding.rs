//! The embedding bag sharded over 2 and 3 ranks (threads of one process joined by the host
//! communicator over loopback), some tables table-wise, the sum-pooled ones row-wise, each
//! rank with its own batch, against one process running the concatenated batch:
//! * table-wise outputs bit for bit, row-wise ones within 1e-6 relative (the ranks' partial
//!   sums of a bag are added in another order than one serial sum);
//! * after several steps every shard's weights and optimizer state bit for bit (each row is
//!   updated by its one owner from the same contributions in the same order).

mod common;

use std::time::Duration;

use common::{odd_layout, random_batch, random_values};
use tilearn_parallel::host::run_on_threads;
use tilearn_recsys::shard::{ShardPlan, ShardedEmbeddingBag, Sharding};
use tilearn_recsys::{
    EmbeddingTables, JaggedBatch, Pooling, SparseOptimizer, SparseState, TableLayout,
    embedding_bag_backward_update, embedding_bag_forward,
};

const STEPS: u64 = 4;
const BATCH: usize = 37;

/// Sum-pooled tables row-wise, mean-pooled ones table-wise on rank `t % world`.
fn placement(layout: &TableLayout, world: usize) -> Vec<Sharding> {
    (layout.specs().iter().enumerate())
        .map(|(t, s)| match s.pooling {
            Pooling::Sum => Sharding::RowWise,
            Pooling::Mean => Sharding::TableWise { owner: t % world },
        })
        .collect()
}

fn local_inputs(layout: &TableLayout, rank: usize, step: u64) -> (JaggedBatch, Vec<f32>) {
    let seed = 1000 * step + rank as u64;
    let batch = random_batch(layout, BATCH, 5, 1.1, seed);
    (batch, random_values(BATCH * layout.total_dim(), seed + 77))
}

/// The ranks' batches as one batch (rank 0's samples first), table-major.
fn concatenated(layout: &TableLayout, batches: &[JaggedBatch]) -> JaggedBatch {
    let mut offsets = vec![0u32];
    let mut ids = Vec::new();
    for t in 0..layout.num_tables() {
        for b in batches {
            for s in 0..b.batch() {
                ids.extend_from_slice(&b.ids()[b.bag(t, s)]);
                offsets.push(ids.len() as u32);
            }
        }
    }
    JaggedBatch::new(layout, BATCH * batches.len(), offsets, ids).unwrap()
}

#[test]
fn sharded_training_equals_one_process() {
    let layout = odd_layout();
    let full = EmbeddingTables::new(layout.clone(), 12);
    for world in [2, 3] {
        for optimizer in [
            SparseOptimizer::row_wise_adagrad(0.1),
            SparseOptimizer::adam(0.01),
        ] {
            let plan = ShardPlan::new(&layout, &placement(&layout, world), world).unwrap();
            let results = run_on_threads(world, Duration::from_secs(60), |rank, comm| {
                let mut bag =
                    ShardedEmbeddingBag::from_full(plan.clone(), rank, &full, optimizer).unwrap();
                let mut outputs = Vec::new();
                for step in 0..STEPS {
                    let (batch, dout) = local_inputs(&layout, rank, step);
                    let mut out = vec![f32::NAN; BATCH * layout.total_dim()];
                    let fwd = bag.forward(&comm, &batch, &mut out).unwrap();
                    bag.backward_update(&comm, &fwd, &dout).unwrap();
                    outputs.push(out);
                }
                (outputs, bag.shard().cloned())
            })
            .unwrap();

            let mut tables = full.clone();
            let mut state = SparseState::new(optimizer, &layout).unwrap();
            let width = layout.total_dim();
            for step in 0..STEPS {
                let inputs: Vec<_> = (0..world).map(|r| local_inputs(&layout, r, step)).collect();
                let batches: Vec<JaggedBatch> = inputs.iter().map(|(b, _)| b.clone()).collect();
                let global = concatenated(&layout, &batches);
                let dout: Vec<f32> = inputs.iter().flat_map(|(_, d)| d.clone()).collect();
                let mut want = vec![0.0; world * BATCH * width];
                embedding_bag_forward(&tables, &global, &mut want).unwrap();
                embedding_bag_backward_update(&mut tables, &global, &dout, &mut state).unwrap();
                for (rank, (outputs, _)) in results.iter().enumerate() {
                    let want = &want[rank * BATCH * width..(rank + 1) * BATCH * width];
                    for (t, spec) in layout.specs().iter().enumerate() {
                        let col = layout.col_offset()[t];
                        for s in 0..BATCH {
                            let range = s * width + col..s * width + col + spec.dim;
                            let (g, w) = (&outputs[step as usize][range.clone()], &want[range]);
                            let exact = matches!(plan_kind(&plan, t), Kind::TableWise);
                            for (&g, &w) in g.iter().zip(w) {
                                let ok = if exact {
                                    g == w
                                } else {
                                    (g - w).abs() <= 1e-6 * (1.0 + w.abs())
                                };
                                assert!(
                                    ok,
                                    "world {world} step {step} rank {rank} table {t}: {g} vs {w}"
                                );
                            }
                        }
                    }
                }
            }
            // Every shard's rows and row state equal the one-process run's.
            for (rank, (_, shard)) in results.iter().enumerate() {
                let Some((shard_tables, shard_state)) = shard else {
                    assert!(plan.shard(rank).is_empty());
                    continue;
                };
                for (lt, s) in plan.shard(rank).iter().enumerate() {
                    let dim = layout.specs()[s.table].dim;
                    let want_first = layout.row_range(s.table, s.rows.start).start;
                    let want = want_first..want_first + s.rows.len() * dim;
                    let got_first = shard_tables.layout.row_range(lt, 0).start;
                    let got = got_first..got_first + s.rows.len() * dim;
                    assert!(
                        shard_tables.weights[got.clone()] == tables.weights[want.clone()],
                        "world {world} {optimizer:?}: rank {rank} table {}: weights differ",
                        s.table
                    );
                    let states_equal = match optimizer {
                        SparseOptimizer::RowWiseAdagrad { .. } => {
                            let g0 = shard_tables.layout.row_base()[lt];
                            let w0 = layout.row_base()[s.table] + s.rows.start;
                            shard_state.state1()[g0..g0 + s.rows.len()]
                                == state.state1()[w0..w0 + s.rows.len()]
                        }
                        _ => {
                            shard_state.state1()[got.clone()] == state.state1()[want.clone()]
                                && shard_state.state2()[got] == state.state2()[want]
                        }
                    };
                    assert!(
                        states_equal,
                        "world {world} {optimizer:?}: rank {rank} table {}: state differs",
                        s.table
                    );
                }
                assert_eq!(shard_state.step(), state.step());
            }
        }
    }
}

enum Kind {
    TableWise,
    RowWise,
}

fn plan_kind(plan: &ShardPlan, table: usize) -> Kind {
    let holders = (0..plan.world())
        .filter(|&r| plan.shard(r).iter().any(|s| s.table == table))
        .count();
    let whole = (0..plan.world()).any(|r| {
        plan.shard(r)
            .iter()
            .any(|s| s.table == table && s.rows == (0..plan.layout().specs()[table].rows))
    });
    if holders == 1 && whole {
        Kind::TableWise
    } else {
        Kind::RowWise
    }
}

#[test]
fn plans_refuse_what_cannot_work() {
    let layout = odd_layout();
    let mean_row_wise = vec![Sharding::RowWise; layout.num_tables()];
    let err = ShardPlan::new(&layout, &mean_row_wise, 2)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("mean-pooled") && err.contains("table-wise"),
        "{err}"
    );
    let bad_owner = vec![Sharding::TableWise { owner: 2 }; layout.num_tables()];
    assert!(ShardPlan::new(&layout, &bad_owner, 2).is_err());
    assert!(ShardPlan::new(&layout, &bad_owner[1..], 3).is_err());
    // A row-wise table of one row lives on rank 0 only.
    let plan = ShardPlan::new(&layout, &placement(&layout, 3), 3).unwrap();
    let one_row = layout.specs().iter().position(|s| s.rows == 1).unwrap();
    let holders: Vec<usize> = (0..3)
        .filter(|&r| plan.shard(r).iter().any(|s| s.table == one_row))
        .collect();
    assert_eq!(holders, [0]);
}

/// DeepFM trained sharded over 2 and 3 ranks (`ShardedCtrTrainer`: balanced plan with the
/// larger tables row-wise, the dense part data parallel) against one process on the same global
/// batches, through the training loop: every step's loss within 1e-5 relative, the held-out
/// loss within 1e-5 and AUC within 1e-4, and the gathered tables (every row, both rules'
/// state) within 1e-4 of the single process's. Not bit for bit: the dense gradient is summed
/// by the all-reduce in another order than one process's GEMM, and the row-wise bags add
/// partial sums; AdamW turns those roundings into small steps of near-zero gradient elements.
#[test]
fn sharded_ctr_training_follows_one_process() {
    use std::sync::Arc;
    use tilearn_optim::AdamWConfig;
    use tilearn_parallel::Communicator;
    use tilearn_recsys::data::SyntheticCriteo;
    use tilearn_recsys::shard::ShardedCtrTrainer;
    use tilearn_recsys::train::{TrainOptions, train};
    use tilearn_recsys::{CtrConfig, CtrModel, ModelKind};

    let config = CtrConfig::for_fields(ModelKind::DeepFm, 13, 26, 300, 8, vec![32, 16]);
    let generator = SyntheticCriteo::criteo_shaped(5, 400);
    let data = Arc::new(generator.generate(0, 96 * 12).0);
    let eval = generator.generate(1 << 20, 500).0;
    let options = TrainOptions {
        steps: 12,
        batch_size: 96,
        dense_lr: 3e-3,
        eval_every: 6,
        seed: 4,
        save: None,
        resume: None,
    };
    let dense = AdamWConfig {
        lr: 3e-3,
        weight_decay: 0.0,
        ..AdamWConfig::default()
    };
    for sparse in [
        SparseOptimizer::row_wise_adagrad(0.05),
        SparseOptimizer::adam(2e-3),
    ] {
        let model = || CtrModel::new(config.clone(), sparse, dense, 8).unwrap();
        let mut single = model();
        let mut single_losses = Vec::new();
        let single_records = train(
            &mut single,
            data.clone(),
            &eval,
            &options,
            |_, l| single_losses.push(l),
            |_| Ok(()),
        )
        .unwrap();
        for world in [2, 3] {
            let results = run_on_threads(world, Duration::from_secs(120), |_, comm| {
                let layout = model().tables.layout.clone();
                // The 26 field tables (300 rows) row-wise, the first-order ones table-wise.
                let plan = ShardPlan::balanced(&layout, world, 300).unwrap();
                let comm: Arc<dyn Communicator> = Arc::new(comm);
                let mut trainer = ShardedCtrTrainer::new(comm, model(), plan).unwrap();
                let mut losses = Vec::new();
                let records = train(
                    &mut trainer,
                    data.clone(),
                    &eval,
                    &options,
                    |_, l| losses.push(l),
                    |_| Ok(()),
                )
                .unwrap();
                let host = trainer.into_host().unwrap();
                (losses, records, host)
            })
            .unwrap();
            for (rank, (losses, records, host)) in results.iter().enumerate() {
                let what = format!("{sparse:?} world {world} rank {rank}");
                for (step, (&got, &want)) in losses.iter().zip(&single_losses).enumerate() {
                    let rel = ((got - want) / want).abs();
                    assert!(rel <= 1e-5, "{what} step {step}: loss {got} vs {want}");
                }
                for (got, want) in records.iter().zip(&single_records) {
                    let (gl, wl) = (got.eval_loss.unwrap(), want.eval_loss.unwrap());
                    assert!(
                        ((gl - wl) / wl).abs() <= 1e-5,
                        "{what}: eval loss {gl} vs {wl}"
                    );
                    let (ga, wa) = (got.eval_auc.unwrap(), want.eval_auc.unwrap());
                    assert!((ga - wa).abs() <= 1e-4, "{what}: AUC {ga} vs {wa}");
                }
                let worst = |a: &[f32], b: &[f32]| {
                    assert_eq!(a.len(), b.len(), "{what}: lengths");
                    a.iter()
                        .zip(b)
                        .map(|(x, y)| (x - y).abs())
                        .fold(0.0f32, f32::max)
                };
                let dw = worst(&host.tables.weights, &single.tables.weights);
                let ds1 = worst(host.sparse.state1(), single.sparse.state1());
                let ds2 = worst(host.sparse.state2(), single.sparse.state2());
                eprintln!("{what}: max |Δ| rows {dw:e}, state {ds1:e} / {ds2:e}");
                assert!(dw <= 1e-4 && ds1 <= 1e-4 && ds2 <= 1e-4, "{what}");
                assert_eq!(host.sparse.step(), single.sparse.step(), "{what}: steps");
            }
        }
    }
}
