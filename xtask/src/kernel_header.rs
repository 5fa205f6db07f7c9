//! The header every kernel file opens with, checked by `cargo xtask build-kernels [--check]`.
//!
//! Each `crates/tilearn-kernels/kernels/*.cu` starts with a `//` comment that states, as fields
//! at the start of a comment line (continuation lines indented) or after a sentence's `. `:
//!
//! * `Fused:` what the kernel does in one pass that would otherwise take several;
//! * `Layout:` the memory layout of its tensors;
//! * `Precision:` the storage and arithmetic types and where it rounds;
//! * `Gradients:` or `Output:` what it writes (`=`) or accumulates (`+=`): the statement must
//!   contain `=` (which `+=` does), so the write convention is never left implicit.
//!
//! A field that does not apply says `n/a` (only `status.cu`, which has no kernels, does).

use std::path::{Path, PathBuf};

/// The fields every header must have, with a non-empty value.
const REQUIRED: [&str; 3] = ["Fused", "Layout", "Precision"];
/// The write statement: one of these, whose value contains `=` (or is `n/a`).
const WRITES: [&str; 2] = ["Gradients", "Output"];

/// Checks every `*.cu` directly in `dir`; the error lists each file with each missing field.
pub fn check_dir(dir: &Path) -> Result<(), String> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(|e| format!("cannot read {}: {e}", dir.display()))?
        .filter_map(|entry| entry.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|ext| ext == "cu"))
        .collect();
    files.sort();
    if files.is_empty() {
        return Err(format!("no *.cu kernel files in {}", dir.display()));
    }
    let mut problems = Vec::new();
    for file in &files {
        let text = std::fs::read_to_string(file)
            .map_err(|e| format!("cannot read {}: {e}", file.display()))?;
        problems.extend(
            check_header(&text)
                .into_iter()
                .map(|p| format!("{}: {p}", file.display())),
        );
    }
    if problems.is_empty() {
        return Ok(());
    }
    Err(format!(
        "kernel file headers are incomplete:\n  {}\n(every kernel file opens with a `//` comment \
         stating `Fused:`, `Layout:`, `Precision:` and `Gradients:` or `Output:` with what it \
         writes `=` or accumulates `+=`; see activation.cu)",
        problems.join("\n  ")
    ))
}

/// What is missing from the opening comment of one kernel file (empty when complete).
pub fn check_header(source: &str) -> Vec<String> {
    let comment = opening_comment(source);
    if comment.is_empty() {
        return vec!["does not open with a `//` comment (the kernel header)".to_string()];
    }
    let fields = fields(&comment);
    let value = |name: &str| {
        fields
            .iter()
            .find(|(label, _)| label == name)
            .map(|(_, value)| value.as_str())
    };
    let mut problems = Vec::new();
    for name in REQUIRED {
        match value(name) {
            None => problems.push(format!("the header has no `{name}:` field")),
            Some("") => problems.push(format!("the header's `{name}:` field is empty")),
            Some(_) => {}
        }
    }
    let writes: Vec<&str> = WRITES.iter().filter_map(|name| value(name)).collect();
    if writes.is_empty() {
        problems.push(
            "the header has no `Gradients:` or `Output:` field (what the kernel writes `=` or \
             accumulates `+=`)"
                .to_string(),
        );
    } else if !writes
        .iter()
        .any(|v| v.contains('=') || v.starts_with("n/a"))
    {
        problems.push(
            "the header's `Gradients:`/`Output:` field does not say whether outputs are written \
             (`=`) or accumulated (`+=`)"
                .to_string(),
        );
    }
    problems
}

/// The leading `//` lines of `source` with the `//` and one following space removed.
fn opening_comment(source: &str) -> Vec<&str> {
    source
        .lines()
        .map_while(|line| line.strip_prefix("//"))
        .map(|text| text.strip_prefix(' ').unwrap_or(text))
        .collect()
}

/// `(label, value)` of every field of the comment, in order. A field starts where a line's text
/// (not indented) begins with `Label:`, or after `. ` inside a line; its value runs to the next
/// field, with whitespace collapsed.
fn fields(comment: &[&str]) -> Vec<(String, String)> {
    let mut fields: Vec<(String, String)> = Vec::new();
    for line in comment {
        let mut rest = *line;
        let mut at_line_start = true;
        loop {
            let starts_field = at_line_start && !rest.starts_with(char::is_whitespace);
            match label_at(rest).filter(|_| starts_field) {
                Some((label, after)) => {
                    let (value, next) = split_at_inline_field(after);
                    fields.push((label.to_string(), value.trim().to_string()));
                    match next {
                        Some(next) => {
                            rest = next;
                            at_line_start = true;
                        }
                        None => break,
                    }
                }
                None => {
                    let (value, next) = split_at_inline_field(rest);
                    if let Some((_, v)) = fields.last_mut() {
                        append(v, value);
                    }
                    match next {
                        Some(next) => {
                            rest = next;
                            at_line_start = true;
                        }
                        None => break,
                    }
                }
            }
        }
    }
    fields
}

/// `Label` and the text after `Label:` when `text` starts with a capitalised label of words
/// (letters, spaces, `-`) followed by a colon and a space or the line's end.
fn label_at(text: &str) -> Option<(&str, &str)> {
    let colon = text.find(':')?;
    let label = &text[..colon];
    let after = &text[colon + 1..];
    let well_formed = label.starts_with(|c: char| c.is_ascii_uppercase())
        && label
            .chars()
            .all(|c| c.is_ascii_alphabetic() || c == ' ' || c == '-')
        && (after.is_empty() || after.starts_with(' '));
    well_formed.then_some((label, after))
}

