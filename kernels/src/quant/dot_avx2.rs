//! AVX2 dot products: `vpmaddubsw` (unsigned weight quant × signed
//! activation, adjacent pairs summed to i16) then `vpmaddwd` by the
//! sub-block scale (pairs summed to i32). Each block's i32 sum is reduced
//! and folded exactly as the scalar reference does (see the module docs of
//! `quant`).
//!
//! `vpmaddubsw` saturates its i16 pair sums, so every use is bounded below
//! 32767: k-quant quants are at most 63 and activations at most 127 in
//! magnitude (2 × 63 × 127 = 16002); for the signed Q8_0/Q4_0 weights the
//! weight's sign moves onto the activation (`vpsignb`), leaving |w| ≤ 128
//! against |y| ≤ 127 (2 × 128 × 127 = 32512), which is why activations may
//! never hold -128.

use super::blocks::{half_at, k_scales_mins, BlockQ8K, BlockQ8_0, QuantKind, K_SCALES, Q4K_QS, Q5K_QH, Q5K_QS, Q6K_D, Q6K_QH, Q6K_SCALES};
use super::dot_scalar::k_min_term;
use super::{fold_32, fold_k};
use std::arch::x86_64::*;

/// 32 bytes from the front of `s` (bounds-checked).
#[inline]
#[target_feature(enable = "avx2")]
fn ld(s: &[u8]) -> __m256i {
    let s = &s[..32];
    // SAFETY: 32 readable bytes; unaligned load.
    unsafe { _mm256_loadu_si256(s.as_ptr().cast()) }
}

/// 32 activation quants from the front of `s`.
#[inline]
#[target_feature(enable = "avx2")]
fn ld_i8(s: &[i8]) -> __m256i {
    let s = &s[..32];
    // SAFETY: as in `ld`.
    unsafe { _mm256_loadu_si256(s.as_ptr().cast()) }
}

/// Sum of eight i32 lanes.
#[inline]
#[target_feature(enable = "avx2")]
fn hsum(v: __m256i) -> i32 {
    let s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v));
    let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b01_00_11_10>(s));
    let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b10_11_00_01>(s));
    _mm_cvtsi128_si32(s)
}

/// Q4_K (`FIVE = false`) or Q5_K row against Q8_K.
#[target_feature(enable = "avx2")]
pub(super) fn dot_q45k<const FIVE: bool>(row: &[u8], y: &[BlockQ8K]) -> f32 {
    let bb = if FIVE { QuantKind::Q5K } else { QuantKind::Q4K }.block_bytes();
    let qs_at = if FIVE { Q5K_QS } else { Q4K_QS };
    let m4 = _mm256_set1_epi8(15);
    let sixteen = _mm256_set1_epi8(16);
    let mut acc = 0.0f32;
    for (b, yb) in row.chunks_exact(bb).zip(y) {
        let (sc, mn) = k_scales_mins(&b[K_SCALES..K_SCALES + 12]);
        let qh = if FIVE { ld(&b[Q5K_QH..]) } else { _mm256_setzero_si256() };
        let mut sum = _mm256_setzero_si256();
        // Chunk c: 32 bytes whose low nibbles are sub-block 2c and high
        // nibbles sub-block 2c + 1.
        for c in 0..4 {
            let q = ld(&b[qs_at + 32 * c..]);
            let mut lo = _mm256_and_si256(q, m4);
            let mut hi = _mm256_and_si256(_mm256_srli_epi16::<4>(q), m4);
            if FIVE {
                // Sub-block s's fifth bit is bit s of each qh byte.
                let bit_lo = _mm256_set1_epi8((1u8 << (2 * c)) as i8);
                let bit_hi = _mm256_set1_epi8((1u8 << (2 * c + 1)) as i8);
                let set_lo = _mm256_cmpeq_epi8(_mm256_and_si256(qh, bit_lo), bit_lo);
                let set_hi = _mm256_cmpeq_epi8(_mm256_and_si256(qh, bit_hi), bit_hi);
                lo = _mm256_or_si256(lo, _mm256_and_si256(set_lo, sixteen));
                hi = _mm256_or_si256(hi, _mm256_and_si256(set_hi, sixteen));
            }
            let p0 = _mm256_maddubs_epi16(lo, ld_i8(&yb.qs[64 * c..]));
            let p1 = _mm256_maddubs_epi16(hi, ld_i8(&yb.qs[64 * c + 32..]));
            let p0 = _mm256_madd_epi16(p0, _mm256_set1_epi16(sc[2 * c] as i16));
            let p1 = _mm256_madd_epi16(p1, _mm256_set1_epi16(sc[2 * c + 1] as i16));
            sum = _mm256_add_epi32(sum, _mm256_add_epi32(p0, p1));
        }
        acc = fold_k(acc, half_at(b, 0) * yb.d, hsum(sum), half_at(b, 2) * yb.d, k_min_term(&mn, &yb.bsums));
    }
    acc
}

