//! The prefill worker's settings: defaults, the `[prefill]` section of the
//! TOML config file, `DUPLEX_PREFILL_*` environment variables, then
//! command-line flags (`duplex_telemetry::config`).

use duplex_telemetry::config::Layers;
use serde::{Deserialize, Serialize};
use std::path::PathBuf;

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PrefillConfig {
    /// The model: a Hugging Face directory (config.json, safetensors, tokenizer) or a GGUF model (file, or a directory holding one).
    pub model: PathBuf,
    /// Overrides of a GGUF model's metadata, each `KEY=TYPE:VALUE` (TYPE
    /// `int`, `float`, `bool` or `str`) as llama.cpp's `--override-kv`, for
    /// example `deepseek2.rope.scaling.yarn_beta_fast=float:32`. The decode
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
    /// Prefix of the segment names; must match the decode worker's.
    pub instance: String,
    /// Prompt tokens per forward pass. Cancellation and `Stats` are served
    /// between chunks.
    pub chunk_tokens: usize,
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
    /// The accelerator for stream-loading prefill: `cuda`, `emulated` (a
    /// CPU-backed stand-in, for tests and demos), `cpu` (none: every prompt
    /// on the CPU engine), or `auto` (`cuda` when built in and a GPU is
    /// present, else `cpu`).
    pub device: String,
    /// Accelerators for stream-loading prefill, each `emulated` or `cuda:N`;
    /// two or more also run two-device prefill (DSLP) on all of them, when
    /// the router routes a prompt there. When set, `device` and
    /// `cuda_device` are not used. Empty: `device` alone.
    pub devices: Vec<String>,
    /// Prompts of at least this many tokens use stream-loading prefill;
    /// shorter ones the CPU engine, which has the lower TTFT there.
    pub slp_threshold_tokens: usize,
    /// Device memory to use, in MiB; 0: 90% of what is free (cuda) or 4096 (emulated).
    pub device_memory_mib: usize,
    /// Which CUDA device.
    pub cuda_device: usize,
    /// Host→device copy bandwidth of the emulated device, in GB/s (25 ≈
    /// PCIe 4.0 x16); 0: unlimited.
    pub emulated_h2d_gb_per_s: f64,
    /// Experts ring-buffer slots; 0: adaptive (one layer's experts below the
    /// turning point, 2 from it on).
    pub ring_slots: usize,
    /// Prompt length from which the ring shrinks to 2 slots (ping-pong).
    pub ring_turning_point_tokens: usize,
    /// Device memory for non-expert weights (attention, dense MLPs, router
    /// and shared experts, embedding and LM-head chunks), in MiB.
    pub dense_budget_mib: usize,
    /// Two-device prefill borrows its second device (and any further one)
    /// from the decode worker, which lends it only while it has nothing to
    /// decode and takes it back when a decode request arrives (the device
    /// lease). false: every device in `devices` is this worker's own, and
    /// no lease is taken.
    pub dslp_borrows_decode_device: bool,
    /// The decode worker to borrow the device from: `unix:/path.sock`, a
    /// URL or `host:port`. Empty: the socket `duplex serve` gives it,
    /// `unix:<shm_dir>/<instance>.sockets/decode.sock`.
    pub decode_worker: String,
}

/// Where stream-loading prefill runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceKind {
    Auto,
    Cuda,
    Emulated,
    Cpu,
}

/// One entry of `devices`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NamedDevice {
    Emulated,
    /// A CUDA device by ordinal.
    Cuda(usize),
}

