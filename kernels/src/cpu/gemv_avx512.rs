//! AVX-512 GEMV kernels: `Avx512Fp16` (FP16 FMA, decode only), `Avx512Bf16`
//! (`vdpbf16ps`) and `Avx512` (f32 FMA).
//!
//! # FP8 → BF16 with integer ops
//! An E4M3 magnitude `eeee.mmm` shifted left by 4 lines up with BF16's
//! exponent and mantissa; OR-ing in exponent bit 7 (`0x4000`) rebiases it, so
//! `0x4000 | mag << 4` is the value × 2⁸ for every normal code (e ≥ 1). The
//! 2⁻⁸ is folded into the block scale. The sign must move from bit 11 to 15.
//! Both fall out of one arithmetic shift plus one `vpternlogd`:
//! a 64-byte load viewed as 32 words has the odd bytes in the high halves;
//! `sraw 4` puts each odd byte's sign in bits 15..11 and magnitude in 10..4,
//! and `(v & 0x87f0) | 0x4000` finishes the BF16 value. Even bytes take one
//! extra `sllw 8`. So 64 codes cost 5 ALU ops, and the activations are
//! packed in the same odd/even order (see `pack`).
//!
//! Exponent-0 codes (zero and the subnormals) decode wrongly this way. In a
//! block-scaled checkpoint they are rare (values under 2⁻⁶ of a scale that
//! maps the block's maximum to 448: of order 1e-4 of the codes), so a
//! `vptestnmb` per load looks for them, and a kernel step (one full line from
//! each of its rows) takes the exact decode only if any of its lines has one:
//! the same shift trick on zero-extended codes, with the exponent-0 lanes
//! replaced from a table indexed by the mantissa (`vpermw`) and the sign
//! OR-ed back. One branch per step, not per line, matters: with the weights
//! in cache a branch per line cost more than the decode. On checkpoint
//! weights the exact branch is rarely taken; uniformly random bytes (1/16
//! such codes) take it on nearly every step and run ~1.5× slower. Both
//! decodes read the two NaN codes as ±480.
//!
//! On the development machine (an AVX-512 BF16/FP16 Xeon under KVM)
//! `vdpbf16ps` issues about once per two cycles and dominates: 64 codes cost
//! two of them plus the five decode ops, and one core with its weights in
//! cache is barely faster than one core's DRAM read (`DUPLEX_ISA=avx512bf16
//! duplex bench-kernels`, last row). Where AVX512-FP16 exists, the FP8
//! GEMV takes FP16 instead, for any number of tokens (see [`fused_fp16`]).
//!
//! The `Avx512` level splits the same BF16 words into f32 lanes (BF16 is the
//! top half of an f32) — four lane classes per 64 codes — and uses FMA.

// The kernels index several fixed-size register arrays ([row][token]) in
// lockstep; index loops say that more plainly than zipped iterators.
#![allow(clippy::needless_range_loop)]

use super::kernel::{bands, prefetch_ahead, prefetch_far, token_groups, Bf16Rows, Job, RowKernel, BAND_ROWS, E4M3_BF16_X256, PASS_TOKENS, UNBIAS};
use super::gemv::bf16_to_f32;
use super::pack::{AlignedBuf, Packed};
use std::arch::x86_64::*;
use std::array;
use std::ops::Range;

// ---------------------------------------------------------------------------
// Decoding

/// Reinterpret 32 BF16 bit patterns as the dot-product operand type.
#[inline(always)]
fn bh(v: __m512i) -> __m512bh {
    // SAFETY: both are 64-byte plain vectors; every bit pattern is valid.
    unsafe { std::mem::transmute::<__m512i, __m512bh>(v) }
}

/// Fast decode of 64 codes (a raw 64-byte load) to two vectors of BF16 × 2⁸:
/// the odd bytes, then the even bytes. Exponent-0 codes come out wrong.
#[inline]
#[target_feature(enable = "avx512f,avx512bw")]
fn fast_odd_even(raw: __m512i) -> (__m512i, __m512i) {
    let keep = _mm512_set1_epi16(0x87f0u16 as i16);
    let bias = _mm512_set1_epi16(0x4000);
    // (a & b) | c
    let odd = _mm512_ternarylogic_epi32::<0xea>(_mm512_srai_epi16::<4>(raw), keep, bias);
    let even = _mm512_ternarylogic_epi32::<0xea>(_mm512_srai_epi16::<4>(_mm512_slli_epi16::<8>(raw)), keep, bias);
    (odd, even)
}

/// Which of the (`valid`) bytes of `raw` are zero or subnormal codes.
#[inline]
#[target_feature(enable = "avx512f,avx512bw")]
fn exponent_zero(raw: __m512i, valid: u64) -> u64 {
    _mm512_mask_testn_epi8_mask(valid, raw, _mm512_set1_epi8(0x78))
}

/// Exact BF16 × 2⁸ of 32 codes zero-extended in 16-bit lanes, except that
/// NaN codes read as ±480 like [`fast_odd_even`]: the fast decode's
/// magnitude, with exponent-0 lanes replaced from the table of `m/8 · 2⁻⁶ · 2⁸`
/// (`vpermw` indexes by the low 5 bits, which are `00mmm` for these codes).
#[inline]
#[target_feature(enable = "avx512f,avx512bw")]
fn exact_words(codes: __m512i) -> __m512i {
    // SAFETY: the table has 256 entries; entries 0..8 are the subnormals × 2⁸.
    let subnormals = unsafe { _mm512_loadu_si512(E4M3_BF16_X256.as_ptr().cast()) };
    let mag = _mm512_ternarylogic_epi32::<0xea>(
        _mm512_slli_epi16::<4>(codes),
        _mm512_set1_epi16(0x07f0),
        _mm512_set1_epi16(0x4000),
    );
    let zero_exp = _mm512_testn_epi16_mask(codes, _mm512_set1_epi16(0x78));
    let mag = _mm512_mask_permutexvar_epi16(mag, zero_exp, codes, subnormals);
    // a | (b & c): the code's sign bit, moved to bit 15.
    _mm512_ternarylogic_epi32::<0xf8>(mag, _mm512_slli_epi16::<8>(codes), _mm512_set1_epi16(0x8000u16 as i16))
}

/// Exact version of [`fast_odd_even`], for loads holding exponent-0 codes.
/// (Inlined, not `#[cold]`: a call per load would make weights full of such
/// codes several times slower instead of ~2×.)
#[inline]
#[target_feature(enable = "avx512f,avx512bw")]
fn exact_odd_even(raw: __m512i) -> (__m512i, __m512i) {
    (exact_words(_mm512_srli_epi16::<8>(raw)), exact_words(_mm512_and_si512(raw, _mm512_set1_epi16(0xff))))
}

