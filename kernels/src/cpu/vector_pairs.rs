//! BF16 pair forms of [`super::vector`]'s blocked attention kernels, for
//! `vdpbf16ps`: [`dots_16_pairs`] and [`weighted_sum_16_pairs`].
//!
//! `vdpbf16ps` multiplies sixteen pairs of BF16 values by sixteen others
//! and adds both exact products of each pair into an f32 lane: twice the
//! multiply-adds of an f32 FMA per instruction. Where it issues as often
//! as a 512-bit FMA (Zen 4: once a cycle) the products take half the time.
//! Operands that are BF16 values already (the BF16 path rounds every
//! activation, the cached latents included) lose nothing on the way.
//!
//! Operands are pairs: two BF16 words in a `u32`, the first in the low
//! half, paired along the summed axis ([`pack_pairs`] pairs neighbours in a
//! row, [`pack_row_pairs`] the same element of two rows). The portable
//! form of a pair's product is [`pair_madd`]: the order the instruction's
//! definition gives. The hardware need not keep it (Zen 4 does, bit for
//! bit), so the SIMD level is checked against it within f32 rounding of
//! the sums.

use super::isa::Isa;

/// `a` and `b` rounded to BF16 (to nearest, ties to even, as `half`) in
/// one pair, `a` in the low half.
#[inline]
pub fn pair(a: f32, b: f32) -> u32 {
    u32::from(half::bf16::from_f32(a).to_bits()) | u32::from(half::bf16::from_f32(b).to_bits()) << 16
}

/// The f32 values of a pair's halves (exact): (low, high).
#[inline]
fn halves(p: u32) -> (f32, f32) {
    (f32::from_bits(p << 16), f32::from_bits(p & 0xffff_0000))
}

/// `acc` plus the products of two pairs' halves, as `vdpbf16ps` is defined:
/// the high halves' product first, then the low halves'; each product of
/// BF16 values is exact in f32, each addition rounds.
#[inline]
pub fn pair_madd(acc: f32, a: u32, b: u32) -> f32 {
    let ((a0, a1), (b0, b1)) = (halves(a), halves(b));
    (acc + a1 * b1) + a0 * b0
}

/// `dst[i] = pair(src[2i], src[2i + 1])`, the last pair of an odd-length
/// `src` completed with zero.
pub fn pack_pairs(isa: Isa, src: &[f32], dst: &mut [u32]) {
    assert_eq!(dst.len(), src.len().div_ceil(2), "pack_pairs: one pair per two floats");
    let even = src.len() / 2 * 2;
    if cfg!(target_endian = "little") {
        // SAFETY: `dst` holds `even / 2` u32s, i.e. `even` u16s at a
        // stricter alignment; on a little-endian target the first u16 of a
        // u32 is its low half, where a pair keeps its first element.
        let words = unsafe { std::slice::from_raw_parts_mut(dst.as_mut_ptr().cast::<u16>(), even) };
        super::convert::f32_to_bf16(isa, &src[..even], words);
    } else {
        dst.iter_mut().zip(src.chunks_exact(2)).for_each(|(d, s)| *d = pair(s[0], s[1]));
    }
    if even < src.len() {
        dst[even / 2] = pair(src[even], 0.0);
    }
}

/// `dst[k] = pair(a[k], b[k])`: two rows interleaved, so that the pairs
/// run across the rows (rows `2j`, `2j + 1` of a block, for a sum over rows).
pub fn pack_row_pairs(isa: Isa, a: &[f32], b: &[f32], dst: &mut [u32]) {
    assert!(a.len() == b.len() && dst.len() == a.len(), "pack_row_pairs: lengths");
    match isa.usable() {
        // SAFETY: `usable()` guarantees the features; the lengths are checked above.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 | Isa::Avx512Bf16 | Isa::Avx512Fp16 => unsafe { x86::pack_row_pairs_avx512(a, b, dst) },
        _ => dst.iter_mut().zip(a.iter().zip(b)).for_each(|(d, (&a, &b))| *d = pair(a, b)),
    }
}

