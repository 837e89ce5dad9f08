//! duplex-prefill: the prefill worker.
//!
//! It maps the shared weights and the shared KV pool, and runs long prompts
//! first come first served, writing their KV into blocks the decode worker
//! leased for them; it returns only the first token. The router talks to it
//! over the `PrefillWorker` gRPC service. Long prompts run on an accelerator
//! with stream-loading prefill ([`slp`]), the rest on the CPU engine.

pub mod config;
pub mod dslp;
pub mod engine;
pub mod server;
pub mod slp;

pub use config::PrefillConfig;
use config::{DeviceKind, NamedDevice};
use duplex_kernels::device::emulated::{EmulatedConfig, EmulatedDevice};
use duplex_kernels::device::Device;
use dslp::DslpEngine;
use engine::{Slp, SlpDevices};
use slp::{SlpConfig, SlpEngine};
use duplex_proto::worker::prefill_worker_server::PrefillWorkerServer;
use engine::{Engine, KvSource};
use duplex_proto::stats::StatsCell;
use std::future::Future;
use std::sync::Arc;
use std::time::Instant;
use duplex_telemetry::process::Listener;

/// Serve on `listener` until `shutdown` resolves. Loads the model first.
pub async fn serve(config: PrefillConfig, listener: impl Into<Listener>, shutdown: impl Future<Output = ()> + Send + 'static) -> anyhow::Result<()> {
    let listener = listener.into();
    let model = config.model.clone();
    let runtime = tokio::runtime::Handle::current();
    let (engine, stats) = tokio::task::spawn_blocking(move || start_engine(&config, runtime)).await??;
    let vocab = engine.vocab_size();
    let grammar = tokio::task::spawn_blocking(move || grammar_compiler(&model, vocab)).await?;
    let (commands, receiver) = std::sync::mpsc::channel();
    std::thread::Builder::new().name("prefill-engine".into()).spawn(move || engine.run(receiver))?;
    tracing::info!("prefill worker serving on {listener}");
    let router = tonic::transport::Server::builder().add_service(PrefillWorkerServer::with_interceptor(server::PrefillService::new(commands, stats).with_grammar(grammar), duplex_proto::auth::CheckToken::from_env()));
    duplex_telemetry::process::serve_grpc(router, listener, shutdown).await?;
    Ok(())
}

/// Bind, export metrics, serve until Ctrl-C or SIGTERM.
pub async fn run(config: PrefillConfig) -> anyhow::Result<()> {
    let listener = duplex_telemetry::process::start_worker(&config.host, config.port, config.unix_socket.as_deref(), config.metrics_port).await?;
    serve(config, listener, duplex_telemetry::process::shutdown_signal()).await
}

/// The structured-output compiler over the model's tokenizer. A model
/// without a readable tokenizer is still served, unconstrained.
fn grammar_compiler(model: &std::path::Path, vocab_rows: usize) -> Option<duplex_grammar::GrammarCompiler> {
    let built = duplex_model::tokenizer::Tokenizer::from_model_path(model)
        .map_err(|e| e.to_string())
        .and_then(|t| duplex_grammar::GrammarCompiler::new(&t, vocab_rows).map_err(|e| e.to_string()));
    built.inspect_err(|e| tracing::warn!("structured output is off: {e}")).ok()
}

