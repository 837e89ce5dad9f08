//! The batcher on the bundled tiny model, without processes: admission under
//! KV pressure (first come, first served, leases and sequences in one
//! bounded queue, each holding its whole need), refusal of what can never
//! fit, stop tokens, and blocks returned when a client goes away.

use duplex_decode::batcher::{Admission, Batcher, Command, Limits, Prefilled, SeqEvent};
use duplex_decode::engine::Engine;
use duplex_decode::kv_alloc::KvAllocator;
use duplex_kernels::device::emulated::{EmulatedConfig, EmulatedDevice};
use duplex_model::hybrid::{HybridConfig, HybridEngine};
use duplex_model::sampling::{SampledToken, SamplingParams};
use duplex_model::{KvPool, Model, Precision};
use duplex_proto::stats::StatsCell;
use duplex_decode::error::DecodeError;
use duplex_decode::server::status;
use duplex_decode::kv_alloc::BlockLease;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::mpsc::Sender;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};
use tokio::sync::oneshot;
use tonic::{Code, Status};

fn start(kv_blocks: usize) -> (Sender<Command>, Arc<StatsCell>) {
    start_on(kv_blocks, None)
}

/// With `device_kv_blocks`, the hybrid placement on an emulated device
/// whose KV pool has that many blocks.
fn start_on(kv_blocks: usize, device_kv_blocks: Option<usize>) -> (Sender<Command>, Arc<StatsCell>) {
    let model = Model::load(std::path::Path::new(duplex_model::BUNDLED_MODEL), &mut |_, _| {}).unwrap();
    let pool = KvPool::new(kv_blocks, 16, model.cfg.num_hidden_layers, model.cfg.kv_entry_dim());
    let stats = Arc::new(StatsCell::new(1024, "test".into()));
    let limits = Limits { context_length: 1024, lease_timeout: Duration::from_secs(60), max_batch_size: 6, prefill_chunk_tokens: 64, max_waiting_requests: 4 };
    let engine = match device_kv_blocks {
        None => Engine::Cpu(model),
        Some(blocks) => {
            let dev = EmulatedDevice::new(EmulatedConfig { memory_bytes: 64 << 20, compute_threads: 1, ..Default::default() }).unwrap();
            let config = HybridConfig { kv_blocks: blocks, micro_batches: true, defer_experts: 0, cpu_jitter: None, submit: Default::default(), expert_cache: None };
            Engine::Hybrid(HybridEngine::new(model, dev, config, 16).unwrap())
        }
    };
    // Admission alone: these requests share their prompts, and with the
    // prefix cache on how many blocks each needs would depend on whether
    // the one before had registered its first block yet (tests/prefix_cache.rs
    // tests the cache).
    let kv = KvAllocator::new(pool, 1).with_prefix_caching(false);
    let batcher = Batcher::new(engine, kv, limits, Precision::F32, stats.clone());
    let (commands, receiver) = std::sync::mpsc::channel();
    std::thread::spawn(move || batcher.run(receiver));
    (commands, stats)
}

type Events = UnboundedReceiver<SeqEvent>;

fn prompt(len: usize) -> Vec<u32> {
    (0..len as u32).map(|i| 100 + i * 7 % 1500).collect()
}

fn admit(commands: &Sender<Command>, id: &str, prompt_len: usize, max_tokens: usize, stop: &[u32]) -> Events {
    send_admission(commands, id, prompt_len, max_tokens, stop, None)
}

fn send_admission(commands: &Sender<Command>, id: &str, prompt_len: usize, max_tokens: usize, stop: &[u32], prefilled: Option<Prefilled>) -> Events {
    let (events, receiver) = unbounded_channel();
    let admission = Admission {
        request_id: id.into(),
        prompt: prompt(prompt_len),
        sampling: SamplingParams { seed: Some(1), ..SamplingParams::greedy() },
        max_tokens,
        stop_token_ids: stop.iter().copied().collect(),
        prefilled,
        constraint: None,
        events,
        arrived: Instant::now(),
    };
    commands.send(Command::Admit(Box::new(admission))).unwrap();
    receiver
}

