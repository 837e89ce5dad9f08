//! The replacement policies on synthetic routing traces: a cache of a fixed
//! capacity per layer, starting empty, a policy per layer deciding its swaps
//! after every step, hits counted when an activated expert is already cached
//! as its layer runs (before that step's swaps). Real routing traces cannot
//! be had here (no full-size MoE model runs on this machine), so the traces
//! come from `duplex_expert_cache::trace` with the parameters and seeds below.
//!
//! `cargo test -p duplex-expert-cache --test policies -- --nocapture` prints
//! the hit-rate tables.

use duplex_expert_cache::policy::{
    apply_swaps, new_policy, ModelFamily, PolicyKind, PolicyParams,
};
use duplex_expert_cache::trace::{replay, HitCount, TraceGenerator, TraceParams};
use proptest::prelude::*;

/// The seeds every comparison pools over.
const SEEDS: [u64; 3] = [11, 22, 33];
/// Steps per trace, and the first steps left out of the count (the cache
/// starts empty; the papers report steady-state hit rates).
const STEPS: usize = 192;
const WARMUP: usize = 32;
/// Layers per trace: policies are per layer, so more layers only add samples.
const LAYERS: usize = 4;

/// Swaps per layer and step for the policies that may swap every step (MRS,
/// LRU, LFU). The window makes its own u per w steps instead: for DeepSeek and
/// Qwen 8 per 4 steps, the same 2 a step on average; for Mixtral 1 per 4.
const MAX_SWAPS: usize = 2;

#[derive(Clone, Copy, Debug)]
struct Model {
    name: &'static str,
    n_experts: usize,
    top_k: usize,
    family: ModelFamily,
}

const DEEPSEEK: Model = Model {
    name: "DeepSeek-like 256/8",
    n_experts: 256,
    top_k: 8,
    family: ModelFamily::DeepSeek,
};
const QWEN: Model = Model {
    name: "Qwen3-like 128/8",
    n_experts: 128,
    top_k: 8,
    family: ModelFamily::Qwen,
};
const MIXTRAL: Model = Model {
    name: "Mixtral-like 8/2",
    n_experts: 8,
    top_k: 2,
    family: ModelFamily::Mixtral,
};
/// The shape the generator's defaults are calibrated on (HybriMoE's
/// DeepSeek-V2-Lite: 64 routed experts, top-6; see `trace`'s defaults).
const V2_LITE: Model = Model {
    name: "DeepSeek-V2-Lite 64/6",
    n_experts: 64,
    top_k: 6,
    family: ModelFamily::DeepSeek,
};

/// Strong skew and short-range locality: classic Zipf, half of a sequence's
/// experts used again at the next step (DALI's fig. 8 diagonal taken at its
/// strongest), each sequence with its own preferences.
fn strong(model: Model, batch: usize) -> TraceParams {
    TraceParams {
        zipf_exponent: 1.0,
        temporal_overlap: 0.5,
        sequence_affinity: 1.0,
        ..TraceParams::new(model.n_experts, model.top_k, LAYERS, batch)
    }
}

/// Strong skew and persistent locality: classic Zipf, no expert repeated for
/// its own sake from one step to the next, but each sequence leaning hard on
/// its own experts for its life (DALI's "domains", dali.txt §3.3, fig. 18d).
fn persistent(model: Model, batch: usize) -> TraceParams {
    TraceParams {
        zipf_exponent: 1.0,
        temporal_overlap: 0.0,
        sequence_affinity: 2.0,
        ..TraceParams::new(model.n_experts, model.top_k, LAYERS, batch)
    }
}

fn defaults(model: Model, batch: usize) -> TraceParams {
    TraceParams::new(model.n_experts, model.top_k, LAYERS, batch)
}

fn capacity(model: Model, fraction: f64) -> usize {
    ((model.n_experts as f64 * fraction).round() as usize).max(1)
}

