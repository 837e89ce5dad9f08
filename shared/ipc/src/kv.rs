//! The KV segment: the paged latent KV pool in shared memory.
//!
//! The decode worker creates it and owns block allocation; the prefill worker
//! attaches, writes the blocks of the tables it is given, and hands a
//! sequence over by its block numbers. Layout (integers little-endian):
//! magic `DUPLEXK1`, format version (u32), 4 zero bytes, epoch (u64),
//! `n_blocks`, `block_size`, `n_layers`, `entry_dim`, data offset (u64 each),
//! then at the page-aligned data offset the pool's f32s.

use crate::segment::{self, io_err, u32_at, u64_at, PAGE};
use crate::IpcError;
use duplex_model::kv_cache::{KvMemory, KvPool};
use memmap2::MmapMut;
use serde::{Deserialize, Serialize};
use std::fs::File;
use std::path::{Path, PathBuf};

const MAGIC: &[u8; 8] = b"DUPLEXK1";
const VERSION: u32 = 1;
const HEADER_LEN: usize = 64;
/// The data starts on the first page boundary after the header.
const DATA_OFFSET: usize = PAGE;

/// The shape of a KV pool, as `KvPool` takes it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvGeometry {
    pub n_blocks: usize,
    pub block_size: usize,
    pub n_layers: usize,
    pub entry_dim: usize,
}

impl KvGeometry {
    /// Bytes of the data region, or why this geometry is unusable.
    fn data_bytes(&self) -> Result<usize, String> {
        if [self.n_blocks, self.block_size, self.n_layers, self.entry_dim].contains(&0) {
            return Err("every dimension must be positive".into());
        }
        [self.block_size, self.n_layers, self.entry_dim, 4]
            .iter()
            .try_fold(self.n_blocks, |acc, &d| acc.checked_mul(d))
            .filter(|&n| n.checked_add(DATA_OFFSET).is_some_and(|t| t <= isize::MAX as usize))
            .ok_or_else(|| "its size overflows".into())
    }
}

/// A KV segment, mapped read-write.
#[derive(Debug)]
pub struct KvSegment {
    path: PathBuf,
    map: MmapMut,
    epoch: u64,
    geometry: KvGeometry,
    file: File,
    /// The creator's lock on `<name>.lock`, held while the segment lives.
    owner: Option<File>,
}

/// How long `create` waits for the previous owner of a segment to exit (a
/// decode worker shutting down is given 10 s by the supervisor) before
/// refusing to touch it.
const OWNER_WAIT: std::time::Duration = std::time::Duration::from_secs(15);
/// How long `create` waits for other processes to unmap a reclaimed segment.
const RECLAIM_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

/// Tells whether a mapped segment's file is still the one under its name.
#[derive(Debug)]
pub struct LinkWatch(File);

impl LinkWatch {
    /// True once the file was removed or replaced: its owner is gone (or a
    /// new one made a fresh segment), and holding the mapping would keep the
    /// old pages from returning to the tmpfs.
    pub fn is_unlinked(&self) -> bool {
        nix::sys::stat::fstat(&self.0).map(|st| st.st_nlink == 0).unwrap_or(true)
    }
}

/// The data region of a mapped KV segment, as the pool's memory.
struct MappedFloats {
    map: MmapMut,
    floats: usize,
    /// The owner's lock lives as long as the pool does.
    _owner: Option<File>,
}

impl KvMemory for MappedFloats {
    fn floats(&self) -> &[f32] {
        // SAFETY: the mapping starts on a page boundary and DATA_OFFSET is a
        // multiple of the page size, so the pointer is aligned for f32;
        // `floats * 4` bytes from DATA_OFFSET lie inside the mapping (checked
        // when the segment was mapped); every bit pattern is a valid f32.
        // Another process writes only blocks this one does not read at the
        // same time: a block belongs to one sequence, whose table is held by
        // one worker at a time.
        unsafe { std::slice::from_raw_parts(self.map.as_ptr().add(DATA_OFFSET).cast::<f32>(), self.floats) }
    }

