//! The decode device's expert cache (HybriMoE, DALI): slots of device memory
//! that hold whole routed experts, so that an activated expert can run on
//! the device beside the CPU's share instead of on the CPU.
//!
//! `duplex-expert-cache` makes the decisions — which experts each layer
//! keeps (a replacement policy), where each activated expert of a layer runs
//! (an assignment over a cost model profiled at start-up), what to copy
//! ahead (prefetch) — and this module applies them: the copies, the slots
//! and the events that order them. Slots are allocated once and reused:
//! - **cache slots**, a share of the budget per MoE layer, filled and
//!   replaced by the layer's policy after each step;
//! - **transient slots**, a small ring for experts copied in for one layer
//!   only: those an assignment sends over PCIe, and prefetched ones.
//!
//! A slot is overwritten only after all the work that read it (its
//! `last_use` events, one per stream: both micro-batches read the same
//! slots, and either may finish first), and read only after its copy landed
//! (its `ready` event).

use crate::backend::{ExpertJob, Tokens};
use crate::forward::ModuleKind;
use crate::model::{ForwardError, Model};
use crate::staged::StagedModule;
use crate::weights::HostWeight;
use duplex_expert_cache::assign::{assign, AssignmentKind, Side};
use crate::config::Architecture;
use duplex_expert_cache::policy::{new_policy, ModelFamily, PolicyKind, PolicyParams, ReplacementPolicy};
use duplex_expert_cache::prefetch::{self, PrefetchKind};
use duplex_expert_cache::{Active, CostModel};
use duplex_kernels::device::{Device, DevicePtr, DeviceWeight, Event, StreamId};
use std::collections::HashMap;
use std::time::{Duration, Instant};

/// How the cache is set up.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExpertCacheConfig {
    /// Routed experts the cache holds, over all MoE layers (0: no cache).
    pub experts: usize,
    pub assignment: AssignmentKind,
    pub prefetch: PrefetchKind,
    pub policy: PolicyKind,
}

/// What the cache did in a step (or, summed, in many), for metrics.
#[derive(Clone, Copy, Debug, Default)]
pub struct CacheStats {
    /// Activated experts looked up, and those found on the device.
    pub lookups: u64,
    pub hits: u64,
    /// Activated experts run on each side.
    pub device_experts: u64,
    pub cpu_experts: u64,
    /// Experts copied in for their layer only (the assignment's transfers).
    pub transferred: u64,
    /// Prefetched bytes, and those whose expert its layer did not use.
    pub prefetched_bytes: u64,
    pub wasted_bytes: u64,
    /// Experts the policy swapped into the cache.
    pub swapped_in: u64,
    /// MoE layers planned, with their predicted and measured times summed.
    pub layers: u64,
    pub predicted: Duration,
    pub measured: Duration,
    /// Time spent deciding (assignment, policy, prefetch choice).
    pub deciding: Duration,
}

impl std::ops::AddAssign for CacheStats {
    fn add_assign(&mut self, o: Self) {
        self.lookups += o.lookups;
        self.hits += o.hits;
        self.device_experts += o.device_experts;
        self.cpu_experts += o.cpu_experts;
        self.transferred += o.transferred;
        self.prefetched_bytes += o.prefetched_bytes;
        self.wasted_bytes += o.wasted_bytes;
        self.swapped_in += o.swapped_in;
        self.layers += o.layers;
        self.predicted += o.predicted;
        self.measured += o.measured;
        self.deciding += o.deciding;
    }
}

/// One expert's projections where a slot holds them.
#[derive(Clone, Copy)]
pub struct SlotWeights {
    pub gate: DeviceWeight,
    pub up: DeviceWeight,
    pub down: DeviceWeight,
}

/// One expert-sized piece of device memory.
struct Slot {
    ptr: DevicePtr,
    /// The `(layer, expert)` it holds, and its weights there.
    holds: Option<((usize, usize), SlotWeights)>,
    /// Completed when the copy into it landed.
    ready: Option<Event>,
    /// Per stream that read it, completed when its last reading work finished.
    last_use: Vec<(StreamId, Event)>,
}

