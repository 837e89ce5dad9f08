//! The prefill GEMM of the k-quants (Q4_K, Q5_K, Q6_K) on AMX INT8 tiles:
//! sixteen weight rows against sixteen tokens per product.
//!
//! The operands are the AVX-512 GEMM's (`klanes`), unbiased:
//! [`KRows`] holds each row's quants as bytes in element order, so a tile of
//! sixteen rows × one sub-block (A: 16 × 32 bytes, Q6_K's 16 × 16) loads
//! straight from it with the band's row stride, and [`KLanes`] holds the
//! tokens transposed, a quad of four elements of sixteen tokens a 64-byte
//! row, which is a B tile as it lies. `tdpbssd` then leaves each row and
//! token's sub-block sum (quants 0..64 are signed bytes too) in C.
//!
//! A tile's sums cover whole sub-blocks, and each sub-block has its own
//! scale per row, so every sub-block is a product of its own, weighed by
//! its scale on the way into the block's integer sum; that sum, the
//! minimum term (Q4_K, Q5_K) or the offset (Q6_K) from the tokens'
//! activation sums, and `fold_k` are the reference's, so every product has
//! the bits of the one-token kernels and of the scalar reference. The
//! kernel is written over [`Tiles`], so the model runs it on any CPU, and
//! the arithmetic around the products has two forms ([`Around`]): plain
//! Rust, and the AVX-512 that the hardware tiles take, which the tests
//! also run on the model.

use super::blocks::QK_K;
use super::fold_k;
use super::klanes::{KLanes, KRows, LANES};
use super::tiles_amx::{words_as_bytes, BlockSums, TILE};
use crate::cpu::amx::{TileConfig, Tiles};
use std::arch::x86_64::*;

const _: () = assert!(LANES == TILE);

/// The registers: C (16 × 16 i32), A (rows × a sub-block), B (its quads).
const C: u8 = 0;
const A: u8 = 1;
const B: u8 = 2;

/// The two i16 of a word, low first, as i32.
#[inline(always)]
fn halves(w: u32) -> (i32, i32) {
    (w as u16 as i16 as i32, (w >> 16) as u16 as i16 as i32)
}

/// The arithmetic around the tile products, for a panel of sixteen rows
/// and a group of sixteen tokens: each sub-block's sums weighed by the
/// rows' scales into the block's integer sums, and each block's fold. Two
/// forms with the same operations in the same order: plain Rust (the
/// model's, on any CPU) and AVX-512 (the hardware's: a row's sixteen
/// tokens in one register, the block's sums kept in registers).
///
/// `at[n]` is panel row n's block index into [`KRows`]' per-block fields
/// (a short panel's missing rows repeat its last: their results are
/// dropped).
trait Around {
    /// A block's integer sums, one entry per row, a token per lane.
    type Ints;
    /// The panel's f32 sums, likewise.
    type Acc;
    /// # Safety (every method)
    /// The CPU has the form's features; `at` names blocks of `w`'s rows.
    unsafe fn ints() -> Self::Ints;
    unsafe fn acc() -> Self::Acc;
    /// `ints[n] += part[n] × row n's scale of sub-block s`.
    unsafe fn weigh(ints: &mut Self::Ints, part: &BlockSums, w: &KRows, s: usize, at: &[usize; TILE]);
    /// Fold block b's integer sums, with its minimum term or offset.
    unsafe fn fold(acc: &mut Self::Acc, ints: &Self::Ints, w: &KRows, y: &KLanes, b: usize, at: &[usize; TILE]);
    /// The first `out.len()` rows' sums.
    unsafe fn store(acc: &Self::Acc, out: &mut [[f32; TILE]]);
}

/// [`Around`] in plain Rust.
struct Portable;

impl Around for Portable {
    type Ints = [[i32; TILE]; TILE];
    type Acc = [[f32; TILE]; TILE];

    #[inline(always)]
    unsafe fn ints() -> Self::Ints {
        [[0; TILE]; TILE]
    }

    #[inline(always)]
    unsafe fn acc() -> Self::Acc {
        [[0.0; TILE]; TILE]
    }

    #[inline(always)]
    unsafe fn weigh(ints: &mut Self::Ints, part: &BlockSums, w: &KRows, s: usize, at: &[usize; TILE]) {
        for ((ints, part), &i) in ints.iter_mut().zip(&part.0).zip(at) {
            let scale = w.scales[i * 16 + s];
            *ints = std::array::from_fn(|t| ints[t] + scale * part[t]);
        }
    }

