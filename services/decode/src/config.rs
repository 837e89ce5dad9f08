//! The decode worker's settings: defaults, the `[decode]` section of the
//! TOML config file, `DUPLEX_DECODE_*` environment variables, then
//! command-line flags (`duplex_telemetry::config`).

use duplex_telemetry::config::Layers;
use serde::{Deserialize, Serialize};
use duplex_model::device_experts::ExpertCacheConfig;
use duplex_model::hybrid::Submit;
use std::path::PathBuf;

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DecodeConfig {
    /// The model: a Hugging Face directory (config.json, safetensors, tokenizer) or a GGUF model (file, or a directory holding one).
    pub model: PathBuf,
    /// Overrides of a GGUF model's metadata, each `KEY=TYPE:VALUE` (TYPE
    /// `int`, `float`, `bool` or `str`) as llama.cpp's `--override-kv`, for
    /// example `deepseek2.rope.scaling.yarn_beta_fast=float:32`. The prefill
    /// worker must be given the same ones (they share the weight segment).
    pub override_kv: Vec<String>,
    pub host: String,
    /// Internal gRPC port the router calls.
    pub port: u16,
    /// Take the internal gRPC calls on this Unix socket instead of
    /// `host:port` (what `duplex serve` does: only processes that may open
    /// the socket's directory can connect).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub unix_socket: Option<PathBuf>,
    /// Port of this process's Prometheus `/metrics`; 0 turns it off.
    pub metrics_port: u16,
    /// tmpfs directory holding the shared weight and KV segments.
    pub shm_dir: PathBuf,
    /// Prefix of the segment names, so several servers can share a machine.
    pub instance: String,
    /// Longest prompt plus output; 0 means the model's maximum.
    pub context_length: usize,
    /// KV pool size in blocks of 16 tokens; 0 sizes it for `max_batch_size`
    /// sequences at full context.
    pub kv_blocks: usize,
    /// Sequences decoded together in one step (continuous batching).
    pub max_batch_size: usize,
    /// Prompt tokens prefilled per step, shared by the sequences still in
    /// prefill; decoding sequences always take part in every step.
    pub prefill_chunk_tokens: usize,
    /// A KV lease (blocks lent to the prefill worker) that is neither
    /// admitted nor freed within this many seconds is freed; longer than the
    /// router's prefill deadline.
    pub lease_timeout_seconds: u64,
    /// Requests that may wait for KV blocks at once (first come first
    /// served); beyond it the worker answers RESOURCE_EXHAUSTED.
    pub max_waiting_requests: usize,
    /// Automatic prefix caching: full KV blocks stay cached after their
    /// request ends, and a prompt that starts with cached blocks shares
    /// them and prefills only the rest (on either prefill path). Idle cached
    /// blocks are evicted, least recently used first, when free ones run out.
    pub prefix_caching: bool,
    /// Numeric path: `bf16` (the fast one) or `f32` (the scalar reference,
    /// whose results do not depend on how requests are batched).
    pub dtype: String,
    /// Compute threads; 0 means every core.
    pub threads: usize,
    /// NUMA nodes the thread pool is split into.
    pub numa_nodes: usize,
    /// The cores this worker runs on, as a CPU list (`0-11,24-35`); its
    /// pool's threads are pinned to them in order, NUMA nodes taking
    /// consecutive slices. Empty: not set (started alone, the pool pins to
    /// the first cores the process may use; under `duplex serve`, which
    /// gives the two workers disjoint sets when neither sets one).
    pub cores: String,
    /// Where decode runs: `cpu` (everything on the CPU), or the hybrid
    /// placement on `cuda` or `emulated` (a CPU-backed stand-in, for tests
    /// and demos): attention, norms, router, shared experts, dense layers,
    /// embedding and LM head on the device with their weights resident
    /// there, routed experts on the CPU.
    pub device: String,
    /// Device memory to use, in MiB; 0: 90% of what is free (cuda) or 4096 (emulated).
    pub device_memory_mib: usize,
    /// Which CUDA device.
    pub cuda_device: usize,
    /// Compute threads of the emulated device (its own, besides `threads`).
    pub device_threads: usize,
    /// Device KV pool size in 16-token blocks; 0: as many as fit beside the
    /// resident weights. A sequence waits for its blocks when the pool is full.
    pub device_kv_blocks: usize,
    /// Split batches of two or more sequences into two micro-batches whose
    /// device attention and CPU experts overlap.
    pub micro_batches: bool,
    /// Expert Deferral when one sequence decodes alone on a device: this
    /// many of each token's routed experts (the lowest-weighted) run while
    /// the next layer's attention does, and join the next MoE layer's
    /// output. It changes the model's function slightly; 0: off.
    pub defer_experts: usize,
    /// How a device step starts and awaits the CPU's routed experts:
    /// `graph` (as `stream`, the step captured as one device graph and
    /// launched at once), `stream` (from the device streams through host
    /// functions, a step queued whole) or `host` (this worker's thread,
    /// layer by layer).
    pub expert_submit: String,
    /// With a device: routed experts the device's expert cache holds, over
    /// all MoE layers (0: no cache, unless `expert_cache_bytes` sizes it).
    /// With a cache, steps are host-driven (`expert_submit` is not used).
    pub expert_cache_experts: usize,
    /// The cache's size in bytes instead (as many whole experts as fit);
    /// `expert_cache_experts` wins when both are set.
    pub expert_cache_bytes: usize,
    /// Where each activated expert of a layer runs: `static` (the CPU),
    /// `hybrimoe` or `dali`.
    pub expert_assignment: String,
    /// What to copy ahead: `none`, `impact` (HybriMoE) or `residual` (DALI).
    pub expert_prefetch: String,
    /// Which experts the cache keeps: `mrs`, `workload`, `lru` or `lfu`.
    pub expert_cache_policy: String,
    /// Device memory, in MiB, this worker lends the prefill worker's
    /// two-device prefill while it has nothing to decode (the device lease).
    /// 0: with a device, what it has free when asked; without one (its
    /// steps on the CPU, the device managed elsewhere), any amount.
    /// Otherwise at most this much (and at most what is free).
    pub lendable_device_mib: usize,
    /// How long a decode request arriving during a device lease waits for
    /// the prefill worker to give the device back after it is revoked;
    /// past it, a warning and the request goes on.
    pub device_lease_revoke_timeout_seconds: f64,
}

