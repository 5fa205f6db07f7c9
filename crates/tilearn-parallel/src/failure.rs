//! Failure reports: a rank that fails writes why to the store before it exits, so the launcher can
//! print one message naming the rank that caused the failure instead of every rank's echo of it.

use crate::error::Result;
use crate::store::StoreClient;

/// One rank's report.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FailureReport {
    pub rank: usize,
    /// A consequence of another rank's failure (a lost or silent peer), not a cause.
    pub secondary: bool,
    pub message: String,
}

fn count_key(prefix: &str) -> String {
    format!("{prefix}/failures")
}

/// Appends a report under `prefix` (the attempt's key prefix).
pub fn write_report(store: &StoreClient, prefix: &str, report: &FailureReport) -> Result<()> {
    let index = store.add(&count_key(prefix), 1)?;
    let kind = if report.secondary {
        "secondary"
    } else {
        "primary"
    };
    let value = format!("{}\n{kind}\n{}", report.rank, report.message);
    store.set(&format!("{prefix}/failure/{index}"), value.as_bytes())
}

/// Every report under `prefix`, in the order they were written; malformed entries are skipped.
pub fn read_reports(store: &StoreClient, prefix: &str) -> Result<Vec<FailureReport>> {
    let count = store.add(&count_key(prefix), 0)?;
    let mut reports = Vec::new();
    for index in 1..=count {
        let Some(value) = store.get(&format!("{prefix}/failure/{index}"))? else {
            continue; // counted but not yet written: the writer died in between
        };
        let text = String::from_utf8_lossy(&value);
        let mut parts = text.splitn(3, '\n');
        let (Some(rank), Some(kind), Some(message)) = (parts.next(), parts.next(), parts.next())
        else {
            continue;
        };
        let Ok(rank) = rank.parse() else { continue };
        reports.push(FailureReport {
            rank,
            secondary: kind == "secondary",
            message: message.to_string(),
        });
    }
    Ok(reports)
}
