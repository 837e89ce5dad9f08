//! `duplex serve`'s process lifecycle, with real processes and real signals:
//! SIGTERM at awkward moments, `kill -9` of a worker and of the supervisor,
//! a second server on busy ports or the same instance, a crash loop, and a
//! start that fails. After each, no process and no file is left behind.

use duplex_tests::{duplex_bin, free_ports, runtime};
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// A `duplex serve` with its own shm directory and ports, its output kept.
struct Serve {
    child: Child,
    log: Arc<Mutex<String>>,
    /// Output streams closed: 2 once the process has exited.
    closed: Arc<std::sync::atomic::AtomicUsize>,
    http: u16,
}

fn config(dir: &Path, [http, grpc, decode, prefill]: [u16; 4]) -> PathBuf {
    let path = dir.join("duplex.toml");
    let text = format!(
        "[router]\nhttp_port = {http}\ngrpc_port = {grpc}\n\n\
         [decode]\nport = {decode}\nmetrics_port = 0\nthreads = 1\n\n\
         [prefill]\nport = {prefill}\nmetrics_port = 0\nthreads = 1\ndevice = \"cpu\"\n"
    );
    std::fs::write(&path, text).unwrap();
    path
}

impl Serve {
    fn start(config: &Path, ports: [u16; 4], shm: &Path, instance: &str, extra: &[&str]) -> Serve {
        let mut child = Command::new(duplex_bin())
            .args(["serve", "--config"])
            .arg(config)
            .args(["--instance", instance, "--ready-timeout", "120", "--shm-dir"])
            .arg(shm)
            .args(extra)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start duplex serve");
        let log = Arc::new(Mutex::new(String::new()));
        let closed = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        for stream in [Box::new(child.stdout.take().unwrap()) as Box<dyn std::io::Read + Send>, Box::new(child.stderr.take().unwrap())] {
            let (log, closed) = (log.clone(), closed.clone());
            std::thread::spawn(move || {
                for line in BufReader::new(stream).lines().map_while(Result::ok) {
                    eprintln!("[serve] {line}");
                    log.lock().unwrap().push_str(&(line + "\n"));
                }
                closed.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            });
        }
        Serve { child, log, closed, http: ports[0] }
    }

    fn log(&self) -> String {
        self.log.lock().unwrap().clone()
    }

    fn wait_for(&self, what: &str, timeout: Duration, pred: impl Fn(&str) -> bool) {
        let deadline = Instant::now() + timeout;
        while !pred(&self.log()) {
            assert!(Instant::now() < deadline, "timed out waiting for {what}; log:\n{}", self.log());
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn wait_ready(&self) {
        let exited = || self.closed.load(std::sync::atomic::Ordering::SeqCst) == 2;
        self.wait_for("the server to be ready", Duration::from_secs(180), |l| l.contains("Duplex is ready") || exited());
        assert!(!exited(), "duplex serve exited instead of becoming ready; log:\n{}", self.log());
    }

    /// Pids of every `name` started so far ("decode worker", "prefill worker", "router").
    fn pids_of(&self, name: &str) -> Vec<i32> {
        let needle = format!("started the {name} (pid ");
        self.log().match_indices(&needle).map(|(at, _)| self.log()[at + needle.len()..].split(')').next().unwrap().parse().unwrap()).collect()
    }

    fn children(&self) -> Vec<i32> {
        ["decode worker", "prefill worker", "router"].iter().flat_map(|n| self.pids_of(n)).collect()
    }

    fn signal(&self, signal: Signal) {
        kill(Pid::from_raw(self.child.id() as i32), signal).unwrap();
    }

    /// The exit status, or None if it is still running after `timeout`.
    fn wait_exit(&mut self, timeout: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                return Some(s);
            }
            if Instant::now() > deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        // A failed test must not leave a server behind.
        let _ = self.child.kill();
        let _ = self.child.wait();
        for pid in self.children() {
            let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
        }
    }
}

fn alive(pid: i32) -> bool {
    // A zombie is dead for our purposes: it holds no port and no mapping.
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| !s.rsplit(')').next().unwrap_or("").trim_start().starts_with('Z'))
}

