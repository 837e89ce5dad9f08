//! AVX-512 bodies of the elementwise kernels (see [`super::elementwise`] for
//! the contracts and the numerics). Every function here needs AVX-512F, which
//! every level from `Avx512` up guarantees; none needs more.
//!
//! Lengths are handled with masked loads and stores, so there is no scalar
//! tail: a lane outside the mask is never read or written.

use crate::elementwise::SoftmaxStats;
use super::elementwise::{EXP_HI, EXP_LO, EXP_POLY, LN2_HI, LN2_LO, LOG2E, ROPE_MAX_HALF};
use std::arch::x86_64::*;

/// The first `min(n, 16)` lanes.
#[inline(always)]
fn mask(n: usize) -> __mmask16 {
    if n >= 16 {
        !0
    } else {
        (1u16 << n) - 1
    }
}

/// `e^x` in every lane; see [`super::elementwise`] for the method and its
/// error. NaN stays NaN, `-inf` gives 0, large inputs give `+inf`.
#[inline]
#[target_feature(enable = "avx512f")]
fn exp(x: __m512) -> __m512 {
    // max(lo, x) then min(hi, ·): with x NaN, both return their second
    // operand, so NaN passes through.
    let x = _mm512_min_ps(_mm512_set1_ps(EXP_HI), _mm512_max_ps(_mm512_set1_ps(EXP_LO), x));
    let n = _mm512_cvtps_epi32(_mm512_mul_ps(x, _mm512_set1_ps(LOG2E)));
    let nf = _mm512_cvtepi32_ps(n);
    let r = _mm512_fnmadd_ps(nf, _mm512_set1_ps(LN2_HI), x);
    let r = _mm512_fnmadd_ps(nf, _mm512_set1_ps(LN2_LO), r);
    let mut p = _mm512_set1_ps(EXP_POLY[0]);
    for &c in &EXP_POLY[1..] {
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
    }
    let e = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.0));
    // 2^n as two normal powers of two (n ∈ [-150, 128]), so that results in
    // the subnormal range are rounded once and overflow gives +inf.
    let n1 = _mm512_srai_epi32::<1>(n);
    let n2 = _mm512_sub_epi32(n, n1);
    let bias = _mm512_set1_epi32(127);
    let s1 = _mm512_castsi512_ps(_mm512_slli_epi32::<23>(_mm512_add_epi32(n1, bias)));
    let s2 = _mm512_castsi512_ps(_mm512_slli_epi32::<23>(_mm512_add_epi32(n2, bias)));
    _mm512_mul_ps(_mm512_mul_ps(e, s1), s2)
}

/// Round every lane to the nearest BF16 value (ties to even), kept as f32:
/// bit-exact with `half::bf16::from_f32(x).to_f32()`, NaN included (quiet bit
/// set, top payload bits kept), as `convert::f32_to_bf16` does.
#[inline]
#[target_feature(enable = "avx512f")]
fn round_bf16(v: __m512) -> __m512 {
    let x = _mm512_castps_si512(v);
    let top = _mm512_set1_epi32(0xffff_0000u32 as i32);
    let lsb = _mm512_and_si512(_mm512_srli_epi32::<16>(x), _mm512_set1_epi32(1));
    let rounded = _mm512_and_si512(_mm512_add_epi32(x, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), top);
    let magnitude = _mm512_and_si512(x, _mm512_set1_epi32(0x7fff_ffff));
    let nan = _mm512_cmpgt_epu32_mask(magnitude, _mm512_set1_epi32(0x7f80_0000));
    let quiet = _mm512_or_si512(_mm512_and_si512(x, top), _mm512_set1_epi32(0x0040_0000));
    _mm512_castsi512_ps(_mm512_mask_mov_epi32(rounded, nan, quiet))
}

/// RMSNorm of one row; with `ROUND`, the outputs are rounded to BF16.
/// The caller checked that the three slices have the same length.
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn rms_norm<const ROUND: bool>(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let (n, px, pw, po) = (x.len(), x.as_ptr(), w.as_ptr(), out.as_mut_ptr());
    // Four chains hide the FMA latency.
    let mut acc = [_mm512_setzero_ps(); 4];
    let mut i = 0;
    while i + 64 <= n {
        for (j, acc) in acc.iter_mut().enumerate() {
            // SAFETY: i + 16 * j + 16 <= n = x.len().
            let v = unsafe { _mm512_loadu_ps(px.add(i + 16 * j)) };
            *acc = _mm512_fmadd_ps(v, v, *acc);
        }
        i += 64;
    }
    while i < n {
        // SAFETY: only the lanes below n are read.
        let v = unsafe { _mm512_maskz_loadu_ps(mask(n - i), px.add(i)) };
        acc[0] = _mm512_fmadd_ps(v, v, acc[0]);
        i += 16;
    }
    let sum = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3])));
    let inv = _mm512_set1_ps(1.0 / (sum / n as f32 + eps).sqrt());
    let mut i = 0;
    while i < n {
        let m = mask(n - i);
        // SAFETY: only the lanes below n are read and written; all three
        // slices are n long.
        unsafe {
            let v = _mm512_maskz_loadu_ps(m, px.add(i));
            let wv = _mm512_maskz_loadu_ps(m, pw.add(i));
            // Same operations, in the same order, as the scalar `w * (v * inv)`.
            let mut o = _mm512_mul_ps(wv, _mm512_mul_ps(v, inv));
            if ROUND {
                o = round_bf16(o);
            }
            _mm512_mask_storeu_ps(po.add(i), m, o);
        }
        i += 16;
    }
}

