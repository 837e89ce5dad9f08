//! The router's settings: defaults, the `[router]` section of the TOML
//! config file, `DUPLEX_ROUTER_*` environment variables, then command-line
//! flags (`duplex_telemetry::config`).

use duplex_telemetry::config::Layers;
use serde::{Deserialize, Serialize};
use std::path::PathBuf;
use std::time::Duration;

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RouterConfig {
    /// Checkpoint directory; the router reads its tokenizer and configs only.
    pub model: PathBuf,
    /// The name clients use; defaults to the model directory's last component.
    pub served_model_name: Option<String>,
    pub host: String,
    /// OpenAI-compatible HTTP API, `/health` and `/metrics`.
    pub http_port: u16,
    /// Public gRPC API (`duplex.v1.Generation`, health, reflection).
    pub grpc_port: u16,
    pub decode_worker: String,
    pub prefill_worker: String,
    /// Prompts with at least this many tokens go to the prefill worker;
    /// shorter ones are chunk-prefilled by the decode worker (the paper's
    /// `chunked_prefill_max_tokens`).
    pub prefill_threshold_tokens: u32,
    /// A long prompt runs on every device of the prefill worker (two-device
    /// prefill) when it has several and no request has been decoding for
    /// this long; else on one device, so the decode worker keeps its
    /// latency. 0: whenever nothing decodes right now.
    pub dslp_idle_window_seconds: f64,
    /// Requests in flight at once; beyond this the router answers 429 /
    /// RESOURCE_EXHAUSTED instead of queueing without bound.
    pub max_pending_requests: usize,
    /// `max_tokens` of a request that does not set it.
    pub default_max_tokens: u32,
    /// Deadline of the short unary worker calls (FreeKv, Cancel, Stats) and
    /// of connecting to a worker.
    pub worker_timeout_seconds: f64,
    /// Deadline of one Prefill call: a long prompt on a CPU takes minutes.
    pub prefill_timeout_seconds: f64,
    /// Clients of the public APIs must present this key (`Authorization:
    /// Bearer <key>` on HTTP, `authorization` metadata on gRPC); unset: no
    /// key. `/health` and `/metrics` stay open. Also `DUPLEX_API_KEY`.
    pub api_key: Option<String>,
    /// Largest HTTP request body and gRPC request message; larger ones are
    /// refused (413 / RESOURCE_EXHAUSTED) without being read.
    pub max_request_body_bytes: usize,
    /// Open connections per public port; more wait to be accepted.
    pub max_connections: usize,
    /// How long a connection may send nothing: request headers over HTTP
    /// (also between keep-alive requests), its first bytes over gRPC.
    pub idle_timeout_seconds: f64,
    /// How long a long prompt may wait in the decode worker's queue for its
    /// KV blocks (AllocateKv); then 429 / RESOURCE_EXHAUSTED.
    pub kv_wait_timeout_seconds: f64,
    /// Health reports NOT_SERVING when the decode worker has work but has
    /// made no progress (no step, no blocks granted) for this long.
    pub stall_timeout_seconds: f64,
    /// Browser origins (`https://app.example.com`) allowed to call `/v1/*`
    /// across origins (CORS); `["*"]`: any. Empty: no CORS headers, so
    /// browsers allow same-origin calls only.
    pub cors_allowed_origins: Vec<String>,
}

impl Default for RouterConfig {
    fn default() -> Self {
        RouterConfig {
            model: duplex_text::bundled_model(),
            served_model_name: None,
            host: "127.0.0.1".into(),
            http_port: 8000,
            grpc_port: 50051,
            decode_worker: "http://127.0.0.1:50061".into(),
            prefill_worker: "http://127.0.0.1:50071".into(),
            prefill_threshold_tokens: 2048,
            dslp_idle_window_seconds: 300.0,
            max_pending_requests: 64,
            default_max_tokens: 256,
            worker_timeout_seconds: 10.0,
            prefill_timeout_seconds: 600.0,
            api_key: None,
            max_request_body_bytes: 8 << 20,
            max_connections: 512,
            idle_timeout_seconds: 30.0,
            kv_wait_timeout_seconds: 600.0,
            stall_timeout_seconds: 60.0,
            cors_allowed_origins: Vec::new(),
        }
    }
}