/// One MoE layer's share of the cache.
struct LayerCache {
    /// Its cache slots; which expert each holds is in `map`.
    slots: Vec<usize>,
    map: HashMap<usize, usize>,
    policy: Box<dyn ReplacementPolicy>,
    /// Experts prefetched for this layer's next run, in transient slots.
    prefetched: HashMap<usize, usize>,
    /// DALI's residual vector: the mean change of the FFN's input hidden
    /// state from this MoE layer to the next, over calibration tokens.
    residual: Vec<f32>,
}

/// A planned layer: which jobs run on the device (with their slots'
/// weights) and which on the CPU.
pub(crate) struct PlannedLayer {
    /// `(index into the layer's jobs, weights)`.
    pub device: Vec<(usize, SlotWeights)>,
    pub cpu: Vec<usize>,
    slots: Vec<usize>,
}

/// A planned layer's timing, read once the step is done.
struct PendingMeasure {
    device: Option<(Event, Event)>,
    cpu: Duration,
}

pub struct ExpertCache {
    cfg: ExpertCacheConfig,
    /// Per layer, per expert: the tensors a copy into a slot takes.
    modules: Vec<Vec<StagedModule>>,
    slots: Vec<Slot>,
    layers: Vec<Option<LayerCache>>,
    /// Transient slots, used round robin.
    transient: Vec<usize>,
    next_transient: usize,
    slot_bytes: usize,
    cost: CostModel,
    pending: Vec<PendingMeasure>,
    stats: CacheStats,
}

/// Bytes of one expert's three matrices on the device (the largest, should
/// experts differ), or `None` for a model without routed experts.
pub fn expert_slot_bytes(model: &Model) -> Option<usize> {
    model.staged_modules(usize::MAX).iter().filter(|m| m.is_expert()).map(StagedModule::device_bytes).max()
}

/// Transient slots: room for a layer's activated experts copied in at once.
fn transient_slots(model: &Model) -> usize {
    2 * model.cfg.num_experts_per_tok.max(1)
}

fn tokens_of(t: &Tokens) -> usize {
    match t {
        Tokens::Rows(r) => r.len(),
        Tokens::All => 0,
    }
}

impl ExpertCache {
    /// Device bytes a cache of `experts` needs, with its transient slots.
    pub fn bytes(model: &Model, experts: usize) -> usize {
        expert_slot_bytes(model).map_or(0, |b| (experts + transient_slots(model)) * b)
    }

