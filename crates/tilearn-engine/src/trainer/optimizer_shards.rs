//! The optimizer state of a checkpoint, whole or in ZeRO shards, read back for any partition.
//!
//! * Whole: `optimizer.safetensors` ([`super::optimizer_file`]), written by a single process or
//!   by rank 0 of plain data parallelism (every rank holds the same state).
//! * Sharded (ZeRO): one file per rank, `optimizer-rank00001-of-00004.safetensors`, each in the
//!   same format for the `end - start` parameters it owns (its groups shifted to the shard), and
//!   the manifest `optimizer_shards.json` naming every file and its element range of the flat
//!   parameter buffer.
//!
//! [`OptimizerCheckpoint::read`] fills the moments of any element range from whichever files
//! hold them, so a run resumes on another world size (or alone) by reading its new shard.

use std::ops::Range;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use tilearn_optim::ParamGroup;

use super::{optimizer_file, state};
use crate::checkpoint::TensorDest;
use crate::{EngineError, Result};

/// The manifest of a sharded optimizer state.
pub const MANIFEST_FILE: &str = "optimizer_shards.json";
const MANIFEST_FORMAT: &str = "tilearn-zero-optimizer";
const MANIFEST_VERSION: u32 = 1;

/// The file rank `rank` of `world` writes its optimizer shard to.
pub fn shard_file_name(rank: usize, world: usize) -> String {
    format!("optimizer-rank{rank:05}-of-{world:05}.safetensors")
}

/// One shard's file and the elements of the flat parameter buffer it covers.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardEntry {
    pub file: String,
    pub start: usize,
    pub end: usize,
}

/// `optimizer_shards.json`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardManifest {
    pub format: String,
    pub format_version: u32,
    /// Parameters of the whole model.
    pub numel: usize,
    pub world_size: usize,
    pub zero_stage: u8,
    /// In element order, covering `0..numel` without gaps.
    pub shards: Vec<ShardEntry>,
}

impl ShardManifest {
    /// The manifest of `world` shards given by `owned(rank)`.
    pub fn new(
        numel: usize,
        world: usize,
        zero_stage: u8,
        owned: impl Fn(usize) -> Range<usize>,
    ) -> ShardManifest {
        ShardManifest {
            format: MANIFEST_FORMAT.into(),
            format_version: MANIFEST_VERSION,
            numel,
            world_size: world,
            zero_stage,
            shards: (0..world)
                .map(|rank| {
                    let r = owned(rank);
                    ShardEntry {
                        file: shard_file_name(rank, world),
                        start: r.start,
                        end: r.end,
                    }
                })
                .collect(),
        }
    }

    fn check(&self, path: &Path, numel: usize) -> Result<()> {
        let bad = |message: String| {
            Err(EngineError::Data {
                file: path.to_path_buf(),
                message,
            })
        };
        if self.format != MANIFEST_FORMAT || self.format_version != MANIFEST_VERSION {
            return bad(format!(
                "format `{}` version {} is not `{MANIFEST_FORMAT}` version {MANIFEST_VERSION}",
                self.format, self.format_version
            ));
        }
        if self.numel != numel {
            return bad(format!(
                "the optimizer state is for {} parameters, this model has {numel}; resume with \
                 the same model",
                self.numel
            ));
        }
        let mut next = 0;
        for s in &self.shards {
            if s.start != next || s.end < s.start || s.file.contains(['/', '\\']) {
                return bad(format!(
                    "shard `{}` covers {}..{}, expected a plain file name starting at {next}",
                    s.file, s.start, s.end
                ));
            }
            next = s.end;
        }
        if next != numel {
            return bad(format!("the shards cover 0..{next}, not 0..{numel}"));
        }
        Ok(())
    }
}

/// Where a checkpoint's optimizer state lives.
#[derive(Clone, Debug)]
pub enum OptimizerCheckpoint {
    Whole(PathBuf),
    Sharded {
        dir: PathBuf,
        manifest: ShardManifest,
    },
}

