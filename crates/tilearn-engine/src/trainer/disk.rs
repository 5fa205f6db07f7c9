//! Disk space for saves: the bytes each save writes, the free space of the output filesystem,
//! and the checks that refuse a run at its start (or skip one checkpoint) instead of failing
//! in the middle of a write hours later.

use std::ffi::CString;
use std::io;
use std::mem::MaybeUninit;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

use tilearn_ops::DType;

use crate::params::ParamSpec;
use crate::{EngineError, Result};

/// Bytes of the AdamW state per parameter in a checkpoint: `exp_avg` and `exp_avg_sq` in f32
/// (the Trainer's AdamW never uses amsgrad, see [`super::adamw_for`]).
pub const OPTIMIZER_BYTES_PER_PARAM: u64 = 8;

/// Allowance for the small files of a save: config.json, the shard index, trainer_state.json,
/// scheduler.json, scaler.json, amp_policy.json.
const SMALL_FILES_BYTES: u64 = 1 << 20;

/// How much free space a filesystem has for new files; the Trainer's is [`FilesystemSpace`],
/// tests inject a small quota.
pub trait FreeSpace: Send + Sync {
    /// Bytes an unprivileged process can still write on the filesystem holding `dir`.
    fn available_bytes(&self, dir: &Path) -> io::Result<u64>;
}

/// The real free space, from `statvfs` (`f_bavail * f_frsize`, what `df` shows as available).
#[derive(Clone, Copy, Debug, Default)]
pub struct FilesystemSpace;

impl FreeSpace for FilesystemSpace {
    fn available_bytes(&self, dir: &Path) -> io::Result<u64> {
        let path = CString::new(dir.as_os_str().as_bytes())
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "path contains a NUL byte"))?;
        let mut stat = MaybeUninit::<libc::statvfs>::zeroed();
        // SAFETY: `path` is a NUL-terminated string that outlives the call and `stat` points to
        // writable memory for one `statvfs`, which the call fills on success.
        let rc = unsafe { libc::statvfs(path.as_ptr(), stat.as_mut_ptr()) };
        if rc != 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: statvfs returned 0, so it initialised the struct (and it was zeroed before).
        let stat = unsafe { stat.assume_init() };
        // fsblkcnt_t and c_ulong are u64 on the 64-bit Linux targets tilearn builds for.
        Ok(stat.f_bavail.saturating_mul(stat.f_frsize))
    }
}

/// What a run's saves write, in bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SaveSizes {
    /// The final model: config.json and the weights in the save dtype.
    pub model: u64,
    /// One `checkpoint-N` directory.
    pub checkpoint: u64,
    /// The final model's dtype (for messages).
    pub model_dtype: DType,
}

impl SaveSizes {
    /// Sizes for a model with tensors `specs`, saved in `model_dtype`; checkpoints hold the f32
    /// master weights and the optimizer state, or with `save_only_model` the weights in
    /// `model_dtype` alone.
    pub fn new(specs: &[ParamSpec], model_dtype: DType, save_only_model: bool) -> SaveSizes {
        let numel: u64 = specs.iter().map(|s| s.numel() as u64).sum();
        let model = weight_files_bytes(specs, model_dtype) + SMALL_FILES_BYTES;
        let checkpoint = if save_only_model {
            model
        } else {
            weight_files_bytes(specs, DType::F32)
                + numel * OPTIMIZER_BYTES_PER_PARAM
                + SMALL_FILES_BYTES
        };
        SaveSizes {
            model,
            checkpoint,
            model_dtype,
        }
    }
}

/// The safetensors bytes of `specs` in `dtype`: data plus a generous header estimate (the JSON
/// entry of a tensor is its name and under 100 bytes of dtype, shape and offsets).
fn weight_files_bytes(specs: &[ParamSpec], dtype: DType) -> u64 {
    let data: u64 = specs
        .iter()
        .map(|s| (s.numel() * dtype.size_in_bytes()) as u64)
        .sum();
    let header: u64 = specs.iter().map(|s| s.name.len() as u64 + 128).sum();
    data + header + 4096
}

/// `bytes` as a short human number with the exact count, e.g. `13.48 GB (13476839424 bytes)`.
pub fn show_bytes(bytes: u64) -> String {
    if bytes >= 1_000_000_000 {
        format!("{:.2} GB ({bytes} bytes)", bytes as f64 / 1e9)
    } else {
        format!("{:.2} MB ({bytes} bytes)", bytes as f64 / 1e6)
    }
}

