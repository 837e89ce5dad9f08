//! ggml's block-quantized weight formats (GGUF tensors) and their dot products.
//!
//! A GGUF k-quant model (Q4_K_M and kin) stores each weight row as a run of
//! fixed-size blocks in ggml's byte layout; llama.cpp multiplies such a row by
//! an activation vector that it first quantizes to 8 bits (Q8_K for the
//! k-quants, Q8_0 for Q4_0/Q5_0/Q8_0, Q8_1 for Q5_1), so that the inner loop
//! is an integer dot product and the scales are applied once per block. This
//! module does the same:
//!
//! - [`blocks`]: the layouts ([`QuantKind`], [`BlockQ8K`], [`BlockQ8_0`],
//!   [`BlockQ8_1`]), scalar dequantization of every weight format to f32,
//!   and quantization of f32 activations to Q8_K / Q8_0 / Q8_1 as ggml's
//!   reference code does it.
//! - [`dot`] / [`gemv`]: a weight row (raw GGUF bytes, no alignment needed)
//!   against quantized activations, on the portable scalar reference, AVX2
//!   (`vpmaddubsw`) or AVX-512 VNNI (`vpdpbusd`), chosen at run time from an
//!   [`Isa`] level the same way as the other CPU kernels.
//!
//! # Exactness
//! Every path computes each block's integer sums exactly (they are the sums
//! ggml's reference forms, regrouped; no intermediate can overflow, see the
//! bounds at each kernel) and then folds the blocks into the f32 result with
//! the same f32 operations, one block at a time (`fold_k` for the
//! k-quants, `fold_32` for the 32-element formats). So the SIMD paths
//! return the scalar reference's bits exactly, and the tests say so, and a
//! token's products do not depend on which kernel took it: one token, a
//! group of tokens, or sixteen tokens in the lanes of the prefill GEMMs
//! (`lanes_avx512`, `klanes_avx512`). Against llama.cpp the integers are
//! identical and only the f32 folding differs (its SIMD decode keeps a
//! vector of partial sums per row), which is f32 rounding.

pub mod blocks;
mod dot_scalar;
#[cfg(target_arch = "x86_64")]
mod dot_avx2;
#[cfg(target_arch = "x86_64")]
mod dot_avx512;
#[cfg(target_arch = "x86_64")]
mod klanes;
#[cfg(target_arch = "x86_64")]
mod klanes_avx2;
#[cfg(target_arch = "x86_64")]
mod klanes_avx512;
#[cfg(target_arch = "x86_64")]
mod ktiles_amx;
#[cfg(target_arch = "x86_64")]
mod lanes_avx2;
#[cfg(target_arch = "x86_64")]
mod lanes_avx512;
mod tiles_amx;

pub use blocks::{
    dequantize_row, quantize_q8_0, quantize_q8_0_into, quantize_q8_1, quantize_q8_1_into, quantize_q8_k, quantize_q8_k_into, BlockQ8K,
    BlockQ8_0, BlockQ8_1, QuantKind, QK_K, QK8_0,
};

use crate::cpu::isa::Isa;
use std::fmt;

/// What can be wrong with a quantized product's operands.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum QuantError {
    /// A row of `kind` must be whole blocks.
    #[error("{kind} row of {bytes} bytes is not a whole number of {block_bytes}-byte blocks")]
    PartialBlock { kind: QuantKind, bytes: usize, block_bytes: usize },
    /// An element count that does not fill whole blocks.
    #[error("{kind} needs a multiple of {block} elements, got {elements}")]
    PartialElements { kind: QuantKind, elements: usize, block: usize },
    /// The weight row and the activations hold different element counts.
    #[error("{kind} weight row has {row} elements but the activations have {activations}")]
    LengthMismatch { kind: QuantKind, row: usize, activations: usize },
    /// The activations were quantized for another family of weights.
    #[error("{kind} weights need {wanted} activations, got {got}")]
    WrongActivations { kind: QuantKind, wanted: &'static str, got: &'static str },
    /// This format has no quantized dot product (it is dequantized instead).
    #[error("{kind} has no quantized dot product; dequantize it")]
    NoDot { kind: QuantKind },
    /// Output buffer of the wrong size.
    #[error("output has {got} elements, expected {expected}")]
    OutputSize { got: usize, expected: usize },
    /// A matrix that is not `rows` whole rows.
    #[error("matrix of {bytes} bytes is not {rows} rows of {row_bytes} bytes")]
    MatrixShape { bytes: usize, rows: usize, row_bytes: usize },
    /// Activation bytes that break the invariants the kernels rely on.
    #[error("bad {kind} activation block {block}: {why}")]
    BadActivations { kind: &'static str, block: usize, why: &'static str },
}

/// Activations quantized for one family of weight formats, as ggml pairs
/// them (its `vec_dot_type`): Q8_K for the k-quants, Q8_0 for Q4_0, Q5_0
/// and Q8_0, Q8_1 for Q5_1.
///
/// Invariants every kernel relies on, kept by the constructors: every quant
/// is in [-127, 127] (never -128, which would overflow AVX2's `vpmaddubsw`
/// sign trick) and every Q8_K `bsums` entry is the sum of its 16 quants (the
/// k-quant kernels take their minimum and offset terms from it).
#[derive(Clone, Debug, PartialEq)]
pub enum Activations {
    Q8K(Vec<BlockQ8K>),
    Q8_0(Vec<BlockQ8_0>),
    Q8_1(Vec<BlockQ8_1>),
}

impl Activations {
    /// Quantize `x` for products with `kind` weights (ggml's reference
    /// quantization; see [`quantize_q8_k`] and [`quantize_q8_0`]).
    pub fn quantize_for(kind: QuantKind, x: &[f32]) -> Result<Activations, QuantError> {
        match kind {
            QuantKind::Q4K | QuantKind::Q5K | QuantKind::Q6K => Ok(Activations::Q8K(quantize_q8_k(x)?)),
            QuantKind::Q4_0 | QuantKind::Q5_0 | QuantKind::Q8_0 => Ok(Activations::Q8_0(quantize_q8_0(x)?)),
            QuantKind::Q5_1 => Ok(Activations::Q8_1(quantize_q8_1(x)?)),
            QuantKind::F32 | QuantKind::F16 | QuantKind::Bf16 => Err(QuantError::NoDot { kind }),
        }
    }

    /// How many elements these activations hold.
    pub fn len(&self) -> usize {
        match self {
            Activations::Q8K(b) => b.len() * QK_K,
            Activations::Q8_0(b) => b.len() * QK8_0,
            Activations::Q8_1(b) => b.len() * QK8_0,
        }
    }

    /// Whether there are no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn name(&self) -> &'static str {
        match self {
            Activations::Q8K(_) => "Q8_K",
            Activations::Q8_0(_) => "Q8_0",
            Activations::Q8_1(_) => "Q8_1",
        }
    }
}

/// Which implementation a product runs on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum DotPath {
    /// Plain Rust integer arithmetic: the reference.
    Scalar,
    /// AVX2 `vpmaddubsw`/`vpmaddwd`.
    Avx2,
    /// AVX-512 BW with VNNI `vpdpbusd`.
    Avx512Vnni,
    /// [`DotPath::Avx512Vnni`], with the prefill GEMMs on AMX INT8 tiles
    /// (`tdpbssd`; the 32-element formats in `tiles_amx`, the k-quants in
    /// `ktiles_amx`), where the CPU has them and they pass their
    /// self-check. The same bits.
    Amx,
}

