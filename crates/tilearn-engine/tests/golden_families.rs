//! Golden parity of the model families beyond Llama (Qwen2, Mistral, Baichuan-7B,
//! Baichuan2-7B, Baichuan-13B and Baichuan2-13B with ALiBi and z-loss): each case of `tests/golden_families/` (made by `make_family_golden.py`)
//! holds a checkpoint in the family's own names and config form and the logits, loss and
//! gradients its reference computed in float64 (transformers for Qwen2 / Mistral, the script's
//! PyTorch model of the published architecture for Baichuan). We load it, run the f32 CPU
//! engine and compare relative errors; then we save a changed model and check that it loads
//! back here and, where python3 with torch + transformers is found, in the reference.

mod support;

use std::path::Path;
use std::process::Command;

use support::golden::{
    FAMILY_CASES, baichuan_13b_of, cpu_run, families_dir, load_family_case, read_golden,
};
use support::{rel_err, report};
use tilearn_engine::config::{BaichuanVariant, ModelFamily};
use tilearn_engine::model::{Activations, LlamaForCausalLM};
use tilearn_ops::DType;

/// As for the Llama goldens: one f32 forward over two layers is ~1e-6 off the f64 reference;
/// a wrong mask, bias or head moves the logits by 1e-2 or more.
const LOGITS_LOSS_TOL: f64 = 1e-4;
/// f32 backward through softmax, norms and (Baichuan2) the head normalisation; biases and norm
/// weights have small gradients that amplify rounding relatively. Wrong terms give >= 1e-2.
const GRAD_TOL: f64 = 1e-3;

fn expected_family(case: &str) -> ModelFamily {
    let b = ModelFamily::Baichuan;
    match case {
        "baichuan_7b" => b(BaichuanVariant::Baichuan7B),
        "baichuan2_7b" => b(BaichuanVariant::Baichuan2_7B),
        "baichuan_13b" => b(BaichuanVariant::Baichuan13B),
        "baichuan2_13b" => b(BaichuanVariant::Baichuan2_13B),
        _ => match case.split('_').next() {
            Some("bloom") => ModelFamily::Bloom,
            Some("qwen2") => ModelFamily::Qwen2,
            Some("mistral") => ModelFamily::Mistral,
            _ => panic!("{case}: no family"),
        },
    }
}

fn load(case: &str) -> LlamaForCausalLM {
    let dir = families_dir().join(case);
    assert!(
        dir.is_dir(),
        "fixture {} is missing: it is committed; restore it with git or regenerate it with \
         tests/golden_families/make_family_golden.py",
        dir.display()
    );
    load_family_case(&dir)
}

fn run_case(case: &str) {
    let model = load(case);
    let cfg = &model.config;
    assert_eq!(cfg.family, expected_family(case), "{case}: family");
    let g = read_golden(&families_dir().join(case).join("golden.safetensors"));
    let (logits, stats, grads) = cpu_run(&model, &g);
    // Bloom's query_key_value gradient back in the checkpoint's per-head interleaved order.
    let grads = tilearn_engine::checkpoint::checkpoint_order(cfg, &model.params.specs, &grads);
    let loss = stats.mean();
    let logits_err = rel_err(&logits, &g.logits);
    let loss_err = (loss - g.loss as f64).abs() / (g.loss as f64).abs();

    let mut ours: Vec<&str> = model.params.specs.iter().map(|s| s.name.as_str()).collect();
    ours.sort_unstable();
    let theirs: Vec<&str> = g.grads.iter().map(|(n, _, _)| n.as_str()).collect();
    assert_eq!(ours, theirs, "{case}: parameter sets differ");
    let mut worst = (0.0f64, String::new());
    let mut failures = Vec::new();
    for (name, shape, want) in &g.grads {
        let spec = model.params.spec(name).unwrap();
        assert_eq!(&spec.shape, shape, "{case}: {name} shape");
        let err = rel_err(&grads[spec.range()], want);
        if err > worst.0 {
            worst = (err, name.clone());
        }
        if err > GRAD_TOL {
            failures.push(format!("{name}: {err:.3e}"));
        }
    }
    report(&format!(
        "golden {case}: logits rel err {logits_err:.3e}, loss rel err {loss_err:.3e} (ours \
         {loss:.7}, ref {:.7}), worst grad rel err {:.3e} ({})",
        g.loss, worst.0, worst.1
    ));
    assert!(
        logits_err <= LOGITS_LOSS_TOL,
        "{case}: logits {logits_err:.3e}"
    );
    assert!(loss_err <= LOGITS_LOSS_TOL, "{case}: loss {loss_err:.3e}");
    assert!(failures.is_empty(), "{case}: gradients off: {failures:?}");
}

