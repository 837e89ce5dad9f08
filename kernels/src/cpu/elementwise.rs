//! Fused elementwise and row-wise ops at a chosen SIMD level: RMSNorm (with
//! optional BF16 rounding of its output), rotary embedding, SiLU·up, softmax,
//! and the MoE router's sigmoid scores and top-k selection.
//!
//! Each entry point takes an [`Isa`], clamps it with [`Isa::usable`] and runs:
//! - `Avx512Fp16`, `Avx512Bf16`, `Avx512`: the AVX-512F kernels (no BF16 or
//!   FP16 instruction helps here, and `vcvtneps2bf16` flushes subnormals, so
//!   all three levels share them);
//! - `Avx2`: the AVX2 + FMA kernels;
//! - `Portable`: the scalar reference in [`crate::elementwise`], unchanged.
//!
//! Lengths may be anything: the last partial vector is masked, so every
//! element of a row takes the same arithmetic.
//!
//! # Numerics
//!
//! - `e^x` (SiLU, softmax, sigmoid) is computed as `2^n · e^r` with
//!   `n = round(x / ln 2)`, `r = x − n·ln 2` in two FMA steps (Cody–Waite,
//!   `ln 2` split so that `n · LN2_HI` is exact), and `e^r ≈ 1 + r + r²·P(r)`
//!   with Cephes' degree-5 `expf` polynomial on `|r| ≤ ln 2 / 2`. `2^n` is
//!   applied as two normal powers of two, so results that underflow into the
//!   subnormals are rounded once and large inputs overflow to `+inf`; NaN
//!   stays NaN and `-inf` gives 0. Maximum relative error over the normal
//!   range (`x ∈ [-87.3, 88.7]`), measured against f64 by the test
//!   `exp_is_accurate` (2M points, plus the reduction boundaries) on every
//!   level: 8.2e-8, i.e. 0.69·2^-23 (at most ~1.4 ulp); the test asserts
//!   ≤ 2^-23 ≈ 1.2e-7. The scalar reference (libm's `expf`) is within 1 ulp.
//!   SiLU and sigmoid then differ from the scalar code by ≤ 3e-7 relative
//!   (measured), softmax and RMSNorm by their sums' rounding (≤ 3e-6 for
//!   7168-long rows, mostly the scalar loop's own error).
//! - RMSNorm and softmax reduce with several vector accumulators, so their
//!   sums are rounded in a different order than the scalar loop (more
//!   accurately, in fact: more, shorter partial sums). Everything after the
//!   reduction uses the scalar code's operations in the scalar code's order.
//! - Rotary embedding is bit-exact with the scalar code (same multiplies and
//!   adds, no FMA contraction).
//! - `top_k` compares only, so it is exact: the same indices as the scalar
//!   sort, ties included (lowest index first; NaN counts as `-inf`; `-0.0`
//!   ranks below `+0.0`, as `f32::total_cmp` has it).
//! - The fused BF16 rounding of [`rms_norm_bf16`] is bit-exact with
//!   `half::bf16::from_f32` (round to nearest even, NaN kept quiet).

use super::isa::Isa;

/// Inputs of `exp` are clamped to `[EXP_LO, EXP_HI]`: `e^-104` rounds to 0
/// and `e^89` overflows, so the clamp changes no result, and `n` stays in
/// `[-150, 128]`, where each half of `2^n` is a normal float.
pub(super) const EXP_LO: f32 = -104.0;
pub(super) const EXP_HI: f32 = 89.0;
pub(super) const LOG2E: f32 = std::f32::consts::LOG2_E;
/// `ln 2 = LN2_HI + LN2_LO`; `LN2_HI` (0x3f317200) has 15 significant bits,
/// so `n · LN2_HI` is exact for `|n| < 2^9`.
pub(super) const LN2_HI: f32 = 0.693_145_75;
pub(super) const LN2_LO: f32 = 1.428_606_8e-6;
/// Cephes `expf`: `e^r ≈ 1 + r + r² · P(r)`, highest degree first.
pub(super) const EXP_POLY: [f32; 6] = [1.987_569_1e-4, 1.398_199_9e-3, 8.333_452e-3, 4.166_579_6e-2, 1.666_666_6e-1, 0.5];
/// The longest rotary half-dimension the interleaved layout supports (the
/// scalar reference has the same limit).
pub const ROPE_MAX_HALF: usize = 256;

