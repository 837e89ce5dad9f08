//! llama.cpp's `deepseek2` architecture (DeepSeek-V2/V3/R1, Kimi-K2 as
//! converted by `convert_hf_to_gguf.py`): its metadata as a Duplex
//! [`ModelConfig`], and its tensor names as the Hugging Face names Duplex's
//! loader asks for.
//!
//! Two converter generations exist. The older one stores `attn_kv_b` as the
//! Hugging Face `kv_b_proj` and the per-head widths under
//! `attention.key_length` / `value_length`. The newer one (llama.cpp's MLA
//! support, and the fixture) splits `kv_b_proj` per head into `attn_k_b`
//! (each head's key rows, transposed: `[kv_lora, qk_nope]`, which is the
//! absorbed form's matrix) and `attn_v_b` (each head's value rows,
//! `[v_head_dim, kv_lora]`), stores the compressed widths under
//! `key_length` / `value_length` and the per-head ones under
//! `key_length_mla` / `value_length_mla`, and writes `head_count_kv` = 1.

use duplex_gguf::{Gguf, GgufError, Metadata, TensorInfo};
use crate::config::{at_most, Architecture, AttentionConfig, MlaConfig, ModelConfig, ScoringFunc, Yarn, MAX_EXPERTS, MAX_LAYERS};
use std::collections::{BTreeMap, BTreeSet};

pub const ARCH: &str = "deepseek2";

/// How a GGUF tensor relates to the Hugging Face tensor it comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HfSlice {
    /// The whole tensor: its Hugging Face shape is the ggml dims reversed.
    Whole,
    /// Every routed expert stacked on the outermost ggml dimension
    /// (`[experts, rows, cols]` in row-major order): expert `e`'s matrix is
    /// the Hugging Face tensor [`HfTensor::expert`] names.
    Experts,
    /// `attn_k_b`, `[heads, kv_lora, qk_nope]`: for each head, the transpose
    /// of `kv_b_proj`'s key rows.
    KvBKeysTransposed,
    /// `attn_v_b`, `[heads, v_head_dim, kv_lora]`: for each head,
    /// `kv_b_proj`'s value rows.
    KvBValues,
}

/// The Hugging Face tensor a GGUF tensor holds (all or part of).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HfTensor {
    /// For [`HfSlice::Experts`], with `*` where the expert index goes.
    pub name: String,
    pub slice: HfSlice,
}

impl HfTensor {
    /// The name of expert `e`'s tensor (the name itself for other slices).
    pub fn expert(&self, e: usize) -> String {
        self.name.replacen('*', &e.to_string(), 1)
    }
}

/// Whole-model tensors.
const GLOBAL_NAMES: [(&str, &str); 3] = [("token_embd.weight", "model.embed_tokens.weight"), ("output_norm.weight", "model.norm.weight"), ("output.weight", "lm_head.weight")];

