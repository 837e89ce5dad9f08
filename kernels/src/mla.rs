//! MLA attention: decode in the absorbed form over a paged latent cache, and
//! prefill in the expanded form.
//!
//! With `kv_b_proj` folded into the query and the output, every head attends
//! directly over the cached latents `c_t` (shared by all heads) and the
//! rotated shared key `k_pe_t`:
//! `out_h = Σ_t softmax_t(scale · (q_latent_h · c_t + q_pe_h · k_pe_t)) · c_t`.

use crate::cpu::elementwise::softmax;
use crate::elementwise::SoftmaxStats;
use crate::cpu::convert::f32_to_bf16;
use crate::cpu::gemv::{axpy_f32, matmul_bf16};
use crate::cpu::vector::{dots_16, LaneSoftmax, weighted_sum_16, QUERY_LANES};
use crate::cpu::vector_pairs::{dots_16_pairs, pack_pairs, pack_row_pairs, weighted_sum_16_pairs};
use crate::cpu::pairs_amx::{self, dots_16_tiles, weighted_sum_16_tiles};
#[cfg(target_arch = "x86_64")]
use crate::cpu::amx::HardwareTiles;
use crate::cpu::amx::{ModelTiles, Tiles};
use crate::cpu::isa::Isa;
use crate::pool::ThreadPool;
use crate::shared::SharedSlice;
use crate::{Precision, WeightFormat, WeightView};

thread_local! {
    /// A decode attention task's block on BF16 pairs (its keys,
    /// probabilities and latents), kept across tasks and calls.
    static PAIRS: std::cell::RefCell<Vec<u32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// MLA head shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MlaDims {
    pub heads: usize,
    /// Per-head query/key width without the rotary part.
    pub dn: usize,
    /// Rotary width.
    pub dr: usize,
    /// Per-head value width.
    pub dv: usize,
    /// Latent (kv_lora) width.
    pub dc: usize,
}

/// The cache of one layer: blocks of `block_size` entries of `[c (dc), k_pe (dr)]`.
#[derive(Clone, Copy)]
pub struct LatentCache<'a> {
    pub blocks: &'a [&'a [f32]],
    pub block_size: usize,
    pub dc: usize,
    pub dr: usize,
}

impl LatentCache<'_> {
    #[inline]
    fn entry(&self, t: usize) -> &[f32] {
        let e = self.dc + self.dr;
        let off = (t % self.block_size) * e;
        &self.blocks[t / self.block_size][off..off + e]
    }
}

/// Attend one query token (all heads) over positions `0..ctx`.
/// `q_latent` is `[heads, dc]`, `q_pe` is `[heads, dr]`; `out` is `[heads, dc]`.
/// `scratch` is reused across calls and grown as needed.
///
/// The products run in f32, on BF16 pairs where `vdpbf16ps` exists, or on
/// AMX BF16 tiles where those are usable ([`pairs_amx::usable`]).
#[allow(clippy::too_many_arguments)]
pub fn decode_attention(
    pool: &ThreadPool,
    isa: Isa,
    cache: LatentCache,
    ctx: usize,
    q_latent: &[f32],
    q_pe: &[f32],
    scale: f32,
    scratch: &mut Vec<f32>,
    out: &mut [f32],
) {
    #[cfg(target_arch = "x86_64")]
    if matches!(isa.usable(), Isa::Avx512Bf16 | Isa::Avx512Fp16) && pairs_amx::usable() {
        let unit = || HardwareTiles::for_bf16().expect("`pairs_amx::usable` found the BF16 tiles permitted");
        return decode_attention_on(pool, isa, Some(unit as fn() -> HardwareTiles), cache, ctx, q_latent, q_pe, scale, scratch, out);
    }
    decode_attention_on(pool, isa, None::<fn() -> ModelTiles>, cache, ctx, q_latent, q_pe, scale, scratch, out)
}

