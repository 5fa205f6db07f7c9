//! `tilearn prepare-data --format sft` on a small JSON-lines file (prompt/response and chat
//! lines, one bad line), then `tilearn train` a few CPU steps on the result.

mod support;

use std::path::Path;
use std::process::{Command, Output};

fn tilearn(args: &[&str]) -> Output {
    Command::new(support::bin("tilearn", env!("CARGO_BIN_EXE_tilearn")))
        .args(args)
        .output()
        .expect("the tilearn binary runs")
}

fn path_str(p: &Path) -> &str {
    p.to_str().expect("temp paths are UTF-8")
}

/// A short chat template (`<u>question\n<a>answer\n`) so the byte-level tokenizer spells it.
const TOKENIZER_CONFIG: &str = r#"{
  "eos_token": "<|endoftext|>",
  "chat_template": "{% for m in messages %}{{ '<' + m['role'][0] + '>' + m['content'] + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<a>' }}{% endif %}"
}"#;

const CONFIG: &str = r#"{"architectures": ["LlamaForCausalLM"], "hidden_size": 32,
 "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
 "num_key_value_heads": 1, "vocab_size": 257, "max_position_embeddings": 64,
 "rms_norm_eps": 1e-5, "rope_theta": 10000.0}"#;

#[test]
fn prepare_sft_then_train_a_few_cpu_steps() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("model");
    std::fs::create_dir_all(&model).unwrap();
    let tokenizer = model.join("tokenizer.json");
    tilearn_engine::data::byte_level_tokenizer()
        .save(&tokenizer, false)
        .unwrap();
    std::fs::write(model.join("tokenizer_config.json"), TOKENIZER_CONFIG).unwrap();
    let config = dir.path().join("config.json");
    std::fs::write(&config, CONFIG).unwrap();

    let mut lines = Vec::new();
    for i in 0..12 {
        lines.push(format!(
            r#"{{"prompt": "What is {i} plus 1? ", "response": "{}."}}"#,
            i + 1
        ));
        lines.push(format!(
            r#"{{"messages": [{{"role": "user", "content": "Say {i}"}}, {{"role": "assistant", "content": "{i} {}"}}]}}"#,
            "ok ".repeat(i)
        ));
    }
    lines.insert(3, r#"{"prompt": "no response"}"#.to_string());
    let input = dir.path().join("train.jsonl");
    std::fs::write(&input, lines.join("\n")).unwrap();
    let data = dir.path().join("data");
    let prepare = |extra: &[&str]| {
        let mut args = vec![
            "prepare-data",
            "--format",
            "sft",
            "--tokenizer",
            path_str(&tokenizer),
            "--input",
            path_str(&input),
            "--output",
            path_str(&data),
        ];
        args.extend_from_slice(extra);
        tilearn(&args)
    };

    // The bad line stops the run, named by file and line, with the way out.
    let out = prepare(&[]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("train.jsonl") && err.contains("line 4"),
        "{err}"
    );
    assert!(
        err.contains("`response` is missing") && err.contains("--skip-bad-lines"),
        "{err}"
    );

    let stdout = support::ok(prepare(&["--skip-bad-lines"]));
    assert!(stdout.contains("24 examples"), "{stdout}");
    assert!(stdout.contains("skipped 1 bad line(s)"), "{stdout}");
    assert!(stdout.contains("train.jsonl line 4"), "{stdout}");

    // --seq-len 40 cuts the longest chats; training warns with the count and runs.
    let run = dir.path().join("run");
    let out = tilearn(&[
        "train",
        "--config",
        path_str(&config),
        "--data",
        path_str(&data),
        "--output-dir",
        path_str(&run),
        "--max-steps",
        "3",
        "--per-device-train-batch-size",
        "4",
        "--seq-len",
        "40",
        "--logging-steps",
        "1",
        "--save-strategy",
        "no",
        "--device",
        "cpu",
    ]);
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    let stdout = support::ok(out);
    assert!(
        err.contains("examples in") && err.contains("--seq-len 40"),
        "no truncation warning: {err}\n{stdout}"
    );
    let log: Vec<serde_json::Value> = std::fs::read_to_string(run.join("train_log.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(log.len(), 3);
    for record in &log {
        let loss = record["loss"].as_f64().unwrap();
        // Untrained over 257 tokens: about ln 257 = 5.5 per target.
        assert!(loss.is_finite() && loss > 3.0 && loss < 8.0, "{record}");
    }
}

/// `prepare-data --format sft --packing --max-seq-length 48`: the examples are packed into
/// fewer rows than examples, every row holds whole examples within 48 tokens, positions
/// restart per example, and `train` runs a few CPU steps on the packed rows. Without
/// `--max-seq-length` the flag is refused with the fix.
#[test]
fn prepare_sft_with_packing_then_train() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("model");
    std::fs::create_dir_all(&model).unwrap();
    let tokenizer = model.join("tokenizer.json");
    tilearn_engine::data::byte_level_tokenizer()
        .save(&tokenizer, false)
        .unwrap();
    std::fs::write(model.join("tokenizer_config.json"), TOKENIZER_CONFIG).unwrap();
    let config = dir.path().join("config.json");
    std::fs::write(&config, CONFIG).unwrap();
    let lines: Vec<String> = (0..20)
        .map(|i| {
            format!(
                r#"{{"prompt": "Q{i}? ", "response": "{}"}}"#,
                "a".repeat(1 + i % 7)
            )
        })
        .collect();
    let input = dir.path().join("train.jsonl");
    std::fs::write(&input, lines.join("\n")).unwrap();
    let data = dir.path().join("data");
    let base = [
        "prepare-data",
        "--format",
        "sft",
        "--tokenizer",
        path_str(&tokenizer),
        "--input",
        path_str(&input),
        "--output",
        path_str(&data),
        "--packing",
    ];

    let out = tilearn(&base);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_ne!(out.status.code(), Some(0), "{err}");
    assert!(err.contains("--max-seq-length"), "{err}");

    let mut args = base.to_vec();
    args.extend_from_slice(&["--max-seq-length", "48"]);
    let stdout = support::ok(tilearn(&args));
    assert!(
        stdout.contains("20 examples") && stdout.contains("packed into"),
        "{stdout}"
    );

    let ds = tilearn_engine::data::TokenDataset::open(&data).unwrap();
    assert_eq!(ds.layout(), tilearn_engine::data::RowLayout::Packed);
    let rows = ds.num_rows(48);
    assert!(
        rows < 20,
        "{rows} rows for 20 short examples: nothing was packed"
    );
    let (mut ids, mut labels, mut pos) = (vec![0; 48], vec![0; 48], vec![0; 48]);
    let mut starts = 0;
    for r in 0..rows {
        ds.read_row_at(r, &mut ids, &mut labels, Some(&mut pos))
            .unwrap();
        tilearn_ops::check_positions(&pos, 1, 48).unwrap();
        // Every example start (position 0 inside the data, not the padding) has label -100.
        for t in 0..48 {
            if pos[t] == 0 {
                assert_eq!(labels[t], -100, "row {r} token {t}");
                starts += 1;
            }
        }
    }
    // 20 examples, plus one padding run per row that is not full.
    assert!(
        starts >= 20 && starts <= 20 + rows,
        "{starts} segment starts in {rows} rows"
    );

    let run = dir.path().join("run");
    let out = tilearn(&[
        "train",
        "--config",
        path_str(&config),
        "--data",
        path_str(&data),
        "--output-dir",
        path_str(&run),
        "--max-steps",
        "2",
        "--per-device-train-batch-size",
        "2",
        "--seq-len",
        "48",
        "--logging-steps",
        "1",
        "--save-strategy",
        "no",
        "--device",
        "cpu",
    ]);
    support::ok(out);
    let log = std::fs::read_to_string(run.join("train_log.jsonl")).unwrap();
    assert_eq!(log.lines().count(), 2, "{log}");
}
