//! Criteo's TSV format (the Display Advertising Challenge / Terabyte logs): per line a label
//! (0 or 1), 13 integer features and 26 categorical features as hex strings, tab-separated;
//! any feature may be empty. A malformed line (wrong field count, a label that is not 0/1, a
//! non-integer or non-hex value) is skipped, counted and reported with its line number and
//! reason; the reader never panics on input.

use std::io::BufRead;
use std::path::Path;

use serde::Serialize;

use super::batch::{CtrBatch, MISSING, transform_dense};
use crate::error::{RecsysError, Result};

/// Criteo's widths.
pub const CRITEO_DENSE: usize = 13;
pub const CRITEO_FIELDS: usize = 26;

/// How many lines were read and why the skipped ones were malformed (the first few reasons).
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct ParseReport {
    pub lines: usize,
    pub samples: usize,
    pub malformed: usize,
    /// `(line number, reason)` of the first [`ParseReport::KEPT_ERRORS`] malformed lines.
    pub first_errors: Vec<(usize, String)>,
}

impl ParseReport {
    pub const KEPT_ERRORS: usize = 10;

    fn malformed(&mut self, line: usize, reason: String) {
        self.malformed += 1;
        if self.first_errors.len() < Self::KEPT_ERRORS {
            self.first_errors.push((line, reason));
        }
    }
}

/// Parses one line into `batch` (appending a sample) or says why it is malformed; `batch` is
/// unchanged on error.
pub fn parse_line(line: &str, batch: &mut CtrBatch) -> std::result::Result<(), String> {
    let line = line.strip_suffix('\r').unwrap_or(line);
    let fields: Vec<&str> = line.split('\t').collect();
    let want = 1 + batch.num_dense + batch.num_fields;
    if fields.len() != want {
        return Err(format!(
            "{} tab-separated fields, expected {want}",
            fields.len()
        ));
    }
    let label = match fields[0] {
        "0" => 0.0,
        "1" => 1.0,
        other => return Err(format!("label `{other}` is not 0 or 1")),
    };
    let mut dense = Vec::with_capacity(batch.num_dense);
    for (i, f) in fields[1..=batch.num_dense].iter().enumerate() {
        let value = if f.is_empty() {
            None
        } else {
            Some(
                f.parse::<i64>()
                    .map_err(|_| format!("integer feature I{} is `{f}`", i + 1))?,
            )
        };
        dense.push(transform_dense(value));
    }
    let mut cats = Vec::with_capacity(batch.num_fields);
    for (i, f) in fields[1 + batch.num_dense..].iter().enumerate() {
        let value = if f.is_empty() {
            MISSING
        } else if f.len() <= 15 {
            // At most 15 hex digits, so no value reaches the MISSING sentinel.
            u64::from_str_radix(f, 16)
                .map_err(|_| format!("categorical feature C{} is `{f}`, not hex", i + 1))?
        } else {
            return Err(format!(
                "categorical feature C{} has {} hex digits (at most 15)",
                i + 1,
                f.len()
            ));
        };
        cats.push(value);
    }
    batch.labels.push(label);
    batch.dense.extend_from_slice(&dense);
    batch.cats.extend_from_slice(&cats);
    Ok(())
}

/// Reads every line of a Criteo TSV stream (`source` names it in errors).
pub fn read_tsv(reader: impl BufRead, source: &Path) -> Result<(CtrBatch, ParseReport)> {
    let mut batch = CtrBatch::new(CRITEO_DENSE, CRITEO_FIELDS);
    let mut report = ParseReport::default();
    for (i, line) in reader.lines().enumerate() {
        let line = line.map_err(|e| RecsysError::io(source, e))?;
        report.lines += 1;
        if line.trim().is_empty() {
            report.malformed(i + 1, "empty line".into());
            continue;
        }
        if let Err(reason) = parse_line(&line, &mut batch) {
            report.malformed(i + 1, reason);
        }
    }
    report.samples = batch.len();
    Ok((batch, report))
}

/// [`read_tsv`] of a file.
pub fn read_tsv_file(path: &Path) -> Result<(CtrBatch, ParseReport)> {
    let file = std::fs::File::open(path).map_err(|e| RecsysError::io(path, e))?;
    read_tsv(std::io::BufReader::new(file), path)
}
