//! Mixture-of-experts FFN on the worker pool, with the fine-grained
//! parallelism of §3.5 of the cloud-grade-SLO paper.
//!
//! Each expert is `down(silu(gate·x) ⊙ up·x)`. Stage 1 slices every active
//! expert's gate and up projections along M into tiles (never crossing a
//! scale block) and fuses the SiLU·up combine into the same task. A
//! per-expert countdown lets that expert's down-projection tiles (stage 2)
//! start as soon as its own stage-1 tiles are done; there is no barrier
//! between the stages. All tasks of a node sit in one list, stage 1 first, so
//! a thread that reaches a stage-2 task waits only for tiles that running
//! threads have already claimed. Shared experts are simply experts that every
//! token uses with weight 1, on the same pool.
//!
//! Block-quantized experts (GGUF k-quants) multiply 8-bit activations, as
//! llama.cpp does, with the conversions fused so that a layer has two
//! barriers (§3.5): the layer's tokens are quantized once, before any task
//! (one per weight family, not per expert); each expert's hidden rows stay
//! F32 until its last gate/up task, which quantizes them for the down
//! projection before the expert's countdown reaches zero. So every weight
//! byte is multiplied by activations quantized exactly once.
//!
//! NUMA: each expert is placed on a node and only that node's threads touch
//! its weights; every node leaves per-expert partial outputs that one last
//! parallel pass reduces into the result.

use crate::cpu::{convert::f32_to_bf16, gemv::matmul_bf16, isa::Isa};
use crate::parallel_linear::quantize_tokens;
use crate::pool::ThreadPool;
use crate::quant::{self, DotPath, QuantKind, QuantizedTokens};
use crate::shared::SharedSlice;
use crate::{WeightFormat, WeightView};
use std::sync::atomic::{AtomicUsize, Ordering};

/// The three projections of one expert.
#[derive(Clone, Copy, Debug)]
pub struct ExpertWeights<'a> {
    pub gate: WeightView<'a>,
    pub up: WeightView<'a>,
    pub down: WeightView<'a>,
}

/// One expert's share of a batch.
#[derive(Clone, Copy, Debug)]
pub struct ExpertCall<'a> {
    pub weights: ExpertWeights<'a>,
    /// `(token row, combine weight)` pairs.
    pub tokens: &'a [(usize, f32)],
    /// The NUMA node that holds this expert's weights.
    pub node: usize,
}

/// Buffers reused across calls, so the hot path does not allocate once they
/// have grown to the largest batch seen.
#[derive(Default)]
pub struct MoeScratch {
    xs: Vec<u16>,
    h: Vec<u16>,
    y: Vec<f32>,
    tile_out: Vec<f32>,
    pending: Vec<AtomicUsize>,
    layout: Vec<Layout>,
    tasks: Vec<Vec<Task>>,
    /// Tasks per node.
    counts: Vec<usize>,
    /// Block-quantized experts: the layer's tokens, quantized once for each
    /// activation format their gate/up weights take (`activation_slot`), as
    /// needed.
    xq: [QuantizedTokens; 3],
    /// Their hidden rows in F32, and quantized for the down projection.
    hf: Vec<f32>,
    hq: Vec<QuantizedTokens>,
}

/// The block formats of an expert's three projections, if all three are
/// block formats. An expert that mixes formats (a GGUF may keep one
/// projection in F16) takes the general path, whose `matmul_bf16` reads
/// every format, block formats quantizing their input per call.
fn quant_kinds(w: &ExpertWeights) -> Option<[QuantKind; 3]> {
    match (w.gate.format, w.up.format, w.down.format) {
        (WeightFormat::Quant(g), WeightFormat::Quant(u), WeightFormat::Quant(d)) => Some([g, u, d]),
        _ => None,
    }
}

