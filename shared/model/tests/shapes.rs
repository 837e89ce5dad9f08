//! The engine must handle any DeepSeek-V3-layout checkpoint, not only the
//! bundled one. These tests generate random checkpoints with other dimensions
//! and options (plain `q_proj`, partial and non-square FP8 blocks, BF16
//! weights, tied embeddings, many expert groups, Kimi-K2 YaRN, rotate-half
//! rope, an MTP layer, sharding) and check for each:
//!
//! - F32 logits match an independent f64 transcription of transformers'
//!   `DeepseekV3ForCausalLM` (below, sharing no code with the engine);
//! - token-by-token decode through the paged KV cache, chunked prefill
//!   (chunks of 7 and 64), prefill-then-decode and two sequences interleaved
//!   in one pool all reproduce one-shot teacher-forced logits;
//! - the BF16 path stays finite and close to F32.
//!
//! Decode and chunked prefill are also checked on the fixture's longest
//! reference prompt (400 tokens).

mod common;

use common::{assert_close, fixture, load, prefill_then_decode, run_chunked, write_index, write_tensors, Tensor};
use duplex_model::{BlockTable, Logits, Model, Precision};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use safetensors::Dtype;
use serde_json::{json, Value};
use std::path::Path;

/// Relative tolerance of the decode / chunked-prefill checks (f32).
const REL: f32 = 1e-4;
/// Relative tolerance of the engine (f32) against the f64 reference.
const REF_REL: f32 = 1e-4;

// ---------------------------------------------------------------------------
// Random checkpoint generator
// ---------------------------------------------------------------------------

/// Builds the tensors of a random checkpoint described by a config.json value.
struct Gen {
    rng: ChaCha8Rng,
    /// `weight_block_size` when projections are stored as FP8, else BF16.
    fp8_block: Option<[usize; 2]>,
    tensors: Vec<Tensor>,
}

fn bf16_bytes(xs: impl Iterator<Item = f32>) -> Vec<u8> {
    xs.flat_map(|x| half::bf16::from_f32(x).to_le_bytes()).collect()
}

fn f32_bytes(xs: impl Iterator<Item = f32>) -> Vec<u8> {
    xs.flat_map(|x| x.to_le_bytes()).collect()
}

impl Gen {
    fn new(seed: u64, fp8_block: Option<[usize; 2]>) -> Self {
        Gen { rng: ChaCha8Rng::seed_from_u64(seed), fp8_block, tensors: vec![] }
    }

    fn uniform(&mut self, n: usize, lo: f32, hi: f32) -> Vec<f32> {
        (0..n).map(|_| self.rng.gen_range(lo..hi)).collect()
    }

    /// A BF16 tensor with entries uniform in `[lo, hi)`.
    fn bf16(&mut self, name: &str, shape: &[usize], lo: f32, hi: f32) {
        let v = self.uniform(shape.iter().product(), lo, hi);
        self.tensors.push(Tensor::new(name, Dtype::BF16, shape, bf16_bytes(v.into_iter())));
    }

    fn f32(&mut self, name: &str, shape: &[usize], lo: f32, hi: f32) {
        let v = self.uniform(shape.iter().product(), lo, hi);
        self.tensors.push(Tensor::new(name, Dtype::F32, shape, f32_bytes(v.into_iter())));
    }

    /// An RMSNorm weight near 1.
    fn norm(&mut self, name: &str, dim: usize) {
        self.bf16(name, &[dim], 0.9, 1.1);
    }

    /// A BF16 matrix whose products have about unit gain.
    fn bf16_matrix(&mut self, name: &str, rows: usize, cols: usize) {
        let a = (3.0 / cols as f32).sqrt();
        self.bf16(name, &[rows, cols], -a, a);
    }

    /// `{prefix}.weight` `[rows, cols]`: FP8 E4M3 codes of magnitude ≤ 4 with
    /// one F32 scale in 0.01..0.05 per block (`{prefix}.weight_scale_inv`,
    /// partial edge blocks included), or BF16.
    fn linear(&mut self, prefix: &str, rows: usize, cols: usize) {
        let Some([b0, b1]) = self.fp8_block else {
            return self.bf16_matrix(&format!("{prefix}.weight"), rows, cols);
        };
        let codes: Vec<u8> = (0..rows * cols)
            .map(|_| loop {
                let c: u8 = self.rng.gen();
                // 0x7f and 0xff are NaN.
                if c & 0x7f != 0x7f && e4m3(c).abs() <= 4.0 {
                    break c;
                }
            })
            .collect();
        self.tensors.push(Tensor::new(format!("{prefix}.weight"), Dtype::F8_E4M3, &[rows, cols], codes));
        self.f32(&format!("{prefix}.weight_scale_inv"), &[rows.div_ceil(b0), cols.div_ceil(b1)], 0.01, 0.05);
    }

