//! The prefill engine: one thread owns the model and runs prompts one at a
//! time, first come first served, into KV blocks lent by the decode worker.
//! A prompt the router routed to two-device prefill runs on every device
//! ([`crate::dslp`]) where this worker has several and its uncached part
//! (after the lease's cached prefix) can be split over them. Otherwise,
//! prompts whose uncached part is at or above the SLP threshold run on the
//! (first) accelerator with stream-loading prefill ([`crate::slp`]);
//! shorter ones, or all of them when there is no accelerator, on the CPU
//! engine in chunks.
//!
//! Where two-device prefill borrows the decode worker's device
//! (`dslp_borrows_decode_device`), it runs only under the decode worker's
//! device lease: refused or unanswered, the prompt runs on one device; when
//! the lease is revoked mid-run (a decode request arrived), the run stops
//! at its next module, the device is given back at once, and the prompt runs
//! again on one device from its cached prefix.
//!
//! Between chunks (or SLP modules) of a prompt it takes the commands that
//! have arrived (cancellation, new jobs to queue), and it drops a job whose
//! caller has gone. A cancel of the running job is answered only once the
//! engine has stopped writing into the job's blocks, so the caller may then
//! free them.
//!
//! The engine speaks its own types (`Job`, `FirstToken`, `PrefillError`);
//! `server.rs` maps them to the worker protocol.

use duplex_ipc::KvSegment;
use duplex_model::sampling::{SampledToken, Sampler, SamplingParams};
use crate::dslp::{DslpEngine, DslpReport};
use crate::server::{Borrowed, DeviceBorrower, DeviceLoan};
use crate::slp::{SlpEngine, SlpError, SlpReport};
use duplex_model::{BlockTable, KvPool, Logits, Model, Precision};
use duplex_proto::stats::StatsCell;
use duplex_telemetry as names;
use duplex_text::{FinishReason, FinishRule};
use std::collections::{HashSet, VecDeque};
use std::path::PathBuf;
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::oneshot;

/// How often an idle engine checks whether its KV segment was removed.
const KV_WATCH_INTERVAL: Duration = Duration::from_millis(500);

pub struct Job {
    pub request_id: String,
    pub prompt: Vec<u32>,
    pub sampling: SamplingParams,
    pub lease: Lease,
    /// The request's `max_tokens` and stop tokens: this worker samples its
    /// first token, so it says whether that token is the last.
    pub max_tokens: usize,
    pub stop_token_ids: HashSet<u32>,
    /// Structured output, compiled: the first token must keep to it.
    pub constraint: Option<duplex_grammar::Matcher>,
    pub reply: oneshot::Sender<Result<FirstToken, PrefillError>>,
    pub arrived: Instant,
    /// The router routed the prompt to two-device prefill.
    pub dslp_routed: bool,
}

/// The KV blocks the decode worker lent for the prompt, in the pool of
/// `pool_epoch`.
pub struct Lease {
    pub pool_epoch: u64,
    pub blocks: Vec<u32>,
    /// Positions the first blocks already hold: the prompt's cached prefix.
    pub cached_tokens: u32,
}

/// What a prefill gives back: the prompt's KV is in the lease's blocks.
#[derive(Debug)]
pub struct FirstToken {
    pub token: SampledToken,
    /// Set when this token already ends the request.
    pub finish: Option<FinishReason>,
    /// In this worker's queue before compute.
    pub queue: Duration,
    pub prefill: Duration,
}

/// Why a prefill did not give a first token.
#[derive(Debug, thiserror::Error)]
pub enum PrefillError {
    /// The request cannot run as asked (a bad lease, bad sampling settings).
    #[error("{0}")]
    InvalidArgument(String),
    /// The lease is from a pool that no longer exists.
    #[error("{0}")]
    StaleLease(String),
    /// The KV pool cannot be mapped (the decode worker is not there).
    #[error("{0}")]
    PoolUnavailable(String),
    #[error("prefill cancelled")]
    Cancelled,
    #[error("{0}")]
    Internal(String),
}

pub enum Command {
    Prefill(Box<Job>),
    Cancel { request_id: String, reply: oneshot::Sender<bool> },
}

/// The job being run.
struct Current {
    request_id: String,
    cancelled: bool,
    /// Cancels waiting for the job to stop writing.
    waiters: Vec<oneshot::Sender<bool>>,
}

/// Where the shared KV segment is, and the mapping of it in use.
pub struct KvSource {
    pub shm_dir: PathBuf,
    pub name: String,
    attached: Option<Attached>,
}