/// The f32 lane classes of 64 codes from their odd/even BF16 words: a BF16
/// value is the top half of its f32, so the high words of each dword are one
/// class and the low words (shifted up) another. Order: bytes 4i+3, 4i+1,
/// 4i+2, 4i (see [`C4_ORDER`]).
#[inline]
#[target_feature(enable = "avx512f")]
fn classes_from_words(odd: __m512i, even: __m512i) -> [__m512; 4] {
    let high = _mm512_set1_epi32(0xffff_0000u32 as i32);
    [
        _mm512_castsi512_ps(_mm512_and_si512(odd, high)),
        _mm512_castsi512_ps(_mm512_slli_epi32::<16>(odd)),
        _mm512_castsi512_ps(_mm512_and_si512(even, high)),
        _mm512_castsi512_ps(_mm512_slli_epi32::<16>(even)),
    ]
}

/// Fast decode of 64 codes straight to the four f32 classes (× 2⁸): the
/// ternlog masks and rebiases in the f32 layout, so the low-word classes
/// need only their shift. Exponent-0 codes come out wrong.
#[inline]
#[target_feature(enable = "avx512f,avx512bw")]
fn fast_classes(raw: __m512i) -> [__m512; 4] {
    let keep = _mm512_set1_epi32(0x87f0_0000u32 as i32);
    let bias = _mm512_set1_epi32(0x4000_0000);
    let odd = _mm512_srai_epi16::<4>(raw);
    let even = _mm512_srai_epi16::<4>(_mm512_slli_epi16::<8>(raw));
    let f = |v: __m512i| _mm512_castsi512_ps(_mm512_ternarylogic_epi32::<0xea>(v, keep, bias));
    [f(odd), f(_mm512_slli_epi32::<16>(odd)), f(even), f(_mm512_slli_epi32::<16>(even))]
}

/// Byte class of each 16-lane quarter of [`fast_classes`].
const C4_ORDER: [usize; 4] = [3, 1, 2, 0];

#[inline(always)]
fn tail_mask64(len: usize) -> u64 {
    if len >= 64 {
        !0
    } else {
        (1u64 << len) - 1
    }
}

#[inline(always)]
fn tail_mask32(len: usize) -> u32 {
    if len >= 32 {
        !0
    } else {
        (1u32 << len) - 1
    }
}

/// Load up to 64 bytes; masked-off bytes read as zero and are not accessed.
///
/// # Safety
/// `p .. p + len` must be readable.
#[inline]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn load_bytes(p: *const u8, len: usize) -> __m512i {
    // SAFETY: per the contract; a full load reads exactly 64 bytes.
    unsafe {
        if len >= 64 {
            _mm512_loadu_si512(p.cast())
        } else {
            _mm512_maskz_loadu_epi8(tail_mask64(len), p.cast())
        }
    }
}

/// Horizontal sums of the per-row, per-token accumulators.
#[inline]
#[target_feature(enable = "avx512f")]
fn reduce<const R: usize, const N: usize>(acc: &[[__m512; N]; R]) -> [[f32; N]; R] {
    array::from_fn(|r| array::from_fn(|t| _mm512_reduce_add_ps(acc[r][t])))
}

// ---------------------------------------------------------------------------
// Fused FP8 decode + dot (any number of tokens)

struct FusedBf16<'a> {
    job: &'a Job<'a>,
    x: &'a Packed<u16>,
}

impl RowKernel for FusedBf16<'_> {
    unsafe fn rows<const R: usize, const N: usize>(&self, rows: [usize; R], t0: usize) -> [[f32; N]; R] {
        // SAFETY: forwarded from the caller.
        unsafe { fused_bf16::<R, N>(self.job, self.x, rows, t0) }
    }
}

/// # Safety
/// AVX512-BF16 present; `rows` and tokens `t0..t0 + N` in range.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
unsafe fn fused_bf16<const R: usize, const N: usize>(job: &Job, x: &Packed<u16>, rows: [usize; R], t0: usize) -> [[f32; N]; R] {
    // One chain per sum, a line's odd bytes then its even ones, whatever R
    // and N: the order of a row's sum must not depend on how many rows and
    // tokens share the step (batch invariance, see `kernel::bands`). (Two
    // chains, odd and even, hid the dot product's latency where a step has
    // few sums, but decode is bound by memory, not by that; and in
    // `tile_bf16`, which must keep these sums, the second chain cost an
    // add per sum and block next to the dot products: one chain made the
    // FP8 prefill GEMM 7–10% faster, `matmul_bf16` bench.)
    // SAFETY: every row is < the matrix's rows, so its `cols` bytes are inside `data`.
    let row: [*const u8; R] = rows.map(|r| unsafe { job.data.as_ptr().add(r * job.cols) });
    let scales: [&[f32]; R] = rows.map(|r| job.scale_row(r));
    let mut total = [[_mm512_setzero_ps(); N]; R];
    for cb in 0..job.col_blocks {
        let (k0, width) = job.block_cols(cb);
        let mut acc = [[_mm512_setzero_ps(); N]; R];
        for q in 0..width.div_ceil(64) {
            let len = (width - 64 * q).min(64);
            // SAFETY: the packed chunk holds 64 u16 (32 odd, then 32 even).
            let xo: [__m512bh; N] = array::from_fn(|t| bh(unsafe { _mm512_load_si512(x.chunk(t0 + t, cb, q).cast()) }));
            let xe: [__m512bh; N] = array::from_fn(|t| bh(unsafe { _mm512_load_si512(x.chunk(t0 + t, cb, q).add(32).cast()) }));
            let mut dot = |r: usize, (odd, even): (__m512i, __m512i)| {
                for t in 0..N {
                    acc[r][t] = _mm512_dpbf16_ps(acc[r][t], bh(odd), xo[t]);
                    acc[r][t] = _mm512_dpbf16_ps(acc[r][t], bh(even), xe[t]);
                }
            };
            if len == 64 {
                // The common case: a full line from each row, and one test
                // and branch for all of them (a branch per row costs more
                // than the decode when the weights are cache-resident).
                let raw: [__m512i; R] = array::from_fn(|r| {
                    prefetch_ahead(row[r], k0 + 64 * q);
                    // SAFETY: columns k0 + 64q .. + 64 are inside the row.
                    unsafe { _mm512_loadu_si512(row[r].add(k0 + 64 * q).cast()) }
                });
                if raw.iter().fold(0, |any, &v| any | exponent_zero(v, !0)) == 0 {
                    for r in 0..R {
                        dot(r, fast_odd_even(raw[r]));
                    }
                } else {
                    for r in 0..R {
                        dot(r, exact_odd_even(raw[r]));
                    }
                }
            } else {
                for r in 0..R {
                    // SAFETY: columns k0 + 64q .. + len are inside the row.
                    let raw = unsafe { load_bytes(row[r].add(k0 + 64 * q), len) };
                    dot(r, exact_odd_even(raw));
                }
            }
        }
        for r in 0..R {
            // (The decode's 2⁸ comes off once at the end: exact, being a power of two.)
            let s = _mm512_set1_ps(scales[r][cb]);
            for t in 0..N {
                total[r][t] = _mm512_fmadd_ps(acc[r][t], s, total[r][t]);
            }
        }
    }
    reduce(&total).map(|row| row.map(|v| v * UNBIAS))
}

