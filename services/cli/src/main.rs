//! `duplex`: the command line of the Duplex inference engine.
//!
//! `generate` runs one prompt (text, chat message or raw token ids) and
//! streams the continuation; `logits` writes the teacher-forced logits of a
//! token sequence to a safetensors file, for comparison with other engines;
//! `synth` writes a synthetic checkpoint of a given shape, or prints its plan;
//! `bench` drives a running server with load and reports its latencies.

use anyhow::{bail, Context, Result};
use clap::{Args, Parser, Subcommand};
use duplex_model::generation::{sampling_defaults, Engine, GenerationParams};
use duplex_toolkit::synth::{self, SynthConfig, WriteOptions};
use duplex_model::tokenizer::ChatMessage;
use duplex_model::{BlockTable, Logits, Model, Precision};
use duplex_kernels::pool::PoolConfig;
use indicatif::{ProgressBar, ProgressStyle};

mod bench;
mod bench_decode;
mod bench_experts;
mod bench_slp;
mod loadgen;
mod serve;
mod simulate;
mod simulate_plot;
mod simulate_serve;
use std::io::Write;
use std::path::{Path, PathBuf};


#[derive(Parser)]
#[command(name = "duplex", version, about = "Duplex: DeepSeek-V3-family inference on one workstation")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Generate a continuation of a prompt.
    Generate(GenerateArgs),
    /// Write the teacher-forced logits of a token sequence to a safetensors file.
    Logits(LogitsArgs),
    /// Write a synthetic DeepSeek-V3, Qwen3-MoE or Mixtral checkpoint (random weights, real layout), or print its plan.
    Synth(SynthArgs),
    /// Benchmark the CPU kernels against the measured DRAM read bandwidth.
    BenchKernels(BenchKernelsArgs),
    /// Benchmark the engine's decode and prefill of a model against its roofline (in process, no server).
    BenchEngine(BenchArgs),
    /// Stream-loading prefill on an emulated accelerator: transfer, compute and their overlap, per layer.
    BenchSlp(bench_slp::BenchSlpArgs),
    /// Hybrid decode on an emulated accelerator: device and CPU time and their overlap per layer, batch 1 and 2.
    BenchDecode(bench_decode::BenchDecodeArgs),
    /// Predict prefill and decode on described hardware (virtual clock, real engines); --calibrate describes this machine.
    Simulate(simulate::SimulateArgs),
    /// Load a running server over gRPC: the paper's concurrency scenarios, or open-loop Poisson arrivals.
    Bench(loadgen::LoadArgs),
    /// Serve a model: start the router and both workers, restart them if they die.
    Serve(serve::ServeArgs),
    /// Run the router alone (`duplex serve` starts it).
    Router(duplex_router::config::RouterArgs),
    /// Run the prefill worker alone (`duplex serve` starts it).
    Prefill(duplex_prefill::config::PrefillArgs),
    /// Run the decode worker alone (`duplex serve` starts it).
    Decode(duplex_decode::config::DecodeArgs),
}

#[derive(Args)]
struct PoolArgs {
    /// Worker threads (default: every core).
    #[arg(long)]
    threads: Option<usize>,
    /// Split the threads into this many NUMA nodes (simulated on one-node machines).
    #[arg(long, default_value_t = 1)]
    numa_nodes: usize,
}

impl PoolArgs {
    fn config(&self) -> Result<PoolConfig> {
        if self.threads == Some(0) {
            bail!("--threads must be positive");
        }
        PoolConfig::split(self.threads.unwrap_or(0), self.numa_nodes).map_err(|e| anyhow::anyhow!("--threads/--numa-nodes: {e}"))
    }
}

#[derive(Args)]
struct BenchKernelsArgs {
    #[command(flatten)]
    pool: PoolArgs,
    /// Size of each weight buffer streamed through the kernels, in MiB (keep it far above L3); there are four (FP8, Q4_K, Q6_K, and Q4_K_M MoE layers), made once.
    #[arg(long, default_value_t = 1536)]
    buffer_mib: usize,
    /// Best of this many passes.
    #[arg(long, default_value_t = 5)]
    passes: usize,
    /// Stream the GEMV and MoE-layer weights from a file in this directory,
    /// made as the weight segment is (a tmpfs such as /dev/shm, or a
    /// hugetlbfs mount for huge pages), instead of process memory. The DRAM
    /// read limit is measured on process memory either way.
    #[arg(long)]
    buffer_dir: Option<PathBuf>,
}

