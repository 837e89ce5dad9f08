//! The prefill GEMM of the 32-element formats (Q8_0, Q4_0, Q5_0) on
//! AVX-512 VNNI, sixteen tokens at once, one per i32 lane.
//!
//! A row's product with one token (`gemv_32`) spends most of its time
//! gathering each block's integer lanes into one sum. Here the tokens are
//! transposed instead ([`Lanes32`]): one vector holds the same four
//! elements of sixteen tokens, so `vpdpbusd` against four weight bytes
//! broadcast to every lane adds those elements' products to each token's
//! own lane, and a block's eight such steps leave each token's block sum in
//! its lane, with nothing to reduce. The f32 fold is then `fold_32`'s
//! operations on sixteen lanes, so every token gets `gemv_32`'s bits.
//!
//! `vpdpbusd` multiplies unsigned by signed bytes and only the signed
//! operand can be broadcast from memory, so the activations are stored
//! biased (y + 128, unsigned) and the weights stay signed: Σ (y + 128)·x =
//! Σ x·y + 128·Σ x, and each row block's 128·Σ x is taken off first. Lane
//! bounds: 32 × 255 × 128 in magnitude, far inside i32.

use super::blocks::BlockQ8_0;
use super::dot_avx2::{bytes32, halves_at, quants32};
use std::arch::x86_64::*;

/// Tokens per group: one per i32 lane of a 512-bit vector.
pub(super) const LANES: usize = 16;

/// Up to `L` tokens' Q8_0 activations, transposed for a GEMM with `L`
/// tokens a vector (here, and at eight in `lanes_avx2`): block b's quad k
/// (elements 4k..4k + 4, as the bytes of one little-endian word, xor
/// `BIAS`: 0x8080_8080 moves each signed byte up by 128) of token t at
/// `q[(b · 8 + k) · L + t]`; block b's scale of token t at `d[b · L + t]`.
/// Lanes without a token hold zeros (biased alike, and a zero scale), so
/// they compute zeros. The buffers are reused from group to group.
#[derive(Default)]
pub(super) struct Lanes<const L: usize, const BIAS: u32> {
    pub(super) q: Vec<u32>,
    pub(super) d: Vec<f32>,
    pub(super) blocks: usize,
}

/// The activations of [`gemm_32`]: biased by 128, sixteen tokens.
pub(super) type Lanes32 = Lanes<LANES, 0x8080_8080>;

impl<const L: usize, const BIAS: u32> Lanes<L, BIAS> {
    /// Words of one block: eight quads, each as `L` tokens' four bytes.
    pub(super) const BLOCK_WORDS: usize = 8 * L;

    /// Transpose `tokens` (at most `L`, each the same number of blocks)
    /// into the lanes.
    pub(super) fn fill(&mut self, tokens: &[&[BlockQ8_0]]) {
        assert!(!tokens.is_empty() && tokens.len() <= L, "Lanes: 1..={L} tokens");
        let blocks = tokens[0].len();
        self.blocks = blocks;
        self.q.clear();
        self.q.resize(blocks * Self::BLOCK_WORDS, BIAS);
        self.d.clear();
        self.d.resize(blocks * L, 0.0);
        for (t, y) in tokens.iter().enumerate() {
            assert_eq!(y.len(), blocks, "Lanes: tokens of one width");
            for (b, yb) in y.iter().enumerate() {
                for (k, quad) in yb.qs.chunks_exact(4).enumerate() {
                    let word = u32::from_le_bytes([quad[0] as u8, quad[1] as u8, quad[2] as u8, quad[3] as u8]);
                    self.q[(b * 8 + k) * L + t] = word ^ BIAS;
                }
                self.d[b * L + t] = yb.d.to_f32();
            }
        }
    }
}

/// Rows of Q8_0, Q4_0 or Q5_0 weights (`Q` as in `quants32`), each
/// `y.blocks` blocks, against a group of tokens: `out[r][t]` is row r's
/// product with token t, with `gemv_32`'s bits.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,f16c")]
pub(super) fn gemm_32<const Q: u8>(matrix: &[u8], y: &Lanes32, out: &mut [[f32; LANES]]) {
    let bb = bytes32(Q);
    let row_bytes = y.blocks * bb;
    let bias = _mm256_set1_epi8(-128);
    for (row, o) in matrix.chunks_exact(row_bytes).zip(out) {
        let mut acc = _mm512_setzero_ps();
        for ((b, yq), yd) in row.chunks_exact(bb).zip(y.q.chunks_exact(Lanes32::BLOCK_WORDS)).zip(y.d.chunks_exact(LANES)) {
            super::fetch_ahead::<2048>(b);
            let x = quants32::<Q>(b);
            // Σ (x + 128) in four u64 lanes, then 128 · Σ x off the start.
            let s = _mm256_sad_epu8(_mm256_xor_si256(x, bias), _mm256_setzero_si256());
            let s = _mm_add_epi64(_mm256_castsi256_si128(s), _mm256_extracti128_si256::<1>(s));
            let biased = _mm_cvtsi128_si32(_mm_add_epi64(s, _mm_unpackhi_epi64(s, s)));
            let mut sum = _mm512_set1_epi32(-128 * (biased - 32 * 128));
            let mut quads = [0i32; 8];
            // SAFETY: eight writable i32, 32 bytes; unaligned store.
            unsafe { _mm256_storeu_si256(quads.as_mut_ptr().cast(), x) };
            for (k, &quad) in quads.iter().enumerate() {
                // SAFETY: 16 readable words of the block's activations.
                let lanes = unsafe { _mm512_loadu_si512(yq[LANES * k..LANES * (k + 1)].as_ptr().cast()) };
                sum = _mm512_dpbusd_epi32(sum, lanes, _mm512_set1_epi32(quad));
            }
            // SAFETY: 16 readable f32; unaligned load.
            let dy = unsafe { _mm512_loadu_ps(yd.as_ptr()) };
            let dxdy = _mm512_mul_ps(_mm512_set1_ps(halves_at(b, 0).0), dy);
            acc = _mm512_add_ps(acc, _mm512_mul_ps(_mm512_cvtepi32_ps(sum), dxdy));
        }
        // SAFETY: 16 writable f32; unaligned store.
        unsafe { _mm512_storeu_ps(o.as_mut_ptr(), acc) };
    }
}
