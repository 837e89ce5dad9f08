//! F32 vector primitives for attention over the latent KV cache:
//! scores are `dot_f32(q, k)`, the context is a sum of `axpy_f32(p, v, ctx)`.
//! The blocked forms, [`dots_16`] and [`weighted_sum`], are what decode
//! attention uses: they load each operand once for several products, so
//! they run at FMA rather than load/store speed.

use super::isa::Isa;

/// `Σ a[i]·b[i]` in f32 (several accumulators, so the summation order differs
/// from a sequential loop by normal rounding).
pub fn dot_f32(isa: Isa, a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "dot_f32: length mismatch");
    match isa.usable() {
        // SAFETY: `usable()` guarantees the features each path enables.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 | Isa::Avx512Bf16 | Isa::Avx512Fp16 => unsafe { x86::dot_avx512(a, b) },
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { x86::dot_avx2(a, b) },
        _ => crate::linear::dot(a, b),
    }
}

/// `Σ w[i]·x[i]` in f32 for BF16 `w` given as its little-endian bytes (any
/// alignment): exact F32 products, as an F32 matmul of BF16 weights gives
/// (the router's logits). Summation order as in [`dot_f32`].
pub fn dot_bf16_f32(isa: Isa, w: &[u8], x: &[f32]) -> f32 {
    assert_eq!(w.len(), 2 * x.len(), "dot_bf16_f32: length mismatch");
    match isa.usable() {
        // SAFETY: `usable()` guarantees the features; `w` holds `x.len()` BF16 values.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 | Isa::Avx512Bf16 | Isa::Avx512Fp16 => unsafe { x86::dot_bf16_f32_avx512(w, x) },
        _ => w.chunks_exact(2).zip(x).map(|(b, &x)| half::bf16::from_le_bytes([b[0], b[1]]).to_f32() * x).sum(),
    }
}

/// `y[i] += alpha · x[i]` (fused multiply-add on the SIMD levels).
pub fn axpy_f32(isa: Isa, alpha: f32, x: &[f32], y: &mut [f32]) {
    assert_eq!(x.len(), y.len(), "axpy_f32: length mismatch");
    match isa.usable() {
        // SAFETY: `usable()` guarantees the features each path enables.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 | Isa::Avx512Bf16 | Isa::Avx512Fp16 => unsafe { x86::axpy_avx512(alpha, x, y) },
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { x86::axpy_avx2(alpha, x, y) },
        _ => y.iter_mut().zip(x).for_each(|(y, &x)| *y += alpha * x),
    }
}

/// Queries one SIMD vector wide: [`dots_16`] takes up to this many at once.
pub const QUERY_LANES: usize = 16;

/// The dot products of [`QUERY_LANES`] queries with each of `keys`:
/// `out[t · 16 + l] = Σ_k qt[k · 16 + l] · keys[t][k]`. `qt` holds the
/// queries transposed (`[d][16]`, unused lanes zero), so one vector load
/// serves all of them and each key element is one broadcast: the products
/// need no horizontal sums, and each lane sums in order of `k`.
pub fn dots_16(isa: Isa, qt: &[f32], keys: &[&[f32]], out: &mut [f32]) {
    const L: usize = QUERY_LANES;
    let d = qt.len() / L;
    assert!(qt.len() == d * L && keys.iter().all(|k| k.len() == d), "dots_16: shapes");
    assert_eq!(out.len(), keys.len() * L, "dots_16: one row of outputs per key");
    match isa.usable() {
        // SAFETY: `usable()` guarantees the features; the shapes are checked above.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 | Isa::Avx512Bf16 | Isa::Avx512Fp16 => unsafe { x86::dots_16_avx512(qt, keys, out) },
        _ => {
            for (key, out) in keys.iter().zip(out.chunks_exact_mut(L)) {
                out.fill(0.0);
                for (&kv, q) in key.iter().zip(qt.chunks_exact(L)) {
                    out.iter_mut().zip(q).for_each(|(o, &q)| *o = kv.mul_add(q, *o));
                }
            }
        }
    }
}

