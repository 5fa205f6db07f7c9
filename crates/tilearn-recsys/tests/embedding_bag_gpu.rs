//! The CUDA embedding bag against the CPU reference, on the random inputs of the CPU tests (odd
//! dims on the scalar and float4 paths, empty bags, repeated and zipf-skewed ids), over several
//! optimizer steps, and on runs that cross every chunk boundary of the backward's summation
//! order (rows repeated 1, 31, 32, 33, 64, 65 and 97 times; wide tables, one row per warp, and
//! narrow ones, several rows per warp). Tolerances: the forward is checked
//! to 1e-6 relative; SGD and SparseAdam must be bit-identical (same f32 operations in the same
//! chunked order, no FMA contraction); row-wise Adagrad sums its squares in a warp tree instead
//! of the CPU's serial order, checked to 1e-5 relative. A second GPU run must reproduce the
//! first bit for bit.
//!
//! The device row cache (tables in host memory, hot rows on the GPU) must give the uncached
//! GPU operator's outputs, weights and optimizer state bit for bit.
//!
//! Without a GPU or driver each test prints `skipped: <reason>` to stderr and passes.
#![cfg(feature = "cuda")]

mod common;

use std::io::Write;

use common::{
    boundary_batch, boundary_layout, narrow_boundary_layout, odd_layout, random_batch,
    random_values,
};
use tilearn_ops::cuda::GpuDevice;
use tilearn_recsys::cuda::{DeviceCachedEmbeddingBag, DeviceEmbeddingBag, DeviceJaggedBatch};
use tilearn_recsys::{
    EmbeddingTables, JaggedBatch, SparseOptimizer, SparseState, TableLayout,
    embedding_bag_backward_update, embedding_bag_forward,
};

fn gpu_or_skip(test: &str) -> Option<GpuDevice> {
    match GpuDevice::new(0) {
        Ok(dev) => Some(dev),
        Err(e) => {
            let _ = writeln!(std::io::stderr().lock(), "skipped: {test}: {e}");
            None
        }
    }
}

/// Within `rel` relative to magnitude; `rel == 0` asks for the same bits.
fn close(what: &str, got: &[f32], want: &[f32], rel: f32) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        assert!(
            if rel == 0.0 {
                g.to_bits() == w.to_bits()
            } else {
                (g - w).abs() <= rel * (1.0 + w.abs())
            },
            "{what}[{i}]: gpu {g}, cpu {w}"
        );
    }
}

#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn forward_matches_the_cpu_reference() {
    let Some(dev) = gpu_or_skip("forward_matches_the_cpu_reference") else {
        return;
    };
    let stream = dev.stream();
    let layout = odd_layout();
    let tables = EmbeddingTables::new(layout.clone(), 7);
    let state = SparseState::new(SparseOptimizer::Sgd { lr: 0.1 }, &layout).unwrap();
    let device = DeviceEmbeddingBag::new(stream, &tables, &state).unwrap();
    for (batch_size, skew, seed) in [(1, 0.0, 1), (333, 1.1, 2), (2048, 1.3, 3)] {
        let batch = random_batch(&layout, batch_size, 9, skew, seed);
        let mut want = vec![0.0; batch_size * layout.total_dim()];
        embedding_bag_forward(&tables, &batch, &mut want).unwrap();
        let dbatch = DeviceJaggedBatch::upload(stream, &layout, &batch).unwrap();
        // Poisoned, so an output the kernel forgets to write fails.
        let mut out = stream.clone_htod(&vec![f32::NAN; want.len()]).unwrap();
        device.forward(stream, &dbatch, &mut out).unwrap();
        let got = stream.clone_dtoh(&out).unwrap();
        close(&format!("forward, batch {batch_size}"), &got, &want, 1e-6);
    }
}

