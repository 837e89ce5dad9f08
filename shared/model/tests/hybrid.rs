//! The hybrid placement (attention and the rest on an emulated device,
//! routed experts on the CPU, the KV cache in a device pool) against the
//! CPU engine and against transformers, on the tiny checkpoint of every
//! family.

use duplex_kernels::device::emulated::{EmulatedConfig, EmulatedDevice, Jitter};
use duplex_kernels::device::{self, Device, Op, StreamKind};
use duplex_expert_cache::assign::AssignmentKind;
use duplex_expert_cache::policy::PolicyKind;
use duplex_expert_cache::prefetch::PrefetchKind;
use duplex_model::device_experts::ExpertCacheConfig;
use duplex_model::hybrid::{AdmitError, DeviceSeq, HybridConfig, HybridEngine, HybridTimings, Submit};
use duplex_model::{BlockTable, KvPool, Logits, Model, Precision, SeqInput};
use duplex_toolkit::reference::{self, argmax, max_abs_diff, Bf16Gate, ReferencePrompt, F32_MAX_ABS_DIFF};
use std::path::{Path, PathBuf};
use std::sync::{mpsc, Arc};
use std::time::Duration;

const FIXTURES: [&str; 3] = ["tiny-dsv3", "tiny-qwen3moe", "tiny-mixtral"];
const BLOCK: usize = 16;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures").join(name)
}

fn load(name: &str) -> Model {
    Model::load(&fixture(name), &mut |_, _| {}).expect("fixture loads")
}

fn prompts(name: &str) -> Vec<ReferencePrompt> {
    reference::load(&fixture(name)).expect("the fixture's reference outputs")
}

fn device(jitter: Option<Jitter>) -> Arc<dyn Device> {
    // One compute thread of its own, as on the benchmark machine.
    EmulatedDevice::new(EmulatedConfig { memory_bytes: 64 << 20, compute_threads: 1, jitter, ..Default::default() }).unwrap()
}

fn engine(name: &str, micro_batches: bool, submit: Submit) -> HybridEngine {
    HybridEngine::new(load(name), device(None), HybridConfig { kv_blocks: 64, micro_batches, defer_experts: 0, cpu_jitter: None, submit, expert_cache: None }, BLOCK).expect("the tiny model fits")
}

/// Six prompts of mixed lengths cut from the fixture's reference prompts.
fn batch_prompts(name: &str) -> Vec<Vec<u32>> {
    let refs = prompts(name);
    [40usize, 3, 25, 1, 57, 9]
        .iter()
        .enumerate()
        .map(|(i, &len)| refs[i % refs.len()].input_ids.iter().copied().cycle().skip(i).take(len).collect())
        .collect()
}

/// Greedy decode of `steps` tokens for each prompt, all in one batch, on the
/// CPU engine: every step's logits, per sequence.
fn cpu_decode(m: &Model, prompts: &[Vec<u32>], steps: usize, p: Precision) -> Vec<Vec<Vec<f32>>> {
    let v = m.cfg.vocab_size;
    let mut pool = m.new_kv_pool(64, BLOCK);
    let mut tables: Vec<BlockTable> = prompts.iter().map(|_| BlockTable::default()).collect();
    let mut out: Vec<Vec<Vec<f32>>> = prompts.iter().map(|_| vec![]).collect();
    for (i, prompt) in prompts.iter().enumerate() {
        out[i].push(m.forward(&mut pool, &mut tables[i], prompt, p, Logits::Last).unwrap());
    }
    for _ in 0..steps {
        let tokens: Vec<[u32; 1]> = out.iter().map(|o| [argmax(o.last().unwrap())]).collect();
        let mut seqs: Vec<SeqInput> = tables.iter_mut().zip(&tokens).map(|(table, t)| SeqInput { table, tokens: t }).collect();
        let logits = m.forward_batch(&mut pool, &mut seqs, p, Logits::Last, &mut Default::default()).unwrap();
        for (o, row) in out.iter_mut().zip(logits.chunks(v)) {
            o.push(row.to_vec());
        }
    }
    out
}

