//! `config.json` of a DeepSeek-V3-family checkpoint: every field that changes
//! the math, validated up front so that a bad config is an error, not a panic
//! deep inside the forward pass.

use serde::Deserialize;
use std::path::Path;

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read {path}: {source}")]
    Io { path: String, source: std::io::Error },
    #[error("{path} is not a valid config: {message}")]
    Parse { path: String, message: String },
    #[error("{path}: {message}")]
    Invalid { path: String, message: String },
}

/// YaRN rope scaling (`rope_scaling` with `type: yarn`).
#[derive(Clone, Debug, PartialEq)]
pub struct Yarn {
    pub factor: f64,
    pub original_max_position_embeddings: usize,
    pub beta_fast: f64,
    pub beta_slow: f64,
    pub mscale: f64,
    pub mscale_all_dim: f64,
    /// An explicit cos/sin scale, which overrides the one derived from mscale.
    pub attention_factor: Option<f64>,
}

/// FP8 block quantisation as declared by `quantization_config`.
#[derive(Clone, Debug, PartialEq)]
pub struct Fp8Quantization {
    pub weight_block_size: [usize; 2],
}

pub use duplex_kernels::router::ScoringFunc;

/// The model families Duplex runs, each with its Hugging Face layout.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Architecture {
    /// `deepseek_v3` (and `kimi_k2`): MLA, group-limited sigmoid routing, shared experts.
    DeepseekV3,
    /// `qwen3_moe`: GQA with per-head q/k RMSNorm, softmax top-k routing.
    Qwen3Moe,
    /// `mixtral`: GQA, softmax top-2 routing, `block_sparse_moe` tensor names.
    Mixtral,
}

impl Architecture {
    pub fn name(self) -> &'static str {
        match self {
            Architecture::DeepseekV3 => "deepseek_v3",
            Architecture::Qwen3Moe => "qwen3_moe",
            Architecture::Mixtral => "mixtral",
        }
    }
}

/// Multi-head latent attention (DeepSeek-V3): keys and values compressed
/// into one latent per token, plus a rotary key shared by every head.
#[derive(Clone, Debug, PartialEq)]
pub struct MlaConfig {
    pub q_lora_rank: Option<usize>,
    pub kv_lora_rank: usize,
    pub qk_nope_head_dim: usize,
    pub qk_rope_head_dim: usize,
    pub v_head_dim: usize,
}

/// Grouped-query attention: `num_key_value_heads` key/value heads, each
/// shared by `num_attention_heads / num_key_value_heads` query heads.
#[derive(Clone, Debug, PartialEq)]
pub struct GqaConfig {
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    /// Per-head RMSNorm of queries and keys before the rotation (Qwen3).
    pub qk_norm: bool,
}

#[derive(Clone, Debug, PartialEq)]
pub enum AttentionConfig {
    Mla(MlaConfig),
    Gqa(GqaConfig),
}

/// The most layers a configuration may declare: llama.cpp's
/// `LLAMA_MAX_LAYERS`. Checked before anything is sized by the count (the
/// per-layer tables, every tensor name the loader looks for), so that a
/// corrupt count is a clear error rather than memory exhausted.
pub const MAX_LAYERS: usize = 512;
/// The most routed experts per layer: llama.cpp's `LLAMA_MAX_EXPERTS`.
pub const MAX_EXPERTS: usize = 1024;
/// The widest any width may be (the vocabulary, the hidden size, a head's,
/// a rank, an intermediate size): 2^20, four times the largest vocabulary
/// published. Widths within it keep every size the engine forms from them
/// (a weight's elements, the workspace's bytes) far from overflow, so that
/// a corrupt one is refused here.
pub const MAX_WIDTH: usize = 1 << 20;

/// `Err("is N, more than ...")` when `n` (a count or a width) exceeds `max`, for the
/// caller to put after the name of the field.
pub(crate) fn at_most(n: usize, max: usize) -> Result<(), String> {
    if n > max {
        return Err(format!("is {n}, more than the {max} that Duplex supports: the configuration is corrupt"));
    }
    Ok(())
}

