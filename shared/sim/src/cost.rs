//! How long an op or a transfer takes on a described machine: a roofline
//! per level, as MoE-Lightning's hierarchical roofline model puts it
//! (`P = min(P_peak, B·I)` at each level, links as one more level):
//!
//! `time = max(flops ÷ (peak × gemm_efficiency), bytes ÷ (bandwidth × efficiency)) + fixed cost`
//!
//! [`op_work`] counts an [`Op`]'s FLOPs and the bytes it must move: weights
//! read once (data plus FP8 scales), activations read and written as F32
//! (4 bytes, the device layer's format), causal attention over the keys each
//! query sees only. FLOPs are 2 per multiply-add; elementwise ops count one
//! per arithmetic step, which never decides their time (they are far below
//! any machine's turning point) but keeps them honest.

use crate::hardware::{CpuSpec, DeviceSpec};
use duplex_kernels::device::{Matrix, Op};
use duplex_kernels::Precision;
use std::time::Duration;

const GB: f64 = 1e9;
const TERA: f64 = 1e12;
/// AMX multiplies tiles of 16 rows: fewer activation rows leave it idle.
const AMX_MIN_ROWS: usize = 16;

/// What kind of work an op is, which picks the roofs it meets.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WorkKind {
    /// A product with a weight matrix: memory-bound work streams weights.
    Matmul,
    /// Attention over a context.
    Attention,
    /// Row-wise and elementwise work, copies, gathers, routing.
    Elementwise,
}

/// Which arithmetic the FLOPs run in, which picks the compute peak.
///
/// The BF16 path multiplies BF16 activations by weights widened from their
/// stored format (FP8 or BF16) with F32 accumulation: BF16 math, so a
/// tensor-core or AVX512-BF16 kernel runs it at the BF16 peak. FP8 weights
/// are widened, never multiplied as FP8, so no op of ours meets an FP8 peak.
/// The F32 path (the reference) is F32 math. Elementwise ops are F32 math
/// whatever the path.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Math {
    F32,
    Bf16,
}

impl From<Precision> for Math {
    fn from(p: Precision) -> Math {
        match p {
            Precision::F32 => Math::F32,
            Precision::Bf16 => Math::Bf16,
        }
    }
}

/// The FLOPs and bytes of one op.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Work {
    pub flops: f64,
    pub bytes: f64,
    pub kind: WorkKind,
    pub math: Math,
    /// Activation rows (tokens) a product multiplies: the CPU's AMX needs
    /// a tile's worth. 0 for work that is not a product.
    pub rows: usize,
}

impl Work {
    fn elementwise(flops: f64, bytes: f64) -> Work {
        Work { flops, bytes, kind: WorkKind::Elementwise, math: Math::F32, rows: 0 }
    }
}

/// Bytes of an F32 matrix's elements.
fn f32_bytes(m: &Matrix) -> f64 {
    (m.rows * m.cols * 4) as f64
}

/// How many (query, key) pairs a causal attention scores: queries at
/// positions `start..start + n`, keys at `key_start..key_start + keys`,
/// and a query sees the keys at or before its position.
fn visible_pairs(start: usize, n: usize, key_start: usize, keys: usize) -> f64 {
    // Query i sees clamp(start + i - key_start + 1, 0, keys) keys: a sum of
    // clamp(j, 0, keys) over j in first..=last.
    let (first, last) = (start as i128 - key_start as i128 + 1, start as i128 + n as i128 - key_start as i128);
    if n == 0 || last <= 0 {
        return 0.0;
    }
    let k = keys as i128;
    // Σ_{j=1}^{m} min(j, k).
    let upto = |m: i128| if m <= k { m * (m + 1) / 2 } else { k * (k + 1) / 2 + (m - k) * k };
    (upto(last) - upto((first - 1).max(0))) as f64
}