impl DotPath {
    /// The best path for `isa` on this CPU. AVX-512 levels take VNNI only
    /// where the CPU has it (it is not part of [`Isa`]'s ladder: every
    /// AVX-512 BF16 CPU has it, but a plain AVX-512 one may not) and fall
    /// back to AVX2 otherwise; they add AMX tiles where those are usable
    /// (`DUPLEX_AMX=off` keeps them off).
    pub fn for_isa(isa: Isa) -> DotPath {
        match isa.usable() {
            Isa::Portable => DotPath::Scalar,
            Isa::Avx2 => DotPath::Avx2,
            _ if tiles_amx::usable() => DotPath::Amx,
            _ if has_vnni() => DotPath::Avx512Vnni,
            _ => DotPath::Avx2,
        }
    }

    /// The lower-case name used in benchmarks.
    pub fn name(self) -> &'static str {
        match self {
            DotPath::Scalar => "scalar",
            DotPath::Avx2 => "avx2",
            DotPath::Avx512Vnni => "avx512vnni",
            DotPath::Amx => "amx",
        }
    }

    /// Every path this CPU can run, scalar first.
    pub fn supported() -> Vec<DotPath> {
        let mut v = vec![DotPath::Scalar];
        if Isa::Avx2.usable() >= Isa::Avx2 {
            v.push(DotPath::Avx2);
        }
        if Isa::Avx512.usable() >= Isa::Avx512 && has_vnni() {
            v.push(DotPath::Avx512Vnni);
            if tiles_amx::usable() {
                v.push(DotPath::Amx);
            }
        }
        v
    }
}

impl fmt::Display for DotPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(target_arch = "x86_64")]
fn has_vnni() -> bool {
    std::arch::is_x86_feature_detected!("avx512vnni")
}

#[cfg(not(target_arch = "x86_64"))]
fn has_vnni() -> bool {
    false
}

/// The f32 fold of one k-quant block into its row's sum, `acc + d · sumi -
/// dmin · summ`: `sumi` is the block's integer sum of scale × quant ×
/// activation over its 256 elements (for Q6_K less its offset, 32 × Σ
/// scale × the sub-block's activation sum), `summ` its minimum term, Σ min
/// × the sub-block's activation sum (Q4_K, Q5_K; zero for Q6_K); `d` and
/// `dmin` are the weight block's scales times the activation block's.
/// Every path reduces each block's integers exactly (their order does not
/// matter) and folds them here, block by block: that is what makes them
/// bit-equal, and it leaves a row's whole product with one token in one
/// f32, so a GEMM can keep a token per lane (see `klanes_avx512`).
#[inline(always)]
fn fold_k(acc: f32, d: f32, sumi: i32, dmin: f32, summ: i32) -> f32 {
    acc + d * sumi as f32 - dmin * summ as f32
}

/// The f32 fold of one 32-element block (Q4_0, Q8_0): `sumi` × (weight scale
/// × activation scale), as ggml's reference writes it for Q8_0.
#[inline(always)]
fn fold_32(acc: f32, dx: f32, dy: f32, sumi: i32) -> f32 {
    acc + sumi as f32 * (dx * dy)
}

/// The f32 fold of one Q5_1 block: [`fold_32`]'s product plus the weights'
/// `m` times the activations' sum `s`, added to it first, as ggml's
/// reference writes it.
#[inline(always)]
fn fold_q5_1(acc: f32, dx: f32, dy: f32, sumi: i32, m: f32, s: f32) -> f32 {
    acc + (sumi as f32 * (dx * dy) + m * s)
}

