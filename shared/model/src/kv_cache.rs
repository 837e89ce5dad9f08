//! Paged cache of the compressed MLA latent.
//!
//! Per token and layer, MLA needs only the normalised latent `c` (`kv_lora_rank`
//! floats) and the rotated shared key `k_pe` (`qk_rope_head_dim` floats): the
//! per-head keys and values are recomputed from `c` or absorbed into the query.
//! The pool is one flat array of fixed-size blocks, each holding `block_size`
//! tokens for every layer; a sequence owns a `BlockTable` listing its blocks.
//! The pool is a plain addressable region ([`KvMemory`]): the heap, or a
//! shared-memory segment that the prefill worker writes and the decode worker
//! reads in place, handing sequences over by block number. Allocation is the
//! business of one owner; a pool made with [`KvPool::lent`] can only write
//! into blocks it is given.

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum KvError {
    #[error("KV cache is full: {needed} more blocks needed, {free} free of {total}")]
    OutOfBlocks { needed: usize, free: usize, total: usize },
    #[error("KV block {block} does not exist: the pool has {total} blocks")]
    NoSuchBlock { block: u32, total: usize },
    #[error("KV block {block} appears twice in one block table")]
    DuplicateBlock { block: u32 },
    #[error("KV memory holds {got} floats, but {blocks} blocks of this shape need {needed}")]
    MemorySize { got: usize, blocks: usize, needed: usize },
}

/// The floats behind a pool.
pub trait KvMemory: Send + Sync {
    fn floats(&self) -> &[f32];
    fn floats_mut(&mut self) -> &mut [f32];
}

impl KvMemory for Vec<f32> {
    fn floats(&self) -> &[f32] {
        self
    }
    fn floats_mut(&mut self) -> &mut [f32] {
        self
    }
}

/// The blocks of one sequence and how many positions are filled.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct BlockTable {
    pub blocks: Vec<u32>,
    pub len: usize,
}

pub struct KvPool {
    block_size: usize,
    n_layers: usize,
    entry_dim: usize,
    data: Box<dyn KvMemory>,
    free: Vec<u32>,
    total: usize,
}

impl KvPool {
    /// A pool of `n_blocks` blocks of `block_size` tokens, each token holding
    /// `entry_dim` floats for each of `n_layers` layers.
    pub fn new(n_blocks: usize, block_size: usize, n_layers: usize, entry_dim: usize) -> Self {
        let memory = Box::new(vec![0.0f32; Self::floats_needed(n_blocks, block_size, n_layers, entry_dim)]);
        Self::owning(memory, n_blocks, block_size, n_layers, entry_dim).expect("memory sized above")
    }

    /// Floats that `n_blocks` blocks of this shape occupy.
    pub fn floats_needed(n_blocks: usize, block_size: usize, n_layers: usize, entry_dim: usize) -> usize {
        n_blocks * block_size * n_layers * entry_dim
    }

    /// A pool over `memory` that owns allocation: every block starts free.
    pub fn owning(memory: Box<dyn KvMemory>, n_blocks: usize, block_size: usize, n_layers: usize, entry_dim: usize) -> Result<Self, KvError> {
        let mut pool = Self::lent(memory, n_blocks, block_size, n_layers, entry_dim)?;
        // Pop from the end: hand out low block numbers first.
        pool.free = (0..n_blocks as u32).rev().collect();
        Ok(pool)
    }

    /// A pool over `memory` whose blocks are allocated by someone else: it
    /// has no free blocks, and only writes into the tables it is given.
    pub fn lent(memory: Box<dyn KvMemory>, n_blocks: usize, block_size: usize, n_layers: usize, entry_dim: usize) -> Result<Self, KvError> {
        assert!(block_size > 0 && n_layers > 0 && entry_dim > 0, "KvPool dimensions must be positive");
        let needed = Self::floats_needed(n_blocks, block_size, n_layers, entry_dim);
        if memory.floats().len() < needed {
            return Err(KvError::MemorySize { got: memory.floats().len(), blocks: n_blocks, needed });
        }
        Ok(KvPool { block_size, n_layers, entry_dim, data: memory, free: vec![], total: n_blocks })
    }

    /// Check a table that came from elsewhere: every block exists, none twice.
    pub fn check_table(&self, table: &BlockTable) -> Result<(), KvError> {
        let mut seen = std::collections::HashSet::new();
        for &block in &table.blocks {
            if block as usize >= self.total {
                return Err(KvError::NoSuchBlock { block, total: self.total });
            }
            if !seen.insert(block) {
                return Err(KvError::DuplicateBlock { block });
            }
        }
        Ok(())
    }

