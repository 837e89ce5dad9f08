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
use std::os::unix::fs::FileExt;
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
}

/// The data region of a mapped KV segment, as the pool's memory.
struct MappedFloats {
    map: MmapMut,
    floats: usize,
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
    pub fn create(shm_dir: &Path, name: &str, geometry: KvGeometry) -> Result<KvSegment, IpcError> {
        let data = geometry.data_bytes().map_err(|reason| IpcError::BadGeometry { geometry, reason })?;
        let _lock = segment::lock(shm_dir, name)?;
        segment::remove_stale_temps(shm_dir, name);
        let temp = segment::create_reserved(shm_dir, name, (DATA_OFFSET + data) as u64)?;
        let epoch: u64 = rand::random();
        let mut header = Vec::with_capacity(HEADER_LEN);
        header.extend_from_slice(MAGIC);
        header.extend_from_slice(&VERSION.to_le_bytes());
        header.extend_from_slice(&0u32.to_le_bytes());
        for v in [epoch, geometry.n_blocks as u64, geometry.block_size as u64, geometry.n_layers as u64, geometry.entry_dim as u64, DATA_OFFSET as u64] {
            header.extend_from_slice(&v.to_le_bytes());
        }
        debug_assert_eq!(header.len(), HEADER_LEN);
        temp.as_file().write_all_at(&header, 0).map_err(io_err(temp.path()))?;
        // The mapping follows the inode, so it stays valid across the rename.
        let map = map_mut(temp.as_file(), temp.path())?;
        let path = shm_dir.join(name);
        temp.persist(&path).map_err(|e| IpcError::Io { path: path.clone(), source: e.error })?;
        Ok(KvSegment { path, map, epoch, geometry })
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
        if field(5) != DATA_OFFSET || map.len() != DATA_OFFSET + data {
            return Err(corrupt(format!("data at {} and {} bytes do not match geometry {geometry:?}", field(5), map.len())));
        }
        Ok(KvSegment { path, map, epoch, geometry })
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

    /// The pool over this memory: `owning` (the decode worker) starts with
    /// every block free; otherwise (the prefill worker) it is lent, with no
    /// free blocks, and writes only into the tables it is given.
    pub fn into_pool(self, owning: bool) -> Result<KvPool, IpcError> {
        let g = self.geometry;
        let memory = Box::new(MappedFloats { map: self.map, floats: KvPool::floats_needed(g.n_blocks, g.block_size, g.n_layers, g.entry_dim) });
        let make = if owning { KvPool::owning } else { KvPool::lent };
        Ok(make(memory, g.n_blocks, g.block_size, g.n_layers, g.entry_dim)?)
    }

    /// Remove segment `name` and its lock file. Processes mapping it keep
    /// their mapping; a missing segment is not an error.
    pub fn remove(shm_dir: &Path, name: &str) -> std::io::Result<()> {
        segment::remove(shm_dir, name)
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

        let fresh = KvSegment::create(shm.path(), "kv", G).unwrap();
        let fresh_epoch = fresh.epoch();
        assert_ne!(fresh_epoch, epoch);
        prefill.entry_mut(&table, 0, 0).fill(9.0);
        let fresh = fresh.into_pool(false).unwrap();
        assert!(fresh.entry(&table, 0, 0).iter().all(|&v| v == 0.0), "old writes land in the old segment");
        assert_eq!(KvSegment::attach(shm.path(), "kv").unwrap().epoch(), fresh_epoch);
        KvSegment::remove(shm.path(), "kv").unwrap();
        assert!(matches!(KvSegment::attach(shm.path(), "kv"), Err(IpcError::Io { .. })));
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