impl PrefillConfig {
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
            "auto" => Ok(DeviceKind::Auto),
            "cuda" => Ok(DeviceKind::Cuda),
            "emulated" => Ok(DeviceKind::Emulated),
            "cpu" => Ok(DeviceKind::Cpu),
            other => anyhow::bail!("device: unknown device {other:?}; expected auto, cuda, emulated or cpu"),
        }
    }

    /// The decode worker's address for the device lease.
    pub fn decode_worker_address(&self) -> String {
        if self.decode_worker.is_empty() {
            format!("unix:{}", self.shm_dir.join(format!("{}.sockets", self.instance)).join("decode.sock").display())
        } else {
            self.decode_worker.clone()
        }
    }

    /// `devices` parsed; empty when not set.
    pub fn device_list(&self) -> anyhow::Result<Vec<NamedDevice>> {
        let mut list = Vec::with_capacity(self.devices.len());
        for entry in &self.devices {
            let device = match entry.trim() {
                "emulated" => NamedDevice::Emulated,
                other => match other.strip_prefix("cuda:").map(str::parse::<usize>) {
                    Some(Ok(ordinal)) => NamedDevice::Cuda(ordinal),
                    _ => anyhow::bail!("devices: unknown device {entry:?}; expected emulated or cuda:N (N the CUDA device's ordinal)"),
                },
            };
            // Two ranks on one GPU would share its memory and its copy
            // engine: slower than one, never what was meant.
            if let NamedDevice::Cuda(n) = device {
                if list.contains(&device) {
                    anyhow::bail!("devices: cuda:{n} is listed twice");
                }
            }
            list.push(device);
        }
        Ok(list)
    }
}

impl Default for PrefillConfig {
    fn default() -> Self {
        PrefillConfig {
            model: duplex_model::bundled_model(),
            override_kv: vec![],
            host: "127.0.0.1".into(),
            port: 50071,
            unix_socket: None,
            metrics_port: 9171,
            shm_dir: duplex_ipc::default_shm_dir(),
            instance: "duplex".into(),
            chunk_tokens: 512,
            dtype: "bf16".into(),
            threads: 0,
            numa_nodes: 1,
            cores: String::new(),
            device: "auto".into(),
            devices: Vec::new(),
            slp_threshold_tokens: 4096,
            device_memory_mib: 0,
            cuda_device: 0,
            emulated_h2d_gb_per_s: 25.0,
            ring_slots: 0,
            ring_turning_point_tokens: 50_000,
            dense_budget_mib: 1024,
            dslp_borrows_decode_device: true,
            decode_worker: String::new(),
        }
    }
}

/// Command-line flags: each overrides the environment, which overrides the
/// config file, which overrides the defaults. Serialized, the flags given
/// are the top layer of the settings.
#[derive(Clone, Debug, Default, clap::Args, Serialize)]
pub struct PrefillArgs {
    /// TOML config file; its `[prefill]` section applies here. Environment variables DUPLEX_PREFILL_<KEY> (DUPLEX_PREFILL_THREADS) override it, flags override both.
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
    /// Internal gRPC port [default: 50071].
    #[arg(long)]
    pub port: Option<u16>,
    /// Listen on this Unix socket instead of host:port [default: none].
    #[arg(long)]
    pub unix_socket: Option<PathBuf>,
    /// Prometheus /metrics port, 0 for none [default: 9171].
    #[arg(long)]
    pub metrics_port: Option<u16>,
    /// Directory of the shared-memory segments [default: $DUPLEX_SHM_DIR or /dev/shm].
    #[arg(long)]
    pub shm_dir: Option<PathBuf>,
    /// Prefix of the shared segments' names [default: duplex].
    #[arg(long)]
    pub instance: Option<String>,
    /// Prompt tokens per forward pass [default: 512].
    #[arg(long)]
    pub chunk_tokens: Option<usize>,
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
    /// Accelerator for stream-loading prefill: auto, cuda, emulated or cpu [default: auto].
    #[arg(long)]
    pub device: Option<String>,
    /// Accelerators for stream-loading prefill, comma-separated (emulated, cuda:N); two or more also run two-device prefill; replaces --device [default: none].
    #[arg(long, value_delimiter = ',')]
    pub devices: Option<Vec<String>>,
    /// Prompt tokens from which stream-loading prefill is used [default: 4096].
    #[arg(long)]
    pub slp_threshold_tokens: Option<usize>,
    /// Device memory in MiB; 0 for 90% of free (cuda) or 4096 (emulated) [default: 0].
    #[arg(long)]
    pub device_memory_mib: Option<usize>,
    /// CUDA device ordinal [default: 0].
    #[arg(long)]
    pub cuda_device: Option<usize>,
    /// Emulated device's host→device bandwidth in GB/s, 0 for unlimited [default: 25].
    #[arg(long)]
    pub emulated_h2d_gb_per_s: Option<f64>,
    /// Experts ring-buffer slots, 0 for adaptive [default: 0].
    #[arg(long)]
    pub ring_slots: Option<usize>,
    /// Prompt tokens from which the ring shrinks to 2 slots [default: 50000].
    #[arg(long)]
    pub ring_turning_point_tokens: Option<usize>,
    /// Device MiB for non-expert weights [default: 1024].
    #[arg(long)]
    pub dense_budget_mib: Option<usize>,
    /// Two-device prefill borrows the decode worker's device under a lease [default: true].
    #[arg(long)]
    pub dslp_borrows_decode_device: Option<bool>,
    /// Decode worker address for the device lease [default: the socket duplex serve gives it].
    #[arg(long)]
    pub decode_worker: Option<String>,
}

