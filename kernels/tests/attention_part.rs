//! Partial attention with its log-sum-exp (`Op::MlaPrefillPart`,
//! `Op::GqaAttentionPart`) and `Op::AttentionMerge` on the emulated device:
//! the keys of a causal attention split into contiguous ranges, attended a
//! range at a time and merged in any order, give the whole attention
//! (`Op::MlaPrefill`, `Op::GqaAttention`) and its log-sum-exp; the merge's
//! edge cases (−∞ on either side or both); and the shape checks.

use duplex_kernels::device::emulated::{EmulatedConfig, EmulatedDevice};
use duplex_kernels::device::{download_matrix, upload_f32, Device, DeviceError, GqaDims, Matrix, MlaDims, Op, StreamId, StreamKind};
use duplex_kernels::Precision;
use std::ops::Range;
use std::sync::Arc;

mod common;
use common::Rng;

struct Dev {
    dev: Arc<EmulatedDevice>,
    s: StreamId,
}

impl Dev {
    fn new() -> Self {
        let dev = EmulatedDevice::new(EmulatedConfig { memory_bytes: 32 << 20, compute_threads: 3, ..Default::default() }).unwrap();
        let s = dev.create_stream(StreamKind::Compute).unwrap();
        Dev { dev, s }
    }

    fn matrix(&self, xs: &[f32], rows: usize, cols: usize) -> Matrix {
        assert_eq!(xs.len(), rows * cols);
        let p = self.dev.alloc((xs.len() * 4).max(4)).unwrap();
        if !xs.is_empty() {
            upload_f32(&*self.dev, self.s, xs, p.slice(0, xs.len() * 4).unwrap()).unwrap();
        }
        p.matrix(rows, cols)
    }

    fn read(&self, m: Matrix) -> Vec<f32> {
        download_matrix(&*self.dev, self.s, m).unwrap()
    }

    #[track_caller]
    fn launch(&self, op: &Op) {
        self.dev.launch(self.s, op).unwrap_or_else(|e| panic!("{op:?}: {e}"));
    }
}

/// The two attentions, with what differs between them.
#[derive(Clone, Copy, Debug)]
enum Attention {
    Mla(MlaDims),
    Gqa(GqaDims),
}

impl Attention {
    fn heads(&self) -> usize {
        match self {
            Attention::Mla(d) => d.heads,
            Attention::Gqa(d) => d.heads,
        }
    }

    fn q_width(&self) -> usize {
        match self {
            Attention::Mla(d) => d.heads * (d.dn + d.dr),
            Attention::Gqa(d) => d.heads * d.head_dim,
        }
    }

    fn out_width(&self) -> usize {
        match self {
            Attention::Mla(d) => d.heads * d.dv,
            Attention::Gqa(d) => d.heads * d.head_dim,
        }
    }

    /// Widths of the two key-side inputs: (kv, latents) or (k, v).
    fn key_widths(&self) -> (usize, usize) {
        match self {
            Attention::Mla(d) => (d.heads * (d.dn + d.dv), d.dc + d.dr),
            Attention::Gqa(d) => (d.kv_heads * d.head_dim, d.kv_heads * d.head_dim),
        }
    }

    fn scale(&self) -> f32 {
        match self {
            Attention::Mla(_) => 0.3,
            Attention::Gqa(_) => 0.125,
        }
    }

    /// The whole causal attention over keys 0..start + n.
    fn whole(&self, q: Matrix, a: Matrix, b: Matrix, out: Matrix, start: usize, precision: Precision) -> Op {
        let scale = self.scale();
        match *self {
            Attention::Mla(dims) => Op::MlaPrefill { q, kv: a, latents: b, out, start, dims, scale, precision },
            Attention::Gqa(dims) => Op::GqaAttention { q, k: a, v: b, out, start, dims, scale, precision },
        }
    }