    fn floats_mut(&mut self) -> &mut [f32] {
        // SAFETY: as in `floats`; `&mut self` makes this the only slice of
        // the data in this process.
        unsafe { std::slice::from_raw_parts_mut(self.map.as_mut_ptr().add(DATA_OFFSET).cast::<f32>(), self.floats) }
    }
}

/// Map `file` read-write.
fn map_mut(file: &File, path: &Path) -> Result<MmapMut, IpcError> {
    // SAFETY: the segment file is only ever modified through mappings like
    // this one, by Duplex workers that write disjoint blocks (see
    // `MappedFloats`); its length never changes after creation.
    unsafe { MmapMut::map_mut(file) }.map_err(io_err(path))
}

impl KvSegment {
    /// Make a fresh, zeroed segment with a new random epoch, replacing any old
    /// one atomically. The decode worker calls this at start, so that a
    /// restarted decode worker never shares blocks with writes still in
    /// flight for its predecessor: those land in the old, unlinked file.
    ///
    /// The creator owns the segment: it holds `<name>.lock` for as long as the
    /// returned segment (or the pool made of it) lives. So a segment whose
    /// lock is free was left by a dead owner (even one killed with `kill -9`),
    /// and is reclaimed here before the space check; one whose owner still
    /// lives is never touched ([`IpcError::Owned`] after waiting a while for
    /// an owner that is shutting down).
    pub fn create(shm_dir: &Path, name: &str, geometry: KvGeometry) -> Result<KvSegment, IpcError> {
        Self::create_within(shm_dir, name, geometry, OWNER_WAIT)
    }

    fn create_within(shm_dir: &Path, name: &str, geometry: KvGeometry, owner_wait: std::time::Duration) -> Result<KvSegment, IpcError> {
        let data = geometry.data_bytes().map_err(|reason| IpcError::BadGeometry { geometry, reason })?;
        let path = segment::segment_path(shm_dir, name)?;
        let owner = segment::try_lock_for(shm_dir, name, owner_wait)?.ok_or_else(|| IpcError::Owned { path: path.clone() })?;
        segment::remove_stale_temps(shm_dir, name);
        let reclaimed = match std::fs::remove_file(&path) {
            Ok(()) => true,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => false,
            Err(e) => return Err(IpcError::Io { path, source: e }),
        };
        // The dead owner's pages return to the tmpfs only once every process
        // mapping them lets go; the prefill worker drops a mapping whose file
        // was unlinked within about a second (see `KvSegment::is_unlinked`).
        let deadline = std::time::Instant::now() + RECLAIM_WAIT;
        let temp = loop {
            match segment::create_reserved(shm_dir, name, segment::Backing::of(shm_dir)?.segment_len(DATA_OFFSET + data) as u64) {
                Err(IpcError::NoSpace { .. }) if reclaimed && std::time::Instant::now() < deadline => {
                    std::thread::sleep(std::time::Duration::from_millis(100));
                }
                r => break r?,
            }
        };
        let epoch: u64 = rand::random();
        let mut header = Vec::with_capacity(HEADER_LEN);
        header.extend_from_slice(MAGIC);
        header.extend_from_slice(&VERSION.to_le_bytes());
        header.extend_from_slice(&0u32.to_le_bytes());
        for v in [epoch, geometry.n_blocks as u64, geometry.block_size as u64, geometry.n_layers as u64, geometry.entry_dim as u64, DATA_OFFSET as u64] {
            header.extend_from_slice(&v.to_le_bytes());
        }
        debug_assert_eq!(header.len(), HEADER_LEN);
        // Written through the mapping: a hugetlbfs file takes no write(2).
        // The mapping follows the inode, so it stays valid across the rename.
        let mut map = map_mut(temp.as_file(), temp.path())?;
        map[..HEADER_LEN].copy_from_slice(&header);
        let path = shm_dir.join(name);
        let file = temp.persist(&path).map_err(|e| IpcError::Io { path: path.clone(), source: e.error })?;
        Ok(KvSegment { path, map, epoch, geometry, file, owner: Some(owner) })
    }

