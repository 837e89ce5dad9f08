//! Allocation of the shared KV pool, which the decode worker owns.
//!
//! Sequences reserve blocks as they are admitted. For a long prompt the
//! router first takes a *lease*: blocks reserved under the request's id and
//! lent to the prefill worker, which writes the prompt's KV into them in
//! place. A lease holds the request's whole need (prompt plus `max_tokens`,
//! within the context), as any admission does, and no more: admission takes
//! it over only for the same prompt and need, so no request holds more KV
//! than its own prompt and output can fill. A lease that is never admitted
//! is freed by `FreeKv` (or `Cancel`), or, should its router vanish without
//! either, when it expires. Leases carry the pool's epoch, so one granted
//! before a restart of this worker is refused afterwards.
//!
//! Prefix caching ([`crate::prefix_cache`], on unless turned off): full
//! blocks of written KV are registered under the hash of their tokens and
//! all before them, and a new table, a sequence's or a lease's, starts with
//! the cached blocks of its prompt's longest cached prefix, shared read-only
//! (at most the blocks wholly before the prompt's last token, whose logits
//! must be computed). Its need, and what it prefills, shrink by as much. A
//! cached block no table holds still counts as free: a table is made from
//! never-cached free blocks first, then by evicting the least recently used
//! idle cached blocks, never one a table holds. So the cache never makes an
//! admission wait that would otherwise run. The cache lives and dies with
//! the pool: a restarted worker has a new epoch and starts with none.

use crate::error::DecodeError;
use crate::prefix_cache::{BlockHash, BlockHashes, PrefixCache};
use duplex_model::kv_cache::KvError;
use duplex_model::{BlockTable, KvPool};
use duplex_telemetry as names;
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Blocks lent to the prefill worker for one prompt, as the router passes
/// them on (`server.rs` maps this to the wire's `KvLease`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlockLease {
    /// The pool the blocks belong to (a restarted worker's pool is another).
    pub pool_epoch: u64,
    pub request_id: String,
    pub blocks: Vec<u32>,
    /// Leading prompt tokens already in the blocks (a prefix-cache hit).
    pub cached_tokens: u32,
}

pub struct KvAllocator {
    pool: KvPool,
    epoch: u64,
    /// Granted, not yet admitted.
    leases: HashMap<String, Lease>,
    /// Requests freed (or cancelled) while they held no lease, newest last.
    /// `FreeKv` and `AllocateKv` travel as separate calls, and a router whose
    /// client hangs up frees at once, so the free can overtake the
    /// allocation; a lease granted after it would sit unused until it
    /// expires. Such an allocation is refused instead.
    freed_early: VecDeque<String>,
    /// None when prefix caching is off.
    cache: Option<PrefixCache>,
    counters: Arc<PrefixCacheCounters>,
}

struct Lease {
    table: BlockTable,
    /// Prompt tokens the lease is for.
    tokens: usize,
    /// The prompt itself, when AllocateKv carried it (empty otherwise).
    prompt: Vec<u32>,
    /// Positions reserved: prompt plus `max_tokens`, within the context.
    positions: usize,
    granted: Instant,
}

/// What the prefix cache has done since the pool was made (the metrics
/// count the same; these are for tests and benchmarks to read).
#[derive(Debug, Default)]
pub struct PrefixCacheCounters {
    /// Prompt tokens of the tables made with a lookup.
    pub query_tokens: AtomicU64,
    /// Of those, the tokens found cached.
    pub hit_tokens: AtomicU64,
    /// Cached blocks taken for new data.
    pub evicted_blocks: AtomicU64,
}

/// How many early frees are remembered (request ids are unique, and the
/// allocation they overtake arrives within moments).
const FREED_EARLY_MAX: usize = 1024;

impl KvAllocator {
    /// An allocator of `pool`, with prefix caching on.
    pub fn new(pool: KvPool, epoch: u64) -> Self {
        KvAllocator { pool, epoch, leases: HashMap::new(), freed_early: VecDeque::new(), cache: Some(PrefixCache::default()), counters: Arc::default() }
    }

    /// Turn prefix caching on or off (before any allocation).
    pub fn with_prefix_caching(mut self, on: bool) -> Self {
        self.cache = on.then(PrefixCache::default);
        self
    }

    pub fn prefix_caching(&self) -> bool {
        self.cache.is_some()
    }

    pub fn prefix_cache_counters(&self) -> Arc<PrefixCacheCounters> {
        self.counters.clone()
    }

