//! The multi-device placement: one prompt's pass split over ranks, each an
//! accelerator running the staged program on its share (distributed
//! stream-loading prefill, §3.2 of the cloud-grade-SLO paper).
//!
//! - **Tokens, zig-zag.** The new tokens are cut into `2R` chunks; rank `r`
//!   holds chunks `r` and `2R−1−r`, so every rank has as much causal
//!   attention work as the others ([`ZigZag`]).
//! - **Attention, context parallel (Pass-KV).** Each rank computes its
//!   tokens' KV entries and first attends its chunks over the keys it has
//!   (its own chunks, a cached prefix); meanwhile the ranks exchange their
//!   entries through the host (device → host → device; the exchange also
//!   writes them into the shared paged pool, in position order, where the
//!   decode worker finds them). Then each chunk attends the peers' chunks
//!   before its end, and the parts are merged by their log-sum-exp (online
//!   softmax), which gives causal attention over the whole context.
//! - **Routed experts, SmallEP.** Each rank owns `1/R` of every layer's
//!   experts. After the router, the ranks all-gather their unsorted hidden
//!   rows with their choices (the rows go to the host on a copy stream while
//!   the shared experts run), so that every rank holds all `N` tokens; each
//!   runs its own experts on the rows routed to them, making a partial sum
//!   `[N, D]`; one all-to-all of the partial sums and a local reduce complete
//!   the layer. Per link that is `N·D` per layer, against `N·A·D/S` for
//!   classic expert parallelism, which ships each token to its experts' owners.
//! - Shared experts, dense layers and everything else run on each rank's own
//!   tokens.
//!
//! The program is [`crate::forward`]'s with [`RankBackend`] under it: the
//! device backend plus the collectives of [`Exchange`]. There is no
//! peer-to-peer path: every exchange is a download into host memory and an
//! upload from it.

use crate::backend::{AttentionCall, Backend, ExpertJob, ExpertScratch, RouteCall, Routes, Segment};
use crate::config::AttentionConfig;
use crate::forward::{ExpertShard, ModuleKind, Pass};
use crate::kv_cache::{BlockTable, KvPool};
use crate::model::{ForwardError, Logits, Model, Precision};
use crate::staged::DeviceBackend;
use crate::weights::Weights;
use duplex_kernels::device::{self, Device, DevicePtr, DeviceWeight, Event, GqaDims, Matrix, MlaDims, Op, Staging, StreamId};
use std::ops::Range;
use duplex_kernels::clock::Stamp;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// How `n` new tokens after `cached` ones are split over `ranks` ranks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ZigZag {
    ranks: usize,
    /// The `2R` chunks, as positions.
    chunks: Vec<Range<usize>>,
    n_experts: usize,
}

impl ZigZag {
    /// The split of positions `cached..cached + n` (chunk sizes differ by at
    /// most one) and of `n_experts` routed experts. Every chunk must get a
    /// token: `n` is at least `2·ranks`.
    pub fn new(cached: usize, n: usize, ranks: usize, n_experts: usize) -> Result<Self, ForwardError> {
        if ranks == 0 || n < 2 * ranks {
            return Err(ForwardError::BadModule(format!("{n} tokens cannot be split into {} zig-zag chunks over {ranks} ranks", 2 * ranks)));
        }
        if n_experts > 0 && n_experts < ranks {
            return Err(ForwardError::BadModule(format!("{n_experts} routed experts cannot be shared by {ranks} ranks")));
        }
        let parts = 2 * ranks;
        let chunks = (0..parts).map(|i| cached + i * n / parts..cached + (i + 1) * n / parts).collect();
        Ok(ZigZag { ranks, chunks, n_experts })
    }

    pub fn ranks(&self) -> usize {
        self.ranks
    }

    /// The first new position: the cached prefix before it is in the pool.
    pub fn first_position(&self) -> usize {
        self.chunks[0].start
    }

    /// Rank `r`'s chunks, in the order its pass holds them: `r`, then `2R−1−r`.
    pub fn chunks_of(&self, rank: usize) -> [Range<usize>; 2] {
        [self.chunks[rank].clone(), self.chunks[2 * self.ranks - 1 - rank].clone()]
    }