    /// Map the existing segment `<shm_dir>/<name>` read-write (the prefill worker).
    pub fn attach(shm_dir: &Path, name: &str) -> Result<KvSegment, IpcError> {
        let path = segment::segment_path(shm_dir, name)?;
        let file = File::options().read(true).write(true).open(&path).map_err(io_err(&path))?;
        let map = map_mut(&file, &path)?;
        let corrupt = |reason: String| IpcError::Corrupt { path: path.clone(), reason };
        let h = map.get(..HEADER_LEN).ok_or_else(|| corrupt(format!("{} bytes is too short for the header", map.len())))?;
        if &h[..8] != MAGIC {
            return Err(corrupt("it does not start with DUPLEXK1".into()));
        }
        let version = u32_at(h, 8).unwrap_or(0);
        if version != VERSION {
            return Err(corrupt(format!("format version {version}, this build reads version {VERSION}")));
        }
        let field = |i: usize| usize::try_from(u64_at(h, 16 + 8 * i).unwrap_or(u64::MAX)).unwrap_or(usize::MAX);
        let epoch = u64_at(h, 16).unwrap_or(0);
        let geometry = KvGeometry { n_blocks: field(1), block_size: field(2), n_layers: field(3), entry_dim: field(4) };
        let data = geometry.data_bytes().map_err(|reason| corrupt(format!("geometry {geometry:?}: {reason}")))?;
        let expected_len = segment::Backing::of(shm_dir)?.segment_len(DATA_OFFSET + data);
        if field(5) != DATA_OFFSET || map.len() != expected_len {
            return Err(corrupt(format!("data at {} and {} bytes do not match geometry {geometry:?}", field(5), map.len())));
        }
        Ok(KvSegment { path, map, epoch, geometry, file, owner: None })
    }

    /// Random at creation: tells a segment from its predecessor of the same name.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    pub fn geometry(&self) -> KvGeometry {
        self.geometry
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// A watch on this segment's file, kept beside the pool.
    pub fn link_watch(&self) -> Result<LinkWatch, IpcError> {
        self.file.try_clone().map(LinkWatch).map_err(io_err(&self.path))
    }

    /// Remove segment `name` and its lock file, unless a live process owns
    /// it; true if it was removed (or was not there).
    pub fn remove_if_unowned(shm_dir: &Path, name: &str) -> std::io::Result<bool> {
        if segment::is_locked(shm_dir, name) {
            return Ok(false);
        }
        segment::remove(shm_dir, name)?;
        Ok(true)
    }

    /// The pool over this memory: `owning` (the decode worker) starts with
    /// every block free; otherwise (the prefill worker) it is lent, with no
    /// free blocks, and writes only into the tables it is given.
    pub fn into_pool(self, owning: bool) -> Result<KvPool, IpcError> {
        let g = self.geometry;
        let memory = Box::new(MappedFloats { map: self.map, floats: KvPool::floats_needed(g.n_blocks, g.block_size, g.n_layers, g.entry_dim), _owner: self.owner });
        let make = if owning { KvPool::owning } else { KvPool::lent };
        Ok(make(memory, g.n_blocks, g.block_size, g.n_layers, g.entry_dim)?)
    }

}

#[cfg(test)]
mod tests {
    use super::*;
    use duplex_model::BlockTable;

    const G: KvGeometry = KvGeometry { n_blocks: 4, block_size: 2, n_layers: 3, entry_dim: 5 };

