//! AVX2 + FMA bodies of the elementwise kernels (see [`super::elementwise`]
//! for the contracts and the numerics).
//!
//! Full vectors use plain loads and stores; the last partial vector uses
//! `vmaskmovps` (masked-off lanes are never accessed), so there is no scalar
//! tail and every element takes the same arithmetic.

use crate::elementwise::SoftmaxStats;
use super::elementwise::{EXP_HI, EXP_LO, EXP_POLY, LN2_HI, LN2_LO, LOG2E, ROPE_MAX_HALF};
use std::arch::x86_64::*;

/// A lane mask for `vmaskmovps`: `None` for a full vector, else the first `n < 8` lanes.
type Tail = Option<__m256i>;

#[inline]
#[target_feature(enable = "avx2")]
fn tail(n: usize) -> Tail {
    debug_assert!(n < 8);
    Some(_mm256_cmpgt_epi32(_mm256_set1_epi32(n as i32), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)))
}

/// Load 8 lanes, or the masked ones (the others read as 0).
///
/// # Safety
/// The lanes that `m` selects (all without a mask) must be readable.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn load(p: *const f32, m: Tail) -> __m256 {
    // SAFETY: the caller vouches for the selected lanes; others are not accessed.
    unsafe {
        match m {
            None => _mm256_loadu_ps(p),
            Some(m) => _mm256_maskload_ps(p, m),
        }
    }
}

/// Store 8 lanes, or the masked ones.
///
/// # Safety
/// The lanes that `m` selects (all without a mask) must be writable.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn store(p: *mut f32, m: Tail, v: __m256) {
    // SAFETY: as for `load`.
    unsafe {
        match m {
            None => _mm256_storeu_ps(p, v),
            Some(m) => _mm256_maskstore_ps(p, m, v),
        }
    }
}

/// Run `body(i, mask)` over `0..n` in steps of 8, the last step masked.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn for_each_vector(n: usize, mut body: impl FnMut(usize, Tail)) {
    let mut i = 0;
    while i + 8 <= n {
        body(i, None);
        i += 8;
    }
    if i < n {
        body(i, tail(n - i));
    }
}

#[inline]
#[target_feature(enable = "avx2")]
fn hsum(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)))
}

#[inline]
#[target_feature(enable = "avx2")]
fn hmax(v: __m256) -> f32 {
    let s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)))
}

/// `e^x` in every lane: the same method, constants and error as the AVX-512
/// version (see [`super::elementwise`]).
#[inline]
#[target_feature(enable = "avx2,fma")]
fn exp(x: __m256) -> __m256 {
    // max(lo, x) then min(hi, ·): with x NaN, both return their second
    // operand, so NaN passes through.
    let x = _mm256_min_ps(_mm256_set1_ps(EXP_HI), _mm256_max_ps(_mm256_set1_ps(EXP_LO), x));
    let n = _mm256_cvtps_epi32(_mm256_mul_ps(x, _mm256_set1_ps(LOG2E)));
    let nf = _mm256_cvtepi32_ps(n);
    let r = _mm256_fnmadd_ps(nf, _mm256_set1_ps(LN2_HI), x);
    let r = _mm256_fnmadd_ps(nf, _mm256_set1_ps(LN2_LO), r);
    let mut p = _mm256_set1_ps(EXP_POLY[0]);
    for &c in &EXP_POLY[1..] {
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
    }
    let e = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0));
    let n1 = _mm256_srai_epi32::<1>(n);
    let n2 = _mm256_sub_epi32(n, n1);
    let bias = _mm256_set1_epi32(127);
    let s1 = _mm256_castsi256_ps(_mm256_slli_epi32::<23>(_mm256_add_epi32(n1, bias)));
    let s2 = _mm256_castsi256_ps(_mm256_slli_epi32::<23>(_mm256_add_epi32(n2, bias)));
    _mm256_mul_ps(_mm256_mul_ps(e, s1), s2)
}

