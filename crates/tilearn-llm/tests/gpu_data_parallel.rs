//! Data parallelism on the GPU engine through the real launcher (feature `cuda`, a CUDA GPU;
//! NCCL for the second test, found as `libnccl.so.2`/`libnccl.so` on the library path or at
//! `TILEARN_NCCL_LIBRARY`).
//!
//! * Two ranks share one GPU over the host communicator (device gradients staged through
//!   page-locked memory) and give the weights of one process with the same global batch.
//!   Tolerance |Δw| ≤ 1e-4 in fp32 (one step moves a weight by up to lr = 1e-2): as on the CPU
//!   the sums of the ranks' gradients round differently from one process's accumulation inside
//!   the backward kernels (~1e-7 relative), enlarged by AdamW for near-zero gradients; the GPU's
//!   reductions add their own ordering.
//! * NCCL with world size 1 through the launcher equals a plain run exactly (the all-reduce of
//!   one rank leaves the gradients as they are), with the all-reduce overlapped with the
//!   backward (the default) and without.
//! * The overlapped all-reduce gives the same weights, bit for bit, as the all-reduce after the
//!   backward (two ranks sharing one GPU; the sum of two values does not depend on the order),
//!   and the log reports how much of it was hidden.
//! * `--ddp-comm-dtype bf16` on the GPU (rounded on the GPU, summed, widened back): the weights
//!   move off the f32 run's (the compression happened), and the final losses agree within 1e-3
//!   (measured on the H200: 4.812412 vs 4.812432). The weights are only bounded by 2 · lr · steps
//!   = 0.08: AdamW moves a weight by up to ~lr per step whatever the gradient's size, so a
//!   near-zero gradient whose sign bf16 rounding flips moves it the other way (measured max
//!   |Δw| 1.02e-2 after 4 steps at lr 1e-2).
//! * Two GPUs over NCCL (skipped, saying so, with fewer than two) equal one process with the
//!   same global batch, within the first test's tolerance.

#![cfg(feature = "cuda")]

mod support;

use std::path::Path;

use support::gpu_runs::{TINY, gpu_present, gpus_present, setup, train, train_in};
use support::{max_abs_diff, weights};

