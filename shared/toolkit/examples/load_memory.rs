//! What `Model::load` costs: wall time and this process's memory after it
//! (peak, and resident split into heap and mapped checkpoint pages). On a
//! hollow checkpoint the mapped pages are the bytes load actually touched.
//!
//! `cargo run --release -p duplex-toolkit --example load_memory -- DIR`

use duplex_model::Model;
use std::time::Instant;

/// `VmHWM`, `VmRSS`, `RssAnon` and `RssFile` of /proc/self/status, in kB.
fn memory() -> String {
    let status = std::fs::read_to_string("/proc/self/status").expect("Linux /proc");
    let kb = |key: &str| -> u64 {
        let line = status.lines().find(|l| l.starts_with(key)).unwrap_or_else(|| panic!("{key} in /proc/self/status"));
        line.split_whitespace().nth(1).and_then(|v| v.parse().ok()).expect("a number of kB")
    };
    let mb = |key: &str| kb(key) as f64 / 1024.0;
    format!("peak {:.0} MiB, resident {:.0} MiB ({:.0} heap, {:.0} mapped files)", mb("VmHWM:"), mb("VmRSS:"), mb("RssAnon:"), mb("RssFile:"))
}

fn main() {
    let dir = std::env::args().nth(1).expect("usage: load_memory CHECKPOINT_DIR");
    println!("before: {}", memory());
    let start = Instant::now();
    let model = Model::load(dir.as_ref(), &mut |_, _| {}).unwrap_or_else(|e| panic!("{dir}: {e}"));
    let elapsed = start.elapsed();
    println!(
        "loaded {} ({} layers, {} modules) in {:.2} s; {}",
        dir,
        model.cfg.num_hidden_layers,
        model.modules.len(),
        elapsed.as_secs_f64(),
        memory()
    );
}