// ---------------------------------------------------------------------------
// FP8 prefill at the BF16 level: bands decoded once, then `fused_bf16`'s sums

/// A band of FP8 rows decoded into BF16 × 2⁸ words laid out as
/// [`fused_bf16`] decodes them: per row, per column block, per 64-column
/// line, the 32 odd bytes' words, then the 32 even bytes' (zero past the
/// block's end). Row `r` starts at `base + (r − first) · stride` words.
#[derive(Clone, Copy)]
struct OddEvenTile {
    base: *const u16,
    stride: usize,
    first: usize,
    /// Lines per column block.
    lines: usize,
}

/// Words per row of an [`OddEvenTile`] for `job`.
fn odd_even_stride(job: &Job) -> usize {
    job.col_blocks * job.block[1].div_ceil(64) * 64
}

/// Decode FP8 rows `band` into `tile` (see [`OddEvenTile`]) with the exact
/// decode [`fused_bf16`] falls back on, whose words equal the fast decode's
/// for every code (NaN codes as ±480 in both).
///
/// # Safety
/// AVX-512 F/BW present; `band` inside the matrix; `tile` holds
/// `band.len() · odd_even_stride(job)` words, 64-byte aligned.
#[target_feature(enable = "avx512f,avx512bw")]
pub(super) unsafe fn decode_odd_even_tile(job: &Job, band: Range<usize>, tile: &mut [u16]) {
    let (stride, lines) = (odd_even_stride(job), job.block[1].div_ceil(64));
    for (i, r) in band.enumerate() {
        // SAFETY: row r is inside `data`.
        let row = unsafe { job.data.as_ptr().add(r * job.cols) };
        for cb in 0..job.col_blocks {
            let (k0, width) = job.block_cols(cb);
            for q in 0..width.div_ceil(64) {
                // Each band is read from DRAM once; without the prefetch its
                // loads waited on memory (17% of a 2048-token FP8 prefill's
                // samples in this function, 7% with it 1 KiB ahead).
                prefetch_far(row, k0 + 64 * q);
                // SAFETY: columns k0 + 64q .. + len are inside the row; the
                // line's 64 words are inside the tile row, 64-byte aligned.
                unsafe {
                    let (odd, even) = exact_odd_even(load_bytes(row.add(k0 + 64 * q), (width - 64 * q).min(64)));
                    let dst = tile.as_mut_ptr().add(i * stride + (cb * lines + q) * 64);
                    _mm512_store_si512(dst.cast(), odd);
                    _mm512_store_si512(dst.add(32).cast(), even);
                }
            }
        }
    }
}

struct TileBf16<'a> {
    job: &'a Job<'a>,
    tile: OddEvenTile,
    x: &'a Packed<u16>,
}

impl RowKernel for TileBf16<'_> {
    unsafe fn rows<const R: usize, const N: usize>(&self, rows: [usize; R], t0: usize) -> [[f32; N]; R] {
        // SAFETY: forwarded from the caller.
        unsafe { tile_bf16::<R, N>(self.job, self.tile, self.x, rows, t0) }
    }
}

/// [`fused_bf16`] over a decoded [`OddEvenTile`]: the same words, the same
/// dot products into the same chain, the same scaling, so the same
/// bits for every row and token. Prefill decodes each band once for all
/// its passes instead of once per pass (decoding per pass made 512-token
/// prefill ~1.6× as slow).
///
/// # Safety
/// AVX512-BF16 present; `rows` in the tile, tokens `t0..t0 + N` in range.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
unsafe fn tile_bf16<const R: usize, const N: usize>(job: &Job, tile: OddEvenTile, x: &Packed<u16>, rows: [usize; R], t0: usize) -> [[f32; N]; R] {
    // SAFETY: the rows are in the tile.
    let row: [*const u16; R] = rows.map(|r| unsafe { tile.base.add((r - tile.first) * tile.stride) });
    let scales: [&[f32]; R] = rows.map(|r| job.scale_row(r));
    let mut total = [[_mm512_setzero_ps(); N]; R];
    for cb in 0..job.col_blocks {
        let (_, width) = job.block_cols(cb);
        let mut acc = [[_mm512_setzero_ps(); N]; R];
        for q in 0..width.div_ceil(64) {
            // SAFETY: the packed chunk holds 64 u16 (32 odd, then 32 even).
            let xo: [__m512bh; N] = array::from_fn(|t| bh(unsafe { _mm512_load_si512(x.chunk(t0 + t, cb, q).cast()) }));
            let xe: [__m512bh; N] = array::from_fn(|t| bh(unsafe { _mm512_load_si512(x.chunk(t0 + t, cb, q).add(32).cast()) }));
            for r in 0..R {
                // SAFETY: line (cb, q) of the row is inside the tile, aligned.
                let (odd, even) = unsafe {
                    let p = row[r].add((cb * tile.lines + q) * 64);
                    (_mm512_load_si512(p.cast()), _mm512_load_si512(p.add(32).cast()))
                };
                for t in 0..N {
                    acc[r][t] = _mm512_dpbf16_ps(acc[r][t], bh(odd), xo[t]);
                    acc[r][t] = _mm512_dpbf16_ps(acc[r][t], bh(even), xe[t]);
                }
            }
        }
        for r in 0..R {
            let s = _mm512_set1_ps(scales[r][cb]);
            for t in 0..N {
                total[r][t] = _mm512_fmadd_ps(acc[r][t], s, total[r][t]);
            }
        }
    }
    reduce(&total).map(|row| row.map(|v| v * UNBIAS))
}

// ---------------------------------------------------------------------------
// Fused FP8 decode + FP16 FMA (the `Avx512Fp16` level)

