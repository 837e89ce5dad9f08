//! The prefill GEMM of the 32-element formats (Q8_0, Q4_0, Q5_0) on AMX
//! INT8 tiles: sixteen weight rows against sixteen tokens per product.
//!
//! One `tdpbssd` multiplies a tile of sixteen tokens' 32 activations of a
//! block (A, 16 × 32 bytes) by the same block of sixteen weight rows (B,
//! 8 × 64 bytes: row k holds elements 4k..4k + 4 of each weight row) into
//! 16 × 16 exact i32 block sums. Each block's sums are then folded into
//! f32 with `fold_32`'s operations, in block order, so every product has
//! the bits of `gemv_32` and the scalar reference, whichever path a token
//! took; a block's fold is what the scales ask for (one per block and
//! row, one per block and token), and it costs more than the product.
//!
//! The weights are repacked per call into B tiles ([`Panels32`], the band
//! at 32 bytes a block, in the caller's thread-local scratch: the shared
//! segment keeps its one copy) and reused by every group of sixteen
//! tokens; the tokens are copied into A tiles ([`Tokens32`]), so a MoE
//! expert's picked tokens need no common stride. Q4_0 and Q5_0 are
//! widened to signed bytes on the way.
//!
//! The kernel is written over [`Tiles`], so [`ModelTiles`] runs it on any
//! CPU in the tests; [`usable`] runs it once on the CPU's tiles and on the
//! model, and keeps the tiles off if they disagree. The k-quants' tile
//! GEMM (`ktiles_amx`) runs on the same [`TileUnit`]s, under the same
//! self-check.

use super::blocks::{half_at, q5_0_quant, BlockQ8_0, QuantKind, QK8_0};
#[cfg(target_arch = "x86_64")]
use super::blocks::BlockQ8K;
use super::fold_32;
#[cfg(target_arch = "x86_64")]
use super::klanes::{KLanes, KRows};
#[cfg(target_arch = "x86_64")]
use super::ktiles_amx;
use crate::cpu::amx::{TileConfig, Tiles};
use std::sync::OnceLock;

/// Tokens per A tile and weight rows per B tile.
pub(super) const TILE: usize = 16;

/// Bytes of one block's tile (A: sixteen tokens × 32; B: 8 rows × 64).
const BLOCK_TILE: usize = TILE * QK8_0;

/// The registers: C (16 × 16 i32), A (16 tokens × 32 bytes), B (8 × 64).
const C: u8 = 0;
const A: u8 = 1;
const B: u8 = 2;

fn config() -> TileConfig {
    TileConfig::new().with(C, TILE, 4 * TILE).with(A, TILE, QK8_0).with(B, QK8_0 / 4, 4 * TILE)
}

/// Block `block`'s 32 weights as signed bytes (Q8_0: as stored; Q4_0:
/// nibble − 8, low nibbles first; Q5_0: five bits − 16).
fn widen<const Q: u8>(block: &[u8]) -> [i8; QK8_0] {
    std::array::from_fn(|j| match Q {
        8 => block[2 + j] as i8,
        4 => {
            let byte = block[2 + j % 16];
            (if j < 16 { byte & 15 } else { byte >> 4 }) as i8 - 8
        }
        _ => q5_0_quant(block, j) as i8 - 16,
    })
}

/// The 32-element format `Q` names (8, 4 or 5).
fn kind<const Q: u8>() -> QuantKind {
    match Q {
        8 => QuantKind::Q8_0,
        4 => QuantKind::Q4_0,
        _ => QuantKind::Q5_0,
    }
}

/// A band of weight rows as B tiles, sixteen rows a panel: panel p's block
/// b at `q[(p · blocks + b) · 512..]` (row k, column n: elements 4k..4k + 4
/// of the panel's row n), its row scales at `d[(p · blocks + b) · 16..]`.
/// Rows past the band's end are zeros with zero scales.
#[derive(Default)]
pub(super) struct Panels32 {
    /// As words: each holds one row's four elements of a tile row.
    q: Vec<u32>,
    d: Vec<f32>,
    rows: usize,
    blocks: usize,
}

