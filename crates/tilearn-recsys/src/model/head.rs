//! Everything of a CTR model after the embedding lookup, generic over [`Real`] (f32 to train,
//! f64 for the finite-difference tests): from the pooled embeddings and dense features to the
//! logit, the mean BCE-with-logits loss, and the gradients of both the dense parameters and the
//! pooled embeddings (which the fused embedding backward consumes).
//!
//! Pooled row layout (the table order of [`CtrConfig::table_layout`]): `F * k` field
//! embeddings, then `F` first-order weights, then one weight per cross.
//!
//! `logit = bias + sum(first-order) + sum(crosses) + dense . w_dense + mlp(emb, dense)`
//! `        + [DeepFM] 0.5 * sum_j ((sum_f v_fj)^2 - sum_f v_fj^2)`

use tilearn_ops::cpu::{Real, linear_backward, linear_forward};

use super::config::{CtrConfig, DenseLayout, ModelKind};
use crate::error::Result;

/// Mean BCE-with-logits of `logits` against `labels` (0 or 1), in f64, as
/// `torch.nn.BCEWithLogitsLoss`: `max(z, 0) - z y + ln(1 + exp(-|z|))`.
pub fn bce_with_logits<R: Real>(logits: &[R], labels: &[f32]) -> f64 {
    let sum: f64 = logits
        .iter()
        .zip(labels)
        .map(|(&z, &y)| {
            let z = z.to_f64();
            z.max(0.0) - z * y as f64 + (-z.abs()).exp().ln_1p()
        })
        .sum();
    sum / logits.len().max(1) as f64
}

/// Activations a backward needs: the MLP input and every layer's output (pre-ReLU).
#[derive(Debug)]
pub struct HeadCache<R> {
    batch: usize,
    /// `inputs[l]` is layer l's input (`inputs[0]` the concatenated embeddings and dense).
    inputs: Vec<Vec<R>>,
    /// Layer outputs before the ReLU.
    outputs: Vec<Vec<R>>,
}

/// Logits of a batch (`emb` `[batch, width]`, `dense` `[batch, num_dense]`), and the cache of
/// its backward.
pub fn head_forward<R: Real>(
    cfg: &CtrConfig,
    layout: &DenseLayout,
    params: &[R],
    emb: &[R],
    dense: &[R],
    batch: usize,
) -> Result<(Vec<R>, HeadCache<R>)> {
    let (fields, k, nd) = (cfg.num_fields(), cfg.embed_dim, cfg.num_dense);
    let width = emb.len() / batch.max(1);
    let deep = fields * k;
    let mut x0 = Vec::with_capacity(batch * cfg.mlp_input());
    for b in 0..batch {
        x0.extend_from_slice(&emb[b * width..b * width + deep]);
        x0.extend_from_slice(&dense[b * nd..(b + 1) * nd]);
    }
    let mut inputs = vec![x0];
    let mut outputs = Vec::with_capacity(layout.layers.len());
    for (l, layer) in layout.layers.iter().enumerate() {
        let mut z = vec![R::zero(); batch * layer.fan_out];
        linear_forward(
            &inputs[l],
            &params[layer.weight.clone()],
            Some(&params[layer.bias.clone()]),
            batch,
            layer.fan_in,
            layer.fan_out,
            &mut z,
        )?;
        if l + 1 < layout.layers.len() {
            inputs.push(z.iter().map(|&v| v.max(R::zero())).collect());
        }
        outputs.push(z);
    }
    let mlp = outputs.last().expect("the output layer exists");
    let w_dense = &params[layout.dense_weights.clone()];
    let mut logits = Vec::with_capacity(batch);
    for b in 0..batch {
        let row = &emb[b * width..(b + 1) * width];
        let mut z = params[layout.bias] + mlp[b];
        for &w in &row[deep..] {
            z += w;
        }
        for (&x, &w) in dense[b * nd..(b + 1) * nd].iter().zip(w_dense) {
            z += x * w;
        }
        if cfg.model == ModelKind::DeepFm {
            let mut fm = R::zero();
            for j in 0..k {
                let (mut sum, mut sum_sq) = (R::zero(), R::zero());
                for f in 0..fields {
                    let v = row[f * k + j];
                    sum += v;
                    sum_sq += v * v;
                }
                fm += sum * sum - sum_sq;
            }
            z += R::from_f64(0.5) * fm;
        }
        logits.push(z);
    }
    Ok((
        logits,
        HeadCache {
            batch,
            inputs,
            outputs,
        },
    ))
}

/// Backward of [`head_forward`] for `dlogits` (d loss / d logit per sample): accumulates the
/// dense parameters' gradient into `dparams` (`+=`) and writes the pooled embeddings' gradient
/// `demb` (`=`).
#[allow(clippy::too_many_arguments)]
pub fn head_backward<R: Real>(
    cfg: &CtrConfig,
    layout: &DenseLayout,
    params: &[R],
    emb: &[R],
    dense: &[R],
    cache: &HeadCache<R>,
    dlogits: &[R],
    dparams: &mut [R],
    demb: &mut [R],
) -> Result<()> {
    let batch = cache.batch;
    let (fields, k, nd) = (cfg.num_fields(), cfg.embed_dim, cfg.num_dense);
    let width = emb.len() / batch.max(1);
    let deep = fields * k;
    for (b, &g) in dlogits.iter().enumerate() {
        dparams[layout.bias] += g;
        for (i, &x) in dense[b * nd..(b + 1) * nd].iter().enumerate() {
            dparams[layout.dense_weights.start + i] += g * x;
        }
        let row = &emb[b * width..(b + 1) * width];
        let drow = &mut demb[b * width..(b + 1) * width];
        drow[deep..].fill(g);
        if cfg.model == ModelKind::DeepFm {
            for j in 0..k {
                let mut sum = R::zero();
                for f in 0..fields {
                    sum += row[f * k + j];
                }
                for f in 0..fields {
                    drow[f * k + j] = g * (sum - row[f * k + j]);
                }
            }
        } else {
            drow[..deep].fill(R::zero());
        }
    }
    // The MLP, from the output layer down; `dz` is d loss / d (layer output before ReLU).
    let mut dz: Vec<R> = dlogits.to_vec();
    for (l, layer) in layout.layers.iter().enumerate().rev() {
        let mut dx = vec![R::zero(); batch * layer.fan_in];
        let (dw, db) = split_two(dparams, layer.weight.clone(), layer.bias.clone());
        linear_backward(
            &dz,
            &cache.inputs[l],
            &params[layer.weight.clone()],
            batch,
            layer.fan_in,
            layer.fan_out,
            Some(&mut dx),
            dw,
            Some(db),
        )?;
        if l > 0 {
            // Through the ReLU that made this layer's input.
            for (d, &z) in dx.iter_mut().zip(&cache.outputs[l - 1]) {
                if z <= R::zero() {
                    *d = R::zero();
                }
            }
        } else {
            let mlp_in = cfg.mlp_input();
            for b in 0..batch {
                for (d, &x) in demb[b * width..b * width + deep]
                    .iter_mut()
                    .zip(&dx[b * mlp_in..b * mlp_in + deep])
                {
                    *d += x;
                }
            }
        }
        dz = dx;
    }
    Ok(())
}

/// Two disjoint ranges of one buffer, mutably (`a` before `b`).
fn split_two<R>(
    buf: &mut [R],
    a: std::ops::Range<usize>,
    b: std::ops::Range<usize>,
) -> (&mut [R], &mut [R]) {
    debug_assert!(a.end <= b.start);
    let (left, right) = buf.split_at_mut(b.start);
    (&mut left[a], &mut right[..b.end - b.start])
}
