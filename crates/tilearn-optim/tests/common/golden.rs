//! Reading the PyTorch trajectories recorded by `tests/optim_golden/make_optim_golden.py`
//! (shared by the CPU replay in `torch_trajectories.rs` and the GPU replay in `gpu.rs`).
//!
//! The fixtures live in `tests/optim_golden/fixtures` at the repository root; set
//! `TILEARN_OPTIM_GOLDEN_DIR` to replay another recording (e.g. one made with
//! `--device cuda` on the GPU machine).

use std::collections::HashMap;
use std::ops::Range;
use std::path::{Path, PathBuf};

use safetensors::SafeTensors;
use serde_json::Value;
use tilearn_optim::{
    AdamConfig, AdamWConfig, LambConfig, LionConfig, OptimizerConfig, ParamGroup, SgdConfig,
};

pub const CASES: &[&str] = &[
    "adamw",
    "adamw_amsgrad",
    "adam",
    "adam_amsgrad",
    "sgd",
    "sgd_momentum",
    "sgd_nesterov",
    "lamb",
    "lamb_nvlamb_noclip",
    "lion",
];

pub fn golden_dir() -> PathBuf {
    match std::env::var_os("TILEARN_OPTIM_GOLDEN_DIR") {
        Some(d) => PathBuf::from(d),
        None => Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/optim_golden/fixtures"),
    }
}

pub fn f32s(st: &SafeTensors<'_>, name: &str) -> (Vec<f32>, Vec<usize>) {
    let view = st.tensor(name).unwrap_or_else(|e| panic!("{name}: {e}"));
    assert_eq!(view.dtype(), safetensors::Dtype::F32, "{name}");
    let data = view
        .data()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    (data, view.shape().to_vec())
}

fn metadata(bytes: &[u8]) -> HashMap<String, String> {
    let (_, header) = SafeTensors::read_metadata(bytes).unwrap();
    header.metadata().clone().expect("metadata")
}

pub struct Inputs {
    pub params0: Vec<f32>,
    /// One gradient buffer per step.
    pub grads: Vec<Vec<f32>>,
    /// Element range of each model tensor in the flat buffer.
    pub tensors: Vec<Range<usize>>,
}

pub fn load_inputs(dir: &Path) -> Inputs {
    let bytes = std::fs::read(dir.join("inputs.safetensors"))
        .unwrap_or_else(|e| panic!("{}: {e}", dir.join("inputs.safetensors").display()));
    let meta = metadata(&bytes);
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let (params0, shape) = f32s(&st, "params0");
    let n = shape[0];
    let (g, gshape) = f32s(&st, "grads");
    assert_eq!(gshape[1], n);
    let layout: Value = serde_json::from_str(&meta["tensors"]).unwrap();
    let tensors = layout
        .as_array()
        .unwrap()
        .iter()
        .map(|t| {
            let off = t["offset"].as_u64().unwrap() as usize;
            off..off + t["numel"].as_u64().unwrap() as usize
        })
        .collect::<Vec<_>>();
    assert_eq!(tensors.last().unwrap().end, n);
    Inputs {
        params0,
        grads: g.chunks_exact(n).map(<[f32]>::to_vec).collect(),
        tensors,
    }
}

fn f(v: &Value) -> f32 {
    v.as_f64().unwrap_or_else(|| panic!("not a number: {v}")) as f32
}