/// A checked pairing of weight format and activations: what a kernel runs.
#[derive(Clone, Copy)]
enum Op<'a> {
    Q4K(&'a [BlockQ8K]),
    Q5K(&'a [BlockQ8K]),
    Q6K(&'a [BlockQ8K]),
    Q4_0(&'a [BlockQ8_0]),
    Q5_0(&'a [BlockQ8_0]),
    Q5_1(&'a [BlockQ8_1]),
    Q8_0(&'a [BlockQ8_0]),
}

/// Check that `kind` weights multiply `act`'s kind of activations.
fn pair(kind: QuantKind, act: &Activations) -> Result<Op<'_>, QuantError> {
    match (kind, act) {
        (QuantKind::Q4K, Activations::Q8K(y)) => Ok(Op::Q4K(y)),
        (QuantKind::Q5K, Activations::Q8K(y)) => Ok(Op::Q5K(y)),
        (QuantKind::Q6K, Activations::Q8K(y)) => Ok(Op::Q6K(y)),
        (QuantKind::Q4_0, Activations::Q8_0(y)) => Ok(Op::Q4_0(y)),
        (QuantKind::Q5_0, Activations::Q8_0(y)) => Ok(Op::Q5_0(y)),
        (QuantKind::Q8_0, Activations::Q8_0(y)) => Ok(Op::Q8_0(y)),
        (QuantKind::Q5_1, Activations::Q8_1(y)) => Ok(Op::Q5_1(y)),
        (QuantKind::F32 | QuantKind::F16 | QuantKind::Bf16, _) => Err(QuantError::NoDot { kind }),
        (QuantKind::Q4K | QuantKind::Q5K | QuantKind::Q6K, _) => {
            Err(QuantError::WrongActivations { kind, wanted: "Q8_K", got: act.name() })
        }
        (QuantKind::Q4_0 | QuantKind::Q5_0 | QuantKind::Q8_0, _) => Err(QuantError::WrongActivations { kind, wanted: "Q8_0", got: act.name() }),
        (QuantKind::Q5_1, _) => Err(QuantError::WrongActivations { kind, wanted: "Q8_1", got: act.name() }),
    }
}

/// Check a weight row against the activations.
fn check_row<'a>(kind: QuantKind, row: &[u8], act: &'a Activations) -> Result<Op<'a>, QuantError> {
    let op = pair(kind, act)?;
    let bb = kind.block_bytes();
    if !row.len().is_multiple_of(bb) {
        return Err(QuantError::PartialBlock { kind, bytes: row.len(), block_bytes: bb });
    }
    let elements = row.len() / bb * kind.block_elems();
    if elements != act.len() {
        return Err(QuantError::LengthMismatch { kind, row: elements, activations: act.len() });
    }
    Ok(op)
}

/// Run one checked row on `path`.
#[inline]
fn dot_on(path: DotPath, row: &[u8], op: Op) -> f32 {
    match path {
        DotPath::Scalar => match op {
            Op::Q4K(y) => dot_scalar::dot_q45k::<false>(row, y),
            Op::Q5K(y) => dot_scalar::dot_q45k::<true>(row, y),
            Op::Q6K(y) => dot_scalar::dot_q6k(row, y),
            Op::Q4_0(y) => dot_scalar::dot_q4_0(row, y),
            Op::Q5_0(y) => dot_scalar::dot_q5_0(row, y),
            Op::Q5_1(y) => dot_scalar::dot_q5_1(row, y),
            Op::Q8_0(y) => dot_scalar::dot_q8_0(row, y),
        },
        // SAFETY: `runnable` only lets through paths whose features this
        // CPU has; the row holds exactly `y.len()` blocks (checked).
        #[cfg(target_arch = "x86_64")]
        DotPath::Avx2 => unsafe {
            match op {
                Op::Q4K(y) => dot_avx2::dot_q45k::<false>(row, y),
                Op::Q5K(y) => dot_avx2::dot_q45k::<true>(row, y),
                Op::Q6K(y) => dot_avx2::dot_q6k(row, y),
                Op::Q4_0(y) => dot_avx2::dot_q4_0(row, y),
                Op::Q5_0(y) => dot_avx2::dot_q5_0(row, y),
                Op::Q5_1(y) => dot_avx2::dot_q5_1(row, y),
                Op::Q8_0(y) => dot_avx2::dot_q8_0(row, y),
            }
        },
        // SAFETY: as above (AMX tiles are for many tokens; one row runs on VNNI).
        #[cfg(target_arch = "x86_64")]
        DotPath::Avx512Vnni | DotPath::Amx => unsafe {
            match op {
                Op::Q4K(y) => dot_avx512::dot_q45k::<false>(row, y),
                Op::Q5K(y) => dot_avx512::dot_q45k::<true>(row, y),
                Op::Q6K(y) => dot_avx512::dot_q6k(row, y),
                Op::Q4_0(y) => dot_avx512::dot_q4_0(row, y),
                Op::Q5_0(y) => dot_avx512::dot_q5_0(row, y),
                Op::Q5_1(y) => dot_avx512::dot_q5_1(row, y),
                Op::Q8_0(y) => dot_avx512::dot_q8_0(row, y),
            }
        },
        #[cfg(not(target_arch = "x86_64"))]
        _ => dot_on(DotPath::Scalar, row, op),
    }
}

/// A path the caller named, lowered to one this CPU can run.
fn runnable(path: DotPath) -> DotPath {
    let best = DotPath::for_isa(Isa::Avx512Fp16);
    if path <= best {
        path
    } else {
        best
    }
}

/// Dot product of one weight row (`kind`'s raw GGUF bytes) with quantized
/// activations, on the best path for `isa` on this CPU.
pub fn dot(kind: QuantKind, row: &[u8], act: &Activations, isa: Isa) -> Result<f32, QuantError> {
    dot_with(DotPath::for_isa(isa), kind, row, act)
}

/// [`dot`] on a named path (lowered to what this CPU can run).
pub fn dot_with(path: DotPath, kind: QuantKind, row: &[u8], act: &Activations) -> Result<f32, QuantError> {
    let op = check_row(kind, row, act)?;
    Ok(dot_on(runnable(path), row, op))
}

/// `y[r] = dot(row r of matrix, act)` for a row-major matrix of `rows`
/// equal rows, on the best path for `isa`, one thread.
pub fn gemv(kind: QuantKind, matrix: &[u8], rows: usize, act: &Activations, isa: Isa, y: &mut [f32]) -> Result<(), QuantError> {
    gemv_with(DotPath::for_isa(isa), kind, matrix, rows, act, y)
}

/// [`gemv`] on a named path (lowered to what this CPU can run).
///
/// Rows run one at a time, each streamed start to end. Pairing rows so
/// that they share the activations' loads made the AVX-512 Q4_K kernel
/// faster from cache (39 against 30 GB/s of weights on the development
/// machine) but halved its rate from DRAM (12 against 26 GB/s), where a
/// GEMV over model weights runs.
pub fn gemv_with(
    path: DotPath,
    kind: QuantKind,
    matrix: &[u8],
    rows: usize,
    act: &Activations,
    y: &mut [f32],
) -> Result<(), QuantError> {
    if y.len() != rows {
        return Err(QuantError::OutputSize { got: y.len(), expected: rows });
    }
    if rows == 0 {
        return if matrix.is_empty() {
            Ok(())
        } else {
            Err(QuantError::MatrixShape { bytes: matrix.len(), rows, row_bytes: 0 })
        };
    }
    pair(kind, act)?;
    let row_bytes = act.len() / kind.block_elems() * kind.block_bytes();
    if row_bytes == 0 {
        // Empty activations: every row is empty and every product zero.
        if !matrix.is_empty() {
            return Err(QuantError::MatrixShape { bytes: matrix.len(), rows, row_bytes });
        }
        y.fill(0.0);
        return Ok(());
    }
    if matrix.len() != rows * row_bytes {
        return Err(QuantError::MatrixShape { bytes: matrix.len(), rows, row_bytes });
    }
    let op = check_row(kind, &matrix[..row_bytes], act)?;
    row_products(runnable(path), matrix, row_bytes, op, y);
    Ok(())
}

/// `out[r]` = row r of `matrix` (whole rows of `row_bytes`, `out.len()` of
/// them) · `op`'s token, on `path` (runnable here). On AVX-512 VNNI the
/// band runs inside one kernel call (`gemv_32`, `gemv_q45k`, `gemv_q6k`):
/// a call per row set the kernel's constants up again for every row, which
/// for a decode's short rows (six to eight k-quant blocks) showed.
fn row_products(path: DotPath, matrix: &[u8], row_bytes: usize, op: Op, out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if path >= DotPath::Avx512Vnni {
        // SAFETY: `runnable` lets Avx512Vnni (and Amx) through only on a CPU
        // that has it; the band is whole rows of the op's blocks (checked by callers).
        unsafe {
            match op {
                Op::Q8_0(y) => dot_avx512::gemv_32::<8, _>(matrix, y, out),
                Op::Q4_0(y) => dot_avx512::gemv_32::<4, _>(matrix, y, out),
                Op::Q5_0(y) => dot_avx512::gemv_32::<5, _>(matrix, y, out),
                Op::Q5_1(y) => dot_avx512::gemv_32::<{ dot_avx512::Q5_1 }, _>(matrix, y, out),
                Op::Q4K(y) => dot_avx512::gemv_q45k::<false>(matrix, y, out),
                Op::Q5K(y) => dot_avx512::gemv_q45k::<true>(matrix, y, out),
                Op::Q6K(y) => dot_avx512::gemv_q6k(matrix, y, out),
            }
        }
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if path == DotPath::Avx2 {
        // SAFETY: `runnable` lets Avx2 through only on a CPU that has it;
        // whole rows, as above.
        match op {
            Op::Q4K(y) => return unsafe { dot_avx2::gemv_q45k::<false>(matrix, y, out) },
            Op::Q5K(y) => return unsafe { dot_avx2::gemv_q45k::<true>(matrix, y, out) },
            Op::Q6K(y) => return unsafe { dot_avx2::gemv_q6k(matrix, y, out) },
            Op::Q8_0(_) | Op::Q4_0(_) | Op::Q5_0(_) | Op::Q5_1(_) => {}
        }
    }
    for (o, row) in out.iter_mut().zip(matrix.chunks_exact(row_bytes)) {
        *o = dot_on(path, row, op);
    }
}

/// The activation format a weight kind multiplies (ggml's `vec_dot_type`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
enum Family {
    /// Q8_K, for the k-quants.
    #[default]
    Q8K,
    /// Q8_0, for Q4_0, Q5_0 and Q8_0.
    Q8_0,
    /// Q8_1, for Q5_1.
    Q8_1,
}

impl Family {
    fn of(kind: QuantKind) -> Result<Family, QuantError> {
        match kind {
            QuantKind::Q4K | QuantKind::Q5K | QuantKind::Q6K => Ok(Family::Q8K),
            QuantKind::Q4_0 | QuantKind::Q5_0 | QuantKind::Q8_0 => Ok(Family::Q8_0),
            QuantKind::Q5_1 => Ok(Family::Q8_1),
            QuantKind::F32 | QuantKind::F16 | QuantKind::Bf16 => Err(QuantError::NoDot { kind }),
        }
    }

    fn block(self) -> usize {
        match self {
            Family::Q8K => QK_K,
            Family::Q8_0 | Family::Q8_1 => QK8_0,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Family::Q8K => "Q8_K",
            Family::Q8_0 => "Q8_0",
            Family::Q8_1 => "Q8_1",
        }
    }
}

/// The buffers of [`QuantizedTokens::blocks_mut`], one per family; only
/// the held family's is sized.
pub struct TokenBlocks<'a> {
    pub q8k: &'a mut [BlockQ8K],
    pub q8_0: &'a mut [BlockQ8_0],
    pub q8_1: &'a mut [BlockQ8_1],
}

/// The activations of several tokens, quantized for one weight family and
/// kept token-major in buffers that are reused from call to call (they grow
/// to the largest batch seen and never shrink, so a warm hot path does not
/// allocate). What a linear layer over quantized weights multiplies by.
#[derive(Default)]
pub struct QuantizedTokens {
    q8k: Vec<BlockQ8K>,
    q8_0: Vec<BlockQ8_0>,
    q8_1: Vec<BlockQ8_1>,
    /// Which buffer holds the tokens.
    family: Family,
    tokens: usize,
    cols: usize,
    /// Renewed by every change (unique across all instances), so that a
    /// GEMM's tokens transposed on a thread for one band can be reused for
    /// the next band of the same tokens.
    generation: u64,
}

/// The last [`QuantizedTokens::generation`] handed out.
static GENERATIONS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

impl QuantizedTokens {
    /// Quantize `n` rows of `x` (`[n, cols]`) for products with `kind`
    /// weights, replacing what was held.
    pub fn quantize(&mut self, kind: QuantKind, x: &[f32], n: usize) -> Result<(), QuantError> {
        self.prepare(kind, x.len(), n)?;
        let cols = self.cols;
        for t in 0..n {
            self.quantize_token(t, &x[t * cols..(t + 1) * cols])?;
        }
        Ok(())
    }

    /// Size the buffers for `n` tokens of `elements / n` columns for `kind`
    /// weights, without quantizing anything yet: callers that quantize the
    /// tokens in parallel then fill them with [`Self::quantize_token`].
    pub fn prepare(&mut self, kind: QuantKind, elements: usize, n: usize) -> Result<(), QuantError> {
        let cols = elements.checked_div(n).unwrap_or(0);
        if cols * n != elements {
            return Err(QuantError::LengthMismatch { kind, row: cols, activations: elements });
        }
        let family = Family::of(kind)?;
        let block = family.block();
        if !cols.is_multiple_of(block) {
            return Err(QuantError::PartialElements { kind, elements: cols, block });
        }
        let blocks = n * cols / block;
        match family {
            Family::Q8K => self.q8k.resize(blocks, BlockQ8K { d: 0.0, qs: [0; QK_K], bsums: [0; QK_K / 16] }),
            Family::Q8_0 => self.q8_0.resize(blocks, BlockQ8_0 { d: half::f16::ZERO, qs: [0; QK8_0] }),
            Family::Q8_1 => self.q8_1.resize(blocks, BlockQ8_1 { d: half::f16::ZERO, s: 0.0, qs: [0; QK8_0] }),
        }
        (self.family, self.tokens, self.cols) = (family, n, cols);
        self.renew();
        Ok(())
    }

    /// A new generation: what was held has changed.
    fn renew(&mut self) {
        self.generation = GENERATIONS.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
    }

    /// Quantize token `t` (`cols` values) into its place.
    pub fn quantize_token(&mut self, t: usize, x: &[f32]) -> Result<(), QuantError> {
        self.renew();
        let r = self.token_range(t);
        match self.family {
            Family::Q8K => quantize_q8_k_into(x, &mut self.q8k[r]),
            Family::Q8_0 => quantize_q8_0_into(x, &mut self.q8_0[r]),
            Family::Q8_1 => quantize_q8_1_into(x, &mut self.q8_1[r]),
        }
    }

    /// The blocks of token `t`, for splitting the work of quantizing many
    /// tokens across threads: disjoint tokens are disjoint ranges.
    pub fn token_range(&self, t: usize) -> std::ops::Range<usize> {
        let per = self.cols / self.family.block();
        t * per..(t + 1) * per
    }

    /// The blocks of every family, by which [`Self::token_range`] indexes
    /// the held one.
    pub fn blocks_mut(&mut self) -> TokenBlocks<'_> {
        self.renew();
        TokenBlocks { q8k: &mut self.q8k, q8_0: &mut self.q8_0, q8_1: &mut self.q8_1 }
    }

    pub fn tokens(&self) -> usize {
        self.tokens
    }

    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Token `t`'s activations paired with `kind` weights.
    fn op(&self, kind: QuantKind, t: usize) -> Result<Op<'_>, QuantError> {
        let r = self.token_range(t);
        let wanted = Family::of(kind)?;
        if wanted != self.family {
            return Err(QuantError::WrongActivations { kind, wanted: wanted.name(), got: self.family.name() });
        }
        Ok(match kind {
            QuantKind::Q4K => Op::Q4K(&self.q8k[r]),
            QuantKind::Q5K => Op::Q5K(&self.q8k[r]),
            QuantKind::Q6K => Op::Q6K(&self.q8k[r]),
            QuantKind::Q4_0 => Op::Q4_0(&self.q8_0[r]),
            QuantKind::Q5_0 => Op::Q5_0(&self.q8_0[r]),
            QuantKind::Q8_0 => Op::Q8_0(&self.q8_0[r]),
            QuantKind::Q5_1 => Op::Q5_1(&self.q8_1[r]),
            QuantKind::F32 | QuantKind::F16 | QuantKind::Bf16 => unreachable!("Family::of refused {kind}"),
        })
    }
}

/// `out[t · rows + r] = row r of `matrix` · token t` for every held token:
/// a band of `rows` whole rows of `kind` weights (raw GGUF bytes) against
/// quantized tokens, on `path`, one thread. `out` is `[tokens, rows]`.
///
/// Each row is read once per group of tokens and multiplied by all of them
/// while it is in cache, so a prefill band costs few passes over its weights.
pub fn matmul(path: DotPath, kind: QuantKind, matrix: &[u8], rows: usize, acts: &QuantizedTokens, out: &mut [f32]) -> Result<(), QuantError> {
    matmul_where(path, kind, matrix, rows, acts, acts.tokens, |j| j, out)
}

/// [`matmul`] over the held tokens that `picked` names (`(token, _)` pairs,
/// as a MoE layer lists an expert's tokens): `out` is `[picked.len(), rows]`.
pub fn matmul_picked(path: DotPath, kind: QuantKind, matrix: &[u8], rows: usize, acts: &QuantizedTokens, picked: &[(usize, f32)], out: &mut [f32]) -> Result<(), QuantError> {
    if let Some(&(t, _)) = picked.iter().find(|&&(t, _)| t >= acts.tokens) {
        return Err(QuantError::OutputSize { got: t, expected: acts.tokens });
    }
    matmul_where(path, kind, matrix, rows, acts, picked.len(), |j| picked[j].0, out)
}

/// The fewest tokens for which a group of `gemm_32`'s sixteen lanes,
/// partly empty, is quicker than that many passes of `gemv_32`.
#[cfg(target_arch = "x86_64")]
const LANES_LEAST: usize = 4;

/// [`LANES_LEAST`] for AVX2's `gemm_32` (eight lanes): one token at a
/// time ran Q8_0 at 20–21 and Q5_0 at 16–17 G multiply-adds/s, a full
/// group of lanes at 69–71 and 39 (`quant_matmul avx2`, one thread, in
/// cache), so Q8_0 gains from three tokens on and Q5_0 (and Q4_0, whose
/// unpacking costs less) from four.
#[cfg(target_arch = "x86_64")]
fn lanes_least_avx2(kind: QuantKind) -> usize {
    if kind == QuantKind::Q8_0 {
        3
    } else {
        4
    }
}

#[cfg(target_arch = "x86_64")]
thread_local! {
    /// Each pool thread's transposed tokens and row sums for `gemm_32`:
    /// grown to the largest band and width seen, never shrunk, so a warm
    /// prefill does not allocate.
    static LANES_SCRATCH: std::cell::RefCell<(lanes_avx512::Lanes32, Vec<[f32; lanes_avx512::LANES]>)> = Default::default();
    /// The same for the AMX tiles: the band packed as B tiles, a group of
    /// tokens as A tiles, and the group's results.
    static TILES_SCRATCH: std::cell::RefCell<(tiles_amx::Panels32, tiles_amx::Tokens32, Vec<[f32; tiles_amx::TILE]>)> = Default::default();
    /// The same for AVX2's `gemm_32`.
    static LANES_AVX2_SCRATCH: std::cell::RefCell<(lanes_avx2::Lanes32, Vec<[f32; lanes_avx2::LANES]>)> = Default::default();
    /// The same for `gemm_k`: the groups of transposed tokens, a part of
    /// the band unpacked, and a group's results.
    /// The groups carry what they hold (`TransposedKey`): a call for the
    /// same tokens of the same activations, as the next band of a layer's
    /// product or an expert's up projection after its gate, reuses them.
    static KLANES_SCRATCH: std::cell::RefCell<KLanesScratch> = Default::default();
}

/// The fewest k-quant tokens that `gemm_k` takes in one group of sixteen
/// lanes, partly empty, rather than the one-token kernels' groups of
/// eight and four: at twelve (`quant_matmul`, one thread, in cache) the
/// lanes ran Q4_K at 79–80 and Q5_K at 76 G multiply-adds/s against the
/// groups' 72–73 and 67, Q6_K at 68.5 against 70–71.5; at thirteen every
/// format is quicker in the lanes.
#[cfg(target_arch = "x86_64")]
const K_LANES_LEAST: usize = 12;

/// [`K_LANES_LEAST`] for AVX2's `gemm_k` (eight tokens a vector), where
/// fewer tokens go one by one. Its unpacking of the band is most of its
/// time at a few tokens, so the one-token kernels' speed decides: Q4_K's
/// ran at 60 G multiply-adds/s against the lanes' 57 at 8 and 12 tokens
/// and 75 at 16; Q5_K's (44) and Q6_K's (36) as fast as the lanes' at 6
/// (`quant_matmul avx2`, one thread, in cache).
#[cfg(target_arch = "x86_64")]
fn k_lanes_least_avx2(kind: QuantKind) -> usize {
    if kind == QuantKind::Q4K {
        16
    } else {
        6
    }
}

/// Bytes of unpacked weights (a byte per quant) per pass of `gemm_k`: the
/// part of a band that stays in L2 while every group of tokens takes it.
#[cfg(target_arch = "x86_64")]
const K_UNPACKED_BYTES: usize = 64 << 10;

/// Tokens per group of [`matmul`]: each row is multiplied by a whole group
/// while it is in L1; the band (a task's rows) stays in L2 across groups.
/// (Sixteen spilled the kernel's registers: 53 against 58 G/s in cache.)
#[cfg(target_arch = "x86_64")]
const GROUP: usize = 8;

/// The tokens [`matmul_where`] takes together, into their rows of `out`;
/// how many, from the first: sixteen at a time in the lanes of `gemm_32`
/// or, on [`DotPath::Amx`], in AMX tiles (32-element formats, a last group
/// of fewer too unless so few that the empty lanes would cost more than a
/// pass per token; the tiles' own turning point is unmeasured, for want
/// of an AMX machine, so they take the same groups; on AVX2 eight at a time
/// in the lanes of its `gemm_32`, from `lanes_least_avx2`); the k-quants' sixteen
/// at a time in the lanes of `gemm_k` or, on [`DotPath::Amx`], in AMX
/// tiles (from [`K_LANES_LEAST`] tokens, likewise; on AVX2 eight at a time,
/// from `k_lanes_least_avx2`), then whole groups of eight per row
/// (`dot_q45k_multi`, `dot_q6k_multi`) and a group of four if at least
/// four are left. The
/// rest go one at a time over the whole band (`row_products`), as do all of
/// Q5_1's (a fallback format, for rows too short for a k-quant block). All
/// give the bits of row by row.
#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
fn products_together(path: DotPath, mut tiles: Option<&mut impl tiles_amx::TileUnit>, kind: QuantKind, matrix: &[u8], rows: usize, acts: &QuantizedTokens, n: usize, token: &impl Fn(usize) -> usize, out: &mut [f32]) -> Result<usize, QuantError> {
    let row_bytes = matrix.len() / rows;
    if (tiles.is_some() || path >= DotPath::Avx512Vnni) && matches!(kind, QuantKind::Q4_0 | QuantKind::Q5_0 | QuantKind::Q8_0) {
        const _: () = assert!(lanes_avx512::LANES == tiles_amx::TILE);
        let lanes = lanes_avx512::LANES;
        let together = if n % lanes >= LANES_LEAST { n } else { n - n % lanes };
        if tiles.is_some() && together > 0 {
            TILES_SCRATCH.with_borrow_mut(|(w, ..)| tiles_amx::pack(kind, matrix, rows, acts.cols / QK8_0, w));
        }
        for j0 in (0..together).step_by(lanes) {
            let count = lanes.min(together - j0);
            let tokens = &group_32::<{ lanes_avx512::LANES }>(kind, acts, j0..j0 + count, token)?[..count];
            if let Some(unit) = tiles.as_deref_mut() {
                TILES_SCRATCH.with_borrow_mut(|(w, y, sums)| {
                    y.fill(tokens);
                    sums.resize(rows, [0.0; tiles_amx::TILE]);
                    unit.gemm_32(w, y, sums);
                    scatter_group(sums, j0..j0 + count, out);
                });
            } else {
                LANES_SCRATCH.with_borrow_mut(|(y, sums)| {
                    y.fill(tokens);
                    sums.resize(rows, [0.0; lanes_avx512::LANES]);
                    // SAFETY: `runnable` lets Avx512Vnni through only on a
                    // CPU that has it; the band is `rows` whole rows of the
                    // tokens' width (checked by the caller).
                    unsafe {
                        match kind {
                            QuantKind::Q8_0 => lanes_avx512::gemm_32::<8>(matrix, y, sums),
                            QuantKind::Q4_0 => lanes_avx512::gemm_32::<4>(matrix, y, sums),
                            _ => lanes_avx512::gemm_32::<5>(matrix, y, sums),
                        }
                    }
                    scatter_group(sums, j0..j0 + count, out);
                });
            }
        }
        return Ok(together);
    }
    if path == DotPath::Avx2 && tiles.is_none() && matches!(kind, QuantKind::Q4_0 | QuantKind::Q5_0 | QuantKind::Q8_0) {
        // The same groups at AVX2's eight lanes.
        let lanes = lanes_avx2::LANES;
        let together = if n % lanes >= lanes_least_avx2(kind) { n } else { n - n % lanes };
        for j0 in (0..together).step_by(lanes) {
            let count = lanes.min(together - j0);
            let tokens = &group_32::<{ lanes_avx2::LANES }>(kind, acts, j0..j0 + count, token)?[..count];
            LANES_AVX2_SCRATCH.with_borrow_mut(|(y, sums)| {
                y.fill(tokens);
                sums.resize(rows, [0.0; lanes_avx2::LANES]);
                // SAFETY: `runnable` lets Avx2 through only on a CPU that
                // has it; the band is `rows` whole rows of the tokens'
                // width (checked by the caller).
                unsafe {
                    match kind {
                        QuantKind::Q8_0 => lanes_avx2::gemm_32::<8>(matrix, y, sums),
                        QuantKind::Q4_0 => lanes_avx2::gemm_32::<4>(matrix, y, sums),
                        _ => lanes_avx2::gemm_32::<5>(matrix, y, sums),
                    }
                }
                scatter_group(sums, j0..j0 + count, out);
            });
        }
        return Ok(together);
    }
    if (tiles.is_some() || path >= DotPath::Avx2) && Family::of(kind)? == Family::Q8K {
        // Sixteen at a time in `gemm_k`'s lanes or the tiles, a last group
        // of fewer too if not too few; of the rest (AVX-512), whole groups
        // of eight, then four if as many are left.
        let lanes = klanes::LANES;
        let least = if tiles.is_some() || path >= DotPath::Avx512Vnni { K_LANES_LEAST } else { k_lanes_least_avx2(kind) };
        let in_lanes = match n % lanes {
            _ if n < least => 0,
            left if left >= least => n,
            left => n - left,
        };
        if in_lanes > 0 {
            k_quant_lanes(path, tiles, kind, matrix, row_bytes, rows, acts, in_lanes, token, out)?;
        }
        if path < DotPath::Avx512Vnni {
            // The groups below are AVX-512's; on AVX2 the rest go one by one.
            return Ok(in_lanes);
        }
        let left = n - in_lanes;
        let groups = left - left % GROUP;
        let tail = if left % GROUP >= GROUP / 2 { GROUP / 2 } else { 0 };
        for j0 in (in_lanes..in_lanes + groups).step_by(GROUP) {
            k_quant_group::<GROUP>(kind, matrix, row_bytes, rows, acts, j0, token, out)?;
        }
        if tail > 0 {
            k_quant_group::<{ GROUP / 2 }>(kind, matrix, row_bytes, rows, acts, in_lanes + groups, token, out)?;
        }
        return Ok(in_lanes + groups + tail);
    }
    Ok(0)
}

/// Every row of a k-quant band against the first `n` tokens sixteen at a
/// time (a last group of fewer), in `gemm_k`'s lanes (AVX-512 VNNI, or
/// AVX2's eight at a time on `path` Avx2) or, given a tile unit, in AMX
/// tiles (`ktiles_amx`), into their rows of `out`, with `dot_on`'s bits.
/// The band is unpacked a part at a time (on the tiles, of whole panels of
/// sixteen rows), each part taken by every group while it is in L2.
#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
fn k_quant_lanes(path: DotPath, mut tiles: Option<&mut impl tiles_amx::TileUnit>, kind: QuantKind, matrix: &[u8], row_bytes: usize, rows: usize, acts: &QuantizedTokens, n: usize, token: &impl Fn(usize) -> usize, out: &mut [f32]) -> Result<(), QuantError> {
    let lanes = klanes::LANES;
    let blocks = acts.cols / QK_K;
    KLANES_SCRATCH.with_borrow_mut(|(held, groups, unpacked, sums)| {
        let count = n.div_ceil(lanes);
        if groups.len() < count {
            groups.resize_with(count, Default::default);
        }
        // `vpdpbusd` takes the tokens unsigned, biased; `tdpbssd` signed.
        let biased = tiles.is_none();
        let held_already = held.generation != 0 && held.generation == acts.generation && held.biased == biased && held.tokens.iter().copied().eq((0..n).map(token));
        if !held_already {
            held.generation = 0; // until the groups are whole
            for (g, group) in groups[..count].iter_mut().enumerate() {
                let j0 = g * lanes;
                let mut ys: [&[BlockQ8K]; klanes::LANES] = [&[]; klanes::LANES];
                for (slot, j) in ys.iter_mut().zip(j0..n.min(j0 + lanes)) {
                    *slot = match acts.op(kind, token(j))? {
                        Op::Q4K(y) | Op::Q5K(y) | Op::Q6K(y) => y,
                        Op::Q4_0(_) | Op::Q5_0(_) | Op::Q5_1(_) | Op::Q8_0(_) => unreachable!("{kind} is a k-quant"),
                    };
                }
                group.fill(&ys[..n.min(j0 + lanes) - j0], biased);
            }
            held.tokens.clear();
            held.tokens.extend((0..n).map(token));
            (held.generation, held.biased) = (acts.generation, biased);
        }
        let part = (K_UNPACKED_BYTES / (QK_K * blocks)).max(1);
        let part = if tiles.is_some() { part.next_multiple_of(tiles_amx::TILE) } else { part };
        for r0 in (0..rows).step_by(part) {
            let taken = part.min(rows - r0);
            let part_bytes = &matrix[r0 * row_bytes..(r0 + taken) * row_bytes];
            if path >= DotPath::Avx512Vnni {
                unpacked.unpack_best(kind, part_bytes, taken, blocks);
            } else if path == DotPath::Avx2 {
                // SAFETY: `runnable` lets Avx2 through only on a CPU that
                // has AVX2.
                unsafe { unpacked.unpack_avx2(kind, part_bytes, taken, blocks) };
            } else {
                // Only the tests put tiles (the model) beside the scalar path.
                unpacked.unpack_portable(kind, part_bytes, taken, blocks);
            }
            sums.resize(taken, [0.0; klanes::LANES]);
            for (g, group) in groups[..count].iter().enumerate() {
                let j0 = g * lanes;
                match tiles.as_deref_mut() {
                    Some(unit) => unit.gemm_k(unpacked, group, &mut sums[..taken]),
                    // SAFETY: `runnable` lets a path through only on a CPU
                    // that has its features.
                    None if path >= DotPath::Avx512Vnni => unsafe { klanes_avx512::gemm_k(unpacked, group, &mut sums[..taken]) },
                    None => unsafe { klanes_avx2::gemm_k(unpacked, group, n.min(j0 + lanes) - j0, &mut sums[..taken]) },
                }
                for (r, lane) in sums[..taken].iter().enumerate() {
                    for (t, &v) in lane[..n.min(j0 + lanes) - j0].iter().enumerate() {
                        out[(j0 + t) * rows + r0 + r] = v;
                    }
                }
            }
        }
        Ok(())
    })
}

/// Every row of a k-quant band against tokens `j0..j0 + T` (`dot_q45k_multi`,
/// `dot_q6k_multi`: each block unpacked once for all of them), into their
/// rows of `out`, with `dot_on`'s bits. Only on AVX-512 VNNI.
#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
fn k_quant_group<const T: usize>(kind: QuantKind, matrix: &[u8], row_bytes: usize, rows: usize, acts: &QuantizedTokens, j0: usize, token: &impl Fn(usize) -> usize, out: &mut [f32]) -> Result<(), QuantError> {
    let mut ys: [&[BlockQ8K]; T] = [&[]; T];
    for (slot, j) in ys.iter_mut().zip(j0..) {
        *slot = match acts.op(kind, token(j))? {
            Op::Q4K(y) | Op::Q5K(y) | Op::Q6K(y) => y,
            Op::Q4_0(_) | Op::Q5_0(_) | Op::Q5_1(_) | Op::Q8_0(_) => unreachable!("{kind} is a k-quant"),
        };
    }
    for (r, row) in matrix.chunks_exact(row_bytes).enumerate() {
        // SAFETY: the caller runs this only on the Avx512Vnni path, which
        // `runnable` lets through only on a CPU that has it; `acts.op`
        // paired whole rows of `kind` with the tokens' blocks.
        let values = unsafe {
            match kind {
                QuantKind::Q4K => dot_avx512::dot_q45k_multi::<false, T>(row, ys),
                QuantKind::Q5K => dot_avx512::dot_q45k_multi::<true, T>(row, ys),
                _ => dot_avx512::dot_q6k_multi::<T>(row, ys),
            }
        };
        for (j, v) in (j0..).zip(values) {
            out[j * rows + r] = v;
        }
    }
    Ok(())
}

/// A thread's `gemm_k` buffers ([`KLANES_SCRATCH`]).
#[cfg(target_arch = "x86_64")]
type KLanesScratch = (TransposedKey, Vec<klanes::KLanes>, klanes::KRows, Vec<[f32; klanes::LANES]>);

/// What a thread's transposed k-quant groups hold: the tokens (in order)
/// of the activations of one [`QuantizedTokens::generation`] (0: nothing),
/// biased or not.
#[cfg(target_arch = "x86_64")]
#[derive(Default)]
struct TransposedKey {
    generation: u64,
    biased: bool,
    tokens: Vec<usize>,
}

/// The Q8_0 activations of the tokens `js` (at most `L`) names, for a
/// group of a 32-element format's lanes.
#[cfg(target_arch = "x86_64")]
fn group_32<'a, const L: usize>(kind: QuantKind, acts: &'a QuantizedTokens, js: std::ops::Range<usize>, token: &impl Fn(usize) -> usize) -> Result<[&'a [BlockQ8_0]; L], QuantError> {
    let mut tokens: [&[BlockQ8_0]; L] = [&[]; L];
    for (slot, j) in tokens.iter_mut().zip(js) {
        *slot = match acts.op(kind, token(j))? {
            Op::Q8_0(y) | Op::Q4_0(y) | Op::Q5_0(y) => y,
            Op::Q4K(_) | Op::Q5K(_) | Op::Q6K(_) | Op::Q5_1(_) => unreachable!("{kind} is a 32-element format of Q8_0 activations"),
        };
    }
    Ok(tokens)
}

