//! What the kernel benchmarks share.

// Each bench compiles this module on its own and uses only some of it.
#![allow(dead_code)]

#[cfg(target_arch = "x86_64")]
use duplex_kernels::cpu::amx::{HardwareTiles, TileConfig, Tiles};
use duplex_kernels::quant::QuantKind;
#[cfg(not(target_os = "linux"))]
use std::time::Instant;

/// Seconds this thread has been on a CPU: unlike wall time, not counting
/// slices in which other processes ran instead.
#[cfg(target_os = "linux")]
pub fn thread_seconds() -> f64 {
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
pub fn thread_seconds() -> f64 {
    use std::sync::OnceLock;
    static START: OnceLock<Instant> = OnceLock::new();
    START.get_or_init(Instant::now).elapsed().as_secs_f64()
}

/// xorshift64*: deterministic, dependency-free.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
}

/// GB/s for `bytes` moved by `f`, by this thread's CPU time.
pub fn rate(bytes: usize, f: impl FnOnce()) -> f64 {
    let t = thread_seconds();
    f();
    bytes as f64 / (thread_seconds() - t) / 1e9
}

/// The token counts of a `--tokens N,...` argument, or `default`.
pub fn token_counts(args: &[String], default: &[usize]) -> Vec<usize> {
    match args.iter().position(|a| a == "--tokens") {
        Some(i) => args
            .get(i + 1)
            .and_then(|list| list.split(',').map(|n| n.trim().parse::<usize>().ok().filter(|&n| n > 0)).collect::<Option<Vec<_>>>())
            .unwrap_or_else(|| panic!("--tokens takes a comma-separated list of token counts, each at least 1")),
        None => default.to_vec(),
    }
}

/// (median, best).
pub fn summary(mut v: Vec<f64>) -> (f64, f64) {
    v.sort_by(f64::total_cmp);
    (v[v.len() / 2], v[v.len() - 1])
}

/// `len` bytes of random blocks of `kind` with small positive f16 scales
/// (random quant and scale bytes, as the kernels do the same work whatever
/// they hold; the scales are kept finite so the sums stay numbers).
pub fn matrix_bytes(kind: QuantKind, len: usize, rng: &mut Rng) -> Vec<u8> {
    let mut v = vec![0u8; len];
    for chunk in v.chunks_mut(8) {
        let r = rng.next().to_le_bytes();
        chunk.copy_from_slice(&r[..chunk.len()]);
    }
    let scale = half::f16::from_f32(0.01).to_bits().to_le_bytes();
    for block in v.chunks_exact_mut(kind.block_bytes()) {
        for &a in kind.f16_offsets() {
            block[a..a + 2].copy_from_slice(&scale);
        }
    }
    v
}

/// A BF16 value in [−1, 1] (as f32): attention queries and cache entries.
pub fn bf16_unit(rng: &mut Rng) -> f32 {
    duplex_kernels::round_bf16((rng.next() % 2001) as f32 / 1000.0 - 1.0)
}

/// A tile unit's rate in G multiply-adds/s, the median of `passes`:
/// `step` runs four products of `macs` multiply-adds each, into
/// accumulators 0–3 from sources 4–7 (which hold `source`, 16 rows of 64
/// bytes), none waiting for another.
#[cfg(target_arch = "x86_64")]
pub fn tile_rate(tiles: &mut HardwareTiles, source: &[u8], macs: usize, passes: usize, step: impl Fn(&mut HardwareTiles)) -> f64 {
    let mut config = TileConfig::new();
    for r in 0..8 {
        config = config.with(r, 16, 64);
    }
    const STEPS: usize = 1 << 16;
    let mut rates = Vec::with_capacity(passes);
    for _ in 0..passes {
        tiles.configure(&config);
        tiles.load::<4>(source, 64);
        tiles.load::<5>(source, 64);
        tiles.load::<6>(source, 64);
        tiles.load::<7>(source, 64);
        let start = thread_seconds();
        for _ in 0..STEPS {
            step(tiles);
        }
        rates.push((STEPS * 4 * macs) as f64 / (thread_seconds() - start) / 1e9);
        tiles.release();
    }
    summary(rates).0
}

/// The tile unit's BF16 rate, G multiply-adds/s (median of `passes`):
/// four 16 × 16 accumulators, each `tdpbf16ps` 16 × 32 × 16
/// multiply-adds, none waiting for another; `None` without BF16 tiles.
#[cfg(target_arch = "x86_64")]
pub fn bf16_tile_peak(passes: usize) -> Option<f64> {
    let mut t = HardwareTiles::for_bf16()?;
    // Small normal BF16 values (2⁻⁷ in each half), so that no sum overflows.
    let source = [0x00u8, 0x3c].repeat(512);
    Some(tile_rate(&mut t, &source, 16 * 32 * 16, passes, |t| {
        t.dot_bf16::<0, 4, 6>();
        t.dot_bf16::<1, 4, 7>();
        t.dot_bf16::<2, 5, 6>();
        t.dot_bf16::<3, 5, 7>();
    }))
}

#[cfg(not(target_arch = "x86_64"))]
pub fn bf16_tile_peak(_: usize) -> Option<f64> {
    None
}
