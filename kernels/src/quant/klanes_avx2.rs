//! The prefill GEMM of the k-quants (Q4_K, Q5_K, Q6_K) on AVX2, for CPUs
//! without AVX-512 VNNI (Zen 2 and 3, Intel before Ice Lake): the AVX-512
//! GEMM's operands and arithmetic (`klanes_avx512`), eight tokens per
//! vector, a group's sixteen in two passes.
//!
//! AVX2 has no `vpdpbusd`: `vpmaddubsw` multiplies the biased activations
//! (y + 128, unsigned) by four weight bytes broadcast to every lane and
//! adds adjacent pairs into words, and `vpmaddwd` by ones adds the pairs
//! into each token's i32 lane. A pair is at most 2 × 255 × 63 = 32130, so
//! the words never saturate. The rest is `rows_k`'s: a sub-block's sums
//! weighed by `vpmulld`, the bias term taken off, the minimum term or
//! offset from the activation sums (`vpmaddwd`), and `fold_k`'s f32
//! operations per lane, so every token gets the one-token kernels' bits.

use super::klanes::{KLanes, KRows, LANES, QUADS};
use super::QK_K;
use std::arch::x86_64::*;

/// Tokens per vector.
const HALF: usize = LANES / 2;

/// Rows taken together by [`rows_k`]: each activation load serves all of
/// them; with their sub-block sums, block sums and f32 sums, four fill
/// the sixteen registers.
const ROWS: usize = 4;

/// Every unpacked row against the first `tokens` of a group (biased):
/// `out[r][t]` is row r's product with token t, with the one-token
/// kernels' bits.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn gemm_k(w: &KRows, y: &KLanes, tokens: usize, out: &mut [[f32; LANES]]) {
    assert_eq!(w.blocks, y.blocks, "gemm_k avx2: rows and tokens of one width");
    assert!(out.len() >= w.rows && tokens <= LANES, "gemm_k avx2: an output per row, a group of tokens");
    for half in 0..tokens.div_ceil(HALF) {
        let mut r = 0;
        while r + ROWS <= w.rows {
            if w.six {
                rows_k::<ROWS, true>(w, r, y, half, &mut out[r..r + ROWS]);
            } else {
                rows_k::<ROWS, false>(w, r, y, half, &mut out[r..r + ROWS]);
            }
            r += ROWS;
        }
        for r in r..w.rows {
            if w.six {
                rows_k::<1, true>(w, r, y, half, &mut out[r..r + 1]);
            } else {
                rows_k::<1, false>(w, r, y, half, &mut out[r..r + 1]);
            }
        }
    }
}

/// Rows `r0..r0 + R` against tokens `8 · half..8 · half + 8` of the group,
/// every block (`SIX`: Q6_K, sixteen sub-blocks of sixteen, an integer
/// offset term and no minimum term).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn rows_k<const R: usize, const SIX: bool>(w: &KRows, r0: usize, y: &KLanes, half: usize, out: &mut [[f32; LANES]]) {
    // Quads per sub-block.
    let per = if SIX { 4 } else { 8 };
    let ones = _mm256_set1_epi16(1);
    let lane0 = half * HALF;
    let mut acc = [_mm256_setzero_ps(); R];
    for b in 0..w.blocks {
        let at: [usize; R] = std::array::from_fn(|r| (r0 + r) * w.blocks + b);
        assert!(at[R - 1] < w.d.len() && b < y.blocks, "rows_k avx2: rows and block in range");
        let yq = y.q[b * QUADS * LANES..(b + 1) * QUADS * LANES].as_ptr();
        let wq: [*const u8; R] = at.map(|i| w.q[i * QK_K..(i + 1) * QK_K].as_ptr());
        let mut sumi = at.map(|i| _mm256_set1_epi32(-w.bias[i]));
        for s in 0..QUADS / per {
            let mut part = [_mm256_setzero_si256(); R];
            for k in 0..per {
                let quad = s * per + k;
                // SAFETY: quad < 64: eight readable words of the block's
                // quad from lane `lane0`, and 4 readable quant bytes of each
                // row's block (one unaligned word).
                let ys = unsafe { _mm256_loadu_si256(yq.add(quad * LANES + lane0).cast()) };
                for r in 0..R {
                    let x = unsafe { wq[r].add(4 * quad).cast::<i32>().read_unaligned() };
                    let pairs = _mm256_maddubs_epi16(ys, _mm256_set1_epi32(x));
                    part[r] = _mm256_add_epi32(part[r], _mm256_madd_epi16(pairs, ones));
                }
            }
            for r in 0..R {
                let scale = _mm256_set1_epi32(w.scales[at[r] * 16 + s]);
                sumi[r] = _mm256_add_epi32(sumi[r], _mm256_mullo_epi32(part[r], scale));
            }
        }
        // SAFETY (loads below): eight f32 / words of the block's scales and
        // sums from lane `lane0` (b < y.blocks); unaligned.
        let dy = unsafe { _mm256_loadu_ps(y.d.as_ptr().add(b * LANES + lane0)) };
        for r in 0..R {
            let dyd = _mm256_mul_ps(_mm256_set1_ps(w.d[at[r]]), dy);
            if SIX {
                // The offset joins the integer sum; `fold_k`'s `- 0 × 0`
                // leaves every f32 as it is.
                for h in 0..8 {
                    let sums = unsafe { _mm256_loadu_si256(y.sums16.as_ptr().add((b * 8 + h) * LANES + lane0).cast()) };
                    let pair = _mm256_set1_epi32(w.pairs[at[r] * 8 + h] as i32);
                    sumi[r] = _mm256_add_epi32(sumi[r], _mm256_madd_epi16(sums, pair));
                }
                acc[r] = _mm256_add_ps(acc[r], _mm256_mul_ps(dyd, _mm256_cvtepi32_ps(sumi[r])));
            } else {
                let mut summ = _mm256_setzero_si256();
                for h in 0..4 {
                    let sums = unsafe { _mm256_loadu_si256(y.sums32.as_ptr().add((b * 4 + h) * LANES + lane0).cast()) };
                    let pair = _mm256_set1_epi32(w.pairs[at[r] * 8 + h] as i32);
                    summ = _mm256_add_epi32(summ, _mm256_madd_epi16(sums, pair));
                }
                let dmin = _mm256_mul_ps(_mm256_set1_ps(w.dmin[at[r]]), dy);
                let plus = _mm256_add_ps(acc[r], _mm256_mul_ps(dyd, _mm256_cvtepi32_ps(sumi[r])));
                acc[r] = _mm256_sub_ps(plus, _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(summ)));
            }
        }
    }
    for (o, a) in out.iter_mut().zip(acc) {
        // SAFETY: eight writable f32 from lane `lane0`; unaligned store.
        unsafe { _mm256_storeu_ps(o[lane0..lane0 + HALF].as_mut_ptr(), a) };
    }
}
