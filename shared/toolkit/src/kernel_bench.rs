//! Kernel benchmarks, each quoted against the machine's measured DRAM read
//! bandwidth from the same run (machines are shared and noisy, so absolute
//! numbers mean little; ratios to a limit measured alongside do).

use duplex_kernels::cpu::{bandwidth::read_bytes, elementwise, isa::Isa};
use duplex_kernels::moe::{moe_forward, ExpertCall, ExpertWeights, MoeScratch};
use duplex_kernels::parallel_linear::{par_matmul, LinearScratch};
use duplex_kernels::pool::ThreadPool;
use duplex_kernels::shared::SharedSlice;
use duplex_kernels::{WeightFormat, WeightView};
use std::time::Instant;

/// Best-of-`passes` read bandwidth in bytes/s over `buf`, read by `threads`
/// pool threads in equal contiguous parts.
pub fn read_bandwidth(pool: &ThreadPool, isa: Isa, buf: &[u8], threads: usize, passes: usize) -> f64 {
    let threads = threads.clamp(1, pool.threads());
    let part = buf.len() / threads;
    let mut best = 0.0f64;
    for _ in 0..passes {
        let sink = std::sync::atomic::AtomicU64::new(0);
        let t0 = Instant::now();
        if threads == 1 {
            sink.fetch_add(read_bytes(isa, buf), std::sync::atomic::Ordering::Relaxed);
        } else {
            pool.parallel_for(threads, &|i| {
                let v = read_bytes(isa, &buf[i * part..(i + 1) * part]);
                sink.fetch_add(v, std::sync::atomic::Ordering::Relaxed);
            });
        }
        let dt = t0.elapsed().as_secs_f64();
        std::hint::black_box(sink.into_inner());
        best = best.max((part * threads) as f64 / dt);
    }
    best
}

/// A buffer of `len` bytes of normal FP8 codes of moderate value, filled
/// in parallel so that large buffers are quick to make.
pub fn random_fp8(pool: &ThreadPool, len: usize, seed: u64) -> Vec<u8> {
    let mut buf = vec![0u8; len];
    const CHUNK: usize = 1 << 20;
    let shared = SharedSlice::new(&mut buf);
    pool.parallel_for(len.div_ceil(CHUNK), &|c| {
        let start = c * CHUNK;
        // SAFETY: chunk c is written by this task only.
        let dst = unsafe { shared.slice_mut(start, CHUNK.min(len - start)) };
        let mut state = (seed ^ (c as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15)) | 1;
        for b in dst.iter_mut() {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            // Normal codes of magnitude 2^-6..15: like real checkpoints, which
            // hold almost no zero or subnormal codes (the kernels' slow path).
            *b = (state as u8 & 0x80) | (0x08 + (state >> 8) as u8 % 0x48);
        }
    });
    buf
}

/// An FP8 `[rows, cols]` matrix at `offset` in a big buffer, 128×128 scales.
pub fn fp8_view<'a>(buf: &'a [u8], offset: usize, rows: usize, cols: usize, scales: &'a [f32]) -> WeightView<'a> {
    WeightView { rows, cols, format: WeightFormat::Fp8E4m3 { block: [128, 128] }, data: &buf[offset..offset + rows * cols], scales: &scales[..rows.div_ceil(128) * cols.div_ceil(128)] }
}

