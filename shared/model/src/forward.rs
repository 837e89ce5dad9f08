//! The forward program: every architecture's layers, written once over a
//! [`Backend`].
//!
//! A pass runs the model's modules in order — embedding, then per layer the
//! attention block, the FFN (a dense MLP, or a MoE's router and shared
//! experts) and the routed experts, then the LM head — each with its weights
//! looked up by name. Where the weights live is the placement's business: the
//! CPU engine hands every module its weights from the host mapping at once,
//! stream-loading prefill hands them over as they arrive on a device (a few
//! experts at a time), and the program neither knows nor cares.
//!
//! The roundings are the numeric contract: on the BF16 path every op's
//! output (linear layers, norms, rotations, attention) is rounded to BF16
//! where transformers rounds it, expert outputs are summed in F32 and
//! rounded once, and logits stay F32. The residual stream itself stays F32,
//! as llama.cpp keeps it: rounding it after every block was the largest
//! error of the BF16 path (on the three fixtures it roughly halves the mean
//! logit error against transformers' float32).

use crate::backend::{AttentionCall, Backend, ExpertJob, ExpertScratch, RouteCall, Routes, Segment, Tokens};
use crate::config::{AttentionConfig, ModelConfig};
use crate::kv_cache::{BlockTable, KvPool};
use crate::model::{ForwardError, ForwardTimings, Logits, Model, Precision, SeqInput};
use crate::weights::Weights;
use duplex_kernels::device::{DevicePtr, Matrix};
use std::time::{Duration, Instant};

/// One unit of the program: what a placement loads, and the pass runs, at once.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ModuleKind {
    /// Rows of the embedding table (`embed_tokens`).
    Embed { first_row: usize },
    /// A layer's norms and attention projections.
    Attention { layer: usize },
    /// A dense layer's MLP, or a MoE layer's router and shared experts.
    Ffn { layer: usize },
    /// One routed expert.
    Expert { layer: usize, expert: usize },
    /// The final norm (with the first chunk) and rows of the LM head.
    Head { first_row: usize },
}

impl ModuleKind {
    pub fn layer(self) -> Option<usize> {
        match self {
            ModuleKind::Attention { layer } | ModuleKind::Ffn { layer } | ModuleKind::Expert { layer, .. } => Some(layer),
            ModuleKind::Embed { .. } | ModuleKind::Head { .. } => None,
        }
    }
}

/// A MoE layer's routing as per-expert work: for each expert, its `(row,
/// weight)` pairs, split into the experts that run now and the deferred
/// ones (Expert Deferral), with where each expert's rows start in the
/// layer's row lists (the immediate experts' lists, then the deferred ones').
#[derive(Default)]
pub struct Assignment {
    now: Vec<Vec<(usize, f32)>>,
    now_firsts: Vec<usize>,
    deferred: Vec<Vec<(usize, f32)>>,
    deferred_firsts: Vec<usize>,
}

impl Assignment {
    /// Split the router's choices (per token, `(expert, weight)`) among
    /// `n_experts`: of each token's experts, the `defer` with the lowest
    /// weights are deferred. Reuses the lists' memory.
    pub fn assign(&mut self, chosen: &[Vec<(usize, f32)>], n_experts: usize, defer: usize) -> Result<(), ForwardError> {
        for lists in [&mut self.now, &mut self.deferred] {
            lists.iter_mut().for_each(|a| a.clear());
            lists.resize_with(n_experts, Vec::new);
        }
        for (row, picks) in chosen.iter().enumerate() {
            let mut picks = std::borrow::Cow::Borrowed(picks.as_slice());
            if defer > 0 {
                // Highest weights first; a stable sort keeps the router's order on ties.
                picks.to_mut().sort_by(|a, b| b.1.total_cmp(&a.1));
            }
            let immediate = picks.len().saturating_sub(defer);
            for (rank, &(expert, weight)) in picks.iter().enumerate() {
                let lists = if rank < immediate { &mut self.now } else { &mut self.deferred };
                lists.get_mut(expert).ok_or(ForwardError::Routing { expert, experts: n_experts })?.push((row, weight));
            }
        }
        let mut first = 0;
        for (firsts, lists) in [(&mut self.now_firsts, &self.now), (&mut self.deferred_firsts, &self.deferred)] {
            firsts.clear();
            for a in lists {
                firsts.push(first);
                first += a.len();
            }
        }
        Ok(())
    }