/// [`decode_attention`], with the pairs' products on the tiles that
/// `tiles` makes (one unit a task: the tile state is a thread's) when given.
#[allow(clippy::too_many_arguments)]
fn decode_attention_on<T: Tiles>(
    pool: &ThreadPool,
    isa: Isa,
    tiles: Option<fn() -> T>,
    cache: LatentCache,
    ctx: usize,
    q_latent: &[f32],
    q_pe: &[f32],
    scale: f32,
    scratch: &mut Vec<f32>,
    out: &mut [f32],
) {
    let (dc, dr) = (cache.dc, cache.dr);
    let heads = q_latent.len() / dc;
    assert_eq!(q_pe.len(), heads * dr, "decode_attention: q_pe shape");
    assert_eq!(out.len(), heads * dc, "decode_attention: out shape");
    // Split-K over positions (flash-decoding), in one parallel region: each
    // task takes a part of the positions for a set of groups of sixteen
    // heads (one SIMD lane each). It walks its part in blocks that stay in
    // cache, and for each group: the block's scores (`dots_16`, over the
    // queries transposed), the online softmax on those [position][head]
    // scores, then the latents weighted for the group (`weighted_sum_16`,
    // on the same layout). Every cached entry is read from memory once per
    // task; no scores are scattered or transposed. The parts' contexts are
    // then combined with their softmax statistics.
    //
    // Where `vdpbf16ps` exists the products run on BF16 pairs instead
    // (`vector_pairs`: twice the multiply-adds per instruction; or on
    // tiles, `pairs_amx`, in the same layouts), each block's entries packed
    // into pairs once for the task's groups. The queries and entries are
    // BF16 values on the BF16 path, so only the summation order differs;
    // the probabilities that weigh the latents are rounded to BF16 on every
    // level (as a BF16 model's attention rounds them before its product
    // with the values), so that every level computes the same values.
    let de = dc + dr;
    const L: usize = QUERY_LANES;
    let groups = heads.div_ceil(L);
    let pairs = tiles.is_some() || matches!(isa.usable(), Isa::Avx512Bf16 | Isa::Avx512Fp16);
    // Parts whose length depends on the context alone, not on the threads:
    // the result then does not depend on the pool's size (a server's worker
    // and `duplex generate` agree bit for bit), and the pool balances the
    // parts dynamically. 128 positions, or longer past 8192 positions so
    // that there are at most 64 parts: their contexts (the scratch) stay
    // bounded at long contexts (17 MB for V3's 128 heads).
    const MIN_PART: usize = 128;
    const MAX_PARTS: usize = 64;
    let part = MIN_PART.max(ctx.div_ceil(MAX_PARTS));
    let parts = ctx.div_ceil(part);
    let range = |c: usize| c * part..((c + 1) * part).min(ctx);
    // Scratch: the transposed queries, `[groups][de][L]` with lane l of
    // group j holding head `L·j + l` (zero past the last head), then the
    // parts' contexts `[parts][heads][dc]`. On pairs the queries are
    // `[groups][de / 2][L]` pairs, beside the scratch.
    let (queries_len, partial_len) = (if pairs { 0 } else { groups * de * L }, parts * heads * dc);
    if scratch.len() < queries_len + partial_len {
        scratch.resize(queries_len + partial_len, 0.0);
    }
    let (queries_t, partial) = scratch[..queries_len + partial_len].split_at_mut(queries_len);
    queries_t.fill(0.0);
    let dp = de.div_ceil(2);
    let mut query_pairs = vec![0u32; if pairs { groups * dp * L } else { 0 }];
    // Head h's query `[q_latent | q_pe]`, and its pairs (the last one
    // completed with zero).
    let (mut query, mut pairs_of_query) = (vec![0.0f32; de], vec![0u32; dp]);
    for h in 0..heads {
        let (j, l) = (h / L, h % L);
        query[..dc].copy_from_slice(&q_latent[h * dc..(h + 1) * dc]);
        query[dc..].copy_from_slice(&q_pe[h * dr..(h + 1) * dr]);
        if pairs {
            pack_pairs(isa, &query, &mut pairs_of_query);
            for (i, &p) in pairs_of_query.iter().enumerate() {
                query_pairs[(j * dp + i) * L + l] = p;
            }
        } else {
            for (k, &v) in query.iter().enumerate() {
                queries_t[(j * de + k) * L + l] = v;
            }
        }
    }
    let queries_t = &*queries_t;
    let zeros = vec![0.0f32; dc.max(L)];
    let mut stats = vec![SoftmaxStats { max: f32::NEG_INFINITY, sum: 0.0 }; parts * heads];
    // A task takes a part for a set of groups. In f32 every group is a set
    // of its own; on pairs a block's entries are packed once for a whole
    // set (DeepSeek-V3's 128 heads are eight groups), so the sets are as
    // large as leaves two tasks a thread. Which task computes a group
    // changes no operation on it, so the bits do not depend on the pool.
    let per_set = if pairs { groups.div_ceil((2 * pool.threads()).div_ceil(parts).clamp(1, groups)) } else { 1 };
    let sets = groups.div_ceil(per_set);
    let lanes = |j: usize| (heads - j * L).min(L);
    {
        let (partial, stats) = (SharedSlice::new(partial), SharedSlice::new(&mut stats));
        pool.parallel_for(parts * sets, &|task| {
            let (c, s) = (task / sets, task % sets);
            let set = s * per_set..((s + 1) * per_set).min(groups);
            let (first, last) = (set.start * L, (set.end * L).min(heads));
            let entries: Vec<&[f32]> = range(c).map(|t| cache.entry(t)).collect();
            // SAFETY: task (c, s) writes only the contexts and statistics of
            // part c for heads first..last.
            let (ctx_out, part_stats) = unsafe { (partial.slice_mut((c * heads + first) * dc, (last - first) * dc), stats.slice_mut(c * heads + first, last - first)) };
            ctx_out.fill(0.0);
            // Group j's lanes of the contexts, and its softmax.
            let contexts = |j: usize| (j * L - first) * dc..(j * L - first + lanes(j)) * dc;
            let mut softmax = vec![LaneSoftmax::default(); set.len()];
            const BLOCK: usize = 32;
            let mut tile = [0.0f32; BLOCK * L];
            if pairs {
                let mut unit = tiles.map(|make| make());
                PAIRS.with_borrow_mut(|scratch| {
                    // A block's keys `[BLOCK][de / 2]`, then its latents and
                    // probabilities by pairs of positions, `[BLOCK / 2][dc]`
                    // and `[BLOCK / 2][L]`; an odd last position pairs with zeros.
                    scratch.resize(BLOCK * dp + BLOCK / 2 * (dc + L), 0);
                    let (keys, rest) = scratch.split_at_mut(BLOCK * dp);
                    let (latents, weights) = rest.split_at_mut(BLOCK / 2 * dc);
                    // The entries come from DRAM (the weights streamed since
                    // evict them): the scores of a block fetch the next
                    // block's entries meanwhile, and the part's last block
                    // those of the next part, which a thread takes next.
                    let following: Vec<&[f32]> = range(c + 1).take(BLOCK).map(|t| cache.entry(t)).collect();
                    let mut blocks = entries.chunks(BLOCK).peekable();
                    while let Some(block) = blocks.next() {
                        let (n, pairs_of) = (block.len(), block.len().div_ceil(2));
                        for (e, k) in block.iter().zip(keys.chunks_exact_mut(dp)) {
                            pack_pairs(isa, e, k);
                        }
                        for (i, lat) in latents.chunks_exact_mut(dc).take(pairs_of).enumerate() {
                            pack_row_pairs(isa, &block[2 * i][..dc], block.get(2 * i + 1).map_or(&zeros[..dc], |e| &e[..dc]), lat);
                        }
                        let ahead = blocks.peek().copied().unwrap_or(&following);
                        for j in set.clone() {
                            let tile = &mut tile[..n * L];
                            let ahead = if j == set.start { ahead } else { &[] };
                            let (queries, keys) = (&query_pairs[j * dp * L..(j + 1) * dp * L], &keys[..n * dp]);
                            match unit.as_mut() {
                                Some(unit) => dots_16_tiles(unit, queries, keys, tile),
                                None => dots_16_pairs(isa, queries, keys, ahead, tile),
                            }
                            let ctx_out = &mut ctx_out[contexts(j)];
                            softmax[j - set.start].block(isa, tile, scale, ctx_out, dc, lanes(j));
                            for (i, w) in weights.chunks_exact_mut(L).take(pairs_of).enumerate() {
                                pack_row_pairs(isa, &tile[2 * i * L..][..L], tile.get((2 * i + 1) * L..(2 * i + 2) * L).unwrap_or(&zeros[..L]), w);
                            }
                            let (weights, latents) = (&weights[..pairs_of * L], &latents[..pairs_of * dc]);
                            match unit.as_mut() {
                                Some(unit) => weighted_sum_16_tiles(unit, weights, latents, ctx_out, dc),
                                None => weighted_sum_16_pairs(isa, weights, latents, ctx_out, dc),
                            }
                        }
                    }
                });
            } else {
                let latents: Vec<&[f32]> = entries.iter().map(|e| &e[..dc]).collect();
                for b0 in (0..entries.len()).step_by(BLOCK) {
                    let b1 = (b0 + BLOCK).min(entries.len());
                    for j in set.clone() {
                        let tile = &mut tile[..(b1 - b0) * L];
                        dots_16(isa, &queries_t[j * de * L..(j + 1) * de * L], &entries[b0..b1], tile);
                        let ctx_out = &mut ctx_out[contexts(j)];
                        softmax[j - set.start].block(isa, tile, scale, ctx_out, dc, lanes(j));
                        crate::round_bf16_slice(tile);
                        weighted_sum_16(isa, tile, &latents[b0..b1], ctx_out, dc);
                    }
                }
            }
            // Normalise the part's contexts by their own sums.
            let heads_of = set.clone().flat_map(|j| (0..lanes(j)).map(move |l| (j - set.start, l)));
            for ((g, l), (ctx, st)) in heads_of.zip(ctx_out.chunks_exact_mut(dc).zip(part_stats.iter_mut())) {
                let (max, sum) = (softmax[g].max[l], softmax[g].sum[l]);
                let inv = 1.0 / sum;
                ctx.iter_mut().for_each(|v| *v *= inv);
                *st = SoftmaxStats { max, sum };
            }
        });
    }
    // out_h = Σ_c a_c · context_c,h / Σ_c a_c with a_c = sum_c · exp(max_c − max).
    for (h, o) in out.chunks_mut(dc).enumerate() {
        let max = (0..parts).map(|c| stats[c * heads + h].max).fold(f32::NEG_INFINITY, f32::max);
        let weights: Vec<f32> = (0..parts).map(|c| stats[c * heads + h]).map(|s| s.sum * (s.max - max).exp()).collect();
        let inv = 1.0 / weights.iter().sum::<f32>();
        o.fill(0.0);
        for (c, &a) in weights.iter().enumerate() {
            axpy_f32(isa, a * inv, &partial[(c * heads + h) * dc..(c * heads + h + 1) * dc], o);
        }
    }
}

