//! GQA decode attention (one query row, BF16 path) against its bounds.
//!
//! `cargo bench -p duplex-kernels --bench gqa_decode [-- [THREADS] [CTX...]]`
//! (defaults: 2 threads, contexts 512 2048 8192; `GQA_BENCH_WARM=1` for a
//! warm cache).
//!
//! Qwen3-30B-A3B's attention: 32 query heads on 4 KV heads of 128, a paged
//! cache of 16-entry blocks. The engine streams weights between layers, so
//! the cache is cold when a layer attends: the bench cycles through enough
//! layers' caches (at least 12, and at least 512 MB) that each call reads
//! its keys and values from DRAM, as in a decode step. Reported per call:
//! min / median / max wall time over the passes, next to the time to read
//! K and V at the streaming bandwidth (`read_bytes` on the same caches, one
//! reader per thread) and to the vector-FMA count the useful work needs.
//! The machines are shared, so the same calls are also timed on a pool of
//! one thread (the caller runs every task) by its thread CPU time, which
//! time slices lost to other processes do not inflate.

use duplex_kernels::cpu::{isa, read_bytes};
use duplex_kernels::gqa::{gqa_attention, GqaDims, KvBlocks};
use duplex_kernels::pool::{PoolConfig, ThreadPool};
use duplex_kernels::Precision;
mod common;

use common::thread_seconds;
use std::hint::black_box;
use std::time::Instant;


const PASSES: usize = 9;
const BLOCK: usize = 16;

fn main() {
    let args: Vec<usize> = std::env::args().skip(1).filter_map(|a| a.parse().ok()).collect();
    let threads = args.first().copied().unwrap_or(2);
    let contexts = if args.len() > 1 { args[1..].to_vec() } else { vec![512, 2048, 8192] };
    let isa = isa::detect();
    let dims = GqaDims { heads: 32, kv_heads: 4, head_dim: 128 };
    let pool = ThreadPool::new(&PoolConfig::single_node(threads));
    let single = ThreadPool::new(&PoolConfig::single_node(1));
    let e = 2 * dims.kv_heads * dims.head_dim;
    println!("GQA decode, {isa}, {threads} threads, {}/{}×{}", dims.heads, dims.kv_heads, dims.head_dim);
    for ctx in contexts {
        let layer_bytes = ctx * e * 4;
        // GQA_BENCH_WARM=1: one layer, called again and again (its cache
        // stays in L2/L3): the compute alone, for comparison.
        let warm = std::env::var_os("GQA_BENCH_WARM").is_some();
        let layers = if warm { 1 } else { 12.max((512 << 20) / layer_bytes) };
        // Each layer's blocks in their own allocation, in a scrambled order
        // (as a pool hands them out), BF16-valued.
        let mut state = 0x9e37_79b9_7f4a_7c15u64 ^ ctx as u64;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            duplex_kernels::round_bf16((state % 2001) as f32 / 1000.0 - 1.0)
        };
        let caches: Vec<Vec<Vec<f32>>> = (0..layers).map(|_| (0..ctx.div_ceil(BLOCK)).map(|_| (0..BLOCK * e).map(|_| next()).collect()).collect()).collect();
        let q: Vec<f32> = (0..dims.heads * dims.head_dim).map(|_| next()).collect();
        let mut out = vec![0.0f32; q.len()];
        let mut scratch = Vec::new();
        let mut times = Vec::new();
        let mut read_times = Vec::new();
        let mut cpu_times = Vec::new();
        for pass in 0..PASSES + 1 {
            let t0 = Instant::now();
            for layer in &caches {
                let blocks: Vec<&[f32]> = layer.iter().rev().map(|b| b.as_slice()).collect();
                let cache = KvBlocks { blocks: &blocks, block_size: BLOCK, kv_heads: dims.kv_heads, head_dim: dims.head_dim };
                gqa_attention(&pool, isa, &q, cache, ctx - 1, dims, 0.088, Precision::Bf16, &mut scratch, &mut out);
                black_box(&out);
            }
            let t = t0.elapsed().as_secs_f64() / layers as f64;
            // The bandwidth bar: the same caches, read by `threads` readers.
            let t0 = Instant::now();
            for layer in &caches {
                pool.parallel_for(layer.len(), &|b| {
                    // SAFETY: f32s seen as their bytes.
                    let bytes = unsafe { std::slice::from_raw_parts(layer[b].as_ptr().cast::<u8>(), layer[b].len() * 4) };
                    black_box(read_bytes(isa, bytes));
                });
            }
            let r = t0.elapsed().as_secs_f64() / layers as f64;
            let c0 = thread_seconds();
            for layer in &caches {
                let blocks: Vec<&[f32]> = layer.iter().rev().map(|b| b.as_slice()).collect();
                let cache = KvBlocks { blocks: &blocks, block_size: BLOCK, kv_heads: dims.kv_heads, head_dim: dims.head_dim };
                gqa_attention(&single, isa, &q, cache, ctx - 1, dims, 0.088, Precision::Bf16, &mut scratch, &mut out);
                black_box(&out);
            }
            let c = (thread_seconds() - c0) / layers as f64;
            if pass > 0 {
                times.push(t);
                read_times.push(r);
                cpu_times.push(c);
            }
        }
        times.sort_by(f64::total_cmp);
        read_times.sort_by(f64::total_cmp);
        cpu_times.sort_by(f64::total_cmp);
        let ms = |s: f64| s * 1e3;
        // Useful vector FMAs: per position and query head, head_dim for the
        // score and head_dim for the weighted value, sixteen to a vector.
        let fmas = (ctx * dims.heads * dims.head_dim * 2 / 16) as f64;
        println!(
            "ctx {ctx:5}: {:.3} / {:.3} / {:.3} ms (min/median/max over {PASSES} passes of {layers} layers); read K+V {:.3} ms ({:.1} GB/s); {:.2} M useful vector FMAs",
            ms(times[0]),
            ms(times[PASSES / 2]),
            ms(times[PASSES - 1]),
            ms(read_times[PASSES / 2]),
            layer_bytes as f64 / read_times[PASSES / 2] / 1e9,
            fmas / 1e6
        );
        println!("           1 thread, CPU time: {:.3} / {:.3} / {:.3} ms", ms(cpu_times[0]), ms(cpu_times[PASSES / 2]), ms(cpu_times[PASSES - 1]));
    }
}