impl Panels32 {
    /// Pack `rows` rows of `Q` weights of `blocks` blocks each.
    pub(super) fn fill<const Q: u8>(&mut self, matrix: &[u8], rows: usize, blocks: usize) {
        let bb = kind::<Q>().block_bytes();
        assert_eq!(matrix.len(), rows * blocks * bb, "Panels32: {rows} rows of {blocks} blocks");
        let panels = rows.div_ceil(TILE);
        (self.rows, self.blocks) = (rows, blocks);
        self.q.clear();
        self.q.resize(panels * blocks * BLOCK_TILE / 4, 0);
        self.d.clear();
        self.d.resize(panels * blocks * TILE, 0.0);
        for (r, row) in matrix.chunks_exact(blocks * bb).enumerate() {
            let (p, n) = (r / TILE, r % TILE);
            for (b, block) in row.chunks_exact(bb).enumerate() {
                let tile = &mut self.q[(p * blocks + b) * BLOCK_TILE / 4..][..BLOCK_TILE / 4];
                let values = widen::<Q>(block);
                for (k, quad) in values.chunks_exact(4).enumerate() {
                    tile[k * TILE + n] = u32::from_le_bytes([quad[0] as u8, quad[1] as u8, quad[2] as u8, quad[3] as u8]);
                }
                self.d[(p * blocks + b) * TILE + n] = half_at(block, 0);
            }
        }
    }
}

/// Up to sixteen tokens' Q8_0 activations as A tiles: block b's tile at
/// `q[b · 512..]` (token m's 32 quants at `m · 32`), its token scales at
/// `d[b · 16..]`. Rows past the tokens are zeros with zero scales.
#[derive(Default)]
pub(super) struct Tokens32 {
    q: Vec<u8>,
    d: Vec<f32>,
    count: usize,
    blocks: usize,
}

impl Tokens32 {
    /// Copy `tokens` (1..=16, each the same number of blocks) into tiles.
    pub(super) fn fill(&mut self, tokens: &[&[BlockQ8_0]]) {
        assert!(!tokens.is_empty() && tokens.len() <= TILE, "Tokens32: 1..=16 tokens");
        let blocks = tokens[0].len();
        (self.count, self.blocks) = (tokens.len(), blocks);
        self.q.clear();
        self.q.resize(blocks * BLOCK_TILE, 0);
        self.d.clear();
        self.d.resize(blocks * TILE, 0.0);
        for (m, y) in tokens.iter().enumerate() {
            assert_eq!(y.len(), blocks, "Tokens32: tokens of one width");
            for (b, yb) in y.iter().enumerate() {
                let at = b * BLOCK_TILE + m * QK8_0;
                for (dst, &v) in self.q[at..at + QK8_0].iter_mut().zip(&yb.qs) {
                    *dst = v as u8;
                }
                self.d[b * TILE + m] = yb.d.to_f32();
            }
        }
    }
}

/// Words as their little-endian bytes (what a tile row holds).
pub(super) fn words_as_bytes(words: &[u32]) -> &[u8] {
    // SAFETY: the same memory, four bytes a word, and a byte has no
    // alignment; x86 is little-endian (AMX is only there).
    unsafe { std::slice::from_raw_parts(words.as_ptr().cast::<u8>(), words.len() * 4) }
}

/// One C tile's block sums, as stored from the tile.
#[repr(C, align(64))]
pub(super) struct BlockSums(pub(super) [[i32; TILE]; TILE]);

impl Default for BlockSums {
    fn default() -> Self {
        BlockSums([[0; TILE]; TILE])
    }
}

impl BlockSums {
    pub(super) fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: 1 KiB of i32 seen as bytes; every byte pattern is an i32.
        unsafe { std::slice::from_raw_parts_mut(self.0.as_mut_ptr().cast::<u8>(), TILE * TILE * 4) }
    }
}

/// A panel's sixteen f32 sums for each of sixteen tokens: `acc[m][n]`,
/// token m against the panel's row n.
type Sums = [[f32; TILE]; TILE];

/// One block's fold: `acc[m][n] = fold_32(acc[m][n], dw[n], dy[m],
/// sums[m][n])` for the first `dy.len()` tokens.
fn fold_block(acc: &mut Sums, sums: &BlockSums, dw: &[f32; TILE], dy: &[f32]) {
    for ((acc, s), &dy) in acc.iter_mut().zip(&sums.0).zip(dy) {
        for n in 0..TILE {
            acc[n] = fold_32(acc[n], dw[n], dy, s[n]);
        }
    }
}

