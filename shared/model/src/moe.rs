//! Each family's mixture-of-experts routing rule, as parameters of the
//! router top-k kernel (`duplex_kernels::router`):
//! - DeepSeek-V3 / Kimi-K2 (`noaux_tc`): sigmoid scores, the
//!   `e_score_correction_bias` for selection only, group-limited top-k
//!   (`n_group`, `topk_group`), weights normalised (`norm_topk_prob`) and
//!   scaled by `routed_scaling_factor`; `greedy` drops the bias.
//! - Qwen3-MoE: softmax over every expert, top-k, renormalised when
//!   `norm_topk_prob`.
//! - Mixtral: softmax over every expert, top-2, always renormalised (which
//!   is the softmax of the two chosen logits).
//!
//! `config.rs` sets the fields per family; this maps them onto the kernel.

use crate::config::ModelConfig;
pub use duplex_kernels::router::RouterParams;

/// The routing hyper-parameters of `cfg`.
pub fn router_params(cfg: &ModelConfig) -> RouterParams {
    RouterParams {
        n_experts: cfg.n_routed_experts,
        top_k: cfg.num_experts_per_tok,
        n_group: cfg.n_group,
        topk_group: cfg.topk_group,
        norm_topk_prob: cfg.norm_topk_prob,
        routed_scaling_factor: cfg.routed_scaling_factor,
        scoring: cfg.scoring_func,
    }
}
