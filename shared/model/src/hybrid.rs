//! The hybrid placement, for decode: attention, norms, the router, shared
//! experts, dense layers, the embedding and the LM head run on an
//! accelerator with their weights resident there; the routed experts run on
//! the host's CPU pool, reading their weights in place from the host
//! mapping (the shared weight segment). Per layer only the FFN's input, the
//! router's choices and the experts' summed output cross the bus.
//!
//! It is one more backend of the forward program ([`crate::forward`]): a
//! [`HybridBackend`] enqueues the device ops as [`crate::staged`]'s backend
//! does, and runs a layer's routed experts through the CPU backend's own
//! code. The KV cache of the sequences it decodes lives in a paged pool in
//! device memory ([`DeviceKv`]), laid out as the host's pool: a sequence's
//! blocks are copied in once when it is admitted, and later entries are
//! appended on the device.
//!
//! [`HybridEngine::forward`] splits a batch of two or more sequences into two
//! micro-batches on two device streams and alternates them layer by layer,
//! so that the device runs one micro-batch's attention while the CPU runs
//! the other's experts (the schedule of KTransformers and of the paper's
//! §3.3.1). With [`Submit::Stream`] a step is queued whole: per MoE
//! layer a stream copies the experts' input and the router's choices into
//! staging memory and a host function hands them to the host thread, which
//! runs the experts as they arrive; a later host function holds the stream
//! until their sum has landed, and a copy takes it up. Events between the
//! two streams keep the alternation. With [`Submit::Graph`] (the default)
//! that whole step is captured as one device graph (a CUDA graph on a GPU)
//! and launched at once: one launch per step instead of one per kernel,
//! through an executable graph kept per batch shape and updated in place. With
//! [`Submit::Host`] the host thread instead queues the work layer by layer
//! and waits on each micro-batch's routes itself.

use crate::checkpoint::HostTensor;
use crate::backend::{AttentionCall, Backend, ExpertJob, ExpertScratch, RouteCall, Routes, Segment};
use crate::cpu::CpuBackend;
use crate::device_experts::{CacheStats, ExpertCache, ExpertCacheConfig};
use crate::forward::{align, Assignment, ModuleKind, Pass};
use duplex_expert_cache::prefetch::PrefetchKind;
use duplex_expert_cache::CostModel;
use std::cell::RefCell;
use crate::kv_cache::{BlockTable, KvPool};
use crate::model::{ForwardError, Logits, Model, Precision, SeqInput};
use crate::staged::DeviceBackend;
use crate::weights::{HostWeight, Weights};
use duplex_kernels::linear::OwnedWeight;
use duplex_kernels::device::emulated::Jitter;
use duplex_kernels::device::{Device, DeviceError, DevicePtr, DeviceWeight, Event, GraphExec, GraphLaunch, HostBytes, Matrix, Op, PagedKv, Staging, StreamId, StreamKind};
use std::collections::HashMap;
use duplex_kernels::clock::Stamp;
use std::sync::{mpsc, Arc, Condvar, Mutex};
use std::ops::Range;
use std::time::{Duration, Instant};

/// Bound on MLA's expanded keys and values in a pass's workspace (heads are
/// expanded a group at a time within it).
const EXPANDED_BYTES: usize = 64 << 20;

/// A weight where the hybrid placement keeps it.
#[derive(Clone, Debug)]
pub enum Placed {
    /// Resident in device memory.
    Device(DeviceWeight),
    /// In the host mapping (a routed expert's projections).
    Host(HostWeight),
    /// One device weight per attention head (MLA's absorbed key bands).
    PerHead(Vec<DeviceWeight>),
}

fn on_device(w: &Placed) -> Result<&DeviceWeight, ForwardError> {
    match w {
        Placed::Device(d) => Ok(d),
        _ => Err(ForwardError::BadModule("a host or per-head weight where the hybrid placement runs one device matrix".into())),
    }
}

/// Where the time of hybrid passes went, as the host saw it.
#[derive(Clone, Copy, Debug, Default)]
pub struct HybridTimings {
    /// Running routed experts on the CPU pool.
    pub cpu_moe: Duration,
    /// Blocked on the device (routes, expert inputs, logits).
    pub device_wait: Duration,
    /// The device's compute time, where it keeps count.
    pub device_busy: Option<Duration>,
    /// Sequences in each micro-batch (the second empty when unsplit).
    pub micro_batches: [usize; 2],
    /// What the expert cache did (all zero without one).
    pub cache: CacheStats,
    /// Steps launched as graphs: through a graph made anew, and through
    /// one kept for their shape and updated in place.
    pub graphs_instantiated: u64,
    pub graphs_updated: u64,
    /// Capturing graph steps and launching them: host time before the
    /// device can start the step (queued without a graph, it starts on the
    /// first command).
    pub graph_capture: Duration,
}

impl std::ops::AddAssign for HybridTimings {
    fn add_assign(&mut self, o: Self) {
        self.cpu_moe += o.cpu_moe;
        self.device_wait += o.device_wait;
        self.device_busy = match (self.device_busy, o.device_busy) {
            (Some(a), Some(b)) => Some(a + b),
            (a, b) => a.or(b),
        };
        self.micro_batches = [self.micro_batches[0] + o.micro_batches[0], self.micro_batches[1] + o.micro_batches[1]];
        self.cache += o.cache;
        self.graphs_instantiated += o.graphs_instantiated;
        self.graphs_updated += o.graphs_updated;
        self.graph_capture += o.graph_capture;
    }
}

/// One sequence's blocks in the device KV pool, parallel to its host table:
/// device block `i` holds the positions of host block `i`.
#[derive(Debug)]
pub struct DeviceSeq {
    blocks: Vec<u32>,
    /// The block ids, on the device.
    ids: DevicePtr,
    /// Completed when the admission's copies have landed.
    ready: Event,
}

impl DeviceSeq {
    pub fn blocks(&self) -> usize {
        self.blocks.len()
    }
}

/// The device KV pool: blocks of `block_size` positions for every layer, as
/// the host's [`KvPool`] lays them out, handed out whole to sequences.
pub struct DeviceKv {
    kv: PagedKv,
    free: Vec<u32>,
    total: usize,
}

impl DeviceKv {
    /// Bytes of one block (every layer's entries for `block_size` positions).
    pub fn block_bytes(n_layers: usize, block_size: usize, entry_dim: usize) -> usize {
        n_layers * block_size * entry_dim * 4
    }

    fn new(pool: DevicePtr, n_blocks: usize, n_layers: usize, block_size: usize, entry_dim: usize) -> Self {
        DeviceKv { kv: PagedKv { pool, n_layers, block_size, entry_dim }, free: (0..n_blocks as u32).rev().collect(), total: n_blocks }
    }

    pub fn free_blocks(&self) -> usize {
        self.free.len()
    }

    pub fn total_blocks(&self) -> usize {
        self.total
    }

    /// Blocks a sequence of `positions` positions takes.
    pub fn blocks_for(&self, positions: usize) -> usize {
        positions.div_ceil(self.kv.block_size)
    }
}

/// Errors of admitting a sequence to the device.
#[derive(Debug, thiserror::Error)]
pub enum AdmitError {
    #[error("the device KV pool is full: {needed} blocks needed, {free} free of {total}")]
    Full { needed: usize, free: usize, total: usize },
    #[error(transparent)]
    Device(#[from] DeviceError),
}

/// Sizes of the hybrid placement.
#[derive(Clone, Copy, Debug)]
pub struct HybridConfig {
    /// Blocks of the device KV pool; 0: as many as fit beside the resident weights.
    pub kv_blocks: usize,
    /// Split batches of two or more sequences into two micro-batches.
    pub micro_batches: bool,
    /// Expert Deferral for a batch of one decoding sequence: of each
    /// token's routed experts, this many (the lowest-weighted) run while the
    /// next layer's attention does and join the next MoE layer's output
    /// ([`Pass::defer_experts`]). 0: off (the model as trained).
    pub defer_experts: usize,
    /// A random delay before every CPU MoE, as the emulated device's
    /// jitter delays its commands (tests: it shakes out ordering bugs).
    pub cpu_jitter: Option<Jitter>,
    /// How a step's CPU experts are started and awaited.
    pub submit: Submit,
    /// A cache of routed experts in device memory (HybriMoE, DALI): each
    /// layer's activated experts then run on the device or the CPU as the
    /// assignment decides. Steps are then host-driven ([`Submit::Host`]):
    /// where an expert runs is decided on the host once its layer's routes
    /// are known.
    pub expert_cache: Option<ExpertCacheConfig>,
}

/// How a hybrid step starts the CPU's routed experts and waits for them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Submit {
    /// From the device streams (host functions), as KTransformers does: a
    /// step is queued whole, each micro-batch one ordered stream of device
    /// work; per MoE layer its stream copies the experts' input and the
    /// router's choices down, a host function hands them to the CPU, and a
    /// later one (after the shared experts) waits for the sum, which is
    /// copied up. The host thread runs the experts as they arrive and never
    /// round-trips to the device per layer.
    Stream,
    /// As `Stream`, with the step captured as one device graph (both
    /// streams, their copies, events and host functions) and launched at
    /// once. The executable graph is kept per batch shape and updated in
    /// place each step, as llama.cpp's CUDA backend does, since the
    /// context length (and so kernels' parameters) changes every step.
    /// On a device that cannot capture graphs the engine runs `Stream`,
    /// saying so at start-up. The default.
    #[default]
    Graph,
    /// From the host thread, which queues the device work layer by layer
    /// and waits on each micro-batch's routes before running its experts.
    Host,
}

/// The shape of a step, as far as its device work's topology goes: per
/// micro-batch, each sequence's new tokens and whether it starts the
/// sequence (it then attends to its fresh entries without a gather).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct StepShape {
    micro: [Vec<(usize, bool)>; 2],
    precision: Precision,
    want: Logits,
}

/// Executable graphs kept at most: a decode batch has few shapes (one per
/// batch size, more while prompts are chunked in), each a little device memory.
const MAX_GRAPHS: usize = 64;

/// What the resident weights and the KV pool take on the device.
#[derive(Clone, Copy, Debug, Default)]
pub struct DeviceBudget {
    pub embedding: usize,
    pub attention: usize,
    pub ffn: usize,
    pub head: usize,
    pub kv: usize,
    /// The expert cache's slots (cached and transient).
    pub experts: usize,
}