/// [`fold_block`] on AVX-512, a token per vector (written out: left to
/// itself the compiler vectorized across tokens, with gathers).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn fold_block_avx512(acc: &mut Sums, sums: &BlockSums, dw: &[f32; TILE], dy: &[f32]) {
    use std::arch::x86_64::*;
    // SAFETY: every pointer is to sixteen f32 or i32 of a whole array row.
    unsafe {
        let dw = _mm512_loadu_ps(dw.as_ptr());
        for ((acc, s), &dy) in acc.iter_mut().zip(&sums.0).zip(dy) {
            let dxdy = _mm512_mul_ps(dw, _mm512_set1_ps(dy));
            let s = _mm512_cvtepi32_ps(_mm512_loadu_si512(s.as_ptr().cast()));
            _mm512_storeu_ps(acc.as_mut_ptr(), _mm512_add_ps(_mm512_loadu_ps(acc.as_ptr()), _mm512_mul_ps(s, dxdy)));
        }
    }
}

/// `out[r][m]` = weight row r · token m for every row of `w` and token of
/// `y`, with `gemv_32`'s bits (lanes past the tokens are left as zeros);
/// `fold` is [`fold_block`] or its AVX-512 form.
#[inline(always)]
fn gemm_32<T: Tiles>(tiles: &mut T, w: &Panels32, y: &Tokens32, out: &mut [[f32; TILE]], fold: impl Fn(&mut Sums, &BlockSums, &[f32; TILE], &[f32])) {
    assert_eq!(w.blocks, y.blocks, "gemm_32 tiles: weights and tokens of one width");
    assert_eq!(out.len(), w.rows, "gemm_32 tiles: a result row per weight row");
    let blocks = w.blocks;
    let mut sums = BlockSums::default();
    tiles.configure(&config());
    for (p, out) in out.chunks_mut(TILE).enumerate() {
        let mut acc: Sums = [[0.0; TILE]; TILE];
        for b in 0..blocks {
            let at = (p * blocks + b) * BLOCK_TILE;
            tiles.zero::<C>();
            tiles.load::<A>(&y.q[b * BLOCK_TILE..(b + 1) * BLOCK_TILE], QK8_0);
            tiles.load::<B>(words_as_bytes(&w.q[at / 4..(at + BLOCK_TILE) / 4]), 4 * TILE);
            tiles.dot_i8::<C, A, B>();
            tiles.store::<C>(sums.bytes_mut(), 4 * TILE);
            let dw: &[f32; TILE] = w.d[(p * blocks + b) * TILE..][..TILE].try_into().expect("sixteen scales");
            fold(&mut acc, &sums, dw, &y.d[b * TILE..b * TILE + y.count]);
        }
        for (n, o) in out.iter_mut().enumerate() {
            *o = std::array::from_fn(|m| acc[m][n]);
        }
    }
    tiles.release();
}

/// [`gemm_32`] on the CPU's tiles, with the fold on AVX-512.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
fn gemm_32_amx(tiles: &mut crate::cpu::amx::HardwareTiles, w: &Panels32, y: &Tokens32, out: &mut [[f32; TILE]]) {
    // The closure has this function's features, so the call is safe.
    gemm_32(tiles, w, y, out, |acc, sums, dw, dy| fold_block_avx512(acc, sums, dw, dy))
}

/// A tile unit the GEMMs run on: the CPU's, or the model (tests).
pub(super) trait TileUnit {
    /// The 32-element formats (this file's [`gemm_32`]).
    fn gemm_32(&mut self, w: &Panels32, y: &Tokens32, out: &mut [[f32; TILE]]);
    /// The k-quants (`ktiles_amx`; `y` filled unbiased).
    #[cfg(target_arch = "x86_64")]
    fn gemm_k(&mut self, w: &KRows, y: &KLanes, out: &mut [[f32; TILE]]);
}

impl TileUnit for crate::cpu::amx::ModelTiles {
    fn gemm_32(&mut self, w: &Panels32, y: &Tokens32, out: &mut [[f32; TILE]]) {
        gemm_32(self, w, y, out, fold_block)
    }

