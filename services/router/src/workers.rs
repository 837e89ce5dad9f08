//! One gRPC client per worker: lazy connections that reconnect on their
//! own, deadlines on unary calls, worker errors mapped to what a client
//! should see, and a readiness poller that calls Stats on both workers.

use crate::config::RouterConfig;
use crate::error::Error;
use crate::request::WorkerLimits;
use duplex_proto::v1::generation_server::SERVICE_NAME;
use duplex_proto::worker::decode_worker_client::DecodeWorkerClient;
use duplex_proto::worker::prefill_worker_client::PrefillWorkerClient;
use duplex_proto::worker::{
    AllocateKvRequest, CancelRequest, DecodeEvent, DecodeRequest, FreeKvRequest, KvLease, PrefillRequest, PrefillResponse, StatsRequest,
    WorkerStats,
};
use std::future::Future;
use std::time::Duration;
use tokio::sync::watch;
use tonic::transport::{Channel, Endpoint};
use tonic::{Response, Status, Streaming};
use tonic_health::server::HealthReporter;
use tonic_health::ServingStatus;

/// How often the readiness poller calls Stats.
const POLL_INTERVAL: Duration = Duration::from_millis(500);

#[derive(Debug, thiserror::Error)]
#[error("invalid {worker} worker address {address:?}: {source}")]
pub struct AddressError {
    worker: &'static str,
    address: String,
    source: tonic::transport::Error,
}

/// What the last Stats poll of each worker said: its stats, or why it failed.
#[derive(Clone, Debug)]
pub struct Readiness {
    pub decode: Result<WorkerStats, String>,
    pub prefill: Result<WorkerStats, String>,
}

impl Readiness {
    pub fn is_ready(&self) -> bool {
        self.decode.is_ok() && self.prefill.is_ok()
    }

    /// Both workers answer: what `/health` and the gRPC health status say.
    pub fn check(&self) -> Result<(), Error> {
        self.limits()?;
        self.prefill_ready()
    }

    /// The limits every request is validated against, from the decode
    /// worker's stats; or why there are none.
    pub fn limits(&self) -> Result<WorkerLimits, Error> {
        let decode = self.decode.as_ref().map_err(|why| not_ready("decode", why))?;
        Ok(WorkerLimits {
            context_length: decode.context_length,
            kv_tokens: u64::from(decode.kv_blocks_total) * u64::from(decode.kv_block_size),
        })
    }

    /// Needed only by prompts on the prefill path.
    pub fn prefill_ready(&self) -> Result<(), Error> {
        self.prefill.as_ref().map(drop).map_err(|why| not_ready("prefill", why))
    }
}

fn not_ready(worker: &str, why: &str) -> Error {
    Error::Unavailable(format!("the {worker} worker is not ready: {why}"))
}

pub struct Workers {
    decode: DecodeWorkerClient<Channel>,
    prefill: PrefillWorkerClient<Channel>,
    timeout: Duration,
    prefill_timeout: Duration,
    readiness: watch::Sender<Readiness>,
}

impl Workers {
    /// Clients for both workers. Nothing connects until the first call, so
    /// the router may start before its workers.
    pub fn new(config: &RouterConfig) -> Result<Self, AddressError> {
        let timeout = config.worker_timeout();
        let never_polled = || Err("not polled yet".to_string());
        Ok(Workers {
            decode: DecodeWorkerClient::new(channel("decode", &config.decode_worker, timeout)?),
            prefill: PrefillWorkerClient::new(channel("prefill", &config.prefill_worker, timeout)?),
            timeout,
            prefill_timeout: config.prefill_timeout(),
            readiness: watch::Sender::new(Readiness { decode: never_polled(), prefill: never_polled() }),
        })
    }

    pub fn readiness(&self) -> Readiness {
        self.readiness.borrow().clone()
    }

    pub async fn allocate_kv(&self, request_id: &str, tokens: usize) -> Result<KvLease, Error> {
        let req = AllocateKvRequest { request_id: request_id.into(), tokens: u32::try_from(tokens).unwrap_or(u32::MAX) };
        deadline("decode", "AllocateKv", self.timeout, self.decode.clone().allocate_kv(req)).await
    }

