//! Synthetic checkpoints in the real Hugging Face layouts of the model
//! families the engine runs: DeepSeek-V3 (FP8), Qwen3-MoE (BF16, or the
//! official "-FP8" layout) and Mixtral (BF16).
//!
//! [`write_checkpoint`] writes `config.json`, sharded safetensors with their
//! index, `generation_config.json` and the family's bundled tokenizer, filled
//! with random but numerically sane weights. The engine and its benchmarks can
//! then run on model shapes nobody has to download.
//!
//! Everything is streamed: every shape is known from the config, so each
//! shard's header is computed up front and the tensor bytes are generated and
//! written chunk by chunk. Memory stays at a few MB whatever the model size.
//!
//! Values are deterministic in `(seed, tensor name)`, independent of sharding
//! and of the order tensors are written in.
//!
//! A *hollow* checkpoint ([`WriteOptions::hollow`]) has the same files,
//! headers and index but no tensor bytes: each shard is extended to its full
//! size with `File::set_len`, so it is sparse, reads as zeros and takes no
//! disk beyond its header. It is for `duplex simulate`, which builds the real
//! engines for shapes as big as DeepSeek-R1 or Kimi-K2 but never computes
//! with their weights. Run for real, a hollow checkpoint computes garbage:
//! every weight and FP8 scale is zero.

use duplex_model::checkpoint::{INDEX_FILE, SINGLE_FILE};
use duplex_model::config::{Architecture, AttentionConfig, ConfigError, ModelConfig};
use duplex_kernels::fp8::E4M3_TABLE;
use rand::{RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::Serialize;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::fmt;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// The bundled tiny checkpoints' configs: the `tiny*` presets, and the
/// templates (key sets, as each family's Hugging Face config has them) of the
/// other presets of their family.
const DSV3_CONFIG: &str = include_str!("../../../tests/fixtures/tiny-dsv3/config.json");
const QWEN3_CONFIG: &str = include_str!("../../../tests/fixtures/tiny-qwen3moe/config.json");
const MIXTRAL_CONFIG: &str = include_str!("../../../tests/fixtures/tiny-mixtral/config.json");

/// `tokenizer.json` and `tokenizer_config.json` of one family's fixture.
/// Embedded rather than copied at run time, so a relocated binary still works.
struct Tokenizer {
    json: &'static [u8],
    config: &'static [u8],
}

/// Each family gets its own tokenizer (and chat template): the fixtures'
/// ids of BOS/EOS are the ones the presets' configs name.
fn tokenizer(arch: Architecture) -> Tokenizer {
    match arch {
        Architecture::DeepseekV3 => Tokenizer {
            json: include_bytes!("../../../tests/fixtures/tiny-dsv3/tokenizer.json"),
            config: include_bytes!("../../../tests/fixtures/tiny-dsv3/tokenizer_config.json"),
        },
        Architecture::Qwen3Moe => Tokenizer {
            json: include_bytes!("../../../tests/fixtures/tiny-qwen3moe/tokenizer.json"),
            config: include_bytes!("../../../tests/fixtures/tiny-qwen3moe/tokenizer_config.json"),
        },
        Architecture::Mixtral => Tokenizer {
            json: include_bytes!("../../../tests/fixtures/tiny-mixtral/tokenizer.json"),
            config: include_bytes!("../../../tests/fixtures/tiny-mixtral/tokenizer_config.json"),
        },
    }
}

/// Tokens in each bundled tokenizer; a config's `vocab_size` must cover them.
pub const TOKENIZER_VOCAB: usize = 2048;
/// Preset names accepted by [`preset`].
pub const PRESETS: [&str; 9] = [
    "tiny",
    "bench",
    "deepseek-v3",
    "tiny-qwen3moe",
    "tiny-qwen3moe-fp8",
    "tiny-mixtral",
    "qwen3-30b-a3b",
    "qwen3-30b-a3b-fp8",
    "mixtral-8x7b",
];
pub const DEFAULT_SHARD_SIZE: u64 = 1 << 30;

/// Bytes generated and written at a time: big enough for fast writes, small
/// enough that memory does not grow with the model.
const CHUNK: usize = 1 << 20;
/// Standard deviation, in FP8 units, of the drawn FP8 codes. Tails reach about
/// ±185, well inside E4M3's ±448, and the bulk sits where E4M3 has 3 bits of
/// mantissa, like amax-scaled real checkpoints.
const FP8_SPREAD: f32 = 64.0;

#[derive(Debug, thiserror::Error)]
pub enum SynthError {
    #[error("unknown preset {name:?}; expected one of: {}", PRESETS.join(", "))]
    UnknownPreset { name: String },
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("{origin}: {message}")]
    Unsupported { origin: String, message: String },
    #[error("{0}")]
    BadOption(String),
    #[error("{dir} already contains a checkpoint ({found}); refusing to overwrite it without --force")]
    Exists { dir: PathBuf, found: String },
    #[error("the checkpoint would take {}, over the {} limit (--max-size); --plan prints its tensor plan without writing", human_bytes(*need), human_bytes(*limit))]
    TooLarge { need: u64, limit: u64 },
    #[error("cannot write {path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> SynthError + '_ {
    move |source| SynthError::Io { path: path.to_path_buf(), source }
}

/// How the linear layers (attention projections, MLPs, experts) are stored.
/// Embeddings, the LM head, routers and norms are BF16 in every layout.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LinearFormat {
    /// BF16, as Qwen3-MoE's and Mixtral's own releases.
    Bf16,
    /// FP8 E4M3 in `block` tiles, each with an inverse scale of dtype
    /// `scale`: F32 in DeepSeek-V3, BF16 in Qwen's "-FP8" releases.
    Fp8 { block: [usize; 2], scale: Dtype },
}

/// A config to synthesise: the JSON written as `config.json` and the same
/// config as the engine parses it.
#[derive(Clone, Debug)]
pub struct SynthConfig {
    pub json: Value,
    pub model: ModelConfig,
    /// `num_nextn_predict_layers`: multi-token-prediction layers written after
    /// the decoder layers, as in DeepSeek-V3 (the engine skips them).
    pub mtp_layers: usize,
    pub linear: LinearFormat,
}