/// A setting out of range: which, and why.
#[derive(Debug, thiserror::Error)]
#[error("invalid router setting `{key}`: {message}")]
pub struct ConfigError {
    pub key: &'static str,
    pub message: String,
}

impl ConfigError {
    fn new(key: &'static str, message: impl Into<String>) -> Self {
        ConfigError { key, message: message.into() }
    }
}

/// Command-line flags: each overrides the environment, which overrides the
/// config file, which overrides the defaults. Serialized, the flags given
/// are the top layer of the settings.
#[derive(Clone, Debug, Default, clap::Args, Serialize)]
pub struct RouterArgs {
    /// TOML config file; its `[router]` section applies here. Environment variables DUPLEX_ROUTER_<KEY> (DUPLEX_ROUTER_HTTP_PORT) override it, flags override both.
    #[arg(long)]
    #[serde(skip)]
    pub config: Option<PathBuf>,
    /// The model: a Hugging Face directory or a GGUF model (file, or a directory holding one) [default: the bundled tiny model].
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Model name clients use [default: the model directory's name].
    #[arg(long)]
    pub served_model_name: Option<String>,
    /// Address to listen on [default: 127.0.0.1].
    #[arg(long)]
    pub host: Option<String>,
    /// OpenAI-compatible HTTP port [default: 8000].
    #[arg(long)]
    pub http_port: Option<u16>,
    /// Public gRPC port [default: 50051].
    #[arg(long)]
    pub grpc_port: Option<u16>,
    /// Decode worker address [default: http://127.0.0.1:50061].
    #[arg(long)]
    pub decode_worker: Option<String>,
    /// Prefill worker address [default: http://127.0.0.1:50071].
    #[arg(long)]
    pub prefill_worker: Option<String>,
    /// Prompts of at least this many tokens go to the prefill worker [default: 2048].
    #[arg(long)]
    pub prefill_threshold_tokens: Option<u32>,
    /// Seconds without decoding after which a long prompt runs on every prefill device [default: 300].
    #[arg(long)]
    pub dslp_idle_window_seconds: Option<f64>,
    /// Requests in flight at once; more are refused with 429 [default: 64].
    #[arg(long)]
    pub max_pending_requests: Option<usize>,
    /// max_tokens of requests that do not set it [default: 256].
    #[arg(long)]
    pub default_max_tokens: Option<u32>,
    /// Deadline of short worker calls and of connecting, in seconds [default: 10].
    #[arg(long)]
    pub worker_timeout_seconds: Option<f64>,
    /// Deadline of one prefill, in seconds [default: 600].
    #[arg(long)]
    pub prefill_timeout_seconds: Option<f64>,
    /// Key clients must send (Authorization: Bearer <key>; gRPC `authorization` metadata)
    /// [default: $DUPLEX_ROUTER_API_KEY or $DUPLEX_API_KEY, else none].
    #[arg(long)]
    pub api_key: Option<String>,
    /// Largest request body / gRPC message, in bytes [default: 8388608].
    #[arg(long)]
    pub max_request_body_bytes: Option<usize>,
    /// Open connections per public port [default: 512].
    #[arg(long)]
    pub max_connections: Option<usize>,
    /// Seconds a connection may send nothing before it is closed [default: 30].
    #[arg(long)]
    pub idle_timeout_seconds: Option<f64>,
    /// Longest wait for a long prompt's KV blocks, in seconds [default: 600].
    #[arg(long)]
    pub kv_wait_timeout_seconds: Option<f64>,
    /// NOT_SERVING after this many seconds of work without progress [default: 60].
    #[arg(long)]
    pub stall_timeout_seconds: Option<f64>,
    /// Browser origins allowed to call /v1/* (CORS), comma-separated; * for any [default: none].
    #[arg(long, value_delimiter = ',')]
    pub cors_allowed_origins: Option<Vec<String>>,
}

impl RouterArgs {
    /// The settings from every source (see `duplex_telemetry::config`),
    /// checked; `DUPLEX_API_KEY` is an older name of `DUPLEX_ROUTER_API_KEY`.
    pub fn resolve(self) -> anyhow::Result<RouterConfig> {
        let layers = Layers::new::<RouterConfig>("router").file(self.config.as_deref())?.env(API_KEY_ALIAS)?;
        self.resolve_with(layers)
    }

