//! A byte-level BPE tokenizer with no merges: the embedded default tokenizer.
//!
//! Token id `b` (0..=255) is the byte `b`, spelled with the GPT-2 byte-to-unicode alphabet that
//! the `ByteLevel` pre-tokenizer and decoder use; [`EOS_TOKEN`] is the special token 256, so the
//! vocabulary has 257 entries. It is an ordinary Hugging Face `tokenizer.json` once saved:
//! `Tokenizer::from_file` (Rust) and `PreTrainedTokenizerFast(tokenizer_file=…)` (Python) give
//! the same ids.

use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::{BPE, Vocab};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::{AddedToken, Tokenizer};

/// The end-of-text special token of the byte-level tokenizer (id [`BYTE_EOS_ID`]).
pub const EOS_TOKEN: &str = "<|endoftext|>";
/// Id of [`EOS_TOKEN`] in [`byte_level_tokenizer`].
pub const BYTE_EOS_ID: u32 = 256;
/// Vocabulary size of [`byte_level_tokenizer`]: 256 bytes and the EOS token.
pub const BYTE_VOCAB_SIZE: usize = 257;

/// The GPT-2 byte-to-unicode map: printable Latin-1 bytes stand for themselves, the other 68
/// bytes are shifted to code points 256.. in byte order, so every byte is one visible char.
pub fn byte_to_unicode() -> [char; 256] {
    let printable = |b: u32| {
        (u32::from(b'!')..=u32::from(b'~')).contains(&b)
            || (0xA1..=0xAC).contains(&b)
            || (0xAE..=0xFF).contains(&b)
    };
    let mut table = ['\0'; 256];
    let mut next_shifted = 256u32;
    for (b, slot) in table.iter_mut().enumerate() {
        let b = b as u32;
        let code = if printable(b) {
            b
        } else {
            let c = next_shifted;
            next_shifted += 1;
            c
        };
        *slot = char::from_u32(code).expect("code points below 0x200 are valid chars");
    }
    table
}

/// Build the byte-level tokenizer: 256 byte tokens (ids 0..=255 in byte order) and
/// `<|endoftext|>` = 256, no merges, no normalizer, GPT-2 byte-level pre-tokenizer (no prefix
/// space) and decoder.
pub fn byte_level_tokenizer() -> Tokenizer {
    let vocab: Vocab = byte_to_unicode()
        .iter()
        .enumerate()
        .map(|(id, c)| (c.to_string(), id as u32))
        .collect();
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, Vec::new())
        .build()
        .expect("a 256-token byte vocabulary with no merges is a valid BPE model");
    let mut tokenizer = Tokenizer::new(bpe);
    tokenizer.with_pre_tokenizer(Some(ByteLevel::new(false, true, true)));
    tokenizer.with_decoder(Some(ByteLevelDecoder::default()));
    tokenizer.with_post_processor(Some(ByteLevel::new(false, true, true)));
    tokenizer.add_special_tokens(&[AddedToken::from(EOS_TOKEN, true)]);
    debug_assert_eq!(tokenizer.token_to_id(EOS_TOKEN), Some(BYTE_EOS_ID));
    tokenizer
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn alphabet_matches_the_byte_level_pre_tokenizer() {
        let ours: std::collections::BTreeSet<char> = byte_to_unicode().into_iter().collect();
        let theirs: std::collections::BTreeSet<char> = ByteLevel::alphabet().into_iter().collect();
        assert_eq!(ours.len(), 256);
        assert_eq!(ours, theirs);
        // Spot checks from GPT-2: space is 'Ġ' (U+0120), newline 'Ċ' (U+010A).
        assert_eq!(byte_to_unicode()[b' ' as usize], '\u{120}');
        assert_eq!(byte_to_unicode()[b'\n' as usize], '\u{10A}');
        assert_eq!(byte_to_unicode()[b'A' as usize], 'A');
    }
}
