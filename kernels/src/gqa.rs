//! Grouped-query attention (GQA) over a paged KV cache, as Qwen3-MoE and
//! Mixtral use it: `heads` query heads share `kv_heads` key/value heads,
//! query head `h` reading kv head `h / (heads / kv_heads)`. For every query
//! row and head, `out_h = Σ_t softmax_t(scale · q_h · k_t) · v_t`, causal.
//!
//! Three paths, picked by precision and row count:
//! - `F32`: the scalar reference, plain loops with f32 accumulation (what
//!   the F32 model path compares against transformers with).
//! - `Bf16`, one row (decode): split-K over positions with an online
//!   softmax, as MLA's `decode_attention`: each task takes a part of the
//!   positions for one kv head and up to sixteen of its query heads, so
//!   every cached entry is read once per kv head. A group narrower than
//!   sixteen spreads each head over several lanes (`dots_16_split`) and
//!   weighs the values for its heads alone, so no FMA lane idles; the
//!   scattered, cold entries are prefetched a block ahead.
//! - `Bf16`, several rows (prefill): per (block of rows, head), the scores
//!   are one BF16 GEMM against the kv head's keys (converted once per call),
//!   as MLA's `prefill_attention` takes them.
//!
//! Both BF16 paths compute in F32 on BF16-valued inputs and round the output
//! to BF16. No path's result depends on the pool's thread count.

use crate::cpu::convert::f32_to_bf16;
use crate::cpu::elementwise::softmax;
use crate::cpu::gemv::{axpy_f32, matmul_bf16};
use crate::cpu::isa::Isa;
use crate::cpu::vector::{dots_16_split, LaneSoftmax, prefetch, weighted_sum_16, QUERY_LANES};
use crate::pool::{thread_index, ThreadPool};
use crate::shared::SharedSlice;
use crate::{round_bf16_slice, Precision, WeightFormat, WeightView};

/// GQA head shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GqaDims {
    /// Query heads.
    pub heads: usize,
    /// Key/value heads; divides `heads`.
    pub kv_heads: usize,
    /// Width of every query, key and value head.
    pub head_dim: usize,
}

impl GqaDims {
    /// Why these dimensions are unusable, if they are.
    pub fn check(&self) -> Result<(), String> {
        if self.heads == 0 || self.kv_heads == 0 || self.head_dim == 0 || !self.heads.is_multiple_of(self.kv_heads) {
            return Err(format!("{self:?}: heads, kv_heads and head_dim must be positive, with kv_heads dividing heads"));
        }
        Ok(())
    }

    /// Query heads per key/value head.
    pub fn group(&self) -> usize {
        self.heads / self.kv_heads
    }
}

/// The KV cache of one layer: blocks of `block_size` entries, each entry
/// (one position) `[k (kv_heads·head_dim, head-major), v (same)]`.
#[derive(Clone, Copy)]
pub struct KvBlocks<'a> {
    pub blocks: &'a [&'a [f32]],
    pub block_size: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
}

impl KvBlocks<'_> {
    /// Floats per entry.
    pub fn entry_len(&self) -> usize {
        2 * self.kv_heads * self.head_dim
    }

    #[inline]
    fn entry(&self, t: usize) -> &[f32] {
        let e = self.entry_len();
        let off = (t % self.block_size) * e;
        &self.blocks[t / self.block_size][off..off + e]
    }

    /// Key of kv head `j` at position `t`.
    #[inline]
    fn key(&self, t: usize, j: usize) -> &[f32] {
        let hd = self.head_dim;
        &self.entry(t)[j * hd..(j + 1) * hd]
    }

    /// Value of kv head `j` at position `t`.
    #[inline]
    fn value(&self, t: usize, j: usize) -> &[f32] {
        let hd = self.head_dim;
        &self.entry(t)[(self.kv_heads + j) * hd..(self.kv_heads + j + 1) * hd]
    }
}

