//! The forward pass with its weights staged on a device, one module at a
//! time: what stream-loading prefill runs.
//!
//! [`Model::staged_modules`] cuts the model into modules in the order the
//! pass uses them, each with the host tensors a loader copies to the device:
//! embedding chunks, then per layer the attention block, the FFN's dense part
//! (a dense MLP, or the router and shared experts) and each routed expert,
//! then LM-head chunks. [`StagedPass`] runs one prompt through those modules
//! as their weights arrive, with every op on the device: the same ops, in the
//! same order and with the same roundings, as [`Model::forward_batch`], so
//! the logits and the KV cache it writes match the CPU engine's.
//!
//! The only host work is routing bookkeeping (which token goes to which
//! expert, from the router's top-k) and writing each layer's latents into the
//! paged KV pool.

use crate::checkpoint::{HostTensor, Linear};
use crate::kv_cache::{BlockTable, KvPool};
use crate::model::{Ffn, ForwardError, Logits, Mlp, Model, Precision, QProj};
use duplex_kernels::device::{self, Device, DeviceError, DevicePtr, DeviceWeight, Matrix, MlaDims, Op, StreamId};
use std::ops::Range;

/// One unit of staging: what the loader copies, and the model runs, at once.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ModuleKind {
    /// Rows of the embedding table.
    Embed { first_row: usize },
    /// A layer's norms and MLA projections.
    Attention { layer: usize },
    /// A dense layer's MLP, or a MoE layer's router and shared experts.
    Ffn { layer: usize },
    /// One routed expert.
    Expert { layer: usize, expert: usize },
    /// The final norm (first chunk only) and rows of the LM head.
    Head { first_row: usize },
}

pub struct StagedModule {
    pub kind: ModuleKind,
    pub tensors: Vec<HostTensor>,
}

/// Device placements start on this boundary.
const ALIGN: usize = 256;

fn align(x: usize) -> usize {
    x.div_ceil(ALIGN) * ALIGN
}

impl StagedModule {
    pub fn is_expert(&self) -> bool {
        matches!(self.kind, ModuleKind::Expert { .. })
    }

    /// Host bytes a load copies.
    pub fn bytes(&self) -> usize {
        self.tensors.iter().map(|t| t.data.len() + t.scales.as_ref().map_or(0, |s| s.len())).sum()
    }

    /// Device bytes the module occupies, each piece aligned.
    pub fn device_bytes(&self) -> usize {
        self.tensors.iter().map(|t| align(t.data.len()) + t.scales.as_ref().map_or(0, |s| align(s.len()))).sum()
    }

    /// Enqueue the copies of every tensor into `dst` (at least
    /// [`device_bytes`](Self::device_bytes) long) on `stream`, and return
    /// where each weight will be.
    pub fn upload(&self, dev: &dyn Device, stream: StreamId, dst: DevicePtr) -> Result<Vec<DeviceWeight>, DeviceError> {
        let mut offset = 0;
        let mut place = |bytes: &device::HostBytes| -> Result<DevicePtr, DeviceError> {
            let p = dst.slice(offset, bytes.len())?;
            offset += align(bytes.len());
            dev.upload(stream, bytes, p)?;
            Ok(p)
        };
        let mut out = Vec::with_capacity(self.tensors.len());
        for t in &self.tensors {
            let data = place(&t.data)?;
            let scales = match &t.scales {
                Some(s) => place(s)?,
                None => DevicePtr { addr: data.addr, bytes: 0 },
            };
            out.push(DeviceWeight { data, scales, rows: t.rows, cols: t.cols, format: t.format });
        }
        Ok(out)
    }
}

/// Row chunks of a `rows`-row weight of `row_bytes` per row, each at most
/// `max_bytes` (but at least one 128-row block, so FP8 scale blocks are
/// never split).
fn row_chunks(rows: usize, row_bytes: usize, max_bytes: usize) -> Vec<Range<usize>> {
    let per = (max_bytes / row_bytes.max(1)).max(128) / 128 * 128;
    (0..rows.div_ceil(per)).map(|i| i * per..((i + 1) * per).min(rows)).collect()
}

fn mlp_tensors(m: &Mlp) -> Vec<HostTensor> {
    vec![m.gate.host_tensor(), m.up.host_tensor(), m.down.host_tensor()]
}

