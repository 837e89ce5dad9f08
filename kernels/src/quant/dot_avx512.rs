//! AVX-512 VNNI dot products: `vpdpbusd` multiplies 64 unsigned weight
//! quants by 64 signed activations and sums each four into an i32 lane, with
//! no intermediate saturation (unlike AVX2's `vpmaddubsw`). A k-quant
//! sub-block is 8 lanes (32 elements) or 4 lanes (Q6_K's 16), so its scale
//! is applied per lane: each lane's sum fits an i16, so two chunks' lanes
//! share the words of one `vpmaddwd` against their scales (`scale_pairs`;
//! three multiplying instructions per 128 products, where `vpmaddubsw` +
//! `vpdpwssd` took four, for the same integers). A block's
//! sixteen i32 lanes are summed and the sum folded into the row's f32
//! exactly as the scalar reference folds it (`fold_k`). The k-quant kernels take several tokens at once, each
//! block unpacked once for all of them (prefill); one token is the same
//! kernel, and a band of rows for one token runs in one call (decode).
//!
//! Lane bounds: a `vpdpbusd` lane is at most 4 × 255 × 127 in magnitude
//! (Q8_0's quants moved up by 128 in `gemv_32`); a k-quant one, 4 × 63 ×
//! 127 (Q6_K's largest quant; Q8_K, like ggml's, holds −127..127), which
//! fits the i16 word `scale_pairs` gives it; a scaled sum of eight
//! sub-blocks, scales of at most 128: far inside i32.

use super::blocks::{k_scales_mins, Block32, BlockQ8K, BlockQ8_0, BlockQ8_1, QuantKind, K_SCALES, Q4K_QS, Q5K_QH, Q5K_QS, Q6K_D, Q6K_QH, Q6K_SCALES};
pub(super) use super::dot_avx2::Q5_1;
use super::dot_avx2::{bytes32, fold4, gemv4, half_bits, halves_at, hsum_pair, qh_qs_at, reduce4, KSums};
use super::{fold_32, fold_k, fold_q5_1};
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

/// A vector whose low 32 bytes are `a` and high 32 bytes `b`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,f16c")]
fn halves_i8(a: u8, b: u8) -> __m512i {
    _mm512_inserti64x4::<1>(_mm512_set1_epi8(a as i8), _mm256_set1_epi8(b as i8))
}

/// The sum of a product's two 256-bit halves: its sixteen i32 lanes
/// folded to eight, the first step of summing them.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,f16c")]
fn fold_halves(v: __m512i) -> __m256i {
    _mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64::<1>(v))
}

/// A `vpshufb` control that turns a vector holding the eight scale bytes in
/// every 128-bit lane into the words of [`scale_pairs`]: in 128-bit lanes
/// 0 and 1, words 0..4 hold byte `a` and words 4..8 byte `b`; in lanes 2
/// and 3, bytes `c` and `d`; each zero-extended.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,f16c")]
fn pick_pair(a: u8, b: u8, c: u8, d: u8) -> __m512i {
    // A control byte with its top bit set makes `vpshufb` write zero.
    let words = |byte: u8| i64::from_le_bytes([byte, 0x80, byte, 0x80, byte, 0x80, byte, 0x80]);
    _mm512_set_epi64(words(d), words(c), words(d), words(c), words(b), words(a), words(b), words(a))
}

/// A block's four chunks of `vpdpbusd` group sums (i32 lane l: elements
/// 4l..4l + 4 of the chunk) weighed by their sub-blocks' scales and added,
/// as sixteen i32 lanes whose total is the block's. Chunks 2p and 2p + 1
/// share a `vpmaddwd`: `vpackssdw` puts each 128-bit lane's four sums of
/// the first in words 0..4 and of the second in words 4..8 (a group sum
/// fits an i16, at most 4 × 63 × 127 in magnitude, so nothing saturates),
/// against the scale words of `scales[p]`; a weighed pair fits an i32.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,f16c")]
fn scale_pairs(groups: [__m512i; 4], scales: [__m512i; 2]) -> __m512i {
    let pair = |a: __m512i, b: __m512i, s: __m512i| _mm512_madd_epi16(_mm512_packs_epi32(a, b), s);
    _mm512_add_epi32(pair(groups[0], groups[1], scales[0]), pair(groups[2], groups[3], scales[1]))
}

/// Q4_K (`FIVE = false`) or Q5_K row against Q8_K: the multi-token
/// kernel for one token.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,f16c")]
pub(super) fn dot_q45k<const FIVE: bool>(row: &[u8], y: &[BlockQ8K]) -> f32 {
    dot_q45k_multi::<FIVE, 1>(row, [y])[0]
}

