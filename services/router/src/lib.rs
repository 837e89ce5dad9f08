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
use api::listener::{self, Acceptor};
use duplex_proto::v1::generation_server::GenerationServer;
use futures::FutureExt;
use tonic::codegen::http;
use metrics_exporter_prometheus::PrometheusHandle;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::net::TcpListener;

/// Binds the configured ports and serves until Ctrl-C or SIGTERM.
pub async fn run(config: RouterConfig) -> anyhow::Result<()> {
    duplex_telemetry::init_logging();
    let bind = |port: u16| {
        // A (host, port) pair takes IPv4, IPv6 (`::1`, unbracketed) and names.
        let host = config.host.clone();
        async move { TcpListener::bind((host.as_str(), port)).await.with_context(|| format!("cannot listen on {host} port {port}")) }
    };
    let http = bind(config.http_port).await?;
    let grpc = bind(config.grpc_port).await?;
    listener::raise_fd_limit(2 * config.max_connections + listener::RESERVE_CONNECTIONS);
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
    // Both versions of reflection: grpcurl and grpcui speak v1, Python's
    // grpcio-reflection and older clients only v1alpha.
    let reflection = reflection_builder()?.build_v1()?;
    let reflection_v1alpha = reflection_builder()?.build_v1alpha()?;

    let api_key = api::ApiKey::new(config.api_key.as_deref());
    let grpc_key = api_key.clone();
    let authorize = move |request: tonic::Request<()>| {
        let presented = request.metadata().get("authorization").map(|v| v.as_bytes());
        match grpc_key.check(presented) {
            Ok(()) => Ok(request),
            Err(e) => {
                generate::count_refused(&e);
                Err(tonic::Status::from(e))
            }
        }
    };
    let generation = GenerationServer::new(GrpcApi::new(router.clone()))
        .max_decoding_message_size(config.max_request_body_bytes);
    let idle = config.idle_timeout();

    let shutdown = shutdown.shared();
    let grpc_server = tonic::transport::Server::builder()
        // Pings find dead peers; a connection that never sends its first
        // bytes is closed by the listener.
        .http2_keepalive_interval(Some(idle))
        .http2_keepalive_timeout(Some(Duration::from_secs(20)))
        .layer(tower::util::MapResponseLayer::new(oversize_is_resource_exhausted))
        .add_service(health_service)
        .add_service(reflection)
        .add_service(reflection_v1alpha)
        .add_service(tonic::service::interceptor::InterceptedService::new(generation, authorize))
        .serve_with_incoming_shutdown(listener::incoming(Acceptor::new(grpc, config.max_connections, 0, idle)), shutdown.clone());
    let cors = api::cors(&config.cors_allowed_origins).map_err(anyhow::Error::msg)?;
    let app = api::openai::routes(router, metrics, api_key, config.max_request_body_bytes, cors);
    let http_acceptor = Acceptor::new(http, config.max_connections, listener::RESERVE_CONNECTIONS, idle);
    let http_server = listener::serve_http(http_acceptor, app, idle, shutdown);
    tokio::try_join!(async { grpc_server.await.context("gRPC server failed") }, async {
        http_server.await;
        Ok(())
    },)?;
    Ok(())
}

/// Reflection over the public API and both reflection services, whichever
/// version a client asks.
fn reflection_builder() -> anyhow::Result<tonic_reflection::server::Builder<'static>> {
    Ok(tonic_reflection::server::Builder::configure()
        .register_file_descriptor_set(public_descriptors()?)
        .register_encoded_file_descriptor_set(tonic_reflection::pb::v1::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_reflection::pb::v1alpha::FILE_DESCRIPTOR_SET)
        .include_reflection_service(false))
}

/// The descriptors that reflection shows: the public API only, not the
/// workers' protocol, which the public port does not serve.
fn public_descriptors() -> anyhow::Result<prost_types::FileDescriptorSet> {
    use prost::Message;
    let mut set = prost_types::FileDescriptorSet::decode(duplex_proto::FILE_DESCRIPTOR_SET).context("the bundled proto descriptors do not decode")?;
    set.file.retain(|f| !f.package().starts_with("duplex.worker"));
    Ok(set)
}

/// tonic answers a request message over `max_decoding_message_size` with
/// OUT_OF_RANGE; the client sent too much, which gRPC calls
/// RESOURCE_EXHAUSTED (as grpc-go and grpc-java do).
fn oversize_is_resource_exhausted<B>(mut response: http::Response<B>) -> http::Response<B> {
    let headers = response.headers_mut();
    let out_of_range = headers.get("grpc-status").is_some_and(|v| v.as_bytes() == b"11");
    let too_large = headers.get("grpc-message").and_then(|m| m.to_str().ok()).is_some_and(|m| m.replace("%20", " ").contains("message length too large"));
    if out_of_range && too_large {
        headers.insert("grpc-status", http::HeaderValue::from_static("8"));
    }
    response
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
