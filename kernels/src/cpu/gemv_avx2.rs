//! AVX2 GEMV kernels (f32 FMA).
//!
//! FP8 → f32 goes through f16, for which E4M3 is a plain bit shift: shifted
//! left by 7 (sign kept at bit 15, bit 14 cleared) an E4M3 code *is* an f16
//! equal to the value × 2⁻⁸, subnormals included, because f16's exponent
//! bias (15) minus E4M3's (7) is exactly 8 and f16 has subnormals of its own.
//! F16C's `vcvtph2ps` then widens exactly. No fix-ups, no fallback: the only
//! code this misreads is NaN (as ±480). Without AVX-512 masked loads, partial
//! chunks are copied into a zeroed stack buffer.

// The kernels index several fixed-size register arrays ([row][token]) in
// lockstep; index loops say that more plainly than zipped iterators.
#![allow(clippy::needless_range_loop)]

use super::kernel::{bands, prefetch_ahead, token_groups, Bf16Rows, Job, RowKernel};
use super::gemv::bf16_to_f32;
use super::pack::Packed;
use std::arch::x86_64::*;
use std::array;
use std::ops::Range;

/// Undoes the 2⁻⁸ of the f16 reading.
const F16_UNBIAS: f32 = 256.0;

/// Load `len ≤ N` bytes from `p`, zero-padded to `N`.
///
/// # Safety
/// `p .. p + len` readable.
#[inline(always)]
unsafe fn padded<const N: usize>(p: *const u8, len: usize) -> [u8; N] {
    let mut buf = [0u8; N];
    // SAFETY: per the contract; `len ≤ N`.
    unsafe { std::ptr::copy_nonoverlapping(p, buf.as_mut_ptr(), len.min(N)) };
    buf
}

#[inline]
#[target_feature(enable = "avx2,fma")]
fn hsum(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)))
}

/// 16 FP8 codes to two vectors of 8 f32 (× 2⁻⁸), in column order.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn decode16(codes: __m128i) -> (__m256, __m256) {
    let h = _mm256_and_si256(
        _mm256_slli_epi16::<7>(_mm256_cvtepi8_epi16(codes)),
        _mm256_set1_epi16(0xbf80u16 as i16),
    );
    (_mm256_cvtph_ps(_mm256_castsi256_si128(h)), _mm256_cvtph_ps(_mm256_extracti128_si256::<1>(h)))
}

struct Fused<'a> {
    job: &'a Job<'a>,
    x: &'a Packed<f32>,
}

impl RowKernel for Fused<'_> {
    unsafe fn rows<const R: usize, const N: usize>(&self, rows: [usize; R], t0: usize) -> [[f32; N]; R] {
        // SAFETY: forwarded from the caller.
        unsafe { fused::<R, N>(self.job, self.x, rows, t0) }
    }
}

/// # Safety
/// AVX2/FMA/F16C present; `rows` and tokens `t0..t0 + N` in range.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn fused<const R: usize, const N: usize>(job: &Job, x: &Packed<f32>, rows: [usize; R], t0: usize) -> [[f32; N]; R] {
    // SAFETY: every row is < the matrix's rows, so its `cols` bytes are inside `data`.
    let row: [*const u8; R] = rows.map(|r| unsafe { job.data.as_ptr().add(r * job.cols) });
    let scales: [&[f32]; R] = rows.map(|r| job.scale_row(r));
    let mut total = [[_mm256_setzero_ps(); N]; R];
    for cb in 0..job.col_blocks {
        let (k0, width) = job.block_cols(cb);
        let mut acc = [[_mm256_setzero_ps(); N]; R];
        for q in 0..width.div_ceil(16) {
            let len = width - 16 * q;
            for r in 0..R {
                if q % 4 == 0 {
                    prefetch_ahead(row[r], k0 + 16 * q);
                }
                // SAFETY: columns k0 + 16q .. + min(len, 16) are inside the row.
                let codes = unsafe {
                    let p = row[r].add(k0 + 16 * q);
                    if len >= 16 {
                        _mm_loadu_si128(p.cast())
                    } else {
                        _mm_loadu_si128(padded::<16>(p, len).as_ptr().cast())
                    }
                };
                let (lo, hi) = decode16(codes);
                for t in 0..N {
                    let c = x.chunk(t0 + t, cb, q);
                    // SAFETY: the packed chunk holds 16 f32.
                    let (xl, xh) = unsafe { (_mm256_load_ps(c), _mm256_load_ps(c.add(8))) };
                    acc[r][t] = _mm256_fmadd_ps(hi, xh, _mm256_fmadd_ps(lo, xl, acc[r][t]));
                }
            }
        }
        for r in 0..R {
            let s = _mm256_set1_ps(scales[r][cb] * F16_UNBIAS);
            for t in 0..N {
                total[r][t] = _mm256_fmadd_ps(acc[r][t], s, total[r][t]);
            }
        }
    }
    array::from_fn(|r| array::from_fn(|t| hsum(total[r][t])))
}