/// Bytes/s of a batch-1 FP8 GEMV of shape `rows × cols` on the whole pool,
/// cycling through as many distinct matrices as fit in `buf`, so that every
/// call reads its weights from DRAM. Best of `passes` sweeps.
pub fn gemv_bandwidth(pool: &ThreadPool, isa: Isa, buf: &[u8], rows: usize, cols: usize, passes: usize) -> f64 {
    let size = rows * cols;
    let count = buf.len() / size;
    assert!(count > 0, "buffer smaller than one matrix");
    let scales = vec![0.01f32; rows.div_ceil(128) * cols.div_ceil(128)];
    let x: Vec<f32> = (0..cols).map(|i| ((i % 17) as f32 - 8.0) / 8.0).collect();
    let mut out = vec![0.0f32; rows];
    let mut scratch = LinearScratch::default();
    let mut best = 0.0f64;
    for _ in 0..passes {
        let t0 = Instant::now();
        for m in 0..count {
            let w = fp8_view(buf, m * size, rows, cols, &scales);
            par_matmul(pool, isa, &w, &x, 1, &mut out, &mut scratch);
        }
        best = best.max((count * (size + scales.len() * 4)) as f64 / t0.elapsed().as_secs_f64());
    }
    std::hint::black_box(&out);
    best
}

/// Bytes/s of a whole batch-1 MoE layer: `active` routed experts plus
/// `shared` shared experts of `hidden → inter → hidden`, through
/// [`moe_forward`], cycling through distinct layers' weights in `buf`.
#[allow(clippy::too_many_arguments)]
pub fn moe_layer_bandwidth(pool: &ThreadPool, isa: Isa, buf: &[u8], hidden: usize, inter: usize, active: usize, shared: usize, passes: usize) -> f64 {
    let mat = hidden * inter;
    let experts_per_layer = active + shared;
    let layer_bytes = 3 * mat * experts_per_layer;
    let layers = buf.len() / layer_bytes;
    assert!(layers > 0, "buffer smaller than one MoE layer");
    let scales = vec![0.01f32; hidden.div_ceil(128) * inter.div_ceil(128)];
    let x: Vec<f32> = (0..hidden).map(|i| ((i % 13) as f32 - 6.0) / 6.0).collect();
    let tokens: Vec<(usize, f32)> = vec![(0, 0.25)];
    let mut out = vec![0.0f32; hidden];
    let mut scratch = MoeScratch::default();
    let mut best = 0.0f64;
    for _ in 0..passes {
        let t0 = Instant::now();
        for l in 0..layers {
            let calls: Vec<ExpertCall> = (0..experts_per_layer)
                .map(|e| {
                    let base = l * layer_bytes + e * 3 * mat;
                    ExpertCall {
                        weights: ExpertWeights {
                            gate: fp8_view(buf, base, inter, hidden, &scales),
                            up: fp8_view(buf, base + mat, inter, hidden, &scales),
                            down: fp8_view(buf, base + 2 * mat, hidden, inter, &scales),
                        },
                        tokens: &tokens,
                        node: e % pool.nodes(),
                    }
                })
                .collect();
            moe_forward(pool, isa, &calls, &x, hidden, &mut out, &mut scratch);
        }
        let bytes = layers * (layer_bytes + 3 * experts_per_layer * scales.len() * 4);
        best = best.max(bytes as f64 / t0.elapsed().as_secs_f64());
    }
    std::hint::black_box(&out);
    best
}

/// Bytes/s of the fused elementwise kernels at level `isa` next to the
/// scalar code they replace on the BF16 path, single-threaded, over `len`
/// floats (a multiple of `row`), best of `passes`. Each figure counts the
/// bytes the op must move: RMSNorm reads `x` and writes `out` (8 bytes per
/// element; the weight row stays in cache), SiLU·up reads `gate` and `up`
/// and writes `gate` (12 bytes). A `len` far beyond the last-level cache
/// measures against DRAM; a `len` of one row, against L1/L2 (the call is
/// repeated to fill `min_bytes`, as it is then too short to time alone).
#[derive(Clone, Copy, Debug, Default)]
pub struct ElementwiseBandwidth {
    /// `elementwise::rms_norm` then `round_bf16_slice`, per `row`.
    pub rms_norm_scalar: f64,
    /// `cpu::elementwise::rms_norm_bf16`, per `row`.
    pub rms_norm_fused: f64,
    /// `elementwise::silu_mul`.
    pub silu_mul_scalar: f64,
    /// `cpu::elementwise::silu_mul`.
    pub silu_mul_simd: f64,
}

