//! Generation on the device with a key/value cache: the [`Decoder`] of the CUDA engine.
//!
//! [`GpuDecoder`] uploads a model's weights once (rounded to the decoder's precision: f32, bf16
//! or f16) and runs the same cached forward as the CPU's
//! [`CachedDecoder`](crate::model::generate::CachedDecoder): the prompt in one call (prefill),
//! then one token per call, each layer's keys and values appended to a cache in device memory
//! in the decoder's type. The layer math reuses the training kernels (`embedding_forward`,
//! `rmsnorm_forward` and the residual-fused `add_rmsnorm_forward`, cuBLASLt linears,
//! `swiglu_forward`), RoPE through `rope_forward_from` (the table read from the chunk's first
//! absolute position) and attention through `cached_attention.cu` (n queries against the
//! cache, GQA). The k and v projections are written straight into the cache rows of their
//! positions and rotated there. Only the last position goes through `lm_head`; its logits
//! (one row) are copied back and widened to f32 for the host's sampler: one synchronisation
//! per generated token.
//!
//! RoPE positions: one table of the positions `0..capacity` (grown with the cache), computed
//! by the same host code as the CPU decoder's. Dynamic NTK scaling past
//! `original_max_position_embeddings` changes the frequencies with the length, as in
//! transformers' cached generation, so there each chunk's rows are computed and uploaded on
//! their own.

mod buffers;

use half::{bf16, f16};
use tilearn_ops::DType;
use tilearn_ops::cpu::{CachedAttnShape, check_token_ids};
use tilearn_ops::cuda::{self as k, DeviceFloat, Gemm, GpuDevice, GpuRopeTable, TokenIdCheck};

use buffers::Buffers;

use crate::config::{LlamaConfig, RopeScalingConfig};
use crate::error::{EngineError, Result};
use crate::gpu::cuda_err;
use crate::model::generate::Decoder;
use crate::model::generate::family_parts::{
    alibi_slopes, apply_head_scale, check_sliding_window, norm_head_scale,
};
use crate::model::generate::rotary::rope_rows;
use crate::model::{LinearLayout, LlamaForCausalLM, ModelLayout};

/// The device buffers in the decoder's precision.
#[derive(Debug)]
enum Typed {
    F32(Buffers<f32>),
    Bf16(Buffers<bf16>),
    F16(Buffers<f16>),
}

/// A model on one GPU for generating one sequence at a time with a key/value cache in device
/// memory.
#[derive(Debug)]
pub struct GpuDecoder {
    device: GpuDevice,
    config: LlamaConfig,
    layout: ModelLayout,
    precision: DType,
    capacity: usize,
    len: usize,
    typed: Typed,
    gemm: Gemm,
    check: TokenIdCheck,
    /// Rotations of positions `0..rope.seq_len()`.
    rope: GpuRopeTable,
    /// Positions up to which the table's frequencies hold at every length (dynamic NTK:
    /// `original_max_position_embeddings`; otherwise unbounded).
    rope_fixed_until: usize,
    logits: Vec<f32>,
    /// NormHead's per-row logit scale (Baichuan2), `None` for the other families.
    head_scale: Option<Vec<f32>>,
    /// ALiBi slopes `[q_heads]` on the device (Baichuan-13B), `None` for RoPE models.
    alibi: Option<k::CudaSlice<f32>>,
}

/// The GPU decoder runs the RMSNorm / SwiGLU blocks only.
fn bloom_on_gpu_decoder() -> EngineError {
    invalid(
        "model",
        "Bloom (LayerNorm, GeLU MLP) is not served by the GPU decoder yet; generate on the CPU \
         (--device cpu)"
            .into(),
    )
}

fn invalid(argument: &str, message: String) -> EngineError {
    EngineError::InvalidArgument {
        argument: argument.to_string(),
        message,
    }
}

