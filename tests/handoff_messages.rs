//! The KV handoff sends block numbers, never KV bytes: the messages that
//! cross the worker protocol grow only by the prompt's token ids and one
//! block number per block, however long the prompt.

use duplex_proto::worker::{AllocateKvRequest, DecodeRequest, KvLease, PrefillRequest, PrefillRoute, Prefilled, SampledToken, Sampling};
use prost::Message;

fn messages(prompt_len: usize) -> (usize, usize, usize, usize) {
    let prompt: Vec<u32> = (0..prompt_len as u32).map(|i| 1000 + i % 1000).collect();
    let blocks: Vec<u32> = (0..prompt_len.div_ceil(16) as u32).map(|b| 100 + b).collect();
    let lease = KvLease { pool_epoch: u64::MAX, request_id: "req-0123456789".into(), blocks, cached_tokens: 0 };
    let sampling = Sampling { temperature: 0.7, top_k: 40, top_p: 0.9, seed: 42, ..Sampling::default() };
    let allocate = AllocateKvRequest { request_id: "req-0123456789".into(), tokens: prompt_len as u32, max_tokens: 64, prompt: prompt.clone() };
    let prefill = PrefillRequest { request_id: "req-0123456789".into(), prompt: prompt.clone(), sampling: Some(sampling.clone()), lease: Some(lease.clone()), max_tokens: 64, stop_token_ids: vec![1], route: PrefillRoute::Dslp as i32 };
    let first_token = SampledToken { id: 7, logprob: -0.5, top_logprobs: vec![], ..Default::default() };
    let admit = DecodeRequest {
        request_id: "req-0123456789".into(),
        prompt,
        sampling: Some(sampling),
        max_tokens: 64,
        stop_token_ids: vec![1],
        prefilled: Some(Prefilled { lease: Some(lease.clone()), first_token: Some(first_token), prefill_seconds: 1.0 }),
    };
    (allocate.encoded_len(), lease.encoded_len(), prefill.encoded_len(), admit.encoded_len())
}

#[test]
fn handoff_messages_carry_block_numbers_not_kv_bytes() {
    let cfg = duplex_model::ModelConfig::from_file(&std::path::Path::new(duplex_model::BUNDLED_MODEL).join("config.json")).unwrap();
    // What one token's KV would cost if it were sent: every layer's latent entry in F32.
    let kv_bytes_per_token = cfg.num_hidden_layers * cfg.kv_entry_dim() * 4;
    let (short, long) = (messages(256), messages(4096));
    let extra_tokens = (4096 - 256) as f64;
    // AllocateKv carries the prompt for prefix caching.
    for (what, a, b) in [("AllocateKv", short.0, long.0), ("KvLease", short.1, long.1), ("PrefillRequest", short.2, long.2), ("DecodeRequest", short.3, long.3)] {
        let per_token = (b - a) as f64 / extra_tokens;
        println!("{what}: {a} bytes at 256 prompt tokens, {b} at 4096: {per_token:.2} bytes per token (one token's KV is {kv_bytes_per_token} bytes)");
        // Token ids are varints of at most 3 bytes here, block numbers 2 bytes per 16 tokens.
        assert!(per_token <= 3.0 + 2.0 / 16.0 + 0.01, "{what} grows by {per_token} bytes per prompt token");
        assert!(per_token * 100.0 < kv_bytes_per_token as f64);
    }
}
