//! `duplex simulate --workload scenarios|open`: the serving system on a
//! virtual clock.
//!
//! What runs is the production scheduling, turned by simulated time: the
//! router's prefill policy routes each prompt as it arrives; the decode
//! worker's batcher (KV admission, continuous batching, chunked prefill,
//! the hybrid placement's two micro-batches) turns on the simulated decode
//! device and CPU; long prompts take KV leases from it and run, first come
//! first served, through SLP on the prefill device or DSLP on both. A DSLP
//! run is stopped, as the device lease is revoked, when a request reaches
//! the decode worker meanwhile, and the prompt runs again on one device.
//!
//! The driver is one thread whose virtual clock is the decode worker's. It
//! hands each request to the router at its arrival time, turns the batcher,
//! stamps every token with the time the step that sampled it ended, and
//! jumps the clock to the next arrival when nothing runs. A prefill runs
//! when its lease is granted, from when the prefill device is free; its
//! first token is the request's first, and the decode admission follows at
//! its end. The report is `duplex bench`'s.
//!
//! Not modelled: the gRPC hops, tokenization, a decode request's wait for
//! a revoked device lease (at most one module of the stopped DSLP run), and
//! the DRAM bandwidth that SLP's weight streaming and the CPU's experts
//! share (each side gets the description's full bandwidth).

use crate::loadgen::chat::{Chat, ChatTurn};
use crate::loadgen::report::{self, ClosedLoop, OpenLoop, Outcome, Report, RunReport, Sample, Workload};
use crate::loadgen::scenarios::{Kind, Scenarios};
use crate::loadgen::workload::{self, Dist};
use anyhow::{bail, Context, Result};
use duplex_decode::batcher::{Admission, Batcher, Command, Limits, Prefilled, SeqEvent};
use duplex_decode::engine::Engine;
use duplex_decode::kv_alloc::{BlockLease, KvAllocator};
use duplex_decode::DecodeConfig;
use duplex_kernels::clock;
use duplex_model::hybrid::HybridEngine;
use duplex_model::sampling::{SampledToken, SamplingParams};
use duplex_model::{BlockTable, Logits, Model, Precision};
use duplex_prefill::dslp::DslpEngine;
use duplex_prefill::slp::{SlpConfig, SlpEngine, SlpError};
use duplex_proto::stats::StatsCell;
use duplex_router::policy::{DecodeActivity, DecodeTracker, Decoding, PrefillPolicy, Route};
use duplex_router::RouterConfig;
use duplex_sim::cpu::SimCpu;
use duplex_sim::device::SimDevice;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, oneshot};

/// The serving workloads' settings (`duplex simulate` flags).
pub struct ServeSettings {
    pub mode: Mode,
    pub scenarios: Scenarios,
    /// P: a long prompt and a few output tokens; D: a short prompt, many.
    pub long_prompt_tokens: u32,
    pub long_output_tokens: u32,
    pub short_prompt_tokens: u32,
    pub decode_tokens: u32,
    /// Open loop: Poisson arrivals at `rate` per second, `requests` of them.
    pub rate: f64,
    pub requests: usize,
    pub prompt_tokens: Dist,
    pub output_tokens: Dist,
    pub seed: u64,
    /// Whether long prompts may take two-device prefill.
    pub dslp: bool,
    pub router: RouterConfig,
    pub decode: DecodeConfig,
}

/// Which serving workload.
pub enum Mode {
    /// The paper's §4.5 mixes (`scenarios`).
    Scenarios,
    /// Poisson arrivals (`open`).
    Open,
    /// One conversation, turn by turn (`chat`).
    Chat(Chat),
}

/// One request's life on the virtual clock.
struct Request {
    kind: &'static str,
    prompt: Vec<u32>,
    max_tokens: usize,
    arrives: Duration,
    route: Option<Route>,
    events: Option<mpsc::UnboundedReceiver<SeqEvent>>,
    lease: Option<oneshot::Receiver<Result<BlockLease, duplex_decode::error::DecodeError>>>,
    /// When each token reached the client, and which it was.
    tokens: Vec<Duration>,
    ids: Vec<u32>,
    done: Option<Duration>,
    error: Option<String>,
}

impl Request {
    fn new(kind: &'static str, prompt: Vec<u32>, max_tokens: usize, arrives: Duration) -> Request {
        Request { kind, prompt, max_tokens, arrives, route: None, events: None, lease: None, tokens: vec![], ids: vec![], done: None, error: None }
    }

