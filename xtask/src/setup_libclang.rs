//! Makes libclang loadable for `build-kernels` (bindgen's `runtime` feature opens it with
//! `dlopen` when it first runs), installing it when none is found, as `setup_cuda` does for nvcc.
//!
//! bindgen finds libclang through clang-sys: `LIBCLANG_PATH` (a directory or the file itself)
//! when that is set, and *only* there; otherwise `llvm-config`, `LD_LIBRARY_PATH` and the usual
//! system directories (`/usr/lib/llvm-*/lib`, …). It searches at the first bindgen call, so
//! setting `LIBCLANG_PATH` in this process before that call is enough.
//!
//! When none loads, the primary route is the pinned `libclang` wheel from PyPI, installed with
//! `pip install --target target/libclang`; it ships `clang/native/libclang.so` for x86_64 and
//! aarch64 Linux, and `LIBCLANG_PATH` is pointed at that directory. Why it comes first: it needs
//! neither root nor apt (only pip, which the nvcc wheels need anyway), only PyPI is reachable from
//! CI, it changes nothing outside `target/`, and it pins one libclang version, so every machine
//! without a system libclang generates the bindings with the same one. The fallback, when pip
//! cannot install the wheel (no pip, no wheel for this platform) and we run as root with
//! `apt-get`, is the Debian package `libclang-dev`, which puts `libclang.so` where clang-sys looks
//! by itself.
//!
//! The wheel has no clang resource directory, so `<stddef.h>` (a header the compiler provides,
//! not libc) would not be found. We add the C compiler's own header directory
//! (`cc -print-file-name=include`) through `BINDGEN_EXTRA_CLANG_ARGS`, which bindgen reads at
//! each `generate`: the host compiler is there wherever the kernels build (nvcc needs it), and
//! its `stddef.h`/`stdint.h` are written to work under clang too.
//!
//! A stamp file written after the wheel's libclang loaded makes later runs skip pip.

use std::fs;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::cmd::{run_checked, workspace_root};
use crate::setup_cuda::pip_install_wheels;

/// The pinned wheel; its `clang/native/libclang.so` is LLVM 18.
const WHEEL: &str = "libclang==18.1.1";

/// The environment variable clang-sys reads (see the module docs).
const LIBCLANG_PATH: &str = "LIBCLANG_PATH";

/// Extra clang arguments bindgen reads from the environment (shell-quoted).
const EXTRA_CLANG_ARGS: &str = "BINDGEN_EXTRA_CLANG_ARGS";

/// `target/libclang`: where the wheel is installed.
fn install_root() -> PathBuf {
    workspace_root().join("target").join("libclang")
}

/// The directory of the wheel's `libclang.so` under `root`.
fn wheel_lib_dir(root: &Path) -> PathBuf {
    root.join("clang").join("native")
}

fn stamp_path(root: &Path) -> PathBuf {
    root.join(".installed")
}

/// Makes libclang loadable by bindgen in this process: the one already found, else the pinned
/// install in `target/libclang`, else a fresh install (wheel, then apt). Returns the version
/// string of the libclang in use.
pub fn ensure() -> Result<String, String> {
    if let Some(version) = loaded_version() {
        return Ok(version);
    }
    if let Some(path) = std::env::var_os(LIBCLANG_PATH).filter(|p| !p.is_empty()) {
        // clang-sys looks only there; replacing a path the user chose would hide their mistake.
        return Err(format!(
            "{LIBCLANG_PATH}={} holds no loadable libclang; point it at the directory of \
             libclang.so, or unset it to let `cargo xtask` find or install one",
            Path::new(&path).display()
        ));
    }
    let root = install_root();
    if fs::read_to_string(stamp_path(&root)).ok().as_deref() == Some(WHEEL)
        && let Some(version) = use_wheel(&wheel_lib_dir(&root))?
    {
        eprintln!(
            "setup-libclang: using the pinned {version} in {}",
            root.display()
        );
        return Ok(version);
    }
    eprintln!("setup-libclang: no libclang found (bindgen needs it to check the kernel bindings)");
    let wheel_error = match install_wheel(&root) {
        Ok(version) => return Ok(version),
        Err(e) => e,
    };
    if !(running_as_root() && on_path("apt-get")) {
        return Err(format!(
            "could not install libclang: {wheel_error}; install it with `apt-get install \
             libclang-dev`, or set {LIBCLANG_PATH} to the directory of libclang.so"
        ));
    }
    eprintln!("setup-libclang: the wheel failed ({wheel_error}); installing libclang-dev with apt");
    install_apt()?;
    loaded_version().ok_or_else(|| {
        "apt-get installed libclang-dev, but bindgen still cannot load libclang.so; set \
         LIBCLANG_PATH to its directory (e.g. /usr/lib/llvm-<version>/lib)"
            .to_string()
    })
}

