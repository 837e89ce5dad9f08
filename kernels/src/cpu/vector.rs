//! F32 vector primitives for attention over the latent KV cache:
//! scores are `dot_f32(q, k)`, the context is a sum of `axpy_f32(p, v, ctx)`.
//! The blocked forms, [`dots_16`] and [`weighted_sum_16`], are what decode
//! attention uses: they load each operand once for sixteen products, so
//! they run at FMA rather than load/store speed.

use super::isa::Isa;

/// `Σ a[i]·b[i]` in f32 (several accumulators, so the summation order differs
/// from a sequential loop by normal rounding).
pub fn dot_f32(isa: Isa, a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "dot_f32: length mismatch");
    match isa.usable() {
        // SAFETY: `usable()` guarantees the features each path enables.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 | Isa::Avx512Bf16 | Isa::Avx512Fp16 => unsafe { x86::dot_avx512(a.as_ptr(), b) },
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { x86::dot_avx2(a.as_ptr(), b) },
        _ => crate::linear::dot(a, b),
    }
}

/// `Σ w[i]·x[i]` for F32 `w` given as its little-endian bytes (any
/// alignment): a GGUF's F32 router, read where it lies in the weights.
///
/// Summed as llama.cpp sums it on AVX-512 (llamafile's tinyBLAS, which takes
/// F32 × F32 products): sixteen lanes, lane `l` one fused multiply-add
/// chain over elements `l, l + 16, …` (a partial last group padded with
/// zeros), then the halving tree of `_mm512_reduce_add_ps`. Every level
/// returns the same bits: router logits decide which experts run, and near
/// ties they should not depend on the machine's SIMD level.
pub fn dot_f32_bytes(isa: Isa, w: &[u8], x: &[f32]) -> f32 {
    assert_eq!(w.len(), 4 * x.len(), "dot_f32_bytes: length mismatch");
    match isa.usable() {
        // SAFETY: `usable()` guarantees the features; `w` holds `x.len()`
        // f32 values, which the kernels read with unaligned loads.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 | Isa::Avx512Bf16 | Isa::Avx512Fp16 => unsafe { x86::lanes16_dot_avx512(w.as_ptr().cast(), x) },
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { x86::lanes16_dot_avx2(w.as_ptr().cast(), x) },
        _ => {
            let mut lanes = [0.0f32; 16];
            for (k, (w, &x)) in w.chunks_exact(4).zip(x).enumerate() {
                let w = f32::from_le_bytes([w[0], w[1], w[2], w[3]]);
                lanes[k % 16] = w.mul_add(x, lanes[k % 16]);
            }
            // The zero padding of a partial last group: `0 · 0 + lane`.
            if !x.len().is_multiple_of(16) {
                lanes[x.len() % 16..].iter_mut().for_each(|l| *l = 0f32.mul_add(0.0, *l));
            }
            reduce_lanes16(lanes)
        }
    }
}

/// How far ahead the AVX-512 forms of [`dot_f32_bytes`] and
/// [`dot_bf16_f32`] fetch their row (a line at a time): a router's rows are
/// read once a layer, from DRAM, one after another, and a row's one chain
/// of multiply-adds left its loads waiting there. On the `bench` model,
/// decoding at context 512, the router's products took 0.23–0.24 ms a step
/// from its GGUF's F32 rows and 0.19–0.20 from the checkpoint's BF16 ones;
/// 8 KiB ahead, 0.09–0.11 each. (The AVX2 forms, run here with
/// `DUPLEX_ISA=avx2`, took 0.11–0.12 ms with and without.)
#[cfg(target_arch = "x86_64")]
const ROW_LEAD: usize = 8192;

/// The halving tree of `_mm512_reduce_add_ps` (GCC's and LLVM's alike):
/// the high eight lanes onto the low eight, then four onto four, then
/// lanes 2 and 3 onto 0 and 1, then lane 1 onto lane 0.
fn reduce_lanes16(v: [f32; 16]) -> f32 {
    let t8: [f32; 8] = std::array::from_fn(|i| v[i] + v[i + 8]);
    let t4: [f32; 4] = std::array::from_fn(|i| t8[i] + t8[i + 4]);
    (t4[0] + t4[2]) + (t4[1] + t4[3])
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
        // SAFETY: as above.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { x86::dot_bf16_f32_avx2(w, x) },
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

/// Queries (heads) one SIMD vector wide: [`dots_16`] and [`weighted_sum_16`]
/// take up to this many at once.
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
        // SAFETY: `usable()` guarantees AVX2 and FMA; the shapes are checked above.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { x86::dots_16_avx2(qt, keys, out) },
        _ => dots_16_plain(qt, keys, out),
    }
}

/// [`dots_16`] in plain Rust: each lane one fused chain in order of `k`,
/// as the vector forms sum it.
fn dots_16_plain(qt: &[f32], keys: &[&[f32]], out: &mut [f32]) {
    const L: usize = QUERY_LANES;
    for (key, out) in keys.iter().zip(out.chunks_exact_mut(L)) {
        let mut lanes = [0.0f32; L];
        for (&kv, q) in key.iter().zip(qt.chunks_exact(L)) {
            lanes = std::array::from_fn(|l| kv.mul_add(q[l], lanes[l]));
        }
        out.copy_from_slice(&lanes);
    }
}

