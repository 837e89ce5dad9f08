//! duplex-router: the front of a Duplex server. It takes requests on a
//! public gRPC API (`duplex.v1.Generation`, server streaming) and an
//! OpenAI-compatible HTTP API, validates them into one internal
//! `GenerationRequest`, admits a bounded number, and runs each through the
//! workers over internal gRPC: short prompts straight to the decode worker,
//! long ones through the prefill worker into KV blocks the decode worker
//! lends. It detokenizes, applies stop strings, and records the latency
//! metrics. It never loads weights.
//!
//! Files, in the order a request meets them: `api/` (the front doors),
//! `request.rs` (validation), `admission.rs`, `policy.rs`, `generate.rs`
//! (the flow), `workers.rs` (the worker clients).

pub mod admission;
pub mod api;
pub mod config;
pub mod error;
pub mod generate;
pub mod policy;
pub mod request;
pub mod workers;

pub use config::RouterConfig;
pub use error::Error;
pub use generate::Router;

use anyhow::Context;
use api::grpc::GrpcApi;
use duplex_proto::v1::generation_server::GenerationServer;
use futures::FutureExt;
use metrics_exporter_prometheus::PrometheusHandle;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::net::TcpListener;
use tokio_stream::wrappers::TcpListenerStream;

/// Binds the configured ports and serves until Ctrl-C or SIGTERM.
pub async fn run(config: RouterConfig) -> anyhow::Result<()> {
    duplex_telemetry::init_logging();
    let bind = |port: u16| {
        let addr = format!("{}:{port}", config.host);
        async move { TcpListener::bind(&addr).await.with_context(|| format!("cannot listen on {addr}")) }
    };
    let http = bind(config.http_port).await?;
    let grpc = bind(config.grpc_port).await?;
    tracing::info!(model = %config.model.display(), decode = %config.decode_worker, prefill = %config.prefill_worker, "router serving HTTP on {} and gRPC on {}", http.local_addr()?, grpc.local_addr()?);
    let shutdown = async {
        duplex_telemetry::process::shutdown_signal().await;
        tracing::info!("shutting down");
    };
    serve(config, http, grpc, shutdown).await
}

/// Serves on listeners the caller bound (tests bind port 0) until
/// `shutdown` completes. The `*_port` fields of `config` are not used.
pub async fn serve(config: RouterConfig, http: TcpListener, grpc: TcpListener, shutdown: impl Future<Output = ()> + Send + 'static) -> anyhow::Result<()> {
    config.validate()?;
    let metrics = metrics_handle()?;
    let model = request::ServedModel::load(&config).context("cannot load the model's tokenizer and config")?;
    let router = Arc::new(Router::new(model, workers::Workers::new(&config)?, &config));

    let (health, health_service) = tonic_health::server::health_reporter();
    health.set_not_serving::<GenerationServer<GrpcApi>>().await;
    let _poller = AbortOnDrop(router.workers.clone().spawn_poller(health));
    let _upkeep = AbortOnDrop(tokio::spawn(upkeep(metrics.clone())));
    let reflection = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(duplex_proto::FILE_DESCRIPTOR_SET)
        .build_v1()?;

    let shutdown = shutdown.shared();
    let grpc_server = tonic::transport::Server::builder()
        .add_service(health_service)
        .add_service(reflection)
        .add_service(GenerationServer::new(GrpcApi::new(router.clone())))
        .serve_with_incoming_shutdown(TcpListenerStream::new(grpc), shutdown.clone());
    let http_server = axum::serve(http, api::openai::routes(router, metrics)).with_graceful_shutdown(shutdown);
    tokio::try_join!(
        async { grpc_server.await.context("gRPC server failed") },
        async { http_server.await.context("HTTP server failed") },
    )?;
    Ok(())
}

/// The process's metrics recorder. A process can install only one, and
/// tests start several routers in one process, so it is installed once.
fn metrics_handle() -> Result<PrometheusHandle, duplex_telemetry::TelemetryError> {
    static HANDLE: Mutex<Option<PrometheusHandle>> = Mutex::new(None);
    let mut handle = HANDLE.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(h) = &*handle {
        return Ok(h.clone());
    }
    let h = duplex_telemetry::install(None)?;
    *handle = Some(h.clone());
    Ok(h)
}

/// Histograms keep their samples until upkeep folds them in; without a
/// scrape for a long while they would grow without bound.
async fn upkeep(metrics: PrometheusHandle) {
    let mut interval = tokio::time::interval(Duration::from_secs(5));
    loop {
        interval.tick().await;
        metrics.run_upkeep();
    }
}

/// Background tasks end with the server.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}
