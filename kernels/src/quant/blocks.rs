//! ggml's block layouts, scalar dequantization, and activation quantization.
//!
//! Weight blocks are read straight from their little-endian bytes (a GGUF
//! mapping has no alignment to offer past the tensor's start, and a struct
//! view would buy nothing): each layout is a list of byte offsets below.
//! Activation blocks (Q8_K, Q8_0, Q8_1) are made here, so they are Rust
//! structs: Q8_K and Q8_0 with ggml's exact layout and size, convertible to
//! and from its bytes; Q8_1 with its `s` held in f32 (see [`BlockQ8_1`]).
//!
//! Layouts (ggml-common.h; `d`, `dmin` are IEEE half precision):
//!
//! | kind | elements | bytes | fields |
//! | --- | --- | --- | --- |
//! | Q4_0 | 32 | 18 | `d`, `qs[16]`: element j is `qs[j] & 15`, j+16 is `qs[j] >> 4`, minus 8 |
//! | Q5_0 | 32 | 22 | `d`, `qh[4]` (bit j: element j's fifth bit), `qs[16]` as Q4_0; minus 16 |
//! | Q5_1 | 32 | 24 | `d`, `m`, `qh[4]`, `qs[16]` as Q5_0; the value is `d × q + m` (q in 0..32) |
//! | Q8_0 | 32 | 34 | `d`, `qs[32]` (i8) |
//! | Q4_K | 256 | 144 | `d`, `dmin`, `scales[12]` (8 six-bit scales and mins), `qs[128]` |
//! | Q5_K | 256 | 176 | `d`, `dmin`, `scales[12]`, `qh[32]` (fifth bits), `qs[128]` |
//! | Q6_K | 256 | 210 | `ql[128]` (low four bits), `qh[64]` (high two), `scales[16]` (i8), `d` |
//! | Q8_K | 256 | 292 | `d` (f32), `qs[256]` (i8), `bsums[16]` (i16 sums of 16 quants) |
//! | Q8_1 | 32 | 36 | `d`, `s` (`d × Σ qs`), `qs[32]` (i8): Q5_1's activations (here `s` is held in f32, see [`BlockQ8_1`]) |

use super::QuantError;
use half::{bf16, f16};
use std::fmt;

/// Elements in a k-quant super-block.
pub const QK_K: usize = 256;
/// Elements in a Q4_0 / Q5_0 / Q5_1 / Q8_0 block.
pub const QK8_0: usize = 32;

/// A GGUF tensor's element format, of those this module reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum QuantKind {
    F32,
    F16,
    Bf16,
    Q4_0,
    Q5_0,
    Q5_1,
    Q8_0,
    Q4K,
    Q5K,
    Q6K,
}

impl QuantKind {
    /// Every kind, for tests and tables.
    pub const ALL: [QuantKind; 10] = [
        QuantKind::F32,
        QuantKind::F16,
        QuantKind::Bf16,
        QuantKind::Q4_0,
        QuantKind::Q5_0,
        QuantKind::Q5_1,
        QuantKind::Q8_0,
        QuantKind::Q4K,
        QuantKind::Q5K,
        QuantKind::Q6K,
    ];

    /// Elements per block (1 for the plain float formats).
    pub const fn block_elems(self) -> usize {
        match self {
            QuantKind::F32 | QuantKind::F16 | QuantKind::Bf16 => 1,
            QuantKind::Q4_0 | QuantKind::Q5_0 | QuantKind::Q5_1 | QuantKind::Q8_0 => QK8_0,
            QuantKind::Q4K | QuantKind::Q5K | QuantKind::Q6K => QK_K,
        }
    }

    /// Bytes per block, as ggml lays it out.
    pub const fn block_bytes(self) -> usize {
        match self {
            QuantKind::F32 => 4,
            QuantKind::F16 | QuantKind::Bf16 => 2,
            QuantKind::Q4_0 => 2 + QK8_0 / 2,
            QuantKind::Q5_0 => 2 + 4 + QK8_0 / 2,
            QuantKind::Q5_1 => 2 + 2 + 4 + QK8_0 / 2,
            QuantKind::Q8_0 => 2 + QK8_0,
            QuantKind::Q4K => 2 + 2 + 12 + QK_K / 2,
            QuantKind::Q5K => 2 + 2 + 12 + QK_K / 8 + QK_K / 2,
            QuantKind::Q6K => QK_K / 2 + QK_K / 4 + QK_K / 16 + 2,
        }
    }