    /// The jobs of `experts` (index, weights) that have rows: the immediate
    /// ones, or with `deferred` the deferred ones.
    pub fn jobs<'a, W>(&'a self, experts: &[(usize, &'a Weights<W>)], deferred: bool) -> Result<Vec<ExpertJob<'a, W>>, ForwardError> {
        let (lists, firsts) = if deferred { (&self.deferred, &self.deferred_firsts) } else { (&self.now, &self.now_firsts) };
        let mut jobs = Vec::with_capacity(experts.len());
        for &(e, w) in experts {
            let rows = lists.get(e).ok_or(ForwardError::Routing { expert: e, experts: lists.len() })?;
            if !rows.is_empty() {
                jobs.push(ExpertJob::named(w, "", Tokens::Rows(rows), firsts[e], e)?);
            }
        }
        Ok(jobs)
    }
}

/// The activations of a pass, carved out of one workspace.
struct Workspace {
    tokens: DevicePtr,
    cos: Matrix,
    sin: Matrix,
    h: Matrix,
    x: Matrix,
    /// The FFN's normed input unrounded, for the router.
    x_router: Matrix,
    /// Expert Deferral: a MoE layer's input, kept for its deferred experts,
    /// and their summed output, added to the next MoE layer's.
    x_deferred: Matrix,
    out_deferred: Matrix,
    qa: Matrix,
    q: Matrix,
    /// The new tokens' KV entries, as the cache stores them.
    fresh: Matrix,
    context: Matrix,
    expanded: Matrix,
    /// MLA's absorbed decode on a device: per head `[q_latent | context latent | keys and values]`.
    absorbed: Matrix,
    attn: Matrix,
    /// Context-parallel attention: a partial result over one range of keys,
    /// and the log-sum-exp of the accumulated and of the partial one.
    attn_part: Matrix,
    lse: Matrix,
    lse_part: Matrix,
    out: Matrix,
    router: Matrix,
    route_ids: DevicePtr,
    route_weights: Matrix,
    /// Expert parallelism: the routed experts' input and this rank's
    /// partial sums over every rank's rows.
    x_all: Matrix,
    out_all: Matrix,
    experts: ExpertScratch,
    final_x: Matrix,
    logits: Matrix,
}

/// Device placements start on this boundary.
pub const ALIGN: usize = 256;

pub fn align(x: usize) -> usize {
    x.div_ceil(ALIGN) * ALIGN
}

/// The shape of a pass, which sizes its workspace.
#[derive(Clone, Copy, Debug)]
pub struct PassShape {
    /// Rows (new tokens) in the batch.
    pub n: usize,
    /// Logits rows returned.
    pub r: usize,
    /// Rows of cached context a segment may need brought in (0: none).
    pub context: usize,
    /// Rows of context whose keys and values are expanded (MLA; 0: none).
    pub expanded: usize,
    /// Heads expanded at a time.
    pub heads_per_step: usize,
    /// Rows of every rank together, whose routed experts this pass runs
    /// (expert parallelism; 0: none).
    pub ep_rows: usize,
    /// Whether attention is computed in parts over ranges of keys and
    /// merged (context parallelism).
    pub partial_attention: bool,
}

/// Lay out the workspace with `carve(rows, cols)` (in F32 units; u32
/// buffers count as F32).
fn layout(cfg: &ModelConfig, s: PassShape, carve: &mut dyn FnMut(usize, usize) -> Result<Matrix, ForwardError>) -> Result<Workspace, ForwardError> {
    let n = s.n;
    // Routed experts run on every rank's rows under expert parallelism.
    let expert_rows = n.max(s.ep_rows);
    let (d, heads) = (cfg.hidden_size, cfg.num_attention_heads);
    // The dense width counts only where a layer is dense: Qwen3-MoE's
    // configs give one that no layer of theirs uses.
    let dense = if cfg.moe_layers.iter().all(|&m| m) { 0 } else { cfg.intermediate_size };
    let inter = dense.max(cfg.moe_intermediate_size * cfg.n_shared_experts.max(1));
    let k = cfg.num_experts_per_tok.max(1);
    let (lora, dnv, dc) = match &cfg.attention {
        AttentionConfig::Mla(m) => (m.q_lora_rank.unwrap_or(0), m.qk_nope_head_dim + m.v_head_dim, m.kv_lora_rank),
        AttentionConfig::Gqa(_) => (0, 0, 0),
    };
    let some = |rows: usize, cols: usize| if rows > 0 && cols > 0 { (rows, cols) } else { (0, 1) };
    let entry = cfg.kv_entry_dim();
    let mut next = |(rows, cols): (usize, usize)| carve(rows, cols);
    Ok(Workspace {
        tokens: next((n, 1))?.buf,
        cos: next((n, cfg.rope_dim() / 2))?,
        sin: next((n, cfg.rope_dim() / 2))?,
        h: next((n, d))?,
        x: next((n, d))?,
        // Right after the FFN's input: a backend that fetches both with the
        // router's choices takes them in one copy.
        route_ids: next((n * k, 1))?.buf,
        route_weights: next((n, k))?,
        x_router: next(some(n, if cfg.n_routed_experts > 0 { d } else { 0 }))?,
        x_deferred: next(some(n, if cfg.n_routed_experts > 0 { d } else { 0 }))?,
        out_deferred: next(some(n, if cfg.n_routed_experts > 0 { d } else { 0 }))?,
        qa: next(some(n, lora))?,
        q: next((n, heads * cfg.qk_head_dim()))?,
        fresh: next((n, entry))?,
        context: next(some(s.context, entry))?,
        expanded: next(some(s.expanded, s.heads_per_step * dnv))?,
        absorbed: next(some(if dc > 0 { heads } else { 0 }, 2 * dc + dnv))?,
        attn: next((n, heads * cfg.v_head_dim()))?,
        attn_part: next(some(if s.partial_attention { n } else { 0 }, heads * cfg.v_head_dim()))?,
        lse: next(some(if s.partial_attention { n } else { 0 }, heads))?,
        lse_part: next(some(if s.partial_attention { n } else { 0 }, heads))?,
        out: next((n, d))?,
        router: next(some(n, cfg.n_routed_experts))?,
        x_all: next(some(s.ep_rows, d))?,
        out_all: next(some(s.ep_rows, d))?,
        experts: ExpertScratch {
            rows: next((expert_rows * k, 1))?.buf,
            scales: next((expert_rows * k, 1))?.buf,
            xe: next((expert_rows, d))?,
            gate: next((expert_rows, inter))?,
            up: next((expert_rows, inter))?,
            ye: next((expert_rows, d))?,
        },
        final_x: next((s.r, d))?,
        logits: next((s.r, cfg.vocab_size))?,
    })
}

/// Bytes of workspace a pass of this shape needs.
pub fn workspace_bytes(cfg: &ModelConfig, shape: PassShape) -> usize {
    let mut total = 0;
    let _ = layout(cfg, shape, &mut |rows, cols| {
        total += align(rows * cols * 4);
        Ok(DevicePtr { addr: 0, bytes: rows * cols * 4 }.matrix(rows, cols))
    });
    total
}

/// Heads whose expanded keys and values one step of MLA attention
/// materialises for `ctx` positions: as many as fit `kv_bytes`, in steps
/// that keep each slice of `kv_b_proj` on whole FP8 scale blocks (all heads
/// if no smaller group does).
pub fn heads_per_step(cfg: &ModelConfig, ctx: usize, kv_bytes: usize) -> usize {
    let heads = cfg.num_attention_heads;
    let Some(m) = cfg.mla() else { return heads };
    let dkv = m.qk_nope_head_dim + m.v_head_dim;
    let block = cfg.quantization.as_ref().map_or(1, |q| q.weight_block_size[0]);
    let step = (1..=heads).find(|g| (g * dkv) % block == 0).unwrap_or(heads);
    let fit = kv_bytes / (ctx.max(1) * dkv * 4).max(1);
    (fit / step * step).clamp(step, heads)
}

/// One rank's share of a pass split over devices with expert parallelism
/// (SmallEP): its rows are some of the prompt's tokens, and it runs the
/// routed experts `experts` on the rows of every rank (`rows_all` of them,
/// rank by rank), gathered by the backend after the router and reduced back
/// by it after the layer's last expert.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExpertShard {
    pub experts: std::ops::Range<usize>,
    pub rows_all: usize,
}

/// One pass of a batch of sequences through the model's modules.
/// A point in time as the pass's timings count it: the thread's virtual
/// time under the simulator, else the real clock's.
#[derive(Clone, Copy)]
struct Moment {
    real: Instant,
    simulated: Option<Duration>,
}

impl Moment {
    fn now() -> Moment {
        Moment { real: Instant::now(), simulated: duplex_kernels::clock::now() }
    }

