//! Prefix caching on the bundled tiny model, without processes: the decode
//! worker's batcher and the prefill worker's engine share a KV segment, as
//! they do when served. With `f32` and greedy sampling the tokens must be
//! the same with the cache as without, on the decode worker's path and on
//! the lease path, for requests that share a prefix concurrently and under
//! eviction; a restarted pool starts with an empty cache and refuses the
//! leases of the old one.

use duplex_decode::batcher::{Admission, Batcher, Command, Limits, Prefilled, SeqEvent};
use duplex_decode::error::DecodeError;
use duplex_decode::engine::Engine;
use duplex_decode::kv_alloc::{KvAllocator, PrefixCacheCounters};
use duplex_ipc::{KvGeometry, KvSegment};
use duplex_kernels::device::emulated::{EmulatedConfig, EmulatedDevice};
use duplex_model::hybrid::{HybridConfig, HybridEngine, Submit};
use duplex_model::sampling::SamplingParams;
use duplex_model::{Model, Precision};
use duplex_prefill::engine::{Command as PrefillCommand, Engine as PrefillEngine, Job, KvSource, Lease};
use duplex_proto::stats::StatsCell;
use duplex_decode::kv_alloc::BlockLease;
use std::path::Path;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::mpsc::Sender;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::{mpsc::unbounded_channel, oneshot};


const BLOCK: usize = 16;

fn model() -> Model {
    Model::load(Path::new(duplex_model::BUNDLED_MODEL), &mut |_, _| {}).unwrap()
}

/// A decode worker (batcher) and a prefill worker (engine) over one KV
/// segment in `dir`, as `duplex serve` runs them.
struct Workers {
    decode: Sender<Command>,
    prefill: Sender<PrefillCommand>,
    counters: Arc<PrefixCacheCounters>,
    stats: Arc<StatsCell>,
    epoch: u64,
}

fn start(dir: &Path, kv_blocks: usize, prefix_caching: bool) -> Workers {
    start_with(dir, kv_blocks, prefix_caching, Placement::Cpu)
}

/// Where the decode worker runs its steps.
#[derive(Clone, Copy)]
enum Placement {
    Cpu,
    /// The hybrid placement on an emulated device: the KV of what it
    /// computes lives in device blocks.
    Hybrid,
}

fn start_with(dir: &Path, kv_blocks: usize, prefix_caching: bool, placement: Placement) -> Workers {
    let model = model();
    let name = duplex_ipc::kv_segment_name("test");
    let geometry = KvGeometry { n_blocks: kv_blocks, block_size: BLOCK, n_layers: model.cfg.num_hidden_layers, entry_dim: model.cfg.kv_entry_dim() };
    let segment = KvSegment::create(dir, &name, geometry).unwrap();
    let epoch = segment.epoch();
    let kv = KvAllocator::new(segment.into_pool(true).unwrap(), epoch).with_prefix_caching(prefix_caching);
    let counters = kv.prefix_cache_counters();
    let stats = Arc::new(StatsCell::new(1024, "test".into()));
    let limits = Limits { context_length: 1024, lease_timeout: Duration::from_secs(60), max_batch_size: 4, prefill_chunk_tokens: 40, max_waiting_requests: 64 };
    let engine = match placement {
        Placement::Cpu => Engine::Cpu(model),
        Placement::Hybrid => {
            let device = EmulatedDevice::new(EmulatedConfig { memory_bytes: 64 << 20, compute_threads: 1, ..Default::default() }).unwrap();
            let config = HybridConfig { kv_blocks: 32, micro_batches: true, defer_experts: 0, cpu_jitter: None, submit: Submit::Stream, expert_cache: None };
            Engine::Hybrid(HybridEngine::new(model, device, config, BLOCK).unwrap())
        }
    };
    let batcher = Batcher::new(engine, kv, limits, Precision::F32, stats.clone());
    let (decode, receiver) = std::sync::mpsc::channel();
    std::thread::spawn(move || batcher.run(receiver));
    let engine = PrefillEngine::new(self::model(), KvSource::new(dir.to_path_buf(), name), 24, Precision::F32, None, Arc::new(StatsCell::new(1024, "test".into())));
    let (prefill, receiver) = std::sync::mpsc::channel();
    std::thread::spawn(move || engine.run(receiver));
    Workers { decode, prefill, counters, stats, epoch }
}

