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

use crate::{load_progress, ModelArgs, PoolArgs};
use anyhow::Result;
use clap::Args;
use duplex_kernels::device::emulated::{EmulatedConfig, EmulatedDevice};
use duplex_model::{BlockTable, Logits, Model};
use duplex_prefill::slp::{SlpConfig, SlpEngine, SlpReport};
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
}

fn secs(d: Duration) -> f64 {
    d.as_secs_f64()
}

/// One prefill of `tokens` with SLP on a fresh emulated device.
fn run(model: &Model, args: &BenchSlpArgs, tokens: &[u32], rate: Option<f64>, ring_slots: Option<usize>) -> Result<(SlpReport, Duration)> {
    let threads = model.cpu.pool.threads();
    let device = EmulatedDevice::new(EmulatedConfig { memory_bytes: args.device_memory_mib << 20, h2d_bytes_per_second: rate, compute_threads: threads, jitter: None })?;
    let engine = SlpEngine::new(model, device, SlpConfig { ring_slots, dense_budget_bytes: args.dense_budget_mib << 20, ..Default::default() })?;
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

pub fn run_bench(args: BenchSlpArgs) -> Result<()> {
    let dir = &args.model.model;
    let (bar, mut progress) = load_progress(dir);
    let model = Model::load_with(dir, &args.pool.config()?, &mut progress)?;
    bar.finish_and_clear();
    let vocab = model.cfg.vocab_size.min(2048);
    let tokens: Vec<u32> = (0..args.tokens).map(|i| ((i * 7919 + 13) % vocab) as u32).collect();
    println!("{}: {} layers, {} routed experts a layer, {}-token prompt, {:?}, {} compute threads", dir.display(), model.cfg.num_hidden_layers, model.cfg.n_routed_experts, tokens.len(), args.model.dtype, model.cpu.pool.threads());

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
