//! Live values behind a worker's `Stats` RPC. The engine thread updates them
//! as it runs; the gRPC service reads them without waiting for the engine,
//! so `Stats` answers at once even in the middle of a long prefill.

use crate::worker::WorkerStats;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering::Relaxed};

#[derive(Debug, Default)]
pub struct StatsCell {
    pub running: AtomicU32,
    pub waiting: AtomicU32,
    pub kv_blocks_used: AtomicU32,
    pub kv_blocks_total: AtomicU32,
    pub kv_block_size: AtomicU32,
    pub pool_epoch: AtomicU64,
    /// See `WorkerStats.progress`: bumped by the engine each time it moves.
    pub progress: AtomicU64,
    /// Set when the engine thread has ended (it panicked, or was shut
    /// down): the process still answers, but can serve nothing.
    pub engine_stopped: AtomicBool,
    /// Devices of two-device prefill (`WorkerStats.dslp_devices`); set once
    /// at start, 0 for none.
    pub dslp_devices: AtomicU32,
    context_length: u32,
    weights_fingerprint: String,
}

impl StatsCell {
    pub fn new(context_length: usize, weights_fingerprint: String) -> Self {
        StatsCell { context_length: context_length.min(u32::MAX as usize) as u32, weights_fingerprint, ..StatsCell::default() }
    }

    pub fn set(field: &AtomicU32, value: usize) {
        field.store(value.min(u32::MAX as usize) as u32, Relaxed);
    }

    pub fn progressed(&self) {
        self.progress.fetch_add(1, Relaxed);
    }

    pub fn snapshot(&self) -> WorkerStats {
        WorkerStats {
            running: self.running.load(Relaxed),
            waiting: self.waiting.load(Relaxed),
            kv_blocks_used: self.kv_blocks_used.load(Relaxed),
            kv_blocks_total: self.kv_blocks_total.load(Relaxed),
            kv_block_size: self.kv_block_size.load(Relaxed),
            pool_epoch: self.pool_epoch.load(Relaxed),
            context_length: self.context_length,
            weights_fingerprint: self.weights_fingerprint.clone(),
            progress: self.progress.load(Relaxed),
            dslp_devices: self.dslp_devices.load(Relaxed),
        }
    }
}