    /// The attention to the keys at positions `key_start..key_start + a.rows`.
    #[allow(clippy::too_many_arguments)]
    fn part(&self, q: Matrix, a: Matrix, b: Matrix, out: Matrix, lse: Matrix, start: usize, key_start: usize, precision: Precision) -> Op {
        let scale = self.scale();
        match *self {
            Attention::Mla(dims) => Op::MlaPrefillPart { q, kv: a, latents: b, out, lse, start, key_start, dims, scale, precision },
            Attention::Gqa(dims) => Op::GqaAttentionPart { q, k: a, v: b, out, lse, start, key_start, dims, scale, precision },
        }
    }

    /// Row i, head h's score of key t, in F64 from the F32 inputs.
    fn score(&self, q: &[f32], a: &[f32], b: &[f32], i: usize, h: usize, t: usize) -> f64 {
        let dot = |x: &[f32], y: &[f32]| x.iter().zip(y).map(|(&x, &y)| x as f64 * y as f64).sum::<f64>();
        let (qw, (aw, bw)) = (self.q_width(), self.key_widths());
        let s = match *self {
            Attention::Mla(d) => {
                let qh = &q[i * qw + h * (d.dn + d.dr)..][..d.dn + d.dr];
                dot(&qh[..d.dn], &a[t * aw + h * (d.dn + d.dv)..][..d.dn]) + dot(&qh[d.dn..], &b[t * bw + d.dc..][..d.dr])
            }
            Attention::Gqa(d) => {
                let j = h / d.group();
                dot(&q[i * qw + h * d.head_dim..][..d.head_dim], &a[t * aw + j * d.head_dim..][..d.head_dim])
            }
        };
        s * self.scale() as f64
    }
}

/// `got` is within `rel` of `want`, relative to each value's magnitude or,
/// for values near zero (sums that cancel), to the root mean square of all;
/// returns the largest error so measured.
#[track_caller]
fn assert_close(got: &[f32], want: &[f32], rel: f32, what: &str) -> f32 {
    assert_eq!(got.len(), want.len(), "{what}: lengths differ");
    let rms = (want.iter().map(|w| w * w).sum::<f32>() / want.len().max(1) as f32).sqrt();
    let mut worst = 0.0f32;
    for (k, (&g, &w)) in got.iter().zip(want).enumerate() {
        let err = (g - w).abs() / w.abs().max(rms).max(1e-30);
        assert!(err <= rel, "{what}: element {k}: merged {g}, whole {w} (relative error {err}, tolerance {rel})");
        worst = worst.max(err);
    }
    worst
}

/// Random dimensions: MLA or GQA, one to four heads, GQA groups of one to four.
fn random_attention(rng: &mut Rng, mla: bool) -> Attention {
    if mla {
        Attention::Mla(MlaDims { heads: rng.within(1, 4), dn: rng.within(1, 12), dr: rng.within(1, 6), dv: rng.within(1, 10), dc: rng.within(1, 8) })
    } else {
        let kv_heads = rng.within(1, 3);
        Attention::Gqa(GqaDims { heads: kv_heads * rng.within(1, 4), kv_heads, head_dim: rng.within(1, 20) })
    }
}

/// What one split run saw, for the coverage checks.
#[derive(Default)]
struct Seen {
    /// Parts a query row saw no key of, counted per row.
    blind_rows: usize,
    /// Parts no row saw any key of (wholly past the queries).
    masked_parts: usize,
    /// The largest error against the whole attention.
    worst: f32,
}

