//! A trained CTR model on disk: `model.safetensors` with the tables' flat weights
//! (`embedding_bags.weight`) and the dense parameters (`dense.weight`), and the config as JSON in
//! the metadata (`ctr_config`), written atomically through `tilearn_ops::fs`.

use std::collections::HashMap;
use std::path::Path;

use safetensors::tensor::{Dtype, TensorView};

use super::config::CtrConfig;
use crate::error::{RecsysError, Result};
use crate::tables::EmbeddingTables;

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
    let tensors = [
        ("embedding_bags.weight", bytemuck_f32(&tables.weights)),
        ("dense.weight", bytemuck_f32(dense)),
    ];
    let views: Vec<(&str, TensorView<'_>)> = tensors
        .iter()
        .map(|(name, bytes)| {
            let view =
                TensorView::new(Dtype::F32, vec![bytes.len() / 4], bytes).expect("f32 bytes");
            (*name, view)
        })
        .collect();
    let metadata = HashMap::from([(
        "ctr_config".to_string(),
        serde_json::to_string(config).expect("config serialises"),
    )]);
    let path = dir.join(MODEL_FILE);
    let bytes = safetensors::serialize(views, Some(metadata)).map_err(|e| RecsysError::Format {
        path: path.clone(),
        message: e.to_string(),
    })?;
    tilearn_ops::fs::write_bytes_atomic(&path, &bytes).map_err(|e| RecsysError::io(&path, e))
}

/// Reads `dir/model.safetensors`, checking every size against the config.
pub fn load_model(dir: &Path) -> Result<SavedModel> {
    let path = dir.join(MODEL_FILE);
    let bytes = std::fs::read(&path).map_err(|e| RecsysError::io(&path, e))?;
    let bad = |message: String| RecsysError::Format {
        path: path.clone(),
        message,
    };
    let (_, meta) =
        safetensors::SafeTensors::read_metadata(&bytes).map_err(|e| bad(e.to_string()))?;
    let config: CtrConfig = meta
        .metadata()
        .as_ref()
        .and_then(|m| m.get("ctr_config"))
        .ok_or_else(|| bad("no `ctr_config` metadata: not a tilearn CTR model".into()))
        .and_then(|json| serde_json::from_str(json).map_err(|e| bad(format!("ctr_config: {e}"))))?;
    config.validate()?;
    let file = safetensors::SafeTensors::deserialize(&bytes).map_err(|e| bad(e.to_string()))?;
    let read = |name: &str, len: usize| -> Result<Vec<f32>> {
        let t = file.tensor(name).map_err(|e| bad(format!("{name}: {e}")))?;
        if t.dtype() != Dtype::F32 || t.data().len() != 4 * len {
            return Err(bad(format!("{name} is not {len} f32 values")));
        }
        Ok(t.data()
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().expect("4")))
            .collect())
    };
    let layout = config.table_layout()?;
    let weights = read("embedding_bags.weight", layout.total_elements())?;
    let dense = read("dense.weight", config.dense_layout().numel)?;
    Ok(SavedModel {
        tables: EmbeddingTables::from_weights(layout, weights)?,
        dense,
        config,
    })
}

fn bytemuck_f32(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}