/// The records of a run's training log.
fn log_lines(dir: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(dir.join("train_log.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// Two ranks on this host through the launcher (sharing one GPU over the host communicator).
const TWO_RANKS: [&str; 6] = [
    "launch",
    "--nproc-per-node",
    "2",
    "--standalone",
    "--comm-timeout",
    "120",
];

/// The host communicator with small buckets, so that several run during the backward.
const SMALL_HOST_BUCKETS: [&str; 4] = ["--ddp-backend", "host", "--ddp-bucket-cap-mb", "0.01"];

/// [`TINY`] with 8 layers, for the ZeRO-2 tests: the window holds the largest part and one
/// layer, so only a model of several layers keeps fewer gradient bytes with it than with the
/// whole buffer (with TINY's 2 layers the engine keeps the whole buffer, and says so by naming
/// no window).
fn deep_tiny(dir: &Path) {
    let deep = TINY.replace("\"num_hidden_layers\": 2", "\"num_hidden_layers\": 8");
    assert_ne!(deep, TINY);
    std::fs::write(dir.join("tiny.json"), deep).unwrap();
}

#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn two_ranks_sharing_one_gpu_over_the_host_communicator_equal_one_process() {
    if !gpu_present() {
        return;
    }
    let dir = setup();
    train(
        dir.path(),
        &[],
        "one",
        &["--gradient-accumulation-steps", "2"],
    );
    let stdout = train(dir.path(), &TWO_RANKS, "two", &["--ddp-backend", "host"]);
    assert!(stdout.contains("host backend"), "{stdout}");
    let diff = max_abs_diff(
        &weights(&dir.path().join("one")),
        &weights(&dir.path().join("two")),
    );
    println!("2 ranks on one GPU vs one process: max |Δw| = {diff:e}");
    assert!(diff <= 1e-4, "max |Δw| = {diff}");
}

#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn nccl_with_one_rank_through_the_launcher_equals_a_plain_run() {
    if !gpu_present() {
        return;
    }
    let dir = setup();
    train(dir.path(), &[], "plain", &[]);
    let launch = ["launch", "--nproc-per-node", "1", "--standalone"];
    let stdout = train(dir.path(), &launch, "nccl", &["--ddp-backend", "nccl"]);
    assert!(stdout.contains("nccl backend"), "{stdout}");
    let after = ["--ddp-backend", "nccl", "--no-ddp-overlap"];
    train(dir.path(), &launch, "nccl-after", &after);
    let plain = weights(&dir.path().join("plain"));
    assert_eq!(plain, weights(&dir.path().join("nccl")));
    assert_eq!(plain, weights(&dir.path().join("nccl-after")));
    // ZeRO over NCCL with one rank: the shard is everything, the reduce-scatter (stage 1) and
    // the reduce to the owner during the backward (stage 2, `ncclReduce`) leave the sums as
    // they are, and the clip's global sum of squares is the one the kernel would measure.
    for stage in ["1", "2"] {
        let out = format!("nccl-zero{stage}");
        let flags = ["--ddp-backend", "nccl", "--zero-stage", stage];
        train(dir.path(), &launch, &out, &flags);
        assert_eq!(plain, weights(&dir.path().join(&out)), "ZeRO-{stage}");
    }
    // With one process `--cuda-graphs auto` may capture the whole step (one rank's
    // all-reduce is the identity), which logs no overlap timeline: that is read from a run
    // with graphs off.
    let timeline = ["--ddp-backend", "nccl", "--cuda-graphs", "off"];
    train(dir.path(), &launch, "nccl-timeline", &timeline);
    let logged = log_lines(&dir.path().join("nccl-timeline"));
    assert!(
        logged.iter().all(|r| r["allreduce_hidden"].is_number()),
        "{logged:?}"
    );
}

#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn the_overlapped_all_reduce_equals_the_one_after_the_backward() {
    if !gpu_present() {
        return;
    }
    let dir = setup();
    let host = SMALL_HOST_BUCKETS;
    train(dir.path(), &TWO_RANKS, "overlap", &host);
    train(
        dir.path(),
        &TWO_RANKS,
        "after",
        &[&host[..], &["--no-ddp-overlap"]].concat(),
    );
    assert_eq!(
        weights(&dir.path().join("overlap")),
        weights(&dir.path().join("after"))
    );
    let overlapped = log_lines(&dir.path().join("overlap"));
    let share = overlapped[0]["allreduce_hidden"].as_f64().unwrap();
    println!("host communicator, two ranks on one GPU: {share:.2} of the all-reduce hidden");
    assert!((0.0..=1.0).contains(&share), "{overlapped:?}");
    assert!(log_lines(&dir.path().join("after"))[0]["allreduce_hidden"].is_null());
}

#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn bf16_compressed_gradients_on_the_gpu_stay_close_to_f32() {
    if !gpu_present() {
        return;
    }
    let dir = setup();
    train(dir.path(), &TWO_RANKS, "f32", &SMALL_HOST_BUCKETS);
    let stdout = train(
        dir.path(),
        &TWO_RANKS,
        "bf16",
        &[&SMALL_HOST_BUCKETS[..], &["--ddp-comm-dtype", "bf16"]].concat(),
    );
    assert!(stdout.contains("gradients sent in bf16"), "{stdout}");
    let diff = max_abs_diff(
        &weights(&dir.path().join("f32")),
        &weights(&dir.path().join("bf16")),
    );
    let loss = |run: &str| {
        log_lines(&dir.path().join(run)).last().unwrap()["loss"]
            .as_f64()
            .unwrap()
    };
    let (f32_loss, bf16_loss) = (loss("f32"), loss("bf16"));
    println!("bf16 gradients vs f32: max |Δw| = {diff:e}, final loss {bf16_loss} vs {f32_loss}");
    assert!(diff > 0.0 && diff <= 2.0 * 1e-2 * 4.0, "max |Δw| = {diff}");
    assert!((f32_loss - bf16_loss).abs() < 1e-3);
}