/// `gate = gate / (1 + e^-gate) · up`; the slices have the same length.
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn silu_mul(gate: &mut [f32], up: &[f32]) {
    let (n, pg, pu) = (gate.len(), gate.as_mut_ptr(), up.as_ptr());
    let one = _mm512_set1_ps(1.0);
    let mut i = 0;
    while i < n {
        let m = mask(n - i);
        // SAFETY: only the lanes below n are read and written.
        unsafe {
            let g = _mm512_maskz_loadu_ps(m, pg.add(i));
            let u = _mm512_maskz_loadu_ps(m, pu.add(i));
            let e = exp(_mm512_sub_ps(_mm512_setzero_ps(), g));
            _mm512_mask_storeu_ps(pg.add(i), m, _mm512_mul_ps(_mm512_div_ps(g, _mm512_add_ps(one, e)), u));
        }
        i += 16;
    }
}

/// Softmax in place (max-subtracted).
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn softmax(xs: &mut [f32]) -> SoftmaxStats {
    let (n, p) = (xs.len(), xs.as_mut_ptr());
    let neg_inf = _mm512_set1_ps(f32::NEG_INFINITY);
    let mut vmax = neg_inf;
    let mut i = 0;
    while i < n {
        // SAFETY: only the lanes below n are read; the others are -inf.
        let v = unsafe { _mm512_mask_loadu_ps(neg_inf, mask(n - i), p.add(i)) };
        vmax = _mm512_max_ps(vmax, v);
        i += 16;
    }
    let row_max = _mm512_reduce_max_ps(vmax);
    let max = _mm512_set1_ps(row_max);
    let mut acc = [_mm512_setzero_ps(); 2];
    let mut i = 0;
    while i < n {
        let m = mask(n - i);
        // SAFETY: only the lanes below n are read and written.
        unsafe {
            let e = exp(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, p.add(i)), max));
            _mm512_mask_storeu_ps(p.add(i), m, e);
            let a = &mut acc[(i / 16) & 1];
            *a = _mm512_mask_add_ps(*a, m, *a, e);
        }
        i += 16;
    }
    let sum = _mm512_reduce_add_ps(_mm512_add_ps(acc[0], acc[1]));
    let inv = _mm512_set1_ps(1.0 / sum);
    let mut i = 0;
    while i < n {
        let m = mask(n - i);
        // SAFETY: only the lanes below n are read and written.
        unsafe { _mm512_mask_storeu_ps(p.add(i), m, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, p.add(i)), inv)) };
        i += 16;
    }
    SoftmaxStats { max: row_max, sum }
}

/// Rotary embedding of one head; `x.len() == 2 · cos.len() == 2 · sin.len()`
/// and `cos.len() <= ROPE_MAX_HALF` (checked by the caller). Bit-exact with
/// the scalar code: the same multiplies and adds, no FMA.
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn rope(x: &mut [f32], cos: &[f32], sin: &[f32], interleaved: bool) {
    let half = cos.len();
    let (pc, ps) = (cos.as_ptr(), sin.as_ptr());
    // Interleaved input is read from a copy, as the output layout differs.
    let mut tmp = [0.0f32; 2 * ROPE_MAX_HALF];
    if interleaved {
        tmp[..2 * half].copy_from_slice(x);
    }
    let (pt, px) = (tmp.as_ptr(), x.as_mut_ptr());
    let even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    let odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
    let mut i = 0;
    while i < half {
        let m = mask(half - i);
        // SAFETY: lanes below `half - i` of x[i..], x[half + i..], cos[i..]
        // and sin[i..] are in bounds; for the interleaved layout, the lanes
        // of tmp below 2 · (half - i) past 2i, which lie inside x's copy.
        unsafe {
            let (a, b) = if interleaved {
                let pairs = 2 * (half - i);
                let lo = _mm512_maskz_loadu_ps(mask(pairs), pt.add(2 * i));
                let hi = _mm512_maskz_loadu_ps(mask(pairs.saturating_sub(16)), pt.add(2 * i + 16));
                (_mm512_permutex2var_ps(lo, even, hi), _mm512_permutex2var_ps(lo, odd, hi))
            } else {
                (_mm512_maskz_loadu_ps(m, px.add(i)), _mm512_maskz_loadu_ps(m, px.add(half + i)))
            };
            let (c, s) = (_mm512_maskz_loadu_ps(m, pc.add(i)), _mm512_maskz_loadu_ps(m, ps.add(i)));
            _mm512_mask_storeu_ps(px.add(i), m, _mm512_sub_ps(_mm512_mul_ps(a, c), _mm512_mul_ps(b, s)));
            _mm512_mask_storeu_ps(px.add(half + i), m, _mm512_add_ps(_mm512_mul_ps(b, c), _mm512_mul_ps(a, s)));
        }
        i += 16;
    }
}