/// Decode of 64 codes (a raw 64-byte load) to two vectors of FP16 × 2⁻⁸: the
/// odd bytes, then the even bytes. Exact for every code, zero and subnormal
/// ones included: E4M3's `s eeee mmm` at FP16 bits 15 and 13..7 is an FP16
/// with exponent field `0eeee`, the value × 2⁻⁸, and the subnormal codes
/// land on FP16 subnormals of the same scale. NaN codes read as ±480, as in
/// [`fast_odd_even`]. So no test for exponent-0 codes is needed.
#[inline]
#[target_feature(enable = "avx512f,avx512bw")]
fn fp16_odd_even(raw: __m512i) -> (__m512i, __m512i) {
    // `sraw 1` leaves a word's high byte with its sign in bits 15 and 14
    // and its magnitude in 13..7; the mask drops bit 14 and the low byte.
    let keep = _mm512_set1_epi16(0xbf80u16 as i16);
    let odd = _mm512_and_si512(_mm512_srai_epi16::<1>(raw), keep);
    let even = _mm512_and_si512(_mm512_srai_epi16::<1>(_mm512_slli_epi16::<8>(raw)), keep);
    (odd, even)
}

/// The 32 FP16 sums of `acc` folded to 16 (high half onto low) and widened
/// to f32.
#[inline]
#[target_feature(enable = "avx512f,avx512vl,avx512fp16")]
fn widen_fp16(acc: __m512h) -> __m512 {
    let low = _mm512_castph512_ph256(acc);
    let high = _mm256_castsi256_ph(_mm512_extracti64x4_epi64::<1>(_mm512_castph_si512(acc)));
    _mm512_cvtxph_ps(_mm256_add_ph(low, high))
}

/// BF16 bit patterns to FP16 ones in place, multiplied on the way by
/// `scale` (a power of two), rounding to nearest even. `values` is a packed
/// activation buffer: whole chunks of 64.
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
fn bf16_to_fp16_scaled(values: &mut [u16], scale: f32) {
    assert!(values.len().is_multiple_of(16), "bf16_to_fp16_scaled: not whole vectors");
    let s = _mm512_set1_ps(scale);
    for c in values.chunks_exact_mut(16) {
        // SAFETY: the chunk holds 16 u16, 32 bytes, for the load and the store.
        unsafe {
            let b = _mm256_loadu_si256(c.as_ptr().cast());
            let f = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(b))), s);
            _mm256_storeu_si256(c.as_mut_ptr().cast(), _mm512_cvtps_ph::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(f));
        }
    }
}

struct FusedFp16<'a> {
    job: &'a Job<'a>,
    /// FP16 activations, token `t` × 2⁻ˢ⁽ᵗ⁾ (see [`run_fp16`]).
    x: &'a Packed<u16>,
    /// Per token, 2⁸⁺ˢ⁽ᵗ⁾: undoes the decode's 2⁻⁸ and the activations' 2⁻ˢ⁽ᵗ⁾.
    post: &'a [f32],
}

impl RowKernel for FusedFp16<'_> {
    unsafe fn rows<const R: usize, const N: usize>(&self, rows: [usize; R], t0: usize) -> [[f32; N]; R] {
        // SAFETY: forwarded from the caller.
        unsafe { fused_fp16::<R, N>(self.job, self.x, rows, t0, self.post) }
    }
}

/// [`fused_bf16`] with FP16 products and short FP16 sums: `vfmadd231ph`
/// does 32 multiply-adds per instruction at about three times the rate
/// `vdpbf16ps` does its 32 (on the development machine), and the decode
/// needs no exponent-0 test, so one core runs ~1.4× as fast with its
/// weights in cache.
///
/// Each lane sums at most two lines' products (4 per token) in FP16 before
/// they are folded in pairs and widened into the f32 totals, scaled by the
/// block's scale. With weights of magnitude < 2 (× 2⁻⁸) and activations
/// scaled below 2¹¹, a folded sum of 8 products stays under 2¹⁵, far from
/// FP16's 65504; its rounding error is a few units of 2⁻¹¹ of the terms'
/// magnitude, below what rounding the activations to BF16 already costs.
///
/// # Safety
/// AVX512-FP16 present; `rows` and tokens `t0..t0 + N` in range.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512fp16")]
unsafe fn fused_fp16<const R: usize, const N: usize>(job: &Job, x: &Packed<u16>, rows: [usize; R], t0: usize, post: &[f32]) -> [[f32; N]; R] {
    // SAFETY: every row is < the matrix's rows, so its `cols` bytes are inside `data`.
    let row: [*const u8; R] = rows.map(|r| unsafe { job.data.as_ptr().add(r * job.cols) });
    let scales: [&[f32]; R] = rows.map(|r| job.scale_row(r));
    let mut total = [[_mm512_setzero_ps(); N]; R];
    for cb in 0..job.col_blocks {
        let (k0, width) = job.block_cols(cb);
        let lines = width.div_ceil(64);
        let mut acc = [[_mm512_setzero_ph(); N]; R];
        for q in 0..lines {
            let len = (width - 64 * q).min(64);
            // SAFETY: the packed chunk holds 64 u16 (32 odd, then 32 even).
            let xo: [__m512h; N] = array::from_fn(|t| _mm512_castsi512_ph(unsafe { _mm512_load_si512(x.chunk(t0 + t, cb, q).cast()) }));
            let xe: [__m512h; N] = array::from_fn(|t| _mm512_castsi512_ph(unsafe { _mm512_load_si512(x.chunk(t0 + t, cb, q).add(32).cast()) }));
            for r in 0..R {
                prefetch_ahead(row[r], k0 + 64 * q);
                // SAFETY: columns k0 + 64q .. + len are inside the row.
                let (odd, even) = fp16_odd_even(unsafe { load_bytes(row[r].add(k0 + 64 * q), len) });
                for t in 0..N {
                    acc[r][t] = _mm512_fmadd_ph(_mm512_castsi512_ph(odd), xo[t], acc[r][t]);
                    acc[r][t] = _mm512_fmadd_ph(_mm512_castsi512_ph(even), xe[t], acc[r][t]);
                }
            }
            if q % 2 == 1 || q + 1 == lines {
                for r in 0..R {
                    let s = _mm512_set1_ps(scales[r][cb]);
                    for t in 0..N {
                        total[r][t] = _mm512_fmadd_ps(widen_fp16(acc[r][t]), s, total[r][t]);
                        acc[r][t] = _mm512_setzero_ph();
                    }
                }
            }
        }
    }
    reduce(&total).map(|row| array::from_fn(|t| row[t] * post[t0 + t]))
}

