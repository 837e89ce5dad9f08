//! The router end to end, through both front doors, against mock workers.

mod common;

use common::{sse_data, start, Mock, MockConfig, TIMEOUT};
use duplex_text::tokenizer::Tokenizer;
use duplex_proto::v1::{generate_request, generate_response, GenerateRequest, GenerateResponse, SamplingParameters, StoppingCriteria, TokenIds};
use duplex_text::BUNDLED_MODEL;
use serde_json::{json, Value};
use std::path::Path;
use std::time::Duration;
use tokio::time::timeout;
use tonic::Code;

fn tokens_request(ids: Vec<u32>, max_tokens: u32) -> GenerateRequest {
    GenerateRequest {
        prompt: Some(generate_request::Prompt::Tokens(TokenIds { ids })),
        stopping: Some(StoppingCriteria { max_tokens, ignore_eos: true, ..Default::default() }),
        ..Default::default()
    }
}

/// Every message of a Generate stream, or the status it ended with.
async fn generate_all(router: &common::TestRouter, req: GenerateRequest) -> Result<Vec<GenerateResponse>, tonic::Status> {
    let run = async {
        let mut stream = router.grpc_client().await.generate(req).await?.into_inner();
        let mut out = vec![];
        while let Some(msg) = stream.message().await? {
            out.push(msg);
        }
        Ok(out)
    };
    timeout(TIMEOUT, run).await.expect("Generate timed out")
}

fn token_ids(msgs: &[GenerateResponse]) -> Vec<u32> {
    msgs.iter()
        .filter_map(|m| match &m.event {
            Some(generate_response::Event::Token(t)) => Some(t.id),
            _ => None,
        })
        .collect()
}

/// The text of the streamed tokens, in order.
fn token_text(msgs: &[GenerateResponse]) -> String {
    msgs.iter()
        .filter_map(|m| match &m.event {
            Some(generate_response::Event::Token(t)) => Some(t.text.as_str()),
            _ => None,
        })
        .collect()
}

fn finished(msgs: &[GenerateResponse]) -> &duplex_proto::v1::Finished {
    match msgs.last().and_then(|m| m.event.as_ref()) {
        Some(generate_response::Event::Finished(f)) => f,
        other => panic!("the stream did not end with finished: {other:?}"),
    }
}

async fn json_of(resp: reqwest::Response) -> (u16, Value) {
    let status = resp.status().as_u16();
    (status, resp.json().await.unwrap())
}

/// A request that must work, to show the server still serves.
async fn assert_serves(router: &common::TestRouter) {
    let msgs = generate_all(router, tokens_request(vec![5, 6, 7], 2)).await.unwrap();
    assert_eq!(token_ids(&msgs), [3, 4]);
}

#[tokio::test]
async fn grpc_generate_streams_every_token_then_finished() {
    let router = start(MockConfig::default(), |_| {}).await;
    let mut req = tokens_request(vec![5, 6, 7], 5);
    req.sampling = Some(SamplingParameters { logprobs: true, top_logprobs: Some(2), ..Default::default() });
    let msgs = generate_all(&router, req).await.unwrap();
    assert_eq!(token_ids(&msgs), [3, 4, 5, 6, 7]);
    let Some(generate_response::Event::Token(t)) = &msgs[0].event else { panic!() };
    assert_eq!((t.logprob, t.top_logprobs.len()), (Some(-0.5), 2));
    let f = finished(&msgs);
    assert_eq!(f.finish_reason, "length");
    let usage = f.usage.unwrap();
    assert_eq!((usage.prompt_tokens, usage.completion_tokens), (3, 5));
    let timings = f.timings.as_ref().unwrap();
    assert_eq!(timings.prefill_path, "decode");
    assert!(timings.total_seconds >= timings.time_to_first_token_seconds && timings.queue_seconds > 0.0, "{timings:?}");

    {
        // The record's lock, released before waiting below.
        let r = router.mock.record();
        assert_eq!(r.decodes.len(), 1);
        assert!(r.allocs.is_empty() && r.prefills.is_empty());
        let d = &r.decodes[0];
        assert!(d.prefilled.is_none());
        assert_eq!((d.prompt.as_slice(), d.max_tokens), ([5, 6, 7].as_slice(), 5));
        assert_eq!(d.sampling.as_ref().unwrap().top_logprobs, Some(2));
    }
    // The mock's stream guard drops after the last event went out: wait for it.
    router.wait_for("the decode stream to finish, not be cancelled", |r| r.streams_finished.len() == 1).await;
    assert!(router.mock.record().streams_cancelled.is_empty());
}

#[tokio::test]
async fn stop_token_ends_with_stop_and_text_round_trips() {
    let tok = Tokenizer::from_dir(Path::new(BUNDLED_MODEL)).unwrap();
    let mut script = tok.encode_raw("Hello there, world").unwrap();
    script.push(1); // EOS
    let router = start(MockConfig { script: script.clone(), ..Default::default() }, |_| {}).await;
    let req = GenerateRequest { prompt: Some(generate_request::Prompt::Text("Hi".into())), ..Default::default() };
    let msgs = generate_all(&router, req).await.unwrap();
    assert_eq!(token_ids(&msgs), script);
    let text = token_text(&msgs);
    assert_eq!(text, "Hello there, world");
    assert_eq!(finished(&msgs).finish_reason, "stop");
    let r = router.mock.record();
    assert_eq!(r.decodes[0].stop_token_ids, [1], "EOS is a stop token");
    assert_eq!(r.decodes[0].prompt[0], 0, "BOS added to text prompts");
}

