//! Mock decode and prefill workers, and a router started in-process against
//! them on port-0 listeners.
//!
//! The mocks implement the worker protocol as the router expects it (see
//! the report in the crate's tests): generated token `i` (0-based, counting
//! the prefill worker's first token) is `script[i]`, or `prompt_len + i`
//! past the end of the script; the worker that samples a token in
//! `stop_token_ids` ("stop"), or the `max_tokens`-th token, the prefilled one
//! included ("length"), marks it last; the decode stream then ends (or,
//! with `hold_after_last`, stays open).

#![allow(dead_code)]

use duplex_proto::worker::decode_worker_server::{DecodeWorker, DecodeWorkerServer};
use duplex_proto::worker::prefill_worker_server::{PrefillWorker, PrefillWorkerServer};
use duplex_proto::worker::*;
use duplex_router::RouterConfig;
use futures::Stream;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;
use tokio::sync::oneshot;
use tonic::{Request, Response, Status};

/// Generous: the test machine is small and shared.
pub const TIMEOUT: Duration = Duration::from_secs(20);

pub const BLOCK_SIZE: u32 = 16;

#[derive(Clone, Debug)]
pub struct MockConfig {
    pub token_delay: Duration,
    pub prefill_delay: Duration,
    pub script: Vec<u32>,
    /// The decode stream fails with UNAVAILABLE after this many tokens.
    pub fail_after: Option<usize>,
    pub kv_blocks_total: u32,
    pub context_length: u32,
    /// The prefill worker's Stats fails, as while it loads.
    pub prefill_down: bool,
    /// The decode stream stays open this long after its last token.
    pub hold_after_last: Duration,
    /// What the prefill worker's Stats says of its two-device prefill.
    pub prefill_dslp_devices: u32,
    /// The prompt tokens a KV lease says the prefix cache holds (at most
    /// all but the prompt's last).
    pub cached_tokens: u32,
}

impl Default for MockConfig {
    fn default() -> Self {
        MockConfig {
            token_delay: Duration::ZERO,
            prefill_delay: Duration::ZERO,
            script: vec![],
            fail_after: None,
            kv_blocks_total: 256,
            context_length: 1024,
            prefill_down: false,
            hold_after_last: Duration::ZERO,
            prefill_dslp_devices: 0,
            cached_tokens: 0,
        }
    }
}

/// Everything the mocks were asked, and what they hold.
#[derive(Debug, Default)]
pub struct Record {
    pub allocs: Vec<AllocateKvRequest>,
    pub frees: Vec<String>,
    pub decodes: Vec<DecodeRequest>,
    pub prefills: Vec<PrefillRequest>,
    pub decode_cancels: Vec<String>,
    pub prefill_cancels: Vec<String>,
    /// Decode streams the router dropped before `finished`.
    pub streams_cancelled: Vec<String>,
    pub streams_finished: Vec<String>,
    /// Leases not yet freed or released by a finished/dropped stream.
    pub leases: HashMap<String, Vec<u32>>,
}

#[derive(Clone)]
struct Shared {
    config: Arc<Mutex<MockConfig>>,
    record: Arc<Mutex<Record>>,
}

impl Shared {
    fn config(&self) -> MockConfig {
        self.config.lock().unwrap().clone()
    }
    fn record(&self) -> MutexGuard<'_, Record> {
        self.record.lock().unwrap()
    }
    /// Token `i` (0-based), marked last as a worker marks it.
    fn token(&self, prompt_len: usize, i: usize, top: Option<u32>, max_tokens: u32, stop_token_ids: &[u32]) -> SampledToken {
        let id = self.config().script.get(i).copied().unwrap_or((prompt_len + i) as u32);
        let top_logprobs = (0..top.unwrap_or(0)).map(|k| TopLogprob { id: id + k, logprob: -0.5 - k as f32 }).collect();
        let reason = if stop_token_ids.contains(&id) {
            FinishReason::Stop
        } else if i + 1 >= max_tokens as usize {
            FinishReason::Length
        } else {
            FinishReason::Unspecified
        };
        SampledToken { id, logprob: -0.5, top_logprobs, last: reason != FinishReason::Unspecified, finish_reason: reason.into() }
    }
}