    fn since(self, earlier: Moment) -> Duration {
        match (self.simulated, earlier.simulated) {
            (Some(now), Some(then)) => now.saturating_sub(then),
            _ => self.real - earlier.real,
        }
    }
}

pub struct Pass<'m, B: Backend> {
    model: &'m Model,
    pub(crate) backend: B,
    precision: Precision,
    want: Logits,
    segments: Vec<Segment>,
    rows: usize,
    heads_per_step: usize,
    ws: Workspace,
    /// Expert parallelism: this rank's share of the routed experts.
    shard: Option<ExpertShard>,
    /// The current MoE layer's routing, when the backend hands it back.
    routing: Assignment,
    /// Whether the backend runs the current layer's routed experts itself
    /// ([`Routes::Submitted`]), and whether that includes deferred ones.
    submitted: Option<bool>,
    /// Expert Deferral: routed experts per token whose output is added one
    /// MoE layer later, and whether `out_deferred` holds a sum still to be added.
    defer: usize,
    pending_deferred: bool,
    /// Whether a MoE layer's shared experts may wait for its routed ones,
    /// to run in their parallel region ([`Pass::shared_experts_with_routed`]),
    /// and whether the current layer's wait.
    shared_with_routed: bool,
    shared_waiting: bool,
    timings: ForwardTimings,
    /// When the running module started, and whether it is attention.
    clock: Option<(Moment, bool)>,
}

