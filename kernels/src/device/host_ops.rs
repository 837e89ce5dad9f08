//! The kernel set run on the CPU over an emulated device's memory: each op
//! calls the same kernels, with the same roundings, as the CPU engine, so
//! that a model staged on the emulated device computes what the CPU engine
//! computes.
//!
//! Activations are copied out of device memory into vectors and back, which
//! keeps aliasing questions out of the way; weights are read in place.
//!
//! Public for the simulator's functional mode, which computes with these
//! while it keeps its own clock.

use super::{DeviceError, DevicePtr, DeviceWeight, Matrix, Op, PagedKv};
use crate::cpu::{elementwise as simd, isa::Isa};
use crate::elementwise::{rms_norm, rope, silu_mul, softmax};
use crate::gqa::{gqa_attention, KvBlocks};
use crate::linear::{dot, matmul};
use crate::mla::{decode_attention, prefill_attention, LatentCache};
use crate::parallel_linear::{par_matmul, LinearScratch};
use crate::pool::ThreadPool;
use crate::router::{route, route_simd};
use crate::shared::SharedSlice;
use crate::{round_bf16_slice, Precision, WeightView};

/// An emulated device's memory: `len` bytes at `base`, addressed by offset.
pub struct Memory {
    base: *mut u8,
    len: usize,
    _owner: Box<[u8]>,
}

// SAFETY: the memory is plain bytes; which stream touches which bytes when
// is ordered by streams and events, exactly as on a GPU, and the copies in
// and out below never hand out references that outlive a call.
unsafe impl Send for Memory {}
unsafe impl Sync for Memory {}

impl Memory {
    /// `len` zeroed bytes (the OS commits pages only when touched).
    pub fn new(len: usize) -> Self {
        let mut owner = vec![0u8; len].into_boxed_slice();
        Memory { base: owner.as_mut_ptr(), len, _owner: owner }
    }

    fn check(&self, addr: u64, bytes: usize) -> Result<usize, DeviceError> {
        let start = usize::try_from(addr).map_err(|_| DeviceError::Invalid(format!("address {addr:#x}")))?;
        match start.checked_add(bytes) {
            Some(end) if end <= self.len => Ok(start),
            _ => Err(DeviceError::Invalid(format!("{bytes} bytes at {addr:#x} lie outside the device's {} bytes", self.len))),
        }
    }

    /// The bytes of `p`, for reading weights in place.
    pub fn bytes(&self, p: DevicePtr) -> Result<&[u8], DeviceError> {
        let start = self.check(p.addr, p.bytes)?;
        // SAFETY: in bounds (checked); see the Sync impl for ordering.
        Ok(unsafe { std::slice::from_raw_parts(self.base.add(start), p.bytes) })
    }

    pub fn write(&self, p: DevicePtr, src: &[u8]) -> Result<(), DeviceError> {
        if src.len() != p.bytes {
            return Err(DeviceError::Invalid(format!("copy of {} bytes into a {}-byte range", src.len(), p.bytes)));
        }
        let start = self.check(p.addr, p.bytes)?;
        // SAFETY: in bounds (checked); `src` is host memory, never device memory.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), self.base.add(start), src.len()) };
        Ok(())
    }

    fn f32s(&self, p: DevicePtr) -> Result<Vec<f32>, DeviceError> {
        Ok(self.bytes(p)?.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect())
    }

    fn u32s(&self, p: DevicePtr, n: usize) -> Result<Vec<u32>, DeviceError> {
        Ok(self.bytes(p.slice(0, n * 4)?)?.chunks_exact(4).map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect())
    }

    /// A matrix's floats, row by row.
    fn read(&self, m: &Matrix) -> Result<Vec<f32>, DeviceError> {
        let mut out = Vec::with_capacity(m.rows * m.cols);
        for r in 0..m.rows {
            let row = m.buf.slice((m.offset + r * m.stride) * 4, m.cols * 4)?;
            out.extend(self.bytes(row)?.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])));
        }
        Ok(out)
    }

    fn store(&self, m: &Matrix, xs: &[f32]) -> Result<(), DeviceError> {
        for (r, row) in xs.chunks(m.cols.max(1)).take(m.rows).enumerate() {
            let dst = m.buf.slice((m.offset + r * m.stride) * 4, m.cols * 4)?;
            let bytes: Vec<u8> = row.iter().flat_map(|x| x.to_le_bytes()).collect();
            self.write(dst, &bytes)?;
        }
        Ok(())
    }

    fn weight<'a>(&'a self, w: &DeviceWeight, scales: &'a [f32]) -> Result<WeightView<'a>, DeviceError> {
        Ok(WeightView { rows: w.rows, cols: w.cols, format: w.format, data: self.bytes(w.data)?, scales })
    }
}