    fn fail(&mut self, at: Duration, why: String) {
        self.error.get_or_insert(why);
        self.done.get_or_insert(at);
        self.events = None;
        self.lease = None;
    }

    /// As `duplex bench` reports a request; times from `origin`.
    fn outcome(&self, origin: Duration) -> Outcome {
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        let gaps_ms: Vec<f64> = self.tokens.windows(2).map(|w| ms(w[1] - w[0])).collect();
        let tpot_ms = (!gaps_ms.is_empty()).then(|| gaps_ms.iter().sum::<f64>() / gaps_ms.len() as f64);
        let end = self.done.unwrap_or(self.arrives);
        Outcome {
            sample: Sample {
                kind: self.kind.to_string(),
                start_s: (self.arrives - origin).as_secs_f64(),
                prompt_tokens: self.prompt.len() as u32,
                output_tokens: self.tokens.len() as u32,
                ttft_ms: self.tokens.first().map(|&t| ms(t - self.arrives)),
                tpot_ms,
                e2e_ms: ms(end - self.arrives),
                prefill_path: self.route.map(|r| r.as_str().to_string()),
                error: self.error.as_ref().map(|_| "SIMULATION".to_string()),
            },
            gaps_ms,
            message: self.error.clone(),
            token_ids: self.ids.clone(),
        }
    }
}

/// What is due at a virtual time.
enum Due {
    /// The request reaches the router.
    Arrive,
    /// Its prefill ended: the decode worker admits it with its lease.
    Admit(Box<Prefilled>),
    /// Its lease showed it mostly cached: the decode worker prefills the rest.
    Chunked,
}

/// The simulated deployment: a prefill worker with one device (and the
/// decode worker's for DSLP), a decode worker with the other and the CPU.
pub struct Deployment {
    batcher: Batcher,
    slp: Option<SlpEngine>,
    dslp: Option<DslpEngine>,
    policy: PrefillPolicy,
    precision: Precision,
    tracker: DecodeTracker,
    /// The virtual time the prefill device is free from.
    prefill_free: Duration,
    /// Devices and CPU, for where the time went.
    pub prefill_device: Arc<SimDevice>,
    pub decode_device: Arc<SimDevice>,
    pub cpu: Arc<SimCpu>,
    /// DSLP runs that a decode request stopped (or that the decode worker's
    /// device could not be lent for), run on one device instead.
    pub revoked: usize,
}

/// Virtual time `t` as an `Instant`, for the router's decode tracker.
fn instant(base: Instant, t: Duration) -> Instant {
    base + t
}

impl Deployment {
    /// `devices`: the prefill device, the decode device, and a second
    /// instance of the decode device's description that DSLP's second rank
    /// runs on while it holds the lease (decode is idle then).
    pub fn new(model: Model, devices: [Arc<SimDevice>; 3], cpu: Arc<SimCpu>, slp: SlpConfig, settings: &ServeSettings, precision: Precision) -> Result<Deployment> {
        let [prefill_device, decode_device, lent] = devices;
        let (slp_engine, dslp) = if settings.dslp {
            let ranks: Vec<Arc<dyn duplex_kernels::device::Device>> = vec![prefill_device.clone(), lent];
            (None, Some(DslpEngine::new(&model, ranks, slp).context("two-device prefill does not fit the devices")?))
        } else {
            (Some(SlpEngine::new(&model, prefill_device.clone(), slp).context("SLP does not fit the prefill device")?), None)
        };
        let cfg = &settings.decode;
        let context_length = model.cfg.max_position_embeddings;
        // Host KV for as many of the longest requests as can be in flight
        // (a full batch and two leases behind it, at most): the bytes are
        // never touched, but the address space must be granted.
        let longest = workload_positions(settings).min(context_length);
        let in_flight = match settings.mode {
            Mode::Scenarios => settings.scenarios.0.iter().map(|s| s.slots.len()).max().unwrap_or(1),
            Mode::Open => settings.requests.min(cfg.max_batch_size + 2),
            // The conversation, cached, and the fresh prompt beside it.
            Mode::Chat(_) => 2,
        };
        let blocks = longest.div_ceil(16) * in_flight;
        let kv = KvAllocator::new(model.new_kv_pool(blocks, 16), 1).with_prefix_caching(cfg.prefix_caching);
        let placement = cfg.hybrid(&model)?;
        let mut hybrid = HybridEngine::new(model, decode_device.clone(), placement, 16).context("the hybrid placement does not fit the decode device")?;
        hybrid.set_expert_pool(cpu.clone());
        // A simulated run may take far longer in wall time than the leases'
        // timeout, which is about wall time.
        let limits = Limits { lease_timeout: Duration::from_secs(u32::MAX as u64), ..Limits::of(cfg, context_length) };
        let batcher = Batcher::new(Engine::Hybrid(hybrid), kv, limits, precision, Arc::new(StatsCell::default()));
        let policy = PrefillPolicy { chunked_prefill_max_tokens: settings.router.prefill_threshold_tokens, dslp_idle_window: settings.router.dslp_idle_window() };
        Ok(Deployment { batcher, slp: slp_engine, dslp, policy, precision, tracker: DecodeTracker::default(), prefill_free: Duration::ZERO, prefill_device, decode_device, cpu, revoked: 0 })
    }