/// The FLOPs and bytes of `op`, as the module's doc counts them.
pub fn op_work(op: &Op) -> Work {
    match op {
        Op::Gemm { w, x, y, precision, .. } => {
            // Weights once (their bytes as stored, scales included), x read, y written.
            let flops = 2.0 * (x.rows * w.rows * w.cols) as f64;
            let bytes = (w.data.bytes + w.scales.bytes) as f64 + f32_bytes(x) + f32_bytes(y);
            Work { flops, bytes, kind: WorkKind::Matmul, math: (*precision).into(), rows: x.rows }
        }
        Op::GemmBatched { w, x, y, count, precision, .. } => {
            // `count` products of batch 0's shape, each with its own weight.
            let flops = 2.0 * (count * x.rows * w.rows * w.cols) as f64;
            let bytes = *count as f64 * ((w.data.bytes + w.scales.bytes) as f64 + f32_bytes(x) + f32_bytes(y));
            Work { flops, bytes, kind: WorkKind::Matmul, math: (*precision).into(), rows: x.rows }
        }
        // Square, sum, scale by 1/rms, by the weight: 4 per element; x read,
        // out written, the weight row read once.
        Op::RmsNorm { x, out, .. } => Work::elementwise(4.0 * (x.rows * x.cols) as f64, f32_bytes(x) + f32_bytes(out) + (x.cols * 4) as f64),
        // A rotation of each pair: 4 multiplies and 2 adds per pair, 3 per
        // element; x read and written, the cos and sin tables read.
        Op::Rope { x, cos, sin, .. } => Work::elementwise(3.0 * (x.rows * x.cols) as f64, 2.0 * f32_bytes(x) + f32_bytes(cos) + f32_bytes(sin)),
        // silu(g)·u = g / (1 + e^-g) · u: negate, exp, add, divide, multiply.
        Op::SiluMul { gate, up, .. } => Work::elementwise(5.0 * (gate.rows * gate.cols) as f64, 2.0 * f32_bytes(gate) + f32_bytes(up)),
        Op::Add { h, delta, .. } => Work::elementwise((h.rows * h.cols) as f64, 2.0 * f32_bytes(h) + f32_bytes(delta)),
        Op::RoundBf16 { x } => Work::elementwise((x.rows * x.cols) as f64, 2.0 * f32_bytes(x)),
        Op::Zero { x } => Work::elementwise(0.0, f32_bytes(x)),
        // Score every logit (sigmoid or softmax, ~4 steps each) and pick the
        // top k of each row (~one compare per logit and pick); logits and
        // bias read, ids and weights written.
        Op::Route { logits, bias, params, weights, .. } => {
            let n = logits.rows;
            let flops = ((4 + params.top_k) * n * logits.cols) as f64;
            let bytes = f32_bytes(logits) + bias.map_or(0.0, |b| b.bytes as f64) + (n * params.top_k * 4) as f64 + f32_bytes(weights);
            Work::elementwise(flops, bytes)
        }
        // `count` rows read and written, and their u32 indices.
        Op::GatherRows { count, dst, .. } => Work::elementwise(0.0, (count * dst.cols * 8 + count * 4) as f64),
        // `count` rows of src read, as many rows of dst read and written,
        // an index and a scale each; a multiply-add per element.
        Op::ScatterAddRows { src, count, .. } => Work::elementwise(2.0 * (count * src.cols) as f64, (count * src.cols * 12 + count * 8) as f64),
        // The ids read; every token whose id falls in this table's rows gets
        // a row decoded (one step per element) and written. Which ids fall
        // here is known only when the op runs: count every token, up to the
        // table's rows.
        Op::Embedding { table, count, out, .. } => {
            let rows = (*count).min(table.rows);
            let row_bytes = (table.data.bytes + table.scales.bytes) as f64 / table.rows.max(1) as f64;
            Work::elementwise((rows * out.cols) as f64, (count * 4) as f64 + rows as f64 * (row_bytes + (out.cols * 4) as f64))
        }
        // Expanded MLA, causal: per visible (query, key) pair and head, a
        // score over dn + dr and a weighted value over dv. Every key's kv
        // row and rope key read once (the rope key is the latents' last dr
        // columns), q read, out written.
        Op::MlaPrefill { q, kv, out, start, dims, precision, .. } => {
            let ctx = start + q.rows;
            let pairs = visible_pairs(*start, q.rows, 0, ctx);
            let flops = 2.0 * pairs * (dims.heads * (dims.dn + dims.dr + dims.dv)) as f64;
            let bytes = f32_bytes(q) + (ctx * (kv.cols + dims.dr) * 4) as f64 + f32_bytes(out);
            Work { flops, bytes, kind: WorkKind::Attention, math: (*precision).into(), rows: q.rows }
        }
        // Absorbed MLA for one token over every latent: per head and
        // latent, a score over dc + dr and a weighted sum over dc. The
        // latents are read once for all heads.
        Op::MlaDecode { q_latent, q_pe, latents, out, precision, .. } => {
            let heads = q_latent.rows;
            let (dc, dr, ctx) = (q_latent.cols, q_pe.cols, latents.rows);
            let flops = 2.0 * (heads * ctx * (2 * dc + dr)) as f64;
            let bytes = f32_bytes(q_latent) + f32_bytes(q_pe) + (ctx * (dc + dr) * 4) as f64 + f32_bytes(out);
            Work { flops, bytes, kind: WorkKind::Attention, math: (*precision).into(), rows: 1 }
        }
        // GQA, causal: per visible pair and query head, a score and a
        // weighted value over head_dim each. Keys and values up to the last
        // query's position read once (query heads of a group share them).
        Op::GqaAttention { q, out, start, dims, precision, .. } => {
            let ctx = start + q.rows;
            let pairs = visible_pairs(*start, q.rows, 0, ctx);
            let flops = 4.0 * pairs * (dims.heads * dims.head_dim) as f64;
            let bytes = f32_bytes(q) + (2 * ctx * dims.kv_heads * dims.head_dim * 4) as f64 + f32_bytes(out);
            Work { flops, bytes, kind: WorkKind::Attention, math: (*precision).into(), rows: q.rows }
        }
        // A piece of expanded MLA over the keys at key_start..: as MlaPrefill
        // over the pairs this piece holds, plus the log-sum-exp written.
        Op::MlaPrefillPart { q, kv, out, lse, start, key_start, dims, precision, .. } => {
            let pairs = visible_pairs(*start, q.rows, *key_start, kv.rows);
            let flops = 2.0 * pairs * (dims.heads * (dims.dn + dims.dr + dims.dv)) as f64;
            let bytes = f32_bytes(q) + (kv.rows * (kv.cols + dims.dr) * 4) as f64 + f32_bytes(out) + f32_bytes(lse);
            Work { flops, bytes, kind: WorkKind::Attention, math: (*precision).into(), rows: q.rows }
        }
        Op::GqaAttentionPart { q, k, v, out, lse, start, key_start, dims, precision, .. } => {
            let pairs = visible_pairs(*start, q.rows, *key_start, k.rows);
            let flops = 4.0 * pairs * (dims.heads * dims.head_dim) as f64;
            let bytes = f32_bytes(q) + f32_bytes(k) + f32_bytes(v) + f32_bytes(out) + f32_bytes(lse);
            Work { flops, bytes, kind: WorkKind::Attention, math: (*precision).into(), rows: q.rows }
        }
        // out and lse read and written, part and part_lse read; per element
        // two multiplies, an add and a divide, per row and head two exps
        // and a log (~3 steps each).
        Op::AttentionMerge { out, lse, part, part_lse, .. } => {
            let flops = 4.0 * (out.rows * out.cols) as f64 + 9.0 * (lse.rows * lse.cols) as f64;
            Work::elementwise(flops, 2.0 * f32_bytes(out) + f32_bytes(part) + 2.0 * f32_bytes(lse) + f32_bytes(part_lse))
        }
        // Entries read and written into the pool, the block table read.
        Op::KvStore { entries, blocks, .. } => Work::elementwise(0.0, 2.0 * f32_bytes(entries) + (blocks * 4) as f64),
        // out.rows entries read from the pool and written to out, the block table read.
        Op::KvGather { kv, blocks, out, .. } => Work::elementwise(0.0, (out.rows * kv.entry_dim * 4) as f64 + f32_bytes(out) + (blocks * 4) as f64),
    }
}

