//! Stream-loading prefill (SLP, §3.1 of the cloud-grade-SLO paper): a prompt
//! runs entirely on an accelerator whose memory is far smaller than the
//! model, its weights streamed from the shared host segment just ahead of
//! use.
//!
//! Three threads per prompt, each on its own stream:
//! - the **loader** stages each module's weights (copy stream) into an
//!   experts-ring slot or the dense budget, and sets the module's ON signal
//!   with the device event that marks the copies done;
//! - the **model** thread (the caller's) waits for ON, orders the compute
//!   stream after that event, enqueues the module's kernels, and sets OFF
//!   with the event that marks them done;
//! - the **unloader** waits for OFF, waits for that event on the device, and
//!   releases the slot or budget space, which wakes a blocked loader.
//!
//! The unit is the sub-layer: the attention block, the FFN's dense part, and
//! each routed expert are modules of their own. Host copies are never
//! written back: the authoritative weights stay in the shared segment.

mod audit;
mod ring;
mod signal;

use audit::{Audit, Phase};
use duplex_kernels::device::{Device, DeviceError, DevicePtr, DeviceWeight, Event, StreamId, StreamKind};
use duplex_model::staged::{workspace_bytes, ModuleKind, StagedError, StagedModule, StagedPass};
use duplex_model::weights::Weights;
use duplex_model::{BlockTable, KvPool, Logits, Model, Precision};
use rand::{Rng, SeedableRng};
use ring::{DenseBudget, ExpertRing};
use signal::{lock, Abort, Aborted, Signal};
use std::sync::{Arc, Mutex};
use std::time::Duration;

#[derive(Clone, Debug)]
pub struct SlpConfig {
    /// Ring length for every prompt, overriding the adaptive choice.
    pub ring_slots: Option<usize>,
    /// Prompts this long or longer get a 2-slot (ping-pong) ring; shorter
    /// ones a ring holding one layer's experts.
    pub turning_point_tokens: usize,
    /// Device bytes for non-expert modules.
    pub dense_budget_bytes: usize,
    /// Device bytes for the keys and values attention expands at a time:
    /// long prompts take the heads in groups to stay under it.
    pub attention_kv_bytes: usize,
    /// Random delays in the three threads (stress tests): seed and maximum.
    pub jitter: Option<(u64, Duration)>,
}