/// What runs ops: the device's own threads and reusable buffers.
pub struct Executor {
    pub pool: ThreadPool,
    pub isa: Isa,
    linear: LinearScratch,
    attention: Vec<f32>,
}

impl Executor {
    pub fn new(pool: ThreadPool, isa: Isa) -> Self {
        Executor { pool, isa, linear: LinearScratch::default(), attention: Vec::new() }
    }

    /// `y = x · Wᵀ` ([`Op::Gemm`]).
    fn gemm(&mut self, mem: &Memory, w: &DeviceWeight, x: &Matrix, y: &Matrix, precision: Precision, round: bool) -> Result<(), DeviceError> {
        let scales = mem.f32s(w.scales)?;
        let view = mem.weight(w, &scales)?;
        let xs = mem.read(x)?;
        let mut out = vec![0.0; y.rows * y.cols];
        match precision {
            Precision::F32 => matmul(&view, &xs, x.rows, &mut out),
            Precision::Bf16 => par_matmul(&self.pool, self.isa, &view, &xs, x.rows, &mut out, &mut self.linear),
        }
        if round {
            round_bf16_slice(&mut out);
        }
        mem.store(y, &out)
    }

    /// Run one (validated) op. Fails only on what validation cannot see:
    /// index values out of range.
    pub fn run(&mut self, mem: &Memory, op: &Op) -> Result<(), DeviceError> {
        let isa = self.isa;
        match op {
            Op::Gemm { w, x, y, precision, round } => self.gemm(mem, w, x, y, *precision, *round),
            Op::GemmBatched { w, w_step, scales_step, x, x_rows, y, y_rows, count, precision, round } => {
                for b in 0..*count {
                    let w = w.shifted(b * w_step, b * scales_step);
                    let (x, y) = (x.rows(b * x_rows..b * x_rows + x.rows), y.rows(b * y_rows..b * y_rows + y.rows));
                    self.gemm(mem, &w, &x, &y, *precision, *round)?;
                }
                Ok(())
            }
            Op::RmsNorm { x, weight, out, eps, precision } => {
                let (xs, w) = (mem.read(x)?, mem.f32s(*weight)?);
                let mut ys = vec![0.0; xs.len()];
                for (o, xi) in ys.chunks_mut(x.cols).zip(xs.chunks(x.cols)) {
                    match precision {
                        Precision::F32 => rms_norm(xi, &w, *eps, o),
                        Precision::Bf16 => simd::rms_norm_bf16(isa, xi, &w, *eps, o),
                    }
                }
                mem.store(out, &ys)
            }
            Op::Rope { x, cos, sin, rows_per_position, interleaved, precision } => {
                let (mut xs, cos, sin, half) = (mem.read(x)?, mem.read(cos)?, mem.read(sin)?, x.cols / 2);
                for (r, row) in xs.chunks_mut(x.cols).enumerate() {
                    let p = r / rows_per_position;
                    let (c, s) = (&cos[p * half..(p + 1) * half], &sin[p * half..(p + 1) * half]);
                    match precision {
                        Precision::F32 => rope(row, c, s, *interleaved),
                        Precision::Bf16 => {
                            simd::rope(isa, row, c, s, *interleaved);
                            round_bf16_slice(row);
                        }
                    }
                }
                mem.store(x, &xs)
            }
            Op::SiluMul { gate, up, precision } => {
                let (mut g, u) = (mem.read(gate)?, mem.read(up)?);
                match precision {
                    Precision::F32 => silu_mul(&mut g, &u),
                    Precision::Bf16 => {
                        simd::silu_mul(isa, &mut g, &u);
                        round_bf16_slice(&mut g);
                    }
                }
                mem.store(gate, &g)
            }
            Op::Add { h, delta, precision } => {
                let (mut hs, d) = (mem.read(h)?, mem.read(delta)?);
                hs.iter_mut().zip(&d).for_each(|(a, b)| *a += b);
                precision.round(&mut hs);
                mem.store(h, &hs)
            }
            Op::RoundBf16 { x } => {
                let mut xs = mem.read(x)?;
                round_bf16_slice(&mut xs);
                mem.store(x, &xs)
            }
            Op::Zero { x } => mem.store(x, &vec![0.0; x.rows * x.cols]),
            Op::Route { logits, bias, params, ids, weights, precision } => {
                let xs = mem.read(logits)?;
                let bias = bias.map(|b| mem.f32s(b)).transpose()?;
                let (mut chosen, mut ws) = (Vec::with_capacity(logits.rows * params.top_k), Vec::with_capacity(logits.rows * params.top_k));
                for row in xs.chunks(logits.cols) {
                    let picked = match precision {
                        Precision::F32 => route(params, row, bias.as_deref()),
                        Precision::Bf16 => route_simd(isa, params, row, bias.as_deref()),
                    };
                    chosen.extend(picked.iter().map(|&(e, _)| e as u32));
                    ws.extend(picked.iter().map(|&(_, w)| w));
                }
                let bytes: Vec<u8> = chosen.iter().flat_map(|x| x.to_le_bytes()).collect();
                mem.write(ids.slice(0, bytes.len())?, &bytes)?;
                mem.store(weights, &ws)
            }
            Op::GatherRows { src, rows, count, dst } => {
                let idx = mem.u32s(*rows, *count)?;
                let mut out = Vec::with_capacity(count * src.cols);
                for &i in &idx {
                    let i = i as usize;
                    if i >= src.rows {
                        return Err(DeviceError::Invalid(format!("gather: row {i} of a {}-row matrix", src.rows)));
                    }
                    out.extend(mem.read(&src.rows(i..i + 1))?);
                }
                mem.store(&dst.rows(0..*count), &out)
            }
            Op::ScatterAddRows { src, rows, scales, count, dst } => {
                let idx = mem.u32s(*rows, *count)?;
                let s = mem.f32s(scales.slice(0, count * 4)?)?;
                let ys = mem.read(&src.rows(0..*count))?;
                for ((&i, &w), y) in idx.iter().zip(&s).zip(ys.chunks(src.cols)) {
                    let i = i as usize;
                    if i >= dst.rows {
                        return Err(DeviceError::Invalid(format!("scatter: row {i} of a {}-row matrix", dst.rows)));
                    }
                    let row = dst.rows(i..i + 1);
                    let mut d = mem.read(&row)?;
                    d.iter_mut().zip(y).for_each(|(a, b)| *a += w * b);
                    mem.store(&row, &d)?;
                }
                Ok(())
            }
            Op::Embedding { table, first_row, ids, count, out, precision } => {
                let scales = mem.f32s(table.scales)?;
                let view = mem.weight(table, &scales)?;
                let mut row = vec![0.0; table.cols];
                for (i, &id) in mem.u32s(*ids, *count)?.iter().enumerate() {
                    let Some(r) = (id as usize).checked_sub(*first_row).filter(|&r| r < table.rows) else { continue };
                    view.decode_row(r, &mut row);
                    precision.round(&mut row);
                    mem.store(&out.rows(i..i + 1), &row)?;
                }
                Ok(())
            }
            Op::MlaPrefill { q, kv, latents, out, start, dims, scale, precision } => {
                let (qs, kvs, lat) = (mem.read(q)?, mem.read(kv)?, mem.read(latents)?);
                let mut os = vec![0.0; out.rows * out.cols];
                prefill_attention(&self.pool, isa, &qs, &kvs, &lat, &mut os, *start, *dims, *scale, *precision);
                mem.store(out, &os)
            }
            Op::MlaDecode { q_latent, q_pe, latents, out, scale, precision } => {
                let (ql, qp, lat) = (mem.read(q_latent)?, mem.read(q_pe)?, mem.read(latents)?);
                let (heads, dc, dr, ctx) = (q_latent.rows, q_latent.cols, q_pe.cols, latents.rows);
                let mut os = vec![0.0; heads * dc];
                match precision {
                    Precision::F32 => {
                        let mut scores = vec![0.0; ctx];
                        for h in 0..heads {
                            for (t, s) in scores.iter_mut().enumerate() {
                                let e = &lat[t * (dc + dr)..(t + 1) * (dc + dr)];
                                *s = (dot(&ql[h * dc..(h + 1) * dc], &e[..dc]) + dot(&qp[h * dr..(h + 1) * dr], &e[dc..])) * scale;
                            }
                            softmax(&mut scores);
                            let o = &mut os[h * dc..(h + 1) * dc];
                            for (t, &w) in scores.iter().enumerate() {
                                o.iter_mut().zip(&lat[t * (dc + dr)..t * (dc + dr) + dc]).for_each(|(a, b)| *a += w * b);
                            }
                        }
                    }
                    Precision::Bf16 => {
                        let blocks = [lat.as_slice()];
                        let cache = LatentCache { blocks: &blocks, block_size: ctx, dc, dr };
                        let mut scores = vec![0.0; heads * ctx];
                        decode_attention(&self.pool, isa, cache, ctx, &ql, &qp, *scale, &mut scores, &mut os);
                    }
                }
                mem.store(out, &os)
            }
            Op::KvStore { entries, kv, table, blocks, layer, start } => {
                let rows = kv_rows(mem, kv, *table, *blocks, *layer, *start..start + entries.rows, "kv_store")?;
                // Plain copies: the entries are already what the cache holds.
                let xs = mem.read(entries)?;
                for (row, dst) in xs.chunks(kv.entry_dim).zip(rows) {
                    let bytes: Vec<u8> = row.iter().flat_map(|x| x.to_le_bytes()).collect();
                    mem.write(dst, &bytes)?;
                }
                Ok(())
            }
            Op::KvGather { kv, table, blocks, layer, out } => {
                let rows = kv_rows(mem, kv, *table, *blocks, *layer, 0..out.rows, "kv_gather")?;
                let mut xs = Vec::with_capacity(out.rows * out.cols);
                for src in rows {
                    xs.extend(mem.f32s(src)?);
                }
                mem.store(out, &xs)
            }
            Op::MlaPrefillPart { q, kv, latents, out, lse, start, key_start, dims: d, scale, precision } => {
                let (n, keys, heads) = (q.rows, kv.rows, d.heads);
                let (dq, dkv, de) = (d.dn + d.dr, d.dn + d.dv, d.dc + d.dr);
                let (mut qs, kvs, lat) = (mem.read(q)?, mem.read(kv)?, mem.read(latents)?);
                // Each head's keys `[keys][heads][k_nope | k_pe]`, gathered
                // once; BF16 rounds them and the queries (the score GEMM's
                // inputs on the CPU's BF16 path), never the values.
                let mut ks = Vec::with_capacity(keys * heads * dq);
                for t in 0..keys {
                    for h in 0..heads {
                        ks.extend_from_slice(&kvs[t * heads * dkv + h * dkv..][..d.dn]);
                        ks.extend_from_slice(&lat[t * de + d.dc..(t + 1) * de]);
                    }
                }
                if *precision == Precision::Bf16 {
                    round_bf16_slice(&mut qs);
                    round_bf16_slice(&mut ks);
                }
                let (mut os, mut ls) = (vec![0.0; n * heads * d.dv], vec![0.0; n * heads]);
                {
                    let (o_all, l_all) = (SharedSlice::new(&mut os), SharedSlice::new(&mut ls));
                    self.pool.parallel_for(n * heads, &|task| {
                        let (i, h) = (task / heads, task % heads);
                        let qh = &qs[task * dq..(task + 1) * dq];
                        // As MlaPrefill's F32 path: the two dot products, summed, scaled.
                        let mut scores: Vec<f32> = (0..seen(*start + i, *key_start, keys))
                            .map(|t| {
                                let k = &ks[(t * heads + h) * dq..(t * heads + h + 1) * dq];
                                (dot(&qh[..d.dn], &k[..d.dn]) + dot(&qh[d.dn..], &k[d.dn..])) * scale
                            })
                            .collect();
                        // SAFETY: row i, head h is this task's alone.
                        let (o, l) = unsafe { (o_all.slice_mut(task * d.dv, d.dv), l_all.slice_mut(task, 1)) };
                        l[0] = attend_part(&mut scores, |t| &kvs[t * heads * dkv + h * dkv + d.dn..][..d.dv], o);
                    });
                }
                mem.store(out, &os)?;
                mem.store(lse, &ls)
            }
            Op::GqaAttentionPart { q, k, v, out, lse, start, key_start, dims, scale, precision } => {
                let (n, keys, heads, hd, group) = (q.rows, k.rows, dims.heads, dims.head_dim, dims.group());
                let (mut qs, mut ks, vs) = (mem.read(q)?, mem.read(k)?, mem.read(v)?);
                // BF16 rounds the queries and keys, as GqaAttention's BF16 path does.
                if *precision == Precision::Bf16 {
                    round_bf16_slice(&mut qs);
                    round_bf16_slice(&mut ks);
                }
                let (mut os, mut ls) = (vec![0.0; n * heads * hd], vec![0.0; n * heads]);
                {
                    let (o_all, l_all) = (SharedSlice::new(&mut os), SharedSlice::new(&mut ls));
                    let kw = k.cols;
                    self.pool.parallel_for(n * heads, &|task| {
                        let (i, j) = (task / heads, task % heads / group);
                        let qh = &qs[task * hd..(task + 1) * hd];
                        // As GqaAttention's F32 reference: one sum in order, scaled.
                        let mut scores: Vec<f32> = (0..seen(*start + i, *key_start, keys))
                            .map(|t| {
                                let mut acc = 0.0f32;
                                for (a, b) in qh.iter().zip(&ks[t * kw + j * hd..t * kw + (j + 1) * hd]) {
                                    acc += a * b;
                                }
                                acc * scale
                            })
                            .collect();
                        // SAFETY: row i, head h is this task's alone.
                        let (o, l) = unsafe { (o_all.slice_mut(task * hd, hd), l_all.slice_mut(task, 1)) };
                        l[0] = attend_part(&mut scores, |t| &vs[t * kw + j * hd..t * kw + (j + 1) * hd], o);
                    });
                }
                mem.store(out, &os)?;
                mem.store(lse, &ls)
            }
            Op::AttentionMerge { out, lse, part, part_lse, heads } => {
                let (mut os, mut ls, ps, pls) = (mem.read(out)?, mem.read(lse)?, mem.read(part)?, mem.read(part_lse)?);
                let d = out.cols / heads;
                for (r, (l, &pl)) in ls.iter_mut().zip(&pls).enumerate() {
                    if let Some((a, b)) = merge_weights(l, pl) {
                        for (o, &p) in os[r * d..(r + 1) * d].iter_mut().zip(&ps[r * d..(r + 1) * d]) {
                            *o = merged(*o, p, a, b);
                        }
                    }
                }
                mem.store(out, &os)?;
                mem.store(lse, &ls)
            }
            Op::GqaAttention { q, k, v, out, start, dims, scale, precision } => {
                let (n, ctx) = (q.rows, start + q.rows);
                if n == 0 {
                    return Ok(());
                }
                let (qs, ks, vs) = (mem.read(q)?, mem.read(&k.rows(0..ctx))?, mem.read(&v.rows(0..ctx))?);
                // The cache layout gqa_attention reads: one block of `ctx`
                // entries `[k | v]`.
                let width = k.cols;
                let mut entries = Vec::with_capacity(ctx * 2 * width);
                for (kt, vt) in ks.chunks(width).zip(vs.chunks(width)) {
                    entries.extend_from_slice(kt);
                    entries.extend_from_slice(vt);
                }
                let blocks = [entries.as_slice()];
                let cache = KvBlocks { blocks: &blocks, block_size: ctx, kv_heads: dims.kv_heads, head_dim: dims.head_dim };
                let mut os = vec![0.0; n * q.cols];
                gqa_attention(&self.pool, isa, &qs, cache, *start, *dims, *scale, *precision, &mut self.attention, &mut os);
                mem.store(out, &os)
            }
        }
    }
}

