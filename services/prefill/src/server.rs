//! The `PrefillWorker` gRPC service: checks each message, queues it for the
//! engine thread and relays the answer. The only place where the worker
//! protocol's messages and `tonic::Status` meet the engine's types; also
//! the client of the decode worker's `DeviceLease` ([`DeviceBorrower`]).

use crate::engine::{Command, FirstToken, Job, Lease, PrefillError};
use duplex_grammar::{ConstraintSpec, GrammarCompiler};
use duplex_proto::worker::prefill_worker_server::PrefillWorker;
use duplex_proto::auth::AddToken;
use duplex_proto::worker::device_lease_client::DeviceLeaseClient;
use duplex_proto::worker::{device_lease_event, DeviceLeaseEvent, DeviceLeaseRequest};
use duplex_proto::worker::{CancelRequest, CancelResponse, PrefillRequest, PrefillResponse, PrefillRoute, SampledToken, StatsRequest, WorkerStats};
use duplex_proto::stats::StatsCell;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::Sender;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tonic::codegen::InterceptedService;
use tonic::transport::{Channel, Endpoint};
use tokio::sync::oneshot;
use tonic::{Request, Response, Status};
use tracing::Instrument;

pub struct PrefillService {
    commands: Sender<Command>,
    stats: Arc<StatsCell>,
    /// Compiles structured-output constraints; `None` without a tokenizer.
    grammar: Option<GrammarCompiler>,
}

impl PrefillService {
    pub fn new(commands: Sender<Command>, stats: Arc<StatsCell>) -> Self {
        PrefillService { commands, stats, grammar: None }
    }

    /// Accept constrained requests, compiled with `grammar`.
    pub fn with_grammar(self, grammar: Option<GrammarCompiler>) -> Self {
        PrefillService { grammar, ..self }
    }

    async fn ask<T>(&self, make: impl FnOnce(oneshot::Sender<T>) -> Command) -> Result<T, Status> {
        let (reply, answer) = oneshot::channel();
        self.commands.send(make(reply)).map_err(|_| Status::unavailable("the prefill engine has stopped"))?;
        answer.await.map_err(|_| Status::unavailable("the prefill engine has stopped"))
    }
}

/// The engine's answer in the protocol's terms.
fn response(first: FirstToken) -> PrefillResponse {
    PrefillResponse {
        first_token: Some(SampledToken::sampled(&first.token, first.finish)),
        queue_seconds: first.queue.as_secs_f64(),
        prefill_seconds: first.prefill.as_secs_f64(),
    }
}

/// Each engine error as the status the router maps for its clients.
fn status(e: PrefillError) -> Status {
    let message = e.to_string();
    match e {
        PrefillError::InvalidArgument(_) => Status::invalid_argument(message),
        PrefillError::StaleLease(_) => Status::failed_precondition(message),
        PrefillError::PoolUnavailable(_) => Status::unavailable(message),
        PrefillError::Cancelled => Status::cancelled(message),
        PrefillError::Internal(_) => Status::internal(message),
    }
}