struct Decode(Shared);
struct Prefill(Shared);

/// Marks a decode stream cancelled if it is dropped before it finished, and
/// releases its lease either way.
struct StreamGuard {
    shared: Shared,
    id: String,
    finished: bool,
}

impl Drop for StreamGuard {
    fn drop(&mut self) {
        let mut r = self.shared.record();
        r.leases.remove(&self.id);
        if self.finished {
            r.streams_finished.push(self.id.clone());
        } else {
            r.streams_cancelled.push(self.id.clone());
        }
    }
}

type EventStream = Pin<Box<dyn Stream<Item = Result<DecodeEvent, Status>> + Send>>;

#[tonic::async_trait]
impl DecodeWorker for Decode {
    type DecodeStream = EventStream;

    async fn allocate_kv(&self, request: Request<AllocateKvRequest>) -> Result<Response<KvLease>, Status> {
        let req = request.into_inner();
        let config = self.0.config();
        let mut r = self.0.record();
        r.allocs.push(req.clone());
        let used: usize = r.leases.values().map(Vec::len).sum();
        let need = req.tokens.div_ceil(BLOCK_SIZE) as usize;
        if used + need > config.kv_blocks_total as usize {
            return Err(Status::resource_exhausted("no free KV blocks"));
        }
        let blocks: Vec<u32> = (used as u32..(used + need) as u32).collect();
        r.leases.insert(req.request_id.clone(), blocks.clone());
        let cached_tokens = config.cached_tokens.min(req.tokens.saturating_sub(1));
        Ok(Response::new(KvLease { pool_epoch: 7, request_id: req.request_id, blocks, cached_tokens }))
    }

    async fn free_kv(&self, request: Request<FreeKvRequest>) -> Result<Response<FreeKvResponse>, Status> {
        let id = request.into_inner().request_id;
        let mut r = self.0.record();
        r.leases.remove(&id);
        r.frees.push(id);
        Ok(Response::new(FreeKvResponse {}))
    }

    async fn decode(&self, request: Request<DecodeRequest>) -> Result<Response<EventStream>, Status> {
        let req = request.into_inner();
        self.0.record().decodes.push(req.clone());
        let shared = self.0.clone();
        let config = shared.config();
        let top = req.sampling.as_ref().and_then(|s| s.top_logprobs);
        // The prefilled first token counts towards max_tokens.
        let mut generated = usize::from(req.prefilled.is_some());
        if let Some(p) = &req.prefilled {
            let first = p.first_token.as_ref().map(|t| t.id);
            if first.is_some_and(|id| req.stop_token_ids.contains(&id)) || generated >= req.max_tokens as usize {
                return Err(Status::invalid_argument("the prefilled request is already finished"));
            }
        }
        let stream = async_stream::stream! {
            let mut guard = StreamGuard { shared: shared.clone(), id: req.request_id.clone(), finished: false };
            loop {
                tokio::time::sleep(config.token_delay).await;
                if config.fail_after == Some(generated) {
                    yield Err(Status::unavailable("mock decode worker crashed"));
                    return;
                }
                let token = shared.token(req.prompt.len(), generated, top, req.max_tokens, &req.stop_token_ids);
                generated += 1;
                if !token.last {
                    yield Ok(DecodeEvent { token: Some(token), queue_seconds: 0.0 });
                    continue;
                }
                guard.finished = true;
                yield Ok(DecodeEvent { token: Some(token), queue_seconds: 0.001 });
                tokio::time::sleep(config.hold_after_last).await;
                return;
            }
        };
        Ok(Response::new(Box::pin(stream)))
    }