/// MLA in the expanded (prefill) form: causal attention of `n` query rows
/// (`q`, `[n, heads·(dn+dr)]`, positions `start..start+n`) over `ctx =
/// start + n` positions, whose per-head keys and values `kv` (`[ctx,
/// heads·(dn+dv)]`) are `kv_b_proj` of the cached latents, and whose shared
/// rope key is columns `dc..` of `latents` (`[ctx, dc+dr]`). `out` (`[n,
/// heads·dv]`, zeroed by the caller) is rounded to BF16 on that path. One
/// task per head.
///
/// F32 is the scalar reference. On the BF16 path the queries and keys are
/// BF16 values already (every activation is rounded), so the scores of a
/// block of queries against all the keys it may see are one BF16 GEMM on the
/// `vdpbf16ps` kernels, exact products summed in F32, instead of a dot
/// product and a horizontal sum per (query, key) pair.
#[allow(clippy::too_many_arguments)]
pub fn prefill_attention(pool: &ThreadPool, isa: Isa, q: &[f32], kv: &[f32], latents: &[f32], out: &mut [f32], start: usize, d: MlaDims, scale: f32, p: Precision) {
    match p {
        Precision::F32 => prefill_attention_f32(pool, q, kv, latents, out, start, d, scale),
        Precision::Bf16 => prefill_attention_bf16(pool, isa, q, kv, latents, out, start, d, scale),
    }
}

