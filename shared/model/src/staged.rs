//! The device placement: the forward program with every op on an
//! accelerator and its weights staged there one module at a time, which is
//! what stream-loading prefill runs.
//!
//! [`Model::staged_modules`] lists the model's modules with the host
//! tensors a loader copies to the device (the embedding and LM head cut
//! into row chunks that fit a bounded budget); [`StagedPass`] runs one
//! prompt through them as their weights arrive, on one device stream. The
//! program is [`crate::forward`]'s, the same as the CPU engine's, so the
//! logits and the KV cache a staged pass writes match the CPU engine's.
//!
//! The host's only work is routing bookkeeping (which rows go to which
//! expert, from the router's top-k) and moving KV entries between the
//! device and the paged pool.

use crate::backend::{AttentionCall, Backend, ExpertJob, ExpertScratch, RouteCall, Routes, Segment, Tokens};
use crate::checkpoint::HostTensor;
use crate::forward::{align, Pass, PassShape};
use crate::kv_cache::{BlockTable, KvPool};
use crate::model::{ForwardError, Logits, Model, Precision, SeqInput};
use crate::weights::{HostWeight, Weights};
use duplex_kernels::device::{self, Device, DeviceError, DevicePtr, DeviceWeight, GqaDims, Matrix, MlaDims, Op, StreamId};
use std::ops::Range;

pub use crate::forward::ModuleKind;

/// The errors of a staged pass are those of any pass.
pub type StagedError = ForwardError;

/// One unit of staging: what the loader copies, and the pass runs, at once.
pub struct StagedModule {
    pub kind: ModuleKind,
    pub tensors: Weights<HostTensor>,
}

impl StagedModule {
    pub fn is_expert(&self) -> bool {
        matches!(self.kind, ModuleKind::Expert { .. })
    }

    /// Host bytes a load copies.
    pub fn bytes(&self) -> usize {
        self.tensors.iter().map(|(_, t)| t.data.len() + t.scales.as_ref().map_or(0, |s| s.len())).sum()
    }

    /// Device bytes the module occupies, each piece aligned.
    pub fn device_bytes(&self) -> usize {
        self.tensors.iter().map(|(_, t)| align(t.data.len()) + t.scales.as_ref().map_or(0, |s| align(s.len()))).sum()
    }

    /// Enqueue the copies of every tensor into `dst` (at least
    /// [`device_bytes`](Self::device_bytes) long) on `stream`, and return
    /// where each weight will be, under its name.
    pub fn upload(&self, dev: &dyn Device, stream: StreamId, dst: DevicePtr) -> Result<Weights<DeviceWeight>, DeviceError> {
        let mut offset = 0;
        let mut place = |bytes: &device::HostBytes| -> Result<DevicePtr, DeviceError> {
            let p = dst.slice(offset, bytes.len())?;
            offset += align(bytes.len());
            dev.upload(stream, bytes, p)?;
            Ok(p)
        };
        self.tensors.try_map(|t| {
            let data = place(&t.data)?;
            let scales = match &t.scales {
                Some(s) => place(s)?,
                None => DevicePtr { addr: data.addr, bytes: 0 },
            };
            Ok(Some(DeviceWeight { data, scales, rows: t.rows, cols: t.cols, format: t.format }))
        })
    }
}

/// Row chunks of a `rows`-row weight of `row_bytes` per row, each at most
/// `max_bytes` (but at least one 128-row block, so FP8 scale blocks are
/// never split).
fn row_chunks(rows: usize, row_bytes: usize, max_bytes: usize) -> Vec<Range<usize>> {
    let per = (max_bytes / row_bytes.max(1)).max(128) / 128 * 128;
    (0..rows.div_ceil(per)).map(|i| i * per..((i + 1) * per).min(rows)).collect()
}