#[derive(Args)]
struct BenchArgs {
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    pool: PoolArgs,
    /// Contexts at which to measure decode.
    #[arg(long, value_delimiter = ',', default_value = "512,4096")]
    contexts: Vec<usize>,
    /// Decode steps timed at each context.
    #[arg(long, default_value_t = 32)]
    decode_tokens: usize,
    /// Times the decode steps are repeated from the same context; the best
    /// round counts, as the best pass does for the bandwidth.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..))]
    decode_rounds: u32,
    /// Prompt lengths at which to measure prefill.
    #[arg(long, value_delimiter = ',', default_value = "512,2048")]
    prefill: Vec<usize>,
    /// Buffer for the bandwidth measurement, in MiB.
    #[arg(long, default_value_t = 1536)]
    buffer_mib: usize,
    /// Load the model from its weight segment in this directory (built there
    /// if missing or stale, and left there for the next run) rather than
    /// from the checkpoint files: the segment the workers map, in /dev/shm
    /// or in a hugetlbfs or huge-page tmpfs mount.
    #[arg(long)]
    weights_dir: Option<PathBuf>,
}

#[derive(Args)]
struct ModelArgs {
    /// The model: a Hugging Face directory (config.json, safetensors), a GGUF file (any part of a split set) or a directory holding one GGUF model. Defaults to the bundled tiny model.
    #[arg(long, default_value_os_t = duplex_model::bundled_model())]
    model: PathBuf,
    /// Numeric path: f32 (reference) or bf16.
    #[arg(long, default_value = "bf16")]
    dtype: Precision,
    /// Override a GGUF model's metadata key, KEY=TYPE:VALUE (TYPE int, float, bool or str), as llama.cpp's --override-kv: e.g. deepseek2.rope.scaling.yarn_beta_fast=float:32. Repeatable; it changes the model, not its tokenizer.
    #[arg(long)]
    override_kv: Vec<String>,
}

impl ModelArgs {
    /// The model `--model` names, with its `--override-kv`s.
    fn source(&self) -> Result<duplex_model::source::ModelSource> {
        Ok(duplex_model::source::ModelSource::locate_with(&self.model, &self.override_kv)?)
    }
}

#[derive(Args)]
#[group(id = "input", required = true, multiple = false)]
struct PromptInput {
    /// Plain text prompt (BOS is added as the tokenizer config says).
    #[arg(long, group = "input")]
    prompt: Option<String>,
    /// A user message, rendered with the model's chat template.
    #[arg(long, group = "input")]
    chat: Option<String>,
    /// Comma-separated token ids, used as they are.
    #[arg(long, group = "input")]
    tokens: Option<String>,
}

#[derive(Args)]
struct GenerateArgs {
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    input: PromptInput,
    /// System message for --chat.
    #[arg(long, requires = "chat")]
    system: Option<String>,
    /// Maximum number of tokens to generate.
    #[arg(long, default_value_t = 64)]
    max_tokens: usize,
    /// Sampling temperature; 0 is greedy. Default: generation_config.json, else 1.
    #[arg(long, allow_negative_numbers = true)]
    temperature: Option<f32>,
    /// Nucleus sampling mass. Default: generation_config.json, else 1 (off).
    #[arg(long, allow_negative_numbers = true)]
    top_p: Option<f32>,
    /// Keep the K most likely tokens; 0 is off.
    #[arg(long)]
    top_k: Option<usize>,
    /// Drop tokens below min_p times the top probability; 0 is off.
    #[arg(long, allow_negative_numbers = true)]
    min_p: Option<f32>,
    #[arg(long, allow_negative_numbers = true)]
    repetition_penalty: Option<f32>,
    #[arg(long, allow_negative_numbers = true)]
    presence_penalty: Option<f32>,
    #[arg(long, allow_negative_numbers = true)]
    frequency_penalty: Option<f32>,
    /// RNG seed; equal seeds give equal outputs.
    #[arg(long)]
    seed: Option<u64>,
    /// Stop when this string is generated (repeatable); it is not printed.
    #[arg(long)]
    stop: Vec<String>,
    /// Keep going past end-of-sequence tokens.
    #[arg(long)]
    ignore_eos: bool,
    /// Also report the N most likely tokens at each step (with --json).
    #[arg(long)]
    logprobs: Option<usize>,
    /// Prefill the prompt in chunks of this many tokens.
    #[arg(long, default_value_t = 512)]
    prefill_chunk: usize,
    /// Context length to allocate KV cache for (capped at the model's maximum).
    #[arg(long, default_value_t = 8192)]
    max_context: usize,
    /// Print one JSON object instead of streaming text.
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
struct LogitsArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Comma-separated token ids.
    #[arg(long)]
    tokens: String,
    /// Output safetensors file; tensor `logits`, F32, `[T, vocab_size]`.
    #[arg(long)]
    out: PathBuf,
}

