//! `duplex bench-slp`: how well stream-loading prefill hides weight transfer
//! behind compute, on the emulated accelerator with a limited copy bandwidth.
//!
//! Per layer it reports the copy engine's transfer time, the compute
//! stream's kernel time, the measured time, and the overlap efficiency
//! max(transfer, compute) ÷ measured, which is 1 when the shorter of the two
//! is hidden entirely (per layer it can exceed 1: with a full ring, part of a
//! layer's transfer happens during the previous layer; the whole pass's
//! figure is max(Σ transfer, Σ compute) ÷ Σ measured). The emulated device computes far slower than a GPU,
//! so a PCIe figure would make every layer compute-bound and the test
//! trivial; by default the bandwidth is instead set so that transfer equals
//! compute (measured first with unlimited bandwidth), where overlap is
//! hardest to get and matters most.
//!
//! With `--devices 2` (or more) it measures two-device prefill (DSLP)
//! against one-device SLP instead: each emulated device with one compute
//! thread and a copy engine of its own paced at the same bandwidth (PCIe
//! links are per device), runs interleaved A/B, prompt tokens/s as min /
//! median / max and the ratio of the medians, next to the paper's 1.64×;
//! then, from DSLP's last run, the bytes per link of SmallEP against
//! classic expert parallelism, and per layer the ranks' compute, transfer
//! and exchange time.

use crate::{load_progress, ModelArgs, PoolArgs};
use anyhow::Result;
use clap::Args;
use duplex_kernels::device::emulated::{EmulatedConfig, EmulatedDevice};
use duplex_model::{BlockTable, Logits, Model};
use duplex_kernels::device::Device;
use duplex_prefill::dslp::{DslpEngine, DslpReport};
use duplex_prefill::slp::{SlpConfig, SlpEngine, SlpReport};
use std::sync::Arc;
use std::time::{Duration, Instant};

#[derive(Args)]
pub struct BenchSlpArgs {
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    pool: PoolArgs,
    /// Prompt length.
    #[arg(long, default_value_t = 512)]
    tokens: usize,
    /// Host→device bandwidth of the emulated copy engine in GB/s [default: transfer = compute].
    #[arg(long)]
    h2d_gb_per_s: Option<f64>,
    /// Emulated device memory in MiB (touched only as used).
    #[arg(long, default_value_t = 8192)]
    device_memory_mib: usize,
    /// Device memory for non-expert weights, in MiB.
    #[arg(long, default_value_t = 1024)]
    dense_budget_mib: usize,
    /// Devices: 2 or more compares two-device prefill (DSLP) with one-device SLP.
    #[arg(long, default_value_t = 1)]
    devices: usize,
    /// Interleaved runs of each side, with `--devices`.
    #[arg(long, default_value_t = 3)]
    repeats: usize,
}

fn secs(d: Duration) -> f64 {
    d.as_secs_f64()
}

/// One prefill of `tokens` with SLP on a fresh emulated device.
fn run(model: &Model, args: &BenchSlpArgs, tokens: &[u32], rate: Option<f64>, ring_slots: Option<usize>) -> Result<(SlpReport, Duration)> {
    let device = emulated(args, rate, model.cpu.pool.threads())?;
    let engine = SlpEngine::new(model, device, SlpConfig { ring_slots, ..slp_config(args) })?;
    let mut kv = model.new_kv_pool(tokens.len().div_ceil(16), 16);
    let started = Instant::now();
    let (_, report) = engine.run(model, &mut kv, &mut BlockTable::default(), tokens, args.model.dtype, Logits::Last, &mut || false)?;
    Ok((report, started.elapsed()))
}