    /// The `ggml_type` number GGUF stores for this kind.
    pub const fn ggml_type(self) -> u32 {
        match self {
            QuantKind::F32 => 0,
            QuantKind::F16 => 1,
            QuantKind::Q4_0 => 2,
            QuantKind::Q5_0 => 6,
            QuantKind::Q5_1 => 7,
            QuantKind::Q8_0 => 8,
            QuantKind::Q4K => 12,
            QuantKind::Q5K => 13,
            QuantKind::Q6K => 14,
            QuantKind::Bf16 => 30,
        }
    }

    /// The kind for a `ggml_type` number, if this module reads it.
    pub fn from_ggml_type(t: u32) -> Option<QuantKind> {
        QuantKind::ALL.into_iter().find(|k| k.ggml_type() == t)
    }

    /// ggml's name for the kind.
    pub const fn name(self) -> &'static str {
        match self {
            QuantKind::F32 => "F32",
            QuantKind::F16 => "F16",
            QuantKind::Bf16 => "BF16",
            QuantKind::Q4_0 => "Q4_0",
            QuantKind::Q5_0 => "Q5_0",
            QuantKind::Q5_1 => "Q5_1",
            QuantKind::Q8_0 => "Q8_0",
            QuantKind::Q4K => "Q4_K",
            QuantKind::Q5K => "Q5_K",
            QuantKind::Q6K => "Q6_K",
        }
    }

    /// Byte offsets of a block's f16 scales (`d`, and `dmin` for Q4_K and
    /// Q5_K, `m` for Q5_1); none for the plain float formats. A generator
    /// of blocks must set these, as random bytes there may be NaN or
    /// infinite.
    pub const fn f16_offsets(self) -> &'static [usize] {
        match self {
            QuantKind::F32 | QuantKind::F16 | QuantKind::Bf16 => &[],
            QuantKind::Q4_0 | QuantKind::Q5_0 | QuantKind::Q8_0 => &[0],
            QuantKind::Q4K | QuantKind::Q5K | QuantKind::Q5_1 => &[0, 2],
            QuantKind::Q6K => &[Q6K_D],
        }
    }

    /// Bytes of a row of `elements` elements, or an error if that is not
    /// whole blocks.
    pub fn row_bytes(self, elements: usize) -> Result<usize, QuantError> {
        let block = self.block_elems();
        if !elements.is_multiple_of(block) {
            return Err(QuantError::PartialElements { kind: self, elements, block });
        }
        Ok(elements / block * self.block_bytes())
    }
}

impl fmt::Display for QuantKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

// ---------------------------------------------------------------------------
// Byte offsets within the weight blocks.

/// Q4_K / Q5_K: `d` at 0, `dmin` at 2, `scales` at 4..16.
pub(crate) const K_SCALES: usize = 4;
/// Q4_K: `qs` after the scales.
pub(crate) const Q4K_QS: usize = 16;
/// Q5_K: `qh` after the scales, then `qs`.
pub(crate) const Q5K_QH: usize = 16;
pub(crate) const Q5K_QS: usize = 48;
/// Q6_K: `ql` at 0, `qh` at 128, `scales` at 192, `d` at 208.
pub(crate) const Q6K_QH: usize = 128;
pub(crate) const Q6K_SCALES: usize = 192;
pub(crate) const Q6K_D: usize = 208;

/// The half-precision value at `b[at..at + 2]`.
#[inline(always)]
pub(crate) fn half_at(b: &[u8], at: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([b[at], b[at + 1]])).to_f32()
}