/// The sums of sixteen vectors, in one: lane `i` of the result is the sum
/// of the lanes of `v[i]`. A transposing tree of 45 shuffles and adds, where
/// sixteen separate horizontal sums take ~120 with long dependency chains.
#[inline]
#[target_feature(enable = "avx512f")]
fn sum16(v: [__m512; 16]) -> __m512 {
    // Pairs: per 128-bit quarter, [a0+a2, b0+b2, a1+a3, b1+b3].
    let pair: [__m512; 8] = array::from_fn(|k| _mm512_add_ps(_mm512_unpacklo_ps(v[2 * k], v[2 * k + 1]), _mm512_unpackhi_ps(v[2 * k], v[2 * k + 1])));
    // Fours: per quarter, the quarter's sums of rows 4k..4k + 4.
    let four: [__m512; 4] = array::from_fn(|k| {
        let (a, b) = (_mm512_castps_pd(pair[2 * k]), _mm512_castps_pd(pair[2 * k + 1]));
        // (Moved as pairs of floats, added as floats.)
        _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)))
    });
    // Across quarters: first halves of two vectors' quarters onto the other halves.
    let fold = |a: __m512, b: __m512| _mm512_add_ps(_mm512_shuffle_f32x4::<0b10_00_10_00>(a, b), _mm512_shuffle_f32x4::<0b11_01_11_01>(a, b));
    fold(fold(four[0], four[1]), fold(four[2], four[3]))
}

/// [`fused_fp16`] for token `t` over rows of at most 128 columns: one scale
/// block and at most two lines a row, as in MLA's absorbed query products
/// (512 rows of 128 per head). Such rows cost their reduction and the call
/// more than their FMAs, so this takes sixteen neighbouring rows a step and
/// folds their sums with [`sum16`], writing `out[r − rows.start]`. The FP16
/// sums per lane are those of [`fused_fp16`]. With the weights in cache, a
/// 512 × 128 product took 3.6–6.5 µs against 6.6–12.2 µs before (paired
/// runs); inside the model, where each head's band comes from DRAM, the
/// absorbed query products took ~12% less time.
///
/// Every row of such a matrix goes through here, for any number of tokens
/// and any band (the last step of a band pads its sixteen with zero
/// vectors), so that a row's sum never depends on the batch or the band:
/// `sum16` folds each vector on its own, in a fixed order.
///
/// # Safety
/// AVX512-FP16 present; `job.cols ≤ 128` in one column block; `rows` inside
/// the matrix; `t` a token of `x`; `out` holds `rows.len()` values.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512fp16")]
unsafe fn short_rows_fp16(job: &Job, x: &Packed<u16>, t: usize, rows: Range<usize>, post: f32, out: &mut [f32]) {
    let cols = job.cols;
    let lines = cols.div_ceil(64);
    // SAFETY: chunks 0 and (when there are two lines) 1 of block 0 exist.
    let xo: [__m512h; 2] = array::from_fn(|q| _mm512_castsi512_ph(if q < lines { unsafe { _mm512_load_si512(x.chunk(t, 0, q).cast()) } } else { _mm512_setzero_si512() }));
    let xe: [__m512h; 2] = array::from_fn(|q| _mm512_castsi512_ph(if q < lines { unsafe { _mm512_load_si512(x.chunk(t, 0, q).add(32).cast()) } } else { _mm512_setzero_si512() }));
    let mut r = rows.start;
    while r < rows.end {
        let count = (rows.end - r).min(16);
        let sums: [__m512; 16] = array::from_fn(|i| {
            if i >= count {
                return _mm512_setzero_ps();
            }
            let row = job.data.as_ptr().wrapping_add((r + i) * cols);
            // One sequential stream (the rows are neighbours), read from
            // DRAM a head at a time: fetch 4 KiB ahead, 32 rows of 128
            // columns, not the row kernels' 1 KiB (~10% less time for the
            // absorbed query products in the model).
            for q in 0..2 {
                if q < lines {
                    // A hint only: it never faults.
                    _mm_prefetch::<_MM_HINT_T0>(row.wrapping_add(4096 + 64 * q).cast());
                }
            }
            let mut acc = _mm512_setzero_ph();
            for q in 0..2 {
                if q < lines {
                    // SAFETY: columns 64q .. min(64q + 64, cols) are inside row r + i.
                    let (odd, even) = fp16_odd_even(unsafe { load_bytes(row.add(64 * q), cols - 64 * q) });
                    acc = _mm512_fmadd_ph(_mm512_castsi512_ph(odd), xo[q], acc);
                    acc = _mm512_fmadd_ph(_mm512_castsi512_ph(even), xe[q], acc);
                }
            }
            widen_fp16(acc)
        });
        let scales: [f32; 16] = array::from_fn(|i| if i < count { job.scale_row(r + i)[0] * post } else { 0.0 });
        // SAFETY: `scales` holds 16 floats; the mask keeps the store to
        // out[r − start ..][..count], inside `out`.
        unsafe {
            let v = _mm512_mul_ps(sum16(sums), _mm512_loadu_ps(scales.as_ptr()));
            _mm512_mask_storeu_ps(out.as_mut_ptr().add(r - rows.start), ((1u32 << count) - 1) as u16, v);
        }
        r += count;
    }
}

struct FusedF32<'a> {
    job: &'a Job<'a>,
    x: &'a Packed<f32>,
}

impl RowKernel for FusedF32<'_> {
    unsafe fn rows<const R: usize, const N: usize>(&self, rows: [usize; R], t0: usize) -> [[f32; N]; R] {
        // SAFETY: forwarded from the caller.
        unsafe { fused_f32::<R, N>(self.job, self.x, rows, t0) }
    }
}

/// [`fused_bf16`] for CPUs without BF16 dot products: f32 lanes and FMA.
///
/// # Safety
/// AVX-512 F/BW/VL present; rows and tokens in range.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma")]
unsafe fn fused_f32<const R: usize, const N: usize>(job: &Job, x: &Packed<f32>, rows: [usize; R], t0: usize) -> [[f32; N]; R] {
    // Two chains whatever R and N (fixed, as in `fused_bf16`, for batch invariance).
    // SAFETY: every row is < the matrix's rows, so its `cols` bytes are inside `data`.
    let row: [*const u8; R] = rows.map(|r| unsafe { job.data.as_ptr().add(r * job.cols) });
    let scales: [&[f32]; R] = rows.map(|r| job.scale_row(r));
    let mut total = [[_mm512_setzero_ps(); N]; R];
    for cb in 0..job.col_blocks {
        let (k0, width) = job.block_cols(cb);
        let mut acc = [[[_mm512_setzero_ps(); 2]; N]; R];
        for q in 0..width.div_ceil(64) {
            let len = (width - 64 * q).min(64);
            for r in 0..R {
                // SAFETY: columns k0 + 64q .. + len are inside the row.
                prefetch_ahead(row[r], k0 + 64 * q);
                let raw = unsafe { load_bytes(row[r].add(k0 + 64 * q), len) };
                let w = if exponent_zero(raw, tail_mask64(len)) == 0 {
                    fast_classes(raw)
                } else {
                    let (odd, even) = exact_odd_even(raw);
                    classes_from_words(odd, even)
                };
                for t in 0..N {
                    let c = x.chunk(t0 + t, cb, q);
                    for (i, &wi) in w.iter().enumerate() {
                        // SAFETY: the packed chunk holds 64 f32.
                        let xv = unsafe { _mm512_load_ps(c.add(16 * i)) };
                        acc[r][t][i % 2] = _mm512_fmadd_ps(wi, xv, acc[r][t][i % 2]);
                    }
                }
            }
        }
        for r in 0..R {
            // (The decode's 2⁸ comes off once at the end: exact, being a power of two.)
            let s = _mm512_set1_ps(scales[r][cb]);
            for t in 0..N {
                total[r][t] = _mm512_fmadd_ps(_mm512_add_ps(acc[r][t][0], acc[r][t][1]), s, total[r][t]);
            }
        }
    }
    reduce(&total).map(|row| row.map(|v| v * UNBIAS))
}

