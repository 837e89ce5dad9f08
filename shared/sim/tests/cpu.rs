//! The simulated CPU runs the CPU placement's own forward program
//! (`Model::forward_batch_on`) on the tiny fixtures, an MLA model and a GQA
//! one, and its virtual time behaves as the cost model says: it advances,
//! attention grows with the context, a bandwidth-bound step scales with
//! the DRAM bandwidth, and every op's time is accounted for.

use duplex_kernels::clock;
use duplex_kernels::pool::PoolConfig;
use duplex_model::kv_cache::{BlockTable, KvPool};
use duplex_model::model::{ForwardTimings, Logits, Model, Precision, SeqInput};
use duplex_sim::cpu::SimCpu;
use duplex_sim::hardware::{CpuSpec, Hardware};
use std::path::PathBuf;
use std::time::Duration;

const MODELS: [&str; 2] = ["tiny-dsv3", "tiny-qwen3moe"];

fn load(name: &str) -> Model {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures").join(name);
    Model::load_with(&dir, &PoolConfig::single_node(1), &mut |_, _| {}).unwrap_or_else(|e| panic!("{name}: {e}"))
}

/// The paper's node, all its cores.
fn paper_cpu() -> CpuSpec {
    Hardware::builtin("paper-node").unwrap().cpu
}

/// A sequence on the simulated CPU, on this thread's virtual clock.
struct Run<'m> {
    model: &'m Model,
    cpu: SimCpu,
    pool: KvPool,
    table: BlockTable,
}

impl<'m> Run<'m> {
    fn new(model: &'m Model, spec: CpuSpec, threads: usize) -> Self {
        clock::set(Some(Duration::ZERO));
        Run { model, cpu: SimCpu::new(spec, threads, 7), pool: model.new_kv_pool(64, 16), table: BlockTable::default() }
    }

    /// Run `n` new tokens; returns the virtual time they took.
    fn step(&mut self, n: usize, p: Precision) -> Duration {
        let tokens: Vec<u32> = (0..n as u32).map(|i| 3 + i % 50).collect();
        let start = clock::now().unwrap();
        let seqs = &mut [SeqInput { table: &mut self.table, tokens: &tokens }];
        let logits = self.model.forward_batch_on(self.cpu.backend(), &mut self.pool, seqs, p, Logits::Last, &mut ForwardTimings::default(), 0).unwrap();
        assert_eq!(logits.len(), self.model.cfg.vocab_size);
        clock::now().unwrap() - start
    }

    fn kind(&self, kind: &str) -> Duration {
        self.cpu.per_kind().iter().find(|(k, _)| *k == kind).map_or(Duration::ZERO, |&(_, t)| t)
    }
}

#[test]
fn prefill_and_decode_take_virtual_time_that_per_kind_totals_account_for() {
    for name in MODELS {
        let model = load(name);
        for p in [Precision::Bf16, Precision::F32] {
            let mut run = Run::new(&model, paper_cpu(), 8);
            let prefill = run.step(32, p);
            let decode = run.step(1, p);
            assert!(prefill > Duration::ZERO && decode > Duration::ZERO, "{name} {p:?}: {prefill:?} {decode:?}");
            assert!(prefill > decode, "{name} {p:?}: 32 tokens {prefill:?}, 1 token {decode:?}");
            assert_eq!(run.table.len, 33, "{name}: the pass runs to the end");
            // One thread issues every op back to back: the pool is never
            // idle in between, and no op's time goes unaccounted.
            let summed: Duration = run.cpu.per_kind().iter().map(|&(_, t)| t).sum();
            assert_eq!(summed, prefill + decode, "{name} {p:?}: {:?}", run.cpu.per_kind());
            assert_eq!(run.cpu.busy(), summed);
            for kind in ["gemm", "experts", "attention", "route", "rms_norm"] {
                assert!(run.kind(kind) > Duration::ZERO, "{name} {p:?}: no {kind} time in {:?}", run.cpu.per_kind());
            }
        }
    }
    clock::set(None);
}

#[test]
fn decode_attention_grows_with_the_context() {
    for name in MODELS {
        let model = load(name);
        // A decode step after a prompt of `context` tokens: its time and its attention's.
        let decode_at = |context: usize| {
            let mut run = Run::new(&model, paper_cpu(), 8);
            run.step(context, Precision::Bf16);
            let before = run.kind("attention");
            let step = run.step(1, Precision::Bf16);
            (step, run.kind("attention") - before)
        };
        let (short, short_attention) = decode_at(128);
        let (middle, middle_attention) = decode_at(320);
        let (long, long_attention) = decode_at(512);
        assert!(short < middle && middle < long, "{name}: decode at 128, 320, 512: {short:?} {middle:?} {long:?}");
        assert_eq!(long - short, long_attention - short_attention, "{name}: only attention depends on the context");
        // Every key is read and scored once: attention is an affine function
        // of the context, so equal steps of context add equal time (up to a
        // nanosecond's rounding per layer).
        let (first, second) = ((middle_attention - short_attention).as_nanos() as i128, (long_attention - middle_attention).as_nanos() as i128);
        assert!(first > 0 && (first - second).abs() <= model.cfg.num_hidden_layers as i128 * 2, "{name}: 128→320 adds {first} ns, 320→512 {second} ns");
    }
    clock::set(None);
}

#[test]
fn a_bandwidth_bound_decode_step_scales_with_dram_bandwidth() {
    // A CPU with compute to spare, on which one thread saturates DRAM: every
    // op of a decode step, the row-wise ones on one thread as much as the
    // products on the pool, is then bound by DRAM bandwidth alone.
    let mut spec = paper_cpu();
    spec.core_read_gb_per_s = spec.dram_read_gb_per_s;
    spec.f32_tflops *= 1000.0;
    spec.bf16_tflops *= 1000.0;
    let mut doubled = spec.clone();
    doubled.dram_read_gb_per_s *= 2.0;
    doubled.core_read_gb_per_s *= 2.0;
    for name in MODELS {
        let model = load(name);
        let decode_on = |spec: &CpuSpec| {
            let mut run = Run::new(&model, spec.clone(), spec.cores());
            run.step(64, Precision::Bf16);
            run.step(1, Precision::Bf16)
        };
        let (base, fast) = (decode_on(&spec), decode_on(&doubled));
        let speedup = base.as_secs_f64() / fast.as_secs_f64();
        assert!((speedup - 2.0).abs() < 0.2, "{name}: doubling DRAM bandwidth sped decode up {speedup:.3}× ({base:?} → {fast:?})");
        // And the realistic CPU's compute does not make it faster still.
        let realistic = decode_on(&paper_cpu());
        assert!(realistic >= base, "{name}: {realistic:?} on the paper's CPU, {base:?} with compute to spare");
    }
    clock::set(None);
}