/// Attend `n` query rows at `start` to keys 0..start + n + spare split at
/// `cuts` (taken in `order`), merge the parts into an accumulator that
/// starts at zeros and −∞, and compare with the whole attention and, in
/// F32, with its log-sum-exp computed in F64.
#[allow(clippy::too_many_arguments)]
fn split_and_merge(dev: &Dev, rng: &mut Rng, att: Attention, n: usize, start: usize, spare: usize, ranges: &[Range<usize>], precision: Precision, rel: f32) -> Seen {
    let (qw, ow, heads, (aw, bw)) = (att.q_width(), att.out_width(), att.heads(), att.key_widths());
    let total = start + n + spare;
    let what = format!("{att:?}, n {n}, start {start}, keys {ranges:?}, {precision:?}");
    let (q, a, b) = (rng.f32s(n * qw, -1.0, 1.0), rng.f32s(total * aw, -1.0, 1.0), rng.f32s(total * bw, -1.0, 1.0));
    let (qm, am, bm) = (dev.matrix(&q, n, qw), dev.matrix(&a, total, aw), dev.matrix(&b, total, bw));
    let whole = dev.matrix(&vec![0.0; n * ow], n, ow);
    dev.launch(&att.whole(qm, am, bm, whole, start, precision));
    let want = dev.read(whole);
    let acc = dev.matrix(&vec![0.0; n * ow], n, ow);
    let acc_lse = dev.matrix(&vec![f32::NEG_INFINITY; n * heads], n, heads);
    // Stale values in the part's buffers: the op must write every element.
    let part = dev.matrix(&vec![f32::NAN; n * ow], n, ow);
    let part_lse = dev.matrix(&vec![f32::NAN; n * heads], n, heads);
    let mut seen = Seen::default();
    for r in ranges {
        dev.launch(&att.part(qm, am.rows(r.clone()), bm.rows(r.clone()), part, part_lse, start, r.start, precision));
        let (po, pl) = (dev.read(part), dev.read(part_lse));
        for i in 0..n {
            let blind = r.is_empty() || start + i < r.start;
            for h in 0..heads {
                let l = pl[i * heads + h];
                assert_eq!(blind, l == f32::NEG_INFINITY, "{what}: part {r:?}, row {i} head {h}: lse {l}");
                assert!(!l.is_nan(), "{what}: part {r:?}, row {i} head {h}: lse NaN");
            }
            if blind {
                assert!(po[i * ow..(i + 1) * ow].iter().all(|&x| x == 0.0), "{what}: part {r:?}, row {i} sees no key but has a nonzero output");
                seen.blind_rows += 1;
            }
        }
        seen.masked_parts += (r.is_empty() || r.start >= start + n) as usize;
        dev.launch(&Op::AttentionMerge { out: acc, lse: acc_lse, part, part_lse, heads });
    }
    seen.worst = assert_close(&dev.read(acc), &want, rel, &what);
    let lse = dev.read(acc_lse);
    for i in 0..n {
        for h in 0..heads {
            let expect = (0..=start + i).map(|t| att.score(&q, &a, &b, i, h, t).exp()).sum::<f64>().ln();
            let got = lse[i * heads + h] as f64;
            // BF16 rounds the scores' inputs: ~2^-8 of each product.
            let tol = if precision == Precision::F32 { 1e-5 } else { 2e-2 };
            assert!((got - expect).abs() <= tol * expect.abs().max(1.0), "{what}: row {i} head {h}: lse {got}, expected {expect}");
        }
    }
    seen
}

/// 2–4 contiguous ranges covering 0..total (empty ones included), in a random order.
fn random_ranges(rng: &mut Rng, total: usize) -> Vec<Range<usize>> {
    let pieces = rng.within(2, 4);
    let mut cuts: Vec<usize> = (1..pieces).map(|_| rng.within(0, total)).collect();
    cuts.extend([0, total]);
    cuts.sort_unstable();
    let mut ranges: Vec<Range<usize>> = cuts.windows(2).map(|w| w[0]..w[1]).collect();
    for k in (1..ranges.len()).rev() {
        ranges.swap(k, rng.within(0, k));
    }
    ranges
}

/// The tolerance against the whole attention (relative to each value or the
/// output's root mean square): F32 1e-5; BF16 2^-7, two BF16 steps, since the
/// whole op rounds its output to BF16 (up to 2^-8 relative here, 2^-9 at the
/// middle of a step) and sums its scores in another order than the parts.
fn tolerance(precision: Precision) -> f32 {
    match precision {
        Precision::F32 => 1e-5,
        Precision::Bf16 => 2f32.powi(-7),
    }
}