#[tonic::async_trait]
impl PrefillWorker for PrefillService {
    /// Runs the prompt into the lease's blocks and returns the first token.
    /// If the caller goes away, the job is dropped at its next chunk.
    async fn prefill(&self, request: Request<PrefillRequest>) -> Result<Response<PrefillResponse>, Status> {
        let arrived = Instant::now();
        let r = request.into_inner();
        let span = tracing::info_span!("prefill", request_id = %r.request_id, prompt_tokens = r.prompt.len(), route = r.route().as_str_name());
        async move {
            if r.request_id.is_empty() {
                return Err(Status::invalid_argument("request_id is empty"));
            }
            if r.prompt.is_empty() {
                return Err(Status::invalid_argument("prompt is empty"));
            }
            if r.max_tokens == 0 {
                return Err(Status::invalid_argument("max_tokens must be at least 1"));
            }
            let route = PrefillRoute::try_from(r.route).map_err(|_| Status::invalid_argument(format!("unknown prefill route {}", r.route)))?;
            let wire_sampling = r.sampling.as_ref().ok_or_else(|| Status::invalid_argument("sampling is missing"))?;
            let sampling = wire_sampling.into();
            // Compiled here, off the engine thread.
            let constraint = match wire_sampling.constraint.as_ref() {
                None => None,
                Some(c) => {
                    let spec = ConstraintSpec::try_from(c).map_err(Status::invalid_argument)?;
                    let grammar = self.grammar.as_ref().ok_or_else(|| Status::invalid_argument("this prefill worker has no tokenizer, so it cannot constrain output"))?;
                    Some(grammar.compile(&spec).map_err(|e| Status::invalid_argument(e.to_string()))?)
                }
            };
            let lease = r.lease.ok_or_else(|| Status::invalid_argument("lease is missing"))?;
            let lease = Lease { pool_epoch: lease.pool_epoch, blocks: lease.blocks, cached_tokens: lease.cached_tokens };
            let job = |reply| {
                let stop_token_ids = r.stop_token_ids.into_iter().collect();
                Command::Prefill(Box::new(Job { request_id: r.request_id, prompt: r.prompt, sampling, lease, constraint, max_tokens: r.max_tokens as usize, stop_token_ids, reply, arrived, dslp_routed: route == PrefillRoute::Dslp }))
            };
            let first = self.ask(job).await?.map_err(status)?;
            Ok(Response::new(response(first)))
        }
        .instrument(span)
        .await
    }

    async fn cancel(&self, request: Request<CancelRequest>) -> Result<Response<CancelResponse>, Status> {
        let request_id = request.into_inner().request_id;
        let span = tracing::info_span!("cancel", %request_id);
        async move {
            let found = self.ask(|reply| Command::Cancel { request_id, reply }).await?;
            tracing::debug!(found, "prefill cancel");
            Ok(Response::new(CancelResponse { found }))
        }
        .instrument(span)
        .await
    }

    async fn stats(&self, _: Request<StatsRequest>) -> Result<Response<WorkerStats>, Status> {
        Ok(Response::new(self.stats.snapshot()))
    }
}

/// How long the prefill worker waits for the decode worker to grant or
/// refuse a device lease (connecting included) before running on one device.
const LEASE_ANSWER_TIMEOUT: Duration = Duration::from_secs(2);

type LeaseClient = DeviceLeaseClient<InterceptedService<Channel, AddToken>>;

/// The prefill worker's side of the decode worker's device lease: two-device
/// prefill borrows the decode worker's device for one job at a time.
pub struct DeviceBorrower {
    runtime: tokio::runtime::Handle,
    client: LeaseClient,
    address: String,
    /// Device memory two-device prefill uses on the borrowed devices.
    bytes: u64,
}

/// What the decode worker answered.
pub enum Borrowed {
    Granted(DeviceLoan),
    Refused(String),
    /// No answer: not running, not reachable, or too slow to answer.
    Unreachable(String),
}

/// A granted lease. Dropping it drops the stream, which gives the device
/// back at once.
pub struct DeviceLoan {
    revoked: Arc<AtomicBool>,
    watcher: Option<tokio::task::JoinHandle<()>>,
    runtime: tokio::runtime::Handle,
}

impl DeviceLoan {
    /// Whether the decode worker wants its device back (or the lease was
    /// lost with the decode worker's connection): stop using it.
    pub fn revoked(&self) -> bool {
        self.revoked.load(Ordering::Acquire)
    }
}

impl Drop for DeviceLoan {
    fn drop(&mut self) {
        // The watcher owns the stream: aborting it drops the stream. On the
        // engine thread (outside the runtime) wait for that, so that the
        // stream's reset is on its way to the decode worker before the
        // prefill's answer (and the router's next call) is.
        let Some(watcher) = self.watcher.take() else { return };
        watcher.abort();
        if tokio::runtime::Handle::try_current().is_err() {
            let _ = self.runtime.block_on(async move { tokio::time::timeout(Duration::from_secs(1), watcher).await });
        }
    }
}

