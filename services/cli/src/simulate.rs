//! `duplex simulate`: what a model would do on hardware we do not have.
//!
//! The real engines run — the CPU placement's program, stream-loading
//! prefill with its loader, model and unloader threads and ring buffer,
//! two-device prefill with its exchanges, hybrid decode with its two
//! micro-batches — against a simulated accelerator and a simulated CPU
//! (`duplex-sim`) whose ops take the time the hardware description's
//! roofline gives them on a virtual clock. Model shapes come from a
//! `config.json`; without weights beside it, a hollow checkpoint (sparse
//! files, no bytes) is written once into a scratch directory.
//!
//! `--calibrate` measures this machine into a description; `--validate`
//! calibrates, then runs the same workloads for real on this machine (the
//! CPU engine, and SLP on the emulated device with its paced copies) and
//! sets the predictions beside the measurements.

use anyhow::{bail, Context, Result};
use clap::{Args, ValueEnum};
use duplex_kernels::clock;
use duplex_kernels::device::emulated::{EmulatedConfig, EmulatedDevice};
use duplex_kernels::device::{Device, Op};
use duplex_kernels::WeightFormat;
use duplex_model::hybrid::{HybridConfig, HybridEngine, Submit};
use duplex_model::{BlockTable, ForwardTimings, Logits, Model, Precision, SeqInput};
use duplex_prefill::dslp::DslpEngine;
use duplex_prefill::slp::{LayerTiming, SlpConfig, SlpEngine, SlpReport};
use duplex_sim::calibrate::{self, Calibration};
use duplex_sim::cpu::SimCpu;
use duplex_sim::device::{CostModel, SimConfig, SimDevice, SimStats};
use duplex_sim::hardware::{DeviceSpec, Hardware};
use crate::loadgen::scenarios::Scenarios;
use crate::loadgen::chat::Chat;
use crate::simulate_serve::{self, Deployment, Mode, ServeSettings};
use duplex_decode::DecodeConfig;
use duplex_router::RouterConfig;
use crate::loadgen::workload::Dist;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

#[derive(Args)]
pub struct SimulateArgs {
    /// The machine: a shipped description (paper-node, rtx4090-workstation) or a TOML file.
    #[arg(long, default_value = "paper-node")]
    hardware: String,
    /// The model: a directory with its config.json (weights are not needed),
    /// or a shipped config (deepseek-r1, kimi-k2, qwen3-235b-a22b, mixtral-8x22b).
    #[arg(long, default_value = "deepseek-r1")]
    model: String,
    /// What to run.
    #[arg(long, value_enum, default_value_t = Workload::All)]
    workload: Workload,
    /// Prompt lengths of the prefill sweep.
    #[arg(long, value_delimiter = ',', default_value = "1024,2048,4096,8192,16384,32768")]
    prompts: Vec<usize>,
    /// Contexts at which to decode.
    #[arg(long, value_delimiter = ',', default_value = "512,32768")]
    contexts: Vec<usize>,
    /// Batch sizes to decode at (2 or more: two micro-batches on the hybrid placement).
    #[arg(long, value_delimiter = ',', default_value = "1,2")]
    batches: Vec<usize>,
    /// Decode steps per measurement (the last step's time counts).
    #[arg(long, default_value_t = 3)]
    decode_steps: usize,
    /// Numeric path the engines run.
    #[arg(long, value_enum, default_value_t = Dtype::Bf16)]
    dtype: Dtype,
    /// CPU threads (default: every core the description has).
    #[arg(long)]
    threads: Option<usize>,
    /// Device memory for non-expert weights in SLP, MiB.
    #[arg(long, default_value_t = 1024)]
    dense_budget_mib: usize,
    /// What if products of FP8 weights ran at the device's FP8 peak (FP8
    /// tensor-core kernels, as the paper's engine has) instead of widened to BF16.
    #[arg(long)]
    fp8_products: bool,
    /// Where hollow checkpoints are written (default: the system's temporary directory).
    #[arg(long)]
    scratch: Option<PathBuf>,
    /// Measure this machine and write its description to `--out` (or print it).
    #[arg(long)]
    calibrate: bool,
    /// With --calibrate/--validate: the emulated device's compute threads (a
    /// GPU's compute does not share the host's cores; as `bench-slp --devices`
    /// gives each device one).
    #[arg(long, default_value_t = 1)]
    device_threads: usize,
    /// With --calibrate/--validate: the emulated device's copy bandwidth, GB/s.
    #[arg(long, default_value_t = 2.0)]
    emulated_h2d_gb_per_s: f64,
    /// Calibrate, then set the predictions for this machine beside real runs
    /// of the same workloads (the model must have weights: `duplex synth --preset bench`).
    #[arg(long)]
    validate: bool,
    /// Where --calibrate writes its description, or a serving workload its
    /// report (`duplex bench --out`'s JSON).
    #[arg(long)]
    out: Option<PathBuf>,
    /// Serving, `scenarios`: which of the paper's §4.5 mixes (1P, 1D, 1P+1D, 2D, 1P+2D, or all).
    #[arg(long, default_value = "all")]
    scenario: Scenarios,
    /// Serving, `scenarios`: P's prompt (the paper's 24K).
    #[arg(long, default_value_t = 24576)]
    long_prompt_tokens: u32,
    /// Serving, `scenarios`: P's output tokens.
    #[arg(long, default_value_t = 2)]
    long_output_tokens: u32,
    /// Serving, `scenarios`: D's prompt (the paper's 10 tokens).
    #[arg(long, default_value_t = 10)]
    short_prompt_tokens: u32,
    /// Serving, `scenarios`: D's output tokens (the paper's 480).
    #[arg(long, default_value_t = 480)]
    decode_tokens: u32,
    /// Serving, `open`: Poisson arrivals per second.
    #[arg(long, default_value_t = 0.5)]
    rate: f64,
    /// Serving, `open`: how many requests arrive.
    #[arg(long, default_value_t = 16)]
    requests: usize,
    /// Serving, `open`: prompt lengths (`N`, `uniform:MIN-MAX`, `normal:MEAN,SD`).
    #[arg(long, default_value = "uniform:32-8192")]
    prompt_tokens: Dist,
    /// Serving, `open`: output lengths.
    #[arg(long, default_value = "uniform:16-256")]
    output_tokens: Dist,
    /// Serving, `chat`: turns of the conversation.
    #[arg(long, default_value_t = 4)]
    chat_turns: u32,
    /// Serving, `chat`: the first turn's prompt tokens.
    #[arg(long, default_value_t = 8192)]
    chat_first_tokens: u32,
    /// Serving, `chat`: each later turn's new message.
    #[arg(long, default_value_t = 256)]
    chat_message_tokens: u32,
    /// Serving, `chat`: each answer's tokens.
    #[arg(long, default_value_t = 256)]
    chat_answer_tokens: u32,
    /// Serving: seed of the prompts and arrivals.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Serving: long prompts never take two-device prefill (as if the
    /// prefill worker had one device).
    #[arg(long)]
    no_dslp: bool,
    /// Serving: a router or decode-worker setting, as in duplex.toml
    /// (`prefill_threshold_tokens=4096`, `dslp_idle_window_seconds=0`,
    /// `max_batch_size=6`, `micro_batches=false`, ...); repeatable.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    settings: Vec<String>,
    /// Also draw the tables as an SVG chart here.
    #[arg(long)]
    plot: Option<PathBuf>,
}