fn chunked(w: &Linear, max_bytes: usize) -> impl Iterator<Item = Range<usize>> {
    row_chunks(w.rows, w.stored_bytes() / w.rows.max(1), max_bytes).into_iter()
}

impl Model {
    /// The model as modules, in the order a forward pass uses them. The
    /// embedding and LM head are cut into row chunks of at most
    /// `max_chunk_bytes`, so they fit a bounded staging budget.
    pub fn staged_modules(&self, max_chunk_bytes: usize) -> Vec<StagedModule> {
        let mut out = vec![];
        for rows in chunked(&self.embed, max_chunk_bytes) {
            out.push(StagedModule { kind: ModuleKind::Embed { first_row: rows.start }, tensors: vec![self.embed.host_rows(rows)] });
        }
        for (l, layer) in self.layers.iter().enumerate() {
            let a = &layer.attn;
            let mut t = vec![HostTensor::vector(&layer.input_norm)];
            match &a.q {
                QProj::Lora { a, norm, b } => t.extend([a.host_tensor(), HostTensor::vector(norm), b.host_tensor()]),
                QProj::Plain(w) => t.push(w.host_tensor()),
            }
            t.extend([a.kv_a.host_tensor(), HostTensor::vector(&a.kv_a_norm), a.kv_b.host_tensor(), a.o.host_tensor(), HostTensor::vector(&layer.post_attention_norm)]);
            out.push(StagedModule { kind: ModuleKind::Attention { layer: l }, tensors: t });
            match &layer.ffn {
                Ffn::Dense(mlp) => out.push(StagedModule { kind: ModuleKind::Ffn { layer: l }, tensors: mlp_tensors(mlp) }),
                Ffn::Moe(moe) => {
                    let mut t = vec![moe.router.host_tensor()];
                    t.extend(moe.correction_bias.as_deref().map(HostTensor::vector));
                    t.extend(moe.shared.iter().flat_map(mlp_tensors));
                    out.push(StagedModule { kind: ModuleKind::Ffn { layer: l }, tensors: t });
                    for (e, expert) in moe.experts.iter().enumerate() {
                        out.push(StagedModule { kind: ModuleKind::Expert { layer: l, expert: e }, tensors: mlp_tensors(expert) });
                    }
                }
            }
        }
        for (i, rows) in chunked(&self.lm_head, max_chunk_bytes).enumerate() {
            let mut t = vec![self.lm_head.host_rows(rows.clone())];
            if i == 0 {
                t.push(HostTensor::vector(&self.norm));
            }
            out.push(StagedModule { kind: ModuleKind::Head { first_row: rows.start }, tensors: t });
        }
        out
    }
}

