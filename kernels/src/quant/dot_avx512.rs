//! AVX-512 VNNI dot products: `vpdpbusd` multiplies 64 unsigned weight
//! quants by 64 signed activations and sums each four into an i32 lane, with
//! no intermediate saturation (unlike AVX2's `vpmaddubsw`). A k-quant
//! sub-block is 8 lanes (32 elements) or 4 lanes (Q6_K's 16), so its scale
//! is applied per lane with `vpmulld` against a scale vector permuted from
//! the block's scales, and the block's lanes are reduced once. Each block's
//! i32 sum is then folded exactly as the scalar reference does.
//!
//! Lane bounds: a `vpdpbusd` lane is at most 4 × 128 × 127 in magnitude,
//! times a scale of at most 128, far inside i32.

use super::blocks::{k_scales_mins, BlockQ8K, BlockQ8_0, QuantKind, K_SCALES, Q4K_QS, Q5K_QH, Q5K_QS, Q6K_D, Q6K_QH, Q6K_SCALES};
use super::dot_avx2::{bytes32, half_bits, halves_at, hsum2, min_lanes, quants32};
use super::{fold_32, fold_k};
use std::arch::x86_64::*;

/// 64 bytes from the front of `s`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,f16c")]
fn ld64(s: &[u8]) -> __m512i {
    let s = &s[..64];
    // SAFETY: 64 readable bytes; unaligned load.
    unsafe { _mm512_loadu_si512(s.as_ptr().cast()) }
}

/// 64 activation quants from the front of `s`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,f16c")]
fn ld64_i8(s: &[i8]) -> __m512i {
    let s = &s[..64];
    // SAFETY: as in `ld64`.
    unsafe { _mm512_loadu_si512(s.as_ptr().cast()) }
}

/// 32 bytes from the front of `s`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,f16c")]
fn ld32(s: &[u8]) -> __m256i {
    let s = &s[..32];
    // SAFETY: 32 readable bytes; unaligned load.
    unsafe { _mm256_loadu_si256(s.as_ptr().cast()) }
}

/// 32 activation quants from the front of `s`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,f16c")]
fn ld32_i8(s: &[i8]) -> __m256i {
    let s = &s[..32];
    // SAFETY: as in `ld32`.
    unsafe { _mm256_loadu_si256(s.as_ptr().cast()) }
}

/// A vector whose low eight i32 lanes are `a` and high eight `b`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,f16c")]
fn halves_i32(a: i32, b: i32) -> __m512i {
    _mm512_inserti64x4::<1>(_mm512_set1_epi32(a), _mm256_set1_epi32(b))
}

/// A vector whose low 32 bytes are `a` and high 32 bytes `b`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,f16c")]
fn halves_i8(a: u8, b: u8) -> __m512i {
    _mm512_inserti64x4::<1>(_mm512_set1_epi8(a as i8), _mm256_set1_epi8(b as i8))
}

/// Q4_K (`FIVE = false`) or Q5_K row against Q8_K: the multi-token
/// kernel for one token.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,f16c")]
pub(super) fn dot_q45k<const FIVE: bool>(row: &[u8], y: &[BlockQ8K]) -> f32 {
    dot_q45k_multi::<FIVE, 1>(row, [y])[0]
}

