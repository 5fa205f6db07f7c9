//! Policy 0, time-based: mixed precision on for `start <= t <= end`, fp32 elsewhere.

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// The seed's default `start_time`.
pub const DEFAULT_START: u64 = 10;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct TimePolicy {
    start: u64,
    end: u64,
}

impl TimePolicy {
    /// `end` is inclusive (the seed recommends the last epoch, which should run mixed too).
    pub fn new(start: u64, end: u64) -> Result<Self> {
        check_order(start, end)?;
        Ok(TimePolicy { start, end })
    }

    pub fn start(&self) -> u64 {
        self.start
    }

    pub fn end(&self) -> u64 {
        self.end
    }

    pub fn in_window(&self, period: u64) -> bool {
        (self.start..=self.end).contains(&period)
    }
}

pub(crate) fn check_order(start: u64, end: u64) -> Result<()> {
    if end < start {
        return Err(Error::EndBeforeStart { start, end });
    }
    Ok(())
}
