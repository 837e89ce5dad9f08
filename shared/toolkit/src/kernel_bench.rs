//! Kernel benchmarks, each quoted against the machine's measured DRAM read
//! bandwidth from the same run (machines are shared and noisy, so absolute
//! numbers mean little; ratios to a limit measured alongside do).

use duplex_kernels::cpu::{bandwidth::read_bytes, elementwise, isa::Isa};
use duplex_kernels::moe::{moe_forward, ExpertCall, ExpertWeights, MoeScratch};
use duplex_kernels::parallel_linear::{par_matmul, LinearScratch};
use duplex_kernels::pool::ThreadPool;
use duplex_kernels::quant::QuantKind;
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

/// Make every f16 block scale of the `kind` blocks in `region` a small
/// normal value (random bytes there may be NaN or infinite), in parallel.
pub fn set_block_scales(pool: &ThreadPool, kind: QuantKind, region: &mut [u8]) {
    let bb = kind.block_bytes();
    let blocks = region.len() / bb;
    let shared = SharedSlice::new(region);
    const CHUNK: usize = 1 << 14;
    pool.parallel_for(blocks.div_ceil(CHUNK), &|c| {
        let first = c * CHUNK;
        let n = CHUNK.min(blocks - first);
        // SAFETY: chunk c is written by this task only.
        let dst = unsafe { shared.slice_mut(first * bb, n * bb) };
        for (i, block) in dst.chunks_exact_mut(bb).enumerate() {
            for (k, &at) in kind.f16_offsets().iter().enumerate() {
                // 2^-7 .. 2^-4 for `d`, a tenth of that for `dmin`.
                let v = (1u32 << ((first + i) % 4)) as f32 / 128.0 / if k == 0 { 1.0 } else { 10.0 };
                block[at..at + 2].copy_from_slice(&half::f16::from_f32(v).to_le_bytes());
            }
        }
    });
}

/// `len` bytes (whole blocks) of random `kind` blocks with valid scales.
pub fn random_blocks(pool: &ThreadPool, kind: QuantKind, len: usize, seed: u64) -> Vec<u8> {
    let mut buf = random_fp8(pool, len / kind.block_bytes() * kind.block_bytes(), seed);
    set_block_scales(pool, kind, &mut buf);
    buf
}

/// `len` bytes of as many whole MoE experts as fit, laid out as
/// [`format_moe_layer_bandwidth`] reads them, each matrix valid for its format.
pub fn random_moe_layers(pool: &ThreadPool, formats: [BenchFormat; 3], hidden: usize, inter: usize, len: usize, seed: u64) -> Vec<u8> {
    let mut buf = random_fp8(pool, len, seed);
    let sizes = moe_matrix_bytes(formats, hidden, inter);
    let expert_bytes: usize = sizes.iter().sum();
    for e in 0..len / expert_bytes {
        let mut at = e * expert_bytes;
        for (format, size) in formats.iter().zip(sizes) {
            if let BenchFormat::Quant(kind) = format {
                set_block_scales(pool, *kind, &mut buf[at..at + size]);
            }
            at += size;
        }
    }
    buf
}

/// Bytes of one expert's gate, up and down matrices.
fn moe_matrix_bytes(formats: [BenchFormat; 3], hidden: usize, inter: usize) -> [usize; 3] {
    [formats[0].matrix_bytes(inter, hidden), formats[1].matrix_bytes(inter, hidden), formats[2].matrix_bytes(hidden, inter)]
}

/// FP8 weights with 128×128 blocks, or a ggml block format.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BenchFormat {
    Fp8,
    Quant(QuantKind),
}

impl BenchFormat {
    /// Bytes of a `[rows, cols]` matrix in a weight buffer (FP8 keeps its
    /// scales apart, in an f32 array).
    fn matrix_bytes(self, rows: usize, cols: usize) -> usize {
        match self {
            BenchFormat::Fp8 => rows * cols,
            BenchFormat::Quant(kind) => rows * kind.row_bytes(cols).expect("whole blocks"),
        }
    }

