//! A trained CTR model on disk: `model.safetensors` with the tables' flat weights
//! (`embedding_bags.weight`) and the dense parameters (`dense.weight`), and the config as JSON in
//! the metadata (`ctr_config`), written atomically through `tilearn_ops::fs`.

use std::path::Path;

use super::config::CtrConfig;
use crate::error::{RecsysError, Result};
use crate::tables::EmbeddingTables;
use crate::tensor_file::{F32TensorFile, write_f32_tensors};

pub const MODEL_FILE: &str = "model.safetensors";

/// The weights of a model: its config, tables and dense parameters.
#[derive(Debug, Clone, PartialEq)]
pub struct SavedModel {
    pub config: CtrConfig,
    pub tables: EmbeddingTables,
    pub dense: Vec<f32>,
}

/// Writes `dir/model.safetensors`.
pub fn save_model(
    dir: &Path,
    config: &CtrConfig,
    tables: &EmbeddingTables,
    dense: &[f32],
) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(|e| RecsysError::io(dir, e))?;
    let metadata = (
        "ctr_config",
        serde_json::to_string(config).expect("config serialises"),
    );
    write_f32_tensors(
        &dir.join(MODEL_FILE),
        &[
            ("embedding_bags.weight", &tables.weights),
            ("dense.weight", dense),
        ],
        metadata,
    )
}

/// Reads `dir/model.safetensors`, checking every size against the config.
pub fn load_model(dir: &Path) -> Result<SavedModel> {
    let file = F32TensorFile::read(&dir.join(MODEL_FILE))?;
    let json = file.metadata("ctr_config", "tilearn CTR model")?;
    let config: CtrConfig =
        serde_json::from_str(json).map_err(|e| file.error(format!("ctr_config: {e}")))?;
    config.validate()?;
    let layout = config.table_layout()?;
    let weights = file.tensor("embedding_bags.weight", layout.total_elements())?;
    let dense = file.tensor("dense.weight", config.dense_layout().numel)?;
    Ok(SavedModel {
        tables: EmbeddingTables::from_weights(layout, weights)?,
        dense,
        config,
    })
}