    fn mlp(&mut self, prefix: &str, d: usize, inter: usize) {
        self.linear(&format!("{prefix}.gate_proj"), inter, d);
        self.linear(&format!("{prefix}.up_proj"), inter, d);
        self.linear(&format!("{prefix}.down_proj"), d, inter);
    }

    /// One decoder layer, exactly as DeepSeek-V3 names its tensors.
    fn layer(&mut self, c: &Value, l: usize, moe: bool) {
        let (d, h) = (get(c, "hidden_size"), get(c, "num_attention_heads"));
        let (dn, dr, dv, dc) = (get(c, "qk_nope_head_dim"), get(c, "qk_rope_head_dim"), get(c, "v_head_dim"), get(c, "kv_lora_rank"));
        let p = format!("model.layers.{l}");
        let a = format!("{p}.self_attn");
        self.norm(&format!("{p}.input_layernorm.weight"), d);
        self.norm(&format!("{p}.post_attention_layernorm.weight"), d);
        match c["q_lora_rank"].as_u64() {
            Some(r) => {
                let r = r as usize;
                self.linear(&format!("{a}.q_a_proj"), r, d);
                self.norm(&format!("{a}.q_a_layernorm.weight"), r);
                self.linear(&format!("{a}.q_b_proj"), h * (dn + dr), r);
            }
            None => self.linear(&format!("{a}.q_proj"), h * (dn + dr), d),
        }
        self.linear(&format!("{a}.kv_a_proj_with_mqa"), dc + dr, d);
        self.norm(&format!("{a}.kv_a_layernorm.weight"), dc);
        self.linear(&format!("{a}.kv_b_proj"), h * (dn + dv), dc);
        self.linear(&format!("{a}.o_proj"), d, h * dv);
        if moe {
            let (e, inter) = (get(c, "n_routed_experts"), get(c, "moe_intermediate_size"));
            // The router stays BF16 and the bias F32 even in FP8 checkpoints.
            self.bf16_matrix(&format!("{p}.mlp.gate.weight"), e, d);
            self.f32(&format!("{p}.mlp.gate.e_score_correction_bias"), &[e], -0.05, 0.05);
            for i in 0..e {
                self.mlp(&format!("{p}.mlp.experts.{i}"), d, inter);
            }
            let shared = get(c, "n_shared_experts");
            if shared > 0 {
                self.mlp(&format!("{p}.mlp.shared_experts"), d, inter * shared);
            }
        } else {
            self.mlp(&format!("{p}.mlp"), d, get(c, "intermediate_size"));
        }
    }
}

fn get(c: &Value, key: &str) -> usize {
    c[key].as_u64().unwrap_or_else(|| panic!("config has no {key}")) as usize
}

/// Layer `l` is MoE as in transformers' DeepseekV3 (`moe_layer_freq` 1 here).
fn is_moe(c: &Value, l: usize) -> bool {
    c["n_routed_experts"].as_u64().unwrap_or(0) > 0 && l >= get(c, "first_k_dense_replace")
}

/// How the generated checkpoint is laid out on disk.
#[derive(Clone, Copy)]
struct Layout {
    /// Two shards and an index instead of one `model.safetensors`.
    sharded: bool,
    /// Add the multi-token-prediction layer (index `num_hidden_layers`).
    mtp: bool,
}

/// Write `config` and random weights for it into `dir`; returns the tensors
/// the model uses (not the MTP ones). Weights do not depend on `layout`: the
/// MTP tensors come from their own random stream.
fn generate(dir: &Path, config: &Value, seed: u64, layout: Layout) -> Vec<Tensor> {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(dir.join("config.json"), serde_json::to_string_pretty(config).unwrap()).unwrap();
    let fp8_block = config.get("quantization_config").map(|q| {
        let b = q["weight_block_size"].as_array().unwrap();
        [b[0].as_u64().unwrap() as usize, b[1].as_u64().unwrap() as usize]
    });
    let (v, d, n_layers) = (get(config, "vocab_size"), get(config, "hidden_size"), get(config, "num_hidden_layers"));

    let mut g = Gen::new(seed, fp8_block);
    g.bf16_matrix("model.embed_tokens.weight", v, d);
    g.norm("model.norm.weight", d);
    if !config["tie_word_embeddings"].as_bool().unwrap_or(false) {
        g.bf16_matrix("lm_head.weight", v, d);
    }
    for l in 0..n_layers {
        g.layer(config, l, is_moe(config, l));
    }
    let model_tensors = std::mem::take(&mut g.tensors);
    let mut tensors = model_tensors.clone();

    if layout.mtp {
        let mut m = Gen::new(seed ^ 0x4d54_5000, fp8_block);
        let p = format!("model.layers.{n_layers}");
        m.layer(config, n_layers, true);
        m.bf16_matrix(&format!("{p}.embed_tokens.weight"), v, d);
        m.norm(&format!("{p}.enorm.weight"), d);
        m.norm(&format!("{p}.hnorm.weight"), d);
        m.linear(&format!("{p}.eh_proj"), d, 2 * d);
        m.norm(&format!("{p}.shared_head.norm.weight"), d);
        m.bf16_matrix(&format!("{p}.shared_head.head.weight"), v, d);
        tensors.extend(m.tensors);
    }

    if layout.sharded {
        let half = tensors.len() / 2;
        let (a, b) = tensors.split_at(half);
        let names = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"];
        write_tensors(&dir.join(names[0]), a);
        write_tensors(&dir.join(names[1]), b);
        write_index(dir, &[(names[0], a), (names[1], b)]);
    } else {
        write_tensors(&dir.join("model.safetensors"), &tensors);
    }
    model_tensors
}