// ---------------------------------------------------------------------------
// BF16 weights (BF16 checkpoints)

struct Bf16Dot<'a> {
    job: &'a Job<'a>,
    w: Bf16Rows,
    x: &'a Packed<u16>,
}

impl RowKernel for Bf16Dot<'_> {
    unsafe fn rows<const R: usize, const N: usize>(&self, rows: [usize; R], t0: usize) -> [[f32; N]; R] {
        // SAFETY: forwarded from the caller.
        unsafe { bf16_weights_dot::<R, N>(self.job, self.w, self.x, rows, t0) }
    }
}

/// # Safety
/// AVX512-BF16 present; rows in the view, tokens in range.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
unsafe fn bf16_weights_dot<const R: usize, const N: usize>(
    job: &Job,
    w: Bf16Rows,
    x: &Packed<u16>,
    rows: [usize; R],
    t0: usize,
) -> [[f32; N]; R] {
    // One chain whatever R and N, so that a row's order never depends on
    // the step (see `kernel::bands`). One, not two: a single token over
    // the BF16 `lm_head` takes eight rows a step (eight chains already),
    // and one chain keeps that hot step's code as it was.
    // SAFETY: the rows are in the view.
    let row: [*const u8; R] = rows.map(|r| unsafe { w.row(r) });
    let scales: [&[f32]; R] = rows.map(|r| job.scale_row(r));
    let mut total = [[_mm512_setzero_ps(); N]; R];
    for cb in 0..job.col_blocks {
        let (k0, width) = job.block_cols(cb);
        let mut acc = [[_mm512_setzero_ps(); N]; R];
        for q in 0..width.div_ceil(32) {
            let mask = tail_mask32(width - 32 * q);
            // SAFETY: the packed chunk holds 32 u16.
            let xv: [__m512bh; N] = array::from_fn(|t| bh(unsafe { _mm512_load_si512(x.chunk(t0 + t, cb, q).cast()) }));
            for r in 0..R {
                prefetch_ahead(row[r], 2 * (k0 + 32 * q));
                // SAFETY: masked lanes stay inside the block of this row.
                let wv = bh(unsafe { _mm512_maskz_loadu_epi16(mask, row[r].add(2 * (k0 + 32 * q)).cast()) });
                for t in 0..N {
                    acc[r][t] = _mm512_dpbf16_ps(acc[r][t], wv, xv[t]);
                }
            }
        }
        for r in 0..R {
            let s = _mm512_set1_ps(scales[r][cb]);
            for t in 0..N {
                total[r][t] = _mm512_fmadd_ps(acc[r][t], s, total[r][t]);
            }
        }
    }
    reduce(&total)
}

struct Bf16Fma<'a> {
    job: &'a Job<'a>,
    w: Bf16Rows,
    x: &'a Packed<f32>,
}

impl RowKernel for Bf16Fma<'_> {
    unsafe fn rows<const R: usize, const N: usize>(&self, rows: [usize; R], t0: usize) -> [[f32; N]; R] {
        // SAFETY: forwarded from the caller.
        unsafe { bf16_weights_fma::<R, N>(self.job, self.w, self.x, rows, t0) }
    }
}

/// # Safety
/// AVX-512 F/BW/VL present; rows in the view, tokens in range.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma")]
unsafe fn bf16_weights_fma<const R: usize, const N: usize>(
    job: &Job,
    w: Bf16Rows,
    x: &Packed<f32>,
    rows: [usize; R],
    t0: usize,
) -> [[f32; N]; R] {
    let high = _mm512_set1_epi32(0xffff_0000u32 as i32);
    // Two chains (even and odd columns) whatever R and N (fixed, as in `fused_bf16`).
    // SAFETY: the rows are in the view.
    let row: [*const u8; R] = rows.map(|r| unsafe { w.row(r) });
    let scales: [&[f32]; R] = rows.map(|r| job.scale_row(r));
    let mut total = [[_mm512_setzero_ps(); N]; R];
    for cb in 0..job.col_blocks {
        let (k0, width) = job.block_cols(cb);
        let mut acc = [[[_mm512_setzero_ps(); 2]; N]; R];
        for q in 0..width.div_ceil(32) {
            let mask = tail_mask32(width - 32 * q);
            for r in 0..R {
                prefetch_ahead(row[r], 2 * (k0 + 32 * q));
                // SAFETY: masked lanes stay inside the block of this row.
                let wv = unsafe { _mm512_maskz_loadu_epi16(mask, row[r].add(2 * (k0 + 32 * q)).cast()) };
                let even = _mm512_castsi512_ps(_mm512_slli_epi32::<16>(wv));
                let odd = _mm512_castsi512_ps(_mm512_and_si512(wv, high));
                for t in 0..N {
                    let c = x.chunk(t0 + t, cb, q);
                    // SAFETY: the packed chunk holds 32 f32 (even, then odd columns).
                    let (xe, xo) = unsafe { (_mm512_load_ps(c), _mm512_load_ps(c.add(16))) };
                    acc[r][t][0] = _mm512_fmadd_ps(even, xe, acc[r][t][0]);
                    acc[r][t][1] = _mm512_fmadd_ps(odd, xo, acc[r][t][1]);
                }
            }
        }
        for r in 0..R {
            let s = _mm512_set1_ps(scales[r][cb]);
            for t in 0..N {
                total[r][t] = _mm512_fmadd_ps(_mm512_add_ps(acc[r][t][0], acc[r][t][1]), s, total[r][t]);
            }
        }
    }
    reduce(&total)
}

// ---------------------------------------------------------------------------
// Entry points