    /// The hashes of the full blocks of `tokens` (none when caching is off).
    pub fn hashes(&self, tokens: &[u32]) -> BlockHashes {
        match self.cache {
            Some(_) => BlockHashes::of(tokens, self.pool.block_size()),
            None => BlockHashes::default(),
        }
    }

    /// The cached blocks a prompt of `prompt_len` tokens whose block hashes
    /// are `hashes` may share: its longest cached prefix of whole blocks,
    /// ending before its last token.
    pub fn lookup(&self, prompt_len: usize, hashes: &[BlockHash]) -> Vec<u32> {
        let Some(cache) = &self.cache else { return vec![] };
        let shareable = prompt_len.saturating_sub(1) / self.pool.block_size();
        cache.lookup(&hashes[..hashes.len().min(shareable)])
    }

    /// Whether a table of `positions` positions that starts with the cached
    /// blocks `hits` can be made now.
    pub fn can_allocate(&self, hits: &[u32], positions: usize) -> bool {
        let new = self.blocks_for(positions).saturating_sub(hits.len());
        // Reviving an idle cached block takes it from what is free.
        let revived = self.cache.as_ref().map_or(0, |c| hits.iter().filter(|&&b| c.is_evictable(b)).count());
        new + revived <= self.free_blocks()
    }

    /// Make the table of a prompt of `prompt_len` tokens that needs
    /// `positions` positions: the cached blocks `hits` (from [`lookup`],
    /// just now), shared and already filled, then blocks of its own. All or
    /// nothing.
    pub fn allocate(&mut self, prompt_len: usize, hits: &[u32], positions: usize) -> Result<BlockTable, KvError> {
        if !self.can_allocate(hits, positions) {
            let needed = self.blocks_for(positions).saturating_sub(hits.len());
            return Err(KvError::OutOfBlocks { needed, free: self.free_blocks(), total: self.pool.total_blocks() });
        }
        let mut table = BlockTable::default();
        let need = self.blocks_for(positions);
        if let Some(cache) = &mut self.cache {
            for &block in hits {
                cache.share(block);
            }
            table.blocks.extend_from_slice(hits);
            table.len = hits.len() * self.pool.block_size();
            // Never-cached free blocks first, then the least recently used
            // idle cached ones.
            let short = need.saturating_sub(table.blocks.len() + self.pool.free_blocks());
            let mut evicted = BlockTable::default();
            evicted.blocks.extend((0..short).map_while(|_| cache.evict()));
            let evictions = evicted.blocks.len() as u64;
            self.pool.release(&mut evicted);
            self.counters.query_tokens.fetch_add(prompt_len as u64, Relaxed);
            self.counters.hit_tokens.fetch_add(table.len as u64, Relaxed);
            self.counters.evicted_blocks.fetch_add(evictions, Relaxed);
            metrics::counter!(names::PREFIX_CACHE_QUERIES).increment(prompt_len as u64);
            metrics::counter!(names::PREFIX_CACHE_HITS).increment(table.len as u64);
            metrics::counter!(names::PREFIX_CACHE_EVICTIONS).increment(evictions);
        }
        self.pool.reserve(&mut table, positions)?;
        Ok(table)
    }

    /// Register the full blocks of `table` whose KV is written, from block
    /// `from` on (those before are registered or were shared from the
    /// cache), as holding the tokens `hashes` names; returns how many are
    /// now registered. A block whose hash another block already holds stays
    /// the table's alone.
    pub fn register(&mut self, table: &BlockTable, hashes: &[BlockHash], from: usize) -> usize {
        let Some(cache) = &mut self.cache else { return from };
        let written = (table.len / self.pool.block_size()).min(hashes.len()).min(table.blocks.len());
        for (&hash, &block) in hashes.iter().zip(&table.blocks).take(written).skip(from) {
            cache.insert(hash, block);
        }
        written.max(from)
    }

    /// Whether `request_id` may ask for a lease: it holds none, and was not
    /// freed before asking (then it is refused, and forgotten).
    pub fn check_lease(&mut self, request_id: &str) -> Result<(), DecodeError> {
        if self.leases.contains_key(request_id) {
            return Err(DecodeError::AlreadyExists(format!("request {request_id} already holds a KV lease")));
        }
        if let Some(i) = self.freed_early.iter().position(|id| id == request_id) {
            self.freed_early.remove(i);
            return Err(DecodeError::Cancelled(format!("request {request_id} was freed before its KV lease was granted")));
        }
        Ok(())
    }