    #[test]
    fn writes_are_seen_through_a_second_mapping_until_recreated() {
        let shm = tempfile::tempdir().unwrap();
        let seg = KvSegment::create(shm.path(), "kv", G).unwrap();
        let epoch = seg.epoch();
        assert_eq!(seg.geometry(), G);
        let mut decode = seg.into_pool(true).unwrap();
        assert_eq!(decode.free_blocks(), 4);
        let mut table = BlockTable::default();
        decode.reserve(&mut table, 3).unwrap();
        for pos in 0..3 {
            for layer in 0..3 {
                decode.entry_mut(&table, layer, pos).fill((pos * 10 + layer) as f32 + 0.5);
            }
        }

        let attached = KvSegment::attach(shm.path(), "kv").unwrap();
        assert_eq!((attached.epoch(), attached.geometry()), (epoch, G));
        let attached_watch = attached.link_watch().unwrap();
        let mut prefill = attached.into_pool(false).unwrap();
        assert_eq!(prefill.free_blocks(), 0);
        prefill.check_table(&table).unwrap();
        for pos in 0..3 {
            for layer in 0..3 {
                assert!(prefill.entry(&table, layer, pos).iter().all(|&v| v == (pos * 10 + layer) as f32 + 0.5));
            }
        }
        // And the other way: prefill writes, decode reads.
        prefill.entry_mut(&table, 2, 1).fill(-7.0);
        assert!(decode.entry(&table, 2, 1).iter().all(|&v| v == -7.0));
        // The creator owns the segment while its pool lives.
        assert!(!KvSegment::remove_if_unowned(shm.path(), "kv").unwrap());
        let watch = attached_watch;
        assert!(!watch.is_unlinked());
        drop(decode);

        let fresh = KvSegment::create(shm.path(), "kv", G).unwrap();
        let fresh_epoch = fresh.epoch();
        assert_ne!(fresh_epoch, epoch);
        assert!(watch.is_unlinked(), "the old segment was replaced");
        prefill.entry_mut(&table, 0, 0).fill(9.0);
        let fresh = fresh.into_pool(false).unwrap();
        assert!(fresh.entry(&table, 0, 0).iter().all(|&v| v == 0.0), "old writes land in the old segment");
        assert_eq!(KvSegment::attach(shm.path(), "kv").unwrap().epoch(), fresh_epoch);
        drop(fresh);
        assert!(KvSegment::remove_if_unowned(shm.path(), "kv").unwrap());
        assert!(matches!(KvSegment::attach(shm.path(), "kv"), Err(IpcError::Io { .. })));
    }

    #[test]
    fn a_live_owners_segment_is_never_taken_and_a_dead_owners_is_reclaimed() {
        let shm = tempfile::tempdir().unwrap();
        let first = KvSegment::create(shm.path(), "kv", G).unwrap().into_pool(true).unwrap();
        let err = KvSegment::create_within(shm.path(), "kv", G, std::time::Duration::from_millis(100)).unwrap_err();
        assert!(matches!(err, IpcError::Owned { .. }), "{err}");
        assert!(err.to_string().contains("--instance"), "{err}");
        assert!(shm.path().join("kv").exists(), "a live owner's segment stays");
        drop(first); // as the owner's death does
        KvSegment::create_within(shm.path(), "kv", G, std::time::Duration::ZERO).unwrap();
    }

    #[test]
    fn bad_geometry_and_bad_files_are_errors() {
        let shm = tempfile::tempdir().unwrap();
        for g in [KvGeometry { entry_dim: 0, ..G }, KvGeometry { n_blocks: usize::MAX / 2, ..G }] {
            assert!(matches!(KvSegment::create(shm.path(), "kv", g), Err(IpcError::BadGeometry { .. })), "{g:?}");
        }
        KvSegment::create(shm.path(), "kv", G).unwrap();
        let path = shm.path().join("kv");
        let good = std::fs::read(&path).unwrap();
        let mut zero_dim = good.clone();
        zero_dim[40..48].fill(0);
        let mut huge = good.clone();
        huge[24..32].fill(0xff);
        for bytes in [vec![], b"garbage".to_vec(), good[..HEADER_LEN].to_vec(), good[..good.len() - 4].to_vec(), zero_dim, huge] {
            std::fs::write(&path, &bytes).unwrap();
            assert!(matches!(KvSegment::attach(shm.path(), "kv"), Err(IpcError::Corrupt { .. })));
        }
    }
}