    /// Bytes a product with a `[rows, cols]` matrix reads: its own and its scales'.
    fn read_bytes(self, rows: usize, cols: usize) -> usize {
        match self {
            BenchFormat::Fp8 => rows * cols + 4 * rows.div_ceil(128) * cols.div_ceil(128),
            BenchFormat::Quant(_) => self.matrix_bytes(rows, cols),
        }
    }
}

/// A `[rows, cols]` matrix of `format` at `offset` in a big buffer; FP8
/// takes its 128×128 scales from `scales`.
pub fn bench_view<'a>(format: BenchFormat, buf: &'a [u8], offset: usize, rows: usize, cols: usize, scales: &'a [f32]) -> WeightView<'a> {
    match format {
        BenchFormat::Fp8 => fp8_view(buf, offset, rows, cols, scales),
        BenchFormat::Quant(kind) => {
            let bytes = format.matrix_bytes(rows, cols);
            WeightView { rows, cols, format: WeightFormat::Quant(kind), data: &buf[offset..offset + bytes], scales: &[] }
        }
    }
}

/// An FP8 `[rows, cols]` matrix at `offset` in a big buffer, 128×128 scales.
pub fn fp8_view<'a>(buf: &'a [u8], offset: usize, rows: usize, cols: usize, scales: &'a [f32]) -> WeightView<'a> {
    WeightView { rows, cols, format: WeightFormat::Fp8E4m3 { block: [128, 128] }, data: &buf[offset..offset + rows * cols], scales: &scales[..rows.div_ceil(128) * cols.div_ceil(128)] }
}

/// Bytes/s of a batch-1 FP8 GEMV of shape `rows × cols` on the whole pool,
/// cycling through as many distinct matrices as fit in `buf`, so that every
/// call reads its weights from DRAM. Best of `passes` sweeps.
pub fn gemv_bandwidth(pool: &ThreadPool, isa: Isa, buf: &[u8], rows: usize, cols: usize, passes: usize) -> f64 {
    format_gemv_bandwidth(pool, isa, BenchFormat::Fp8, buf, rows, cols, passes)
}

/// [`gemv_bandwidth`] of `format` weights (`buf` holds them: for a block
/// format, made by [`random_blocks`]).
pub fn format_gemv_bandwidth(pool: &ThreadPool, isa: Isa, format: BenchFormat, buf: &[u8], rows: usize, cols: usize, passes: usize) -> f64 {
    let size = format.matrix_bytes(rows, cols);
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
            let w = bench_view(format, buf, m * size, rows, cols, &scales);
            par_matmul(pool, isa, &w, &x, 1, &mut out, &mut scratch);
        }
        best = best.max((count * format.read_bytes(rows, cols)) as f64 / t0.elapsed().as_secs_f64());
    }
    std::hint::black_box(&out);
    best
}

/// Bytes/s of a whole batch-1 MoE layer: `active` routed experts plus
/// `shared` shared experts of `hidden → inter → hidden`, through
/// [`moe_forward`], cycling through distinct layers' weights in `buf`.
#[allow(clippy::too_many_arguments)]
pub fn moe_layer_bandwidth(pool: &ThreadPool, isa: Isa, buf: &[u8], hidden: usize, inter: usize, active: usize, shared: usize, passes: usize) -> f64 {
    format_moe_layer_bandwidth(pool, isa, [BenchFormat::Fp8; 3], buf, hidden, inter, active, shared, passes)
}