// ---------------------------------------------------------------------------
// Variants
// ---------------------------------------------------------------------------

/// Fields every variant shares (transformers' DeepseekV3Config names).
fn base_config() -> Value {
    json!({
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "hidden_act": "silu",
        "moe_layer_freq": 1,
        "norm_topk_prob": true,
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": 1024,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "torch_dtype": "bfloat16",
    })
}

fn merge(mut base: Value, extra: Value) -> Value {
    for (k, v) in extra.as_object().unwrap() {
        base[k] = v.clone();
    }
    base
}

fn fp8_quantization() -> Value {
    json!({ "activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128] })
}

/// (a) Plain `q_proj`, no expert groups, two dense layers, no rope scaling,
/// FP8 with partial edge blocks everywhere (192 = 128 + 64, 80 < 128, ...).
fn variant_a() -> Value {
    merge(
        base_config(),
        json!({
            "vocab_size": 1000,
            "hidden_size": 192,
            "intermediate_size": 320,
            "moe_intermediate_size": 80,
            "num_hidden_layers": 4,
            "first_k_dense_replace": 2,
            "num_attention_heads": 3,
            "num_key_value_heads": 3,
            "q_lora_rank": null,
            "kv_lora_rank": 96,
            "qk_nope_head_dim": 32,
            "qk_rope_head_dim": 16,
            "v_head_dim": 48,
            "n_routed_experts": 8,
            "num_experts_per_tok": 2,
            "n_shared_experts": 1,
            "n_group": 1,
            "topk_group": 1,
            "routed_scaling_factor": 1.5,
            "rope_scaling": null,
            "tie_word_embeddings": false,
            "quantization_config": fp8_quantization(),
        }),
    )
}

/// (b) Kimi-K2 style: 32 experts in 8 groups (keep 3, pick 6), 2 shared
/// experts, YaRN with beta_fast = beta_slow = 1, rotate-half rope, BF16
/// weights without quantization_config, tied embeddings and no lm_head.
fn variant_b() -> Value {
    merge(
        base_config(),
        json!({
            "model_type": "kimi_k2",
            "vocab_size": 777,
            "hidden_size": 160,
            "intermediate_size": 288,
            "moe_intermediate_size": 32,
            "num_hidden_layers": 3,
            "first_k_dense_replace": 1,
            "num_attention_heads": 3,
            "num_key_value_heads": 3,
            "q_lora_rank": 96,
            "kv_lora_rank": 64,
            "qk_nope_head_dim": 24,
            "qk_rope_head_dim": 8,
            "v_head_dim": 40,
            "n_routed_experts": 32,
            "num_experts_per_tok": 6,
            "n_shared_experts": 2,
            "n_group": 8,
            "topk_group": 3,
            "routed_scaling_factor": 2.827,
            "rope_theta": 50000.0,
            "max_position_embeddings": 2048,
            "rope_interleave": false,
            "rope_scaling": {
                "type": "yarn",
                "factor": 32.0,
                "original_max_position_embeddings": 64,
                "beta_fast": 1.0,
                "beta_slow": 1.0,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
            },
            "tie_word_embeddings": true,
        }),
    )
}

/// (c) DeepSeek-V3 proper, sharded, with the MTP layer that must be ignored:
/// q LoRA, 12 experts in 4 groups, YaRN, FP8 with 200-wide expert matrices.
fn variant_c() -> Value {
    merge(
        base_config(),
        json!({
            "vocab_size": 500,
            "hidden_size": 136,
            "intermediate_size": 300,
            "moe_intermediate_size": 200,
            "num_hidden_layers": 2,
            "num_nextn_predict_layers": 1,
            "first_k_dense_replace": 1,
            "num_attention_heads": 2,
            "num_key_value_heads": 2,
            "q_lora_rank": 72,
            "kv_lora_rank": 40,
            "qk_nope_head_dim": 16,
            "qk_rope_head_dim": 8,
            "v_head_dim": 24,
            "n_routed_experts": 12,
            "num_experts_per_tok": 3,
            "n_shared_experts": 1,
            "n_group": 4,
            "topk_group": 2,
            "routed_scaling_factor": 2.5,
            "max_position_embeddings": 5120,
            "rope_scaling": {
                "type": "yarn",
                "factor": 40.0,
                "original_max_position_embeddings": 128,
                "beta_fast": 32,
                "beta_slow": 1,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
            },
            "tie_word_embeddings": false,
            "quantization_config": fp8_quantization(),
        }),
    )
}

/// (d) Every layer MoE, no shared experts, unnormalised top-k weights, all
/// groups kept, 64 x 32 FP8 blocks, odd head count and a tiny rope dim.
fn variant_d() -> Value {
    merge(
        base_config(),
        json!({
            "vocab_size": 333,
            "hidden_size": 96,
            "intermediate_size": 64,
            "moe_intermediate_size": 56,
            "num_hidden_layers": 2,
            "first_k_dense_replace": 0,
            "num_attention_heads": 5,
            "num_key_value_heads": 5,
            "q_lora_rank": 48,
            "kv_lora_rank": 32,
            "qk_nope_head_dim": 16,
            "qk_rope_head_dim": 4,
            "v_head_dim": 20,
            "n_routed_experts": 6,
            "num_experts_per_tok": 2,
            "n_shared_experts": 0,
            "n_group": 2,
            "topk_group": 2,
            "norm_topk_prob": false,
            "routed_scaling_factor": 1.0,
            "rms_norm_eps": 1e-5,
            "rope_scaling": null,
            "tie_word_embeddings": false,
            "quantization_config": merge(fp8_quantization(), json!({ "weight_block_size": [64, 32] })),
        }),
    )
}

// ---------------------------------------------------------------------------
// Independent f64 reference forward pass
// ---------------------------------------------------------------------------

/// A direct f64 transcription of transformers' `DeepseekV3ForCausalLM`
/// (modeling_deepseek_v3.py) over the generated tensors: no KV cache, no
/// absorption, dequantised weights. It shares no code with the engine, so it
/// catches mistakes that token-by-token vs. one-shot consistency cannot
/// (rope layout, YaRN, plain `q_proj`, partial FP8 blocks, tied embeddings,
/// group-limited routing with other group counts).
struct Reference<'a> {
    c: &'a Value,
    w: std::collections::HashMap<String, Vec<f64>>,
}

impl<'a> Reference<'a> {
    fn new(c: &'a Value, tensors: &[Tensor]) -> Self {
        let decode = |t: &Tensor| -> Vec<f64> {
            match t.dtype {
                Dtype::BF16 => t.data.chunks_exact(2).map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f64()).collect(),
                Dtype::F32 => t.data.chunks_exact(4).map(|b| f32::from_le_bytes(b.try_into().unwrap()) as f64).collect(),
                Dtype::F8_E4M3 => t.data.iter().map(|&b| e4m3(b)).collect(),
                other => panic!("{}: unexpected {other:?}", t.name),
            }
        };
        let by_name: std::collections::HashMap<&str, &Tensor> = tensors.iter().map(|t| (t.name.as_str(), t)).collect();
        let mut w = std::collections::HashMap::new();
        for t in tensors {
            let mut v = decode(t);
            if t.dtype == Dtype::F8_E4M3 {
                let b = &c["quantization_config"]["weight_block_size"];
                let (b0, b1) = (b[0].as_u64().unwrap() as usize, b[1].as_u64().unwrap() as usize);
                let scale_name = t.name.replace(".weight", ".weight_scale_inv");
                let scales = decode(by_name[scale_name.as_str()]);
                let (rows, cols) = (t.shape[0], t.shape[1]);
                for r in 0..rows {
                    for col in 0..cols {
                        v[r * cols + col] *= scales[(r / b0) * cols.div_ceil(b1) + col / b1];
                    }
                }
            }
            w.insert(t.name.clone(), v);
        }
        Reference { c, w }
    }

    fn get(&self, name: &str) -> &[f64] {
        self.w.get(name).unwrap_or_else(|| panic!("reference: no {name}"))
    }

    fn num(&self, key: &str) -> f64 {
        self.c[key].as_f64().unwrap()
    }

    /// `W x` for `W = {prefix}.weight` of shape `[rows, x.len()]`.
    fn linear(&self, prefix: &str, x: &[f64]) -> Vec<f64> {
        let w = self.get(&format!("{prefix}.weight"));
        w.chunks_exact(x.len()).map(|row| row.iter().zip(x).map(|(a, b)| a * b).sum()).collect()
    }

    fn rms_norm(&self, name: &str, x: &[f64]) -> Vec<f64> {
        let eps = self.num("rms_norm_eps");
        let inv = 1.0 / (x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64 + eps).sqrt();
        x.iter().zip(self.get(name)).map(|(v, w)| v * inv * w).collect()
    }

    fn mlp(&self, prefix: &str, x: &[f64]) -> Vec<f64> {
        let g = self.linear(&format!("{prefix}.gate_proj"), x);
        let u = self.linear(&format!("{prefix}.up_proj"), x);
        let h: Vec<f64> = g.iter().zip(&u).map(|(g, u)| g / (1.0 + (-g).exp()) * u).collect();
        self.linear(&format!("{prefix}.down_proj"), &h)
    }

    /// `_compute_yarn_parameters` / default rope: inverse frequencies and the
    /// cos/sin scale.
    fn rope_params(&self) -> (Vec<f64>, f64) {
        let dim = get(self.c, "qk_rope_head_dim");
        let base = self.num("rope_theta");
        let pos_freqs: Vec<f64> = (0..dim / 2).map(|i| base.powf(2.0 * i as f64 / dim as f64)).collect();
        let y = &self.c["rope_scaling"];
        if y.is_null() {
            return (pos_freqs.iter().map(|p| 1.0 / p).collect(), 1.0);
        }
        let factor = y["factor"].as_f64().unwrap();
        let orig = y["original_max_position_embeddings"].as_f64().unwrap();
        let (beta_fast, beta_slow) = (y["beta_fast"].as_f64().unwrap(), y["beta_slow"].as_f64().unwrap());
        let (mscale, mscale_all) = (y["mscale"].as_f64().unwrap(), y["mscale_all_dim"].as_f64().unwrap());
        let get_mscale = |s: f64, m: f64| if s <= 1.0 { 1.0 } else { 0.1 * m * s.ln() + 1.0 };
        let attention = if mscale != 0.0 && mscale_all != 0.0 { get_mscale(factor, mscale) / get_mscale(factor, mscale_all) } else { get_mscale(factor, 1.0) };
        let corr = |rot: f64| dim as f64 * (orig / (rot * 2.0 * std::f64::consts::PI)).ln() / (2.0 * base.ln());
        let low = corr(beta_fast).floor().max(0.0);
        let mut high = corr(beta_slow).ceil().min(dim as f64 - 1.0);
        if low == high {
            high += 0.001;
        }
        let inv = pos_freqs
            .iter()
            .enumerate()
            .map(|(i, p)| {
                let extrapolation_factor = 1.0 - ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
                (1.0 / (factor * p)) * (1.0 - extrapolation_factor) + (1.0 / p) * extrapolation_factor
            })
            .collect();
        (inv, attention)
    }

    /// `apply_rotary_pos_emb` (rotate_half), after de-interleaving the pairs
    /// when `rope_interleave` (`apply_rotary_pos_emb_interleave`).
    fn rotate(&self, x: &[f64], pos: usize, inv: &[f64], scale: f64) -> Vec<f64> {
        let half = x.len() / 2;
        let x: Vec<f64> = if self.c["rope_interleave"].as_bool().unwrap_or(true) {
            x.iter().step_by(2).chain(x.iter().skip(1).step_by(2)).copied().collect()
        } else {
            x.to_vec()
        };
        let mut out = vec![0.0; x.len()];
        for i in 0..half {
            let (cos, sin) = ((pos as f64 * inv[i]).cos() * scale, (pos as f64 * inv[i]).sin() * scale);
            out[i] = x[i] * cos - x[i + half] * sin;
            out[i + half] = x[i + half] * cos + x[i] * sin;
        }
        out
    }

    fn attention(&self, l: usize, xs: &[Vec<f64>]) -> Vec<Vec<f64>> {
        let c = self.c;
        let (h, dn, dr, dv, dc) =
            (get(c, "num_attention_heads"), get(c, "qk_nope_head_dim"), get(c, "qk_rope_head_dim"), get(c, "v_head_dim"), get(c, "kv_lora_rank"));
        let a = format!("model.layers.{l}.self_attn");
        let (inv, rope_scale) = self.rope_params();
        let mut scaling = ((dn + dr) as f64).powf(-0.5);
        let y = &c["rope_scaling"];
        if !y.is_null() && y["mscale_all_dim"].as_f64().unwrap_or(0.0) != 0.0 {
            let m = 0.1 * y["mscale_all_dim"].as_f64().unwrap() * y["factor"].as_f64().unwrap().ln() + 1.0;
            scaling *= m * m;
        }
        // Per position: queries [h][dn + dr], keys [h][dn + dr], values [h][dv].
        let (mut qs, mut ks, mut vs) = (vec![], vec![], vec![]);
        for (pos, x) in xs.iter().enumerate() {
            let q = if c["q_lora_rank"].is_null() {
                self.linear(&format!("{a}.q_proj"), x)
            } else {
                let qa = self.linear(&format!("{a}.q_a_proj"), x);
                self.linear(&format!("{a}.q_b_proj"), &self.rms_norm(&format!("{a}.q_a_layernorm.weight"), &qa))
            };
            let ckv = self.linear(&format!("{a}.kv_a_proj_with_mqa"), x);
            let k_rot = self.rotate(&ckv[dc..], pos, &inv, rope_scale);
            let kv = self.linear(&format!("{a}.kv_b_proj"), &self.rms_norm(&format!("{a}.kv_a_layernorm.weight"), &ckv[..dc]));
            let (mut qp, mut kp, mut vp) = (vec![], vec![], vec![]);
            for head in 0..h {
                let qh = &q[head * (dn + dr)..(head + 1) * (dn + dr)];
                qp.push([&qh[..dn], &self.rotate(&qh[dn..], pos, &inv, rope_scale)[..]].concat());
                let kvh = &kv[head * (dn + dv)..(head + 1) * (dn + dv)];
                kp.push([&kvh[..dn], &k_rot[..]].concat());
                vp.push(kvh[dn..].to_vec());
            }
            qs.push(qp);
            ks.push(kp);
            vs.push(vp);
        }
        (0..xs.len())
            .map(|i| {
                let mut o = vec![];
                for head in 0..h {
                    let scores: Vec<f64> = (0..=i)
                        .map(|t| qs[i][head].iter().zip(&ks[t][head]).map(|(a, b)| a * b).sum::<f64>() * scaling)
                        .collect();
                    let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                    let e: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
                    let z: f64 = e.iter().sum();
                    o.extend((0..dv).map(|d| (0..=i).map(|t| e[t] / z * vs[t][head][d]).sum::<f64>()));
                }
                self.linear(&format!("{a}.o_proj"), &o)
            })
            .collect()
    }

    /// `DeepseekV3MoE`: sigmoid scores, bias for selection, group limit,
    /// top-k, normalised weights times `routed_scaling_factor`, plus shared.
    fn moe(&self, l: usize, x: &[f64]) -> Vec<f64> {
        let c = self.c;
        let m = format!("model.layers.{l}.mlp");
        let (e, k) = (get(c, "n_routed_experts"), get(c, "num_experts_per_tok"));
        let (n_group, topk_group) = (get(c, "n_group"), get(c, "topk_group"));
        let scores: Vec<f64> = self.linear(&format!("{m}.gate"), x).iter().map(|v| 1.0 / (1.0 + (-v).exp())).collect();
        let bias = self.get(&format!("{m}.gate.e_score_correction_bias"));
        let mut choice: Vec<f64> = scores.iter().zip(bias).map(|(s, b)| s + b).collect();
        let top = |v: &[f64], k: usize| -> Vec<usize> {
            let mut idx: Vec<usize> = (0..v.len()).collect();
            idx.sort_by(|&a, &b| v[b].partial_cmp(&v[a]).unwrap());
            idx.truncate(k);
            idx
        };
        let per = e / n_group;
        let group_scores: Vec<f64> = choice.chunks(per).map(|g| top(g, 2).iter().map(|&i| g[i]).sum()).collect();
        let kept = top(&group_scores, topk_group);
        for (g, chunk) in choice.chunks_mut(per).enumerate() {
            if !kept.contains(&g) {
                chunk.fill(0.0);
            }
        }
        let chosen = top(&choice, k);
        let sum = match c["norm_topk_prob"].as_bool().unwrap_or(true) {
            true => chosen.iter().map(|&i| scores[i]).sum::<f64>() + 1e-20,
            false => 1.0,
        };
        let mut out = vec![0.0; x.len()];
        for &i in &chosen {
            let w = scores[i] / sum * self.num("routed_scaling_factor");
            for (o, y) in out.iter_mut().zip(self.mlp(&format!("{m}.experts.{i}"), x)) {
                *o += w * y;
            }
        }
        if get(c, "n_shared_experts") > 0 {
            for (o, y) in out.iter_mut().zip(self.mlp(&format!("{m}.shared_experts"), x)) {
                *o += y;
            }
        }
        out
    }

    fn logits(&self, tokens: &[u32]) -> Vec<f64> {
        let c = self.c;
        let d = get(c, "hidden_size");
        let embed = self.get("model.embed_tokens.weight");
        let mut hs: Vec<Vec<f64>> = tokens.iter().map(|&t| embed[t as usize * d..(t as usize + 1) * d].to_vec()).collect();
        for l in 0..get(c, "num_hidden_layers") {
            let p = format!("model.layers.{l}");
            let xs: Vec<Vec<f64>> = hs.iter().map(|h| self.rms_norm(&format!("{p}.input_layernorm.weight"), h)).collect();
            for (h, a) in hs.iter_mut().zip(self.attention(l, &xs)) {
                h.iter_mut().zip(a).for_each(|(h, a)| *h += a);
            }
            for h in hs.iter_mut() {
                let x = self.rms_norm(&format!("{p}.post_attention_layernorm.weight"), h);
                let f = if is_moe(c, l) { self.moe(l, &x) } else { self.mlp(&format!("{p}.mlp"), &x) };
                h.iter_mut().zip(f).for_each(|(h, f)| *h += f);
            }
        }
        let head = if self.w.contains_key("lm_head.weight") { "lm_head" } else { "model.embed_tokens" };
        hs.iter().flat_map(|h| self.linear(head, &self.rms_norm("model.norm.weight", h))).collect()
    }
}