/// One prompt length of the prefill sweep: each placement's TTFT.
pub struct PrefillPoint {
    pub tokens: usize,
    pub cpu: Duration,
    pub slp: Option<Duration>,
    pub dslp: Option<Duration>,
}

/// One context and batch of the decode table: each placement's tokens/s (all sequences together).
pub struct DecodePoint {
    pub context: usize,
    pub batch: usize,
    pub cpu: f64,
    pub hybrid: Option<f64>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Workload {
    /// Prefill sweep: CPU, SLP on one device, DSLP on two.
    Prefill,
    /// Decode: CPU and hybrid placements at each context and batch.
    Decode,
    /// Prefill sweep and decode table.
    All,
    /// Serving: the paper's §4.5 mixes of a long prefill (P) and decodes (D),
    /// every request at once, through the router's policy and the batcher.
    Scenarios,
    /// Serving: an open loop of Poisson arrivals.
    Open,
    /// Serving: one conversation resent turn by turn (the prefix cache's case).
    Chat,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Dtype {
    F32,
    Bf16,
}

impl From<Dtype> for Precision {
    fn from(d: Dtype) -> Precision {
        match d {
            Dtype::F32 => Precision::F32,
            Dtype::Bf16 => Precision::Bf16,
        }
    }
}

/// The virtual time the run has reached. Simulated devices and the CPU pool
/// keep their timelines (and their streams where they got to) from one
/// measurement to the next, so each measurement starts where the last ended.
static REACHED_NS: AtomicU64 = AtomicU64::new(0);

/// Run `f` on this thread's virtual clock from where the run has reached:
/// its result and the virtual time it took.
pub(crate) fn on_clock<T>(f: impl FnOnce() -> T) -> (T, Duration) {
    let start = Duration::from_nanos(REACHED_NS.load(Ordering::Relaxed));
    clock::set(Some(start));
    let out = f();
    let end = clock::now().unwrap_or(start);
    clock::set(None);
    REACHED_NS.fetch_max(end.as_nanos() as u64, Ordering::Relaxed);
    (out, end - start)
}

/// The shipped model configs (deploy/models), embedded.
const SHIPPED_MODELS: [(&str, &str); 4] = [
    ("deepseek-r1", include_str!("../../../deploy/models/deepseek-r1/config.json")),
    ("kimi-k2", include_str!("../../../deploy/models/kimi-k2/config.json")),
    ("qwen3-235b-a22b", include_str!("../../../deploy/models/qwen3-235b-a22b/config.json")),
    ("mixtral-8x22b", include_str!("../../../deploy/models/mixtral-8x22b/config.json")),
];

fn hardware(spec: &str) -> Result<Hardware> {
    if let Some(hw) = Hardware::builtin(spec) {
        return Ok(hw);
    }
    let path = Path::new(spec);
    if !path.exists() {
        bail!("no hardware description {spec:?}: name a shipped one ({}) or a TOML file (`duplex simulate --calibrate --out this-machine.toml` describes this machine)", duplex_sim::hardware::BUILTIN.join(", "));
    }
    Ok(Hardware::load(path)?)
}

/// The model's directory: itself when it holds weights, else a hollow
/// checkpoint of its config (written once, then reused).
fn model_dir(spec: &str, scratch: Option<&Path>) -> Result<PathBuf> {
    let (name, config) = match SHIPPED_MODELS.iter().find(|(n, _)| *n == spec) {
        Some((name, text)) => (name.to_string(), text.to_string()),
        None => {
            let dir = Path::new(spec);
            if has_weights(dir) {
                return Ok(dir.to_path_buf());
            }
            let config = dir.join("config.json");
            let text = std::fs::read_to_string(&config).with_context(|| format!("{spec} is neither a shipped model ({}) nor a directory with a config.json", SHIPPED_MODELS.map(|m| m.0).join(", ")))?;
            (dir.file_name().map_or("model".into(), |n| n.to_string_lossy().into_owned()), text)
        }
    };
    let scratch = scratch.map_or_else(std::env::temp_dir, Path::to_path_buf);
    // Named by the config's content, so an edited config gets a fresh checkpoint.
    let digest = {
        use sha2::Digest;
        let d = sha2::Sha256::digest(config.as_bytes());
        d[..6].iter().map(|b| format!("{b:02x}")).collect::<String>()
    };
    let dir = scratch.join(format!("duplex-hollow-{name}-{digest}"));
    if !has_weights(&dir) {
        let json: serde_json::Value = serde_json::from_str(&config).with_context(|| format!("{name}'s config.json"))?;
        let synth = duplex_toolkit::synth::SynthConfig::from_json(json, &name)?;
        let options = duplex_toolkit::synth::WriteOptions { hollow: true, force: true, ..Default::default() };
        eprintln!("writing a hollow checkpoint of {name} (sparse files, no weights) to {}", dir.display());
        duplex_toolkit::synth::write_checkpoint(&synth, &dir, &options, &mut |_, _| {})?;
    }
    Ok(dir)
}

/// Whether `dir` holds a checkpoint the engine can open (config and weights).
fn has_weights(dir: &Path) -> bool {
    duplex_model::source::ModelSource::locate(dir).and_then(|s| s.open()).is_ok()
}

pub(crate) fn device(spec: &DeviceSpec, seed: u64, fp8_products: bool) -> Arc<SimDevice> {
    let memory_bytes = (spec.memory_gib * (1u64 << 30) as f64) as usize;
    let cost: Arc<dyn CostModel> = if fp8_products { Arc::new(Fp8Products(spec.clone())) } else { Arc::new(spec.clone()) };
    SimDevice::new(SimConfig { name: spec.name.clone(), memory_bytes, cost, seed, functional: false })
}

/// `--fp8-products`: a what-if. Duplex's kernels widen FP8 weights and
/// multiply in BF16; an engine with FP8 tensor-core products (the paper's
/// quotes 419 FP8 TFLOPS) runs those products at the device's FP8 peak,
/// at the same efficiency. Everything else is costed as built.
struct Fp8Products(DeviceSpec);

impl CostModel for Fp8Products {
    fn op(&self, op: &Op) -> Duration {
        match op {
            Op::Gemm { w, .. } | Op::GemmBatched { w, .. } if matches!(w.format, WeightFormat::Fp8E4m3 { .. }) && self.0.fp8_tflops > 0.0 => {
                DeviceSpec { bf16_tflops: self.0.fp8_tflops, ..self.0.clone() }.op_time(op)
            }
            _ => self.0.op_time(op),
        }
    }

    fn h2d(&self, bytes: usize) -> Duration {
        self.0.h2d_time(bytes)
    }

    fn d2h(&self, bytes: usize) -> Duration {
        self.0.d2h_time(bytes)
    }

    fn copy_engines(&self) -> usize {
        self.0.copy_engines
    }
}

/// Token ids for a synthetic prompt (as `duplex bench-engine`'s).
fn prompt(len: usize, vocab: usize) -> Vec<u32> {
    (0..len).map(|i| ((i * 7919 + 13) % vocab.min(2048)) as u32).collect()
}

/// The CPU placement's prefill of `len` tokens, in `duplex bench-engine`'s
/// chunks of 512, and its split into attention and FFN.
fn cpu_prefill(model: &Model, cpu: &SimCpu, len: usize, p: Precision) -> Result<(Duration, ForwardTimings)> {
    let mut kv = model.new_kv_pool(len.div_ceil(16), 16);
    let mut table = BlockTable::default();
    let tokens = prompt(len, model.cfg.vocab_size);
    let mut timings = ForwardTimings::default();
    let (result, took) = on_clock(|| -> Result<()> {
        for c in tokens.chunks(512) {
            let mut seqs = [SeqInput { table: &mut table, tokens: c }];
            model.forward_batch_on(cpu.backend(), &mut kv, &mut seqs, p, Logits::Last, &mut timings, 0)?;
        }
        Ok(())
    });
    result.map(|_| (took, timings))
}

/// One SLP prefill of `len` tokens on a fresh simulated device.
fn slp_prefill(model: &Model, dev: &DeviceSpec, fp8: bool, slp: &SlpConfig, len: usize, p: Precision) -> Result<(Duration, SimStats, SlpReport)> {
    let device = device(dev, 1, fp8);
    let engine = SlpEngine::new(model, device.clone(), slp.clone())?;
    let mut kv = model.new_kv_pool(len.div_ceil(16), 16);
    let tokens = prompt(len, model.cfg.vocab_size);
    let (result, took) = on_clock(|| engine.run(model, &mut kv, &mut BlockTable::default(), &tokens, p, Logits::Last, &mut || false));
    let (_, report) = result?;
    Ok((took, device.stats(), report))
}

/// One DSLP prefill of `len` tokens on fresh simulated devices.
fn dslp_prefill(model: &Model, devs: &[DeviceSpec], fp8: bool, slp: &SlpConfig, len: usize, p: Precision) -> Result<Duration> {
    let devices: Vec<Arc<dyn Device>> = devs.iter().enumerate().map(|(i, d)| device(d, 1 + i as u64, fp8) as Arc<dyn Device>).collect();
    let engine = DslpEngine::new(model, devices, slp.clone())?;
    let mut kv = model.new_kv_pool(len.div_ceil(16), 16);
    let tokens = prompt(len, model.cfg.vocab_size);
    let (result, took) = on_clock(|| engine.run(model, &mut kv, &mut BlockTable::default(), &tokens, p, Logits::Last, &mut || false));
    result?;
    Ok(took)
}

/// Sequences of `ctx` positions each (their cache is not filled: simulated
/// attention reads nothing), ready to decode `steps` more.
fn contexts(model: &Model, batch: usize, ctx: usize, steps: usize) -> Result<(duplex_model::KvPool, Vec<BlockTable>)> {
    let per_seq = (ctx + steps).div_ceil(16);
    let mut kv = model.new_kv_pool(per_seq * batch, 16);
    let mut tables = vec![];
    for _ in 0..batch {
        let mut t = BlockTable::default();
        kv.reserve(&mut t, ctx + steps)?;
        t.len = ctx;
        tables.push(t);
    }
    Ok((kv, tables))
}

/// The CPU placement's decode step at batch `batch`, context `ctx`.
fn cpu_decode(model: &Model, cpu: &SimCpu, batch: usize, ctx: usize, steps: usize, p: Precision) -> Result<Duration> {
    let (mut kv, mut tables) = contexts(model, batch, ctx, steps)?;
    let mut last = Duration::ZERO;
    for step in 0..steps {
        let tokens: Vec<[u32; 1]> = (0..batch).map(|i| [(i + step) as u32 % 100]).collect();
        let mut seqs: Vec<SeqInput> = tables.iter_mut().zip(&tokens).map(|(table, t)| SeqInput { table, tokens: t }).collect();
        let (r, took) = on_clock(|| model.forward_batch_on(cpu.backend(), &mut kv, &mut seqs, p, Logits::Last, &mut ForwardTimings::default(), 0));
        r?;
        last = took;
    }
    Ok(last)
}

/// Where a step's time went: busy time of the device's compute, of its
/// links (weights and bulk copies; a compute stream's own copies), and of
/// the CPU pool.
#[derive(Clone, Copy, Debug, Default)]
struct Busy {
    compute: Duration,
    links: Duration,
    inline_copies: Duration,
    cpu: Duration,
}

impl Busy {
    fn of(dev: &SimDevice, cpu: &SimCpu) -> Busy {
        let s = dev.stats();
        Busy { compute: s.compute_busy, links: s.h2d_busy + s.d2h_busy, inline_copies: s.inline_copies_busy, cpu: cpu.busy() }
    }

    fn since(self, before: Busy) -> Busy {
        Busy { compute: self.compute - before.compute, links: self.links - before.links, inline_copies: self.inline_copies - before.inline_copies, cpu: self.cpu - before.cpu }
    }

    /// Each as a share of `step`.
    fn shares(&self, step: Duration) -> String {
        let pct = |d: Duration| 100.0 * secs(d) / secs(step).max(1e-12);
        format!("{:.0}% / {:.0}% / {:.0}%", pct(self.compute), pct(self.links + self.inline_copies), pct(self.cpu))
    }
}

/// The hybrid placement's decode step at batch `batch`, context `ctx` (the
/// last of `steps`), and where its time went.
fn hybrid_decode(engine: &mut HybridEngine, dev: &SimDevice, cpu: &SimCpu, batch: usize, ctx: usize, steps: usize, p: Precision) -> Result<(Duration, Busy)> {
    let (mut kv, mut tables) = contexts(&engine.model, batch, ctx, steps)?;
    let dseqs = tables.iter().map(|t| engine.admit(&kv, t, ctx + steps)).collect::<Result<Vec<_>, _>>()?;
    let refs: Vec<_> = dseqs.iter().collect();
    let mut last = (Duration::ZERO, Busy::default());
    let mut outcome = Ok(());
    for step in 0..steps {
        let tokens: Vec<[u32; 1]> = (0..batch).map(|i| [(i + step) as u32 % 100]).collect();
        let mut seqs: Vec<SeqInput> = tables.iter_mut().zip(&tokens).map(|(table, t)| SeqInput { table, tokens: t }).collect();
        let before = Busy::of(dev, cpu);
        let (r, took) = on_clock(|| engine.forward(&mut kv, &mut seqs, &refs, p, Logits::Last));
        if let Err(e) = r {
            outcome = Err(e.into());
            break;
        }
        last = (took, Busy::of(dev, cpu).since(before));
    }
    for d in dseqs {
        engine.release(d)?;
    }
    outcome.map(|_| last)
}

fn secs(d: Duration) -> f64 {
    d.as_secs_f64()
}

/// Milliseconds, to four significant figures at least.
fn ms(d: Duration) -> String {
    let ms = d.as_secs_f64() * 1e3;
    if ms >= 1000.0 {
        format!("{ms:.0}")
    } else {
        format!("{ms:.4}")
    }
}

pub fn run(args: SimulateArgs) -> Result<()> {
    if args.prompts.contains(&0) || args.batches.contains(&0) || args.decode_steps == 0 || args.threads == Some(0) || args.device_threads == 0 {
        bail!("--prompts, --batches, --decode-steps, --threads and --device-threads take counts of at least 1");
    }
    if args.calibrate || args.validate {
        let c = Calibration { threads: args.threads.unwrap_or(0), device_threads: args.device_threads, emulated_h2d_gb_per_s: Some(args.emulated_h2d_gb_per_s), ..Calibration::default() };
        let hw = calibrate::this_machine(&c)?;
        if args.calibrate {
            let text = calibrate::to_toml(&hw);
            match &args.out {
                Some(path) => {
                    std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))?;
                    println!("wrote {}", path.display());
                }
                None => print!("{text}"),
            }
            return Ok(());
        }
        return validate(&args, &hw);
    }
    let hw = hardware(&args.hardware)?;
    let dir = model_dir(&args.model, args.scratch.as_deref())?;
    let threads = args.threads.unwrap_or_else(|| hw.cpu.cores());
    // The engines' own CPU pool stays small: simulated kernels compute nothing.
    let pool = duplex_kernels::pool::PoolConfig::split(1, 1).map_err(anyhow::Error::msg)?;
    let t0 = Instant::now();
    let model = Model::load_with(&dir, &pool, &mut |_, _| {})?;
    let p: Precision = args.dtype.into();
    let cfg = &model.cfg;
    println!("# {} on {}{}", args.model, hw.name, if args.fp8_products { " (what if: FP8 weights multiplied at the FP8 peak)" } else { "" });
    println!("{} layers, hidden {}, {} routed experts (top {}), {:?}; CPU: {} threads; devices: {} (model loaded in {:.1} s)\n", cfg.num_hidden_layers, cfg.hidden_size, cfg.n_routed_experts, cfg.num_experts_per_tok, p, threads, hw.devices.iter().map(|d| d.name.as_str()).collect::<Vec<_>>().join(", "), t0.elapsed().as_secs_f64());
    let cpu = Arc::new(SimCpu::new(hw.cpu.clone(), threads, 1));
    let slp = SlpConfig { dense_budget_bytes: args.dense_budget_mib << 20, ..Default::default() };
    if matches!(args.workload, Workload::Scenarios | Workload::Open | Workload::Chat) {
        return serve(&args, &hw, model, cpu, slp, p);
    }
    let mut prefill = vec![];
    if matches!(args.workload, Workload::Prefill | Workload::All) {
        prefill = prefill_sweep(&args, &hw, &model, &cpu, &slp, p)?;
    }
    let mut decode = vec![];
    if matches!(args.workload, Workload::Decode | Workload::All) {
        decode = decode_table(&args, &hw, model, &cpu, p)?;
    }
    if let Some(path) = &args.plot {
        crate::simulate_plot::write(path, &format!("{} on {}", args.model, hw.name), &prefill, &decode)?;
        println!("plot: {}", path.display());
    }
    Ok(())
}

