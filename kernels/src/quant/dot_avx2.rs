//! AVX2 dot products: `vpmaddubsw` (unsigned weight quant × signed
//! activation, adjacent pairs summed to i16) then `vpmaddwd` by the
//! sub-block scale (pairs summed to i32). A k-quant block's eight i32
//! lanes are folded into the row's eight f32 lanes, a 32-element block's
//! sum into one f32, exactly as the scalar reference does (see the module
//! docs of `quant`).
//!
//! `vpmaddubsw` saturates its i16 pair sums, so every use is bounded below
//! 32767: k-quant quants are at most 63 and activations at most 127 in
//! magnitude (2 × 63 × 127 = 16002); for the signed Q8_0/Q4_0/Q5_0 weights the
//! weight's sign moves onto the activation (`vpsignb`), leaving |w| ≤ 128
//! against |y| ≤ 127 (2 × 128 × 127 = 32512), which is why activations may
//! never hold -128.

use super::blocks::{k_scales_mins, Block32, BlockQ8K, BlockQ8_0, BlockQ8_1, QuantKind, K_SCALES, Q4K_QS, Q5K_QH, Q5K_QS, Q6K_D, Q6K_QH, Q6K_SCALES};
use super::{fold_32, fold_q5_1};
use std::arch::x86_64::*;

/// 32 bytes from the front of `s` (bounds-checked).
#[inline]
#[target_feature(enable = "avx2,f16c")]
fn ld(s: &[u8]) -> __m256i {
    let s = &s[..32];
    // SAFETY: 32 readable bytes; unaligned load.
    unsafe { _mm256_loadu_si256(s.as_ptr().cast()) }
}

/// 32 activation quants from the front of `s`.
#[inline]
#[target_feature(enable = "avx2,f16c")]
fn ld_i8(s: &[i8]) -> __m256i {
    let s = &s[..32];
    // SAFETY: as in `ld`.
    unsafe { _mm256_loadu_si256(s.as_ptr().cast()) }
}

/// Sum of eight i32 lanes.
#[inline]
#[target_feature(enable = "avx2,f16c")]
fn hsum(v: __m256i) -> i32 {
    let s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v));
    let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b01_00_11_10>(s));
    let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b10_11_00_01>(s));
    _mm_cvtsi128_si32(s)
}

/// The f32 values of two consecutive half-precision numbers at `b[at..at + 4]`
/// (F16C; the conversion is exact, so this equals the scalar decode).
#[inline]
#[target_feature(enable = "avx2,f16c")]
pub(super) fn halves_at(b: &[u8], at: usize) -> (f32, f32) {
    let bits = u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]]);
    let v = _mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32));
    (_mm_cvtss_f32(v), _mm_cvtss_f32(_mm_shuffle_ps::<1>(v, v)))
}

/// The f32 value of a half-precision bit pattern (F16C).
#[inline]
#[target_feature(enable = "avx2,f16c")]
pub(super) fn half_bits(bits: u16) -> f32 {
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32)))
}

/// Per sub-block pair lanes of a Q4_K/Q5_K block's minimum term: lane j of
/// the result is `bsums[2j] × min[j] + bsums[2j+1] × min[j]`.
#[inline]
#[target_feature(enable = "avx2,f16c")]
pub(super) fn min_lanes(mins: [u8; 8], bsums: &[i16; 16]) -> __m256i {
    // Each min twice, as i16, against the 16 activation sums.
    let m = _mm_set_epi64x(0, i64::from_le_bytes(mins));
    let m = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(m, m));
    // SAFETY: `bsums` is 32 bytes; unaligned load.
    let s = unsafe { _mm256_loadu_si256(bsums.as_ptr().cast()) };
    _mm256_madd_epi16(s, m)
}

/// `fold_k` on eight lanes at once: the same f32 operations, lane by lane.
#[inline]
#[target_feature(enable = "avx2,f16c")]
pub(super) fn fold_lanes(acc: __m256, d: f32, sumi: __m256i, dmin: f32, summ: __m256i) -> __m256 {
    let plus = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi)));
    _mm256_sub_ps(plus, _mm256_mul_ps(_mm256_set1_ps(dmin), _mm256_cvtepi32_ps(summ)))
}

/// `reduce_k` of eight lanes: halves added, then halves again.
#[inline]
#[target_feature(enable = "avx2,f16c")]
pub(super) fn reduce_lanes(v: __m256) -> f32 {
    let b = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let c = _mm_add_ps(b, _mm_movehl_ps(b, b));
    _mm_cvtss_f32(_mm_add_ss(c, _mm_movehdup_ps(c)))
}