/// The eight six-bit scales and eight six-bit mins packed in a Q4_K/Q5_K
/// block's 12 `scales` bytes. Bytes 0..4 hold scales 0..4 in their low six
/// bits, bytes 4..8 mins 0..4; scales and mins 4..8 take their low four bits
/// from the nibbles of bytes 8..12 and their top two bits from the spare
/// top bits of bytes 0..4 (scales) and 4..8 (mins). Done four bytes at a
/// time in u32 lanes, as it runs once per block in every kernel.
#[inline(always)]
pub(crate) fn k_scales_mins(s: &[u8]) -> ([u8; 8], [u8; 8]) {
    let word = |i: usize| u32::from_le_bytes([s[4 * i], s[4 * i + 1], s[4 * i + 2], s[4 * i + 3]]);
    let (w0, w1, w2) = (word(0), word(1), word(2));
    const LOW6: u32 = 0x3f3f_3f3f;
    const LOW4: u32 = 0x0f0f_0f0f;
    const TOP2: u32 = 0x0303_0303;
    let sc_lo = w0 & LOW6;
    let mn_lo = w1 & LOW6;
    let sc_hi = (w2 & LOW4) | (((w0 >> 6) & TOP2) << 4);
    let mn_hi = ((w2 >> 4) & LOW4) | (((w1 >> 6) & TOP2) << 4);
    let join = |lo: u32, hi: u32| (lo as u64 | (hi as u64) << 32).to_le_bytes();
    (join(sc_lo, sc_hi), join(mn_lo, mn_hi))
}

/// Q4_K quant `e` (0..256) of a block: sub-block `e / 32`'s nibble. Chunk
/// `c` of 64 elements reads bytes `32c..32c+32` of `qs`: low nibbles are its
/// first 32 elements, high nibbles the next 32.
#[inline(always)]
pub(crate) fn q4k_quant(qs: &[u8], e: usize) -> u8 {
    let byte = qs[32 * (e / 64) + e % 32];
    if (e / 32).is_multiple_of(2) {
        byte & 15
    } else {
        byte >> 4
    }
}

/// Q5_K quant `e`: the Q4_K nibble plus bit `e / 32` of `qh[e % 32]` as 16.
#[inline(always)]
pub(crate) fn q5k_quant(qh: &[u8], qs: &[u8], e: usize) -> u8 {
    q4k_quant(qs, e) | (((qh[e % 32] >> (e / 32)) & 1) << 4)
}

/// Q6_K quant `e` as stored (0..64; the value is this minus 32). Each half
/// of 128 elements has 64 `ql` bytes and 32 `qh` bytes; its quarter `k`
/// (32 elements) takes low nibbles (k = 0, 1) or high nibbles (k = 2, 3) of
/// `ql[32 * (k % 2)..]`, and bits `2k, 2k+1` of `qh` on top.
#[inline(always)]
pub(crate) fn q6k_quant(block: &[u8], e: usize) -> u8 {
    let (half, k, l) = (e / 128, (e % 128) / 32, e % 32);
    let ql = block[64 * half + 32 * (k % 2) + l];
    let low = if k < 2 { ql & 15 } else { ql >> 4 };
    let high = (block[Q6K_QH + 32 * half + l] >> (2 * k)) & 3;
    low | (high << 4)
}

/// A whole Q4_K (`five` false) or Q5_K block's quants, as [`q4k_quant`]
/// and [`q5k_quant`] give them one by one: chunk c of 64 takes the low
/// nibbles of `qs[32c..32c + 32]`, then their high nibbles; Q5_K's fifth
/// bits are bits 2c and 2c + 1 of `qh`. (Fixed-size arrays throughout, so
/// the loops have no bounds checks and vectorize: the portable unpacking
/// of the k-quant GEMMs' rows.)
#[inline(always)]
pub(crate) fn q45k_quants(b: &[u8], five: bool, q: &mut [u8; QK_K]) {
    let qs: &[u8; 128] = b[if five { Q5K_QS } else { Q4K_QS }..][..128].try_into().expect("128 bytes");
    let qh: [u8; 32] = if five { b[Q5K_QH..Q5K_QH + 32].try_into().expect("32 bytes") } else { [0; 32] };
    for c in 0..4 {
        for l in 0..32 {
            let (byte, high) = (qs[32 * c + l], qh[l] >> (2 * c));
            q[64 * c + l] = (byte & 15) | ((high & 1) << 4);
            q[64 * c + 32 + l] = (byte >> 4) | (((high >> 1) & 1) << 4);
        }
    }
}