    /// Rows of rank `r`'s pass.
    pub fn rows_of(&self, rank: usize) -> usize {
        self.chunks_of(rank).iter().map(|c| c.len()).sum()
    }

    /// Where rank `r`'s rows start among every rank's, rank by rank.
    pub fn first_row_of(&self, rank: usize) -> usize {
        (0..rank).map(|r| self.rows_of(r)).sum()
    }

    /// Every rank's rows.
    pub fn rows(&self) -> usize {
        self.chunks.iter().map(|c| c.len()).sum()
    }

    /// The routed experts rank `r` runs.
    pub fn experts_of(&self, rank: usize) -> Range<usize> {
        rank * self.n_experts / self.ranks..(rank + 1) * self.n_experts / self.ranks
    }

    /// The rank that owns expert `e`.
    pub fn owner_of(&self, expert: usize) -> usize {
        (0..self.ranks).find(|&r| self.experts_of(r).contains(&expert)).unwrap_or(0)
    }

    /// The rank holding the prompt's last token (chunk `2R−1`: rank 0), and
    /// that token's row among that rank's logits of [`Logits::Last`].
    pub fn last_token(&self) -> (usize, usize) {
        (0, 1)
    }

    /// Whether rank `r` computes logits: all of them do for [`Logits::All`],
    /// only the one holding the last token for [`Logits::Last`].
    pub fn wants_logits(&self, rank: usize, want: Logits) -> bool {
        want == Logits::All || rank == self.last_token().0
    }

    /// Whether rank `r` runs module `kind`: every module but other ranks'
    /// routed experts, and the LM head only where its logits are wanted.
    pub fn runs(&self, rank: usize, kind: ModuleKind, want: Logits) -> bool {
        match kind {
            ModuleKind::Expert { expert, .. } => self.experts_of(rank).contains(&expert),
            ModuleKind::Head { .. } => self.wants_logits(rank, want),
            _ => true,
        }
    }

    /// Every rank's logits (`[rows, vocab]` each, from [`Logits::All`]
    /// passes) as the prompt's rows in position order.
    pub fn merge_logits(&self, per_rank: &[Vec<f32>], vocab: usize) -> Vec<f32> {
        let mut rows: Vec<(usize, &[f32])> = vec![];
        for (rank, logits) in per_rank.iter().enumerate() {
            let positions = self.chunks_of(rank).into_iter().flatten();
            rows.extend(positions.zip(logits.chunks(vocab)));
        }
        rows.sort_by_key(|&(pos, _)| pos);
        rows.into_iter().flat_map(|(_, row)| row.iter().copied()).collect()
    }
}

/// What one rank hands the others at a collective.
#[derive(Default)]
struct Parcel {
    floats: Vec<f32>,
    /// Router choices of the rank's rows (SmallEP's all-gather).
    picks: Vec<Vec<(usize, f32)>>,
    /// `(start, rows)` runs of KV entries in `floats` (the KV exchange).
    runs: Vec<(usize, usize)>,
}

/// A layer's traffic between ranks, summed over the ranks.
#[derive(Clone, Debug, Default)]
pub struct LayerExchange {
    /// KV entries each rank sent the others.
    pub kv_bytes: u64,
    /// SmallEP: hidden rows all-gathered, and partial sums sent back.
    pub gather_bytes: u64,
    pub reduce_bytes: u64,
    /// What classic expert parallelism would have moved for the same
    /// routing: each token to the owner of each of its experts that is not
    /// its own rank, and the expert's output back.
    pub standard_ep_bytes: u64,
    /// Time the ranks spent in collectives: copies to and from the host, and
    /// waiting for each other.
    pub time: Duration,
}

struct ExchangeState<'p> {
    pool: &'p mut KvPool,
    table: BlockTable,
    generation: u64,
    deposits: Vec<Option<Parcel>>,
    result: Arc<Vec<Parcel>>,
    failed: Option<String>,
    layers: Vec<LayerExchange>,
    /// The latest arrival at the current collective, and at the last one
    /// completed (the simulator's virtual time: no rank leaves a collective
    /// before the last one came).
    arrived_at: Stamp,
    completed_at: Stamp,
}

