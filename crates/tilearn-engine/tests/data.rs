//! Tests of the data pipeline: grammar corpus, byte-level tokenizer, prepare-data, the shard
//! format's error handling and the loader's windows, shuffling and resume.

use std::collections::{HashMap, HashSet};
use std::fs;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use tilearn_engine::data::{
    BYTE_EOS_ID, BYTE_VOCAB_SIZE, Batch, DataLoader, EOS_TOKEN, LoaderOptions, LoaderState,
    PrepareOptions, ShardWriter, TokenDataset, byte_level_tokenizer, generate_corpus, prepare_data,
    prepare_embedded_default,
};
use tokenizers::Tokenizer;

fn save_byte_tokenizer(dir: &Path) -> PathBuf {
    let path = dir.join("tokenizer.json");
    byte_level_tokenizer()
        .save(&path, false)
        .expect("save tokenizer");
    path
}

fn encode(tok: &Tokenizer, text: &str) -> Vec<u32> {
    tok.encode(text, false).expect("encode").get_ids().to_vec()
}

// ---------------------------------------------------------------------------------------------
// Grammar

#[test]
fn grammar_is_deterministic_and_varied() {
    let a = generate_corpus(11, 300);
    assert_eq!(a.len(), 300);
    assert_eq!(a, generate_corpus(11, 300), "same seed, same corpus");
    assert_ne!(a, generate_corpus(12, 300), "other seed, other corpus");
    // A prefix of a longer corpus is the shorter corpus.
    assert_eq!(&generate_corpus(11, 310)[..300], &a[..]);

    let distinct: HashSet<&String> = a.iter().collect();
    assert!(
        distinct.len() >= 295,
        "only {} distinct documents",
        distinct.len()
    );
    for doc in &a {
        assert!(doc.is_ascii() && !doc.is_empty());
        assert!(doc.ends_with('.'), "{doc:?}");
        assert!(doc.starts_with(|c: char| c.is_ascii_uppercase() || c.is_ascii_digit()));
        let sentences = doc.matches(". ").count() + 1;
        assert!(
            (2..=5).contains(&sentences),
            "{sentences} sentences in {doc:?}"
        );
    }

    // Small lexicon (low entropy), yet every template appears.
    let words: HashSet<&str> = a
        .iter()
        .flat_map(|d| d.split(|c: char| !c.is_ascii_alphanumeric()))
        .filter(|w| !w.is_empty())
        .collect();
    assert!(words.len() < 150, "{} distinct words", words.len());
    let all = a.join(" ");
    for needle in [
        " plus ",
        " minus ",
        "There ",
        " are ",
        " is ",
        " children",
        " an ",
    ] {
        assert!(all.contains(needle), "no {needle:?} in the corpus");
    }
}

#[test]
fn grammar_facts_and_agreement_hold() {
    let corpus = generate_corpus(5, 500);
    let mut facts = 0;
    for doc in &corpus {
        for sentence in doc.split(". ") {
            let s = sentence.trim_end_matches('.');
            let w: Vec<&str> = s.split(' ').collect();
            // "A plus B is C." / "A minus B is C."
            if w.len() == 5 && (w[1] == "plus" || w[1] == "minus") {
                let n = |x: &str| x.parse::<i64>().expect("number");
                let expect = if w[1] == "plus" {
                    n(w[0]) + n(w[2])
                } else {
                    n(w[0]) - n(w[2])
                };
                assert_eq!(w[3], "is");
                assert_eq!(n(w[4]), expect, "false fact {sentence:?}");
                assert!(expect >= 0);
                facts += 1;
            }
            // Plural subjects never take "is"/"sleeps"-style singular verbs right after them.
            let lower = s.to_ascii_lowercase();
            for bad in [
                "dogs is",
                "dogs runs",
                "cats sleeps",
                "children is",
                "mice runs",
            ] {
                assert!(
                    !lower.contains(bad),
                    "agreement error {bad:?} in {sentence:?}"
                );
            }
            for bad in ["dog are", "dog run ", "cat sleep ", "child are"] {
                assert!(
                    !lower.contains(bad),
                    "agreement error {bad:?} in {sentence:?}"
                );
            }
        }
    }
    assert!(facts > 100, "only {facts} arithmetic facts");
}

