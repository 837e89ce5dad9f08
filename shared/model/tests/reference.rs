//! The engine against transformers on the tiny checkpoint of every family
//! (`DeepseekV3ForCausalLM`, `Qwen3MoeForCausalLM`, `MixtralForCausalLM`):
//! logits, greedy continuations, KV-cache decode, batching, every SIMD level,
//! and the staged (device) placement.

use duplex_toolkit::reference::{self, argmax, max_abs_diff, Bf16Gate, ReferencePrompt, F32_MAX_ABS_DIFF};
use duplex_model::{BlockTable, KvPool, Logits, Model, Precision};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// One checkpoint of each architecture, with transformers' outputs.
const FIXTURES: [&str; 3] = ["tiny-dsv3", "tiny-qwen3moe", "tiny-mixtral"];

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures").join(name)
}

fn model(name: &str) -> &'static Model {
    static MODELS: [OnceLock<Model>; 3] = [OnceLock::new(), OnceLock::new(), OnceLock::new()];
    let i = FIXTURES.iter().position(|f| *f == name).expect("a known fixture");
    MODELS[i].get_or_init(|| Model::load(&fixture(name), &mut |_, _| {}).expect("fixture loads"))
}

fn prompts(name: &str) -> Vec<ReferencePrompt> {
    reference::load(&fixture(name)).expect("the fixture's reference outputs")
}

fn pool(m: &Model) -> KvPool {
    m.new_kv_pool(64, 16)
}

fn teacher_forced(m: &Model, tokens: &[u32], p: Precision) -> Vec<f32> {
    let mut pool = pool(m);
    m.forward(&mut pool, &mut BlockTable::default(), tokens, p, Logits::All).unwrap()
}

fn greedy(m: &Model, prompt: &[u32], n: usize, p: Precision) -> Vec<u32> {
    let mut pool = pool(m);
    let mut table = BlockTable::default();
    let mut logits = m.forward(&mut pool, &mut table, prompt, p, Logits::Last).unwrap();
    let mut out = vec![];
    for _ in 0..n {
        let t = argmax(&logits);
        out.push(t);
        logits = m.forward(&mut pool, &mut table, &[t], p, Logits::Last).unwrap();
    }
    out
}

#[test]
fn f32_logits_match_transformers() {
    for (f, m, prompts) in FIXTURES.map(|f| (f, model(f), prompts(f))) {
    let vocab = m.cfg.vocab_size;
    for (i, p) in prompts.iter().enumerate() {
        let got = teacher_forced(m, &p.input_ids, Precision::F32);
        assert_eq!(got.len(), p.input_ids.len() * vocab);
        let max_diff = max_abs_diff(&got, &p.logits);
        println!("{f} prompt {i}: {} tokens, f32 max |Δlogit| = {max_diff:.3e}", p.input_ids.len());
        assert!(max_diff <= F32_MAX_ABS_DIFF, "{f} prompt {i}: max |Δlogit| {max_diff}");
    }
    }
}

#[test]
fn f32_greedy_continuations_match_transformers() {
    for (f, m, prompts) in FIXTURES.map(|f| (f, model(f), prompts(f))) {
        for (i, p) in prompts.iter().enumerate() {
            let got = greedy(m, &p.input_ids, p.greedy.len(), Precision::F32);
            assert_eq!(got, p.greedy, "{f} prompt {i}");
        }
    }
}

fn check_bf16(label: &str, p: &ReferencePrompt, got: &[f32], vocab: usize) {
    let gate = Bf16Gate::new(p, got, vocab);
    println!("{label}: {gate}");
    assert!(gate.passed(), "{label}: {gate}");
}

#[test]
fn bf16_logits_within_reference_bf16_error() {
    for (f, m, prompts) in FIXTURES.map(|f| (f, model(f), prompts(f))) {
        for (i, p) in prompts.iter().enumerate() {
            let got = teacher_forced(m, &p.input_ids, Precision::Bf16);
            check_bf16(&format!("{f} prompt {i}"), p, &got, m.cfg.vocab_size);
        }
    }
}

/// Every SIMD level this CPU can run meets the gates on every prompt of
/// every fixture (the kernels' own property tests check each level exactly
/// against the scalar code).
#[test]
fn bf16_logits_at_every_isa_level() {
    for f in FIXTURES {
        for isa in duplex_kernels::cpu::isa::supported() {
            let mut m = Model::load(&fixture(f), &mut |_, _| {}).unwrap();
            m.cpu.isa = isa;
            for (i, p) in prompts(f).iter().enumerate() {
                let got = teacher_forced(&m, &p.input_ids, Precision::Bf16);
                check_bf16(&format!("{f} {isa:?}, prompt {i}"), p, &got, m.cfg.vocab_size);
            }
        }
    }
}

