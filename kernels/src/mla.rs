//! MLA attention: decode in the absorbed form over a paged latent cache, and
//! prefill in the expanded form.
//!
//! With `kv_b_proj` folded into the query and the output, every head attends
//! directly over the cached latents `c_t` (shared by all heads) and the
//! rotated shared key `k_pe_t`:
//! `out_h = Σ_t softmax_t(scale · (q_latent_h · c_t + q_pe_h · k_pe_t)) · c_t`.

use crate::cpu::elementwise::softmax;
use crate::cpu::gemv::{axpy_f32, dot_f32};
use crate::cpu::isa::Isa;
use crate::pool::ThreadPool;
use crate::shared::SharedSlice;
use crate::Precision;

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
/// `scores` is scratch of at least `heads · ctx` floats.
#[allow(clippy::too_many_arguments)]
pub fn decode_attention(
    pool: &ThreadPool,
    isa: Isa,
    cache: LatentCache,
    ctx: usize,
    q_latent: &[f32],
    q_pe: &[f32],
    scale: f32,
    scores: &mut [f32],
    out: &mut [f32],
) {
    let (dc, dr) = (cache.dc, cache.dr);
    let heads = q_latent.len() / dc;
    assert_eq!(q_pe.len(), heads * dr, "decode_attention: q_pe shape");
    assert_eq!(out.len(), heads * dc, "decode_attention: out shape");
    assert!(scores.len() >= heads * ctx, "decode_attention: scores scratch too small");
    let scores = SharedSlice::new(scores);
    let out = SharedSlice::new(out);
    // Heads in contiguous groups, one group per thread: every cached entry
    // is then loaded once per thread and reused, from L1, by all of the
    // group's heads, instead of being streamed again for every head.
    let groups = pool.threads().min(heads).max(1);
    let per = heads.div_ceil(groups);
    pool.parallel_for(groups, &|g| {
        let heads = g * per..((g + 1) * per).min(heads);
        if heads.is_empty() {
            return;
        }
        // SAFETY: this group owns the scores and outputs of its heads.
        let s = unsafe { scores.slice_mut(heads.start * ctx, heads.len() * ctx) };
        let o = unsafe { out.slice_mut(heads.start * dc, heads.len() * dc) };
        for t in 0..ctx {
            let e = cache.entry(t);
            for (j, h) in heads.clone().enumerate() {
                let score = dot_f32(isa, &q_latent[h * dc..(h + 1) * dc], &e[..dc]) + dot_f32(isa, &q_pe[h * dr..(h + 1) * dr], &e[dc..]);
                s[j * ctx + t] = score * scale;
            }
        }
        s.chunks_mut(ctx).for_each(|s| softmax(isa, s));
        o.fill(0.0);
        for t in 0..ctx {
            let c = &cache.entry(t)[..dc];
            for (j, oh) in o.chunks_mut(dc).enumerate() {
                axpy_f32(isa, s[j * ctx + t], c, oh);
            }
        }
    });
}

/// MLA in the expanded (prefill) form: causal attention of `n` query rows
/// (`q`, `[n, heads·(dn+dr)]`, positions `start..start+n`) over `ctx =
/// start + n` positions, whose per-head keys and values `kv` (`[ctx,
/// heads·(dn+dv)]`) are `kv_b_proj` of the cached latents, and whose shared
/// rope key is columns `dc..` of `latents` (`[ctx, dc+dr]`). `out` (`[n,
/// heads·dv]`, zeroed by the caller) is rounded to BF16 on that path. F32
/// uses the scalar reference dot product and softmax; one task per head.
#[allow(clippy::too_many_arguments)]
pub fn prefill_attention(pool: &ThreadPool, isa: Isa, q: &[f32], kv: &[f32], latents: &[f32], out: &mut [f32], start: usize, d: MlaDims, scale: f32, p: Precision) {
    let (dq, dkv, de) = (d.dn + d.dr, d.dn + d.dv, d.dc + d.dr);
    let n = q.len() / (d.heads * dq);
    let ctx = start + n;
    let dot = |a: &[f32], b: &[f32]| if p == Precision::F32 { crate::linear::dot(a, b) } else { dot_f32(isa, a, b) };
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
            match p {
                Precision::F32 => crate::elementwise::softmax(&mut scores[..=pos]),
                Precision::Bf16 => softmax(isa, &mut scores[..=pos]),
            }
            // SAFETY: head h of token i is written by this task only.
            let o = unsafe { out.slice_mut((i * d.heads + h) * d.dv, d.dv) };
            for (t, &w) in scores[..=pos].iter().enumerate() {
                let v = &kv[t * d.heads * dkv + h * dkv + d.dn..][..d.dv];
                o.iter_mut().zip(v).for_each(|(a, b)| *a += w * b);
            }
            p.round(o);
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pool::PoolConfig;

    #[test]
    fn matches_naive_attention() {
        let (heads, dc, dr, bs, ctx): (usize, usize, usize, usize, usize) = (3, 40, 8, 4, 11);
        let entries: Vec<f32> = (0..ctx.div_ceil(bs) * bs * (dc + dr)).map(|i| ((i * 13 % 29) as f32 - 14.0) / 14.0).collect();
        let blocks: Vec<&[f32]> = entries.chunks(bs * (dc + dr)).rev().collect(); // any block order
        let cache = LatentCache { blocks: &blocks, block_size: bs, dc, dr };
        let ql: Vec<f32> = (0..heads * dc).map(|i| (i % 7) as f32 / 7.0 - 0.5).collect();
        let qp: Vec<f32> = (0..heads * dr).map(|i| (i % 5) as f32 / 5.0 - 0.5).collect();
        let pool = ThreadPool::new(&PoolConfig::single_node(2));
        for isa in crate::cpu::isa::supported() {
            let mut scores = vec![0.0; heads * ctx];
            let mut out = vec![0.0; heads * dc];
            decode_attention(&pool, isa, cache, ctx, &ql, &qp, 0.3, &mut scores, &mut out);
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
                for i in 0..dc {
                    let want: f32 = (0..ctx).map(|t| s[t] * cache.entry(t)[i]).sum();
                    assert!((out[h * dc + i] - want).abs() < 1e-5, "{isa:?}");
                }
            }
        }
    }
}
