//! `duplex bench`, the load generator, against a real `duplex serve` on the
//! tiny model: every closed-loop scenario once, and a short open-loop run,
//! each writing its JSON report and SVG chart.

use duplex_tests::{duplex_bin, Options, Server};
use std::io::Read;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Run `duplex` with `args`; its exit status, stdout and stderr. Killed
/// after `seconds`, so that a hang fails the test instead of stalling CI.
fn duplex(args: &[&str], seconds: u64) -> (std::process::ExitStatus, String, String) {
    let mut child = Command::new(duplex_bin()).args(args).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().expect("start duplex");
    let pipes: [Box<dyn Read + Send>; 2] = [Box::new(child.stdout.take().unwrap()), Box::new(child.stderr.take().unwrap())];
    let readers: Vec<_> = pipes
        .into_iter()
        .map(|mut pipe| {
            std::thread::spawn(move || {
                let mut text = String::new();
                pipe.read_to_string(&mut text).unwrap();
                text
            })
        })
        .collect();
    let deadline = Instant::now() + Duration::from_secs(seconds);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("duplex {args:?} took more than {seconds} s");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let mut texts = readers.into_iter().map(|r| r.join().unwrap());
    (status, texts.next().unwrap(), texts.next().unwrap())
}

fn read_json(path: &std::path::Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(path).expect("--out was written")).expect("--out is JSON")
}

fn assert_svg(path: &std::path::Path) {
    let svg = std::fs::read_to_string(path).expect("--plot was written");
    assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"), "not an SVG: {}", &svg[..svg.len().min(200)]);
}

#[test]
fn scenarios_and_open_loop_against_a_server() {
    let server = Server::start(Options::default());
    let dir = tempfile::tempdir().unwrap();
    let (json, svg) = (dir.path().join("bench.json"), dir.path().join("bench.svg"));

    // Every scenario once (--scenario-seconds 0), with a shorter P so that it
    // stays quick on a loaded machine; D is calibrated against it.
    let args = ["bench", "--target", &server.grpc, "--scenario", "all", "--scenario-seconds", "0", "--long-prompt-tokens", "300"];
    let (status, stdout, stderr) = duplex(&[&args[..], &["--out", json.to_str().unwrap(), "--plot", svg.to_str().unwrap()]].concat(), 120);
    assert!(status.success(), "duplex bench failed:\n{stderr}\n{stdout}\nserver log:\n{}", server.log());
    assert!(stderr.contains("calibrated: P (300 + 1 tokens)"), "{stderr}");
    assert!(stdout.starts_with("| scenario | kind | requests | TTFT p50 / p90 / p99 (ms) |"), "{stdout}");
    for row in ["| 1P | P | 1 |", "| 1D | D | 1 |", "| 1P+1D | P | 1 |", "| 1P+1D | D | 1 |", "| 2D | D | 2 |", "| 1P+2D | P | 1 |", "| 1P+2D | D | 2 |"] {
        assert!(stdout.contains(row), "no row {row:?} in:\n{stdout}");
    }
    assert!(stdout.contains("1.00× TTFT") && stdout.contains("1.00× TPOT"), "{stdout}");

    let report = read_json(&json);
    assert_eq!(report["target"], server.grpc.as_str());
    assert_eq!(report["context_length"], 1024);
    let workload = &report["workload"];
    assert_eq!(workload["mode"], "closed");
    assert_eq!(workload["long_prompt_tokens"], 300);
    let decode_tokens = workload["decode_tokens"].as_u64().unwrap();
    assert!((2..=1024 - 16).contains(&decode_tokens), "{workload}");
    assert!(workload["calibration"]["long_e2e_ms"].as_f64().unwrap() > 0.0);
    let runs = report["runs"].as_array().unwrap();
    let names: Vec<&str> = runs.iter().map(|r| r["name"].as_str().unwrap()).collect();
    assert_eq!(names, ["1P", "1D", "1P+1D", "2D", "1P+2D"]);
    for run in runs {
        assert!(run["errors"].as_object().unwrap().is_empty(), "{run}");
        for sample in run["samples"].as_array().unwrap() {
            let (kind, tokens) = (sample["kind"].as_str().unwrap(), sample["output_tokens"].as_u64().unwrap());
            match kind {
                "P" => assert_eq!((sample["prompt_tokens"].as_u64(), tokens), (Some(300), 1), "{sample}"),
                "D" => assert_eq!((sample["prompt_tokens"].as_u64(), tokens), (Some(16), decode_tokens), "{sample}"),
                _ => panic!("unexpected kind in {sample}"),
            }
            assert!(sample["ttft_ms"].as_f64().unwrap() <= sample["e2e_ms"].as_f64().unwrap());
        }
        for kind in run["kinds"].as_array().unwrap() {
            let slowdown = &kind["slowdown"];
            let metric = if kind["kind"] == "P" { "ttft" } else { "tpot" };
            assert!(slowdown[metric].as_f64().unwrap() > 0.0, "{kind}");
            assert!(kind["e2e_ms"]["p99"].as_f64().unwrap() >= kind["e2e_ms"]["p50"].as_f64().unwrap());
        }
    }
    assert_svg(&svg);

    // Open loop: Poisson arrivals, lengths drawn from distributions.
    let args = ["bench", "--target", &server.grpc, "--rate", "20", "--requests", "8", "--prompt-tokens", "uniform:8-64", "--output-tokens", "normal:8,2"];
    let (status, stdout, stderr) = duplex(&[&args[..], &["--out", json.to_str().unwrap(), "--plot", svg.to_str().unwrap()]].concat(), 60);
    assert!(status.success(), "duplex bench failed:\n{stderr}\n{stdout}");
    assert!(stdout.contains("| open | open | 8 |") && stdout.contains("| open | 8 | 0 |"), "{stdout}");
    let report = read_json(&json);
    assert_eq!(report["workload"]["mode"], "open");
    assert_eq!(report["workload"]["prompt_tokens"], "uniform:8-64");
    let samples = report["runs"][0]["samples"].as_array().unwrap();
    assert_eq!(samples.len(), 8);
    assert!(samples.iter().all(|s| (8..=64).contains(&s["prompt_tokens"].as_u64().unwrap())), "{samples:?}");
    assert_svg(&svg);
}
