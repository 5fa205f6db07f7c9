//! Supervised fine-tuning data: chat templates (Llama-2-chat and Qwen2 ChatML fixtures) rendered
//! with minijinja, loss masks that line up with the assistant turns, bad lines named by file and
//! line, the `examples` layout's rows (truncated, padded, label -100), old datasets still
//! loading, and the key property on the CPU engine: masked tokens contribute nothing to the loss
//! or the gradients.

mod support;

use std::path::Path;

use support::sft::{
    IGNORE, TINY, llama2, msg, perturb_padding, prepare, qwen2, rows, sft_batch, trained_text,
    write_lines,
};
use tilearn_engine::config::LlamaConfig;
use tilearn_engine::data::format::{
    DatasetMeta, META_FILE, RowLayout, ShardMeta, shard_file_name, write_shard,
};
use tilearn_engine::data::{
    BYTE_EOS_ID, ChatTemplate, DataLoader, LoaderState, TokenDataset, byte_level_tokenizer,
    prepare_sft,
};
use tilearn_engine::model::{Activations, LlamaForCausalLM, count_valid_targets};
use tokenizers::Tokenizer;

// ---------------------------------------------------------------------------------------------
// Templates

/// The Llama-2-chat template renders the format Meta documents and transformers produces:
/// `<s>[INST] <<SYS>>\n{system}\n<</SYS>>\n\n{user} [/INST] {answer} </s>` per exchange.
#[test]
fn llama2_chat_template_renders_the_published_format() {
    let dir = tempfile::tempdir().unwrap();
    let template = ChatTemplate::beside(&llama2(dir.path())).unwrap().unwrap();
    let conversation = [
        msg("system", "Be brief."),
        msg("user", "Hi? "),
        msg("assistant", " Hello."),
        msg("user", "2+2?"),
        msg("assistant", "4"),
    ];
    let text = template.render(&conversation, false).unwrap();
    assert_eq!(
        text,
        "<s>[INST] <<SYS>>\nBe brief.\n<</SYS>>\n\nHi? [/INST] Hello. </s><s>[INST] 2+2? [/INST] 4 </s>"
    );
    let (full, spans) = template.assistant_spans(&conversation).unwrap();
    assert_eq!(full, text);
    let spans: Vec<&str> = spans.iter().map(|s| &full[s.clone()]).collect();
    assert_eq!(spans, [" Hello. </s>", " 4 </s>"]);

    // raise_exception reaches the caller with the template's message.
    let err = template
        .render(&[msg("user", "a"), msg("user", "b")], false)
        .unwrap_err();
    assert!(
        err.contains("Conversation roles must alternate user/assistant/user/assistant/..."),
        "{err}"
    );
}

/// ChatML (Qwen2-Instruct): the default system prompt is added, `add_generation_prompt` opens
/// the assistant turn, and the assistant span is the content, `<|im_end|>` and the newline.
#[test]
fn chatml_template_renders_the_published_format() {
    let dir = tempfile::tempdir().unwrap();
    let template = ChatTemplate::beside(&qwen2(dir.path())).unwrap().unwrap();
    let question = [msg("user", "Hi")];
    assert_eq!(
        template.render(&question, true).unwrap(),
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    );
    let conversation = [msg("user", "Hi"), msg("assistant", "Hello!")];
    let (full, spans) = template.assistant_spans(&conversation).unwrap();
    assert_eq!(
        full,
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n"
    );
    assert_eq!(spans.len(), 1);
    assert_eq!(&full[spans[0].clone()], "Hello!<|im_end|>\n");
}

