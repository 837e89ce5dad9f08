//! The simulated CPU against the real CPU engine on this machine: predict a
//! prefill of 512 tokens and the decode steps that follow it (context 512)
//! with [`SimCpu`] from a calibration of this machine (quick), and time the
//! real CPU backend on the same model in the same process. Three rounds,
//! each a calibration, its prediction and the real runs, so that a noisy
//! neighbour (this machine's cores are shared) weighs on both alike. Prints
//! both, their ratios and where the predicted time went.
//!
//! `cargo run -p duplex-sim --example cpu_vs_real -- [MODEL_DIR] [--full]`
//! (default `/tmp/bench-synth`, from `duplex synth --preset bench`; `--full`
//! calibrates with the full, slower measurements).

use duplex_kernels::clock;
use duplex_model::backend::Backend;
use duplex_model::kv_cache::{BlockTable, KvPool};
use duplex_model::model::{ForwardTimings, Logits, Model, Precision, SeqInput};
use duplex_model::weights::{HostWeight, Weights};
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

/// FLOP/s of the BF16 path's products at prefill's shapes, to tell which
/// compute rate the real FFN meets: one MoE layer (layer `layer`'s experts)
/// over `CONTEXT` tokens routed round-robin, as `moe_forward` runs it, and
/// `par_matmul` on one expert's gate at that layer's rows per expert and at
/// the calibration's 128 rows. Best of 2.
fn product_rates(model: &Model, layer: usize) -> (f64, f64, f64) {
    use duplex_kernels::moe::{moe_forward, ExpertCall, ExpertWeights, MoeScratch};
    use duplex_kernels::parallel_linear::{par_matmul, LinearScratch};
    use duplex_model::forward::ModuleKind;
    let (rt, cfg) = (&model.cpu, &model.cfg);
    let (d, k) = (cfg.hidden_size, cfg.num_experts_per_tok);
    let experts: Vec<&Weights<HostWeight>> = model.modules.iter().filter(|m| matches!(m.kind, ModuleKind::Expert { layer: l, .. } if l == layer)).map(|m| &m.weights).collect();
    fn view<'w>(w: &'w Weights<HostWeight>, role: &str) -> duplex_kernels::WeightView<'w> {
        w.get(role).expect("an expert's projection").matrix().expect("a matrix").view()
    }
    let mut rows: Vec<Vec<(usize, f32)>> = vec![vec![]; experts.len()];
    for t in 0..CONTEXT {
        for j in 0..k {
            rows[(t * k + j) % experts.len()].push((t, 1.0 / k as f32));
        }
    }
    let calls: Vec<ExpertCall> = experts
        .iter()
        .zip(&rows)
        .map(|(w, tokens)| ExpertCall { weights: ExpertWeights { gate: view(w, "gate_proj"), up: view(w, "up_proj"), down: view(w, "down_proj") }, tokens, node: 0 })
        .collect();
    let x: Vec<f32> = (0..CONTEXT * d).map(|i| ((i % 31) as f32 - 15.0) / 15.0).collect();
    let mut out = vec![0.0f32; CONTEXT * d];
    let mut scratch = MoeScratch::default();
    let gate = view(experts[0], "gate_proj");
    let layer_flops = 2.0 * (CONTEXT * k) as f64 * 3.0 * (gate.rows * gate.cols) as f64;
    let best = |mut f: Box<dyn FnMut() + '_>, flops: f64| {
        (0..2)
            .map(|_| {
                let t = Instant::now();
                f();
                flops / t.elapsed().as_secs_f64()
            })
            .fold(0.0, f64::max)
    };
    let moe = best(Box::new(|| moe_forward(&rt.pool, rt.isa, &calls, &x, d, &mut out, &mut scratch)), layer_flops);
    let mut linear = LinearScratch::default();
    let mut gemm_at = |n: usize| {
        let mut y = vec![0.0f32; n * gate.rows];
        best(Box::new(|| par_matmul(&rt.pool, rt.isa, &gate, &x[..n * d], n, &mut y, &mut linear)), 2.0 * (n * gate.rows * gate.cols) as f64)
    };
    let per_expert = CONTEXT * k / experts.len();
    (moe, gemm_at(per_expert), gemm_at(128))
}

