//! Allocation of the shared KV pool, which the decode worker owns.
//!
//! Sequences reserve blocks as they are admitted. For a long prompt the
//! router first takes a *lease*: blocks reserved under the request's id and
//! lent to the prefill worker, which writes the prompt's KV into them in
//! place. A lease holds the request's whole need (prompt plus `max_tokens`,
//! within the context), as any admission does, and no more: admission takes
//! it over only for the same prompt length and need, so no request holds
//! more KV than its own prompt and output can fill. A lease that is never
//! admitted is freed by `FreeKv` (or `Cancel`), or, should its router vanish
//! without either, when it expires. Leases carry the pool's epoch, so one
//! granted before a restart of this worker is refused afterwards.

use crate::error::DecodeError;
use duplex_model::kv_cache::KvError;
use duplex_model::{BlockTable, KvPool};
use duplex_proto::worker::KvLease;
use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

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
}

struct Lease {
    table: BlockTable,
    /// Prompt tokens the lease is for.
    tokens: usize,
    /// Positions reserved: prompt plus `max_tokens`, within the context.
    positions: usize,
    granted: Instant,
}

/// How many early frees are remembered (request ids are unique, and the
/// allocation they overtake arrives within moments).
const FREED_EARLY_MAX: usize = 1024;

impl KvAllocator {
    pub fn new(pool: KvPool, epoch: u64) -> Self {
        KvAllocator { pool, epoch, leases: HashMap::new(), freed_early: VecDeque::new() }
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
    /// `request_id`; fails while the pool is short, taking nothing.
    pub fn lease(&mut self, request_id: &str, tokens: usize, positions: usize) -> Result<KvLease, KvError> {
        debug_assert!(0 < tokens && tokens <= positions);
        let mut table = BlockTable::default();
        self.pool.reserve(&mut table, positions)?;
        let lease = KvLease { pool_epoch: self.epoch, request_id: request_id.to_string(), blocks: table.blocks.clone() };
        self.leases.insert(request_id.to_string(), Lease { table, tokens, positions, granted: Instant::now() });
        Ok(lease)
    }

    /// Free a lease that will not be admitted; false if there is none (and
    /// then a lease asked for later under this id is refused).
    pub fn free_lease(&mut self, request_id: &str) -> bool {
        match self.leases.remove(request_id) {
            Some(mut lease) => {
                self.pool.release(&mut lease.table);
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

    /// Take over the lease of `request_id`, whose first `filled` positions
    /// (the prompt) the prefill worker has written, for a sequence that
    /// needs `positions` positions in all. The lease must be for exactly
    /// that prompt and need: one made for less would have to grow here,
    /// where the pool may be short, and one made for more would hold blocks
    /// the sequence never uses.
    pub fn take_lease(&mut self, request_id: &str, lease: &KvLease, filled: usize, positions: usize) -> Result<BlockTable, DecodeError> {
        if lease.pool_epoch != self.epoch {
            return Err(DecodeError::FailedPrecondition(format!(
                "KV lease of request {request_id} is from pool epoch {}, but the pool is now epoch {} (the decode worker restarted)",
                lease.pool_epoch, self.epoch
            )));
        }
        match self.leases.get(request_id) {
            None => return Err(DecodeError::FailedPrecondition(format!("request {request_id} holds no KV lease"))),
            Some(held) if held.table.blocks != lease.blocks => {
                return Err(DecodeError::InvalidArgument(format!("KV lease of request {request_id} does not match the blocks granted")))
            }
            Some(held) if (held.tokens, held.positions) != (filled, positions) => {
                return Err(DecodeError::InvalidArgument(format!(
                    "KV lease of request {request_id} is for a prompt of {} tokens and {} positions in all, but the request has {filled} prompt tokens and needs {positions} positions (prompt plus max_tokens)",
                    held.tokens, held.positions
                )))
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

    pub fn reserve(&mut self, table: &mut BlockTable, len: usize) -> Result<(), KvError> {
        self.pool.reserve(table, len)
    }

    pub fn release(&mut self, table: &mut BlockTable) {
        self.pool.release(table);
    }

    pub fn blocks_for(&self, positions: usize) -> usize {
        positions.div_ceil(self.pool.block_size())
    }

    pub fn used_blocks(&self) -> usize {
        self.pool.total_blocks() - self.pool.free_blocks()
    }

    pub fn free_blocks(&self) -> usize {
        self.pool.free_blocks()
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
        assert_eq!(kv.lease("b", 16, 16).unwrap().blocks.len(), 1);
    }

    #[test]
    fn leases_are_granted_taken_over_and_freed() {
        let mut kv = KvAllocator::new(KvPool::new(8, 16, 2, 4), 7);
        // A 40-token prompt with up to 8 tokens of output: 48 positions, 3 blocks.
        let lease = kv.lease("a", 40, 48).unwrap();
        assert_eq!((lease.blocks.len(), lease.pool_epoch, kv.used_blocks()), (3, 7, 3));
        assert!(matches!(kv.check_lease("a").unwrap_err(), DecodeError::AlreadyExists(_)));
        assert!(kv.lease("b", 16 * 6, 16 * 6).is_err(), "only 5 blocks are free");
        assert_eq!(kv.used_blocks(), 3, "a failed lease takes nothing");

        let stale = KvLease { pool_epoch: 6, ..lease.clone() };
        assert!(matches!(kv.take_lease("a", &stale, 40, 48).unwrap_err(), DecodeError::FailedPrecondition(_)));
        let forged = KvLease { blocks: vec![5, 6, 7], ..lease.clone() };
        assert!(matches!(kv.take_lease("a", &forged, 40, 48).unwrap_err(), DecodeError::InvalidArgument(_)));
        // Another prompt length, or another need, than the lease was made for.
        assert!(matches!(kv.take_lease("a", &lease, 41, 48).unwrap_err(), DecodeError::InvalidArgument(_)));
        assert!(matches!(kv.take_lease("a", &lease, 40, 64).unwrap_err(), DecodeError::InvalidArgument(_)));
        let smaller = kv.take_lease("a", &lease, 40, 41).unwrap_err();
        assert!(smaller.to_string().contains("needs 41 positions"), "{smaller}");
        let mut table = kv.take_lease("a", &lease, 40, 48).unwrap();
        assert_eq!(table.len, 40);
        assert!(!kv.free_lease("a"), "the lease became the sequence's table");
        kv.release(&mut table);
        assert_eq!(kv.used_blocks(), 0);

        kv.lease("c", 5, 5).unwrap();
        assert!(kv.free_lease("c"));
        assert_eq!(kv.used_blocks(), 0);

        kv.lease("d", 5, 5).unwrap();
        assert!(kv.expire_leases(Duration::from_secs(60)).is_empty());
        std::thread::sleep(Duration::from_millis(5));
        assert_eq!(kv.expire_leases(Duration::from_millis(1)), ["d"]);
        assert_eq!(kv.used_blocks(), 0);
    }
}