/// Hit rate of each policy (in `PolicyKind::ALL` order) for each of `caps`
/// (experts per layer), pooled over the seeds; each seed's trace generated
/// once for all.
fn hit_rates_at(model: Model, trace: TraceParams, caps: &[usize]) -> Vec<[f64; 4]> {
    let params = PolicyParams::for_model(model.n_experts, model.top_k, model.family).unwrap();
    let mut total = vec![[HitCount::default(); 4]; caps.len()];
    for seed in SEEDS {
        let steps = TraceGenerator::new(trace, seed).unwrap().steps(STEPS);
        for (c, &cap) in caps.iter().enumerate() {
            for (i, kind) in PolicyKind::ALL.into_iter().enumerate() {
                let max_swaps = match kind {
                    PolicyKind::Workload => params.window_swaps(),
                    _ => MAX_SWAPS,
                };
                let h = replay(kind, &params, &steps, model.n_experts, cap, max_swaps, WARMUP)
                    .unwrap();
                total[c][i].add(h);
            }
        }
    }
    total.into_iter().map(|t| t.map(|h| h.rate())).collect()
}

fn hit_rates(model: Model, trace: TraceParams, cap: usize) -> [f64; 4] {
    hit_rates_at(model, trace, &[cap])[0]
}

const MRS: usize = 0;
const WORKLOAD: usize = 1;
const LRU: usize = 2;

fn table(title: &str, trace: fn(Model, usize) -> TraceParams, models: &[Model]) {
    println!("\n{title}");
    println!(
        "{:<22} {:>5} {:>9} {:>7} {:>9} {:>7} {:>7}",
        "scenario", "batch", "capacity", "mrs", "workload", "lru", "lfu"
    );
    for &model in models {
        for batch in [1, 6] {
            let fractions = [0.10, 0.25];
            let caps = fractions.map(|f| capacity(model, f));
            let rates = hit_rates_at(model, trace(model, batch), &caps);
            for ((fraction, cap), r) in fractions.into_iter().zip(caps).zip(rates) {
                println!(
                    "{:<22} {:>5} {:>9} {:>7.3} {:>9.3} {:>7.3} {:>7.3}",
                    model.name,
                    batch,
                    format!("{cap} ({:.0}%)", fraction * 100.0),
                    r[0],
                    r[1],
                    r[2],
                    r[3]
                );
            }
        }
    }
}

/// The tables, for the record (the assertions are in the tests below).
#[test]
fn hit_rate_tables() {
    let all = [V2_LITE, DEEPSEEK, QWEN, MIXTRAL];
    table("default trace parameters (calibrated to HybriMoE's LRU)", defaults, &all);
    table("strong skew, short-range locality", strong, &all[1..]);
    table("strong skew, persistent per-sequence locality", persistent, &all[1..]);
}

/// HybriMoE's setting (batch 1, edge decode): MRS hits at least as often as
/// LRU, by at least half a point, on the DeepSeek- and Qwen-like shapes, at
/// 10% and 25% caches, on both kinds of skewed, local traces. Measured on
/// these seeds: +0.7 to +5.9 points (+0.7 to +2.0 at 25%, where HybriMoE
/// reports +5 to +8).
#[test]
fn mrs_beats_lru_at_batch_one() {
    for model in [DEEPSEEK, QWEN] {
        for trace in [strong(model, 1), persistent(model, 1)] {
            let fractions = [0.10, 0.25];
            let rates = hit_rates_at(model, trace, &fractions.map(|f| capacity(model, f)));
            for (fraction, r) in fractions.into_iter().zip(rates) {
                assert!(
                    r[MRS] >= r[LRU] + 0.005,
                    "{} at {fraction}: mrs {:.3} vs lru {:.3} ({trace:?})",
                    model.name,
                    r[MRS],
                    r[LRU]
                );
            }
        }
    }
}

/// DALI's workload window beats LRU where DALI measured it, a batch (fig. 17b:
/// batch 4), and where the locality is a sequence's persistent leaning on its
/// experts: batch 6, 25% cache, measured +1.1 to +1.3 points.
///
/// It does not beat LRU everywhere on these traces, and the next assertion
/// keeps that on record: at batch 1 with short-range locality, LRU (2 swaps
/// every step) follows a sequence's next experts while the window waits 4
/// steps to act on counts of 0 or 1 per step; measured 14–17 points below
/// LRU. DALI's own fig. 18c points the same way: a shorter window hits more.
#[test]
fn workload_window_against_lru() {
    for model in [DEEPSEEK, QWEN] {
        let r = hit_rates(model, persistent(model, 6), capacity(model, 0.25));
        assert!(
            r[WORKLOAD] >= r[LRU] + 0.005,
            "{} batch 6 persistent: workload {:.3} vs lru {:.3}",
            model.name,
            r[WORKLOAD],
            r[LRU]
        );
        let r = hit_rates(model, strong(model, 1), capacity(model, 0.25));
        assert!(
            r[WORKLOAD] + 0.10 <= r[LRU],
            "{} batch 1 short-range: workload {:.3} vs lru {:.3}",
            model.name,
            r[WORKLOAD],
            r[LRU]
        );
    }
}

