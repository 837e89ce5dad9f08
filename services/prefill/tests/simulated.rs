//! Stream-loading prefill on the simulated accelerator (`duplex-sim`): the
//! same engine, unchanged, on a virtual clock.
//! - In its functional mode the simulated device gives every stream the same
//!   commands, in the same order, as the emulated device does, and the same
//!   logits: the simulator runs the production schedule, not a model of it.
//! - Its virtual time behaves as the pipeline should: a pass takes at least
//!   the longer of its transfers and its kernels, and less than their sum.
//! - Two-device prefill (DSLP) likewise: the same schedule on every device
//!   as on emulated ones, and, where transfers bound the pass, about half
//!   the time of one device (each streams half of the experts).

use duplex_kernels::clock;
use duplex_kernels::device::emulated::{EmulatedConfig, EmulatedDevice};
use duplex_kernels::device::traced::Traced;
use duplex_kernels::device::{Device, Op};
use duplex_model::{BlockTable, Logits, Model, Precision, BUNDLED_MODEL};
use duplex_prefill::dslp::DslpEngine;
use duplex_prefill::slp::{SlpConfig, SlpEngine, SlpReport};
use duplex_sim::device::{CostModel, SimConfig, SimDevice};
use std::path::Path;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

fn model() -> &'static Model {
    static MODEL: OnceLock<Model> = OnceLock::new();
    MODEL.get_or_init(|| Model::load(Path::new(BUNDLED_MODEL), &mut |_, _| {}).expect("the bundled model loads"))
}

const MEMORY: usize = 64 << 20;

fn config(ring_slots: Option<usize>) -> SlpConfig {
    SlpConfig { dense_budget_bytes: 8 << 20, ring_slots, ..Default::default() }
}

/// Every kernel `op` long, copies at `bytes_per_second`.
struct Fixed {
    op: Duration,
    bytes_per_second: f64,
}

impl CostModel for Fixed {
    fn op(&self, _: &Op) -> Duration {
        self.op
    }
    fn h2d(&self, bytes: usize) -> Duration {
        Duration::from_secs_f64(bytes as f64 / self.bytes_per_second)
    }
    fn d2h(&self, bytes: usize) -> Duration {
        self.h2d(bytes)
    }
}

fn sim(cost: Fixed, functional: bool) -> Arc<SimDevice> {
    SimDevice::new(SimConfig { name: "test device".into(), memory_bytes: MEMORY, cost: Arc::new(cost), seed: 7, functional })
}

fn prefill(device: Arc<dyn Device>, ring_slots: Option<usize>, tokens: &[u32]) -> (Vec<f32>, SlpReport) {
    let m = model();
    let engine = SlpEngine::new(m, device, config(ring_slots)).unwrap();
    let mut kv = m.new_kv_pool(64, 16);
    let mut table = BlockTable::default();
    engine.run(m, &mut kv, &mut table, tokens, Precision::F32, Logits::Last, &mut || false).unwrap()
}

#[test]
fn the_simulated_device_runs_the_emulated_devices_schedule() {
    let tokens: Vec<u32> = (0..37).map(|i| (i * 7 + 3) % 200).collect();
    for ring in [None, Some(2)] {
        let emulated_trace = Traced::new(EmulatedDevice::new(EmulatedConfig { memory_bytes: MEMORY, ..Default::default() }).unwrap());
        let (real_logits, _) = prefill(emulated_trace.clone(), ring, &tokens);

        let sim_trace = Traced::new(sim(Fixed { op: Duration::from_micros(10), bytes_per_second: 1e9 }, true));
        clock::set(Some(Duration::ZERO));
        let (sim_logits, _) = prefill(sim_trace.clone(), ring, &tokens);
        clock::set(None);

        let (real, simulated) = (emulated_trace.per_stream(), sim_trace.per_stream());
        assert_eq!(real.len(), simulated.len(), "ring {ring:?}: streams");
        for (s, (a, b)) in real.iter().zip(&simulated).enumerate() {
            assert!(a.len() > 10, "stream {s} did work");
            if let Some(i) = (0..a.len().max(b.len())).find(|&i| a.get(i) != b.get(i)) {
                panic!("ring {ring:?}, stream {s}: command {i} is {:?} on the emulated device, {:?} simulated", a.get(i), b.get(i));
            }
        }
        assert_eq!(real_logits, sim_logits, "ring {ring:?}: the functional simulation computes what the emulated device does");
    }
}

/// The virtual time a prefill takes, and its transfer and kernel time.
fn timed(cost: Fixed, tokens: usize) -> (Duration, Duration, Duration) {
    let device = sim(cost, false);
    let prompt: Vec<u32> = (0..tokens as u32).collect();
    clock::set(Some(Duration::ZERO));
    let (_, report) = prefill(device.clone(), Some(2), &prompt);
    let total = clock::now().unwrap();
    clock::set(None);
    let stats = device.stats();
    assert_eq!(report.layers.len(), model().cfg.num_hidden_layers);
    (total, stats.h2d_busy, stats.compute_busy)
}