/// The model hyper-parameters, as the engine uses them.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    pub architecture: Architecture,
    pub vocab_size: usize,
    pub hidden_size: usize,
    /// Width of the dense layers' MLP.
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub attention: AttentionConfig,
    /// Width of one routed (and of one shared) expert.
    pub moe_intermediate_size: usize,
    pub n_routed_experts: usize,
    pub n_shared_experts: usize,
    pub num_experts_per_tok: usize,
    /// Per layer: a mixture of experts (else a dense MLP).
    pub moe_layers: Vec<bool>,
    pub n_group: usize,
    pub topk_group: usize,
    pub norm_topk_prob: bool,
    pub routed_scaling_factor: f32,
    pub scoring_func: ScoringFunc,
    /// `true` for `noaux_tc` (bias-corrected selection), `false` for `greedy`.
    pub use_correction_bias: bool,
    pub rope_theta: f64,
    pub rope_scaling: Option<Yarn>,
    /// Rotate interleaved pairs (DeepSeek) rather than the two halves (Llama-style).
    pub rope_interleave: bool,
    pub rms_norm_eps: f32,
    pub max_position_embeddings: usize,
    pub tie_word_embeddings: bool,
    pub quantization: Option<Fp8Quantization>,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
}

/// The raw JSON, before validation. Field names are the union of the three
/// families' configs; optional fields take transformers' defaults, which
/// differ per family and are applied in [`ModelConfig::from_json`].
#[derive(Deserialize)]
struct RawConfig {
    model_type: Option<String>,
    vocab_size: usize,
    hidden_size: usize,
    #[serde(default)]
    intermediate_size: Option<usize>,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    // MLA
    #[serde(default)]
    q_lora_rank: Option<usize>,
    #[serde(default)]
    kv_lora_rank: Option<usize>,
    #[serde(default)]
    qk_nope_head_dim: Option<usize>,
    #[serde(default)]
    qk_rope_head_dim: Option<usize>,
    #[serde(default)]
    v_head_dim: Option<usize>,
    // GQA
    #[serde(default)]
    num_key_value_heads: Option<usize>,
    #[serde(default)]
    head_dim: Option<usize>,
    #[serde(default)]
    attention_bias: bool,
    #[serde(default)]
    use_sliding_window: bool,
    #[serde(default)]
    sliding_window: Option<serde_json::Value>,
    // MoE, under each family's names
    #[serde(default)]
    moe_intermediate_size: Option<usize>,
    #[serde(default)]
    n_routed_experts: Option<usize>,
    #[serde(default)]
    num_experts: Option<usize>,
    #[serde(default)]
    num_local_experts: Option<usize>,
    #[serde(default)]
    n_shared_experts: Option<usize>,
    #[serde(default)]
    num_experts_per_tok: Option<usize>,
    #[serde(default)]
    first_k_dense_replace: usize,
    #[serde(default = "one")]
    moe_layer_freq: usize,
    #[serde(default)]
    mlp_only_layers: Vec<usize>,
    #[serde(default = "one")]
    decoder_sparse_step: usize,
    #[serde(default)]
    n_group: Option<usize>,
    #[serde(default)]
    topk_group: Option<usize>,
    #[serde(default)]
    norm_topk_prob: Option<bool>,
    #[serde(default = "one_f64")]
    routed_scaling_factor: f64,
    #[serde(default = "sigmoid")]
    scoring_func: String,
    #[serde(default = "noaux_tc")]
    topk_method: String,
    #[serde(default)]
    rope_theta: Option<f64>,
    #[serde(default)]
    rope_scaling: Option<serde_json::Value>,
    #[serde(default)]
    rope_interleave: Option<bool>,
    #[serde(default)]
    rms_norm_eps: Option<f64>,
    #[serde(default = "default_max_pos")]
    max_position_embeddings: usize,
    #[serde(default)]
    tie_word_embeddings: bool,
    #[serde(default)]
    quantization_config: Option<serde_json::Value>,
    #[serde(default)]
    bos_token_id: Option<u32>,
    #[serde(default)]
    eos_token_id: Option<serde_json::Value>,
    #[serde(default)]
    hidden_act: Option<String>,
}

fn one() -> usize {
    1
}
fn one_f64() -> f64 {
    1.0
}
fn sigmoid() -> String {
    "sigmoid".into()
}
fn noaux_tc() -> String {
    "noaux_tc".into()
}
fn default_max_pos() -> usize {
    4096
}

