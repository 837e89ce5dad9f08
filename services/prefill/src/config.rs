//! The prefill worker's settings: defaults, the `[prefill]` section of the
//! TOML config file, then command-line flags.

use serde::{Deserialize, Serialize};
use std::path::PathBuf;

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PrefillConfig {
    /// Checkpoint directory (config.json, safetensors, tokenizer).
    pub model: PathBuf,
    pub host: String,
    /// Internal gRPC port the router calls.
    pub port: u16,
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
}

impl PrefillConfig {
    pub fn precision(&self) -> anyhow::Result<duplex_model::Precision> {
        self.dtype.parse().map_err(|e: String| anyhow::anyhow!("dtype: {e}"))
    }
}

impl Default for PrefillConfig {
    fn default() -> Self {
        PrefillConfig {
            model: PathBuf::from(duplex_model::BUNDLED_MODEL),
            host: "127.0.0.1".into(),
            port: 50071,
            metrics_port: 9171,
            shm_dir: duplex_ipc::default_shm_dir(),
            instance: "duplex".into(),
            chunk_tokens: 512,
            dtype: "bf16".into(),
            threads: 0,
            numa_nodes: 1,
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
        take!(model, host, port, metrics_port, shm_dir, instance, chunk_tokens, dtype, threads, numa_nodes);
        if c.chunk_tokens == 0 {
            anyhow::bail!("chunk_tokens must be at least 1");
        }
        c.precision()?;
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
}