/// Causal GQA of `n` query rows, `q` (`[n, heads·head_dim]`) at positions
/// `start..start + n`, over the cache, which already holds those rows' keys
/// and values: row `i` attends to positions `0..=start + i`. Writes `out`
/// (`[n, heads·head_dim]`). `scratch` is reused across calls and grown as
/// needed; nothing else is allocated. Panics on inconsistent shapes (a
/// caller's bug), as the other kernels do.
#[allow(clippy::too_many_arguments)]
pub fn gqa_attention(pool: &ThreadPool, isa: Isa, q: &[f32], cache: KvBlocks, start: usize, dims: GqaDims, scale: f32, precision: Precision, scratch: &mut Vec<f32>, out: &mut [f32]) {
    if let Err(e) = dims.check() {
        panic!("gqa_attention: {e}");
    }
    let width = dims.heads * dims.head_dim;
    assert!(cache.kv_heads == dims.kv_heads && cache.head_dim == dims.head_dim, "gqa_attention: a cache of {} kv heads of {} for {dims:?}", cache.kv_heads, cache.head_dim);
    assert!(q.len().is_multiple_of(width), "gqa_attention: q is not [n, heads·head_dim]");
    assert_eq!(out.len(), q.len(), "gqa_attention: out is not shaped as q");
    let n = q.len() / width;
    if n == 0 {
        return;
    }
    let ctx = start + n;
    let (bs, e) = (cache.block_size, cache.entry_len());
    assert!(bs > 0 && cache.blocks.len() * bs >= ctx, "gqa_attention: {} blocks of {bs} cannot hold {ctx} positions", cache.blocks.len());
    for (b, block) in cache.blocks[..ctx.div_ceil(bs)].iter().enumerate() {
        let used = bs.min(ctx - b * bs) * e;
        assert!(block.len() >= used, "gqa_attention: block {b} has {} floats, {used} are needed", block.len());
    }
    match (precision, n) {
        (Precision::F32, _) => reference(pool, q, cache, start, dims, scale, scratch, out),
        (Precision::Bf16, 1) => decode_bf16(pool, isa, q, cache, ctx, dims, scale, scratch, out),
        (Precision::Bf16, _) => prefill_bf16(pool, isa, q, cache, start, dims, scale, scratch, out),
    }
}

/// `scratch[..len]`, grown if needed.
fn scratch_of(scratch: &mut Vec<f32>, len: usize) -> &mut [f32] {
    if scratch.len() < len {
        scratch.resize(len, 0.0);
    }
    &mut scratch[..len]
}

/// The scalar reference: one task per (row, head), each with its scores in
/// its thread's part of the scratch.
#[allow(clippy::too_many_arguments)]
fn reference(pool: &ThreadPool, q: &[f32], cache: KvBlocks, start: usize, dims: GqaDims, scale: f32, scratch: &mut Vec<f32>, out: &mut [f32]) {
    let (heads, hd, group) = (dims.heads, dims.head_dim, dims.group());
    let n = q.len() / (heads * hd);
    let ctx = start + n;
    let scores = SharedSlice::new(scratch_of(scratch, pool.threads() * ctx));
    let out = SharedSlice::new(out);
    pool.parallel_for(n * heads, &|task| {
        // Task `i · heads + h` is row i, head h: its query and output are
        // floats `task · hd..` of q and out.
        let (i, j) = (task / heads, task % heads / group);
        let qh = &q[task * hd..(task + 1) * hd];
        // SAFETY: a thread runs one task at a time, and this part of the
        // scratch is its own; the output of (i, h) is this task's alone.
        let (s, o) = unsafe { (scores.slice_mut(thread_index() * ctx, start + i + 1), out.slice_mut(task * hd, hd)) };
        for (t, s) in s.iter_mut().enumerate() {
            let mut acc = 0.0f32;
            for (a, b) in qh.iter().zip(cache.key(t, j)) {
                acc += a * b;
            }
            *s = acc * scale;
        }
        crate::elementwise::softmax(s);
        o.fill(0.0);
        for (t, &w) in s.iter().enumerate() {
            for (a, b) in o.iter_mut().zip(cache.value(t, j)) {
                *a += w * b;
            }
        }
    });
}

