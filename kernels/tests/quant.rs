//! ggml block formats and k-quant dot products (`duplex_kernels::quant`).
//!
//! - Known answers from a real llama.cpp Q4_K_M GGUF
//!   (`tests/fixtures/tiny-dsv3-q4km/`): blocks decoded here equal, bit for
//!   bit, what the `gguf` Python package decodes (`quant_reference.json`,
//!   written by `make_quant_reference.py` next to it).
//! - The activation quantizers equal llama.cpp's own (`quantize_row_q8_0`,
//!   `_q8_1`, `_q8_K` of its x86 CPU backend) byte for byte
//!   (`tests/fixtures/llama-cpp-quantizers.json`, written by
//!   `deploy/anchor/llama_quantizers.py`).
//! - Every SIMD path equals the scalar reference EXACTLY (compared as bits):
//!   all paths compute the same per-block integers (exact, no overflow) and
//!   fold them into f32 with one shared expression in block order, so there
//!   is no summation-order freedom to tolerate.
//! - dot(w, quant(x)) is close to Σ dequant(w)·x within a derived bound.
//! - Quantization round trips and the activation types' invariants.

use duplex_kernels::cpu::isa;
use duplex_kernels::quant::blocks::{dequantize_q8_0, dequantize_q8_1, dequantize_q8_k};
use duplex_kernels::quant::{
    self, dequantize_row, dot, dot_with, gemv_with, quantize_q8_0, quantize_q8_1, quantize_q8_k, Activations, BlockQ8K, BlockQ8_0, BlockQ8_1, DotPath,
    QuantError, QuantKind, QuantizedTokens, QK8_0, QK_K,
};
use proptest::prelude::*;
use std::path::PathBuf;

const EPS: f64 = f32::EPSILON as f64 / 2.0; // unit roundoff of f32

// ---------------------------------------------------------------------------
// Real GGUF blocks

fn fixture_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/tiny-dsv3-q4km")
}

/// A tensor's entry in a GGUF file's header.
struct TensorInfo {
    name: String,
    dims: Vec<u64>,
    ggml_type: u32,
    /// Absolute offset of its data in the file.
    offset: usize,
}

/// Walk a GGUF header (v2/v3): metadata is skipped except
/// `general.alignment`, and tensor offsets are made absolute.
fn gguf_tensors(file: &[u8]) -> Vec<TensorInfo> {
    struct Cur<'a>(&'a [u8], usize);
    impl Cur<'_> {
        fn take(&mut self, n: usize) -> &[u8] {
            let s = &self.0[self.1..self.1 + n];
            self.1 += n;
            s
        }
        fn u32(&mut self) -> u32 {
            u32::from_le_bytes(self.take(4).try_into().unwrap())
        }
        fn u64(&mut self) -> u64 {
            u64::from_le_bytes(self.take(8).try_into().unwrap())
        }
        fn string(&mut self) -> String {
            let n = self.u64() as usize;
            String::from_utf8(self.take(n).to_vec()).unwrap()
        }
        /// Skip a value of type `t`, returning it if it is an integer.
        fn value(&mut self, t: u32) -> Option<u64> {
            match t {
                0 | 1 | 7 => Some(self.take(1)[0] as u64),
                2 | 3 => Some(u16::from_le_bytes(self.take(2).try_into().unwrap()) as u64),
                4 | 5 => Some(self.u32() as u64),
                6 => {
                    self.take(4);
                    None
                }
                10 | 11 => Some(self.u64()),
                12 => {
                    self.take(8);
                    None
                }
                8 => {
                    self.string();
                    None
                }
                9 => {
                    let (et, n) = (self.u32(), self.u64());
                    for _ in 0..n {
                        self.value(et);
                    }
                    None
                }
                _ => panic!("unknown GGUF value type {t}"),
            }
        }
    }
    let mut c = Cur(file, 0);
    assert_eq!(c.take(4), b"GGUF", "not a GGUF file");
    let version = c.u32();
    assert!(version == 2 || version == 3, "GGUF version {version}");
    let (n_tensors, n_kv) = (c.u64(), c.u64());
    let mut alignment = 32usize;
    for _ in 0..n_kv {
        let key = c.string();
        let t = c.u32();
        let v = c.value(t);
        if key == "general.alignment" {
            alignment = v.expect("integer alignment") as usize;
        }
    }
    let mut infos = Vec::new();
    for _ in 0..n_tensors {
        let name = c.string();
        let n_dims = c.u32();
        let dims = (0..n_dims).map(|_| c.u64()).collect();
        let ggml_type = c.u32();
        let offset = c.u64() as usize;
        infos.push(TensorInfo { name, dims, ggml_type, offset });
    }
    let data = c.1.div_ceil(alignment) * alignment;
    for t in &mut infos {
        t.offset += data;
    }
    infos
}

struct Fixture {
    file: Vec<u8>,
    tensors: Vec<TensorInfo>,
    reference: serde_json::Value,
}

fn fixture() -> Fixture {
    let dir = fixture_dir();
    let file = std::fs::read(dir.join("model-Q4_K_M.gguf")).expect("read the GGUF fixture");
    let reference: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("quant_reference.json")).expect("read quant_reference.json"))
            .expect("parse quant_reference.json");
    let tensors = gguf_tensors(&file);
    Fixture { file, tensors, reference }
}

fn bits_of(v: &serde_json::Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|b| b.as_u64().unwrap() as u32).collect()
}

impl Fixture {
    fn tensor(&self, name: &str) -> &TensorInfo {
        self.tensors.iter().find(|t| t.name == name).unwrap_or_else(|| panic!("no tensor {name}"))
    }

    /// The raw bytes of `n` blocks of a tensor from block `first` on.
    fn blocks(&self, t: &TensorInfo, first: usize, n: usize) -> &[u8] {
        let kind = QuantKind::from_ggml_type(t.ggml_type).expect("readable type");
        let bb = kind.block_bytes();
        &self.file[t.offset + first * bb..t.offset + (first + n) * bb]
    }
}

#[test]
fn gguf_blocks_decode_as_the_gguf_package_does() {
    let fx = fixture();
    let entries = fx.reference["tensors"].as_array().unwrap();
    let mut kinds_seen = Vec::new();
    for e in entries {
        let name = e["name"].as_str().unwrap();
        let t = fx.tensor(name);
        // Our header walk finds the data where the gguf package does.
        assert_eq!(t.offset as u64, e["data_offset"].as_u64().unwrap(), "{name}: data offset");
        assert_eq!(t.ggml_type as u64, e["ggml_type"].as_u64().unwrap(), "{name}: type");
        let dims: Vec<u64> = e["dims"].as_array().unwrap().iter().map(|d| d.as_u64().unwrap()).collect();
        assert_eq!(t.dims, dims, "{name}: dims");
        let kind = QuantKind::from_ggml_type(t.ggml_type).unwrap();
        assert_eq!(kind.name(), e["type"].as_str().unwrap());
        let elements: u64 = dims.iter().product();
        assert_eq!(kind.row_bytes(elements as usize).unwrap() as u64, e["n_bytes"].as_u64().unwrap(), "{name}: size");
        kinds_seen.push(kind);
        for run in e["runs"].as_array().unwrap() {
            let first = run["first_block"].as_u64().unwrap() as usize;
            let expected = bits_of(&run["values_bits"]);
            let n = expected.len() / kind.block_elems();
            let mut out = vec![0f32; expected.len()];
            dequantize_row(kind, fx.blocks(t, first, n), &mut out).unwrap();
            for (i, (got, want)) in out.iter().zip(&expected).enumerate() {
                assert_eq!(got.to_bits(), *want, "{name} block {first} element {i}: {got} vs {}", f32::from_bits(*want));
            }
        }
    }
    for k in [QuantKind::Q4K, QuantKind::Q6K, QuantKind::Q5_0, QuantKind::F32] {
        assert!(kinds_seen.contains(&k), "reference covers {k}");
    }
}

