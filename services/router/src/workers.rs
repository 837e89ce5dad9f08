//! One gRPC client per worker: lazy connections that reconnect on their
//! own, deadlines on unary calls, worker errors mapped to what a client
//! should see, and a readiness poller that calls Stats on both workers and
//! watches the decode worker's progress. Each call a request makes runs in
//! a span of its own (inside the request's span, which names its id).

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
use std::time::{Duration, Instant};
use tokio::sync::watch;
use duplex_proto::auth::AddToken;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Channel, Endpoint};
use tonic::{Response, Status, Streaming};
use tonic_health::server::HealthReporter;
use tonic_health::ServingStatus;
use tracing::Instrument;

/// How often the readiness poller calls Stats.
const POLL_INTERVAL: Duration = Duration::from_millis(500);

#[derive(Debug, thiserror::Error)]
#[error("invalid {worker} worker address {address:?}: {source}")]
pub struct AddressError {
    worker: &'static str,
    address: String,
    source: tonic::transport::Error,
}

/// What the last Stats poll of each worker said: its stats, or why it
/// failed; and whether the decode worker has stalled.
#[derive(Clone, Debug)]
pub struct Readiness {
    pub decode: Result<WorkerStats, String>,
    pub prefill: Result<WorkerStats, String>,
    /// Why the server cannot make progress although both workers answer.
    pub stalled: Option<String>,
}

impl Readiness {
    pub fn is_ready(&self) -> bool {
        self.check().is_ok()
    }

    /// Both workers answer and the decode worker is not stalled: what
    /// `/health` and the gRPC health status say.
    pub fn check(&self) -> Result<(), Error> {
        self.limits()?;
        self.prefill_ready()?;
        match &self.stalled {
            Some(why) => Err(Error::Unavailable(why.clone())),
            None => Ok(()),
        }
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

    /// Whether the prefill worker said it runs two-device prefill.
    pub fn prefill_has_dslp(&self) -> bool {
        self.prefill.as_ref().is_ok_and(|s| s.dslp_devices >= 2)
    }
}

fn not_ready(worker: &str, why: &str) -> Error {
    Error::Unavailable(format!("the {worker} worker is not ready: {why}"))
}

/// Watches the decode worker's progress counter: requests running, or
/// waiting while nothing else moves, with the counter standing still for
/// `timeout`, is a stall (an engine that hangs, or blocks that never free).
#[derive(Debug)]
struct StallWatch {
    timeout: Duration,
    /// The counter and pool epoch last seen (a restarted worker counts anew).
    last: Option<(u64, u64)>,
    /// Since when the counter has stood still with work to do.
    since: Instant,
}

impl StallWatch {
    fn new(timeout: Duration) -> Self {
        StallWatch { timeout, last: None, since: Instant::now() }
    }

    /// Why the decode worker is stalled, if it is, given its latest stats
    /// and whether the prefill worker has work. Waiting requests may wait
    /// for blocks lent to a prefill in progress: that is progress too.
    fn observe(&mut self, decode: Option<&WorkerStats>, prefill_busy: bool, now: Instant) -> Option<String> {
        let Some(decode) = decode else {
            self.last = None; // down: reported as such, not as a stall
            return None;
        };
        let mark = (decode.progress, decode.pool_epoch);
        let busy = decode.running > 0 || (decode.waiting > 0 && !prefill_busy);
        if !busy || self.last != Some(mark) {
            self.last = Some(mark);
            self.since = now;
            return None;
        }
        let still = now.duration_since(self.since);
        (still >= self.timeout).then(|| {
            format!(
                "the decode worker has made no progress for {:.1} s with {} requests running and {} waiting (stall_timeout_seconds is {})",
                still.as_secs_f64(),
                decode.running,
                decode.waiting,
                self.timeout.as_secs_f64()
            )
        })
    }
}

/// A worker connection whose every call carries the internal secret.
type Authed = InterceptedService<Channel, AddToken>;

pub struct Workers {
    decode: DecodeWorkerClient<Authed>,
    prefill: PrefillWorkerClient<Authed>,
    timeout: Duration,
    prefill_timeout: Duration,
    kv_wait_timeout: Duration,
    stall_timeout: Duration,
    readiness: watch::Sender<Readiness>,
}

impl Workers {
    /// Clients for both workers. Nothing connects until the first call, so
    /// the router may start before its workers.
    pub fn new(config: &RouterConfig) -> Result<Self, AddressError> {
        let timeout = config.worker_timeout();
        let never_polled = || Err("not polled yet".to_string());
        Ok(Workers {
            decode: DecodeWorkerClient::with_interceptor(channel("decode", &config.decode_worker, timeout)?, AddToken::from_env()),
            prefill: PrefillWorkerClient::with_interceptor(channel("prefill", &config.prefill_worker, timeout)?, AddToken::from_env()),
            timeout,
            prefill_timeout: config.prefill_timeout(),
            kv_wait_timeout: config.kv_wait_timeout(),
            stall_timeout: config.stall_timeout(),
            readiness: watch::Sender::new(Readiness { decode: never_polled(), prefill: never_polled(), stalled: None }),
        })
    }