/// The corpus must be learnable: its byte-bigram conditional entropy is far below the 8 bits
/// (ln 257 ≈ 5.55 nats) of a uniform guess, so a small model's loss falls clearly. English
/// prose is about 3.3 bits here; the bound 3.0 bits leaves room above what the grammar gives.
#[test]
fn grammar_has_low_entropy() {
    let text = generate_corpus(0, 2000).join("\n");
    let bytes = text.as_bytes();
    let mut pair = HashMap::<(u8, u8), f64>::new();
    let mut first = HashMap::<u8, f64>::new();
    for w in bytes.windows(2) {
        *pair.entry((w[0], w[1])).or_default() += 1.0;
        *first.entry(w[0]).or_default() += 1.0;
    }
    let total = (bytes.len() - 1) as f64;
    let h: f64 = pair
        .iter()
        .map(|(&(a, _), &c)| -(c / total) * (c / first[&a]).log2())
        .sum();
    eprintln!("byte bigram conditional entropy: {h:.3} bits");
    assert!(h < 3.0, "conditional entropy {h} bits");
    assert!(h > 0.5, "corpus is degenerate: {h} bits");
}

// ---------------------------------------------------------------------------------------------
// Byte-level tokenizer

const SAMPLES: &[&str] = &[
    "Hello, world!",
    "  two leading spaces\n\ttab and newline\r\n",
    "日本語 ünïcödé — emoji 🚀🦀 and combining e\u{301}",
    "\u{0}\u{1}\u{7f} control bytes",
    "The big dog chases a red ball. 3 plus 4 is 7.",
    "",
];

#[test]
fn byte_tokenizer_ids_are_bytes_and_round_trip() {
    let tok = byte_level_tokenizer();
    assert_eq!(tok.get_vocab_size(true), BYTE_VOCAB_SIZE);
    assert_eq!(tok.token_to_id(EOS_TOKEN), Some(BYTE_EOS_ID));
    assert_eq!(BYTE_EOS_ID, 256);
    for text in SAMPLES {
        let ids = encode(&tok, text);
        let bytes: Vec<u32> = text.bytes().map(u32::from).collect();
        assert_eq!(ids, bytes, "ids of {text:?} must be its bytes");
        assert_eq!(tok.decode(&ids, false).expect("decode"), *text);
    }
    // The special token is recognised in text and decodes back.
    let ids = encode(&tok, "a<|endoftext|>b");
    assert_eq!(ids, vec![u32::from(b'a'), 256, u32::from(b'b')]);
    assert_eq!(tok.decode(&ids, false).unwrap(), "a<|endoftext|>b");
    assert_eq!(tok.decode(&ids, true).unwrap(), "ab");
    // Every single byte id decodes to a char from the byte-level alphabet (no unknowns).
    for id in 0..256u32 {
        assert!(tok.id_to_token(id).is_some(), "id {id} has no token");
    }
}

#[test]
fn byte_tokenizer_saves_and_reloads_identically() {
    let dir = tempfile::tempdir().unwrap();
    let path = save_byte_tokenizer(dir.path());
    let reloaded = Tokenizer::from_file(&path).expect("reload tokenizer.json");
    let tok = byte_level_tokenizer();
    assert_eq!(reloaded.get_vocab_size(true), BYTE_VOCAB_SIZE);
    assert_eq!(reloaded.token_to_id(EOS_TOKEN), Some(256));
    for text in SAMPLES.iter().chain(["x<|endoftext|>y"].iter()) {
        let ids = encode(&reloaded, text);
        assert_eq!(ids, encode(&tok, text), "{text:?}");
        assert_eq!(reloaded.decode(&ids, false).unwrap(), *text);
    }
    // The saved JSON is a standard BPE tokenizer.json.
    let json: serde_json::Value =
        serde_json::from_str(&fs::read_to_string(&path).unwrap()).unwrap();
    assert_eq!(json["model"]["type"], "BPE");
    assert_eq!(json["pre_tokenizer"]["type"], "ByteLevel");
    assert_eq!(json["decoder"]["type"], "ByteLevel");
    assert_eq!(json["added_tokens"][0]["content"], EOS_TOKEN);
    assert_eq!(json["added_tokens"][0]["special"], true);
}