#[allow(clippy::too_many_arguments)]
fn prefill_attention_f32(pool: &ThreadPool, q: &[f32], kv: &[f32], latents: &[f32], out: &mut [f32], start: usize, d: MlaDims, scale: f32) {
    let (dq, dkv, de) = (d.dn + d.dr, d.dn + d.dv, d.dc + d.dr);
    let n = q.len() / (d.heads * dq);
    let ctx = start + n;
    let dot = crate::linear::dot;
    let out = SharedSlice::new(out);
    pool.parallel_for(d.heads, &|h| {
        let mut scores = vec![0.0f32; ctx];
        for i in 0..n {
            let pos = start + i;
            let qh = &q[(i * d.heads + h) * dq..(i * d.heads + h + 1) * dq];
            for (t, s) in scores[..=pos].iter_mut().enumerate() {
                let k_nope = &kv[t * d.heads * dkv + h * dkv..][..d.dn];
                let k_pe = &latents[t * de + d.dc..(t + 1) * de];
                *s = (dot(&qh[..d.dn], k_nope) + dot(&qh[d.dn..], k_pe)) * scale;
            }
            crate::elementwise::softmax(&mut scores[..=pos]);
            // SAFETY: head h of token i is written by this task only.
            let o = unsafe { out.slice_mut((i * d.heads + h) * d.dv, d.dv) };
            for (t, &w) in scores[..=pos].iter().enumerate() {
                let v = &kv[t * d.heads * dkv + h * dkv + d.dn..][..d.dv];
                o.iter_mut().zip(v).for_each(|(a, b)| *a += w * b);
            }
        }
    });
}

/// Query rows per score GEMM: enough to amortise each key's decode, few
/// enough that the block's scores stay in L2 at long contexts.
const QUERY_BLOCK: usize = 32;