/// Q4_K (`FIVE = false`) or Q5_K row against Q8_K.
#[target_feature(enable = "avx2,f16c")]
pub(super) fn dot_q45k<const FIVE: bool>(row: &[u8], y: &[BlockQ8K]) -> f32 {
    let bb = if FIVE { QuantKind::Q5K } else { QuantKind::Q4K }.block_bytes();
    let qs_at = if FIVE { Q5K_QS } else { Q4K_QS };
    let m4 = _mm256_set1_epi8(15);
    let sixteen = _mm256_set1_epi8(16);
    let mut acc = _mm256_setzero_ps();
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
        let (d, dmin) = halves_at(b, 0);
        acc = fold_lanes(acc, d * yb.d, sum, dmin * yb.d, min_lanes(mn, &yb.bsums));
    }
    reduce_lanes(acc)
}

/// Q6_K row against Q8_K. The quants are taken unsigned (0..64) and the
/// `- 32` comes back as 32 × the sub-block's activation sum (`bsums`).
#[target_feature(enable = "avx2,f16c")]
pub(super) fn dot_q6k(row: &[u8], y: &[BlockQ8K]) -> f32 {
    let m4 = _mm256_set1_epi8(15);
    let m30 = _mm256_set1_epi8(0x30);
    let mut acc = _mm256_setzero_ps();
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
        // The offset 32 × Σ scale × bsum, taken off in the same lanes.
        // SAFETY: 16 scale bytes and the 32 bytes of `bsums`; unaligned loads.
        let (sc16, bsums) = unsafe {
            (
                _mm256_cvtepi8_epi16(_mm_loadu_si128(b[Q6K_SCALES..Q6K_SCALES + 16].as_ptr().cast())),
                _mm256_loadu_si256(yb.bsums.as_ptr().cast()),
            )
        };
        let sum = _mm256_sub_epi32(sum, _mm256_slli_epi32::<5>(_mm256_madd_epi16(sc16, bsums)));
        let d = half_bits(u16::from_le_bytes([b[Q6K_D], b[Q6K_D + 1]]));
        acc = fold_lanes(acc, d * yb.d, sum, 0.0, _mm256_setzero_si256());
    }
    reduce_lanes(acc)
}

/// Σ x·y over 32 signed weight bytes and 32 activations.
#[inline]
#[target_feature(enable = "avx2,f16c")]
fn dot_s8(x: __m256i, y: __m256i) -> __m256i {
    let p = _mm256_maddubs_epi16(_mm256_abs_epi8(x), _mm256_sign_epi8(y, x));
    _mm256_madd_epi16(p, _mm256_set1_epi16(1))
}

/// The `Q` number of Q5_1 (see [`quants32`]).
pub(super) const Q5_1: u8 = 51;

/// Where a `Q` block's `qh` (Q5_0, Q5_1; 0 for the others) and its
/// nibbles start.
pub(super) const fn qh_qs_at(q: u8) -> (usize, usize) {
    match q {
        5 => (2, 6),
        Q5_1 => (4, 8),
        _ => (0, 2),
    }
}

/// Block `b`'s 32 quants as signed bytes, for `Q` = 8 (Q8_0: as stored),
/// 4 (Q4_0: nibbles minus 8), 5 (Q5_0: nibbles plus `qh` bit as 16,
/// minus 16) or [`Q5_1`] (as Q5_0, after `m`, and not moved: 0..32).
#[inline]
#[target_feature(enable = "avx2,f16c")]
pub(super) fn quants32<const Q: u8>(b: &[u8]) -> __m256i {
    if Q == 8 {
        return ld(&b[2..]);
    }
    let (qh_at, at) = qh_qs_at(Q);
    let qs = &b[at..at + 16];
    // SAFETY: 16 readable bytes; unaligned load.
    let q = unsafe { _mm_loadu_si128(qs.as_ptr().cast()) };
    let m4 = _mm_set1_epi8(15);
    let lo = _mm_and_si128(q, m4);
    let hi = _mm_and_si128(_mm_srli_epi16::<4>(q), m4);
    let nibbles = _mm256_set_m128i(hi, lo);
    if Q == 4 {
        return _mm256_sub_epi8(nibbles, _mm256_set1_epi8(8));
    }
    // Byte j takes bit j of qh: copy qh byte j / 8 to byte j (the shuffle
    // works per 128-bit half, and each half holds all of qh), then test
    // bit j % 8.
    let qh = i32::from_le_bytes([b[qh_at], b[qh_at + 1], b[qh_at + 2], b[qh_at + 3]]);
    let spread = _mm256_shuffle_epi8(
        _mm256_set1_epi32(qh),
        _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3),
    );
    let bit = _mm256_set1_epi64x(0x8040_2010_0804_0201u64 as i64);
    let set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
    let q5 = _mm256_or_si256(nibbles, _mm256_and_si256(set, _mm256_set1_epi8(16)));
    if Q == Q5_1 {
        return q5;
    }
    _mm256_sub_epi8(q5, _mm256_set1_epi8(16))
}