impl GpuDecoder {
    /// Uploads `model`'s weights to `device` in `precision` for sequences of up to `capacity`
    /// tokens (cache memory is taken as the sequence grows).
    pub fn new(
        device: &GpuDevice,
        model: &LlamaForCausalLM,
        precision: DType,
        capacity: usize,
    ) -> Result<GpuDecoder> {
        let config = model.config.clone();
        let layout = model.layout();
        if model.params.numel() != layout.numel {
            return Err(invalid(
                "params",
                format!(
                    "has {} entries but the config describes {}",
                    model.params.numel(),
                    layout.numel
                ),
            ));
        }
        if config.family.embedding_norm() {
            return Err(bloom_on_gpu_decoder());
        }
        if config.head_dim > k::CACHED_ATTENTION_MAX_HEAD_DIM {
            return Err(invalid(
                "head_dim",
                format!(
                    "{} exceeds the {} the GPU decoder's attention kernel serves; generate on \
                     the CPU (--device cpu)",
                    config.head_dim,
                    k::CACHED_ATTENTION_MAX_HEAD_DIM
                ),
            ));
        }
        let stream = device.stream().clone();
        device
            .ctx()
            .bind_to_thread()
            .map_err(|e| cuda_err("binding the device context", e))?;
        let p = &model.params.data;
        let typed = match precision {
            DType::F32 => Typed::F32(Buffers::new(&stream, &config, p)?),
            DType::BF16 => Typed::Bf16(Buffers::new(&stream, &config, p)?),
            DType::F16 => Typed::F16(Buffers::new(&stream, &config, p)?),
        };
        let rope_fixed_until = match config.rope_scaling {
            RopeScalingConfig::Dynamic {
                original_max_position_embeddings,
                ..
            } if original_max_position_embeddings > 0 => original_max_position_embeddings,
            RopeScalingConfig::Dynamic { .. } => config.max_position_embeddings,
            _ => usize::MAX,
        };
        let rope = GpuRopeTable::upload(&stream, &rope_rows(&config, 0, 1))?;
        let alibi = match alibi_slopes(&config) {
            Some(slopes) => Some(
                stream
                    .clone_htod(&slopes)
                    .map_err(|e| cuda_err("uploading the ALiBi slopes", e))?,
            ),
            None => None,
        };
        let decoder = GpuDecoder {
            alibi,
            gemm: Gemm::new(&stream)?,
            check: TokenIdCheck::new(&stream, config.vocab_size)?,
            logits: vec![0.0; config.vocab_size],
            head_scale: norm_head_scale(model),
            device: device.clone(),
            layout,
            precision,
            capacity,
            len: 0,
            typed,
            rope,
            rope_fixed_until,
            config,
        };
        decoder.device.synchronize()?;
        Ok(decoder)
    }

    /// The precision weights, activations and the cache are stored in.
    pub fn precision(&self) -> DType {
        self.precision
    }

    /// Device bytes of the key/value cache as allocated now.
    pub fn cache_bytes(&self) -> usize {
        match &self.typed {
            Typed::F32(b) => b.cache_bytes(),
            Typed::Bf16(b) => b.cache_bytes(),
            Typed::F16(b) => b.cache_bytes(),
        }
    }

    /// Appends `ids` (positions `position()..position() + ids.len()`) and returns the logits
    /// `[vocab]` (f32) of the last of them. Synchronises once, to read the logits.
    pub fn forward(&mut self, ids: &[u32]) -> Result<&[f32]> {
        let (n, start) = (ids.len(), self.len);
        if n == 0 {
            return Err(invalid(
                "ids",
                "is empty; pass at least one token id".into(),
            ));
        }
        if start + n > self.capacity {
            return Err(invalid(
                "ids",
                format!(
                    "{n} more tokens after {start} exceed the cache capacity of {} positions; \
                     build the decoder with a larger capacity",
                    self.capacity
                ),
            ));
        }
        check_token_ids(ids, self.config.vocab_size)?;
        check_sliding_window(&self.config, start + n)?;
        let rope = self.rope_for(start, n)?;
        let GpuDecoder {
            device,
            config,
            layout,
            typed,
            gemm,
            check,
            logits,
            capacity,
            rope: shared,
            alibi,
            ..
        } = self;
        let cx = Cx {
            stream: device.stream(),
            config,
            layout,
            gemm,
            rope: match &rope {
                ChunkRope::Shared => shared,
                ChunkRope::Own(table) => table,
            },
            rope_first: match rope {
                ChunkRope::Shared => start,
                ChunkRope::Own(_) => 0,
            },
            alibi: alibi.as_ref(),
        };
        match typed {
            Typed::F32(b) => forward_chunk(&cx, check, b, ids, start, *capacity, logits)?,
            Typed::Bf16(b) => forward_chunk(&cx, check, b, ids, start, *capacity, logits)?,
            Typed::F16(b) => forward_chunk(&cx, check, b, ids, start, *capacity, logits)?,
        }
        self.len += n;
        apply_head_scale(self.head_scale.as_deref(), &mut self.logits);
        Ok(&self.logits)
    }

