//! Two-device prefill (DSLP) on two emulated accelerators against one-device
//! SLP, the CPU engine and transformers' reference, for every architecture
//! the fixtures cover: the same logits and the same KV cache, with prompt
//! lengths that are not multiples of the four zig-zag chunks, with the
//! experts ring at full length and at 2 slots, with a cached prefix
//! (chunked prefill on top), and under random delays in every thread and
//! stream; plus the clear errors.

use duplex_kernels::device::emulated::{EmulatedConfig, EmulatedDevice, Jitter};
use duplex_kernels::device::Device;
use duplex_model::{BlockTable, KvPool, Logits, Model, Precision};
use duplex_prefill::dslp::{DslpEngine, DslpReport};
use duplex_prefill::slp::{SlpConfig, SlpEngine, SlpError};
use duplex_toolkit::reference::{self, max_abs_diff, Bf16Gate, F32_MAX_ABS_DIFF};
use std::path::{Path, PathBuf};
use std::sync::{mpsc, Arc, OnceLock};
use std::time::Duration;

const FIXTURES: [&str; 3] = ["tiny-dsv3", "tiny-qwen3moe", "tiny-mixtral"];

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures").join(name)
}

fn model(name: &str) -> &'static Model {
    static MODELS: [OnceLock<Model>; 3] = [OnceLock::new(), OnceLock::new(), OnceLock::new()];
    let i = FIXTURES.iter().position(|f| *f == name).expect("a known fixture");
    MODELS[i].get_or_init(|| Model::load(&fixture(name), &mut |_, _| {}).expect("the fixture loads"))
}

fn device(jitter: Option<Jitter>) -> Arc<dyn Device> {
    EmulatedDevice::new(EmulatedConfig { memory_bytes: 64 << 20, jitter, ..Default::default() }).unwrap()
}

fn config() -> SlpConfig {
    SlpConfig { dense_budget_bytes: 8 << 20, ..Default::default() }
}

fn two_devices(m: &Model, config: SlpConfig) -> DslpEngine {
    DslpEngine::new(m, vec![device(None), device(None)], config).unwrap()
}

struct Run {
    logits: Vec<f32>,
    kv: KvPool,
    table: BlockTable,
}

fn dslp(engine: &DslpEngine, m: &Model, tokens: &[u32], p: Precision, want: Logits) -> Result<(Run, DslpReport), SlpError> {
    let mut kv = m.new_kv_pool(64, 16);
    let mut table = BlockTable::default();
    let (logits, report) = engine.run(m, &mut kv, &mut table, tokens, p, want, &mut || false)?;
    Ok((Run { logits, kv, table }, report))
}

fn cpu(m: &Model, tokens: &[u32], p: Precision, want: Logits) -> Run {
    let mut kv = m.new_kv_pool(64, 16);
    let mut table = BlockTable::default();
    let logits = m.forward(&mut kv, &mut table, tokens, p, want).unwrap();
    Run { logits, kv, table }
}

/// Largest and mean |Δ| of every layer's KV entries, relative to the largest entry.
fn kv_difference(m: &Model, a: &Run, b: &Run) -> (f32, f32) {
    assert_eq!(a.table.len, b.table.len, "cached length");
    let (mut got, mut want) = (vec![], vec![]);
    for layer in 0..m.cfg.num_hidden_layers {
        for pos in 0..a.table.len {
            got.extend_from_slice(a.kv.entry(&a.table, layer, pos));
            want.extend_from_slice(b.kv.entry(&b.table, layer, pos));
        }
    }
    let scale = want.iter().fold(0.0f32, |x, y| x.max(y.abs()));
    let mean = got.iter().zip(&want).map(|(x, y)| (x - y).abs()).sum::<f32>() / got.len() as f32;
    (max_abs_diff(&got, &want) / scale, mean / scale)
}

