//! The optimizer state of a checkpoint, whole or in ZeRO shards, read back for any partition.
//!
//! * Whole: `optimizer.safetensors` ([`super::optimizer_file`]), written by a single process or
//!   by rank 0 of plain data parallelism (every rank holds the same state).
//! * Sharded (ZeRO): one file per rank, `optimizer-rank00001-of-00004.safetensors`, each in the
//!   same format for the `end - start` parameters it owns (its groups shifted to the shard), and
//!   the manifest `optimizer_shards.json` naming every file and its element range of the flat
//!   parameter buffer.
//!
//! * Sliced (tensor or pipeline parallelism, with or without ZeRO): one file per writing rank,
//!   each in the same format with the `layout` metadata ([`super::optimizer_layout`]: the
//!   tensors' full shapes and the slice of each the file holds), and the manifest (version 2)
//!   naming the files and the layout they came from.
//!
//! [`OptimizerCheckpoint::read`] fills the moments of any element range of the whole model, and
//! [`OptimizerCheckpoint::read_slices`] those of any slices of its tensors, from whichever files
//! hold them: a run resumes on another world size, or another tensor/pipeline layout, by
//! reading the parts of the saved files that overlap what it holds. Whole and version-1 files
//! are ranges of the whole model's flat buffer, which the reader describes as slices itself.

use std::ops::Range;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use tilearn_optim::ParamGroup;

use super::optimizer_file::{self, StateFile};
use super::optimizer_layout::{Gap, Run, TensorSlice, plan_runs, whole_slices};
use super::state;
use crate::checkpoint::TensorDest;
use crate::params::ParamSpec;
use crate::{EngineError, Result};

/// The manifest of a sharded optimizer state.
pub const MANIFEST_FILE: &str = "optimizer_shards.json";
const MANIFEST_FORMAT: &str = "tilearn-zero-optimizer";
const MANIFEST_VERSION: u32 = 1;
/// The manifest version of sliced (tensor/pipeline-parallel) optimizer states.
const SLICED_VERSION: u32 = 2;

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

/// `optimizer_shards.json` of a sliced state (version 2): the files, each describing its own
/// slices, and the layout that wrote them (for people; the reader goes by the slices).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SlicedManifest {
    pub format: String,
    pub format_version: u32,
    /// Parameters of the whole model.
    pub numel: usize,
    pub tp_size: usize,
    pub pp_size: usize,
    pub dp_size: usize,
    pub zero_stage: u8,
    pub files: Vec<String>,
}

impl SlicedManifest {
    /// The manifest of a layout whose `files` writers each saved their slices.
    pub fn new(
        numel: usize,
        (tp_size, pp_size, dp_size): (usize, usize, usize),
        zero_stage: u8,
        files: Vec<String>,
    ) -> SlicedManifest {
        SlicedManifest {
            format: MANIFEST_FORMAT.into(),
            format_version: SLICED_VERSION,
            numel,
            tp_size,
            pp_size,
            dp_size,
            zero_stage,
            files,
        }
    }