#[derive(Debug, thiserror::Error)]
pub enum StagedError {
    #[error(transparent)]
    Forward(#[from] ForwardError),
    #[error(transparent)]
    Device(#[from] DeviceError),
    #[error("module {0:?} came with the wrong weights")]
    Weights(ModuleKind),
    #[error("a staged pass starts a sequence; this one already has {0} cached positions")]
    CachedPrefix(usize),
}

/// The device buffers of one pass, carved out of one allocation.
struct Workspace {
    tokens: DevicePtr,
    cos: Matrix,
    sin: Matrix,
    h: Matrix,
    x: Matrix,
    qa: Matrix,
    q: Matrix,
    latents: Matrix,
    kv: Matrix,
    attn: Matrix,
    out: Matrix,
    router: Matrix,
    route_ids: DevicePtr,
    route_weights: Matrix,
    expert_rows: DevicePtr,
    expert_scales: DevicePtr,
    xe: Matrix,
    gate: Matrix,
    up: Matrix,
    ye: Matrix,
    final_x: Matrix,
    logits: Matrix,
}

/// Heads whose expanded keys and values one step of attention materialises
/// for `n` positions: as many as fit `kv_bytes`, in steps that keep each
/// slice of `kv_b_proj` on whole FP8 scale blocks (all heads if no smaller
/// group does).
pub fn kv_heads_per_step(m: &Model, n: usize, kv_bytes: usize) -> usize {
    let c = &m.cfg;
    let (heads, dkv) = (c.num_attention_heads, c.qk_nope_head_dim + c.v_head_dim);
    let block = c.quantization.as_ref().map_or(1, |q| q.weight_block_size[0]);
    let step = (1..=heads).find(|g| (g * dkv) % block == 0).unwrap_or(heads);
    let fit = kv_bytes / (n.max(1) * dkv * 4).max(1);
    (fit / step * step).clamp(step, heads)
}

/// The `(rows, cols)` of each workspace buffer, in [`Workspace`]'s field
/// order, for a pass over `n` tokens returning `r` logits rows, with keys and
/// values expanded `g` heads at a time. (u32 buffers count as F32.)
fn workspace_plan(m: &Model, n: usize, r: usize, g: usize) -> [(usize, usize); 22] {
    let c = &m.cfg;
    let (d, heads, dv) = (c.hidden_size, c.num_attention_heads, c.v_head_dim);
    let inter = c.intermediate_size.max(c.moe_intermediate_size * c.n_shared_experts.max(1));
    let k = c.num_experts_per_tok.max(1);
    let (lora, experts) = (c.q_lora_rank.unwrap_or(0), c.n_routed_experts);
    let some = |cols: usize| if cols > 0 { (n, cols) } else { (0, 1) };
    [
        (n, 1),                                   // tokens (u32)
        (n, c.qk_rope_head_dim / 2),              // cos
        (n, c.qk_rope_head_dim / 2),              // sin
        (n, d),                                   // h
        (n, d),                                   // x
        some(lora),                               // qa
        (n, heads * c.qk_head_dim()),             // q
        (n, c.kv_entry_dim()),                    // latents
        (n, g * (c.qk_nope_head_dim + dv)),       // kv
        (n, heads * dv),                          // attn
        (n, d),                                   // out
        some(experts),                            // router logits
        (n * k, 1),                               // route ids (u32)
        (n, k),                                   // route weights
        (n * k, 1),                               // expert rows (u32)
        (n * k, 1),                               // expert scales
        (n, d),                                   // xe
        (n, inter),                               // gate
        (n, inter),                               // up
        (n, d),                                   // ye
        (r, d),                                   // final x
        (r, c.vocab_size),                        // logits
    ]
}

/// Device bytes of the activations of a pass over `n` tokens whose expanded
/// keys and values take at most about `kv_bytes` at a time.
pub fn workspace_bytes(model: &Model, n: usize, want: Logits, kv_bytes: usize) -> usize {
    let r = if want == Logits::All { n } else { 1 };
    workspace_plan(model, n, r, kv_heads_per_step(model, n, kv_bytes)).iter().map(|(rows, cols)| align(rows * cols * 4)).sum()
}

/// One prompt's pass through the staged modules, on one device stream.
pub struct StagedPass<'a> {
    model: &'a Model,
    dev: &'a dyn Device,
    stream: StreamId,
    precision: Precision,
    want: Logits,
    n: usize,
    start: usize,
    /// Heads per step of expanded attention.
    kv_heads: usize,
    ws: Workspace,
    /// Per expert of the current layer: `(first index, count)` into the
    /// uploaded row and scale lists.
    assignments: Vec<(usize, usize)>,
}

impl<'a> StagedPass<'a> {
    /// Prepare a pass of `tokens` starting the sequence of `table` (whose
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
    ) -> Result<Self, StagedError> {
        let cfg = &model.cfg;
        let n = tokens.len();
        if n == 0 {
            return Err(ForwardError::EmptySequence.into());
        }
        if let Some(&id) = tokens.iter().find(|&&t| t as usize >= cfg.vocab_size) {
            return Err(ForwardError::TokenOutOfRange { id, vocab: cfg.vocab_size }.into());
        }
        let start = table.len;
        if start != 0 {
            // Attention sees only this pass's latents on the device.
            return Err(StagedError::CachedPrefix(start));
        }
        if start + n > cfg.max_position_embeddings {
            return Err(ForwardError::TooLong { pos: start + n, max: cfg.max_position_embeddings }.into());
        }
        pool.reserve(table, start + n).map_err(ForwardError::from)?;
        let r = if want == Logits::All { n } else { 1 };
        let mut offset = 0;
        let kv_heads = kv_heads_per_step(model, n, kv_bytes);
        let mut plan = workspace_plan(model, n, r, kv_heads).into_iter();
        let mut next = || -> Result<Matrix, DeviceError> {
            let (rows, cols) = plan.next().expect("one plan entry per buffer");
            let m = workspace.slice(offset, rows * cols * 4)?.matrix(rows, cols);
            offset += align(rows * cols * 4);
            Ok(m)
        };
        let ws = Workspace {
            tokens: next()?.buf,
            cos: next()?,
            sin: next()?,
            h: next()?,
            x: next()?,
            qa: next()?,
            q: next()?,
            latents: next()?,
            kv: next()?,
            attn: next()?,
            out: next()?,
            router: next()?,
            route_ids: next()?.buf,
            route_weights: next()?,
            expert_rows: next()?.buf,
            expert_scales: next()?.buf,
            xe: next()?,
            gate: next()?,
            up: next()?,
            ye: next()?,
            final_x: next()?,
            logits: next()?,
        };
        let dr2 = cfg.qk_rope_head_dim / 2;
        let (mut cos, mut sin) = (vec![0.0; n * dr2], vec![0.0; n * dr2]);
        for i in 0..n {
            model.rope.cos_sin(start + i, &mut cos[i * dr2..(i + 1) * dr2], &mut sin[i * dr2..(i + 1) * dr2]);
        }
        device::upload_u32(dev, stream, tokens, ws.tokens)?;
        device::upload_f32(dev, stream, &cos, ws.cos.buf)?;
        device::upload_f32(dev, stream, &sin, ws.sin.buf)?;
        Ok(StagedPass { model, dev, stream, precision, want, n, start, kv_heads, ws, assignments: vec![] })
    }

