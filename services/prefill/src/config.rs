//! The prefill worker's settings: defaults, the `[prefill]` section of the
//! TOML config file, then command-line flags.

use serde::{Deserialize, Serialize};
use std::path::PathBuf;

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PrefillConfig {
    /// The model: a Hugging Face directory (config.json, safetensors, tokenizer) or a GGUF model (file, or a directory holding one).
    pub model: PathBuf,
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
}

/// Where stream-loading prefill runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceKind {
    Auto,
    Cuda,
    Emulated,
    Cpu,
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

    pub fn device_kind(&self) -> anyhow::Result<DeviceKind> {
        match self.device.as_str() {
            "auto" => Ok(DeviceKind::Auto),
            "cuda" => Ok(DeviceKind::Cuda),
            "emulated" => Ok(DeviceKind::Emulated),
            "cpu" => Ok(DeviceKind::Cpu),
            other => anyhow::bail!("device: unknown device {other:?}; expected auto, cuda, emulated or cpu"),
        }
    }
}

impl Default for PrefillConfig {
    fn default() -> Self {
        PrefillConfig {
            model: duplex_model::bundled_model(),
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
            slp_threshold_tokens: 4096,
            device_memory_mib: 0,
            cuda_device: 0,
            emulated_h2d_gb_per_s: 25.0,
            ring_slots: 0,
            ring_turning_point_tokens: 50_000,
            dense_budget_mib: 1024,
        }
    }
}

/// Command-line flags: each overrides the config file, which overrides the
/// defaults.
#[derive(Clone, Debug, Default, clap::Args)]
pub struct PrefillArgs {
    /// TOML config file; its `[prefill]` section applies here.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Checkpoint directory [default: the bundled tiny model].
    #[arg(long)]
    pub model: Option<PathBuf>,
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
}

impl PrefillArgs {
    pub fn resolve(self) -> anyhow::Result<PrefillConfig> {
        let mut c: PrefillConfig = match &self.config {
            Some(path) => duplex_telemetry::process::load_section(path, "prefill")?,
            None => PrefillConfig::default(),
        };
        macro_rules! take {
            ($($field:ident),*) => { $(if let Some(v) = self.$field { c.$field = v; })* };
        }
        if let Some(path) = self.unix_socket {
            c.unix_socket = Some(path);
        }
        take!(model, host, port, metrics_port, shm_dir, instance, chunk_tokens, dtype, threads, numa_nodes, cores);
        take!(device, slp_threshold_tokens, device_memory_mib, cuda_device, emulated_h2d_gb_per_s, ring_slots, ring_turning_point_tokens, dense_budget_mib);
        if c.chunk_tokens == 0 {
            anyhow::bail!("chunk_tokens must be at least 1");
        }
        c.precision()?;
        c.device_kind()?;
        c.core_list()?;
        if c.ring_slots == 1 {
            anyhow::bail!("ring_slots must be 0 (adaptive) or at least 2");
        }
        if !(c.emulated_h2d_gb_per_s.is_finite() && c.emulated_h2d_gb_per_s >= 0.0) {
            anyhow::bail!("emulated_h2d_gb_per_s must be a non-negative number, got {}", c.emulated_h2d_gb_per_s);
        }
        if c.dense_budget_mib == 0 || c.slp_threshold_tokens == 0 {
            anyhow::bail!("dense_budget_mib and slp_threshold_tokens must be at least 1");
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
