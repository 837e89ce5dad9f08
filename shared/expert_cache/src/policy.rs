//! Replacement policies for one MoE layer's cached experts.
//!
//! The cache holds whole routed experts; its capacity is per layer (the caller
//! splits a total budget across layers) and there is one policy instance per
//! layer. A policy sees each decode step's per-expert loads and router scores
//! ([`ReplacementPolicy::observe`]) and answers which swaps would bring the
//! cached set toward what it wants ([`ReplacementPolicy::swaps`]). It never
//! holds the cached set itself: the caller passes what is cached now, so a
//! swap the caller could not apply (a copy that failed, a slot still busy)
//! simply shows up again next step instead of leaving the two views apart.
//!
//! The policies, from `shared/papers.md` §3–§4:
//! - [`PolicyKind::Mrs`]: HybriMoE's Minus Recent Score,
//!   `S ← α·TopP(s) + (1−α)·S` (hybrimoe.txt §IV-D, eq. 3; p = 2·top-k there,
//!   α = 0.5 in its code).
//! - [`PolicyKind::Workload`]: DALI's workload-aware window: token counts
//!   summed over `w` steps, then the `u` busiest uncached experts replace the
//!   `u` idlest cached ones (dali.txt §4.3, Algorithm 2; (w, u) = (4, 8) for
//!   DeepSeek/Qwen, (4, 1) for Mixtral, §6.4-3 and Table 9).
//! - [`PolicyKind::Lru`] and [`PolicyKind::Lfu`]: the classic baselines both
//!   papers compare against.
//!
//! Ties are broken by the lower expert index everywhere (for admission and for
//! eviction), so every decision is deterministic and testable.

use std::cmp::Ordering;
use std::fmt;
use std::str::FromStr;

/// One replacement: bring `admit` into the cache, in `evict`'s slot, or in a
/// free slot when `evict` is `None`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Swap {
    pub admit: usize,
    pub evict: Option<usize>,
}

/// A replacement policy for one layer's cached experts.
pub trait ReplacementPolicy: Send {
    /// One decode step of this layer: per expert (len = n_experts), the tokens
    /// routed to it and the sum over tokens of its router score (the gate's
    /// probability/weight before top-k renormalisation where the caller has
    /// it; the top-k weight otherwise).
    fn observe(&mut self, loads: &[u32], scores: &[f32]);

    /// The swaps that bring the cached set toward what the policy wants now:
    /// each `Swap` admits an uncached expert, evicting a cached one, or filling
    /// a free slot when fewer than `capacity` are cached. At most `max_swaps`,
    /// best first. `cached[e]` says what is cached now. Never admits a cached
    /// expert, evicts an uncached one, names an expert twice, or goes over
    /// `capacity` (a cache already over it gets only one-for-one swaps).
    ///
    /// The caller is expected to apply what it gets back; policies with
    /// periodic decisions (the workload window) close their period here.
    fn swaps(&mut self, cached: &[bool], capacity: usize, max_swaps: usize) -> Vec<Swap>;

    /// Which policy this is, for logs.
    fn kind(&self) -> PolicyKind;
}

/// The replacement policies there are.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PolicyKind {
    /// HybriMoE's Minus Recent Score.
    Mrs,
    /// DALI's workload-aware window.
    Workload,
    /// Least recently used.
    Lru,
    /// Least frequently used.
    Lfu,
}

impl PolicyKind {
    pub const ALL: [PolicyKind; 4] = [
        PolicyKind::Mrs,
        PolicyKind::Workload,
        PolicyKind::Lru,
        PolicyKind::Lfu,
    ];

    pub fn name(self) -> &'static str {
        match self {
            PolicyKind::Mrs => "mrs",
            PolicyKind::Workload => "workload",
            PolicyKind::Lru => "lru",
            PolicyKind::Lfu => "lfu",
        }
    }
}

impl fmt::Display for PolicyKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A name that is not a policy, or parameters no policy can run with.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum PolicyError {
    #[error("unknown expert cache policy {0:?}: expected one of \"mrs\", \"workload\", \"lru\", \"lfu\"")]
    UnknownKind(String),
    #[error("unknown model family {0:?}: expected one of \"deepseek\", \"qwen\", \"mixtral\"")]
    UnknownFamily(String),
    #[error("MRS averaging coefficient alpha must be in (0, 1], got {0}")]
    Alpha(f32),
    #[error("MRS top-p must be at least 1, got 0")]
    TopP,
    #[error("workload window must be at least 1 step, got 0")]
    Window,
    #[error("workload window swaps must be at least 1, got 0")]
    WindowSwaps,
    #[error("top_k must be at least 1, got 0")]
    TopK,
}

