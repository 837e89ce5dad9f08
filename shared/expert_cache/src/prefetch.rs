//! Which experts of the coming layers to copy to the device ahead of time,
//! from predicted loads (config `expert_prefetch`):
//! - [`PrefetchKind::Impact`]: HybriMoE's impact-driven prefetch (§IV-C). The
//!   caller applies the next three layers' gates to the current hidden state;
//!   [`impact`] copies the experts whose caching shortens those layers'
//!   simulated time (HybriMoE's assignment) the most.
//! - [`PrefetchKind::Residual`]: DALI's residual-based prefetch (§4.2). The
//!   caller predicts layer l+1's routing with `gate_{l+1}(h_l + r_l)`, `r_l`
//!   the mean of `h_{l+1} − h_l` over calibration tokens ([`ResidualMean`]);
//!   [`top_ps`] copies the PS uncached experts with the most predicted tokens.
//!
//! Both are pure choices; the hybrid placement issues the copies (in the
//! returned order) and makes room for them with its replacement policy.

use crate::assign::hybrimoe_timelines;
use crate::{Active, CostModel};
use std::cmp::Reverse;
use std::fmt;
use std::str::FromStr;

/// DALI's prefetch size for models with many fine-grained experts (its main
/// decode results, Fig. 12: "for DeepSeek and Qwen ... the prefetch size is 4").
pub const DEFAULT_PS: usize = 4;
/// DALI's prefetch size for few, large experts (Mixtral, Fig. 12 and 18a:
/// prefetching only the expert with the highest predicted load was fastest).
pub const DEFAULT_PS_FEW_EXPERTS: usize = 1;
/// How many upcoming layers HybriMoE predicts from the current hidden state.
pub const IMPACT_LAYERS: usize = 3;

/// Which prefetch runs (config `expert_prefetch`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PrefetchKind {
    None,
    Impact,
    Residual,
}

impl PrefetchKind {
    pub const ALL: [PrefetchKind; 3] = [PrefetchKind::None, PrefetchKind::Impact, PrefetchKind::Residual];

    pub fn as_str(self) -> &'static str {
        match self {
            PrefetchKind::None => "none",
            PrefetchKind::Impact => "impact",
            PrefetchKind::Residual => "residual",
        }
    }
}

impl fmt::Display for PrefetchKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for PrefetchKind {
    type Err = PrefetchError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        PrefetchKind::ALL
            .into_iter()
            .find(|k| k.as_str() == s)
            .ok_or_else(|| PrefetchError::UnknownKind(s.to_string()))
    }
}

#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PrefetchError {
    #[error("unknown expert prefetch {0:?}; expected one of: none, impact, residual")]
    UnknownKind(String),
    #[error("predicted loads for {predicted} layers but cached flags for {cached}")]
    LayerCount { predicted: usize, cached: usize },
    #[error("upcoming layer {layer}: predicted loads for {predicted} experts but cached flags for {cached}")]
    ExpertCount { layer: usize, predicted: usize, cached: usize },
    #[error("residual: hidden states of {h_l} and {h_next} values, expected equal multiples of the hidden size {dim}")]
    Shape { h_l: usize, h_next: usize, dim: usize },
    #[error("residual: no calibration tokens were added, so there is no mean")]
    NoCalibrationTokens,
}

/// DALI's top-PS: the `ps` experts with the most predicted tokens
/// (`predicted[e]`, for layer l+1) that are not cached and have at least one,
/// most tokens first, equal counts by lower expert id.
pub fn top_ps(predicted: &[usize], cached: &[bool], ps: usize) -> Result<Vec<usize>, PrefetchError> {
    let mut out = Vec::new();
    top_ps_into(predicted, cached, ps, &mut out)?;
    Ok(out)
}

