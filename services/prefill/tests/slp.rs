//! Stream-loading prefill on the emulated accelerator against the CPU engine
//! and transformers' reference, with the ring at full length, at 2 slots,
//! and with a dense budget so small that the loader blocks on every module;
//! and a stress test with random delays in every thread and stream.

use duplex_kernels::device::emulated::{EmulatedConfig, EmulatedDevice, Jitter};
use duplex_kernels::device::Device;
use duplex_model::staged::{workspace_bytes, ModuleKind};
use duplex_toolkit::reference::{self, max_abs_diff, Bf16Gate, F32_MAX_ABS_DIFF};
use duplex_model::{BlockTable, KvPool, Logits, Model, Precision, BUNDLED_MODEL};
use duplex_prefill::slp::{SlpConfig, SlpEngine, SlpError};
use std::path::Path;
use std::sync::{mpsc, Arc, OnceLock};
use std::time::Duration;

fn model() -> &'static Model {
    static MODEL: OnceLock<Model> = OnceLock::new();
    MODEL.get_or_init(|| Model::load(Path::new(BUNDLED_MODEL), &mut |_, _| {}).expect("the bundled model loads"))
}

fn device(jitter: Option<Jitter>) -> Arc<dyn Device> {
    EmulatedDevice::new(EmulatedConfig { memory_bytes: 64 << 20, jitter, ..Default::default() }).unwrap()
}

/// The largest module that is not cut into chunks (attention, dense FFN): a
/// budget of exactly this holds one module at a time.
fn one_module_budget(m: &Model) -> usize {
    let whole = |k: &ModuleKind| matches!(k, ModuleKind::Attention { .. } | ModuleKind::Ffn { .. });
    m.staged_modules(usize::MAX).iter().filter(|x| whole(&x.kind)).map(|x| x.device_bytes()).max().unwrap()
}

/// Settings for the tiny model on a 64 MiB device.
fn config() -> SlpConfig {
    SlpConfig { dense_budget_bytes: 8 << 20, ..Default::default() }
}

struct Run {
    logits: Vec<f32>,
    kv: KvPool,
    table: BlockTable,
    ring_slots: usize,
}

fn slp(engine: &SlpEngine, tokens: &[u32], p: Precision, want: Logits) -> Result<Run, SlpError> {
    let m = model();
    let mut kv = m.new_kv_pool(64, 16);
    let mut table = BlockTable::default();
    let (logits, report) = engine.run(m, &mut kv, &mut table, tokens, p, want, &mut || false)?;
    assert_eq!(report.layers.len(), m.cfg.num_hidden_layers);
    Ok(Run { logits, kv, table, ring_slots: report.ring_slots })
}

fn cpu(tokens: &[u32], p: Precision, want: Logits) -> (Vec<f32>, KvPool, BlockTable) {
    let m = model();
    let mut kv = m.new_kv_pool(64, 16);
    let mut table = BlockTable::default();
    let logits = m.forward(&mut kv, &mut table, tokens, p, want).unwrap();
    (logits, kv, table)
}

/// The latents SLP wrote against the CPU engine's: `(max |Δ|, mean |Δ|)`
/// relative to the largest, over all layers.
fn kv_difference(a: &Run, b: &(Vec<f32>, KvPool, BlockTable)) -> (f32, f32) {
    let m = model();
    assert_eq!(a.table.len, b.2.len, "cached length");
    let (mut got, mut want) = (vec![], vec![]);
    for layer in 0..m.cfg.num_hidden_layers {
        for pos in 0..a.table.len {
            got.extend_from_slice(a.kv.entry(&a.table, layer, pos));
            want.extend_from_slice(b.1.entry(&b.2, layer, pos));
        }
    }
    let scale = want.iter().fold(0.0f32, |x, y| x.max(y.abs()));
    let mean = got.iter().zip(&want).map(|(x, y)| (x - y).abs()).sum::<f32>() / got.len() as f32;
    (max_abs_diff(&got, &want) / scale, mean / scale)
}

