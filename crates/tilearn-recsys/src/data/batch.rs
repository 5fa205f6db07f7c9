//! A batch of CTR samples as the models take it: labels, transformed dense features and raw
//! categorical values (a model's config turns them into jagged ids: `CtrConfig::jagged`).

/// The raw value of an empty categorical field (Criteo's values are 32-bit, so no real value
/// collides with it).
pub const MISSING: u64 = u64::MAX;

/// Samples in column blocks: `labels[b]`, `dense[b * num_dense + i]`, `cats[b * num_fields + f]`
/// (raw values, [`MISSING`] for an empty field).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct CtrBatch {
    pub num_dense: usize,
    pub num_fields: usize,
    pub labels: Vec<f32>,
    pub dense: Vec<f32>,
    pub cats: Vec<u64>,
}

/// Criteo's integer features enter the models as `ln(1 + x)` for `x > 0` and 0 otherwise (empty
/// or negative), the usual transform that tames their heavy tails.
pub fn transform_dense(x: Option<i64>) -> f32 {
    match x {
        Some(v) if v > 0 => (v as f64).ln_1p() as f32,
        _ => 0.0,
    }
}

impl CtrBatch {
    pub fn new(num_dense: usize, num_fields: usize) -> Self {
        CtrBatch {
            num_dense,
            num_fields,
            ..Default::default()
        }
    }

    pub fn len(&self) -> usize {
        self.labels.len()
    }

    pub fn is_empty(&self) -> bool {
        self.labels.is_empty()
    }

    /// Samples `range` of this batch as a new batch.
    pub fn slice(&self, range: std::ops::Range<usize>) -> CtrBatch {
        CtrBatch {
            num_dense: self.num_dense,
            num_fields: self.num_fields,
            labels: self.labels[range.clone()].to_vec(),
            dense: self.dense[range.start * self.num_dense..range.end * self.num_dense].to_vec(),
            cats: self.cats[range.start * self.num_fields..range.end * self.num_fields].to_vec(),
        }
    }

    /// Appends every sample of `other` (same widths).
    pub fn extend(&mut self, other: &CtrBatch) {
        debug_assert_eq!(
            (self.num_dense, self.num_fields),
            (other.num_dense, other.num_fields)
        );
        self.labels.extend_from_slice(&other.labels);
        self.dense.extend_from_slice(&other.dense);
        self.cats.extend_from_slice(&other.cats);
    }
}