/// [`dots_16`] for `16 / sub` queries, each spread over `sub` lanes (`sub`
/// a power of two up to 16, dividing `d`), so that fewer than sixteen
/// queries still fill a vector: query `g` lane `s` sums the products of
/// the elements `p · sub + s`. `qt` is `[d / sub][16]`, `qt[p · 16 + g · sub
/// + s] = q_g[p · sub + s]`, and each key step is a broadcast of `sub`
/// consecutive key elements. `out[t · 16 + g]` is query g's dot product
/// with key t (its `sub` partial sums added in a fixed tree), and zero for
/// `g ≥ 16 / sub`, so `out` has [`dots_16`]'s layout. `sub == 1` is
/// [`dots_16`] itself.
pub fn dots_16_split(isa: Isa, qt: &[f32], sub: usize, keys: &[&[f32]], out: &mut [f32]) {
    const L: usize = QUERY_LANES;
    assert!(sub.is_power_of_two() && sub <= L, "dots_16_split: sub {sub} is not a power of two up to 16");
    let d = qt.len() / L * sub;
    assert!(qt.len().is_multiple_of(L) && keys.iter().all(|k| k.len() == d), "dots_16_split: shapes");
    assert_eq!(out.len(), keys.len() * L, "dots_16_split: one row of outputs per key");
    if sub == 1 {
        return dots_16(isa, qt, keys, out);
    }
    match isa.usable() {
        // SAFETY: `usable()` guarantees the features; the shapes are checked above.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 | Isa::Avx512Bf16 | Isa::Avx512Fp16 => unsafe {
            match sub {
                2 => x86::dots_16_split_avx512::<2>(qt, keys, out),
                4 => x86::dots_16_split_avx512::<4>(qt, keys, out),
                8 => x86::dots_16_split_avx512::<8>(qt, keys, out),
                _ => x86::dots_16_split_avx512::<16>(qt, keys, out),
            }
        },
        // SAFETY: `usable()` guarantees AVX2 and FMA.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { dots_16_split_fma(qt, sub, keys, out) },
        _ => dots_16_split_plain(qt, sub, keys, out),
    }
}

/// [`dots_16_split`] in plain Rust.
#[inline(always)]
fn dots_16_split_plain(qt: &[f32], sub: usize, keys: &[&[f32]], out: &mut [f32]) {
    const L: usize = QUERY_LANES;
    for (key, out) in keys.iter().zip(out.chunks_exact_mut(L)) {
        let mut lanes = [0.0f32; L];
        for (k, q) in key.chunks_exact(sub).zip(qt.chunks_exact(L)) {
            for (l, lane) in lanes.iter_mut().enumerate() {
                *lane = k[l % sub].mul_add(q[l], *lane);
            }
        }
        out.fill(0.0);
        for (g, o) in out[..L / sub].iter_mut().enumerate() {
            *o = lanes[g * sub..(g + 1) * sub].iter().sum();
        }
    }
}

/// [`dots_16_split_plain`] compiled with FMA (and AVX2): without it every
/// `mul_add` is a call to the C library's software `fmaf`, which made
/// decode attention on an AVX2 CPU twenty times slower than its weights.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn dots_16_split_fma(qt: &[f32], sub: usize, keys: &[&[f32]], out: &mut [f32]) {
    dots_16_split_plain(qt, sub, keys, out)
}