impl FromStr for PolicyKind {
    type Err = PolicyError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        PolicyKind::ALL
            .into_iter()
            .find(|k| k.name().eq_ignore_ascii_case(s.trim()))
            .ok_or_else(|| PolicyError::UnknownKind(s.to_string()))
    }
}

/// The model families the papers tuned their defaults on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ModelFamily {
    /// DeepSeek-V2/V3-style fine-grained experts (many, small).
    DeepSeek,
    /// Qwen MoE (many experts, top-8).
    Qwen,
    /// Mixtral-style coarse experts (8, top-2).
    Mixtral,
}

impl FromStr for ModelFamily {
    type Err = PolicyError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "deepseek" => Ok(ModelFamily::DeepSeek),
            "qwen" => Ok(ModelFamily::Qwen),
            "mixtral" => Ok(ModelFamily::Mixtral),
            _ => Err(PolicyError::UnknownFamily(s.to_string())),
        }
    }
}

/// The policies' parameters. Built validated ([`PolicyParams::new`],
/// [`PolicyParams::for_model`]) so that a policy never runs with a value that
/// would make it divide by zero or never decide.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PolicyParams {
    mrs_alpha: f32,
    mrs_p: usize,
    window: usize,
    window_swaps: usize,
}

impl PolicyParams {
    /// `mrs_alpha` ∈ (0, 1] and `mrs_p` ≥ 1 for MRS; the workload window's
    /// length `window` ≥ 1 (steps) and its swaps per window `window_swaps` ≥ 1.
    pub fn new(
        mrs_alpha: f32,
        mrs_p: usize,
        window: usize,
        window_swaps: usize,
    ) -> Result<Self, PolicyError> {
        // `!(a > 0)` also rejects NaN.
        if !(mrs_alpha > 0.0 && mrs_alpha <= 1.0) {
            return Err(PolicyError::Alpha(mrs_alpha));
        }
        if mrs_p == 0 {
            return Err(PolicyError::TopP);
        }
        if window == 0 {
            return Err(PolicyError::Window);
        }
        if window_swaps == 0 {
            return Err(PolicyError::WindowSwaps);
        }
        Ok(Self {
            mrs_alpha,
            mrs_p,
            window,
            window_swaps,
        })
    }

    /// The papers' defaults for a model: MRS α = 0.5 and p = 2·top-k
    /// (hybrimoe.txt §IV-D: "we set p to twice the number of activated
    /// experts"; α as in its code), and DALI's (w, u) = (4, 8) for DeepSeek and
    /// Qwen, (4, 1) for Mixtral (dali.txt §6.4-3, Table 9). p is at most
    /// `n_experts` (a larger p keeps every score anyway).
    pub fn for_model(
        n_experts: usize,
        top_k: usize,
        family: ModelFamily,
    ) -> Result<Self, PolicyError> {
        if top_k == 0 {
            return Err(PolicyError::TopK);
        }
        let (window, window_swaps) = match family {
            ModelFamily::DeepSeek | ModelFamily::Qwen => (4, 8),
            ModelFamily::Mixtral => (4, 1),
        };
        Self::new(0.5, (2 * top_k).min(n_experts.max(1)), window, window_swaps)
    }

    pub fn mrs_alpha(&self) -> f32 {
        self.mrs_alpha
    }

    pub fn mrs_p(&self) -> usize {
        self.mrs_p
    }

    /// The workload window's length, in steps.
    pub fn window(&self) -> usize {
        self.window
    }

    /// Swaps the workload window makes when it closes.
    pub fn window_swaps(&self) -> usize {
        self.window_swaps
    }
}

