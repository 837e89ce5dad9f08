//! `duplex bench-decode`: how well the hybrid decode placement overlaps the
//! device's work with the CPU's, on the emulated accelerator.
//!
//! The hybrid placement runs attention, norms, the router, shared experts,
//! the embedding and the LM head on the device and the routed experts on the
//! CPU pool. A batch of two is split into two micro-batches alternated layer
//! by layer, so that the device runs one's attention while the CPU runs the
//! other's experts. This measures, per decode step:
//! - device busy time: the emulated device's compute time (its own threads),
//! - CPU MoE time: the host's time in the routed experts,
//! - measured time: the step's wall time,
//!
//! and the overlap efficiency max(device, CPU) ÷ measured: 1 when the shorter
//! of the two is hidden entirely behind the longer. Batch 1 (nothing to
//! overlap with), batch 2 in two micro-batches and batch 2 as one batch run
//! interleaved round by round, so that load from other tenants of the
//! machine hits all three alike, and every ratio is taken within a round.
//!
//! With `--defer N`, batch 1 also runs with Expert Deferral (each token's N
//! lowest-weighted routed experts run on the CPU while the device runs the
//! next layer's attention), the other way to overlap at batch 1.
//!
//! The CPU experts are started and awaited from the device streams, each
//! step captured as one device graph (the default, [`Submit::Graph`]);
//! batch 1 and batch 2 also run queued on the streams without a graph
//! ([`Submit::Stream`]) and with the host thread driving the micro-batches
//! layer by layer ([`Submit::Host`]), to compare the three.
//!
//! Per-layer figures are a step's totals divided by its layers: the engine
//! reports its timings per pass, not per layer.

use crate::{load_progress, ModelArgs};
use anyhow::{bail, Context, Result};
use clap::Args;
use duplex_kernels::device::emulated::{EmulatedConfig, EmulatedDevice};
use duplex_kernels::device::Device;
use duplex_kernels::pool::PoolConfig;
use duplex_model::device_experts::{CacheStats, ExpertCache, ExpertCacheConfig};
use duplex_model::hybrid::{DeviceKv, DeviceSeq, HybridConfig, HybridEngine, Submit};
use duplex_model::{BlockTable, KvPool, Logits, Model, Precision, SeqInput};
use duplex_toolkit::reference::argmax;
use std::io::Write;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Positions per KV block, as the workers use.
const BLOCK: usize = 16;
/// The paper's batch-2 ÷ batch-1 decode throughput with dual micro-batches.
const PAPER_BATCH2_SPEEDUP: f64 = 1.56;

#[derive(Args)]
pub struct BenchDecodeArgs {
    #[command(flatten)]
    pub(crate) model: ModelArgs,
    /// Prompt tokens per sequence, prefilled on the CPU engine into a host KV pool and
    /// handed to the hybrid placement (as from the prefill worker).
    #[arg(long, default_value_t = 512)]
    pub(crate) context: usize,
    /// Decode steps per round.
    #[arg(long, default_value_t = 16)]
    pub(crate) steps: usize,
    /// Rounds; each runs every configuration once, interleaved.
    #[arg(long, default_value_t = 5)]
    pub(crate) rounds: usize,
    /// Compute threads of the emulated device (its own, apart from the CPU pool's).
    #[arg(long, default_value_t = 1)]
    pub(crate) device_threads: usize,
    /// Threads of the CPU pool that runs the routed experts.
    #[arg(long, default_value_t = 1)]
    pub(crate) cpu_threads: usize,
    /// Emulated device memory in MiB [default: the resident weights, the KV pool and room for activations].
    #[arg(long)]
    pub(crate) device_memory_mib: Option<usize>,
    /// Blocks of each engine's device KV pool [default: enough for two sequences].
    #[arg(long)]
    pub(crate) kv_blocks: Option<usize>,
    /// Expert Deferral at batch 1: defer this many of each token's routed experts
    /// (less than the model's experts per token); 0 leaves that row out.
    #[arg(long, default_value_t = 2)]
    pub(crate) defer: usize,
    /// Instead: compare the expert cache's settings (assignment, prefetch,
    /// policy) with a device cache of this many routed experts (over all MoE layers).
    #[arg(long, default_value_t = 0)]
    pub(crate) expert_cache: usize,
    /// With --expert-cache: the emulated device's host→device bandwidth in GB/s
    /// (PCIe 4.0 x16 moves about 25).
    #[arg(long, default_value_t = 25.0)]
    pub(crate) h2d_gb_per_s: f64,
    /// With --expert-cache: sequences decoding at once (1 or 2).
    #[arg(long, default_value_t = 1)]
    pub(crate) batch: usize,
}