/// An `i32` whose order is that of `f32::total_cmp`, with NaN read as `-inf`
/// (as the router's scalar top-k does). Every key is above `i32::MIN`.
#[inline]
pub(super) fn sort_key(v: f32) -> i32 {
    let v = if v.is_nan() { f32::NEG_INFINITY } else { v };
    let b = v.to_bits() as i32;
    b ^ (((b >> 31) as u32) >> 1) as i32
}

/// `out = x / sqrt(mean(x²) + eps) · weight` (see [`crate::elementwise::rms_norm`]).
pub fn rms_norm(isa: Isa, x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    assert!(x.len() == weight.len() && x.len() == out.len(), "rms_norm: length mismatch");
    match isa.usable() {
        // SAFETY: `usable()` guarantees the features each path enables; the
        // lengths are checked above.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 | Isa::Avx512Bf16 | Isa::Avx512Fp16 => unsafe { super::elementwise_avx512::rms_norm::<false>(x, weight, eps, out) },
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { super::elementwise_avx2::rms_norm::<false>(x, weight, eps, out) },
        _ => crate::elementwise::rms_norm(x, weight, eps, out),
    }
}

/// [`rms_norm`] with every output rounded to BF16 precision (kept as f32),
/// in the same pass: bit-exact with [`rms_norm`] followed by
/// [`crate::round_bf16_slice`] at the same level.
pub fn rms_norm_bf16(isa: Isa, x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    assert!(x.len() == weight.len() && x.len() == out.len(), "rms_norm_bf16: length mismatch");
    match isa.usable() {
        // SAFETY: as in `rms_norm`.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 | Isa::Avx512Bf16 | Isa::Avx512Fp16 => unsafe { super::elementwise_avx512::rms_norm::<true>(x, weight, eps, out) },
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { super::elementwise_avx2::rms_norm::<true>(x, weight, eps, out) },
        _ => {
            crate::elementwise::rms_norm(x, weight, eps, out);
            crate::round_bf16_slice(out);
        }
    }
}

/// `gate[i] = silu(gate[i]) · up[i]` in place.
pub fn silu_mul(isa: Isa, gate: &mut [f32], up: &[f32]) {
    assert_eq!(gate.len(), up.len(), "silu_mul: length mismatch");
    match isa.usable() {
        // SAFETY: `usable()` guarantees the features; the lengths match.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 | Isa::Avx512Bf16 | Isa::Avx512Fp16 => unsafe { super::elementwise_avx512::silu_mul(gate, up) },
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { super::elementwise_avx2::silu_mul(gate, up) },
        _ => crate::elementwise::silu_mul(gate, up),
    }
}

/// Numerically stable softmax in place.
pub fn softmax(isa: Isa, xs: &mut [f32]) -> crate::elementwise::SoftmaxStats {
    match isa.usable() {
        // SAFETY: `usable()` guarantees the features.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 | Isa::Avx512Bf16 | Isa::Avx512Fp16 => unsafe { super::elementwise_avx512::softmax(xs) },
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { super::elementwise_avx2::softmax(xs) },
        _ => crate::elementwise::softmax(xs),
    }
}

/// `e^x` of every element in place (the levels' `exp` is within one f32
/// epsilon, relative, of the correctly rounded value).
pub fn exp_slice(isa: Isa, xs: &mut [f32]) {
    match isa.usable() {
        // SAFETY: `usable()` guarantees the features.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 | Isa::Avx512Bf16 | Isa::Avx512Fp16 => unsafe { super::elementwise_avx512::exp_slice(xs) },
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { super::elementwise_avx2::exp_slice(xs) },
        _ => xs.iter_mut().for_each(|x| *x = x.exp()),
    }
}

