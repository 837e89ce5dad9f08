//! `matmul_bf16`'s products of many tokens on AMX BF16 tiles (`tdpbf16ps`):
//! FP8 (block-scaled) and BF16 weights against BF16 tokens.
//!
//! Operands. A step is 32 BF16 words of a row: the weights and the tokens
//! are both laid out as rows of steps in one column order, each column
//! block padded with zeros to whole steps, so that no step spans two scale
//! blocks. FP8 weights are a band decoded as `gemv_avx512` decodes them
//! (per 64-column line, the odd bytes' words, then the even bytes', × 2⁸);
//! the tokens are packed in that order (`Packed`); BF16 weights and their
//! tokens keep the columns' own order. One `tdpbf16ps` multiplies A, a
//! panel of sixteen weight rows' step (16 × 64 bytes, read in place from a
//! BF16 matrix whose rows are whole steps), by B, the same step of a group
//! of sixteen tokens as sixteen pairs × sixteen tokens (transposed once per
//! call, and kept per thread for the next call on the same tokens), into
//! C, sixteen rows × sixteen tokens of f32 sums. Two panels × two groups
//! take all eight registers (four C, two A, two B), so each tile loaded is
//! used twice.
//!
//! Scales. A column block's steps sum into fresh C tiles; at the block's
//! end they are stored and folded into f32 sums, `sum = C · scale + sum`
//! (fused), as the vector kernels fold each block's sum; the decode's 2⁸
//! comes off at the end.
//!
//! Numerics. Each product of two BF16 values is exact in f32; the unit adds
//! them in an order of its own (and takes subnormal BF16 inputs as zero),
//! so a result agrees with the vector kernels' within f32 rounding of the
//! sums, not bit for bit. Within the tiles, every output is summed in an
//! order fixed by its row and the columns alone, so the tile path is batch
//! invariant by itself: which path a token takes depends on how many
//! tokens share its call (see `gemv::Products`).
//!
//! The kernel is generic over [`Tiles`] and over what runs around the tile
//! instructions ([`Around`]: plain Rust, or AVX-512 for the hardware), so
//! the tests run all of it but the tile instructions on [`ModelTiles`] on
//! any CPU; [`usable`] holds the CPU's tiles (and the model) to the exact
//! sums of small products before the first call takes them.
//!
//! [`ModelTiles`]: super::amx::ModelTiles

use super::amx::{TileConfig, Tiles};
use super::kernel::{Job, E4M3_BF16_X256, UNBIAS};
use super::pack::{AlignedBuf, Packed};
use std::cell::RefCell;
use std::ops::Range;
use std::sync::OnceLock;

/// Rows of a panel (an A tile) and tokens of a group (a B tile's columns).
const TILE: usize = 16;
/// BF16 words of a step: a tile row of A; sixteen pairs of a token in B.
const STEP: usize = 32;
/// Words of one group's step in B: sixteen pairs × sixteen tokens.
const B_WORDS: usize = TILE * TILE;

/// The registers: the sums of panel p and group g in `C[2p + g]`, the
/// panels' weights in A0 and A1, the groups' tokens in B0 and B1.
const C00: u8 = 0;
const C01: u8 = 1;
const C10: u8 = 2;
const C11: u8 = 3;
const A0: u8 = 4;
const A1: u8 = 5;
const B0: u8 = 6;
const B1: u8 = 7;

fn config() -> TileConfig {
    let mut c = TileConfig::new();
    for t in 0..8 {
        c = c.with(t, TILE, 4 * TILE);
    }
    c
}

/// The step layout of a call: words per row (padding included) and steps
/// per column block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Steps {
    per_row: usize,
    per_block: usize,
}

impl Steps {
    fn of(job: &Job) -> Steps {
        // FP8: `Packed::new::<64, 2>`'s lines of 64 words per block; BF16:
        // one block (the row) of 32-word chunks.
        let line = if job.fp8 { 64 } else { STEP };
        let per_block = job.block[1].div_ceil(line) * line / STEP;
        Steps { per_row: job.col_blocks * per_block, per_block }
    }
}

/// The tokens packed in the weights' column order.
fn packed(job: &Job, x: &[u16], n: usize) -> Packed<u16> {
    if job.fp8 {
        Packed::new::<64, 2>(x, n, job.cols, job.block[1], [1, 0], |v| v)
    } else {
        Packed::new::<32, 1>(x, n, job.cols, job.block[1], [0], |v| v)
    }
}

