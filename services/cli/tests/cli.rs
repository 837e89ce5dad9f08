//! The `duplex` binary end to end, on the bundled tiny model.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tiny-dsv3")
}

fn duplex(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_duplex")).args(args).output().expect("duplex runs")
}

fn json_of(out: &Output) -> serde_json::Value {
    assert!(out.status.success(), "stderr: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).expect("one JSON object")
}

fn reference_prompt(i: usize) -> (String, Vec<u64>) {
    let r: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(fixture().join("reference.json")).unwrap()).unwrap();
    let p = &r["prompts"][i];
    let ids: Vec<String> = p["input_ids"].as_array().unwrap().iter().map(|v| v.to_string()).collect();
    (ids.join(","), p["greedy_continuation"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap()).collect())
}

#[test]
fn greedy_generate_json_reproduces_reference() {
    let (tokens, want) = reference_prompt(0);
    let n = want.len().to_string();
    let out = duplex(&["generate", "--tokens", &tokens, "--dtype", "f32", "--temperature", "0", "--ignore-eos", "--max-tokens", &n, "--json"]);
    let json = json_of(&out);
    let got: Vec<u64> = json["tokens"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap()).collect();
    assert_eq!(got, want);
    assert_eq!(json["prompt_tokens"], 23);
    assert_eq!(json["finish_reason"], "length");
    assert!(json["ttft_ms"].as_f64().unwrap() > 0.0);
    assert!(json["decode_tokens_per_s"].as_f64().unwrap() > 0.0);
    assert!(json["text"].is_string());
}

#[test]
fn seeded_sampling_is_reproducible() {
    let run = |seed: &str| json_of(&duplex(&["generate", "--prompt", "Hello", "--temperature", "1.0", "--seed", seed, "--max-tokens", "12", "--ignore-eos", "--json"]))["tokens"].clone();
    assert_eq!(run("7"), run("7"));
    assert_ne!(run("7"), run("8"));
}

#[test]
fn chat_and_prompt_inputs_and_streaming_text() {
    let out = duplex(&["generate", "--chat", "Hi", "--system", "Be brief", "--max-tokens", "4", "--json"]);
    let json = json_of(&out);
    // BOS + system text + <｜User｜> + "Hi" + <｜Assistant｜>.
    assert!(json["prompt_tokens"].as_u64().unwrap() >= 4);
    let streamed = duplex(&["generate", "--prompt", "Hello world", "--max-tokens", "6", "--seed", "1", "--ignore-eos"]);
    assert!(streamed.status.success());
    let json = json_of(&duplex(&["generate", "--prompt", "Hello world", "--max-tokens", "6", "--seed", "1", "--ignore-eos", "--json"]));
    assert_eq!(String::from_utf8_lossy(&streamed.stdout).trim_end_matches('\n'), json["text"].as_str().unwrap());
}

#[test]
fn logits_file_matches_reference() {
    let (tokens, _) = reference_prompt(1);
    let dir = tempfile::tempdir().unwrap();
    let out_path = dir.path().join("logits.safetensors");
    let out = duplex(&["logits", "--tokens", &tokens, "--dtype", "f32", "--out", out_path.to_str().unwrap()]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let got = std::fs::read(&out_path).unwrap();
    let got = safetensors::SafeTensors::deserialize(&got).unwrap();
    let got = got.tensor("logits").unwrap();
    assert_eq!(got.shape(), &[23, 2112]);
    let want = std::fs::read(fixture().join("reference_logits.safetensors")).unwrap();
    let want = safetensors::SafeTensors::deserialize(&want).unwrap();
    let want = want.tensor("logits.1").unwrap();
    let f = |b: &[u8]| b.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect::<Vec<_>>();
    let max = f(got.data()).iter().zip(f(want.data())).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max);
    assert!(max <= 2e-3, "max |Δlogit| {max}");
}

