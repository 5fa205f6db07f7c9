//! The tables of one fused embedding-bag operator: their shapes, pooling modes and weights, all
//! in one flat f32 buffer (as FBGEMM's table-batched embeddings keep them), so one launch and one
//! optimizer state cover every table.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

use crate::error::{RecsysError, Result};

/// How a bag's rows are combined into its output.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Pooling {
    /// The sum of the bag's rows (an empty bag gives zeros).
    Sum,
    /// The sum times `1 / len` (an empty bag gives zeros), as `nn.EmbeddingBag(mode="mean")`.
    Mean,
}

impl Pooling {
    /// The factor each row of a bag of `len` rows is multiplied by, in forward and backward:
    /// 1 for sum, `1 / len` (rounded to f32 once) for mean.
    pub fn scale(self, len: usize) -> f32 {
        match self {
            Pooling::Sum => 1.0,
            Pooling::Mean if len == 0 => 0.0,
            Pooling::Mean => 1.0 / len as f32,
        }
    }

    /// The code of the CUDA launchers (`TILEARN_POOLING_SUM` / `_MEAN`).
    pub fn code(self) -> u8 {
        match self {
            Pooling::Sum => 0,
            Pooling::Mean => 1,
        }
    }
}

/// One table: `rows` rows of `dim` f32, pooled by `pooling`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct TableSpec {
    pub rows: usize,
    pub dim: usize,
    pub pooling: Pooling,
}

/// Where each table lives in the flat buffers and the pooled output, computed once from the
/// specs and checked against the kernels' index ranges.
#[derive(Debug, Clone, PartialEq)]
pub struct TableLayout {
    specs: Vec<TableSpec>,
    /// First row of table t in the stacked row space (`row_base[T]` = all rows).
    row_base: Vec<usize>,
    /// First element of table t in the flat weights (`row_base[t]` rows of the earlier dims).
    weight_offset: Vec<usize>,
    /// First column of table t in a pooled output row (`col_offset[T]` = its width).
    col_offset: Vec<usize>,
}

impl TableLayout {
    /// Checks the specs: at least one table, every table with 1..=2^32 rows and dim >= 1, and
    /// all rows together below 2^32 (the kernels sort u32 stacked-row keys).
    pub fn new(specs: Vec<TableSpec>) -> Result<Self> {
        if specs.is_empty() {
            return Err(RecsysError::invalid(
                "tables",
                "at least one table is needed",
            ));
        }
        let mut row_base = vec![0usize];
        let mut weight_offset = vec![0usize];
        let mut col_offset = vec![0usize];
        for (t, spec) in specs.iter().enumerate() {
            if spec.rows == 0 || spec.dim == 0 {
                return Err(RecsysError::invalid(
                    "tables",
                    format!(
                        "table {t} has {} rows of dim {}; both must be >= 1",
                        spec.rows, spec.dim
                    ),
                ));
            }
            let rows = row_base[t] + spec.rows;
            if rows as u64 >= u32::MAX as u64 {
                return Err(RecsysError::invalid(
                    "tables",
                    format!(
                        "{rows} rows over tables 0..={t}; all tables together must stay below 2^32 - 1 rows"
                    ),
                ));
            }
            row_base.push(rows);
            weight_offset.push(weight_offset[t] + spec.rows * spec.dim);
            col_offset.push(col_offset[t] + spec.dim);
        }
        Ok(TableLayout {
            specs,
            row_base,
            weight_offset,
            col_offset,
        })
    }

    pub fn specs(&self) -> &[TableSpec] {
        &self.specs
    }

    pub fn num_tables(&self) -> usize {
        self.specs.len()
    }

    /// Rows of all tables together.
    pub fn total_rows(&self) -> usize {
        self.row_base[self.specs.len()]
    }

    /// Elements of the flat weight buffer.
    pub fn total_elements(&self) -> usize {
        self.weight_offset[self.specs.len()]
    }

    /// Width of a pooled output row (the sum of the dims).
    pub fn total_dim(&self) -> usize {
        self.col_offset[self.specs.len()]
    }

    pub fn row_base(&self) -> &[usize] {
        &self.row_base
    }

    pub fn weight_offset(&self) -> &[usize] {
        &self.weight_offset
    }

    pub fn col_offset(&self) -> &[usize] {
        &self.col_offset
    }

    /// The element range of row `row` of table `t` in the flat weights.
    pub fn row_range(&self, t: usize, row: usize) -> std::ops::Range<usize> {
        let start = self.weight_offset[t] + row * self.specs[t].dim;
        start..start + self.specs[t].dim
    }
}

/// The tables' layout and their f32 weights (one flat buffer, table after table, row-major).
#[derive(Debug, Clone, PartialEq)]
pub struct EmbeddingTables {
    pub layout: TableLayout,
    pub weights: Vec<f32>,
}

impl EmbeddingTables {
    /// Tables initialised uniformly in `[-scale_t, scale_t)` with `scale_t = 1 / sqrt(rows_t)`
    /// (FBGEMM's default), from `seed`.
    pub fn new(layout: TableLayout, seed: u64) -> Self {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let mut weights = Vec::with_capacity(layout.total_elements());
        for spec in layout.specs() {
            let scale = (1.0 / spec.rows as f64).sqrt() as f32;
            weights.extend((0..spec.rows * spec.dim).map(|_| rng.random_range(-scale..scale)));
        }
        EmbeddingTables { layout, weights }
    }

    /// Tables with the given weights (`layout.total_elements()` of them).
    pub fn from_weights(layout: TableLayout, weights: Vec<f32>) -> Result<Self> {
        if weights.len() != layout.total_elements() {
            return Err(RecsysError::invalid(
                "table weights",
                format!(
                    "{} values given, the tables hold {}",
                    weights.len(),
                    layout.total_elements()
                ),
            ));
        }
        Ok(EmbeddingTables { layout, weights })
    }

    /// Row `row` of table `t`.
    pub fn row(&self, t: usize, row: usize) -> &[f32] {
        &self.weights[self.layout.row_range(t, row)]
    }
}
