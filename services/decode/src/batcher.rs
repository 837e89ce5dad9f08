//! The engine loop: one thread owns the model and the KV pool, and runs
//! steps of continuous batching.
//!
//! Each step takes every running sequence that is decoding (one token each)
//! plus chunks of the prompts still being prefilled, sharing a budget of
//! `prefill_chunk_tokens` first come first served, and runs them as one
//! forward pass. Sequences join when a place in the batch and their KV
//! blocks are free, and leave when they finish or their client goes away;
//! the check for a departed client happens at the start of every step, so a
//! cancelled request stops within one step and its blocks return at once.
//!
//! KV admission. Every request reserves its whole need, prompt plus
//! `max_tokens` within the context, before it starts: a sequence on this
//! worker's path when it leaves the queue, a long prompt when its lease for
//! the prefill worker is granted. Admitted work can therefore always finish,
//! and nothing is ever preempted. Preemption (free the newest sequence's
//! blocks, recompute it later, as vLLM does) would use the pool better when
//! requests stop early, but here the costly part of a long prompt is its
//! prefill on the other worker, whose KV lives in blocks lent across
//! processes: evicting it would redo minutes of work, and a lease that could
//! be taken back mid-prefill would need a protocol of its own. Reserving the
//! prompt alone and the output later is what deadlocked: leases holding the
//! pool, each sequence waiting for the few blocks of output the others held.
//!
//! Prefix caching (`kv_alloc`). When a request's blocks are granted, its
//! table starts with the cached blocks of its prompt's longest cached
//! prefix: a sequence here then prefills only the rest, a lease tells the
//! prefill worker where to start. Cached blocks no request holds count as
//! free, so the cache changes how much a request needs, never whether the
//! pool can grant it. A sequence's full blocks are registered as each step
//! writes them, prompt and output alike (the next turn of a chat resends
//! the answer); with a device they are first copied back from its device
//! blocks into its host blocks, where the cache can share them.
//!
//! Requests that do not fit yet wait in one queue, leases and sequences
//! alike, first come first served: the front waits for blocks and holds
//! back those behind it, so a long prompt is not starved by short ones. The
//! queue is bounded (`max_waiting_requests`; beyond it RESOURCE_EXHAUSTED),
//! and a request whose need exceeds the whole pool is refused at once
//! (INVALID_ARGUMENT: it would never run). Sequences holding their blocks
//! then wait only for a place in the batch, which running sequences free as
//! they finish.
//!
//! A sequence's events are its tokens, the last one saying why it ends
//! (`FinishRule`, applied here to every token this worker samples), or the
//! error that ended it: `SeqEvent`, which `server.rs` puts on the wire.

use crate::constraint::{fill_masks, Constrained};
use crate::engine::{Engine, StepTimings};
use crate::error::DecodeError;
use crate::kv_alloc::{BlockLease, KvAllocator};
use crate::prefix_cache::BlockHashes;
use duplex_model::hybrid::{AdmitError, DeviceSeq};
use duplex_model::model::ForwardError;
use duplex_model::sampling::{SampledToken, Sampler, SamplingParams};
use duplex_model::{BlockTable, Precision, SeqInput};
use duplex_proto::stats::StatsCell;
use duplex_text::{FinishReason, FinishRule};
use duplex_telemetry as names;
use std::collections::{HashSet, VecDeque};
use std::sync::Arc;
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, oneshot};

pub type EventSender = mpsc::UnboundedSender<SeqEvent>;
pub type LeaseReply = oneshot::Sender<Result<BlockLease, DecodeError>>;

/// What a sequence's stream carries: tokens until the one with `finish`,
/// or an error; nothing after either.
#[derive(Debug)]
pub enum SeqEvent {
    Token { token: SampledToken, finish: Option<Finish> },
    Failed(DecodeError),
}

/// Why a sequence ended with its last token, and how long it waited here.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Finish {
    pub reason: FinishReason,
    /// From admission to its first step.
    pub queue: Duration,
}

/// A validated request to decode.
pub struct Admission {
    pub request_id: String,
    pub prompt: Vec<u32>,
    pub sampling: SamplingParams,
    pub max_tokens: usize,
    pub stop_token_ids: HashSet<u32>,
    /// Set when the prefill worker already ran the prompt into a lease.
    pub prefilled: Option<Prefilled>,
    /// Structured output, compiled: the tokens must keep to it.
    pub constraint: Option<duplex_grammar::Matcher>,
    pub events: EventSender,
    pub arrived: Instant,
}