/// What llama.cpp's CPU backend on x86 returns for rows of activations
/// chosen to reach its rounding's every case (exact halves, and maxima
/// where `127 / max` and `1 / (max / 127)` differ), against ours, for the
/// three formats its matrix products quantize activations to.
#[test]
fn activation_quantizers_are_llama_cpps() {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/llama-cpp-quantizers.json");
    let doc: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).expect("read llama-cpp-quantizers.json")).expect("parse it");
    let bytes = |v: &serde_json::Value| -> Vec<u8> {
        let hex = v.as_str().unwrap();
        (0..hex.len()).step_by(2).map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap()).collect()
    };
    let rows = doc["rows"].as_array().unwrap();
    assert!(rows.len() >= 10, "the fixture's rows");
    for (i, row) in rows.iter().enumerate() {
        let x: Vec<f32> = bits_of(&row["x_bits"]).into_iter().map(f32::from_bits).collect();
        assert_eq!(BlockQ8_0::to_bytes(&quantize_q8_0(&x).unwrap()), bytes(&row["q8_0"]), "Q8_0, row {i}");
        // ggml's block_q8_1: d and s in half precision, then the quants.
        let q8_1: Vec<u8> = quantize_q8_1(&x)
            .unwrap()
            .iter()
            .flat_map(|b| [b.d.to_bits(), half::f16::from_f32(b.s).to_bits()].into_iter().flat_map(u16::to_le_bytes).chain(b.qs.iter().map(|&q| q as u8)))
            .collect();
        assert_eq!(q8_1, bytes(&row["q8_1"]), "Q8_1, row {i}");
        assert_eq!(BlockQ8K::to_bytes(&quantize_q8_k(&x).unwrap()), bytes(&row["q8_k"]), "Q8_K, row {i}");
    }
}

/// Q8_K quantization equals a transcription of ggml's `quantize_row_q8_K_ref`
/// byte for byte, and real rows' dot products agree with a transcription of
/// ggml's generic `ggml_vec_dot_q4_K_q8_K` / `_q6_K_q8_K` (both in
/// `make_quant_reference.py`) to f32 rounding: the integers are the same,
/// only the f32 fold differs (ggml: eight f32 lanes per row, summed at the
/// end; here one running sum per block). Each side is within (B + 9) eps of
/// Σ |d · lane sums| + |dmin · min sum| (`magnitude`) of the exact value
/// for B blocks, so they are within twice that of each other.
#[test]
fn q8_k_and_dots_match_ggml_reference_code() {
    let fx = fixture();
    let q = &fx.reference["q8_k"];
    let x: Vec<f32> = bits_of(&q["x_bits"]).into_iter().map(f32::from_bits).collect();
    let hex = q["bytes_hex"].as_str().unwrap();
    let expected: Vec<u8> = (0..hex.len()).step_by(2).map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap()).collect();
    let blocks = quantize_q8_k(&x).unwrap();
    assert_eq!(BlockQ8K::to_bytes(&blocks), expected);
    let act = Activations::Q8K(blocks);
    let dots = q["dots"].as_array().unwrap();
    assert!(dots.len() >= 10);
    for e in dots {
        let t = fx.tensor(e["tensor"].as_str().unwrap());
        let kind = QuantKind::from_ggml_type(t.ggml_type).unwrap();
        let r = e["row"].as_u64().unwrap() as usize;
        let row_bytes = kind.row_bytes(x.len()).unwrap();
        let row = &fx.file[t.offset + r * row_bytes..t.offset + (r + 1) * row_bytes];
        let want = f32::from_bits(e["value_bits"].as_u64().unwrap() as u32) as f64;
        let blocks = (x.len() / QK_K) as f64;
        let bound = 2.0 * (blocks + 9.0) * EPS * e["magnitude"].as_f64().unwrap();
        for path in DotPath::supported() {
            let got = dot_with(path, kind, row, &act).unwrap() as f64;
            assert!((got - want).abs() <= bound, "{} row {r} on {path}: {got} vs ggml {want} (bound {bound:e})", t.name);
        }
    }
}