/// A mapped KV segment: its pool, its epoch, and a watch on its file.
struct Attached {
    pool: KvPool,
    epoch: u64,
    watch: duplex_ipc::LinkWatch,
}

impl KvSource {
    pub fn new(shm_dir: PathBuf, name: String) -> Self {
        KvSource { shm_dir, name, attached: None }
    }

    /// The pool of epoch `epoch`: the decode worker makes a new segment when
    /// it restarts, so map it again when a lease names another epoch.
    fn pool(&mut self, epoch: u64) -> Result<&mut KvPool, PrefillError> {
        self.release_if_unlinked();
        if self.attached.as_ref().is_none_or(|a| a.epoch != epoch) {
            self.attached = None;
            let unavailable = |e: &dyn std::fmt::Display| PrefillError::PoolUnavailable(format!("cannot map the KV pool: {e}"));
            let segment = KvSegment::attach(&self.shm_dir, &self.name).map_err(|e| unavailable(&e))?;
            let found = segment.epoch();
            if found != epoch {
                return Err(PrefillError::StaleLease(format!("KV lease is for pool epoch {epoch}, but the pool is now epoch {found} (the decode worker restarted)")));
            }
            let watch = segment.link_watch().map_err(|e| unavailable(&e))?;
            let pool = segment.into_pool(false).map_err(|e| unavailable(&e))?;
            self.attached = Some(Attached { pool, epoch: found, watch });
        }
        Ok(&mut self.attached.as_mut().expect("attached above").pool)
    }

    /// Unmap a segment whose file is gone: its decode worker died (or
    /// restarted), and while this mapping lives its pages cannot return to
    /// the tmpfs, so a restarted decode worker on a small /dev/shm would find
    /// no room for its new segment.
    pub fn release_if_unlinked(&mut self) {
        if self.attached.as_ref().is_some_and(|a| a.watch.is_unlinked()) {
            tracing::info!("the KV segment of epoch {} was removed; unmapping it", self.attached.as_ref().map_or(0, |a| a.epoch));
            self.attached = None;
        }
    }

}

/// Stream-loading prefill and the prompt length from which it is used.
pub struct Slp {
    pub devices: SlpDevices,
    pub threshold_tokens: usize,
}

/// The accelerators stream-loading prefill runs on.
pub enum SlpDevices {
    One(Box<SlpEngine>),
    /// Two or more: two-device prefill over all of them, and single-device
    /// prefill on the first (no second engine on that device).
    Ranks(DslpEngine),
}

impl Slp {
    /// The engine of single-device stream-loading prefill.
    fn single(&self) -> &SlpEngine {
        match &self.devices {
            SlpDevices::One(engine) => engine,
            SlpDevices::Ranks(dslp) => dslp.single(),
        }
    }

    fn dslp(&self) -> Option<&DslpEngine> {
        match &self.devices {
            SlpDevices::One(_) => None,
            SlpDevices::Ranks(dslp) => Some(dslp),
        }
    }
}

/// Which engine computes a prompt.
#[derive(Clone, Copy)]
enum Compute<'a> {
    Cpu,
    Slp(&'a SlpEngine),
    Dslp(&'a DslpEngine),
}

impl Compute<'_> {
    fn as_str(self) -> &'static str {
        match self {
            Compute::Cpu => "the CPU engine",
            Compute::Slp(_) => "stream-loading prefill",
            Compute::Dslp(_) => "two-device prefill",
        }
    }
}

/// Where a prompt of `new_tokens` uncached tokens runs, and why when a
/// route to two-device prefill cannot be followed.
fn compute_for(slp: Option<&Slp>, dslp_routed: bool, new_tokens: usize) -> (Compute<'_>, Option<String>) {
    let fallback = match slp {
        Some(s) if new_tokens >= s.threshold_tokens => Compute::Slp(s.single()),
        _ => Compute::Cpu,
    };
    if !dslp_routed {
        return (fallback, None);
    }
    let why = match slp.and_then(Slp::dslp) {
        Some(dslp) if dslp.accepts(new_tokens) => return (Compute::Dslp(dslp), None),
        Some(dslp) => format!("its {new_tokens} uncached tokens cannot be split over {} devices", dslp.ranks()),
        None => "this worker has no two-device prefill".to_string(),
    };
    (fallback, Some(why))
}

pub struct Engine {
    model: Model,
    kv: KvSource,
    chunk_tokens: usize,
    precision: Precision,
    slp: Option<Slp>,
    /// Two-device prefill borrows the decode worker's device under a lease
    /// (`dslp_borrows_decode_device`); `None`: its devices are its own.
    borrower: Option<DeviceBorrower>,
    inbox: Inbox,
}