/// Round every lane to BF16 precision, bit-exact with `half` (NaN included).
#[inline]
#[target_feature(enable = "avx2")]
fn round_bf16(v: __m256) -> __m256 {
    let x = _mm256_castps_si256(v);
    let top = _mm256_set1_epi32(0xffff_0000u32 as i32);
    let lsb = _mm256_and_si256(_mm256_srli_epi32::<16>(x), _mm256_set1_epi32(1));
    let rounded = _mm256_and_si256(_mm256_add_epi32(x, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), top);
    let magnitude = _mm256_and_si256(x, _mm256_set1_epi32(0x7fff_ffff));
    // Both sides are non-negative as i32, so the signed compare is exact.
    let nan = _mm256_cmpgt_epi32(magnitude, _mm256_set1_epi32(0x7f80_0000));
    let quiet = _mm256_or_si256(_mm256_and_si256(x, top), _mm256_set1_epi32(0x0040_0000));
    _mm256_castsi256_ps(_mm256_blendv_epi8(rounded, quiet, nan))
}

/// RMSNorm of one row; with `ROUND`, the outputs are rounded to BF16.
/// The caller checked that the three slices have the same length.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn rms_norm<const ROUND: bool>(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let (n, px, pw, po) = (x.len(), x.as_ptr(), w.as_ptr(), out.as_mut_ptr());
    let mut acc = [_mm256_setzero_ps(); 4];
    let mut i = 0;
    while i + 32 <= n {
        for (j, acc) in acc.iter_mut().enumerate() {
            // SAFETY: i + 8 * j + 8 <= n = x.len().
            let v = unsafe { _mm256_loadu_ps(px.add(i + 8 * j)) };
            *acc = _mm256_fmadd_ps(v, v, *acc);
        }
        i += 32;
    }
    for_each_vector(n - i, |j, m| {
        // SAFETY: the selected lanes are below n.
        let v = unsafe { load(px.add(i + j), m) };
        acc[0] = _mm256_fmadd_ps(v, v, acc[0]);
    });
    let sum = hsum(_mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3])));
    let inv = _mm256_set1_ps(1.0 / (sum / n as f32 + eps).sqrt());
    for_each_vector(n, |i, m| {
        // SAFETY: the selected lanes are below n, the length of all three slices.
        unsafe {
            // Same operations, in the same order, as the scalar `w * (v * inv)`.
            let mut o = _mm256_mul_ps(load(pw.add(i), m), _mm256_mul_ps(load(px.add(i), m), inv));
            if ROUND {
                o = round_bf16(o);
            }
            store(po.add(i), m, o);
        }
    });
}

/// `gate = gate / (1 + e^-gate) · up`; the slices have the same length.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn silu_mul(gate: &mut [f32], up: &[f32]) {
    let (pg, pu) = (gate.as_mut_ptr(), up.as_ptr());
    let one = _mm256_set1_ps(1.0);
    for_each_vector(gate.len(), |i, m| {
        // SAFETY: the selected lanes are inside both slices.
        unsafe {
            let g = load(pg.add(i), m);
            let e = exp(_mm256_sub_ps(_mm256_setzero_ps(), g));
            store(pg.add(i), m, _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(one, e)), load(pu.add(i), m)));
        }
    });
}