/// The host side of the ranks' collectives: a rendezvous per collective,
/// the shared KV pool the attention exchange writes, and the traffic.
/// Every rank takes part in every collective, in the same order.
pub struct Exchange<'p> {
    split: ZigZag,
    state: Mutex<ExchangeState<'p>>,
    arrived: Condvar,
}

impl<'p> Exchange<'p> {
    /// The exchange of a pass over `split` that writes the sequence of
    /// `table` (whose blocks hold every position) in `pool`.
    pub fn new(split: ZigZag, pool: &'p mut KvPool, table: BlockTable, layers: usize) -> Self {
        let ranks = split.ranks;
        let state = ExchangeState { pool, table, generation: 0, deposits: (0..ranks).map(|_| None).collect(), result: Arc::default(), failed: None, layers: vec![LayerExchange::default(); layers], arrived_at: Stamp::default(), completed_at: Stamp::default() };
        Exchange { split, state: Mutex::new(state), arrived: Condvar::new() }
    }

    pub fn split(&self) -> &ZigZag {
        &self.split
    }

    /// Entries of `layer` at `positions` from the pool (a cached prefix).
    fn read(&self, layer: usize, positions: Range<usize>) -> Vec<f32> {
        let st = self.lock();
        positions.flat_map(|t| st.pool.entry(&st.table, layer, t).iter().copied()).collect()
    }

    /// The sequence the pass writes.
    pub fn table(&self) -> BlockTable {
        self.lock().table.clone()
    }

    fn lock(&self) -> MutexGuard<'_, ExchangeState<'p>> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A rank failed: every rank waiting in (or later coming to) a
    /// collective gets an error instead of waiting for it forever.
    pub fn abort(&self, why: &str) {
        self.lock().failed.get_or_insert_with(|| why.to_string());
        self.arrived.notify_all();
    }

    /// Whether a rank has failed.
    pub fn aborted(&self) -> bool {
        self.lock().failed.is_some()
    }

    /// Traffic per layer.
    pub fn layers(&self) -> Vec<LayerExchange> {
        self.lock().layers.clone()
    }

    /// Deposit `parcel` and wait for every rank's; the last to arrive runs
    /// `complete` on all of them first.
    fn rendezvous(&self, rank: usize, parcel: Parcel, complete: impl FnOnce(&mut ExchangeState<'p>, &[Parcel])) -> Result<Arc<Vec<Parcel>>, ForwardError> {
        let mut st = self.lock();
        let failed = |st: &ExchangeState| st.failed.as_ref().map(|why| ForwardError::BadModule(format!("another rank failed: {why}")));
        if let Some(e) = failed(&st) {
            return Err(e);
        }
        let generation = st.generation;
        st.deposits[rank] = Some(parcel);
        st.arrived_at = st.arrived_at.max(Stamp::now());
        if st.deposits.iter().all(Option::is_some) {
            let parcels: Vec<Parcel> = st.deposits.iter_mut().map(|d| d.take().expect("checked")).collect();
            complete(&mut st, &parcels);
            st.result = Arc::new(parcels);
            st.generation += 1;
            st.completed_at = std::mem::take(&mut st.arrived_at);
            st.completed_at.join();
            self.arrived.notify_all();
            return Ok(st.result.clone());
        }
        loop {
            st = self.arrived.wait(st).unwrap_or_else(|e| e.into_inner());
            // The next collective cannot complete without this rank, so the
            // result is still this one's.
            if st.generation != generation {
                st.completed_at.join();
                return Ok(st.result.clone());
            }
            if let Some(e) = failed(&st) {
                return Err(e);
            }
        }
    }

    fn count(&self, layer: usize, f: impl FnOnce(&mut LayerExchange)) {
        if let Some(l) = self.lock().layers.get_mut(layer) {
            f(l);
        }
    }
}

/// One rank's backend: the device's ops, with attention's context and the
/// routed experts' rows exchanged with the other ranks.
pub struct RankBackend<'a, 'p> {
    device: DeviceBackend<'a>,
    rank: usize,
    exchange: &'a Exchange<'p>,
    layer: usize,
    /// The stream the rank's KV entries are downloaded on for the exchange,
    /// beside the compute stream's phase 1.
    copies: StreamId,
    /// This layer's fresh KV entries on their way to the host, by start position.
    fresh: Vec<(usize, InFlight)>,
    /// SmallEP: this rank's expert input on its way to the host, and the
    /// router's choices for it.
    outgoing: Option<(InFlight, Choices)>,
}

/// Per row, the router's `(expert, weight)` choices.
type Choices = Vec<Vec<(usize, f32)>>;

/// Rows of a rank's workspace being downloaded for an exchange.
struct InFlight {
    rows: usize,
    staging: Arc<Staging>,
    /// Ends the copy.
    copied: Event,
    since: Instant,
}

impl InFlight {
    /// Download `m` (contiguous) on `stream` once the work enqueued on `after` so far is done.
    fn start(dev: &dyn Device, m: Matrix, after: StreamId, stream: StreamId) -> Result<Self, ForwardError> {
        if !m.is_contiguous() {
            return Err(ForwardError::Workspace(format!("a {}×{} view is not contiguous", m.rows, m.cols)));
        }
        let bytes = m.rows * m.cols * 4;
        let staging = dev.staging(bytes)?;
        let computed = dev.record(after)?;
        dev.wait_event(stream, &computed)?;
        dev.download_to(stream, m.buf.slice(m.offset * 4, bytes)?, &staging, 0)?;
        Ok(InFlight { rows: m.rows, staging, copied: dev.record(stream)?, since: Instant::now() })
    }