#[derive(Args)]
#[group(id = "shape", required = true, multiple = false)]
struct SynthShape {
    /// Named shape: tiny, tiny-qwen3moe, tiny-qwen3moe-fp8, tiny-mixtral (the bundled models'), bench (DeepSeek-V3 family, ~5 GB),
    /// qwen3-30b-a3b, qwen3-30b-a3b-fp8, mixtral-8x7b (real layer shapes, fewer layers and experts) or deepseek-v3 (671B; --plan only).
    #[arg(long, group = "shape")]
    preset: Option<String>,
    /// A config.json to synthesise instead of a preset.
    #[arg(long, group = "shape")]
    config: Option<PathBuf>,
}

#[derive(Args)]
struct SynthArgs {
    #[command(flatten)]
    shape: SynthShape,
    /// Output directory (created if needed).
    #[arg(long, required_unless_present = "plan")]
    out: Option<PathBuf>,
    /// RNG seed; equal seeds give byte-identical checkpoints.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Largest shard, e.g. 512M or 2G (binary units).
    #[arg(long, default_value = "1G", value_parser = synth::parse_size)]
    shard_size: u64,
    /// Refuse to write a checkpoint bigger than this (not applied with --hollow, which takes no disk).
    #[arg(long, default_value = "100G", value_parser = synth::parse_size)]
    max_size: u64,
    /// Write the files, headers and index but no tensor bytes: sparse shards that read as zeros and take no disk.
    /// For `duplex simulate` on models too big to store (any size, e.g. --config deploy/models/deepseek-r1/config.json);
    /// such a checkpoint computes garbage if run for real.
    #[arg(long)]
    hollow: bool,
    /// Replace a checkpoint already in --out.
    #[arg(long)]
    force: bool,
    /// Print the tensor plan's byte counts instead of writing anything.
    #[arg(long)]
    plan: bool,
    /// With --plan: print one JSON object.
    #[arg(long, requires = "plan")]
    json: bool,
}

fn main() {
    if let Err(e) = run(Cli::parse()) {
        // A reader that went away (`duplex generate ... | head`) is not an error.
        if e.chain().any(|c| c.downcast_ref::<std::io::Error>().is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe)) {
            return;
        }
        // Print the cause chain, skipping causes a message already quoted.
        let mut message = String::new();
        for cause in e.chain() {
            let text = cause.to_string();
            if !message.contains(&text) {
                if !message.is_empty() {
                    message.push_str(": ");
                }
                message.push_str(&text);
            }
        }
        eprintln!("error: {message}");
        std::process::exit(1);
    }
}

fn block_on(service: impl std::future::Future<Output = Result<()>>) -> Result<()> {
    tokio::runtime::Runtime::new()?.block_on(service)
}

fn run(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Generate(args) => generate(args),
        Command::Serve(args) => serve::run(args),
        Command::Router(args) => {
            let config = args.resolve()?;
            duplex_model::check_model_dir(&config.model).map_err(anyhow::Error::msg)?;
            block_on(duplex_router::run(config))
        }
        Command::Prefill(args) => {
            let config = args.resolve()?;
            duplex_model::check_model_dir(&config.model).map_err(anyhow::Error::msg)?;
            block_on(duplex_prefill::run(config))
        }
        Command::Decode(args) => {
            let config = args.resolve()?;
            duplex_model::check_model_dir(&config.model).map_err(anyhow::Error::msg)?;
            block_on(duplex_decode::run(config))
        }
        Command::Logits(args) => logits(args),
        Command::Synth(args) => synth(args),
        Command::BenchKernels(args) => bench::kernels(args),
        Command::BenchEngine(args) => bench::end_to_end(args),
        Command::BenchSlp(args) => bench_slp::run_bench(args),
        Command::BenchDecode(args) => bench_decode::run(args),
        Command::Simulate(args) => simulate::run(args),
        Command::Bench(args) => loadgen::run(args),
    }
}

