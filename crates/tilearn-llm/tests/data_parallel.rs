//! Data parallelism and ZeRO through the real launcher on the CPU (host communicator on
//! loopback): N ranks with per-device batch b and accumulation A train exactly the windows of one
//! process with batch b and accumulation N·A (the loader gives rank r the r-th run of b windows
//! of every global batch), so after the same steps their weights agree.
//!
//! Tolerance: |Δw| ≤ 1e-5 everywhere (one step moves a weight by up to lr = 1e-2). The ranks'
//! gradients are summed by the ring all-reduce (or reduce-scatter) while one process adds its
//! micro-batches inside the backward, so the f32 sums round differently (~1e-7 relative), and
//! AdamW's m/√v enlarges that for elements whose gradient is near zero. Observed: 6e-8 for 2
//! ranks, about 1e-6 for 4 ranks with accumulation. A resume on the same world size repeats the
//! uninterrupted run bit for bit.

mod support;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use support::{SPLIT_TOLERANCE, assert_logs_agree, max_abs_diff, ok, train_log};
use tilearn_llm::engine::trainer::tensorboard::{event_files, read_scalars};

fn weights(dir: &str) -> Vec<f32> {
    support::weights(Path::new(dir))
}

fn tilearn(args: &[&str]) -> Output {
    Command::new(support::bin("tilearn", env!("CARGO_BIN_EXE_tilearn")))
        .args(args)
        .env_remove("OMP_NUM_THREADS")
        .env_remove("TILEARN_HYBRID_ZERO_STAGE")
        .output()
        .expect("run tilearn")
}

const TINY: &str = r#"{"architectures": ["LlamaForCausalLM"], "hidden_size": 32,
 "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
 "num_key_value_heads": 1, "vocab_size": 257, "max_position_embeddings": 32,
 "rms_norm_eps": 1e-5, "rope_theta": 10000.0}"#;

/// A scratch directory with the tiny config and the embedded corpus (generated once by a
/// one-step run).
struct Setup {
    dir: tempfile::TempDir,
}

impl Setup {
    fn new() -> Setup {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("tiny.json"), TINY).unwrap();
        let setup = Setup { dir };
        let gen_dir = setup.path("gen");
        ok(tilearn(&[
            "train",
            "--config",
            &setup.path("tiny.json"),
            "--output-dir",
            &gen_dir,
            "--max-steps",
            "1",
            "--seq-len",
            "32",
            "--device",
            "cpu",
            "--save-strategy",
            "no",
        ]));
        setup
    }

    fn path(&self, name: &str) -> String {
        self.dir.path().join(name).to_str().unwrap().to_string()
    }

    /// `tilearn train` (alone, or under `tilearn launch` with `ranks` > 0) with the tiny model
    /// and `extra` flags, writing to `out`.
    fn command(&self, ranks: usize, out: &str, extra: &[&str]) -> Command {
        self.launch(ranks, &[], out, extra)
    }

    /// [`Setup::command`] with more `tilearn launch` flags.
    fn launch(&self, ranks: usize, launch: &[&str], out: &str, extra: &[&str]) -> Command {
        let ranks = ranks.to_string();
        let mut launcher = vec!["launch", "--nproc-per-node", &ranks, "--standalone"];
        launcher.extend(launch);
        self.under(if ranks == "0" { &[] } else { &launcher }, out, extra)
    }

    /// The tiny model's `tilearn train` after `launcher` (`launch` and its flags, or nothing).
    fn under(&self, launcher: &[&str], out: &str, extra: &[&str]) -> Command {
        let (config, data) = (self.path("tiny.json"), self.path("gen/data"));
        let mut cmd = Command::new(support::bin("tilearn", env!("CARGO_BIN_EXE_tilearn")));
        cmd.env_remove("OMP_NUM_THREADS")
            .env_remove("TILEARN_HYBRID_ZERO_STAGE")
            .env_remove("TILEARN_HYBRID_TP_SIZE")
            .env_remove("TILEARN_HYBRID_PP_SIZE");
        cmd.args(launcher);
        cmd.args([
            "train",
            "--config",
            &config,
            "--data",
            &data,
            "--output-dir",
            out,
            "--per-device-train-batch-size",
            "2",
            "--seq-len",
            "32",
            "--logging-steps",
            "1",
            "--device",
            "cpu",
            "--learning-rate",
            "1e-2",
            "--warmup-steps",
            "0",
        ]);
        cmd.args(extra);
        cmd
    }

    /// [`Setup::command`], run to success; its stdout.
    fn train(&self, ranks: usize, out: &str, extra: &[&str]) -> String {
        ok(self.command(ranks, out, extra).output().unwrap())
    }
}