/// A k-quant block unpacked for its products with tokens: what every
/// token's integer sums need (`sums`), and its scales.
pub(super) struct KBlock {
    /// The quants, chunk by chunk (64 elements each, in element order).
    pub(super) q: [__m512i; 4],
    /// The scale words of chunks 0, 1 and 2, 3 (see [`scale_pairs`]).
    s: [__m512i; 2],
    /// Q4_K/Q5_K: the i16 multipliers of the 16 `bsums` in the minimum
    /// term (min k / 2 in word k); Q6_K: the sixteen scales as i16, for
    /// the offset.
    by_sums: __m256i,
    pub(super) d: f32,
    /// Zero for Q6_K.
    pub(super) dmin: f32,
    six: bool,
}

impl KBlock {
    /// The block's integer sums with token block `yb`, each in eight i32
    /// lanes: Σ scale × q·y (Q6_K: less its offset) and the minimum term
    /// (Q6_K: zero).
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,f16c")]
    pub(super) fn sums(&self, yb: &BlockQ8K) -> (__m256i, __m256i) {
        let zero = _mm512_setzero_si512();
        let groups: [__m512i; 4] = std::array::from_fn(|c| _mm512_dpbusd_epi32(zero, self.q[c], ld64_i8(&yb.qs[64 * c..])));
        let sum = fold_halves(scale_pairs(groups, self.s));
        // SAFETY: `bsums` is 16 i16, 32 bytes; unaligned load.
        let bsums = unsafe { _mm256_loadu_si256(yb.bsums.as_ptr().cast()) };
        let by_sums = _mm256_madd_epi16(bsums, self.by_sums);
        if self.six {
            // Less 32 × Σ scale × bsum.
            (_mm256_sub_epi32(sum, _mm256_slli_epi32::<5>(by_sums)), _mm256_setzero_si256())
        } else {
            (sum, by_sums)
        }
    }
}

/// A k-quant format's unpacking of a weight block, shared by the one-token
/// kernels (through [`KSums`]), the grouped ones and the prefill GEMM's
/// unpacking of its rows (`klanes_avx512`).
pub(super) trait Unpack {
    /// The format.
    const KIND: QuantKind;
    /// # Safety
    /// The CPU has the kernels' features; `b` is one block.
    unsafe fn unpack(&self, b: &[u8]) -> KBlock;
}

impl<U: Unpack> KSums for U {
    const KIND: QuantKind = U::KIND;
    #[inline]
    unsafe fn sums(&self, b: &[u8], yb: &BlockQ8K) -> (__m256i, __m256i, f32, f32) {
        // SAFETY: the caller's CPU has the kernels' features.
        let blk = unsafe { self.unpack(b) };
        let (sumi, summ) = unsafe { blk.sums(yb) };
        (sumi, summ, blk.d, blk.dmin)
    }
}

/// Fold block `i` of a row (`blk`) into `acc`, its products with `T`
/// tokens: four at a time through `reduce4`, the rest one at a time.
/// The same f32 operations either way, so grouping does not change bits.
///
/// # Safety
/// Inlined (always: out of line, the block's vectors went through memory,
/// 25 against 67 G/s) into a function with the kernels' features, on a
/// CPU that has them.
#[inline(always)]
unsafe fn fold_tokens<const T: usize>(acc: &mut [f32; T], blk: &KBlock, ys: &[&[BlockQ8K]; T], i: usize) {
    let mut t = 0;
    while t + 4 <= T {
        let mut sums = [_mm256_setzero_si256(); 4];
        let mut mins = [_mm256_setzero_si256(); 4];
        for j in 0..4 {
            (sums[j], mins[j]) = blk.sums(&ys[t + j][i]);
        }
        let dy = _mm_setr_ps(ys[t][i].d, ys[t + 1][i].d, ys[t + 2][i].d, ys[t + 3][i].d);
        // SAFETY: acc[t..t + 4] is in bounds (t + 4 <= T); unaligned load
        // and store.
        let a = unsafe { _mm_loadu_ps(acc[t..t + 4].as_ptr()) };
        let a = fold4(a, _mm_mul_ps(_mm_set1_ps(blk.d), dy), _mm_mul_ps(_mm_set1_ps(blk.dmin), dy), reduce4(sums, mins));
        unsafe { _mm_storeu_ps(acc[t..t + 4].as_mut_ptr(), a) };
        t += 4;
    }
    for t in t..T {
        let yb = &ys[t][i];
        let (sumi, summ) = blk.sums(yb);
        let (sumi, summ) = hsum_pair(sumi, summ);
        acc[t] = fold_k(acc[t], blk.d * yb.d, sumi, blk.dmin * yb.d, summ);
    }
}

