//! Models stored as GGUF (llama.cpp's format): what llama.cpp's architecture
//! names, metadata keys and tensor layouts mean for Duplex, and a GGUF
//! opened as a [`Checkpoint`] under Hugging Face names, so that one loader
//! serves both. The container itself is `duplex-gguf`'s.
//!
//! - [`deepseek2`]: DeepSeek-V2/V3/R1 and Kimi-K2 (`deepseek2`).
//! - [`gqa`]: Qwen3-MoE (`qwen3moe`) and Mixtral (`llama` with experts).
//!
//! Weights stay views into the file's mapping, in their stored formats
//! (k-quants and all), with one exception: newer converters split MLA's
//! `kv_b_proj` per head into `attn_k_b` (transposed) and `attn_v_b`, which
//! no single view can present as one matrix. That matrix is rebuilt in BF16
//! in an anonymous mapping beside the file's: small (for DeepSeek-V3, 32 MiB
//! per layer, under 1% of a Q4_K_M file) and, in a shared weight segment,
//! held once like every other weight. Prefill reads it (BF16, not F32: F32
//! weights take the scalar reference path, which made a quarter of a
//! 512-token prefill of the `bench` model; the rounding, 2⁻⁹ of each
//! weight, is that of the BF16 activations it meets). The absorbed decode
//! reads the halves themselves, as stored and as llama.cpp does, under the
//! names `self_attn.k_b_proj` (`[heads · kv_lora, nope]`) and
//! `self_attn.v_b_proj` (`[heads · v, kv_lora]`).

pub mod deepseek2;
pub mod gqa;

pub use duplex_gguf::{split_file_name, types, vocab, GgmlType, Gguf, GgufError, GgufPart, Metadata, TensorInfo, Value, ValueType};

use crate::checkpoint::{Checkpoint, StoredTensor, StoredType};
use crate::config::ModelConfig;
use deepseek2::HfSlice;
use duplex_kernels::quant::{dequantize_row, QuantKind};
use memmap2::Mmap;
use safetensors::Dtype;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// A GGUF model, opened: its configuration and its tensors by Hugging Face
/// name.
pub struct GgufModel {
    pub cfg: ModelConfig,
    pub checkpoint: Checkpoint,
    pub gguf: Gguf,
}

/// The configuration a GGUF's metadata describes, for the architectures
/// Duplex maps.
pub fn model_config(g: &Gguf) -> Result<ModelConfig, GgufError> {
    let arch_key = "general.architecture";
    match g.metadata().str(arch_key)? {
        Some(deepseek2::ARCH) => deepseek2::model_config(g),
        Some(arch @ (gqa::QWEN3MOE | gqa::LLAMA)) => gqa::model_config(g, arch),
        Some(other) => Err(g.metadata().error(arch_key, format!("is {other:?}; Duplex serves GGUF models of the architectures {ARCHITECTURES}"))),
        None => Err(g.metadata().error(arch_key, "missing".into())),
    }
}

/// The `general.architecture` values Duplex maps.
pub const ARCHITECTURES: &str = "deepseek2 (DeepSeek-V2/V3/R1, Kimi-K2), qwen3moe (Qwen3-MoE) and llama (Mixtral)";

/// The Hugging Face tensor a GGUF tensor name holds, for `arch`.
fn hf_name(arch: &str, gguf_name: &str) -> Option<deepseek2::HfTensor> {
    match arch {
        deepseek2::ARCH => deepseek2::hf_name(gguf_name),
        _ => gqa::hf_name(arch, gguf_name),
    }
}

/// Open the GGUF model at `path` (one file or any part of a split set).
pub fn open(path: &Path) -> Result<GgufModel, GgufError> {
    open_with(path, &[])
}

