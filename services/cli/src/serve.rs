//! `duplex serve`: the supervisor. It puts the weights into shared memory
//! once, starts the decode worker, the prefill worker and the router as
//! separate processes (this same binary, with the `decode`, `prefill` and
//! `router` subcommands), waits until the router reports ready, prints the
//! endpoints, and restarts any process that dies. A restarted worker attaches
//! to the weight segment instead of reading the checkpoint again. On Ctrl-C
//! or SIGTERM, at any moment, it stops the children and removes the shared
//! segments.
//!
//! What keeps an unlucky operator out of trouble:
//! - the instance lock: one supervisor per instance name and shm directory,
//!   so a second `duplex serve` never removes the segments of a live one;
//! - the ports are checked before anything starts, so a second server on
//!   busy ports fails at once instead of polling the first one's `/health`;
//! - children die with the supervisor (`PR_SET_PDEATHSIG`), even under
//!   `kill -9`, so they never linger as orphans holding the ports;
//! - restarts back off exponentially, and a child that keeps crashing ends
//!   `duplex serve` with its last error instead of looping for ever.

use anyhow::{anyhow, bail, Context, Result};
use clap::Args;
use duplex_decode::config::DecodeArgs;
use duplex_ipc::{KvSegment, WeightStore};
use duplex_prefill::config::PrefillArgs;
use duplex_router::config::RouterArgs;
use std::collections::VecDeque;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::io::AsyncBufReadExt;
use tokio::process::{Child, Command};
use tokio::sync::watch;

#[derive(Args)]
pub struct ServeArgs {
    /// Checkpoint directory.
    #[arg(long, default_value_os_t = duplex_model::bundled_model())]
    model: PathBuf,
    /// Override a GGUF model's metadata key for both workers, KEY=TYPE:VALUE
    /// (TYPE int, float, bool or str), as llama.cpp's --override-kv; repeatable
    /// [default: the config file's `override_kv`].
    #[arg(long)]
    override_kv: Vec<String>,
    /// Address every process listens on.
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// OpenAI-compatible HTTP port [default: 8000, or the config file's].
    #[arg(long)]
    http_port: Option<u16>,
    /// Public gRPC port [default: 50051, or the config file's].
    #[arg(long)]
    grpc_port: Option<u16>,
    /// TOML config file with `[router]`, `[prefill]` and `[decode]` sections.
    #[arg(long)]
    config: Option<PathBuf>,
    /// Prefix of the shared-memory segments' names.
    #[arg(long, default_value = "duplex")]
    instance: String,
    /// Directory of the shared-memory segments [default: $DUPLEX_SHM_DIR or /dev/shm].
    #[arg(long)]
    shm_dir: Option<PathBuf>,
    /// Give up if the server is not ready within this many seconds.
    #[arg(long, default_value_t = 600)]
    ready_timeout: u64,
    /// Give up, exiting non-zero with its last error, when one process has
    /// crashed this many times in a row (each within a minute of its start).
    #[arg(long, default_value_t = 5)]
    max_restarts: u32,
    /// Key the public HTTP and gRPC APIs require (`Authorization: Bearer`);
    /// `/health` and `/metrics` stay open [default: the router's `api_key`
    /// setting: $DUPLEX_ROUTER_API_KEY, $DUPLEX_API_KEY or the config file,
    /// else none]. Given to the router in its environment, not its command line.
    #[arg(long)]
    api_key: Option<String>,
}

/// A process that runs for this long is healthy again: its next crash
/// starts a fresh back-off.
const HEALTHY_RUN: Duration = Duration::from_secs(60);
/// The first restart's delay; each further crash in a row doubles it.
const FIRST_BACKOFF: Duration = Duration::from_millis(500);
const MAX_BACKOFF: Duration = Duration::from_secs(30);
/// Lines of a child's stderr kept, to quote when it gives up.
const LAST_LINES: usize = 20;
/// How long a child is given to exit after SIGTERM before it is killed.
const STOP_GRACE: Duration = Duration::from_secs(5);

/// Whether Ctrl-C or SIGTERM has arrived. The signals are watched from the
/// supervisor's first moment, so every wait (building the weights, the
/// readiness poll, a restart's back-off) can end on them.
#[derive(Clone)]
struct Shutdown(watch::Receiver<bool>);