fn wait_dead(pids: &[i32], timeout: Duration) {
    let deadline = Instant::now() + timeout;
    while pids.iter().any(|&p| alive(p)) {
        assert!(Instant::now() < deadline, "processes still alive after {timeout:?}: {:?}", pids.iter().filter(|&&p| alive(p)).collect::<Vec<_>>());
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn files_in(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    names.sort();
    names
}

fn health(port: u16) -> Option<u16> {
    let rt = runtime();
    rt.block_on(async {
        let r = reqwest::Client::new().get(format!("http://127.0.0.1:{port}/health")).timeout(Duration::from_secs(2)).send().await.ok()?;
        Some(r.status().as_u16())
    })
}

/// Status of a short `/v1/completions` request.
fn complete(port: u16) -> u16 {
    let rt = runtime();
    rt.block_on(async {
        let body = serde_json::json!({"prompt": "Hello", "max_tokens": 4});
        let r = reqwest::Client::new().post(format!("http://127.0.0.1:{port}/v1/completions")).json(&body).timeout(Duration::from_secs(60)).send().await.unwrap();
        r.status().as_u16()
    })
}

/// A tmpfs of `mib` MiB mounted on a fresh directory, unmounted on drop: a
/// small /dev/shm, as Docker gives by default.
struct SmallTmpfs {
    dir: tempfile::TempDir,
}

impl SmallTmpfs {
    fn mount(mib: u32) -> SmallTmpfs {
        let dir = tempfile::tempdir().unwrap();
        let out = Command::new("mount").args(["-t", "tmpfs", "-o", &format!("size={mib}m"), "tmpfs"]).arg(dir.path()).output().expect("run mount");
        assert!(out.status.success(), "mounting a {mib} MiB tmpfs failed (the tests run as root): {}", String::from_utf8_lossy(&out.stderr));
        SmallTmpfs { dir }
    }

    fn path(&self) -> &Path {
        self.dir.path()
    }
}

impl Drop for SmallTmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(self.dir.path()).status();
    }
}

#[test]
fn sigterm_during_a_restart_backoff_stops_everything_and_leaves_no_segment() {
    let dir = tempfile::tempdir().unwrap();
    let shm = tempfile::tempdir().unwrap();
    let ports = free_ports();
    let mut serve = Serve::start(&config(dir.path(), ports), ports, shm.path(), "backoff", &[]);
    serve.wait_ready();
    // Crash the prefill worker twice: the second restart waits a full second.
    for n in 1..=2 {
        let pid = *serve.pids_of("prefill worker").last().unwrap();
        kill(Pid::from_raw(pid), Signal::SIGKILL).unwrap();
        serve.wait_for("the restart's back-off", Duration::from_secs(30), |l| l.matches("restarting it in").count() == n);
        if n == 1 {
            serve.wait_for("the restart", Duration::from_secs(30), |l| l.matches("started the prefill worker").count() == 2);
        }
    }
    let children = serve.children();
    serve.signal(Signal::SIGTERM);
    let status = serve.wait_exit(Duration::from_secs(10)).expect("duplex serve stops within 10 s of SIGTERM during a back-off");
    assert!(status.success(), "{status}; log:\n{}", serve.log());
    wait_dead(&children, Duration::from_secs(5));
    assert_eq!(files_in(shm.path()), Vec::<String>::new(), "segments and locks are removed");
    // Written to a pipe, not a terminal: no colour codes in the logs.
    assert!(!serve.log().contains('\u{1b}'), "ANSI escapes in a log file:\n{}", serve.log());
}