/// How far ahead the one-token GEMVs (the k-quants' `gemv4`, AVX-512's
/// `gemv_32`: decode's products) fetch their rows. Without it the kernels
/// read DRAM at ~0.7 of a plain read's rate on this host (Zen 5), their
/// loads waiting on memory between the hardware prefetcher's lines;
/// `quant_dot`, one thread, from DRAM, GB/s before and after: Q4_K
/// 27.4–27.6 → 32.2–32.8, Q6_K 29.5–29.7 → 36.1–37.8, Q5_K 30.2 →
/// 32.1–33.6, Q8_0 28.4 → 29.2–30.8 (Q5_0 and Q5_1, bound by arithmetic,
/// unchanged). One line a block, not every line of it, kept only a third of
/// that. Leads of 4, 8 and 16 KiB decode the Q4_K_M `bench` model alike
/// (two threads); one thread's Q6_K wanted 8 KiB or more (31.0 at 4 KiB).
#[cfg(target_arch = "x86_64")]
const GEMV_LEAD: usize = 8192;

/// Prefetch `block` moved `LEAD` bytes on, one line for each 64 bytes of
/// it, from its first byte: the one-token GEMVs' blocks ([`GEMV_LEAD`])
/// and the k-quant GEMM's unpacking of its band (4 KiB, see
/// [`fetch_ahead`]). A block may touch one line more than that (a k-quant
/// block of 144 to 210 bytes spans three to five lines, `gemv_32`'s eight
/// blocks of 176 to 272 bytes three to six), but the kernels walk a
/// matrix's blocks, which lie end to end: no two fetched addresses are
/// more than 64 bytes apart, so every line ahead is fetched by one block
/// or the next. A constant count of prefetches (the blocks' sizes are
/// constants) and no arithmetic on addresses: working out each block's
/// exact lines cost the Q4_K GEMV a seventh of its speed in cache
/// (`quant_dot`, one thread, in L3, alternating: 34.5–35.6 → 39.7–40.7 GB/s;
/// from DRAM 30.1–31.7 → 33.1–34.0).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn fetch_block_ahead<const LEAD: usize>(block: &[u8]) {
    for at in (0..block.len()).step_by(64) {
        crate::cpu::kernel::prefetch_at::<LEAD>(block.as_ptr(), at);
    }
}

