//! The transformers golden fixtures of `tests/golden/<case>/` (made by
//! `tests/golden/make_golden.py`): where they are and how to read one case's
//! `golden.safetensors`. Shared by the CPU parity test and the GPU engine's test.

use std::path::{Path, PathBuf};

use safetensors::{Dtype, SafeTensors};
use tilearn_engine::model::{Activations, LlamaForCausalLM, LossStats};

/// The committed cases.
pub const CASES: &[&str] = &[
    "mha_untied",
    "gqa_tied_llama3",
    "gqa_linear_bias_v4config",
    "dynamic_rope",
];

pub fn golden_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/golden")
}

/// The model-family cases of `tests/golden_families/` (made by `make_family_golden.py`, same
/// format): Qwen2 and Mistral from transformers, Baichuan from the script's reference.
pub const FAMILY_CASES: &[&str] = &[
    "qwen2_tied",
    "qwen2_sliding_v4config",
    "mistral_sliding",
    "mistral_v4config",
    "baichuan_7b",
    "baichuan2_7b",
    "baichuan_13b",
    "baichuan2_13b",
    "bloom_tied",
    "bloom_v4config",
];

/// The `TILEARN_LLM_BAICHUAN_13B` value a family case was made with (its `golden.json`):
/// reduced-width 13B models are 13B ones only by that variable.
pub fn baichuan_13b_of(case_dir: &Path) -> Option<String> {
    let info: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(case_dir.join("golden.json")).ok()?).ok()?;
    info.get("tilearn_llm_baichuan_13b")?
        .as_u64()
        .map(|g| g.to_string())
}

/// Loads the checkpoint of family case directory `case_dir` as its reference reads it.
pub fn load_family_case(case_dir: &Path) -> tilearn_engine::model::LlamaForCausalLM {
    let generation = baichuan_13b_of(case_dir);
    tilearn_engine::model::LlamaForCausalLM::from_pretrained_with_baichuan_13b(
        case_dir,
        generation.as_deref(),
    )
    .unwrap_or_else(|e| panic!("{}: {e}", case_dir.display()))
}

pub fn families_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/golden_families")
}

/// One case's inputs and transformers' outputs (gradients sorted by parameter name, each with
/// its shape).
pub struct Golden {
    pub batch: usize,
    pub seq: usize,
    pub input_ids: Vec<u32>,
    pub labels: Vec<i32>,
    pub logits: Vec<f32>,
    pub loss: f32,
    pub inv_freq: Option<Vec<f32>>,
    pub grads: Vec<(String, Vec<usize>, Vec<f32>)>,
}

pub fn f32s(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect()
}

pub fn i64s(bytes: &[u8]) -> Vec<i64> {
    bytes
        .chunks_exact(8)
        .map(|b| i64::from_le_bytes(b.try_into().unwrap()))
        .collect()
}

pub fn read_golden(path: &Path) -> Golden {
    let bytes = std::fs::read(path)
        .unwrap_or_else(|e| panic!("{}: {e}; regenerate with make_golden.py", path.display()));
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let get = |name: &str, dtype: Dtype| {
        let t = st
            .tensor(name)
            .unwrap_or_else(|e| panic!("{}: {name}: {e}", path.display()));
        assert_eq!(t.dtype(), dtype, "{}: {name} dtype", path.display());
        t
    };
    let ids = get("input_ids", Dtype::I64);
    let (batch, seq) = (ids.shape()[0], ids.shape()[1]);
    let input_ids = i64s(ids.data()).into_iter().map(|x| x as u32).collect();
    let labels = i64s(get("labels", Dtype::I64).data())
        .into_iter()
        .map(|x| x as i32)
        .collect();
    let logits = f32s(get("logits", Dtype::F32).data());
    let loss = f32s(get("loss", Dtype::F32).data())[0];
    let inv_freq = st.tensor("rope.inv_freq").ok().map(|t| f32s(t.data()));
    let mut grads: Vec<_> = st
        .iter()
        .filter_map(|(name, t)| {
            name.strip_prefix("grad.")
                .map(|n| (n.to_string(), t.shape().to_vec(), f32s(t.data())))
        })
        .collect();
    grads.sort_by(|a, b| a.0.cmp(&b.0));
    Golden {
        batch,
        seq,
        input_ids,
        labels,
        logits,
        loss,
        inv_freq,
        grads,
    }
}

/// The CPU model on a case's batch: its logits, loss statistics and the gradients of every
/// parameter (flat, in the model's parameter order).
pub fn cpu_run(model: &LlamaForCausalLM, g: &Golden) -> (Vec<f32>, LossStats, Vec<f32>) {
    let mut acts = Activations::new(&model.config, g.batch, g.seq, false);
    let logits = model
        .forward_logits(&g.input_ids, g.batch, g.seq, &mut acts)
        .unwrap()
        .to_vec();
    let mut grads = vec![0.0f32; model.params.numel()];
    let stats = model
        .forward_backward(
            &g.input_ids,
            &g.labels,
            g.batch,
            g.seq,
            None,
            &mut acts,
            &mut grads,
        )
        .unwrap();
    (logits, stats, grads)
}