#[test]
fn qwen2_tied() {
    run_case("qwen2_tied");
}

#[test]
fn qwen2_sliding_v4config() {
    run_case("qwen2_sliding_v4config");
}

#[test]
fn mistral_sliding() {
    run_case("mistral_sliding");
}

#[test]
fn mistral_v4config() {
    run_case("mistral_v4config");
}

#[test]
fn baichuan_7b() {
    run_case("baichuan_7b");
}

#[test]
fn baichuan2_7b() {
    run_case("baichuan2_7b");
}

#[test]
fn bloom_tied() {
    run_case("bloom_tied");
}

#[test]
fn bloom_v4config() {
    run_case("bloom_v4config");
}

#[test]
fn baichuan_13b() {
    run_case("baichuan_13b");
}

#[test]
fn baichuan2_13b() {
    run_case("baichuan2_13b");
}

/// Baichuan2-13B's z-loss is in the loss and its gradient: the same model without it gives a
/// loss lower by `z_loss_weight · mean(max²)` and other gradients.
#[test]
fn the_z_loss_weight_is_honoured() {
    let model = load("baichuan2_13b");
    assert!(model.config.z_loss_weight > 0.0);
    let g = read_golden(
        &families_dir()
            .join("baichuan2_13b")
            .join("golden.safetensors"),
    );
    let (_, with, grads_with) = cpu_run(&model, &g);
    let mut plain = model.clone();
    plain.config.z_loss_weight = 0.0;
    let (_, without, grads_without) = cpu_run(&plain, &g);
    let term = with.mean() - without.mean();
    report(&format!("baichuan2_13b: z-loss term {term:.6}"));
    assert!(term > 1e-2, "z-loss term {term}");
    assert!(rel_err(&grads_with, &grads_without) > 1e-3);
}

#[test]
fn every_family_fixture_has_a_test() {
    let mut found: Vec<String> = std::fs::read_dir(families_dir())
        .unwrap()
        .filter_map(|e| {
            let e = e.unwrap();
            e.path()
                .join("golden.safetensors")
                .is_file()
                .then(|| e.file_name().to_string_lossy().into_owned())
        })
        .collect();
    found.sort();
    let mut known: Vec<String> = FAMILY_CASES.iter().map(|s| s.to_string()).collect();
    known.sort();
    assert_eq!(found, known, "add a #[test] for each family case");
}

/// The python that runs the reference: `TILEARN_PYTHON`, else `python3`; `None` (the check is
/// skipped, with a message) unless it imports torch, transformers and safetensors.
fn reference_python() -> Option<String> {
    let python = std::env::var("TILEARN_PYTHON").unwrap_or_else(|_| "python3".into());
    let ok = Command::new(&python)
        .args(["-c", "import torch, transformers, safetensors"])
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false);
    ok.then_some(python)
}

fn write_expectation(path: &Path, ids: &[u32], batch: usize, seq: usize, logits: &[f32]) {
    use safetensors::tensor::{Dtype, TensorView};
    let ids: Vec<u8> = ids
        .iter()
        .flat_map(|&i| i64::from(i).to_le_bytes())
        .collect();
    let logits_bytes: Vec<u8> = logits.iter().flat_map(|x| x.to_le_bytes()).collect();
    let vocab = logits.len() / (batch * seq);
    let tensors = vec![
        (
            "input_ids",
            TensorView::new(Dtype::I64, vec![batch, seq], &ids).unwrap(),
        ),
        (
            "logits",
            TensorView::new(Dtype::F32, vec![batch, seq, vocab], &logits_bytes).unwrap(),
        ),
    ];
    safetensors::serialize_to_file(tensors, None, path).unwrap();
}

