//! Linear layers split across the worker pool by output rows.

use crate::cpu::{convert::f32_to_bf16, gemv::matmul_bf16, isa::Isa};
use crate::quant::{self, DotPath, QuantKind, QuantizedTokens};
use crate::pool::ThreadPool;
use crate::shared::SharedSlice;
use crate::{WeightFormat, WeightView};
use std::ops::Range;

/// Rows per task. FP8 tiles follow the scale blocks so that no tile crosses
/// one. Four tiles a thread let the pool balance threads that run at
/// different speeds; but up to [`STREAMING_TOKENS`] tokens a tile reads
/// its weights once, and every tile pays a fixed cost (a cold stream, its
/// scheduling), so there a thread takes one tile per [`STREAM_TILE_BYTES`]
/// of its share, one at least and four at most.
fn tile_rows(w: &WeightView, threads: usize, n: usize) -> usize {
    let align = match w.format {
        WeightFormat::Fp8E4m3 { block } => block[0],
        _ => 16,
    };
    let threads = threads.max(1);
    let tiles_per_thread = if n <= STREAMING_TOKENS { (w.rows * w.format.row_bytes(w.cols) / (threads * STREAM_TILE_BYTES)).clamp(1, 4) } else { 4 };
    let per_thread = w.rows.div_ceil(threads * tiles_per_thread);
    per_thread.div_ceil(align).max(1) * align
}

/// Tokens up to which a product streams each weight once from memory (the
/// kernels' one pass, `cpu::kernel`'s `PASS_TOKENS`): decode's.
const STREAMING_TOKENS: usize = 8;

/// Weight bytes per tile where the product streams, at least (where a
/// thread's share has as many). On the Q4_K_M `bench` model, decoding at
/// context 512, MLA's projections (0.7–2.7 MB each) took 1.78–1.97 ms a
/// step in four tiles a thread (0.2–0.7 MB), 1.60–1.66 in two and
/// 1.49–1.51 in one (three runs alternating).
const STREAM_TILE_BYTES: usize = 1 << 20;

/// Reusable buffers: the BF16 (or, for block-quantized weights, 8-bit)
/// copy of the input and per-task outputs; for [`par_head_products`], the
/// BF16 copy's values as F32 too, the quantizer's input.
#[derive(Default)]
pub struct LinearScratch {
    x: Vec<u16>,
    q: QuantizedTokens,
    tiles: Vec<f32>,
}

/// `out[i, r] = Σ_c W[r, c] · bf16(x[i, c])` for `n` rows of `x` (`[n, cols]`),
/// with F32 accumulation; `out` is `[n, rows]`. Block-quantized weights
/// take 8-bit activations instead, quantized once for every tile as
/// llama.cpp quantizes a matmul's input once (from F32, not BF16: the same
/// values it quantizes).
pub fn par_matmul(pool: &ThreadPool, isa: Isa, w: &WeightView, x: &[f32], n: usize, out: &mut [f32], scratch: &mut LinearScratch) {
    assert_eq!(x.len(), n * w.cols, "par_matmul: input is not [n, cols]");
    assert_eq!(out.len(), n * w.rows, "par_matmul: output is not [n, rows]");
    let quant = match w.format {
        WeightFormat::Quant(kind) => {
            quantize_tokens(pool, &mut scratch.q, kind, x, n);
            Some((kind, w.format.row_bytes(w.cols), DotPath::for_isa(isa)))
        }
        _ => {
            scratch.x.resize(x.len(), 0);
            f32_to_bf16(isa, x, &mut scratch.x);
            None
        }
    };
    let (xb, xq) = (&scratch.x, &scratch.q);
    // Rows r0..r1 for every token into `buf` (`[n, r1 - r0]`).
    let band = |r0: usize, r1: usize, buf: &mut [f32]| match quant {
        Some((kind, row_bytes, path)) => quant::matmul(path, kind, &w.data[r0 * row_bytes..r1 * row_bytes], r1 - r0, xq, buf).expect("a checked block-quantized band"),
        None => matmul_bf16(isa, w, r0..r1, xb, n, buf),
    };
    let tile = tile_rows(w, pool.threads(), n);
    let n_tiles = w.rows.div_ceil(tile);
    if n == 1 {
        // One token: each tile's output is already contiguous in `out`.
        let out = SharedSlice::new(out);
        pool.parallel_for(n_tiles, &|t| {
            let (r0, r1) = (t * tile, ((t + 1) * tile).min(w.rows));
            // SAFETY: rows r0..r1 are written by this task only.
            band(r0, r1, unsafe { out.slice_mut(r0, r1 - r0) });
        });
        return;
    }
    // Several tokens: tiles are computed into their own buffers, then
    // scattered into the token-major output.
    scratch.tiles.resize(n_tiles * tile * n, 0.0);
    let tiles = SharedSlice::new(&mut scratch.tiles);
    let out = SharedSlice::new(out);
    pool.parallel_for(n_tiles, &|t| {
        let (r0, r1) = (t * tile, ((t + 1) * tile).min(w.rows));
        let m = r1 - r0;
        // SAFETY: tile t's buffer is this task's alone.
        let buf = unsafe { tiles.slice_mut(t * tile * n, m * n) };
        band(r0, r1, buf);
        for i in 0..n {
            // SAFETY: rows r0..r1 of every token row are written by this task only.
            unsafe { out.slice_mut(i * w.rows + r0, m) }.copy_from_slice(&buf[i * m..(i + 1) * m]);
        }
    });
}