impl DeviceBudget {
    pub fn total(&self) -> usize {
        self.embedding + self.attention + self.ffn + self.head + self.kv + self.experts
    }
}

fn human(bytes: usize) -> String {
    format!("{:.1} MiB", bytes as f64 / (1 << 20) as f64)
}

/// A layer's modules as the hybrid placement holds them.
struct Layer {
    attention: Weights<Placed>,
    ffn: Weights<Placed>,
    /// Routed experts by index (empty for a dense layer).
    experts: Vec<Weights<Placed>>,
}

/// The model placed for hybrid decode on one device.
pub struct HybridEngine {
    pub model: Model,
    dev: Arc<dyn Device>,
    embed: Weights<Placed>,
    layers: Vec<Layer>,
    head: Weights<Placed>,
    streams: [StreamId; 2],
    copy: StreamId,
    /// Each stream's activation memory, grown when a batch needs more.
    workspaces: [Option<DevicePtr>; 2],
    /// Each stream's staging memory for the CPU experts' inputs and sums
    /// ([`Submit::Stream`]), grown likewise.
    stagings: [Option<Arc<Staging>>; 2],
    submit: Submit,
    cache: Option<RefCell<ExpertCache>>,
    kv: DeviceKv,
    micro_batches: bool,
    defer_experts: usize,
    cpu_jitter: Option<Jitter>,
    /// Counts CPU MoE calls, for the jitter's random delays.
    moe_calls: std::cell::Cell<u64>,
    budget: DeviceBudget,
    /// Where routed experts run instead of the model's CPU pool (the simulator's model of one).
    expert_pool: Option<Arc<dyn ExpertPool>>,
    /// With [`Submit::Graph`]: the executable graph kept for each step shape.
    graphs: RefCell<HashMap<StepShape, GraphExec>>,
    /// The resident weights and the KV pool, given back on drop.
    _resident: Allocations,
}

/// Where the hybrid placement runs a layer's routed experts: the host's CPU
/// pool ([`crate::cpu::CpuRuntime`]), or the simulator's model of one.
pub trait ExpertPool: Send + Sync {
    /// The summed output `[n, d]` of `jobs` (host weights) over the rows `xs` (`[n, d]`).
    fn sum(&self, xs: &[f32], n: usize, d: usize, jobs: &[ExpertJob<HostWeight>], p: Precision) -> Result<Vec<f32>, ForwardError>;
}

impl ExpertPool for crate::cpu::CpuRuntime {
    fn sum(&self, xs: &[f32], n: usize, d: usize, jobs: &[ExpertJob<HostWeight>], p: Precision) -> Result<Vec<f32>, ForwardError> {
        cpu_sum(self, xs, n, d, jobs, p)
    }
}

impl HybridEngine {
    /// Upload every module but the routed experts to `dev`, and make a
    /// device KV pool of `cfg.kv_blocks` blocks. Refuses, naming the parts,
    /// when they do not fit the device's memory.
    pub fn new(model: Model, dev: Arc<dyn Device>, cfg: HybridConfig, block_size: usize) -> Result<Self, ForwardError> {
        if let Some(why) = model.device_refusal() {
            return Err(ForwardError::Device(DeviceError::Invalid(why)));
        }
        let c = &model.cfg;
        let entry = c.kv_entry_dim();
        let modules = model.staged_modules(usize::MAX);
        let block_bytes = DeviceKv::block_bytes(c.num_hidden_layers, block_size, entry);
        let mut budget = DeviceBudget::default();
        // MLA's absorbed decode reads each head's key band transposed, as
        // the CPU does: made once on the host, resident like the rest.
        let key_bands = |layer: usize| -> &[OwnedWeight] {
            let attention = model.modules.iter().find(|m| m.kind == ModuleKind::Attention { layer });
            match attention.and_then(|m| m.weights.find("kv_b_proj.key_t")) {
                Some(HostWeight::PerHead(heads)) => heads.heads(),
                _ => &[],
            }
        };
        let band_bytes = |w: &OwnedWeight| align(w.data.len()) + if w.scales.is_empty() { 0 } else { align(w.scales.len() * 4) };
        for l in 0..c.num_hidden_layers {
            budget.attention += key_bands(l).iter().map(band_bytes).sum::<usize>();
        }
        for m in modules.iter().filter(|m| !m.is_expert()) {
            let slot = match m.kind {
                ModuleKind::Embed { .. } => &mut budget.embedding,
                ModuleKind::Attention { .. } => &mut budget.attention,
                ModuleKind::Ffn { .. } => &mut budget.ffn,
                ModuleKind::Head { .. } => &mut budget.head,
                ModuleKind::Expert { .. } => unreachable!("filtered out"),
            };
            *slot += m.device_bytes();
        }
        if let Some(ec) = cfg.expert_cache.as_ref().filter(|ec| ec.experts > 0) {
            budget.experts = ExpertCache::bytes(&model, ec.experts);
        }
        // Activations are small next to these; a tenth of the memory is left for them.
        let usable = dev.capacity() / 10 * 9;
        let kv_blocks = match cfg.kv_blocks {
            0 => usable.saturating_sub(budget.total()) / block_bytes.max(1),
            n => n,
        };
        budget.kv = kv_blocks * block_bytes;
        if kv_blocks == 0 || budget.total() > usable {
            let cache = match &cfg.expert_cache {
                Some(ec) if ec.experts > 0 => format!(", an expert cache of {} experts {}", ec.experts, human(budget.experts)),
                _ => String::new(),
            };
            return Err(ForwardError::Workspace(format!(
                "the hybrid placement does not fit the device ({}, {} usable after a tenth kept for activations): resident weights {} (embedding {}, attention {}, dense FFNs, routers and shared experts {}, LM head {}){cache} and a KV pool of {} blocks {}",
                human(dev.capacity()),
                human(usable),
                human(budget.total() - budget.kv - budget.experts),
                human(budget.embedding),
                human(budget.attention),
                human(budget.ffn),
                human(budget.head),
                kv_blocks.max(1),
                human(budget.kv.max(block_bytes))
            )));
        }
        let copy = dev.create_stream(StreamKind::Copy)?;
        let streams = [dev.create_stream(StreamKind::Compute)?, dev.create_stream(StreamKind::Compute)?];
        let mut resident = Allocations { dev: dev.clone(), copy, ptrs: vec![] };
        let upload = |m: &crate::staged::StagedModule, resident: &mut Allocations| -> Result<Weights<Placed>, ForwardError> {
            let dst = dev.alloc(m.device_bytes().max(1))?;
            resident.push(dst);
            Ok(m.upload(&*dev, copy, dst)?.filter_map(|w| Some(Placed::Device(*w))))
        };
        let mut embed = Weights::default();
        let mut head = Weights::default();
        let mut layers: Vec<Layer> = (0..c.num_hidden_layers).map(|_| Layer { attention: Weights::default(), ffn: Weights::default(), experts: vec![] }).collect();
        for m in modules.iter().filter(|m| !m.is_expert()) {
            let w = upload(m, &mut resident)?;
            match m.kind {
                ModuleKind::Embed { .. } => embed = w,
                ModuleKind::Head { .. } => head = w,
                ModuleKind::Attention { layer } => {
                    let mut w = w;
                    let heads = key_bands(layer);
                    if !heads.is_empty() {
                        let dst = dev.alloc(heads.iter().map(band_bytes).sum::<usize>().max(1))?;
                        resident.push(dst);
                        let mut offset = 0;
                        let mut placed = Vec::with_capacity(heads.len());
                        for band in heads {
                            // One tensor staged as a module is placed as any other.
                            let module = crate::staged::StagedModule { kind: m.kind, tensors: Weights::default().with("key_t", owned_tensor(band)) };
                            let uploaded = module.upload(&*dev, copy, dst.slice(offset, band_bytes(band))?)?;
                            offset += band_bytes(band);
                            placed.push(*uploaded.get("key_t")?);
                        }
                        w.push("kv_b_proj.key_t", Placed::PerHead(placed));
                    }
                    layers[layer].attention = w;
                }
                ModuleKind::Ffn { layer } => layers[layer].ffn = w,
                ModuleKind::Expert { .. } => unreachable!("filtered out"),
            }
        }
        for m in &model.modules {
            if let ModuleKind::Expert { layer, expert } = m.kind {
                let experts = &mut layers[layer].experts;
                if experts.len() != expert {
                    return Err(ForwardError::BadModule(format!("expert {expert} of layer {layer} out of order")));
                }
                experts.push(m.weights.filter_map(|w| Some(Placed::Host(w.clone()))));
            }
        }
        let pool = dev.alloc(budget.kv)?;
        resident.push(pool);
        let kv = DeviceKv::new(pool, kv_blocks, c.num_hidden_layers, block_size, entry);
        // The weights must be in place before the first pass reads them.
        let done = dev.record(copy)?;
        dev.synchronize(&done)?;
        let cache = match cfg.expert_cache.filter(|ec| ec.experts > 0) {
            Some(ec) => {
                let memory = dev.alloc(budget.experts)?;
                resident.push(memory);
                let cost = profile_costs(&model, &*dev, streams[0], copy, memory)?;
                let mut cache = ExpertCache::new(&model, &*dev, memory, ec, cost)?;
                if cache.config().prefetch == PrefetchKind::Residual {
                    calibrate_residuals(&model, &mut cache)?;
                }
                Some(RefCell::new(cache))
            }
            None => None,
        };
        let submit = match cfg.submit {
            Submit::Graph => match can_capture(&*dev, streams[0]) {
                Ok(()) => Submit::Graph,
                Err(e) => {
                    tracing::warn!(device = %dev.describe(), error = %e, "this device cannot capture decode steps as graphs: they are queued on its streams instead (expert_submit = \"stream\")");
                    Submit::Stream
                }
            },
            other => other,
        };
        Ok(HybridEngine { model, dev, embed, layers, head, streams, copy, workspaces: [None, None], stagings: [None, None], submit, cache, kv, micro_batches: cfg.micro_batches, defer_experts: cfg.defer_experts, cpu_jitter: cfg.cpu_jitter, moe_calls: Default::default(), budget, expert_pool: None, graphs: RefCell::default(), _resident: resident })
    }

    /// Run the routed experts on `pool` instead of the model's CPU pool
    /// (the simulator's model of a CPU).
    pub fn set_expert_pool(&mut self, pool: Arc<dyn ExpertPool>) {
        self.expert_pool = Some(pool);
    }

