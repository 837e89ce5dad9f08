//! Every architecture Duplex loads (DeepSeek-V3, Qwen3-MoE, Mixtral) gives
//! transformers' float32 greedy tokens (each fixture's `reference.json`)
//! through every way a prompt can run: `duplex generate`, the decode
//! worker's own prefill, the prefill worker on the CPU (then KV handoff), and
//! the prefill worker's stream-loading prefill on the emulated accelerator.
//!
//! Everything runs at `--dtype f32`: only there is the engine held to the
//! reference token for token (the fixtures' README: a bf16 continuation is
//! not expected to match). The references ignore EOS and contain padded-vocab
//! ids (≥ 2048) and special tokens mid-output, so every request here is
//! greedy with `ignore_eos` and nothing is masked.

use duplex_tests::{collect, duplex_bin, greedy_request, runtime, serial, within, Options, Server};
use std::path::PathBuf;
use std::process::Command;

const ARCHITECTURES: [&str; 3] = ["tiny-dsv3", "tiny-qwen3moe", "tiny-mixtral"];

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("fixtures").join(name)
}

struct Reference {
    input_ids: Vec<u32>,
    greedy: Vec<u32>,
}

/// The fixture's reference prompts and their greedy continuations.
fn references(name: &str) -> Vec<Reference> {
    let path = fixture(name).join("reference.json");
    let json: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let ids = |v: &serde_json::Value| -> Vec<u32> { v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect() };
    let prompts = json["prompts"].as_array().unwrap();
    assert_eq!(prompts.len(), 4, "{}", path.display());
    prompts.iter().map(|p| Reference { input_ids: ids(&p["input_ids"]), greedy: ids(&p["greedy_continuation"]) }).collect()
}

/// `duplex generate` on `model`: greedy, EOS ignored, F32, as JSON.
fn generate(model: &PathBuf, prompt: &[u32], max_tokens: usize) -> serde_json::Value {
    generate_with(model, prompt, max_tokens, &[])
}

/// [`generate`] with `--override-kv` for each of `overrides`.
fn generate_with(model: &PathBuf, prompt: &[u32], max_tokens: usize, overrides: &[String]) -> serde_json::Value {
    let ids: Vec<String> = prompt.iter().map(|t| t.to_string()).collect();
    let out = Command::new(duplex_bin())
        .args(["generate", "--model"])
        .arg(model)
        .args(["--tokens", &ids.join(","), "--temperature", "0", "--ignore-eos", "--json", "--dtype", "f32"])
        .args(["--max-tokens", &max_tokens.to_string()])
        .args(overrides.iter().flat_map(|o| ["--override-kv", o.as_str()]))
        .output()
        .expect("run duplex generate");
    assert!(out.status.success(), "duplex generate --model {} failed: {}", model.display(), String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).expect("generate --json output")
}

/// `duplex serve --override-kv` on a GGUF reaches both workers: a long
/// prompt prefilled by the prefill worker and decoded by the decode worker
/// gives `duplex generate`'s tokens with the same override (another YaRN
/// beta), which differ from the tokens without it.
#[test]
fn serve_passes_metadata_overrides_to_both_workers() {
    let _serial = serial();
    let gguf = fixture("tiny-dsv3-q4km").join("model-Q4_K_M.gguf");
    let prompt = references("tiny-dsv3-q4km").swap_remove(2).input_ids;
    assert!(prompt.len() >= 256, "the prompt goes to the prefill worker");
    let overrides = vec!["deepseek2.rope.scaling.yarn_beta_fast=float:4".to_string()];
    let tokens = |json: serde_json::Value| -> Vec<u32> { json["tokens"].as_array().unwrap().iter().map(|t| t.as_u64().unwrap() as u32).collect() };
    let want = tokens(generate_with(&gguf, &prompt, 12, &overrides));
    assert_ne!(want, tokens(generate(&gguf, &prompt, 12)), "the override changes nothing here: the test could not tell");
    let server = Server::start(Options { prefill_threshold_tokens: 256, dtype: "f32", model: Some(gguf), override_kv: overrides, ..Options::default() });
    runtime().block_on(async {
        let mut client = server.grpc_client().await;
        let (ids, _, _) = within(120, "generate", collect(&mut client, greedy_request(&prompt, 12))).await.unwrap_or_else(|e| panic!("{e}\nserver log:\n{}", server.log()));
        assert_eq!(ids, want);
    });
}