/// The queue of jobs, the running one, and what `Stats` reads of them.
struct Inbox {
    stats: Arc<StatsCell>,
    queue: VecDeque<Job>,
    current: Option<Current>,
}

impl Engine {
    pub fn new(model: Model, kv: KvSource, chunk_tokens: usize, precision: Precision, slp: Option<Slp>, stats: Arc<StatsCell>) -> Self {
        let inbox = Inbox { stats, queue: VecDeque::new(), current: None };
        Engine { model, kv, chunk_tokens: chunk_tokens.max(1), precision, slp, borrower: None, inbox }
    }

    /// Borrow the decode worker's device with `borrower` for each two-device prefill.
    pub fn with_borrower(self, borrower: Option<DeviceBorrower>) -> Self {
        Engine { borrower, ..self }
    }

    /// The logits row's width.
    pub fn vocab_size(&self) -> usize {
        self.model.cfg.vocab_size
    }

    pub fn run(mut self, commands: Receiver<Command>) {
        loop {
            if self.inbox.queue.is_empty() {
                // Idle: wake now and then to let go of a removed KV segment.
                match commands.recv_timeout(KV_WATCH_INTERVAL) {
                    Ok(c) => self.inbox.handle(c),
                    Err(RecvTimeoutError::Timeout) => {
                        self.kv.release_if_unlinked();
                        continue;
                    }
                    Err(RecvTimeoutError::Disconnected) => return,
                }
            }
            self.inbox.drain(&commands);
            if let Some(job) = self.inbox.queue.pop_front() {
                self.run_job(job, &commands);
            }
        }
    }

    fn run_job(&mut self, mut job: Job, commands: &Receiver<Command>) {
        if job.reply.is_closed() {
            return; // the caller gave up while the job queued
        }
        // What the engine logs of this job (stream-loading reports) names it.
        let _job = tracing::info_span!("prefill_job", request_id = %job.request_id, prompt_tokens = job.prompt.len()).entered();
        self.inbox.current = Some(Current { request_id: job.request_id.clone(), cancelled: false, waiters: vec![] });
        let result = self.prefill(&mut job, commands);
        match &result {
            Ok(first) => tracing::debug!(token = first.token.id, finish = first.finish.map(|r| r.as_str()), seconds = first.prefill.as_secs_f64(), "prefilled"),
            Err(e) => tracing::debug!("prefill failed: {e}"),
        }
        for waiter in self.inbox.current.take().map(|c| c.waiters).unwrap_or_default() {
            let _ = waiter.send(true);
        }
        // `Stats` must say idle as soon as the job ends, not at the next command.
        StatsCell::set(&self.inbox.stats.running, 0);
        let _ = job.reply.send(result);
    }

