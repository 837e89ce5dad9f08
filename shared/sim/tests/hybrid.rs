//! Hybrid decode (attention on a device, routed experts on the CPU, two
//! micro-batches) on the simulated accelerator: the same engine, unchanged.
//! - Functional mode: every stream gets the commands the emulated device's
//!   streams get, in the same order, and the logits are the same.
//! - Virtual time: with two micro-batches the device's half of a step hides
//!   behind the CPU's half, so batch 2 costs far less than two batches of 1.

use duplex_kernels::clock;
use duplex_kernels::device::emulated::{EmulatedConfig, EmulatedDevice};
use duplex_kernels::device::traced::Traced;
use duplex_kernels::device::{Device, Op};
use duplex_model::backend::ExpertJob;
use duplex_model::hybrid::{DeviceSeq, ExpertPool, HybridConfig, HybridEngine, Submit};
use duplex_model::weights::HostWeight;
use duplex_model::model::ForwardError;
use duplex_model::{BlockTable, Logits, Model, Precision, SeqInput, BUNDLED_MODEL};
use duplex_sim::device::{CostModel, SimConfig, SimDevice};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

const BLOCK: usize = 16;
const MEMORY: usize = 64 << 20;

struct Fixed(Duration);

impl CostModel for Fixed {
    fn op(&self, _: &Op) -> Duration {
        self.0
    }
    fn h2d(&self, bytes: usize) -> Duration {
        Duration::from_secs_f64(bytes as f64 / 10e9)
    }
    fn d2h(&self, bytes: usize) -> Duration {
        self.h2d(bytes)
    }
}

/// Every expert job takes the same time on the calling thread.
struct FixedPool(Duration);

impl ExpertPool for FixedPool {
    fn sum(&self, _: &[f32], n: usize, d: usize, jobs: &[ExpertJob<HostWeight>], _: Precision) -> Result<Vec<f32>, ForwardError> {
        let now = clock::now().expect("a simulated thread");
        clock::advance_to(now + self.0 * jobs.len() as u32);
        Ok(vec![0.0; n * d])
    }
}

fn engine(dev: Arc<dyn Device>, micro_batches: bool) -> HybridEngine {
    engine_submitting(dev, micro_batches, Submit::Stream)
}

fn engine_submitting(dev: Arc<dyn Device>, micro_batches: bool, submit: Submit) -> HybridEngine {
    let model = Model::load(Path::new(BUNDLED_MODEL), &mut |_, _| {}).unwrap();
    let cfg = HybridConfig { kv_blocks: 32, micro_batches, defer_experts: 0, cpu_jitter: None, submit, expert_cache: None };
    HybridEngine::new(model, dev, cfg, BLOCK).unwrap()
}

/// The simulated accelerator captures no graphs: an engine asked for
/// graph steps on it queues them on the streams, as it would on any such
/// device, and says so rather than failing.
#[test]
fn graph_steps_fall_back_to_streamed_steps_on_a_device_without_graphs() {
    let sim = SimDevice::new(SimConfig { name: "test".into(), memory_bytes: MEMORY, cost: Arc::new(Fixed(Duration::from_micros(5))), seed: 1, functional: true });
    assert_eq!(engine_submitting(sim, true, Submit::Graph).submit(), Submit::Stream);
    let emulated = EmulatedDevice::new(EmulatedConfig { memory_bytes: MEMORY, compute_threads: 1, ..Default::default() }).unwrap();
    assert_eq!(engine_submitting(emulated, true, Submit::Graph).submit(), Submit::Graph);
}