    /// Empty slots in `memory` (at least [`ExpertCache::bytes`] long) of `dev`.
    pub(crate) fn new(model: &Model, dev: &dyn Device, memory: DevicePtr, cfg: ExpertCacheConfig, cost: CostModel) -> Result<Self, ForwardError> {
        let c = &model.cfg;
        let slot_bytes = expert_slot_bytes(model).ok_or_else(|| ForwardError::BadModule("an expert cache for a model without routed experts".into()))?;
        let n_slots = cfg.experts + transient_slots(model);
        if memory.bytes < n_slots * slot_bytes {
            return Err(ForwardError::Workspace(format!("{} bytes for {n_slots} expert slots of {slot_bytes}", memory.bytes)));
        }
        let slots = (0..n_slots).map(|i| Ok(Slot { ptr: memory.slice(i * slot_bytes, slot_bytes)?, holds: None, ready: None, last_use: vec![] })).collect::<Result<Vec<_>, ForwardError>>()?;
        let mut modules: Vec<Vec<StagedModule>> = (0..c.num_hidden_layers).map(|_| vec![]).collect();
        for m in model.staged_modules(usize::MAX) {
            if let ModuleKind::Expert { layer, .. } = m.kind {
                modules[layer].push(m);
            }
        }
        // Page-lock the mappings the experts are copied from (once each), so
        // that their copies run at the link's speed on a GPU.
        let mut owners: Vec<duplex_kernels::device::HostBytes> = vec![];
        for (_, t) in modules.iter().flatten().flat_map(|m| m.tensors.iter()) {
            if !owners.iter().any(|o| o.same_owner(&t.data)) {
                owners.push(t.data.whole());
            }
        }
        for o in &owners {
            dev.register_host(o)?;
        }
        let moe: Vec<usize> = (0..c.num_hidden_layers).filter(|&l| c.is_moe_layer(l)).collect();
        let family = match c.architecture {
            Architecture::DeepseekV3 => ModelFamily::DeepSeek,
            Architecture::Qwen3Moe => ModelFamily::Qwen,
            Architecture::Mixtral => ModelFamily::Mixtral,
        };
        let params = PolicyParams::for_model(c.n_routed_experts, c.num_experts_per_tok, family).map_err(|e| ForwardError::BadModule(format!("expert cache policy: {e}")))?;
        let mut layers: Vec<Option<LayerCache>> = (0..c.num_hidden_layers).map(|_| None).collect();
        let mut next = 0;
        for (i, &l) in moe.iter().enumerate() {
            // The budget split evenly, the first layers taking the remainder.
            let share = cfg.experts / moe.len() + usize::from(i < cfg.experts % moe.len());
            layers[l] = Some(LayerCache { slots: (next..next + share).collect(), map: HashMap::new(), policy: new_policy(cfg.policy, c.n_routed_experts, &params), prefetched: HashMap::new(), residual: vec![] });
            next += share;
        }
        let transient = (cfg.experts..n_slots).collect();
        Ok(ExpertCache { cfg, modules, slots, layers, transient, next_transient: 0, slot_bytes, cost, pending: vec![], stats: CacheStats::default() })
    }

    pub fn config(&self) -> &ExpertCacheConfig {
        &self.cfg
    }

    pub fn cost(&self) -> &CostModel {
        &self.cost
    }

    /// DALI's residual vectors, per MoE layer (set after calibration).
    pub(crate) fn set_residual(&mut self, layer: usize, r: Vec<f32>) {
        if let Some(Some(l)) = self.layers.get_mut(layer) {
            l.residual = r;
        }
    }

    /// Enqueue the copy of `module` (an expert) into `dst` on `stream`.
    pub(crate) fn upload_expert(dev: &dyn Device, stream: StreamId, module: &StagedModule, dst: DevicePtr) -> Result<SlotWeights, ForwardError> {
        let w = module.upload(dev, stream, dst.slice(0, module.device_bytes())?)?;
        Ok(SlotWeights { gate: *w.get("gate_proj")?, up: *w.get("up_proj")?, down: *w.get("down_proj")? })
    }

    /// Copy `(layer, expert)` into slot `s` on `copy`, after the slot's last reader.
    fn load(&mut self, dev: &dyn Device, copy: StreamId, s: usize, layer: usize, expert: usize) -> Result<(), ForwardError> {
        let module = self.modules.get(layer).and_then(|m| m.get(expert)).ok_or(ForwardError::Routing { expert, experts: self.modules.get(layer).map_or(0, Vec::len) })?;
        let slot = &mut self.slots[s];
        for (_, used) in slot.last_use.drain(..) {
            dev.wait_event(copy, &used)?;
        }
        let weights = Self::upload_expert(dev, copy, module, slot.ptr)?;
        slot.holds = Some(((layer, expert), weights));
        slot.ready = Some(dev.record(copy)?);
        Ok(())
    }

    /// The next transient slot but those in `busy` (read by work not queued
    /// yet: a slot is only ever waited for once its readers are queued);
    /// whatever was prefetched into it is dropped (and counted as wasted).
    fn take_transient(&mut self, busy: &[usize]) -> Option<usize> {
        let n = self.transient.len();
        let at = (0..n).map(|i| (self.next_transient + i) % n).find(|&i| !busy.contains(&self.transient[i]))?;
        let s = self.transient[at];
        self.next_transient = at + 1;
        let mut dropped = 0;
        for l in self.layers.iter_mut().flatten() {
            let before = l.prefetched.len();
            l.prefetched.retain(|_, slot| *slot != s);
            dropped += before - l.prefetched.len();
        }
        self.stats.wasted_bytes += (dropped * self.slot_bytes) as u64;
        Some(s)
    }

