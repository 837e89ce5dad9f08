//! `duplex bench`: a load generator that drives a running router over its
//! public gRPC API and measures, on the client, what its users would see.
//!
//! Three modes:
//! - closed loop (`--scenario`): the concurrency scenarios of §4.5 of the
//!   cloud-grade-SLO paper, reported as slowdowns against solo baselines as
//!   its Figure 18 does (see `scenarios`);
//! - open loop (`--rate`): Poisson arrivals with prompt and output lengths
//!   drawn from distributions or read from a JSONL file (see `workload`);
//! - chat (`--chat-turns`): one conversation resent turn by turn, each
//!   turn's TTFT against a fresh prompt of its length (see `chat`): what
//!   prefix caching saves.
//!
//! Every request uses greedy sampling and ignores end-of-sequence tokens, so
//! that output lengths are exactly as asked and runs are comparable.

pub(crate) mod chat;
pub(crate) mod plot;
pub(crate) mod report;
pub(crate) mod scenarios;
pub(crate) mod workload;

use anyhow::{bail, Context, Result};
use clap::{ArgGroup, Args};
use duplex_proto::v1::generation_client::GenerationClient;
use duplex_proto::v1::{generate_request, generate_response, GenerateRequest, ModelInfoRequest, SamplingParameters, StoppingCriteria, TokenIds};
use indicatif::{ProgressBar, ProgressStyle};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use report::{ClosedLoop, OpenLoop, Outcome, Report, RunReport, Sample, Workload};
use scenarios::{Scenarios, Sizes};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tonic::transport::{Channel, Endpoint};
use workload::{Dist, FilePrompt, PromptKind};

#[derive(Args)]
#[command(group(ArgGroup::new("mode").required(true).args(["scenario", "rate", "chat_turns"])))]
pub struct LoadArgs {
    /// The router's gRPC address.
    #[arg(long, default_value = "http://127.0.0.1:50051")]
    target: String,
    /// Closed loop: 1P, 1D, 1P+1D, 2D, 1P+2D, a comma-separated list of them, or all.
    /// Mixes also run the solo baselines they are compared with.
    #[arg(long)]
    scenario: Option<Scenarios>,
    /// Closed loop: how long each scenario keeps its requests going; each
    /// request slot sends at least one request, so 0 runs each exactly once.
    #[arg(long, default_value_t = 3.0, conflicts_with = "rate")]
    scenario_seconds: f64,
    /// Closed loop: prompt tokens of the long-prefill request P.
    #[arg(long, default_value_t = 900, value_parser = clap::value_parser!(u32).range(1..), conflicts_with = "rate")]
    long_prompt_tokens: u32,
    /// Closed loop: output tokens of P.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..), conflicts_with = "rate")]
    long_output_tokens: u32,
    /// Closed loop: prompt tokens of the decode-heavy request D.
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u32).range(1..), conflicts_with = "rate")]
    short_prompt_tokens: u32,
    /// Closed loop: output tokens of D [default: calibrated so that D alone
    /// lasts as long as P alone, within the context].
    #[arg(long, value_parser = clap::value_parser!(u32).range(2..), conflicts_with = "rate")]
    decode_tokens: Option<u32>,
    /// Open loop: mean arrival rate in requests per second (Poisson arrivals).
    #[arg(long)]
    rate: Option<f64>,
    /// Open loop: send arrivals for this many seconds.
    #[arg(long, conflicts_with = "scenario")]
    duration: Option<f64>,
    /// Open loop: send this many requests (with --duration: whichever ends first).
    #[arg(long, conflicts_with = "scenario", value_parser = clap::value_parser!(u64).range(1..))]
    requests: Option<u64>,
    /// Open loop: prompt tokens per request: N, uniform:MIN-MAX or normal:MEAN,SD.
    #[arg(long, default_value = "128", conflicts_with = "scenario")]
    prompt_tokens: Dist,
    /// Open loop: output tokens per request (same syntax), unless the prompt file gives max_tokens.
    #[arg(long, default_value = "64", conflicts_with = "scenario")]
    output_tokens: Dist,
    /// Open loop: prompts from a JSONL file, used in order and cycled: lines
    /// {"prompt": "text", "max_tokens": N} or {"tokens": [ids], "max_tokens": N}.
    #[arg(long, conflicts_with_all = ["scenario", "prompt_tokens"])]
    prompts: Option<PathBuf>,
    /// Chat: hold one conversation of this many turns, each resending the
    /// whole history (the previous answer included) plus a new message; each
    /// turn's TTFT is compared with a fresh prompt of the same length.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    chat_turns: Option<u32>,
    /// Chat: prompt tokens of the first turn.
    #[arg(long, default_value_t = 512, value_parser = clap::value_parser!(u32).range(1..))]
    chat_first_tokens: u32,
    /// Chat: tokens of each later turn's new message.
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u32).range(1..))]
    chat_message_tokens: u32,
    /// Chat: tokens of each answer.
    #[arg(long, default_value_t = 32, value_parser = clap::value_parser!(u32).range(1..))]
    chat_answer_tokens: u32,
    /// Write the full report (settings, every run's statistics and every request) as JSON.
    #[arg(long)]
    out: Option<PathBuf>,
    /// Draw the results as an SVG chart.
    #[arg(long)]
    plot: Option<PathBuf>,
    /// Seed of the random prompts, lengths and arrival times.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Give up on a request after this many seconds (it counts as DeadlineExceeded).
    #[arg(long, default_value_t = 600.0)]
    request_timeout: f64,
}