    #[inline(always)]
    unsafe fn fold(acc: &mut Self::Acc, ints: &Self::Ints, w: &KRows, y: &KLanes, b: usize, at: &[usize; TILE]) {
        for ((acc, sumi), &i) in acc.iter_mut().zip(ints).zip(at) {
            let pairs = &w.pairs[i * 8..(i + 1) * 8];
            for t in 0..TILE {
                let dy = y.d[b * TILE + t];
                // Q6_K: the offset (-32 × scale × bsums) joins the integer
                // sum; Q4_K/Q5_K: Σ min × the 32-element sums is the
                // minimum term. Exact either way, as in the reference.
                let term = |sums: &[u32], count: usize| -> i32 {
                    (0..count)
                        .map(|h| {
                            let ((w0, w1), (s0, s1)) = (halves(pairs[h]), halves(sums[(b * count + h) * TILE + t]));
                            w0 * s0 + w1 * s1
                        })
                        .sum()
                };
                acc[t] = if w.six {
                    fold_k(acc[t], w.d[i] * dy, sumi[t] + term(&y.sums16, 8), 0.0, 0)
                } else {
                    fold_k(acc[t], w.d[i] * dy, sumi[t], w.dmin[i] * dy, term(&y.sums32, 4))
                };
            }
        }
    }

    #[inline(always)]
    unsafe fn store(acc: &Self::Acc, out: &mut [[f32; TILE]]) {
        let rows = out.len();
        out.copy_from_slice(&acc[..rows]);
    }
}

/// [`Around`] on AVX-512 (F, BW, VL, VNNI), as `gemm_k`'s lanes do it.
struct Avx512;

impl Around for Avx512 {
    type Ints = [__m512i; TILE];
    type Acc = [__m512; TILE];

    #[inline(always)]
    unsafe fn ints() -> Self::Ints {
        [_mm512_setzero_si512(); TILE]
    }

    #[inline(always)]
    unsafe fn acc() -> Self::Acc {
        [_mm512_setzero_ps(); TILE]
    }

    #[inline(always)]
    unsafe fn weigh(ints: &mut Self::Ints, part: &BlockSums, w: &KRows, s: usize, at: &[usize; TILE]) {
        for ((ints, part), &i) in ints.iter_mut().zip(&part.0).zip(at) {
            // SAFETY: a 64-byte row of the aligned stored tile.
            let part = unsafe { _mm512_load_si512(part.as_ptr().cast()) };
            // SAFETY: `at` holds the panel's rows' blocks, each with 16 scales.
            let scale = unsafe { *w.scales.get_unchecked(i * 16 + s) };
            *ints = _mm512_add_epi32(*ints, _mm512_mullo_epi32(part, _mm512_set1_epi32(scale)));
        }
    }

    #[inline(always)]
    unsafe fn fold(acc: &mut Self::Acc, ints: &Self::Ints, w: &KRows, y: &KLanes, b: usize, at: &[usize; TILE]) {
        // Plain loops, no closures: a closure around an intrinsic is left
        // out of line, and each call then goes through memory.
        let (count, sums) = if w.six { (8, &y.sums16) } else { (4, &y.sums32) };
        let sums = &sums[b * count * TILE..(b + 1) * count * TILE];
        // SAFETY (loads): sixteen f32 of block b's scales, in range.
        let dy = unsafe { _mm512_loadu_ps(y.d[b * TILE..(b + 1) * TILE].as_ptr()) };
        for ((acc, &sumi), &i) in acc.iter_mut().zip(ints).zip(at) {
            let pairs = &w.pairs[i * 8..i * 8 + count];
            // Q6_K: the offset joins the integer sum; Q4_K/Q5_K: the
            // minimum term. The saturating `vpdpwssds` (LLVM splits
            // `vpdpwssd` in two); these sums are far from saturating.
            let mut term = if w.six { sumi } else { _mm512_setzero_si512() };
            for (h, &pair) in pairs.iter().enumerate() {
                // SAFETY: sixteen words of the block's sums, in range.
                let lanes = unsafe { _mm512_loadu_si512(sums[h * TILE..(h + 1) * TILE].as_ptr().cast()) };
                term = _mm512_dpwssds_epi32(term, lanes, _mm512_set1_epi32(pair as i32));
            }
            let dyd = _mm512_mul_ps(_mm512_set1_ps(w.d[i]), dy);
            if w.six {
                // `fold_k`'s `- 0 × 0` leaves every f32 as it is (as in `rows_k`).
                *acc = _mm512_add_ps(*acc, _mm512_mul_ps(dyd, _mm512_cvtepi32_ps(term)));
            } else {
                let dmin = _mm512_mul_ps(_mm512_set1_ps(w.dmin[i]), dy);
                let plus = _mm512_add_ps(*acc, _mm512_mul_ps(dyd, _mm512_cvtepi32_ps(sumi)));
                *acc = _mm512_sub_ps(plus, _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(term)));
            }
        }
    }

    #[inline(always)]
    unsafe fn store(acc: &Self::Acc, out: &mut [[f32; TILE]]) {
        for (o, &a) in out.iter_mut().zip(acc) {
            // SAFETY: sixteen writable f32.
            unsafe { _mm512_storeu_ps(o.as_mut_ptr(), a) };
        }
    }
}