    fn launch(&self, op: Op) -> Result<(), DeviceError> {
        self.dev.launch(self.stream, &op)
    }

    /// `y = x · Wᵀ` over the first `x.rows` rows, rounded as the CPU engine rounds linear layers.
    fn linear(&self, w: &DeviceWeight, x: Matrix, y: Matrix) -> Result<Matrix, DeviceError> {
        let y = y.rows(0..x.rows).reshape(x.rows, w.rows);
        self.launch(Op::Gemm { w: *w, x, y, precision: self.precision, round: self.precision == Precision::Bf16 })?;
        Ok(y)
    }

    fn norm(&self, x: Matrix, weight: &DeviceWeight, out: Matrix) -> Result<Matrix, DeviceError> {
        let out = out.rows(0..x.rows);
        self.launch(Op::RmsNorm { x, weight: weight.data, out, eps: self.model.cfg.rms_norm_eps, precision: self.precision })?;
        Ok(out)
    }

    /// `down(silu(gate·x) ⊙ up·x)` of `x` into `y`, unrounded (the caller
    /// combines, then rounds once).
    fn mlp(&self, w: &[DeviceWeight], x: Matrix, y: Matrix) -> Result<Matrix, DeviceError> {
        let rows = x.rows;
        let inter = w[0].rows;
        let g = self.ws.gate.rows(0..rows).reshape(rows, inter);
        let u = self.ws.up.rows(0..rows).reshape(rows, inter);
        let y = y.rows(0..rows).reshape(rows, w[2].rows);
        self.launch(Op::Gemm { w: w[0], x, y: g, precision: self.precision, round: false })?;
        self.launch(Op::Gemm { w: w[1], x, y: u, precision: self.precision, round: false })?;
        self.launch(Op::SiluMul { gate: g, up: u, precision: self.precision })?;
        self.launch(Op::Gemm { w: w[2], x: g, y, precision: self.precision, round: false })?;
        Ok(y)
    }

