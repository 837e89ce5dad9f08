//! KV admission end to end (issue 17): the router, the prefill worker and
//! the decode worker in this process, on loopback, with the bundled tiny
//! model and a small KV pool.
//!
//! - Long prompts whose KV adds up to three pools all finish, through the
//!   prefill worker, with the tokens each gets alone, and every block comes
//!   back. (Leases used to hold the prompt only: they filled the pool and no
//!   sequence could then get the blocks of its output.)
//! - A request that can never fit is refused at once; the queue for blocks
//!   is bounded (RESOURCE_EXHAUSTED beyond it).
//! - Health goes NOT_SERVING when work waits and nothing moves.
//!
//! The test plays a second router at times, leasing blocks from the decode
//! worker itself to hold the pool.
//!
//! The workers run the F32 path, whose results do not depend on batching, so
//! a request's tokens must be exactly what it gets alone.

use duplex_proto::worker::decode_worker_client::DecodeWorkerClient;
use duplex_proto::worker::{AllocateKvRequest, DecodeRequest, FreeKvRequest, Sampling, StatsRequest, WorkerStats};
use duplex_tests::{collect, greedy_request, prompt, runtime, serial, v1, within};
use std::time::{Duration, Instant};
use tokio::net::TcpListener;
use tonic::transport::Channel;
use tonic::Code;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::HealthCheckRequest;

struct Settings {
    kv_blocks: usize,
    max_waiting_requests: usize,
    stall_timeout_seconds: f64,
    kv_wait_timeout_seconds: f64,
}

impl Default for Settings {
    fn default() -> Self {
        Settings { kv_blocks: 40, max_waiting_requests: 256, stall_timeout_seconds: 60.0, kv_wait_timeout_seconds: 600.0 }
    }
}

/// Router, prefill worker and decode worker, served by tasks of the calling
/// runtime; prompts of 64 tokens or more take the prefill path.
struct Stack {
    http: String,
    grpc: String,
    decode: DecodeWorkerClient<Channel>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
    _shm: tempfile::TempDir,
}

impl Drop for Stack {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
    }
}

async fn listener() -> (TcpListener, String) {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = format!("http://{}", l.local_addr().unwrap());
    (l, address)
}

