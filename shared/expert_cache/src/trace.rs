//! Synthetic routing traces with the properties the papers report, to compare
//! the replacement policies where real routing traces cannot be had (none can
//! be recorded here: no full-size MoE checkpoint runs on this machine).
//!
//! A trace is a sequence of decode steps; each step routes `tokens_per_step`
//! tokens (one per sequence of the batch) through `layers` MoE layers, each
//! token to `top_k` distinct experts of `n_experts`. Four properties are
//! modelled, each with its own knob:
//!
//! - **Skewed expert popularity** ([`TraceParams::zipf_exponent`]): a fresh
//!   choice draws experts without replacement with probability ∝ 1/rank^s,
//!   each layer with its own random ranking (before each sequence's own
//!   preference, below). HybriMoE measures that expert
//!   activation frequency is skewed but "more evenly distributed" than neuron
//!   activations (hybrimoe.txt §III, Challenge 1, fig. 3(a)), and DALI that
//!   "the token count routed to each expert … vary widely across inputs"
//!   (dali.txt §1).
//! - **Temporal locality** ([`TraceParams::temporal_overlap`]): each expert a
//!   token used at step t in a layer is used by the same sequence at step t+1
//!   in that layer with this probability (plus whatever chance brings). DALI
//!   shows "a pronounced diagonal" of high-workload experts between adjacent
//!   tokens (dali.txt §3.3, fig. 8), and HybriMoE that experts used now and
//!   high-score experts are likely reused next iteration (hybrimoe.txt §III,
//!   Opportunity 1, fig. 3(b)).
//! - **Correlation between consecutive layers**
//!   ([`TraceParams::layer_correlation`]): each expert a token uses in layer l
//!   pulls, with this probability, a fixed partner expert into the token's
//!   choice in layer l+1 (partners map popularity rank to rank, so the
//!   popularity of every layer stays what the exponent says). HybriMoE:
//!   "MoE models often exhibit high activation similarity between adjacent
//!   layers" (hybrimoe.txt §III, Opportunity 1; §IV-C on residual
//!   connections); DALI predicts layer l+1's experts from layer l's input with
//!   cosine similarity 0.89–0.93 after its residual correction (dali.txt §A.5,
//!   Table 8).
//!
//! - **Each sequence's own experts** ([`TraceParams::sequence_affinity`],
//!   [`TraceParams::sequence_length`]): a sequence adds its own random offset
//!   to each expert's router logit, per layer, for its whole life, and
//!   sequences end and are replaced in the batch. DALI: experts serve
//!   knowledge domains and "adjacent tokens within a sequence often share
//!   similar semantics" (dali.txt §3.3); its hit rate climbs as a sequence
//!   goes on (fig. 18d). This is also what makes a high-score expert that was
//!   *not* activated likelier to be used soon, HybriMoE's fig. 3(b).
//!
//! Router scores: every token gets a full softmax over its fresh logits
//! (log popularity + the sequence's affinity + Gumbel noise; the Gumbel-top-k
//! trick is what makes a fresh draw follow those weights exactly); the chosen
//! experts are given the largest of those logits, so a token's top-k by score
//! are exactly its experts, and the next k are reported as runners-up.
//!
//! Generation is deterministic for a seed (ChaCha8).

use crate::policy::{apply_swaps, new_policy, PolicyKind, PolicyParams};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rand::seq::SliceRandom;

/// What a trace looks like. Build with [`TraceParams::new`] (documented
/// defaults) and change the fields you need.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TraceParams {
    /// Routed experts per MoE layer.
    pub n_experts: usize,
    /// Experts each token is routed to per layer.
    pub top_k: usize,
    /// MoE layers.
    pub layers: usize,
    /// Tokens per step: the decode batch (one token per sequence).
    pub tokens_per_step: usize,
    /// Popularity ∝ 1/rank^s of a fresh choice; 0 is uniform. Default 0.5.
    pub zipf_exponent: f64,
    /// Probability that each expert a sequence used at step t in a layer is
    /// used again at t+1 in that layer; 0 is memoryless. Default 0.2.
    pub temporal_overlap: f64,
    /// Probability that each expert a token uses in layer l brings its
    /// partner into the token's choice in layer l+1. Default 0.3.
    pub layer_correlation: f64,
    /// Standard deviation of each sequence's own preference for each expert
    /// (a Gaussian offset on its router logits, per layer, drawn when the
    /// sequence starts and kept for its life); 0 = every sequence routes
    /// alike. Default 1.0.
    pub sequence_affinity: f64,
    /// Mean decode length of a sequence, in steps: each step a sequence ends
    /// with probability 1/this and a new one (new preferences, no history)
    /// takes its place in the batch. Default 64.
    pub sequence_length: f64,
}