/// Applies `swaps` to `cached`, checking [`ReplacementPolicy::swaps`]'s
/// contract on the way: at most `max_swaps`, each admitting an uncached
/// expert and evicting a cached one, no expert named twice, no more than
/// `capacity` cached afterwards (or no more than before, for a cache that was
/// already over it). On a breach `cached` is left as it was and the error
/// says what broke.
pub fn apply_swaps(
    cached: &mut [bool],
    swaps: &[Swap],
    capacity: usize,
    max_swaps: usize,
) -> Result<(), String> {
    if swaps.len() > max_swaps {
        return Err(format!("{} swaps, more than max_swaps {max_swaps}", swaps.len()));
    }
    let mut next = cached.to_vec();
    let mut named = vec![false; cached.len()];
    let mut name = |e: usize| -> Result<(), String> {
        match named.get_mut(e) {
            None => Err(format!("expert {e} out of range (n_experts {})", cached.len())),
            Some(true) => Err(format!("expert {e} named twice in {swaps:?}")),
            Some(n) => {
                *n = true;
                Ok(())
            }
        }
    };
    for s in swaps {
        name(s.admit)?;
        if cached[s.admit] {
            return Err(format!("admits expert {}, which is cached", s.admit));
        }
        if let Some(v) = s.evict {
            name(v)?;
            if !cached[v] {
                return Err(format!("evicts expert {v}, which is not cached"));
            }
            next[v] = false;
        }
        next[s.admit] = true;
    }
    let (before, after) = (count_cached(cached), count_cached(&next));
    if after > capacity.max(before) {
        return Err(format!("{after} cached after the swaps, capacity {capacity} (was {before})"));
    }
    cached.copy_from_slice(&next);
    Ok(())
}

/// A policy of `kind` for one layer of `n_experts` routed experts.
pub fn new_policy(
    kind: PolicyKind,
    n_experts: usize,
    params: &PolicyParams,
) -> Box<dyn ReplacementPolicy> {
    match kind {
        PolicyKind::Mrs => Box::new(Mrs::new(n_experts, params.mrs_alpha, params.mrs_p)),
        PolicyKind::Workload => Box::new(WorkloadWindow::new(
            n_experts,
            params.window,
            params.window_swaps,
        )),
        PolicyKind::Lru => Box::new(Lru::new(n_experts)),
        PolicyKind::Lfu => Box::new(Lfu::new(n_experts)),
    }
}

/// Pairs the best uncached candidates with the worst cached victims: first
/// fills free slots, then swaps one for one while `better(admit, evict)`.
///
/// `admit` must be sorted best first and hold only uncached experts the policy
/// would take at all; `evict` sorted worst first and hold only cached experts
/// it would give up. Because both lists are sorted, the first pair that is not
/// an improvement ends the pairing: no later pair can be one.
fn pair(
    admit: &[usize],
    evict: &[usize],
    n_cached: usize,
    capacity: usize,
    max_swaps: usize,
    better: impl Fn(usize, usize) -> bool,
) -> Vec<Swap> {
    let mut out = Vec::new();
    let free = capacity.saturating_sub(n_cached);
    let mut admits = admit.iter().copied();
    for admit in admits.by_ref().take(free.min(max_swaps)) {
        out.push(Swap { admit, evict: None });
    }
    let mut victims = evict.iter().copied();
    for admit in admits {
        if out.len() >= max_swaps {
            break;
        }
        match victims.next() {
            Some(victim) if better(admit, victim) => out.push(Swap {
                admit,
                evict: Some(victim),
            }),
            _ => break,
        }
    }
    out
}

/// How many experts are cached, over the experts the policy knows.
fn count_cached(cached: &[bool]) -> usize {
    cached.iter().filter(|&&c| c).count()
}

/// Experts `e < n` (and `e < cached.len()`) with `cached[e] == want` and
/// `keep(e)`, sorted by `order`, then by index.
fn select(
    cached: &[bool],
    n: usize,
    want: bool,
    keep: impl Fn(usize) -> bool,
    order: impl Fn(usize, usize) -> Ordering,
) -> Vec<usize> {
    let mut v: Vec<usize> = (0..n.min(cached.len()))
        .filter(|&e| cached[e] == want && keep(e))
        .collect();
    v.sort_by(|&a, &b| order(a, b).then(a.cmp(&b)));
    v
}

/// Slices of the wrong length are a caller's bug: loud in debug builds; in
/// release the policies use the experts both sides know.
fn debug_len(name: &str, got: usize, n: usize) {
    debug_assert_eq!(got, n, "{name} has {got} entries for {n} experts");
}

