//! Elementwise and row-wise ops: RMSNorm, rotary embedding, SiLU·up, softmax,
//! and the MoE router's score and top-k steps.
//!
//! These are the scalar references (and the F32 model path); the SIMD
//! versions, dispatched on the CPU's level, are in [`crate::cpu::elementwise`].

/// `out = x / sqrt(mean(x²) + eps) * weight`, computed in f32 like PyTorch's
/// RMSNorm after its upcast.
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let mean_sq = x.iter().map(|v| v * v).sum::<f32>() / x.len() as f32;
    let inv = 1.0 / (mean_sq + eps).sqrt();
    for ((o, &v), &w) in out.iter_mut().zip(x).zip(weight) {
        *o = w * (v * inv);
    }
}

/// `gate[i] = silu(gate[i]) * up[i]`, in place.
pub fn silu_mul(gate: &mut [f32], up: &[f32]) {
    for (g, &u) in gate.iter_mut().zip(up) {
        *g = *g / (1.0 + (-*g).exp()) * u;
    }
}

/// Numerically stable softmax in place.
pub fn softmax(xs: &mut [f32]) -> SoftmaxStats {
    let max = xs.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0;
    for x in xs.iter_mut() {
        *x = (*x - max).exp();
        sum += *x;
    }
    let inv = 1.0 / sum;
    xs.iter_mut().for_each(|x| *x *= inv);
    SoftmaxStats { max, sum }
}

/// What a softmax normalised by: the row's maximum and `Σ exp(x − max)`.
/// Softmaxes taken over parts of a row combine into the whole row's with
/// these (split-K attention): part `c` weighs `sum_c · exp(max_c − max)`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SoftmaxStats {
    pub max: f32,
    pub sum: f32,
}

/// Rotate `x` (one head's rotary part, `2 · cos.len()` long) by the angles
/// whose cosines and sines are given, one per frequency.
///
/// With `interleaved`, frequency `i` rotates the pair `(x[2i], x[2i+1])` and the
/// result is written de-interleaved (`[evens.., odds..]`), exactly as
/// transformers' `apply_rotary_pos_emb_interleave` does. Without it, frequency
/// `i` rotates `(x[i], x[i + d/2])` (the `rotate_half` convention).
pub fn rope(x: &mut [f32], cos: &[f32], sin: &[f32], interleaved: bool) {
    let half = cos.len();
    debug_assert_eq!(x.len(), 2 * half);
    if interleaved {
        let mut tmp = [0.0f32; 512];
        let tmp = &mut tmp[..2 * half];
        tmp.copy_from_slice(x);
        for i in 0..half {
            let (a, b) = (tmp[2 * i], tmp[2 * i + 1]);
            x[i] = a * cos[i] - b * sin[i];
            x[i + half] = b * cos[i] + a * sin[i];
        }
    } else {
        for i in 0..half {
            let (a, b) = (x[i], x[i + half]);
            x[i] = a * cos[i] - b * sin[i];
            x[i + half] = b * cos[i] + a * sin[i];
        }
    }
}

/// The router's score step: `scores[i] = sigmoid(logits[i])`, and `choice`
/// the scores plus the correction `bias` when there is one (it steers the
/// selection only), else a copy of them.
pub fn router_scores(logits: &[f32], bias: Option<&[f32]>, scores: &mut [f32], choice: &mut [f32]) {
    for (s, &x) in scores.iter_mut().zip(logits) {
        *s = 1.0 / (1.0 + (-x).exp());
    }
    match bias {
        Some(b) => choice.iter_mut().zip(scores.iter().zip(b)).for_each(|(c, (s, b))| *c = s + b),
        None => choice.copy_from_slice(scores),
    }
}

/// Indices of the `k` largest values, best first; ties go to the lower
/// index. NaN counts as `-inf`; otherwise the order is `f32::total_cmp`'s
/// (so `-0.0` ranks below `+0.0`).
pub fn top_k(values: &[f32], k: usize) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..values.len()).collect();
    let key = |i: usize| if values[i].is_nan() { f32::NEG_INFINITY } else { values[i] };
    idx.sort_by(|&a, &b| key(b).total_cmp(&key(a)).then(a.cmp(&b)));
    idx.truncate(k);
    idx
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn softmax_sums_to_one_and_survives_large_inputs() {
        let mut xs = [1000.0, 1001.0, 999.0, f32::NEG_INFINITY];
        softmax(&mut xs);
        assert!((xs.iter().sum::<f32>() - 1.0).abs() < 1e-6);
        assert_eq!(xs[3], 0.0);
        assert!(xs[1] > xs[0] && xs[0] > xs[2]);
    }

    #[test]
    fn rms_norm_of_constant_is_weight() {
        let mut out = [0.0; 4];
        rms_norm(&[3.0; 4], &[1.0, 2.0, 3.0, 4.0], 0.0, &mut out);
        assert_eq!(out, [1.0, 2.0, 3.0, 4.0]);
    }

    #[test]
    fn rope_conventions_agree_up_to_layout() {
        let x: Vec<f32> = (0..8).map(|i| i as f32 + 1.0).collect();
        let (cos, sin) = ([0.6f32, 1.0, 0.0, 0.8], [0.8f32, 0.0, 1.0, 0.6]);
        let mut inter = x.clone();
        rope(&mut inter, &cos, &sin, true);
        // De-interleave first, then rotate_half: must give the same result.
        let mut plain: Vec<f32> = x.iter().step_by(2).chain(x.iter().skip(1).step_by(2)).copied().collect();
        rope(&mut plain, &cos, &sin, false);
        assert_eq!(inter, plain);
        // Rotations preserve the norm of each pair.
        for i in 0..4 {
            let before = x[2 * i].powi(2) + x[2 * i + 1].powi(2);
            let after = inter[i].powi(2) + inter[i + 4].powi(2);
            assert!((before - after).abs() < 1e-4);
        }
    }

    #[test]
    fn silu_mul_matches_formula() {
        let mut g = [0.0, 1.0, -2.0];
        silu_mul(&mut g, &[2.0, 3.0, 1.0]);
        assert_eq!(g[0], 0.0);
        assert!((g[1] - 3.0 / (1.0 + (-1.0f32).exp())).abs() < 1e-6);
        assert!((g[2] - (-2.0 / (1.0 + 2.0f32.exp()))).abs() < 1e-6);
    }
}