#[test]
fn dslp_matches_slp_cpu_engine_and_reference_for_every_architecture() {
    for name in FIXTURES {
        let m = model(name);
        let prompts = reference::load(&fixture(name)).unwrap();
        for (label, config) in [("full ring", config()), ("2-slot ring", SlpConfig { ring_slots: Some(2), ..config() })] {
            let engine = two_devices(m, config.clone());
            let slp = SlpEngine::new(m, device(None), config).unwrap();
            for (i, p) in prompts.iter().enumerate() {
                let tokens = &p.input_ids;
                let (run, report) = dslp(&engine, m, tokens, Precision::F32, Logits::All).unwrap();
                assert_eq!(report.ranks.len(), 2);
                assert!(report.ranks.iter().all(|r| r.layers.len() == m.cfg.num_hidden_layers));
                let want = cpu(m, tokens, Precision::F32, Logits::All);
                let mut kv = m.new_kv_pool(64, 16);
                let (one, _) = slp.run(m, &mut kv, &mut BlockTable::default(), tokens, Precision::F32, Logits::All, &mut || false).unwrap();
                let (vs_cpu, vs_slp, vs_ref) = (max_abs_diff(&run.logits, &want.logits), max_abs_diff(&run.logits, &one), max_abs_diff(&run.logits, &p.logits));
                println!("{name}, {label}, prompt {i} ({} tokens): f32 max |Δlogit| {vs_cpu:.2e} vs CPU, {vs_slp:.2e} vs SLP, {vs_ref:.2e} vs transformers", tokens.len());
                assert_eq!(run.logits.len(), want.logits.len());
                assert!(vs_cpu <= F32_MAX_ABS_DIFF && vs_slp <= F32_MAX_ABS_DIFF && vs_ref <= F32_MAX_ABS_DIFF, "{name}, {label}, prompt {i}");
                let (max, _) = kv_difference(m, &run, &want);
                assert!(max <= 1e-5, "{name}, {label}, prompt {i}: f32 KV differs by {max:.2e} of its scale");

                let (run, _) = dslp(&engine, m, tokens, Precision::Bf16, Logits::All).unwrap();
                let gate = Bf16Gate::new(p, &run.logits, m.cfg.vocab_size);
                println!("{name}, {label}, prompt {i}: {gate}");
                assert!(gate.passed(), "{name}, {label}, prompt {i}: {gate}");
                let (_, mean) = kv_difference(m, &run, &cpu(m, tokens, Precision::Bf16, Logits::All));
                assert!(mean <= 5e-3, "{name}, {label}, prompt {i}: bf16 KV mean difference {mean:.2e} of its scale");
            }
        }
    }
}

/// The last token's logits, and a prompt continued in chunks after a cached
/// prefix, equal a one-shot pass; the prompt may be as short as the split
/// allows, and of any length modulo 4.
#[test]
fn chunked_dslp_equals_one_shot_at_every_length_modulo_four() {
    for name in FIXTURES {
        let m = model(name);
        let engine = two_devices(m, config());
        for len in [4usize, 5, 6, 7, 33] {
            let tokens: Vec<u32> = (0..len as u32 * 2).map(|i| (i * 131 + 7) % m.cfg.vocab_size as u32).collect();
            let want = cpu(m, &tokens, Precision::F32, Logits::Last);
            // One shot.
            let (run, _) = dslp(&engine, m, &tokens, Precision::F32, Logits::Last).unwrap();
            assert_eq!(run.logits.len(), m.cfg.vocab_size);
            let d = max_abs_diff(&run.logits, &want.logits);
            assert!(d <= F32_MAX_ABS_DIFF, "{name}, {} tokens in one shot: {d:.2e}", tokens.len());
            // Two chunks: the second attends over the first's cached KV.
            let mut kv = m.new_kv_pool(64, 16);
            let mut table = BlockTable::default();
            engine.run(m, &mut kv, &mut table, &tokens[..len], Precision::F32, Logits::Last, &mut || false).unwrap();
            let (logits, _) = engine.run(m, &mut kv, &mut table, &tokens[len..], Precision::F32, Logits::Last, &mut || false).unwrap();
            let d = max_abs_diff(&logits, &want.logits);
            println!("{name}: {len} + {len} tokens in two DSLP chunks: max |Δlogit| {d:.2e} vs one CPU pass");
            assert!(d <= F32_MAX_ABS_DIFF, "{name}, {len} + {len} tokens: {d:.2e}");
            let (max, _) = kv_difference(m, &Run { logits, kv, table }, &want);
            assert!(max <= 1e-5, "{name}, {len} + {len} tokens: KV differs by {max:.2e} of its scale");
        }
    }
}

/// SmallEP moves each rank's rows once each way per MoE layer, whatever the
/// routing; classic expert parallelism would move a row per remote expert.
#[test]
fn smallep_traffic_is_n_times_d_per_link_and_layer() {
    let m = model("tiny-dsv3");
    let engine = two_devices(m, config());
    let tokens: Vec<u32> = (0..45).map(|i| (i * 37 % 2000) as u32).collect();
    let (_, report) = dslp(&engine, m, &tokens, Precision::F32, Logits::Last).unwrap();
    let (n, d, entry) = (tokens.len() as u64, m.cfg.hidden_size as u64, m.cfg.kv_entry_dim() as u64);
    let k = m.cfg.num_experts_per_tok as u64;
    for (layer, l) in report.exchange.iter().enumerate() {
        println!("layer {layer}: KV {} B, SmallEP gather {} + reduce {} B, classic EP {} B, {:?} in collectives", l.kv_bytes, l.gather_bytes, l.reduce_bytes, l.standard_ep_bytes, l.time);
        // Every rank sends its own tokens' entries, all N of them in all.
        assert_eq!(l.kv_bytes, n * entry * 4, "layer {layer}");
        if m.cfg.is_moe_layer(layer) {
            // Each rank sends its rows and gets back the others' partial sums for them: N·D each way.
            assert_eq!((l.gather_bytes, l.reduce_bytes), (n * d * 4, n * d * 4), "layer {layer}");
            // Classic EP: two ways for each (token, expert) pair across ranks, at most all k of them.
            assert!(l.standard_ep_bytes > 0 && l.standard_ep_bytes <= 2 * n * k * d * 4, "layer {layer}");
        } else {
            assert_eq!((l.gather_bytes, l.reduce_bytes, l.standard_ep_bytes), (0, 0, 0), "dense layer {layer}");
        }
    }
}