#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn two_gpus_over_nccl_equal_one_process() {
    if !gpus_present(2) {
        return;
    }
    let dir = setup();
    train(
        dir.path(),
        &[],
        "one",
        &["--gradient-accumulation-steps", "2"],
    );
    let launch = ["launch", "--nproc-per-node", "2", "--standalone"];
    let nccl = ["--ddp-backend", "nccl", "--ddp-bucket-cap-mb", "0.01"];
    let stdout = train(dir.path(), &launch, "two", &nccl);
    assert!(stdout.contains("nccl backend"), "{stdout}");
    let diff = max_abs_diff(
        &weights(&dir.path().join("one")),
        &weights(&dir.path().join("two")),
    );
    println!("2 GPUs over NCCL vs one process: max |Δw| = {diff:e}");
    assert!(diff <= 1e-4, "max |Δw| = {diff}");
}

/// The per-rank model-state line: the bytes held and the ZeRO formula's value.
fn model_states(stdout: &str, rank: usize) -> (f64, f64) {
    let prefix = format!("[rank {rank}] model states on rank {rank}: ");
    let line = stdout
        .lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .unwrap_or_else(|| panic!("no model-state line for rank {rank}: {stdout}"));
    let held: f64 = line.split(' ').next().unwrap().parse().unwrap();
    let formula = line
        .split(" = ")
        .find_map(|part| part.strip_suffix(" bytes (Ψ"))
        .unwrap_or_else(|| panic!("no formula in {line}"));
    (held, formula.parse().unwrap())
}

/// ZeRO-2's gradient bytes on the model-state line of `rank`: (all held, the owned shard's,
/// the backward window's, Ψ), `None` when the line names no window.
fn gradient_window(stdout: &str, rank: usize) -> Option<(f64, f64, f64, f64)> {
    let prefix = format!("[rank {rank}] model states on rank {rank}: ");
    let line = stdout.lines().find_map(|l| l.strip_prefix(&prefix))?;
    let number = |after: &str, end: char| -> Option<f64> {
        let rest = &line[line.find(after)? + after.len()..];
        rest[..rest.find(end)?].parse().ok()
    };
    Some((
        number("gradients ", ' ')?,
        number("(owned shard ", ' ')?,
        number("backward window ", ')')?,
        number("(Ψ = ", ',')?,
    ))
}

/// Checks every rank's model-state line against the ZeRO formula: the bytes held equal it up
/// to the `Ψ mod N` tail the last rank owns (fewer than N parameters of at most 16 bytes).
/// Under GPU ZeRO-2 (`windowed`) the rank holds the formula's owned-shard gradients plus the
/// backward's window, and nothing else: held = formula + window, the gradient bytes are the
/// owned shard's (4Ψ/N) plus the window, and together far less than the whole model's 4Ψ.
fn check_model_states(stdout: &str, what: &str, expected_formula: &str, windowed: bool) {
    assert!(stdout.contains(expected_formula), "{what}: {stdout}");
    for rank in 0..2 {
        let (held, formula) = model_states(stdout, rank);
        let window = match gradient_window(stdout, rank) {
            Some((grads, owned, window, psi)) => {
                println!(
                    "{what}, rank {rank}: gradients {grads} bytes = owned {owned} + window \
                     {window} (whole model: {})",
                    4.0 * psi
                );
                assert_eq!(grads, owned + window, "{what} rank {rank}: {stdout}");
                assert!(
                    (owned - 4.0 * psi / 2.0).abs() <= 4.0 * 2.0,
                    "{what} rank {rank}: {stdout}"
                );
                assert!(window > 0.0 && grads < 4.0 * psi, "{what}: {stdout}");
                window
            }
            None => 0.0,
        };
        assert_eq!(window > 0.0, windowed, "{what} rank {rank}: {stdout}");
        println!("{what}, rank {rank}: {held} bytes held, formula {formula}");
        assert!(
            (held - window - formula).abs() <= 16.0 * 2.0,
            "{what} rank {rank}: {stdout}"
        );
    }
}

