//! `tilearn generate` end to end: a model saved by a short `tilearn train --device cpu` run
//! continues a prompt (text through the run's tokenizer, or raw ids), a seed reproduces sampled
//! output, and bad input ends in one `error:` line naming the flag or file. The training run
//! ends with samples (or not, with `--no-samples`) and saves a `generation_config.json`, whose
//! values `generate` takes as defaults under its flags, and which fine-tuning keeps.

mod support;

use std::path::Path;
use std::process::{Command, Output};

use support::ok;

fn tilearn(args: &[&str]) -> Output {
    Command::new(support::bin("tilearn", env!("CARGO_BIN_EXE_tilearn")))
        .args(args)
        .output()
        .expect("the tilearn binary runs")
}

fn read_json(path: &Path) -> serde_json::Value {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap()
}

fn path_str(p: &Path) -> &str {
    p.to_str().expect("temp paths are UTF-8")
}

/// Asserts a failed run with exit status 1 and one `error:` line holding every needle.
fn assert_clean_error(out: &Output, needles: &[&str]) {
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "stderr: {err}");
    assert!(!err.contains("panicked"), "panicked: {err}");
    let lines: Vec<&str> = err.lines().filter(|l| l.starts_with("error:")).collect();
    assert_eq!(lines.len(), 1, "want one error line, got: {err}");
    for needle in needles {
        assert!(
            lines[0].contains(needle),
            "error lacks `{needle}`: {}",
            lines[0]
        );
    }
}

#[test]
fn generate_from_a_trained_model() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    let trained = ok(tilearn(&[
        "train",
        "--output-dir",
        path_str(&run),
        "--max-steps",
        "3",
        "--per-device-train-batch-size",
        "2",
        "--seq-len",
        "32",
        "--device",
        "cpu",
    ]));
    // The run ends with two greedy samples prompted from its own data, generated on the CPU.
    let samples: Vec<&str> = trained
        .lines()
        .skip_while(|l| !l.starts_with("samples (greedy"))
        .collect();
    assert!(samples[0].contains("on the CPU"), "{trained}");
    assert!(samples.len() >= 3, "{trained}");
    assert!(samples[1].starts_with("  [1] \"") && samples[1].contains(" -> "));
    assert!(samples[2].starts_with("  [2] \""), "{trained}");
    // transformers' generation_config.json, from config.json's special ids.
    let generation = read_json(&run.join("generation_config.json"));
    assert_eq!(generation["eos_token_id"], 256, "{generation}");
    // The run keeps the embedded corpus's byte-level tokenizer beside its data.
    let tokenizer = run.join("data").join("tokenizer.json");
    let model = path_str(&run);
    let text_args = |extra: &[&str]| -> Vec<String> {
        let mut a: Vec<String> = [
            "generate",
            "--model",
            model,
            "--tokenizer",
            path_str(&tokenizer),
            "--prompt",
            "The cat",
            "--max-new-tokens",
            "12",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        a.extend(extra.iter().map(|s| s.to_string()));
        a
    };
    let run_text = |extra: &[&str]| -> Output {
        let args = text_args(extra);
        tilearn(&args.iter().map(String::as_str).collect::<Vec<_>>())
    };

    let sampled = |seed: &str| {
        run_text(&[
            "--do-sample",
            "--temperature",
            "1.2",
            "--top-p",
            "0.95",
            "--seed",
            seed,
        ])
    };
    let first = sampled("7");
    let stderr = String::from_utf8_lossy(&first.stderr).into_owned();
    let text = ok(first);
    assert!(stderr.contains("tokens/s"), "{stderr}");
    assert!(stderr.contains("KV cache"), "{stderr}");
    assert_eq!(
        text,
        ok(sampled("7")),
        "the same seed must give the same text"
    );
    // A 3-step model is close to uniform over 257 bytes: two seeds agreeing on 12 draws would
    // be a sampler ignoring its seed.
    assert_ne!(text, ok(sampled("8")));

    // Greedy twice gives the same text; temperature 0 with --do-sample is greedy as well.
    let greedy = ok(run_text(&[]));
    assert_eq!(greedy, ok(run_text(&["--do-sample", "--temperature", "0"])));
    // Without --do-sample the sampling flags are ignored with a note, as transformers warns.
    let ignored = run_text(&["--temperature", "0.5"]);
    let note = String::from_utf8_lossy(&ignored.stderr).into_owned();
    assert!(note.contains("apply only when sampling"), "{note}");
    assert_eq!(greedy, ok(ignored));

    // Raw ids need no tokenizer and print ids.
    let ids = ok(tilearn(&[
        "generate",
        "--model",
        model,
        "--prompt-ids",
        "84,104,101",
        "--max-new-tokens",
        "5",
    ]));
    let ids: Vec<u32> = ids
        .trim()
        .split(',')
        .map(|s| s.parse().expect("comma-separated ids"))
        .collect();
    assert!(!ids.is_empty() && ids.len() <= 5, "{ids:?}");
    assert!(ids.iter().all(|&t| t < 257), "{ids:?}");

    // Errors: the model dir has no tokenizer.json of its own; bad flag values; a missing model.
    let missing_tok = run.join("tokenizer.json");
    let out = tilearn(&["generate", "--model", model, "--prompt", "hi"]);
    assert_clean_error(&out, &["--tokenizer", path_str(&missing_tok), "not found"]);
    for (flag, value) in [
        ("--top-p", "1.5"),
        ("--top-p", "0"),
        ("--temperature", "-0.5"),
    ] {
        let out = run_text(&[&format!("{flag}={value}")]);
        assert_clean_error(&out, &[flag, value]);
    }
    let out = tilearn(&[
        "generate",
        "--model",
        path_str(&dir.path().join("nowhere")),
        "--prompt-ids",
        "1",
    ]);
    assert_clean_error(&out, &["--model", "config.json"]);
    let out = tilearn(&["generate", "--model", model, "--prompt-ids", "999"]);
    assert_clean_error(&out, &["--prompt-ids", "999"]);
}