/// Per-block tensors: the name after `blk.N.` and after `model.layers.N.`.
const BLOCK_NAMES: [(&str, &str, HfSlice); 26] = [
    ("attn_norm.weight", "input_layernorm.weight", HfSlice::Whole),
    ("attn_q_a.weight", "self_attn.q_a_proj.weight", HfSlice::Whole),
    ("attn_q_a_norm.weight", "self_attn.q_a_layernorm.weight", HfSlice::Whole),
    ("attn_q_b.weight", "self_attn.q_b_proj.weight", HfSlice::Whole),
    ("attn_q.weight", "self_attn.q_proj.weight", HfSlice::Whole),
    ("attn_kv_a_mqa.weight", "self_attn.kv_a_proj_with_mqa.weight", HfSlice::Whole),
    ("attn_kv_a_norm.weight", "self_attn.kv_a_layernorm.weight", HfSlice::Whole),
    ("attn_kv_b.weight", "self_attn.kv_b_proj.weight", HfSlice::Whole),
    ("attn_k_b.weight", "self_attn.kv_b_proj.weight", HfSlice::KvBKeysTransposed),
    ("attn_v_b.weight", "self_attn.kv_b_proj.weight", HfSlice::KvBValues),
    ("attn_output.weight", "self_attn.o_proj.weight", HfSlice::Whole),
    ("ffn_norm.weight", "post_attention_layernorm.weight", HfSlice::Whole),
    ("ffn_gate.weight", "mlp.gate_proj.weight", HfSlice::Whole),
    ("ffn_up.weight", "mlp.up_proj.weight", HfSlice::Whole),
    ("ffn_down.weight", "mlp.down_proj.weight", HfSlice::Whole),
    ("ffn_gate_inp.weight", "mlp.gate.weight", HfSlice::Whole),
    ("exp_probs_b.bias", "mlp.gate.e_score_correction_bias", HfSlice::Whole),
    ("ffn_gate_exps.weight", "mlp.experts.*.gate_proj.weight", HfSlice::Experts),
    ("ffn_up_exps.weight", "mlp.experts.*.up_proj.weight", HfSlice::Experts),
    ("ffn_down_exps.weight", "mlp.experts.*.down_proj.weight", HfSlice::Experts),
    ("ffn_gate_shexp.weight", "mlp.shared_experts.gate_proj.weight", HfSlice::Whole),
    ("ffn_up_shexp.weight", "mlp.shared_experts.up_proj.weight", HfSlice::Whole),
    ("ffn_down_shexp.weight", "mlp.shared_experts.down_proj.weight", HfSlice::Whole),
    // Multi-token prediction (blocks past the decoder's), which Duplex skips.
    ("nextn.eh_proj.weight", "eh_proj.weight", HfSlice::Whole),
    ("nextn.enorm.weight", "enorm.weight", HfSlice::Whole),
    ("nextn.hnorm.weight", "hnorm.weight", HfSlice::Whole),
];

/// The MTP head's remaining tensors (kept apart so the table above stays
/// one entry per line of llama.cpp's tensor list).
const NEXTN_NAMES: [(&str, &str); 3] = [
    ("nextn.embed_tokens.weight", "embed_tokens.weight"),
    ("nextn.shared_head_head.weight", "shared_head.head.weight"),
    ("nextn.shared_head_norm.weight", "shared_head.norm.weight"),
];

/// The Hugging Face tensor behind a `deepseek2` GGUF tensor name, or `None`
/// for a name this table does not know.
pub fn hf_name(gguf_name: &str) -> Option<HfTensor> {
    if let Some((_, hf)) = GLOBAL_NAMES.iter().find(|(g, _)| *g == gguf_name) {
        return Some(HfTensor { name: hf.to_string(), slice: HfSlice::Whole });
    }
    let rest = gguf_name.strip_prefix("blk.")?;
    let (layer, suffix) = rest.split_once('.')?;
    // Only canonical decimal indices: "blk.01" is not block 1.
    if layer.is_empty() || (layer.len() > 1 && layer.starts_with('0')) || !layer.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let layer: usize = layer.parse().ok()?;
    let (hf, slice) = BLOCK_NAMES
        .iter()
        .map(|&(g, h, s)| (g, h, s))
        .chain(NEXTN_NAMES.iter().map(|&(g, h)| (g, h, HfSlice::Whole)))
        .find(|(g, _, _)| *g == suffix)
        .map(|(_, h, s)| (h, s))?;
    Some(HfTensor { name: format!("model.layers.{layer}.{hf}"), slice })
}

/// Which form of `kv_b_proj` a file stores.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvBLayout {
    /// `attn_kv_b`: the Hugging Face matrix as it is.
    Fused,
    /// `attn_k_b` and `attn_v_b`: split per head (newer converters).
    Split,
}

/// The `kv_b_proj` form of layer 0 (every layer is converted alike).
pub fn kv_b_layout(g: &Gguf) -> Result<KvBLayout, GgufError> {
    match (g.contains("blk.0.attn_kv_b.weight"), g.contains("blk.0.attn_k_b.weight") && g.contains("blk.0.attn_v_b.weight")) {
        (true, false) => Ok(KvBLayout::Fused),
        (false, true) => Ok(KvBLayout::Split),
        (true, true) => Err(model_err(g, "layer 0 has both attn_kv_b and attn_k_b/attn_v_b")),
        (false, false) => Err(model_err(g, "layer 0 has neither attn_kv_b nor both of attn_k_b and attn_v_b")),
    }
}