impl ModelConfig {
    pub fn from_file(path: &Path) -> Result<Self, ConfigError> {
        let p = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Io { path: p.clone(), source })?;
        Self::from_json(&text, &p)
    }

    /// Parse and validate; `origin` names the file in errors.
    pub fn from_json(text: &str, origin: &str) -> Result<Self, ConfigError> {
        // serde_path_to_error names the offending field, which serde_json alone does not.
        let raw: RawConfig = serde_path_to_error::deserialize(&mut serde_json::Deserializer::from_str(text)).map_err(|e| {
            let message = match e.path().to_string().as_str() {
                "." => e.inner().to_string(),
                field => format!("field {field}: {}", e.inner()),
            };
            ConfigError::Parse { path: origin.into(), message }
        })?;
        let invalid = |message: String| ConfigError::Invalid { path: origin.into(), message };
        let required = |name: &str, v: Option<usize>| v.ok_or_else(|| invalid(format!("missing field {name}")));

        let architecture = match raw.model_type.as_deref() {
            Some("deepseek_v3") | Some("kimi_k2") | None => Architecture::DeepseekV3,
            Some("qwen3_moe") => Architecture::Qwen3Moe,
            Some("mixtral") => Architecture::Mixtral,
            Some(other) => return Err(invalid(format!("unsupported model_type {other:?}; expected \"deepseek_v3\", \"kimi_k2\", \"qwen3_moe\" or \"mixtral\""))),
        };
        if let Some(act) = raw.hidden_act.as_deref() {
            if act != "silu" {
                return Err(invalid(format!("unsupported hidden_act {act:?}; only \"silu\" is supported")));
            }
        }
        let quantization = match &raw.quantization_config {
            None => None,
            Some(q) => Some(parse_quantization(q).map_err(invalid)?),
        };
        let rope_scaling = match &raw.rope_scaling {
            None | Some(serde_json::Value::Null) => None,
            Some(v) => Some(parse_yarn(v, raw.max_position_embeddings).map_err(invalid)?),
        };
        let eos_token_ids = match &raw.eos_token_id {
            None | Some(serde_json::Value::Null) => vec![],
            Some(v) => parse_token_ids(v).ok_or_else(|| invalid("eos_token_id must be an integer or a list of integers".into()))?,
        };
        let layers = raw.num_hidden_layers;
        at_most(layers, MAX_LAYERS).map_err(|m| invalid(format!("num_hidden_layers {m}")))?;

        let cfg = match architecture {
            Architecture::DeepseekV3 => {
                let scoring_func = match raw.scoring_func.as_str() {
                    "sigmoid" => ScoringFunc::Sigmoid,
                    "softmax" => ScoringFunc::Softmax,
                    other => return Err(invalid(format!("unsupported scoring_func {other:?}"))),
                };
                let use_correction_bias = match raw.topk_method.as_str() {
                    "noaux_tc" => true,
                    "greedy" => false,
                    other => return Err(invalid(format!("unsupported topk_method {other:?}; expected \"noaux_tc\" or \"greedy\""))),
                };
                let n_routed_experts = raw.n_routed_experts.unwrap_or(0);
                let freq = raw.moe_layer_freq.max(1);
                if raw.moe_layer_freq == 0 {
                    return Err(invalid("moe_layer_freq must be positive".into()));
                }
                ModelConfig {
                    architecture,
                    vocab_size: raw.vocab_size,
                    hidden_size: raw.hidden_size,
                    intermediate_size: raw.intermediate_size.unwrap_or(0),
                    num_hidden_layers: layers,
                    num_attention_heads: raw.num_attention_heads,
                    attention: AttentionConfig::Mla(MlaConfig {
                        q_lora_rank: raw.q_lora_rank,
                        kv_lora_rank: required("kv_lora_rank", raw.kv_lora_rank)?,
                        qk_nope_head_dim: required("qk_nope_head_dim", raw.qk_nope_head_dim)?,
                        qk_rope_head_dim: required("qk_rope_head_dim", raw.qk_rope_head_dim)?,
                        v_head_dim: required("v_head_dim", raw.v_head_dim)?,
                    }),
                    moe_intermediate_size: raw.moe_intermediate_size.unwrap_or(0),
                    n_routed_experts,
                    n_shared_experts: raw.n_shared_experts.unwrap_or(0),
                    num_experts_per_tok: raw.num_experts_per_tok.unwrap_or(0),
                    moe_layers: (0..layers).map(|l| n_routed_experts > 0 && l >= raw.first_k_dense_replace && l.is_multiple_of(freq)).collect(),
                    n_group: raw.n_group.unwrap_or(1),
                    topk_group: raw.topk_group.unwrap_or(1),
                    norm_topk_prob: raw.norm_topk_prob.unwrap_or(true),
                    routed_scaling_factor: raw.routed_scaling_factor as f32,
                    scoring_func,
                    use_correction_bias,
                    rope_theta: raw.rope_theta.unwrap_or(10000.0),
                    rope_scaling,
                    rope_interleave: raw.rope_interleave.unwrap_or(true),
                    rms_norm_eps: raw.rms_norm_eps.unwrap_or(1e-6) as f32,
                    max_position_embeddings: raw.max_position_embeddings,
                    tie_word_embeddings: raw.tie_word_embeddings,
                    quantization,
                    bos_token_id: raw.bos_token_id,
                    eos_token_ids,
                }
            }
            Architecture::Qwen3Moe | Architecture::Mixtral => {
                if raw.attention_bias {
                    return Err(invalid("attention_bias = true is not supported".into()));
                }
                let window = raw.sliding_window.as_ref().is_some_and(|v| !v.is_null());
                if raw.use_sliding_window || (architecture == Architecture::Mixtral && window) {
                    return Err(invalid("sliding-window attention is not supported (set sliding_window to null)".into()));
                }
                let heads = raw.num_attention_heads;
                let qwen = architecture == Architecture::Qwen3Moe;
                let experts = if qwen { raw.num_experts } else { raw.num_local_experts }.unwrap_or(0);
                let step = raw.decoder_sparse_step;
                if qwen && step == 0 {
                    return Err(invalid("decoder_sparse_step must be positive".into()));
                }
                // Mixtral's experts are `intermediate_size` wide and every layer is MoE.
                let (dense, expert) = if qwen {
                    (raw.intermediate_size.unwrap_or(0), raw.moe_intermediate_size.unwrap_or(0))
                } else {
                    (0, required("intermediate_size", raw.intermediate_size)?)
                };
                ModelConfig {
                    architecture,
                    vocab_size: raw.vocab_size,
                    hidden_size: raw.hidden_size,
                    intermediate_size: dense,
                    num_hidden_layers: layers,
                    num_attention_heads: heads,
                    attention: AttentionConfig::Gqa(GqaConfig {
                        num_key_value_heads: raw.num_key_value_heads.unwrap_or(heads),
                        head_dim: raw.head_dim.unwrap_or(raw.hidden_size.checked_div(heads).unwrap_or(0)),
                        qk_norm: qwen,
                    }),
                    moe_intermediate_size: expert,
                    n_routed_experts: experts,
                    n_shared_experts: 0,
                    num_experts_per_tok: raw.num_experts_per_tok.unwrap_or(if qwen { 8 } else { 2 }),
                    moe_layers: (0..layers)
                        .map(|l| experts > 0 && (!qwen || (!raw.mlp_only_layers.contains(&l) && (l + 1).is_multiple_of(step))))
                        .collect(),
                    n_group: 1,
                    topk_group: 1,
                    // Mixtral always renormalises its top-2; Qwen3 has a switch (off by default).
                    norm_topk_prob: if qwen { raw.norm_topk_prob.unwrap_or(false) } else { true },
                    routed_scaling_factor: 1.0,
                    scoring_func: ScoringFunc::Softmax,
                    use_correction_bias: false,
                    rope_theta: raw.rope_theta.unwrap_or(if qwen { 10000.0 } else { 1e6 }),
                    rope_scaling,
                    rope_interleave: false,
                    rms_norm_eps: raw.rms_norm_eps.unwrap_or(if qwen { 1e-6 } else { 1e-5 }) as f32,
                    max_position_embeddings: raw.max_position_embeddings,
                    tie_word_embeddings: raw.tie_word_embeddings,
                    quantization,
                    bos_token_id: raw.bos_token_id,
                    eos_token_ids,
                }
            }
        };
        cfg.validate().map_err(invalid)?;
        Ok(cfg)
    }

    pub(crate) fn validate(&self) -> Result<(), String> {
        at_most(self.num_hidden_layers, MAX_LAYERS).map_err(|m| format!("num_hidden_layers {m}"))?;
        at_most(self.n_routed_experts, MAX_EXPERTS).map_err(|m| format!("the routed expert count (n_routed_experts, num_experts or num_local_experts) {m}"))?;
        at_most(self.n_shared_experts, MAX_EXPERTS).map_err(|m| format!("n_shared_experts {m}"))?;
        let mut widths = vec![
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("num_attention_heads", self.num_attention_heads),
            ("intermediate_size", self.intermediate_size),
            ("moe_intermediate_size", self.moe_intermediate_size),
            ("num_experts_per_tok", self.num_experts_per_tok),
            ("n_group", self.n_group),
            ("topk_group", self.topk_group),
        ];
        match &self.attention {
            AttentionConfig::Mla(m) => widths.extend([
                ("q_lora_rank", m.q_lora_rank.unwrap_or(0)),
                ("kv_lora_rank", m.kv_lora_rank),
                ("qk_nope_head_dim", m.qk_nope_head_dim),
                ("qk_rope_head_dim", m.qk_rope_head_dim),
                ("v_head_dim", m.v_head_dim),
            ]),
            AttentionConfig::Gqa(g) => widths.extend([("head_dim", g.head_dim), ("num_key_value_heads", g.num_key_value_heads)]),
        }
        for (name, v) in widths {
            at_most(v, MAX_WIDTH).map_err(|m| format!("{name} {m}"))?;
        }
        let positive = [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
        ];
        for (name, v) in positive {
            if v == 0 {
                return Err(format!("{name} must be positive"));
            }
        }
        match &self.attention {
            AttentionConfig::Mla(m) => {
                for (name, v) in [("kv_lora_rank", m.kv_lora_rank), ("qk_rope_head_dim", m.qk_rope_head_dim), ("v_head_dim", m.v_head_dim)] {
                    if v == 0 {
                        return Err(format!("{name} must be positive"));
                    }
                }
                if m.q_lora_rank == Some(0) {
                    return Err("q_lora_rank must be positive or null".into());
                }
            }
            AttentionConfig::Gqa(g) => {
                if g.head_dim == 0 || g.num_key_value_heads == 0 {
                    return Err("head_dim and num_key_value_heads must be positive".into());
                }
                if !self.num_attention_heads.is_multiple_of(g.num_key_value_heads) {
                    return Err(format!("num_key_value_heads ({}) must divide num_attention_heads ({})", g.num_key_value_heads, self.num_attention_heads));
                }
            }
        }
        let rope = self.rope_dim();
        if !rope.is_multiple_of(2) || rope > 512 {
            return Err(format!("the rotary width (qk_rope_head_dim or head_dim) must be even and at most 512, got {rope}"));
        }
        if self.moe_layers.iter().any(|m| !m) && self.intermediate_size == 0 {
            return Err("intermediate_size must be positive when there are dense layers".into());
        }
        if self.moe_layers.iter().any(|&m| m) {
            let e = self.n_routed_experts;
            if self.moe_intermediate_size == 0 {
                return Err("moe_intermediate_size must be positive".into());
            }
            if self.num_experts_per_tok == 0 || self.num_experts_per_tok > e {
                return Err(format!("num_experts_per_tok must be in 1..={e}, got {}", self.num_experts_per_tok));
            }
            if self.n_group == 0 || !e.is_multiple_of(self.n_group) {
                return Err(format!("n_group ({}) must divide n_routed_experts ({e})", self.n_group));
            }
            if self.topk_group == 0 || self.topk_group > self.n_group {
                return Err(format!("topk_group must be in 1..={}, got {}", self.n_group, self.topk_group));
            }
            if self.num_experts_per_tok > self.topk_group * (e / self.n_group) {
                return Err(format!(
                    "num_experts_per_tok ({}) exceeds the experts in topk_group groups ({})",
                    self.num_experts_per_tok,
                    self.topk_group * (e / self.n_group)
                ));
            }
            if !self.routed_scaling_factor.is_finite() {
                return Err("routed_scaling_factor must be finite".into());
            }
        }
        if !(self.rope_theta.is_finite() && self.rope_theta > 1.0) {
            return Err(format!("rope_theta must be > 1, got {}", self.rope_theta));
        }
        if !(self.rms_norm_eps.is_finite() && self.rms_norm_eps >= 0.0) {
            return Err("rms_norm_eps must be finite and non-negative".into());
        }
        Ok(())
    }

    /// Whether layer `layer` uses a mixture of experts (else a dense MLP).
    pub fn is_moe_layer(&self, layer: usize) -> bool {
        self.moe_layers.get(layer).copied().unwrap_or(false)
    }

    /// The MLA shape, for a DeepSeek-family model.
    pub fn mla(&self) -> Option<&MlaConfig> {
        match &self.attention {
            AttentionConfig::Mla(m) => Some(m),
            AttentionConfig::Gqa(_) => None,
        }
    }

    pub fn gqa(&self) -> Option<&GqaConfig> {
        match &self.attention {
            AttentionConfig::Gqa(g) => Some(g),
            AttentionConfig::Mla(_) => None,
        }
    }

    /// Width of each head's query (and key).
    pub fn qk_head_dim(&self) -> usize {
        match &self.attention {
            AttentionConfig::Mla(m) => m.qk_nope_head_dim + m.qk_rope_head_dim,
            AttentionConfig::Gqa(g) => g.head_dim,
        }
    }

    /// Width of each head's value (and attention output).
    pub fn v_head_dim(&self) -> usize {
        match &self.attention {
            AttentionConfig::Mla(m) => m.v_head_dim,
            AttentionConfig::Gqa(g) => g.head_dim,
        }
    }

    /// Width of the rotated part of a query head.
    pub fn rope_dim(&self) -> usize {
        match &self.attention {
            AttentionConfig::Mla(m) => m.qk_rope_head_dim,
            AttentionConfig::Gqa(g) => g.head_dim,
        }
    }

    /// Floats per token per layer in the paged KV cache: MLA's latent and
    /// rotary key, or every KV head's key then every KV head's value.
    pub fn kv_entry_dim(&self) -> usize {
        match &self.attention {
            AttentionConfig::Mla(m) => m.kv_lora_rank + m.qk_rope_head_dim,
            AttentionConfig::Gqa(g) => 2 * g.num_key_value_heads * g.head_dim,
        }
    }

    /// The attention softmax scale, including YaRN's mscale² correction (MLA).
    pub fn softmax_scale(&self) -> f32 {
        let mut scale = (self.qk_head_dim() as f64).powf(-0.5);
        if let (Some(y), AttentionConfig::Mla(_)) = (&self.rope_scaling, &self.attention) {
            if y.mscale_all_dim != 0.0 {
                let m = crate::rope::yarn_get_mscale(y.factor, y.mscale_all_dim);
                scale *= m * m;
            }
        }
        scale as f32
    }
}