/// The CLI reproduces the reference continuation of the short prompts
/// (plain text, and a chat-template rendering) of every architecture.
#[test]
fn cli_gives_the_reference_greedy_tokens_for_every_architecture() {
    for name in ARCHITECTURES {
        for (i, reference) in references(name).iter().enumerate().take(2) {
            let json = generate(&fixture(name), &reference.input_ids, reference.greedy.len());
            let tokens: Vec<u32> = json["tokens"].as_array().unwrap().iter().map(|t| t.as_u64().unwrap() as u32).collect();
            assert_eq!(tokens, reference.greedy, "{name} prompt {i}: duplex generate");
            assert_eq!(json["prompt_tokens"], reference.input_ids.len(), "{name} prompt {i}");
            assert_eq!(json["finish_reason"], "length", "{name} prompt {i}");
        }
    }
}

/// One server per architecture, both workers at F32. The router sends
/// prompts of 256 tokens or more to the prefill worker, and the prefill
/// worker runs prompts of prompt 3's length or more with stream-loading
/// prefill on the emulated accelerator. So:
/// - prompts 0 and 1 (23–30 tokens) are prefilled by the decode worker;
/// - prompt 2 (303–371 tokens) by the prefill worker on the CPU, then its KV
///   is handed to the decode worker;
/// - prompt 3 (327–412 tokens) by stream-loading prefill.
///
/// Each must give the reference's greedy tokens, and each must have taken
/// the path it is meant to (the router's reported path; the SLP metrics).
fn serve_paths_give_the_reference_greedy_tokens(name: &str) {
    let _serial = serial();
    let references = references(name);
    let slp_threshold = references[3].input_ids.len();
    assert!(references[2].input_ids.len() >= 256 && references[2].input_ids.len() < slp_threshold, "{name}: prompt 2 must sit between the thresholds");
    let server = Server::start(Options {
        prefill_threshold_tokens: 256,
        slp_threshold_tokens: Some(slp_threshold),
        dtype: "f32",
        model: Some(fixture(name)),
        ..Options::default()
    });
    let slp_metrics = server.prefill_metrics_url();
    runtime().block_on(async {
        let mut client = server.grpc_client().await;
        // (prompt, the path the router reports, whether SLP ran it)
        for (i, path, slp) in [(0, "decode", false), (1, "decode", false), (2, "prefill", false), (3, "prefill", true)] {
            let reference = &references[i];
            let slp_before = server.metric(&slp_metrics, "duplex_prefill_slp_stall_seconds_count", "").await.unwrap_or(0.0);
            let request = greedy_request(&reference.input_ids, reference.greedy.len() as u32);
            let (ids, _text, finished) = within(120, "generate", collect(&mut client, request))
                .await
                .unwrap_or_else(|e| panic!("{name} prompt {i}: {e}\nserver log:\n{}", server.log()));
            assert_eq!(ids, reference.greedy, "{name} prompt {i} ({path} path, slp {slp})");
            let usage = finished.usage.unwrap();
            assert_eq!((usage.prompt_tokens as usize, usage.completion_tokens as usize), (reference.input_ids.len(), reference.greedy.len()));
            assert_eq!(finished.finish_reason, "length");
            assert_eq!(finished.timings.unwrap().prefill_path, path, "{name} prompt {i}");
            let slp_after = server.metric(&slp_metrics, "duplex_prefill_slp_stall_seconds_count", "").await.unwrap_or(0.0);
            assert_eq!(slp_after - slp_before, if slp { 1.0 } else { 0.0 }, "{name} prompt {i}: SLP prefills");
        }
        let streamed = server.metric(&slp_metrics, "duplex_prefill_slp_streamed_bytes_total", "").await.unwrap_or(0.0);
        assert!(streamed > 0.0, "{name}: SLP streamed no weights");
    });
    assert!(server.log().contains("stream-loading prefill on emulated accelerator"), "{}", server.log());
}