impl Model {
    /// The model as modules, in the order a forward pass uses them, with
    /// the tensors a device copies. The embedding and LM head are cut into
    /// row chunks of at most `max_chunk_bytes`, so they fit a bounded
    /// staging budget.
    pub fn staged_modules(&self, max_chunk_bytes: usize) -> Vec<StagedModule> {
        let mut out = vec![];
        for m in &self.modules {
            let chunked = match m.kind {
                ModuleKind::Embed { .. } => Some("embed_tokens"),
                ModuleKind::Head { .. } => Some("lm_head"),
                _ => None,
            };
            let Some(name) = chunked else {
                let tensors = m.weights.filter_map(HostWeight::host_tensor);
                out.push(StagedModule { kind: m.kind, tensors });
                continue;
            };
            let Some(HostWeight::Matrix(w)) = m.weights.find(name) else { continue };
            for (i, rows) in row_chunks(w.rows, w.stored_bytes() / w.rows.max(1), max_chunk_bytes).into_iter().enumerate() {
                let mut tensors = Weights::default().with(name, w.host_rows(rows.clone()));
                let kind = match m.kind {
                    ModuleKind::Embed { .. } => ModuleKind::Embed { first_row: rows.start },
                    _ => {
                        if i == 0 {
                            if let Some(norm) = m.weights.find("norm").and_then(|n| n.host_tensor()) {
                                tensors.push("norm", norm);
                            }
                        }
                        ModuleKind::Head { first_row: rows.start }
                    }
                };
                out.push(StagedModule { kind, tensors });
            }
        }
        out
    }
}

/// Device bytes of the activations of a pass over `n` new tokens after
/// `cached` ones, whose expanded keys and values take at most about
/// `kv_bytes` at a time.
pub fn workspace_bytes(model: &Model, cached: usize, n: usize, want: Logits, kv_bytes: usize) -> Result<usize, ForwardError> {
    let shape: PassShape = Pass::<DeviceBackend>::shape(&model.cfg, std::iter::once((cached, n)), want, kv_bytes)?;
    Ok(crate::forward::workspace_bytes(&model.cfg, shape))
}

/// The forward program's ops, enqueued on one stream of a device.
pub struct DeviceBackend<'a> {
    pub(crate) dev: &'a dyn Device,
    pub(crate) stream: StreamId,
    workspace: DevicePtr,
}

impl<'a> DeviceBackend<'a> {
    pub(crate) fn new(dev: &'a dyn Device, stream: StreamId, workspace: DevicePtr) -> Self {
        DeviceBackend { dev, stream, workspace }
    }

    /// A route op's choices, `(expert, weight)` per row, once it has run.
    pub(crate) fn route_results(&self, (ids, weights): (DevicePtr, Matrix), n: usize, k: usize) -> Result<Vec<Vec<(usize, f32)>>, ForwardError> {
        let ids = device::download_u32(self.dev, self.stream, ids.slice(0, n * k * 4)?)?;
        let ws = device::download_matrix(self.dev, self.stream, weights)?;
        Ok(ids.chunks(k).zip(ws.chunks(k)).map(|(e, w)| e.iter().map(|&e| e as usize).zip(w.iter().copied()).collect()).collect())
    }

    pub(crate) fn launch(&self, op: Op) -> Result<(), ForwardError> {
        Ok(self.dev.launch(self.stream, &op)?)
    }

    /// `down(silu(gate·x) ⊙ up·x)` of `x` into `y`, unrounded.
    fn mlp(&self, job: &ExpertJob<DeviceWeight>, x: Matrix, s: &ExpertScratch, p: Precision) -> Result<Matrix, ForwardError> {
        let (rows, inter) = (x.rows, job.gate.rows);
        let g = s.gate.rows(0..rows).reshape(rows, inter);
        let u = s.up.rows(0..rows).reshape(rows, inter);
        let y = s.ye.rows(0..rows).reshape(rows, job.down.rows);
        self.launch(Op::Gemm { w: *job.gate, x, y: g, precision: p, round: false })?;
        self.launch(Op::Gemm { w: *job.up, x, y: u, precision: p, round: false })?;
        self.launch(Op::SiluMul { gate: g, up: u, precision: p })?;
        self.launch(Op::Gemm { w: *job.down, x: g, y, precision: p, round: false })?;
        Ok(y)
    }

