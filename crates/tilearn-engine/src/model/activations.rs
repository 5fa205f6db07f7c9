//! `Activations`: every buffer the forward and backward need, allocated once for a
//! (batch, seq) capacity, so a training step allocates nothing.
//!
//! Without gradient checkpointing each decoder layer keeps its own [`LayerActs`]; with it there
//! is one `LayerActs`, reused: only each block's input (`resid`) is kept for the whole model and
//! the block is recomputed inside its backward.

use tilearn_ops::cpu::{Real, RopeTable};

use super::layout::ModelLayout;
use crate::config::{LlamaConfig, PositionEncoding, RopeScalingConfig};

/// What one decoder layer's forward saves for its backward (`N = batch * seq` rows).
#[derive(Clone, Debug)]
pub struct LayerActs<R: Real> {
    /// `1/rms` of the block input, `[N]`.
    pub rstd1: Vec<R>,
    /// `input_layernorm(x)`, `[N, C]`.
    pub xn1: Vec<R>,
    /// Queries after rotary embedding, `[N, Hq*D]`.
    pub q: Vec<R>,
    /// Keys after rotary embedding, `[N, Hkv*D]`.
    pub k: Vec<R>,
    /// Values, `[N, Hkv*D]`.
    pub v: Vec<R>,
    /// Attention output (input of `o_proj`), `[N, Hq*D]`.
    pub att: Vec<R>,
    /// Log-sum-exp of the attention scores, `[B, Hq, T]`.
    pub lse: Vec<R>,
    /// Residual stream after attention, `[N, C]`.
    pub h: Vec<R>,
    /// `1/rms` of `h`, `[N]`.
    pub rstd2: Vec<R>,
    /// `post_attention_layernorm(h)`, `[N, C]`.
    pub xn2: Vec<R>,
    /// `gate_proj` output, `[N, I]`.
    pub gate: Vec<R>,
    /// `up_proj` output, `[N, I]`.
    pub up: Vec<R>,
    /// `silu(gate) * up` (input of `down_proj`), `[N, I]`; `gelu(up)` for Bloom's MLP.
    pub act: Vec<R>,
    /// LayerNorm means of the block input and of `h` (Bloom), `[N]` each.
    pub mean1: Vec<R>,
    pub mean2: Vec<R>,
}

impl<R: Real> LayerActs<R> {
    fn new(c: &LlamaConfig, batch: usize, seq: usize) -> Self {
        let n = batch * seq;
        let z = |len: usize| vec![R::zero(); len];
        LayerActs {
            rstd1: z(n),
            xn1: z(n * c.hidden_size),
            q: z(n * c.q_dim()),
            k: z(n * c.kv_dim()),
            v: z(n * c.kv_dim()),
            att: z(n * c.q_dim()),
            lse: z(n * c.num_attention_heads),
            h: z(n * c.hidden_size),
            rstd2: z(n),
            xn2: z(n * c.hidden_size),
            gate: z(n * c.intermediate_size),
            up: z(n * c.intermediate_size),
            act: z(n * c.intermediate_size),
            mean1: z(n),
            mean2: z(n),
        }
    }

    fn len(&self) -> usize {
        [
            &self.rstd1,
            &self.xn1,
            &self.q,
            &self.k,
            &self.v,
            &self.att,
            &self.lse,
            &self.h,
            &self.rstd2,
            &self.xn2,
            &self.gate,
            &self.up,
            &self.act,
            &self.mean1,
            &self.mean2,
        ]
        .iter()
        .map(|b| b.len())
        .sum()
    }
}

