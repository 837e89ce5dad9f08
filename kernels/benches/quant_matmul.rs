//! Single-thread quantized GEMM throughput: what a prefill's weight
//! products run at once the weights are in cache.
//!
//! `cargo bench -p duplex-kernels --bench quant_matmul [-- [PATH...] [--tokens N,...]]`
//! (`PATH`: only these of scalar, avx2, avx512vnni, amx; `--tokens`: the
//! token counts, 64 by default; the tile fractions ask for
//! `--tokens 128,512,2048`).
//!
//! A band of 256 rows × 2048 columns of each format a Q4_K_M or Q8_0 GGUF
//! holds (Q4_K, Q5_K, Q6_K, Q8_0, Q5_0; ≤ 550 KB, so in L2) against N
//! quantized tokens through `quant::matmul`, as a prefill task runs it.
//! Reported in G multiply-adds per second of thread CPU time (median and
//! best of the passes): prefill is bound by this, not by DRAM.
//!
//! Where the CPU has AMX INT8 tiles, the tile unit's peak is measured in
//! the same run (back-to-back `tdpbssd` on four independent accumulators),
//! each format on the `amx` path is also given as a fraction of it, and a
//! sweep of 1–32 tokens finds the turning point: the fewest tokens at
//! which the tiles beat the AVX-512 kernels, per format (KTransformers
//! switches at about four tokens per expert; `quant::matmul` takes the
//! tiles where it takes the AVX-512 lanes: from `LANES_LEAST` tokens for
//! the 32-element formats, `K_LANES_LEAST` for the k-quants).

use duplex_kernels::cpu::amx::{HardwareTiles, Tiles};
use duplex_kernels::quant::{matmul, DotPath, QuantKind, QuantizedTokens};
mod common;

use common::{matrix_bytes, summary, thread_seconds, tile_rate, Rng};
use std::hint::black_box;

const ROWS: usize = 256;
const COLS: usize = 2048;
const PASSES: usize = 15;
/// Token-products per pass (tokens × repeats): enough that a pass takes
/// some tens of milliseconds at any token count.
const TOKEN_PRODUCTS: usize = 512;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let tokens = common::token_counts(&args, &[64]);
    let names: Vec<&String> = args.iter().enumerate().filter(|&(i, a)| !a.starts_with('-') && (i == 0 || args[i - 1] != "--tokens")).map(|(_, a)| a).collect();
    let paths: Vec<DotPath> = DotPath::supported().into_iter().filter(|p| names.is_empty() || names.iter().any(|a| *a == p.name())).collect();
    println!("quant GEMM {ROWS} x {COLS} against {tokens:?} tokens, one thread, weights in cache; paths {paths:?}");
    let peak = tile_peak();
    match peak {
        Some(p) => println!("AMX INT8 tile peak (tdpbssd back to back, one thread): {p:.1} G multiply-adds/s"),
        None => println!("AMX: this CPU or kernel gives no INT8 tiles; no tile peak"),
    }
    println!("| format | path | tokens | G multiply-adds/s (median) | best |");
    println!("| --- | --- | --- | --- | --- |");
    let mut rng = Rng(0x2545_f491_4f6c_dd1d);
    let matrices: Vec<(QuantKind, Vec<u8>)> = [QuantKind::Q4K, QuantKind::Q5K, QuantKind::Q6K, QuantKind::Q8_0, QuantKind::Q5_0]
        .into_iter()
        .map(|kind| (kind, matrix_bytes(kind, ROWS * kind.row_bytes(COLS).expect("whole blocks"), &mut rng)))
        .collect();
    for (kind, m) in &matrices {
        for &n in &tokens {
            for &path in &paths {
                let (median, best) = gemm_rate(path, *kind, m, n, PASSES);
                let of_peak = match (path, peak) {
                    (DotPath::Amx, Some(p)) => format!(" ({:.2} / {:.2} of the tile peak)", median / p, best / p),
                    _ => String::new(),
                };
                println!("| {kind} | {} | {n} | {median:.1} | {best:.1}{of_peak} |", path.name());
            }
        }
    }
    if peak.is_some() && paths.contains(&DotPath::Amx) && paths.contains(&DotPath::Avx512Vnni) {
        // Below `LANES_LEAST` (4; the k-quants' `K_LANES_LEAST`, 12) tokens
        // both paths run the same kernels, so their ratio there is noise; a
        // turn is a 5% lead.
        println!("\nturning point (1-32 tokens, medians of {} passes each; amx ÷ avx512vnni, the first at least 1.05):", PASSES / 3);
        for (kind, m) in &matrices {
            let ratios: Vec<(usize, f64)> = (1..=32).map(|n| (n, gemm_rate(DotPath::Amx, *kind, m, n, PASSES / 3).0 / gemm_rate(DotPath::Avx512Vnni, *kind, m, n, PASSES / 3).0)).collect();
            let turn = ratios.iter().find(|&&(_, r)| r >= 1.05).map_or("never within 32".to_string(), |(n, _)| format!("{n} tokens"));
            let shown: Vec<String> = ratios.iter().filter(|(n, _)| [1, 2, 4, 8, 16, 32].contains(n)).map(|(n, r)| format!("{n}: {r:.2}")).collect();
            println!("  {kind}: tiles faster from {turn} ({})", shown.join(", "));
        }
    }
}

/// (median, best) G multiply-adds/s of `passes` passes of `n` tokens on `path`.
fn gemm_rate(path: DotPath, kind: QuantKind, m: &[u8], n: usize, passes: usize) -> (f64, f64) {
    let x: Vec<f32> = (0..n * COLS).map(|i| ((i as f32) * 0.37).sin() * 1.5).collect();
    let mut acts = QuantizedTokens::default();
    acts.quantize(kind, &x, n).expect("quantize");
    let mut out = vec![0.0f32; n * ROWS];
    let repeats = TOKEN_PRODUCTS.div_ceil(n);
    let mut rates = Vec::with_capacity(passes);
    for _ in 0..passes {
        let t = thread_seconds();
        for _ in 0..repeats {
            matmul(path, kind, black_box(m), ROWS, &acts, &mut out).expect("matmul");
        }
        rates.push((repeats * ROWS * COLS * n) as f64 / (thread_seconds() - t) / 1e9);
        black_box(&out);
    }
    summary(rates)
}

/// The tile unit's INT8 rate, G multiply-adds/s (median of the passes):
/// four 16 × 16 accumulators, each `tdpbssd` 16 × 64 × 16 multiply-adds,
/// none waiting for another.
fn tile_peak() -> Option<f64> {
    let mut t = HardwareTiles::new()?;
    Some(tile_rate(&mut t, &[1u8; 1024], 16 * 64 * 16, PASSES, |t| {
        t.dot_i8::<0, 4, 6>();
        t.dot_i8::<1, 4, 7>();
        t.dot_i8::<2, 5, 6>();
        t.dot_i8::<3, 5, 7>();
    }))
}