// ---------------------------------------------------------------------------------------------
// prepare-data

fn options(dir: &Path, tokenizer: PathBuf, inputs: Vec<PathBuf>) -> PrepareOptions {
    let mut o = PrepareOptions::new(tokenizer, inputs, dir.join("out"));
    o.shard_tokens = 50;
    o
}

#[test]
fn prepare_text_and_jsonl_inputs() {
    let dir = tempfile::tempdir().unwrap();
    let tok_path = save_byte_tokenizer(dir.path());
    let text = dir.path().join("a.txt");
    fs::write(
        &text,
        "First paragraph,\nsecond line.\n\n\n   \nSecond paragraph ü.\r\n\r\nThird.\n",
    )
    .unwrap();
    let jsonl = dir.path().join("b.jsonl");
    fs::write(
        &jsonl,
        "{\"text\": \"json one\", \"id\": 1}\n\n{\"text\": \"json \\\"two\\\" 🚀\"}\n{\"text\": \"\"}\n",
    )
    .unwrap();
    let opts = options(dir.path(), tok_path.clone(), vec![text, jsonl]);
    let summary = prepare_data(&opts, false).expect("prepare");

    let docs = [
        "First paragraph,\nsecond line.",
        "Second paragraph ü.",
        "Third.",
        "json one",
        "json \"two\" 🚀",
    ];
    let tok = Tokenizer::from_file(&tok_path).unwrap();
    let mut expected = Vec::new();
    for d in docs {
        expected.extend(encode(&tok, d));
        expected.push(BYTE_EOS_ID);
    }
    assert_eq!(summary.num_documents, docs.len() as u64);
    assert_eq!(summary.num_tokens, expected.len() as u64);
    assert_eq!(summary.eos_id, BYTE_EOS_ID);
    assert_eq!(summary.vocab_size, BYTE_VOCAB_SIZE);
    assert_eq!(summary.token_width, 2);
    assert_eq!(summary.shards.len(), expected.len().div_ceil(50));
    assert!(summary.shards.len() >= 2, "test needs several shards");
    assert_eq!(summary.shards[0].file, "shard-00000.bin");

    let ds = TokenDataset::open(&opts.output_dir).expect("open");
    assert_eq!(ds.num_tokens(), expected.len());
    assert_eq!(ds.num_documents(), docs.len() as u64);
    assert_eq!(ds.eos_id(), BYTE_EOS_ID);
    assert_eq!(ds.vocab_size(), BYTE_VOCAB_SIZE);
    assert_eq!(ds.tokens(0..ds.num_tokens()).unwrap(), expected);
    // Ranges that straddle shard boundaries.
    assert!(expected.len() > 60);
    for start in [0, 3, 45, 49, 50, 51, 60] {
        let end = (start + 37).min(expected.len());
        assert_eq!(ds.tokens(start..end).unwrap(), &expected[start..end]);
    }
    assert!(ds.tokens(0..expected.len() + 1).is_err());
    // The tokenizer travels with the data.
    let copied = ds.tokenizer_path().expect("tokenizer recorded");
    assert_eq!(fs::read(copied).unwrap(), fs::read(&tok_path).unwrap());
    // Atomic writes leave no temporary files behind.
    for entry in fs::read_dir(&opts.output_dir).unwrap() {
        let name = entry.unwrap().file_name().to_string_lossy().into_owned();
        assert!(!name.contains(".tmp"), "left-over {name}");
    }
    // Shard header fields.
    let shard = fs::read(opts.output_dir.join("shard-00000.bin")).unwrap();
    assert_eq!(&shard[0..8], b"TILTOK01");
    assert_eq!(u32::from_le_bytes(shard[8..12].try_into().unwrap()), 1);
    assert_eq!(u32::from_le_bytes(shard[12..16].try_into().unwrap()), 2);
    assert_eq!(u64::from_le_bytes(shard[16..24].try_into().unwrap()), 50);
    assert_eq!(shard.len(), 32 + 50 * 2);

    // Re-running with a larger shard size replaces the old shards completely.
    let mut bigger = opts.clone();
    bigger.shard_tokens = 1000;
    let again = prepare_data(&bigger, false).unwrap();
    assert_eq!(again.shards.len(), 1);
    assert!(
        !opts.output_dir.join("shard-00001.bin").exists(),
        "stale shard left"
    );
    let ds = TokenDataset::open(&opts.output_dir).unwrap();
    assert_eq!(ds.tokens(0..ds.num_tokens()).unwrap(), expected);
}