    #[cfg(target_arch = "x86_64")]
    fn gemm_k(&mut self, w: &KRows, y: &KLanes, out: &mut [[f32; TILE]]) {
        ktiles_amx::gemm_k_portable(self, w, y, out)
    }
}

#[cfg(target_arch = "x86_64")]
impl TileUnit for crate::cpu::amx::HardwareTiles {
    fn gemm_32(&mut self, w: &Panels32, y: &Tokens32, out: &mut [[f32; TILE]]) {
        assert!(crate::cpu::isa::hardware() >= crate::cpu::isa::Isa::Avx512, "the tiles' fold runs on AVX-512");
        // SAFETY: AVX-512 F/BW/VL (asserted above).
        unsafe { gemm_32_amx(self, w, y, out) }
    }

    fn gemm_k(&mut self, w: &KRows, y: &KLanes, out: &mut [[f32; TILE]]) {
        assert!(super::has_vnni() && crate::cpu::isa::hardware() >= crate::cpu::isa::Isa::Avx512, "the tiles' fold runs on AVX-512 VNNI");
        // SAFETY: AVX-512 F/BW/VL and VNNI (asserted above).
        unsafe { ktiles_amx::gemm_k_avx512(self, w, y, out) }
    }
}

/// Pack `matrix` (`Q` rows) for [`gemm_32`].
pub(super) fn pack(kind: QuantKind, matrix: &[u8], rows: usize, blocks: usize, into: &mut Panels32) {
    match kind {
        QuantKind::Q8_0 => into.fill::<8>(matrix, rows, blocks),
        QuantKind::Q4_0 => into.fill::<4>(matrix, rows, blocks),
        QuantKind::Q5_0 => into.fill::<5>(matrix, rows, blocks),
        _ => unreachable!("{kind} is not a 32-element format"),
    }
}

/// Whether the prefill GEMMs (the 32-element formats' and the k-quants')
/// run on AMX tiles: the CPU has INT8 tiles and AVX-512 VNNI, Linux
/// permits them, `DUPLEX_AMX` does not say `off` (or `0`), and the tiles
/// pass a self-check (small products of every format on the tiles and on
/// [`ModelTiles`], bit for bit, each against the scalar reference).
/// Decided once per process; a failed check is said once on stderr.
#[cfg(target_arch = "x86_64")]
pub(super) fn usable() -> bool {
    static USABLE: OnceLock<bool> = OnceLock::new();
    *USABLE.get_or_init(|| {
        let fold_runs = super::has_vnni() && crate::cpu::isa::hardware() >= crate::cpu::isa::Isa::Avx512;
        fold_runs && crate::cpu::amx::checked_tiles(crate::cpu::amx::HardwareTiles::new, self_check, "AMX INT8 tiles turned off, the AVX-512 kernels run instead")
    })
}

#[cfg(not(target_arch = "x86_64"))]
pub(super) fn usable() -> bool {
    false
}