pub struct Prefilled {
    pub lease: BlockLease,
    /// Sampled by the prefill worker, which said it was not the last.
    pub first_token: SampledToken,
}

pub enum Command {
    Admit(Box<Admission>),
    /// A lease for a prompt of `tokens` tokens (`prompt`, or empty when
    /// the router did not send it) that may generate up to `max_tokens`;
    /// answered when the blocks are granted.
    AllocateKv { request_id: String, tokens: usize, prompt: Vec<u32>, max_tokens: usize, reply: LeaseReply },
    FreeKv { request_id: String, reply: oneshot::Sender<bool> },
    Cancel { request_id: String, reply: oneshot::Sender<bool> },
    /// How many sequences are running or queued (the device lease is
    /// granted only at none).
    Sequences { reply: oneshot::Sender<usize> },
}

pub struct Limits {
    pub context_length: usize,
    /// A lease not admitted nor freed within this long is freed.
    pub lease_timeout: Duration,
    pub max_batch_size: usize,
    pub prefill_chunk_tokens: usize,
    /// Requests that may wait for KV blocks at once; more are refused.
    pub max_waiting_requests: usize,
}

impl Limits {
    /// The worker's limits as configured, for a context of `context_length`.
    pub fn of(cfg: &crate::DecodeConfig, context_length: usize) -> Limits {
        Limits {
            context_length,
            lease_timeout: Duration::from_secs(cfg.lease_timeout_seconds),
            max_batch_size: cfg.max_batch_size.max(1),
            prefill_chunk_tokens: cfg.prefill_chunk_tokens.max(1),
            max_waiting_requests: cfg.max_waiting_requests,
        }
    }
}

struct Sequence {
    request_id: String,
    prompt: Vec<u32>,
    generated: Vec<u32>,
    /// Prompt tokens already in the cache.
    prefilled: usize,
    /// Of those, the ones shared from the prefix cache.
    cached: usize,
    table: BlockTable,
    /// The hashes of the prompt's full blocks, then of the output's as they
    /// fill (prefix caching).
    hashes: BlockHashes,
    /// Leading blocks of `table` that are in the prefix cache.
    registered: usize,
    /// Its blocks in the device KV pool (hybrid placement), from when it
    /// first runs until it leaves.
    device: Option<DeviceSeq>,
    sampler: Sampler,
    /// When its latest token is its last.
    finish: FinishRule,
    /// Structured output: its matcher, and the mask it fills.
    constraint: Option<Box<Constrained>>,
    events: EventSender,
    arrived: Instant,
    /// When it first took part in a step.
    started: Option<Instant>,
}

/// A request waiting for its KV blocks.
enum Waiter {
    /// To prefill and decode here; holds no blocks yet (boxed: a sequence
    /// is far larger than a lease request).
    Sequence(Box<Sequence>),
    /// A lease for the prefill worker.
    Lease(LeaseAsk),
}

struct LeaseAsk {
    request_id: String,
    tokens: usize,
    /// Empty when the router did not send it.
    prompt: Vec<u32>,
    hashes: BlockHashes,
    /// Prompt plus `max_tokens`, within the context.
    positions: usize,
    reply: LeaseReply,
    arrived: Instant,
}

impl Waiter {
    fn request_id(&self) -> &str {
        match self {
            Waiter::Sequence(s) => &s.request_id,
            Waiter::Lease(l) => &l.request_id,
        }
    }

    fn arrived(&self) -> Instant {
        match self {
            Waiter::Sequence(s) => s.arrived,
            Waiter::Lease(l) => l.arrived,
        }
    }

    /// Its caller has gone (a closed stream, a router that stopped waiting).
    fn is_gone(&self) -> bool {
        match self {
            Waiter::Sequence(s) => s.events.is_closed(),
            Waiter::Lease(l) => l.reply.is_closed(),
        }
    }

    fn refuse(self, e: DecodeError) {
        match self {
            Waiter::Sequence(s) => reject(&s.events, e),
            Waiter::Lease(l) => {
                let _ = l.reply.send(Err(e));
            }
        }
    }
}

