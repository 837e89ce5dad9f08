//! The prefill worker samples a long prompt's first token, so it decides
//! whether that token is the request's last (a stop token, or `max_tokens`
//! is 1), with the rule the decode worker applies to the rest.

use duplex_ipc::{KvGeometry, KvSegment};
use duplex_model::sampling::SamplingParams;
use duplex_model::{Model, Precision};
use duplex_prefill::engine::{Command, Engine, FirstToken, Job, KvSource, Lease, PrefillError};
use duplex_proto::stats::StatsCell;
use duplex_text::FinishReason;
use std::sync::mpsc::Sender;
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::oneshot;

const KV_NAME: &str = "first-token-kv";

/// A prefill engine on the bundled model, and the KV segment it fills
/// (kept alive: its creator owns it).
fn start(shm_dir: &std::path::Path) -> (Sender<Command>, KvSegment) {
    let model = Model::load(std::path::Path::new(duplex_model::BUNDLED_MODEL), &mut |_, _| {}).unwrap();
    let geometry = KvGeometry { n_blocks: 4, block_size: 16, n_layers: model.cfg.num_hidden_layers, entry_dim: model.cfg.kv_entry_dim() };
    let segment = KvSegment::create(shm_dir, KV_NAME, geometry).unwrap();
    let stats = Arc::new(StatsCell::new(1024, "test".into()));
    let engine = Engine::new(model, KvSource::new(shm_dir.to_path_buf(), KV_NAME.into()), 64, Precision::F32, None, stats);
    let (commands, receiver) = std::sync::mpsc::channel();
    std::thread::spawn(move || engine.run(receiver));
    (commands, segment)
}

fn prefill(commands: &Sender<Command>, epoch: u64, max_tokens: usize, stop: &[u32]) -> Result<FirstToken, PrefillError> {
    let (reply, answer) = oneshot::channel();
    let job = Job {
        request_id: "r".into(),
        prompt: (0..20).map(|i| 100 + i * 7).collect(),
        sampling: SamplingParams { seed: Some(1), ..SamplingParams::greedy() },
        lease: Lease { pool_epoch: epoch, blocks: vec![0, 1], cached_tokens: 0 },
        max_tokens,
        stop_token_ids: stop.iter().copied().collect(),
        constraint: None,
        reply,
        arrived: Instant::now(),
        dslp_routed: false,
    };
    commands.send(Command::Prefill(Box::new(job))).unwrap();
    answer.blocking_recv().expect("the engine answers")
}

#[test]
fn the_first_token_is_marked_last_by_a_stop_token_or_max_tokens_1() {
    let shm_dir = std::env::temp_dir().join(format!("duplex-prefill-first-token-{}", std::process::id()));
    let (commands, segment) = start(&shm_dir);
    let epoch = segment.epoch();

    let first = prefill(&commands, epoch, 8, &[]).unwrap();
    assert_eq!(first.finish, None, "neither a stop token nor the last of max_tokens");
    let id = first.token.id;

    let stopped = prefill(&commands, epoch, 8, &[id]).unwrap();
    assert_eq!((stopped.token.id, stopped.finish), (id, Some(FinishReason::Stop)));
    let one = prefill(&commands, epoch, 1, &[]).unwrap();
    assert_eq!((one.token.id, one.finish), (id, Some(FinishReason::Length)));
    // A stop token wins over max_tokens, as on the decode worker.
    assert_eq!(prefill(&commands, epoch, 1, &[id]).unwrap().finish, Some(FinishReason::Stop));

    // A lease from another pool is refused with what the caller can act on.
    let stale = prefill(&commands, epoch.wrapping_add(1), 8, &[]).unwrap_err();
    assert!(matches!(stale, PrefillError::StaleLease(_)), "{stale:?}");
    drop(segment);
    let _ = std::fs::remove_dir_all(&shm_dir);
}