/// Gradient scratch of the backward, shared by all layers.
#[derive(Clone, Debug)]
pub struct GradScratch<R: Real> {
    /// Gradient w.r.t. the residual stream, `[N, C]`.
    pub dres: Vec<R>,
    /// Gradient w.r.t. a norm output, `[N, C]`.
    pub dxn: Vec<R>,
    /// Temporary `[N, C]` (the `=` output of a backward before it is added).
    pub dtmp: Vec<R>,
    pub dq: Vec<R>,
    pub dk: Vec<R>,
    pub dv: Vec<R>,
    pub datt: Vec<R>,
    pub dgate: Vec<R>,
    pub dup: Vec<R>,
    pub dact: Vec<R>,
}

impl<R: Real> GradScratch<R> {
    fn new(c: &LlamaConfig, batch: usize, seq: usize) -> Self {
        let n = batch * seq;
        let z = |len: usize| vec![R::zero(); len];
        GradScratch {
            dres: z(n * c.hidden_size),
            dxn: z(n * c.hidden_size),
            dtmp: z(n * c.hidden_size),
            dq: z(n * c.q_dim()),
            dk: z(n * c.kv_dim()),
            dv: z(n * c.kv_dim()),
            datt: z(n * c.q_dim()),
            dgate: z(n * c.intermediate_size),
            dup: z(n * c.intermediate_size),
            dact: z(n * c.intermediate_size),
        }
    }

    fn len(&self) -> usize {
        [
            &self.dres,
            &self.dxn,
            &self.dtmp,
            &self.dq,
            &self.dk,
            &self.dv,
            &self.datt,
            &self.dgate,
            &self.dup,
            &self.dact,
        ]
        .iter()
        .map(|b| b.len())
        .sum()
    }
}

/// The activation arena of a [`LlamaForCausalLM`](super::LlamaForCausalLM) for batches of up
/// to `batch` sequences of `seq` tokens. `R` is `f32` in training (`f64` in the
/// finite-difference tests).
#[derive(Clone, Debug)]
pub struct Activations<R: Real = f32> {
    pub(crate) batch: usize,
    pub(crate) seq: usize,
    pub(crate) checkpointing: bool,
    /// Whether the rope table of a shorter sequence is a prefix of this one (false only for
    /// dynamic NTK scaling beyond `original_max_position_embeddings`).
    pub(crate) rope_prefix_ok: bool,
    pub(crate) rope: RopeTable,
    /// ALiBi slopes `[q_heads]` (Baichuan-13B), `None` for RoPE models.
    pub(crate) alibi: Option<Vec<f32>>,
    pub(crate) layout: ModelLayout,
    /// Block inputs: `resid[i]` is the input of layer `i`, `resid[L]` the final norm's input;
    /// `L + 1` slabs of `[N, C]`.
    pub(crate) resid: Vec<R>,
    /// One per layer, or a single reused one with gradient checkpointing.
    pub(crate) layers: Vec<LayerActs<R>>,
    pub(crate) final_rstd: Vec<R>,
    /// The final LayerNorm's means (Bloom), `[N]`.
    pub(crate) final_mean: Vec<R>,
    /// Bloom's `word_embeddings_layernorm` statistics (mean, rstd), `[N]` each; its input,
    /// the raw embedding, is recomputed in the backward.
    pub(crate) embed_mean: Vec<R>,
    pub(crate) embed_rstd: Vec<R>,
    pub(crate) final_xn: Vec<R>,
    /// Logits `[N, V]`; after `forward_backward`, the gradient of the loss w.r.t. them.
    pub(crate) logits: Vec<R>,
    /// Shifted targets `[N]` (-100 = ignored).
    pub(crate) targets: Vec<i32>,
    /// Position ids of packed rows for the calls of their `(batch, seq)` (see
    /// [`Activations::set_position_ids`]).
    pub(crate) position_ids: Option<(Vec<i32>, usize, usize)>,
    pub(crate) grad: GradScratch<R>,
    /// NormHead (Baichuan2): the row-normalised lm_head `[V, C]` the logits are computed with,
    /// and its gradient before the normalisation's backward (empty without NormHead).
    pub(crate) head_normed: Vec<R>,
    pub(crate) dhead_normed: Vec<R>,
}