/// [`dots_16`](super::vector::dots_16) on pairs:
/// `out[t · 16 + l] = Σ_i qt[i · 16 + l] ⊙ keys[t · d + i]` for `d =
/// qt.len() / 16` pairs per key, the keys one after another in `keys`, and
/// ⊙ a pair's two products. Each lane sums in order of `i`.
///
/// `ahead` are rows that will be read next (the next keys, as f32 before
/// their packing): row p's first `2 · d` floats are fetched into cache
/// along key p's chain, so that their reads from DRAM overlap the products
/// (a hint; rows past the keys' count are not fetched).
pub fn dots_16_pairs(isa: Isa, qt: &[u32], keys: &[u32], ahead: &[&[f32]], out: &mut [f32]) {
    const L: usize = super::vector::QUERY_LANES;
    let d = qt.len() / L;
    assert!(qt.len() == d * L && d > 0 && keys.len().is_multiple_of(d), "dots_16_pairs: shapes");
    assert_eq!(out.len(), keys.len() / d * L, "dots_16_pairs: one row of outputs per key");
    match isa.usable() {
        // SAFETY: `usable()` guarantees the features; the shapes are checked above.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512Bf16 | Isa::Avx512Fp16 => unsafe { x86::dots_16_pairs_avx512(qt, keys, ahead, out) },
        _ => {
            let _ = ahead;
            for (key, out) in keys.chunks_exact(d).zip(out.chunks_exact_mut(L)) {
                out.fill(0.0);
                for (&k, q) in key.iter().zip(qt.chunks_exact(L)) {
                    out.iter_mut().zip(q).for_each(|(o, &q)| *o = pair_madd(*o, q, k));
                }
            }
        }
    }
}