/// The serving workloads, on the disaggregated deployment: the first
/// device prefills, the second decodes beside the CPU.
fn serve(args: &SimulateArgs, hw: &Hardware, model: Model, cpu: Arc<SimCpu>, slp: SlpConfig, p: Precision) -> Result<()> {
    let [prefill_spec, decode_spec, ..] = hw.devices.as_slice() else {
        bail!("serving workloads simulate the disaggregated deployment, a prefill device and a decode device; {} describes {}", hw.name, hw.devices.len());
    };
    let (router, decode) = serving_configs(&args.settings)?;
    let mode = match args.workload {
        Workload::Scenarios => Mode::Scenarios,
        Workload::Open => Mode::Open,
        _ => {
            if [args.chat_turns, args.chat_first_tokens, args.chat_message_tokens, args.chat_answer_tokens].contains(&0) {
                bail!("--chat-turns, --chat-first-tokens, --chat-message-tokens and --chat-answer-tokens take counts of at least 1");
            }
            Mode::Chat(Chat { turns: args.chat_turns, first_tokens: args.chat_first_tokens, message_tokens: args.chat_message_tokens, answer_tokens: args.chat_answer_tokens, per_turn: vec![] })
        }
    };
    let settings = ServeSettings {
        mode,
        scenarios: args.scenario.clone(),
        long_prompt_tokens: args.long_prompt_tokens,
        long_output_tokens: args.long_output_tokens,
        short_prompt_tokens: args.short_prompt_tokens,
        decode_tokens: args.decode_tokens,
        rate: args.rate,
        requests: args.requests,
        prompt_tokens: args.prompt_tokens.clone(),
        output_tokens: args.output_tokens.clone(),
        seed: args.seed,
        dslp: !args.no_dslp,
        router,
        decode,
    };
    if !(settings.rate.is_finite() && settings.rate > 0.0) || settings.requests == 0 {
        bail!("--rate must be a positive number and --requests at least 1");
    }
    let devices = [device(prefill_spec, 1, args.fp8_products), device(decode_spec, 7, args.fp8_products), device(decode_spec, 2, args.fp8_products)];
    let mut deployment = Deployment::new(model, devices, cpu, slp, &settings, p)?;
    let report = simulate_serve::run(&mut deployment, &settings, &args.model, &hw.name)?;
    if let Some(path) = &args.out {
        std::fs::write(path, report.to_json()?).with_context(|| format!("writing {}", path.display()))?;
        println!("report: {}", path.display());
    }
    if let Some(path) = &args.plot {
        crate::loadgen::plot::write(path, &report)?;
        println!("plot: {}", path.display());
    }
    Ok(())
}