#[test]
fn a_template_that_rewrites_earlier_turns_is_refused() {
    // Renders only the last message: the prefix before an assistant turn is not a prefix of
    // the whole conversation, so its tokens cannot be located.
    let template = ChatTemplate::new(
        "{{ messages[-1]['content'] }}{% if add_generation_prompt %}>{% endif %}",
        Path::new("x/tokenizer_config.json"),
        String::new(),
        String::new(),
    )
    .unwrap();
    let err = template
        .assistant_spans(&[msg("user", "q"), msg("assistant", "a")])
        .unwrap_err();
    assert!(err.contains("is not a prefix"), "{err}");
    let err = ChatTemplate::new(
        "{% for %}",
        Path::new("x/tokenizer_config.json"),
        String::new(),
        String::new(),
    )
    .unwrap_err();
    assert!(err.to_string().contains("does not compile"), "{err}");
}

// ---------------------------------------------------------------------------------------------
// Masks

#[test]
fn llama2_chat_masks_train_exactly_the_assistant_turns() {
    let dir = tempfile::tempdir().unwrap();
    let tokenizer = llama2(&dir.path().join("model"));
    let input = write_lines(
        &dir.path().join("chat.jsonl"),
        &[
            r#"{"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]}"#,
        ],
    );
    let out = dir.path().join("data");
    let summary = prepare_sft(&prepare(&tokenizer, input, &out), false).unwrap();
    // Llama-2 names no pad token: rows are padded with the EOS `</s>` (id 258).
    assert_eq!(summary.pad_id, 258);
    assert_eq!(summary.data.eos_id, 258);
    let ds = TokenDataset::open(&out).unwrap();
    assert_eq!(ds.layout(), RowLayout::Examples);
    assert_eq!(ds.num_rows(4096), 1);
    let tok = Tokenizer::from_file(&tokenizer).unwrap();
    let seq = 128;
    let (ids, labels) = &rows(&ds, seq)[0];
    let len = ds.num_tokens();
    assert_eq!(
        tok.decode(&ids[..len], false).unwrap(),
        "<s>[INST] <<SYS>>\nBe brief.\n<</SYS>>\n\nHi? [/INST] Hello. </s><s>[INST] 2+2? [/INST] 4 </s>"
    );
    assert_eq!(trained_text(&tok, labels), " Hello. </s> 4 </s>");
    // Trained positions hold their own ids; the padding is the pad id with label -100.
    for (t, (&id, &l)) in ids.iter().zip(labels).enumerate() {
        assert!(l == IGNORE || l == id as i32, "position {t}");
        if t >= len {
            assert_eq!((id, l), (258, IGNORE), "padding at {t}");
        }
    }
    let trained = labels.iter().filter(|&&l| l != IGNORE).count();
    assert_eq!(trained as u64, summary.trained_tokens);
    assert_eq!(count_valid_targets(labels, 1, seq), trained);
}

#[test]
fn chatml_masks_train_content_end_token_and_newline() {
    let dir = tempfile::tempdir().unwrap();
    let tokenizer = qwen2(&dir.path().join("model"));
    let input = write_lines(
        &dir.path().join("chat.jsonl"),
        &[
            r#"{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]}"#,
            r#"{"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}]}"#,
        ],
    );
    let out = dir.path().join("data");
    let summary = prepare_sft(&prepare(&tokenizer, input, &out), false).unwrap();
    assert!(
        summary
            .template
            .unwrap()
            .ends_with("model/tokenizer_config.json")
    );
    // Qwen's pad_token `<|endoftext|>` is the byte tokenizer's 256; its EOS is `<|im_end|>`.
    assert_eq!((summary.pad_id, summary.data.eos_id), (BYTE_EOS_ID, 258));
    let tok = Tokenizer::from_file(&tokenizer).unwrap();
    let ds = TokenDataset::open(&out).unwrap();
    let rows = rows(&ds, 200);
    assert_eq!(rows.len(), 2);
    assert_eq!(trained_text(&tok, &rows[0].1), "Hello!<|im_end|>\n");
    assert_eq!(trained_text(&tok, &rows[1].1), "b<|im_end|>\nd<|im_end|>\n");
    // The user's "c" turn sits between the two trained spans and is masked.
    let first_d = rows[1]
        .0
        .iter()
        .rposition(|&id| id == u32::from(b'd'))
        .unwrap();
    let c = rows[1]
        .0
        .iter()
        .rposition(|&id| id == u32::from(b'c'))
        .unwrap();
    assert!(c < first_d);
    assert_eq!(rows[1].1[c], IGNORE);
    assert_eq!(rows[1].1[first_d], i32::from(b'd'));
}