/// Softmax in place (max-subtracted).
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn softmax(xs: &mut [f32]) -> SoftmaxStats {
    let (n, p) = (xs.len(), xs.as_mut_ptr());
    let neg_inf = _mm256_set1_ps(f32::NEG_INFINITY);
    let mut vmax = neg_inf;
    for_each_vector(n, |i, m| {
        // SAFETY: the selected lanes are inside xs; the others become -inf.
        let v = unsafe { load(p.add(i), m) };
        let v = match m {
            None => v,
            Some(m) => _mm256_blendv_ps(neg_inf, v, _mm256_castsi256_ps(m)),
        };
        vmax = _mm256_max_ps(vmax, v);
    });
    let row_max = hmax(vmax);
    let max = _mm256_set1_ps(row_max);
    let mut acc = [_mm256_setzero_ps(); 2];
    for_each_vector(n, |i, m| {
        // SAFETY: the selected lanes are inside xs.
        unsafe {
            let e = exp(_mm256_sub_ps(load(p.add(i), m), max));
            // Masked-off lanes must not add e^(0 - max).
            let e = match m {
                None => e,
                Some(m) => _mm256_and_ps(e, _mm256_castsi256_ps(m)),
            };
            store(p.add(i), m, e);
            acc[(i / 8) & 1] = _mm256_add_ps(acc[(i / 8) & 1], e);
        }
    });
    let sum = hsum(_mm256_add_ps(acc[0], acc[1]));
    let inv = _mm256_set1_ps(1.0 / sum);
    for_each_vector(n, |i, m| {
        // SAFETY: the selected lanes are inside xs.
        unsafe { store(p.add(i), m, _mm256_mul_ps(load(p.add(i), m), inv)) };
    });
    SoftmaxStats { max: row_max, sum }
}

/// Rotary embedding of one head; `x.len() == 2 · cos.len() == 2 · sin.len()`
/// and `cos.len() <= ROPE_MAX_HALF` (checked by the caller). Bit-exact with
/// the scalar code: the same multiplies and adds, no FMA.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn rope(x: &mut [f32], cos: &[f32], sin: &[f32], interleaved: bool) {
    let half = cos.len();
    let (pc, ps) = (cos.as_ptr(), sin.as_ptr());
    // Interleaved input is read from a copy, as the output layout differs.
    // Whole vectors are read from it: 2i + 16 <= 2 · ROPE_MAX_HALF for every
    // i < half (a multiple of 8), and lanes past 2 · half are never stored.
    let mut tmp = [0.0f32; 2 * ROPE_MAX_HALF];
    if interleaved {
        tmp[..2 * half].copy_from_slice(x);
    }
    let (pt, px) = (tmp.as_ptr(), x.as_mut_ptr());
    for_each_vector(half, |i, m| {
        // SAFETY: the selected lanes of x[i..], x[half + i..], cos[i..] and
        // sin[i..] are in bounds; tmp[2i..2i + 16] is inside tmp (see above).
        unsafe {
            let (a, b) = if interleaved {
                let lo = _mm256_loadu_ps(pt.add(2 * i));
                let hi = _mm256_loadu_ps(pt.add(2 * i + 8));
                // shuffle_ps works per 128-bit half: [lo0 lo2 hi0 hi2 | lo4 lo6 hi4 hi6];
                // the 64-bit permute puts the halves' pairs in order.
                let order = |v: __m256| _mm256_castpd_ps(_mm256_permute4x64_pd::<0b11_01_10_00>(_mm256_castps_pd(v)));
                (order(_mm256_shuffle_ps::<0b10_00_10_00>(lo, hi)), order(_mm256_shuffle_ps::<0b11_01_11_01>(lo, hi)))
            } else {
                (load(px.add(i), m), load(px.add(half + i), m))
            };
            let (c, s) = (load(pc.add(i), m), load(ps.add(i), m));
            store(px.add(i), m, _mm256_sub_ps(_mm256_mul_ps(a, c), _mm256_mul_ps(b, s)));
            store(px.add(half + i), m, _mm256_add_ps(_mm256_mul_ps(b, c), _mm256_mul_ps(a, s)));
        }
    });
}