#[test]
fn virtual_time_overlaps_transfer_with_compute() {
    // Transfer-bound, compute-bound, and balanced.
    for (op_us, gb_per_s) in [(1, 0.05), (500, 100.0), (50, 1.0)] {
        let (total, transfer, compute) = timed(Fixed { op: Duration::from_micros(op_us), bytes_per_second: gb_per_s * 1e9 }, 24);
        let (longer, shorter) = (transfer.max(compute), transfer.min(compute));
        eprintln!("{op_us} µs ops, {gb_per_s} GB/s: total {total:?}, transfer {transfer:?}, compute {compute:?}");
        assert!(total >= longer, "{op_us} µs ops, {gb_per_s} GB/s: {total:?} is less than the longer of transfer {transfer:?} and compute {compute:?}");
        // Most of the shorter side hides behind the longer. Where it is a
        // sliver (0.2% of the transfer-bound pass), a module that the race
        // below serialises may cost all of it, so only the bound after this
        // one holds there.
        if shorter * 10 > longer {
            assert!(total < longer + shorter / 2, "{op_us} µs ops, {gb_per_s} GB/s: {total:?} overlapped less than half of transfer {transfer:?} and compute {compute:?}");
        }
        // A pipeline that keeps one side busy ends within the other's first
        // and last module of it.
        assert!(total.as_secs_f64() < longer.as_secs_f64() * 1.35 + 2e-3, "{op_us} µs ops, {gb_per_s} GB/s: {total:?} against transfer {transfer:?} and compute {compute:?}");
    }
    // Repeatable: the threads still race in real time (whether the loader
    // finds budget space already freed decides where its next module goes),
    // which may move a pass's virtual time a little, never much.
    let runs: Vec<f64> = (0..3).map(|_| timed(Fixed { op: Duration::from_micros(50), bytes_per_second: 1e9 }, 24).0.as_secs_f64()).collect();
    let (lo, hi) = runs.iter().fold((f64::MAX, 0f64), |(lo, hi), &t| (lo.min(t), hi.max(t)));
    assert!(hi / lo < 1.02, "the same pass took {runs:?} s");
}

fn dslp(devices: Vec<Arc<dyn Device>>, tokens: &[u32]) -> Vec<f32> {
    let m = model();
    let engine = DslpEngine::new(m, devices, config(Some(2))).unwrap();
    let mut kv = m.new_kv_pool(64, 16);
    let mut table = BlockTable::default();
    engine.run(m, &mut kv, &mut table, tokens, Precision::F32, Logits::Last, &mut || false).unwrap().0
}

#[test]
fn two_device_prefill_runs_the_same_schedule_and_halves_a_transfer_bound_pass() {
    let tokens: Vec<u32> = (0..41).map(|i| (i * 11 + 5) % 200).collect();
    let mut traces: Vec<Arc<Traced>> = (0..2).map(|_| Traced::new(EmulatedDevice::new(EmulatedConfig { memory_bytes: MEMORY, ..Default::default() }).unwrap())).collect();
    traces.extend((0..2).map(|_| Traced::new(sim(Fixed { op: Duration::from_micros(10), bytes_per_second: 1e9 }, true))));
    let real = dslp(traces[..2].iter().map(|t| t.clone() as Arc<dyn Device>).collect(), &tokens);
    let simulated: Vec<Arc<dyn Device>> = traces[2..].iter().map(|t| t.clone() as Arc<dyn Device>).collect();
    clock::set(Some(Duration::ZERO));
    let predicted = dslp(simulated, &tokens);
    clock::set(None);
    for rank in 0..2 {
        let (a, b) = (traces[rank].per_stream(), traces[2 + rank].per_stream());
        assert_eq!(a.len(), b.len(), "rank {rank}: streams");
        for (s, (a, b)) in a.iter().zip(&b).enumerate() {
            if let Some(i) = (0..a.len().max(b.len())).find(|&i| a.get(i) != b.get(i)) {
                panic!("rank {rank}, stream {s}: command {i} is {:?} on the emulated device, {:?} simulated", a.get(i), b.get(i));
            }
        }
    }
    assert_eq!(real, predicted);

    // Transfer-bound: one device streams every expert, two stream half each.
    let slow = || Fixed { op: Duration::from_micros(1), bytes_per_second: 0.05e9 };
    let prompt: Vec<u32> = (0..48).collect();
    clock::set(Some(Duration::ZERO));
    prefill(sim(slow(), false), Some(2), &prompt);
    let one = clock::now().unwrap();
    clock::set(Some(Duration::ZERO));
    dslp(vec![sim(slow(), false), sim(slow(), false)], &prompt);
    let two = clock::now().unwrap();
    clock::set(None);
    eprintln!("transfer-bound prefill: one device {one:?}, two {two:?}");
    let ratio = one.as_secs_f64() / two.as_secs_f64();
    assert!(ratio > 1.3 && ratio < 2.0, "two devices took {two:?}, one {one:?}: {ratio:.2}×");
}
