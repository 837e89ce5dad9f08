//! The router's settings: defaults, the `[router]` section of the TOML
//! config file, then command-line flags.

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
    /// shorter ones are chunk-prefilled by the decode worker.
    pub prefill_threshold_tokens: u32,
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
        }
    }
}

/// A setting out of range.
#[derive(Debug, thiserror::Error)]
#[error("invalid router setting: {0}")]
pub struct ConfigError(String);

/// Command-line flags: each overrides the config file, which overrides the
/// defaults.
#[derive(Clone, Debug, Default, clap::Args)]
pub struct RouterArgs {
    /// TOML config file; its `[router]` section applies here.
    #[arg(long)]
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
    /// [default: $DUPLEX_API_KEY, else none].
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
}

impl RouterArgs {
    pub fn resolve(self) -> anyhow::Result<RouterConfig> {
        self.resolve_with(std::env::var("DUPLEX_API_KEY").ok())
    }

    /// `resolve`, with the value of `DUPLEX_API_KEY` given.
    fn resolve_with(self, env_api_key: Option<String>) -> anyhow::Result<RouterConfig> {
        let mut c: RouterConfig = match &self.config {
            Some(path) => duplex_telemetry::process::load_section(path, "router")?,
            None => RouterConfig::default(),
        };
        macro_rules! take {
            ($($field:ident),*) => { $(if let Some(v) = self.$field { c.$field = v; })* };
        }
        take!(model, host, http_port, grpc_port, decode_worker, prefill_worker, prefill_threshold_tokens, max_pending_requests, default_max_tokens, worker_timeout_seconds, prefill_timeout_seconds, kv_wait_timeout_seconds, stall_timeout_seconds);
        if self.served_model_name.is_some() {
            c.served_model_name = self.served_model_name;
        }
        take!(max_request_body_bytes, max_connections, idle_timeout_seconds);
        // The flag, else the environment (which keeps the key out of `ps`),
        // else the config file.
        if let Some(key) = self.api_key.or(env_api_key) {
            c.api_key = Some(key);
        }
        c.validate()?;
        Ok(c)
    }
}

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
        let positive = |name: &str, v: f64| {
            if v.is_finite() && v > 0.0 {
                Ok(())
            } else {
                Err(ConfigError(format!("{name} must be a positive number of seconds, got {v}")))
            }
        };
        positive("worker_timeout_seconds", self.worker_timeout_seconds)?;
        positive("prefill_timeout_seconds", self.prefill_timeout_seconds)?;
        positive("kv_wait_timeout_seconds", self.kv_wait_timeout_seconds)?;
        positive("stall_timeout_seconds", self.stall_timeout_seconds)?;
        positive("idle_timeout_seconds", self.idle_timeout_seconds)?;
        if self.api_key.as_deref().is_some_and(|k| k.trim().is_empty()) {
            return Err(ConfigError("api_key must not be empty (leave it unset for no key)".into()));
        }
        if self.max_request_body_bytes < 1024 {
            return Err(ConfigError(format!("max_request_body_bytes must be at least 1024, got {}", self.max_request_body_bytes)));
        }
        if self.max_connections == 0 {
            return Err(ConfigError("max_connections must be at least 1".into()));
        }
        if self.max_pending_requests == 0 {
            return Err(ConfigError("max_pending_requests must be at least 1".into()));
        }
        if self.default_max_tokens == 0 {
            return Err(ConfigError("default_max_tokens must be at least 1".into()));
        }
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

    /// `RouterArgs` parsed from a command line, with `toml` as the config file.
    fn resolve(toml: &str, flags: &[&str]) -> Result<RouterConfig, String> {
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
        // Independent of the test runner's environment.
        Cli::parse_from(argv).args.resolve_with(None).map_err(|e| format!("{e:#}"))
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
    }

    #[test]
    fn api_key_from_flag_then_environment_then_file() {
        use clap::Parser;
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            args: RouterArgs,
        }
        let parse = |flags: &[&str]| Cli::parse_from(["duplex-router"].into_iter().chain(flags.iter().copied())).args;
        assert_eq!(parse(&[]).resolve_with(None).unwrap().api_key, None);
        assert_eq!(parse(&[]).resolve_with(Some("env".into())).unwrap().api_key.as_deref(), Some("env"));
        assert_eq!(parse(&["--api-key", "flag"]).resolve_with(Some("env".into())).unwrap().api_key.as_deref(), Some("flag"));
        assert!(parse(&["--api-key", " "]).resolve_with(None).is_err());
        let c = resolve("[router]\napi_key = \"file\"\nmax_connections = 3\n", &["--idle-timeout-seconds", "2"]).unwrap();
        assert_eq!((c.max_connections, c.idle_timeout()), (3, Duration::from_secs(2)));
        assert_eq!(c.api_key.as_deref(), Some("file"));
        assert!(resolve("", &["--max-connections", "0"]).unwrap_err().contains("max_connections"));
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