/// The same on the hybrid placement. Even-numbered prompts are prefilled
/// on the CPU into the host pool and handed over (as from the prefill
/// worker: their blocks are copied in); odd-numbered ones are prefilled by
/// the hybrid placement itself, in one batch.
fn hybrid_decode(e: &mut HybridEngine, prompts: &[Vec<u32>], steps: usize, p: Precision) -> Vec<Vec<Vec<f32>>> {
    hybrid_decode_counting(e, prompts, steps, p).0
}

/// [`hybrid_decode`], with the steps' timings summed over the whole run
/// (what the expert cache did, how steps were launched).
fn hybrid_decode_counting(e: &mut HybridEngine, prompts: &[Vec<u32>], steps: usize, p: Precision) -> (Vec<Vec<Vec<f32>>>, HybridTimings) {
    let v = e.model.cfg.vocab_size;
    let mut stats = HybridTimings::default();
    let mut host = e.model.new_kv_pool(64, BLOCK);
    let mut tables: Vec<BlockTable> = prompts.iter().map(|_| BlockTable::default()).collect();
    let mut out: Vec<Vec<Vec<f32>>> = prompts.iter().map(|_| vec![]).collect();
    for (i, prompt) in prompts.iter().enumerate() {
        host.reserve(&mut tables[i], prompt.len() + steps).unwrap();
        if i % 2 == 0 {
            out[i].push(e.model.forward(&mut host, &mut tables[i], prompt, p, Logits::Last).unwrap());
        }
    }
    let dseqs: Vec<DeviceSeq> = tables.iter().zip(prompts).map(|(t, pr)| e.admit(&host, t, pr.len() + steps).unwrap()).collect();
    let odd: Vec<usize> = (1..prompts.len()).step_by(2).collect();
    if !odd.is_empty() {
        let mut picked: Vec<(usize, &mut BlockTable)> = tables.iter_mut().enumerate().filter(|(i, _)| i % 2 == 1).collect();
        let mut seqs: Vec<SeqInput> = picked.iter_mut().map(|(i, table)| SeqInput { table, tokens: &prompts[*i] }).collect();
        let ds: Vec<&DeviceSeq> = odd.iter().map(|&i| &dseqs[i]).collect();
        let (logits, timings) = e.forward(&mut host, &mut seqs, &ds, p, Logits::Last).unwrap();
        stats += timings;
        for (&i, row) in odd.iter().zip(logits.chunks(v)) {
            out[i].push(row.to_vec());
        }
    }
    let refs: Vec<&DeviceSeq> = dseqs.iter().collect();
    for _ in 0..steps {
        let tokens: Vec<[u32; 1]> = out.iter().map(|o| [argmax(o.last().unwrap())]).collect();
        let mut seqs: Vec<SeqInput> = tables.iter_mut().zip(&tokens).map(|(table, t)| SeqInput { table, tokens: t }).collect();
        let (logits, timings) = e.forward(&mut host, &mut seqs, &refs, p, Logits::Last).unwrap();
        assert!(timings.cpu_moe > Duration::ZERO || timings.cache.device_experts > 0, "the routed experts ran");
        stats += timings;
        for (o, row) in out.iter_mut().zip(logits.chunks(v)) {
            o.push(row.to_vec());
        }
    }
    for (t, pr) in tables.iter().zip(prompts) {
        assert_eq!(t.len, pr.len() + steps);
    }
    let free = e.kv().free_blocks();
    for d in dseqs {
        e.release(d).unwrap();
    }
    assert!(e.kv().free_blocks() > free);
    assert_eq!(e.kv().free_blocks(), e.kv().total_blocks(), "every device block is back");
    (out, stats)
}