/// Asks for every cache line of `data` to be brought into the L1 cache: a
/// hint for data read soon from scattered places (paged cache entries)
/// that the hardware prefetchers do not foresee. Never faults.
#[inline]
pub fn prefetch(data: &[f32]) {
    #[cfg(target_arch = "x86_64")]
    for i in (0..data.len()).step_by(16) {
        // SAFETY: prefetching is only a hint, valid for any address; the
        // line of data[i] is inside the slice anyway.
        unsafe { std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(data.as_ptr().add(i).cast()) };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = data;
}

/// `out[l] += Σ_t wt[t · 16 + l] · rows[t]` for the `out.len() / width`
/// (at most [`QUERY_LANES`]) outputs of `width` floats in `out`, and rows
/// of `width` floats. The weights come transposed, as [`dots_16`] leaves
/// its scores: each row vector loaded feeds sixteen FMAs, one per output,
/// and each output sums in order of `t`.
pub fn weighted_sum_16(isa: Isa, wt: &[f32], rows: &[&[f32]], out: &mut [f32], width: usize) {
    const L: usize = QUERY_LANES;
    assert!(width > 0 && out.len().is_multiple_of(width) && out.len() / width <= L, "weighted_sum_16: out is not [≤ 16, width]");
    assert_eq!(wt.len(), rows.len() * L, "weighted_sum_16: one row of weights per row");
    assert!(rows.iter().all(|r| r.len() == width), "weighted_sum_16: row length");
    match isa.usable() {
        // SAFETY: as above; every row and output is `width` long.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 | Isa::Avx512Bf16 | Isa::Avx512Fp16 => unsafe { x86::weighted_sum_16_avx512(wt, rows, out, width) },
        // SAFETY: `usable()` guarantees AVX2 and FMA; the shapes are checked above.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { x86::weighted_sum_16_avx2(wt, rows, out, width) },
        _ => weighted_sum_16_plain(wt, rows, out, width),
    }
}

/// [`weighted_sum_16`] in plain Rust: each output float one fused chain
/// in order of the rows.
fn weighted_sum_16_plain(wt: &[f32], rows: &[&[f32]], out: &mut [f32], width: usize) {
    const L: usize = QUERY_LANES;
    for (l, y) in out.chunks_exact_mut(width).enumerate() {
        for (w, row) in wt.chunks_exact(L).zip(rows) {
            y.iter_mut().zip(*row).for_each(|(y, &r)| *y = w[l].mul_add(r, *y));
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    /// `pa` points at `b.len()` f32 values, which it may hold at any alignment.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn dot_avx512(pa: *const f32, b: &[f32]) -> f32 {
        let (n, pb) = (b.len(), b.as_ptr());
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
            if i % 32 == 0 {
                crate::cpu::kernel::prefetch_at::<{ super::ROW_LEAD }>(pw, 2 * i);
            }
            // SAFETY: the lanes under `m` lie inside both slices (2 bytes per value in `w`).
            let (wv, xv) = unsafe { (_mm256_maskz_loadu_epi16(m, pw.add(2 * i).cast()), _mm512_maskz_loadu_ps(m, px.add(i))) };
            let a = (i / 16) % 4;
            acc[a] = _mm512_fmadd_ps(widen(wv), xv, acc[a]);
            i += 16;
        }
        _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3])))
    }

    /// [`dot_bf16_f32_avx512`] eight values at a time (a BF16 router on
    /// an AVX2 CPU); the last few in order after the vectors' sum.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn dot_bf16_f32_avx2(w: &[u8], x: &[f32]) -> f32 {
        let (n, pw, px) = (x.len(), w.as_ptr(), x.as_ptr());
        let mut acc = [_mm256_setzero_ps(); 4];
        let mut i = 0;
        while i + 8 <= n {
            // SAFETY: values i..i + 8 lie inside both slices (2 bytes each in `w`).
            let (wv, xv) = unsafe { (_mm_loadu_si128(pw.add(2 * i).cast()), _mm256_loadu_ps(px.add(i))) };
            // A BF16 value is the top half of its f32: widen, shift up 16.
            let wv = _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(wv)));
            let a = (i / 8) % 4;
            acc[a] = _mm256_fmadd_ps(wv, xv, acc[a]);
            i += 8;
        }
        let tail: f32 = w[2 * i..].chunks_exact(2).zip(&x[i..]).map(|(b, &x)| half::bf16::from_le_bytes([b[0], b[1]]).to_f32() * x).sum();
        sum4(acc) + tail
    }

    /// [`super::dots_16`] on AVX2: four keys at a time (then one), each
    /// key's sixteen lanes in two vectors, every lane one fused chain in
    /// order of `k` (the plain form's bits).
    ///
    /// # Safety
    /// AVX2 and FMA present; `qt` is `[d][16]`, every key `d` long, `out`
    /// `[keys][16]`.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn dots_16_avx2(qt: &[f32], keys: &[&[f32]], out: &mut [f32]) {
        let mut t = 0;
        while t + 4 <= keys.len() {
            // SAFETY: forwarded; keys t..t + 4 exist.
            unsafe { dots_16_group_avx2::<4>(qt, &keys[t..t + 4], &mut out[16 * t..16 * (t + 4)]) };
            t += 4;
        }
        for t in t..keys.len() {
            // SAFETY: as above, one key.
            unsafe { dots_16_group_avx2::<1>(qt, &keys[t..t + 1], &mut out[16 * t..16 * (t + 1)]) };
        }
    }

    /// # Safety
    /// As [`dots_16_avx2`], with exactly `P` keys.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn dots_16_group_avx2<const P: usize>(qt: &[f32], keys: &[&[f32]], out: &mut [f32]) {
        let key: [*const f32; P] = std::array::from_fn(|p| keys[p].as_ptr());
        let mut acc = [[_mm256_setzero_ps(); 2]; P];
        for i in 0..qt.len() / 16 {
            if i % 16 == 0 {
                // As `dots_16_group`: each key stream's line four ahead.
                for k in key {
                    // Only a hint, never a fault.
                    _mm_prefetch::<_MM_HINT_T0>(k.wrapping_add(i + 64).cast());
                }
            }
            // SAFETY: i < d: qt holds 16 · d floats and every key d.
            let q = unsafe { [_mm256_loadu_ps(qt.as_ptr().add(16 * i)), _mm256_loadu_ps(qt.as_ptr().add(16 * i + 8))] };
            for p in 0..P {
                let k = _mm256_set1_ps(unsafe { *key[p].add(i) });
                acc[p][0] = _mm256_fmadd_ps(k, q[0], acc[p][0]);
                acc[p][1] = _mm256_fmadd_ps(k, q[1], acc[p][1]);
            }
        }
        for (p, acc) in acc.iter().enumerate() {
            // SAFETY: out holds 16 · P floats.
            unsafe {
                _mm256_storeu_ps(out.as_mut_ptr().add(16 * p), acc[0]);
                _mm256_storeu_ps(out.as_mut_ptr().add(16 * p + 8), acc[1]);
            }
        }
    }

    /// [`super::weighted_sum_16`] on AVX2: eight columns of up to eight
    /// outputs at once in registers across all the rows (sixteen outputs
    /// in two passes over the chunk, which stays in cache), every output
    /// float one fused chain in order of the rows (the plain form's bits);
    /// the last columns past a multiple of eight in the plain form.
    ///
    /// # Safety
    /// AVX2 and FMA present; `wt` is `[rows][16]`, every row `width` long
    /// and `out` `[out.len() / width ≤ 16][width]`.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn weighted_sum_16_avx2(wt: &[f32], rows: &[&[f32]], out: &mut [f32], width: usize) {
        let outputs = out.len() / width;
        let whole = width - width % 8;
        let po = out.as_mut_ptr();
        for j in (0..whole).step_by(8) {
            for l0 in (0..outputs).step_by(8) {
                let n = (outputs - l0).min(8);
                // SAFETY (the loads and stores of `out`): output l < outputs
                // has columns j..j + 8 < width.
                let mut acc: [__m256; 8] = std::array::from_fn(|l| if l < n { unsafe { _mm256_loadu_ps(po.add((l0 + l) * width + j)) } } else { _mm256_setzero_ps() });
                for (w, row) in wt.chunks_exact(16).zip(rows) {
                    // SAFETY: j + 8 <= width, the row's length.
                    let r = unsafe { _mm256_loadu_ps(row.as_ptr().add(j)) };
                    for l in 0..8 {
                        // Outputs past the last are computed and dropped.
                        acc[l] = _mm256_fmadd_ps(_mm256_set1_ps(w[l0 + l % n]), r, acc[l]);
                    }
                }
                for (l, a) in acc.iter().enumerate().take(n) {
                    unsafe { _mm256_storeu_ps(po.add((l0 + l) * width + j), *a) };
                }
            }
        }
        for (l, y) in out.chunks_exact_mut(width).enumerate() {
            for (w, row) in wt.chunks_exact(16).zip(rows) {
                y[whole..].iter_mut().zip(&row[whole..]).for_each(|(y, &r)| *y = w[l].mul_add(r, *y));
            }
        }
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
        // Sixteen keys at a time: sixteen independent FMA chains hide the
        // latency, and each query vector loaded feeds sixteen broadcast FMAs.
        let mut t = 0;
        while t + 16 <= keys.len() {
            // SAFETY: forwarded; keys t..t + 16 exist.
            unsafe { dots_16_group::<16>(qt, &keys[t..t + 16], &mut out[16 * t..16 * (t + 16)]) };
            t += 16;
        }
        while t + 4 <= keys.len() {
            // SAFETY: as above, four keys.
            unsafe { dots_16_group::<4>(qt, &keys[t..t + 4], &mut out[16 * t..16 * (t + 4)]) };
            t += 4;
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
            if i % 16 == 0 {
                // The keys come from DRAM or L3 (the weights streamed since
                // evict them) as sixteen read streams of four bytes per FMA,
                // which the hardware prefetchers lag behind: fetch each
                // stream's line four ahead (~15% off the kernel's time at
                // context 512, cold or warm).
                for k in key {
                    // Only a hint, never a fault; `wrapping_add` keeps the
                    // address past the key well-defined.
                    _mm_prefetch::<_MM_HINT_T0>(k.wrapping_add(i + 64).cast());
                }
            }
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
    /// AVX-512 F present; `qt` is `[d / S][16]`, every key `d` long (`S`
    /// divides `d`), `out` `[keys][16]`.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn dots_16_split_avx512<const S: usize>(qt: &[f32], keys: &[&[f32]], out: &mut [f32]) {
        // As `dots_16_avx512`: sixteen keys at a time, then four, then one.
        let mut t = 0;
        while t + 16 <= keys.len() {
            // SAFETY: forwarded; keys t..t + 16 exist.
            unsafe { dots_16_split_group::<S, 16>(qt, &keys[t..t + 16], &mut out[16 * t..16 * (t + 16)]) };
            t += 16;
        }
        while t + 4 <= keys.len() {
            // SAFETY: as above, four keys.
            unsafe { dots_16_split_group::<S, 4>(qt, &keys[t..t + 4], &mut out[16 * t..16 * (t + 4)]) };
            t += 4;
        }
        for t in t..keys.len() {
            // SAFETY: as above, one key.
            unsafe { dots_16_split_group::<S, 1>(qt, &keys[t..t + 1], &mut out[16 * t..16 * (t + 1)]) };
        }
    }

    /// `S` consecutive floats at `k` repeated across the vector (one
    /// broadcast load for S < 16).
    ///
    /// # Safety
    /// `k..k + S` is readable.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn broadcast_run<const S: usize>(k: *const f32) -> __m512 {
        // SAFETY: the caller's; unaligned loads throughout.
        unsafe {
            match S {
                1 => _mm512_set1_ps(*k),
                2 => _mm512_castpd_ps(_mm512_set1_pd(k.cast::<f64>().read_unaligned())),
                4 => _mm512_broadcast_f32x4(_mm_loadu_ps(k)),
                8 => _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_loadu_pd(k.cast()))),
                _ => _mm512_loadu_ps(k),
            }
        }
    }

    /// Lane g of the result is the sum of lanes `g · S..(g + 1) · S` of `v`
    /// (pairs, then pairs of pairs, ...), for g < 16 / S; the rest zero.
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn sum_runs<const S: usize>(v: __m512) -> __m512 {
        let mut v = v;
        if S >= 2 {
            v = _mm512_add_ps(v, _mm512_permute_ps::<0b10_11_00_01>(v));
        }
        if S >= 4 {
            v = _mm512_add_ps(v, _mm512_permute_ps::<0b01_00_11_10>(v));
        }
        if S >= 8 {
            v = _mm512_add_ps(v, _mm512_shuffle_f32x4::<0b10_11_00_01>(v, v));
        }
        if S >= 16 {
            v = _mm512_add_ps(v, _mm512_shuffle_f32x4::<0b01_00_11_10>(v, v));
        }
        // Every lane of run g now holds its sum; gather lane g · S to g.
        let idx = _mm512_set_epi32(15 * S as i32 % 16, 14 * S as i32 % 16, 13 * S as i32 % 16, 12 * S as i32 % 16, 11 * S as i32 % 16, 10 * S as i32 % 16, 9 * S as i32 % 16, 8 * S as i32 % 16, 7 * S as i32 % 16, 6 * S as i32 % 16, 5 * S as i32 % 16, 4 * S as i32 % 16, 3 * S as i32 % 16, 2 * S as i32 % 16, S as i32 % 16, 0);
        let keep: __mmask16 = if S == 16 { 1 } else { ((1u32 << (16 / S)) - 1) as __mmask16 };
        _mm512_maskz_permutexvar_ps(keep, idx, v)
    }

    /// # Safety
    /// As [`dots_16_split_avx512`], with exactly `P` keys.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn dots_16_split_group<const S: usize, const P: usize>(qt: &[f32], keys: &[&[f32]], out: &mut [f32]) {
        let key: [*const f32; P] = std::array::from_fn(|p| keys[p].as_ptr());
        let mut acc = [_mm512_setzero_ps(); P];
        for i in 0..qt.len() / 16 {
            // Key floats i · S.. are this step's.
            if (i * S).is_multiple_of(16) {
                // As in `dots_16_group`: each key stream's line four ahead.
                for k in key {
                    // Only a hint, never a fault.
                    _mm_prefetch::<_MM_HINT_T0>(k.wrapping_add(i * S + 64).cast());
                }
            }
            // SAFETY: i < d / S: qt holds 16 · d / S floats and every key d.
            let q = unsafe { _mm512_loadu_ps(qt.as_ptr().add(16 * i)) };
            for p in 0..P {
                acc[p] = _mm512_fmadd_ps(unsafe { broadcast_run::<S>(key[p].add(i * S)) }, q, acc[p]);
            }
        }
        for (p, acc) in acc.iter().enumerate() {
            // SAFETY: out holds 16 · P floats.
            unsafe { _mm512_storeu_ps(out.as_mut_ptr().add(16 * p), sum_runs::<S>(*acc)) };
        }
    }

    /// # Safety
    /// AVX-512 F present; `wt` is `[rows][16]`, every row `width` long and
    /// `out` `[out.len() / width ≤ 16][width]`.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn weighted_sum_16_avx512(wt: &[f32], rows: &[&[f32]], out: &mut [f32], width: usize) {
        // Only the outputs there are (rounded up to a power of two) are
        // computed, each over as many vectors of the width as fill sixteen
        // accumulators: fewer outputs take fewer FMAs per row, and share
        // each weight broadcast across more vectors.
        // SAFETY (all arms): forwarded.
        unsafe {
            match out.len() / width {
                1 => weighted_sum_n::<1, 16>(wt, rows, out, width),
                2 => weighted_sum_n::<2, 8>(wt, rows, out, width),
                3..=4 => weighted_sum_n::<4, 4>(wt, rows, out, width),
                5..=8 => weighted_sum_n::<8, 2>(wt, rows, out, width),
                _ => weighted_sum_n::<16, 1>(wt, rows, out, width),
            }
        }
    }

    /// `weighted_sum_16` for at most `N` outputs, `C` vectors of each at
    /// once (`N · C = 16` accumulators).
    ///
    /// # Safety
    /// As [`weighted_sum_16_avx512`], with at most `N` outputs.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn weighted_sum_n<const N: usize, const C: usize>(wt: &[f32], rows: &[&[f32]], out: &mut [f32], width: usize) {
        // One vector of every output per chunk in registers across all the
        // rows; per row C loads and N broadcasts feed N · C FMAs. Outputs
        // past the last (up to N) and vectors past the width are computed
        // and dropped: their loads and stores are masked off entirely. Each
        // output float sums its rows in order, whatever N and C are.
        let outputs = out.len() / width;
        let po = out.as_mut_ptr();
        let mut i = 0;
        while i < width {
            let m: [__mmask16; C] = std::array::from_fn(|c| if i + 16 * c < width { lanes(width, i + 16 * c) } else { 0 });
            let mask = |l: usize, c: usize| if l < outputs { m[c] } else { 0 };
            // SAFETY: output l < outputs has lanes i + 16c.. under `m[c]`
            // inside it; elsewhere the mask is empty and nothing is touched.
            unsafe {
                let mut acc: [[__m512; C]; N] = std::array::from_fn(|l| std::array::from_fn(|c| _mm512_maskz_loadu_ps(mask(l, c), po.wrapping_add(l * width + i + 16 * c))));
                for (t, row) in rows.iter().enumerate() {
                    let r: [__m512; C] = std::array::from_fn(|c| _mm512_maskz_loadu_ps(m[c], row.as_ptr().wrapping_add(i + 16 * c)));
                    let w = wt.as_ptr().add(16 * t);
                    for (l, acc) in acc.iter_mut().enumerate() {
                        let w = _mm512_set1_ps(*w.add(l));
                        for (acc, &r) in acc.iter_mut().zip(&r) {
                            *acc = _mm512_fmadd_ps(w, r, *acc);
                        }
                    }
                }
                for (l, acc) in acc.iter().enumerate() {
                    for (c, &acc) in acc.iter().enumerate() {
                        _mm512_mask_storeu_ps(po.wrapping_add(l * width + i + 16 * c), mask(l, c), acc);
                    }
                }
            }
            i += 16 * C;
        }
    }

    /// `dot_f32_bytes`'s sixteen FMA chains and tree; `pa` as in
    /// [`dot_avx512`].
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn lanes16_dot_avx512(pa: *const f32, b: &[f32]) -> f32 {
        let (n, pb) = (b.len(), b.as_ptr());
        let mut acc = _mm512_setzero_ps();
        let mut i = 0;
        while i < n {
            let m = lanes(n, i);
            crate::cpu::kernel::prefetch_at::<{ super::ROW_LEAD }>(pa.cast(), 4 * i);
            // SAFETY: the lanes under `m` lie inside both; the others read as zero.
            let (w, x) = unsafe { (_mm512_maskz_loadu_ps(m, pa.add(i)), _mm512_maskz_loadu_ps(m, pb.add(i))) };
            acc = _mm512_fmadd_ps(w, x, acc);
            i += 16;
        }
        let lo = _mm512_castps512_ps256(acc);
        let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(acc)));
        tree_of_eight(_mm256_add_ps(lo, hi))
    }

    /// The same chains as [`lanes16_dot_avx512`], lanes 0–7 and 8–15 in two
    /// vectors; a partial last group is copied out, zero-padded.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn lanes16_dot_avx2(pa: *const f32, b: &[f32]) -> f32 {
        let (n, pb) = (b.len(), b.as_ptr());
        let (mut lo, mut hi) = (_mm256_setzero_ps(), _mm256_setzero_ps());
        let (mut w_tail, mut x_tail) = ([0.0f32; 16], [0.0f32; 16]);
        let mut i = 0;
        while i < n {
            let (w, x) = if n - i >= 16 {
                // SAFETY: i + 16 <= n, inside both.
                unsafe { (pa.add(i), pb.add(i)) }
            } else {
                for k in 0..n - i {
                    // SAFETY: i + k < n, inside both; unaligned reads.
                    (w_tail[k], x_tail[k]) = unsafe { (pa.add(i + k).read_unaligned(), *pb.add(i + k)) };
                }
                (w_tail.as_ptr(), x_tail.as_ptr())
            };
            // SAFETY: `w` and `x` each point at 16 readable f32.
            unsafe {
                lo = _mm256_fmadd_ps(_mm256_loadu_ps(w), _mm256_loadu_ps(x), lo);
                hi = _mm256_fmadd_ps(_mm256_loadu_ps(w.add(8)), _mm256_loadu_ps(x.add(8)), hi);
            }
            i += 16;
        }
        tree_of_eight(_mm256_add_ps(lo, hi))
    }

    /// `reduce_lanes16` from its first step on: four onto four, lanes 2
    /// and 3 onto 0 and 1, lane 1 onto lane 0.
    #[target_feature(enable = "avx2")]
    fn tree_of_eight(t8: __m256) -> f32 {
        let t4 = _mm_add_ps(_mm256_castps256_ps128(t8), _mm256_extractf128_ps::<1>(t8));
        let t2 = _mm_add_ps(t4, _mm_movehl_ps(t4, t4));
        _mm_cvtss_f32(_mm_add_ss(t2, _mm_movehdup_ps(t2)))
    }

    /// `pa` as in [`dot_avx512`].
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn dot_avx2(pa: *const f32, b: &[f32]) -> f32 {
        let (n, pb) = (b.len(), b.as_ptr());
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
        // SAFETY: i..n lie inside both; unaligned reads.
        let tail: f32 = (i..n).map(|k| unsafe { pa.add(k).read_unaligned() } * b[k]).sum();
        sum4(acc) + tail
    }

    /// The sum of four accumulators' lanes: pairs of vectors, then halves.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn sum4(acc: [__m256; 4]) -> f32 {
        let s = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
        let s = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps::<1>(s));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)))
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

