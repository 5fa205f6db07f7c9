//! adaptfp16: the GradScaler and adaptive mixed-precision policies. No CUDA dependency of its
//! own: the device half of unscaling is the [`UnscaleTarget`] trait, which `tilearn-ops`
//! implements for CUDA buffers; [`CpuGrads`] is the CPU implementation.
//!
//! * [`GradScaler`]: `torch.amp.GradScaler` semantics bit for bit (checked against PyTorch's own
//!   trajectory by `tests/torch_trajectory.rs`), torch's defaults and `state_dict` keys.
//! * [`AmpPolicy`]: the typed form of Tilearn-Angel's
//!   `MixedPrecision_TrainingPolicy(policy, start_time, hold_time, end_time, interval_time,
//!   interval_hold_time)` with `enable_mixed_precision(epoch, lr, loss, scaler) -> bool`
//!   ([`AmpPolicy::enable_mixed_precision`]; [`AmpPolicy::decide`] returns the precision, a
//!   [`DType`]).
//!   Built by [`PolicyBuilder`]; policies 0, 1, 2 and our `auto`.
//! * [`DType`] (re-exported from `tilearn-ops`, the workspace's one precision type): what a
//!   period computes in — `F32`, `BF16` or `F16`, named `fp32`, `bf16`, `fp16` in flags, logs
//!   and saved policy state. Master weights and optimizer state stay fp32 in every case.
//! * [`AmpPlan`]: a fixed precision or a policy, what the trainer holds; [`cli::plan_from_args`]
//!   builds one from `tilearn train`'s flags.
//!
//! # Example: a training loop on CPU
//!
//! ```
//! use adaptfp16::cli::{AmpArgs, plan_from_args};
//! use adaptfp16::{CpuGrads, DType, Signals};
//!
//! // `tilearn train --amp-policy 0 --amp-start 2 --amp-end 5`
//! let args = AmpArgs { policy: Some("0".parse()?), start: Some(2), end: Some(5), ..Default::default() };
//! let mut plan = plan_from_args(&args)?;
//! let mut scaler = plan.new_scaler();
//! let mut timeline = Vec::new();
//! for step in 0..8u64 {
//!     let precision = plan.decide(step, Signals { lr: Some(1e-3), loss: None }, Some(&mut scaler))?;
//!     timeline.push(precision);
//!     let mut grads = vec![0.25f32; 4]; // the backward of loss * seed
//!     if precision == DType::F16 {
//!         let _seed = scaler.scale(1.0); // multiplies the loss gradient
//!         grads.iter_mut().for_each(|g| *g *= scaler.get_scale());
//!         let mut target = CpuGrads::flat(&mut grads);
//!         scaler.unscale(&mut target)?;
//!         let skip = scaler.should_skip_step(&mut target)?;
//!         // if !skip { optimizer.step(&grads) }
//!         let outcome = scaler.update(&mut target)?;
//!         assert_eq!(outcome.skipped(), skip);
//!         assert_eq!(grads, vec![0.25f32; 4]);
//!     }
//! }
//! use DType::{F16, F32};
//! assert_eq!(timeline, [F32, F32, F16, F16, F16, F16, F32, F32]);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! # Periods
//!
//! A policy is asked once per *period*, before the period runs, with the period's 0-based index
//! `t`: the global step (`unit = step`, the default, since LLM runs have few epochs) or the epoch
//! (`unit = epoch`, the seed's use). All parameters below count periods of that unit. Periods
//! must be asked in non-decreasing order; gaps are allowed; asking twice for one `t` returns the
//! first answer and changes nothing. "Mixed" below means the configured mixed precision (fp16 by
//! default, or bf16); "off" means fp32.
//!
//! # Decision rules
//!
//! | policy | parameters (default)                                                   | required   |
//! |--------|------------------------------------------------------------------------|------------|
//! | 0      | start (10), end                                                        | end        |
//! | 1      | start, end, hold, lr_tolerance (0.1)                                   | start, end, hold |
//! | 2      | start (10), end (none), interval (1000), interval_hold (100), loss_rise_tolerance (0.02) | – |
//! | auto   | hold (200), fallback (bf16), overflow_window (100), max_overflows (10), scale_floor (1.0), resume_scale (65536) | – |
//!
//! A parameter the policy does not use is rejected ([`Error::ParameterNotUsed`]), as are a
//! missing required one, `end < start`, zero lengths, and `interval_hold > interval`.
//!
//! **Policy 0 (time).** Mixed iff `start <= t <= end` (`end` inclusive: the seed recommends the
//! last epoch as `end_time`, and that epoch should run mixed too). Stateless. Rationale of the
//! seed: the first periods, when gradients and the loss change fastest, run fp32.
//!
//! **Policy 1 (time + learning rate).** Policy 0's window minus fp32 *holds* after learning-rate
//! changes, because a change of the learning rate is when the loss fluctuates abnormally (the
//! seed's use case) and fp32 is the safe precision for it. `lr` is required at every decision.
//! A *change* happens at `t` when the previous decision's learning rate `p` exists and
//! `|lr(t) - p| > lr_tolerance * |p|` (a jump between consecutive decisions: step decays, warm
//! restarts, the end of warm-up; a smooth cosine or linear schedule moves far less than 10% per
//! step and does not trigger, except in the last steps of a schedule decaying to 0). Changes are
//! detected at every decision, also outside the window. With `c` the latest change:
//! mixed iff `start <= t <= end` and not (`c <= t < c + hold`). A change during a hold restarts
//! the hold from the new change (the new fluctuation gets its full `hold`). The decision is
//! uniform over a hold, as the seed asks: it is fp32 throughout.
//!
//! **Policy 2 (loss).** Gated by `[start, end]` like policy 0 (fp32 outside; `end` may be
//! absent = no end). Inside the gate, *windows* `W_k = [k*interval, k*interval + interval_hold)`
//! for `k >= 1` (1000–1099, 2000–2099, … with the defaults; the end is exclusive, so a window
//! is exactly `interval_hold` periods). `loss` is the loss of the previous period (the seed's
//! argument), may be absent. The standing decision starts **on** (mixed before the first
//! window: the point of mixed precision is speed, and fp32 is only bought back when the loss
//! says so). At each period inside `W_k`:
//! 1. a non-finite loss → off;
//! 2. else, if `W_k` has no reference loss yet (its first period, or no loss given so far in it):
//!    → on, and a given loss becomes the reference `r` (each window switches mixed precision
//!    on and gives it a fresh chance: the seed's "policy 2 is switched on every interval_time");
//! 3. else an absent loss keeps the decision; a loss `l` → on iff `l - r <= loss_rise_tolerance * |r|`
//!    (the loss did not rise above where the window opened, beyond the tolerance).
//!
//! Outside the windows the decision made last (in the latest window) stands. Why: a window is a
//! probe; the loss trend in it says whether mixed precision is hurting (loss going up or
//! non-finite), and between probes nothing new is known. A loss falling *fast* is not treated as
//! a fault: fp16/bf16 numerical trouble shows as a rising or non-finite loss, and a fast fall is
//! what training is for. With `unit = step` the per-step loss is noisy; raise
//! `loss_rise_tolerance` (builder) above the step-to-step noise.
//!
//! **auto (ours).** Fp16 with the GradScaler (`mixed` must be fp16), falling back to `fallback`
//! (bf16 or fp32) for `hold` periods when fp16 is failing, then back to fp16. The scaler is
//! required at every decision. At `t`, let `n(t)` be the overflows (skipped steps) the scaler
//! counted since the previous decision, plus 1 if `loss` is non-finite.
//! * In fallback until `u`: `t < u` → fallback. At `t >= u` → fp16 again, the overflow history
//!   is cleared, and if the scale is below `scale_floor` the scaler restarts at `resume_scale`
//!   with a zero growth tracker ([`GradScaler::restart_at`]), since a collapsed scale would
//!   trigger a new fallback at once.
//! * In fp16: record `n(t)`; if the scale is `< scale_floor` (collapse: the known failure where
//!   the scale falls to 1 and below, small gradients underflow in fp16 and training stops
//!   learning) or the `n` recorded at decisions in `(t - overflow_window, t]` sum to
//!   `>= max_overflows` (recurring overflows), → fallback with `u = t + hold` (so periods
//!   `t .. t + hold - 1` run in the fallback) and the history is cleared; otherwise fp16.
//!
//! With decisions every step, "the last `overflow_window` decisions" are the overflows of the
//! last `overflow_window` steps. A normal fp16 run overflows about once per growth interval
//! (2000 steps) and a fresh start a handful of times in its first steps, far from 10 in 100.
//!
//! # GradScaler on a device
//!
//! See [`UnscaleTarget`]: the fused unscale pass keeps its found-inf flag on the device, where
//! the optimizer kernel reads it (and, with [`GradScaler::check_for_fused_step`], the
//! `inv_scale` too); the host reads the flag once per step, in [`GradScaler::update`].

pub mod cli;
pub mod error;
pub mod names;
pub mod plan;
pub mod policy;
pub mod scaler;

pub use error::{BackendError, Error, Result};
pub use names::{Param, ParseNameError, PolicyId, TimeUnit};
pub use plan::AmpPlan;
pub use policy::{AmpPolicy, PolicyBuilder, Rule, Signals};
pub use scaler::{
    CpuGrads, GradScaler, ScalerConfig, ScalerState, StepOutcome, UnscaleTarget,
    unscale_and_check_slice,
};
pub use tilearn_ops::DType;