/// The Rust config equal to the case's torch hyper-parameters.
fn config_of(case: &Value, decay_wd: f32) -> OptimizerConfig {
    let h = &case["hyper"];
    let lr = f(&case["lrs"][0]);
    let betas = || (f(&h["betas"][0]), f(&h["betas"][1]));
    let flag = |k: &str| h.get(k).and_then(Value::as_bool).unwrap_or(false);
    let num = |k: &str, d: f32| h.get(k).map_or(d, f);
    match case["optimizer"].as_str().unwrap() {
        "adamw" => OptimizerConfig::AdamW(AdamWConfig {
            lr,
            beta1: betas().0,
            beta2: betas().1,
            eps: f(&h["eps"]),
            weight_decay: decay_wd,
            amsgrad: flag("amsgrad"),
        }),
        "adam" => OptimizerConfig::Adam(AdamConfig {
            lr,
            beta1: betas().0,
            beta2: betas().1,
            eps: f(&h["eps"]),
            weight_decay: decay_wd,
            amsgrad: flag("amsgrad"),
        }),
        "sgd" => OptimizerConfig::Sgd(SgdConfig {
            lr,
            momentum: num("momentum", 0.0),
            dampening: num("dampening", 0.0),
            weight_decay: decay_wd,
            nesterov: flag("nesterov"),
        }),
        "lamb" => OptimizerConfig::Lamb(LambConfig {
            lr,
            beta1: betas().0,
            beta2: betas().1,
            eps: f(&h["eps"]),
            weight_decay: decay_wd,
            bias_correction: flag("bias_correction"),
            grad_averaging: flag("grad_averaging"),
            max_grad_norm: h["max_grad_norm"].as_f64().map(|x| x as f32),
            use_nvlamb: flag("use_nvlamb"),
        }),
        "lion" => OptimizerConfig::Lion(LionConfig {
            lr,
            beta1: betas().0,
            beta2: betas().1,
            weight_decay: decay_wd,
        }),
        other => panic!("unknown optimizer {other}"),
    }
}

/// One recorded case: torch's configuration and its parameters after every step.
pub struct Case {
    /// The torch optimizer's name (`adamw`, `adam`, `sgd`, `lamb`, `lion`).
    pub optimizer: String,
    /// The Rust config equal to torch's hyper-parameters (lr = the first step's; the weight
    /// decay of the first group, the others' come from `groups`).
    pub config: OptimizerConfig,
    pub groups: Vec<ParamGroup>,
    /// Learning rate of each step.
    pub lrs: Vec<f32>,
    /// `steps × numel` parameters, row `t` after step `t + 1`.
    pub trajectory: Vec<f32>,
    /// The final optimizer state, by torch's state name (`exp_avg`, `momentum_buffer`, ...).
    pub state: Vec<(String, Vec<f32>)>,
}

pub fn load_case(dir: &Path, inputs: &Inputs, name: &str) -> Case {
    let path = dir.join(format!("{name}.safetensors"));
    let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let case: Value = serde_json::from_str(&metadata(&bytes)["case"]).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let n = inputs.params0.len();
    let (trajectory, tshape) = f32s(&st, "trajectory");
    assert_eq!(tshape, vec![inputs.grads.len(), n]);

    let groups: Vec<ParamGroup> = case["groups"]
        .as_array()
        .unwrap()
        .iter()
        .map(|g| {
            let ranges = g["tensors"]
                .as_array()
                .unwrap()
                .iter()
                .map(|i| inputs.tensors[i.as_u64().unwrap() as usize].clone())
                .collect();
            ParamGroup::new(g["name"].as_str().unwrap(), ranges, f(&g["weight_decay"]))
        })
        .collect();
    let lrs: Vec<f32> = case["lrs"].as_array().unwrap().iter().map(f).collect();
    assert_eq!(lrs.len(), inputs.grads.len(), "{name}: one lr per step");
    let mut state: Vec<(String, Vec<f32>)> = st
        .names()
        .into_iter()
        .filter_map(|k| {
            k.strip_prefix("state.")
                .map(|s| (s.to_string(), f32s(&st, k).0))
        })
        .collect();
    state.sort_by(|a, b| a.0.cmp(&b.0));
    Case {
        optimizer: case["optimizer"].as_str().unwrap().to_string(),
        config: config_of(&case, groups[0].weight_decay),
        groups,
        lrs,
        trajectory,
        state,
    }
}

/// `||a - b|| / ||b||` in f64.
pub fn rel_err(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len());
    let num: f64 = a
        .iter()
        .zip(b)
        .map(|(&x, &y)| (f64::from(x) - f64::from(y)).powi(2))
        .sum();
    let den: f64 = b.iter().map(|&y| f64::from(y).powi(2)).sum();
    let e = (num / den).sqrt();
    // NaN must fail the comparison, not slip through `e <= TOL`.
    assert!(e.is_finite(), "non-finite relative error");
    e
}