    /// The rows, once downloaded.
    fn finish(self, dev: &dyn Device) -> Result<Vec<f32>, ForwardError> {
        dev.synchronize(&self.copied)?;
        Ok(self.staging.lock().chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect())
    }
}

impl<'a, 'p> RankBackend<'a, 'p> {
    /// Exchange this layer's fresh entries with the other ranks (the last
    /// to arrive writes everyone's into the pool) and return the others',
    /// as `(start, entries)` runs.
    fn exchange_kv(&mut self, layer: usize, entry: usize) -> Result<Vec<(usize, Vec<f32>)>, ForwardError> {
        let started = Instant::now();
        let mut parcel = Parcel::default();
        for (start, rows) in self.fresh.drain(..) {
            parcel.runs.push((start, rows.rows));
            parcel.floats.extend(rows.finish(self.device.dev)?);
        }
        if parcel.floats.len() != parcel.runs.iter().map(|r| r.1).sum::<usize>() * entry {
            return Err(ForwardError::Workspace(format!("the KV entries of layer {layer} do not have {entry} floats each")));
        }
        let sent = (parcel.floats.len() * 4 * (self.exchange.split.ranks - 1)) as u64;
        let all = self.exchange.rendezvous(self.rank, parcel, |st, parcels| {
            for p in parcels {
                let mut at = 0;
                for &(start, rows) in &p.runs {
                    for pos in start..start + rows {
                        st.pool.entry_mut(&st.table, layer, pos).copy_from_slice(&p.floats[at..at + entry]);
                        at += entry;
                    }
                }
            }
        })?;
        let mut remote = vec![];
        for (_, p) in all.iter().enumerate().filter(|&(r, _)| r != self.rank) {
            let mut at = 0;
            for &(start, rows) in &p.runs {
                remote.push((start, p.floats[at..at + rows * entry].to_vec()));
                at += rows * entry;
            }
        }
        self.exchange.count(layer, |l| {
            l.kv_bytes += sent;
            l.time += started.elapsed();
        });
        Ok(remote)
    }

    /// Keys brought from the host (`[rows, entry]`), in the segment's room for context.
    fn upload_keys(&self, c: &AttentionCall, rows: &[f32]) -> Result<Matrix, ForwardError> {
        let len = rows.len() / c.cfg.kv_entry_dim();
        if c.context.rows < len {
            return Err(ForwardError::Workspace(format!("no room for {len} positions of context")));
        }
        let dst = c.context.rows(0..len);
        self.upload_rows(rows, dst)?;
        Ok(dst)
    }