    /// Run `requests` (arrival times from now) to their ends on this
    /// thread's virtual clock, which must be set; returns when they began
    /// and when the last ended.
    fn run(&mut self, requests: &mut [Request]) -> Result<(Duration, Duration)> {
        let start = clock::now().context("the serving simulation runs on a virtual clock")?;
        let base = Instant::now();
        let mut due: Vec<(Duration, usize, Due)> = requests.iter().enumerate().map(|(i, r)| (start + r.arrives, i, Due::Arrive)).collect();
        for r in requests.iter_mut() {
            r.arrives += start;
        }
        let mut decoding: Vec<Option<Decoding<'_>>> = (0..requests.len()).map(|_| None).collect();
        // Commands for the next turn (freeing leases).
        let mut later = vec![];
        // Whether a turn has run since anything changed.
        let mut settled = false;
        // Borrowed apart from `self` so that guards may live across turns.
        let (batcher, tracker) = (&mut self.batcher, &self.tracker);
        let (slp, dslp, policy, precision, prefill_free, revoked) = (&self.slp, &self.dslp, self.policy, self.precision, &mut self.prefill_free, &mut self.revoked);
        loop {
            let now = clock::now().context("the serving simulation runs on a virtual clock")?;
            due.sort_by_key(|d| (d.0, d.1));
            let mut commands = std::mem::take(&mut later);
            while due.first().is_some_and(|d| d.0 <= now) {
                let (_, i, what) = due.remove(0);
                let r = &mut requests[i];
                // Whether it reaches the decode worker now, and with what
                // prefill's lease (none: the decode worker prefills it).
                let admit = match what {
                    Due::Arrive => {
                        let (route, _) = policy.route(r.prompt.len(), dslp.is_some(), tracker.activity(instant(base, now)));
                        r.route = Some(route);
                        if route == Route::DecodeChunked {
                            Some(None)
                        } else {
                            let (reply, lease) = oneshot::channel();
                            r.lease = Some(lease);
                            commands.push(Command::AllocateKv { request_id: i.to_string(), tokens: r.prompt.len(), prompt: r.prompt.clone(), max_tokens: r.max_tokens, reply });
                            None
                        }
                    }
                    Due::Chunked => Some(None),
                    Due::Admit(prefilled) => Some(Some(*prefilled)),
                };
                if let Some(prefilled) = admit {
                    let (tx, rx) = mpsc::unbounded_channel();
                    decoding[i] = Some(tracker.begin());
                    r.events = Some(rx);
                    commands.push(Command::Admit(Box::new(admission(i, r, tx, prefilled))));
                }
            }
            batcher.turn(commands);
            let t = clock::now().unwrap_or(now);
            // Tokens sampled by the step reach their clients as it ends.
            for (i, r) in requests.iter_mut().enumerate() {
                let Some(events) = r.events.as_mut() else { continue };
                while let Ok(event) = events.try_recv() {
                    match event {
                        SeqEvent::Token { token, finish } => {
                            r.tokens.push(t);
                            r.ids.push(token.id);
                            if finish.is_some() {
                                r.done = Some(t);
                            }
                        }
                        SeqEvent::Failed(e) => r.error = Some(e.to_string()),
                    }
                }
                if r.done.is_some() || r.error.is_some() {
                    r.events = None;
                    r.done.get_or_insert(t);
                    if let Some(d) = decoding[i].take() {
                        d.end_at(instant(base, t));
                    }
                }
            }
            // Leases granted in this turn: their prefills queue for the device.
            for i in 0..requests.len() {
                let lease = match requests[i].lease.as_mut().map(|l| l.try_recv()) {
                    None | Some(Err(oneshot::error::TryRecvError::Empty)) => continue,
                    Some(Ok(Ok(lease))) => lease,
                    Some(Ok(Err(e))) => {
                        requests[i].fail(t, format!("KV lease: {e}"));
                        continue;
                    }
                    Some(Err(oneshot::error::TryRecvError::Closed)) => {
                        requests[i].fail(t, "the decode worker dropped the KV lease request".into());
                        continue;
                    }
                };
                requests[i].lease = None;
                // The router's second look, now that the lease says how much
                // of the prompt the prefix cache holds: the lease goes back
                // (before the admission, which finds the same cached blocks).
                if let Some((route, _)) = policy.reroute(requests[i].prompt.len(), lease.cached_tokens as usize) {
                    requests[i].route = Some(route);
                    later.push(free_lease(i));
                    due.push((t, i, Due::Chunked));
                    continue;
                }
                // The decode worker lends its device only while nothing
                // decodes there; a request reaching it during the run (a
                // short prompt arriving, a prefilled one admitted) takes it back.
                let lendable = !batcher.has_work() && !matches!(tracker.activity(instant(base, now)), DecodeActivity::Busy(_));
                let revoke_at = due
                    .iter()
                    .filter(|(_, j, what)| matches!(what, Due::Admit(_) | Due::Chunked) || requests[*j].prompt.len() < policy.chunked_prefill_max_tokens as usize)
                    .map(|d| d.0)
                    .min();
                let r = &mut requests[i];
                let two_devices = r.route == Some(Route::Dslp) && lendable;
                let begin = now.max(*prefill_free);
                clock::set(Some(begin));
                let ran = prefill(batcher.model(), slp, dslp, &r.prompt, lease.cached_tokens as usize, precision, two_devices, revoke_at);
                let end = clock::now().unwrap_or(begin);
                clock::set(Some(t));
                *prefill_free = end;
                match ran {
                    Ok((first, ran_on_two)) => {
                        *revoked += usize::from(two_devices && !ran_on_two);
                        if !ran_on_two && r.route == Some(Route::Dslp) {
                            r.route = Some(Route::Slp);
                        }
                        // The first token streams to the client as the prefill ends.
                        r.tokens.push(end);
                        r.ids.push(first.id);
                        if r.max_tokens == 1 {
                            r.done = Some(end);
                            later.push(free_lease(i));
                        } else {
                            due.push((end, i, Due::Admit(Box::new(Prefilled { lease, first_token: first }))));
                        }
                    }
                    Err(e) => {
                        r.fail(end, format!("prefill: {e:#}"));
                        later.push(free_lease(i));
                    }
                }
            }
            if batcher.has_work() || !later.is_empty() {
                settled = false;
                continue;
            }
            // Blocks a finished sequence gave back go to those waiting at the
            // next turn: take it before moving the clock.
            if !settled {
                settled = true;
                continue;
            }
            match due.iter().map(|d| d.0).min() {
                Some(next) => {
                    settled = false;
                    clock::set(Some(next.max(t)))
                }
                None if requests.iter().all(|r| r.done.is_some()) => {
                    // The run has reached its last request's end (a prefill's
                    // may lie past the decode worker's clock).
                    let end = requests.iter().filter_map(|r| r.done).max().unwrap_or(t).max(t);
                    clock::set(Some(end));
                    return Ok((start, end));
                }
                None => {
                    let stuck = requests.iter().filter(|r| r.done.is_none()).count();
                    bail!("{stuck} requests wait for KV blocks that nothing running will free (the simulated host KV pool is too small for this workload)")
                }
            }
        }
    }
}