/// The unpacking constants of the Q4_K (`FIVE = false`) and Q5_K kernels.
pub(super) struct Q45Unpack<const FIVE: bool> {
    m4: __m512i,
    sixteen: __m512i,
    nibble_shift: __m512i,
    pick_scales: [__m512i; 2],
    pick_mins: __m256i,
    fifth_bit: [__m512i; 4],
}

impl<const FIVE: bool> Q45Unpack<FIVE> {
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,f16c")]
    pub(super) fn new() -> Self {
        Q45Unpack {
            m4: _mm512_set1_epi8(15),
            sixteen: _mm512_set1_epi8(16),
            nibble_shift: _mm512_inserti64x4::<1>(_mm512_set1_epi16(0), _mm256_set1_epi16(4)),
            // Scale words of chunks 2p and 2p + 1 (see `scale_pairs`).
            pick_scales: [pick_pair(0, 2, 1, 3), pick_pair(4, 6, 5, 7)],
            // i16 lane k of the minimum term's multiplier: min k / 2, against bsums[k].
            pick_mins: _mm256_setr_epi16(
                -0x8000, -0x8000, 0x8001u16 as i16, 0x8001u16 as i16, 0x8002u16 as i16, 0x8002u16 as i16, 0x8003u16 as i16, 0x8003u16 as i16,
                0x8004u16 as i16, 0x8004u16 as i16, 0x8005u16 as i16, 0x8005u16 as i16, 0x8006u16 as i16, 0x8006u16 as i16, 0x8007u16 as i16, 0x8007u16 as i16,
            ),
            // Sub-block s's fifth bit is bit s of each qh byte.
            fifth_bit: [halves_i8(1 << 0, 1 << 1), halves_i8(1 << 2, 1 << 3), halves_i8(1 << 4, 1 << 5), halves_i8(1 << 6, 1 << 7)],
        }
    }

    /// Block `b` unpacked. Chunk c (32 bytes of qs) holds sub-block 2c in
    /// its low nibbles and 2c + 1 in its high ones: broadcast to both
    /// halves of a vector and shifted by 0 and 4 per half, it is elements
    /// 64c..64c + 64 in order, to meet one plain 64-byte load of
    /// activations. `vpdpbusd` sums each four products into an i32 lane:
    /// lane l holds elements 4l..4l + 4 of sub-block 2c, lane l + 8 those
    /// of sub-block 2c + 1; [`scale_pairs`] weighs them by their
    /// sub-blocks' scales, two chunks per `vpmaddwd`.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,f16c")]
    fn block(&self, b: &[u8]) -> KBlock {
        let qs_at = if FIVE { Q5K_QS } else { Q4K_QS };
        let (sc, mn) = k_scales_mins(&b[K_SCALES..K_SCALES + 12]);
        let scales = _mm512_set1_epi64(i64::from_le_bytes(sc));
        let qh = if FIVE { _mm512_broadcast_i64x4(ld32(&b[Q5K_QH..])) } else { _mm512_setzero_si512() };
        let q = std::array::from_fn(|c| {
            let chunk = _mm512_broadcast_i64x4(ld32(&b[qs_at + 32 * c..]));
            let q = _mm512_and_si512(_mm512_srlv_epi16(chunk, self.nibble_shift), self.m4);
            if FIVE {
                _mm512_mask_add_epi8(q, _mm512_test_epi8_mask(qh, self.fifth_bit[c]), q, self.sixteen)
            } else {
                q
            }
        });
        let (d, dmin) = halves_at(b, 0);
        KBlock {
            q,
            s: self.pick_scales.map(|pick| _mm512_shuffle_epi8(scales, pick)),
            by_sums: _mm256_shuffle_epi8(_mm256_set1_epi64x(i64::from_le_bytes(mn)), self.pick_mins),
            d,
            dmin,
            six: false,
        }
    }
}

impl<const FIVE: bool> Unpack for Q45Unpack<FIVE> {
    const KIND: QuantKind = if FIVE { QuantKind::Q5K } else { QuantKind::Q4K };
    #[inline]
    unsafe fn unpack(&self, b: &[u8]) -> KBlock {
        // SAFETY: the caller's CPU has the kernels' features.
        unsafe { self.block(b) }
    }
}

/// A row of `U`'s blocks against `T` tokens of Q8_K at once: each block's
/// weights are unpacked (nibbles, high bits, scales) once for all of them,
/// which is what a prefill saves; each token's integer sums and f32 fold
/// do not depend on `T`, so every result has the bits of the one-token
/// product.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,f16c")]
fn dot_k_multi<U: Unpack, const T: usize>(unpack: &U, row: &[u8], ys: [&[BlockQ8K]; T]) -> [f32; T] {
    let mut acc = [0.0f32; T];
    for (i, b) in row.chunks_exact(U::KIND.block_bytes()).enumerate() {
        // SAFETY: inlined here, with the kernels' features.
        unsafe { fold_tokens(&mut acc, &unpack.unpack(b), &ys, i) };
    }
    acc
}