#[test]
fn split_keys_merge_into_the_whole_attention() {
    let dev = Dev::new();
    let mut rng = Rng::new(20);
    for mla in [true, false] {
        for precision in [Precision::F32, Precision::Bf16] {
            let (mut blind_rows, mut masked_parts, mut single_rows, mut worst) = (0, 0, 0, 0.0f32);
            for case in 0..40 {
                let att = random_attention(&mut rng, mla);
                let n = if case % 4 == 0 { 1 } else { rng.within(1, 9) };
                let (start, spare) = (rng.within(0, 15), rng.within(0, 5));
                let ranges = random_ranges(&mut rng, start + n + spare);
                let seen = split_and_merge(&dev, &mut rng, att, n, start, spare, &ranges, precision, tolerance(precision));
                blind_rows += seen.blind_rows;
                masked_parts += seen.masked_parts;
                single_rows += (n == 1) as usize;
                worst = worst.max(seen.worst);
            }
            // The random cases did cover what they are meant to.
            assert!(blind_rows > 0 && masked_parts > 0 && single_rows > 0, "mla {mla} {precision:?}: {blind_rows} blind rows, {masked_parts} masked parts, {single_rows} single rows");
            eprintln!("mla {mla}, {precision:?}: largest relative error {worst:e}");
        }
    }
}

/// Hand-picked splits: every key in its own range; a range after every
/// query; a query block at a large start whose early keys come in one piece.
#[test]
fn split_keys_edge_splits() {
    let dev = Dev::new();
    let mut rng = Rng::new(21);
    let mla = Attention::Mla(MlaDims { heads: 2, dn: 8, dr: 4, dv: 6, dc: 5 });
    let gqa = Attention::Gqa(GqaDims { heads: 6, kv_heads: 2, head_dim: 16 });
    for att in [mla, gqa] {
        for precision in [Precision::F32, Precision::Bf16] {
            let single: Vec<Range<usize>> = (0..4).map(|t| t..t + 1).rev().collect();
            split_and_merge(&dev, &mut rng, att, 3, 1, 0, &single, precision, tolerance(precision));
            split_and_merge(&dev, &mut rng, att, 4, 2, 3, &[6..9, 0..3, 3..6], precision, tolerance(precision));
            split_and_merge(&dev, &mut rng, att, 1, 200, 0, &[100..201, 0..100], precision, tolerance(precision));
            split_and_merge(&dev, &mut rng, att, 5, 0, 0, &[0..5, 5..5], precision, tolerance(precision));
        }
    }
}

/// One part over all the keys is the whole F32 attention, bit for bit, unrounded.
#[test]
fn one_part_is_the_whole_f32_attention() {
    let dev = Dev::new();
    let mut rng = Rng::new(22);
    for mla in [true, false] {
        for _ in 0..10 {
            let att = random_attention(&mut rng, mla);
            let (n, start) = (rng.within(1, 7), rng.within(0, 9));
            let (qw, ow, heads, (aw, bw)) = (att.q_width(), att.out_width(), att.heads(), att.key_widths());
            let ctx = start + n;
            let q = dev.matrix(&rng.f32s(n * qw, -1.0, 1.0), n, qw);
            let (a, b) = (dev.matrix(&rng.f32s(ctx * aw, -1.0, 1.0), ctx, aw), dev.matrix(&rng.f32s(ctx * bw, -1.0, 1.0), ctx, bw));
            let (whole, part, lse) = (dev.matrix(&vec![0.0; n * ow], n, ow), dev.matrix(&vec![0.0; n * ow], n, ow), dev.matrix(&vec![0.0; n * heads], n, heads));
            dev.launch(&att.whole(q, a, b, whole, start, Precision::F32));
            dev.launch(&att.part(q, a, b, part, lse, start, 0, Precision::F32));
            let (want, got) = (dev.read(whole), dev.read(part));
            assert!(got.iter().zip(&want).all(|(g, w)| g.to_bits() == w.to_bits()), "{att:?}, n {n}, start {start}");
        }
    }
}

