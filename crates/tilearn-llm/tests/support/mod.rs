//! Shared by the CLI test binaries.

use std::ffi::OsString;

/// The binary to run: `$TILEARN_BIN_DIR/<name>` when set (the GPU machine runs bundled test
/// executables, where Cargo's build path does not exist), else the one Cargo built for the test.
pub fn bin(name: &str, cargo_built: &str) -> OsString {
    match std::env::var_os("TILEARN_BIN_DIR") {
        Some(dir) => std::path::Path::new(&dir).join(name).into_os_string(),
        None => cargo_built.into(),
    }
}