    fn check(&self, path: &Path, numel: usize) -> Result<()> {
        let bad = |message: String| {
            Err(EngineError::Data {
                file: path.to_path_buf(),
                message,
            })
        };
        if self.numel != numel {
            return bad(format!(
                "the optimizer state is for {} parameters, this model has {numel}; resume with \
                 the same model",
                self.numel
            ));
        }
        if self.files.is_empty() {
            return bad("names no optimizer files".into());
        }
        if let Some(f) = self.files.iter().find(|f| f.contains(['/', '\\'])) {
            return bad(format!("file `{f}` is not a plain file name"));
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
    /// Files of model slices, opened for the whole model's tensors `specs`.
    Sliced {
        dir: PathBuf,
        manifest: SlicedManifest,
        specs: Vec<ParamSpec>,
    },
}

impl OptimizerCheckpoint {
    /// The optimizer state of checkpoint `dir` for the whole model's tensors `specs`; `None`
    /// when the checkpoint has none (saved with `--save-only-model`).
    pub fn open(dir: &Path, specs: &[ParamSpec]) -> Result<Option<OptimizerCheckpoint>> {
        let numel = specs.iter().map(ParamSpec::numel).sum();
        let manifest_path = dir.join(MANIFEST_FILE);
        let dir = dir.to_path_buf();
        let opened = if manifest_path.exists() {
            let value: serde_json::Value = state::read_json(&manifest_path)?;
            let version = value.get("format_version").and_then(|v| v.as_u64());
            if version == Some(SLICED_VERSION.into()) {
                let manifest: SlicedManifest =
                    serde_json::from_value(value).map_err(|e| EngineError::Data {
                        file: manifest_path.clone(),
                        message: format!("not a valid sliced optimizer manifest: {e}"),
                    })?;
                manifest.check(&manifest_path, numel)?;
                OptimizerCheckpoint::Sliced {
                    dir,
                    manifest,
                    specs: specs.to_vec(),
                }
            } else {
                let manifest: ShardManifest = state::read_json(&manifest_path)?;
                manifest.check(&manifest_path, numel)?;
                OptimizerCheckpoint::Sharded { dir, manifest }
            }
        } else {
            let whole = dir.join(state::OPTIMIZER_FILE);
            if !whole.exists() {
                return Ok(None);
            }
            OptimizerCheckpoint::Whole(whole)
        };
        Ok(Some(opened))
    }

    /// The checkpoint directory.
    fn dir(&self) -> &Path {
        match self {
            OptimizerCheckpoint::Whole(path) => path.parent().unwrap_or(Path::new(".")),
            OptimizerCheckpoint::Sharded { dir, .. } | OptimizerCheckpoint::Sliced { dir, .. } => {
                dir
            }
        }
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
                    check_step(&path, &mut step, s)?;
                }
                Ok(step.unwrap_or_default())
            }
            OptimizerCheckpoint::Sliced { specs, .. } => {
                self.read_slices(specs, &whole_slices(specs, &range), dest)
            }
        }
    }

    /// Reads the moments of the slices `want` of the whole model's tensors `specs` (laid out
    /// one after the other: `0..len` is `exp_avg`, `len..2·len` is `exp_avg_sq`, `len` = their
    /// elements) into `dest` and returns the step count. Only the files holding a part of
    /// `want` are read, and of them only those parts.
    pub fn read_slices(
        &self,
        specs: &[ParamSpec],
        want: &[TensorSlice],
        dest: &mut dyn TensorDest,
    ) -> Result<u64> {
        let len: usize = want.iter().map(TensorSlice::len).sum();
        // Each source: its path, its slices, and the file if it was opened to learn them.
        let mut sources: Vec<(PathBuf, Vec<TensorSlice>, Option<StateFile>)> = Vec::new();
        match self {
            OptimizerCheckpoint::Whole(path) => {
                let numel = specs.iter().map(ParamSpec::numel).sum();
                sources.push((path.clone(), whole_slices(specs, &(0..numel)), None));
            }
            OptimizerCheckpoint::Sharded { dir, manifest } => {
                for shard in &manifest.shards {
                    let slices = whole_slices(specs, &(shard.start..shard.end));
                    sources.push((dir.join(&shard.file), slices, None));
                }
            }
            OptimizerCheckpoint::Sliced { dir, manifest, .. } => {
                for name in &manifest.files {
                    let path = dir.join(name);
                    if !path.exists() {
                        return Err(EngineError::Data {
                            file: path,
                            message: format!(
                                "is missing, so the optimizer state is incomplete; resume from \
                                 a complete checkpoint, or start a new run from its weights \
                                 with --model {}",
                                dir.display()
                            ),
                        });
                    }
                    let file = StateFile::open(&path, None)?;
                    let Some(slices) = file.layout.clone() else {
                        return Err(EngineError::Data {
                            file: path,
                            message: "has no `layout` metadata, which every file of a sliced \
                                      optimizer state carries; the checkpoint mixes files of \
                                      different saves: resume from another checkpoint, or \
                                      start from its weights with --model"
                                .into(),
                        });
                    };
                    sources.push((path, slices, Some(file)));
                }
            }
        }
        let layouts: Vec<Vec<TensorSlice>> = sources.iter().map(|s| s.1.clone()).collect();
        let runs = plan_runs(want, &layouts).map_err(|gap| self.gap_error(gap, &sources))?;
        let mut step = None;
        // The first source gives the step count when nothing is to be read (an empty shard).
        let used: Vec<usize> = if runs.is_empty() {
            vec![0]
        } else {
            let mut used: Vec<usize> = runs.iter().map(|r| r.source).collect();
            used.sort_unstable();
            used.dedup();
            used
        };
        for s in used {
            let (path, slices, opened) = &mut sources[s];
            let numel = slices.iter().map(TensorSlice::len).sum();
            if opened.is_none() {
                *opened = Some(StateFile::open(path, Some(numel))?);
            }
            let file = opened.as_ref().expect("opened above");
            if file.numel != numel {
                return Err(EngineError::Data {
                    file: path.clone(),
                    message: format!(
                        "holds {} parameters, its manifest says {numel}; the checkpoint mixes \
                         files of different saves",
                        file.numel
                    ),
                });
            }
            check_step(path, &mut step, file.step)?;
            let mine = runs.iter().filter(|r| r.source == s);
            for moment in 0..2 {
                for &Run {
                    src, dst, len: n, ..
                } in mine.clone()
                {
                    file.read_into(moment, src..src + n, dest, moment * len + dst)?;
                }
            }
        }
        Ok(step.unwrap_or_default())
    }

    /// The error for saved slices that cannot fill the wanted ones, naming the file and the fix.
    fn gap_error(
        &self,
        gap: Gap,
        sources: &[(PathBuf, Vec<TensorSlice>, Option<StateFile>)],
    ) -> EngineError {
        match gap {
            Gap::Shape {
                source,
                name,
                saved,
                wanted,
            } => EngineError::Data {
                file: sources[source].0.clone(),
                message: format!(
                    "holds the optimizer state of `{name}` with shape {saved:?}, this model's is \
                     {wanted:?}: the checkpoint is of another model; resume with the model it \
                     was saved from, or start a new run from its weights with --model"
                ),
            },
            Gap::Missing {
                name,
                found,
                wanted,
            } => EngineError::Data {
                file: match self {
                    OptimizerCheckpoint::Whole(path) => path.clone(),
                    _ => self.dir().join(MANIFEST_FILE),
                },
                message: format!(
                    "its optimizer files hold {found} of the {wanted} elements of `{name}` this \
                     rank needs, so the state cannot be re-sharded to this layout (a shard file \
                     is missing, or from another save); resume from a complete checkpoint, or \
                     start a new run from its weights with --model {}",
                    self.dir().display()
                ),
            },
        }
    }
}

