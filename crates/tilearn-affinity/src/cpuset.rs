//! [`CpuSet`]: a set of logical CPU ids, parsed from and printed as the kernel's cpu list format
//! (`0-3,8-11`), the format of every sysfs and cgroup file this crate reads.

use std::collections::BTreeSet;
use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::error::{AffinityError, Result};

/// Largest CPU id accepted (exclusive). The kernel's NR_CPUS tops out at 8192 today; the bound
/// only stops a corrupt file from making us allocate a giant affinity mask.
pub const MAX_CPUS: usize = 1 << 16;

/// A set of logical CPU ids, iterated in ascending order.
#[derive(Clone, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct CpuSet(BTreeSet<usize>);

impl CpuSet {
    /// The empty set.
    pub fn new() -> Self {
        CpuSet(BTreeSet::new())
    }

    /// Parses the kernel's cpu list format: comma-separated ids and inclusive ranges
    /// (`0-3,8-11`). Surrounding whitespace (the trailing newline of a sysfs file) is ignored
    /// and an empty or blank string is the empty set, as sysfs writes for a CPU-less node.
    pub fn parse(input: &str) -> Result<Self> {
        let bad = |reason: String| AffinityError::CpuList {
            input: input.to_string(),
            reason,
        };
        let text = input.trim();
        let mut set = BTreeSet::new();
        if text.is_empty() {
            return Ok(CpuSet(set));
        }
        for item in text.split(',') {
            let item = item.trim();
            if item.is_empty() {
                return Err(bad("empty element between commas".into()));
            }
            let (lo, hi) = match item.split_once('-') {
                Some((lo, hi)) => (parse_id(lo, input)?, parse_id(hi, input)?),
                None => {
                    let id = parse_id(item, input)?;
                    (id, id)
                }
            };
            if lo > hi {
                return Err(bad(format!("range {item} runs backwards")));
            }
            set.extend(lo..=hi);
        }
        Ok(CpuSet(set))
    }

    /// Number of CPUs in the set.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    pub fn contains(&self, cpu: usize) -> bool {
        self.0.contains(&cpu)
    }

    /// Adds `cpu`; ids at or above [`MAX_CPUS`] are refused.
    pub fn insert(&mut self, cpu: usize) -> Result<()> {
        if cpu >= MAX_CPUS {
            return Err(AffinityError::CpuList {
                input: cpu.to_string(),
                reason: format!("cpu id is not below {MAX_CPUS}"),
            });
        }
        self.0.insert(cpu);
        Ok(())
    }

    /// Ascending CPU ids.
    pub fn iter(&self) -> impl Iterator<Item = usize> + '_ {
        self.0.iter().copied()
    }

    /// Ascending CPU ids as a vector (handy in assertions and JSON).
    pub fn to_vec(&self) -> Vec<usize> {
        self.iter().collect()
    }

    /// Lowest CPU id, if any.
    pub fn first(&self) -> Option<usize> {
        self.0.first().copied()
    }

    /// Highest CPU id, if any.
    pub fn last(&self) -> Option<usize> {
        self.0.last().copied()
    }

    pub fn intersection(&self, other: &CpuSet) -> CpuSet {
        CpuSet(self.0.intersection(&other.0).copied().collect())
    }

    pub fn union(&self, other: &CpuSet) -> CpuSet {
        CpuSet(self.0.union(&other.0).copied().collect())
    }

    pub fn difference(&self, other: &CpuSet) -> CpuSet {
        CpuSet(self.0.difference(&other.0).copied().collect())
    }

    pub fn is_subset(&self, other: &CpuSet) -> bool {
        self.0.is_subset(&other.0)
    }
}

fn parse_id(text: &str, input: &str) -> Result<usize> {
    let text = text.trim();
    let bad = |reason: String| AffinityError::CpuList {
        input: input.to_string(),
        reason,
    };
    if text.is_empty() || !text.bytes().all(|b| b.is_ascii_digit()) {
        return Err(bad(format!("{text:?} is not a cpu number")));
    }
    let id: usize = text
        .parse()
        .map_err(|_| bad(format!("{text} is too large")))?;
    if id >= MAX_CPUS {
        return Err(bad(format!("cpu {id} is not below {MAX_CPUS}")));
    }
    Ok(id)
}

impl FromIterator<usize> for CpuSet {
    /// Collects ids as given; callers build sets from ids they already validated (sysfs or
    /// other sets), so no bound is checked here.
    fn from_iter<I: IntoIterator<Item = usize>>(iter: I) -> Self {
        CpuSet(iter.into_iter().collect())
    }
}

impl FromStr for CpuSet {
    type Err = AffinityError;
    fn from_str(s: &str) -> Result<Self> {
        CpuSet::parse(s)
    }
}

/// Prints the kernel's format with maximal ranges (`0-3,8-11`); the empty set prints as `""`
/// would in sysfs, i.e. nothing. `parse(format(x)) == x` for every set.
impl fmt::Display for CpuSet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut first = true;
        let mut ids = self.iter().peekable();
        while let Some(lo) = ids.next() {
            let mut hi = lo;
            while ids.peek() == Some(&(hi + 1)) {
                hi += 1;
                ids.next();
            }
            if !first {
                f.write_str(",")?;
            }
            first = false;
            if lo == hi {
                write!(f, "{lo}")?;
            } else {
                write!(f, "{lo}-{hi}")?;
            }
        }
        Ok(())
    }
}

impl fmt::Debug for CpuSet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "CpuSet({self})")
    }
}

/// Serialised as the cpu list string, the form people read in sysfs.
impl Serialize for CpuSet {
    fn serialize<S: Serializer>(&self, serializer: S) -> std::result::Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for CpuSet {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> std::result::Result<Self, D::Error> {
        let text = String::deserialize(deserializer)?;
        CpuSet::parse(&text).map_err(serde::de::Error::custom)
    }
}