    /// Reserve `positions` positions for the prompt of `tokens` tokens of
    /// `request_id` (`prompt`, when the router sent it), starting with the
    /// cached blocks `hits`, which the lease reports as `cached_tokens`: the
    /// prefill worker starts after them. Fails while the pool is short,
    /// taking nothing.
    pub fn lease(&mut self, request_id: &str, prompt: Vec<u32>, tokens: usize, hits: &[u32], positions: usize) -> Result<BlockLease, KvError> {
        debug_assert!(0 < tokens && tokens <= positions && (prompt.is_empty() || prompt.len() == tokens));
        let table = self.allocate(tokens, hits, positions)?;
        let lease = BlockLease { pool_epoch: self.epoch, request_id: request_id.to_string(), blocks: table.blocks.clone(), cached_tokens: table.len as u32 };
        self.leases.insert(request_id.to_string(), Lease { table, tokens, prompt, positions, granted: Instant::now() });
        Ok(lease)
    }

    /// Free a lease that will not be admitted; false if there is none (and
    /// then a lease asked for later under this id is refused).
    pub fn free_lease(&mut self, request_id: &str) -> bool {
        match self.leases.remove(request_id) {
            Some(mut lease) => {
                self.release(&mut lease.table);
                true
            }
            None => {
                if self.freed_early.len() == FREED_EARLY_MAX {
                    self.freed_early.pop_front();
                }
                self.freed_early.push_back(request_id.to_string());
                false
            }
        }
    }

    /// Take over the lease of `request_id`, whose prompt the prefill worker
    /// has written (after its cached blocks), for a sequence of `prompt`
    /// that needs `positions` positions in all. The lease must be for
    /// exactly that prompt and need: one made for less would have to grow
    /// here, where the pool may be short, and one made for more would hold
    /// blocks the sequence never uses.
    pub fn take_lease(&mut self, request_id: &str, lease: &BlockLease, prompt: &[u32], positions: usize) -> Result<BlockTable, DecodeError> {
        let filled = prompt.len();
        if lease.pool_epoch != self.epoch {
            return Err(DecodeError::FailedPrecondition(format!(
                "KV lease of request {request_id} is from pool epoch {}, but the pool is now epoch {} (the decode worker restarted)",
                lease.pool_epoch, self.epoch
            )));
        }
        match self.leases.get(request_id) {
            None => return Err(DecodeError::FailedPrecondition(format!("request {request_id} holds no KV lease"))),
            Some(held) if held.table.blocks != lease.blocks || held.table.len != lease.cached_tokens as usize => {
                return Err(DecodeError::InvalidArgument(format!("KV lease of request {request_id} does not match the blocks granted")))
            }
            Some(held) if (held.tokens, held.positions) != (filled, positions) => {
                return Err(DecodeError::InvalidArgument(format!(
                    "KV lease of request {request_id} is for a prompt of {} tokens and {} positions in all, but the request has {filled} prompt tokens and needs {positions} positions (prompt plus max_tokens)",
                    held.tokens, held.positions
                )))
            }
            // Its cached blocks hold the KV of the prompt it was asked for.
            Some(held) if !held.prompt.is_empty() && held.prompt != prompt => {
                return Err(DecodeError::InvalidArgument(format!("KV lease of request {request_id} was granted for another prompt than the request's")))
            }
            Some(_) => {}
        }
        let mut table = self.leases.remove(request_id).expect("checked above").table;
        table.len = filled;
        Ok(table)
    }

    /// Free the leases older than `max_age`; returns their request ids.
    pub fn expire_leases(&mut self, max_age: Duration) -> Vec<String> {
        let expired: Vec<String> = self.leases.iter().filter(|(_, lease)| lease.granted.elapsed() > max_age).map(|(id, _)| id.clone()).collect();
        for id in &expired {
            self.free_lease(id);
        }
        expired
    }

    /// Let go of every block of `table`: cached ones become idle (still
    /// findable) once no table holds them, the rest are free at once.
    pub fn release(&mut self, table: &mut BlockTable) {
        let mut uncached = BlockTable::default();
        // Last block first: a prefix's tail is the least likely to be
        // shared again, so it is evicted before its head.
        for &block in table.blocks.iter().rev() {
            if !self.cache.as_mut().is_some_and(|c| c.release(block)) {
                uncached.blocks.push(block);
            }
        }
        self.pool.release(&mut uncached);
        table.blocks.clear();
        table.len = 0;
    }