/// [`weighted_sum_16`](super::vector::weighted_sum_16) on pairs of rows:
/// `out[l] += Σ_j wt[j · 16 + l] ⊙ rows[j]` for the `out.len() / width`
/// (at most 16) outputs of `width` floats, where `rows` holds the row
/// pairs one after another (`[pairs][width]`, from [`pack_row_pairs`]) and
/// `wt[j · 16 + l]` output l's weights of the same two rows. Each output
/// sums in order of `j`.
pub fn weighted_sum_16_pairs(isa: Isa, wt: &[u32], rows: &[u32], out: &mut [f32], width: usize) {
    const L: usize = super::vector::QUERY_LANES;
    assert!(width > 0 && out.len().is_multiple_of(width) && out.len() / width <= L, "weighted_sum_16_pairs: out is not [≤ 16, width]");
    assert!(rows.len().is_multiple_of(width) && wt.len() == rows.len() / width * L, "weighted_sum_16_pairs: one row of weights per row pair");
    match isa.usable() {
        // SAFETY: as above; every row pair and output is `width` long.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512Bf16 | Isa::Avx512Fp16 => unsafe { x86::weighted_sum_16_pairs_avx512(wt, rows, out, width) },
        _ => {
            for (l, y) in out.chunks_exact_mut(width).enumerate() {
                for (w, row) in wt.chunks_exact(L).zip(rows.chunks_exact(width)) {
                    y.iter_mut().zip(row).for_each(|(y, &r)| *y = pair_madd(*y, w[l], r));
                }
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::super::convert::x86::round_lanes;
    use std::arch::x86_64::*;

    #[inline(always)]
    fn lanes(n: usize, i: usize) -> __mmask16 {
        if n - i >= 16 {
            !0
        } else {
            (1 << (n - i)) - 1
        }
    }

    /// Reinterpret sixteen pairs as the dot-product operand type.
    #[inline(always)]
    fn bh(v: __m512i) -> __m512bh {
        // SAFETY: both are 64-byte plain vectors; every bit pattern is valid.
        unsafe { std::mem::transmute::<__m512i, __m512bh>(v) }
    }

    /// # Safety
    /// AVX-512 F present; `a`, `b` and `dst` of one length.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn pack_row_pairs_avx512(a: &[f32], b: &[f32], dst: &mut [u32]) {
        let n = a.len();
        let mut i = 0;
        while i < n {
            let m = lanes(n, i);
            // SAFETY: the lanes under `m` lie inside all three slices.
            unsafe {
                let x = round_lanes(_mm512_maskz_loadu_epi32(m, a.as_ptr().add(i).cast()));
                let y = round_lanes(_mm512_maskz_loadu_epi32(m, b.as_ptr().add(i).cast()));
                _mm512_mask_storeu_epi32(dst.as_mut_ptr().add(i).cast(), m, _mm512_or_si512(x, _mm512_slli_epi32::<16>(y)));
            }
            i += 16;
        }
    }

    /// # Safety
    /// AVX-512 F and BF16 present; `qt` is `[d][16]`, `keys` `[n][d]`, `out` `[n][16]`.
    #[target_feature(enable = "avx512f,avx512bf16")]
    pub(super) unsafe fn dots_16_pairs_avx512(qt: &[u32], keys: &[u32], ahead: &[&[f32]], out: &mut [f32]) {
        // As `dots_16`: sixteen keys at a time (sixteen independent chains,
        // each query vector loaded feeding sixteen products), then four, then one.
        let d = qt.len() / 16;
        let n = keys.len() / d;
        let ahead = |t: usize, p: usize| ahead.get(t..(t + p).min(ahead.len())).unwrap_or(&[]);
        let mut t = 0;
        while t + 16 <= n {
            // SAFETY: forwarded; keys t..t + 16 exist.
            unsafe { dots_pairs_group::<16>(qt, &keys[t * d..(t + 16) * d], ahead(t, 16), &mut out[16 * t..16 * (t + 16)]) };
            t += 16;
        }
        while t + 4 <= n {
            // SAFETY: as above, four keys.
            unsafe { dots_pairs_group::<4>(qt, &keys[t * d..(t + 4) * d], ahead(t, 4), &mut out[16 * t..16 * (t + 4)]) };
            t += 4;
        }
        for t in t..n {
            // SAFETY: as above, one key.
            unsafe { dots_pairs_group::<1>(qt, &keys[t * d..(t + 1) * d], ahead(t, 1), &mut out[16 * t..16 * (t + 1)]) };
        }
    }

    /// # Safety
    /// As [`dots_16_pairs_avx512`], with exactly `P` keys and at most `P`
    /// rows `ahead`.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bf16")]
    unsafe fn dots_pairs_group<const P: usize>(qt: &[u32], keys: &[u32], ahead: &[&[f32]], out: &mut [f32]) {
        let d = qt.len() / 16;
        let mut acc = [_mm512_setzero_ps(); P];
        for i in 0..d {
            if i % 8 == 0 {
                // Eight pairs a line of 16 floats: a row of 2 · d floats
                // is fetched by the end of the chain.
                for row in ahead {
                    if 2 * i < row.len() {
                        // Only a hint, never a fault; the line is inside the row.
                        _mm_prefetch::<_MM_HINT_T0>(row.as_ptr().wrapping_add(2 * i).cast());
                    }
                }
            }
            // SAFETY: i < d: qt holds 16 · d pairs and keys P · d.
            unsafe {
                let q = bh(_mm512_loadu_si512(qt.as_ptr().add(16 * i).cast()));
                for (p, acc) in acc.iter_mut().enumerate() {
                    *acc = _mm512_dpbf16_ps(*acc, q, bh(_mm512_set1_epi32(*keys.as_ptr().add(p * d + i) as i32)));
                }
            }
        }
        for (p, acc) in acc.iter().enumerate() {
            // SAFETY: out holds 16 · P floats.
            unsafe { _mm512_storeu_ps(out.as_mut_ptr().add(16 * p), *acc) };
        }
    }

    /// # Safety
    /// AVX-512 F and BF16 present; `wt` is `[pairs][16]`, `rows` `[pairs][width]`
    /// and `out` `[out.len() / width ≤ 16][width]`.
    #[target_feature(enable = "avx512f,avx512bf16")]
    pub(super) unsafe fn weighted_sum_16_pairs_avx512(wt: &[u32], rows: &[u32], out: &mut [f32], width: usize) {
        // As `weighted_sum_16`: only the outputs there are (rounded up to a
        // power of two), over as many vectors of the width as fill sixteen
        // accumulators.
        // SAFETY (all arms): forwarded.
        unsafe {
            match out.len() / width {
                1 => weighted_pairs_n::<1, 16>(wt, rows, out, width),
                2 => weighted_pairs_n::<2, 8>(wt, rows, out, width),
                3..=4 => weighted_pairs_n::<4, 4>(wt, rows, out, width),
                5..=8 => weighted_pairs_n::<8, 2>(wt, rows, out, width),
                _ => weighted_pairs_n::<16, 1>(wt, rows, out, width),
            }
        }
    }

    /// `weighted_sum_16_pairs` for at most `N` outputs, `C` vectors of each
    /// at once (`N · C = 16` accumulators).
    ///
    /// # Safety
    /// As [`weighted_sum_16_pairs_avx512`], with at most `N` outputs.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bf16")]
    unsafe fn weighted_pairs_n<const N: usize, const C: usize>(wt: &[u32], rows: &[u32], out: &mut [f32], width: usize) {
        // One vector of every output per chunk in registers across all the
        // row pairs; per pair C loads and N broadcasts feed N · C products.
        // Lanes past the width load as zero and are never stored; outputs
        // past the last are computed and dropped.
        let outputs = out.len() / width;
        let po = out.as_mut_ptr();
        let pairs = rows.len() / width;
        let mut i = 0;
        while i < width {
            let m: [__mmask16; C] = std::array::from_fn(|c| if i + 16 * c < width { lanes(width, i + 16 * c) } else { 0 });
            let mask = |l: usize, c: usize| if l < outputs { m[c] } else { 0 };
            // SAFETY: output l < outputs has lanes i + 16c.. under `m[c]`
            // inside it, as every row pair has; elsewhere the mask is empty
            // and nothing is touched.
            unsafe {
                let mut acc: [[__m512; C]; N] = std::array::from_fn(|l| std::array::from_fn(|c| _mm512_maskz_loadu_ps(mask(l, c), po.wrapping_add(l * width + i + 16 * c))));
                for j in 0..pairs {
                    let row = rows.as_ptr().add(j * width);
                    let r: [__m512bh; C] = std::array::from_fn(|c| bh(_mm512_maskz_loadu_epi32(m[c], row.wrapping_add(i + 16 * c).cast())));
                    let w = wt.as_ptr().add(16 * j);
                    for (l, acc) in acc.iter_mut().enumerate() {
                        let w = bh(_mm512_set1_epi32(*w.add(l) as i32));
                        for (acc, &r) in acc.iter_mut().zip(&r) {
                            *acc = _mm512_dpbf16_ps(*acc, r, w);
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
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::isa;
    use proptest::prelude::*;

    const L: usize = 16;

    /// BF16 values of either sign and a spread of magnitudes.
    fn bf16_values(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed | 1;
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                let unit = (s >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
                crate::round_bf16(unit * [0.01f32, 1.0, 30.0][(s % 3) as usize])
            })
            .collect()
    }

    /// Each level's sum `got` against the exact sum of the same products,
    /// within f32 rounding of a sum of `terms` products of magnitude `mag`.
    fn close(got: f32, exact: f64, mag: f64, terms: usize) -> bool {
        (got as f64 - exact).abs() <= mag * f32::EPSILON as f64 * (terms as f64 + 2.0)
    }

    #[test]
    fn pair_is_two_halves() {
        let p = pair(1.5, -2.25);
        assert_eq!(halves(p), (1.5, -2.25));
        // Rounded to nearest even, as `half`: 1 + 2⁻⁸ is a tie that stays at 1.
        assert_eq!(halves(pair(1.0 + 1.0 / 256.0, 1.0 + 3.0 / 256.0)), (1.0, 1.0 + 4.0 / 256.0));
        // The high halves' product is added first: 1 + 2⁻²⁴ rounds to 1,
        // and the low product −1 then leaves 0 (low first would leave 2⁻²⁴).
        let tiny = 2f32.powi(-12);
        assert_eq!(pair_madd(1.0, pair(-1.0, tiny), pair(1.0, tiny)), 0.0);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]

        /// Both packings give `pair`'s bits on every level, NaN and
        /// infinities included, for any length.
        #[test]
        fn packings_round_as_half(n in 0usize..80, seed in any::<u64>()) {
            let mut a = bf16_values(n, seed).into_iter().map(|v| v * 1.003).collect::<Vec<_>>();
            let b = bf16_values(n, seed ^ 0x55).into_iter().map(|v| v / 3.0).collect::<Vec<_>>();
            if n > 3 {
                a[1] = f32::NAN;
                a[2] = f32::INFINITY;
                a[3] = -1e-40;
            }
            for isa in isa::supported() {
                let mut rows = vec![0u32; n];
                pack_row_pairs(isa, &a, &b, &mut rows);
                let want: Vec<u32> = a.iter().zip(&b).map(|(&a, &b)| pair(a, b)).collect();
                prop_assert_eq!(&rows, &want, "{} rows", isa);
                let mut pairs = vec![0u32; n.div_ceil(2)];
                pack_pairs(isa, &a, &mut pairs);
                let want: Vec<u32> = a.chunks(2).map(|c| pair(c[0], c.get(1).copied().unwrap_or(0.0))).collect();
                prop_assert_eq!(&pairs, &want, "{} pairs", isa);
            }
        }

        /// Scores for 1..40 keys (the kernel's groups of 16, 4 and 1) of up
        /// to 70 pairs: each level within f32 rounding of the exact sum.
        #[test]
        fn dots_match_exact_sums(keys in 1usize..40, d in 1usize..70, seed in any::<u64>()) {
            let q = bf16_values(2 * d * L, seed);
            let k = bf16_values(2 * d * keys, !seed);
            let mut qt = vec![0u32; d * L];
            for i in 0..d {
                for l in 0..L {
                    qt[i * L + l] = pair(q[(l * d + i) * 2], q[(l * d + i) * 2 + 1]);
                }
            }
            let mut kp = vec![0u32; d * keys];
            pack_pairs(Isa::Portable, &k, &mut kp);
            for isa in isa::supported() {
                let mut out = vec![f32::NAN; keys * L];
                dots_16_pairs(isa, &qt, &kp, &[], &mut out);
                for t in 0..keys {
                    for l in 0..L {
                        let terms = (0..2 * d).map(|e| q[(l * d + e / 2) * 2 + e % 2] as f64 * k[t * 2 * d + e] as f64);
                        let (exact, mag) = terms.fold((0.0, 0.0), |(s, m), x| (s + x, m + x.abs()));
                        prop_assert!(close(out[t * L + l], exact, mag, 2 * d), "{}: key {} lane {}: {} vs {}", isa, t, l, out[t * L + l], exact);
                    }
                }
            }
        }

        /// Weighted sums of 1..20 row pairs into 1..16 outputs (each of the
        /// kernel's N × C shapes), widths on and off the 16-lane vectors,
        /// added to what the outputs held: within f32 rounding of the exact sum.
        #[test]
        fn weighted_sums_match_exact_sums(pairs in 1usize..20, outputs in 1usize..=16, width in 1usize..90, seed in any::<u64>()) {
            let r = bf16_values(2 * pairs * width, seed);
            let w = bf16_values(2 * pairs * L, !seed);
            let start = bf16_values(outputs * width, seed ^ 7);
            let mut rows = vec![0u32; pairs * width];
            let mut wt = vec![0u32; pairs * L];
            for j in 0..pairs {
                let (r0, r1) = r[2 * j * width..(2 * j + 2) * width].split_at(width);
                pack_row_pairs(Isa::Portable, r0, r1, &mut rows[j * width..(j + 1) * width]);
                pack_row_pairs(Isa::Portable, &w[2 * j * L..(2 * j + 1) * L], &w[(2 * j + 1) * L..(2 * j + 2) * L], &mut wt[j * L..(j + 1) * L]);
            }
            for isa in isa::supported() {
                let mut out = start.clone();
                weighted_sum_16_pairs(isa, &wt, &rows, &mut out, width);
                for l in 0..outputs {
                    for k in 0..width {
                        let terms = (0..2 * pairs).map(|t| w[t * L + l] as f64 * r[t * width + k] as f64).chain([start[l * width + k] as f64]);
                        let (exact, mag) = terms.fold((0.0, 0.0), |(s, m), x| (s + x, m + x.abs()));
                        prop_assert!(close(out[l * width + k], exact, mag, 2 * pairs + 1), "{}: output {} element {}: {} vs {}", isa, l, k, out[l * width + k], exact);
                    }
                }
            }
        }
    }
}
