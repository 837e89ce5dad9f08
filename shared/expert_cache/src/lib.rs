//! Which routed experts the decode device caches, and where each activated
//! expert of a layer runs: the decisions of a GPU expert cache over
//! CPU-resident experts (HybriMoE, DALI; summaries in `shared/papers.md`).
//!
//! Everything here is a pure decision over token counts, router scores and
//! profiled costs, cheap enough to run per layer and per step; the hybrid
//! placement (`duplex-model`'s `hybrid`) owns the device memory, the copies
//! and the clocks, and applies the decisions.
//!
//! - [`policy`]: replacement policies (MRS, the workload-aware window, LRU, LFU).
//! - [`assign`]: per-layer CPU/device assignment of the activated experts
//!   (static, HybriMoE's timeline simulation, DALI's greedy).
//! - [`prefetch`]: which experts to copy ahead from predicted loads
//!   (HybriMoE's impact-driven choice, DALI's top-PS).
//! - [`trace`]: synthetic routing traces with the properties the papers
//!   report, to compare policies where real traces cannot be had.

pub mod assign;
pub mod policy;
pub mod prefetch;
pub mod trace;

/// One activated routed expert of a layer in a step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Active {
    pub expert: usize,
    /// Tokens routed to it this step.
    pub tokens: usize,
    /// Whether its weights are in the device cache now.
    pub cached: bool,
}

/// What one routed expert costs where, profiled at warm-up (seconds).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CostModel {
    /// On the CPU: `cpu_fixed + cpu_per_token · tokens` (linear in tokens).
    pub cpu_fixed: f64,
    pub cpu_per_token: f64,
    /// On the device: `device_fixed + device_per_token · tokens` (about constant).
    pub device_fixed: f64,
    pub device_per_token: f64,
    /// Copying one expert's three matrices to the device (constant).
    pub transfer: f64,
}

impl CostModel {
    pub fn cpu(&self, tokens: usize) -> f64 {
        self.cpu_fixed + self.cpu_per_token * tokens as f64
    }

    pub fn device(&self, tokens: usize) -> f64 {
        self.device_fixed + self.device_per_token * tokens as f64
    }
}