/// Where the decode worker runs its steps.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceKind {
    Cpu,
    Emulated,
    Cuda,
}

impl DecodeConfig {
    /// `cores` parsed; empty when not set.
    pub fn core_list(&self) -> anyhow::Result<Vec<usize>> {
        duplex_kernels::pool::parse_cpu_list(&self.cores).map_err(|e| anyhow::anyhow!("cores: {e}"))
    }

    /// The compute pool: `threads`, `numa_nodes` and `cores` checked together.
    pub fn pool(&self) -> anyhow::Result<duplex_kernels::pool::PoolConfig> {
        duplex_kernels::pool::PoolConfig::on_cores(self.threads, self.numa_nodes, &self.core_list()?).map_err(|e| anyhow::anyhow!("threads/numa_nodes/cores: {e}"))
    }

    pub fn precision(&self) -> anyhow::Result<duplex_model::Precision> {
        self.dtype.parse().map_err(|e: String| anyhow::anyhow!("dtype: {e}"))
    }

    /// The model, with its metadata overrides.
    pub fn model_source(&self) -> anyhow::Result<duplex_model::source::ModelSource> {
        Ok(duplex_model::source::ModelSource::locate_with(&self.model, &self.override_kv)?)
    }

    pub fn device_kind(&self) -> anyhow::Result<DeviceKind> {
        match self.device.as_str() {
            "cpu" => Ok(DeviceKind::Cpu),
            "emulated" => Ok(DeviceKind::Emulated),
            "cuda" => Ok(DeviceKind::Cuda),
            other => anyhow::bail!("device: unknown device {other:?}; expected cpu, emulated or cuda"),
        }
    }

