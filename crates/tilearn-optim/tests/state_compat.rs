//! State files written before the optimizers shared one state-file writer still load, and the
//! shared writer produces the same file contents.
//!
//! `tests/fixtures/state_v1/<case>.safetensors` were written by the code of commit 69ba2ca
//! (AdamW with its own writer, the others through `state_file.rs`) after the three steps of
//! [`run`]; `params.safetensors` holds that code's parameters after steps 3 and 4
//! (`<case>.step3`, `<case>.step4`). For every case this test
//!
//! * checks that today's optimizer computes those parameters bit for bit,
//! * loads the old file into a fresh optimizer and checks that the fourth step from it gives
//!   the old parameters too (so moments and step count are read back exactly), and
//! * saves today's state after the same three steps and checks that its metadata (format tag,
//!   version, step, numel, config and groups JSON) and tensors (names, dtype, shape, bytes) are
//!   those of the old file. Only the order of the metadata keys in the JSON header may differ:
//!   the old writers serialized a `HashMap`.

// Groups take a list of ranges; a list holding a single range is intended here.
#![allow(clippy::single_range_in_vec_init)]

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use safetensors::SafeTensors;
use tilearn_optim::{
    AdamConfig, AdamWConfig, LambConfig, LionConfig, Optimizer, OptimizerConfig, ParamGroup,
    SgdConfig,
};

const NUMEL: usize = 7;

fn cases() -> Vec<(&'static str, OptimizerConfig)> {
    let adamw = AdamWConfig {
        lr: 1e-2,
        weight_decay: 0.1,
        ..AdamWConfig::default()
    };
    let adam = AdamConfig {
        lr: 1e-2,
        weight_decay: 0.1,
        ..AdamConfig::default()
    };
    vec![
        ("adamw", OptimizerConfig::AdamW(adamw)),
        (
            "adamw_amsgrad",
            OptimizerConfig::AdamW(AdamWConfig {
                amsgrad: true,
                ..adamw
            }),
        ),
        ("adam", OptimizerConfig::Adam(adam)),
        (
            "adam_amsgrad",
            OptimizerConfig::Adam(AdamConfig {
                amsgrad: true,
                ..adam
            }),
        ),
        ("sgd", OptimizerConfig::Sgd(SgdConfig::default())),
        (
            "sgd_momentum",
            OptimizerConfig::Sgd(SgdConfig {
                momentum: 0.9,
                dampening: 0.1,
                ..SgdConfig::default()
            }),
        ),
        ("lamb", OptimizerConfig::Lamb(LambConfig::default())),
        (
            "lion",
            OptimizerConfig::Lion(LionConfig {
                weight_decay: 0.1,
                ..LionConfig::default()
            }),
        ),
    ]
}

/// Two groups with holes between their ranges, one with its own lr scale.
fn build(config: OptimizerConfig) -> Box<dyn Optimizer> {
    let groups = vec![
        ParamGroup::new("decay", vec![0..3, 6..7], config.weight_decay()),
        ParamGroup::new("no_decay", vec![4..6], 0.0).with_lr_scale(0.5),
    ];
    config.build(groups, NUMEL, vec![0..3, 4..6, 6..7]).unwrap()
}

fn params0() -> Vec<f32> {
    (0..NUMEL).map(|i| (i as f32 * 0.37).sin()).collect()
}

fn grads(step: usize) -> Vec<f32> {
    (0..NUMEL)
        .map(|i| ((i * 5 + step * 3) as f32 * 0.61).cos() * (1.0 + step as f32))
        .collect()
}

fn lr(config: &OptimizerConfig, step: usize) -> f32 {
    config.lr() * (1.0 - 0.2 * step as f32)
}

/// The optimizer and parameters after `steps` steps.
fn run(config: OptimizerConfig, steps: usize) -> (Box<dyn Optimizer>, Vec<f32>) {
    let mut opt = build(config);
    let mut p = params0();
    for s in 0..steps {
        opt.step(&mut p, &grads(s), lr(&config, s)).unwrap();
    }
    (opt, p)
}

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/state_v1")
        .join(format!("{name}.safetensors"))
}

/// The metadata and the tensors (name → dtype, shape, bytes) of a state file.
type Contents = (
    HashMap<String, String>,
    Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)>,
);

fn contents(path: &Path) -> Contents {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let (_, header) = SafeTensors::read_metadata(&bytes).unwrap();
    let metadata = header
        .metadata()
        .clone()
        .expect("state files carry metadata");
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let mut tensors: Vec<_> = st
        .tensors()
        .into_iter()
        .map(|(name, view)| {
            (
                name,
                view.dtype(),
                view.shape().to_vec(),
                view.data().to_vec(),
            )
        })
        .collect();
    tensors.sort_by(|a, b| a.0.cmp(&b.0));
    (metadata, tensors)
}

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

/// The parameters the old code reached (see the module docs), as bits.
fn old_params(case: &str, step: usize) -> Vec<u32> {
    let bytes = std::fs::read(fixture("params")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let view = st.tensor(&format!("{case}.step{step}")).unwrap();
    view.data()
        .chunks_exact(4)
        .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

#[test]
fn old_files_load_and_the_steps_match_the_old_code_bit_for_bit() {
    for (name, config) in cases() {
        let (mut running, p3) = run(config, 3);
        assert_eq!(bits(&p3), old_params(name, 3), "{name}: step 3");
        let mut resumed = build(config);
        resumed
            .load_state(&fixture(name))
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(resumed.step_count(), 3, "{name}");

        let (mut p_running, mut p_resumed) = (p3.clone(), p3);
        running
            .step(&mut p_running, &grads(3), lr(&config, 3))
            .unwrap();
        resumed
            .step(&mut p_resumed, &grads(3), lr(&config, 3))
            .unwrap();
        assert_eq!(bits(&p_running), old_params(name, 4), "{name}: step 4");
        assert_eq!(
            bits(&p_resumed),
            old_params(name, 4),
            "{name}: step 4 after load"
        );
    }
}

#[test]
fn the_shared_writer_writes_what_the_previous_writers_wrote() {
    let dir = tempfile::tempdir().unwrap();
    for (name, config) in cases() {
        let (opt, _) = run(config, 3);
        let path = dir.path().join(format!("{name}.safetensors"));
        opt.save_state(&path).unwrap();
        let (new_meta, new_tensors) = contents(&path);
        let (old_meta, old_tensors) = contents(&fixture(name));
        assert_eq!(new_meta, old_meta, "{name}: metadata");
        assert_eq!(new_tensors, old_tensors, "{name}: tensors");
        assert_eq!(new_meta["format"], format!("tilearn-{}", opt.name()));
    }
}

#[test]
fn equal_states_give_identical_files() {
    let dir = tempfile::tempdir().unwrap();
    for (name, config) in cases() {
        let (opt, _) = run(config, 3);
        let a = dir.path().join(format!("{name}.a"));
        let b = dir.path().join(format!("{name}.b"));
        opt.save_state(&a).unwrap();
        opt.save_state(&b).unwrap();
        assert_eq!(
            std::fs::read(a).unwrap(),
            std::fs::read(b).unwrap(),
            "{name}"
        );
    }
}
