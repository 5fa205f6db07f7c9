//! DeepFM sharded over GPU ranks (`cuda::GpuShardedCtrTrainer`): two ranks sharing one GPU
//! (threads of this process joined by the host communicator, device buffers staged through
//! pinned memory — NCCL refuses two ranks on one device) against one GPU rank
//! (`cuda::GpuCtrTrainer`) on the same global batches, through the training loop.
//!
//! * Table-wise (`ShardPlan::balanced` with no table row-wise) and row-wise (every table split
//!   over both ranks), row-wise Adagrad and SparseAdam: every step's loss within 1e-5
//!   relative, held-out loss within 1e-5 and AUC within 1e-4, every table row and the sparse
//!   state within 1e-4 absolute. Not bit for bit: the dense gradient is the sum of two ranks'
//!   GEMMs over half batches (another order than one GEMM over the whole batch), row-wise bags
//!   add two partial sums, and AdamW turns such roundings into lr-sized steps of near-zero
//!   gradient elements (the CPU sharded trainer's bounds, `tests/sharding.rs`).
//! * Resume: 2 ranks, 2N steps straight equal N steps + checkpoint + a fresh trainer from it +
//!   N steps, bit for bit (the same kernels on the same data; the checkpoint holds every
//!   state exactly). The checkpoint is the single process's format, so it also loads into one
//!   GPU rank and into the CPU model, which continue within the bounds above.
//! * NCCL with one rank: the sharded trainer over a one-rank NCCL communicator (device buffers
//!   through `ncclSend`/`ncclRecv` and `ncclAllReduce`) equals the one GPU rank bit for bit
//!   in every table row, state, dense parameter, loss and AUC (one rank holds every table;
//!   its exchanges are copies; the loss sum crosses the host as three f32 parts, exactly).
//!
//! Without a GPU or driver each test prints `skipped: <reason>` to stderr and passes.
#![cfg(feature = "cuda")]

use std::io::Write;
use std::sync::Arc;
use std::time::Duration;

use tilearn_ops::cuda::GpuDevice;
use tilearn_optim::AdamWConfig;
use tilearn_parallel::Communicator;
use tilearn_parallel::host::run_on_threads;
use tilearn_recsys::checkpoint::load_checkpoint;
use tilearn_recsys::cuda::{GpuCtrTrainer, GpuShardedCtrTrainer};
use tilearn_recsys::data::{CtrBatch, SyntheticCriteo};
use tilearn_recsys::shard::ShardPlan;
use tilearn_recsys::train::{LogRecord, SavePolicy, TrainOptions, train};
use tilearn_recsys::{CtrConfig, CtrModel, ModelKind, SparseOptimizer};

fn gpu_or_skip(test: &str) -> Option<GpuDevice> {
    match GpuDevice::new(0) {
        Ok(dev) => Some(dev),
        Err(e) => {
            let _ = writeln!(std::io::stderr().lock(), "skipped: {test}: {e}");
            None
        }
    }
}

/// DeepFM, 13 dense features, 26 fields of 300 rows, dim 8, hidden 32 and 16.
fn model(sparse: SparseOptimizer, seed: u64) -> CtrModel {
    let config = CtrConfig::for_fields(ModelKind::DeepFm, 13, 26, 300, 8, vec![32, 16]);
    let dense = AdamWConfig {
        lr: 3e-3,
        weight_decay: 0.0,
        ..AdamWConfig::default()
    };
    CtrModel::new(config, sparse, dense, seed).unwrap()
}

fn data() -> (Arc<CtrBatch>, CtrBatch) {
    let generator = SyntheticCriteo::criteo_shaped(5, 400);
    (
        Arc::new(generator.generate(0, 96 * 12).0),
        generator.generate(1 << 20, 500).0,
    )
}

fn options(steps: usize) -> TrainOptions {
    TrainOptions {
        steps,
        batch_size: 96,
        dense_lr: 3e-3,
        eval_every: 6,
        seed: 4,
        save: None,
        resume: None,
    }
}

/// The placements tested: every table whole on one rank, or every table cut over all ranks.
const PLACEMENTS: [(&str, usize); 2] = [("table-wise", usize::MAX), ("row-wise", 0)];

/// What a run gives: every step's loss, the log records, the trained model.
type Run = (Vec<f64>, Vec<LogRecord>, CtrModel);

/// `body` on two ranks sharing GPU 0 (host communicator, staged device buffers).
fn on_two_ranks<T: Send>(body: impl Fn(Arc<dyn Communicator>, &GpuDevice) -> T + Sync) -> Vec<T> {
    run_on_threads(2, Duration::from_secs(300), |_, comm| {
        let dev = GpuDevice::new(0).unwrap();
        comm.set_staging_stream(dev.stream().clone());
        body(Arc::new(comm), &dev)
    })
    .unwrap()
}