    /// Where `(layer, expert)` is on the device now, cached or prefetched.
    fn slot_of(&self, layer: usize, expert: usize) -> Option<usize> {
        let l = self.layers.get(layer)?.as_ref()?;
        l.map.get(&expert).or_else(|| l.prefetched.get(&expert)).copied()
    }

    /// Plan layer `layer` of a step: where each job (a routed expert with
    /// its token rows) runs. For the device's share, transfers are queued on
    /// `copy` and `stream` is made to wait for the copies; the caller runs
    /// them, then calls [`ExpertCache::ran`].
    pub(crate) fn plan(&mut self, dev: &dyn Device, stream: StreamId, copy: StreamId, layer: usize, jobs: &[ExpertJob<HostWeight>]) -> Result<PlannedLayer, ForwardError> {
        let started = Instant::now();
        let active: Vec<Active> = jobs.iter().map(|j| Active { expert: j.expert, tokens: tokens_of(&j.tokens), cached: self.slot_of(layer, j.expert).is_some() }).collect();
        let plan = assign(self.cfg.assignment, &active, &self.cost);
        self.stats.deciding += started.elapsed();
        let predicted = Duration::from_secs_f64(plan.predicted.max(0.0));
        self.stats.layers += 1;
        self.stats.lookups += active.len() as u64;
        self.stats.hits += active.iter().filter(|a| a.cached).count() as u64;
        self.stats.predicted += predicted;
        let mut out = PlannedLayer { device: vec![], cpu: vec![], slots: vec![] };
        // Slots this layer reads: its cached and prefetched experts', and
        // those copied in below (none may be reused before its jobs are queued).
        let mut busy: Vec<usize> = jobs.iter().filter_map(|j| self.slot_of(layer, j.expert)).collect();
        // In the order the assignment's model times them: cached experts
        // first, then the copied ones, each highest load first.
        let mut order: Vec<usize> = (0..jobs.len()).collect();
        order.sort_by_key(|&i| (plan.sides[i] == Side::DeviceAfterTransfer, std::cmp::Reverse(active[i].tokens)));
        for i in order {
            let (job, side) = (&jobs[i], &plan.sides[i]);
            let slot = match side {
                Side::Cpu => None,
                Side::Device => Some(self.slot_of(layer, job.expert).ok_or_else(|| ForwardError::BadModule(format!("expert {} of layer {layer} planned on the device but not there", job.expert)))?),
                // More transfers than transient slots: the rest run on the CPU.
                Side::DeviceAfterTransfer => match self.take_transient(&busy) {
                    Some(s) => {
                        self.load(dev, copy, s, layer, job.expert)?;
                        self.stats.transferred += 1;
                        busy.push(s);
                        Some(s)
                    }
                    None => None,
                },
            };
            let Some(slot) = slot else {
                out.cpu.push(i);
                continue;
            };
            let Some((_, weights)) = self.slots[slot].holds else {
                return Err(ForwardError::BadModule(format!("expert slot {slot} is empty")));
            };
            if let Some(ready) = &self.slots[slot].ready {
                dev.wait_event(stream, ready)?;
            }
            out.device.push((i, weights));
            out.slots.push(slot);
        }
        self.stats.device_experts += out.device.len() as u64;
        self.stats.cpu_experts += out.cpu.len() as u64;
        Ok(out)
    }

