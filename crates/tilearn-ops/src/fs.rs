//! The one atomic file write of the workspace: every file tilearn saves (model shards, optimizer
//! state, data shards, logs of record) goes through [`AtomicFile`], so a crash or a full disk
//! never leaves a half-written file under the real name and never damages the previous one.
//!
//! Protocol: the bytes go to `<name>.tmp` beside the target (same filesystem, so the rename is
//! atomic), the file is flushed and `fsync`ed, renamed over the target, and the directory is
//! synced so the rename itself survives a power loss. A file dropped before [`AtomicFile::commit`]
//! removes its temporary file.

use std::fs::File;
use std::io::{self, BufWriter, Write};
use std::path::{Path, PathBuf};

/// `<path>.tmp`: the name a file (or a checkpoint directory) is written under before it is
/// renamed into place.
pub fn tmp_path(path: &Path) -> PathBuf {
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(".tmp");
    path.with_file_name(name)
}

/// A file being written atomically; see the module docs. Writes are buffered (1 MiB).
pub struct AtomicFile {
    target: PathBuf,
    tmp: PathBuf,
    writer: Option<BufWriter<File>>,
}

impl AtomicFile {
    /// Starts writing `path` (through `<path>.tmp`, created or truncated).
    pub fn create(path: &Path) -> io::Result<AtomicFile> {
        let tmp = tmp_path(path);
        let file = File::create(&tmp)?;
        Ok(AtomicFile {
            target: path.to_path_buf(),
            tmp,
            writer: Some(BufWriter::with_capacity(1 << 20, file)),
        })
    }

    /// The buffered writer; present from `create` until `commit` or drop take it.
    fn writer(&mut self) -> &mut BufWriter<File> {
        self.writer
            .as_mut()
            .expect("writer lives until commit or drop")
    }

    /// The underlying file, for positioned writes (e.g. a header patched after the payload).
    /// Buffered bytes are flushed first.
    pub fn file_mut(&mut self) -> io::Result<&mut File> {
        let writer = self.writer();
        writer.flush()?;
        Ok(writer.get_mut())
    }

    /// Flushes, syncs, renames onto the target and syncs the directory. On error the temporary
    /// file is removed and the target is untouched.
    pub fn commit(mut self) -> io::Result<()> {
        let writer = self
            .writer
            .take()
            .expect("writer lives until commit or drop");
        let result = writer
            .into_inner()
            .map_err(|e| e.into_error())
            .and_then(|file| file.sync_all())
            .and_then(|()| std::fs::rename(&self.tmp, &self.target));
        if let Err(e) = result {
            let _ = std::fs::remove_file(&self.tmp);
            return Err(e);
        }
        sync_parent_dir(&self.target);
        Ok(())
    }
}

impl Write for AtomicFile {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.writer().write(buf)
    }

    fn write_all(&mut self, buf: &[u8]) -> io::Result<()> {
        self.writer().write_all(buf)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.writer().flush()
    }
}

impl Drop for AtomicFile {
    fn drop(&mut self) {
        if self.writer.take().is_some() {
            // Not committed: the partial file must not linger (best effort; it may be gone).
            let _ = std::fs::remove_file(&self.tmp);
        }
    }
}

/// Writes `path` atomically with the bytes `write` produces.
pub fn write_atomic(
    path: &Path,
    write: impl FnOnce(&mut AtomicFile) -> io::Result<()>,
) -> io::Result<()> {
    let mut file = AtomicFile::create(path)?;
    write(&mut file)?;
    file.commit()
}

/// Writes `bytes` to `path` atomically.
pub fn write_bytes_atomic(path: &Path, bytes: &[u8]) -> io::Result<()> {
    write_atomic(path, |f| f.write_all(bytes))
}

/// Makes a rename inside `path`'s directory durable where the platform allows it. Failure is
/// harmless (the rename happened; only its durability across a power loss is unconfirmed).
pub fn sync_parent_dir(path: &Path) {
    if let Some(dir) = path.parent().filter(|p| !p.as_os_str().is_empty())
        && let Ok(d) = File::open(dir)
    {
        let _ = d.sync_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("tilearn-fs-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn commit_replaces_the_target_and_leaves_no_tmp() {
        let dir = scratch("commit");
        let path = dir.join("a.bin");
        std::fs::write(&path, b"old").unwrap();
        write_bytes_atomic(&path, b"new contents").unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"new contents");
        assert!(!tmp_path(&path).exists());
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn a_failing_writer_keeps_the_old_file_and_removes_the_tmp() {
        let dir = scratch("fail");
        let path = dir.join("a.bin");
        std::fs::write(&path, b"old").unwrap();
        let err = write_atomic(&path, |f| {
            f.write_all(b"partial")?;
            Err(io::Error::other("disk full"))
        })
        .unwrap_err();
        assert_eq!(err.to_string(), "disk full");
        assert_eq!(std::fs::read(&path).unwrap(), b"old");
        assert!(!tmp_path(&path).exists());
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn dropping_uncommitted_removes_the_tmp() {
        let dir = scratch("drop");
        let path = dir.join("a.bin");
        {
            let mut f = AtomicFile::create(&path).unwrap();
            f.write_all(b"x").unwrap();
        }
        assert!(!path.exists());
        assert!(!tmp_path(&path).exists());
        std::fs::remove_dir_all(dir).unwrap();
    }
}
