//! A CTR model's shape: which model, how many dense and categorical features, the tables it
//! derives (one fused embedding-bag operator for all of them) and where each dense parameter
//! lives in the flat buffer the dense optimizer steps.

use std::ops::Range;

use serde::{Deserialize, Serialize};

use crate::data::{CtrBatch, MISSING};
use crate::error::{RecsysError, Result};
use crate::hash::{hash_to_row, mix64};
use crate::jagged::JaggedBatch;
use crate::tables::{Pooling, TableLayout, TableSpec};
use rayon::prelude::*;

/// The two models.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ModelKind {
    /// DeepFM (Guo et al. 2017): first-order terms + FM pairwise interactions of the field
    /// embeddings + an MLP over the embeddings and dense features, summed into one logit.
    DeepFm,
    /// Wide & Deep (Cheng et al. 2016): a wide linear part over the sparse features and crossed
    /// pairs of them + an MLP over embeddings and dense features.
    WideDeep,
}

impl std::str::FromStr for ModelKind {
    type Err = RecsysError;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "deepfm" => Ok(ModelKind::DeepFm),
            "wide-deep" => Ok(ModelKind::WideDeep),
            other => Err(RecsysError::invalid(
                "model",
                format!("`{other}` is not a model; use deepfm or wide-deep"),
            )),
        }
    }
}

/// Hyper-parameters of a CTR model.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CtrConfig {
    pub model: ModelKind,
    /// Dense (numeric) features per sample (Criteo: 13).
    pub num_dense: usize,
    /// Rows of each categorical field's table (Criteo: 26 fields); raw values are hashed into it.
    pub field_rows: Vec<usize>,
    /// Embedding dimension of every field (the FM needs one common dimension).
    pub embed_dim: usize,
    /// Hidden widths of the MLP (ReLU after each); the output layer (width 1) is added.
    pub hidden: Vec<usize>,
    /// Wide & Deep's crossed features: pairs of fields, each hashed into `cross_rows` rows.
    pub crosses: Vec<(usize, usize)>,
    pub cross_rows: usize,
}

impl CtrConfig {
    /// `num_fields` fields of `rows` rows each; Wide & Deep crosses fields (0, 1), (2, 3), ...
    /// into tables of `rows` rows.
    pub fn for_fields(
        model: ModelKind,
        num_dense: usize,
        num_fields: usize,
        rows: usize,
        embed_dim: usize,
        hidden: Vec<usize>,
    ) -> Self {
        let crosses = match model {
            ModelKind::DeepFm => Vec::new(),
            ModelKind::WideDeep => (0..num_fields / 2).map(|i| (2 * i, 2 * i + 1)).collect(),
        };
        CtrConfig {
            model,
            num_dense,
            field_rows: vec![rows; num_fields],
            embed_dim,
            hidden,
            crosses,
            cross_rows: rows,
        }
    }