impl Sequence {
    /// The tokens this sequence runs in the next step, if any budget is left.
    fn next_tokens(&self, budget: &mut usize) -> Option<std::ops::Range<usize>> {
        if self.prefilled < self.prompt.len() {
            let n = (*budget).min(self.prompt.len() - self.prefilled);
            *budget -= n;
            (n > 0).then(|| self.prefilled..self.prefilled + n)
        } else {
            Some(0..1)
        }
    }

    fn queue_time(&self) -> Duration {
        self.started.map_or(Duration::ZERO, |s| s - self.arrived)
    }

    /// Why the sequence is done after its latest token, if it is.
    fn finish_reason(&self) -> Option<FinishReason> {
        let last = *self.generated.last()?;
        self.finish.check(self.prompt.len(), self.generated.len(), last)
    }
}

pub struct Batcher {
    engine: Engine,
    kv: KvAllocator,
    limits: Limits,
    precision: Precision,
    /// Waiting for KV blocks, in arrival order.
    waiting: VecDeque<Waiter>,
    /// Holding their blocks, waiting for a place in the batch.
    ready: VecDeque<Sequence>,
    running: Vec<Sequence>,
    stats: Arc<StatsCell>,
}

impl Batcher {
    pub fn new(engine: Engine, kv: KvAllocator, limits: Limits, precision: Precision, stats: Arc<StatsCell>) -> Self {
        stats.pool_epoch.store(kv.epoch(), std::sync::atomic::Ordering::Relaxed);
        StatsCell::set(&stats.kv_blocks_total, kv.total_blocks());
        StatsCell::set(&stats.kv_block_size, kv.block_size());
        Batcher { engine, kv, limits, precision, waiting: VecDeque::new(), ready: VecDeque::new(), running: vec![], stats }
    }

    pub fn model(&self) -> &duplex_model::Model {
        self.engine.model()
    }

    /// Run until every sender of `commands` is gone.
    pub fn run(mut self, commands: Receiver<Command>) {
        // However the loop ends, a panic included, Stats says so from then on.
        struct Stopped(Arc<StatsCell>);
        impl Drop for Stopped {
            fn drop(&mut self) {
                self.0.engine_stopped.store(true, std::sync::atomic::Ordering::Relaxed);
            }
        }
        let _stopped = Stopped(self.stats.clone());
        loop {
            // Nothing running: block for work (briefly, when requests wait
            // for blocks a lease holds, so that departed waiters are noticed).
            // Busy: take what has arrived and step.
            let first = if self.running.is_empty() {
                let wait = if self.waiting.is_empty() { Duration::from_secs(1) } else { Duration::from_millis(10) };
                match commands.recv_timeout(wait) {
                    Ok(c) => Some(c),
                    Err(RecvTimeoutError::Timeout) => None,
                    Err(RecvTimeoutError::Disconnected) => return,
                }
            } else {
                commands.try_recv().ok()
            };
            self.turn(first.into_iter().chain(std::iter::from_fn(|| commands.try_recv().ok())));
        }
    }

    /// One turn of the loop: take `commands`, free expired leases, run a
    /// step if anything can run. `run` turns as commands arrive; `duplex
    /// simulate` turns it on a virtual clock, handing each command over
    /// when its simulated time comes.
    pub fn turn(&mut self, commands: impl IntoIterator<Item = Command>) {
        for c in commands {
            self.handle(c);
        }
        for id in self.kv.expire_leases(self.limits.lease_timeout) {
            tracing::warn!("freed the KV lease of request {id}: not admitted within {:?}", self.limits.lease_timeout);
        }
        self.step();
        self.export_gauges();
    }

    /// Whether a turn would run a step: some sequence holds its blocks.
    /// (Requests waiting for blocks wait for a step or a freed lease.)
    pub fn has_work(&self) -> bool {
        !self.running.is_empty() || !self.ready.is_empty()
    }