/// The router's and the decode worker's settings: their defaults, with
/// each `--set KEY=VALUE` applied to whichever has the key.
fn serving_configs(sets: &[String]) -> Result<(RouterConfig, DecodeConfig)> {
    let mut router = serde_json::to_value(RouterConfig::default())?;
    let mut decode = serde_json::to_value(DecodeConfig::default())?;
    for set in sets {
        let (key, text) = set.split_once('=').with_context(|| format!("--set {set:?}: expected KEY=VALUE"))?;
        // Numbers and booleans as such; anything else is a string.
        let value = serde_json::from_str(text).unwrap_or_else(|_| serde_json::Value::String(text.into()));
        let mut found = false;
        for config in [&mut router, &mut decode] {
            if let Some(slot) = config.get_mut(key) {
                *slot = value.clone();
                found = true;
            }
        }
        if !found {
            bail!("--set {key}: neither a router nor a decode-worker setting (see deploy/duplex.toml)");
        }
    }
    let router: RouterConfig = serde_json::from_value(router).context("--set: the router's settings")?;
    let decode: DecodeConfig = serde_json::from_value(decode).context("--set: the decode worker's settings")?;
    router.validate().map_err(|e| anyhow::anyhow!("--set: {e}"))?;
    Ok((router, decode))
}