/// `out[r][t]` = row r of `w` · token t of `y` for every row, with the
/// one-token kernels' bits (lanes past the tokens hold products with zero
/// tokens), the arithmetic around the products as `F` does it. `y` must
/// be filled unbiased.
///
/// # Safety
/// The CPU has `F`'s features.
#[inline(always)]
unsafe fn gemm_k<T: Tiles, F: Around>(tiles: &mut T, w: &KRows, y: &KLanes, out: &mut [[f32; TILE]]) {
    assert_eq!(w.blocks, y.blocks, "gemm_k tiles: rows and tokens of one width");
    assert!(out.len() >= w.rows, "gemm_k tiles: an output per row");
    assert!(w.scales.len() >= w.rows * w.blocks * 16 && w.pairs.len() >= w.rows * w.blocks * 8, "gemm_k tiles: whole unpacked rows");
    let (blocks, sub) = (w.blocks, if w.six { 16 } else { 32 });
    let mut sums = BlockSums::default();
    let mut configured = 0;
    for p0 in (0..w.rows).step_by(TILE) {
        let rows = TILE.min(w.rows - p0);
        if rows != configured {
            // The last panel may be short: its A and C tiles are too.
            tiles.configure(&TileConfig::new().with(C, rows, 4 * TILE).with(A, rows, sub).with(B, sub / 4, 4 * TILE));
            configured = rows;
        }
        // SAFETY (the `F` calls): the caller's CPU has `F`'s features.
        let mut acc = unsafe { F::acc() };
        for b in 0..blocks {
            let at: [usize; TILE] = std::array::from_fn(|n| (p0 + n.min(rows - 1)) * blocks + b);
            let mut ints = unsafe { F::ints() };
            for s in 0..QK_K / sub {
                tiles.zero::<C>();
                tiles.load::<A>(&w.q[(p0 * blocks + b) * QK_K + s * sub..], blocks * QK_K);
                let quads = (b * QK_K + s * sub) / 4 * TILE;
                tiles.load::<B>(words_as_bytes(&y.q[quads..quads + sub / 4 * TILE]), 4 * TILE);
                tiles.dot_i8::<C, A, B>();
                tiles.store::<C>(sums.bytes_mut(), 4 * TILE);
                unsafe { F::weigh(&mut ints, &sums, w, s, &at) };
            }
            unsafe { F::fold(&mut acc, &ints, w, y, b, &at) };
        }
        unsafe { F::store(&acc, &mut out[p0..p0 + rows]) };
    }
    tiles.release();
}

/// [`gemm_k`] with its arithmetic in plain Rust, on any CPU (the model).
pub(super) fn gemm_k_portable<T: Tiles>(tiles: &mut T, w: &KRows, y: &KLanes, out: &mut [[f32; TILE]]) {
    // SAFETY: plain Rust needs no features.
    unsafe { gemm_k::<T, Portable>(tiles, w, y, out) }
}

/// [`gemm_k`] with its arithmetic on AVX-512: the CPU's tiles run it, and
/// the tests run it on the model too.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
pub(super) fn gemm_k_avx512<T: Tiles>(tiles: &mut T, w: &KRows, y: &KLanes, out: &mut [[f32; TILE]]) {
    // SAFETY: this function's features are `Avx512`'s.
    unsafe { gemm_k::<T, Avx512>(tiles, w, y, out) }
}