fn parse_quantization(q: &serde_json::Value) -> Result<Fp8Quantization, String> {
    let method = q.get("quant_method").and_then(|v| v.as_str()).unwrap_or("");
    if method != "fp8" {
        return Err(format!("unsupported quantization_config.quant_method {method:?}; only \"fp8\" is supported"));
    }
    if let Some(fmt) = q.get("fmt").and_then(|v| v.as_str()) {
        if fmt != "e4m3" {
            return Err(format!("unsupported quantization_config.fmt {fmt:?}; only \"e4m3\" is supported"));
        }
    }
    if let Some(a) = q.get("activation_scheme").and_then(|v| v.as_str()) {
        if a != "dynamic" {
            return Err(format!("unsupported quantization_config.activation_scheme {a:?}; only \"dynamic\" is supported"));
        }
    }
    let block = q
        .get("weight_block_size")
        .and_then(|v| v.as_array())
        .and_then(|a| {
            let v: Option<Vec<usize>> = a.iter().map(|x| x.as_u64().map(|x| x as usize)).collect();
            v
        })
        .filter(|v| v.len() == 2 && v.iter().all(|&x| x > 0))
        .ok_or("quantization_config.weight_block_size must be two positive integers")?;
    Ok(Fp8Quantization { weight_block_size: [block[0], block[1]] })
}