/// A model changed by one gradient step is saved in the family's own names and config form,
/// loads back here unchanged, and (with python) the family's reference reproduces our logits.
#[test]
fn saved_families_load_back_here_and_in_the_reference() {
    let python = reference_python();
    if python.is_none() {
        report(
            "saved_families_load_back_here_and_in_the_reference: reference check SKIPPED (no \
             python3 with torch + transformers + safetensors; set TILEARN_PYTHON); the tilearn \
             round trip still runs",
        );
    }
    let script = families_dir().join("make_family_golden.py");
    for &case in FAMILY_CASES {
        let mut model = load(case);
        let g = read_golden(&families_dir().join(case).join("golden.safetensors"));
        let mut acts = Activations::new(&model.config, g.batch, g.seq, false);
        let mut grads = vec![0.0f32; model.params.numel()];
        model
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
        for (p, d) in model.params.data.iter_mut().zip(&grads) {
            *p -= 0.05 * d;
        }
        let dir = tempfile::tempdir().unwrap();
        model.save_pretrained(dir.path(), DType::F32, None).unwrap();

        let written: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.path().join("config.json")).unwrap())
                .unwrap();
        assert_eq!(
            written["architectures"][0],
            model.config.family.architecture(),
            "{case}"
        );
        assert_eq!(written["model_type"], model.config.family.model_type());
        let generation = baichuan_13b_of(&families_dir().join(case));
        let back =
            LlamaForCausalLM::from_pretrained_with_baichuan_13b(dir.path(), generation.as_deref())
                .unwrap();
        assert_eq!(
            back.params.specs, model.params.specs,
            "{case}: tensor names"
        );
        assert!(back.params.data == model.params.data, "{case}: weights");
        assert_eq!(back.config.family, model.config.family);
        assert_eq!(back.config.layer_types, model.config.layer_types);
        assert_eq!(back.config.sliding_window, model.config.sliding_window);
        assert_eq!(back.config.rope_theta, model.config.rope_theta);
        assert_eq!(back.config.z_loss_weight, model.config.z_loss_weight);

        let Some(python) = &python else { continue };
        let logits = model
            .forward_logits(&g.input_ids, g.batch, g.seq, &mut acts)
            .unwrap()
            .to_vec();
        let expect = dir.path().join("expect.safetensors");
        write_expectation(&expect, &g.input_ids, g.batch, g.seq, &logits);
        let mut cmd = Command::new(python);
        match &generation {
            Some(g) => cmd.env(tilearn_engine::config::BAICHUAN_13B_ENV, g),
            None => cmd.env_remove(tilearn_engine::config::BAICHUAN_13B_ENV),
        };
        let out = cmd
            .arg(&script)
            .arg("--check-saved")
            .arg(dir.path())
            .arg("--expect")
            .arg(&expect)
            .output()
            .unwrap();
        report(&format!(
            "{case}: {}{}",
            String::from_utf8_lossy(&out.stdout).trim(),
            String::from_utf8_lossy(&out.stderr)
                .lines()
                .last()
                .unwrap_or("")
        ));
        assert!(out.status.success(), "{case}: the reference disagrees");
    }
}

/// The KV-cache decoder on the families: Baichuan2's NormHead logits (scaled on the host) and
/// Qwen2's biases match the full forward's last position; a sequence longer than Mistral's
/// sliding window is refused, one inside it computes.
#[test]
fn the_cached_decoder_serves_the_families() {
    use tilearn_engine::model::generate::CachedDecoder;
    for case in [
        "baichuan2_7b",
        "baichuan_13b",
        "baichuan2_13b",
        "bloom_tied",
        "qwen2_tied",
        "mistral_sliding",
    ] {
        let model = load(case);
        let g = read_golden(&families_dir().join(case).join("golden.safetensors"));
        let window = model.config.sliding_window.unwrap_or(g.seq);
        let len = window.min(g.seq);
        let ids = &g.input_ids[..len];
        let mut acts = Activations::new(&model.config, 1, len, false);
        let full = model.forward_logits(ids, 1, len, &mut acts).unwrap();
        let vocab = model.config.vocab_size;
        let want = full[(len - 1) * vocab..].to_vec();
        let mut dec = CachedDecoder::new(&model, g.seq);
        dec.forward(&ids[..len - 1]).unwrap();
        let got = dec.forward(&ids[len - 1..]).unwrap().to_vec();
        let err = rel_err(&got, &want);
        report(&format!(
            "cached decoder {case}: last logits rel err {err:.3e}"
        ));
        assert!(err < 1e-5, "{case}: {err:e}");
        if len < g.seq {
            let e = dec
                .forward(&g.input_ids[len..len + 1])
                .unwrap_err()
                .to_string();
            assert!(e.contains("sliding window"), "{case}: {e}");
        }
    }
}
