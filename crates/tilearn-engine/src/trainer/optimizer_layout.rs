//! Where each element of an optimizer state file sits in the whole model, and how the state
//! of one layout is read into another (re-sharding).
//!
//! A file's flat moments are a run of [`TensorSlice`]s in order: each names a Hugging Face
//! tensor, its *full* shape, the rectangle of it the writer held (`rows` × `cols`: a
//! tensor-parallel cut is rows or columns of the full tensor, a replicated tensor all of it)
//! and the part of that rectangle, in row-major order, the file holds (`elements`: ZeRO cuts
//! a rank's buffer anywhere, also inside a tensor). A 1-D tensor is a column (`cols = [0, 1]`).
//! A replicated tensor is held by several tensor-parallel ranks; all but one mark their slice
//! `copy`, so the slices without the mark cover each tensor exactly once.
//!
//! Re-sharding is geometry: a rank describes the state it needs in the same terms (its own
//! slices) and [`plan_runs`] intersects them with the saved ones, row by row, into contiguous
//! copies ([`Run`]), so each rank reads only the elements it holds.

use std::collections::HashMap;
use std::ops::Range;

use serde::{Deserialize, Serialize};

use crate::params::ParamSpec;

/// A part of one tensor of the whole model (see the module docs).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TensorSlice {
    pub name: String,
    /// The whole tensor's shape.
    pub shape: Vec<usize>,
    pub rows: [usize; 2],
    pub cols: [usize; 2],
    /// Row-major element range within the `rows` × `cols` rectangle.
    pub elements: [usize; 2],
    /// A replica of a tensor another rank's slice also holds (ignored when reading).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub copy: bool,
}

impl TensorSlice {
    pub fn len(&self) -> usize {
        self.elements[1] - self.elements[0]
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn width(&self) -> usize {
        self.cols[1] - self.cols[0]
    }

    /// The full shape as rows × columns (a 1-D tensor is one column).
    fn full_dims(&self) -> (usize, usize) {
        match self.shape.as_slice() {
            [n] => (*n, 1),
            [r, c] => (*r, *c),
            other => (other.iter().product(), 1),
        }
    }

    /// Whether the slice fits its shape (for checking a file's metadata).
    pub fn is_consistent(&self) -> bool {
        let (rows, cols) = self.full_dims();
        let area = (self.rows[1] - self.rows[0].min(self.rows[1]))
            * (self.cols[1] - self.cols[0].min(self.cols[1]));
        self.rows[0] <= self.rows[1]
            && self.rows[1] <= rows
            && self.cols[0] <= self.cols[1]
            && self.cols[1] <= cols
            && self.elements[0] <= self.elements[1]
            && self.elements[1] <= area
    }

    /// The full rows with at least one element in the slice.
    fn row_span(&self) -> Range<usize> {
        let w = self.width().max(1);
        let first = self.rows[0] + self.elements[0] / w;
        let last = self.rows[0] + self.elements[1].div_ceil(w);
        first..last.min(self.rows[1])
    }

    /// The full columns of row `row` (inside [`Self::row_span`]) the slice holds.
    fn cols_of(&self, row: usize) -> Range<usize> {
        let w = self.width();
        let at = (row - self.rows[0]) * w;
        let lo = self.elements[0].max(at) - at;
        let hi = self.elements[1].min(at + w).saturating_sub(at);
        self.cols[0] + lo..self.cols[0] + hi.max(lo)
    }

    /// The position (relative to the slice's first element) of full element (`row`, `col`).
    fn position(&self, row: usize, col: usize) -> usize {
        (row - self.rows[0]) * self.width() + (col - self.cols[0]) - self.elements[0]
    }
}

/// Where a tensor of a rank's buffer lies in the whole tensor.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorPlace {
    /// The whole tensor's shape.
    pub shape: Vec<usize>,
    pub rows: Range<usize>,
    pub cols: Range<usize>,
    pub copy: bool,
}

impl TensorPlace {
    /// All of a tensor of shape `shape`.
    pub fn whole(shape: &[usize]) -> TensorPlace {
        let (rows, cols) = match shape {
            [r, c] => (*r, *c),
            other => (other.iter().product(), 1),
        };
        TensorPlace {
            shape: shape.to_vec(),
            rows: 0..rows,
            cols: 0..cols,
            copy: false,
        }
    }
}