#[test]
fn prepare_with_custom_text_field_and_progress() {
    let dir = tempfile::tempdir().unwrap();
    let tok_path = save_byte_tokenizer(dir.path());
    let jsonl = dir.path().join("c.json");
    fs::write(&jsonl, "{\"content\": \"abc\"}\n{\"content\": \"de\"}\n").unwrap();
    let mut opts = options(dir.path(), tok_path, vec![jsonl]);
    opts.text_field = "content".into();
    let summary = prepare_data(&opts, true).unwrap();
    assert_eq!(summary.num_tokens, 3 + 1 + 2 + 1);
    let shown = summary.to_string();
    assert!(
        shown.contains("7 tokens") && shown.contains("2 documents"),
        "{shown}"
    );
}

#[test]
fn bad_jsonl_line_names_file_line_and_field() {
    let dir = tempfile::tempdir().unwrap();
    let tok_path = save_byte_tokenizer(dir.path());
    let cases = [
        (
            "missing.jsonl",
            "{\"text\": \"ok\"}\n\n{\"txt\": \"x\"}\n",
            "line 3",
            "`text`",
        ),
        (
            "notstring.jsonl",
            "{\"text\": 5}\n",
            "line 1",
            "must be a string",
        ),
        (
            "badjson.jsonl",
            "{\"text\": \"ok\"}\n{\"text\": \n",
            "line 2",
            "invalid JSON",
        ),
        ("array.jsonl", "[1, 2]\n", "line 1", "JSON object"),
    ];
    for (name, content, line, what) in cases {
        let input = dir.path().join(name);
        fs::write(&input, content).unwrap();
        let err = prepare_data(&options(dir.path(), tok_path.clone(), vec![input]), false)
            .expect_err(name)
            .to_string();
        assert!(err.contains(name), "{err}");
        assert!(err.contains(line), "{err}");
        assert!(err.contains(what), "{err}");
    }
}

#[test]
fn empty_input_is_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let tok_path = save_byte_tokenizer(dir.path());
    let empty = dir.path().join("empty.txt");
    fs::write(&empty, "\n  \n\n").unwrap();
    let err = prepare_data(&options(dir.path(), tok_path.clone(), vec![empty]), false)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("empty.txt") && err.contains("no documents"),
        "{err}"
    );
    assert!(!dir.path().join("out/meta.json").exists());

    let err = prepare_data(&options(dir.path(), tok_path, vec![]), false)
        .unwrap_err()
        .to_string();
    assert!(err.contains("no input files"), "{err}");

    // A dataset directory whose meta.json lists no tokens.
    let ds_dir = dir.path().join("zero");
    fs::create_dir(&ds_dir).unwrap();
    fs::write(
        ds_dir.join("meta.json"),
        r#"{"format":"tilearn-tokens","version":1,"vocab_size":257,"eos_id":256,
            "token_width":2,"num_tokens":0,"num_documents":0,"shards":[],"tokenizer":null}"#,
    )
    .unwrap();
    let err = TokenDataset::open(&ds_dir).unwrap_err().to_string();
    assert!(err.contains("contains no tokens"), "{err}");
    assert!(err.contains("tilearn prepare-data"), "{err}");

    // No meta.json at all.
    let err = TokenDataset::open(&dir.path().join("nowhere"))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("meta.json") && err.contains("prepare-data"),
        "{err}"
    );
}