#[test]
fn merge_edge_cases() {
    let dev = Dev::new();
    let inf = f32::INFINITY;
    // Two heads of width 3 per row; each row one case.
    let cases: [(f32, f32); 6] = [(-inf, -inf), (-inf, 0.5), (0.25, -inf), (1.0, 1.0), (3.0, -2.0), (-100.0, 50.0)];
    let rows = cases.len();
    let (heads, d) = (2, 3);
    let mut rng = Rng::new(23);
    let mut out = rng.f32s(rows * heads * d, -1.0, 1.0);
    let part = rng.f32s(rows * heads * d, -1.0, 1.0);
    // An accumulator at −∞ may hold anything: it is left as is, or replaced.
    out[0] = f32::NAN;
    out[heads * d + 1] = f32::NAN;
    let lse: Vec<f32> = cases.iter().flat_map(|&(a, _)| [a; 2]).collect();
    let part_lse: Vec<f32> = cases.iter().flat_map(|&(_, b)| [b; 2]).collect();
    let (om, lm) = (dev.matrix(&out, rows, heads * d), dev.matrix(&lse, rows, heads));
    let (pm, plm) = (dev.matrix(&part, rows, heads * d), dev.matrix(&part_lse, rows, heads));
    dev.launch(&Op::AttentionMerge { out: om, lse: lm, part: pm, part_lse: plm, heads });
    let (got, got_lse) = (dev.read(om), dev.read(lm));
    let bits = |xs: &[f32]| xs.iter().map(|x| x.to_bits()).collect::<Vec<u32>>();
    let row = |xs: &[f32], r: usize| xs[r * heads * d..(r + 1) * heads * d].to_vec();
    // Both −∞: the row as it was, NaN and all.
    assert_eq!(bits(&row(&got, 0)), bits(&row(&out, 0)));
    assert_eq!(got_lse[..2], [-inf, -inf]);
    // Only the part: the part exactly, its lse.
    assert_eq!(bits(&row(&got, 1)), bits(&row(&part, 1)));
    assert_eq!(got_lse[2..4], [0.5, 0.5]);
    // Only the accumulator: unchanged.
    assert_eq!(bits(&row(&got, 2)), bits(&row(&out, 2)));
    assert_eq!(got_lse[4..6], [0.25, 0.25]);
    // The general formula, in F64.
    for (r, &(la, lb)) in cases.iter().enumerate().skip(3) {
        let m = la.max(lb) as f64;
        let (a, b) = ((la as f64 - m).exp(), (lb as f64 - m).exp());
        for k in 0..heads * d {
            let i = r * heads * d + k;
            let want = (a * out[i] as f64 + b * part[i] as f64) / (a + b);
            assert!((got[i] as f64 - want).abs() <= 1e-6, "row {r} element {k}: {} vs {want}", got[i]);
        }
        for h in 0..heads {
            let want = m + (a + b).ln();
            assert!((got_lse[r * heads + h] as f64 - want).abs() <= 1e-6 * want.abs().max(1.0), "row {r}: lse {} vs {want}", got_lse[r * heads + h]);
        }
    }
    assert!((got_lse[6] - (1.0 + 2f32.ln())).abs() < 1e-6);
}