/// The version of the libclang bindgen loads, or `None` when it finds none. bindgen panics when
/// it cannot load libclang (and retries on the next call), so the panic is caught here and its
/// message, which would look like a crash, is not printed.
fn loaded_version() -> Option<String> {
    let previous_hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    let version = std::panic::catch_unwind(bindgen::clang_version);
    std::panic::set_hook(previous_hook);
    version.ok().map(|v| v.full)
}

/// Points bindgen at the wheel's libclang in `dir` (and at the C compiler's builtin headers)
/// and returns the version it loads from there; `None` when it loads none.
fn use_wheel(dir: &Path) -> Result<Option<String>, String> {
    if !dir.join("libclang.so").is_file() {
        return Ok(None);
    }
    let mut extra = format!("-isystem {}", quote(&compiler_include_dir()?)?);
    if let Some(user) = std::env::var_os(EXTRA_CLANG_ARGS) {
        extra = format!("{} {extra}", user.to_string_lossy());
    }
    // SAFETY: xtask is single-threaded (it runs its steps and child processes one after the
    // other), so no other thread reads or writes the environment while it changes.
    unsafe {
        std::env::set_var(LIBCLANG_PATH, dir);
        std::env::set_var(EXTRA_CLANG_ARGS, extra);
    }
    Ok(loaded_version())
}

/// The directory of the C compiler's own headers (`stddef.h`, …): `cc -print-file-name=include`.
fn compiler_include_dir() -> Result<PathBuf, String> {
    let out = Command::new("cc")
        .arg("-print-file-name=include")
        .output()
        .map_err(|e| {
            format!("cannot run `cc` ({e}); install a C compiler (e.g. `apt-get install gcc`)")
        })?;
    let dir = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
    if out.status.success() && dir.join("stddef.h").is_file() {
        Ok(dir)
    } else {
        Err(format!(
            "`cc -print-file-name=include` gave `{}`, which has no stddef.h; the libclang wheel \
             needs the C compiler's headers",
            dir.display()
        ))
    }
}

/// `path` quoted for `BINDGEN_EXTRA_CLANG_ARGS`, which bindgen splits with `shlex`.
fn quote(path: &Path) -> Result<String, String> {
    let text = path.to_string_lossy();
    shlex::try_quote(&text)
        .map(|q| q.into_owned())
        .map_err(|e| format!("cannot pass {} to clang: {e}", path.display()))
}

/// Installs the pinned wheel into `root` and loads its libclang.
fn install_wheel(root: &Path) -> Result<String, String> {
    eprintln!("setup-libclang: installing {WHEEL} into {}", root.display());
    if root.exists() {
        fs::remove_dir_all(root).map_err(|e| format!("cannot remove {}: {e}", root.display()))?;
    }
    pip_install_wheels(root, &[WHEEL])?;
    let dir = wheel_lib_dir(root);
    let version = use_wheel(&dir)?.ok_or_else(|| {
        format!(
            "the {WHEEL} wheel installed, but bindgen cannot load {}",
            dir.join("libclang.so").display()
        )
    })?;
    fs::write(stamp_path(root), WHEEL)
        .map_err(|e| format!("cannot write {}: {e}", stamp_path(root).display()))?;
    eprintln!("setup-libclang: {version} from {}", dir.display());
    Ok(version)
}

/// `apt-get install libclang-dev` (after refreshing the package lists).
fn install_apt() -> Result<(), String> {
    for args in [
        &["update", "-qq"][..],
        &["install", "-y", "-qq", "libclang-dev"][..],
    ] {
        let mut apt = Command::new("apt-get");
        apt.args(args).env("DEBIAN_FRONTEND", "noninteractive");
        run_checked(apt)?;
    }
    Ok(())
}

/// Whether this process runs as root (it owns its `/proc/self`).
fn running_as_root() -> bool {
    fs::metadata("/proc/self").is_ok_and(|m| m.uid() == 0)
}

fn on_path(program: &str) -> bool {
    std::env::var_os("PATH")
        .is_some_and(|path| std::env::split_paths(&path).any(|dir| dir.join(program).is_file()))
}