/// HybriMoE's Minus Recent Score: an exponential average of each step's top-p
/// router scores. Keeping only the p largest is the paper's observation that
/// reuse probability does not differ among low-score experts (fig. 3(b)), so
/// their scores would only add noise.
pub struct Mrs {
    alpha: f32,
    p: usize,
    score: Vec<f32>,
    /// Scratch for picking the top p of a step without allocating each time.
    order: Vec<usize>,
}

impl Mrs {
    pub fn new(n_experts: usize, alpha: f32, p: usize) -> Self {
        Self {
            alpha,
            p,
            score: vec![0.0; n_experts],
            order: Vec::with_capacity(n_experts),
        }
    }

    /// The priority S of each expert now.
    pub fn priorities(&self) -> &[f32] {
        &self.score
    }
}

impl ReplacementPolicy for Mrs {
    fn observe(&mut self, _loads: &[u32], scores: &[f32]) {
        let n = self.score.len();
        debug_len("scores", scores.len(), n);
        let m = n.min(scores.len());
        self.order.clear();
        self.order.extend(0..m);
        // Top p by score, ties to the lower index; NaN counts as nothing.
        let s = |e: usize| if scores[e].is_nan() { 0.0 } else { scores[e] };
        self.order
            .sort_by(|&a, &b| s(b).total_cmp(&s(a)).then(a.cmp(&b)));
        let mut top = vec![false; n];
        for &e in self.order.iter().take(self.p) {
            top[e] = true;
        }
        for (e, slot) in self.score.iter_mut().enumerate() {
            let s_now = if top[e] { s(e) } else { 0.0 };
            *slot = self.alpha * s_now + (1.0 - self.alpha) * *slot;
        }
    }

    fn swaps(&mut self, cached: &[bool], capacity: usize, max_swaps: usize) -> Vec<Swap> {
        let n = self.score.len();
        debug_len("cached", cached.len(), n);
        let s = &self.score;
        let by_desc = |a: usize, b: usize| s[b].total_cmp(&s[a]);
        let by_asc = |a: usize, b: usize| s[a].total_cmp(&s[b]);
        // An expert with no score has given no sign it will be used: copying
        // it in would cost a transfer for nothing.
        let admit = select(cached, n, false, |e| s[e] > 0.0, by_desc);
        let evict = select(cached, n, true, |_| true, by_asc);
        pair(&admit, &evict, count_cached(cached), capacity, max_swaps, |a, v| {
            s[a] > s[v]
        })
    }

    fn kind(&self) -> PolicyKind {
        PolicyKind::Mrs
    }
}

/// DALI's workload-aware window: tokens per expert summed over `window`
/// steps; when the window closes, the busiest uncached experts replace the
/// idlest cached ones (at most `swaps` of them), and the counts restart.
pub struct WorkloadWindow {
    window: usize,
    swaps: usize,
    counts: Vec<u64>,
    steps: usize,
}

impl WorkloadWindow {
    pub fn new(n_experts: usize, window: usize, swaps: usize) -> Self {
        Self {
            window: window.max(1),
            swaps,
            counts: vec![0; n_experts],
            steps: 0,
        }
    }

    /// Tokens per expert in the window so far.
    pub fn counts(&self) -> &[u64] {
        &self.counts
    }
}

impl ReplacementPolicy for WorkloadWindow {
    fn observe(&mut self, loads: &[u32], _scores: &[f32]) {
        debug_len("loads", loads.len(), self.counts.len());
        for (c, &l) in self.counts.iter_mut().zip(loads) {
            *c += u64::from(l);
        }
        self.steps += 1;
    }

    fn swaps(&mut self, cached: &[bool], capacity: usize, max_swaps: usize) -> Vec<Swap> {
        // Only at the end of a window: swapping mid-window would be LFU over
        // a partial window, which is not what DALI measured.
        if self.steps < self.window {
            return Vec::new();
        }
        let n = self.counts.len();
        debug_len("cached", cached.len(), n);
        let c = &self.counts;
        let admit = select(cached, n, false, |e| c[e] > 0, |a, b| c[b].cmp(&c[a]));
        let evict = select(cached, n, true, |_| true, |a, b| c[a].cmp(&c[b]));
        let out = pair(
            &admit,
            &evict,
            count_cached(cached),
            capacity,
            self.swaps.min(max_swaps),
            |a, v| c[a] > c[v],
        );
        self.counts.iter_mut().for_each(|c| *c = 0);
        self.steps = 0;
        out
    }