fn sharded(
    comm: Arc<dyn Communicator>,
    dev: &GpuDevice,
    host: CtrModel,
    row_wise_rows: usize,
) -> GpuShardedCtrTrainer {
    let plan = ShardPlan::balanced(&host.tables.layout, comm.world_size(), row_wise_rows).unwrap();
    GpuShardedCtrTrainer::new(comm.clone(), comm, dev.stream(), host, plan).unwrap()
}

fn worst(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "lengths");
    assert!(a.iter().all(|x| x.is_finite()), "non-finite value");
    (a.iter().zip(b))
        .map(|(x, y)| (x - y).abs())
        .fold(0.0f32, f32::max)
}

/// `got` against the one-rank run `want` within the bounds of the module comment.
fn assert_follows(what: &str, got: &Run, want: &Run) {
    let (losses, records, host) = got;
    let (want_losses, want_records, single) = want;
    assert_eq!(losses.len(), want_losses.len(), "{what}: steps");
    for (step, (&g, &w)) in losses.iter().zip(want_losses).enumerate() {
        let rel = ((g - w) / w).abs();
        assert!(rel <= 1e-5, "{what} step {step}: loss {g} vs {w}");
    }
    for (g, w) in records.iter().zip(want_records) {
        let (gl, wl) = (g.eval_loss.unwrap(), w.eval_loss.unwrap());
        assert!(
            ((gl - wl) / wl).abs() <= 1e-5,
            "{what}: eval loss {gl} vs {wl}"
        );
        let (ga, wa) = (g.eval_auc.unwrap(), w.eval_auc.unwrap());
        assert!((ga - wa).abs() <= 1e-4, "{what}: AUC {ga} vs {wa}");
    }
    let dw = worst(&host.tables.weights, &single.tables.weights);
    let ds1 = worst(host.sparse.state1(), single.sparse.state1());
    let ds2 = worst(host.sparse.state2(), single.sparse.state2());
    let dd = worst(&host.dense, &single.dense);
    eprintln!("{what}: max |Δ| rows {dw:e}, state {ds1:e} / {ds2:e}, dense {dd:e}");
    assert!(dw <= 1e-4 && ds1 <= 1e-4 && ds2 <= 1e-4, "{what}: tables");
    assert_eq!(host.sparse.step(), single.sparse.step(), "{what}: steps");
}

fn one_gpu_run(dev: &GpuDevice, sparse: SparseOptimizer) -> Run {
    let (data, eval) = data();
    let mut trainer = GpuCtrTrainer::new(dev.stream(), model(sparse, 8)).unwrap();
    let mut losses = Vec::new();
    let records = train(
        &mut trainer,
        data,
        &eval,
        &options(12),
        |_, l| losses.push(l),
        |_| Ok(()),
    )
    .unwrap();
    (losses, records, trainer.into_host().unwrap())
}