    fn handle(&mut self, command: Command) {
        match command {
            Command::Admit(a) => self.admit(*a),
            Command::AllocateKv { request_id, tokens, prompt, max_tokens, reply } => match self.check_lease(&request_id, tokens, max_tokens) {
                Ok(positions) => {
                    let hashes = self.kv.hashes(&prompt);
                    self.enqueue(Waiter::Lease(LeaseAsk { request_id, tokens, prompt, hashes, positions, reply, arrived: Instant::now() }))
                }
                Err(e) => {
                    let _ = reply.send(Err(e));
                }
            },
            Command::FreeKv { request_id, reply } => {
                // A lease still waiting for blocks is withdrawn; a granted
                // one freed (and one not asked for yet, refused when asked).
                let found = self.withdraw(&request_id, |w| matches!(w, Waiter::Lease(_))) || self.kv.free_lease(&request_id);
                let _ = reply.send(found);
            }
            Command::Cancel { request_id, reply } => {
                let found = self.kv.free_lease(&request_id) | self.cancel(&request_id);
                let _ = reply.send(found);
            }
            Command::Sequences { reply } => {
                let waiting = self.waiting.iter().filter(|w| matches!(w, Waiter::Sequence(_))).count();
                let _ = reply.send(self.running.len() + self.ready.len() + waiting);
            }
        }
    }

    fn admit(&mut self, a: Admission) {
        tracing::debug!(request_id = %a.request_id, prompt_tokens = a.prompt.len(), prefilled = a.prefilled.is_some(), "admission");
        let sampler = match &a.prefilled {
            Some(p) => Sampler::resume(a.sampling, &a.prompt, &[p.first_token.id]),
            None => Sampler::new(a.sampling, &a.prompt),
        };
        let sampler = match sampler {
            Ok(s) => s,
            Err(e) => return reject(&a.events, DecodeError::InvalidArgument(e.to_string())),
        };
        let hashes = self.kv.hashes(&a.prompt);
        let mut seq = Sequence {
            request_id: a.request_id,
            prompt: a.prompt,
            generated: vec![],
            prefilled: 0,
            cached: 0,
            table: BlockTable::default(),
            hashes,
            registered: 0,
            device: None,
            sampler,
            constraint: a.constraint.map(|m| Box::new(Constrained::new(m, &a.stop_token_ids))),
            finish: FinishRule { stop_token_ids: a.stop_token_ids, max_tokens: a.max_tokens, context_length: self.limits.context_length },
            events: a.events,
            arrived: a.arrived,
            started: None,
        };
        let positions = reserve_len(&seq, self.limits.context_length);
        if let Some(p) = a.prefilled {
            if let Err(e) = self.fits(positions) {
                self.kv.free_lease(&seq.request_id);
                return reject(&seq.events, e);
            }
            // The lease already holds the whole need: no wait for blocks.
            match self.kv.take_lease(&seq.request_id, &p.lease, &seq.prompt, positions) {
                Ok(table) => seq.table = table,
                Err(e) => return reject(&seq.events, e),
            }
            // The prefill worker wrote the prompt into host blocks: cache them.
            seq.registered = self.kv.register(&seq.table, seq.hashes.as_slice(), 0);
            seq.prefilled = seq.prompt.len();
            seq.cached = p.lease.cached_tokens as usize;
            if let Some(Err(e)) = seq.constraint.as_mut().map(|c| c.accept(p.first_token.id)) {
                self.kv.release(&mut seq.table);
                return reject(&seq.events, DecodeError::InvalidArgument(format!("the prefilled first token: {e}")));
            }
            seq.generated.push(p.first_token.id);
            if let Some(reason) = seq.finish_reason() {
                // The prefill worker, which sampled that token, said it was
                // not the last; by this worker's rule it is. Nothing to do.
                release(&mut self.kv, &mut self.engine, &mut seq);
                let why = format!("request {} already ends with its prefilled first token ({}): there is nothing to decode", seq.request_id, reason.as_str());
                return reject(&seq.events, DecodeError::InvalidArgument(why));
            }
            self.ready.push_back(seq);
            return;
        }
        if let Err(e) = self.fits(positions) {
            return reject(&seq.events, e);
        }
        self.enqueue(Waiter::Sequence(Box::new(seq)));
    }

    /// Refuses, at once, a need the whole pool could never hold.
    fn fits(&self, positions: usize) -> Result<(), DecodeError> {
        let (need, total) = (self.kv.blocks_for(positions), self.kv.total_blocks());
        if need > total {
            return Err(DecodeError::InvalidArgument(format!(
                "the request needs {need} KV blocks ({positions} positions: prompt plus max_tokens, within the context of {}) but the pool has only {total}; it can never run on this worker",
                self.limits.context_length
            )));
        }
        if let Some((need, total)) = self.engine.device_need(positions) {
            if need > total {
                return Err(DecodeError::InvalidArgument(format!(
                    "the request needs {need} device KV blocks ({positions} positions: prompt plus max_tokens) but the device pool has only {total} (device_kv_blocks); it can never run on this worker"
                )));
            }
        }
        Ok(())
    }