fn model_err(g: &Gguf, message: impl Into<String>) -> GgufError {
    GgufError::Model { path: g.path().to_path_buf(), message: message.into() }
}

fn key(name: &str) -> String {
    format!("{ARCH}.{name}")
}

/// The YaRN parameters as `deepseek2` metadata states them.
fn yarn(md: &Metadata, max_pos: usize) -> Result<Option<Yarn>, GgufError> {
    let ty_key = key("rope.scaling.type");
    match md.str(&ty_key)? {
        None | Some("none") => return Ok(None),
        Some("yarn") => {}
        Some(other) => return Err(md.error(&ty_key, format!("unsupported rope scaling {other:?}; only \"yarn\" is supported"))),
    }
    let factor_key = key("rope.scaling.factor");
    let factor = md.require(&factor_key, md.f64(&factor_key)?)?;
    if !(factor.is_finite() && factor > 0.0) {
        return Err(md.error(&factor_key, format!("must be a positive number, got {factor}")));
    }
    let original = md.usize(&key("rope.scaling.original_context_length"))?.unwrap_or(max_pos);
    // The converter writes 0.1 · mscale_all_dim; divide in f32, the type it
    // is stored in, so that 0.1 gives back exactly 1.
    let log_mul_key = key("rope.scaling.yarn_log_multiplier");
    let mscale_all_dim = match md.get(&log_mul_key) {
        Some(super::Value::F32(v)) => f64::from(*v / 0.1f32),
        Some(_) => md.f64(&log_mul_key)?.unwrap_or(0.0) / 0.1,
        None => 0.0,
    };
    // llama.cpp ignores the betas for deepseek2 (it uses its defaults, 32
    // and 1); Duplex reads them where the converter wrote them. A zero
    // means "default", as in transformers.
    let beta = |name: &str, default: f64| -> Result<f64, GgufError> {
        let k = key(name);
        let v = md.f64(&k)?.filter(|b| *b != 0.0).unwrap_or(default);
        if !(v.is_finite() && v > 0.0) {
            return Err(md.error(&k, format!("must be positive, got {v}")));
        }
        Ok(v)
    };
    Ok(Some(Yarn {
        factor,
        original_max_position_embeddings: original,
        beta_fast: beta("rope.scaling.yarn_beta_fast", 32.0)?,
        beta_slow: beta("rope.scaling.yarn_beta_slow", 1.0)?,
        // GGUF keeps only mscale_all_dim. DeepSeek's checkpoints set mscale
        // equal to it, which makes cos/sin unscaled: what llama.cpp computes.
        mscale: mscale_all_dim,
        mscale_all_dim,
        attention_factor: None,
    }))
}