    fn expert_pool(&self) -> &dyn ExpertPool {
        self.expert_pool.as_deref().unwrap_or(&self.model.cpu)
    }

    /// How steps are submitted: the configured way, or [`Submit::Stream`]
    /// where [`Submit::Graph`] was asked of a device that cannot capture.
    pub fn submit(&self) -> Submit {
        self.submit
    }

    pub fn budget(&self) -> DeviceBudget {
        self.budget
    }

    pub fn kv(&self) -> &DeviceKv {
        &self.kv
    }

    pub fn device(&self) -> &Arc<dyn Device> {
        &self.dev
    }

    /// The expert cache, where there is one.
    pub fn expert_cache(&self) -> Option<std::cell::Ref<'_, ExpertCache>> {
        self.cache.as_ref().map(RefCell::borrow)
    }

    /// Give a sequence of up to `positions` positions its device blocks and
    /// copy in the entries its host table holds (`table.len` positions),
    /// asynchronously: passes wait for the copies on the device, not here.
    pub fn admit(&mut self, host: &KvPool, table: &BlockTable, positions: usize) -> Result<DeviceSeq, AdmitError> {
        let needed = self.kv.blocks_for(positions.max(table.len)).max(1);
        if needed > self.kv.free.len() {
            return Err(AdmitError::Full { needed, free: self.kv.free.len(), total: self.kv.total });
        }
        let ids = self.dev.alloc(needed * 4)?;
        let blocks: Vec<u32> = (0..needed).map(|_| self.kv.free.pop().expect("counted above")).collect();
        let upload = || -> Result<Event, DeviceError> {
            self.dev.upload(self.copy, &HostBytes::from_u32(&blocks), ids)?;
            let kv = self.kv.kv;
            let block_bytes = DeviceKv::block_bytes(kv.n_layers, kv.block_size, kv.entry_dim);
            for (i, &b) in table.blocks.iter().take(table.len.div_ceil(kv.block_size)).enumerate() {
                let dst = kv.pool.slice(blocks[i] as usize * block_bytes, block_bytes)?;
                self.dev.upload(self.copy, &HostBytes::from_f32(host.block(b)), dst)?;
            }
            self.dev.record(self.copy)
        };
        match upload() {
            Ok(ready) => Ok(DeviceSeq { blocks, ids, ready }),
            Err(e) => {
                // Nothing may still write them: wait for the copy stream before handing them back.
                if let Ok(ev) = self.dev.record(self.copy) {
                    let _ = self.dev.synchronize(&ev);
                }
                self.kv.free.extend(blocks);
                let _ = self.dev.free(ids);
                Err(e.into())
            }
        }
    }

    /// Copy the entries of `seq`'s blocks `blocks` (indices into its table)
    /// back into `table`'s host blocks, so that the prefix cache can share
    /// them: what the steps compute lives in device blocks only. Call it
    /// between steps; every pass has ended by then (each ends in a download).
    pub fn write_back(&mut self, host: &mut KvPool, table: &BlockTable, seq: &DeviceSeq, blocks: Range<usize>) -> Result<(), DeviceError> {
        let kv = self.kv.kv;
        let block_bytes = DeviceKv::block_bytes(kv.n_layers, kv.block_size, kv.entry_dim);
        for i in blocks {
            let (Some(&on_device), Some(&on_host)) = (seq.blocks.get(i), table.blocks.get(i)) else {
                return Err(DeviceError::Invalid(format!("block {i} of a sequence with {} device and {} host blocks", seq.blocks.len(), table.blocks.len())));
            };
            let bytes = self.dev.download(self.copy, kv.pool.slice(on_device as usize * block_bytes, block_bytes)?)?;
            for (dst, src) in host.block_mut(on_host).iter_mut().zip(bytes.chunks_exact(4)) {
                *dst = f32::from_le_bytes([src[0], src[1], src[2], src[3]]);
            }
        }
        Ok(())
    }

    /// Give a sequence's blocks back (on every exit path of a sequence).
    /// The blocks return to the pool even when the device reports an error.
    pub fn release(&mut self, seq: DeviceSeq) -> Result<(), DeviceError> {
        // Its admission copies may still be running (a request cancelled at once).
        let landed = self.dev.synchronize(&seq.ready);
        self.kv.free.extend(seq.blocks);
        landed.and(self.dev.free(seq.ids))
    }

    /// Workspace of at least `bytes` for stream `i`.
    fn workspace(&mut self, i: usize, bytes: usize) -> Result<DevicePtr, ForwardError> {
        match self.workspaces[i] {
            Some(w) if w.bytes >= bytes => Ok(w),
            old => {
                if let Some(w) = old {
                    // The stream's earlier passes have finished: each ends in a download.
                    self.dev.free(w)?;
                    self.workspaces[i] = None;
                }
                // Room to spare, so that growing contexts do not reallocate every step.
                let w = self.dev.alloc(align(bytes + bytes / 2))?;
                self.workspaces[i] = Some(w);
                Ok(w)
            }
        }
    }

    /// One step over `seqs` (whose device blocks are `dseqs`, in the same
    /// order): the logits their passes want, in order, and where the host's
    /// time went.
    pub fn forward(&mut self, host: &mut KvPool, seqs: &mut [SeqInput], dseqs: &[&DeviceSeq], precision: Precision, want: Logits) -> Result<(Vec<f32>, HybridTimings), ForwardError> {
        if seqs.len() != dseqs.len() {
            return Err(ForwardError::BadModule(format!("{} sequences with {} device tables", seqs.len(), dseqs.len())));
        }
        for (s, d) in seqs.iter().zip(dseqs) {
            let end = s.table.len + s.tokens.len();
            if end > d.blocks.len() * self.kv.kv.block_size {
                return Err(ForwardError::Workspace(format!("a sequence reaches position {end} but holds {} device blocks", d.blocks.len())));
            }
        }
        let busy_before = self.dev.compute_busy();
        let split = if self.micro_batches && seqs.len() >= 2 { seqs.len().div_ceil(2) } else { seqs.len() };
        let (a, b) = seqs.split_at_mut(split);
        let (da, db) = dseqs.split_at(split);
        let wa = self.pass_workspace(0, a, want)?;
        let wb = if b.is_empty() { None } else { Some(self.pass_workspace(1, b, want)?) };
        let submit = if self.cache.is_some() { Submit::Host } else { self.submit };
        let (logits, mut timings) = match submit {
            Submit::Host => self.step_host(host, (a, da, wa), (b, db, wb), precision, want)?,
            Submit::Stream | Submit::Graph => {
                let n = |seqs: &[SeqInput]| seqs.iter().map(|s| s.tokens.len()).sum::<usize>();
                let sa = self.staging(0, n(a))?;
                let sb = if b.is_empty() { None } else { Some(self.staging(1, n(b))?) };
                let shape = |seqs: &[SeqInput]| seqs.iter().map(|s| (s.tokens.len(), s.table.len == 0)).collect();
                let graph = (submit == Submit::Graph).then(|| StepShape { micro: [shape(a), shape(b)], precision, want });
                self.step_streamed(host, (a, da, wa, sa), (b, db, wb, sb), precision, want, graph)?
            }
        };
        timings.micro_batches = [a.len(), b.len()];
        if let Some(cache) = &self.cache {
            timings.cache = cache.borrow_mut().take_stats(&*self.dev);
        }
        timings.device_busy = busy_before.zip(self.dev.compute_busy()).map(|(before, after)| after.saturating_sub(before));
        Ok((logits, timings))
    }

    /// One step with [`Submit::Host`]: this thread queues both micro-batches'
    /// device work layer by layer and runs their experts in between.
    #[allow(clippy::type_complexity)]
    fn step_host(&self, host: &mut KvPool, (a, da, wa): (&mut [SeqInput], &[&DeviceSeq], DevicePtr), (b, db, wb): (&mut [SeqInput], &[&DeviceSeq], Option<DevicePtr>), precision: Precision, want: Logits) -> Result<(Vec<f32>, HybridTimings), ForwardError> {
        let mut pa = self.pass(host, a, da, wa, self.streams[0], precision, want, None)?;
        let mut pb = match wb {
            Some(w) => Some(self.pass(host, b, db, w, self.streams[1], precision, want, None)?),
            None => None,
        };
        if pb.is_none() && seqs_decoding(a) {
            pa.defer_experts(self.defer_experts);
        }
        let me = self;
        pa.run(ModuleKind::Embed { first_row: 0 }, &me.embed, host)?;
        if let Some(pb) = pb.as_mut() {
            pb.run(ModuleKind::Embed { first_row: 0 }, &me.embed, host)?;
        }
        // A waits for its routes (only its own work is queued then), and
        // runs its experts on the CPU while the device runs B's attention,
        // queued just before; then the same with the roles swapped, the
        // device running A's next attention. (B's attention queued before
        // A's routes made A's wait include it, and left the device idle
        // during A's experts: 0.62 of overlap against 0.82 at batch 2 in
        // `duplex bench-decode`.)
        pa.run(ModuleKind::Attention { layer: 0 }, &me.layers[0].attention, host)?;
        for (l, layer) in me.layers.iter().enumerate() {
            pa.run(ModuleKind::Ffn { layer: l }, &layer.ffn, host)?;
            if let Some(pb) = pb.as_mut() {
                pb.run(ModuleKind::Attention { layer: l }, &layer.attention, host)?;
            }
            Self::experts(&mut pa, l, layer)?;
            if let Some(pb) = pb.as_mut() {
                pb.run(ModuleKind::Ffn { layer: l }, &layer.ffn, host)?;
            }
            match me.layers.get(l + 1) {
                Some(next) => pa.run(ModuleKind::Attention { layer: l + 1 }, &next.attention, host)?,
                // A's LM head runs on the device during B's last experts.
                None => pa.run(ModuleKind::Head { first_row: 0 }, &me.head, host)?,
            }
            // Deferred experts (one sequence alone) run while the device
            // runs the next layer's attention, queued just above.
            if pb.is_none() && self.defer_experts > 0 {
                pa.run_deferred(&Self::group(layer))?;
            }
            if let Some(pb) = pb.as_mut() {
                Self::experts(pb, l, layer)?;
            }
        }
        if let Some(pb) = pb.as_mut() {
            pb.run(ModuleKind::Head { first_row: 0 }, &me.head, host)?;
        }
        Self::finish(pa, pb, a, b)
    }

    /// One step with [`Submit::Stream`]: each micro-batch's whole pass is
    /// queued on its stream at once, then this thread runs the CPU experts
    /// that the streams hand it, in the order they arrive, until every MoE
    /// layer of both has had its experts. With `graph` (the step's shape,
    /// [`Submit::Graph`]) the queued work is captured and launched as one graph.
    #[allow(clippy::type_complexity, clippy::too_many_arguments)]
    fn step_streamed(&self, host: &mut KvPool, (a, da, wa, sa): (&mut [SeqInput], &[&DeviceSeq], DevicePtr, Arc<Staging>), (b, db, wb, sb): (&mut [SeqInput], &[&DeviceSeq], Option<DevicePtr>, Option<Arc<Staging>>), precision: Precision, want: Logits, graph: Option<StepShape>) -> Result<(Vec<f32>, HybridTimings), ForwardError> {
        let (tasks, arrivals) = mpsc::channel();
        let board = Arc::new(Board::default());
        let streamed = |micro: usize, staging: &Arc<Staging>| Some(Streamed { micro, staging: staging.clone(), tasks: tasks.clone(), board: board.clone(), next_offset: 0, current: None, submitted: 0, handed: None });
        let mut pa = self.pass(host, a, da, wa, self.streams[0], precision, want, streamed(0, &sa))?;
        let mut pb = match (wb, &sb) {
            (Some(w), Some(st)) => Some(self.pass(host, b, db, w, self.streams[1], precision, want, streamed(1, st))?),
            _ => None,
        };
        let stagings = [Some(sa), sb];
        if pb.is_none() && seqs_decoding(a) {
            pa.defer_experts(self.defer_experts);
        }
        let defer = pb.is_none() && self.defer_experts > 0;
        let mut timings = HybridTimings::default();
        let queued = match graph {
            None => self.queue_step(&mut pa, pb.as_mut(), host, defer),
            Some(shape) => {
                let started = Instant::now();
                let launched = self.queue_step_as_graph(&mut pa, pb.as_mut(), host, defer, shape);
                timings.graph_capture = started.elapsed();
                launched.map(|launch| match launch {
                    GraphLaunch::Instantiated => timings.graphs_instantiated += 1,
                    GraphLaunch::Updated => timings.graphs_updated += 1,
                })
            }
        };
        let ends = [Some(&pa), pb.as_ref()].into_iter().flatten().map(|p| self.dev.record(p.backend.dev.stream)).collect::<Result<Vec<_>, _>>();
        let expected = pa.backend.streamed.as_ref().map_or(0, |s| s.submitted) + pb.as_ref().and_then(|p| p.backend.streamed.as_ref()).map_or(0, |s| s.submitted);
        let served = match (queued, ends) {
            (Ok(()), Ok(ends)) => self.serve_experts(&arrivals, &stagings, expected, &board, &ends, precision, &mut timings),
            (Err(e), _) => Err(e),
            (_, Err(e)) => Err(e.into()),
        };
        if let Err(e) = served {
            // Let the streams run to their end (their waits now pass) before
            // the pass's memory can be reused.
            board.abort();
            for stream in self.streams {
                if let Ok(done) = self.dev.record(stream) {
                    let _ = self.dev.synchronize(&done);
                }
            }
            return Err(e);
        }
        let (logits, passes) = Self::finish(pa, pb, a, b)?;
        timings += passes;
        Ok((logits, timings))
    }

    /// [`Self::queue_step`] captured on A's stream (B's forked from it by an
    /// event and joined back) and launched as one graph, through the
    /// executable graph kept for `shape`. A capture that fails is
    /// discarded: nothing of it runs.
    fn queue_step_as_graph(&self, pa: &mut Pass<HybridBackend>, pb: Option<&mut Pass<HybridBackend>>, host: &mut KvPool, defer: bool, shape: StepShape) -> Result<GraphLaunch, ForwardError> {
        let (dev, a) = (&*self.dev, pa.backend.dev.stream);
        let b = pb.as_ref().map(|p| p.backend.dev.stream);
        // The graph runs on A: after B's own work so far (its pass's uploads).
        if let Some(b) = b {
            dev.wait_event(a, &dev.record(b)?)?;
        }
        dev.begin_capture(a)?;
        let captured = (|| -> Result<(), ForwardError> {
            if let Some(b) = b {
                dev.wait_event(b, &dev.record(a)?)?;
            }
            self.queue_step(pa, pb, host, defer)?;
            if let Some(b) = b {
                dev.wait_event(a, &dev.record(b)?)?;
            }
            Ok(())
        })();
        let ended = dev.end_capture(a);
        captured?;
        let graph = ended?;
        let mut graphs = self.graphs.borrow_mut();
        let mut exec = graphs.remove(&shape);
        if graphs.len() >= MAX_GRAPHS {
            graphs.clear();
        }
        let launched = dev.launch_graph(a, graph, &mut exec)?;
        if let Some(exec) = exec {
            graphs.insert(shape, exec);
        }
        // B's later work (its logits' download) waits for the whole graph.
        if let Some(b) = b {
            dev.wait_event(b, &dev.record(a)?)?;
        }
        Ok(launched)
    }

    /// The logits of both micro-batches' passes, in order (each pass ends in
    /// its stream's download of them), and their backends' timings.
    fn finish(pa: Pass<HybridBackend>, pb: Option<Pass<HybridBackend>>, a: &mut [SeqInput], b: &mut [SeqInput]) -> Result<(Vec<f32>, HybridTimings), ForwardError> {
        let mut tables: Vec<&mut BlockTable> = a.iter_mut().map(|s| &mut *s.table).collect();
        let (mut logits, backend, _) = pa.finish(&mut tables)?;
        let mut timings = backend.timings;
        if let Some(pb) = pb {
            let mut tables: Vec<&mut BlockTable> = b.iter_mut().map(|s| &mut *s.table).collect();
            let (more, backend, _) = pb.finish(&mut tables)?;
            logits.extend(more);
            timings += backend.timings;
        }
        Ok((logits, timings))
    }

    /// Queue a whole step on the streams, in the host schedule's order, with
    /// the same alternation made by events instead of by this thread: B's
    /// attention of a layer waits until A has handed that layer's experts
    /// to the CPU (so the device runs it while the CPU runs A's experts),
    /// and A's next attention until B has handed over its own. Without
    /// them both streams would share the device from the start and reach
    /// their routes late together, leaving the CPU idle (0.92× the
    /// host-driven throughput at batch 2 in `duplex bench-decode`).
    fn queue_step(&self, pa: &mut Pass<HybridBackend>, mut pb: Option<&mut Pass<HybridBackend>>, host: &mut KvPool, defer: bool) -> Result<(), ForwardError> {
        pa.run(ModuleKind::Embed { first_row: 0 }, &self.embed, host)?;
        if let Some(pb) = pb.as_deref_mut() {
            pb.run(ModuleKind::Embed { first_row: 0 }, &self.embed, host)?;
        }
        pa.run(ModuleKind::Attention { layer: 0 }, &self.layers[0].attention, host)?;
        for (l, layer) in self.layers.iter().enumerate() {
            pa.run(ModuleKind::Ffn { layer: l }, &layer.ffn, host)?;
            Self::experts(pa, l, layer)?;
            if let Some(pb) = pb.as_deref_mut() {
                self.follow(pb, pa)?;
                pb.run(ModuleKind::Attention { layer: l }, &layer.attention, host)?;
                pb.run(ModuleKind::Ffn { layer: l }, &layer.ffn, host)?;
                Self::experts(pb, l, layer)?;
                self.follow(pa, pb)?;
            }
            match self.layers.get(l + 1) {
                Some(next) => pa.run(ModuleKind::Attention { layer: l + 1 }, &next.attention, host)?,
                None => pa.run(ModuleKind::Head { first_row: 0 }, &self.head, host)?,
            }
            // Deferred experts after the next layer's attention, as the host schedule runs them.
            if defer {
                pa.run_deferred(&Self::group(layer))?;
            }
        }
        if let Some(pb) = pb {
            pb.run(ModuleKind::Head { first_row: 0 }, &self.head, host)?;
        }
        Ok(())
    }

    /// Make `waiter`'s stream wait until `leader` has handed its latest MoE
    /// layer to the host (nothing after a dense layer).
    fn follow(&self, waiter: &Pass<HybridBackend>, leader: &mut Pass<HybridBackend>) -> Result<(), ForwardError> {
        if let Some(handed) = leader.backend.streamed.as_mut().and_then(|s| s.handed.take()) {
            self.dev.wait_event(waiter.backend.dev.stream, &handed)?;
        }
        Ok(())
    }

    /// Run the CPU experts the streams hand over until `expected` have
    /// arrived. Stops with the device's error if it fails (its streams may
    /// then never get to their host functions).
    #[allow(clippy::too_many_arguments)]
    fn serve_experts(&self, arrivals: &mpsc::Receiver<MoeTask>, stagings: &[Option<Arc<Staging>>; 2], expected: usize, board: &Board, ends: &[Event], p: Precision, timings: &mut HybridTimings) -> Result<(), ForwardError> {
        for _ in 0..expected {
            let waited = Instant::now();
            let task = loop {
                match arrivals.recv_timeout(Duration::from_millis(20)) {
                    Ok(task) => break task,
                    Err(mpsc::RecvTimeoutError::Timeout) => {
                        let mut finished = true;
                        for end in ends {
                            finished &= self.dev.query(end)?;
                        }
                        if finished {
                            return Err(ForwardError::BadModule("the device streams finished without handing over every MoE layer's experts".into()));
                        }
                    }
                    Err(mpsc::RecvTimeoutError::Disconnected) => return Err(ForwardError::BadModule("the passes stopped handing over experts".into())),
                }
            };
            timings.device_wait += waited.elapsed();
            task.handed.join();
            let staging = stagings[task.micro].as_ref().ok_or_else(|| ForwardError::BadModule(format!("no staging for micro-batch {}", task.micro)))?;
            self.cpu_task(&task, staging, board, p, timings)?;
        }
        Ok(())
    }

    /// One MoE layer's routed experts on the CPU pool, from what the stream
    /// copied into the staging: the immediate experts' sum, then (Expert
    /// Deferral) the deferred ones', each marked done on the board as it lands.
    fn cpu_task(&self, t: &MoeTask, staging: &Staging, board: &Board, p: Precision, timings: &mut HybridTimings) -> Result<(), ForwardError> {
        let c = &self.model.cfg;
        let (n, d, k) = (t.rows, c.hidden_size, c.num_experts_per_tok);
        let layout = SlotLayout::new(n, d, k);
        let (xs, chosen) = {
            let bytes = staging.lock();
            let slot = &bytes[t.offset..t.offset + layout.bytes];
            let word = |i: usize| [slot[4 * i], slot[4 * i + 1], slot[4 * i + 2], slot[4 * i + 3]];
            let xs: Vec<f32> = (0..n * d).map(|i| f32::from_le_bytes(word(i))).collect();
            let chosen: Vec<Vec<(usize, f32)>> = (0..n)
                .map(|r| (0..k).map(|j| (u32::from_le_bytes(word(n * d + r * k + j)) as usize, f32::from_le_bytes(word(n * d + n * k + r * k + j)))).collect())
                .collect();
            (xs, chosen)
        };
        if let Some(j) = self.cpu_jitter {
            std::thread::sleep(jitter_delay(j, &self.moe_calls));
        }
        let started = Instant::now();
        let mut routing = Assignment::default();
        routing.assign(&chosen, c.n_routed_experts, t.defer)?;
        let group = Self::group(&self.layers[t.layer]);
        let mut sums = vec![(false, t.now, layout.sum)];
        if let Some(id) = t.deferred {
            sums.push((true, id, layout.deferred_sum));
        }
        for (deferred, id, at) in sums {
            let (_, host) = split_jobs(&routing.jobs(&group, deferred)?)?;
            let sum = self.expert_pool().sum(&xs, n, d, &host, p)?;
            let mut bytes = staging.lock();
            for (o, v) in bytes[t.offset + at..][..4 * n * d].chunks_exact_mut(4).zip(&sum) {
                o.copy_from_slice(&v.to_le_bytes());
            }
            drop(bytes);
            board.finish(id);
        }
        timings.cpu_moe += started.elapsed();
        Ok(())
    }

    /// Staging for stream `i`'s CPU experts: one slot per MoE layer for a
    /// pass of `n` tokens.
    fn staging(&mut self, i: usize, n: usize) -> Result<Arc<Staging>, ForwardError> {
        let c = &self.model.cfg;
        let slots = (0..c.num_hidden_layers).filter(|&l| c.is_moe_layer(l)).count();
        let bytes = slots * SlotLayout::new(n, c.hidden_size, c.num_experts_per_tok).bytes;
        match &self.stagings[i] {
            Some(st) if st.len() >= bytes => Ok(st.clone()),
            _ => {
                // Room to spare, as for the workspaces.
                let st = self.dev.staging(bytes + bytes / 2)?;
                self.stagings[i] = Some(st.clone());
                Ok(st)
            }
        }
    }

    fn experts(pass: &mut Pass<HybridBackend>, layer: usize, w: &Layer) -> Result<(), ForwardError> {
        if w.experts.is_empty() {
            return Ok(());
        }
        pass.run_experts(layer, &Self::group(w))
    }

    /// A layer's routed experts with their indices.
    fn group(w: &Layer) -> Vec<(usize, &Weights<Placed>)> {
        w.experts.iter().enumerate().collect()
    }

    fn pass_workspace(&mut self, i: usize, seqs: &[SeqInput], want: Logits) -> Result<DevicePtr, ForwardError> {
        let shape = Pass::<HybridBackend>::shape(&self.model.cfg, seqs.iter().map(|s| (s.table.len, s.tokens.len())), want, EXPANDED_BYTES)?;
        self.workspace(i, crate::forward::workspace_bytes(&self.model.cfg, shape))
    }

    #[allow(clippy::too_many_arguments)]
    fn pass<'e>(&'e self, host: &mut KvPool, seqs: &mut [SeqInput], dseqs: &[&DeviceSeq], workspace: DevicePtr, stream: StreamId, precision: Precision, want: Logits, streamed: Option<Streamed>) -> Result<Pass<'e, HybridBackend<'e>>, ForwardError> {
        let mut tables = Vec::with_capacity(seqs.len());
        let mut row = 0;
        for (s, d) in seqs.iter().zip(dseqs) {
            // The admission's copies land before this stream reads the blocks.
            self.dev.wait_event(stream, &d.ready)?;
            tables.push(SeqTable { row, ids: d.ids, blocks: d.blocks.len() });
            row += s.tokens.len();
        }
        let backend = HybridBackend {
            dev: DeviceBackend::new(&*self.dev, stream, workspace),
            cpu: self.expert_pool(),
            kv: self.kv.kv,
            tables,
            host_copies: vec![],
            timings: HybridTimings::default(),
            jitter: self.cpu_jitter.map(|j| (j, &self.moe_calls)),
            streamed,
            cache: self.cache.as_ref(),
            model: &self.model,
            copy: self.copy,
            moe_layer: 0,
            routed_input: None,
            hidden: None,
        };
        Pass::new(&self.model, backend, host, seqs, precision, want, EXPANDED_BYTES)
    }
}