/// Which of `MoeScratch::xq` holds the tokens `kind` multiplies: Q8_K for
/// the k-quants, Q8_1 for Q5_1, Q8_0 for the other 32-element formats; and
/// a kind each slot quantizes for.
fn activation_slot(kind: QuantKind) -> usize {
    match kind {
        QuantKind::Q4K | QuantKind::Q5K | QuantKind::Q6K => 0,
        QuantKind::Q5_1 => 2,
        _ => 1,
    }
}
const SLOT_KINDS: [QuantKind; 3] = [QuantKind::Q4K, QuantKind::Q8_0, QuantKind::Q5_1];

#[derive(Clone, Copy, Default)]
struct Layout {
    xs: usize,
    h: usize,
    y: usize,
}

#[derive(Clone, Copy)]
enum Task {
    GateUp { call: usize, rows: (usize, usize) },
    Down { call: usize, rows: (usize, usize) },
}

/// Weight bytes per task, at most. Every task pays fixed costs and starts
/// its read streams cold, so tasks of one 128-row block (256 KiB of the
/// `bench` preset's experts) left bandwidth unused: in A/B runs of a whole
/// MoE layer, 1 MiB tasks moved 4–20% more bytes per second, on those
/// experts and on V3's.
const TASK_BYTES: usize = 1 << 20;

/// Tasks per thread, at least, over a whole layer, so that the pool still
/// balances when threads run at different speeds.
const TASKS_PER_THREAD: usize = 8;

/// Rows per task for `w`, as many as fit in `task_bytes`: whole scale
/// blocks for FP8 (a tile never splits one), whole 16-row bands otherwise.
/// (BF16 experts took 64-row tasks, 96–256 KiB of Qwen3-30B-A3B's: their
/// fixed costs and cold streams held its MoE layer ~9% below what 1 MiB
/// tasks reach.)
fn tile_rows(w: &WeightView, task_bytes: usize) -> usize {
    match w.format {
        crate::WeightFormat::Fp8E4m3 { block } => block[0] * (task_bytes / (block[0] * w.cols).max(1)).max(1),
        _ => 16 * (task_bytes / (16 * w.format.row_bytes(w.cols)).max(1)).max(1),
    }
}

/// The task size for a layer's calls on `threads` threads.
fn task_bytes(calls: &[ExpertCall], threads: usize) -> usize {
    let bytes: usize = calls.iter().map(|c| [c.weights.gate, c.weights.up, c.weights.down].iter().map(|w| w.data.len()).sum::<usize>()).sum();
    (bytes / (TASKS_PER_THREAD * threads.max(1))).min(TASK_BYTES)
}

fn tiles(rows: usize, tile: usize) -> impl Iterator<Item = (usize, usize)> {
    (0..rows.div_ceil(tile)).map(move |i| (i * tile, ((i + 1) * tile).min(rows)))
}

/// Largest `n_tokens × tile` output any task produces, for per-thread buffers.
fn max_tile_out(calls: &[ExpertCall], task_bytes: usize) -> usize {
    calls
        .iter()
        .map(|c| c.tokens.len() * tile_rows(&c.weights.gate, task_bytes).max(tile_rows(&c.weights.down, task_bytes)))
        .max()
        .unwrap_or(0)
}

