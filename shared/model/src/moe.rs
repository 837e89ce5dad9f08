//! Mixture-of-experts routing as DeepSeek-V3 does it (`noaux_tc`): the
//! algorithm is the router top-k kernel in `duplex_kernels::router`; this
//! module takes its parameters from the model's config.

use crate::config::ModelConfig;
pub use duplex_kernels::router::{route, route_simd, RouterParams};

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