#[test]
fn slp_matches_cpu_engine_and_reference_at_every_ring_length_and_budget() {
    let m = model();
    let prompts = reference::load(Path::new(BUNDLED_MODEL)).unwrap();
    let configs = [
        ("full ring", config()),
        ("2-slot ring", SlpConfig { ring_slots: Some(2), ..config() }),
        ("one-module budget, heads in groups", SlpConfig { ring_slots: Some(2), dense_budget_bytes: one_module_budget(m), attention_kv_bytes: 1, ..config() }),
    ];
    for (label, config) in configs {
        let engine = SlpEngine::new(m, device(None), config).unwrap();
        for (i, p) in prompts.iter().enumerate() {
            let run = slp(&engine, &p.input_ids, Precision::F32, Logits::All).unwrap();
            let want = cpu(&p.input_ids, Precision::F32, Logits::All);
            let (vs_cpu, vs_ref) = (max_abs_diff(&run.logits, &want.0), max_abs_diff(&run.logits, &p.logits));
            println!("{label}, prompt {i}: ring {} slots, f32 max |Δlogit| {vs_cpu:.2e} vs CPU engine, {vs_ref:.2e} vs transformers", run.ring_slots);
            assert!(vs_cpu <= F32_MAX_ABS_DIFF && vs_ref <= F32_MAX_ABS_DIFF, "{label}, prompt {i}");
            let (max, _) = kv_difference(&run, &want);
            assert!(max <= 1e-5, "{label}, prompt {i}: f32 KV differs by {max:.2e} of its scale");

            let run = slp(&engine, &p.input_ids, Precision::Bf16, Logits::All).unwrap();
            let gate = Bf16Gate::new(p, &run.logits, m.cfg.vocab_size);
            println!("{label}, prompt {i}: {gate}");
            assert!(gate.passed(), "{label}, prompt {i}: {gate}");
            // BF16 roundings compound over layers (and a near tie may route a
            // token differently), so the cache is held to a mean, as logits are.
            let (max, mean) = kv_difference(&run, &cpu(&p.input_ids, Precision::Bf16, Logits::All));
            println!("{label}, prompt {i}: bf16 KV max |Δ| {max:.2e}, mean |Δ| {mean:.2e} of its scale");
            assert!(mean <= 5e-3, "{label}, prompt {i}: bf16 KV mean difference {mean:.2e} of its scale");
        }
    }
}

#[test]
fn ring_length_adapts_to_the_prompt_and_can_be_overridden() {
    let m = model();
    let tokens: Vec<u32> = (0..40).map(|i| (i * 37 % 2000) as u32).collect();
    let adaptive = SlpEngine::new(m, device(None), SlpConfig { turning_point_tokens: 32, ..config() }).unwrap();
    assert_eq!(slp(&adaptive, &tokens[..31], Precision::Bf16, Logits::Last).unwrap().ring_slots, m.cfg.n_routed_experts);
    assert_eq!(slp(&adaptive, &tokens, Precision::Bf16, Logits::Last).unwrap().ring_slots, 2);
    let fixed = SlpEngine::new(m, device(None), SlpConfig { ring_slots: Some(5), ..config() }).unwrap();
    assert_eq!(slp(&fixed, &tokens, Precision::Bf16, Logits::Last).unwrap().ring_slots, 5);
    // Device memory too small for the full ring: as many slots as fit.
    let expert = m.staged_modules(usize::MAX).iter().filter(|x| x.is_expert()).map(|x| x.device_bytes()).max().unwrap();
    let memory = one_module_budget(m) + workspace_bytes(m, 0, tokens.len(), Logits::Last, config().attention_kv_bytes).unwrap() + 6 * expert + (64 << 10);
    let small = EmulatedDevice::new(EmulatedConfig { memory_bytes: memory, ..Default::default() }).unwrap();
    let engine = SlpEngine::new(m, small, SlpConfig { dense_budget_bytes: one_module_budget(m), ..config() }).unwrap();
    let slots = slp(&engine, &tokens, Precision::Bf16, Logits::Last).unwrap().ring_slots;
    println!("{memory} bytes of device memory: a ring of {slots} slots");
    assert!((2..m.cfg.n_routed_experts).contains(&slots), "{slots} slots");
}

