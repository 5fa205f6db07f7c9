//! SentencePiece `tokenizer.model` files as Hugging Face tokenizers.
//!
//! Some families ship only a SentencePiece model (Baichuan and Baichuan2: `tokenizer.model` and
//! their own Python tokenizer class, no `tokenizer.json`). This reads the model's protobuf and
//! builds the `tokenizers` pipeline that reproduces SentencePiece's encoder, as transformers'
//! slow-to-fast conversion does (`convert_slow_tokenizer.py`, `SpmConverter`):
//!
//! * normaliser: the precompiled character map when the model has one, SentencePiece's
//!   whitespace rules (`remove_extra_whitespaces`: strip and collapse runs of spaces;
//!   `add_dummy_prefix`: a leading "▁"; `escape_whitespaces`: spaces become "▁");
//! * model: BPE models get the pieces as vocabulary (id = position) and merges derived from the
//!   scores (SentencePiece merges the adjacent pair whose concatenation is the best-scored
//!   piece; every split of a piece into two pieces becomes a merge ranked by that piece's
//!   score), unigram models the pieces with their scores; byte fallback as the model says;
//! * control and unknown pieces are special tokens, user-defined pieces added tokens;
//! * decoder: "▁" back to spaces, byte pieces back to bytes, the dummy prefix's space removed.
//!
//! Checked against the `sentencepiece` package's own encoder on committed models
//! (`tests/sentencepiece.rs`).

use std::path::Path;

use prost::Message;
use tokenizers::decoders::DecoderWrapper;
use tokenizers::decoders::byte_fallback::ByteFallback;
use tokenizers::decoders::fuse::Fuse;
use tokenizers::decoders::sequence::Sequence as DecoderSequence;
use tokenizers::decoders::strip::Strip as StripDecoder;
use tokenizers::models::bpe::{BPE, Vocab};
use tokenizers::models::unigram::Unigram;
use tokenizers::normalizers::replace::ReplacePattern;
use tokenizers::normalizers::{NormalizerWrapper, Precompiled, Prepend, Replace, Sequence, Strip};
use tokenizers::{AddedToken, ModelWrapper, Tokenizer};

use crate::error::{EngineError, Result};

/// The metaspace SentencePiece writes for a space.
const META: &str = "\u{2581}";

/// The fields of `sentencepiece_model.proto` the conversion reads (field numbers as there).
#[derive(Clone, PartialEq, Message)]
struct ModelProto {
    #[prost(message, repeated, tag = "1")]
    pieces: Vec<Piece>,
    #[prost(message, optional, tag = "2")]
    trainer_spec: Option<TrainerSpec>,
    #[prost(message, optional, tag = "3")]
    normalizer_spec: Option<NormalizerSpec>,
}

#[derive(Clone, PartialEq, Message)]
struct Piece {
    #[prost(string, optional, tag = "1")]
    piece: Option<String>,
    #[prost(float, optional, tag = "2")]
    score: Option<f32>,
    /// NORMAL 1, UNKNOWN 2, CONTROL 3, USER_DEFINED 4, UNUSED 5, BYTE 6.
    #[prost(int32, optional, tag = "3")]
    r#type: Option<i32>,
}

#[derive(Clone, PartialEq, Message)]
struct TrainerSpec {
    /// UNIGRAM 1 (the default), BPE 2, WORD 3, CHAR 4.
    #[prost(int32, optional, tag = "3")]
    model_type: Option<i32>,
    #[prost(bool, optional, tag = "24")]
    treat_whitespace_as_suffix: Option<bool>,
    #[prost(bool, optional, tag = "35")]
    byte_fallback: Option<bool>,
    #[prost(int32, optional, tag = "40")]
    unk_id: Option<i32>,
}

#[derive(Clone, PartialEq, Message)]
struct NormalizerSpec {
    #[prost(string, optional, tag = "1")]
    name: Option<String>,
    #[prost(bytes = "vec", optional, tag = "2")]
    precompiled_charsmap: Option<Vec<u8>>,
    #[prost(bool, optional, tag = "3")]
    add_dummy_prefix: Option<bool>,
    #[prost(bool, optional, tag = "4")]
    remove_extra_whitespaces: Option<bool>,
    #[prost(bool, optional, tag = "5")]
    escape_whitespaces: Option<bool>,
}

const NORMAL: i32 = 1;
const UNKNOWN: i32 = 2;
const CONTROL: i32 = 3;
const USER_DEFINED: i32 = 4;
const MODEL_UNIGRAM: i32 = 1;
const MODEL_BPE: i32 = 2;

/// Whether `path` names a SentencePiece model (by its extension, as transformers' files do).
pub fn is_sentencepiece_model(path: &Path) -> bool {
    path.extension().is_some_and(|e| e == "model")
}

/// Reads a SentencePiece `.model` file into an equivalent Hugging Face tokenizer.
pub fn load_sentencepiece(path: &Path) -> Result<Tokenizer> {
    let error = |message: String| EngineError::Tokenizer {
        file: path.to_path_buf(),
        message,
    };
    let bytes = std::fs::read(path).map_err(|e| error(format!("cannot read: {e}")))?;
    let proto = ModelProto::decode(bytes.as_slice()).map_err(|e| {
        error(format!(
            "not a SentencePiece model ({e}); pass a tokenizer.model or a tokenizer.json"
        ))
    })?;
    convert(&proto).map_err(error)
}