#[test]
fn tokenizer_without_eos_is_rejected() {
    let dir = tempfile::tempdir().unwrap();
    // The byte tokenizer minus its special token.
    let path = dir.path().join("tokenizer.json");
    let mut json: serde_json::Value =
        serde_json::from_str(&byte_level_tokenizer().to_string(false).unwrap()).unwrap();
    json["added_tokens"] = serde_json::json!([]);
    fs::write(&path, json.to_string()).unwrap();
    let input = dir.path().join("a.txt");
    fs::write(&input, "hello\n").unwrap();
    let err = prepare_data(
        &options(dir.path(), path.clone(), vec![input.clone()]),
        false,
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("end-of-sequence"), "{err}");
    assert!(err.contains("tokenizer.json"), "{err}");
    assert!(err.contains("--eos-token"), "{err}");

    // --eos-token names one: a token of the vocabulary is taken, another is refused by name.
    let mut named = options(dir.path(), path, vec![input]);
    named.eos_token = Some("A".into());
    let want = byte_level_tokenizer().token_to_id("A").unwrap();
    assert_eq!(prepare_data(&named, false).unwrap().eos_id, want);
    named.eos_token = Some("<no such token>".into());
    let err = prepare_data(&named, false).unwrap_err().to_string();
    assert!(
        err.contains("--eos-token") && err.contains("<no such token>"),
        "{err}"
    );

    let err = prepare_data(
        &options(dir.path(), dir.path().join("absent.json"), vec![]),
        false,
    )
    .unwrap_err()
    .to_string();
    assert!(!err.is_empty());
}

/// Writes a 3-shard dataset and returns (dir guard, dataset dir).
fn small_prepared() -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let tok_path = save_byte_tokenizer(dir.path());
    let input = dir.path().join("in.txt");
    fs::write(
        &input,
        "one two three four\n\nfive six seven eight nine ten\n\nx\n",
    )
    .unwrap();
    let mut opts = options(dir.path(), tok_path, vec![input]);
    opts.shard_tokens = 20;
    let summary = prepare_data(&opts, false).unwrap();
    assert!(summary.shards.len() >= 3);
    (dir, opts.output_dir)
}

#[test]
fn corrupt_shard_fails_the_checksum() {
    let (_guard, out) = small_prepared();
    TokenDataset::open(&out).expect("intact dataset opens");
    let shard = out.join("shard-00001.bin");
    let mut bytes = fs::read(&shard).unwrap();
    bytes[32 + 7] ^= 0x01; // flip one payload bit
    fs::write(&shard, &bytes).unwrap();
    let err = TokenDataset::open(&out).unwrap_err().to_string();
    assert!(err.contains("checksum mismatch"), "{err}");
    assert!(err.contains("shard-00001.bin"), "{err}");
    assert!(err.contains("re-run"), "{err}");
}

#[test]
fn truncated_shard_is_reported() {
    let (_guard, out) = small_prepared();
    let shard = out.join("shard-00002.bin");
    let bytes = fs::read(&shard).unwrap();
    fs::write(&shard, &bytes[..bytes.len() - 1]).unwrap();
    let err = TokenDataset::open(&out).unwrap_err().to_string();
    assert!(
        err.contains("truncated") && err.contains("shard-00002.bin"),
        "{err}"
    );

    fs::write(&shard, &bytes[..10]).unwrap();
    let err = TokenDataset::open(&out).unwrap_err().to_string();
    assert!(err.contains("truncated") && err.contains("header"), "{err}");

    fs::remove_file(&shard).unwrap();
    let err = TokenDataset::open(&out).unwrap_err().to_string();
    assert!(
        err.contains("missing") && err.contains("shard-00002.bin"),
        "{err}"
    );
}

#[test]
fn bad_magic_is_reported() {
    let (_guard, out) = small_prepared();
    let shard = out.join("shard-00000.bin");
    let mut bytes = fs::read(&shard).unwrap();
    bytes[0] = b'X';
    fs::write(&shard, &bytes).unwrap();
    let err = TokenDataset::open(&out).unwrap_err().to_string();
    assert!(err.contains("not a tilearn token shard"), "{err}");
}