#[test]
fn bad_settings_and_cancellation_are_clear_errors() {
    let m = model();
    let too_small = SlpEngine::new(m, device(None), SlpConfig { dense_budget_bytes: one_module_budget(m) - 1, ..config() });
    let message = too_small.err().expect("a budget below the largest module is refused").to_string();
    assert!(message.contains("more than the dense budget"), "{message}");
    let one_slot = SlpEngine::new(m, device(None), SlpConfig { ring_slots: Some(1), ..config() });
    assert!(one_slot.err().unwrap().to_string().contains("at least 2"));
    // Activations that cannot fit: a clear error, and the device stays usable.
    let small = EmulatedDevice::new(EmulatedConfig { memory_bytes: 8 << 20, ..Default::default() }).unwrap();
    let engine = SlpEngine::new(m, small, SlpConfig { dense_budget_bytes: one_module_budget(m), ..config() }).unwrap();
    let long: Vec<u32> = (0..1000).map(|i| i % 2000).collect();
    let mut kv = m.new_kv_pool(64, 16);
    let Err(err) = engine.run(m, &mut kv, &mut BlockTable::default(), &long, Precision::Bf16, Logits::All, &mut || false) else { panic!("1000 rows of logits fit 8 MiB") };
    assert!(err.to_string().contains("do not fit the device"), "{err}");
    // Cancelled after a few modules: an error, the table unchanged, and the next prompt runs.
    let mut asked = 0;
    let mut table = BlockTable::default();
    let err = engine.run(m, &mut kv, &mut table, &long[..50], Precision::Bf16, Logits::Last, &mut || {
        asked += 1;
        asked > 5
    });
    assert!(matches!(err, Err(SlpError::Cancelled)), "{:?}", err.err());
    assert_eq!(table.len, 0);
    slp(&engine, &long[..50], Precision::Bf16, Logits::Last).unwrap();
}

/// Random delays before every command of every stream and every step of
/// the loader, model and unloader threads: SLP must never deadlock, and the
/// ordering audit (a module used only after its load completed, a slot
/// reused or freed only after its module ran) must never fire. Any misuse
/// would also show as logits differing from the undisturbed run.
#[test]
fn stress_random_delays_never_deadlock_or_misuse_memory() {
    let m = model();
    let tokens: Vec<u32> = (0..24).map(|i| (i * 53 % 2000) as u32).collect();
    let calm = SlpEngine::new(m, device(None), SlpConfig { ring_slots: Some(2), ..config() }).unwrap();
    let want = slp(&calm, &tokens, Precision::Bf16, Logits::Last).unwrap().logits;
    let budget = one_module_budget(m);
    for seed in 0..24u64 {
        let (done, finished) = mpsc::channel();
        let tokens = tokens.clone();
        std::thread::spawn(move || {
            let jitter = Jitter { seed, max: Duration::from_micros(300) };
            let settings = SlpConfig { ring_slots: Some(2 + seed as usize % 3), dense_budget_bytes: budget * (1 + seed as usize % 2), jitter: Some((seed, Duration::from_micros(300))), ..config() };
            let engine = SlpEngine::new(model(), device(Some(jitter)), settings).unwrap();
            let _ = done.send(slp(&engine, &tokens, Precision::Bf16, Logits::Last).map(|r| r.logits));
        });
        let got = finished.recv_timeout(Duration::from_secs(120)).unwrap_or_else(|_| panic!("seed {seed}: SLP did not finish in 120 s (deadlock?)"));
        let got = got.unwrap_or_else(|e| panic!("seed {seed}: {e}"));
        assert_eq!(got, want, "seed {seed}: logits differ from the undisturbed run");
    }
}
