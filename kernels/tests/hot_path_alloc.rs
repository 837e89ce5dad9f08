//! The MoE layer, the parallel linear layer and GQA decode attention
//! allocate nothing once their scratch has grown: a counting global
//! allocator watches a warmed-up call.

use duplex_toolkit::kernel_bench::{fp8_view, random_fp8};
use duplex_kernels::cpu::isa;
use duplex_kernels::gqa::{gqa_attention, GqaDims, KvBlocks};
use duplex_kernels::moe::{moe_forward, ExpertCall, ExpertWeights, MoeScratch};
use duplex_kernels::parallel_linear::{par_matmul, LinearScratch};
use duplex_kernels::pool::{PoolConfig, ThreadPool};
use duplex_kernels::Precision;
use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

struct Counting;

static COUNTING: AtomicBool = AtomicBool::new(false);
static ALLOCATIONS: AtomicUsize = AtomicUsize::new(0);

// SAFETY: forwards to the system allocator; only counts.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if COUNTING.load(Ordering::Relaxed) {
            ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        }
        // SAFETY: forwarded.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: forwarded.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if COUNTING.load(Ordering::Relaxed) {
            ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        }
        // SAFETY: forwarded.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// The count covers every thread (the pools' workers too), so the tests of
/// this file take turns: run side by side, one's set-up counted against the
/// other's warmed-up call (it failed about one run in five).
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// Allocations made by every thread while `f` runs, the fewest of three
/// runs: a thread outside the test (the harness reporting the previous
/// test's result) can only add to a count, while a call that allocates does
/// so every time.
fn allocations(mut f: impl FnMut()) -> usize {
    (0..3)
        .map(|_| {
            ALLOCATIONS.store(0, Ordering::Relaxed);
            COUNTING.store(true, Ordering::Relaxed);
            f();
            COUNTING.store(false, Ordering::Relaxed);
            ALLOCATIONS.load(Ordering::Relaxed)
        })
        .min()
        .unwrap_or(0)
}

#[test]
fn warmed_up_moe_and_linear_do_not_allocate() {
    let _serial = serial();
    let pool = ThreadPool::new(&PoolConfig::split(2, 2).unwrap());
    let (hidden, inter) = (256, 384);
    let mat = hidden * inter;
    let buf = random_fp8(&pool, 3 * 3 * mat, 7);
    let scales = vec![0.01f32; hidden.div_ceil(128) * inter.div_ceil(128)];
    let x: Vec<f32> = (0..2 * hidden).map(|i| (i % 11) as f32 / 11.0 - 0.5).collect();
    let routed = [(0usize, 0.5f32), (1, 0.25)];
    let shared = [(0usize, 1.0f32), (1, 1.0)];
    let calls: Vec<ExpertCall> = (0..3)
        .map(|e| ExpertCall {
            weights: ExpertWeights {
                gate: fp8_view(&buf, 3 * e * mat, inter, hidden, &scales),
                up: fp8_view(&buf, (3 * e + 1) * mat, inter, hidden, &scales),
                down: fp8_view(&buf, (3 * e + 2) * mat, hidden, inter, &scales),
            },
            tokens: if e == 2 { &shared } else { &routed[..1 + e] },
            node: e % pool.nodes(),
        })
        .collect();
    let mut out = vec![0.0f32; 2 * hidden];
    let mut moe_scratch = MoeScratch::default();
    let mut lin_out = vec![0.0f32; inter];
    let mut lin_scratch = LinearScratch::default();
    let w = fp8_view(&buf, 0, inter, hidden, &scales);
    let isa = isa::detect();
    let run = |out: &mut [f32], moe_scratch: &mut MoeScratch, lin_out: &mut [f32], lin_scratch: &mut LinearScratch| {
        moe_forward(&pool, isa, &calls, &x, hidden, out, moe_scratch);
        par_matmul(&pool, isa, &w, &x[..hidden], 1, lin_out, lin_scratch);
    };
    // Warm up: scratch grows, every worker packs its first activations.
    for _ in 0..3 {
        run(&mut out, &mut moe_scratch, &mut lin_out, &mut lin_scratch);
    }
    let n = allocations(|| run(&mut out, &mut moe_scratch, &mut lin_out, &mut lin_scratch));
    assert_eq!(n, 0, "a warmed-up MoE layer and linear layer allocated {n} times");
}

#[test]
fn warmed_up_gqa_decode_does_not_allocate() {
    let _serial = serial();
    let pool = ThreadPool::new(&PoolConfig::split(2, 2).unwrap());
    // Qwen3-30B-A3B's heads (32 query heads on 4 kv heads of 128), over a
    // paged cache long enough for several split-K parts.
    let dims = GqaDims { heads: 32, kv_heads: 4, head_dim: 128 };
    let (bs, ctx) = (16usize, 1000usize);
    let entries: Vec<f32> = (0..ctx.div_ceil(bs) * bs * 2 * 4 * 128).map(|i| ((i * 13 % 29) as f32 - 14.0) / 14.0).collect();
    let blocks: Vec<&[f32]> = entries.chunks(bs * 2 * 4 * 128).collect();
    let cache = KvBlocks { blocks: &blocks, block_size: bs, kv_heads: 4, head_dim: 128 };
    let q: Vec<f32> = (0..32 * 128).map(|i| (i % 7) as f32 / 7.0 - 0.5).collect();
    let mut out = vec![0.0f32; 32 * 128];
    let mut scratch = Vec::new();
    let isa = isa::detect();
    for precision in [Precision::Bf16, Precision::F32] {
        let mut run = || gqa_attention(&pool, isa, &q, cache, ctx - 1, dims, 0.088, precision, &mut scratch, &mut out);
        // Warm up: scratch grows.
        run();
        run();
        let n = allocations(&mut run);
        assert_eq!(n, 0, "a warmed-up {precision:?} GQA decode allocated {n} times");
    }
}