#[test]
fn wide_vocabularies_use_four_byte_tokens() {
    let dir = tempfile::tempdir().unwrap();
    let mut w = ShardWriter::new(dir.path(), 70_000, 69_999, 7).unwrap();
    w.push_document(&[0, 65_535, 65_536, 69_998]).unwrap();
    w.push_document(&[12]).unwrap();
    assert!(
        w.push_document(&[70_000]).is_err(),
        "id beyond the vocabulary"
    );
    let summary = w.finish(None).unwrap();
    assert_eq!(summary.token_width, 4);
    let ds = TokenDataset::open(dir.path()).unwrap();
    assert_eq!(
        ds.tokens(0..ds.num_tokens()).unwrap(),
        vec![0, 65_535, 65_536, 69_998, 69_999, 12, 69_999]
    );
}

#[test]
fn embedded_default_needs_no_download() {
    let dir = tempfile::tempdir().unwrap();
    let summary = prepare_embedded_default(dir.path(), 3, 200).unwrap();
    assert_eq!(summary.num_documents, 200);
    assert_eq!(summary.vocab_size, 257);
    let ds = TokenDataset::open(dir.path()).unwrap();
    let tok = Tokenizer::from_file(ds.tokenizer_path().unwrap()).unwrap();
    let corpus = generate_corpus(3, 200);
    let stream = ds.tokens(0..ds.num_tokens()).unwrap();
    let docs: Vec<String> = stream
        .split(|&t| t == BYTE_EOS_ID)
        .take(200)
        .map(|ids| tok.decode(ids, false).unwrap())
        .collect();
    assert_eq!(docs, corpus);
    let expected: usize = corpus.iter().map(|d| d.len() + 1).sum();
    assert_eq!(ds.num_tokens(), expected);
}

// ---------------------------------------------------------------------------------------------
// Loader

/// A dataset whose token stream has unique content: documents of consecutive ids (lengths
/// 1..=9), each followed by EOS, spread over shards of 97 tokens. Any window of two or more
/// tokens therefore occurs once in the stream.
fn unique_dataset(num_docs: usize) -> (tempfile::TempDir, Arc<TokenDataset>, Vec<u32>) {
    let dir = tempfile::tempdir().unwrap();
    let eos = 99_999;
    let mut w = ShardWriter::new(dir.path(), 100_000, eos, 97).unwrap();
    let mut stream = Vec::new();
    let mut next = 0u32;
    for i in 0..num_docs {
        let len = 1 + (i * 7) % 9;
        let doc: Vec<u32> = (next..next + len as u32).collect();
        next += len as u32;
        w.push_document(&doc).unwrap();
        stream.extend(&doc);
        stream.push(eos);
    }
    w.finish(None).unwrap();
    let ds = Arc::new(TokenDataset::open(dir.path()).unwrap());
    assert_eq!(ds.tokens(0..ds.num_tokens()).unwrap(), stream);
    (dir, ds, stream)
}

fn rows(batch: &Batch) -> Vec<Vec<u32>> {
    batch
        .input_ids
        .chunks(batch.seq_len)
        .map(<[u32]>::to_vec)
        .collect()
}

fn take(loader: &mut DataLoader, n: usize) -> Vec<Batch> {
    (0..n).map(|_| loader.next_batch().unwrap()).collect()
}

#[test]
fn loader_batches_have_the_right_shape() {
    let (_d, ds, _) = unique_dataset(200);
    let mut loader =
        DataLoader::with_options(ds.clone(), LoaderOptions::new(3, 16, 0), None).unwrap();
    assert_eq!(loader.num_windows(), ds.num_tokens() / 16);
    assert_eq!(
        loader.batches_per_epoch(),
        (ds.num_tokens() / 16 / 3) as u64
    );
    for _ in 0..5 {
        let b = loader.next_batch().unwrap();
        assert_eq!((b.batch, b.seq_len), (3, 16));
        assert_eq!(b.input_ids.len(), 48);
        let as_i32: Vec<i32> = b.input_ids.iter().map(|&t| t as i32).collect();
        assert_eq!(b.labels, as_i32);
    }
}

