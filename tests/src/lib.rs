//! duplex-tests: a harness that starts a real `duplex serve` (router, prefill
//! worker and decode worker as separate processes) on loopback ports with the
//! bundled tiny model, and helpers to talk to it and look inside it.
//!
//! The `duplex` binary is the one cargo built next to this test binary
//! (`cargo test --workspace` builds it), or `$DUPLEX_BIN`.

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

pub use duplex_proto::v1;

/// Path of the `duplex` executable under test.
pub fn duplex_bin() -> PathBuf {
    if let Some(p) = std::env::var_os("DUPLEX_BIN") {
        return PathBuf::from(p);
    }
    // target/<profile>/deps/serving-<hash> → target/<profile>/duplex
    let exe = std::env::current_exe().expect("test executable path");
    let bin = exe.parent().and_then(|d| d.parent()).expect("target dir").join("duplex");
    assert!(bin.exists(), "{} is missing: run the tests with `cargo test --workspace`, or set DUPLEX_BIN", bin.display());
    bin
}

/// `N` distinct loopback ports that were free a moment ago. All are held
/// until all are chosen: one at a time, the system may hand out a port it
/// has just handed out (two of a server's processes then collide).
pub fn free_ports<const N: usize>() -> [u16; N] {
    let listeners: [std::net::TcpListener; N] = std::array::from_fn(|_| std::net::TcpListener::bind("127.0.0.1:0").unwrap());
    listeners.map(|l| l.local_addr().unwrap().port())
}

#[derive(Clone, Debug)]
pub struct Options {
    pub prefill_threshold_tokens: usize,
    pub max_pending_requests: usize,
    /// Both workers' numeric path.
    pub dtype: &'static str,
    /// Give the prefill worker an emulated accelerator and run prompts of
    /// this many tokens or more with stream-loading prefill; `None` keeps
    /// every prompt on the CPU engine.
    pub slp_threshold_tokens: Option<usize>,
    /// Checkpoint directory; `None` serves the bundled tiny model.
    pub model: Option<PathBuf>,
    /// The decode worker's `device`: `cpu`, or `emulated` for the hybrid
    /// placement on an emulated accelerator with one compute thread.
    pub decode_device: &'static str,
    /// Routed experts the decode device's expert cache holds (0: none).
    pub expert_cache_experts: usize,
    /// With `slp_threshold_tokens`: this many emulated devices for the
    /// prefill worker (`[prefill] devices`), two or more for two-device
    /// prefill; 0 keeps the one `device`.
    pub prefill_devices: usize,
    /// The router's `dslp_idle_window_seconds`.
    pub dslp_idle_window_seconds: f64,
    /// With `slp_threshold_tokens`: the emulated devices' paced copy
    /// bandwidth (`emulated_h2d_gb_per_s`); `None` keeps the default.
    pub prefill_h2d_gb_per_s: Option<f64>,
    /// `duplex serve --override-kv` for each (a GGUF model's metadata overrides).
    pub override_kv: Vec<String>,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            prefill_threshold_tokens: 2048,
            max_pending_requests: 64,
            dtype: "bf16",
            slp_threshold_tokens: None,
            model: None,
            decode_device: "cpu",
            expert_cache_experts: 0,
            prefill_devices: 0,
            dslp_idle_window_seconds: 300.0,
            prefill_h2d_gb_per_s: None,
            override_kv: vec![],
        }
    }
}

/// A running `duplex serve`; stopped (and its segments removed) on drop.
pub struct Server {
    child: Child,
    pub instance: String,
    pub http: String,
    pub grpc: String,
    pub decode_metrics: u16,
    pub prefill_metrics: u16,
    log: Arc<Mutex<String>>,
    _dir: tempfile::TempDir,
}

static COUNTER: AtomicUsize = AtomicUsize::new(0);