#[test]
fn bad_part_and_merge_shapes_are_refused() {
    let dev = Dev::new();
    let buf = |rows: usize, cols: usize| dev.matrix(&vec![0.0; rows * cols], rows, cols);
    let refused = |op: Op, why: &str| {
        assert!(matches!(op.validate(), Err(DeviceError::Invalid(_))), "{why}: {op:?}");
        assert!(matches!(dev.dev.launch(dev.s, &op), Err(DeviceError::Invalid(_))), "{why}: launch");
    };
    // MLA: 2 heads, dn 4, dr 2, dv 3, dc 5; 3 queries over 6 keys.
    let dims = MlaDims { heads: 2, dn: 4, dr: 2, dv: 3, dc: 5 };
    let (q, kv, lat, out, lse) = (buf(3, 12), buf(6, 14), buf(6, 7), buf(3, 6), buf(3, 2));
    let mla = |q: Matrix, kv: Matrix, latents: Matrix, out: Matrix, lse: Matrix, key_start: usize| Op::MlaPrefillPart { q, kv, latents, out, lse, start: 4, key_start, dims, scale: 1.0, precision: Precision::F32 };
    mla(q, kv, lat, out, lse, 2).validate().unwrap();
    mla(q, kv, lat, out, lse, 100).validate().expect("keys past every query: allowed, all masked");
    refused(mla(q, kv, buf(5, 7), out, lse, 0), "latents for other positions than kv");
    refused(mla(q, buf(6, 12), lat, out, lse, 0), "kv not heads × (dn + dv) wide");
    refused(mla(q, kv, lat, out, buf(3, 3), 0), "lse not [n, heads]");
    refused(mla(q, kv, lat, out, buf(2, 2), 0), "lse short of rows");
    refused(mla(q, kv, lat, buf(3, 5), lse, 0), "out not heads × dv wide");
    refused(mla(q, kv, lat, out, out.reshape(9, 2).rows(0..3), 0), "lse overlaps out");
    refused(mla(q, kv, lat, out, q.reshape(18, 2).rows(0..3), 0), "lse overlaps q");
    refused(mla(q, kv, lat, out, lse, usize::MAX), "key positions overflow");
    // GQA: 4 heads over 2 kv heads of 8.
    let gdims = GqaDims { heads: 4, kv_heads: 2, head_dim: 8 };
    let (q, k, v, out, lse) = (buf(3, 32), buf(5, 16), buf(5, 16), buf(3, 32), buf(3, 4));
    let gqa = |q: Matrix, k: Matrix, v: Matrix, out: Matrix, lse: Matrix, dims: GqaDims| Op::GqaAttentionPart { q, k, v, out, lse, start: 0, key_start: 0, dims, scale: 1.0, precision: Precision::F32 };
    gqa(q, k, v, out, lse, gdims).validate().unwrap();
    refused(gqa(q, k, buf(4, 16), out, lse, gdims), "v and k at different positions");
    refused(gqa(q, k, v, out, lse, GqaDims { kv_heads: 3, ..gdims }), "3 kv heads do not divide 4");
    refused(gqa(q, k, v, out, buf(3, 2), gdims), "lse not [n, heads]");
    refused(gqa(q, k, v, q, lse, gdims), "out is q");
    refused(gqa(q, k, v, out, k.reshape(20, 4).rows(0..3), gdims), "lse overlaps k");
    // Merge: 2 rows of 3 heads of 4.
    let (out, lse, part, part_lse) = (buf(2, 12), buf(2, 3), buf(2, 12), buf(2, 3));
    let merge = |out: Matrix, lse: Matrix, part: Matrix, part_lse: Matrix, heads: usize| Op::AttentionMerge { out, lse, part, part_lse, heads };
    merge(out, lse, part, part_lse, 3).validate().unwrap();
    refused(merge(out, lse, part, part_lse, 0), "no heads");
    refused(merge(out, lse, part, part_lse, 5), "5 heads do not divide 12 columns");
    refused(merge(out, lse, buf(2, 8), part_lse, 3), "part not shaped as out");
    refused(merge(out, lse, part, buf(1, 3), 3), "part_lse short of rows");
    refused(merge(out, buf(2, 4), part, part_lse, 3), "lse not [n, heads]");
    refused(merge(out, lse, out, part_lse, 3), "part is out");
    refused(merge(out, lse, part, lse, 3), "part_lse is lse");
}