    /// The expert cache's settings, with its size in experts resolved
    /// against the model (`None`: no cache).
    pub fn expert_cache(&self, model: &duplex_model::Model) -> anyhow::Result<Option<ExpertCacheConfig>> {
        let assignment = self.expert_assignment.parse().map_err(|e| anyhow::anyhow!("expert_assignment: {e}"))?;
        let prefetch = self.expert_prefetch.parse().map_err(|e| anyhow::anyhow!("expert_prefetch: {e}"))?;
        let policy = self.expert_cache_policy.parse().map_err(|e| anyhow::anyhow!("expert_cache_policy: {e}"))?;
        let experts = match (self.expert_cache_experts, self.expert_cache_bytes) {
            (0, 0) => return Ok(None),
            (0, bytes) => {
                let per = duplex_model::device_experts::expert_slot_bytes(model).ok_or_else(|| anyhow::anyhow!("expert_cache_bytes: the model has no routed experts to cache"))?;
                if bytes < per {
                    anyhow::bail!("expert_cache_bytes: {bytes} bytes hold no expert of this model ({per} bytes each)");
                }
                bytes / per
            }
            (n, _) => n,
        };
        Ok(Some(ExpertCacheConfig { experts, assignment, prefetch, policy }))
    }

    /// The hybrid placement's settings (with a device).
    pub fn hybrid(&self, model: &duplex_model::Model) -> anyhow::Result<duplex_model::hybrid::HybridConfig> {
        Ok(duplex_model::hybrid::HybridConfig {
            kv_blocks: self.device_kv_blocks,
            micro_batches: self.micro_batches,
            defer_experts: self.defer_experts,
            cpu_jitter: None,
            submit: self.submit()?,
            expert_cache: self.expert_cache(model)?,
        })
    }

    pub fn submit(&self) -> anyhow::Result<Submit> {
        match self.expert_submit.as_str() {
            "graph" => Ok(Submit::Graph),
            "stream" => Ok(Submit::Stream),
            "host" => Ok(Submit::Host),
            other => anyhow::bail!("expert_submit: unknown mode {other:?}; expected graph, stream or host"),
        }
    }
}

impl Default for DecodeConfig {
    fn default() -> Self {
        DecodeConfig {
            model: duplex_model::bundled_model(),
            override_kv: vec![],
            host: "127.0.0.1".into(),
            port: 50061,
            unix_socket: None,
            metrics_port: 9161,
            shm_dir: duplex_ipc::default_shm_dir(),
            instance: "duplex".into(),
            context_length: 0,
            kv_blocks: 0,
            max_batch_size: 6,
            prefill_chunk_tokens: 256,
            lease_timeout_seconds: 900,
            max_waiting_requests: 256,
            prefix_caching: true,
            dtype: "bf16".into(),
            threads: 0,
            numa_nodes: 1,
            cores: String::new(),
            device: "cpu".into(),
            device_memory_mib: 0,
            cuda_device: 0,
            device_threads: 1,
            device_kv_blocks: 0,
            micro_batches: true,
            defer_experts: 0,
            expert_submit: "graph".into(),
            expert_cache_experts: 0,
            expert_cache_bytes: 0,
            expert_assignment: "hybrimoe".into(),
            expert_prefetch: "none".into(),
            expert_cache_policy: "mrs".into(),
            lendable_device_mib: 0,
            device_lease_revoke_timeout_seconds: 5.0,
        }
    }
}