impl Server {
    pub fn start(options: Options) -> Server {
        let dir = tempfile::tempdir().unwrap();
        let instance = format!("duplex-test-{}-{}", std::process::id(), COUNTER.fetch_add(1, Ordering::SeqCst));
        let [http, grpc, decode, prefill, decode_metrics, prefill_metrics] = free_ports();
        let config = format!(
            "[router]\nhttp_port = {http}\ngrpc_port = {grpc}\nprefill_threshold_tokens = {}\nmax_pending_requests = {}\ndslp_idle_window_seconds = {}\n\n\
             [decode]\nport = {decode}\nmetrics_port = {decode_metrics}\nthreads = 1\ndtype = \"{dtype}\"\ndevice = \"{decode_device}\"\ndevice_memory_mib = 256\ndevice_threads = 1\nexpert_cache_experts = {expert_cache}\nexpert_prefetch = \"{prefetch}\"\n\n\
             [prefill]\nport = {prefill}\nmetrics_port = {prefill_metrics}\nthreads = 1\ndtype = \"{dtype}\"\n",
            options.prefill_threshold_tokens,
            options.max_pending_requests,
            options.dslp_idle_window_seconds,
            dtype = options.dtype,
            decode_device = options.decode_device,
            expert_cache = options.expert_cache_experts,
            // With a cache, prefetch too, so that every metric of the cache moves.
            prefetch = if options.expert_cache_experts > 0 { "impact" } else { "none" }
        );
        let slp = match options.slp_threshold_tokens {
            Some(n) => {
                let devices = vec!["\"emulated\""; options.prefill_devices].join(", ");
                let paced = options.prefill_h2d_gb_per_s.map_or(String::new(), |rate| format!("emulated_h2d_gb_per_s = {rate}\n"));
                format!("device = \"emulated\"\ndevices = [{devices}]\nslp_threshold_tokens = {n}\ndevice_memory_mib = 64\ndense_budget_mib = 4\n{paced}")
            }
            None => "device = \"cpu\"\n".into(),
        };
        let config = config + &slp;
        let config_path = dir.path().join("duplex.toml");
        std::fs::write(&config_path, config).unwrap();
        let mut command = Command::new(duplex_bin());
        command.args(["serve", "--config"]).arg(&config_path);
        if let Some(model) = &options.model {
            command.arg("--model").arg(model);
        }
        for o in &options.override_kv {
            command.arg("--override-kv").arg(o);
        }
        let mut child = command
            .args(["--instance", &instance, "--ready-timeout", "120"])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start duplex serve");
        let log = Arc::new(Mutex::new(String::new()));
        // Each output stream says `true` when the server is ready, and
        // `false` when it closes (the server has exited).
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        for stream in [Box::new(child.stdout.take().unwrap()) as Box<dyn std::io::Read + Send>, Box::new(child.stderr.take().unwrap())] {
            let (log, ready_tx) = (log.clone(), ready_tx.clone());
            std::thread::spawn(move || {
                for line in BufReader::new(stream).lines().map_while(Result::ok) {
                    eprintln!("[serve] {line}");
                    if line.starts_with("Duplex is ready") {
                        let _ = ready_tx.send(true);
                    }
                    log.lock().unwrap().push_str(&(line + "\n"));
                }
                let _ = ready_tx.send(false);
            });
        }
        let server = Server {
            child,
            instance,
            http: format!("http://127.0.0.1:{http}"),
            grpc: format!("http://127.0.0.1:{grpc}"),
            decode_metrics,
            prefill_metrics,
            log,
            _dir: dir,
        };
        let deadline = Instant::now() + Duration::from_secs(180);
        let mut closed = 0;
        loop {
            match ready_rx.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
                Ok(true) => return server,
                Ok(false) if closed == 0 => closed += 1,
                // Both streams closed, or the deadline passed: no point waiting.
                _ => panic!("duplex serve did not become ready; its log:\n{}", server.log()),
            }
        }
    }

    /// Everything the supervisor and its children printed so far.
    pub fn log(&self) -> String {
        self.log.lock().unwrap().clone()
    }

    /// The pid of the latest `name` ("decode worker", "prefill worker", "router").
    pub fn pid_of(&self, name: &str) -> u32 {
        let needle = format!("started the {name} (pid ");
        let log = self.log();
        let at = log.rfind(&needle).unwrap_or_else(|| panic!("no pid for {name} in:\n{log}")) + needle.len();
        log[at..].split(')').next().unwrap().parse().unwrap()
    }

    /// Wait until `pred` holds of the log.
    pub fn wait_for_log(&self, what: &str, timeout: Duration, pred: impl Fn(&str) -> bool) {
        let deadline = Instant::now() + timeout;
        while !pred(&self.log()) {
            assert!(Instant::now() < deadline, "timed out waiting for {what}; log:\n{}", self.log());
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    pub async fn grpc_client(&self) -> v1::generation_client::GenerationClient<tonic::transport::Channel> {
        v1::generation_client::GenerationClient::connect(self.grpc.clone()).await.expect("connect to the router's gRPC port")
    }

    /// A metric's value from a process's `/metrics` (summed over label sets
    /// matching `labels`, e.g. `part="moe"`), or None if absent.
    pub async fn metric(&self, url: &str, name: &str, labels: &str) -> Option<f64> {
        let text = reqwest::get(url).await.ok()?.text().await.ok()?;
        let mut found = None;
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            let Some((key, value)) = line.rsplit_once(' ') else { continue };
            let base = key.split('{').next().unwrap();
            if base == name && key.contains(labels) {
                *found.get_or_insert(0.0) += value.parse::<f64>().ok()?;
            }
        }
        found
    }

    pub fn decode_metrics_url(&self) -> String {
        format!("http://127.0.0.1:{}/metrics", self.decode_metrics)
    }

    pub fn prefill_metrics_url(&self) -> String {
        format!("http://127.0.0.1:{}/metrics", self.prefill_metrics)
    }

    /// Stop the supervisor as Ctrl-C would, and wait for it.
    pub fn stop(&mut self) -> std::process::ExitStatus {
        let pid = nix::unistd::Pid::from_raw(self.child.id() as i32);
        let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status;
            }
            if Instant::now() > deadline {
                let _ = self.child.kill();
                return self.child.wait().unwrap();
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Token ids of `duplex generate` for `prompt` (greedy, EOS ignored) on the
/// numeric path `dtype` (`bf16` or `f32`).
pub fn generate_cli(prompt: &[u32], max_tokens: usize, dtype: &str) -> Vec<u32> {
    let ids: Vec<String> = prompt.iter().map(|t| t.to_string()).collect();
    let out = Command::new(duplex_bin())
        .args(["generate", "--tokens", &ids.join(","), "--temperature", "0", "--ignore-eos", "--json", "--dtype", dtype])
        .args(["--max-tokens", &max_tokens.to_string()])
        .output()
        .expect("run duplex generate");
    assert!(out.status.success(), "duplex generate failed: {}", String::from_utf8_lossy(&out.stderr));
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).expect("generate --json output");
    json["tokens"].as_array().unwrap().iter().map(|t| t.as_u64().unwrap() as u32).collect()
}

/// A greedy request for `prompt` ids that ignores EOS.
pub fn greedy_request(prompt: &[u32], max_tokens: u32) -> v1::GenerateRequest {
    v1::GenerateRequest {
        prompt: Some(v1::generate_request::Prompt::Tokens(v1::TokenIds { ids: prompt.to_vec() })),
        sampling: Some(v1::SamplingParameters { temperature: Some(0.0), ..Default::default() }),
        stopping: Some(v1::StoppingCriteria { max_tokens, ignore_eos: true, ..Default::default() }),
        ..Default::default()
    }
}

/// Run a Generate stream to its end: the token ids, and the final message.
pub async fn collect(
    client: &mut v1::generation_client::GenerationClient<tonic::transport::Channel>,
    request: v1::GenerateRequest,
) -> Result<(Vec<u32>, String, v1::Finished), tonic::Status> {
    let mut stream = client.generate(request).await?.into_inner();
    let (mut ids, mut text) = (vec![], String::new());
    while let Some(message) = stream.message().await? {
        match message.event {
            Some(v1::generate_response::Event::Token(t)) => {
                ids.push(t.id);
                text.push_str(&t.text);
            }
            Some(v1::generate_response::Event::Finished(f)) => {
                text.push_str(&f.text);
                return Ok((ids, text, f));
            }
            None => {}
        }
    }
    Err(tonic::Status::internal("stream ended without a finished message"))
}

/// A prompt of `n` token ids from the fixture's own reference prompts
/// (repeated as needed), so it is realistic for the tiny model.
pub fn prompt(n: usize) -> Vec<u32> {
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(PathBuf::from(duplex_model::BUNDLED_MODEL).join("reference.json")).unwrap()).unwrap();
    let ids: Vec<u32> = json["prompts"][3]["input_ids"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect();
    ids.iter().cycle().take(n).copied().collect()
}

/// One server at a time within a test binary: CI machines have two cores.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

/// Hold while a test runs a server.
pub fn serial() -> std::sync::MutexGuard<'static, ()> {
    ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner())
}

pub fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread().enable_all().build().unwrap()
}

/// Every wait is bounded, so a deadlock or a bug fails the test instead of
/// hanging CI.
pub async fn within<T>(seconds: u64, what: &str, f: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(seconds), f).await.unwrap_or_else(|_| panic!("{what} took more than {seconds} s"))
}