/// Q4_K (`FIVE = false`) or Q5_K row against `T` tokens of Q8_K at once
/// ([`dot_k_multi`]).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,f16c")]
pub(super) fn dot_q45k_multi<const FIVE: bool, const T: usize>(row: &[u8], ys: [&[BlockQ8K]; T]) -> [f32; T] {
    dot_k_multi(&Q45Unpack::<FIVE>::new(), row, ys)
}

/// Rows of Q4_K (`FIVE = false`) or Q5_K weights, `y.len()` blocks each,
/// against one token: `out[r]` is row r's `dot_q45k`, the row loop inside
/// the kernel's features so that its constants are set up once a band.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,f16c")]
pub(super) fn gemv_q45k<const FIVE: bool>(matrix: &[u8], y: &[BlockQ8K], out: &mut [f32]) {
    // SAFETY: inlined here, with the kernels' features.
    unsafe { gemv4(&Q45Unpack::<FIVE>::new(), matrix, y, out) }
}

/// Rows of Q6_K weights against one token, as [`gemv_q45k`].
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,f16c")]
pub(super) fn gemv_q6k(matrix: &[u8], y: &[BlockQ8K], out: &mut [f32]) {
    // SAFETY: as in `gemv_q45k`.
    unsafe { gemv4(&Q6Unpack::new(), matrix, y, out) }
}

/// Q6_K row against Q8_K: the multi-token kernel for one token.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,f16c")]
pub(super) fn dot_q6k(row: &[u8], y: &[BlockQ8K]) -> f32 {
    dot_q6k_multi::<1>(row, [y])[0]
}

/// The unpacking constants of the Q6_K kernels.
pub(super) struct Q6Unpack {
    m4: __m512i,
    m30: __m512i,
    left01: __m512i,
    right23: __m512i,
    pick_scales: [__m512i; 2],
}

impl Q6Unpack {
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,f16c")]
    pub(super) fn new() -> Self {
        // Chunks 2p and 2p + 1's scale words (see `scale_pairs`): 128-bit
        // lane m of chunk j is sub-block 4j + m, so word w (lane w / 8) is
        // sub-block 8p + m of the first chunk in words 0..4 of the lane and
        // 8p + 4 + m of the second in words 4..8.
        let pick = |p: i16| {
            let lane = |w: i16| 8 * p + 4 * ((w % 8) / 4) + w / 8;
            _mm512_set_epi16(
                lane(31), lane(30), lane(29), lane(28), lane(27), lane(26), lane(25), lane(24), lane(23), lane(22), lane(21), lane(20), lane(19), lane(18), lane(17), lane(16),
                lane(15), lane(14), lane(13), lane(12), lane(11), lane(10), lane(9), lane(8), lane(7), lane(6), lane(5), lane(4), lane(3), lane(2), lane(1), lane(0),
            )
        };
        Q6Unpack {
            m4: _mm512_set1_epi8(15),
            m30: _mm512_set1_epi8(0x30),
            // Per 16-bit lane shift counts that bring qh bits 2k, 2k+1 to bits
            // 4, 5 for quarters k = 0 | 1 (left by 4 | 2) and k = 2 | 3 (right
            // by 0 | 2).
            left01: _mm512_inserti64x4::<1>(_mm512_set1_epi16(4), _mm256_set1_epi16(2)),
            right23: _mm512_inserti64x4::<1>(_mm512_set1_epi16(0), _mm256_set1_epi16(2)),
            pick_scales: [pick(0), pick(1)],
        }
    }

    /// Block `b` unpacked. The quants are taken unsigned (0..64) and the
    /// `- 32` comes back through `bsums`. Chunk j (0..4) is elements
    /// 64j..64j + 64: `vpdpbusd` sums each four products into i32 lane l,
    /// elements 4l..4l + 4 of the chunk (sub-block 4j + l / 4), and
    /// [`scale_pairs`] weighs them by their scales.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,f16c")]
    fn block(&self, b: &[u8]) -> KBlock {
        // SAFETY: 16 readable bytes (the scales); unaligned load.
        let sc8 = unsafe { _mm_loadu_si128(b[Q6K_SCALES..Q6K_SCALES + 16].as_ptr().cast()) };
        let sc16 = _mm256_cvtepi8_epi16(sc8);
        let scales = _mm512_castsi256_si512(sc16);
        let mut q = [_mm512_setzero_si512(); 4];
        for h in 0..2 {
            let ql = ld64(&b[64 * h..]);
            let qh = _mm512_broadcast_i64x4(ld32(&b[Q6K_QH + 32 * h..]));
            q[2 * h] = _mm512_or_si512(_mm512_and_si512(ql, self.m4), _mm512_and_si512(_mm512_sllv_epi16(qh, self.left01), self.m30));
            q[2 * h + 1] = _mm512_or_si512(
                _mm512_and_si512(_mm512_srli_epi16::<4>(ql), self.m4),
                _mm512_and_si512(_mm512_srlv_epi16(qh, self.right23), self.m30),
            );
        }
        KBlock {
            q,
            s: self.pick_scales.map(|pick| _mm512_permutexvar_epi16(pick, scales)),
            by_sums: sc16,
            d: half_bits(u16::from_le_bytes([b[Q6K_D], b[Q6K_D + 1]])),
            dmin: 0.0,
            six: true,
        }
    }
}