/// A call's tokens as B tiles: group g's step s at `pairs[(g · steps + s)
/// · 256..]`, row k holding pair k (words 2k, 2k + 1 of the step) of each
/// of the group's sixteen tokens; tokens past the last are zeros. Keeps
/// the tokens it was made from, so that a thread's next call on the same
/// ones (a matrix's other row tiles, an expert's up projection after its
/// gate) reuses it.
#[derive(Default)]
struct TokenTiles {
    x: Vec<u16>,
    /// Tokens (with no columns, `x` alone would not tell).
    n: usize,
    cols: usize,
    block: usize,
    fp8: bool,
    pairs: Vec<u32>,
    steps: usize,
}

impl TokenTiles {
    /// Make the tiles of `x` (`n` tokens) for `job`, unless they are held.
    fn fill(&mut self, around: &impl Around, job: &Job, x: &[u16], n: usize) {
        if self.n == n && self.cols == job.cols && self.block == job.block[1] && self.fp8 == job.fp8 && self.x == x {
            return;
        }
        let steps = Steps::of(job).per_row;
        let groups = n.div_ceil(TILE);
        let packed = packed(job, x, n);
        self.pairs.clear();
        self.pairs.resize(groups * steps * B_WORDS, 0);
        for g in 0..groups {
            let count = TILE.min(n - TILE * g);
            let tokens: [&[u16]; TILE] = std::array::from_fn(|i| if i < count { packed.token(TILE * g + i) } else { &[] });
            around.transpose(&tokens[..count], steps, &mut self.pairs[g * steps * B_WORDS..(g + 1) * steps * B_WORDS]);
        }
        self.x.clear();
        self.x.extend_from_slice(x);
        (self.n, self.cols, self.block, self.fp8, self.steps) = (n, job.cols, job.block[1], job.fp8, steps);
    }

    /// Group g's step s, as a tile's bytes.
    fn b(&self, g: usize, s: usize) -> &[u8] {
        words_as_bytes(&self.pairs[(g * self.steps + s) * B_WORDS..][..B_WORDS])
    }
}

/// Held tokens past this many bytes are dropped after their call, so that
/// one long prompt does not pin its copy in every thread.
const HELD_BYTES: usize = 64 << 20;

thread_local! {
    static HELD_TOKENS: RefCell<TokenTiles> = RefCell::default();
}

fn words_as_bytes(words: &[u32]) -> &[u8] {
    // SAFETY: the same memory, four bytes a word; a byte has no alignment.
    unsafe { std::slice::from_raw_parts(words.as_ptr().cast::<u8>(), std::mem::size_of_val(words)) }
}

fn halves_as_bytes(words: &[u16]) -> &[u8] {
    // SAFETY: as above, two bytes a word.
    unsafe { std::slice::from_raw_parts(words.as_ptr().cast::<u8>(), std::mem::size_of_val(words)) }
}

/// One C tile as stored.
#[repr(C, align(64))]
pub(super) struct Sums([[f32; TILE]; TILE]);

impl Sums {
    fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: 1 KiB of f32 seen as bytes; any bytes make some f32.
        unsafe { std::slice::from_raw_parts_mut(self.0.as_mut_ptr().cast::<u8>(), TILE * TILE * 4) }
    }
}

/// What runs around the tile instructions: the weights' decode, the
/// tokens' transposition and the fold of each block's sums.
pub(super) trait Around {
    /// Rows `band` of an FP8 `job` into `buf`, row i at word `i · stride`,
    /// in the step layout (see the module docs; NaN codes read as ±480, as
    /// on every SIMD level).
    fn decode_fp8(&self, job: &Job, band: Range<usize>, buf: &mut [u16], stride: usize);
    /// `dst[s · 256 + k · 16 + n]` = pair k of step s of `tokens[n]` (each
    /// `steps` steps of packed words), zero for n past the tokens.
    fn transpose(&self, tokens: &[&[u16]], steps: usize, dst: &mut [u32]);
    /// One column block's sums into a panel's: `acc[i][t] = sums[i][t] ·
    /// scales[i] + acc[i][t]`, fused (as the vector kernels fold a block).
    fn fold(&self, acc: &mut [[f32; TILE]; TILE], sums: &Sums, scales: &[f32]);
}

/// An FP8 code's BF16 word × 2⁸, NaN codes as ±480 (as the SIMD decodes
/// read them).
fn fp8_word(code: u8) -> u16 {
    if code & 0x7f == 0x7f {
        0x47f0 | u16::from(code & 0x80) << 8
    } else {
        E4M3_BF16_X256[code as usize]
    }
}

/// The portable forms.
pub(super) struct Portable;

impl Around for Portable {
    fn decode_fp8(&self, job: &Job, band: Range<usize>, buf: &mut [u16], stride: usize) {
        let lines = job.block[1].div_ceil(64);
        for (i, r) in band.enumerate() {
            let row = &job.data[r * job.cols..(r + 1) * job.cols];
            let dst = &mut buf[i * stride..(i + 1) * stride];
            dst.fill(0);
            for cb in 0..job.col_blocks {
                let (k0, width) = job.block_cols(cb);
                for (c, &code) in row[k0..k0 + width].iter().enumerate() {
                    let (q, j) = (c / 64, c % 64);
                    // Odd bytes first, then even ones.
                    dst[(cb * lines + q) * 64 + (1 - j % 2) * 32 + j / 2] = fp8_word(code);
                }
            }
        }
    }

