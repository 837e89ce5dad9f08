//! `duplex serve`: the supervisor. It puts the weights into shared memory
//! once, starts the decode worker, the prefill worker and the router as
//! separate processes (this same binary, with the `decode`, `prefill` and
//! `router` subcommands), waits until the router reports ready, prints the
//! endpoints, and restarts any process that dies. A restarted worker attaches
//! to the weight segment instead of reading the checkpoint again. On Ctrl-C
//! or SIGTERM it stops the children and removes the shared segments.

use anyhow::{bail, Context, Result};
use clap::Args;
use duplex_decode::config::DecodeArgs;
use duplex_ipc::{KvSegment, WeightStore};
use duplex_prefill::config::PrefillArgs;
use duplex_router::config::RouterArgs;
use std::path::PathBuf;
use std::process::ExitStatus;
use std::time::{Duration, Instant};
use tokio::process::{Child, Command};

#[derive(Args)]
pub struct ServeArgs {
    /// Checkpoint directory.
    #[arg(long, default_value = duplex_model::BUNDLED_MODEL)]
    model: PathBuf,
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
}

/// One supervised process: how to start it, and the running child.
struct Supervised {
    name: &'static str,
    args: Vec<String>,
    child: Child,
    restarts: u32,
}

impl Supervised {
    fn start(name: &'static str, args: Vec<String>) -> Result<Self> {
        let child = spawn(name, &args)?;
        Ok(Supervised { name, args, child, restarts: 0 })
    }

    async fn restart(&mut self, status: ExitStatus) -> Result<()> {
        self.restarts += 1;
        // Back off if it keeps dying, so a crash loop does not spin.
        let delay = Duration::from_millis(250 * u64::from(self.restarts.min(40)));
        eprintln!("duplex serve: the {} exited ({status}); restarting it in {:.1} s", self.name, delay.as_secs_f64());
        tokio::time::sleep(delay).await;
        self.child = spawn(self.name, &self.args)?;
        Ok(())
    }
}

fn spawn(name: &str, args: &[String]) -> Result<Child> {
    let exe = std::env::current_exe().context("cannot find the duplex executable")?;
    let child = Command::new(exe).args(args).kill_on_drop(true).spawn().with_context(|| format!("cannot start the {name}"))?;
    eprintln!("duplex serve: started the {name} (pid {})", child.id().unwrap_or(0));
    Ok(child)
}

fn flag(name: &str, value: impl ToString) -> [String; 2] {
    [format!("--{name}"), value.to_string()]
}

pub fn run(args: ServeArgs) -> Result<()> {
    let runtime = tokio::runtime::Runtime::new()?;
    runtime.block_on(supervise(args))
}

async fn supervise(a: ServeArgs) -> Result<()> {
    let shm_dir = a.shm_dir.clone().unwrap_or_else(duplex_ipc::default_shm_dir);
    // What each process will run with: its section of the config file under
    // the flags given here.
    let config = || a.config.clone();
    let decode = DecodeArgs { config: config(), ..DecodeArgs::default() }.resolve()?;
    let prefill = PrefillArgs { config: config(), ..PrefillArgs::default() }.resolve()?;
    let router = RouterArgs { config: config(), ..RouterArgs::default() }.resolve()?;
    let http_port = a.http_port.unwrap_or(router.http_port);
    let grpc_port = a.grpc_port.unwrap_or(router.grpc_port);

    let started = Instant::now();
    let weights = duplex_ipc::weight_segment_name(&a.instance);
    let (store, provenance) = tokio::task::block_in_place(|| WeightStore::open_or_build(&shm_dir, &weights, &a.model))?;
    eprintln!(
        "duplex serve: weight segment {} ({:.1} MiB) {provenance:?} in {:.2} s",
        store.path().display(),
        store.size_bytes() as f64 / (1 << 20) as f64,
        started.elapsed().as_secs_f64()
    );
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
        v
    };
    let mut decode_args = worker("decode");
    decode_args.extend(flag("port", decode.port));
    let mut prefill_args = worker("prefill");
    prefill_args.extend(flag("port", prefill.port));
    let mut router_args = common("router");
    router_args.extend(flag("http-port", http_port));
    router_args.extend(flag("grpc-port", grpc_port));
    router_args.extend(flag("decode-worker", format!("http://{}:{}", a.host, decode.port)));
    router_args.extend(flag("prefill-worker", format!("http://{}:{}", a.host, prefill.port)));

    let mut children = vec![
        Supervised::start("decode worker", decode_args)?,
        Supervised::start("prefill worker", prefill_args)?,
        Supervised::start("router", router_args)?,
    ];

    let result = tokio::select! {
        r = wait_ready(&a.host, http_port, Duration::from_secs(a.ready_timeout), &mut children) => r,
        _ = duplex_telemetry::process::shutdown_signal() => Err(anyhow::anyhow!("interrupted before the server was ready")),
    };
    if let Err(e) = result {
        shutdown(&mut children, &shm_dir, &a.instance).await;
        return Err(e);
    }
    println!("Duplex is ready: model {}", a.model.display());
    println!("  OpenAI HTTP  http://{}:{http_port}/v1  (health /health, metrics /metrics)", a.host);
    println!("  gRPC         {}:{grpc_port}  (duplex.v1.Generation, grpc.health.v1, reflection)", a.host);
    if decode.metrics_port != 0 || prefill.metrics_port != 0 {
        println!("  worker metrics  http://{}:{}/metrics (decode), http://{}:{}/metrics (prefill)", a.host, decode.metrics_port, a.host, prefill.metrics_port);
    }

    loop {
        tokio::select! {
            (i, status) = first_exit(&mut children) => {
                let status = status?;
                children[i].restart(status).await?;
            }
            _ = duplex_telemetry::process::shutdown_signal() => break,
        }
    }
    shutdown(&mut children, &shm_dir, &a.instance).await;
    Ok(())
}

/// The index and exit status of the first child to exit.
async fn first_exit(children: &mut [Supervised]) -> (usize, std::io::Result<ExitStatus>) {
    let waits = children.iter_mut().enumerate().map(|(i, c)| Box::pin(async move { (i, c.child.wait().await) }));
    futures::future::select_all(waits).await.0
}

/// Poll the router's `/health` until it answers 200 (both workers ready).
async fn wait_ready(host: &str, http_port: u16, timeout: Duration, children: &mut [Supervised]) -> Result<()> {
    let url = format!("http://{host}:{http_port}/health");
    let client = reqwest::Client::new();
    let deadline = Instant::now() + timeout;
    loop {
        for c in children.iter_mut() {
            if let Some(status) = c.child.try_wait()? {
                bail!("the {} exited ({status}) before the server was ready", c.name);
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
/// shared segments: a clean shutdown leaves nothing in /dev/shm.
async fn shutdown(children: &mut [Supervised], shm_dir: &std::path::Path, instance: &str) {
    eprintln!("duplex serve: shutting down");
    for c in children.iter() {
        if let Some(pid) = c.child.id() {
            let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid as i32), nix::sys::signal::Signal::SIGTERM);
        }
    }
    for c in children.iter_mut() {
        if tokio::time::timeout(Duration::from_secs(10), c.child.wait()).await.is_err() {
            let _ = c.child.kill().await;
        }
    }
    let _ = WeightStore::remove(shm_dir, &duplex_ipc::weight_segment_name(instance));
    let _ = KvSegment::remove(shm_dir, &duplex_ipc::kv_segment_name(instance));
}