    /// After a planned layer's work is queued: its slots were last read by
    /// what `stream` has queued so far; its device share ran between
    /// `device` events, its CPU share took `cpu`. Then the layer's policy
    /// sees the step's loads, and its swaps are queued on `copy`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn ran(&mut self, dev: &dyn Device, stream: StreamId, copy: StreamId, layer: usize, jobs: &[ExpertJob<HostWeight>], planned: &PlannedLayer, device: Option<(Event, Event)>, cpu: Duration) -> Result<(), ForwardError> {
        if !planned.slots.is_empty() {
            let used = dev.record(stream)?;
            for &s in &planned.slots {
                let readers = &mut self.slots[s].last_use;
                readers.retain(|(reader, _)| *reader != stream);
                readers.push((stream, used.clone()));
            }
        }
        self.pending.push(PendingMeasure { device, cpu });
        let started = Instant::now();
        let n_experts = self.modules.get(layer).map_or(0, Vec::len);
        let Some(Some(lc)) = self.layers.get_mut(layer) else {
            return Ok(());
        };
        // Prefetched experts this layer did not use were wasted copies.
        let used: Vec<usize> = jobs.iter().map(|j| j.expert).collect();
        let wasted = lc.prefetched.keys().filter(|e| !used.contains(e)).count();
        self.stats.wasted_bytes += (wasted * self.slot_bytes) as u64;
        lc.prefetched.clear();
        let (mut loads, mut scores) = (vec![0u32; n_experts], vec![0f32; n_experts]);
        for j in jobs {
            if let (Some(l), Some(s), Tokens::Rows(rows)) = (loads.get_mut(j.expert), scores.get_mut(j.expert), j.tokens) {
                *l += rows.len() as u32;
                *s += rows.iter().map(|&(_, w)| w).sum::<f32>();
            }
        }
        lc.policy.observe(&loads, &scores);
        let mut cached = vec![false; n_experts];
        for &e in lc.map.keys() {
            cached[e] = true;
        }
        // Recency and frequency policies move at most one expert a layer per
        // step (bounded copy traffic); the workload window swaps its own `u`
        // every `w` steps.
        let max_swaps = if lc.policy.kind() == PolicyKind::Workload { usize::MAX } else { 1 };
        let swaps = lc.policy.swaps(&cached, lc.slots.len(), max_swaps);
        self.stats.deciding += started.elapsed();
        for swap in swaps {
            let Some(Some(lc)) = self.layers.get_mut(layer) else { break };
            let slot = match swap.evict.and_then(|e| lc.map.remove(&e)) {
                Some(s) => s,
                None => match lc.slots.iter().find(|s| !lc.map.values().any(|v| v == *s)) {
                    Some(&free) => free,
                    None => continue,
                },
            };
            lc.map.insert(swap.admit, slot);
            self.load(dev, copy, slot, layer, swap.admit)?;
            self.stats.swapped_in += 1;
        }
        Ok(())
    }

    /// Prefetch for the layers after `layer`, from the FFN input hidden
    /// state `h` (`[n, d]`) of this step at `layer`: DALI's residual
    /// prediction of the next MoE layer, or HybriMoE's impact over the next
    /// three. Copies go into transient slots on `copy`.
    pub(crate) fn prefetch(&mut self, dev: &dyn Device, copy: StreamId, model: &Model, layer: usize, h: &[f32]) -> Result<(), ForwardError> {
        let c = &model.cfg;
        let started = Instant::now();
        let upcoming: Vec<usize> = (layer + 1..c.num_hidden_layers).filter(|&l| c.is_moe_layer(l)).take(3).collect();
        let cached_mask = |me: &Self, l: usize| -> Vec<bool> { (0..c.n_routed_experts).map(|e| me.slot_of(l, e).is_some()).collect() };
        // Copies per layer: half the transient slots (the rest are for the
        // assignment's own transfers); DALI's top-PS its paper's PS.
        let budget = self.transient.len() / 2;
        let ps = if c.n_routed_experts <= 16 { prefetch::DEFAULT_PS_FEW_EXPERTS } else { prefetch::DEFAULT_PS }.min(budget);
        let copies: Vec<(usize, usize)> = match self.cfg.prefetch {
            PrefetchKind::None => vec![],
            PrefetchKind::Residual => {
                let Some(&next) = upcoming.first() else { return Ok(()) };
                let residual = self.layers.get(layer).and_then(Option::as_ref).map(|l| l.residual.clone()).unwrap_or_default();
                let shifted: Vec<f32> = if residual.len() == c.hidden_size { h.chunks(c.hidden_size).flat_map(|row| row.iter().zip(&residual).map(|(a, b)| a + b)).collect() } else { h.to_vec() };
                let predicted = predicted_loads(model, next, &shifted)?;
                prefetch::top_ps(&predicted, &cached_mask(self, next), ps).map_err(prefetch_error)?.into_iter().map(|e| (next, e)).collect()
            }
            PrefetchKind::Impact => {
                let mut predicted = vec![];
                let mut cached = vec![];
                for &l in &upcoming {
                    predicted.push(predicted_loads(model, l, h)?);
                    cached.push(cached_mask(self, l));
                }
                prefetch::impact(&predicted, &cached, &self.cost, budget).map_err(prefetch_error)?.into_iter().map(|(j, e)| (upcoming[j], e)).collect()
            }
        };
        self.stats.deciding += started.elapsed();
        for (l, e) in copies {
            if self.slot_of(l, e).is_some() {
                continue;
            }
            let Some(s) = self.take_transient(&[]) else { break };
            self.load(dev, copy, s, l, e)?;
            if let Some(Some(lc)) = self.layers.get_mut(l) {
                lc.prefetched.insert(e, s);
            }
            self.stats.prefetched_bytes += self.slot_bytes as u64;
        }
        Ok(())
    }

    /// The step's counts, with its layers' measured times (its device work
    /// has finished), and a fresh count for the next.
    pub(crate) fn take_stats(&mut self, dev: &dyn Device) -> CacheStats {
        for m in self.pending.drain(..) {
            let device = m.device.and_then(|(a, b)| dev.elapsed(&a, &b).ok()).unwrap_or_default();
            self.stats.measured += device.max(m.cpu);
        }
        std::mem::take(&mut self.stats)
    }
}