fn parse_yarn(v: &serde_json::Value, max_pos: usize) -> Result<Yarn, String> {
    let kind = v.get("type").or_else(|| v.get("rope_type")).and_then(|t| t.as_str()).unwrap_or("");
    if kind != "yarn" {
        return Err(format!("unsupported rope_scaling type {kind:?}; only \"yarn\" is supported"));
    }
    let num = |key: &str, default: f64| -> Result<f64, String> {
        match v.get(key) {
            None | Some(serde_json::Value::Null) => Ok(default),
            Some(x) => x.as_f64().filter(|f| f.is_finite()).ok_or(format!("rope_scaling.{key} must be a number")),
        }
    };
    let factor = num("factor", f64::NAN)?;
    if !(factor.is_finite() && factor > 0.0) {
        return Err("rope_scaling.factor must be a positive number".into());
    }
    let orig = num("original_max_position_embeddings", max_pos as f64)?;
    if orig < 1.0 {
        return Err("rope_scaling.original_max_position_embeddings must be positive".into());
    }
    let y = Yarn {
        factor,
        original_max_position_embeddings: orig as usize,
        // transformers treats a missing or zero beta as its default.
        beta_fast: Some(num("beta_fast", 32.0)?).filter(|b| *b != 0.0).unwrap_or(32.0),
        beta_slow: Some(num("beta_slow", 1.0)?).filter(|b| *b != 0.0).unwrap_or(1.0),
        mscale: num("mscale", 1.0)?,
        mscale_all_dim: num("mscale_all_dim", 0.0)?,
        attention_factor: match v.get("attention_factor") {
            None | Some(serde_json::Value::Null) => None,
            Some(_) => Some(num("attention_factor", 1.0)?),
        },
    };
    if y.beta_fast < 0.0 || y.beta_slow < 0.0 {
        return Err("rope_scaling.beta_fast and beta_slow must be positive".into());
    }
    Ok(y)
}

