//! The prefill GEMM of the k-quants (Q4_K, Q5_K, Q6_K) on AVX-512 VNNI,
//! sixteen tokens at once, one per i32 lane.
//!
//! The one-token kernels (`dot_q45k_multi`, `dot_q6k_multi`) spend more of
//! their instructions weighing each group of four products by its
//! sub-block's scale and summing lanes than multiplying. Here a band's rows
//! are unpacked once ([`KRows`]: each quant a byte) and the tokens are
//! transposed ([`KLanes`]): one vector holds the same four elements of
//! sixteen tokens, so `vpdpbusd` against four weight bytes broadcast to
//! every lane adds those elements' products to each token's own lane. A
//! sub-block's eight such steps (Q6_K's: four) leave each token's
//! sub-block sum in its lane, weighed by its scale with one `vpmulld`; the
//! block's integer sums are then the reference's exactly (integer sums do
//! not depend on their order), and `fold_k`'s f32 operations on sixteen
//! lanes give every token the one-token kernels' bits.
//!
//! `vpdpbusd` broadcasts only its signed operand, so the weights are the
//! signed bytes (quants 0..64 fit) and the activations are stored biased
//! (y + 128, unsigned): Σ (y + 128)·q = Σ y·q + 128·Σ q, and each row
//! block's 128 × Σ scale × Σ q is taken off at the end. Bounds: a sub-block
//! sum is at most 32 × 255 × 63 (Q5_K: 31), times a scale of at most 128
//! in magnitude; a block's sum below 2²⁹: inside i32.

use super::klanes::{KLanes, KRows, LANES, QUADS};
use super::QK_K;
use std::arch::x86_64::*;

/// Every unpacked row against a group of tokens: `out[r][t]` is row r's
/// product with token t, with the one-token kernels' bits.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,f16c")]
pub(super) fn gemm_k(w: &KRows, y: &KLanes, out: &mut [[f32; LANES]]) {
    assert_eq!(w.blocks, y.blocks, "gemm_k: rows and tokens of one width");
    assert!(out.len() >= w.rows, "gemm_k: an output per row");
    let mut r = 0;
    while r + ROWS <= w.rows {
        if w.six {
            rows_k::<ROWS, true>(w, r, y, &mut out[r..r + ROWS]);
        } else {
            rows_k::<ROWS, false>(w, r, y, &mut out[r..r + ROWS]);
        }
        r += ROWS;
    }
    for r in r..w.rows {
        if w.six {
            rows_k::<1, true>(w, r, y, &mut out[r..r + 1]);
        } else {
            rows_k::<1, false>(w, r, y, &mut out[r..r + 1]);
        }
    }
}

/// Rows taken together by [`rows_k`]: each activation load serves all of
/// them, and two sub-blocks' accumulators per row still fit the registers
/// beside the rows' sums.
const ROWS: usize = 4;

/// Rows `r0..r0 + R` against the group, every block (`SIX`: Q6_K, sixteen
/// sub-blocks of sixteen, an integer offset term and no minimum term).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,f16c")]
fn rows_k<const R: usize, const SIX: bool>(w: &KRows, r0: usize, y: &KLanes, out: &mut [[f32; LANES]]) {
    // Quads per sub-block.
    let per = if SIX { 4 } else { 8 };
    let mut acc = [_mm512_setzero_ps(); R];
    for b in 0..w.blocks {
        let at: [usize; R] = std::array::from_fn(|r| (r0 + r) * w.blocks + b);
        assert!(at[R - 1] < w.d.len() && b < y.blocks, "rows_k: rows and block in range");
        let yq = y.q[b * QUADS * LANES..(b + 1) * QUADS * LANES].as_ptr();
        let wq: [*const u8; R] = at.map(|i| w.q[i * QK_K..(i + 1) * QK_K].as_ptr());
        let sc: [*const i32; R] = at.map(|i| w.scales[i * 16..(i + 1) * 16].as_ptr());
        let mut sumi = at.map(|i| _mm512_set1_epi32(-w.bias[i]));
        // Two sub-blocks at a time, so that each row has two chains of
        // `vpdpbusd` in flight.
        for s in (0..QUADS / per).step_by(2) {
            let mut parts = [[_mm512_setzero_si512(); R]; 2];
            for (h, part) in parts.iter_mut().enumerate() {
                for k in 0..per {
                    let quad = (s + h) * per + k;
                    // SAFETY: quad < 64: 16 readable words of the block's
                    // quad, and 4 readable quant bytes of each row's block
                    // (one unaligned word).
                    let ys = unsafe { _mm512_loadu_si512(yq.add(quad * LANES).cast()) };
                    for r in 0..R {
                        let x = unsafe { wq[r].add(4 * quad).cast::<i32>().read_unaligned() };
                        part[r] = _mm512_dpbusd_epi32(part[r], ys, _mm512_set1_epi32(x));
                    }
                }
            }
            for (h, part) in parts.iter().enumerate() {
                for r in 0..R {
                    // SAFETY: sub-block s + h < 16 of the row's scales.
                    let scale = unsafe { _mm512_set1_epi32(*sc[r].add(s + h)) };
                    sumi[r] = _mm512_add_epi32(sumi[r], _mm512_mullo_epi32(part[r], scale));
                }
            }
        }
        // SAFETY (loads below): 16 f32 / words of the block's scales and
        // sums (b < y.blocks); unaligned.
        let dy = unsafe { _mm512_loadu_ps(y.d.as_ptr().add(b * LANES)) };
        for r in 0..R {
            let pair = |h: usize| _mm512_set1_epi32(w.pairs[at[r] * 8 + h] as i32);
            let dyd = _mm512_mul_ps(_mm512_set1_ps(w.d[at[r]]), dy);
            if SIX {
                // The offset joins the integer sum; `fold_k`'s `- 0 × 0`
                // leaves every f32 as it is.
                for h in 0..8 {
                    let sums = unsafe { _mm512_loadu_si512(y.sums16.as_ptr().add((b * 8 + h) * LANES).cast()) };
                    sumi[r] = _mm512_dpwssd_epi32(sumi[r], sums, pair(h));
                }
                acc[r] = _mm512_add_ps(acc[r], _mm512_mul_ps(dyd, _mm512_cvtepi32_ps(sumi[r])));
            } else {
                let mut summ = _mm512_setzero_si512();
                for h in 0..4 {
                    let sums = unsafe { _mm512_loadu_si512(y.sums32.as_ptr().add((b * 4 + h) * LANES).cast()) };
                    summ = _mm512_dpwssd_epi32(summ, sums, pair(h));
                }
                let dmin = _mm512_mul_ps(_mm512_set1_ps(w.dmin[at[r]]), dy);
                let plus = _mm512_add_ps(acc[r], _mm512_mul_ps(dyd, _mm512_cvtepi32_ps(sumi[r])));
                acc[r] = _mm512_sub_ps(plus, _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(summ)));
            }
        }
    }
    for (o, a) in out.iter_mut().zip(acc) {
        // SAFETY: 16 writable f32; unaligned store.
        unsafe { _mm512_storeu_ps(o.as_mut_ptr(), a) };
    }
}

