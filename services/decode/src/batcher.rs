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
//! A sequence reserves the blocks for its prompt plus `max_tokens` when it
//! is admitted, so it can never run out of cache mid-generation (no
//! preemption is needed); a request that would never fit is refused.

use crate::kv_alloc::KvAllocator;
use duplex_model::model::ForwardError;
use duplex_model::sampling::{Sampler, SamplingParams};
use duplex_model::{BlockTable, ForwardTimings, Logits, Model, Precision, SeqInput};
use duplex_proto::stats::StatsCell;
use duplex_proto::worker::{decode_event, DecodeEvent, DecodeFinished, KvLease, SampledToken as WireToken};
use duplex_telemetry as names;
use std::collections::{HashSet, VecDeque};
use std::sync::Arc;
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, oneshot};
use tonic::Status;

pub type EventSender = mpsc::UnboundedSender<Result<DecodeEvent, Status>>;

/// A validated request to decode.
pub struct Admission {
    pub request_id: String,
    pub prompt: Vec<u32>,
    pub sampling: SamplingParams,
    pub max_tokens: usize,
    pub stop_token_ids: HashSet<u32>,
    /// Set when the prefill worker already ran the prompt into a lease.
    pub prefilled: Option<Prefilled>,
    pub events: EventSender,
    pub arrived: Instant,
}

pub struct Prefilled {
    pub lease: KvLease,
    pub first_token: WireToken,
}

pub enum Command {
    Admit(Box<Admission>),
    AllocateKv { request_id: String, tokens: usize, reply: oneshot::Sender<Result<KvLease, Status>> },
    FreeKv { request_id: String, reply: oneshot::Sender<bool> },
    Cancel { request_id: String, reply: oneshot::Sender<bool> },
}

pub struct Limits {
    pub context_length: usize,
    /// A lease not admitted nor freed within this long is freed.
    pub lease_timeout: Duration,
    pub max_batch_size: usize,
    pub prefill_chunk_tokens: usize,
}

struct Sequence {
    request_id: String,
    prompt: Vec<u32>,
    generated: Vec<u32>,
    /// Prompt tokens already in the cache.
    prefilled: usize,
    table: BlockTable,
    sampler: Sampler,
    max_tokens: usize,
    stop_token_ids: HashSet<u32>,
    events: EventSender,
    arrived: Instant,
    /// When it first took part in a step.
    started: Option<Instant>,
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

    fn queue_seconds(&self) -> f64 {
        self.started.map_or(0.0, |s| (s - self.arrived).as_secs_f64())
    }

    /// Why the sequence is done after its latest token, if it is.
    fn finish_reason(&self, context_length: usize) -> Option<&'static str> {
        let last = *self.generated.last()?;
        if self.stop_token_ids.contains(&last) {
            Some("stop")
        } else if self.generated.len() >= self.max_tokens || self.table.len + 1 > context_length {
            Some("length")
        } else {
            None
        }
    }
}

pub struct Batcher {
    model: Model,
    kv: KvAllocator,
    limits: Limits,
    precision: Precision,
    waiting: VecDeque<Sequence>,
    running: Vec<Sequence>,
    stats: Arc<StatsCell>,
}

impl Batcher {
    pub fn new(model: Model, kv: KvAllocator, limits: Limits, precision: Precision, stats: Arc<StatsCell>) -> Self {
        stats.pool_epoch.store(kv.epoch(), std::sync::atomic::Ordering::Relaxed);
        StatsCell::set(&stats.kv_blocks_total, kv.total_blocks());
        StatsCell::set(&stats.kv_block_size, kv.block_size());
        Batcher { model, kv, limits, precision, waiting: VecDeque::new(), running: vec![], stats }
    }

    /// Run until every sender of `commands` is gone.
    pub fn run(mut self, commands: Receiver<Command>) {
        loop {
            // Nothing running: block for work (briefly, when sequences wait
            // for blocks a lease holds). Busy: take what has arrived and step.
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
            if let Some(c) = first {
                self.handle(c);
                while let Ok(c) = commands.try_recv() {
                    self.handle(c);
                }
            }
            for id in self.kv.expire_leases(self.limits.lease_timeout) {
                tracing::warn!("freed the KV lease of request {id}: not admitted within {:?}", self.limits.lease_timeout);
            }
            self.step();
            self.export_gauges();
        }
    }