/// The slices of the flat elements `range` of a buffer holding the tensors `specs` (each placed
/// in its whole tensor by `place`), in buffer order.
pub fn slices_within(
    specs: &[ParamSpec],
    place: impl Fn(&ParamSpec) -> TensorPlace,
    range: &Range<usize>,
) -> Vec<TensorSlice> {
    specs
        .iter()
        .filter_map(|spec| {
            let r = spec.range();
            let (lo, hi) = (r.start.max(range.start), r.end.min(range.end));
            if lo >= hi {
                return None;
            }
            let p = place(spec);
            Some(TensorSlice {
                name: spec.name.clone(),
                shape: p.shape,
                rows: [p.rows.start, p.rows.end],
                cols: [p.cols.start, p.cols.end],
                elements: [lo - r.start, hi - r.start],
                copy: p.copy,
            })
        })
        .collect()
}

/// The flat elements `range` of the whole model's buffer (tensors `specs`) as slices.
pub fn whole_slices(specs: &[ParamSpec], range: &Range<usize>) -> Vec<TensorSlice> {
    slices_within(specs, |s| TensorPlace::whole(&s.shape), range)
}

/// One contiguous copy: `len` elements from position `src` of source file `source` to
/// position `dst` of the destination.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Run {
    pub source: usize,
    pub src: usize,
    pub dst: usize,
    pub len: usize,
}

/// Why the saved slices cannot fill the wanted ones.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Gap {
    /// Source `source` holds `name` with another full shape (another model).
    Shape {
        source: usize,
        name: String,
        saved: Vec<usize>,
        wanted: Vec<usize>,
    },
    /// The sources hold `found` of the `wanted` elements of `name` the destination needs.
    Missing {
        name: String,
        found: usize,
        wanted: usize,
    },
}