/// Command-line flags: each overrides the environment, which overrides the
/// config file, which overrides the defaults. Serialized, the flags given
/// are the top layer of the settings.
#[derive(Clone, Debug, Default, clap::Args, Serialize)]
pub struct DecodeArgs {
    /// TOML config file; its `[decode]` section applies here. Environment variables DUPLEX_DECODE_<KEY> (DUPLEX_DECODE_THREADS) override it, flags override both.
    #[arg(long)]
    #[serde(skip)]
    pub config: Option<PathBuf>,
    /// Checkpoint directory [default: the bundled tiny model].
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Override a GGUF model's metadata key, KEY=TYPE:VALUE (TYPE int, float, bool or str); repeatable [default: none].
    #[arg(long)]
    pub override_kv: Option<Vec<String>>,
    /// Address to listen on [default: 127.0.0.1].
    #[arg(long)]
    pub host: Option<String>,
    /// Internal gRPC port [default: 50061].
    #[arg(long)]
    pub port: Option<u16>,
    /// Listen on this Unix socket instead of host:port [default: none].
    #[arg(long)]
    pub unix_socket: Option<PathBuf>,
    /// Prometheus /metrics port, 0 for none [default: 9161].
    #[arg(long)]
    pub metrics_port: Option<u16>,
    /// Directory of the shared-memory segments [default: $DUPLEX_SHM_DIR or /dev/shm].
    #[arg(long)]
    pub shm_dir: Option<PathBuf>,
    /// Prefix of the shared segments' names [default: duplex].
    #[arg(long)]
    pub instance: Option<String>,
    /// Longest prompt plus output [default: the model's maximum].
    #[arg(long)]
    pub context_length: Option<usize>,
    /// KV pool size in 16-token blocks [default: max-batch-size full contexts].
    #[arg(long)]
    pub kv_blocks: Option<usize>,
    /// Sequences per decode step [default: 6].
    #[arg(long)]
    pub max_batch_size: Option<usize>,
    /// Prompt tokens prefilled per step [default: 256].
    #[arg(long)]
    pub prefill_chunk_tokens: Option<usize>,
    /// Free KV leases not admitted within this many seconds [default: 900].
    #[arg(long)]
    pub lease_timeout_seconds: Option<u64>,
    /// Requests that may wait for KV blocks; more are refused [default: 256].
    #[arg(long)]
    pub max_waiting_requests: Option<usize>,
    /// Reuse the cached KV blocks of a prompt's longest cached prefix [default: true].
    #[arg(long)]
    pub prefix_caching: Option<bool>,
    /// Numeric path: bf16 or f32 [default: bf16].
    #[arg(long)]
    pub dtype: Option<String>,
    /// Compute threads [default: every core].
    #[arg(long)]
    pub threads: Option<usize>,
    /// NUMA nodes to split the threads into [default: 1].
    #[arg(long)]
    pub numa_nodes: Option<usize>,
    /// Cores to run on, a CPU list like 0-11,24-35 [default: not set].
    #[arg(long)]
    pub cores: Option<String>,
    /// Where decode runs: cpu, or the hybrid placement on cuda or emulated [default: cpu].
    #[arg(long)]
    pub device: Option<String>,
    /// Device memory in MiB; 0 for 90% of free (cuda) or 4096 (emulated) [default: 0].
    #[arg(long)]
    pub device_memory_mib: Option<usize>,
    /// CUDA device ordinal [default: 0].
    #[arg(long)]
    pub cuda_device: Option<usize>,
    /// Compute threads of the emulated device [default: 1].
    #[arg(long)]
    pub device_threads: Option<usize>,
    /// Device KV pool size in 16-token blocks; 0 for as many as fit [default: 0].
    #[arg(long)]
    pub device_kv_blocks: Option<usize>,
    /// Overlap two micro-batches (true) or run each batch whole (false) [default: true].
    #[arg(long)]
    pub micro_batches: Option<bool>,
    /// Routed experts deferred per token when one sequence decodes alone on a device; 0 for none [default: 0].
    #[arg(long)]
    pub defer_experts: Option<usize>,
    /// How a device step starts the CPU's experts: graph (one device graph per step), stream (host functions) or host [default: graph].
    #[arg(long)]
    pub expert_submit: Option<String>,
    /// Routed experts the device's expert cache holds; 0 for none [default: 0].
    #[arg(long)]
    pub expert_cache_experts: Option<usize>,
    /// The expert cache's size in bytes (when expert_cache_experts is 0) [default: 0].
    #[arg(long)]
    pub expert_cache_bytes: Option<usize>,
    /// Where activated experts run: static, hybrimoe or dali [default: hybrimoe].
    #[arg(long)]
    pub expert_assignment: Option<String>,
    /// Expert prefetch: none, impact or residual [default: none].
    #[arg(long)]
    pub expert_prefetch: Option<String>,
    /// Expert cache replacement: mrs, workload, lru or lfu [default: mrs].
    #[arg(long)]
    pub expert_cache_policy: Option<String>,
    /// Device MiB lent to two-device prefill, 0 for what is free (any amount without a device) [default: 0].
    #[arg(long)]
    pub lendable_device_mib: Option<usize>,
    /// Seconds a decode request waits for a revoked device lease to be given back [default: 5].
    #[arg(long)]
    pub device_lease_revoke_timeout_seconds: Option<f64>,
}

impl DecodeArgs {
    /// The settings from every source (see `duplex_telemetry::config`), checked.
    pub fn resolve(self) -> anyhow::Result<DecodeConfig> {
        let layers = Layers::new::<DecodeConfig>("decode").file(self.config.as_deref())?.env(&[])?;
        self.resolve_with(layers)
    }