/// Open-loop schedules beyond this are surely a typo, and would not fit in memory.
const MAX_ARRIVALS: usize = 1_000_000;

impl LoadArgs {
    /// Checks that need no server, so that a typo fails before a long run.
    fn validate(&self) -> Result<()> {
        let positive = |name: &str, v: f64| if v.is_finite() && v > 0.0 { Ok(()) } else { bail!("{name} must be a positive number of seconds, got {v}") };
        if !(self.scenario_seconds.is_finite() && self.scenario_seconds >= 0.0) {
            bail!("--scenario-seconds must be zero or more, got {}", self.scenario_seconds);
        }
        positive("--request-timeout", self.request_timeout)?;
        if let Some(rate) = self.rate {
            if !(rate.is_finite() && rate > 0.0) {
                bail!("--rate must be a positive number of requests per second, got {rate}");
            }
            match (self.duration, self.requests) {
                (None, None) => bail!("--rate needs --duration or --requests to say when to stop"),
                (Some(d), _) => positive("--duration", d)?,
                _ => {}
            }
            let planned = self.duration.map_or(f64::INFINITY, |d| rate * d).min(self.requests.map_or(f64::INFINITY, |n| n as f64));
            if planned > MAX_ARRIVALS as f64 {
                bail!("--rate with --duration/--requests plans about {planned:.0} requests; at most {MAX_ARRIVALS} are allowed");
            }
        }
        if let Some(plot) = &self.plot {
            if !plot.extension().is_some_and(|e| e.eq_ignore_ascii_case("svg")) {
                bail!("--plot draws SVG: give a path ending in .svg, not {}", plot.display());
            }
        }
        for (flag, path) in [("--out", &self.out), ("--plot", &self.plot)] {
            if let Some(dir) = path.as_ref().and_then(|p| p.parent()).filter(|d| !d.as_os_str().is_empty()) {
                if !dir.is_dir() {
                    bail!("cannot write {flag} {}: {} is not a directory", path.as_ref().unwrap().display(), dir.display());
                }
            }
        }
        Ok(())
    }
}

/// A connection to the router, shared by every request (one HTTP/2 stream each).
#[derive(Clone)]
pub struct Client {
    grpc: GenerationClient<Channel>,
    timeout: Duration,
}

/// Prompt and output lengths of a request.
#[derive(Clone, Copy, Debug)]
pub struct Shape {
    pub prompt: u32,
    pub output: u32,
}

/// A greedy request that ignores EOS, so it produces exactly `max_tokens`
/// tokens (or fewer where the context ends).
fn request(prompt: generate_request::Prompt, max_tokens: u32) -> GenerateRequest {
    GenerateRequest {
        prompt: Some(prompt),
        sampling: Some(SamplingParameters { temperature: Some(0.0), ..Default::default() }),
        stopping: Some(StoppingCriteria { max_tokens, ignore_eos: true, ..Default::default() }),
        ..Default::default()
    }
}

/// A request of `shape` whose prompt is fresh random token ids, so that no
/// two requests share a prefix.
pub fn random_prompt(rng: &mut impl Rng, vocab: u32, shape: Shape) -> GenerateRequest {
    let ids = (0..shape.prompt).map(|_| rng.gen_range(0..vocab)).collect();
    request(generate_request::Prompt::Tokens(TokenIds { ids }), shape.output)
}