impl Drop for HybridEngine {
    fn drop(&mut self) {
        // (The resident allocations go back with `_resident`.)
        for w in self.workspaces.iter_mut().filter_map(Option::take) {
            let _ = self.dev.free(w);
        }
    }
}

/// The expert cache's cost model, measured on this machine: routed experts
/// copied to the device, and run there and on the CPU pool at 1 and 8
/// tokens, fitted as fixed + per-token times. Each timing is the best of
/// five after one to warm up (the pool's threads wake slowly from a sleep,
/// and another tenant of the cores can take one), and each run reads
/// another expert, as a decode step does: one expert read over and over
/// would be timed from the cache, not from memory. BF16, the precision the
/// decode worker runs by default.
fn profile_costs(model: &Model, dev: &dyn Device, stream: StreamId, copy: StreamId, memory: DevicePtr) -> Result<CostModel, ForwardError> {
    let c = &model.cfg;
    let (d, inter, p) = (c.hidden_size, c.moe_intermediate_size, Precision::Bf16);
    let layer = (0..c.num_hidden_layers).find(|&l| c.is_moe_layer(l)).ok_or_else(|| ForwardError::BadModule("no MoE layer to profile".into()))?;
    let slot_bytes = crate::device_experts::expert_slot_bytes(model).ok_or_else(|| ForwardError::BadModule("no routed expert to profile".into()))?;
    let staged: Vec<crate::staged::StagedModule> = model.staged_modules(usize::MAX).into_iter().filter(|m| matches!(m.kind, ModuleKind::Expert { layer: l, .. } if l == layer)).collect();
    let host: Vec<&crate::model::Module> = model.modules.iter().filter(|m| matches!(m.kind, ModuleKind::Expert { layer: l, .. } if l == layer)).collect();
    let distinct = staged.len().min(host.len()).min(memory.bytes / slot_bytes).min(6);
    if distinct == 0 {
        return Err(ForwardError::BadModule("no routed expert to profile".into()));
    }
    let best = |f: &mut dyn FnMut(usize) -> Result<Duration, ForwardError>| -> Result<f64, ForwardError> {
        f(0)?;
        let mut best = f64::MAX;
        for run in 1..=5 {
            best = best.min(f(run % distinct)?.as_secs_f64());
        }
        Ok(best)
    };
    let timed = |stream: StreamId, f: &mut dyn FnMut() -> Result<(), ForwardError>| -> Result<Duration, ForwardError> {
        let before = dev.record(stream)?;
        f()?;
        let after = dev.record(stream)?;
        dev.synchronize(&after)?;
        Ok(dev.elapsed(&before, &after)?)
    };
    let mut weights = vec![None; distinct];
    for (i, w) in weights.iter_mut().enumerate() {
        *w = Some(ExpertCache::upload_expert(dev, copy, &staged[i], memory.slice(i * slot_bytes, slot_bytes)?)?);
    }
    let transfer = best(&mut |i| timed(copy, &mut || ExpertCache::upload_expert(dev, copy, &staged[i], memory.slice(i * slot_bytes, slot_bytes)?).map(|_| ())))?;
    let weights: Vec<crate::device_experts::SlotWeights> = weights.into_iter().flatten().collect();
    let t = 8;
    let scratch_bytes = [t * d, t * d, t, t, t * d, t * inter, t * inter, t * d].iter().map(|n| align(n * 4)).sum::<usize>();
    let ws = dev.alloc(scratch_bytes)?;
    let measured = (|| -> Result<[f64; 4], ForwardError> {
        let mut offset = 0;
        let mut next = |rows: usize, cols: usize| -> Result<Matrix, ForwardError> {
            let m = ws.slice(offset, rows * cols * 4)?.matrix(rows, cols);
            offset += align(rows * cols * 4);
            Ok(m)
        };
        let (x, out) = (next(t, d)?, next(t, d)?);
        let s = ExpertScratch { rows: next(t, 1)?.buf, scales: next(t, 1)?.buf, xe: next(t, d)?, gate: next(t, inter)?, up: next(t, inter)?, ye: next(t, d)? };
        let mut backend = DeviceBackend::new(dev, stream, ws);
        backend.zero(x)?;
        let xs = vec![0.01f32; t * d];
        let mut times = [0.0; 4];
        for (i, n) in [1usize, t].into_iter().enumerate() {
            let rows: Vec<(usize, f32)> = (0..n).map(|r| (r, 1.0)).collect();
            let tokens = crate::backend::Tokens::Rows(&rows);
            times[i] = best(&mut |e| {
                let w = &weights[e];
                let job = ExpertJob { gate: &w.gate, up: &w.up, down: &w.down, tokens, first: 0, expert: e };
                timed(stream, &mut || backend.experts(x, std::slice::from_ref(&job), out, p, &s))
            })?;
            times[2 + i] = best(&mut |e| {
                let job = ExpertJob::named(&host[e].weights, "", tokens, 0, e)?;
                let started = Instant::now();
                cpu_sum(&model.cpu, &xs[..n * d], n, d, std::slice::from_ref(&job), p)?;
                Ok(started.elapsed())
            })?;
        }
        Ok(times)
    })();
    // Its work has finished (each timing synchronized), or failed.
    dev.free(ws)?;
    let [dev1, dev8, cpu1, cpu8] = measured?;
    let per = |one: f64, many: f64| ((many - one) / (t - 1) as f64).max(0.0);
    let (device_per_token, cpu_per_token) = (per(dev1, dev8), per(cpu1, cpu8));
    Ok(CostModel { cpu_fixed: (cpu1 - cpu_per_token).max(0.0), cpu_per_token, device_fixed: (dev1 - device_per_token).max(0.0), device_per_token, transfer })
}