    /// `resolve` with the file and environment layers given.
    fn resolve_with(self, layers: Layers) -> anyhow::Result<DecodeConfig> {
        let layers = layers.flags(&self);
        let c: DecodeConfig = layers.extract()?;
        // Each check's error names its key; where the value came from follows.
        let check = |key: &str, result: anyhow::Result<()>| result.map_err(|e| anyhow::anyhow!("{e} (from {})", layers.source_of(key)));
        for (key, value) in [("max_batch_size", c.max_batch_size), ("prefill_chunk_tokens", c.prefill_chunk_tokens)] {
            if value == 0 {
                return Err(layers.invalid(key, "must be at least 1").into());
            }
        }
        check("dtype", c.precision().map(drop))?;
        check("override_kv", duplex_model::source::ModelSource::parse_overrides(&c.override_kv).map(drop).map_err(anyhow::Error::from))?;
        check("device", c.device_kind().map(drop))?;
        check("expert_submit", c.submit().map(drop))?;
        check("expert_assignment", c.expert_assignment.parse::<duplex_expert_cache::assign::AssignmentKind>().map(drop).map_err(|e| anyhow::anyhow!("expert_assignment: {e}")))?;
        check("expert_prefetch", c.expert_prefetch.parse::<duplex_expert_cache::prefetch::PrefetchKind>().map(drop).map_err(|e| anyhow::anyhow!("expert_prefetch: {e}")))?;
        check("expert_cache_policy", c.expert_cache_policy.parse::<duplex_expert_cache::policy::PolicyKind>().map(drop).map_err(|e| anyhow::anyhow!("expert_cache_policy: {e}")))?;
        check("cores", c.core_list().map(drop))?;
        if !(c.device_lease_revoke_timeout_seconds.is_finite() && c.device_lease_revoke_timeout_seconds >= 0.0) {
            return Err(layers.invalid("device_lease_revoke_timeout_seconds", format!("must be a non-negative number of seconds, got {}", c.device_lease_revoke_timeout_seconds)).into());
        }
        Ok(c)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn readme_documents_every_key() {
        let readme = include_str!("../../../README.md");
        let keys = toml::Table::try_from(DecodeConfig::default()).unwrap();
        for key in keys.keys() {
            assert!(readme.contains(&format!("`{key}`")), "README.md does not document `{key}`");
        }
    }

    #[test]
    fn cores_come_from_the_file_or_the_flag_and_are_checked() {
        let path = std::env::temp_dir().join(format!("duplex-decode-cores-{}.toml", std::process::id()));
        std::fs::write(&path, "[decode]\ncores = \"0\"\n").unwrap();
        let c = DecodeArgs { config: Some(path.clone()), ..Default::default() }.resolve().unwrap();
        assert_eq!(c.core_list().unwrap(), [0]);
        let c = DecodeArgs { config: Some(path.clone()), cores: Some("0-1, 3".into()), ..Default::default() }.resolve().unwrap();
        assert_eq!(c.core_list().unwrap(), [0, 1, 3]);
        std::fs::remove_file(&path).unwrap();
        assert_eq!(DecodeConfig::default().core_list().unwrap(), Vec::<usize>::new(), "not set by default");
        let err = DecodeArgs { cores: Some("3-1".into()), ..Default::default() }.resolve().unwrap_err().to_string();
        assert!(err.starts_with("cores: ") && err.contains("backwards"), "{err}");
        // More threads than cores is refused, naming both.
        let c = DecodeConfig { cores: "0".into(), threads: 2, ..Default::default() };
        let err = c.pool().unwrap_err().to_string();
        assert!(err.contains("threads = 2") && err.contains("1 cores"), "{err}");
        let c = DecodeConfig { cores: "0".into(), ..Default::default() };
        assert_eq!(c.pool().unwrap().cores, Some(vec![0]));
    }

    /// `DecodeArgs` parsed from a command line, with `toml` as the config
    /// file and `vars` as the environment (not the test runner's).
    fn resolve_env(toml: &str, vars: &[(&str, &str)], flags: &[&str]) -> Result<DecodeConfig, String> {
        use clap::Parser;
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            args: DecodeArgs,
        }
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("duplex.toml");
        std::fs::write(&path, toml).unwrap();
        let args = Cli::parse_from(["duplex-decode"].into_iter().chain(flags.iter().copied())).args;
        let vars = vars.iter().map(|(k, v)| (k.to_string(), v.to_string()));
        let layers = Layers::new::<DecodeConfig>("decode").file(Some(&path)).map_err(|e| e.to_string())?.env_from(vars, &[]);
        args.resolve_with(layers).map_err(|e| format!("{e:#}"))
    }

