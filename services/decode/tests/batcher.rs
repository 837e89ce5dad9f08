//! The batcher on the bundled tiny model, without processes: admission under
//! KV pressure (first come, first served), refusal of what can never fit,
//! stop tokens, and blocks returned when a client goes away.

use duplex_decode::batcher::{Admission, Batcher, Command, Limits};
use duplex_decode::kv_alloc::KvAllocator;
use duplex_model::sampling::SamplingParams;
use duplex_model::{KvPool, Model, Precision};
use duplex_proto::stats::StatsCell;
use duplex_proto::worker::{decode_event::Event, DecodeEvent};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::mpsc::Sender;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};
use tonic::{Code, Status};

fn start(kv_blocks: usize) -> (Sender<Command>, Arc<StatsCell>) {
    let model = Model::load(std::path::Path::new(duplex_model::BUNDLED_MODEL), &mut |_, _| {}).unwrap();
    let pool = KvPool::new(kv_blocks, 16, model.cfg.num_hidden_layers, model.cfg.kv_entry_dim());
    let stats = Arc::new(StatsCell::new(1024, "test".into()));
    let limits = Limits { context_length: 1024, lease_timeout: Duration::from_secs(60), max_batch_size: 6, prefill_chunk_tokens: 64 };
    let batcher = Batcher::new(model, KvAllocator::new(pool, 1), limits, Precision::F32, stats.clone());
    let (commands, receiver) = std::sync::mpsc::channel();
    std::thread::spawn(move || batcher.run(receiver));
    (commands, stats)
}

type Events = UnboundedReceiver<Result<DecodeEvent, Status>>;

fn admit(commands: &Sender<Command>, id: &str, prompt_len: usize, max_tokens: usize, stop: &[u32]) -> Events {
    let (events, receiver) = unbounded_channel();
    let admission = Admission {
        request_id: id.into(),
        prompt: (0..prompt_len as u32).map(|i| 100 + i * 7 % 1500).collect(),
        sampling: SamplingParams { seed: Some(1), ..SamplingParams::greedy() },
        max_tokens,
        stop_token_ids: stop.iter().copied().collect(),
        prefilled: None,
        events,
        arrived: Instant::now(),
    };
    commands.send(Command::Admit(Box::new(admission))).unwrap();
    receiver
}

/// Every token, then the finish reason or the error.
fn drain(events: &mut Events) -> (Vec<u32>, Result<String, Status>) {
    let mut tokens = vec![];
    loop {
        match events.blocking_recv().expect("the stream ends with finished or an error") {
            Ok(DecodeEvent { event: Some(Event::Token(t)) }) => tokens.push(t.id),
            Ok(DecodeEvent { event: Some(Event::Finished(f)) }) => return (tokens, Ok(f.finish_reason)),
            Ok(_) => panic!("empty event"),
            Err(status) => return (tokens, Err(status)),
        }
    }
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
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
    assert!(status.message().contains("KV blocks"), "{}", status.message());
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
    gone.blocking_recv().unwrap().unwrap();
    // The gauges are published after each step, so wait for this one's.
    wait_until("the running sequence's blocks", || stats.kv_blocks_used.load(Relaxed) > 0);
    drop(gone);
    wait_until("the departed client's blocks", || stats.kv_blocks_used.load(Relaxed) == 0 && stats.running.load(Relaxed) == 0);
}