    /// The segment's whole context `[ctx, entry]`: its fresh entries when it
    /// starts the sequence, else every cached entry brought from the pool.
    fn context(&self, c: &AttentionCall) -> Result<Matrix, ForwardError> {
        if c.seg.start == 0 {
            return Ok(c.fresh);
        }
        let ctx = c.seg.start + c.seg.n;
        let entries: Vec<f32> = (0..ctx).flat_map(|t| c.pool.entry(&c.seg.table, c.layer, t).iter().copied()).collect();
        let dst = c.context.rows(0..ctx);
        if dst.rows != ctx || !dst.is_contiguous() {
            return Err(ForwardError::Workspace(format!("no room for {ctx} positions of cached context")));
        }
        device::upload_f32(self.dev, self.stream, &entries, dst.buf.slice(dst.offset * 4, entries.len() * 4)?)?;
        Ok(dst)
    }
}

impl Backend for DeviceBackend<'_> {
    type Weight = DeviceWeight;
    // A device expands every segment's keys and values (it has no absorbed form yet).
    const ATTENDS_IN_PLACE: bool = false;

    fn rows_of(w: &DeviceWeight) -> Result<usize, ForwardError> {
        Ok(w.rows)
    }

    fn workspace(&mut self, bytes: usize) -> Result<DevicePtr, ForwardError> {
        if bytes > self.workspace.bytes {
            return Err(ForwardError::Workspace(format!("the pass needs {bytes} bytes of device workspace, {} were given", self.workspace.bytes)));
        }
        Ok(self.workspace.slice(0, bytes)?)
    }

    fn upload_f32(&mut self, xs: &[f32], dst: DevicePtr) -> Result<(), ForwardError> {
        Ok(device::upload_f32(self.dev, self.stream, xs, dst.slice(0, xs.len() * 4)?)?)
    }

    fn upload_u32(&mut self, xs: &[u32], dst: DevicePtr) -> Result<(), ForwardError> {
        Ok(device::upload_u32(self.dev, self.stream, xs, dst.slice(0, xs.len() * 4)?)?)
    }

    fn download(&mut self, m: Matrix) -> Result<Vec<f32>, ForwardError> {
        Ok(device::download_matrix(self.dev, self.stream, m)?)
    }

    fn embedding(&mut self, table: &DeviceWeight, first_row: usize, ids: DevicePtr, count: usize, out: Matrix, p: Precision) -> Result<(), ForwardError> {
        self.launch(Op::Embedding { table: *table, first_row, ids, count, out, precision: p })
    }

    fn gemm(&mut self, w: &DeviceWeight, x: Matrix, y: Matrix, p: Precision, round: bool) -> Result<(), ForwardError> {
        self.launch(Op::Gemm { w: *w, x, y, precision: p, round: round && p == Precision::Bf16 })
    }

    fn router_logits(&mut self, w: &DeviceWeight, x: Matrix, y: Matrix, _p: Precision) -> Result<(), ForwardError> {
        self.launch(Op::Gemm { w: *w, x, y, precision: Precision::F32, round: false })
    }

    fn rms_norm(&mut self, x: Matrix, weight: &DeviceWeight, out: Matrix, eps: f32, p: Precision) -> Result<(), ForwardError> {
        self.launch(Op::RmsNorm { x, weight: weight.data, out, eps, precision: p })
    }

    fn rope(&mut self, x: Matrix, cos: Matrix, sin: Matrix, rows_per_position: usize, interleaved: bool, p: Precision) -> Result<(), ForwardError> {
        self.launch(Op::Rope { x, cos, sin, rows_per_position, interleaved, precision: p })
    }

    fn add(&mut self, h: Matrix, delta: Matrix, p: Precision) -> Result<(), ForwardError> {
        self.launch(Op::Add { h, delta, precision: p })
    }

    fn round_bf16(&mut self, x: Matrix) -> Result<(), ForwardError> {
        self.launch(Op::RoundBf16 { x })
    }

    fn zero(&mut self, x: Matrix) -> Result<(), ForwardError> {
        self.launch(Op::Zero { x })
    }

    fn copy(&mut self, src: Matrix, dst: Matrix) -> Result<(), ForwardError> {
        self.launch(Op::Zero { x: dst })?;
        self.launch(Op::Add { h: dst, delta: src, precision: Precision::F32 })
    }

    fn route(&mut self, c: RouteCall<'_, DeviceWeight>) -> Result<Routes, ForwardError> {
        let (n, k) = (c.logits.rows, c.params.top_k);
        self.launch(Op::Route { logits: c.logits, bias: c.bias.map(|b| b.data), params: c.params.clone(), ids: c.ids, weights: c.weights, precision: c.precision })?;
        Ok(Routes::Chosen(self.route_results((c.ids, c.weights), n, k)?))
    }

    fn experts(&mut self, x: Matrix, jobs: &[ExpertJob<DeviceWeight>], out: Matrix, p: Precision, s: &ExpertScratch) -> Result<(), ForwardError> {
        for job in jobs {
            match job.tokens {
                Tokens::All => {
                    let y = self.mlp(job, x, s, p)?;
                    self.launch(Op::Add { h: out, delta: y, precision: Precision::F32 })?;
                }
                Tokens::Rows(list) => {
                    let count = list.len();
                    let rows: Vec<u32> = list.iter().map(|&(r, _)| r as u32).collect();
                    let scales: Vec<f32> = list.iter().map(|&(_, w)| w).collect();
                    // Each expert's lists have their own place, so no upload
                    // overwrites a list an earlier launch still reads.
                    let (rows_at, scales_at) = (s.rows.slice(job.first * 4, count * 4)?, s.scales.slice(job.first * 4, count * 4)?);
                    device::upload_u32(self.dev, self.stream, &rows, rows_at)?;
                    device::upload_f32(self.dev, self.stream, &scales, scales_at)?;
                    let xe = s.xe.rows(0..count);
                    self.launch(Op::GatherRows { src: x, rows: rows_at, count, dst: xe })?;
                    let y = self.mlp(job, xe, s, p)?;
                    self.launch(Op::ScatterAddRows { src: y, rows: rows_at, scales: scales_at, count, dst: out })?;
                }
            }
        }
        Ok(())
    }

    fn store_kv(&mut self, layer: usize, parts: &[Matrix], seg: &Segment, pool: &mut KvPool) -> Result<(), ForwardError> {
        let rows: Vec<Vec<f32>> = parts.iter().map(|m| device::download_matrix(self.dev, self.stream, *m)).collect::<Result<_, _>>()?;
        for i in 0..seg.n {
            let entry = pool.entry_mut(&seg.table, layer, seg.start + i);
            let mut at = 0;
            for (part, r) in parts.iter().zip(&rows) {
                entry[at..at + part.cols].copy_from_slice(&r[i * part.cols..(i + 1) * part.cols]);
                at += part.cols;
            }
        }
        Ok(())
    }

    fn mla_attention(&mut self, c: &AttentionCall, w: &Weights<DeviceWeight>) -> Result<(), ForwardError> {
        let context = self.context(c)?;
        self.mla_over(c, w.get("kv_b_proj")?, context)
    }

    fn gqa_attention(&mut self, c: &AttentionCall) -> Result<(), ForwardError> {
        let context = self.context(c)?;
        self.gqa_over(c, context)
    }
}