impl PrefillArgs {
    /// The settings from every source (see `duplex_telemetry::config`), checked.
    pub fn resolve(self) -> anyhow::Result<PrefillConfig> {
        let layers = Layers::new::<PrefillConfig>("prefill").file(self.config.as_deref())?.env(&[])?;
        self.resolve_with(layers)
    }

    /// `resolve` with the file and environment layers given.
    fn resolve_with(self, layers: Layers) -> anyhow::Result<PrefillConfig> {
        let layers = layers.flags(&self);
        let c: PrefillConfig = layers.extract()?;
        // Each check's error names its key; where the value came from follows.
        let check = |key: &str, result: anyhow::Result<()>| result.map_err(|e| anyhow::anyhow!("{e} (from {})", layers.source_of(key)));
        for (key, value) in [("chunk_tokens", c.chunk_tokens), ("dense_budget_mib", c.dense_budget_mib), ("slp_threshold_tokens", c.slp_threshold_tokens)] {
            if value == 0 {
                return Err(layers.invalid(key, "must be at least 1").into());
            }
        }
        check("dtype", c.precision().map(drop))?;
        check("override_kv", duplex_model::source::ModelSource::parse_overrides(&c.override_kv).map(drop).map_err(anyhow::Error::from))?;
        check("device", c.device_kind().map(drop))?;
        check("devices", c.device_list().map(drop))?;
        check("cores", c.core_list().map(drop))?;
        if c.ring_slots == 1 {
            return Err(layers.invalid("ring_slots", "must be 0 (adaptive) or at least 2").into());
        }
        if !(c.emulated_h2d_gb_per_s.is_finite() && c.emulated_h2d_gb_per_s >= 0.0) {
            return Err(layers.invalid("emulated_h2d_gb_per_s", format!("must be a non-negative number, got {}", c.emulated_h2d_gb_per_s)).into());
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
        let keys = toml::Table::try_from(PrefillConfig::default()).unwrap();
        for key in keys.keys() {
            assert!(readme.contains(&format!("`{key}`")), "README.md does not document `{key}`");
        }
    }

    /// `PrefillArgs` parsed from a command line, with `toml` as the config
    /// file and `vars` as the environment (not the test runner's).
    fn resolve_env(toml: &str, vars: &[(&str, &str)], flags: &[&str]) -> Result<PrefillConfig, String> {
        use clap::Parser;
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            args: PrefillArgs,
        }
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("duplex.toml");
        std::fs::write(&path, toml).unwrap();
        let args = Cli::parse_from(["duplex-prefill"].into_iter().chain(flags.iter().copied())).args;
        let vars = vars.iter().map(|(k, v)| (k.to_string(), v.to_string()));
        let layers = Layers::new::<PrefillConfig>("prefill").file(Some(&path)).map_err(|e| e.to_string())?.env_from(vars, &[]);
        args.resolve_with(layers).map_err(|e| format!("{e:#}"))
    }