/// The block size of a 32-element kind by its `Q` number.
pub(super) const fn bytes32(q: u8) -> usize {
    match q {
        4 => QuantKind::Q4_0.block_bytes(),
        5 => QuantKind::Q5_0.block_bytes(),
        Q5_1 => QuantKind::Q5_1.block_bytes(),
        _ => QuantKind::Q8_0.block_bytes(),
    }
}

/// A Q8_0, Q4_0 or Q5_0 row (`Q` as in [`quants32`]) against Q8_0, or a
/// Q5_1 row against Q8_1.
#[target_feature(enable = "avx2,f16c")]
fn dot_32<const Q: u8, Y: Block32>(row: &[u8], y: &[Y]) -> f32 {
    let bb = bytes32(Q);
    let mut acc = 0.0f32;
    // Four blocks at a time: sums reduced together and products formed in
    // one vector (the same f32 operations as `fold_32`, lane by lane), then
    // added to `acc` one by one in block order.
    let fours = y.len() / 4;
    for (b, yb) in row.chunks_exact(4 * bb).zip(y.chunks_exact(4)) {
        let mut v = [_mm256_setzero_si256(); 4];
        let (mut dx, mut dy, mut m, mut sy) = ([0u16; 8], [0u16; 8], [0u16; 8], [0f32; 8]);
        for i in 0..4 {
            let bi = &b[i * bb..];
            let x = quants32::<Q>(bi);
            v[i] = dot_s8(x, ld_i8(yb[i].qs()));
            dx[i] = u16::from_le_bytes([bi[0], bi[1]]);
            dy[i] = yb[i].d().to_bits();
            if Q == Q5_1 {
                (m[i], sy[i]) = (u16::from_le_bytes([bi[2], bi[3]]), yb[i].s());
            }
        }
        // [v0 v1 v2 v3] partial pairs in each half, then the halves added.
        let h = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
        let sums = _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256::<1>(h));
        // SAFETY: two 16-byte arrays; unaligned loads.
        let (dx, dy) = unsafe { (_mm_loadu_si128(dx.as_ptr().cast()), _mm_loadu_si128(dy.as_ptr().cast())) };
        let mut prod = _mm_mul_ps(_mm_cvtepi32_ps(sums), _mm_mul_ps(_mm_cvtph_ps(dx), _mm_cvtph_ps(dy)));
        if Q == Q5_1 {
            // SAFETY: as above.
            let (m, sy) = unsafe { (_mm_loadu_si128(m.as_ptr().cast()), _mm_loadu_ps(sy.as_ptr())) };
            prod = _mm_add_ps(prod, _mm_mul_ps(_mm_cvtph_ps(m), sy));
        }
        let mut t = [0f32; 4];
        // SAFETY: 4 writable f32; unaligned store.
        unsafe { _mm_storeu_ps(t.as_mut_ptr(), prod) };
        for p in t {
            acc += p;
        }
    }
    let (row, y) = (&row[fours * 4 * bb..], &y[fours * 4..]);
    for (b, yb) in row.chunks_exact(bb).zip(y) {
        let x = quants32::<Q>(b);
        let sumi = hsum(dot_s8(x, ld_i8(yb.qs())));
        let (dx, m) = halves_at(b, 0);
        let dy = half_bits(yb.d().to_bits());
        acc = if Q == Q5_1 { fold_q5_1(acc, dx, dy, sumi, m, yb.s()) } else { fold_32(acc, dx, dy, sumi) };
    }
    acc
}

/// Q8_0 row against Q8_0.
#[target_feature(enable = "avx2,f16c")]
pub(super) fn dot_q8_0(row: &[u8], y: &[BlockQ8_0]) -> f32 {
    dot_32::<8, _>(row, y)
}

/// Q4_0 row against Q8_0.
#[target_feature(enable = "avx2,f16c")]
pub(super) fn dot_q4_0(row: &[u8], y: &[BlockQ8_0]) -> f32 {
    dot_32::<4, _>(row, y)
}

/// Q5_0 row against Q8_0.
#[target_feature(enable = "avx2,f16c")]
pub(super) fn dot_q5_0(row: &[u8], y: &[BlockQ8_0]) -> f32 {
    dot_32::<5, _>(row, y)
}

/// Q5_1 row against Q8_1.
#[target_feature(enable = "avx2,f16c")]
pub(super) fn dot_q5_1(row: &[u8], y: &[BlockQ8_1]) -> f32 {
    dot_32::<Q5_1, _>(row, y)
}
