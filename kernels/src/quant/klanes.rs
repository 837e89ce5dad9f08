//! The operands of the k-quant prefill GEMMs (`klanes_avx512`,
//! `klanes_avx2`, and on AMX tiles `ktiles_amx`): a band's rows unpacked
//! once ([`KRows`]: each quant a byte in element order, with the scales,
//! minimum terms and offsets beside them), and a group of sixteen tokens
//! transposed ([`KLanes`]: one 64-byte row holds the same four elements of
//! every token, so a vector of them meets four weight bytes broadcast to
//! every lane). What each kernel does with them is in its own file.

use super::blocks::{half_at, k_scales_mins, q45k_quants, q6k_quants, BlockQ8K, QuantKind, K_SCALES, Q6K_D, Q6K_SCALES};
use super::dot_avx2::hsum;
use super::dot_avx512::{Q45Unpack, Q6Unpack, Unpack};
use super::QK_K;
use std::arch::x86_64::*;

/// Tokens per group: one per i32 lane of a 512-bit vector.
pub(super) const LANES: usize = 16;

/// Groups of four elements per block.
pub(super) const QUADS: usize = QK_K / 4;

/// Two i16 as the words of one little-endian u32 (`lo` first).
fn words(lo: i16, hi: i16) -> u32 {
    lo as u16 as u32 | (hi as u16 as u32) << 16
}

/// Up to sixteen tokens' Q8_K activations, transposed: block b's quad k
/// (elements 4k..4k + 4, biased by 128 or not, as the bytes of a word) of
/// token t at `q[(b · 64 + k) · 16 + t]`; its scale at
/// `d[b · 16 + t]`; the activation sums of its sixteen-element sub-blocks
/// 2h and 2h + 1 (`bsums`, as words) at `sums16[(b · 8 + h) · 16 + t]`,
/// and of its 32-element sub-blocks 2h and 2h + 1 at
/// `sums32[(b · 4 + h) · 16 + t]`. Lanes without a token hold zeros. The
/// buffers are reused from group to group.
#[derive(Default)]
pub(super) struct KLanes {
    pub(super) q: Vec<u32>,
    pub(super) d: Vec<f32>,
    pub(super) sums16: Vec<u32>,
    pub(super) sums32: Vec<u32>,
    pub(super) blocks: usize,
}

impl KLanes {
    /// Transpose `tokens` (1..=[`LANES`], each the same number of blocks),
    /// their quants biased by 128 (`biased`: unsigned, for `vpdpbusd` and
    /// `vpmaddubsw`) or as they are, signed, for the AMX tiles (`tdpbssd`).
    pub(super) fn fill(&mut self, tokens: &[&[BlockQ8K]], biased: bool) {
        assert!(!tokens.is_empty() && tokens.len() <= LANES, "KLanes: 1..=16 tokens");
        let blocks = tokens[0].len();
        self.blocks = blocks;
        let bias = if biased { 0x8080_8080 } else { 0 };
        for (v, per_block) in [(&mut self.q, QUADS), (&mut self.sums16, 8), (&mut self.sums32, 4)] {
            v.clear();
            v.resize(blocks * per_block * LANES, 0);
        }
        self.d.clear();
        self.d.resize(blocks * LANES, 0.0);
        for (t, y) in tokens.iter().enumerate() {
            assert_eq!(y.len(), blocks, "KLanes: tokens of one width");
            for (b, yb) in y.iter().enumerate() {
                for (k, quad) in yb.qs.chunks_exact(4).enumerate() {
                    let word = u32::from_le_bytes([quad[0] as u8, quad[1] as u8, quad[2] as u8, quad[3] as u8]);
                    self.q[(b * QUADS + k) * LANES + t] = word ^ bias;
                }
                let s = &yb.bsums;
                for h in 0..8 {
                    self.sums16[(b * 8 + h) * LANES + t] = words(s[2 * h], s[2 * h + 1]);
                }
                // A 32-element sub-block's sum is at most 32 × 127: an i16.
                let s32 = |g: usize| s[2 * g] + s[2 * g + 1];
                for h in 0..4 {
                    self.sums32[(b * 4 + h) * LANES + t] = words(s32(2 * h), s32(2 * h + 1));
                }
                self.d[b * LANES + t] = yb.d;
            }
        }
    }
}