/// `matmul_bf16` at the `Avx512Bf16` level.
///
/// # Safety
/// AVX512-BF16 present; shapes checked by the caller.
// (The features also let the activation packing inlined here vectorise.)
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
pub(super) unsafe fn run_bf16(job: &Job, rows: Range<usize>, x: &[u16], n: usize, out: &mut [f32]) {
    let (m, first, b1) = (rows.len(), rows.start, job.block[1]);
    let passes = n.div_ceil(PASS_TOKENS);
    if job.fp8 && passes == 1 {
        let x = Packed::new::<64, 2>(x, n, job.cols, b1, [1, 0], |v| v);
        let k = FusedBf16 { job, x: &x };
        // SAFETY: forwarded.
        unsafe { token_groups!(&k, rows, first, n, out, m, 8, {1 => 4, 2 => 4, 3 => 2, 4 => 2, 5 => 1, 6 => 1, 7 => 1, 8 => 1}) };
    } else if job.fp8 {
        // Several passes: each band is decoded once, in `fused_bf16`'s word
        // order, and every pass runs `fused_bf16`'s sums over it.
        let x = Packed::new::<64, 2>(x, n, job.cols, b1, [1, 0], |v| v);
        let stride = odd_even_stride(job);
        let mut buf = AlignedBuf::<u16>::zeroed(BAND_ROWS * stride);
        for band in bands(rows, passes) {
            // SAFETY: forwarded; the buffer holds BAND_ROWS rows of `stride` words, aligned.
            unsafe { decode_odd_even_tile(job, band.clone(), buf.as_mut_slice()) };
            let tile = OddEvenTile { base: buf.as_slice().as_ptr(), stride, first: band.start, lines: job.block[1].div_ceil(64) };
            let k = TileBf16 { job, tile, x: &x };
            // The band is in cache, so loads bound the kernel, not DRAM:
            // two rows × four tokens share each load more than one row ×
            // eight (which read a weight line per eight products but an
            // activation line per product), 1.3–1.4× as fast at 64 tokens
            // (`gemv_bandwidth`, FP8 n=64). Bits: see `kernel::bands`.
            // SAFETY: forwarded; the band's rows are in the tile.
            unsafe { token_groups!(&k, band, first, n, out, m, 4, {1 => 4, 2 => 4, 3 => 2, 4 => 2}) };
        }
    } else {
        let x = Packed::new::<32, 1>(x, n, job.cols, b1, [0], |v| v);
        let k = Bf16Dot { job, w: Bf16Rows::new(job), x: &x };
        for band in bands(rows, passes) {
            // Four read streams for a single token, however long the band:
            // eight (tried for the 134 MB `lm_head`) left a thread at ~0.75
            // of its read bandwidth on 2048 × 4096 and 4096 × 2048 BF16
            // matrices with 4 KiB pages, where four reach ~0.89 (the
            // `gemv_bandwidth` bench, n=1). Up to eight tokens read the
            // weights once, one row a step for eight; more take bands that
            // stay in cache across the passes, where four rows × four
            // tokens share each load best (1.4–2.2× one row × eight at
            // 64 tokens; three rows or two were slower).
            if passes == 1 {
                // SAFETY: forwarded.
                unsafe { token_groups!(&k, band, first, n, out, m, 8, {1 => 4, 2 => 4, 3 => 2, 4 => 2, 5 => 1, 6 => 1, 7 => 1, 8 => 1}) };
            } else {
                // SAFETY: forwarded.
                unsafe { token_groups!(&k, band, first, n, out, m, 4, {1 => 4, 2 => 4, 3 => 3, 4 => 4}) };
            }
        }
    }
}

/// The largest BF16 magnitude of `x`, as bits (BF16 magnitudes order like
/// integers): `0x7f80` and up is an infinity or a NaN.
fn top_bits(x: &[u16]) -> u16 {
    x.iter().fold(0u16, |a, &b| a.max(b & 0x7fff))
}

/// `matmul_bf16` at the `Avx512Fp16` level: FP8 weights take [`fused_fp16`]
/// (or [`short_rows_fp16`]) for any number of tokens; BF16 weights, and the
/// tokens whose activations hold a NaN or an infinity (which the BF16
/// kernels propagate as f32 arithmetic does), run the `Avx512Bf16` code.
///
/// Each token's activations are scaled into FP16's range on their own, and
/// a non-finite token is split off on its own, so that no token's result
/// depends on the others in the call (batch invariance, see
/// `kernel::bands`).
///
/// # Safety
/// AVX512-FP16 and AVX512-BF16 present; shapes checked by the caller.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16,avx512fp16")]
pub(super) unsafe fn run_fp16(job: &Job, rows: Range<usize>, x: &[u16], n: usize, out: &mut [f32]) {
    let (m, first, b1, cols) = (rows.len(), rows.start, job.block[1], job.cols);
    if !job.fp8 || (n == 1 && top_bits(x) >= 0x7f80) {
        // SAFETY: forwarded; this level implies the BF16 one.
        return unsafe { run_bf16(job, rows, x, n, out) };
    }
    if n > 1 && top_bits(x) >= 0x7f80 {
        // Rare (the model has already gone wrong): one token at a time.
        for (xt, ot) in x.chunks_exact(cols.max(1)).zip(out.chunks_exact_mut(m)) {
            // SAFETY: forwarded, for one token.
            unsafe { run_fp16(job, rows.clone(), xt, 1, ot) };
        }
        return;
    }
    FP16_ACTIVATIONS.with_borrow_mut(|last| {
        let same = last.as_ref().is_some_and(|p| p.cols == cols && p.block == b1 && p.x == x);
        if !same {
            let mut bits = last.take().map(|p| p.x).unwrap_or_default();
            bits.clear();
            bits.extend_from_slice(x);
            let mut packed = Packed::new::<64, 2>(x, n, cols, b1, [1, 0], |v| v);
            let mut post = Vec::with_capacity(n);
            for t in 0..n {
                let xt = &x[t * cols..(t + 1) * cols];
                // Scale the token's activations by 2⁻ˢ so that the largest
                // lies in [2¹⁰, 2¹¹): the FP16 sums then keep clear of
                // overflow (see `fused_fp16`) and the activations keep
                // FP16's full precision down to 2⁻²⁴ of the largest.
                // (Clamped so that both powers of two stay finite f32s.)
                let shift = (i32::from(top_bits(xt) >> 7) - 127 - 10).clamp(-127, 119);
                bf16_to_fp16_scaled(packed.token_mut(t), 2f32.powi(-shift));
                post.push(2f32.powi(8 + shift));
            }
            *last = Some(Fp16Activations { x: bits, cols, block: b1, packed, post });
        }
        let p = last.as_ref().expect("packed above");
        if job.col_blocks == 1 && cols <= 128 {
            for (t, ot) in out.chunks_exact_mut(m).enumerate() {
                // SAFETY: forwarded; one block of at most 128 columns.
                unsafe { short_rows_fp16(job, &p.packed, t, rows.clone(), p.post[t], ot) };
            }
            return;
        }
        let k = FusedFp16 { job, x: &p.packed, post: &p.post };
        for band in bands(rows, n.div_ceil(PASS_TOKENS)) {
            // A single token over a long band takes eight rows (eight read
            // streams) per step: with the FP16 kernel's slack over DRAM,
            // that moved ~10% more bytes per second than four on the V3
            // shapes of `duplex bench-kernels`. Short streams do not pay for
            // the prefetchers' ramp-up (the 128-row tiles of small experts
            // ran slower), so a band needs 64 KiB per stream.
            // SAFETY (both): forwarded.
            if band.len() * cols >= 8 << 16 {
                unsafe { token_groups!(&k, band, first, n, out, m, 8, {1 => 8, 2 => 4, 3 => 2, 4 => 2, 5 => 1, 6 => 1, 7 => 1, 8 => 1}) };
            } else {
                unsafe { token_groups!(&k, band, first, n, out, m, 8, {1 => 4, 2 => 4, 3 => 2, 4 => 2, 5 => 1, 6 => 1, 7 => 1, 8 => 1}) };
            }
        }
    });
}