/// `--override-kv` on a GGUF: the logits follow the overridden YaRN beta;
/// a malformed override, one of a Hugging Face model, and a `duplex serve`
/// whose workers were given different ones are refused before anything runs.
#[test]
fn metadata_overrides_reach_the_model_and_bad_ones_are_refused() {
    let gguf = fixture().join("../tiny-dsv3-q4km/model-Q4_K_M.gguf");
    let dir = tempfile::tempdir().unwrap();
    let logits = |extra: &[&str]| -> Vec<u8> {
        let out_path = dir.path().join("logits.safetensors");
        let args = [&["logits", "--model", gguf.to_str().unwrap(), "--tokens", "1,2,3,4,5,6,7,8,9,10,11,12", "--dtype", "f32", "--out", out_path.to_str().unwrap()], extra].concat();
        let out = duplex(&args);
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        std::fs::read(&out_path).unwrap()
    };
    let plain = logits(&[]);
    assert_ne!(logits(&["--override-kv", "deepseek2.rope.scaling.yarn_beta_fast=float:4"]), plain);
    for (args, needle) in [
        (vec!["logits", "--model", gguf.to_str().unwrap(), "--tokens", "1", "--out", "/dev/null", "--override-kv", "deepseek2.rope.scaling.yarn_beta_fast=4"], "KEY=TYPE:VALUE"),
        (vec!["generate", "--tokens", "1", "--override-kv", "a.b=float:1"], "is a Hugging Face model"),
    ] {
        let out = duplex(&args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && stderr.contains(needle), "{args:?}: {stderr}");
    }
    let config = dir.path().join("workers.toml");
    std::fs::write(&config, "[decode]\noverride_kv = [\"a.b=float:1\"]\n[prefill]\noverride_kv = [\"a.b=float:2\"]\n").unwrap();
    let out = duplex(&["serve", "--config", config.to_str().unwrap(), "--model", gguf.to_str().unwrap(), "--shm-dir", dir.path().to_str().unwrap(), "--http-port", "0"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && stderr.contains("override_kv differs between [decode]") && stderr.contains("a.b=float:2"), "{stderr}");
    assert!(std::fs::read_dir(dir.path()).unwrap().all(|e| !e.unwrap().file_name().to_string_lossy().starts_with("duplex")), "serve left segments behind");
}

#[test]
fn bad_input_is_a_clear_error() {
    let cases: &[(&[&str], &str)] = &[
        (&["generate", "--tokens", "0,99999"], "out of range"),
        (&["generate", "--tokens", "0,abc"], "not a token id"),
        (&["generate", "--tokens", ","], "no token ids"),
        (&["generate", "--prompt", "hi", "--temperature", "-1"], "temperature"),
        (&["generate", "--prompt", "hi", "--top-p", "1.5"], "top_p"),
        (&["generate", "--prompt", "hi", "--max-tokens", "0"], "max_tokens"),
        (&["generate", "--prompt", "hi", "--stop", ""], "stop"),
        (&["generate", "--prompt", "hi", "--model", "/nonexistent/model"], "/nonexistent/model"),
        (&["generate", "--prompt", "hi", "--dtype", "f8"], "dtype"),
        (&["logits", "--tokens", "1", "--out", "/nonexistent/dir/x.safetensors"], "/nonexistent/dir"),
    ];
    for (args, needle) in cases {
        let out = duplex(args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} should fail");
        assert!(stderr.contains(needle), "{args:?}: {stderr}");
        assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
    }
}

#[test]
fn bench_engine_is_the_engine_benchmark_and_bench_the_load_generator() {
    let help = duplex(&["bench-engine", "--help"]);
    assert!(help.status.success() && String::from_utf8_lossy(&help.stdout).contains("--contexts"));
    // `bench` checks its flags before it looks for a server.
    let cases: &[(&[&str], &str)] = &[
        (&["bench"], "--scenario <SCENARIO>|--rate <RATE>"),
        (&["bench", "--scenario", "3D"], "unknown scenario \"3D\""),
        (&["bench", "--scenario", "all", "--rate", "2"], "cannot be used with"),
        (&["bench", "--rate", "2"], "--duration or --requests"),
        (&["bench", "--rate", "2", "--requests", "5", "--prompt-tokens", "uniform:400-100"], "MIN must not exceed MAX"),
        (&["bench", "--rate", "2", "--requests", "5", "--output-tokens", "zipf:1"], "unknown distribution \"zipf\""),
        (&["bench", "--scenario", "1P", "--plot", "chart.png"], "ending in .svg"),
        (&["bench-engine", "--decode-tokens", "0"], "at least 1"),
        (&["bench-engine", "--contexts", "64,0"], "at least 1"),
        (&["bench-engine", "--decode-rounds", "0"], "--decode-rounds"),
    ];
    for (args, needle) in cases {
        let out = duplex(args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} should fail");
        assert!(stderr.contains(needle), "{args:?}: {stderr}");
    }
    // The engine benchmark on the bundled model: the best of its decode
    // rounds against the roofline, where each step's time goes, and prefill.
    let out = duplex(&["bench-engine", "--contexts", "8", "--decode-tokens", "2", "--decode-rounds", "2", "--prefill", "8", "--buffer-mib", "16"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}{}", String::from_utf8_lossy(&out.stderr));
    for needle in ["best of 2 rounds", "| decode, batch 1, context 8 |", "| decode step, context |", "\n| 8 |", "| prefill, 8 tokens |"] {
        assert!(stdout.contains(needle), "{needle:?} missing from:\n{stdout}");
    }
}

/// A copy of the binary installed under `<prefix>/bin`, with the bundled
/// model under `<prefix>/share/duplex/tiny-dsv3`, finds that model, wherever
/// it is run from: the default is resolved at run time, not compiled in.
#[test]
fn an_installed_binary_finds_the_bundled_model_beside_it() {
    let prefix = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(prefix.path().join("bin")).unwrap();
    let share = prefix.path().join("share/duplex/tiny-dsv3");
    std::fs::create_dir_all(&share).unwrap();
    for entry in std::fs::read_dir(fixture()).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), share.join(entry.file_name())).unwrap();
    }
    let exe = prefix.path().join("bin/duplex");
    // Copied by a `cp` child, not `std::fs::copy`: a write descriptor open in
    // this process would be inherited by any child another test thread forks
    // meanwhile, and exec of the copy then fails with ETXTBSY ("Text file busy")
    // until that child execs. The descriptor in `cp` is never shared.
    let copied = Command::new("cp").arg(env!("CARGO_BIN_EXE_duplex")).arg(&exe).status().unwrap();
    assert!(copied.success(), "cp of the binary failed");
    let out = Command::new(&exe).args(["generate", "--help"]).current_dir("/").output().unwrap();
    let help = String::from_utf8_lossy(&out.stdout);
    assert!(help.contains(&share.display().to_string()), "the default model should be the installed copy:\n{help}");
    let out = Command::new(&exe).args(["generate", "--tokens", "1,2,3", "--max-tokens", "2", "--json"]).current_dir("/").output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
}

