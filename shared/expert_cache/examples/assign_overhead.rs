//! What the per-layer decisions cost: `assign_into` for each assignment,
//! `impact_into` over three upcoming layers and `top_ps`, on DeepSeek-shaped
//! layers (256 routed experts, 8 per token; batch 1 activates 8, batch 6 up
//! to 48), half of the activated experts cached.
//!
//! `cargo run --release -p duplex-expert-cache --example assign_overhead [calls]`
//!
//! Each call is timed on its own (the clock's own cost, printed, is
//! included); min, median, 99th percentile and max over all calls are shown
//! in microseconds, with the allocations a call makes once its buffers are
//! warm (a counting global allocator). The layers cycle through 256
//! pre-generated ones, so branch predictors see varied inputs.

use duplex_expert_cache::assign::{assign_into, AssignmentKind, Plan, Scratch};
use duplex_expert_cache::prefetch::{
    impact_into, top_ps_into, ImpactScratch, DEFAULT_PS, IMPACT_LAYERS,
};
use duplex_expert_cache::{Active, CostModel};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::alloc::{GlobalAlloc, Layout, System};
use std::hint::black_box;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

/// Counts allocations, so the table can show that a warm call makes none.
struct Counting;
static ALLOCATIONS: AtomicUsize = AtomicUsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

const EXPERTS: usize = 256;
const TOP_K: usize = 8;
const LAYERS: usize = 256;

/// DeepSeek-V3-like costs in seconds: an FP8 expert (44 MB) read by the CPU
/// in ~0.7 ms plus ~50 µs per token, ~20 µs on the device, ~1.8 ms over
/// PCIe 4.0 x16.
const COST: CostModel = CostModel {
    cpu_fixed: 0.7e-3,
    cpu_per_token: 0.05e-3,
    device_fixed: 20e-6,
    device_per_token: 1e-6,
    transfer: 1.8e-3,
};

/// Tokens per expert for `batch` tokens each routed to 8 distinct experts
/// of 256, popularity Zipf-like (weight 1/rank) under a per-layer shuffle.
fn route(rng: &mut ChaCha8Rng, batch: usize) -> Vec<usize> {
    let mut rank: Vec<usize> = (0..EXPERTS).collect();
    for i in (1..EXPERTS).rev() {
        rank.swap(i, rng.gen_range(0..=i));
    }
    let weight = |e: usize| 1.0 / (1 + rank[e]) as f64;
    let total: f64 = (0..EXPERTS).map(weight).sum();
    let mut counts = vec![0; EXPERTS];
    for _ in 0..batch {
        let mut chosen = [usize::MAX; TOP_K];
        for slot in 0..TOP_K {
            loop {
                let mut x = rng.gen::<f64>() * total;
                let mut pick = EXPERTS - 1;
                for e in 0..EXPERTS {
                    x -= weight(e);
                    if x <= 0.0 {
                        pick = e;
                        break;
                    }
                }
                if !chosen.contains(&pick) {
                    chosen[slot] = pick;
                    break;
                }
            }
        }
        for e in chosen {
            counts[e] += 1;
        }
    }
    counts
}

struct Stats {
    min: f64,
    median: f64,
    p99: f64,
    max: f64,
    allocs_per_call: f64,
}

/// Times `calls` calls of `f(i)` one by one, after a warm-up round.
fn measure(calls: usize, mut f: impl FnMut(usize)) -> Stats {
    for i in 0..LAYERS {
        f(i);
    }
    let mut times = Vec::with_capacity(calls);
    let before = ALLOCATIONS.load(Ordering::Relaxed);
    for i in 0..calls {
        let t = Instant::now();
        f(i % LAYERS);
        times.push(t.elapsed().as_secs_f64() * 1e6);
    }
    // The `times` vector was reserved up front, so these are `f`'s.
    let allocs = ALLOCATIONS.load(Ordering::Relaxed) - before;
    times.sort_by(f64::total_cmp);
    Stats {
        min: times[0],
        median: times[calls / 2],
        p99: times[calls * 99 / 100],
        max: times[calls - 1],
        allocs_per_call: allocs as f64 / calls as f64,
    }
}

fn row(name: &str, active: f64, s: &Stats) {
    println!(
        "{name:<30} {active:>7.1} {:>8.3} {:>8.3} {:>8.3} {:>9.3} {:>7.2}",
        s.min, s.median, s.p99, s.max, s.allocs_per_call
    );
}

fn main() {
    let calls: usize = match std::env::args().nth(1) {
        None => 200_000,
        Some(s) => match s.parse() {
            Ok(n) if n > 0 => n,
            _ => {
                eprintln!("usage: assign_overhead [calls (a positive count, default 200000)]");
                std::process::exit(2);
            }
        },
    };
    let mut rng = ChaCha8Rng::seed_from_u64(21);

    let clock = measure(calls, |_| {
        black_box(0);
    });
    println!("per call, µs ({calls} calls; an empty timed call reads median {:.3})", clock.median);
    println!(
        "{:<30} {:>7} {:>8} {:>8} {:>8} {:>9} {:>7}",
        "decision", "active", "min", "median", "p99", "max", "allocs"
    );

    for batch in [1, 6] {
        // The layers' routed counts and, for each, half its experts cached.
        let counts: Vec<Vec<usize>> = (0..LAYERS).map(|_| route(&mut rng, batch)).collect();
        let cached: Vec<Vec<bool>> =
            (0..LAYERS).map(|_| (0..EXPERTS).map(|_| rng.gen_bool(0.5)).collect()).collect();
        let layers: Vec<Vec<Active>> = counts
            .iter()
            .zip(&cached)
            .map(|(c, k)| {
                (0..EXPERTS)
                    .filter(|&e| c[e] > 0)
                    .map(|e| Active { expert: e, tokens: c[e], cached: k[e] })
                    .collect()
            })
            .collect();
        let mean_active = layers.iter().map(Vec::len).sum::<usize>() as f64 / LAYERS as f64;

        let mut scratch = Scratch::default();
        let mut plan = Plan::default();
        for kind in AssignmentKind::ALL {
            let s = measure(calls, |i| {
                assign_into(kind, &layers[i], &COST, &mut scratch, &mut plan);
                black_box(&plan);
            });
            row(&format!("assign {kind}, batch {batch}"), mean_active, &s);
        }

        let mut impact_scratch = ImpactScratch::default();
        let mut copies = Vec::new();
        let s = measure(calls, |i| {
            let l = i.min(LAYERS - IMPACT_LAYERS);
            impact_into(
                &counts[l..l + IMPACT_LAYERS],
                &cached[l..l + IMPACT_LAYERS],
                &COST,
                DEFAULT_PS,
                &mut impact_scratch,
                &mut copies,
            )
            .expect("shapes match");
            black_box(&copies);
        });
        row(&format!("impact, 3 layers, batch {batch}"), mean_active * 3.0, &s);

        let mut picks = Vec::new();
        let s = measure(calls, |i| {
            top_ps_into(&counts[i], &cached[i], DEFAULT_PS, &mut picks).expect("shapes match");
            black_box(&picks);
        });
        row(&format!("top_ps of 256, batch {batch}"), mean_active, &s);
    }
}