    fn transpose(&self, tokens: &[&[u16]], steps: usize, dst: &mut [u32]) {
        dst[..steps * B_WORDS].fill(0);
        for (n, t) in tokens.iter().enumerate() {
            for s in 0..steps {
                for k in 0..TILE {
                    let w = &t[s * STEP + 2 * k..];
                    dst[s * B_WORDS + k * TILE + n] = u32::from(w[0]) | u32::from(w[1]) << 16;
                }
            }
        }
    }

    fn fold(&self, acc: &mut [[f32; TILE]; TILE], sums: &Sums, scales: &[f32]) {
        for ((acc, s), &scale) in acc.iter_mut().zip(&sums.0).zip(&scales[..TILE]) {
            for (a, &s) in acc.iter_mut().zip(s) {
                *a = s.mul_add(scale, *a);
            }
        }
    }
}

/// The AVX-512 forms: `gemv_avx512`'s exact decode and a register
/// transpose. Made only where the CPU has AVX-512 F/BW.
#[derive(Clone, Copy)]
pub(super) struct Avx512(());

impl Avx512 {
    pub(super) fn new() -> Option<Avx512> {
        (super::isa::hardware() >= super::isa::Isa::Avx512).then_some(Avx512(()))
    }
}

impl Around for Avx512 {
    fn decode_fp8(&self, job: &Job, band: Range<usize>, buf: &mut [u16], stride: usize) {
        assert!(buf.len() >= band.len() * stride && (buf.as_ptr() as usize).is_multiple_of(64) && stride == Steps::of(job).per_row * STEP);
        // SAFETY: AVX-512 F/BW (an `Avx512` exists); the band is inside the
        // matrix (the caller's rows) and the buffer holds its rows of
        // `odd_even_stride` (= `stride`) words, aligned (asserted).
        unsafe { super::gemv_avx512::decode_odd_even_tile(job, band, buf) }
    }

    fn transpose(&self, tokens: &[&[u16]], steps: usize, dst: &mut [u32]) {
        assert!(tokens.len() <= TILE && tokens.iter().all(|t| t.len() >= steps * STEP) && dst.len() >= steps * B_WORDS);
        // SAFETY: AVX-512 F (an `Avx512` exists); lengths asserted.
        unsafe { transpose_avx512(tokens, steps, dst) }
    }

    #[inline(always)]
    fn fold(&self, acc: &mut [[f32; TILE]; TILE], sums: &Sums, scales: &[f32]) {
        // SAFETY: AVX-512 F (an `Avx512` exists).
        unsafe { fold_avx512(acc, sums, &scales[..TILE]) }
    }
}

/// [`Portable::fold`] a row (sixteen tokens) per vector. (Written out:
/// left to itself the compiler vectorized it across rows, with gathers.)
#[target_feature(enable = "avx512f")]
fn fold_avx512(acc: &mut [[f32; TILE]; TILE], sums: &Sums, scales: &[f32]) {
    use std::arch::x86_64::*;
    for ((acc, s), &scale) in acc.iter_mut().zip(&sums.0).zip(scales) {
        // SAFETY: sixteen f32 of a whole array row each.
        unsafe {
            let v = _mm512_fmadd_ps(_mm512_loadu_ps(s.as_ptr()), _mm512_set1_ps(scale), _mm512_loadu_ps(acc.as_ptr()));
            _mm512_storeu_ps(acc.as_mut_ptr(), v);
        }
    }
}

