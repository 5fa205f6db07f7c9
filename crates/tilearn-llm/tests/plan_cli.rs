//! `tilearn plan` end to end: the committed Llama-2-shaped configs (tests/plan/, the README's
//! "Choosing a parallel layout" table) plan on 8 GPUs of 80 and 141 GiB, `--json` is one
//! document whose recommendation fits, bad input ends in one error line naming the fix, and
//! the advisor's ZeRO model-state terms equal what CPU ranks launched with ZeRO-1/2 hold.

mod support;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use tilearn_engine::plan::ShardStage;
use tilearn_engine::plan::memory::model_state;
use tilearn_engine::trainer::zero::CPU_FP32_ADAMW;

const GIB: f64 = (1u64 << 30) as f64;

fn tilearn(args: &[&str]) -> Output {
    Command::new(support::bin("tilearn", env!("CARGO_BIN_EXE_tilearn")))
        .args(args)
        .env_remove("OMP_NUM_THREADS")
        .env_remove("TILEARN_HYBRID_ZERO_STAGE")
        .output()
        .expect("the tilearn binary runs")
}

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/plan")
        .join(name)
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// A failed run with exactly one `error:` line containing every needle, and no panic.
fn assert_clean_error(out: &Output, needles: &[&str]) {
    let err = stderr(out);
    assert_eq!(out.status.code(), Some(1), "stderr: {err}");
    assert!(!err.contains("panicked"), "panicked: {err}");
    let lines: Vec<&str> = err.lines().filter(|l| l.starts_with("error:")).collect();
    assert_eq!(lines.len(), 1, "want one error line: {err}");
    for needle in needles {
        assert!(
            lines[0].contains(needle),
            "error lacks `{needle}`: {}",
            lines[0]
        );
    }
}

fn plan_json(model: &Path, memory: &str, extra: &[&str]) -> serde_json::Value {
    let mut args = vec!["plan", "--model", model.to_str().unwrap()];
    if !extra.contains(&"--gpus") {
        args.extend_from_slice(&["--gpus", "8"]);
    }
    args.extend_from_slice(&["--gpu-memory", memory, "--json"]);
    args.extend_from_slice(extra);
    let out = support::ok(tilearn(&args));
    serde_json::from_str(out.trim())
        .unwrap_or_else(|e| panic!("not one JSON document ({e}): {out}"))
}

/// A layout field of a candidate as text.
fn layout_value(candidate: &serde_json::Value, key: &str) -> String {
    candidate["layout"][key].as_u64().unwrap().to_string()
}

#[test]
fn llama2_7b_and_13b_plans_fit_and_rank_fastest_first() {
    for model in ["llama2-7b.json", "llama2-13b.json"] {
        for memory in ["80GiB", "141GiB"] {
            let plan = plan_json(&fixture(model), memory, &["--seq-len", "4096"]);
            let capacity: f64 = memory.trim_end_matches("GiB").parse::<f64>().unwrap() * GIB;
            let reserved = plan["hardware"]["reserved_bytes"].as_f64().unwrap();
            let rec = &plan["recommended"];
            let total = rec["memory_total"].as_f64().unwrap();
            assert!(rec["fits"].as_bool().unwrap(), "{model} {memory}: {rec}");
            assert!(
                total + reserved <= capacity,
                "{model} {memory}: {total} bytes"
            );
            // The parts add up to the total.
            let parts: f64 = ["weights", "grads", "optimizer", "activations", "workspace"]
                .iter()
                .map(|k| rec["memory"][k].as_f64().unwrap())
                .sum();
            assert!((parts - total).abs() <= 1e-6 * total, "{rec}");
            let layout = &rec["layout"];
            let world = ["tp", "pp", "dp"]
                .iter()
                .map(|k| layout[k].as_u64().unwrap())
                .product::<u64>();
            assert_eq!(world, 8, "{layout}");
            // Ranked fastest first, at most --top (10) listed; the recommendation is one the
            // GPU engine runs, within 2 % of the fastest of those (the simplest of them, see
            // tilearn_engine::plan::search), never faster than the fastest of all.
            let ranked = plan["ranked"].as_array().unwrap();
            assert!(!ranked.is_empty() && ranked.len() <= 10);
            assert!(
                rec["gpu_engine_refuses"].is_null(),
                "{model} {memory}: {rec}"
            );
            // Its train flags carry its micro-batch and accumulation.
            let flags: Vec<&str> = plan["recommended_train_flags"]
                .as_array()
                .unwrap()
                .iter()
                .map(|f| f.as_str().unwrap())
                .collect();
            let after = |flag: &str| flags[flags.iter().position(|f| *f == flag).unwrap() + 1];
            assert_eq!(
                after("--per-device-train-batch-size"),
                layout_value(rec, "micro_batch")
            );
            assert_eq!(
                after("--gradient-accumulation-steps"),
                layout_value(rec, "micro_batches")
            );
            let step = |c: &serde_json::Value| c["cost"]["step_s"].as_f64().unwrap();
            let rec_step = step(rec);
            assert!(
                rec_step >= step(&ranked[0]),
                "{rec_step} vs {}",
                step(&ranked[0])
            );
            if let Some(runs) = ranked.iter().find(|c| c["gpu_engine_refuses"].is_null()) {
                assert!(
                    rec_step <= step(runs) * 1.02,
                    "{rec_step} vs {}",
                    step(runs)
                );
            }
            let steps: Vec<f64> = ranked
                .iter()
                .map(|c| c["cost"]["step_s"].as_f64().unwrap())
                .collect();
            assert!(steps.windows(2).all(|w| w[0] <= w[1]), "{steps:?}");
            let mfu = rec["cost"]["mfu"].as_f64().unwrap();
            assert!(mfu > 0.05 && mfu < 0.8, "{model} {memory}: MFU {mfu}");
        }
    }
}