const TOLERANCE: f32 = 1e-5;

fn log(dir: &str) -> Vec<serde_json::Value> {
    train_log(Path::new(dir))
}

fn losses(dir: &str) -> Vec<f64> {
    log(dir)
        .iter()
        .map(|r| r["loss"].as_f64().unwrap())
        .collect()
}

const NO_SAVES: &[&str] = &["--max-steps", "4", "--save-strategy", "no"];

fn with<'a>(base: &[&'a str], more: &[&'a str]) -> Vec<&'a str> {
    base.iter().chain(more).copied().collect()
}

/// Buckets of 8 KiB (18 of them for the tiny model's 140 kB of gradients) give the same
/// weights as one bucket, bit for bit: with two ranks each element is one f32 addition either
/// way.
#[test]
fn small_buckets_reduce_the_same_sums() {
    let s = Setup::new();
    let (one_bucket, many) = (s.path("one_bucket"), s.path("many"));
    s.train(2, &one_bucket, NO_SAVES);
    let stdout = s.train(
        2,
        &many,
        &with(NO_SAVES, &["--ddp-bucket-cap-mb", "0.0078125"]),
    );
    assert!(stdout.contains("18 buckets"), "{stdout}");
    assert_eq!(weights(&one_bucket), weights(&many));
}

#[test]
fn two_and_four_ranks_equal_one_process() {
    let s = Setup::new();
    for (ranks, accum, one_accum) in [(2, "1", "2"), (4, "2", "8")] {
        let (one, dp) = (
            s.path(&format!("one{ranks}")),
            s.path(&format!("dp{ranks}")),
        );
        s.train(
            0,
            &one,
            &with(NO_SAVES, &["--gradient-accumulation-steps", one_accum]),
        );
        let stdout = s.train(
            ranks,
            &dp,
            &with(NO_SAVES, &["--gradient-accumulation-steps", accum]),
        );
        let diff = max_abs_diff(&weights(&one), &weights(&dp));
        assert!(diff <= TOLERANCE, "{ranks} ranks: max |Δw| = {diff}");
        // The logged loss is the global mean; the log records the world size.
        for (a, b) in losses(&one).iter().zip(losses(&dp)) {
            assert!((a - b).abs() < 1e-5, "loss {a} vs {b}");
        }
        let records = log(&dp);
        assert_eq!(records.len(), 4);
        assert!(records.iter().all(|r| r["world_size"] == ranks));
        // Only rank 0 shows progress.
        assert!(stdout.contains("[rank 0] step      4"), "{stdout}");
        assert!(
            !stdout
                .lines()
                .any(|l| l.contains(" step ") && !l.starts_with("[rank 0]")),
            "{stdout}"
        );
    }
}

/// Two launchers on this host as the two nodes of one job (`--nnodes 2`, node ranks 0 and 1,
/// node 0's store on a free loopback port), two ranks each: the four data-parallel ranks equal
/// one process with the same global batch, and rank 0 (on node 0) reports the world of four.
#[test]
fn two_nodes_on_one_host_train_as_one_job_of_four_ranks() {
    let s = Setup::new();
    let (one, nodes) = (s.path("one"), s.path("nodes"));
    s.train(
        0,
        &one,
        &with(NO_SAVES, &["--gradient-accumulation-steps", "4"]),
    );
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
        .to_string();
    let node = |rank: &str| {
        let launcher = [
            "launch",
            "--nnodes",
            "2",
            "--node-rank",
            rank,
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            &port,
            "--nproc-per-node",
            "2",
            "--comm-timeout",
            "60",
        ];
        s.under(&launcher, &nodes, NO_SAVES)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap()
    };
    // Node 1 first: its launcher waits for node 0's store.
    let second = node("1");
    let first = node("0");
    let stdout = ok(first.wait_with_output().unwrap());
    ok(second.wait_with_output().unwrap());
    let diff = max_abs_diff(&weights(&one), &weights(&nodes));
    assert!(diff <= TOLERANCE, "two nodes: max |Δw| = {diff}");
    assert!(log(&nodes).iter().all(|r| r["world_size"] == 4));
    assert!(stdout.contains("[rank 0] step      4"), "{stdout}");
}

/// The per-rank model-state line: the bytes held, and the formula's value and Ψ, N.
fn model_states(stdout: &str, rank: usize) -> (u64, f64, f64, f64) {
    let prefix = format!("[rank {rank}] model states on rank {rank}: ");
    let line = stdout
        .lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .unwrap_or_else(|| panic!("no model-state line for rank {rank}: {stdout}"));
    let number_after = |key: &str| -> f64 {
        let rest = &line[line.find(key).unwrap() + key.len()..];
        let end = rest
            .find(|c: char| !c.is_ascii_digit() && c != '.')
            .unwrap_or(rest.len());
        rest[..end].parse().unwrap()
    };
    let held: u64 = line.split(' ').next().unwrap().parse().unwrap();
    (
        held,
        number_after("/N = "),
        number_after("(Ψ = "),
        number_after(", N = "),
    )
}

#[test]
fn zero_1_and_2_equal_one_process_and_follow_the_memory_formulas() {
    let s = Setup::new();
    let one = s.path("one");
    s.train(
        0,
        &one,
        &with(NO_SAVES, &["--gradient-accumulation-steps", "4"]),
    );
    for stage in ["1", "2"] {
        let out = s.path(&format!("zero{stage}"));
        let stdout = s.train(
            2,
            &out,
            &with(
                NO_SAVES,
                &["--gradient-accumulation-steps", "2", "--zero-stage", stage],
            ),
        );
        let diff = max_abs_diff(&weights(&one), &weights(&out));
        assert!(diff <= TOLERANCE, "ZeRO-{stage}: max |Δw| = {diff}");
        for rank in 0..2 {
            let (held, formula, psi, n) = model_states(&stdout, rank);
            // The CPU engine's fp32 AdamW: weights 4, gradients 4, K = 8 bytes per parameter
            // (the paper's mixed-precision 4Ψ + 12Ψ/N and 2Ψ + 14Ψ/N with 4/4/8 in place of
            // 2/2/12; see zero).
            let expected = match stage {
                "1" => 8.0 * psi + 8.0 * psi / n,
                _ => 4.0 * psi + 12.0 * psi / n,
            };
            assert_eq!(formula, expected.round(), "{stdout}");
            assert_eq!(n, 2.0);
            // Ψ is even here, so the shards are exactly Ψ/N and the bytes match the formula.
            assert_eq!(held as f64, expected, "rank {rank}: {stdout}");
        }
    }
}

#[test]
fn zero_stage_comes_from_the_environment_and_bad_values_are_named() {
    let s = Setup::new();
    let out = s.path("env");
    let run = |stage: &str| {
        s.command(2, &out, &["--max-steps", "1", "--save-strategy", "no"])
            .env("TILEARN_HYBRID_ZERO_STAGE", stage)
            .output()
            .unwrap()
    };
    let stdout = ok(run("2"));
    assert!(stdout.contains("ZeRO stage 2"), "{stdout}");
    let bad = run("3");
    let stderr = String::from_utf8_lossy(&bad.stderr);
    assert!(!bad.status.success());
    let errors: Vec<&str> = stderr.lines().filter(|l| l.contains("error")).collect();
    assert_eq!(errors.len(), 1, "one line for the job: {stderr}");
    assert!(
        errors[0].contains("TILEARN_HYBRID_ZERO_STAGE") && errors[0].contains("`3`"),
        "{stderr}"
    );
}

/// `--ddp-comm-dtype bf16` rounds each rank's gradient to bf16 before the sum (accumulated in
/// f32, rounded once). Effect on the loss: after 4 steps the logged losses stay within 0.01
/// (0.2 %) of the f32 all-reduce's, while the weights do differ (by up to about one step's lr for
/// elements whose tiny gradients change sign under the rounding).
#[test]
fn bf16_compression_changes_the_loss_by_less_than_a_hundredth() {
    let s = Setup::new();
    let (f32_dir, bf16_dir) = (s.path("f32"), s.path("bf16"));
    s.train(2, &f32_dir, NO_SAVES);
    let stdout = s.train(2, &bf16_dir, &with(NO_SAVES, &["--ddp-comm-dtype", "bf16"]));
    assert!(stdout.contains("gradients sent in bf16"), "{stdout}");
    let diff = max_abs_diff(&weights(&f32_dir), &weights(&bf16_dir));
    assert!(
        diff > 1e-6,
        "bf16 compression had no effect (max |Δw| = {diff})"
    );
    for (a, b) in losses(&f32_dir).iter().zip(losses(&bf16_dir)) {
        assert!((a - b).abs() < 0.01, "loss {a} (f32) vs {b} (bf16)");
    }
}

/// A 2-rank ZeRO-1 checkpoint (after step 2 of 4) resumes on 2 ranks bit for bit and on 1 rank
/// (accumulation 2: the same global batch) within the tolerance, re-sharding the optimizer
/// state from the two shard files.
#[test]
fn a_two_rank_checkpoint_resumes_on_two_and_on_one_rank() {
    let s = Setup::new();
    let full = s.path("full");
    let saves = ["--max-steps", "4", "--save-steps", "2", "--zero-stage", "1"];
    s.train(2, &full, &saves);
    let ckpt = PathBuf::from(&full).join("checkpoint-2");
    for file in [
        "optimizer_shards.json",
        "optimizer-rank00000-of-00002.safetensors",
        "optimizer-rank00001-of-00002.safetensors",
        "model.safetensors",
    ] {
        assert!(ckpt.join(file).exists(), "{file} missing");
    }
    assert!(!ckpt.join("optimizer.safetensors").exists());
    let ckpt = ckpt.to_str().unwrap().to_string();

    // Resume on 2 ranks, into a copy of the run's directory.
    let two = s.path("two");
    let resume = ["--resume-from-checkpoint", ckpt.as_str()];
    s.train(2, &two, &with(&saves, &resume));
    assert_eq!(weights(&full), weights(&two), "a same-size resume is exact");

    // Resume alone with accumulation 2 (the same global batch).
    let one = s.path("one");
    let stdout = s.train(
        0,
        &one,
        &with(
            &["--max-steps", "4", "--save-strategy", "no"],
            &[
                "--gradient-accumulation-steps",
                "2",
                "--resume-from-checkpoint",
                &ckpt,
            ],
        ),
    );
    assert!(stdout.contains("step      3"), "{stdout}");
    let diff = max_abs_diff(&weights(&full), &weights(&one));
    assert!(diff <= TOLERANCE, "resumed alone: max |Δw| = {diff}");
    // ... and a plain-DP checkpoint (one optimizer.safetensors) resumes under ZeRO-2 on 2 ranks.
    let plain = s.path("plain");
    s.train(2, &plain, &["--max-steps", "4", "--save-steps", "2"]);
    let plain_ckpt = format!("{plain}/checkpoint-2");
    assert!(
        Path::new(&plain_ckpt)
            .join("optimizer.safetensors")
            .exists()
    );
    let resharded = s.path("resharded");
    s.train(
        2,
        &resharded,
        &[
            "--max-steps",
            "4",
            "--save-strategy",
            "no",
            "--zero-stage",
            "2",
            "--resume-from-checkpoint",
            &plain_ckpt,
        ],
    );
    let diff = max_abs_diff(&weights(&plain), &weights(&resharded));
    assert!(diff <= TOLERANCE, "plain → ZeRO-2: max |Δw| = {diff}");
}

/// `tilearn launch --max-restarts 1`: both ranks fail after step 3 in the first attempt; the
/// restarted group resumes from `checkpoint-2` by itself and ends with the uninterrupted run's
/// weights, bit for bit, and its log.
#[test]
fn a_restarted_group_resumes_from_the_last_checkpoint() {
    let s = Setup::new();
    let saves = ["--max-steps", "4", "--save-steps", "2", "--zero-stage", "1"];
    let full = s.path("full");
    s.train(2, &full, &saves);
    let restarted = s.path("restarted");
    let out = s
        .launch(
            2,
            &["--max-restarts", "1"],
            &restarted,
            &with(&saves, &["--debug-fail-after-step", "3"]),
        )
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    let stdout = ok(out);
    assert!(stderr.contains("restarting the group"), "{stderr}");
    assert!(
        stderr.contains("failing on purpose after step 3"),
        "{stderr}"
    );
    assert!(stdout.contains("resuming from"), "{stdout}");
    assert_eq!(weights(&full), weights(&restarted));
    let steps: Vec<u64> = log(&restarted)
        .iter()
        .map(|r| r["step"].as_u64().unwrap())
        .collect();
    assert_eq!(steps, [1, 2, 3, 4]);
}

/// Evaluation with two ranks: each evaluates its half of every global eval batch and the sums
/// are combined, so the logged eval_loss equals one process (accumulating the same global batch)
/// evaluating the same windows: the first 20, in 5 global batches of 2 × 2 or 10 batches of 2.
#[test]
fn two_ranks_evaluate_the_same_eval_loss_as_one_process() {
    let s = Setup::new();
    let (one, dp) = (s.path("eval_one"), s.path("eval_dp"));
    let eval_data = s.path("gen/data");
    let eval = |batches: &'static str, accum: &'static str| -> Vec<&str> {
        let flags = [
            "--eval-data",
            &eval_data,
            "--eval-steps",
            "2",
            "--max-eval-batches",
            batches,
            "--gradient-accumulation-steps",
            accum,
        ];
        with(NO_SAVES, &flags)
    };
    s.train(0, &one, &eval("10", "2"));
    // Only rank 0 reports to TensorBoard: one event file although both ranks share the dir.
    let tb = s.path("eval_dp_tb");
    let report = ["--report-to", "tensorboard", "--logging-dir", &tb];
    s.train(2, &dp, &with(&eval("5", "1"), &report));
    let eval_losses = |dir: &str| -> Vec<(u64, f64, u64)> {
        log(dir)
            .iter()
            .filter(|r| r.get("eval_loss").is_some())
            .map(|r| {
                let field = |k: &str| r[k].as_f64().unwrap();
                (
                    field("step") as u64,
                    field("eval_loss"),
                    field("eval_tokens") as u64,
                )
            })
            .collect()
    };
    let (a, b) = (eval_losses(&one), eval_losses(&dp));
    assert_eq!(a.iter().map(|e| e.0).collect::<Vec<_>>(), [2, 4], "{a:?}");
    assert_eq!(a.len(), b.len(), "{a:?} vs {b:?}");
    for (x, y) in a.iter().zip(&b) {
        assert_eq!((x.0, x.2), (y.0, y.2), "same steps and targets");
        assert_eq!(x.2, 20 * 31, "20 windows of 31 targets");
        assert!((x.1 - y.1).abs() < 1e-5, "eval_loss {} vs {}", x.1, y.1);
    }
    let files = event_files(Path::new(&tb)).unwrap();
    assert_eq!(files.len(), 1, "{files:?}");
    let eval_steps: Vec<(u64, f32)> = read_scalars(&files[0])
        .unwrap()
        .into_iter()
        .filter(|s| s.tag == "eval/loss")
        .map(|s| (s.step, s.value))
        .collect();
    let logged: Vec<(u64, f32)> = b.iter().map(|e| (e.0, e.1 as f32)).collect();
    assert_eq!(eval_steps, logged, "the events hold the log's eval losses");
}

/// Tensor and pipeline parallelism through the real launcher, every (tp, pp, dp) in {1, 2}³ that
/// splits the model: tp 2 alone, tp 2 × dp 2 with ZeRO-1 inside the data-parallel groups, pp 2
/// (1F1B, 3 micro-batches), tp 2 × pp 2 (GPipe), pp 2 × dp 2 with ZeRO-2 and tp 2 × pp 2 × dp 2
/// with ZeRO-1 (8 processes), against one process with the same global batch. The tiny model has one kv head, so
/// tp 2 replicates it, its vocabulary of 257 splits 129 + 128, and its two layers make one per
/// stage.
///
/// The split reorders many more f32 sums than data parallelism does (the row-parallel products,
/// the sums of exponentials per vocabulary slice), so the gradients differ by ~1e-7 relative (the
/// engine's `tensor_parallel` test checks them tensor by tensor). AdamW's update
/// `m / (√v + 1e-8)` turns that into up to ~5e-5 on the few weights whose gradients are near
/// 1e-8 (observed 4.7e-5, in an up_proj, after 4 steps at lr 1e-2), hence `support::SPLIT_TOLERANCE`; the
/// logged loss and gradient norm (the norm counts replicated tensors once) must agree to 2e-4
/// relative at every step; a wrong slice or a missed reduction moves weights by ~lr and the
/// norm by far more. Observed drift of the norm from one process: pp 2 none (bit-identical),
/// tp 2 with 2 micro-batches 2e-8, plain dp 2 1.6e-6 (third step), tp 2 × dp 2 with 2
/// micro-batches 1.2e-5 then 6.5e-5 (second, third step; tp 2 × dp 2 × pp 2 logs exactly what
/// tp 2 × dp 2 does, pp 2 × dp 2 exactly what dp 2 does). Its cause, found by comparing the
/// weights after one step: a single o_proj weight whose gradient is near AdamW's ε moved 1.9e-4
/// differently (every other weight within 7e-6), and the next steps carry that on.
#[test]
fn tensor_and_pipeline_parallel_with_data_parallel_and_zero_equal_one_process() {
    let s = Setup::new();
    for (ranks, extra, one_accum, layout) in [
        (2, &["--tp-size", "2"][..], "1", "tp 2 × dp 1 × pp 1"),
        (
            4,
            &["--tp-size", "2", "--zero-stage", "1"][..],
            "2",
            "tp 2 × dp 2 × pp 1",
        ),
        (
            2,
            &["--pp-size", "2", "--gradient-accumulation-steps", "3"][..],
            "3",
            "tp 1 × dp 1 × pp 2",
        ),
        (
            4,
            &[
                "--tp-size",
                "2",
                "--pp-size",
                "2",
                "--pp-schedule",
                "gpipe",
                "--gradient-accumulation-steps",
                "2",
            ][..],
            "2",
            "tp 2 × dp 1 × pp 2",
        ),
        (
            4,
            &[
                "--pp-size",
                "2",
                "--zero-stage",
                "2",
                "--gradient-accumulation-steps",
                "2",
            ][..],
            "4",
            "tp 1 × dp 2 × pp 2",
        ),
        (
            8,
            &[
                "--tp-size",
                "2",
                "--pp-size",
                "2",
                "--zero-stage",
                "1",
                "--gradient-accumulation-steps",
                "2",
            ][..],
            "4",
            "tp 2 × dp 2 × pp 2",
        ),
    ] {
        let tag = layout.replace(' ', "");
        let (one, split) = (s.path(&format!("one{tag}")), s.path(&format!("split{tag}")));
        s.train(
            0,
            &one,
            &with(NO_SAVES, &["--gradient-accumulation-steps", one_accum]),
        );
        let stdout = s.train(ranks, &split, &with(NO_SAVES, extra));
        assert!(
            stdout.contains(&format!("hybrid parallel: {layout}")),
            "{stdout}"
        );
        let diff = max_abs_diff(&weights(&one), &weights(&split));
        assert!(diff <= SPLIT_TOLERANCE, "{ranks} ranks: max |Δw| = {diff}");
        assert_logs_agree(Path::new(&one), Path::new(&split), 2e-4);
    }
}

/// The model a tp 2 run saves (gathered into plain Hugging Face files) starts a pp 2 run, which
/// then trains as one process started from the same files does: a layout's model loads into
/// another layout.
#[test]
fn a_tensor_parallel_runs_model_starts_a_pipeline_parallel_run() {
    let s = Setup::new();
    let tp = s.path("tp_model");
    s.train(2, &tp, &with(NO_SAVES, &["--tp-size", "2"]));
    let continue_from = |ranks: usize, out: &str, extra: &[&str]| {
        // `--model` instead of `--config`: the saved files, not a random init.
        let mut args: Vec<&str> = vec![
            "--model",
            &tp,
            "--max-steps",
            "2",
            "--save-strategy",
            "no",
            "--gradient-accumulation-steps",
            "2",
        ];
        args.extend_from_slice(extra);
        let cmd = s.command(ranks, out, &args);
        let argv: Vec<String> = cmd
            .get_args()
            .map(|a| a.to_string_lossy().into_owned())
            .collect();
        // Drop the setup's `--config tiny.json`.
        let at = argv.iter().position(|a| a == "--config").unwrap();
        let mut fresh = Command::new(cmd.get_program());
        fresh
            .args(argv[..at].iter().chain(&argv[at + 2..]))
            .env_remove("OMP_NUM_THREADS")
            .env_remove("TILEARN_HYBRID_ZERO_STAGE")
            .env_remove("TILEARN_HYBRID_TP_SIZE")
            .env_remove("TILEARN_HYBRID_PP_SIZE");
        ok(fresh.output().unwrap())
    };
    let (one, pp) = (s.path("one_from_tp"), s.path("pp_from_tp"));
    continue_from(0, &one, &[]);
    let stdout = continue_from(2, &pp, &["--pp-size", "2"]);
    assert!(stdout.contains("tp 1 × dp 1 × pp 2"), "{stdout}");
    let diff = max_abs_diff(&weights(&one), &weights(&pp));
    assert!(diff <= SPLIT_TOLERANCE, "max |Δw| = {diff}");
    assert_ne!(weights(&tp), weights(&pp), "the pp run trained");
}

#[test]
fn tensor_parallel_size_comes_from_the_environment_and_bad_layouts_are_named() {
    let s = Setup::new();
    let out = s.path("env");
    let stdout = ok(s
        .command(2, &out, &["--max-steps", "1", "--save-strategy", "no"])
        .env("TILEARN_HYBRID_TP_SIZE", "2")
        .output()
        .unwrap());
    assert!(stdout.contains("hybrid parallel: tp 2 × dp 1"), "{stdout}");
    let refused = |ranks: usize, extra: &[&str], env: Option<&str>, expected: &str| {
        let mut cmd = s.command(ranks, &s.path("refused"), extra);
        if let Some(value) = env {
            cmd.env("TILEARN_HYBRID_TP_SIZE", value);
        }
        let output = cmd.output().unwrap();
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
        assert!(!output.status.success(), "{text}");
        assert!(text.contains(expected), "expected `{expected}` in: {text}");
    };
    refused(
        2,
        &["--tp-size", "3"],
        None,
        "does not divide the 2 launched ranks",
    );
    refused(
        0,
        &["--tp-size", "2"],
        None,
        "does not divide the 1 launched ranks",
    );
    refused(0, &[], Some("two"), "TILEARN_HYBRID_TP_SIZE");
    refused(
        2,
        &["--pp-size", "2", "--pp-schedule", "interleaved"],
        None,
        "need at least as many layers",
    );
    refused(
        2,
        &["--pp-size", "2", "--pp-layers", "1,2"],
        None,
        "--pp-layers",
    );
}

/// `--sequence-parallel` (Megatron-SP) trains as plain tensor parallelism does: the norms and
/// the residual stream of each rank hold its half of the tokens, reduce-scattered and
/// all-gathered instead of all-reduced. With two ranks each reduced element is the same one f32
/// addition either way, and the norms compute row by row, so only the norms' weight gradients
/// (each rank's rows summed, then the two sums added) round differently: |Δw| ≤ 1e-5, losses
/// 1e-5 relative. Without tensor parallelism the flag is refused by name.
#[test]
fn sequence_parallelism_trains_as_tensor_parallelism() {
    let s = Setup::new();
    let (tp, sp) = (s.path("tp"), s.path("sp"));
    s.train(2, &tp, &with(NO_SAVES, &["--tp-size", "2"]));
    let stdout = s.train(
        2,
        &sp,
        &with(NO_SAVES, &["--tp-size", "2", "--sequence-parallel"]),
    );
    assert!(stdout.contains("with sequence parallelism"), "{stdout}");
    let diff = max_abs_diff(&weights(&tp), &weights(&sp));
    assert!(diff <= TOLERANCE, "max |Δw| = {diff}");
    for (a, b) in losses(&tp).iter().zip(losses(&sp)) {
        assert!((a - b).abs() <= 1e-5 * a.abs(), "loss {a} vs {b}");
    }
    let out = s
        .command(
            2,
            &s.path("refused"),
            &with(NO_SAVES, &["--sequence-parallel"]),
        )
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{text}");
    assert!(
        text.contains("--sequence-parallel") && text.contains("--tp-size"),
        "{text}"
    );
}

/// The files of `dir` whose names start with `prefix`.
fn files_starting(dir: &Path, prefix: &str) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(prefix))
        .collect();
    names.sort();
    names
}