/// One query row (decode) on the BF16 path: split-K over positions.
#[allow(clippy::too_many_arguments)]
fn decode_bf16(pool: &ThreadPool, isa: Isa, q: &[f32], cache: KvBlocks, ctx: usize, dims: GqaDims, scale: f32, scratch: &mut Vec<f32>, out: &mut [f32]) {
    const L: usize = QUERY_LANES;
    let (heads, kv_heads, hd, group) = (dims.heads, dims.kv_heads, dims.head_dim, dims.group());
    // A unit is one kv head with up to sixteen of its query heads: the
    // lanes of the scores and of `weighted_sum_16`. Groups wider than
    // sixteen take several units (each reads the kv head's entries again).
    let lane_groups = group.div_ceil(L);
    let units = kv_heads * lane_groups;
    let first_head = |u: usize| (u / lane_groups) * group + (u % lane_groups) * L;
    let lanes_of = |u: usize| (group - (u % lane_groups) * L).min(L);
    // A group narrower than sixteen (Qwen3-MoE's and Llama's eight, Mixtral's
    // four) would leave lanes of every score FMA idle: instead each head
    // takes `sub` lanes, each summing every sub-th product of its dot
    // product (`dots_16_split`), so the vectors are full.
    let mut sub = L / lanes_of(0).next_power_of_two().min(L);
    while !hd.is_multiple_of(sub) {
        sub /= 2;
    }
    // Parts whose length depends on the context alone, not on the threads,
    // so that the result does not depend on the pool's size, as in
    // `mla::decode_attention`: 128 positions, or longer so that there are
    // at most 64 parts (bounding the scratch at long contexts).
    const MIN_PART: usize = 128;
    const MAX_PARTS: usize = 64;
    let part = MIN_PART.max(ctx.div_ceil(MAX_PARTS));
    let parts = ctx.div_ceil(part);
    // Scratch: the queries `[units][hd / sub][L]` (lane g · sub + s of step
    // p of unit u is element p · sub + s of head first_head(u) + g, zero
    // past its last head), the parts' contexts `[parts][heads][hd]` and
    // their softmax statistics `[parts][heads][max, sum]`.
    let (queries_len, partial_len, stats_len) = (units * hd / sub * L, parts * heads * hd, parts * heads * 2);
    let all = scratch_of(scratch, queries_len + partial_len + stats_len);
    let (queries_t, rest) = all.split_at_mut(queries_len);
    let (partial, stats) = rest.split_at_mut(partial_len);
    queries_t.fill(0.0);
    for u in 0..units {
        let unit = &mut queries_t[u * hd / sub * L..(u + 1) * hd / sub * L];
        for g in 0..lanes_of(u) {
            let h = first_head(u) + g;
            for (d, &v) in q[h * hd..(h + 1) * hd].iter().enumerate() {
                unit[d / sub * L + g * sub + d % sub] = v;
            }
        }
    }
    let queries_t = &*queries_t;
    {
        let (partial, stats) = (SharedSlice::new(&mut *partial), SharedSlice::new(&mut *stats));
        pool.parallel_for(parts * units, &|task| {
            let (c, u) = (task / units, task % units);
            let (j, first, lanes) = (u / lane_groups, first_head(u), lanes_of(u));
            let positions = c * part..((c + 1) * part).min(ctx);
            // SAFETY: task (c, u) writes only the contexts and statistics
            // of part c for heads first..first + lanes.
            let (ctx_out, part_stats) = unsafe { (partial.slice_mut((c * heads + first) * hd, lanes * hd), stats.slice_mut((c * heads + first) * 2, lanes * 2)) };
            ctx_out.fill(0.0);
            let queries = &queries_t[u * hd / sub * L..(u + 1) * hd / sub * L];
            let mut softmax_state = LaneSoftmax::default();
            // Blocks of positions that stay in cache between the scores and
            // the weighted sum: both read the same entries. Eight: a block's
            // keys and values (8 KB per kv head of 128) with the next one's,
            // prefetched meanwhile, fit the L1 cache; sixteen or thirty-two
            // measured 15-20% slower cold (the prefetched block evicts the
            // current one's values before the weighted sum reads them).
            const BLOCK: usize = 8;
            let mut tile = [0.0f32; BLOCK * L];
            let mut keys = [&[] as &[f32]; BLOCK];
            let mut values = [&[] as &[f32]; BLOCK];
            let (key_at, value_at) = (j * hd, (kv_heads + j) * hd);
            // Position t's key and value: one division for both.
            let entry = |t: usize| {
                let entry = &cache.blocks[t / cache.block_size][(t % cache.block_size) * 2 * kv_heads * hd..];
                (&entry[key_at..key_at + hd], &entry[value_at..value_at + hd])
            };
            // The entries are scattered (blocks of a paged cache, and in them
            // one head of many) and cold (the weights streamed since evict
            // them), which the hardware prefetchers do not foresee: every
            // block's keys and values are asked for one block ahead, the
            // first block's at once. (Two blocks ahead, a hint to L2 only, or
            // the requests spread over the block's work measured no better.)
            let fetch = |t: usize| {
                if t < positions.end {
                    let (k, v) = entry(t);
                    prefetch(k);
                    prefetch(v);
                }
            };
            (positions.start..positions.end.min(positions.start + BLOCK)).for_each(fetch);
            for b0 in positions.clone().step_by(BLOCK) {
                let b1 = (b0 + BLOCK).min(positions.end);
                for (k, t) in (b0..b1).enumerate() {
                    (keys[k], values[k]) = entry(t);
                    fetch(t + BLOCK);
                }
                let tile = &mut tile[..(b1 - b0) * L];
                dots_16_split(isa, queries, sub, &keys[..b1 - b0], tile);
                softmax_state.block(isa, tile, scale, ctx_out, hd, lanes);
                weighted_sum_16(isa, tile, &values[..b1 - b0], ctx_out, hd);
            }
            // Normalise the part's contexts by their own sums.
            for (l, (ctx, st)) in ctx_out.chunks_exact_mut(hd).zip(part_stats.chunks_exact_mut(2)).enumerate() {
                let inv = 1.0 / softmax_state.sum[l];
                ctx.iter_mut().for_each(|v| *v *= inv);
                st.copy_from_slice(&[softmax_state.max[l], softmax_state.sum[l]]);
            }
        });
    }
    // out_h = Σ_c a_c · context_c,h / Σ_c a_c with a_c = sum_c · exp(max_c − max),
    // the parts combined in order, one task per head.
    let (partial, stats) = (&*partial, &*stats);
    let out = SharedSlice::new(out);
    pool.parallel_for(heads, &|h| {
        let stat = |c: usize| (stats[(c * heads + h) * 2], stats[(c * heads + h) * 2 + 1]);
        let max = (0..parts).map(|c| stat(c).0).fold(f32::NEG_INFINITY, f32::max);
        let weight = |c: usize| stat(c).1 * (stat(c).0 - max).exp();
        let inv = 1.0 / (0..parts).map(weight).sum::<f32>();
        // SAFETY: head h's output is this task's alone.
        let o = unsafe { out.slice_mut(h * hd, hd) };
        o.fill(0.0);
        for c in 0..parts {
            axpy_f32(isa, weight(c) * inv, &partial[(c * heads + h) * hd..(c * heads + h + 1) * hd], o);
        }
        round_bf16_slice(o);
    });
}

