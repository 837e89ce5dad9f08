//! The router's scheduling policy end to end (§3.3.2 of the cloud-grade-SLO
//! paper), on a real `duplex serve` whose prefill worker has two emulated
//! devices: a short prompt is prefilled in chunks by the decode worker; a
//! long one goes to two-device prefill once nothing has decoded for the idle
//! window, and to single-device stream-loading prefill while a request
//! decodes. Each gives the CPU engine's greedy tokens, and the router's
//! `duplex_prefill_route_total` counts each route.

use duplex_tests::{collect, generate_cli, greedy_request, prompt, runtime, serial, v1, within, Options, Server};
use std::time::Duration;

/// `n` prompt tokens starting `offset` tokens into the reference prompt, so
/// that prompts with different offsets share no prefix (and so no cached
/// KV block): each is prefilled in full.
fn prompt_from(offset: usize, n: usize) -> Vec<u32> {
    prompt(offset + n)[offset..].to_vec()
}

#[test]
fn short_prompts_chunk_on_decode_long_ones_take_dslp_when_decode_is_idle_and_slp_while_it_runs() {
    let _serial = serial();
    let short = prompt_from(3, 40);
    let long_idle = prompt_from(0, 300);
    let long_busy = prompt_from(7, 300);
    let decoding = prompt_from(11, 20);
    // The F32 CPU engine's tokens: stream-loading prefill matches it bit for
    // bit, two-device prefill to rounding (F32 within 2e-3).
    let expected = |p: &[u32], n: usize| generate_cli(p, n, "f32");
    let (short_want, idle_want, busy_want, decoding_want) = (expected(&short, 8), expected(&long_idle, 8), expected(&long_busy, 8), expected(&decoding, 200));

    let window = Duration::from_secs(1);
    let server = Server::start(Options {
        prefill_threshold_tokens: 64,
        slp_threshold_tokens: Some(64),
        prefill_devices: 2,
        dslp_idle_window_seconds: window.as_secs_f64(),
        dtype: "f32",
        ..Options::default()
    });
    assert!(server.log().contains("two-device prefill (DSLP) on 2 devices"), "{}", server.log());
    let router_metrics = format!("{}/metrics", server.http);
    let routes = |route: &'static str| {
        let (server, url) = (&server, &router_metrics);
        async move { server.metric(url, "duplex_prefill_route_total", &format!("route=\"{route}\"")).await.unwrap_or(0.0) }
    };
    runtime().block_on(async {
        let mut client = server.grpc_client().await;

        // Short: chunked prefill on the decode worker.
        let (ids, _, finished) = within(60, "short prompt", collect(&mut client, greedy_request(&short, 8))).await.unwrap();
        assert_eq!(ids, short_want, "short prompt");
        assert_eq!(finished.timings.unwrap().prefill_path, "decode");
        assert_eq!((routes("decode_chunked").await, routes("slp").await, routes("dslp").await), (1.0, 0.0, 0.0));

        // Long, after the idle window: two-device prefill.
        tokio::time::sleep(window + Duration::from_millis(500)).await;
        let (ids, _, finished) = within(120, "long prompt, decode idle", collect(&mut client, greedy_request(&long_idle, 8))).await.unwrap();
        assert_eq!(ids, idle_want, "long prompt on two-device prefill");
        assert_eq!(finished.timings.unwrap().prefill_path, "prefill");
        assert_eq!((routes("decode_chunked").await, routes("slp").await, routes("dslp").await), (1.0, 0.0, 1.0));
        assert_eq!(server.log().matches("two-device prefill on 2 devices:").count(), 1, "{}", server.log());

        // Long, while another request decodes: single-device prefill. The
        // decoding request's stream is read no further than its first token
        // until the long prompt is done, so it is still on the decode worker
        // (the router waits on this client) whatever the speeds.
        let mut decoding_client = server.grpc_client().await;
        let mut stream = decoding_client.generate(greedy_request(&decoding, 200)).await.unwrap().into_inner();
        let first = within(60, "the decoding request's first token", stream.message()).await.unwrap().unwrap();
        let Some(v1::generate_response::Event::Token(first)) = first.event else { panic!("expected a token, got {first:?}") };
        let (ids, _, finished) = within(120, "long prompt, decode busy", collect(&mut client, greedy_request(&long_busy, 8))).await.unwrap();
        assert_eq!(ids, busy_want, "long prompt on stream-loading prefill");
        assert_eq!(finished.timings.unwrap().prefill_path, "prefill");
        assert_eq!((routes("decode_chunked").await, routes("slp").await, routes("dslp").await), (2.0, 1.0, 1.0));
        assert_eq!(server.log().matches("two-device prefill on 2 devices:").count(), 1, "no second two-device prefill");
        assert!(server.log().contains("stream-loading prefill: ring"), "{}", server.log());

        // The decoding request, read to its end, is undisturbed.
        let mut ids = vec![first.id];
        while let Some(message) = within(60, "the decoding request's tokens", stream.message()).await.unwrap() {
            if let Some(v1::generate_response::Event::Token(t)) = message.event {
                ids.push(t.id);
            }
        }
        assert_eq!(ids, decoding_want, "the request decoding meanwhile");

        // Each decision is logged with its reason.
        let log = server.log();
        for (route, reason) in [("decode_chunked", "below prefill_threshold_tokens (64)"), ("dslp", "no request has decoded for"), ("slp", "a request is decoding")] {
            assert!(log.lines().any(|l| l.contains("prefill route") && l.contains(&format!("route=\"{route}\"")) && l.contains(reason)), "no {route} decision saying {reason:?} in:\n{log}");
        }
    });
}
