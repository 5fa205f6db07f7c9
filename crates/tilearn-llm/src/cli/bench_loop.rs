//! What both device loops of `tilearn bench` share: the seeded random batches they time, the
//! median they report, and the result they hand back to the command. A leaf: the command
//! (`bench.rs`) and the CUDA loop (`bench_gpu.rs`) both import it, neither imports the other's
//! helpers.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use tilearn_ops::DType;

/// What a device's bench loop measured.
pub struct BenchResult {
    pub device: String,
    /// What the timed steps computed in (`precision` in the JSON line).
    pub precision: DType,
    pub num_params: usize,
    pub step_seconds: f64,
    pub peak_memory_bytes: u64,
    pub last_loss: f64,
    /// Steps the GradScaler skipped (fp16 only), warm-up included.
    pub skipped_steps: u64,
    /// GPU only: how the steps ran under `--cuda-graphs` (warm-up included), and why they ran
    /// eagerly when graphs were asked for and not used.
    pub cuda_graphs: Option<GraphReport>,
    /// GPU only: whether the checkpoints lived in host memory (`--offload-checkpoints`
    /// resolved), and why `auto` decided as it did.
    pub offload_checkpoints: Option<(bool, Option<String>)>,
}

/// `cuda_graphs` in the JSON line.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct GraphReport {
    /// The setting (`on`, `off`, `auto`).
    pub mode: String,
    pub eager_steps: u64,
    pub captured_steps: u64,
    pub replayed_steps: u64,
    /// Why steps ran eagerly though graphs were asked for (none: they did not, or graphs are
    /// off).
    pub fallback: Option<String>,
}

impl GraphReport {
    /// The JSON object of the bench line.
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::json!({
            "mode": self.mode,
            "eager_steps": self.eager_steps,
            "captured_steps": self.captured_steps,
            "replayed_steps": self.replayed_steps,
            "fallback": self.fallback,
        })
    }
}

/// Random token batches (never constant), seeded so runs are comparable.
pub fn random_tokens(vocab: usize, n: usize, seed: u64) -> Vec<u32> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    (0..n).map(|_| rng.random_range(0..vocab as u32)).collect()
}

/// The median of the timed steps (the upper middle one for an even count).
pub fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    xs[xs.len() / 2]
}