#[test]
fn a_missing_model_directory_is_a_clear_error() {
    let out = duplex(&["generate", "--model", "/nonexistent/model", "--tokens", "1"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("/nonexistent/model is not a model directory"), "{err}");
}

/// `duplex bench-decode` on the bundled model: the configurations'
/// per-layer times, overlap efficiencies and throughputs (graph steps,
/// streamed steps without graphs, deferral), the batch-2 ÷ batch-1 ratio
/// next to the paper's, and graph ÷ streamed; zero lengths, and a deferral of as
/// many experts as a token has, are refused by name.
#[test]
fn bench_decode_reports_overlap_and_throughput() {
    let bad: [(&[&str], &str); 4] = [
        (&["--steps", "0"], "--steps must be at least 1"),
        (&["--rounds", "0"], "--rounds must be at least 1"),
        (&["--context", "0"], "--context must be at least 1"),
        // The bundled model routes each token to 4 experts.
        (&["--defer", "4"], "--defer 4 must be less than the model's 4 routed experts per token"),
    ];
    for (args, needle) in bad {
        let out = duplex(&[&["bench-decode"], args].concat());
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} should fail");
        assert!(stderr.contains(needle), "{args:?}: {stderr}");
    }
    let out = duplex(&["bench-decode", "--context", "8", "--steps", "2", "--rounds", "2"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}{}", String::from_utf8_lossy(&out.stderr));
    // The cells of the table row that starts with `label`, after `after`.
    let cells = |label: &str, after: &str| -> Vec<String> {
        let rest = &stdout[stdout.find(after).unwrap_or_else(|| panic!("{after:?} missing from:\n{stdout}"))..];
        let line = rest.lines().find(|l| l.starts_with(&format!("| {label} |"))).unwrap_or_else(|| panic!("no row {label:?} after {after:?} in:\n{stdout}"));
        line.trim_matches('|').split('|').map(|c| c.trim().to_string()).collect()
    };
    // `min / median / max`, in order.
    let spread = |cell: &str| -> Vec<f64> {
        let v: Vec<f64> = cell.split(" / ").map(|x| x.parse().unwrap_or_else(|_| panic!("{cell:?} is not min / median / max"))).collect();
        assert!(v.len() == 3 && v[0] <= v[1] && v[1] <= v[2], "{cell:?}");
        v
    };
    assert!(stdout.contains("dtype Bf16, context 8, 2 decode steps × 2 rounds"), "{stdout}");
    assert!(stdout.contains("expert deferral: 2 of 4 routed experts per token at batch 1"), "{stdout}");
    for label in ["batch 1", "batch 2, two micro-batches", "batch 2, one batch", "batch 1, streamed without a graph", "batch 2, two micro-batches, streamed without a graph", "batch 1, expert deferral"] {
        let row = cells(label, "| overlap efficiency");
        assert_eq!(row.len(), 6, "{row:?}");
        for ms in [&row[1], &row[2], &row[3]] {
            assert!(spread(ms)[0] > 0.0, "{label}: {row:?}");
        }
        for e in spread(&row[4]) {
            assert!(e > 0.0 && e < 1.5, "{label}: overlap efficiency {e}");
        }
        let tps = cells(label, "| tokens/s");
        assert!(spread(&tps[1])[0] > 0.0, "{label}: {tps:?}");
    }
    let capture = stdout.lines().find(|l| l.starts_with("Capturing a step as a graph")).unwrap_or_else(|| panic!("no capture time in:\n{stdout}"));
    let batch1 = capture.split("batch 1 ").nth(1).and_then(|r| r.split(", batch 2").next()).unwrap_or_else(|| panic!("{capture}"));
    assert!(spread(batch1)[0] > 0.0, "{capture}");
    let paper = cells("batch 2 (two micro-batches) ÷ batch 1", "| ratio of tokens/s");
    assert!(spread(&paper[1])[0] > 0.0, "{paper:?}");
    assert_eq!(paper[2], "paper: 1.56×");
    for label in ["batch 1 with expert deferral ÷ batch 1", "batch 1, a graph per step ÷ streamed without", "batch 2 (two micro-batches), a graph per step ÷ streamed without"] {
        let ratio = cells(label, "| ratio of tokens/s");
        assert!(spread(&ratio[1])[0] > 0.0, "{ratio:?}");
    }
}
