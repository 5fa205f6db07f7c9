//! Streamed checkpoint I/O: files written piece by piece from a [`TensorSource`] (as the GPU
//! engine's staging buffer hands them out) are valid safetensors files for the `safetensors`
//! crate, load back bit for bit in f32 and rounded to nearest even in bf16, sharded or not, and
//! loads into a piecewise [`TensorDest`] fill exactly what a whole-buffer load fills.

use std::ops::Range;
use std::path::Path;

use half::bf16;
use safetensors::{Dtype, SafeTensors};
use tilearn_engine::checkpoint::{
    INDEX_FILE, SINGLE_FILE, TensorDest, TensorSource, load_into, load_params, save_pretrained_from,
};
use tilearn_engine::config::LlamaConfig;
use tilearn_engine::params::ParamStore;
use tilearn_engine::{EngineError, Result};
use tilearn_ops::DType;

fn config() -> LlamaConfig {
    let json = r#"{"architectures":["LlamaForCausalLM"],"hidden_size":16,"intermediate_size":24,
        "num_hidden_layers":2,"num_attention_heads":4,"num_key_value_heads":2,
        "vocab_size":37,"tie_word_embeddings":false,"attention_bias":true}"#;
    LlamaConfig::from_json_str(json, "config.json").unwrap()
}

/// Hands out values in pieces of `piece` elements, as a staging buffer does.
struct Pieces<'a> {
    data: &'a [f32],
    piece: usize,
    calls: usize,
}

impl TensorSource for Pieces<'_> {
    fn read(
        &mut self,
        range: Range<usize>,
        sink: &mut dyn FnMut(&[f32]) -> Result<()>,
    ) -> Result<()> {
        for chunk in self.data[range].chunks(self.piece) {
            self.calls += 1;
            sink(chunk)?;
        }
        Ok(())
    }
}

/// Lends buffers of `piece` elements.
struct PieceDest<'a> {
    data: &'a mut [f32],
    piece: usize,
}

impl TensorDest for PieceDest<'_> {
    fn write(
        &mut self,
        range: Range<usize>,
        fill: &mut dyn FnMut(usize, &mut [f32]) -> Result<()>,
    ) -> Result<()> {
        for (k, chunk) in self.data[range].chunks_mut(self.piece).enumerate() {
            fill(k * self.piece, chunk)?;
        }
        Ok(())
    }
}

fn saved(dir: &Path, p: &ParamStore, dtype: DType, shard: Option<usize>) -> usize {
    let mut source = Pieces {
        data: &p.data,
        piece: 13,
        calls: 0,
    };
    save_pretrained_from(dir, &config(), &p.specs, &mut source, dtype, shard).unwrap();
    source.calls
}

#[test]
fn streamed_f32_is_bit_exact_and_readable_by_safetensors() {
    let dir = tempfile::tempdir().unwrap();
    let mut p = ParamStore::from_config(&config());
    p.init_random(4, 0.3);
    let calls = saved(dir.path(), &p, DType::F32, None);
    assert!(
        calls > p.specs.len(),
        "pieces were streamed ({calls} calls)"
    );
    let bytes = std::fs::read(dir.path().join(SINGLE_FILE)).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    for spec in &p.specs {
        let view = st.tensor(&spec.name).unwrap();
        assert_eq!(view.dtype(), Dtype::F32);
        assert_eq!(view.shape(), spec.shape.as_slice());
        let expect: Vec<u8> = p.data[spec.range()]
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect();
        assert_eq!(view.data(), expect.as_slice(), "{}", spec.name);
    }
    assert_eq!(load_params(dir.path(), &config()).unwrap().data, p.data);
}

#[test]
fn streamed_bf16_rounds_to_nearest_even_and_sharding_writes_an_index() {
    let dir = tempfile::tempdir().unwrap();
    let mut p = ParamStore::from_config(&config());
    p.init_random(5, 0.3);
    saved(dir.path(), &p, DType::BF16, Some(2000));
    assert!(dir.path().join(INDEX_FILE).is_file());
    assert!(!dir.path().join(SINGLE_FILE).exists());
    let back = load_params(dir.path(), &config()).unwrap();
    let rounded: Vec<f32> = p.data.iter().map(|&x| bf16::from_f32(x).to_f32()).collect();
    assert_eq!(back.data, rounded);
    for entry in std::fs::read_dir(dir.path()).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "safetensors") {
            let bytes = std::fs::read(&path).unwrap();
            let st = SafeTensors::deserialize(&bytes).unwrap();
            assert!(st.iter().all(|(_, v)| v.dtype() == Dtype::BF16));
        }
    }
}

#[test]
fn piecewise_loads_match_whole_loads() {
    let dir = tempfile::tempdir().unwrap();
    let mut p = ParamStore::from_config(&config());
    p.init_random(6, 0.3);
    saved(dir.path(), &p, DType::F32, Some(3000));
    let mut pieces = vec![f32::NAN; p.numel()];
    let mut dest = PieceDest {
        data: &mut pieces,
        piece: 7,
    };
    load_into(dir.path(), &config(), &p.specs, &mut dest).unwrap();
    assert_eq!(pieces, p.data);
}

#[test]
fn a_failing_source_leaves_no_file() {
    struct Failing;
    impl TensorSource for Failing {
        fn read(&mut self, _: Range<usize>, _: &mut dyn FnMut(&[f32]) -> Result<()>) -> Result<()> {
            Err(EngineError::InvalidArgument {
                argument: "test".into(),
                message: "device lost".into(),
            })
        }
    }
    let dir = tempfile::tempdir().unwrap();
    let p = ParamStore::from_config(&config());
    let e = save_pretrained_from(
        dir.path(),
        &config(),
        &p.specs,
        &mut Failing,
        DType::F32,
        None,
    )
    .unwrap_err();
    assert!(e.to_string().contains("device lost"), "{e}");
    assert!(!dir.path().join(SINGLE_FILE).exists());
    assert!(!dir.path().join("model.safetensors.tmp").exists());
}