fn print(label: &str, report: &SlpReport, wall: Duration, tokens: usize) {
    println!("\n{label}: ring of {} slots ({:.1} MiB), {:.1} MB streamed, compute stalled {:.3} s, {:.1} prompt tokens/s", report.ring_slots, report.ring_bytes as f64 / (1 << 20) as f64, report.bytes_streamed as f64 / 1e6, secs(report.stall), tokens as f64 / secs(wall));
    println!("| layer | transfer (ms) | compute (ms) | measured (ms) | overlap efficiency |");
    println!("| --- | --- | --- | --- | --- |");
    for (l, t) in report.layers.iter().enumerate() {
        println!("| {l} | {:.1} | {:.1} | {:.1} | {:.2} |", secs(t.transfer) * 1e3, secs(t.compute) * 1e3, secs(t.measured) * 1e3, t.overlap_efficiency());
    }
    let sum = |f: fn(&duplex_prefill::slp::LayerTiming) -> Duration| report.layers.iter().map(f).sum::<Duration>();
    println!("| all | {:.1} | {:.1} | {:.1} | {:.2} |", secs(sum(|t| t.transfer)) * 1e3, secs(sum(|t| t.compute)) * 1e3, secs(sum(|t| t.measured)) * 1e3, report.overlap_efficiency());
}

/// An emulated device with `compute_threads` and a copy engine paced at `rate` bytes/s.
fn emulated(args: &BenchSlpArgs, rate: Option<f64>, compute_threads: usize) -> Result<Arc<dyn Device>> {
    Ok(EmulatedDevice::new(EmulatedConfig { memory_bytes: args.device_memory_mib << 20, h2d_bytes_per_second: rate, compute_threads, jitter: None })?)
}

fn slp_config(args: &BenchSlpArgs) -> SlpConfig {
    SlpConfig { dense_budget_bytes: args.dense_budget_mib << 20, ..Default::default() }
}

/// `(min, median, max)`.
fn spread(xs: &mut [f64]) -> (f64, f64, f64) {
    xs.sort_by(f64::total_cmp);
    (xs[0], xs[xs.len() / 2], xs[xs.len() - 1])
}

/// DSLP on `args.devices` devices against SLP on one, interleaved.
fn compare_devices(model: &Model, args: &BenchSlpArgs, tokens: &[u32]) -> Result<()> {
    let rate = match args.h2d_gb_per_s {
        Some(gb) => gb * 1e9,
        None => {
            let engine = SlpEngine::new(model, emulated(args, None, 1)?, slp_config(args))?;
            let mut kv = model.new_kv_pool(tokens.len().div_ceil(16), 16);
            let (_, report) = engine.run(model, &mut kv, &mut BlockTable::default(), tokens, args.model.dtype, Logits::Last, &mut || false)?;
            let compute: Duration = report.layers.iter().map(|t| t.compute).sum();
            report.layers.iter().map(|t| t.bytes).sum::<u64>() as f64 / secs(compute).max(1e-9)
        }
    };
    println!("each device: 1 compute thread, its own copy engine at {:.2} GB/s{}", rate / 1e9, if args.h2d_gb_per_s.is_none() { " (one device's transfer ≈ compute)" } else { "" });
    let one = SlpEngine::new(model, emulated(args, Some(rate), 1)?, slp_config(args))?;
    let devices = (0..args.devices).map(|_| emulated(args, Some(rate), 1)).collect::<Result<Vec<_>>>()?;
    let many = DslpEngine::new(model, devices, slp_config(args))?;
    let (mut slp_rates, mut dslp_rates, mut last) = (vec![], vec![], DslpReport::default());
    for _ in 0..args.repeats.max(1) {
        let mut kv = model.new_kv_pool(tokens.len().div_ceil(16), 16);
        let started = Instant::now();
        one.run(model, &mut kv, &mut BlockTable::default(), tokens, args.model.dtype, Logits::Last, &mut || false)?;
        slp_rates.push(tokens.len() as f64 / secs(started.elapsed()));
        let mut kv = model.new_kv_pool(tokens.len().div_ceil(16), 16);
        let started = Instant::now();
        let (_, report) = many.run(model, &mut kv, &mut BlockTable::default(), tokens, args.model.dtype, Logits::Last, &mut || false)?;
        dslp_rates.push(tokens.len() as f64 / secs(started.elapsed()));
        last = report;
    }
    let (s, d) = (spread(&mut slp_rates), spread(&mut dslp_rates));
    println!("\n| prefill | prompt tokens/s min / median / max |");
    println!("| --- | --- |");
    println!("| SLP, 1 device | {:.1} / {:.1} / {:.1} |", s.0, s.1, s.2);
    println!("| DSLP, {} devices | {:.1} / {:.1} / {:.1} |", args.devices, d.0, d.1, d.2);
    println!("\nDSLP ÷ SLP (medians): {:.2}× (the paper: 1.64× on two RTX 5090s)", d.1 / s.1);

    let (kv, gather, reduce, classic) = last.bytes();
    let moe_layers = last.exchange.iter().filter(|l| l.gather_bytes > 0).count().max(1) as f64;
    let links = args.devices as f64;
    println!("\nbytes per link per MoE layer: SmallEP {:.3} MB (all-gather {:.3} + all-to-all {:.3}), classic EP {:.3} MB ({:.2}× SmallEP); KV exchange {:.3} MB per link per layer", (gather + reduce) as f64 / links / moe_layers / 1e6, gather as f64 / links / moe_layers / 1e6, reduce as f64 / links / moe_layers / 1e6, classic as f64 / links / moe_layers / 1e6, classic as f64 / (gather + reduce).max(1) as f64, kv as f64 / links / last.exchange.len().max(1) as f64 / 1e6);
    println!("\n| layer | compute per rank (ms) | transfer per rank (ms) | measured per rank (ms) | exchange, all ranks (ms) | SmallEP bytes | classic EP bytes |");
    println!("| --- | --- | --- | --- | --- | --- | --- |");
    let ms = |d: Duration| format!("{:.1}", secs(d) * 1e3);
    for (l, x) in last.exchange.iter().enumerate() {
        let per_rank = |f: fn(&duplex_prefill::slp::LayerTiming) -> Duration| last.ranks.iter().map(|r| r.layers.get(l).map_or("-".into(), |t| ms(f(t)))).collect::<Vec<_>>().join(" / ");
        println!("| {l} | {} | {} | {} | {} | {} | {} |", per_rank(|t| t.compute), per_rank(|t| t.transfer), per_rank(|t| t.measured), ms(x.time), x.gather_bytes + x.reduce_bytes, x.standard_ep_bytes);
    }
    Ok(())
}