/// [`Portable::transpose`] sixteen words at a time: a step of each token
/// is one vector (its sixteen pairs), and a 16 × 16 transpose of the
/// group's vectors gives the step's B tile.
///
/// # Safety
/// AVX-512 F; `tokens` ≤ 16, each of at least `steps · 32` words; `dst` of
/// at least `steps · 256`.
#[target_feature(enable = "avx512f")]
unsafe fn transpose_avx512(tokens: &[&[u16]], steps: usize, dst: &mut [u32]) {
    use std::arch::x86_64::*;
    for s in 0..steps {
        // SAFETY: step s of a token is 32 words inside it (contract).
        let r: [__m512i; TILE] = std::array::from_fn(|n| match tokens.get(n) {
            Some(t) => unsafe { _mm512_loadu_si512(t.as_ptr().add(s * STEP).cast()) },
            None => _mm512_setzero_si512(),
        });
        // In each 128-bit lane L (pairs 4L..4L + 4): a[2i], a[2i + 1] hold
        // pairs 4L, 4L + 1 and 4L + 2, 4L + 3 of tokens 2i, 2i + 1, interleaved.
        let a: [__m512i; TILE] = std::array::from_fn(|j| {
            let i = j / 2;
            if j % 2 == 0 { _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]) } else { _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]) }
        });
        // b[4i + c], lane L: pair 4L + c of tokens 4i..4i + 4.
        let b: [__m512i; TILE] = std::array::from_fn(|j| {
            let (i, c) = (j / 4, j % 4);
            let (x, y) = (a[4 * i + c / 2], a[4 * i + c / 2 + 2]);
            if c % 2 == 0 { _mm512_unpacklo_epi64(x, y) } else { _mm512_unpackhi_epi64(x, y) }
        });
        // Pair 4L + c of all sixteen tokens: lane L of b[c], b[4 + c],
        // b[8 + c], b[12 + c], gathered by two rounds of lane shuffles
        // (0x88 takes lanes 0 and 2 of each source, 0xdd lanes 1 and 3).
        for c in 0..4 {
            let t0 = _mm512_shuffle_i32x4::<0x88>(b[c], b[4 + c]);
            let t1 = _mm512_shuffle_i32x4::<0xdd>(b[c], b[4 + c]);
            let u0 = _mm512_shuffle_i32x4::<0x88>(b[8 + c], b[12 + c]);
            let u1 = _mm512_shuffle_i32x4::<0xdd>(b[8 + c], b[12 + c]);
            let pairs = [
                (c, _mm512_shuffle_i32x4::<0x88>(t0, u0)),
                (8 + c, _mm512_shuffle_i32x4::<0xdd>(t0, u0)),
                (4 + c, _mm512_shuffle_i32x4::<0x88>(t1, u1)),
                (12 + c, _mm512_shuffle_i32x4::<0xdd>(t1, u1)),
            ];
            for (k, v) in pairs {
                // SAFETY: row k of step s's tile is inside `dst` (contract).
                unsafe { _mm512_storeu_si512(dst.as_mut_ptr().add(s * B_WORDS + k * TILE).cast(), v) };
            }
        }
    }
}

/// `out[t · m + (r − rows.start)]` = weight row r · token t for every row of
/// `rows` and every token of `x` (`n` BF16 tokens of `job.cols`), on
/// `tiles`, with `around`'s decode and transposition, the tokens' tiles
/// kept in `held`.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn gemm<T: Tiles>(tiles: &mut T, around: &impl Around, held: &mut TokenTiles, job: &Job, rows: Range<usize>, x: &[u16], n: usize, out: &mut [f32]) {
    let m = rows.len();
    let steps = Steps::of(job);
    held.fill(around, job, x, n);
    let groups = n.div_ceil(TILE);
    let stride = steps.per_row * STEP;
    let mut band_buf = AlignedBuf::<u16>::zeroed(2 * TILE * stride);
    let unbias = if job.fp8 { UNBIAS } else { 1.0 };
    let mut sums = Sums([[0.0; TILE]; TILE]);
    tiles.configure(&config());
    for b0 in rows.clone().step_by(2 * TILE) {
        let b1 = (b0 + 2 * TILE).min(rows.end);
        let two_panels = b1 - b0 > TILE;
        // BF16 rows that are whole steps, in whole panels, are read in
        // place; any other band is decoded (FP8) or copied with its
        // padding (BF16) first. (A short last panel reads buffer rows past
        // the band: their sums are never stored out.)
        let in_place = !job.fp8 && job.cols.is_multiple_of(STEP) && (b1 - b0).is_multiple_of(TILE);
        let (a_src, a_stride): (&[u8], usize) = if in_place {
            (&job.data[2 * b0 * job.cols..2 * b1 * job.cols], 2 * job.cols)
        } else {
            let buf = band_buf.as_mut_slice();
            if job.fp8 {
                around.decode_fp8(job, b0..b1, buf, stride);
            } else {
                for (i, r) in (b0..b1).enumerate() {
                    let row = &job.data[2 * r * job.cols..2 * (r + 1) * job.cols];
                    let dst = &mut buf[i * stride..(i + 1) * stride];
                    for (d, b) in dst.iter_mut().zip(row.chunks_exact(2)) {
                        *d = u16::from_le_bytes([b[0], b[1]]);
                    }
                    dst[job.cols..].fill(0);
                }
            }
            (halves_as_bytes(band_buf.as_slice()), 2 * stride)
        };
        for g0 in (0..groups).step_by(2) {
            let two_groups = g0 + 1 < groups;
            // The sums of C[2p + g], [row][token].
            let mut acc = [[[0.0f32; TILE]; TILE]; 4];
            for cb in 0..job.col_blocks {
                tiles.zero::<C00>();
                tiles.zero::<C01>();
                tiles.zero::<C10>();
                tiles.zero::<C11>();
                for s in cb * steps.per_block..(cb + 1) * steps.per_block {
                    tiles.load::<A0>(&a_src[s * 2 * STEP..], a_stride);
                    tiles.load::<B0>(held.b(g0, s), 4 * TILE);
                    tiles.dot_bf16::<C00, A0, B0>();
                    if two_groups {
                        tiles.load::<B1>(held.b(g0 + 1, s), 4 * TILE);
                        tiles.dot_bf16::<C01, A0, B1>();
                    }
                    if two_panels {
                        tiles.load::<A1>(&a_src[TILE * a_stride + s * 2 * STEP..], a_stride);
                        tiles.dot_bf16::<C10, A1, B0>();
                        if two_groups {
                            tiles.dot_bf16::<C11, A1, B1>();
                        }
                    }
                }
                // The band's rows' scales of this block (1 past the band).
                let scales: [f32; 2 * TILE] = std::array::from_fn(|i| if job.fp8 && b0 + i < b1 { job.scale_row(b0 + i)[cb] } else { 1.0 });
                tiles.store::<C00>(sums.bytes_mut(), 4 * TILE);
                around.fold(&mut acc[0], &sums, &scales[..TILE]);
                if two_groups {
                    tiles.store::<C01>(sums.bytes_mut(), 4 * TILE);
                    around.fold(&mut acc[1], &sums, &scales[..TILE]);
                }
                if two_panels {
                    tiles.store::<C10>(sums.bytes_mut(), 4 * TILE);
                    around.fold(&mut acc[2], &sums, &scales[TILE..]);
                    if two_groups {
                        tiles.store::<C11>(sums.bytes_mut(), 4 * TILE);
                        around.fold(&mut acc[3], &sums, &scales[TILE..]);
                    }
                }
            }
            for (c, acc) in acc.iter().enumerate() {
                let (r0, t0) = (b0 + (c / 2) * TILE, (g0 + c % 2) * TILE);
                for (i, row) in acc.iter().enumerate().take(b1.saturating_sub(r0)) {
                    for (j, &v) in row.iter().enumerate().take(n.saturating_sub(t0)) {
                        out[(t0 + j) * m + r0 + i - rows.start] = v * unbias;
                    }
                }
            }
        }
    }
    tiles.release();
    if held.pairs.len() * 4 > HELD_BYTES {
        *held = TokenTiles::default();
    }
}