#[tokio::test]
async fn http_completions_streamed_equals_non_streamed() {
    let router = start(MockConfig::default(), |_| {}).await;
    let body = json!({"model": "tiny-dsv3", "prompt": "Hello world", "max_tokens": 8, "seed": 3, "ignore_eos": true, "user": "extra fields are ignored"});
    let (status, full) = json_of(router.post("/v1/completions", body.clone()).await).await;
    assert_eq!(status, 200, "{full}");
    assert_eq!(full["object"], "text_completion");
    assert_eq!(full["model"], "tiny-dsv3");
    assert!(full["id"].as_str().unwrap().starts_with("cmpl-") && full["created"].is_u64());
    assert_eq!(full["choices"][0]["index"], 0);
    assert_eq!(full["choices"][0]["finish_reason"], "length");
    assert_eq!(full["usage"]["completion_tokens"], 8);
    assert_eq!(full["usage"]["total_tokens"], full["usage"]["prompt_tokens"].as_u64().unwrap() + 8);
    let text = full["choices"][0]["text"].as_str().unwrap();
    assert!(!text.is_empty());

    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    streamed["stream_options"] = json!({"include_usage": true});
    let resp = router.post("/v1/completions", streamed).await;
    assert_eq!(resp.status(), 200);
    assert!(resp.headers()["content-type"].to_str().unwrap().starts_with("text/event-stream"));
    let data = sse_data(&resp.text().await.unwrap());
    assert_eq!(data.last().unwrap(), "[DONE]");
    let chunks: Vec<Value> = data[..data.len() - 1].iter().map(|d| serde_json::from_str(d).unwrap()).collect();
    let concatenated: String = chunks.iter().filter_map(|c| c["choices"].get(0).map(|ch| ch["text"].as_str().unwrap().to_string())).collect();
    assert_eq!(concatenated, text);
    assert!(chunks.iter().all(|c| c["object"] == "text_completion" && c["id"].is_string()));
    let last_choice = &chunks[chunks.len() - 2]["choices"][0];
    assert_eq!(last_choice["finish_reason"], "length");
    let usage = chunks.last().unwrap();
    assert_eq!(usage["choices"], json!([]));
    assert_eq!(usage["usage"]["completion_tokens"], 8);

    // Token-id prompts and completions logprobs (ids 10.. decode to distinct text).
    let (status, v) = json_of(router.post("/v1/completions", json!({"prompt": vec![5; 10], "max_tokens": 3, "logprobs": 2, "ignore_eos": true})).await).await;
    assert_eq!(status, 200, "{v}");
    let lp = &v["choices"][0]["logprobs"];
    assert_eq!(lp["tokens"].as_array().unwrap().len(), 3);
    assert_eq!(lp["token_logprobs"], json!([-0.5, -0.5, -0.5]));
    assert_eq!(lp["top_logprobs"][0].as_object().unwrap().len(), 2);
    assert_eq!(lp["text_offset"][0], 0);
}

#[tokio::test]
async fn http_chat_streamed_and_not() {
    let router = start(MockConfig::default(), |_| {}).await;
    let body = json!({
        "model": "tiny-dsv3",
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
        "max_completion_tokens": 6, "ignore_eos": true, "logprobs": true, "top_logprobs": 2,
    });
    let (status, full) = json_of(router.post("/v1/chat/completions", body.clone()).await).await;
    assert_eq!(status, 200, "{full}");
    assert_eq!(full["object"], "chat.completion");
    assert!(full["id"].as_str().unwrap().starts_with("chatcmpl-"));
    let choice = &full["choices"][0];
    assert_eq!(choice["message"]["role"], "assistant");
    assert_eq!(choice["finish_reason"], "length");
    let content = choice["message"]["content"].as_str().unwrap();
    let lp = choice["logprobs"]["content"].as_array().unwrap();
    assert_eq!(lp.len(), 6);
    assert_eq!(lp[0]["top_logprobs"].as_array().unwrap().len(), 2);
    assert!(lp[0]["bytes"].is_array());
    // The chat template ran: BOS, the system text, <｜User｜>, ..., <｜Assistant｜>.
    let prompt = router.mock.record().decodes[0].prompt.clone();
    assert_eq!((prompt[0], *prompt.last().unwrap()), (0, 3));

    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let data = sse_data(&router.post("/v1/chat/completions", streamed).await.text().await.unwrap());
    assert_eq!(data.last().unwrap(), "[DONE]");
    let chunks: Vec<Value> = data[..data.len() - 1].iter().map(|d| serde_json::from_str(d).unwrap()).collect();
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    assert!(chunks.iter().all(|c| c["object"] == "chat.completion.chunk"));
    let text: String = chunks.iter().filter_map(|c| c["choices"][0]["delta"]["content"].as_str()).collect();
    assert_eq!(text, content);
    assert_eq!(chunks.last().unwrap()["choices"][0]["finish_reason"], "length");
    assert!(chunks[1]["choices"][0]["logprobs"]["content"].is_array());
}

#[tokio::test]
async fn long_prompts_go_through_the_prefill_worker() {
    let router = start(MockConfig::default(), |c| c.prefill_threshold_tokens = 32).await;
    let prompt: Vec<u32> = (10..50).collect(); // 40 tokens
    let msgs = generate_all(&router, tokens_request(prompt.clone(), 4)).await.unwrap();
    assert_eq!(token_ids(&msgs), [40, 41, 42, 43], "the prefill worker's token comes first");
    let f = finished(&msgs);
    assert_eq!(f.timings.as_ref().unwrap().prefill_path, "prefill");
    assert_eq!(f.usage.unwrap().completion_tokens, 4);
    {
        let r = router.mock.record();
        assert_eq!((r.allocs.len(), r.prefills.len(), r.decodes.len()), (1, 1, 1), "{r:#?}");
        let (alloc, prefill, decode) = (&r.allocs[0], &r.prefills[0], &r.decodes[0]);
        assert_eq!(alloc.tokens, 40);
        assert_eq!(prefill.prompt, prompt);
        let lease = prefill.lease.as_ref().unwrap();
        assert_eq!(lease.blocks.len(), 3);
        let prefilled = decode.prefilled.as_ref().expect("Decode carries the prefilled lease");
        assert_eq!(prefilled.lease.as_ref(), Some(lease));
        assert_eq!(prefilled.first_token.as_ref().unwrap().id, 40);
        assert_eq!(prefill.sampling.as_ref().unwrap().seed, decode.sampling.as_ref().unwrap().seed, "both workers sample one stream");
        assert!(r.leases.is_empty() && r.frees.is_empty(), "{r:#?}");
    }

    // One token: the prefill worker's answer is all; the lease is freed.
    let msgs = generate_all(&router, tokens_request(prompt.clone(), 1)).await.unwrap();
    assert_eq!(token_ids(&msgs), [40]);
    assert_eq!(finished(&msgs).finish_reason, "length");
    router.wait_for("FreeKv", |r| r.frees.len() == 1).await;
    let r = router.mock.record();
    assert_eq!(r.decodes.len(), 1, "no Decode for a request that is already done");
    assert!(r.leases.is_empty());
}