/// Prefetch the line `LEAD` bytes past the start of `block` (a block that
/// fits a line; [`fetch_block_ahead`] for larger ones): the prefill GEMMs
/// read a band from DRAM once (unpacking it, or for their first group of
/// tokens), and their loads waited on memory without it; past the band's
/// end too, as a hint never faults. The leads are measured: the k-quant unpacking's
/// one stream wants 4 KiB (Q4_K_M prefill of 512 tokens, two rounds
/// alternating, 354–363 tokens/s with 2 KiB, 366–378 with 4), the 32-element
/// GEMM 2 KiB (Q8_0 251–257 with 2 KiB, 250–252 with 4).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn fetch_ahead<const LEAD: usize>(block: &[u8]) {
    crate::cpu::kernel::prefetch_at::<LEAD>(block.as_ptr(), 0)
}

/// A group's products into `out` (`[token][row]`): row r of `sums` holds
/// row r's with the tokens `js`, one per lane from the first.
#[cfg(target_arch = "x86_64")]
fn scatter_group<const L: usize>(sums: &[[f32; L]], js: std::ops::Range<usize>, out: &mut [f32]) {
    let rows = sums.len();
    for (r, lane) in sums.iter().enumerate() {
        for (j, &v) in js.clone().zip(lane) {
            out[j * rows + r] = v;
        }
    }
}

