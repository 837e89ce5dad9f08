//! What runs the decode worker's steps: the CPU engine, or the hybrid
//! placement (attention and the rest on an accelerator, routed experts on
//! the CPU, two micro-batches overlapped; `duplex_model::hybrid`).

use duplex_model::hybrid::{AdmitError, DeviceSeq, HybridEngine, HybridTimings};
use duplex_model::model::ForwardError;
use duplex_model::{BlockTable, ForwardTimings, KvPool, Logits, Model, Precision, SeqInput};
use duplex_kernels::device::DeviceError;
use std::ops::Range;
use std::time::Duration;

// One per worker, built once: the size of its variants does not matter.
#[allow(clippy::large_enum_variant)]
pub enum Engine {
    Cpu(Model),
    Hybrid(HybridEngine),
}

/// Where one step's time went.
#[derive(Debug)]
pub enum StepTimings {
    /// CPU engine: attention and FFN time.
    Cpu(ForwardTimings),
    /// Hybrid placement: CPU MoE, waits, device time, micro-batch sizes.
    Hybrid(HybridTimings),
}

impl Engine {
    pub fn model(&self) -> &Model {
        match self {
            Engine::Cpu(m) => m,
            Engine::Hybrid(h) => &h.model,
        }
    }

    pub fn describe(&self) -> String {
        match self {
            Engine::Cpu(_) => "the CPU".into(),
            Engine::Hybrid(h) => {
                let b = h.budget();
                let experts = match h.expert_cache() {
                    Some(c) => {
                        let cfg = c.config();
                        format!(
                            "an expert cache of {} routed experts ({:.1} MiB; assignment {}, prefetch {}, policy {}; steps host-driven)",
                            cfg.experts,
                            b.experts as f64 / (1 << 20) as f64,
                            cfg.assignment,
                            cfg.prefetch,
                            cfg.policy
                        )
                    }
                    None => "routed experts on the CPU".into(),
                };
                format!(
                    "{} (hybrid: {:.1} MiB of resident weights, {} device KV blocks; {experts})",
                    h.device().describe(),
                    (b.total() - b.kv - b.experts) as f64 / (1 << 20) as f64,
                    h.kv().total_blocks()
                )
            }
        }
    }

    /// Device KV blocks a sequence of `positions` needs and the pool's
    /// total, when there is a device pool.
    pub fn device_need(&self, positions: usize) -> Option<(usize, usize)> {
        match self {
            Engine::Cpu(_) => None,
            Engine::Hybrid(h) => Some((h.kv().blocks_for(positions).max(1), h.kv().total_blocks())),
        }
    }

    /// Device blocks in use and in all (none on the CPU).
    pub fn device_blocks(&self) -> Option<(usize, usize)> {
        match self {
            Engine::Cpu(_) => None,
            Engine::Hybrid(h) => Some((h.kv().total_blocks() - h.kv().free_blocks(), h.kv().total_blocks())),
        }
    }

    /// Give a sequence about to run its device blocks, copying in what its
    /// host table holds (nothing to do on the CPU).
    pub fn admit(&mut self, host: &KvPool, table: &BlockTable, positions: usize) -> Result<Option<DeviceSeq>, AdmitError> {
        match self {
            Engine::Cpu(_) => Ok(None),
            Engine::Hybrid(h) => h.admit(host, table, positions).map(Some),
        }
    }

    /// Make the host blocks `blocks` of `table` hold what the steps wrote,
    /// for the prefix cache: the CPU engine writes them itself; the hybrid
    /// placement copies them back from the sequence's device blocks.
    pub fn write_back(&mut self, host: &mut KvPool, table: &BlockTable, seq: Option<&DeviceSeq>, blocks: Range<usize>) -> Result<(), DeviceError> {
        match (self, seq) {
            (Engine::Cpu(_), _) => Ok(()),
            (Engine::Hybrid(h), Some(seq)) => h.write_back(host, table, seq, blocks),
            (Engine::Hybrid(_), None) => Err(DeviceError::Invalid("a running sequence without device KV blocks".into())),
        }
    }

    /// Give a sequence's device blocks back, if it holds any.
    pub fn release(&mut self, seq: Option<DeviceSeq>) {
        if let (Engine::Hybrid(h), Some(seq)) = (self, seq) {
            if let Err(e) = h.release(seq) {
                tracing::error!("releasing device KV blocks: {e}");
            }
        }
    }

    /// One step over `seqs`; `device` holds each one's device blocks (in
    /// the hybrid placement every running sequence has them).
    pub fn forward(&mut self, pool: &mut KvPool, seqs: &mut [SeqInput], device: &[Option<&DeviceSeq>], p: Precision) -> Result<(Vec<f32>, StepTimings), ForwardError> {
        match self {
            Engine::Cpu(m) => {
                let mut t = ForwardTimings::default();
                let logits = m.forward_batch(pool, seqs, p, Logits::Last, &mut t)?;
                Ok((logits, StepTimings::Cpu(t)))
            }
            Engine::Hybrid(h) => {
                let device: Vec<&DeviceSeq> = device
                    .iter()
                    .map(|d| d.ok_or_else(|| ForwardError::BadModule("a running sequence without device KV blocks".into())))
                    .collect::<Result<_, _>>()?;
                let (logits, t) = h.forward(pool, seqs, &device, p, Logits::Last)?;
                Ok((logits, StepTimings::Hybrid(t)))
            }
        }
    }
}

impl StepTimings {
    /// max(device busy, CPU MoE) ÷ the step's time: how well the two sides
    /// overlapped, where the device reports its busy time.
    pub fn overlap(&self, step: Duration) -> Option<f64> {
        let StepTimings::Hybrid(h) = self else { return None };
        let busy = h.device_busy?;
        (step > Duration::ZERO).then(|| busy.max(h.cpu_moe).as_secs_f64() / step.as_secs_f64())
    }
}
