//! Automatic prefix caching: which KV blocks hold the KV of which tokens.
//!
//! A full block is named by a hash of its `block_size` tokens and of its
//! parent's hash, so a hash stands for the block's tokens *and everything
//! before them* (vLLM's automatic prefix caching): two prompts share the
//! blocks of their longest common prefix of whole blocks, and the same block
//! of tokens after a different prefix is another block. SHA-256 makes a
//! collision, which would hand one request another's KV, out of reach.
//!
//! The cache only keeps the books; the pool's blocks stay with the
//! allocator. A cached block is counted by the block tables that hold it
//! (shared read-only: nobody writes a full block again). When the count
//! falls to zero the block stays findable, in least-recently-used order,
//! until the allocator needs it for new data and evicts it; a lookup that
//! finds it first revives it. Blocks a table holds are never evictable.

use sha2::{Digest, Sha256};
use std::collections::{BTreeMap, HashMap};

/// Names the tokens of a full block and of every block before it.
pub type BlockHash = [u8; 32];

/// The hash of the block of `tokens` that follows the block `parent` (none
/// for a sequence's first block).
pub fn block_hash(parent: Option<&BlockHash>, tokens: &[u32]) -> BlockHash {
    let mut h = Sha256::new();
    // The first block's parent is a fixed value no digest equals in practice.
    h.update(parent.unwrap_or(&[0; 32]));
    for t in tokens {
        h.update(t.to_le_bytes());
    }
    h.finalize().into()
}

/// The hashes of a token sequence's full blocks, extended as it grows.
#[derive(Clone, Debug, Default)]
pub struct BlockHashes(Vec<BlockHash>);

impl BlockHashes {
    /// The hashes of the full blocks of `tokens`.
    pub fn of(tokens: &[u32], block_size: usize) -> Self {
        let mut hashes = BlockHashes::default();
        hashes.extend(tokens.iter().copied(), tokens.len(), block_size);
        hashes
    }

    /// Hash the full blocks among the first `len` of `tokens` (the whole
    /// sequence from its start) that are not hashed yet.
    pub fn extend(&mut self, tokens: impl Iterator<Item = u32>, len: usize, block_size: usize) {
        let done = self.0.len();
        let full = len / block_size;
        if full <= done {
            return;
        }
        let tail: Vec<u32> = tokens.skip(done * block_size).take((full - done) * block_size).collect();
        for block in tail.chunks_exact(block_size) {
            let hash = block_hash(self.0.last(), block);
            self.0.push(hash);
        }
    }

