//! `duplex simulate` end to end, in seconds: the shipped paper node with the
//! tiny DeepSeek-V3 fixture (real weights), its tables and chart, and a
//! hollow checkpoint of a config alone; clear errors for what it cannot use.

use std::path::Path;
use std::process::{Command, Output};

fn duplex(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_duplex")).args(args).output().expect("duplex runs")
}

fn fixture(name: &str) -> String {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures").join(name).to_string_lossy().into_owned()
}

/// The table rows of `section` in `out`: the cells of each row after the header.
fn rows(out: &str, section: &str) -> Vec<Vec<String>> {
    let body = out.split(section).nth(1).unwrap_or_else(|| panic!("no {section} in:\n{out}"));
    body.lines()
        .skip_while(|l| !l.starts_with("| ---"))
        .skip(1)
        .take_while(|l| l.starts_with('|'))
        .map(|l| l.trim_matches('|').split('|').map(|c| c.trim().to_string()).collect())
        .collect()
}

fn number(cell: &str) -> f64 {
    cell.trim_end_matches('×').parse().unwrap_or_else(|_| panic!("{cell:?} is not a number"))
}

#[test]
fn simulates_prefill_and_decode_on_the_paper_node() {
    let plot = tempfile::NamedTempFile::with_suffix(".svg").unwrap();
    let plot_path = plot.path().to_string_lossy().into_owned();
    let out = duplex(&["simulate", "--hardware", "paper-node", "--model", &fixture("tiny-dsv3"), "--prompts", "64,256", "--contexts", "32,200", "--batches", "1,2", "--threads", "64", "--plot", &plot_path]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}\n{}", String::from_utf8_lossy(&out.stderr));
    let prefill = rows(&text, "## Prefill");
    assert_eq!(prefill.len(), 2, "{text}");
    for r in &prefill {
        let (cpu, slp, dslp) = (number(&r[1]), number(&r[2]), number(&r[5]));
        assert!(cpu > 0.0 && slp > 0.0 && dslp > 0.0, "{r:?}");
    }
    // A 4× longer prompt takes longer on every placement.
    assert!(number(&prefill[1][1]) > number(&prefill[0][1]) && number(&prefill[1][2]) > number(&prefill[0][2]), "{prefill:?}");
    let decode = rows(&text, "## Decode");
    assert_eq!(decode.len(), 4, "{text}");
    for r in &decode {
        assert!(number(&r[2]) > 0.0 && number(&r[3]) > 0.0, "{r:?}");
    }
    let svg = std::fs::read_to_string(plot.path()).unwrap();
    for label in ["SLP, 1 device", "DSLP", "CPU, batch 1", "hybrid, batch 2"] {
        assert!(svg.contains(label), "the chart has a line for {label}");
    }
}

#[test]
fn a_config_alone_gets_a_hollow_checkpoint_and_bad_input_is_refused() {
    let scratch = tempfile::tempdir().unwrap();
    let config_only = tempfile::tempdir().unwrap();
    std::fs::copy(Path::new(&fixture("tiny-qwen3moe")).join("config.json"), config_only.path().join("config.json")).unwrap();
    let model = config_only.path().to_string_lossy().into_owned();
    let scratch_dir = scratch.path().to_string_lossy().into_owned();
    // A context past the model's positions is a row that says so, not a failure.
    let out = duplex(&["simulate", "--hardware", "rtx4090-workstation", "--model", &model, "--scratch", &scratch_dir, "--workload", "decode", "--contexts", "64,1000000", "--batches", "1"]);
    assert!(out.status.success(), "{}\n{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    let decode = rows(&String::from_utf8_lossy(&out.stdout), "## Decode");
    assert_eq!(decode.len(), 2);
    assert!(decode[1][2].contains("longer than the model's"), "{decode:?}");
    let written: Vec<_> = std::fs::read_dir(scratch.path()).unwrap().collect();
    assert_eq!(written.len(), 1, "one hollow checkpoint in the scratch directory");

    let bad = duplex(&["simulate", "--hardware", "no-such-machine", "--model", &model]);
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("paper-node"), "the error names the shipped descriptions: {}", String::from_utf8_lossy(&bad.stderr));
    let zero = duplex(&["simulate", "--model", &model, "--scratch", &scratch_dir, "--batches", "0"]);
    assert!(!zero.status.success());
    assert!(String::from_utf8_lossy(&zero.stderr).contains("at least 1"), "{}", String::from_utf8_lossy(&zero.stderr));
    let nothing = duplex(&["simulate", "--model", &scratch_dir]);
    assert!(!nothing.status.success());
    assert!(String::from_utf8_lossy(&nothing.stderr).contains("config.json"), "{}", String::from_utf8_lossy(&nothing.stderr));
}

/// `duplex simulate --workload W --out F` on the tiny fixture and the paper
/// node, with prompts of 128 tokens or more sent to the prefill worker: the
/// report's JSON.
fn serve(workload: &str, extra: &[&str]) -> serde_json::Value {
    let json = tempfile::NamedTempFile::with_suffix(".json").unwrap();
    let (path, model) = (json.path().to_string_lossy().into_owned(), fixture_dsv3());
    let mut args = vec!["simulate", "--hardware", "paper-node", "--model", &model, "--threads", "64", "--workload", workload, "--set", "prefill_threshold_tokens=128", "--out", &path];
    args.extend(extra);
    let out = duplex(&args);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}\n{}", String::from_utf8_lossy(&out.stderr));
    assert!(text.contains("## Serving") && text.contains("Where the time went"), "{text}");
    serde_json::from_str(&std::fs::read_to_string(json.path()).unwrap()).unwrap()
}

fn fixture_dsv3() -> String {
    fixture("tiny-dsv3")
}