/// A whole Q6_K block's quants as stored (0..64), as [`q6k_quant`] gives
/// them one by one: each half of 128 takes `ql`'s 64 bytes (low nibbles
/// for its first 64 elements, high for the rest) and `qh`'s 32 (two bits
/// per quarter of 32).
#[inline(always)]
pub(crate) fn q6k_quants(b: &[u8], q: &mut [u8; QK_K]) {
    for h in 0..2 {
        let ql: &[u8; 64] = b[64 * h..64 * h + 64].try_into().expect("64 bytes");
        let qh: &[u8; 32] = b[Q6K_QH + 32 * h..Q6K_QH + 32 * h + 32].try_into().expect("32 bytes");
        for l in 0..32 {
            let (a, c, high) = (ql[l], ql[32 + l], qh[l]);
            q[128 * h + l] = (a & 15) | ((high & 3) << 4);
            q[128 * h + 32 + l] = (c & 15) | (((high >> 2) & 3) << 4);
            q[128 * h + 64 + l] = (a >> 4) | (((high >> 4) & 3) << 4);
            q[128 * h + 96 + l] = (c >> 4) | (((high >> 6) & 3) << 4);
        }
    }
}

/// Q5_0 quant `j` (0..32) as stored (0..32; the value is this minus 16):
/// the Q4_0 nibble plus bit `j` of the little-endian u32 `qh` as 16.
#[inline(always)]
pub(crate) fn q5_0_quant(block: &[u8], j: usize) -> u8 {
    five_bits(&block[2..], j)
}

/// Q5_1 quant `j` (0..32): Q5_0's five bits, after the extra `m`.
#[inline(always)]
pub(crate) fn q5_1_quant(block: &[u8], j: usize) -> u8 {
    five_bits(&block[4..], j)
}

/// Element `j` of a `qh[4]`, `qs[16]` run (Q5_0, Q5_1): the nibble plus
/// bit `j` of the little-endian u32 `qh` as 16.
#[inline(always)]
fn five_bits(run: &[u8], j: usize) -> u8 {
    let qh = u32::from_le_bytes([run[0], run[1], run[2], run[3]]);
    let byte = run[4 + j % 16];
    let nibble = if j < 16 { byte & 15 } else { byte >> 4 };
    nibble | ((((qh >> j) & 1) as u8) << 4)
}

// ---------------------------------------------------------------------------
// Dequantization

/// Decode a row of `kind`'s bytes into `out`, as ggml's `dequantize_row_*`
/// does (same f32 operations, so the same bits). `out.len()` elements are
/// read from `bytes`, which must be exactly that many elements' bytes.
pub fn dequantize_row(kind: QuantKind, bytes: &[u8], out: &mut [f32]) -> Result<(), QuantError> {
    let expected = kind.row_bytes(out.len())?;
    if bytes.len() != expected {
        return Err(QuantError::LengthMismatch {
            kind,
            row: bytes.len() / kind.block_bytes() * kind.block_elems(),
            activations: out.len(),
        });
    }
    let bb = kind.block_bytes();
    let be = kind.block_elems();
    for (block, y) in bytes.chunks_exact(bb).zip(out.chunks_exact_mut(be)) {
        match kind {
            QuantKind::F32 => y[0] = f32::from_le_bytes([block[0], block[1], block[2], block[3]]),
            QuantKind::F16 => y[0] = half_at(block, 0),
            QuantKind::Bf16 => y[0] = bf16::from_bits(u16::from_le_bytes([block[0], block[1]])).to_f32(),
            QuantKind::Q4_0 => dequant_q4_0(block, y),
            QuantKind::Q5_0 => {
                let d = half_at(block, 0);
                for (j, v) in y.iter_mut().enumerate() {
                    *v = (q5_0_quant(block, j) as i32 - 16) as f32 * d;
                }
            }
            QuantKind::Q5_1 => {
                let (d, m) = (half_at(block, 0), half_at(block, 2));
                for (j, v) in y.iter_mut().enumerate() {
                    *v = q5_1_quant(block, j) as f32 * d + m;
                }
            }
            QuantKind::Q8_0 => dequant_q8_0(block, y),
            QuantKind::Q4K => dequant_q4k(block, y),
            QuantKind::Q5K => dequant_q5k(block, y),
            QuantKind::Q6K => dequant_q6k(block, y),
        }
    }
    Ok(())
}

fn dequant_q4_0(b: &[u8], y: &mut [f32]) {
    let d = half_at(b, 0);
    for j in 0..16 {
        let q = b[2 + j];
        y[j] = ((q & 15) as i32 - 8) as f32 * d;
        y[j + 16] = ((q >> 4) as i32 - 8) as f32 * d;
    }
}