impl<'m, B: Backend> Pass<'m, B> {
    /// Prepare a pass over `seqs`' new tokens: check them, reserve their
    /// cache blocks, and lay out and fill the workspace. `kv_bytes` bounds
    /// the expanded keys and values of MLA attention.
    pub fn new(model: &'m Model, backend: B, pool: &mut KvPool, seqs: &mut [SeqInput], precision: Precision, want: Logits, kv_bytes: usize) -> Result<Self, ForwardError> {
        let cfg = &model.cfg;
        for seq in seqs.iter() {
            Self::check_tokens(cfg, seq.tokens)?;
        }
        let shape = Self::shape(cfg, seqs.iter().map(|s| (s.table.len, s.tokens.len())), want, kv_bytes)?;
        for seq in seqs.iter_mut() {
            pool.reserve(seq.table, seq.table.len + seq.tokens.len())?;
        }
        let parts: Vec<(&BlockTable, usize, &[u32])> = seqs.iter().map(|s| (&*s.table, s.table.len, s.tokens)).collect();
        Self::build(model, backend, &parts, shape, None, precision, want)
    }

    /// Prepare one rank's share of a pass split over devices: `chunks`
    /// (start position, tokens) of the sequence of `table`, whose blocks
    /// already hold every position; with `shard`, its share of the routed
    /// experts. The pass writes no table lengths: the caller owns the split.
    #[allow(clippy::too_many_arguments)]
    pub fn ranked(model: &'m Model, backend: B, table: &BlockTable, chunks: &[(usize, &[u32])], shard: Option<ExpertShard>, precision: Precision, want: Logits, kv_bytes: usize) -> Result<Self, ForwardError> {
        let cfg = &model.cfg;
        for &(_, tokens) in chunks {
            Self::check_tokens(cfg, tokens)?;
        }
        let shape = Self::ranked_shape(cfg, chunks.iter().map(|&(start, t)| (start, t.len())), shard.as_ref(), want, kv_bytes)?;
        let parts: Vec<(&BlockTable, usize, &[u32])> = chunks.iter().map(|&(start, t)| (table, start, t)).collect();
        Self::build(model, backend, &parts, shape, shard, precision, want)
    }

    /// The shape of one rank's pass (see [`Pass::ranked`]).
    pub fn ranked_shape(cfg: &ModelConfig, chunks: impl Iterator<Item = (usize, usize)>, shard: Option<&ExpertShard>, want: Logits, kv_bytes: usize) -> Result<PassShape, ForwardError> {
        let mut shape = Self::shape(cfg, chunks, want, kv_bytes)?;
        shape.ep_rows = shard.map_or(0, |s| s.rows_all);
        shape.partial_attention = true;
        Ok(shape)
    }

    /// Lay out the workspace for segments `(table, start, tokens)` and fill it.
    fn build(model: &'m Model, mut backend: B, parts: &[(&BlockTable, usize, &[u32])], shape: PassShape, shard: Option<ExpertShard>, precision: Precision, want: Logits) -> Result<Self, ForwardError> {
        let cfg = &model.cfg;
        let mut segments = Vec::with_capacity(parts.len());
        let mut rows = 0;
        for &(table, start, tokens) in parts {
            segments.push(Segment { table: table.clone(), start, n: tokens.len(), row: rows });
            rows += tokens.len();
        }
        let base = backend.workspace(workspace_bytes(cfg, shape))?;
        let mut offset = 0;
        let ws = layout(cfg, shape, &mut |rows, cols| {
            let m = base.slice(offset, rows * cols * 4)?.matrix(rows, cols);
            offset += align(rows * cols * 4);
            Ok(m)
        })?;
        let tokens: Vec<u32> = parts.iter().flat_map(|p| p.2.iter().copied()).collect();
        let half = cfg.rope_dim() / 2;
        let (mut cos, mut sin) = (vec![0.0; rows * half], vec![0.0; rows * half]);
        for seg in &segments {
            for i in 0..seg.n {
                let r = seg.row + i;
                model.rope.cos_sin(seg.start + i, &mut cos[r * half..(r + 1) * half], &mut sin[r * half..(r + 1) * half]);
            }
        }
        backend.upload_u32(&tokens, ws.tokens)?;
        backend.upload_f32(&cos, ws.cos.buf)?;
        backend.upload_f32(&sin, ws.sin.buf)?;
        Ok(Pass {
            model,
            backend,
            precision,
            want,
            segments,
            rows,
            heads_per_step: shape.heads_per_step,
            ws,
            shard,
            routing: Assignment::default(),
            submitted: None,
            defer: 0,
            pending_deferred: false,
            shared_with_routed: false,
            shared_waiting: false,
            timings: ForwardTimings::default(),
            clock: None,
        })
    }

    /// Check a batch (`(cached, new)` tokens per sequence) and size its pass.
    pub fn shape(cfg: &ModelConfig, seqs: impl Iterator<Item = (usize, usize)>, want: Logits, kv_bytes: usize) -> Result<PassShape, ForwardError> {
        let (mut n, mut context, mut expanded, mut count) = (0, 0, 0, 0);
        for (cached, new) in seqs {
            if new == 0 {
                return Err(ForwardError::EmptySequence);
            }
            let end = cached + new;
            if end > cfg.max_position_embeddings {
                return Err(ForwardError::TooLong { pos: end, max: cfg.max_position_embeddings });
            }
            n += new;
            count += 1;
            if !B::ATTENDS_IN_PLACE {
                if cached > 0 {
                    context = context.max(end);
                }
                expanded = expanded.max(end);
            }
        }
        if cfg.mla().is_none() {
            expanded = 0;
        }
        let r = if want == Logits::All { n } else { count };
        Ok(PassShape { n, r, context, expanded, heads_per_step: heads_per_step(cfg, expanded, kv_bytes), ep_rows: 0, partial_attention: false })
    }