/// Keys a query at position `query` sees among `keys` keys at positions
/// `key_start..`: those at positions up to its own (causal), as a count
/// from the first.
fn seen(query: usize, key_start: usize, keys: usize) -> usize {
    (query + 1).saturating_sub(key_start).min(keys)
}

/// One (row, head) of a partial attention: softmax `scores` (those of the
/// keys the row sees, in position order), write the weighted sum of the
/// values `value(t)` into `o`, and return ln Σ exp(score). No key: zeros
/// and −∞. The weights and sums are MlaPrefill's and GqaAttention's F32
/// reference's, so a single part over all keys is their result unrounded.
fn attend_part<'a>(scores: &mut [f32], value: impl Fn(usize) -> &'a [f32], o: &mut [f32]) -> f32 {
    o.fill(0.0);
    if scores.is_empty() {
        return f32::NEG_INFINITY;
    }
    let stats = softmax(scores);
    for (t, &w) in scores.iter().enumerate() {
        o.iter_mut().zip(value(t)).for_each(|(a, b)| *a += w * b);
    }
    stats.max + stats.sum.ln()
}

/// [`Op::AttentionMerge`]'s weights for one row and head: updates `lse` to
/// the merged log-sum-exp and returns `(a, b)` normalised by `a + b`, or
/// `None` when both sides are −∞ (the row stays as it is). The CUDA kernel
/// (attention_part.cu) computes the same, in the same order.
fn merge_weights(lse: &mut f32, part_lse: f32) -> Option<(f32, f32)> {
    let m = lse.max(part_lse);
    if m == f32::NEG_INFINITY {
        return None;
    }
    let (a, b) = ((*lse - m).exp(), (part_lse - m).exp());
    let sum = a + b;
    *lse = m + sum.ln();
    Some((a / sum, b / sum))
}