fn dequant_q8_0(b: &[u8], y: &mut [f32]) {
    let d = half_at(b, 0);
    for j in 0..32 {
        y[j] = (b[2 + j] as i8) as f32 * d;
    }
}

fn dequant_q4k(b: &[u8], y: &mut [f32]) {
    let (d, dmin) = (half_at(b, 0), half_at(b, 2));
    let (sc, mn) = k_scales_mins(&b[K_SCALES..K_SCALES + 12]);
    let qs = &b[Q4K_QS..Q4K_QS + 128];
    for (e, v) in y.iter_mut().enumerate() {
        let s = e / 32;
        *v = d * sc[s] as f32 * q4k_quant(qs, e) as f32 - dmin * mn[s] as f32;
    }
}

fn dequant_q5k(b: &[u8], y: &mut [f32]) {
    let (d, dmin) = (half_at(b, 0), half_at(b, 2));
    let (sc, mn) = k_scales_mins(&b[K_SCALES..K_SCALES + 12]);
    let qh = &b[Q5K_QH..Q5K_QH + 32];
    let qs = &b[Q5K_QS..Q5K_QS + 128];
    for (e, v) in y.iter_mut().enumerate() {
        let s = e / 32;
        *v = d * sc[s] as f32 * q5k_quant(qh, qs, e) as f32 - dmin * mn[s] as f32;
    }
}

fn dequant_q6k(b: &[u8], y: &mut [f32]) {
    let d = half_at(b, Q6K_D);
    for (e, v) in y.iter_mut().enumerate() {
        let sc = b[Q6K_SCALES + e / 16] as i8;
        *v = d * sc as f32 * (q6k_quant(b, e) as i32 - 32) as f32;
    }
}

// ---------------------------------------------------------------------------
// Activation blocks

/// ggml's `block_q8_K`: 256 activations as `d × qs`, with the sums of each
/// 16 quants precomputed (the k-quant kernels use them for the weight
/// blocks' minimum and offset terms).
#[derive(Clone, Copy, Debug, PartialEq)]
#[repr(C)]
pub struct BlockQ8K {
    pub d: f32,
    pub qs: [i8; QK_K],
    pub bsums: [i16; QK_K / 16],
}

/// ggml's `block_q8_0`: 32 values as `d × qs`, `d` in half precision.
#[derive(Clone, Copy, Debug, PartialEq)]
#[repr(C)]
pub struct BlockQ8_0 {
    pub d: f16,
    pub qs: [i8; QK8_0],
}

/// ggml's `block_q8_1`, what Q5_1 weights multiply: Q8_0's `d` and
/// quants, and `s`, the block's sum `d × Σ qs` (from the f32 `d`) for the
/// weights' `m` term. ggml stores `s` in half precision; so does this,
/// in an f32, wherever it fits. Past half precision's range (block sums
/// past 65504, where ggml's `s` is infinite and its product NaN or
/// infinite) it keeps the f32 value, so such activations still multiply.
#[derive(Clone, Copy, Debug, PartialEq)]
#[repr(C)]
pub struct BlockQ8_1 {
    pub d: f16,
    pub s: f32,
    pub qs: [i8; QK8_0],
}

const _: () = assert!(std::mem::size_of::<BlockQ8K>() == 292);
const _: () = assert!(std::mem::size_of::<BlockQ8_0>() == 34);
const _: () = assert!(std::mem::size_of::<BlockQ8_1>() == 40);

/// What the 32-element kernels read of an activation block (Q8_0, Q8_1).
pub(crate) trait Block32: Copy {
    fn d(&self) -> f16;
    fn qs(&self) -> &[i8; QK8_0];
    /// Q8_1's `s`; zero for Q8_0, which has none (its weights have no `m`).
    fn s(&self) -> f32;
}

impl Block32 for BlockQ8_0 {
    fn d(&self) -> f16 {
        self.d
    }
    fn qs(&self) -> &[i8; QK8_0] {
        &self.qs
    }
    fn s(&self) -> f32 {
        0.0
    }
}

impl Block32 for BlockQ8_1 {
    fn d(&self) -> f16 {
        self.d
    }
    fn qs(&self) -> &[i8; QK8_0] {
        &self.qs
    }
    fn s(&self) -> f32 {
        self.s
    }
}