#[test]
fn a_worker_killed_on_a_small_shm_is_restarted_in_the_space_it_held() {
    // The tiny model: ~11 MiB of weights and a 15 MiB KV segment. 32 MiB
    // holds both, but not a second KV segment beside the dead worker's.
    let tmpfs = SmallTmpfs::mount(32);
    let dir = tempfile::tempdir().unwrap();
    let ports = free_ports();
    let serve = Serve::start(&config(dir.path(), ports), ports, tmpfs.path(), "small", &[]);
    serve.wait_ready();
    for round in 1..=2 {
        let pid = *serve.pids_of("decode worker").last().unwrap();
        kill(Pid::from_raw(pid), Signal::SIGKILL).unwrap();
        serve.wait_for("the restart", Duration::from_secs(30), |l| l.matches("started the decode worker").count() == round + 1);
        let deadline = Instant::now() + Duration::from_secs(60);
        while health(serve.http) != Some(200) {
            assert!(Instant::now() < deadline, "the server did not recover after kill -9 of the decode worker; log:\n{}", serve.log());
            std::thread::sleep(Duration::from_millis(100));
        }
        // Serving again: one request runs to its end.
        assert_eq!(complete(serve.http), 200, "a request after the restart failed; log:\n{}", serve.log());
    }
    // Each restart held: the worker exited only when it was killed.
    assert_eq!(serve.log().matches("the decode worker exited").count(), 2, "the restarted worker crash-looped; log:\n{}", serve.log());
    assert!(!serve.log().contains("free but the segment needs"), "log:\n{}", serve.log());
}

#[test]
fn kill_9_of_the_supervisor_takes_its_children_down_and_a_new_server_starts() {
    let dir = tempfile::tempdir().unwrap();
    let shm = tempfile::tempdir().unwrap();
    let ports = free_ports();
    let cfg = config(dir.path(), ports);
    let mut serve = Serve::start(&cfg, ports, shm.path(), "orphans", &[]);
    serve.wait_ready();
    let children = serve.children();
    assert_eq!(children.len(), 3);
    serve.signal(Signal::SIGKILL);
    serve.wait_exit(Duration::from_secs(5)).unwrap();
    wait_dead(&children, Duration::from_secs(10));
    // The same instance on the same ports starts again, reclaiming what the
    // dead server left.
    let again = Serve::start(&cfg, ports, shm.path(), "orphans", &[]);
    again.wait_ready();
    assert_eq!(health(again.http), Some(200));
}

#[test]
fn a_second_server_on_busy_ports_or_the_same_instance_fails_at_once_and_harms_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let shm = tempfile::tempdir().unwrap();
    let ports = free_ports();
    let first = Serve::start(&config(dir.path(), ports), ports, shm.path(), "first", &[]);
    first.wait_ready();
    let segments = files_in(shm.path());

    // Other instance, same ports.
    let dir2 = tempfile::tempdir().unwrap();
    let mut busy = Serve::start(&config(dir2.path(), ports), ports, shm.path(), "second", &[]);
    let status = busy.wait_exit(Duration::from_secs(10)).expect("fails at once");
    assert!(!status.success());
    // The log is read by another thread, which may not have the last line
    // yet when the exit is seen.
    busy.wait_for("the address-in-use error", Duration::from_secs(5), |l| l.contains("address in use"));
    assert!(!busy.log().contains("started the"), "nothing was started: {}", busy.log());

    // Same instance, other ports.
    let other = free_ports();
    let dir3 = tempfile::tempdir().unwrap();
    let mut same = Serve::start(&config(dir3.path(), other), other, shm.path(), "first", &[]);
    let status = same.wait_exit(Duration::from_secs(10)).expect("fails at once");
    assert!(!status.success());
    same.wait_for("the already-served error", Duration::from_secs(5), |l| l.contains("already being served"));

    assert_eq!(files_in(shm.path()), segments, "the first server's segments are untouched");
    assert_eq!(health(first.http), Some(200), "the first server still serves");
}