/// Step `step`'s batch (uniform ids on even steps, zipf-skewed on odd) and pooled gradient.
fn step_inputs(layout: &TableLayout, step: u64) -> (JaggedBatch, Vec<f32>) {
    let skew = if step.is_multiple_of(2) { 0.0 } else { 1.2 };
    let batch = random_batch(layout, 500, 7, skew, 300 + step);
    (batch, random_values(500 * layout.total_dim(), 400 + step))
}

/// Step `step`'s batch of runs crossing every chunk boundary, and its pooled gradient.
fn boundary_inputs(layout: &TableLayout, step: u64) -> (JaggedBatch, Vec<f32>) {
    let batch = boundary_batch(layout, 600 + step);
    let dout = random_values(batch.batch() * layout.total_dim(), 700 + step);
    (batch, dout)
}

type Inputs = fn(&TableLayout, u64) -> (JaggedBatch, Vec<f32>);

/// Four steps of `opt` on the GPU and on the CPU from the same tables: weights and state
/// within `rel` (0: bit for bit), and a second GPU run bit-identical to the first.
fn check_backward(test: &str, opt: SparseOptimizer, rel: f32, layout: TableLayout, inputs: Inputs) {
    let Some(dev) = gpu_or_skip(test) else {
        return;
    };
    let stream = dev.stream();
    let run_gpu = || {
        let tables = EmbeddingTables::new(layout.clone(), 8);
        let state = SparseState::new(opt, &layout).unwrap();
        let mut device = DeviceEmbeddingBag::new(stream, &tables, &state).unwrap();
        for step in 0..4u64 {
            let (batch, dout) = inputs(&layout, step);
            let dbatch = DeviceJaggedBatch::upload(stream, &layout, &batch).unwrap();
            let ddout = stream.clone_htod(&dout).unwrap();
            device.backward_update(stream, &dbatch, &ddout).unwrap();
        }
        device.download(stream).unwrap()
    };
    let mut tables = EmbeddingTables::new(layout.clone(), 8);
    let mut state = SparseState::new(opt, &layout).unwrap();
    for step in 0..4u64 {
        let (batch, dout) = inputs(&layout, step);
        embedding_bag_backward_update(&mut tables, &batch, &dout, &mut state).unwrap();
    }
    let (weights, state1, state2) = run_gpu();
    close(&format!("{opt:?} weights"), &weights, &tables.weights, rel);
    close(&format!("{opt:?} state1"), &state1, state.state1(), rel);
    close(&format!("{opt:?} state2"), &state2, state.state2(), rel);
    let again = run_gpu();
    assert!(
        weights
            .iter()
            .zip(&again.0)
            .all(|(a, b)| a.to_bits() == b.to_bits())
            && state1
                .iter()
                .zip(&again.1)
                .all(|(a, b)| a.to_bits() == b.to_bits()),
        "{opt:?}: a rerun on the GPU is not bit-identical"
    );
}

#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn sgd_backward_update_matches_the_cpu_reference() {
    let test = "sgd_backward_update_matches_the_cpu_reference";
    let opt = SparseOptimizer::Sgd { lr: 0.05 };
    check_backward(test, opt, 0.0, odd_layout(), step_inputs);
    check_backward(test, opt, 0.0, boundary_layout(), boundary_inputs);
    check_backward(test, opt, 0.0, narrow_boundary_layout(), boundary_inputs);
}

#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn row_wise_adagrad_backward_update_matches_the_cpu_reference() {
    let test = "row_wise_adagrad_backward_update_matches_the_cpu_reference";
    let opt = SparseOptimizer::row_wise_adagrad(0.05);
    check_backward(test, opt, 1e-5, odd_layout(), step_inputs);
    check_backward(test, opt, 1e-5, boundary_layout(), boundary_inputs);
    check_backward(test, opt, 1e-5, narrow_boundary_layout(), boundary_inputs);
}

#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn sparse_adam_backward_update_matches_the_cpu_reference() {
    let test = "sparse_adam_backward_update_matches_the_cpu_reference";
    let opt = SparseOptimizer::adam(0.01);
    check_backward(test, opt, 0.0, odd_layout(), step_inputs);
    check_backward(test, opt, 0.0, boundary_layout(), boundary_inputs);
    check_backward(test, opt, 0.0, narrow_boundary_layout(), boundary_inputs);
}