/// On a uniform, memoryless trace the cached set says nothing about the next
/// step, so no policy can beat the capacity fraction: a check that hits are
/// counted before the swaps that would make them.
#[test]
fn no_policy_beats_chance_on_uniform_memoryless_traces() {
    for model in [DEEPSEEK, QWEN, MIXTRAL] {
        for batch in [1, 6] {
            let trace = TraceParams::uniform(model.n_experts, model.top_k, LAYERS, batch);
            let caps = [0.10, 0.25].map(|f| capacity(model, f));
            for (cap, r) in caps.into_iter().zip(hit_rates_at(model, trace, &caps)) {
                let chance = cap as f64 / model.n_experts as f64;
                for (kind, rate) in PolicyKind::ALL.into_iter().zip(r) {
                    assert!(
                        (rate - chance).abs() <= 0.02,
                        "{kind} on {} batch {batch} cap {cap}: {rate:.3} vs chance {chance:.3}",
                        model.name
                    );
                }
            }
        }
    }
}

/// One observe/swaps round of a proptest case.
#[derive(Clone, Debug)]
struct Round {
    loads: Vec<u32>,
    scores: Vec<f32>,
    max_swaps: usize,
    /// Sometimes the caller does not apply what it gets (a copy failed):
    /// the next round must still be valid against what is really cached.
    apply: bool,
}

fn rounds(n: usize) -> impl Strategy<Value = Vec<Round>> {
    prop::collection::vec(
        (
            prop::collection::vec(0u32..4, n),
            prop::collection::vec(prop_oneof![Just(0.0f32), 0.0f32..1.0, Just(0.5f32)], n),
            0usize..5,
            prop::bool::weighted(0.9),
        )
            .prop_map(|(loads, scores, max_swaps, apply)| Round {
                loads,
                scores,
                max_swaps,
                apply,
            }),
        1..40,
    )
}

fn case() -> impl Strategy<Value = (usize, usize, Vec<bool>, usize, usize, Vec<Round>)> {
    (1usize..12).prop_flat_map(|n| {
        (
            Just(n),
            0..=n,
            prop::collection::vec(any::<bool>(), n),
            1usize..4,
            1usize..4,
            rounds(n),
        )
    })
}

proptest! {
    // No failure file: the seeds of a failure are in the test's output.
    #![proptest_config(ProptestConfig { cases: 256, failure_persistence: None, ..ProptestConfig::default() })]

    /// No policy ever breaks the swaps contract: admits only uncached experts,
    /// evicts only cached ones, names no expert twice, never goes over the
    /// capacity, never more than max_swaps.
    #[test]
    fn no_policy_breaks_the_swap_contract(
        (n, capacity, initial, window, u, rounds) in case()
    ) {
        let params = PolicyParams::new(0.5, 2, window, u).unwrap();
        for kind in PolicyKind::ALL {
            let mut policy = new_policy(kind, n, &params);
            // Start within capacity: keep the first `capacity` of the initial set.
            let mut cached = initial.clone();
            let mut seen = 0;
            for c in cached.iter_mut() {
                if *c {
                    seen += 1;
                    *c = seen <= capacity;
                }
            }
            for (i, r) in rounds.iter().enumerate() {
                policy.observe(&r.loads, &r.scores);
                let swaps = policy.swaps(&cached, capacity, r.max_swaps);
                let mut next = cached.clone();
                apply_swaps(&mut next, &swaps, capacity, r.max_swaps)
                    .map_err(|e| TestCaseError::fail(format!("{kind} round {i}: {e}")))?;
                if r.apply {
                    cached = next;
                }
            }
        }
    }
}