/// DALI's residual vectors, computed by the engine itself: the CPU engine
/// runs a calibration sequence (seeded pseudo-random token ids: the engine
/// has no tokenizer, and the mean change of the hidden state is what is
/// wanted, not any one text) and, per MoE layer, averages how the FFN's
/// input hidden state changes from it to the next MoE layer's.
fn calibrate_residuals(model: &Model, cache: &mut ExpertCache) -> Result<(), ForwardError> {
    let c = &model.cfg;
    let len = 128.min(c.max_position_embeddings);
    let mut state = 0x9E37_79B9_7F4A_7C15u64;
    let tokens: Vec<u32> = (0..len)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state % c.vocab_size as u64) as u32
        })
        .collect();
    let mut pool = model.new_kv_pool(len.div_ceil(16), 16);
    let mut table = BlockTable::default();
    let mut seqs = [SeqInput { table: &mut table, tokens: &tokens }];
    let mut pass = Pass::new(model, model.cpu.backend(), &mut pool, &mut seqs, Precision::F32, Logits::Last, usize::MAX)?;
    let mut hidden: Vec<Option<Vec<f32>>> = vec![None; c.num_hidden_layers];
    let mut i = 0;
    while i < model.modules.len() {
        let m = &model.modules[i];
        match m.kind {
            ModuleKind::Expert { layer, .. } => {
                let group = model.expert_group(i);
                i += group.len();
                pass.run_experts(layer, &group)?;
            }
            ModuleKind::Head { .. } => break,
            kind => {
                pass.run(kind, &m.weights, &mut pool)?;
                if let ModuleKind::Attention { layer } = kind {
                    if c.is_moe_layer(layer) {
                        hidden[layer] = Some(pass.hidden()?);
                    }
                }
                i += 1;
            }
        }
    }
    let moe: Vec<usize> = (0..c.num_hidden_layers).filter(|&l| c.is_moe_layer(l)).collect();
    for pair in moe.windows(2) {
        if let (Some(h), Some(next)) = (&hidden[pair[0]], &hidden[pair[1]]) {
            let d = c.hidden_size;
            let mut mean = vec![0f64; d];
            for (a, b) in h.chunks(d).zip(next.chunks(d)) {
                for ((m, x), y) in mean.iter_mut().zip(a).zip(b) {
                    *m += f64::from(y - x);
                }
            }
            cache.set_residual(pair[0], mean.iter().map(|m| (m / len as f64) as f32).collect());
        }
    }
    Ok(())
}

