//! The CPU backend: the forward program's ops on the host's worker pool.
//!
//! Weights are read in place from the checkpoint's mapping (or the shared
//! weight segment), the KV cache in place from the paged pool. Activations
//! live in one F32 arena that is reused from pass to pass, so a steady
//! stream of decode steps allocates nothing for them. The F32 path runs the
//! scalar reference kernels; the BF16 path the SIMD kernels of the level
//! the CPU supports, spread over the pool.

use crate::backend::{AttentionCall, Backend, ExpertJob, ExpertScratch, RouteCall, Routes, Segment, Tokens};
use crate::kv_cache::KvPool;
use crate::model::{ForwardError, Precision};
use crate::weights::{HostWeight, Weights};
use duplex_kernels::cpu::{elementwise as simd, isa::Isa, vector::{dot_bf16_f32, dot_f32_bytes}};
use duplex_kernels::device::{DevicePtr, Matrix};
use duplex_kernels::elementwise::{rms_norm, rope, silu_mul, softmax};
use duplex_kernels::gqa::{gqa_attention, GqaDims, KvBlocks};
use duplex_kernels::linear::{dot, matmul, matmul_rows, matmul_t_rows, WeightView};
use duplex_kernels::mla::{decode_attention, prefill_attention, LatentCache, MlaDims};
use duplex_kernels::moe::{moe_forward, ExpertCall, ExpertWeights, MoeScratch};
use duplex_kernels::parallel_linear::{par_head_products, par_matmul, LinearScratch};
use duplex_kernels::pool::{PoolConfig, ThreadPool};
use duplex_kernels::router::{route, route_simd};
use duplex_kernels::shared::SharedSlice;
use duplex_kernels::WeightFormat;
use std::borrow::Cow;
use std::sync::{Mutex, MutexGuard};

/// Where the CPU computes: the worker pool, the SIMD level, and the
/// buffers reused across passes.
pub struct CpuRuntime {
    pub pool: ThreadPool,
    pub isa: Isa,
    arena: Mutex<Arena>,
}

#[derive(Default)]
pub(crate) struct Arena {
    data: Vec<f32>,
    /// An op's output before it is stored (its inputs may be borrowed from `data`).
    tmp: Vec<f32>,
    expanded: Vec<f32>,
    context: Vec<f32>,
    linear: LinearScratch,
    moe: MoeScratch,
    attention: Vec<f32>,
}

impl CpuRuntime {
    pub fn new(config: &PoolConfig) -> Self {
        CpuRuntime { pool: ThreadPool::new(config), isa: duplex_kernels::cpu::isa::detect(), arena: Mutex::default() }
    }

    /// A backend for one pass (passes on one runtime take turns).
    pub fn backend(&self) -> CpuBackend<'_> {
        CpuBackend { rt: self, arena: self.arena.lock().unwrap_or_else(|e| e.into_inner()) }
    }
}

pub struct CpuBackend<'a> {
    rt: &'a CpuRuntime,
    arena: MutexGuard<'a, Arena>,
}

/// Index in the arena of `m`'s first float.
fn at(m: Matrix) -> usize {
    m.buf.addr as usize / 4 + m.offset
}

/// The floats of `m` in `data`: borrowed when contiguous, else gathered.
fn read<'d>(data: &'d [f32], m: Matrix) -> Cow<'d, [f32]> {
    if m.is_contiguous() {
        Cow::Borrowed(&data[at(m)..at(m) + m.rows * m.cols])
    } else {
        Cow::Owned((0..m.rows).flat_map(|r| data[at(m) + r * m.stride..][..m.cols].iter().copied()).collect())
    }
}

fn store(data: &mut [f32], m: Matrix, xs: &[f32]) {
    for (r, row) in xs.chunks(m.cols.max(1)).take(m.rows).enumerate() {
        data[at(m) + r * m.stride..][..m.cols].copy_from_slice(row);
    }
}

/// Apply `f` to each row of `m` in place.
fn rows_mut(data: &mut [f32], m: Matrix, mut f: impl FnMut(usize, &mut [f32])) {
    for r in 0..m.rows {
        f(r, &mut data[at(m) + r * m.stride..][..m.cols]);
    }
}

fn matrix(w: &HostWeight) -> Result<WeightView<'_>, ForwardError> {
    w.matrix().map(|l| l.view()).ok_or_else(|| ForwardError::BadModule("a vector where a matrix is expected".into()))
}

