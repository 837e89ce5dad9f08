//! Router top-k: the family of mixture-of-experts routers as one kernel
//! with parameters (as vLLM's `grouped_topk`/`fused_topk` are).
//!
//! Scores are `sigmoid(logits)` or `softmax(logits)`. An optional per-expert
//! bias is added *for selection only*. With groups, experts are grouped,
//! each group is scored by the sum of its two best biased scores, the best
//! `topk_group` groups are kept, and the top-k experts are chosen among
//! them; with one group it is a plain top-k. The weights come from the
//! unbiased scores, optionally normalised to sum to one, then scaled.
//! Which model routes how is model code (`duplex_model::moe`).

use crate::cpu::{elementwise, isa::Isa};

/// How router logits become expert scores.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ScoringFunc {
    Sigmoid,
    Softmax,
}

/// The routing hyper-parameters.
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
/// `(expert, weight)` pairs, best first. This is the scalar reference (and
/// the F32 path); [`route_simd`] is the same routing on the SIMD kernels.
pub fn route(p: &RouterParams, logits: &[f32], correction_bias: Option<&[f32]>) -> Vec<(usize, f32)> {
    route_with(Kernels::Reference, p, logits, correction_bias)
}

/// [`route`] on the SIMD kernels of level `isa` (the BF16 path): vectorised
/// sigmoid scores plus bias, softmax, and top-k max-scans. The scores differ
/// from the scalar ones by ≤ 1e-6 relative (the vector `exp`), so the chosen
/// experts are the same unless two candidates' scores are that close; ties
/// are broken exactly as [`route`] breaks them (lowest index first).
pub fn route_simd(isa: Isa, p: &RouterParams, logits: &[f32], correction_bias: Option<&[f32]>) -> Vec<(usize, f32)> {
    route_with(Kernels::Simd(isa), p, logits, correction_bias)
}

/// Which implementation of the score and top-k steps routing uses.
#[derive(Clone, Copy)]
enum Kernels {
    /// The scalar code (bit-for-bit the reference).
    Reference,
    Simd(Isa),
}

impl Kernels {
    /// `(scores, choice)`: the expert scores, and the values experts are
    /// chosen by (the scores plus the correction bias, if any).
    fn scores(self, p: &RouterParams, logits: &[f32], correction_bias: Option<&[f32]>) -> (Vec<f32>, Vec<f32>) {
        match self {
            Kernels::Reference => {
                let scores: Vec<f32> = match p.scoring {
                    ScoringFunc::Sigmoid => logits.iter().map(|&x| 1.0 / (1.0 + (-x).exp())).collect(),
                    ScoringFunc::Softmax => {
                        let mut s = logits.to_vec();
                        crate::elementwise::softmax(&mut s);
                        s
                    }
                };
                let choice: Vec<f32> = match correction_bias {
                    Some(b) => scores.iter().zip(b).map(|(s, b)| s + b).collect(),
                    None => scores.clone(),
                };
                (scores, choice)
            }
            Kernels::Simd(isa) => {
                let n = logits.len();
                let bias = correction_bias.map(|b| &b[..n]);
                let (mut scores, mut choice) = (vec![0.0; n], vec![0.0; n]);
                match p.scoring {
                    ScoringFunc::Sigmoid => elementwise::router_scores(isa, logits, bias, &mut scores, &mut choice),
                    ScoringFunc::Softmax => {
                        scores.copy_from_slice(logits);
                        elementwise::softmax(isa, &mut scores);
                        match bias {
                            Some(b) => choice.iter_mut().zip(scores.iter().zip(b)).for_each(|(c, (s, b))| *c = s + b),
                            None => choice.copy_from_slice(&scores),
                        }
                    }
                }
                (scores, choice)
            }
        }
    }

    fn top(self, values: &[f32], k: usize) -> Vec<usize> {
        match self {
            Kernels::Reference => top_indices(values, k),
            Kernels::Simd(isa) => elementwise::top_k(isa, values, k),
        }
    }
}