impl SynthConfig {
    /// Validate `json` as the engine would. `origin` names it in errors.
    pub fn from_json(mut json: Value, origin: &str) -> Result<Self, SynthError> {
        let unsupported = |message: String| SynthError::Unsupported { origin: origin.into(), message };
        let obj = json.as_object_mut().ok_or_else(|| unsupported("a config must be a JSON object".into()))?;
        let deepseek = matches!(obj.get("model_type").and_then(Value::as_str), None | Some("deepseek_v3") | Some("kimi_k2"));
        // DeepSeek-V3 is only released in FP8, so a DeepSeek config without
        // quantization_config gets V3's rather than lying about the
        // checkpoint. Qwen3-MoE and Mixtral without one are written in BF16,
        // as their own releases are.
        if deepseek && obj.get("quantization_config").unwrap_or(&Value::Null).is_null() {
            obj.insert(
                "quantization_config".into(),
                json!({"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}),
            );
        }
        let mtp_layers = match obj.get("num_nextn_predict_layers") {
            None | Some(Value::Null) => 0,
            Some(v) => v.as_u64().ok_or_else(|| unsupported("num_nextn_predict_layers must be a non-negative integer".into()))? as usize,
        };
        let model = ModelConfig::from_json(&json.to_string(), origin)?;
        if model.vocab_size < TOKENIZER_VOCAB {
            return Err(unsupported(format!(
                "vocab_size {} is smaller than the bundled tokenizer's {TOKENIZER_VOCAB} tokens",
                model.vocab_size
            )));
        }
        if mtp_layers > 0 && model.architecture != Architecture::DeepseekV3 {
            return Err(unsupported("num_nextn_predict_layers (MTP) exists only in DeepSeek-V3 checkpoints".into()));
        }
        let linear = match &model.quantization {
            None => LinearFormat::Bf16,
            Some(q) => LinearFormat::Fp8 {
                block: q.weight_block_size,
                scale: if model.architecture == Architecture::DeepseekV3 { Dtype::F32 } else { Dtype::Bf16 },
            },
        };
        Ok(SynthConfig { json, model, mtp_layers, linear })
    }

    pub fn from_file(path: &Path) -> Result<Self, SynthError> {
        let origin = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Io { path: origin.clone(), source })?;
        let json = serde_json::from_str(&text).map_err(|e| ConfigError::Parse { path: origin.clone(), message: e.to_string() })?;
        Self::from_json(json, &origin)
    }
}

/// The `quantization_config` of Qwen's "-FP8" releases (Qwen3-30B-A3B-FP8):
/// 128×128 E4M3 blocks, dynamic activations, and the LM head and every MoE
/// router (`mlp.gate`) left in BF16.
fn qwen3_fp8_quantization(model: &ModelConfig) -> Value {
    let mut keep = vec![Value::from("lm_head")];
    keep.extend((0..model.num_hidden_layers).filter(|&l| model.is_moe_layer(l)).map(|l| Value::from(format!("model.layers.{l}.mlp.gate"))));
    json!({
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "modules_to_not_convert": keep,
        "quant_method": "fp8",
        "weight_block_size": [128, 128],
    })
}

/// A named model shape: `tiny`, `tiny-qwen3moe` and `tiny-mixtral` (the
/// bundled fixtures' configs), `tiny-qwen3moe-fp8` (the same in FP8),
/// `bench` (DeepSeek-V3 family, about 5 GB), `qwen3-30b-a3b`,
/// `qwen3-30b-a3b-fp8` and `mixtral-8x7b` (the real per-layer shapes, fewer
/// layers and experts) or `deepseek-v3` (the real 671B shape, for `--plan`).
pub fn preset(name: &str) -> Result<SynthConfig, SynthError> {
    let (template, overrides) = match name {
        "tiny" => (DSV3_CONFIG, json!({})),
        // DeepSeek-V2-Lite-sized MoE with V3's routing and YaRN. The vocabulary
        // is cut to 32768 (V3 has 129280): with V3's the checkpoint grows to
        // 6.3 GB and the LM head is 40% of the bytes a decode step reads,
        // against 5% in the real model.
        "bench" => (DSV3_CONFIG, json!({
            "vocab_size": 32768,
            "hidden_size": 2048,
            "intermediate_size": 10944,
            "moe_intermediate_size": 1536,
            "num_hidden_layers": 9,
            "first_k_dense_replace": 1,
            "num_attention_heads": 16,
            "num_key_value_heads": 16,
            "n_routed_experts": 64,
            "n_shared_experts": 2,
            "num_experts_per_tok": 6,
            "n_group": 8,
            "topk_group": 4,
            "q_lora_rank": 1536,
            "kv_lora_rank": 512,
            "qk_nope_head_dim": 128,
            "qk_rope_head_dim": 64,
            "v_head_dim": 128,
            "max_position_embeddings": 16384,
            "num_nextn_predict_layers": 0,
            "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096,
                             "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
        })),
        // DeepSeek-V3's published config.json.
        "deepseek-v3" => (DSV3_CONFIG, json!({
            "vocab_size": 129280,
            "hidden_size": 7168,
            "intermediate_size": 18432,
            "moe_intermediate_size": 2048,
            "num_hidden_layers": 61,
            "first_k_dense_replace": 3,
            "num_attention_heads": 128,
            "num_key_value_heads": 128,
            "n_routed_experts": 256,
            "n_shared_experts": 1,
            "num_experts_per_tok": 8,
            "n_group": 8,
            "topk_group": 4,
            "q_lora_rank": 1536,
            "kv_lora_rank": 512,
            "qk_nope_head_dim": 128,
            "qk_rope_head_dim": 64,
            "v_head_dim": 128,
            "max_position_embeddings": 163840,
            "num_nextn_predict_layers": 1,
            "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                             "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
        })),
        "tiny-qwen3moe" | "tiny-qwen3moe-fp8" => (QWEN3_CONFIG, json!({})),
        "tiny-mixtral" => (MIXTRAL_CONFIG, json!({})),
        // Qwen3-30B-A3B's config.json with every per-layer shape real
        // (hidden 2048; 32 query / 4 KV heads of 128; 768-wide experts,
        // top-8 with renormalised weights), a quarter of its depth (12 of 48
        // layers), of its experts (32 of 128) and of its vocabulary (37984 of
        // 151936). A decode step then reads what 12 real layers read, and the
        // LM head keeps its real share (a tenth) of those bytes; the
        // checkpoint is 4.4 GB (the real one is 61 GB). BOS/EOS are the
        // bundled Qwen tokenizer's (<|endoftext|>, <|im_end|>).
        "qwen3-30b-a3b" | "qwen3-30b-a3b-fp8" => (QWEN3_CONFIG, json!({
            "vocab_size": 37984,
            "hidden_size": 2048,
            "intermediate_size": 6144,
            "moe_intermediate_size": 768,
            "num_hidden_layers": 12,
            "max_window_layers": 12,
            "mlp_only_layers": [],
            "decoder_sparse_step": 1,
            "num_attention_heads": 32,
            "num_key_value_heads": 4,
            "head_dim": 128,
            "num_experts": 32,
            "num_experts_per_tok": 8,
            "norm_topk_prob": true,
            "rope_theta": 1000000.0,
            "rms_norm_eps": 1e-6,
            "max_position_embeddings": 40960,
            "tie_word_embeddings": false,
        })),
        // Mixtral-8x7B's config.json with every per-layer shape real (hidden
        // 4096; 32 query / 8 KV heads of 128; 14336-wide experts, top-2), an
        // eighth of its depth (4 of 32 layers) and of its vocabulary (4000 of
        // 32000), and 4 of its 8 experts: one layer's experts are 2.8 GB in
        // BF16, so only a few fit this way, and routing still picks 2 of
        // several. A decode step reads what 4 real layers read with the LM
        // head's real share (1%); the checkpoint is 6.0 GB (the real one is
        // 93 GB).
        "mixtral-8x7b" => (MIXTRAL_CONFIG, json!({
            "vocab_size": 4000,
            "hidden_size": 4096,
            "intermediate_size": 14336,
            "num_hidden_layers": 4,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "rope_theta": 1000000.0,
            "rms_norm_eps": 1e-5,
            "max_position_embeddings": 32768,
            "sliding_window": null,
            "tie_word_embeddings": false,
        })),
        _ => return Err(SynthError::UnknownPreset { name: name.into() }),
    };
    let mut json: Value = serde_json::from_str(template).expect("the bundled config.json is valid JSON");
    for (k, v) in overrides.as_object().expect("overrides are an object") {
        json[k] = v.clone();
    }
    let origin = format!("preset {name}");
    if name.ends_with("-fp8") {
        let model = ModelConfig::from_json(&json.to_string(), &origin)?;
        json["quantization_config"] = qwen3_fp8_quantization(&model);
    }
    SynthConfig::from_json(json, &origin)
}

// ---------------------------------------------------------------------------
// The tensor plan.

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Dtype {
    F8E4M3,
    Bf16,
    F32,
}

impl Dtype {
    pub fn size(self) -> usize {
        match self {
            Dtype::F8E4M3 => 1,
            Dtype::Bf16 => 2,
            Dtype::F32 => 4,
        }
    }

    /// The name in a safetensors header.
    pub fn name(self) -> &'static str {
        match self {
            Dtype::F8E4M3 => "F8_E4M3",
            Dtype::Bf16 => "BF16",
            Dtype::F32 => "F32",
        }
    }
}

/// What a tensor is part of, for byte accounting. FP8 scales share their
/// weight's part; every tensor of an MTP layer is [`Part::Mtp`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Part {
    Embedding,
    LmHead,
    Norm,
    Attention,
    DenseMlp,
    Router,
    SharedExperts,
    RoutedExpert(usize),
    Mtp,
}

impl Part {
    pub fn label(self) -> &'static str {
        match self {
            Part::Embedding => "embedding",
            Part::LmHead => "lm_head",
            Part::Norm => "norms",
            Part::Attention => "attention",
            Part::DenseMlp => "dense_mlp",
            Part::Router => "router",
            Part::SharedExperts => "shared_experts",
            Part::RoutedExpert(_) => "routed_experts",
            Part::Mtp => "mtp",
        }
    }
}

/// How a tensor's values are drawn.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Init {
    /// FP8 codes with standard deviation [`fp8_code_std`]; the scales make
    /// the weight's standard deviation about `1/sqrt(fan_in)`.
    Fp8,
    /// Approximately normal.
    Normal { mean: f32, std: f32 },
}

#[derive(Clone, Debug, PartialEq)]
pub struct TensorPlan {
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    /// Decoder layer index (MTP layers follow the decoder layers).
    pub layer: Option<usize>,
    pub part: Part,
    pub init: Init,
}

impl TensorPlan {
    pub fn numel(&self) -> u64 {
        self.shape.iter().map(|&d| d as u64).product()
    }

    pub fn bytes(&self) -> u64 {
        self.numel() * self.dtype.size() as u64
    }

    /// FP8 block scales are storage overhead, not parameters.
    pub fn is_scale(&self) -> bool {
        self.name.ends_with(".weight_scale_inv")
    }
}

struct Planner {
    linear: LinearFormat,
    layer: Option<usize>,
    part: Part,
    out: Vec<TensorPlan>,
}

/// A SwiGLU MLP's tensor names under its prefix: gate, up, down.
const HF_MLP: [&str; 3] = ["gate_proj", "up_proj", "down_proj"];
/// Mixtral's experts: `w1` the gate, `w3` the up and `w2` the down projection.
const MIXTRAL_EXPERT: [&str; 3] = ["w1", "w3", "w2"];

impl Planner {
    fn push(&mut self, name: String, dtype: Dtype, shape: &[usize], init: Init) {
        self.out.push(TensorPlan { name, dtype, shape: shape.to_vec(), layer: self.layer, part: self.part, init });
    }

    /// A linear layer's `[rows, cols]` weight of standard deviation
    /// `1/sqrt(cols)`, in the checkpoint's format: BF16, or FP8 with its
    /// inverse block scales (partial blocks at the edges when a dimension is
    /// not a multiple of the block).
    fn linear(&mut self, prefix: &str, rows: usize, cols: usize) {
        let std = 1.0 / (cols as f32).sqrt();
        match self.linear {
            LinearFormat::Bf16 => self.bf16(format!("{prefix}.weight"), rows, cols, std),
            LinearFormat::Fp8 { block, scale } => {
                self.push(format!("{prefix}.weight"), Dtype::F8E4M3, &[rows, cols], Init::Fp8);
                // Block scales vary ±10% around the value that gives std
                // 1/sqrt(fan_in), so kernels that mix up blocks produce
                // visibly wrong results.
                let mean = 1.0 / ((cols as f32).sqrt() * fp8_code_std());
                let shape = [rows.div_ceil(block[0]), cols.div_ceil(block[1])];
                self.push(format!("{prefix}.weight_scale_inv"), scale, &shape, Init::Normal { mean, std: 0.1 * mean });
            }
        }
    }