/// [`gemm`] on the CPU's tiles, with the AVX-512 decode, transposition and
/// fold.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma")]
fn gemm_hardware(tiles: &mut super::amx::HardwareTiles, held: &mut TokenTiles, job: &Job, rows: Range<usize>, x: &[u16], n: usize, out: &mut [f32]) {
    let around = Avx512::new().expect("usable tiles come with AVX-512");
    gemm(tiles, &around, held, job, rows, x, n, out)
}

/// `matmul_bf16` for FP8 or BF16 weights on the CPU's tiles (the caller
/// has checked the shapes, and [`usable`]).
pub(super) fn run(job: &Job, rows: Range<usize>, x: &[u16], n: usize, out: &mut [f32]) {
    assert!(usable(), "AMX BF16 tiles taken where they are not usable");
    let mut tiles = super::amx::HardwareTiles::for_bf16().expect("usable tiles are permitted");
    HELD_TOKENS.with_borrow_mut(|held| {
        // SAFETY: AVX-512 F/BW/VL and FMA: `usable` asks for the AVX-512
        // level, whose detection requires them.
        unsafe { gemm_hardware(&mut tiles, held, job, rows, x, n, out) }
    });
}

/// Whether `matmul_bf16` may take the tiles: the CPU has AMX BF16 tiles
/// and AVX-512, Linux permits the tiles, `DUPLEX_AMX` does not say `off`,
/// and the tiles pass a self-check (FP8 and BF16 products on the tiles
/// and on the model, each within f32 rounding of the exact sums). Decided
/// once per process; a failed check is said once on stderr.
pub(super) fn usable() -> bool {
    static USABLE: OnceLock<bool> = OnceLock::new();
    *USABLE.get_or_init(|| {
        Avx512::new().is_some()
            && super::amx::checked_tiles(super::amx::HardwareTiles::for_bf16, self_check, "AMX BF16 tiles turned off for matmul_bf16's prefill products, the vector kernels run instead")
    })
}

/// A deterministic sample problem: weights of `format`'s kind (`rows` ×
/// `cols`; FP8 with `block` scale blocks), `n` tokens, from `seed`.
struct Sample {
    rows: usize,
    cols: usize,
    fp8: Option<[usize; 2]>,
    data: Vec<u8>,
    scales: Vec<f32>,
    x: Vec<u16>,
    n: usize,
}

