//! FP8 E4M3FN ("fn": finite, no infinities) as used by DeepSeek-V3 checkpoints.
//!
//! Layout: 1 sign bit, 4 exponent bits (bias 7), 3 mantissa bits. Exponent 0
//! holds subnormals (m/8 · 2^-6); `S.1111.111` is NaN; there is no infinity,
//! so the largest finite magnitude is 448.

/// Decode one E4M3FN code exactly (every code is representable in f32 and BF16).
pub const fn e4m3_to_f32(code: u8) -> f32 {
    let sign = if code & 0x80 != 0 { -1.0f32 } else { 1.0f32 };
    let exp = ((code >> 3) & 0x0f) as i32;
    let man = (code & 0x07) as i32;
    if exp == 0x0f && man == 0x07 {
        return f32::NAN;
    }
    let magnitude = if exp == 0 {
        // Subnormal: m/8 * 2^(1-7).
        man as f32 / 8.0 / 64.0
    } else {
        let m = 1.0 + man as f32 / 8.0;
        let mut scale = 1.0f32;
        let mut e = exp - 7;
        while e > 0 {
            scale *= 2.0;
            e -= 1;
        }
        while e < 0 {
            scale *= 0.5;
            e += 1;
        }
        m * scale
    };
    sign * magnitude
}

const fn build_table() -> [f32; 256] {
    let mut table = [0.0f32; 256];
    let mut i = 0;
    while i < 256 {
        table[i] = e4m3_to_f32(i as u8);
        i += 1;
    }
    table
}

/// All 256 codes, decoded. Indexing this is the fast scalar decode.
pub static E4M3_TABLE: [f32; 256] = build_table();

#[cfg(test)]
mod tests {
    use super::*;

    /// Independent reference: decode by the IEEE-like formula with powf.
    fn reference(code: u8) -> f32 {
        let s = if code >> 7 == 1 { -1.0 } else { 1.0 };
        let e = (code >> 3) & 0xf;
        let m = code & 7;
        if e == 15 && m == 7 {
            return f32::NAN;
        }
        if e == 0 {
            s * (m as f32) * 2f32.powi(-9)
        } else {
            s * (1.0 + m as f32 / 8.0) * 2f32.powi(e as i32 - 7)
        }
    }

    #[test]
    fn all_codes_match_reference_table() {
        for code in 0..=255u8 {
            let got = E4M3_TABLE[code as usize];
            let want = reference(code);
            if want.is_nan() {
                assert!(got.is_nan(), "code {code:#04x} should be NaN");
            } else {
                assert_eq!(got.to_bits(), want.to_bits(), "code {code:#04x}");
            }
        }
    }

    #[test]
    fn special_values() {
        assert_eq!(E4M3_TABLE[0x00].to_bits(), 0.0f32.to_bits());
        assert_eq!(E4M3_TABLE[0x80].to_bits(), (-0.0f32).to_bits());
        assert!(E4M3_TABLE[0x7f].is_nan() && E4M3_TABLE[0xff].is_nan());
        assert_eq!(E4M3_TABLE[0x7e], 448.0);
        assert_eq!(E4M3_TABLE[0xfe], -448.0);
        assert_eq!(E4M3_TABLE[0x01], 2f32.powi(-9)); // smallest subnormal
        assert_eq!(E4M3_TABLE[0x07], 7.0 * 2f32.powi(-9)); // largest subnormal
        assert_eq!(E4M3_TABLE[0x08], 2f32.powi(-6)); // smallest normal
        assert_eq!(E4M3_TABLE[0x38], 1.0);
        assert_eq!(E4M3_TABLE[0xb8], -1.0);
        // Only two NaN codes; everything else is finite.
        assert_eq!(E4M3_TABLE.iter().filter(|v| v.is_nan()).count(), 2);
        assert!(E4M3_TABLE.iter().all(|v| v.is_nan() || v.is_finite()));
    }

    #[test]
    fn every_code_is_exact_in_bf16() {
        for v in E4M3_TABLE.iter().filter(|v| !v.is_nan()) {
            assert_eq!(crate::round_bf16(*v), *v);
        }
    }
}