#[test]
fn a_crash_loop_ends_serve_with_the_last_error() {
    let dir = tempfile::tempdir().unwrap();
    let shm = tempfile::tempdir().unwrap();
    let ports = free_ports();
    let mut serve = Serve::start(&config(dir.path(), ports), ports, shm.path(), "crashloop", &["--max-restarts", "2"]);
    serve.wait_ready();
    // Kill the prefill worker and take its socket: every restart now fails.
    let socket = shm.path().join("crashloop.sockets/prefill.sock");
    let pid = *serve.pids_of("prefill worker").last().unwrap();
    kill(Pid::from_raw(pid), Signal::SIGKILL).unwrap();
    wait_dead(&[pid], Duration::from_secs(5));
    let _ = std::fs::remove_file(&socket);
    let squatter = std::os::unix::net::UnixListener::bind(&socket).expect("take the prefill worker's socket");
    let status = serve.wait_exit(Duration::from_secs(30)).expect("gives up after two restarts");
    drop(squatter);
    assert!(!status.success());
    let log = serve.log();
    assert!(log.contains("crashed 3 times in a row"), "{log}");
    let quoted = &log[log.find("Its last error").expect("quotes the last error")..];
    assert!(quoted.contains("cannot listen on unix:") && quoted.contains("prefill.sock"), "{quoted}");
    assert_eq!(files_in(shm.path()), Vec::<String>::new());
}

#[test]
fn a_start_that_does_not_fit_leaves_no_file() {
    let tmpfs = SmallTmpfs::mount(4);
    let dir = tempfile::tempdir().unwrap();
    let ports = free_ports();
    let mut serve = Serve::start(&config(dir.path(), ports), ports, tmpfs.path(), "nofit", &[]);
    let status = serve.wait_exit(Duration::from_secs(30)).expect("fails at once");
    assert!(!status.success());
    assert!(serve.log().contains("--shm-size"), "{}", serve.log());
    assert_eq!(files_in(tmpfs.path()), Vec::<String>::new());
}

#[test]
fn ipv6_loopback_serves() {
    if std::net::TcpListener::bind("[::1]:0").is_err() {
        panic!("this machine has no IPv6 loopback; the test needs one");
    }
    let dir = tempfile::tempdir().unwrap();
    let shm = tempfile::tempdir().unwrap();
    let ports = free_ports();
    let serve = Serve::start(&config(dir.path(), ports), ports, shm.path(), "ipv6", &["--host", "::1"]);
    serve.wait_ready();
    let rt = runtime();
    let status = rt.block_on(async { reqwest::get(format!("http://[::1]:{}/health", serve.http)).await.unwrap().status().as_u16() });
    assert_eq!(status, 200);
    assert!(serve.log().contains(&format!("http://[::1]:{}/v1", serve.http)), "{}", serve.log());
}

/// A gRPC channel over the Unix socket at `path`.
async fn unix_channel(path: PathBuf) -> tonic::transport::Channel {
    tonic::transport::Endpoint::from_static("http://worker.invalid")
        .connect_with_connector(tower::service_fn(move |_: tonic::codegen::http::Uri| {
            let path = path.clone();
            async move { Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(tokio::net::UnixStream::connect(path).await?)) }
        }))
        .await
        .unwrap()
}

#[test]
fn serve_keeps_the_workers_on_private_sockets_that_want_the_internal_token() {
    use duplex_proto::worker::decode_worker_client::DecodeWorkerClient;
    use duplex_proto::worker::prefill_worker_client::PrefillWorkerClient;
    use duplex_proto::worker::{AllocateKvRequest, CancelRequest, StatsRequest};
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let shm = tempfile::tempdir().unwrap();
    let ports = free_ports();
    let serve = Serve::start(&config(dir.path(), ports), ports, shm.path(), "auth", &[]);
    serve.wait_ready();
    // No TCP port for the workers; their sockets' directory is the user's alone.
    for port in [ports[2], ports[3]] {
        assert!(std::net::TcpStream::connect(("127.0.0.1", port)).is_err(), "a worker listens on TCP port {port}");
    }
    let sockets = shm.path().join("auth.sockets");
    assert_eq!(std::fs::metadata(&sockets).unwrap().permissions().mode() & 0o777, 0o700);
    let rt = runtime();
    rt.block_on(async {
        // Even a process that may open the socket needs the secret.
        let mut decode = DecodeWorkerClient::new(unix_channel(sockets.join("decode.sock")).await);
        let grab = decode.allocate_kv(AllocateKvRequest { request_id: "thief".into(), tokens: 1000, ..Default::default() }).await.unwrap_err();
        assert_eq!(grab.code(), tonic::Code::Unauthenticated, "{grab:?}");
        let cancel = decode.cancel(CancelRequest { request_id: "someone".into() }).await.unwrap_err();
        assert_eq!(cancel.code(), tonic::Code::Unauthenticated);
        let mut prefill = PrefillWorkerClient::new(unix_channel(sockets.join("prefill.sock")).await);
        assert_eq!(prefill.stats(StatsRequest {}).await.unwrap_err().code(), tonic::Code::Unauthenticated);
    });
    // The router, which has the secret, still serves.
    assert_eq!(complete(serve.http), 200);
}