/// A band's k-quant rows unpacked, row r's block b at index
/// `i = r · blocks + b`: its quants as bytes in element order at
/// `q[i · 256..]` (Q6_K's as stored, 0..64: the `- 32` comes through the
/// activation sums); its scales per sub-block (eight of 32 elements, or
/// Q6_K's sixteen of 16) at `scales[i · 16..]`; the bias term 128 × Σ
/// scale × Σ quant at `bias[i]`; `d`, and `dmin` (zero for Q6_K); and the
/// word pairs that multiply the activation sums (`KLanes`' `sums32` for
/// Q4_K/Q5_K: mins 2h and 2h + 1, the minimum term; `sums16` for Q6_K:
/// -32 × scales 2h and 2h + 1, the offset) at `pairs[i · 8..]`.
#[derive(Default)]
pub(super) struct KRows {
    pub(super) q: Vec<u8>,
    pub(super) scales: Vec<i32>,
    pub(super) bias: Vec<i32>,
    pub(super) d: Vec<f32>,
    pub(super) dmin: Vec<f32>,
    pub(super) pairs: Vec<u32>,
    pub(super) rows: usize,
    pub(super) blocks: usize,
    pub(super) six: bool,
}

/// A token block of ones: a weight block's sums with it are Σ scale ×
/// quant (Q6_K's offset, from the zero `bsums`, is zero), the bias term's
/// factor.
static ONES: BlockQ8K = BlockQ8K { d: 0.0, qs: [1; QK_K], bsums: [0; QK_K / 16] };

impl KRows {
    /// Unpack `rows` whole rows of `kind` (Q4_K, Q5_K or Q6_K), `blocks`
    /// blocks each, with the one-token kernels' unpacking.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,f16c")]
    pub(super) fn unpack(&mut self, kind: QuantKind, matrix: &[u8], rows: usize, blocks: usize) {
        match kind {
            QuantKind::Q4K => self.unpack_with(&Q45Unpack::<false>::new(), matrix, rows, blocks),
            QuantKind::Q5K => self.unpack_with(&Q45Unpack::<true>::new(), matrix, rows, blocks),
            QuantKind::Q6K => self.unpack_with(&Q6Unpack::new(), matrix, rows, blocks),
            _ => unreachable!("KRows: {kind} is not a k-quant"),
        }
    }

    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,f16c")]
    fn unpack_with<U: Unpack>(&mut self, unpack: &U, matrix: &[u8], rows: usize, blocks: usize) {
        let bb = self.size_for(U::KIND, matrix, rows, blocks);
        for (i, b) in matrix.chunks_exact(bb).enumerate() {
            super::fetch_block_ahead::<4096>(b);
            // SAFETY: this function's features are the kernels'.
            let blk = unsafe { unpack.unpack(b) };
            for (c, &v) in blk.q.iter().enumerate() {
                let q = &mut self.q[i * QK_K + 64 * c..][..64];
                // SAFETY: 64 writable bytes; unaligned store.
                unsafe { _mm512_storeu_si512(q.as_mut_ptr().cast(), v) };
            }
            self.bias[i] = 128 * hsum(blk.sums(&ONES).0);
            (self.d[i], self.dmin[i]) = (blk.d, blk.dmin);
            self.scales_and_pairs(i, b);
        }
    }

    /// [`KRows::unpack`] where the CPU has AVX-512 VNNI, else
    /// [`KRows::unpack_portable`]: the same fields either way.
    pub(super) fn unpack_best(&mut self, kind: QuantKind, matrix: &[u8], rows: usize, blocks: usize) {
        if super::has_vnni() && crate::cpu::isa::hardware() >= crate::cpu::isa::Isa::Avx512 {
            // SAFETY: the CPU has AVX-512 F/BW and VNNI (checked), and with
            // them AVX2 and F16C.
            unsafe { self.unpack(kind, matrix, rows, blocks) }
        } else {
            self.unpack_portable(kind, matrix, rows, blocks)
        }
    }

    /// [`KRows::unpack`] in plain Rust, 32 elements at a time (loops the
    /// compiler vectorizes on any x86 level): the AMX tile model's
    /// unpacking on any CPU (the tests).
    pub(super) fn unpack_portable(&mut self, kind: QuantKind, matrix: &[u8], rows: usize, blocks: usize) {
        self.unpack_plain(kind, matrix, rows, blocks)
    }

    /// [`KRows::unpack_portable`] compiled for AVX2, whose wider vectors
    /// unpack faster (`quant_matmul`'s AVX2 GEMM at eight tokens, where the
    /// unpacking is most of the time: Q4_K 49 → 58 G multiply-adds/s): the
    /// AVX2 GEMM's unpacking.
    #[target_feature(enable = "avx2")]
    pub(super) fn unpack_avx2(&mut self, kind: QuantKind, matrix: &[u8], rows: usize, blocks: usize) {
        self.unpack_plain(kind, matrix, rows, blocks)
    }

