//! What the forward program runs on: a [`Backend`] executes the model's ops
//! over activations it holds as [`Matrix`] handles (views into one
//! workspace), with weights of its own kind, looked up by name.
//!
//! Two backends exist: [`crate::cpu::CpuBackend`] computes on the host's
//! worker pool, reading weights in place from the checkpoint's mapping and
//! the KV cache in place from the paged pool; the device backend of
//! [`crate::staged`] enqueues the same ops on an accelerator (emulated or
//! CUDA). Most ops are the device layer's [`duplex_kernels::device::Op`]s one
//! for one. Attention and the routed experts are whole operations, because
//! each backend has its own best way to run them (the CPU attends over the
//! paged pool and runs all of a layer's experts in one parallel region; a
//! device attends over its own copy of the context and runs one expert as
//! its weights arrive).

use crate::config::{AttentionConfig, ModelConfig};
use crate::kv_cache::{BlockTable, KvPool};
use crate::model::{ForwardError, Precision};
use crate::weights::Weights;
use duplex_kernels::device::{DevicePtr, Matrix};
use duplex_kernels::router::RouterParams;

/// One sequence's rows within a pass.
#[derive(Clone, Debug)]
pub struct Segment {
    pub table: BlockTable,
    /// Position of its first new token.
    pub start: usize,
    pub n: usize,
    /// Index of its first row in the batch.
    pub row: usize,
}

impl Segment {
    pub fn rows(&self) -> std::ops::Range<usize> {
        self.row..self.row + self.n
    }
}

/// Which rows of the batch an expert runs on, with the weight of its output.
#[derive(Clone, Copy, Debug)]
pub enum Tokens<'a> {
    /// Every row, weight 1 (a dense MLP, shared experts).
    All,
    /// `(row, weight)` pairs, no row twice.
    Rows(&'a [(usize, f32)]),
}

/// One expert to run: `down(silu(gate·x) ⊙ up·x)`, scaled and added into
/// the output rows. `first` is where its rows start in the layer's
/// row lists (so that a device can keep every expert's lists at once).
pub struct ExpertJob<'a, W> {
    pub gate: &'a W,
    pub up: &'a W,
    pub down: &'a W,
    pub tokens: Tokens<'a>,
    pub first: usize,
    /// The expert's index in its layer (0 for dense and shared ones), to
    /// spread experts over NUMA nodes.
    pub expert: usize,
}

impl<'a, W> ExpertJob<'a, W> {
    /// The expert whose projections are `{prefix}gate_proj`, `{prefix}up_proj`
    /// and `{prefix}down_proj` in `w`.
    pub fn named(w: &'a Weights<W>, prefix: &str, tokens: Tokens<'a>, first: usize, expert: usize) -> Result<Self, ForwardError> {
        let get = |role: &str| w.get_prefixed(prefix, role);
        Ok(ExpertJob { gate: get("gate_proj")?, up: get("up_proj")?, down: get("down_proj")?, tokens, first, expert })
    }
}

/// Workspace a backend may use for experts (the device gathers rows).
#[derive(Clone, Copy, Debug)]
pub struct ExpertScratch {
    pub rows: DevicePtr,
    pub scales: DevicePtr,
    pub xe: Matrix,
    pub gate: Matrix,
    pub up: Matrix,
    pub ye: Matrix,
}

/// Everything attention needs beyond the layer's weights.
pub struct AttentionCall<'a> {
    pub cfg: &'a ModelConfig,
    pub layer: usize,
    pub seg: &'a Segment,
    pub pool: &'a KvPool,
    /// The segment's queries, rotated: `[n, heads·qk_head_dim]`.
    pub q: Matrix,
    /// The segment's new KV entries as written to the cache, `[n, entry]`.
    pub fresh: Matrix,
    /// `[n, heads·v_head_dim]`, written (BF16: rounded).
    pub out: Matrix,
    /// Room for the context's entries `[ctx, entry]` when it is not all
    /// fresh (backends that do not attend in place; else empty).
    pub context: Matrix,
    /// Room for MLA's expanded keys and values, `[ctx, heads_per_step·(dn+dv)]`
    /// (backends that do not attend in place; else empty).
    pub expanded: Matrix,
    /// Room for MLA's absorbed decode, `[heads, 2·kv_lora + dn + dv]`:
    /// per head its latent query, its latent context and its keys and
    /// values (backends that do not attend in place; empty for GQA).
    pub absorbed: Matrix,
    /// Context-parallel attention (passes split over devices; else empty):
    /// room for a partial result `[n, heads·v_head_dim]` over one range of
    /// keys, and the log-sum-exp `[n, heads]` of `out` and of the partial.
    pub part: Matrix,
    pub lse: Matrix,
    pub part_lse: Matrix,
    pub heads_per_step: usize,
    pub scale: f32,
    pub precision: Precision,
}