impl Default for SlpConfig {
    fn default() -> Self {
        SlpConfig { ring_slots: None, turning_point_tokens: 50_000, dense_budget_bytes: 1 << 30, attention_kv_bytes: 256 << 20, jitter: None }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum SlpError {
    #[error(transparent)]
    Staged(#[from] StagedError),
    #[error(transparent)]
    Device(#[from] DeviceError),
    #[error("{0}")]
    Config(String),
    #[error("the pipeline broke its ordering: {0}")]
    Audit(String),
    #[error("prefill cancelled")]
    Cancelled,
}

/// One layer's device times: copies, kernels, and wall time on the compute
/// stream from the end of the previous layer to the end of this one.
#[derive(Clone, Copy, Debug, Default)]
pub struct LayerTiming {
    /// Weight bytes the layer's modules streamed.
    pub bytes: u64,
    pub transfer: Duration,
    pub compute: Duration,
    pub measured: Duration,
}

impl LayerTiming {
    /// max(transfer, compute) ÷ measured: 1 when the shorter is hidden entirely.
    pub fn overlap_efficiency(&self) -> f64 {
        self.transfer.max(self.compute).as_secs_f64() / self.measured.as_secs_f64().max(1e-12)
    }
}

#[derive(Clone, Debug, Default)]
pub struct SlpReport {
    pub ring_slots: usize,
    pub ring_bytes: usize,
    pub bytes_streamed: u64,
    /// Time the compute stream sat idle between modules, waiting for weights.
    pub stall: Duration,
    pub layers: Vec<LayerTiming>,
}

impl SlpReport {
    /// max(Σ transfer, Σ compute) ÷ Σ measured over the layers: how close
    /// the pass came to taking only as long as the longer of the two. (Per
    /// layer the ratio can exceed 1: with a full ring, part of a layer's
    /// transfer happens during the previous layer.)
    pub fn overlap_efficiency(&self) -> f64 {
        let sum = |f: fn(&LayerTiming) -> Duration| self.layers.iter().map(f).sum::<Duration>().as_secs_f64();
        sum(|l| l.transfer).max(sum(|l| l.compute)) / sum(|l| l.measured).max(1e-12)
    }
}

/// Runs one module of a pass whose weights are on the device.
type RunModule<'a> = dyn FnMut(ModuleKind, &Weights<DeviceWeight>) -> Result<(), StagedError> + 'a;

/// Where a loaded module's weights are.
#[derive(Clone, Copy, Debug)]
enum Place {
    Slot(usize),
    Dense(DevicePtr),
}

#[derive(Clone)]
struct Loaded {
    weights: Weights<DeviceWeight>,
    place: Place,
    copy_start: Event,
    ready: Event,
}

#[derive(Clone)]
struct Ran {
    start: Event,
    done: Event,
}

/// A device, its streams, the dense budget and the model cut into modules.
pub struct SlpEngine {
    device: Arc<dyn Device>,
    modules: Vec<StagedModule>,
    copy: StreamId,
    compute: StreamId,
    budget: Option<DenseBudget>,
    config: SlpConfig,
    moe_layers: usize,
    expert_bytes: usize,
}

impl SlpEngine {
    pub fn new(model: &Model, device: Arc<dyn Device>, config: SlpConfig) -> Result<Self, SlpError> {
        if config.ring_slots.is_some_and(|s| s < 2) {
            return Err(SlpError::Config("ring_slots must be at least 2 (ping-pong)".into()));
        }
        if let Some(why) = model.device_refusal() {
            return Err(SlpError::Config(why));
        }
        // Embedding and LM-head chunks of a quarter of the budget, so that
        // the loader can run ahead of the model thread through them.
        let modules = model.staged_modules(config.dense_budget_bytes / 4);
        let largest_dense = modules.iter().filter(|m| !m.is_expert()).map(|m| (m.device_bytes(), m.kind)).max_by_key(|m| m.0);
        if let Some((bytes, kind)) = largest_dense.filter(|&(b, _)| b > config.dense_budget_bytes) {
            return Err(SlpError::Config(format!("module {kind:?} needs {bytes} bytes of device memory, more than the dense budget of {} bytes", config.dense_budget_bytes)));
        }
        // Page-lock the shared segment (every mapping weights come from).
        let mut owners: Vec<duplex_kernels::device::HostBytes> = vec![];
        for (_, t) in modules.iter().flat_map(|m| m.tensors.iter()) {
            if !owners.iter().any(|o| o.same_owner(&t.data)) {
                owners.push(t.data.whole());
            }
        }
        for o in &owners {
            device.register_host(o)?;
        }
        let copy = device.create_stream(StreamKind::Copy)?;
        let compute = device.create_stream(StreamKind::Compute)?;
        let budget = DenseBudget::new(&*device, config.dense_budget_bytes).map_err(|e| SlpError::Config(format!("the dense budget of {} bytes does not fit {}: {e}", config.dense_budget_bytes, device.describe())))?;
        let expert_bytes = modules.iter().filter(|m| m.is_expert()).map(|m| m.device_bytes()).max().unwrap_or(0);
        let moe_layers = (0..model.cfg.num_hidden_layers).filter(|&l| model.cfg.is_moe_layer(l)).count();
        Ok(SlpEngine { device, modules, copy, compute, budget: Some(budget), config, moe_layers, expert_bytes })
    }

    pub fn device(&self) -> &Arc<dyn Device> {
        &self.device
    }

    pub fn config(&self) -> &SlpConfig {
        &self.config
    }

    /// The stream this engine's passes compute on.
    pub fn compute_stream(&self) -> StreamId {
        self.compute
    }

    pub fn describe(&self) -> String {
        self.device.describe()
    }

    /// The ring length for a prompt of `tokens` that runs `experts_per_layer`
    /// routed experts of each MoE layer: one layer's experts below the
    /// turning point, two beyond it, or the configured override.
    pub fn ring_slots_for(&self, tokens: usize, experts_per_layer: usize) -> usize {
        self.config.ring_slots.unwrap_or(if tokens >= self.config.turning_point_tokens { 2 } else { experts_per_layer.max(2) })
    }

    /// Prefill `tokens` into `table`'s blocks of `pool` on the device and
    /// return the logits. `should_stop` is asked between modules.
    #[allow(clippy::too_many_arguments)]
    pub fn run(
        &self,
        model: &Model,
        pool: &mut KvPool,
        table: &mut BlockTable,
        tokens: &[u32],
        precision: Precision,
        want: Logits,
        should_stop: &mut dyn FnMut() -> bool,
    ) -> Result<(Vec<f32>, SlpReport), SlpError> {
        let (dev, kv_bytes) = (&*self.device, self.config.attention_kv_bytes);
        let start_len = table.len;
        let bytes = workspace_bytes(model, table.len, tokens.len(), want, kv_bytes)?;
        let (compute, seq) = (self.compute, &mut *table);
        let result = self.stream(
            tokens.len(),
            bytes,
            should_stop,
            move |workspace| Ok((StagedPass::new(model, dev, compute, pool, seq, tokens, precision, want, workspace, kv_bytes)?, pool, seq)),
            |(pass, pool, _), kind, w| pass.run(kind, w, pool),
            |(pass, _, seq)| Ok(pass.finish(seq)?),
            &|_| true,
        );
        if result.is_err() {
            table.len = start_len;
        }
        result
    }

    /// Run a prompt of `tokens` tokens through the modules that `runs`
    /// accepts as their weights stream in: `start` makes the pass in a
    /// workspace of `workspace_bytes`, `run` runs one module on it, and
    /// `finish` takes its results before the device memory is given back.
    #[allow(clippy::too_many_arguments)]
    pub fn stream<P, T>(
        &self,
        tokens: usize,
        workspace_bytes: usize,
        should_stop: &mut dyn FnMut() -> bool,
        start: impl FnOnce(DevicePtr) -> Result<P, SlpError>,
        mut run: impl FnMut(&mut P, ModuleKind, &Weights<DeviceWeight>) -> Result<(), StagedError>,
        finish: impl FnOnce(P) -> Result<T, SlpError>,
        runs: &dyn Fn(ModuleKind) -> bool,
    ) -> Result<(T, SlpReport), SlpError> {
        let dev = &*self.device;
        let modules: Vec<&StagedModule> = self.modules.iter().filter(|m| runs(m.kind)).collect();
        let experts_per_layer = modules.iter().filter(|m| m.is_expert()).count() / self.moe_layers.max(1);
        let workspace = dev.alloc(workspace_bytes).map_err(|e| SlpError::Config(format!("the activations of a {tokens}-token prompt do not fit the device: {e}")))?;
        let ring = match self.ring(tokens, experts_per_layer) {
            Ok(ring) => ring,
            Err(e) => {
                dev.free(workspace)?;
                return Err(e);
            }
        };
        let result = (|| -> Result<(T, SlpReport), SlpError> {
            let mut pass = start(workspace)?;
            let report = self.pipeline(&modules, &mut |kind, w| run(&mut pass, kind, w), ring.as_ref(), should_stop)?;
            Ok((finish(pass)?, report))
        })();
        // Whatever happened, nothing may still touch the ring or the budget.
        let idle = [self.copy, self.compute].map(|s| dev.record(s).and_then(|e| dev.synchronize(&e)));
        if let Some(ring) = ring {
            ring.free(dev)?;
        }
        dev.free(workspace)?;
        if let Some(budget) = &self.budget {
            budget.reset();
        }
        let result = result?;
        idle.into_iter().collect::<Result<Vec<()>, _>>()?;
        Ok(result)
    }

    /// The experts ring for a prompt of `tokens`, as long as asked for or,
    /// when device memory is short, as long as fits (at least 2 slots).
    fn ring(&self, tokens: usize, experts_per_layer: usize) -> Result<Option<ExpertRing>, SlpError> {
        if self.expert_bytes == 0 {
            return Ok(None);
        }
        let dev = &*self.device;
        let wanted = self.ring_slots_for(tokens, experts_per_layer);
        match ExpertRing::new(dev, wanted, self.expert_bytes) {
            Ok(r) => Ok(Some(r)),
            Err(DeviceError::OutOfMemory { largest, .. }) if wanted > 2 => {
                let fits = (largest / (self.expert_bytes.div_ceil(256) * 256)).max(2);
                tracing::warn!("experts ring of {wanted} slots does not fit device memory; using {fits}");
                Ok(Some(ExpertRing::new(dev, fits.min(wanted), self.expert_bytes)?))
            }
            Err(e) => Err(SlpError::Config(format!("the experts ring ({wanted} slots of {} bytes) does not fit the device: {e}", self.expert_bytes))),
        }
    }

    fn pipeline(&self, modules: &[&StagedModule], run: &mut RunModule, ring: Option<&ExpertRing>, should_stop: &mut dyn FnMut() -> bool) -> Result<SlpReport, SlpError> {
        let dev = &*self.device;
        let budget = self.budget.as_ref().expect("the budget lives as long as the engine");
        let n = modules.len();
        let on: Vec<Signal<Loaded>> = (0..n).map(|_| Signal::new()).collect();
        let off: Vec<Signal<Ran>> = (0..n).map(|_| Signal::new()).collect();
        let audit = Arc::new(Audit::new(n));
        let abort = Abort::default();
        let failure: Mutex<Option<SlpError>> = Mutex::new(None);
        let fail = |e: SlpError| {
            lock(&failure).get_or_insert(e);
            abort.raise();
        };
        let jitter = |thread: u64| self.config.jitter.map(|(seed, max)| (rand_chacha::ChaCha8Rng::seed_from_u64(seed ^ thread), max));
        let pause = |j: &mut Option<(rand_chacha::ChaCha8Rng, Duration)>| {
            if let Some((rng, max)) = j {
                std::thread::sleep(max.mul_f64(rng.gen::<f64>()));
            }
        };
        // Expert module k of the prompt takes ring slot k % len.
        let mut experts = 0;
        let expert_seq: Vec<Option<usize>> = modules
            .iter()
            .map(|m| {
                let k = experts;
                experts += m.is_expert() as usize;
                m.is_expert().then_some(k)
            })
            .collect();
        let slot_users: Vec<usize> = (0..n).filter(|&i| expert_seq[i].is_some()).collect();
        let epoch = dev.record(self.compute)?;

        // The helper threads start at the caller's virtual time (simulator).
        let started = duplex_kernels::clock::Stamp::now();
        std::thread::scope(|scope| {
            let loader = scope.spawn(|| {
                started.join();
                let mut j = jitter(1);
                for (i, m) in modules.iter().enumerate() {
                    pause(&mut j);
                    let (place, memory) = match (expert_seq[i], ring) {
                        (Some(k), Some(ring)) => match ring.acquire(k, i, &abort) {
                            Ok((slot, memory)) => {
                                if k >= ring.len() {
                                    audit.expect_freed(slot_users[k - ring.len()], i);
                                }
                                (Place::Slot(slot), memory)
                            }
                            Err(Aborted) => return,
                        },
                        _ => match budget.alloc(m.device_bytes(), &abort) {
                            Ok(p) => (Place::Dense(p), p),
                            Err(Aborted) => return,
                        },
                    };
                    audit.step(i, None, Phase::Loading);
                    let staged = (|| -> Result<Loaded, DeviceError> {
                        let copy_start = dev.record(self.copy)?;
                        let weights = m.upload(dev, self.copy, memory)?;
                        let a = audit.clone();
                        dev.host_fn(self.copy, Box::new(move || a.step(i, Some(Phase::Loading), Phase::Loaded)))?;
                        Ok(Loaded { weights, place, copy_start, ready: dev.record(self.copy)? })
                    })();
                    match staged {
                        Ok(loaded) => on[i].set(loaded),
                        Err(e) => return fail(e.into()),
                    }
                }
            });
            let unloader = scope.spawn(|| {
                started.join();
                let mut j = jitter(3);
                for i in 0..n {
                    pause(&mut j);
                    let Ok(ran) = off[i].wait(&abort) else { return };
                    if let Err(e) = dev.synchronize(&ran.done) {
                        return fail(e.into());
                    }
                    audit.step(i, Some(Phase::Used), Phase::Freed);
                    match on[i].get().map(|l| l.place) {
                        Some(Place::Slot(s)) => ring.expect("slots come from the ring").release(s),
                        Some(Place::Dense(p)) => budget.release(p),
                        None => unreachable!("a module runs only once loaded"),
                    }
                }
            });

            let mut j = jitter(2);
            for (i, m) in modules.iter().enumerate() {
                pause(&mut j);
                if abort.raised() {
                    break;
                }
                if should_stop() {
                    fail(SlpError::Cancelled);
                    break;
                }
                let Ok(loaded) = on[i].wait(&abort) else { break };
                let ran = (|| -> Result<Ran, SlpError> {
                    dev.wait_event(self.compute, &loaded.ready)?;
                    let a = audit.clone();
                    dev.host_fn(self.compute, Box::new(move || a.step(i, Some(Phase::Loaded), Phase::InUse)))?;
                    let start = dev.record(self.compute)?;
                    run(m.kind, &loaded.weights)?;
                    let a = audit.clone();
                    dev.host_fn(self.compute, Box::new(move || a.step(i, Some(Phase::InUse), Phase::Used)))?;
                    Ok(Ran { start, done: dev.record(self.compute)? })
                })();
                match ran {
                    Ok(ran) => off[i].set(ran),
                    Err(e) => {
                        fail(e);
                        break;
                    }
                }
            }
            if loader.join().is_err() || unloader.join().is_err() {
                fail(SlpError::Audit("an SLP thread panicked".into()));
            }
        });
        if let Some(e) = lock(&failure).take() {
            return Err(e);
        }
        if let Some(v) = audit.violations().first() {
            return Err(SlpError::Audit(v.clone()));
        }
        self.report(modules, ring, &on, &off, &epoch)
    }

    /// Per-layer times from the events of a completed prompt.
    fn report(&self, modules: &[&StagedModule], ring: Option<&ExpertRing>, on: &[Signal<Loaded>], off: &[Signal<Ran>], epoch: &Event) -> Result<SlpReport, SlpError> {
        let dev = &*self.device;
        let mut report = SlpReport { ring_slots: ring.map_or(0, |r| r.len()), ring_bytes: ring.map_or(0, |r| r.bytes()), ..Default::default() };
        let mut previous_done = epoch.clone();
        let mut layer_end = epoch.clone();
        let mut current = LayerTiming::default();
        let mut current_layer = None;
        for (i, m) in modules.iter().enumerate() {
            let (Some(loaded), Some(ran)) = (on[i].get(), off[i].get()) else { continue };
            let layer = match m.kind {
                ModuleKind::Attention { layer } | ModuleKind::Ffn { layer } | ModuleKind::Expert { layer, .. } => Some(layer),
                ModuleKind::Embed { .. } | ModuleKind::Head { .. } => None,
            };
            if layer != current_layer {
                if current_layer.is_some() {
                    current.measured = dev.elapsed(&layer_end, &previous_done)?;
                    report.layers.push(current);
                }
                layer_end = previous_done.clone();
                current = LayerTiming::default();
                current_layer = layer;
            }
            report.bytes_streamed += m.bytes() as u64;
            current.bytes += m.bytes() as u64;
            current.transfer += dev.elapsed(&loaded.copy_start, &loaded.ready)?;
            current.compute += dev.elapsed(&ran.start, &ran.done)?;
            report.stall += dev.elapsed(&previous_done, &ran.start)?;
            previous_done = ran.done.clone();
        }
        if current_layer.is_some() {
            current.measured = dev.elapsed(&layer_end, &previous_done)?;
            report.layers.push(current);
        }
        Ok(report)
    }
}

impl Drop for SlpEngine {
    fn drop(&mut self) {
        if let Some(budget) = self.budget.take() {
            let _ = budget.free(&*self.device);
        }
    }
}