    fn prefill(&mut self, job: &mut Job, commands: &Receiver<Command>) -> Result<FirstToken, PrefillError> {
        let started = Instant::now();
        let mut sampler = Sampler::new(job.sampling.clone(), &job.prompt).map_err(|e| PrefillError::InvalidArgument(e.to_string()))?;
        // The lease's blocks: its first `cached_tokens` positions hold the
        // prompt's cached prefix (blocks shared with other requests, never
        // written again), the rest nothing yet. Prefill starts after them.
        let cached = job.lease.cached_tokens as usize;
        if cached >= job.prompt.len() {
            return Err(PrefillError::InvalidArgument(format!("the KV lease has {cached} cached tokens, but the prompt only {}: its last token must be computed", job.prompt.len())));
        }
        let mut table = BlockTable { blocks: job.lease.blocks.clone(), len: cached };
        let pool = self.kv.pool(job.lease.pool_epoch)?;
        self.inbox.stats.pool_epoch.store(job.lease.pool_epoch, std::sync::atomic::Ordering::Relaxed);
        pool.check_table(&table).map_err(|e| PrefillError::InvalidArgument(e.to_string()))?;
        if pool.capacity(&table) < job.prompt.len() {
            return Err(PrefillError::InvalidArgument(format!("the KV lease holds {} positions, fewer than the prompt's {}", pool.capacity(&table), job.prompt.len())));
        }
        let todo = &job.prompt[cached..];
        let inbox = &mut self.inbox;
        let (mut compute, fallback) = compute_for(self.slp.as_ref(), job.dslp_routed, todo.len());
        match fallback {
            Some(why) => tracing::info!("routed to two-device prefill, but {why}: running {}", compute.as_str()),
            None => tracing::debug!("running {} on {} uncached tokens", compute.as_str(), todo.len()),
        }
        // Where the prompt runs when the decode worker's device cannot be
        // borrowed, or is taken back.
        let single = compute_for(self.slp.as_ref(), false, todo.len()).0;
        let mut loan = None;
        if let (Compute::Dslp(_), Some(borrower)) = (compute, self.borrower.as_ref()) {
            let refusal = match borrower.borrow(&job.request_id) {
                Borrowed::Granted(granted) => {
                    tracing::debug!("the decode worker lent its device");
                    loan = Some((granted, Instant::now()));
                    None
                }
                Borrowed::Refused(why) => Some(("refused", format!("the decode worker refused to lend its device ({why})"))),
                Borrowed::Unreachable(why) => Some(("unreachable", format!("the decode worker at {} did not answer for its device ({why})", borrower.address()))),
            };
            if let Some((reason, why)) = refusal {
                tracing::info!("routed to two-device prefill, but {why}: running {}", single.as_str());
                metrics::counter!(names::PREFILL_DSLP_FALLBACK, "reason" => reason).increment(1);
                compute = single;
            }
        }
        let revoked = |loan: &Option<(DeviceLoan, Instant)>| loan.as_ref().is_some_and(|(l, _)| l.revoked());
        let (model, precision, chunk_tokens) = (&self.model, self.precision, self.chunk_tokens);
        let first = run_compute(compute, model, pool, &mut table, todo, precision, chunk_tokens, &mut || inbox.stop(job, commands) || revoked(&loan));
        let logits = match first {
            // Stopped for the decode worker, not for the client: give the
            // device back now, then run the prompt again on one device.
            Err(PrefillError::Cancelled) if revoked(&loan) && !inbox.cancelled(job) => {
                let held = loan.take().map_or(0.0, |(_, since)| since.elapsed().as_secs_f64());
                metrics::counter!(names::PREFILL_DSLP_FALLBACK, "reason" => "revoked").increment(1);
                tracing::info!("two-device prefill stopped: the decode worker took its device back after {held:.3} s; running {} from the cached {cached} tokens", single.as_str());
                // The stopped run wrote some KV past the cached prefix; the rerun overwrites it.
                table.len = cached;
                run_compute(single, model, pool, &mut table, todo, precision, chunk_tokens, &mut || inbox.stop(job, commands))?
            }
            result => result?,
        };
        drop(loan);
        // One mask for a whole prompt: computed after it, as its
        // milliseconds are nothing beside the prefill. Stop ids are allowed
        // where the grammar may end (an output it lets be empty).
        let token = match job.constraint.as_mut() {
            None => sampler.sample(&logits),
            Some(matcher) => {
                let mut mask = duplex_grammar::TokenMask::default();
                let stop_ids: Vec<u32> = job.stop_token_ids.iter().copied().collect();
                matcher.fill_mask(&stop_ids, &mut mask).map_err(|e| PrefillError::Internal(format!("structured output: {e}")))?;
                sampler.sample_with_mask(&logits, Some(&mask)).map_err(|e| PrefillError::Internal(format!("structured output: {e}")))?
            }
        };
        let rule = FinishRule { stop_token_ids: job.stop_token_ids.clone(), max_tokens: job.max_tokens, context_length: self.model.cfg.max_position_embeddings };
        let finish = rule.check(job.prompt.len(), 1, token.id);
        let elapsed = started.elapsed();
        let seconds = elapsed.as_secs_f64();
        let n = todo.len() as f64;
        metrics::counter!(names::PREFILL_TOKENS, "worker" => "prefill").increment(todo.len() as u64);
        metrics::histogram!(names::PREFILL_TIME, "worker" => "prefill").record(seconds);
        metrics::histogram!(names::PREFILL_THROUGHPUT, "worker" => "prefill").record(n / seconds.max(1e-9));
        Ok(FirstToken { token, finish, queue: started - job.arrived, prefill: elapsed })
    }
}

impl Inbox {
    /// Whether the running job should stop: cancelled, or its caller gone.
    fn stop(&mut self, job: &Job, commands: &Receiver<Command>) -> bool {
        self.drain(commands);
        self.cancelled(job)
    }

    /// Whether the running job was cancelled or its caller has gone (as
    /// last seen: no commands are taken).
    fn cancelled(&self, job: &Job) -> bool {
        job.reply.is_closed() || self.current.as_ref().is_some_and(|c| c.cancelled)
    }

