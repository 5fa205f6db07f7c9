//! Packed fine-tuning rows on the CPU engine and through the data pipeline:
//! * a packed batch (position ids restarting per example) gives the loss and every gradient of
//!   its examples run alone, in f64 to 1e-12 and in f32 with gradient checkpointing to 1e-5;
//! * `prepare_sft` with `packing` writes every example exactly once into rows of at most
//!   `max_seq_length` tokens, and the rows read back with restarting positions, each example's
//!   first label ignored, and the trained tokens of the unpacked dataset;
//! * a packed dataset refuses to be read without its positions.

mod support;

use std::path::Path;

use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use support::packing::{pack, random_examples};
use support::sft::{IGNORE, TINY, prepare, qwen2, write_lines};
use tilearn_engine::config::LlamaConfig;
use tilearn_engine::data::{RowLayout, TokenDataset, prepare_sft};
use tilearn_engine::model::{Activations, LlamaForCausalLM};

const SEQ: usize = 40;
const LENS: [usize; 6] = [13, 1, 9, 17, 30, 8];
const ROWS: [&[usize]; 2] = [&[0, 1, 2, 3], &[4, 5]];

fn rel_err<T: Copy + Into<f64>>(a: &[T], b: &[T]) -> f64 {
    let (mut d, mut n) = (0.0f64, 0.0f64);
    for (&x, &y) in a.iter().zip(b) {
        let (x, y) = (x.into(), y.into());
        assert!(x.is_finite(), "non-finite value");
        d += (x - y).powi(2);
        n += y * y;
    }
    (d / n).sqrt()
}

fn model() -> LlamaForCausalLM {
    let config = LlamaConfig::from_json_str(TINY, Path::new("tiny/config.json")).unwrap();
    let config = LlamaConfig {
        max_position_embeddings: SEQ,
        ..config
    };
    LlamaForCausalLM::from_config(config, 21)
}

#[test]
fn packed_rows_equal_their_examples_run_alone_in_f64() {
    let m = model();
    let mut rng = ChaCha8Rng::seed_from_u64(5);
    let examples = random_examples(&mut rng, 259, &LENS);
    let (ids, labels, pos) = pack(&examples, &ROWS, SEQ, 0);
    let p64: Vec<f64> = m.params.data.iter().map(|&x| x as f64).collect();
    let numel = p64.len();

    let mut acts = Activations::<f64>::new(&m.config, ROWS.len(), SEQ, false);
    acts.set_position_ids(Some(&pos), ROWS.len(), SEQ).unwrap();
    let mut packed_grads = vec![0.0f64; numel];
    let packed = m
        .forward_backward_with(
            &p64,
            &ids,
            &labels,
            ROWS.len(),
            SEQ,
            Some(1.0),
            &mut acts,
            &mut packed_grads,
        )
        .unwrap();

    let mut alone_grads = vec![0.0f64; numel];
    let (mut alone_loss, mut alone_valid) = (0.0, 0);
    for ex in &examples {
        let n = ex.ids.len();
        let mut a = Activations::<f64>::new(&m.config, 1, n, false);
        let s = m
            .forward_backward_with(
                &p64,
                &ex.ids,
                &ex.labels,
                1,
                n,
                Some(1.0),
                &mut a,
                &mut alone_grads,
            )
            .unwrap();
        alone_loss += s.loss_sum;
        alone_valid += s.valid_tokens;
    }
    assert_eq!(packed.valid_tokens, alone_valid);
    let loss_err = (packed.loss_sum - alone_loss).abs() / alone_loss;
    let grad_err = rel_err(&packed_grads, &alone_grads);
    assert!(
        loss_err < 1e-12,
        "loss: packed {} alone {alone_loss}",
        packed.loss_sum
    );
    assert!(grad_err < 1e-12, "grads rel err {grad_err:e}");

    // Without the position ids the same rows attend across examples: the loss changes.
    acts.set_position_ids(None, 0, 0).unwrap();
    let mut g = vec![0.0f64; numel];
    let unmasked = m
        .forward_backward_with(
            &p64,
            &ids,
            &labels,
            ROWS.len(),
            SEQ,
            Some(1.0),
            &mut acts,
            &mut g,
        )
        .unwrap();
    assert!((unmasked.loss_sum - alone_loss).abs() / alone_loss > 1e-4);
}