/// A MoE layer's routing, as the forward program asks a backend for it.
pub struct RouteCall<'a, W> {
    pub layer: usize,
    pub logits: Matrix,
    pub bias: Option<&'a W>,
    pub params: &'a RouterParams,
    pub precision: Precision,
    /// Where the chosen ids (u32, `[n, k]`) and weights (`[n, k]`) go.
    pub ids: DevicePtr,
    pub weights: Matrix,
    /// The experts' input.
    pub input: Matrix,
    /// The FFN's input hidden state (before its norm), for a placement that
    /// predicts the next layers' routes from it.
    pub hidden: Matrix,
    /// Experts per token deferred to the next MoE layer (Expert Deferral).
    pub defer: usize,
}

/// What a backend did with a MoE layer's routing.
pub enum Routes {
    /// Per token, its `(expert, weight)` pairs: the pass runs the experts.
    Chosen(Vec<Vec<(usize, f32)>>),
    /// The backend runs the routed experts itself once the choices exist
    /// (the hybrid placement's CPU experts, started from the device's
    /// stream); the pass collects their sums with [`Backend::routed_sum`].
    Submitted,
}

pub trait Backend {
    /// A weight as this backend reads it.
    type Weight;
    /// Whether attention reads the cached context in place in the paged
    /// pool, with buffers of its own; else a pass plans room in its
    /// workspace for the context it brings in and for MLA's expanded keys
    /// and values.
    const ATTENDS_IN_PLACE: bool;

    /// Rows of a weight matrix.
    fn rows_of(w: &Self::Weight) -> Result<usize, ForwardError>;
    /// Activation memory of `bytes`, for the pass's workspace.
    fn workspace(&mut self, bytes: usize) -> Result<DevicePtr, ForwardError>;
    fn upload_f32(&mut self, xs: &[f32], dst: DevicePtr) -> Result<(), ForwardError>;
    fn upload_u32(&mut self, xs: &[u32], dst: DevicePtr) -> Result<(), ForwardError>;
    fn download(&mut self, m: Matrix) -> Result<Vec<f32>, ForwardError>;

    /// Rows `first_row..` of the embedding table for each token id in `ids`
    /// that falls there (BF16: rounded).
    fn embedding(&mut self, table: &Self::Weight, first_row: usize, ids: DevicePtr, count: usize, out: Matrix, p: Precision) -> Result<(), ForwardError>;
    /// `y = x · Wᵀ` (BF16 with `round`: rounded).
    fn gemm(&mut self, w: &Self::Weight, x: Matrix, y: Matrix, p: Precision, round: bool) -> Result<(), ForwardError>;
    /// Router logits in F32, as transformers computes them, whatever the precision.
    fn router_logits(&mut self, w: &Self::Weight, x: Matrix, y: Matrix, p: Precision) -> Result<(), ForwardError>;
    fn rms_norm(&mut self, x: Matrix, weight: &Self::Weight, out: Matrix, eps: f32, p: Precision) -> Result<(), ForwardError>;
    /// Rotate each row of `x` in place; row `r` is at the position of table row `r / rows_per_position`.
    fn rope(&mut self, x: Matrix, cos: Matrix, sin: Matrix, rows_per_position: usize, interleaved: bool, p: Precision) -> Result<(), ForwardError>;
    /// `h += delta` (BF16: rounded).
    fn add(&mut self, h: Matrix, delta: Matrix, p: Precision) -> Result<(), ForwardError>;
    fn round_bf16(&mut self, x: Matrix) -> Result<(), ForwardError>;
    fn zero(&mut self, x: Matrix) -> Result<(), ForwardError>;