#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn two_gpu_ranks_follow_one_gpu() {
    let Some(dev) = gpu_or_skip("two_gpu_ranks_follow_one_gpu") else {
        return;
    };
    for sparse in [
        SparseOptimizer::row_wise_adagrad(0.05),
        SparseOptimizer::adam(2e-3),
    ] {
        let single = one_gpu_run(&dev, sparse);
        for (name, row_wise_rows) in PLACEMENTS {
            let runs = on_two_ranks(|comm, dev| {
                let (data, eval) = data();
                let mut trainer = sharded(comm, dev, model(sparse, 8), row_wise_rows);
                let mut losses = Vec::new();
                let records = train(
                    &mut trainer,
                    data,
                    &eval,
                    &options(12),
                    |_, l| losses.push(l),
                    |_| Ok(()),
                )
                .unwrap();
                (losses, records, trainer.into_host().unwrap())
            });
            for (rank, run) in runs.iter().enumerate() {
                assert_follows(&format!("{sparse:?} {name} rank {rank}"), run, &single);
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn two_gpu_ranks_resume_exactly() {
    let Some(dev) = gpu_or_skip("two_gpu_ranks_resume_exactly") else {
        return;
    };
    let sparse = SparseOptimizer::adam(2e-3);
    let dir = tempfile::tempdir().unwrap();
    for (name, row_wise_rows) in PLACEMENTS {
        let out = dir.path().join(name);
        let runs = on_two_ranks(|comm, dev| {
            let (data, eval) = data();
            let mut straight = sharded(comm.clone(), dev, model(sparse, 8), row_wise_rows);
            train(
                &mut straight,
                data.clone(),
                &eval,
                &options(12),
                |_, _| {},
                |_| Ok(()),
            )
            .unwrap();
            let straight = straight.into_host().unwrap();

            let mut first = sharded(comm.clone(), dev, model(sparse, 8), row_wise_rows);
            let mut opts = options(6);
            opts.save = Some(SavePolicy {
                output_dir: out.clone(),
                every: 6,
                keep: None,
            });
            train(
                &mut first,
                data.clone(),
                &eval,
                &opts,
                |_, _| {},
                |_| Ok(()),
            )
            .unwrap();
            comm.barrier().unwrap();
            let mut host = model(sparse, 99);
            let state = load_checkpoint(&out.join("checkpoint-6"), &mut host).unwrap();
            let mut resumed = sharded(comm, dev, host, row_wise_rows);
            let mut opts = options(12);
            opts.resume = Some(state);
            train(&mut resumed, data, &eval, &opts, |_, _| {}, |_| Ok(())).unwrap();
            (straight, resumed.into_host().unwrap())
        });
        for (rank, (straight, resumed)) in runs.iter().enumerate() {
            let what = format!("{name} rank {rank}");
            assert!(
                straight.dense == resumed.dense,
                "{what}: dense parameters differ"
            );
            assert!(
                straight.tables.weights == resumed.tables.weights,
                "{what}: tables differ"
            );
            assert_eq!(
                straight.sparse, resumed.sparse,
                "{what}: sparse state differs"
            );
            assert_eq!(
                straight.adamw.exp_avg_sq(),
                resumed.adamw.exp_avg_sq(),
                "{what}: AdamW state differs"
            );
        }
        // The 2-rank checkpoint continues on one GPU rank, within the bounds of two ranks.
        let (data, eval) = data();
        let mut host = model(sparse, 99);
        let state = load_checkpoint(&out.join("checkpoint-6"), &mut host).unwrap();
        let mut one = GpuCtrTrainer::new(dev.stream(), host).unwrap();
        let mut opts = options(12);
        opts.resume = Some(state);
        train(&mut one, data, &eval, &opts, |_, _| {}, |_| Ok(())).unwrap();
        let one = one.into_host().unwrap();
        // And on the CPU model (the same files, no GPU involved in the continuation).
        let (data, eval) = self::data();
        let mut cpu = model(sparse, 99);
        let state = load_checkpoint(&out.join("checkpoint-6"), &mut cpu).unwrap();
        let mut opts = options(12);
        opts.resume = Some(state);
        train(&mut cpu, data, &eval, &opts, |_, _| {}, |_| Ok(())).unwrap();
        let (two, _) = &runs[0];
        for (device, continued) in [("1 GPU", &one), ("the CPU", &cpu)] {
            let dw = worst(&continued.tables.weights, &two.tables.weights);
            eprintln!("{name}: 2-rank checkpoint continued on {device}: max |Δ| rows {dw:e}");
            assert!(dw <= 1e-4, "{name}: {device} from the 2-rank checkpoint");
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU and libnccl (run with --include-ignored)"]
fn nccl_one_rank_sharded_equals_one_gpu() {
    let Some(dev) = gpu_or_skip("nccl_one_rank_sharded_equals_one_gpu") else {
        return;
    };
    let single_env = tilearn_parallel::RankEnv::single();
    let group = match tilearn_parallel::ProcessGroup::init(single_env, Default::default()) {
        Ok(g) => g,
        Err(e) => {
            eprintln!("skipped: nccl_one_rank_sharded_equals_one_gpu: {e}");
            return;
        }
    };
    let nccl = match tilearn_parallel::nccl::NcclCommunicator::new(&group, dev.stream().context()) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("skipped: nccl_one_rank_sharded_equals_one_gpu: {e}");
            return;
        }
    };
    let host: Arc<dyn Communicator> = Arc::new(group.host_communicator().unwrap());
    let sparse = SparseOptimizer::row_wise_adagrad(0.05);
    let single = one_gpu_run(&dev, sparse);
    let (data, eval) = data();
    let host_model = model(sparse, 8);
    let plan = ShardPlan::balanced(&host_model.tables.layout, 1, 0).unwrap();
    let mut trainer =
        GpuShardedCtrTrainer::new(host, Arc::new(nccl), dev.stream(), host_model, plan).unwrap();
    let mut losses = Vec::new();
    let records = train(
        &mut trainer,
        data,
        &eval,
        &options(12),
        |_, l| losses.push(l),
        |_| Ok(()),
    )
    .unwrap();
    let host = trainer.into_host().unwrap();
    // The loss sum crosses the host all-reduce as three f32 parts, exact for one rank.
    assert_eq!(losses, single.0, "losses");
    for (g, w) in records.iter().zip(&single.1) {
        assert_eq!(g.eval_auc, w.eval_auc, "AUC");
    }
    assert!(host.tables.weights == single.2.tables.weights, "tables");
    assert!(host.dense == single.2.dense, "dense");
    assert_eq!(host.sparse, single.2.sparse, "sparse state");
}