/// Query rows per score GEMM (as in `mla`): enough to amortise each key's
/// decode, few enough that the block's scores stay in L2 at long contexts.
const QUERY_BLOCK: usize = 32;
/// Positions per task when the keys are converted to BF16.
const KEY_CHUNK: usize = 256;

/// BF16 values stored in f32 scratch: two to a float.
fn bf16_words(words: &mut [f32]) -> &mut [u16] {
    // SAFETY: f32's alignment covers u16's, the length is the same bytes,
    // and every bit pattern is valid for both types.
    unsafe { std::slice::from_raw_parts_mut(words.as_mut_ptr().cast::<u16>(), words.len() * 2) }
}

/// Several query rows (prefill) on the BF16 path: per (block of rows,
/// head), the block's scores against every key it may see are one BF16
/// GEMM; then per row the softmax, and the weighted sums of the values.
///
/// On the AVX-512 levels the weighted sums of sixteen rows at a time are
/// one `weighted_sum_16` (each value vector loaded feeds sixteen FMAs)
/// instead of an `axpy` per (row, position): the same fused sums in the
/// same order, the positions a row may not see weighing an exact zero.
#[allow(clippy::too_many_arguments)]
fn prefill_bf16(pool: &ThreadPool, isa: Isa, q: &[f32], cache: KvBlocks, start: usize, dims: GqaDims, scale: f32, scratch: &mut Vec<f32>, out: &mut [f32]) {
    let (heads, kv_heads, hd, group) = (dims.heads, dims.kv_heads, dims.head_dim, dims.group());
    let n = q.len() / (heads * hd);
    let ctx = start + n;
    // Scratch: the keys in BF16, `[kv_heads][ctx][hd]` (a weight matrix of
    // ctx rows per kv head), then per thread the scores of a block of rows
    // `[rows][ctx]`, its queries in BF16 `[rows][hd]` and the weighted
    // sums of sixteen rows `[16][hd]`.
    const L: usize = QUERY_LANES;
    let rows = QUERY_BLOCK.min(n);
    let keys_len = (kv_heads * ctx * hd).div_ceil(2);
    let per_thread = rows * ctx + (rows * hd).div_ceil(2) + L * hd;
    let wide = isa.usable() >= Isa::Avx512;
    let all = scratch_of(scratch, keys_len + pool.threads() * per_thread);
    let (key_words, thread_words) = all.split_at_mut(keys_len);
    let keys = &mut bf16_words(key_words)[..kv_heads * ctx * hd];
    {
        let keys = SharedSlice::new(&mut *keys);
        let chunks = ctx.div_ceil(KEY_CHUNK);
        pool.parallel_for(kv_heads * chunks, &|task| {
            let (j, c) = (task / chunks, task % chunks);
            let ts = c * KEY_CHUNK..((c + 1) * KEY_CHUNK).min(ctx);
            // SAFETY: task (j, c) writes only kv head j's keys at positions ts.
            let dst = unsafe { keys.slice_mut((j * ctx + ts.start) * hd, ts.len() * hd) };
            for (t, key) in ts.zip(dst.chunks_exact_mut(hd)) {
                f32_to_bf16(isa, cache.key(t, j), key);
                // A weight's BF16 values are little-endian bytes.
                key.iter_mut().for_each(|k| *k = k.to_le());
            }
        });
    }
    // SAFETY: the u16s seen as their bytes (u8 needs no alignment).
    let key_bytes: &[u8] = unsafe { std::slice::from_raw_parts(keys.as_ptr().cast::<u8>(), keys.len() * 2) };
    let blocks = n.div_ceil(QUERY_BLOCK);
    let per = SharedSlice::new(thread_words);
    let out = SharedSlice::new(out);
    pool.parallel_for(blocks * heads, &|task| {
        // The last row blocks first: they see the most keys and take
        // longest, and the pool hands tasks out in order.
        let (b, h) = (blocks - 1 - task / heads, task % heads);
        let j = h / group;
        let (i0, i1) = (b * QUERY_BLOCK, ((b + 1) * QUERY_BLOCK).min(n));
        // The keys the block's last row may see; earlier rows mask the rest.
        let seen = start + i1;
        // SAFETY: a thread runs one task at a time, and this part of the
        // scratch is its own.
        let mine = unsafe { per.slice_mut(thread_index() * per_thread, per_thread) };
        let (scores, rest) = mine.split_at_mut(rows * ctx);
        let (query_words, sums) = rest.split_at_mut((rows * hd).div_ceil(2));
        let queries = &mut bf16_words(query_words)[..(i1 - i0) * hd];
        for (i, row) in (i0..i1).zip(queries.chunks_exact_mut(hd)) {
            f32_to_bf16(isa, &q[(i * heads + h) * hd..(i * heads + h + 1) * hd], row);
        }
        let keys = WeightView { rows: ctx, cols: hd, format: WeightFormat::Bf16, data: &key_bytes[j * ctx * hd * 2..(j + 1) * ctx * hd * 2], scales: &[] };
        let block = &mut scores[..(i1 - i0) * seen];
        matmul_bf16(isa, &keys, 0..seen, queries, i1 - i0, block);
        for (i, row) in (i0..i1).zip(block.chunks_mut(seen)) {
            let row = &mut row[..=start + i];
            row.iter_mut().for_each(|s| *s *= scale);
            softmax(isa, row);
        }
        let block = &*block;
        // SAFETY: head h of row i is written by this task only.
        let out_row = |i: usize| unsafe { out.slice_mut((i * heads + h) * hd, hd) };
        if !wide {
            for (i, row) in (i0..i1).zip(block.chunks(seen)) {
                let o = out_row(i);
                o.fill(0.0);
                for (t, &w) in row[..=start + i].iter().enumerate() {
                    axpy_f32(isa, w, cache.value(t, j), o);
                }
                round_bf16_slice(o);
            }
            return;
        }
        for r0 in (i0..i1).step_by(L) {
            let r1 = (r0 + L).min(i1);
            let sums = &mut sums[..(r1 - r0) * hd];
            sums.fill(0.0);
            // Positions in chunks: their weights transposed, `[position][row]`.
            const CHUNK: usize = 32;
            let mut values = [&[] as &[f32]; CHUNK];
            for c0 in (0..start + r1).step_by(CHUNK) {
                let c1 = (c0 + CHUNK).min(start + r1);
                let mut weights = [0.0f32; CHUNK * L];
                for (k, t) in (c0..c1).enumerate() {
                    values[k] = cache.value(t, j);
                    for i in r0.max(t.saturating_sub(start))..r1 {
                        weights[k * L + i - r0] = block[(i - i0) * seen + t];
                    }
                }
                weighted_sum_16(isa, &weights[..(c1 - c0) * L], &values[..c1 - c0], sums, hd);
            }
            for (i, sum) in (r0..r1).zip(sums.chunks_exact(hd)) {
                let o = out_row(i);
                o.copy_from_slice(sum);
                round_bf16_slice(o);
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pool::PoolConfig;
    use proptest::prelude::*;
    use std::sync::OnceLock;

    /// Pools of one and of three threads, shared by the tests.
    fn pools() -> &'static [ThreadPool; 2] {
        static POOLS: OnceLock<[ThreadPool; 2]> = OnceLock::new();
        POOLS.get_or_init(|| [ThreadPool::new(&PoolConfig::single_node(1)), ThreadPool::new(&PoolConfig::single_node(3))])
    }

    /// Reproducible inputs in [-1, 1), BF16-valued (the BF16 path's inputs are).
    struct Rng(u64);

    impl Rng {
        fn bf16s(&mut self, n: usize) -> Vec<f32> {
            (0..n)
                .map(|_| {
                    self.0 ^= self.0 << 13;
                    self.0 ^= self.0 >> 7;
                    self.0 ^= self.0 << 17;
                    crate::round_bf16((self.0 % 2001) as f32 / 1000.0 - 1.0)
                })
                .collect()
        }
    }

    /// A problem: queries and a cache of `start + n` entries.
    struct Case {
        dims: GqaDims,
        start: usize,
        n: usize,
        q: Vec<f32>,
        entries: Vec<f32>,
    }

    impl Case {
        fn new(dims: GqaDims, start: usize, n: usize, seed: u64) -> Self {
            let mut rng = Rng(seed | 1);
            let q = rng.bf16s(n * dims.heads * dims.head_dim);
            let entries = rng.bf16s((start + n) * 2 * dims.kv_heads * dims.head_dim);
            Case { dims, start, n, q, entries }
        }

        /// The cache in blocks of `bs` entries, the last block padded with
        /// NaN past the context (which must never be read).
        fn blocks(&self, bs: usize) -> Vec<Vec<f32>> {
            let e = 2 * self.dims.kv_heads * self.dims.head_dim;
            let mut blocks: Vec<Vec<f32>> = self.entries.chunks(bs * e).map(|c| c.to_vec()).collect();
            blocks.last_mut().unwrap().resize(bs * e, f32::NAN);
            blocks
        }

        fn run(&self, pool: &ThreadPool, isa: Isa, bs: usize, precision: Precision) -> Vec<f32> {
            let owned = self.blocks(bs);
            let blocks: Vec<&[f32]> = owned.iter().map(|b| b.as_slice()).collect();
            let cache = KvBlocks { blocks: &blocks, block_size: bs, kv_heads: self.dims.kv_heads, head_dim: self.dims.head_dim };
            let mut out = vec![f32::NAN; self.q.len()];
            gqa_attention(pool, isa, &self.q, cache, self.start, self.dims, 0.125, precision, &mut vec![], &mut out);
            out
        }

        /// Attention in f64 from the definition, on dense per-head keys and values.
        fn naive(&self) -> Vec<f64> {
            let GqaDims { heads, kv_heads, head_dim: hd } = self.dims;
            let e = 2 * kv_heads * hd;
            let mut out = vec![0.0; self.q.len()];
            for i in 0..self.n {
                for h in 0..heads {
                    let kvh = h / (heads / kv_heads);
                    let qh = &self.q[(i * heads + h) * hd..][..hd];
                    let s: Vec<f64> = (0..=self.start + i).map(|t| 0.125 * (0..hd).map(|d| qh[d] as f64 * self.entries[t * e + kvh * hd + d] as f64).sum::<f64>()).collect();
                    let m = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                    let z: f64 = s.iter().map(|x| (x - m).exp()).sum();
                    for d in 0..hd {
                        out[(i * heads + h) * hd + d] = s.iter().enumerate().map(|(t, x)| (x - m).exp() / z * self.entries[t * e + (kv_heads + kvh) * hd + d] as f64).sum();
                    }
                }
            }
            out
        }
    }

    fn bits(xs: &[f32]) -> Vec<u32> {
        xs.iter().map(|x| x.to_bits()).collect()
    }

    /// The BF16 path's output against the F32 reference: within BF16
    /// rounding of the output (half an ulp, 2⁻⁸ relative) plus f32
    /// summation noise (the values are below 1).
    fn close_to_reference(got: &[f32], want: &[f32]) -> bool {
        got.iter().zip(want).all(|(g, w)| (g - w).abs() <= w.abs() / 256.0 + 1e-5)
    }

    fn check(case: &Case, bs: usize) -> Result<(), TestCaseError> {
        let [one, three] = pools();
        let want = case.run(one, Isa::Portable, case.start + case.n, Precision::F32);
        for (g, w) in want.iter().zip(case.naive()) {
            prop_assert!((*g as f64 - w).abs() <= 1e-5, "reference {g} vs f64 {w}");
        }
        prop_assert_eq!(bits(&case.run(one, Isa::Portable, bs, Precision::F32)), bits(&want), "F32: paged vs one block");
        prop_assert_eq!(bits(&case.run(three, Isa::Portable, bs, Precision::F32)), bits(&want), "F32: 3 threads vs 1");
        for isa in crate::cpu::isa::supported() {
            let got = case.run(one, isa, case.start + case.n, Precision::Bf16);
            prop_assert!(got.iter().all(|&x| x == crate::round_bf16(x)), "{isa}: output not rounded to BF16");
            prop_assert!(close_to_reference(&got, &want), "{isa}: BF16 path off the reference:\n{got:?}\n{want:?}");
            prop_assert_eq!(bits(&case.run(one, isa, bs, Precision::Bf16)), bits(&got), "{}: paged vs one block", isa);
            prop_assert_eq!(bits(&case.run(three, isa, bs, Precision::Bf16)), bits(&got), "{}: 3 threads vs 1", isa);
        }
        Ok(())
    }

    fn divisors(h: usize) -> Vec<usize> {
        (1..=h).filter(|d| h.is_multiple_of(*d)).collect()
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        #[test]
        fn paths_agree(
            (heads, kv_heads) in (1usize..=16).prop_flat_map(|h| (Just(h), prop::sample::select(divisors(h)))),
            head_dim in prop::sample::select(vec![8usize, 16, 32, 64, 128]),
            block_size in 1usize..=32,
            start in 0usize..100,
            n in 1usize..=20,
            seed in any::<u64>(),
        ) {
            check(&Case::new(GqaDims { heads, kv_heads, head_dim }, start, n, seed), block_size)?;
        }
    }

    /// What the random shapes do not reach: decode over several parts
    /// (128 positions each, longer past 8192) and groups wider than
    /// sixteen lanes (two units per kv head); prefill over several row blocks.
    #[test]
    fn long_contexts_and_wide_groups() {
        for (heads, kv_heads, head_dim, start, n, bs) in [
            (8, 2, 64, 1000, 1, 16),
            (32, 1, 16, 300, 1, 7),
            (20, 1, 8, 129, 1, 32),
            (4, 4, 32, 9000, 1, 64),
            (6, 2, 16, 40, 70, 16),
            (34, 2, 8, 0, 33, 5),
        ] {
            let case = Case::new(GqaDims { heads, kv_heads, head_dim }, start, n, 7);
            check(&case, bs).unwrap_or_else(|e| panic!("{heads}/{kv_heads}×{head_dim}, start {start}, n {n}: {e}"));
        }
    }

    /// One key far above the rest takes all the weight, whatever the head
    /// mapping would otherwise blur: each query head reads its own kv head.
    #[test]
    fn heads_read_their_own_kv_head() {
        let dims = GqaDims { heads: 4, kv_heads: 2, head_dim: 8 };
        let ctx = 5;
        // kv head 0's key points up at position 1, kv head 1's at position 3;
        // every value is its position + 10 · its kv head.
        let mut entries = vec![0.0f32; ctx * 32];
        for t in 0..ctx {
            let e = &mut entries[t * 32..(t + 1) * 32];
            if t == 1 {
                e[..8].fill(8.0);
            }
            if t == 3 {
                e[8..16].fill(8.0);
            }
            e[16..24].fill(t as f32);
            e[24..32].fill(t as f32 + 10.0);
        }
        let blocks = [entries.as_slice()];
        let cache = KvBlocks { blocks: &blocks, block_size: ctx, kv_heads: 2, head_dim: 8 };
        // One row (decode) and two (prefill); every row sees positions 1 and 3.
        for (n, precision) in [(1, Precision::F32), (1, Precision::Bf16), (2, Precision::F32), (2, Precision::Bf16)] {
            let q = vec![1.0f32; n * 4 * 8];
            let mut out = vec![0.0; n * 32];
            gqa_attention(&pools()[1], crate::cpu::isa::detect(), &q, cache, ctx - n, dims, 1.0, precision, &mut vec![], &mut out);
            for (i, row) in out.chunks(32).enumerate() {
                for (h, want) in [(0, 1.0), (1, 1.0), (2, 13.0), (3, 13.0)] {
                    assert!(row[h * 8..(h + 1) * 8].iter().all(|&x| (x - want).abs() < 1e-3), "{n} rows, {precision:?}: row {i} head {h}: {:?}", &row[h * 8..(h + 1) * 8]);
                }
            }
        }
    }
}