fn prefetch_error(e: prefetch::PrefetchError) -> ForwardError {
    ForwardError::BadModule(format!("expert prefetch: {e}"))
}

/// Tokens per routed expert that MoE layer `layer`'s router would send
/// from hidden states `h` (`[n, d]`): its post-attention norm, its gate and
/// its top-k, on the host in F32.
fn predicted_loads(model: &Model, layer: usize, h: &[f32]) -> Result<Vec<usize>, ForwardError> {
    let c = &model.cfg;
    let d = c.hidden_size;
    let ffn = model.modules.iter().find(|m| m.kind == ModuleKind::Ffn { layer }).ok_or_else(|| ForwardError::BadModule(format!("no FFN for layer {layer}")))?;
    let norm = match ffn.weights.get("post_attention_layernorm")? {
        HostWeight::Vector(v) => v,
        _ => return Err(ForwardError::BadModule("a norm that is not a vector".into())),
    };
    let gate = ffn.weights.get("gate")?.matrix().ok_or_else(|| ForwardError::BadModule("a router gate that is not a matrix".into()))?;
    let bias = if c.use_correction_bias { ffn.weights.find("e_score_correction_bias").and_then(HostWeight::vector) } else { None };
    let mut loads = vec![0usize; c.n_routed_experts];
    let (mut x, mut logits) = (vec![0f32; d], vec![0f32; c.n_routed_experts]);
    for row in h.chunks_exact(d) {
        duplex_kernels::elementwise::rms_norm(row, norm, c.rms_norm_eps, &mut x);
        duplex_kernels::linear::matmul(&gate.view(), &x, 1, &mut logits);
        for (e, _) in duplex_kernels::router::route(&model.router, &logits, bias) {
            if let Some(l) = loads.get_mut(e) {
                *l += 1;
            }
        }
    }
    Ok(loads)
}