impl Unpack for Q6Unpack {
    const KIND: QuantKind = QuantKind::Q6K;
    #[inline]
    unsafe fn unpack(&self, b: &[u8]) -> KBlock {
        // SAFETY: the caller's CPU has the kernels' features.
        unsafe { self.block(b) }
    }
}

/// Q6_K row against `T` tokens of Q8_K at once ([`dot_k_multi`]).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,f16c")]
pub(super) fn dot_q6k_multi<const T: usize>(row: &[u8], ys: [&[BlockQ8K]; T]) -> [f32; T] {
    dot_k_multi(&Q6Unpack::new(), row, ys)
}

/// Two blocks' quants (`Q` as in `quants32`: 8, 4, 5 or [`Q5_1`]) as
/// unsigned bytes, `b0`'s in the low half: each quant plus [`bias`]. So
/// `vpdpbusd` takes them as they are, and a block's sum comes out
/// `bias · Σy` too large, which `gemv_32` takes off (one subtraction per
/// eight blocks, where moving the weights' signs onto the activations cost
/// three instructions per two blocks).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,f16c")]
fn quants64_biased<const Q: u8>(b0: &[u8], b1: &[u8]) -> __m512i {
    if Q == 8 {
        let x = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(ld32(&b0[2..])), ld32(&b1[2..]));
        return _mm512_xor_si512(x, _mm512_set1_epi8(-128));
    }
    let (qh_at, at) = qh_qs_at(Q);
    // Elements 0..16 are the low nibbles of a block's 16 bytes, 16..32 the high ones.
    let nibbles = |b: &[u8]| {
        // SAFETY: 16 readable bytes; unaligned load.
        let q = unsafe { _mm_loadu_si128(b[at..at + 16].as_ptr().cast()) };
        let m4 = _mm_set1_epi8(15);
        _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16::<4>(q), m4), _mm_and_si128(q, m4))
    };
    let x = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(nibbles(b0)), nibbles(b1));
    if Q == 4 {
        return x;
    }
    // Element j's fifth bit is bit j of the block's `qh`.
    let qh = |b: &[u8]| u32::from_le_bytes([b[qh_at], b[qh_at + 1], b[qh_at + 2], b[qh_at + 3]]) as u64;
    _mm512_mask_add_epi8(x, qh(b0) | qh(b1) << 32, x, _mm512_set1_epi8(16))
}

/// What [`quants64_biased`] adds to a `Q` quant: Q8_0's signed bytes are
/// moved up by 128; Q4_0's nibbles and Q5_0's five bits are stored that
/// far above their values (8, 16); Q5_1's are their values.
const fn bias(q: u8) -> i32 {
    match q {
        4 => 8,
        5 => 16,
        Q5_1 => 0,
        _ => 128,
    }
}