/// Splits `text` before an inline `. Label:` of a required or write field (status.cu's
/// one-line header), keeping the full stop with the first part.
fn split_at_inline_field(text: &str) -> (&str, Option<&str>) {
    for (i, _) in text.match_indices(". ") {
        let next = &text[i + 2..];
        if let Some((label, _)) = label_at(next)
            && (REQUIRED.contains(&label) || WRITES.contains(&label))
        {
            return (&text[..=i], Some(next));
        }
    }
    (text, None)
}

fn append(value: &mut String, more: &str) {
    let more = more.trim();
    if more.is_empty() {
        return;
    }
    if !value.is_empty() {
        value.push(' ');
    }
    value.push_str(more);
}

#[cfg(test)]
mod tests {
    use super::*;

    const COMPLETE: &str = "\
// op.cu: an example kernel.
//
// Fused:     the scale and the add in one pass.
// Layout:    flat arrays of `n` elements.
// Precision: f32 arithmetic, outputs rounded once.
// Gradients: dx is written (`=`); dw is accumulated
//            (`+=`).

#include \"tilearn_kernels.h\"
";

    #[test]
    fn a_complete_header_passes() {
        assert_eq!(check_header(COMPLETE), Vec::<String>::new());
    }

    #[test]
    fn each_missing_field_is_named() {
        for name in REQUIRED {
            let source = COMPLETE.replace(&format!("// {name}:"), "// Notes:");
            let problems = check_header(&source);
            assert_eq!(
                problems,
                vec![format!("the header has no `{name}:` field")],
                "{source}"
            );
        }
    }

    #[test]
    fn an_empty_field_is_refused() {
        let source = COMPLETE.replace("// Layout:    flat arrays of `n` elements.", "// Layout:");
        assert_eq!(
            check_header(&source),
            vec!["the header's `Layout:` field is empty".to_string()]
        );
    }

    #[test]
    fn the_write_statement_must_state_the_convention() {
        let no_field = COMPLETE
            .replace("// Gradients: dx is written (`=`); dw is accumulated\n", "")
            .replace("//            (`+=`).\n", "");
        assert_eq!(check_header(&no_field).len(), 1, "{no_field}");
        assert!(check_header(&no_field)[0].contains("no `Gradients:` or `Output:`"));

        let no_convention = COMPLETE
            .replace("dx is written (`=`); dw is accumulated", "dx and dw")
            .replace("//            (`+=`).", "//            (see the wrapper).");
        let problems = check_header(&no_convention);
        assert_eq!(problems.len(), 1, "{problems:?}");
        assert!(problems[0].contains("written (`=`) or accumulated (`+=`)"));

        // The statement may sit on a continuation line, and `Output:` serves as well.
        let output = COMPLETE.replace("// Gradients:", "// Output:   ");
        assert_eq!(check_header(&output), Vec::<String>::new());
    }

    #[test]
    fn a_file_without_an_opening_comment_is_refused() {
        let problems = check_header("#include \"tilearn_kernels.h\"\n// Fused: late.\n");
        assert_eq!(problems.len(), 1);
        assert!(problems[0].contains("does not open with a `//` comment"));
    }

    #[test]
    fn fields_after_the_comment_do_not_count() {
        let source = "// op.cu: prose only.\n\n// Fused: x.\n// Layout: y.\n// Precision: z.\n";
        assert_eq!(check_header(source).len(), 4);
    }

    #[test]
    fn inline_fields_and_n_a_are_accepted() {
        let source = "// status.cu: no kernels.\n//\n// Fused: n/a. Layout: n/a. Precision: n/a. \
                      Output: n/a (static strings).\n";
        assert_eq!(check_header(source), Vec::<String>::new());
        let fields = fields(&opening_comment(source));
        assert_eq!(
            fields.iter().map(|(l, _)| l.as_str()).collect::<Vec<_>>(),
            ["Fused", "Layout", "Precision", "Output"]
        );
    }

    #[test]
    fn indented_lines_continue_the_field() {
        // `forward:` inside an indented continuation is not a field of its own.
        let source = "// Fused: a.\n// Layout: b.\n// Precision: c.\n// Gradients: none\n\
                      //   forward:  out = x.\n";
        assert_eq!(check_header(source), Vec::<String>::new());
    }

    #[test]
    fn every_kernel_in_the_workspace_has_its_header() {
        let dir = crate::cmd::workspace_root().join(crate::build_kernels::KERNELS);
        check_dir(&dir).unwrap();
    }

    #[test]
    fn the_error_names_the_file_and_the_field() {
        let dir = std::env::temp_dir().join(format!("xtask-kernel-header-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("bad.cu");
        std::fs::write(&file, COMPLETE.replace("// Precision:", "// Notes:")).unwrap();
        std::fs::write(dir.join("good.cu"), COMPLETE).unwrap();
        let err = check_dir(&dir).unwrap_err();
        std::fs::remove_dir_all(&dir).unwrap();
        assert!(err.contains(&format!(
            "{}: the header has no `Precision:` field",
            file.display()
        )));
        assert!(!err.contains("good.cu"), "{err}");
    }
}