/// F32: the hybrid placement's tokens equal the CPU engine's, and its logits
/// lie within 2e-3 of them, at batch 1, 2 and 6 with long and short prompts
/// mixed, with and without micro-batches, the CPU experts started from the
/// device streams (each step captured as a graph, or not) or from the host.
#[test]
fn f32_hybrid_decode_equals_the_cpu_engine() {
    for f in FIXTURES {
        let all = batch_prompts(f);
        let cpu_model = load(f);
        for (micro_batches, submit) in [(true, Submit::Graph), (false, Submit::Graph), (true, Submit::Stream), (true, Submit::Host)] {
            let mut e = engine(f, micro_batches, submit);
            for batch in [1usize, 2, 6] {
                let prompts = &all[..batch];
                let want = cpu_decode(&cpu_model, prompts, 5, Precision::F32);
                let got = hybrid_decode(&mut e, prompts, 5, Precision::F32);
                for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                    for (step, (gs, ws)) in g.iter().zip(w).enumerate() {
                        let d = max_abs_diff(gs, ws);
                        assert!(d <= F32_MAX_ABS_DIFF, "{f} batch {batch} (micro-batches {micro_batches}, {submit:?}) seq {i} step {step}: max |Δlogit| {d}");
                        assert_eq!(argmax(gs), argmax(ws), "{f} batch {batch} seq {i} step {step}: greedy token differs");
                    }
                }
            }
        }
    }
}

/// Steps captured as graphs: the first of each shape makes an executable
/// graph, and later ones of that shape update it in place although the
/// context (and so kernels' parameters) grows every step; the logits are
/// the uncaptured steps' bit for bit.
#[test]
fn graph_steps_update_the_graph_kept_for_their_shape_and_equal_streamed_steps() {
    for f in FIXTURES {
        let prompts = &batch_prompts(f)[..3];
        let (mut graphed, mut streamed) = (engine(f, true, Submit::Graph), engine(f, true, Submit::Stream));
        assert_eq!(graphed.submit(), Submit::Graph, "the emulated device captures graphs");
        let (got, t) = hybrid_decode_counting(&mut graphed, prompts, 6, Precision::F32);
        let (want, plain) = hybrid_decode_counting(&mut streamed, prompts, 6, Precision::F32);
        assert_eq!(got, want, "{f}: graphs change the logits");
        assert_eq!(plain.graphs_instantiated + plain.graphs_updated, 0, "{f}: streamed steps launched graphs");
        // One prefill step (one shape) and six decode steps (another): two
        // graphs made, five updated.
        assert_eq!((t.graphs_instantiated, t.graphs_updated), (2, 5), "{f}");
    }
}

/// BF16: decoding the reference prompts token by token on the hybrid
/// placement (two at once, as two micro-batches) meets the engine's gates
/// against transformers.
#[test]
fn bf16_hybrid_decode_meets_the_reference_gates() {
    for (f, cache) in FIXTURES.iter().flat_map(|f| [(*f, false), (*f, true)]) {
        let refs = prompts(f);
        let mut e = match cache {
            false => engine(f, true, Submit::Graph),
            // With an expert cache of a few experts, DALI assignment and DALI prefetch.
            true => cached_engine(f, None, ExpertCacheConfig { experts: 4, assignment: AssignmentKind::Dali, prefetch: PrefetchKind::Residual, policy: PolicyKind::Workload }),
        };
        let v = e.model.cfg.vocab_size;
        let (a, b) = (&refs[0], &refs[1 % refs.len()]);
        let len = a.input_ids.len().min(b.input_ids.len());
        let mut host = e.model.new_kv_pool(64, BLOCK);
        let mut tables = [BlockTable::default(), BlockTable::default()];
        for t in tables.iter_mut() {
            host.reserve(t, len).unwrap();
        }
        let dseqs: Vec<DeviceSeq> = tables.iter().map(|t| e.admit(&host, t, len).unwrap()).collect();
        let refs_d: Vec<&DeviceSeq> = dseqs.iter().collect();
        let (mut got_a, mut got_b) = (vec![], vec![]);
        for pos in 0..len {
            let (ta, tb) = ([a.input_ids[pos]], [b.input_ids[pos]]);
            let [t0, t1] = &mut tables;
            let mut seqs = [SeqInput { table: t0, tokens: &ta }, SeqInput { table: t1, tokens: &tb }];
            let (logits, _) = e.forward(&mut host, &mut seqs, &refs_d, Precision::Bf16, Logits::Last).unwrap();
            got_a.extend_from_slice(&logits[..v]);
            got_b.extend_from_slice(&logits[v..]);
        }
        for (label, p, got) in [("a", a, &got_a), ("b", b, &got_b)] {
            let gate = Bf16Gate::new(p, got, v);
            println!("{f} hybrid bf16 decode (expert cache {cache}), prompt {label}: {gate}");
            assert!(gate.passed(), "{f} (expert cache {cache}) prompt {label}: {gate}");
        }
        for d in dseqs {
            e.release(d).unwrap();
        }
    }
}