fn convert(proto: &ModelProto) -> std::result::Result<Tokenizer, String> {
    if proto.pieces.is_empty() {
        return Err("the model has no pieces".into());
    }
    let trainer = proto.trainer_spec.clone().unwrap_or_default();
    if trainer.treat_whitespace_as_suffix == Some(true) {
        return Err("treat_whitespace_as_suffix models are not supported".into());
    }
    let spec = proto.normalizer_spec.clone().unwrap_or_default();
    let add_dummy_prefix = spec.add_dummy_prefix.unwrap_or(true);
    let pieces: Vec<(String, f32, i32)> = proto
        .pieces
        .iter()
        .map(|p| {
            (
                p.piece.clone().unwrap_or_default(),
                p.score.unwrap_or(0.0),
                p.r#type.unwrap_or(NORMAL),
            )
        })
        .collect();
    let byte_fallback = trainer.byte_fallback.unwrap_or(false);
    let unk = pieces.iter().position(|p| p.2 == UNKNOWN);
    let model: ModelWrapper = match trainer.model_type.unwrap_or(MODEL_UNIGRAM) {
        MODEL_BPE => bpe(&pieces, unk, byte_fallback)?.into(),
        MODEL_UNIGRAM => {
            let vocab = pieces
                .iter()
                .map(|(p, s, _)| (p.clone(), f64::from(*s)))
                .collect();
            Unigram::from(vocab, unk, byte_fallback)
                .map_err(|e| format!("cannot build the unigram model: {e}"))?
                .into()
        }
        other => {
            return Err(format!(
                "model_type {other} (WORD or CHAR) is not supported; only BPE and unigram"
            ));
        }
    };
    let mut tokenizer = Tokenizer::new(model);
    tokenizer.with_normalizer(Some(normalizer(&spec)?));
    tokenizer.with_decoder(Some(decoder(add_dummy_prefix)?));
    let special: Vec<AddedToken> = pieces
        .iter()
        .filter(|p| p.2 == CONTROL || p.2 == UNKNOWN)
        .map(|p| AddedToken::from(p.0.clone(), true))
        .collect();
    tokenizer.add_special_tokens(&special);
    let user: Vec<AddedToken> = pieces
        .iter()
        .filter(|p| p.2 == USER_DEFINED)
        .map(|p| AddedToken::from(p.0.clone(), false))
        .collect();
    tokenizer.add_tokens(&user);
    Ok(tokenizer)
}

/// The BPE model: pieces as vocabulary, merges ranked by the score of the piece they make.
fn bpe(
    pieces: &[(String, f32, i32)],
    unk: Option<usize>,
    byte_fallback: bool,
) -> std::result::Result<BPE, String> {
    let vocab: Vocab = pieces
        .iter()
        .enumerate()
        .map(|(id, p)| (p.0.clone(), id as u32))
        .collect();
    // Every way to write a mergeable piece as two pieces: (score of the result, ids of the
    // halves) orders them; best score first, then the halves' ids (as transformers orders
    // them, so that both conversions agree on ties).
    let mut merges: Vec<(f32, u32, u32, &str, &str)> = Vec::new();
    for (piece, score, kind) in pieces {
        if *kind != NORMAL && *kind != USER_DEFINED {
            continue;
        }
        for (at, _) in piece.char_indices().skip(1) {
            let (left, right) = piece.split_at(at);
            if let (Some(&l), Some(&r)) = (vocab.get(left), vocab.get(right)) {
                merges.push((*score, l, r, left, right));
            }
        }
    }
    merges.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)).then(a.2.cmp(&b.2)));
    let merges = merges
        .into_iter()
        .map(|m| (m.3.to_string(), m.4.to_string()))
        .collect();
    let mut builder = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .byte_fallback(byte_fallback)
        .fuse_unk(true);
    if let Some(u) = unk {
        builder = builder.unk_token(pieces[u].0.clone());
    }
    builder
        .build()
        .map_err(|e| format!("cannot build the BPE model: {e}"))
}

fn normalizer(spec: &NormalizerSpec) -> std::result::Result<NormalizerWrapper, String> {
    let mut steps: Vec<NormalizerWrapper> = Vec::new();
    if let Some(map) = spec
        .precompiled_charsmap
        .as_deref()
        .filter(|m| !m.is_empty())
    {
        let precompiled = Precompiled::from(map).map_err(|e| {
            format!(
                "cannot read the precompiled normaliser of {:?}: {e}",
                spec.name.as_deref().unwrap_or("?")
            )
        })?;
        steps.push(precompiled.into());
    }
    if spec.remove_extra_whitespaces.unwrap_or(true) {
        steps.push(Strip::new(true, true).into());
        steps.push(replace(ReplacePattern::Regex(" {2,}".into()), " ")?.into());
    }
    if spec.add_dummy_prefix.unwrap_or(true) {
        steps.push(Prepend::new(META.into()).into());
    }
    if spec.escape_whitespaces.unwrap_or(true) {
        steps.push(replace(" ".into(), META)?.into());
    }
    Ok(Sequence::new(steps).into())
}

fn replace(pattern: ReplacePattern, content: &str) -> std::result::Result<Replace, String> {
    Replace::new(pattern, content).map_err(|e| format!("cannot build a replacement: {e}"))
}

fn decoder(add_dummy_prefix: bool) -> std::result::Result<DecoderWrapper, String> {
    let mut steps: Vec<DecoderWrapper> = vec![
        DecoderWrapper::Replace(replace(META.into(), " ")?),
        ByteFallback::new().into(),
        Fuse::new().into(),
    ];
    if add_dummy_prefix {
        steps.push(StripDecoder::new(' ', 1, 0).into());
    }
    Ok(DecoderSequence::new(steps).into())
}
