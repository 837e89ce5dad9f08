//! Linear-layer products over stored weight formats.
//!
//! A weight is a row-major `[rows, cols]` matrix (`out_features × in_features`,
//! as PyTorch stores it). FP8 weights carry one F32 scale per
//! `block[0] × block[1]` tile (`weight_scale_inv` in the checkpoint); edge
//! tiles may be partial. Products are *post-scaled*: each block's dot product
//! is accumulated over the raw FP8 values and multiplied by its scale once,
//! which is exactly the order the fast kernels use.

use crate::fp8::E4M3_TABLE;
use crate::quant::{self, DotPath, QuantKind, QuantizedTokens};
use std::ops::Range;

/// How the bytes of a weight matrix encode its values.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WeightFormat {
    F32,
    Bf16,
    F16,
    /// FP8 E4M3FN with one F32 scale per `[block_rows, block_cols]` tile.
    Fp8E4m3 { block: [usize; 2] },
    /// One of ggml's block formats (a GGUF k-quant or Q4_0/Q5_0/Q8_0): each
    /// row is whole blocks that carry their own scales. Products quantize
    /// the activations to 8 bits first, as llama.cpp does (see [`crate::quant`]).
    /// Never F32/F16/BF16, which are the plain formats above.
    Quant(QuantKind),
}

impl WeightFormat {
    /// Bytes per element of a plain or FP8 format; block formats have none
    /// (see [`Self::row_bytes`]).
    pub fn bytes_per_element(self) -> usize {
        match self {
            WeightFormat::F32 => 4,
            WeightFormat::Bf16 | WeightFormat::F16 => 2,
            WeightFormat::Fp8E4m3 { .. } => 1,
            WeightFormat::Quant(kind) => panic!("{kind} is a block format: ask row_bytes"),
        }
    }

    /// Bytes of one row of `cols` elements (for block formats, `cols` must
    /// be whole blocks, which loading checks).
    pub fn row_bytes(self, cols: usize) -> usize {
        match self {
            WeightFormat::Quant(kind) => cols / kind.block_elems() * kind.block_bytes(),
            _ => cols * self.bytes_per_element(),
        }
    }

    /// The format of a GGUF tensor of `kind`.
    pub fn of_quant(kind: QuantKind) -> WeightFormat {
        match kind {
            QuantKind::F32 => WeightFormat::F32,
            QuantKind::F16 => WeightFormat::F16,
            QuantKind::Bf16 => WeightFormat::Bf16,
            _ => WeightFormat::Quant(kind),
        }
    }
}

/// A borrowed weight matrix: raw little-endian bytes plus, for FP8, its scales
/// (row-major `[ceil(rows/b0), ceil(cols/b1)]`).
#[derive(Clone, Copy, Debug)]
pub struct WeightView<'a> {
    pub rows: usize,
    pub cols: usize,
    pub format: WeightFormat,
    pub data: &'a [u8],
    pub scales: &'a [f32],
}

impl<'a> WeightView<'a> {
    /// Column-block width used for post-scaling (the whole row if unscaled).
    fn col_block(&self) -> usize {
        match self.format {
            WeightFormat::Fp8E4m3 { block } => block[1],
            _ => self.cols.max(1),
        }
    }

    /// Scale of tile (row `r`, column block `cb`); 1 for unscaled formats.
    #[inline]
    fn scale(&self, r: usize, cb: usize) -> f32 {
        match self.format {
            WeightFormat::Fp8E4m3 { block } => {
                let col_blocks = self.cols.div_ceil(block[1]);
                self.scales[(r / block[0]) * col_blocks + cb]
            }
            _ => 1.0,
        }
    }

    /// Decode row `r` without its scales into `out` (`cols` long).
    pub fn decode_row_unscaled(&self, r: usize, out: &mut [f32]) {
        let row_bytes = self.format.row_bytes(self.cols);
        let bytes = &self.data[r * row_bytes..(r + 1) * row_bytes];
        match self.format {
            WeightFormat::Quant(kind) => {
                // Loading checked that rows are whole blocks.
                quant::dequantize_row(kind, bytes, &mut out[..self.cols]).expect("a checked block-quantized row");
            }
            WeightFormat::Fp8E4m3 { .. } => {
                for (o, &b) in out.iter_mut().zip(bytes) {
                    *o = E4M3_TABLE[b as usize];
                }
            }
            WeightFormat::Bf16 => {
                for (o, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                    *o = half::bf16::from_le_bytes([b[0], b[1]]).to_f32();
                }
            }
            WeightFormat::F16 => {
                for (o, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                    *o = half::f16::from_le_bytes([b[0], b[1]]).to_f32();
                }
            }
            WeightFormat::F32 => {
                for (o, b) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                    *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                }
            }
        }
    }

    /// Decode row `r`, scales applied, into `out` (`cols` long).
    pub fn decode_row(&self, r: usize, out: &mut [f32]) {
        self.decode_row_unscaled(r, out);
        let cb = self.col_block();
        for (b, chunk) in out[..self.cols].chunks_mut(cb).enumerate() {
            let s = self.scale(r, b);
            if s != 1.0 {
                chunk.iter_mut().for_each(|v| *v *= s);
            }
        }
    }
}