    /// Checks the shape: at least one field, every index of `crosses` a field, no crosses for
    /// DeepFM, non-zero widths.
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(RecsysError::invalid("model config", m));
        if self.field_rows.is_empty() || self.embed_dim == 0 {
            return bad("at least one categorical field and embed_dim >= 1 are needed".into());
        }
        if self.hidden.contains(&0) {
            return bad(format!("hidden widths must be >= 1, got {:?}", self.hidden));
        }
        if self.model == ModelKind::DeepFm && !self.crosses.is_empty() {
            return bad(
                "crossed features belong to wide-deep; DeepFM's FM learns the pairs".into(),
            );
        }
        let fields = self.field_rows.len();
        if let Some(&(a, b)) = self
            .crosses
            .iter()
            .find(|&&(a, b)| a >= fields || b >= fields)
        {
            return bad(format!("cross ({a}, {b}) names a field >= {fields}"));
        }
        if !self.crosses.is_empty() && self.cross_rows == 0 {
            return bad("cross_rows must be >= 1".into());
        }
        Ok(())
    }

    pub fn num_fields(&self) -> usize {
        self.field_rows.len()
    }

    /// The fused operator's tables: the fields' embeddings (dim `embed_dim`), then their
    /// first-order weights (dim 1), then one dim-1 table per cross. All sum-pooled.
    pub fn table_layout(&self) -> Result<TableLayout> {
        let spec = |rows, dim| TableSpec {
            rows,
            dim,
            pooling: Pooling::Sum,
        };
        let mut specs: Vec<TableSpec> = self
            .field_rows
            .iter()
            .map(|&r| spec(r, self.embed_dim))
            .collect();
        specs.extend(self.field_rows.iter().map(|&r| spec(r, 1)));
        specs.extend(self.crosses.iter().map(|_| spec(self.cross_rows, 1)));
        TableLayout::new(specs)
    }

    /// Width of the MLP's input: the field embeddings and the dense features.
    pub fn mlp_input(&self) -> usize {
        self.num_fields() * self.embed_dim + self.num_dense
    }

    /// The jagged ids of this model's tables for `data`: each field's value (or an empty bag)
    /// for its embedding and first-order tables, and each cross's combined value when both
    /// fields are present, hashed into the table ([`hash_to_row`]). The tables are built in
    /// parallel (this is the largest host cost of a training step at large batches).
    pub fn jagged(&self, data: &CtrBatch) -> Result<JaggedBatch> {
        let layout = self.table_layout()?;
        let (batch, fields) = (data.len(), data.num_fields);
        let field = |b: usize, f: usize| Some(data.cats[b * fields + f]).filter(|&v| v != MISSING);
        // Table t's value of sample b: fields (twice), then crosses.
        let value = |t: usize, b: usize| {
            if t < 2 * fields {
                field(b, t % fields)
            } else {
                let (fa, fb) = self.crosses[t - 2 * fields];
                field(b, fa).zip(field(b, fb)).map(|(a, c)| mix64(a) ^ c)
            }
        };
        let per_table: Vec<(Vec<u32>, Vec<u32>)> = (0..layout.num_tables())
            .into_par_iter()
            .map(|t| {
                let rows = layout.specs()[t].rows;
                let mut lens = Vec::with_capacity(batch);
                let mut ids = Vec::with_capacity(batch);
                for b in 0..batch {
                    let before = ids.len();
                    if let Some(v) = value(t, b) {
                        ids.push(hash_to_row(v, rows));
                    }
                    lens.push((ids.len() - before) as u32);
                }
                (lens, ids)
            })
            .collect();
        let entries: usize = per_table.iter().map(|(_, ids)| ids.len()).sum();
        let mut offsets = Vec::with_capacity(layout.num_tables() * batch + 1);
        let mut ids = Vec::with_capacity(entries);
        offsets.push(0u32);
        for (lens, table_ids) in per_table {
            for len in lens {
                offsets.push(offsets[offsets.len() - 1] + len);
            }
            ids.extend(table_ids);
        }
        JaggedBatch::new(&layout, batch, offsets, ids)
    }

    /// Where each dense parameter lives in the flat buffer.
    pub fn dense_layout(&self) -> DenseLayout {
        let mut next = 0;
        let mut take = |n: usize| {
            let r = next..next + n;
            next += n;
            r
        };
        let dense_weights = take(self.num_dense);
        let bias = take(1).start;
        let mut layers = Vec::new();
        let mut fan_in = self.mlp_input();
        for &out in self.hidden.iter().chain(std::iter::once(&1)) {
            layers.push(LinearLayer {
                weight: take(out * fan_in),
                bias: take(out),
                fan_in,
                fan_out: out,
            });
            fan_in = out;
        }
        DenseLayout {
            dense_weights,
            bias,
            layers,
            numel: next,
        }
    }
}

/// One MLP layer's place in the flat dense buffer (`W` is `[fan_out, fan_in]`, as PyTorch).
#[derive(Debug, Clone, PartialEq)]
pub struct LinearLayer {
    pub weight: Range<usize>,
    pub bias: Range<usize>,
    pub fan_in: usize,
    pub fan_out: usize,
}

/// The flat dense buffer: the dense features' linear weights, the global bias, the MLP layers.
#[derive(Debug, Clone, PartialEq)]
pub struct DenseLayout {
    pub dense_weights: Range<usize>,
    pub bias: usize,
    pub layers: Vec<LinearLayer>,
    pub numel: usize,
}
