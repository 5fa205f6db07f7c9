//! The MLP's matrix products in bf16 (`tilearn ctr train --precision bf16`): cuBLASLt with bf16
//! inputs and f32 accumulation, fp32 master weights.
//!
//! The dense parameters stay f32 and are stepped by the f32 AdamW; after each step one cast
//! refreshes their bf16 shadow, which the GEMMs read. Per layer, forward: the input in bf16
//! (x0 cast once; a hidden layer's output cast after its ReLU), `z = x·Wᵀ + b` in bf16, cast to
//! f32 for the ReLU and the head (which stay f32). Backward: `dz` cast to bf16, then
//! `linear_backward` in bf16 whose weight and bias gradients accumulate in f32 (so the master
//! weights see f32 gradients of bf16 products), `dx` cast back to f32 for the ReLU's backward
//! and the embeddings' gradient. Everything outside the MLP (embeddings, FM, loss, optimizer)
//! is the f32 path unchanged.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, CudaView, CudaViewMut, DevicePtrMut};
use half::bf16;
use tilearn_ops::cuda::{
    Gemm, cast_bf16_to_f32, cast_f32_to_bf16, linear_backward, linear_forward,
};

use crate::error::{RecsysError, Result};
use crate::model::{DenseLayout, LinearLayer};

fn driver(context: &'static str) -> impl Fn(cudarc::driver::DriverError) -> RecsysError {
    move |e| {
        RecsysError::Ops(tilearn_ops::OpsError::Cuda {
            context,
            message: e.to_string(),
        })
    }
}

/// Which element type the MLP's GEMMs read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum MlpPrecision {
    /// f32 throughout (no TF32): the CPU model's arithmetic up to the order of sums.
    #[default]
    F32,
    /// bf16 GEMM inputs, f32 accumulation and master weights.
    Bf16,
}

/// The bf16 shadow of the dense parameters and the MLP's bf16 activations for up to
/// `capacity` samples.
#[derive(Debug)]
pub struct Bf16Mlp {
    capacity: usize,
    params: CudaSlice<bf16>,
    x0: CudaSlice<bf16>,
    /// Each layer's output, before the ReLU.
    z: Vec<CudaSlice<bf16>>,
    /// Each hidden layer's output after the ReLU: the next layer's input.
    a: Vec<CudaSlice<bf16>>,
    dz: CudaSlice<bf16>,
    dx: CudaSlice<bf16>,
}

impl Bf16Mlp {
    /// Buffers for `layout`'s MLP and batches of `capacity` samples; the shadow is filled from
    /// `params` (the f32 master weights).
    pub fn new(
        stream: &Arc<CudaStream>,
        layout: &DenseLayout,
        params: &CudaSlice<f32>,
        capacity: usize,
    ) -> Result<Self> {
        let err = driver("Bf16Mlp::new");
        let alloc = |n: usize| stream.alloc_zeros::<bf16>(n.max(1)).map_err(&err);
        let widest_in = layout.layers.iter().map(|l| l.fan_in).max().unwrap_or(1);
        let widest_out = layout.layers.iter().map(|l| l.fan_out).max().unwrap_or(1);
        let hidden = &layout.layers[..layout.layers.len() - 1];
        let mut mlp = Bf16Mlp {
            capacity,
            params: alloc(layout.numel)?,
            x0: alloc(capacity * layout.layers[0].fan_in)?,
            z: (layout.layers.iter())
                .map(|l| alloc(capacity * l.fan_out))
                .collect::<Result<_>>()?,
            a: (hidden.iter())
                .map(|l| alloc(capacity * l.fan_out))
                .collect::<Result<_>>()?,
            dz: alloc(capacity * widest_out)?,
            dx: alloc(capacity * widest_in)?,
        };
        mlp.refresh(stream, params)?;
        Ok(mlp)
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Casts the f32 master weights into the bf16 shadow (after every optimizer step).
    pub fn refresh(&mut self, stream: &Arc<CudaStream>, params: &CudaSlice<f32>) -> Result<()> {
        let n = params.len();
        cast_f32_to_bf16(stream, params, &mut self.params.slice_mut(..n))?;
        Ok(())
    }

    /// Layer `l`'s forward for `n` samples: its input is `x0` (f32, layer 0, cast here) or the
    /// previous hidden output kept in bf16; `z` (f32, `[n, fan_out]`) receives `x·Wᵀ + b`.
    /// For a hidden layer, `relu` (f32) is then cast into the next layer's input by
    /// [`keep_hidden`](Self::keep_hidden).
    pub fn forward_layer(
        &mut self,
        gemm: &Gemm,
        l: usize,
        layer: &LinearLayer,
        x0: Option<&CudaView<'_, f32>>,
        n: usize,
        z: &mut CudaViewMut<'_, f32>,
    ) -> Result<()> {
        let stream = gemm.stream().clone();
        let (in_len, out_len) = (n * layer.fan_in, n * layer.fan_out);
        if let Some(x0) = x0 {
            cast_f32_to_bf16(&stream, x0, &mut self.x0.slice_mut(..in_len))?;
        }
        let input = if l == 0 {
            self.x0.slice(..in_len)
        } else {
            self.a[l - 1].slice(..in_len)
        };
        linear_forward(
            gemm,
            &input,
            &self.params.slice(layer.weight.clone()),
            Some(&self.params.slice(layer.bias.clone()) as &dyn cudarc::driver::DevicePtr<bf16>),
            n,
            layer.fan_in,
            layer.fan_out,
            &mut self.z[l].slice_mut(..out_len),
        )?;
        cast_bf16_to_f32(&stream, &self.z[l].slice(..out_len), z)?;
        Ok(())
    }

    /// Keeps hidden layer `l`'s ReLU output (f32, `len` values) in bf16 as the next input.
    pub fn keep_hidden(
        &mut self,
        stream: &Arc<CudaStream>,
        l: usize,
        relu: &CudaView<'_, f32>,
        len: usize,
    ) -> Result<()> {
        cast_f32_to_bf16(stream, relu, &mut self.a[l].slice_mut(..len))?;
        Ok(())
    }

    /// Layer `l`'s backward for `n` samples: `dz` (f32, `[n, fan_out]`) in, the weight and
    /// bias gradients accumulated (+=, f32) into `dw` / `db`, `dx` (f32, `[n, fan_in]`)
    /// written.
    #[allow(clippy::too_many_arguments)]
    pub fn backward_layer(
        &mut self,
        gemm: &Gemm,
        l: usize,
        layer: &LinearLayer,
        n: usize,
        dz: &CudaView<'_, f32>,
        dw: &mut impl DevicePtrMut<f32>,
        db: &mut dyn DevicePtrMut<f32>,
        dx: &mut CudaViewMut<'_, f32>,
    ) -> Result<()> {
        let stream = gemm.stream().clone();
        let (in_len, out_len) = (n * layer.fan_in, n * layer.fan_out);
        cast_f32_to_bf16(&stream, dz, &mut self.dz.slice_mut(..out_len))?;
        let input = if l == 0 {
            self.x0.slice(..in_len)
        } else {
            self.a[l - 1].slice(..in_len)
        };
        let mut dx_h = self.dx.slice_mut(..in_len);
        linear_backward(
            gemm,
            &self.dz.slice(..out_len),
            &input,
            &self.params.slice(layer.weight.clone()),
            n,
            layer.fan_in,
            layer.fan_out,
            Some(&mut dx_h as &mut dyn DevicePtrMut<bf16>),
            dw,
            Some(db),
        )?;
        cast_bf16_to_f32(&stream, &self.dx.slice(..in_len), dx)?;
        Ok(())
    }
}
