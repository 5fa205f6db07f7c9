//! Bloom's fused `query_key_value`: in its checkpoints the rows (and bias entries) are
//! interleaved per head, `[heads, 3, head_dim]` (head 0's q, k, v, then head 1's, …), while the
//! engine keeps every packed q/k/v tensor as `[3, heads, head_dim]` ([Q; K; V], as Baichuan's
//! `W_pack`), so the layout carves q, k and v as three consecutive row blocks. Loading and
//! saving move the `3 · heads` blocks of `head_dim` rows between the two orders by wrapping the
//! destination / source: file block `b = h · 3 + j` is engine block `j · heads + h`. Each block
//! is contiguous (`head_dim · width` elements), so the streamed load and save keep their large
//! pieces; nothing else changes (other tensors pass straight through).

use std::ops::Range;

use crate::config::{LlamaConfig, ModelFamily};
use crate::error::Result;
use crate::params::{ParamSpec, TensorNames};
use crate::tensor_io::{TensorDest, TensorSource};

/// One interleaved tensor: its range and the elements of one head's q (or k, or v) block.
#[derive(Clone, Debug)]
struct Interleaved {
    range: Range<usize>,
    block: usize,
}

/// The interleaved tensors of a model (empty for every family but Bloom).
#[derive(Clone, Debug, Default)]
pub(crate) struct QkvInterleave {
    tensors: Vec<Interleaved>,
    heads: usize,
}

impl QkvInterleave {
    pub(crate) fn of(config: &LlamaConfig, specs: &[ParamSpec]) -> QkvInterleave {
        if config.family != ModelFamily::Bloom {
            return QkvInterleave::default();
        }
        let names = TensorNames::of(config.family);
        let suffixes = [
            (
                format!(".{}.weight", names.qkv),
                config.head_dim * config.hidden_size,
            ),
            (format!(".{}.bias", names.qkv), config.head_dim),
        ];
        let tensors = specs
            .iter()
            .filter_map(|s| {
                suffixes
                    .iter()
                    .find(|(suffix, _)| s.name.ends_with(suffix.as_str()))
                    .map(|&(_, block)| Interleaved {
                        range: s.range(),
                        block,
                    })
            })
            .collect();
        QkvInterleave {
            tensors,
            heads: config.num_attention_heads,
        }
    }

    /// The engine's range of file block `b` of tensor `t`.
    fn engine_block(&self, t: &Interleaved, b: usize) -> Range<usize> {
        let (h, j) = (b / 3, b % 3);
        let start = t.range.start + (j * self.heads + h) * t.block;
        start..start + t.block
    }

    fn find(&self, range: &Range<usize>) -> Option<&Interleaved> {
        self.tensors.iter().find(|t| t.range == *range)
    }

    /// `dest` taking the file's order for the interleaved tensors.
    pub(crate) fn dest<'a>(&'a self, inner: &'a mut dyn TensorDest) -> impl TensorDest + 'a {
        PermutedDest { qkv: self, inner }
    }

    /// `source` giving the file's order for the interleaved tensors.
    pub(crate) fn source<'a>(&'a self, inner: &'a mut dyn TensorSource) -> impl TensorSource + 'a {
        PermutedSource { qkv: self, inner }
    }
}

/// A flat buffer in the engine's layout (parameters or gradients) with every tensor in the
/// order its checkpoint stores it: Bloom's `query_key_value` interleaved per head again; a
/// copy for the other families.
pub fn checkpoint_order(config: &LlamaConfig, specs: &[ParamSpec], data: &[f32]) -> Vec<f32> {
    let qkv = QkvInterleave::of(config, specs);
    let mut out = data.to_vec();
    let mut inner: &[f32] = data;
    let mut source = qkv.source(&mut inner);
    for spec in specs {
        let range = spec.range();
        let mut at = range.start;
        source
            .read(range, &mut |values| {
                out[at..at + values.len()].copy_from_slice(values);
                at += values.len();
                Ok(())
            })
            .expect("reading a host buffer cannot fail");
    }
    out
}

struct PermutedDest<'a> {
    qkv: &'a QkvInterleave,
    inner: &'a mut dyn TensorDest,
}

impl TensorDest for PermutedDest<'_> {
    fn write(
        &mut self,
        range: Range<usize>,
        fill: &mut dyn FnMut(usize, &mut [f32]) -> Result<()>,
    ) -> Result<()> {
        let Some(t) = self.qkv.find(&range) else {
            return self.inner.write(range, fill);
        };
        for b in 0..3 * self.qkv.heads {
            let file_start = b * t.block;
            self.inner
                .write(self.qkv.engine_block(t, b), &mut |offset, buf| {
                    fill(file_start + offset, buf)
                })?;
        }
        Ok(())
    }
}

struct PermutedSource<'a> {
    qkv: &'a QkvInterleave,
    inner: &'a mut dyn TensorSource,
}

impl TensorSource for PermutedSource<'_> {
    fn read(
        &mut self,
        range: Range<usize>,
        sink: &mut dyn FnMut(&[f32]) -> Result<()>,
    ) -> Result<()> {
        let Some(t) = self.qkv.find(&range) else {
            return self.inner.read(range, sink);
        };
        for b in 0..3 * self.qkv.heads {
            self.inner.read(self.qkv.engine_block(t, b), sink)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_move_between_the_head_interleaved_and_the_stacked_order() {
        let json = r#"{"architectures": ["BloomForCausalLM"], "hidden_size": 4, "n_layer": 1,
            "n_head": 2, "vocab_size": 5}"#;
        let config = LlamaConfig::from_json_str(json, "config.json").unwrap();
        let specs = crate::params::ParamStore::specs_for(&config);
        let qkv = QkvInterleave::of(&config, &specs);
        assert_eq!(qkv.tensors.len(), 2);
        let bias = qkv.tensors.iter().find(|t| t.block == 2).unwrap().clone();
        // File bias: [h0 q, h0 k, h0 v, h1 q, h1 k, h1 v], 2 values each.
        let file: Vec<f32> = (0..12).map(|x| x as f32).collect();
        let numel = specs.last().unwrap().range().end;
        let mut engine = vec![0.0f32; numel];
        {
            let mut inner: &mut [f32] = &mut engine;
            let mut dest = qkv.dest(&mut inner);
            dest.write(bias.range.clone(), &mut |off, buf| {
                buf.copy_from_slice(&file[off..off + buf.len()]);
                Ok(())
            })
            .unwrap();
        }
        // Engine: [Q: h0, h1][K: h0, h1][V: h0, h1].
        let want = [0., 1., 6., 7., 2., 3., 8., 9., 4., 5., 10., 11.];
        assert_eq!(&engine[bias.range.clone()], &want);
        let mut back = Vec::new();
        let mut inner: &[f32] = &engine;
        let mut source = qkv.source(&mut inner);
        source
            .read(bias.range.clone(), &mut |v| {
                back.extend_from_slice(v);
                Ok(())
            })
            .unwrap();
        assert_eq!(back, file);
    }
}