    /// Attend the segment's queries over the keys `keys` (entries as the
    /// cache holds them) at positions `key_start..`: straight into its
    /// output for the first part, else into its partial buffers and merged
    /// (online softmax, by log-sum-exp).
    fn attend_part(&mut self, c: &AttentionCall, kv_b: Option<&DeviceWeight>, key_start: usize, keys: Matrix, first: bool) -> Result<(), ForwardError> {
        let (out, lse) = if first { (c.out, c.lse) } else { (c.part, c.part_lse) };
        let (cfg, start) = (c.cfg, c.seg.start);
        match (&cfg.attention, kv_b) {
            (AttentionConfig::Mla(m), Some(kv_b)) => {
                let (heads, dn, dr, dv, dc) = (cfg.num_attention_heads, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim, m.kv_lora_rank);
                let (len, dkv) = (keys.rows, dn + dv);
                // Keys and values expanded a group of heads at a time, as in one-device attention.
                for h0 in (0..heads).step_by(c.heads_per_step.max(1)) {
                    let g = c.heads_per_step.min(heads - h0);
                    let kv = c.expanded.rows(0..len).reshape(len, g * dkv);
                    self.device.gemm(&kv_b.rows(h0 * dkv..(h0 + g) * dkv)?, keys.columns(0..dc), kv, c.precision, true)?;
                    let (q, o, l) = (c.q.columns(h0 * (dn + dr)..(h0 + g) * (dn + dr)), out.columns(h0 * dv..(h0 + g) * dv), lse.columns(h0..h0 + g));
                    let dims = MlaDims { heads: g, dn, dr, dv, dc };
                    self.device.launch(Op::MlaPrefillPart { q, kv, latents: keys, out: o, lse: l, start, key_start, dims, scale: c.scale, precision: c.precision })?;
                }
            }
            (AttentionConfig::Gqa(g), _) => {
                let kvd = g.num_key_value_heads * g.head_dim;
                let dims = GqaDims { heads: cfg.num_attention_heads, kv_heads: g.num_key_value_heads, head_dim: g.head_dim };
                let (k, v) = (keys.columns(0..kvd), keys.columns(kvd..2 * kvd));
                self.device.launch(Op::GqaAttentionPart { q: c.q, k, v, out, lse, start, key_start, dims, scale: c.scale, precision: c.precision })?;
            }
            (AttentionConfig::Mla(_), None) => return Err(ForwardError::MissingWeight("kv_b_proj".into())),
        }
        if !first {
            self.device.launch(Op::AttentionMerge { out: c.out, lse: c.lse, part: c.part, part_lse: c.part_lse, heads: cfg.num_attention_heads })?;
        }
        Ok(())
    }

    fn upload_rows(&self, rows: &[f32], dst: Matrix) -> Result<(), ForwardError> {
        if !dst.is_contiguous() || rows.len() != dst.rows * dst.cols {
            return Err(ForwardError::Workspace(format!("{} floats do not fill a {}×{} matrix", rows.len(), dst.rows, dst.cols)));
        }
        Ok(device::upload_f32(self.device.dev, self.device.stream, rows, dst.buf.slice(dst.offset * 4, rows.len() * 4)?)?)
    }
}

impl Drop for RankBackend<'_, '_> {
    fn drop(&mut self) {
        // A pass that failed mid-layer leaves downloads of its workspace in
        // flight: they must end before the workspace is given back.
        let in_flight = self.fresh.drain(..).map(|(_, rows)| rows).chain(self.outgoing.take().map(|(rows, _)| rows));
        for rows in in_flight.collect::<Vec<_>>() {
            let _ = self.device.dev.synchronize(&rows.copied);
        }
    }
}

impl Backend for RankBackend<'_, '_> {
    type Weight = DeviceWeight;
    const ATTENDS_IN_PLACE: bool = false;

