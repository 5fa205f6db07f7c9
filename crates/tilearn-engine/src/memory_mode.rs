//! `--memory default|lean`: how the GPU engine spends device memory, and the host half of the
//! lean mode's optimizer step. No device code here, so the setting parses, the combinations
//! are checked and the host step is tested on any machine; the device side is `gpu::offload`.
//!
//! **Default** keeps 18 bytes per parameter on the device (fp32 master 4, bf16 working copy 2,
//! fp32 gradients 4, AdamW moments 8) and every layer's `silu(gate) * up` for the backward;
//! under gradient checkpointing about 16 (the working copy kept per layer, see
//! [`crate::weight_copy`]) and the activation recomputed.
//!
//! **Lean** keeps 6 (the bf16 working copy and the fp32 gradients), as ZeRO-Offload does with
//! one process: the fp32 master weights and the AdamW moments live in host memory and are
//! stepped there by `tilearn-optim`'s multi-threaded CPU AdamW ([`HostAdamW::step`]: the
//! gradients come down once per step, the clipped AdamW runs on the host, the new weights go
//! up as bf16). The step is the default mode's step: the CPU AdamW is the reference the fused
//! kernel reproduces (same f32 operations in the same order), the clip coefficient is the same
//! f32 rounding of `max_norm / (norm + 1e-6)`, and the bf16 copy is the same round-to-nearest
//! cast. The MLP's activation `silu(gate) * up` (`[tokens, intermediate]` per layer) is not kept:
//! the backward recomputes it from `gate` and `up` with the same deterministic kernel, one
//! elementwise launch per layer (the values are bit-identical; Liger-Kernel's SwiGLU does the
//! same).

use std::fmt;

use serde::{Deserialize, Serialize};
use tilearn_ops::DType;
use tilearn_optim::{AdamW, AdamWConfig, ParamGroup};

use crate::error::{EngineError, Result};

/// Device bytes per parameter of the model state in each mode (weights, gradients and
/// optimizer state; activations come on top).
pub const DEFAULT_STATE_BYTES_PER_PARAM: usize = 4 + 2 + 4 + 8;
/// See [`DEFAULT_STATE_BYTES_PER_PARAM`]: bf16 working copy + fp32 gradients.
pub const LEAN_STATE_BYTES_PER_PARAM: usize = 2 + 4;

/// `--memory`: where the GPU engine keeps the optimizer's state.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum MemoryMode {
    /// Everything on the device (fastest).
    #[default]
    Default,
    /// fp32 master weights and AdamW moments in host memory, stepped on the CPU; the MLP
    /// activation recomputed in the backward (see the module docs).
    Lean,
}

impl fmt::Display for MemoryMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            MemoryMode::Default => "default",
            MemoryMode::Lean => "lean",
        })
    }
}

impl MemoryMode {
    /// Parses the flag's text (`default`, `lean`; case-insensitive).
    pub fn parse(text: &str) -> std::result::Result<MemoryMode, String> {
        match text.trim().to_ascii_lowercase().as_str() {
            "default" => Ok(MemoryMode::Default),
            "lean" => Ok(MemoryMode::Lean),
            _ => Err(format!(
                "`{text}` is not a memory mode; use `default` (all state on the GPU) or `lean` \
                 (fp32 master weights and AdamW moments in host memory, stepped on the CPU)"
            )),
        }
    }

    pub fn is_lean(self) -> bool {
        self == MemoryMode::Lean
    }

    /// Refuses what the lean mode does not combine with: it runs bf16 alone (no fp32 or fp16
    /// periods: the device holds no fp32 weights to compute with, and fp16's GradScaler would
    /// need the host step to skip on overflow) in one process (data, tensor or pipeline
    /// parallelism and ZeRO partition state the host optimizer holds whole).
    pub fn check(self, precisions: &[DType], processes: usize) -> Result<()> {
        if !self.is_lean() {
            return Ok(());
        }
        if precisions != [DType::BF16] {
            let names: Vec<String> = precisions.iter().map(|p| p.to_string()).collect();
            return Err(usage(format!(
                "lean runs bf16 only, and this run may use {}; pass --bf16 without an AMP \
                 policy, or --memory default",
                names.join(", ")
            )));
        }
        if processes > 1 {
            return Err(usage(format!(
                "lean keeps the whole optimizer in one process's host memory and this job has \
                 {processes} processes (data/tensor/pipeline parallel or ZeRO); run one \
                 process, or --memory default (ZeRO partitions the state across GPUs instead)"
            )));
        }
        Ok(())
    }
}

