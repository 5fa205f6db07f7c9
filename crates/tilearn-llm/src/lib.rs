//! tilearn-llm: the umbrella crate. Re-exports the workspace crates and hosts the `tilearn` CLI.
//!
//! ```no_run
//! use tilearn_llm::engine::model::LlamaForCausalLM;
//! let model = LlamaForCausalLM::from_pretrained(std::path::Path::new("my-llama")).unwrap();
//! println!("{} parameters", model.params.numel());
//! ```

pub mod cli;
pub mod error;
pub mod loss_plot;
pub mod presets;

pub use error::{LlmError, Result};
pub use tilearn_engine as engine;
pub use tilearn_ops as ops;
pub use tilearn_optim as optim;

/// The embedded default model: a small Llama (4 layers, hidden 128, GQA 4/2 heads, tied
/// embeddings) over the 257-token byte-level vocabulary of the embedded corpus.
pub const DEFAULT_CONFIG_JSON: &str = include_str!("default_config.json");