    fn rows_of(w: &DeviceWeight) -> Result<usize, ForwardError> {
        Ok(w.rows)
    }
    fn workspace(&mut self, bytes: usize) -> Result<DevicePtr, ForwardError> {
        self.device.workspace(bytes)
    }
    fn upload_f32(&mut self, xs: &[f32], dst: DevicePtr) -> Result<(), ForwardError> {
        self.device.upload_f32(xs, dst)
    }
    fn upload_u32(&mut self, xs: &[u32], dst: DevicePtr) -> Result<(), ForwardError> {
        self.device.upload_u32(xs, dst)
    }
    fn download(&mut self, m: Matrix) -> Result<Vec<f32>, ForwardError> {
        self.device.download(m)
    }
    fn embedding(&mut self, table: &DeviceWeight, first_row: usize, ids: DevicePtr, count: usize, out: Matrix, p: Precision) -> Result<(), ForwardError> {
        self.device.embedding(table, first_row, ids, count, out, p)
    }
    fn gemm(&mut self, w: &DeviceWeight, x: Matrix, y: Matrix, p: Precision, round: bool) -> Result<(), ForwardError> {
        self.device.gemm(w, x, y, p, round)
    }
    fn router_logits(&mut self, w: &DeviceWeight, x: Matrix, y: Matrix, p: Precision) -> Result<(), ForwardError> {
        self.device.router_logits(w, x, y, p)
    }
    fn rms_norm(&mut self, x: Matrix, weight: &DeviceWeight, out: Matrix, eps: f32, p: Precision) -> Result<(), ForwardError> {
        self.device.rms_norm(x, weight, out, eps, p)
    }
    fn rope(&mut self, x: Matrix, cos: Matrix, sin: Matrix, rows_per_position: usize, interleaved: bool, p: Precision) -> Result<(), ForwardError> {
        self.device.rope(x, cos, sin, rows_per_position, interleaved, p)
    }
    fn add(&mut self, h: Matrix, delta: Matrix, p: Precision) -> Result<(), ForwardError> {
        self.device.add(h, delta, p)
    }
    fn round_bf16(&mut self, x: Matrix) -> Result<(), ForwardError> {
        self.device.round_bf16(x)
    }
    fn zero(&mut self, x: Matrix) -> Result<(), ForwardError> {
        self.device.zero(x)
    }
    fn route(&mut self, route: RouteCall<'_, DeviceWeight>) -> Result<Routes, ForwardError> {
        self.device.route(route)
    }
    fn copy(&mut self, src: Matrix, dst: Matrix) -> Result<(), ForwardError> {
        self.device.copy(src, dst)
    }
    fn experts(&mut self, x: Matrix, jobs: &[ExpertJob<DeviceWeight>], out: Matrix, p: Precision, scratch: &ExpertScratch) -> Result<(), ForwardError> {
        self.device.experts(x, jobs, out, p, scratch)
    }

    fn send_expert_input(&mut self, x: Matrix, chosen: Vec<Vec<(usize, f32)>>) -> Result<(), ForwardError> {
        // Downloaded on the copy stream, beside the shared experts on the compute stream.
        self.outgoing = Some((InFlight::start(self.device.dev, x, self.device.stream, self.copies)?, chosen));
        Ok(())
    }

    fn gather_expert_input(&mut self, x_all: Matrix) -> Result<Vec<Vec<(usize, f32)>>, ForwardError> {
        let (rows, chosen) = self.outgoing.take().ok_or_else(|| ForwardError::BadModule("experts gathered before their input was sent".into()))?;
        let started = rows.since;
        let split = &self.exchange.split;
        let (d, ranks) = (x_all.cols as u64, split.ranks as u64);
        // Classic EP ships a row to each of its experts' owners but its own, and the output back.
        let remote = chosen.iter().flatten().filter(|&&(e, _)| split.owner_of(e) != self.rank).count() as u64;
        let rows = rows.finish(self.device.dev)?;
        let sent = rows.len() as u64 * 4 * (ranks - 1);
        let all = self.exchange.rendezvous(self.rank, Parcel { floats: rows, picks: chosen, runs: vec![] }, |_, _| {})?;
        let floats: Vec<f32> = all.iter().flat_map(|p| p.floats.iter().copied()).collect();
        self.upload_rows(&floats, x_all)?;
        let picks = all.iter().flat_map(|p| p.picks.iter().cloned()).collect();
        self.exchange.count(self.layer, |l| {
            l.gather_bytes += sent;
            l.standard_ep_bytes += 2 * remote * d * 4;
            l.time += started.elapsed();
        });
        Ok(picks)
    }

