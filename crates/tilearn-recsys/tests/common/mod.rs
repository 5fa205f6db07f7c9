//! Random inputs of the embedding-bag tests (CPU and GPU): odd table sizes and dims, empty
//! bags, repeated ids, zipf-skewed ids.

#![allow(dead_code)]

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use tilearn_recsys::{JaggedBatch, Pooling, TableLayout, TableSpec, Zipf};

/// Tables with odd shapes: dims 1, 3, 4, 5, 8, 17, 32 and 64 (vector and scalar paths), small
/// row counts (many repeats) and one bigger table, sum and mean pooling.
pub fn odd_layout() -> TableLayout {
    let shapes = [
        (7, 1, Pooling::Sum),
        (13, 3, Pooling::Mean),
        (5, 4, Pooling::Sum),
        (101, 5, Pooling::Mean),
        (1, 8, Pooling::Sum),
        (257, 17, Pooling::Mean),
        (64, 32, Pooling::Sum),
        (1000, 64, Pooling::Mean),
    ];
    TableLayout::new(
        shapes
            .iter()
            .map(|&(rows, dim, pooling)| TableSpec { rows, dim, pooling })
            .collect(),
    )
    .unwrap()
}

/// A batch with bags of 0..=max_bag ids (about a fifth empty), ids zipf-skewed with exponent
/// `skew` (so hot rows repeat within and across bags).
pub fn random_batch(
    layout: &TableLayout,
    batch: usize,
    max_bag: usize,
    skew: f64,
    seed: u64,
) -> JaggedBatch {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut offsets = vec![0u32];
    let mut ids = Vec::new();
    for spec in layout.specs() {
        let zipf = Zipf::new(spec.rows, skew);
        for _ in 0..batch {
            let len = if rng.random_bool(0.2) {
                0
            } else {
                rng.random_range(1..=max_bag)
            };
            for _ in 0..len {
                ids.push(zipf.sample(&mut rng) as u32);
            }
            offsets.push(ids.len() as u32);
        }
    }
    JaggedBatch::new(layout, batch, offsets, ids).unwrap()
}

/// `n` values uniform in [-1, 1).
pub fn random_values(n: usize, seed: u64) -> Vec<f32> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    (0..n).map(|_| rng.random_range(-1.0..1.0)).collect()
}

/// Runs of a row's entries that cross every chunk boundary of the backward's summation order
/// (chunks of 32 entries): in every table, rows 0..7 occur 1, 31, 32, 33, 64, 65 and 97 times.
pub const BOUNDARY_RUNS: [usize; 7] = [1, 31, 32, 33, 64, 65, 97];
/// The bags of [`boundary_batch`] per table (sum(BOUNDARY_RUNS) = 323 ids in bags of 2 or 3).
pub const BOUNDARY_BAGS: usize = 120;

/// Tables for [`boundary_batch`]: float4 and scalar rows, dims on both sides of the widths up
/// to which row-wise Adagrad holds a row's gradient in registers (512 float4, 128 scalar).
pub fn boundary_layout() -> TableLayout {
    let shapes = [
        (8, 128, Pooling::Sum),
        (7, 3, Pooling::Mean),
        (9, 20, Pooling::Mean),
        (7, 1, Pooling::Sum),
        (8, 600, Pooling::Sum),
        (7, 130, Pooling::Mean),
    ];
    TableLayout::new(
        shapes
            .iter()
            .map(|&(rows, dim, pooling)| TableSpec { rows, dim, pooling })
            .collect(),
    )
    .unwrap()
}

/// Narrow tables for [`boundary_batch`] (widest 16): the GPU update then serves 8 rows per warp
/// with groups of 4 lanes, float4 and scalar.
pub fn narrow_boundary_layout() -> TableLayout {
    let shapes = [
        (8, 16, Pooling::Mean),
        (7, 4, Pooling::Sum),
        (9, 3, Pooling::Mean),
        (7, 1, Pooling::Sum),
        (8, 13, Pooling::Sum),
    ];
    TableLayout::new(
        shapes
            .iter()
            .map(|&(rows, dim, pooling)| TableSpec { rows, dim, pooling })
            .collect(),
    )
    .unwrap()
}

/// Every table's ids: row r repeated BOUNDARY_RUNS[r] times, shuffled (seeded), cut into
/// BOUNDARY_BAGS bags of 2 or 3 ids.
pub fn boundary_batch(layout: &TableLayout, seed: u64) -> JaggedBatch {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let total: usize = BOUNDARY_RUNS.iter().sum();
    let mut offsets = vec![0u32];
    let mut ids = Vec::new();
    for _ in layout.specs() {
        let mut table: Vec<u32> = BOUNDARY_RUNS
            .iter()
            .enumerate()
            .flat_map(|(row, &n)| std::iter::repeat_n(row as u32, n))
            .collect();
        // Fisher-Yates, so the runs' entries interleave across bags.
        for i in (1..table.len()).rev() {
            table.swap(i, rng.random_range(0..=i));
        }
        let start = ids.len();
        ids.extend(table);
        for b in 1..=BOUNDARY_BAGS {
            offsets.push((start + b * total / BOUNDARY_BAGS) as u32);
        }
    }
    JaggedBatch::new(layout, BOUNDARY_BAGS, offsets, ids).unwrap()
}