/// The worker that samples a token says whether it is the last: here the
/// prefill worker, whose first token is a stop token. The request ends with
/// it (one token, "stop"), nothing is admitted to decode, the lease is freed.
#[tokio::test]
async fn a_stop_token_first_on_the_prefill_path_ends_the_request() {
    let router = start(MockConfig { script: vec![77, 78, 79], ..Default::default() }, |c| c.prefill_threshold_tokens = 32).await;
    let mut req = tokens_request((10..50).collect(), 10);
    req.stopping.as_mut().unwrap().stop_token_ids = vec![77];
    let msgs = generate_all(&router, req).await.unwrap();
    assert_eq!(token_ids(&msgs), [77]);
    let f = finished(&msgs);
    assert_eq!((f.finish_reason.as_str(), f.usage.unwrap().completion_tokens), ("stop", 1));
    router.wait_for("FreeKv", |r| r.frees.len() == 1).await;
    let r = router.mock.record();
    assert_eq!(r.prefills[0].stop_token_ids, [77], "the prefill worker is told the stop tokens");
    assert!(r.decodes.is_empty() && r.leases.is_empty(), "{r:#?}");
}

/// max_tokens = 1 on the decode worker's path (the prefill path's is in
/// `long_prompts_go_through_the_prefill_worker`): one token, "length".
#[tokio::test]
async fn max_tokens_1_on_the_decode_path() {
    let router = start(MockConfig::default(), |_| {}).await;
    let msgs = generate_all(&router, tokens_request(vec![5, 6, 7], 1)).await.unwrap();
    assert_eq!(token_ids(&msgs), [3]);
    assert_eq!(finished(&msgs).finish_reason, "length");
    assert_eq!(router.mock.record().decodes.len(), 1);
}

/// The finish comes with the last token: a decode worker that sends its
/// last token and then keeps the stream open does not delay the client's
/// `finished` (the router used to wait up to 2 s for a finish message).
#[tokio::test]
async fn the_finish_arrives_with_the_last_token_not_after_the_stream() {
    let router = start(MockConfig { hold_after_last: Duration::from_secs(60), ..Default::default() }, |_| {}).await;
    let mut client = router.grpc_client().await;
    let mut stream = client.generate(tokens_request(vec![5, 6, 7], 3)).await.unwrap().into_inner();
    let mut last_token_at = None;
    let finished_at = loop {
        let msg = timeout(TIMEOUT, stream.message()).await.expect("Generate timed out").unwrap().expect("the stream ends with finished");
        match msg.event {
            Some(generate_response::Event::Token(_)) => last_token_at = Some(std::time::Instant::now()),
            Some(generate_response::Event::Finished(f)) => {
                assert_eq!(f.finish_reason, "length");
                break std::time::Instant::now();
            }
            other => panic!("unexpected event {other:?}"),
        }
    };
    let gap = finished_at - last_token_at.expect("tokens before finished");
    assert!(gap < Duration::from_secs(1), "finished came {gap:?} after the last token");
    // The mock would hold its stream for a minute: the router let go of it.
    router.wait_for("the router to drop the held stream", |r| r.streams_finished.len() == 1).await;
}

#[tokio::test]
async fn stop_strings_across_tokens() {
    let tok = Tokenizer::from_dir(Path::new(BUNDLED_MODEL)).unwrap();
    let script = tok.encode_raw("one two ENDING three four five").unwrap();
    let router = start(MockConfig { script, token_delay: Duration::from_millis(5), ..Default::default() }, |_| {}).await;
    let req = GenerateRequest {
        prompt: Some(generate_request::Prompt::Text("x".into())),
        stopping: Some(StoppingCriteria { max_tokens: 50, stop: vec!["END".into()], ..Default::default() }),
        ..Default::default()
    };
    let msgs = generate_all(&router, req).await.unwrap();
    let text = token_text(&msgs);
    assert_eq!(text, "one two ");
    assert_eq!(finished(&msgs).finish_reason, "stop");
    router.wait_for("the decode stream to be dropped", |r| r.streams_cancelled.len() == 1).await;

    let (status, v) = json_of(router.post("/v1/completions", json!({"prompt": "x", "stop": ["two", "four"], "max_tokens": 50})).await).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["choices"][0]["text"], "one ");
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
}

#[tokio::test]
async fn cancelling_a_stream_cancels_the_decode() {
    let router = start(MockConfig { token_delay: Duration::from_millis(50), ..Default::default() }, |_| {}).await;
    // gRPC: read two tokens, then hang up.
    let mut client = router.grpc_client().await;
    let mut stream = client.generate(tokens_request(vec![5, 6], 500)).await.unwrap().into_inner();
    for _ in 0..2 {
        timeout(TIMEOUT, stream.message()).await.unwrap().unwrap().unwrap();
    }
    drop(stream);
    router.wait_for("the gRPC client's cancel to reach the worker", |r| r.streams_cancelled.len() == 1).await;

    // HTTP: read the first chunk of an SSE stream, then hang up.
    let mut resp = router.post("/v1/completions", json!({"prompt": [5, 6], "max_tokens": 500, "stream": true, "ignore_eos": true})).await;
    timeout(TIMEOUT, resp.chunk()).await.unwrap().unwrap().unwrap();
    drop(resp);
    router.wait_for("the HTTP client's cancel to reach the worker", |r| r.streams_cancelled.len() == 2).await;
    assert!(router.mock.record().streams_finished.is_empty());
    assert_serves(&router).await;
}