    async fn cancel(&self, request: Request<CancelRequest>) -> Result<Response<CancelResponse>, Status> {
        self.0.record().decode_cancels.push(request.into_inner().request_id);
        Ok(Response::new(CancelResponse { found: false }))
    }

    async fn stats(&self, _: Request<StatsRequest>) -> Result<Response<WorkerStats>, Status> {
        let c = self.0.config();
        let r = self.0.record();
        Ok(Response::new(WorkerStats {
            running: 0,
            waiting: 0,
            kv_blocks_used: r.leases.values().map(Vec::len).sum::<usize>() as u32,
            kv_blocks_total: c.kv_blocks_total,
            kv_block_size: BLOCK_SIZE,
            pool_epoch: 7,
            context_length: c.context_length,
            weights_fingerprint: "mock-fingerprint".into(),
            progress: 0,
            dslp_devices: 0,
        }))
    }
}

#[tonic::async_trait]
impl PrefillWorker for Prefill {
    async fn prefill(&self, request: Request<PrefillRequest>) -> Result<Response<PrefillResponse>, Status> {
        let req = request.into_inner();
        self.0.record().prefills.push(req.clone());
        let config = self.0.config();
        tokio::time::sleep(config.prefill_delay).await;
        let top = req.sampling.as_ref().and_then(|s| s.top_logprobs);
        let first = self.0.token(req.prompt.len(), 0, top, req.max_tokens, &req.stop_token_ids);
        Ok(Response::new(PrefillResponse { first_token: Some(first), queue_seconds: 0.002, prefill_seconds: config.prefill_delay.as_secs_f64() }))
    }

    async fn cancel(&self, request: Request<CancelRequest>) -> Result<Response<CancelResponse>, Status> {
        self.0.record().prefill_cancels.push(request.into_inner().request_id);
        Ok(Response::new(CancelResponse { found: true }))
    }

    async fn stats(&self, _: Request<StatsRequest>) -> Result<Response<WorkerStats>, Status> {
        if self.0.config().prefill_down {
            return Err(Status::unavailable("loading weights"));
        }
        let c = self.0.config();
        Ok(Response::new(WorkerStats { context_length: c.context_length, dslp_devices: c.prefill_dslp_devices, ..Default::default() }))
    }
}

