//! Where a prompt is prefilled. Short prompts are cheap enough for the
//! decode worker to prefill in chunks between decode steps; long ones would
//! stall its batch, so the prefill worker runs them into KV blocks the
//! decode worker lends, and only the block numbers travel.

/// The two ways into the decode worker's batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PrefillPath {
    /// Chunked prefill on the decode worker.
    Decode,
    /// AllocateKv, Prefill on the prefill worker, then Decode with the lease.
    Prefill,
}

impl PrefillPath {
    /// For the `path` metric label and `Timings.prefill_path`.
    pub fn as_str(self) -> &'static str {
        match self {
            PrefillPath::Decode => "decode",
            PrefillPath::Prefill => "prefill",
        }
    }
}

/// Prompts of at least `threshold` tokens go to the prefill worker.
pub fn choose(prompt_tokens: usize, threshold: u32) -> PrefillPath {
    if prompt_tokens >= threshold as usize {
        PrefillPath::Prefill
    } else {
        PrefillPath::Decode
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn threshold_is_inclusive() {
        assert_eq!(choose(2047, 2048), PrefillPath::Decode);
        assert_eq!(choose(2048, 2048), PrefillPath::Prefill);
        assert_eq!(choose(1, 0), PrefillPath::Prefill);
    }
}