impl Shutdown {
    async fn install() -> Shutdown {
        let (tx, rx) = watch::channel(false);
        tokio::spawn(async move {
            duplex_telemetry::process::shutdown_signal().await;
            let _ = tx.send(true);
        });
        // Let the task register its signal handlers before anything else runs.
        tokio::task::yield_now().await;
        Shutdown(rx)
    }

    async fn requested(&mut self) {
        let _ = self.0.wait_for(|&stop| stop).await;
    }
}

/// The cores `duplex serve` gives the two workers when neither sets `cores`.
#[derive(Debug, PartialEq, Eq)]
struct CoreSets {
    decode: Vec<usize>,
    prefill: Vec<usize>,
}

/// Disjoint core sets out of `allowed` (the cores the supervisor may run
/// on, ascending), so that a running prefill and the decode worker's experts
/// do not fight over cores. With an accelerator the prefill worker mostly
/// waits on it: it gets max(1, n/8) cores, the highest-numbered, and the
/// decode worker's expert pool the rest. With a CPU prefill the two halves,
/// decode taking the lower one and, for an odd count, the extra core (it
/// serves every token). One core: both share it.
fn default_core_sets(allowed: &[usize], prefill_accelerator: bool) -> CoreSets {
    let n = allowed.len();
    if n <= 1 {
        return CoreSets { decode: allowed.to_vec(), prefill: allowed.to_vec() };
    }
    let prefill = if prefill_accelerator { (n / 8).max(1) } else { n / 2 };
    let (decode, prefill) = allowed.split_at(n - prefill);
    CoreSets { decode: decode.to_vec(), prefill: prefill.to_vec() }
}

/// Whether the prefill worker runs on an accelerator (`devices`, or a
/// `device` named), for the core split. `auto` counts as the CPU: knowing whether CUDA is there would mean
/// opening it in the supervisor, and the smaller prefill set would starve a
/// CPU prefill, while the larger one only costs decode a few cores.
fn prefill_has_accelerator(prefill: &duplex_prefill::PrefillConfig) -> bool {
    !prefill.devices.is_empty() || matches!(prefill.device.as_str(), "cuda" | "emulated")
}

/// `--cores` for the decode and prefill workers: the default split when
/// neither config sets `cores`, else none (each worker takes its own). A
/// worker whose `threads` or `numa_nodes` do not fit its default set is an
/// error now, saying what to set, rather than a worker dying at start.
fn worker_cores(decode: &duplex_decode::DecodeConfig, prefill: &duplex_prefill::PrefillConfig) -> Result<Option<CoreSets>> {
    if !decode.cores.trim().is_empty() || !prefill.cores.trim().is_empty() {
        return Ok(None);
    }
    let allowed = duplex_kernels::pool::allowed_cores();
    if allowed.is_empty() {
        eprintln!("duplex serve: cannot read this process's cores; the workers are left to pin as they do alone");
        return Ok(None);
    }
    let sets = default_core_sets(&allowed, prefill_has_accelerator(prefill));
    let list = duplex_kernels::pool::format_cpu_list;
    for (name, threads, nodes, set) in [("decode", decode.threads, decode.numa_nodes, &sets.decode), ("prefill", prefill.threads, prefill.numa_nodes, &sets.prefill)] {
        if let Err(e) = duplex_kernels::pool::PoolConfig::on_cores(threads, nodes, set) {
            bail!("[{name}]: {e}; duplex serve gives the {name} worker cores {} by default: lower its threads / numa_nodes, or set `cores` in [decode] and [prefill]", list(set));
        }
    }
    if allowed.len() == 1 {
        eprintln!("duplex serve: one core ({}): both workers share it", list(&allowed));
    } else {
        eprintln!("duplex serve: cores: decode worker {}, prefill worker {} (set `cores` in [decode] or [prefill] to choose)", list(&sets.decode), list(&sets.prefill));
    }
    Ok(Some(sets))
}

/// Exponential back-off, capped: the delay before the `n`-th restart in a row.
fn backoff(n: u32) -> Duration {
    FIRST_BACKOFF.saturating_mul(1u32 << n.saturating_sub(1).min(16)).min(MAX_BACKOFF)
}