#[test]
fn prompt_response_trains_response_and_eos_and_pads_with_ignored_labels() {
    let dir = tempfile::tempdir().unwrap();
    let tokenizer = qwen2(&dir.path().join("model"));
    let input = write_lines(
        &dir.path().join("pairs.jsonl"),
        &[
            r#"{"prompt": "Q: 1+1? A:", "response": " 2"}"#,
            "",
            r#"{"prompt": "", "response": "xyz"}"#,
        ],
    );
    let out = dir.path().join("data");
    let summary = prepare_sft(&prepare(&tokenizer, input, &out), false).unwrap();
    assert_eq!(summary.data.num_documents, 2);
    assert!(
        summary.template.is_none(),
        "prompt/response lines use no template"
    );
    let ds = TokenDataset::open(&out).unwrap();
    let seq = 16;
    let rows = rows(&ds, seq);
    let eos = 258i32; // <|im_end|>, the tokenizer_config's eos_token
    let (ids, labels) = &rows[0];
    let prompt = "Q: 1+1? A:".len();
    assert!(labels[..prompt].iter().all(|&l| l == IGNORE));
    assert_eq!(&labels[prompt..prompt + 3], &[32, 50, eos]); // " ", "2", EOS
    assert!(labels[prompt + 3..].iter().all(|&l| l == IGNORE));
    assert!(ids[prompt + 3..].iter().all(|&id| id == BYTE_EOS_ID));
    // Targets: the response and EOS, nothing of the padding.
    assert_eq!(count_valid_targets(labels, 1, seq), 3);
    // An empty prompt: the first response token is position 0, which nothing predicts.
    assert_eq!(count_valid_targets(&rows[1].1, 1, seq), 3);
    assert_eq!(
        count_valid_targets(&[labels.clone(), rows[1].1.clone()].concat(), 2, seq),
        6
    );
}

// ---------------------------------------------------------------------------------------------
// Errors

#[test]
fn bad_lines_stop_with_file_line_and_fix_or_are_skipped_and_counted() {
    let dir = tempfile::tempdir().unwrap();
    let tokenizer = llama2(&dir.path().join("model"));
    let input = write_lines(
        &dir.path().join("mixed.jsonl"),
        &[
            r#"{"prompt": "a", "response": "b"}"#,
            r#"{"prompt": "a", "response": "b""#,
            r#"{"prompt": "a"}"#,
            r#"{"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}, {"role": "assistant", "content": "c"}]}"#,
            r#"{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}"#,
        ],
    );
    let out = dir.path().join("data");
    let mut opts = prepare(&tokenizer, input.clone(), &out);
    let err = prepare_sft(&opts, false).unwrap_err().to_string();
    assert!(err.contains("mixed.jsonl"), "{err}");
    assert!(err.contains("line 2: invalid JSON"), "{err}");
    assert!(err.contains("--skip-bad-lines"), "{err}");
    assert!(
        !out.join(META_FILE).exists(),
        "a failed run leaves no meta.json"
    );

    opts.skip_bad_lines = true;
    let summary = prepare_sft(&opts, false).unwrap();
    assert_eq!(summary.num_skipped, 3);
    assert_eq!(summary.data.num_documents, 2);
    let lines: Vec<usize> = summary.skipped.iter().map(|b| b.line).collect();
    assert_eq!(lines, [2, 3, 4]);
    assert!(
        summary.skipped[1]
            .message
            .contains("field `response` is missing")
    );
    assert!(
        summary.skipped[2]
            .message
            .contains("Conversation roles must alternate"),
        "{}",
        summary.skipped[2]
    );
    assert!(summary.skipped[2].message.contains("tokenizer_config.json"));
    let report = summary.to_string();
    assert!(report.contains("skipped 3 bad line(s)"), "{report}");
    assert!(report.contains("mixed.jsonl line 3"), "{report}");
}

