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

/// The model hyper-parameters, as the engine uses them.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub moe_intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub q_lora_rank: Option<usize>,
    pub kv_lora_rank: usize,
    pub qk_nope_head_dim: usize,
    pub qk_rope_head_dim: usize,
    pub v_head_dim: usize,
    pub n_routed_experts: usize,
    pub n_shared_experts: usize,
    pub num_experts_per_tok: usize,
    pub first_k_dense_replace: usize,
    pub moe_layer_freq: usize,
    pub n_group: usize,
    pub topk_group: usize,
    pub norm_topk_prob: bool,
    pub routed_scaling_factor: f32,
    pub scoring_func: ScoringFunc,
    /// `true` for `noaux_tc` (bias-corrected selection), `false` for `greedy`.
    pub use_correction_bias: bool,
    pub rope_theta: f64,
    pub rope_scaling: Option<Yarn>,
    pub rope_interleave: bool,
    pub rms_norm_eps: f32,
    pub max_position_embeddings: usize,
    pub tie_word_embeddings: bool,
    pub quantization: Option<Fp8Quantization>,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
}

/// The raw JSON, before validation. Optional fields take the defaults of
/// transformers' `DeepseekV3Config`.
#[derive(Deserialize)]
struct RawConfig {
    model_type: Option<String>,
    vocab_size: usize,
    hidden_size: usize,
    intermediate_size: usize,
    moe_intermediate_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    q_lora_rank: Option<usize>,
    kv_lora_rank: usize,
    qk_nope_head_dim: usize,
    qk_rope_head_dim: usize,
    v_head_dim: usize,
    #[serde(default)]
    n_routed_experts: Option<usize>,
    #[serde(default)]
    n_shared_experts: Option<usize>,
    #[serde(default)]
    num_experts_per_tok: Option<usize>,
    #[serde(default)]
    first_k_dense_replace: usize,
    #[serde(default = "one")]
    moe_layer_freq: usize,
    #[serde(default)]
    n_group: Option<usize>,
    #[serde(default)]
    topk_group: Option<usize>,
    #[serde(default = "yes")]
    norm_topk_prob: bool,
    #[serde(default = "one_f64")]
    routed_scaling_factor: f64,
    #[serde(default = "sigmoid")]
    scoring_func: String,
    #[serde(default = "noaux_tc")]
    topk_method: String,
    #[serde(default = "default_theta")]
    rope_theta: f64,
    #[serde(default)]
    rope_scaling: Option<serde_json::Value>,
    #[serde(default = "yes")]
    rope_interleave: bool,
    #[serde(default = "default_eps")]
    rms_norm_eps: f64,
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
fn yes() -> bool {
    true
}
fn sigmoid() -> String {
    "sigmoid".into()
}
fn noaux_tc() -> String {
    "noaux_tc".into()
}
fn default_theta() -> f64 {
    10000.0
}
fn default_eps() -> f64 {
    1e-6
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

        match raw.model_type.as_deref() {
            Some("deepseek_v3") | Some("kimi_k2") | None => {}
            Some(other) => return Err(invalid(format!("unsupported model_type {other:?}; expected \"deepseek_v3\""))),
        }
        if let Some(act) = raw.hidden_act.as_deref() {
            if act != "silu" {
                return Err(invalid(format!("unsupported hidden_act {act:?}; only \"silu\" is supported")));
            }
        }
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

        let n_routed_experts = raw.n_routed_experts.unwrap_or(0);
        let cfg = ModelConfig {
            vocab_size: raw.vocab_size,
            hidden_size: raw.hidden_size,
            intermediate_size: raw.intermediate_size,
            moe_intermediate_size: raw.moe_intermediate_size,
            num_hidden_layers: raw.num_hidden_layers,
            num_attention_heads: raw.num_attention_heads,
            q_lora_rank: raw.q_lora_rank,
            kv_lora_rank: raw.kv_lora_rank,
            qk_nope_head_dim: raw.qk_nope_head_dim,
            qk_rope_head_dim: raw.qk_rope_head_dim,
            v_head_dim: raw.v_head_dim,
            n_routed_experts,
            n_shared_experts: raw.n_shared_experts.unwrap_or(0),
            num_experts_per_tok: raw.num_experts_per_tok.unwrap_or(0),
            first_k_dense_replace: raw.first_k_dense_replace,
            moe_layer_freq: raw.moe_layer_freq,
            n_group: raw.n_group.unwrap_or(1),
            topk_group: raw.topk_group.unwrap_or(1),
            norm_topk_prob: raw.norm_topk_prob,
            routed_scaling_factor: raw.routed_scaling_factor as f32,
            scoring_func,
            use_correction_bias,
            rope_theta: raw.rope_theta,
            rope_scaling,
            rope_interleave: raw.rope_interleave,
            rms_norm_eps: raw.rms_norm_eps as f32,
            max_position_embeddings: raw.max_position_embeddings,
            tie_word_embeddings: raw.tie_word_embeddings,
            quantization,
            bos_token_id: raw.bos_token_id,
            eos_token_ids,
        };
        cfg.validate().map_err(invalid)?;
        Ok(cfg)
    }

