//! `cargo xtask setup-cuda`: installs the pinned CUDA 13.0 compiler from PyPI wheels.
//!
//! Only PyPI is reachable from CI, so the toolchain comes from NVIDIA's own wheels, installed with
//! `pip install --target target/cuda/site`. All five wheels unpack into one prefix,
//! `site/nvidia/cu13/{bin,include,lib,nvvm}`, which is already the shape of a CUDA install: nvcc
//! reads `bin/nvcc.profile`, whose `TOP` is `bin/..`, and finds `nvvm/bin/cicc`, `include/` and
//! `lib64/` below it. We add `lib64 -> lib` (the profile searches `lib64`) and expose the prefix
//! as `target/cuda/{bin,include,lib,lib64,nvvm}` symlinks, so `CUDA_HOME=target/cuda` works too.
//!
//! The runtime wheel carries `lib/libcudart_static.a`, which the kernels link statically (see
//! `crates/tilearn-ops/build.rs`). A stamp file written after a successful verification makes a
//! second run a no-op.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use crate::cmd::{run_checked, workspace_root};

/// The pinned wheels: CUDA 13.0, the driver level of the H200 machines. Keep in sync with
/// DESIGN.md ("Kernels and the CUDA path").
const WHEELS: &[&str] = &[
    "nvidia-cuda-nvcc==13.0.88",
    "nvidia-cuda-crt==13.0.88",
    "nvidia-nvvm==13.0.88",
    "nvidia-cuda-cccl==13.0.85",
    "nvidia-cuda-runtime==13.0.96",
];

/// Subdirectories of the CUDA prefix exposed at `target/cuda/`.
const TREE: &[&str] = &["bin", "include", "lib", "lib64", "nvvm"];

/// `target/cuda`: the CUDA_HOME-like root of the pinned install.
pub fn install_root() -> PathBuf {
    workspace_root().join("target").join("cuda")
}

fn stamp_path(root: &Path) -> PathBuf {
    root.join(".installed")
}

fn stamp_contents() -> String {
    WHEELS.join("\n") + "\n"
}

/// Installs the pinned nvcc into `target/cuda` (or finds the existing install) and returns the
/// path of `nvcc`.
pub fn run(args: &[String]) -> Result<PathBuf, String> {
    if let Some(arg) = args.first() {
        return Err(format!(
            "setup-cuda takes no arguments (got `{arg}`); it installs {} into target/cuda",
            WHEELS.join(" ")
        ));
    }
    let start = Instant::now();
    let root = install_root();
    let nvcc = root.join("bin").join("nvcc");

    if fs::read_to_string(stamp_path(&root)).ok().as_deref() == Some(stamp_contents().as_str())
        && nvcc.is_file()
    {
        let version = nvcc_version(&nvcc)?;
        eprintln!(
            "setup-cuda: pinned CUDA already installed at {} ({version})",
            root.display()
        );
        return Ok(nvcc);
    }

    eprintln!(
        "setup-cuda: installing {} into {}",
        WHEELS.join(" "),
        root.display()
    );
    let _ = fs::remove_file(stamp_path(&root));
    let site = root.join("site");
    if site.exists() {
        fs::remove_dir_all(&site).map_err(|e| format!("cannot remove {}: {e}", site.display()))?;
    }
    fs::create_dir_all(&site).map_err(|e| format!("cannot create {}: {e}", site.display()))?;

    pip_install_wheels(&site, WHEELS)?;

    let prefix = site.join("nvidia").join("cu13");
    arrange_tree(&root, &prefix)?;
    let version = nvcc_version(&nvcc)?;
    eprintln!("setup-cuda: {version}");
    verify_compile(&root, &nvcc)?;
    fs::write(stamp_path(&root), stamp_contents())
        .map_err(|e| format!("cannot write {}: {e}", stamp_path(&root).display()))?;
    eprintln!(
        "setup-cuda: done in {:.1}s; nvcc is {} (build.rs finds it there; or set CUDA_HOME={})",
        start.elapsed().as_secs_f64(),
        nvcc.display(),
        root.display()
    );
    Ok(nvcc)
}

/// Finds nvcc through `NVCC`, `CUDA_HOME`/`CUDA_PATH`, `PATH` or the pinned install, without
/// installing. The same order as `crates/tilearn-ops/build.rs`.
pub fn find_nvcc() -> Option<PathBuf> {
    if let Some(nvcc) = std::env::var_os("NVCC").filter(|v| !v.is_empty()) {
        let nvcc = PathBuf::from(nvcc);
        return nvcc.is_file().then_some(nvcc);
    }
    for var in ["CUDA_HOME", "CUDA_PATH"] {
        if let Some(home) = std::env::var_os(var).filter(|v| !v.is_empty()) {
            let nvcc = PathBuf::from(home).join("bin").join("nvcc");
            if nvcc.is_file() {
                return Some(nvcc);
            }
        }
    }
    if let Some(path) = std::env::var_os("PATH") {
        for dir in std::env::split_paths(&path) {
            let nvcc = dir.join("nvcc");
            if nvcc.is_file() {
                return Some(nvcc);
            }
        }
    }
    let pinned = install_root().join("bin").join("nvcc");
    pinned.is_file().then_some(pinned)
}