/// One layer's MLA decode attention over `CONTEXT` cached latents, as the
/// CPU backend's BF16 path runs it (`decode_attention`), against its
/// predicted time on `cpu`. Best of 50: a pass is short enough that a
/// neighbour's time slice on one of the cores can make it ten times longer.
fn decode_attention_check(model: &Model, cpu: &duplex_sim::hardware::CpuSpec) -> Option<(Duration, Duration)> {
    use duplex_kernels::device::{DevicePtr, Op};
    use duplex_kernels::mla::{decode_attention, LatentCache};
    let m = model.cfg.mla()?;
    let (heads, dc, dr, block) = (model.cfg.num_attention_heads, m.kv_lora_rank, m.qk_rope_head_dim, 16);
    let rt = &model.cpu;
    let latents: Vec<f32> = (0..CONTEXT * (dc + dr)).map(|i| ((i % 23) as f32 - 11.0) / 11.0).collect();
    let blocks: Vec<&[f32]> = latents.chunks(block * (dc + dr)).collect();
    let cache = LatentCache { blocks: &blocks, block_size: block, dc, dr };
    let (q_latent, q_pe) = (vec![0.1f32; heads * dc], vec![0.1f32; heads * dr]);
    let (mut scratch, mut out) = (vec![], vec![0.0f32; heads * dc]);
    let real = (0..50)
        .map(|_| {
            let t = Instant::now();
            decode_attention(&rt.pool, rt.isa, cache, CONTEXT, &q_latent, &q_pe, 0.1, &mut scratch, &mut out);
            t.elapsed()
        })
        .min()?;
    let shaped = |rows: usize, cols: usize| DevicePtr { addr: 0, bytes: rows * cols * 4 }.matrix(rows, cols);
    let op = Op::MlaDecode { q_latent: shaped(heads, dc), q_pe: shaped(heads, dr), latents: shaped(CONTEXT, dc + dr), out: shaped(heads, dc), scale: 0.1, precision: PRECISION };
    Some((real, cpu.time(&duplex_sim::cost::op_work(&op), rt.pool.threads())))
}