    /// A BF16 matrix of standard deviation `std`.
    fn bf16(&mut self, name: String, rows: usize, cols: usize, std: f32) {
        self.push(name, Dtype::Bf16, &[rows, cols], Init::Normal { mean: 0.0, std });
    }

    /// An RMSNorm weight: about 1, as trained norms are.
    fn norm(&mut self, name: String, dim: usize) {
        let part = self.part;
        self.set_part(Part::Norm);
        self.push(name, Dtype::Bf16, &[dim], Init::Normal { mean: 1.0, std: 0.05 });
        self.part = part;
    }

    /// A SwiGLU MLP: `{prefix}.{names}` for gate, up and down.
    fn mlp(&mut self, prefix: &str, names: [&str; 3], hidden: usize, inter: usize) {
        self.linear(&format!("{prefix}.{}", names[0]), inter, hidden);
        self.linear(&format!("{prefix}.{}", names[1]), inter, hidden);
        self.linear(&format!("{prefix}.{}", names[2]), hidden, inter);
    }

    /// In the engine's part, unless this is an MTP layer.
    fn set_part(&mut self, part: Part) {
        if self.part != Part::Mtp {
            self.part = part;
        }
    }

    /// Decoder layer `l`, with exactly the names and shapes `Model::load_layer`
    /// reads for the config's family.
    fn decoder_layer(&mut self, cfg: &ModelConfig, l: usize) {
        let (d, h) = (cfg.hidden_size, cfg.num_attention_heads);
        let p = format!("model.layers.{l}");
        let a = format!("{p}.self_attn");
        self.norm(format!("{p}.input_layernorm.weight"), d);
        self.set_part(Part::Attention);
        match &cfg.attention {
            AttentionConfig::Mla(mla) => {
                match mla.q_lora_rank {
                    Some(r) => {
                        self.linear(&format!("{a}.q_a_proj"), r, d);
                        self.norm(format!("{a}.q_a_layernorm.weight"), r);
                        self.linear(&format!("{a}.q_b_proj"), h * cfg.qk_head_dim(), r);
                    }
                    None => self.linear(&format!("{a}.q_proj"), h * cfg.qk_head_dim(), d),
                }
                self.linear(&format!("{a}.kv_a_proj_with_mqa"), cfg.kv_entry_dim(), d);
                self.norm(format!("{a}.kv_a_layernorm.weight"), mla.kv_lora_rank);
                self.linear(&format!("{a}.kv_b_proj"), h * (mla.qk_nope_head_dim + mla.v_head_dim), mla.kv_lora_rank);
                self.linear(&format!("{a}.o_proj"), d, h * mla.v_head_dim);
            }
            AttentionConfig::Gqa(g) => {
                let kv = g.num_key_value_heads * g.head_dim;
                self.linear(&format!("{a}.q_proj"), h * g.head_dim, d);
                self.linear(&format!("{a}.k_proj"), kv, d);
                self.linear(&format!("{a}.v_proj"), kv, d);
                if g.qk_norm {
                    self.norm(format!("{a}.q_norm.weight"), g.head_dim);
                    self.norm(format!("{a}.k_norm.weight"), g.head_dim);
                }
                self.linear(&format!("{a}.o_proj"), d, h * g.head_dim);
            }
        }
        self.norm(format!("{p}.post_attention_layernorm.weight"), d);
        // DeepSeek-V3's MTP layers (after the decoder layers, which is all
        // `is_moe_layer` knows of) are MoE layers.
        let moe = if l < cfg.num_hidden_layers { cfg.is_moe_layer(l) } else { cfg.n_routed_experts > 0 };
        if !moe {
            self.set_part(Part::DenseMlp);
            self.mlp(&format!("{p}.mlp"), HF_MLP, d, cfg.intermediate_size);
            return;
        }
        let (m, expert_names) = match cfg.architecture {
            Architecture::Mixtral => (format!("{p}.block_sparse_moe"), MIXTRAL_EXPERT),
            Architecture::DeepseekV3 | Architecture::Qwen3Moe => (format!("{p}.mlp"), HF_MLP),
        };
        let e = cfg.n_routed_experts;
        self.set_part(Part::Router);
        // Router logits of std 1: scores spread over (0, 1). Routers stay
        // BF16 in every family's FP8 release.
        self.bf16(format!("{m}.gate.weight"), e, d, 1.0 / (d as f32).sqrt());
        if cfg.use_correction_bias {
            self.push(format!("{m}.gate.e_score_correction_bias"), Dtype::F32, &[e], Init::Normal { mean: 0.0, std: 0.02 });
        }
        for i in 0..e {
            self.set_part(Part::RoutedExpert(i));
            self.mlp(&format!("{m}.experts.{i}"), expert_names, d, cfg.moe_intermediate_size);
        }
        if cfg.n_shared_experts > 0 {
            self.set_part(Part::SharedExperts);
            self.mlp(&format!("{m}.shared_experts"), HF_MLP, d, cfg.moe_intermediate_size * cfg.n_shared_experts);
        }
    }
}

/// Every tensor of the checkpoint, in writing order: embedding, decoder
/// layers, final norm, LM head, then MTP layers.
pub fn plan(cfg: &SynthConfig) -> Vec<TensorPlan> {
    let m = &cfg.model;
    let (d, v) = (m.hidden_size, m.vocab_size);
    let mut p = Planner { linear: cfg.linear, layer: None, part: Part::Embedding, out: vec![] };
    // Embeddings of std 1, as in trained DeepSeek-V3.
    p.bf16("model.embed_tokens.weight".into(), v, d, 1.0);
    for l in 0..m.num_hidden_layers {
        p.layer = Some(l);
        p.part = Part::Norm;
        p.decoder_layer(m, l);
    }
    p.layer = None;
    p.norm("model.norm.weight".into(), d);
    if !m.tie_word_embeddings {
        p.part = Part::LmHead;
        // Logits of std about 1 after the final norm: neither flat nor one-hot.
        p.bf16("lm_head.weight".into(), v, d, 1.0 / (d as f32).sqrt());
    }
    // DeepSeek-V3's MTP module: a full decoder layer plus its own embedding,
    // projections and head, all in BF16 apart from the layer's linears.
    for j in 0..cfg.mtp_layers {
        let l = m.num_hidden_layers + j;
        let pre = format!("model.layers.{l}");
        p.layer = Some(l);
        p.part = Part::Mtp;
        p.bf16(format!("{pre}.embed_tokens.weight"), v, d, 1.0);
        p.norm(format!("{pre}.enorm.weight"), d);
        p.norm(format!("{pre}.hnorm.weight"), d);
        p.bf16(format!("{pre}.eh_proj.weight"), d, 2 * d, 1.0 / ((2 * d) as f32).sqrt());
        p.decoder_layer(m, l);
        p.norm(format!("{pre}.shared_head.norm.weight"), d);
        p.bf16(format!("{pre}.shared_head.head.weight"), v, d, 1.0 / (d as f32).sqrt());
    }
    p.out
}

/// What one decode step reads of `t`, in bytes and parameters: everything
/// outside MTP, except one embedding row and `num_experts_per_tok` of the
/// routed experts (all experts have the same size, so the first k stand in
/// for whichever k are routed). Bytes are counted as the engine holds the
/// tensor, which is what it reads: matrices as stored, but vectors (norms,
/// biases) and FP8 block scales converted to F32 at load. The figure then
/// equals `Model::activated_bytes_per_token`, the roofline's denominator.
fn activated(cfg: &ModelConfig, t: &TensorPlan) -> (u64, u64) {
    let params = if t.is_scale() { 0 } else { t.numel() };
    let bytes = if t.is_scale() || t.shape.len() == 1 { t.numel() * 4 } else { t.bytes() };
    match t.part {
        Part::Mtp => (0, 0),
        Part::RoutedExpert(e) if e >= cfg.num_experts_per_tok => (0, 0),
        Part::Embedding => {
            let rows = cfg.vocab_size as u64;
            // A tied embedding is also read whole as the LM head.
            let whole = if cfg.tie_word_embeddings { (bytes, params) } else { (0, 0) };
            (bytes / rows + whole.0, params / rows + whole.1)
        }
        _ => (bytes, params),
    }
}

/// Bytes one decode step reads: every non-expert weight a token uses (one
/// embedding row, the whole LM head), the shared experts and
/// `num_experts_per_tok` routed experts per MoE layer, with FP8 scales.
pub fn activated_bytes_per_token(cfg: &SynthConfig) -> u64 {
    plan(cfg).iter().map(|t| activated(&cfg.model, t).0).sum()
}

/// Bytes of one kind of layer (or of the tensors outside layers).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct LayerKind {
    pub kind: &'static str,
    pub count: usize,
    pub bytes: u64,
}

