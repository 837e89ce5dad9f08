//! `duplex bench-slp --devices 2` end to end on the bundled tiny model, in
//! about a second: two-device prefill against one-device SLP, SmallEP's
//! bytes per link against classic expert parallelism's, and the per-layer
//! split, each read back as numbers.

use std::path::Path;
use std::process::Command;

/// The number before `unit` in the text that follows `label` in `line`.
fn number_after(line: &str, label: &str, unit: &str) -> f64 {
    let rest = &line[line.find(label).unwrap_or_else(|| panic!("no {label:?} in {line:?}")) + label.len()..];
    let value = rest.split(unit).next().unwrap().trim();
    value.parse().unwrap_or_else(|_| panic!("{value:?} after {label:?} in {line:?} is not a number"))
}

/// The cells of the table row of `out` that starts with `label`.
fn row(out: &str, label: &str) -> Vec<String> {
    let line = out.lines().find(|l| l.starts_with(&format!("| {label} |"))).unwrap_or_else(|| panic!("no row {label:?} in:\n{out}"));
    line.trim_matches('|').split('|').map(|c| c.trim().to_string()).collect()
}

/// `a / b / …` as numbers.
fn per_part(cell: &str) -> Vec<f64> {
    cell.split(" / ").map(|x| x.parse().unwrap_or_else(|_| panic!("{cell:?} is not numbers split by ' / '"))).collect()
}

#[test]
fn two_devices_against_one_report_the_ratio_smallep_bytes_and_the_layers() {
    let model = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tiny-dsv3");
    let out = Command::new(env!("CARGO_BIN_EXE_duplex"))
        .args(["bench-slp", "--devices", "2", "--tokens", "64", "--repeats", "1", "--threads", "1", "--model"])
        .arg(&model)
        .output()
        .expect("duplex runs");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}\n{}", String::from_utf8_lossy(&out.stderr));
    let config: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(model.join("config.json")).unwrap()).unwrap();
    let layers = config["num_hidden_layers"].as_u64().unwrap() as usize;
    let dense_layers = config["first_k_dense_replace"].as_u64().unwrap() as usize;

    // Calibrated so that one device's transfer about equals its compute.
    let device_line = text.lines().find(|l| l.starts_with("each device:")).unwrap_or_else(|| panic!("no device line in:\n{text}"));
    assert!(number_after(device_line, "its own copy engine at", "GB/s") > 0.0, "{device_line}");

    // Prompt tokens/s, one run each: min = median = max.
    let median = |label: &str| {
        let spread = per_part(&row(&text, label)[1]);
        assert!(spread.len() == 3 && spread[0] > 0.0 && spread[0] == spread[1] && spread[1] == spread[2], "{label}: {spread:?} from one run");
        spread[1]
    };
    let (slp, dslp) = (median("SLP, 1 device"), median("DSLP, 2 devices"));
    let ratio_line = text.lines().find(|l| l.starts_with("DSLP ÷ SLP")).unwrap_or_else(|| panic!("no ratio in:\n{text}"));
    let ratio = number_after(ratio_line, "(medians):", "×");
    eprintln!("SLP {slp} tokens/s, DSLP {dslp} tokens/s, DSLP ÷ SLP {ratio}");
    // The ratio is of the medians as printed (each rounded to 0.1).
    assert!((ratio - dslp / slp).abs() <= 0.005 + 0.05 * (1.0 / slp + 1.0 / dslp) * ratio, "{ratio} is not {dslp} ÷ {slp}");

    // Bytes per link per MoE layer: SmallEP's two collectives against classic EP.
    let bytes_line = text.lines().find(|l| l.starts_with("bytes per link per MoE layer:")).unwrap_or_else(|| panic!("no bytes line in:\n{text}"));
    let small_ep = number_after(bytes_line, "SmallEP", "MB");
    let (gather, all_to_all) = (number_after(bytes_line, "all-gather", "+"), number_after(bytes_line, "all-to-all", "),"));
    let classic = number_after(bytes_line, "classic EP", "MB");
    let times = number_after(&bytes_line[bytes_line.find("classic EP").unwrap()..], "MB (", "×");
    let kv = number_after(bytes_line, "KV exchange", "MB");
    eprintln!("per link per MoE layer: SmallEP {small_ep} MB (all-gather {gather} + all-to-all {all_to_all}), classic EP {classic} MB ({times}×), KV {kv} MB");
    assert!(small_ep > 0.0 && kv > 0.0, "{bytes_line}");
    assert!((gather + all_to_all - small_ep).abs() <= 0.002, "{bytes_line}");
    assert!(small_ep < classic, "SmallEP moves less than classic expert parallelism: {bytes_line}");
    assert!((times - classic / small_ep).abs() <= 0.01 * times + 0.02, "{bytes_line}");

    // Per layer: both ranks computed, streamed and were timed; the dense
    // layers exchange no expert rows; SmallEP moves the same bytes in every
    // MoE layer whatever the routing, fewer than classic EP.
    let mut small_ep_bytes = vec![];
    for layer in 0..layers {
        let cells = row(&text, &layer.to_string());
        assert_eq!(cells.len(), 7, "{cells:?}");
        for (what, cell) in [("compute", &cells[1]), ("transfer", &cells[2]), ("measured", &cells[3])] {
            let ranks = per_part(cell);
            assert!(ranks.len() == 2 && ranks.iter().all(|&ms| ms > 0.0), "layer {layer}: {what} per rank {cell:?}");
        }
        let (exchange_ms, small, classic): (f64, u64, u64) = (cells[4].parse().unwrap(), cells[5].parse().unwrap(), cells[6].parse().unwrap());
        assert!(exchange_ms > 0.0, "layer {layer}: the ranks exchanged KV: {cells:?}");
        if layer < dense_layers {
            assert_eq!((small, classic), (0, 0), "dense layer {layer}: {cells:?}");
        } else {
            assert!(small > 0 && small < classic, "MoE layer {layer}: {cells:?}");
            small_ep_bytes.push(small);
        }
    }
    assert!(small_ep_bytes.iter().all(|&b| b == small_ep_bytes[0]), "SmallEP bytes per MoE layer: {small_ep_bytes:?}");
    // The summary is the rows' SmallEP bytes per link (two) per MoE layer.
    let from_rows = small_ep_bytes[0] as f64 / 2.0 / 1e6;
    assert!((from_rows - small_ep).abs() <= 0.0005, "{small_ep} MB against {from_rows} MB from the rows");
}