fn greedy() -> SamplingParams {
    SamplingParams { seed: Some(1), ..SamplingParams::greedy() }
}

/// A prompt of `len` tokens that `seed` makes distinct.
fn tokens(seed: u32, len: usize) -> Vec<u32> {
    (0..len as u32).map(|i| 50 + (i * 31 + seed * 97) % 1400).collect()
}

fn admission(id: &str, prompt: &[u32], max_tokens: usize, prefilled: Option<Prefilled>) -> (Box<Admission>, tokio::sync::mpsc::UnboundedReceiver<SeqEvent>) {
    let (events, receiver) = unbounded_channel();
    let a = Admission {
        request_id: id.into(),
        prompt: prompt.to_vec(),
        sampling: greedy(),
        max_tokens,
        stop_token_ids: Default::default(),
        prefilled,
        constraint: None,
        events,
        arrived: Instant::now(),
    };
    (Box::new(a), receiver)
}

/// Every token of a stream, or the error that ended it.
fn drain(mut events: tokio::sync::mpsc::UnboundedReceiver<SeqEvent>) -> Result<Vec<u32>, DecodeError> {
    let mut out = vec![];
    loop {
        match events.blocking_recv().expect("the stream ends with its last token or an error") {
            SeqEvent::Token { token, finish } => {
                out.push(token.id);
                if finish.is_some() {
                    return Ok(out);
                }
            }
            SeqEvent::Failed(e) => return Err(e),
        }
    }
}

impl Workers {
    /// A request prefilled and decoded on the decode worker; its tokens.
    fn generate(&self, id: &str, prompt: &[u32], max_tokens: usize) -> Vec<u32> {
        self.send(id, prompt, max_tokens).recv().unwrap()
    }

