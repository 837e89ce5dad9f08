//! MLA decode attention in the absorbed form (one query token, BF16 path):
//! products in f32 against products on BF16 pairs (`vdpbf16ps`, or AMX
//! tiles), in the same run.
//!
//! `cargo bench -p duplex-kernels --bench mla_decode [-- [THREADS] [HEADS] [CTX...]]`
//! (defaults: 2 threads, 16 heads as the `bench` model, contexts 512 4096;
//! DeepSeek-V3 has 128 heads).
//!
//! The latent width is DeepSeek-V3's (512 + 64 rotary), in a paged cache of
//! 16-entry blocks. The engine streams weights between layers, so the cache
//! is cold when a layer attends: each pass cycles through enough layers'
//! caches (at least 8, and at least 512 MB) that every call reads its
//! entries from DRAM. The two kernels' passes alternate; reported per call:
//! min / median / max over the passes of each, the ratio pass by pass, and
//! the time to read the entries at the streaming bandwidth. The machines
//! are shared, so both are also timed on a pool of one thread by its
//! thread CPU time, which time slices lost to other processes do not inflate.
//!
//! Where AMX BF16 tiles pass their self-check, the BF16 level's products
//! run on them (`cpu::pairs_amx`): the bench says so, measures the tile
//! unit's peak in the same run (back-to-back `tdpbf16ps` on four
//! independent accumulators) and gives the calls' useful multiply-adds as
//! a fraction of it.

use duplex_kernels::cpu::{isa, pairs_amx, read_bytes, Isa};
use duplex_kernels::mla::{decode_attention, LatentCache};
use duplex_kernels::pool::{PoolConfig, ThreadPool};
mod common;

use common::{bf16_unit, thread_seconds, Rng};
use std::hint::black_box;
use std::time::Instant;

const PASSES: usize = 9;
const BLOCK: usize = 16;
const DC: usize = 512;
const DR: usize = 64;

fn main() {
    let args: Vec<usize> = std::env::args().skip(1).filter_map(|a| a.parse().ok()).collect();
    let threads = args.first().copied().unwrap_or(2);
    let heads = args.get(1).copied().unwrap_or(16);
    let contexts = if args.len() > 2 { args[2..].to_vec() } else { vec![512, 4096] };
    let best = isa::detect();
    // The f32 products run on every AVX-512 level; the pairs need BF16.
    let levels: Vec<Isa> = [Isa::Avx512, Isa::Avx512Bf16].into_iter().filter(|&l| l <= best).collect();
    if levels.len() < 2 {
        println!("MLA decode: this CPU ({best}) has no AVX512_BF16, so there are no pairs to compare with");
        return;
    }
    let pool = ThreadPool::new(&PoolConfig::single_node(threads));
    let single = ThreadPool::new(&PoolConfig::single_node(1));
    let e = DC + DR;
    let (second, short, peak) = if pairs_amx::usable() { ("AMX BF16 tiles", "tiles", common::bf16_tile_peak(PASSES)) } else { ("BF16 pairs", "pairs", None) };
    println!("MLA decode, {threads} threads, {heads} heads, latent {DC} + {DR}: f32 products ({}) against {second} ({})", levels[0], levels[1]);
    match peak {
        Some(p) => println!("AMX BF16 tile peak (tdpbf16ps back to back, one thread): {p:.1} G multiply-adds/s"),
        None => println!("AMX: no BF16 tiles in use here; no tile peak"),
    }
    for ctx in contexts {
        let layer_bytes = ctx * e * 4;
        let layers = 8.max((512 << 20) / layer_bytes);
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15u64 ^ ctx as u64);
        let mut next = || bf16_unit(&mut rng);
        let caches: Vec<Vec<Vec<f32>>> = (0..layers).map(|_| (0..ctx.div_ceil(BLOCK)).map(|_| (0..BLOCK * e).map(|_| next()).collect()).collect()).collect();
        let q_latent: Vec<f32> = (0..heads * DC).map(|_| next()).collect();
        let q_pe: Vec<f32> = (0..heads * DR).map(|_| next()).collect();
        let mut out = vec![0.0f32; heads * DC];
        let mut scratch = Vec::new();
        let mut run = |pool: &ThreadPool, level: Isa| {
            for layer in &caches {
                let blocks: Vec<&[f32]> = layer.iter().rev().map(|b| b.as_slice()).collect();
                let cache = LatentCache { blocks: &blocks, block_size: BLOCK, dc: DC, dr: DR };
                decode_attention(pool, level, cache, ctx, &q_latent, &q_pe, 0.07, &mut scratch, &mut out);
                black_box(&out);
            }
        };
        let mut wall = [vec![], vec![]];
        let mut cpu = [vec![], vec![]];
        let mut reads = vec![];
        for pass in 0..PASSES + 1 {
            for (k, &level) in levels.iter().enumerate() {
                let t0 = Instant::now();
                run(&pool, level);
                let t = t0.elapsed().as_secs_f64() / layers as f64;
                let c0 = thread_seconds();
                run(&single, level);
                let c = (thread_seconds() - c0) / layers as f64;
                if pass > 0 {
                    wall[k].push(t);
                    cpu[k].push(c);
                }
            }
            let t0 = Instant::now();
            for layer in &caches {
                pool.parallel_for(layer.len(), &|b| {
                    // SAFETY: f32s seen as their bytes.
                    let bytes = unsafe { std::slice::from_raw_parts(layer[b].as_ptr().cast::<u8>(), layer[b].len() * 4) };
                    black_box(read_bytes(best, bytes));
                });
            }
            if pass > 0 {
                reads.push(t0.elapsed().as_secs_f64() / layers as f64);
            }
        }
        let ratios = |v: &[Vec<f64>; 2]| {
            let mut r: Vec<f64> = v[0].iter().zip(&v[1]).map(|(a, b)| a / b).collect();
            r.sort_by(f64::total_cmp);
            r
        };
        let (wall_ratio, cpu_ratio) = (ratios(&wall), ratios(&cpu));
        let stats = |v: &mut Vec<f64>| {
            v.sort_by(f64::total_cmp);
            format!("{:.3} / {:.3} / {:.3}", v[0] * 1e3, v[PASSES / 2] * 1e3, v[PASSES - 1] * 1e3)
        };
        let read = stats(&mut reads);
        println!("ctx {ctx:5} ({layers} layers a pass, {PASSES} passes; ms per call, min / median / max):");
        println!("  {threads} threads: f32 {}, {short} {}; f32 ÷ {short} {:.2} / {:.2} / {:.2}; reading the entries {read}", stats(&mut wall[0]), stats(&mut wall[1]), wall_ratio[0], wall_ratio[PASSES / 2], wall_ratio[PASSES - 1]);
        println!("  1 thread, CPU time: f32 {}, {short} {}; f32 ÷ {short} {:.2} / {:.2} / {:.2}", stats(&mut cpu[0]), stats(&mut cpu[1]), cpu_ratio[0], cpu_ratio[PASSES / 2], cpu_ratio[PASSES - 1]);
        if let Some(p) = peak {
            // Scores over the whole entry and weighted latents, per head and position.
            let macs = (ctx * heads * (e + DC)) as f64;
            let rate = |s: f64| macs / s / 1e9;
            println!("  tiles, 1 thread: {:.1} G useful multiply-adds/s at the median, {:.2} of the tile peak", rate(cpu[1][PASSES / 2]), rate(cpu[1][PASSES / 2]) / p);
        }
    }
}