#[cfg(not(target_arch = "x86_64"))]
#[allow(clippy::too_many_arguments)]
fn products_together(_: DotPath, _: Option<&mut impl tiles_amx::TileUnit>, _: QuantKind, _: &[u8], _: usize, _: &QuantizedTokens, _: usize, _: &impl Fn(usize) -> usize, _: &mut [f32]) -> Result<usize, QuantError> {
    Ok(0)
}

#[allow(clippy::too_many_arguments)]
fn matmul_where(path: DotPath, kind: QuantKind, matrix: &[u8], rows: usize, acts: &QuantizedTokens, n: usize, token: impl Fn(usize) -> usize, out: &mut [f32]) -> Result<(), QuantError> {
    if out.len() != n * rows {
        return Err(QuantError::OutputSize { got: out.len(), expected: n * rows });
    }
    let row_bytes = kind.row_bytes(acts.cols)?;
    if matrix.len() != rows * row_bytes {
        return Err(QuantError::MatrixShape { bytes: matrix.len(), rows, row_bytes });
    }
    if n == 0 || rows == 0 {
        return Ok(());
    }
    if row_bytes == 0 {
        // Rows of no blocks: every product is an empty sum.
        out.fill(0.0);
        return Ok(());
    }
    let path = runnable(path);
    #[cfg(target_arch = "x86_64")]
    let mut tiles = (path == DotPath::Amx).then(|| crate::cpu::amx::HardwareTiles::new().expect("`runnable` lets Amx through only where the tiles are permitted"));
    #[cfg(not(target_arch = "x86_64"))]
    let mut tiles: Option<crate::cpu::amx::ModelTiles> = None;
    products_of_checked(path, tiles.as_mut(), kind, matrix, rows, acts, n, &token, out)
}

