//! duplex-ipc: the shared-memory segments that Duplex's processes map.
//!
//! - The weight store ([`WeightStore`]): one copy of the model's weights in a
//!   named segment that the prefill and decode workers both map read-only.
//! - The KV segment ([`KvSegment`]): the paged latent KV pool that the prefill
//!   worker writes and the decode worker reads in place, so a prefilled
//!   sequence is handed over by block numbers, without copying.
//!
//! Mechanism: a segment is a plain file in a tmpfs directory, `/dev/shm` by
//! default (which is what POSIX `shm_open` does on Linux), mapped with
//! memmap2. Why files in a tmpfs:
//! - they are named, so a restarted worker re-attaches in milliseconds
//!   instead of reading the checkpoint again;
//! - separate containers that share `/dev/shm` see the same segments;
//! - unlike mapping the safetensors files themselves (rejected), the segment
//!   holds only what the engine runs: the FP8 checkpoint's layout carries
//!   multi-token-prediction tensors and shard headers we do not want;
//! - its size can be checked and reserved up front (`fallocate`), and tmpfs
//!   pages cannot be evicted by page-cache pressure the way pages of a
//!   checkpoint file on disk can, which would turn decode steps into disk reads.
//!
//! Segments are replaced by building a temp file in the same directory and
//! renaming it over the old name: processes still mapping the old inode keep
//! working, and no reader ever sees a half-written segment.

mod kv;
pub mod numa;
mod residency;
mod segment;
mod weights;

pub use kv::{KvGeometry, KvSegment, LinkWatch};
pub use residency::{huge_page_mapping, mapping_residency, HugePageMapping, Residency};
pub use segment::{check_fits, thp_hint, Backing, ScratchSegment};
pub use weights::{checkpoint_fingerprint, describe_pages, load_model, touch_and_measure, Provenance, WeightStore};

use duplex_model::checkpoint::CheckpointError;
use duplex_model::config::ConfigError;
use duplex_model::kv_cache::KvError;
use segment::human;
use std::path::PathBuf;

/// Environment variable naming the directory that holds the segments.
pub const SHM_DIR_ENV: &str = "DUPLEX_SHM_DIR";

/// Where segments live: `$DUPLEX_SHM_DIR` if set, else `/dev/shm`.
pub fn default_shm_dir() -> PathBuf {
    match std::env::var_os(SHM_DIR_ENV) {
        Some(dir) if !dir.is_empty() => PathBuf::from(dir),
        _ => PathBuf::from("/dev/shm"),
    }
}

/// Name of the weight segment of server instance `instance`.
pub fn weight_segment_name(instance: &str) -> String {
    format!("{instance}-weights")
}

/// Name of the KV segment of server instance `instance`.
pub fn kv_segment_name(instance: &str) -> String {
    format!("{instance}-kv")
}

/// What a worker does at start: attach to server instance `instance`'s
/// weight segment (building it from `source` if it is missing or stale)
/// and load the model from it.
pub fn open_shared_model(
    shm_dir: &std::path::Path,
    instance: &str,
    source: &duplex_model::source::ModelSource,
    pool: &duplex_kernels::pool::PoolConfig,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<(duplex_model::Model, WeightStore, Provenance), IpcError> {
    // A worker that builds the segment itself places the experts for its own pool.
    let (store, provenance) = WeightStore::open_or_build_placed(shm_dir, &weight_segment_name(instance), source, pool.nodes(), progress)?;
    let model = load_model(&store, source, pool)?;
    Ok((model, store, provenance))
}

#[derive(Debug, thiserror::Error)]
pub enum IpcError {
    #[error("cannot access {path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error(
        "the shared-memory filesystem {} has {} free but the segment needs {}; in Docker raise --shm-size or share the host's /dev/shm (ipc: host), or point {SHM_DIR_ENV} at a larger tmpfs",
        dir.display(), human(*available), human(*needed)
    )]
    NoSpace { dir: PathBuf, needed: u64, available: u64 },
    /// A hugetlbfs shm_dir without enough free huge pages (the message
    /// says how many are needed, free, and how to reserve them).
    #[error("{message}")]
    NoHugePages { message: String },
    #[error("{path} is not a usable Duplex segment: {reason}")]
    Corrupt { path: PathBuf, reason: String },
    #[error("{path} holds the weights of another checkpoint (fingerprint {found}, expected {expected})")]
    FingerprintMismatch { path: PathBuf, expected: String, found: String },
    #[error("{config} (with its override_kv, if any) is not the config.json (or GGUF) the weight segment {segment} was built from; point every process at the same model with the same overrides, or rebuild the segment")]
    ConfigMismatch { config: PathBuf, segment: PathBuf },
    #[error("{name:?} is not a valid segment name: {reason}")]
    BadName { name: String, reason: String },
    #[error("{} is owned by a live process (its lock {}.lock is held): another decode worker of this instance is still running; stop it, or give this server another --instance", path.display(), path.display())]
    Owned { path: PathBuf },
    #[error("KV segment geometry {geometry:?} is invalid: {reason}")]
    BadGeometry { geometry: KvGeometry, reason: String },
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Load(#[from] duplex_model::model::LoadError),
    #[error(transparent)]
    Kv(#[from] KvError),
}