/// E4M3FN decoded from its definition (bias 7, subnormals, no infinities).
fn e4m3(b: u8) -> f64 {
    let sign = if b & 0x80 != 0 { -1.0 } else { 1.0 };
    let (e, m) = (((b >> 3) & 0xf) as i32, (b & 7) as f64);
    assert!(!(e == 15 && m == 7.0), "NaN code");
    sign * if e == 0 { m / 8.0 * 2f64.powi(-6) } else { (1.0 + m / 8.0) * 2f64.powi(e - 7) }
}

// ---------------------------------------------------------------------------
// Checks
// ---------------------------------------------------------------------------

fn prompt(vocab: usize, len: usize, seed: u64) -> Vec<u32> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    (0..len).map(|_| rng.gen_range(0..vocab as u32)).collect()
}

/// One-shot teacher-forced logits of `tokens`, checked against token-by-token
/// decode (`Logits::Last`, i.e. chunks of 1) and chunked prefill in chunks of
/// 7 and 64, all through a paged cache of 16-token blocks. Returns the
/// one-shot logits.
fn check_consistency(what: &str, m: &Model, tokens: &[u32]) -> Vec<f32> {
    let vocab = m.cfg.vocab_size;
    let full = run_chunked(m, tokens, tokens.len(), Logits::All);
    assert_eq!(full.len(), tokens.len() * vocab);
    assert!(full.iter().all(|v| v.is_finite()), "{what}: non-finite logits");
    let spread = full.iter().fold(0.0f32, |a, v| a.max(v.abs()));
    assert!(spread > 1e-3, "{what}: logits are all ~0 ({spread})");

    let decoded = run_chunked(m, tokens, 1, Logits::Last);
    assert_close(&format!("{what}: token-by-token decode vs teacher-forced"), &decoded, &full, REL);
    for chunk in [7, 64] {
        let chunked = run_chunked(m, tokens, chunk, Logits::All);
        assert_close(&format!("{what}: prefill in chunks of {chunk} vs one-shot"), &chunked, &full, REL);
    }
    full
}