/// `y += Σ_t w[t] · rows[t]` (every row as long as `y`).
pub fn weighted_sum(isa: Isa, w: &[f32], rows: &[&[f32]], y: &mut [f32]) {
    assert_eq!(w.len(), rows.len(), "weighted_sum: one weight per row");
    assert!(rows.iter().all(|r| r.len() == y.len()), "weighted_sum: row length");
    match isa.usable() {
        // SAFETY: as above; every row is `y.len()` long.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 | Isa::Avx512Bf16 | Isa::Avx512Fp16 => unsafe { x86::weighted_sum_avx512(w, rows, y) },
        _ => w.iter().zip(rows).for_each(|(&w, r)| axpy_f32(isa, w, r, y)),
    }
}

/// [`weighted_sum`] for four outputs over the same rows: `y[i] += Σ_t w[i][t] · rows[t]`.
/// Each row vector loaded feeds four FMAs.
pub fn weighted_sum_4(isa: Isa, w: [&[f32]; 4], rows: &[&[f32]], y: [&mut [f32]; 4]) {
    assert!(w.iter().all(|w| w.len() == rows.len()), "weighted_sum_4: one weight per row");
    let n = y[0].len();
    assert!(y.iter().all(|y| y.len() == n) && rows.iter().all(|r| r.len() == n), "weighted_sum_4: row length");
    match isa.usable() {
        // SAFETY: as above; every row and output is `n` long.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 | Isa::Avx512Bf16 | Isa::Avx512Fp16 => unsafe { x86::weighted_sum_4_avx512(w, rows, y) },
        _ => {
            for (w, y) in w.iter().zip(y) {
                weighted_sum(isa, w, rows, y);
            }
        }
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

    /// # Safety
    /// AVX-512 F/BW/VL present; `w` holds `2 · x.len()` bytes.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    pub(super) unsafe fn dot_bf16_f32_avx512(w: &[u8], x: &[f32]) -> f32 {
        let (n, pw, px) = (x.len(), w.as_ptr(), x.as_ptr());
        // A BF16 value is the top half of its f32: widen, shift up 16.
        let widen = |v: __m256i| _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(v)));
        let mut acc = [_mm512_setzero_ps(); 4];
        let mut i = 0;
        while i < n {
            let m = lanes(n, i);
            // SAFETY: the lanes under `m` lie inside both slices (2 bytes per value in `w`).
            let (wv, xv) = unsafe { (_mm256_maskz_loadu_epi16(m, pw.add(2 * i).cast()), _mm512_maskz_loadu_ps(m, px.add(i))) };
            let a = (i / 16) % 4;
            acc[a] = _mm512_fmadd_ps(widen(wv), xv, acc[a]);
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

    #[inline(always)]
    fn lanes(n: usize, i: usize) -> __mmask16 {
        if n - i >= 16 {
            !0
        } else {
            (1 << (n - i)) - 1
        }
    }

    /// # Safety
    /// AVX-512 F present; `qt` is `[d][16]`, every key `d` long, `out` `[keys][16]`.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn dots_16_avx512(qt: &[f32], keys: &[&[f32]], out: &mut [f32]) {
        // Eight keys at a time: eight independent FMA chains hide the
        // latency, and each query vector loaded feeds eight broadcast FMAs.
        let mut t = 0;
        while t + 8 <= keys.len() {
            // SAFETY: forwarded; keys t..t + 8 exist.
            unsafe { dots_16_group::<8>(qt, &keys[t..t + 8], &mut out[16 * t..16 * (t + 8)]) };
            t += 8;
        }
        for t in t..keys.len() {
            // SAFETY: as above, one key.
            unsafe { dots_16_group::<1>(qt, &keys[t..t + 1], &mut out[16 * t..16 * (t + 1)]) };
        }
    }

    /// # Safety
    /// As [`dots_16_avx512`], with exactly `P` keys.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn dots_16_group<const P: usize>(qt: &[f32], keys: &[&[f32]], out: &mut [f32]) {
        let key: [*const f32; P] = std::array::from_fn(|p| keys[p].as_ptr());
        let mut acc = [_mm512_setzero_ps(); P];
        for i in 0..qt.len() / 16 {
            // SAFETY: i < d: qt holds 16 · d floats and every key d.
            let q = unsafe { _mm512_loadu_ps(qt.as_ptr().add(16 * i)) };
            for p in 0..P {
                acc[p] = _mm512_fmadd_ps(_mm512_set1_ps(unsafe { *key[p].add(i) }), q, acc[p]);
            }
        }
        for (p, acc) in acc.iter().enumerate() {
            // SAFETY: out holds 16 · P floats.
            unsafe { _mm512_storeu_ps(out.as_mut_ptr().add(16 * p), *acc) };
        }
    }

    /// # Safety
    /// AVX-512 F present; every row as long as `y`.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn weighted_sum_avx512(w: &[f32], rows: &[&[f32]], y: &mut [f32]) {
        // Slabs of SLAB vectors of `y` stay in registers across all the rows
        // (a fixed count, so the compiler keeps them there); the tail past
        // the last whole slab goes row by row.
        const SLAB: usize = 16;
        let n = y.len();
        let whole = n / (16 * SLAB) * (16 * SLAB);
        let py = y.as_mut_ptr();
        for i in (0..whole).step_by(16 * SLAB) {
            // SAFETY: i + 16·SLAB <= n, the length of `y` and of every row.
            unsafe {
                let mut acc: [__m512; SLAB] = std::array::from_fn(|k| _mm512_loadu_ps(py.add(i + 16 * k)));
                for (&wt, row) in w.iter().zip(rows) {
                    let a = _mm512_set1_ps(wt);
                    let pr = row.as_ptr().add(i);
                    for (k, acc) in acc.iter_mut().enumerate() {
                        *acc = _mm512_fmadd_ps(a, _mm512_loadu_ps(pr.add(16 * k)), *acc);
                    }
                }
                for (k, acc) in acc.iter().enumerate() {
                    _mm512_storeu_ps(py.add(i + 16 * k), *acc);
                }
            }
        }
        if whole < n {
            for (&wt, row) in w.iter().zip(rows) {
                // SAFETY: as above, for the tail.
                unsafe { axpy_avx512(wt, &row[whole..], &mut y[whole..]) };
            }
        }
    }

    /// # Safety
    /// AVX-512 F present; every row and output of one length.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn weighted_sum_4_avx512(w: [&[f32]; 4], rows: &[&[f32]], y: [&mut [f32]; 4]) {
        // Four vectors of each output in registers (16 accumulators); per
        // row, four loads and four broadcasts feed sixteen FMAs.
        const SLAB: usize = 4;
        let n = y[0].len();
        let whole = n / (16 * SLAB) * (16 * SLAB);
        let py: [*mut f32; 4] = std::array::from_fn(|j| y[j].as_ptr().cast_mut());
        for i in (0..whole).step_by(16 * SLAB) {
            // SAFETY: i + 16·SLAB <= n, the length of every output and row.
            unsafe {
                let mut acc: [[__m512; SLAB]; 4] = std::array::from_fn(|j| std::array::from_fn(|k| _mm512_loadu_ps(py[j].add(i + 16 * k))));
                for (t, row) in rows.iter().enumerate() {
                    let pr = row.as_ptr().add(i);
                    let v: [__m512; SLAB] = std::array::from_fn(|k| _mm512_loadu_ps(pr.add(16 * k)));
                    for (j, acc) in acc.iter_mut().enumerate() {
                        let a = _mm512_set1_ps(*w[j].get_unchecked(t));
                        for (k, acc) in acc.iter_mut().enumerate() {
                            *acc = _mm512_fmadd_ps(a, v[k], *acc);
                        }
                    }
                }
                for (j, acc) in acc.iter().enumerate() {
                    for (k, acc) in acc.iter().enumerate() {
                        _mm512_storeu_ps(py[j].add(i + 16 * k), *acc);
                    }
                }
            }
        }
        if whole < n {
            for (w, y) in w.iter().zip(y) {
                for (&wt, row) in w.iter().zip(rows) {
                    // SAFETY: as above, for the tail.
                    unsafe { axpy_avx512(wt, &row[whole..], &mut y[whole..]) };
                }
            }
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

        #[test]
        fn bf16_weight_dot_matches_scalar(v in prop::collection::vec((-10.0f32..10.0, -10.0f32..10.0), 0..300)) {
            let (w, x): (Vec<f32>, Vec<f32>) = v.into_iter().unzip();
            let bytes: Vec<u8> = w.iter().flat_map(|&f| half::bf16::from_f32(f).to_le_bytes()).collect();
            let wr: Vec<f64> = w.iter().map(|&f| half::bf16::from_f32(f).to_f64()).collect();
            let want: f64 = wr.iter().zip(&x).map(|(&a, &b)| a * b as f64).sum();
            let mag: f64 = wr.iter().zip(&x).map(|(&a, &b)| (a * b as f64).abs()).sum::<f64>() + 1e-6;
            for isa in isa::supported() {
                // An odd start, so the bytes are not 2-aligned.
                let mut shifted = vec![0u8; bytes.len() + 1];
                shifted[1..].copy_from_slice(&bytes);
                let got = dot_bf16_f32(isa, &shifted[1..], &x) as f64;
                prop_assert!((got - want).abs() / mag < 1e-5, "{isa}: {got} vs {want}");
            }
        }

        #[test]
        fn blocked_forms_match_scalar(len in 0usize..200, seed in any::<u64>()) {
            let mut state = seed | 1;
            let mut next = move || { state ^= state << 13; state ^= state >> 7; state ^= state << 17; (state % 2001) as f32 / 100.0 - 10.0 };
            let vecs: Vec<Vec<f32>> = (0..8).map(|_| (0..len).map(|_| next()).collect()).collect();
            let weights: Vec<f32> = (0..6).map(|_| next() / 10.0).collect();
            let rows: Vec<&[f32]> = (0..6).map(|i| vecs[i % 8].as_slice()).collect();
            let y0: Vec<f32> = (0..len).map(|_| next()).collect();
            for isa in isa::supported() {
                // Sixteen query lanes (the last four zero) against 4 + 8 + 1
                // keys: a group of eight and single keys.
                let mut qt = vec![0.0f32; 16 * len];
                for (k, lanes) in qt.chunks_exact_mut(16).enumerate() {
                    for l in 0..12 {
                        lanes[l] = vecs[l % 8][(k + l) % len];
                    }
                }
                let keys: Vec<&[f32]> = (0..13).map(|t| vecs[(3 * t) % 8].as_slice()).collect();
                let mut d = vec![f32::NAN; 16 * keys.len()];
                dots_16(isa, &qt, &keys, &mut d);
                for (t, key) in keys.iter().enumerate() {
                    for l in 0..16 {
                        let terms = || qt.chunks_exact(16).zip(key.iter()).map(|(q, &x)| q[l] as f64 * x as f64);
                        let (want, mag) = (terms().sum::<f64>(), terms().map(f64::abs).sum::<f64>() + 1e-6);
                        prop_assert!((d[16 * t + l] as f64 - want).abs() / mag < 1e-5, "{isa}: dots_16[{t}][{l}]");
                    }
                }
                let mut ys: [Vec<f32>; 4] = std::array::from_fn(|_| y0.clone());
                let w4: [&[f32]; 4] = std::array::from_fn(|_| weights.as_slice());
                let [a0, a1, a2, a3] = &mut ys;
                weighted_sum_4(isa, w4, &rows, [a0, a1, a2, a3]);
                let mut y = y0.clone();
                weighted_sum(isa, &weights, &rows, &mut y);
                for other in &ys {
                    prop_assert!(other.iter().zip(&y).all(|(a, b)| (a - b).abs() <= 1e-5 * (a.abs() + 1.0)), "{isa}: weighted_sum_4");
                }
                for k in 0..len {
                    let want: f64 = y0[k] as f64 + weights.iter().zip(&rows).map(|(&w, r)| w as f64 * r[k] as f64).sum::<f64>();
                    let mag: f64 = y0[k].abs() as f64 + weights.iter().zip(&rows).map(|(&w, r)| (w * r[k]).abs() as f64).sum::<f64>() + 1e-6;
                    prop_assert!((y[k] as f64 - want).abs() / mag < 1e-5, "{isa}: weighted_sum[{k}]");
                }
            }
        }
    }
}