#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn a_batch_checked_for_other_tables_is_refused() {
    let Some(dev) = gpu_or_skip("a_batch_checked_for_other_tables_is_refused") else {
        return;
    };
    let stream = dev.stream();
    let layout = odd_layout();
    let other = tilearn_recsys::TableLayout::new(layout.specs()[..7].to_vec()).unwrap();
    let tables = EmbeddingTables::new(layout.clone(), 1);
    let state = SparseState::new(SparseOptimizer::Sgd { lr: 0.1 }, &layout).unwrap();
    let device = DeviceEmbeddingBag::new(stream, &tables, &state).unwrap();
    let batch = random_batch(&other, 4, 3, 0.0, 1);
    let dbatch = DeviceJaggedBatch::upload(stream, &other, &batch).unwrap();
    let mut out = stream.alloc_zeros::<f32>(4 * layout.total_dim()).unwrap();
    assert!(device.forward(stream, &dbatch, &mut out).is_err());
}

#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn device_row_cache_equals_the_uncached_operator() {
    let Some(dev) = gpu_or_skip("device_row_cache_equals_the_uncached_operator") else {
        return;
    };
    let stream = dev.stream();
    let layout = odd_layout();
    let width = layout.total_dim();
    for opt in [
        SparseOptimizer::row_wise_adagrad(0.1),
        SparseOptimizer::adam(0.01),
    ] {
        let tables = EmbeddingTables::new(layout.clone(), 4);
        let state = SparseState::new(opt, &layout).unwrap();
        let mut full = DeviceEmbeddingBag::new(stream, &tables, &state).unwrap();
        // A third of each table, at least one batch's rows (24 bags of <= 3 ids).
        let slots: Vec<usize> = (layout.specs().iter())
            .map(|s| s.rows.min((s.rows / 3).max(72)))
            .collect();
        let mut cached = DeviceCachedEmbeddingBag::new(stream, tables, state, &slots).unwrap();
        for step in 0..30u64 {
            let batch = random_batch(&layout, 24, 3, 1.1, 500 + step);
            let dout = stream
                .clone_htod(&random_values(24 * width, 600 + step))
                .unwrap();
            let dfull = DeviceJaggedBatch::upload(stream, &layout, &batch).unwrap();
            let mut want = stream.alloc_zeros::<f32>(24 * width).unwrap();
            full.forward(stream, &dfull, &mut want).unwrap();
            full.backward_update(stream, &dfull, &dout).unwrap();
            let dslots = cached.map_batch(stream, &batch, true).unwrap();
            let mut got = stream.clone_htod(&vec![f32::NAN; 24 * width]).unwrap();
            cached.forward(stream, &dslots, &mut got).unwrap();
            cached.backward_update(stream, &dslots, &dout).unwrap();
            let (got, want) = (
                stream.clone_dtoh(&got).unwrap(),
                stream.clone_dtoh(&want).unwrap(),
            );
            assert!(
                got == want,
                "{opt:?} step {step}: forward through the cache differs"
            );
        }
        let report = cached.report().unwrap();
        let stats = report.stats;
        let (weights, state1, state2) = full.download(stream).unwrap();
        let (cached_weights, cached1, cached2) = cached.download(stream).unwrap();
        eprintln!("{opt:?}: {report:?}");
        assert!(stats.evictions > 0 && stats.write_backs > 0, "{stats:?}");
        assert!(
            report.bytes_to_device > 0 && report.copy_seconds > 0.0,
            "{report:?}"
        );
        assert!(cached_weights == weights, "{opt:?}: weights differ");
        assert!(cached1 == state1, "{opt:?}: state1 differs");
        assert!(cached2 == state2, "{opt:?}: state2 differs");
        assert_eq!(cached.step(), full.step());
    }
}
