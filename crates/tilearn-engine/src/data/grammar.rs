//! A small probabilistic grammar of English-like sentences, used as the embedded default
//! training corpus.
//!
//! The language is deliberately low-entropy so that a tiny model learns it quickly: a few
//! sentence templates over a small lexicon, with rules a model has to pick up to predict well —
//! subject–verb number agreement ("the dog runs" / "the dogs run"), `a`/`an` before vowels,
//! `is`/`are`, `there is`/`there are`, capitalised sentence starts, and single-digit arithmetic
//! facts that are always true ("3 plus 4 is 7.", "9 minus 5 is 4."). Everything is ASCII.
//!
//! Generation is deterministic: the same `(seed, num_documents)` gives the same corpus on every
//! platform, because it uses a seeded ChaCha8 stream and its own bounded-integer sampling.

use rand::{RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// A noun as (singular, plural).
type Noun = (&'static str, &'static str);
/// A verb as (third person singular, plural).
type Verb = (&'static str, &'static str);

const ANIMATE: &[Noun] = &[
    ("dog", "dogs"),
    ("cat", "cats"),
    ("bird", "birds"),
    ("child", "children"),
    ("fox", "foxes"),
    ("mouse", "mice"),
    ("teacher", "teachers"),
    ("farmer", "farmers"),
    ("owl", "owls"),
    ("elephant", "elephants"),
];
const THINGS: &[Noun] = &[
    ("ball", "balls"),
    ("apple", "apples"),
    ("box", "boxes"),
    ("book", "books"),
    ("tree", "trees"),
    ("house", "houses"),
    ("egg", "eggs"),
    ("stone", "stones"),
];
const PLACES: &[&str] = &["garden", "house", "river", "forest", "park", "kitchen"];
const ADJECTIVES: &[&str] = &[
    "big", "small", "red", "old", "happy", "quick", "lazy", "green", "little", "brown", "orange",
    "angry",
];
const TRANSITIVE: &[Verb] = &[
    ("sees", "see"),
    ("chases", "chase"),
    ("likes", "like"),
    ("finds", "find"),
    ("carries", "carry"),
    ("watches", "watch"),
];
const INTRANSITIVE: &[Verb] = &[
    ("sleeps", "sleep"),
    ("runs", "run"),
    ("sings", "sing"),
    ("jumps", "jump"),
    ("waits", "wait"),
];
const PREPOSITIONS: &[&str] = &["on", "under", "near", "behind", "in"];
const SINGULAR_DETERMINERS: &[&str] = &["the", "a", "this", "that", "every"];
const PLURAL_DETERMINERS: &[&str] = &["the", "some", "these", "those", "two", "many"];

/// Generate `num_documents` documents of 2–5 sentences each from `seed`.
pub fn generate_corpus(seed: u64, num_documents: usize) -> Vec<String> {
    let mut g = Generator {
        rng: ChaCha8Rng::seed_from_u64(seed),
    };
    (0..num_documents).map(|_| g.document()).collect()
}

struct Generator {
    rng: ChaCha8Rng,
}

impl Generator {
    /// Uniform integer in `0..n` (multiply-shift; the bias is below n/2^64, irrelevant here).
    fn below(&mut self, n: usize) -> usize {
        debug_assert!(n > 0);
        ((u128::from(self.rng.next_u64()) * n as u128) >> 64) as usize
    }

    fn pick<T: Copy>(&mut self, items: &[T]) -> T {
        items[self.below(items.len())]
    }

    /// True with probability `num/den`.
    fn chance(&mut self, num: usize, den: usize) -> bool {
        self.below(den) < num
    }

    fn document(&mut self) -> String {
        let n = 2 + self.below(4);
        let sentences: Vec<String> = (0..n).map(|_| self.sentence()).collect();
        sentences.join(" ")
    }

    fn sentence(&mut self) -> String {
        // Template weights: transitive 4, intransitive 3, copula 2, arithmetic 2, existential 1.
        let s = match self.below(12) {
            0..=3 => self.transitive(),
            4..=6 => self.intransitive(),
            7..=8 => self.copula(),
            9..=10 => self.arithmetic(),
            _ => self.existential(),
        };
        capitalize(&s)
    }

    /// A noun phrase: determiner, optional adjective, noun, with `a`/`an` agreement.
    fn noun_phrase(&mut self, nouns: &[Noun], plural: bool) -> String {
        let noun = self.pick(nouns);
        let noun = if plural { noun.1 } else { noun.0 };
        let adjective = self.chance(1, 2).then(|| self.pick(ADJECTIVES));
        let det = if plural {
            self.pick(PLURAL_DETERMINERS)
        } else {
            self.pick(SINGULAR_DETERMINERS)
        };
        let next = adjective.unwrap_or(noun);
        let det = if det == "a" && starts_with_vowel(next) {
            "an"
        } else {
            det
        };
        match adjective {
            Some(a) => format!("{det} {a} {noun}"),
            None => format!("{det} {noun}"),
        }
    }

    fn place_phrase(&mut self) -> String {
        let prep = self.pick(PREPOSITIONS);
        let place = self.pick(PLACES);
        format!("{prep} the {place}")
    }

    fn transitive(&mut self) -> String {
        let plural = self.chance(1, 3);
        let subject = self.noun_phrase(ANIMATE, plural);
        let verb = self.pick(TRANSITIVE);
        let verb = if plural { verb.1 } else { verb.0 };
        let object_plural = self.chance(1, 3);
        let objects = if self.chance(1, 2) { THINGS } else { ANIMATE };
        let object = self.noun_phrase(objects, object_plural);
        if self.chance(1, 3) {
            let place = self.place_phrase();
            format!("{subject} {verb} {object} {place}.")
        } else {
            format!("{subject} {verb} {object}.")
        }
    }

    fn intransitive(&mut self) -> String {
        let plural = self.chance(1, 3);
        let subject = self.noun_phrase(ANIMATE, plural);
        let verb = self.pick(INTRANSITIVE);
        let verb = if plural { verb.1 } else { verb.0 };
        if self.chance(2, 3) {
            let place = self.place_phrase();
            format!("{subject} {verb} {place}.")
        } else {
            format!("{subject} {verb}.")
        }
    }

    fn copula(&mut self) -> String {
        let plural = self.chance(1, 3);
        let nouns = if self.chance(1, 2) { THINGS } else { ANIMATE };
        let subject = self.noun_phrase(nouns, plural);
        let be = if plural { "are" } else { "is" };
        let adjective = self.pick(ADJECTIVES);
        format!("{subject} {be} {adjective}.")
    }

    fn arithmetic(&mut self) -> String {
        let a = self.below(10);
        let b = self.below(10);
        if self.chance(1, 2) {
            format!("{a} plus {b} is {}.", a + b)
        } else {
            let (hi, lo) = if a >= b { (a, b) } else { (b, a) };
            format!("{hi} minus {lo} is {}.", hi - lo)
        }
    }

    fn existential(&mut self) -> String {
        let plural = self.chance(1, 2);
        let subject = self.noun_phrase(ANIMATE, plural);
        let be = if plural { "are" } else { "is" };
        let place = self.pick(PLACES);
        format!("there {be} {subject} in the {place}.")
    }
}

fn starts_with_vowel(word: &str) -> bool {
    matches!(
        word.as_bytes().first(),
        Some(b'a' | b'e' | b'i' | b'o' | b'u')
    )
}

fn capitalize(s: &str) -> String {
    let mut chars = s.chars();
    match chars.next() {
        Some(c) => c.to_ascii_uppercase().to_string() + chars.as_str(),
        None => String::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn articles_agree_with_vowels() {
        for doc in generate_corpus(7, 200) {
            let lower = doc.to_ascii_lowercase();
            let words: Vec<&str> = lower
                .split(|c: char| !c.is_ascii_alphanumeric())
                .filter(|w| !w.is_empty())
                .collect();
            for pair in words.windows(2) {
                if pair[0] == "a" {
                    assert!(!starts_with_vowel(pair[1]), "`a {}` in {doc:?}", pair[1]);
                }
                if pair[0] == "an" {
                    assert!(starts_with_vowel(pair[1]), "`an {}` in {doc:?}", pair[1]);
                }
            }
        }
    }
}