    pub async fn free_kv(&self, request_id: &str) -> Result<(), Error> {
        let req = FreeKvRequest { request_id: request_id.into() };
        deadline("decode", "FreeKv", self.timeout, self.decode.clone().free_kv(req)).await.map(drop)
    }

    /// Opens the token stream. It has no deadline (a request may decode for
    /// minutes); a dead worker breaks the connection, and with it the stream.
    pub async fn decode(&self, req: DecodeRequest) -> Result<Streaming<DecodeEvent>, Error> {
        let response = self.decode.clone().decode(req).await.map_err(|s| Error::from_worker("decode", &s))?;
        Ok(response.into_inner())
    }

    pub async fn prefill(&self, req: PrefillRequest) -> Result<PrefillResponse, Error> {
        deadline("prefill", "Prefill", self.prefill_timeout, self.prefill.clone().prefill(req)).await
    }

    pub async fn cancel_prefill(&self, request_id: &str) -> Result<(), Error> {
        let req = CancelRequest { request_id: request_id.into() };
        deadline("prefill", "Cancel", self.timeout, self.prefill.clone().cancel(req)).await.map(drop)
    }

    /// Polls both workers' Stats every [`POLL_INTERVAL`] for as long as the
    /// returned task runs, and reports `duplex.v1.Generation` (and the
    /// server as a whole) SERVING exactly while both answer.
    pub fn spawn_poller(self: std::sync::Arc<Self>, health: HealthReporter) -> tokio::task::JoinHandle<()> {
        tokio::spawn(async move {
            let mut interval = tokio::time::interval(POLL_INTERVAL);
            interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            let mut was_ready = None;
            loop {
                interval.tick().await;
                let (mut decode, mut prefill) = (self.decode.clone(), self.prefill.clone());
                let (decode, prefill) = tokio::join!(
                    deadline("decode", "Stats", self.timeout, decode.stats(StatsRequest {})),
                    deadline("prefill", "Stats", self.timeout, prefill.stats(StatsRequest {})),
                );
                let now = Readiness { decode: decode.map_err(|e| e.to_string()), prefill: prefill.map_err(|e| e.to_string()) };
                let ready = now.is_ready();
                if was_ready != Some(ready) {
                    let status = if ready { ServingStatus::Serving } else { ServingStatus::NotServing };
                    health.set_service_status(SERVICE_NAME, status).await;
                    health.set_service_status("", status).await;
                    match (&now.decode, &now.prefill) {
                        _ if ready => tracing::info!("both workers are ready"),
                        (Err(e), _) | (_, Err(e)) => tracing::warn!("workers not ready: {e}"),
                        _ => {}
                    }
                    was_ready = Some(ready);
                }
                self.readiness.send_replace(now);
            }
        })
    }
}

fn channel(worker: &'static str, address: &str, timeout: Duration) -> Result<Channel, AddressError> {
    // Accept a bare "host:port" as well as a URL.
    let url = if address.contains("://") { address.to_string() } else { format!("http://{address}") };
    let endpoint = Endpoint::from_shared(url).map_err(|source| AddressError { worker, address: address.into(), source })?;
    Ok(endpoint
        .connect_timeout(timeout)
        .tcp_nodelay(true)
        // Pings notice a worker that vanished without closing its socket
        // (a power-cut host), which would otherwise hang a token stream.
        .http2_keep_alive_interval(Duration::from_secs(10))
        .keep_alive_timeout(Duration::from_secs(10))
        .connect_lazy())
}

/// One unary call with a deadline; errors become what a client should see.
async fn deadline<T>(worker: &str, rpc: &str, timeout: Duration, call: impl Future<Output = Result<Response<T>, Status>>) -> Result<T, Error> {
    match tokio::time::timeout(timeout, call).await {
        Ok(Ok(response)) => Ok(response.into_inner()),
        Ok(Err(status)) => Err(Error::from_worker(worker, &status)),
        Err(_) => Err(Error::Unavailable(format!("{worker} worker failed: no answer to {rpc} within {timeout:?}"))),
    }
}