    /// `resolve` with the file and environment layers given.
    fn resolve_with(self, layers: Layers) -> anyhow::Result<RouterConfig> {
        let layers = layers.flags(&self);
        let config: RouterConfig = layers.extract()?;
        config.validate().map_err(|e| layers.invalid(e.key, e.message))?;
        Ok(config)
    }
}

/// The API key's variable from before there was one per key.
const API_KEY_ALIAS: &[(&str, &str)] = &[("DUPLEX_API_KEY", "api_key")];

impl RouterConfig {
    /// The model name clients must use (or may leave out).
    pub fn served_model_name(&self) -> String {
        self.served_model_name.clone().unwrap_or_else(|| {
            // A GGUF file is named for its model: `DeepSeek-R1-Q4_K_M.gguf`
            // serves as `DeepSeek-R1-Q4_K_M`.
            let name = self.model.file_name().map(|n| n.to_string_lossy().into_owned());
            let name = name.map(|n| n.strip_suffix(".gguf").map(str::to_string).unwrap_or(n));
            name.unwrap_or_else(|| self.model.display().to_string())
        })
    }

    /// Rejects values that would make the router misbehave rather than fail.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let positive = |key: &'static str, v: f64| {
            if v.is_finite() && v > 0.0 {
                Ok(())
            } else {
                Err(ConfigError::new(key, format!("must be a positive number of seconds, got {v}")))
            }
        };
        positive("worker_timeout_seconds", self.worker_timeout_seconds)?;
        positive("prefill_timeout_seconds", self.prefill_timeout_seconds)?;
        positive("kv_wait_timeout_seconds", self.kv_wait_timeout_seconds)?;
        positive("stall_timeout_seconds", self.stall_timeout_seconds)?;
        positive("idle_timeout_seconds", self.idle_timeout_seconds)?;
        if !(self.dslp_idle_window_seconds.is_finite() && self.dslp_idle_window_seconds >= 0.0) {
            return Err(ConfigError::new("dslp_idle_window_seconds", format!("must be a non-negative number of seconds, got {}", self.dslp_idle_window_seconds)));
        }
        if self.api_key.as_deref().is_some_and(|k| k.trim().is_empty()) {
            return Err(ConfigError::new("api_key", "must not be empty (leave it unset for no key)"));
        }
        if self.max_request_body_bytes < 1024 {
            return Err(ConfigError::new("max_request_body_bytes", format!("must be at least 1024, got {}", self.max_request_body_bytes)));
        }
        if self.max_connections == 0 {
            return Err(ConfigError::new("max_connections", "must be at least 1"));
        }
        if self.max_pending_requests == 0 {
            return Err(ConfigError::new("max_pending_requests", "must be at least 1"));
        }
        if self.default_max_tokens == 0 {
            return Err(ConfigError::new("default_max_tokens", "must be at least 1"));
        }
        check_origins(&self.cors_allowed_origins).map_err(|m| ConfigError::new("cors_allowed_origins", m))?;
        Ok(())
    }

    pub fn worker_timeout(&self) -> Duration {
        Duration::from_secs_f64(self.worker_timeout_seconds)
    }

    pub fn prefill_timeout(&self) -> Duration {
        Duration::from_secs_f64(self.prefill_timeout_seconds)
    }

    pub fn idle_timeout(&self) -> Duration {
        Duration::from_secs_f64(self.idle_timeout_seconds)
    }

    pub fn kv_wait_timeout(&self) -> Duration {
        Duration::from_secs_f64(self.kv_wait_timeout_seconds)
    }

    pub fn stall_timeout(&self) -> Duration {
        Duration::from_secs_f64(self.stall_timeout_seconds)
    }

    pub fn dslp_idle_window(&self) -> Duration {
        Duration::from_secs_f64(self.dslp_idle_window_seconds)
    }
}