fn vector(w: &HostWeight) -> Result<&[f32], ForwardError> {
    w.vector().ok_or_else(|| ForwardError::BadModule("a matrix where a vector is expected".into()))
}

fn check(m: Matrix, len: usize) -> Result<(), ForwardError> {
    let end = if m.rows == 0 { at(m) } else { at(m) + (m.rows - 1) * m.stride + m.cols };
    if end > len || (m.rows > 1 && m.stride < m.cols) {
        return Err(ForwardError::Workspace(format!("a {}×{} matrix at {} (stride {}) overruns {len} floats", m.rows, m.cols, m.offset, m.stride)));
    }
    Ok(())
}

impl CpuBackend<'_> {
    /// Run experts on rows of `x`, adding their scaled outputs into `out`
    /// unrounded ([`Backend::experts`], which needs no scratch here).
    pub fn run_experts(&mut self, x: Matrix, jobs: &[ExpertJob<HostWeight>], out: Matrix, p: Precision) -> Result<(), ForwardError> {
        let (rt, a) = (self.rt, &mut *self.arena);
        check(x, a.data.len())?;
        check(out, a.data.len())?;
        let (n, d) = (x.rows, x.cols);
        let xs = read(&a.data, x);
        let all: Vec<(usize, f32)> = if jobs.iter().any(|j| matches!(j.tokens, Tokens::All)) { (0..n).map(|t| (t, 1.0)).collect() } else { vec![] };
        fn tokens<'t>(j: &ExpertJob<'t, HostWeight>, all: &'t [(usize, f32)]) -> &'t [(usize, f32)] {
            match j.tokens {
                Tokens::All => all,
                Tokens::Rows(r) => r,
            }
        }
        a.tmp.clear();
        a.tmp.resize(n * d, 0.0);
        match p {
            Precision::F32 => {
                for job in jobs {
                    let rows = tokens(job, &all);
                    let picked: Vec<f32> = rows.iter().flat_map(|&(i, _)| xs[i * d..(i + 1) * d].iter().copied()).collect();
                    let ys = Self::expert_f32(job, &picked, rows.len())?;
                    for (&(i, w), y) in rows.iter().zip(ys.chunks(d)) {
                        a.tmp[i * d..(i + 1) * d].iter_mut().zip(y).for_each(|(o, v)| *o += w * v);
                    }
                }
            }
            Precision::Bf16 => {
                let nodes = rt.pool.nodes();
                let calls = jobs
                    .iter()
                    .map(|j| {
                        let weights = ExpertWeights { gate: matrix(j.gate)?, up: matrix(j.up)?, down: matrix(j.down)? };
                        Ok(ExpertCall { weights, tokens: tokens(j, &all), node: duplex_kernels::pool::expert_node(j.expert, nodes) })
                    })
                    .collect::<Result<Vec<_>, ForwardError>>()?;
                moe_forward(&rt.pool, rt.isa, &calls, &xs, d, &mut a.tmp, &mut a.moe);
            }
        }
        drop(xs);
        let sum = &a.tmp;
        rows_mut(&mut a.data, out, |r, row| row.iter_mut().zip(&sum[r * d..(r + 1) * d]).for_each(|(o, v)| *o += v));
        Ok(())
    }

    /// `x · Wᵀ` of contiguous rows into `out`.
    fn product(rt: &CpuRuntime, linear: &mut LinearScratch, w: &WeightView, x: &[f32], rows: usize, out: &mut Vec<f32>, p: Precision) {
        out.clear();
        out.resize(rows * w.rows, 0.0);
        match p {
            Precision::F32 => matmul(w, x, rows, out),
            Precision::Bf16 => par_matmul(&rt.pool, rt.isa, w, x, rows, out, linear),
        }
    }

    /// The F32 reference of one expert: three plain matrix products.
    fn expert_f32(job: &ExpertJob<HostWeight>, x: &[f32], n: usize) -> Result<Vec<f32>, ForwardError> {
        let (gate, up, down) = (matrix(job.gate)?, matrix(job.up)?, matrix(job.down)?);
        let mut g = vec![0.0; n * gate.rows];
        let mut u = vec![0.0; n * up.rows];
        let mut y = vec![0.0; n * down.rows];
        matmul(&gate, x, n, &mut g);
        matmul(&up, x, n, &mut u);
        silu_mul(&mut g, &u);
        matmul(&down, &g, n, &mut y);
        Ok(y)
    }

    /// The absorbed form for one token: fold `kv_b_proj` into the query
    /// (`q_nope · W_k`) and the output (`W_v · Σ p·c`), so that attention
    /// runs directly over the cached latents.
    fn mla_absorbed(&mut self, c: &AttentionCall, w: &Weights<HostWeight>, out: &mut [f32]) -> Result<(), ForwardError> {
        let (cfg, m) = (c.cfg, c.cfg.mla().expect("MLA"));
        let (heads, dn, dr, dv, dc) = (cfg.num_attention_heads, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim, m.kv_lora_rank);
        let (dq, dkv, ctx) = (dn + dr, dn + dv, c.seg.start + 1);
        let kv_b = matrix(w.get("kv_b_proj")?)?;
        let (rt, isa) = (self.rt, self.rt.isa);
        let a = &mut *self.arena;
        let q = read(&a.data, c.q);
        let (pool, table, layer) = (c.pool, &c.seg.table, c.layer);
        match c.precision {
            Precision::F32 => {
                let mut q_latent = vec![0.0f32; dc];
                let mut ctx_latent = vec![0.0f32; dc];
                let mut scores = vec![0.0f32; ctx];
                for h in 0..heads {
                    let qh = &q[h * dq..(h + 1) * dq];
                    matmul_t_rows(&kv_b, h * dkv..h * dkv + dn, &qh[..dn], &mut q_latent);
                    for (t, s) in scores.iter_mut().enumerate() {
                        let e = pool.entry(table, layer, t);
                        *s = (dot(&q_latent, &e[..dc]) + dot(&qh[dn..], &e[dc..])) * c.scale;
                    }
                    softmax(&mut scores);
                    ctx_latent.fill(0.0);
                    for (t, &p) in scores.iter().enumerate() {
                        let lat = &pool.entry(table, layer, t)[..dc];
                        ctx_latent.iter_mut().zip(lat).for_each(|(a, b)| *a += p * b);
                    }
                    matmul_rows(&kv_b, h * dkv + dn..h * dkv + dkv, &ctx_latent, 1, &mut out[h * dv..(h + 1) * dv]);
                }
            }
            Precision::Bf16 => {
                let HostWeight::PerHead(key_t) = w.get("kv_b_proj.key_t")? else {
                    return Err(ForwardError::BadModule("kv_b_proj.key_t is not per head".into()));
                };
                let key_t = key_t.heads();
                let mut q_latent = vec![0.0f32; heads * dc];
                let (q_nope, q_pe): (Vec<f32>, Vec<f32>) = (q.chunks(dq).flat_map(|h| h[..dn].iter().copied()).collect(), q.chunks(dq).flat_map(|h| h[dn..].iter().copied()).collect());
                par_head_products(&rt.pool, isa, heads, &|h| (key_t[h].view(), 0..dc), &q_nope, &mut q_latent, &mut a.linear);
                duplex_kernels::round_bf16_slice(&mut q_latent);
                let blocks: Vec<&[f32]> = table.blocks[..ctx.div_ceil(pool.block_size())].iter().map(|&b| pool.layer_block(b, layer)).collect();
                let cache = LatentCache { blocks: &blocks, block_size: pool.block_size(), dc, dr };
                let mut ctx_latent = vec![0.0f32; heads * dc];
                decode_attention(&rt.pool, isa, cache, ctx, &q_latent, &q_pe, c.scale, &mut a.attention, &mut ctx_latent);
                duplex_kernels::round_bf16_slice(&mut ctx_latent);
                // A GGUF's own value half (`attn_v_b`), else kv_b_proj's value rows.
                let (values, stride, offset) = match w.find("v_b_proj") {
                    Some(v) => (matrix(v)?, dv, 0),
                    None => (kv_b, dkv, dn),
                };
                let band = |h: usize| (values, h * stride + offset..h * stride + offset + dv);
                par_head_products(&rt.pool, isa, heads, &band, &ctx_latent, out, &mut a.linear);
                duplex_kernels::round_bf16_slice(out);
            }
        }
        Ok(())
    }

    /// The cached entries `0..ctx` of a segment's layer, gathered (or its
    /// fresh entries when it starts the sequence).
    fn context<'d>(data: &'d [f32], gathered: &'d mut Vec<f32>, c: &AttentionCall) -> &'d [f32] {
        if c.seg.start == 0 {
            return &data[at(c.fresh)..at(c.fresh) + c.fresh.rows * c.fresh.cols];
        }
        let ctx = c.seg.start + c.seg.n;
        gathered.clear();
        for t in 0..ctx {
            gathered.extend_from_slice(c.pool.entry(&c.seg.table, c.layer, t));
        }
        gathered
    }
}