fn parse_tokens(s: &str) -> Result<Vec<u32>> {
    let ids = s
        .split(',')
        .map(|t| t.trim())
        .filter(|t| !t.is_empty())
        .map(|t| t.parse::<u32>().with_context(|| format!("--tokens: {t:?} is not a token id")))
        .collect::<Result<Vec<_>>>()?;
    if ids.is_empty() {
        bail!("--tokens: no token ids given");
    }
    Ok(ids)
}

/// A progress bar on stderr for loading (hidden when stderr is not a terminal).
fn load_progress(dir: &Path) -> (ProgressBar, impl FnMut(usize, usize)) {
    let bar = ProgressBar::new(0).with_message(format!("loading {}", dir.display()));
    bar.set_style(ProgressStyle::with_template("{msg} [{bar:30}] layer {pos}/{len} {elapsed}").expect("valid template"));
    let b = bar.clone();
    (bar, move |done, total| {
        b.set_length(total as u64);
        b.set_position(done as u64);
    })
}

fn generate(args: GenerateArgs) -> Result<()> {
    let dir = &args.model.model;
    duplex_model::check_model_dir(dir).map_err(anyhow::Error::msg)?;
    let (bar, mut progress) = load_progress(dir);
    let mut engine = Engine::load_with(dir, &args.model.override_kv, args.model.dtype, args.max_context, &mut progress)
        .with_context(|| format!("loading model from {}", dir.display()))?;
    bar.finish_and_clear();

    let tok = &engine.tokenizer;
    let prompt = if let Some(text) = &args.input.prompt {
        tok.encode(text)?
    } else if let Some(user) = &args.input.chat {
        let mut messages = vec![];
        if let Some(system) = &args.system {
            messages.push(ChatMessage::new("system", system.clone()));
        }
        messages.push(ChatMessage::new("user", user.clone()));
        tok.encode_raw(&tok.apply_chat_template(&messages, true)?)?
    } else {
        parse_tokens(args.input.tokens.as_deref().unwrap_or_default())?
    };

    let mut sampling = sampling_defaults(dir);
    let overrides = [
        (&mut sampling.temperature, args.temperature),
        (&mut sampling.top_p, args.top_p),
        (&mut sampling.min_p, args.min_p),
        (&mut sampling.repetition_penalty, args.repetition_penalty),
        (&mut sampling.presence_penalty, args.presence_penalty),
        (&mut sampling.frequency_penalty, args.frequency_penalty),
    ];
    for (field, value) in overrides {
        if let Some(v) = value {
            *field = v;
        }
    }
    if let Some(k) = args.top_k {
        sampling.top_k = k;
    }
    sampling.seed = args.seed;
    sampling.logprobs = args.logprobs;
    let params = GenerationParams {
        max_tokens: args.max_tokens,
        sampling,
        stop: args.stop.clone(),
        ignore_eos: args.ignore_eos,
        prefill_chunk: args.prefill_chunk,
        ..GenerationParams::default()
    };

    let stream = !args.json;
    let mut stdout = std::io::stdout().lock();
    let out = engine.generate(&prompt, &params, &mut |event| {
        if stream && !event.text.is_empty() {
            // A closed stdout (e.g. `| head`) should not abort generation mid-way.
            let _ = write!(stdout, "{}", event.text).and_then(|_| stdout.flush());
        }
    })?;
    if args.json {
        let mut json = serde_json::json!({
            "tokens": out.token_ids(),
            "text": out.text,
            "prompt_tokens": out.prompt_tokens,
            "completion_tokens": out.tokens.len(),
            "finish_reason": out.finish_reason.as_str(),
            "ttft_ms": out.ttft.as_secs_f64() * 1e3,
            "decode_tokens_per_s": out.decode_tokens_per_s(),
        });
        if args.logprobs.is_some() {
            let tok = &engine.tokenizer;
            json["logprobs"] = out
                .tokens
                .iter()
                .map(|t| {
                    serde_json::json!({
                        "token": t.id,
                        "text": tok.token_text(t.id),
                        "logprob": t.logprob,
                        "top_logprobs": t.top_logprobs.iter().map(|(id, lp)| serde_json::json!({"token": id, "text": tok.token_text(*id), "logprob": lp})).collect::<Vec<_>>(),
                    })
                })
                .collect();
        }
        writeln!(stdout, "{json}")?;
    } else {
        writeln!(stdout)?;
        eprintln!(
            "[{} prompt tokens, {} generated ({}), TTFT {:.1} ms, decode {:.1} tokens/s]",
            out.prompt_tokens,
            out.tokens.len(),
            out.finish_reason.as_str(),
            out.ttft.as_secs_f64() * 1e3,
            out.decode_tokens_per_s()
        );
    }
    Ok(())
}