    /// Positions a table's blocks can hold.
    pub fn capacity(&self, table: &BlockTable) -> usize {
        table.blocks.len() * self.block_size
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn entry_dim(&self) -> usize {
        self.entry_dim
    }

    pub fn free_blocks(&self) -> usize {
        self.free.len()
    }

    pub fn total_blocks(&self) -> usize {
        self.total
    }

    /// Grow `table` so that it can hold `len` positions. All or nothing.
    pub fn reserve(&mut self, table: &mut BlockTable, len: usize) -> Result<(), KvError> {
        let needed = len.div_ceil(self.block_size).saturating_sub(table.blocks.len());
        if needed > self.free.len() {
            return Err(KvError::OutOfBlocks { needed, free: self.free.len(), total: self.total });
        }
        for _ in 0..needed {
            table.blocks.push(self.free.pop().expect("checked above"));
        }
        Ok(())
    }

    /// Return every block of `table` to the pool.
    pub fn release(&mut self, table: &mut BlockTable) {
        self.free.append(&mut table.blocks);
        table.len = 0;
    }

    fn offset(&self, table: &BlockTable, layer: usize, pos: usize) -> usize {
        let block = table.blocks[pos / self.block_size] as usize;
        ((block * self.n_layers + layer) * self.block_size + pos % self.block_size) * self.entry_dim
    }

    /// All entries of `layer` in block `block`: `block_size` entries, in order.
    pub fn layer_block(&self, block: u32, layer: usize) -> &[f32] {
        let o = (block as usize * self.n_layers + layer) * self.block_size * self.entry_dim;
        &self.data.floats()[o..o + self.block_size * self.entry_dim]
    }

    /// Floats in one block: every layer's entries for `block_size` positions.
    fn block_len(&self) -> usize {
        self.n_layers * self.block_size * self.entry_dim
    }

    /// Every layer's entries in block `block`, as one run of floats.
    pub fn block(&self, block: u32) -> &[f32] {
        let len = self.block_len();
        &self.data.floats()[block as usize * len..][..len]
    }

    /// Every layer's entries in block `block`, to fill from a copy made
    /// elsewhere (a device's pool).
    pub fn block_mut(&mut self, block: u32) -> &mut [f32] {
        let len = self.block_len();
        &mut self.data.floats_mut()[block as usize * len..][..len]
    }

    /// The cache entry of `layer` at `pos`: `[latent.., k_pe..]`.
    pub fn entry(&self, table: &BlockTable, layer: usize, pos: usize) -> &[f32] {
        let o = self.offset(table, layer, pos);
        &self.data.floats()[o..o + self.entry_dim]
    }

    pub fn entry_mut(&mut self, table: &BlockTable, layer: usize, pos: usize) -> &mut [f32] {
        let o = self.offset(table, layer, pos);
        &mut self.data.floats_mut()[o..o + self.entry_dim]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reserve_write_read_release() {
        let mut pool = KvPool::new(4, 2, 3, 5);
        let mut a = BlockTable::default();
        let mut b = BlockTable::default();
        pool.reserve(&mut a, 3).unwrap();
        pool.reserve(&mut b, 2).unwrap();
        assert_eq!((a.blocks.len(), b.blocks.len(), pool.free_blocks()), (2, 1, 1));
        for pos in 0..3 {
            for layer in 0..3 {
                pool.entry_mut(&a, layer, pos).fill((pos * 10 + layer) as f32);
            }
        }
        pool.entry_mut(&b, 2, 1).fill(-1.0);
        for pos in 0..3 {
            for layer in 0..3 {
                assert!(pool.entry(&a, layer, pos).iter().all(|&v| v == (pos * 10 + layer) as f32));
            }
        }
        assert_eq!(pool.reserve(&mut b, 6), Err(KvError::OutOfBlocks { needed: 2, free: 1, total: 4 }));
        assert_eq!(b.blocks.len(), 1, "a failed reserve takes nothing");
        pool.release(&mut a);
        assert_eq!(pool.free_blocks(), 3);
        pool.reserve(&mut b, 6).unwrap();
        assert!(pool.entry(&b, 2, 1).iter().all(|&v| v == -1.0));
    }

    #[test]
    fn lent_pool_writes_only_given_blocks() {
        let mut pool = KvPool::lent(Box::new(vec![0.0f32; 4 * 2 * 3 * 5]), 4, 2, 3, 5).unwrap();
        assert_eq!(pool.free_blocks(), 0);
        let mut table = BlockTable { blocks: vec![2, 0], len: 0 };
        pool.check_table(&table).unwrap();
        pool.reserve(&mut table, 4).unwrap();
        assert_eq!(pool.reserve(&mut table, 5), Err(KvError::OutOfBlocks { needed: 1, free: 0, total: 4 }));
        assert_eq!(pool.check_table(&BlockTable { blocks: vec![1, 4], len: 0 }), Err(KvError::NoSuchBlock { block: 4, total: 4 }));
        assert_eq!(pool.check_table(&BlockTable { blocks: vec![1, 1], len: 0 }), Err(KvError::DuplicateBlock { block: 1 }));
        assert!(matches!(KvPool::lent(Box::new(vec![0.0f32; 10]), 4, 2, 3, 5), Err(KvError::MemorySize { .. })));
    }
}