    fn validate(&self) -> Result<(), String> {
        let positive = [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("kv_lora_rank", self.kv_lora_rank),
            ("qk_rope_head_dim", self.qk_rope_head_dim),
            ("v_head_dim", self.v_head_dim),
            ("moe_layer_freq", self.moe_layer_freq),
        ];
        for (name, v) in positive {
            if v == 0 {
                return Err(format!("{name} must be positive"));
            }
        }
        if self.q_lora_rank == Some(0) {
            return Err("q_lora_rank must be positive or null".into());
        }
        if !self.qk_rope_head_dim.is_multiple_of(2) || self.qk_rope_head_dim > 512 {
            return Err(format!("qk_rope_head_dim must be even and at most 512, got {}", self.qk_rope_head_dim));
        }
        if self.first_k_dense_replace > 0 && self.intermediate_size == 0 {
            return Err("intermediate_size must be positive when there are dense layers".into());
        }
        if self.has_moe_layers() {
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
        self.n_routed_experts > 0 && layer >= self.first_k_dense_replace && layer.is_multiple_of(self.moe_layer_freq)
    }

    fn has_moe_layers(&self) -> bool {
        (0..self.num_hidden_layers).any(|l| self.is_moe_layer(l))
    }

    pub fn qk_head_dim(&self) -> usize {
        self.qk_nope_head_dim + self.qk_rope_head_dim
    }

    /// Floats per token per layer in the latent KV cache.
    pub fn kv_entry_dim(&self) -> usize {
        self.kv_lora_rank + self.qk_rope_head_dim
    }

    /// The attention softmax scale, including YaRN's mscale² correction.
    pub fn softmax_scale(&self) -> f32 {
        let mut scale = (self.qk_head_dim() as f64).powf(-0.5);
        if let Some(y) = &self.rope_scaling {
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
        assert_eq!(c.q_lora_rank, Some(256));
        assert_eq!(c.n_group, 4);
        assert_eq!(c.quantization, Some(Fp8Quantization { weight_block_size: [128, 128] }));
        assert_eq!(c.rope_scaling.as_ref().unwrap().factor, 4.0);
        assert!(c.rope_interleave && c.use_correction_bias);
        assert_eq!(c.eos_token_ids, vec![1]);
        assert!(!c.is_moe_layer(0) && c.is_moe_layer(1));
    }

    fn edited(f: impl FnOnce(&mut serde_json::Value)) -> Result<ModelConfig, ConfigError> {
        let mut v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(FIXTURE).unwrap()).unwrap();
        f(&mut v);
        ModelConfig::from_json(&v.to_string(), "config.json")
    }

    #[test]
    fn null_q_lora_rank_is_plain_q_proj() {
        let c = edited(|v| v["q_lora_rank"] = serde_json::Value::Null).unwrap();
        assert_eq!(c.q_lora_rank, None);
    }

    #[test]
    fn rejects_bad_fields_with_their_names() {
        let cases: Vec<(Box<dyn FnOnce(&mut serde_json::Value)>, &str)> = vec![
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
        ];
        for (edit, field) in cases {
            let err = edited(edit).unwrap_err().to_string();
            assert!(err.contains(field) && err.contains("config.json"), "{err}");
        }
    }
}
