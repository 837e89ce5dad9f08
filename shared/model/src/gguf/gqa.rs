//! llama.cpp's grouped-query-attention MoE architectures: `qwen3moe`
//! (Qwen3-MoE) and `llama` with experts (Mixtral): their metadata as a
//! Duplex [`ModelConfig`], their tensor names as Hugging Face names.
//!
//! One conversion detail matters: for `llama`, `convert_hf_to_gguf.py`
//! permutes each head's rows of `q_proj` and `k_proj` so that llama.cpp's
//! rotation of adjacent pairs equals transformers' rotation of the two
//! halves. Duplex keeps the rows as stored and rotates adjacent pairs too
//! (`rope_interleave`), which gives the same attention scores without
//! touching the weights. `qwen3moe` is converted unpermuted and rotates
//! halves, as transformers does.

use super::deepseek2::{HfSlice, HfTensor};
use crate::config::{at_most, Architecture, AttentionConfig, GqaConfig, ModelConfig, ScoringFunc, MAX_EXPERTS, MAX_LAYERS};
use duplex_gguf::{Gguf, GgufError};

pub const QWEN3MOE: &str = "qwen3moe";
pub const LLAMA: &str = "llama";

/// The Duplex configuration of a `qwen3moe` or `llama` (MoE) GGUF.
pub fn model_config(g: &Gguf, arch: &str) -> Result<ModelConfig, GgufError> {
    let md = g.metadata();
    let key = |name: &str| format!("{arch}.{name}");
    let need = |name: &str| -> Result<usize, GgufError> { md.require(&key(name), md.usize(&key(name))?) };
    let opt = |name: &str| md.usize(&key(name));
    let qwen = arch == QWEN3MOE;
    let vocab = duplex_gguf::vocab::GgufVocab::from_metadata(md)?;
    let layers = need("block_count")?;
    at_most(layers, MAX_LAYERS).map_err(|m| md.error(&key("block_count"), m))?;
    let hidden = need("embedding_length")?;
    let heads = need("attention.head_count")?;
    let kv_heads = opt("attention.head_count_kv")?.unwrap_or(heads);
    let head_dim = match opt("attention.key_length")? {
        Some(k) => k,
        None => hidden.checked_div(heads).unwrap_or(0),
    };
    let experts = opt("expert_count")?.unwrap_or(0);
    at_most(experts, MAX_EXPERTS).map_err(|m| md.error(&key("expert_count"), m))?;
    if experts == 0 {
        return Err(GgufError::Model { path: g.path().to_path_buf(), message: format!("{arch} without {} is a dense model; Duplex serves mixtures of experts", key("expert_count")) });
    }
    // A layer is a mixture of experts exactly when it has a router.
    let moe_layers: Vec<bool> = (0..layers).map(|l| g.contains(&format!("blk.{l}.ffn_gate_inp.weight"))).collect();
    let ffn = opt("feed_forward_length")?.unwrap_or(0);
    // Mixtral's experts are feed_forward_length wide; Qwen3's have their own width.
    let expert_width = if qwen { need("expert_feed_forward_length")? } else { ffn };
    let max_pos = opt("context_length")?.unwrap_or(4096);
    let cfg = ModelConfig {
        architecture: if qwen { Architecture::Qwen3Moe } else { Architecture::Mixtral },
        vocab_size: vocab.tokens.len(),
        hidden_size: hidden,
        intermediate_size: if qwen { ffn } else { 0 },
        num_hidden_layers: layers,
        num_attention_heads: heads,
        attention: AttentionConfig::Gqa(GqaConfig { num_key_value_heads: kv_heads, head_dim, qk_norm: qwen }),
        moe_intermediate_size: expert_width,
        n_routed_experts: experts,
        n_shared_experts: 0,
        num_experts_per_tok: need("expert_used_count")?,
        moe_layers,
        n_group: 1,
        topk_group: 1,
        // llama.cpp renormalises the chosen experts' weights for both (Qwen3-MoE's
        // released checkpoints all set norm_topk_prob); a converter that
        // writes the switch is obeyed.
        norm_topk_prob: md.bool(&key("expert_weights_norm"))?.unwrap_or(true),
        routed_scaling_factor: 1.0,
        scoring_func: ScoringFunc::Softmax,
        use_correction_bias: false,
        rope_theta: md.f64(&key("rope.freq_base"))?.unwrap_or(if qwen { 1e6 } else { 1e4 }),
        rope_scaling: match md.str(&key("rope.scaling.type"))? {
            None | Some("none") => None,
            Some(other) => return Err(md.error(&key("rope.scaling.type"), format!("rope scaling {other:?} is not supported for {arch}"))),
        },
        // See the module's comment: llama's q/k rows are stored permuted.
        rope_interleave: !qwen,
        rms_norm_eps: md.f64(&key("attention.layer_norm_rms_epsilon"))?.unwrap_or(if qwen { 1e-6 } else { 1e-5 }) as f32,
        max_position_embeddings: max_pos,
        tie_word_embeddings: !g.contains("output.weight"),
        quantization: None,
        bos_token_id: vocab.bos_token_id,
        eos_token_ids: vocab.eos_token_id.into_iter().collect(),
    };
    cfg.validate().map_err(|m| GgufError::Model { path: g.path().to_path_buf(), message: format!("the {arch} metadata gives an invalid configuration: {m}") })?;
    Ok(cfg)
}