/// Bytes of the files directly in `dir` whose names `keep` accepts (what a save wrote).
pub fn files_bytes(dir: &Path, keep: impl Fn(&str) -> bool) -> u64 {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    entries
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_str().is_some_and(&keep))
        .filter_map(|e| e.metadata().ok())
        .filter(|m| m.is_file())
        .map(|m| m.len())
        .sum()
}

/// The flags that make saves smaller or go elsewhere.
const OPTIONS: &str = "--save-only-model (checkpoints without optimizer state), \
    --save-total-limit N (fewer checkpoints on disk), --save-steps 0 or --save-strategy no \
    (no checkpoints), --save-dtype bf16 (a smaller final model), or another --output-dir";

fn available(space: &dyn FreeSpace, dir: &Path) -> Result<u64> {
    space.available_bytes(dir).map_err(|e| {
        EngineError::io(
            dir,
            "query the free space of the output directory's filesystem",
            e,
        )
    })
}

/// Refuses a run whose saves cannot fit: the final model plus `checkpoints_on_disk`
/// checkpoints written at once must fit in the free space of `output_dir`'s filesystem.
pub fn check_run(
    space: &dyn FreeSpace,
    output_dir: &Path,
    sizes: SaveSizes,
    checkpoints_on_disk: u64,
) -> Result<()> {
    let needed = sizes.model + checkpoints_on_disk * sizes.checkpoint;
    let free = available(space, output_dir)?;
    if needed <= free {
        return Ok(());
    }
    Err(EngineError::InvalidArgument {
        argument: "--output-dir".into(),
        message: format!(
            "{}: this run's saves need {} (the final model in {}: {}, plus {checkpoints_on_disk} \
             checkpoint(s) of {} each) but the filesystem has {} free; use {OPTIONS}",
            output_dir.display(),
            show_bytes(needed),
            sizes.model_dtype,
            show_bytes(sizes.model),
            show_bytes(sizes.checkpoint),
            show_bytes(free),
        ),
    })
}

/// Refuses one save of `needed` bytes (`what`, e.g. `checkpoint-500`) into `dir` that cannot
/// fit in the free space.
pub fn check_save(space: &dyn FreeSpace, dir: &Path, what: &str, needed: u64) -> Result<()> {
    let free = available(space, dir)?;
    if needed <= free {
        return Ok(());
    }
    Err(EngineError::InvalidArgument {
        argument: "--output-dir".into(),
        message: format!(
            "{}: {what} needs {} but the filesystem has {} free; use {OPTIONS}",
            dir.display(),
            show_bytes(needed),
            show_bytes(free),
        ),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Quota(u64);

    impl FreeSpace for Quota {
        fn available_bytes(&self, _: &Path) -> io::Result<u64> {
            Ok(self.0)
        }
    }

    fn specs() -> Vec<ParamSpec> {
        vec![ParamSpec {
            name: "w".into(),
            shape: vec![1000, 1000],
            offset: 0,
            decay: true,
        }]
    }

    #[test]
    fn sizes_follow_dtype_and_contents() {
        let full = SaveSizes::new(&specs(), DType::BF16, false);
        assert!(full.model >= 2_000_000 && full.model < 2_000_000 + (2 << 20));
        // f32 weights + two f32 moments.
        assert!(full.checkpoint >= 12_000_000 && full.checkpoint < 12_000_000 + (2 << 20));
        let only = SaveSizes::new(&specs(), DType::BF16, true);
        assert_eq!(only.checkpoint, only.model);
    }

    #[test]
    fn refusal_names_both_numbers_and_the_options() {
        let sizes = SaveSizes::new(&specs(), DType::F32, false);
        let needed = sizes.model + 2 * sizes.checkpoint;
        let e = check_run(&Quota(needed - 1), Path::new("/out"), sizes, 2).unwrap_err();
        let msg = e.to_string();
        assert!(msg.contains(&format!("({needed} bytes)")), "{msg}");
        assert!(
            msg.contains(&format!("({} bytes) free", needed - 1)),
            "{msg}"
        );
        for flag in ["--save-only-model", "--save-total-limit", "--output-dir"] {
            assert!(msg.contains(flag), "{msg}");
        }
        check_run(&Quota(needed), Path::new("/out"), sizes, 2).unwrap();
    }

    #[test]
    fn statvfs_reports_some_space_for_the_temp_dir() {
        let free = FilesystemSpace
            .available_bytes(&std::env::temp_dir())
            .unwrap();
        assert!(free > 0);
        assert!(
            FilesystemSpace
                .available_bytes(Path::new("/no/such/dir/tilearn"))
                .is_err()
        );
    }
}
