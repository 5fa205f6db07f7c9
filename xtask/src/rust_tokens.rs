//! A minimal Rust lexer for `check-cycles`: identifiers, `::` and single punctuation characters
//! with their line numbers. Comments (doc comments included), string, byte-string, raw-string
//! and char literals, lifetimes and number literals produce no tokens, so a path written in a
//! doc link or an error message is not taken for a dependency.

/// One token.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Tok {
    /// An identifier or keyword (`r#type` gives `type`; `$crate` is one identifier).
    Ident(String),
    /// `::`
    PathSep,
    Punct(char),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Token {
    pub tok: Tok,
    /// 1-based line of the token's first character.
    pub line: usize,
}

/// The tokens of `src`. Never fails: unterminated literals or comments end at the end of input.
pub fn tokenize(src: &str) -> Vec<Token> {
    Lexer {
        c: src.chars().collect(),
        i: 0,
        line: 1,
        out: Vec::new(),
    }
    .run()
}

struct Lexer {
    c: Vec<char>,
    i: usize,
    line: usize,
    out: Vec<Token>,
}

fn is_ident_start(ch: char) -> bool {
    ch == '_' || ch.is_alphabetic()
}

fn is_ident_continue(ch: char) -> bool {
    ch == '_' || ch.is_alphanumeric()
}

impl Lexer {
    fn at(&self, k: usize) -> Option<char> {
        self.c.get(self.i + k).copied()
    }

    /// Moves past one character, counting lines.
    fn bump(&mut self) {
        if self.at(0) == Some('\n') {
            self.line += 1;
        }
        self.i += 1;
    }

    fn push(&mut self, tok: Tok, line: usize) {
        self.out.push(Token { tok, line });
    }

    fn run(mut self) -> Vec<Token> {
        while let Some(ch) = self.at(0) {
            let line = self.line;
            match ch {
                '/' if self.at(1) == Some('/') => {
                    while self.at(0).is_some_and(|c| c != '\n') {
                        self.bump();
                    }
                }
                '/' if self.at(1) == Some('*') => self.block_comment(),
                '"' => self.quoted('"'),
                '\'' => self.char_or_lifetime(),
                ':' if self.at(1) == Some(':') => {
                    self.i += 2;
                    self.push(Tok::PathSep, line);
                }
                '$' if self.word_at(1) == "crate" => {
                    self.i += 1 + "crate".len();
                    self.push(Tok::Ident("$crate".into()), line);
                }
                c if c.is_ascii_digit() => {
                    while self.at(0).is_some_and(is_ident_continue) {
                        self.bump();
                    }
                }
                c if is_ident_start(c) => self.ident_or_prefixed_literal(),
                c if c.is_whitespace() => self.bump(),
                c => {
                    self.bump();
                    self.push(Tok::Punct(c), line);
                }
            }
        }
        self.out
    }

    /// The identifier starting `k` characters ahead (empty if none).
    fn word_at(&self, k: usize) -> String {
        let mut j = self.i + k;
        let mut w = String::new();
        if self.c.get(j).is_some_and(|&c| is_ident_start(c)) {
            while let Some(&c) = self.c.get(j).filter(|&&c| is_ident_continue(c)) {
                w.push(c);
                j += 1;
            }
        }
        w
    }

    fn block_comment(&mut self) {
        let mut depth = 0usize;
        while let Some(ch) = self.at(0) {
            if ch == '/' && self.at(1) == Some('*') {
                depth += 1;
                self.i += 2;
            } else if ch == '*' && self.at(1) == Some('/') {
                depth -= 1;
                self.i += 2;
                if depth == 0 {
                    return;
                }
            } else {
                self.bump();
            }
        }
    }

    /// A literal opened by `quote` at the current position, with backslash escapes.
    fn quoted(&mut self, quote: char) {
        self.bump();
        while let Some(ch) = self.at(0) {
            self.bump();
            if ch == '\\' {
                self.bump();
            } else if ch == quote {
                return;
            }
        }
    }

    /// `r"…"`, `r#"…"#` (any number of `#`), with the `r` already consumed.
    fn raw_string(&mut self) {
        let mut hashes = 0;
        while self.at(0) == Some('#') {
            hashes += 1;
            self.i += 1;
        }
        self.bump(); // the opening quote
        while let Some(ch) = self.at(0) {
            self.bump();
            if ch == '"' && (0..hashes).all(|k| self.at(k) == Some('#')) {
                self.i += hashes;
                return;
            }
        }
    }

    /// A char literal (`'a'`, `'\n'`, `'\''`, `'\u{1F600}'`) or a lifetime/label (`'a`).
    fn char_or_lifetime(&mut self) {
        if self.at(1) == Some('\\') {
            self.i += 3; // quote, backslash, the escaped character
            while self.at(0).is_some_and(|c| c != '\'') {
                self.bump();
            }
            self.i += 1;
        } else if self.at(2) == Some('\'') {
            self.i += 3;
        } else {
            self.i += 1;
            while self.at(0).is_some_and(is_ident_continue) {
                self.i += 1;
            }
        }
    }

    fn ident_or_prefixed_literal(&mut self) {
        let line = self.line;
        let word = self.word_at(0);
        let next = self.c.get(self.i + word.chars().count()).copied();
        let after_hashes = {
            let mut j = self.i + word.chars().count();
            while self.c.get(j) == Some(&'#') {
                j += 1;
            }
            self.c.get(j).copied()
        };
        self.i += word.chars().count();
        match (word.as_str(), next) {
            ("r" | "br" | "cr", Some('"' | '#')) if after_hashes == Some('"') => self.raw_string(),
            ("b" | "c", Some('"')) => self.quoted('"'),
            ("b", Some('\'')) => self.char_or_lifetime(),
            ("r", Some('#')) => {
                // A raw identifier: `r#type` is the identifier `type`.
                self.i += 1;
                let raw = self.word_at(0);
                self.i += raw.chars().count();
                self.push(Tok::Ident(raw), line);
            }
            _ => self.push(Tok::Ident(word), line),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn idents(src: &str) -> Vec<String> {
        tokenize(src)
            .into_iter()
            .filter_map(|t| match t.tok {
                Tok::Ident(s) => Some(s),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn comments_literals_and_lifetimes_give_no_identifiers() {
        let src = r###"
            // crate::a in a line comment
            /* crate::b /* nested crate::c */ still comment */
            /// [`crate::d`]
            let s = "crate::e \" crate::f";
            let r = r#"crate::g " crate::h"#;
            let b = b"crate::i"; let c = 'x'; let q = '\''; let u = '\u{1F600}';
            fn f<'a>(x: &'a str) -> &'a str { x }
            let n = 0x1F_u8 + 1e5 as u8;
        "###;
        assert_eq!(
            idents(src),
            [
                "let", "s", "let", "r", "let", "b", "let", "c", "let", "q", "let", "u", "fn", "f",
                "x", "str", "str", "x", "let", "n", "as", "u8"
            ]
        );
    }

    #[test]
    fn paths_keep_their_separators_and_lines() {
        let toks = tokenize("use crate::a;\n$crate::b::C\nr#type");
        let lines: Vec<usize> = toks.iter().map(|t| t.line).collect();
        assert_eq!(lines, [1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 3]);
        assert_eq!(toks[2].tok, Tok::PathSep);
        assert_eq!(toks[5].tok, Tok::Ident("$crate".into()));
        assert_eq!(toks[10].tok, Tok::Ident("type".into()));
    }
}