type LeaseAnswer = oneshot::Receiver<Result<BlockLease, DecodeError>>;

/// AllocateKv as the router sends it: the prompt's length and max_tokens.
fn ask_lease(commands: &Sender<Command>, id: &str, tokens: usize, max_tokens: usize) -> LeaseAnswer {
    let (reply, answer) = oneshot::channel();
    commands.send(Command::AllocateKv { request_id: id.into(), tokens, prompt: vec![], max_tokens, reply }).unwrap();
    answer
}

/// Admit a request whose prompt "the prefill worker" ran into `lease`. (The
/// blocks hold whatever they held: these tests are about blocks, not tokens.)
fn admit_leased(commands: &Sender<Command>, id: &str, prompt_len: usize, max_tokens: usize, lease: BlockLease) -> Events {
    let first_token = SampledToken { id: 7, logprob: -1.0, top_logprobs: vec![] };
    send_admission(commands, id, prompt_len, max_tokens, &[], Some(Prefilled { lease, first_token }))
}

fn free_kv(commands: &Sender<Command>, id: &str) -> bool {
    let (reply, answer) = oneshot::channel();
    commands.send(Command::FreeKv { request_id: id.into(), reply }).unwrap();
    answer.blocking_recv().unwrap()
}

/// The answer to an AllocateKv, within a generous bound (an error as the
/// server would send it).
fn answer(lease: &mut LeaseAnswer) -> Result<BlockLease, Status> {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        match lease.try_recv() {
            Ok(answer) => return answer.map_err(status),
            Err(oneshot::error::TryRecvError::Empty) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(5)),
            Err(e) => panic!("no answer to AllocateKv: {e:?}"),
        }
    }
}

/// Still waiting a while after it was asked.
fn still_waiting(lease: &mut LeaseAnswer) -> bool {
    std::thread::sleep(Duration::from_millis(100));
    matches!(lease.try_recv(), Err(oneshot::error::TryRecvError::Empty))
}

/// Every token, then the finish reason of the last or the error (as the
/// server would send it). Nothing may follow either.
fn drain(events: &mut Events) -> (Vec<u32>, Result<String, Status>) {
    let mut tokens = vec![];
    let end = loop {
        match events.blocking_recv().expect("the stream ends with a last token or an error") {
            SeqEvent::Token { token, finish } => {
                tokens.push(token.id);
                if let Some(f) = finish {
                    break Ok(f.reason.as_str().to_string());
                }
            }
            SeqEvent::Failed(e) => break Err(status(e)),
        }
    };
    assert!(events.blocking_recv().is_none(), "nothing follows the end of a stream");
    (tokens, end)
}