/// An online softmax over the [`QUERY_LANES`] lanes of tiles of scores
/// (`[positions][lane]`, as [`dots_16`] writes them): each lane's running
/// maximum and sum, carried from block to block. Shared by the split-K
/// decode attention kernels.
#[derive(Clone, Copy)]
pub struct LaneSoftmax {
    pub max: [f32; QUERY_LANES],
    pub sum: [f32; QUERY_LANES],
}

impl Default for LaneSoftmax {
    fn default() -> Self {
        LaneSoftmax { max: [f32::NEG_INFINITY; QUERY_LANES], sum: [0.0; QUERY_LANES] }
    }
}

impl LaneSoftmax {
    /// Take one block: its scores are scaled and become `e^(s − max)`
    /// against the running maximum of their lane; whatever a lane already
    /// summed into `acc` (`lanes` rows of `width`) under an older, smaller
    /// maximum is rescaled. The tile is then ready for [`weighted_sum_16`].
    pub fn block(&mut self, isa: Isa, tile: &mut [f32], scale: f32, acc: &mut [f32], width: usize, lanes: usize) {
        const L: usize = QUERY_LANES;
        let (max, sum) = (&mut self.max, &mut self.sum);
        let mut block_max = [f32::NEG_INFINITY; L];
        for row in tile.chunks_exact_mut(L) {
            for l in 0..L {
                row[l] *= scale;
                block_max[l] = block_max[l].max(row[l]);
            }
        }
        let new_max: [f32; L] = std::array::from_fn(|l| max[l].max(block_max[l]));
        for row in tile.chunks_exact_mut(L) {
            for l in 0..L {
                row[l] -= new_max[l];
            }
        }
        super::elementwise::exp_slice(isa, tile);
        // Each lane's block sum in order of position, all lanes at once (the
        // same additions as summing each lane's column on its own).
        let mut block_sum = [-0.0f32; L];
        for row in tile.chunks_exact(L) {
            for l in 0..L {
                block_sum[l] += row[l];
            }
        }
        for l in 0..L {
            // An unchanged finite maximum rescales by e⁰ = 1 exactly: skip the exp.
            let rescale = if max[l] == new_max[l] && max[l].is_finite() { 1.0 } else { (max[l] - new_max[l]).exp() };
            sum[l] = sum[l] * rescale + block_sum[l];
            if l < lanes && rescale != 1.0 {
                acc[l * width..(l + 1) * width].iter_mut().for_each(|v| *v *= rescale);
            }
        }
        *max = new_max;
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
        fn f32_weight_bytes_dot_matches_scalar(v in prop::collection::vec((-10.0f32..10.0, -10.0f32..10.0), 0..300), offset in 0usize..4) {
            let (w, x): (Vec<f32>, Vec<f32>) = v.into_iter().unzip();
            let want: f64 = w.iter().zip(&x).map(|(&a, &b)| a as f64 * b as f64).sum();
            let mag: f64 = w.iter().zip(&x).map(|(&a, &b)| (a as f64 * b as f64).abs()).sum::<f64>() + 1e-6;
            // The weights' bytes at every offset from 4-byte alignment.
            let mut bytes = vec![0u8; offset];
            bytes.extend(w.iter().flat_map(|f| f.to_le_bytes()));
            for isa in isa::supported() {
                let got = dot_f32_bytes(isa, &bytes[offset..], &x);
                prop_assert!((got as f64 - want).abs() / mag < 1e-5, "{isa}: {got} vs {want}");
                // Every level sums in the same order.
                prop_assert_eq!(got.to_bits(), dot_f32_bytes(Isa::Portable, &bytes[offset..], &x).to_bits(), "{}", isa);
            }
        }

        /// Heads spread over 1 to 16 lanes each: every dot product against
        /// f64, the lanes past the last head zero, on and off the 16-, 4-
        /// and 1-key groups.
        #[test]
        fn split_dots_match_scalar(sub_log in 0u32..=4, steps in 1usize..20, keys in 0usize..40, seed in any::<u64>()) {
            let sub = 1usize << sub_log;
            let (d, heads) = (steps * sub, 16 / sub);
            let mut state = seed | 1;
            let mut next = move || { state ^= state << 13; state ^= state >> 7; state ^= state << 17; (state % 2001) as f32 / 100.0 - 10.0 };
            let q: Vec<Vec<f32>> = (0..heads).map(|_| (0..d).map(|_| next()).collect()).collect();
            let keys: Vec<Vec<f32>> = (0..keys).map(|_| (0..d).map(|_| next()).collect()).collect();
            let key_refs: Vec<&[f32]> = keys.iter().map(|k| k.as_slice()).collect();
            let mut qt = vec![0.0f32; 16 * steps];
            for (g, q) in q.iter().enumerate() {
                for (i, &v) in q.iter().enumerate() {
                    qt[i / sub * 16 + g * sub + i % sub] = v;
                }
            }
            for isa in isa::supported() {
                let mut out = vec![f32::NAN; 16 * keys.len()];
                dots_16_split(isa, &qt, sub, &key_refs, &mut out);
                for (t, key) in keys.iter().enumerate() {
                    for g in 0..16 {
                        let got = out[16 * t + g] as f64;
                        if g >= heads {
                            prop_assert_eq!(got, 0.0, "{}: sub {}: lane {} past the heads", isa, sub, g);
                            continue;
                        }
                        let terms = || q[g].iter().zip(key).map(|(&a, &b)| a as f64 * b as f64);
                        let (want, mag) = (terms().sum::<f64>(), terms().map(f64::abs).sum::<f64>() + 1e-6);
                        prop_assert!((got - want).abs() / mag < 1e-5, "{isa}: sub {sub}: key {t} head {g}: {got} vs {want}");
                    }
                }
            }
        }

        #[test]
        fn blocked_forms_match_scalar(len in 0usize..200, keys in 0usize..40, outputs in 1usize..=16, seed in any::<u64>()) {
            let mut state = seed | 1;
            let mut next = move || { state ^= state << 13; state ^= state >> 7; state ^= state << 17; (state % 2001) as f32 / 100.0 - 10.0 };
            let vecs: Vec<Vec<f32>> = (0..8).map(|_| (0..len).map(|_| next()).collect()).collect();
            // Any number of keys: groups of sixteen, of four and single keys.
            let keys: Vec<&[f32]> = (0..keys).map(|t| vecs[(3 * t) % 8].as_slice()).collect();
            // Sixteen query lanes, the last four zero.
            let mut qt = vec![0.0f32; 16 * len];
            for (k, lanes) in qt.chunks_exact_mut(16).enumerate() {
                for l in 0..12 {
                    lanes[l] = vecs[l % 8][(k + l) % len];
                }
            }
            let wt: Vec<f32> = (0..16 * keys.len()).map(|_| next() / 10.0).collect();
            let width = len.max(1);
            let rows: Vec<Vec<f32>> = (0..keys.len()).map(|_| (0..width).map(|_| next()).collect()).collect();
            let rows: Vec<&[f32]> = rows.iter().map(|r| r.as_slice()).collect();
            let y0: Vec<f32> = (0..outputs * width).map(|_| next()).collect();
            // Every level has the plain form's bits: each lane, and each
            // output float, is one fused chain in order.
            let mut plain_d = vec![f32::NAN; 16 * keys.len()];
            dots_16(Isa::Portable, &qt, &keys, &mut plain_d);
            let mut plain_y = y0.clone();
            weighted_sum_16(Isa::Portable, &wt, &rows, &mut plain_y, width);
            for isa in isa::supported() {
                let mut d = vec![f32::NAN; 16 * keys.len()];
                dots_16(isa, &qt, &keys, &mut d);
                prop_assert_eq!(d.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), plain_d.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), "{}: dots_16's bits", isa);
                for (t, key) in keys.iter().enumerate() {
                    for l in 0..16 {
                        let terms = || qt.chunks_exact(16).zip(key.iter()).map(|(q, &x)| q[l] as f64 * x as f64);
                        let (want, mag) = (terms().sum::<f64>(), terms().map(f64::abs).sum::<f64>() + 1e-6);
                        prop_assert!((d[16 * t + l] as f64 - want).abs() / mag < 1e-5, "{isa}: dots_16[{t}][{l}]");
                    }
                }
                let mut y = y0.clone();
                weighted_sum_16(isa, &wt, &rows, &mut y, width);
                prop_assert_eq!(y.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), plain_y.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), "{}: weighted_sum_16's bits", isa);
                for l in 0..outputs {
                    for k in 0..width {
                        let terms = || rows.iter().enumerate().map(|(t, r)| wt[16 * t + l] as f64 * r[k] as f64);
                        let want = y0[l * width + k] as f64 + terms().sum::<f64>();
                        let mag = y0[l * width + k].abs() as f64 + terms().map(f64::abs).sum::<f64>() + 1e-6;
                        prop_assert!((y[l * width + k] as f64 - want).abs() / mag < 1e-5, "{isa}: weighted_sum_16[{l}][{k}]");
                    }
                }
            }
        }
    }
}