/// [`top_ps`] into `out` (cleared first), allocation-free once `out` has
/// grown to the number of candidates.
pub fn top_ps_into(
    predicted: &[usize],
    cached: &[bool],
    ps: usize,
    out: &mut Vec<usize>,
) -> Result<(), PrefetchError> {
    out.clear();
    if predicted.len() != cached.len() {
        return Err(PrefetchError::ExpertCount { layer: 0, predicted: predicted.len(), cached: cached.len() });
    }
    out.extend((0..predicted.len()).filter(|&e| predicted[e] > 0 && !cached[e]));
    out.sort_unstable_by_key(|&e| (Reverse(predicted[e]), e));
    out.truncate(ps);
    Ok(())
}

/// Reusable buffers for [`impact_into`].
#[derive(Clone, Debug, Default)]
pub struct ImpactScratch {
    /// The upcoming layers' predicted active experts, back to back.
    active: Vec<Active>,
    /// `active[start[l]..start[l + 1]]` is upcoming layer `l`.
    start: Vec<usize>,
    /// Per layer, indices into its slice of `active`, highest load first.
    by_load: Vec<usize>,
    /// Per layer, the best copy left: (gain, index into `active`).
    best: Vec<Option<(f64, usize)>>,
    /// HybriMoE's queue, for its simulation.
    seq: Vec<usize>,
}

/// HybriMoE's impact-driven prefetch: up to `budget` copies `(upcoming layer,
/// expert)` for the layers `predicted` covers (index 0 is the next layer),
/// `predicted[l][e]` the tokens the caller's gate prediction routes to expert
/// `e`, `cached[l][e]` whether it is resident.
///
/// A copy's gain is how much it shortens its layer's simulated time under
/// HybriMoE's assignment ([`crate::assign`]) given the copies already chosen;
/// copies are chosen greedily, largest gain first, and only while a gain is
/// positive (a layer the CPU finishes first anyway gains nothing). The paper
/// gives no formula beyond "simulate the impact and prioritise the highest
/// gains", so two choices are ours: a gain in a later layer counts as much as
/// one in the next (the paper does not discount its three-layer prediction),
/// and equal gains go to the nearer layer, then the lower expert id, since a
/// nearer layer's prediction is the more accurate and its copy is needed
/// first. The result is in the order to issue the copies: nearer layers
/// first, and within a layer in the order chosen.
pub fn impact(
    predicted: &[Vec<usize>],
    cached: &[Vec<bool>],
    cost: &CostModel,
    budget: usize,
) -> Result<Vec<(usize, usize)>, PrefetchError> {
    let mut out = Vec::new();
    impact_into(predicted, cached, cost, budget, &mut ImpactScratch::default(), &mut out)?;
    Ok(out)
}

/// [`impact`] into `out` (cleared first), reusing `scratch`'s buffers.
pub fn impact_into(
    predicted: &[Vec<usize>],
    cached: &[Vec<bool>],
    cost: &CostModel,
    budget: usize,
    scratch: &mut ImpactScratch,
    out: &mut Vec<(usize, usize)>,
) -> Result<(), PrefetchError> {
    out.clear();
    if predicted.len() != cached.len() {
        return Err(PrefetchError::LayerCount { predicted: predicted.len(), cached: cached.len() });
    }
    for (layer, (p, c)) in predicted.iter().zip(cached).enumerate() {
        if p.len() != c.len() {
            return Err(PrefetchError::ExpertCount { layer, predicted: p.len(), cached: c.len() });
        }
    }
    if budget == 0 {
        return Ok(());
    }

    let s = scratch;
    s.active.clear();
    s.start.clear();
    s.by_load.clear();
    s.best.clear();
    for (p, c) in predicted.iter().zip(cached) {
        s.start.push(s.active.len());
        let first = s.active.len();
        s.active.extend(
            p.iter()
                .zip(c)
                .enumerate()
                .filter(|(_, (&tokens, _))| tokens > 0)
                .map(|(expert, (&tokens, &cached))| Active { expert, tokens, cached }),
        );
        // Loads never change while choosing, so each layer is sorted once.
        let layer = &s.active[first..];
        let from = s.by_load.len();
        s.by_load.extend(0..layer.len());
        s.by_load[from..].sort_unstable_by_key(|&i| (Reverse(layer[i].tokens), i));
    }
    s.start.push(s.active.len());
    for layer in 0..predicted.len() {
        let best = best_copy(s, layer, cost);
        s.best.push(best);
    }

    while out.len() < budget {
        // Strictly larger gains win, so ties stay with the nearer layer.
        let mut pick: Option<(usize, f64, usize)> = None;
        for (layer, best) in s.best.iter().enumerate() {
            if let Some((gain, i)) = *best {
                if pick.is_none_or(|(_, g, _)| gain > g) {
                    pick = Some((layer, gain, i));
                }
            }
        }
        let Some((layer, _, i)) = pick else { break };
        s.active[i].cached = true;
        out.push((layer, s.active[i].expert));
        s.best[layer] = best_copy(s, layer, cost);
    }
    // Stable: within a layer, copies stay in the order chosen.
    out.sort_by_key(|&(layer, _)| layer);
    Ok(())
}