    fn kind(&self) -> PolicyKind {
        PolicyKind::Workload
    }
}

/// Least recently used: experts this step used and missed come in (most
/// tokens first), replacing the cached experts unused for longest.
pub struct Lru {
    /// Step of each expert's last use; 0 = never.
    last_used: Vec<u64>,
    /// This step's loads, to know which misses to admit.
    loads: Vec<u32>,
    step: u64,
}

impl Lru {
    pub fn new(n_experts: usize) -> Self {
        Self {
            last_used: vec![0; n_experts],
            loads: vec![0; n_experts],
            step: 0,
        }
    }
}

impl ReplacementPolicy for Lru {
    fn observe(&mut self, loads: &[u32], _scores: &[f32]) {
        debug_len("loads", loads.len(), self.loads.len());
        self.step += 1;
        self.loads.iter_mut().for_each(|l| *l = 0);
        for (e, &l) in loads.iter().enumerate().take(self.loads.len()) {
            self.loads[e] = l;
            if l > 0 {
                self.last_used[e] = self.step;
            }
        }
    }

    fn swaps(&mut self, cached: &[bool], capacity: usize, max_swaps: usize) -> Vec<Swap> {
        let n = self.loads.len();
        debug_len("cached", cached.len(), n);
        let (loads, last, step) = (&self.loads, &self.last_used, self.step);
        let admit = select(cached, n, false, |e| loads[e] > 0, |a, b| {
            loads[b].cmp(&loads[a])
        });
        // What this step used stays: evicting it for another of its experts
        // would only trade one miss for another.
        let evict = select(cached, n, true, |e| last[e] < step, |a, b| {
            last[a].cmp(&last[b])
        });
        pair(&admit, &evict, count_cached(cached), capacity, max_swaps, |_, _| {
            true
        })
    }

    fn kind(&self) -> PolicyKind {
        PolicyKind::Lru
    }
}

/// Least frequently used: counts the steps in which each expert was used
/// (a use per step, however many tokens, as LRU sees it); an uncached expert
/// comes in when its count is above the lowest cached count.
pub struct Lfu {
    uses: Vec<u64>,
}

impl Lfu {
    pub fn new(n_experts: usize) -> Self {
        Self {
            uses: vec![0; n_experts],
        }
    }
}

impl ReplacementPolicy for Lfu {
    fn observe(&mut self, loads: &[u32], _scores: &[f32]) {
        debug_len("loads", loads.len(), self.uses.len());
        for (u, &l) in self.uses.iter_mut().zip(loads) {
            *u += u64::from(l > 0);
        }
    }

    fn swaps(&mut self, cached: &[bool], capacity: usize, max_swaps: usize) -> Vec<Swap> {
        let n = self.uses.len();
        debug_len("cached", cached.len(), n);
        let u = &self.uses;
        let admit = select(cached, n, false, |e| u[e] > 0, |a, b| u[b].cmp(&u[a]));
        let evict = select(cached, n, true, |_| true, |a, b| u[a].cmp(&u[b]));
        pair(&admit, &evict, count_cached(cached), capacity, max_swaps, |a, v| {
            u[a] > u[v]
        })
    }

