//! The optimizers that run inside the embedding backward: each touched row is updated in place
//! from its de-duplicated gradient row, and only touched rows' state changes (lazy state).
//!
//! * SGD: `torch.optim.SGD` with sparse gradients, `w = w + (-lr) * g`.
//! * Row-wise Adagrad: FBGEMM's `EXACT_ROWWISE_ADAGRAD`, one accumulator per row:
//!   `G = G + sum(g^2) / dim`, `w = w + (-(lr / (sqrt(G) + eps))) * g`.
//! * Adam: `torch.optim.SparseAdam`: moments of touched rows only, bias corrections from the
//!   global step count (every call is a step), `eps` added to `sqrt(v)` (not `sqrt(v_hat)`).
//!
//! The per-element arithmetic is f32, one rounding per operation in the order written here and
//! mirrored by `embedding_bag.cu`; the step scalars are computed in f64 on the host and rounded
//! once, as torch computes them in Python floats.

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::error::{RecsysError, Result};
use crate::tables::TableLayout;
use crate::tensor_file::{F32TensorFile, write_f32_tensors};

/// The `format` of a sparse optimizer state file.
pub const SPARSE_STATE_FORMAT: &str = "tilearn-recsys-sparse-optimizer";
const SPARSE_STATE_VERSION: u32 = 1;
/// The metadata key of a sparse optimizer state file ([`SparseStateHeader`] as JSON).
const SPARSE_STATE_KEY: &str = "sparse_optimizer_state";

/// What a sparse optimizer state file says about its tensors.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct SparseStateHeader {
    format: String,
    format_version: u32,
    /// Steps taken.
    step: u64,
    config: SparseOptimizer,
}

/// Which rule updates the touched rows, with its hyper-parameters.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum SparseOptimizer {
    Sgd {
        lr: f32,
    },
    RowWiseAdagrad {
        lr: f32,
        eps: f32,
        initial_accumulator: f32,
    },
    Adam {
        lr: f32,
        beta1: f32,
        beta2: f32,
        eps: f32,
    },
}

impl SparseOptimizer {
    /// Row-wise Adagrad with FBGEMM's defaults (`eps = 1e-8`, accumulator starting at 0).
    pub fn row_wise_adagrad(lr: f32) -> Self {
        SparseOptimizer::RowWiseAdagrad {
            lr,
            eps: 1e-8,
            initial_accumulator: 0.0,
        }
    }

    /// SparseAdam with torch's defaults (betas 0.9 / 0.999, eps 1e-8).
    pub fn adam(lr: f32) -> Self {
        SparseOptimizer::Adam {
            lr,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
        }
    }

    /// Checks the hyper-parameters (finite lr >= 0, eps > 0, betas in [0, 1)).
    pub fn validate(&self) -> Result<()> {
        let bad = |message: String| Err(RecsysError::invalid("sparse optimizer", message));
        let lr = match *self {
            SparseOptimizer::Sgd { lr } => lr,
            SparseOptimizer::RowWiseAdagrad {
                lr,
                eps,
                initial_accumulator,
            } => {
                let valid = eps > 0.0 && eps.is_finite() && initial_accumulator >= 0.0;
                if !valid {
                    return bad(format!(
                        "row-wise Adagrad needs eps > 0 and initial_accumulator >= 0 (got {eps}, {initial_accumulator})"
                    ));
                }
                lr
            }
            SparseOptimizer::Adam {
                lr,
                beta1,
                beta2,
                eps,
            } => {
                let valid = (0.0..1.0).contains(&beta1)
                    && (0.0..1.0).contains(&beta2)
                    && eps > 0.0
                    && eps.is_finite();
                if !valid {
                    return bad(format!(
                        "Adam needs betas in [0, 1) and eps > 0 (got {beta1}, {beta2}, {eps})"
                    ));
                }
                lr
            }
        };
        if lr.is_finite() && lr >= 0.0 {
            Ok(())
        } else {
            bad(format!("lr must be finite and >= 0, got {lr}"))
        }
    }

    /// The same optimizer with learning rate `lr` (checked).
    pub fn with_lr(self, lr: f32) -> Result<Self> {
        let mut optimizer = self;
        match &mut optimizer {
            SparseOptimizer::Sgd { lr: l }
            | SparseOptimizer::RowWiseAdagrad { lr: l, .. }
            | SparseOptimizer::Adam { lr: l, .. } => *l = lr,
        }
        optimizer.validate()?;
        Ok(optimizer)
    }

