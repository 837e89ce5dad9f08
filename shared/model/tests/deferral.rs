//! Expert Deferral (KTransformers §4.1) against an independent
//! implementation of its formula,
//!   O_k = I_k + S_k(I_k) + R_{k−1}^def(I_{k−1}) + R_k^imm(I_k)
//! (the last MoE layer deferring none), and on the hybrid placement
//! against the CPU engine; plus what it does to the tiny models' logits.
//!
//! The independent implementation is a plain F32 forward pass of a
//! grouped-query-attention MoE model (Qwen3-MoE, Mixtral) over a whole
//! sequence, written here from the weights alone. Deferral acts on each
//! token's own experts, so running it over every position at once gives
//! what decoding token by token with deferral gives.

use duplex_kernels::device::emulated::{EmulatedConfig, EmulatedDevice};
use duplex_kernels::linear::{matmul, WeightView};
use duplex_model::forward::ModuleKind;
use duplex_model::hybrid::{HybridConfig, HybridEngine, Submit};
use duplex_model::weights::HostWeight;
use duplex_model::{BlockTable, Logits, Model, Precision, SeqInput};
use duplex_toolkit::reference::{self, argmax, max_abs_diff, F32_MAX_ABS_DIFF};
use std::path::{Path, PathBuf};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures").join(name)
}

fn load(name: &str) -> Model {
    Model::load(&fixture(name), &mut |_, _| {}).expect("fixture loads")
}

fn view(w: &HostWeight) -> WeightView<'_> {
    w.matrix().expect("a matrix").view()
}

/// `x · Wᵀ` for `n` rows.
fn linear(w: &HostWeight, x: &[f32], n: usize) -> Vec<f32> {
    let v = view(w);
    let mut y = vec![0.0; n * v.rows];
    matmul(&v, x, n, &mut y);
    y
}

fn rms_norm(x: &[f32], w: &[f32], eps: f32) -> Vec<f32> {
    x.chunks(w.len())
        .flat_map(|row| {
            let inv = 1.0 / (row.iter().map(|v| v * v).sum::<f32>() / row.len() as f32 + eps).sqrt();
            row.iter().zip(w).map(move |(v, g)| v * inv * g)
        })
        .collect()
}

/// Rotate each `hd`-wide head of row `pos` by halves (the Llama layout).
fn rope(x: &mut [f32], hd: usize, theta: f64, pos: usize) {
    for head in x.chunks_mut(hd) {
        for i in 0..hd / 2 {
            let angle = pos as f64 * theta.powf(-((2 * i) as f64) / hd as f64);
            let (c, s) = (angle.cos() as f32, angle.sin() as f32);
            let (a, b) = (head[i], head[i + hd / 2]);
            head[i] = a * c - b * s;
            head[i + hd / 2] = b * c + a * s;
        }
    }
}

fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// The whole-sequence logits of a GQA MoE model with `defer` of each
/// token's routed experts deferred, per the formula.
fn reference_forward(m: &Model, ids: &[u32], defer: usize) -> Vec<f32> {
    let c = &m.cfg;
    let g = c.gqa().expect("a GQA model");
    let (n, d, heads, kvh, hd) = (ids.len(), c.hidden_size, c.num_attention_heads, g.num_key_value_heads, g.head_dim);
    let module = |kind: ModuleKind| &m.modules.iter().find(|x| x.kind == kind).expect("module").weights;
    let get = |kind: ModuleKind, name: &str| module(kind).get(name).expect("weight").clone();
    let embed = get(ModuleKind::Embed { first_row: 0 }, "embed_tokens");
    let mut h: Vec<f32> = ids
        .iter()
        .flat_map(|&t| {
            let mut row = vec![0.0; d];
            view(&embed).decode_row(t as usize, &mut row);
            row
        })
        .collect();
    let last_moe = (0..c.num_hidden_layers).rev().find(|&l| c.is_moe_layer(l));
    // The previous MoE layer's deferred output, per token.
    let mut pending: Option<Vec<f32>> = None;
    for l in 0..c.num_hidden_layers {
        let att = ModuleKind::Attention { layer: l };
        let x = rms_norm(&h, get(att, "input_layernorm").vector().unwrap(), c.rms_norm_eps);
        let (mut q, mut k, v) = (linear(&get(att, "q_proj"), &x, n), linear(&get(att, "k_proj"), &x, n), linear(&get(att, "v_proj"), &x, n));
        if g.qk_norm {
            q = rms_norm(&q, get(att, "q_norm").vector().unwrap(), c.rms_norm_eps);
            k = rms_norm(&k, get(att, "k_norm").vector().unwrap(), c.rms_norm_eps);
        }
        for t in 0..n {
            rope(&mut q[t * heads * hd..(t + 1) * heads * hd], hd, c.rope_theta, t);
            rope(&mut k[t * kvh * hd..(t + 1) * kvh * hd], hd, c.rope_theta, t);
        }
        let scale = 1.0 / (hd as f32).sqrt();
        let mut attn = vec![0.0f32; n * heads * hd];
        for t in 0..n {
            for hh in 0..heads {
                let j = hh / (heads / kvh);
                let qv = &q[(t * heads + hh) * hd..][..hd];
                let mut s: Vec<f32> = (0..=t).map(|u| qv.iter().zip(&k[(u * kvh + j) * hd..][..hd]).map(|(a, b)| a * b).sum::<f32>() * scale).collect();
                let max = s.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
                s.iter_mut().for_each(|x| *x = (*x - max).exp());
                let sum: f32 = s.iter().sum();
                let out = &mut attn[(t * heads + hh) * hd..][..hd];
                for (u, p) in s.iter().enumerate() {
                    out.iter_mut().zip(&v[(u * kvh + j) * hd..][..hd]).for_each(|(o, vv)| *o += p / sum * vv);
                }
            }
        }
        let o = linear(&get(att, "o_proj"), &attn, n);
        h.iter_mut().zip(&o).for_each(|(a, b)| *a += b);

        let ffn = ModuleKind::Ffn { layer: l };
        let x = rms_norm(&h, get(ffn, "post_attention_layernorm").vector().unwrap(), c.rms_norm_eps);
        let expert = |prefix: &str, kind: ModuleKind, rows: &[f32]| -> Vec<f32> {
            let r = rows.len() / d;
            let (gt, up) = (linear(&get(kind, &format!("{prefix}gate_proj")), rows, r), linear(&get(kind, &format!("{prefix}up_proj")), rows, r));
            let act: Vec<f32> = gt.iter().zip(&up).map(|(a, b)| silu(*a) * b).collect();
            linear(&get(kind, &format!("{prefix}down_proj")), &act, r)
        };
        let mut out = vec![0.0f32; n * d];
        if !c.is_moe_layer(l) {
            out = expert("", ffn, &x);
        } else {
            let logits = linear(&get(ffn, "gate"), &x, n);
            let defer_here = if Some(l) == last_moe { 0 } else { defer };
            let mut deferred = vec![0.0f32; n * d];
            for t in 0..n {
                let row = &logits[t * c.n_routed_experts..][..c.n_routed_experts];
                let max = row.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
                let probs: Vec<f32> = row.iter().map(|v| (v - max).exp()).collect();
                let total: f32 = probs.iter().sum();
                let mut order: Vec<usize> = (0..probs.len()).collect();
                order.sort_by(|&a, &b| probs[b].total_cmp(&probs[a]));
                let top = &order[..c.num_experts_per_tok];
                let norm: f32 = if c.norm_topk_prob { top.iter().map(|&e| probs[e]).sum() } else { total };
                let xt = &x[t * d..(t + 1) * d];
                for (rank, &e) in top.iter().enumerate() {
                    let w = probs[e] / norm * c.routed_scaling_factor;
                    let y = expert("", ModuleKind::Expert { layer: l, expert: e }, xt);
                    let dst = if rank < top.len() - defer_here { &mut out } else { &mut deferred };
                    dst[t * d..(t + 1) * d].iter_mut().zip(&y).for_each(|(o, v)| *o += w * v);
                }
            }
            if let Some(p) = pending.take() {
                out.iter_mut().zip(&p).for_each(|(o, v)| *o += v);
            }
            if defer_here > 0 {
                pending = Some(deferred);
            }
        }
        h.iter_mut().zip(&out).for_each(|(a, b)| *a += b);
    }
    let head = ModuleKind::Head { first_row: 0 };
    let x = rms_norm(&h, get(head, "norm").vector().unwrap(), c.rms_norm_eps);
    linear(&get(head, "lm_head"), &x, n)
}