#[test]
fn generation_config_gives_the_defaults_flags_override_and_fine_tuning_keeps_it() {
    let dir = tempfile::tempdir().unwrap();
    let base = dir.path().join("base");
    let quick_train = |out: &Path, extra: &[&str]| {
        let mut args = vec![
            "train",
            "--output-dir",
            path_str(out),
            "--max-steps",
            "1",
            "--per-device-train-batch-size",
            "2",
            "--seq-len",
            "32",
            "--device",
            "cpu",
            "--no-samples",
        ];
        args.extend_from_slice(extra);
        ok(tilearn(&args))
    };
    let stdout = quick_train(&base, &[]);
    assert!(
        !stdout.contains("samples (greedy"),
        "--no-samples: {stdout}"
    );
    // A source model with generation defaults of its own (and a key we do not interpret).
    let source_generation = serde_json::json!({
        "do_sample": true, "temperature": 0.7, "top_p": 0.9, "max_new_tokens": 5,
        "eos_token_id": [256], "bos_token_id": 84, "repetition_penalty": 1.1,
    });
    std::fs::write(
        base.join("generation_config.json"),
        source_generation.to_string(),
    )
    .unwrap();
    let generate = |extra: &[&str]| -> Output {
        let mut args = vec![
            "generate",
            "--model",
            path_str(&base),
            "--prompt-ids",
            "84,104,101",
        ];
        args.extend_from_slice(extra);
        tilearn(&args)
    };
    // The file's defaults: sampling at temperature 0.7, top-p 0.9, at most 5 tokens.
    let out = generate(&[]);
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(
        err.contains("sampling: temperature 0.7") && err.contains("top-p 0.9"),
        "{err}"
    );
    let ids = ok(out);
    assert!(ids.trim().split(',').count() <= 5, "{ids}");
    // Flags win: greedy with --do-sample false, and a longer length.
    let out = generate(&["--do-sample", "false", "--max-new-tokens", "7"]);
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(err.contains("greedy"), "{err}");
    ok(out);
    // Fine-tuning the model writes the source's generation_config.json back, whole.
    let tuned = dir.path().join("tuned");
    quick_train(
        &tuned,
        &[
            "--model",
            path_str(&base),
            "--data",
            path_str(&base.join("data")),
        ],
    );
    let mut written = read_json(&tuned.join("generation_config.json"));
    written
        .as_object_mut()
        .unwrap()
        .remove("transformers_version");
    let mut want = source_generation.clone();
    want["eos_token_id"] = 256.into(); // a one-element list is written as the id itself
    assert_eq!(written, want);
}