/// ZeRO-1 and ZeRO-2 on the GPU engine, two ranks sharing one GPU over the host communicator
/// (device buffers staged through page-locked memory), against one process with the same global
/// batch (ZeRO-2 with accumulation, so the owned-shard accumulation runs). fp32: |Δw| ≤ 1e-4,
/// the bound (and reason) of the plain data-parallel test above — the ranks' gradient sums
/// round differently from one process's accumulation inside the kernels, and the clip uses the
/// sum of the shards' sums of squares instead of one whole-buffer sum. In fp32 the master
/// weights are what the forward reads, so they stay whole and only the moments are sharded:
/// the GPU engine reports 4/4/8 bytes per parameter, 8Ψ + 8Ψ/N and 4Ψ + 12Ψ/N. ZeRO-2 keeps
/// only the owned gradients plus the backward's window; with `--no-ddp-overlap` it keeps the
/// whole buffer and reduce-scatters after each micro-batch's backward, which gives the same
/// weights bit for bit (with two ranks every reduced element is the one sum a + b, and the
/// window's owned piece starts from the accumulated gradients as the whole buffer's does).
#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn zero_1_and_2_on_one_gpu_over_the_host_communicator_equal_one_process() {
    if !gpu_present() {
        return;
    }
    let dir = setup();
    deep_tiny(dir.path());
    train(
        dir.path(),
        &[],
        "one",
        &["--gradient-accumulation-steps", "4"],
    );
    let one = weights(&dir.path().join("one"));
    for (stage, formula) in [("1", "8Ψ + 8Ψ/N"), ("2", "4Ψ + 12Ψ/N")] {
        let out = format!("zero{stage}");
        let flags = [
            &SMALL_HOST_BUCKETS[..],
            &["--zero-stage", stage, "--gradient-accumulation-steps", "2"],
        ]
        .concat();
        let stdout = train(dir.path(), &TWO_RANKS, &out, &flags);
        assert!(stdout.contains(&format!("ZeRO stage {stage}")), "{stdout}");
        let what = format!("fp32 ZeRO-{stage}");
        check_model_states(&stdout, &what, formula, stage == "2");
        let diff = max_abs_diff(&one, &weights(&dir.path().join(&out)));
        println!("fp32 ZeRO-{stage}, 2 ranks on one GPU vs one process: max |Δw| = {diff:e}");
        assert!(diff <= 1e-4, "ZeRO-{stage}: max |Δw| = {diff}");
    }
    let whole = [
        &SMALL_HOST_BUCKETS[..],
        &["--zero-stage", "2", "--gradient-accumulation-steps", "2"],
        &["--no-ddp-overlap"],
    ]
    .concat();
    let stdout = train(dir.path(), &TWO_RANKS, "zero2-whole", &whole);
    check_model_states(&stdout, "fp32 ZeRO-2, whole buffer", "4Ψ + 12Ψ/N", false);
    assert_eq!(
        weights(&dir.path().join("zero2")),
        weights(&dir.path().join("zero2-whole")),
        "ZeRO-2 with the gradient window differs from the whole buffer"
    );
}