/// What one configuration did in one round, summed over its steps.
#[derive(Clone, Copy, Default)]
pub(crate) struct Round {
    /// The emulated device's compute time.
    device: Duration,
    /// The host's time in the routed experts.
    cpu: Duration,
    /// The host's time blocked on the device.
    wait: Duration,
    /// The host's time capturing graph steps and launching them.
    capture: Duration,
    /// Wall time of the steps.
    pub(crate) measured: Duration,
    pub(crate) tokens: usize,
    /// What an expert cache did.
    pub(crate) cache: CacheStats,
}

impl Round {
    fn efficiency(&self) -> f64 {
        self.device.max(self.cpu).as_secs_f64() / self.measured.as_secs_f64().max(1e-12)
    }

    pub(crate) fn tokens_per_s(&self) -> f64 {
        self.tokens as f64 / self.measured.as_secs_f64().max(1e-12)
    }
}

/// One engine and its sequences' device blocks.
pub(crate) struct Placement {
    pub(crate) engine: HybridEngine,
    pub(crate) seqs: Vec<DeviceSeq>,
}

/// Cores of their own for the host thread (the CPU pool's thread 0, which
/// runs the routed experts) with the pool's workers, and for the emulated
/// device's stream threads. Unpinned, the scheduler tends to wake a stream
/// thread on its waker's core, where it preempts the host thread: the two
/// then take turns on one core and nothing overlaps.
#[derive(Clone)]
pub(crate) struct Pinning {
    host: Vec<usize>,
    device: usize,
}

impl Pinning {
    /// `None` when the machine has too few cores, or the device more than
    /// one thread (its pool pins its own workers, from the first core up).
    fn plan(cpu_threads: usize, device_threads: usize) -> Option<Pinning> {
        let cores = duplex_kernels::pool::allowed_cores();
        (device_threads == 1 && cores.len() > cpu_threads).then(|| Pinning { host: cores[..cpu_threads].to_vec(), device: cores[cpu_threads] })
    }

    pub(crate) fn describe(p: &Option<Pinning>) -> String {
        match p {
            Some(p) => format!("pinned: host and CPU pool on cores {}, device streams on core {}", duplex_kernels::pool::format_cpu_list(&p.host), p.device),
            None => "not pinned (too few cores, or more than one device thread)".into(),
        }
    }
}

pub(crate) fn pin_current(core: usize) -> Result<()> {
    if !core_affinity::set_for_current(core_affinity::CoreId { id: core }) {
        bail!("cannot pin the benchmark's thread to core {core}");
    }
    Ok(())
}

/// A configuration: which placement, how many sequences.
struct Config {
    label: &'static str,
    placement: usize,
    batch: usize,
}

/// `min / median / max`.
pub(crate) fn spread(mut xs: Vec<f64>, digits: usize) -> String {
    xs.sort_by(f64::total_cmp);
    let median = if xs.len() % 2 == 1 { xs[xs.len() / 2] } else { (xs[xs.len() / 2 - 1] + xs[xs.len() / 2]) / 2.0 };
    format!("{:.digits$} / {median:.digits$} / {:.digits$}", xs[0], xs[xs.len() - 1])
}

pub(crate) fn mib(bytes: usize) -> f64 {
    bytes as f64 / (1 << 20) as f64
}

/// Device memory that holds the resident weights and a KV pool of
/// `kv_blocks` with the tenth the engine keeps for activations, plus room for
/// the activations of a batch of two (both streams' workspaces, which grow by
/// half again). The emulated device commits memory only as it is touched, so
/// a generous figure costs nothing.
fn default_device_bytes(model: &Model, kv_blocks: usize, positions: usize) -> Result<usize> {
    let c = &model.cfg;
    let resident: usize = model.staged_modules(usize::MAX).iter().filter(|m| !m.is_expert()).map(|m| m.device_bytes()).sum();
    let kv = kv_blocks * DeviceKv::block_bytes(c.num_hidden_layers, BLOCK, c.kv_entry_dim());
    let activations = duplex_model::staged::workspace_bytes(model, positions, 1, Logits::Last, 64 << 20)?;
    Ok((resident + kv) / 9 * 10 + 2 * 2 * activations * 3 / 2 + (64 << 20))
}