thread_local! {
    /// `bias · Σy` of each activation block of a `gemv_32` call, repeated
    /// past the row's end (entry i is block `i mod blocks`), so that any
    /// eight blocks from any column are one load. Grown, never shrunk.
    static BIASED_SUMS: std::cell::RefCell<Vec<i32>> = const { std::cell::RefCell::new(Vec::new()) };
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

/// The block sums of four `vpdpbusd` results (two blocks each, eight lanes
/// a block), in block order.
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

/// A Q8_0, Q4_0 or Q5_0 row (`Q` as in `quants32`) against Q8_0, or a
/// Q5_1 row against Q8_1: the band product of one row.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,f16c")]
fn dot_32<const Q: u8, Y: Block32>(row: &[u8], y: &[Y]) -> f32 {
    let mut out = [0.0f32];
    gemv_32::<Q, Y>(row, y, &mut out);
    out[0]
}

/// Rows of Q8_0, Q4_0 or Q5_0 weights (`Q` as in `quants32`), `y.len()`
/// blocks each, against Q8_0, or of Q5_1 against Q8_1: `out[r]` is row r's
/// `fold_32` (`fold_q5_1`) sum, bit for bit. Rows of whole eight-block
/// groups go to [`gemv_32_rows4`], rows of four blocks (MLA's per-head
/// `attn_k_b`) to [`gemv_32_rows8_of4`]; other rows are taken as one
/// stream of blocks, eight at a time across row ends: each row still adds
/// its blocks' products to its own sum from zero, in block order. Eight
/// blocks' integer sums are reduced together and their products formed in
/// one vector (the same f32 operations as `fold_32`'s, lane by lane).
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,f16c")]
pub(super) fn gemv_32<const Q: u8, Y: Block32>(matrix: &[u8], y: &[Y], out: &mut [f32]) {
    let bb = bytes32(Q);
    let per_row = y.len();
    out.fill(0.0); // for rows of no blocks
    if per_row == 0 {
        return;
    }
    // Taken out of the thread's slot and put back, not borrowed for a
    // closure around the loops: that form ran Q8_0 rows 16% slower.
    let mut sums = BIASED_SUMS.take();
    sums.clear();
    sums.extend((0..per_row + 8).map(|i| bias(Q) * y[i % per_row].qs().iter().map(|&v| i32::from(v)).sum::<i32>()));
    // Whole rows of eight-block groups go four at a time, a lane each
    // (Q5_1, bound by its unpacking, ran 8% slower so), rows of four
    // blocks eight at a time; the rest, here.
    let together = if Q != Q5_1 && per_row.is_multiple_of(8) {
        out.len() / 4 * 4
    } else if per_row == 4 {
        out.len() / 8 * 8
    } else {
        0
    };
    let (head, out) = out.split_at_mut(together);
    if per_row == 4 {
        gemv_32_rows8_of4::<Q, Y>(&matrix[..together * per_row * bb], y, &sums, head);
    } else {
        gemv_32_rows4::<Q, Y>(&matrix[..together * per_row * bb], y, &sums, head);
    }
    let matrix = &matrix[together * per_row * bb..][..out.len() * per_row * bb];
    let total = out.len() * per_row;
    let zero = _mm512_setzero_si512();
    // The row being summed (`acc`, stored when the row ends) and the next
    // block's column: kept in registers and counted, not divided. Indexing
    // `out` by `block / per_row` (a run-time divisor) had every block wait
    // for a division and for the previous block's store to its row.
    let (mut row, mut col, mut acc) = (0usize, 0usize, 0.0f32);
    let eights = total / 8;
    for b in matrix.chunks_exact(8 * bb) {
        super::fetch_block_ahead::<{ super::GEMV_LEAD }>(b);
        let first = col;
        let mut cols = [0usize; 8];
        for c in &mut cols {
            *c = col;
            col = if col + 1 == per_row { 0 } else { col + 1 };
        }
        // SAFETY: eight i32 from `first` (the sums run eight past the row);
        // unaligned load.
        let biased = unsafe { _mm256_loadu_si256(sums[first..first + 8].as_ptr().cast()) };
        // SAFETY: inlined here, with the kernels' features.
        let prod = unsafe { products8::<Q, Y>(b, y, cols, biased) };
        let mut t = [0f32; 8];
        // SAFETY: 8 writable f32; unaligned store.
        unsafe { _mm256_storeu_ps(t.as_mut_ptr(), prod) };
        for (p, &c) in t.into_iter().zip(&cols) {
            acc += p;
            if c + 1 == per_row {
                (out[row], row, acc) = (acc, row + 1, 0.0);
            }
        }
    }
    // The last blocks, fewer than eight, one at a time.
    for b in matrix[eights * 8 * bb..].chunks_exact(bb) {
        let yb = &y[col];
        // The high half's quants meet zero activations.
        let (s, _) = hsum_halves(_mm512_dpbusd_epi32(zero, quants64_biased::<Q>(b, b), pair_i8(yb.qs(), &[0; 32])));
        let ((dx, m), dy) = (halves_at(b, 0), half_bits(yb.d().to_bits()));
        acc = if Q == Q5_1 { fold_q5_1(acc, dx, dy, s - sums[col], m, yb.s()) } else { fold_32(acc, dx, dy, s - sums[col]) };
        col += 1;
        if col == per_row {
            (out[row], row, acc, col) = (acc, row + 1, 0.0, 0);
        }
    }
    BIASED_SUMS.set(sums);
}

/// The products of eight consecutive blocks `b` of `Q` weights with the
/// activation blocks of columns `cols` (block k against `y[cols[k]]`), as
/// `fold_32` (Q5_1: `fold_q5_1`) forms each before adding it to its row,
/// lane by lane the same f32 operations: the integer sums of four
/// `vpdpbusd` reduced together, less `biased` (each block's `bias · Σy`),
/// times `d_x · d_y`. Both forms of `gemv_32` take their products here.
///
/// # Safety
/// Inlined into a function with the kernels' features, on a CPU that has
/// them. (Given the eight activation blocks as an array of references
/// instead of columns, Q5_1 ran 28% slower.)
#[inline(always)]
unsafe fn products8<const Q: u8, Y: Block32>(b: &[u8], y: &[Y], cols: [usize; 8], biased: __m256i) -> __m256 {
    let bb = bytes32(Q);
    let ys = |k: usize| &y[cols[k]];
    let zero = _mm512_setzero_si512();
    let mut v = [zero; 4];
    let (mut dx, mut dy, mut m, mut sy) = ([0u16; 8], [0u16; 8], [0u16; 8], [0f32; 8]);
    for p in 0..4 {
        let (b0, b1) = (&b[2 * p * bb..], &b[(2 * p + 1) * bb..]);
        v[p] = _mm512_dpbusd_epi32(zero, quants64_biased::<Q>(b0, b1), pair_i8(ys(2 * p).qs(), ys(2 * p + 1).qs()));
        for (k, bk) in [(2 * p, b0), (2 * p + 1, b1)] {
            dx[k] = u16::from_le_bytes([bk[0], bk[1]]);
            dy[k] = ys(k).d().to_bits();
            if Q == Q5_1 {
                (m[k], sy[k]) = (u16::from_le_bytes([bk[2], bk[3]]), ys(k).s());
            }
        }
    }
    // SAFETY: two 16-byte arrays; unaligned loads.
    let (dx, dy) = unsafe { (_mm_loadu_si128(dx.as_ptr().cast()), _mm_loadu_si128(dy.as_ptr().cast())) };
    let scale = _mm256_mul_ps(_mm256_cvtph_ps(dx), _mm256_cvtph_ps(dy));
    let prod = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(sums8(v), biased)), scale);
    if Q == Q5_1 {
        // SAFETY: 16 readable bytes and 8 readable f32; unaligned loads.
        let (m, sy) = unsafe { (_mm_loadu_si128(m.as_ptr().cast()), _mm256_loadu_ps(sy.as_ptr())) };
        return _mm256_add_ps(prod, _mm256_mul_ps(_mm256_cvtph_ps(m), sy));
    }
    prod
}