impl BlockQ8K {
    /// ggml's bytes of these blocks (little-endian fields, no padding).
    pub fn to_bytes(blocks: &[BlockQ8K]) -> Vec<u8> {
        let mut out = Vec::with_capacity(blocks.len() * 292);
        for b in blocks {
            out.extend_from_slice(&b.d.to_le_bytes());
            out.extend(b.qs.iter().map(|&q| q as u8));
            for s in b.bsums {
                out.extend_from_slice(&s.to_le_bytes());
            }
        }
        out
    }

    /// Blocks from ggml's bytes, refusing what the kernels could not
    /// multiply exactly: a -128 quant, or a `bsums` entry that is not the
    /// sum of its quants.
    pub fn from_bytes(bytes: &[u8]) -> Result<Vec<BlockQ8K>, QuantError> {
        if !bytes.len().is_multiple_of(292) {
            return Err(QuantError::BadActivations { kind: "Q8_K", block: bytes.len() / 292, why: "partial block" });
        }
        bytes
            .chunks_exact(292)
            .enumerate()
            .map(|(i, c)| {
                let mut b = BlockQ8K { d: f32::from_le_bytes([c[0], c[1], c[2], c[3]]), qs: [0; QK_K], bsums: [0; 16] };
                for (q, &byte) in b.qs.iter_mut().zip(&c[4..260]) {
                    *q = byte as i8;
                }
                for (j, s) in b.bsums.iter_mut().enumerate() {
                    *s = i16::from_le_bytes([c[260 + 2 * j], c[261 + 2 * j]]);
                }
                check_q8(&b.qs, "Q8_K", i)?;
                for j in 0..16 {
                    let sum: i32 = b.qs[16 * j..16 * j + 16].iter().map(|&q| q as i32).sum();
                    if sum != b.bsums[j] as i32 {
                        return Err(QuantError::BadActivations { kind: "Q8_K", block: i, why: "bsums is not the sum of its quants" });
                    }
                }
                Ok(b)
            })
            .collect()
    }
}

impl BlockQ8_0 {
    /// ggml's bytes of these blocks.
    pub fn to_bytes(blocks: &[BlockQ8_0]) -> Vec<u8> {
        let mut out = Vec::with_capacity(blocks.len() * 34);
        for b in blocks {
            out.extend_from_slice(&b.d.to_bits().to_le_bytes());
            out.extend(b.qs.iter().map(|&q| q as u8));
        }
        out
    }

    /// Blocks from ggml's bytes, refusing -128 quants (see [`BlockQ8K::from_bytes`]).
    pub fn from_bytes(bytes: &[u8]) -> Result<Vec<BlockQ8_0>, QuantError> {
        if !bytes.len().is_multiple_of(34) {
            return Err(QuantError::BadActivations { kind: "Q8_0", block: bytes.len() / 34, why: "partial block" });
        }
        bytes
            .chunks_exact(34)
            .enumerate()
            .map(|(i, c)| {
                let mut b = BlockQ8_0 { d: f16::from_bits(u16::from_le_bytes([c[0], c[1]])), qs: [0; QK8_0] };
                for (q, &byte) in b.qs.iter_mut().zip(&c[2..]) {
                    *q = byte as i8;
                }
                check_q8(&b.qs, "Q8_0", i)?;
                Ok(b)
            })
            .collect()
    }
}

fn check_q8(qs: &[i8], kind: &'static str, block: usize) -> Result<(), QuantError> {
    if qs.contains(&i8::MIN) {
        return Err(QuantError::BadActivations { kind, block, why: "quant -128 (the kernels need -127..=127)" });
    }
    Ok(())
}

/// ggml's `nearest_int`: round to nearest, ties to even, by adding 1.5 × 2²³
/// so the integer lands in the mantissa. Exact for |x| < 2²²; the callers
/// stay within ±128. Written as ggml writes it (not `round_ties_even`) so
/// that even out-of-range inputs (NaN from a NaN activation) give its bits.
#[inline(always)]
fn nearest_int(x: f32) -> i32 {
    let bits = (x + 12_582_912.0).to_bits() as i32;
    (bits & 0x007f_ffff) - 0x0040_0000
}

/// That `elements` activations fill whole blocks of `kind`'s (the weights
/// they will multiply) and `blocks` of them.
fn check_blocks(kind: QuantKind, elements: usize, blocks: usize) -> Result<(), QuantError> {
    let block = kind.block_elems();
    if !elements.is_multiple_of(block) {
        return Err(QuantError::PartialElements { kind, elements, block });
    }
    if blocks != elements / block {
        return Err(QuantError::OutputSize { got: blocks, expected: elements / block });
    }
    Ok(())
}