#[test]
fn a_larger_memory_never_predicts_a_slower_fastest_layout() {
    // Everything that fits 80 GiB fits 141 GiB.
    let model = fixture("llama2-13b.json");
    let small = plan_json(&model, "80GiB", &[]);
    let large = plan_json(&model, "141GiB", &[]);
    let fastest = |p: &serde_json::Value| p["ranked"][0]["cost"]["step_s"].as_f64().unwrap();
    assert!(fastest(&large) <= fastest(&small), "{large} vs {small}");
}

#[test]
fn the_table_names_the_recommendation_and_its_environment() {
    let out = support::ok(tilearn(&[
        "plan",
        "--model",
        fixture("llama2-7b.json").to_str().unwrap(),
        "--gpus",
        "8",
        "--top",
        "3",
    ]));
    assert!(out.contains("| # | TP | PP |"), "{out}");
    // The three fastest, numbered; the recommendation marked (after a "…" row when it is not
    // among them).
    let numbers: Vec<&str> = out
        .lines()
        .filter(|l| l.starts_with("| ") && !l.starts_with("| #") && !l.starts_with("| …"))
        .map(|l| l.split('|').nth(1).unwrap().trim().trim_end_matches(" ◀"))
        .collect();
    assert_eq!(&numbers[..3], ["1", "2", "3"], "{out}");
    assert!(numbers.len() <= 4, "{out}");
    assert_eq!(out.matches('◀').count(), 2, "the legend and one row: {out}");
    // Each row says whether the GPU engine runs it; the recommended one does.
    assert!(out.contains("| MFU | GPU engine |"), "{out}");
    let marked = out
        .lines()
        .find(|l| l.starts_with("| ") && l.contains(" ◀ |"))
        .unwrap();
    assert!(marked.ends_with("| runs |"), "{marked}");
    assert!(out.contains("recommended: TP="), "{out}");
    assert!(out.contains("TILEARN_HYBRID_TP_SIZE="), "{out}");
    // The command that runs it, with the flags of the recommended layout.
    assert!(
        out.contains("tilearn launch --standalone --nproc-per-node 8 train --device cuda")
            && out.contains("--gradient-accumulation-steps"),
        "{out}"
    );
    assert!(out.contains("predictions"), "{out}");
}

#[test]
fn seventy_billion_on_eight_gpus_does_not_fit_and_the_error_says_how_many_would() {
    let out = tilearn(&[
        "plan",
        "--model",
        fixture("llama2-70b.json").to_str().unwrap(),
        "--gpus",
        "8",
        // 16 bytes a parameter (the per-layer weight copy under checkpointing) fit 8 × 141
        // GiB barely; 8 × 120 GiB do not.
        "--gpu-memory",
        "120GiB",
    ]);
    assert_clean_error(
        &out,
        &["no layout", "GPUs would fit", "--gpus", "--gpu-memory"],
    );
    // The same model on 16 GPUs of two nodes plans.
    let plan = plan_json(
        &fixture("llama2-70b.json"),
        "141GiB",
        &["--gpus", "16", "--nnodes", "2"],
    );
    assert!(plan["recommended"]["fits"].as_bool().unwrap());
}

#[test]
fn missing_and_invalid_configs_and_bad_flags_are_named() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("nothing-here");
    let out = tilearn(&["plan", "--model", missing.to_str().unwrap(), "--gpus", "8"]);
    assert_clean_error(&out, &["--model", "config.json", "does not exist"]);

    let bad = dir.path().join("config.json");
    std::fs::write(&bad, r#"{"hidden_size": 64, "num_hidden_layers": 2"#).unwrap();
    let out = tilearn(&[
        "plan",
        "--model",
        dir.path().to_str().unwrap(),
        "--gpus",
        "8",
    ]);
    assert_clean_error(&out, &["config.json", "not valid JSON"]);

    let seven = fixture("llama2-7b.json");
    let seven = seven.to_str().unwrap();
    let out = tilearn(&["plan", "--model", seven, "--gpus", "8", "--nnodes", "3"]);
    assert_clean_error(&out, &["--nnodes", "divides"]);
    let out = tilearn(&[
        "plan",
        "--model",
        seven,
        "--gpus",
        "8",
        "--global-batch-size",
        "3",
        "--micro-batch-size",
        "2",
    ]);
    assert_clean_error(&out, &["--global-batch-size", "multiple of 16"]);
    let out = tilearn(&[
        "plan",
        "--model",
        seven,
        "--gpus",
        "8",
        "--gpu-memory",
        "8GiB",
    ]);
    assert_clean_error(&out, &["no layout", "--gpu-memory"]);
    let out = tilearn(&[
        "plan",
        "--model",
        seven,
        "--gpus",
        "8",
        "--gpu-memory",
        "lots",
    ]);
    assert!(!out.status.success());
    assert!(stderr(&out).contains("141GiB"), "{}", stderr(&out));
}