    /// Run one module whose weights are on the device (enqueued on this
    /// pass's stream after whatever made them ready). `pool` receives each
    /// layer's latents.
    pub fn run(&mut self, kind: ModuleKind, w: &[DeviceWeight], pool: &mut KvPool, table: &BlockTable) -> Result<(), StagedError> {
        let model: &'a Model = self.model;
        let cfg = &model.cfg;
        let p = self.precision;
        let n = self.n;
        let ws = &self.ws;
        let count = |c: usize| if w.len() == c { Ok(()) } else { Err(StagedError::Weights(kind)) };
        match kind {
            ModuleKind::Embed { first_row } => {
                count(1)?;
                self.launch(Op::Embedding { table: w[0], first_row, ids: ws.tokens, count: n, out: ws.h.rows(0..n), precision: p })?;
            }
            ModuleKind::Attention { layer } => {
                let lora = cfg.q_lora_rank.is_some();
                count(if lora { 9 } else { 7 })?;
                let (heads, dn, dr, dv, dc) = (cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank);
                let h = ws.h.rows(0..n);
                let x = self.norm(h, &w[0], ws.x)?;
                let (q, rest) = if lora {
                    let qa = self.linear(&w[1], x, ws.qa)?;
                    let qa_normed = self.norm(qa, &w[2], ws.qa)?;
                    (self.linear(&w[3], qa_normed, ws.q)?, &w[4..])
                } else {
                    (self.linear(&w[1], x, ws.q)?, &w[2..])
                };
                let [kv_a, kv_a_norm, kv_b, o, post_norm] = rest else { return Err(StagedError::Weights(kind)) };
                // The latents are written where kv_a_proj put them: norm of
                // the compressed part, rotation of the shared rope key.
                let latents = self.linear(kv_a, x, ws.latents)?;
                self.norm(latents.columns(0..dc), kv_a_norm, latents.columns(0..dc))?;
                self.launch(Op::Rope { x: latents.columns(dc..dc + dr), cos: ws.cos, sin: ws.sin, rows_per_position: 1, interleaved: cfg.rope_interleave, precision: p })?;
                let q_heads = q.reshape(n * heads, dn + dr).columns(dn..dn + dr);
                self.launch(Op::Rope { x: q_heads, cos: ws.cos, sin: ws.sin, rows_per_position: heads, interleaved: cfg.rope_interleave, precision: p })?;
                self.store_latents(layer, latents, pool, table)?;
                // Keys and values expanded a group of heads at a time, so
                // their memory stays bounded however long the prompt.
                let attn = ws.attn.rows(0..n);
                let dkv = dn + dv;
                for h0 in (0..heads).step_by(self.kv_heads) {
                    let g = self.kv_heads.min(heads - h0);
                    let kv = self.linear(&kv_b.rows(h0 * dkv..(h0 + g) * dkv)?, latents.columns(0..dc), ws.kv)?;
                    let (q, out) = (q.columns(h0 * (dn + dr)..(h0 + g) * (dn + dr)), attn.columns(h0 * dv..(h0 + g) * dv));
                    let dims = MlaDims { heads: g, dn, dr, dv, dc };
                    self.launch(Op::MlaPrefill { q, kv, latents, out, start: self.start, dims, scale: model.softmax_scale, precision: p })?;
                }
                let out = self.linear(o, attn, ws.out)?;
                self.launch(Op::Add { h, delta: out, precision: p })?;
                self.norm(h, post_norm, ws.x)?;
            }
            ModuleKind::Ffn { layer } => {
                let x = ws.x.rows(0..n);
                let h = ws.h.rows(0..n);
                if !cfg.is_moe_layer(layer) {
                    count(3)?;
                    let y = self.mlp(w, x, ws.out)?;
                    if p == Precision::Bf16 {
                        self.launch(Op::RoundBf16 { x: y })?;
                    }
                    self.launch(Op::Add { h, delta: y, precision: p })?;
                    return Ok(());
                }
                let has_bias = cfg.use_correction_bias;
                count(1 + has_bias as usize + 3 * (cfg.n_shared_experts > 0) as usize)?;
                let e = cfg.n_routed_experts;
                let logits = ws.router.rows(0..n).reshape(n, e);
                // Router logits in F32, as the CPU engine computes them.
                self.launch(Op::Gemm { w: w[0], x, y: logits, precision: Precision::F32, round: false })?;
                let k = cfg.num_experts_per_tok;
                let weights = ws.route_weights.rows(0..n).reshape(n, k);
                self.launch(Op::Route { logits, bias: has_bias.then_some(w[1].data), params: self.model.router.clone(), ids: ws.route_ids, weights, precision: p })?;
                let moe_out = ws.out.rows(0..n);
                self.launch(Op::Zero { x: moe_out })?;
                if cfg.n_shared_experts > 0 {
                    let shared = &w[1 + has_bias as usize..];
                    let y = self.mlp(shared, x, ws.ye)?;
                    self.launch(Op::Add { h: moe_out, delta: y, precision: Precision::F32 })?;
                }
                self.assign(n, k, e, weights)?;
            }
            ModuleKind::Expert { expert, .. } => {
                count(3)?;
                let &(first, tokens) = self.assignments.get(expert).ok_or(StagedError::Weights(kind))?;
                if tokens > 0 {
                    let rows = ws.expert_rows.slice(first * 4, tokens * 4)?;
                    let scales = ws.expert_scales.slice(first * 4, tokens * 4)?;
                    let xe = ws.xe.rows(0..tokens);
                    self.launch(Op::GatherRows { src: ws.x.rows(0..n), rows, count: tokens, dst: xe })?;
                    let y = self.mlp(w, xe, ws.ye)?;
                    self.launch(Op::ScatterAddRows { src: y, rows, scales, count: tokens, dst: ws.out.rows(0..n) })?;
                }
                if expert + 1 == cfg.n_routed_experts {
                    let moe_out = ws.out.rows(0..n);
                    if p == Precision::Bf16 {
                        self.launch(Op::RoundBf16 { x: moe_out })?;
                    }
                    self.launch(Op::Add { h: ws.h.rows(0..n), delta: moe_out, precision: p })?;
                }
            }
            ModuleKind::Head { first_row } => {
                let r = if self.want == Logits::All { n } else { 1 };
                let final_x = ws.final_x.rows(0..r);
                if first_row == 0 {
                    count(2)?;
                    let rows = if self.want == Logits::All { ws.h.rows(0..n) } else { ws.h.rows(n - 1..n) };
                    self.norm(rows, &w[1], final_x)?;
                } else {
                    count(1)?;
                }
                let y = ws.logits.rows(0..r).columns(first_row..first_row + w[0].rows);
                // Logits stay F32: the sampler and logprobs want them unrounded.
                self.launch(Op::Gemm { w: w[0], x: final_x, y, precision: p, round: false })?;
            }
        }
        Ok(())
    }