    /// Checks an AllocateKv; returns the positions the lease must hold.
    fn check_lease(&mut self, request_id: &str, tokens: usize, max_tokens: usize) -> Result<usize, DecodeError> {
        let context = self.limits.context_length;
        if tokens == 0 {
            return Err(DecodeError::InvalidArgument("a KV lease needs at least one prompt token".into()));
        }
        if max_tokens == 0 {
            return Err(DecodeError::InvalidArgument("max_tokens must be at least 1: the lease holds the prompt plus the output".into()));
        }
        if tokens >= context {
            return Err(DecodeError::InvalidArgument(format!("prompt has {tokens} tokens; the context length is {context}")));
        }
        if self.waiting.iter().any(|w| w.request_id() == request_id) {
            return Err(DecodeError::AlreadyExists(format!("request {request_id} already waits for a KV lease")));
        }
        self.kv.check_lease(request_id)?;
        let positions = (tokens + max_tokens).min(context);
        self.fits(positions)?;
        Ok(positions)
    }

    /// Queue a request for its blocks, behind those already waiting; grant
    /// what the pool allows; refuse it if that leaves too many waiting.
    fn enqueue(&mut self, waiter: Waiter) {
        self.waiting.push_back(waiter);
        self.grant();
        // Granting is in arrival order, so a newcomer still waiting is last.
        if self.waiting.len() > self.limits.max_waiting_requests {
            if let Some(waiter) = self.waiting.pop_back() {
                waiter.refuse(DecodeError::ResourceExhausted(format!(
                    "{} requests already wait for KV blocks on the decode worker (max_waiting_requests); retry later",
                    self.waiting.len()
                )));
            }
        }
    }

    /// Give blocks to the waiting requests in arrival order while the pool
    /// has enough for the one in front (less what it finds cached).
    fn grant(&mut self) {
        while let Some(front) = self.waiting.front() {
            let (positions, hits) = match front {
                Waiter::Sequence(seq) => (reserve_len(seq, self.limits.context_length), self.kv.lookup(seq.prompt.len(), seq.hashes.as_slice())),
                Waiter::Lease(ask) => (ask.positions, self.kv.lookup(ask.tokens, ask.hashes.as_slice())),
            };
            if !self.kv.can_allocate(&hits, positions) {
                break; // first come, first served: wait for blocks to free up
            }
            let Some(waiter) = self.waiting.pop_front() else { break };
            metrics::histogram!(names::KV_WAIT_TIME).record(waiter.arrived().elapsed().as_secs_f64());
            self.stats.progressed();
            match waiter {
                Waiter::Sequence(mut seq) => match self.kv.allocate(seq.prompt.len(), &hits, positions) {
                    Ok(table) => {
                        // The cached prefix is prefilled already.
                        (seq.prefilled, seq.cached, seq.registered) = (table.len, table.len, hits.len());
                        seq.table = table;
                        self.ready.push_back(*seq)
                    }
                    Err(e) => reject(&seq.events, DecodeError::Internal(format!("cannot reserve KV blocks the pool reported free: {e}"))),
                },
                Waiter::Lease(ask) => match self.kv.lease(&ask.request_id, ask.prompt, ask.tokens, &hits, positions) {
                    Ok(lease) => {
                        if ask.reply.send(Ok(lease)).is_err() {
                            // The router stopped waiting just now.
                            self.kv.free_lease(&ask.request_id);
                        }
                    }
                    Err(e) => {
                        let _ = ask.reply.send(Err(DecodeError::Internal(format!("cannot reserve KV blocks the pool reported free: {e}"))));
                    }
                },
            }
        }
    }

    /// Remove the waiting request `request_id` if `which` holds of it,
    /// telling its caller it was cancelled; whether there was one.
    fn withdraw(&mut self, request_id: &str, which: impl Fn(&Waiter) -> bool) -> bool {
        let Some(i) = self.waiting.iter().position(|w| w.request_id() == request_id && which(w)) else { return false };
        if let Some(waiter) = self.waiting.remove(i) {
            waiter.refuse(DecodeError::Cancelled("cancelled while waiting for KV blocks".into()));
        }
        true
    }