/// CORS origins are compared with the browser's `Origin` header byte for
/// byte, so each must be written as browsers send it: `scheme://host[:port]`,
/// no path, no trailing slash. `*` (any origin) stands alone.
fn check_origins(origins: &[String]) -> Result<(), String> {
    if origins.iter().any(|o| o == "*") {
        return match origins.len() {
            1 => Ok(()),
            _ => Err("\"*\" allows every origin and must be the only entry".into()),
        };
    }
    for origin in origins {
        let Some((scheme, host)) = origin.split_once("://") else {
            return Err(format!("{origin:?} is not an origin: expected scheme://host[:port], e.g. https://app.example.com"));
        };
        if scheme.is_empty() || host.is_empty() || host.contains('/') || !origin.is_ascii() || origin.chars().any(|c| c.is_ascii_whitespace() || c.is_ascii_control()) {
            return Err(format!("{origin:?} is not an origin: expected scheme://host[:port] with no path or trailing slash, e.g. https://app.example.com"));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults() {
        let c = RouterConfig::default();
        assert_eq!(c.served_model_name(), "tiny-dsv3");
        assert!(c.model.join("tokenizer.json").exists(), "{}", c.model.display());
        let gguf = RouterConfig { model: "/models/DeepSeek-R1-Q4_K_M.gguf".into(), ..RouterConfig::default() };
        assert_eq!(gguf.served_model_name(), "DeepSeek-R1-Q4_K_M");
        assert_eq!((c.http_port, c.grpc_port, c.prefill_threshold_tokens), (8000, 50051, 2048));
        c.validate().unwrap();
    }

    #[test]
    fn readme_documents_every_key() {
        let readme = include_str!("../../../README.md");
        let config = RouterConfig { served_model_name: Some("x".into()), ..Default::default() };
        let value = serde_json::to_value(config).unwrap();
        for key in value.as_object().unwrap().keys() {
            assert!(readme.contains(&format!("| `{key}` |")), "README.md has no row for `{key}`");
        }
    }

    /// `RouterArgs` parsed from a command line, with `toml` as the config
    /// file and `vars` as the environment (not the test runner's).
    fn resolve_env(toml: &str, vars: &[(&str, &str)], flags: &[&str]) -> Result<RouterConfig, String> {
        use clap::Parser;
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            args: RouterArgs,
        }
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("duplex.toml");
        std::fs::write(&path, toml).unwrap();
        let argv = ["duplex-router", "--config", path.to_str().unwrap()].into_iter().chain(flags.iter().copied());
        let args = Cli::parse_from(argv).args;
        let vars = vars.iter().map(|(k, v)| (k.to_string(), v.to_string()));
        let layers = Layers::new::<RouterConfig>("router").file(Some(&path)).map_err(|e| e.to_string())?.env_from(vars, API_KEY_ALIAS);
        args.resolve_with(layers).map_err(|e| format!("{e:#}"))
    }

    fn resolve(toml: &str, flags: &[&str]) -> Result<RouterConfig, String> {
        resolve_env(toml, &[], flags)
    }

    #[test]
    fn reads_router_section_and_flags_win() {
        let file = "[router]\nhttp_port = 9000\ngrpc_port = 9001\nserved_model_name = \"dsv3\"\n[decode]\nanything = 1\n[prefill]\nx = \"y\"\n";
        let c = resolve(file, &[]).unwrap();
        assert_eq!((c.http_port, c.grpc_port, c.served_model_name()), (9000, 9001, "dsv3".into()));
        assert_eq!(c.decode_worker, RouterConfig::default().decode_worker);
        let c = resolve(file, &["--http-port", "9100", "--served-model-name", "m"]).unwrap();
        assert_eq!((c.http_port, c.grpc_port, c.served_model_name()), (9100, 9001, "m".into()));
        assert_eq!(resolve("", &[]).unwrap(), RouterConfig::default());
        assert!(resolve("", &["--worker-timeout-seconds", "0"]).unwrap_err().contains("worker_timeout_seconds"));
        assert!(resolve("", &["--stall-timeout-seconds", "0"]).unwrap_err().contains("stall_timeout_seconds"));
        let c = resolve("[router]\nstall_timeout_seconds = 2.5\n", &["--kv-wait-timeout-seconds", "30"]).unwrap();
        assert_eq!((c.stall_timeout(), c.kv_wait_timeout()), (Duration::from_millis(2500), Duration::from_secs(30)));
        assert_eq!(resolve("", &[]).unwrap().dslp_idle_window(), Duration::from_secs(300));
        assert_eq!(resolve("[router]\ndslp_idle_window_seconds = 1\n", &[]).unwrap().dslp_idle_window(), Duration::from_secs(1));
        assert_eq!(resolve_env("", &[("DUPLEX_ROUTER_DSLP_IDLE_WINDOW_SECONDS", "0")], &[]).unwrap().dslp_idle_window(), Duration::ZERO);
        assert_eq!(resolve("", &["--dslp-idle-window-seconds", "0.5"]).unwrap().dslp_idle_window(), Duration::from_millis(500));
        let err = resolve("", &["--dslp-idle-window-seconds=-1"]).unwrap_err();
        assert!(err.contains("`dslp_idle_window_seconds`") && err.contains("flag --dslp-idle-window-seconds") && err.contains("non-negative"), "{err}");
    }

    #[test]
    fn environment_overrides_the_file_and_flags_the_environment() {
        let file = "[router]\nhttp_port = 9000\nworker_timeout_seconds = 5\n";
        let env = [("DUPLEX_ROUTER_HTTP_PORT", "9200"), ("DUPLEX_ROUTER_WORKER_TIMEOUT_SECONDS", "2.5"), ("DUPLEX_DECODE_PORT", "1")];
        let c = resolve_env(file, &env, &[]).unwrap();
        assert_eq!((c.http_port, c.worker_timeout()), (9200, Duration::from_millis(2500)));
        let c = resolve_env(file, &env, &["--http-port", "9300"]).unwrap();
        assert_eq!((c.http_port, c.worker_timeout()), (9300, Duration::from_millis(2500)));
        let c = resolve_env("", &[("DUPLEX_ROUTER_SERVED_MODEL_NAME", "42")], &[]).unwrap();
        assert_eq!(c.served_model_name(), "42");
        // Out of range, the error says where the value came from.
        let err = resolve_env(file, &[("DUPLEX_ROUTER_MAX_CONNECTIONS", "0")], &[]).unwrap_err();
        assert!(err.contains("`max_connections`") && err.contains("environment variable DUPLEX_ROUTER_MAX_CONNECTIONS"), "{err}");
        let err = resolve_env("[router]\nmax_connections = 0\n", &[], &[]).unwrap_err();
        assert!(err.contains("`max_connections`") && err.contains("duplex.toml"), "{err}");
        let err = resolve_env("", &[("DUPLEX_ROUTER_HTTP_PORT", "eighty")], &[]).unwrap_err();
        assert!(err.contains("`router.http_port` from environment variable DUPLEX_ROUTER_HTTP_PORT") && err.contains("invalid type"), "{err}");
        let err = resolve_env("", &[("DUPLEX_ROUTER_HTTP_PROT", "1")], &[]).unwrap_err();
        assert!(err.contains("DUPLEX_ROUTER_HTTP_PROT") && err.contains("unknown field"), "{err}");
    }

    #[test]
    fn api_key_from_flag_then_environment_then_file() {
        assert_eq!(resolve_env("", &[], &[]).unwrap().api_key, None);
        assert_eq!(resolve_env("", &[("DUPLEX_API_KEY", "env")], &[]).unwrap().api_key.as_deref(), Some("env"));
        assert_eq!(resolve_env("", &[("DUPLEX_API_KEY", "env")], &["--api-key", "flag"]).unwrap().api_key.as_deref(), Some("flag"));
        let both = [("DUPLEX_API_KEY", "old"), ("DUPLEX_ROUTER_API_KEY", "new")];
        assert_eq!(resolve_env("", &both, &[]).unwrap().api_key.as_deref(), Some("new"));
        assert_eq!(resolve_env("[router]\napi_key = \"file\"\n", &[("DUPLEX_API_KEY", "env")], &[]).unwrap().api_key.as_deref(), Some("env"));
        let err = resolve_env("", &[], &["--api-key", " "]).unwrap_err();
        assert!(err.contains("`api_key`") && err.contains("flag --api-key"), "{err}");
        let c = resolve("[router]\napi_key = \"file\"\nmax_connections = 3\n", &["--idle-timeout-seconds", "2"]).unwrap();
        assert_eq!((c.max_connections, c.idle_timeout()), (3, Duration::from_secs(2)));
        assert_eq!(c.api_key.as_deref(), Some("file"));
        assert!(resolve("", &["--max-connections", "0"]).unwrap_err().contains("max_connections"));
    }

    #[test]
    fn cors_origins_from_every_source_and_checked() {
        assert_eq!(resolve("", &[]).unwrap().cors_allowed_origins, Vec::<String>::new());
        let c = resolve("[router]\ncors_allowed_origins = [\"https://a.example\", \"http://localhost:3000\"]\n", &[]).unwrap();
        assert_eq!(c.cors_allowed_origins, ["https://a.example", "http://localhost:3000"]);
        let c = resolve_env("", &[("DUPLEX_ROUTER_CORS_ALLOWED_ORIGINS", "https://a.example,https://b.example")], &[]).unwrap();
        assert_eq!(c.cors_allowed_origins, ["https://a.example", "https://b.example"]);
        let c = resolve("", &["--cors-allowed-origins", "https://c.example,https://d.example"]).unwrap();
        assert_eq!(c.cors_allowed_origins, ["https://c.example", "https://d.example"]);
        assert_eq!(resolve("", &["--cors-allowed-origins", "*"]).unwrap().cors_allowed_origins, ["*"]);
        for bad in ["https://a.example/", "a.example", "https://a.example/app", "*,https://a.example", "https://a example"] {
            let err = resolve("", &["--cors-allowed-origins", bad]).unwrap_err();
            assert!(err.contains("`cors_allowed_origins`") && err.contains("flag --cors-allowed-origins"), "{bad}: {err}");
        }
    }

    #[test]
    fn unknown_keys_are_named() {
        let err = resolve("[router]\nhttp_prot = 1\n", &[]).unwrap_err();
        assert!(err.contains("http_prot") && err.contains("duplex.toml"), "{err}");
        let err = resolve("[routr]\n", &[]).unwrap_err();
        assert!(err.contains("routr"), "{err}");
        let err = resolve("[router]\nhttp_port = \"x\"\n", &[]).unwrap_err();
        assert!(err.contains("http_port"), "{err}");
    }

    #[test]
    fn every_key_has_a_flag() {
        let config = RouterConfig { served_model_name: Some("x".into()), ..Default::default() };
        let value = serde_json::to_value(config).unwrap();
        let flags: Vec<String> = <RouterArgs as clap::Args>::augment_args(clap::Command::new("x")).get_arguments().filter_map(|a| a.get_long().map(String::from)).collect();
        for key in value.as_object().unwrap().keys() {
            assert!(flags.contains(&key.replace('_', "-")), "no flag for {key}");
        }
    }
}