/// Q4_K (`FIVE = false`) or Q5_K row against `T` tokens of Q8_K at once:
/// each block's weights are unpacked (nibbles, `qh` bits, scales) once for
/// all of them, which is what a prefill saves; each token's integer sums
/// and f32 fold do not depend on `T`, so every result has the bits of the
/// one-token product.
///
/// One 64-byte load of qs (half h) holds chunks 2h and 2h + 1: its low
/// nibbles are sub-blocks 4h (bytes 0..32) and 4h + 2 (bytes 32..64), its
/// high nibbles 4h + 1 and 4h + 3. `idx_*` pick each one's scale per lane,
/// and (Q5_K) `bit_*` each one's qh bit per byte; activations 128h.. in
/// 16-byte quarters a0..a3, b0..b3 meet the low nibbles as [a0 a1 b0 b1],
/// the high ones as [a2 a3 b2 b3].
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,f16c")]
pub(super) fn dot_q45k_multi<const FIVE: bool, const T: usize>(row: &[u8], ys: [&[BlockQ8K]; T]) -> [f32; T] {
    let bb = if FIVE { QuantKind::Q5K } else { QuantKind::Q4K }.block_bytes();
    let qs_at = if FIVE { Q5K_QS } else { Q4K_QS };
    let m4 = _mm512_set1_epi8(15);
    let sixteen = _mm512_set1_epi8(16);
    let zero = _mm512_setzero_si512();
    let idx_lo = [halves_i32(0, 2), halves_i32(4, 6)];
    let idx_hi = [halves_i32(1, 3), halves_i32(5, 7)];
    let bit_lo = [halves_i8(1 << 0, 1 << 2), halves_i8(1 << 4, 1 << 6)];
    let bit_hi = [halves_i8(1 << 1, 1 << 3), halves_i8(1 << 5, 1 << 7)];
    let mut acc = [0.0f32; T];
    for (i, b) in row.chunks_exact(bb).enumerate() {
        let (sc, mn) = k_scales_mins(&b[K_SCALES..K_SCALES + 12]);
        let scv = _mm512_castsi256_si512(_mm256_cvtepu8_epi32(_mm_set_epi64x(0, i64::from_le_bytes(sc))));
        let qh = if FIVE { _mm512_broadcast_i64x4(ld32(&b[Q5K_QH..])) } else { zero };
        // The block's quants and scale lanes, for every token.
        let mut lo = [zero; 2];
        let mut hi = [zero; 2];
        let mut s_lo = [zero; 2];
        let mut s_hi = [zero; 2];
        for h in 0..2 {
            let q = ld64(&b[qs_at + 64 * h..]);
            lo[h] = _mm512_and_si512(q, m4);
            hi[h] = _mm512_and_si512(_mm512_srli_epi16::<4>(q), m4);
            if FIVE {
                lo[h] = _mm512_mask_add_epi8(lo[h], _mm512_test_epi8_mask(qh, bit_lo[h]), lo[h], sixteen);
                hi[h] = _mm512_mask_add_epi8(hi[h], _mm512_test_epi8_mask(qh, bit_hi[h]), hi[h], sixteen);
            }
            s_lo[h] = _mm512_permutexvar_epi32(idx_lo[h], scv);
            s_hi[h] = _mm512_permutexvar_epi32(idx_hi[h], scv);
        }
        let (d, dmin) = halves_at(b, 0);
        for (t, y) in ys.iter().enumerate() {
            let yb = &y[i];
            let mut sum = zero;
            for h in 0..2 {
                let a = ld64_i8(&yb.qs[128 * h..]);
                let c = ld64_i8(&yb.qs[128 * h + 64..]);
                let y_lo = _mm512_shuffle_i64x2::<0b01_00_01_00>(a, c);
                let y_hi = _mm512_shuffle_i64x2::<0b11_10_11_10>(a, c);
                sum = _mm512_add_epi32(sum, _mm512_mullo_epi32(_mm512_dpbusd_epi32(zero, lo[h], y_lo), s_lo[h]));
                sum = _mm512_add_epi32(sum, _mm512_mullo_epi32(_mm512_dpbusd_epi32(zero, hi[h], y_hi), s_hi[h]));
            }
            let sum = _mm256_add_epi32(_mm512_castsi512_si256(sum), _mm512_extracti64x4_epi64::<1>(sum));
            let (sumi, summ) = hsum2(sum, min_lanes(mn, &yb.bsums));
            acc[t] = fold_k(acc[t], d * yb.d, sumi, dmin * yb.d, summ);
        }
    }
    acc
}