    fn cancel(&mut self, request_id: &str) -> bool {
        let before = self.running.len() + self.ready.len();
        let (kv, engine, running, ready) = (&mut self.kv, &mut self.engine, &mut self.running, &mut self.ready);
        let mut drop_seq = |s: &mut Sequence| {
            if s.request_id == request_id {
                let _ = s.events.send(SeqEvent::Failed(DecodeError::Cancelled("cancelled".into())));
                release(kv, engine, s);
                false
            } else {
                true
            }
        };
        running.retain_mut(&mut drop_seq);
        ready.retain_mut(&mut drop_seq);
        let dropped = before != self.running.len() + self.ready.len();
        self.withdraw(request_id, |_| true) || dropped
    }

    /// Drop requests whose caller has gone, grant blocks in arrival order
    /// while they last, then fill the batch with sequences that hold theirs.
    fn schedule(&mut self) {
        let (kv, engine) = (&mut self.kv, &mut self.engine);
        let mut gone = |s: &mut Sequence| {
            if s.events.is_closed() {
                release(kv, engine, s);
                false
            } else {
                true
            }
        };
        self.running.retain_mut(&mut gone);
        self.ready.retain_mut(&mut gone);
        // Waiters hold no blocks; one that left must not hold back the rest.
        self.waiting.retain(|w| !w.is_gone());
        self.grant();
        while self.running.len() < self.limits.max_batch_size {
            let Some(mut seq) = self.ready.pop_front() else { break };
            // With a device, a sequence runs once its blocks are in the
            // device pool: copied in now, overlapped with the steps that
            // run meanwhile. A full pool keeps it (and those behind it)
            // waiting until running sequences leave.
            match self.engine.admit(self.kv.pool(), &seq.table, reserve_len(&seq, self.limits.context_length)) {
                Ok(device) => seq.device = device,
                Err(AdmitError::Full { .. }) if !self.running.is_empty() => {
                    self.ready.push_front(seq);
                    break;
                }
                Err(e) => {
                    reject(&seq.events, DecodeError::Internal(format!("cannot place the sequence's KV cache on the device: {e}")));
                    self.kv.release(&mut seq.table);
                    continue;
                }
            }
            self.running.push(seq);
        }
    }

    fn step(&mut self) {
        self.schedule();
        if self.running.is_empty() {
            return;
        }
        let started = Instant::now();
        let mut budget = self.limits.prefill_chunk_tokens.max(1);
        let mut members = vec![];
        let mut inputs = vec![];
        let mut device = vec![];
        // The constrained sequences that sample after this pass.
        let mut to_mask = vec![];
        for (i, seq) in self.running.iter_mut().enumerate() {
            let Some(range) = seq.next_tokens(&mut budget) else { continue };
            seq.started.get_or_insert(started);
            let Sequence { prompt, generated, prefilled, table, device: on_device, constraint, .. } = seq;
            let tokens = if *prefilled < prompt.len() { &prompt[range.clone()] } else { &generated[generated.len() - 1..] };
            if let Some(c) = constraint.as_deref_mut().filter(|_| *prefilled + range.len() >= prompt.len()) {
                to_mask.push(c);
            }
            members.push((i, range.len()));
            inputs.push(SeqInput { table, tokens });
            device.push(on_device.as_ref());
        }
        // The step's events (finishes, departures) carry its batch size.
        let _step = tracing::debug_span!("step", batch = members.len()).entered();
        // Their masks are computed on another thread while the pass runs.
        let (engine, pool, precision) = (&mut self.engine, self.kv.pool_mut(), self.precision);
        let result = std::thread::scope(|s| {
            if !to_mask.is_empty() {
                s.spawn(move || fill_masks(to_mask));
            }
            engine.forward(pool, &mut inputs, &device, precision)
        });
        drop(inputs);
        drop(device);
        let elapsed = started.elapsed();
        metrics::histogram!(names::DECODE_BATCH_SIZE).record(members.len() as f64);
        metrics::histogram!(names::DECODE_STEP_TIME, "part" => "total").record(elapsed.as_secs_f64());
        self.stats.progressed();
        match result {
            Ok((logits, timings)) => {
                record_step(&timings, elapsed);
                self.cache_written(&members);
                self.advance(&members, &logits)
            }
            Err(e) => self.fail_members(&members, e),
        }
    }