/// Rotary embedding of one head's rotary part, both layouts (see
/// [`crate::elementwise::rope`]); bit-exact with it at every level.
/// The interleaved layout needs `cos.len() <= ROPE_MAX_HALF`.
pub fn rope(isa: Isa, x: &mut [f32], cos: &[f32], sin: &[f32], interleaved: bool) {
    let half = cos.len();
    assert!(sin.len() == half && x.len() == 2 * half, "rope: x must be 2 · cos.len() long, sin as long as cos");
    assert!(!interleaved || half <= ROPE_MAX_HALF, "rope: interleaved rotary dimension {} above {}", 2 * half, 2 * ROPE_MAX_HALF);
    match isa.usable() {
        // SAFETY: `usable()` guarantees the features; the shapes are checked above.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 | Isa::Avx512Bf16 | Isa::Avx512Fp16 => unsafe { super::elementwise_avx512::rope(x, cos, sin, interleaved) },
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { super::elementwise_avx2::rope(x, cos, sin, interleaved) },
        _ => crate::elementwise::rope(x, cos, sin, interleaved),
    }
}

/// The router's score step: `scores = sigmoid(logits)` and `choice =
/// scores + bias` (the correction bias that steers selection only), or a
/// copy of the scores without a bias.
pub fn router_scores(isa: Isa, logits: &[f32], bias: Option<&[f32]>, scores: &mut [f32], choice: &mut [f32]) {
    let n = logits.len();
    assert!(scores.len() == n && choice.len() == n, "router_scores: length mismatch");
    assert!(bias.is_none_or(|b| b.len() == n), "router_scores: bias length mismatch");
    match isa.usable() {
        // SAFETY: `usable()` guarantees the features; the lengths are checked above.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 | Isa::Avx512Bf16 | Isa::Avx512Fp16 => unsafe { super::elementwise_avx512::router_scores(logits, bias, scores, choice) },
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { super::elementwise_avx2::router_scores(logits, bias, scores, choice) },
        _ => crate::elementwise::router_scores(logits, bias, scores, choice),
    }
}