fn pool_config(args: &BenchDecodeArgs, pin: &Option<Pinning>) -> Result<PoolConfig> {
    match pin {
        // Workers on the host's cores after the first, which the host thread (thread 0) has.
        Some(p) => PoolConfig::on_cores(args.cpu_threads, 1, &p.host).map_err(anyhow::Error::msg),
        None => Ok(PoolConfig::single_node(args.cpu_threads)),
    }
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn placement(args: &BenchDecodeArgs, pin: &Option<Pinning>, (micro_batches, defer_experts, submit, expert_cache): (bool, usize, Submit, Option<ExpertCacheConfig>), kv_blocks: usize, positions: usize, host: &KvPool, tables: &[BlockTable]) -> Result<Placement> {
    let dir = &args.model.model;
    let (bar, mut progress) = load_progress(dir);
    let model = Model::load_source(&args.model.source()?, &pool_config(args, pin)?, &mut progress).with_context(|| format!("loading model from {}", dir.display()))?;
    bar.finish_and_clear();
    let memory_bytes = match args.device_memory_mib {
        Some(m) => m << 20,
        None => default_device_bytes(&model, kv_blocks, positions)? + expert_cache.map_or(0, |ec| ExpertCache::bytes(&model, ec.experts) / 9 * 10),
    };
    // Copies paced as over PCIe where an expert cache moves experts; else unlimited.
    let h2d_bytes_per_second = expert_cache.map(|_| args.h2d_gb_per_s * 1e9);
    let device: Arc<dyn Device> = EmulatedDevice::new(EmulatedConfig { memory_bytes, compute_threads: args.device_threads, h2d_bytes_per_second, ..Default::default() })?;
    // The engine starts the device's stream threads, which inherit the
    // starting thread's cores: the device's core while it does.
    if let Some(p) = pin {
        pin_current(p.device)?;
    }
    let engine = HybridEngine::new(model, device, HybridConfig { kv_blocks, micro_batches, defer_experts, cpu_jitter: None, submit, expert_cache }, BLOCK);
    if let Some(p) = pin {
        pin_current(p.host[0])?;
    }
    let mut engine = engine?;
    let seqs = tables.iter().map(|t| engine.admit(host, t, positions)).collect::<Result<Vec<_>, _>>()?;
    Ok(Placement { engine, seqs })
}

/// `steps` greedy decode steps of the first `batch` sequences, from the end
/// of their prompts (the tables are rewound, so every round decodes the same
/// tokens over the same blocks and the rounds differ only in noise).
#[allow(clippy::too_many_arguments)]
pub(crate) fn decode(p: &mut Placement, host: &mut KvPool, tables: &mut [BlockTable], first: &[Vec<f32>], context: usize, batch: usize, steps: usize, precision: Precision) -> Result<Round> {
    let vocab = p.engine.model.cfg.vocab_size;
    let mut logits: Vec<f32> = first[..batch].concat();
    let dseqs: Vec<&DeviceSeq> = p.seqs[..batch].iter().collect();
    for t in tables[..batch].iter_mut() {
        t.len = context;
    }
    let mut round = Round { tokens: batch * steps, ..Default::default() };
    for _ in 0..steps {
        let tokens: Vec<[u32; 1]> = logits.chunks(vocab).map(|row| [argmax(row)]).collect();
        let mut seqs: Vec<SeqInput> = tables[..batch].iter_mut().zip(&tokens).map(|(table, t)| SeqInput { table, tokens: t }).collect();
        let started = Instant::now();
        let (out, timings) = p.engine.forward(host, &mut seqs, &dseqs, precision, Logits::Last)?;
        // The pass ends by downloading each stream's logits, so all of its
        // device work has finished (and been counted) by now.
        round.measured += started.elapsed();
        round.device += timings.device_busy.context("the emulated device reports its compute time")?;
        round.cpu += timings.cpu_moe;
        round.wait += timings.device_wait;
        round.capture += timings.graph_capture;
        round.cache += timings.cache;
        logits = out;
    }
    Ok(round)
}

pub fn run(args: BenchDecodeArgs) -> Result<()> {
    for (flag, value) in [("--context", args.context), ("--steps", args.steps), ("--rounds", args.rounds), ("--device-threads", args.device_threads), ("--cpu-threads", args.cpu_threads)] {
        if value == 0 {
            bail!("{flag} must be at least 1");
        }
    }
    if args.expert_cache > 0 && !(args.h2d_gb_per_s.is_finite() && args.h2d_gb_per_s > 0.0) {
        bail!("--h2d-gb-per-s must be a positive number of GB/s");
    }
    if !(1..=2).contains(&args.batch) {
        bail!("--batch must be 1 or 2");
    }
    if args.kv_blocks == Some(0) || args.device_memory_mib == Some(0) {
        bail!("--kv-blocks and --device-memory-mib must be at least 1");
    }
    let dir = &args.model.model;
    duplex_model::check_model_dir(dir).map_err(anyhow::Error::msg)?;
    let (cfg, _) = args.model.source()?.config()?;
    let positions = args.context + args.steps;
    if positions > cfg.max_position_embeddings {
        bail!("--context {} and --steps {} need {positions} positions but the model allows {}", args.context, args.steps, cfg.max_position_embeddings);
    }
    if args.defer > 0 && args.defer >= cfg.num_experts_per_tok {
        bail!("--defer {} must be less than the model's {} routed experts per token (0 turns deferral off)", args.defer, cfg.num_experts_per_tok);
    }
    let precision = args.model.dtype;
    let per_seq = positions.div_ceil(BLOCK);
    let kv_blocks = args.kv_blocks.unwrap_or(2 * per_seq);

    // The prompts, prefilled on the CPU engine into a host pool, as the
    // prefill worker hands them over; both placements copy them in.
    // Counted before pinning narrows what this thread may run on.
    let cores = duplex_kernels::pool::allowed_cores().len();
    let pin = Pinning::plan(args.cpu_threads, args.device_threads);
    if let Some(p) = &pin {
        pin_current(p.host[0])?;
    }
    let (bar, mut progress) = load_progress(dir);
    let cpu = Model::load_source(&args.model.source()?, &pool_config(&args, &pin)?, &mut progress).with_context(|| format!("loading model from {}", dir.display()))?;
    bar.finish_and_clear();
    let mut host = cpu.new_kv_pool(2 * per_seq, BLOCK);
    let mut tables = vec![BlockTable::default(), BlockTable::default()];
    let mut first = vec![];
    let vocab = cfg.vocab_size.min(2048);
    for (s, table) in tables.iter_mut().enumerate() {
        host.reserve(table, positions).map_err(|e| anyhow::anyhow!("host KV pool: {e}"))?;
        // Two different prompts, so the two sequences route differently.
        let prompt: Vec<u32> = (0..args.context).map(|i| ((i * 7919 + 13 + s * 104_729) % vocab) as u32).collect();
        let mut logits = vec![];
        for chunk in prompt.chunks(512) {
            logits = cpu.forward(&mut host, table, chunk, precision, Logits::Last)?;
        }
        first.push(logits);
    }
    drop(cpu);
    if args.expert_cache > 0 {
        return crate::bench_experts::run(&args, &cfg, &pin, kv_blocks, (positions, cores), &mut host, &mut tables, &first);
    }

    let mut placements = vec![];
    for kind in [(true, 0, Submit::Graph, None), (false, 0, Submit::Graph, None), (true, 0, Submit::Host, None), (true, 0, Submit::Stream, None)] {
        placements.push(placement(&args, &pin, kind, kv_blocks, positions, &host, &tables)?);
    }
    if args.defer > 0 {
        // Deferral applies to a pass of one decoding sequence: an engine of its own.
        placements.push(placement(&args, &pin, (true, args.defer, Submit::Graph, None), kv_blocks, positions, &host, &tables)?);
    }
    let budget = placements[0].engine.budget();
    // Written, not printed: a reader that goes away (`| head`) is an error
    // the caller reports, not a panic.
    let mut out = std::io::stdout().lock();
    writeln!(
        out,
        "{}: {} layers, hidden {}, {} routed experts (top {}), dtype {precision:?}, context {}, {} decode steps × {} rounds interleaved; routed experts on a CPU pool of {} thread(s); {}, {} compute thread(s) of its own; {} cores on this machine, {}",
        dir.display(),
        cfg.num_hidden_layers,
        cfg.hidden_size,
        cfg.n_routed_experts,
        cfg.num_experts_per_tok,
        args.context,
        args.steps,
        args.rounds,
        args.cpu_threads,
        placements[0].engine.device().describe(),
        args.device_threads,
        cores,
        Pinning::describe(&pin)
    )?;
    writeln!(
        out,
        "device memory per placement: resident weights {:.1} MiB, KV pool {kv_blocks} blocks {:.1} MiB; expert deferral: {}\n",
        mib(budget.total() - budget.kv),
        mib(budget.kv),
        if args.defer > 0 { format!("{} of {} routed experts per token at batch 1", args.defer, cfg.num_experts_per_tok) } else { "off (--defer 0)".into() }
    )?;

    let mut configs = vec![
        Config { label: "batch 1", placement: 0, batch: 1 },
        Config { label: "batch 2, two micro-batches", placement: 0, batch: 2 },
        Config { label: "batch 2, one batch", placement: 1, batch: 2 },
        Config { label: "batch 1, host-driven", placement: 2, batch: 1 },
        Config { label: "batch 2, two micro-batches, host-driven", placement: 2, batch: 2 },
        Config { label: "batch 1, streamed without a graph", placement: 3, batch: 1 },
        Config { label: "batch 2, two micro-batches, streamed without a graph", placement: 3, batch: 2 },
    ];
    if args.defer > 0 {
        configs.push(Config { label: "batch 1, expert deferral", placement: 4, batch: 1 });
    }
    // One unmeasured round each: the workspaces are allocated and the pages
    // of the weights and the KV touched on first use.
    for c in &configs {
        decode(&mut placements[c.placement], &mut host, &mut tables, &first, args.context, c.batch, args.steps.min(2), precision)?;
    }
    let mut rounds: Vec<Vec<Round>> = configs.iter().map(|_| vec![]).collect();
    for _ in 0..args.rounds {
        for (c, out) in configs.iter().zip(rounds.iter_mut()) {
            out.push(decode(&mut placements[c.placement], &mut host, &mut tables, &first, args.context, c.batch, args.steps, precision)?);
        }
    }

    let layers = cfg.num_hidden_layers as f64;
    let per_layer = |rs: &[Round], f: fn(&Round) -> Duration| spread(rs.iter().map(|r| f(r).as_secs_f64() * 1e3 / (args.steps as f64 * layers)).collect(), 3);
    writeln!(out, "Per layer of a decode step (a step's totals ÷ {} layers), min / median / max over {} rounds:", cfg.num_hidden_layers, args.rounds)?;
    writeln!(out, "| configuration | device busy ms (attention, router, shared experts, head) | CPU MoE ms | measured ms | overlap efficiency max(device, CPU) ÷ measured | host blocked on the device ms |")?;
    writeln!(out, "| --- | --- | --- | --- | --- | --- |")?;
    for (c, rs) in configs.iter().zip(&rounds) {
        writeln!(
            out,
            "| {} | {} | {} | {} | {} | {} |",
            c.label,
            per_layer(rs, |r| r.device),
            per_layer(rs, |r| r.cpu),
            per_layer(rs, |r| r.measured),
            spread(rs.iter().map(Round::efficiency).collect(), 2),
            per_layer(rs, |r| r.wait)
        )?;
    }
    let per_step = |rs: &[Round]| spread(rs.iter().map(|r| r.capture.as_secs_f64() * 1e3 / args.steps as f64).collect(), 3);
    writeln!(out, "\nCapturing a step as a graph and launching it, host ms per step (the device starts the step only after; queued without a graph it starts on the first command): batch 1 {}, batch 2 (two micro-batches) {}", per_step(&rounds[0]), per_step(&rounds[1]))?;
    writeln!(out, "\n| configuration | tokens/s (min / median / max) |")?;
    writeln!(out, "| --- | --- |")?;
    for (c, rs) in configs.iter().zip(&rounds) {
        writeln!(out, "| {} | {} |", c.label, spread(rs.iter().map(Round::tokens_per_s).collect(), 2))?;
    }
    // Ratios within a round: its configurations ran back to back.
    let ratio = |a: usize, b: usize| spread(rounds[a].iter().zip(&rounds[b]).map(|(x, y)| x.tokens_per_s() / y.tokens_per_s()).collect(), 2);
    writeln!(out, "\n| ratio of tokens/s, within each round | min / median / max | compared with |")?;
    writeln!(out, "| --- | --- | --- |")?;
    writeln!(out, "| batch 2 (two micro-batches) ÷ batch 1 | {} | paper: {PAPER_BATCH2_SPEEDUP:.2}× |", ratio(1, 0))?;
    writeln!(out, "| batch 2 (two micro-batches) ÷ batch 2 (one batch) | {} | 1.00× without overlap |", ratio(1, 2))?;
    writeln!(out, "| batch 1, from the streams ÷ host-driven | {} | 1.00× |", ratio(0, 3))?;
    writeln!(out, "| batch 2 (two micro-batches), from the streams ÷ host-driven | {} | 1.00× |", ratio(1, 4))?;
    writeln!(out, "| batch 1, a graph per step ÷ streamed without | {} | 1.00× |", ratio(0, 5))?;
    writeln!(out, "| batch 2 (two micro-batches), a graph per step ÷ streamed without | {} | 1.00× |", ratio(1, 6))?;
    if args.defer > 0 {
        writeln!(out, "| batch 1 with expert deferral ÷ batch 1 | {} | 1.00× without overlap |", ratio(7, 0))?;
    }

    for p in placements {
        let Placement { mut engine, seqs, .. } = p;
        for s in seqs {
            engine.release(s)?;
        }
    }
    Ok(())
}