    /// Register the blocks the step filled in the prefix cache. The CPU
    /// engine wrote them into the host pool; with a device they are copied
    /// back from the sequence's device blocks first (a block's worth of
    /// entries each `block_size` tokens, far less than the step computes).
    fn cache_written(&mut self, members: &[(usize, usize)]) {
        if !self.kv.prefix_caching() {
            return;
        }
        let block_size = self.kv.block_size();
        for &(i, _) in members {
            let seq = &mut self.running[i];
            let full = seq.table.len / block_size;
            if full <= seq.registered {
                continue;
            }
            if let Err(e) = self.engine.write_back(self.kv.pool_mut(), &seq.table, seq.device.as_ref(), seq.registered..full) {
                // The sequence runs on; only the cache misses these blocks.
                tracing::warn!(request_id = %seq.request_id, "prefix cache: copying KV blocks back from the device: {e}");
                continue;
            }
            // The tokens written: the prompt, then the output fed back so far.
            let tokens = seq.prompt.iter().chain(&seq.generated).copied();
            seq.hashes.extend(tokens, seq.table.len, block_size);
            seq.registered = self.kv.register(&seq.table, seq.hashes.as_slice(), seq.registered);
        }
    }

    /// Sample for every sequence that finished its prompt or is decoding,
    /// stream the tokens, and retire the finished.
    fn advance(&mut self, members: &[(usize, usize)], logits: &[f32]) {
        let vocab = self.engine.model().cfg.vocab_size;
        let mut finished = vec![];
        for (row, &(i, n)) in members.iter().enumerate() {
            let seq = &mut self.running[i];
            if seq.prefilled < seq.prompt.len() {
                seq.prefilled += n;
                if seq.prefilled < seq.prompt.len() {
                    continue; // mid-prompt: this row's logits mean nothing yet
                }
                let seconds = seq.started.map_or(0.0, |s| s.elapsed().as_secs_f64());
                let computed = seq.prompt.len() - seq.cached;
                metrics::counter!(names::PREFILL_TOKENS, "worker" => "decode").increment(computed as u64);
                metrics::histogram!(names::PREFILL_TIME, "worker" => "decode").record(seconds);
                if seconds > 0.0 {
                    metrics::histogram!(names::PREFILL_THROUGHPUT, "worker" => "decode").record(computed as f64 / seconds);
                }
            }
            let row = &logits[row * vocab..(row + 1) * vocab];
            let token = match seq.constraint.as_mut() {
                None => seq.sampler.sample(row),
                Some(c) => match c.sample(&mut seq.sampler, row) {
                    Ok(token) => token,
                    Err(e) => {
                        let _ = seq.events.send(SeqEvent::Failed(DecodeError::Internal(format!("structured output: {e}"))));
                        finished.push(i);
                        continue;
                    }
                },
            };
            seq.generated.push(token.id);
            // The last token says why the request ends, so the sequence
            // leaves with it and nothing follows. A constrained output that
            // only a stop token could continue ends here, a step sooner.
            let complete = seq.constraint.as_ref().is_some_and(|c| c.is_complete());
            let finish = seq.finish_reason().or(complete.then_some(FinishReason::Stop)).map(|reason| Finish { reason, queue: seq.queue_time() });
            if let Some(f) = finish {
                tracing::debug!(request_id = %seq.request_id, reason = f.reason.as_str(), tokens = seq.generated.len(), queue_seconds = f.queue.as_secs_f64(), "finished");
            }
            if seq.events.send(SeqEvent::Token { token, finish }).is_err() {
                tracing::debug!(request_id = %seq.request_id, tokens = seq.generated.len(), "the client has gone");
                finished.push(i);
            } else if finish.is_some() {
                finished.push(i);
            }
        }
        // Remove from the back so earlier indices stay valid.
        for i in finished.into_iter().rev() {
            let mut seq = self.running.remove(i);
            release(&mut self.kv, &mut self.engine, &mut seq);
        }
    }

    /// A forward pass failed (it should not: inputs are checked on entry).
    /// End the sequences that were in it with the error; keep serving.
    fn fail_members(&mut self, members: &[(usize, usize)], e: ForwardError) {
        tracing::error!("forward pass failed: {e}");
        for &(i, _) in members.iter().rev() {
            let mut seq = self.running.remove(i);
            reject(&seq.events, DecodeError::Internal(format!("decode step failed: {e}")));
            release(&mut self.kv, &mut self.engine, &mut seq);
        }
    }

