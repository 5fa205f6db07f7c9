//! Compiles `kernels/*.cu` (this crate's own folder) with nvcc (through `cc`) when the `cuda`
//! feature is on; does nothing otherwise, so a default build needs no CUDA toolchain.
//!
//! Finding nvcc, in order: `NVCC` (the compiler itself), `CUDA_HOME` / `CUDA_PATH` (`bin/nvcc`
//! below them), `PATH`, then the pinned toolchain that `cargo xtask setup-cuda` installs at
//! `<workspace>/target/cuda`. Without any of them the build fails with the fix spelled out.
//!
//! Code: SASS for sm_80 (A100) and sm_90a (H100/H200), plus compute_80 PTX so newer GPUs can JIT.
//! `-O3 -lineinfo`; no `--use_fast_math` (it flushes subnormals to zero and approximates division
//! and sqrt, which would break the exact casts and the 1e-5 parity with the CPU reference).
//!
//! The CUDA runtime is linked *statically* (`libcudart_static.a`). The pinned wheels provide it:
//! nvidia-cuda-runtime 13.0.96 ships `nvidia/cu13/lib/{libcudart_static.a, libcudart.so.13,
//! libcudadevrt.a}`, so CI links without any CUDA install, and the resulting binary needs at run
//! time only what cudarc loads itself with dlopen: the driver's `libcuda.so.1` (and cuBLASLt /
//! NCCL when used). No `libcudart.so` is needed on the GPU machine. The static runtime and cudarc
//! both use the device's primary context, so launchers run on cudarc's streams.
//! The static runtime needs `-lrt -lpthread -ldl`; nvcc's host stubs need the C++ ABI runtime
//! (`__cxa_guard_*`, `__gxx_personality_v0`), so `cc` links `libstdc++.so.6` (present on every
//! Linux with a C++ runtime).

use std::env;
use std::path::{Path, PathBuf};

const ENV_VARS: &[&str] = &["NVCC", "CUDA_HOME", "CUDA_PATH", "PATH", "NVCC_CCBIN"];

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    if env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    for var in ENV_VARS {
        println!("cargo:rerun-if-env-changed={var}");
    }
    let manifest_dir = PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").expect("set by cargo"));
    // The pinned toolchain lives in the workspace's target/ (crates/tilearn-kernels/../..).
    let workspace = manifest_dir.join("..").join("..");
    let workspace = workspace.canonicalize().unwrap_or(workspace);
    let kernels = manifest_dir.join("kernels");
    let include = kernels.join("include");
    println!("cargo:rerun-if-changed={}", kernels.display());
    println!("cargo:rerun-if-changed={}", include.display());

    let nvcc = match find_nvcc(&workspace) {
        Some(nvcc) => nvcc,
        None => {
            eprintln!(
                "error: nvcc not found: run `cargo xtask setup-cuda` or set NVCC/CUDA_HOME \
                 (the `cuda` feature of tilearn-kernels compiles kernels/*.cu with nvcc; searched \
                 NVCC, CUDA_HOME, CUDA_PATH, PATH and {})",
                workspace.join("target/cuda/bin/nvcc").display()
            );
            std::process::exit(1);
        }
    };
    let cuda_root = nvcc_root(&nvcc);
    println!("cargo:rerun-if-changed={}", nvcc.display());

    let mut sources: Vec<PathBuf> = std::fs::read_dir(&kernels)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", kernels.display()))
        .filter_map(|entry| entry.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|ext| ext == "cu"))
        .collect();
    sources.sort();
    assert!(
        !sources.is_empty(),
        "no kernels/*.cu found in {}",
        kernels.display()
    );
    for source in &sources {
        println!("cargo:rerun-if-changed={}", source.display());
    }
    if let Ok(entries) = std::fs::read_dir(&include) {
        for entry in entries.flatten() {
            println!("cargo:rerun-if-changed={}", entry.path().display());
        }
    }

    // With `cuda(true)`, cc takes nvcc from the `NVCC` environment variable (`.compiler()` would
    // set the host compiler instead), so hand it the one found above.
    // SAFETY: the build script is single-threaded here; nothing reads the environment
    // concurrently.
    unsafe { env::set_var("NVCC", &nvcc) };
    // One cc build (one static library) per kernel file: with a single .cu file cc compiles
    // whole-program (no `--device-c` relocatable device code, which it uses as soon as a build
    // has several .cu files), so every file is an independent module the runtime loads lazily.
    // The files compile in parallel.
    let ccbin = env::var("NVCC_CCBIN").ok();
    let failures: Vec<String> = std::thread::scope(|scope| {
        let jobs: Vec<_> = sources
            .iter()
            .map(|source| {
                let include = &include;
                let ccbin = ccbin.as_deref();
                scope.spawn(move || compile_kernel_file(source, include, ccbin))
            })
            .collect();
        jobs.into_iter()
            .filter_map(|job| match job.join() {
                Ok(Ok(())) => None,
                Ok(Err(e)) => Some(e),
                Err(_) => Some("a kernel compilation thread panicked".to_string()),
            })
            .collect()
    });
    if !failures.is_empty() {
        for failure in &failures {
            eprintln!("error: {failure}");
        }
        std::process::exit(1);
    }

    let mut found_cudart = false;
    for dir in [
        cuda_root.join("lib64"),
        cuda_root.join("lib"),
        cuda_root.join("targets/x86_64-linux/lib"),
        cuda_root.join("targets/sbsa-linux/lib"),
    ] {
        if dir.join("libcudart_static.a").is_file() {
            println!("cargo:rustc-link-search=native={}", dir.display());
            found_cudart = true;
            break;
        }
    }
    if !found_cudart {
        println!(
            "cargo:warning=libcudart_static.a not found below {}; relying on the linker's \
             default search path",
            cuda_root.display()
        );
    }
    println!("cargo:rustc-link-lib=static=cudart_static");
    for lib in ["rt", "pthread", "dl"] {
        println!("cargo:rustc-link-lib=dylib={lib}");
    }
}