/// Prefill `prompts` on the CPU into the host pool, hand them to the engine,
/// and decode `steps` tokens for all of them in one batch: every step's
/// logits, and the virtual time each step took.
fn decode(e: &mut HybridEngine, prompts: &[Vec<u32>], steps: usize) -> (Vec<Vec<f32>>, Vec<Duration>) {
    let mut host = e.model.new_kv_pool(32, BLOCK);
    let mut tables: Vec<BlockTable> = prompts.iter().map(|_| BlockTable::default()).collect();
    for (t, p) in tables.iter_mut().zip(prompts) {
        host.reserve(t, p.len() + steps).unwrap();
        e.model.forward(&mut host, t, p, Precision::F32, Logits::Last).unwrap();
    }
    let dseqs: Vec<DeviceSeq> = tables.iter().zip(prompts).map(|(t, p)| e.admit(&host, t, p.len() + steps).unwrap()).collect();
    let refs: Vec<&DeviceSeq> = dseqs.iter().collect();
    let (mut logits, mut times) = (vec![], vec![]);
    for step in 0..steps {
        let tokens: Vec<[u32; 1]> = (0..prompts.len()).map(|i| [(7 * i + step) as u32 % 100]).collect();
        let mut seqs: Vec<SeqInput> = tables.iter_mut().zip(&tokens).map(|(table, t)| SeqInput { table, tokens: t }).collect();
        let started = clock::now();
        let (l, _) = e.forward(&mut host, &mut seqs, &refs, Precision::F32, Logits::Last).unwrap();
        times.push(clock::now().zip(started).map_or(Duration::ZERO, |(end, start)| end - start));
        logits.push(l);
    }
    for d in dseqs {
        e.release(d).unwrap();
    }
    (logits, times)
}

fn prompts(n: usize) -> Vec<Vec<u32>> {
    (0..n).map(|i| (0..(9 + 5 * i) as u32).map(|t| (t * 13 + i as u32) % 150).collect()).collect()
}

#[test]
fn the_simulated_device_runs_the_emulated_devices_hybrid_schedule() {
    let emulated_trace = Traced::new(EmulatedDevice::new(EmulatedConfig { memory_bytes: MEMORY, compute_threads: 1, ..Default::default() }).unwrap());
    let (real, _) = decode(&mut engine(emulated_trace.clone(), true), &prompts(2), 2);

    let sim_trace = Traced::new(SimDevice::new(SimConfig { name: "test".into(), memory_bytes: MEMORY, cost: Arc::new(Fixed(Duration::from_micros(5))), seed: 1, functional: true }));
    clock::set(Some(Duration::ZERO));
    let (simulated, _) = decode(&mut engine(sim_trace.clone(), true), &prompts(2), 2);
    clock::set(None);

    let (a, b) = (emulated_trace.per_stream(), sim_trace.per_stream());
    assert_eq!(a.len(), b.len(), "streams");
    for (s, (a, b)) in a.iter().zip(&b).enumerate() {
        assert!(!a.is_empty(), "stream {s} did work");
        if let Some(i) = (0..a.len().max(b.len())).find(|&i| a.get(i) != b.get(i)) {
            panic!("stream {s}: command {i} is {:?} on the emulated device, {:?} simulated", a.get(i), b.get(i));
        }
    }
    assert_eq!(real, simulated);
}

/// The virtual time of a decode step at batch `n`.
fn step_time(n: usize, micro_batches: bool) -> Duration {
    let sim = SimDevice::new(SimConfig { name: "test".into(), memory_bytes: MEMORY, cost: Arc::new(Fixed(Duration::from_micros(20))), seed: 1, functional: false });
    let mut e = engine(sim, micro_batches);
    e.set_expert_pool(Arc::new(FixedPool(Duration::from_micros(200))));
    clock::set(Some(Duration::ZERO));
    let (_, times) = decode(&mut e, &prompts(n), 3);
    clock::set(None);
    *times.last().unwrap()
}

#[test]
fn two_micro_batches_hide_the_device_behind_the_cpu() {
    let one = step_time(1, true);
    let (split, whole) = (step_time(2, true), step_time(2, false));
    eprintln!("decode step: batch 1 {one:?}, batch 2 as two micro-batches {split:?}, as one {whole:?}");
    assert!(one > Duration::ZERO);
    // Each micro-batch runs the experts batch 1 runs (the fixed pool's time
    // does not depend on rows), so the CPU's half doubles; the device's half
    // of one micro-batch runs while the CPU works on the other's.
    assert!(split < one * 2 * 9 / 10, "two micro-batches ({split:?}) overlap nothing of two batch-1 steps ({one:?})");
    assert!(split > one, "two micro-batches ({split:?}) cannot beat one ({one:?})");
}
