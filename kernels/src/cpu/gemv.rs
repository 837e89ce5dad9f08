//! Linear layers with BF16 activations: `out = x · Wᵀ` over FP8 (block-scaled)
//! or BF16 weights, dispatched to the SIMD level asked for.
//!
//! Decode (a handful of tokens) is memory-bound: the weights are streamed
//! once, every token's dot product is taken against each decoded weight
//! vector while it is in registers, and each scale block's sum is multiplied
//! by its scale once ("post-scaling", as `linear::matmul_rows` does).
//! Prefill (many tokens) runs over bands of 16 rows, one pass per group of
//! 8 tokens (4 on AVX2), so that each band's weights stay in cache across
//! the passes; at the `Avx512Bf16` level an FP8 band is first decoded into
//! a BF16 tile in the decode kernel's word order, and the passes take the
//! decode kernel's sums over it.
//!
//! Batch invariance: every output is computed in an order fixed by its row
//! and the columns, never by the number of tokens in the call, the token
//! groups, the row band or the other tokens' values, so a sequence gets the
//! same bits alone as in any batch (see `kernel::bands`). Hence one kernel
//! per level and format for every token count.
//!
//! AMX: where the CPU's BF16 tiles are usable, FP8 and BF16 products of
//! [`TILES_LEAST`] tokens or more run on them instead (`gemm_amx`, at the
//! AVX-512 BF16 levels): prefill's and a busy expert's. The tiles keep the
//! same invariance among themselves but sum in an order of their own, so
//! there a token's bits depend on whether its call held fewer tokens than
//! that (within f32 rounding of the sums either way); `DUPLEX_AMX=off`
//! keeps every call on the vectors.
//!
//! Levels (see [`Isa`]):
//! - `Avx512Fp16`: for FP8 weights, FP8 → FP16 with integer ops,
//!   `vfmadd231ph` over two 64-column lines, then f32; otherwise as below.
//! - `Avx512Bf16`: FP8 → BF16 with integer ops, `vdpbf16ps` into f32.
//! - `Avx512`: FP8 → f32 with integer ops, FMA.
//! - `Avx2`: FP8 → f16 (exact shift) → f32 via F16C, FMA.
//! - `Portable`: the scalar reference, `linear::matmul_rows`.
//!
//! F16 and F32 weights always take the portable path.
//!
//! Numerics: products are exact and accumulated in f32, so results differ
//! from the reference only by summation order, except on the `Avx512Fp16`
//! level's FP8 kernel, whose FP16 products and short sums are good to
//! 2⁻¹⁰ of the terms' magnitude (the tests' bound; BF16 activations carry
//! 2⁻⁹ each; see `gemv_avx512::fused_fp16`; `DUPLEX_ISA=avx512bf16` opts
//! out). Also: the SIMD levels' FP8 kernels read the two NaN codes (`0x7f`,
//! `0xff`) as ±480 instead of NaN; valid checkpoints never contain them,
//! and the portable level keeps them NaN.

use super::isa::Isa;
use crate::linear::{WeightFormat, WeightView};
use std::ops::Range;

pub use super::vector::{axpy_f32, dot_f32};

/// `out[i · rows.len() + j] = Σ_c W[rows.start + j, c] · x[i · cols + c]` for
/// `n` tokens of BF16 activations `x` (`[n, cols]` bit patterns), on the
/// kernels [`Products::for_tokens`] picks for `n`.
///
/// Works for every weight format and any shape; FP8 may have any block size
/// (multiples of 64 columns, like DeepSeek's 128, avoid masked tails).
pub fn matmul_bf16(isa: Isa, w: &WeightView, rows: Range<usize>, x: &[u16], n: usize, out: &mut [f32]) {
    matmul_bf16_on(isa, Products::for_tokens(n), w, rows, x, n, out)
}

/// Which kernels take a [`matmul_bf16`] call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Products {
    /// The vector kernels of the call's level: one kernel per level and
    /// format for any number of tokens, batch invariant (module docs).
    Vectors,
    /// FP8 and BF16 weights on AMX BF16 tiles (`tdpbf16ps`, see
    /// `gemm_amx`) at the AVX-512 BF16 levels, where [`Products::tiles_usable`];
    /// anything else on the vectors. The tiles sum in an order of their own,
    /// so a token's results are within f32 rounding of the vectors', not
    /// the same bits; among calls on the tiles, each token's results are
    /// the same bits whatever the other tokens.
    Tiles,
}