    fn kind(&self) -> PolicyKind {
        PolicyKind::Lfu
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cached(n: usize, set: &[usize]) -> Vec<bool> {
        let mut c = vec![false; n];
        for &e in set {
            c[e] = true;
        }
        c
    }

    fn swap(admit: usize, evict: Option<usize>) -> Swap {
        Swap { admit, evict }
    }

    fn params() -> PolicyParams {
        PolicyParams::new(0.5, 2, 2, 2).unwrap()
    }

    #[test]
    fn kinds_parse_and_print() {
        for k in PolicyKind::ALL {
            assert_eq!(k.to_string().parse::<PolicyKind>().unwrap(), k);
        }
        assert_eq!(" LRU ".parse::<PolicyKind>().unwrap(), PolicyKind::Lru);
        let err = "arc".parse::<PolicyKind>().unwrap_err().to_string();
        assert!(err.contains("\"arc\""), "{err}");
        for name in ["mrs", "workload", "lru", "lfu"] {
            assert!(err.contains(name), "{err}");
        }
        assert_eq!("Mixtral".parse::<ModelFamily>().unwrap(), ModelFamily::Mixtral);
        assert!("llama".parse::<ModelFamily>().unwrap_err().to_string().contains("mixtral"));
    }

    #[test]
    fn params_defaults_and_validation() {
        let p = PolicyParams::for_model(256, 8, ModelFamily::DeepSeek).unwrap();
        assert_eq!((p.mrs_alpha(), p.mrs_p(), p.window(), p.window_swaps()), (0.5, 16, 4, 8));
        let p = PolicyParams::for_model(128, 8, ModelFamily::Qwen).unwrap();
        assert_eq!((p.mrs_p(), p.window(), p.window_swaps()), (16, 4, 8));
        let p = PolicyParams::for_model(8, 2, ModelFamily::Mixtral).unwrap();
        assert_eq!((p.mrs_p(), p.window(), p.window_swaps()), (4, 4, 1));
        // p never above the experts there are.
        assert_eq!(PolicyParams::for_model(4, 3, ModelFamily::Mixtral).unwrap().mrs_p(), 4);
        assert_eq!(PolicyParams::for_model(8, 0, ModelFamily::Mixtral), Err(PolicyError::TopK));
        assert_eq!(PolicyParams::new(0.0, 1, 1, 1), Err(PolicyError::Alpha(0.0)));
        assert!(PolicyParams::new(f32::NAN, 1, 1, 1).is_err());
        assert_eq!(PolicyParams::new(1.5, 1, 1, 1), Err(PolicyError::Alpha(1.5)));
        assert_eq!(PolicyParams::new(1.0, 0, 1, 1), Err(PolicyError::TopP));
        assert_eq!(PolicyParams::new(1.0, 1, 0, 1), Err(PolicyError::Window));
        assert_eq!(PolicyParams::new(1.0, 1, 1, 0), Err(PolicyError::WindowSwaps));
        for k in PolicyKind::ALL {
            assert_eq!(new_policy(k, 4, &params()).kind(), k);
        }
    }

    #[test]
    fn mrs_update_keeps_top_p_and_averages() {
        let mut m = Mrs::new(4, 0.5, 2);
        m.observe(&[1, 1, 1, 0], &[0.4, 0.3, 0.2, 0.1]);
        // Only the top 2 scores count: 0.5·0.4, 0.5·0.3.
        assert_eq!(m.priorities(), &[0.2, 0.15, 0.0, 0.0]);
        m.observe(&[0, 0, 1, 1], &[0.0, 0.0, 0.8, 0.6]);
        assert_eq!(m.priorities(), &[0.1, 0.075, 0.4, 0.3]);
        // Ties for the last top-p place go to the lower index.
        let mut m = Mrs::new(3, 1.0, 1);
        m.observe(&[1, 1, 1], &[0.5, 0.5, 0.5]);
        assert_eq!(m.priorities(), &[0.5, 0.0, 0.0]);
    }

    #[test]
    fn mrs_swaps_admit_best_for_worst_while_better() {
        let mut m = Mrs::new(5, 0.5, 5);
        m.observe(&[0; 5], &[0.1, 0.9, 0.3, 0.7, 0.0]);
        // S = [.05 .45 .15 .35 0]; cached {0, 2}: admit 1 for 0, then 3 for 2.
        assert_eq!(
            m.swaps(&cached(5, &[0, 2]), 2, 8),
            vec![swap(1, Some(0)), swap(3, Some(2))]
        );
        // max_swaps caps it, best first.
        assert_eq!(m.swaps(&cached(5, &[0, 2]), 2, 1), vec![swap(1, Some(0))]);
        // Cached {1, 2}: 3 replaces 2 (0.35 > 0.15); 0 (0.05) would not beat 1.
        assert_eq!(m.swaps(&cached(5, &[1, 2]), 2, 8), vec![swap(3, Some(2))]);
        // Free slots fill first, only with experts that have a score.
        assert_eq!(
            m.swaps(&cached(5, &[]), 5, 8),
            vec![swap(1, None), swap(3, None), swap(2, None), swap(0, None)]
        );
        // Capacity 0, and everything cached: nothing to do.
        assert_eq!(m.swaps(&cached(5, &[]), 0, 8), vec![]);
        assert_eq!(m.swaps(&cached(5, &[0, 1, 2, 3, 4]), 5, 8), vec![]);
        // Capacity 1 holding the best: stays.
        assert_eq!(m.swaps(&cached(5, &[1]), 1, 8), vec![]);
        assert_eq!(m.swaps(&cached(5, &[4]), 1, 8), vec![swap(1, Some(4))]);
    }

    #[test]
    fn mrs_equal_scores_do_not_swap() {
        let mut m = Mrs::new(3, 0.5, 3);
        m.observe(&[1, 1, 1], &[0.5, 0.5, 0.5]);
        assert_eq!(m.swaps(&cached(3, &[2]), 1, 8), vec![]);
        // Free slot with a tie: the lower index comes in.
        assert_eq!(m.swaps(&cached(3, &[2]), 2, 8), vec![swap(0, None)]);
    }

    #[test]
    fn workload_swaps_only_when_the_window_closes() {
        let mut w = WorkloadWindow::new(6, 3, 2);
        let c = cached(6, &[0, 1, 2]);
        w.observe(&[1, 0, 0, 5, 4, 0], &[0.0; 6]);
        assert_eq!(w.swaps(&c, 3, 8), vec![]);
        w.observe(&[1, 0, 3, 0, 0, 1], &[0.0; 6]);
        assert_eq!(w.swaps(&c, 3, 8), vec![]);
        w.observe(&[0, 2, 0, 0, 0, 1], &[0.0; 6]);
        // Counts [2 2 3 5 4 2]: 3 and 4 come in for the idlest cached, 0 and 1
        // (tie at 2, lower index first); 5 (2) would not beat 2 (3) and u = 2.
        assert_eq!(w.swaps(&c, 3, 8), vec![swap(3, Some(0)), swap(4, Some(1))]);
        assert_eq!(w.counts(), &[0; 6], "a new window starts");
        // The next window again waits 3 steps.
        w.observe(&[0, 0, 0, 0, 0, 9], &[0.0; 6]);
        assert_eq!(w.swaps(&cached(6, &[2, 3, 4]), 3, 8), vec![]);
    }

    #[test]
    fn workload_fills_free_slots_first_and_respects_u_and_max_swaps() {
        let mut w = WorkloadWindow::new(5, 1, 2);
        w.observe(&[0, 3, 1, 4, 2], &[0.0; 5]);
        // One free slot (capacity 2, one cached): 3 fills it, 1 replaces 0.
        assert_eq!(
            w.swaps(&cached(5, &[0]), 2, 8),
            vec![swap(3, None), swap(1, Some(0))]
        );
        w.observe(&[0, 3, 1, 4, 2], &[0.0; 5]);
        assert_eq!(w.swaps(&cached(5, &[0]), 2, 1), vec![swap(3, None)]);
        // Only where the incoming count is higher.
        w.observe(&[0, 3, 1, 4, 2], &[0.0; 5]);
        assert_eq!(w.swaps(&cached(5, &[3, 1]), 2, 8), vec![]);
        w.observe(&[0, 3, 1, 4, 2], &[0.0; 5]);
        assert_eq!(w.swaps(&cached(5, &[]), 0, 8), vec![]);
        w.observe(&[0, 3, 1, 4, 2], &[0.0; 5]);
        assert_eq!(w.swaps(&cached(5, &[0, 1, 2, 3, 4]), 5, 8), vec![]);
        w.observe(&[0, 3, 1, 4, 2], &[0.0; 5]);
        assert_eq!(w.swaps(&cached(5, &[2]), 1, 8), vec![swap(3, Some(2))]);
    }

    #[test]
    fn lru_admits_this_steps_misses_for_the_least_recent() {
        let mut l = Lru::new(6);
        l.observe(&[1, 1, 0, 0, 0, 0], &[0.0; 6]); // step 1: 0, 1
        l.observe(&[0, 0, 1, 0, 0, 0], &[0.0; 6]); // step 2: 2
        l.observe(&[0, 1, 0, 1, 3, 0], &[0.0; 6]); // step 3: 1, 3, 4
        // Cached {0, 1, 2, 5}: misses 4 (3 tokens) then 3; victims by age:
        // 5 (never), 0 (step 1), 2 (step 2); 1 was used now and stays.
        let c = cached(6, &[0, 1, 2, 5]);
        assert_eq!(l.swaps(&c, 4, 8), vec![swap(4, Some(5)), swap(3, Some(0))]);
        assert_eq!(l.swaps(&c, 4, 1), vec![swap(4, Some(5))]);
        // A free slot is used before any eviction.
        assert_eq!(
            l.swaps(&cached(6, &[0, 1, 2]), 4, 8),
            vec![swap(4, None), swap(3, Some(0))]
        );
        // Everything cached is in use: nothing can go.
        assert_eq!(l.swaps(&cached(6, &[1]), 1, 8), vec![]);
        assert_eq!(l.swaps(&cached(6, &[0]), 1, 8), vec![swap(4, Some(0))]);
        assert_eq!(l.swaps(&cached(6, &[]), 0, 8), vec![]);
        assert_eq!(l.swaps(&cached(6, &[0, 1, 2, 3, 4, 5]), 6, 8), vec![]);
    }

    #[test]
    fn lru_ties_go_to_the_lower_index() {
        let mut l = Lru::new(4);
        l.observe(&[0, 0, 2, 2], &[0.0; 4]);
        assert_eq!(
            l.swaps(&cached(4, &[0, 1]), 2, 8),
            vec![swap(2, Some(0)), swap(3, Some(1))]
        );
    }

    #[test]
    fn lfu_admits_when_count_beats_the_lowest_cached() {
        let mut l = Lfu::new(4);
        l.observe(&[1, 0, 5, 0], &[0.0; 4]); // uses [1 0 1 0]
        l.observe(&[1, 0, 1, 0], &[0.0; 4]); // [2 0 2 0]
        l.observe(&[0, 1, 1, 0], &[0.0; 4]); // [2 1 3 0]
        // Cached {1, 3}: 2 (3) for 3 (0), 0 (2) for 1 (1).
        assert_eq!(
            l.swaps(&cached(4, &[1, 3]), 2, 8),
            vec![swap(2, Some(3)), swap(0, Some(1))]
        );
        // The best uncached (0, 2 uses) does not beat the cached 2 (3 uses).
        assert_eq!(l.swaps(&cached(4, &[2]), 1, 8), vec![]);
        l.observe(&[0, 1, 0, 0], &[0.0; 4]); // [2 2 3 0]
        // A tie (1 and 0 both at 2) does not swap.
        assert_eq!(l.swaps(&cached(4, &[0, 2]), 2, 8), vec![]);
        // Fill, never with an expert that was never used.
        assert_eq!(
            l.swaps(&cached(4, &[]), 4, 8),
            vec![swap(2, None), swap(0, None), swap(1, None)]
        );
        assert_eq!(l.swaps(&cached(4, &[]), 0, 8), vec![]);
        assert_eq!(l.swaps(&cached(4, &[0, 1, 2, 3]), 4, 8), vec![]);
    }

    #[test]
    fn apply_swaps_checks_the_contract() {
        let c = cached(4, &[0, 1]);
        let ok = |swaps: &[Swap], cap: usize, max: usize| {
            let mut c2 = c.clone();
            apply_swaps(&mut c2, swaps, cap, max).map(|()| c2)
        };
        assert_eq!(
            ok(&[swap(2, Some(0)), swap(3, None)], 3, 2).unwrap(),
            cached(4, &[1, 2, 3])
        );
        let bad = [
            (vec![swap(2, None)], 2, 2, "capacity 2"),
            (vec![swap(1, Some(0))], 2, 2, "admits expert 1"),
            (vec![swap(2, Some(3))], 2, 2, "evicts expert 3"),
            (vec![swap(2, Some(0)), swap(3, Some(0))], 2, 2, "named twice"),
            (vec![swap(2, Some(0)), swap(0, Some(1))], 2, 2, "named twice"),
            (vec![swap(2, Some(0)), swap(3, Some(1))], 2, 1, "max_swaps 1"),
            (vec![swap(7, None)], 4, 2, "out of range"),
        ];
        for (swaps, cap, max, want) in bad {
            let mut c2 = c.clone();
            let err = apply_swaps(&mut c2, &swaps, cap, max).unwrap_err();
            assert!(err.contains(want), "{swaps:?}: {err}");
            assert_eq!(c2, c, "left as it was");
        }
    }

    #[test]
    fn over_capacity_gets_only_one_for_one_swaps() {
        let mut m = Mrs::new(4, 1.0, 4);
        m.observe(&[1; 4], &[0.1, 0.2, 0.3, 0.4]);
        // Three cached in a capacity of two (the caller shrank it): no fill.
        assert_eq!(m.swaps(&cached(4, &[0, 1, 2]), 2, 8), vec![swap(3, Some(0))]);
    }
}