// The defaults. The papers publish no exponent or overlap, only hit rates;
// these were set so that LRU (two swaps a step) on a DeepSeek-V2-Lite shape
// (64 experts, top-6, batch 1, a 25% cache: HybriMoE's setting, hybrimoe.txt
// Table II and §VI-C) hits about what HybriMoE measured for LRU there, 47.7%
// (and 45.0% on Qwen2): 48% on seeds 11, 22, 33. The comparison between the
// policies was not a target.

/// Default [`TraceParams::zipf_exponent`]: HybriMoE finds expert popularity
/// skewed but much flatter than neuron sparsity (hybrimoe.txt fig. 3(a)), so
/// flatter than the classic Zipf's 1.
pub const DEFAULT_ZIPF_EXPONENT: f64 = 0.5;
/// Default [`TraceParams::temporal_overlap`]: DALI's fig. 8 diagonal is clear,
/// yet whole expert sets change a lot from token to token: HybriMoE's LRU on
/// Mixtral at a 25% cache hits 30.2% against a 25% chance level (§VI-C).
pub const DEFAULT_TEMPORAL_OVERLAP: f64 = 0.2;
/// Default [`TraceParams::layer_correlation`]. Adjacent layers are similar, but
/// a layer's own gate still decides: DALI's prediction of layer l+1 from layer
/// l's raw input is poor before its residual correction (dali.txt §4.2).
pub const DEFAULT_LAYER_CORRELATION: f64 = 0.3;
/// Default [`TraceParams::sequence_affinity`]. "MoE experts are typically
/// responsible for different knowledge domains, and adjacent tokens within a
/// sequence often share similar semantics" (dali.txt §3.3), and DALI's hit
/// rate climbs as a sequence goes on (fig. 18d): each sequence leans on its
/// own experts. An offset of standard deviation 1 makes a sequence's favourite
/// expert a few times likelier than its popularity alone says.
pub const DEFAULT_SEQUENCE_AFFINITY: f64 = 1.0;
/// Default [`TraceParams::sequence_length`]: DALI's decoding length (64 tokens,
/// dali.txt fig. 18d and Table 9).
pub const DEFAULT_SEQUENCE_LENGTH: f64 = 64.0;

impl TraceParams {
    /// The given shape with the default skew, locality and layer correlation.
    pub fn new(n_experts: usize, top_k: usize, layers: usize, tokens_per_step: usize) -> Self {
        Self {
            n_experts,
            top_k,
            layers,
            tokens_per_step,
            zipf_exponent: DEFAULT_ZIPF_EXPONENT,
            temporal_overlap: DEFAULT_TEMPORAL_OVERLAP,
            layer_correlation: DEFAULT_LAYER_CORRELATION,
            sequence_affinity: DEFAULT_SEQUENCE_AFFINITY,
            sequence_length: DEFAULT_SEQUENCE_LENGTH,
        }
    }

    /// The given shape with no skew, no memory and no layer correlation:
    /// every step's experts are uniform draws, independent of everything.
    pub fn uniform(n_experts: usize, top_k: usize, layers: usize, tokens_per_step: usize) -> Self {
        Self {
            zipf_exponent: 0.0,
            temporal_overlap: 0.0,
            layer_correlation: 0.0,
            sequence_affinity: 0.0,
            ..Self::new(n_experts, top_k, layers, tokens_per_step)
        }
    }