impl OptimizerCheckpoint {
    /// The optimizer state of checkpoint `dir` for a model of `numel` parameters; `None` when
    /// the checkpoint has none (saved with `--save-only-model`).
    pub fn open(dir: &Path, numel: usize) -> Result<Option<OptimizerCheckpoint>> {
        let manifest_path = dir.join(MANIFEST_FILE);
        if manifest_path.exists() {
            let manifest: ShardManifest = state::read_json(&manifest_path)?;
            manifest.check(&manifest_path, numel)?;
            return Ok(Some(OptimizerCheckpoint::Sharded {
                dir: dir.to_path_buf(),
                manifest,
            }));
        }
        let whole = dir.join(state::OPTIMIZER_FILE);
        Ok(whole.exists().then_some(OptimizerCheckpoint::Whole(whole)))
    }

    /// Reads the moments of the parameters `range` of a model of `numel` into `dest` (`0..len`
    /// is `exp_avg`, `len..2·len` is `exp_avg_sq`, `len = range.len()`) and returns the step
    /// count. Every file is checked before it is read.
    pub fn read(
        &self,
        numel: usize,
        range: Range<usize>,
        dest: &mut dyn TensorDest,
    ) -> Result<u64> {
        match self {
            OptimizerCheckpoint::Whole(path) => {
                let mut window = Window::new(dest, numel, range.clone(), 0, range.len());
                optimizer_file::read(path, numel, &mut window)
            }
            OptimizerCheckpoint::Sharded { dir, manifest } => {
                let mut step = None;
                for shard in &manifest.shards {
                    let lo = range.start.max(shard.start);
                    let hi = range.end.min(shard.end);
                    // An empty range (a rank that owns nothing) still reads one step count.
                    let needed = lo < hi || (range.is_empty() && step.is_none());
                    if !needed {
                        continue;
                    }
                    let (want, target) = if lo < hi {
                        (lo - shard.start..hi - shard.start, lo - range.start)
                    } else {
                        (0..0, 0)
                    };
                    let path = dir.join(&shard.file);
                    let mut window =
                        Window::new(dest, shard.end - shard.start, want, target, range.len());
                    let s = optimizer_file::read(&path, shard.end - shard.start, &mut window)?;
                    if step.is_some_and(|prev| prev != s) {
                        return Err(EngineError::Data {
                            file: path,
                            message: format!(
                                "its step count {s} differs from the other shards' {}; the \
                                 checkpoint mixes shards of different saves",
                                step.unwrap_or_default()
                            ),
                        });
                    }
                    step = Some(s);
                }
                Ok(step.unwrap_or_default())
            }
        }
    }
}

/// The groups of a full-model optimizer restricted to `shard` and shifted to start at 0 (the
/// optimizer of a ZeRO rank steps `params[shard]`).
pub fn groups_within(groups: &[ParamGroup], shard: &Range<usize>) -> Vec<ParamGroup> {
    groups
        .iter()
        .map(|g| ParamGroup {
            ranges: g
                .ranges
                .iter()
                .filter_map(|r| {
                    let (lo, hi) = (r.start.max(shard.start), r.end.min(shard.end));
                    (lo < hi).then(|| lo - shard.start..hi - shard.start)
                })
                .collect(),
            ..g.clone()
        })
        .collect()
}

/// A [`TensorDest`] for one optimizer file of `file_numel` parameters that keeps only its
/// elements `want` (file-local) and writes them at `target` of each moment of `dest`, whose
/// moments are `len` long. The file reader hands over each moment as one range; the window
/// decodes only the wanted part.
struct Window<'d> {
    dest: &'d mut dyn TensorDest,
    file_numel: usize,
    want: Range<usize>,
    target: usize,
    len: usize,
}

impl<'d> Window<'d> {
    fn new(
        dest: &'d mut dyn TensorDest,
        file_numel: usize,
        want: Range<usize>,
        target: usize,
        len: usize,
    ) -> Window<'d> {
        Window {
            dest,
            file_numel,
            want,
            target,
            len,
        }
    }
}

