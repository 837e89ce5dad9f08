//! The simulated CPU against the real CPU engine on this machine: calibrate
//! this machine (quick), predict a prefill of 512 tokens and the decode
//! steps that follow it (context 512) with [`SimCpu`], and time the real
//! CPU backend on the same model in the same process, three times
//! interleaved. Prints both, their ratio and where the predicted time went.
//!
//! `cargo run -p duplex-sim --example cpu_vs_real -- [MODEL_DIR] [--full]`
//! (default `/tmp/bench-synth`, from `duplex synth --preset bench`; `--full`
//! calibrates with the full, slower measurements).

use duplex_kernels::clock;
use duplex_model::backend::Backend;
use duplex_model::kv_cache::{BlockTable, KvPool};
use duplex_model::model::{ForwardTimings, Logits, Model, Precision, SeqInput};
use duplex_model::weights::HostWeight;
use duplex_sim::calibrate::{self, Calibration};
use duplex_sim::cpu::SimCpu;
use std::path::PathBuf;
use std::time::{Duration, Instant};

const CONTEXT: usize = 512;
/// Decode steps timed after each prefill.
const DECODE_STEPS: usize = 4;
const REPS: usize = 3;
const PRECISION: Precision = Precision::Bf16;

/// Min, median and max.
fn spread(mut xs: Vec<Duration>) -> (Duration, Duration, Duration) {
    xs.sort();
    (xs[0], xs[xs.len() / 2], xs[xs.len() - 1])
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// One pass of `tokens` after the sequence's cache, on `backend`; returns
/// where its (real) time went.
fn pass<B: Backend<Weight = HostWeight>>(model: &Model, backend: B, pool: &mut KvPool, table: &mut BlockTable, tokens: &[u32]) -> ForwardTimings {
    let mut timings = ForwardTimings::default();
    let seqs = &mut [SeqInput { table, tokens }];
    model.forward_batch_on(backend, pool, seqs, PRECISION, Logits::Last, &mut timings, 0).expect("forward pass");
    timings
}

fn per_kind_delta(after: &[(&'static str, Duration)], before: &[(&'static str, Duration)]) -> Vec<(&'static str, Duration)> {
    after
        .iter()
        .map(|&(k, t)| (k, t - before.iter().find(|(b, _)| *b == k).map_or(Duration::ZERO, |&(_, b)| b)))
        .filter(|(_, t)| !t.is_zero())
        .collect()
}

fn print_kinds(what: &str, kinds: &[(&'static str, Duration)]) {
    let total: Duration = kinds.iter().map(|&(_, t)| t).sum();
    let parts: Vec<String> = kinds.iter().map(|(k, t)| format!("{k} {:.2} ms ({:.0}%)", ms(*t), 100.0 * t.as_secs_f64() / total.as_secs_f64())).collect();
    println!("  predicted {what}, by kind: {}", parts.join(", "));
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let dir = PathBuf::from(args.iter().find(|a| !a.starts_with("--")).map_or("/tmp/bench-synth", String::as_str));
    let quick = !args.iter().any(|a| a == "--full");

    let t0 = Instant::now();
    let hw = calibrate::this_machine(&Calibration { quick, ..Calibration::default() }).expect("calibration");
    println!("calibrated in {:.1} s: {}", t0.elapsed().as_secs_f64(), hw.notes);
    let model = Model::load(&dir, &mut |_, _| {}).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    let threads = model.cpu.pool.threads();
    let vocab = model.cfg.vocab_size;
    let prompt: Vec<u32> = (0..CONTEXT).map(|i| ((i * 7919 + 13) % vocab) as u32).collect();
    let next: Vec<u32> = (0..DECODE_STEPS).map(|i| ((i * 104_729 + 5) % vocab) as u32).collect();
    let blocks = (CONTEXT + DECODE_STEPS).div_ceil(16) + 1;
    println!("model {} on {threads} thread(s), {PRECISION:?}; prefill {CONTEXT} tokens, then {DECODE_STEPS} decode steps from context {CONTEXT}", dir.display());

    // The prediction: deterministic, once.
    let sim = SimCpu::new(hw.cpu.clone(), threads, 1);
    let mut pool = model.new_kv_pool(blocks, 16);
    let mut table = BlockTable::default();
    clock::set(Some(Duration::ZERO));
    pass(&model, sim.backend(), &mut pool, &mut table, &prompt);
    let predicted_prefill = clock::now().unwrap();
    let after_prefill = sim.per_kind();
    let mut predicted_decode = vec![];
    for &t in &next {
        let start = clock::now().unwrap();
        pass(&model, sim.backend(), &mut pool, &mut table, &[t]);
        predicted_decode.push(clock::now().unwrap() - start);
    }
    clock::set(None);
    pool.release(&mut table);
    let decode_kinds = per_kind_delta(&sim.per_kind(), &after_prefill);
    let decode_kinds: Vec<(&'static str, Duration)> = decode_kinds.iter().map(|&(k, t)| (k, t / DECODE_STEPS as u32)).collect();

    // The real engine, interleaved: each rep a prefill and its decode steps.
    let (mut prefills, mut decodes) = (vec![], vec![]);
    let (mut real_prefill_split, mut real_decode_split) = (ForwardTimings::default(), ForwardTimings::default());
    for _ in 0..REPS {
        let mut table = BlockTable::default();
        let t = Instant::now();
        real_prefill_split = pass(&model, model.cpu.backend(), &mut pool, &mut table, &prompt);
        prefills.push(t.elapsed());
        for &tok in &next {
            let t = Instant::now();
            real_decode_split = pass(&model, model.cpu.backend(), &mut pool, &mut table, &[tok]);
            decodes.push(t.elapsed());
        }
        pool.release(&mut table);
    }

    let report = |what: &str, predicted: Duration, real: Vec<Duration>, split: ForwardTimings, kinds: &[(&'static str, Duration)]| {
        let (min, median, max) = spread(real);
        // The real split is by module: the FFN's (router, shared and routed
        // experts, dense MLPs) and the attention module's (its projections,
        // norms, rotations and attention itself); the LM head is in neither.
        let ffn = kinds.iter().filter(|(k, _)| ["experts", "router", "route"].contains(k)).map(|&(_, t)| t).sum::<Duration>();
        println!("{what}: predicted {:.2} ms; real min {:.2} / median {:.2} / max {:.2} ms; predicted ÷ median {:.3} (÷ min {:.3})", ms(predicted), ms(min), ms(median), ms(max), predicted.as_secs_f64() / median.as_secs_f64(), predicted.as_secs_f64() / min.as_secs_f64());
        println!("  FFN: predicted {:.2} ms (experts, router, route), real {:.2} ms; attention module: real {:.2} ms, predicted with the LM head and the rest {:.2} ms (real runs: the last)", ms(ffn), ms(split.ffn), ms(split.attention), ms(predicted - ffn));
        print_kinds(what, kinds);
    };
    let predicted_decode_median = spread(predicted_decode).1;
    report(&format!("prefill {CONTEXT}"), predicted_prefill, prefills, real_prefill_split, &after_prefill);
    report(&format!("decode at {CONTEXT}"), predicted_decode_median, decodes, real_decode_split, &decode_kinds);
}