/// bf16: the fp32 master weights are sharded too (the forward reads only the bf16 working
/// copy, which is all-gathered after each step): the GPU engine's 2/4/12 bytes per parameter
/// (its gradients are fp32, where the paper's are 2 bytes) give 6Ψ + 12Ψ/N and, with the
/// gradients counted as the owned shard, 2Ψ + 16Ψ/N (the paper's 2Ψ + 14Ψ/N). Without clipping
/// (`--max-grad-norm 0`) and without accumulation, ZeRO-1 and ZeRO-2 equal plain data
/// parallelism bit for bit: with two ranks each reduced element is the one sum a + b, the fused
/// AdamW on a shard is the whole-buffer kernel on those elements, and the gathered working copy
/// holds the bits each owner's kernel wrote. Compared on the checkpoints' f32 master weights.
#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn bf16_zero_shards_the_master_weights_and_equals_plain_data_parallel() {
    if !gpu_present() {
        return;
    }
    let dir = setup();
    deep_tiny(dir.path());
    let flags = ["--max-grad-norm", "0", "--save-steps", "4"];
    let plain_flags = [&SMALL_HOST_BUCKETS[..], &flags[..]].concat();
    train_in(dir.path(), &TWO_RANKS, "plain", "--bf16", &plain_flags);
    let plain = weights(&dir.path().join("plain/checkpoint-4"));
    for (stage, formula) in [("1", "6Ψ + 12Ψ/N"), ("2", "2Ψ + 16Ψ/N")] {
        let out = format!("zero{stage}");
        let stdout = train_in(
            dir.path(),
            &TWO_RANKS,
            &out,
            "--bf16",
            &[&plain_flags[..], &["--zero-stage", stage]].concat(),
        );
        check_model_states(
            &stdout,
            &format!("bf16 ZeRO-{stage}"),
            formula,
            stage == "2",
        );
        let ckpt = dir.path().join(&out).join("checkpoint-4");
        assert!(
            ckpt.join("optimizer-rank00001-of-00002.safetensors")
                .exists()
        );
        let diff = max_abs_diff(&plain, &weights(&ckpt));
        println!("bf16 ZeRO-{stage} vs plain DP (no clipping): max |Δw| = {diff:e}");
        assert_eq!(diff, 0.0, "bf16 ZeRO-{stage} differs from plain DP");
    }
}

/// A 2-rank ZeRO checkpoint of the GPU engine (per-shard optimizer files) resumes on 2 ranks
/// exactly (the uninterrupted run's weights bit for bit) and alone with accumulation 2 (the same
/// global batch; re-sharded from the two files) within the fp32 bound of the tests above.
#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn a_two_rank_gpu_zero_checkpoint_resumes_on_two_and_on_one() {
    if !gpu_present() {
        return;
    }
    let dir = setup();
    let saves = [
        &SMALL_HOST_BUCKETS[..],
        &["--zero-stage", "2", "--save-steps", "2"],
    ]
    .concat();
    train(dir.path(), &TWO_RANKS, "full", &saves);
    let ckpt = dir.path().join("full/checkpoint-2");
    for file in [
        "optimizer_shards.json",
        "optimizer-rank00000-of-00002.safetensors",
        "optimizer-rank00001-of-00002.safetensors",
        "model.safetensors",
    ] {
        assert!(ckpt.join(file).exists(), "{file} missing");
    }
    let ckpt = ckpt.to_str().unwrap().to_string();
    let resume = ["--resume-from-checkpoint", ckpt.as_str()];
    train(
        dir.path(),
        &TWO_RANKS,
        "two",
        &[&saves[..], &resume[..]].concat(),
    );
    let full = weights(&dir.path().join("full"));
    assert_eq!(full, weights(&dir.path().join("two")), "same-size resume");
    let stdout = train(
        dir.path(),
        &[],
        "one",
        &[&["--gradient-accumulation-steps", "2"][..], &resume[..]].concat(),
    );
    // It resumed after step 2 (the GPU's progress lines are sparser than the CPU's, so the
    // run's own summary of its steps is what says so).
    assert!(stdout.contains("training: steps 2..4"), "{stdout}");
    let diff = max_abs_diff(&full, &weights(&dir.path().join("one")));
    println!("GPU ZeRO-2 checkpoint of 2 ranks resumed alone: max |Δw| = {diff:e}");
    assert!(diff <= 1e-4, "resumed alone: max |Δw| = {diff}");
}