    fn reduce_expert_output(&mut self, out_all: Matrix, out: Matrix) -> Result<(), ForwardError> {
        let started = Instant::now();
        let split = &self.exchange.split;
        let d = out_all.cols;
        let mine = split.first_row_of(self.rank)..split.first_row_of(self.rank) + split.rows_of(self.rank);
        let partial = self.device.download(out_all)?;
        // Each rank needs only its own rows of the others' partial sums.
        let sent = ((split.rows() - mine.len()) * d * 4) as u64;
        let all = self.exchange.rendezvous(self.rank, Parcel { floats: partial, picks: vec![], runs: vec![] }, |_, _| {})?;
        let mut sum = vec![0.0f32; mine.len() * d];
        for p in all.iter() {
            for (s, x) in sum.iter_mut().zip(&p.floats[mine.start * d..mine.end * d]) {
                *s += x;
            }
        }
        let own = out_all.rows(mine);
        self.upload_rows(&sum, own)?;
        self.device.launch(Op::Add { h: out, delta: own, precision: Precision::F32 })?;
        self.exchange.count(self.layer, |l| {
            l.reduce_bytes += sent;
            l.time += started.elapsed();
        });
        Ok(())
    }

    fn store_kv(&mut self, layer: usize, parts: &[Matrix], seg: &Segment, _pool: &mut KvPool) -> Result<(), ForwardError> {
        // Downloaded on the copy stream once computed, while phase 1 of the
        // attention runs; the layer's attention exchanges them (and writes
        // them into the pool).
        self.layer = layer;
        let [entries] = parts else {
            return Err(ForwardError::BadModule(format!("a rank stores KV entries as one matrix, not {}", parts.len())));
        };
        if entries.rows != seg.n {
            return Err(ForwardError::Workspace(format!("KV entries of {} rows for a {}-token segment", entries.rows, seg.n)));
        }
        let rows = InFlight::start(self.device.dev, *entries, self.device.stream, self.copies)?;
        self.fresh.push((seg.start, rows));
        Ok(())
    }

    fn mla_attention(&mut self, c: &AttentionCall, w: &Weights<DeviceWeight>) -> Result<(), ForwardError> {
        self.attention(std::slice::from_ref(c), w)
    }

    fn gqa_attention(&mut self, c: &AttentionCall) -> Result<(), ForwardError> {
        self.attention(std::slice::from_ref(c), &Weights::default())
    }

