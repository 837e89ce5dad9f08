//! Single-thread k-quant GEMV throughput against a streaming read.
//!
//! `cargo bench -p duplex-kernels --bench quant_dot [-- [PATH...]]`
//! (`PATH`: only these of scalar, avx2, avx512vnni).
//!
//! A 2048 × 2048 matrix in Q4_K and in Q8_0 (then Q6_K, Q5_K and Q5_0,
//! the other formats of a Q4_K_M model, and Q5_1, a Q5_K_M model's
//! fallback), times one activation vector quantized for it (Q8_K / Q8_0 /
//! Q8_1; the quantization is not timed: a layer
//! quantizes once for all its rows). Then the shape of MLA's per-head
//! `attn_k_b` (rows of 128, four blocks) in its formats, 16384 × 128, and
//! of its `attn_v_b` (rows of 512, two k-quant blocks), 4096 × 512.
//! Two settings per path:
//! - DRAM: enough distinct matrices (~600 MB) that every row comes from
//!   memory, next to `read_bytes` (the machine's best single-thread read)
//!   over the same buffer, passes alternating so background load hits both;
//! - cache: one matrix, again and again (2.4 MB in Q4_K, 4.5 MB in Q8_0:
//!   L3 on this machine), which is the kernel's compute ceiling.
//!
//! Times are thread CPU time; median and best of the passes are shown.

use duplex_kernels::cpu::{isa, read_bytes};
use duplex_kernels::quant::{gemv_with, Activations, DotPath, QuantKind};
mod common;

use common::{matrix_bytes, rate, summary, Rng};
use std::hint::black_box;

const TOTAL_BYTES: usize = 600_000_000;
const PASSES: usize = 5;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).filter(|a| !a.starts_with('-')).collect();
    let paths: Vec<DotPath> = DotPath::supported().into_iter().filter(|p| args.is_empty() || args.iter().any(|a| a == p.name())).collect();
    let read_isa = isa::detect();
    println!("quant GEMV, one thread; paths {paths:?}; read_bytes at {read_isa}");
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let square = [QuantKind::Q4K, QuantKind::Q8_0, QuantKind::Q6K, QuantKind::Q5K, QuantKind::Q5_0, QuantKind::Q5_1].map(|k| (k, 2048, 2048));
    let k_b = [QuantKind::Q5_0, QuantKind::Q8_0, QuantKind::Q5_1].map(|k| (k, 16384, 128));
    let v_b = [QuantKind::Q4K, QuantKind::Q6K].map(|k| (k, 4096, 512));
    for (kind, rows, cols) in square.into_iter().chain(k_b).chain(v_b) {
        let x: Vec<f32> = (0..cols).map(|i| ((i as f32) * 0.37).sin() * 1.5).collect();
        let size = rows * kind.row_bytes(cols).expect("whole blocks");
        let matrices = TOTAL_BYTES / size;
        let all = matrix_bytes(kind, size * matrices, &mut rng);
        let act = Activations::quantize_for(kind, &x).expect("whole blocks");
        let mut y = vec![0f32; rows];
        println!(
            "\n{kind} {rows} x {cols}: {:.2} MB per matrix, {matrices} matrices = {:.0} MB ({:.3} bytes/weight)",
            size as f64 / 1e6,
            all.len() as f64 / 1e6,
            size as f64 / (rows * cols) as f64
        );
        for &path in &paths {
            let passes = if path == DotPath::Scalar { 2 } else { PASSES };
            let (mut read, mut dram, mut cache) = (vec![], vec![], vec![]);
            for _ in 0..passes {
                read.push(rate(all.len(), || {
                    black_box(read_bytes(read_isa, &all));
                }));
                dram.push(rate(all.len(), || {
                    for m in all.chunks_exact(size) {
                        gemv_with(path, kind, m, rows, &act, &mut y).expect("valid shapes");
                        black_box(&y);
                    }
                }));
                let first = &all[..size];
                let reps = (matrices / 4).max(8);
                cache.push(rate(reps * size, || {
                    for _ in 0..reps {
                        gemv_with(path, kind, first, rows, &act, &mut y).expect("valid shapes");
                        black_box(&y);
                    }
                }));
            }
            let ((dm, db), (rm, rb), (cm, cb)) = (summary(dram), summary(read), summary(cache));
            println!(
                "  {:<10} DRAM {dm:5.2} GB/s (best {db:5.2})  read_bytes {rm:5.2} (best {rb:5.2})  = {:3.0}% (best/best {:3.0}%)   cache {cm:5.2} GB/s (best {cb:5.2}) = {:4.1} Gweights/s",
                path.name(),
                100.0 * dm / rm,
                100.0 * db / rb,
                cm * 1e9 / (size as f64 / (rows * cols) as f64) / 1e9
            );
        }
    }
}