impl Sample {
    fn new(rows: usize, cols: usize, fp8: Option<[usize; 2]>, n: usize, seed: u64) -> Sample {
        let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        let mut next = move || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            s
        };
        let unit = |v: u64| (v >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
        let (data, scales) = match fp8 {
            // Any code but the NaNs (which the portable reference reads as NaN).
            Some(block) => (
                (0..rows * cols).map(|_| (next() >> 56) as u8).map(|c| if c & 0x7f == 0x7f { c - 1 } else { c }).collect(),
                (0..rows.div_ceil(block[0]) * cols.div_ceil(block[1])).map(|_| 0.01 + unit(next()).abs()).collect(),
            ),
            None => ((0..rows * cols).flat_map(|_| half::bf16::from_f32(unit(next()) * 4.0).to_le_bytes()).collect(), vec![]),
        };
        let x = (0..n * cols).map(|_| half::bf16::from_f32(unit(next()) * 8.0).to_bits()).collect();
        Sample { rows, cols, fp8, data, scales, x, n }
    }

    fn view(&self) -> crate::linear::WeightView<'_> {
        let format = match self.fp8 {
            Some(block) => crate::linear::WeightFormat::Fp8E4m3 { block },
            None => crate::linear::WeightFormat::Bf16,
        };
        crate::linear::WeightView { rows: self.rows, cols: self.cols, format, data: &self.data, scales: &self.scales }
    }

    /// Every (token, row) product in f64 from the decoded weights, with
    /// the sum of its terms' magnitudes.
    fn exact(&self) -> Vec<(f64, f64)> {
        let w = self.view();
        let mut row = vec![0.0f32; self.cols];
        let mut want = vec![(0.0, 0.0); self.n * self.rows];
        for r in 0..self.rows {
            w.decode_row(r, &mut row);
            for t in 0..self.n {
                let x = &self.x[t * self.cols..(t + 1) * self.cols];
                want[t * self.rows + r] = row.iter().zip(x).fold((0.0, 0.0), |(s, m), (&w, &x)| {
                    let p = w as f64 * super::gemv::bf16_to_f32(x) as f64;
                    (s + p, m + p.abs())
                });
            }
        }
        want
    }

    /// [`gemm`] of the sample on `tiles` with `around`, rows `band`.
    fn products<T: Tiles>(&self, tiles: &mut T, around: &impl Around, band: Range<usize>) -> Vec<f32> {
        let w = self.view();
        let job = Job::new(&w);
        let mut out = vec![f32::NAN; self.n * band.len()];
        gemm(tiles, around, &mut TokenTiles::default(), &job, band, &self.x, self.n, &mut out);
        out
    }
}

/// Whether `got` (rows `band` of every token) is within f32 rounding of
/// the exact products: each output's error at most `(cols + 2) · 2⁻²³` of
/// the sum of its terms' magnitudes (a bound for any order of f32
/// additions of exact products, the scale's FMA included).
fn within_rounding(sample: &Sample, band: Range<usize>, got: &[f32]) -> Result<(), String> {
    let exact = sample.exact();
    let m = band.len();
    for t in 0..sample.n {
        for (j, r) in band.clone().enumerate() {
            let (want, mag) = exact[t * sample.rows + r];
            let g = got[t * m + j] as f64;
            let bound = (sample.cols + 2) as f64 * f32::EPSILON as f64 * mag + 1e-30;
            if g.is_nan() || (g - want).abs() > bound {
                return Err(format!("{}x{} {:?} n={}: token {t} row {r} is {g}, the exact sum {want} (bound {bound:e})", sample.rows, sample.cols, sample.fp8, sample.n));
            }
        }
    }
    Ok(())
}