/// Q6_K row against Q8_K. The quants are taken unsigned (0..64) and the
/// `- 32` comes back as 32 × the sub-block's activation sum (`bsums`).
#[target_feature(enable = "avx2")]
pub(super) fn dot_q6k(row: &[u8], y: &[BlockQ8K]) -> f32 {
    let m4 = _mm256_set1_epi8(15);
    let m30 = _mm256_set1_epi8(0x30);
    let mut acc = 0.0f32;
    for (b, yb) in row.chunks_exact(QuantKind::Q6K.block_bytes()).zip(y) {
        let sc = |s: usize| (b[Q6K_SCALES + s] as i8) as i16;
        let mut sum = _mm256_setzero_si256();
        for h in 0..2 {
            let ql0 = ld(&b[64 * h..]);
            let ql1 = ld(&b[64 * h + 32..]);
            let qh = ld(&b[Q6K_QH + 32 * h..]);
            // Quarter k of the half: a nibble of ql0/ql1 plus qh bits 2k, 2k+1
            // moved to bits 4, 5. The 16-bit shifts carry bits across bytes,
            // but the 0x30 mask keeps only each byte's own.
            let q = [
                _mm256_or_si256(_mm256_and_si256(ql0, m4), _mm256_and_si256(_mm256_slli_epi16::<4>(qh), m30)),
                _mm256_or_si256(_mm256_and_si256(ql1, m4), _mm256_and_si256(_mm256_slli_epi16::<2>(qh), m30)),
                _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16::<4>(ql0), m4), _mm256_and_si256(qh, m30)),
                _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16::<4>(ql1), m4), _mm256_and_si256(_mm256_srli_epi16::<2>(qh), m30)),
            ];
            for (k, &qk) in q.iter().enumerate() {
                let p = _mm256_maddubs_epi16(qk, ld_i8(&yb.qs[128 * h + 32 * k..]));
                // The low 128 bits are sub-block s, the high ones s + 1.
                let s = 8 * h + 2 * k;
                let scv = _mm256_set_m128i(_mm_set1_epi16(sc(s + 1)), _mm_set1_epi16(sc(s)));
                sum = _mm256_add_epi32(sum, _mm256_madd_epi16(p, scv));
            }
        }
        let offset: i32 = (0..16).map(|s| sc(s) as i32 * yb.bsums[s] as i32).sum();
        acc = fold_k(acc, half_at(b, Q6K_D) * yb.d, hsum(sum) - 32 * offset, 0.0, 0);
    }
    acc
}

/// Σ x·y over 32 signed weight bytes and 32 activations.
#[inline]
#[target_feature(enable = "avx2")]
fn dot_s8(x: __m256i, y: __m256i) -> __m256i {
    let p = _mm256_maddubs_epi16(_mm256_abs_epi8(x), _mm256_sign_epi8(y, x));
    _mm256_madd_epi16(p, _mm256_set1_epi16(1))
}

/// Q8_0 row against Q8_0.
#[target_feature(enable = "avx2")]
pub(super) fn dot_q8_0(row: &[u8], y: &[BlockQ8_0]) -> f32 {
    let mut acc = 0.0f32;
    for (b, yb) in row.chunks_exact(QuantKind::Q8_0.block_bytes()).zip(y) {
        let s = dot_s8(ld(&b[2..]), ld_i8(&yb.qs));
        acc = fold_32(acc, half_at(b, 0), yb.d.to_f32(), hsum(s));
    }
    acc
}

/// Q4_0 row against Q8_0: nibbles minus 8 as signed bytes, then as Q8_0.
#[target_feature(enable = "avx2")]
pub(super) fn dot_q4_0(row: &[u8], y: &[BlockQ8_0]) -> f32 {
    let m4 = _mm_set1_epi8(15);
    let eight = _mm256_set1_epi8(8);
    let mut acc = 0.0f32;
    for (b, yb) in row.chunks_exact(QuantKind::Q4_0.block_bytes()).zip(y) {
        let qs = &b[2..18];
        // SAFETY: 16 readable bytes; unaligned load.
        let q = unsafe { _mm_loadu_si128(qs.as_ptr().cast()) };
        let lo = _mm_and_si128(q, m4);
        let hi = _mm_and_si128(_mm_srli_epi16::<4>(q), m4);
        let x = _mm256_sub_epi8(_mm256_set_m128i(hi, lo), eight);
        let s = dot_s8(x, ld_i8(&yb.qs));
        acc = fold_32(acc, half_at(b, 0), yb.d.to_f32(), hsum(s));
    }
    acc
}