const TINY: &str = r#"{"architectures": ["LlamaForCausalLM"], "hidden_size": 32,
 "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
 "num_key_value_heads": 1, "vocab_size": 257, "max_position_embeddings": 32,
 "rms_norm_eps": 1e-5, "rope_theta": 10000.0}"#;

/// The numbers of `[rank R] model states on rank R: HELD bytes (…) … (Ψ = P, N = W)`.
fn model_states(stdout: &str, rank: usize) -> (f64, u64, usize) {
    let prefix = format!("[rank {rank}] model states on rank {rank}: ");
    let line = stdout
        .lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .unwrap_or_else(|| panic!("no model-state line for rank {rank}: {stdout}"));
    let number_after = |key: &str| -> String {
        let rest = &line[line.find(key).unwrap() + key.len()..];
        rest.chars().take_while(char::is_ascii_digit).collect()
    };
    let held: f64 = line.split(' ').next().unwrap().parse().unwrap();
    (
        held,
        number_after("(Ψ = ").parse().unwrap(),
        number_after(", N = ").parse().unwrap(),
    )
}

#[test]
fn zero_terms_equal_what_cpu_ranks_hold() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("tiny.json");
    std::fs::write(&config, TINY).unwrap();
    let config = config.to_str().unwrap();
    // A one-step run writes the embedded corpus as token shards for the launched ranks.
    let corpus = dir.path().join("gen");
    support::ok(tilearn(&[
        "train",
        "--config",
        config,
        "--output-dir",
        corpus.to_str().unwrap(),
        "--max-steps",
        "1",
        "--seq-len",
        "32",
        "--device",
        "cpu",
        "--save-strategy",
        "no",
    ]));
    let data = corpus.join("data");
    for (stage, shard) in [("1", ShardStage::Zero1), ("2", ShardStage::Zero2)] {
        let out = dir.path().join(format!("zero{stage}"));
        let stdout = support::ok(tilearn(&[
            "launch",
            "--nproc-per-node",
            "2",
            "--standalone",
            "train",
            "--config",
            config,
            "--data",
            data.to_str().unwrap(),
            "--output-dir",
            out.to_str().unwrap(),
            "--max-steps",
            "1",
            "--per-device-train-batch-size",
            "2",
            "--seq-len",
            "32",
            "--device",
            "cpu",
            "--save-strategy",
            "no",
            "--zero-stage",
            stage,
        ]));
        for rank in 0..2 {
            let (held, psi, n) = model_states(&stdout, rank);
            assert_eq!(n, 2, "{stdout}");
            let predicted: f64 = model_state(CPU_FP32_ADAMW, psi, n, shard).iter().sum();
            // Ψ is even, so every shard is exactly Ψ/N and the prediction is exact.
            assert_eq!(psi % 2, 0);
            assert_eq!(held, predicted, "ZeRO-{stage}, rank {rank}: {stdout}");
        }
    }
}

/// `--schedule` prints the schedule's timeline, one row per stage, and its simulated bubble,
/// which equals the formula: (p−1)/m for 1F1B, divided by the virtual stages when interleaved.
#[test]
fn a_schedules_timeline_and_bubble_are_printed() {
    for (flags, formula) in [
        (
            &[
                "--schedule",
                "1f1b",
                "--pp-size",
                "4",
                "--micro-batches",
                "8",
            ][..],
            3.0 / 8.0,
        ),
        (
            &[
                "--schedule",
                "interleaved",
                "--pp-size",
                "2",
                "--micro-batches",
                "4",
                "--virtual-stages",
                "2",
            ][..],
            1.0 / 8.0,
        ),
    ] {
        let out = tilearn(&[&["plan"][..], flags].concat());
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(out.status.success(), "{text}{}", stderr(&out));
        let line = text
            .lines()
            .find(|l| l.starts_with("bubble fraction: "))
            .unwrap_or_else(|| panic!("no bubble line: {text}"));
        let simulated: f64 = line["bubble fraction: ".len()..]
            .split(' ')
            .next()
            .unwrap()
            .parse()
            .unwrap();
        assert!(text.contains("stage 1 |"), "{text}");
        assert!((simulated - formula).abs() < 1e-4, "{line}");
    }
    // A shape the schedule cannot run is one error line naming it.
    let out = tilearn(&[
        "plan",
        "--schedule",
        "interleaved",
        "--pp-size",
        "4",
        "--micro-batches",
        "6",
    ]);
    assert_clean_error(&out, &["--schedule"]);
}