/// The Duplex configuration of a `deepseek2` GGUF.
pub fn model_config(g: &Gguf) -> Result<ModelConfig, GgufError> {
    let md = g.metadata();
    let arch_key = "general.architecture";
    match md.str(arch_key)? {
        Some(ARCH) => {}
        Some(other) => return Err(md.error(arch_key, format!("is {other:?}; only \"{ARCH}\" (DeepSeek-V2/V3 family) is mapped"))),
        None => return Err(md.error(arch_key, "missing".into())),
    }
    let need = |name: &str| -> Result<usize, GgufError> {
        let k = key(name);
        md.require(&k, md.usize(&k)?)
    };
    let opt = |name: &str| md.usize(&key(name));

    let vocab = super::vocab::GgufVocab::from_metadata(md)?;
    let vocab_size = vocab.tokens.len();
    if let Some(declared) = opt("vocab_size")? {
        if declared != vocab_size {
            return Err(md.error(&key("vocab_size"), format!("is {declared} but tokenizer.ggml.tokens has {vocab_size} tokens")));
        }
    }
    let block_count = need("block_count")?;
    at_most(block_count, MAX_LAYERS).map_err(|m| md.error(&key("block_count"), m))?;
    let nextn = opt("nextn_predict_layers")?.unwrap_or(0);
    let layers = block_count
        .checked_sub(nextn)
        .ok_or_else(|| md.error(&key("nextn_predict_layers"), format!("{nextn} exceeds block_count {block_count}")))?;
    let hidden = need("embedding_length")?;
    let heads = need("attention.head_count")?;
    let rope_dim = need("rope.dimension_count")?;
    let kv_lora_rank = need("attention.kv_lora_rank")?;
    // Per-head widths: under the `_mla` keys when the converter wrote the
    // compressed widths under the plain ones.
    let (k_name, v_name) = match opt("attention.key_length_mla")? {
        Some(_) => ("attention.key_length_mla", "attention.value_length_mla"),
        None => ("attention.key_length", "attention.value_length"),
    };
    let key_len = need(k_name)?;
    let qk_nope_head_dim = key_len
        .checked_sub(rope_dim)
        .ok_or_else(|| md.error(&key(k_name), format!("{key_len} is less than rope.dimension_count {rope_dim}")))?;
    let v_head_dim = need(v_name)?;
    let q_lora_rank = opt("attention.q_lora_rank")?.filter(|&r| r > 0);

    let n_routed_experts = opt("expert_count")?.unwrap_or(0);
    at_most(n_routed_experts, MAX_EXPERTS).map_err(|m| md.error(&key("expert_count"), m))?;
    let leading_dense = opt("leading_dense_block_count")?.unwrap_or(0);
    let gating_key = key("expert_gating_func");
    // llama.cpp's enum: 1 softmax, 2 sigmoid; absent means softmax (DeepSeek-V2).
    let scoring_func = match opt("expert_gating_func")? {
        None | Some(1) => ScoringFunc::Softmax,
        Some(2) => ScoringFunc::Sigmoid,
        Some(other) => return Err(md.error(&gating_key, format!("gating function {other} is not supported (1 softmax, 2 sigmoid)"))),
    };
    let first_moe = (leading_dense..layers).next();
    // llama.cpp selects with the bias exactly when the tensor is there.
    let use_correction_bias = first_moe.is_some_and(|l| n_routed_experts > 0 && g.contains(&format!("blk.{l}.exp_probs_b.bias")));
    let max_pos = opt("context_length")?.unwrap_or(4096);
    let rms_eps_key = key("attention.layer_norm_rms_epsilon");

    let cfg = ModelConfig {
        architecture: Architecture::DeepseekV3,
        vocab_size,
        hidden_size: hidden,
        intermediate_size: opt("feed_forward_length")?.unwrap_or(0),
        num_hidden_layers: layers,
        num_attention_heads: heads,
        attention: AttentionConfig::Mla(MlaConfig { q_lora_rank, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim: rope_dim, v_head_dim }),
        moe_intermediate_size: opt("expert_feed_forward_length")?.unwrap_or(0),
        n_routed_experts,
        n_shared_experts: opt("expert_shared_count")?.unwrap_or(0),
        num_experts_per_tok: opt("expert_used_count")?.unwrap_or(0),
        moe_layers: (0..layers).map(|l| n_routed_experts > 0 && l >= leading_dense).collect(),
        n_group: opt("expert_group_count")?.unwrap_or(1).max(1),
        topk_group: opt("expert_group_used_count")?.unwrap_or(1).max(1),
        norm_topk_prob: md.bool(&key("expert_weights_norm"))?.unwrap_or(false),
        routed_scaling_factor: md.f64(&key("expert_weights_scale"))?.unwrap_or(1.0) as f32,
        scoring_func,
        use_correction_bias,
        rope_theta: md.f64(&key("rope.freq_base"))?.unwrap_or(10000.0),
        rope_scaling: yarn(md, max_pos)?,
        // llama.cpp's deepseek2 rotates adjacent pairs, as DeepSeek's
        // checkpoints (`rope_interleave`) do; the converter does not permute.
        rope_interleave: true,
        rms_norm_eps: md.f64(&rms_eps_key)?.unwrap_or(1e-6) as f32,
        max_position_embeddings: max_pos,
        tie_word_embeddings: !g.contains("output.weight"),
        quantization: None,
        bos_token_id: vocab.bos_token_id,
        eos_token_ids: vocab.eos_token_id.into_iter().collect(),
    };
    cfg.validate().map_err(|m| model_err(g, format!("the deepseek2 metadata gives an invalid configuration: {m}")))?;
    Ok(cfg)
}