/// A deterministic test product: `rows` rows of `kind` weights (any
/// block format) and `tokens` tokens of `blocks` blocks, from `seed`, the
/// tokens quantized by `quantize` from values in -4..4.
#[cfg(any(test, target_arch = "x86_64"))]
fn sample_of<Y>(kind: QuantKind, rows: usize, tokens: usize, blocks: usize, seed: u64, quantize: impl Fn(&[f32]) -> Vec<Y>) -> (Vec<u8>, Vec<Vec<Y>>) {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut next = move || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        s
    };
    let bb = kind.block_bytes();
    let mut matrix: Vec<u8> = (0..rows * blocks * bb).map(|_| (next() >> 32) as u8).collect();
    for block in matrix.chunks_exact_mut(bb) {
        for &at in kind.f16_offsets() {
            // A finite scale: 2^-12..2^-6 with random mantissa bits.
            let scale = half::f16::from_f32((1.0 + (next() % 1000) as f32 / 1000.0) * 2f32.powi(-12 + (next() % 7) as i32));
            block[at..at + 2].copy_from_slice(&scale.to_le_bytes());
        }
    }
    let xs = (0..tokens)
        .map(|_| {
            let x: Vec<f32> = (0..blocks * kind.block_elems()).map(|_| ((next() >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 8.0).collect();
            quantize(&x)
        })
        .collect();
    (matrix, xs)
}

/// [`sample_of`] a 32-element format, Q8_0 tokens.
#[cfg(any(test, target_arch = "x86_64"))]
pub(super) fn sample(kind: QuantKind, rows: usize, tokens: usize, blocks: usize, seed: u64) -> (Vec<u8>, Vec<Vec<BlockQ8_0>>) {
    sample_of(kind, rows, tokens, blocks, seed, |x| super::quantize_q8_0(x).expect("whole blocks"))
}

/// [`sample_of`] a k-quant, Q8_K tokens.
#[cfg(target_arch = "x86_64")]
pub(super) fn sample_k(kind: QuantKind, rows: usize, tokens: usize, blocks: usize, seed: u64) -> (Vec<u8>, Vec<Vec<BlockQ8K>>) {
    sample_of(kind, rows, tokens, blocks, seed, |x| super::quantize_q8_k(x).expect("whole blocks"))
}

/// `unit`'s k-quant products (`rows` × `tokens` ≤ 16 of `blocks` blocks,
/// from `seed`), each against the scalar reference: the first difference.
#[cfg(target_arch = "x86_64")]
fn compare_k(unit: &mut impl TileUnit, kind: QuantKind, rows: usize, tokens: usize, blocks: usize, seed: u64) -> Result<(), String> {
    let (matrix, xs) = sample_k(kind, rows, tokens, blocks, seed);
    let mut w = KRows::default();
    w.unpack_best(kind, &matrix, rows, blocks);
    let mut y = KLanes::default();
    y.fill(&xs.iter().map(Vec::as_slice).collect::<Vec<_>>(), false);
    let mut out = vec![[f32::NAN; TILE]; rows];
    unit.gemm_k(&w, &y, &mut out);
    for (r, row) in matrix.chunks_exact(blocks * kind.block_bytes()).enumerate() {
        for (m, x) in xs.iter().enumerate() {
            let want = match kind {
                QuantKind::Q4K => super::dot_scalar::dot_q45k::<false>(row, x),
                QuantKind::Q5K => super::dot_scalar::dot_q45k::<true>(row, x),
                _ => super::dot_scalar::dot_q6k(row, x),
            };
            if out[r][m].to_bits() != want.to_bits() {
                return Err(format!("{kind} row {r} token {m} of {rows}×{tokens}×{blocks}: {} against the reference's {want}", out[r][m]));
            }
        }
    }
    Ok(())
}

/// `unit`'s products against the scalar reference, for one sample of
/// each format; the first difference found, if any.
#[cfg(any(test, target_arch = "x86_64"))]
fn compare(unit: &mut impl TileUnit, rows: usize, tokens: usize, blocks: usize, seed: u64) -> Result<(), String> {
    for kind in [QuantKind::Q8_0, QuantKind::Q4_0, QuantKind::Q5_0] {
        let (matrix, xs) = sample(kind, rows, tokens, blocks, seed);
        let mut w = Panels32::default();
        pack(kind, &matrix, rows, blocks, &mut w);
        let mut y = Tokens32::default();
        let refs: Vec<&[BlockQ8_0]> = xs.iter().map(Vec::as_slice).collect();
        y.fill(&refs);
        let mut out = vec![[f32::NAN; TILE]; rows];
        unit.gemm_32(&w, &y, &mut out);
        let bb = kind.block_bytes();
        for (r, row) in matrix.chunks_exact(blocks * bb).enumerate() {
            for (m, x) in xs.iter().enumerate() {
                let want = match kind {
                    QuantKind::Q8_0 => super::dot_scalar::dot_q8_0(row, x),
                    QuantKind::Q4_0 => super::dot_scalar::dot_q4_0(row, x),
                    _ => super::dot_scalar::dot_q5_0(row, x),
                };
                if out[r][m].to_bits() != want.to_bits() {
                    return Err(format!("{kind} row {r} token {m} of {rows}×{tokens}×{blocks}: {} against the reference's {want}", out[r][m]));
                }
            }
        }
    }
    Ok(())
}

/// The self-check of [`usable`]: the hardware and the model, each against
/// the scalar reference, on partial and whole tiles (on AVX-512, which
/// `usable` asks for first and the hardware's fold asserts).
#[cfg(target_arch = "x86_64")]
fn self_check(hw: &mut crate::cpu::amx::HardwareTiles) -> Result<(), String> {
    for (rows, tokens, blocks, seed) in [(21, 13, 3, 1), (16, 16, 2, 2)] {
        compare(&mut crate::cpu::amx::ModelTiles::default(), rows, tokens, blocks, seed).map_err(|e| format!("the model: {e}"))?;
        compare(hw, rows, tokens, blocks, seed).map_err(|e| format!("the tiles: {e}"))?;
    }
    for kind in [QuantKind::Q4K, QuantKind::Q5K, QuantKind::Q6K] {
        for (rows, tokens, blocks, seed) in [(21, 13, 2, 3), (16, 16, 1, 4)] {
            compare_k(&mut crate::cpu::amx::ModelTiles::default(), kind, rows, tokens, blocks, seed).map_err(|e| format!("the model: {e}"))?;
            compare_k(hw, kind, rows, tokens, blocks, seed).map_err(|e| format!("the tiles: {e}"))?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::amx::ModelTiles;

    /// The tile kernel, on the model, gives every (row, token) the scalar
    /// reference's bits: panels whole and partial, tokens from one to a
    /// full tile, one block and several.
    #[test]
    fn model_tiles_give_the_reference_bits() {
        let mut seed = 10;
        for rows in [1, 5, 16, 17, 40] {
            for tokens in [1, 4, 15, 16] {
                for blocks in [1, 3] {
                    seed += 1;
                    compare(&mut ModelTiles::default(), rows, tokens, blocks, seed).unwrap();
                }
            }
        }
    }

    /// The k-quants' tile kernel (`ktiles_amx`), on the model, gives every
    /// (row, token) the scalar reference's bits: panels whole and partial
    /// (one short panel is all a band of fewer than sixteen rows has),
    /// tokens from one to a full tile, one block and several.
    /// With the arithmetic around the products in plain Rust (the model's
    /// own), and, where the CPU has AVX-512 VNNI, in the AVX-512 form the
    /// hardware tiles take: all of the hardware path but the tile
    /// instructions.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn model_tiles_give_the_k_quants_reference_bits() {
        let avx512 = super::super::has_vnni() && crate::cpu::isa::hardware() >= crate::cpu::isa::Isa::Avx512;
        if !avx512 {
            eprintln!("no AVX-512 VNNI on this CPU: the model runs the plain-Rust arithmetic only");
        }
        let mut seed = 500;
        for kind in [QuantKind::Q4K, QuantKind::Q5K, QuantKind::Q6K] {
            for rows in [1, 5, 16, 17, 40] {
                for tokens in [1, 4, 15, 16] {
                    for blocks in [1, 3] {
                        seed += 1;
                        compare_k(&mut ModelTiles::default(), kind, rows, tokens, blocks, seed).unwrap();
                        if avx512 {
                            compare_k(&mut AroundOnAvx512::default(), kind, rows, tokens, blocks, seed).unwrap();
                        }
                    }
                }
            }
        }
    }

    /// The model's tiles with the hardware's AVX-512 arithmetic around them.
    #[cfg(target_arch = "x86_64")]
    #[derive(Default)]
    struct AroundOnAvx512(ModelTiles);

    #[cfg(target_arch = "x86_64")]
    impl TileUnit for AroundOnAvx512 {
        fn gemm_32(&mut self, w: &Panels32, y: &Tokens32, out: &mut [[f32; TILE]]) {
            self.0.gemm_32(w, y, out)
        }

        fn gemm_k(&mut self, w: &KRows, y: &KLanes, out: &mut [[f32; TILE]]) {
            assert!(super::super::has_vnni() && crate::cpu::isa::hardware() >= crate::cpu::isa::Isa::Avx512);
            // SAFETY: AVX-512 F/BW/VL and VNNI (asserted above).
            unsafe { ktiles_amx::gemm_k_avx512(&mut self.0, w, y, out) }
        }
    }

    /// Planted slips in the k-quants' tile kernel's operands are caught by
    /// the same comparison: two sub-blocks' scales swapped, the minimum
    /// term's words swapped, and tokens biased as for the AVX-512 lanes.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn k_quant_tile_slips_are_caught() {
        for kind in [QuantKind::Q4K, QuantKind::Q6K] {
            let (matrix, xs) = sample_k(kind, 16, 3, 1, 77);
            let refs: Vec<&[BlockQ8K]> = xs.iter().map(Vec::as_slice).collect();
            let want = match kind {
                QuantKind::Q4K => super::super::dot_scalar::dot_q45k::<false>(&matrix[..kind.block_bytes()], &xs[0]),
                _ => super::super::dot_scalar::dot_q6k(&matrix[..kind.block_bytes()], &xs[0]),
            };
            type Slip = fn(&mut KRows);
            let slips: [(&str, Slip, bool); 3] = [
                ("scales swapped", |w| w.scales.swap(0, 1), false),
                ("term words swapped", |w| w.pairs[0] = w.pairs[0].rotate_left(16), false),
                ("tokens biased", |_| {}, true),
            ];
            for (what, slip, biased) in slips {
                let mut w = KRows::default();
                w.unpack_best(kind, &matrix, 16, 1);
                assert!(w.scales[0] != w.scales[1] && w.pairs[0] != w.pairs[0].rotate_left(16), "{kind}: the sample gives the slips nothing to change");
                slip(&mut w);
                let mut y = KLanes::default();
                y.fill(&refs, biased);
                let mut out = vec![[0.0; TILE]; 16];
                ModelTiles::default().gemm_k(&w, &y, &mut out);
                assert_ne!(out[0][0].to_bits(), want.to_bits(), "{kind}: {what} went unseen");
            }
        }
    }

    /// A planted slip in the packing (a weight row's quads one column
    /// over) is caught by the same comparison, so it is not vacuous.
    #[test]
    fn a_misplaced_weight_quad_is_caught() {
        let (matrix, xs) = sample(QuantKind::Q8_0, 16, 3, 1, 7);
        let mut w = Panels32::default();
        pack(QuantKind::Q8_0, &matrix, 16, 1, &mut w);
        w.q.swap(0, 1);
        let mut y = Tokens32::default();
        y.fill(&xs.iter().map(Vec::as_slice).collect::<Vec<_>>());
        let mut out = vec![[0.0; TILE]; 16];
        ModelTiles::default().gemm_32(&w, &y, &mut out);
        let want = super::super::dot_scalar::dot_q8_0(&matrix[..34], &xs[0]);
        assert_ne!(out[0][0].to_bits(), want.to_bits());
    }

    /// The AVX-512 fold the tiles use has the portable fold's bits.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn avx512_fold_is_the_portable_fold() {
        if crate::cpu::isa::hardware() < crate::cpu::isa::Isa::Avx512 {
            eprintln!("skipped: no AVX-512 on this CPU (the tiles' fold is only ever run with it)");
            return;
        }
        let (matrix, xs) = sample(QuantKind::Q8_0, 16, 16, 3, 99);
        let mut sums = BlockSums::default();
        for (m, row) in sums.0.iter_mut().enumerate() {
            for (n, v) in row.iter_mut().enumerate() {
                *v = (matrix[m * 34 + n + 2] as i8 as i32) * 4000 + n as i32 - m as i32;
            }
        }
        let dw: [f32; TILE] = std::array::from_fn(|n| half_at(&matrix[n * 34..], 0));
        let dy: Vec<f32> = xs.iter().map(|x| x[1].d.to_f32()).collect();
        for count in [16, 5] {
            let (mut a, mut b): (Sums, Sums) = (std::array::from_fn(|m| std::array::from_fn(|n| (m * 16 + n) as f32 * 0.37)), [[0.0; TILE]; TILE]);
            b.copy_from_slice(&a);
            fold_block(&mut a, &sums, &dw, &dy[..count]);
            // SAFETY: AVX-512 (checked above).
            unsafe { fold_block_avx512(&mut b, &sums, &dw, &dy[..count]) };
            assert_eq!(a.map(|r| r.map(f32::to_bits)), b.map(|r| r.map(f32::to_bits)));
        }
    }

    /// On an AMX machine the self-check must pass; elsewhere this says why
    /// it could not run (as the CUDA tests do without a GPU).
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn hardware_tiles_pass_the_self_check() {
        let Some(mut hw) = crate::cpu::amx::HardwareTiles::new() else {
            eprintln!("skipped: this CPU or kernel gives no AMX INT8 tiles (CPUID, XCR0 or arch_prctl)");
            return;
        };
        self_check(&mut hw).unwrap();
    }
}