fn seconds(s: f64) -> Duration {
    Duration::from_secs_f64(s.max(0.0))
}

impl DeviceSpec {
    /// The modelled time of `op` on this device.
    pub fn op_time(&self, op: &Op) -> Duration {
        self.time(&op_work(op))
    }

    /// The roofline: the slower of the compute and the memory time, plus
    /// one launch. Products and attention on the BF16 path meet the BF16
    /// peak; everything else the F32 peak. Attention reaches its own
    /// fraction of the peak, products theirs.
    pub fn time(&self, w: &Work) -> Duration {
        let peak = match (w.kind, w.math) {
            (WorkKind::Matmul | WorkKind::Attention, Math::Bf16) => self.bf16_tflops,
            _ => self.f32_tflops,
        };
        let efficiency = match w.kind {
            WorkKind::Attention => self.attention_efficiency,
            WorkKind::Matmul => self.gemm_efficiency * self.gemm_row_fractions.at(w.rows),
            WorkKind::Elementwise => self.gemm_efficiency,
        };
        let compute = w.flops / (peak * TERA * efficiency);
        let memory = w.bytes / (self.memory_gb_per_s * GB * self.bandwidth_efficiency);
        seconds(compute.max(memory) + self.launch_us * 1e-6)
    }

    /// A host→device copy of `bytes`: the link's latency plus the bytes at
    /// the link's achieved bandwidth.
    pub fn h2d_time(&self, bytes: usize) -> Duration {
        seconds(self.link_latency_us * 1e-6 + bytes as f64 / (self.h2d_gb_per_s * GB * self.link_efficiency))
    }