/// Compiles one `kernels/<op>.cu` into `libtilearn_kernels_<op>.a` and emits its link line.
fn compile_kernel_file(source: &Path, include: &Path, ccbin: Option<&str>) -> Result<(), String> {
    let stem = source
        .file_stem()
        .and_then(|s| s.to_str())
        .ok_or_else(|| format!("kernel file name {} is not UTF-8", source.display()))?;
    let mut build = cc::Build::new();
    build
        .cuda(true)
        // We emit the cudart link line ourselves (in main), with the right search path for every
        // layout (wheel prefix, /usr/local/cuda, targets/x86_64-linux).
        .cudart("none")
        .include(include)
        .file(source)
        .flag("-std=c++17")
        .flag("-lineinfo")
        .flag("-gencode=arch=compute_80,code=sm_80")
        .flag("-gencode=arch=compute_90a,code=sm_90a")
        .flag("-gencode=arch=compute_80,code=compute_80")
        // cc passes its own -O level (from the profile); kernels are always built with -O3.
        .opt_level(3)
        // cc adds `-G` (device debug: unoptimised, overrides -lineinfo) in debug profiles.
        .debug(false)
        .warnings(false);
    if let Some(ccbin) = ccbin {
        build.ccbin(false).flag(format!("-ccbin={ccbin}"));
    }
    build
        .try_compile(&format!("tilearn_kernels_{stem}"))
        .map_err(|e| format!("nvcc failed on {}: {e}", source.display()))
}

/// NVCC, then CUDA_HOME / CUDA_PATH, then PATH, then the pinned install (the same order as
/// `xtask/src/setup_cuda.rs::find_nvcc`).
fn find_nvcc(workspace: &Path) -> Option<PathBuf> {
    if let Some(nvcc) = env::var_os("NVCC").filter(|v| !v.is_empty()) {
        let nvcc = PathBuf::from(nvcc);
        if nvcc.is_file() {
            return Some(nvcc);
        }
        eprintln!(
            "error: NVCC={} does not exist: point NVCC at nvcc, or unset it",
            nvcc.display()
        );
        std::process::exit(1);
    }
    for var in ["CUDA_HOME", "CUDA_PATH"] {
        if let Some(home) = env::var_os(var).filter(|v| !v.is_empty()) {
            let nvcc = PathBuf::from(home).join("bin").join("nvcc");
            if nvcc.is_file() {
                return Some(nvcc);
            }
        }
    }
    if let Some(path) = env::var_os("PATH") {
        for dir in env::split_paths(&path) {
            let nvcc = dir.join("nvcc");
            if nvcc.is_file() {
                return Some(nvcc);
            }
        }
    }
    let pinned = workspace
        .join("target")
        .join("cuda")
        .join("bin")
        .join("nvcc");
    pinned.is_file().then_some(pinned)
}

/// The CUDA root of an nvcc (`<root>/bin/nvcc`), following symlinks so the pinned install's
/// `target/cuda/bin -> site/nvidia/cu13/bin` resolves to the wheel prefix.
fn nvcc_root(nvcc: &Path) -> PathBuf {
    let real = std::fs::canonicalize(nvcc).unwrap_or_else(|_| nvcc.to_path_buf());
    real.parent()
        .and_then(Path::parent)
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from("/usr/local/cuda"))
}