    #[test]
    fn defaults_then_file_then_environment_then_flags() {
        assert_eq!(resolve_env("", &[], &[]).unwrap(), PrefillConfig::default());
        let file = "[prefill]\nchunk_tokens = 128\ndevice = \"cpu\"\nemulated_h2d_gb_per_s = 12.5\n[decode]\nthreads = 1\n";
        let c = resolve_env(file, &[], &[]).unwrap();
        assert_eq!((c.chunk_tokens, c.device.as_str(), c.emulated_h2d_gb_per_s), (128, "cpu", 12.5));
        let env = [("DUPLEX_PREFILL_CHUNK_TOKENS", "64"), ("DUPLEX_PREFILL_EMULATED_H2D_GB_PER_S", "0"), ("DUPLEX_DECODE_CHUNK_TOKENS", "x")];
        let c = resolve_env(file, &env, &[]).unwrap();
        assert_eq!((c.chunk_tokens, c.device.as_str(), c.emulated_h2d_gb_per_s), (64, "cpu", 0.0));
        let c = resolve_env(file, &env, &["--chunk-tokens", "32", "--device", "emulated"]).unwrap();
        assert_eq!((c.chunk_tokens, c.device.as_str(), c.emulated_h2d_gb_per_s), (32, "emulated", 0.0));
    }

    #[test]
    fn override_kv_comes_from_the_file_or_repeated_flags_and_is_checked() {
        let c = resolve_env("[prefill]\noverride_kv = [\"a.b=float:1\"]\n", &[], &[]).unwrap();
        assert_eq!(c.override_kv, ["a.b=float:1"]);
        let c = resolve_env("", &[], &["--override-kv", "a.b=int:2", "--override-kv", "c.d=bool:true"]).unwrap();
        assert_eq!(c.override_kv, ["a.b=int:2", "c.d=bool:true"]);
        let err = resolve_env("", &[], &["--override-kv", "a.b=16"]).unwrap_err();
        assert!(err.starts_with("override_kv: ") && err.contains("KEY=TYPE:VALUE") && err.ends_with("(from flag --override-kv)"), "{err}");
    }

    #[test]
    fn errors_name_the_key_and_where_its_value_came_from() {
        let err = resolve_env("[prefill]\nring_slots = -1\n", &[], &[]).unwrap_err();
        assert!(err.contains("`prefill.ring_slots` from config file") && err.contains("duplex.toml"), "{err}");
        let err = resolve_env("", &[("DUPLEX_PREFILL_RING_SLOTS", "1")], &[]).unwrap_err();
        assert_eq!(err, "invalid prefill setting `ring_slots` (from environment variable DUPLEX_PREFILL_RING_SLOTS): must be 0 (adaptive) or at least 2");
        let err = resolve_env("", &[], &["--chunk-tokens", "0"]).unwrap_err();
        assert_eq!(err, "invalid prefill setting `chunk_tokens` (from flag --chunk-tokens): must be at least 1");
        let err = resolve_env("", &[("DUPLEX_PREFILL_SLP_THRESHOLD", "4")], &[]).unwrap_err();
        assert!(err.contains("DUPLEX_PREFILL_SLP_THRESHOLD") && err.contains("unknown field"), "{err}");
    }