/// [`matmul_where`] past its checks, with the tile unit (if any) that the
/// 32-element formats' groups of tokens run on.
#[allow(clippy::too_many_arguments)]
fn products_of_checked(path: DotPath, tiles: Option<&mut impl tiles_amx::TileUnit>, kind: QuantKind, matrix: &[u8], rows: usize, acts: &QuantizedTokens, n: usize, token: &impl Fn(usize) -> usize, out: &mut [f32]) -> Result<(), QuantError> {
    let row_bytes = matrix.len() / rows;
    let together = products_together(path, tiles, kind, matrix, rows, acts, n, token, out)?;
    for j in together..n {
        row_products(path, matrix, row_bytes, acts.op(kind, token(j))?, &mut out[j * rows..(j + 1) * rows]);
    }
    Ok(())
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::*;

    /// `matmul`/`matmul_picked`'s dispatch (`products_of_checked`) with the
    /// model as its tile unit, over the held tokens in order and in a
    /// picked order: every product has the bits of its scalar dot
    /// (`activations(t)`: token t's, as `dot_on` takes them).
    fn model_dispatch_matches_scalar(kind: QuantKind, matrix: &[u8], rows: usize, held: &QuantizedTokens, activations: impl Fn(usize) -> Activations) {
        let path = runnable(DotPath::for_isa(crate::cpu::isa::detect())).min(DotPath::Avx512Vnni);
        let tokens = held.tokens();
        let picked: Vec<usize> = (0..tokens).rev().step_by(2).chain((0..tokens).step_by(3)).collect();
        for order in [(0..tokens).collect::<Vec<_>>(), picked] {
            let mut out = vec![f32::NAN; order.len() * rows];
            let mut model = crate::cpu::amx::ModelTiles::default();
            products_of_checked(path, Some(&mut model), kind, matrix, rows, held, order.len(), &|j| order[j], &mut out).unwrap();
            for (j, &t) in order.iter().enumerate() {
                for (r, row) in matrix.chunks_exact(matrix.len() / rows).enumerate() {
                    let want = dot_on(DotPath::Scalar, row, pair(kind, &activations(t)).unwrap());
                    assert_eq!(out[j * rows + r].to_bits(), want.to_bits(), "{kind}: {rows} rows × {tokens} tokens, product {j} (token {t}) row {r}");
                }
            }
        }
    }

    /// The tile path of the 32-element formats as it dispatches (the band
    /// packed once, groups of sixteen and a last group of fewer on tiles,
    /// the last few tokens alone), run on the model tile unit, so that it is
    /// tested on CPUs without AMX.
    #[test]
    fn tile_dispatch_on_the_model_gives_each_tokens_dot() {
        for kind in [QuantKind::Q8_0, QuantKind::Q4_0, QuantKind::Q5_0] {
            for (rows, tokens, blocks) in [(3, 1, 2), (17, 3, 1), (5, 4, 2), (20, 16, 3), (33, 21, 2), (7, 37, 1)] {
                let (matrix, xs) = tiles_amx::sample(kind, rows, tokens, blocks, (rows * 100 + tokens) as u64);
                let mut held = QuantizedTokens::default();
                held.prepare(kind, tokens * blocks * QK8_0, tokens).unwrap();
                for (t, x) in xs.iter().enumerate() {
                    let range = held.token_range(t);
                    held.q8_0[range].copy_from_slice(x);
                }
                model_dispatch_matches_scalar(kind, &matrix, rows, &held, |t| Activations::Q8_0(xs[t].clone()));
            }
        }
    }

    /// The same for the k-quants: groups of sixteen (from `K_LANES_LEAST`
    /// tokens) on the model's tiles, the band unpacked a part at a time in
    /// whole panels; the rest in the AVX-512 groups (or alone, below AVX-512).
    #[test]
    fn k_quant_tile_dispatch_on_the_model_gives_each_tokens_dot() {
        for kind in [QuantKind::Q4K, QuantKind::Q5K, QuantKind::Q6K] {
            // 9 rows × 29 blocks exceeds a part of `K_UNPACKED_BYTES`: two parts.
            for (rows, tokens, blocks) in [(3, 1, 2), (17, 12, 1), (5, 13, 2), (20, 16, 1), (9, 29, 29), (33, 37, 1)] {
                let (matrix, xs) = tiles_amx::sample_k(kind, rows, tokens, blocks, (rows * 100 + tokens) as u64);
                let mut held = QuantizedTokens::default();
                held.prepare(kind, tokens * blocks * QK_K, tokens).unwrap();
                for (t, x) in xs.iter().enumerate() {
                    let range = held.token_range(t);
                    held.q8k[range].copy_from_slice(x);
                }
                model_dispatch_matches_scalar(kind, &matrix, rows, &held, |t| Activations::Q8K(xs[t].clone()));
            }
        }
    }
}
