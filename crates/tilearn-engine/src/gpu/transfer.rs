//! Host transfers of a [`GpuLlama`]'s state: parameters, gradients and optimizer moments down
//! to the host (saving a checkpoint, tests) and back up (resuming, stepping on gradients
//! computed elsewhere). Every download synchronises the stream.

use cudarc::driver::CudaSlice;

use super::{GpuLlama, cuda_err, invalid};
use crate::error::Result;
use crate::params::ParamStore;

impl GpuLlama {
    /// Downloads the fp32 master weights into a [`ParamStore`] (Hugging Face names and order),
    /// e.g. to save a checkpoint. Synchronises.
    pub fn download_params(&self) -> Result<ParamStore> {
        let data = self.download_f32(self.whole_params()?, "downloading the parameters")?;
        Ok(ParamStore {
            specs: self.specs.clone(),
            data,
        })
    }

    /// Downloads the accumulated gradients (flat, the parameters' layout; under ZeRO-2 the
    /// owned shard's only, see [`GpuLlama::owned_gradients`]). Synchronises.
    pub fn download_grads(&self) -> Result<Vec<f32>> {
        self.download_f32(&self.grads, "downloading the gradients")
    }

    /// Replaces the device parameters with `params` (same layout), refreshing the 16-bit
    /// working copy; the optimizer state is kept.
    pub fn upload_params(&mut self, params: &ParamStore) -> Result<()> {
        let numel = self.layout.numel;
        if self.is_lean() {
            if params.specs != self.specs {
                return Err(invalid(
                    "params",
                    "has another layout than the device model".into(),
                ));
            }
            return self.upload_offloaded(&params.data);
        }
        if let Some(shard) = &self.master_shard {
            return Err(invalid(
                "upload_params",
                format!(
                    "the master weights are sharded (ZeRO, elements {shard:?} here); load a \
                     checkpoint with fill_params instead"
                ),
            ));
        }
        if params.data.len() != numel || params.specs != self.specs {
            return Err(invalid(
                "params",
                format!(
                    "has {} entries / another layout; the device model has {numel}",
                    params.data.len()
                ),
            ));
        }
        let stream = self.device.stream().clone();
        stream
            .memcpy_htod(&params.data, &mut self.master.slice_mut(..numel))
            .map_err(|e| cuda_err("uploading the parameters", e))?;
        if let Some(w) = self.work.as_mut() {
            w.invalidate();
            w.refresh(&stream, &self.master, self.precision)?;
        }
        Ok(())
    }

    /// Replaces the accumulated gradients with `grads` (flat, the parameters' layout), e.g. to
    /// step on gradients computed elsewhere.
    pub fn upload_grads(&mut self, grads: &[f32]) -> Result<()> {
        let numel = self.layout.numel;
        if let Some(owned) = self.owned_gradients() {
            return Err(invalid(
                "upload_grads",
                format!("under ZeRO-2 this rank holds only the gradients {owned:?}"),
            ));
        }
        if grads.len() != numel {
            return Err(invalid(
                "grads",
                format!(
                    "has {} entries but the model has {numel} parameters",
                    grads.len()
                ),
            ));
        }
        let stream = self.device.stream().clone();
        stream
            .memcpy_htod(grads, &mut self.grads.slice_mut(..numel))
            .map_err(|e| cuda_err("uploading the gradients", e))
    }

    /// Downloads the optimizer moments `(exp_avg, exp_avg_sq)`. Synchronises.
    pub fn download_optimizer_moments(&self) -> Result<(Vec<f32>, Vec<f32>)> {
        match &self.optimizer {
            Some(opt) => opt.download_moments(self.stream()),
            None => Err(invalid(
                "GpuLlama::download_optimizer_moments",
                "no optimizer: call configure_optimizer first".into(),
            )),
        }
    }

    /// Replaces the optimizer's moments and step count, e.g. from a checkpoint's
    /// `optimizer.safetensors` read by the CPU AdamW.
    pub fn upload_optimizer_state(
        &mut self,
        exp_avg: &[f32],
        exp_avg_sq: &[f32],
        step: u64,
    ) -> Result<()> {
        let stream = self.device.stream().clone();
        match &mut self.optimizer {
            Some(opt) => opt.upload_moments(&stream, exp_avg, exp_avg_sq, step),
            None => Err(invalid(
                "GpuLlama::upload_optimizer_state",
                "no optimizer: call configure_optimizer first".into(),
            )),
        }
    }

    fn download_f32(&self, buf: &CudaSlice<f32>, what: &str) -> Result<Vec<f32>> {
        let stream = self.stream();
        let host = stream
            .clone_dtoh(&buf.slice(..self.layout.numel))
            .map_err(|e| cuda_err(what, e))?;
        stream.synchronize().map_err(|e| cuda_err(what, e))?;
        Ok(host)
    }
}