#[test]
fn chat_lines_without_a_template_name_the_missing_file() {
    let dir = tempfile::tempdir().unwrap();
    let tokenizer = dir.path().join("tokenizer.json");
    byte_level_tokenizer().save(&tokenizer, false).unwrap();
    let input = write_lines(
        &dir.path().join("chat.jsonl"),
        &[
            r#"{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}"#,
        ],
    );
    let err = prepare_sft(&prepare(&tokenizer, input, &dir.path().join("d")), false)
        .unwrap_err()
        .to_string();
    assert!(err.contains("line 1"), "{err}");
    assert!(err.contains("tokenizer_config.json"), "{err}");
    assert!(err.contains("chat_template"), "{err}");
}

// ---------------------------------------------------------------------------------------------
// Rows: truncation, the loader, old data

#[test]
fn truncation_at_prepare_and_at_training_is_counted() {
    let dir = tempfile::tempdir().unwrap();
    let tokenizer = qwen2(&dir.path().join("model"));
    let input = write_lines(
        &dir.path().join("pairs.jsonl"),
        &[
            r#"{"prompt": "short", "response": "ok"}"#,
            r#"{"prompt": "a much longer prompt here", "response": "and its answer"}"#,
        ],
    );
    // Prepare-time cut at 10 tokens: the second example keeps only prompt tokens.
    let mut opts = prepare(&tokenizer, input.clone(), &dir.path().join("cut"));
    opts.max_seq_length = Some(10);
    let summary = prepare_sft(&opts, false).unwrap();
    assert_eq!((summary.truncated, summary.truncated_to_nothing), (1, 1));
    assert!(summary.to_string().contains("--max-seq-length"));
    let ds = TokenDataset::open(&opts.output_dir).unwrap();
    assert_eq!(ds.meta().max_seq_length, Some(10));
    assert_eq!(ds.num_tokens(), 5 + 2 + 1 + 10);

    // Stored whole, cut by the training sequence length when batched.
    let whole = prepare(&tokenizer, input, &dir.path().join("whole"));
    prepare_sft(&whole, false).unwrap();
    let ds = TokenDataset::open(&whole.output_dir).unwrap();
    let t = ds.truncation(30).unwrap();
    assert_eq!((t.truncated, t.left_without_targets, t.examples), (1, 0, 2));
    let warning = t.warning(ds.dir(), 30).unwrap();
    assert!(warning.contains("1 of the 2 examples"), "{warning}");
    assert!(warning.contains("--seq-len 30"), "{warning}");
    assert!(ds.truncation(64).unwrap().warning(ds.dir(), 64).is_none());
    let rows = rows(&ds, 30);
    // "a much longer prompt here" is 25 tokens; positions 25..30 are the answer.
    assert_eq!(count_valid_targets(&rows[1].1, 1, 30), 30 - 25);
}