/// Byte and parameter counts of a plan.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct PlanSummary {
    pub tensors: usize,
    /// Tensor bytes of the whole checkpoint (MTP included, headers excluded).
    pub total_bytes: u64,
    /// Parameters outside MTP (FP8 scales are not parameters).
    pub params: u64,
    pub mtp_params: u64,
    pub bytes_by_dtype: BTreeMap<&'static str, u64>,
    pub bytes_by_part: BTreeMap<&'static str, u64>,
    /// `dense`, `moe`, `mtp` layers and `other` (embedding, final norm, LM head).
    pub layer_kinds: Vec<LayerKind>,
    pub activated_bytes_per_token: u64,
    pub activated_params_per_token: u64,
}

pub fn summarize(cfg: &SynthConfig, plan: &[TensorPlan]) -> PlanSummary {
    let m = &cfg.model;
    let mut s = PlanSummary {
        tensors: plan.len(),
        total_bytes: 0,
        params: 0,
        mtp_params: 0,
        bytes_by_dtype: BTreeMap::new(),
        bytes_by_part: BTreeMap::new(),
        layer_kinds: vec![],
        activated_bytes_per_token: 0,
        activated_params_per_token: 0,
    };
    let kinds = ["dense", "moe", "mtp", "other"];
    let mut kind_bytes = [0u64; 4];
    for t in plan {
        let bytes = t.bytes();
        s.total_bytes += bytes;
        let params = if t.is_scale() { 0 } else { t.numel() };
        if t.part == Part::Mtp {
            s.mtp_params += params;
        } else {
            s.params += params;
        }
        *s.bytes_by_dtype.entry(t.dtype.name()).or_default() += bytes;
        *s.bytes_by_part.entry(t.part.label()).or_default() += bytes;
        let kind = match t.layer {
            None => 3,
            Some(l) if l >= m.num_hidden_layers => 2,
            Some(l) if m.is_moe_layer(l) => 1,
            Some(_) => 0,
        };
        kind_bytes[kind] += bytes;
        let (ab, ap) = activated(m, t);
        s.activated_bytes_per_token += ab;
        s.activated_params_per_token += ap;
    }
    let moe = (0..m.num_hidden_layers).filter(|&l| m.is_moe_layer(l)).count();
    let counts = [m.num_hidden_layers - moe, moe, cfg.mtp_layers, 1];
    s.layer_kinds =
        (0..4).filter(|&i| counts[i] > 0).map(|i| LayerKind { kind: kinds[i], count: counts[i], bytes: kind_bytes[i] }).collect();
    s
}

/// `688.59 GB`: decimal units, as disk sizes are quoted.
pub fn human_bytes(n: u64) -> String {
    match [("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)].iter().find(|(_, f)| n as f64 >= *f) {
        Some((p, f)) => format!("{:.2} {p}B", n as f64 / f),
        None => format!("{n} B"),
    }
}

/// `671.03B`, as parameter counts are quoted.
fn human_count(n: u64) -> String {
    match [("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)].iter().find(|(_, f)| n as f64 >= *f) {
        Some((p, f)) => format!("{:.2}{p}", n as f64 / f),
        None => n.to_string(),
    }
}

impl fmt::Display for PlanSummary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "{} tensors, {} ({} parameters{})",
            self.tensors,
            human_bytes(self.total_bytes),
            human_count(self.params),
            if self.mtp_params > 0 { format!(" + {} in MTP", human_count(self.mtp_params)) } else { String::new() },
        )?;
        writeln!(f, "by dtype:")?;
        for (k, v) in &self.bytes_by_dtype {
            writeln!(f, "  {k:<16} {:>12}", human_bytes(*v))?;
        }
        writeln!(f, "by part:")?;
        for (k, v) in &self.bytes_by_part {
            writeln!(f, "  {k:<16} {:>12}", human_bytes(*v))?;
        }
        writeln!(f, "by layer kind:")?;
        for k in &self.layer_kinds {
            let each = if k.kind == "other" { String::new() } else { format!("  ({} each)", human_bytes(k.bytes / k.count as u64)) };
            writeln!(f, "  {:<8} x{:<4}   {:>12}{each}", k.kind, k.count, human_bytes(k.bytes))?;
        }
        write!(
            f,
            "activated per decode token: {} ({} parameters)",
            human_bytes(self.activated_bytes_per_token),
            human_count(self.activated_params_per_token)
        )
    }
}

// ---------------------------------------------------------------------------
// Values.

/// Standard normal quantiles at the centres of 256 equal-probability bins,
/// rescaled to unit variance. A random byte indexing this table is an
/// (approximately) normal draw at the cost of one table lookup.
fn normal_quantiles() -> &'static [f32; 256] {
    static TABLE: OnceLock<[f32; 256]> = OnceLock::new();
    TABLE.get_or_init(|| {
        let mut q = [0.0f32; 256];
        for (i, x) in q.iter_mut().enumerate() {
            *x = inverse_normal_cdf((i as f64 + 0.5) / 256.0) as f32;
        }
        let std = (q.iter().map(|x| x * x).sum::<f32>() / 256.0).sqrt();
        q.map(|x| x / std)
    })
}

/// Acklam's rational approximation of the standard normal quantile
/// (relative error below 1.2e-9), for `p` in (0, 1).
fn inverse_normal_cdf(p: f64) -> f64 {
    const A: [f64; 6] =
        [-3.969683028665376e1, 2.209460984245205e2, -2.759285104469687e2, 1.38357751867269e2, -3.066479806614716e1, 2.506628277459239];
    const B: [f64; 5] = [-5.447609879822406e1, 1.615858368580409e2, -1.556989798598866e2, 6.680131188771972e1, -1.328068155288572e1];
    const C: [f64; 6] =
        [-7.784894002430293e-3, -3.223964580411365e-1, -2.400758277161838, -2.549732539343734, 4.374664141464968, 2.938163982698783];
    const D: [f64; 4] = [7.784695709041462e-3, 3.224671290700398e-1, 2.445134137142996, 3.754408661907416];
    let tail = |q: f64| {
        (((((C[0] * q + C[1]) * q + C[2]) * q + C[3]) * q + C[4]) * q + C[5]) / ((((D[0] * q + D[1]) * q + D[2]) * q + D[3]) * q + 1.0)
    };
    if p < 0.02425 {
        tail((-2.0 * p.ln()).sqrt())
    } else if p > 1.0 - 0.02425 {
        -tail((-2.0 * (1.0 - p).ln()).sqrt())
    } else {
        let q = p - 0.5;
        let r = q * q;
        (((((A[0] * r + A[1]) * r + A[2]) * r + A[3]) * r + A[4]) * r + A[5]) * q
            / (((((B[0] * r + B[1]) * r + B[2]) * r + B[3]) * r + B[4]) * r + 1.0)
    }
}

/// The E4M3 code nearest to `x` (finite codes only).
fn nearest_e4m3(x: f32) -> u8 {
    let mag = (0u8..=0x7e).min_by(|&a, &b| (E4M3_TABLE[a as usize] - x.abs()).abs().total_cmp(&(E4M3_TABLE[b as usize] - x.abs()).abs()));
    let code = mag.expect("non-empty range");
    // Setting the sign bit keeps the table exactly symmetric (mean zero).
    if x < 0.0 {
        code | 0x80
    } else {
        code
    }
}

/// Byte → FP8 code: the normal quantiles times [`FP8_SPREAD`], quantised to
/// the nearest code, with the resulting standard deviation of the codes.
fn fp8_codes() -> &'static ([u8; 256], f32) {
    static TABLE: OnceLock<([u8; 256], f32)> = OnceLock::new();
    TABLE.get_or_init(|| {
        let codes = normal_quantiles().map(|q| nearest_e4m3(q * FP8_SPREAD));
        let var = codes.iter().map(|&c| E4M3_TABLE[c as usize].powi(2)).sum::<f32>() / 256.0;
        (codes, var.sqrt())
    })
}

/// Standard deviation of the FP8 codes written for [`Init::Fp8`] weights,
/// before scaling.
pub fn fp8_code_std() -> f32 {
    fp8_codes().1
}

/// 64-bit FNV-1a: a stable hash (unlike std's) to derive per-tensor streams.
fn fnv1a(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| (h ^ b as u64).wrapping_mul(0x0100_0000_01b3))
}

/// Produces one tensor's bytes: one random byte per element, mapped through
/// a 256-entry table of encoded values. ChaCha8 is fast, value-stable across
/// platforms and versions, and gives each tensor its own stream.
struct Generator {
    rng: ChaCha8Rng,
    /// Little-endian encoded values, `elem` bytes each.
    table: Vec<u8>,
    elem: usize,
}

impl Generator {
    fn new(t: &TensorPlan, seed: u64) -> Self {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        rng.set_stream(fnv1a(&t.name));
        let q = normal_quantiles();
        let table: Vec<u8> = match (t.init, t.dtype) {
            (Init::Fp8, _) => fp8_codes().0.to_vec(),
            (Init::Normal { mean, std }, Dtype::Bf16) => {
                q.iter().flat_map(|&x| half::bf16::from_f32(mean + std * x).to_le_bytes()).collect()
            }
            (Init::Normal { mean, std }, Dtype::F32) => q.iter().flat_map(|&x| (mean + std * x).to_le_bytes()).collect(),
            (Init::Normal { mean, std }, Dtype::F8E4M3) => q.iter().map(|&x| nearest_e4m3(mean + std * x)).collect(),
        };
        Generator { rng, elem: t.dtype.size(), table }
    }