/// Send one request and time its stream: TTFT to the first token, the gaps
/// between later ones, and the end. Failures are part of the outcome.
pub async fn send(client: &Client, kind: &str, request: GenerateRequest, run_start: Instant) -> Outcome {
    let sent_prompt = match &request.prompt {
        Some(generate_request::Prompt::Tokens(t)) => t.ids.len() as u32,
        _ => 0,
    };
    let mut grpc = client.grpc.clone();
    let (mut tokens, mut token_ids, mut finished) = (vec![], vec![], None);
    let start = Instant::now();
    let result = tokio::time::timeout(client.timeout, async {
        let mut stream = grpc.generate(request).await?.into_inner();
        while let Some(message) = stream.message().await? {
            match message.event {
                Some(generate_response::Event::Token(t)) => {
                    tokens.push(Instant::now());
                    token_ids.push(t.id);
                }
                Some(generate_response::Event::Finished(f)) => {
                    finished = Some(f);
                    break;
                }
                None => {}
            }
        }
        Ok::<_, tonic::Status>(())
    })
    .await;
    let end = Instant::now();
    let (error, message) = match result {
        Err(_) => (Some("DeadlineExceeded".to_string()), Some(format!("no end after --request-timeout {} s", client.timeout.as_secs_f64()))),
        Ok(Err(status)) => (Some(format!("{:?}", status.code())), Some(status.message().to_string())),
        Ok(Ok(())) if finished.is_none() => (Some("Incomplete".to_string()), Some("the stream ended without a finished message".to_string())),
        Ok(Ok(())) => (None, None),
    };
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    let gaps_ms: Vec<f64> = tokens.windows(2).map(|w| ms(w[1] - w[0])).collect();
    let sample = Sample {
        kind: kind.to_string(),
        start_s: (start - run_start).as_secs_f64(),
        prompt_tokens: finished.as_ref().and_then(|f| f.usage).map_or(sent_prompt, |u| u.prompt_tokens),
        output_tokens: tokens.len() as u32,
        ttft_ms: tokens.first().map(|&t| ms(t - start)),
        tpot_ms: (!gaps_ms.is_empty()).then(|| gaps_ms.iter().sum::<f64>() / gaps_ms.len() as f64),
        e2e_ms: ms(end - start),
        prefill_path: finished.as_ref().and_then(|f| f.timings.as_ref()).map(|t| t.prefill_path.clone()).filter(|p| !p.is_empty()),
        error,
    };
    Outcome { sample, gaps_ms, message, token_ids }
}

/// What the server serves, from ModelInfo.
struct Served {
    model: String,
    vocab: u32,
    context: u32,
    /// Prompts of at least this many tokens go to the prefill worker.
    prefill_threshold: u32,
}

async fn connect(target: &str, timeout: Duration) -> Result<(Client, Served)> {
    // Accept host:port as well as a URL.
    let url = if target.contains("://") { target.to_string() } else { format!("http://{target}") };
    let endpoint = Endpoint::from_shared(url).with_context(|| format!("--target {target:?} is not a valid address"))?.connect_timeout(Duration::from_secs(10));
    let channel = endpoint.connect().await.with_context(|| format!("cannot connect to the router at {target}"))?;
    let mut grpc = GenerationClient::new(channel);
    let info = grpc.model_info(ModelInfoRequest {}).await.with_context(|| format!("ModelInfo from {target} failed"))?.into_inner();
    if info.vocab_size == 0 || info.context_length < 2 {
        bail!("{target} reports vocabulary {} and context {}; nothing to benchmark", info.vocab_size, info.context_length);
    }
    Ok((Client { grpc, timeout }, Served { model: info.model, vocab: info.vocab_size, context: info.context_length, prefill_threshold: info.prefill_worker_threshold }))
}

pub fn run(args: LoadArgs) -> Result<()> {
    args.validate()?;
    let prompts = args.prompts.as_deref().map(workload::read_prompts).transpose()?;
    let report = tokio::runtime::Runtime::new()?.block_on(bench(&args, prompts))?;
    print!("{}", report.tables());
    if let Some(path) = &args.out {
        std::fs::write(path, report.to_json()? + "\n").with_context(|| format!("cannot write {}", path.display()))?;
        eprintln!("wrote {}", path.display());
    }
    if let Some(path) = &args.plot {
        plot::write(path, &report).with_context(|| format!("cannot draw {}", path.display()))?;
        eprintln!("wrote {}", path.display());
    }
    // A run in which nothing succeeded measured nothing: say so in the exit status.
    if let Some(run) = report.runs.iter().find(|r| r.requests > 0 && r.errors.values().sum::<usize>() == r.requests) {
        bail!("every request of {} failed", run.name);
    }
    Ok(())
}