/// Quantize f32 activations to Q8_K as ggml's `quantize_row_q8_K_ref` does:
/// per block, the element of largest magnitude (the first, on ties) maps to
/// exactly -127 (`iscale = -127 / max`, `d = 1 / iscale`), the rest round to
/// nearest (ties to even). An all-zero block is `d = 0`, all quants zero.
/// Quants are clamped to [-127, 127]; for finite input that never bites
/// (ggml clamps only the top), it only keeps non-finite input from
/// breaking the kernels' invariants.
pub fn quantize_q8_k(x: &[f32]) -> Result<Vec<BlockQ8K>, QuantError> {
    let mut out = vec![BlockQ8K { d: 0.0, qs: [0; QK_K], bsums: [0; 16] }; x.len() / QK_K];
    quantize_q8_k_into(x, &mut out)?;
    Ok(out)
}

/// [`quantize_q8_k`] into blocks the caller owns (`x.len() / 256` of them),
/// so that a hot path reuses its buffers.
pub fn quantize_q8_k_into(x: &[f32], out: &mut [BlockQ8K]) -> Result<(), QuantError> {
    check_blocks(QuantKind::Q4K, x.len(), out.len())?;
    for (b, xs) in out.iter_mut().zip(x.chunks_exact(QK_K)) {
        *b = BlockQ8K { d: 0.0, qs: [0; QK_K], bsums: [0; 16] };
        // ggml's scan keeps the first element of the largest magnitude
        // (NaN never wins); found here in two passes that vectorize, the
        // magnitude in sixteen lanes and then its first holder.
        let amax = abs_max(xs);
        if amax == 0.0 {
            continue;
        }
        let max = *xs.iter().find(|v| v.abs() == amax).expect("an element holds the largest magnitude");
        let iscale = -127.0 / max;
        for (q, &v) in b.qs.iter_mut().zip(xs) {
            *q = nearest_int(iscale * v).clamp(-127, 127) as i8;
        }
        for (j, s) in b.bsums.iter_mut().enumerate() {
            *s = b.qs[16 * j..16 * j + 16].iter().map(|&q| q as i16).sum();
        }
        b.d = 1.0 / iscale;
    }
    Ok(())
}

/// Quantize f32 activations to Q8_0 as llama.cpp's matrix products do on
/// x86 (ggml-cpu's `quantize_row_q8_0` for AVX and AVX2, on every CPU that
/// Duplex serves): `d = max|x| / 127` (stored in half precision), quants
/// `x · (127 / max|x|)` rounded half to even. (ggml's `_ref` code, its
/// portable fallback, multiplies by `1 / d` and rounds half away from
/// zero: some quants differ by one.)
pub fn quantize_q8_0(x: &[f32]) -> Result<Vec<BlockQ8_0>, QuantError> {
    let mut out = vec![BlockQ8_0 { d: f16::ZERO, qs: [0; QK8_0] }; x.len() / QK8_0];
    quantize_q8_0_into(x, &mut out)?;
    Ok(out)
}

/// [`quantize_q8_0`] into blocks the caller owns (`x.len() / 32` of them).
pub fn quantize_q8_0_into(x: &[f32], out: &mut [BlockQ8_0]) -> Result<(), QuantError> {
    check_blocks(QuantKind::Q8_0, x.len(), out.len())?;
    for (b, xs) in out.iter_mut().zip(x.chunks_exact(QK8_0)) {
        b.d = f16::from_f32(quantize_32(xs, &mut b.qs));
    }
    Ok(())
}

/// One block of [`quantize_q8_0`]: the quants into `qs`; returns the f32 `d`.
/// The clamp changes nothing but keeps `nearest_int` (halves to even)
/// inside its range; NaN gives 0.
fn quantize_32(xs: &[f32], qs: &mut [i8; QK8_0]) -> f32 {
    let amax = abs_max(xs);
    let d = amax / 127.0;
    let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
    for (q, &v) in qs.iter_mut().zip(xs) {
        let y = v * id;
        *q = if y.is_nan() { 0 } else { nearest_int(y.clamp(-127.0, 127.0)) as i8 };
    }
    d
}