/// Random delays in the device's streams and before every CPU MoE: many
/// decode steps over a changing batch (sequences finish and others take
/// their freed blocks) still give the CPU engine's tokens and logits, so no
/// expert output is read before it is complete and no freed block is
/// written by stale work.
#[test]
fn jittered_streams_and_churn_keep_the_cpu_engines_results() {
    let f = "tiny-qwen3moe";
    let all = batch_prompts(f);
    let cpu_model = load(f);
    // The third run has an expert cache of two experts, HybriMoE assignment
    // and impact prefetch: its slots are copied, read and replaced under the jitter.
    let cache = ExpertCacheConfig { experts: 2, assignment: AssignmentKind::HybriMoe, prefetch: PrefetchKind::Impact, policy: PolicyKind::Lru };
    for (submit, expert_cache) in [(Submit::Graph, None), (Submit::Stream, None), (Submit::Host, None), (Submit::Host, Some(cache))] {
        let jitter = Jitter { seed: 7, max: Duration::from_micros(300) };
        let mut e = HybridEngine::new(load(f), device(Some(jitter)), HybridConfig { kv_blocks: 24, micro_batches: true, defer_experts: 0, cpu_jitter: Some(jitter), submit, expert_cache }, BLOCK).unwrap();
        // Rounds of 3 sequences reuse the same 24 blocks: each round's blocks
        // were another's the round before.
        for round in 0..4 {
            let prompts: Vec<Vec<u32>> = (0..3).map(|i| all[(round + i) % all.len()].clone()).collect();
            let want = cpu_decode(&cpu_model, &prompts, 12, Precision::F32);
            let got = hybrid_decode(&mut e, &prompts, 12, Precision::F32);
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                for (step, (gs, ws)) in g.iter().zip(w).enumerate() {
                    assert!(max_abs_diff(gs, ws) <= F32_MAX_ABS_DIFF, "{submit:?} (cache {expert_cache:?}) round {round} seq {i} step {step}");
                }
            }
        }
    }
}

/// A full device KV pool refuses a sequence with a clear error and keeps
/// serving; a device too small for the resident weights is refused at
/// start-up, naming what does not fit.
#[test]
fn refusals_name_what_does_not_fit() {
    let f = "tiny-dsv3";
    let mut e = HybridEngine::new(load(f), device(None), HybridConfig { kv_blocks: 3, micro_batches: true, defer_experts: 0, cpu_jitter: None, submit: Submit::Stream, expert_cache: None }, BLOCK).unwrap();
    let host: KvPool = e.model.new_kv_pool(8, BLOCK);
    let held = e.admit(&host, &BlockTable::default(), 2 * BLOCK).unwrap();
    match e.admit(&host, &BlockTable::default(), 2 * BLOCK) {
        Err(AdmitError::Full { needed: 2, free: 1, total: 3 }) => {}
        other => panic!("expected a full pool, got {other:?}"),
    }
    e.release(held).unwrap();
    let again = e.admit(&host, &BlockTable::default(), 3 * BLOCK).unwrap();
    e.release(again).unwrap();

    let tiny = EmulatedDevice::new(EmulatedConfig { memory_bytes: 64 << 10, ..Default::default() }).unwrap();
    let err = HybridEngine::new(load(f), tiny, HybridConfig { kv_blocks: 4, micro_batches: true, defer_experts: 0, cpu_jitter: None, submit: Submit::Stream, expert_cache: None }, BLOCK).err().expect("64 KiB is too small");
    let msg = err.to_string();
    for part in ["resident weights", "embedding", "attention", "LM head", "KV pool of 4 blocks"] {
        assert!(msg.contains(part), "{msg}");
    }
}