async fn bench(args: &LoadArgs, prompts: Option<Vec<FilePrompt>>) -> Result<Report> {
    let (client, served) = connect(&args.target, Duration::from_secs_f64(args.request_timeout)).await?;
    eprintln!("{} at {}: vocabulary {}, context {} tokens", served.model, args.target, served.vocab, served.context);
    let (workload, runs) = match (&args.scenario, args.chat_turns) {
        (Some(scenarios), _) => closed_loop(args, &client, &served, scenarios).await?,
        (None, Some(turns)) => {
            let chat = chat::Chat { turns, first_tokens: args.chat_first_tokens, message_tokens: args.chat_message_tokens, answer_tokens: args.chat_answer_tokens, per_turn: vec![] };
            if chat.positions() > u64::from(served.context) {
                bail!("{turns} chat turns need {} positions, more than the server's context of {}; fewer turns or shorter messages", chat.positions(), served.context);
            }
            let (chat, runs) = chat::run(&client, served.vocab, chat, args.seed).await?;
            (Workload::Chat(chat), runs)
        }
        (None, None) => open_loop(args, &client, &served, prompts).await?,
    };
    Ok(Report { target: args.target.clone(), model: served.model, context_length: served.context, seed: args.seed, workload, runs })
}

async fn closed_loop(args: &LoadArgs, client: &Client, served: &Served, scenarios: &Scenarios) -> Result<(Workload, Vec<RunReport>)> {
    let p = Shape { prompt: args.long_prompt_tokens, output: args.long_output_tokens };
    if u64::from(p.prompt) + u64::from(p.output) > u64::from(served.context) {
        bail!(
            "P needs {} prompt + {} output tokens, more than the server's context of {}; lower --long-prompt-tokens",
            p.prompt,
            p.output,
            served.context
        );
    }
    if args.short_prompt_tokens >= served.context {
        bail!("--short-prompt-tokens {} leaves no room in the server's context of {}", args.short_prompt_tokens, served.context);
    }
    if p.prompt < served.prefill_threshold {
        // Not the paper's disaggregated setting, which is worth knowing when reading the slowdowns.
        eprintln!(
            "note: P's {}-token prompt is below the server's prefill-worker threshold ({} tokens), so the decode worker prefills it",
            p.prompt, served.prefill_threshold
        );
    }
    let mut rng = ChaCha8Rng::seed_from_u64(args.seed);
    let (decode_tokens, calibration) = match args.decode_tokens {
        Some(n) if u64::from(args.short_prompt_tokens) + u64::from(n) > u64::from(served.context) => {
            bail!("D needs {} prompt + {n} output tokens, more than the server's context of {}", args.short_prompt_tokens, served.context)
        }
        Some(n) => (n, None),
        None => {
            let (n, cal) = scenarios::calibrate(client, served.vocab, served.context, p, args.short_prompt_tokens, &mut rng).await?;
            // Decode time is close to linear in the tokens near the guess.
            let d_ms = cal.guess_e2e_ms * f64::from(n) / f64::from(cal.guess_tokens);
            eprintln!(
                "calibrated: P ({} + {} tokens) takes {:.0} ms alone; D ({} + {n} tokens) about {d_ms:.0} ms{} \
                 (probes: 64 tokens at {:.2} ms/token, then {} tokens in {:.0} ms)",
                p.prompt,
                p.output,
                cal.long_e2e_ms,
                args.short_prompt_tokens,
                if n >= served.context - args.short_prompt_tokens { ", capped by the context" } else { "" },
                cal.short_tpot_ms,
                cal.guess_tokens,
                cal.guess_e2e_ms,
            );
            (n, Some(cal))
        }
    };
    let sizes = Sizes { p, d: Shape { prompt: args.short_prompt_tokens, output: decode_tokens } };
    let mut runs = vec![];
    for (i, scenario) in scenarios.0.iter().enumerate() {
        let seed = args.seed.wrapping_add(i as u64 + 1);
        let (outcomes, wall) = scenarios::run(client, served.vocab, *scenario, sizes, args.scenario_seconds, seed).await?;
        let run = RunReport::new(scenario.name, &outcomes, wall);
        note_run(&run, &outcomes);
        runs.push(run);
    }
    report::add_slowdowns(&mut runs);
    let workload = Workload::Closed(ClosedLoop {
        long_prompt_tokens: p.prompt,
        long_output_tokens: p.output,
        short_prompt_tokens: args.short_prompt_tokens,
        decode_tokens,
        scenario_seconds: args.scenario_seconds,
        calibration,
    });
    Ok((workload, runs))
}