/// A `tilearn train` under `tilearn launch` with this many ranks (0: alone) and these flags.
type Launch = (usize, Vec<&'static str>);

/// Checkpoints of split layouts resume. On the same layout exactly: the resumed run logs the
/// uninterrupted run's losses of steps 3 and 4 and ends with its weights, bit for bit (the
/// checkpoint holds the f32 weights and every rank's optimizer slices, read back into the same
/// places). On another layout after re-sharding the optimizer state (each rank reads the parts
/// of the saved slices that overlap its own), with the same global batch: |Δw| ≤ 1e-5 and the
/// losses within 1e-5 relative. The layouts sum the same f32 values in other orders (tensor
/// parallelism's partial products, data parallelism's ranks), which over the two steps after
/// the resume moved no weight by more than 1.2e-7 (observed for every pair below); a resume
/// that lost the optimizer moments moves weights by ~lr/3 = 3e-3.
#[test]
fn split_checkpoints_resume_exactly_on_their_layout_and_on_others_after_resharding() {
    let s = Setup::new();
    let saves = ["--max-steps", "4", "--save-steps", "2"];
    // (ranks, layout flags, optimizer files in the checkpoint, [(ranks, another layout with
    // the same global batch)]): 2 windows a step for tp 2 (with or without sequence
    // parallelism), pp 2 and one process; 4 (2 micro-batches or 2 data-parallel ranks of 2
    // windows) for the others.
    let cases: [(usize, &[&str], usize, Vec<Launch>); 4] = [
        (
            2,
            &["--tp-size", "2"],
            2,
            vec![
                (2, vec!["--pp-size", "2"]),
                (0, vec![]),
                (2, vec!["--tp-size", "2", "--sequence-parallel"]),
            ],
        ),
        (
            2,
            &["--pp-size", "2", "--gradient-accumulation-steps", "2"],
            2,
            vec![(
                2,
                vec!["--tp-size", "2", "--gradient-accumulation-steps", "2"],
            )],
        ),
        (
            4,
            &["--tp-size", "2", "--zero-stage", "1"],
            4,
            vec![(2, vec!["--zero-stage", "1"])],
        ),
        // A plain ZeRO checkpoint (ranges of the whole model) into tensor-parallel slices.
        (
            2,
            &["--zero-stage", "1"],
            2,
            vec![(
                2,
                vec!["--tp-size", "2", "--gradient-accumulation-steps", "2"],
            )],
        ),
    ];
    for (i, (ranks, layout, files, others)) in cases.iter().enumerate() {
        let full = s.path(&format!("full{i}"));
        s.train(*ranks, &full, &with(&saves, layout));
        let ckpt = PathBuf::from(&full).join("checkpoint-2");
        assert_eq!(
            files_starting(&ckpt, "optimizer-rank").len(),
            *files,
            "{layout:?}"
        );
        assert!(ckpt.join("model.safetensors").exists());
        let ckpt = ckpt.to_str().unwrap().to_string();
        let resume = ["--resume-from-checkpoint", ckpt.as_str()];

        let same = s.path(&format!("same{i}"));
        s.train(*ranks, &same, &with(&with(&saves, layout), &resume));
        assert_eq!(
            weights(&full),
            weights(&same),
            "{layout:?}: resumed weights"
        );
        assert_eq!(
            losses(&full)[2..],
            losses(&same),
            "{layout:?}: resumed losses"
        );

        for (j, (other_ranks, other)) in others.iter().enumerate() {
            let moved = s.path(&format!("moved{i}_{j}"));
            let flags = with(&with(NO_SAVES, other), &resume);
            let stdout = s.train(*other_ranks, &moved, &flags);
            assert!(stdout.contains("step      3"), "{stdout}");
            let diff = max_abs_diff(&weights(&full), &weights(&moved));
            assert!(
                diff <= TOLERANCE,
                "{layout:?} → {other:?}: max |Δw| = {diff}"
            );
            for (a, b) in losses(&full)[2..].iter().zip(losses(&moved)) {
                assert!(
                    (a - b).abs() <= 1e-5 * a.abs(),
                    "{layout:?} → {other:?}: loss {a} vs {b}"
                );
            }
        }
    }

    // A checkpoint missing one rank's optimizer file cannot be re-sharded: the error names the
    // file and the way out.
    let broken = s.path("broken");
    std::fs::create_dir(&broken).unwrap();
    let whole = PathBuf::from(s.path("full0")).join("checkpoint-2");
    for name in files_starting(&whole, "") {
        if name != "optimizer-rank00001-of-00002.safetensors" {
            std::fs::copy(whole.join(&name), PathBuf::from(&broken).join(&name)).unwrap();
        }
    }
    let out = s
        .command(
            2,
            &s.path("from_broken"),
            &with(
                NO_SAVES,
                &["--tp-size", "2", "--resume-from-checkpoint", &broken],
            ),
        )
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{text}");
    assert!(
        text.contains("optimizer-rank00001-of-00002.safetensors") && text.contains("--model"),
        "{text}"
    );
}