/// Every tensor Duplex's DeepSeek loader reads, with its Hugging Face shape.
pub fn duplex_tensors(cfg: &ModelConfig) -> Vec<(String, Vec<usize>)> {
    let (d, h) = (cfg.hidden_size, cfg.num_attention_heads);
    let mut out = vec![("model.embed_tokens.weight".to_string(), vec![cfg.vocab_size, d]), ("model.norm.weight".to_string(), vec![d])];
    if !cfg.tie_word_embeddings {
        out.push(("lm_head.weight".into(), vec![cfg.vocab_size, d]));
    }
    let Some(m) = cfg.mla() else { return out };
    for l in 0..cfg.num_hidden_layers {
        let mut t = |name: &str, shape: Vec<usize>| out.push((format!("model.layers.{l}.{name}"), shape));
        t("input_layernorm.weight", vec![d]);
        match m.q_lora_rank {
            Some(r) => {
                t("self_attn.q_a_proj.weight", vec![r, d]);
                t("self_attn.q_a_layernorm.weight", vec![r]);
                t("self_attn.q_b_proj.weight", vec![h * cfg.qk_head_dim(), r]);
            }
            None => t("self_attn.q_proj.weight", vec![h * cfg.qk_head_dim(), d]),
        }
        t("self_attn.kv_a_proj_with_mqa.weight", vec![cfg.kv_entry_dim(), d]);
        t("self_attn.kv_a_layernorm.weight", vec![m.kv_lora_rank]);
        t("self_attn.kv_b_proj.weight", vec![h * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank]);
        t("self_attn.o_proj.weight", vec![d, h * m.v_head_dim]);
        t("post_attention_layernorm.weight", vec![d]);
        if !cfg.is_moe_layer(l) {
            let i = cfg.intermediate_size;
            t("mlp.gate_proj.weight", vec![i, d]);
            t("mlp.up_proj.weight", vec![i, d]);
            t("mlp.down_proj.weight", vec![d, i]);
            continue;
        }
        let (e, i) = (cfg.n_routed_experts, cfg.moe_intermediate_size);
        t("mlp.gate.weight", vec![e, d]);
        if cfg.use_correction_bias {
            t("mlp.gate.e_score_correction_bias", vec![e]);
        }
        if cfg.n_shared_experts > 0 {
            let s = i * cfg.n_shared_experts;
            t("mlp.shared_experts.gate_proj.weight", vec![s, d]);
            t("mlp.shared_experts.up_proj.weight", vec![s, d]);
            t("mlp.shared_experts.down_proj.weight", vec![d, s]);
        }
        for x in 0..e {
            t(&format!("mlp.experts.{x}.gate_proj.weight"), vec![i, d]);
            t(&format!("mlp.experts.{x}.up_proj.weight"), vec![i, d]);
            t(&format!("mlp.experts.{x}.down_proj.weight"), vec![d, i]);
        }
    }
    out
}

/// How a GGUF's tensors cover what Duplex's DeepSeek loader needs.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Coverage {
    /// Needed and absent.
    pub missing: Vec<String>,
    /// Present, mapped, and not read by Duplex (multi-token prediction, ...).
    pub extra: Vec<String>,
    /// GGUF tensors [`hf_name`] does not know.
    pub unmapped: Vec<String>,
    /// `(name, needed shape, shape the GGUF gives)` where they differ.
    pub wrong_shape: Vec<(String, Vec<usize>, Vec<usize>)>,
}