/// Every path on real rows: equal to the scalar reference, and close to the
/// f64 product of the decoded weights with the quantized activations.
#[test]
fn real_rows_agree_on_every_path() {
    let fx = fixture();
    for (name, rows) in [("blk.0.ffn_gate.weight", 8), ("output.weight", 8), ("blk.2.ffn_down_exps.weight", 8), ("blk.1.attn_k_b.weight", 16)] {
        let t = fx.tensor(name);
        let kind = QuantKind::from_ggml_type(t.ggml_type).unwrap();
        let cols = t.dims[0] as usize;
        let row_bytes = kind.row_bytes(cols).unwrap();
        let matrix = &fx.file[t.offset..t.offset + rows * row_bytes];
        let x: Vec<f32> = (0..cols).map(|i| ((i as f32) * 0.61).sin() * 2.0 - 0.3).collect();
        let act = Activations::quantize_for(kind, &x).unwrap();
        let xq = match &act {
            Activations::Q8K(b) => dequantize_q8_k(b),
            Activations::Q8_0(b) => dequantize_q8_0(b),
            Activations::Q8_1(b) => dequantize_q8_1(b),
        };
        let mut reference = vec![0f32; rows];
        gemv_with(DotPath::Scalar, kind, matrix, rows, &act, &mut reference).unwrap();
        for path in DotPath::supported() {
            let mut y = vec![0f32; rows];
            gemv_with(path, kind, matrix, rows, &act, &mut y).unwrap();
            assert_eq!(bits(&y), bits(&reference), "{name} on {path}");
        }
        for (r, row) in matrix.chunks_exact(row_bytes).enumerate() {
            let mut w = vec![0f32; cols];
            dequantize_row(kind, row, &mut w).unwrap();
            let exact: f64 = w.iter().zip(&xq).map(|(&a, &b)| a as f64 * b as f64).sum();
            let mag: f64 = w.iter().zip(&xq).map(|(&a, &b)| (a as f64 * b as f64).abs()).sum();
            // Real Q4_K blocks' min terms are small next to their values, so
            // a loose multiple of the rounding bound on Σ|w·x| holds.
            assert!((reference[r] as f64 - exact).abs() <= 1e-5 * mag, "{name} row {r}: {} vs {exact}", reference[r]);
        }
    }
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

// ---------------------------------------------------------------------------
// Random blocks

/// A finite half-precision bit pattern (any sign, subnormals included).
fn finite_f16() -> impl Strategy<Value = u16> {
    any::<u16>().prop_filter("finite", |b| b & 0x7c00 != 0x7c00)
}

/// A half-precision scale of moderate size (as real blocks have), either sign.
fn scale_f16() -> impl Strategy<Value = u16> {
    (1e-4f32..0.1, any::<bool>()).prop_map(|(v, neg)| half::f16::from_f32(if neg { -v } else { v }).to_bits())
}

/// `n` random blocks of `kind` whose f16 scales come from `scale`.
fn blocks_of(kind: QuantKind, n: usize, scale: BoxedStrategy<u16>) -> BoxedStrategy<Vec<u8>> {
    let bb = kind.block_bytes();
    // Where each block keeps its f16 scales.
    let scale_at: Vec<usize> = match kind {
        QuantKind::Q4K | QuantKind::Q5K | QuantKind::Q5_1 => vec![0, 2],
        QuantKind::Q6K => vec![208],
        _ => vec![0],
    };
    (prop::collection::vec(any::<u8>(), n * bb), prop::collection::vec(scale, n * scale_at.len()))
        .prop_map(move |(mut bytes, scales)| {
            for (b, block) in bytes.chunks_exact_mut(bb).enumerate() {
                for (j, &at) in scale_at.iter().enumerate() {
                    block[at..at + 2].copy_from_slice(&scales[b * scale_at.len() + j].to_le_bytes());
                }
            }
            bytes
        })
        .boxed()
}

/// Activations: values in ±`range`, with some blocks all zero.
fn activations(n: usize, block: usize) -> impl Strategy<Value = Vec<f32>> {
    (
        prop::collection::vec(-1f32..1.0, n),
        prop::sample::select(vec![1e-3f32, 1.0, 37.0]),
        prop::collection::vec(any::<bool>(), n / block),
    )
        .prop_map(move |(mut x, range, zero)| {
            for (chunk, z) in x.chunks_exact_mut(block).zip(zero) {
                for v in chunk.iter_mut() {
                    *v = if z { 0.0 } else { *v * range };
                }
            }
            x
        })
}

const DOT_KINDS: [QuantKind; 7] = [QuantKind::Q4K, QuantKind::Q5K, QuantKind::Q6K, QuantKind::Q8_0, QuantKind::Q4_0, QuantKind::Q5_0, QuantKind::Q5_1];

/// (kind, row bytes, activations) with 1..=6 blocks (1..=9 for 32-wide kinds,
/// so the AVX-512 kernels' odd tail is covered).
fn case(scale: fn() -> BoxedStrategy<u16>) -> impl Strategy<Value = (QuantKind, Vec<u8>, Vec<f32>)> {
    prop::sample::select(DOT_KINDS.to_vec()).prop_flat_map(move |kind| {
        let max: usize = if kind.block_elems() == QK_K { 6 } else { 9 };
        (1usize..=max).prop_flat_map(move |n| {
            (Just(kind), blocks_of(kind, n, scale()), activations(n * kind.block_elems(), kind.block_elems()))
        })
    })
}

/// (kind, row bytes, activations) of a 32-wide kind with rows of one of
/// `blocks` block counts.
fn case_32(blocks: Vec<usize>) -> impl Strategy<Value = (QuantKind, Vec<u8>, Vec<f32>)> {
    let kinds = DOT_KINDS.iter().copied().filter(|k| k.block_elems() == QK8_0).collect::<Vec<_>>();
    (prop::sample::select(kinds), prop::sample::select(blocks)).prop_flat_map(|(kind, n)| {
        (Just(kind), blocks_of(kind, n, any_scale()), activations(n * kind.block_elems(), kind.block_elems()))
    })
}

/// (kind, 50 distinct rows of four blocks, activations) of a 32-wide kind.
fn four_block_rows() -> impl Strategy<Value = (QuantKind, Vec<u8>, Vec<f32>)> {
    let kinds = DOT_KINDS.iter().copied().filter(|k| k.block_elems() == QK8_0).collect::<Vec<_>>();
    prop::sample::select(kinds).prop_flat_map(|kind| (Just(kind), blocks_of(kind, 50 * 4, any_scale()), activations(4 * QK8_0, QK8_0)))
}

fn any_scale() -> BoxedStrategy<u16> {
    finite_f16().boxed()
}

fn moderate_scale() -> BoxedStrategy<u16> {
    scale_f16().boxed()
}

/// Per element, the magnitude the kernels' f32 work is relative to:
/// |d·sc·q| + |dmin·m| for Q4_K/Q5_K (the two parts are summed separately,
/// so their cancellation does not shrink the rounding), |w| otherwise. For
/// the k-quants with a min this is the dequantization of the block with
/// `d` made positive and `dmin` negative.
fn magnitudes(kind: QuantKind, row: &[u8]) -> Vec<f32> {
    let n = row.len() / kind.block_bytes() * kind.block_elems();
    let mut out = vec![0f32; n];
    match kind {
        QuantKind::Q4K | QuantKind::Q5K => {
            let mut copy = row.to_vec();
            for block in copy.chunks_exact_mut(kind.block_bytes()) {
                block[1] &= 0x7f;
                block[3] |= 0x80;
            }
            dequantize_row(kind, &copy, &mut out).unwrap();
        }
        _ => {
            dequantize_row(kind, row, &mut out).unwrap();
            out.iter_mut().for_each(|v| *v = v.abs());
        }
    }
    out
}

/// The most one element of `x` can move when quantized, per element.
fn quantization_error(act: &Activations, x: &[f32]) -> Vec<f64> {
    match act {
        // Q8_K: q = round(x·iscale), |x·iscale - q| ≤ 1/2 up to the f32
        // rounding of the product (≤ 128·eps), and d = 1/iscale in f32 (one
        // more eps on each of up to 127 steps): |x - d·q| ≤ |d|(1/2 + 300 eps).
        Activations::Q8K(blocks) => blocks
            .iter()
            .flat_map(|b| std::iter::repeat_n(b.d.abs() as f64 * (0.5 + 300.0 * EPS), QK_K))
            .collect(),
        // Q8_0: q = round(x/d) with d = max|x|/127 in f32, but the stored d
        // is its f16 rounding d16: |x - d16·q| ≤ d(1/2 + 300 eps) + 127|d - d16|.
        Activations::Q8_0(blocks) => q8_32_error(blocks.iter().map(|b| b.d), x),
        Activations::Q8_1(blocks) => q8_32_error(blocks.iter().map(|b| b.d), x),
    }
}

/// [`quantization_error`] of Q8_0 and Q8_1, whose quants and `d` are alike:
/// q = round(x/d) with d = max|x|/127 in f32, but the stored d is its f16
/// rounding d16: |x - d16·q| ≤ d(1/2 + 300 eps) + 127|d - d16|.
fn q8_32_error(stored: impl Iterator<Item = half::f16>, x: &[f32]) -> Vec<f64> {
    stored
        .zip(x.chunks_exact(QK8_0))
        .flat_map(|(d16, xs)| {
            let d = xs.iter().fold(0f32, |m, v| m.max(v.abs())) / 127.0;
            let e = d as f64 * (0.5 + 300.0 * EPS) + 127.0 * (d as f64 - d16.to_f32() as f64).abs();
            std::iter::repeat_n(e, QK8_0)
        })
        .collect()
}

/// `rows` rows that differ: row r is `row` rotated by r whole `kind` blocks.
fn rotated_rows(kind: QuantKind, row: &[u8], rows: usize) -> Vec<u8> {
    let bb = kind.block_bytes();
    let mut matrix = Vec::new();
    for r in 0..rows {
        let shift = (r * bb) % row.len();
        matrix.extend_from_slice(&row[shift..]);
        matrix.extend_from_slice(&row[..shift]);
    }
    matrix
}

/// On every path, `gemv` of `rows` rows of `matrix` against `x` quantized
/// gives each row's scalar dot product, bit for bit.
fn gemv_gives_each_rows_dot(kind: QuantKind, matrix: &[u8], rows: usize, x: &[f32]) -> Result<(), TestCaseError> {
    let act = Activations::quantize_for(kind, x).unwrap();
    for path in DotPath::supported() {
        let mut y = vec![f32::NAN; rows];
        gemv_with(path, kind, matrix, rows, &act, &mut y).unwrap();
        for (r, row) in matrix.chunks_exact(matrix.len() / rows).enumerate() {
            prop_assert_eq!(y[r].to_bits(), dot_with(DotPath::Scalar, kind, row, &act).unwrap().to_bits(), "{} row {} of {} on {}", kind, r, rows, path);
        }
    }
    Ok(())
}

/// ggml's x86 `quantize_row_q8_0` (`127 / max`, halves to even) and its
/// `quantize_row_q8_K_ref` (which x86 runs; a strict-greater scan for the
/// largest magnitude) as they read, for the quantizers' faster forms to
/// equal.
fn q8_0_as_ggml_writes_it(x: &[f32]) -> Vec<BlockQ8_0> {
    x.chunks_exact(QK8_0)
        .map(|xs| {
            let amax = xs.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            let d = amax / 127.0;
            let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
            let mut qs = [0i8; QK8_0];
            for (q, &v) in qs.iter_mut().zip(xs) {
                *q = (v * id).round_ties_even().clamp(-127.0, 127.0) as i8;
            }
            BlockQ8_0 { d: half::f16::from_f32(d), qs }
        })
        .collect()
}

fn q8_k_as_ggml_writes_it(x: &[f32]) -> Vec<BlockQ8K> {
    x.chunks_exact(QK_K)
        .map(|xs| {
            let mut b = BlockQ8K { d: 0.0, qs: [0; QK_K], bsums: [0; 16] };
            let (mut amax, mut max) = (0.0f32, 0.0f32);
            for &v in xs {
                if v.abs() > amax {
                    (amax, max) = (v.abs(), v);
                }
            }
            if amax == 0.0 {
                return b;
            }
            let iscale = -127.0 / max;
            for (q, &v) in b.qs.iter_mut().zip(xs) {
                // ggml's `nearest_int`.
                let bits = (iscale * v + 12_582_912.0).to_bits() as i32;
                *q = ((bits & 0x007f_ffff) - 0x0040_0000).clamp(-127, 127) as i8;
            }
            for (j, s) in b.bsums.iter_mut().enumerate() {
                *s = b.qs[16 * j..16 * j + 16].iter().map(|&q| q as i16).sum();
            }
            b.d = 1.0 / iscale;
            b
        })
        .collect()
}

/// Activations for the quantizers: small integers and halves (ties for
/// the rounding), the largest magnitude held by several elements of either
/// sign, zeros, and now and then a NaN or an infinity.
fn quantizer_input() -> impl Strategy<Value = Vec<f32>> {
    let value = prop_oneof![
        6 => (-254i32..=254).prop_map(|k| k as f32 * 0.5),
        6 => -3.0f32..3.0,
        1 => Just(0.0f32),
        1 => prop::sample::select(vec![f32::NAN, f32::INFINITY, f32::NEG_INFINITY, -0.0, 1e-40, 3e38]),
    ];
    (prop::collection::vec(value, 2 * QK_K), 0usize..2 * QK_K, any::<bool>()).prop_map(|(mut x, at, neg)| {
        // The block's largest magnitude twice, with signs that may differ.
        let m = x.iter().filter(|v| v.is_finite()).fold(0.0f32, |m, v| m.max(v.abs()));
        x[at] = if neg { -m } else { m };
        x
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    /// The quantizers give the bytes of ggml's code as it reads.
    #[test]
    fn quantizers_are_ggml_code(x in quantizer_input()) {
        prop_assert_eq!(BlockQ8_0::to_bytes(&quantize_q8_0(&x).unwrap()), BlockQ8_0::to_bytes(&q8_0_as_ggml_writes_it(&x)));
        prop_assert_eq!(BlockQ8K::to_bytes(&quantize_q8_k(&x).unwrap()), BlockQ8K::to_bytes(&q8_k_as_ggml_writes_it(&x)));
    }

    /// Every SIMD path returns the scalar reference's bits, for any finite
    /// scales (subnormal and huge f16 included) and any quant bytes.
    #[test]
    fn simd_paths_equal_the_scalar_reference((kind, row, x) in case(any_scale)) {
        let act = Activations::quantize_for(kind, &x).unwrap();
        let reference = dot_with(DotPath::Scalar, kind, &row, &act).unwrap();
        for path in DotPath::supported() {
            let got = dot_with(path, kind, &row, &act).unwrap();
            prop_assert_eq!(got.to_bits(), reference.to_bits(), "{} on {}: {} vs {}", kind, path, got, reference);
        }
        for level in isa::supported() {
            prop_assert_eq!(dot(kind, &row, &act, level).unwrap().to_bits(), reference.to_bits());
        }
    }

    /// The row GEMV is each row's dot product.
    #[test]
    fn gemv_is_rowwise_dot((kind, row, x) in case(any_scale), rows in 1usize..5) {
        gemv_gives_each_rows_dot(kind, &rotated_rows(kind, &row, rows), rows, &x)?;
    }

    /// Many distinct rows of four blocks (MLA's per-head `attn_k_b`), which
    /// `gemv_32` takes eight rows at a time, a row a lane (Q5_1's too), and
    /// the last few eight blocks (two rows) at a time: each row's product
    /// is its dot product.
    #[test]
    fn gemv_of_four_block_rows_is_rowwise_dot((kind, matrix, x) in four_block_rows(), rows in 14usize..50) {
        gemv_gives_each_rows_dot(kind, &matrix[..rows * 4 * kind.block_bytes()], rows, &x)?;
    }

    /// Long rows, eight or more of them: each row's product is its dot
    /// product.
    #[test]
    fn gemv_of_long_rows_is_rowwise_dot((kind, row, x) in case_32(vec![8, 9, 11, 16, 21, 63, 64, 67, 72, 131]), rows in 8usize..20) {
        gemv_gives_each_rows_dot(kind, &rotated_rows(kind, &row, rows), rows, &x)?;
    }

    /// The band product of several tokens (`quant::matmul`, what linear
    /// layers run) is each token's dot product with each row, bit for bit,
    /// on every path: also where a kernel streams blocks across row ends,
    /// where whole groups of eight tokens share each block's unpacking, and
    /// where sixteen tokens take the lanes of one vector, a last group of
    /// fewer among them (the last 1 of 17 goes alone, the last 5 of 21 in
    /// the lanes of the 32-element formats, the k-quants' last 13 of 13 and
    /// 14 of 30 in theirs, their last 5 of 21 in a group of four and alone).
    #[test]
    fn matmul_is_each_tokens_rowwise_dot((kind, row, x) in case(any_scale), rows in 1usize..10, tokens in prop::sample::select(vec![1usize, 2, 3, 6, 8, 9, 13, 16, 17, 21, 22, 30, 37])) {
        let matrix = rotated_rows(kind, &row, rows);
        // Token t: x scaled and rotated by t elements, so the tokens differ.
        let len = x.len();
        let xs: Vec<f32> = (0..tokens * len).map(|k| (k / len) as f32 + 1.0).zip((0..tokens * len).map(|k| x[(k % len + k / len) % len])).map(|(s, v)| s * v).collect();
        let mut held = QuantizedTokens::default();
        held.quantize(kind, &xs, tokens).unwrap();
        for path in DotPath::supported() {
            let mut out = vec![f32::NAN; tokens * rows];
            quant::matmul(path, kind, &matrix, rows, &held, &mut out).unwrap();
            for t in 0..tokens {
                let act = Activations::quantize_for(kind, &xs[t * len..(t + 1) * len]).unwrap();
                for (r, chunk) in matrix.chunks_exact(row.len()).enumerate() {
                    let want = dot_with(DotPath::Scalar, kind, chunk, &act).unwrap();
                    prop_assert_eq!(out[t * rows + r].to_bits(), want.to_bits(), "{} on {}: token {} row {}", kind, path, t, r);
                }
            }
            // The tokens a MoE expert picks, in another order: its rows of
            // the output are those tokens' rows of the whole product.
            let picked: Vec<(usize, f32)> = (0..tokens).rev().step_by(2).chain((0..tokens).step_by(3)).map(|t| (t, 1.0)).collect();
            let mut sub = vec![f32::NAN; picked.len() * rows];
            quant::matmul_picked(path, kind, &matrix, rows, &held, &picked, &mut sub).unwrap();
            for (j, &(t, _)) in picked.iter().enumerate() {
                for r in 0..rows {
                    prop_assert_eq!(sub[j * rows + r].to_bits(), out[t * rows + r].to_bits(), "{} on {}: picked {} (token {}) row {}", kind, path, j, t, r);
                }
            }
        }
    }

    /// A thread keeps the k-quant tokens it transposed for the next band of
    /// the same product, so each change of the held activations must be
    /// seen: all of them quantized again, one token quantized again, and
    /// another set or order of picked tokens each give their own tokens'
    /// dots, on every path.
    #[test]
    fn transposed_tokens_follow_the_activations((kind, row, x) in case(any_scale).prop_filter("a k-quant", |(k, ..)| k.block_elems() == QK_K), rows in 1usize..6) {
        let matrix = rotated_rows(kind, &row, rows);
        let (len, n) = (x.len(), 33);
        // Token t of version v: x rotated by t, scaled by (t + 1) · v.
        let token = |t: usize, v: f32| -> Vec<f32> { (0..len).map(|k| x[(k + t) % len] * (t + 1) as f32 * v).collect() };
        let mut current: Vec<Vec<f32>> = (0..n).map(|t| token(t, 1.0)).collect();
        let mut held = QuantizedTokens::default();
        held.quantize(kind, &current.concat(), n).unwrap();
        let check = |held: &QuantizedTokens, current: &[Vec<f32>], picked: &[(usize, f32)]| -> Result<(), TestCaseError> {
            for path in DotPath::supported() {
                // The same call twice: the second reuses what the first transposed.
                for _ in 0..2 {
                    let mut out = vec![f32::NAN; picked.len() * rows];
                    quant::matmul_picked(path, kind, &matrix, rows, held, picked, &mut out).unwrap();
                    for (j, &(t, _)) in picked.iter().enumerate() {
                        let act = Activations::quantize_for(kind, &current[t]).unwrap();
                        for (r, chunk) in matrix.chunks_exact(row.len()).enumerate() {
                            prop_assert_eq!(out[j * rows + r].to_bits(), dot_with(DotPath::Scalar, kind, chunk, &act).unwrap().to_bits(), "{} on {}: token {} row {}", kind, path, t, r);
                        }
                    }
                }
            }
            Ok(())
        };
        let all: Vec<(usize, f32)> = (0..n).map(|t| (t, 1.0)).collect();
        check(&held, &current, &all)?;
        current = (0..n).map(|t| token(t, -0.5)).collect();
        held.quantize(kind, &current.concat(), n).unwrap();
        check(&held, &current, &all)?;
        current[5] = token(17, 2.0);
        held.quantize_token(5, &current[5]).unwrap();
        check(&held, &current, &all)?;
        check(&held, &current, &(0..n).rev().map(|t| (t, 1.0)).collect::<Vec<_>>())?;
        check(&held, &current, &(0..n).step_by(2).map(|t| (t, 1.0)).collect::<Vec<_>>())?;
    }

    /// Rows of no blocks (an empty input) give zeros, for a group of tokens
    /// as for one, on every path: not a panic over zero-length rows.
    #[test]
    fn empty_rows_give_zeros(kind in prop::sample::select(DOT_KINDS.to_vec()), tokens in prop::sample::select(vec![1usize, 8, 9, 16, 21])) {
        let mut held = QuantizedTokens::default();
        held.quantize(kind, &[], tokens).unwrap();
        for path in DotPath::supported() {
            let mut out = vec![f32::NAN; tokens * 3];
            quant::matmul(path, kind, &[], 3, &held, &mut out).unwrap();
            prop_assert!(out.iter().all(|&v| v == 0.0), "{} on {}", kind, path);
        }
    }

    /// dot(w, quant(x)) is within a derived bound of Σ dequant(w)·x:
    /// quantizing x moves each x_i by at most e_i (`quantization_error`),
    /// contributing Σ |w_i| e_i; the rest is f32 rounding. Each block's
    /// integers are exact; its fold rounds d_w·d_y, the i32 → f32 conversion,
    /// the product and the sum (a few eps on the block's Σ m_i |x_q,i|, with
    /// m the magnitudes above), and the running sum over B blocks adds up to
    /// B eps of the total; dequantizing w to f32 rounds each element by up
    /// to 3 eps of m_i. So the rounding part is ≤ (B + 8) eps Σ m_i |x_q,i|,
    /// doubled for the f64 reference's own sums and the cross terms.
    #[test]
    fn quantized_dot_is_close_to_the_float_dot((kind, row, x) in case(moderate_scale)) {
        let act = Activations::quantize_for(kind, &x).unwrap();
        let got = dot(kind, &row, &act, isa::detect()).unwrap() as f64;
        let mut w = vec![0f32; x.len()];
        dequantize_row(kind, &row, &mut w).unwrap();
        let m = magnitudes(kind, &row);
        let xq = match &act {
            Activations::Q8K(b) => dequantize_q8_k(b),
            Activations::Q8_0(b) => dequantize_q8_0(b),
            Activations::Q8_1(b) => dequantize_q8_1(b),
        };
        let exact: f64 = w.iter().zip(&x).map(|(&a, &b)| a as f64 * b as f64).sum();
        let e = quantization_error(&act, &x);
        let quant_bound: f64 = w.iter().zip(&e).map(|(&a, &e)| (a as f64).abs() * e).sum();
        let blocks = (x.len() / kind.block_elems()) as f64;
        let round_bound: f64 = 2.0 * (blocks + 8.0) * EPS * m.iter().zip(&xq).map(|(&m, &v)| m as f64 * (v as f64).abs()).sum::<f64>();
        let bound = quant_bound + round_bound + f64::from(f32::MIN_POSITIVE);
        prop_assert!((got - exact).abs() <= bound, "{}: {} vs {} (bound {}: quant {}, rounding {})", kind, got, exact, bound, quant_bound, round_bound);
    }

    /// Q8_K: each quant is x/d rounded to nearest, within [-127, 127]; the
    /// (first) largest magnitude maps to exactly -127, d taking the opposite
    /// of its sign; bsums are the sums; the
    /// bytes round-trip through ggml's layout.
    #[test]
    fn q8_k_round_trip(x in activations(2 * QK_K, QK_K)) {
        let blocks = quantize_q8_k(&x).unwrap();
        let back = dequantize_q8_k(&blocks);
        let e = quantization_error(&Activations::Q8K(blocks.clone()), &x);
        for (bi, (b, (xs, bk))) in blocks.iter().zip(x.chunks_exact(QK_K).zip(back.chunks_exact(QK_K))).enumerate() {
            let amax = xs.iter().fold(0f32, |m, v| m.max(v.abs()));
            if amax == 0.0 {
                prop_assert_eq!(b.d, 0.0);
                prop_assert!(b.qs.iter().all(|&q| q == 0));
                continue;
            }
            let i = xs.iter().position(|v| v.abs() == amax).unwrap();
            prop_assert_eq!(b.qs[i] as i32, -127);
            prop_assert_eq!(b.d < 0.0, xs[i] > 0.0);
            prop_assert!((b.d.abs() - amax / 127.0).abs() <= 2.0 * f32::EPSILON * b.d.abs());
            for j in 0..16 {
                prop_assert_eq!(b.bsums[j] as i32, b.qs[16 * j..16 * j + 16].iter().map(|&q| q as i32).sum::<i32>());
            }
            prop_assert!(b.qs.iter().all(|&q| q != i8::MIN));
            for (k, (&v, &r)) in xs.iter().zip(bk).enumerate() {
                prop_assert!(((v - r) as f64).abs() <= e[QK_K * bi + k], "{} -> {}", v, r);
            }
        }
        prop_assert_eq!(BlockQ8K::from_bytes(&BlockQ8K::to_bytes(&blocks)).unwrap(), blocks);
    }

    /// Q8_0: |x - dequant(quant(x))| within the bound above, the largest
    /// magnitude maps to ±127, and the bytes round-trip.
    #[test]
    fn q8_0_round_trip(x in activations(4 * QK8_0, QK8_0)) {
        let blocks = quantize_q8_0(&x).unwrap();
        let back = dequantize_q8_0(&blocks);
        let e = quantization_error(&Activations::Q8_0(blocks.clone()), &x);
        for (i, (&v, &r)) in x.iter().zip(&back).enumerate() {
            prop_assert!(((v - r) as f64).abs() <= e[i], "{} -> {}", v, r);
        }
        for (b, xs) in blocks.iter().zip(x.chunks_exact(QK8_0)) {
            let amax = xs.iter().fold(0f32, |m, v| m.max(v.abs()));
            if amax > 0.0 {
                let i = xs.iter().position(|v| v.abs() == amax).unwrap();
                prop_assert_eq!((b.qs[i] as i32).abs(), 127);
            }
        }
        prop_assert_eq!(BlockQ8_0::from_bytes(&BlockQ8_0::to_bytes(&blocks)).unwrap(), blocks);
    }

    /// Q8_1 (Q5_1's activations) is Q8_0's quants and `d`, and `s` is
    /// ggml's: the quants' sum times the f32 `d`, rounded to half precision
    /// (these blocks' sums are well inside its range).
    #[test]
    fn q8_1_is_q8_0_with_its_sum(x in activations(4 * QK8_0, QK8_0)) {
        let (one, zero) = (quantize_q8_1(&x).unwrap(), quantize_q8_0(&x).unwrap());
        for ((b1, b0), xs) in one.iter().zip(&zero).zip(x.chunks_exact(QK8_0)) {
            prop_assert_eq!((b1.d, b1.qs), (b0.d, b0.qs));
            let d = xs.iter().fold(0f32, |m, v| m.max(v.abs())) / 127.0;
            let sum: i32 = b1.qs.iter().map(|&q| q as i32).sum();
            prop_assert_eq!(b1.s.to_bits(), half::f16::from_f32(sum as f32 * d).to_f32().to_bits());
        }
    }

    /// Weight round trip: re-quantizing a Q8_0 row's decoded values gives
    /// the same quants back (a Q8_0 weight row is its own Q8_0 activation,
    /// when its scale is positive, it has no -128 and its largest quant is
    /// ±127).
    #[test]
    fn q8_0_weights_requantize_to_themselves(qs in prop::collection::vec(-127i8..=127, QK8_0), d in scale_f16(), pick in 0usize..QK8_0, top in any::<bool>()) {
        let mut qs = qs;
        qs[pick] = if top { 127 } else { -127 };
        let mut row = (d & 0x7fff).to_le_bytes().to_vec();
        row.extend(qs.iter().map(|&q| q as u8));
        let mut w = vec![0f32; QK8_0];
        dequantize_row(QuantKind::Q8_0, &row, &mut w).unwrap();
        let again = quantize_q8_0(&w).unwrap();
        prop_assert_eq!(&again[0].qs[..], &qs[..]);
    }
}

// ---------------------------------------------------------------------------
// Layouts, plain formats and errors

/// The largest integers the kernels meet: every quant at its top (Q4_K 15,
/// Q5_K 31, Q6_K 63, Q8_0 ±127 and Q4_0/Q5_0/Q5_1's extremes), the largest
/// scale bytes of either sign, against activations all at +127 or all at
/// −127 (Q8_K and Q8_0 never hold −128). The SIMD kernels keep four
/// products' sums in i16 words (at most 4 × 63 × 127 here) and whole
/// blocks' in i32: every path must still give the scalar reference's bits.
#[test]
fn extreme_quants_and_activations_keep_the_reference_bits() {
    let scale = half::f16::from_f32(0.01).to_bits().to_le_bytes();
    for kind in DOT_KINDS {
        let cols = 2 * QK_K;
        for (fill, scale_fill) in [(0xffu8, 0xffu8), (0xff, 0x80), (0x80, 0x7f), (0x00, 0xff)] {
            if kind == QuantKind::Q8_0 && fill == 0 {
                continue; // zero weights: nothing to test
            }
            let mut row = vec![fill; kind.row_bytes(cols).unwrap()];
            for block in row.chunks_exact_mut(kind.block_bytes()) {
                // f16 scales where the format keeps them; Q6_K's i8 sub-block scales at 192..208.
                let halves: &[usize] = match kind {
                    QuantKind::Q4K | QuantKind::Q5K | QuantKind::Q5_1 => &[0, 2],
                    QuantKind::Q6K => &[208],
                    _ => &[0],
                };
                for &at in halves {
                    block[at..at + 2].copy_from_slice(&scale);
                }
                match kind {
                    QuantKind::Q4K | QuantKind::Q5K => block[4..16].fill(scale_fill),
                    QuantKind::Q6K => block[192..208].fill(scale_fill),
                    _ => {}
                }
            }
            for sign in [1.0f32, -1.0] {
                let x = vec![sign; cols];
                let act = Activations::quantize_for(kind, &x).unwrap();
                let reference = dot_with(DotPath::Scalar, kind, &row, &act).unwrap();
                assert!(reference.is_finite() && reference != 0.0, "{kind}: a degenerate case ({reference})");
                for path in DotPath::supported() {
                    let got = dot_with(path, kind, &row, &act).unwrap();
                    assert_eq!(got.to_bits(), reference.to_bits(), "{kind} on {path}, quant bytes {fill:#x}, scale bytes {scale_fill:#x}, activations {sign}: {got} vs {reference}");
                }
            }
        }
    }
}

/// Activations whose block sums pass half precision's range (65504): ggml's
/// Q8_1 `s` is infinite there and its Q5_1 products NaN or infinite; here
/// `s` keeps its f32 value and the product stays finite and close.
#[test]
fn q5_1_products_of_large_activations_stay_finite() {
    let x: Vec<f32> = (0..2 * QK8_0).map(|i| 3000.0 + i as f32).collect();
    let blocks = quantize_q8_1(&x).unwrap();
    assert!(half::f16::from_f32(blocks[0].s).is_infinite(), "the case must overflow half precision: s = {}", blocks[0].s);
    let d = half::f16::from_f32(0.01).to_bits().to_le_bytes();
    let m = half::f16::from_f32(-0.2).to_bits().to_le_bytes();
    let mut row = Vec::new();
    for _ in 0..2 {
        row.extend(d);
        row.extend(m);
        row.extend([0x55u8; 4 + 16]);
    }
    let mut w = vec![0f32; x.len()];
    dequantize_row(QuantKind::Q5_1, &row, &mut w).unwrap();
    let exact: f64 = w.iter().zip(&x).map(|(&a, &b)| a as f64 * b as f64).sum();
    let act = Activations::Q8_1(blocks);
    for path in DotPath::supported() {
        let got = dot_with(path, QuantKind::Q5_1, &row, &act).unwrap() as f64;
        assert!(got.is_finite() && (got - exact).abs() <= 1e-2 * exact.abs(), "{path}: {got} vs {exact}");
    }
}

#[test]
fn block_sizes_are_ggml_s() {
    let sizes: Vec<(QuantKind, usize, usize)> = QuantKind::ALL.iter().map(|&k| (k, k.block_elems(), k.block_bytes())).collect();
    assert_eq!(
        sizes,
        vec![
            (QuantKind::F32, 1, 4),
            (QuantKind::F16, 1, 2),
            (QuantKind::Bf16, 1, 2),
            (QuantKind::Q4_0, 32, 18),
            (QuantKind::Q5_0, 32, 22),
            (QuantKind::Q5_1, 32, 24),
            (QuantKind::Q8_0, 32, 34),
            (QuantKind::Q4K, 256, 144),
            (QuantKind::Q5K, 256, 176),
            (QuantKind::Q6K, 256, 210),
        ]
    );
    assert_eq!(std::mem::size_of::<BlockQ8K>(), 292);
    assert_eq!(std::mem::size_of::<BlockQ8_0>(), 34);
    assert_eq!(std::mem::size_of::<BlockQ8_1>(), 40, "ggml's 36, with `s` held in f32");
    for k in QuantKind::ALL {
        assert_eq!(QuantKind::from_ggml_type(k.ggml_type()), Some(k));
    }
    assert_eq!(QuantKind::from_ggml_type(7), Some(QuantKind::Q5_1));
    assert_eq!(QuantKind::from_ggml_type(3), None, "Q4_1 is not read");
}

#[test]
fn plain_float_rows_decode() {
    let f32s = [1.5f32, -0.0, 3.25e-3];
    let bytes: Vec<u8> = f32s.iter().flat_map(|v| v.to_le_bytes()).collect();
    let mut out = [0f32; 3];
    dequantize_row(QuantKind::F32, &bytes, &mut out).unwrap();
    assert_eq!(bits(&out), bits(&f32s));

    // 0x3c00 = 1.0, 0xc000 = -2.0, 0x0001 = 2^-24 (smallest subnormal).
    let bytes: Vec<u8> = [0x3c00u16, 0xc000, 0x0001].iter().flat_map(|v| v.to_le_bytes()).collect();
    dequantize_row(QuantKind::F16, &bytes, &mut out).unwrap();
    assert_eq!(out, [1.0, -2.0, 2f32.powi(-24)]);

    // BF16 is the top half of an f32.
    let bytes: Vec<u8> = [0x3f80u16, 0xc0a0, 0x0001].iter().flat_map(|v| v.to_le_bytes()).collect();
    dequantize_row(QuantKind::Bf16, &bytes, &mut out).unwrap();
    assert_eq!(bits(&out), vec![0x3f80_0000, 0xc0a0_0000, 0x0001_0000]);
}

/// Hand-built blocks with known values, one per k-quant layout detail.
#[test]
fn hand_built_blocks_decode() {
    // Q4_0: d = 0.5, byte j = (j % 16) | (15 - j % 16) << 4.
    let mut b = half::f16::from_f32(0.5).to_bits().to_le_bytes().to_vec();
    b.extend((0..16u8).map(|j| j | ((15 - j) << 4)));
    let mut y = [0f32; 32];
    dequantize_row(QuantKind::Q4_0, &b, &mut y).unwrap();
    for j in 0..16 {
        assert_eq!(y[j], (j as f32 - 8.0) * 0.5);
        assert_eq!(y[j + 16], (7.0 - j as f32) * 0.5);
    }

    // Q5_0 and Q5_1 share a run of qh = 0xA5A5_0F0F (element j's fifth bit
    // is bit j) and the nibbles as in Q4_0. Q5_0's values are d·(q − 16)
    // with d = 0.25; Q5_1's, after its m = −3, d·q + m.
    let run: Vec<u8> = 0xA5A5_0F0Fu32.to_le_bytes().into_iter().chain((0..16u8).map(|j| j | ((15 - j) << 4))).collect();
    let quant = |j: usize| (if j < 16 { j as i32 } else { 31 - j as i32 }) + ((0xA5A5_0F0Fu32 >> j) & 1) as i32 * 16;
    let half = |v: f32| half::f16::from_f32(v).to_bits().to_le_bytes();
    dequantize_row(QuantKind::Q5_0, &[&half(0.25)[..], &run].concat(), &mut y).unwrap();
    for (j, v) in y.iter().enumerate() {
        assert_eq!(*v, (quant(j) - 16) as f32 * 0.25, "Q5_0 element {j}");
    }
    dequantize_row(QuantKind::Q5_1, &[&half(0.25)[..], &half(-3.0), &run].concat(), &mut y).unwrap();
    for (j, v) in y.iter().enumerate() {
        assert_eq!(*v, quant(j) as f32 * 0.25 - 3.0, "Q5_1 element {j}");
    }

    // Q4_K: d = 1, dmin = 0.25; sub-block s has scale s + 1 and min 2s
    // (scales/mins 4..8 use the split six-bit encoding); every quant is 3.
    let (sc, mn): ([u8; 8], [u8; 8]) = (std::array::from_fn(|s| s as u8 + 1 + 40 * (s >= 4) as u8), std::array::from_fn(|s| 2 * s as u8 + 30 * (s >= 5) as u8));
    let mut scales = [0u8; 12];
    for j in 0..4 {
        scales[j] = sc[j] | ((sc[j + 4] >> 4) << 6);
        scales[j + 4] = mn[j] | ((mn[j + 4] >> 4) << 6);
        scales[j + 8] = (sc[j + 4] & 15) | ((mn[j + 4] & 15) << 4);
    }
    let mut b = half::f16::from_f32(1.0).to_bits().to_le_bytes().to_vec();
    b.extend(half::f16::from_f32(0.25).to_bits().to_le_bytes());
    b.extend(scales);
    b.extend([0x33u8; 128]);
    let mut y = [0f32; 256];
    dequantize_row(QuantKind::Q4K, &b, &mut y).unwrap();
    for (e, v) in y.iter().enumerate() {
        let s = e / 32;
        assert_eq!(*v, sc[s] as f32 * 3.0 - 0.25 * mn[s] as f32, "element {e}");
    }

    // Q5_K: the same, with qh byte l having bit s set only for l == s: so
    // element 32s + s is 3 + 16, the rest 3.
    let mut b5 = b[..16].to_vec();
    b5.extend((0..32u8).map(|l| if l < 8 { 1 << l } else { 0 }));
    b5.extend([0x33u8; 128]);
    dequantize_row(QuantKind::Q5K, &b5, &mut y).unwrap();
    for (e, v) in y.iter().enumerate() {
        let s = e / 32;
        let q = if e % 32 == s { 19.0 } else { 3.0 };
        assert_eq!(*v, sc[s] as f32 * q - 0.25 * mn[s] as f32, "element {e}");
    }

    // Q6_K: element e stores (e % 64); scale of sub-block s is s - 8; d = 2.
    let mut b6 = vec![0u8; 210];
    for e in 0..256 {
        let q = (e % 64) as u8;
        let (half, k, l) = (e / 128, (e % 128) / 32, e % 32);
        let at = 64 * half + 32 * (k % 2) + l;
        b6[at] |= if k < 2 { q & 15 } else { (q & 15) << 4 };
        b6[128 + 32 * half + l] |= (q >> 4) << (2 * k);
    }
    for s in 0..16 {
        b6[192 + s] = (s as i8 - 8) as u8;
    }
    b6[208..210].copy_from_slice(&half::f16::from_f32(2.0).to_bits().to_le_bytes());
    dequantize_row(QuantKind::Q6K, &b6, &mut y).unwrap();
    for (e, v) in y.iter().enumerate() {
        assert_eq!(*v, 2.0 * ((e / 16) as f32 - 8.0) * ((e % 64) as f32 - 32.0), "element {e}");
    }
}

#[test]
fn bad_operands_are_clear_errors() {
    let x = vec![0.5f32; QK_K];
    let k = Activations::quantize_for(QuantKind::Q4K, &x).unwrap();
    let z = Activations::quantize_for(QuantKind::Q8_0, &x).unwrap();
    let row = vec![0u8; 144];
    assert_eq!(
        dot(QuantKind::Q4K, &row, &z, isa::detect()),
        Err(QuantError::WrongActivations { kind: QuantKind::Q4K, wanted: "Q8_K", got: "Q8_0" })
    );
    assert_eq!(
        dot(QuantKind::Q4K, &row[..100], &k, isa::detect()),
        Err(QuantError::PartialBlock { kind: QuantKind::Q4K, bytes: 100, block_bytes: 144 })
    );
    assert_eq!(
        dot(QuantKind::Q8_0, &[0u8; 34], &z, isa::detect()),
        Err(QuantError::LengthMismatch { kind: QuantKind::Q8_0, row: 32, activations: 256 })
    );
    assert_eq!(dot(QuantKind::F16, &[0u8; 512], &k, isa::detect()), Err(QuantError::NoDot { kind: QuantKind::F16 }));
    assert_eq!(Activations::quantize_for(QuantKind::Bf16, &x), Err(QuantError::NoDot { kind: QuantKind::Bf16 }));
    assert_eq!(
        quantize_q8_k(&x[..100]),
        Err(QuantError::PartialElements { kind: QuantKind::Q4K, elements: 100, block: 256 })
    );
    let mut y = vec![0f32; 2];
    assert_eq!(
        gemv_with(DotPath::Scalar, QuantKind::Q4K, &row, 2, &k, &mut y),
        Err(QuantError::MatrixShape { bytes: 144, rows: 2, row_bytes: 144 })
    );
    assert_eq!(
        gemv_with(DotPath::Scalar, QuantKind::Q4K, &row, 1, &k, &mut y),
        Err(QuantError::OutputSize { got: 2, expected: 1 })
    );
    let mut out = vec![0f32; 300];
    assert!(matches!(dequantize_row(QuantKind::Q6K, &[0u8; 210], &mut out), Err(QuantError::PartialElements { .. })));
    assert!(matches!(dequantize_row(QuantKind::Q6K, &[0u8; 200], &mut out[..256]), Err(QuantError::LengthMismatch { .. })));
    // Messages name what is wrong.
    let msg = dot(QuantKind::Q4K, &row, &z, isa::detect()).unwrap_err().to_string();
    assert_eq!(msg, "Q4_K weights need Q8_K activations, got Q8_0");

    // Activation bytes that would break the kernels are refused.
    let mut bytes = BlockQ8_0::to_bytes(&quantize_q8_0(&x[..32]).unwrap());
    bytes[5] = 0x80;
    assert!(matches!(BlockQ8_0::from_bytes(&bytes), Err(QuantError::BadActivations { kind: "Q8_0", block: 0, .. })));
    let mut bytes = BlockQ8K::to_bytes(&quantize_q8_k(&x).unwrap());
    bytes[4] = bytes[4].wrapping_add(1);
    assert!(matches!(BlockQ8K::from_bytes(&bytes), Err(QuantError::BadActivations { kind: "Q8_K", block: 0, .. })));
    assert!(matches!(BlockQ8K::from_bytes(&bytes[..291]), Err(QuantError::BadActivations { .. })));
}

#[test]
fn empty_operands_give_zero() {
    let act = Activations::quantize_for(QuantKind::Q6K, &[]).unwrap();
    assert!(act.is_empty());
    assert_eq!(dot(QuantKind::Q6K, &[], &act, isa::detect()), Ok(0.0));
    let mut y = vec![f32::NAN; 3];
    gemv_with(DotPath::Scalar, QuantKind::Q6K, &[], 3, &act, &mut y).unwrap();
    assert_eq!(y, vec![0.0; 3]);
}

#[test]
fn paths_follow_the_isa_level() {
    use duplex_kernels::cpu::Isa;
    assert_eq!(DotPath::for_isa(Isa::Portable), DotPath::Scalar);
    let supported = DotPath::supported();
    assert_eq!(supported[0], DotPath::Scalar);
    for level in isa::supported() {
        assert!(supported.contains(&DotPath::for_isa(level)));
    }
    if isa::hardware() >= Isa::Avx2 {
        assert_eq!(DotPath::for_isa(Isa::Avx2), DotPath::Avx2);
    }
    #[cfg(target_arch = "x86_64")]
    if isa::hardware() >= Isa::Avx512 && std::arch::is_x86_feature_detected!("avx512vnni") {
        assert_eq!(DotPath::for_isa(Isa::Avx512), DotPath::Avx512Vnni);
    }
}