pub use duplex_text::parse_token_ids;

#[cfg(test)]
mod tests {
    use super::*;

    const FIXTURE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/fixtures/tiny-dsv3/config.json");

    #[test]
    fn parses_fixture() {
        let c = ModelConfig::from_file(Path::new(FIXTURE)).unwrap();
        assert_eq!(c.architecture, Architecture::DeepseekV3);
        assert_eq!(c.mla().unwrap().q_lora_rank, Some(256));
        assert_eq!(c.n_group, 4);
        assert_eq!(c.quantization, Some(Fp8Quantization { weight_block_size: [128, 128] }));
        assert_eq!(c.rope_scaling.as_ref().unwrap().factor, 4.0);
        assert!(c.rope_interleave && c.use_correction_bias);
        assert_eq!(c.eos_token_ids, vec![1]);
        assert!(!c.is_moe_layer(0) && c.is_moe_layer(1));
    }

    fn fixture(name: &str) -> ModelConfig {
        ModelConfig::from_file(&Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures").join(name).join("config.json")).unwrap()
    }

    #[test]
    fn parses_qwen3_moe() {
        let c = fixture("tiny-qwen3moe");
        assert_eq!(c.architecture, Architecture::Qwen3Moe);
        assert_eq!(c.attention, AttentionConfig::Gqa(GqaConfig { num_key_value_heads: 2, head_dim: 64, qk_norm: true }));
        assert_eq!(c.moe_layers, vec![false, true, true, true], "mlp_only_layers [0]");
        assert_eq!((c.n_routed_experts, c.num_experts_per_tok, c.moe_intermediate_size, c.intermediate_size), (16, 4, 128, 512));
        assert!(c.norm_topk_prob && !c.rope_interleave && !c.use_correction_bias);
        assert_eq!(c.scoring_func, ScoringFunc::Softmax);
        assert_eq!(c.kv_entry_dim(), 2 * 2 * 64);
        assert_eq!(c.softmax_scale(), 0.125);
    }

    #[test]
    fn parses_mixtral() {
        let c = fixture("tiny-mixtral");
        assert_eq!(c.architecture, Architecture::Mixtral);
        assert_eq!(c.attention, AttentionConfig::Gqa(GqaConfig { num_key_value_heads: 2, head_dim: 32, qk_norm: false }));
        assert!(c.moe_layers.iter().all(|&m| m));
        assert_eq!((c.n_routed_experts, c.num_experts_per_tok, c.moe_intermediate_size), (8, 2, 512));
        assert!(c.norm_topk_prob);
        assert_eq!(c.rms_norm_eps, 1e-5);
    }

    #[test]
    fn qwen3_sparse_step_and_mlp_only_layers() {
        let mut v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tiny-qwen3moe/config.json")).unwrap()).unwrap();
        v["decoder_sparse_step"] = 2.into();
        v["mlp_only_layers"] = serde_json::json!([]);
        let c = ModelConfig::from_json(&v.to_string(), "config.json").unwrap();
        assert_eq!(c.moe_layers, vec![false, true, false, true]);
        v["use_sliding_window"] = true.into();
        assert!(ModelConfig::from_json(&v.to_string(), "config.json").unwrap_err().to_string().contains("sliding"));
        v["use_sliding_window"] = false.into();
        v["num_key_value_heads"] = 3.into();
        assert!(ModelConfig::from_json(&v.to_string(), "config.json").unwrap_err().to_string().contains("num_key_value_heads"));
    }

    fn edited(f: impl FnOnce(&mut serde_json::Value)) -> Result<ModelConfig, ConfigError> {
        let mut v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(FIXTURE).unwrap()).unwrap();
        f(&mut v);
        ModelConfig::from_json(&v.to_string(), "config.json")
    }

