//! Single-thread GEMM throughput of `matmul_bf16` (FP8 and BF16 weights
//! against BF16 tokens): what a prefill's FP8 products run at once the
//! weights are in cache, on the vector kernels and, where the CPU has AMX
//! BF16 tiles, on the tiles.
//!
//! `cargo bench -p duplex-kernels --bench matmul_bf16 [-- [--tokens N,...]]`
//! (the token counts, 64 by default; the tile fractions ask for
//! `--tokens 128,512,2048`).
//!
//! A band of 256 rows × 2048 columns (FP8 in DeepSeek's 128 × 128 scale
//! blocks, 512 KB; BF16, 1 MB) against N tokens, at the CPU's best level,
//! in G multiply-adds per second of thread CPU time: median and best of
//! the passes, the vectors' and the tiles' passes alternating.
//!
//! Where the tiles are usable, the tile unit's peak is measured in the same
//! run (back-to-back `tdpbf16ps` on four independent accumulators), each
//! tile rate is also given as a fraction of it, and a sweep of 1–32 tokens
//! finds the turning point: the fewest tokens at which the tiles beat the
//! vectors by 5% (KTransformers switches at about four tokens per expert;
//! `matmul_bf16` takes the tiles from `TILES_LEAST`).

use duplex_kernels::cpu::gemv::{matmul_bf16_on, Products, TILES_LEAST};
use duplex_kernels::cpu::isa;
use duplex_kernels::{WeightFormat, WeightView};
mod common;

use common::{summary, thread_seconds, Rng};
use std::hint::black_box;

const ROWS: usize = 256;
const COLS: usize = 2048;
const PASSES: usize = 15;
/// Token-products per pass (tokens × repeats).
const TOKEN_PRODUCTS: usize = 256;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let tokens = common::token_counts(&args, &[64]);
    let level = isa::detect();
    let tiles = Products::tiles_usable();
    println!("matmul_bf16 {ROWS} x {COLS} against {tokens:?} tokens, one thread, weights in cache, level {level}; AMX BF16 tiles {}", if tiles { "in use" } else { "not usable here" });
    let peak = if tiles { common::bf16_tile_peak(PASSES) } else { None };
    if let Some(p) = peak {
        println!("AMX BF16 tile peak (tdpbf16ps back to back, one thread): {p:.1} G multiply-adds/s");
    }
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let fp8_codes: Vec<u8> = (0..ROWS * COLS)
        .map(|_| {
            // Normal codes, no NaN: what a block-scaled checkpoint holds.
            let c = (rng.next() >> 56) as u8;
            let c = if c & 0x78 == 0 { c | 0x30 } else { c };
            if c & 0x7f == 0x7f { 0x7e } else { c }
        })
        .collect();
    let scales: Vec<f32> = (0..ROWS.div_ceil(128) * COLS.div_ceil(128)).map(|i| 1e-3 * (1 + i % 7) as f32).collect();
    let bf16_words: Vec<u8> = (0..ROWS * COLS).flat_map(|_| half::bf16::from_f32(common::bf16_unit(&mut rng)).to_le_bytes()).collect();
    let matrices = [
        ("FP8 [128,128]", WeightView { rows: ROWS, cols: COLS, format: WeightFormat::Fp8E4m3 { block: [128, 128] }, data: &fp8_codes, scales: &scales }),
        ("BF16", WeightView { rows: ROWS, cols: COLS, format: WeightFormat::Bf16, data: &bf16_words, scales: &[] }),
    ];
    println!("| weights | tokens | vectors, G multiply-adds/s (median / best) | tiles (median / best) | tiles ÷ vectors (medians) |");
    println!("| --- | --- | --- | --- | --- |");
    for (name, w) in &matrices {
        for &n in &tokens {
            let products: &[Products] = if tiles { &[Products::Vectors, Products::Tiles] } else { &[Products::Vectors] };
            let rates = rates(level, w, n, products, PASSES);
            let (vm, vb) = summary(rates[0].clone());
            let tiles_cell = match rates.get(1) {
                Some(r) => {
                    let (tm, tb) = summary(r.clone());
                    let of_peak = peak.map_or(String::new(), |p| format!(" ({:.2} / {:.2} of the tile peak)", tm / p, tb / p));
                    (format!("{tm:.1} / {tb:.1}{of_peak}"), format!("{:.2}", tm / vm))
                }
                None => ("—".into(), "—".into()),
            };
            println!("| {name} | {n} | {vm:.1} / {vb:.1} | {} | {} |", tiles_cell.0, tiles_cell.1);
        }
    }
    if tiles {
        println!("\nturning point (1-32 tokens, medians of {} passes each; tiles ÷ vectors, the first at least 1.05; matmul_bf16 takes the tiles from {TILES_LEAST}):", PASSES / 3);
        for (name, w) in &matrices {
            let ratios: Vec<(usize, f64)> = (1..=32)
                .map(|n| {
                    let r = rates(level, w, n, &[Products::Vectors, Products::Tiles], PASSES / 3);
                    (n, summary(r[1].clone()).0 / summary(r[0].clone()).0)
                })
                .collect();
            let turn = ratios.iter().find(|&&(_, r)| r >= 1.05).map_or("never within 32".to_string(), |(n, _)| format!("{n} tokens"));
            let shown: Vec<String> = ratios.iter().filter(|(n, _)| [1, 2, 4, 8, 9, 16, 32].contains(n)).map(|(n, r)| format!("{n}: {r:.2}")).collect();
            println!("  {name}: tiles faster from {turn} ({})", shown.join(", "));
        }
    }
}

/// G multiply-adds/s of `passes` passes of `n` tokens on each of
/// `products`, the products' passes alternating.
fn rates(level: isa::Isa, w: &WeightView, n: usize, products: &[Products], passes: usize) -> Vec<Vec<f64>> {
    let x: Vec<u16> = (0..n * COLS).map(|i| half::bf16::from_f32(((i as f32) * 0.37).sin() * 1.5).to_bits()).collect();
    let mut out = vec![0.0f32; n * ROWS];
    let repeats = TOKEN_PRODUCTS.div_ceil(n);
    let mut rates = vec![Vec::with_capacity(passes); products.len()];
    for _ in 0..passes {
        for (p, &products) in products.iter().enumerate() {
            let t = thread_seconds();
            for _ in 0..repeats {
                matmul_bf16_on(level, products, black_box(w), 0..ROWS, &x, n, &mut out);
            }
            rates[p].push((repeats * ROWS * COLS * n) as f64 / (thread_seconds() - t) / 1e9);
            black_box(&out);
        }
    }
    rates
}