/// The engine and its stats; the device lease's calls run on `runtime`.
fn start_engine(cfg: &PrefillConfig, runtime: tokio::runtime::Handle) -> anyhow::Result<(Engine, Arc<StatsCell>)> {
    let started = Instant::now();
    let pool = cfg.pool()?;
    let (placed, warnings) = duplex_ipc::numa::place_worker(&pool, &cfg.core_list()?).map_err(|e| anyhow::anyhow!(e))?;
    tracing::info!("{placed}");
    warnings.iter().for_each(|w| tracing::warn!("{w}"));
    let mut progress = duplex_telemetry::progress::ByteProgress::new("building the weight segment");
    let (model, store, provenance) = duplex_ipc::open_shared_model(&cfg.shm_dir, &cfg.instance, &cfg.model_source()?, &pool, &mut |done, total| progress.update(done, total))?;
    progress.finish();
    tracing::info!("weight segment {} {provenance:?} and model loaded in {:.3} s ({} bytes)", store.path().display(), started.elapsed().as_secs_f64(), store.size_bytes());
    if provenance == duplex_ipc::Provenance::Built && store.placement().nodes > 1 {
        tracing::info!("{}", store.placement());
    }
    metrics::gauge!(duplex_telemetry::WEIGHT_SEGMENT_BYTES).set(store.size_bytes() as f64);
    duplex_telemetry::report_weight_pages(store.huge_pages().map(|m| (store.describe_pages(&m), m.huge)).map_err(|e| e.to_string()));
    let kv = KvSource::new(cfg.shm_dir.clone(), duplex_ipc::kv_segment_name(&cfg.instance));
    let stats = Arc::new(StatsCell::new(model.cfg.max_position_embeddings, store.fingerprint().to_string()));
    let ring_slots = (cfg.ring_slots != 0).then_some(cfg.ring_slots);
    let slp_config = SlpConfig { ring_slots, turning_point_tokens: cfg.ring_turning_point_tokens, dense_budget_bytes: cfg.dense_budget_mib << 20, ..SlpConfig::default() };
    let mut borrowed_bytes = 0;
    let devices = if cfg.devices.is_empty() {
        // "auto" finds no device for a model no device can run; a device
        // asked for by name is refused (by SlpEngine::new) with the reason.
        match open_device(cfg)? {
            Some(_) if cfg.device_kind()? == DeviceKind::Auto && model.device_refusal().is_some() => {
                tracing::info!("device auto: {}", model.device_refusal().unwrap_or_default());
                None
            }
            Some(device) => Some(SlpDevices::One(Box::new(SlpEngine::new(&model, device, slp_config)?))),
            None => None,
        }
    } else {
        let mut opened = cfg.device_list()?.into_iter().map(|d| open_named_device(cfg, d)).collect::<anyhow::Result<Vec<_>>>()?;
        // What two-device prefill uses of the devices after the first: the
        // memory asked of the decode worker when it lends them.
        borrowed_bytes = opened.iter().skip(1).map(|d| d.capacity() as u64).sum();
        Some(match opened.len() {
            1 => SlpDevices::One(Box::new(SlpEngine::new(&model, opened.remove(0), slp_config)?)),
            _ => SlpDevices::Ranks(DslpEngine::new(&model, opened, slp_config)?),
        })
    };
    let mut borrower = None;
    let slp = match devices {
        Some(SlpDevices::One(engine)) => {
            tracing::info!("stream-loading prefill on {} for prompts of {} tokens or more", engine.describe(), cfg.slp_threshold_tokens);
            Some(Slp { devices: SlpDevices::One(engine), threshold_tokens: cfg.slp_threshold_tokens })
        }
        Some(SlpDevices::Ranks(dslp)) => {
            tracing::info!(
                "two-device prefill (DSLP) on {} devices ({}) for prompts the router routes there; stream-loading prefill on the first, {}, for prompts of {} tokens or more",
                dslp.ranks(),
                dslp.describe(),
                dslp.single().describe(),
                cfg.slp_threshold_tokens
            );
            StatsCell::set(&stats.dslp_devices, dslp.ranks());
            if cfg.dslp_borrows_decode_device {
                let address = cfg.decode_worker_address();
                tracing::info!("two-device prefill borrows the devices after the first ({borrowed_bytes} bytes) from the decode worker at {address}, under its device lease");
                borrower = Some(server::DeviceBorrower::new(&address, borrowed_bytes, runtime)?);
            }
            Some(Slp { devices: SlpDevices::Ranks(dslp), threshold_tokens: cfg.slp_threshold_tokens })
        }
        None => {
            tracing::info!("no accelerator: every prompt runs on the CPU engine");
            None
        }
    };
    Ok((Engine::new(model, kv, cfg.chunk_tokens, cfg.precision()?, slp, stats.clone()).with_borrower(borrower), stats))
}

/// One entry of `devices`, opened.
fn open_named_device(cfg: &PrefillConfig, device: NamedDevice) -> anyhow::Result<Arc<dyn Device>> {
    Ok(match device {
        NamedDevice::Emulated => emulated_device(cfg)?,
        NamedDevice::Cuda(ordinal) => duplex_kernels::device::open_cuda(ordinal, cfg.device_memory_mib).map_err(|e| anyhow::anyhow!("devices: cuda:{ordinal}: {e}"))?,
    })
}

fn emulated_device(cfg: &PrefillConfig) -> anyhow::Result<Arc<dyn Device>> {
    let memory_mib = if cfg.device_memory_mib == 0 { 4096 } else { cfg.device_memory_mib };
    let rate = (cfg.emulated_h2d_gb_per_s > 0.0).then_some(cfg.emulated_h2d_gb_per_s * 1e9);
    let config = EmulatedConfig { memory_bytes: memory_mib << 20, h2d_bytes_per_second: rate, compute_threads: cfg.threads, jitter: None };
    Ok(EmulatedDevice::new(config)?)
}

/// The accelerator `cfg` asks for, or none for the CPU engine alone.
fn open_device(cfg: &PrefillConfig) -> anyhow::Result<Option<Arc<dyn Device>>> {
    Ok(match cfg.device_kind()? {
        DeviceKind::Cpu => None,
        DeviceKind::Emulated => Some(emulated_device(cfg)?),
        DeviceKind::Cuda => Some(open_cuda(cfg)?),
        DeviceKind::Auto => match open_cuda(cfg) {
            Ok(device) => Some(device),
            Err(e) => {
                tracing::info!("device auto: no CUDA device ({e})");
                None
            }
        },
    })
}

fn open_cuda(cfg: &PrefillConfig) -> anyhow::Result<Arc<dyn Device>> {
    Ok(duplex_kernels::device::open_cuda(cfg.cuda_device, cfg.device_memory_mib)?)
}