    #[test]
    fn null_q_lora_rank_is_plain_q_proj() {
        let c = edited(|v| v["q_lora_rank"] = serde_json::Value::Null).unwrap();
        assert_eq!(c.mla().unwrap().q_lora_rank, None);
    }

    #[test]
    fn rejects_bad_fields_with_their_names() {
        type Edit = Box<dyn FnOnce(&mut serde_json::Value)>;
        let cases: Vec<(Edit, &str)> = vec![
            (Box::new(|v| v["quantization_config"]["quant_method"] = "gptq".into()), "quant_method"),
            (Box::new(|v| v["quantization_config"]["fmt"] = "e5m2".into()), "fmt"),
            (Box::new(|v| v["n_group"] = 3.into()), "n_group"),
            (Box::new(|v| v["topk_group"] = 9.into()), "topk_group"),
            (Box::new(|v| v["scoring_func"] = "relu".into()), "scoring_func"),
            (Box::new(|v| v["rope_scaling"]["type"] = "dynamic".into()), "rope_scaling"),
            (Box::new(|v| v["model_type"] = "llama".into()), "model_type"),
            (Box::new(|v| v["hidden_size"] = 0.into()), "hidden_size"),
            (Box::new(|v| v["qk_rope_head_dim"] = 33.into()), "qk_rope_head_dim"),
            (Box::new(|v| v["hidden_size"] = "big".into()), "hidden_size"),
            // Counts that would size tables and tensor lists are refused
            // before anything is allocated by them.
            (Box::new(|v| v["num_hidden_layers"] = 10_000_000_000_000u64.into()), "num_hidden_layers is 10000000000000, more than the 512"),
            (Box::new(|v| v["n_routed_experts"] = 4096.into()), "n_routed_experts"),
            // Widths whose products would overflow (a checked build panicked
            // on `kv_lora_rank + qk_rope_head_dim`).
            (Box::new(|v| v["kv_lora_rank"] = u64::MAX.into()), "kv_lora_rank is 18446744073709551615, more than the 1048576"),
            (Box::new(|v| v["hidden_size"] = (1u64 << 21).into()), "hidden_size is 2097152"),
            (Box::new(|v| v["n_shared_experts"] = 2000.into()), "n_shared_experts"),
        ];
        for (edit, field) in cases {
            let err = edited(edit).unwrap_err().to_string();
            assert!(err.contains(field) && err.contains("config.json"), "{err}");
        }
    }
}