    fn drain(&mut self, commands: &Receiver<Command>) {
        while let Ok(c) = commands.try_recv() {
            self.handle(c);
        }
        metrics::gauge!(names::PREFILL_QUEUE).set(self.queue.len() as f64);
        StatsCell::set(&self.stats.waiting, self.queue.len());
        StatsCell::set(&self.stats.running, self.current.is_some() as usize);
    }

    fn handle(&mut self, command: Command) {
        match command {
            Command::Prefill(job) => self.queue.push_back(*job),
            Command::Cancel { request_id, reply } => {
                if let Some(current) = self.current.as_mut().filter(|c| c.request_id == request_id) {
                    current.cancelled = true;
                    current.waiters.push(reply); // answered when the job stops
                    return;
                }
                let queued = self.queue.len();
                self.queue.retain(|j| j.request_id != request_id);
                let _ = reply.send(queued != self.queue.len());
            }
        }
    }
}

/// Run `todo` on `compute` into `table`'s blocks of `pool` and return the
/// last token's logits; `stop` is asked between modules (between chunks on
/// the CPU engine).
#[allow(clippy::too_many_arguments)]
fn run_compute(compute: Compute, model: &Model, pool: &mut KvPool, table: &mut BlockTable, todo: &[u32], precision: Precision, chunk_tokens: usize, stop: &mut dyn FnMut() -> bool) -> Result<Vec<f32>, PrefillError> {
    let slp_failed = |what: &str, e: SlpError| match e {
        SlpError::Cancelled => PrefillError::Cancelled,
        SlpError::Staged(e) if e.is_bad_input() => PrefillError::InvalidArgument(e.to_string()),
        e => PrefillError::Internal(format!("{what} failed: {e}")),
    };
    Ok(match compute {
        Compute::Dslp(dslp) => {
            let (logits, report) = dslp.run(model, pool, table, todo, precision, Logits::Last, stop).map_err(|e| slp_failed("two-device prefill", e))?;
            record_dslp(&report);
            logits
        }
        Compute::Slp(engine) => {
            let (logits, report) = engine.run(model, pool, table, todo, precision, Logits::Last, stop).map_err(|e| slp_failed("stream-loading prefill", e))?;
            record_slp(&report);
            logits
        }
        Compute::Cpu => {
            let mut logits = vec![];
            for chunk in todo.chunks(chunk_tokens) {
                if stop() {
                    return Err(PrefillError::Cancelled);
                }
                logits = model.forward(pool, table, chunk, precision, Logits::Last).map_err(|e| PrefillError::InvalidArgument(e.to_string()))?;
            }
            logits
        }
    })
}

/// Export what one two-device prefill did: the weights every device
/// streamed, and what the devices exchanged.
fn record_dslp(report: &DslpReport) {
    let streamed: u64 = report.ranks.iter().map(|r| r.bytes_streamed).sum();
    metrics::counter!(names::PREFILL_SLP_STREAMED_BYTES).increment(streamed);
    let (kv, gather, all_to_all, standard_ep) = report.bytes();
    let stalls: Vec<String> = report.ranks.iter().map(|r| format!("{:.3}", r.stall.as_secs_f64())).collect();
    tracing::info!(
        "two-device prefill on {} devices: {streamed} bytes streamed in all, compute stalled {} s, exchanged {kv} bytes of KV and {} bytes for SmallEP (all-gather {gather}, all-to-all {all_to_all}; standard expert parallelism would move {standard_ep})",
        report.ranks.len(),
        stalls.join(" / "),
        gather + all_to_all
    );
}

/// Export what one stream-loading prefill did.
fn record_slp(report: &SlpReport) {
    metrics::gauge!(names::PREFILL_SLP_RING_SLOTS).set(report.ring_slots as f64);
    metrics::counter!(names::PREFILL_SLP_STREAMED_BYTES).increment(report.bytes_streamed);
    metrics::histogram!(names::PREFILL_SLP_STALL).record(report.stall.as_secs_f64());
    metrics::gauge!(names::PREFILL_SLP_OVERLAP).set(report.overlap_efficiency());
    // What a layer costs, beside which a decode request's wait for a lent
    // device (at most about one layer) can be judged.
    let layers: Duration = report.layers.iter().map(|l| l.measured).sum();
    tracing::info!(
        "stream-loading prefill: ring {} slots, {} bytes streamed, compute stalled {:.3} s, overlap efficiency {:.2}, {} layers in {:.3} s",
        report.ring_slots,
        report.bytes_streamed,
        report.stall.as_secs_f64(),
        report.overlap_efficiency(),
        report.layers.len(),
        layers.as_secs_f64()
    );
}