/// bf16 ZeRO-2 with gradient accumulation: the owned-gradient accumulator and the window
/// (sharded master weights, so saves and resumes stage the whole fp32 weights in a buffer of
/// their own). Two ranks sharing one GPU over the host communicator:
/// * equal the whole-buffer ZeRO-2 (`--no-ddp-overlap`) bit for bit (see the fp32 test);
/// * against one process with the same global batch the weights differ by rounding only: the
///   ranks' f32 sums round differently, and a master weight that moves by 1e-7 can cross a
///   bf16 rounding boundary of the working copy, so the forward differs by one bf16 ulp; the
///   weights are bounded as in the bf16 compression test (2 · lr · steps, AdamW's per-step
///   movement) and the final losses agree within 1e-2 (one bf16 ulp of a loss near 5 is
///   0.03; the mean over the batch's tokens averages the rounding down);
/// * a checkpoint at step 2 resumes on two ranks to the uninterrupted run's weights bit for
///   bit.
#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn bf16_zero_2_with_accumulation_keeps_only_the_owned_gradients_and_resumes() {
    if !gpu_present() {
        return;
    }
    let dir = setup();
    deep_tiny(dir.path());
    let saves = ["--save-steps", "2"];
    let one = [&["--gradient-accumulation-steps", "4"][..], &saves[..]].concat();
    train_in(dir.path(), &[], "one", "--bf16", &one);
    let zero2 = [
        &SMALL_HOST_BUCKETS[..],
        &["--zero-stage", "2", "--gradient-accumulation-steps", "2"],
        &saves[..],
    ]
    .concat();
    let stdout = train_in(dir.path(), &TWO_RANKS, "window", "--bf16", &zero2);
    check_model_states(&stdout, "bf16 ZeRO-2, accumulation", "2Ψ + 16Ψ/N", true);
    let whole = [&zero2[..], &["--no-ddp-overlap"]].concat();
    train_in(dir.path(), &TWO_RANKS, "whole", "--bf16", &whole);
    let ckpt = |run: &str| weights(&dir.path().join(run).join("checkpoint-4"));
    assert_eq!(ckpt("window"), ckpt("whole"), "window vs whole buffer");
    let diff = max_abs_diff(&ckpt("one"), &ckpt("window"));
    let loss = |run: &str| {
        log_lines(&dir.path().join(run)).last().unwrap()["loss"]
            .as_f64()
            .unwrap()
    };
    let (one_loss, window_loss) = (loss("one"), loss("window"));
    println!(
        "bf16 ZeRO-2 (accumulation) vs one process: max |Δw| = {diff:e}, final loss \
         {window_loss} vs {one_loss}"
    );
    assert!(diff <= 2.0 * 1e-2 * 4.0, "max |Δw| = {diff}");
    assert!((one_loss - window_loss).abs() < 1e-2);
    let from = dir.path().join("window/checkpoint-2");
    let from = from.to_str().unwrap();
    let resume = [&zero2[..], &["--resume-from-checkpoint", from]].concat();
    train_in(dir.path(), &TWO_RANKS, "resumed", "--bf16", &resume);
    assert_eq!(ckpt("window"), ckpt("resumed"), "bf16 ZeRO-2 resume");
}

/// A tied lm_head writes the embedding's gradient before any part is finished, so under GPU
/// ZeRO-2 that part keeps its window space for the whole backward (the persistent part of the
/// plan): fp32, two ranks with accumulation, equal to the whole-buffer ZeRO-2 bit for bit.
#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn zero_2_with_a_tied_lm_head_equals_the_whole_buffer() {
    if !gpu_present() {
        return;
    }
    let dir = setup();
    let tied = TINY.replace("\"num_hidden_layers\": 2", "\"num_hidden_layers\": 8");
    let tied = tied.replace(
        "\"rope_theta\": 10000.0}",
        "\"rope_theta\": 10000.0, \"tie_word_embeddings\": true}",
    );
    assert_ne!(tied, TINY);
    std::fs::write(dir.path().join("tiny.json"), tied).unwrap();
    let flags = [
        &SMALL_HOST_BUCKETS[..],
        &["--zero-stage", "2", "--gradient-accumulation-steps", "2"],
    ]
    .concat();
    let stdout = train(dir.path(), &TWO_RANKS, "window", &flags);
    check_model_states(&stdout, "tied fp32 ZeRO-2", "4Ψ + 12Ψ/N", true);
    let whole = [&flags[..], &["--no-ddp-overlap"]].concat();
    train(dir.path(), &TWO_RANKS, "whole", &whole);
    assert_eq!(
        weights(&dir.path().join("window")),
        weights(&dir.path().join("whole")),
        "tied lm_head: window vs whole buffer"
    );
}