    /// The rotations of positions `start..start + n`: the shared table (grown to cover them
    /// when needed), or, for dynamic NTK past its original length, the chunk's own rows.
    fn rope_for(&mut self, start: usize, n: usize) -> Result<ChunkRope> {
        let end = start + n;
        if end > self.rope_fixed_until {
            let rows = rope_rows(&self.config, start, n);
            return Ok(ChunkRope::Own(GpuRopeTable::upload(
                self.device.stream(),
                &rows,
            )?));
        }
        if end > self.rope.seq_len() {
            let rows = end
                .max(2 * self.rope.seq_len())
                .min(self.capacity)
                .min(self.rope_fixed_until);
            let table = rope_rows(&self.config, 0, rows);
            self.rope = GpuRopeTable::upload(self.device.stream(), &table)?;
        }
        Ok(ChunkRope::Shared)
    }
}

/// Where a chunk's rotations come from.
enum ChunkRope {
    Shared,
    Own(GpuRopeTable),
}

/// What every op of a chunk needs besides its buffers.
struct Cx<'a> {
    stream: &'a std::sync::Arc<k::CudaStream>,
    config: &'a LlamaConfig,
    layout: &'a ModelLayout,
    gemm: &'a Gemm,
    rope: &'a GpuRopeTable,
    /// Row of `rope` holding the chunk's first position.
    rope_first: usize,
    /// ALiBi slopes (Baichuan-13B): attention biases instead of rotations.
    alibi: Option<&'a k::CudaSlice<f32>>,
}

impl Decoder for GpuDecoder {
    fn forward(&mut self, ids: &[u32]) -> Result<&[f32]> {
        GpuDecoder::forward(self, ids)
    }
    fn position(&self) -> usize {
        self.len
    }
    fn capacity(&self) -> usize {
        self.capacity
    }
    fn reset(&mut self) {
        self.len = 0;
    }
}

#[allow(clippy::too_many_arguments)]
fn linear<T: DeviceFloat>(
    cx: &Cx<'_>,
    w: &k::CudaSlice<T>,
    l: &LinearLayout,
    x: &k::CudaView<'_, T>,
    rows: usize,
    in_f: usize,
    out_f: usize,
    out: &mut k::CudaViewMut<'_, T>,
) -> Result<()> {
    let bias = l.bias.as_ref().map(|b| w.slice(b.clone()));
    let bias = bias.as_ref().map(|b| b as &dyn k::DevicePtr<T>);
    k::linear_forward(
        cx.gemm,
        x,
        &w.slice(l.weight.clone()),
        bias,
        rows,
        in_f,
        out_f,
        out,
    )?;
    Ok(())
}