/// The router's FreeKv for request `i` (its prefill failed, or its one token came from it).
fn free_lease(i: usize) -> Command {
    let (reply, _) = oneshot::channel();
    Command::FreeKv { request_id: i.to_string(), reply }
}

/// The decode worker's admission of request `i`: greedy, no stop tokens, so
/// that it runs to its `max_tokens` as `duplex bench`'s requests do.
fn admission(i: usize, r: &Request, events: mpsc::UnboundedSender<SeqEvent>, prefilled: Option<Prefilled>) -> Admission {
    Admission {
        request_id: i.to_string(),
        prompt: r.prompt.clone(),
        sampling: SamplingParams::greedy(),
        max_tokens: r.max_tokens,
        stop_token_ids: HashSet::new(),
        prefilled,
        constraint: None,
        events,
        arrived: Instant::now(),
    }
}

/// One prefill on the prefill worker, from this thread's clock, of the
/// prompt past its `cached` tokens (the lease's prefix-cache hit): DSLP on
/// both devices when `two_devices` (stopped, as its lease is revoked, at
/// `revoke_at`), else or then SLP on the prefill device. Returns the first
/// token and whether DSLP ran it to the end.
#[allow(clippy::too_many_arguments)]
fn prefill(model: &Model, slp: &Option<SlpEngine>, dslp: &Option<DslpEngine>, prompt: &[u32], cached: usize, p: Precision, two_devices: bool, revoke_at: Option<Duration>) -> Result<(SampledToken, bool)> {
    // The KV's bytes are not simulated: a scratch pool stands for the
    // lease's blocks, the cached prefix in its first.
    let scratch = || -> Result<(duplex_model::KvPool, BlockTable)> {
        let mut kv = model.new_kv_pool(prompt.len().div_ceil(16), 16);
        let mut table = BlockTable::default();
        kv.reserve(&mut table, cached)?;
        table.len = cached;
        Ok((kv, table))
    };
    let rest = &prompt[cached..];
    if let Some(d) = dslp.as_ref().filter(|d| two_devices && d.accepts(rest.len())) {
        let mut revoked = || revoke_at.is_some_and(|at| clock::now().is_some_and(|now| now >= at));
        let (mut kv, mut table) = scratch()?;
        match d.run(model, &mut kv, &mut table, rest, p, Logits::Last, &mut revoked) {
            Ok((logits, _)) => return Ok((first_token(&logits), true)),
            Err(SlpError::Cancelled) => {}
            Err(e) => return Err(e.into()),
        }
    }
    let one = match (slp, dslp) {
        (Some(s), _) => s,
        (None, Some(d)) => d.single(),
        (None, None) => bail!("the prefill worker has no engine"),
    };
    let (mut kv, mut table) = scratch()?;
    let (logits, _) = one.run(model, &mut kv, &mut table, rest, p, Logits::Last, &mut || false)?;
    Ok((first_token(&logits), false))
}

