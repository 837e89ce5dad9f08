//! The real configs in `deploy/models` (the simulator's models) parse as the
//! engine parses them, synth accepts them, and their plans have the
//! published sizes.

use duplex_model::config::{Architecture, AttentionConfig};
use duplex_model::ModelConfig;
use duplex_toolkit::synth::{plan, summarize, SynthConfig};
use std::path::PathBuf;

fn config_path(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../deploy/models").join(name).join("config.json")
}

struct Expected {
    name: &'static str,
    architecture: Architecture,
    layers: usize,
    moe_layers: usize,
    experts: usize,
    experts_per_token: usize,
    heads: usize,
    vocab: usize,
    fp8: bool,
    /// Published parameter counts: total and activated per token, and how
    /// far they are rounded (Kimi-K2's are quoted as "1T" and "32B").
    params: f64,
    activated: f64,
    rounding: f64,
}

const MODELS: [Expected; 4] = [
    Expected { name: "deepseek-r1", architecture: Architecture::DeepseekV3, layers: 61, moe_layers: 58, experts: 256, experts_per_token: 8, heads: 128, vocab: 129280, fp8: true, params: 671e9, activated: 37e9, rounding: 0.02 },
    Expected { name: "kimi-k2", architecture: Architecture::DeepseekV3, layers: 61, moe_layers: 60, experts: 384, experts_per_token: 8, heads: 64, vocab: 163840, fp8: true, params: 1e12, activated: 32e9, rounding: 0.05 },
    Expected { name: "qwen3-235b-a22b", architecture: Architecture::Qwen3Moe, layers: 94, moe_layers: 94, experts: 128, experts_per_token: 8, heads: 64, vocab: 151936, fp8: false, params: 235e9, activated: 22e9, rounding: 0.02 },
    Expected { name: "mixtral-8x22b", architecture: Architecture::Mixtral, layers: 56, moe_layers: 56, experts: 8, experts_per_token: 2, heads: 48, vocab: 32768, fp8: false, params: 141e9, activated: 39e9, rounding: 0.02 },
];

#[test]
fn every_model_config_parses_with_its_published_shape() {
    for want in &MODELS {
        let path = config_path(want.name);
        let cfg = ModelConfig::from_file(&path).unwrap_or_else(|e| panic!("{}: {e}", want.name));
        let name = want.name;
        assert_eq!(cfg.architecture, want.architecture, "{name}");
        assert_eq!(cfg.num_hidden_layers, want.layers, "{name}");
        assert_eq!((0..cfg.num_hidden_layers).filter(|&l| cfg.is_moe_layer(l)).count(), want.moe_layers, "{name}");
        assert_eq!((cfg.n_routed_experts, cfg.num_experts_per_tok), (want.experts, want.experts_per_token), "{name}");
        assert_eq!(cfg.num_attention_heads, want.heads, "{name}");
        assert_eq!(cfg.vocab_size, want.vocab, "{name}");
        assert_eq!(cfg.quantization.as_ref().map(|q| q.weight_block_size), want.fp8.then_some([128, 128]), "{name}");
        match (&cfg.attention, want.architecture) {
            (AttentionConfig::Mla(m), Architecture::DeepseekV3) => assert_eq!((m.q_lora_rank, m.kv_lora_rank), (Some(1536), 512), "{name}"),
            (AttentionConfig::Gqa(g), Architecture::Qwen3Moe) => assert_eq!((g.num_key_value_heads, g.head_dim, g.qk_norm), (4, 128, true), "{name}"),
            (AttentionConfig::Gqa(g), Architecture::Mixtral) => assert_eq!((g.num_key_value_heads, g.head_dim, g.qk_norm), (8, 128, false), "{name}"),
            (a, _) => panic!("{name}: unexpected attention {a:?}"),
        }

        // synth takes the file as it is (vocabularies far beyond the bundled
        // tokenizer's included), and its plan has the model's published size.
        let synth = SynthConfig::from_file(&path).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(synth.model, cfg, "{name}");
        let s = summarize(&synth, &plan(&synth));
        let (params, activated) = (s.params as f64, s.activated_params_per_token as f64);
        assert!((params / want.params - 1.0).abs() < want.rounding, "{name}: {params} parameters, published {}", want.params);
        assert!((activated / want.activated - 1.0).abs() < want.rounding.max(0.05), "{name}: {activated} activated, published {}", want.activated);
    }
}
