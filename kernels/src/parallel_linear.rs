//! Linear layers split across the worker pool by output rows.

use crate::cpu::{convert::f32_to_bf16, gemv::matmul_bf16, isa::Isa};
use crate::pool::ThreadPool;
use crate::shared::SharedSlice;
use crate::{WeightFormat, WeightView};

/// Rows per task. FP8 tiles follow the scale blocks so that no tile crosses
/// one; small matrices get fewer, larger tiles so every thread has work.
fn tile_rows(w: &WeightView, threads: usize) -> usize {
    let align = match w.format {
        WeightFormat::Fp8E4m3 { block } => block[0],
        _ => 16,
    };
    let per_thread = w.rows.div_ceil(threads.max(1) * 4);
    per_thread.div_ceil(align).max(1) * align
}

/// Reusable buffers: the BF16 copy of the input and per-task outputs.
#[derive(Default)]
pub struct LinearScratch {
    x: Vec<u16>,
    tiles: Vec<f32>,
}

/// `out[i, r] = Σ_c W[r, c] · bf16(x[i, c])` for `n` rows of `x` (`[n, cols]`),
/// with F32 accumulation; `out` is `[n, rows]`.
pub fn par_matmul(pool: &ThreadPool, isa: Isa, w: &WeightView, x: &[f32], n: usize, out: &mut [f32], scratch: &mut LinearScratch) {
    assert_eq!(x.len(), n * w.cols, "par_matmul: input is not [n, cols]");
    assert_eq!(out.len(), n * w.rows, "par_matmul: output is not [n, rows]");
    scratch.x.resize(x.len(), 0);
    f32_to_bf16(isa, x, &mut scratch.x);
    let xb = &scratch.x;
    let tile = tile_rows(w, pool.threads());
    if n == 1 {
        // One token: each tile's output is already contiguous in `out`.
        let out = SharedSlice::new(out);
        pool.parallel_for(w.rows.div_ceil(tile), &|t| {
            let (r0, r1) = (t * tile, ((t + 1) * tile).min(w.rows));
            // SAFETY: rows r0..r1 are written by this task only.
            matmul_bf16(isa, w, r0..r1, xb, 1, unsafe { out.slice_mut(r0, r1 - r0) });
        });
        return;
    }
    // Several tokens: tiles are computed into their own buffers, then
    // scattered into the token-major output.
    let n_tiles = w.rows.div_ceil(tile);
    scratch.tiles.resize(n_tiles * tile * n, 0.0);
    let tiles = SharedSlice::new(&mut scratch.tiles);
    let out = SharedSlice::new(out);
    pool.parallel_for(n_tiles, &|t| {
        let (r0, r1) = (t * tile, ((t + 1) * tile).min(w.rows));
        let m = r1 - r0;
        // SAFETY: tile t's buffer is this task's alone.
        let buf = unsafe { tiles.slice_mut(t * tile * n, m * n) };
        matmul_bf16(isa, w, r0..r1, xb, n, buf);
        for i in 0..n {
            // SAFETY: rows r0..r1 of every token row are written by this task only.
            unsafe { out.slice_mut(i * w.rows + r0, m) }.copy_from_slice(&buf[i * m..(i + 1) * m]);
        }
    });
}
