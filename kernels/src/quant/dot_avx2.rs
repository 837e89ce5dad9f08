//! AVX2 dot products: `vpmaddubsw` (unsigned weight quant × signed
//! activation, adjacent pairs summed to i16) then `vpmaddwd` by the
//! sub-block scale (pairs summed to i32). A block's i32 lanes are summed
//! and the sum folded into the row's f32 exactly as the scalar reference
//! does (see the module docs of `quant`).
//!
//! `vpmaddubsw` saturates its i16 pair sums, so every use is bounded below
//! 32767: k-quant quants are at most 63 and activations at most 127 in
//! magnitude (2 × 63 × 127 = 16002); for the signed Q8_0/Q4_0/Q5_0 weights the
//! weight's sign moves onto the activation (`vpsignb`), leaving |w| ≤ 128
//! against |y| ≤ 127 (2 × 128 × 127 = 32512), which is why activations may
//! never hold -128.

use super::blocks::{k_scales_mins, Block32, BlockQ8K, BlockQ8_0, BlockQ8_1, QuantKind, K_SCALES, Q4K_QS, Q5K_QH, Q5K_QS, Q6K_D, Q6K_QH, Q6K_SCALES};
use super::{fold_32, fold_k, fold_q5_1};
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
pub(super) fn hsum(v: __m256i) -> i32 {
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

/// A Q4_K/Q5_K block's minimum term in eight i32 lanes: lane j is
/// `bsums[2j] × min[j] + bsums[2j+1] × min[j]`.
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

/// The sums of the eight i32 lanes of `a` and of `b`, reduced together:
/// a k-quant block's integer sum and its minimum term (`fold_k`).
#[inline]
#[target_feature(enable = "avx2,f16c")]
pub(super) fn hsum_pair(a: __m256i, b: __m256i) -> (i32, i32) {
    // [a0+a1, a2+a3, b0+b1, b2+b3 | the same of lanes 4..8], then halves.
    let h = _mm256_hadd_epi32(a, b);
    let s = _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256::<1>(h));
    let s = _mm_hadd_epi32(s, s);
    (_mm_cvtsi128_si32(s), _mm_extract_epi32::<1>(s))
}

/// Four products' integer sums and minimum terms, eight i32 lanes each,
/// summed: `[Σ sums[0], .., Σ sums[3] | Σ mins[0], .., Σ mins[3]]`: a
/// transposition that adds as it goes, where four separate reductions
/// would each end in a lone lane.
#[inline]
#[target_feature(enable = "avx2,f16c")]
pub(super) fn reduce4(sums: [__m256i; 4], mins: [__m256i; 4]) -> __m256i {
    // [a0 + a2, b0 + b2, a1 + a3, b1 + b3] in each 128-bit lane.
    let pairs = |a: __m256i, b: __m256i| _mm256_add_epi32(_mm256_unpacklo_epi32(a, b), _mm256_unpackhi_epi32(a, b));
    // [Σa, Σb, Σc, Σd] of each 128-bit lane.
    let quads = |ab: __m256i, cd: __m256i| _mm256_add_epi32(_mm256_unpacklo_epi64(ab, cd), _mm256_unpackhi_epi64(ab, cd));
    let s = quads(pairs(sums[0], sums[1]), pairs(sums[2], sums[3]));
    let m = quads(pairs(mins[0], mins[1]), pairs(mins[2], mins[3]));
    _mm256_add_epi32(_mm256_permute2x128_si256::<0x20>(s, m), _mm256_permute2x128_si256::<0x31>(s, m))
}

/// `fold_k` of four products at once, lane by lane the same f32
/// operations: `acc + d · sumi - dmin · summ` with `reduce4`'s `sums`.
#[inline]
#[target_feature(enable = "avx2,f16c")]
pub(super) fn fold4(acc: __m128, d: __m128, dmin: __m128, sums: __m256i) -> __m128 {
    let f = _mm256_cvtepi32_ps(sums);
    let plus = _mm_add_ps(acc, _mm_mul_ps(d, _mm256_castps256_ps128(f)));
    _mm_sub_ps(plus, _mm_mul_ps(dmin, _mm256_extractf128_ps::<1>(f)))
}

/// A k-quant format's integer sums of one weight block with one token's
/// block, on one SIMD level, for [`gemv4`].
pub(super) trait KSums {
    /// The format.
    const KIND: QuantKind;
    /// Bytes per weight block.
    const BYTES: usize = Self::KIND.block_bytes();
    /// Σ scale × q·y (Q6_K: less its offset) and the minimum term (Q6_K:
    /// zero), eight i32 lanes each, and the block's `d` and `dmin`.
    ///
    /// # Safety
    /// The CPU has the implementation's features; `b` is one block.
    unsafe fn sums(&self, b: &[u8], yb: &BlockQ8K) -> (__m256i, __m256i, f32, f32);
}

