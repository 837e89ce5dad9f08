//! Helpers shared by the integration tests: the bundled fixture, owned
//! safetensors tensors, and comparison of logits.

#![allow(dead_code)]

use duplex_model::{BlockTable, Logits, Model, Precision};
use safetensors::tensor::View;
use safetensors::{Dtype, SafeTensors};
use std::borrow::Cow;
use std::path::{Path, PathBuf};

/// The bundled tiny DeepSeek-V3 checkpoint (sharded, FP8).
pub fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tiny-dsv3")
}

/// One tensor of a safetensors file, owned, so that a test can edit it.
#[derive(Clone, Debug)]
pub struct Tensor {
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    pub data: Vec<u8>,
}

impl Tensor {
    pub fn new(name: impl Into<String>, dtype: Dtype, shape: &[usize], data: Vec<u8>) -> Self {
        let t = Tensor { name: name.into(), dtype, shape: shape.to_vec(), data };
        assert_eq!(t.data.len(), shape.iter().product::<usize>() * dtype.size(), "{}: bytes do not match shape", t.name);
        t
    }
}

impl View for &Tensor {
    fn dtype(&self) -> Dtype {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> Cow<'_, [u8]> {
        Cow::Borrowed(&self.data)
    }
    fn data_len(&self) -> usize {
        self.data.len()
    }
}

/// Every tensor of a safetensors file, sorted by name.
pub fn read_tensors(path: &Path) -> Vec<Tensor> {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
    let st = SafeTensors::deserialize(&bytes).unwrap_or_else(|e| panic!("parse {}: {e:?}", path.display()));
    let mut out: Vec<Tensor> = st
        .tensors()
        .into_iter()
        .map(|(name, v)| Tensor { name, dtype: v.dtype(), shape: v.shape().to_vec(), data: v.data().to_vec() })
        .collect();
    out.sort_by(|a, b| a.name.cmp(&b.name));
    out
}

/// Write `tensors` as a safetensors file (replacing any file at `path`).
pub fn write_tensors(path: &Path, tensors: &[Tensor]) {
    // Remove first: never write through a link into someone else's file.
    let _ = std::fs::remove_file(path);
    safetensors::serialize_to_file(tensors.iter().map(|t| (t.name.clone(), t)), &None, path)
        .unwrap_or_else(|e| panic!("write {}: {e:?}", path.display()));
}

/// Write `model.safetensors.index.json` mapping each tensor to its shard.
pub fn write_index(dir: &Path, shards: &[(&str, &[Tensor])]) {
    let mut map = serde_json::Map::new();
    let mut total = 0;
    for (file, tensors) in shards {
        for t in *tensors {
            map.insert(t.name.clone(), serde_json::Value::String(file.to_string()));
            total += t.data.len();
        }
    }
    let json = serde_json::json!({ "metadata": { "total_size": total }, "weight_map": map });
    std::fs::write(dir.join("model.safetensors.index.json"), serde_json::to_string_pretty(&json).unwrap()).unwrap();
}

pub fn load(dir: &Path) -> Model {
    match Model::load(dir, &mut |_, _| {}) {
        Ok(m) => m,
        Err(e) => panic!("{} does not load: {e}", dir.display()),
    }
}

/// Feed `tokens` through one sequence in chunks of `chunk`, collecting the
/// logits (`want` per chunk). `chunk >= tokens.len()` is one-shot prefill.
pub fn run_chunked(m: &Model, tokens: &[u32], chunk: usize, want: Logits) -> Vec<f32> {
    let block_size = 16;
    let mut pool = m.new_kv_pool(tokens.len().div_ceil(block_size) + 1, block_size);
    let mut table = BlockTable::default();
    let mut out = Vec::with_capacity(tokens.len() * m.cfg.vocab_size);
    for c in tokens.chunks(chunk) {
        let logits = m.forward(&mut pool, &mut table, c, Precision::F32, want).expect("forward");
        out.extend_from_slice(&logits);
    }
    assert_eq!(table.len, tokens.len());
    out
}

/// Prefill `tokens[..prefill]` in one pass, then decode the rest one token
/// at a time; returns the `Logits::Last` row of every step (the rows of
/// positions `prefill - 1..tokens.len()`).
pub fn prefill_then_decode(m: &Model, tokens: &[u32], prefill: usize) -> Vec<f32> {
    let mut pool = m.new_kv_pool(tokens.len().div_ceil(16), 16);
    let mut table = BlockTable::default();
    let mut out = m.forward(&mut pool, &mut table, &tokens[..prefill], Precision::F32, Logits::Last).expect("prefill");
    for t in &tokens[prefill..] {
        out.extend(m.forward(&mut pool, &mut table, std::slice::from_ref(t), Precision::F32, Logits::Last).expect("decode"));
    }
    out
}

/// Assert `max |got - want| <= rel * max |want|`.
pub fn assert_close(what: &str, got: &[f32], want: &[f32], rel: f32) {
    assert_eq!(got.len(), want.len(), "{what}: lengths differ");
    assert!(want.iter().all(|v| v.is_finite()), "{what}: reference has non-finite values");
    assert!(got.iter().all(|v| v.is_finite()), "{what}: non-finite values");
    let scale = want.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let (worst, at) = got
        .iter()
        .zip(want)
        .enumerate()
        .map(|(i, (a, b))| ((a - b).abs(), i))
        .fold((0.0f32, 0), |acc, x| if x.0 > acc.0 { x } else { acc });
    println!("{what}: max |Δ| / max |ref| = {:.2e}", worst / scale);
    assert!(
        worst <= rel * scale,
        "{what}: max |Δ| = {worst:e} at element {at} exceeds {rel:e} × max|ref| ({scale:e})"
    );
}