    pub fn blocks_for(&self, positions: usize) -> usize {
        positions.div_ceil(self.pool.block_size())
    }

    /// Blocks that tables hold.
    pub fn used_blocks(&self) -> usize {
        self.pool.total_blocks() - self.free_blocks()
    }

    /// Blocks a new table may take: never-cached free ones and idle cached
    /// ones.
    pub fn free_blocks(&self) -> usize {
        self.pool.free_blocks() + self.cache.as_ref().map_or(0, PrefixCache::evictable)
    }

    /// Blocks the prefix cache names, held by tables or idle.
    pub fn cached_blocks(&self) -> usize {
        self.cache.as_ref().map_or(0, PrefixCache::len)
    }

    pub fn total_blocks(&self) -> usize {
        self.pool.total_blocks()
    }

    pub fn block_size(&self) -> usize {
        self.pool.block_size()
    }

    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    pub fn pool(&self) -> &KvPool {
        &self.pool
    }

    pub fn pool_mut(&mut self) -> &mut KvPool {
        &mut self.pool
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A lease without the prompt (an AllocateKv that did not send it).
    fn lease_blind(kv: &mut KvAllocator, id: &str, tokens: usize, positions: usize) -> Result<BlockLease, KvError> {
        kv.lease(id, vec![], tokens, &[], positions)
    }

    /// A free that overtakes its allocation: the late allocation is refused
    /// and holds nothing; the memory of it is bounded.
    #[test]
    fn a_free_before_the_lease_refuses_the_lease() {
        let mut kv = KvAllocator::new(KvPool::new(8, 16, 2, 4), 7);
        assert!(!kv.free_lease("late"));
        assert!(matches!(kv.check_lease("late").unwrap_err(), DecodeError::Cancelled(_)));
        assert!(kv.check_lease("late").is_ok(), "refused once, then forgotten");
        assert_eq!(kv.used_blocks(), 0);
        for i in 0..2 * FREED_EARLY_MAX {
            kv.free_lease(&format!("gone-{i}"));
        }
        assert_eq!(kv.freed_early.len(), FREED_EARLY_MAX);
        // Other requests are untouched.
        kv.check_lease("b").unwrap();
        assert_eq!(lease_blind(&mut kv, "b", 16, 16).unwrap().blocks.len(), 1);
    }

    #[test]
    fn leases_are_granted_taken_over_and_freed() {
        let mut kv = KvAllocator::new(KvPool::new(8, 16, 2, 4), 7);
        let prompt: Vec<u32> = (0..40).collect();
        // A 40-token prompt with up to 8 tokens of output: 48 positions, 3 blocks.
        let lease = lease_blind(&mut kv, "a", 40, 48).unwrap();
        assert_eq!((lease.blocks.len(), lease.pool_epoch, lease.cached_tokens, kv.used_blocks()), (3, 7, 0, 3));
        assert!(matches!(kv.check_lease("a").unwrap_err(), DecodeError::AlreadyExists(_)));
        assert!(lease_blind(&mut kv, "b", 16 * 6, 16 * 6).is_err(), "only 5 blocks are free");
        assert_eq!(kv.used_blocks(), 3, "a failed lease takes nothing");

        let stale = BlockLease { pool_epoch: 6, ..lease.clone() };
        assert!(matches!(kv.take_lease("a", &stale, &prompt, 48).unwrap_err(), DecodeError::FailedPrecondition(_)));
        let forged = BlockLease { blocks: vec![5, 6, 7], ..lease.clone() };
        assert!(matches!(kv.take_lease("a", &forged, &prompt, 48).unwrap_err(), DecodeError::InvalidArgument(_)));
        let claims_cached = BlockLease { cached_tokens: 16, ..lease.clone() };
        assert!(matches!(kv.take_lease("a", &claims_cached, &prompt, 48).unwrap_err(), DecodeError::InvalidArgument(_)));
        // Another prompt length, or another need, than the lease was made for.
        assert!(matches!(kv.take_lease("a", &lease, &(0..41).collect::<Vec<u32>>(), 48).unwrap_err(), DecodeError::InvalidArgument(_)));
        assert!(matches!(kv.take_lease("a", &lease, &prompt, 64).unwrap_err(), DecodeError::InvalidArgument(_)));
        let smaller = kv.take_lease("a", &lease, &prompt, 41).unwrap_err();
        assert!(smaller.to_string().contains("needs 41 positions"), "{smaller}");
        let mut table = kv.take_lease("a", &lease, &prompt, 48).unwrap();
        assert_eq!(table.len, 40);
        assert!(!kv.free_lease("a"), "the lease became the sequence's table");
        kv.release(&mut table);
        assert_eq!(kv.used_blocks(), 0);

        lease_blind(&mut kv, "c", 5, 5).unwrap();
        assert!(kv.free_lease("c"));
        assert_eq!(kv.used_blocks(), 0);

        lease_blind(&mut kv, "d", 5, 5).unwrap();
        assert!(kv.expire_leases(Duration::from_secs(60)).is_empty());
        std::thread::sleep(Duration::from_millis(5));
        assert_eq!(kv.expire_leases(Duration::from_millis(1)), ["d"]);
        assert_eq!(kv.used_blocks(), 0);
    }

    /// Make, as the batcher does, the table of a request for `prompt` with
    /// `extra` positions of output; returns it and its prompt's hashes.
    fn admit(kv: &mut KvAllocator, prompt: &[u32], extra: usize) -> (BlockTable, BlockHashes) {
        let hashes = kv.hashes(prompt);
        let hits = kv.lookup(prompt.len(), hashes.as_slice());
        (kv.allocate(prompt.len(), &hits, prompt.len() + extra).unwrap(), hashes)
    }

    /// Run the table's prompt (nothing is computed here) and cache its blocks.
    fn fill(kv: &mut KvAllocator, table: &mut BlockTable, hashes: &BlockHashes, len: usize) {
        table.len = len;
        kv.register(table, hashes.as_slice(), 0);
    }

    #[test]
    fn a_prompt_shares_the_cached_blocks_of_its_longest_prefix_before_its_last_token() {
        let mut kv = KvAllocator::new(KvPool::new(16, 4, 2, 4), 1);
        let counters = kv.prefix_cache_counters();
        let a: Vec<u32> = (0..10).collect();
        let (mut ta, ha) = admit(&mut kv, &a, 2);
        assert_eq!((ta.len, ta.blocks.len()), (0, 3), "nothing cached yet");
        fill(&mut kv, &mut ta, &ha, 10);
        assert_eq!(kv.cached_blocks(), 2, "only full blocks are cached");

        // The same first 8 tokens, then others: blocks 0 and 1 are shared.
        let b: Vec<u32> = (0..8).chain([50, 51, 52]).collect();
        let (tb, _) = admit(&mut kv, &b, 1);
        assert_eq!((tb.len, &tb.blocks[..2]), (8, &ta.blocks[..2]));
        assert_eq!(tb.blocks.len(), 3);
        assert_eq!(kv.used_blocks(), 4, "two shared blocks count once");
        // Exactly the cached 8 tokens: the last one must be computed, so only block 0.
        let (tc, _) = admit(&mut kv, &a[..8], 4);
        assert_eq!((tc.len, tc.blocks[0]), (4, ta.blocks[0]));
        assert_ne!(tc.blocks[1], ta.blocks[1], "the block with the last prompt token is the request's own");
        // A block of the same tokens after another prefix is not a hit.
        let d: Vec<u32> = [9, 9, 9, 9].into_iter().chain(4..10).collect();
        let (td, _) = admit(&mut kv, &d, 1);
        assert_eq!(td.len, 0);
        assert_eq!(counters.query_tokens.load(Relaxed), (10 + 11 + 8 + 10) as u64);
        assert_eq!(counters.hit_tokens.load(Relaxed), 12);

        // Off: no sharing, no counting.
        let mut off = KvAllocator::new(KvPool::new(16, 4, 2, 4), 1).with_prefix_caching(false);
        let (mut t, h) = admit(&mut off, &a, 2);
        fill(&mut off, &mut t, &h, 10);
        assert_eq!((admit(&mut off, &a, 2).0.len, off.cached_blocks()), (0, 0));
    }

    #[test]
    fn cached_blocks_are_counted_by_their_holders_and_evicted_only_when_idle() {
        // 6 blocks of 4 positions.
        let mut kv = KvAllocator::new(KvPool::new(6, 4, 2, 4), 1);
        let counters = kv.prefix_cache_counters();
        let a: Vec<u32> = (0..13).collect();
        let (mut ta, ha) = admit(&mut kv, &a, 3);
        fill(&mut kv, &mut ta, &ha, 13);
        let (mut tb, _) = admit(&mut kv, &a, 3);
        assert_eq!((tb.len, kv.used_blocks()), (12, 5));
        kv.release(&mut ta);
        assert_eq!(kv.used_blocks(), 4, "the shared blocks stay held by b");
        assert_eq!(kv.free_blocks(), 2);
        kv.release(&mut tb);
        assert_eq!((kv.used_blocks(), kv.free_blocks(), kv.cached_blocks()), (0, 6, 3), "idle cached blocks count as free");
        // A request of other tokens needing the whole pool evicts them all:
        // the cache never makes an admission wait.
        let other: Vec<u32> = (100..120).collect();
        let (mut t, h) = admit(&mut kv, &other, 4);
        assert_eq!((t.blocks.len(), kv.cached_blocks(), counters.evicted_blocks.load(Relaxed)), (6, 0, 3));
        fill(&mut kv, &mut t, &h, 20);
        let blocks = t.blocks.clone();
        kv.release(&mut t);
        assert_eq!(kv.cached_blocks(), 5);
        // Two new blocks: the never-cached free one first, then one
        // eviction, which takes the prefix's tail (released last block first).
        let (mut t2, _) = admit(&mut kv, &[7, 7, 7, 7, 7], 3);
        assert_eq!((t2.blocks.len(), kv.cached_blocks(), counters.evicted_blocks.load(Relaxed)), (2, 4, 4));
        assert_eq!(kv.lookup(other.len(), h.as_slice()), blocks[..4], "the head of the prefix is still found");
        kv.release(&mut t2);
    }

    #[test]
    fn a_hit_on_an_idle_block_revives_it_and_it_is_no_longer_free() {
        let mut kv = KvAllocator::new(KvPool::new(4, 4, 2, 4), 1);
        let a: Vec<u32> = (0..9).collect();
        let (mut ta, ha) = admit(&mut kv, &a, 3);
        fill(&mut kv, &mut ta, &ha, 9);
        kv.release(&mut ta);
        assert_eq!(kv.free_blocks(), 4);
        let hashes = kv.hashes(&a);
        let hits = kv.lookup(a.len(), hashes.as_slice());
        assert_eq!(hits.len(), 2);
        // 12 positions: 3 blocks, 2 of them cached. A table of 4 new blocks
        // would not fit beside the 2 revived ones.
        assert!(kv.can_allocate(&hits, 12));
        assert!(!kv.can_allocate(&hits, 24));
        let t = kv.allocate(a.len(), &hits, 12).unwrap();
        assert_eq!((t.len, kv.free_blocks(), kv.used_blocks()), (8, 1, 3));
        assert!(kv.allocate(3, &[], 8).is_err(), "one block is free, two asked for");
    }

    /// A lease shares cached blocks too, reports them, and is taken over
    /// only for the prompt it was granted for.
    #[test]
    fn a_lease_starts_after_its_cached_prefix() {
        let mut kv = KvAllocator::new(KvPool::new(8, 4, 2, 4), 3);
        let a: Vec<u32> = (0..10).collect();
        let (mut ta, ha) = admit(&mut kv, &a, 2);
        fill(&mut kv, &mut ta, &ha, 10);
        let hashes = kv.hashes(&a);
        let hits = kv.lookup(a.len(), hashes.as_slice());
        let lease = kv.lease("l", a.clone(), a.len(), &hits, 12).unwrap();
        assert_eq!((lease.cached_tokens, &lease.blocks[..2]), (8, &ta.blocks[..2]));
        let mut other = a.clone();
        other[9] = 99;
        assert!(matches!(kv.take_lease("l", &lease, &other, 12).unwrap_err(), DecodeError::InvalidArgument(_)));
        let mut t = kv.take_lease("l", &lease, &a, 12).unwrap();
        assert_eq!(t.len, 10);
        kv.release(&mut ta);
        kv.release(&mut t);
        assert_eq!((kv.used_blocks(), kv.cached_blocks()), (0, 2));
        // A freed lease gives its shared blocks back too.
        let hits = kv.lookup(a.len(), hashes.as_slice());
        kv.lease("m", a.clone(), a.len(), &hits, 12).unwrap();
        assert_eq!(kv.used_blocks(), 3);
        assert!(kv.free_lease("m"));
        assert_eq!((kv.used_blocks(), kv.free_blocks()), (0, 8));
    }
}
