//! What the SIMD GEMV kernels share: the problem description, the row-band
//! driver (which rows a kernel step takes, in what order) and prefetching.
//! x86-64 only; the portable level needs none of it.

use crate::linear::{WeightFormat, WeightView};
use std::ops::Range;

/// The weight matrix as the SIMD kernels see it. BF16 weights are one block
/// per row with no scales.
pub(super) struct Job<'a> {
    pub data: &'a [u8],
    pub cols: usize,
    pub fp8: bool,
    /// `[rows per scale block, columns per scale block]`.
    pub block: [usize; 2],
    pub col_blocks: usize,
    scales: &'a [f32],
}

impl<'a> Job<'a> {
    pub fn new(w: &WeightView<'a>) -> Self {
        let (fp8, block) = match w.format {
            WeightFormat::Fp8E4m3 { block } => (true, block),
            _ => (false, [w.rows.max(1), w.cols.max(1)]),
        };
        Job { data: w.data, cols: w.cols, fp8, block, col_blocks: w.cols.div_ceil(block[1]), scales: w.scales }
    }

    /// The scales of row `r`, one per column block (a single 1 for BF16).
    /// Kernels fetch this once per row: the division by the block height
    /// must stay out of the block loop.
    #[inline]
    pub fn scale_row(&self, r: usize) -> &'a [f32] {
        if self.fp8 {
            // A shift for the usual power-of-two block height: this runs
            // for every band of rows, and a division costs ~30 cycles.
            let block_row = if self.block[0].is_power_of_two() { r >> self.block[0].trailing_zeros() } else { r / self.block[0] };
            let start = block_row * self.col_blocks;
            &self.scales[start..start + self.col_blocks]
        } else {
            &[1.0]
        }
    }

    /// Columns `[start, start + len)` of block `cb`.
    #[inline]
    pub fn block_cols(&self, cb: usize) -> (usize, usize) {
        let start = cb * self.block[1];
        (start, self.block[1].min(self.cols - start))
    }
}

/// FP8 codes with their BF16 bit patterns, pre-multiplied by 2⁸ like every
/// SIMD decode here (so scales are applied with a 2⁻⁸ factor). Exact,
/// NaN codes included. The AVX-512 exact decode takes its subnormals from it.
pub(super) static E4M3_BF16_X256: [u16; 256] = {
    let mut t = [0u16; 256];
    let mut i = 0;
    while i < 256 {
        t[i] = ((crate::fp8::e4m3_to_f32(i as u8) * 256.0).to_bits() >> 16) as u16;
        i += 1;
    }
    t
};

/// Post-scale factor undoing the 2⁸ of every SIMD FP8 decode.
pub(super) const UNBIAS: f32 = 1.0 / 256.0;

/// Tokens one pass of the AVX-512 kernels takes (its largest token group).
pub(super) const PASS_TOKENS: usize = 8;

/// Rows per band when a call makes several passes: 16 rows × 7168 columns
/// is 112 KiB of FP8 (224 KiB of BF16), which stays in L2 from one pass
/// to the next.
pub(super) const BAND_ROWS: usize = 16;

/// Rows of BF16 weights in place: row `r` starts at `base + r · stride` bytes.
#[derive(Clone, Copy)]
pub(super) struct Bf16Rows {
    pub base: *const u8,
    pub stride: usize,
}

impl Bf16Rows {
    pub fn new(job: &Job) -> Self {
        Bf16Rows { base: job.data.as_ptr(), stride: 2 * job.cols }
    }

    /// # Safety
    /// `r` is a row of the matrix.
    #[inline(always)]
    pub unsafe fn row(&self, r: usize) -> *const u8 {
        // SAFETY: per the contract the row lies inside the matrix.
        unsafe { self.base.add(r * self.stride) }
    }
}

/// The row bands a call runs its token groups over, `passes` of them (one
/// per token group). One band when a single pass covers every token: its
/// read streams then run the length of the rows instead of restarting every
/// 16 rows (that moved the 134 MB BF16 `lm_head` of the
/// `bench` preset at ~1.0 of the read bandwidth instead of ~0.8). With
/// several passes, bands of [`BAND_ROWS`] keep each band's rows in cache
/// across them.
///
/// Batch invariance: every kernel computes a row's dot product for a token
/// in an order fixed by the row and the columns alone, whatever the band,
/// the rows taken with it in a step (`R`), the tokens taken with it (`N`)
/// or the number of tokens in the call. So a sequence's result does not
/// depend on the batch it was computed in. (Prefill used to decode FP8
/// bands into BF16 tiles for a kernel with another lane order, and the
/// decode kernels used one accumulator chain or two depending on `R · N`:
/// each changed the summation order with the batch.)
pub(super) fn bands(rows: Range<usize>, passes: usize) -> impl Iterator<Item = Range<usize>> {
    let band = if passes <= 1 { rows.len().max(1) } else { BAND_ROWS };
    (rows.start..rows.end).step_by(band).map(move |b| b..(b + band).min(rows.end))
}

