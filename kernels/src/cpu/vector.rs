//! F32 vector primitives for attention over the latent KV cache:
//! scores are `dot_f32(q, k)`, the context is a sum of `axpy_f32(p, v, ctx)`.

use super::isa::Isa;

/// `Σ a[i]·b[i]` in f32 (several accumulators, so the summation order differs
/// from a sequential loop by normal rounding).
pub fn dot_f32(isa: Isa, a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "dot_f32: length mismatch");
    match isa.usable() {
        // SAFETY: `usable()` guarantees the features each path enables.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 | Isa::Avx512Bf16 => unsafe { x86::dot_avx512(a, b) },
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { x86::dot_avx2(a, b) },
        _ => crate::linear::dot(a, b),
    }
}

/// `y[i] += alpha · x[i]` (fused multiply-add on the SIMD levels).
pub fn axpy_f32(isa: Isa, alpha: f32, x: &[f32], y: &mut [f32]) {
    assert_eq!(x.len(), y.len(), "axpy_f32: length mismatch");
    match isa.usable() {
        // SAFETY: `usable()` guarantees the features each path enables.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 | Isa::Avx512Bf16 => unsafe { x86::axpy_avx512(alpha, x, y) },
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { x86::axpy_avx2(alpha, x, y) },
        _ => y.iter_mut().zip(x).for_each(|(y, &x)| *y += alpha * x),
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn dot_avx512(a: &[f32], b: &[f32]) -> f32 {
        let (n, pa, pb) = (a.len(), a.as_ptr(), b.as_ptr());
        // Four chains hide the FMA latency.
        let mut acc = [_mm512_setzero_ps(); 4];
        let mut i = 0;
        while i + 64 <= n {
            for (j, acc) in acc.iter_mut().enumerate() {
                // SAFETY: i + 16 * j + 16 <= n, the length of both slices.
                let (x, y) = unsafe { (_mm512_loadu_ps(pa.add(i + 16 * j)), _mm512_loadu_ps(pb.add(i + 16 * j))) };
                *acc = _mm512_fmadd_ps(x, y, *acc);
            }
            i += 64;
        }
        while i < n {
            let m: __mmask16 = if n - i >= 16 { !0 } else { (1 << (n - i)) - 1 };
            // SAFETY: masked-off lanes are not accessed.
            let (x, y) = unsafe { (_mm512_maskz_loadu_ps(m, pa.add(i)), _mm512_maskz_loadu_ps(m, pb.add(i))) };
            acc[0] = _mm512_fmadd_ps(x, y, acc[0]);
            i += 16;
        }
        _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3])))
    }

    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn axpy_avx512(alpha: f32, x: &[f32], y: &mut [f32]) {
        let (n, px, py) = (x.len(), x.as_ptr(), y.as_mut_ptr());
        let a = _mm512_set1_ps(alpha);
        let mut i = 0;
        while i < n {
            let m: __mmask16 = if n - i >= 16 { !0 } else { (1 << (n - i)) - 1 };
            // SAFETY: lanes i.. i + 16 within the mask are inside both slices.
            unsafe {
                let v = _mm512_fmadd_ps(a, _mm512_maskz_loadu_ps(m, px.add(i)), _mm512_maskz_loadu_ps(m, py.add(i)));
                _mm512_mask_storeu_ps(py.add(i), m, v);
            }
            i += 16;
        }
    }

    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn dot_avx2(a: &[f32], b: &[f32]) -> f32 {
        let (n, pa, pb) = (a.len(), a.as_ptr(), b.as_ptr());
        let mut acc = [_mm256_setzero_ps(); 4];
        let mut i = 0;
        while i + 32 <= n {
            for (j, acc) in acc.iter_mut().enumerate() {
                // SAFETY: i + 8 * j + 8 <= n.
                let (x, y) = unsafe { (_mm256_loadu_ps(pa.add(i + 8 * j)), _mm256_loadu_ps(pb.add(i + 8 * j))) };
                *acc = _mm256_fmadd_ps(x, y, *acc);
            }
            i += 32;
        }
        while i + 8 <= n {
            // SAFETY: i + 8 <= n.
            let (x, y) = unsafe { (_mm256_loadu_ps(pa.add(i)), _mm256_loadu_ps(pb.add(i))) };
            acc[0] = _mm256_fmadd_ps(x, y, acc[0]);
            i += 8;
        }
        let s = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
        let s = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps::<1>(s));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_movehdup_ps(s));
        let tail: f32 = a[i..].iter().zip(&b[i..]).map(|(x, y)| x * y).sum();
        _mm_cvtss_f32(s) + tail
    }

    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn axpy_avx2(alpha: f32, x: &[f32], y: &mut [f32]) {
        let (n, px, py) = (x.len(), x.as_ptr(), y.as_mut_ptr());
        let a = _mm256_set1_ps(alpha);
        let mut i = 0;
        while i + 8 <= n {
            // SAFETY: i + 8 <= n, the length of both slices.
            unsafe { _mm256_storeu_ps(py.add(i), _mm256_fmadd_ps(a, _mm256_loadu_ps(px.add(i)), _mm256_loadu_ps(py.add(i)))) };
            i += 8;
        }
        for j in i..n {
            y[j] = alpha.mul_add(x[j], y[j]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::isa;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn dot_and_axpy_match_scalar(v in prop::collection::vec((-10.0f32..10.0, -10.0f32..10.0), 0..300), alpha in -3.0f32..3.0) {
            let (a, b): (Vec<f32>, Vec<f32>) = v.into_iter().unzip();
            let want: f64 = a.iter().zip(&b).map(|(&x, &y)| x as f64 * y as f64).sum();
            let mag: f64 = a.iter().zip(&b).map(|(&x, &y)| (x as f64 * y as f64).abs()).sum::<f64>() + 1e-6;
            for isa in isa::supported() {
                let got = dot_f32(isa, &a, &b) as f64;
                prop_assert!((got - want).abs() / mag < 1e-5, "{isa}: {got} vs {want}");
                let mut y = b.clone();
                axpy_f32(isa, alpha, &a, &mut y);
                for i in 0..a.len() {
                    let want = b[i] as f64 + alpha as f64 * a[i] as f64;
                    prop_assert!((y[i] as f64 - want).abs() <= 1e-6 * (want.abs() + (alpha * a[i]).abs() as f64) + 1e-30, "{isa}: axpy[{i}]");
                }
            }
        }
    }
}