impl Coverage {
    pub fn is_complete(&self) -> bool {
        self.missing.is_empty() && self.unmapped.is_empty() && self.wrong_shape.is_empty()
    }
}

/// Compare the Hugging Face tensors (and shapes) a GGUF provides with the
/// ones Duplex's loader needs for `cfg`.
pub fn coverage(cfg: &ModelConfig, g: &Gguf) -> Coverage {
    let mut provided: BTreeMap<String, Vec<usize>> = BTreeMap::new();
    let mut unmapped = vec![];
    // kv_b_proj halves, per HF name: (keys [h, kv_lora, nope], values [h, v, kv_lora]).
    let mut halves: BTreeMap<String, (Option<&TensorInfo>, Option<&TensorInfo>)> = BTreeMap::new();
    for t in g.tensors() {
        let Some(hf) = hf_name(&t.name) else {
            unmapped.push(t.name.clone());
            continue;
        };
        let shape = t.hf_shape();
        match hf.slice {
            HfSlice::Whole => {
                provided.insert(hf.name, shape);
            }
            HfSlice::Experts => {
                let (experts, inner) = shape.split_first().map(|(e, s)| (*e, s.to_vec())).unwrap_or((0, vec![]));
                for e in 0..experts {
                    provided.insert(hf.expert(e), inner.clone());
                }
            }
            HfSlice::KvBKeysTransposed => halves.entry(hf.name).or_default().0 = Some(t),
            HfSlice::KvBValues => halves.entry(hf.name).or_default().1 = Some(t),
        }
    }
    for (name, pair) in halves {
        // Only the two halves together make kv_b_proj; a lone one is not it.
        if let (Some(k), Some(v)) = pair {
            let (ks, vs) = (k.hf_shape(), v.hf_shape());
            let combined = match (ks.as_slice(), vs.as_slice()) {
                ([h, r, nope], [h2, dv, r2]) if h == h2 && r == r2 => vec![h * (nope + dv), *r],
                _ => vec![],
            };
            provided.insert(name, combined);
        }
    }
    let needed = duplex_tensors(cfg);
    let needed_names: BTreeSet<&str> = needed.iter().map(|(n, _)| n.as_str()).collect();
    let mut cov = Coverage { unmapped, ..Default::default() };
    for (name, shape) in &needed {
        match provided.get(name) {
            None => cov.missing.push(name.clone()),
            Some(s) if s != shape => cov.wrong_shape.push((name.clone(), shape.clone(), s.clone())),
            Some(_) => {}
        }
    }
    cov.extra = provided.keys().filter(|n| !needed_names.contains(n.as_str())).cloned().collect();
    cov
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_map_to_hugging_face() {
        let n = |g: &str| hf_name(g).map(|h| (h.name, h.slice));
        assert_eq!(n("token_embd.weight"), Some(("model.embed_tokens.weight".into(), HfSlice::Whole)));
        assert_eq!(n("blk.12.attn_q_a.weight"), Some(("model.layers.12.self_attn.q_a_proj.weight".into(), HfSlice::Whole)));
        assert_eq!(n("blk.3.exp_probs_b.bias"), Some(("model.layers.3.mlp.gate.e_score_correction_bias".into(), HfSlice::Whole)));
        assert_eq!(n("blk.0.attn_k_b.weight"), Some(("model.layers.0.self_attn.kv_b_proj.weight".into(), HfSlice::KvBKeysTransposed)));
        let experts = hf_name("blk.1.ffn_down_exps.weight").unwrap();
        assert_eq!(experts.slice, HfSlice::Experts);
        assert_eq!(experts.expert(7), "model.layers.1.mlp.experts.7.down_proj.weight");
        assert_eq!(n("blk.61.nextn.shared_head_head.weight"), Some(("model.layers.61.shared_head.head.weight".into(), HfSlice::Whole)));
        for unknown in ["blk.x.attn_q.weight", "blk.01.attn_q.weight", "blk..attn_q.weight", "blk.1.attn_qq.weight", "rope_freqs.weight", "blk.1"] {
            assert_eq!(hf_name(unknown), None, "{unknown}");
        }
    }
}