    fn export_gauges(&self) {
        let waiting = self.waiting.len() + self.ready.len();
        StatsCell::set(&self.stats.running, self.running.len());
        StatsCell::set(&self.stats.waiting, waiting);
        StatsCell::set(&self.stats.kv_blocks_used, self.kv.used_blocks());
        metrics::gauge!(names::DECODE_RUNNING).set(self.running.len() as f64);
        metrics::gauge!(names::DECODE_WAITING).set(waiting as f64);
        metrics::gauge!(names::KV_BLOCKS_USED).set(self.kv.used_blocks() as f64);
        metrics::gauge!(names::KV_BLOCKS_CAPACITY).set(self.kv.total_blocks() as f64);
        metrics::gauge!(names::PREFIX_CACHE_BLOCKS).set(self.kv.cached_blocks() as f64);
        if let Some((used, _)) = self.engine.device_blocks() {
            metrics::gauge!(names::DEVICE_KV_BLOCKS_USED).set(used as f64);
        }
    }
}

/// Give back a leaving sequence's blocks, host and device.
fn release(kv: &mut KvAllocator, engine: &mut Engine, seq: &mut Sequence) {
    kv.release(&mut seq.table);
    engine.release(seq.device.take());
}

/// A step's timings into the metrics.
fn record_step(t: &StepTimings, elapsed: Duration) {
    let part = |name: &'static str, d: Duration| metrics::histogram!(names::DECODE_STEP_TIME, "part" => name).record(d.as_secs_f64());
    match t {
        StepTimings::Cpu(c) => {
            part("attention", c.attention);
            part("moe", c.ffn);
        }
        StepTimings::Hybrid(h) => {
            part("cpu_moe", h.cpu_moe);
            part("device_wait", h.device_wait);
            if h.graphs_instantiated + h.graphs_updated > 0 {
                part("graph_capture", h.graph_capture);
            }
            if let Some(busy) = h.device_busy {
                part("device", busy);
            }
            for (half, &n) in ["a", "b"].iter().zip(&h.micro_batches) {
                if n > 0 {
                    metrics::histogram!(names::DECODE_MICRO_BATCH_SIZE, "half" => *half).record(n as f64);
                }
            }
            for (exec, n) in [("instantiated", h.graphs_instantiated), ("updated", h.graphs_updated)] {
                if n > 0 {
                    metrics::counter!(names::DECODE_GRAPH_LAUNCHES, "exec" => exec).increment(n);
                }
            }
            let c = &h.cache;
            if c.layers > 0 {
                let layers = c.layers as f64;
                metrics::counter!(names::EXPERT_CACHE_LOOKUPS).increment(c.lookups);
                metrics::counter!(names::EXPERT_CACHE_HITS).increment(c.hits);
                metrics::histogram!(names::EXPERTS_PER_LAYER, "side" => "device").record(c.device_experts as f64 / layers);
                metrics::histogram!(names::EXPERTS_PER_LAYER, "side" => "cpu").record(c.cpu_experts as f64 / layers);
                metrics::counter!(names::EXPERT_PREFETCH_BYTES, "outcome" => "copied").increment(c.prefetched_bytes);
                metrics::counter!(names::EXPERT_PREFETCH_BYTES, "outcome" => "wasted").increment(c.wasted_bytes);
                metrics::histogram!(names::EXPERT_LAYER_TIME, "kind" => "predicted").record(c.predicted.as_secs_f64() / layers);
                metrics::histogram!(names::EXPERT_LAYER_TIME, "kind" => "measured").record(c.measured.as_secs_f64() / layers);
                metrics::histogram!(names::EXPERT_DECISION_TIME).record(c.deciding.as_secs_f64() / layers);
            }
        }
    }
    if let Some(overlap) = t.overlap(elapsed) {
        metrics::histogram!(names::DECODE_OVERLAP).record(overlap);
    }
}

/// Positions a sequence may ever fill: prompt plus output, within the context.
fn reserve_len(seq: &Sequence, context_length: usize) -> usize {
    (seq.prompt.len() + seq.finish.max_tokens).min(context_length)
}

fn reject(events: &EventSender, e: DecodeError) {
    let _ = events.send(SeqEvent::Failed(e));
}