/// The engine decoding `ids` one token at a time, with deferral.
fn cpu_decode(m: &Model, ids: &[u32], defer: usize) -> Vec<f32> {
    let mut pool = m.new_kv_pool(64, 16);
    let mut table = BlockTable::default();
    let mut out = vec![];
    for &t in ids {
        let mut seqs = [SeqInput { table: &mut table, tokens: &[t] }];
        out.extend(m.forward_batch_deferred(&mut pool, &mut seqs, Precision::F32, Logits::Last, &mut Default::default(), defer).unwrap());
    }
    out
}

#[test]
fn cpu_deferral_equals_an_independent_implementation_of_the_formula() {
    for f in ["tiny-qwen3moe", "tiny-mixtral"] {
        let m = load(f);
        let k = m.cfg.num_experts_per_tok;
        assert!(m.cfg.moe_layers.iter().filter(|&&x| x).count() >= 2, "{f}: deferral needs two MoE layers");
        let ids = &reference::load(&fixture(f)).unwrap()[0].input_ids;
        let v = m.cfg.vocab_size;
        for defer in 0..k {
            let want = reference_forward(&m, ids, defer);
            let got = cpu_decode(&m, ids, defer);
            let diff = max_abs_diff(&got, &want);
            println!("{f}: defer {defer} of {k}: engine vs the formula, max |Δlogit| {diff:.2e}");
            assert!(diff <= F32_MAX_ABS_DIFF, "{f} defer {defer}: max |Δlogit| {diff}");
            for (r, (a, b)) in got.chunks(v).zip(want.chunks(v)).enumerate() {
                assert_eq!(argmax(a), argmax(b), "{f} defer {defer} position {r}");
            }
            if defer > 0 {
                // It is another function: the formula's logits move.
                assert!(max_abs_diff(&want, &reference_forward(&m, ids, 0)) > 10.0 * F32_MAX_ABS_DIFF, "{f}: deferring {defer} changed nothing");
            }
        }
    }
}

/// On the hybrid placement (batch 1, deferred experts on the CPU while the
/// device runs the next layer's attention) deferral computes what the CPU
/// engine's deferral computes; and what it does to the tiny models' logits
/// against transformers' (which defers nothing).
#[test]
fn hybrid_deferral_equals_the_cpu_engine_and_its_effect_is_quoted() {
    for f in ["tiny-dsv3", "tiny-qwen3moe", "tiny-mixtral"] {
        let refs = reference::load(&fixture(f)).unwrap();
        let cpu = load(f);
        let k = cpu.cfg.num_experts_per_tok;
        let v = cpu.cfg.vocab_size;
        for (defer, submit) in [(1, Submit::Graph), (k - 1, Submit::Stream), (k - 1, Submit::Host)] {
            let dev = EmulatedDevice::new(EmulatedConfig { memory_bytes: 64 << 20, compute_threads: 1, ..Default::default() }).unwrap();
            let mut e = HybridEngine::new(load(f), dev, HybridConfig { kv_blocks: 64, micro_batches: true, defer_experts: defer, cpu_jitter: None, submit, expert_cache: None }, 16).unwrap();
            for (i, p) in refs.iter().enumerate().take(2) {
                let ids = &p.input_ids;
                let mut host = e.model.new_kv_pool(64, 16);
                let mut table = BlockTable::default();
                host.reserve(&mut table, ids.len()).unwrap();
                let dseq = e.admit(&host, &table, ids.len()).unwrap();
                let mut got = vec![];
                for &t in ids {
                    let mut seqs = [SeqInput { table: &mut table, tokens: &[t] }];
                    got.extend(e.forward(&mut host, &mut seqs, &[&dseq], Precision::F32, Logits::Last).unwrap().0);
                }
                e.release(dseq).unwrap();
                let want = cpu_decode(&cpu, ids, defer);
                let diff = max_abs_diff(&got, &want);
                assert!(diff <= F32_MAX_ABS_DIFF, "{f} defer {defer} ({submit:?}) prompt {i}: hybrid vs CPU max |Δlogit| {diff}");
                let mean = got.iter().zip(&p.logits).map(|(a, b)| (a - b).abs()).sum::<f32>() / got.len() as f32;
                let rows = got.len() / v;
                let agree = (0..rows).filter(|&r| argmax(&got[r * v..(r + 1) * v]) == argmax(&p.logits[r * v..(r + 1) * v])).count();
                println!(
                    "{f} prompt {i}: defer {defer} of {k}: against transformers (no deferral) mean |Δlogit| {mean:.4}, top-1 agreement {:.3} ({agree}/{rows})",
                    agree as f64 / rows as f64
                );
            }
        }
    }
}