    pub fn as_slice(&self) -> &[BlockHash] {
        &self.0
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

struct Entry {
    hash: BlockHash,
    /// Block tables holding it.
    refs: usize,
    /// Its place in the evictable order while `refs` is 0.
    idle_since: Option<u64>,
}

#[derive(Default)]
pub struct PrefixCache {
    by_hash: HashMap<BlockHash, u32>,
    entries: HashMap<u32, Entry>,
    /// Cached blocks no table holds, oldest first: the next to evict.
    evictable: BTreeMap<u64, u32>,
    clock: u64,
}

impl PrefixCache {
    /// The cached blocks that hold the first blocks named by `hashes`, in
    /// order, up to the first one not cached.
    pub fn lookup(&self, hashes: &[BlockHash]) -> Vec<u32> {
        hashes.iter().map_while(|h| self.by_hash.get(h).copied()).collect()
    }

    /// Whether `block` is cached.
    pub fn contains(&self, block: u32) -> bool {
        self.entries.contains_key(&block)
    }

    /// Whether `block` is cached and held by no table.
    pub fn is_evictable(&self, block: u32) -> bool {
        self.entries.get(&block).is_some_and(|e| e.refs == 0)
    }

    /// A table takes a share of the cached `block` (found by [`lookup`]),
    /// reviving it if it was evictable.
    pub fn share(&mut self, block: u32) {
        let Some(e) = self.entries.get_mut(&block) else { return };
        if let Some(since) = e.idle_since.take() {
            self.evictable.remove(&since);
        }
        e.refs += 1;
    }

    /// Record that `block`, held by one table and full of written KV, holds
    /// the tokens named by `hash`. False when another block already does
    /// (two requests computed the same prefix at once): the first stays
    /// the cached one, and `block` remains its table's alone.
    pub fn insert(&mut self, hash: BlockHash, block: u32) -> bool {
        if self.by_hash.contains_key(&hash) || self.entries.contains_key(&block) {
            return false;
        }
        self.by_hash.insert(hash, block);
        self.entries.insert(block, Entry { hash, refs: 1, idle_since: None });
        true
    }

    /// A table lets go of `block`; false if it is not cached (then it is
    /// the caller's to free). A cached block no table holds becomes the
    /// most recently used of the evictable ones.
    pub fn release(&mut self, block: u32) -> bool {
        let Some(e) = self.entries.get_mut(&block) else { return false };
        e.refs = e.refs.saturating_sub(1);
        if e.refs == 0 && e.idle_since.is_none() {
            self.clock += 1;
            e.idle_since = Some(self.clock);
            self.evictable.insert(self.clock, block);
        }
        true
    }

    /// Forget the least recently used block no table holds; the caller
    /// takes it for new data.
    pub fn evict(&mut self) -> Option<u32> {
        let (_, block) = self.evictable.pop_first()?;
        if let Some(e) = self.entries.remove(&block) {
            self.by_hash.remove(&e.hash);
        }
        Some(block)
    }

    /// Cached blocks no table holds.
    pub fn evictable(&self) -> usize {
        self.evictable.len()
    }

    /// Cached blocks, held or not.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_hash_names_the_block_and_everything_before_it() {
        let a = BlockHashes::of(&[1, 2, 3, 4, 5, 6, 7], 2);
        assert_eq!(a.len(), 3, "whole blocks only");
        let b = BlockHashes::of(&[9, 9, 3, 4, 5, 6], 2);
        // The same tokens [3, 4] after another first block are another block.
        assert_ne!(a.as_slice()[1], b.as_slice()[1]);
        assert_eq!(BlockHashes::of(&[1, 2, 3, 4], 2).as_slice(), &a.as_slice()[..2]);
        // Grown token by token, the same hashes.
        let mut grown = BlockHashes::default();
        let tokens = [1, 2, 3, 4, 5, 6, 7];
        for len in 0..=tokens.len() {
            grown.extend(tokens.iter().copied(), len, 2);
        }
        assert_eq!(grown.as_slice(), a.as_slice());
    }

    #[test]
    fn lookup_stops_at_the_first_miss() {
        let mut cache = PrefixCache::default();
        let h = BlockHashes::of(&[1, 2, 3, 4, 5, 6], 2);
        assert!(cache.insert(h.as_slice()[0], 10));
        assert!(cache.insert(h.as_slice()[2], 12));
        assert_eq!(cache.lookup(h.as_slice()), [10], "block 2 without block 1 is no prefix");
        assert!(!cache.insert(h.as_slice()[0], 11), "the first block to hold a hash stays the cached one");
        assert!(!cache.contains(11));
    }

    #[test]
    fn held_blocks_are_never_evicted_and_idle_ones_go_least_recently_used_first() {
        let mut cache = PrefixCache::default();
        let h = BlockHashes::of(&[1, 2, 3, 4, 5, 6], 2);
        for (i, hash) in h.as_slice().iter().enumerate() {
            assert!(cache.insert(*hash, i as u32));
        }
        cache.share(0); // a second table holds block 0
        assert_eq!(cache.evict(), None, "every block is held");
        // The first table lets go, last block first (vLLM's order: a
        // prefix's tail is the least likely to be shared).
        for b in [2, 1, 0] {
            assert!(cache.release(b));
        }
        assert_eq!((cache.evictable(), cache.is_evictable(0)), (2, false));
        assert!(!cache.release(7), "not cached: the caller frees it");
        // A lookup hit revives block 2: block 1 becomes the oldest.
        assert_eq!(cache.lookup(&h.as_slice()[..1]), [0]);
        cache.share(2);
        assert_eq!(cache.evict(), Some(1));
        assert_eq!(cache.lookup(h.as_slice()), [0], "an evicted block is no longer found");
        assert_eq!(cache.evict(), None, "0 and 2 are held");
        cache.release(0);
        cache.release(2);
        assert_eq!(cache.evict(), Some(0), "released first, so used least recently");
        assert_eq!(cache.evict(), Some(2));
        assert!(cache.is_empty());
    }
}