/// Blocks of a row that [`gemv4`] takes before the next row's.
const RUN: usize = 16;

/// Rows of k-quant blocks against one token: `out[r]` gets row r's
/// product, four rows at a time through [`reduce4`] and [`fold4`], the
/// rest one at a time, with the scalar reference's bits either way.
///
/// # Safety
/// Inlined into a function with `K`'s features (AVX2 at least), on a CPU
/// that has them, so that `K::sums` and the reductions inline too.
#[inline(always)]
pub(super) unsafe fn gemv4<K: KSums>(k: &K, matrix: &[u8], y: &[BlockQ8K], out: &mut [f32]) {
    let bb = K::BYTES;
    let row_bytes = y.len() * bb;
    if row_bytes == 0 {
        out.fill(0.0);
        return;
    }
    let mut rows = matrix.chunks_exact(row_bytes);
    let mut fours = out.chunks_exact_mut(4);
    // A run's per-block results, rewritten run by run (set up once here, as
    // zeroing them per run would cost a memset per four rows). The blocks'
    // `d` and `dmin` are kept as their half-precision bits and converted
    // four rows at a time, one conversion where each block had its own
    // (`quant_dot`, one thread, in L3: Q4_K and Q6_K 3–5% faster).
    let mut halves = [[0u32; 4]; RUN];
    // SAFETY (intrinsics below): the caller's features, per the contract.
    let mut sums = [[unsafe { _mm256_setzero_si256() }; 4]; RUN];
    let mut mins = sums;
    for o in &mut fours {
        let mut four: [&[u8]; 4] = [&[]; 4];
        for r in &mut four {
            *r = rows.next().expect("a row per output");
        }
        let mut acc = unsafe { _mm_setzero_ps() };
        // A row's run of blocks at a time, then the next row's: the four
        // rows are read as they lie, in runs long enough for the hardware
        // prefetchers (block by block across the rows, they are not).
        for i0 in (0..y.len()).step_by(RUN) {
            let run = RUN.min(y.len() - i0);
            for r in 0..4 {
                for (j, (b, yb)) in four[r][i0 * bb..(i0 + run) * bb].chunks_exact(bb).zip(&y[i0..i0 + run]).enumerate() {
                    super::fetch_block_ahead::<{ super::GEMV_LEAD }>(b);
                    (sums[j][r], mins[j][r], _, _) = unsafe { k.sums(b, yb) };
                    halves[j][r] = scale_halves(K::KIND, b);
                }
            }
            for (j, yb) in y[i0..i0 + run].iter().enumerate() {
                // SAFETY: `halves[j]` is 16 readable bytes; unaligned load.
                unsafe {
                    // [d0, dmin0, d1, dmin1 | d2, dmin2, d3, dmin3].
                    let f = _mm256_cvtph_ps(_mm_loadu_si128(halves[j].as_ptr().cast()));
                    let (lo, hi) = (_mm256_castps256_ps128(f), _mm256_extractf128_ps::<1>(f));
                    let (d, dmin) = (_mm_shuffle_ps::<0b10_00_10_00>(lo, hi), _mm_shuffle_ps::<0b11_01_11_01>(lo, hi));
                    let dy = _mm_set1_ps(yb.d);
                    acc = fold4(acc, _mm_mul_ps(d, dy), _mm_mul_ps(dmin, dy), reduce4(sums[j], mins[j]));
                }
            }
        }
        // SAFETY: also four writable f32; unaligned store.
        unsafe { _mm_storeu_ps(o.as_mut_ptr(), acc) };
    }
    for (o, row) in fours.into_remainder().iter_mut().zip(rows) {
        // SAFETY: the same contract.
        *o = unsafe { dot_k(k, row, y) };
    }
}

/// A k-quant block's `d` (low half) and `dmin` (high half; Q6_K has none:
/// zero, whose value is 0.0) as half-precision bits.
#[inline(always)]
fn scale_halves(kind: QuantKind, b: &[u8]) -> u32 {
    match kind {
        QuantKind::Q6K => u32::from(u16::from_le_bytes([b[Q6K_D], b[Q6K_D + 1]])),
        _ => u32::from_le_bytes([b[0], b[1], b[2], b[3]]),
    }
}

/// The AVX2 kernels of Q4_K (`FIVE = false`) and Q5_K.
pub(super) struct Q45<const FIVE: bool>;

