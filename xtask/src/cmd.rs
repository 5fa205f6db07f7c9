//! Running child commands with the invocation echoed, so CI logs show what ran.

use std::path::PathBuf;
use std::process::Command;

/// The workspace root (the parent of `xtask/`).
pub fn workspace_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask lives one level below the workspace root")
        .to_path_buf()
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
