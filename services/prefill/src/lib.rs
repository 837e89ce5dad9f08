//! duplex-prefill: the prefill worker.
//!
//! It maps the shared weights and the shared KV pool, and runs long prompts
//! first come first served, writing their KV into blocks the decode worker
//! leased for them; it returns only the first token. The router talks to it
//! over the `PrefillWorker` gRPC service. (Stream-loading prefill on an
//! accelerator will live here too; for now it computes on the CPU engine.)

pub mod config;
pub mod engine;
pub mod server;
pub mod slp;

pub use config::PrefillConfig;
use duplex_kernels::pool::PoolConfig;
use duplex_proto::worker::prefill_worker_server::PrefillWorkerServer;
use engine::{Engine, KvSource};
use duplex_proto::stats::StatsCell;
use std::future::Future;
use std::sync::Arc;
use std::time::Instant;
use tokio::net::TcpListener;

/// Serve on `listener` until `shutdown` resolves. Loads the model first.
pub async fn serve(config: PrefillConfig, listener: TcpListener, shutdown: impl Future<Output = ()> + Send + 'static) -> anyhow::Result<()> {
    let (engine, stats) = tokio::task::spawn_blocking(move || start_engine(&config)).await??;
    let (commands, receiver) = std::sync::mpsc::channel();
    std::thread::Builder::new().name("prefill-engine".into()).spawn(move || engine.run(receiver))?;
    tracing::info!("prefill worker serving on {}", listener.local_addr()?);
    tonic::transport::Server::builder()
        .add_service(PrefillWorkerServer::new(server::PrefillService::new(commands, stats)))
        .serve_with_incoming_shutdown(tokio_stream::wrappers::TcpListenerStream::new(listener), shutdown)
        .await?;
    Ok(())
}

/// Bind, export metrics, serve until Ctrl-C or SIGTERM.
pub async fn run(config: PrefillConfig) -> anyhow::Result<()> {
    let listener = duplex_telemetry::process::start_worker(&config.host, config.port, config.metrics_port).await?;
    serve(config, listener, duplex_telemetry::process::shutdown_signal()).await
}

fn start_engine(cfg: &PrefillConfig) -> anyhow::Result<(Engine, Arc<StatsCell>)> {
    let started = Instant::now();
    let pool = PoolConfig::split(cfg.threads, cfg.numa_nodes).map_err(|e| anyhow::anyhow!("threads/numa_nodes: {e}"))?;
    let (model, store, provenance) = duplex_ipc::open_shared_model(&cfg.shm_dir, &cfg.instance, &cfg.model, &pool)?;
    tracing::info!("weight segment {} {provenance:?} and model loaded in {:.3} s ({} bytes)", store.path().display(), started.elapsed().as_secs_f64(), store.size_bytes());
    metrics::gauge!(duplex_telemetry::WEIGHT_SEGMENT_BYTES).set(store.size_bytes() as f64);
    let kv = KvSource::new(cfg.shm_dir.clone(), duplex_ipc::kv_segment_name(&cfg.instance));
    let stats = Arc::new(StatsCell::new(model.cfg.max_position_embeddings, store.fingerprint().to_string()));
    Ok((Engine::new(model, kv, cfg.chunk_tokens, cfg.precision()?, stats.clone()), stats))
}