    pub fn validate(&self) -> Result<(), TraceError> {
        if self.n_experts == 0 {
            return Err(TraceError::Shape("n_experts must be at least 1".into()));
        }
        if self.top_k == 0 || self.top_k > self.n_experts {
            return Err(TraceError::Shape(format!(
                "top_k must be in 1..={} (n_experts), got {}",
                self.n_experts, self.top_k
            )));
        }
        if self.layers == 0 {
            return Err(TraceError::Shape("layers must be at least 1".into()));
        }
        if self.tokens_per_step == 0 {
            return Err(TraceError::Shape("tokens_per_step must be at least 1".into()));
        }
        for (name, x) in [
            ("zipf_exponent", self.zipf_exponent),
            ("sequence_affinity", self.sequence_affinity),
        ] {
            if !(x >= 0.0 && x.is_finite()) {
                return Err(TraceError::Value(name, x));
            }
        }
        // Infinity is allowed: sequences that never end.
        if self.sequence_length.is_nan() || self.sequence_length < 1.0 {
            return Err(TraceError::Value("sequence_length", self.sequence_length));
        }
        for (name, p) in [
            ("temporal_overlap", self.temporal_overlap),
            ("layer_correlation", self.layer_correlation),
        ] {
            if !(0.0..=1.0).contains(&p) {
                return Err(TraceError::Value(name, p));
            }
        }
        Ok(())
    }
}

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum TraceError {
    #[error("trace shape: {0}")]
    Shape(String),
    #[error("trace parameter {0} out of range: {1} (probabilities must be in [0, 1], the exponent and affinity finite and ≥ 0, the sequence length ≥ 1)")]
    Value(&'static str, f64),
}

/// One token's routing in one layer.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenRoute {
    /// Its `top_k` experts with their router probabilities (before top-k
    /// renormalisation), highest first.
    pub experts: Vec<(usize, f32)>,
    /// The next `top_k` experts by probability (fewer when there are fewer
    /// experts), highest first: what HybriMoE's TopP (p = 2·top-k) also sees.
    pub runners_up: Vec<(usize, f32)>,
}

/// One layer of one step: a route per token.
#[derive(Clone, Debug, PartialEq)]
pub struct LayerRoutes {
    pub tokens: Vec<TokenRoute>,
}

impl LayerRoutes {
    /// Tokens routed to each expert (the `loads` of
    /// [`ReplacementPolicy::observe`](crate::policy::ReplacementPolicy::observe)).
    pub fn loads(&self, n_experts: usize) -> Vec<u32> {
        let mut loads = vec![0u32; n_experts];
        for t in &self.tokens {
            for &(e, _) in &t.experts {
                loads[e] += 1;
            }
        }
        loads
    }

    /// Sum over tokens of each expert's router probability, over each token's
    /// top 2·k (its experts and runners-up): the `scores` of `observe`, as a
    /// caller with the gate's probabilities would pass them.
    pub fn scores(&self, n_experts: usize) -> Vec<f32> {
        let mut scores = vec![0f32; n_experts];
        for t in &self.tokens {
            for &(e, s) in t.experts.iter().chain(&t.runners_up) {
                scores[e] += s;
            }
        }
        scores
    }

    /// The experts at least one token uses, ascending.
    pub fn activated(&self) -> Vec<usize> {
        let mut v: Vec<usize> = self
            .tokens
            .iter()
            .flat_map(|t| t.experts.iter().map(|&(e, _)| e))
            .collect();
        v.sort_unstable();
        v.dedup();
        v
    }
}

/// One decode step: a [`LayerRoutes`] per MoE layer.
#[derive(Clone, Debug, PartialEq)]
pub struct Step {
    pub layers: Vec<LayerRoutes>,
}

/// A seeded generator of steps; see the module documentation for the model.
pub struct TraceGenerator {
    p: TraceParams,
    rng: ChaCha8Rng,
    /// `log_pop[l][e]`: log of expert e's popularity in layer l (−s·ln rank).
    log_pop: Vec<Vec<f64>>,
    /// `partner[l][e]`: the expert of layer l+1 that expert e of layer l pulls
    /// in (same popularity rank).
    partner: Vec<Vec<usize>>,
    /// `prev[token][l]`: the token's experts in layer l at the last step.
    prev: Vec<Vec<Vec<usize>>>,
    /// `affinity[token][l][e]`: the sequence's own logit offset for expert e.
    affinity: Vec<Vec<Vec<f64>>>,
}