#[allow(clippy::too_many_arguments)]
fn prefill_attention_bf16(pool: &ThreadPool, isa: Isa, q: &[f32], kv: &[f32], latents: &[f32], out: &mut [f32], start: usize, d: MlaDims, scale: f32) {
    let (dq, dkv, de) = (d.dn + d.dr, d.dn + d.dv, d.dc + d.dr);
    let n = q.len() / (d.heads * dq);
    let ctx = start + n;
    let out = SharedSlice::new(out);
    let grouped = matches!(isa.usable(), Isa::Avx512 | Isa::Avx512Bf16 | Isa::Avx512Fp16);
    pool.parallel_for(d.heads, &|h| {
        // This head's keys [ctx, dn + dr] and queries [n, dn + dr] in BF16.
        let mut key = vec![0u16; dq];
        let mut keys = Vec::with_capacity(ctx * dq * 2);
        for t in 0..ctx {
            f32_to_bf16(isa, &kv[t * d.heads * dkv + h * dkv..][..d.dn], &mut key[..d.dn]);
            f32_to_bf16(isa, &latents[t * de + d.dc..(t + 1) * de], &mut key[d.dn..]);
            keys.extend(key.iter().flat_map(|k| k.to_le_bytes()));
        }
        let keys = WeightView { rows: ctx, cols: dq, format: WeightFormat::Bf16, data: &keys, scales: &[] };
        let mut queries = vec![0u16; n * dq];
        for (i, row) in queries.chunks_mut(dq).enumerate() {
            f32_to_bf16(isa, &q[(i * d.heads + h) * dq..(i * d.heads + h + 1) * dq], row);
        }
        let values: Vec<&[f32]> = (0..ctx).map(|t| &kv[t * d.heads * dkv + h * dkv + d.dn..][..d.dv]).collect();
        let mut weights_t = Vec::new();
        let mut weighed = vec![0.0f32; QUERY_BLOCK.min(n) * d.dv];
        let mut scores = vec![0.0f32; QUERY_BLOCK.min(n) * ctx];
        for i0 in (0..n).step_by(QUERY_BLOCK) {
            let i1 = (i0 + QUERY_BLOCK).min(n);
            // The keys the block's last query may see; earlier rows mask the rest.
            let seen = start + i1;
            let block = &mut scores[..(i1 - i0) * seen];
            matmul_bf16(isa, &keys, 0..seen, &queries[i0 * dq..i1 * dq], i1 - i0, block);
            for (i, row) in (i0..i1).zip(block.chunks_mut(seen)) {
                let row = &mut row[..=start + i];
                row.iter_mut().for_each(|s| *s *= scale);
                softmax(isa, row);
            }
            let weighed = &mut weighed[..(i1 - i0) * d.dv];
            weigh_values(isa, grouped, block, start + i0, &values, &mut weights_t, weighed);
            for (i, w) in (i0..i1).zip(weighed.chunks_exact(d.dv)) {
                // SAFETY: head h of token i is written by this task only.
                let o = unsafe { out.slice_mut((i * d.heads + h) * d.dv, d.dv) };
                o.copy_from_slice(w);
                crate::round_bf16_slice(o);
            }
        }
    });
}