fn prefill_sweep(args: &SimulateArgs, hw: &Hardware, model: &Model, cpu: &SimCpu, slp: &SlpConfig, p: Precision) -> Result<Vec<PrefillPoint>> {
    println!("## Prefill (TTFT, virtual time)\n");
    println!("| prompt tokens | CPU ms | SLP, 1 device ms | SLP tokens/s | device compute / transfer busy | DSLP, {} devices ms | DSLP ÷ SLP |", hw.devices.len());
    println!("| --- | --- | --- | --- | --- | --- | --- |");
    let mut turning_point = None;
    let mut points = vec![];
    for &len in &args.prompts {
        if len > model.cfg.max_position_embeddings {
            println!("| {len} | longer than the model's {} positions | | | | | |", model.cfg.max_position_embeddings);
            continue;
        }
        let (on_cpu, _) = cpu_prefill(model, cpu, len, p)?;
        let (slp_time, dslp_time, busy) = match hw.devices.first() {
            Some(d) => {
                let (t, stats, _) = slp_prefill(model, d, args.fp8_products, slp, len, p)?;
                let dslp = if hw.devices.len() >= 2 { Some(dslp_prefill(model, &hw.devices, args.fp8_products, slp, len, p)?) } else { None };
                (Some(t), dslp, format!("{:.0}% / {:.0}%", 100.0 * secs(stats.compute_busy) / secs(t), 100.0 * secs(stats.h2d_busy) / secs(t)))
            }
            None => (None, None, "-".into()),
        };
        points.push(PrefillPoint { tokens: len, cpu: on_cpu, slp: slp_time, dslp: dslp_time });
        if turning_point.is_none() && slp_time.is_some_and(|s| s < on_cpu) {
            turning_point = Some(len);
        }
        let f = |d: Option<Duration>| d.map_or("-".into(), ms);
        let ratio = match (slp_time, dslp_time) {
            (Some(s), Some(d)) => format!("{:.2}×", secs(s) / secs(d)),
            _ => "-".into(),
        };
        println!("| {len} | {} | {} | {} | {busy} | {} | {ratio} |", ms(on_cpu), f(slp_time), slp_time.map_or("-".into(), |s| format!("{:.0}", len as f64 / secs(s))), f(dslp_time));
    }
    match turning_point {
        Some(len) => println!("\nSLP beats CPU prefill from {len} tokens (the sweep's first length where it does)."),
        None => println!("\nSLP beats CPU prefill at none of these lengths."),
    }
    println!();
    Ok(points)
}