impl TraceGenerator {
    pub fn new(params: TraceParams, seed: u64) -> Result<Self, TraceError> {
        params.validate()?;
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let n = params.n_experts;
        // by_rank[l][r]: the expert of rank r (0 = most popular) in layer l.
        let by_rank: Vec<Vec<usize>> = (0..params.layers)
            .map(|_| {
                let mut v: Vec<usize> = (0..n).collect();
                v.shuffle(&mut rng);
                v
            })
            .collect();
        let log_pop = by_rank
            .iter()
            .map(|order| {
                let mut lp = vec![0.0; n];
                for (r, &e) in order.iter().enumerate() {
                    lp[e] = -params.zipf_exponent * ((r + 1) as f64).ln();
                }
                lp
            })
            .collect();
        let partner = by_rank
            .windows(2)
            .map(|w| {
                let mut m = vec![0; n];
                for (r, &e) in w[0].iter().enumerate() {
                    m[e] = w[1][r];
                }
                m
            })
            .collect();
        let mut g = Self {
            p: params,
            rng,
            log_pop,
            partner,
            prev: vec![vec![Vec::new(); params.layers]; params.tokens_per_step],
            affinity: vec![vec![vec![0.0; n]; params.layers]; params.tokens_per_step],
        };
        for t in 0..params.tokens_per_step {
            g.start_sequence(t);
        }
        Ok(g)
    }

    /// A new sequence in batch slot `t`: its own preferences, no history.
    fn start_sequence(&mut self, t: usize) {
        let sigma = self.p.sequence_affinity;
        for l in 0..self.p.layers {
            self.prev[t][l].clear();
            for e in 0..self.p.n_experts {
                self.affinity[t][l][e] = if sigma > 0.0 {
                    sigma * standard_normal(&mut self.rng)
                } else {
                    0.0
                };
            }
        }
    }

    pub fn params(&self) -> &TraceParams {
        &self.p
    }

    /// The next decode step.
    pub fn next_step(&mut self) -> Step {
        let TraceParams {
            layers,
            tokens_per_step,
            ..
        } = self.p;
        let mut out: Vec<LayerRoutes> = (0..layers)
            .map(|_| LayerRoutes {
                tokens: Vec::with_capacity(tokens_per_step),
            })
            .collect();
        for t in 0..tokens_per_step {
            if self.rng.gen::<f64>() < 1.0 / self.p.sequence_length {
                self.start_sequence(t);
            }
            for l in 0..layers {
                let above = if l == 0 {
                    None
                } else {
                    Some(out[l - 1].tokens[t].experts.clone())
                };
                let route = self.route(t, l, above.as_deref());
                self.prev[t][l] = route.experts.iter().map(|&(e, _)| e).collect();
                out[l].tokens.push(route);
            }
        }
        Step { layers: out }
    }

    /// `steps` steps.
    pub fn steps(&mut self, steps: usize) -> Vec<Step> {
        (0..steps).map(|_| self.next_step()).collect()
    }