/// The largest magnitude in `xs`, NaN ignored (0 when there is none),
/// kept in sixteen lanes so that it vectorizes. `f32::max` is exact and
/// ignores NaN in any order, so the lanes give the sequential scan's value.
#[inline(always)]
fn abs_max(xs: &[f32]) -> f32 {
    let mut lanes = [0.0f32; 16];
    let chunks = xs.chunks_exact(16);
    let tail = chunks.remainder().iter().fold(0.0f32, |m, v| m.max(v.abs()));
    for c in chunks {
        for (l, v) in lanes.iter_mut().zip(c) {
            *l = l.max(v.abs());
        }
    }
    lanes.into_iter().fold(tail, f32::max)
}

/// Quantize f32 activations to Q8_1 as llama.cpp's matrix products do on
/// x86 (`quantize_row_q8_1`): [`quantize_q8_0`]'s quants and `d`, and
/// `s = d × Σ qs` with the f32 `d`,
/// rounded to half precision where it fits (see [`BlockQ8_1`]).
pub fn quantize_q8_1(x: &[f32]) -> Result<Vec<BlockQ8_1>, QuantError> {
    let mut out = vec![BlockQ8_1 { d: f16::ZERO, s: 0.0, qs: [0; QK8_0] }; x.len() / QK8_0];
    quantize_q8_1_into(x, &mut out)?;
    Ok(out)
}

/// [`quantize_q8_1`] into blocks the caller owns (`x.len() / 32` of them).
pub fn quantize_q8_1_into(x: &[f32], out: &mut [BlockQ8_1]) -> Result<(), QuantError> {
    check_blocks(QuantKind::Q5_1, x.len(), out.len())?;
    for (b, xs) in out.iter_mut().zip(x.chunks_exact(QK8_0)) {
        let d = quantize_32(xs, &mut b.qs);
        let s = b.qs.iter().map(|&q| q as i32).sum::<i32>() as f32 * d;
        let half = f16::from_f32(s).to_f32();
        (b.d, b.s) = (f16::from_f32(d), if half.is_finite() || !s.is_finite() { half } else { s });
    }
    Ok(())
}

/// Dequantize Q8_K activations (`d × q`), for tests and error bounds.
pub fn dequantize_q8_k(blocks: &[BlockQ8K]) -> Vec<f32> {
    blocks.iter().flat_map(|b| b.qs.iter().map(move |&q| b.d * q as f32)).collect()
}

/// Dequantize Q8_1 activations (`d × q`; `s` is their sum's, not a value).
pub fn dequantize_q8_1(blocks: &[BlockQ8_1]) -> Vec<f32> {
    blocks.iter().flat_map(|b| b.qs.iter().map(move |&q| b.d.to_f32() * q as f32)).collect()
}

/// Dequantize Q8_0 activations (`d × q`).
pub fn dequantize_q8_0(blocks: &[BlockQ8_0]) -> Vec<f32> {
    blocks.iter().flat_map(|b| b.qs.iter().map(move |&q| b.d.to_f32() * q as f32)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The whole-block unpackings give the per-element decoders' quants,
    /// on any CPU (the SIMD unpacking is held to them in `klanes`).
    #[test]
    fn block_quants_are_the_element_quants() {
        let mut s = 0x2545_f491_4f6c_dd1du64;
        for _ in 0..20 {
            let block: Vec<u8> = (0..QuantKind::Q5K.block_bytes().max(QuantKind::Q6K.block_bytes()))
                .map(|_| {
                    s ^= s << 13;
                    s ^= s >> 7;
                    s ^= s << 17;
                    s as u8
                })
                .collect();
            let mut q = [0u8; QK_K];
            for five in [false, true] {
                q45k_quants(&block, five, &mut q);
                for (e, &v) in q.iter().enumerate() {
                    let want = if five { q5k_quant(&block[Q5K_QH..], &block[Q5K_QS..], e) } else { q4k_quant(&block[Q4K_QS..], e) };
                    assert_eq!(v, want, "Q{}_K quant {e}", if five { 5 } else { 4 });
                }
            }
            q6k_quants(&block, &mut q);
            for (e, &v) in q.iter().enumerate() {
                assert_eq!(v, q6k_quant(&block, e), "Q6_K quant {e}");
            }
        }
    }
}
