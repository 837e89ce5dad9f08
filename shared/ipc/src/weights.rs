//! The weight store: the model's weights, once, in a named segment.
//!
//! Layout (integers little-endian):
//!
//! | offset | field |
//! | --- | --- |
//! | 0 | magic `DUPLEXW1` |
//! | 8 | format version (u32) |
//! | 12 | complete flag (u32, 1 = complete), written last |
//! | 16 | checkpoint fingerprint, 64 hex bytes |
//! | 80 | sha256 of config.json, 64 hex bytes |
//! | 144 | directory offset, directory length (u64 each) |
//! | 160 | data offset (page-aligned), total length (u64 each) |
//! | 176 | directory: JSON `{name: {dtype, shape, data_offsets}}` (safetensors' form; `dtype` may also name a GGUF block format, `Q4_K`), offsets relative to the data offset |
//! | data offset | tensor data, every tensor 64-byte aligned |
//!
//! The fingerprint names the checkpoint the segment was built from; it is not
//! a checksum of the data, which would cost a full read on every attach.

use crate::numa::{self, PlacementReport};
use crate::segment::{self, align_up, io_err, u32_at, u64_at, PAGE};
use crate::residency::{huge_page_mapping, HugePageMapping};
use crate::IpcError;
use duplex_kernels::pool::PoolConfig;
use duplex_model::checkpoint::{Checkpoint, CheckpointError};
use duplex_model::model::{CpuRuntime, Model};
use duplex_model::source::ModelSource;
use memmap2::Mmap;
use duplex_model::checkpoint::{StoredTensor, StoredType};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::Arc;

const MAGIC: &[u8; 8] = b"DUPLEXW1";
const VERSION: u32 = 1;
const COMPLETE_AT: usize = 12;
const FINGERPRINT_AT: usize = 16;
const CONFIG_HASH_AT: usize = 80;
const DIR_AT: usize = 144;
const DATA_AT: usize = 160;
const HEADER_LEN: usize = 176;
/// Tensor alignment inside the data region: one cache line, the widest SIMD load.
const TENSOR_ALIGN: usize = 64;
/// Largest safetensors header read while fingerprinting (safetensors' own limit).
const MAX_SHARD_HEADER: u64 = 100_000_000;

/// A tensor's entry in the segment's directory.
#[derive(Clone, Debug, Serialize, Deserialize)]
struct DirEntry {
    /// [`StoredType::name`].
    dtype: String,
    shape: Vec<usize>,
    data_offsets: (usize, usize),
}

/// The directory as a checkpoint's tensor list; an unknown type name makes
/// the segment unreadable (a newer build's), which rebuilding fixes.
fn stored_tensors(directory: &BTreeMap<String, DirEntry>) -> Result<Vec<StoredTensor>, String> {
    directory
        .iter()
        .map(|(name, e)| {
            let ty = StoredType::from_name(&e.dtype).ok_or_else(|| format!("tensor {name} has unknown type {}", e.dtype))?;
            Ok(StoredTensor { name: name.clone(), ty, shape: e.shape.clone(), range: e.data_offsets.0..e.data_offsets.1 })
        })
        .collect()
}

/// How [`WeightStore::open_or_build`] got its segment.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Provenance {
    /// A complete segment of this checkpoint was already there.
    Attached,
    /// The segment was missing or stale and was built from the checkpoint.
    Built,
}

/// A weight segment, mapped read-only.
pub struct WeightStore {
    path: PathBuf,
    map: Arc<Mmap>,
    fingerprint: String,
    config_hash: String,
    data_offset: usize,
    directory: BTreeMap<String, DirEntry>,
    /// What this process's build placed; the default when it attached.
    placement: PlacementReport,
}

impl std::fmt::Debug for WeightStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "WeightStore({}, {} bytes, {} tensors, {})", self.path.display(), self.map.len(), self.directory.len(), self.fingerprint)
    }
}