/// See [`ElementwiseBandwidth`].
pub fn elementwise_bandwidth(isa: Isa, len: usize, row: usize, min_bytes: usize, passes: usize) -> ElementwiseBandwidth {
    assert!(row > 0 && len.is_multiple_of(row), "elementwise_bandwidth: len must be a multiple of row");
    let mut state = 0x2545_f491_4f6c_dd1du64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    };
    let x: Vec<f32> = (0..len).map(|_| 4.0 * next()).collect();
    // SiLU·up runs in place, over and over. With up = 1 + e^-g, each g is a
    // fixed point of g ↦ silu(g) · up, and an attracting one for g in
    // (-2.4, 0) (the slope there, 1 + g·(1 - σ(g)), is inside (-1, 1)), so
    // the values neither drift into subnormals nor blow up, and every
    // repetition does the same work.
    let gate0: Vec<f32> = (0..len).map(|_| -1.15 + next()).collect();
    let up: Vec<f32> = gate0.iter().map(|g| 1.0 + (-g).exp()).collect();
    let weight: Vec<f32> = (0..row).map(|_| 1.0 + 0.1 * next()).collect();
    let mut out = vec![0.0f32; len];
    let mut gate = gate0.clone();
    let reps = min_bytes.div_ceil(12 * len).max(1);
    let time = |f: &mut dyn FnMut(), bytes: usize| {
        let mut best = 0.0f64;
        for _ in 0..passes {
            let t0 = Instant::now();
            for _ in 0..reps {
                f();
            }
            best = best.max((reps * bytes) as f64 / t0.elapsed().as_secs_f64());
        }
        best
    };
    let mut r = ElementwiseBandwidth {
        rms_norm_scalar: time(
            &mut || {
                for (o, xi) in out.chunks_mut(row).zip(x.chunks(row)) {
                    duplex_kernels::elementwise::rms_norm(xi, &weight, 1e-6, o);
                    duplex_kernels::round_bf16_slice(o);
                }
            },
            8 * len,
        ),
        ..Default::default()
    };
    r.rms_norm_fused = time(
        &mut || {
            for (o, xi) in out.chunks_mut(row).zip(x.chunks(row)) {
                elementwise::rms_norm_bf16(isa, xi, &weight, 1e-6, o);
            }
        },
        8 * len,
    );
    r.silu_mul_scalar = time(&mut || duplex_kernels::elementwise::silu_mul(&mut gate, &up), 12 * len);
    gate.copy_from_slice(&gate0);
    r.silu_mul_simd = time(&mut || elementwise::silu_mul(isa, &mut gate, &up), 12 * len);
    std::hint::black_box((&out, &gate));
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `cargo test --release -p duplex-kernels -- --ignored --nocapture elementwise_speed`
    #[test]
    #[ignore = "benchmark: prints numbers"]
    fn elementwise_speed() {
        const GB: f64 = 1e9;
        let row = 7168; // DeepSeek-V3's hidden size
        for (label, len) in [("DRAM (4 × 128 MiB buffers)", row * 4681), ("one row, in cache", row)] {
            println!("{label}:");
            println!("| level | RMSNorm+BF16 scalar | fused | speedup | SiLU·up scalar | SIMD | speedup |");
            println!("| --- | --- | --- | --- | --- | --- | --- |");
            for isa in duplex_kernels::cpu::isa::supported() {
                let b = elementwise_bandwidth(isa, len, row, 1 << 30, 5);
                println!(
                    "| {isa} | {:.1} GB/s | {:.1} GB/s | {:.2}× | {:.1} GB/s | {:.1} GB/s | {:.2}× |",
                    b.rms_norm_scalar / GB,
                    b.rms_norm_fused / GB,
                    b.rms_norm_fused / b.rms_norm_scalar,
                    b.silu_mul_scalar / GB,
                    b.silu_mul_simd / GB,
                    b.silu_mul_simd / b.silu_mul_scalar
                );
            }
        }
    }
}