    /// Start one; its tokens arrive on the returned channel.
    fn send(&self, id: &str, prompt: &[u32], max_tokens: usize) -> std::sync::mpsc::Receiver<Vec<u32>> {
        let (a, events) = admission(id, prompt, max_tokens, None);
        self.decode.send(Command::Admit(a)).unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || tx.send(drain(events).unwrap()));
        rx
    }

    fn lease(&self, id: &str, prompt: &[u32], max_tokens: usize) -> Result<BlockLease, DecodeError> {
        let (reply, answer) = oneshot::channel();
        self.decode.send(Command::AllocateKv { request_id: id.into(), tokens: prompt.len(), prompt: prompt.to_vec(), max_tokens, reply }).unwrap();
        answer.blocking_recv().unwrap()
    }

    /// The router's long-prompt path: AllocateKv, Prefill into the lease,
    /// then Decode taking the lease over. The first token and the rest.
    fn generate_leased(&self, id: &str, prompt: &[u32], max_tokens: usize) -> (BlockLease, Vec<u32>) {
        let lease = self.lease(id, prompt, max_tokens).unwrap();
        let (reply, answer) = oneshot::channel();
        let job_lease = Lease { pool_epoch: lease.pool_epoch, blocks: lease.blocks.clone(), cached_tokens: lease.cached_tokens };
        let job = Job { request_id: id.into(), prompt: prompt.to_vec(), sampling: greedy(), lease: job_lease, max_tokens, stop_token_ids: Default::default(), constraint: None, reply, arrived: Instant::now(), dslp_routed: false };
        self.prefill.send(PrefillCommand::Prefill(Box::new(job))).unwrap();
        let first_token = answer.blocking_recv().unwrap().unwrap().token;
        let mut out = vec![first_token.id];
        let (a, events) = admission(id, prompt, max_tokens, Some(Prefilled { lease: lease.clone(), first_token }));
        self.decode.send(Command::Admit(a)).unwrap();
        out.extend(drain(events).unwrap());
        (lease, out)
    }

    /// Every block free or idle in the cache, once the last requests leave.
    fn wait_until_all_free(&self) {
        let deadline = Instant::now() + Duration::from_secs(20);
        while self.stats.kv_blocks_used.load(Relaxed) != 0 {
            assert!(Instant::now() < deadline, "{} KV blocks still used", self.stats.kv_blocks_used.load(Relaxed));
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    fn hits(&self) -> u64 {
        self.counters.hit_tokens.load(Relaxed)
    }
}

fn chat_turn(history: &[u32], answer: &[u32], seed: u32) -> Vec<u32> {
    history.iter().chain(answer).copied().chain(tokens(seed, 9)).collect()
}

/// A chat resent turn by turn: each prompt is the last prompt, its answer
/// and a new message. The answers with the cache are those without, and
/// the cache serves the whole written history, the answer's full blocks
/// included.
#[test]
fn a_chat_gets_the_same_tokens_with_and_without_the_cache_on_the_decode_path() {
    chat_on_the_decode_path(Placement::Cpu);
}

/// The same with the hybrid placement, whose steps write the KV into
/// device blocks: the full ones are copied back to the host for the cache,
/// so the next turn finds the answer as on the CPU engine.
#[test]
fn a_chat_gets_the_same_tokens_with_and_without_the_cache_on_the_hybrid_placement() {
    chat_on_the_decode_path(Placement::Hybrid);
}

fn chat_on_the_decode_path(placement: Placement) {
    let (dir_on, dir_off) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let (on, off) = (start_with(dir_on.path(), 64, true, placement), start_with(dir_off.path(), 64, false, placement));
    let mut prompt = tokens(1, 40);
    for turn in 0..3 {
        let hits_before = on.hits();
        let answer = on.generate(&format!("on-{turn}"), &prompt, 20);
        assert_eq!(answer, off.generate(&format!("off-{turn}"), &prompt, 20), "turn {turn}");
        if turn > 0 {
            // The previous turn wrote its prompt and all but its last
            // token's KV: every full block of that is found.
            let written = prompt.len() - 9 - 1;
            assert_eq!(on.hits() - hits_before, (written / BLOCK * BLOCK) as u64, "turn {turn}");
        }
        prompt = chat_turn(&prompt, &answer, turn + 10);
    }
    assert_eq!(off.hits(), 0);
    assert!(on.counters.query_tokens.load(Relaxed) > on.hits());
}

/// The same on the lease path: the prefill worker starts after the cached
/// prefix, and writes none of its blocks.
#[test]
fn a_chat_gets_the_same_tokens_with_and_without_the_cache_on_the_lease_path() {
    let (dir_on, dir_off) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let (on, off) = (start(dir_on.path(), 64, true), start(dir_off.path(), 64, false));
    let mut prompt = tokens(2, 50);
    for turn in 0..3 {
        let (lease, answer) = on.generate_leased(&format!("on-{turn}"), &prompt, 12);
        let (plain, expected) = off.generate_leased(&format!("off-{turn}"), &prompt, 12);
        assert_eq!(answer, expected, "turn {turn}");
        assert_eq!(plain.cached_tokens, 0);
        if turn > 0 {
            // The blocks the prefill worker wrote are cached (the output is
            // only on the CPU path, which the decode worker also takes here).
            assert!(lease.cached_tokens as usize >= (prompt.len() - 9 - 1) / BLOCK * BLOCK, "turn {turn}: {}", lease.cached_tokens);
            assert_eq!(lease.cached_tokens as usize % BLOCK, 0);
        }
        // Leased and decode-path requests share one cache.
        let again = on.generate(&format!("again-{turn}"), &prompt, 12);
        assert_eq!(again, expected, "turn {turn}, decode path after the lease");
        prompt = chat_turn(&prompt, &answer, turn + 20);
    }
}

/// Requests that share a prefix, admitted together and while the prefix is
/// cached and held: the tokens of each are those it gets alone without the
/// cache.
#[test]
fn concurrent_requests_sharing_a_prefix() {
    let (dir_on, dir_off) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let (on, off) = (start(dir_on.path(), 96, true), start(dir_off.path(), 96, false));
    let system = tokens(3, 70);
    let prompts: Vec<Vec<u32>> = (0..6).map(|i| system.iter().copied().chain(tokens(30 + i, 5 + i as usize * 3)).collect()).collect();
    let expected: Vec<Vec<u32>> = prompts.iter().enumerate().map(|(i, p)| off.generate(&format!("off-{i}"), p, 16)).collect();
    // First all at once (none cached yet), then again while others run.
    for round in 0..2 {
        let pending: Vec<_> = prompts.iter().enumerate().map(|(i, p)| on.send(&format!("r{round}-{i}"), p, 16)).collect();
        for (i, rx) in pending.into_iter().enumerate() {
            assert_eq!(rx.recv().unwrap(), expected[i], "round {round}, request {i}");
        }
    }
    assert!(on.hits() >= 6 * 64, "the second round finds the 64-token shared prefix: {} tokens hit", on.hits());
    on.wait_until_all_free();
}

/// A pool too small to keep everything: requests still run (idle cached
/// blocks are taken), and what the cache still holds after the evictions is
/// right (an evicted-and-reused block found under its old hash would give
/// other tokens).
#[test]
fn eviction_under_pressure_keeps_admission_going_and_tokens_right() {
    let (dir_on, dir_off) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    // 14 blocks; each request needs 4 (40 prompt + 20 output positions).
    let (on, off) = (start(dir_on.path(), 14, true), start(dir_off.path(), 14, false));
    let prompts: Vec<Vec<u32>> = (0..8).map(|i| tokens(100 + i, 40)).collect();
    let expected: Vec<Vec<u32>> = prompts.iter().enumerate().map(|(i, p)| off.generate(&format!("off-{i}"), p, 20)).collect();
    for round in 0..3 {
        // Three at a time: 12 of the 14 blocks held, the rest of the cache evicted.
        for (chunk_no, chunk) in prompts.chunks(3).enumerate() {
            let pending: Vec<_> = chunk.iter().enumerate().map(|(i, p)| on.send(&format!("r{round}-{chunk_no}-{i}"), p, 20)).collect();
            for (i, rx) in pending.into_iter().enumerate() {
                assert_eq!(rx.recv().unwrap(), expected[chunk_no * 3 + i], "round {round}, request {}", chunk_no * 3 + i);
            }
        }
        // And the last one again at once, from whatever is left of it.
        assert_eq!(on.generate(&format!("r{round}-last"), &prompts[7], 20), expected[7]);
    }
    assert!(on.counters.evicted_blocks.load(Relaxed) > 0, "the pool was too small to keep everything");
    assert!(on.hits() > 0);
    on.wait_until_all_free();
}

/// A decode worker restart: the new pool (a new epoch) starts with no cache,
/// and a lease of the old pool is refused by both workers.
#[test]
fn a_restarted_pool_starts_empty_and_refuses_old_leases() {
    let dir = tempfile::tempdir().unwrap();
    let prompt = tokens(4, 60);
    let before = start(dir.path(), 32, true);
    let (_, expected) = before.generate_leased("warm", &prompt, 8);
    let old = before.lease("old", &prompt, 8).unwrap();
    assert_eq!(old.cached_tokens, 48);
    drop(before);

    // The same segment name, made again: a new epoch, nothing cached.
    let after = start(dir.path(), 32, true);
    assert_ne!(after.epoch, old.pool_epoch);
    let (fresh, tokens_after) = after.generate_leased("fresh", &prompt, 8);
    assert_eq!((fresh.cached_tokens, after.hits()), (0, 0));
    assert_eq!(tokens_after, expected);
    // The old lease: the prefill worker refuses it, and so does Decode.
    let (reply, answer) = oneshot::channel();
    let old_lease = Lease { pool_epoch: old.pool_epoch, blocks: old.blocks.clone(), cached_tokens: old.cached_tokens };
    let job = Job { request_id: "old".into(), prompt: prompt.clone(), sampling: greedy(), lease: old_lease, max_tokens: 8, stop_token_ids: Default::default(), constraint: None, reply, arrived: Instant::now(), dslp_routed: false };
    after.prefill.send(PrefillCommand::Prefill(Box::new(job))).unwrap();
    assert!(matches!(answer.blocking_recv().unwrap().unwrap_err(), duplex_prefill::engine::PrefillError::StaleLease(_)));
    let first_token = duplex_model::sampling::SampledToken { id: 7, logprob: 0.0, top_logprobs: vec![] };
    let (a, events) = admission("old", &prompt, 8, Some(Prefilled { lease: old, first_token }));
    after.decode.send(Command::Admit(a)).unwrap();
    assert!(matches!(drain(events).unwrap_err(), DecodeError::FailedPrecondition(_)));
    // The new pool's cache works from here.
    let (again, _) = after.generate_leased("again", &prompt, 8);
    assert_eq!(again.cached_tokens, 48);
}