/// The BF16 decode path (absorbed attention, SIMD kernels) stays as close to
/// transformers as the BF16 prefill path does, at every SIMD level.
#[test]
fn bf16_decode_from_cache_tracks_reference() {
    for (f, isa) in FIXTURES.iter().flat_map(|f| duplex_kernels::cpu::isa::supported().into_iter().map(move |isa| (*f, isa))) {
        let prompts = prompts(f);
        let mut m = Model::load(&fixture(f), &mut |_, _| {}).unwrap();
        m.cpu.isa = isa;
        for (i, p) in prompts.iter().enumerate().take(2) {
            let mut pool = pool(&m);
            let mut table = BlockTable::default();
            let mut got = vec![];
            for &t in &p.input_ids {
                got.extend(m.forward(&mut pool, &mut table, &[t], Precision::Bf16, Logits::Last).unwrap());
            }
            check_bf16(&format!("{f} {isa:?}, prompt {i}, decode"), p, &got, m.cfg.vocab_size);
        }
    }
}

/// Continuous batching: one forward pass over several sequences (a decode
/// step, a prefill chunk from scratch and a prefill chunk after a cached
/// prefix) gives each sequence the logits it gets alone.
#[test]
fn batched_forward_equals_each_sequence_alone() {
    for f in FIXTURES {
    let m = model(f);
    let prompts = prompts(f);
    let (a, b, c) = (&prompts[0].input_ids, &prompts[1].input_ids, &prompts[2].input_ids);
    for p in [Precision::F32, Precision::Bf16] {
        let mut pool = m.new_kv_pool(64, 16);
        let (mut ta, mut tb, mut tc) = (BlockTable::default(), BlockTable::default(), BlockTable::default());
        m.forward(&mut pool, &mut ta, &a[..10], p, Logits::Last).unwrap();
        m.forward(&mut pool, &mut tc, &c[..40], p, Logits::Last).unwrap();
        let mut timings = duplex_model::ForwardTimings::default();
        let got = m
            .forward_batch(
                &mut pool,
                &mut [
                    duplex_model::SeqInput { table: &mut ta, tokens: &a[10..11] },
                    duplex_model::SeqInput { table: &mut tb, tokens: &b[..15] },
                    duplex_model::SeqInput { table: &mut tc, tokens: &c[40..57] },
                ],
                p,
                Logits::Last,
                &mut timings,
            )
            .unwrap();
        assert!(timings.attention > std::time::Duration::ZERO && timings.ffn > std::time::Duration::ZERO);
        assert_eq!((ta.len, tb.len, tc.len), (11, 15, 57));
        let v = m.cfg.vocab_size;
        let alone = |tokens: &[u32]| teacher_forced(m, tokens, p)[(tokens.len() - 1) * v..].to_vec();
        for (i, want) in [alone(&a[..11]), alone(&b[..15]), alone(&c[..57])].iter().enumerate() {
            let row = &got[i * v..(i + 1) * v];
            let scale = want.iter().fold(0.0f32, |x, y| x.max(y.abs()));
            let err = row.iter().zip(want).map(|(x, y)| (x - y).abs()).fold(0.0f32, f32::max);
            // F32 is exact up to summation order; BF16 rounds activations,
            // and a batch of rows may take a different kernel than one row.
            let limit = if p == Precision::F32 { 1e-4 } else { 5e-2 };
            println!("{f} {p:?} seq {i}: max err {err}");
            assert!(err <= limit * scale, "{f} {p:?} sequence {i}: max error {err} vs scale {scale}");
            assert_eq!(argmax(row), argmax(want), "{f} {p:?} sequence {i}: greedy token differs");
        }
    }
    }
}

/// Run `tokens` through every staged module in turn on an emulated device,
/// each module's weights uploaded just before it runs and freed after.
fn staged_forward(m: &Model, tokens: &[u32], p: Precision, want: Logits, kv_bytes: usize) -> Vec<f32> {
    use duplex_kernels::device::emulated::{EmulatedConfig, EmulatedDevice};
    use duplex_kernels::device::{Device, StreamKind};
    use duplex_model::staged::{workspace_bytes, StagedPass};
    let dev = EmulatedDevice::new(EmulatedConfig { memory_bytes: 32 << 20, ..Default::default() }).unwrap();
    let (copy, compute) = (dev.create_stream(StreamKind::Copy).unwrap(), dev.create_stream(StreamKind::Compute).unwrap());
    let mut kv = pool(m);
    let mut table = BlockTable::default();
    let workspace = dev.alloc(workspace_bytes(m, 0, tokens.len(), want, kv_bytes).unwrap()).unwrap();
    let mut pass = StagedPass::new(m, &*dev, compute, &mut kv, &mut table, tokens, p, want, workspace, kv_bytes).unwrap();
    for module in m.staged_modules(64 << 10) {
        let slot = dev.alloc(module.device_bytes()).unwrap();
        let weights = module.upload(&*dev, copy, slot).unwrap();
        let loaded = dev.record(copy).unwrap();
        dev.wait_event(compute, &loaded).unwrap();
        pass.run(module.kind, &weights, &mut kv).unwrap();
        let done = dev.record(compute).unwrap();
        dev.synchronize(&done).unwrap();
        dev.free(slot).unwrap();
    }
    let logits = pass.finish(&mut table).unwrap();
    // The KV cache it wrote serves decode: continuing on the CPU engine
    // must give what a CPU-only prefill followed by the same step gives.
    let next = argmax(&logits[logits.len() - m.cfg.vocab_size..]);
    let step = m.forward(&mut kv, &mut table, &[next], p, Logits::Last).unwrap();
    let mut cpu_kv = pool(m);
    let mut cpu_table = BlockTable::default();
    m.forward(&mut cpu_kv, &mut cpu_table, tokens, p, Logits::Last).unwrap();
    let want_step = m.forward(&mut cpu_kv, &mut cpu_table, &[next], p, Logits::Last).unwrap();
    let scale = want_step.iter().fold(0.0f32, |a, b| a.max(b.abs()));
    let err = step.iter().zip(&want_step).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
    assert!(err <= 0.05 * scale, "decode after staged prefill: max error {err} vs scale {scale}");
    assert_eq!(argmax(&step), argmax(&want_step), "decode after staged prefill");
    logits
}

