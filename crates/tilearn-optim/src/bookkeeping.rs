//! What every optimizer keeps besides its state buffers: the config, the validated parameter
//! groups over one flat buffer, and the step counter — with the checks a step runs first and
//! the state-file save/load around them.

use std::path::Path;

use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::common::{check_len, check_lr, decimal_f64};
use crate::error::Result;
use crate::group::{ParamGroup, Segment, validate_groups};
use crate::state_file::{self, LoadedState, StateOut};

/// Config, groups, their sorted segments, buffer length and completed steps of an optimizer.
#[derive(Debug, Clone)]
pub(crate) struct Bookkeeping<C> {
    pub config: C,
    pub groups: Vec<ParamGroup>,
    /// The non-empty ranges of all groups sorted by start (see [`validate_groups`]).
    pub segments: Vec<Segment>,
    pub numel: usize,
    pub step: u64,
}

impl<C> Bookkeeping<C> {
    /// Validates `groups` against a buffer of `numel` elements (the config is validated by the
    /// optimizer, which knows its type); the step count starts at 0.
    pub fn new(config: C, groups: Vec<ParamGroup>, numel: usize) -> Result<Self> {
        let segments = validate_groups(&groups, numel)?;
        Ok(Bookkeeping {
            config,
            groups,
            segments,
            numel,
            step: 0,
        })
    }

    /// The checks of a step, before anything is modified: both buffers hold `numel` elements
    /// (`what` names them in the error, e.g. `["Sgd::step params", "Sgd::step grads"]`) and
    /// `lr` is finite and >= 0.
    pub fn check_step(
        &self,
        what: [&'static str; 2],
        params: &[f32],
        grads: &[f32],
        lr: f32,
    ) -> Result<()> {
        check_len(what[0], self.numel, params.len())?;
        check_len(what[1], self.numel, grads.len())?;
        check_lr(lr)
    }

    /// Writes the state file (see [`state_file`]) with `tensors`, each `numel` elements.
    pub fn save_state(
        &self,
        path: &Path,
        format: &'static str,
        tensors: Vec<(&'static str, &[f32])>,
    ) -> Result<()>
    where
        C: Serialize,
    {
        state_file::save(
            path,
            StateOut {
                format,
                step: self.step,
                numel: self.numel,
                config: &self.config,
                groups: &self.groups,
                tensors,
            },
        )
    }

    /// Reads a state file of `format` for `numel` parameters; `want_for` gets the file's config
    /// and names the tensors to read (or says why the file does not fit this optimizer).
    pub fn load_state(
        &self,
        path: &Path,
        format: &'static str,
        want_for: impl FnOnce(&C) -> std::result::Result<Vec<&'static str>, String>,
    ) -> Result<LoadedState>
    where
        C: DeserializeOwned,
    {
        state_file::load(path, format, self.numel, want_for)
    }
}

/// The learning rate of group `g` in a step at `lr`: both widened to the f64 Python floats
/// torch computes with ([`decimal_f64`]), then `lr * lr_scale`.
pub(crate) fn group_lr(g: &ParamGroup, lr: f32) -> f64 {
    decimal_f64(lr) * decimal_f64(g.lr_scale)
}

/// The inherent accessors every optimizer has, reading its `base: Bookkeeping<$config>` field
/// (expanded inside each optimizer's `impl` block, so callers need no trait in scope).
macro_rules! bookkeeping_accessors {
    ($config:ty) => {
        /// The hyper-parameters the optimizer was built with.
        pub fn config(&self) -> &$config {
            &self.base.config
        }

        /// The parameter groups (ranges, weight decay, lr scale).
        pub fn groups(&self) -> &[$crate::group::ParamGroup] {
            &self.base.groups
        }

        /// The non-empty ranges of all groups sorted by start (what a multi-tensor kernel
        /// walks).
        pub fn segments(&self) -> &[$crate::group::Segment] {
            &self.base.segments
        }

        /// Length of the parameter, gradient and state buffers.
        pub fn numel(&self) -> usize {
            self.base.numel
        }

        /// Number of completed steps (torch's `state["step"]`).
        pub fn step_count(&self) -> u64 {
            self.base.step
        }
    };
}

pub(crate) use bookkeeping_accessors;