/// Records a file's step count, refusing one that differs from the files read before it.
fn check_step(path: &Path, step: &mut Option<u64>, s: u64) -> Result<()> {
    if let Some(prev) = *step
        && prev != s
    {
        return Err(EngineError::Data {
            file: path.to_path_buf(),
            message: format!(
                "its step count {s} differs from the other shards' {prev}; the checkpoint mixes \
                 shards of different saves"
            ),
        });
    }
    *step = Some(s);
    Ok(())
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

    /// A model of one 1-D tensor of `numel` elements.
    fn flat(numel: usize) -> Vec<ParamSpec> {
        vec![ParamSpec {
            name: "w".into(),
            shape: vec![numel],
            offset: 0,
            decay: true,
        }]
    }

    /// A 3×4 matrix `m` saved by two tensor-parallel ranks holding columns 0..2 and 2..4,
    /// the second rank's file split by ZeRO after 3 elements: moments `m[i] = i`,
    /// `v[i] = 1000 + i` of the whole matrix's flat index.
    fn write_sliced(dir: &Path, step: u64, files: &[usize]) {
        use crate::trainer::optimizer_layout::{TensorPlace, slices_within};
        let local = vec![ParamSpec {
            name: "m".into(),
            shape: vec![3, 2],
            offset: 0,
            decay: true,
        }];
        let mut names = Vec::new();
        let writers = [(0, 0..6), (1, 0..3), (1, 3..6)];
        for (index, (rank, shard)) in writers.into_iter().enumerate() {
            let name = shard_file_name(index, 3);
            names.push(name.clone());
            if !files.contains(&index) {
                continue;
            }
            let place = |_: &ParamSpec| TensorPlace {
                shape: vec![3, 4],
                rows: 0..3,
                cols: rank * 2..rank * 2 + 2,
                copy: false,
            };
            let slices = slices_within(&local, place, &shard);
            let full = |e: usize| (e / 2 * 4 + rank * 2 + e % 2) as f32;
            let m: Vec<f32> = shard.clone().map(full).collect();
            let v: Vec<f32> = shard.clone().map(|e| 1000.0 + full(e)).collect();
            let both: Vec<f32> = m.iter().chain(&v).copied().collect();
            let mut source: &[f32] = &both;
            let groups = vec![ParamGroup::whole("all", shard.len(), 0.1)];
            let path = dir.join(&name);
            optimizer_file::write_sliced(
                &path,
                &config(),
                &groups,
                step,
                shard.len(),
                Some(&slices),
                &mut source,
            )
            .unwrap();
        }
        let manifest = SlicedManifest::new(12, (2, 1, 1), 1, names);
        state::write_json(&dir.join(MANIFEST_FILE), &manifest).unwrap();
    }

    #[test]
    fn sliced_files_read_back_as_any_range_of_the_whole_model() {
        let dir = tempfile::tempdir().unwrap();
        write_sliced(dir.path(), 4, &[0, 1, 2]);
        let specs = vec![ParamSpec {
            name: "m".into(),
            shape: vec![3, 4],
            offset: 0,
            decay: true,
        }];
        let ckpt = OptimizerCheckpoint::open(dir.path(), &specs)
            .unwrap()
            .unwrap();
        for range in [0..12, 5..11, 0..0] {
            let mut both = vec![-1.0f32; 2 * range.len()];
            let step = ckpt.read(12, range.clone(), &mut &mut both[..]).unwrap();
            assert_eq!(step, 4);
            let want: Vec<f32> = range
                .clone()
                .map(|i| i as f32)
                .chain(range.clone().map(|i| 1000.0 + i as f32))
                .collect();
            assert_eq!(both, want, "{range:?}");
        }
        // A missing file is named with the fix.
        let gone = tempfile::tempdir().unwrap();
        write_sliced(gone.path(), 4, &[0, 1]);
        let e = OptimizerCheckpoint::open(gone.path(), &specs)
            .unwrap()
            .unwrap()
            .read(12, 0..12, &mut &mut vec![0.0; 24][..])
            .unwrap_err()
            .to_string();
        assert!(e.contains("optimizer-rank00002-of-00003"), "{e}");
        // Files of different saves are refused.
        let mixed = tempfile::tempdir().unwrap();
        write_sliced(mixed.path(), 4, &[0, 1]);
        let other = tempfile::tempdir().unwrap();
        write_sliced(other.path(), 5, &[2]);
        let name = shard_file_name(2, 3);
        std::fs::copy(other.path().join(&name), mixed.path().join(&name)).unwrap();
        let e = OptimizerCheckpoint::open(mixed.path(), &specs)
            .unwrap()
            .unwrap()
            .read(12, 0..12, &mut &mut vec![0.0; 24][..])
            .unwrap_err()
            .to_string();
        assert!(e.contains("different saves"), "{e}");
        // Another model's state is refused, naming the file.
        let wrong = vec![ParamSpec {
            shape: vec![4, 3],
            ..specs[0].clone()
        }];
        let e = OptimizerCheckpoint::open(dir.path(), &wrong)
            .unwrap()
            .unwrap()
            .read(12, 0..12, &mut &mut vec![0.0; 24][..])
            .unwrap_err()
            .to_string();
        assert!(e.contains("another model"), "{e}");
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
        let ckpt = OptimizerCheckpoint::open(dir.path(), &flat(numel))
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
        let e = OptimizerCheckpoint::open(dir.path(), &flat(12)).unwrap_err();
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
        let ckpt = OptimizerCheckpoint::open(dir.path(), &flat(numel))
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