    /// Pass-KV context parallelism. Phase 1: every segment attends the keys
    /// this rank has (its own chunks, the cached prefix), enqueued before
    /// the exchange, so the device computes while the host waits for the
    /// peers. Phase 2: each segment attends the peers' chunks before its
    /// end, each part merged into its output by log-sum-exp.
    fn attention(&mut self, calls: &[AttentionCall], w: &Weights<DeviceWeight>) -> Result<(), ForwardError> {
        let Some(first) = calls.first() else { return Ok(()) };
        let (layer, cfg) = (first.layer, first.cfg);
        let entry = cfg.kv_entry_dim();
        let kv_b = match cfg.attention {
            AttentionConfig::Mla(_) => Some(*w.get("kv_b_proj")?),
            AttentionConfig::Gqa(_) => None,
        };
        let cached = self.exchange.split.first_position();
        let prefix = if cached > 0 { Some(self.exchange.read(layer, 0..cached)) } else { None };
        for c in calls {
            // Its own chunk first: every query sees at least itself.
            self.attend_part(c, kv_b.as_ref(), c.seg.start, c.fresh, true)?;
            for own in calls.iter().filter(|o| o.seg.start < c.seg.start) {
                self.attend_part(c, kv_b.as_ref(), own.seg.start, own.fresh, false)?;
            }
            if let Some(prefix) = &prefix {
                let keys = self.upload_keys(c, prefix)?;
                self.attend_part(c, kv_b.as_ref(), 0, keys, false)?;
            }
        }
        let remote = self.exchange_kv(layer, entry)?;
        for c in calls {
            let end = c.seg.start + c.seg.n;
            for (start, rows) in remote.iter().filter(|(start, _)| *start < end) {
                let keys = self.upload_keys(c, rows)?;
                self.attend_part(c, kv_b.as_ref(), *start, keys, false)?;
            }
            if c.precision == Precision::Bf16 {
                self.device.round_bf16(c.out)?;
            }
        }
        Ok(())
    }
}

/// Device bytes of rank `rank`'s activations in a pass over `split`.
pub fn workspace_bytes(model: &Model, split: &ZigZag, rank: usize, want: Logits, kv_bytes: usize) -> Result<usize, ForwardError> {
    let shard = ExpertShard { experts: split.experts_of(rank), rows_all: split.rows() };
    let chunks = split.chunks_of(rank).map(|c| (c.start, c.len()));
    let shape = Pass::<RankBackend>::ranked_shape(&model.cfg, chunks.into_iter(), Some(&shard), want, kv_bytes)?;
    Ok(crate::forward::workspace_bytes(&model.cfg, shape))
}

/// A rank's streams: its pass computes on one, and downloads its KV
/// entries for the exchange on the other.
#[derive(Clone, Copy, Debug)]
pub struct RankStreams {
    pub compute: StreamId,
    pub copies: StreamId,
}

/// One rank's pass through its staged modules, on one device stream.
pub struct RankedPass<'a, 'p> {
    pass: Pass<'a, RankBackend<'a, 'p>>,
    /// Ranks reach the shared pool only through the exchange; the program's
    /// own pool argument is this one, which has no blocks.
    no_pool: KvPool,
}

impl<'a, 'p> RankedPass<'a, 'p> {
    /// Prepare rank `rank`'s share of a pass of `tokens` (the prompt's new
    /// tokens, all ranks' together) that continues the sequence of the
    /// exchange's table, with activations in `workspace` (at least
    /// [`workspace_bytes`] long for the same `kv_bytes`).
    #[allow(clippy::too_many_arguments)]
    pub fn new(model: &'a Model, dev: &'a dyn Device, streams: RankStreams, rank: usize, exchange: &'a Exchange<'p>, table: &BlockTable, tokens: &[u32], precision: Precision, want: Logits, workspace: DevicePtr, kv_bytes: usize) -> Result<Self, ForwardError> {
        let split = exchange.split();
        let first = split.first_position();
        let chunks = split.chunks_of(rank);
        let mut parts: Vec<(usize, &[u32])> = vec![];
        for c in &chunks {
            let t = tokens.get(c.start - first..c.end - first).ok_or_else(|| ForwardError::BadModule(format!("positions {c:?} beyond the {} tokens given", tokens.len())))?;
            parts.push((c.start, t));
        }
        let backend = RankBackend { device: DeviceBackend::new(dev, streams.compute, workspace), rank, exchange, layer: 0, copies: streams.copies, fresh: vec![], outgoing: None };
        let shard = ExpertShard { experts: split.experts_of(rank), rows_all: split.rows() };
        let pass = Pass::ranked(model, backend, table, &parts, Some(shard), precision, want, kv_bytes)?;
        Ok(RankedPass { pass, no_pool: KvPool::new(0, 1, 1, 1) })
    }

    /// Run one module whose weights are on the device.
    pub fn run(&mut self, kind: ModuleKind, w: &Weights<DeviceWeight>) -> Result<(), ForwardError> {
        self.pass.run(kind, w, &mut self.no_pool)
    }

    /// This rank's logits, one row per chunk for [`Logits::Last`] or one per
    /// token for [`Logits::All`] (its chunks in order), once every module
    /// has run; empty when this rank computed none.
    pub fn finish(self, want: Logits) -> Result<Vec<f32>, ForwardError> {
        let wanted = self.pass.backend.exchange.split.wants_logits(self.pass.backend.rank, want);
        let logits = self.pass.finish(&mut [])?.0;
        Ok(if wanted { logits } else { vec![] })
    }
}