impl Backend for CpuBackend<'_> {
    type Weight = HostWeight;
    const ATTENDS_IN_PLACE: bool = true;

    fn rows_of(w: &HostWeight) -> Result<usize, ForwardError> {
        Ok(matrix(w)?.rows)
    }

    fn workspace(&mut self, bytes: usize) -> Result<DevicePtr, ForwardError> {
        let floats = bytes.div_ceil(4);
        let data = &mut self.arena.data;
        if data.len() < floats {
            // A fresh zeroed allocation (pages a pass never touches are never
            // committed), with room to spare: decode steps grow a little
            // each time, and must not reallocate each time.
            *data = vec![0.0; floats + floats / 2];
        }
        Ok(DevicePtr { addr: 0, bytes: floats * 4 })
    }

    fn upload_f32(&mut self, xs: &[f32], dst: DevicePtr) -> Result<(), ForwardError> {
        let first = dst.addr as usize / 4;
        self.arena.data[first..first + xs.len()].copy_from_slice(xs);
        Ok(())
    }

    fn upload_u32(&mut self, xs: &[u32], dst: DevicePtr) -> Result<(), ForwardError> {
        let first = dst.addr as usize / 4;
        self.arena.data[first..first + xs.len()].iter_mut().zip(xs).for_each(|(d, &x)| *d = f32::from_bits(x));
        Ok(())
    }

    fn download(&mut self, m: Matrix) -> Result<Vec<f32>, ForwardError> {
        check(m, self.arena.data.len())?;
        Ok(read(&self.arena.data, m).into_owned())
    }

    fn embedding(&mut self, table: &HostWeight, first_row: usize, ids: DevicePtr, count: usize, out: Matrix, p: Precision) -> Result<(), ForwardError> {
        let view = matrix(table)?;
        let data = &mut self.arena.data;
        check(out, data.len())?;
        let first_id = ids.addr as usize / 4;
        for i in 0..count {
            let id = data[first_id + i].to_bits() as usize;
            let Some(r) = id.checked_sub(first_row).filter(|&r| r < view.rows) else { continue };
            let row = &mut data[at(out) + i * out.stride..][..out.cols];
            view.decode_row(r, row);
            p.round(row);
        }
        Ok(())
    }

    fn gemm(&mut self, w: &HostWeight, x: Matrix, y: Matrix, p: Precision, round: bool) -> Result<(), ForwardError> {
        let view = matrix(w)?;
        let a = &mut *self.arena;
        check(x, a.data.len())?;
        check(y, a.data.len())?;
        let xs = read(&a.data, x);
        Self::product(self.rt, &mut a.linear, &view, &xs, x.rows, &mut a.tmp, p);
        drop(xs);
        if round {
            p.round(&mut a.tmp);
        }
        store(&mut a.data, y, &a.tmp);
        Ok(())
    }

    fn router_logits(&mut self, w: &HostWeight, x: Matrix, y: Matrix, p: Precision) -> Result<(), ForwardError> {
        let view = matrix(w)?;
        // A checkpoint's router is BF16, a GGUF's F32.
        let width = match view.format {
            WeightFormat::Bf16 => 2,
            WeightFormat::F32 => 4,
            _ => 0,
        };
        if p != Precision::Bf16 || width == 0 {
            return self.gemm(w, x, y, Precision::F32, false);
        }
        // SIMD dot products of the weights as they are: exact F32 products,
        // only the summation order differs from the reference. Spread over
        // the pool by experts: the router's weights (3.7 MB for V3 in BF16)
        // are streamed once per layer like any other matrix.
        let (rt, a) = (self.rt, &mut *self.arena);
        check(x, a.data.len())?;
        let xs = read(&a.data, x);
        a.tmp.clear();
        a.tmp.resize(x.rows * view.rows, 0.0);
        const EXPERTS_PER_TASK: usize = 16;
        let out = SharedSlice::new(&mut a.tmp);
        rt.pool.parallel_for(view.rows.div_ceil(EXPERTS_PER_TASK), &|task| {
            let experts = task * EXPERTS_PER_TASK..((task + 1) * EXPERTS_PER_TASK).min(view.rows);
            for (i, xi) in xs.chunks_exact(view.cols).enumerate() {
                // SAFETY: the logits of these experts are written by this task only.
                let out = unsafe { out.slice_mut(i * view.rows + experts.start, experts.len()) };
                for (r, o) in experts.clone().zip(out) {
                    let row = &view.data[width * r * view.cols..width * (r + 1) * view.cols];
                    *o = if width == 2 { dot_bf16_f32(rt.isa, row, xi) } else { dot_f32_bytes(rt.isa, row, xi) };
                }
            }
        });
        drop(xs);
        store(&mut a.data, y, &a.tmp);
        Ok(())
    }

    fn rms_norm(&mut self, x: Matrix, weight: &HostWeight, out: Matrix, eps: f32, p: Precision) -> Result<(), ForwardError> {
        let (w, isa) = (vector(weight)?, self.rt.isa);
        let a = &mut *self.arena;
        check(x, a.data.len())?;
        check(out, a.data.len())?;
        let xs = read(&a.data, x);
        a.tmp.clear();
        a.tmp.resize(xs.len(), 0.0);
        for (o, xi) in a.tmp.chunks_mut(x.cols).zip(xs.chunks(x.cols)) {
            match p {
                Precision::F32 => rms_norm(xi, w, eps, o),
                Precision::Bf16 => simd::rms_norm_bf16(isa, xi, w, eps, o),
            }
        }
        drop(xs);
        store(&mut a.data, out, &a.tmp);
        Ok(())
    }

    fn rope(&mut self, x: Matrix, cos: Matrix, sin: Matrix, rows_per_position: usize, interleaved: bool, p: Precision) -> Result<(), ForwardError> {
        let isa = self.rt.isa;
        let a = &mut *self.arena;
        check(x, a.data.len())?;
        let half = x.cols / 2;
        // The tables are small: copy them out so that x can be rotated in place.
        a.tmp.clear();
        a.tmp.extend_from_slice(&read(&a.data, cos));
        a.tmp.extend_from_slice(&read(&a.data, sin));
        let (cos, sin) = a.tmp.split_at(cos.rows * cos.cols);
        rows_mut(&mut a.data, x, |r, row| {
            let pos = r / rows_per_position;
            let (c, s) = (&cos[pos * half..(pos + 1) * half], &sin[pos * half..(pos + 1) * half]);
            match p {
                Precision::F32 => rope(row, c, s, interleaved),
                Precision::Bf16 => {
                    simd::rope(isa, row, c, s, interleaved);
                    duplex_kernels::round_bf16_slice(row);
                }
            }
        });
        Ok(())
    }

    fn add(&mut self, h: Matrix, delta: Matrix, p: Precision) -> Result<(), ForwardError> {
        let a = &mut *self.arena;
        check(h, a.data.len())?;
        check(delta, a.data.len())?;
        a.tmp.clear();
        a.tmp.extend_from_slice(&read(&a.data, delta));
        let d = &a.tmp;
        rows_mut(&mut a.data, h, |r, row| {
            row.iter_mut().zip(&d[r * h.cols..(r + 1) * h.cols]).for_each(|(x, y)| *x += y);
            p.round(row);
        });
        Ok(())
    }

    fn round_bf16(&mut self, x: Matrix) -> Result<(), ForwardError> {
        check(x, self.arena.data.len())?;
        rows_mut(&mut self.arena.data, x, |_, row| duplex_kernels::round_bf16_slice(row));
        Ok(())
    }

    fn zero(&mut self, x: Matrix) -> Result<(), ForwardError> {
        check(x, self.arena.data.len())?;
        rows_mut(&mut self.arena.data, x, |_, row| row.fill(0.0));
        Ok(())
    }

    fn copy(&mut self, src: Matrix, dst: Matrix) -> Result<(), ForwardError> {
        let a = &mut self.arena.data;
        check(src, a.len())?;
        check(dst, a.len())?;
        let xs = read(a, src).into_owned();
        store(a, dst, &xs);
        Ok(())
    }

    fn route(&mut self, c: RouteCall<'_, HostWeight>) -> Result<Routes, ForwardError> {
        let (logits, params, p) = (c.logits, c.params, c.precision);
        let bias = c.bias.map(vector).transpose()?;
        check(logits, self.arena.data.len())?;
        let xs = read(&self.arena.data, logits);
        Ok(Routes::Chosen(
            xs.chunks(logits.cols)
                .map(|row| match p {
                    Precision::F32 => route(params, row, bias),
                    Precision::Bf16 => route_simd(self.rt.isa, params, row, bias),
                })
                .collect(),
        ))
    }

    fn experts(&mut self, x: Matrix, jobs: &[ExpertJob<HostWeight>], out: Matrix, p: Precision, _scratch: &ExpertScratch) -> Result<(), ForwardError> {
        self.run_experts(x, jobs, out, p)
    }

    fn store_kv(&mut self, layer: usize, parts: &[Matrix], seg: &Segment, pool: &mut KvPool) -> Result<(), ForwardError> {
        let data = &self.arena.data;
        for part in parts {
            check(*part, data.len())?;
        }
        for i in 0..seg.n {
            let entry = pool.entry_mut(&seg.table, layer, seg.start + i);
            let mut col = 0;
            for part in parts {
                entry[col..col + part.cols].copy_from_slice(&data[at(*part) + i * part.stride..][..part.cols]);
                col += part.cols;
            }
        }
        Ok(())
    }

    fn mla_attention(&mut self, c: &AttentionCall, w: &Weights<HostWeight>) -> Result<(), ForwardError> {
        let (cfg, m) = (c.cfg, c.cfg.mla().expect("MLA"));
        check(c.q, self.arena.data.len())?;
        check(c.out, self.arena.data.len())?;
        let mut out = vec![0.0f32; c.out.rows * c.out.cols];
        if c.seg.n == 1 {
            self.mla_absorbed(c, w, &mut out)?;
        } else {
            // The prefill form: expand every cached latent into per-head keys
            // and values with kv_b_proj, then ordinary causal attention.
            let dims = MlaDims { heads: cfg.num_attention_heads, dn: m.qk_nope_head_dim, dr: m.qk_rope_head_dim, dv: m.v_head_dim, dc: m.kv_lora_rank };
            let kv_b = matrix(w.get("kv_b_proj")?)?;
            let (rt, a) = (self.rt, &mut *self.arena);
            let entries = Self::context(&a.data, &mut a.context, c);
            let de = cfg.kv_entry_dim();
            let ctx = entries.len() / de;
            let latents: Vec<f32> = entries.chunks(de).flat_map(|e| e[..dims.dc].iter().copied()).collect();
            Self::product(rt, &mut a.linear, &kv_b, &latents, ctx, &mut a.expanded, c.precision);
            c.precision.round(&mut a.expanded);
            let q = read(&a.data, c.q);
            prefill_attention(&rt.pool, rt.isa, &q, &a.expanded, entries, &mut out, c.seg.start, dims, c.scale, c.precision);
        }
        store(&mut self.arena.data, c.out, &out);
        Ok(())
    }

    fn gqa_attention(&mut self, c: &AttentionCall) -> Result<(), ForwardError> {
        let (cfg, g) = (c.cfg, c.cfg.gqa().expect("GQA"));
        let (rt, a) = (self.rt, &mut *self.arena);
        check(c.q, a.data.len())?;
        check(c.out, a.data.len())?;
        let ctx = c.seg.start + c.seg.n;
        let pool = c.pool;
        let blocks: Vec<&[f32]> = c.seg.table.blocks[..ctx.div_ceil(pool.block_size())].iter().map(|&b| pool.layer_block(b, c.layer)).collect();
        let cache = KvBlocks { blocks: &blocks, block_size: pool.block_size(), kv_heads: g.num_key_value_heads, head_dim: g.head_dim };
        let dims = GqaDims { heads: cfg.num_attention_heads, kv_heads: g.num_key_value_heads, head_dim: g.head_dim };
        let q = read(&a.data, c.q);
        a.tmp.clear();
        a.tmp.resize(c.out.rows * c.out.cols, 0.0);
        gqa_attention(&rt.pool, rt.isa, &q, cache, c.seg.start, dims, c.scale, c.precision, &mut a.attention, &mut a.tmp);
        drop(q);
        store(&mut a.data, c.out, &a.tmp);
        Ok(())
    }
}