    /// The router's top-k of every row of `logits` for MoE layer `layer`.
    /// `input` is what the routed experts will read (a backend that runs
    /// them elsewhere may fetch it along with the choices), and `defer` how
    /// many of each token's experts are deferred ([`crate::forward::Pass::defer_experts`]).
    fn route(&mut self, route: RouteCall<'_, Self::Weight>) -> Result<Routes, ForwardError>;
    /// Add the summed output of the routed experts that this backend runs
    /// itself (after [`Routes::Submitted`]) into `out`: the layer's
    /// immediate experts, or with `deferred` its deferred ones.
    fn routed_sum(&mut self, _out: Matrix, _deferred: bool, _scratch: &ExpertScratch) -> Result<(), ForwardError> {
        Err(ForwardError::BadModule("this backend hands the router's choices back; it runs no experts itself".into()))
    }
    /// Expert parallelism (SmallEP): set off this rank's expert input `x`
    /// and the router's choices for its rows to the other ranks; the pass
    /// may enqueue other work before it collects every rank's with
    /// [`Backend::gather_expert_input`].
    fn send_expert_input(&mut self, _x: Matrix, _chosen: Vec<Vec<(usize, f32)>>) -> Result<(), ForwardError> {
        Err(ForwardError::BadModule("this backend runs every expert of a layer itself; it has no peers to share them with".into()))
    }
    /// Expert parallelism: every rank's expert input into `x_all`, rank by
    /// rank, and the router's choices for all those rows.
    fn gather_expert_input(&mut self, _x_all: Matrix) -> Result<Vec<Vec<(usize, f32)>>, ForwardError> {
        Err(ForwardError::BadModule("this backend runs every expert of a layer itself; it has no peers to share them with".into()))
    }
    /// Expert parallelism: add into `out` (this rank's rows) the partial sums
    /// that every rank's experts made for them (this rank's, over all rows,
    /// are `out_all`).
    fn reduce_expert_output(&mut self, _out_all: Matrix, _out: Matrix) -> Result<(), ForwardError> {
        Err(ForwardError::BadModule("this backend runs every expert of a layer itself; it has no peers to share them with".into()))
    }
    /// `dst = src` (same shape).
    fn copy(&mut self, src: Matrix, dst: Matrix) -> Result<(), ForwardError>;
    /// Run experts on rows of `x`, adding their scaled outputs into `out`
    /// unrounded (the caller rounds once, after the last).
    fn experts(&mut self, x: Matrix, jobs: &[ExpertJob<Self::Weight>], out: Matrix, p: Precision, scratch: &ExpertScratch) -> Result<(), ForwardError>;

    /// Write rows of new KV entries (the concatenation of `parts`, row by
    /// row) into the cache at the segment's positions.
    fn store_kv(&mut self, layer: usize, parts: &[Matrix], seg: &Segment, pool: &mut KvPool) -> Result<(), ForwardError>;
    /// Multi-head latent attention of one segment (causal, over its cached
    /// context and its fresh entries).
    fn mla_attention(&mut self, call: &AttentionCall, w: &Weights<Self::Weight>) -> Result<(), ForwardError>;
    /// Grouped-query attention of one segment.
    fn gqa_attention(&mut self, call: &AttentionCall) -> Result<(), ForwardError>;
    /// Attention of a layer's segments, once their entries are stored: one
    /// segment at a time, unless the backend has a better order (a rank of
    /// a split pass starts every segment on its own keys before it waits
    /// for its peers').
    fn attention(&mut self, calls: &[AttentionCall], w: &Weights<Self::Weight>) -> Result<(), ForwardError> {
        for c in calls {
            match &c.cfg.attention {
                AttentionConfig::Mla(_) => self.mla_attention(c, w)?,
                AttentionConfig::Gqa(_) => self.gqa_attention(c)?,
            }
        }
        Ok(())
    }
}