    #[inline(always)]
    fn unpack_plain(&mut self, kind: QuantKind, matrix: &[u8], rows: usize, blocks: usize) {
        let bb = self.size_for(kind, matrix, rows, blocks);
        for (i, b) in matrix.chunks_exact(bb).enumerate() {
            super::fetch_block_ahead::<4096>(b);
            let q: &mut [u8; QK_K] = (&mut self.q[i * QK_K..(i + 1) * QK_K]).try_into().expect("a block's quants");
            match kind {
                QuantKind::Q6K => q6k_quants(b, q),
                _ => q45k_quants(b, kind == QuantKind::Q5K, q),
            }
            (self.d[i], self.dmin[i]) = match kind {
                QuantKind::Q6K => (half_at(b, Q6K_D), 0.0),
                _ => (half_at(b, 0), half_at(b, 2)),
            };
            self.scales_and_pairs(i, b);
            let per = if self.six { 16 } else { 32 };
            let (q, scales) = (&self.q[i * QK_K..(i + 1) * QK_K], &self.scales[i * 16..(i + 1) * 16]);
            let sums = q.chunks_exact(per).zip(scales).map(|(sub, &scale)| scale * sub.iter().map(|&v| v as i32).sum::<i32>());
            self.bias[i] = 128 * sums.sum::<i32>();
        }
    }

    /// Size the buffers for `rows` rows of `blocks` `kind` blocks (Q4_K,
    /// Q5_K or Q6_K) held whole in `matrix`; the block's bytes.
    fn size_for(&mut self, kind: QuantKind, matrix: &[u8], rows: usize, blocks: usize) -> usize {
        assert!(matches!(kind, QuantKind::Q4K | QuantKind::Q5K | QuantKind::Q6K), "KRows: {kind} is not a k-quant");
        let bb = kind.block_bytes();
        assert_eq!(matrix.len(), rows * blocks * bb, "KRows: whole rows");
        (self.rows, self.blocks, self.six) = (rows, blocks, kind == QuantKind::Q6K);
        let n = rows * blocks;
        self.q.resize(n * QK_K, 0);
        self.scales.resize(n * 16, 0);
        self.bias.resize(n, 0);
        self.d.resize(n, 0.0);
        self.dmin.resize(n, 0.0);
        self.pairs.resize(n * 8, 0);
        bb
    }

    /// Block `i`'s scales and word pairs, from its bytes `b`.
    #[inline(always)]
    fn scales_and_pairs(&mut self, i: usize, b: &[u8]) {
        let scales = &mut self.scales[i * 16..(i + 1) * 16];
        let pairs = &mut self.pairs[i * 8..(i + 1) * 8];
        if self.six {
            let sc = |s: usize| (b[Q6K_SCALES + s] as i8) as i16;
            for (s, v) in scales.iter_mut().enumerate() {
                *v = sc(s) as i32;
            }
            for (h, p) in pairs.iter_mut().enumerate() {
                *p = words(-32 * sc(2 * h), -32 * sc(2 * h + 1));
            }
        } else {
            let (sc, mn) = k_scales_mins(&b[K_SCALES..K_SCALES + 12]);
            for (v, &s) in scales.iter_mut().zip(&sc) {
                *v = s as i32;
            }
            for h in 0..4 {
                pairs[h] = words(mn[2 * h] as i16, mn[2 * h + 1] as i16);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The portable unpacking (the tile model's on CPUs without AVX-512)
    /// gives every field the SIMD one does, for each k-quant.
    #[test]
    fn portable_unpack_is_the_simd_unpack() {
        if !(super::super::has_vnni() && crate::cpu::isa::hardware() >= crate::cpu::isa::Isa::Avx512) {
            eprintln!("skipped: no AVX-512 VNNI on this CPU, so no SIMD unpacking to compare with");
            return;
        }
        for (kind, seed) in [(QuantKind::Q4K, 1), (QuantKind::Q5K, 2), (QuantKind::Q6K, 3)] {
            let (matrix, _) = super::super::tiles_amx::sample_k(kind, 7, 1, 3, seed);
            let (mut simd, mut portable) = (KRows::default(), KRows::default());
            // SAFETY: AVX-512 VNNI (checked above).
            unsafe { simd.unpack(kind, &matrix, 7, 3) };
            portable.unpack_portable(kind, &matrix, 7, 3);
            assert_eq!(simd.q, portable.q, "{kind} quants");
            assert_eq!(simd.scales, portable.scales, "{kind} scales");
            assert_eq!(simd.bias, portable.bias, "{kind} bias");
            assert_eq!(simd.pairs, portable.pairs, "{kind} pairs");
            assert_eq!((simd.d, simd.dmin), (portable.d, portable.dmin), "{kind} d, dmin");
        }
    }
}