    /// A device→host copy of `bytes`, likewise.
    pub fn d2h_time(&self, bytes: usize) -> Duration {
        seconds(self.link_latency_us * 1e-6 + bytes as f64 / (self.d2h_gb_per_s * GB * self.link_efficiency))
    }
}

impl CpuSpec {
    /// DRAM bandwidth `threads` threads reach with a streaming read, in
    /// bytes/s. The rule: each thread streams `core_read_gb_per_s` until
    /// together they reach the machine's `dram_read × read_efficiency`,
    /// past which more threads add nothing.
    pub fn read_bandwidth(&self, threads: usize) -> f64 {
        let threads = threads.clamp(1, self.cores()) as f64;
        (threads * self.core_read_gb_per_s).min(self.dram_read_gb_per_s * self.read_efficiency) * GB
    }

    /// The roofline of `w` on `threads` threads of this CPU (at most all
    /// its cores). Memory: the streaming read of [`Self::read_bandwidth`],
    /// times `gemv_efficiency` for products (they stream weights through
    /// the GEMV/MoE kernels). Compute: for attention, the rate the attention
    /// kernels reach (`attention_tflops` for one query row, as decode runs,
    /// `prefill_attention_tflops` for more); else the vector peak of `w.math`,
    /// or for BF16 products of at least 16 rows the AMX peak where there is
    /// one, times `gemm_efficiency` (and, for products, the fraction their
    /// rows reach, `gemm_row_fractions`); either shared out by core:
    /// `threads / cores` of it.
    ///
    /// The CPU path's F32 products (the reference) run on one thread in
    /// this codebase; callers pass the threads that actually run the work.
    pub fn time(&self, w: &Work, threads: usize) -> Duration {
        let threads = threads.clamp(1, self.cores());
        let bandwidth = match w.kind {
            WorkKind::Matmul => self.read_bandwidth(threads) * self.gemv_efficiency,
            _ => self.read_bandwidth(threads),
        };
        let amx = w.kind == WorkKind::Matmul && w.math == Math::Bf16 && w.rows >= AMX_MIN_ROWS && self.amx_bf16_tflops > 0.0;
        let peak = match w.math {
            _ if amx => self.amx_bf16_tflops,
            Math::Bf16 if w.kind != WorkKind::Elementwise => self.bf16_tflops,
            _ => self.f32_tflops,
        };
        let share = threads as f64 / self.cores() as f64;
        let rate = match w.kind {
            WorkKind::Attention if w.rows <= 1 => self.attention_tflops,
            WorkKind::Attention => self.prefill_attention_tflops,
            WorkKind::Matmul => peak * self.gemm_efficiency * self.gemm_row_fractions.at(w.rows),
            WorkKind::Elementwise => peak * self.gemm_efficiency,
        };
        let compute = w.flops / (rate * TERA * share);
        seconds(compute.max(w.bytes / bandwidth))
    }
}

#[cfg(test)]
mod tests {
    use super::visible_pairs;

    /// The closed form against counting pair by pair.
    #[test]
    fn visible_pairs_counts_each_querys_keys() {
        for (start, n, key_start, keys) in [(0usize, 5usize, 0usize, 5usize), (3, 4, 0, 7), (0, 6, 2, 3), (10, 3, 0, 4), (0, 3, 5, 4), (4, 8, 2, 6)] {
            let counted: usize = (0..n).map(|i| (start + i + 1).saturating_sub(key_start).min(keys)).sum();
            assert_eq!(visible_pairs(start, n, key_start, keys), counted as f64, "{start} {n} {key_start} {keys}");
        }
    }
}
