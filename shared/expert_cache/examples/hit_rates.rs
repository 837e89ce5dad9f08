//! Hit rates of the replacement policies on one synthetic trace, to explore
//! the generator's parameters beyond the tables of `tests/policies.rs`:
//!
//! `cargo run -p duplex-expert-cache --example hit_rates -- N K BATCH CAP FAMILY [ZIPF OVERLAP LAYERCORR AFFINITY SEQLEN [STEPS]]`
//!
//! FAMILY is deepseek | qwen | mixtral (the papers' policy defaults); the
//! trace parameters default to `TraceParams::new`'s. Prints the hit rate of
//! each policy, pooled over seeds 11, 22, 33, 4 layers, the first 32 steps
//! not counted; MRS, LRU and LFU make at most 2 swaps a step, the window its u.

use duplex_expert_cache::policy::{ModelFamily, PolicyKind, PolicyParams};
use duplex_expert_cache::trace::{replay, HitCount, TraceGenerator, TraceParams};

fn main() {
    if let Err(e) = run() {
        eprintln!("error: {e}");
        std::process::exit(2);
    }
}

fn run() -> Result<(), String> {
    const USAGE: &str =
        "usage: hit_rates N K BATCH CAP FAMILY [ZIPF OVERLAP LAYERCORR AFFINITY SEQLEN [STEPS]]";
    let a: Vec<String> = std::env::args().skip(1).collect();
    if a.len() < 5 {
        return Err(USAGE.into());
    }
    let num = |i: usize| -> Result<f64, String> {
        a[i].parse::<f64>()
            .map_err(|e| format!("argument {} ({:?}): {e}\n{USAGE}", i + 1, a[i]))
    };
    let int = |i: usize| num(i).map(|x| x as usize);
    let (n, k, batch, cap) = (int(0)?, int(1)?, int(2)?, int(3)?);
    let family: ModelFamily = a[4].parse().map_err(|e| format!("{e}"))?;
    let mut trace = TraceParams::new(n, k, 4, batch);
    if a.len() >= 10 {
        trace.zipf_exponent = num(5)?;
        trace.temporal_overlap = num(6)?;
        trace.layer_correlation = num(7)?;
        trace.sequence_affinity = num(8)?;
        trace.sequence_length = num(9)?;
    }
    let steps = if a.len() > 10 { int(10)? } else { 192 };
    let params = PolicyParams::for_model(n, k, family).map_err(|e| e.to_string())?;
    let traces = [11, 22, 33]
        .map(|seed| TraceGenerator::new(trace, seed).map(|mut g| g.steps(steps)));
    let mut line = String::new();
    for kind in PolicyKind::ALL {
        let max_swaps = match kind {
            PolicyKind::Workload => params.window_swaps(),
            _ => 2,
        };
        let mut total = HitCount::default();
        for t in &traces {
            let t = t.as_ref().map_err(|e| e.to_string())?;
            total.add(replay(kind, &params, t, n, cap, max_swaps, 32)?);
        }
        line += &format!("{kind}={:.3} ", total.rate());
    }
    println!("{}", line.trim_end());
    Ok(())
}