struct Bf16Fma<'a> {
    job: &'a Job<'a>,
    w: Bf16Rows,
    x: &'a Packed<f32>,
}

impl RowKernel for Bf16Fma<'_> {
    unsafe fn rows<const R: usize, const N: usize>(&self, rows: [usize; R], t0: usize) -> [[f32; N]; R] {
        // SAFETY: forwarded from the caller.
        unsafe { bf16_weights::<R, N>(self.job, self.w, self.x, rows, t0) }
    }
}

/// BF16 weights: each 16-value chunk splits into its even columns (low
/// halves shifted up) and odd columns (high halves), matched by the packing.
///
/// # Safety
/// AVX2/FMA present; rows in the view, tokens in range.
#[target_feature(enable = "avx2,fma")]
unsafe fn bf16_weights<const R: usize, const N: usize>(
    job: &Job,
    w: Bf16Rows,
    x: &Packed<f32>,
    rows: [usize; R],
    t0: usize,
) -> [[f32; N]; R] {
    let high = _mm256_set1_epi32(0xffff_0000u32 as i32);
    // SAFETY: the rows are in the view.
    let row: [*const u8; R] = rows.map(|r| unsafe { w.row(r) });
    let scales: [&[f32]; R] = rows.map(|r| job.scale_row(r));
    let mut total = [[_mm256_setzero_ps(); N]; R];
    for cb in 0..job.col_blocks {
        let (k0, width) = job.block_cols(cb);
        let mut acc = [[_mm256_setzero_ps(); N]; R];
        for q in 0..width.div_ceil(16) {
            let len = width - 16 * q;
            for r in 0..R {
                if q % 2 == 0 {
                    prefetch_ahead(row[r], 2 * (k0 + 16 * q));
                }
                // SAFETY: values k0 + 16q .. + min(len, 16) are inside the row.
                let wv = unsafe {
                    let p = row[r].add(2 * (k0 + 16 * q));
                    if len >= 16 {
                        _mm256_loadu_si256(p.cast())
                    } else {
                        _mm256_loadu_si256(padded::<32>(p, 2 * len).as_ptr().cast())
                    }
                };
                let even = _mm256_castsi256_ps(_mm256_slli_epi32::<16>(wv));
                let odd = _mm256_castsi256_ps(_mm256_and_si256(wv, high));
                for t in 0..N {
                    let c = x.chunk(t0 + t, cb, q);
                    // SAFETY: the packed chunk holds 16 f32 (even, then odd columns).
                    let (xe, xo) = unsafe { (_mm256_load_ps(c), _mm256_load_ps(c.add(8))) };
                    acc[r][t] = _mm256_fmadd_ps(odd, xo, _mm256_fmadd_ps(even, xe, acc[r][t]));
                }
            }
        }
        for r in 0..R {
            let s = _mm256_set1_ps(scales[r][cb]);
            for t in 0..N {
                total[r][t] = _mm256_fmadd_ps(acc[r][t], s, total[r][t]);
            }
        }
    }
    array::from_fn(|r| array::from_fn(|t| hsum(total[r][t])))
}

/// `matmul_bf16` at the `Avx2` level. Token groups are at most 4: sixteen
/// ymm registers hold R·N accumulators plus the decoded weights. FP8
/// weights are decoded on the fly for any number of tokens, so that a
/// token's sums never depend on the batch (see `kernel::bands`); the decode
/// is three integer ops and two conversions per 16 codes.
///
/// # Safety
/// AVX2/FMA/F16C present; shapes checked by the caller.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn run(job: &Job, rows: Range<usize>, x: &[u16], n: usize, out: &mut [f32]) {
    let (m, first, b1) = (rows.len(), rows.start, job.block[1]);
    let passes = n.div_ceil(4);
    if job.fp8 {
        let x = Packed::new::<16, 1>(x, n, job.cols, b1, [0], bf16_to_f32);
        let k = Fused { job, x: &x };
        for band in bands(rows, passes) {
            // SAFETY: forwarded.
            unsafe { token_groups!(&k, band, first, n, out, m, 4, {1 => 4, 2 => 2, 3 => 1, 4 => 1}) };
        }
    } else {
        let x = Packed::new::<16, 2>(x, n, job.cols, b1, [0, 1], bf16_to_f32);
        let k = Bf16Fma { job, w: Bf16Rows::new(job), x: &x };
        for band in bands(rows, passes) {
            // SAFETY: forwarded.
            unsafe { token_groups!(&k, band, first, n, out, m, 4, {1 => 4, 2 => 2, 3 => 1, 4 => 1}) };
        }
    }
}