impl Stack {
    async fn start(s: Settings) -> Stack {
        let shm = tempfile::tempdir_in(duplex_ipc::default_shm_dir()).unwrap();
        let instance = "kv-admission".to_string();
        let mut tasks = vec![];
        let (decode_listener, decode_addr) = listener().await;
        let decode_config = duplex_decode::DecodeConfig {
            shm_dir: shm.path().into(),
            instance: instance.clone(),
            kv_blocks: s.kv_blocks,
            max_waiting_requests: s.max_waiting_requests,
            metrics_port: 0,
            threads: 1,
            dtype: "f32".into(),
            // Admission alone: a prompt sent again must take the lease path
            // as it did the first time (the prefix cache would find it, and
            // the router would chunk it on the decode worker).
            prefix_caching: false,
            ..Default::default()
        };
        tasks.push(tokio::spawn(async move {
            duplex_decode::serve(decode_config, decode_listener, std::future::pending()).await.expect("decode worker failed");
        }));
        // The decode worker creates the KV segment the prefill worker maps.
        let decode = DecodeWorkerClient::new(Channel::from_shared(decode_addr.clone()).unwrap().connect_lazy());
        within(120, "the decode worker's start", async {
            while decode.clone().stats(StatsRequest {}).await.is_err() {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        })
        .await;
        let (prefill_listener, prefill_addr) = listener().await;
        let prefill_config = duplex_prefill::PrefillConfig {
            shm_dir: shm.path().into(),
            instance,
            metrics_port: 0,
            threads: 1,
            dtype: "f32".into(),
            device: "cpu".into(),
            ..Default::default()
        };
        tasks.push(tokio::spawn(async move {
            duplex_prefill::serve(prefill_config, prefill_listener, std::future::pending()).await.expect("prefill worker failed");
        }));
        let router_config = duplex_router::RouterConfig {
            decode_worker: decode_addr,
            prefill_worker: prefill_addr,
            prefill_threshold_tokens: 64,
            stall_timeout_seconds: s.stall_timeout_seconds,
            kv_wait_timeout_seconds: s.kv_wait_timeout_seconds,
            ..Default::default()
        };
        let (http, http_addr) = listener().await;
        let (grpc, grpc_addr) = listener().await;
        tasks.push(tokio::spawn(async move {
            duplex_router::serve(router_config, http, grpc, std::future::pending()).await.expect("router failed");
        }));
        let stack = Stack { http: http_addr, grpc: grpc_addr, decode, tasks, _shm: shm };
        within(120, "the router's readiness", async {
            while stack.health().await.0 != 200 {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        })
        .await;
        stack
    }

    async fn client(&self) -> v1::generation_client::GenerationClient<Channel> {
        v1::generation_client::GenerationClient::connect(self.grpc.clone()).await.unwrap()
    }

    /// `/health`: the status code and the body.
    async fn health(&self) -> (u16, String) {
        match reqwest::get(format!("{}/health", self.http)).await {
            Ok(r) => (r.status().as_u16(), r.text().await.unwrap_or_default()),
            Err(_) => (0, String::new()),
        }
    }

    async fn grpc_health(&self) -> ServingStatus {
        let channel = Channel::from_shared(self.grpc.clone()).unwrap().connect().await.unwrap();
        let mut client = HealthClient::new(channel);
        let response = client.check(HealthCheckRequest { service: "duplex.v1.Generation".into() }).await.unwrap();
        response.into_inner().status()
    }

    async fn stats(&self) -> WorkerStats {
        self.decode.clone().stats(StatsRequest {}).await.unwrap().into_inner()
    }

    /// Waits until the decode worker's stats satisfy `pred`.
    async fn wait_stats(&self, what: &str, pred: impl Fn(&WorkerStats) -> bool) -> WorkerStats {
        within(60, what, async {
            loop {
                let stats = self.stats().await;
                if pred(&stats) {
                    return stats;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
        .await
    }

    /// Lease blocks straight from the decode worker, as a router would.
    async fn lease(&self, id: &str, tokens: u32, max_tokens: u32) -> Result<Vec<u32>, tonic::Status> {
        let request = AllocateKvRequest { request_id: id.into(), tokens, max_tokens, ..Default::default() };
        Ok(self.decode.clone().allocate_kv(request).await?.into_inner().blocks)
    }

    async fn free(&self, id: &str) {
        self.decode.clone().free_kv(FreeKvRequest { request_id: id.into() }).await.unwrap();
    }

    /// A router-side metric, summed over its label sets (the workers run in
    /// this process, so the router's `/metrics` shows theirs too).
    async fn metric(&self, name: &str) -> f64 {
        let text = reqwest::get(format!("{}/metrics", self.http)).await.unwrap().text().await.unwrap();
        text.lines().filter(|l| !l.starts_with('#')).filter_map(|l| l.rsplit_once(' ')).filter(|(key, _)| key.split('{').next() == Some(name)).map(|(_, v)| v.parse::<f64>().unwrap()).sum()
    }
}

/// The `i`-th of several different long prompts.
fn long_prompt(i: usize, len: usize) -> Vec<u32> {
    let base = prompt(len + 64);
    base[i * 7..i * 7 + len].to_vec()
}

/// The test. Each request needs 200 + 120 = 320 positions, 20
/// blocks; the pool has 40, so two run at a time, and the six need three
/// pools in all. With leases of the prompt alone (13 blocks), three leases
/// fit in the pool and then none of the three could get the 7 blocks of its
/// output: the old deadlock. A short request sent meanwhile (decode path)
/// finishes too. Every request gets the tokens it gets alone, and the pool
/// is empty at the end.
#[test]
fn long_prompts_needing_three_pools_all_finish_with_their_own_tokens() {
    let _serial = serial();
    runtime().block_on(async {
        let stack = Stack::start(Settings { kv_blocks: 40, ..Default::default() }).await;
        let mut client = stack.client().await;
        let (n, prompt_len, max_tokens) = (6, 200, 120);
        let prompts: Vec<Vec<u32>> = (0..n).map(|i| long_prompt(i, prompt_len)).collect();
        let short = prompt(5);
        let mut alone = vec![];
        for p in &prompts {
            let (ids, _, finished) = within(120, "a long prompt alone", collect(&mut client, greedy_request(p, max_tokens))).await.unwrap();
            assert_eq!(finished.timings.unwrap().prefill_path, "prefill");
            alone.push(ids);
        }
        let short_alone = within(60, "the short prompt alone", collect(&mut client, greedy_request(&short, 2))).await.unwrap().0;
        assert_eq!(stack.stats().await.kv_blocks_used, 0);

        let started = Instant::now();
        let runs = prompts.iter().map(|p| {
            let (mut client, request) = (client.clone(), greedy_request(p, max_tokens));
            tokio::spawn(async move { collect(&mut client, request).await })
        });
        let runs: Vec<_> = runs.collect();
        // The pool is full and the rest wait, first come first served.
        let busy = stack.wait_stats("a full pool with requests waiting", |s| s.kv_blocks_used == 40 && s.waiting > 0).await;
        println!("decode worker while busy: {} running, {} waiting, {} of 40 blocks", busy.running, busy.waiting, busy.kv_blocks_used);
        let short_run = {
            let mut client = client.clone();
            let request = greedy_request(&short, 2);
            tokio::spawn(async move { collect(&mut client, request).await })
        };
        let mut queue_seconds = vec![];
        for (i, run) in runs.into_iter().enumerate() {
            let (ids, _, finished) = within(300, "the concurrent long prompts", run).await.unwrap().unwrap_or_else(|e| panic!("request {i}: {e}"));
            assert_eq!(ids, alone[i], "request {i} among the others");
            assert_eq!(finished.finish_reason, "length");
            let timings = finished.timings.unwrap();
            assert_eq!(timings.prefill_path, "prefill", "request {i} through a lease");
            queue_seconds.push(timings.queue_seconds);
        }
        let (short_ids, _, _) = within(60, "the short prompt sent meanwhile", short_run).await.unwrap().unwrap();
        assert_eq!(short_ids, short_alone);
        println!("{n} requests of {prompt_len} + {max_tokens} tokens, 3 pools of KV, in {:.2} s; queue times {queue_seconds:.3?} s", started.elapsed().as_secs_f64());

        let idle = stack.wait_stats("every block back", |s| s.kv_blocks_used == 0 && s.running == 0 && s.waiting == 0).await;
        assert_eq!(idle.kv_blocks_total, 40);
        // The waits are in the queue-time metrics: the router's (which counts
        // the wait for a lease) and the decode worker's own.
        let waited = queue_seconds.iter().cloned().fold(0.0, f64::max);
        assert!(waited > 0.0, "{queue_seconds:?}");
        assert!(stack.metric("duplex_request_queue_time_seconds_count").await >= (2 * n + 2) as f64);
        assert!(stack.metric("duplex_decode_kv_wait_seconds_sum").await >= waited * 0.5);
        assert_eq!(stack.health().await.0, 200);
    });
}

/// A request whose need exceeds the whole pool is refused at once, even
/// while the pool is busy (it is not queued behind the others for ever);
/// the queue for blocks is bounded, and a request beyond it gets
/// RESOURCE_EXHAUSTED; those that waited start when blocks free up.
#[test]
fn never_fitting_requests_are_refused_and_the_queue_is_bounded() {
    let _serial = serial();
    runtime().block_on(async {
        let stack = Stack::start(Settings { kv_blocks: 40, max_waiting_requests: 2, ..Default::default() }).await;
        // Another router's lease holds the whole pool: 600 + 40 positions.
        assert_eq!(stack.lease("hog", 600, 40).await.unwrap().len(), 40);

        // 200 prompt tokens and up to 1000 more: capped by the context, 1024
        // positions, 64 blocks. The pool has 40.
        let never = within(5, "refusing a lease that can never fit", stack.lease("never", 200, 1000)).await.unwrap_err();
        assert_eq!(never.code(), Code::InvalidArgument, "{never:?}");
        assert!(never.message().contains("needs 64 KV blocks") && never.message().contains("only 40"), "{}", never.message());
        let sampling = Sampling { temperature: 0.0, seed: 1, ..Default::default() };
        let decode = DecodeRequest { request_id: "never-too".into(), prompt: prompt(700), sampling: Some(sampling), max_tokens: 4, ..Default::default() };
        let refused = within(5, "refusing a sequence that can never fit", async {
            match stack.decode.clone().decode(decode).await {
                Err(status) => status,
                Ok(stream) => stream.into_inner().message().await.expect_err("the stream ends with the refusal"),
            }
        })
        .await;
        assert_eq!(refused.code(), Code::InvalidArgument, "{refused:?}");

        // Two long prompts wait for blocks (max_waiting_requests = 2) ...
        let client = stack.client().await;
        let mut waiting = vec![];
        for i in 0..2 {
            let (mut client, request) = (client.clone(), greedy_request(&long_prompt(i, 100), 20));
            waiting.push(tokio::spawn(async move { collect(&mut client, request).await }));
            stack.wait_stats("a waiting lease", |s| s.waiting as usize == i + 1).await;
        }
        // ... so the third is refused at once.
        let mut client = stack.client().await;
        let full = within(5, "refusing past the queue's bound", collect(&mut client, greedy_request(&long_prompt(2, 100), 20))).await.unwrap_err();
        assert_eq!(full.code(), Code::ResourceExhausted, "{full:?}");
        assert!(full.message().contains("max_waiting_requests"), "{}", full.message());

        stack.free("hog").await;
        for run in waiting {
            let (ids, _, finished) = within(120, "the waiting requests", run).await.unwrap().unwrap();
            assert_eq!((ids.len(), finished.finish_reason.as_str()), (20, "length"));
        }
        stack.wait_stats("every block back", |s| s.kv_blocks_used == 0 && s.waiting == 0).await;
    });
}

/// Requests wait, nothing moves (the blocks are held by a lease that no
/// prefill is filling): `/health` and gRPC health turn NOT_SERVING after
/// `stall_timeout_seconds`, and SERVING again once work moves. A long
/// prompt waits for its lease at most `kv_wait_timeout_seconds`, and then
/// leaves the queue.
#[test]
fn health_is_not_serving_while_waiting_work_makes_no_progress() {
    let _serial = serial();
    runtime().block_on(async {
        let settings = Settings { kv_blocks: 40, stall_timeout_seconds: 1.0, kv_wait_timeout_seconds: 2.0, ..Default::default() };
        let stack = Stack::start(settings).await;
        assert_eq!(stack.grpc_health().await, ServingStatus::Serving);
        stack.lease("hog", 600, 40).await.unwrap();
        // Holding blocks with nothing waiting is no stall.
        tokio::time::sleep(Duration::from_millis(1500)).await;
        assert_eq!(stack.health().await.0, 200);

        let mut client = stack.client().await;
        let waiting = tokio::spawn(async move { collect(&mut client, greedy_request(&prompt(5), 4)).await });
        let since = Instant::now();
        let body = within(20, "health to turn NOT_SERVING", async {
            loop {
                let (status, body) = stack.health().await;
                if status == 503 {
                    return body;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        })
        .await;
        println!("NOT_SERVING {:.2} s after the request began to wait: {body}", since.elapsed().as_secs_f64());
        assert!(since.elapsed() >= Duration::from_millis(900));
        assert!(body.contains("no progress"), "{body}");
        assert_eq!(stack.grpc_health().await, ServingStatus::NotServing);
        assert!(!waiting.is_finished());

        stack.free("hog").await;
        let (ids, _, _) = within(60, "the request once blocks are free", waiting).await.unwrap().unwrap();
        assert_eq!(ids.len(), 4);
        within(20, "health to recover", async {
            while stack.health().await.0 != 200 || stack.grpc_health().await != ServingStatus::Serving {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        })
        .await;

        stack.lease("hog", 600, 40).await.unwrap();
        let mut client = stack.client().await;
        let since = Instant::now();
        let late = within(20, "the lease's wait to end", collect(&mut client, greedy_request(&long_prompt(0, 100), 4))).await.unwrap_err();
        assert_eq!(late.code(), Code::ResourceExhausted, "{late:?}");
        assert!(late.message().contains("kv_wait_timeout_seconds"), "{}", late.message());
        assert!(since.elapsed() >= Duration::from_millis(1900), "{:?}", since.elapsed());
        stack.wait_stats("the lease ask gone from the queue", |s| s.waiting == 0).await;
        stack.free("hog").await;
        assert_eq!(stack.stats().await.kv_blocks_used, 0);
    });
}