    /// Which state buffers the rule keeps: (state1, state2).
    pub fn state_buffers(&self) -> (bool, bool) {
        match self {
            SparseOptimizer::Sgd { .. } => (false, false),
            SparseOptimizer::RowWiseAdagrad { .. } => (true, false),
            SparseOptimizer::Adam { .. } => (true, true),
        }
    }

    /// The learning rate.
    pub fn lr(&self) -> f32 {
        match *self {
            SparseOptimizer::Sgd { lr }
            | SparseOptimizer::RowWiseAdagrad { lr, .. }
            | SparseOptimizer::Adam { lr, .. } => lr,
        }
    }
}

/// The optimizer's state for every row of a set of tables, allocated once at its full size but
/// changed only at touched rows.
#[derive(Debug, Clone, PartialEq)]
pub struct SparseState {
    optimizer: SparseOptimizer,
    /// Steps taken (Adam's bias corrections use it).
    step: u64,
    /// Row-wise Adagrad: one accumulator per stacked row. Adam: the first moment, one per
    /// weight element. SGD: empty. (Private, so the buffers always match the optimizer.)
    state1: Vec<f32>,
    /// Adam: the second moment, one per weight element. Otherwise empty.
    state2: Vec<f32>,
}

impl SparseState {
    /// Fresh state for the tables of `layout`.
    pub fn new(optimizer: SparseOptimizer, layout: &TableLayout) -> Result<Self> {
        optimizer.validate()?;
        let (state1, state2) = match optimizer {
            SparseOptimizer::Sgd { .. } => (Vec::new(), Vec::new()),
            SparseOptimizer::RowWiseAdagrad {
                initial_accumulator,
                ..
            } => (vec![initial_accumulator; layout.total_rows()], Vec::new()),
            SparseOptimizer::Adam { .. } => (
                vec![0.0; layout.total_elements()],
                vec![0.0; layout.total_elements()],
            ),
        };
        Ok(SparseState {
            optimizer,
            step: 0,
            state1,
            state2,
        })
    }

    pub fn optimizer(&self) -> &SparseOptimizer {
        &self.optimizer
    }

    /// Changes the learning rate (a schedule), keeping every other hyper-parameter.
    pub fn set_lr(&mut self, lr: f32) -> Result<()> {
        self.optimizer = self.optimizer.with_lr(lr)?;
        Ok(())
    }

    /// Fails unless this state was sized for `layout`.
    pub fn check_layout(&self, layout: &TableLayout) -> Result<()> {
        let (uses1, uses2) = self.optimizer.state_buffers();
        let want1 = match self.optimizer {
            SparseOptimizer::RowWiseAdagrad { .. } => layout.total_rows(),
            _ => layout.total_elements(),
        };
        let fits = (!uses1 || self.state1.len() == want1)
            && (!uses2 || self.state2.len() == layout.total_elements());
        if fits {
            Ok(())
        } else {
            Err(RecsysError::invalid(
                "sparse optimizer state",
                "it was made for other tables; create it with SparseState::new for these",
            ))
        }
    }

    pub fn step(&self) -> u64 {
        self.step
    }

    /// The per-row accumulators (row-wise Adagrad) or first moments (Adam).
    pub fn state1(&self) -> &[f32] {
        &self.state1
    }

    /// The second moments (Adam).
    pub fn state2(&self) -> &[f32] {
        &self.state2
    }

    /// The rule's name in files and errors (`sgd`, `row_wise_adagrad`, `adam`).
    fn kind_name(optimizer: &SparseOptimizer) -> String {
        let json = serde_json::to_value(optimizer).expect("optimizer serialises");
        json["kind"].as_str().unwrap_or_default().to_string()
    }

