//! The CPU placement runs a MoE layer's shared experts in its routed
//! experts' call (`Pass::shared_experts_with_routed`), one parallel region
//! where there were two. The shared experts' sum then joins the routed
//! ones' last instead of first; the claim is that no logit changes by a
//! bit. Checked here against the same program with the shared experts in a
//! call of their own, on DeepSeek-V3 (FP8, two shared experts) and its
//! GGUF Q4_K_M form, for prefill chunks and decode steps, in F32 and BF16.

use duplex_kernels::pool::PoolConfig;
use duplex_model::forward::{ModuleKind, Pass};
use duplex_model::{BlockTable, Logits, Model, Precision, SeqInput};
use duplex_toolkit::reference;
use std::path::{Path, PathBuf};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures").join(name)
}

/// The CPU placement's program with every shared expert in a call of its
/// own: `Model::forward_batch` as it was before the merge.
fn forward_shared_apart(m: &Model, pool: &mut duplex_model::KvPool, table: &mut BlockTable, tokens: &[u32], p: Precision) -> Vec<f32> {
    let mut seqs = [SeqInput { table, tokens }];
    let mut pass = Pass::new(m, m.cpu.backend(), pool, &mut seqs, p, Logits::All, usize::MAX).expect("a pass");
    let mut i = 0;
    while i < m.modules.len() {
        match m.modules[i].kind {
            ModuleKind::Expert { layer, .. } => {
                let group: Vec<_> = m.modules[i..]
                    .iter()
                    .map_while(|x| match x.kind {
                        ModuleKind::Expert { layer: l, expert } if l == layer => Some((expert, &x.weights)),
                        _ => None,
                    })
                    .collect();
                i += group.len();
                pass.run_experts(layer, &group).expect("experts run");
            }
            kind => {
                pass.run(kind, &m.modules[i].weights, pool).expect("module runs");
                i += 1;
            }
        }
    }
    let mut tables: Vec<&mut BlockTable> = seqs.iter_mut().map(|s| &mut *s.table).collect();
    pass.finish(&mut tables).expect("the pass finishes").0
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|f| f.to_bits()).collect()
}

#[test]
fn shared_experts_with_the_routed_ones_change_no_logit() {
    for (path, refs) in [(fixture("tiny-dsv3"), "tiny-dsv3"), (fixture("tiny-dsv3-q4km").join("model-Q4_K_M.gguf"), "tiny-dsv3")] {
        let name = path.display();
        // Two threads: the region's tasks then interleave the experts.
        let m = Model::load_with(&path, &PoolConfig::single_node(2), &mut |_, _| {}).expect("fixture loads");
        assert!(m.cfg.n_shared_experts > 0, "{name} has shared experts");
        let prompt = &reference::load(&fixture(refs)).expect("reference prompts")[0].input_ids;
        let prompt = &prompt[..prompt.len().min(24)];
        for p in [Precision::F32, Precision::Bf16] {
            let (mut pool_a, mut pool_b) = (m.new_kv_pool(8, 16), m.new_kv_pool(8, 16));
            let (mut table_a, mut table_b) = (BlockTable::default(), BlockTable::default());
            // A prefill chunk, then decode steps on its greedy tokens.
            let mut tokens = prompt.to_vec();
            for step in 0..4 {
                let merged = m.forward(&mut pool_a, &mut table_a, &tokens, p, Logits::All).expect("forward");
                let apart = forward_shared_apart(&m, &mut pool_b, &mut table_b, &tokens, p);
                assert_eq!(bits(&merged), bits(&apart), "{name} {p:?} step {step}: the logits moved");
                let last = &merged[merged.len() - m.cfg.vocab_size..];
                tokens = vec![reference::argmax(last) as u32];
            }
        }
    }
}