/// The self-check of [`usable`]: FP8 (whole and partial scale blocks) and
/// BF16 (rows of whole steps, read in place, and not), partial panels and
/// groups, on the model and on the tiles.
fn self_check(hw: &mut super::amx::HardwareTiles) -> Result<(), String> {
    let around = Avx512::new().ok_or("no AVX-512")?;
    for (rows, cols, fp8, n, seed) in [(37, 300, Some([128, 128]), 19, 1), (32, 256, None, 33, 2), (21, 100, None, 5, 3), (16, 640, Some([16, 128]), 16, 4)] {
        let sample = Sample::new(rows, cols, fp8, n, seed);
        let model = sample.products(&mut super::amx::ModelTiles::default(), &Portable, 0..rows);
        within_rounding(&sample, 0..rows, &model).map_err(|e| format!("the model: {e}"))?;
        // SAFETY: AVX-512 F/BW/VL and FMA (`usable` asked first).
        let got = unsafe { self_check_products(hw, around, &sample) };
        within_rounding(&sample, 0..rows, &got).map_err(|e| format!("the tiles: {e}"))?;
    }
    Ok(())
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma")]
fn self_check_products(hw: &mut super::amx::HardwareTiles, around: Avx512, sample: &Sample) -> Vec<f32> {
    let w = sample.view();
    let job = Job::new(&w);
    let mut out = vec![f32::NAN; sample.n * sample.rows];
    gemm(hw, &around, &mut TokenTiles::default(), &job, 0..sample.rows, &sample.x, sample.n, &mut out);
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::amx::ModelTiles;
    use proptest::prelude::*;

    /// A sample's products over a band of rows, on the model.
    type Products = Box<dyn Fn(&Sample, Range<usize>) -> Vec<f32>>;

    /// Every `Around` this CPU runs: the portable one, and AVX-512's where present.
    fn arounds() -> Vec<Products> {
        let mut v: Vec<Products> = vec![Box::new(|s: &Sample, band| s.products(&mut ModelTiles::default(), &Portable, band))];
        match Avx512::new() {
            Some(a) => v.push(Box::new(move |s: &Sample, band| s.products(&mut ModelTiles::default(), &a, band))),
            None => eprintln!("no AVX-512 on this CPU: the model runs the portable decode and transposition only"),
        }
        v
    }

    /// The tiles (on the model) give every product within f32 rounding of
    /// its exact sum: FP8 with DeepSeek's blocks, odd blocks and partial
    /// edges; BF16 rows in place and copied; panels and groups whole and
    /// partial; bands that start anywhere.
    #[test]
    fn model_products_are_within_rounding() {
        let mut seed = 100;
        for (rows, cols, fp8) in [(40, 256, Some([128, 128])), (17, 300, Some([128, 128])), (33, 130, Some([7, 50])), (16, 64, None), (50, 96, None), (9, 70, None), (3, 1, Some([128, 128]))] {
            for n in [1, 9, 16, 17, 40] {
                seed += 1;
                let s = Sample::new(rows, cols, fp8, n, seed);
                for products in arounds() {
                    for band in [0..rows, rows / 3..rows] {
                        within_rounding(&s, band.clone(), &products(&s, band)).unwrap();
                    }
                }
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(32))]
        /// The same on random shapes, blocks and bands.
        #[test]
        fn random_shapes_are_within_rounding(rows in 1usize..50, cols in 1usize..300, n in 1usize..40, fp8 in prop::option::of((1usize..70, 1usize..200)), cut in 0usize..50, seed in any::<u64>()) {
            let s = Sample::new(rows, cols, fp8.map(|(a, b)| [a, b]), n, seed);
            let band = cut.min(rows)..rows;
            for products in arounds() {
                within_rounding(&s, band.clone(), &products(&s, band.clone())).map_err(TestCaseError::fail)?;
            }
        }
    }

    /// On the tiles every token's results are the same bits alone as with
    /// any others, and over any band holding its rows; and the AVX-512
    /// decode and transposition give the portable ones' bits.
    #[test]
    fn tile_products_are_batch_invariant() {
        for (rows, cols, fp8) in [(40, 300, Some([128, 128])), (35, 96, None), (20, 100, None)] {
            let s = Sample::new(rows, cols, fp8, 37, 7);
            let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            let all = s.products(&mut ModelTiles::default(), &Portable, 0..rows);
            if let Some(a) = Avx512::new() {
                assert_eq!(bits(&all), bits(&s.products(&mut ModelTiles::default(), &a, 0..rows)), "{rows}x{cols}: AVX-512 around");
            }
            for t in [0, 16, 36] {
                let alone = Sample { x: s.x[t * cols..(t + 1) * cols].to_vec(), n: 1, ..Sample::new(rows, cols, fp8, 1, 7) };
                assert_eq!(bits(&alone.products(&mut ModelTiles::default(), &Portable, 0..rows)), bits(&all[t * rows..(t + 1) * rows]), "{rows}x{cols}: token {t} alone");
            }
            let sub = 5..rows - 2;
            let part = s.products(&mut ModelTiles::default(), &Portable, sub.clone());
            for t in 0..s.n {
                assert_eq!(bits(&part[t * sub.len()..(t + 1) * sub.len()]), bits(&all[t * rows + sub.start..t * rows + sub.end]), "{rows}x{cols}: token {t}, rows {sub:?}");
            }
        }
    }

    /// Held tokens are not taken for others: without columns every token
    /// count has the same (empty) activations, and each gets its zeros.
    #[test]
    fn held_tokens_follow_the_token_count() {
        for fp8 in [Some([128, 128]), None] {
            let mut held = TokenTiles::default();
            for n in [9, 40, 17] {
                let s = Sample::new(5, 0, fp8, n, 1);
                let w = s.view();
                let mut out = vec![f32::NAN; n * 5];
                gemm(&mut ModelTiles::default(), &Portable, &mut held, &Job::new(&w), 0..5, &s.x, n, &mut out);
                assert!(out.iter().all(|&v| v == 0.0), "{fp8:?} n={n}: {out:?}");
            }
        }
    }

    /// The decodes agree for all 256 codes in every position of a line
    /// (NaN codes as ±480), over whole and partial lines.
    #[test]
    fn avx512_decode_is_the_portable_decode() {
        let Some(a) = Avx512::new() else {
            eprintln!("no AVX-512 on this CPU: only the portable decode runs here");
            return;
        };
        let (rows, cols) = (3, 300);
        let data: Vec<u8> = (0..rows * cols).map(|i| (i * 7 % 256) as u8).collect();
        let scales = vec![1.0; 3];
        let w = crate::linear::WeightView { rows, cols, format: crate::linear::WeightFormat::Fp8E4m3 { block: [128, 128] }, data: &data, scales: &scales };
        let job = Job::new(&w);
        let stride = Steps::of(&job).per_row * STEP;
        let mut want = AlignedBuf::<u16>::zeroed(rows * stride);
        let mut got = AlignedBuf::<u16>::zeroed(rows * stride);
        Portable.decode_fp8(&job, 0..rows, want.as_mut_slice(), stride);
        a.decode_fp8(&job, 0..rows, got.as_mut_slice(), stride);
        assert_eq!(got.as_slice(), want.as_slice());
        // NaN codes as ±480 · 2⁸.
        assert_eq!(f32::from_bits((fp8_word(0x7f) as u32) << 16), 480.0 * 256.0);
        assert_eq!(f32::from_bits((fp8_word(0xff) as u32) << 16), -480.0 * 256.0);
    }

    /// The AVX-512 transposition against the portable one, for every
    /// number of tokens in a group.
    #[test]
    fn avx512_transpose_is_the_portable_transpose() {
        let Some(a) = Avx512::new() else {
            eprintln!("no AVX-512 on this CPU: only the portable transposition runs here");
            return;
        };
        let steps = 3;
        let tokens: Vec<Vec<u16>> = (0..TILE).map(|t| (0..steps * STEP).map(|i| (t * 1000 + i) as u16).collect()).collect();
        for count in [1, 5, 16] {
            let refs: Vec<&[u16]> = tokens[..count].iter().map(Vec::as_slice).collect();
            let (mut want, mut got) = (vec![7u32; steps * B_WORDS], vec![9u32; steps * B_WORDS]);
            Portable.transpose(&refs, steps, &mut want);
            a.transpose(&refs, steps, &mut got);
            assert_eq!(got, want, "{count} tokens");
        }
    }

    /// Planted slips are caught by the rounding check: a scale taken from
    /// the next row, and a pair's halves swapped in the transposition.
    #[test]
    fn slips_are_caught() {
        struct SwappedPair;
        impl Around for SwappedPair {
            fn decode_fp8(&self, job: &Job, band: Range<usize>, buf: &mut [u16], stride: usize) {
                Portable.decode_fp8(job, band, buf, stride)
            }
            fn transpose(&self, tokens: &[&[u16]], steps: usize, dst: &mut [u32]) {
                Portable.transpose(tokens, steps, dst);
                dst[3] = dst[3].rotate_left(16);
            }
            fn fold(&self, acc: &mut [[f32; TILE]; TILE], sums: &Sums, scales: &[f32]) {
                Portable.fold(acc, sums, scales)
            }
        }
        let s = Sample::new(16, 64, None, 4, 3);
        let got = s.products(&mut ModelTiles::default(), &SwappedPair, 0..16);
        assert!(within_rounding(&s, 0..16, &got).is_err(), "a swapped pair went unseen");
        let mut s = Sample::new(32, 128, Some([16, 128]), 4, 5);
        let got = s.products(&mut ModelTiles::default(), &Portable, 0..32);
        s.scales.swap(0, 1);
        assert!(within_rounding(&s, 0..32, &got).is_err(), "swapped scales went unseen");
    }

    /// On an AMX machine the self-check must pass; elsewhere this says why
    /// it could not run (as the CUDA tests do without a GPU).
    #[test]
    fn hardware_bf16_gemm_passes_the_self_check() {
        let Some(mut hw) = crate::cpu::amx::HardwareTiles::for_bf16() else {
            eprintln!("skipped: this CPU or kernel gives no AMX BF16 tiles (CPUID, XCR0 or arch_prctl)");
            return;
        };
        assert!(Avx512::new().is_some(), "AMX without AVX-512");
        self_check(&mut hw).unwrap();
    }
}
