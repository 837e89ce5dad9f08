//! A simulated CPU pool, for the CPU placement: a [`Backend`] over the
//! host's weights whose ops compute nothing but take their modelled time on
//! a virtual clock, so that [`duplex_model::model::Model::forward_batch_on`]
//! runs the CPU engine's own program against it.
//!
//! Each op's work is what the real CPU backend ([`duplex_model::cpu`]) does
//! for it: the device layer's [`Op`] where the CPU runs the same thing
//! (costed by [`op_work`]), else FLOPs and bytes counted here (attention in
//! place over the paged cache, a layer's routed experts in one parallel
//! region). The work runs on as many threads as the real kernel uses: the
//! pool for the BF16 path's products and for attention, one thread for the
//! F32 reference's products and for the row-wise ops the backend runs
//! inline. An op starts at the calling thread's virtual time
//! ([`clock::now`], which the caller starts with [`clock::set`]), takes the
//! first gap of that length on the pool's one timeline (passes on a CPU
//! runtime take turns), and moves the thread's time to its end.
//!
//! Nothing reads a weight's bytes (a checkpoint may be hollow): only shapes
//! and stored sizes. Nothing touches the KV cache. Results are zeros, and the
//! router, the one result the program's control flow depends on, chooses
//! `top_k` distinct experts per token uniformly at random (seeded), with
//! weights 1/k, as the simulated accelerator's does.

use crate::cost::{op_work, Math, Work, WorkKind};
use crate::device::{splitmix, Timeline};
use crate::hardware::CpuSpec;
use duplex_kernels::clock;
use duplex_kernels::device::{DevicePtr, DeviceWeight, GqaDims, Matrix, MlaDims, Op};
use duplex_kernels::WeightView;
use duplex_model::hybrid::ExpertPool;
use duplex_model::backend::{AttentionCall, Backend, ExpertJob, ExpertScratch, RouteCall, Routes, Segment, Tokens};
use duplex_model::kv_cache::KvPool;
use duplex_model::model::{ForwardError, Precision};
use duplex_model::weights::{HostWeight, Weights};
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

/// The simulated pool: one CPU's cost model, the threads the engine's pool
/// has, and when that pool is busy.
pub struct SimCpu {
    spec: CpuSpec,
    threads: usize,
    /// Seed of the simulated router's choices.
    seed: u64,
    busy: Mutex<Timeline>,
    /// Modelled time per kind of op, in the order kinds first ran.
    per_kind: Mutex<Vec<(&'static str, Duration)>>,
    /// Tokens routed so far (the router's counter-based random stream).
    routed: Mutex<u64>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl SimCpu {
    /// A pool of `threads` threads (at least 1, at most the CPU's cores).
    pub fn new(spec: CpuSpec, threads: usize, seed: u64) -> SimCpu {
        let threads = threads.clamp(1, spec.cores());
        SimCpu { spec, threads, seed, busy: Mutex::default(), per_kind: Mutex::default(), routed: Mutex::new(0) }
    }

    /// A backend for one pass.
    pub fn backend(&self) -> SimCpuBackend<'_> {
        SimCpuBackend { cpu: self, next: 0 }
    }

    pub fn threads(&self) -> usize {
        self.threads
    }

    /// The pool's busy time so far.
    pub fn busy(&self) -> Duration {
        lock(&self.busy).total
    }

    /// Modelled time per kind of op (`gemm`, `experts`, `attention`, ...).
    pub fn per_kind(&self) -> Vec<(&'static str, Duration)> {
        lock(&self.per_kind).clone()
    }

    /// `work` on `threads` threads.
    fn time(&self, work: &Work, threads: usize) -> Duration {
        self.spec.time(work, threads)
    }

    /// Book `len` of `kind` on the pool from the calling thread's virtual
    /// time, and move that time to its end. A thread outside a simulation
    /// books from zero and keeps no time.
    fn book(&self, kind: &'static str, len: Duration) {
        let ready = clock::now().unwrap_or_default();
        let end = lock(&self.busy).book(ready, len);
        let mut per_kind = lock(&self.per_kind);
        match per_kind.iter_mut().find(|(k, _)| *k == kind) {
            Some((_, t)) => *t += len,
            None => per_kind.push((kind, len)),
        }
        drop(per_kind);
        clock::advance_to(end);
    }

    /// A layer's routed experts over `rows` rows of `cols` (one parallel
    /// region, as the CPU backend runs them): each expert's three
    /// projections read once, over the rows routed to it.
    fn run_experts(&self, rows: usize, cols: usize, jobs: &[ExpertJob<HostWeight>], p: Precision) -> Result<(), ForwardError> {
        let threads = self.product_threads(p);
        let mut total = Duration::ZERO;
        for job in jobs {
            let n = match job.tokens {
                Tokens::All => rows,
                Tokens::Rows(r) => r.len(),
            };
            let (gate, up, down) = (matrix(job.gate)?, matrix(job.up)?, matrix(job.down)?);
            let bytes = view_bytes(&gate) + view_bytes(&up) + view_bytes(&down);
            let macs = gate.rows * gate.cols + up.rows * up.cols + down.rows * down.cols;
            total += self.time(&product(bytes, macs, n, cols, down.rows, p), threads);
        }
        self.book("experts", total);
        Ok(())
    }

    /// Book `op` as the device layer costs it, on `threads` threads.
    fn book_op(&self, kind: &'static str, op: &Op, threads: usize) {
        self.book(kind, self.time(&op_work(op), threads));
    }

    /// Threads a product of `precision` runs on: the BF16 path's
    /// `par_matmul` uses the pool, the F32 reference `matmul` one thread.
    fn product_threads(&self, p: Precision) -> usize {
        match p {
            Precision::F32 => 1,
            Precision::Bf16 => self.threads,
        }
    }

    /// The simulated router: `k` distinct experts of `experts` per token.
    fn choose(&self, tokens: usize, k: usize, experts: usize) -> Vec<Vec<(usize, f32)>> {
        let (k, experts) = (k.min(experts.max(1)), experts.max(1));
        let weight = 1.0 / k.max(1) as f32;
        let mut counter = lock(&self.routed);
        (0..tokens)
            .map(|_| {
                let mut row: Vec<(usize, f32)> = Vec::with_capacity(k);
                let mut draw = 0u64;
                while row.len() < k {
                    let e = (splitmix(self.seed ^ (*counter << 20) ^ draw) % experts as u64) as usize;
                    draw += 1;
                    if row.iter().all(|&(x, _)| x != e) {
                        row.push((e, weight));
                    }
                }
                *counter += 1;
                row
            })
            .collect()
    }
}

/// The simulated CPU as the forward program's backend, for one pass.
pub struct SimCpuBackend<'a> {
    cpu: &'a SimCpu,
    /// The next workspace offset handed out (no memory behind it).
    next: u64,
}