/// `a·out + b·part`, where a side of weight exactly zero is left out (an
/// accumulator at −∞ may hold anything).
fn merged(out: f32, part: f32, a: f32, b: f32) -> f32 {
    if a == 0.0 {
        part
    } else if b == 0.0 {
        out
    } else {
        a * out + b * part
    }
}

/// The pool entries of `positions` of `layer` of the sequence whose block
/// table is the `blocks` u32 ids at `table`, one range per position. Every
/// block id those positions use is checked against the pool before any is
/// returned, so a bad table fails the op before it touches anything.
fn kv_rows(mem: &Memory, kv: &PagedKv, table: DevicePtr, blocks: usize, layer: usize, positions: std::ops::Range<usize>, what: &str) -> Result<Vec<DevicePtr>, DeviceError> {
    let ids = mem.u32s(table, blocks)?;
    let pool_blocks = kv.blocks();
    let row_bytes = kv.entry_dim * 4;
    positions
        .map(|p| {
            let (i, slot) = (p / kv.block_size, p % kv.block_size);
            let block = ids[i] as usize;
            if block >= pool_blocks {
                return Err(DeviceError::Invalid(format!("{what}: position {p} is in block {block} (table entry {i}), past the pool's {pool_blocks} blocks")));
            }
            kv.pool.slice(kv.entry_offset(block, layer, slot) * 4, row_bytes)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pool::PoolConfig;

    /// A store whose table has one good and one bad block id fails before
    /// it writes anything: the good block keeps its old contents too. (Through
    /// `Device` the memory cannot be read after the fault, so this looks at
    /// the executor and its memory directly.)
    #[test]
    fn a_kv_store_with_a_bad_block_id_writes_nothing() {
        let (n_layers, block_size, entry_dim, pool_blocks) = (2, 4, 3, 3);
        let pool_bytes = pool_blocks * n_layers * block_size * entry_dim * 4;
        let mem = Memory::new(pool_bytes + 4096);
        let pool = DevicePtr { addr: 0, bytes: pool_bytes };
        let before: Vec<u8> = (0..pool_bytes).map(|i| i as u8).collect();
        mem.write(pool, &before).unwrap();
        let table = DevicePtr { addr: pool_bytes as u64, bytes: 8 };
        mem.write(table, &[1u32, pool_blocks as u32].iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>()).unwrap();
        let entries = DevicePtr { addr: pool_bytes as u64 + 64, bytes: 6 * entry_dim * 4 };
        mem.write(entries, &vec![0u8; entries.bytes]).unwrap();
        let kv = PagedKv { pool, n_layers, block_size, entry_dim };
        // Positions 2..8: slots 2, 3 of block 1, then slots 0..4 of the bad block.
        let op = Op::KvStore { entries: entries.matrix(6, entry_dim), kv, table, blocks: 2, layer: 1, start: 2 };
        op.validate().unwrap();
        let mut executor = Executor::new(ThreadPool::new(&PoolConfig::single_node(1)), crate::cpu::isa::detect());
        let err = executor.run(&mem, &op).unwrap_err();
        assert!(err.to_string().contains("block 3 (table entry 1), past the pool's 3 blocks"), "{err}");
        assert_eq!(mem.bytes(pool).unwrap(), before.as_slice(), "a failed store changed the pool");
        // The same store without the bad positions does write block 1.
        let op = Op::KvStore { entries: entries.matrix(2, entry_dim), kv, table, blocks: 2, layer: 1, start: 2 };
        executor.run(&mem, &op).unwrap();
        assert_ne!(mem.bytes(pool).unwrap(), before.as_slice());
    }
}