    fn handle(&mut self, command: Command) {
        match command {
            Command::Admit(a) => self.admit(*a),
            Command::AllocateKv { request_id, tokens, reply } => {
                let _ = reply.send(self.kv.lease(&request_id, tokens));
            }
            Command::FreeKv { request_id, reply } => {
                let _ = reply.send(self.kv.free_lease(&request_id));
            }
            Command::Cancel { request_id, reply } => {
                let found = self.kv.free_lease(&request_id) | self.cancel(&request_id);
                let _ = reply.send(found);
            }
        }
    }

    fn admit(&mut self, a: Admission) {
        let sampler = match &a.prefilled {
            Some(p) => Sampler::resume(a.sampling, &a.prompt, &[p.first_token.id]),
            None => Sampler::new(a.sampling, &a.prompt),
        };
        let sampler = match sampler {
            Ok(s) => s,
            Err(e) => return reject(&a.events, Status::invalid_argument(e.to_string())),
        };
        let mut seq = Sequence {
            request_id: a.request_id,
            prompt: a.prompt,
            generated: vec![],
            prefilled: 0,
            table: BlockTable::default(),
            sampler,
            max_tokens: a.max_tokens,
            stop_token_ids: a.stop_token_ids,
            events: a.events,
            arrived: a.arrived,
            started: None,
        };
        if let Some(p) = a.prefilled {
            match self.kv.take_lease(&seq.request_id, &p.lease, seq.prompt.len()) {
                Ok(table) => seq.table = table,
                Err(status) => return reject(&seq.events, status),
            }
            seq.prefilled = seq.prompt.len();
            seq.generated.push(p.first_token.id);
            if let Some(reason) = seq.finish_reason(self.limits.context_length) {
                return self.finish(seq, reason);
            }
        }
        let need = self.kv.blocks_for(reserve_len(&seq, self.limits.context_length));
        if need > self.kv.total_blocks() {
            let status = Status::resource_exhausted(format!(
                "the request needs {need} KV blocks (prompt plus max_tokens) but the pool has only {}",
                self.kv.total_blocks()
            ));
            self.kv.release(&mut seq.table);
            return reject(&seq.events, status);
        }
        self.waiting.push_back(seq);
    }

    fn cancel(&mut self, request_id: &str) -> bool {
        let before = self.running.len() + self.waiting.len();
        let (kv, running, waiting) = (&mut self.kv, &mut self.running, &mut self.waiting);
        let mut drop_seq = |s: &mut Sequence| {
            if s.request_id == request_id {
                let _ = s.events.send(Err(Status::cancelled("cancelled")));
                kv.release(&mut s.table);
                false
            } else {
                true
            }
        };
        running.retain_mut(&mut drop_seq);
        waiting.retain_mut(&mut drop_seq);
        before != self.running.len() + self.waiting.len()
    }