fn wait_until(what: &str, pred: impl Fn() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !pred() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn requests_wait_for_blocks_in_arrival_order_and_all_finish() {
    // 10 blocks of 16; each request needs 4 (20 prompt + 40 output positions).
    let (commands, stats) = start(10);
    let mut streams: Vec<Events> = (0..3).map(|i| admit(&commands, &format!("r{i}"), 20, 40, &[])).collect();
    wait_until("two running with 8 blocks, one waiting", || {
        stats.running.load(Relaxed) == 2 && stats.waiting.load(Relaxed) == 1 && stats.kv_blocks_used.load(Relaxed) == 8
    });
    let outputs: Vec<_> = streams.iter_mut().map(drain).collect();
    for (tokens, reason) in &outputs {
        assert_eq!((tokens.len(), reason.as_deref().unwrap()), (40, "length"));
    }
    // Same prompt, same greedy tokens, whether it ran first or waited.
    assert!(outputs.windows(2).all(|w| w[0].0 == w[1].0));
    wait_until("blocks back", || stats.kv_blocks_used.load(Relaxed) == 0 && stats.running.load(Relaxed) == 0);
}

#[test]
fn a_request_that_can_never_fit_is_refused() {
    let (commands, stats) = start(10);
    let (tokens, result) = drain(&mut admit(&commands, "big", 20, 500, &[]));
    assert!(tokens.is_empty());
    let status = result.unwrap_err();
    // Not RESOURCE_EXHAUSTED: retrying would never help.
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
    assert!(status.message().contains("needs 33 KV blocks") && status.message().contains("only 10"), "{}", status.message());
    assert_eq!(stats.kv_blocks_used.load(Relaxed), 0);
}

#[test]
fn stop_tokens_end_generation_and_departed_clients_free_blocks() {
    let (commands, stats) = start(64);
    let (greedy, _) = drain(&mut admit(&commands, "a", 30, 8, &[]));
    let (tokens, reason) = drain(&mut admit(&commands, "b", 30, 8, &[greedy[2]]));
    assert_eq!(tokens, greedy[..3]);
    assert_eq!(reason.unwrap(), "stop");

    let mut gone = admit(&commands, "c", 30, 900, &[]);
    assert!(matches!(gone.blocking_recv(), Some(SeqEvent::Token { .. })));
    // The gauges are published after each step, so wait for this one's.
    wait_until("the running sequence's blocks", || stats.kv_blocks_used.load(Relaxed) > 0);
    drop(gone);
    wait_until("the departed client's blocks", || stats.kv_blocks_used.load(Relaxed) == 0 && stats.running.load(Relaxed) == 0);
}

/// The deadlock, in miniature: five long prompts on the prefill
/// path whose prompts alone fill the pool. Leases used to hold the prompt
/// only, so all five were granted and then none could be admitted for want
/// of its output's blocks. Now each lease holds its whole need (4 blocks of
/// 10), two are granted, the rest wait in line and are granted as the first
/// finish; all five run to the end and every block comes back.
#[test]
fn leases_hold_the_whole_need_so_prefilled_requests_always_finish() {
    let (commands, stats) = start(10);
    let (prompt_len, max_tokens) = (30, 34); // 64 positions: 4 blocks (the prompt alone: 2)
    let mut asks: Vec<LeaseAnswer> = (0..5).map(|i| ask_lease(&commands, &format!("p{i}"), prompt_len, max_tokens)).collect();
    let mut leases: Vec<BlockLease> = asks.drain(..2).map(|mut ask| answer(&mut ask).unwrap()).collect();
    // Two leases hold 8 of the 10 blocks; the other three wait in line.
    wait_until("three leases waiting", || stats.waiting.load(Relaxed) == 3 && stats.kv_blocks_used.load(Relaxed) == 8);
    assert!(asks.iter_mut().all(still_waiting));
    let mut streams = vec![];
    for i in 0..5 {
        if i >= 2 {
            // Granted as the earlier ones finish.
            leases.push(answer(&mut asks[i - 2]).unwrap());
        }
        let lease = leases[i].clone();
        assert_eq!(lease.blocks.len(), 4, "the lease holds prompt plus max_tokens");
        streams.push(admit_leased(&commands, &format!("p{i}"), prompt_len, max_tokens, lease));
    }
    for events in &mut streams {
        let (tokens, reason) = drain(events);
        // The prefill worker's token came with the lease; the rest from here.
        assert_eq!((tokens.len(), reason.unwrap().as_str()), (max_tokens - 1, "length"));
    }
    wait_until("every block back", || stats.kv_blocks_used.load(Relaxed) == 0 && stats.waiting.load(Relaxed) == 0);
}

/// Leases and sequences share one first-come first-served queue; it is
/// bounded, and what cannot join is refused at once with RESOURCE_EXHAUSTED;
/// freeing blocks lets the waiters in, in their order.
#[test]
fn the_queue_for_blocks_is_first_come_first_served_and_bounded() {
    let (commands, stats) = start(10);
    // A lease holding the whole pool: 100 prompt tokens + 60 = 160 positions.
    let hog = answer(&mut ask_lease(&commands, "hog", 100, 60)).unwrap();
    assert_eq!(hog.blocks.len(), 10);
    // Four wait (max_waiting_requests is 4): a lease, a sequence, two leases.
    let mut first = ask_lease(&commands, "w0", 20, 44); // 4 blocks
    let mut seq = admit(&commands, "w1", 20, 12, &[]); // 2 blocks
    let gone = ask_lease(&commands, "w2", 20, 12);
    let mut last = ask_lease(&commands, "w3", 20, 12);
    assert!(still_waiting(&mut first) && still_waiting(&mut last));
    // The fifth, lease or sequence, is refused at once.
    let full = answer(&mut ask_lease(&commands, "w4", 20, 12)).unwrap_err();
    assert_eq!(full.code(), Code::ResourceExhausted, "{full:?}");
    assert!(full.message().contains("max_waiting_requests"), "{}", full.message());
    let (_, refused) = drain(&mut admit(&commands, "w5", 20, 12, &[]));
    assert_eq!(refused.unwrap_err().code(), Code::ResourceExhausted);
    // A waiter that gave up (its router stopped waiting) and one whose lease
    // was freed while it waited hold nothing and hold back no one.
    drop(gone);
    assert!(free_kv(&commands, "w3"));
    assert_eq!(answer(&mut last).unwrap_err().code(), Code::Cancelled);
    wait_until("w0 and w1 left waiting", || stats.waiting.load(Relaxed) == 2);

    // Freeing the hog lets the rest in, in order: w0's 4 blocks, w1's 2.
    assert!(free_kv(&commands, "hog"));
    let lease = answer(&mut first).unwrap();
    assert_eq!(lease.blocks.len(), 4);
    let (tokens, reason) = drain(&mut seq);
    assert_eq!((tokens.len(), reason.unwrap().as_str()), (12, "length"));
    assert!(free_kv(&commands, "w0"));
    wait_until("every block back", || stats.kv_blocks_used.load(Relaxed) == 0 && stats.waiting.load(Relaxed) == 0);
}

/// One request cannot hold more KV than its own prompt and output need: a
/// lease is sized by the worker from the prompt and max_tokens, a need the
/// pool could never hold is refused at once (not queued for ever), and a
/// lease is taken over only by the request it was made for.
#[test]
fn a_lease_is_the_requests_own_need_and_no_more() {
    let (commands, stats) = start(10);
    // max_tokens past the context is capped by it: 1024 positions, 64 blocks > 10.
    let never = answer(&mut ask_lease(&commands, "big", 20, 5000)).unwrap_err();
    assert_eq!(never.code(), Code::InvalidArgument, "{never:?}");
    assert!(never.message().contains("needs 64 KV blocks"), "{}", never.message());
    for (tokens, max_tokens, what) in [(0, 10, "prompt token"), (20, 0, "max_tokens"), (1024, 1, "context length")] {
        let status = answer(&mut ask_lease(&commands, "bad", tokens, max_tokens)).unwrap_err();
        assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
        assert!(status.message().contains(what), "{}", status.message());
    }
    assert_eq!(stats.kv_blocks_used.load(Relaxed), 0);

    let lease = answer(&mut ask_lease(&commands, "a", 20, 12)).unwrap();
    assert_eq!(lease.blocks.len(), 2, "32 positions");
    // Admitted with more output than the lease was made for: refused (it
    // would need blocks the lease does not hold); with less: refused too
    // (the lease would hold blocks it never uses).
    for max_tokens in [40, 4] {
        let (_, result) = drain(&mut admit_leased(&commands, "a", 20, max_tokens, lease.clone()));
        let status = result.unwrap_err();
        assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
        assert!(status.message().contains("lease"), "{}", status.message());
    }
    let (tokens, reason) = drain(&mut admit_leased(&commands, "a", 20, 12, lease));
    assert_eq!((tokens.len(), reason.unwrap().as_str()), (11, "length"));
    wait_until("every block back", || stats.kv_blocks_used.load(Relaxed) == 0);
}

/// A decode worker whose engine thread has ended (a panic, say) still
/// answers gRPC, but can serve nothing: its Stats fails from then on, so the
/// router's health reports it down instead of ready.
#[test]
fn stats_fail_once_the_engine_has_stopped() {
    use duplex_proto::worker::decode_worker_server::DecodeWorker;
    let (commands, stats) = start(10);
    let (unused, _receiver) = std::sync::mpsc::channel();
    let service = duplex_decode::server::DecodeService::new(unused, stats.clone(), 2048, 1024);
    let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
    let ask = || rt.block_on(service.stats(tonic::Request::new(duplex_proto::worker::StatsRequest {})));
    assert_eq!(ask().unwrap().into_inner().kv_blocks_total, 10);
    drop(commands); // the engine's only sender: its loop ends
    wait_until("the engine to stop", || stats.engine_stopped.load(Relaxed));
    let status = ask().unwrap_err();
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
}

/// The hybrid placement: a full device KV pool makes sequences that hold
/// their host blocks wait for a place (not fail, not hang); they run as
/// running ones leave, every one to the end with the CPU engine's tokens;
/// and a need the device pool can never hold is refused at once.
#[test]
fn a_full_device_kv_pool_queues_and_a_need_it_cannot_hold_is_refused() {
    // Host pool 64 blocks; device pool 8. Each request needs 4 (20 + 40 positions).
    let (commands, stats) = start_on(64, Some(8));
    let mut streams: Vec<Events> = (0..3).map(|i| admit(&commands, &format!("r{i}"), 20, 40, &[])).collect();
    wait_until("two running on the device, one waiting for its blocks there", || {
        stats.running.load(Relaxed) == 2 && stats.waiting.load(Relaxed) == 1 && stats.kv_blocks_used.load(Relaxed) == 12
    });
    let outputs: Vec<_> = streams.iter_mut().map(drain).collect();
    let (cpu, _) = start(64);
    let (want, _) = drain(&mut admit(&cpu, "cpu", 20, 40, &[]));
    for (tokens, reason) in &outputs {
        assert_eq!(reason.as_deref().unwrap(), "length");
        assert_eq!(tokens, &want, "the hybrid placement's tokens are the CPU engine's");
    }
    wait_until("blocks back", || stats.kv_blocks_used.load(Relaxed) == 0 && stats.running.load(Relaxed) == 0);

    let (tokens, result) = drain(&mut admit(&commands, "big", 20, 120, &[]));
    assert!(tokens.is_empty());
    let status = result.unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
    assert!(status.message().contains("needs 9 device KV blocks") && status.message().contains("only 8"), "{}", status.message());
}

/// max_tokens = 1 on this worker's path: one token, marked last. On the
/// prefill path the prefill worker decides for the first token; a request
/// admitted although that token already ends it has nothing to decode: it
/// is refused and its lease's blocks come back.
#[test]
fn max_tokens_1_ends_with_the_first_token_on_either_path() {
    let (commands, stats) = start(10);
    let (tokens, reason) = drain(&mut admit(&commands, "short", 20, 1, &[]));
    assert_eq!((tokens.len(), reason.unwrap().as_str()), (1, "length"));

    let lease = answer(&mut ask_lease(&commands, "long", 20, 1)).unwrap();
    let (tokens, result) = drain(&mut admit_leased(&commands, "long", 20, 1, lease));
    assert!(tokens.is_empty());
    let status = result.unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
    assert!(status.message().contains("nothing to decode"), "{}", status.message());
    wait_until("every block back", || stats.kv_blocks_used.load(Relaxed) == 0);
}