/// One supervised process: how to start it, the running child, its crashes
/// in a row, and the last lines it wrote to stderr.
struct Supervised {
    name: &'static str,
    args: Vec<String>,
    /// Environment for it: the internal calls' secret, the API key.
    env: Vec<(&'static str, String)>,
    child: Child,
    started: Instant,
    crashes: u32,
    last_lines: Arc<Mutex<VecDeque<String>>>,
}

impl Supervised {
    fn start(name: &'static str, args: Vec<String>, env: Vec<(&'static str, String)>) -> Result<Self> {
        let last_lines = Arc::new(Mutex::new(VecDeque::new()));
        let child = spawn(name, &args, &env, &last_lines)?;
        Ok(Supervised { name, args, env, child, started: Instant::now(), crashes: 0, last_lines })
    }

    fn last_error(&self) -> String {
        let lines = self.last_lines.lock().unwrap_or_else(|e| e.into_inner());
        if lines.is_empty() {
            "(it wrote nothing to stderr)".into()
        } else {
            lines.iter().cloned().collect::<Vec<_>>().join("\n")
        }
    }
}

fn spawn(name: &str, args: &[String], env: &[(&'static str, String)], last_lines: &Arc<Mutex<VecDeque<String>>>) -> Result<Child> {
    let exe = std::env::current_exe().context("cannot find the duplex executable")?;
    let mut command = Command::new(exe);
    command.args(args).envs(env.iter().map(|(k, v)| (k, v))).kill_on_drop(true).stderr(Stdio::piped());
    let supervisor = std::process::id();
    // SAFETY: between fork and exec only async-signal-safe calls are made
    // (prctl, getppid, _exit), as `pre_exec` requires.
    unsafe {
        command.pre_exec(move || {
            // The child gets SIGTERM when the supervisor dies, however it
            // dies. The supervisor runs on one thread (a current-thread
            // runtime), and PDEATHSIG follows the thread that forked.
            nix::sys::prctl::set_pdeathsig(nix::sys::signal::Signal::SIGTERM).map_err(std::io::Error::from)?;
            // The supervisor may have died before the line above.
            if std::os::unix::process::parent_id() != supervisor {
                nix::libc::_exit(1);
            }
            Ok(())
        });
    }
    let mut child = command.spawn().with_context(|| format!("cannot start the {name}"))?;
    eprintln!("duplex serve: started the {name} (pid {})", child.id().unwrap_or(0));
    // Pass its stderr through, keeping the last lines to quote should it give up.
    if let Some(stderr) = child.stderr.take() {
        let last_lines = last_lines.clone();
        tokio::spawn(async move {
            let mut lines = tokio::io::BufReader::new(stderr).lines();
            while let Ok(Some(line)) = lines.next_line().await {
                // Keep draining even if our own stderr is gone (`| head`):
                // a child blocked on a full pipe would stop serving.
                let _ = writeln!(std::io::stderr(), "{line}");
                let mut kept = last_lines.lock().unwrap_or_else(|e| e.into_inner());
                if kept.len() == LAST_LINES {
                    kept.pop_front();
                }
                kept.push_back(line);
            }
        });
    }
    Ok(child)
}

fn flag(name: &str, value: impl ToString) -> [String; 2] {
    [format!("--{name}"), value.to_string()]
}

/// `host:port` for a URL: an IPv6 address goes in brackets.
fn url_authority(host: &str, port: u16) -> String {
    if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

pub fn run(args: ServeArgs) -> Result<()> {
    // One thread: the children's death signal is tied to the thread that
    // forked them, which must therefore live as long as the supervisor.
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let result = runtime.block_on(supervise(args));
    // A weight build interrupted by a signal may still be running on a
    // blocking thread: do not wait for it.
    runtime.shutdown_background();
    result
}

/// Held while `duplex serve` runs: `<shm_dir>/<instance>.serve.lock`. A
/// second supervisor of the same instance would remove the first one's
/// segments when it stops; it is refused at once instead.
struct InstanceLock {
    path: PathBuf,
    _file: std::fs::File,
}

impl InstanceLock {
    fn take(shm_dir: &Path, instance: &str) -> Result<InstanceLock> {
        std::fs::create_dir_all(shm_dir).with_context(|| format!("cannot create {}", shm_dir.display()))?;
        let path = shm_dir.join(format!("{instance}.serve.lock"));
        let file = std::fs::File::options().create(true).truncate(false).write(true).open(&path).with_context(|| format!("cannot open {}", path.display()))?;
        match file.try_lock() {
            Ok(()) => Ok(InstanceLock { path, _file: file }),
            Err(std::fs::TryLockError::WouldBlock) => bail!(
                "instance {instance:?} is already being served from {} (its lock {} is held); stop that server, or give this one another --instance",
                shm_dir.display(),
                path.display()
            ),
            Err(std::fs::TryLockError::Error(e)) => Err(e).with_context(|| format!("cannot lock {}", path.display())),
        }
    }
}

impl Drop for InstanceLock {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// `<shm_dir>/<instance>.sockets/`, mode 0700: the workers' Unix sockets.
/// Only this user's processes can connect to them, and the internal secret
/// is checked on top. Removed when dropped; one left by a dead supervisor is
/// replaced (the instance lock says there is no live one).
struct SocketDir(PathBuf);

impl SocketDir {
    fn create(shm_dir: &Path, instance: &str) -> Result<SocketDir> {
        use std::os::unix::fs::DirBuilderExt;
        let path = shm_dir.join(format!("{instance}.sockets"));
        if path.exists() {
            std::fs::remove_dir_all(&path).with_context(|| format!("cannot remove the stale {}", path.display()))?;
        }
        std::fs::DirBuilder::new().mode(0o700).create(&path).with_context(|| format!("cannot create {}", path.display()))?;
        Ok(SocketDir(path))
    }

    fn decode(&self) -> PathBuf {
        self.0.join("decode.sock")
    }

    fn prefill(&self) -> PathBuf {
        self.0.join("prefill.sock")
    }
}

impl Drop for SocketDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Fail at once, naming the address, if any port is taken: otherwise the
/// router would die on it after the weights were built, and the readiness
/// poll might even be answered by the server already on that port.
fn check_ports_free(host: &str, ports: &[(&str, u16)]) -> Result<()> {
    for &(what, port) in ports {
        if port == 0 {
            continue;
        }
        let addr = url_authority(host, port);
        if let Err(e) = std::net::TcpListener::bind((host, port)) {
            if e.kind() == std::io::ErrorKind::AddrInUse {
                bail!("cannot listen on {addr} ({what}): address in use; is another server running there? Stop it or choose another port");
            }
            return Err(e).with_context(|| format!("cannot listen on {addr} ({what})"));
        }
    }
    Ok(())
}

async fn supervise(a: ServeArgs) -> Result<()> {
    let mut stop = Shutdown::install().await;
    duplex_model::check_model_dir(&a.model).map_err(anyhow::Error::msg)?;
    let shm_dir = a.shm_dir.clone().unwrap_or_else(duplex_ipc::default_shm_dir);
    // What each process will run with: its section of the config file under
    // the flags given here.
    let config = || a.config.clone();
    let overrides = || (!a.override_kv.is_empty()).then(|| a.override_kv.clone());
    let decode = DecodeArgs { config: config(), override_kv: overrides(), ..DecodeArgs::default() }.resolve()?;
    let prefill = PrefillArgs { config: config(), override_kv: overrides(), ..PrefillArgs::default() }.resolve()?;
    // The workers share one weight segment, built from one reading of the model.
    if decode.override_kv != prefill.override_kv {
        bail!("override_kv differs between [decode] ({:?}) and [prefill] ({:?}): the workers share one weight segment, so give them the same overrides", decode.override_kv, prefill.override_kv);
    }
    let source = duplex_model::source::ModelSource::locate_with(&a.model, &decode.override_kv)?;
    let router = RouterArgs { config: config(), ..RouterArgs::default() }.resolve()?;
    let core_sets = worker_cores(&decode, &prefill)?;
    let http_port = a.http_port.unwrap_or(router.http_port);
    let grpc_port = a.grpc_port.unwrap_or(router.grpc_port);
    // The workers take internal calls on Unix sockets, not TCP ports.
    check_ports_free(
        &a.host,
        &[("HTTP", http_port), ("gRPC", grpc_port), ("decode worker metrics", decode.metrics_port), ("prefill worker metrics", prefill.metrics_port)],
    )?;
    let instance_lock = InstanceLock::take(&shm_dir, &a.instance)?;
    let sockets = match SocketDir::create(&shm_dir, &a.instance) {
        Ok(s) => s,
        Err(e) => {
            drop(instance_lock);
            return Err(e);
        }
    };

    let started = Instant::now();
    let weights = duplex_ipc::weight_segment_name(&a.instance);
    let build = {
        let (shm_dir, weights, source, numa_nodes) = (shm_dir.clone(), weights.clone(), source.clone(), decode.numa_nodes);
        tokio::task::spawn_blocking(move || {
            let mut progress = duplex_telemetry::progress::ByteProgress::new("duplex serve: building the weight segment");
            // Placed for the decode worker's pool, whose threads compute the experts.
            let r = WeightStore::open_or_build_placed(&shm_dir, &weights, &source, numa_nodes, &mut |done, total| progress.update(done, total));
            progress.finish();
            r
        })
    };
    let built = tokio::select! {
        r = build => r.context("the weight segment's builder panicked")?,
        _ = stop.requested() => {
            // The build goes on for the moments until the process exits;
            // what it wrote is removed now.
            let _ = WeightStore::remove(&shm_dir, &weights);
            drop(instance_lock);
            bail!("interrupted while building the weight segment");
        }
    };
    let (store, provenance) = match built {
        Ok(b) => b,
        Err(e) => {
            drop(instance_lock);
            return Err(e.into());
        }
    };
    eprintln!(
        "duplex serve: weight segment {} ({:.1} MiB) {provenance:?} in {:.2} s",
        store.path().display(),
        store.size_bytes() as f64 / (1 << 20) as f64,
        started.elapsed().as_secs_f64()
    );
    if provenance == duplex_ipc::Provenance::Built && store.placement().nodes > 1 {
        eprintln!("duplex serve: {}", store.placement());
    }
    drop(store);

    let common = |sub: &str| -> Vec<String> {
        let mut v = vec![sub.to_string()];
        if let Some(c) = &a.config {
            v.extend(flag("config", c.display()));
        }
        v.extend(flag("model", a.model.display()));
        v.extend(flag("host", &a.host));
        v
    };
    let worker = |sub: &str| -> Vec<String> {
        let mut v = common(sub);
        v.extend(flag("shm-dir", shm_dir.display()));
        v.extend(flag("instance", &a.instance));
        for o in &a.override_kv {
            v.extend(flag("override-kv", o));
        }
        v
    };
    let mut decode_args = worker("decode");
    decode_args.extend(flag("unix-socket", sockets.decode().display()));
    let mut prefill_args = worker("prefill");
    prefill_args.extend(flag("unix-socket", sockets.prefill().display()));
    if let Some(sets) = core_sets {
        decode_args.extend(flag("cores", duplex_kernels::pool::format_cpu_list(&sets.decode)));
        prefill_args.extend(flag("cores", duplex_kernels::pool::format_cpu_list(&sets.prefill)));
    }
    let mut router_args = common("router");
    router_args.extend(flag("http-port", http_port));
    router_args.extend(flag("grpc-port", grpc_port));
    router_args.extend(flag("decode-worker", format!("unix:{}", sockets.decode().display())));
    router_args.extend(flag("prefill-worker", format!("unix:{}", sockets.prefill().display())));

    // Router ↔ worker calls carry this secret (see `duplex_proto::auth`):
    // the operator's, when given, else a fresh one per start.
    let token = duplex_proto::auth::token_from_env().unwrap_or_else(duplex_proto::auth::new_token);
    let mut children = Vec::new();
    for (name, args) in [("decode worker", decode_args), ("prefill worker", prefill_args), ("router", router_args)] {
        let mut env = vec![(duplex_proto::auth::TOKEN_ENV, token.clone())];
        if let (Some(key), "router") = (&a.api_key, name) {
            // The router's own variable, which wins over the environment
            // it inherits (and only a flag would win over it).
            env.push(("DUPLEX_ROUTER_API_KEY", key.clone()));
        }
        match Supervised::start(name, args, env) {
            Ok(c) => children.push(c),
            Err(e) => {
                shutdown(&mut children, &shm_dir, &a.instance).await;
                return Err(e);
            }
        }
    }

    let result = tokio::select! {
        r = wait_ready(&a.host, http_port, Duration::from_secs(a.ready_timeout), &mut children) => r,
        _ = stop.requested() => Err(anyhow!("interrupted before the server was ready")),
    };
    if let Err(e) = result {
        shutdown(&mut children, &shm_dir, &a.instance).await;
        return Err(e);
    }
    let http = url_authority(&a.host, http_port);
    println!("Duplex is ready: model {}", a.model.display());
    println!("  OpenAI HTTP  http://{http}/v1  (health /health, metrics /metrics)");
    println!("  gRPC         {}  (duplex.v1.Generation, grpc.health.v1, reflection)", url_authority(&a.host, grpc_port));
    if decode.metrics_port != 0 || prefill.metrics_port != 0 {
        println!(
            "  worker metrics  http://{}/metrics (decode), http://{}/metrics (prefill)",
            url_authority(&a.host, decode.metrics_port),
            url_authority(&a.host, prefill.metrics_port)
        );
    }

    let outcome = supervise_running(&mut children, &mut stop, a.max_restarts).await;
    shutdown(&mut children, &shm_dir, &a.instance).await;
    drop(sockets);
    drop(instance_lock);
    outcome
}

/// Restart children as they die, until a signal (Ok) or a crash loop (Err).
async fn supervise_running(children: &mut [Supervised], stop: &mut Shutdown, max_restarts: u32) -> Result<()> {
    loop {
        let (i, status) = tokio::select! {
            exit = first_exit(children) => exit,
            _ = stop.requested() => return Ok(()),
        };
        let status = status?;
        let c = &mut children[i];
        if c.started.elapsed() >= HEALTHY_RUN {
            c.crashes = 0;
        }
        c.crashes += 1;
        if c.crashes > max_restarts {
            bail!("the {} crashed {} times in a row (last: {status}); giving up. Its last error:\n{}", c.name, c.crashes, c.last_error());
        }
        let delay = backoff(c.crashes);
        eprintln!("duplex serve: the {} exited ({status}); restarting it in {:.1} s (crash {} of at most {max_restarts} in a row)", c.name, delay.as_secs_f64(), c.crashes);
        tokio::select! {
            _ = tokio::time::sleep(delay) => {}
            _ = stop.requested() => return Ok(()),
        }
        c.child = spawn(c.name, &c.args, &c.env, &c.last_lines)?;
        c.started = Instant::now();
    }
}

/// The index and exit status of the first child to exit.
async fn first_exit(children: &mut [Supervised]) -> (usize, std::io::Result<ExitStatus>) {
    let waits = children.iter_mut().enumerate().map(|(i, c)| Box::pin(async move { (i, c.child.wait().await) }));
    futures::future::select_all(waits).await.0
}

/// Poll the router's `/health` until it answers 200 (both workers ready).
async fn wait_ready(host: &str, http_port: u16, timeout: Duration, children: &mut [Supervised]) -> Result<()> {
    let url = format!("http://{}/health", url_authority(host, http_port));
    let client = reqwest::Client::new();
    let deadline = Instant::now() + timeout;
    loop {
        for c in children.iter_mut() {
            if let Some(status) = c.child.try_wait()? {
                bail!("the {} exited ({status}) before the server was ready. Its last error:\n{}", c.name, c.last_error());
            }
        }
        if let Ok(r) = client.get(&url).timeout(Duration::from_secs(2)).send().await {
            if r.status().is_success() {
                return Ok(());
            }
        }
        if Instant::now() > deadline {
            bail!("the server was not ready within {} s ({url} never answered 200)", timeout.as_secs());
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// SIGTERM every child, wait for them (killing stragglers), then remove the
/// shared segments: a clean shutdown leaves nothing in /dev/shm. The KV
/// segment is removed only if its owner (the decode worker) is dead.
async fn shutdown(children: &mut [Supervised], shm_dir: &Path, instance: &str) {
    eprintln!("duplex serve: shutting down");
    for c in children.iter() {
        if let Some(pid) = c.child.id() {
            let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid as i32), nix::sys::signal::Signal::SIGTERM);
        }
    }
    let waits = children.iter_mut().map(|c| async move {
        if tokio::time::timeout(STOP_GRACE, c.child.wait()).await.is_err() {
            eprintln!("duplex serve: the {} did not stop within {} s; killing it", c.name, STOP_GRACE.as_secs());
            let _ = c.child.kill().await;
        }
    });
    futures::future::join_all(waits).await;
    let _ = WeightStore::remove(shm_dir, &duplex_ipc::weight_segment_name(instance));
    match KvSegment::remove_if_unowned(shm_dir, &duplex_ipc::kv_segment_name(instance)) {
        Ok(true) => {}
        Ok(false) => eprintln!("duplex serve: the KV segment is still owned by a live process; left in place"),
        Err(e) => eprintln!("duplex serve: cannot remove the KV segment: {e}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_and_is_capped() {
        let d: Vec<u64> = (1..=9).map(|n| backoff(n).as_millis() as u64).collect();
        assert_eq!(d, [500, 1000, 2000, 4000, 8000, 16000, 30000, 30000, 30000]);
    }

    #[test]
    fn ipv6_hosts_are_bracketed_in_urls() {
        assert_eq!(url_authority("::1", 80), "[::1]:80");
        assert_eq!(url_authority("127.0.0.1", 80), "127.0.0.1:80");
        assert_eq!(url_authority("localhost", 80), "localhost:80");
    }

    #[test]
    fn default_core_sets_are_disjoint_and_favour_decode() {
        let cores = |n: usize| (0..n).collect::<Vec<_>>();
        let sets = |n, accel| {
            let s = default_core_sets(&cores(n), accel);
            (s.decode, s.prefill)
        };
        // An accelerator prefill: max(1, n/8) highest cores.
        assert_eq!(sets(2, true), (vec![0], vec![1]));
        assert_eq!(sets(8, true), (cores(7), vec![7]));
        assert_eq!(sets(16, true), (cores(14), vec![14, 15]));
        assert_eq!(sets(48, true), (cores(42), (42..48).collect()));
        // A CPU prefill: halves, decode the lower (and the odd core).
        assert_eq!(sets(2, false), (vec![0], vec![1]));
        assert_eq!(sets(3, false), (vec![0, 1], vec![2]));
        assert_eq!(sets(16, false), (cores(8), (8..16).collect()));
        // One core: shared.
        assert_eq!(sets(1, true), (vec![0], vec![0]));
        assert_eq!(sets(1, false), (vec![0], vec![0]));
        // The cores this process may run on need not start at 0 nor be contiguous.
        let s = default_core_sets(&[2, 4, 6, 8], false);
        assert_eq!((s.decode, s.prefill), (vec![2, 4], vec![6, 8]));
        for n in 2..70 {
            for accel in [false, true] {
                let (d, p) = sets(n, accel);
                assert_eq!(d.len() + p.len(), n, "n {n}");
                assert!(!d.is_empty() && !p.is_empty() && d.len() >= p.len(), "n {n} accel {accel}");
                assert!(d.last() < p.first(), "disjoint, decode lower: n {n}");
            }
        }
    }

    #[test]
    fn which_prefill_devices_count_as_accelerators() {
        let with = |device: &str| prefill_has_accelerator(&duplex_prefill::PrefillConfig { device: device.into(), ..Default::default() });
        assert!(with("cuda") && with("emulated"));
        assert!(!with("cpu") && !with("auto"));
        let devices = duplex_prefill::PrefillConfig { devices: vec!["emulated".into(), "emulated".into()], ..Default::default() };
        assert!(prefill_has_accelerator(&devices));
    }

    #[test]
    fn serve_splits_cores_only_when_neither_worker_sets_them() {
        let decode = duplex_decode::DecodeConfig::default();
        let prefill = duplex_prefill::PrefillConfig::default();
        let allowed = duplex_kernels::pool::allowed_cores();
        let sets = worker_cores(&decode, &prefill).unwrap().unwrap();
        assert_eq!(sets, default_core_sets(&allowed, false));
        let decode_set = duplex_decode::DecodeConfig { cores: "0".into(), ..Default::default() };
        assert_eq!(worker_cores(&decode_set, &prefill).unwrap(), None);
        let prefill_set = duplex_prefill::PrefillConfig { cores: "0".into(), ..Default::default() };
        assert_eq!(worker_cores(&decode, &prefill_set).unwrap(), None);
        // More threads than the default set holds: refused up front, saying what to do.
        let greedy = duplex_decode::DecodeConfig { threads: allowed.len() + 1, ..Default::default() };
        let err = worker_cores(&greedy, &prefill).unwrap_err().to_string();
        assert!(err.starts_with("[decode]: threads = ") && err.contains("set `cores`"), "{err}");
    }
}