impl DeviceBackend<'_> {
    /// MLA of one segment over its whole context `[ctx, entry]` on the
    /// device, in the expanded form.
    pub(crate) fn mla_over(&mut self, c: &AttentionCall, kv_b: &DeviceWeight, context: Matrix) -> Result<(), ForwardError> {
        let (cfg, m) = (c.cfg, c.cfg.mla().expect("MLA"));
        let (heads, dn, dr, dv, dc) = (cfg.num_attention_heads, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim, m.kv_lora_rank);
        let ctx = context.rows;
        let dkv = dn + dv;
        // Keys and values expanded a group of heads at a time, so that
        // their memory stays bounded however long the prompt.
        for h0 in (0..heads).step_by(c.heads_per_step.max(1)) {
            let g = c.heads_per_step.min(heads - h0);
            let kv = c.expanded.reshape(ctx, g * dkv);
            self.gemm(&kv_b.rows(h0 * dkv..(h0 + g) * dkv)?, context.columns(0..dc), kv, c.precision, true)?;
            let (q, out) = (c.q.columns(h0 * (dn + dr)..(h0 + g) * (dn + dr)), c.out.columns(h0 * dv..(h0 + g) * dv));
            let dims = MlaDims { heads: g, dn, dr, dv, dc };
            self.launch(Op::MlaPrefill { q, kv, latents: context, out, start: c.seg.start, dims, scale: c.scale, precision: c.precision })?;
        }
        Ok(())
    }

    /// Grouped-query attention of one segment over its whole context on the device.
    pub(crate) fn gqa_over(&mut self, c: &AttentionCall, context: Matrix) -> Result<(), ForwardError> {
        let (cfg, g) = (c.cfg, c.cfg.gqa().expect("GQA"));
        let kvd = g.num_key_value_heads * g.head_dim;
        let dims = GqaDims { heads: cfg.num_attention_heads, kv_heads: g.num_key_value_heads, head_dim: g.head_dim };
        let (k, v) = (context.columns(0..kvd), context.columns(kvd..2 * kvd));
        self.launch(Op::GqaAttention { q: c.q, k, v, out: c.out, start: c.seg.start, dims, scale: c.scale, precision: c.precision })
    }
}