/// Both mock workers, served on their own runtime in their own thread, so
/// that `kill` can drop every connection at once, as a crashed process would.
pub struct Mock {
    pub decode_addr: SocketAddr,
    pub prefill_addr: SocketAddr,
    shared: Shared,
    kill: Option<oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Mock {
    pub fn start(config: MockConfig) -> Mock {
        let bind = || std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        Mock::start_on(bind(), bind(), config)
    }

    /// Serves on listeners bound earlier (a router may already be calling them).
    pub fn start_on(decode: std::net::TcpListener, prefill: std::net::TcpListener, config: MockConfig) -> Mock {
        let shared = Shared { config: Arc::new(Mutex::new(config)), record: Arc::default() };
        let (decode_addr, prefill_addr) = (decode.local_addr().unwrap(), prefill.local_addr().unwrap());
        let (kill, killed) = oneshot::channel::<()>();
        let s = shared.clone();
        let thread = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
            rt.block_on(async move {
                let incoming = |l: std::net::TcpListener| {
                    l.set_nonblocking(true).unwrap();
                    tokio_stream::wrappers::TcpListenerStream::new(tokio::net::TcpListener::from_std(l).unwrap())
                };
                let decode = tonic::transport::Server::builder().add_service(DecodeWorkerServer::new(Decode(s.clone()))).serve_with_incoming(incoming(decode));
                let prefill = tonic::transport::Server::builder().add_service(PrefillWorkerServer::new(Prefill(s))).serve_with_incoming(incoming(prefill));
                tokio::select! {
                    _ = decode => {}
                    _ = prefill => {}
                    _ = killed => {}
                }
            });
            // Dropping the runtime here drops every connection task.
            drop(rt);
        });
        Mock { decode_addr, prefill_addr, shared, kill: Some(kill), thread: Some(thread) }
    }

    pub fn record(&self) -> MutexGuard<'_, Record> {
        self.shared.record()
    }

    pub fn configure(&self, f: impl FnOnce(&mut MockConfig)) {
        f(&mut self.shared.config.lock().unwrap());
    }

    /// Dies like a crashed process: all connections close.
    pub fn kill(&mut self) {
        if let Some(kill) = self.kill.take() {
            let _ = kill.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

impl Drop for Mock {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A router serving on port-0 listeners in this process.
pub struct TestRouter {
    pub http: String,
    pub grpc: String,
    pub mock: Mock,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for TestRouter {
    fn drop(&mut self) {
        self.task.abort();
    }
}

pub fn router_config(mock: &Mock) -> RouterConfig {
    RouterConfig {
        decode_worker: format!("http://{}", mock.decode_addr),
        prefill_worker: mock.prefill_addr.to_string(),
        prefill_threshold_tokens: 32,
        worker_timeout_seconds: 2.0,
        ..RouterConfig::default()
    }
}

/// Starts the router without waiting for it to be ready.
pub async fn spawn_router(mock: Mock, config: RouterConfig) -> TestRouter {
    let http = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let grpc = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let (http_addr, grpc_addr) = (http.local_addr().unwrap(), grpc.local_addr().unwrap());
    let task = tokio::spawn(async move {
        if let Err(e) = duplex_router::serve(config, http, grpc, std::future::pending()).await {
            panic!("router failed: {e}");
        }
    });
    TestRouter { http: format!("http://{http_addr}"), grpc: format!("http://{grpc_addr}"), mock, task }
}

/// Mock workers and a router in front of them, ready to serve.
pub async fn start(mock: MockConfig, tweak: impl FnOnce(&mut RouterConfig)) -> TestRouter {
    let mock = Mock::start(mock);
    let mut config = router_config(&mock);
    tweak(&mut config);
    let router = spawn_router(mock, config).await;
    router.wait_ready().await;
    router
}

impl TestRouter {
    pub async fn health(&self) -> u16 {
        match reqwest::get(format!("{}/health", self.http)).await {
            Ok(r) => r.status().as_u16(),
            Err(_) => 0,
        }
    }

    pub async fn wait_ready(&self) {
        let ready = async {
            while self.health().await != 200 {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        };
        tokio::time::timeout(TIMEOUT, ready).await.expect("the router never became ready");
    }

    /// Waits until `check` holds for the mock's record.
    pub async fn wait_for(&self, what: &str, check: impl Fn(&Record) -> bool) {
        let poll = async {
            while !check(&self.mock.record()) {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        };
        if tokio::time::timeout(TIMEOUT, poll).await.is_err() {
            panic!("timed out waiting for {what}: {:#?}", self.mock.record());
        }
    }

    pub async fn grpc_client(&self) -> duplex_proto::v1::generation_client::GenerationClient<tonic::transport::Channel> {
        duplex_proto::v1::generation_client::GenerationClient::connect(self.grpc.clone()).await.unwrap()
    }

    pub async fn post(&self, path: &str, body: serde_json::Value) -> reqwest::Response {
        reqwest::Client::new().post(format!("{}{path}", self.http)).json(&body).send().await.unwrap()
    }
}

/// The `data:` payloads of a server-sent-events body (comments skipped).
pub fn sse_data(body: &str) -> Vec<String> {
    body.split("\n\n")
        .filter(|event| !event.trim().is_empty())
        .flat_map(|event| event.lines().filter_map(|l| l.strip_prefix("data: ").or_else(|| l.strip_prefix("data:"))).map(String::from).collect::<Vec<_>>())
        .collect()
}