/// `out[h] = W_h · x[h]` for heads `0..heads`, in one parallel region:
/// MLA's absorbed decode multiplies each head's query by a band of weights
/// of its own (`attn_k_b`, `attn_v_b`, or `kv_b_proj`'s rows), small
/// products that the pool takes a head at a time. `x` is `[heads, cols]`,
/// `out` `[heads, rows]`; `band(h)` is head h's weights and rows, all in
/// one format. Every head's product has the bits [`par_matmul`] gives that
/// head alone: BF16 activations for unquantized weights; for
/// block-quantized ones the heads' activations are quantized once from F32,
/// each head a token of them, and every head's product takes its own token
/// (not quantizing and allocating per head).
pub fn par_head_products<'w>(pool: &ThreadPool, isa: Isa, heads: usize, band: &(dyn Fn(usize) -> (WeightView<'w>, Range<usize>) + Sync), x: &[f32], out: &mut [f32], scratch: &mut LinearScratch) {
    if heads == 0 {
        return;
    }
    let (cols, rows) = (x.len() / heads, out.len() / heads);
    assert_eq!(x.len(), heads * cols, "par_head_products: input is not [heads, cols]");
    assert_eq!(out.len(), heads * rows, "par_head_products: output is not [heads, rows]");
    let quant = match band(0).0.format {
        WeightFormat::Quant(kind) => {
            // From F32, as `par_matmul` quantizes (and llama.cpp).
            scratch.q.quantize(kind, x, heads).expect("activations of whole blocks (loading checks the widths)");
            Some(kind)
        }
        _ => {
            scratch.x.resize(x.len(), 0);
            f32_to_bf16(isa, x, &mut scratch.x);
            None
        }
    };
    let (xb, xq, path) = (&scratch.x, &scratch.q, DotPath::for_isa(isa));
    let out = SharedSlice::new(out);
    pool.parallel_for(heads, &|h| {
        let (w, r) = band(h);
        assert_eq!((w.cols, r.len()), (cols, rows), "par_head_products: head {h}'s band");
        // SAFETY: head h's rows of `out` are written by this task only.
        let dst = unsafe { out.slice_mut(h * rows, rows) };
        match (w.format, quant) {
            (WeightFormat::Quant(kind), Some(held)) if kind == held => {
                let row_bytes = w.format.row_bytes(cols);
                quant::matmul_picked(path, kind, &w.data[r.start * row_bytes..r.end * row_bytes], rows, xq, &[(h, 1.0)], dst).expect("a checked block-quantized band");
            }
            (WeightFormat::Quant(_), _) | (_, Some(_)) => panic!("par_head_products: head {h}'s band is {:?}, head 0's {:?}", w.format, band(0).0.format),
            _ => matmul_bf16(isa, &w, r, &xb[h * cols..(h + 1) * cols], 1, dst),
        }
    });
}