fn usage(message: String) -> EngineError {
    EngineError::InvalidArgument {
        argument: "--memory lean".into(),
        message,
    }
}

/// The host half of the lean step: fp32 master weights and the CPU AdamW (its moments), with
/// the clipping limit. The caller brings the gradients down and takes the bf16 copy up.
#[derive(Debug)]
pub struct HostAdamW {
    master: Vec<f32>,
    adamw: AdamW,
    max_grad_norm: f64,
    last_grad_norm: Option<f64>,
}

impl HostAdamW {
    /// AdamW over `master` (the whole model, flat) with `groups`, clipping to `max_grad_norm`
    /// (0 disables).
    pub fn new(
        master: Vec<f32>,
        config: AdamWConfig,
        groups: Vec<ParamGroup>,
        max_grad_norm: f64,
    ) -> Result<HostAdamW> {
        let adamw = AdamW::new(config, groups, master.len())?;
        Ok(HostAdamW {
            master,
            adamw,
            max_grad_norm,
            last_grad_norm: None,
        })
    }

    /// The fp32 master weights.
    pub fn master(&self) -> &[f32] {
        &self.master
    }

    /// The master weights, giving the optimizer up (a reconfiguration keeps them).
    pub fn into_master(self) -> Vec<f32> {
        self.master
    }

    /// Replaces the master weights (a load); the moments are kept.
    pub fn master_mut(&mut self) -> &mut [f32] {
        &mut self.master
    }

    /// The optimizer (moments, step count, state files).
    pub fn adamw(&self) -> &AdamW {
        &self.adamw
    }

    pub fn adamw_mut(&mut self) -> &mut AdamW {
        &mut self.adamw
    }

    /// The global gradient norm (before clipping) of the last step.
    pub fn last_grad_norm(&self) -> Option<f64> {
        self.last_grad_norm
    }

    /// Bytes of host memory held (master weights and moments).
    pub fn bytes(&self) -> usize {
        (self.master.len() + self.adamw.exp_avg().len() + self.adamw.exp_avg_sq().len()) * 4
    }

    /// One step at `lr` with `grads` clipped as `clip_grad_norm_` clips them, then the new
    /// weights as bf16 bits into `bf16_out` (round to nearest even, as the fused kernel's
    /// copy). Returns the norm before clipping. One pass for the norm and one over the state
    /// (`AdamW::step_fused` applies the clip coefficient and writes the copy as it steps;
    /// `grads` are left unscaled): the same bits as clipping, stepping and casting in turn.
    pub fn step(&mut self, grads: &[f32], lr: f32, bf16_out: &mut [u16]) -> Result<f64> {
        if bf16_out.len() != self.master.len() {
            return Err(EngineError::InvalidArgument {
                argument: "bf16_out".into(),
                message: format!(
                    "has {} elements; the model has {}",
                    bf16_out.len(),
                    self.master.len()
                ),
            });
        }
        let norm = tilearn_optim::global_grad_norm(grads);
        let coefficient = if self.max_grad_norm > 0.0 {
            tilearn_optim::clip::clip_coefficient(norm, self.max_grad_norm)
        } else {
            None
        };
        let scale = coefficient.map_or(1.0, |c| c as f32);
        self.adamw
            .step_fused(&mut self.master, grads, lr, scale, Some(bf16_out))?;
        self.last_grad_norm = Some(norm);
        Ok(norm)
    }
}

#[cfg(test)]
mod tests {
    use half::bf16;

    use super::*;
    use rand::{Rng, SeedableRng};

    fn random(n: usize, seed: u64, scale: f32) -> Vec<f32> {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        (0..n).map(|_| rng.random_range(-scale..scale)).collect()
    }

    #[allow(clippy::single_range_in_vec_init)] // each group holds one range, on purpose
    fn groups(n: usize) -> Vec<ParamGroup> {
        vec![
            ParamGroup {
                name: "decay".into(),
                ranges: vec![0..n / 2],
                weight_decay: 0.1,
                lr_scale: 1.0,
            },
            ParamGroup {
                name: "no_decay".into(),
                ranges: vec![n / 2..n],
                weight_decay: 0.0,
                lr_scale: 1.0,
            },
        ]
    }