/// The Hugging Face tensor behind a `qwen3moe` / `llama` GGUF tensor name.
pub fn hf_name(arch: &str, gguf_name: &str) -> Option<HfTensor> {
    let whole = |name: String| Some(HfTensor { name, slice: HfSlice::Whole });
    match gguf_name {
        "token_embd.weight" => return whole("model.embed_tokens.weight".into()),
        "output_norm.weight" => return whole("model.norm.weight".into()),
        "output.weight" => return whole("lm_head.weight".into()),
        _ => {}
    }
    let rest = gguf_name.strip_prefix("blk.")?;
    let (layer, suffix) = rest.split_once('.')?;
    if layer.is_empty() || (layer.len() > 1 && layer.starts_with('0')) || !layer.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let p = format!("model.layers.{layer}");
    let (moe, [gate, up, down]) = if arch == LLAMA { ("block_sparse_moe", ["w1", "w3", "w2"]) } else { ("mlp", ["gate_proj", "up_proj", "down_proj"]) };
    let name = match suffix {
        "attn_norm.weight" => format!("{p}.input_layernorm.weight"),
        "attn_q.weight" => format!("{p}.self_attn.q_proj.weight"),
        "attn_k.weight" => format!("{p}.self_attn.k_proj.weight"),
        "attn_v.weight" => format!("{p}.self_attn.v_proj.weight"),
        "attn_output.weight" => format!("{p}.self_attn.o_proj.weight"),
        "attn_q_norm.weight" => format!("{p}.self_attn.q_norm.weight"),
        "attn_k_norm.weight" => format!("{p}.self_attn.k_norm.weight"),
        "ffn_norm.weight" => format!("{p}.post_attention_layernorm.weight"),
        "ffn_gate.weight" => format!("{p}.mlp.gate_proj.weight"),
        "ffn_up.weight" => format!("{p}.mlp.up_proj.weight"),
        "ffn_down.weight" => format!("{p}.mlp.down_proj.weight"),
        "ffn_gate_inp.weight" => format!("{p}.{moe}.gate.weight"),
        "ffn_gate_exps.weight" => return Some(HfTensor { name: format!("{p}.{moe}.experts.*.{gate}.weight"), slice: HfSlice::Experts }),
        "ffn_up_exps.weight" => return Some(HfTensor { name: format!("{p}.{moe}.experts.*.{up}.weight"), slice: HfSlice::Experts }),
        "ffn_down_exps.weight" => return Some(HfTensor { name: format!("{p}.{moe}.experts.*.{down}.weight"), slice: HfSlice::Experts }),
        other => {
            // Older Mixtral conversions: one tensor per expert, `ffn_gate.3.weight`.
            let (proj, rest) = other.split_once('.')?;
            let (e, tail) = rest.split_once('.')?;
            if tail != "weight" || e.is_empty() || !e.bytes().all(|b| b.is_ascii_digit()) {
                return None;
            }
            let which = match proj {
                "ffn_gate" => gate,
                "ffn_up" => up,
                "ffn_down" => down,
                _ => return None,
            };
            format!("{p}.{moe}.experts.{e}.{which}.weight")
        }
    };
    whole(name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_map_to_hugging_face() {
        let n = |arch: &str, g: &str| hf_name(arch, g).map(|h| (h.name, h.slice));
        assert_eq!(n(QWEN3MOE, "blk.2.attn_q_norm.weight"), Some(("model.layers.2.self_attn.q_norm.weight".into(), HfSlice::Whole)));
        assert_eq!(n(QWEN3MOE, "blk.1.ffn_gate_inp.weight"), Some(("model.layers.1.mlp.gate.weight".into(), HfSlice::Whole)));
        assert_eq!(hf_name(QWEN3MOE, "blk.1.ffn_down_exps.weight").unwrap().expert(5), "model.layers.1.mlp.experts.5.down_proj.weight");
        assert_eq!(hf_name(LLAMA, "blk.0.ffn_up_exps.weight").unwrap().expert(7), "model.layers.0.block_sparse_moe.experts.7.w3.weight");
        assert_eq!(n(LLAMA, "blk.3.ffn_gate.6.weight"), Some(("model.layers.3.block_sparse_moe.experts.6.w1.weight".into(), HfSlice::Whole)));
        assert_eq!(n(LLAMA, "blk.0.ffn_gate_inp.weight"), Some(("model.layers.0.block_sparse_moe.gate.weight".into(), HfSlice::Whole)));
        assert_eq!(n(LLAMA, "output.weight"), Some(("lm_head.weight".into(), HfSlice::Whole)));
        for unknown in ["blk.01.attn_q.weight", "blk.1.ffn_gate.x.weight", "blk.1.attn_kv_b.weight", "rope_freqs.weight"] {
            assert_eq!(hf_name(QWEN3MOE, unknown), None, "{unknown}");
        }
    }
}
