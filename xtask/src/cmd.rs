//! Running child commands with the invocation echoed, so CI logs show what ran.

use std::path::PathBuf;
use std::process::Command;

/// The workspace root (the parent of `xtask/`). `cargo run` sets `CARGO_MANIFEST_DIR` for the
/// process, which is right even when this binary was compiled from another checkout sharing
/// the target directory; the compile-time value is the fallback.
pub fn workspace_root() -> PathBuf {
    let manifest_dir = std::env::var_os("CARGO_MANIFEST_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")));
    manifest_dir
        .parent()
        .map(|p| p.to_path_buf())
        .unwrap_or(manifest_dir)
}

/// Runs `cmd` in the workspace root, failing with the command line when it exits non-zero.
pub fn run_checked(mut cmd: Command) -> Result<(), String> {
    cmd.current_dir(workspace_root());
    let line = format!("{cmd:?}");
    eprintln!("$ {line}");
    let status = cmd
        .status()
        .map_err(|e| format!("could not start {line}: {e}"))?;
    if status.success() {
        Ok(())
    } else {
        Err(format!("{line} failed with {status}"))
    }
}

/// `cargo` as invoked by this xtask (respects `$CARGO`).
pub fn cargo() -> Command {
    Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
}