/// The samples of run `name` of kind `kind`.
fn samples<'a>(report: &'a serde_json::Value, name: &str, kind: &str) -> Vec<&'a serde_json::Value> {
    let run = report["runs"].as_array().unwrap().iter().find(|r| r["name"] == name).unwrap_or_else(|| panic!("no run {name}"));
    run["samples"].as_array().unwrap().iter().filter(|s| s["kind"] == kind).collect()
}

fn ms(sample: &serde_json::Value, field: &str) -> f64 {
    sample[field].as_f64().unwrap_or_else(|| panic!("{field} in {sample}"))
}

#[test]
fn serving_scenarios_route_by_the_policy_and_batch_decodes_on_virtual_time() {
    let report = serve("scenarios", &["--scenario", "1P+2D", "--long-prompt-tokens", "300", "--short-prompt-tokens", "8", "--decode-tokens", "24"]);
    let names: Vec<&str> = report["runs"].as_array().unwrap().iter().map(|r| r["name"].as_str().unwrap()).collect();
    assert_eq!(names, ["1P", "1D", "1P+2D"], "the mix and its baselines");
    for run in report["runs"].as_array().unwrap() {
        for s in run["samples"].as_array().unwrap() {
            assert!(s.get("error").is_none(), "{s}");
            let want = if s["kind"] == "P" { 2 } else { 24 };
            assert_eq!(s["output_tokens"], want, "{s}");
            assert!(ms(s, "e2e_ms") >= ms(s, "ttft_ms") && ms(s, "ttft_ms") > 0.0, "{s}");
        }
    }
    // Nothing had decoded when P came alone: both devices. In the mix the
    // decodes had just run: one device, by the policy's idle window.
    let (alone, mixed) = (samples(&report, "1P", "P")[0], samples(&report, "1P+2D", "P")[0]);
    assert_eq!((alone["prefill_path"].as_str(), mixed["prefill_path"].as_str()), (Some("dslp"), Some("slp")));
    assert!(ms(mixed, "ttft_ms") > ms(alone, "ttft_ms"), "one device takes longer than two");
    // Two decodes share each step: each token comes later, but not twice as late.
    let (one, two) = (ms(samples(&report, "1D", "D")[0], "tpot_ms"), ms(samples(&report, "1P+2D", "D")[0], "tpot_ms"));
    assert!(two > one && two < 2.0 * one, "TPOT alone {one} ms, two at once {two} ms");
}

#[test]
fn open_loop_serving_sends_at_poisson_times_and_refuses_what_it_cannot_simulate() {
    let report = serve("open", &["--rate", "4", "--requests", "6", "--prompt-tokens", "uniform:8-300", "--output-tokens", "4", "--seed", "3"]);
    let s = samples(&report, "open", "open");
    assert_eq!(s.len(), 6);
    assert!(s.windows(2).all(|w| ms(w[0], "start_s") <= ms(w[1], "start_s")), "arrivals in order");
    assert!(s.iter().all(|s| s["output_tokens"] == 4 && s.get("error").is_none()), "{s:?}");
    let routes: Vec<&str> = s.iter().map(|s| s["prefill_path"].as_str().unwrap()).collect();
    assert!(routes.contains(&"decode_chunked") && routes.iter().any(|r| *r != "decode_chunked"), "short prompts chunked, long ones to the prefill worker: {routes:?}");

    let model = fixture_dsv3();
    let one_device = duplex(&["simulate", "--hardware", "rtx4090-workstation", "--model", &model, "--workload", "scenarios"]);
    assert!(!one_device.status.success());
    assert!(String::from_utf8_lossy(&one_device.stderr).contains("a prefill device and a decode device"), "{}", String::from_utf8_lossy(&one_device.stderr));
    let unknown = duplex(&["simulate", "--model", &model, "--workload", "open", "--set", "no_such_setting=1"]);
    assert!(!unknown.status.success());
    assert!(String::from_utf8_lossy(&unknown.stderr).contains("no_such_setting: neither a router nor a decode-worker setting"), "{}", String::from_utf8_lossy(&unknown.stderr));
    let bad = duplex(&["simulate", "--model", &model, "--workload", "open", "--set", "dslp_idle_window_seconds=-1"]);
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("dslp_idle_window_seconds"), "{}", String::from_utf8_lossy(&bad.stderr));
}

#[test]
fn chat_turns_resend_the_conversation_and_face_a_fresh_prompt_each() {
    let report = serve("chat", &["--chat-turns", "3", "--chat-first-tokens", "300", "--chat-message-tokens", "40", "--chat-answer-tokens", "20"]);
    let turns = report["workload"]["per_turn"].as_array().unwrap();
    let lengths: Vec<u64> = turns.iter().map(|t| t["prompt_tokens"].as_u64().unwrap()).collect();
    assert_eq!(lengths, [300, 360, 420], "each turn resends the last one, its answer and a new message");
    for t in turns {
        assert!(ms(t, "ttft_ms") > 0.0 && ms(t, "fresh_ttft_ms") > 0.0, "{t}");
    }
    for turn in 1..=3 {
        let chat = samples(&report, &format!("turn {turn}"), "chat");
        assert_eq!(chat[0]["output_tokens"], 20);
    }
    // Turn 2 finds turn 1's prompt cached: its 60 new tokens, below the
    // threshold, are chunked on the decode worker instead of streaming
    // every weight through SLP as its fresh twin does.
    let (cached, fresh) = (samples(&report, "turn 2", "chat")[0], samples(&report, "turn 2", "fresh")[0]);
    assert_eq!((cached["prefill_path"].as_str(), fresh["prefill_path"].as_str()), (Some("decode_chunked"), Some("slp")));
    assert!(ms(cached, "ttft_ms") < ms(fresh, "ttft_ms"), "{cached} {fresh}");
}