/// [`gemv_32`] for rows of whole groups of eight blocks (`y.len()` a
/// multiple of eight), four rows at a time (`out.len()` a multiple of
/// four). A row's sum is a chain of additions in block order, which one
/// row at a time left waiting on each addition's latency (eight a group);
/// here the four rows' chains run side by side, row r in lane r, so each
/// addition serves four rows: the same additions in the same order, so
/// the same bits. `sums` holds `bias · Σy` of each activation block (`BIASED_SUMS`).
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,f16c")]
fn gemv_32_rows4<const Q: u8, Y: Block32>(matrix: &[u8], y: &[Y], sums: &[i32], out: &mut [f32]) {
    let (bb, per_row) = (bytes32(Q), y.len());
    let group_bytes = 8 * bb;
    // A run of a row's groups at a time, then the next row's (as `gemv4`
    // reads its rows): four rows group by group read memory in pieces too
    // short for the hardware prefetchers (Q8_0 from DRAM ran at 0.85 of
    // the one-row kernel's rate).
    const RUN: usize = 8;
    let mut products = [[_mm256_setzero_ps(); 4]; RUN];
    for (rows, o) in matrix.chunks_exact(4 * per_row * bb).zip(out.chunks_exact_mut(4)) {
        let mut acc = _mm_setzero_ps();
        for g0 in (0..per_row / 8).step_by(RUN) {
            let run = RUN.min(per_row / 8 - g0);
            // Each row's products with each group's eight blocks, in block order.
            for r in 0..4 {
                for (j, row_products) in products[..run].iter_mut().enumerate() {
                    let g = g0 + j;
                    let ys = &y[8 * g..8 * g + 8];
                    let b = &rows[(r * per_row + 8 * g) * bb..][..group_bytes];
                    super::fetch_block_ahead::<{ super::GEMV_LEAD }>(b);
                    // SAFETY: the group's eight i32; unaligned load.
                    let biased = unsafe { _mm256_loadu_si256(sums[8 * g..8 * g + 8].as_ptr().cast()) };
                    // SAFETY: inlined here, with the kernels' features.
                    let product = unsafe { products8::<Q, Y>(b, ys, [0, 1, 2, 3, 4, 5, 6, 7], biased) };
                    row_products[r] = product;
                }
            }
            for &rows4 in &products[..run] {
                // Transposed: column k holds block k's four products, a row a lane.
                // SAFETY: inlined here, with the kernels' features.
                let columns = unsafe { transpose_halves(rows4) };
                // Blocks 0..4 are the columns' low halves, 4..8 their high ones.
                for column in columns {
                    acc = _mm_add_ps(acc, _mm256_castps256_ps128(column));
                }
                for column in columns {
                    acc = _mm_add_ps(acc, _mm256_extractf128_ps::<1>(column));
                }
            }
        }
        // SAFETY: four writable f32; unaligned store.
        unsafe { _mm_storeu_ps(o.as_mut_ptr(), acc) };
    }
}