    /// Token `t`'s route in layer `l`, given its route in layer l−1 this step.
    fn route(&mut self, t: usize, l: usize, above: Option<&[(usize, f32)]>) -> TokenRoute {
        let (n, k) = (self.p.n_experts, self.p.top_k);
        let mut chosen: Vec<usize> = Vec::with_capacity(k);
        let mut taken = vec![false; n];
        // Temporal locality: keep each of last step's experts with q.
        for i in 0..self.prev[t][l].len() {
            let e = self.prev[t][l][i];
            if self.rng.gen::<f64>() < self.p.temporal_overlap {
                chosen.push(e);
                taken[e] = true;
            }
        }
        // Layer correlation: the experts of the layer above pull in their
        // partners, highest-score first, while there is room.
        if let Some(above) = above {
            for &(e, _) in above {
                let m = self.partner[l - 1][e];
                if chosen.len() < k && !taken[m] && self.rng.gen::<f64>() < self.p.layer_correlation
                {
                    chosen.push(m);
                    taken[m] = true;
                }
            }
        }
        // Fresh logits: log popularity + the sequence's affinity + Gumbel noise. The top of these among
        // the experts not yet chosen fills the rest (sampling without
        // replacement ∝ popularity), and the next k are the runners-up.
        let g: Vec<f64> = self.log_pop[l]
            .iter()
            .zip(&self.affinity[t][l])
            .map(|(&lp, &a)| {
                let u: f64 = self.rng.gen_range(f64::MIN_POSITIVE..1.0);
                lp + a - (-u.ln()).ln()
            })
            .collect();
        let mut rest: Vec<usize> = (0..n).filter(|&e| !taken[e]).collect();
        rest.sort_by(|&a, &b| g[b].total_cmp(&g[a]).then(a.cmp(&b)));
        let fill = k - chosen.len();
        chosen.extend_from_slice(&rest[..fill]);
        let runners: Vec<usize> = rest[fill..].iter().copied().take(k).collect();

        // Scores: the largest logits go to the chosen (in their own logits'
        // order), the next to the runners-up; the multiset of logits is g's,
        // so the softmax normaliser is g's too.
        chosen.sort_by(|&a, &b| g[b].total_cmp(&g[a]).then(a.cmp(&b)));
        let mut sorted = g.clone();
        sorted.sort_by(|a, b| b.total_cmp(a));
        let max = sorted[0];
        let z: f64 = sorted.iter().map(|&x| (x - max).exp()).sum();
        let prob = |i: usize| ((sorted[i] - max).exp() / z) as f32;
        TokenRoute {
            experts: chosen.iter().enumerate().map(|(i, &e)| (e, prob(i))).collect(),
            runners_up: runners
                .iter()
                .enumerate()
                .map(|(i, &e)| (e, prob(k + i)))
                .collect(),
        }
    }
}

/// Hits and lookups of a replayed cache.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HitCount {
    pub hits: u64,
    pub lookups: u64,
}

impl HitCount {
    pub fn rate(&self) -> f64 {
        if self.lookups == 0 {
            0.0
        } else {
            self.hits as f64 / self.lookups as f64
        }
    }

    pub fn add(&mut self, other: HitCount) {
        self.hits += other.hits;
        self.lookups += other.lookups;
    }
}

/// Replays `trace` through a cache of `capacity` experts per layer, starting
/// empty, with a policy of `kind` per layer: each step and layer, first the
/// lookups (an activated expert is a hit when it is cached as the layer runs),
/// then the policy observes the step and its swaps (at most `max_swaps`) are
/// applied, so they serve the steps after. Steps before `warmup` are run but
/// not counted. A policy that breaks the swap contract is an error naming
/// the step, the layer and what broke.
pub fn replay(
    kind: PolicyKind,
    params: &PolicyParams,
    trace: &[Step],
    n_experts: usize,
    capacity: usize,
    max_swaps: usize,
    warmup: usize,
) -> Result<HitCount, String> {
    let layers = trace.first().map_or(0, |s| s.layers.len());
    let mut policies: Vec<_> = (0..layers)
        .map(|_| new_policy(kind, n_experts, params))
        .collect();
    let mut cached = vec![vec![false; n_experts]; layers];
    let mut count = HitCount::default();
    for (t, step) in trace.iter().enumerate() {
        if step.layers.len() != layers {
            return Err(format!("step {t} has {} layers, the first had {layers}", step.layers.len()));
        }
        for (l, routes) in step.layers.iter().enumerate() {
            let active = routes.activated();
            if let Some(&e) = active.iter().find(|&&e| e >= n_experts) {
                return Err(format!("step {t} layer {l} routes to expert {e} of {n_experts}"));
            }
            if t >= warmup {
                count.lookups += active.len() as u64;
                count.hits += active.iter().filter(|&&e| cached[l][e]).count() as u64;
            }
            let p = &mut policies[l];
            p.observe(&routes.loads(n_experts), &routes.scores(n_experts));
            let swaps = p.swaps(&cached[l], capacity, max_swaps);
            apply_swaps(&mut cached[l], &swaps, capacity, max_swaps)
                .map_err(|e| format!("{kind} at step {t} layer {l}: {e}"))?;
        }
    }
    Ok(count)
}