/// Tokens from which [`matmul_bf16`] takes the tiles, where usable: the
/// calls the vector kernels run in several passes over cached bands
/// (prefill's and a busy expert's), where they are bound by arithmetic,
/// not by reading the weights. Up to eight tokens they stream each weight
/// once from DRAM, which is decode's regime, and keep decode's bits.
/// (This machine's turning point is for an AMX machine to measure:
/// `cargo bench -p duplex-kernels --bench matmul_bf16` finds it.)
pub const TILES_LEAST: usize = 9;
#[cfg(target_arch = "x86_64")]
const _: () = assert!(TILES_LEAST == super::kernel::PASS_TOKENS + 1);

impl Products {
    /// What [`matmul_bf16`] takes for `n` tokens: the tiles from
    /// [`TILES_LEAST`] tokens, where they are usable.
    pub fn for_tokens(n: usize) -> Products {
        if n >= TILES_LEAST && Products::tiles_usable() {
            Products::Tiles
        } else {
            Products::Vectors
        }
    }

    /// Whether this process may run [`Products::Tiles`] on the CPU's AMX
    /// BF16 tiles: the CPU has them and AVX-512, Linux permits them,
    /// `DUPLEX_AMX` does not say `off`, and they passed a self-check.
    pub fn tiles_usable() -> bool {
        #[cfg(target_arch = "x86_64")]
        return super::gemm_amx::usable();
        #[cfg(not(target_arch = "x86_64"))]
        return false;
    }
}

/// [`matmul_bf16`] on the kernels `products` names.
pub fn matmul_bf16_on(isa: Isa, products: Products, w: &WeightView, rows: Range<usize>, x: &[u16], n: usize, out: &mut [f32]) {
    let (cols, m) = (w.cols, rows.len());
    assert!(rows.start <= rows.end && rows.end <= w.rows, "matmul_bf16: rows {rows:?} out of 0..{}", w.rows);
    assert_eq!(x.len(), n * cols, "matmul_bf16: input is not [n, cols]");
    assert_eq!(out.len(), n * m, "matmul_bf16: output is not [n, rows]");
    assert!(w.data.len() >= w.rows * w.format.row_bytes(cols), "matmul_bf16: weight data too short");
    if let WeightFormat::Fp8E4m3 { block } = w.format {
        assert!(block[0] > 0 && block[1] > 0, "matmul_bf16: zero block size");
        let grid = w.rows.div_ceil(block[0]) * cols.div_ceil(block[1]);
        assert!(w.scales.len() >= grid, "matmul_bf16: {} scales, need {grid}", w.scales.len());
    }
    if m == 0 || n == 0 {
        return;
    }
    match (isa.usable(), w.format) {
        (Isa::Portable, _) | (_, WeightFormat::F16 | WeightFormat::F32) => portable(w, rows, x, n, out),
        // Block-quantized weights quantize the activations for this call
        // (`par_matmul` and the MoE layer do it once for all their tasks).
        (isa, WeightFormat::Quant(kind)) => {
            let xf: Vec<f32> = x.iter().map(|&b| bf16_to_f32(b)).collect();
            crate::linear::matmul_quant(kind, w, rows, &xf, n, out, crate::quant::DotPath::for_isa(isa));
        }
        #[cfg(target_arch = "x86_64")]
        (isa, _) => {
            let job = super::kernel::Job::new(w);
            if products == Products::Tiles && isa >= Isa::Avx512Bf16 && Products::tiles_usable() {
                // The checks above cover every row, column and scale.
                return super::gemm_amx::run(&job, rows, x, n, out);
            }
            // SAFETY: `usable()` vouches for the CPU features, and the checks
            // above for every row, column and scale the kernels touch.
            unsafe { x86_dispatch(isa, &job, rows, x, n, out) }
        }
        #[cfg(not(target_arch = "x86_64"))]
        _ => {
            let _ = products;
            portable(w, rows, x, n, out)
        }
    }
}

/// BF16 bits to f32 (exact).
#[inline]
pub(super) fn bf16_to_f32(b: u16) -> f32 {
    f32::from_bits((b as u32) << 16)
}