#[test]
fn packed_rows_equal_their_examples_run_alone_in_f32_with_checkpointing() {
    let m = model();
    let mut rng = ChaCha8Rng::seed_from_u64(6);
    let examples = random_examples(&mut rng, 259, &LENS);
    let (ids, labels, pos) = pack(&examples, &ROWS, SEQ, 0);
    let numel = m.params.numel();
    let mut acts = Activations::new(&m.config, ROWS.len(), SEQ, true);
    acts.set_position_ids(Some(&pos), ROWS.len(), SEQ).unwrap();
    let mut packed_grads = vec![0.0f32; numel];
    let packed = m
        .forward_backward(
            &ids,
            &labels,
            ROWS.len(),
            SEQ,
            Some(1.0),
            &mut acts,
            &mut packed_grads,
        )
        .unwrap();
    let mut alone_grads = vec![0.0f32; numel];
    let mut alone = 0.0;
    for ex in &examples {
        let n = ex.ids.len();
        let mut a = Activations::new(&m.config, 1, n, true);
        alone += m
            .forward_backward(
                &ex.ids,
                &ex.labels,
                1,
                n,
                Some(1.0),
                &mut a,
                &mut alone_grads,
            )
            .unwrap()
            .loss_sum;
    }
    // f32: the same terms summed in another order.
    assert!((packed.loss_sum - alone).abs() / alone < 1e-5);
    assert!(rel_err(&packed_grads, &alone_grads) < 1e-5);

    // Position ids set for another shape are refused, not silently applied.
    let err = m
        .forward_backward(
            &ids[..SEQ],
            &labels[..SEQ],
            1,
            SEQ,
            None,
            &mut acts,
            &mut packed_grads,
        )
        .unwrap_err()
        .to_string();
    assert!(err.contains("position_ids"), "{err}");
    // Bad position ids are refused when set.
    assert!(acts.set_position_ids(Some(&[1; SEQ]), 1, SEQ).is_err());
}

#[test]
fn prepare_with_packing_writes_every_example_once_in_rows_that_restart_positions() {
    let dir = tempfile::tempdir().unwrap();
    let tokenizer = qwen2(&dir.path().join("model"));
    let lines: Vec<String> = (0..15)
        .map(|i| {
            format!(
                r#"{{"prompt": "Question {i}?", "response": " {}"}}"#,
                "yes ".repeat(1 + i % 5)
            )
        })
        .collect();
    let refs: Vec<&str> = lines.iter().map(String::as_str).collect();
    let input = write_lines(&dir.path().join("train.jsonl"), &refs);

    // The unpacked dataset: the trained tokens of every example.
    let plain = dir.path().join("plain");
    prepare_sft(&prepare(&tokenizer, input.clone(), &plain), false).unwrap();
    let plain = TokenDataset::open(&plain).unwrap();
    assert_eq!(plain.layout(), RowLayout::Examples);
    assert_eq!(plain.meta().version, 2, "unpacked data keeps version 2");
    let mut expected: Vec<Vec<i32>> = (0..plain.num_rows(64))
        .map(|r| {
            let (mut ids, mut labels) = (vec![0; 64], vec![0; 64]);
            plain.read_row(r, &mut ids, &mut labels).unwrap();
            // Prompt/response examples end with their trained EOS: the last label that counts
            // ends the example (the pad id may equal the EOS id, so the ids cannot tell).
            let len = labels.iter().rposition(|&l| l != IGNORE).unwrap() + 1;
            // As packed: the first label is never a target.
            let mut l = labels[..len].to_vec();
            l[0] = IGNORE;
            l
        })
        .collect();

    let packed_dir = dir.path().join("packed");
    let mut opts = prepare(&tokenizer, input.clone(), &packed_dir);
    opts.packing = true;
    assert!(
        prepare_sft(&opts, false).is_err(),
        "--packing needs --max-seq-length"
    );
    opts.max_seq_length = Some(48);
    let summary = prepare_sft(&opts, false).unwrap();
    let (rows, fill) = summary.packed_rows.unwrap();
    assert!(rows < 15 && fill > 0.5, "{summary}");
    let ds = TokenDataset::open(&packed_dir).unwrap();
    assert_eq!(ds.layout(), RowLayout::Packed);
    assert_eq!(ds.meta().version, 3);
    assert_eq!(ds.num_rows(48), rows as usize);

    let (mut ids, mut labels) = (vec![0; 48], vec![0; 48]);
    let err = ds
        .read_row(0, &mut ids, &mut labels)
        .unwrap_err()
        .to_string();
    assert!(err.contains("read_row_at"), "{err}");
    let mut got: Vec<Vec<i32>> = Vec::new();
    let mut pos = vec![0; 48];
    for r in 0..ds.num_rows(48) {
        ds.read_row_at(r, &mut ids, &mut labels, Some(&mut pos))
            .unwrap();
        tilearn_ops::check_positions(&pos, 1, 48).unwrap();
        // Split the row at its position restarts; the last run is padding when the row is
        // not full (its ids are the pad id and its labels ignored).
        let mut t = 0;
        while t < 48 {
            let end = (t + 1..48).find(|&u| pos[u] == 0).unwrap_or(48);
            let pad = ids[t..end].iter().all(|&i| i == ds.meta().pad_id.unwrap())
                && labels[t..end].iter().all(|&l| l == IGNORE)
                && end == 48;
            if !pad {
                got.push(labels[t..end].to_vec());
            }
            t = end;
        }
    }
    expected.sort();
    got.sort();
    assert_eq!(got, expected, "every example exactly once, with its labels");

    // Training shorter than the rows cuts examples: the warning counts the packed rows.
    assert!(ds.truncation(48).unwrap().warning(ds.dir(), 48).is_none());
    let cut = ds.truncation(20).unwrap();
    assert!(cut.packed && cut.truncated > 0);
    let warning = cut.warning(ds.dir(), 20).unwrap();
    assert!(
        warning.contains("packed rows") && warning.contains("--max-seq-length 20"),
        "{warning}"
    );
}