fn decode_table(args: &SimulateArgs, hw: &Hardware, model: Model, cpu: &Arc<SimCpu>, p: Precision) -> Result<Vec<DecodePoint>> {
    println!("## Decode (per step, virtual time)\n");
    println!("| context | batch | CPU placement tokens/s | hybrid placement tokens/s (total) | hybrid step ms | hybrid: device compute / links / CPU busy |");
    println!("| --- | --- | --- | --- | --- | --- |");
    let max_positions = model.cfg.max_position_embeddings;
    let (contexts, too_long): (Vec<usize>, Vec<usize>) = args.contexts.iter().partition(|&&c| c + args.decode_steps <= max_positions);
    let mut cpu_rates = vec![];
    for &ctx in &contexts {
        for &b in &args.batches {
            let t = cpu_decode(&model, cpu, b, ctx, args.decode_steps, p)?;
            cpu_rates.push(((ctx, b), b as f64 / secs(t)));
        }
    }
    let mut hybrid = match hw.devices.last() {
        Some(d) => {
            let positions = contexts.iter().max().copied().unwrap_or(0) + args.decode_steps;
            let blocks = positions.div_ceil(16) * args.batches.iter().max().copied().unwrap_or(1);
            let cfg = HybridConfig { kv_blocks: blocks, micro_batches: true, defer_experts: 0, cpu_jitter: None, submit: Submit::Stream, expert_cache: None };
            let dev = device(d, 7, args.fp8_products);
            // A placement that does not fit is a finding, not a failure of the run.
            match HybridEngine::new(model, dev.clone(), cfg, 16) {
                Ok(mut e) => {
                    e.set_expert_pool(cpu.clone());
                    Some((e, dev))
                }
                Err(e) => {
                    println!("(the hybrid placement does not run on {}: {e})\n", d.name);
                    None
                }
            }
        }
        None => None,
    };
    let mut points = vec![];
    for ((ctx, b), cpu_rate) in cpu_rates {
        let (hybrid_rate, ms, busy) = match hybrid.as_mut() {
            Some((e, dev)) => {
                let (t, busy) = hybrid_decode(e, dev, cpu, b, ctx, args.decode_steps, p)?;
                (Some(b as f64 / secs(t)), ms(t), busy.shares(t))
            }
            None => (None, "-".into(), "-".into()),
        };
        println!("| {ctx} | {b} | {cpu_rate:.1} | {} | {ms} | {busy} |", hybrid_rate.map_or("-".into(), |r| format!("{r:.1}")));
        points.push(DecodePoint { context: ctx, batch: b, cpu: cpu_rate, hybrid: hybrid_rate });
    }
    for ctx in too_long {
        println!("| {ctx} | | longer than the model's {max_positions} positions | | | |");
    }
    println!();
    Ok(points)
}