    /// The names of the state tensors the rule keeps (`state1`, `state2` in that order).
    fn tensor_names(&self) -> &'static [&'static str] {
        match self.optimizer {
            SparseOptimizer::Sgd { .. } => &[],
            SparseOptimizer::RowWiseAdagrad { .. } => &["accumulator"],
            SparseOptimizer::Adam { .. } => &["exp_avg", "exp_avg_sq"],
        }
    }

    /// Writes the state to `path` atomically (safetensors; metadata `sparse_optimizer_state`:
    /// JSON `{format, format_version, step, config}`, format [`SPARSE_STATE_FORMAT`]; tensors
    /// `accumulator` (row-wise Adagrad, one per stacked row) or `exp_avg` / `exp_avg_sq` (Adam,
    /// one per weight element); SGD keeps none).
    pub fn save_state(&self, path: &Path) -> Result<()> {
        let header = SparseStateHeader {
            format: SPARSE_STATE_FORMAT.to_string(),
            format_version: SPARSE_STATE_VERSION,
            step: self.step,
            config: self.optimizer,
        };
        let metadata = (
            SPARSE_STATE_KEY,
            serde_json::to_string(&header).expect("header serialises"),
        );
        let buffers = [&self.state1[..], &self.state2[..]];
        let tensors: Vec<(&str, &[f32])> =
            self.tensor_names().iter().copied().zip(buffers).collect();
        write_f32_tensors(path, &tensors, metadata)
    }

    /// Reads a state written by [`SparseState::save_state`] for the same rule and tables: step
    /// count and buffers. The hyper-parameters of `self` are kept (as tilearn-optim's
    /// `load_state` does). Any problem is an error naming the file and leaves `self` unchanged.
    pub fn load_state(&mut self, path: &Path) -> Result<()> {
        let file = F32TensorFile::read(path)?;
        let json = file.metadata(SPARSE_STATE_KEY, "tilearn-recsys sparse optimizer state")?;
        let header: SparseStateHeader = serde_json::from_str(json)
            .map_err(|e| file.error(format!("metadata `{SPARSE_STATE_KEY}`: {e}")))?;
        let (format, version) = (&header.format, header.format_version);
        if format != SPARSE_STATE_FORMAT || version != SPARSE_STATE_VERSION {
            return Err(file.error(format!(
                "format `{format}` version {version}; expected `{SPARSE_STATE_FORMAT}` version {SPARSE_STATE_VERSION}"
            )));
        }
        let (step, saved) = (header.step, header.config);
        let (saved_kind, kind) = (Self::kind_name(&saved), Self::kind_name(&self.optimizer));
        if saved_kind != kind {
            return Err(file.error(format!(
                "the state is of the sparse optimizer `{saved_kind}`, this run uses `{kind}`; resume with the same --sparse-optimizer"
            )));
        }
        let lens = [self.state1.len(), self.state2.len()];
        let mut loaded = Vec::with_capacity(2);
        for (name, len) in self.tensor_names().iter().zip(lens) {
            loaded.push(file.tensor(name, len)?);
        }
        let mut loaded = loaded.into_iter();
        self.state1 = loaded.next().unwrap_or_default();
        self.state2 = loaded.next().unwrap_or_default();
        self.step = step;
        Ok(())
    }

    /// Replaces the buffers and the step count with those a device copy kept (e.g.
    /// `cuda::DeviceEmbeddingBag::download`), so that [`SparseState::save_state`] writes them.
    /// Lengths must equal the current ones (empty for a buffer the rule does not keep).
    pub fn set_state(&mut self, state1: Vec<f32>, state2: Vec<f32>, step: u64) -> Result<()> {
        let lens = [
            ("state1", self.state1.len(), state1.len()),
            ("state2", self.state2.len(), state2.len()),
        ];
        for (what, want, got) in lens {
            if want != got {
                return Err(RecsysError::invalid(
                    "sparse optimizer state",
                    format!("{what} has {got} values, this state keeps {want}"),
                ));
            }
        }
        self.state1 = state1;
        self.state2 = state2;
        self.step = step;
        Ok(())
    }

    /// Sets the step count (a cache of rows steps its own state and hands the count back).
    pub(crate) fn set_step(&mut self, step: u64) {
        self.step = step;
    }

    /// Both state buffers, mutable (empty where the rule keeps none): for whole-row copies
    /// (the row cache), which keep the lengths.
    pub(crate) fn buffers_mut(&mut self) -> (&mut [f32], &mut [f32]) {
        (&mut self.state1, &mut self.state2)
    }

    /// The state of stacked row `row` whose weights are `elements` of the flat buffer.
    pub fn row_mut(&mut self, row: usize, elements: std::ops::Range<usize>) -> RowStateMut<'_> {
        match self.optimizer {
            SparseOptimizer::Sgd { .. } => RowStateMut::None,
            SparseOptimizer::RowWiseAdagrad { .. } => {
                RowStateMut::Accumulator(&mut self.state1[row])
            }
            SparseOptimizer::Adam { .. } => RowStateMut::Moments(
                &mut self.state1[elements.clone()],
                &mut self.state2[elements],
            ),
        }
    }

    /// Counts a step and returns its per-row rule.
    pub fn begin_step(&mut self) -> RowRule {
        self.step += 1;
        RowRule::new(&self.optimizer, self.step)
    }
}