    pub fn readiness(&self) -> Readiness {
        self.readiness.borrow().clone()
    }

    /// A lease of KV blocks for the whole request: its prompt plus up to
    /// `max_tokens` of output, starting with the cached blocks of the
    /// prompt's longest cached prefix (`cached_tokens`). The decode worker
    /// answers once the blocks are free (its queue is first come first
    /// served), so this waits up to `kv_wait_timeout_seconds`, not the short
    /// deadline.
    pub async fn allocate_kv(&self, request_id: &str, prompt: &[u32], max_tokens: u32) -> Result<KvLease, Error> {
        let tokens = u32::try_from(prompt.len()).unwrap_or(u32::MAX);
        let req = AllocateKvRequest { request_id: request_id.into(), tokens, max_tokens, prompt: prompt.to_vec() };
        let call = async {
            match tokio::time::timeout(self.kv_wait_timeout, self.decode.clone().allocate_kv(req)).await {
                Ok(Ok(response)) => Ok(response.into_inner()),
                Ok(Err(status)) => Err(Error::from_worker("decode", &status)),
                Err(_) => Err(Error::Overloaded(format!(
                    "no KV blocks became free for this request within {:?} (kv_wait_timeout_seconds); retry later",
                    self.kv_wait_timeout
                ))),
            }
        };
        traced("decode", "AllocateKv", call).await
    }

    pub async fn free_kv(&self, request_id: &str) -> Result<(), Error> {
        let req = FreeKvRequest { request_id: request_id.into() };
        traced("decode", "FreeKv", deadline("decode", "FreeKv", self.timeout, self.decode.clone().free_kv(req))).await.map(drop)
    }

    /// Opens the token stream. It has no deadline (a request may decode for
    /// minutes); a dead worker breaks the connection, and with it the stream.
    pub async fn decode(&self, req: DecodeRequest) -> Result<Streaming<DecodeEvent>, Error> {
        let call = async {
            let response = self.decode.clone().decode(req).await.map_err(|s| Error::from_worker("decode", &s))?;
            Ok(response.into_inner())
        };
        traced("decode", "Decode", call).await
    }

    pub async fn prefill(&self, req: PrefillRequest) -> Result<PrefillResponse, Error> {
        traced("prefill", "Prefill", deadline("prefill", "Prefill", self.prefill_timeout, self.prefill.clone().prefill(req))).await
    }

    pub async fn cancel_prefill(&self, request_id: &str) -> Result<(), Error> {
        let req = CancelRequest { request_id: request_id.into() };
        traced("prefill", "Cancel", deadline("prefill", "Cancel", self.timeout, self.prefill.clone().cancel(req))).await.map(drop)
    }

    /// Polls both workers' Stats every [`POLL_INTERVAL`] for as long as the
    /// returned task runs, and reports `duplex.v1.Generation` (and the
    /// server as a whole) SERVING exactly while both answer and the decode
    /// worker is not stalled.
    pub fn spawn_poller(self: std::sync::Arc<Self>, health: HealthReporter) -> tokio::task::JoinHandle<()> {
        tokio::spawn(async move {
            let mut interval = tokio::time::interval(POLL_INTERVAL);
            interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            let mut was_ready = None;
            let mut stall = StallWatch::new(self.stall_timeout);
            loop {
                interval.tick().await;
                let (mut decode, mut prefill) = (self.decode.clone(), self.prefill.clone());
                let (decode, prefill) = tokio::join!(
                    deadline("decode", "Stats", self.timeout, decode.stats(StatsRequest {})),
                    deadline("prefill", "Stats", self.timeout, prefill.stats(StatsRequest {})),
                );
                let prefill_busy = prefill.as_ref().is_ok_and(|p| p.running > 0 || p.waiting > 0);
                let stalled = stall.observe(decode.as_ref().ok(), prefill_busy, Instant::now());
                let now = Readiness { decode: decode.map_err(|e| e.to_string()), prefill: prefill.map_err(|e| e.to_string()), stalled };
                let ready = now.is_ready();
                if was_ready != Some(ready) {
                    let status = if ready { ServingStatus::Serving } else { ServingStatus::NotServing };
                    health.set_service_status(SERVICE_NAME, status).await;
                    health.set_service_status("", status).await;
                    match now.check() {
                        Ok(()) => tracing::info!("both workers are ready"),
                        Err(e) => tracing::warn!("not serving: {e}"),
                    }
                    was_ready = Some(ready);
                }
                self.readiness.send_replace(now);
            }
        })
    }
}

/// A lazy connection to `address`: `unix:/path/to.sock`, a URL, or a bare
/// `host:port`.
fn channel(worker: &'static str, address: &str, timeout: Duration) -> Result<Channel, AddressError> {
    let unix = address.strip_prefix("unix:").map(std::path::PathBuf::from);
    // A Unix socket's endpoint URL names no host; the connector below dials.
    let url = match &unix {
        Some(_) => "http://worker.invalid".to_string(),
        None if address.contains("://") => address.to_string(),
        None => format!("http://{address}"),
    };
    let endpoint = Endpoint::from_shared(url).map_err(|source| AddressError { worker, address: address.into(), source })?;
    let endpoint = endpoint
        .connect_timeout(timeout)
        .tcp_nodelay(true)
        // Pings notice a worker that vanished without closing its socket
        // (a power-cut host), which would otherwise hang a token stream.
        .http2_keep_alive_interval(Duration::from_secs(10))
        .keep_alive_timeout(Duration::from_secs(10));
    Ok(match unix {
        Some(path) => endpoint.connect_with_connector_lazy(tower::service_fn(move |_: tonic::codegen::http::Uri| {
            let path = path.clone();
            async move { Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(tokio::net::UnixStream::connect(path).await?)) }
        })),
        None => endpoint.connect_lazy(),
    })
}