/// The prefill worker's greedy first token.
fn first_token(logits: &[f32]) -> SampledToken {
    let id = logits.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1)).map_or(0, |(i, _)| i as u32);
    SampledToken { id, logprob: 0.0, top_logprobs: vec![] }
}

/// Positions the longest request of the workload needs.
fn workload_positions(s: &ServeSettings) -> usize {
    match &s.mode {
        Mode::Scenarios => (s.long_prompt_tokens + s.long_output_tokens).max(s.short_prompt_tokens + s.decode_tokens) as usize,
        Mode::Open => dist_max(&s.prompt_tokens) + dist_max(&s.output_tokens),
        Mode::Chat(chat) => chat.positions() as usize,
    }
}

fn dist_max(d: &Dist) -> usize {
    match *d {
        Dist::Fixed(n) => n as usize,
        Dist::Uniform(_, hi) => hi as usize,
        Dist::Normal { mean, sd } => (mean + 4.0 * sd).ceil() as usize,
    }
}

/// Busy time of the devices and the CPU, to say where a run's time went.
#[derive(Clone, Copy, Default)]
struct Busy {
    prefill_compute: Duration,
    prefill_links: Duration,
    decode_compute: Duration,
    decode_links: Duration,
    cpu: Duration,
}

impl Busy {
    fn of(d: &Deployment) -> Busy {
        let (p, q) = (d.prefill_device.stats(), d.decode_device.stats());
        Busy {
            prefill_compute: p.compute_busy,
            prefill_links: p.h2d_busy + p.d2h_busy + p.inline_copies_busy,
            decode_compute: q.compute_busy,
            decode_links: q.h2d_busy + q.d2h_busy + q.inline_copies_busy,
            cpu: d.cpu.busy(),
        }
    }

