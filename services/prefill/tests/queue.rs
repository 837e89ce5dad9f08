//! The prefill engine runs prompts one at a time, first come first served:
//! jobs that arrive while it is busy run in the order they arrived.

use duplex_ipc::{KvGeometry, KvSegment};
use duplex_model::sampling::SamplingParams;
use duplex_model::{Model, Precision};
use duplex_prefill::engine::{Command, Engine, FirstToken, Job, KvSource, Lease, PrefillError};
use duplex_proto::stats::StatsCell;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::mpsc::Sender;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::oneshot;

const KV_NAME: &str = "queue-kv";
const BLOCK_SIZE: usize = 16;

/// Send a prefill of `tokens` prompt tokens into `blocks`, and the receiver
/// of its answer with the instant it was sent.
fn submit(commands: &Sender<Command>, epoch: u64, request_id: &str, tokens: u32, blocks: Vec<u32>) -> (oneshot::Receiver<Result<FirstToken, PrefillError>>, Instant) {
    let (reply, answer) = oneshot::channel();
    let arrived = Instant::now();
    let job = Job {
        request_id: request_id.into(),
        prompt: (0..tokens).map(|i| 100 + i * 7).collect(),
        sampling: SamplingParams::greedy(),
        lease: Lease { pool_epoch: epoch, blocks, cached_tokens: 0 },
        max_tokens: 8,
        stop_token_ids: Default::default(),
        constraint: None,
        reply,
        arrived,
        dslp_routed: false,
    };
    commands.send(Command::Prefill(Box::new(job))).unwrap();
    (answer, arrived)
}

#[test]
fn jobs_that_arrive_while_the_engine_is_busy_run_in_arrival_order() {
    let shm_dir = tempfile::tempdir().unwrap();
    let model = Model::load(std::path::Path::new(duplex_model::BUNDLED_MODEL), &mut |_, _| {}).unwrap();
    // The long job's 128 tokens and three short jobs of one block each.
    let long_tokens = 128;
    let geometry = KvGeometry { n_blocks: long_tokens / BLOCK_SIZE + 3, block_size: BLOCK_SIZE, n_layers: model.cfg.num_hidden_layers, entry_dim: model.cfg.kv_entry_dim() };
    let segment = KvSegment::create(shm_dir.path(), KV_NAME, geometry).unwrap();
    let epoch = segment.epoch();
    let stats = Arc::new(StatsCell::new(1024, "test".into()));
    // One token a chunk: the long job takes 128 forward passes, and the
    // engine takes arriving commands between them.
    let engine = Engine::new(model, KvSource::new(shm_dir.path().to_path_buf(), KV_NAME.into()), 1, Precision::F32, None, stats.clone());
    let (commands, receiver) = std::sync::mpsc::channel();
    let engine_thread = std::thread::spawn(move || engine.run(receiver));

    let (mut long, long_arrived) = submit(&commands, epoch, "long", long_tokens as u32, (0..(long_tokens / BLOCK_SIZE) as u32).collect());
    let deadline = Instant::now() + Duration::from_secs(60);
    while stats.running.load(Relaxed) == 0 {
        assert!(Instant::now() < deadline, "the long job never started");
        std::thread::sleep(Duration::from_millis(1));
    }
    let short_block = |k: usize| vec![(long_tokens / BLOCK_SIZE + k) as u32];
    let short: Vec<_> = ["first", "second", "third"].iter().enumerate().map(|(k, id)| (*id, submit(&commands, epoch, id, 8, short_block(k)))).collect();
    // Had the long job ended before the last short job was sent, the engine
    // could have taken them one at a time, and any order would pass.
    assert!(matches!(long.try_recv(), Err(oneshot::error::TryRecvError::Empty)), "the long job ended before the short jobs were all sent: make it longer");

    // The engine runs one job at a time, so the instants they started
    // (arrival plus time queued) give the order they ran in.
    let started = |answer: oneshot::Receiver<Result<FirstToken, PrefillError>>, arrived: Instant, id: &str| {
        let first = answer.blocking_recv().expect("the engine answers").unwrap_or_else(|e| panic!("{id}: {e}"));
        arrived + first.queue
    };
    let long_started = started(long, long_arrived, "long");
    let mut order = vec![("long", long_started)];
    for (id, (answer, arrived)) in short {
        order.push((id, started(answer, arrived, id)));
    }
    order.sort_by_key(|&(_, at)| at);
    let ran: Vec<&str> = order.iter().map(|&(id, _)| id).collect();
    assert_eq!(ran, ["long", "first", "second", "third"], "the jobs ran in this order");

    drop(commands);
    engine_thread.join().unwrap();
    drop(segment);
}
