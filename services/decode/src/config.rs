//! The decode worker's settings: defaults, the `[decode]` section of the
//! TOML config file, then command-line flags.

use serde::{Deserialize, Serialize};
use std::path::PathBuf;

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DecodeConfig {
    /// Checkpoint directory (config.json, safetensors, tokenizer).
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
    /// Numeric path: `bf16` (the fast one) or `f32` (the scalar reference,
    /// whose results do not depend on how requests are batched).
    pub dtype: String,
    /// Compute threads; 0 means every core.
    pub threads: usize,
    /// NUMA nodes the thread pool is split into.
    pub numa_nodes: usize,
}

impl DecodeConfig {
    pub fn precision(&self) -> anyhow::Result<duplex_model::Precision> {
        self.dtype.parse().map_err(|e: String| anyhow::anyhow!("dtype: {e}"))
    }
}

impl Default for DecodeConfig {
    fn default() -> Self {
        DecodeConfig {
            model: duplex_model::bundled_model(),
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
            dtype: "bf16".into(),
            threads: 0,
            numa_nodes: 1,
        }
    }
}

/// Command-line flags: each overrides the config file, which overrides the
/// defaults.
#[derive(Clone, Debug, Default, clap::Args)]
pub struct DecodeArgs {
    /// TOML config file; its `[decode]` section applies here.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Checkpoint directory [default: the bundled tiny model].
    #[arg(long)]
    pub model: Option<PathBuf>,
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

impl DecodeArgs {
    pub fn resolve(self) -> anyhow::Result<DecodeConfig> {
        let mut c: DecodeConfig = match &self.config {
            Some(path) => duplex_telemetry::process::load_section(path, "decode")?,
            None => DecodeConfig::default(),
        };
        macro_rules! take {
            ($($field:ident),*) => { $(if let Some(v) = self.$field { c.$field = v; })* };
        }
        if let Some(path) = self.unix_socket {
            c.unix_socket = Some(path);
        }
        take!(model, host, port, metrics_port, shm_dir, instance, context_length, kv_blocks, max_batch_size, prefill_chunk_tokens, lease_timeout_seconds, max_waiting_requests, dtype, threads, numa_nodes);
        if c.max_batch_size == 0 || c.prefill_chunk_tokens == 0 {
            anyhow::bail!("max_batch_size and prefill_chunk_tokens must be at least 1");
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
        let keys = toml::Table::try_from(DecodeConfig::default()).unwrap();
        for key in keys.keys() {
            assert!(readme.contains(&format!("`{key}`")), "README.md does not document `{key}`");
        }
    }
}