/// The uncached expert of upcoming `layer` whose caching shortens the
/// layer's simulated time the most (lowest expert id among equals), with its
/// gain, or `None` when no copy shortens it.
fn best_copy(s: &mut ImpactScratch, layer: usize, cost: &CostModel) -> Option<(f64, usize)> {
    let (lo, hi) = (s.start[layer], s.start[layer + 1]);
    let active = &s.active[lo..hi];
    let by_load = &s.by_load[lo..hi];
    let seq = &mut s.seq;
    let base = hybrimoe_timelines(active, cost, by_load, |i| active[i].cached, seq, None).layer();
    let mut best: Option<(f64, usize)> = None;
    // Candidates in expert order (the layer's slice is built in expert
    // order), so that a strictly larger gain is needed to displace one.
    for cand in 0..active.len() {
        if active[cand].cached {
            continue;
        }
        let with = hybrimoe_timelines(active, cost, by_load, |i| i == cand || active[i].cached, seq, None);
        let gain = base - with.layer();
        if gain > 0.0 && best.is_none_or(|(g, _)| gain > g) {
            best = Some((gain, lo + cand));
        }
    }
    best
}

/// DALI's residual vector of one layer, `r_l = mean over calibration tokens
/// of (h_{l+1} − h_l)` (its Eq. 11), accumulated token by token in `f64` so
/// that a long calibration set loses no precision to rounding.
#[derive(Clone, Debug, PartialEq)]
pub struct ResidualMean {
    pub sum: Vec<f64>,
    /// Calibration tokens added.
    pub count: u64,
}

impl ResidualMean {
    /// A mean over hidden states of `dim` values.
    pub fn new(dim: usize) -> Self {
        ResidualMean { sum: vec![0.0; dim], count: 0 }
    }

    /// Adds one or more tokens: `h_l` and `h_next` are the gate inputs of
    /// layers l and l+1 for the same tokens, `dim` values per token, back to
    /// back.
    pub fn add(&mut self, h_l: &[f32], h_next: &[f32]) -> Result<(), PrefetchError> {
        let dim = self.sum.len();
        if h_l.len() != h_next.len() || dim == 0 || !h_l.len().is_multiple_of(dim) {
            return Err(PrefetchError::Shape { h_l: h_l.len(), h_next: h_next.len(), dim });
        }
        for (x, y) in h_l.chunks_exact(dim).zip(h_next.chunks_exact(dim)) {
            for ((s, &a), &b) in self.sum.iter_mut().zip(x).zip(y) {
                *s += f64::from(b) - f64::from(a);
            }
            self.count += 1;
        }
        Ok(())
    }

    /// `r_l`; an error before any token was added.
    pub fn mean(&self) -> Result<Vec<f32>, PrefetchError> {
        if self.count == 0 {
            return Err(PrefetchError::NoCalibrationTokens);
        }
        let n = self.count as f64;
        Ok(self.sum.iter().map(|&s| (s / n) as f32).collect())
    }
}