    /// Bring the layer's latents back and write them into the sequence's
    /// blocks of the paged pool.
    fn store_latents(&self, layer: usize, latents: Matrix, pool: &mut KvPool, table: &BlockTable) -> Result<(), StagedError> {
        let rows = device::download_matrix(self.dev, self.stream, latents)?;
        for (i, entry) in rows.chunks(latents.cols).enumerate() {
            pool.entry_mut(table, layer, self.start + i).copy_from_slice(entry);
        }
        Ok(())
    }

    /// Fetch the router's choices, group token rows by expert, and upload
    /// the per-expert row and scale lists.
    fn assign(&mut self, n: usize, k: usize, experts: usize, weights: Matrix) -> Result<(), StagedError> {
        let ids = device::download_u32(self.dev, self.stream, self.ws.route_ids.slice(0, n * k * 4)?)?;
        let ws = device::download_matrix(self.dev, self.stream, weights)?;
        let mut per_expert: Vec<Vec<(u32, f32)>> = vec![vec![]; experts];
        for (i, (chosen, w)) in ids.chunks(k).zip(ws.chunks(k)).enumerate() {
            for (&e, &w) in chosen.iter().zip(w) {
                per_expert.get_mut(e as usize).ok_or_else(|| DeviceError::Backend(format!("router chose expert {e} of {experts}")))?.push((i as u32, w));
            }
        }
        let (mut rows, mut scales) = (Vec::with_capacity(n * k), Vec::with_capacity(n * k));
        self.assignments.clear();
        for list in &per_expert {
            self.assignments.push((rows.len(), list.len()));
            rows.extend(list.iter().map(|&(r, _)| r));
            scales.extend(list.iter().map(|&(_, w)| w));
        }
        if !rows.is_empty() {
            device::upload_u32(self.dev, self.stream, &rows, self.ws.expert_rows.slice(0, rows.len() * 4)?)?;
            device::upload_f32(self.dev, self.stream, &scales, self.ws.expert_scales.slice(0, scales.len() * 4)?)?;
        }
        Ok(())
    }

    /// The logits (`[rows, vocab]`) once every module has run; the sequence's
    /// table then covers the new tokens.
    pub fn finish(self, table: &mut BlockTable) -> Result<Vec<f32>, StagedError> {
        let r = if self.want == Logits::All { self.n } else { 1 };
        let logits = device::download_matrix(self.dev, self.stream, self.ws.logits.rows(0..r))?;
        table.len = self.start + self.n;
        Ok(logits)
    }
}