/// A worker started on its own (as in compose) on a TCP port, with a secret
/// in its environment, refuses calls without it and takes calls with it.
#[test]
fn a_standalone_worker_on_tcp_wants_the_internal_token() {
    use duplex_proto::auth::{AddToken, METADATA_KEY, TOKEN_ENV};
    use duplex_proto::worker::decode_worker_client::DecodeWorkerClient;
    use duplex_proto::worker::StatsRequest;
    let shm = tempfile::tempdir().unwrap();
    let [port] = free_ports();
    let mut worker = Command::new(duplex_bin())
        .args(["decode", "--port", &port.to_string(), "--metrics-port", "0", "--threads", "1", "--instance", "standalone", "--shm-dir"])
        .arg(shm.path())
        .env(TOKEN_ENV, "compose-secret")
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let rt = runtime();
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        rt.block_on(async {
            let channel = tonic::transport::Endpoint::from_shared(format!("http://127.0.0.1:{port}")).unwrap();
            let deadline = Instant::now() + Duration::from_secs(60);
            let channel = loop {
                match channel.connect().await {
                    Ok(c) => break c,
                    Err(e) if Instant::now() < deadline => {
                        let _ = e;
                        tokio::time::sleep(Duration::from_millis(50)).await
                    }
                    Err(e) => panic!("the worker never listened: {e}"),
                }
            };
            let mut bare = DecodeWorkerClient::new(channel.clone());
            assert_eq!(bare.stats(StatsRequest {}).await.unwrap_err().code(), tonic::Code::Unauthenticated);
            let mut wrong = DecodeWorkerClient::with_interceptor(channel.clone(), AddToken::new(Some("guess".into())));
            assert_eq!(wrong.stats(StatsRequest {}).await.unwrap_err().code(), tonic::Code::Unauthenticated);
            let mut right = DecodeWorkerClient::with_interceptor(channel, AddToken::new(Some("compose-secret".into())));
            right.stats(StatsRequest {}).await.unwrap_or_else(|e| panic!("a call with {METADATA_KEY} failed: {e}"));
        })
    }));
    let _ = worker.kill();
    let _ = worker.wait();
    if let Err(e) = result {
        std::panic::resume_unwind(e);
    }
}

#[test]
fn serve_api_key_guards_the_public_api_and_stays_off_command_lines() {
    let dir = tempfile::tempdir().unwrap();
    let shm = tempfile::tempdir().unwrap();
    let ports = free_ports();
    let serve = Serve::start(&config(dir.path(), ports), ports, shm.path(), "apikey", &["--api-key", "k3y-for-the-test"]);
    serve.wait_ready();
    assert_eq!(complete(serve.http), 401, "no key");
    let rt = runtime();
    let with_key = rt.block_on(async {
        let body = serde_json::json!({"prompt": "Hello", "max_tokens": 2});
        let url = format!("http://127.0.0.1:{}/v1/completions", serve.http);
        reqwest::Client::new().post(url).bearer_auth("k3y-for-the-test").json(&body).send().await.unwrap().status().as_u16()
    });
    assert_eq!(with_key, 200);
    assert_eq!(health(serve.http), Some(200), "/health stays open");
    for pid in serve.children() {
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap();
        assert!(!String::from_utf8_lossy(&cmdline).contains("k3y-for-the-test"), "pid {pid} shows the key in its command line");
    }
}