#[test]
fn serve_paths_give_the_reference_greedy_tokens_deepseek_v3() {
    serve_paths_give_the_reference_greedy_tokens("tiny-dsv3");
}

#[test]
fn serve_paths_give_the_reference_greedy_tokens_qwen3_moe() {
    serve_paths_give_the_reference_greedy_tokens("tiny-qwen3moe");
}

#[test]
fn serve_paths_give_the_reference_greedy_tokens_mixtral() {
    serve_paths_give_the_reference_greedy_tokens("tiny-mixtral");
}

/// The decode worker on the hybrid placement (attention on an emulated
/// accelerator, routed experts on the CPU), both workers at F32: every
/// prompt, short ones prefilled by the decode worker itself and the long
/// one handed over from the prefill worker (its KV copied into the device
/// pool), gives the reference's greedy tokens alone (batch 1) and with
/// others in flight (batches of 2 and 6, run as two micro-batches), each
/// step launched as one device graph.
fn serve_hybrid_decode_gives_the_reference_greedy_tokens(name: &str) {
    let _serial = serial();
    let references = references(name);
    assert!(references[2].input_ids.len() >= 256, "{name}: prompt 2 goes to the prefill worker");
    let server = Server::start(Options { prefill_threshold_tokens: 256, dtype: "f32", model: Some(fixture(name)), decode_device: "emulated", ..Options::default() });
    let decode_metrics = server.decode_metrics_url();
    runtime().block_on(async {
        let client = server.grpc_client().await;
        for batch in [1usize, 2, 6] {
            // Prompts 0, 1 (short) and 2 (long), round robin.
            let runs = (0..batch).map(|k| {
                let (mut client, reference) = (client.clone(), &references[k % 3]);
                async move {
                    let request = greedy_request(&reference.input_ids, reference.greedy.len() as u32);
                    (k, within(120, "generate", collect(&mut client, request)).await)
                }
            });
            for (k, result) in futures::future::join_all(runs).await {
                let (ids, _text, finished) = result.unwrap_or_else(|e| panic!("{name} batch {batch} request {k}: {e}\nserver log:\n{}", server.log()));
                assert_eq!(ids, references[k % 3].greedy, "{name} batch {batch} request {k}");
                assert_eq!(finished.finish_reason, "length");
            }
        }
        let split = server.metric(&decode_metrics, "duplex_decode_micro_batch_size_count", "half=\"b\"").await.unwrap_or(0.0);
        assert!(split > 0.0, "{name}: no step ran as two micro-batches");
        let cpu_moe = server.metric(&decode_metrics, "duplex_decode_step_seconds_count", "part=\"cpu_moe\"").await.unwrap_or(0.0);
        assert!(cpu_moe > 0.0, "{name}: no hybrid step recorded");
        // Steps are captured as device graphs by default, and a shape seen before updates its graph.
        let updated = server.metric(&decode_metrics, "duplex_decode_graph_launches_total", "exec=\"updated\"").await.unwrap_or(0.0);
        assert!(updated > 0.0, "{name}: no step launched through a kept graph");
        let used = server.metric(&decode_metrics, "duplex_decode_device_kv_blocks_used", "").await;
        assert_eq!(used, Some(0.0), "{name}: device KV blocks still held after every request finished");
    });
    assert!(server.log().contains("decoding on emulated"), "{}", server.log());
}

#[test]
fn serve_hybrid_decode_gives_the_reference_greedy_tokens_deepseek_v3() {
    serve_hybrid_decode_gives_the_reference_greedy_tokens("tiny-dsv3");
}

#[test]
fn serve_hybrid_decode_gives_the_reference_greedy_tokens_qwen3_moe() {
    serve_hybrid_decode_gives_the_reference_greedy_tokens("tiny-qwen3moe");
}

#[test]
fn serve_hybrid_decode_gives_the_reference_greedy_tokens_mixtral() {
    serve_hybrid_decode_gives_the_reference_greedy_tokens("tiny-mixtral");
}