/// Router scores: `scores = sigmoid(logits)`, `choice = scores + bias` (or a
/// copy of the scores). All slices have the same length.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn router_scores(logits: &[f32], bias: Option<&[f32]>, scores: &mut [f32], choice: &mut [f32]) {
    let (pl, ps, pc) = (logits.as_ptr(), scores.as_mut_ptr(), choice.as_mut_ptr());
    let one = _mm256_set1_ps(1.0);
    for_each_vector(logits.len(), |i, m| {
        // SAFETY: the selected lanes are inside every slice.
        unsafe {
            let x = load(pl.add(i), m);
            let s = _mm256_div_ps(one, _mm256_add_ps(one, exp(_mm256_sub_ps(_mm256_setzero_ps(), x))));
            store(ps.add(i), m, s);
            let c = match bias {
                Some(b) => _mm256_add_ps(s, load(b.as_ptr().add(i), m)),
                None => s,
            };
            store(pc.add(i), m, c);
        }
    });
}

/// Fill `keys` (a multiple of 8 long, at least `values.len()`) with the
/// order-preserving integer keys of `values` (NaN as -inf), and the padding
/// with `i32::MIN`, below every key.
#[target_feature(enable = "avx2")]
pub(super) unsafe fn sort_keys(values: &[f32], keys: &mut [i32]) {
    let n = values.len();
    let neg_inf_key = _mm256_set1_epi32(super::elementwise::sort_key(f32::NEG_INFINITY));
    let pad = _mm256_set1_epi32(i32::MIN);
    let mut i = 0;
    while i < keys.len() {
        let key = if i < n {
            let m = if n - i >= 8 { None } else { tail(n - i) };
            // SAFETY: the selected lanes are below n.
            let b = _mm256_castps_si256(unsafe { load(values.as_ptr().add(i), m) });
            let flip = _mm256_srli_epi32::<1>(_mm256_srai_epi32::<31>(b));
            let key = _mm256_xor_si256(b, flip);
            let magnitude = _mm256_and_si256(b, _mm256_set1_epi32(0x7fff_ffff));
            let nan = _mm256_cmpgt_epi32(magnitude, _mm256_set1_epi32(0x7f80_0000));
            let key = _mm256_blendv_epi8(key, neg_inf_key, nan);
            match m {
                None => key,
                Some(m) => _mm256_blendv_epi8(pad, key, m),
            }
        } else {
            pad
        };
        // SAFETY: keys[i..i + 8] is inside keys, a multiple of 8 long.
        unsafe { _mm256_storeu_si256(keys.as_mut_ptr().add(i).cast(), key) };
        i += 8;
    }
}

/// The index of the first largest key; `keys` is a non-empty multiple of 8 long.
#[target_feature(enable = "avx2")]
pub(super) unsafe fn argmax_key(keys: &[i32]) -> usize {
    let p = keys.as_ptr();
    let mut vmax = _mm256_set1_epi32(i32::MIN);
    for i in (0..keys.len()).step_by(8) {
        // SAFETY: i + 8 <= keys.len().
        vmax = _mm256_max_epi32(vmax, unsafe { _mm256_loadu_si256(p.add(i).cast()) });
    }
    let s = _mm_max_epi32(_mm256_castsi256_si128(vmax), _mm256_extracti128_si256::<1>(vmax));
    let s = _mm_max_epi32(s, _mm_shuffle_epi32::<0b01_00_11_10>(s));
    let s = _mm_max_epi32(s, _mm_shuffle_epi32::<0b10_11_00_01>(s));
    let best = _mm256_broadcastd_epi32(s);
    for i in (0..keys.len()).step_by(8) {
        // SAFETY: as above.
        let eq = _mm256_cmpeq_epi32(unsafe { _mm256_loadu_si256(p.add(i).cast()) }, best);
        let hit = _mm256_movemask_ps(_mm256_castsi256_ps(eq));
        if hit != 0 {
            return i + hit.trailing_zeros() as usize;
        }
    }
    unreachable!("the maximum is one of the keys")
}

/// `e^x` of every element.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn exp_slice(xs: &mut [f32]) {
    let p = xs.as_mut_ptr();
    // SAFETY: the selected lanes are inside xs.
    for_each_vector(xs.len(), |i, m| unsafe { store(p.add(i), m, exp(load(p.add(i), m))) });
}