/// The BF16 path runs on the same model, stays finite and stays near F32:
/// mean |Δlogit| within 3% of the largest F32 logit and top-1 agreement of
/// at least 80% (random routers flip some expert choices under BF16, so a
/// few rows differ a lot; measured: 0.1–1.4% and 88–100%).
fn check_bf16(what: &str, m: &Model, tokens: &[u32], f32_logits: &[f32]) {
    let mut pool = m.new_kv_pool(tokens.len().div_ceil(16), 16);
    let got = m.forward(&mut pool, &mut BlockTable::default(), tokens, Precision::Bf16, Logits::All).unwrap();
    assert_eq!(got.len(), f32_logits.len());
    assert!(got.iter().all(|v| v.is_finite()), "{what}: non-finite BF16 logits");
    let scale = f32_logits.iter().fold(0.0f32, |a, v| a.max(v.abs()));
    let mean = got.iter().zip(f32_logits).map(|(a, b)| (a - b).abs()).sum::<f32>() / got.len() as f32;
    let vocab = m.cfg.vocab_size;
    let argmax = |r: &[f32]| r.iter().enumerate().fold(0, |best, (i, v)| if *v > r[best] { i } else { best });
    let agree = got.chunks(vocab).zip(f32_logits.chunks(vocab)).filter(|(a, b)| argmax(a) == argmax(b)).count();
    let rows = tokens.len();
    println!("{what}: BF16 vs F32 mean |Δ| = {mean:.4} (max |logit| {scale:.3}), top-1 agreement {agree}/{rows}");
    assert!(mean <= 0.03 * scale, "{what}: BF16 mean |Δ| {mean} vs max |logit| {scale}");
    assert!(agree * 5 >= rows * 4, "{what}: BF16 top-1 agreement {agree}/{rows}");
}

