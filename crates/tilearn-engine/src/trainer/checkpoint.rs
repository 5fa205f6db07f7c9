//! Writing training checkpoints so that an interrupted save never damages the previous one.
//!
//! A checkpoint is first written completely into `checkpoint-N.tmp/`, then renamed to
//! `checkpoint-N/`. A failed save removes its `.tmp` directory (freeing the space it took); a
//! crash mid-save leaves only a `.tmp` directory, which the next save of the same step removes
//! and `--resume-from-checkpoint` never picks. Old checkpoints are rotated away only after a
//! newer one is complete.

use std::fs;
use std::path::{Path, PathBuf};

use tilearn_ops::fs::{sync_parent_dir, tmp_path, write_bytes_atomic};

use crate::{EngineError, Result};

/// Writes `bytes` to `path` atomically ([`tilearn_ops::fs`]).
pub fn write_atomically(path: &Path, bytes: &[u8]) -> Result<()> {
    write_bytes_atomic(path, bytes).map_err(|e| EngineError::io(path, "write", e))
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
    let staging = prepare_staging(final_dir)?;
    if let Err(e) = write(&staging) {
        discard_staging(&staging);
        return Err(e);
    }
    commit_staging(&staging, final_dir)
}

/// Creates the empty staging directory of `final_dir` (removing a stale one) and returns it.
/// The first half of [`save_dir_atomically`], for saves that several ranks write into.
pub fn prepare_staging(final_dir: &Path) -> Result<PathBuf> {
    let staging = tmp_path(final_dir);
    if staging.exists() {
        fs::remove_dir_all(&staging)
            .map_err(|e| EngineError::io(&staging, "remove a stale staging directory", e))?;
    }
    fs::create_dir_all(&staging).map_err(|e| EngineError::io(&staging, "create", e))?;
    Ok(staging)
}

/// Removes a staging directory after a failed save (best effort: the space a half-written
/// checkpoint holds is what the final model may need next).
pub fn discard_staging(staging: &Path) {
    let _ = fs::remove_dir_all(staging);
}

/// Moves a complete staging directory to `final_dir` (replacing an older one only now).
pub fn commit_staging(staging: &Path, final_dir: &Path) -> Result<()> {
    if final_dir.exists() {
        let mut old = final_dir.as_os_str().to_os_string();
        old.push(".old");
        let old = PathBuf::from(old);
        let _ = fs::remove_dir_all(&old);
        fs::rename(final_dir, &old).map_err(|e| EngineError::io(final_dir, "move aside", e))?;
        fs::rename(staging, final_dir)
            .map_err(|e| EngineError::io(final_dir, "rename into place", e))?;
        let _ = fs::remove_dir_all(&old);
    } else {
        fs::rename(staging, final_dir)
            .map_err(|e| EngineError::io(final_dir, "rename into place", e))?;
    }
    sync_parent_dir(final_dir);
    Ok(())
}

/// The complete `checkpoint-N` directories in `output_dir`, oldest (lowest step) first.
pub fn checkpoints(output_dir: &Path) -> Vec<(u64, PathBuf)> {
    let Ok(entries) = fs::read_dir(output_dir) else {
        return Vec::new();
    };
    let mut found: Vec<(u64, PathBuf)> = entries
        .filter_map(|e| e.ok())
        .filter(|e| e.path().is_dir())
        .filter_map(|e| {
            let name = e.file_name().into_string().ok()?;
            let step: u64 = name.strip_prefix("checkpoint-")?.parse().ok()?;
            Some((step, e.path()))
        })
        .collect();
    found.sort();
    found
}

/// Deletes the oldest checkpoints until at most `limit` remain (Hugging Face's
/// `save_total_limit`); the ones in `keep` (the one just completed, the one the run resumed
/// from, the best one) are never deleted, so more than `limit` may remain. Returns the deleted
/// directories.
pub fn rotate_checkpoints(output_dir: &Path, limit: usize, keep: &[&Path]) -> Result<Vec<PathBuf>> {
    let all = checkpoints(output_dir);
    let excess = all.len().saturating_sub(limit);
    let mut removed = Vec::new();
    let kept = |d: &Path| keep.iter().any(|k| same_dir(k, d));
    for (_, dir) in all.into_iter().filter(|(_, d)| !kept(d)).take(excess) {
        fs::remove_dir_all(&dir).map_err(|e| {
            EngineError::io(&dir, "delete an old checkpoint (--save-total-limit)", e)
        })?;
        removed.push(dir);
    }
    Ok(removed)
}

/// Whether two paths name the same directory (a path recorded in a trainer state may be
/// spelled differently from the listing's).
fn same_dir(a: &Path, b: &Path) -> bool {
    a == b || matches!((fs::canonicalize(a), fs::canonicalize(b)), (Ok(x), Ok(y)) if x == y)
}

/// The newest complete `checkpoint-N` directory in `output_dir`, if any.
pub fn latest_checkpoint(output_dir: &Path) -> Option<PathBuf> {
    checkpoints(output_dir).pop().map(|(_, path)| path)
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
        assert!(
            !tmp_path(&ckpt).exists(),
            "the failed staging dir is removed"
        );
        assert_eq!(latest_checkpoint(dir.path()).unwrap(), ckpt);
    }

    #[test]
    fn rotation_keeps_the_newest_and_deletes_the_oldest() {
        let dir = tempfile::tempdir().unwrap();
        for step in [2, 10, 4, 8] {
            fs::create_dir(checkpoint_dir(dir.path(), step)).unwrap();
        }
        fs::create_dir(dir.path().join("checkpoint-12.tmp")).unwrap();
        let newest = checkpoint_dir(dir.path(), 10);
        let removed = rotate_checkpoints(dir.path(), 2, &[&newest]).unwrap();
        assert_eq!(
            removed,
            [checkpoint_dir(dir.path(), 2), checkpoint_dir(dir.path(), 4)]
        );
        let left: Vec<u64> = checkpoints(dir.path())
            .into_iter()
            .map(|(s, _)| s)
            .collect();
        assert_eq!(left, [8, 10]);
        assert!(dir.path().join("checkpoint-12.tmp").exists());
    }

    #[test]
    fn rotation_never_deletes_the_resumed_or_best_checkpoint() {
        let dir = tempfile::tempdir().unwrap();
        for step in [2, 4, 6, 8] {
            fs::create_dir(checkpoint_dir(dir.path(), step)).unwrap();
        }
        let (resumed, best, newest) = (
            checkpoint_dir(dir.path(), 2),
            // Spelled another way, as a path recorded in a trainer state may be.
            dir.path().join(".").join("checkpoint-6"),
            checkpoint_dir(dir.path(), 8),
        );
        let removed = rotate_checkpoints(dir.path(), 1, &[&newest, &resumed, &best]).unwrap();
        assert_eq!(removed, [checkpoint_dir(dir.path(), 4)]);
        let left: Vec<u64> = checkpoints(dir.path())
            .into_iter()
            .map(|(s, _)| s)
            .collect();
        assert_eq!(left, [2, 6, 8]);
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