/// Predictions for this machine, from `hw` (just calibrated), beside real
/// runs of the same workloads, interleaved.
fn validate(args: &SimulateArgs, hw: &Hardware) -> Result<()> {
    let dir = model_dir(&args.model, args.scratch.as_deref())?;
    let threads = args.threads.unwrap_or_else(|| hw.cpu.cores());
    let pool = duplex_kernels::pool::PoolConfig::split(threads, 1).map_err(anyhow::Error::msg)?;
    let model = Model::load_with(&dir, &pool, &mut |_, _| {})?;
    let p: Precision = args.dtype.into();
    let cpu = SimCpu::new(hw.cpu.clone(), threads, 1);
    let emulated = hw.devices.first().context("the calibration describes no emulated device")?;
    println!("# Predictions for this machine against real runs ({} on {threads} threads, {p:?})\n", dir.display());
    println!("| workload | predicted s | measured s min / median / max | predicted ÷ measured (median) |");
    println!("| --- | --- | --- | --- |");
    let repeats = 3;
    let row = |label: String, predicted: Duration, measured: &mut Vec<f64>| {
        measured.sort_by(f64::total_cmp);
        let median = measured[measured.len() / 2];
        println!("| {label} | {:.4} | {:.4} / {:.4} / {:.4} | {:.2} |", secs(predicted), measured[0], median, measured[measured.len() - 1], secs(predicted) / median);
    };
    // CPU decode at each context: the real engine's step against the simulated one's.
    for &ctx in &[512usize, 4096] {
        if ctx + args.decode_steps > model.cfg.max_position_embeddings {
            continue;
        }
        let mut measured = vec![];
        let mut predicted = Duration::ZERO;
        for _ in 0..repeats {
            predicted = cpu_decode(&model, &cpu, 1, ctx, args.decode_steps, p)?;
            let (mut kv, mut tables) = contexts(&model, 1, ctx, args.decode_steps)?;
            let mut t = 0.0;
            for step in 0..args.decode_steps {
                let tokens = [step as u32 % 100];
                let mut seqs = [SeqInput { table: &mut tables[0], tokens: &tokens }];
                let started = Instant::now();
                model.forward_batch(&mut kv, &mut seqs, p, Logits::Last, &mut ForwardTimings::default())?;
                t = started.elapsed().as_secs_f64();
            }
            measured.push(t);
        }
        row(format!("CPU decode step, context {ctx}"), predicted, &mut measured);
    }
    let mut splits = vec![];
    for &len in &[512usize, 2048] {
        let mut measured = vec![];
        let (mut predicted, mut split) = (Duration::ZERO, (ForwardTimings::default(), ForwardTimings::default()));
        for _ in 0..repeats {
            let (t, timings) = cpu_prefill(&model, &cpu, len, p)?;
            predicted = t;
            let mut kv = model.new_kv_pool(len.div_ceil(16), 16);
            let mut table = BlockTable::default();
            let tokens = prompt(len, model.cfg.vocab_size);
            let mut real = ForwardTimings::default();
            let started = Instant::now();
            for c in tokens.chunks(512) {
                model.forward_batch(&mut kv, &mut [SeqInput { table: &mut table, tokens: c }], p, Logits::Last, &mut real)?;
            }
            measured.push(started.elapsed().as_secs_f64());
            split = (timings, real);
        }
        row(format!("CPU prefill, {len} tokens"), predicted, &mut measured);
        splits.push((len, split));
    }
    // SLP on the emulated device, its copies paced as the description says.
    let slp = SlpConfig { dense_budget_bytes: args.dense_budget_mib << 20, ..Default::default() };
    let mut slp_split = None;
    for &len in &[512usize] {
        let mut measured = vec![];
        let mut predicted = Duration::ZERO;
        let mut split = (SlpReport::default(), SlpReport::default());
        let (mut per_op, mut measured_per_op) = (vec![], vec![]);
        for _ in 0..repeats {
            let (t, stats, predicted_report) = slp_prefill(&model, emulated, false, &slp, len, p)?;
            predicted = t;
            per_op = stats.per_op;
            let real = EmulatedDevice::new(EmulatedConfig { memory_bytes: (emulated.memory_gib * (1u64 << 30) as f64) as usize, h2d_bytes_per_second: Some(args.emulated_h2d_gb_per_s * 1e9), compute_threads: args.device_threads, jitter: None })?;
            let engine = SlpEngine::new(&model, real.clone(), slp.clone())?;
            let mut kv = model.new_kv_pool(len.div_ceil(16), 16);
            let tokens = prompt(len, model.cfg.vocab_size);
            let started = Instant::now();
            let (_, report) = engine.run(&model, &mut kv, &mut BlockTable::default(), &tokens, p, Logits::Last, &mut || false)?;
            measured.push(started.elapsed().as_secs_f64());
            split = (predicted_report, report);
            measured_per_op = real.stats().per_op;
        }
        row(format!("SLP prefill on the emulated device, {len} tokens, copies at {:.1} GB/s", args.emulated_h2d_gb_per_s), predicted, &mut measured);
        slp_split = Some((len, split, per_op, measured_per_op));
    }
    println!("\nWhere the time went (predicted / measured, the last round):\n");
    println!("| workload | attention s | FFN s | device compute s | transfer s |");
    println!("| --- | --- | --- | --- | --- |");
    for (len, (sim, real)) in splits {
        println!("| CPU prefill, {len} tokens | {:.3} / {:.3} | {:.3} / {:.3} | | |", secs(sim.attention), secs(real.attention), secs(sim.ffn), secs(real.ffn));
    }
    if let Some((len, (sim, real), per_op, measured_per_op)) = slp_split {
        let sum = |r: &SlpReport, f: fn(&LayerTiming) -> Duration| secs(r.layers.iter().map(f).sum());
        println!("| SLP prefill, {len} tokens | | | {:.3} / {:.3} | {:.3} / {:.3} |", sum(&sim, |l| l.compute), sum(&real, |l| l.compute), sum(&sim, |l| l.transfer), sum(&real, |l| l.transfer));
        println!("\nKernel time of the SLP prefill by op, predicted / measured (s):\n");
        println!("| op | predicted s | measured s |");
        println!("| --- | --- | --- |");
        for (op, t) in &per_op {
            let real = measured_per_op.iter().find(|(o, _)| o == op).map_or(0.0, |(_, t)| secs(*t));
            println!("| {op} | {:.3} | {real:.3} |", secs(*t));
        }
    }
    Ok(())
}