/// `pip install --target target` of the pinned `wheels` (binary wheels only, no dependencies),
/// with the Python found by [`find_python`]. Also used for the libclang wheel.
pub fn pip_install_wheels(target: &Path, wheels: &[&str]) -> Result<(), String> {
    let mut pip = Command::new(find_python()?);
    pip.args([
        "-m",
        "pip",
        "install",
        "--disable-pip-version-check",
        "--no-deps",
        "--no-compile",
        "--only-binary=:all:",
        "--target",
    ])
    .arg(target)
    .args(wheels);
    run_checked(pip)
}

/// A Python with pip (`python3`, else `python`), to install wheels with.
fn find_python() -> Result<PathBuf, String> {
    for candidate in ["python3", "python"] {
        let ok = Command::new(candidate)
            .args(["-m", "pip", "--version"])
            .output()
            .map(|o| o.status.success())
            .unwrap_or(false);
        if ok {
            return Ok(PathBuf::from(candidate));
        }
    }
    let have_python = Command::new("python3").arg("--version").output().is_ok();
    Err(if have_python {
        "python3 has no pip: install python3-pip (e.g. `apt-get install python3-pip`), then rerun \
         the command"
            .into()
    } else {
        "python3 not found: install python3 and python3-pip (e.g. `apt-get install python3-pip`), \
         then rerun the command"
            .into()
    })
}

/// Adds `lib64 -> lib` inside the prefix and exposes the prefix's directories at `root`.
fn arrange_tree(root: &Path, prefix: &Path) -> Result<(), String> {
    let must = [
        "bin/nvcc",
        "bin/ptxas",
        "nvvm/bin/cicc",
        "include/cuda_runtime.h",
        "include/crt/host_config.h",
        "include/cccl",
        "lib/libcudart_static.a",
    ];
    for rel in must {
        if !prefix.join(rel).exists() {
            return Err(format!(
                "the wheels did not provide {}: is the wheel layout different from \
                 nvidia/cu13/{{bin,include,lib,nvvm}}?",
                prefix.join(rel).display()
            ));
        }
    }
    symlink_replace(Path::new("lib"), &prefix.join("lib64"))?;
    for dir in TREE {
        let target = Path::new("site").join("nvidia").join("cu13").join(dir);
        symlink_replace(&target, &root.join(dir))?;
    }
    Ok(())
}

fn symlink_replace(target: &Path, link: &Path) -> Result<(), String> {
    if link.symlink_metadata().is_ok() {
        fs::remove_file(link).map_err(|e| format!("cannot replace {}: {e}", link.display()))?;
    }
    std::os::unix::fs::symlink(target, link).map_err(|e| {
        format!(
            "cannot link {} -> {}: {e}",
            link.display(),
            target.display()
        )
    })
}

fn nvcc_version(nvcc: &Path) -> Result<String, String> {
    let out = Command::new(nvcc)
        .arg("--version")
        .output()
        .map_err(|e| format!("cannot run {}: {e}", nvcc.display()))?;
    if !out.status.success() {
        return Err(format!(
            "{} --version failed: {}",
            nvcc.display(),
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    let text = String::from_utf8_lossy(&out.stdout);
    Ok(text
        .lines()
        .find(|l| l.contains("release"))
        .unwrap_or("nvcc (unknown release)")
        .trim()
        .to_string())
}

/// Compiles a trivial kernel that includes `cuda_runtime.h` for sm_80, so a broken install
/// (missing cicc, headers or host compiler) fails here rather than in `cargo build`.
fn verify_compile(root: &Path, nvcc: &Path) -> Result<(), String> {
    let dir = root.join("verify");
    fs::create_dir_all(&dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    let src = dir.join("probe.cu");
    fs::write(
        &src,
        "#include <cuda_runtime.h>\n#include <cuda_bf16.h>\n\
         __global__ void probe(float* x) { x[threadIdx.x] = \
         __bfloat162float(__float2bfloat16_rn(x[threadIdx.x])); }\n\
         extern \"C\" int probe_launch(float* x, cudaStream_t s) { \
         probe<<<1, 32, 0, s>>>(x); return (int)cudaGetLastError(); }\n",
    )
    .map_err(|e| format!("cannot write {}: {e}", src.display()))?;
    let obj = dir.join("probe.o");
    eprintln!("setup-cuda: verifying: nvcc -c probe.cu (sm_80)");
    let out = Command::new(nvcc)
        .args(["-c", "-gencode=arch=compute_80,code=sm_80", "-o"])
        .arg(&obj)
        .arg(&src)
        .output()
        .map_err(|e| format!("cannot run {}: {e}", nvcc.display()))?;
    if !out.status.success() || !obj.is_file() {
        return Err(format!(
            "nvcc could not compile a trivial kernel (is a host C++ compiler, g++, installed?):\n{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    Ok(())
}