fn matrix(w: &HostWeight) -> Result<WeightView<'_>, ForwardError> {
    w.matrix().map(|l| l.view()).ok_or_else(|| ForwardError::BadModule("a vector where a matrix is expected".into()))
}

fn vector_bytes(w: &HostWeight) -> Result<usize, ForwardError> {
    w.vector().map(|v| v.len() * 4).ok_or_else(|| ForwardError::BadModule("a matrix where a vector is expected".into()))
}

/// Bytes a pass over a weight reads: its data and its scales. Only the
/// lengths are looked at, never the bytes.
fn view_bytes(v: &WeightView) -> usize {
    v.data.len() + v.scales.len() * 4
}

/// A host weight as the device layer's ops describe one: its shape, format
/// and stored sizes (the addresses mean nothing here).
fn device_weight(v: &WeightView) -> DeviceWeight {
    DeviceWeight { data: ptr(v.data.len()), scales: ptr(v.scales.len() * 4), rows: v.rows, cols: v.cols, format: v.format }
}

fn ptr(bytes: usize) -> DevicePtr {
    DevicePtr { addr: 0, bytes }
}

/// An F32 matrix of this shape, for costing.
fn shaped(rows: usize, cols: usize) -> Matrix {
    ptr(rows * cols * 4).matrix(rows, cols)
}

/// A product with a weight of `weight_bytes` over `rows` rows: 2 FLOPs per
/// multiply-add of `macs_per_row`, the weight read once, activations of
/// `in_cols` read and `out_cols` written as F32.
fn product(weight_bytes: usize, macs_per_row: usize, rows: usize, in_cols: usize, out_cols: usize, p: Precision) -> Work {
    Work {
        flops: 2.0 * (rows * macs_per_row) as f64,
        bytes: (weight_bytes + rows * (in_cols + out_cols) * 4) as f64,
        kind: WorkKind::Matmul,
        math: p.into(),
        rows,
    }
}

/// Moving `bytes` (read and written once each), with no arithmetic.
fn copying(bytes: usize) -> Work {
    Work { flops: 0.0, bytes: 2.0 * bytes as f64, kind: WorkKind::Elementwise, math: Math::F32, rows: 0 }
}

