//! The scalar reference dot products: plain integer arithmetic per block,
//! then the shared f32 fold. Every SIMD path must return exactly these bits.
//!
//! Per k-quant block the integer sums are ggml's (see `fold_k`): Σ scale ×
//! q·y, and for Q4_K/Q5_K the minimum term Σ min × (sum of the sub-block's
//! activations) taken from Q8_K's `bsums`. No i32 overflows: the largest,
//! Q6_K's, is at most 256 elements × 128 × 63 × 127 less an offset of at
//! most 32 × 16 × 128 × 16 × 127, < 2²⁹.

use super::blocks::{half_at, q5_0_quant, q5_1_quant, k_scales_mins, q4k_quant, q5k_quant, q6k_quant, BlockQ8K, BlockQ8_0, BlockQ8_1, QuantKind, K_SCALES, Q4K_QS, Q5K_QH, Q5K_QS, Q6K_D, Q6K_SCALES};
use super::{fold_32, fold_k, fold_q5_1, QK_K};

/// A Q4_K/Q5_K block's minimum term: Σ over sub-blocks g of min g × the
/// sum of its 32 activations (`bsums[2g] + bsums[2g + 1]`).
#[inline(always)]
fn k_min_term(mins: &[u8; 8], bsums: &[i16; 16]) -> i32 {
    (0..8).map(|g| mins[g] as i32 * (bsums[2 * g] as i32 + bsums[2 * g + 1] as i32)).sum()
}

/// A row of Q4_K (`FIVE = false`) or Q5_K (`FIVE = true`) against Q8_K.
pub(super) fn dot_q45k<const FIVE: bool>(row: &[u8], y: &[BlockQ8K]) -> f32 {
    let bb = if FIVE { QuantKind::Q5K } else { QuantKind::Q4K }.block_bytes();
    let mut acc = 0.0f32;
    for (b, yb) in row.chunks_exact(bb).zip(y) {
        let (sc, mn) = k_scales_mins(&b[K_SCALES..K_SCALES + 12]);
        let mut sumi = 0i32;
        for e in 0..QK_K {
            let q = if FIVE { q5k_quant(&b[Q5K_QH..], &b[Q5K_QS..], e) } else { q4k_quant(&b[Q4K_QS..], e) };
            sumi += sc[e / 32] as i32 * q as i32 * yb.qs[e] as i32;
        }
        acc = fold_k(acc, half_at(b, 0) * yb.d, sumi, half_at(b, 2) * yb.d, k_min_term(&mn, &yb.bsums));
    }
    acc
}

/// A Q6_K row against Q8_K. The quants are taken unsigned (0..64), as the
/// SIMD paths do, and the `- 32` comes off as 32 × Σ scale × the 16-element
/// sub-block's activation sum (`bsums`).
pub(super) fn dot_q6k(row: &[u8], y: &[BlockQ8K]) -> f32 {
    let mut acc = 0.0f32;
    for (b, yb) in row.chunks_exact(QuantKind::Q6K.block_bytes()).zip(y) {
        let sc = |s: usize| (b[Q6K_SCALES + s] as i8) as i32;
        let mut sumi: i32 = -32 * (0..16).map(|s| sc(s) * yb.bsums[s] as i32).sum::<i32>();
        for e in 0..QK_K {
            sumi += sc(e / 16) * q6k_quant(b, e) as i32 * yb.qs[e] as i32;
        }
        acc = fold_k(acc, half_at(b, Q6K_D) * yb.d, sumi, 0.0, 0);
    }
    acc
}

/// A Q8_0 row against Q8_0.
pub(super) fn dot_q8_0(row: &[u8], y: &[BlockQ8_0]) -> f32 {
    let mut acc = 0.0f32;
    for (b, yb) in row.chunks_exact(QuantKind::Q8_0.block_bytes()).zip(y) {
        let sumi: i32 = (0..32).map(|j| (b[2 + j] as i8) as i32 * yb.qs[j] as i32).sum();
        acc = fold_32(acc, half_at(b, 0), yb.d.to_f32(), sumi);
    }
    acc
}

/// A Q4_0 row against Q8_0.
pub(super) fn dot_q4_0(row: &[u8], y: &[BlockQ8_0]) -> f32 {
    let mut acc = 0.0f32;
    for (b, yb) in row.chunks_exact(QuantKind::Q4_0.block_bytes()).zip(y) {
        let sumi: i32 = (0..16)
            .map(|j| {
                let q = b[2 + j];
                ((q & 15) as i32 - 8) * yb.qs[j] as i32 + ((q >> 4) as i32 - 8) * yb.qs[j + 16] as i32
            })
            .sum();
        acc = fold_32(acc, half_at(b, 0), yb.d.to_f32(), sumi);
    }
    acc
}

/// A Q5_0 row against Q8_0.
pub(super) fn dot_q5_0(row: &[u8], y: &[BlockQ8_0]) -> f32 {
    let mut acc = 0.0f32;
    for (b, yb) in row.chunks_exact(QuantKind::Q5_0.block_bytes()).zip(y) {
        let sumi: i32 = (0..32).map(|j| (q5_0_quant(b, j) as i32 - 16) * yb.qs[j] as i32).sum();
        acc = fold_32(acc, half_at(b, 0), yb.d.to_f32(), sumi);
    }
    acc
}

/// A Q5_1 row against Q8_1: the quants as stored (0..32) and the `m` term
/// from the activations' sum.
pub(super) fn dot_q5_1(row: &[u8], y: &[BlockQ8_1]) -> f32 {
    let mut acc = 0.0f32;
    for (b, yb) in row.chunks_exact(QuantKind::Q5_1.block_bytes()).zip(y) {
        let sumi: i32 = (0..32).map(|j| q5_1_quant(b, j) as i32 * yb.qs[j] as i32).sum();
        acc = fold_q5_1(acc, half_at(b, 0), yb.d.to_f32(), sumi, half_at(b, 2), yb.s);
    }
    acc
}