/// A line on stderr per finished run, with the first message of each kind of error.
fn note_run(run: &RunReport, outcomes: &[Outcome]) {
    let paths: Vec<String> = {
        let mut p: Vec<String> = run.samples.iter().filter_map(|s| s.prefill_path.clone()).collect();
        p.sort();
        p.dedup();
        p
    };
    eprintln!(
        "{}: {} requests in {:.2} s, {} failed{}",
        run.name,
        run.requests,
        run.wall_s,
        run.errors.values().sum::<usize>(),
        if paths.is_empty() { String::new() } else { format!("; prefilled on the {} worker", paths.join(" and ")) }
    );
    for code in run.errors.keys() {
        if let Some(message) = outcomes.iter().find(|o| o.sample.error.as_ref() == Some(code)).and_then(|o| o.message.as_ref()) {
            eprintln!("  first {code}: {message}");
        }
    }
}

async fn open_loop(args: &LoadArgs, client: &Client, served: &Served, prompts: Option<Vec<FilePrompt>>) -> Result<(Workload, Vec<RunReport>)> {
    let rate = args.rate.context("--rate is required for an open-loop run")?;
    let mut rng = ChaCha8Rng::seed_from_u64(args.seed);
    let times = workload::arrivals(rate, args.requests.map(|n| n as usize), args.duration, &mut rng);
    let bar = ProgressBar::new(times.len() as u64).with_prefix("open");
    bar.set_style(ProgressStyle::with_template("{prefix:>6} [{bar:30}] {pos}/{len} {elapsed:>3} {msg}").expect("valid template"));
    let (in_flight, failed) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let mut clamped = 0;
    let start = Instant::now();
    let mut tasks = Vec::with_capacity(times.len());
    for (i, &at) in times.iter().enumerate() {
        // Requests are drawn in order as they are sent, so a seed fixes them all.
        let request = match &prompts {
            Some(list) => {
                let p = &list[i % list.len()];
                let max_tokens = p.max_tokens.unwrap_or_else(|| args.output_tokens.sample(&mut rng));
                let prompt = match &p.prompt {
                    PromptKind::Text(text) => generate_request::Prompt::Text(text.clone()),
                    PromptKind::Tokens(ids) => generate_request::Prompt::Tokens(TokenIds { ids: ids.clone() }),
                };
                request(prompt, max_tokens)
            }
            None => {
                let mut prompt = args.prompt_tokens.sample(&mut rng);
                // The prompt must leave room for one output token.
                if prompt >= served.context {
                    prompt = served.context - 1;
                    clamped += 1;
                }
                let output = args.output_tokens.sample(&mut rng);
                random_prompt(&mut rng, served.vocab, Shape { prompt, output })
            }
        };
        tokio::time::sleep_until((start + Duration::from_secs_f64(at)).into()).await;
        let (client, bar, in_flight, failed) = (client.clone(), bar.clone(), in_flight.clone(), failed.clone());
        in_flight.fetch_add(1, Ordering::Relaxed);
        tasks.push(tokio::spawn(async move {
            let outcome = send(&client, "open", request, start).await;
            in_flight.fetch_sub(1, Ordering::Relaxed);
            if outcome.sample.error.is_some() {
                failed.fetch_add(1, Ordering::Relaxed);
            }
            bar.inc(1);
            bar.set_message(format!("{} in flight, {} failed", in_flight.load(Ordering::Relaxed), failed.load(Ordering::Relaxed)));
            outcome
        }));
    }
    let mut outcomes = Vec::with_capacity(tasks.len());
    for task in tasks {
        outcomes.push(task.await.context("an open-loop request task failed")?);
    }
    bar.finish_and_clear();
    let run = RunReport::new("open", &outcomes, start.elapsed().as_secs_f64());
    note_run(&run, &outcomes);
    if clamped > 0 {
        eprintln!("note: {clamped} prompt lengths drawn from {} were cut to {} tokens to fit the context", args.prompt_tokens, served.context - 1);
    }
    let workload = Workload::Open(OpenLoop {
        rate,
        duration_s: args.duration,
        requests: args.requests.map(|n| n as usize),
        prompt_tokens: if prompts.is_some() { "file".into() } else { args.prompt_tokens.to_string() },
        output_tokens: args.output_tokens.to_string(),
        prompts_file: args.prompts.as_deref().map(|p: &Path| p.display().to_string()),
    });
    Ok((workload, vec![run]))
}