/// The copies that fill `dest` (slices laid out one after the other from position 0) from the
/// `sources` (each a file's slices, laid out likewise), in destination order, adjacent copies
/// merged. Copies (`copy` slices) among the sources are skipped; every wanted element must be
/// found exactly once.
pub fn plan_runs(dest: &[TensorSlice], sources: &[Vec<TensorSlice>]) -> Result<Vec<Run>, Gap> {
    // name → (source, slice, its position in the source)
    let mut saved: HashMap<&str, Vec<(usize, &TensorSlice, usize)>> = HashMap::new();
    for (s, slices) in sources.iter().enumerate() {
        let mut at = 0;
        for slice in slices {
            if !slice.copy {
                saved.entry(&slice.name).or_default().push((s, slice, at));
            }
            at += slice.len();
        }
    }
    let mut runs: Vec<Run> = Vec::new();
    let mut dst_at = 0;
    for want in dest {
        let mut found = 0;
        for &(source, have, src_at) in saved.get(want.name.as_str()).into_iter().flatten() {
            if have.shape != want.shape {
                return Err(Gap::Shape {
                    source,
                    name: want.name.clone(),
                    saved: have.shape.clone(),
                    wanted: want.shape.clone(),
                });
            }
            let (a, b) = (want.row_span(), have.row_span());
            for row in a.start.max(b.start)..a.end.min(b.end) {
                let (x, y) = (want.cols_of(row), have.cols_of(row));
                let (lo, hi) = (x.start.max(y.start), x.end.min(y.end));
                if lo >= hi {
                    continue;
                }
                let run = Run {
                    source,
                    src: src_at + have.position(row, lo),
                    dst: dst_at + want.position(row, lo),
                    len: hi - lo,
                };
                found += run.len;
                match runs.last_mut() {
                    Some(last)
                        if last.source == run.source
                            && last.src + last.len == run.src
                            && last.dst + last.len == run.dst =>
                    {
                        last.len += run.len
                    }
                    _ => runs.push(run),
                }
            }
        }
        if found != want.len() {
            return Err(Gap::Missing {
                name: want.name.clone(),
                found,
                wanted: want.len(),
            });
        }
        dst_at += want.len();
    }
    Ok(runs)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(name: &str, shape: &[usize], offset: usize) -> ParamSpec {
        ParamSpec {
            name: name.into(),
            shape: shape.to_vec(),
            offset,
            decay: true,
        }
    }

    /// A 4×6 matrix and a 5-vector, whole: `m` at 0..24, `v` at 24..29.
    fn model() -> Vec<ParamSpec> {
        vec![spec("m", &[4, 6], 0), spec("v", &[5], 24)]
    }

    /// The value of every element of the whole model: its flat index.
    fn whole_values() -> Vec<f32> {
        (0..29).map(|i| i as f32).collect()
    }

    /// The values a file holding `slices` holds (taken from the whole model).
    fn values_of(slices: &[TensorSlice]) -> Vec<f32> {
        let whole = whole_values();
        let specs = model();
        let mut out = Vec::new();
        for s in slices {
            let base = specs.iter().find(|p| p.name == s.name).unwrap().offset;
            let (_, cols) = s.full_dims();
            let w = s.width();
            for e in s.elements[0]..s.elements[1] {
                let (r, c) = (s.rows[0] + e / w, s.cols[0] + e % w);
                out.push(whole[base + r * cols + c]);
            }
        }
        out
    }

    /// Tensor-parallel rank `rank` of 2: `m` cut by columns, `v` replicated.
    fn tp_rank(rank: usize) -> (Vec<ParamSpec>, impl Fn(&ParamSpec) -> TensorPlace) {
        let local = vec![spec("m", &[4, 3], 0), spec("v", &[5], 12)];
        let place = move |s: &ParamSpec| match s.name.as_str() {
            "m" => TensorPlace {
                shape: vec![4, 6],
                rows: 0..4,
                cols: rank * 3..rank * 3 + 3,
                copy: false,
            },
            _ => TensorPlace {
                copy: rank != 0,
                ..TensorPlace::whole(&[5])
            },
        };
        (local, place)
    }

    fn apply(runs: &[Run], sources: &[Vec<f32>], len: usize) -> Vec<f32> {
        let mut out = vec![f32::NAN; len];
        for r in runs {
            out[r.dst..r.dst + r.len].copy_from_slice(&sources[r.source][r.src..r.src + r.len]);
        }
        out
    }

    /// Two tensor-parallel ranks, each cut in two ZeRO shards at an odd place, read back into
    /// the whole model and into a ZeRO shard of it that starts inside `m`'s row 1.
    #[test]
    fn column_cut_zero_shards_reassemble_into_any_range() {
        let mut sources = Vec::new();
        for rank in 0..2 {
            let (local, place) = tp_rank(rank);
            for shard in [0..7, 7..17] {
                sources.push(slices_within(&local, &place, &shard));
            }
        }
        let values: Vec<Vec<f32>> = sources.iter().map(|s| values_of(s)).collect();
        for range in [0..29, 8..27, 0..0, 24..29] {
            let dest = whole_slices(&model(), &range);
            let runs = plan_runs(&dest, &sources).unwrap();
            let got = apply(&runs, &values, range.len());
            assert_eq!(got, whole_values()[range.clone()], "{range:?}");
        }
        // Row-major full rows merge into one copy per source.
        let dest = whole_slices(&model(), &(24..29));
        assert_eq!(plan_runs(&dest, &sources).unwrap().len(), 1);
    }

    /// The whole model read into a tensor-parallel rank's slices.
    #[test]
    fn whole_files_fill_a_column_cut() {
        let sources = vec![
            whole_slices(&model(), &(0..10)),
            whole_slices(&model(), &(10..29)),
        ];
        let values: Vec<Vec<f32>> = sources.iter().map(|s| values_of(s)).collect();
        let (local, place) = tp_rank(1);
        let dest = slices_within(&local, &place, &(2..17));
        let runs = plan_runs(&dest, &sources).unwrap();
        assert_eq!(apply(&runs, &values, 15), values_of(&dest));
    }

    #[test]
    fn missing_or_foreign_state_is_named() {
        let sources = vec![whole_slices(&model(), &(0..20))];
        let dest = whole_slices(&model(), &(0..29));
        assert_eq!(
            plan_runs(&dest, &sources),
            Err(Gap::Missing {
                name: "m".into(),
                found: 20,
                wanted: 24
            })
        );
        let other = vec![whole_slices(&[spec("m", &[6, 4], 0)], &(0..24))];
        assert!(matches!(
            plan_runs(&dest, &other),
            Err(Gap::Shape { source: 0, .. })
        ));
        // A replica's copy does not count.
        let (local, place) = tp_rank(1);
        let copies = vec![slices_within(&local, &place, &(12..17))];
        let want = whole_slices(&model(), &(24..29));
        assert!(matches!(
            plan_runs(&want, &copies),
            Err(Gap::Missing { found: 0, .. })
        ));
    }

    #[test]
    fn slices_check_their_shape() {
        let (local, place) = tp_rank(1);
        for s in slices_within(&local, &place, &(0..17)) {
            assert!(s.is_consistent(), "{s:?}");
        }
        let bad = TensorSlice {
            cols: [3, 7],
            ..slices_within(&local, &place, &(0..12)).remove(0)
        };
        assert!(!bad.is_consistent());
    }
}