/// Dot product with four independent accumulators.
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let mut acc = [0.0f32; 4];
    let chunks = n / 4;
    for i in 0..chunks {
        for j in 0..4 {
            acc[j] += a[4 * i + j] * b[4 * i + j];
        }
    }
    let mut tail = 0.0;
    for i in chunks * 4..n {
        tail += a[i] * b[i];
    }
    (acc[0] + acc[1]) + (acc[2] + acc[3]) + tail
}

/// `out[i, r] = Σ_c W[r, c] · x[i, c]` for `n` input rows: `x` is `[n, cols]`,
/// `out` is `[n, rows]`.
pub fn matmul(w: &WeightView, x: &[f32], n: usize, out: &mut [f32]) {
    matmul_rows(w, 0..w.rows, x, n, out)
}

/// [`matmul`] restricted to a band of output rows: `out` is `[n, rows.len()]`.
pub fn matmul_rows(w: &WeightView, rows: Range<usize>, x: &[f32], n: usize, out: &mut [f32]) {
    let cols = w.cols;
    let m = rows.len();
    assert!(rows.end <= w.rows, "matmul_rows: rows out of range");
    assert_eq!(x.len(), n * cols, "matmul: input is not [n, cols]");
    assert_eq!(out.len(), n * m, "matmul: output is not [n, rows]");
    if let WeightFormat::Quant(kind) = w.format {
        return matmul_quant(kind, w, rows, x, n, out, DotPath::Scalar);
    }
    let cb = w.col_block();
    let mut row = vec![0.0f32; cols];
    for (j, r) in rows.enumerate() {
        w.decode_row_unscaled(r, &mut row);
        for i in 0..n {
            let xi = &x[i * cols..(i + 1) * cols];
            let mut acc = 0.0f32;
            for (b, (wc, xc)) in row.chunks(cb).zip(xi.chunks(cb)).enumerate() {
                acc += dot(wc, xc) * w.scale(r, b);
            }
            out[i * m + j] = acc;
        }
    }
}

/// A band of rows of block-quantized weights against `n` tokens of `x`,
/// as llama.cpp computes it: each token quantized to 8 bits (Q8_K or Q8_0,
/// as the format pairs), then integer block dot products on `path`. Every
/// path gives the scalar reference's bits (see [`crate::quant`]).
pub fn matmul_quant(kind: QuantKind, w: &WeightView, rows: Range<usize>, x: &[f32], n: usize, out: &mut [f32], path: DotPath) {
    let row_bytes = w.format.row_bytes(w.cols);
    let mut acts = QuantizedTokens::default();
    // Loading checked the shapes (whole blocks per row, the data's length),
    // so what could fail here is a caller's bug.
    acts.quantize(kind, x, n).expect("activations of whole blocks");
    quant::matmul(path, kind, &w.data[rows.start * row_bytes..rows.end * row_bytes], rows.len(), &acts, out).expect("a checked block-quantized band");
}

/// Transposed product over a band of rows: `out[c] = Σ_{r ∈ rows} x[r - rows.start] · W[r, c]`.
/// This is how MLA folds `kv_b_proj` into the query without materialising it.
pub fn matmul_t_rows(w: &WeightView, rows: Range<usize>, x: &[f32], out: &mut [f32]) {
    assert_eq!(x.len(), rows.len(), "matmul_t_rows: input length");
    assert_eq!(out.len(), w.cols, "matmul_t_rows: output length");
    out.iter_mut().for_each(|o| *o = 0.0);
    let mut row = vec![0.0f32; w.cols];
    for (r, &xr) in rows.zip(x) {
        w.decode_row(r, &mut row);
        for (o, &v) in out.iter_mut().zip(&row) {
            *o += xr * v;
        }
    }
}

/// An owned weight matrix, for weights the engine derives at load time.
#[derive(Clone, Debug, PartialEq)]
pub struct OwnedWeight {
    pub rows: usize,
    pub cols: usize,
    pub format: WeightFormat,
    pub data: Vec<u8>,
    pub scales: Vec<f32>,
}

