//! Which tables stay whole on the device and how many cache slots the others get, under a
//! byte budget for the embeddings (weights + sparse optimizer state): `tilearn ctr train
//! --gpu-embedding-budget SIZE --host-rows auto|T,T,...`.
//!
//! `auto` keeps every table on the device if they fit; otherwise it moves the largest tables
//! to host memory one at a time until the rest, plus a minimal cache for each moved table,
//! fits. The budget left over is shared among the host tables' caches in proportion to their
//! size (a bigger table gets more slots). A table's cache needs at least `min_slots` rows: the
//! distinct rows of the largest batch it will see (training or evaluation).

use std::str::FromStr;

use crate::error::{RecsysError, Result};
use crate::sparse_optim::SparseOptimizer;
use crate::tables::{TableLayout, TableSpec};

/// Which tables keep their rows in host memory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HostRows {
    /// As few as the budget allows, largest first.
    Auto,
    /// These table indices (the fused operator's order).
    Tables(Vec<usize>),
}

impl FromStr for HostRows {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, String> {
        if s.trim() == "auto" {
            return Ok(HostRows::Auto);
        }
        let tables = (s.split(',').map(|t| t.trim().parse::<usize>()))
            .collect::<std::result::Result<Vec<_>, _>>()
            .map_err(|_| format!("`{s}`: give `auto` or table indices such as `0,3,7`"))?;
        Ok(HostRows::Tables(tables))
    }
}

/// Where each table lives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResidencyPlan {
    /// Cache slots per table (the table's rows for a table kept whole on the device).
    pub slots: Vec<usize>,
    /// The tables whose rows live in host memory, ascending.
    pub host_tables: Vec<usize>,
    /// Device bytes of the embeddings (whole tables + caches, weights + optimizer state).
    pub device_bytes: u64,
    /// Host bytes of the host tables (weights + optimizer state).
    pub host_bytes: u64,
}

impl ResidencyPlan {
    /// Whether every table lives on the device (no cache needed).
    pub fn all_on_device(&self) -> bool {
        self.host_tables.is_empty()
    }
}

/// Bytes of one row of `spec` with `optimizer`'s state.
pub fn row_bytes(spec: &TableSpec, optimizer: &SparseOptimizer) -> u64 {
    let dim = spec.dim as u64;
    let state = match optimizer {
        SparseOptimizer::Sgd { .. } => 0,
        SparseOptimizer::RowWiseAdagrad { .. } => 1,
        SparseOptimizer::Adam { .. } => 2 * dim,
    };
    4 * (dim + state)
}

/// Plans the tables of `layout` into `budget` device bytes (see the module docs).
pub fn plan_residency(
    layout: &TableLayout,
    optimizer: &SparseOptimizer,
    budget: u64,
    host: &HostRows,
    min_slots: usize,
) -> Result<ResidencyPlan> {
    let specs = layout.specs();
    let row = |t: usize| row_bytes(&specs[t], optimizer);
    let whole = |t: usize| specs[t].rows as u64 * row(t);
    // A cache of fewer rows than the table; smaller tables gain nothing from a cache.
    let cacheable = |t: usize| specs[t].rows > min_slots.max(1);
    let min_cache = |t: usize| min_slots.max(1) as u64 * row(t);
    let need = |on_host: &[bool]| -> u64 {
        (0..specs.len())
            .map(|t| if on_host[t] { min_cache(t) } else { whole(t) })
            .sum()
    };
    let mut on_host = vec![false; specs.len()];
    match host {
        HostRows::Tables(tables) => {
            for &t in tables {
                if t >= specs.len() {
                    return Err(RecsysError::invalid(
                        "--host-rows",
                        format!(
                            "table {t} does not exist; the model has tables 0..{}",
                            specs.len()
                        ),
                    ));
                }
                on_host[t] = cacheable(t);
            }
        }
        HostRows::Auto => {
            let mut by_size: Vec<usize> = (0..specs.len()).filter(|&t| cacheable(t)).collect();
            by_size.sort_by_key(|&t| std::cmp::Reverse(whole(t)));
            for t in by_size {
                if need(&on_host) <= budget {
                    break;
                }
                on_host[t] = true;
            }
        }
    }
    let needed = need(&on_host);
    if needed > budget {
        return Err(RecsysError::invalid(
            "--gpu-embedding-budget",
            format!(
                "{budget} bytes cannot hold the device-resident tables plus a cache of {min_slots} rows (one batch's distinct rows) for each host table: that needs {needed} bytes; raise the budget, put more tables in host memory (--host-rows auto) or lower --batch-size"
            ),
        ));
    }
    let host_tables: Vec<usize> = (0..specs.len()).filter(|&t| on_host[t]).collect();
    let host_total: u64 = host_tables.iter().map(|&t| whole(t)).sum();
    let spare = budget - needed;
    let mut slots: Vec<usize> = specs.iter().map(|s| s.rows).collect();
    for &t in &host_tables {
        // The spare bytes in proportion to the table's size, never the whole table.
        let share = (spare as u128 * whole(t) as u128 / host_total.max(1) as u128) as u64;
        let extra = (share / row(t)) as usize;
        slots[t] = (min_slots.max(1) + extra).min(specs[t].rows - 1);
    }
    let device_bytes = (0..specs.len()).map(|t| slots[t] as u64 * row(t)).sum();
    Ok(ResidencyPlan {
        slots,
        device_bytes,
        host_bytes: host_total,
        host_tables,
    })
}

/// Parses a byte count: `2GiB`, `512 MiB`, `1.5GB`, `800kB`, `4096` (binary units are powers
/// of 1024, decimal ones of 1000).
pub fn parse_bytes(text: &str) -> std::result::Result<u64, String> {
    let s = text.trim();
    let split = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(s.len());
    let (number, unit) = s.split_at(split);
    let scale: f64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "kb" => 1e3,
        "mb" => 1e6,
        "gb" => 1e9,
        "tb" => 1e12,
        "kib" => 1024.0,
        "mib" => 1024.0 * 1024.0,
        "gib" => 1024.0 * 1024.0 * 1024.0,
        "tib" => 1024.0 * 1024.0 * 1024.0 * 1024.0,
        _ => {
            return Err(format!(
                "`{text}`: unknown unit; write e.g. 2GiB, 512MiB, 1.5GB or bytes"
            ));
        }
    };
    let value: f64 = number
        .parse()
        .map_err(|_| format!("`{text}`: not a size; write e.g. 2GiB, 512MiB, 1.5GB or bytes"))?;
    let bytes = value * scale;
    if !bytes.is_finite() || bytes < 1.0 || bytes > u64::MAX as f64 {
        return Err(format!("`{text}`: a size must be at least 1 byte"));
    }
    Ok(bytes as u64)
}