    /// This run's shares of `span`, as a table row's cells.
    fn row_since(&self, before: &Busy, span: Duration) -> String {
        let pct = |a: Duration, b: Duration| format!("{:.0}%", 100.0 * (a - b).as_secs_f64() / span.as_secs_f64().max(1e-12));
        [
            pct(self.prefill_compute, before.prefill_compute),
            pct(self.prefill_links, before.prefill_links),
            pct(self.decode_compute, before.decode_compute),
            pct(self.decode_links, before.decode_links),
            pct(self.cpu, before.cpu),
        ]
        .join(" | ")
    }
}

/// Random prompt tokens (their values matter only to the prefix cache).
fn random_prompt(rng: &mut ChaCha8Rng, len: usize, vocab: usize) -> Vec<u32> {
    (0..len).map(|_| rng.gen_range(0..vocab as u32)).collect()
}

/// Runs requests on the deployment one batch at a time, keeping the table
/// of where each batch's time went.
struct Player<'a> {
    dep: &'a mut Deployment,
    time_went: String,
}

impl Player<'_> {
    /// Run `requests` from the time the run has reached; their outcomes,
    /// and the virtual time from their start to the last one's end.
    fn play(&mut self, name: &str, mut requests: Vec<Request>) -> Result<(Vec<Outcome>, Duration)> {
        let (before, revoked, wall) = (Busy::of(self.dep), self.dep.revoked, Instant::now());
        let (span, _) = crate::simulate::on_clock(|| self.dep.run(&mut requests));
        let (start, end) = span?;
        let span = end - start;
        let mut routes: Vec<String> = vec![];
        for route in [Route::DecodeChunked, Route::Slp, Route::Dslp] {
            let n = requests.iter().filter(|r| r.route == Some(route)).count();
            if n > 0 {
                routes.push(format!("{n} {}", route.as_str()));
            }
        }
        if self.dep.revoked > revoked {
            routes.push(format!("{} DSLP stopped by a decode request", self.dep.revoked - revoked));
        }
        self.time_went += &format!("| {name} | {:.2} | {} | {} |\n", span.as_secs_f64(), Busy::of(self.dep).row_since(&before, span), routes.join(", "));
        eprintln!("{name}: {} requests, {:.2} virtual s, simulated in {:.1} s", requests.len(), span.as_secs_f64(), wall.elapsed().as_secs_f64());
        Ok((requests.iter().map(|r| r.outcome(start)).collect(), span))
    }
}