/// [`gemv_32`] for rows of four blocks (MLA's per-head `attn_k_b`, 128
/// columns), eight rows at a time (`out.len()` a multiple of eight). The
/// stream form adds each block's product to one running sum, so every
/// addition waited on the one before; here four vectors of eight blocks
/// (two rows each) are transposed so that each addition serves eight rows,
/// row r in its own lane: the same additions in the same order, so the
/// same bits.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,f16c")]
fn gemv_32_rows8_of4<const Q: u8, Y: Block32>(matrix: &[u8], y: &[Y], sums: &[i32], out: &mut [f32]) {
    let bb = bytes32(Q);
    debug_assert_eq!(y.len(), 4);
    // Two rows' blocks: columns 0..4 twice (the sums run eight past the row).
    // SAFETY: eight i32; unaligned load.
    let biased = unsafe { _mm256_loadu_si256(sums[..8].as_ptr().cast()) };
    // The transposed lanes hold rows 0, 2, 4, 6, 1, 3, 5, 7: back in order.
    let in_order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (rows, o) in matrix.chunks_exact(32 * bb).zip(out.chunks_exact_mut(8)) {
        let mut pairs = [_mm256_setzero_ps(); 4];
        for (k, pair) in pairs.iter_mut().enumerate() {
            let b = &rows[k * 8 * bb..][..8 * bb];
            super::fetch_block_ahead::<{ super::GEMV_LEAD }>(b);
            // SAFETY: inlined here, with the kernels' features.
            *pair = unsafe { products8::<Q, Y>(b, y, [0, 1, 2, 3, 0, 1, 2, 3], biased) };
        }
        // Each 128-bit half is a row's four products: transposed half by
        // half, column k holds block k of rows 0, 2, 4, 6 (low) and 1, 3, 5, 7.
        let mut acc = _mm256_setzero_ps();
        // SAFETY: inlined here, with the kernels' features.
        for column in unsafe { transpose_halves(pairs) } {
            acc = _mm256_add_ps(acc, column);
        }
        // SAFETY: eight writable f32; unaligned store.
        unsafe { _mm256_storeu_ps(o.as_mut_ptr(), _mm256_permutevar8x32_ps(acc, in_order)) };
    }
}

/// Four vectors' 128-bit halves transposed as 4 × 4 matrices: lane i of
/// column k's low (high) half is element k of vector i's low (high) half.
///
/// # Safety
/// Inlined into a function with the kernels' features, on a CPU that has
/// them.
#[inline(always)]
unsafe fn transpose_halves([a, b, c, d]: [__m256; 4]) -> [__m256; 4] {
    let (ab_lo, ab_hi, cd_lo, cd_hi) = (_mm256_unpacklo_ps(a, b), _mm256_unpackhi_ps(a, b), _mm256_unpacklo_ps(c, d), _mm256_unpackhi_ps(c, d));
    [
        _mm256_shuffle_ps::<0b01_00_01_00>(ab_lo, cd_lo),
        _mm256_shuffle_ps::<0b11_10_11_10>(ab_lo, cd_lo),
        _mm256_shuffle_ps::<0b01_00_01_00>(ab_hi, cd_hi),
        _mm256_shuffle_ps::<0b11_10_11_10>(ab_hi, cd_hi),
    ]
}

/// Q8_0 row against Q8_0.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,f16c")]
pub(super) fn dot_q8_0(row: &[u8], y: &[BlockQ8_0]) -> f32 {
    dot_32::<8, _>(row, y)
}

/// Q4_0 row against Q8_0.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,f16c")]
pub(super) fn dot_q4_0(row: &[u8], y: &[BlockQ8_0]) -> f32 {
    dot_32::<4, _>(row, y)
}

/// Q5_0 row against Q8_0.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,f16c")]
pub(super) fn dot_q5_0(row: &[u8], y: &[BlockQ8_0]) -> f32 {
    dot_32::<5, _>(row, y)
}

/// Q5_1 row against Q8_1.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,f16c")]
pub(super) fn dot_q5_1(row: &[u8], y: &[BlockQ8_1]) -> f32 {
    dot_32::<Q5_1, _>(row, y)
}