    /// Drop sequences whose client has gone, then fill the batch from the
    /// queue in arrival order while blocks last.
    fn schedule(&mut self) {
        let kv = &mut self.kv;
        let gone = |s: &mut Sequence| {
            if s.events.is_closed() {
                kv.release(&mut s.table);
                false
            } else {
                true
            }
        };
        let mut gone = gone;
        self.running.retain_mut(&mut gone);
        self.waiting.retain_mut(&mut gone);
        while self.running.len() < self.limits.max_batch_size {
            let Some(seq) = self.waiting.front_mut() else { break };
            let len = reserve_len(seq, self.limits.context_length);
            if self.kv.reserve(&mut seq.table, len).is_err() {
                break; // first come, first served: wait for blocks to free up
            }
            let seq = self.waiting.pop_front().expect("front exists");
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
        for (i, seq) in self.running.iter_mut().enumerate() {
            let Some(range) = seq.next_tokens(&mut budget) else { continue };
            seq.started.get_or_insert(started);
            let tokens = if seq.prefilled < seq.prompt.len() { &seq.prompt[range.clone()] } else { &seq.generated[seq.generated.len() - 1..] };
            members.push((i, range.len()));
            inputs.push(SeqInput { table: &mut seq.table, tokens });
        }
        let mut timings = ForwardTimings::default();
        let result = self.model.forward_batch(self.kv.pool_mut(), &mut inputs, self.precision, Logits::Last, &mut timings);
        drop(inputs);
        metrics::histogram!(names::DECODE_BATCH_SIZE).record(members.len() as f64);
        metrics::histogram!(names::DECODE_STEP_TIME, "part" => "total").record(started.elapsed().as_secs_f64());
        metrics::histogram!(names::DECODE_STEP_TIME, "part" => "attention").record(timings.attention.as_secs_f64());
        metrics::histogram!(names::DECODE_STEP_TIME, "part" => "moe").record(timings.ffn.as_secs_f64());
        match result {
            Ok(logits) => self.advance(&members, &logits),
            Err(e) => self.fail_members(&members, e),
        }
    }

    /// Sample for every sequence that finished its prompt or is decoding,
    /// stream the tokens, and retire the finished.
    fn advance(&mut self, members: &[(usize, usize)], logits: &[f32]) {
        let vocab = self.model.cfg.vocab_size;
        let mut finished = vec![];
        for (row, &(i, n)) in members.iter().enumerate() {
            let seq = &mut self.running[i];
            if seq.prefilled < seq.prompt.len() {
                seq.prefilled += n;
                if seq.prefilled < seq.prompt.len() {
                    continue; // mid-prompt: this row's logits mean nothing yet
                }
                let seconds = seq.started.map_or(0.0, |s| s.elapsed().as_secs_f64());
                metrics::counter!(names::PREFILL_TOKENS, "worker" => "decode").increment(seq.prompt.len() as u64);
                metrics::histogram!(names::PREFILL_TIME, "worker" => "decode").record(seconds);
                if seconds > 0.0 {
                    metrics::histogram!(names::PREFILL_THROUGHPUT, "worker" => "decode").record(seq.prompt.len() as f64 / seconds);
                }
            }
            let token = seq.sampler.sample(&logits[row * vocab..(row + 1) * vocab]);
            seq.generated.push(token.id);
            let event = DecodeEvent { event: Some(decode_event::Event::Token(WireToken::from(&token))) };
            if seq.events.send(Ok(event)).is_err() {
                finished.push((i, None)); // the client has gone
            } else if let Some(reason) = seq.finish_reason(self.limits.context_length) {
                finished.push((i, Some(reason)));
            }
        }
        // Remove from the back so earlier indices stay valid.
        for (i, reason) in finished.into_iter().rev() {
            let mut seq = self.running.remove(i);
            match reason {
                Some(reason) => self.finish(seq, reason),
                None => self.kv.release(&mut seq.table),
            }
        }
    }

    fn finish(&mut self, mut seq: Sequence, reason: &str) {
        let event = DecodeFinished { finish_reason: reason.to_string(), queue_seconds: seq.queue_seconds() };
        let _ = seq.events.send(Ok(DecodeEvent { event: Some(decode_event::Event::Finished(event)) }));
        self.kv.release(&mut seq.table);
    }

    /// A forward pass failed (it should not: inputs are checked on entry).
    /// End the sequences that were in it with the error; keep serving.
    fn fail_members(&mut self, members: &[(usize, usize)], e: ForwardError) {
        tracing::error!("forward pass failed: {e}");
        for &(i, _) in members.iter().rev() {
            let mut seq = self.running.remove(i);
            let _ = seq.events.send(Err(Status::internal(format!("decode step failed: {e}"))));
            self.kv.release(&mut seq.table);
        }
    }

    fn export_gauges(&self) {
        StatsCell::set(&self.stats.running, self.running.len());
        StatsCell::set(&self.stats.waiting, self.waiting.len());
        StatsCell::set(&self.stats.kv_blocks_used, self.kv.used_blocks());
        metrics::gauge!(names::DECODE_RUNNING).set(self.running.len() as f64);
        metrics::gauge!(names::DECODE_WAITING).set(self.waiting.len() as f64);
        metrics::gauge!(names::KV_BLOCKS_USED).set(self.kv.used_blocks() as f64);
        metrics::gauge!(names::KV_BLOCKS_CAPACITY).set(self.kv.total_blocks() as f64);
    }
}

/// Positions a sequence may ever fill: prompt plus output, within the context.
fn reserve_len(seq: &Sequence, context_length: usize) -> usize {
    (seq.prompt.len() + seq.max_tokens).min(context_length)
}

fn reject(events: &EventSender, status: Status) {
    let _ = events.send(Err(status));
}