/// A standard normal draw (Box–Muller; one of the pair is enough here).
fn standard_normal(rng: &mut ChaCha8Rng) -> f64 {
    let u1: f64 = rng.gen_range(f64::MIN_POSITIVE..1.0);
    let u2: f64 = rng.gen();
    (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::PolicyParams;

    fn experts(r: &TokenRoute) -> Vec<usize> {
        let mut v: Vec<usize> = r.experts.iter().map(|&(e, _)| e).collect();
        v.sort_unstable();
        v
    }

    #[test]
    fn same_seed_same_trace_other_seed_other_trace() {
        let p = TraceParams::new(32, 4, 3, 2);
        let a = TraceGenerator::new(p, 7).unwrap().steps(20);
        let b = TraceGenerator::new(p, 7).unwrap().steps(20);
        let c = TraceGenerator::new(p, 8).unwrap().steps(20);
        assert_eq!(a, b);
        assert_ne!(a, c);
    }

    #[test]
    fn routes_are_well_formed() {
        for n in [8, 16, 256] {
            let p = TraceParams::new(n, 2.min(n), 4, 3);
            let mut g = TraceGenerator::new(p, 1).unwrap();
            for step in g.steps(50) {
                assert_eq!(step.layers.len(), 4);
                for layer in &step.layers {
                    assert_eq!(layer.tokens.len(), 3);
                    for r in &layer.tokens {
                        let mut all: Vec<usize> = r
                            .experts
                            .iter()
                            .chain(&r.runners_up)
                            .map(|&(e, _)| e)
                            .collect();
                        assert_eq!(r.experts.len(), p.top_k);
                        assert_eq!(r.runners_up.len(), p.top_k.min(n - p.top_k));
                        all.sort_unstable();
                        all.dedup();
                        assert_eq!(all.len(), r.experts.len() + r.runners_up.len());
                        assert!(all.iter().all(|&e| e < n));
                        // Probabilities descend through experts then runners-up.
                        let s: Vec<f32> = r
                            .experts
                            .iter()
                            .chain(&r.runners_up)
                            .map(|&(_, s)| s)
                            .collect();
                        assert!(s.windows(2).all(|w| w[0] >= w[1]), "{s:?}");
                        assert!(s.iter().all(|&x| x > 0.0));
                        assert!(s.iter().sum::<f32>() <= 1.0 + 1e-5);
                    }
                }
            }
        }
    }

    #[test]
    fn loads_scores_and_activated_add_up() {
        let layer = LayerRoutes {
            tokens: vec![
                TokenRoute {
                    experts: vec![(2, 0.5), (0, 0.25)],
                    runners_up: vec![(1, 0.125)],
                },
                TokenRoute {
                    experts: vec![(2, 0.25), (3, 0.125)],
                    runners_up: vec![(0, 0.0625)],
                },
            ],
        };
        assert_eq!(layer.loads(4), vec![1, 0, 2, 1]);
        assert_eq!(layer.scores(4), vec![0.3125, 0.125, 0.75, 0.125]);
        assert_eq!(layer.activated(), vec![0, 2, 3]);
    }

    /// Fraction of a sequence's experts at step t+1 that it also used at t,
    /// over all tokens and layers.
    fn measured_overlap(p: TraceParams, steps: usize) -> f64 {
        let trace = TraceGenerator::new(p, 3).unwrap().steps(steps);
        let (mut same, mut all) = (0usize, 0usize);
        for w in trace.windows(2) {
            for (a, b) in w[0].layers.iter().zip(&w[1].layers) {
                for (ta, tb) in a.tokens.iter().zip(&b.tokens) {
                    let prev = experts(ta);
                    same += experts(tb).iter().filter(|e| prev.contains(e)).count();
                    all += p.top_k;
                }
            }
        }
        same as f64 / all as f64
    }

    #[test]
    fn temporal_overlap_is_what_was_asked_plus_chance() {
        // Uniform, memoryless: overlap is chance, k/n.
        let u = TraceParams::uniform(64, 4, 2, 2);
        let o = measured_overlap(u, 2000);
        assert!((o - 4.0 / 64.0).abs() < 0.01, "{o}");
        // q = 0.5 on top of that: about q + (1 − q)·chance.
        // Sequences that never end, so no history is dropped.
        let u = TraceParams {
            sequence_length: f64::INFINITY,
            ..u
        };
        let p = TraceParams {
            temporal_overlap: 0.5,
            ..u
        };
        let o = measured_overlap(p, 2000);
        let want = 0.5 + 0.5 * 4.0 / 64.0;
        assert!((o - want).abs() < 0.02, "{o} vs {want}");
        let p = TraceParams {
            temporal_overlap: 1.0,
            ..u
        };
        assert_eq!(measured_overlap(p, 50), 1.0);
    }

    #[test]
    fn popularity_follows_the_exponent() {
        let p = TraceParams {
            zipf_exponent: 1.0,
            temporal_overlap: 0.0,
            layer_correlation: 0.0,
            sequence_affinity: 0.0,
            ..TraceParams::new(64, 1, 1, 1)
        };
        let trace = TraceGenerator::new(p, 5).unwrap().steps(20_000);
        let mut counts = vec![0usize; 64];
        for s in &trace {
            for (e, &l) in s.layers[0].loads(64).iter().enumerate() {
                counts[e] += l as usize;
            }
        }
        counts.sort_unstable_by(|a, b| b.cmp(a));
        // top-1 sampling ∝ 1/rank: the most popular gets 1/H(64) ≈ 21%, the
        // second half of that.
        let h: f64 = (1..=64).map(|r| 1.0 / r as f64).sum();
        let top = counts[0] as f64 / 20_000.0;
        assert!((top - 1.0 / h).abs() < 0.015, "{top} vs {}", 1.0 / h);
        let second = counts[1] as f64 / 20_000.0;
        assert!((second - 0.5 / h).abs() < 0.015, "{second}");
        // And uniform is flat.
        let p = TraceParams { zipf_exponent: 0.0, ..p };
        let trace = TraceGenerator::new(p, 5).unwrap().steps(20_000);
        let mut counts = vec![0usize; 64];
        for s in &trace {
            counts[s.layers[0].tokens[0].experts[0].0] += 1;
        }
        let max = *counts.iter().max().unwrap() as f64 / 20_000.0;
        assert!(max < 2.0 / 64.0, "{max}");
    }

    #[test]
    fn layer_correlation_pulls_in_partners() {
        // c = 1, nothing else: layer l+1's experts are layer l's partners.
        let p = TraceParams {
            layer_correlation: 1.0,
            ..TraceParams::uniform(32, 4, 3, 1)
        };
        let mut g = TraceGenerator::new(p, 9).unwrap();
        let partner = g.partner.clone();
        for step in g.steps(30) {
            for l in 1..3 {
                let mut want: Vec<usize> = step.layers[l - 1].tokens[0]
                    .experts
                    .iter()
                    .map(|&(e, _)| partner[l - 1][e])
                    .collect();
                want.sort_unstable();
                assert_eq!(experts(&step.layers[l].tokens[0]), want);
            }
        }
        // c = 0: independent, overlap with the partners is chance (k/n).
        let p = TraceParams::uniform(32, 4, 2, 1);
        let mut g = TraceGenerator::new(p, 9).unwrap();
        let partner = g.partner.clone();
        let (mut hit, mut all) = (0, 0);
        for step in g.steps(2000) {
            let want: Vec<usize> = step.layers[0].tokens[0]
                .experts
                .iter()
                .map(|&(e, _)| partner[0][e])
                .collect();
            hit += experts(&step.layers[1].tokens[0])
                .iter()
                .filter(|e| want.contains(e))
                .count();
            all += 4;
        }
        let f = hit as f64 / all as f64;
        assert!((f - 4.0 / 32.0).abs() < 0.02, "{f}");
    }

    #[test]
    fn a_sequence_leans_on_its_own_experts_and_runners_up_come_back() {
        // No popularity, no kept experts: only the affinity links steps.
        let u = TraceParams {
            sequence_length: f64::INFINITY,
            ..TraceParams::uniform(64, 4, 1, 1)
        };
        let chance = 4.0 / 64.0;
        let p = TraceParams {
            sequence_affinity: 1.0,
            ..u
        };
        let overlap = measured_overlap(p, 2000);
        assert!(overlap > 2.0 * chance, "{overlap}");
        // A runner-up at t is routed at t+1 more often than chance, more
        // often than an expert that was neither.
        let trace = TraceGenerator::new(p, 4).unwrap().steps(2000);
        let (mut back, mut all) = (0, 0);
        for w in trace.windows(2) {
            let next = experts(&w[1].layers[0].tokens[0]);
            for &(e, _) in &w[0].layers[0].tokens[0].runners_up {
                back += usize::from(next.contains(&e));
                all += 1;
            }
        }
        let f = back as f64 / all as f64;
        assert!(f > 1.5 * chance, "{f}");
        // Without affinity both are chance.
        let o = measured_overlap(u, 2000);
        assert!((o - chance).abs() < 0.01, "{o}");
        // A sequence that ends takes its history with it: overlap of 1 drops
        // to about 1 − 1/length (plus chance).
        let p = TraceParams {
            temporal_overlap: 1.0,
            sequence_length: 4.0,
            ..u
        };
        let o = measured_overlap(p, 4000);
        let want = 0.75 + 0.25 * chance;
        assert!((o - want).abs() < 0.03, "{o} vs {want}");
    }

    #[test]
    fn replay_counts_hits_before_the_swaps() {
        // Expert 0 every step, one token, one layer; capacity 1, LRU.
        let step = Step {
            layers: vec![LayerRoutes {
                tokens: vec![TokenRoute {
                    experts: vec![(0, 0.9)],
                    runners_up: vec![],
                }],
            }],
        };
        let trace = vec![step; 10];
        let params = PolicyParams::new(0.5, 2, 4, 1).unwrap();
        let h = replay(PolicyKind::Lru, &params, &trace, 2, 1, 2, 0).unwrap();
        // The first lookup misses (empty cache), the other nine hit.
        assert_eq!(h, HitCount { hits: 9, lookups: 10 });
        let h = replay(PolicyKind::Lru, &params, &trace, 2, 1, 2, 3).unwrap();
        assert_eq!(h, HitCount { hits: 7, lookups: 7 });
        // Capacity 0: never a hit. The window waits for its 4 steps.
        let h = replay(PolicyKind::Lru, &params, &trace, 2, 0, 2, 0).unwrap();
        assert_eq!(h.hits, 0);
        let h = replay(PolicyKind::Workload, &params, &trace, 2, 1, 1, 0).unwrap();
        assert_eq!(h, HitCount { hits: 6, lookups: 10 });
        // A trace naming an expert the cache does not have is an error.
        let err = replay(PolicyKind::Lru, &params, &trace, 0, 1, 2, 0).unwrap_err();
        assert!(err.contains("expert 0 of 0"), "{err}");
    }

    #[test]
    fn bad_parameters_are_clear_errors() {
        let ok = TraceParams::new(8, 2, 1, 1);
        let cases = [
            (TraceParams { n_experts: 0, ..ok }, "n_experts"),
            (TraceParams { top_k: 0, ..ok }, "top_k"),
            (TraceParams { top_k: 9, ..ok }, "top_k"),
            (TraceParams { layers: 0, ..ok }, "layers"),
            (TraceParams { tokens_per_step: 0, ..ok }, "tokens_per_step"),
            (TraceParams { zipf_exponent: -1.0, ..ok }, "zipf_exponent"),
            (TraceParams { zipf_exponent: f64::NAN, ..ok }, "zipf_exponent"),
            (TraceParams { temporal_overlap: 1.5, ..ok }, "temporal_overlap"),
            (TraceParams { layer_correlation: -0.1, ..ok }, "layer_correlation"),
            (TraceParams { sequence_affinity: -1.0, ..ok }, "sequence_affinity"),
            (TraceParams { sequence_affinity: f64::INFINITY, ..ok }, "sequence_affinity"),
            (TraceParams { sequence_length: 0.5, ..ok }, "sequence_length"),
            (TraceParams { sequence_length: f64::NAN, ..ok }, "sequence_length"),
        ];
        for (p, name) in cases {
            let err = TraceGenerator::new(p, 0).err().expect(name).to_string();
            assert!(err.contains(name), "{err}");
        }
    }
}