/// Q6_K row against Q8_K; unsigned quants, the `- 32` taken back through
/// `bsums` as in the AVX2 kernel.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,f16c")]
pub(super) fn dot_q6k(row: &[u8], y: &[BlockQ8K]) -> f32 {
    let m4 = _mm512_set1_epi8(15);
    let m30 = _mm512_set1_epi8(0x30);
    let zero = _mm512_setzero_si512();
    // Per 16-bit lane shift counts that bring qh bits 2k, 2k+1 to bits 4, 5
    // for quarters k = 0 | 1 (left by 4 | 2) and k = 2 | 3 (right by 0 | 2).
    let left01 = _mm512_inserti64x4::<1>(_mm512_set1_epi16(4), _mm256_set1_epi16(2));
    let right23 = _mm512_inserti64x4::<1>(_mm512_set1_epi16(0), _mm256_set1_epi16(2));
    // Lane i of a 64-element product covers elements 4i..4i+4: sub-block i/4.
    let idx = |first: i32| {
        _mm512_add_epi32(_mm512_set1_epi32(first), _mm512_srli_epi32::<2>(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)))
    };
    let idx_q = [idx(0), idx(4), idx(8), idx(12)];
    let mut acc = 0.0f32;
    for (b, yb) in row.chunks_exact(QuantKind::Q6K.block_bytes()).zip(y) {
        // SAFETY: 16 readable bytes (the scales); unaligned load.
        let sc8 = unsafe { _mm_loadu_si128(b[Q6K_SCALES..Q6K_SCALES + 16].as_ptr().cast()) };
        let scales = _mm512_cvtepi8_epi32(sc8);
        // SAFETY: `bsums` is 16 i16, 32 bytes; unaligned load.
        let bsums = _mm512_cvtepi16_epi32(unsafe { _mm256_loadu_si256(yb.bsums.as_ptr().cast()) });
        // Start from -32 × Σ scale × bsum: the offset of the unsigned quants.
        let mut sum = _mm512_sub_epi32(zero, _mm512_slli_epi32::<5>(_mm512_mullo_epi32(scales, bsums)));
        for h in 0..2 {
            let ql = ld64(&b[64 * h..]);
            let qh = _mm512_broadcast_i64x4(ld32(&b[Q6K_QH + 32 * h..]));
            let q01 = _mm512_or_si512(_mm512_and_si512(ql, m4), _mm512_and_si512(_mm512_sllv_epi16(qh, left01), m30));
            let q23 = _mm512_or_si512(
                _mm512_and_si512(_mm512_srli_epi16::<4>(ql), m4),
                _mm512_and_si512(_mm512_srlv_epi16(qh, right23), m30),
            );
            let d01 = _mm512_dpbusd_epi32(zero, q01, ld64_i8(&yb.qs[128 * h..]));
            let d23 = _mm512_dpbusd_epi32(zero, q23, ld64_i8(&yb.qs[128 * h + 64..]));
            sum = _mm512_add_epi32(sum, _mm512_mullo_epi32(d01, _mm512_permutexvar_epi32(idx_q[2 * h], scales)));
            sum = _mm512_add_epi32(sum, _mm512_mullo_epi32(d23, _mm512_permutexvar_epi32(idx_q[2 * h + 1], scales)));
        }
        let sumi = _mm512_reduce_add_epi32(sum);
        let d = half_bits(u16::from_le_bytes([b[Q6K_D], b[Q6K_D + 1]]));
        acc = fold_k(acc, d * yb.d, sumi, 0.0, 0);
    }
    acc
}

/// Per-lane Σ x·y of 64 signed weight bytes and 64 activations: |x| as the
/// unsigned operand, x's sign moved onto y (y is never -128, so negating it
/// cannot overflow).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,f16c")]
fn dot_s8(x: __m512i, y: __m512i) -> __m512i {
    let zero = _mm512_setzero_si512();
    let neg = _mm512_movepi8_mask(x);
    let sy = _mm512_mask_sub_epi8(y, neg, zero, y);
    _mm512_dpbusd_epi32(zero, _mm512_abs_epi8(x), sy)
}

/// Sums of the low and the high eight i32 lanes.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,f16c")]
fn hsum_halves(v: __m512i) -> (i32, i32) {
    let lo = _mm512_castsi512_si256(v);
    let hi = _mm512_extracti64x4_epi64::<1>(v);
    // Add the two halves' 128-bit quarters side by side, then finish each.
    let a = _mm256_add_epi32(_mm256_permute2x128_si256::<0x20>(lo, hi), _mm256_permute2x128_si256::<0x31>(lo, hi));
    let a = _mm256_hadd_epi32(a, a);
    let a = _mm256_hadd_epi32(a, a);
    (_mm256_extract_epi32::<0>(a), _mm256_extract_epi32::<4>(a))
}

/// The block sums of four `dot_s8` results (two blocks each, eight lanes a
/// block), in block order.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,f16c")]
fn sums8(v: [__m512i; 4]) -> __m256i {
    // 128-bit quarter k of s01 holds four partials of block k (0..4); of
    // s45, of block 4 + k.
    let s01 = _mm512_add_epi32(
        _mm512_shuffle_i64x2::<0b10_00_10_00>(v[0], v[1]),
        _mm512_shuffle_i64x2::<0b11_01_11_01>(v[0], v[1]),
    );
    let s45 = _mm512_add_epi32(
        _mm512_shuffle_i64x2::<0b10_00_10_00>(v[2], v[3]),
        _mm512_shuffle_i64x2::<0b11_01_11_01>(v[2], v[3]),
    );
    // Per quarter: [a0 b0 a1 b1] + [a2 b2 a3 b3], then the pairs added, so
    // element 0 is block k's sum and element 1 block 4 + k's.
    let r = _mm512_add_epi32(_mm512_unpacklo_epi32(s01, s45), _mm512_unpackhi_epi32(s01, s45));
    let r = _mm512_add_epi32(r, _mm512_shuffle_epi32::<0b01_00_11_10>(r));
    let order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 0, 0, 0, 0, 0, 0, 0, 0);
    _mm512_castsi512_si256(_mm512_permutexvar_epi32(order, r))
}