    /// Fill `out` (a whole number of elements) with the next elements;
    /// `scratch` holds the random bytes and is at least `out.len()` long.
    fn fill(&mut self, out: &mut [u8], scratch: &mut [u8]) {
        if self.elem == 1 {
            // FP8: map the random bytes in place, no scratch needed.
            self.rng.fill_bytes(out);
            let table: &[u8; 256] = self.table.as_slice().try_into().expect("256 one-byte entries");
            out.iter_mut().for_each(|b| *b = table[*b as usize]);
            return;
        }
        let idx = &mut scratch[..out.len() / self.elem];
        self.rng.fill_bytes(idx);
        for (o, &i) in out.chunks_exact_mut(self.elem).zip(idx.iter()) {
            let i = i as usize * self.elem;
            o.copy_from_slice(&self.table[i..i + self.elem]);
        }
    }
}

// ---------------------------------------------------------------------------
// Writing.

#[derive(Clone, Debug)]
pub struct WriteOptions {
    pub seed: u64,
    /// Largest shard in tensor bytes; a bigger tensor gets a shard of its own.
    pub shard_size: u64,
    /// Replace a checkpoint already in the directory.
    pub force: bool,
    /// Refuse a checkpoint bigger than this before writing anything. A
    /// limit on disk space: a hollow checkpoint, which takes none, ignores it.
    pub max_bytes: Option<u64>,
    /// Write the files, headers and index but no tensor bytes: sparse shards
    /// that read as zeros (see the module docs). For the simulator only.
    pub hollow: bool,
}

impl Default for WriteOptions {
    fn default() -> Self {
        WriteOptions { seed: 0, shard_size: DEFAULT_SHARD_SIZE, force: false, max_bytes: None, hollow: false }
    }
}

#[derive(Clone, Debug)]
pub struct Summary {
    pub dir: PathBuf,
    pub tensors: usize,
    pub shards: usize,
    /// Tensor bytes (`metadata.total_size` of the index).
    pub tensor_bytes: u64,
    /// Bytes of the shard files, headers included.
    pub file_bytes: u64,
    pub elapsed: Duration,
}

impl Summary {
    pub fn mb_per_s(&self) -> f64 {
        self.file_bytes as f64 / 1e6 / self.elapsed.as_secs_f64().max(1e-9)
    }
}

/// `model-00001-of-00007.safetensors`, as Hugging Face names shards.
pub fn shard_name(i: usize, n: usize) -> String {
    format!("model-{:05}-of-{:05}.safetensors", i + 1, n)
}

fn is_weight_file(name: &str) -> bool {
    name == SINGLE_FILE || (name.starts_with("model-") && name.ends_with(".safetensors"))
}

/// Group tensors, in plan order, into shards of at most `max` bytes.
fn assign_shards(plan: &[TensorPlan], max: u64) -> Vec<Vec<&TensorPlan>> {
    let mut shards: Vec<Vec<&TensorPlan>> = vec![vec![]];
    let mut size = 0;
    for t in plan {
        if size > 0 && size + t.bytes() > max {
            shards.push(vec![]);
            size = 0;
        }
        shards.last_mut().expect("at least one shard").push(t);
        size += t.bytes();
    }
    shards
}