/// Activations as [`fused_fp16`] takes them, with what they were made from.
struct Fp16Activations {
    /// The BF16 activations (all tokens).
    x: Vec<u16>,
    cols: usize,
    block: usize,
    packed: Packed<u16>,
    /// Per token, the factor undoing its scaling and the decode's 2⁻⁸.
    post: Vec<f32>,
}

thread_local! {
    /// The last activations this thread packed for [`fused_fp16`]. Calls
    /// in a row often share them: a split GEMV's row tiles, and an expert's
    /// gate and up projections and all its tiles. Packing and converting
    /// 7168 of them took ~6% of a 128-row tile with its weights in cache, so
    /// a call whose activations equal the last ones (compared in full, which
    /// is far cheaper) reuses them.
    static FP16_ACTIVATIONS: std::cell::RefCell<Option<Fp16Activations>> = const { std::cell::RefCell::new(None) };
}

/// `matmul_bf16` at the `Avx512` level.
///
/// # Safety
/// AVX-512 F/BW/VL present; shapes checked by the caller.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma")]
pub(super) unsafe fn run_f32(job: &Job, rows: Range<usize>, x: &[u16], n: usize, out: &mut [f32]) {
    let (m, first, b1) = (rows.len(), rows.start, job.block[1]);
    let passes = n.div_ceil(PASS_TOKENS);
    if job.fp8 {
        let x = Packed::new::<64, 4>(x, n, job.cols, b1, C4_ORDER, bf16_to_f32);
        let k = FusedF32 { job, x: &x };
        for band in bands(rows, passes) {
            // SAFETY: forwarded.
            unsafe { token_groups!(&k, band, first, n, out, m, 8, {1 => 4, 2 => 4, 3 => 2, 4 => 2, 5 => 1, 6 => 1, 7 => 1, 8 => 1}) };
        }
    } else {
        let x = Packed::new::<32, 2>(x, n, job.cols, b1, [0, 1], bf16_to_f32);
        let k = Bf16Fma { job, w: Bf16Rows::new(job), x: &x };
        for band in bands(rows, passes) {
            // SAFETY: forwarded.
            unsafe { token_groups!(&k, band, first, n, out, m, 8, {1 => 4, 2 => 4, 3 => 2, 4 => 2, 5 => 1, 6 => 1, 7 => 1, 8 => 1}) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::isa::{self, Isa};

    /// Every decoder against the scalar table, for all 256 codes: the fast
    /// one for nonzero exponents, the exact fallback and the FP16 decode for
    /// all (NaN as ±480).
    #[test]
    fn decoders_agree_with_the_table() {
        if isa::hardware() < Isa::Avx512 {
            return;
        }
        let bytes: Vec<u8> = (0..=255u8).collect();
        // SAFETY: AVX-512 checked above.
        unsafe { check_decoders(&bytes) };
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    unsafe fn check_decoders(bytes: &[u8]) {
        let table = |c: u8| crate::fp8::E4M3_TABLE[c as usize] * 256.0;
        // The fused kernels' reading of a code: NaN codes are ±480.
        let fused = |c: u8| if c & 0x7f == 0x7f { 480.0 * 256.0 * if c & 0x80 != 0 { -1.0 } else { 1.0 } } else { table(c) };
        let words = |v: __m512i| {
            let mut out = [0u16; 32];
            // SAFETY: 64 writable bytes.
            unsafe { _mm512_storeu_si512(out.as_mut_ptr().cast(), v) };
            out
        };
        let store16 = |v: __m512i| words(v).map(bf16_to_f32);
        for chunk in bytes.chunks(64) {
            // SAFETY: 64 readable bytes.
            let raw = unsafe { _mm512_loadu_si512(chunk.as_ptr().cast()) };
            let (fo, fe) = fast_odd_even(raw);
            let (ho, he) = fp16_odd_even(raw);
            let fp16 = [ho, he].map(|v| words(v).map(|b| half::f16::from_bits(b).to_f32()));
            let (xo, xe) = exact_odd_even(raw);
            let (fast, exact) = ([store16(fo), store16(fe)], [store16(xo), store16(xe)]);
            let mut classes = [[0f32; 16]; 4];
            for (dst, v) in classes.iter_mut().zip(fast_classes(raw)) {
                // SAFETY: 16 writable f32.
                unsafe { _mm512_storeu_ps(dst.as_mut_ptr(), v) };
            }
            for (j, &c) in chunk.iter().enumerate() {
                let half = 1 - j % 2; // odd bytes come first
                assert_eq!(exact[half][j / 2], fused(c), "exact {c:#04x}");
                // FP16 is × 2⁻⁸ where the BF16 decodes are × 2⁸.
                assert_eq!(fp16[half][j / 2] * 65536.0, fused(c), "fp16 {c:#04x}");
                if c & 0x78 != 0 {
                    assert_eq!(fast[half][j / 2], fused(c), "fast {c:#04x}");
                    let class = C4_ORDER.iter().position(|&k| k == j % 4).unwrap();
                    assert_eq!(classes[class][j / 4], fused(c), "class {c:#04x}");
                }
            }
        }
    }

    #[test]
    fn sum16_sums_each_vector() {
        if !std::arch::is_x86_feature_detected!("avx512f") {
            return;
        }
        let v: Vec<f32> = (0..256).map(|i| ((i * 37) % 101) as f32 - 50.0).collect();
        // SAFETY: AVX-512 F is present; `v` holds 16 vectors.
        let got = unsafe {
            let vs: [__m512; 16] = array::from_fn(|k| _mm512_loadu_ps(v.as_ptr().add(16 * k)));
            let mut out = [0.0f32; 16];
            _mm512_storeu_ps(out.as_mut_ptr(), sum16(vs));
            out
        };
        for k in 0..16 {
            assert_eq!(got[k], v[16 * k..16 * k + 16].iter().sum::<f32>(), "vector {k}");
        }
    }
}