/// Two activation blocks' quants in one vector.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,f16c")]
fn pair_i8(a: &[i8], b: &[i8]) -> __m512i {
    _mm512_inserti64x4::<1>(_mm512_castsi256_si512(ld32_i8(a)), ld32_i8(b))
}

/// A Q8_0, Q4_0 or Q5_0 row (`Q` as in `quants32`) against Q8_0, two
/// blocks per vector.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,f16c")]
fn dot_32<const Q: u8>(row: &[u8], y: &[BlockQ8_0]) -> f32 {
    let bb = bytes32(Q);
    let mut acc = 0.0f32;
    // Eight blocks at a time: their sums reduced together, their products
    // formed in one vector (the same f32 operations as `fold_32`, lane by
    // lane), then added to `acc` one by one in block order.
    let eights = y.len() / 8;
    for (b, yb) in row.chunks_exact(8 * bb).zip(y.chunks_exact(8)) {
        let mut v = [_mm512_setzero_si512(); 4];
        let (mut dx, mut dy) = ([0u16; 8], [0u16; 8]);
        for p in 0..4 {
            let (b0, b1) = (&b[2 * p * bb..], &b[(2 * p + 1) * bb..]);
            let x = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(quants32::<Q>(b0)), quants32::<Q>(b1));
            v[p] = dot_s8(x, pair_i8(&yb[2 * p].qs, &yb[2 * p + 1].qs));
            dx[2 * p] = u16::from_le_bytes([b0[0], b0[1]]);
            dx[2 * p + 1] = u16::from_le_bytes([b1[0], b1[1]]);
            dy[2 * p] = yb[2 * p].d.to_bits();
            dy[2 * p + 1] = yb[2 * p + 1].d.to_bits();
        }
        // SAFETY: two 16-byte arrays; unaligned loads.
        let (dx, dy) = unsafe { (_mm_loadu_si128(dx.as_ptr().cast()), _mm_loadu_si128(dy.as_ptr().cast())) };
        let scale = _mm256_mul_ps(_mm256_cvtph_ps(dx), _mm256_cvtph_ps(dy));
        let prod = _mm256_mul_ps(_mm256_cvtepi32_ps(sums8(v)), scale);
        let mut t = [0f32; 8];
        // SAFETY: 8 writable f32; unaligned store.
        unsafe { _mm256_storeu_ps(t.as_mut_ptr(), prod) };
        for p in t {
            acc += p;
        }
    }
    let (row, y) = (&row[eights * 8 * bb..], &y[eights * 8..]);
    let pairs = row.chunks_exact(2 * bb).zip(y.chunks_exact(2));
    for (b, yb) in pairs {
        let (b0, b1) = b.split_at(bb);
        let x = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(quants32::<Q>(b0)), quants32::<Q>(b1));
        let (s0, s1) = hsum_halves(dot_s8(x, pair_i8(&yb[0].qs, &yb[1].qs)));
        acc = fold_32(acc, halves_at(b0, 0).0, half_bits(yb[0].d.to_bits()), s0);
        acc = fold_32(acc, halves_at(b1, 0).0, half_bits(yb[1].d.to_bits()), s1);
    }
    // An odd last block: its high half is zero and contributes nothing.
    if y.len() % 2 == 1 {
        let (b, yb) = (&row[(y.len() - 1) * bb..], &y[y.len() - 1]);
        let x = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(quants32::<Q>(b)), _mm256_setzero_si256());
        let (s, _) = hsum_halves(dot_s8(x, pair_i8(&yb.qs, &[0; 32])));
        acc = fold_32(acc, halves_at(b, 0).0, half_bits(yb.d.to_bits()), s);
    }
    acc
}

/// Q8_0 row against Q8_0.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,f16c")]
pub(super) fn dot_q8_0(row: &[u8], y: &[BlockQ8_0]) -> f32 {
    dot_32::<8>(row, y)
}

/// Q4_0 row against Q8_0.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,f16c")]
pub(super) fn dot_q4_0(row: &[u8], y: &[BlockQ8_0]) -> f32 {
    dot_32::<4>(row, y)
}

/// Q5_0 row against Q8_0.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,f16c")]
pub(super) fn dot_q5_0(row: &[u8], y: &[BlockQ8_0]) -> f32 {
    dot_32::<5>(row, y)
}