fn route_with(kernels: Kernels, p: &RouterParams, logits: &[f32], correction_bias: Option<&[f32]>) -> Vec<(usize, f32)> {
    let (scores, mut choice) = kernels.scores(p, logits, correction_bias);
    if p.n_group > 1 && p.topk_group < p.n_group {
        let per_group = p.n_experts / p.n_group;
        let group_scores: Vec<f32> = choice
            .chunks(per_group)
            .map(|g| kernels.top(g, 2).iter().map(|&i| g[i]).sum())
            .collect();
        let kept = kernels.top(&group_scores, p.topk_group);
        for (g, chunk) in choice.chunks_mut(per_group).enumerate() {
            if !kept.contains(&g) {
                // As transformers: masked experts score 0, not -inf.
                chunk.fill(0.0);
            }
        }
    }
    let chosen = kernels.top(&choice, p.top_k);
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

    /// Whether the `count` best of `values` (with a flag: masked to exactly
    /// 0) are ordered with gaps above `gap`, down to the next value: then
    /// errors below `gap` cannot change which are chosen, nor their order.
    /// Two masked zeros tie exactly on every path and need no gap.
    fn separated(values: &[(f64, bool)], count: usize, gap: f64) -> bool {
        let mut v = values.to_vec();
        v.sort_by(|a, b| b.0.total_cmp(&a.0));
        v.windows(2).take(count).all(|w| w[0].0 - w[1].0 > gap || (w[0].1 && w[1].1))
    }

    /// The SIMD routing chooses exactly the scalar routing's experts, in the
    /// same order, whenever no two candidates are within the kernels'
    /// tolerance (the vector scores are within 1e-6 relative of the scalar
    /// ones, so we ask for gaps of 1e-5 where they matter); the weights
    /// agree to that tolerance.
    fn check_simd_route(p: &RouterParams, logits: &[f32], bias: Option<&[f32]>) -> Result<(), TestCaseError> {
        let mut scores: Vec<f32> = logits.to_vec();
        match p.scoring {
            ScoringFunc::Sigmoid => scores.iter_mut().for_each(|x| *x = 1.0 / (1.0 + (-*x).exp())),
            ScoringFunc::Softmax => {
                crate::elementwise::softmax(&mut scores);
            }
        }
        let mut choice: Vec<(f64, bool)> = scores.iter().enumerate().map(|(i, &s)| (s as f64 + bias.map_or(0.0, |b| b[i] as f64), false)).collect();
        if p.n_group > 1 && p.topk_group < p.n_group {
            let per_group = p.n_experts / p.n_group;
            let sums: Vec<(f64, bool)> = choice
                .chunks(per_group)
                .map(|g| {
                    let mut g: Vec<f64> = g.iter().map(|v| v.0).collect();
                    g.sort_by(|a, b| b.total_cmp(a));
                    (g.iter().take(2).sum(), false)
                })
                .collect();
            prop_assume!(separated(&sums, p.topk_group, 1e-5));
            let mut order: Vec<usize> = (0..sums.len()).collect();
            order.sort_by(|&a, &b| sums[b].0.total_cmp(&sums[a].0));
            for g in &order[p.topk_group..] {
                choice[g * per_group..(g + 1) * per_group].fill((0.0, true));
            }
        }
        prop_assume!(separated(&choice, p.top_k, 1e-5));
        let want = route(p, logits, bias);
        for isa in crate::cpu::isa::supported() {
            let got = route_simd(isa, p, logits, bias);
            prop_assert_eq!(got.iter().map(|x| x.0).collect::<Vec<_>>(), want.iter().map(|x| x.0).collect::<Vec<_>>(), "{}", isa);
            for (g, w) in got.iter().zip(&want) {
                prop_assert!((g.1 - w.1).abs() <= 1e-5 * w.1.abs() + 1e-30, "{isa}: weight {} vs {}", g.1, w.1);
            }
        }
        Ok(())
    }

    proptest! {
        #[test]
        fn simd_routing_matches_scalar_64(
            logits in prop::collection::vec(-8.0f32..8.0, 64),
            bias in prop::option::of(prop::collection::vec(-0.5f32..0.5, 64)),
            (n_group, topk_group) in prop::sample::select(vec![(1usize, 1usize), (8, 4), (8, 3), (4, 2), (64, 8)]),
            top_k in 1usize..=8,
            softmax in any::<bool>(),
        ) {
            let mut p = params(64, top_k, n_group, topk_group);
            if softmax {
                p.scoring = ScoringFunc::Softmax;
            }
            check_simd_route(&p, &logits, bias.as_deref())?;
        }

        /// DeepSeek-V3's shape: 256 experts in 8 groups, 4 kept, top 8.
        #[test]
        fn simd_routing_matches_scalar_deepseek(perm in Just((0..256).collect::<Vec<usize>>()).prop_shuffle(), jitter in prop::collection::vec(0.0f32..0.01, 256)) {
            // Distinct logits (0.03 apart) so that scores are well separated.
            let logits: Vec<f32> = perm.iter().zip(&jitter).map(|(&i, &j)| -4.0 + 0.03 * i as f32 + j).collect();
            check_simd_route(&params(256, 8, 8, 4), &logits, None)?;
        }

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