/// Quantize `n` tokens of `x` for `kind` weights into `q`, spread over the
/// pool when there are enough of them to pay for it (a prefill's).
///
/// Panics if a token is not whole blocks: loading checks every block
/// format's widths, so that would be a caller's bug.
pub fn quantize_tokens(pool: &ThreadPool, q: &mut QuantizedTokens, kind: QuantKind, x: &[f32], n: usize) {
    q.prepare(kind, x.len(), n).expect("activations of whole blocks (loading checks the widths)");
    let cols = q.cols();
    /// Tokens per task: below this, one thread does it faster than a fork.
    const PER_TASK: usize = 16;
    if n <= PER_TASK {
        for t in 0..n {
            q.quantize_token(t, &x[t * cols..(t + 1) * cols]).expect("checked by prepare");
        }
        return;
    }
    let per_token = q.token_range(0).len();
    let blocks = q.blocks_mut();
    let (k, z, one) = (SharedSlice::new(blocks.q8k), SharedSlice::new(blocks.q8_0), SharedSlice::new(blocks.q8_1));
    pool.parallel_for(n.div_ceil(PER_TASK), &|task| {
        for t in task * PER_TASK..((task + 1) * PER_TASK).min(n) {
            let xt = &x[t * cols..(t + 1) * cols];
            // SAFETY: token t's blocks are written by this task only (in
            // the buffer of `kind`'s family, the one `prepare` sized).
            match kind {
                QuantKind::Q4K | QuantKind::Q5K | QuantKind::Q6K => crate::quant::quantize_q8_k_into(xt, unsafe { k.slice_mut(t * per_token, per_token) }),
                QuantKind::Q5_1 => crate::quant::quantize_q8_1_into(xt, unsafe { one.slice_mut(t * per_token, per_token) }),
                _ => crate::quant::quantize_q8_0_into(xt, unsafe { z.slice_mut(t * per_token, per_token) }),
            }
            .expect("checked by prepare");
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::isa;
    use crate::pool::PoolConfig;

    /// Deterministic bytes: a xorshift stream.
    fn bytes(len: usize, mut seed: u64) -> Vec<u8> {
        (0..len)
            .map(|_| {
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                (seed >> 24) as u8
            })
            .collect()
    }

    /// `rows × cols` weights of `format`: block-quantized ones are any
    /// quants under a small F16 scale, BF16 ones values in about ±1.
    fn weights(format: WeightFormat, rows: usize, cols: usize, seed: u64) -> Vec<u8> {
        match format {
            WeightFormat::Quant(kind) => {
                let mut data = bytes(rows * format.row_bytes(cols), seed);
                let scale = half::f16::from_f32(0.01).to_bits().to_le_bytes();
                for block in data.chunks_exact_mut(kind.block_bytes()) {
                    for &at in kind.f16_offsets() {
                        block[at..at + 2].copy_from_slice(&scale);
                    }
                }
                data
            }
            _ => bytes(rows * cols, seed).iter().flat_map(|&b| crate::round_bf16(b as f32 / 128.0 - 1.0).to_bits().to_le_bytes()[2..].to_vec()).collect(),
        }
    }

    /// Every head's product has the bits `par_matmul` gives that head
    /// alone, on bands of one matrix (as `attn_v_b`'s) for every format
    /// the absorbed decode meets, with inputs that are not BF16 values.
    #[test]
    fn head_products_are_each_heads_par_matmul() {
        let (pool, isa) = (ThreadPool::new(&PoolConfig::single_node(2)), isa::detect());
        let (heads, rows, cols) = (5, 48, 512);
        for format in [QuantKind::Q4K, QuantKind::Q5K, QuantKind::Q6K, QuantKind::Q8_0, QuantKind::Q5_0, QuantKind::Q5_1].map(WeightFormat::Quant).into_iter().chain([WeightFormat::Bf16]) {
            let data = weights(format, heads * rows, cols, 0x9e37_79b9 + heads as u64);
            let w = WeightView { rows: heads * rows, cols, format, data: &data, scales: &[] };
            let x: Vec<f32> = bytes(heads * cols, 7).iter().map(|&b| (b as f32 - 127.5) / 37.3).collect();
            let mut out = vec![f32::NAN; heads * rows];
            par_head_products(&pool, isa, heads, &|h| (w, h * rows..(h + 1) * rows), &x, &mut out, &mut LinearScratch::default());
            let row_bytes = format.row_bytes(cols);
            for h in 0..heads {
                let head = WeightView { rows, data: &data[h * rows * row_bytes..(h + 1) * rows * row_bytes], ..w };
                let mut want = vec![0.0f32; rows];
                par_matmul(&pool, isa, &head, &x[h * cols..(h + 1) * cols], 1, &mut want, &mut LinearScratch::default());
                let got = &out[h * rows..(h + 1) * rows];
                assert!(got.iter().zip(&want).all(|(g, w)| g.to_bits() == w.to_bits()), "{format:?} head {h}: {got:?} against {want:?}");
            }
        }
    }
}