/// A device fault in the middle of steps whose CPU experts are started and
/// awaited from the device streams ends the step with the device's error,
/// promptly: no stream is left waiting on the host, nor the host on a stream.
#[test]
fn a_device_fault_mid_step_is_an_error_not_a_hang() {
    let f = "tiny-qwen3moe";
    let dev = EmulatedDevice::new(EmulatedConfig { memory_bytes: 64 << 20, compute_threads: 1, ..Default::default() }).unwrap();
    let mut e = HybridEngine::new(load(f), dev.clone(), HybridConfig { kv_blocks: 8, micro_batches: true, defer_experts: 0, cpu_jitter: None, submit: Submit::Graph, expert_cache: None }, BLOCK).unwrap();
    // A stream of the test's own holds a faulting op until released.
    let s = dev.create_stream(StreamKind::Compute).unwrap();
    let (release, gate) = mpsc::channel::<()>();
    dev.host_fn(
        s,
        Box::new(move || {
            let _ = gate.recv();
        }),
    )
    .unwrap();
    let (pool, table) = (dev.alloc(64).unwrap(), dev.alloc(4).unwrap());
    device::upload_u32(&*dev, s, &[99], table).unwrap();
    let bad = device::PagedKv { pool, n_layers: 1, block_size: 1, entry_dim: 4 };
    dev.launch(s, &Op::KvGather { kv: bad, table, blocks: 1, layer: 0, out: dev.alloc(16).unwrap().matrix(1, 4) }).unwrap();

    let (results, outcomes) = mpsc::channel();
    let prompts = batch_prompts(f);
    std::thread::spawn(move || {
        let mut host = e.model.new_kv_pool(16, BLOCK);
        let mut tables = [BlockTable::default(), BlockTable::default()];
        for t in tables.iter_mut() {
            host.reserve(t, 64).unwrap();
        }
        let dseqs: Vec<DeviceSeq> = tables.iter().map(|t| e.admit(&host, t, 64).unwrap()).collect();
        let refs: Vec<&DeviceSeq> = dseqs.iter().collect();
        for step in 0..60 {
            let (ta, tb) = ([prompts[0][step % prompts[0].len()]], [prompts[2][step % prompts[2].len()]]);
            let [t0, t1] = &mut tables;
            let mut seqs = [SeqInput { table: t0, tokens: &ta }, SeqInput { table: t1, tokens: &tb }];
            let r = e.forward(&mut host, &mut seqs, &refs, Precision::F32, Logits::Last).map(|_| ()).map_err(|e| e.to_string());
            if results.send(r).is_err() {
                return;
            }
        }
    });
    let mut fault_at = None;
    for step in 0..60 {
        if step == 2 {
            release.send(()).unwrap();
        }
        match outcomes.recv_timeout(Duration::from_secs(60)) {
            Ok(Ok(())) => assert!(fault_at.is_none(), "step {step} succeeded after the fault at step {fault_at:?}"),
            Ok(Err(msg)) => {
                assert!(msg.contains("failed") || msg.contains("block"), "{msg}");
                if fault_at.is_none() {
                    println!("step {step}: {msg}");
                }
                fault_at.get_or_insert(step);
            }
            Err(e) => panic!("step {step} did not finish: {e}"),
        }
    }
    assert!(fault_at.is_some(), "the fault never showed");
}