/// A kernel that produces `R` rows × `N` tokens of output at a time.
pub(super) trait RowKernel {
    /// Outputs for rows `rows[0..R]`, tokens `t0..t0 + N`, as `[row][token]`.
    ///
    /// # Safety
    /// The kernel's CPU features are present, and the rows and tokens are
    /// inside the problem the kernel was built for.
    unsafe fn rows<const R: usize, const N: usize>(&self, rows: [usize; R], t0: usize) -> [[f32; N]; R];
}

/// Run `k` over `rows` for tokens `t0..t0 + N`, `R` rows at a time, writing
/// `out[t · m + (r - first)]`.
///
/// The `R` rows of a step are not neighbours: `rows` is cut into `R` equal
/// contiguous parts and step `i` takes row `i` of each. Each of the kernel's
/// `R` read streams then walks one part sequentially, which the hardware
/// prefetchers follow best (they track streams per 4 KiB page; with
/// neighbouring rows, 2048-column rows put two streams in each page). On the
/// 7168 × 2048 shape this took one thread from ~65% to ~85% of the streaming
/// read bandwidth.
///
/// # Safety
/// As for [`RowKernel::rows`].
pub(super) unsafe fn band<K: RowKernel, const R: usize, const N: usize>(
    k: &K,
    rows: Range<usize>,
    first: usize,
    t0: usize,
    out: &mut [f32],
    m: usize,
) {
    let mut store = |at: &[usize], res: &[[f32; N]]| {
        for (&r, row) in at.iter().zip(res) {
            for (t, &v) in row.iter().enumerate() {
                out[(t0 + t) * m + r - first] = v;
            }
        }
    };
    let part = rows.len() / R;
    for i in 0..part {
        let at: [usize; R] = std::array::from_fn(|j| rows.start + j * part + i);
        // SAFETY: forwarded; every row is inside `rows`.
        store(&at, &unsafe { k.rows::<R, N>(at, t0) });
    }
    for r in rows.start + R * part..rows.end {
        // SAFETY: as above, for the leftover rows one at a time.
        store(&[r], &unsafe { k.rows::<1, N>([r], t0) });
    }
}

/// Software prefetch 1 KiB ahead of `byte` in the row at `row`. The
/// rows a stream reads follow each other in memory (see [`band`]), so near a
/// row's end this already fetches the start of that stream's next row.
#[inline(always)]
pub(super) fn prefetch_ahead(row: *const u8, byte: usize) {
    prefetch_at::<1024>(row, byte)
}

/// [`prefetch_ahead`] for a band decoded once, one row after another
/// (`decode_odd_even_tile`): 4 KiB ahead, where its one stream waited on
/// memory with 1 KiB (a 2048-token FP8 prefill, three rounds alternating
/// each: 207.7–211.6 tokens/s with 1 KiB against 213.0–216.2 with 2; then
/// 212.0–214.7 with 2 against 214.8–220.6 with 4).
#[inline(always)]
pub(super) fn prefetch_far(row: *const u8, byte: usize) {
    prefetch_at::<4096>(row, byte)
}

/// Software prefetch `LEAD` bytes ahead of `byte` past `row` (the one
/// prefetch of the kernels, `quant`'s included).
#[inline(always)]
pub(crate) fn prefetch_at<const LEAD: usize>(row: *const u8, byte: usize) {
    // SAFETY: prefetching is only a hint and never faults; `wrapping_add`
    // makes computing an address past the matrix well-defined.
    unsafe { std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(row.wrapping_add(byte + LEAD).cast()) };
}

/// Split `n` tokens into groups of at most `$group` and run `band` with the
/// rows-per-step chosen for each group size (register budget: R·N pairs of
/// accumulators).
macro_rules! token_groups {
    ($k:expr, $rows:expr, $first:expr, $n:expr, $out:expr, $m:expr, $group:literal, { $($nt:literal => $r:literal),* $(,)? }) => {{
        let mut t0 = 0;
        while t0 < $n {
            let nt = ($n - t0).min($group);
            match nt {
                $($nt => super::kernel::band::<_, $r, $nt>($k, $rows.clone(), $first, t0, $out, $m),)*
                _ => unreachable!(),
            }
            t0 += nt;
        }
    }};
}
pub(super) use token_groups;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bf16_table_is_exact() {
        for c in 0..=255u8 {
            let want = crate::fp8::E4M3_TABLE[c as usize] * 256.0;
            let got = f32::from_bits((E4M3_BF16_X256[c as usize] as u32) << 16);
            assert!(got == want || (got.is_nan() && want.is_nan()), "code {c:#04x}");
        }
    }
}