/// One call a request makes to a worker, in a span of its own, and how it
/// ended at debug level. (The readiness poller's Stats calls are not traced:
/// they would flood the debug log.)
async fn traced<T>(worker: &'static str, rpc: &'static str, call: impl Future<Output = Result<T, Error>>) -> Result<T, Error> {
    let span = tracing::debug_span!("worker_call", worker, rpc);
    async move {
        let started = Instant::now();
        let result = call.await;
        let seconds = started.elapsed().as_secs_f64();
        match &result {
            Ok(_) => tracing::debug!(seconds, "answered"),
            Err(e) => tracing::debug!(seconds, "failed: {e}"),
        }
        result
    }
    .instrument(span)
    .await
}

/// One unary call with a deadline; errors become what a client should see.
async fn deadline<T>(worker: &str, rpc: &str, timeout: Duration, call: impl Future<Output = Result<Response<T>, Status>>) -> Result<T, Error> {
    match tokio::time::timeout(timeout, call).await {
        Ok(Ok(response)) => Ok(response.into_inner()),
        Ok(Err(status)) => Err(Error::from_worker(worker, &status)),
        Err(_) => Err(Error::Unavailable(format!("{worker} worker failed: no answer to {rpc} within {timeout:?}"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stats(running: u32, waiting: u32, progress: u64) -> WorkerStats {
        WorkerStats { running, waiting, progress, pool_epoch: 1, ..Default::default() }
    }

    #[test]
    fn a_stall_is_work_without_progress_for_the_timeout() {
        let t0 = Instant::now();
        let at = |s: u64| t0 + Duration::from_secs(s);
        let mut w = StallWatch::new(Duration::from_secs(10));
        // Idle: never a stall, however long.
        assert_eq!(w.observe(Some(&stats(0, 0, 5)), false, at(0)), None);
        assert_eq!(w.observe(Some(&stats(0, 0, 5)), false, at(100)), None);
        // Waiting, nothing moves: a stall once the timeout has passed.
        assert_eq!(w.observe(Some(&stats(0, 3, 5)), false, at(101)), None);
        assert_eq!(w.observe(Some(&stats(0, 3, 5)), false, at(109)), None);
        let why = w.observe(Some(&stats(0, 3, 5)), false, at(112)).unwrap();
        assert!(why.contains("no progress") && why.contains("3 waiting"), "{why}");
        // Progress clears it.
        assert_eq!(w.observe(Some(&stats(1, 2, 6)), false, at(113)), None);
        // Running steps without moving is a stall too, prefill or not.
        assert_eq!(w.observe(Some(&stats(1, 0, 6)), true, at(120)), None);
        assert!(w.observe(Some(&stats(1, 0, 6)), true, at(124)).is_some());
        // Requests waiting while the prefill worker fills a lease are not.
        let mut w = StallWatch::new(Duration::from_secs(10));
        assert_eq!(w.observe(Some(&stats(0, 3, 5)), true, at(0)), None);
        assert_eq!(w.observe(Some(&stats(0, 3, 5)), true, at(60)), None);
        // A worker that is down is reported as down, and then counts anew.
        assert_eq!(w.observe(None, false, at(61)), None);
        assert_eq!(w.observe(Some(&stats(0, 3, 5)), false, at(62)), None);
        assert_eq!(w.observe(Some(&stats(0, 3, 5)), false, at(71)), None);
        assert!(w.observe(Some(&stats(0, 3, 5)), false, at(72)).is_some());
    }
}