fn cached_engine(name: &str, jitter: Option<Jitter>, cache: ExpertCacheConfig) -> HybridEngine {
    let cfg = HybridConfig { kv_blocks: 64, micro_batches: true, defer_experts: 0, cpu_jitter: jitter, submit: Submit::Stream, expert_cache: Some(cache) };
    HybridEngine::new(load(name), device(jitter), cfg, BLOCK).expect("the tiny model and its cache fit")
}

/// With the device's expert cache, under every assignment, prefetch and
/// replacement setting (each varied from a default, on every family; the
/// whole cross product on Qwen3-MoE), with a budget of one expert and of a
/// quarter of them, batch 1 and 6: the CPU engine's tokens, and logits within
/// 2e-3. The settings that may run experts on the device do so.
#[test]
fn f32_expert_cache_keeps_the_cpu_engines_results() {
    let assignments = [AssignmentKind::Static, AssignmentKind::HybriMoe, AssignmentKind::Dali];
    let prefetches = [PrefetchKind::None, PrefetchKind::Impact, PrefetchKind::Residual];
    let policies = [PolicyKind::Mrs, PolicyKind::Workload, PolicyKind::Lru, PolicyKind::Lfu];
    for f in FIXTURES {
        let all = batch_prompts(f);
        let cpu_model = load(f);
        let quarter = (cpu_model.cfg.n_routed_experts * cpu_model.cfg.moe_layers.iter().filter(|&&m| m).count() / 4).max(1);
        let base = ExpertCacheConfig { experts: quarter, assignment: AssignmentKind::Dali, prefetch: PrefetchKind::None, policy: PolicyKind::Mrs };
        let mut settings: Vec<ExpertCacheConfig> = vec![];
        if f == "tiny-qwen3moe" {
            for &assignment in &assignments {
                for &prefetch in &prefetches {
                    for &policy in &policies {
                        settings.push(ExpertCacheConfig { assignment, prefetch, policy, ..base });
                    }
                }
            }
        } else {
            settings.extend(assignments.iter().map(|&assignment| ExpertCacheConfig { assignment, ..base }));
            settings.extend(prefetches.iter().map(|&prefetch| ExpertCacheConfig { prefetch, ..base }));
            settings.extend(policies.iter().map(|&policy| ExpertCacheConfig { policy, ..base }));
        }
        settings.push(ExpertCacheConfig { experts: 1, assignment: AssignmentKind::HybriMoe, prefetch: PrefetchKind::Impact, policy: PolicyKind::Lru });
        settings.push(ExpertCacheConfig { experts: 1, ..base });
        for batch in [1usize, 6] {
            let prompts = &all[..batch];
            let want = cpu_decode(&cpu_model, prompts, 4, Precision::F32);
            for cache in &settings {
                let mut e = cached_engine(f, None, *cache);
                let (got, timings) = hybrid_decode_counting(&mut e, prompts, 4, Precision::F32);
                let stats = timings.cache;
                for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                    for (step, (gs, ws)) in g.iter().zip(w).enumerate() {
                        let d = max_abs_diff(gs, ws);
                        assert!(d <= F32_MAX_ABS_DIFF, "{f} batch {batch} {cache:?} seq {i} step {step}: max |Δlogit| {d}");
                        assert_eq!(argmax(gs), argmax(ws), "{f} batch {batch} {cache:?} seq {i} step {step}");
                    }
                }
                assert!(stats.lookups > 0 && stats.layers > 0, "{f} {cache:?}: the cache planned no layer");
                if cache.assignment == AssignmentKind::Static {
                    assert_eq!(stats.device_experts, 0, "{f} {cache:?}: static runs every routed expert on the CPU");
                }
                if batch == 6 && cache.experts > 1 {
                    println!("{f} batch {batch} {cache:?}: {stats:?} {:?}", e.expert_cache().unwrap().cost());
                }
            }
        }
    }
}