    #[test]
    fn defaults_then_file_then_environment_then_flags() {
        assert_eq!(resolve_env("", &[], &[]).unwrap(), DecodeConfig::default());
        let file = "[decode]\nmax_batch_size = 8\nmicro_batches = false\nthreads = 2\n[router]\nhttp_port = 1\n";
        let c = resolve_env(file, &[], &[]).unwrap();
        assert_eq!((c.max_batch_size, c.micro_batches, c.threads), (8, false, 2));
        let env = [("DUPLEX_DECODE_MAX_BATCH_SIZE", "12"), ("DUPLEX_DECODE_MICRO_BATCHES", "true"), ("DUPLEX_DECODE_CORES", "0"), ("DUPLEX_PREFILL_THREADS", "9")];
        let c = resolve_env(file, &env, &[]).unwrap();
        assert_eq!((c.max_batch_size, c.micro_batches, c.threads, c.cores.as_str()), (12, true, 2, "0"));
        let c = resolve_env(file, &env, &["--max-batch-size", "16", "--threads", "1"]).unwrap();
        assert_eq!((c.max_batch_size, c.micro_batches, c.threads), (16, true, 1));
    }

    #[test]
    fn override_kv_comes_from_the_file_or_repeated_flags_and_is_checked() {
        let c = resolve_env("[decode]\noverride_kv = [\"a.b=float:1\"]\n", &[], &[]).unwrap();
        assert_eq!(c.override_kv, ["a.b=float:1"]);
        let c = resolve_env("", &[], &["--override-kv", "a.b=int:2", "--override-kv", "c.d=bool:true"]).unwrap();
        assert_eq!(c.override_kv, ["a.b=int:2", "c.d=bool:true"]);
        let err = resolve_env("", &[], &["--override-kv", "a.b=16"]).unwrap_err();
        assert!(err.starts_with("override_kv: ") && err.contains("KEY=TYPE:VALUE") && err.ends_with("(from flag --override-kv)"), "{err}");
    }

    #[test]
    fn errors_name_the_key_and_where_its_value_came_from() {
        let err = resolve_env("[decode]\nmax_batch_size = \"x\"\n", &[], &[]).unwrap_err();
        assert!(err.contains("`decode.max_batch_size` from config file") && err.contains("duplex.toml") && err.contains("invalid type"), "{err}");
        let err = resolve_env("[decode]\nmax_bach_size = 4\n", &[], &[]).unwrap_err();
        assert!(err.contains("max_bach_size") && err.contains("unknown field"), "{err}");
        let err = resolve_env("", &[("DUPLEX_DECODE_MAX_BATCH_SIZE", "0")], &[]).unwrap_err();
        assert_eq!(err, "invalid decode setting `max_batch_size` (from environment variable DUPLEX_DECODE_MAX_BATCH_SIZE): must be at least 1");
        let err = resolve_env("[decode]\ndevice = \"tpu\"\n", &[], &[]).unwrap_err();
        assert!(err.starts_with("device: ") && err.contains("\"tpu\"") && err.contains("(from config file ") && err.ends_with("duplex.toml)"), "{err}");
        let err = resolve_env("", &[], &["--dtype", "f16"]).unwrap_err();
        assert!(err.starts_with("dtype: ") && err.ends_with("(from flag --dtype)"), "{err}");
    }

    #[test]
    fn expert_submit_is_graph_stream_or_host() {
        assert_eq!(DecodeConfig::default().submit().unwrap(), Submit::Graph);
        for (name, submit) in [("graph", Submit::Graph), ("stream", Submit::Stream), ("host", Submit::Host)] {
            let c = DecodeArgs { expert_submit: Some(name.into()), ..Default::default() }.resolve().unwrap();
            assert_eq!(c.submit().unwrap(), submit);
        }
        let err = DecodeArgs { expert_submit: Some("callbacks".into()), ..Default::default() }.resolve().unwrap_err().to_string();
        assert!(err.starts_with("expert_submit: ") && err.contains("\"callbacks\""), "{err}");
    }
}