/// Indices of the `k` largest values, best first; ties go to the lower
/// index and NaN counts as `-inf` (exactly [`crate::elementwise::top_k`]).
/// One vectorised max-scan per pick over integer keys: meant for router
/// widths (up to a few hundred values) and small `k`.
pub fn top_k(isa: Isa, values: &[f32], k: usize) -> Vec<usize> {
    let k = k.min(values.len());
    match isa.usable() {
        #[cfg(target_arch = "x86_64")]
        isa @ (Isa::Avx2 | Isa::Avx512 | Isa::Avx512Bf16 | Isa::Avx512Fp16) => {
            const STACK: usize = 256;
            let padded = values.len().div_ceil(16) * 16;
            let mut stack = [0i32; STACK];
            let mut heap = vec![];
            let keys: &mut [i32] = if padded <= STACK {
                &mut stack[..padded]
            } else {
                heap.resize(padded, 0);
                &mut heap
            };
            // SAFETY: `usable()` guarantees the features, and `keys` is a
            // multiple of 16 long and covers `values`.
            unsafe {
                if isa == Isa::Avx2 {
                    super::elementwise_avx2::sort_keys(values, keys);
                } else {
                    super::elementwise_avx512::sort_keys(values, keys);
                }
            }
            (0..k)
                .map(|_| {
                    // SAFETY: as above; `keys` is not empty, as k > 0 here
                    // implies values.len() > 0.
                    let i = unsafe {
                        if isa == Isa::Avx2 {
                            super::elementwise_avx2::argmax_key(keys)
                        } else {
                            super::elementwise_avx512::argmax_key(keys)
                        }
                    };
                    // Taken: below every remaining value (and the padding
                    // never wins while k <= values.len()).
                    keys[i] = i32::MIN;
                    i
                })
                .collect()
        }
        _ => crate::elementwise::top_k(values, k),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::isa;
    use proptest::prelude::*;

    /// Unit roundoff of f32.
    const U: f64 = f32::EPSILON as f64 / 2.0;

    /// The relative error bound of a sum of `n` non-negative f32 terms (each
    /// itself a rounded product) taken sequentially, as the scalar
    /// reference does: `n · u` (Higham's γ_n, to first order). The SIMD
    /// kernels' bound is smaller (n/8 terms per partial sum at most), so the
    /// two results differ by at most about twice this.
    fn sum_bound(n: usize) -> f64 {
        n as f64 * U
    }

    /// Per-element tolerance for results that go through `exp`: ours is
    /// within 1.2e-7 relative (`exp_is_accurate`), libm's within about as
    /// much, and the few roundings after it (add, divide, multiply) add about
    /// 4u (2.4e-7) to each side: ≤ 7.2e-7 in all (3e-7 observed). 1e-6
    /// covers that, and is far below what matters downstream: these values
    /// are rounded to BF16 (relative spacing 2^-8 ≈ 4e-3) right after.
    const EXP_TOL: f64 = 1e-6;

    /// Absolute slack for results that underflow: libm and our `exp` may
    /// round differently in the subnormal range (and near the overflow
    /// threshold, where `silu` of a large negative input is ~1e-37 or 0).
    const TINY: f64 = 1e-30;

    fn close(got: f32, want: f32, rel: f64) -> bool {
        got == want || (got as f64 - want as f64).abs() <= rel * (want as f64).abs() + TINY
    }

    fn lengths() -> impl Strategy<Value = usize> {
        // Mostly short rows (every tail length), some long ones.
        prop_oneof![3 => 1usize..=80, 2 => 1usize..=1000]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(128))]

        #[test]
        fn rms_norm_matches_scalar(
            (x, w) in lengths().prop_flat_map(|n| (prop::collection::vec(-50.0f32..50.0, n), prop::collection::vec(-2.0f32..2.0, n))),
            eps in prop_oneof![Just(1e-6f32), Just(1e-5), 0.0f32..1.0],
        ) {
            let n = x.len();
            let mut want = vec![0.0; n];
            crate::elementwise::rms_norm(&x, &w, eps, &mut want);
            // Exact, in f64, for a bound on the SIMD kernels alone.
            let ms = x.iter().map(|&v| v as f64 * v as f64).sum::<f64>() / n as f64;
            let inv = 1.0 / (ms + eps as f64).sqrt();
            // inv's relative error is half the sum's, plus the divide, the
            // square root and the two products after it.
            let vs_scalar = EXP_TOL + sum_bound(n) + 0.5 * sum_bound(n / 8 + 16);
            let vs_exact = EXP_TOL + 0.5 * sum_bound(n / 8 + 16);
            for isa in isa::supported() {
                let mut got = vec![f32::NAN; n];
                rms_norm(isa, &x, &w, eps, &mut got);
                for i in 0..n {
                    prop_assert!(close(got[i], want[i], vs_scalar), "{isa} n={n}: out[{i}] = {} want {}", got[i], want[i]);
                    let exact = w[i] as f64 * x[i] as f64 * inv;
                    prop_assert!((got[i] as f64 - exact).abs() <= vs_exact * exact.abs() + TINY, "{isa} n={n}: out[{i}] = {} exact {exact}", got[i]);
                }
                // The fused rounding is exactly the unfused one at this level.
                let mut fused = vec![f32::NAN; n];
                rms_norm_bf16(isa, &x, &w, eps, &mut fused);
                crate::round_bf16_slice(&mut got);
                prop_assert_eq!(fused.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), "{}", isa);
            }
        }

        #[test]
        fn silu_mul_matches_scalar(
            (g, u) in lengths().prop_flat_map(|n| (
                prop::collection::vec(prop_oneof![4 => -12.0f32..12.0, 1 => -120.0f32..120.0], n),
                prop::collection::vec(-10.0f32..10.0, n),
            )),
        ) {
            let mut want = g.clone();
            crate::elementwise::silu_mul(&mut want, &u);
            for isa in isa::supported() {
                let mut got = g.clone();
                silu_mul(isa, &mut got, &u);
                for i in 0..g.len() {
                    prop_assert!(close(got[i], want[i], EXP_TOL), "{isa}: silu({}) * {} = {} want {}", g[i], u[i], got[i], want[i]);
                }
            }
        }

        #[test]
        fn softmax_matches_scalar(
            xs in lengths().prop_flat_map(|n| prop::collection::vec(prop_oneof![20 => -30.0f32..30.0, 1 => Just(f32::NEG_INFINITY)], n)),
            shift in prop_oneof![Just(0.0f32), -1000.0f32..1000.0],
        ) {
            // At least one finite entry, so that the result is defined.
            let mut xs: Vec<f32> = xs.iter().map(|v| v + shift).collect();
            xs[0] = shift;
            let n = xs.len();
            let mut want = xs.clone();
            let want_stats = crate::elementwise::softmax(&mut want);
            // Each output is e_i / Σe: exp's error plus both sums' bounds.
            let tol = 2.0 * EXP_TOL + sum_bound(n) + sum_bound(n / 8 + 16);
            for isa in isa::supported() {
                let mut got = xs.clone();
                let stats = softmax(isa, &mut got);
                // The statistics it normalised by: the exact maximum, and Σe.
                prop_assert_eq!(stats.max, want_stats.max, "{} max", isa);
                prop_assert!(close(stats.sum, want_stats.sum, EXP_TOL + sum_bound(n)), "{isa}: sum {} want {}", stats.sum, want_stats.sum);
                for i in 0..n {
                    prop_assert!(close(got[i], want[i], tol), "{isa} n={n}: p[{i}] = {} want {}", got[i], want[i]);
                }
                let total: f64 = got.iter().map(|&p| p as f64).sum();
                prop_assert!((total - 1.0).abs() <= tol, "{isa}: sums to {total}");
            }
        }

        #[test]
        fn rope_is_bit_exact(
            (half, interleaved) in prop_oneof![(1usize..=ROPE_MAX_HALF, Just(true)), (1usize..=500, Just(false))],
            seed in any::<u64>(),
        ) {
            let mut state = seed | 1;
            let mut next = move || {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                (state >> 40) as f32 / (1u64 << 23) as f32 - 1.0
            };
            let x: Vec<f32> = (0..2 * half).map(|_| 8.0 * next()).collect();
            let (cos, sin): (Vec<f32>, Vec<f32>) = (0..half).map(|_| { let a = 4.0 * next(); (a.cos(), a.sin()) }).unzip();
            let mut want = x.clone();
            crate::elementwise::rope(&mut want, &cos, &sin, interleaved);
            for isa in isa::supported() {
                let mut got = x.clone();
                rope(isa, &mut got, &cos, &sin, interleaved);
                prop_assert_eq!(got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), want.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), "{} half={} interleaved={}", isa, half, interleaved);
            }
        }

        #[test]
        fn router_scores_match_scalar(
            (logits, bias) in lengths().prop_flat_map(|n| (
                prop::collection::vec(prop_oneof![4 => -20.0f32..20.0, 1 => -120.0f32..120.0], n),
                prop::option::of(prop::collection::vec(-0.5f32..0.5, n)),
            )),
        ) {
            let n = logits.len();
            let (mut want_s, mut want_c) = (vec![0.0; n], vec![0.0; n]);
            crate::elementwise::router_scores(&logits, bias.as_deref(), &mut want_s, &mut want_c);
            for isa in isa::supported() {
                let (mut s, mut c) = (vec![f32::NAN; n], vec![f32::NAN; n]);
                router_scores(isa, &logits, bias.as_deref(), &mut s, &mut c);
                for i in 0..n {
                    prop_assert!(close(s[i], want_s[i], EXP_TOL), "{isa}: sigmoid({}) = {} want {}", logits[i], s[i], want_s[i]);
                    let b = bias.as_ref().map_or(0.0, |b| b[i].abs() as f64);
                    let slack = EXP_TOL * (want_s[i] as f64 + b) + TINY;
                    prop_assert!((c[i] as f64 - want_c[i] as f64).abs() <= slack, "{isa}: choice[{i}] = {} want {}", c[i], want_c[i]);
                }
            }
        }

        /// Exact, ties and specials included: the values come from a small
        /// set so that ties are common.
        #[test]
        fn top_k_is_exact(
            values in prop::collection::vec(prop_oneof![
                Just(0.0f32), Just(-0.0), Just(1.0), Just(-1.0), Just(0.5), Just(f32::INFINITY),
                Just(f32::NEG_INFINITY), Just(f32::NAN), Just(-f32::NAN), any::<f32>(), -1.0f32..1.0,
            ], 0..300),
            k in 0usize..12,
        ) {
            for k in [k, values.len(), values.len() + 1] {
                let want = crate::elementwise::top_k(&values, k);
                for isa in isa::supported() {
                    prop_assert_eq!(&top_k(isa, &values, k), &want, "{} k={}", isa, k);
                }
            }
        }

        /// Distinct random scores, router-sized.
        #[test]
        fn top_k_matches_on_router_shapes(n in prop::sample::select(vec![8usize, 16, 32, 64, 160, 256]), k in 1usize..=8, seed in any::<u64>()) {
            let mut state = seed | 1;
            let values: Vec<f32> = (0..n).map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                (state >> 40) as f32 / (1u64 << 24) as f32
            }).collect();
            let want = crate::elementwise::top_k(&values, k);
            for isa in isa::supported() {
                prop_assert_eq!(&top_k(isa, &values, k), &want, "{}", isa);
            }
        }
    }

    /// The vector `exp` against f64 over the whole range with normal results,
    /// and its edge behaviour. Reports the worst relative error per level.
    #[test]
    fn exp_is_accurate() {
        let mut xs: Vec<f32> = (0..=2_000_000).map(|i| -87.3 + 176.0 * i as f32 / 2_000_000.0).collect();
        // Every f32 in [-1, 1] near the reduction boundaries ±ln2/2 too.
        let edge = std::f32::consts::LN_2 / 2.0;
        xs.extend((-2000..=2000).flat_map(|d| [f32::from_bits((edge.to_bits() as i32 + d) as u32), -f32::from_bits((edge.to_bits() as i32 + d) as u32)]));
        xs.retain(|&x| x < 88.72);
        for isa in isa::supported().into_iter().filter(|&i| i > Isa::Portable) {
            let mut got = xs.clone();
            exp_slice(isa, &mut got);
            let worst = xs
                .iter()
                .zip(&got)
                .map(|(&x, &g)| {
                    let want = (x as f64).exp();
                    (g as f64 - want).abs() / want
                })
                .fold(0.0f64, f64::max);
            println!("{isa}: max relative error of exp {worst:.3e} ({:.2} ulp at worst spacing)", worst / f32::EPSILON as f64);
            assert!(worst <= f32::EPSILON as f64, "{isa}: exp relative error {worst}");
            let mut edge = vec![f32::NEG_INFINITY, -1000.0, -104.0, -103.0, 0.0, -0.0, 89.0, 1000.0, f32::INFINITY, f32::NAN];
            exp_slice(isa, &mut edge);
            assert_eq!(&edge[..4], &[0.0, 0.0, 0.0, (-103.0f32).exp()], "{isa}: underflow");
            assert_eq!(&edge[4..9], &[1.0, 1.0, f32::INFINITY, f32::INFINITY, f32::INFINITY], "{isa}: overflow");
            assert!(edge[9].is_nan(), "{isa}: NaN");
        }
    }

    #[test]
    fn empty_and_single() {
        for isa in isa::supported() {
            rms_norm(isa, &[], &[], 1e-6, &mut []);
            silu_mul(isa, &mut [], &[]);
            softmax(isa, &mut []);
            rope(isa, &mut [], &[], &[], true);
            router_scores(isa, &[], None, &mut [], &mut []);
            assert!(top_k(isa, &[], 3).is_empty());
            let mut one = [5.0f32];
            softmax(isa, &mut one);
            assert_eq!(one, [1.0], "{isa}");
            let mut out = [0.0f32];
            rms_norm(isa, &[3.0], &[2.0], 0.0, &mut out);
            assert_eq!(out, [2.0], "{isa}");
        }
    }

    #[test]
    fn sort_key_orders_like_total_cmp() {
        let vals = [f32::NEG_INFINITY, -f32::MAX, -1.0, -f32::MIN_POSITIVE, -1e-45, -0.0, 0.0, 1e-45, 1.0, f32::MAX, f32::INFINITY];
        for w in vals.windows(2) {
            assert!(sort_key(w[0]) < sort_key(w[1]), "{} < {}", w[0], w[1]);
        }
        assert_eq!(sort_key(f32::NAN), sort_key(f32::NEG_INFINITY));
        assert!(sort_key(f32::NEG_INFINITY) > i32::MIN);
    }
}