impl<const FIVE: bool> Q45<FIVE> {
    /// A block's sums, as [`KSums::sums`].
    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    fn block(b: &[u8], yb: &BlockQ8K) -> (__m256i, __m256i, f32, f32) {
        let qs_at = if FIVE { Q5K_QS } else { Q4K_QS };
        let m4 = _mm256_set1_epi8(15);
        let sixteen = _mm256_set1_epi8(16);
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
        (sum, min_lanes(mn, &yb.bsums), d, dmin)
    }
}

impl<const FIVE: bool> KSums for Q45<FIVE> {
    const KIND: QuantKind = if FIVE { QuantKind::Q5K } else { QuantKind::Q4K };
    #[inline]
    unsafe fn sums(&self, b: &[u8], yb: &BlockQ8K) -> (__m256i, __m256i, f32, f32) {
        // SAFETY: the caller's CPU has AVX2 and F16C.
        unsafe { Self::block(b, yb) }
    }
}

/// The AVX2 kernels of Q6_K. The quants are taken unsigned (0..64) and
/// the `- 32` comes back as 32 × the sub-block's activation sum (`bsums`).
pub(super) struct Q6;

impl Q6 {
    /// A block's sums, as [`KSums::sums`].
    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    fn block(b: &[u8], yb: &BlockQ8K) -> (__m256i, __m256i, f32, f32) {
        let m4 = _mm256_set1_epi8(15);
        let m30 = _mm256_set1_epi8(0x30);
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
        // The offset 32 × Σ scale × bsum, taken off lane by lane.
        // SAFETY: 16 scale bytes and the 32 bytes of `bsums`; unaligned loads.
        let (sc16, bsums) = unsafe {
            (
                _mm256_cvtepi8_epi16(_mm_loadu_si128(b[Q6K_SCALES..Q6K_SCALES + 16].as_ptr().cast())),
                _mm256_loadu_si256(yb.bsums.as_ptr().cast()),
            )
        };
        let sum = _mm256_sub_epi32(sum, _mm256_slli_epi32::<5>(_mm256_madd_epi16(sc16, bsums)));
        (sum, _mm256_setzero_si256(), half_bits(u16::from_le_bytes([b[Q6K_D], b[Q6K_D + 1]])), 0.0)
    }
}

impl KSums for Q6 {
    const KIND: QuantKind = QuantKind::Q6K;
    #[inline]
    unsafe fn sums(&self, b: &[u8], yb: &BlockQ8K) -> (__m256i, __m256i, f32, f32) {
        // SAFETY: the caller's CPU has AVX2 and F16C.
        unsafe { Self::block(b, yb) }
    }
}

/// A row of `K`'s blocks against Q8_K, one block at a time.
///
/// # Safety
/// As [`gemv4`]'s: inlined into a function with `K`'s features.
#[inline(always)]
unsafe fn dot_k<K: KSums>(k: &K, row: &[u8], y: &[BlockQ8K]) -> f32 {
    let mut acc = 0.0f32;
    for (b, yb) in row.chunks_exact(K::BYTES).zip(y) {
        // SAFETY: the caller's features, per the contract.
        let (sumi, summ, d, dmin) = unsafe { k.sums(b, yb) };
        let (sumi, summ) = unsafe { hsum_pair(sumi, summ) };
        acc = fold_k(acc, d * yb.d, sumi, dmin * yb.d, summ);
    }
    acc
}

/// Q4_K (`FIVE = false`) or Q5_K row against Q8_K.
#[target_feature(enable = "avx2,f16c")]
pub(super) fn dot_q45k<const FIVE: bool>(row: &[u8], y: &[BlockQ8K]) -> f32 {
    // SAFETY: inlined here, with AVX2 and F16C.
    unsafe { dot_k(&Q45::<FIVE>, row, y) }
}

/// Q6_K row against Q8_K.
#[target_feature(enable = "avx2,f16c")]
pub(super) fn dot_q6k(row: &[u8], y: &[BlockQ8K]) -> f32 {
    // SAFETY: as in `dot_q45k`.
    unsafe { dot_k(&Q6, row, y) }
}

/// Rows of Q4_K (`FIVE = false`) or Q5_K weights against one token: `out[r]`
/// is row r's [`dot_q45k`].
#[target_feature(enable = "avx2,f16c")]
pub(super) fn gemv_q45k<const FIVE: bool>(matrix: &[u8], y: &[BlockQ8K], out: &mut [f32]) {
    // SAFETY: inlined here, with AVX2 and F16C.
    unsafe { gemv4(&Q45::<FIVE>, matrix, y, out) }
}

/// Rows of Q6_K weights against one token, as [`gemv_q45k`].
#[target_feature(enable = "avx2,f16c")]
pub(super) fn gemv_q6k(matrix: &[u8], y: &[BlockQ8K], out: &mut [f32]) {
    // SAFETY: as in `gemv_q45k`.
    unsafe { gemv4(&Q6, matrix, y, out) }
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
