//! Distributed stream-loading prefill (DSLP, §3.2 of the cloud-grade-SLO
//! paper): one prompt on two (or more) accelerators at once, with zig-zag
//! context parallelism for attention and SmallEP for the routed experts
//! (the split itself is [`duplex_model::ranked`]).
//!
//! Each rank is an [`SlpEngine`] of its own: its loader streams the modules
//! it runs (every dense module, its share of each layer's experts, the LM
//! head where its logits are wanted) from the one shared host segment into
//! its own device, and its model thread runs them on its share of the
//! tokens. The ranks meet only at the exchange's collectives (per layer: the
//! KV entries, then SmallEP's all-gather and all-to-all), through the host:
//! there is no peer-to-peer path. Rank 0 runs on the caller's thread, the
//! others on threads of their own; a failure or a cancel on one rank aborts
//! the exchange, so no rank waits for another that will not come.

use crate::slp::{SlpConfig, SlpEngine, SlpError, SlpReport};
use duplex_kernels::device::{Device, StreamId, StreamKind};
use duplex_model::ranked::{self, Exchange, LayerExchange, RankStreams, RankedPass, ZigZag};
use duplex_model::model::ForwardError;
use duplex_model::{BlockTable, KvPool, Logits, Model, Precision};
use std::sync::{Arc, Mutex};

/// What a two-device prefill did: each rank's streaming, and the traffic
/// between the ranks per layer.
#[derive(Clone, Debug, Default)]
pub struct DslpReport {
    pub ranks: Vec<SlpReport>,
    pub exchange: Vec<LayerExchange>,
}

impl DslpReport {
    /// Bytes the ranks exchanged in all, by kind: KV, SmallEP's all-gather
    /// and all-to-all, and what classic expert parallelism would have moved.
    pub fn bytes(&self) -> (u64, u64, u64, u64) {
        self.exchange.iter().fold((0, 0, 0, 0), |(k, g, r, s), l| (k + l.kv_bytes, g + l.gather_bytes, r + l.reduce_bytes, s + l.standard_ep_bytes))
    }
}

/// One SLP engine per device; rank `r` is device `r`.
pub struct DslpEngine {
    ranks: Vec<SlpEngine>,
    /// Per rank, the stream its KV entries are downloaded on for the exchange.
    copies: Vec<StreamId>,
}

impl DslpEngine {
    /// An engine over `devices` (at least two), each streaming with `config`.
    pub fn new(model: &Model, devices: Vec<Arc<dyn Device>>, config: SlpConfig) -> Result<Self, SlpError> {
        if devices.len() < 2 {
            return Err(SlpError::Config(format!("two-device prefill needs at least two devices, {} given", devices.len())));
        }
        let e = model.cfg.n_routed_experts;
        if e > 0 && e < devices.len() {
            return Err(SlpError::Config(format!("{e} routed experts cannot be shared by {} devices", devices.len())));
        }
        let copies = devices.iter().map(|d| d.create_stream(StreamKind::Copy)).collect::<Result<_, _>>()?;
        let ranks = devices.into_iter().map(|d| SlpEngine::new(model, d, config.clone())).collect::<Result<_, _>>()?;
        Ok(DslpEngine { ranks, copies })
    }

    pub fn ranks(&self) -> usize {
        self.ranks.len()
    }

    /// The first device's engine, for prompts that run on one device.
    pub fn single(&self) -> &SlpEngine {
        &self.ranks[0]
    }

    pub fn describe(&self) -> String {
        self.ranks.iter().map(|r| r.describe()).collect::<Vec<_>>().join(" + ")
    }

    /// Whether a prompt of `tokens` new tokens can be split: every rank
    /// needs a token in each of its two chunks.
    pub fn accepts(&self, tokens: usize) -> bool {
        tokens >= 2 * self.ranks.len()
    }

