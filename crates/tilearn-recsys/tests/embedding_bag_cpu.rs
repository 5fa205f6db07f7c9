//! The CPU embedding bag against a naive dense reference in f64: the pooled forward, and the
//! fused backward + update against "materialise the dense gradient, then apply the optimizer's
//! dense rule to the touched rows" (the definition of a lazy sparse optimizer), over several
//! steps so the lazy state is exercised, on odd sizes, empty bags, repeated and skewed ids.

mod common;

use common::{boundary_batch, boundary_layout, odd_layout, random_batch, random_values};
use tilearn_recsys::{
    EmbeddingTables, JaggedBatch, Pooling, RecsysError, SparseOptimizer, SparseState, TableLayout,
    TableSpec, embedding_bag_backward_update, embedding_bag_forward,
};

/// Relative-to-magnitude tolerance between the f32 operator and the f64 reference.
const TOL: f64 = 2e-5;

fn close(what: &str, got: &[f32], want: &[f64]) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g as f64 - w).abs() <= TOL * (1.0 + w.abs()),
            "{what}[{i}]: got {g}, want {w}"
        );
    }
}

/// Naive forward: every bag, every id, in f64.
fn dense_forward(layout: &TableLayout, weights: &[f32], batch: &JaggedBatch) -> Vec<f64> {
    let width = layout.total_dim();
    let mut out = vec![0.0f64; batch.batch() * width];
    for (t, spec) in layout.specs().iter().enumerate() {
        for b in 0..batch.batch() {
            let bag = batch.bag(t, b);
            let n = bag.len();
            for &id in &batch.ids()[bag] {
                for (c, &w) in weights[layout.row_range(t, id as usize)].iter().enumerate() {
                    let scale = match spec.pooling {
                        Pooling::Sum => 1.0,
                        Pooling::Mean => 1.0 / n as f64,
                    };
                    out[b * width + layout.col_offset()[t] + c] += w as f64 * scale;
                }
            }
        }
    }
    out
}

/// The dense reference optimizer: f64 weights and state, dense gradient, dense rule applied to
/// the rows whose gradient exists.
struct DenseReference {
    weights: Vec<f64>,
    state1: Vec<f64>,
    state2: Vec<f64>,
    step: i32,
}

impl DenseReference {
    fn new(tables: &EmbeddingTables) -> Self {
        let n = tables.weights.len();
        DenseReference {
            weights: tables.weights.iter().map(|&w| w as f64).collect(),
            state1: vec![0.0; n],
            state2: vec![0.0; n],
            step: 0,
        }
    }