impl<R: Real> Activations<R> {
    /// Allocates every buffer for batches of up to `batch` sequences of `seq` tokens and
    /// builds the rotary table for `seq` positions.
    pub fn new(
        config: &LlamaConfig,
        batch: usize,
        seq: usize,
        gradient_checkpointing: bool,
    ) -> Activations<R> {
        let n = batch * seq;
        let c = config.hidden_size;
        let n_layer_acts = if gradient_checkpointing {
            1
        } else {
            config.num_hidden_layers
        };
        let rope_prefix_ok = match config.rope_scaling {
            RopeScalingConfig::Dynamic {
                original_max_position_embeddings,
                ..
            } => seq <= original_max_position_embeddings,
            _ => true,
        };
        let head_len = if config.norm_head() {
            config.vocab_size * c
        } else {
            0
        };
        Activations {
            batch,
            seq,
            checkpointing: gradient_checkpointing,
            rope_prefix_ok,
            rope: RopeTable::new(
                config.head_dim,
                config.rope_theta,
                &config.rope_scaling.to_ops(),
                seq,
                config.max_position_embeddings,
            ),
            alibi: (config.family.position_encoding() == PositionEncoding::Alibi)
                .then(|| tilearn_ops::alibi_slopes(config.num_attention_heads)),
            layout: ModelLayout::from_config(config),
            resid: vec![R::zero(); (config.num_hidden_layers + 1) * n * c],
            layers: (0..n_layer_acts)
                .map(|_| LayerActs::new(config, batch, seq))
                .collect(),
            final_rstd: vec![R::zero(); n],
            final_mean: vec![R::zero(); n],
            embed_mean: vec![R::zero(); n],
            embed_rstd: vec![R::zero(); n],
            final_xn: vec![R::zero(); n * c],
            logits: vec![R::zero(); n * config.vocab_size],
            targets: vec![0; n],
            position_ids: None,
            grad: GradScratch::new(config, batch, seq),
            head_normed: vec![R::zero(); head_len],
            dhead_normed: vec![R::zero(); head_len],
        }
    }

    /// Sets the position ids (`[batch, seq]`) of the packed rows of the following calls of
    /// shape `batch x seq` (`None`: one sequence a row, positions `0..seq`). Positions restart
    /// at 0 where an example starts ([`tilearn_ops::check_positions`]); RoPE rotates by them and
    /// attention keeps every query inside its example, so each example computes as if it ran
    /// alone. A call of another shape is refused until they are set again.
    pub fn set_position_ids(
        &mut self,
        positions: Option<&[i32]>,
        batch: usize,
        seq: usize,
    ) -> crate::error::Result<()> {
        let Some(pos) = positions else {
            self.position_ids = None;
            return Ok(());
        };
        tilearn_ops::check_positions(pos, batch, seq)?;
        self.position_ids = Some((pos.to_vec(), batch, seq));
        Ok(())
    }

    /// Largest batch this arena holds.
    pub fn batch(&self) -> usize {
        self.batch
    }

    /// Sequence length this arena (and its rotary table) was built for.
    pub fn seq(&self) -> usize {
        self.seq
    }

    /// Whether blocks are recomputed in the backward.
    pub fn gradient_checkpointing(&self) -> bool {
        self.checkpointing
    }

    /// Bytes held by the arena.
    pub fn bytes(&self) -> usize {
        let elems = self.resid.len()
            + self.layers.iter().map(LayerActs::len).sum::<usize>()
            + self.final_rstd.len()
            + self.final_mean.len()
            + self.embed_mean.len()
            + self.embed_rstd.len()
            + self.final_xn.len()
            + self.logits.len()
            + self.grad.len()
            + self.head_normed.len()
            + self.dhead_normed.len();
        elems * std::mem::size_of::<R>() + self.targets.len() * 4
    }
}