fn sha256_hex(bytes: &[u8]) -> String {
    hex(&Sha256::digest(bytes))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Fingerprint of the model at `model_dir`, without reading its tensor
/// data: sha256 over the sha256 of config.json, the index file (if any), and
/// for each shard (by file name) its name, length and safetensors header;
/// for a GGUF, over each part's name, length and header (metadata and
/// tensor table). Hex. Any edit that changes a tensor's name, dtype, shape
/// or place changes it; rewriting tensor data in place with identical
/// layout does not.
pub fn checkpoint_fingerprint(source: &ModelSource) -> Result<String, IpcError> {
    let (_, identity) = source.config()?;
    fingerprint_of(source, &identity)
}

fn fingerprint_of(source: &ModelSource, identity: &[u8]) -> Result<String, IpcError> {
    match source {
        // Opening maps the shards and parses their headers; it reads no tensor data.
        ModelSource::HuggingFace(dir) => fingerprint_with(dir, &Checkpoint::open(dir, None)?, &sha256_hex(identity)),
        // The identity already holds every part's header.
        ModelSource::Gguf { .. } => Ok(sha256_hex(identity)),
    }
}

fn fingerprint_with(model_dir: &Path, ck: &Checkpoint, config_hash: &str) -> Result<String, IpcError> {
    let mut h = Sha256::new();
    h.update(b"config.json\0");
    h.update(config_hash.as_bytes());
    let index = model_dir.join(duplex_model::checkpoint::INDEX_FILE);
    if index.exists() {
        let bytes = std::fs::read(&index).map_err(io_err(&index))?;
        h.update(b"index\0");
        h.update((bytes.len() as u64).to_le_bytes());
        h.update(&bytes);
    }
    let mut files: Vec<&Path> = ck.files().collect();
    files.sort();
    for path in files {
        let bad = |message: String| CheckpointError::BadShard { file: path.to_path_buf(), message };
        let mut file = File::open(path).map_err(io_err(path))?;
        let len = file.metadata().map_err(io_err(path))?.len();
        let mut n = [0u8; 8];
        file.read_exact(&mut n).map_err(io_err(path))?;
        let header_len = u64::from_le_bytes(n);
        if header_len > MAX_SHARD_HEADER || header_len > len.saturating_sub(8) {
            return Err(bad(format!("header length {header_len} does not fit the file of {len} bytes")).into());
        }
        let mut header = vec![0u8; header_len as usize];
        file.read_exact(&mut header).map_err(io_err(path))?;
        h.update(path.file_name().map(|n| n.as_encoded_bytes()).unwrap_or_default());
        h.update(b"\0");
        h.update(len.to_le_bytes());
        h.update(n);
        h.update(&header);
    }
    Ok(hex(&h.finalize()))
}

/// `model.layers.{i}.…` with `i >= n_layers`: a multi-token-prediction layer,
/// which the engine does not run.
fn is_mtp(name: &str, n_layers: usize) -> bool {
    name.strip_prefix("model.layers.")
        .and_then(|r| r.split('.').next())
        .and_then(|i| i.parse::<usize>().ok())
        .is_some_and(|i| i >= n_layers)
}

impl WeightStore {
    /// Under the lock `<shm_dir>/<name>.lock`, attach to `<shm_dir>/<name>` if
    /// it is complete and its fingerprint matches the checkpoint in
    /// `model_dir`; otherwise (missing, incomplete, corrupt, another format
    /// version or checkpoint) build it from the checkpoint and rename it over
    /// the old one. Processes still mapping the old one keep their copy.
    pub fn open_or_build(shm_dir: &Path, name: &str, model_dir: &Path) -> Result<(WeightStore, Provenance), IpcError> {
        Self::open_or_build_reporting(shm_dir, name, model_dir, &mut |_, _| {})
    }

    /// [`Self::open_or_build`], calling `progress(bytes written, total)` as
    /// a build goes (a real checkpoint's segment takes minutes to fill). A
    /// build that fails leaves no files behind: the temp file goes with it,
    /// and so does the lock file when there is no segment to guard.
    pub fn open_or_build_reporting(shm_dir: &Path, name: &str, model_dir: &Path, progress: &mut dyn FnMut(u64, u64)) -> Result<(WeightStore, Provenance), IpcError> {
        Self::open_or_build_placed(shm_dir, name, &ModelSource::locate(model_dir)?, 1, progress)
    }

    /// [`Self::open_or_build_reporting`] for a CPU pool of `numa_nodes`
    /// nodes: a build places each routed expert's pages in the memory of the
    /// node that computes it (see [`crate::numa`]); [`Self::placement`] says
    /// what was placed. An attached segment keeps the placement it was built with.
    /// The model is `source`, with its metadata overrides.
    pub fn open_or_build_placed(shm_dir: &Path, name: &str, source: &ModelSource, numa_nodes: usize, progress: &mut dyn FnMut(u64, u64)) -> Result<(WeightStore, Provenance), IpcError> {
        let lock = segment::lock(shm_dir, name)?;
        let result = Self::open_or_build_locked(shm_dir, name, source, numa_nodes, progress);
        if result.is_err() && !shm_dir.join(name).exists() {
            let _ = std::fs::remove_file(shm_dir.join(format!("{name}.lock")));
        }
        drop(lock);
        result
    }

    fn open_or_build_locked(shm_dir: &Path, name: &str, source: &ModelSource, numa_nodes: usize, progress: &mut dyn FnMut(u64, u64)) -> Result<(WeightStore, Provenance), IpcError> {
        let (cfg, identity) = source.config()?;
        let config_hash = sha256_hex(&identity);
        let fingerprint = fingerprint_of(source, &identity)?;
        // Whatever is wrong with the existing segment, rebuilding fixes it.
        if let Ok(store) = Self::attach(shm_dir, name, Some(&fingerprint)) {
            return Ok((store, Provenance::Attached));
        }
        segment::remove_stale_temps(shm_dir, name);
        let (_, ck) = source.open()?;
        let layout = segment::Backing::of(shm_dir)?;
        let placement = Self::build(shm_dir, name, &ck, cfg.num_hidden_layers, &fingerprint, &config_hash, numa_nodes, layout, progress)?;
        let mut store = Self::attach(shm_dir, name, Some(&fingerprint))?;
        store.placement = placement;
        Ok((store, Provenance::Built))
    }

    /// Build the segment laid out and filled for `layout`: [`segment::Backing::of`]
    /// the directory, except in a test that lays out a hugetlbfs segment on a tmpfs.
    #[allow(clippy::too_many_arguments)]
    fn build(shm_dir: &Path, name: &str, ck: &Checkpoint, n_layers: usize, fingerprint: &str, config_hash: &str, numa_nodes: usize, layout: segment::Backing, progress: &mut dyn FnMut(u64, u64)) -> Result<PlacementReport, IpcError> {
        let mut tensors: Vec<_> = ck.raw_tensors().filter(|(n, ..)| !is_mtp(n, n_layers)).collect();
        tensors.sort_by_key(|t| t.0);
        let mut directory = BTreeMap::new();
        let mut end = 0;
        for &(n, dtype, shape, bytes) in &tensors {
            let start = align_up(end, TENSOR_ALIGN);
            end = start + bytes.len();
            directory.insert(n, DirEntry { dtype: dtype.name(), shape: shape.to_vec(), data_offsets: (start, end) });
        }
        let dir_json = serde_json::to_vec(&directory).expect("a map of strings and entries always serialises");
        let data_offset = align_up(HEADER_LEN + dir_json.len(), PAGE);
        // On a hugetlbfs the file is whole huge pages; the header's total is
        // the file's length, padding included, which is what `attach` checks.
        let total = layout.segment_len(data_offset + end);

        // A policy covers whole pages of the file, huge ones on a hugetlbfs.
        let page = numa::page_size().max(layout.page());
        let plan = numa::plan(directory.iter().map(|(n, t)| (*n, data_offset + t.data_offsets.0, t.data_offsets.1 - t.data_offsets.0)), numa_nodes, page);
        let mut placement = PlacementReport { nodes: numa_nodes, ..Default::default() };
        let temp = segment::create_reserved_placed(shm_dir, name, total as u64, |file| {
            if !plan.is_empty() {
                placement = numa::apply(file, &plan, numa_nodes, numa::memory_nodes());
            }
        })?;
        let mut filler = segment::Filler::new(temp.as_file(), temp.path(), total, layout)?;
        let mut write = |bytes: &[u8], at: usize| filler.write(bytes, at);
        let mut header = Vec::with_capacity(HEADER_LEN);
        header.extend_from_slice(MAGIC);
        header.extend_from_slice(&VERSION.to_le_bytes());
        header.extend_from_slice(&0u32.to_le_bytes());
        header.extend_from_slice(fingerprint.as_bytes());
        header.extend_from_slice(config_hash.as_bytes());
        for v in [HEADER_LEN, dir_json.len(), data_offset, total] {
            header.extend_from_slice(&(v as u64).to_le_bytes());
        }
        debug_assert_eq!(header.len(), HEADER_LEN);
        write(&header, 0)?;
        write(&dir_json, HEADER_LEN)?;
        let mut written = 0u64;
        for &(n, _, _, bytes) in &tensors {
            write(bytes, data_offset + directory[n].data_offsets.0)?;
            written += bytes.len() as u64;
            progress(written, end as u64);
        }
        write(&1u32.to_le_bytes(), COMPLETE_AT)?;
        // A shared mapping of a hugetlbfs writes the file's own pages:
        // there is nothing to flush before the rename.
        drop(filler);
        let path = shm_dir.join(name);
        temp.persist(&path).map_err(|e| IpcError::Io { path, source: e.error })?;
        Ok(placement)
    }

    /// Map `<shm_dir>/<name>` read-only and check its header and directory,
    /// and its fingerprint if `expected_fingerprint` is given.
    pub fn attach(shm_dir: &Path, name: &str, expected_fingerprint: Option<&str>) -> Result<WeightStore, IpcError> {
        let path = segment::segment_path(shm_dir, name)?;
        let file = File::open(&path).map_err(io_err(&path))?;
        // SAFETY: a weight segment is never written after it is renamed into
        // place; a rebuild writes a new file and renames it over this name,
        // leaving this inode as it is.
        let map = unsafe { Mmap::map(&file) }.map_err(io_err(&path))?;
        // Where a tmpfs allocated the segment in 2 MiB transparent huge pages
        // (see `segment::create_reserved_placed` for the settings that make
        // it), map them whole.
        segment::advise_huge(&map, shm_dir);
        let map = Arc::new(map);
        let corrupt = |reason: String| IpcError::Corrupt { path: path.clone(), reason };
        let h = map.get(..HEADER_LEN).ok_or_else(|| corrupt(format!("{} bytes is too short for the header", map.len())))?;
        if &h[..8] != MAGIC {
            return Err(corrupt("it does not start with DUPLEXW1".into()));
        }
        let version = u32_at(h, 8).unwrap_or(0);
        if version != VERSION {
            return Err(corrupt(format!("format version {version}, this build reads version {VERSION}")));
        }
        if u32_at(h, COMPLETE_AT) != Some(1) {
            return Err(corrupt("it was never completed".into()));
        }
        let hex_field = |at: usize| {
            let field = &h[at..at + 64];
            field.iter().all(|b| b.is_ascii_hexdigit()).then(|| String::from_utf8_lossy(field).into_owned())
        };
        let (Some(fingerprint), Some(config_hash)) = (hex_field(FINGERPRINT_AT), hex_field(CONFIG_HASH_AT)) else {
            return Err(corrupt("its fingerprint is not hex".into()));
        };
        let field = |at: usize| usize::try_from(u64_at(h, at).unwrap_or(u64::MAX)).unwrap_or(usize::MAX);
        let (dir_at, dir_len, data_offset, total) = (field(DIR_AT), field(DIR_AT + 8), field(DATA_AT), field(DATA_AT + 8));
        if total != map.len() {
            return Err(corrupt(format!("its header says {total} bytes but the file has {}", map.len())));
        }
        let dir_end = dir_at.checked_add(dir_len).filter(|&e| dir_at >= HEADER_LEN && e <= data_offset && data_offset <= total);
        if dir_end.is_none() || data_offset % PAGE != 0 {
            return Err(corrupt(format!("bad layout: directory {dir_at}+{dir_len}, data at {data_offset}, total {total}")));
        }
        if let Some(expected) = expected_fingerprint {
            if expected != fingerprint {
                return Err(IpcError::FingerprintMismatch { path, expected: expected.to_string(), found: fingerprint });
            }
        }
        let directory: BTreeMap<String, DirEntry> =
            serde_json::from_slice(&map[dir_at..dir_at + dir_len]).map_err(|e| corrupt(format!("its tensor directory is not valid: {e}")))?;
        // Check every tensor's range now, so that a bad directory is a stale
        // segment here rather than an error when the model loads.
        Checkpoint::from_mapping(path.clone(), map.clone(), data_offset, stored_tensors(&directory).map_err(&corrupt)?, None).map_err(|e| corrupt(e.to_string()))?;
        Ok(WeightStore { path, map, fingerprint, config_hash, data_offset, directory, placement: PlacementReport::default() })
    }

    /// The NUMA placement this process gave the segment when it built it
    /// (nodes 0 when it attached to one built elsewhere).
    pub fn placement(&self) -> &PlacementReport {
        &self.placement
    }

    /// The fingerprint of the checkpoint this segment was built from (hex).
    pub fn fingerprint(&self) -> &str {
        &self.fingerprint
    }

    pub fn size_bytes(&self) -> u64 {
        self.map.len() as u64
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Map every 2 MiB of the segment (one read each, so that a huge page
    /// is mapped whole and a base page maps only its neighbourhood) and
    /// report from `/proc/self/smaps` how many of the segment's bytes this
    /// process maps with huge pages. About 350,000 page faults for a
    /// 700 GB segment in huge pages.
    pub fn huge_pages(&self) -> std::io::Result<HugePageMapping> {
        touch_and_measure(&self.map, &self.path)
    }

    /// The line a worker logs at attach: "weights: 4.8 GiB, 100% in 2 MiB
    /// pages", and where they are not all huge, the settings that decide it.
    pub fn describe_pages(&self, m: &HugePageMapping) -> String {
        describe_pages("weights", &self.path, self.map.len() as u64, m)
    }

    /// Names of the tensors in the segment.
    pub fn tensor_names(&self) -> impl Iterator<Item = &str> {
        self.directory.keys().map(|s| s.as_str())
    }

    /// The segment's tensors as a checkpoint; the weights stay views into it.
    pub fn checkpoint(&self, fp8_block: Option<[usize; 2]>) -> Result<Checkpoint, CheckpointError> {
        let tensors = stored_tensors(&self.directory).map_err(|message| CheckpointError::BadShard { file: self.path.clone(), message })?;
        Checkpoint::from_mapping(self.path.clone(), self.map.clone(), self.data_offset, tensors, fp8_block)
    }

    /// Remove segment `name`, its lock file and any temp file of an
    /// interrupted build. Processes mapping it keep their mapping; a missing
    /// segment is not an error.
    pub fn remove(shm_dir: &Path, name: &str) -> std::io::Result<()> {
        segment::remove_stale_temps(shm_dir, name);
        segment::remove(shm_dir, name)
    }
}

/// Read one byte of every 2 MiB of `map` (a mapping of `path`), so that a
/// huge page is mapped whole and a base page only its neighbourhood, then
/// report from `/proc/self/smaps` how `path` is mapped.
pub fn touch_and_measure(map: &[u8], path: &Path) -> std::io::Result<HugePageMapping> {
    for at in (0..map.len()).step_by(2 << 20) {
        // SAFETY: `at` is inside the slice.
        std::hint::black_box(unsafe { std::ptr::read_volatile(map.as_ptr().add(at)) });
    }
    huge_page_mapping(std::process::id(), path)
}

/// "weights: 4.8 GiB, 100% in 2 MiB pages" (`what` = "weights") for `size`
/// bytes of `path` mapped as `m` says; where not all are huge, the settings
/// that decide it.
pub fn describe_pages(what: &str, path: &Path, size: u64, m: &HugePageMapping) -> String {
    let percent = if size == 0 { 0.0 } else { 100.0 * m.huge.min(size) as f64 / size as f64 };
    // Transparent huge pages are PMD-sized: 2 MiB on x86-64. A hugetlbfs
    // mapping says its own page size.
    let page = if m.kernel_page > PAGE as u64 { m.kernel_page } else { 2 << 20 };
    let mut line = format!("{what}: {}, {percent:.0}% in {} pages", segment::human(size), segment::human(page).replace(".0 ", " "));
    // A tmpfs file's last partial 2 MiB is never a huge page: the hint is
    // for a segment visibly short of 100%.
    if percent < 99.5 {
        line.push_str(&format!(" ({}; README \"Huge pages for the weight segment\" says how to get them)", segment::thp_hint(path.parent().unwrap_or(Path::new("/")))));
    }
    line
}

/// Load the model from the store with the configuration of the model at
/// `model_dir` (its config.json, or its GGUF's metadata), which must be the
/// one the segment was built from.
pub fn load_model(store: &WeightStore, source: &ModelSource, pool: &PoolConfig) -> Result<Model, IpcError> {
    let (cfg, identity) = source.config()?;
    if sha256_hex(&identity) != store.config_hash {
        return Err(IpcError::ConfigMismatch { config: source.config_file(), segment: store.path.clone() });
    }
    let ck = store.checkpoint(cfg.quantization.as_ref().map(|q| q.weight_block_size))?;
    Ok(Model::from_checkpoint(cfg, &ck, CpuRuntime::new(pool), &mut |_, _| {})?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::residency::mapping_residency;
    use duplex_model::config::ModelConfig;
    use duplex_model::{BlockTable, Logits, Precision};
    use std::time::Instant;

    const FIXTURE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/fixtures/tiny-dsv3");

    fn fixture() -> &'static Path {
        Path::new(FIXTURE)
    }

    /// A copy of the fixture's model files, for editing.
    fn fixture_copy() -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        for f in ["config.json", "model.safetensors.index.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"] {
            std::fs::copy(fixture().join(f), dir.path().join(f)).unwrap();
        }
        dir
    }

    #[test]
    fn builds_once_then_attaches() {
        let shm = tempfile::tempdir().unwrap();
        let t = Instant::now();
        let (built, how) = WeightStore::open_or_build(shm.path(), "w", fixture()).unwrap();
        let build_time = t.elapsed();
        assert_eq!(how, Provenance::Built);
        let t = Instant::now();
        let (attached, how) = WeightStore::open_or_build(shm.path(), "w", fixture()).unwrap();
        eprintln!("build {build_time:?}, attach {:?} ({} bytes)", t.elapsed(), attached.size_bytes());
        assert_eq!(how, Provenance::Attached);
        assert_eq!(built.fingerprint(), attached.fingerprint());
        assert_eq!(built.fingerprint(), checkpoint_fingerprint(&ModelSource::locate(fixture()).unwrap()).unwrap());
        assert_eq!(attached.path(), shm.path().join("w"));
        assert_eq!(attached.data_offset % PAGE, 0);
        assert!(attached.directory.values().all(|t| t.data_offsets.0 % TENSOR_ALIGN == 0));
        WeightStore::remove(shm.path(), "w").unwrap();
        WeightStore::remove(shm.path(), "w").unwrap();
        assert!(std::fs::read_dir(shm.path()).unwrap().next().is_none(), "remove leaves nothing behind");
    }

    #[test]
    fn store_model_matches_disk_model_bit_for_bit() {
        let shm = tempfile::tempdir().unwrap();
        let (store, _) = WeightStore::open_or_build(shm.path(), "w", fixture()).unwrap();
        let pool = PoolConfig::single_node(1);
        let tokens = [1, 17, 300, 5, 42];
        let logits = |model: &Model| {
            let mut kv = model.new_kv_pool(8, 16);
            model.forward(&mut kv, &mut BlockTable::default(), &tokens, Precision::F32, Logits::All).unwrap()
        };
        let from_store = load_model(&store, &ModelSource::locate(fixture()).unwrap(), &pool).unwrap();
        let from_disk = Model::load_with(fixture(), &pool, &mut |_, _| {}).unwrap();
        assert!(from_disk.skipped_mtp_tensors > 0);
        assert_eq!(from_store.skipped_mtp_tensors, 0);
        assert_eq!(logits(&from_store), logits(&from_disk));
    }

    #[test]
    fn a_gguf_segment_holds_its_block_formats_and_computes_as_the_file_does() {
        let gguf = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tiny-dsv3-q4km/model-Q4_K_M.gguf");
        let shm = tempfile::tempdir().unwrap();
        let (store, how) = WeightStore::open_or_build(shm.path(), "g", &gguf).unwrap();
        assert_eq!(how, Provenance::Built);
        assert!(store.directory.values().any(|e| e.dtype == "Q4_K") && store.directory.values().any(|e| e.dtype == "Q6_K"), "k-quants are stored as they are");
        assert_eq!(store.fingerprint(), checkpoint_fingerprint(&ModelSource::locate(&gguf).unwrap()).unwrap());
        // The directory holding it names the same model, so it attaches.
        let (_, how) = WeightStore::open_or_build(shm.path(), "g", gguf.parent().unwrap()).unwrap();
        assert_eq!(how, Provenance::Attached);
        let pool = PoolConfig::single_node(1);
        let tokens = [0, 17, 300, 5, 42];
        let logits = |model: &Model, p: Precision| {
            let mut kv = model.new_kv_pool(8, 16);
            model.forward(&mut kv, &mut BlockTable::default(), &tokens, p, Logits::All).unwrap()
        };
        let from_store = load_model(&store, &ModelSource::locate(&gguf).unwrap(), &pool).unwrap();
        let from_disk = Model::load_with(&gguf, &pool, &mut |_, _| {}).unwrap();
        for p in [Precision::F32, Precision::Bf16] {
            assert_eq!(logits(&from_store, p), logits(&from_disk, p), "{p:?}");
        }
        // Another model's configuration is refused.
        assert!(matches!(load_model(&store, &ModelSource::locate(fixture()).unwrap(), &pool), Err(IpcError::ConfigMismatch { .. })));
        // So is the same file read with other metadata overrides (another
        // YaRN, say): a worker given other overrides than the segment's
        // builder stops, and with them the segment is rebuilt.
        let overridden = ModelSource::locate_with(&gguf, &["deepseek2.rope.scaling.yarn_beta_fast=float:4".into()]).unwrap();
        let e = load_model(&store, &overridden, &pool).err().expect("other overrides, another model");
        assert!(matches!(e, IpcError::ConfigMismatch { .. }) && e.to_string().contains("override_kv"), "{e}");
        let (rebuilt, how) = WeightStore::open_or_build_placed(shm.path(), "g", &overridden, 1, &mut |_, _| {}).unwrap();
        assert_eq!(how, Provenance::Built);
        assert_eq!(load_model(&rebuilt, &overridden, &pool).unwrap().cfg.rope_scaling.unwrap().beta_fast, 4.0);
    }

    #[test]
    fn leaves_out_mtp_tensors() {
        let shm = tempfile::tempdir().unwrap();
        let (store, _) = WeightStore::open_or_build(shm.path(), "w", fixture()).unwrap();
        let n_layers = ModelConfig::from_file(&fixture().join("config.json")).unwrap().num_hidden_layers;
        let ck = Checkpoint::open(fixture(), None).unwrap();
        assert!(ck.tensor_names().any(|n| is_mtp(n, n_layers)), "the fixture has MTP tensors");
        assert!(store.tensor_names().all(|n| !is_mtp(n, n_layers)));
        assert_eq!(store.tensor_names().count(), ck.tensor_names().filter(|n| !is_mtp(n, n_layers)).count());
        let shard_bytes: u64 = ck.files().map(|f| f.metadata().unwrap().len()).sum();
        assert!(store.size_bytes() < shard_bytes, "{} vs {shard_bytes}", store.size_bytes());
    }

    #[test]
    fn stale_segments_are_rebuilt() {
        let shm = tempfile::tempdir().unwrap();
        let path = shm.path().join("w");
        let (good, _) = WeightStore::open_or_build(shm.path(), "w", fixture()).unwrap();
        let good_bytes = std::fs::read(&path).unwrap();
        let fingerprint = good.fingerprint().to_string();
        drop(good);

        let wrong = "0".repeat(64);
        let err = WeightStore::attach(shm.path(), "w", Some(&wrong)).unwrap_err();
        assert!(matches!(&err, IpcError::FingerprintMismatch { found, .. } if *found == fingerprint), "{err}");

        let mut other_fingerprint = good_bytes.clone();
        other_fingerprint[FINGERPRINT_AT] = if good_bytes[FINGERPRINT_AT] == b'0' { b'1' } else { b'0' };
        let mut incomplete = good_bytes.clone();
        incomplete[COMPLETE_AT] = 0;
        let mut bad_dir = good_bytes.clone();
        bad_dir[HEADER_LEN] = b'!';
        let mut damaged: Vec<Vec<u8>> = vec![other_fingerprint, incomplete, bad_dir, b"garbage".repeat(1000), vec![]];
        for len in [7, 100, HEADER_LEN, HEADER_LEN + 10, good_bytes.len() - 1] {
            damaged.push(good_bytes[..len].to_vec());
        }
        for (i, bytes) in damaged.iter().enumerate() {
            std::fs::write(&path, bytes).unwrap();
            // Only the other fingerprint (case 0) is a well-formed segment.
            assert_eq!(WeightStore::attach(shm.path(), "w", None).is_ok(), i == 0, "case {i}");
            let (store, how) = WeightStore::open_or_build(shm.path(), "w", fixture()).unwrap();
            assert_eq!((how, store.fingerprint()), (Provenance::Built, fingerprint.as_str()), "case {i}");
            store.checkpoint(Some([128, 128])).unwrap();
        }
    }

    #[test]
    fn another_checkpoint_is_rebuilt() {
        let shm = tempfile::tempdir().unwrap();
        let (a, _) = WeightStore::open_or_build(shm.path(), "w", fixture()).unwrap();
        let copy = fixture_copy();
        assert_eq!(checkpoint_fingerprint(&ModelSource::locate(copy.path()).unwrap()).unwrap(), a.fingerprint(), "the fingerprint depends on contents, not paths");
        let config = copy.path().join("config.json");
        let mut text = std::fs::read_to_string(&config).unwrap();
        text.push('\n');
        std::fs::write(&config, text).unwrap();
        let (b, how) = WeightStore::open_or_build(shm.path(), "w", copy.path()).unwrap();
        assert_eq!(how, Provenance::Built);
        assert_ne!(a.fingerprint(), b.fingerprint());
        assert_eq!(WeightStore::open_or_build(shm.path(), "w", copy.path()).unwrap().1, Provenance::Attached);
        // The old mapping still works after the rename, and the model loads
        // only with the config the segment was built from.
        a.checkpoint(Some([128, 128])).unwrap();
        assert!(matches!(load_model(&b, &ModelSource::locate(fixture()).unwrap(), &PoolConfig::single_node(1)), Err(IpcError::ConfigMismatch { .. })));
        load_model(&b, &ModelSource::locate(copy.path()).unwrap(), &PoolConfig::single_node(1)).unwrap();
    }

    #[test]
    fn mapped_segment_is_resident() {
        let shm = tempfile::tempdir().unwrap();
        let (store, _) = WeightStore::open_or_build(shm.path(), "w", fixture()).unwrap();
        let sum: u64 = store.map.iter().step_by(PAGE).map(|&b| b as u64).sum();
        std::hint::black_box(sum);
        let r = mapping_residency(std::process::id(), store.path()).unwrap();
        eprintln!("size {} rss {} pss {}", store.size_bytes(), r.rss, r.pss);
        assert!(r.rss as f64 >= 0.9 * store.size_bytes() as f64, "{r:?}");
        assert!(r.pss <= r.rss);
    }

    /// Whether a tmpfs at `dir` allocates transparent huge pages at fallocate.
    fn thp_allocates(dir: &Path) -> bool {
        let hint = crate::segment::thp_hint(dir);
        ["huge=always", "huge=within_size", "shmem_enabled=always", "shmem_enabled=within_size", "shmem_enabled=force"].iter().any(|s| hint.contains(s))
    }

    #[test]
    fn a_plain_tmpfs_segment_builds_and_reports_its_pages() {
        // It reads back as the checkpoint's bytes.
        let shm = tempfile::tempdir_in("/dev/shm").unwrap();
        let (store, _) = WeightStore::open_or_build(shm.path(), "w", fixture()).unwrap();
        let ck = Checkpoint::open(fixture(), None).unwrap();
        let seg = store.checkpoint(None).unwrap();
        for (name, _, _, bytes) in ck.raw_tensors().filter(|(n, ..)| store.directory.contains_key(*n)) {
            let (_, _, _, in_seg) = seg.raw_tensors().find(|(n, ..)| *n == name).unwrap();
            assert_eq!(in_seg, bytes, "{name}");
        }
        let m = store.huge_pages().unwrap();
        let line = store.describe_pages(&m);
        eprintln!("{line} {m:?}");
        assert!(m.mapped >= store.size_bytes() / 2, "every 2 MiB was touched: {m:?}");
        assert!(m.huge <= m.mapped, "{m:?}");
        if !thp_allocates(shm.path()) {
            // 4 KiB pages: none is huge, and the line says why.
            assert_eq!(m.huge, 0, "{m:?}");
            assert!(line.contains(", 0% in 2 MiB pages (") && line.contains("shmem_enabled="), "{line}");
        }
    }

    #[test]
    fn a_segment_laid_out_for_hugetlbfs_is_whole_pages_filled_through_a_mapping() {
        // What a hugetlbfs shm_dir gets (the file in whole 2 MiB pages, the
        // header's total counting the padding, every byte stored through a
        // mapping), made on a plain tmpfs, where it must attach and compute
        // as the segment written with write(2) does.
        let shm = tempfile::tempdir_in("/dev/shm").unwrap();
        let (plain, _) = WeightStore::open_or_build(shm.path(), "plain", fixture()).unwrap();
        let source = ModelSource::locate(fixture()).unwrap();
        let (cfg, _) = source.config().unwrap();
        let (_, ck) = source.open().unwrap();
        let page = 2 << 20;
        WeightStore::build(shm.path(), "huge", &ck, cfg.num_hidden_layers, plain.fingerprint(), &plain.config_hash, 1, segment::Backing::HugeTlb { page }, &mut |_, _| {}).unwrap();
        let huge = WeightStore::attach(shm.path(), "huge", Some(plain.fingerprint())).unwrap();
        assert_eq!(huge.size_bytes() % page as u64, 0);
        assert!(huge.size_bytes() > plain.size_bytes(), "the fixture is no whole number of huge pages");
        let (p, h) = (std::fs::read(plain.path()).unwrap(), std::fs::read(huge.path()).unwrap());
        assert_eq!(u64_at(&h, DATA_AT + 8), Some(h.len() as u64), "the header's total is the file's length");
        assert_eq!(p[..DATA_AT + 8], h[..DATA_AT + 8]);
        assert_eq!(p[DATA_AT + 16..], h[DATA_AT + 16..p.len()], "the same bytes");
        assert!(h[p.len()..].iter().all(|&b| b == 0), "the padding is zeros");
        let pool = PoolConfig::single_node(1);
        let tokens = [1, 17, 300, 5, 42];
        let logits = |store: &WeightStore| {
            let model = load_model(store, &ModelSource::locate(fixture()).unwrap(), &pool).unwrap();
            let mut kv = model.new_kv_pool(8, 16);
            model.forward(&mut kv, &mut BlockTable::default(), &tokens, Precision::F32, Logits::All).unwrap()
        };
        assert_eq!(logits(&huge), logits(&plain));
    }

    #[test]
    fn the_page_line_says_what_is_huge_and_hints_only_when_short() {
        let path = Path::new("/dev/shm/w");
        let size = 5u64 << 30;
        let thp = |huge| HugePageMapping { mapped: size, huge, kernel_page: 4096 };
        // A tmpfs segment whose last partial 2 MiB is in small pages is all huge.
        assert_eq!(describe_pages("weights", path, size, &thp(size - (1 << 20))), "weights: 5.0 GiB, 100% in 2 MiB pages");
        let half = describe_pages("weights", path, size, &thp(size / 2));
        assert!(half.starts_with("weights: 5.0 GiB, 50% in 2 MiB pages (/dev/shm mount huge="), "{half}");
        let hugetlb = HugePageMapping { mapped: size, huge: size, kernel_page: 1 << 30 };
        assert_eq!(describe_pages("weights", Path::new("/mnt/huge/w"), size, &hugetlb), "weights: 5.0 GiB, 100% in 1 GiB pages");
    }

    #[test]
    fn a_segment_in_a_plain_directory_reports_without_failing() {
        let dir = tempfile::tempdir().unwrap();
        let (store, _) = WeightStore::open_or_build(dir.path(), "w", fixture()).unwrap();
        let m = store.huge_pages().unwrap();
        assert!(m.mapped > 0 && m.huge <= m.mapped, "{m:?}");
        assert!(store.describe_pages(&m).starts_with("weights: "));
    }

    #[test]
    fn concurrent_starters_build_once() {
        let shm = tempfile::tempdir().unwrap();
        let results: Vec<_> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..2).map(|_| s.spawn(|| WeightStore::open_or_build(shm.path(), "w", fixture()).unwrap())).collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert_eq!(results.iter().filter(|(_, how)| *how == Provenance::Built).count(), 1);
        assert_eq!(results[0].0.fingerprint(), results[1].0.fingerprint());
    }

    /// The `/proc/self/numa_maps` line of the mapping that starts at `addr`.
    fn numa_maps_line(addr: *const u8) -> String {
        let maps = std::fs::read_to_string("/proc/self/numa_maps").unwrap();
        let key = format!("{:x} ", addr as usize);
        maps.lines().find(|l| l.starts_with(&key)).unwrap_or_else(|| panic!("no numa_maps line for {key}")).to_string()
    }

    #[test]
    fn numa_placement_keeps_the_bytes_and_sets_the_policy() {
        // A tmpfs, where the policy decides where pages go.
        let shm = tempfile::tempdir_in("/dev/shm").unwrap();
        let (plain, _) = WeightStore::open_or_build_placed(shm.path(), "plain", &ModelSource::locate(fixture()).unwrap(), 1, &mut |_, _| {}).unwrap();
        let (placed, how) = WeightStore::open_or_build_placed(shm.path(), "placed", &ModelSource::locate(fixture()).unwrap(), 2, &mut |_, _| {}).unwrap();
        assert_eq!(how, Provenance::Built);
        assert_eq!(plain.placement().nodes, 1);
        assert!(plain.placement().placed.is_empty());
        assert_eq!(std::fs::read(plain.path()).unwrap(), std::fs::read(placed.path()).unwrap(), "placement changes no byte");

        let plan = numa::plan(
            placed.directory.iter().map(|(n, t)| (n.as_str(), placed.data_offset + t.data_offsets.0, t.data_offsets.1 - t.data_offsets.0)),
            2,
            numa::page_size(),
        );
        let planned = |node| plan.iter().filter(|r| r.node == node).map(|r| r.len as u64).sum::<u64>();
        assert!(planned(0) > 0 && planned(1) > 0, "the fixture's experts span whole pages");
        let machine = numa::memory_nodes().unwrap();
        let report = placed.placement();
        eprintln!("{report}");
        // Every planned byte is either placed on a node the machine has, or
        // reported unplaced because the machine lacks that node.
        for node in [0, 1] {
            let on_machine = machine.contains(&node);
            assert_eq!(report.placed.get(&node).copied().unwrap_or(0), if on_machine { planned(node) } else { 0 }, "node {node}: {report}");
        }
        if !machine.contains(&1) {
            assert_eq!(report.unplaced, planned(1));
            assert!(report.note.as_deref().unwrap_or("").contains("no memory node 1"), "{report}");
        }
        // The policy is the file's: a fresh mapping of a node-0 range shows
        // it, one of a non-expert range shows the default.
        let file = File::open(placed.path()).unwrap();
        let r0 = plan.iter().find(|r| r.node == 0).unwrap();
        let map = unsafe { memmap2::MmapOptions::new().offset(r0.start as u64).len(r0.len).map(&file) }.unwrap();
        let line = numa_maps_line(map.as_ptr());
        assert!(line.contains(" prefer:0 "), "{line}");
        let header = unsafe { memmap2::MmapOptions::new().len(PAGE).map(&file) }.unwrap();
        let line = numa_maps_line(header.as_ptr());
        assert!(line.contains(" default "), "{line}");
    }
}