    fn step(
        &mut self,
        layout: &TableLayout,
        batch: &JaggedBatch,
        dout: &[f32],
        opt: SparseOptimizer,
    ) {
        self.step += 1;
        let width = layout.total_dim();
        let mut grad = vec![0.0f64; self.weights.len()];
        let mut touched = vec![false; layout.total_rows()];
        for (t, spec) in layout.specs().iter().enumerate() {
            for b in 0..batch.batch() {
                let bag = batch.bag(t, b);
                let n = bag.len();
                for &id in &batch.ids()[bag] {
                    touched[layout.row_base()[t] + id as usize] = true;
                    for (c, e) in layout.row_range(t, id as usize).enumerate() {
                        let scale = match spec.pooling {
                            Pooling::Sum => 1.0,
                            Pooling::Mean => 1.0 / n as f64,
                        };
                        grad[e] += dout[b * width + layout.col_offset()[t] + c] as f64 * scale;
                    }
                }
            }
        }
        for (t, spec) in layout.specs().iter().enumerate() {
            for row in 0..spec.rows {
                let stacked = layout.row_base()[t] + row;
                if !touched[stacked] {
                    continue;
                }
                let r = layout.row_range(t, row);
                match opt {
                    SparseOptimizer::Sgd { lr } => {
                        for e in r {
                            self.weights[e] -= lr as f64 * grad[e];
                        }
                    }
                    SparseOptimizer::RowWiseAdagrad { lr, eps, .. } => {
                        let mean_sq =
                            r.clone().map(|e| grad[e] * grad[e]).sum::<f64>() / spec.dim as f64;
                        self.state1[stacked] += mean_sq;
                        for e in r {
                            self.weights[e] -=
                                lr as f64 * grad[e] / (self.state1[stacked].sqrt() + eps as f64);
                        }
                    }
                    SparseOptimizer::Adam {
                        lr,
                        beta1,
                        beta2,
                        eps,
                    } => {
                        let (b1, b2) = (beta1 as f64, beta2 as f64);
                        let step_size = lr as f64 * (1.0 - b2.powi(self.step)).sqrt()
                            / (1.0 - b1.powi(self.step));
                        for e in r {
                            self.state1[e] = b1 * self.state1[e] + (1.0 - b1) * grad[e];
                            self.state2[e] = b2 * self.state2[e] + (1.0 - b2) * grad[e] * grad[e];
                            self.weights[e] -=
                                step_size * self.state1[e] / (self.state2[e].sqrt() + eps as f64);
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn forward_matches_the_dense_reference() {
    let layout = odd_layout();
    let tables = EmbeddingTables::new(layout.clone(), 1);
    for (seed, skew) in [(10, 0.0), (11, 1.1)] {
        let batch = random_batch(&layout, 37, 6, skew, seed);
        let mut out = vec![f32::NAN; 37 * layout.total_dim()];
        embedding_bag_forward(&tables, &batch, &mut out).unwrap();
        close(
            "forward",
            &out,
            &dense_forward(&layout, &tables.weights, &batch),
        );
    }
}

fn check_optimizer(opt: SparseOptimizer) {
    let layout = odd_layout();
    let mut tables = EmbeddingTables::new(layout.clone(), 2);
    let mut state = SparseState::new(opt, &layout).unwrap();
    let mut reference = DenseReference::new(&tables);
    for step in 0..4u64 {
        // Alternate uniform and zipf-skewed ids: skewed batches repeat hot rows many times.
        let skew = if step % 2 == 0 { 0.0 } else { 1.2 };
        let batch = random_batch(&layout, 29, 5, skew, 100 + step);
        let dout = random_values(29 * layout.total_dim(), 200 + step);
        let unique = embedding_bag_backward_update(&mut tables, &batch, &dout, &mut state).unwrap();
        reference.step(&layout, &batch, &dout, opt);
        assert!(unique > 0 && unique <= batch.ids().len());
        close(
            &format!("{opt:?} weights after step {step}"),
            &tables.weights,
            &reference.weights,
        );
    }
    match opt {
        SparseOptimizer::Sgd { .. } => assert!(state.state1().is_empty()),
        SparseOptimizer::RowWiseAdagrad { .. } => close(
            "accumulators",
            state.state1(),
            &reference.state1[..layout.total_rows()],
        ),
        SparseOptimizer::Adam { .. } => {
            close("first moments", state.state1(), &reference.state1);
            close("second moments", state.state2(), &reference.state2);
        }
    }
}

#[test]
fn sgd_matches_the_dense_rule_on_touched_rows() {
    check_optimizer(SparseOptimizer::Sgd { lr: 0.05 });
}

#[test]
fn row_wise_adagrad_matches_the_dense_rule_on_touched_rows() {
    check_optimizer(SparseOptimizer::row_wise_adagrad(0.05));
}

#[test]
fn sparse_adam_matches_the_dense_rule_on_touched_rows() {
    check_optimizer(SparseOptimizer::adam(0.01));
}

#[test]
fn untouched_rows_and_their_state_never_change() {
    let layout = TableLayout::new(vec![TableSpec {
        rows: 10,
        dim: 4,
        pooling: Pooling::Sum,
    }])
    .unwrap();
    let mut tables = EmbeddingTables::new(layout.clone(), 3);
    let before = tables.clone();
    let mut state = SparseState::new(SparseOptimizer::adam(0.1), &layout).unwrap();
    // Rows 2 and 7 only, row 7 twice in one bag.
    let batch = JaggedBatch::new(&layout, 2, vec![0, 1, 3], vec![2, 7, 7]).unwrap();
    let dout = vec![1.0; 2 * 4];
    assert_eq!(
        embedding_bag_backward_update(&mut tables, &batch, &dout, &mut state).unwrap(),
        2
    );
    for row in 0..10 {
        let changed = tables.row(0, row) != before.row(0, row);
        assert_eq!(changed, row == 2 || row == 7, "row {row}");
        let moments = &state.state1()[row * 4..row * 4 + 4];
        assert_eq!(
            moments.iter().any(|&m| m != 0.0),
            row == 2 || row == 7,
            "moments of row {row}"
        );
    }
}

/// The CUDA kernel sums a row's gradient in chunks of 32 entries (in parallel for hot rows) and
/// the reference must use its order for SGD and SparseAdam to match bit for bit: 0 plus the
/// chunk sums in chunk order, each chunk summed from 0 in entry order. SGD with lr 1 from zero
/// weights exposes the gradient exactly; the serial order must differ somewhere on these inputs,
/// or the test could not tell the orders apart.
#[test]
fn the_gradient_is_summed_in_chunks_of_32_entries() {
    let layout = boundary_layout();
    let zeros = vec![0.0f32; layout.total_elements()];
    let mut tables = EmbeddingTables::from_weights(layout.clone(), zeros).unwrap();
    let mut state = SparseState::new(SparseOptimizer::Sgd { lr: 1.0 }, &layout).unwrap();
    let batch = boundary_batch(&layout, 5);
    let width = layout.total_dim();
    let dout = random_values(batch.batch() * width, 6);
    embedding_bag_backward_update(&mut tables, &batch, &dout, &mut state).unwrap();
    let mut serial_differs = false;
    for (t, spec) in layout.specs().iter().enumerate() {
        let col = layout.col_offset()[t];
        for row in 0..common::BOUNDARY_RUNS.len() {
            // The row's contributions in entry order: (sample, pooling scale).
            let mut run = Vec::new();
            for b in 0..batch.batch() {
                let bag = batch.bag(t, b);
                let scale = spec.pooling.scale(bag.len());
                for &id in &batch.ids()[bag] {
                    if id as usize == row {
                        run.push((b, scale));
                    }
                }
            }
            assert_eq!(run.len(), common::BOUNDARY_RUNS[row]);
            for c in 0..spec.dim {
                let term = |&(b, scale): &(usize, f32)| dout[b * width + col + c] * scale;
                let mut chunked = 0.0f32;
                for chunk in run.chunks(32) {
                    chunked += chunk.iter().map(term).fold(0.0f32, |a, x| a + x);
                }
                let serial = run.iter().map(term).fold(0.0f32, |a, x| a + x);
                serial_differs |= serial.to_bits() != chunked.to_bits();
                let want = 0.0f32 + -chunked;
                let got = tables.row(t, row)[c];
                assert_eq!(
                    got.to_bits(),
                    want.to_bits(),
                    "table {t} row {row} column {c}: got {got}, want {want} (chunked order)"
                );
            }
        }
    }
    assert!(serial_differs, "the inputs do not tell the orders apart");
}

#[test]
fn reruns_are_bit_identical() {
    let layout = odd_layout();
    let run = || {
        let mut tables = EmbeddingTables::new(layout.clone(), 4);
        let mut state = SparseState::new(SparseOptimizer::row_wise_adagrad(0.1), &layout).unwrap();
        for step in 0..3 {
            let batch = random_batch(&layout, 41, 7, 1.3, step);
            let dout = random_values(41 * layout.total_dim(), 50 + step);
            embedding_bag_backward_update(&mut tables, &batch, &dout, &mut state).unwrap();
        }
        (tables.weights, state.state1().to_vec())
    };
    let (a, b) = (run(), run());
    assert!(
        a.0.iter()
            .zip(&b.0)
            .all(|(x, y)| x.to_bits() == y.to_bits())
    );
    assert!(
        a.1.iter()
            .zip(&b.1)
            .all(|(x, y)| x.to_bits() == y.to_bits())
    );
}

#[test]
fn raw_values_are_hashed_into_each_table() {
    let layout = TableLayout::new(vec![
        TableSpec {
            rows: 3,
            dim: 2,
            pooling: Pooling::Sum,
        },
        TableSpec {
            rows: 1000,
            dim: 2,
            pooling: Pooling::Sum,
        },
    ])
    .unwrap();
    let raw = [u64::MAX, 0x68fd_1e64, 12, 0x68fd_1e64];
    let batch = JaggedBatch::from_raw(&layout, 2, vec![0, 1, 2, 3, 4], &raw).unwrap();
    assert!(batch.ids()[..2].iter().all(|&id| id < 3));
    assert!(batch.ids()[2..].iter().all(|&id| id < 1000));
    // The same value always lands on the same row of a table.
    let again = JaggedBatch::from_raw(&layout, 2, vec![0, 1, 2, 3, 4], &raw).unwrap();
    assert_eq!(batch, again);
}

#[test]
fn bad_batches_are_refused_with_the_reason() {
    let layout = TableLayout::new(vec![TableSpec {
        rows: 4,
        dim: 2,
        pooling: Pooling::Mean,
    }])
    .unwrap();
    let err = |r: Result<JaggedBatch, RecsysError>| r.unwrap_err().to_string();
    assert!(err(JaggedBatch::new(&layout, 2, vec![0, 1], vec![0])).contains("expected 3"));
    assert!(err(JaggedBatch::new(&layout, 2, vec![0, 2, 1], vec![0, 1])).contains("decrease"));
    assert!(err(JaggedBatch::new(&layout, 2, vec![0, 1, 3], vec![0, 1])).contains("last offset"));
    assert!(
        err(JaggedBatch::new(&layout, 2, vec![0, 1, 2], vec![0, 4]))
            .contains("row id 4 at entry 1")
    );
    let batch = JaggedBatch::new(&layout, 2, vec![0, 1, 2], vec![0, 3]).unwrap();
    let tables = EmbeddingTables::new(layout.clone(), 0);
    let mut short = vec![0.0; 3];
    assert!(
        embedding_bag_forward(&tables, &batch, &mut short)
            .unwrap_err()
            .to_string()
            .contains("needs 4")
    );
    assert!(
        TableLayout::new(vec![TableSpec {
            rows: 0,
            dim: 2,
            pooling: Pooling::Sum
        }])
        .is_err()
    );
    assert!(SparseState::new(SparseOptimizer::Sgd { lr: f32::NAN }, &layout).is_err());
}
