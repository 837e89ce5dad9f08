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