/// Router scores: `scores = sigmoid(logits)`, `choice = scores + bias` (or a
/// copy of the scores). All slices have the same length.
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn router_scores(logits: &[f32], bias: Option<&[f32]>, scores: &mut [f32], choice: &mut [f32]) {
    let n = logits.len();
    let (pl, ps, pc) = (logits.as_ptr(), scores.as_mut_ptr(), choice.as_mut_ptr());
    let one = _mm512_set1_ps(1.0);
    let mut i = 0;
    while i < n {
        let m = mask(n - i);
        // SAFETY: only the lanes below n are read and written.
        unsafe {
            let x = _mm512_maskz_loadu_ps(m, pl.add(i));
            let s = _mm512_div_ps(one, _mm512_add_ps(one, exp(_mm512_sub_ps(_mm512_setzero_ps(), x))));
            _mm512_mask_storeu_ps(ps.add(i), m, s);
            let c = match bias {
                Some(b) => _mm512_add_ps(s, _mm512_maskz_loadu_ps(m, b.as_ptr().add(i))),
                None => s,
            };
            _mm512_mask_storeu_ps(pc.add(i), m, c);
        }
        i += 16;
    }
}

/// Fill `keys` (a multiple of 16 long, at least `values.len()`) with the
/// order-preserving integer keys of `values` (NaN as -inf), and the padding
/// with `i32::MIN`, below every key.
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn sort_keys(values: &[f32], keys: &mut [i32]) {
    let n = values.len();
    let neg_inf_key = super::elementwise::sort_key(f32::NEG_INFINITY);
    let mut i = 0;
    while i < keys.len() {
        let key = if i < n {
            let m = mask(n - i);
            // SAFETY: only the lanes of values below n are read.
            let b = unsafe { _mm512_maskz_loadu_epi32(m, values.as_ptr().add(i).cast()) };
            let flip = _mm512_srli_epi32::<1>(_mm512_srai_epi32::<31>(b));
            let key = _mm512_xor_si512(b, flip);
            let magnitude = _mm512_and_si512(b, _mm512_set1_epi32(0x7fff_ffff));
            let nan = _mm512_cmpgt_epu32_mask(magnitude, _mm512_set1_epi32(0x7f80_0000));
            let key = _mm512_mask_mov_epi32(key, nan, _mm512_set1_epi32(neg_inf_key));
            _mm512_mask_mov_epi32(_mm512_set1_epi32(i32::MIN), m, key)
        } else {
            _mm512_set1_epi32(i32::MIN)
        };
        // SAFETY: keys[i..i + 16] is inside keys, a multiple of 16 long.
        unsafe { _mm512_storeu_si512(keys.as_mut_ptr().add(i).cast(), key) };
        i += 16;
    }
}

/// The index of the first largest key; `keys` is a non-empty multiple of 16 long.
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn argmax_key(keys: &[i32]) -> usize {
    let p = keys.as_ptr();
    let mut vmax = _mm512_set1_epi32(i32::MIN);
    for i in (0..keys.len()).step_by(16) {
        // SAFETY: i + 16 <= keys.len().
        vmax = _mm512_max_epi32(vmax, unsafe { _mm512_loadu_si512(p.add(i).cast()) });
    }
    let best = _mm512_set1_epi32(_mm512_reduce_max_epi32(vmax));
    for i in (0..keys.len()).step_by(16) {
        // SAFETY: as above.
        let hit = _mm512_cmpeq_epi32_mask(unsafe { _mm512_loadu_si512(p.add(i).cast()) }, best);
        if hit != 0 {
            return i + hit.trailing_zeros() as usize;
        }
    }
    unreachable!("the maximum is one of the keys")
}

/// `e^x` of every element.
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn exp_slice(xs: &mut [f32]) {
    let (n, p) = (xs.len(), xs.as_mut_ptr());
    let mut i = 0;
    while i < n {
        let m = mask(n - i);
        // SAFETY: only the lanes below n are read and written.
        unsafe { _mm512_mask_storeu_ps(p.add(i), m, exp(_mm512_maskz_loadu_ps(m, p.add(i)))) };
        i += 16;
    }
}
