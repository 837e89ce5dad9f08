//! Single-thread FP8 GEMV bandwidth against a streaming read.
//!
//! `cargo bench -p duplex-kernels --bench gemv_bandwidth [-- [LEVEL...] [n1]]`
//! (`LEVEL`: only these ISA levels; `n1`: skip the batched shapes).
//!
//! Streams 40 different DeepSeek-V3-shaped FP8 matrices (~590 MB, far beyond
//! any L3) through `matmul_bf16` for one token and reports weight bytes per
//! second next to `read_bytes` over the same buffer, for every ISA level this
//! CPU supports. Passes of the two alternate, so that background load hits
//! both alike, and are timed by thread CPU time (the machines are shared);
//! the median and best of the passes are shown. Extra lines show batched
//! decode and prefill, as weight bytes per second and MACs per second.

use duplex_kernels::cpu::gemv::{matmul_bf16_on, Products};
use duplex_kernels::cpu::{isa, matmul_bf16, read_bytes, Isa};
use duplex_kernels::{WeightFormat, WeightView};
mod common;

use common::{rate, summary, Rng};
use std::hint::black_box;
#[cfg(not(target_os = "linux"))]
use std::time::Instant;

const MATRICES: usize = 40;
const PASSES: usize = 7;

/// A 64-byte aligned buffer of FP8 codes (what a loader that repacks weights
/// gives), distributed like a block-scaled checkpoint: almost every code has
/// a nonzero exponent (~1e-4 zero or subnormal), no NaN.
fn weights(len: usize, rng: &mut Rng) -> (Vec<u8>, usize) {
    let mut v = vec![0u8; len + 64];
    let off = v.as_ptr().align_offset(64);
    for b in &mut v[off..off + len] {
        let r = rng.next();
        let mut c = (r >> 56) as u8;
        if c & 0x78 == 0 && (r & 0xffff) > 6 {
            c |= 0x30;
        }
        if c & 0x7f == 0x7f {
            c = 0x7e;
        }
        *b = c;
    }
    (v, off)
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let only: Vec<Isa> = args.iter().filter_map(|a| a.parse().ok()).collect();
    let batched = !args.iter().any(|a| a == "n1");
    let mut rng = Rng(0x1234_5678_9abc_def1);
    println!("ISA levels on this CPU: {:?} (detect() = {})", isa::supported(), isa::detect());
    // DeepSeek-V3's expert shapes in FP8, and Qwen3-30B-A3B's attention
    // projections in BF16 (as released).
    let fp8 = WeightFormat::Fp8E4m3 { block: [128, 128] };
    for (rows, cols, format) in [(2048usize, 7168usize, fp8), (7168, 2048, fp8), (4096, 2048, WeightFormat::Bf16), (2048, 4096, WeightFormat::Bf16)] {
        let size = rows * cols * format.bytes_per_element();
        let (buf, off) = weights(size * MATRICES, &mut rng);
        let all = &buf[off..off + size * MATRICES];
        let scales: Vec<f32> = match format {
            WeightFormat::Fp8E4m3 { .. } => (0..rows.div_ceil(128) * cols.div_ceil(128)).map(|i| 1e-3 * (1 + i % 7) as f32).collect(),
            _ => vec![],
        };
        let view = |m: usize| WeightView { rows, cols, format, data: &all[m * size..(m + 1) * size], scales: &scales };
        let x: Vec<u16> = (0..cols).map(|i| half::bf16::from_f32((i % 17) as f32 * 0.1 - 0.8).to_bits()).collect();
        let name = if format == fp8 { "FP8 [128,128]" } else { "BF16" };
        println!("\n{rows} x {cols} {name}, {MATRICES} matrices = {:.0} MB, one thread", all.len() as f64 / 1e6);
        for isa in isa::supported().into_iter().rev().filter(|i| only.is_empty() || only.contains(i)) {
            let passes = if isa == Isa::Portable { 1 } else { PASSES };
            let mut out = vec![0f32; rows];
            let (mut read, mut gemv) = (vec![], vec![]);
            for _ in 0..passes {
                read.push(rate(all.len(), || {
                    black_box(read_bytes(isa, all));
                }));
                gemv.push(rate(all.len(), || {
                    for m in 0..MATRICES {
                        matmul_bf16(isa, &view(m), 0..rows, &x, 1, &mut out);
                        black_box(&out);
                    }
                }));
            }
            let ((gm, gb), (rm, rb)) = (summary(gemv), summary(read));
            println!(
                "  {:<11} n=1  gemv {gm:5.1} GB/s (best {gb:5.1})   read_bytes {rm:5.1} (best {rb:5.1})   ratio {:3.0}% (best/best {:3.0}%)",
                isa.name(),
                100.0 * gm / rm,
                100.0 * gb / rb
            );
            if isa == Isa::Portable || !batched {
                continue;
            }
            for n in [2usize, 4, 8, 16, 64] {
                let xs: Vec<u16> = (0..n).flat_map(|_| x.iter().copied()).collect();
                let mut out = vec![0f32; n * rows];
                let mats = (MATRICES * 4 / n).clamp(2, MATRICES);
                let runs: Vec<f64> = (0..3)
                    .map(|_| {
                        rate(mats * size, || {
                            for m in 0..mats {
                                // The level's own vector kernels (`matmul_bf16_on`), even
                                // where `matmul_bf16` would take AMX tiles (the
                                // `matmul_bf16` bench compares those).
                                matmul_bf16_on(isa, Products::Vectors, &view(m), 0..rows, &xs, n, &mut out);
                                black_box(&out);
                            }
                        })
                    })
                    .collect();
                let (med, _) = summary(runs);
                println!("  {:<11} n={n:<3} {med:5.2} GB/s of weights = {:5.1} GMAC/s", "", med * n as f64);
            }
        }
    }
}