#[test]
fn the_loader_gives_one_example_per_row() {
    let dir = tempfile::tempdir().unwrap();
    let tokenizer = qwen2(&dir.path().join("model"));
    let lines: Vec<String> = (0..10)
        .map(|i| {
            format!(
                r#"{{"prompt": "p{i}", "response": "{}"}}"#,
                "r".repeat(i + 1)
            )
        })
        .collect();
    let lines: Vec<&str> = lines.iter().map(String::as_str).collect();
    let input = write_lines(&dir.path().join("pairs.jsonl"), &lines);
    let mut opts = prepare(&tokenizer, input, &dir.path().join("data"));
    opts.shard_tokens = 7; // examples span shard boundaries
    prepare_sft(&opts, false).unwrap();
    let ds = TokenDataset::open(&opts.output_dir).unwrap();
    assert!(ds.num_shards() > 3);
    let mut loader = DataLoader::new(ds, 5, 16, 3, LoaderState::default()).unwrap();
    assert_eq!(loader.batches_per_epoch(), 2);
    let mut seen = Vec::new();
    for _ in 0..2 {
        let b = loader.next_batch().unwrap();
        for (ids, labels) in b.input_ids.chunks(16).zip(b.labels.chunks(16)) {
            // "p{i}" then i+1 "r"s and EOS; the rest is padding.
            let i = (ids[1] - u32::from(b'0')) as usize;
            let trained: Vec<i32> = labels.iter().copied().filter(|&l| l != IGNORE).collect();
            let mut expected = vec![i32::from(b'r'); i + 1];
            expected.push(258);
            assert_eq!(trained, expected, "example {i}");
            assert!(ids[2 + i + 2..].iter().all(|&id| id == BYTE_EOS_ID));
            seen.push(i);
        }
    }
    seen.sort_unstable();
    assert_eq!(seen, (0..10).collect::<Vec<_>>());
}

/// A dataset written by the version-1 writer (`meta.json` without layout fields, as tilearn
/// wrote before fine-tuning data existed) still opens as a token stream.
#[test]
fn version_one_datasets_still_load_as_streams() {
    let dir = tempfile::tempdir().unwrap();
    let tokens: Vec<u32> = (0..40).map(|i| i % 7).collect();
    write_shard(&dir.path().join(shard_file_name(0)), &tokens, 2).unwrap();
    let v1 = r#"{
  "format": "tilearn-tokens",
  "version": 1,
  "vocab_size": 8,
  "eos_id": 7,
  "token_width": 2,
  "num_tokens": 40,
  "num_documents": 1,
  "shards": [{"file": "shard-00000.bin", "num_tokens": 40}],
  "tokenizer": null
}"#;
    std::fs::write(dir.path().join(META_FILE), v1).unwrap();
    let ds = TokenDataset::open(dir.path()).unwrap();
    assert_eq!(ds.layout(), RowLayout::Stream);
    assert!(ds.truncation(8).is_none());
    assert_eq!(ds.num_rows(8), 5);
    let (mut ids, mut labels) = (vec![0; 8], vec![0; 8]);
    ds.read_row(2, &mut ids, &mut labels).unwrap();
    assert_eq!(ids, tokens[16..24]);
    assert_eq!(
        labels,
        tokens[16..24].iter().map(|&t| t as i32).collect::<Vec<_>>()
    );
    assert!(ds.read_row(5, &mut ids, &mut labels).is_err());

    // The stream writer still writes version 1, byte for byte the same fields.
    let mut w = tilearn_engine::data::ShardWriter::new(&dir.path().join("new"), 8, 7, 100).unwrap();
    w.push_document(&tokens[..39]).unwrap();
    w.finish(None).unwrap();
    let text = std::fs::read_to_string(dir.path().join("new").join(META_FILE)).unwrap();
    let meta: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(meta["version"], 1);
    let keys: Vec<&String> = meta.as_object().unwrap().keys().collect();
    assert!(
        !keys.iter().any(|k| k.contains("mask") || *k == "pad_id"),
        "{keys:?}"
    );
}

