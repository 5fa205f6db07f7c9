//! Writing training checkpoints so that an interrupted save never damages the previous one.
//!
//! A checkpoint is first written completely into `checkpoint-N.tmp/`, then renamed to
//! `checkpoint-N/`. A crash mid-save leaves only a `.tmp` directory, which the next save of
//! the same step removes and `--resume-from-checkpoint` never picks.

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};

use crate::{EngineError, Result};

/// Writes `bytes` to `path` through `path.tmp` + fsync + rename.
pub fn write_atomically(path: &Path, bytes: &[u8]) -> Result<()> {
    let tmp = tmp_path(path);
    let mut file = fs::File::create(&tmp).map_err(|e| EngineError::io(&tmp, "create", e))?;
    file.write_all(bytes)
        .and_then(|_| file.sync_all())
        .map_err(|e| EngineError::io(&tmp, "write", e))?;
    fs::rename(&tmp, path).map_err(|e| EngineError::io(path, "rename into place", e))
}

fn tmp_path(path: &Path) -> PathBuf {
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(".tmp");
    path.with_file_name(name)
}

/// The directory name of the checkpoint after `step` optimizer steps.
pub fn checkpoint_dir(output_dir: &Path, step: u64) -> PathBuf {
    output_dir.join(format!("checkpoint-{step}"))
}

/// Runs `write` on a fresh staging directory, then moves it to `final_dir` as one rename.
/// An existing `final_dir` (a re-run of the same step) is replaced only after the new one is
/// complete.
pub fn save_dir_atomically(
    final_dir: &Path,
    write: impl FnOnce(&Path) -> Result<()>,
) -> Result<()> {
    let staging = tmp_path(final_dir);
    if staging.exists() {
        fs::remove_dir_all(&staging)
            .map_err(|e| EngineError::io(&staging, "remove a stale staging directory", e))?;
    }
    fs::create_dir_all(&staging).map_err(|e| EngineError::io(&staging, "create", e))?;
    write(&staging)?;
    if final_dir.exists() {
        let mut old = final_dir.as_os_str().to_os_string();
        old.push(".old");
        let old = PathBuf::from(old);
        let _ = fs::remove_dir_all(&old);
        fs::rename(final_dir, &old).map_err(|e| EngineError::io(final_dir, "move aside", e))?;
        fs::rename(&staging, final_dir)
            .map_err(|e| EngineError::io(final_dir, "rename into place", e))?;
        let _ = fs::remove_dir_all(&old);
    } else {
        fs::rename(&staging, final_dir)
            .map_err(|e| EngineError::io(final_dir, "rename into place", e))?;
    }
    Ok(())
}

/// The newest complete `checkpoint-N` directory in `output_dir`, if any.
pub fn latest_checkpoint(output_dir: &Path) -> Option<PathBuf> {
    let entries = fs::read_dir(output_dir).ok()?;
    entries
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let name = e.file_name().into_string().ok()?;
            let step: u64 = name.strip_prefix("checkpoint-")?.parse().ok()?;
            Some((step, e.path()))
        })
        .max_by_key(|(step, _)| *step)
        .map(|(_, path)| path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failed_write_keeps_previous_checkpoint() {
        let dir = tempfile::tempdir().unwrap();
        let ckpt = checkpoint_dir(dir.path(), 10);
        save_dir_atomically(&ckpt, |d| write_atomically(&d.join("a.txt"), b"good")).unwrap();
        let failed = save_dir_atomically(&ckpt, |d| {
            write_atomically(&d.join("a.txt"), b"half")?;
            Err(EngineError::InvalidArgument {
                argument: "test".into(),
                message: "simulated crash mid-save".into(),
            })
        });
        assert!(failed.is_err());
        assert_eq!(fs::read(ckpt.join("a.txt")).unwrap(), b"good");
        assert_eq!(latest_checkpoint(dir.path()).unwrap(), ckpt);
    }

    #[test]
    fn latest_ignores_staging_dirs() {
        let dir = tempfile::tempdir().unwrap();
        fs::create_dir(dir.path().join("checkpoint-5")).unwrap();
        fs::create_dir(dir.path().join("checkpoint-9.tmp")).unwrap();
        assert_eq!(
            latest_checkpoint(dir.path()).unwrap(),
            dir.path().join("checkpoint-5")
        );
    }
}