/// One prompt's pass through the staged modules, on one device stream.
pub struct StagedPass<'a> {
    pass: Pass<'a, DeviceBackend<'a>>,
}

impl<'a> StagedPass<'a> {
    /// Prepare a pass of `tokens` continuing the sequence of `table` (whose
    /// blocks must hold them), with activations in `workspace` (at least
    /// [`workspace_bytes`] long for the same `kv_bytes`).
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        model: &'a Model,
        dev: &'a dyn Device,
        stream: StreamId,
        pool: &mut KvPool,
        table: &mut BlockTable,
        tokens: &[u32],
        precision: Precision,
        want: Logits,
        workspace: DevicePtr,
        kv_bytes: usize,
    ) -> Result<Self, ForwardError> {
        let backend = DeviceBackend::new(dev, stream, workspace);
        let pass = Pass::new(model, backend, pool, &mut [SeqInput { table, tokens }], precision, want, kv_bytes)?;
        Ok(StagedPass { pass })
    }

    /// Run one module whose weights are on the device (enqueued on this
    /// pass's stream after whatever made them ready). `pool` receives each
    /// layer's KV entries.
    pub fn run(&mut self, kind: ModuleKind, w: &Weights<DeviceWeight>, pool: &mut KvPool) -> Result<(), ForwardError> {
        self.pass.run(kind, w, pool)
    }

    /// The logits (`[rows, vocab]`) once every module has run; the sequence's
    /// table then covers the new tokens.
    pub fn finish(self, table: &mut BlockTable) -> Result<Vec<f32>, ForwardError> {
        Ok(self.pass.finish(&mut [table])?.0)
    }
}