#[test]
fn bad_settings_cancellation_and_failures_are_clear_errors_without_hangs() {
    let m = model("tiny-dsv3");
    let one = DslpEngine::new(m, vec![device(None)], config());
    assert!(one.err().expect("one device is refused").to_string().contains("at least two devices"));
    let engine = two_devices(m, config());
    assert!(!engine.accepts(3) && engine.accepts(4));
    let mut kv = m.new_kv_pool(64, 16);
    let err = engine.run(m, &mut kv, &mut BlockTable::default(), &[1, 2, 3], Precision::F32, Logits::Last, &mut || false).unwrap_err();
    assert!(err.to_string().contains("zig-zag"), "{err}");
    let bad = engine.run(m, &mut kv, &mut BlockTable::default(), &[1, 2, 3, u32::MAX], Precision::F32, Logits::Last, &mut || false).unwrap_err();
    assert!(bad.to_string().contains("out of range"), "{bad}");

    // Cancelled by rank 0's caller after a few modules: the other rank stops too.
    let tokens: Vec<u32> = (0..40).map(|i| (i * 53 % 2000) as u32).collect();
    let mut asked = 0;
    let mut table = BlockTable::default();
    let err = engine.run(m, &mut kv, &mut table, &tokens, Precision::Bf16, Logits::Last, &mut || {
        asked += 1;
        asked > 5
    });
    assert!(matches!(err, Err(SlpError::Cancelled)), "{:?}", err.err());
    assert_eq!(table.len, 0);

    // The second device too small for the activations: rank 1 fails, rank 0
    // (waiting at the first exchange) is released with it, and the error says why.
    let small = EmulatedDevice::new(EmulatedConfig { memory_bytes: 9 << 20, ..Default::default() }).unwrap();
    let lopsided = DslpEngine::new(m, vec![device(None), small], config()).unwrap();
    let long: Vec<u32> = (0..600).map(|i| i % 2000).collect();
    let (done, finished) = mpsc::channel();
    std::thread::spawn(move || {
        let mut kv = model("tiny-dsv3").new_kv_pool(64, 16);
        let r = lopsided.run(model("tiny-dsv3"), &mut kv, &mut BlockTable::default(), &long, Precision::Bf16, Logits::All, &mut || false).map(drop);
        let _ = done.send(r);
    });
    let err = finished.recv_timeout(Duration::from_secs(120)).expect("a failing rank must not leave the other waiting").unwrap_err();
    assert!(err.to_string().contains("do not fit the device"), "{err}");
    // The engine is still usable afterwards.
    dslp(&engine, m, &tokens, Precision::Bf16, Logits::Last).unwrap();
}

/// Random delays before every command of every stream and every step of
/// each rank's loader, model and unloader threads: no deadlock, no slot or
/// buffer reused early (the SLP audit), and the same logits as a calm run.
#[test]
fn stress_random_delays_never_deadlock_or_change_the_result() {
    let m = model("tiny-dsv3");
    let tokens: Vec<u32> = (0..27).map(|i| (i * 53 % 2000) as u32).collect();
    let calm = two_devices(m, SlpConfig { ring_slots: Some(2), ..config() });
    let want = dslp(&calm, m, &tokens, Precision::Bf16, Logits::Last).unwrap().0.logits;
    for seed in 0..12u64 {
        let (done, finished) = mpsc::channel();
        let tokens = tokens.clone();
        std::thread::spawn(move || {
            let m = model("tiny-dsv3");
            let jittery = |s: u64| device(Some(Jitter { seed: s, max: Duration::from_micros(300) }));
            let settings = SlpConfig { ring_slots: Some(2 + seed as usize % 3), jitter: Some((seed, Duration::from_micros(300))), ..config() };
            let engine = DslpEngine::new(m, vec![jittery(seed), jittery(seed + 100)], settings).unwrap();
            let _ = done.send(dslp(&engine, m, &tokens, Precision::Bf16, Logits::Last).map(|r| r.0.logits));
        });
        let got = finished.recv_timeout(Duration::from_secs(120)).unwrap_or_else(|_| panic!("seed {seed}: DSLP did not finish in 120 s (deadlock?)"));
        let got = got.unwrap_or_else(|e| panic!("seed {seed}: {e}"));
        assert_eq!(got, want, "seed {seed}: logits differ from the undisturbed run");
    }
}