impl DeviceBorrower {
    /// A borrower from the decode worker at `address` (`unix:/path`, a URL
    /// or `host:port`; connected on first use), asking for `bytes`, whose
    /// calls run on `runtime`.
    pub fn new(address: &str, bytes: u64, runtime: tokio::runtime::Handle) -> anyhow::Result<Self> {
        let unix = address.strip_prefix("unix:").map(std::path::PathBuf::from);
        // A Unix socket's endpoint URL names no host; the connector dials.
        let url = match &unix {
            Some(_) => "http://decode-worker.invalid".to_string(),
            None if address.contains("://") => address.to_string(),
            None => format!("http://{address}"),
        };
        let endpoint = Endpoint::from_shared(url).map_err(|e| anyhow::anyhow!("decode_worker: {address:?} is not an address: {e}"))?;
        // Pings notice a decode worker that vanished without closing the
        // connection, which ends the lease's stream (so the loan is revoked).
        let endpoint = endpoint.connect_timeout(LEASE_ANSWER_TIMEOUT).http2_keep_alive_interval(Duration::from_secs(5)).keep_alive_timeout(Duration::from_secs(5));
        let _runtime = runtime.enter(); // the lazy channel's worker is spawned here
        let channel = match unix {
            Some(path) => endpoint.connect_with_connector_lazy(tower::service_fn(move |_: tonic::codegen::http::Uri| {
                let path = path.clone();
                async move { Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(tokio::net::UnixStream::connect(path).await?)) }
            })),
            None => endpoint.connect_lazy(),
        };
        let client = DeviceLeaseClient::with_interceptor(channel, AddToken::from_env());
        Ok(DeviceBorrower { runtime: runtime.clone(), client, address: address.to_string(), bytes })
    }

    pub fn address(&self) -> &str {
        &self.address
    }

    /// Ask for the device for `request_id`; blocks the calling (engine)
    /// thread for at most [`LEASE_ANSWER_TIMEOUT`].
    pub fn borrow(&self, request_id: &str) -> Borrowed {
        let mut client = self.client.clone();
        let request = DeviceLeaseRequest { request_id: request_id.to_string(), bytes: self.bytes };
        // The timer is made inside the runtime's context: this thread is not the runtime's.
        let answer = self.runtime.block_on(async move {
            let ask = async move {
                let mut stream = client.lease_device(request).await?.into_inner();
                let first = stream.message().await?;
                Ok::<_, Status>((first, stream))
            };
            tokio::time::timeout(LEASE_ANSWER_TIMEOUT, ask).await
        });
        let (first, mut stream) = match answer {
            Err(_) => return Borrowed::Unreachable(format!("no answer within {:?}", LEASE_ANSWER_TIMEOUT)),
            Ok(Err(status)) => return Borrowed::Unreachable(format!("{:?}: {}", status.code(), status.message())),
            Ok(Ok(answer)) => answer,
        };
        match first.and_then(|e| e.event) {
            Some(device_lease_event::Event::Granted(_)) => {}
            Some(device_lease_event::Event::Refused(r)) => return Borrowed::Refused(r.reason),
            Some(device_lease_event::Event::Revoked(_)) => return Borrowed::Refused("revoked before it was granted".into()),
            None => return Borrowed::Unreachable("the lease stream ended without an answer".into()),
        }
        let revoked = Arc::new(AtomicBool::new(false));
        let flag = revoked.clone();
        let watcher = self.runtime.spawn(async move {
            // A revocation, or the stream's end (the decode worker gone):
            // either way the device is no longer ours.
            loop {
                match stream.message().await {
                    Ok(Some(DeviceLeaseEvent { event: Some(device_lease_event::Event::Revoked(_)) })) => break,
                    Ok(Some(_)) => continue,
                    Ok(None) | Err(_) => {
                        flag.store(true, Ordering::Release);
                        return;
                    }
                }
            }
            flag.store(true, Ordering::Release);
            // Keep the stream, and so the lease, until the run has stopped
            // using the device and drops the loan (which aborts this task).
            std::future::pending::<()>().await;
            drop(stream);
        });
        Borrowed::Granted(DeviceLoan { revoked, watcher: Some(watcher), runtime: self.runtime.clone() })
    }
}