fn logits(args: LogitsArgs) -> Result<()> {
    let dir = &args.model.model;
    duplex_model::check_model_dir(dir).map_err(anyhow::Error::msg)?;
    let tokens = parse_tokens(&args.tokens)?;
    let (bar, mut progress) = load_progress(dir);
    let model = Model::load_source(&args.model.source()?, &duplex_kernels::pool::PoolConfig::all_cores(), &mut progress).with_context(|| format!("loading model from {}", dir.display()))?;
    bar.finish_and_clear();
    let mut pool = model.new_kv_pool(tokens.len().div_ceil(16), 16);
    let logits = model.forward(&mut pool, &mut BlockTable::default(), &tokens, args.model.dtype, Logits::All)?;
    let bytes: Vec<u8> = logits.iter().flat_map(|v| v.to_le_bytes()).collect();
    let view = safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![tokens.len(), model.cfg.vocab_size], &bytes)?;
    safetensors::serialize_to_file([("logits", view)], &None, &args.out)
        .with_context(|| format!("writing {}", args.out.display()))?;
    eprintln!("wrote logits [{}, {}] to {}", tokens.len(), model.cfg.vocab_size, args.out.display());
    Ok(())
}

fn synth(args: SynthArgs) -> Result<()> {
    let (cfg, what) = match (&args.shape.preset, &args.shape.config) {
        (Some(name), _) => (synth::preset(name)?, format!("preset {name}")),
        (None, Some(path)) => (SynthConfig::from_file(path)?, path.display().to_string()),
        (None, None) => bail!("one of --preset and --config is required"),
    };
    if args.plan {
        let summary = synth::summarize(&cfg, &synth::plan(&cfg));
        let mut stdout = std::io::stdout().lock();
        if args.json {
            writeln!(stdout, "{}", serde_json::to_string(&summary)?)?;
        } else {
            writeln!(stdout, "{what}: {summary}")?;
        }
        return Ok(());
    }
    let Some(out) = &args.out else { bail!("--out is required unless --plan is given") };
    let bar = ProgressBar::new(0).with_message(format!("writing {}", out.display()));
    bar.set_style(
        ProgressStyle::with_template("{msg} [{bar:30}] {bytes}/{total_bytes} {binary_bytes_per_sec} eta {eta}").expect("valid template"),
    );
    let opts = WriteOptions { seed: args.seed, shard_size: args.shard_size, force: args.force, max_bytes: Some(args.max_size), hollow: args.hollow };
    let summary = synth::write_checkpoint(&cfg, out, &opts, &mut |done, total| {
        bar.set_length(total);
        bar.set_position(done);
    })
    .with_context(|| format!("synthesising {what}"))?;
    bar.finish_and_clear();
    eprintln!(
        "wrote {}{} ({} tensors, {} shard{}) to {} in {:.1} s ({:.0} MB/s)",
        if args.hollow { "a hollow " } else { "" },
        synth::human_bytes(summary.file_bytes),
        summary.tensors,
        summary.shards,
        if summary.shards == 1 { "" } else { "s" },
        out.display(),
        summary.elapsed.as_secs_f64(),
        summary.mb_per_s()
    );
    Ok(())
}
