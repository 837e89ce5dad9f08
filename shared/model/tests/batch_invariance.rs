//! Reproducible output: a sequence's logits must not depend on which other
//! sequences share its forward pass. Continuous batching puts a request
//! next to whatever else is running, so if the kernels' summation order
//! followed the batch (one token vs several, token groups, a GEMV for one
//! token and a tiled product for many), the same request with the same seed
//! would sample differently from run to run. Checked bit for bit, on the
//! bundled FP8 checkpoint, at every SIMD level this CPU runs, for decode
//! steps (one token per sequence, batches of 6 and of 12 — past the kernels'
//! 8-token groups) and for prefill chunks batched with other prompts.

use duplex_toolkit::reference::{self, argmax};
use duplex_model::{BlockTable, ForwardTimings, Logits, Model, Precision, SeqInput};
use std::path::{Path, PathBuf};

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tiny-dsv3")
}

/// Distinct prompts: the fixture's reference prompts, cut to a few lengths
/// so that the sequences sit at different positions.
fn prompts(count: usize) -> Vec<Vec<u32>> {
    let refs = reference::load(&fixture()).expect("the fixture's reference outputs");
    (0..count)
        .map(|i| {
            let (ids, skip) = (&refs[i % refs.len()].input_ids, i / refs.len());
            let len = (5 + 3 * i).min(ids.len() - skip);
            ids[skip..skip + len].to_vec()
        })
        .collect()
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|f| f.to_bits()).collect()
}

/// Prefill every prompt alone (the same work whatever is batched later),
/// then run `steps` greedy decode steps with the sequences `batch` (indices
/// into `prompts`) in one forward pass each. Returns the logits of every
/// step for each sequence of `batch`, in order.
fn decode_steps(m: &Model, p: Precision, prompts: &[Vec<u32>], batch: &[usize], steps: usize) -> Vec<Vec<f32>> {
    let v = m.cfg.vocab_size;
    let mut pool = m.new_kv_pool(256, 16);
    let mut tables: Vec<BlockTable> = batch.iter().map(|_| BlockTable::default()).collect();
    let mut next: Vec<u32> = vec![];
    for (table, &i) in tables.iter_mut().zip(batch) {
        let logits = m.forward(&mut pool, table, &prompts[i], p, Logits::Last).unwrap();
        next.push(argmax(&logits));
    }
    let mut out = vec![vec![]; batch.len()];
    for _ in 0..steps {
        let tokens: Vec<[u32; 1]> = next.iter().map(|&t| [t]).collect();
        let mut seqs: Vec<SeqInput> = tables.iter_mut().zip(&tokens).map(|(table, t)| SeqInput { table, tokens: t }).collect();
        let logits = m.forward_batch(&mut pool, &mut seqs, p, Logits::Last, &mut ForwardTimings::default()).unwrap();
        for (s, row) in logits.chunks(v).enumerate() {
            out[s].extend_from_slice(row);
            next[s] = argmax(row);
        }
    }
    out
}

/// Prefill the prompts `batch` in one forward pass; the last logits of each.
fn prefill_batch(m: &Model, p: Precision, prompts: &[Vec<u32>], batch: &[usize]) -> Vec<Vec<f32>> {
    let v = m.cfg.vocab_size;
    let mut pool = m.new_kv_pool(256, 16);
    let mut tables: Vec<BlockTable> = batch.iter().map(|_| BlockTable::default()).collect();
    let mut seqs: Vec<SeqInput> = tables.iter_mut().zip(batch).map(|(table, &i)| SeqInput { table, tokens: &prompts[i] }).collect();
    let logits = m.forward_batch(&mut pool, &mut seqs, p, Logits::Last, &mut ForwardTimings::default()).unwrap();
    logits.chunks(v).map(<[f32]>::to_vec).collect()
}

fn models() -> Vec<(String, Model, Precision)> {
    // On a CPU with AMX BF16 tiles, FP8 and BF16 products of 9 tokens or
    // more take the tiles, which sum in an order of their own: there a
    // batch of 12 parts from a sequence alone by design (README,
    // "Reproducible output"), and `DUPLEX_AMX=off` is what keeps the
    // invariance this checks. (The tiles' own invariance, among calls on
    // the tiles, is `duplex-kernels`' `each_token_alone_gives_the_same_bits`.)
    // Every test calls this before any product, and the kernels read the
    // variable at their first product.
    std::env::set_var("DUPLEX_AMX", "off");
    let mut out = vec![];
    let f32_model = Model::load(&fixture(), &mut |_, _| {}).unwrap();
    out.push(("f32".to_string(), f32_model, Precision::F32));
    for isa in duplex_kernels::cpu::isa::supported() {
        let mut m = Model::load(&fixture(), &mut |_, _| {}).unwrap();
        m.cpu.isa = isa;
        out.push((format!("bf16 {isa}"), m, Precision::Bf16));
    }
    out
}

/// Decode: sequence 0 alone, then with five others, then with eleven
/// others (more tokens than one kernel token group), in two positions of
/// the batch: its logits at every step must be the same bits.
#[test]
fn decode_logits_do_not_depend_on_the_batch() {
    let prompts = prompts(12);
    for (label, m, p) in models() {
        let alone = decode_steps(&m, p, &prompts, &[0], 3).remove(0);
        for batch in [vec![0, 1, 2, 3, 4, 5], vec![3, 1, 4, 0, 5, 2], (0..12).collect(), (0..12).rev().collect()] {
            let got = decode_steps(&m, p, &prompts, &batch, 3);
            let at = batch.iter().position(|&i| i == 0).unwrap();
            let same = bits(&got[at]) == bits(&alone);
            let diff = got[at].iter().zip(&alone).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
            assert!(same, "{label}: decode logits of a sequence batched with {} others differ from alone (max |Δ| {diff:e})", batch.len() - 1);
        }
    }
}

/// Prefill: a prompt's last logits alone and in one forward pass with
/// other prompts (before and after it) must be the same bits.
#[test]
fn prefill_logits_do_not_depend_on_the_batch() {
    let prompts = prompts(6);
    for (label, m, p) in models() {
        // Prompt 0 (5 tokens) alone fits one token group, prompt 2 (11) does not.
        for target in [0, 2] {
            let alone = prefill_batch(&m, p, &prompts, &[target]).remove(0);
            for batch in [vec![2, 0], vec![0, 1, 2, 3], vec![5, 2, 4, 0]] {
                let got = prefill_batch(&m, p, &prompts, &batch);
                let at = batch.iter().position(|&i| i == target).unwrap();
                let diff = got[at].iter().zip(&alone).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
                assert!(bits(&got[at]) == bits(&alone), "{label}: prefill logits of prompt {target} batched as {batch:?} differ from alone (max |Δ| {diff:e})");
            }
        }
    }
}