/// [`moe_layer_bandwidth`] with the gate, up and down projections in
/// `formats` (a Q4_K_M file keeps gate and up in Q4_K and down in Q6_K or
/// Q4_K), from a `buf` made by [`random_moe_layers`] (FP8 takes any bytes;
/// layers of one block format are that format's blocks end to end, so
/// [`random_blocks`] of it serves as well).
#[allow(clippy::too_many_arguments)]
pub fn format_moe_layer_bandwidth(pool: &ThreadPool, isa: Isa, formats: [BenchFormat; 3], buf: &[u8], hidden: usize, inter: usize, active: usize, shared: usize, passes: usize) -> f64 {
    let sizes = moe_matrix_bytes(formats, hidden, inter);
    let expert_bytes: usize = sizes.iter().sum();
    let experts_per_layer = active + shared;
    let layer_bytes = expert_bytes * experts_per_layer;
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
                    let base = l * layer_bytes + e * expert_bytes;
                    ExpertCall {
                        weights: ExpertWeights {
                            gate: bench_view(formats[0], buf, base, inter, hidden, &scales),
                            up: bench_view(formats[1], buf, base + sizes[0], inter, hidden, &scales),
                            down: bench_view(formats[2], buf, base + sizes[0] + sizes[1], hidden, inter, &scales),
                        },
                        tokens: &tokens,
                        node: e % pool.nodes(),
                    }
                })
                .collect();
            moe_forward(pool, isa, &calls, &x, hidden, &mut out, &mut scratch);
        }
        let read = formats[0].read_bytes(inter, hidden) + formats[1].read_bytes(inter, hidden) + formats[2].read_bytes(hidden, inter);
        best = best.max((layers * experts_per_layer * read) as f64 / t0.elapsed().as_secs_f64());
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
    use duplex_kernels::pool::PoolConfig;
    use duplex_kernels::quant::dequantize_row;

    /// Every weight of `bytes` (whole `kind` blocks) as f32.
    fn decode(kind: QuantKind, bytes: &[u8]) -> Vec<f32> {
        let mut out = vec![0.0; bytes.len() / kind.block_bytes() * kind.block_elems()];
        dequantize_row(kind, bytes, &mut out).unwrap();
        out
    }

    #[test]
    fn random_blocks_hold_finite_varied_weights() {
        let pool = ThreadPool::new(&PoolConfig::single_node(2));
        for kind in [QuantKind::Q4_0, QuantKind::Q5_0, QuantKind::Q5_1, QuantKind::Q8_0, QuantKind::Q4K, QuantKind::Q5K, QuantKind::Q6K] {
            // Not a whole number of blocks: the buffer is cut to whole ones.
            let buf = random_blocks(&pool, kind, (1 << 20) + 5, 7);
            assert_eq!(buf.len() % kind.block_bytes(), 0, "{kind}");
            let w = decode(kind, &buf);
            assert!(w.iter().all(|v| v.is_finite() && v.abs() < 1e3), "{kind}: a weight out of range");
            let nonzero = w.iter().filter(|v| **v != 0.0).count();
            assert!(nonzero > w.len() / 2, "{kind}: {nonzero} of {} weights are nonzero", w.len());
        }
    }

    #[test]
    fn random_moe_layers_hold_valid_matrices_where_the_benchmark_reads_them() {
        let pool = ThreadPool::new(&PoolConfig::single_node(2));
        let (q4k, q6k) = (BenchFormat::Quant(QuantKind::Q4K), BenchFormat::Quant(QuantKind::Q6K));
        let formats = [q4k, q4k, q6k];
        let (hidden, inter) = (512, 256);
        let buf = random_moe_layers(&pool, formats, hidden, inter, 3 << 20, 9);
        let sizes = moe_matrix_bytes(formats, hidden, inter);
        let kinds = [QuantKind::Q4K, QuantKind::Q4K, QuantKind::Q6K];
        let experts = buf.len() / sizes.iter().sum::<usize>();
        assert!(experts >= 4);
        let mut at = 0;
        for _ in 0..experts {
            for (kind, size) in kinds.iter().zip(sizes) {
                assert!(decode(*kind, &buf[at..at + size]).iter().all(|v| v.is_finite() && v.abs() < 1e3), "{kind} at {at}");
                at += size;
            }
        }
        // And the benchmark runs over them (two experts a layer).
        assert!(format_moe_layer_bandwidth(&pool, Isa::Portable, formats, &buf, hidden, inter, 1, 1, 1) > 0.0);
    }

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