#[test]
fn a_corrupt_or_inconsistent_mask_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let tokenizer = qwen2(&dir.path().join("model"));
    let input = write_lines(
        &dir.path().join("pairs.jsonl"),
        &[r#"{"prompt": "p", "response": "r"}"#],
    );
    let out = dir.path().join("data");
    prepare_sft(&prepare(&tokenizer, input, &out), false).unwrap();
    let meta_text = std::fs::read_to_string(out.join(META_FILE)).unwrap();
    let meta: DatasetMeta = serde_json::from_str(&meta_text).unwrap();
    assert_eq!(meta.version, 2);
    assert_eq!(meta.mask_shards.len(), meta.shards.len());

    // A flipped mask byte fails the checksum.
    let mask = out.join(&meta.mask_shards[0].file);
    let mut bytes = std::fs::read(&mask).unwrap();
    *bytes.last_mut().unwrap() ^= 1;
    std::fs::write(&mask, &bytes).unwrap();
    let err = TokenDataset::open(&out).unwrap_err().to_string();
    assert!(
        err.contains("checksum mismatch") && err.contains("mask-00000.bin"),
        "{err}"
    );
    *bytes.last_mut().unwrap() ^= 1;
    std::fs::write(&mask, &bytes).unwrap();
    TokenDataset::open(&out).unwrap();

    // Mask files that do not pair with the shards.
    let mut broken = meta.clone();
    broken.mask_shards = vec![ShardMeta {
        file: "mask-00000.bin".into(),
        num_tokens: 1,
    }];
    std::fs::write(out.join(META_FILE), serde_json::to_string(&broken).unwrap()).unwrap();
    let err = TokenDataset::open(&out).unwrap_err().to_string();
    assert!(err.contains("do not pair"), "{err}");
}

// ---------------------------------------------------------------------------------------------
// Masked tokens contribute nothing to the loss or the gradients (CPU engine)

fn loss_and_grads(
    model: &LlamaForCausalLM,
    ids: &[u32],
    labels: &[i32],
    seq: usize,
) -> (f64, Vec<f32>) {
    let mut acts = Activations::new(&model.config, 2, seq, false);
    let mut grads = vec![0.0; model.params.numel()];
    let stats = model
        .forward_backward(ids, labels, 2, seq, None, &mut acts, &mut grads)
        .unwrap();
    (stats.loss_sum, grads)
}

#[test]
fn masked_tokens_contribute_nothing_to_loss_or_gradients_on_the_cpu() {
    let dir = tempfile::tempdir().unwrap();
    let seq = 24;
    let (ids, labels, lens) = sft_batch(dir.path(), seq);
    let config = LlamaConfig::from_json_str(TINY, Path::new("tiny/config.json")).unwrap();
    let model = LlamaForCausalLM::from_config(config, 5);
    let (loss, grads) = loss_and_grads(&model, &ids, &labels, seq);
    assert!(loss.is_finite() && loss > 0.0);
    assert!(grads.iter().any(|&g| g != 0.0));

    // 1. The padding (masked, after each example): other ids, other targets behind the mask —
    //    loss and every gradient bit-identical.
    let (ids2, labels2) = perturb_padding(&ids, &labels, &lens, seq);
    let (loss2, grads2) = loss_and_grads(&model, &ids2, &labels2, seq);
    assert_eq!(
        loss2.to_bits(),
        loss.to_bits(),
        "loss changed with the padding"
    );
    let differing = grads
        .iter()
        .zip(&grads2)
        .filter(|(a, b)| a.to_bits() != b.to_bits())
        .count();
    assert_eq!(
        differing, 0,
        "{differing} gradients changed with the padding"
    );

    // 2. The prompt's targets: the loss is exactly the response tokens' cross entropy (f64
    //    reference from the logits), so the masked targets add nothing.
    let mut acts = Activations::new(&model.config, 2, seq, false);
    let logits = model
        .forward_logits(&ids, 2, seq, &mut acts)
        .unwrap()
        .to_vec();
    let vocab = 259;
    let mut reference = 0.0f64;
    let mut targets = 0;
    for r in 0..2 {
        for t in 0..seq - 1 {
            let label = labels[r * seq + t + 1];
            if label == IGNORE {
                continue;
            }
            let row = &logits[(r * seq + t) * vocab..(r * seq + t + 1) * vocab];
            let max = row.iter().fold(f64::NEG_INFINITY, |m, &x| m.max(x as f64));
            let lse = max
                + row
                    .iter()
                    .map(|&x| (x as f64 - max).exp())
                    .sum::<f64>()
                    .ln();
            reference += lse - row[label as usize] as f64;
            targets += 1;
        }
    }
    assert_eq!(targets, count_valid_targets(&labels, 2, seq));
    assert_eq!(targets, 4 + 6, "\" ok\"+EOS and \" fine\"+EOS");
    // f32 logits and the engine's f32 log-sum-exp against f64: ~1e-7 relative.
    assert!(
        (loss - reference).abs() / reference < 1e-5,
        "{loss} vs {reference}"
    );

    // 3. A response token's target changes the loss and the gradients.
    let mut labels3 = labels.clone();
    let r0 = labels.iter().position(|&l| l != IGNORE).unwrap();
    labels3[r0] = (labels3[r0] + 1) % 259;
    let (loss3, grads3) = loss_and_grads(&model, &ids, &labels3, seq);
    assert_ne!(loss3.to_bits(), loss.to_bits());
    assert!(grads.iter().zip(&grads3).any(|(a, b)| a != b));

    // 4. Prompt tokens stay context (as in transformers): a different prompt id changes the
    //    response's loss even though the prompt is never a target.
    let mut ids4 = ids.clone();
    ids4[1] = (ids4[1] + 1) % 259;
    let (loss4, _) = loss_and_grads(&model, &ids4, &labels, seq);
    assert_ne!(loss4.to_bits(), loss.to_bits());
}