impl OwnedWeight {
    pub fn view(&self) -> WeightView<'_> {
        WeightView { rows: self.rows, cols: self.cols, format: self.format, data: &self.data, scales: &self.scales }
    }
}

/// The transpose of rows `rows` of `w`: a `[w.cols, rows.len()]` matrix with
/// exactly the same values. MLA's absorbed decode multiplies by the transpose
/// of a band of `kv_b_proj`; transposed, that product is an ordinary GEMV.
///
/// FP8 stays FP8 when the band starts on a scale-block boundary: the codes
/// move and the `[b0, b1]` scale grid transposes into a `[b1, b0]` one.
/// Otherwise (and for F16) the values are dequantised to F32; BF16 and F32
/// transpose as they are.
pub fn transpose_rows(w: &WeightView, rows: Range<usize>) -> OwnedWeight {
    assert!(rows.end <= w.rows, "transpose_rows: rows out of range");
    let (m, n) = (rows.len(), w.cols);
    match w.format {
        WeightFormat::Fp8E4m3 { block: [b0, b1] } if rows.start.is_multiple_of(b0) => {
            let mut data = vec![0u8; m * n];
            for (j, r) in rows.clone().enumerate() {
                for c in 0..n {
                    data[c * m + j] = w.data[r * n + c];
                }
            }
            let (sr, sc) = (m.div_ceil(b0), n.div_ceil(b1));
            let src_cols = n.div_ceil(b1);
            let first = rows.start / b0;
            let mut scales = vec![0.0; sc * sr];
            for i in 0..sr {
                for k in 0..sc {
                    scales[k * sr + i] = w.scales[(first + i) * src_cols + k];
                }
            }
            OwnedWeight { rows: n, cols: m, format: WeightFormat::Fp8E4m3 { block: [b1, b0] }, data, scales }
        }
        WeightFormat::Bf16 | WeightFormat::F32 => {
            let bpe = w.format.bytes_per_element();
            let mut data = vec![0u8; m * n * bpe];
            for (j, r) in rows.clone().enumerate() {
                for c in 0..n {
                    let src = (r * n + c) * bpe;
                    let dst = (c * m + j) * bpe;
                    data[dst..dst + bpe].copy_from_slice(&w.data[src..src + bpe]);
                }
            }
            OwnedWeight { rows: n, cols: m, format: w.format, data, scales: vec![] }
        }
        _ => {
            let mut data = vec![0u8; m * n * 4];
            let mut row = vec![0.0f32; n];
            for (j, r) in rows.clone().enumerate() {
                w.decode_row(r, &mut row);
                for (c, v) in row.iter().enumerate() {
                    data[(c * m + j) * 4..(c * m + j + 1) * 4].copy_from_slice(&v.to_le_bytes());
                }
            }
            OwnedWeight { rows: n, cols: m, format: WeightFormat::F32, data, scales: vec![] }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Dense f32 reference: dequantise everything, then multiply naively in f64.
    fn dense(w: &WeightView) -> Vec<f64> {
        let mut m = vec![0.0; w.rows * w.cols];
        let mut row = vec![0.0f32; w.cols];
        for r in 0..w.rows {
            w.decode_row_unscaled(r, &mut row);
            for c in 0..w.cols {
                let s = match w.format {
                    WeightFormat::Fp8E4m3 { block } => {
                        w.scales[(r / block[0]) * w.cols.div_ceil(block[1]) + c / block[1]]
                    }
                    _ => 1.0,
                };
                m[r * w.cols + c] = row[c] as f64 * s as f64;
            }
        }
        m
    }

    fn fp8_case() -> impl Strategy<Value = (usize, usize, usize, usize, Vec<u8>, Vec<f32>, Vec<f32>)> {
        (1usize..300, 1usize..300, 1usize..4, prop::sample::select(vec![16usize, 32, 128]))
            .prop_flat_map(|(rows, cols, n, b)| {
                let nscales = rows.div_ceil(b) * cols.div_ceil(b);
                (
                    Just(rows),
                    Just(cols),
                    Just(n),
                    Just(b),
                    // Avoid the two NaN codes.
                    prop::collection::vec(any::<u8>().prop_map(|c| if c & 0x7f == 0x7f { 0 } else { c }), rows * cols),
                    prop::collection::vec(0.001f32..2.0, nscales),
                    prop::collection::vec(-1.0f32..1.0, n * cols),
                )
            })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]
        #[test]
        fn fp8_matmul_matches_dense_reference((rows, cols, n, b, data, scales, x) in fp8_case()) {
            let w = WeightView { rows, cols, format: WeightFormat::Fp8E4m3 { block: [b, b] }, data: &data, scales: &scales };
            let m = dense(&w);
            let mut out = vec![0.0; n * rows];
            matmul(&w, &x, n, &mut out);
            for i in 0..n {
                for r in 0..rows {
                    let want: f64 = (0..cols).map(|c| m[r * cols + c] * x[i * cols + c] as f64).sum();
                    let scale: f64 = (0..cols).map(|c| (m[r * cols + c] * x[i * cols + c] as f64).abs()).sum::<f64>() + 1e-6;
                    prop_assert!(((out[i * rows + r] as f64 - want) / scale).abs() < 1e-5);
                }
            }
            // Transposed band product over the whole matrix.
            let xt: Vec<f32> = x[..rows.min(x.len())].iter().cycle().take(rows).copied().collect();
            let mut t = vec![0.0; cols];
            matmul_t_rows(&w, 0..rows, &xt, &mut t);
            for c in 0..cols {
                let want: f64 = (0..rows).map(|r| m[r * cols + c] * xt[r] as f64).sum();
                let scale: f64 = (0..rows).map(|r| (m[r * cols + c] * xt[r] as f64).abs()).sum::<f64>() + 1e-6;
                prop_assert!(((t[c] as f64 - want) / scale).abs() < 1e-5);
            }
        }
    }

    #[test]
    fn partial_edge_blocks_use_their_own_scale() {
        // 3x5 matrix of 1.0 (code 0x38) with 2x2 blocks: scales grid is 2x3.
        let data = vec![0x38u8; 15];
        let scales = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0];
        let w = WeightView { rows: 3, cols: 5, format: WeightFormat::Fp8E4m3 { block: [2, 2] }, data: &data, scales: &scales };
        let mut row = vec![0.0; 5];
        w.decode_row(0, &mut row);
        assert_eq!(row, [1.0, 1.0, 2.0, 2.0, 3.0]);
        w.decode_row(2, &mut row);
        assert_eq!(row, [4.0, 4.0, 5.0, 5.0, 6.0]);
        let mut out = vec![0.0; 3];
        matmul(&w, &[1.0; 5], 1, &mut out);
        assert_eq!(out, [9.0, 9.0, 24.0]);
    }

    #[test]
    fn half_formats_decode() {
        let vals = [1.5f32, -2.25, 0.0];
        let bf: Vec<u8> = vals.iter().flat_map(|v| half::bf16::from_f32(*v).to_le_bytes()).collect();
        let f16: Vec<u8> = vals.iter().flat_map(|v| half::f16::from_f32(*v).to_le_bytes()).collect();
        let f32b: Vec<u8> = vals.iter().flat_map(|v| v.to_le_bytes()).collect();
        for (fmt, data) in [(WeightFormat::Bf16, &bf), (WeightFormat::F16, &f16), (WeightFormat::F32, &f32b)] {
            let w = WeightView { rows: 1, cols: 3, format: fmt, data, scales: &[] };
            let mut row = vec![0.0; 3];
            w.decode_row(0, &mut row);
            assert_eq!(row, vals, "{fmt:?}");
        }
    }

    #[test]
    fn transpose_rows_is_exact_for_every_format() {
        let (rows, cols) = (300, 200);
        let data: Vec<u8> = (0..rows * cols).map(|i| (i * 7 % 251) as u8 & 0xf7).collect();
        let scales: Vec<f32> = (0..3 * 2).map(|i| 0.5 + i as f32).collect();
        let fp8 = WeightView { rows, cols, format: WeightFormat::Fp8E4m3 { block: [128, 128] }, data: &data, scales: &scales };
        let bf: Vec<u8> = data.iter().flat_map(|&b| half::bf16::from_f32(b as f32 - 100.0).to_le_bytes()).collect();
        let bf16 = WeightView { rows, cols, format: WeightFormat::Bf16, data: &bf, scales: &[] };
        for (w, band, keeps_format) in [(fp8, 128..300, true), (fp8, 64..192, false), (bf16, 10..50, true)] {
            let t = transpose_rows(&w, band.clone());
            assert_eq!((t.rows, t.cols), (cols, band.len()));
            assert_eq!(t.format == w.format || matches!((t.format, w.format), (WeightFormat::Fp8E4m3 { .. }, WeightFormat::Fp8E4m3 { .. })), keeps_format);
            let (mut src, mut dst) = (vec![0.0; cols], vec![0.0; band.len()]);
            for c in 0..cols {
                t.view().decode_row(c, &mut dst);
                for (j, r) in band.clone().enumerate() {
                    w.decode_row(r, &mut src);
                    assert_eq!(dst[j], src[c], "({r}, {c})");
                }
            }
        }
    }
}