/// [`open`], with `overrides` applied to the metadata first.
pub fn open_with(path: &Path, overrides: &[duplex_gguf::MetadataOverride]) -> Result<GgufModel, GgufError> {
    let mut g = Gguf::open(path)?;
    g.override_metadata(overrides);
    let cfg = model_config(&g)?;
    let arch = g.metadata().str("general.architecture")?.unwrap_or_default().to_string();
    let model_err = |message: String| GgufError::Model { path: g.path().to_path_buf(), message };
    // The DeepSeek layout is checked whole here; the others when the model
    // loads, by the Hugging Face names it asks for.
    let cov = if arch == deepseek2::ARCH { deepseek2::coverage(&cfg, &g) } else { deepseek2::Coverage::default() };
    if !cov.missing.is_empty() || !cov.wrong_shape.is_empty() {
        let shapes: Vec<String> = cov.wrong_shape.iter().map(|(n, want, got)| format!("{n} is {got:?}, needs {want:?}")).collect();
        return Err(model_err(format!("does not hold the model its metadata describes: missing {:?}; misshapen: {}", cov.missing, shapes.join("; "))));
    }
    let mut shards: Vec<(PathBuf, Arc<Mmap>)> = vec![];
    for part in g.parts() {
        let map = part.mapping().map_err(|source| GgufError::Io { path: part.path.clone(), source })?;
        shards.push((part.path.clone(), map));
    }
    let mut tensors: Vec<(usize, StoredTensor)> = vec![];
    // kv_b_proj halves by Hugging Face name: (keys, values).
    let mut halves: BTreeMap<String, (Option<&TensorInfo>, Option<&TensorInfo>)> = BTreeMap::new();
    for t in g.tensors() {
        // Names the table does not know are not read (coverage said the
        // ones the model needs are all there).
        let Some(hf) = hf_name(&arch, &t.name) else { continue };
        let ty = stored_type(&g, t)?;
        let (start, shape) = (t.start as usize, t.hf_shape());
        match hf.slice {
            HfSlice::Whole => tensors.push((t.part, StoredTensor { name: hf.name, ty, shape, range: start..start + t.n_bytes as usize })),
            HfSlice::Experts => {
                let [experts, rows, cols] = shape[..] else {
                    return Err(model_err(format!("{} has shape {shape:?}, expected [experts, rows, cols]", t.name)));
                };
                let each = t.n_bytes as usize / experts.max(1);
                for e in 0..experts {
                    let at = start + e * each;
                    tensors.push((t.part, StoredTensor { name: hf.expert(e), ty, shape: vec![rows, cols], range: at..at + each }));
                }
            }
            HfSlice::KvBKeysTransposed => halves.entry(hf.name).or_default().0 = Some(t),
            HfSlice::KvBValues => halves.entry(hf.name).or_default().1 = Some(t),
        }
    }
    if !halves.is_empty() {
        let mut derived: Vec<u8> = vec![];
        let mut placed = vec![];
        for (name, pair) in &halves {
            let (Some(k), Some(v)) = *pair else {
                return Err(model_err(format!("{name} has only one of its attn_k_b / attn_v_b halves")));
            };
            let (rows, cols, data) = rebuild_kv_b(&g, k, v)?;
            let attn = name.strip_suffix(".kv_b_proj.weight").unwrap_or(name);
            for (t, half) in [(k, "k_b_proj"), (v, "v_b_proj")] {
                let s = t.hf_shape();
                let (start, end) = (t.start as usize, (t.start + t.n_bytes) as usize);
                tensors.push((t.part, StoredTensor { name: format!("{attn}.{half}.weight"), ty: stored_type(&g, t)?, shape: vec![s[0] * s[1], s[2]], range: start..end }));
            }
            let at = derived.len();
            derived.extend(data.iter().flat_map(|&x| half::bf16::from_f32(x).to_le_bytes()));
            placed.push(StoredTensor { name: name.clone(), ty: StoredType::Float(Dtype::BF16), shape: vec![rows, cols], range: at..derived.len() });
        }
        let io = |source| GgufError::Io { path: g.path().to_path_buf(), source };
        let mut anon = memmap2::MmapMut::map_anon(derived.len().max(1)).map_err(io)?;
        anon[..derived.len()].copy_from_slice(&derived);
        shards.push((g.path().with_extension("gguf (kv_b_proj rebuilt)"), Arc::new(anon.make_read_only().map_err(io)?)));
        let shard = shards.len() - 1;
        tensors.extend(placed.into_iter().map(|t| (shard, t)));
    }
    let checkpoint = Checkpoint::from_shards(shards, tensors, None).map_err(|e| model_err(e.to_string()))?;
    Ok(GgufModel { cfg, checkpoint, gguf: g })
}