    /// Prefill `tokens` into `table`'s blocks of `pool` on every device and
    /// return the logits (the last token's for [`Logits::Last`], every
    /// token's in order for [`Logits::All`]). `should_stop` is asked
    /// between modules.
    #[allow(clippy::too_many_arguments)]
    pub fn run(
        &self,
        model: &Model,
        pool: &mut KvPool,
        table: &mut BlockTable,
        tokens: &[u32],
        precision: Precision,
        want: Logits,
        should_stop: &mut dyn FnMut() -> bool,
    ) -> Result<(Vec<f32>, DslpReport), SlpError> {
        let split = ZigZag::new(table.len, tokens.len(), self.ranks.len(), model.cfg.n_routed_experts)?;
        let end = table.len + tokens.len();
        if end > model.cfg.max_position_embeddings {
            return Err(ForwardError::TooLong { pos: end, max: model.cfg.max_position_embeddings }.into());
        }
        pool.reserve(table, end).map_err(ForwardError::from)?;
        let layers = model.cfg.num_hidden_layers;
        let exchange = Exchange::new(split.clone(), pool, table.clone(), layers);
        // The first failure that was not merely another rank's.
        let cause: Mutex<Option<SlpError>> = Mutex::new(None);
        let rank = |r: usize, should_stop: &mut dyn FnMut() -> bool| -> Option<(Vec<f32>, SlpReport)> {
            let result = self.run_rank(model, r, &exchange, tokens, precision, want, should_stop);
            match result {
                Ok(done) => Some(done),
                Err(e) => {
                    let mut cause = cause.lock().unwrap_or_else(|e| e.into_inner());
                    // Ranks stopped by another's failure say only that (or
                    // that they were cancelled): the first failure is the cause.
                    if !exchange.aborted() {
                        exchange.abort(&e.to_string());
                        *cause = Some(e);
                    }
                    None
                }
            }
        };
        let results: Vec<Option<(Vec<f32>, SlpReport)>> = std::thread::scope(|scope| {
            let (rank, exchange) = (&rank, &exchange);
            // The ranks start at the caller's virtual time (simulator).
            let started = duplex_kernels::clock::Stamp::now();
            let others: Vec<_> = (1..self.ranks.len())
                .map(|r| {
                    scope.spawn(move || {
                        started.join();
                        rank(r, &mut || exchange.aborted())
                    })
                })
                .collect();
            let first = rank(0, &mut || should_stop() || exchange.aborted());
            let mut all = vec![first];
            for h in others {
                all.push(h.join().unwrap_or_else(|_| {
                    exchange.abort("a rank's thread panicked");
                    None
                }));
            }
            all
        });
        let report_layers = exchange.layers();
        drop(exchange);
        if results.iter().any(Option::is_none) {
            let cause = cause.into_inner().unwrap_or_else(|e| e.into_inner());
            return Err(cause.unwrap_or_else(|| SlpError::Audit("a rank stopped without saying why".into())));
        }
        let (logits, ranks): (Vec<Vec<f32>>, Vec<SlpReport>) = results.into_iter().flatten().unzip();
        let vocab = model.cfg.vocab_size;
        let logits = match want {
            Logits::All => split.merge_logits(&logits, vocab),
            Logits::Last => {
                let (r, row) = split.last_token();
                logits[r].get(row * vocab..(row + 1) * vocab).ok_or_else(|| SlpError::Audit("the last token's rank returned no logits".into()))?.to_vec()
            }
        };
        table.len = end;
        Ok((logits, DslpReport { ranks, exchange: report_layers }))
    }

    /// Rank `r`'s share: stream its modules and run them on its tokens.
    #[allow(clippy::too_many_arguments)]
    fn run_rank(&self, model: &Model, r: usize, exchange: &Exchange, tokens: &[u32], precision: Precision, want: Logits, should_stop: &mut dyn FnMut() -> bool) -> Result<(Vec<f32>, SlpReport), SlpError> {
        let engine = &self.ranks[r];
        let kv_bytes = engine.config().attention_kv_bytes;
        let split = exchange.split();
        let bytes = ranked::workspace_bytes(model, split, r, want, kv_bytes)?;
        let dev = &**engine.device();
        let table = exchange.table();
        // SmallEP runs each expert on every rank's rows: the ring is sized
        // as for the whole prompt.
        engine.stream(
            tokens.len(),
            bytes,
            should_stop,
            |workspace| Ok(RankedPass::new(model, dev, RankStreams { compute: engine.compute_stream(), copies: self.copies[r] }, r, exchange, &table, tokens, precision, want, workspace, kv_bytes)?),
            |pass, kind, w| pass.run(kind, w),
            |pass| Ok(pass.finish(want)?),
            &|kind| split.runs(r, kind, want),
        )
    }
}