/// Generate, load and check one variant; returns the model and its logits.
fn check_variant(what: &str, config: &Value, seed: u64, layout: Layout) -> (Model, Vec<f32>) {
    let tmp = tempfile::tempdir().unwrap();
    let tensors = generate(tmp.path(), config, seed, layout);
    let m = load(tmp.path());
    let vocab = get(config, "vocab_size");
    assert_eq!(m.cfg.vocab_size, vocab);

    // 150 tokens: past 128 and across ten 16-token blocks.
    let tokens = prompt(vocab, 150, seed + 1);
    let logits = check_consistency(what, &m, &tokens);
    check_bf16(what, &m, &tokens, &logits);

    // Against the independent f64 transcription of transformers.
    let want: Vec<f32> = Reference::new(config, &tensors).logits(&tokens).iter().map(|&v| v as f32).collect();
    assert_close(&format!("{what}: engine vs f64 reference"), &logits, &want, REF_REL);

    // Logits::Last of a one-shot prefill is the last row of Logits::All.
    let last = run_chunked(&m, &tokens, tokens.len(), Logits::Last);
    assert_close(&format!("{what}: Logits::Last"), &last, &logits[149 * vocab..], REL);

    // Generation as a server runs it: one prefill, then decode steps.
    let stepped = prefill_then_decode(&m, &tokens, 100);
    assert_close(&format!("{what}: prefill 100 then decode"), &stepped, &logits[99 * vocab..], REL);

    // Two sequences sharing one pool, advanced alternately so that their
    // blocks interleave, each match their own one-shot logits.
    let other = prompt(vocab, 90, seed + 2);
    let alone = run_chunked(&m, &other, other.len(), Logits::All);
    let mut pool = m.new_kv_pool(20, 16);
    let (mut ta, mut tb) = (BlockTable::default(), BlockTable::default());
    let (mut la, mut lb) = (vec![], vec![]);
    for (a, b) in tokens.chunks(15).zip(other.chunks(9)) {
        la.extend(m.forward(&mut pool, &mut ta, a, Precision::F32, Logits::All).unwrap());
        lb.extend(m.forward(&mut pool, &mut tb, b, Precision::F32, Logits::All).unwrap());
    }
    assert!(ta.blocks.windows(2).any(|w| w[1] != w[0] + 1), "blocks of the two sequences interleave");
    assert_close(&format!("{what}: sequence A in a shared pool"), &la, &logits, REL);
    assert_close(&format!("{what}: sequence B in a shared pool"), &lb, &alone, REL);
    (m, logits)
}