/// Whether `dev` can capture a graph on `stream` (an empty one, discarded).
fn can_capture(dev: &dyn Device, stream: StreamId) -> Result<(), DeviceError> {
    dev.begin_capture(stream)?;
    dev.end_capture(stream).map(drop)
}

/// Whether every sequence of a batch decodes (one new token each): Expert
/// Deferral applies to decode only, as in KTransformers.
fn seqs_decoding(seqs: &[SeqInput]) -> bool {
    seqs.iter().all(|s| s.tokens.len() == 1)
}

/// Device allocations given back when dropped: the engine's resident ones,
/// or what a start-up that fails half way allocated.
struct Allocations {
    dev: Arc<dyn Device>,
    /// The stream copying into them, waited for before they go back.
    copy: StreamId,
    ptrs: Vec<DevicePtr>,
}

impl Allocations {
    fn push(&mut self, p: DevicePtr) {
        self.ptrs.push(p);
    }
}

impl Drop for Allocations {
    fn drop(&mut self) {
        if self.ptrs.is_empty() {
            return;
        }
        if let Ok(done) = self.dev.record(self.copy) {
            let _ = self.dev.synchronize(&done);
        }
        for p in self.ptrs.drain(..) {
            let _ = self.dev.free(p);
        }
    }
}

/// A host-made weight as a device copies it.
fn owned_tensor(w: &OwnedWeight) -> HostTensor {
    let scales = (!w.scales.is_empty()).then(|| HostBytes::from_f32(&w.scales));
    HostTensor { rows: w.rows, cols: w.cols, format: w.format, data: HostBytes::new(Arc::new(w.data.clone()), 0..w.data.len()).expect("the whole vector"), scales }
}

/// What a micro-batch's stream hands the host for one MoE layer.
struct MoeTask {
    micro: usize,
    layer: usize,
    /// Tokens of the pass.
    rows: usize,
    /// Where the layer's slot starts in the micro-batch's staging.
    offset: usize,
    defer: usize,
    /// The board's entries for the immediate experts' sum and the deferred ones'.
    now: usize,
    deferred: Option<usize>,
    /// When the stream handed it over (the simulator's virtual time).
    handed: Stamp,
}

/// One MoE layer's slot in a staging: the experts' input `[n, d]`, the
/// chosen ids (u32) and weights `[n, k]` as the stream copies them down,
/// then the immediate and the deferred experts' sums `[n, d]` for it to copy up.
struct SlotLayout {
    ids: usize,
    weights: usize,
    sum: usize,
    deferred_sum: usize,
    bytes: usize,
}

impl SlotLayout {
    fn new(n: usize, d: usize, k: usize) -> Self {
        let (x, choices) = (4 * n * d, 4 * n * k);
        SlotLayout { ids: x, weights: x + choices, sum: x + 2 * choices, deferred_sum: 2 * x + 2 * choices, bytes: align(3 * x + 2 * choices) }
    }
}

/// Which CPU expert sums have landed, for the streams' host functions to
/// wait on. Aborting releases every wait (a step that failed half way must
/// still let its streams run to their end).
#[derive(Default)]
struct Board {
    state: Mutex<BoardState>,
    changed: Condvar,
}

#[derive(Default)]
struct BoardState {
    /// Per entry: done, and when (the simulator's virtual time).
    done: Vec<(bool, Stamp)>,
    aborted: bool,
}

impl Board {
    fn lock(&self) -> std::sync::MutexGuard<'_, BoardState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A new entry, not yet done.
    fn add(&self) -> usize {
        let mut st = self.lock();
        st.done.push((false, Stamp::default()));
        st.done.len() - 1
    }

    fn finish(&self, id: usize) {
        if let Some(d) = self.lock().done.get_mut(id) {
            *d = (true, Stamp::now());
        }
        self.changed.notify_all();
    }

    fn abort(&self) {
        self.lock().aborted = true;
        self.changed.notify_all();
    }

    /// Block until entry `id` is done or the step is aborted.
    fn wait(&self, id: usize) {
        let mut st = self.lock();
        while !st.aborted && !st.done.get(id).is_none_or(|d| d.0) {
            st = self.changed.wait(st).unwrap_or_else(|e| e.into_inner());
        }
        if let Some((_, done)) = st.done.get(id) {
            done.join();
        }
    }
}

/// A pass's side of [`Submit::Stream`]: where its stream copies each MoE
/// layer's inputs and finds its sums, and how it hands the layer to the host.
struct Streamed {
    micro: usize,
    staging: Arc<Staging>,
    tasks: mpsc::Sender<MoeTask>,
    board: Arc<Board>,
    /// Where the next MoE layer's slot starts.
    next_offset: usize,
    /// The current MoE layer's hand-over.
    current: Option<Handed>,
    /// Layers handed over so far.
    submitted: usize,
    /// Completed when the latest layer has been handed over (its copies
    /// down and the host function that hands it over have run).
    handed: Option<Event>,
}

/// A MoE layer handed to the host: where its sums will be, for how many
/// tokens, and the board entries that say they are there.
#[derive(Clone, Copy)]
struct Handed {
    rows: usize,
    sum: usize,
    deferred_sum: usize,
    now: usize,
    deferred: Option<usize>,
}

/// A random delay for the CPU's next MoE call (tests): SplitMix64 of the
/// seed and the call's number, so runs are reproducible.
fn jitter_delay(j: Jitter, calls: &std::cell::Cell<u64>) -> Duration {
    let n = calls.get();
    calls.set(n + 1);
    let mut z = j.seed.wrapping_add(n.wrapping_mul(0x9e37_79b9_7f4a_7c15));
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    j.max.mul_f64((z ^ (z >> 31)) as f64 / u64::MAX as f64)
}

/// Expert jobs by where their weights are: on the device, or in the host mapping.
#[allow(clippy::type_complexity)]
fn split_jobs<'a>(jobs: &[ExpertJob<'a, Placed>]) -> Result<(Vec<ExpertJob<'a, DeviceWeight>>, Vec<ExpertJob<'a, HostWeight>>), ForwardError> {
    let (mut device, mut host) = (vec![], vec![]);
    for j in jobs {
        match (j.gate, j.up, j.down) {
            (Placed::Device(gate), Placed::Device(up), Placed::Device(down)) => device.push(ExpertJob { gate, up, down, tokens: j.tokens, first: j.first, expert: j.expert }),
            (Placed::Host(gate), Placed::Host(up), Placed::Host(down)) => host.push(ExpertJob { gate, up, down, tokens: j.tokens, first: j.first, expert: j.expert }),
            _ => return Err(ForwardError::BadModule(format!("expert {}'s projections are split between the host and the device", j.expert))),
        }
    }
    Ok((device, host))
}

/// The summed output `[n, d]` of host-placed experts over `xs`, on the CPU pool.
fn cpu_sum(cpu: &crate::cpu::CpuRuntime, xs: &[f32], n: usize, d: usize, jobs: &[ExpertJob<HostWeight>], p: Precision) -> Result<Vec<f32>, ForwardError> {
    let mut cpu: CpuBackend = cpu.backend();
    let base = cpu.workspace(2 * n * d * 4)?;
    let (x, y) = (base.slice(0, n * d * 4)?.matrix(n, d), base.slice(n * d * 4, n * d * 4)?.matrix(n, d));
    cpu.upload_f32(xs, x.buf)?;
    cpu.zero(y)?;
    cpu.run_experts(x, jobs, y, p)?;
    cpu.download(y)
}