/// Write `cfg` as a checkpoint in `dir` (created if needed).
/// `progress(done, total)` is called in tensor bytes as they are written.
pub fn write_checkpoint(
    cfg: &SynthConfig,
    dir: &Path,
    opts: &WriteOptions,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<Summary, SynthError> {
    let start = Instant::now();
    let plan = plan(cfg);
    let total: u64 = plan.iter().map(TensorPlan::bytes).sum();
    if opts.shard_size == 0 {
        return Err(SynthError::BadOption("the shard size must be positive".into()));
    }
    if let Some(limit) = opts.max_bytes.filter(|&l| total > l && !opts.hollow) {
        return Err(SynthError::TooLarge { need: total, limit });
    }
    std::fs::create_dir_all(dir).map_err(io_err(dir))?;
    clear_existing(dir, opts.force)?;

    let mut created = vec![];
    let result = write_files(cfg, dir, &plan, opts, total, progress, &mut created);
    if result.is_err() {
        // Leave no half-written checkpoint behind (best effort: the error
        // that got us here matters more than one from cleaning up).
        for path in &created {
            let _ = std::fs::remove_file(path);
        }
    }
    let (shards, file_bytes) = result?;
    Ok(Summary { dir: dir.to_path_buf(), tensors: plan.len(), shards, tensor_bytes: total, file_bytes, elapsed: start.elapsed() })
}

/// Refuse to overwrite a checkpoint unless `force`; with it, remove the old
/// weight files, so stale shards of a bigger checkpoint do not linger.
fn clear_existing(dir: &Path, force: bool) -> Result<(), SynthError> {
    let mut found = vec![];
    for entry in std::fs::read_dir(dir).map_err(io_err(dir))? {
        let name = entry.map_err(io_err(dir))?.file_name().to_string_lossy().into_owned();
        if name == "config.json" || name == INDEX_FILE || is_weight_file(&name) {
            found.push(name);
        }
    }
    if found.is_empty() {
        return Ok(());
    }
    found.sort();
    if !force {
        let found = if found.len() > 3 { format!("{}, ... ({} files)", found[..3].join(", "), found.len()) } else { found.join(", ") };
        return Err(SynthError::Exists { dir: dir.to_path_buf(), found });
    }
    for name in found.iter().filter(|n| is_weight_file(n)) {
        let path = dir.join(name);
        std::fs::remove_file(&path).map_err(io_err(&path))?;
    }
    Ok(())
}

/// Write every file, recording each in `created` before creating it.
/// Returns the number of shards and their total size.
fn write_files(
    cfg: &SynthConfig,
    dir: &Path,
    plan: &[TensorPlan],
    opts: &WriteOptions,
    total: u64,
    progress: &mut dyn FnMut(u64, u64),
    created: &mut Vec<PathBuf>,
) -> Result<(usize, u64), SynthError> {
    let shards = assign_shards(plan, opts.shard_size);
    let mut weight_map = serde_json::Map::new();
    let mut done = 0;
    let mut file_bytes = 0;
    let mut buf = vec![0u8; CHUNK];
    let mut scratch = vec![0u8; CHUNK];
    progress(0, total);
    for (i, tensors) in shards.iter().enumerate() {
        let name = shard_name(i, shards.len());
        let path = dir.join(&name);
        created.push(path.clone());
        let mut write_tensor_bytes = |w: &mut BufWriter<File>, t: &TensorPlan| -> std::io::Result<()> {
            if opts.hollow {
                // Nothing to write: `write_shard` extends the file over the
                // tensor, which then reads as zeros.
                done += t.bytes();
                progress(done, total);
                return Ok(());
            }
            let mut gen = Generator::new(t, opts.seed);
            let mut left = t.bytes();
            while left > 0 {
                let n = left.min(CHUNK as u64) as usize;
                gen.fill(&mut buf[..n], &mut scratch);
                w.write_all(&buf[..n])?;
                left -= n as u64;
                done += n as u64;
                progress(done, total);
            }
            Ok(())
        };
        file_bytes += write_shard(&path, tensors, &mut write_tensor_bytes).map_err(io_err(&path))?;
        for t in tensors {
            weight_map.insert(t.name.clone(), name.clone().into());
        }
    }

    // The JSON files come last: a directory whose writing was interrupted
    // has no index or config, so nothing mistakes it for a checkpoint.
    let index = json!({"metadata": {"total_size": total}, "weight_map": weight_map});
    let mut generation = json!({"do_sample": true, "temperature": 0.6, "top_p": 0.95});
    for key in ["bos_token_id", "eos_token_id"] {
        if let Some(v) = cfg.json.get(key).filter(|v| !v.is_null()) {
            generation[key] = v.clone();
        }
    }
    let pretty = |v: &Value| serde_json::to_vec_pretty(v).expect("JSON values serialise");
    let tok = tokenizer(cfg.model.architecture);
    let files: [(&str, Vec<u8>); 5] = [
        (INDEX_FILE, pretty(&index)),
        ("generation_config.json", pretty(&generation)),
        ("tokenizer.json", tok.json.to_vec()),
        ("tokenizer_config.json", tok.config.to_vec()),
        ("config.json", pretty(&cfg.json)),
    ];
    for (name, bytes) in files {
        let path = dir.join(name);
        created.push(path.clone());
        std::fs::write(&path, bytes).map_err(io_err(&path))?;
    }
    Ok((shards.len(), file_bytes))
}

/// Write one safetensors file: header from the shapes, then each tensor's
/// bytes from `write_tensor`, and set the file's length to the end of the
/// last tensor (a no-op when every byte was written; a sparse tail over the
/// tensors `write_tensor` skipped, for a hollow checkpoint). Returns the
/// file size.
fn write_shard(
    path: &Path,
    tensors: &[&TensorPlan],
    write_tensor: &mut dyn FnMut(&mut BufWriter<File>, &TensorPlan) -> std::io::Result<()>,
) -> std::io::Result<u64> {
    // Widest dtype first, as safetensors' own writer orders them: with the
    // header padded to 8 bytes every tensor starts aligned to its element.
    let mut order = tensors.to_vec();
    order.sort_by_key(|t| std::cmp::Reverse(t.dtype.size()));
    let mut header = serde_json::Map::new();
    header.insert("__metadata__".into(), json!({"format": "pt"}));
    let mut offset = 0u64;
    for t in &order {
        let end = offset + t.bytes();
        header.insert(t.name.clone(), json!({"dtype": t.dtype.name(), "shape": t.shape, "data_offsets": [offset, end]}));
        offset = end;
    }
    let mut text = Value::Object(header).to_string();
    text.extend(std::iter::repeat_n(' ', text.len().next_multiple_of(8) - text.len()));
    let mut w = BufWriter::with_capacity(CHUNK, File::create(path)?);
    w.write_all(&(text.len() as u64).to_le_bytes())?;
    w.write_all(text.as_bytes())?;
    for t in order {
        write_tensor(&mut w, t)?;
    }
    let size = 8 + text.len() as u64 + offset;
    w.into_inner().map_err(|e| e.into_error())?.set_len(size)?;
    Ok(size)
}

/// Parse a size such as `1073741824`, `512M` or `1G` (binary units: K, M,
/// G, T, with an optional `iB` or `B`).
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let t = t.strip_suffix("iB").or_else(|| t.strip_suffix('B')).unwrap_or(t);
    let (digits, shift) = match t.char_indices().last() {
        Some((i, c)) if c.is_ascii_alphabetic() => {
            let shift = match c.to_ascii_uppercase() {
                'K' => 10,
                'M' => 20,
                'G' => 30,
                'T' => 40,
                _ => return Err(format!("{s:?}: unknown unit {c:?}; use K, M, G or T")),
            };
            (&t[..i], shift)
        }
        _ => (t, 0),
    };
    let n: u64 = digits.trim().parse().map_err(|_| format!("{s:?} is not a size like 512M or 2G"))?;
    n.checked_mul(1 << shift).filter(|&n| n > 0).ok_or_else(|| format!("{s:?} must be positive and below 16 EiB"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use duplex_model::checkpoint::Checkpoint;
    use duplex_model::generation::{Engine, GenerationParams};
    use duplex_model::{BlockTable, Logits, Model, Precision};
    use std::collections::BTreeSet;

    const FIXTURE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/fixtures/tiny-dsv3");

    /// (name → (dtype, shape)) of every tensor in a checkpoint's shards, plus
    /// the shard files' sizes minus their headers.
    fn read_headers(dir: &Path) -> (BTreeMap<String, (String, Vec<usize>)>, u64) {
        let index: Value = serde_json::from_slice(&std::fs::read(dir.join(INDEX_FILE)).unwrap()).unwrap();
        let files: BTreeSet<&str> = index["weight_map"].as_object().unwrap().values().map(|v| v.as_str().unwrap()).collect();
        let mut out = BTreeMap::new();
        let mut data_bytes = 0;
        for f in files {
            let bytes = std::fs::read(dir.join(f)).unwrap();
            let (n, meta) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
            data_bytes += (bytes.len() - 8 - n) as u64;
            for (name, info) in meta.tensors() {
                assert_eq!(index["weight_map"][&name], f, "{name} is in {f}");
                out.insert(name, (format!("{:?}", info.dtype), info.shape.clone()));
            }
        }
        (out, data_bytes)
    }

    fn tiny() -> SynthConfig {
        preset("tiny").unwrap()
    }

    fn write(cfg: &SynthConfig, dir: &Path, seed: u64, shard_size: u64) -> Summary {
        let opts = WriteOptions { seed, shard_size, ..WriteOptions::default() };
        write_checkpoint(cfg, dir, &opts, &mut |_, _| {}).unwrap()
    }

    fn planned(cfg: &SynthConfig) -> BTreeMap<String, (String, Vec<usize>)> {
        plan(cfg).into_iter().map(|t| (t.name, (t.dtype.name().to_string(), t.shape))).collect()
    }

    /// Each family's plan is exactly the tensors (names, dtypes, shapes) of
    /// its bundled fixture, which is the Hugging Face release's layout.
    #[test]
    fn tiny_plans_match_the_fixture_layouts() {
        for (name, fixture) in [("tiny", "tiny-dsv3"), ("tiny-qwen3moe", "tiny-qwen3moe"), ("tiny-mixtral", "tiny-mixtral")] {
            let (headers, _) = read_headers(&Path::new(FIXTURE).join("..").join(fixture));
            assert_eq!(planned(&preset(name).unwrap()), headers, "{name}");
        }
    }

    #[test]
    fn fp8_table_is_symmetric_finite_and_moderate() {
        let (codes, std) = fp8_codes();
        for i in 0..256 {
            let v = E4M3_TABLE[codes[i] as usize];
            assert!(v.is_finite() && v.abs() < 256.0);
            assert_eq!(v, -E4M3_TABLE[codes[255 - i] as usize]);
        }
        assert!((std / FP8_SPREAD - 1.0).abs() < 0.05, "{std}");
        assert!((inverse_normal_cdf(0.975) - 1.959964).abs() < 1e-6);
        assert!((inverse_normal_cdf(0.001) + 3.090232).abs() < 1e-5);
    }

    #[test]
    fn presets_validate_and_have_the_intended_sizes() {
        assert!(matches!(preset("nope"), Err(SynthError::UnknownPreset { .. })));
        for name in PRESETS {
            let cfg = preset(name).unwrap_or_else(|e| panic!("{name}: {e}"));
            let s = summarize(&cfg, &plan(&cfg));
            assert_eq!(s.activated_bytes_per_token, activated_bytes_per_token(&cfg), "{name}");
            assert_eq!(s.bytes_by_part.values().sum::<u64>(), s.total_bytes, "{name}");
        }
        let bench = preset("bench").unwrap();
        let s = summarize(&bench, &plan(&bench));
        assert!((5.0e9..6.0e9).contains(&(s.total_bytes as f64)), "{}", s.total_bytes);
        assert_eq!(s.mtp_params, 0);

        let v3 = preset("deepseek-v3").unwrap();
        let s = summarize(&v3, &plan(&v3));
        // DeepSeek-V3: 671B parameters plus a 14B MTP module, 37B activated.
        assert!((s.params as f64 / 671e9 - 1.0).abs() < 0.01, "{}", s.params);
        assert!((s.mtp_params as f64 / 14e9 - 1.0).abs() < 0.15, "{}", s.mtp_params);
        assert!((36e9..39e9).contains(&(s.activated_params_per_token as f64)), "{}", s.activated_params_per_token);
        assert!((37e9..40e9).contains(&(s.activated_bytes_per_token as f64)), "{}", s.activated_bytes_per_token);
        let kinds: Vec<_> = s.layer_kinds.iter().map(|k| (k.kind, k.count)).collect();
        assert_eq!(kinds, [("dense", 3), ("moe", 58), ("mtp", 1), ("other", 1)]);
        assert_eq!(s.layer_kinds.iter().map(|k| k.bytes).sum::<u64>(), s.total_bytes);
        assert_eq!(s.bytes_by_part.values().sum::<u64>(), s.total_bytes);
        assert!(s.to_string().contains("activated per decode token"));
    }

    /// `name` with `edits` applied: the scaled presets with their real depth,
    /// expert count and vocabulary restored.
    fn unscaled(name: &str, edits: Value) -> SynthConfig {
        let mut json = preset(name).unwrap().json;
        for (k, v) in edits.as_object().unwrap() {
            json[k] = v.clone();
        }
        SynthConfig::from_json(json, name).unwrap()
    }

    /// One decoder layer's activated bytes, less its router (whose rows are
    /// the experts, so it shrinks with them).
    fn layer_activated(cfg: &SynthConfig, l: usize) -> u64 {
        plan(cfg).iter().filter(|t| t.layer == Some(l) && t.part != Part::Router).map(|t| activated(&cfg.model, t).0).sum()
    }

    #[test]
    fn qwen3_presets_have_the_real_shapes() {
        let cfg = preset("qwen3-30b-a3b").unwrap();
        assert_eq!(cfg.linear, LinearFormat::Bf16);
        assert!(cfg.json.get("quantization_config").is_none());
        let t = planned(&cfg);
        let bf16 = |shape: &[usize]| ("BF16".to_string(), shape.to_vec());
        assert_eq!(t["model.layers.11.self_attn.q_proj.weight"], bf16(&[4096, 2048]));
        assert_eq!(t["model.layers.11.self_attn.k_proj.weight"], bf16(&[512, 2048]));
        assert_eq!(t["model.layers.11.self_attn.o_proj.weight"], bf16(&[2048, 4096]));
        assert_eq!(t["model.layers.11.self_attn.k_norm.weight"], bf16(&[128]));
        assert_eq!(t["model.layers.0.mlp.gate.weight"], bf16(&[32, 2048]));
        assert_eq!(t["model.layers.0.mlp.experts.31.down_proj.weight"], bf16(&[2048, 768]));
        assert!(!t.contains_key("model.layers.0.mlp.gate_proj.weight"), "every layer is MoE");
        let s = summarize(&cfg, &plan(&cfg));
        assert!((4.0e9..5.0e9).contains(&(s.total_bytes as f64)), "{}", s.total_bytes);

        // With its 48 layers, 128 experts and 151936 tokens restored, the
        // plan is Qwen3-30B-A3B: 30.5B parameters, 3.3B activated (3.0B
        // counting one embedding row rather than the whole table), and a
        // scaled layer reads what a real one does.
        let real = unscaled("qwen3-30b-a3b", json!({"num_hidden_layers": 48, "num_experts": 128, "vocab_size": 151936}));
        let r = summarize(&real, &plan(&real));
        assert!((r.params as f64 / 30.5e9 - 1.0).abs() < 0.01, "{}", r.params);
        assert!((3.0e9..3.1e9).contains(&(r.activated_params_per_token as f64)), "{}", r.activated_params_per_token);
        assert_eq!(layer_activated(&cfg, 5), layer_activated(&real, 5));
        // The LM head's share of a decode step is the real model's.
        let share = |s: &PlanSummary| s.bytes_by_part["lm_head"] as f64 / s.activated_bytes_per_token as f64;
        assert!((share(&s) / share(&r) - 1.0).abs() < 0.01, "{} vs {}", share(&s), share(&r));

        let fp8 = preset("qwen3-30b-a3b-fp8").unwrap();
        assert_eq!(fp8.linear, LinearFormat::Fp8 { block: [128, 128], scale: Dtype::Bf16 });
        let q = &fp8.json["quantization_config"];
        assert_eq!((q["quant_method"].as_str(), q["fmt"].as_str(), q["activation_scheme"].as_str()), (Some("fp8"), Some("e4m3"), Some("dynamic")));
        let keep = q["modules_to_not_convert"].as_array().unwrap();
        assert_eq!(keep.len(), 13);
        assert!(keep.contains(&json!("lm_head")) && keep.contains(&json!("model.layers.11.mlp.gate")));
        let t = planned(&fp8);
        assert_eq!(t["model.layers.3.mlp.experts.7.gate_proj.weight"], ("F8_E4M3".to_string(), vec![768, 2048]));
        assert_eq!(t["model.layers.3.mlp.experts.7.gate_proj.weight_scale_inv"], bf16(&[6, 16]));
        assert_eq!(t["model.layers.3.self_attn.k_proj.weight_scale_inv"], bf16(&[4, 16]));
        assert_eq!(t["model.layers.3.mlp.gate.weight"], bf16(&[32, 2048]));
        assert_eq!(t["model.layers.3.self_attn.q_norm.weight"], bf16(&[128]));
        assert_eq!(t["lm_head.weight"], bf16(&[37984, 2048]));
        // The tiny FP8 variant leaves the dense layer 0 (no router) out.
        let tiny = preset("tiny-qwen3moe-fp8").unwrap();
        let keep = tiny.json["quantization_config"]["modules_to_not_convert"].as_array().unwrap().clone();
        assert_eq!(keep, [json!("lm_head"), json!("model.layers.1.mlp.gate"), json!("model.layers.2.mlp.gate"), json!("model.layers.3.mlp.gate")]);
    }

    #[test]
    fn mixtral_preset_has_the_real_shapes() {
        let cfg = preset("mixtral-8x7b").unwrap();
        let t = planned(&cfg);
        let bf16 = |shape: &[usize]| ("BF16".to_string(), shape.to_vec());
        assert_eq!(t["model.layers.3.self_attn.q_proj.weight"], bf16(&[4096, 4096]));
        assert_eq!(t["model.layers.3.self_attn.v_proj.weight"], bf16(&[1024, 4096]));
        assert_eq!(t["model.layers.3.block_sparse_moe.gate.weight"], bf16(&[4, 4096]));
        assert_eq!(t["model.layers.3.block_sparse_moe.experts.3.w1.weight"], bf16(&[14336, 4096]));
        assert_eq!(t["model.layers.3.block_sparse_moe.experts.3.w2.weight"], bf16(&[4096, 14336]));
        assert!(!t.keys().any(|k| k.contains("q_norm") || k.contains(".mlp.")));
        let s = summarize(&cfg, &plan(&cfg));
        assert!((5.5e9..6.5e9).contains(&(s.total_bytes as f64)), "{}", s.total_bytes);
        // Restored: Mixtral-8x7B's 46.7B parameters, 12.9B activated (12.75B
        // with one embedding row).
        let real = unscaled("mixtral-8x7b", json!({"num_hidden_layers": 32, "num_local_experts": 8, "vocab_size": 32000}));
        let r = summarize(&real, &plan(&real));
        assert!((r.params as f64 / 46.7e9 - 1.0).abs() < 0.01, "{}", r.params);
        assert!((12.7e9..12.8e9).contains(&(r.activated_params_per_token as f64)), "{}", r.activated_params_per_token);
        assert_eq!(layer_activated(&cfg, 2), layer_activated(&real, 2));
        let share = |s: &PlanSummary| s.bytes_by_part["lm_head"] as f64 / s.activated_bytes_per_token as f64;
        assert!((share(&s) / share(&r) - 1.0).abs() < 0.02, "{} vs {}", share(&s), share(&r));
    }

    #[test]
    fn bad_configs_are_errors() {
        let mut json = tiny().json;
        json["vocab_size"] = 1000.into();
        let err = SynthConfig::from_json(json, "x.json").unwrap_err().to_string();
        assert!(err.contains("vocab_size") && err.contains("2048"), "{err}");
        let err = SynthConfig::from_json(json!([1]), "x.json").unwrap_err().to_string();
        assert!(err.contains("JSON object"), "{err}");
        let mut json = tiny().json;
        json["n_group"] = 3.into();
        assert!(matches!(SynthConfig::from_json(json, "x.json"), Err(SynthError::Config(_))));
    }

    #[test]
    fn tiny_checkpoint_loads_runs_and_generates() {
        let dir = tempfile::tempdir().unwrap();
        // A small shard size exercises sharding and tensors bigger than a shard.
        let s = write(&tiny(), dir.path(), 1, 1 << 20);
        assert!(s.shards > 3);
        let (headers, data_bytes) = read_headers(dir.path());
        assert_eq!(headers.len(), s.tensors);
        assert_eq!(data_bytes, s.tensor_bytes);
        let index: Value = serde_json::from_slice(&std::fs::read(dir.path().join(INDEX_FILE)).unwrap()).unwrap();
        assert_eq!(index["metadata"]["total_size"], s.tensor_bytes);
        let sizes: u64 = (0..s.shards).map(|i| std::fs::metadata(dir.path().join(shard_name(i, s.shards))).unwrap().len()).sum();
        assert_eq!(sizes, s.file_bytes);

        let model = Model::load(dir.path(), &mut |_, _| {}).unwrap();
        assert!(model.skipped_mtp_tensors > 0);
        let tokens = [0, 17, 300, 1999, 5];
        for precision in [Precision::F32, Precision::Bf16] {
            let mut pool = model.new_kv_pool(4, 16);
            let logits = model.forward(&mut pool, &mut BlockTable::default(), &tokens, precision, Logits::All).unwrap();
            assert!(logits.iter().all(|x| x.is_finite()));
            // Not degenerate: logits spread about 1 and vary from token to token.
            let v = model.cfg.vocab_size;
            let std = (logits.iter().map(|x| x * x).sum::<f32>() / logits.len() as f32).sqrt();
            assert!((0.2..20.0).contains(&std), "logit std {std}");
            assert_ne!(logits[..v], logits[v..2 * v]);
        }

        let mut engine = Engine::load(dir.path(), Precision::Bf16, 64, &mut |_, _| {}).unwrap();
        let prompt = engine.tokenizer.encode("Hello world").unwrap();
        let params = GenerationParams { max_tokens: 8, ignore_eos: true, ..GenerationParams::default() };
        let out = engine.generate(&prompt, &params, &mut |_| {}).unwrap();
        assert_eq!(out.tokens.len(), 8);
    }

    /// Logits of `tokens` from a fresh cache.
    fn logits(model: &Model, tokens: &[u32], precision: Precision) -> Vec<f32> {
        let mut pool = model.new_kv_pool(4, 16);
        model.forward(&mut pool, &mut BlockTable::default(), tokens, precision, Logits::All).unwrap()
    }

    /// Every family's tiny checkpoint (Qwen3-MoE also in FP8) loads, runs at
    /// F32 and BF16 with finite, non-degenerate logits and a KV pool of its
    /// attention's shape, generates with its own tokenizer, and the engine's
    /// activated bytes (the roofline's denominator) equal synth's.
    #[test]
    fn every_family_loads_runs_and_counts_the_same_bytes() {
        for name in ["tiny", "tiny-qwen3moe", "tiny-qwen3moe-fp8", "tiny-mixtral"] {
            let dir = tempfile::tempdir().unwrap();
            let cfg = preset(name).unwrap();
            write(&cfg, dir.path(), 7, 1 << 20);
            let model = Model::load(dir.path(), &mut |_, _| {}).unwrap();
            assert_eq!(model.cfg, cfg.model, "{name}");
            assert_eq!(model.activated_bytes_per_token() as u64, activated_bytes_per_token(&cfg), "{name}");
            let kv_dim = match &model.cfg.attention {
                AttentionConfig::Gqa(g) => 2 * g.num_key_value_heads * g.head_dim,
                AttentionConfig::Mla(m) => m.kv_lora_rank + m.qk_rope_head_dim,
            };
            assert_eq!(model.new_kv_pool(4, 16).entry_dim(), kv_dim, "{name}");
            let tokens = [0, 17, 300, 1999, 5];
            for precision in [Precision::F32, Precision::Bf16] {
                let logits = logits(&model, &tokens, precision);
                let v = model.cfg.vocab_size;
                assert_eq!(logits.len(), tokens.len() * v);
                assert!(logits.iter().all(|x| x.is_finite()), "{name} {precision:?}");
                let std = (logits.iter().map(|x| x * x).sum::<f32>() / logits.len() as f32).sqrt();
                assert!((0.2..20.0).contains(&std), "{name} {precision:?}: logit std {std}");
                assert_ne!(logits[..v], logits[v..2 * v], "{name} {precision:?}");
            }
            let mut engine = Engine::load(dir.path(), Precision::Bf16, 64, &mut |_, _| {}).unwrap();
            let prompt = engine.tokenizer.encode("Hello world").unwrap();
            let params = GenerationParams { max_tokens: 4, ignore_eos: true, ..GenerationParams::default() };
            assert_eq!(engine.generate(&prompt, &params, &mut |_| {}).unwrap().tokens.len(), 4, "{name}");
        }
    }

    /// The FP8 Qwen3 checkpoint computes what the same weights dequantised
    /// to F32 compute: the engine reads Qwen's FP8 layout (BF16 block scales,
    /// BF16 routers and norms) as intended.
    #[test]
    fn fp8_qwen3_matches_its_dequantised_copy() {
        let cfg = preset("tiny-qwen3moe-fp8").unwrap();
        let fp8_dir = tempfile::tempdir().unwrap();
        write(&cfg, fp8_dir.path(), 11, DEFAULT_SHARD_SIZE);

        // The copy: every FP8 weight times its block scales as F32, every
        // other tensor as stored, and no quantization_config.
        let ck = Checkpoint::open(fp8_dir.path(), Some([128, 128])).unwrap();
        let mut tensors: Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)> = vec![];
        let mut dequantised = 0;
        for (name, dtype, shape, bytes) in ck.raw_tensors() {
            if name.ends_with(".weight_scale_inv") {
                continue;
            }
            let duplex_model::checkpoint::StoredType::Float(dtype) = dtype else { unreachable!("a safetensors checkpoint") };
            if dtype == safetensors::Dtype::F8_E4M3 {
                let (rows, cols) = (shape[0], shape[1]);
                let w = ck.linear(name.strip_suffix(".weight").unwrap(), rows, cols).unwrap();
                let mut row = vec![0.0f32; cols];
                let mut out = Vec::with_capacity(rows * cols * 4);
                for r in 0..rows {
                    w.view().decode_row(r, &mut row);
                    out.extend(row.iter().flat_map(|x| x.to_le_bytes()));
                }
                tensors.push((name.to_string(), safetensors::Dtype::F32, shape.to_vec(), out));
                dequantised += 1;
            } else {
                tensors.push((name.to_string(), dtype, shape.to_vec(), bytes.to_vec()));
            }
        }
        // Every linear: 4 attention projections in each of 4 layers, layer 0's
        // dense MLP, and 3 per expert of 16 in 3 MoE layers.
        assert_eq!(dequantised, 4 * 4 + 3 + 3 * 16 * 3);
        let f32_dir = tempfile::tempdir().unwrap();
        let views: Vec<(String, safetensors::tensor::TensorView)> = tensors
            .iter()
            .map(|(n, d, s, b)| (n.clone(), safetensors::tensor::TensorView::new(*d, s.clone(), b).unwrap()))
            .collect();
        safetensors::serialize_to_file(views, &None, &f32_dir.path().join(SINGLE_FILE)).unwrap();
        let mut json = cfg.json.clone();
        json.as_object_mut().unwrap().remove("quantization_config");
        std::fs::write(f32_dir.path().join("config.json"), json.to_string()).unwrap();

        let fp8 = Model::load(fp8_dir.path(), &mut |_, _| {}).unwrap();
        let f32 = Model::load(f32_dir.path(), &mut |_, _| {}).unwrap();
        assert!(f32.cfg.quantization.is_none() && fp8.cfg.quantization.is_some());
        let tokens = [2044, 17, 300, 1999, 5, 640, 2045];
        let (a, b) = (logits(&fp8, &tokens, Precision::F32), logits(&f32, &tokens, Precision::F32));
        let scale = b.iter().fold(0.0f32, |m, x| m.max(x.abs()));
        let diff = a.iter().zip(&b).fold(0.0f32, |m, (x, y)| m.max((x - y).abs()));
        assert!(scale > 1.0 && diff < 1e-4 * scale, "max |fp8 - dequantised| {diff}, logits up to {scale}");
    }

    #[test]
    fn dequantised_weights_have_the_intended_scale() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = tiny();
        write(&cfg, dir.path(), 3, DEFAULT_SHARD_SIZE);
        let ck = Checkpoint::open(dir.path(), Some([128, 128])).unwrap();
        // kv_a: 160 rows, a partial edge block of 32.
        for (prefix, rows, cols) in [("model.layers.0.self_attn.kv_a_proj_with_mqa", 160, 256), ("model.layers.0.mlp.down_proj", 256, 512)]
        {
            let w = ck.linear(prefix, rows, cols).unwrap();
            let mut row = vec![0.0; cols];
            let (mut sum, mut sq) = (0.0f64, 0.0f64);
            for r in 0..rows {
                w.view().decode_row(r, &mut row);
                sum += row.iter().map(|&x| x as f64).sum::<f64>();
                sq += row.iter().map(|&x| (x as f64).powi(2)).sum::<f64>();
            }
            let n = (rows * cols) as f64;
            let std = (sq / n - (sum / n).powi(2)).sqrt();
            let want = 1.0 / (cols as f64).sqrt();
            assert!((std / want - 1.0).abs() < 0.05, "{prefix}: std {std}, want {want}");
        }
        let norm = ck.vector("model.norm.weight", &[256]).unwrap();
        assert!(norm.iter().all(|&x| (0.7..1.3).contains(&x)));
        let bias = ck.vector("model.layers.1.mlp.gate.e_score_correction_bias", &[16]).unwrap();
        assert!(bias.iter().all(|&x| x.abs() < 0.1) && bias.iter().any(|&x| x != 0.0));
    }

    #[test]
    fn same_seed_same_bytes_other_seed_other_bytes() {
        let cfg = tiny();
        let dirs: Vec<_> = (0..3).map(|_| tempfile::tempdir().unwrap()).collect();
        for (d, seed) in dirs.iter().zip([5, 5, 6]) {
            write(&cfg, d.path(), seed, 4 << 20);
        }
        let files = |d: &Path| {
            let mut names: Vec<_> = std::fs::read_dir(d).unwrap().map(|e| e.unwrap().file_name()).collect();
            names.sort();
            names.into_iter().map(|n| (n.clone(), std::fs::read(d.join(n)).unwrap())).collect::<Vec<_>>()
        };
        let (a, b, c) = (files(dirs[0].path()), files(dirs[1].path()), files(dirs[2].path()));
        assert_eq!(a, b);
        let differing = a.iter().zip(&c).filter(|(x, y)| x != y).map(|(x, _)| x.0.to_string_lossy().into_owned()).collect::<Vec<_>>();
        // Every shard differs; the JSON and tokenizer files do not.
        assert_eq!(differing.len(), a.iter().filter(|(n, _)| is_weight_file(&n.to_string_lossy())).count(), "{differing:?}");
    }

    #[test]
    fn existing_checkpoints_and_bad_options_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = tiny();
        write(&cfg, dir.path(), 0, 4 << 20);
        let before = std::fs::read_dir(dir.path()).unwrap().count();
        let err = write_checkpoint(&cfg, dir.path(), &WriteOptions::default(), &mut |_, _| {}).unwrap_err();
        assert!(matches!(err, SynthError::Exists { .. }) && err.to_string().contains("--force"), "{err}");
        // --force replaces it, removing shards the new layout does not have.
        let opts = WriteOptions { force: true, ..WriteOptions::default() };
        let s = write_checkpoint(&cfg, dir.path(), &opts, &mut |_, _| {}).unwrap();
        assert_eq!(s.shards, 1);
        assert!(std::fs::read_dir(dir.path()).unwrap().count() < before);
        Model::load(dir.path(), &mut |_, _| {}).unwrap();

        let opts = WriteOptions { max_bytes: Some(1000), ..WriteOptions::default() };
        let err = write_checkpoint(&cfg, &dir.path().join("new"), &opts, &mut |_, _| {}).unwrap_err();
        assert!(matches!(err, SynthError::TooLarge { .. }) && !dir.path().join("new").exists());
        // A file where the directory should be.
        let file = dir.path().join("config.json");
        let err = write_checkpoint(&cfg, &file, &WriteOptions::default(), &mut |_, _| {}).unwrap_err();
        assert!(matches!(err, SynthError::Io { .. }), "{err}");
    }

    #[test]
    fn sizes_parse() {
        assert_eq!(parse_size("1G"), Ok(1 << 30));
        assert_eq!(parse_size("512MiB"), Ok(512 << 20));
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("2kB"), Ok(2048));
        assert!(parse_size("0").is_err() && parse_size("1X").is_err() && parse_size("G").is_err());
    }
}