#[test]
fn one_epoch_covers_the_windows_without_overlap() {
    let (_d, ds, stream) = unique_dataset(300);
    let t = 16;
    let windows: HashMap<Vec<u32>, usize> = stream
        .chunks_exact(t)
        .enumerate()
        .map(|(i, w)| (w.to_vec(), i))
        .collect();
    let num_windows = stream.len() / t;
    assert_eq!(
        windows.len(),
        num_windows,
        "test stream must have unique windows"
    );

    let b = 4;
    let mut loader = DataLoader::with_options(ds, LoaderOptions::new(b, t, 42), None).unwrap();
    let per_epoch = loader.batches_per_epoch() as usize;
    assert_eq!(per_epoch, num_windows / b);
    let mut seen = Vec::new();
    for batch in take(&mut loader, per_epoch) {
        for row in rows(&batch) {
            seen.push(
                *windows
                    .get(&row)
                    .expect("every row is an aligned window of the stream"),
            );
        }
    }
    assert_eq!(
        loader.state(),
        LoaderState {
            epoch: 1,
            batch_index: 0
        }
    );
    let distinct: HashSet<usize> = seen.iter().copied().collect();
    assert_eq!(
        distinct.len(),
        seen.len(),
        "a window was used twice in one epoch"
    );
    assert_eq!(seen.len(), per_epoch * b);
    assert!(seen.iter().all(|&w| w < num_windows));
    // Shuffled, not in stream order.
    let mut sorted = seen.clone();
    sorted.sort_unstable();
    assert_ne!(seen, sorted);
}

#[test]
fn shuffling_differs_between_epochs_and_seeds() {
    let (_d, ds, _) = unique_dataset(200);
    let opts = LoaderOptions::new(2, 8, 7);
    let mut loader = DataLoader::with_options(ds.clone(), opts, None).unwrap();
    let per_epoch = loader.batches_per_epoch() as usize;
    let epoch0 = take(&mut loader, per_epoch);
    let epoch1 = take(&mut loader, per_epoch);
    assert_ne!(epoch0, epoch1, "epochs must be shuffled differently");
    let mut other_seed =
        DataLoader::with_options(ds.clone(), LoaderOptions::new(2, 8, 8), None).unwrap();
    assert_ne!(take(&mut other_seed, per_epoch), epoch0);
    let mut same_seed = DataLoader::with_options(ds, opts, None).unwrap();
    assert_eq!(take(&mut same_seed, per_epoch), epoch0);
}

#[test]
fn resume_from_a_saved_state_continues_exactly() {
    let (_d, ds, _) = unique_dataset(20);
    // Few batches per epoch, so ten batches cross epoch boundaries.
    let mut full = DataLoader::new(ds.clone(), 2, 16, 1234, LoaderState::default()).unwrap();
    assert!(
        full.batches_per_epoch() <= 4,
        "{}",
        full.batches_per_epoch()
    );
    assert_eq!(full.state(), LoaderState::default());
    let mut batches = Vec::new();
    let mut states = Vec::new();
    for _ in 0..10 {
        states.push(full.state());
        batches.push(full.next_batch().unwrap());
    }
    let after_four = states[4];
    assert_ne!(after_four, LoaderState::default());
    // The state goes through serde, as it would in a checkpoint.
    let saved = serde_json::to_string(&after_four).unwrap();
    let restored: LoaderState = serde_json::from_str(&saved).unwrap();
    assert_eq!(restored, after_four);
    let mut resumed = DataLoader::new(ds.clone(), 2, 16, 1234, restored).unwrap();
    for (i, expected) in batches.iter().enumerate().skip(4) {
        assert_eq!(resumed.state(), states[i]);
        assert_eq!(
            &resumed.next_batch().unwrap(),
            expected,
            "batch {i} differs after resume"
        );
    }
    // The options form with the same values is the same loader.
    let opts = LoaderOptions::new(2, 16, 1234).starting_at(states[7]);
    let mut again = DataLoader::with_options(ds, opts, None).unwrap();
    assert_eq!(again.next_batch().unwrap(), batches[7]);
}

