//! duplex-decode: the decode worker.
//!
//! It maps the shared weights, creates the shared KV pool (whose allocation
//! it owns), and runs continuous batching: decoding sequences and chunked
//! prefill of short prompts in the same steps, plus sequences whose long
//! prompts the prefill worker ran into KV blocks leased from here. The
//! router talks to it over the `DecodeWorker` gRPC service. With `device =
//! "emulated" | "cuda"` its steps run the hybrid placement (`engine`):
//! attention and the rest on the device, routed experts on the CPU, two
//! micro-batches overlapped.
//!
//! The engine (`batcher`, `kv_alloc`, `engine`) and the device lease
//! (`lease`) speak their own types; `server` alone maps them to the worker
//! protocol and `tonic::Status`.

pub mod batcher;
pub mod config;
pub mod constraint;
pub mod engine;
pub mod error;
pub mod kv_alloc;
pub mod lease;
pub mod prefix_cache;
pub mod server;

use batcher::{Batcher, Limits};
use config::DeviceKind;
pub use config::DecodeConfig;
use duplex_kernels::device::emulated::{EmulatedConfig, EmulatedDevice};
use duplex_kernels::device::Device;
use duplex_model::hybrid::HybridEngine;
use engine::Engine;
use duplex_ipc::{KvGeometry, KvSegment};
use duplex_proto::worker::decode_worker_server::DecodeWorkerServer;
use duplex_proto::worker::device_lease_server::DeviceLeaseServer;
use kv_alloc::KvAllocator;
use duplex_proto::stats::StatsCell;
use std::future::Future;
use std::sync::Arc;
use std::time::Instant;
use duplex_telemetry::process::Listener;

/// Serve on `listener` until `shutdown` resolves. Loads the model first; the
/// router sees the worker as ready once `Stats` answers.
pub async fn serve(config: DecodeConfig, listener: impl Into<Listener>, shutdown: impl Future<Output = ()> + Send + 'static) -> anyhow::Result<()> {
    let listener = listener.into();
    let cfg = config.clone();
    let (batcher, stats, vocab, context, device) = tokio::task::spawn_blocking(move || start_engine(&cfg)).await??;
    let model = config.model.clone();
    let grammar = tokio::task::spawn_blocking(move || grammar_compiler(&model, vocab)).await?;
    let (commands, receiver) = std::sync::mpsc::channel();
    std::thread::Builder::new().name("decode-engine".into()).spawn(move || batcher.run(receiver))?;
    let budget_bytes = (config.lendable_device_mib > 0).then_some((config.lendable_device_mib as u64) << 20);
    let lender = lease::DeviceLender::new(lease::Lendable { device, budget_bytes }, std::time::Duration::from_secs_f64(config.device_lease_revoke_timeout_seconds));
    let service = server::DecodeService::new(commands.clone(), stats, vocab, context).with_grammar(grammar).with_lender(lender.clone());
    tracing::info!("decode worker serving on {listener}");
    let check = duplex_proto::auth::CheckToken::from_env();
    let router = tonic::transport::Server::builder()
        .add_service(DecodeWorkerServer::with_interceptor(service, check.clone()))
        .add_service(DeviceLeaseServer::with_interceptor(server::LeaseService::new(commands, lender), check));
    duplex_telemetry::process::serve_grpc(router, listener, shutdown).await?;
    Ok(())
}

/// Bind, export metrics, serve until Ctrl-C or SIGTERM.
pub async fn run(config: DecodeConfig) -> anyhow::Result<()> {
    let listener = duplex_telemetry::process::start_worker(&config.host, config.port, config.unix_socket.as_deref(), config.metrics_port).await?;
    serve(config, listener, duplex_telemetry::process::shutdown_signal()).await
}

/// The batcher, its stats, the vocabulary and context sizes, and the device
/// its steps run on (which the device lease lends).
type Started = (Batcher, Arc<StatsCell>, usize, usize, Option<Arc<dyn Device>>);

fn start_engine(cfg: &DecodeConfig) -> anyhow::Result<Started> {
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
    let max_context = model.cfg.max_position_embeddings;
    let context_length = if cfg.context_length == 0 { max_context } else { cfg.context_length.min(max_context) };
    let block_size = duplex_model::generation::KV_BLOCK_SIZE;
    let n_blocks = if cfg.kv_blocks == 0 { cfg.max_batch_size.max(1) * context_length.div_ceil(block_size) } else { cfg.kv_blocks };
    let geometry = KvGeometry { n_blocks, block_size, n_layers: model.cfg.num_hidden_layers, entry_dim: model.cfg.kv_entry_dim() };
    let segment = KvSegment::create(&cfg.shm_dir, &duplex_ipc::kv_segment_name(&cfg.instance), geometry)?;
    let epoch = segment.epoch();
    tracing::info!("KV segment {}: {n_blocks} blocks of {block_size} tokens, epoch {epoch}", segment.path().display());
    let kv = KvAllocator::new(segment.into_pool(true)?, epoch).with_prefix_caching(cfg.prefix_caching);
    let limits = Limits::of(cfg, context_length);
    let vocab = model.cfg.vocab_size;
    let device = open_device(cfg)?;
    let engine = match device.clone() {
        None => Engine::Cpu(model),
        Some(device) => {
            let hybrid = cfg.hybrid(&model)?;
            Engine::Hybrid(HybridEngine::new(model, device, hybrid, block_size)?)
        }
    };
    tracing::info!("decoding on {}", engine.describe());
    let stats = Arc::new(StatsCell::new(context_length, store.fingerprint().to_string()));
    Ok((Batcher::new(engine, kv, limits, cfg.precision()?, stats.clone()), stats, vocab, context_length, device))
}

/// The structured-output compiler over the model's tokenizer. A model
/// without a readable tokenizer is still served, unconstrained: the router
/// (which needs the tokenizer itself) would not send constraints anyway.
fn grammar_compiler(model: &std::path::Path, vocab_rows: usize) -> Option<duplex_grammar::GrammarCompiler> {
    let built = duplex_model::tokenizer::Tokenizer::from_model_path(model)
        .map_err(|e| e.to_string())
        .and_then(|t| duplex_grammar::GrammarCompiler::new(&t, vocab_rows).map_err(|e| e.to_string()));
    built.inspect_err(|e| tracing::warn!("structured output is off: {e}")).ok()
}

/// The accelerator `cfg` asks for, or none for the CPU alone.
fn open_device(cfg: &DecodeConfig) -> anyhow::Result<Option<Arc<dyn Device>>> {
    Ok(match cfg.device_kind()? {
        DeviceKind::Cpu => None,
        DeviceKind::Emulated => {
            let memory_bytes = (if cfg.device_memory_mib == 0 { 4096 } else { cfg.device_memory_mib }) << 20;
            Some(EmulatedDevice::new(EmulatedConfig { memory_bytes, compute_threads: cfg.device_threads.max(1), ..Default::default() })?)
        }
        DeviceKind::Cuda => Some(duplex_kernels::device::open_cuda(cfg.cuda_device, cfg.device_memory_mib)?),
    })
}
