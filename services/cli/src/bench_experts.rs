//! `duplex bench-decode --expert-cache N`: the decode device's expert cache
//! (HybriMoE, DALI) against the static placement (every routed expert on the
//! CPU), on the emulated accelerator.
//!
//! Each configuration is an engine of its own with a cache of N routed
//! experts (a fraction of the model's), its copies paced to
//! `--h2d-gb-per-s` as over PCIe, its compute threads on a core apart from
//! the CPU pool's. The configurations decode the same tokens round by round,
//! interleaved, and every ratio over static is taken within a round. Also
//! reported: the hit rate, experts per layer on each side, bytes prefetched
//! and wasted, the assignment's predicted against measured layer time, and
//! the time spent deciding per layer (its overhead).

use crate::bench_decode::{decode, mib, placement, spread, BenchDecodeArgs, Pinning, Placement, Round};
use anyhow::{Context, Result};
use duplex_expert_cache::assign::AssignmentKind;
use duplex_expert_cache::policy::PolicyKind;
use duplex_expert_cache::prefetch::PrefetchKind;
use duplex_model::device_experts::ExpertCacheConfig;
use duplex_model::hybrid::Submit;
use duplex_model::{BlockTable, KvPool, ModelConfig};
use std::io::Write;

/// The settings compared: the three assignments (no prefetch, MRS), each
/// prefetch with the two dynamic assignments, and the other policies with HybriMoE.
fn settings(experts: usize) -> Vec<(String, ExpertCacheConfig)> {
    let base = ExpertCacheConfig { experts, assignment: AssignmentKind::Static, prefetch: PrefetchKind::None, policy: PolicyKind::Mrs };
    let mut out = vec![];
    for assignment in [AssignmentKind::Static, AssignmentKind::HybriMoe, AssignmentKind::Dali] {
        out.push(ExpertCacheConfig { assignment, ..base });
    }
    for assignment in [AssignmentKind::HybriMoe, AssignmentKind::Dali] {
        for prefetch in [PrefetchKind::Impact, PrefetchKind::Residual] {
            out.push(ExpertCacheConfig { assignment, prefetch, ..base });
        }
    }
    for policy in [PolicyKind::Workload, PolicyKind::Lru, PolicyKind::Lfu] {
        out.push(ExpertCacheConfig { assignment: AssignmentKind::HybriMoe, policy, ..base });
    }
    out.into_iter().map(|c| (format!("{} / prefetch {} / {}", c.assignment, c.prefetch, c.policy), c)).collect()
}

#[allow(clippy::too_many_arguments)]
pub fn run(args: &BenchDecodeArgs, cfg: &ModelConfig, pin: &Option<Pinning>, kv_blocks: usize, (positions, cores): (usize, usize), host: &mut KvPool, tables: &mut [BlockTable], first: &[Vec<f32>]) -> Result<()> {
    let precision = args.model.dtype;
    let moe_layers = (0..cfg.num_hidden_layers).filter(|&l| cfg.is_moe_layer(l)).count();
    let all_experts = moe_layers * cfg.n_routed_experts;
    let settings = settings(args.expert_cache);
    let mut placements: Vec<Placement> = vec![];
    for (_, cache) in &settings {
        placements.push(placement(args, pin, (true, 0, Submit::Host, Some(*cache)), kv_blocks, positions, host, tables)?);
    }
    let mut out = std::io::stdout().lock();
    let cost = *placements[0].engine.expert_cache().context("the engine was built with an expert cache")?.cost();
    writeln!(
        out,
        "{}: {} layers ({moe_layers} MoE), hidden {}, {} routed experts (top {}), dtype {precision:?}, context {}, batch {}, {} decode steps × {} rounds interleaved; {}, {} compute thread(s) of its own; routed experts on a CPU pool of {} thread(s); {cores} cores, {}",
        args.model.model.display(),
        cfg.num_hidden_layers,
        cfg.hidden_size,
        cfg.n_routed_experts,
        cfg.num_experts_per_tok,
        args.context,
        args.batch,
        args.steps,
        args.rounds,
        placements[0].engine.device().describe(),
        args.device_threads,
        args.cpu_threads,
        Pinning::describe(pin)
    )?;
    writeln!(
        out,
        "expert cache: {} of {all_experts} routed experts ({:.1}%), {:.1} MiB; profiled costs per expert (first engine): CPU {:.1} µs + {:.1} µs/token, device {:.1} µs + {:.1} µs/token, copy {:.1} µs\n",
        args.expert_cache,
        100.0 * args.expert_cache as f64 / all_experts.max(1) as f64,
        mib(placements[0].engine.budget().experts),
        cost.cpu_fixed * 1e6,
        cost.cpu_per_token * 1e6,
        cost.device_fixed * 1e6,
        cost.device_per_token * 1e6,
        cost.transfer * 1e6
    )?;
    // One unmeasured round each: workspaces, pages, and a cache that fills.
    for p in placements.iter_mut() {
        decode(p, host, tables, first, args.context, args.batch, args.steps, precision)?;
    }
    let mut rounds: Vec<Vec<Round>> = settings.iter().map(|_| vec![]).collect();
    for _ in 0..args.rounds {
        for (p, r) in placements.iter_mut().zip(rounds.iter_mut()) {
            r.push(decode(p, host, tables, first, args.context, args.batch, args.steps, precision)?);
        }
    }
    writeln!(out, "| setting (assignment / prefetch / policy) | tokens/s | ÷ static, within each round | hit rate | experts per layer: device / CPU | prefetched MiB (wasted) | layer ms: predicted / measured | deciding µs per layer |")?;
    writeln!(out, "| --- | --- | --- | --- | --- | --- | --- | --- |")?;
    for ((label, _), rs) in settings.iter().zip(&rounds) {
        let sum = rs.iter().fold(Round::default(), |mut a, r| {
            a.cache += r.cache;
            a
        });
        let c = sum.cache;
        let layers = c.layers.max(1) as f64;
        writeln!(
            out,
            "| {label} | {} | {} | {:.2} | {:.2} / {:.2} | {:.1} ({:.1}) | {:.3} / {:.3} | {:.1} |",
            spread(rs.iter().map(Round::tokens_per_s).collect(), 2),
            spread(rs.iter().zip(&rounds[0]).map(|(x, s)| x.tokens_per_s() / s.tokens_per_s()).collect(), 2),
            c.hits as f64 / c.lookups.max(1) as f64,
            c.device_experts as f64 / layers,
            c.cpu_experts as f64 / layers,
            mib(c.prefetched_bytes as usize),
            mib(c.wasted_bytes as usize),
            c.predicted.as_secs_f64() * 1e3 / layers,
            c.measured.as_secs_f64() * 1e3 / layers,
            c.deciding.as_secs_f64() * 1e6 / layers
        )?;
    }
    for p in placements {
        let Placement { mut engine, seqs, .. } = p;
        for s in seqs {
            engine.release(s)?;
        }
    }
    Ok(())
}