/// `out[t] = Σ_calls weight · expert(x[t])` for a batch `x` (`[n, d]`, F32).
/// `out` is overwritten.
pub fn moe_forward(pool: &ThreadPool, isa: Isa, calls: &[ExpertCall], x: &[f32], d: usize, out: &mut [f32], scratch: &mut MoeScratch) {
    let n = x.len() / d.max(1);
    assert_eq!(out.len(), n * d, "moe_forward: out is not [n, d]");
    let s = scratch;
    // Lay out every expert's gathered input, hidden and output rows.
    s.layout.clear();
    let (mut xs_len, mut h_len, mut y_len) = (0, 0, 0);
    let mut need = [false; 3];
    for c in calls {
        assert_eq!(c.weights.gate.cols, d, "expert gate width");
        assert_eq!(c.weights.down.rows, d, "expert down height");
        s.layout.push(Layout { xs: xs_len, h: h_len, y: y_len });
        if let Some([g, u, _]) = quant_kinds(&c.weights) {
            // Its input is the layer's quantized tokens; its hidden rows
            // live in `hf`, at the same offset `h` would give them.
            need[activation_slot(g)] = true;
            need[activation_slot(u)] = true;
        } else {
            xs_len += c.tokens.len() * d;
        }
        h_len += c.tokens.len() * c.weights.gate.rows;
        y_len += c.tokens.len() * d;
    }
    s.xs.resize(xs_len, 0);
    s.h.resize(h_len, 0);
    s.y.resize(y_len, 0.0);
    for (c, l) in calls.iter().zip(&s.layout) {
        if quant_kinds(&c.weights).is_some() {
            continue;
        }
        for (j, &(t, _)) in c.tokens.iter().enumerate() {
            f32_to_bf16(isa, &x[t * d..(t + 1) * d], &mut s.xs[l.xs + j * d..l.xs + (j + 1) * d]);
        }
    }
    // Barrier 1 of a quantized layer: every token quantized once.
    for ((xq, kind), _) in s.xq.iter_mut().zip(SLOT_KINDS).zip(need).filter(|&(_, needed)| needed) {
        quantize_tokens(pool, xq, kind, x, n);
    }
    if need.contains(&true) {
        s.hf.resize(h_len, 0.0);
        s.hq.resize_with(calls.len().max(s.hq.len()), QuantizedTokens::default);
    }

    // Task lists per node: all gate/up tiles first, then all down tiles.
    let nodes = pool.nodes();
    s.tasks.resize_with(nodes, Vec::new);
    s.tasks.iter_mut().for_each(|t| t.clear());
    s.pending.resize_with(calls.len().max(s.pending.len()), || AtomicUsize::new(0));
    let task_bytes = task_bytes(calls, pool.threads());
    for (i, c) in calls.iter().enumerate() {
        let node = c.node % nodes;
        let before = s.tasks[node].len();
        s.tasks[node].extend(tiles(c.weights.gate.rows, tile_rows(&c.weights.gate, task_bytes)).map(|rows| Task::GateUp { call: i, rows }));
        // A quantized expert counts one more step: quantizing its hidden rows.
        let extra = usize::from(quant_kinds(&c.weights).is_some());
        s.pending[i].store(s.tasks[node].len() - before + extra, Ordering::Relaxed);
    }
    for (i, c) in calls.iter().enumerate() {
        s.tasks[c.node % nodes].extend(tiles(d, tile_rows(&c.weights.down, task_bytes)).map(|rows| Task::Down { call: i, rows }));
    }

    let per_thread = max_tile_out(calls, task_bytes) * 2;
    s.tile_out.resize(per_thread * pool.threads(), 0.0);
    let h = SharedSlice::new(&mut s.h);
    let hf = SharedSlice::new(&mut s.hf);
    let hq = SharedSlice::new(&mut s.hq);
    let y = SharedSlice::new(&mut s.y);
    let tile_out = SharedSlice::new(&mut s.tile_out);
    let (tasks, pending, layout, xs) = (&s.tasks, &s.pending, &s.layout, &s.xs);
    let (xq, path) = (&s.xq, DotPath::for_isa(isa));
    let tokens_for = |kind: QuantKind| &xq[activation_slot(kind)];
    s.counts.clear();
    s.counts.extend(tasks.iter().map(|t| t.len()));
    pool.parallel_for_nodes(&s.counts, &|node, t| {
        // SAFETY: each thread has its own slot of the tile buffer, and a
        // thread runs one task at a time.
        let slot = crate::pool::thread_index();
        let buf = unsafe { tile_out.slice_mut(slot * per_thread, per_thread) };
        match tasks[node][t] {
            Task::GateUp { call, rows: (r0, r1) } if quant_kinds(&calls[call].weights).is_some() => {
                let c = &calls[call];
                let [gk, uk, dk] = quant_kinds(&c.weights).expect("matched above");
                let l = layout[call];
                let (ne, inter, m) = (c.tokens.len(), c.weights.gate.rows, r1 - r0);
                fn band<'w>(w: &WeightView<'w>, r0: usize, r1: usize) -> &'w [u8] {
                    let rb = w.format.row_bytes(w.cols);
                    &w.data[r0 * rb..r1 * rb]
                }
                let (g, u) = buf.split_at_mut(ne * m);
                let u = &mut u[..ne * m];
                quant::matmul_picked(path, gk, band(&c.weights.gate, r0, r1), m, tokens_for(gk), c.tokens, g).expect("loading checked the expert's shapes");
                quant::matmul_picked(path, uk, band(&c.weights.up, r0, r1), m, tokens_for(uk), c.tokens, u).expect("loading checked the expert's shapes");
                crate::cpu::elementwise::silu_mul(isa, g, u);
                for j in 0..ne {
                    // SAFETY: tile (r0..r1) of token row j of this expert is written by this task only.
                    unsafe { hf.slice_mut(l.h + j * inter + r0, m) }.copy_from_slice(&g[j * m..(j + 1) * m]);
                }
                // The expert's last gate/up tile (the count falls to the one
                // step left) quantizes its hidden rows: barrier 2, per expert.
                if pending[call].fetch_sub(1, Ordering::AcqRel) == 2 {
                    // SAFETY: every writer of this expert's hidden rows has
                    // finished (AcqRel above), and its down tasks wait for
                    // the count to reach zero before they read `hq[call]`.
                    let (h_e, q) = unsafe { (hf.slice(l.h, ne * inter), &mut hq.slice_mut(call, 1)[0]) };
                    q.quantize(dk, h_e, ne).expect("loading checked the expert's shapes");
                    pending[call].fetch_sub(1, Ordering::Release);
                }
            }
            Task::Down { call, rows: (r0, r1) } if quant_kinds(&calls[call].weights).is_some() => {
                let c = &calls[call];
                let [.., dk] = quant_kinds(&c.weights).expect("matched above");
                let l = layout[call];
                let (ne, m) = (c.tokens.len(), r1 - r0);
                while pending[call].load(Ordering::Acquire) != 0 {
                    std::hint::spin_loop();
                }
                let rb = c.weights.down.format.row_bytes(c.weights.down.cols);
                let o = &mut buf[..ne * m];
                // SAFETY: the expert's hidden rows were quantized before its count reached zero (Acquire above).
                let q = unsafe { &hq.slice(call, 1)[0] };
                quant::matmul(path, dk, &c.weights.down.data[r0 * rb..r1 * rb], m, q, o).expect("loading checked the expert's shapes");
                for j in 0..ne {
                    // SAFETY: tile (r0..r1) of token row j of this expert is written by this task only.
                    unsafe { y.slice_mut(l.y + j * d + r0, m) }.copy_from_slice(&o[j * m..(j + 1) * m]);
                }
            }
            Task::GateUp { call, rows: (r0, r1) } => {
                let c = &calls[call];
                let l = layout[call];
                let (ne, inter, m) = (c.tokens.len(), c.weights.gate.rows, r1 - r0);
                let xs_e = &xs[l.xs..l.xs + ne * d];
                let (g, u) = buf.split_at_mut(ne * m);
                matmul_bf16(isa, &c.weights.gate, r0..r1, xs_e, ne, g);
                matmul_bf16(isa, &c.weights.up, r0..r1, xs_e, ne, &mut u[..ne * m]);
                crate::cpu::elementwise::silu_mul(isa, g, &u[..ne * m]);
                for j in 0..ne {
                    // SAFETY: tile (r0..r1) of token row j of this expert is written by this task only.
                    let dst = unsafe { h.slice_mut(l.h + j * inter + r0, m) };
                    f32_to_bf16(isa, &g[j * m..(j + 1) * m], dst);
                }
                pending[call].fetch_sub(1, Ordering::Release);
            }
            Task::Down { call, rows: (r0, r1) } => {
                let c = &calls[call];
                let l = layout[call];
                let (ne, inter, m) = (c.tokens.len(), c.weights.gate.rows, r1 - r0);
                // The per-expert barrier: this expert's hidden rows must be complete.
                while pending[call].load(Ordering::Acquire) != 0 {
                    std::hint::spin_loop();
                }
                // SAFETY: all writers of this expert's hidden rows have finished (Acquire above).
                let h_e = unsafe { h.slice(l.h, ne * inter) };
                let o = &mut buf[..ne * m];
                matmul_bf16(isa, &c.weights.down, r0..r1, h_e, ne, o);
                for j in 0..ne {
                    // SAFETY: tile (r0..r1) of token row j of this expert is written by this task only.
                    let dst = unsafe { y.slice_mut(l.y + j * d + r0, m) };
                    dst.copy_from_slice(&o[j * m..(j + 1) * m]);
                }
            }
        }
    });

    // Reduce the experts' partial outputs, in parallel over column chunks.
    let out_shared = SharedSlice::new(out);
    let y = &s.y;
    let layout = &s.layout;
    const CHUNK: usize = 512;
    let chunks = d.div_ceil(CHUNK);
    pool.parallel_for(chunks, &|ci| {
        let (c0, c1) = (ci * CHUNK, ((ci + 1) * CHUNK).min(d));
        for t in 0..n {
            // SAFETY: columns c0..c1 of row t are written by this task only.
            unsafe { out_shared.slice_mut(t * d + c0, c1 - c0) }.fill(0.0);
        }
        for (c, l) in calls.iter().zip(layout) {
            for (j, &(t, w)) in c.tokens.iter().enumerate() {
                // SAFETY: as above.
                let o = unsafe { out_shared.slice_mut(t * d + c0, c1 - c0) };
                let src = &y[l.y + j * d + c0..l.y + j * d + c1];
                o.iter_mut().zip(src).for_each(|(a, b)| *a += w * b);
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::linear::matmul;
    use crate::pool::PoolConfig;
    use crate::WeightFormat;

    struct Owned {
        rows: usize,
        cols: usize,
        data: Vec<u8>,
        scales: Vec<f32>,
    }

    impl Owned {
        fn random(rows: usize, cols: usize, seed: u64) -> Self {
            let mut state = seed.wrapping_mul(0x9E3779B97F4A7C15) | 1;
            let mut next = || {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                state
            };
            // Codes of moderate magnitude (|v| ≤ 2), never NaN.
            let data = (0..rows * cols).map(|_| (next() as u8 & 0x80) | (next() as u8 % 0x40)).collect();
            let scales = (0..rows.div_ceil(128) * cols.div_ceil(128)).map(|i| 0.01 + 0.001 * (i % 7) as f32).collect();
            Owned { rows, cols, data, scales }
        }
        fn view(&self) -> WeightView<'_> {
            WeightView { rows: self.rows, cols: self.cols, format: WeightFormat::Fp8E4m3 { block: [128, 128] }, data: &self.data, scales: &self.scales }
        }
    }

    /// Plain reference: bf16-rounded inputs, F32 everywhere else.
    fn reference(experts: &[(ExpertWeights, Vec<(usize, f32)>)], x: &[f32], d: usize) -> Vec<f32> {
        let n = x.len() / d;
        let mut out = vec![0.0; n * d];
        for (w, tokens) in experts {
            for &(t, weight) in tokens {
                let xt: Vec<f32> = x[t * d..(t + 1) * d].iter().map(|v| crate::round_bf16(*v)).collect();
                let mut g = vec![0.0; w.gate.rows];
                let mut u = vec![0.0; w.gate.rows];
                matmul(&w.gate, &xt, 1, &mut g);
                matmul(&w.up, &xt, 1, &mut u);
                crate::elementwise::silu_mul(&mut g, &u);
                crate::round_bf16_slice(&mut g);
                let mut y = vec![0.0; d];
                matmul(&w.down, &g, 1, &mut y);
                out[t * d..(t + 1) * d].iter_mut().zip(&y).for_each(|(o, v)| *o += weight * v);
            }
        }
        out
    }

    fn check(pool: &ThreadPool, d: usize, inter: usize, n: usize) {
        let owned: Vec<[Owned; 3]> = (0..5)
            .map(|e| [Owned::random(inter, d, 3 * e + 1), Owned::random(inter, d, 3 * e + 2), Owned::random(d, inter, 3 * e + 3)])
            .collect();
        let weights: Vec<ExpertWeights> = owned.iter().map(|[g, u, dn]| ExpertWeights { gate: g.view(), up: u.view(), down: dn.view() }).collect();
        // Expert e takes tokens t with t % (e + 1) == 0; expert 4 is "shared" (all tokens, weight 1).
        let assignment: Vec<Vec<(usize, f32)>> = (0..5)
            .map(|e| if e == 4 { (0..n).map(|t| (t, 1.0)).collect() } else { (0..n).filter(|t| t % (e + 1) == 0).map(|t| (t, 0.3 + 0.1 * e as f32)).collect() })
            .collect();
        let x: Vec<f32> = (0..n * d).map(|i| ((i * 37 % 101) as f32 - 50.0) / 50.0).collect();
        let calls: Vec<ExpertCall> = weights.iter().zip(&assignment).enumerate().map(|(e, (w, t))| ExpertCall { weights: *w, tokens: t, node: e }).collect();
        let mut out = vec![f32::NAN; n * d];
        let mut scratch = MoeScratch::default();
        for isa in crate::cpu::isa::supported() {
            moe_forward(pool, isa, &calls, &x, d, &mut out, &mut scratch);
            let want = reference(&weights.iter().copied().zip(assignment.clone()).collect::<Vec<_>>(), &x, d);
            let scale = want.iter().map(|v| v.abs()).fold(0.0f32, f32::max).max(1e-6);
            for (a, b) in out.iter().zip(&want) {
                assert!((a - b).abs() <= 2e-2 * scale, "{isa:?}: {a} vs {b}");
            }
        }
    }

    #[test]
    fn matches_reference_on_one_node() {
        let pool = ThreadPool::new(&PoolConfig::single_node(2));
        check(&pool, 256, 320, 1);
        check(&pool, 200, 128, 3);
    }

    #[test]
    fn each_slot_quantizes_for_its_own_kinds() {
        for (slot, kind) in SLOT_KINDS.into_iter().enumerate() {
            assert_eq!(activation_slot(kind), slot, "{kind}");
        }
    }

    /// Experts large enough for tasks of several scale blocks, and for
    /// several tasks per projection (the last one partial).
    #[test]
    fn matches_reference_with_multi_block_tasks() {
        let pool = ThreadPool::new(&PoolConfig::single_node(2));
        // Tiles of 1024 + 512 gate rows and 640 + 384 down rows.
        check(&pool, 1024, 1536, 2);
    }

    #[test]
    fn tasks_cover_whole_scale_blocks_and_leave_every_thread_work() {
        let (gate, down) = (Owned::random(1536, 1024, 1), Owned::random(1024, 1536, 2));
        let weights = ExpertWeights { gate: gate.view(), up: gate.view(), down: down.view() };
        let calls: Vec<ExpertCall> = (0..5).map(|_| ExpertCall { weights, tokens: &[], node: 0 }).collect();
        // 23.6 MB over two threads: 1 MiB tasks, 1024 and 640 rows.
        let bytes = task_bytes(&calls, 2);
        assert_eq!(bytes, TASK_BYTES);
        assert_eq!((tile_rows(&weights.gate, bytes), tile_rows(&weights.down, bytes)), (1024, 640));
        // Over more threads the tasks shrink, to one block at the least.
        let bytes = task_bytes(&calls, 8);
        assert_eq!((tile_rows(&weights.gate, bytes), tile_rows(&weights.down, bytes)), (256, 128));
        assert_eq!(tile_rows(&weights.gate, task_bytes(&calls[..1], 1000)), 128);
    }

    #[test]
    fn matches_reference_on_two_simulated_nodes() {
        let pool = ThreadPool::new(&PoolConfig { threads_per_node: vec![1, 1], pin: false, cores: None });
        check(&pool, 256, 320, 2);
        check(&pool, 384, 200, 5);
    }
}