/// What Duplex stores a GGUF tensor as; an unsupported type is an error
/// naming the tensor and its type.
fn stored_type(g: &Gguf, t: &TensorInfo) -> Result<StoredType, GgufError> {
    let unsupported = || GgufError::Unsupported { path: g.parts()[t.part].path.clone(), tensor: t.name.clone(), ty: t.ty };
    if !t.ty.is_supported() {
        return Err(unsupported());
    }
    Ok(match QuantKind::from_ggml_type(t.ty.id()).ok_or_else(unsupported)? {
        QuantKind::F32 => StoredType::Float(Dtype::F32),
        QuantKind::F16 => StoredType::Float(Dtype::F16),
        QuantKind::Bf16 => StoredType::Float(Dtype::BF16),
        kind => StoredType::Block(kind),
    })
}

/// `kv_b_proj` (`[heads · (nope + v), kv_lora]`, dequantized to F32) from its per-head
/// halves: `attn_k_b` (`[heads, kv_lora, nope]`, each head's key rows
/// transposed) and `attn_v_b` (`[heads, v, kv_lora]`).
fn rebuild_kv_b(g: &Gguf, k: &TensorInfo, v: &TensorInfo) -> Result<(usize, usize, Vec<f32>), GgufError> {
    let err = |message: String| GgufError::Tensor { path: g.parts()[k.part].path.clone(), tensor: k.name.clone(), message };
    let (ks, vs) = (k.hf_shape(), v.hf_shape());
    let (&[heads, lora, nope], &[heads_v, dv, lora_v]) = (ks.as_slice(), vs.as_slice()) else {
        return Err(err(format!("attn_k_b {:?} and attn_v_b {:?} are not both [heads, rows, cols]", k.hf_shape(), v.hf_shape())));
    };
    if heads != heads_v || lora != lora_v {
        return Err(err(format!("attn_k_b {:?} does not pair with attn_v_b {:?}", k.hf_shape(), v.hf_shape())));
    }
    // Whole rows, dequantized exactly.
    let rows_of = |t: &TensorInfo, cols: usize| -> Result<Vec<f32>, GgufError> {
        let kind = QuantKind::from_ggml_type(t.ty.id()).ok_or_else(|| GgufError::Unsupported { path: g.parts()[t.part].path.clone(), tensor: t.name.clone(), ty: t.ty })?;
        let bytes = g.raw_bytes(t);
        let mut out = vec![0.0f32; t.n_elements as usize];
        let row_bytes = bytes.len() / (out.len() / cols).max(1);
        for (row, dst) in bytes.chunks_exact(row_bytes.max(1)).zip(out.chunks_exact_mut(cols)) {
            dequantize_row(kind, row, dst).map_err(|e| GgufError::Tensor { path: g.parts()[t.part].path.clone(), tensor: t.name.clone(), message: e.to_string() })?;
        }
        Ok(out)
    };
    let (keys, values) = (rows_of(k, nope)?, rows_of(v, lora)?);
    let (per_head, cols) = (nope + dv, lora);
    let mut out = vec![0.0f32; heads * per_head * cols];
    for h in 0..heads {
        for i in 0..nope {
            for c in 0..cols {
                out[(h * per_head + i) * cols + c] = keys[(h * lora + c) * nope + i];
            }
        }
        let src = &values[h * dv * lora..(h + 1) * dv * lora];
        out[(h * per_head + nope) * cols..(h + 1) * per_head * cols].copy_from_slice(src);
    }
    Ok((heads * per_head, cols, out))
}