#[tokio::test]
async fn cancelling_during_prefill_cancels_it_and_frees_the_lease() {
    let router = start(MockConfig { prefill_delay: Duration::from_secs(30), ..Default::default() }, |c| c.prefill_threshold_tokens = 32).await;
    let req = tokens_request((0..100).collect(), 10);
    let stream = router.grpc_client().await.generate(req).await.unwrap().into_inner();
    router.wait_for("the Prefill call", |r| r.prefills.len() == 1).await;
    drop(stream);
    router.wait_for("Cancel and FreeKv", |r| r.prefill_cancels.len() == 1 && r.frees.len() == 1).await;
    let r = router.mock.record();
    assert_eq!(r.prefill_cancels[0], r.allocs[0].request_id);
    assert_eq!(r.frees[0], r.allocs[0].request_id);
    assert!(r.leases.is_empty() && r.decodes.is_empty(), "{r:#?}");
}

#[tokio::test]
async fn overload_is_refused_with_a_message() {
    let router = start(MockConfig { token_delay: Duration::from_millis(50), ..Default::default() }, |c| c.max_pending_requests = 1).await;
    let mut client = router.grpc_client().await;
    let mut first = client.generate(tokens_request(vec![5], 500)).await.unwrap().into_inner();
    timeout(TIMEOUT, first.message()).await.unwrap().unwrap().unwrap();

    let status = generate_all(&router, tokens_request(vec![5], 5)).await.unwrap_err();
    assert_eq!(status.code(), Code::ResourceExhausted);
    assert!(status.message().contains("capacity"), "{}", status.message());
    let (status, v) = json_of(router.post("/v1/completions", json!({"prompt": "hi"})).await).await;
    assert_eq!(status, 429);
    assert!(v["error"]["message"].as_str().unwrap().contains("capacity"), "{v}");

    drop(first);
    router.wait_for("the first request to end", |r| r.streams_cancelled.len() == 1).await;
    // The permit is released when the request's task ends, just after.
    timeout(TIMEOUT, async {
        while generate_all(&router, tokens_request(vec![5, 6, 7], 2)).await.is_err() {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .unwrap();
}

#[tokio::test]
async fn bad_http_requests_get_clear_errors() {
    let router = start(MockConfig::default(), |_| {}).await;
    let long: Vec<u32> = vec![5; 2000];
    let cases = [
        ("/v1/completions", json!({"prompt": ""}), 400, Some("prompt"), "empty"),
        ("/v1/completions", json!({"prompt": []}), 400, Some("prompt"), "empty"),
        ("/v1/completions", json!({"max_tokens": 3}), 400, Some("prompt"), "required"),
        ("/v1/completions", json!({"prompt": long}), 400, Some("prompt"), "context length"),
        ("/v1/completions", json!({"prompt": "hi", "temperature": -1}), 400, Some("temperature"), "temperature"),
        ("/v1/completions", json!({"prompt": "hi", "temperature": "hot"}), 400, Some("temperature"), "temperature"),
        ("/v1/completions", json!({"prompt": "hi", "n": 200}), 400, Some("n"), "n must be between 1 and 128"),
        ("/v1/completions", json!({"prompt": "hi", "echo": true}), 400, Some("echo"), "echo"),
        ("/v1/completions", json!({"prompt": "hi", "best_of": 3}), 400, Some("best_of"), "best_of"),
        ("/v1/completions", json!({"prompt": "hi", "logprobs": 21}), 400, Some("logprobs"), "logprobs"),
        ("/v1/completions", json!({"prompt": "hi", "max_tokens": 0}), 400, Some("max_tokens"), "max_tokens"),
        ("/v1/completions", json!({"prompt": ["a", "b"]}), 400, Some("prompt"), "batches"),
        ("/v1/completions", json!({"prompt": "hi", "model": "gpt-4"}), 404, Some("model"), "gpt-4"),
        ("/v1/chat/completions", json!({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 21}), 400, Some("top_logprobs"), "top_logprobs"),
        ("/v1/chat/completions", json!({"messages": []}), 400, Some("messages"), "empty"),
        ("/v1/chat/completions", json!({"prompt": "hi"}), 400, Some("messages"), "required"),
        ("/v1/chat/completions", json!({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}), 400, Some("messages"), "image_url"),
    ];
    for (path, body, want_status, param, needle) in cases {
        let (status, v) = json_of(router.post(path, body.clone()).await).await;
        assert_eq!(status, want_status, "{body}: {v}");
        let err = &v["error"];
        assert_eq!(err["param"].as_str(), param, "{body}: {v}");
        assert!(err["message"].as_str().unwrap().contains(needle), "{body}: {v}");
        assert!(err["type"].is_string() && err.get("code").is_some(), "{v}");
    }
    let raw = |body: &'static [u8]| {
        let url = format!("{}/v1/completions", router.http);
        async move { reqwest::Client::new().post(url).header("content-type", "application/json").body(body).send().await.unwrap() }
    };
    let (status, v) = json_of(raw(b"{\"prompt\": \"\xff\xfe\"}").await).await;
    assert_eq!(status, 400);
    assert!(v["error"]["message"].as_str().unwrap().contains("UTF-8"), "{v}");
    let (status, v) = json_of(raw(b"{\"prompt\": ").await).await;
    assert_eq!(status, 400);
    assert!(v["error"]["message"].as_str().unwrap().contains("JSON"), "{v}");
    let (status, _) = json_of(raw(b"{\"prompt\": \"hi\"} trailing").await).await;
    assert_eq!(status, 400);
    assert!(router.mock.record().decodes.is_empty(), "no bad request reached a worker");
    assert_serves(&router).await;
}

#[tokio::test]
async fn bad_grpc_requests_get_clear_errors() {
    let router = start(MockConfig::default(), |_| {}).await;
    let text = |s: &str| Some(generate_request::Prompt::Text(s.into()));
    let cases = [
        (GenerateRequest { prompt: text(""), ..Default::default() }, Code::InvalidArgument, "empty"),
        (GenerateRequest::default(), Code::InvalidArgument, "prompt"),
        (tokens_request(vec![5; 1024], 1), Code::InvalidArgument, "context length"),
        (tokens_request(vec![3_000_000], 1), Code::InvalidArgument, "vocabulary"),
        (GenerateRequest { model: "other".into(), prompt: text("hi"), ..Default::default() }, Code::NotFound, "other"),
        (
            GenerateRequest { prompt: text("hi"), sampling: Some(SamplingParameters { temperature: Some(f32::NAN), ..Default::default() }), ..Default::default() },
            Code::InvalidArgument,
            "temperature",
        ),
        (
            GenerateRequest { prompt: text("hi"), sampling: Some(SamplingParameters { top_logprobs: Some(21), ..Default::default() }), ..Default::default() },
            Code::InvalidArgument,
            "top_logprobs",
        ),
    ];
    for (req, code, needle) in cases {
        let status = generate_all(&router, req.clone()).await.unwrap_err();
        assert_eq!(status.code(), code, "{req:?}: {status:?}");
        assert!(status.message().contains(needle), "{req:?}: {status:?}");
    }
    assert_serves(&router).await;
}

#[tokio::test]
async fn worker_failure_mid_stream_ends_the_request_promptly() {
    let router = start(MockConfig { fail_after: Some(3), ..Default::default() }, |_| {}).await;
    let mut client = router.grpc_client().await;
    let mut stream = client.generate(tokens_request(vec![5], 10)).await.unwrap().into_inner();
    let mut tokens = 0;
    let status = loop {
        match timeout(TIMEOUT, stream.message()).await.expect("no hang") {
            Ok(Some(_)) => tokens += 1,
            Ok(None) => panic!("the stream ended without an error"),
            Err(status) => break status,
        }
    };
    assert_eq!(tokens, 3);
    assert_eq!(status.code(), Code::Unavailable);
    assert!(status.message().contains("decode worker failed"), "{status:?}");

    // Streamed HTTP: the error arrives as an OpenAI error event, then [DONE].
    let body = router.post("/v1/completions", json!({"prompt": [5], "max_tokens": 10, "stream": true, "ignore_eos": true})).await.text().await.unwrap();
    let data = sse_data(&body);
    assert_eq!(data.last().unwrap(), "[DONE]");
    let err: Value = serde_json::from_str(&data[data.len() - 2]).unwrap();
    assert!(err["error"]["message"].as_str().unwrap().contains("decode worker failed"), "{err}");
    // Not streamed: 503.
    let (status, _) = json_of(router.post("/v1/completions", json!({"prompt": [5], "max_tokens": 10, "ignore_eos": true})).await).await;
    assert_eq!(status, 503);
}

#[tokio::test]
async fn worker_death_mid_stream_ends_the_request_and_health() {
    let mut router = start(MockConfig { token_delay: Duration::from_millis(50), ..Default::default() }, |_| {}).await;
    let mut client = router.grpc_client().await;
    let mut stream = client.generate(tokens_request(vec![5], 500)).await.unwrap().into_inner();
    timeout(TIMEOUT, stream.message()).await.unwrap().unwrap().unwrap();
    router.mock.kill();
    let status = timeout(TIMEOUT, async {
        loop {
            match stream.message().await {
                Ok(Some(_)) => continue,
                Ok(None) => panic!("the stream ended without an error"),
                Err(status) => break status,
            }
        }
    })
    .await
    .expect("the request hung after the worker died");
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
    timeout(TIMEOUT, async {
        while router.health().await != 503 {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await
    .expect("health stays 200 after the worker died");
    let status = generate_all(&router, tokens_request(vec![5], 2)).await.unwrap_err();
    assert_eq!(status.code(), Code::Unavailable);
}

#[tokio::test]
async fn health_follows_the_workers() {
    use tonic_health::pb::{health_check_response::ServingStatus, health_client::HealthClient, HealthCheckRequest};
    // Listeners that accept nothing yet: the workers are "starting".
    let decode = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let prefill = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let placeholder = Mock::start(MockConfig::default());
    let mut config = common::router_config(&placeholder);
    config.decode_worker = format!("http://{}", decode.local_addr().unwrap());
    config.prefill_worker = format!("http://{}", prefill.local_addr().unwrap());
    config.worker_timeout_seconds = 0.3;
    let router = common::spawn_router(placeholder, config).await;

    let grpc_status = || async {
        let channel = tonic::transport::Endpoint::from_shared(router.grpc.clone()).unwrap().connect().await.unwrap();
        let mut health = HealthClient::new(channel);
        let req = HealthCheckRequest { service: "duplex.v1.Generation".into() };
        health.check(req).await.unwrap().into_inner().status()
    };
    tokio::time::sleep(Duration::from_millis(1200)).await;
    assert_eq!(router.health().await, 503);
    assert_eq!(grpc_status().await, ServingStatus::NotServing);
    let (status, v) = json_of(router.post("/v1/completions", json!({"prompt": "hi"})).await).await;
    assert_eq!(status, 503);
    assert!(v["error"]["message"].as_str().unwrap().contains("not ready"), "{v}");

    let _workers = Mock::start_on(decode, prefill, MockConfig::default());
    router.wait_ready().await;
    assert_eq!(grpc_status().await, ServingStatus::Serving);
}

#[tokio::test]
async fn short_prompts_are_served_while_the_prefill_worker_is_down() {
    let router = start(MockConfig::default(), |c| c.prefill_threshold_tokens = 32).await;
    router.mock.configure(|c| c.prefill_down = true);
    timeout(TIMEOUT, async {
        while router.health().await != 503 {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await
    .expect("health ignores the prefill worker");
    assert_serves(&router).await;
    let status = generate_all(&router, tokens_request((0..40).collect(), 2)).await.unwrap_err();
    assert_eq!(status.code(), Code::Unavailable);
    assert!(status.message().contains("prefill worker is not ready"), "{status:?}");
    assert!(router.mock.record().allocs.is_empty());
}

#[tokio::test]
async fn metrics_models_model_info_and_tokenize() {
    let router = start(MockConfig::default(), |_| {}).await;
    assert_serves(&router).await;
    let text = reqwest::get(format!("{}/metrics", router.http)).await.unwrap().text().await.unwrap();
    for name in [duplex_telemetry::TIME_TO_FIRST_TOKEN, duplex_telemetry::E2E_REQUEST_LATENCY] {
        assert!(text.contains(&format!("{name}_bucket")), "{name} missing from:\n{text}");
    }
    assert!(text.contains(duplex_telemetry::REQUESTS), "{text}");

    let v: Value = reqwest::get(format!("{}/v1/models", router.http)).await.unwrap().json().await.unwrap();
    assert_eq!(v["object"], "list");
    assert_eq!(v["data"][0]["id"], "tiny-dsv3");
    assert_eq!(v["data"][0]["object"], "model");

    let mut client = router.grpc_client().await;
    let info = client.model_info(duplex_proto::v1::ModelInfoRequest {}).await.unwrap().into_inner();
    assert_eq!((info.model.as_str(), info.vocab_size, info.context_length), ("tiny-dsv3", 2112, 1024));
    assert_eq!((info.prefill_worker_threshold, info.weights_fingerprint.as_str()), (32, "mock-fingerprint"));
    let tokenize = |input| duplex_proto::v1::TokenizeRequest { input: Some(input) };
    let ids = client.tokenize(tokenize(duplex_proto::v1::tokenize_request::Input::Text("Hello".into()))).await.unwrap().into_inner().ids;
    assert_eq!(ids[0], 0);
    let err = client.tokenize(duplex_proto::v1::TokenizeRequest { input: None }).await.unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
}

fn fixture(name: &str) -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures").join(name)
}

/// `chat_template_kwargs` (as vLLM takes it) reaches the template: Qwen3's
/// `enable_thinking: false` appends the empty think block to the generation
/// prompt, through HTTP and through gRPC (a JSON object in a string).
#[tokio::test]
async fn chat_template_kwargs_reach_the_template() {
    let qwen = fixture("tiny-qwen3moe");
    let router = start(MockConfig::default(), |c| c.model = qwen.clone()).await;
    let tok = Tokenizer::from_dir(&qwen).unwrap();
    let user = [duplex_text::tokenizer::ChatMessage::new("user", "Hi")];
    let no_thinking: duplex_text::tokenizer::ChatTemplateKwargs = json!({"enable_thinking": false}).as_object().unwrap().clone();
    let plain = tok.encode_chat(&user, true).unwrap();
    let expected = tok.encode_chat_with(&user, true, &no_thinking).unwrap();
    // `<think>` 2046, "\n\n", `</think>` 2047, "\n\n" after `<|im_start|>assistant\n`.
    assert_eq!(&expected[..plain.len()], &plain[..]);
    let think_block = &expected[plain.len()..];
    assert_eq!((think_block.first(), think_block.get(2)), (Some(&2046), Some(&2047)), "{think_block:?}");

    let body = |kwargs: Value| json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "ignore_eos": true, "chat_template_kwargs": kwargs});
    for (kwargs, prompt) in [(json!({"enable_thinking": false}), &expected), (json!(null), &plain), (json!({}), &plain), (json!({"enable_thinking": true}), &plain)] {
        let (status, reply) = json_of(router.post("/v1/chat/completions", body(kwargs.clone())).await).await;
        assert_eq!(status, 200, "{kwargs}: {reply}");
        assert_eq!(reply["usage"]["prompt_tokens"], prompt.len(), "{kwargs}");
        assert_eq!(&router.mock.record().decodes.last().unwrap().prompt, prompt, "{kwargs}");
    }

    let chat = |kwargs: &str| duplex_proto::v1::ChatMessages {
        messages: vec![duplex_proto::v1::ChatMessage { role: "user".into(), content: "Hi".into() }],
        chat_template_kwargs: kwargs.into(),
    };
    let request = GenerateRequest {
        prompt: Some(generate_request::Prompt::Chat(chat(r#"{"enable_thinking": false}"#))),
        stopping: Some(StoppingCriteria { max_tokens: 2, ignore_eos: true, ..Default::default() }),
        ..Default::default()
    };
    let msgs = generate_all(&router, request).await.unwrap();
    assert_eq!(finished(&msgs).usage.as_ref().unwrap().prompt_tokens as usize, expected.len());
    assert_eq!(&router.mock.record().decodes.last().unwrap().prompt, &expected);
    let tokenize = |kwargs: &str| duplex_proto::v1::TokenizeRequest { input: Some(duplex_proto::v1::tokenize_request::Input::Chat(chat(kwargs))) };
    let mut client = router.grpc_client().await;
    assert_eq!(client.tokenize(tokenize(r#"{"enable_thinking": false}"#)).await.unwrap().into_inner().ids, expected);
    assert_eq!(client.tokenize(tokenize("")).await.unwrap().into_inner().ids, plain);
}

/// A bad `chat_template_kwargs` is a 400 (INVALID_ARGUMENT) naming the field;
/// a template that rejects the messages is a 400 on `messages` with the
/// template's own reason and none of the server's paths.
#[tokio::test]
async fn bad_chat_template_kwargs_and_template_rejections_name_their_field() {
    let router = start(MockConfig::default(), |c| c.model = fixture("tiny-qwen3moe")).await;
    let chat = |kwargs: Value| json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "chat_template_kwargs": kwargs});
    let bad = [
        ("/v1/chat/completions", chat(json!({"add_generation_prompt": false})), "add_generation_prompt"),
        ("/v1/chat/completions", chat(json!({"eos_token": "x"})), "eos_token"),
        ("/v1/chat/completions", chat(json!({"note": "<|im_end|>"})), "special token"),
        ("/v1/chat/completions", chat(json!("enable_thinking=false")), "chat_template_kwargs"),
        ("/v1/chat/completions", chat(json!([1])), "chat_template_kwargs"),
        ("/v1/completions", json!({"prompt": "Hi", "max_tokens": 2, "chat_template_kwargs": {"enable_thinking": false}}), "/v1/chat/completions only"),
    ];
    for (path, body, says) in bad {
        let (status, reply) = json_of(router.post(path, body.clone()).await).await;
        assert_eq!(status, 400, "{body}: {reply}");
        assert_eq!(reply["error"]["param"], "chat_template_kwargs", "{body}: {reply}");
        let message = reply["error"]["message"].as_str().unwrap();
        assert!(message.contains(says), "{body}: {message}");
    }
    assert!(router.mock.record().decodes.is_empty(), "no bad request reached a worker");

    let mut client = router.grpc_client().await;
    for kwargs in [r#"{"enable_thinking": fals"#, "[true]", r#"{"messages": []}"#] {
        let chat = duplex_proto::v1::ChatMessages {
            messages: vec![duplex_proto::v1::ChatMessage { role: "user".into(), content: "Hi".into() }],
            chat_template_kwargs: kwargs.into(),
        };
        let request = GenerateRequest { prompt: Some(generate_request::Prompt::Chat(chat)), ..Default::default() };
        let e = client.generate(request).await.unwrap_err();
        assert_eq!(e.code(), Code::InvalidArgument, "{kwargs}: {e:?}");
        assert!(e.message().contains("chat_template_kwargs"), "{kwargs}: {}", e.message());
    }
    drop(router);

    // Mixtral's [INST] template raises on roles that do not alternate.
    let router = start(MockConfig::default(), |c| c.model = fixture("tiny-mixtral")).await;
    let body = json!({"messages": [{"role": "user", "content": "Hi"}, {"role": "user", "content": "Hi again"}], "max_tokens": 2});
    let (status, reply) = json_of(router.post("/v1/chat/completions", body).await).await;
    assert_eq!(status, 400, "{reply}");
    assert_eq!(reply["error"]["param"], "messages", "{reply}");
    let message = reply["error"]["message"].as_str().unwrap();
    assert!(message.starts_with("the chat template rejected the messages: ") && message.contains("alternate"), "{message}");
    assert!(!message.contains("tokenizer_config.json") && !message.contains("fixtures"), "a server path leaked: {message}");
}

#[tokio::test]
async fn several_choices_each_with_its_own_seed() {
    let router = start(MockConfig::default(), |_| {}).await;
    let body = json!({"prompt": "Hello world", "max_tokens": 4, "seed": 5, "n": 3, "ignore_eos": true});
    let (status, full) = json_of(router.post("/v1/completions", body.clone()).await).await;
    assert_eq!(status, 200, "{full}");
    let choices = full["choices"].as_array().unwrap();
    assert_eq!(choices.iter().map(|c| c["index"].as_u64().unwrap()).collect::<Vec<_>>(), [0, 1, 2]);
    assert!(choices.iter().all(|c| c["finish_reason"] == "length" && !c["text"].as_str().unwrap().is_empty()));
    assert_eq!(full["usage"]["completion_tokens"], 12, "three choices of 4 tokens");
    let prompt_tokens = full["usage"]["prompt_tokens"].as_u64().unwrap();
    assert_eq!(full["usage"]["total_tokens"], prompt_tokens + 12, "the prompt counts once");
    let seeds: Vec<u64> = router.mock.record().decodes.iter().map(|d| d.sampling.as_ref().unwrap().seed).collect();
    assert_eq!(seeds.len(), 3);
    // The first choice is the n = 1 request's, and starts first (the
    // others then find its prompt in the KV cache); all differ.
    assert_eq!(seeds[0], 5);
    assert!(seeds[1] != seeds[2] && !seeds[1..].contains(&5) && !seeds[1..].contains(&6), "{seeds:?}");

    let mut chat = json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "n": 2, "stream": true, "stream_options": {"include_usage": true}, "ignore_eos": true});
    let data = sse_data(&router.post("/v1/chat/completions", chat.clone()).await.text().await.unwrap());
    assert_eq!(data.last().unwrap(), "[DONE]");
    let chunks: Vec<Value> = data[..data.len() - 1].iter().map(|d| serde_json::from_str(d).unwrap()).collect();
    for index in 0..2 {
        let of_choice: Vec<&Value> = chunks.iter().filter_map(|c| c["choices"].get(0)).filter(|c| c["index"] == index).collect();
        assert_eq!(of_choice[0]["delta"]["role"], "assistant", "each choice starts with its role");
        assert_eq!(of_choice.last().unwrap()["finish_reason"], "length");
        assert_eq!(of_choice.iter().filter(|c| !c["finish_reason"].is_null()).count(), 1);
    }
    assert_eq!(chunks.last().unwrap()["usage"]["completion_tokens"], 6);
    assert_eq!(chunks.last().unwrap()["choices"], json!([]));
    chat["n"] = json!(0);
    let (status, v) = json_of(router.post("/v1/chat/completions", chat).await).await;
    assert_eq!((status, v["error"]["param"].as_str()), (400, Some("n")), "{v}");
}

#[tokio::test]
async fn text_offsets_index_the_returned_text() {
    // 'comm', a lone continuation byte (decodes to U+FFFD, released with
    // the next token), 'pect'.
    let mock = MockConfig { script: vec![1064, 98, 990], ..MockConfig::default() };
    let router = start(mock, |_| {}).await;
    let body = json!({"prompt": [5, 6, 7], "max_tokens": 3, "logprobs": 1, "ignore_eos": true});
    let (status, v) = json_of(router.post("/v1/completions", body.clone()).await).await;
    assert_eq!(status, 200, "{v}");
    let text = v["choices"][0]["text"].as_str().unwrap();
    assert_eq!(text, "comm\u{FFFD}pect");
    let lp = &v["choices"][0]["logprobs"];
    assert_eq!(lp["text_offset"], json!([0, 4, 5]));
    let chars: Vec<char> = text.chars().collect();
    for (token, offset) in lp["tokens"].as_array().unwrap().iter().zip(lp["text_offset"].as_array().unwrap()) {
        let rest: String = chars[offset.as_u64().unwrap() as usize..].iter().collect();
        assert!(rest.starts_with(token.as_str().unwrap()), "{token} at {offset} in {text:?}");
    }
    // Streamed: the same offsets, across chunks.
    let mut streamed = body;
    streamed["stream"] = json!(true);
    let data = sse_data(&router.post("/v1/completions", streamed).await.text().await.unwrap());
    let offsets: Vec<Value> = data[..data.len() - 1]
        .iter()
        .map(|d| serde_json::from_str::<Value>(d).unwrap())
        .filter_map(|c| c["choices"].get(0).and_then(|ch| ch["logprobs"]["text_offset"].as_array().cloned()))
        .flatten()
        .collect();
    assert_eq!(offsets, [json!(0), json!(4), json!(5)]);
}

/// The scheduling policy through the router: a long prompt goes to
/// two-device prefill when the prefill worker has it and nothing decodes
/// (here with no idle window), to single-device prefill while a request
/// decodes or when the worker has no second device; the route travels in
/// the Prefill call.
#[tokio::test]
async fn long_prompts_take_dslp_when_decode_is_idle_and_the_worker_has_it() {
    use duplex_proto::worker::PrefillRoute;
    let config = MockConfig { prefill_dslp_devices: 2, token_delay: Duration::from_millis(20), ..Default::default() };
    let router = start(config, |c| {
        c.prefill_threshold_tokens = 32;
        c.dslp_idle_window_seconds = 0.0;
    })
    .await;
    let long: Vec<u32> = (10..50).collect();
    let routes = |router: &common::TestRouter| router.mock.record().prefills.iter().map(|p| p.route()).collect::<Vec<_>>();
    generate_all(&router, tokens_request(long.clone(), 2)).await.unwrap();
    assert_eq!(routes(&router), [PrefillRoute::Dslp], "nothing decoding");

    // A short request decoding for a while (50 tokens, 20 ms apart).
    let slow = {
        let client = router.grpc_client();
        async move { client.await.generate(tokens_request((1..10).collect(), 50)).await.unwrap().into_inner() }
    };
    let mut slow = slow.await;
    router.wait_for("the short request's Decode", |r| r.decodes.len() == 2).await;
    generate_all(&router, tokens_request(long.clone(), 2)).await.unwrap();
    assert_eq!(routes(&router), [PrefillRoute::Dslp, PrefillRoute::Slp], "a request is decoding");
    let mut n = 0;
    while let Some(msg) = timeout(TIMEOUT, slow.message()).await.unwrap().unwrap() {
        n += usize::from(matches!(msg.event, Some(generate_response::Event::Token(_))));
    }
    assert_eq!(n, 50);
    generate_all(&router, tokens_request(long.clone(), 2)).await.unwrap();
    assert_eq!(routes(&router), [PrefillRoute::Dslp, PrefillRoute::Slp, PrefillRoute::Dslp], "decode idle again");
    assert!(router.mock.record().decodes.iter().all(|d| d.prompt.len() == 40 || d.prefilled.is_none()), "short prompts never reach the prefill worker");

    // A prefill worker with one device: single-device prefill, idle or not.
    let router = start(MockConfig::default(), |c| {
        c.prefill_threshold_tokens = 32;
        c.dslp_idle_window_seconds = 0.0;
    })
    .await;
    generate_all(&router, tokens_request(long, 2)).await.unwrap();
    assert_eq!(routes(&router), [PrefillRoute::Slp]);
}

/// A long prompt whose KV lease says the prefix cache holds all but a few of
/// its tokens (a chat's next turn) is prefilled where short prompts are: the
/// router gives the lease back and sends it to the decode worker, which finds
/// the same cached blocks itself. Past the threshold of new tokens it keeps
/// the prefill worker.
#[tokio::test]
async fn a_mostly_cached_long_prompt_is_chunked_on_the_decode_worker() {
    let router = start(MockConfig { cached_tokens: 32, ..Default::default() }, |c| c.prefill_threshold_tokens = 16).await;
    let prompt: Vec<u32> = (10..50).collect(); // 40 tokens, 8 of them not cached
    let msgs = generate_all(&router, tokens_request(prompt.clone(), 3)).await.unwrap();
    assert_eq!(token_ids(&msgs), [40, 41, 42]);
    assert_eq!(finished(&msgs).timings.as_ref().unwrap().prefill_path, "decode");
    {
        let r = router.mock.record();
        assert!(r.prefills.is_empty(), "{r:#?}");
        assert_eq!((r.allocs.len(), r.frees.len(), r.decodes.len()), (1, 1, 1), "{r:#?}");
        assert_eq!(r.frees[0], r.allocs[0].request_id, "the lease is given back");
        assert_eq!((r.decodes[0].prompt.as_slice(), r.decodes[0].prefilled.is_none()), (prompt.as_slice(), true));
        assert!(r.leases.is_empty(), "{r:#?}");
    }

    // 24 new tokens: the prefill worker's, with the lease.
    router.mock.configure(|c| c.cached_tokens = 16);
    let msgs = generate_all(&router, tokens_request(prompt, 3)).await.unwrap();
    assert_eq!(finished(&msgs).timings.as_ref().unwrap().prefill_path, "prefill");
    let r = router.mock.record();
    assert_eq!((r.allocs.len(), r.frees.len(), r.prefills.len(), r.decodes.len()), (2, 1, 1, 2), "{r:#?}");
    assert!(r.decodes[1].prefilled.is_some());
}

/// `/v1/models`'s `max_model_len` and ModelInfo's `context_length` are the
/// longest request the server can run: the context, or less when the
/// decode worker's KV pool holds fewer tokens. The router reads the pool's
/// size from the Stats it polls, so a pool that shrinks shows up within a
/// poll or two.
#[tokio::test]
async fn max_model_len_is_the_context_or_what_the_kv_pool_holds() {
    async fn max_model_len(router: &common::TestRouter) -> u64 {
        let v: Value = reqwest::get(format!("{}/v1/models", router.http)).await.unwrap().json().await.unwrap();
        v["data"][0]["max_model_len"].as_u64().expect("max_model_len is a number")
    }
    async fn context_length(router: &common::TestRouter) -> u32 {
        router.grpc_client().await.model_info(duplex_proto::v1::ModelInfoRequest {}).await.unwrap().into_inner().context_length
    }
    let router = start(MockConfig::default(), |_| {}).await;
    // 256 blocks of 16 tokens hold 4096 tokens: the context of 1024 bounds.
    assert_eq!((max_model_len(&router).await, context_length(&router).await), (1024, 1024));

    // 10 blocks of 16 tokens: the pool bounds.
    router.mock.configure(|c| c.kv_blocks_total = 10);
    let polled = async {
        while max_model_len(&router).await != 160 {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };
    timeout(TIMEOUT, polled).await.expect("max_model_len never became the pool's 160 tokens");
    assert_eq!(context_length(&router).await, 160);
}