/// One step's rule with its scalars, as the CPU reference and the CUDA launcher take it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum RowRule {
    Sgd {
        neg_lr: f32,
    },
    RowWiseAdagrad {
        lr: f32,
        eps: f32,
    },
    Adam {
        one_minus_beta1: f32,
        one_minus_beta2: f32,
        /// `-(lr * sqrt(1 - beta2^t) / (1 - beta1^t))`, torch SparseAdam's step size.
        neg_step_size: f32,
        eps: f32,
    },
}

impl RowRule {
    /// The rule of step `step` (1-based).
    pub fn new(optimizer: &SparseOptimizer, step: u64) -> Self {
        // The decimal value torch sees for an f32 hyper-parameter written in a config.
        let dec = tilearn_optim::decimal_f64;
        match *optimizer {
            SparseOptimizer::Sgd { lr } => RowRule::Sgd { neg_lr: -lr },
            SparseOptimizer::RowWiseAdagrad { lr, eps, .. } => RowRule::RowWiseAdagrad { lr, eps },
            SparseOptimizer::Adam {
                lr,
                beta1,
                beta2,
                eps,
            } => {
                let t = step as f64;
                let (b1, b2) = (dec(beta1), dec(beta2));
                let step_size = dec(lr) * (1.0 - b2.powf(t)).sqrt() / (1.0 - b1.powf(t));
                RowRule::Adam {
                    one_minus_beta1: (1.0 - b1) as f32,
                    one_minus_beta2: (1.0 - b2) as f32,
                    neg_step_size: (-step_size) as f32,
                    eps,
                }
            }
        }
    }

    /// Applies the rule to one row: `w` and `g` (the row's summed gradient) have the row's dim;
    /// `row_state` is the row's accumulator (Adagrad), `m` / `v` its moments (Adam).
    pub fn apply(&self, w: &mut [f32], g: &[f32], row_state: RowStateMut<'_>) {
        match (*self, row_state) {
            (RowRule::Sgd { neg_lr }, RowStateMut::None) => {
                for (w, &g) in w.iter_mut().zip(g) {
                    *w += neg_lr * g;
                }
            }
            (RowRule::RowWiseAdagrad { lr, eps }, RowStateMut::Accumulator(acc)) => {
                let mut sum_sq = 0.0f32;
                for &g in g {
                    sum_sq += g * g;
                }
                *acc += sum_sq / g.len() as f32;
                let neg_multiplier = -(lr / (acc.sqrt() + eps));
                for (w, &g) in w.iter_mut().zip(g) {
                    *w += neg_multiplier * g;
                }
            }
            (
                RowRule::Adam {
                    one_minus_beta1,
                    one_minus_beta2,
                    neg_step_size,
                    eps,
                },
                RowStateMut::Moments(m, v),
            ) => {
                for (((w, &g), m), v) in w.iter_mut().zip(g).zip(m).zip(v) {
                    let m_update = (g - *m) * one_minus_beta1;
                    let v_update = (g * g - *v) * one_minus_beta2;
                    let numer = m_update + *m;
                    let v_new = v_update + *v;
                    *m = numer;
                    *v = v_new;
                    *w += neg_step_size * (numer / (v_new.sqrt() + eps));
                }
            }
            (rule, _) => unreachable!("row state does not match the rule {rule:?}"),
        }
    }
}

/// The state of one row, borrowed mutably from a [`SparseState`].
#[derive(Debug)]
pub enum RowStateMut<'a> {
    None,
    Accumulator(&'a mut f32),
    Moments(&'a mut [f32], &'a mut [f32]),
}
