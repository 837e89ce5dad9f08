//! Single-thread FP8 GEMV bandwidth against a plain streaming read.
//!
//! `cargo bench -p duplex-kernels --bench gemv_bandwidth [-- [LEVEL...] [n1]]`
//! (`LEVEL`: only these ISA levels; `n1`: skip the batched shapes).
//!
//! Streams 40 different DeepSeek-V3-shaped FP8 matrices (~590 MB, far beyond
//! any L3) through `matmul_bf16` for one token and reports the weight bytes
//! per second next to `read_bytes` over the same buffer, for every ISA level
//! this CPU supports. Both are best-of-N wall-clock passes, interleaved so
//! that background load affects them alike. Extra lines show the batched
//! decode and prefill shapes (reported as weight bytes per second too, i.e.
//! how far they are from the bandwidth bound, not FLOPs).

use duplex_kernels::cpu::{isa, matmul_bf16, read_bytes, Isa};
use duplex_kernels::{WeightFormat, WeightView};
use std::hint::black_box;
#[cfg(not(target_os = "linux"))]
use std::time::Instant;

const MATRICES: usize = 40;
const PASSES: usize = 5;

/// xorshift64*: deterministic, dependency-free.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
}

/// A 64-byte aligned byte buffer (what a loader that repacks weights gives).
fn aligned_bytes(len: usize, rng: &mut Rng) -> (Vec<u8>, usize) {
    let mut v = vec![0u8; len + 64];
    let off = v.as_ptr().align_offset(64);
    for b in &mut v[off..off + len] {
        // Real FP8 weights: almost all codes normal, ~1e-4 zero/subnormal.
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

fn gbps(bytes: usize, secs: f64) -> f64 {
    bytes as f64 / secs / 1e9
}

/// Seconds this thread has been on a CPU. Colleagues' builds share the
/// machine; thread CPU time (unlike wall time) does not count the slices in
/// which this thread was descheduled.
#[cfg(target_os = "linux")]
fn thread_seconds() -> f64 {
    #[repr(C)]
    struct Timespec {
        sec: i64,
        nsec: i64,
    }
    extern "C" {
        fn clock_gettime(clock: i32, ts: *mut Timespec) -> i32;
    }
    const CLOCK_THREAD_CPUTIME_ID: i32 = 3;
    let mut ts = Timespec { sec: 0, nsec: 0 };
    // SAFETY: valid out-pointer; this clock always exists on Linux.
    unsafe { clock_gettime(CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    ts.sec as f64 + ts.nsec as f64 * 1e-9
}

#[cfg(not(target_os = "linux"))]
fn thread_seconds() -> f64 {
    use std::sync::OnceLock;
    static START: OnceLock<Instant> = OnceLock::new();
    START.get_or_init(Instant::now).elapsed().as_secs_f64()
}

/// Time `f` by thread CPU time.
fn timed(f: impl FnOnce()) -> f64 {
    let t = thread_seconds();
    f();
    thread_seconds() - t
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let only: Vec<Isa> = args.iter().filter_map(|a| a.parse().ok()).collect();
    let batched = !args.iter().any(|a| a == "n1");
    let shapes: Vec<(usize, usize)> = vec![(2048, 7168), (7168, 2048)];
    let mut rng = Rng(0x1234_5678_9abc_def1);
    println!("ISA levels on this CPU: {:?} (detect() = {})", isa::supported(), isa::detect());
    for (rows, cols) in shapes {
        let size = rows * cols;
        let (buf, off) = aligned_bytes(size * MATRICES, &mut rng);
        let all = &buf[off..off + size * MATRICES];
        let scales: Vec<f32> = (0..rows.div_ceil(128) * cols.div_ceil(128)).map(|i| 1e-3 * (1 + i % 7) as f32).collect();
        let view = |m: usize| WeightView {
            rows,
            cols,
            format: WeightFormat::Fp8E4m3 { block: [128, 128] },
            data: &all[m * size..(m + 1) * size],
            scales: &scales,
        };
        println!("\n{rows} x {cols} FP8 [128,128], {MATRICES} matrices = {:.0} MB, single thread", (size * MATRICES) as f64 / 1e6);
        for isa in isa::supported().into_iter().rev().filter(|i| only.is_empty() || only.contains(i)) {
            let passes = if isa == Isa::Portable { 1 } else { PASSES };
            let x: Vec<u16> = (0..cols).map(|i| half::bf16::from_f32((i % 17) as f32 * 0.1 - 0.8).to_bits()).collect();
            let mut out = vec![0f32; rows];
            let (mut best_read, mut best_gemv) = (0f64, 0f64);
            for _ in 0..passes {
                let secs = timed(|| {
                    black_box(read_bytes(isa, all));
                });
                best_read = best_read.max(gbps(all.len(), secs));
                let secs = timed(|| {
                    for m in 0..MATRICES {
                        matmul_bf16(isa, &view(m), 0..rows, &x, 1, &mut out);
                        black_box(&out);
                    }
                });
                best_gemv = best_gemv.max(gbps(all.len(), secs));
            }
            println!(
                "  {:<11} n=1: gemv {:6.2} GB/s   read_bytes {:6.2} GB/s   ratio {:5.1}%",
                isa.name(),
                best_gemv,
                best_read,
                100.0 * best_gemv / best_read
            );
            if isa == Isa::Portable || !batched {
                continue;
            }
            // Batched decode and prefill: weight bytes per second over fewer matrices.
            for n in [2usize, 4, 8, 16, 64] {
                let xs: Vec<u16> = (0..n).flat_map(|_| x.iter().copied()).collect();
                let mut out = vec![0f32; n * rows];
                let mats = (MATRICES * 4 / n).clamp(2, MATRICES);
                let mut best = 0f64;
                for _ in 0..2 {
                    let secs = timed(|| {
                        for m in 0..mats {
                            matmul_bf16(isa, &view(m), 0..rows, &xs, n, &mut out);
                            black_box(&out);
                        }
                    });
                    best = best.max(gbps(mats * size, secs));
                }
                println!("  {:<11} n={n:<2} {:6.2} GB/s of weights ({:6.1} GMAC/s)", "", best, best * n as f64);
            }
        }
    }
}
