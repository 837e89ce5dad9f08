//! Mixture-of-experts routing as DeepSeek-V3 does it (`noaux_tc`).
//!
//! Scores are `sigmoid(logits)` (or softmax for older models). A per-expert
//! correction bias is added *for selection only*: experts are grouped, each
//! group is scored by the sum of its two best biased scores, the best
//! `topk_group` groups are kept, and the top-k experts are chosen among them.
//! The weights come from the unbiased scores, optionally normalised to sum to
//! one, then multiplied by `routed_scaling_factor`.

use crate::config::{ModelConfig, ScoringFunc};

/// The routing hyper-parameters, taken from the config.
#[derive(Clone, Debug)]
pub struct RouterParams {
    pub n_experts: usize,
    pub top_k: usize,
    pub n_group: usize,
    pub topk_group: usize,
    pub norm_topk_prob: bool,
    pub routed_scaling_factor: f32,
    pub scoring: ScoringFunc,
}

impl RouterParams {
    pub fn from_config(cfg: &ModelConfig) -> Self {
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
}

/// Indices of the `k` largest values, best first; ties go to the lower index.
fn top_indices(values: &[f32], k: usize) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..values.len()).collect();
    // total_cmp puts NaN above everything; treat NaN as the smallest instead.
    let key = |i: usize| if values[i].is_nan() { f32::NEG_INFINITY } else { values[i] };
    idx.sort_by(|&a, &b| key(b).total_cmp(&key(a)).then(a.cmp(&b)));
    idx.truncate(k);
    idx
}

/// Choose experts for one token from its router logits. Returns
/// `(expert, weight)` pairs, best first.
pub fn route(p: &RouterParams, logits: &[f32], correction_bias: Option<&[f32]>) -> Vec<(usize, f32)> {
    let scores: Vec<f32> = match p.scoring {
        ScoringFunc::Sigmoid => logits.iter().map(|&x| 1.0 / (1.0 + (-x).exp())).collect(),
        ScoringFunc::Softmax => {
            let mut s = logits.to_vec();
            duplex_kernels::elementwise::softmax(&mut s);
            s
        }
    };
    let mut choice: Vec<f32> = match correction_bias {
        Some(b) => scores.iter().zip(b).map(|(s, b)| s + b).collect(),
        None => scores.clone(),
    };
    if p.n_group > 1 && p.topk_group < p.n_group {
        let per_group = p.n_experts / p.n_group;
        let group_scores: Vec<f32> = choice
            .chunks(per_group)
            .map(|g| top_indices(g, 2).iter().map(|&i| g[i]).sum())
            .collect();
        let kept = top_indices(&group_scores, p.topk_group);
        for (g, chunk) in choice.chunks_mut(per_group).enumerate() {
            if !kept.contains(&g) {
                // As transformers: masked experts score 0, not -inf.
                chunk.fill(0.0);
            }
        }
    }
    let chosen = top_indices(&choice, p.top_k);
    let mut weights: Vec<f32> = chosen.iter().map(|&e| scores[e]).collect();
    if p.norm_topk_prob {
        let sum: f32 = weights.iter().sum::<f32>() + 1e-20;
        weights.iter_mut().for_each(|w| *w /= sum);
    }
    chosen.into_iter().zip(weights).map(|(e, w)| (e, w * p.routed_scaling_factor)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn params(n_experts: usize, top_k: usize, n_group: usize, topk_group: usize) -> RouterParams {
        RouterParams { n_experts, top_k, n_group, topk_group, norm_topk_prob: true, routed_scaling_factor: 2.5, scoring: ScoringFunc::Sigmoid }
    }

    fn logit(p: f32) -> f32 {
        (p / (1.0 - p)).ln()
    }

    #[test]
    fn group_limit_excludes_strong_expert_in_weak_group() {
        // 8 experts in 4 groups of 2; keep 2 groups, pick 2 experts.
        // Group 0: {0.9, 0.1} sums 1.0; group 1: {0.6, 0.6} = 1.2; group 2: {0.55, 0.55} = 1.1; group 3: {0.2, 0.2}.
        let probs = [0.9, 0.1, 0.6, 0.6, 0.55, 0.55, 0.2, 0.2];
        let logits: Vec<f32> = probs.iter().map(|&p| logit(p)).collect();
        let r = route(&params(8, 2, 4, 2), &logits, None);
        let experts: Vec<usize> = r.iter().map(|x| x.0).collect();
        assert_eq!(experts, vec![2, 3], "expert 0 is strongest but its group loses");
        // Without the group limit, expert 0 wins.
        let r = route(&params(8, 2, 1, 1), &logits, None);
        assert_eq!(r[0].0, 0);
    }

    #[test]
    fn bias_selects_but_does_not_weigh() {
        let probs = [0.5, 0.6, 0.7, 0.8];
        let logits: Vec<f32> = probs.iter().map(|&p| logit(p)).collect();
        let bias = [1.0, 0.0, 0.0, 0.0];
        let r = route(&params(4, 2, 1, 1), &logits, Some(&bias));
        assert_eq!(r.iter().map(|x| x.0).collect::<Vec<_>>(), vec![0, 3]);
        // Weights from unbiased scores 0.5 and 0.8, normalised, times 2.5.
        assert!((r[0].1 - 2.5 * 0.5 / 1.3).abs() < 1e-5);
        assert!((r[1].1 - 2.5 * 0.8 / 1.3).abs() < 1e-5);
    }

    #[test]
    fn n_group_one_is_plain_top_k() {
        let logits = [0.3, -1.0, 2.0, 0.0, 1.0];
        let mut p = params(5, 3, 1, 1);
        p.norm_topk_prob = false;
        p.routed_scaling_factor = 1.0;
        let r = route(&p, &logits, None);
        assert_eq!(r.iter().map(|x| x.0).collect::<Vec<_>>(), vec![2, 4, 0]);
        assert!((r[0].1 - 1.0 / (1.0 + (-2.0f32).exp())).abs() < 1e-6);
    }

    #[test]
    fn single_expert_groups_score_by_their_one_expert() {
        let probs = [0.1, 0.9, 0.3, 0.8];
        let logits: Vec<f32> = probs.iter().map(|&p| logit(p)).collect();
        let r = route(&params(4, 2, 4, 2), &logits, None);
        assert_eq!(r.iter().map(|x| x.0).collect::<Vec<_>>(), vec![1, 3]);
    }

    proptest! {
        #[test]
        fn routing_invariants(logits in prop::collection::vec(-8.0f32..8.0, 16), bias in prop::collection::vec(-0.5f32..0.5, 16)) {
            let p = params(16, 4, 4, 2);
            let r = route(&p, &logits, Some(&bias));
            prop_assert_eq!(r.len(), 4);
            let mut seen = std::collections::HashSet::new();
            for &(e, w) in &r {
                prop_assert!(e < 16 && seen.insert(e) && w >= 0.0);
            }
            let total: f32 = r.iter().map(|x| x.1).sum();
            prop_assert!((total - 2.5).abs() < 1e-4);
        }
    }
}