/// Run the workload; print `duplex bench`'s tables and where the time went.
pub fn run(dep: &mut Deployment, settings: &ServeSettings, model_name: &str, hardware: &str) -> Result<Report> {
    let model = dep.batcher.model();
    let (vocab, context) = (model.cfg.vocab_size, model.cfg.max_position_embeddings);
    let mut rng = ChaCha8Rng::seed_from_u64(settings.seed);
    let mut player = Player {
        dep,
        time_went: String::from("| run | virtual s | prefill device compute | prefill device links | decode device compute | decode device links | CPU | routes |\n| --- | --- | --- | --- | --- | --- | --- | --- |\n"),
    };
    let mut runs = vec![];
    let workload = match &settings.mode {
        Mode::Scenarios => {
            let (p, d) = (settings.long_prompt_tokens as usize, settings.short_prompt_tokens as usize);
            let (p_out, d_out) = (settings.long_output_tokens as usize, settings.decode_tokens as usize);
            if p + p_out > context || d + d_out > context {
                bail!("P ({p} + {p_out} tokens) or D ({d} + {d_out} tokens) exceeds the model's context of {context}");
            }
            for scenario in &settings.scenarios.0 {
                // Every slot's request arrives at once, as in the paper's §4.5.
                let requests = scenario
                    .slots
                    .iter()
                    .map(|kind| match kind {
                        Kind::P => Request::new(kind.name(), random_prompt(&mut rng, p, vocab), p_out, Duration::ZERO),
                        Kind::D => Request::new(kind.name(), random_prompt(&mut rng, d, vocab), d_out, Duration::ZERO),
                    })
                    .collect();
                let (outcomes, span) = player.play(scenario.name, requests)?;
                runs.push(RunReport::new(scenario.name, &outcomes, span.as_secs_f64()));
            }
            report::add_slowdowns(&mut runs);
            Workload::Closed(ClosedLoop {
                long_prompt_tokens: settings.long_prompt_tokens,
                long_output_tokens: settings.long_output_tokens,
                short_prompt_tokens: settings.short_prompt_tokens,
                decode_tokens: settings.decode_tokens,
                scenario_seconds: 0.0,
                calibration: None,
            })
        }
        Mode::Open => {
            let times = workload::arrivals(settings.rate, Some(settings.requests), None, &mut rng);
            let requests = times
                .iter()
                .map(|&at| {
                    let len = (settings.prompt_tokens.sample(&mut rng) as usize).min(context - 1);
                    let out = (settings.output_tokens.sample(&mut rng) as usize).min(context - len).max(1);
                    Request::new("open", random_prompt(&mut rng, len, vocab), out, Duration::from_secs_f64(at))
                })
                .collect();
            let (outcomes, span) = player.play("open", requests)?;
            runs.push(RunReport::new("open", &outcomes, span.as_secs_f64()));
            Workload::Open(OpenLoop {
                rate: settings.rate,
                duration_s: None,
                requests: Some(settings.requests),
                prompt_tokens: settings.prompt_tokens.to_string(),
                output_tokens: settings.output_tokens.to_string(),
                prompts_file: None,
            })
        }
        Mode::Chat(chat) => {
            if chat.positions() > context as u64 {
                bail!("{} chat turns need {} positions, more than the model's context of {context}", chat.turns, chat.positions());
            }
            // As `duplex bench --chat-turns`: each turn resends the whole
            // conversation, then a fresh prompt of its length shares no prefix.
            let mut chat = chat.clone();
            let mut history = random_prompt(&mut rng, chat.first_tokens as usize, vocab);
            for turn in 1..=chat.turns {
                let name = format!("turn {turn}");
                let (mut answer, a) = player.play(&name, vec![Request::new("chat", history.clone(), chat.answer_tokens as usize, Duration::ZERO)])?;
                let (fresh, b) = player.play(&format!("{name}, fresh"), vec![Request::new("fresh", random_prompt(&mut rng, history.len(), vocab), 1, Duration::ZERO)])?;
                let answer = answer.remove(0);
                chat.per_turn.push(ChatTurn { turn, prompt_tokens: history.len() as u32, ttft_ms: answer.sample.ttft_ms, fresh_ttft_ms: fresh[0].sample.ttft_ms });
                history.extend(&answer.token_ids);
                history.extend(random_prompt(&mut rng, chat.message_tokens as usize, vocab));
                runs.push(RunReport::new(&name, &[answer, fresh.into_iter().next().expect("one request")], (a + b).as_secs_f64()));
            }
            Workload::Chat(chat)
        }
    };
    let title = match settings.mode {
        Mode::Scenarios => "the paper's §4.5 scenarios: every request at once",
        Mode::Open => "open loop, Poisson arrivals",
        Mode::Chat(_) => "multi-turn chat, each turn against a fresh prompt of its length",
    };
    let report = Report { target: format!("duplex simulate on {hardware}"), model: model_name.to_string(), context_length: context as u32, seed: settings.seed, workload, runs };
    println!("## Serving ({title}, virtual time)\n");
    println!("{}", report.tables());
    println!("Where the time went (busy share of each run's span; a device's links in both directions summed):\n");
    println!("{}", player.time_went);
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;
    use duplex_sim::hardware::Hardware;

    const P_TOKENS: usize = 300;

    /// The tiny DeepSeek-V3 fixture on the paper's node; prompts of 128
    /// tokens or more go to the prefill worker, which takes both devices
    /// whenever nothing decodes (`dslp`).
    fn deployment(dslp: bool) -> Deployment {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/fixtures/tiny-dsv3");
        let pool = duplex_kernels::pool::PoolConfig::split(1, 1).unwrap();
        let model = Model::load_with(std::path::Path::new(dir), &pool, &mut |_, _| {}).unwrap();
        let hw = Hardware::builtin("paper-node").unwrap();
        let (a, b) = (&hw.devices[0], &hw.devices[1]);
        let devices = [crate::simulate::device(a, 1, false), crate::simulate::device(b, 7, false), crate::simulate::device(b, 2, false)];
        let settings = ServeSettings {
            mode: Mode::Scenarios,
            scenarios: "1P+1D".parse().unwrap(),
            long_prompt_tokens: P_TOKENS as u32,
            long_output_tokens: 2,
            short_prompt_tokens: 8,
            decode_tokens: 6,
            rate: 1.0,
            requests: 1,
            prompt_tokens: Dist::Fixed(1),
            output_tokens: Dist::Fixed(1),
            seed: 0,
            dslp,
            router: RouterConfig { prefill_threshold_tokens: 128, dslp_idle_window_seconds: 0.0, ..RouterConfig::default() },
            decode: DecodeConfig::default(),
        };
        let cpu = Arc::new(SimCpu::new(hw.cpu.clone(), 64, 1));
        Deployment::new(model, devices, cpu, SlpConfig::default(), &settings, Precision::Bf16).unwrap()
    }

    fn prompt(len: usize) -> Vec<u32> {
        prompt_from(0, len)
    }

    /// A prompt sharing no prefix with those of another `start`: the prefix
    /// cache finds none of it.
    fn prompt_from(start: u32, len: usize) -> Vec<u32> {
        (0..len as u32).map(|i| (start + i * 31) % 1000).collect()
    }

    /// Runs `requests` from virtual time zero; the time to each one's first token.
    fn ttfts(dep: &mut Deployment, requests: &mut [Request]) -> Vec<Duration> {
        clock::set(Some(Duration::ZERO));
        let (start, end) = dep.run(requests).unwrap();
        clock::set(None);
        for r in requests.iter() {
            assert!(r.error.is_none(), "{:?}", r.error);
            assert_eq!(r.tokens.len(), r.max_tokens, "every token came");
            assert!(r.tokens.windows(2).all(|w| w[0] < w[1]), "tokens come in time order, one step apart");
            assert!(r.done <= Some(end) && r.arrives >= start);
        }
        requests.iter().map(|r| r.tokens[0] - r.arrives).collect()
    }

    #[test]
    fn a_request_reaching_the_decode_worker_stops_two_device_prefill_which_runs_again_on_one_device() {
        let one_device = ttfts(&mut deployment(false), &mut [Request::new("P", prompt(P_TOKENS), 2, Duration::ZERO)])[0];
        let mut dep = deployment(true);
        let mut alone = [Request::new("P", prompt(P_TOKENS), 2, Duration::ZERO)];
        let two_devices = ttfts(&mut dep, &mut alone)[0];
        assert_eq!(alone[0].route, Some(Route::Dslp), "nothing decodes: both devices");
        assert!(two_devices < one_device, "DSLP {two_devices:?} is faster than SLP {one_device:?}");
        assert_eq!(dep.revoked, 0);

        // A short request arrives halfway through the two-device run of
        // another prompt (the first one's is cached now).
        let halfway = two_devices / 2;
        let mut mixed = [Request::new("P", prompt_from(7, P_TOKENS), 2, Duration::ZERO), Request::new("D", prompt(8), 6, halfway)];
        let t = ttfts(&mut dep, &mut mixed);
        assert_eq!(dep.revoked, 1, "the decode request took its device back");
        assert_eq!((mixed[0].route, mixed[1].route), (Some(Route::Slp), Some(Route::DecodeChunked)));
        // The prompt ran again on one device from where DSLP stopped; the
        // short request did not wait for it.
        assert!(t[0] >= halfway + one_device, "{:?} ≥ {halfway:?} + {one_device:?}", t[0]);
        assert!(mixed[1].tokens[0] < mixed[0].tokens[0]);
        assert!(t[1] < one_device, "the short request's first token took {:?}", t[1]);
    }

    #[test]
    fn decode_steps_in_the_batcher_cost_what_the_placement_costs_alone() {
        // One short request alone, then two at once: the same hybrid steps,
        // so two sequences' tokens come slower, but not twice as slow.
        let mut dep = deployment(false);
        let mut one = [Request::new("D", prompt(8), 6, Duration::ZERO)];
        ttfts(&mut dep, &mut one);
        let mut two = [Request::new("D", prompt(8), 6, Duration::ZERO), Request::new("D", prompt(9), 6, Duration::ZERO)];
        ttfts(&mut dep, &mut two);
        let tpot = |r: &Request| (r.tokens[r.tokens.len() - 1] - r.tokens[1]) / (r.tokens.len() as u32 - 2);
        let (alone, together) = (tpot(&one[0]), tpot(&two[0]));
        assert_eq!(together, tpot(&two[1]), "the two decode in the same steps");
        assert!(together > alone && together < 2 * alone, "batch 2 step {together:?} against batch 1 {alone:?}");
    }
}