/// Evaluation on fine-tuning data (`--eval-data` of an `examples` dataset) scores the trained
/// tokens only: its token count is the rows' valid targets and its mean their mean loss.
#[test]
fn eval_on_fine_tuning_data_scores_only_trained_tokens() {
    use tilearn_engine::trainer::{
        CpuBackend, DataParallel, EvalSet, TrainingArguments, adamw_for,
    };
    let dir = tempfile::tempdir().unwrap();
    let tokenizer = qwen2(&dir.path().join("model"));
    let lines: Vec<String> = (0..7)
        .map(|i| {
            format!(
                r#"{{"prompt": "q{i}?", "response": "{}"}}"#,
                "a".repeat(i + 1)
            )
        })
        .collect();
    let lines: Vec<&str> = lines.iter().map(String::as_str).collect();
    let input = write_lines(&dir.path().join("eval.jsonl"), &lines);
    let out = dir.path().join("data");
    prepare_sft(&prepare(&tokenizer, input, &out), false).unwrap();
    let seq = 16;
    let ds = TokenDataset::open(&out).unwrap();
    let all = rows(&ds, seq);
    let ids: Vec<u32> = all.iter().flat_map(|r| r.0.clone()).collect();
    let labels: Vec<i32> = all.iter().flat_map(|r| r.1.clone()).collect();
    let expected_tokens = count_valid_targets(&labels, all.len(), seq);
    assert_eq!(expected_tokens, (1..=7).map(|n| n + 1).sum::<usize>());

    let config = LlamaConfig::from_json_str(TINY, Path::new("tiny/config.json")).unwrap();
    let model = LlamaForCausalLM::from_config(config, 9);
    let mut acts = Activations::new(&model.config, all.len(), seq, false);
    let reference = model
        .forward_loss_with(&model.params.data, &ids, &labels, all.len(), seq, &mut acts)
        .unwrap();
    let set = EvalSet::new(ds, 259, seq).unwrap();
    assert_eq!(set.num_windows(), 7);
    let args = TrainingArguments::default();
    let optimizer = adamw_for(&args, &model.params).unwrap();
    let dp = DataParallel::single(model.params.numel());
    let mut cpu = CpuBackend::new(model, optimizer, 3, seq, false);
    let eval = set
        .evaluate(&mut cpu, &dp, 3, None, tilearn_ops::DType::F32)
        .unwrap();
    assert_eq!(eval.tokens as usize, expected_tokens);
    // Batches of 3 instead of one of 7 only reorder an f64 sum of the same f32 token losses.
    assert!((eval.mean - reference.mean()).abs() < 1e-9 * reference.mean());
}