/// The data and scales strides (bytes) at which `ws` follow one another, if
/// one pair of strides fits them all (and they share a shape).
fn uniform_steps(ws: &[DeviceWeight]) -> Option<(usize, usize)> {
    let (first, second) = (ws.first()?, ws.get(1));
    let step = |a: &DeviceWeight, b: &DeviceWeight| Some(((b.data.addr.checked_sub(a.data.addr)?) as usize, (b.scales.addr.checked_sub(a.scales.addr)?) as usize));
    let steps = match second {
        Some(b) => step(first, b)?,
        None => (0, 0),
    };
    let same = ws.windows(2).all(|p| step(&p[0], &p[1]) == Some(steps) && (p[0].rows, p[0].cols, p[0].format, p[0].data.bytes, p[0].scales.bytes) == (p[1].rows, p[1].cols, p[1].format, p[1].data.bytes, p[1].scales.bytes));
    same.then_some(steps)
}

/// A segment's device block table.
struct SeqTable {
    /// The segment's first row in its pass.
    row: usize,
    ids: DevicePtr,
    blocks: usize,
}

/// The forward program's ops for the hybrid placement: the device's, but
/// for the routed experts (the CPU's) and the KV cache (the device pool).
pub struct HybridBackend<'a> {
    dev: DeviceBackend<'a>,
    cpu: &'a dyn ExpertPool,
    kv: PagedKv,
    tables: Vec<SeqTable>,
    /// Host copies of device matrices the routed experts read: the FFN's
    /// input, fetched with the router's choices, and its copy kept for the
    /// deferred experts.
    host_copies: Vec<(Matrix, Vec<f32>)>,
    timings: HybridTimings,
    jitter: Option<(Jitter, &'a std::cell::Cell<u64>)>,
    /// With [`Submit::Stream`]: the routed experts go to the host from the stream.
    streamed: Option<Streamed>,
    /// The expert cache, and what it needs: the model (prefetch predicts
    /// routes from it), the copy stream, the current MoE layer, its
    /// experts' input and (for prefetch) its FFN input hidden state.
    cache: Option<&'a RefCell<ExpertCache>>,
    model: &'a Model,
    copy: StreamId,
    moe_layer: usize,
    routed_input: Option<Matrix>,
    hidden: Option<Vec<f32>>,
}

impl HybridBackend<'_> {
    fn table(&self, seg: &Segment) -> Result<&SeqTable, ForwardError> {
        self.tables.iter().find(|t| t.row == seg.row).ok_or_else(|| ForwardError::BadModule(format!("no device table for the segment at row {}", seg.row)))
    }

    /// The segment's whole context `[ctx, entry]` on the device: its fresh
    /// entries when it starts the sequence, else gathered from the pool.
    fn context(&mut self, c: &AttentionCall) -> Result<Matrix, ForwardError> {
        if c.seg.start == 0 {
            return Ok(c.fresh);
        }
        let ctx = c.seg.start + c.seg.n;
        let out = c.context.rows(0..ctx);
        if out.rows != ctx {
            return Err(ForwardError::Workspace(format!("no room for {ctx} positions of context")));
        }
        let t = self.table(c.seg)?;
        let op = Op::KvGather { kv: self.kv, table: t.ids, blocks: t.blocks, layer: c.layer, out };
        self.dev.launch(op)?;
        Ok(out)
    }

    /// MLA for one new token in the absorbed form, as the CPU engine runs
    /// it: per head the latent query `W_kᵀ q_nope`, attention over the
    /// context's latents, then the head's value band of `kv_b_proj` over
    /// the attended latent. The context's keys and values are never
    /// expanded, so a step costs what its latents do, not the context times
    /// the heads.
    fn mla_absorbed(&mut self, c: &AttentionCall, kv_b: &DeviceWeight, key_t: &[DeviceWeight], latents: Matrix) -> Result<(), ForwardError> {
        let (cfg, m) = (c.cfg, c.cfg.mla().expect("MLA"));
        let (heads, dn, dr, dv, dc) = (cfg.num_attention_heads, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim, m.kv_lora_rank);
        let (dq, dkv, p) = (dn + dr, dn + dv, c.precision);
        if key_t.len() != heads || c.absorbed.rows < heads || c.absorbed.cols < 2 * dc + dkv {
            return Err(ForwardError::Workspace(format!("no room for the absorbed form of {heads} heads")));
        }
        // Three contiguous blocks (kernels refuse outputs whose span
        // overlaps an input's, as interleaved columns would).
        let at = |floats: usize, cols: usize| Matrix { offset: c.absorbed.offset + floats, rows: heads, cols, stride: cols, ..c.absorbed };
        let (q_latent, ctx_latent, kv) = (at(0, dc), at(heads * dc, dc), at(2 * heads * dc, dkv));
        let q = c.q.reshape(heads, dq);
        let round = p == Precision::Bf16;
        // One launch for every head where the bands lie at one stride (they
        // are placed so at start-up), else one per head.
        match uniform_steps(key_t) {
            Some((w_step, scales_step)) => self.dev.launch(Op::GemmBatched { w: key_t[0], w_step, scales_step, x: q.rows(0..1).columns(0..dn), x_rows: 1, y: q_latent.rows(0..1), y_rows: 1, count: heads, precision: p, round })?,
            None => {
                for (h, k) in key_t.iter().enumerate() {
                    self.dev.gemm(k, q.rows(h..h + 1).columns(0..dn), q_latent.rows(h..h + 1), p, true)?;
                }
            }
        }
        let op = Op::MlaDecode { q_latent, q_pe: q.columns(dn..dq), latents, out: ctx_latent, scale: c.scale, precision: p };
        self.dev.launch(op)?;
        if p == Precision::Bf16 {
            self.dev.round_bf16(ctx_latent)?;
        }
        // A head's whole band (keys and values: slices of an FP8 weight
        // start on a scale block) over its latent; the values are kept.
        let bands: Vec<DeviceWeight> = (0..heads).map(|h| kv_b.rows(h * dkv..(h + 1) * dkv)).collect::<Result<_, _>>()?;
        match uniform_steps(&bands) {
            Some((w_step, scales_step)) => self.dev.launch(Op::GemmBatched { w: bands[0], w_step, scales_step, x: ctx_latent.rows(0..1), x_rows: 1, y: kv.rows(0..1), y_rows: 1, count: heads, precision: p, round })?,
            None => {
                for (h, band) in bands.iter().enumerate() {
                    self.dev.gemm(band, ctx_latent.rows(h..h + 1), kv.rows(h..h + 1), p, true)?;
                }
            }
        }
        self.dev.copy(kv.columns(dn..dkv), c.out.reshape(heads, dv))
    }

    /// A layer's routed experts with the expert cache: the device runs the
    /// share the assignment gives it (from cache slots, or copied in for
    /// the layer), queued first so that it runs while the CPU runs the
    /// rest; then the layer's policy updates the cache and the next layers
    /// are prefetched.
    fn cached_experts(&mut self, cache: &RefCell<ExpertCache>, x: Matrix, host: &[ExpertJob<HostWeight>], out: Matrix, p: Precision, s: &ExpertScratch) -> Result<(), ForwardError> {
        let (dev, stream, layer) = (self.dev.dev, self.dev.stream, self.moe_layer);
        let mut cache = cache.borrow_mut();
        let planned = cache.plan(dev, stream, self.copy, layer, host)?;
        let on_device: Vec<ExpertJob<DeviceWeight>> = planned.device.iter().map(|(i, w)| ExpertJob { gate: &w.gate, up: &w.up, down: &w.down, tokens: host[*i].tokens, first: host[*i].first, expert: host[*i].expert }).collect();
        let device_span = if on_device.is_empty() {
            None
        } else {
            let before = dev.record(stream)?;
            self.dev.experts(x, &on_device, out, p, s)?;
            Some((before, dev.record(stream)?))
        };
        let on_cpu: Vec<ExpertJob<HostWeight>> = planned.cpu.iter().map(|&i| ExpertJob { gate: host[i].gate, up: host[i].up, down: host[i].down, tokens: host[i].tokens, first: host[i].first, expert: host[i].expert }).collect();
        let started = Instant::now();
        if !on_cpu.is_empty() {
            self.host_experts(x, &on_cpu, out, p, s)?;
        }
        let cpu = started.elapsed();
        cache.ran(dev, stream, self.copy, layer, host, &planned, device_span, cpu)?;
        if let Some(h) = self.hidden.take() {
            cache.prefetch(dev, self.copy, self.model, layer, &h)?;
        }
        Ok(())
    }

    /// [`Submit::Stream`]: queue copies of a MoE layer's expert input and
    /// router choices into the next staging slot, and a host function that
    /// hands the layer to the host; nothing here waits.
    fn hand_over(&mut self, layer: usize, input: Matrix, ids: DevicePtr, weights: Matrix, defer: usize) -> Result<Routes, ForwardError> {
        let (n, d, k) = (input.rows, input.cols, weights.cols);
        let Some(st) = self.streamed.as_mut() else {
            return Err(ForwardError::BadModule("no staging to hand the experts over in".into()));
        };
        if !input.is_contiguous() || !weights.is_contiguous() {
            return Err(ForwardError::Workspace("the experts' input and the router's weights must be contiguous to be copied down".into()));
        }
        let span = |m: Matrix| DevicePtr { addr: m.buf.addr + 4 * m.offset as u64, bytes: 4 * m.rows * m.cols };
        let layout = SlotLayout::new(n, d, k);
        let offset = st.next_offset;
        let (dev, stream) = (self.dev.dev, self.dev.stream);
        dev.download_to(stream, span(input), &st.staging, offset)?;
        dev.download_to(stream, ids.slice(0, 4 * n * k)?, &st.staging, offset + layout.ids)?;
        dev.download_to(stream, span(weights), &st.staging, offset + layout.weights)?;
        let now = st.board.add();
        let deferred = (defer > 0).then(|| st.board.add());
        let task = MoeTask { micro: st.micro, layer, rows: n, offset, defer, now, deferred, handed: Stamp::default() };
        let tasks = st.tasks.clone();
        dev.host_fn(
            stream,
            Box::new(move || {
                // The host stops listening only once the step has failed.
                let _ = tasks.send(MoeTask { handed: Stamp::now(), ..task });
            }),
        )?;
        st.handed = Some(dev.record(stream)?);
        st.next_offset += layout.bytes;
        st.current = Some(Handed { rows: n, sum: offset + layout.sum, deferred_sum: offset + layout.deferred_sum, now, deferred });
        st.submitted += 1;
        Ok(Routes::Submitted)
    }

    /// Hold `xs` as the host's copy of device matrix `m` (replacing an older one).
    fn keep_copy(&mut self, m: Matrix, xs: Vec<f32>) {
        self.host_copies.retain(|(k, _)| *k != m);
        self.host_copies.push((m, xs));
    }

    /// Run `jobs` (routed experts, host weights) on the CPU pool over rows
    /// of `x`, and add their sum into `out` on the device.
    fn host_experts(&mut self, x: Matrix, jobs: &[ExpertJob<HostWeight>], out: Matrix, p: Precision, s: &ExpertScratch) -> Result<(), ForwardError> {
        let (n, d) = (x.rows, x.cols);
        if !self.host_copies.iter().any(|(m, _)| *m == x) {
            let waited = Instant::now();
            let xs = self.dev.download(x)?;
            self.timings.device_wait += waited.elapsed();
            self.keep_copy(x, xs);
        }
        let xs = &self.host_copies.iter().find(|(m, _)| *m == x).expect("kept above").1;
        if let Some((j, calls)) = self.jitter {
            std::thread::sleep(jitter_delay(j, calls));
        }
        let started = Instant::now();
        let sum = self.cpu.sum(xs, n, d, jobs, p)?;
        self.timings.cpu_moe += started.elapsed();
        let ye = s.ye.rows(0..n).reshape(n, d);
        self.dev.upload_f32(&sum, ye.buf.slice(ye.offset * 4, n * d * 4)?)?;
        self.dev.add(out, ye, Precision::F32)
    }
}