#[test]
fn ranks_split_each_global_batch() {
    let (_d, ds, _) = unique_dataset(200);
    let single = LoaderOptions::new(6, 8, 5);
    let mut whole = DataLoader::with_options(ds.clone(), single, None).unwrap();
    let mut parts = Vec::new();
    for rank in 0..2 {
        let mut o = LoaderOptions::new(3, 8, 5);
        o.rank = rank;
        o.world_size = 2;
        let mut l = DataLoader::with_options(ds.clone(), o, None).unwrap();
        assert_eq!(l.batches_per_epoch(), whole.batches_per_epoch());
        parts.push(take(&mut l, 3));
    }
    for (i, b) in take(&mut whole, 3).iter().enumerate() {
        let mut joined = parts[0][i].input_ids.clone();
        joined.extend(&parts[1][i].input_ids);
        assert_eq!(joined, b.input_ids);
    }
}

#[test]
fn loader_rejects_impossible_shapes() {
    let (_d, ds, _) = unique_dataset(20);
    let n = ds.num_tokens();
    let err = DataLoader::with_options(ds.clone(), LoaderOptions::new(2, 0, 0), None)
        .unwrap_err()
        .to_string();
    assert!(err.contains("--seq-len"), "{err}");
    let err = DataLoader::with_options(ds.clone(), LoaderOptions::new(4, n / 2, 0), None)
        .unwrap_err()
        .to_string();
    assert!(err.contains(&format!("dataset has {n} tokens")), "{err}");
    assert!(err.contains(&format!("one batch of 4×{}", n / 2)), "{err}");
    assert!(err.contains("--per-device-train-batch-size") && err.contains("--seq-len"));
    // Exactly one batch fits.
    let l = DataLoader::with_options(ds.clone(), LoaderOptions::new(2, n / 2, 0), None).unwrap();
    assert_eq!(l.batches_per_epoch(), 1);
    // A resume position beyond the epoch.
    let opts = LoaderOptions::new(2, 4, 0).starting_at(LoaderState {
        epoch: 0,
        batch_index: 10_000,
    });
    assert!(DataLoader::with_options(ds, opts, None).is_err());
}

#[test]
fn worker_hook_runs_on_the_worker_and_drop_stops_it() {
    let (_d, ds, _) = unique_dataset(100);
    let ran_elsewhere = Arc::new(AtomicBool::new(false));
    let flag = Arc::clone(&ran_elsewhere);
    let main = std::thread::current().id();
    let hook = Box::new(move || {
        flag.store(std::thread::current().id() != main, Ordering::SeqCst);
    });
    let mut opts = LoaderOptions::new(1, 4, 0);
    opts.prefetch = 1;
    let mut loader = DataLoader::with_options(ds.clone(), opts, Some(hook)).unwrap();
    loader.next_batch().unwrap();
    assert!(ran_elsewhere.load(Ordering::SeqCst));
    drop(loader); // must return: the worker is blocked on a full channel

    // Dropping without reading anything, and dropping many loaders, neither hangs nor leaks.
    for _ in 0..20 {
        drop(DataLoader::with_options(ds.clone(), LoaderOptions::new(2, 4, 0), None).unwrap());
    }
    // The loader is the only other owner of the dataset; after drop only ours is left.
    assert_eq!(
        Arc::strong_count(&ds),
        1,
        "a worker thread still holds the dataset"
    );

    // A hook that panics turns into an error, not a hang or a panic in drop.
    let hook: Box<dyn FnOnce() + Send> = Box::new(|| panic!("hook failed on purpose"));
    let mut loader = DataLoader::with_options(ds, LoaderOptions::new(1, 4, 0), Some(hook)).unwrap();
    let err = loader.next_batch().unwrap_err().to_string();
    assert!(err.contains("worker thread stopped"), "{err}");
    drop(loader);
}

#[test]
fn loader_over_the_embedded_default() {
    let dir = tempfile::tempdir().unwrap();
    prepare_embedded_default(dir.path(), 0, 500).unwrap();
    let ds = TokenDataset::open(dir.path()).unwrap();
    // An owned dataset works as well as an Arc.
    let mut loader = DataLoader::new(ds, 4, 64, 0, LoaderState::default()).unwrap();
    let batches = take(&mut loader, 10);
    assert!(batches.iter().all(|b| b.input_ids.iter().all(|&t| t < 257)));
    assert!(
        batches.iter().any(|b| b.input_ids.contains(&BYTE_EOS_ID)),
        "2,560 tokens of short documents hold an EOS"
    );
}