#[test]
fn variant_a_plain_q_proj_dense_layers_partial_fp8_blocks() {
    let cfg = variant_a();
    let (m, _) = check_variant("variant a", &cfg, 11, Layout { sharded: false, mtp: false });
    assert_eq!(m.cfg.mla().unwrap().q_lora_rank, None);
    assert!(m.cfg.rope_scaling.is_none());
    assert_eq!(m.skipped_mtp_tensors, 0);
}

#[test]
fn variant_b_kimi_k2_groups_yarn_bf16_tied() {
    let cfg = variant_b();
    let (m, _) = check_variant("variant b", &cfg, 22, Layout { sharded: false, mtp: false });
    assert!(m.cfg.tie_word_embeddings && m.cfg.quantization.is_none() && !m.cfg.rope_interleave);
    let y = m.cfg.rope_scaling.as_ref().expect("yarn");
    assert_eq!((y.beta_fast, y.beta_slow), (1.0, 1.0));
}

#[test]
fn variant_c_sharded_with_ignored_mtp_layer() {
    let cfg = variant_c();
    let (m, with_mtp) = check_variant("variant c", &cfg, 33, Layout { sharded: true, mtp: true });
    assert!(m.skipped_mtp_tensors > 0, "the MTP layer's tensors are counted as skipped");

    // The MTP layer changes nothing: the same weights without it give
    // bit-identical logits.
    let tmp = tempfile::tempdir().unwrap();
    generate(tmp.path(), &cfg, 33, Layout { sharded: false, mtp: false });
    let plain = load(tmp.path());
    assert_eq!(plain.skipped_mtp_tensors, 0);
    let tokens = prompt(500, 150, 34);
    let without = run_chunked(&plain, &tokens, tokens.len(), Logits::All);
    assert!(with_mtp.iter().zip(&without).all(|(a, b)| a.to_bits() == b.to_bits()), "MTP tensors changed the logits");
}