/// The weighted values of a block of queries: row i of `out` (`[rows,
/// width]`) is Σ_t p_it · v_t over the keys t ≤ `first` + i, where row i
/// of `probs` holds query i's probabilities p_i· (rows of equal stride,
/// at least `first` + rows long) and `values` the keys' value vectors.
///
/// Query by query (`axpy` per key) reads every value vector once per
/// query: a 2048-token prompt's values are 1 MB a head, past L2. When
/// `grouped` (where `weighted_sum_16` is vectorised), sixteen queries at a
/// time share one pass over the keys they all see, each value vector
/// feeding sixteen FMAs, and only the keys of the group's causal triangle
/// go query by query. Each output adds its keys' products in key order
/// with a fused multiply-add either way: the same bits. `weights_t` holds
/// a group's probabilities transposed (`[keys][16]`).
fn weigh_values(isa: Isa, grouped: bool, probs: &[f32], first: usize, values: &[&[f32]], weights_t: &mut Vec<f32>, out: &mut [f32]) {
    const L: usize = QUERY_LANES;
    let width = values.first().map_or(0, |v| v.len());
    if width == 0 {
        return;
    }
    let rows = out.len() / width;
    let stride = probs.len() / rows.max(1);
    let step = if grouped { L } else { 1 };
    for g0 in (0..rows).step_by(step) {
        let g1 = (g0 + step).min(rows);
        let sums = &mut out[g0 * width..g1 * width];
        sums.fill(0.0);
        // The keys every query of the group sees.
        let common = if grouped { first + g0 + 1 } else { 0 };
        if grouped {
            if weights_t.len() < common * L {
                weights_t.resize(common * L, 0.0);
            }
            for t in 0..common {
                for (l, w) in weights_t[t * L..t * L + g1 - g0].iter_mut().enumerate() {
                    *w = probs[(g0 + l) * stride + t];
                }
            }
            weighted_sum_16(isa, &weights_t[..common * L], &values[..common], sums, width);
        }
        for (i, o) in (g0..g1).zip(sums.chunks_exact_mut(width)) {
            let row = &probs[i * stride..];
            for t in common..=first + i {
                axpy_f32(isa, row[t], values[t], o);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pool::PoolConfig;

    #[test]
    fn matches_naive_attention() {
        // Head counts under, at and over one group of sixteen (a SIMD lane
        // each), part and block lengths on and off the 16-, 4- and 1-key
        // groups of the scores, latent widths on and off the 16-float
        // vectors of the weighted sums. 300 positions: three parts of
        // several blocks; 9000: 64 parts of 141 (parts grow past 8192
        // positions).
        for (heads, dc, dr, bs, ctx, threads) in [
            (3usize, 40usize, 8usize, 4usize, 11usize, 2usize),
            (8, 128, 16, 16, 70, 2),
            (5, 136, 8, 8, 9, 2),
            (4, 64, 8, 4, 5, 4),
            (2, 32, 8, 4, 1, 2),
            (4, 64, 8, 16, 300, 2),
            (16, 64, 8, 16, 45, 2),
            (21, 72, 8, 8, 40, 3),
            (4, 64, 8, 16, 9000, 2),
        ] {
            // BF16 values, as the BF16 path caches and queries.
            let bf = crate::round_bf16;
            let entries: Vec<f32> = (0..ctx.div_ceil(bs) * bs * (dc + dr)).map(|i| bf(((i * 13 % 29) as f32 - 14.0) / 14.0)).collect();
            let blocks: Vec<&[f32]> = entries.chunks(bs * (dc + dr)).rev().collect(); // any block order
            let cache = LatentCache { blocks: &blocks, block_size: bs, dc, dr };
            let ql: Vec<f32> = (0..heads * dc).map(|i| bf((i % 7) as f32 / 7.0 - 0.5)).collect();
            let qp: Vec<f32> = (0..heads * dr).map(|i| bf((i % 5) as f32 / 5.0 - 0.5)).collect();
            let pool = ThreadPool::new(&PoolConfig::single_node(threads));
            for isa in crate::cpu::isa::supported() {
                let mut out = vec![0.0; heads * dc];
                decode_attention(&pool, isa, cache, ctx, &ql, &qp, 0.3, &mut vec![], &mut out);
                for h in 0..heads {
                    let mut s: Vec<f32> = (0..ctx)
                        .map(|t| {
                            let e = cache.entry(t);
                            let a: f32 = (0..dc).map(|i| ql[h * dc + i] * e[i]).sum();
                            let b: f32 = (0..dr).map(|i| qp[h * dr + i] * e[dc + i]).sum();
                            (a + b) * 0.3
                        })
                        .collect();
                    crate::elementwise::softmax(&mut s);
                    // Each probability is rounded to BF16 (a relative error
                    // of at most 2⁻⁹) before it weighs the latents.
                    for i in 0..dc {
                        let want: f32 = (0..ctx).map(|t| s[t] * cache.entry(t)[i]).sum();
                        let bound = 2f32.powi(-8) * (0..ctx).map(|t| (s[t] * cache.entry(t)[i]).abs()).sum::<f32>() + 1e-6;
                        assert!((out[h * dc + i] - want).abs() <= bound, "{isa:?}, {heads} heads, ctx {ctx}: {} vs {want}", out[h * dc + i]);
                    }
                }
            }
        }
    }

    /// Every level rounds the same probabilities to BF16, whether its
    /// products run in f32, on BF16 pairs or on (the model of) AMX tiles:
    /// they agree within f32 rounding of their sums, far closer than a
    /// probability's rounding (2⁻⁹) would allow. Odd entry widths and
    /// odd-length parts and blocks complete their last pair with zeros;
    /// widths off the tiles' sixteen pairs and columns take partial tiles.
    #[test]
    fn levels_agree_within_summation_rounding() {
        for (heads, dc, dr, bs, ctx) in [(16usize, 64usize, 8usize, 16usize, 300usize), (5, 33, 4, 8, 37), (20, 48, 7, 4, 129), (3, 16, 8, 16, 1)] {
            let bf = |i: usize, m: usize, d: f32| crate::round_bf16(((i * m % 61) as f32 - 30.0) / d);
            let entries: Vec<f32> = (0..ctx.div_ceil(bs) * bs * (dc + dr)).map(|i| bf(i, 13, 20.0)).collect();
            let blocks: Vec<&[f32]> = entries.chunks(bs * (dc + dr)).collect();
            let cache = LatentCache { blocks: &blocks, block_size: bs, dc, dr };
            let ql: Vec<f32> = (0..heads * dc).map(|i| bf(i, 7, 60.0)).collect();
            let qp: Vec<f32> = (0..heads * dr).map(|i| bf(i, 11, 30.0)).collect();
            let pool = ThreadPool::new(&PoolConfig::single_node(2));
            let run = |isa: Isa| {
                let mut out = vec![0.0; heads * dc];
                decode_attention(&pool, isa, cache, ctx, &ql, &qp, 0.3, &mut vec![], &mut out);
                out
            };
            let portable = run(Isa::Portable);
            let max = entries.iter().fold(0f32, |m, e| m.max(e.abs()));
            let mut on_tiles = vec![0.0; heads * dc];
            decode_attention_on(&pool, Isa::Portable, Some(ModelTiles::default as fn() -> ModelTiles), cache, ctx, &ql, &qp, 0.3, &mut vec![], &mut on_tiles);
            let levels = crate::cpu::isa::supported().into_iter().map(|isa| (format!("{isa:?}"), run(isa)));
            for (level, got) in levels.chain([("model tiles".to_string(), on_tiles)]) {
                for (i, (g, w)) in got.iter().zip(&portable).enumerate() {
                    assert!((g - w).abs() <= 1e-5 * max, "{level}, {heads} heads, dc {dc}, dr {dr}, ctx {ctx}: output {i}: {g} vs {w}");
                }
            }
        }
    }

    /// Decode attention gives the same bits on pools of any size.
    #[test]
    fn decode_is_independent_of_the_thread_count() {
        // 40 heads: three groups, which pools of 1, 2 and 3 threads split
        // into sets differently on pairs.
        let (heads, dc, dr, bs, ctx) = (40usize, 64usize, 8usize, 16usize, 300usize);
        let entries: Vec<f32> = (0..ctx.div_ceil(bs) * bs * (dc + dr)).map(|i| ((i * 17 % 31) as f32 - 15.0) / 9.0).collect();
        let blocks: Vec<&[f32]> = entries.chunks(bs * (dc + dr)).collect();
        let cache = LatentCache { blocks: &blocks, block_size: bs, dc, dr };
        let ql: Vec<f32> = (0..heads * dc).map(|i| (i % 9) as f32 / 9.0 - 0.5).collect();
        let qp: Vec<f32> = (0..heads * dr).map(|i| (i % 5) as f32 / 5.0 - 0.5).collect();
        let isa = crate::cpu::isa::detect();
        let run = |threads: usize| {
            let pool = ThreadPool::new(&PoolConfig::single_node(threads));
            let mut out = vec![0.0; heads * dc];
            decode_attention(&pool, isa, cache, ctx, &ql, &qp, 0.3, &mut vec![], &mut out);
            out
        };
        let one = run(1);
        for threads in [2, 3, 5] {
            assert!(run(threads).iter().zip(&one).all(|(a, b)| a.to_bits() == b.to_bits()), "{threads} threads");
        }
    }

    /// BF16-valued prefill inputs: `n` queries, and keys, values and
    /// latents for `ctx` positions.
    fn prefill_inputs(d: MlaDims, ctx: usize, n: usize) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
        let bf = |i: usize, m: usize| crate::round_bf16(((i * m % 61) as f32 - 30.0) / 40.0);
        let q = (0..n * d.heads * (d.dn + d.dr)).map(|i| bf(i, 7)).collect();
        let kv = (0..ctx * d.heads * (d.dn + d.dv)).map(|i| bf(i, 11)).collect();
        let latents = (0..ctx * (d.dc + d.dr)).map(|i| bf(i, 13)).collect();
        (q, kv, latents)
    }

    /// The BF16 prefill path (score GEMMs on BF16 keys) against the scalar
    /// reference, on BF16-valued inputs, with a cached prefix and query
    /// blocks that end mid-way: within BF16 output rounding.
    #[test]
    fn prefill_bf16_matches_reference() {
        let d = MlaDims { heads: 3, dn: 16, dr: 8, dv: 12, dc: 20 };
        let (start, n) = (7, 45);
        let (q, kv, latents) = prefill_inputs(d, start + n, n);
        let pool = ThreadPool::new(&PoolConfig::single_node(2));
        let mut want = vec![0.0; n * d.heads * d.dv];
        prefill_attention(&pool, crate::cpu::isa::detect(), &q, &kv, &latents, &mut want, start, d, 0.3, Precision::F32);
        for isa in crate::cpu::isa::supported() {
            let mut got = vec![0.0; want.len()];
            prefill_attention(&pool, isa, &q, &kv, &latents, &mut got, start, d, 0.3, Precision::Bf16);
            for (g, w) in got.iter().zip(&want) {
                assert!((g - w).abs() <= 1e-2 * w.abs() + 1e-3, "{isa:?}: {g} vs {w}");
            }
        }
    }

    /// The grouped weighted values are query-by-query `axpy`'s bits, and
    /// within rounding of the sums: blocks under, at and over sixteen
    /// queries, prefixes short and long, widths on and off the 16-float
    /// vectors. Unrounded f32 inputs, so a product rounded apart from its
    /// sum would show.
    #[test]
    fn grouped_weighted_values_are_each_querys_bits() {
        let mut seed = 0x9e37_79b9u32;
        let mut next = move || {
            seed ^= seed << 13;
            seed ^= seed >> 17;
            seed ^= seed << 5;
            seed as f32 / u32::MAX as f32
        };
        for (rows, first, width) in [(1usize, 0usize, 16usize), (5, 3, 40), (16, 0, 128), (17, 9, 24), (32, 70, 128), (29, 1, 7)] {
            let stride = first + rows + 3;
            let probs: Vec<f32> = (0..rows * stride).map(|_| next()).collect();
            let vals: Vec<Vec<f32>> = (0..stride).map(|_| (0..width).map(|_| 4.0 * next() - 2.0).collect()).collect();
            let values: Vec<&[f32]> = vals.iter().map(|v| v.as_slice()).collect();
            for isa in crate::cpu::isa::supported() {
                let mut one_by_one = vec![0.0; rows * width];
                weigh_values(isa, false, &probs, first, &values, &mut Vec::new(), &mut one_by_one);
                let mut grouped = vec![f32::NAN; rows * width];
                weigh_values(isa, true, &probs, first, &values, &mut Vec::new(), &mut grouped);
                for (i, (g, o)) in grouped.chunks(width).zip(one_by_one.chunks(width)).enumerate() {
                    for (k, (g, o)) in g.iter().zip(o).enumerate() {
                        let want: f64 = (0..=first + i).map(|t| probs[i * stride + t] as f64 * vals[t][k] as f64).sum();
                        let bound = 1e-5 * (0..=first + i).map(|t| (probs[i * stride + t] * vals[t][k]).abs() as f64).sum::<f64>();
                        assert!((*o as f64 - want).abs() <= bound && (*g as f64 - want).abs() <= bound, "{isa:?}: query {i} element {k}: {o}, {g} vs {want}");
                        if matches!(isa.usable(), Isa::Avx512 | Isa::Avx512Bf16 | Isa::Avx512Fp16) {
                            assert_eq!(g.to_bits(), o.to_bits(), "{isa:?}: {rows} queries after {first}, query {i} element {k}");
                        }
                    }
                }
            }
        }
    }

    /// A prompt prefilled in two pieces gets the bits of one pass, on every
    /// level: each query's weighted values add their keys in order with the
    /// same operations, whichever group of sixteen queries it falls in and
    /// wherever its group's shared keys end.
    #[test]
    fn prefill_bf16_in_pieces_gives_the_same_bits() {
        let d = MlaDims { heads: 2, dn: 16, dr: 8, dv: 40, dc: 20 };
        let (start, n) = (7, 45);
        let (dq, dkv, de) = (d.dn + d.dr, d.dn + d.dv, d.dc + d.dr);
        let (q, kv, latents) = prefill_inputs(d, start + n, n);
        let pool = ThreadPool::new(&PoolConfig::single_node(2));
        for isa in crate::cpu::isa::supported() {
            let mut whole = vec![0.0; n * d.heads * d.dv];
            prefill_attention(&pool, isa, &q, &kv, &latents, &mut whole, start, d, 0.3, Precision::Bf16);
            for k in [5, 16, 21] {
                let mut first = vec![0.0; k * d.heads * d.dv];
                let c = start + k;
                prefill_attention(&pool, isa, &q[..k * d.heads * dq], &kv[..c * d.heads * dkv], &latents[..c * de], &mut first, start, d, 0.3, Precision::Bf16);
                let mut rest = vec![0.0; (n - k) * d.heads * d.dv];
                prefill_attention(&pool, isa, &q[k * d.heads * dq..], &kv, &latents, &mut rest, start + k, d, 0.3, Precision::Bf16);
                let differs = first.iter().chain(&rest).zip(&whole).position(|(a, b)| a.to_bits() != b.to_bits());
                assert_eq!(differs, None, "{isa:?}, split after {k}: first differing output");
            }
        }
    }
}