/// The cached forward of `ids` at positions `start..`, leaving the last position's logits in
/// `logits` (f32).
fn forward_chunk<T: DeviceFloat>(
    cx: &Cx<'_>,
    check: &mut TokenIdCheck,
    b: &mut Buffers<T>,
    ids: &[u32],
    start: usize,
    capacity: usize,
    logits: &mut [f32],
) -> Result<()> {
    let (s, cfg, layout) = (cx.stream, cx.config, cx.layout);
    let n = ids.len();
    let (c, q, kv, inter) = (
        cfg.hidden_size,
        cfg.q_dim(),
        cfg.kv_dim(),
        cfg.intermediate_size,
    );
    let (qh, kvh, d, eps) = (
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        cfg.head_dim,
        cfg.rms_norm_eps,
    );
    b.reserve(s, cfg, start + n, start, capacity, n)?;
    let Buffers {
        weights: w,
        cache,
        chunk: ch,
        logits: dev_logits,
        host_logits,
        ..
    } = b;
    s.memcpy_htod(ids, &mut ch.ids.slice_mut(..n))
        .map_err(|e| cuda_err("uploading the token ids", e))?;
    let mut x = ch.x.slice_mut(..n * c);
    let mut xn = ch.xn.slice_mut(..n * c);
    let mut rstd = ch.rstd.slice_mut(..n);
    k::embedding_forward(
        s,
        &ch.ids.slice(..n),
        &w.slice(layout.embed.clone()),
        c,
        &mut x,
        check,
    )?;
    let first_norm = layout
        .layers
        .first()
        .map_or(layout.norm.clone(), |l| l.input_norm.clone());
    k::rmsnorm_forward(s, &x, &w.slice(first_norm), c, eps, &mut xn, &mut rstd)?;
    let (mut qb, mut att, mut h) = (
        ch.q.slice_mut(..n * q),
        ch.att.slice_mut(..n * q),
        ch.h.slice_mut(..n * c),
    );
    let (mut gate, mut up, mut act) = (
        ch.gate.slice_mut(..n * inter),
        ch.up.slice_mut(..n * inter),
        ch.act.slice_mut(..n * inter),
    );
    let shape = CachedAttnShape {
        n,
        start,
        q_heads: qh,
        kv_heads: kvh,
        head_dim: d,
    };
    let rows = start * kv..(start + n) * kv;
    for (i, (lay, kvc)) in layout.layers.iter().zip(cache.iter_mut()).enumerate() {
        linear(cx, w, &lay.q, &xn.as_view(), n, c, q, &mut qb)?;
        let mut k_new = kvc.k.slice_mut(rows.clone());
        linear(cx, w, &lay.k, &xn.as_view(), n, c, kv, &mut k_new)?;
        if cx.alibi.is_none() {
            k::rope_forward_from(s, &mut qb, n, qh, d, cx.rope, cx.rope_first)?;
            k::rope_forward_from(s, &mut k_new, n, kvh, d, cx.rope, cx.rope_first)?;
        }
        let mut v_new = kvc.v.slice_mut(rows.clone());
        linear(cx, w, &lay.v, &xn.as_view(), n, c, kv, &mut v_new)?;
        let seen = ..(start + n) * kv;
        k::cached_attention_alibi_forward(
            s,
            shape,
            cx.alibi,
            &qb,
            &kvc.k.slice(seen),
            &kvc.v.slice(seen),
            &mut att,
        )?;
        linear(cx, w, &lay.o, &att.as_view(), n, q, c, &mut h)?;
        // h = o + x, and post_attention_layernorm(h), in one launch.
        k::add_rmsnorm_forward(
            s,
            &mut h,
            &x,
            &w.slice(lay.post_attention_norm.clone()),
            c,
            eps,
            &mut xn,
            &mut rstd,
        )?;
        let gate_layout = lay.gate.as_ref().ok_or_else(bloom_on_gpu_decoder)?;
        linear(cx, w, gate_layout, &xn.as_view(), n, c, inter, &mut gate)?;
        linear(cx, w, &lay.up, &xn.as_view(), n, c, inter, &mut up)?;
        k::swiglu_forward(s, &gate, &up, &mut act)?;
        linear(cx, w, &lay.down, &act.as_view(), n, inter, c, &mut x)?;
        // x = down + h, and the next layer's input norm (the final norm after the last).
        let next_norm = layout
            .layers
            .get(i + 1)
            .map_or(layout.norm.clone(), |l| l.input_norm.clone());
        k::add_rmsnorm_forward(
            s,
            &mut x,
            &h,
            &w.slice(next_norm),
            c,
            eps,
            &mut xn,
            &mut rstd,
        )?;
    }
    // Only the last position's logits pick the next token.
    let last = xn.slice((n - 1) * c..n * c);
    linear(
        cx,
        w,
        &LinearLayout {
            weight: layout.lm_head.clone(),
            bias: None,
        },
        &last,
        1,
        c,
        cfg.vocab_size,
        &mut dev_logits.slice_mut(..),
    )?;
    s.memcpy_dtoh(dev_logits, host_logits.as_mut_slice())
        .map_err(|e| cuda_err("downloading the logits", e))?;
    s.synchronize()
        .map_err(|e| cuda_err("downloading the logits", e))?;
    for (out, &v) in logits.iter_mut().zip(host_logits.iter()) {
        *out = v.to_f32();
    }
    Ok(())
}