impl Backend for HybridBackend<'_> {
    type Weight = Placed;
    // Attention reads a context gathered from the device pool into the workspace.
    const ATTENDS_IN_PLACE: bool = false;

    fn rows_of(w: &Placed) -> Result<usize, ForwardError> {
        match w {
            Placed::Device(d) => Ok(d.rows),
            Placed::Host(h) => CpuBackend::rows_of(h),
            Placed::PerHead(_) => Err(ForwardError::BadModule("rows of a per-head weight".into())),
        }
    }

    fn workspace(&mut self, bytes: usize) -> Result<DevicePtr, ForwardError> {
        self.dev.workspace(bytes)
    }

    fn upload_f32(&mut self, xs: &[f32], dst: DevicePtr) -> Result<(), ForwardError> {
        self.dev.upload_f32(xs, dst)
    }

    fn upload_u32(&mut self, xs: &[u32], dst: DevicePtr) -> Result<(), ForwardError> {
        self.dev.upload_u32(xs, dst)
    }

    fn download(&mut self, m: Matrix) -> Result<Vec<f32>, ForwardError> {
        let waited = Instant::now();
        let out = self.dev.download(m);
        self.timings.device_wait += waited.elapsed();
        out
    }

    fn embedding(&mut self, table: &Placed, first_row: usize, ids: DevicePtr, count: usize, out: Matrix, p: Precision) -> Result<(), ForwardError> {
        self.dev.embedding(on_device(table)?, first_row, ids, count, out, p)
    }

    fn gemm(&mut self, w: &Placed, x: Matrix, y: Matrix, p: Precision, round: bool) -> Result<(), ForwardError> {
        self.dev.gemm(on_device(w)?, x, y, p, round)
    }

    fn router_logits(&mut self, w: &Placed, x: Matrix, y: Matrix, p: Precision) -> Result<(), ForwardError> {
        self.dev.router_logits(on_device(w)?, x, y, p)
    }

    fn rms_norm(&mut self, x: Matrix, weight: &Placed, out: Matrix, eps: f32, p: Precision) -> Result<(), ForwardError> {
        self.dev.rms_norm(x, on_device(weight)?, out, eps, p)
    }

    fn rope(&mut self, x: Matrix, cos: Matrix, sin: Matrix, rows_per_position: usize, interleaved: bool, p: Precision) -> Result<(), ForwardError> {
        self.dev.rope(x, cos, sin, rows_per_position, interleaved, p)
    }

    fn add(&mut self, h: Matrix, delta: Matrix, p: Precision) -> Result<(), ForwardError> {
        self.dev.add(h, delta, p)
    }

    fn round_bf16(&mut self, x: Matrix) -> Result<(), ForwardError> {
        self.dev.round_bf16(x)
    }

    fn zero(&mut self, x: Matrix) -> Result<(), ForwardError> {
        self.dev.zero(x)
    }

    fn route(&mut self, c: RouteCall<'_, Placed>) -> Result<Routes, ForwardError> {
        let bias = c.bias.map(on_device).transpose()?;
        let (n, k, p) = (c.logits.rows, c.params.top_k, c.precision);
        let (ids, weights, input) = (c.ids, c.weights, c.input);
        let waited = Instant::now();
        self.dev.launch(Op::Route { logits: c.logits, bias: bias.map(|b| b.data), params: c.params.clone(), ids, weights, precision: p })?;
        if self.streamed.is_some() {
            return self.hand_over(c.layer, input, ids, weights, c.defer);
        }
        self.moe_layer = c.layer;
        self.routed_input = Some(input);
        if self.cache.is_some_and(|cache| cache.borrow().config().prefetch != PrefetchKind::None) {
            self.hidden = Some(self.dev.download(c.hidden)?);
        }
        // The experts' input comes with the choices, in the same wait (the
        // shared experts queued next then run on the device while the CPU
        // runs the routed ones), and in one copy: the pass lays the input,
        // the ids and the weights out one after another.
        let (x_at, ids_at, w_at) = (input.buf.addr + 4 * input.offset as u64, ids.addr, weights.buf.addr + 4 * weights.offset as u64);
        let end = w_at + 4 * (n * k) as u64;
        let together = input.is_contiguous() && weights.is_contiguous() && x_at < ids_at && ids_at < w_at && end - x_at <= 4 * (input.rows * input.cols + 2 * n * k) as u64 + 2048;
        let (xs, chosen) = if together {
            let bytes = self.dev.dev.download(self.dev.stream, DevicePtr { addr: x_at, bytes: (end - x_at) as usize })?;
            let floats = |at: u64, len: usize| -> Vec<f32> { bytes[(at - x_at) as usize..][..4 * len].chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect() };
            let xs = floats(x_at, input.rows * input.cols);
            let chosen_ids: Vec<u32> = floats(ids_at, n * k).iter().map(|v| v.to_bits()).collect();
            let ws = floats(w_at, n * k);
            (xs, chosen_ids.chunks(k).zip(ws.chunks(k)).map(|(e, w)| e.iter().map(|&e| e as usize).zip(w.iter().copied()).collect()).collect())
        } else {
            let chosen = self.dev.route_results((ids, weights), n, k)?;
            (self.dev.download(input)?, chosen)
        };
        self.timings.device_wait += waited.elapsed();
        self.keep_copy(input, xs);
        Ok(Routes::Chosen(chosen))
    }

    fn routed_sum(&mut self, out: Matrix, deferred: bool, s: &ExpertScratch) -> Result<(), ForwardError> {
        let Some(st) = self.streamed.as_ref() else {
            return Err(ForwardError::BadModule("routed sums without handing the experts to the host".into()));
        };
        let Some(h) = st.current else {
            return Err(ForwardError::BadModule("a routed sum before its layer's routes".into()));
        };
        let (id, at) = match (deferred, h.deferred) {
            (false, _) => (h.now, h.sum),
            (true, Some(id)) => (id, h.deferred_sum),
            (true, None) => return Err(ForwardError::BadModule("deferred experts' sum of a layer that deferred none".into())),
        };
        let (n, d) = (h.rows, out.cols);
        // The stream waits here (a host function) until the sum has landed, then copies it up.
        let board = st.board.clone();
        let (dev, stream) = (self.dev.dev, self.dev.stream);
        dev.host_fn(stream, Box::new(move || board.wait(id)))?;
        let ye = s.ye.rows(0..n).reshape(n, d);
        dev.upload_from(stream, &st.staging, at, ye.buf.slice(ye.offset * 4, n * d * 4)?)?;
        self.dev.add(out, ye, Precision::F32)
    }

    fn copy(&mut self, src: Matrix, dst: Matrix) -> Result<(), ForwardError> {
        self.dev.copy(src, dst)?;
        // A copy of a matrix the host holds is held too (the deferred
        // experts' input): they then run without waiting on the device.
        if let Some(xs) = self.host_copies.iter().find(|(m, _)| *m == src).map(|(_, xs)| xs.clone()) {
            self.keep_copy(dst, xs);
        }
        Ok(())
    }

    fn experts(&mut self, x: Matrix, jobs: &[ExpertJob<Placed>], out: Matrix, p: Precision, s: &ExpertScratch) -> Result<(), ForwardError> {
        let (device, host) = split_jobs(jobs)?;
        // A layer's routed experts (not its deferred ones) go through the cache.
        if let (Some(cache), true) = (self.cache, self.routed_input == Some(x) && !host.is_empty()) {
            if !device.is_empty() {
                self.dev.experts(x, &device, out, p, s)?;
            }
            return self.cached_experts(cache, x, &host, out, p, s);
        }
        if !device.is_empty() {
            self.dev.experts(x, &device, out, p, s)?;
        }
        if !host.is_empty() {
            self.host_experts(x, &host, out, p, s)?;
        }
        Ok(())
    }

    fn store_kv(&mut self, layer: usize, parts: &[Matrix], seg: &Segment, _host: &mut KvPool) -> Result<(), ForwardError> {
        let [entries] = parts else {
            return Err(ForwardError::BadModule(format!("KV entries in {} parts", parts.len())));
        };
        let t = self.table(seg)?;
        let op = Op::KvStore { entries: *entries, kv: self.kv, table: t.ids, blocks: t.blocks, layer, start: seg.start };
        self.dev.launch(op)
    }

    fn mla_attention(&mut self, c: &AttentionCall, w: &Weights<Placed>) -> Result<(), ForwardError> {
        let context = self.context(c)?;
        let kv_b = on_device(w.get("kv_b_proj")?)?;
        match w.find("kv_b_proj.key_t") {
            Some(Placed::PerHead(key_t)) if c.seg.n == 1 => self.mla_absorbed(c, kv_b, key_t, context),
            _ => self.dev.mla_over(c, kv_b, context),
        }
    }

    fn gqa_attention(&mut self, c: &AttentionCall) -> Result<(), ForwardError> {
        let context = self.context(c)?;
        self.dev.gqa_over(c, context)
    }
}