/// What the simulated CPU predicts from one calibration.
struct Prediction {
    prefill: Duration,
    /// The median of the decode steps.
    decode: Duration,
    prefill_kinds: Vec<(&'static str, Duration)>,
    /// Per decode step.
    decode_kinds: Vec<(&'static str, Duration)>,
}

fn predict(model: &Model, cpu: &duplex_sim::hardware::CpuSpec, pool: &mut KvPool, prompt: &[u32], next: &[u32]) -> Prediction {
    let sim = SimCpu::new(cpu.clone(), model.cpu.pool.threads(), 1);
    let mut table = BlockTable::default();
    clock::set(Some(Duration::ZERO));
    pass(model, sim.backend(), pool, &mut table, prompt);
    let prefill = clock::now().unwrap();
    let prefill_kinds = sim.per_kind();
    let mut steps = vec![];
    for &t in next {
        let start = clock::now().unwrap();
        pass(model, sim.backend(), pool, &mut table, &[t]);
        steps.push(clock::now().unwrap() - start);
    }
    clock::set(None);
    pool.release(&mut table);
    let decode_kinds = per_kind_delta(&sim.per_kind(), &prefill_kinds).into_iter().map(|(k, t)| (k, t / next.len() as u32)).collect();
    Prediction { prefill, decode: spread(steps).1, prefill_kinds, decode_kinds }
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let dir = PathBuf::from(args.iter().find(|a| !a.starts_with("--")).map_or("/tmp/bench-synth", String::as_str));
    let quick = !args.iter().any(|a| a == "--full");

    let model = Model::load(&dir, &mut |_, _| {}).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    let threads = model.cpu.pool.threads();
    let vocab = model.cfg.vocab_size;
    let prompt: Vec<u32> = (0..CONTEXT).map(|i| ((i * 7919 + 13) % vocab) as u32).collect();
    let next: Vec<u32> = (0..DECODE_STEPS).map(|i| ((i * 104_729 + 5) % vocab) as u32).collect();
    let mut pool = model.new_kv_pool((CONTEXT + DECODE_STEPS).div_ceil(16) + 1, 16);
    println!("model {} on {threads} thread(s), {PRECISION:?}; prefill {CONTEXT} tokens, then {DECODE_STEPS} decode steps from context {CONTEXT}", dir.display());

    let (mut predictions, mut prefills, mut decodes) = (vec![], vec![], vec![]);
    let (mut real_prefill_split, mut real_decode_split) = (ForwardTimings::default(), ForwardTimings::default());
    let mut calibrated = vec![];
    for round in 0..REPS {
        calibrated.push(calibrate::this_machine(&Calibration { quick, ..Calibration::default() }).expect("calibration").cpu);
        let c = calibrated.last().unwrap();
        let predicted = predict(&model, c, &mut pool, &prompt, &next);
        let mut table = BlockTable::default();
        let t = Instant::now();
        let split = pass(&model, model.cpu.backend(), &mut pool, &mut table, &prompt);
        let prefill = t.elapsed();
        let mut steps = vec![];
        for &tok in &next {
            let t = Instant::now();
            let split = pass(&model, model.cpu.backend(), &mut pool, &mut table, &[tok]);
            steps.push(t.elapsed());
            if decodes.iter().chain(&steps).all(|&d| d >= *steps.last().unwrap()) {
                real_decode_split = split;
            }
        }
        pool.release(&mut table);
        if prefills.iter().all(|&p| p >= prefill) {
            real_prefill_split = split;
        }
        println!(
            "round {round}: calibrated read {:.1} GB/s, GEMV fraction {:.2}, BF16 GEMM {:.1} GFLOP/s; prefill predicted {:.0} ms, real {:.0} ms; decode predicted {:.1} ms, real median {:.1} ms",
            c.dram_read_gb_per_s,
            c.gemv_efficiency,
            c.bf16_tflops * 1e3,
            ms(predicted.prefill),
            ms(prefill),
            ms(predicted.decode),
            ms(spread(steps.clone()).1)
        );
        predictions.push(predicted);
        prefills.push(prefill);
        decodes.extend(steps);
    }

    // The fastest prediction (the calibration least disturbed) against the
    // fastest real run, and the medians against each other.
    let report = |what: &str, predicted: Vec<Duration>, real: Vec<Duration>, split: ForwardTimings, kinds: &[(&'static str, Duration)]| {
        let (p_min, p_median, p_max) = spread(predicted);
        let (min, median, max) = spread(real);
        println!("{what}: predicted min {:.2} / median {:.2} / max {:.2} ms; real min {:.2} / median {:.2} / max {:.2} ms", ms(p_min), ms(p_median), ms(p_max), ms(min), ms(median), ms(max));
        println!("  predicted ÷ real: min ÷ min {:.3}, median ÷ median {:.3}", p_min.as_secs_f64() / min.as_secs_f64(), p_median.as_secs_f64() / median.as_secs_f64());
        // The real split is by module: the FFN's (router, shared and routed
        // experts, dense MLPs) and the attention module's (its projections,
        // norms, rotations and attention itself); the LM head is in neither.
        let ffn = kinds.iter().filter(|(k, _)| ["experts", "router", "route"].contains(k)).map(|&(_, t)| t).sum::<Duration>();
        let total: Duration = kinds.iter().map(|&(_, t)| t).sum();
        println!("  fastest: FFN predicted {:.2} ms (experts, router, route), real {:.2} ms; attention module real {:.2} ms, predicted with the LM head and the rest {:.2} ms", ms(ffn), ms(split.ffn), ms(split.attention), ms(total - ffn));
        print_kinds(what, kinds);
    };
    let fastest = predictions.iter().min_by_key(|p| p.prefill).expect("a round");
    report(&format!("prefill {CONTEXT}"), predictions.iter().map(|p| p.prefill).collect(), prefills, real_prefill_split, &fastest.prefill_kinds);
    let fastest = predictions.iter().min_by_key(|p| p.decode).expect("a round");
    report(&format!("decode at {CONTEXT}"), predictions.iter().map(|p| p.decode).collect(), decodes, real_decode_split, &fastest.decode_kinds);
    let first_moe = (0..model.cfg.num_hidden_layers).find(|&l| model.cfg.is_moe_layer(l)).expect("a MoE model");
    let (moe, gemm_rows, gemm_128) = product_rates(&model, first_moe);
    let per_expert = CONTEXT * model.cfg.num_experts_per_tok / model.cfg.n_routed_experts;
    println!(
        "BF16 products: moe_forward over a MoE layer of {CONTEXT} tokens {:.1} GFLOP/s; par_matmul on an expert's gate at {per_expert} rows {:.1}, at 128 rows (the calibration's shape) {:.1} GFLOP/s",
        moe / 1e9,
        gemm_rows / 1e9,
        gemm_128 / 1e9
    );
    // Against the calibration with the fastest products (the least disturbed).
    let best = calibrated.iter().max_by(|a, b| a.bf16_tflops.total_cmp(&b.bf16_tflops)).expect("a round");
    if let Some((real, predicted)) = decode_attention_check(&model, best) {
        println!("MLA decode attention of one layer at context {CONTEXT}: real {:.3} ms, predicted {:.3} ms", ms(real), ms(predicted));
    }
}
