//! The committed PyTorch DeepFM fixture (`deepfm_parity.safetensors`, written by
//! `make_deepfm_parity.py` beside this file): initial weights, 200 batches and the loss of every
//! step under torch with row-wise Adagrad and with SparseAdam on the tables (AdamW on the rest).
//! Shared by the CPU parity test and the GPU tests.

#![allow(dead_code)]

use safetensors::SafeTensors;
use safetensors::tensor::Dtype;
use tilearn_optim::AdamWConfig;
use tilearn_recsys::data::{CtrBatch, MISSING};
use tilearn_recsys::{CtrConfig, CtrModel, CtrStepper, JaggedBatch, ModelKind, SparseOptimizer};

const EMPTY: u32 = u32::MAX;

/// The fixture, decoded.
pub struct Parity {
    pub config: CtrConfig,
    pub batch: usize,
    pub steps: usize,
    pub dense_lr: f32,
    pub adagrad_lr: f32,
    pub adam_lr: f32,
    tables: Vec<f32>,
    dense_params: Vec<f32>,
    ids: Vec<u32>,
    dense: Vec<f32>,
    labels: Vec<f32>,
    pub loss_adagrad: Vec<f64>,
    pub loss_adam: Vec<f64>,
}

fn bytes_of<'a>(file: &'a SafeTensors<'a>, name: &str, dtype: Dtype) -> &'a [u8] {
    let t = file
        .tensor(name)
        .unwrap_or_else(|e| panic!("fixture: {name}: {e}"));
    assert_eq!(t.dtype(), dtype, "fixture: {name}");
    t.data()
}

fn f32s(file: &SafeTensors<'_>, name: &str) -> Vec<f32> {
    (bytes_of(file, name, Dtype::F32).chunks_exact(4))
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

fn f64s(file: &SafeTensors<'_>, name: &str) -> Vec<f64> {
    (bytes_of(file, name, Dtype::F64).chunks_exact(8))
        .map(|c| f64::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

fn u32s(file: &SafeTensors<'_>, name: &str) -> Vec<u32> {
    (bytes_of(file, name, Dtype::U32).chunks_exact(4))
        .map(|c| u32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

/// The fixture, compiled into the test (so the GPU bundle needs no source tree).
const FIXTURE: &[u8] = include_bytes!("deepfm_parity.safetensors");

pub fn load() -> Parity {
    let bytes = FIXTURE;
    let (_, meta) = SafeTensors::read_metadata(bytes).unwrap();
    let config: serde_json::Value =
        serde_json::from_str(&meta.metadata().as_ref().unwrap()["config"]).unwrap();
    let file = SafeTensors::deserialize(bytes).unwrap();
    let usizes = |key: &str| -> Vec<usize> {
        config[key]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as usize)
            .collect()
    };
    let num = |v: &serde_json::Value| v.as_f64().unwrap();
    let ctr = CtrConfig {
        model: ModelKind::DeepFm,
        num_dense: num(&config["num_dense"]) as usize,
        field_rows: usizes("field_rows"),
        embed_dim: num(&config["embed_dim"]) as usize,
        hidden: usizes("hidden"),
        crosses: Vec::new(),
        cross_rows: 0,
    };
    Parity {
        batch: num(&config["batch"]) as usize,
        steps: num(&config["steps"]) as usize,
        dense_lr: num(&config["dense_lr"]) as f32,
        adagrad_lr: num(&config["sparse_lr"]["adagrad"]) as f32,
        adam_lr: num(&config["sparse_lr"]["adam"]) as f32,
        config: ctr,
        tables: f32s(&file, "tables"),
        dense_params: f32s(&file, "dense_params"),
        ids: u32s(&file, "ids"),
        dense: f32s(&file, "dense"),
        labels: f32s(&file, "labels"),
        loss_adagrad: f64s(&file, "loss_adagrad"),
        loss_adam: f64s(&file, "loss_adam"),
    }
}

impl Parity {
    /// The fixture's initial model with `sparse` on the tables and AdamW (torch's defaults,
    /// no weight decay) on the dense part.
    pub fn model(&self, sparse: SparseOptimizer) -> CtrModel {
        let dense = AdamWConfig {
            lr: self.dense_lr,
            weight_decay: 0.0,
            ..AdamWConfig::default()
        };
        let mut model = CtrModel::new(self.config.clone(), sparse, dense, 0).unwrap();
        assert_eq!(model.tables.weights.len(), self.tables.len(), "table sizes");
        assert_eq!(model.dense.len(), self.dense_params.len(), "dense sizes");
        model.tables.weights.clone_from(&self.tables);
        model.dense.clone_from(&self.dense_params);
        model
    }

    /// Batch `step`: the samples (categorical values = the fixture's row ids) and the jagged
    /// ids of the model's tables (each field's row in its embedding and first-order tables).
    pub fn batch(&self, step: usize) -> (CtrBatch, JaggedBatch) {
        let (b, fields, nd) = (self.batch, self.config.num_fields(), self.config.num_dense);
        let rows = step * b..(step + 1) * b;
        let ids = &self.ids[rows.start * fields..rows.end * fields];
        let data = CtrBatch {
            num_dense: nd,
            num_fields: fields,
            labels: self.labels[rows.clone()].to_vec(),
            dense: self.dense[rows.start * nd..rows.end * nd].to_vec(),
            cats: ids
                .iter()
                .map(|&id| if id == EMPTY { MISSING } else { id as u64 })
                .collect(),
        };
        let mut offsets = vec![0u32];
        let mut jagged_ids = Vec::new();
        for _copy in 0..2 {
            for f in 0..fields {
                for s in 0..b {
                    let id = ids[s * fields + f];
                    if id != EMPTY {
                        jagged_ids.push(id);
                    }
                    offsets.push(jagged_ids.len() as u32);
                }
            }
        }
        let layout = self.config.table_layout().unwrap();
        (
            data,
            JaggedBatch::new(&layout, b, offsets, jagged_ids).unwrap(),
        )
    }

    /// The loss of every step of `model` on the fixture's batches.
    pub fn run(&self, model: &mut impl CtrStepper) -> Vec<f64> {
        (0..self.steps)
            .map(|step| {
                let (data, jagged) = self.batch(step);
                model.step(&data, &jagged, self.dense_lr).unwrap().loss
            })
            .collect()
    }
}

/// The largest |ours - torch| / torch over the steps.
pub fn worst_relative(ours: &[f64], torch: &[f64]) -> f64 {
    assert_eq!(ours.len(), torch.len());
    ours.iter()
        .zip(torch)
        .map(|(o, t)| ((o - t) / t).abs())
        .fold(0.0, f64::max)
}