    #[test]
    fn parses_and_names_the_modes() {
        for m in [MemoryMode::Default, MemoryMode::Lean] {
            assert_eq!(MemoryMode::parse(&m.to_string()).unwrap(), m);
        }
        assert_eq!(MemoryMode::parse(" LEAN ").unwrap(), MemoryMode::Lean);
        let err = MemoryMode::parse("small").unwrap_err();
        assert!(err.contains("`default`") && err.contains("`lean`"), "{err}");
    }

    #[test]
    fn lean_refuses_other_precisions_and_several_processes() {
        let lean = MemoryMode::Lean;
        assert!(lean.check(&[DType::BF16], 1).is_ok());
        for p in [
            vec![DType::F32],
            vec![DType::F16],
            vec![DType::F32, DType::BF16],
        ] {
            let err = lean.check(&p, 1).unwrap_err().to_string();
            assert!(err.contains("bf16 only"), "{err}");
        }
        let err = lean.check(&[DType::BF16], 2).unwrap_err().to_string();
        assert!(err.contains("2 processes"), "{err}");
        // The default mode takes everything.
        assert!(MemoryMode::Default.check(&[DType::F16], 8).is_ok());
    }

    /// The host step is the default CPU path's step (clip_grad_norm_, then AdamW, then the
    /// bf16 cast) bit for bit, over several steps with active clipping, two groups and a
    /// changing learning rate; and a control: without clipping the weights differ.
    #[test]
    fn the_host_step_is_the_reference_step() {
        let n = 70_001; // not a multiple of the chunks
        let master = random(n, 1, 0.5);
        let config = AdamWConfig {
            lr: 1e-3,
            ..AdamWConfig::default()
        };
        let mut host = HostAdamW::new(master.clone(), config, groups(n), 1.0).unwrap();
        let mut reference = AdamW::new(config, groups(n), n).unwrap();
        let mut params = master.clone();
        let mut unclipped = HostAdamW::new(master, config, groups(n), 0.0).unwrap();
        let mut bits = vec![0u16; n];
        let mut bits_unclipped = vec![0u16; n];
        for step in 0..4u64 {
            // Gradients with a norm well above 1, so clipping is active.
            let g = random(n, 100 + step, 0.05);
            let lr = 1e-3 * (1.0 + step as f32);
            let norm = host.step(&g, lr, &mut bits).unwrap();
            let mut g_ref = g.clone();
            let ref_norm = tilearn_optim::clip_grad_norm(&mut g_ref, 1.0);
            reference.step(&mut params, &g_ref, lr).unwrap();
            assert!(norm > 1.0, "clipping must be active (norm {norm})");
            assert_eq!(norm.to_bits(), ref_norm.to_bits());
            assert_eq!(host.last_grad_norm(), Some(norm));
            assert!(
                host.master()
                    .iter()
                    .zip(&params)
                    .all(|(a, b)| a.to_bits() == b.to_bits())
            );
            assert!(
                bits.iter()
                    .zip(&params)
                    .all(|(&b, &p)| b == bf16::from_f32(p).to_bits())
            );
            unclipped.step(&g, lr, &mut bits_unclipped).unwrap();
        }
        assert_eq!(host.adamw().exp_avg(), reference.exp_avg());
        assert_eq!(host.adamw().exp_avg_sq(), reference.exp_avg_sq());
        assert!(
            unclipped
                .master()
                .iter()
                .zip(host.master())
                .any(|(a, b)| a != b)
        );
    }

    #[test]
    fn a_wrong_copy_length_is_an_error_before_any_update() {
        let mut host =
            HostAdamW::new(vec![1.0; 8], AdamWConfig::default(), groups(8), 1.0).unwrap();
        let err = host.step(&[0.5; 8], 1e-3, &mut [0u16; 7]).unwrap_err();
        assert!(err.to_string().contains("7 elements"), "{err}");
        assert_eq!(host.master(), &[1.0; 8]);
        assert_eq!(host.adamw().step_count(), 0);
    }
}