#[test]
fn variant_d_all_moe_unnormalised_small_fp8_blocks() {
    let cfg = variant_d();
    let (m, _) = check_variant("variant d", &cfg, 44, Layout { sharded: false, mtp: false });
    assert!(!m.cfg.norm_topk_prob && m.cfg.n_shared_experts == 0);
}

/// The fixture, its longest reference prompt (400 tokens) and that prompt's
/// one-shot F32 logits, shared by the two fixture tests.
fn fixture_case() -> &'static (Model, Vec<u32>, Vec<f32>) {
    static CASE: std::sync::OnceLock<(Model, Vec<u32>, Vec<f32>)> = std::sync::OnceLock::new();
    CASE.get_or_init(|| {
        let json: Value = serde_json::from_str(&std::fs::read_to_string(fixture().join("reference.json")).unwrap()).unwrap();
        let tokens: Vec<u32> = json["prompts"][3]["input_ids"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect();
        assert_eq!(tokens.len(), 400);
        let m = load(&fixture());
        let full = run_chunked(&m, &tokens, tokens.len(), Logits::All);
        assert!(full.iter().all(|v| v.is_finite()));
        (m, tokens, full)
    })
}

#[test]
fn fixture_longest_prompt_decode_matches_teacher_forced() {
    let (m, tokens, full) = fixture_case();
    let decoded = run_chunked(m, tokens, 1, Logits::Last);
    assert_close("fixture prompt 3: token-by-token decode vs teacher-forced", &decoded, full, REL);
}

#[test]
fn fixture_longest_prompt_chunked_prefill_matches_one_shot() {
    let (m, tokens, full) = fixture_case();
    // Chunks of 1 are the decode test above.
    for chunk in [7, 64] {
        let chunked = run_chunked(m, tokens, chunk, Logits::All);
        assert_close(&format!("fixture prompt 3: prefill in chunks of {chunk} vs one-shot"), &chunked, full, REL);
    }
}