pub fn run_bench(args: BenchSlpArgs) -> Result<()> {
    let dir = &args.model.model;
    let (bar, mut progress) = load_progress(dir);
    let model = Model::load_source(&args.model.source()?, &args.pool.config()?, &mut progress)?;
    bar.finish_and_clear();
    let vocab = model.cfg.vocab_size.min(2048);
    let tokens: Vec<u32> = (0..args.tokens).map(|i| ((i * 7919 + 13) % vocab) as u32).collect();
    println!("{}: {} layers, {} routed experts a layer, {}-token prompt, {:?}, {} compute threads", dir.display(), model.cfg.num_hidden_layers, model.cfg.n_routed_experts, tokens.len(), args.model.dtype, model.cpu.pool.threads());
    if args.devices >= 2 {
        return compare_devices(&model, &args, &tokens);
    }

    let rate = match args.h2d_gb_per_s {
        Some(gb) => gb * 1e9,
        None => {
            // Calibrate: compute time and bytes per layer with transfer free.
            let (report, _) = run(&model, &args, &tokens, None, None)?;
            let compute: Duration = report.layers.iter().map(|t| t.compute).sum();
            let bytes: u64 = report.layers.iter().map(|t| t.bytes).sum();
            bytes as f64 / secs(compute).max(1e-9)
        }
    };
    println!("emulated host→device bandwidth: {:.2} GB/s{}", rate / 1e9, if args.h2d_gb_per_s.is_none() { " (transfer ≈ compute)" } else { "" });
    for (label, ring) in [("full ring (one layer's experts)", None), ("ping-pong ring (2 slots)", Some(2))] {
        let (report, wall) = run(&model, &args, &tokens, Some(rate), ring)?;
        print(label, &report, wall, tokens.len());
    }
    Ok(())
}