#[test]
fn staged_forward_on_emulated_device_matches_transformers() {
    for (f, m, prompts) in FIXTURES.map(|f| (f, model(f), prompts(f))) {
    for (i, p) in prompts.iter().enumerate() {
        // MLA: all heads' keys and values at once, and one scale block of heads at a time.
        if m.cfg.mla().is_some() {
            assert!(duplex_model::forward::heads_per_step(&m.cfg, p.input_ids.len(), 1) < m.cfg.num_attention_heads);
        }
        for kv_bytes in [usize::MAX, 1] {
            let got = staged_forward(m, &p.input_ids, Precision::F32, Logits::All, kv_bytes);
            let max_diff = max_abs_diff(&got, &p.logits);
            println!("{f} prompt {i}, kv_bytes {kv_bytes}: staged f32 max |Δlogit| = {max_diff:.3e}");
            assert!(max_diff <= F32_MAX_ABS_DIFF, "{f} prompt {i}: staged f32 max |Δlogit| {max_diff}");
            let got = staged_forward(m, &p.input_ids, Precision::Bf16, Logits::All, kv_bytes);
            check_bf16(&format!("{f} prompt {i} staged"), p, &got, m.cfg.vocab_size);
        }
    }
    }
}

/// A staged pass continues a sequence whose first tokens the CPU engine
/// cached: the device brings the cached context in from the paged pool.
#[test]
fn staged_forward_after_a_cached_prefix_matches_transformers() {
    use duplex_kernels::device::emulated::{EmulatedConfig, EmulatedDevice};
    use duplex_kernels::device::{Device, StreamKind};
    use duplex_model::staged::{workspace_bytes, StagedPass};
    for (f, m, prompts) in FIXTURES.map(|f| (f, model(f), prompts(f))) {
        let p = &prompts[1];
        let (cached, v) = (9, m.cfg.vocab_size);
        let dev = EmulatedDevice::new(EmulatedConfig { memory_bytes: 64 << 20, ..Default::default() }).unwrap();
        let (copy, compute) = (dev.create_stream(StreamKind::Copy).unwrap(), dev.create_stream(StreamKind::Compute).unwrap());
        let mut kv = pool(m);
        let mut table = BlockTable::default();
        m.forward(&mut kv, &mut table, &p.input_ids[..cached], Precision::F32, Logits::Last).unwrap();
        let rest = &p.input_ids[cached..];
        let workspace = dev.alloc(workspace_bytes(m, cached, rest.len(), Logits::All, 1).unwrap()).unwrap();
        let mut pass = StagedPass::new(m, &*dev, compute, &mut kv, &mut table, rest, Precision::F32, Logits::All, workspace, 1).unwrap();
        for module in m.staged_modules(64 << 10) {
            let slot = dev.alloc(module.device_bytes()).unwrap();
            let weights = module.upload(&*dev, copy, slot).unwrap();
            dev.wait_event(compute, &dev.record(copy).unwrap()).unwrap();
            pass.run(module.kind, &weights, &mut kv).unwrap();
            dev.synchronize(&dev.record(compute).unwrap()).unwrap();
            dev.free(slot).unwrap();
        }
        let got = pass.finish(&mut table).unwrap();
        assert_eq!(table.len, p.input_ids.len());
        let max_diff = max_abs_diff(&got, &p.logits[cached * v..]);
        println!("{f}: staged after {cached} cached tokens, f32 max |Δlogit| = {max_diff:.3e}");
        assert!(max_diff <= F32_MAX_ABS_DIFF, "{f}: staged after a cached prefix: max |Δlogit| {max_diff}");
    }
}