    #[test]
    fn devices_from_every_source_and_checked() {
        assert_eq!(resolve_env("", &[], &[]).unwrap().device_list().unwrap(), []);
        let c = resolve_env("[prefill]\ndevices = [\"emulated\", \"emulated\"]\n", &[], &[]).unwrap();
        assert_eq!(c.device_list().unwrap(), [NamedDevice::Emulated, NamedDevice::Emulated]);
        let c = resolve_env("", &[("DUPLEX_PREFILL_DEVICES", "cuda:0,cuda:1")], &[]).unwrap();
        assert_eq!(c.device_list().unwrap(), [NamedDevice::Cuda(0), NamedDevice::Cuda(1)]);
        let c = resolve_env("[prefill]\ndevices = [\"cuda:3\"]\n", &[("DUPLEX_PREFILL_DEVICES", "cuda:0,cuda:1")], &["--devices", "emulated,cuda:2"]).unwrap();
        assert_eq!(c.device_list().unwrap(), [NamedDevice::Emulated, NamedDevice::Cuda(2)]);
        let err = resolve_env("", &[], &["--devices", "emulated,gpu"]).unwrap_err();
        assert!(err.contains("devices: unknown device \"gpu\"") && err.contains("flag --devices"), "{err}");
        let err = resolve_env("[prefill]\ndevices = [\"cuda:x\"]\n", &[], &[]).unwrap_err();
        assert!(err.contains("\"cuda:x\"") && err.contains("duplex.toml"), "{err}");
        let err = resolve_env("", &[("DUPLEX_PREFILL_DEVICES", "cuda:1,cuda:1")], &[]).unwrap_err();
        assert!(err.contains("cuda:1 is listed twice") && err.contains("DUPLEX_PREFILL_DEVICES"), "{err}");
    }

    #[test]
    fn the_device_lease_settings() {
        let c = resolve_env("[prefill]\nshm_dir = \"/tmp/shm\"\ninstance = \"x\"\n", &[], &[]).unwrap();
        assert!(c.dslp_borrows_decode_device, "borrowed by default");
        assert_eq!(c.decode_worker_address(), "unix:/tmp/shm/x.sockets/decode.sock", "where duplex serve puts the decode worker's socket");
        let c = resolve_env("", &[("DUPLEX_PREFILL_DSLP_BORROWS_DECODE_DEVICE", "false")], &["--decode-worker", "127.0.0.1:50061"]).unwrap();
        assert!(!c.dslp_borrows_decode_device);
        assert_eq!(c.decode_worker_address(), "127.0.0.1:50061");
    }

    #[test]
    fn cores_come_from_the_file_or_the_flag_and_are_checked() {
        let path = std::env::temp_dir().join(format!("duplex-prefill-cores-{}.toml", std::process::id()));
        std::fs::write(&path, "[prefill]\ncores = \"0\"\n").unwrap();
        let c = PrefillArgs { config: Some(path.clone()), ..Default::default() }.resolve().unwrap();
        assert_eq!(c.core_list().unwrap(), [0]);
        let c = PrefillArgs { config: Some(path.clone()), cores: Some("0-1, 3".into()), ..Default::default() }.resolve().unwrap();
        assert_eq!(c.core_list().unwrap(), [0, 1, 3]);
        std::fs::remove_file(&path).unwrap();
        assert_eq!(PrefillConfig::default().core_list().unwrap(), Vec::<usize>::new(), "not set by default");
        let err = PrefillArgs { cores: Some("3-1".into()), ..Default::default() }.resolve().unwrap_err().to_string();
        assert!(err.starts_with("cores: ") && err.contains("backwards"), "{err}");
        // More threads than cores is refused, naming both.
        let c = PrefillConfig { cores: "0".into(), threads: 2, ..Default::default() };
        let err = c.pool().unwrap_err().to_string();
        assert!(err.contains("threads = 2") && err.contains("1 cores"), "{err}");
        let c = PrefillConfig { cores: "0".into(), ..Default::default() };
        assert_eq!(c.pool().unwrap().cores, Some(vec![0]));
    }
}