    fn cfg(&self) -> &'m ModelConfig {
        &self.model.cfg
    }

    /// Expert Deferral (KTransformers §4.1), for decode: of each token's
    /// top-k routed experts, the `d` with the lowest weights (at most k − 1)
    /// are deferred: they read the layer's input as the others do, but
    /// their output joins the next MoE layer's output instead of this one's,
    ///   O_k = I_k + S_k(I_k) + R_{k−1}^def(I_{k−1}) + R_k^imm(I_k),
    /// so that they can run while the next layer's attention does. The last
    /// MoE layer defers none. It changes the model's function (slightly, by
    /// the paper's measurements); 0, the default, is the model as trained.
    pub fn defer_experts(&mut self, d: usize) {
        self.defer = d;
    }

    /// Let a MoE layer's shared experts run with its routed experts, in
    /// one call of the backend ([`Pass::run_layer_experts`] then takes the
    /// layer's FFN weights), rather than in one of their own: on the CPU
    /// that is one parallel region, one quantization of the input and one
    /// expert barrier a layer fewer. It applies where the routed experts
    /// run here (no expert parallelism, not the backend's own) and none are
    /// deferred. The output is the same: the shared experts' sum joins last,
    /// `x + s` where it joined first as `s + x`.
    pub fn shared_experts_with_routed(&mut self) {
        self.shared_with_routed = true;
    }

    fn tick(&mut self, attention: bool) {
        let now = Moment::now();
        if let Some((since, was_attention)) = self.clock.replace((now, attention)) {
            let spent = now.since(since);
            if was_attention {
                self.timings.attention += spent;
            } else {
                self.timings.ffn += spent;
            }
        }
    }

    /// Check that the token ids fit the vocabulary (before anything runs).
    fn check_tokens(cfg: &ModelConfig, tokens: &[u32]) -> Result<(), ForwardError> {
        match tokens.iter().find(|&&t| t as usize >= cfg.vocab_size) {
            Some(&id) => Err(ForwardError::TokenOutOfRange { id, vocab: cfg.vocab_size }),
            None => Ok(()),
        }
    }

    /// Run one module (every module but the routed experts, which go
    /// through [`Pass::run_experts`]).
    pub fn run(&mut self, kind: ModuleKind, w: &Weights<B::Weight>, pool: &mut KvPool) -> Result<(), ForwardError> {
        let (p, n) = (self.precision, self.rows);
        let cfg = self.cfg();
        let eps = cfg.rms_norm_eps;
        match kind {
            ModuleKind::Embed { first_row } => {
                let ws = &self.ws;
                self.backend.embedding(w.get("embed_tokens")?, first_row, ws.tokens, n, ws.h.rows(0..n), p)?;
            }
            ModuleKind::Attention { layer } => {
                self.tick(true);
                let (h, x) = (self.ws.h.rows(0..n), self.ws.x.rows(0..n));
                self.backend.rms_norm(h, w.get("input_layernorm")?, x, eps, p)?;
                match &cfg.attention {
                    AttentionConfig::Mla(_) => self.mla(layer, w, pool)?,
                    AttentionConfig::Gqa(_) => self.gqa(layer, w, pool)?,
                }
                let ws = &self.ws;
                let out = ws.out.rows(0..n);
                self.backend.gemm(w.get("o_proj")?, ws.attn.rows(0..n), out, p, true)?;
                self.backend.add(h, out, Precision::F32)?;
            }
            ModuleKind::Ffn { layer } => {
                self.tick(false);
                let ws = &self.ws;
                let (h, x, out) = (ws.h.rows(0..n), ws.x.rows(0..n), ws.out.rows(0..n));
                let norm = w.get("post_attention_layernorm")?;
                self.backend.rms_norm(h, norm, x, eps, p)?;
                self.backend.zero(out)?;
                if !cfg.is_moe_layer(layer) {
                    let job = ExpertJob::named(w, "", Tokens::All, 0, 0)?;
                    self.backend.experts(x, &[job], out, p, &ws.experts)?;
                    return self.finish_ffn();
                }
                let e = cfg.n_routed_experts;
                if self.pending_deferred {
                    self.backend.add(out, ws.out_deferred.rows(0..n), Precision::F32)?;
                    self.pending_deferred = false;
                }
                let logits = ws.router.rows(0..n).reshape(n, e);
                // Routing is a discrete choice that a rounding can flip: the
                // router reads the normed input before it is rounded.
                let x_router = ws.x_router.rows(0..n);
                self.backend.rms_norm(h, norm, x_router, eps, Precision::F32)?;
                self.backend.router_logits(w.get("gate")?, x_router, logits, p)?;
                let bias = if cfg.use_correction_bias { Some(w.get("e_score_correction_bias")?) } else { None };
                let k = cfg.num_experts_per_tok;
                let last_moe = (layer + 1..cfg.num_hidden_layers).all(|l| !cfg.is_moe_layer(l));
                let defer = if last_moe || self.shard.is_some() { 0 } else { self.defer.min(k.saturating_sub(1)) };
                let call = RouteCall { layer, logits, bias, params: &self.model.router, precision: p, ids: ws.route_ids, weights: ws.route_weights.rows(0..n).reshape(n, k), input: x, hidden: h, defer };
                match self.backend.route(call)? {
                    // Expert parallelism: this rank's rows and choices set off
                    // to the others; the shared experts run while they travel.
                    Routes::Chosen(chosen) if self.shard.is_some() => {
                        self.submitted = None;
                        self.backend.send_expert_input(x, chosen)?;
                    }
                    Routes::Chosen(chosen) => {
                        self.submitted = None;
                        self.routing.assign(&chosen, e, defer)?;
                        if self.routing.deferred.iter().any(|d| !d.is_empty()) {
                            self.backend.copy(x, ws.x_deferred.rows(0..n))?;
                        }
                    }
                    Routes::Submitted => self.submitted = Some(defer > 0),
                }
                if cfg.n_shared_experts > 0 {
                    if self.shared_with_routed && self.defer == 0 && self.shard.is_none() && self.submitted.is_none() {
                        self.shared_waiting = true;
                    } else {
                        // Within this module: a placement may free its weights once it has run.
                        let job = ExpertJob::named(w, "shared_experts.", Tokens::All, 0, 0)?;
                        self.backend.experts(x, &[job], out, p, &ws.experts)?;
                    }
                }
                if self.shard.is_some() {
                    let chosen = self.backend.gather_expert_input(ws.x_all)?;
                    self.backend.zero(ws.out_all)?;
                    self.routing.assign(&chosen, e, defer)?;
                }
            }
            ModuleKind::Expert { layer, expert } => return self.run_experts(layer, &[(expert, w)]),
            ModuleKind::Head { first_row } => {
                self.tick(false);
                self.clock = None;
                let ws = &self.ws;
                let final_x = ws.final_x.rows(0..self.logit_rows());
                if first_row == 0 {
                    let norm = w.get("norm")?;
                    match self.want {
                        Logits::All => self.backend.rms_norm(ws.h.rows(0..n), norm, final_x, eps, p)?,
                        Logits::Last => {
                            for (i, seg) in self.segments.iter().enumerate() {
                                let last = seg.row + seg.n - 1;
                                self.backend.rms_norm(ws.h.rows(last..last + 1), norm, final_x.rows(i..i + 1), eps, p)?;
                            }
                        }
                    }
                }
                let head = w.get("lm_head")?;
                let rows = B::rows_of(head)?;
                let y = ws.logits.rows(0..final_x.rows).columns(first_row..first_row + rows);
                // Logits stay F32: the sampler and logprobs want them unrounded.
                self.backend.gemm(head, final_x, y, p, false)?;
            }
        }
        Ok(())
    }

    /// The residual stream `[n, d]` as the modules run so far left it.
    pub fn hidden(&mut self) -> Result<Vec<f32>, ForwardError> {
        let h = self.ws.h.rows(0..self.rows);
        self.backend.download(h)
    }

    fn logit_rows(&self) -> usize {
        match self.want {
            Logits::All => self.rows,
            Logits::Last => self.segments.len(),
        }
    }

    /// Run routed experts `(index, weights)` of `layer`, in index order;
    /// after the layer's last, add the MoE output to the residual.
    pub fn run_experts(&mut self, layer: usize, experts: &[(usize, &Weights<B::Weight>)]) -> Result<(), ForwardError> {
        self.run_layer_experts(layer, experts, None)
    }

    /// [`Pass::run_experts`], with the shared experts of `ffn` (the layer's
    /// FFN module's weights) if they wait for the routed ones
    /// ([`Pass::shared_experts_with_routed`]): after them, in the same call.
    pub fn run_layer_experts(&mut self, layer: usize, experts: &[(usize, &Weights<B::Weight>)], ffn: Option<&Weights<B::Weight>>) -> Result<(), ForwardError> {
        let cfg = self.cfg();
        let routed = self.submitted.is_some() || self.routing.now.len() == cfg.n_routed_experts;
        if !cfg.is_moe_layer(layer) || !routed {
            return Err(ForwardError::BadModule(format!("experts of layer {layer} before its router")));
        }
        let end = self.shard.as_ref().map_or(cfg.n_routed_experts, |s| s.experts.end);
        let last = experts.iter().any(|&(e, _)| e + 1 == end);
        let (n, ws) = (self.rows, &self.ws);
        // Under expert parallelism the experts read every rank's rows.
        let (x, out) = match &self.shard {
            Some(_) => (ws.x_all, ws.out_all),
            None => (ws.x.rows(0..n), ws.out.rows(0..n)),
        };
        if self.submitted.is_some() {
            // The backend runs them all: their sum is there once the layer's last is asked for.
            if last {
                self.backend.routed_sum(ws.out.rows(0..n), false, &ws.experts)?;
            }
        } else {
            let mut jobs = self.routing.jobs(experts, false)?;
            if self.shared_waiting {
                let ffn = ffn.ok_or_else(|| ForwardError::BadModule(format!("layer {layer}'s shared experts wait for its routed ones, which came without them")))?;
                jobs.push(ExpertJob::named(ffn, "shared_experts.", Tokens::All, 0, 0)?);
                self.shared_waiting = false;
            }
            if !jobs.is_empty() {
                self.backend.experts(x, &jobs, out, self.precision, &ws.experts)?;
            }
        }
        if last {
            if self.shard.is_some() {
                self.backend.reduce_expert_output(ws.out_all, ws.out.rows(0..n))?;
            }
            self.finish_ffn()?;
        }
        Ok(())
    }

    /// Run the current MoE layer's deferred experts (Expert Deferral; nothing when
    /// none were deferred), in index order: their summed output joins the
    /// next MoE layer's. A placement runs this while the next layer's
    /// attention runs elsewhere.
    pub fn run_deferred(&mut self, experts: &[(usize, &Weights<B::Weight>)]) -> Result<(), ForwardError> {
        let (n, ws) = (self.rows, &self.ws);
        let out = ws.out_deferred.rows(0..n);
        match self.submitted {
            Some(true) => {
                self.backend.zero(out)?;
                self.backend.routed_sum(out, true, &ws.experts)?;
                self.submitted = Some(false);
            }
            Some(false) => return Ok(()),
            None => {
                if self.routing.deferred.iter().all(|d| d.is_empty()) {
                    return Ok(());
                }
                let jobs = self.routing.jobs(experts, true)?;
                self.backend.zero(out)?;
                self.backend.experts(ws.x_deferred.rows(0..n), &jobs, out, self.precision, &ws.experts)?;
                drop(jobs);
                self.routing.deferred.iter_mut().for_each(|d| d.clear());
            }
        }
        self.pending_deferred = true;
        Ok(())
    }

    /// Round the FFN's summed output once and add it to the residual.
    fn finish_ffn(&mut self) -> Result<(), ForwardError> {
        let (n, p) = (self.rows, self.precision);
        let out = self.ws.out.rows(0..n);
        if p == Precision::Bf16 {
            self.backend.round_bf16(out)?;
        }
        self.backend.add(self.ws.h.rows(0..n), out, Precision::F32)
    }

    fn call<'c>(&self, layer: usize, seg: &'c Segment, pool: &'c KvPool) -> AttentionCall<'c>
    where
        'm: 'c,
    {
        let ws = &self.ws;
        let ctx = seg.start + seg.n;
        AttentionCall {
            cfg: &self.model.cfg,
            layer,
            seg,
            pool,
            q: ws.q.rows(seg.rows()),
            fresh: ws.fresh.rows(seg.rows()),
            out: ws.attn.rows(seg.rows()),
            context: if seg.start > 0 && ws.context.rows >= ctx { ws.context.rows(0..ctx) } else { ws.context.rows(0..0) },
            expanded: if ws.expanded.rows >= ctx { ws.expanded.rows(0..ctx) } else { ws.expanded.rows(0..0) },
            absorbed: ws.absorbed,
            part: ws.attn_part.rows(seg.rows()),
            lse: ws.lse.rows(seg.rows()),
            part_lse: ws.lse_part.rows(seg.rows()),
            heads_per_step: self.heads_per_step,
            scale: self.model.softmax_scale,
            precision: self.precision,
        }
    }

    /// MLA: queries (through the low-rank `q_a`/`q_b` or a plain `q_proj`),
    /// the compressed latent and the shared rotary key, written to the
    /// cache; then attention per sequence.
    fn mla(&mut self, layer: usize, w: &Weights<B::Weight>, pool: &mut KvPool) -> Result<(), ForwardError> {
        let (p, n, cfg) = (self.precision, self.rows, self.cfg());
        let m = cfg.mla().expect("an MLA model");
        let (heads, dn, dr, dc) = (cfg.num_attention_heads, m.qk_nope_head_dim, m.qk_rope_head_dim, m.kv_lora_rank);
        let eps = cfg.rms_norm_eps;
        let ws = &self.ws;
        let (x, q) = (ws.x.rows(0..n), ws.q.rows(0..n));
        let b = &mut self.backend;
        if m.q_lora_rank.is_some() {
            let qa = ws.qa.rows(0..n);
            b.gemm(w.get("q_a_proj")?, x, qa, p, true)?;
            b.rms_norm(qa, w.get("q_a_layernorm")?, qa, eps, p)?;
            b.gemm(w.get("q_b_proj")?, qa, q, p, true)?;
        } else {
            b.gemm(w.get("q_proj")?, x, q, p, true)?;
        }
        // The entries are written where kv_a_proj put them: the norm of the
        // compressed part, the rotation of the shared rope key.
        let fresh = ws.fresh.rows(0..n);
        b.gemm(w.get("kv_a_proj_with_mqa")?, x, fresh, p, true)?;
        b.rms_norm(fresh.columns(0..dc), w.get("kv_a_layernorm")?, fresh.columns(0..dc), eps, p)?;
        b.rope(fresh.columns(dc..dc + dr), ws.cos, ws.sin, 1, cfg.rope_interleave, p)?;
        b.rope(q.reshape(n * heads, dn + dr).columns(dn..dn + dr), ws.cos, ws.sin, heads, cfg.rope_interleave, p)?;
        for seg in &self.segments {
            self.backend.store_kv(layer, &[fresh.rows(seg.rows())], seg, pool)?;
        }
        let calls: Vec<AttentionCall> = self.segments.iter().map(|seg| self.call(layer, seg, pool)).collect();
        self.backend.attention(&calls, w)
    }

    /// Grouped-query attention: `q`, `k` and `v` projections, the optional
    /// per-head q/k norms, rotation by halves, then attention per sequence.
    fn gqa(&mut self, layer: usize, w: &Weights<B::Weight>, pool: &mut KvPool) -> Result<(), ForwardError> {
        let (p, n, cfg) = (self.precision, self.rows, self.cfg());
        let g = cfg.gqa().expect("a GQA model");
        let (heads, kvh, hd) = (cfg.num_attention_heads, g.num_key_value_heads, g.head_dim);
        let eps = cfg.rms_norm_eps;
        let ws = &self.ws;
        let (x, q, fresh) = (ws.x.rows(0..n), ws.q.rows(0..n), ws.fresh.rows(0..n));
        let (k, v) = (fresh.columns(0..kvh * hd), fresh.columns(kvh * hd..2 * kvh * hd));
        let b = &mut self.backend;
        b.gemm(w.get("q_proj")?, x, q, p, true)?;
        b.gemm(w.get("k_proj")?, x, k, p, true)?;
        b.gemm(w.get("v_proj")?, x, v, p, true)?;
        let q_heads = q.reshape(n * heads, hd);
        // A key head's rows are `hd` wide within each token's entry.
        let k_heads = (0..kvh).map(|j| k.columns(j * hd..(j + 1) * hd));
        if g.qk_norm {
            b.rms_norm(q_heads, w.get("q_norm")?, q_heads, eps, p)?;
            let k_norm = w.get("k_norm")?;
            for kj in k_heads.clone() {
                b.rms_norm(kj, k_norm, kj, eps, p)?;
            }
        }
        b.rope(q_heads, ws.cos, ws.sin, heads, cfg.rope_interleave, p)?;
        for kj in k_heads {
            b.rope(kj, ws.cos, ws.sin, 1, cfg.rope_interleave, p)?;
        }
        for seg in &self.segments {
            self.backend.store_kv(layer, &[fresh.rows(seg.rows())], seg, pool)?;
        }
        let calls: Vec<AttentionCall> = self.segments.iter().map(|seg| self.call(layer, seg, pool)).collect();
        self.backend.attention(&calls, w)
    }

    /// The logits (`[rows, vocab]`) once every module has run; the
    /// sequences' tables then cover the new tokens. Returns the backend and
    /// where the pass spent its time.
    pub fn finish(mut self, tables: &mut [&mut BlockTable]) -> Result<(Vec<f32>, B, ForwardTimings), ForwardError> {
        self.tick(false);
        let logits = self.backend.download(self.ws.logits.rows(0..self.logit_rows()))?;
        for (t, seg) in tables.iter_mut().zip(&self.segments) {
            t.len = seg.start + seg.n;
        }
        Ok((logits, self.backend, self.timings))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A dense width that no layer uses does not size the workspace:
    /// Qwen3-MoE configs and GGUFs carry one, and a corrupt one asked for
    /// hundreds of gigabytes at the first pass (one that large is now refused
    /// as corrupt; the widest allowed still sizes nothing).
    #[test]
    fn an_unused_dense_width_does_not_size_the_workspace() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/fixtures/tiny-qwen3moe/config.json");
        let mut v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        v["mlp_only_layers"] = serde_json::json!([]);
        let config = |v: &serde_json::Value| ModelConfig::from_json(&v.to_string(), path).unwrap();
        let shape = PassShape { n: 8, r: 1, context: 0, expanded: 0, heads_per_step: 1, ep_rows: 0, partial_attention: false };
        let all_moe = workspace_bytes(&config(&v), shape);
        v["intermediate_size"] = crate::config::MAX_WIDTH.into();
        assert_eq!(workspace_bytes(&config(&v), shape), all_moe);
        // With a dense layer the width counts.
        v["mlp_only_layers"] = serde_json::json!([0]);
        v["intermediate_size"] = (1 << 16).into();
        assert!(workspace_bytes(&config(&v), shape) >= all_moe + 8 * (1 << 16) * 4);
    }
}
