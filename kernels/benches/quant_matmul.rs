//! Single-thread quantized GEMM throughput: what a prefill's weight
//! products run at once the weights are in cache.
//!
//! `cargo bench -p duplex-kernels --bench quant_matmul [-- [PATH...]]`
//! (`PATH`: only these of scalar, avx2, avx512vnni, amx).
//!
//! A band of 256 rows × 2048 columns of each format a Q4_K_M or Q8_0 GGUF
//! holds (Q4_K, Q5_K, Q6_K, Q8_0, Q5_0; ≤ 550 KB, so in L2) against 64
//! quantized tokens through `quant::matmul`, as a prefill task runs it.
//! Reported in G multiply-adds per second of thread CPU time (median and
//! best of the passes): prefill is bound by this, not by DRAM.
//!
//! Where the CPU has AMX INT8 tiles, the tile unit's peak is measured in
//! the same run (back-to-back `tdpbssd` on four independent accumulators),
//! and each format on the `amx` path is also given as a fraction of it.

use duplex_kernels::cpu::amx::{HardwareTiles, Tiles};
use duplex_kernels::quant::{matmul, DotPath, QuantKind, QuantizedTokens};
mod common;

use common::{matrix_bytes, summary, thread_seconds, tile_rate, Rng};
use std::hint::black_box;

const ROWS: usize = 256;
const COLS: usize = 2048;
const TOKENS: usize = 64;
const PASSES: usize = 15;
/// Products per pass: enough that a pass takes some tens of milliseconds.
const REPEATS: usize = 8;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).filter(|a| !a.starts_with('-')).collect();
    let paths: Vec<DotPath> = DotPath::supported().into_iter().filter(|p| args.is_empty() || args.iter().any(|a| a == p.name())).collect();
    println!("quant GEMM {ROWS} x {COLS} against {TOKENS} tokens, one thread, weights in cache; paths {paths:?}");
    let peak = tile_peak();
    match peak {
        Some(p) => println!("AMX INT8 tile peak (tdpbssd back to back, one thread): {p:.1} G multiply-adds/s"),
        None => println!("AMX: this CPU or kernel gives no INT8 tiles; no tile peak"),
    }
    println!("| format | path | G multiply-adds/s (median) | best |");
    println!("| --- | --- | --- | --- |");
    let mut rng = Rng(0x2545_f491_4f6c_dd1d);
    let x: Vec<f32> = (0..TOKENS * COLS).map(|i| ((i as f32) * 0.37).sin() * 1.5).collect();
    let mut out = vec![0.0f32; TOKENS * ROWS];
    for kind in [QuantKind::Q4K, QuantKind::Q5K, QuantKind::Q6K, QuantKind::Q8_0, QuantKind::Q5_0] {
        let m = matrix_bytes(kind, ROWS * kind.row_bytes(COLS).expect("whole blocks"), &mut rng);
        let mut acts = QuantizedTokens::default();
        acts.quantize(kind, &x, TOKENS).expect("quantize");
        for &path in &paths {
            let mut rates = Vec::with_capacity(PASSES);
            for _ in 0..PASSES {
                let t = thread_seconds();
                for _ in 0..REPEATS {
                    matmul(path, kind, black_box(&m), ROWS, &acts, &mut out).expect("matmul");
                }
                rates.push((REPEATS * ROWS * COLS * TOKENS) as f64 / (thread_seconds() - t) / 1e9);
                black_box(&out);
            }
            let (median, best) = summary(rates);
            let of_peak = match (path, peak) {
                (DotPath::Amx, Some(p)) => format!(" ({:.2} / {:.2} of the tile peak)", median / p, best / p),
                _ => String::new(),
            };
            println!("| {kind} | {} | {median:.1} | {best:.1}{of_peak} |", path.name());
        }
    }
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
