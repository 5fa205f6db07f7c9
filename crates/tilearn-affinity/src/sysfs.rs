//! Where the topology files live. Every path is taken relative to a [`SysfsRoot`], so tests point
//! discovery at a fake tree in a temporary directory and the real run uses `/`.

use std::fs;
use std::path::{Path, PathBuf};

use crate::cpuset::CpuSet;

/// The directory that stands for `/` when reading `sys/…` and `proc/…` files.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SysfsRoot(PathBuf);

impl SysfsRoot {
    /// The real machine: files under `/`.
    pub fn host() -> Self {
        SysfsRoot(PathBuf::from("/"))
    }

    /// A tree whose `sys/` and `proc/` stand for the machine's (tests, chroots).
    pub fn new(root: impl Into<PathBuf>) -> Self {
        SysfsRoot(root.into())
    }

    /// The root directory itself.
    pub fn path(&self) -> &Path {
        &self.0
    }

    /// `relative` (written without a leading `/`) under the root.
    pub fn join(&self, relative: &str) -> PathBuf {
        self.0.join(relative.trim_start_matches('/'))
    }

    /// The trimmed contents of a file, or why it could not be read (for warnings).
    pub(crate) fn read(&self, relative: &str) -> Result<String, String> {
        let path = self.join(relative);
        fs::read_to_string(&path)
            .map(|s| s.trim().to_string())
            .map_err(|e| format!("cannot read {}: {e}", path.display()))
    }

    /// A cpu list file, or why not (missing, unreadable, malformed).
    pub(crate) fn read_cpulist(&self, relative: &str) -> Result<CpuSet, String> {
        let text = self.read(relative)?;
        CpuSet::parse(&text).map_err(|e| format!("{}: {e}", self.join(relative).display()))
    }

    /// Names of the entries of a directory, sorted; or why it could not be listed.
    pub(crate) fn list(&self, relative: &str) -> Result<Vec<String>, String> {
        let path = self.join(relative);
        let entries =
            fs::read_dir(&path).map_err(|e| format!("cannot list {}: {e}", path.display()))?;
        let mut names: Vec<String> = entries
            .filter_map(|e| e.ok())
            .filter_map(|e| e.file_name().into_string().ok())
            .collect();
        names.sort();
        Ok(names)
    }
}