impl Backend for SimCpuBackend<'_> {
    type Weight = HostWeight;
    const ATTENDS_IN_PLACE: bool = true;

    fn rows_of(w: &HostWeight) -> Result<usize, ForwardError> {
        Ok(matrix(w)?.rows)
    }

    fn workspace(&mut self, bytes: usize) -> Result<DevicePtr, ForwardError> {
        let at = self.next;
        self.next += duplex_model::forward::align(bytes) as u64;
        Ok(DevicePtr { addr: at, bytes })
    }

    fn upload_f32(&mut self, _xs: &[f32], _dst: DevicePtr) -> Result<(), ForwardError> {
        Ok(())
    }

    fn upload_u32(&mut self, _xs: &[u32], _dst: DevicePtr) -> Result<(), ForwardError> {
        Ok(())
    }

    fn download(&mut self, m: Matrix) -> Result<Vec<f32>, ForwardError> {
        Ok(vec![0.0; m.rows * m.cols])
    }

    fn embedding(&mut self, table: &HostWeight, first_row: usize, ids: DevicePtr, count: usize, out: Matrix, p: Precision) -> Result<(), ForwardError> {
        let op = Op::Embedding { table: device_weight(&matrix(table)?), first_row, ids, count, out, precision: p };
        self.cpu.book_op("embedding", &op, 1);
        Ok(())
    }

    fn gemm(&mut self, w: &HostWeight, x: Matrix, y: Matrix, p: Precision, round: bool) -> Result<(), ForwardError> {
        let op = Op::Gemm { w: device_weight(&matrix(w)?), x, y, precision: p, round };
        self.cpu.book_op("gemm", &op, self.cpu.product_threads(p));
        Ok(())
    }

    fn router_logits(&mut self, w: &HostWeight, x: Matrix, y: Matrix, p: Precision) -> Result<(), ForwardError> {
        let view = matrix(w)?;
        // BF16 router weights take the pool's SIMD dot products (F32 math);
        // anything else the F32 reference product, on one thread.
        let threads = if p == Precision::Bf16 && view.format == duplex_kernels::WeightFormat::Bf16 { self.cpu.threads } else { 1 };
        let op = Op::Gemm { w: device_weight(&view), x, y, precision: Precision::F32, round: false };
        self.cpu.book_op("router", &op, threads);
        Ok(())
    }

    fn rms_norm(&mut self, x: Matrix, weight: &HostWeight, out: Matrix, eps: f32, p: Precision) -> Result<(), ForwardError> {
        let op = Op::RmsNorm { x, weight: ptr(vector_bytes(weight)?), out, eps, precision: p };
        self.cpu.book_op("rms_norm", &op, 1);
        Ok(())
    }

    fn rope(&mut self, x: Matrix, cos: Matrix, sin: Matrix, rows_per_position: usize, interleaved: bool, p: Precision) -> Result<(), ForwardError> {
        let op = Op::Rope { x, cos, sin, rows_per_position, interleaved, precision: p };
        self.cpu.book_op("rope", &op, 1);
        Ok(())
    }

    fn add(&mut self, h: Matrix, delta: Matrix, p: Precision) -> Result<(), ForwardError> {
        self.cpu.book_op("add", &Op::Add { h, delta, precision: p }, 1);
        Ok(())
    }

    fn round_bf16(&mut self, x: Matrix) -> Result<(), ForwardError> {
        self.cpu.book_op("round_bf16", &Op::RoundBf16 { x }, 1);
        Ok(())
    }

    fn zero(&mut self, x: Matrix) -> Result<(), ForwardError> {
        self.cpu.book_op("zero", &Op::Zero { x }, 1);
        Ok(())
    }

    fn route(&mut self, c: RouteCall<'_, HostWeight>) -> Result<Routes, ForwardError> {
        let bias = c.bias.map(vector_bytes).transpose()?.map(ptr);
        let op = Op::Route { logits: c.logits, bias, params: c.params.clone(), ids: c.ids, weights: c.weights, precision: c.precision };
        self.cpu.book_op("route", &op, 1);
        Ok(Routes::Chosen(self.cpu.choose(c.logits.rows, c.params.top_k, c.params.n_experts)))
    }

    fn copy(&mut self, src: Matrix, _dst: Matrix) -> Result<(), ForwardError> {
        self.cpu.book("copy", self.cpu.time(&copying(src.rows * src.cols * 4), 1));
        Ok(())
    }

    /// Each expert streams its three projections once for all its rows and
    /// multiplies `rows × 3·hidden·inter`; the F32 reference runs them one
    /// after another on one thread, the BF16 path all of them in one
    /// parallel region. Each expert's roofline is its own (few rows stream
    /// weights, many compute), and they add up.
    fn experts(&mut self, x: Matrix, jobs: &[ExpertJob<HostWeight>], _out: Matrix, p: Precision, _scratch: &ExpertScratch) -> Result<(), ForwardError> {
        self.cpu.run_experts(x.rows, x.cols, jobs, p)
    }

    fn store_kv(&mut self, _layer: usize, parts: &[Matrix], seg: &Segment, _pool: &mut KvPool) -> Result<(), ForwardError> {
        let bytes: usize = parts.iter().map(|m| seg.n * m.cols * 4).sum();
        self.cpu.book("store_kv", self.cpu.time(&copying(bytes), 1));
        Ok(())
    }

    /// As the CPU backend runs it: one-token steps in the absorbed form
    /// (the query folded through each head's key band, attention over the
    /// cached latents read once for all heads, the context folded through
    /// the value band), longer ones expanded (the context's latents gathered
    /// unless they are all fresh, `kv_b_proj` over them, causal attention).
    fn mla_attention(&mut self, c: &AttentionCall, w: &Weights<HostWeight>) -> Result<(), ForwardError> {
        let (cfg, m) = (c.cfg, c.cfg.mla().ok_or_else(|| ForwardError::BadModule("MLA attention of a GQA model".into()))?);
        let dims = MlaDims { heads: cfg.num_attention_heads, dn: m.qk_nope_head_dim, dr: m.qk_rope_head_dim, dv: m.v_head_dim, dc: m.kv_lora_rank };
        let (p, ctx) = (c.precision, c.seg.start + c.seg.n);
        let kv_b = matrix(w.get("kv_b_proj")?)?;
        let kv_b_bytes = view_bytes(&kv_b);
        let pool_threads = self.cpu.threads;
        let time = |work: &Work, threads: usize| self.cpu.time(work, threads);
        let len = if c.seg.n == 1 {
            let (heads, dkv) = (dims.heads, dims.dn + dims.dv);
            // The key rows of kv_b_proj, read once whichever way the path
            // holds them (the BF16 path's per-head transposes, made on first
            // use, are the same elements in the same format; asking for them
            // here would make them, reading the weights).
            let key_bytes = kv_b_bytes * dims.dn / dkv;
            // A GGUF's own value half, else kv_b_proj's value rows.
            let value_bytes = match w.find("v_b_proj") {
                Some(v) => view_bytes(&matrix(v)?),
                None => kv_b_bytes * dims.dv / dkv,
            };
            let absorb = product(key_bytes, heads * dims.dn * dims.dc, 1, heads * dims.dn, heads * dims.dc, p);
            let attend = op_work(&Op::MlaDecode {
                q_latent: shaped(heads, dims.dc),
                q_pe: shaped(heads, dims.dr),
                latents: shaped(ctx, dims.dc + dims.dr),
                out: shaped(heads, dims.dc),
                scale: c.scale,
                precision: p,
            });
            let values = product(value_bytes, heads * dims.dc * dims.dv, 1, heads * dims.dc, heads * dims.dv, p);
            // The F32 reference runs all three per head on the calling thread.
            let threads = self.cpu.product_threads(p);
            time(&absorb, threads) + time(&attend, threads) + time(&values, threads)
        } else {
            let entry = cfg.kv_entry_dim();
            let gather = if c.seg.start > 0 { time(&copying(ctx * entry * 4), 1) } else { Duration::ZERO };
            let kv = shaped(ctx, dims.heads * (dims.dn + dims.dv));
            let expand = op_work(&Op::Gemm { w: device_weight(&kv_b), x: shaped(ctx, dims.dc), y: kv, precision: p, round: true });
            let attend = op_work(&Op::MlaPrefill { q: c.q, kv, latents: shaped(ctx, entry), out: c.out, start: c.seg.start, dims, scale: c.scale, precision: p });
            // Prefill attention runs its heads over the pool on both paths.
            gather + time(&expand, self.cpu.product_threads(p)) + time(&attend, pool_threads)
        };
        self.cpu.book("attention", len);
        Ok(())
    }

    fn gqa_attention(&mut self, c: &AttentionCall) -> Result<(), ForwardError> {
        let g = c.cfg.gqa().ok_or_else(|| ForwardError::BadModule("GQA attention of an MLA model".into()))?;
        let ctx = c.seg.start + c.seg.n;
        let dims = GqaDims { heads: c.cfg.num_attention_heads, kv_heads: g.num_key_value_heads, head_dim: g.head_dim };
        let kv = shaped(ctx, dims.kv_heads * dims.head_dim);
        let op = Op::GqaAttention { q: c.q, k: kv, v: kv, out: c.out, start: c.seg.start, dims, scale: c.scale, precision: c.precision };
        // In place over the paged pool, spread over the pool on both paths.
        self.cpu.book_op("attention", &op, self.cpu.threads);
        Ok(())
    }
}

/// The hybrid placement's routed experts on the simulated pool: the same
/// work as the CPU placement's, from the thread that serves them.
impl ExpertPool for SimCpu {
    fn sum(&self, _xs: &[f32], n: usize, d: usize, jobs: &[ExpertJob<HostWeight>], p: Precision) -> Result<Vec<f32>, ForwardError> {
        self.run_experts(n, d, jobs, p)?;
        Ok(vec![0.0; n * d])
    }
}
