//! The prefill GEMM of the 32-element formats (Q8_0, Q4_0, Q5_0) on AVX2,
//! eight tokens at once, one per i32 lane: `lanes_avx512`'s layout and
//! fold at half its width, so every token gets `gemv_32`'s bits.
//!
//! AVX2 has no `vpdpbusd`. `vpmaddubsw` multiplies unsigned by signed
//! bytes into pairs of i16, so a weight quad's magnitudes are broadcast
//! (unsigned; |-128| is 128) and its signs moved onto the tokens' quads
//! (`vpsignb`: y·sign(x), whose products with |x| are x·y). A pair is at
//! most 2 × 128 × 127 = 32512, inside i16; `vpmaddwd` by ones adds it into
//! the lane's i32. Q4_0's and Q5_0's magnitudes are at most 16, so their
//! pairs (at most 4064) are summed as i16 over a whole block, and widened
//! once.

use super::dot_avx2::{bytes32, halves_at, quants32};
use std::arch::x86_64::*;

/// Tokens per group: one per i32 lane of a 256-bit vector.
pub(super) const LANES: usize = 8;

/// The activations of [`gemm_32`]: eight tokens, unbiased (`vpsignb` and
/// `vpmaddubsw` take them signed).
pub(super) type Lanes32 = super::lanes_avx512::Lanes<LANES, 0>;

/// Rows of Q8_0, Q4_0 or Q5_0 weights (`Q` as in `quants32`), each
/// `y.blocks` blocks, against a group of tokens: `out[r][t]` is row r's
/// product with token t, with `gemv_32`'s bits.
#[target_feature(enable = "avx2,f16c")]
pub(super) fn gemm_32<const Q: u8>(matrix: &[u8], y: &Lanes32, out: &mut [[f32; LANES]]) {
    let bb = bytes32(Q);
    let row_bytes = y.blocks * bb;
    let ones = _mm256_set1_epi16(1);
    for (row, o) in matrix.chunks_exact(row_bytes).zip(out) {
        let mut acc = _mm256_setzero_ps();
        for ((b, yq), yd) in row.chunks_exact(bb).zip(y.q.chunks_exact(Lanes32::BLOCK_WORDS)).zip(y.d.chunks_exact(LANES)) {
            let x = quants32::<Q>(b);
            let (mut magnitudes, mut signs) = ([0i32; 8], [0i32; 8]);
            // SAFETY: eight writable i32 each, 32 bytes; unaligned stores.
            unsafe {
                _mm256_storeu_si256(magnitudes.as_mut_ptr().cast(), _mm256_abs_epi8(x));
                _mm256_storeu_si256(signs.as_mut_ptr().cast(), x);
            }
            let sum = if Q == 8 {
                let mut sum = _mm256_setzero_si256();
                for k in 0..8 {
                    sum = _mm256_add_epi32(sum, _mm256_madd_epi16(quad_pairs(yq, k, magnitudes[k], signs[k]), ones));
                }
                sum
            } else {
                // Each i16 sums eight pairs of at most 2 × 16 × 127: 32512 at most.
                let mut pairs = _mm256_setzero_si256();
                for k in 0..8 {
                    pairs = _mm256_add_epi16(pairs, quad_pairs(yq, k, magnitudes[k], signs[k]));
                }
                _mm256_madd_epi16(pairs, ones)
            };
            // SAFETY: eight readable f32; unaligned load.
            let dy = unsafe { _mm256_loadu_ps(yd.as_ptr()) };
            let dxdy = _mm256_mul_ps(_mm256_set1_ps(halves_at(b, 0).0), dy);
            acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_cvtepi32_ps(sum), dxdy));
        }
        // SAFETY: eight writable f32; unaligned store.
        unsafe { _mm256_storeu_ps(o.as_mut_ptr(), acc) };
    }
}

/// The products of weight quad k (its bytes' magnitudes and the bytes
/// whose signs they take) with the eight tokens' quad k: per token two
/// i16, each the sum of two products.
#[inline(always)]
fn quad_pairs(yq: &[u32], k: usize, magnitudes: i32, signs: i32) -> __m256i {
    // SAFETY: eight readable words of the block's activations; the
    // caller's features (AVX2).
    unsafe {
        let lanes = _mm256_loadu_si256(yq[LANES * k..LANES * (k + 1)].as_ptr().cast());
        _mm256_maddubs_epi16(_mm256_set1_epi32(magnitudes), _mm256_sign_epi8(lanes, _mm256_set1_epi32(signs)))
    }
}
