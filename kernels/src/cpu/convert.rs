//! F32 → BF16 conversion of activations, bit-exact with `half::bf16::from_f32`:
//! round to nearest, ties to even; NaN stays NaN (quiet bit set, payload's
//! top bits kept); f32 subnormals round like any other value.

use super::isa::Isa;

/// Convert `src` to BF16 bit patterns in `dst` (same length).
pub fn f32_to_bf16(isa: Isa, src: &[f32], dst: &mut [u16]) {
    assert_eq!(src.len(), dst.len(), "f32_to_bf16: length mismatch");
    let done = match isa.usable() {
        Isa::Portable => 0,
        // SAFETY: `usable()` guarantees the CPU has the features each path enables.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { x86::avx2(src, dst) },
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { x86::avx512(src, dst) },
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512Bf16 | Isa::Avx512Fp16 => unsafe { x86::avx512bf16(src, dst) },
        #[cfg(not(target_arch = "x86_64"))]
        _ => 0,
    };
    for (d, &s) in dst[done..].iter_mut().zip(&src[done..]) {
        *d = half::bf16::from_f32(s).to_bits();
    }
}

#[cfg(target_arch = "x86_64")]
pub(super) mod x86 {
    use std::arch::x86_64::*;

    /// The BF16 bits of 16 floats (given as bits), in the low halves of the
    /// lanes (the high halves zero), with integer ops: add 0x7fff plus the
    /// lsb of the kept half, then truncate; NaN lanes keep their top bits +
    /// quiet bit.
    #[inline]
    #[target_feature(enable = "avx512f")]
    pub(in crate::cpu) fn round_lanes(x: __m512i) -> __m512i {
        let lsb = _mm512_and_si512(_mm512_srli_epi32::<16>(x), _mm512_set1_epi32(1));
        let bias = _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff));
        let rounded = _mm512_srli_epi32::<16>(_mm512_add_epi32(x, bias));
        let magnitude = _mm512_and_si512(x, _mm512_set1_epi32(0x7fff_ffff));
        let nan = _mm512_cmpgt_epu32_mask(magnitude, _mm512_set1_epi32(0x7f80_0000));
        let quiet = _mm512_or_si512(_mm512_srli_epi32::<16>(x), _mm512_set1_epi32(0x40));
        _mm512_mask_mov_epi32(rounded, nan, quiet)
    }

    /// [`round_lanes`], packed into sixteen words.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    fn round16(x: __m512i) -> __m256i {
        _mm512_cvtepi32_epi16(round_lanes(x))
    }

    /// Returns how many leading elements were converted.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    pub(super) unsafe fn avx512(src: &[f32], dst: &mut [u16]) -> usize {
        let n = src.len() / 16 * 16;
        for i in (0..n).step_by(16) {
            // SAFETY: i + 16 <= n <= len of both slices.
            unsafe {
                let x = _mm512_loadu_si512(src.as_ptr().add(i).cast());
                _mm256_storeu_si256(dst.as_mut_ptr().add(i).cast(), round16(x));
            }
        }
        n
    }

    /// `vcvtne2ps2bf16` rounds exactly like `half`, except that it treats
    /// subnormal inputs as zero; lanes with a zero exponent are redone with
    /// the integer rounding (rare in activations, so it costs one test).
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
    pub(super) unsafe fn avx512bf16(src: &[f32], dst: &mut [u16]) -> usize {
        let n = src.len() / 32 * 32;
        let exponent = _mm512_set1_epi32(0x7f80_0000);
        for i in (0..n).step_by(32) {
            // SAFETY: i + 32 <= n <= len of both slices.
            unsafe {
                let lo = _mm512_loadu_ps(src.as_ptr().add(i));
                let hi = _mm512_loadu_ps(src.as_ptr().add(i + 16));
                let mut r: __m512i = std::mem::transmute(_mm512_cvtne2ps_pbh(hi, lo));
                let small_lo = _mm512_testn_epi32_mask(_mm512_castps_si512(lo), exponent);
                let small_hi = _mm512_testn_epi32_mask(_mm512_castps_si512(hi), exponent);
                let small = (small_lo as u32) | ((small_hi as u32) << 16);
                if small != 0 {
                    let exact = _mm512_inserti64x4::<1>(
                        _mm512_castsi256_si512(round16(_mm512_castps_si512(lo))),
                        round16(_mm512_castps_si512(hi)),
                    );
                    r = _mm512_mask_mov_epi16(r, small, exact);
                }
                _mm512_storeu_si512(dst.as_mut_ptr().add(i).cast(), r);
            }
        }
        n
    }

    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn avx2(src: &[f32], dst: &mut [u16]) -> usize {
        #[inline]
        #[target_feature(enable = "avx2")]
        fn round8(x: __m256i) -> __m256i {
            let lsb = _mm256_and_si256(_mm256_srli_epi32::<16>(x), _mm256_set1_epi32(1));
            let bias = _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff));
            let rounded = _mm256_srli_epi32::<16>(_mm256_add_epi32(x, bias));
            let magnitude = _mm256_and_si256(x, _mm256_set1_epi32(0x7fff_ffff));
            // Both sides are non-negative as i32, so the signed compare is exact.
            let nan = _mm256_cmpgt_epi32(magnitude, _mm256_set1_epi32(0x7f80_0000));
            let quiet = _mm256_or_si256(_mm256_srli_epi32::<16>(x), _mm256_set1_epi32(0x40));
            _mm256_blendv_epi8(rounded, quiet, nan)
        }
        let n = src.len() / 16 * 16;
        for i in (0..n).step_by(16) {
            // SAFETY: i + 16 <= n <= len of both slices.
            unsafe {
                let a = round8(_mm256_loadu_si256(src.as_ptr().add(i).cast()));
                let b = round8(_mm256_loadu_si256(src.as_ptr().add(i + 8).cast()));
                // packus interleaves 128-bit lanes: [a0..3 b0..3 a4..7 b4..7].
                let packed = _mm256_permute4x64_epi64::<0b11_01_10_00>(_mm256_packus_epi32(a, b));
                _mm256_storeu_si256(dst.as_mut_ptr().add(i).cast(), packed);
            }
        }
        n
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::isa;
    use proptest::prelude::*;

    fn check(isa: Isa, src: &[f32]) {
        let mut got = vec![0u16; src.len()];
        f32_to_bf16(isa, src, &mut got);
        for (i, (&s, &g)) in src.iter().zip(&got).enumerate() {
            let want = half::bf16::from_f32(s).to_bits();
            assert_eq!(g, want, "{isa}: element {i}: {:#010x} -> {g:#06x}, want {want:#06x}", s.to_bits());
        }
    }

    /// Every upper half (sign, exponent, top mantissa bits) combined with the
    /// lower halves that decide rounding: zero, tie, just below/above a tie,
    /// all ones, and a pseudo-random one.
    #[test]
    fn all_upper_halves_match_half() {
        let lows = [0u32, 1, 0x7fff, 0x8000, 0x8001, 0xffff, 0x1234, 0xc001];
        let src: Vec<f32> = (0..=0xffffu32)
            .flat_map(|hi| lows.iter().map(move |&lo| f32::from_bits(hi << 16 | lo)))
            .collect();
        for isa in isa::supported() {
            check(isa, &src);
        }
    }

    proptest! {
        #[test]
        fn random_bits_match_half(bits in prop::collection::vec(any::<u32>(), 0..200)) {
            let src: Vec<f32> = bits.into_iter().map(f32::from_bits).collect();
            for isa in isa::supported() {
                check(isa, &src);
            }
        }
    }
}