impl TensorDest for Window<'_> {
    fn write(
        &mut self,
        range: Range<usize>,
        fill: &mut dyn FnMut(usize, &mut [f32]) -> Result<()>,
    ) -> Result<()> {
        if self.file_numel == 0 || self.want.is_empty() {
            return Ok(());
        }
        let moment = range.start / self.file_numel;
        let base = moment * self.file_numel;
        let lo = base + self.want.start;
        let hi = base + self.want.end;
        let start = moment * self.len + self.target;
        self.dest
            .write(start..start + (hi - lo), &mut |offset, buf| {
                fill(lo - range.start + offset, buf)
            })
    }
}

#[cfg(test)]
mod tests {
    use tilearn_optim::AdamWConfig;

    use super::*;

    fn config() -> AdamWConfig {
        AdamWConfig::default()
    }

    /// Writes the moments `m[i] = i`, `v[i] = 1000 + i` of `numel` parameters cut into
    /// `world` shards, and the manifest.
    fn write_sharded(dir: &Path, numel: usize, world: usize, step: u64) {
        // ZeRO's partition (data_parallel::ShardLayout): the last rank takes the remainder.
        let owned = |rank: usize| {
            let q = numel / world;
            rank * q..if rank + 1 == world {
                numel
            } else {
                (rank + 1) * q
            }
        };
        let groups = vec![ParamGroup::whole("all", numel, 0.1)];
        for rank in 0..world {
            let r = owned(rank);
            let m: Vec<f32> = r.clone().map(|i| i as f32).collect();
            let v: Vec<f32> = r.clone().map(|i| 1000.0 + i as f32).collect();
            let both: Vec<f32> = m.iter().chain(&v).copied().collect();
            let mut source: &[f32] = &both;
            let path = dir.join(shard_file_name(rank, world));
            let local = groups_within(&groups, &r);
            optimizer_file::write(&path, &config(), &local, step, r.len(), &mut source).unwrap();
        }
        let manifest = ShardManifest::new(numel, world, 1, owned);
        state::write_json(&dir.join(MANIFEST_FILE), &manifest).unwrap();
    }

    #[test]
    fn any_range_reads_back_across_shards() {
        let dir = tempfile::tempdir().unwrap();
        let numel = 11;
        write_sharded(dir.path(), numel, 3, 5);
        let ckpt = OptimizerCheckpoint::open(dir.path(), numel)
            .unwrap()
            .unwrap();
        for range in [0..11, 2..9, 3..4, 7..11, 0..0] {
            let mut both = vec![-1.0f32; 2 * range.len()];
            let step = ckpt.read(numel, range.clone(), &mut &mut both[..]).unwrap();
            assert_eq!(step, 5);
            let want: Vec<f32> = range
                .clone()
                .map(|i| i as f32)
                .chain(range.clone().map(|i| 1000.0 + i as f32))
                .collect();
            assert_eq!(both, want, "{range:?}");
        }
        let e = OptimizerCheckpoint::open(dir.path(), 12).unwrap_err();
        assert!(e.to_string().contains("for 11 parameters"), "{e}");
    }

    #[test]
    fn a_whole_file_reads_any_range() {
        let dir = tempfile::tempdir().unwrap();
        let numel = 9;
        let both: Vec<f32> = (0..2 * numel).map(|i| i as f32).collect();
        let mut source: &[f32] = &both;
        let path = dir.path().join(state::OPTIMIZER_FILE);
        let groups = vec![ParamGroup::whole("all", numel, 0.1)];
        optimizer_file::write(&path, &config(), &groups, 2, numel, &mut source).unwrap();
        let ckpt = OptimizerCheckpoint::open(dir.path(), numel)
            .unwrap()
            .unwrap();
        let mut out = vec![0.0f32; 6];
        assert_eq!(ckpt.read(numel, 4..7, &mut &mut out[..]).unwrap(), 2);
        assert_eq!(out, [4.0, 5.0, 6.0, 13.0, 14.0, 15.0]);
    }

    #[test]
    fn groups_are_cut_and_shifted() {
        let groups = vec![
            ParamGroup::new("decay", vec![0..4, 6..10], 0.1),
            ParamGroup::new("no_decay", std::iter::once(4..6).collect(), 0.0),
        ];
        let local = groups_within(&groups, &(3..8));
        assert_eq!(local[0].ranges, [0..1, 3..5]);
        assert_eq!(local[1].ranges, std::iter::once(1..3).collect::<Vec<_>>());
    }
}
