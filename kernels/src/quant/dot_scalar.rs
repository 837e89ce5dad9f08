//! The scalar reference dot products: plain integer arithmetic per block,
//! then the shared f32 fold. Every SIMD path must return exactly these bits.
//!
//! Per k-quant block the integer sums are ggml's: Σ over sub-blocks of
//! scale × Σ q·y, and for Q4_K/Q5_K the minimum term Σ min × (sum of the
//! sub-block's activations) taken from Q8_K's `bsums`. No i32 overflows: the
//! largest, Q6_K's, is at most 16 sub-blocks × 128 × 16 × 32 × 127 < 2²⁸.

use super::blocks::{half_at, q5_0_quant, k_scales_mins, q4k_quant, q5k_quant, q6k_quant, BlockQ8K, BlockQ8_0, QuantKind, K_SCALES, Q4K_QS, Q5K_QH, Q5K_QS, Q6K_D, Q6K_SCALES};
use super::{fold_32, fold_k};

/// The minimum term of a Q4_K/Q5_K block: Σ over the eight 32-element
/// sub-blocks of min × (sum of its activations), from the 16-wide `bsums`.
#[inline(always)]
pub(super) fn k_min_term(mins: &[u8; 8], bsums: &[i16; 16]) -> i32 {
    (0..16).map(|j| bsums[j] as i32 * mins[j / 2] as i32).sum()
}

/// A row of Q4_K (`FIVE = false`) or Q5_K (`FIVE = true`) against Q8_K.
pub(super) fn dot_q45k<const FIVE: bool>(row: &[u8], y: &[BlockQ8K]) -> f32 {
    let bb = if FIVE { QuantKind::Q5K } else { QuantKind::Q4K }.block_bytes();
    let mut acc = 0.0f32;
    for (b, yb) in row.chunks_exact(bb).zip(y) {
        let (sc, mn) = k_scales_mins(&b[K_SCALES..K_SCALES + 12]);
        let mut sumi = 0i32;
        for (s, &scale) in sc.iter().enumerate() {
            let mut sub = 0i32;
            for e in 32 * s..32 * s + 32 {
                let q = if FIVE { q5k_quant(&b[Q5K_QH..], &b[Q5K_QS..], e) } else { q4k_quant(&b[Q4K_QS..], e) };
                sub += q as i32 * yb.qs[e] as i32;
            }
            sumi += scale as i32 * sub;
        }
        acc = fold_k(acc, half_at(b, 0) * yb.d, sumi, half_at(b, 2) * yb.d, k_min_term(&mn, &yb.bsums));
    }
    acc
}

/// A Q6_K row against Q8_K.
pub(super) fn dot_q6k(row: &[u8], y: &[BlockQ8K]) -> f32 {
    let mut acc = 0.0f32;
    for (b, yb) in row.chunks_exact(QuantKind::Q6K.block_bytes()).zip(y) {
        let mut sumi = 0i32;
        for s in 0..16 {
            let mut sub = 0i32;
            for e in 16 * s..16 * s + 16 {
                sub += (q6k_quant(b, e) as i32 - 32) * yb.qs[e] as i32;
            }
            sumi += (b[Q6K_SCALES + s] as i8) as i32 * sub;
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