/// The scalar reference on BF16-rounded activations.
fn portable(w: &WeightView, rows: Range<usize>, x: &[u16], n: usize, out: &mut [f32]) {
    let xf: Vec<f32> = x.iter().map(|&b| bf16_to_f32(b)).collect();
    crate::linear::matmul_rows(w, rows, &xf, n, out);
}

#[cfg(target_arch = "x86_64")]
unsafe fn x86_dispatch(isa: Isa, job: &super::kernel::Job, rows: Range<usize>, x: &[u16], n: usize, out: &mut [f32]) {
    use super::{gemv_avx2 as avx2, gemv_avx512 as avx512};
    // SAFETY (all arms): the caller checked `isa` against the CPU and the
    // shapes against the data.
    unsafe {
        match isa {
            Isa::Avx512Fp16 => avx512::run_fp16(job, rows, x, n, out),
            Isa::Avx512Bf16 => avx512::run_bf16(job, rows, x, n, out),
            Isa::Avx512 => avx512::run_f32(job, rows, x, n, out),
            _ => avx2::run(job, rows, x, n, out),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::isa;
    use proptest::prelude::*;

    /// Token counts above this take several passes (in row bands) on the
    /// AVX-512 levels.
    const PASS_TOKENS: usize = 8;
    #[cfg(target_arch = "x86_64")]
    const _: () = assert!(PASS_TOKENS == crate::cpu::kernel::PASS_TOKENS);

    /// A random problem: weights, activations and a row band.
    #[derive(Debug, Clone)]
    struct Case {
        rows: usize,
        cols: usize,
        n: usize,
        format: WeightFormat,
        data: Vec<u8>,
        scales: Vec<f32>,
        x: Vec<u16>,
        band: Range<usize>,
    }

    fn fp8_code() -> impl Strategy<Value = u8> {
        // All codes but the two NaNs, with the subnormal/zero codes (which
        // take the kernels' exact fallback) over-represented.
        prop_oneof![
            // (A NaN code becomes its neighbour: a filter would reject too
            // many draws for large matrices.)
            4 => any::<u8>().prop_map(|c| if c & 0x7f == 0x7f { c - 1 } else { c }),
            1 => (0u8..8, any::<bool>()).prop_map(|(m, s)| m | (s as u8) << 7),
        ]
    }

    /// Weights as the FP8 kernels meet them. Either any codes, with the
    /// exponent-0 ones over-represented (the exact decode nearly everywhere),
    /// or checkpoint-like: normal codes only (the fast decode), with at most
    /// one zero or subnormal code at a random place, which the step of rows
    /// holding it must notice.
    fn fp8_codes(len: usize) -> impl Strategy<Value = Vec<u8>> {
        // Exponent 1..=15 and any mantissa but NaN's (15, 7).
        let normal = (any::<u8>(), 1u8..16).prop_map(|(c, e)| (c & 0x87) | e << 3).prop_map(|c| if c & 0x7f == 0x7f { c - 1 } else { c });
        prop_oneof![
            prop::collection::vec(fp8_code(), len),
            (prop::collection::vec(normal, len), prop::option::of((0..len.max(1), 0u8..8))).prop_map(|(mut v, zero)| {
                if let Some((i, m)) = zero.filter(|&(i, _)| i < v.len()) {
                    v[i] = m;
                }
                v
            }),
        ]
    }

    fn case(max_rows: usize, max_cols: usize, max_n: usize) -> impl Strategy<Value = Case> {
        let fmt = prop_oneof![
            3 => Just(WeightFormat::Fp8E4m3 { block: [128, 128] }),
            1 => Just(WeightFormat::Fp8E4m3 { block: [64, 32] }),
            1 => (1usize..70, 1usize..200).prop_map(|(a, b)| WeightFormat::Fp8E4m3 { block: [a, b] }),
            1 => Just(WeightFormat::Bf16),
        ];
        (1..=max_rows, 1..=max_cols, 1..=max_n, fmt).prop_flat_map(|(rows, cols, n, format)| {
            let data = match format {
                WeightFormat::Bf16 => prop::collection::vec(-2.0f32..2.0, rows * cols)
                    .prop_map(|v| v.into_iter().flat_map(|f| half::bf16::from_f32(f).to_le_bytes()).collect())
                    .boxed(),
                _ => fp8_codes(rows * cols).boxed(),
            };
            let nscales = match format {
                WeightFormat::Fp8E4m3 { block } => rows.div_ceil(block[0]) * cols.div_ceil(block[1]),
                _ => 0,
            };
            (
                Just((rows, cols, n, format)),
                data,
                prop::collection::vec(0.001f32..2.0, nscales),
                prop::collection::vec(-4.0f32..4.0, n * cols),
                (0..=rows, 0..=rows),
            )
                .prop_map(|((rows, cols, n, format), data, scales, x, (a, b))| Case {
                    rows,
                    cols,
                    n,
                    format,
                    data,
                    scales,
                    x: x.into_iter().map(|f| half::bf16::from_f32(f).to_bits()).collect(),
                    band: a.min(b)..a.max(b),
                })
        })
    }

    /// Compare every level against the reference, with a tolerance relative
    /// to the sum of the terms' magnitudes (only the summation order differs).
    fn check(c: &Case) -> Result<(), TestCaseError> {
        let w = WeightView { rows: c.rows, cols: c.cols, format: c.format, data: &c.data, scales: &c.scales };
        let m = c.band.len();
        let xf: Vec<f32> = c.x.iter().map(|&b| bf16_to_f32(b)).collect();
        let mut want = vec![0.0; c.n * m];
        crate::linear::matmul_rows(&w, c.band.clone(), &xf, c.n, &mut want);
        // Σ|terms|, from |W| (scales applied) times |x|.
        let mut row = vec![0.0f32; c.cols];
        let mut mag = vec![0.0f64; c.n * m];
        for (j, r) in c.band.clone().enumerate() {
            w.decode_row(r, &mut row);
            for i in 0..c.n {
                mag[i * m + j] = (0..c.cols).map(|k| (row[k] as f64 * xf[i * c.cols + k] as f64).abs()).sum();
            }
        }
        // The FP16 level (FP8 weights only) rounds products and short
        // sums to FP16's 11 bits, and FP16 subnormals are spaced 2⁻²⁴ apart
        // in units where the largest activation is ≥ 2¹⁰ and a weight is its
        // value × 2⁻⁸ / scale: per term at most 2⁻²⁵ · 2⁸ · 2⁻¹⁰ · max|x| · scale.
        let max_x = xf.iter().fold(0.0f64, |a, &v| a.max(v.abs() as f64));
        let max_scale = c.scales.iter().fold(0.0f64, |a, &v| a.max(v as f64));
        let fp16_floor = c.cols as f64 * 2f64.powi(-27) * max_x * max_scale;
        for isa in isa::supported() {
            let mut got = vec![f32::NAN; c.n * m];
            matmul_bf16(isa, &w, c.band.clone(), &c.x, c.n, &mut got);
            let fp16 = isa == Isa::Avx512Fp16 && matches!(c.format, WeightFormat::Fp8E4m3 { .. });
            let (relative, floor) = if fp16 { (2f64.powi(-10), fp16_floor) } else { (1e-5, 0.0) };
            for k in 0..c.n * m {
                let err = (got[k] as f64 - want[k] as f64).abs();
                prop_assert!(
                    err <= relative * mag[k] + floor + 1e-30,
                    "{isa} {:?} {}x{} n={} band {:?}: out[{k}] = {} want {} (|terms| {})",
                    c.format, c.rows, c.cols, c.n, c.band, got[k], want[k], mag[k]
                );
            }
        }
        Ok(())
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(96))]
        #[test]
        fn matches_reference_small_batch(c in case(300, 600, 9)) {
            check(&c)?;
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(24))]
        #[test]
        fn matches_reference_large_batch(c in case(60, 400, 20).prop_filter("prefill", |c| c.n > PASS_TOKENS)) {
            check(&c)?;
        }
    }

    /// Shapes the model really uses, including DeepSeek's 128 × 128 blocks
    /// with full and partial edges, a band long enough (≥ 512 KiB) for the
    /// FP16 kernel's eight-stream steps, with leftover rows, and rows of at
    /// most 128 columns (the FP16 kernel's sixteen-row steps: MLA's absorbed
    /// query, 512 × 128, and a ragged 301 × 100) spanning scale blocks.
    #[test]
    fn deepseek_like_shapes() {
        let mut seed = 0x9e3779b97f4a7c15u64;
        let mut next = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        for &(rows, cols, n) in &[(130usize, 512usize, 1usize), (64, 7168 / 4, 3), (200, 300, 8), (33, 640, 17), (16, 128, 32), (301, 1800, 1), (512, 128, 1), (301, 100, 1)] {
            let data: Vec<u8> = (0..rows * cols).map(|_| (next() >> 56) as u8).map(|c| if c & 0x7f == 0x7f { 0x38 } else { c }).collect();
            let scales: Vec<f32> = (0..rows.div_ceil(128) * cols.div_ceil(128)).map(|i| 0.01 + (i % 5) as f32 * 0.3).collect();
            let x: Vec<u16> = (0..n * cols).map(|_| half::bf16::from_f32(((next() >> 40) as f32 / (1u64 << 24) as f32) - 0.5).to_bits()).collect();
            let c = Case { rows, cols, n, format: WeightFormat::Fp8E4m3 { block: [128, 128] }, data, scales, x, band: 0..rows };
            check(&c).unwrap();
        }
    }

    /// BF16 weights in bands long enough (≥ 256 Ki values) for the single
    /// pass's eight streams, with leftover rows, and with enough tokens for
    /// several passes over 16-row bands.
    #[test]
    fn bf16_weights_long_bands() {
        for (rows, cols, n, band) in [(301usize, 1000usize, 1usize, 0..301), (300, 1000, 1, 5..298), (270, 1000, 2, 0..270), (40, 1000, 9, 3..40)] {
            let data = (0..rows * cols).flat_map(|i| half::bf16::from_f32(((i * 7919) % 997) as f32 / 500.0 - 1.0).to_le_bytes()).collect();
            let x = (0..n * cols).map(|i| half::bf16::from_f32(((i * 104_729) % 1009) as f32 / 250.0 - 2.0).to_bits()).collect();
            check(&Case { rows, cols, n, format: WeightFormat::Bf16, data, scales: vec![], x, band }).unwrap();
        }
    }

    /// Checkpoint-like weights (normal codes only) with a single zero or
    /// subnormal code, at every row of a multi-row kernel step and at the
    /// edges of full and partial lines: the fast decode must never see it.
    #[test]
    fn lone_subnormal_among_normal_codes() {
        let (rows, cols) = (9usize, 200usize);
        // The smallest normal codes (exponents 1 and 2), so that a misread
        // subnormal (off by ~2⁻⁷) stands out against the sum of the terms.
        let normal: Vec<u8> = (0..rows * cols).map(|i| (0x08 + (i * 37 % 0x10) as u8) | (((i % 3 == 0) as u8) << 7)).collect();
        let scales = vec![0.5f32; cols.div_ceil(128)];
        for n in [1, 2, 5] {
            let x: Vec<u16> = (0..n * cols).map(|i| half::bf16::from_f32(((i * 13 % 29) as f32 - 14.0) / 8.0).to_bits()).collect();
            for r in 0..rows {
                for col in [0, 63, 64, 127, 128, 199] {
                    for code in [0x00u8, 0x83, 0x07] {
                        let mut data = normal.clone();
                        data[r * cols + col] = code;
                        let c = Case { rows, cols, n, format: WeightFormat::Fp8E4m3 { block: [128, 128] }, data, scales: scales.clone(), x: x.clone(), band: 0..rows };
                        check(&c).unwrap();
                    }
                }
            }
        }
    }

    /// NaN codes: NaN on the portable level; ±480 on the SIMD levels, for
    /// any number of tokens (one kernel per level, whatever the batch).
    #[test]
    fn nan_codes_read_the_same_for_every_token_count() {
        let (rows, cols) = (3, 70);
        for nan in [0x7fu8, 0xff] {
            let mut data = vec![0x38u8; rows * cols];
            data[cols + 5] = nan; // row 1
            let scales = vec![1.0f32; 1];
            let w = WeightView { rows, cols, format: WeightFormat::Fp8E4m3 { block: [128, 128] }, data: &data, scales: &scales };
            // 0.5 · 69 · 1.0 (code 0x38) + 0.5 · ±480.
            let simd = 0.5 * 69.0 + if nan == 0x7f { 240.0 } else { -240.0 };
            for n in [1, 3, PASS_TOKENS + 1] {
                let x = vec![half::bf16::from_f32(0.5).to_bits(); n * cols];
                for isa in isa::supported() {
                    let mut out = vec![0.0; n * rows];
                    matmul_bf16(isa, &w, 0..rows, &x, n, &mut out);
                    for t in 0..n {
                        if isa == Isa::Portable {
                            assert!(out[t * rows + 1].is_nan(), "{isa} n={n}: token {t} should be NaN");
                        } else {
                            assert_eq!(out[t * rows + 1], simd, "{isa} n={n}: token {t}");
                        }
                        assert_eq!(out[t * rows], 35.0, "{isa} n={n}: token {t}, row 0");
                    }
                }
            }
        }
    }

    /// Batch invariance: each token's outputs are the same bits computed
    /// alone, with any other tokens, and over any band of rows containing
    /// them, on the vectors at every level and, where usable, on the AMX
    /// tiles (the products a call takes are named, as `matmul_bf16` picks
    /// them by the number of tokens).
    fn check_invariant(c: &Case) -> Result<(), TestCaseError> {
        let w = WeightView { rows: c.rows, cols: c.cols, format: c.format, data: &c.data, scales: &c.scales };
        let m = c.band.len();
        // A sub-band: rows cut off at both ends of the case's band.
        let sub = c.band.start + m / 3..c.band.end - m / 4;
        let products = if Products::tiles_usable() { vec![Products::Vectors, Products::Tiles] } else { vec![Products::Vectors] };
        for (isa, products) in isa::supported().into_iter().flat_map(|isa| products.iter().map(move |&p| (isa, p))) {
            let mut all = vec![f32::NAN; c.n * m];
            matmul_bf16_on(isa, products, &w, c.band.clone(), &c.x, c.n, &mut all);
            for t in 0..c.n {
                let mut alone = vec![f32::NAN; m];
                matmul_bf16_on(isa, products, &w, c.band.clone(), &c.x[t * c.cols..(t + 1) * c.cols], 1, &mut alone);
                let want: Vec<u32> = all[t * m..(t + 1) * m].iter().map(|v| v.to_bits()).collect();
                let got: Vec<u32> = alone.iter().map(|v| v.to_bits()).collect();
                prop_assert_eq!(got, want, "{} {:?} {:?} {}x{} n={} band {:?}: token {} alone", isa, products, c.format, c.rows, c.cols, c.n, c.band, t);
            }
            let mut part = vec![f32::NAN; c.n * sub.len()];
            matmul_bf16_on(isa, products, &w, sub.clone(), &c.x, c.n, &mut part);
            for t in 0..c.n {
                for (j, r) in sub.clone().enumerate() {
                    let (got, want) = (part[t * sub.len() + j], all[t * m + r - c.band.start]);
                    prop_assert_eq!(got.to_bits(), want.to_bits(), "{} {:?} {:?} n={} row {} of band {:?} in {:?}", isa, products, c.format, c.n, r, sub, c.band);
                }
            }
        }
        Ok(())
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]
        #[test]
        fn each_token_alone_gives_the_same_bits(c in case(300, 600, 20)) {
            check_invariant(&c)?;
        }
    }

    /// Batch invariance on model-like shapes: long bands (the eight-stream
    /// steps), rows of at most 128 columns (the FP16 level's sixteen-row
    /// steps, with a ragged end), BF16 weights, tokens of very different
    /// sizes (the FP16 level scales each on its own) and a token holding a
    /// NaN (which must not change the others).
    #[test]
    fn batch_invariance_on_model_shapes() {
        let mut seed = 0x2545f4914f6cdd1du64;
        let mut next = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        let shapes = [(512usize, 1024usize, WeightFormat::Fp8E4m3 { block: [128, 128] }), (301, 100, WeightFormat::Fp8E4m3 { block: [128, 128] }), (300, 1000, WeightFormat::Bf16)];
        for (rows, cols, format) in shapes {
            let data: Vec<u8> = match format {
                WeightFormat::Bf16 => (0..rows * cols).flat_map(|_| half::bf16::from_f32(((next() >> 40) as f32 / (1u64 << 24) as f32) - 0.5).to_le_bytes()).collect(),
                _ => (0..rows * cols).map(|_| (next() >> 56) as u8).map(|c| if c & 0x7f == 0x7f { 0x38 } else { c }).collect(),
            };
            let scales: Vec<f32> = (0..rows.div_ceil(128) * cols.div_ceil(128)).map(|i| 0.01 + (i % 5) as f32 * 0.3).collect();
            for n in [2, 6, 12] {
                let mut x: Vec<u16> = (0..n * cols)
                    .map(|i| {
                        let size = [1.0f32, 1e-3, 300.0][(i / cols) % 3];
                        half::bf16::from_f32((((next() >> 40) as f32 / (1u64 << 24) as f32) - 0.5) * size).to_bits()
                    })
                    .collect();
                if n == 6 {
                    x[cols + 7] = half::bf16::from_f32(f32::NAN).to_bits();
                }
                let c = Case { rows, cols, n, format, data: data.clone(), scales: scales.clone(), x, band: 0..rows };
                check_invariant(&c).unwrap();
            }
        }
    }

    /// The FP16 level scales activations into FP16's range whatever their
    /// size, and leaves a token holding NaN or infinite ones to the BF16
    /// kernels, which propagate them (that token's results then match that
    /// level bit for bit; the other tokens' do not change).
    #[test]
    fn fp16_level_takes_activations_of_any_size() {
        if isa::hardware() < Isa::Avx512Fp16 {
            return;
        }
        let (rows, cols) = (20usize, 300usize);
        let data: Vec<u8> = (0..rows * cols).map(|i| ((i * 73 + 11) % 256) as u8).map(|c| if c & 0x7f == 0x7f { 0x7e } else { c }).collect();
        let scales: Vec<f32> = (0..3).map(|i| 0.5 + i as f32).collect();
        let format = WeightFormat::Fp8E4m3 { block: [128, 128] };
        for n in [1, 3] {
            let unit: Vec<f32> = (0..n * cols).map(|i| ((i * 29 % 31) as f32 - 15.0) / 15.0).collect();
            for size in [1e-36f32, 1e-30, 1e-6, 1.0, 3e4, 1e30] {
                let x = unit.iter().map(|&v| half::bf16::from_f32(v * size).to_bits()).collect();
                check(&Case { rows, cols, n, format, data: data.clone(), scales: scales.clone(), x, band: 0..rows }).unwrap();
            }
            for odd in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
                let mut x: Vec<u16> = unit.iter().map(|&v| half::bf16::from_f32(v).to_bits()).collect();
                x[cols / 2] = half::bf16::from_f32(odd).to_bits();
                let w = WeightView { rows, cols, format, data: &data, scales: &scales };
                let [mut fp16, mut bf16] = [0, 1].map(|_| vec![0.0f32; n * rows]);
                matmul_bf16(Isa::Avx512Fp16, &w, 0..rows, &x, n, &mut fp16);
                matmul_bf16(Isa::Avx512Bf16, &w, 0..rows, &x, n, &mut bf16);
                assert!(fp16[..rows].iter().any(|v| !v.is_finite()), "{odd}");
                let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                // The token holding it runs the BF16 kernels; the others
                // keep their FP16 results, as if computed alone.
                assert_eq!(bits(&fp16[..rows]), bits(&bf16[..rows]), "{odd}");
                for t in 1..n {
                    let mut alone = vec![0.0f32; rows];
                    matmul_bf16(Isa::Avx512Fp16, &w, 0..rows, &x[t * cols..(t + 1) * cols], 1, &mut alone);
                    assert_eq!(bits(&fp16[t * rows..(t + 1) * rows]), bits(&alone), "{odd}, token {t}");
                    assert!(alone.iter().all(|v| v.is_finite()), "{odd}, token {t}");
                }
            }
        }
    }

    #[test]
    fn empty_shapes() {
        let data = [0u8; 0];
        let w = WeightView { rows: 0, cols: 5, format: WeightFormat::Bf16, data: &data, scales: &[] };
        for isa in isa::supported() {
            matmul_bf16(isa, &w, 0..0, &[0; 10], 2, &mut []);
        }
        // Zero columns: every output is an empty sum.
        let w = WeightView { rows: 3, cols: 0, format: WeightFormat::Fp8E4m3 { block: [128, 128] }, data: &data, scales: &[] };
        for isa in isa::supported() {
            let mut out = vec![1.0; 6];
            matmul_bf16(isa, &w, 0..3, &[], 2, &mut out);
            assert_eq!(out, [0.0; 6], "{isa}");
        }
    }
}
