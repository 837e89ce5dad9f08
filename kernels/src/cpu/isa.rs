//! Which SIMD instruction-set level the CPU kernels run at.
//!
//! Levels are ordered: each one implies everything below it, so "lowering" a
//! level (through `DUPLEX_ISA` or by passing a smaller [`Isa`] to a kernel) is
//! always safe. Kernels clamp whatever level they are given to what the CPU
//! supports ([`Isa::usable`]), so a caller can never reach an instruction the
//! hardware lacks, even by passing `Isa::Avx512Bf16` on an AVX2 machine.
//!
//! AMX is deliberately not a level: the deployment targets (AMD Zen 4) have
//! AVX-512 with BF16 but no AMX. AVX512-FP16 (Intel Sapphire Rapids and
//! later, including the Xeon W workstations) is a level of its own, above
//! BF16: only the decode GEMV uses it (see `gemv_avx512`), everything else
//! runs its `Avx512Bf16` code there. It is never chosen by default: its
//! half-precision products fall short of the BF16 quality gates on some
//! prompts (a held-back DeepSeek-family prompt loses one top-1 token too
//! many), so it runs only where `DUPLEX_ISA=avx512fp16` asks for it.

use std::fmt;
use std::str::FromStr;
use std::sync::OnceLock;

/// A SIMD level. `Ord` follows capability:
/// `Portable < Avx2 < Avx512 < Avx512Bf16 < Avx512Fp16`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Isa {
    /// Plain Rust, any target.
    Portable,
    /// x86-64 AVX2 + FMA (+ F16C, which every AVX2/FMA CPU has).
    Avx2,
    /// AVX-512 F + BW + VL.
    Avx512,
    /// [`Isa::Avx512`] plus AVX512_BF16 (`vdpbf16ps`, `vcvtne2ps2bf16`).
    Avx512Bf16,
    /// [`Isa::Avx512Bf16`] plus AVX512_FP16 (`vfmadd231ph`).
    Avx512Fp16,
}

impl Isa {
    /// Every level, lowest first.
    pub const ALL: [Isa; 5] = [Isa::Portable, Isa::Avx2, Isa::Avx512, Isa::Avx512Bf16, Isa::Avx512Fp16];

    /// The lower-case name used by `DUPLEX_ISA` and [`FromStr`].
    pub fn name(self) -> &'static str {
        match self {
            Isa::Portable => "portable",
            Isa::Avx2 => "avx2",
            Isa::Avx512 => "avx512",
            Isa::Avx512Bf16 => "avx512bf16",
            Isa::Avx512Fp16 => "avx512fp16",
        }
    }

    /// `self`, lowered to the best level this CPU can actually execute.
    #[inline]
    pub fn usable(self) -> Isa {
        self.min(hardware())
    }
}

impl fmt::Display for Isa {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Error for an unrecognised ISA name.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParseIsaError(String);

impl fmt::Display for ParseIsaError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "unknown ISA level {:?} (expected portable, avx2, avx512, avx512bf16 or avx512fp16)", self.0)
    }
}

impl std::error::Error for ParseIsaError {}

impl FromStr for Isa {
    type Err = ParseIsaError;

    fn from_str(s: &str) -> Result<Isa, ParseIsaError> {
        let s = s.trim();
        Isa::ALL
            .into_iter()
            .find(|isa| isa.name().eq_ignore_ascii_case(s))
            .ok_or_else(|| ParseIsaError(s.to_string()))
    }
}

/// The best level the hardware supports, ignoring `DUPLEX_ISA`.
pub fn hardware() -> Isa {
    static HARDWARE: OnceLock<Isa> = OnceLock::new();
    *HARDWARE.get_or_init(probe)
}

#[cfg(target_arch = "x86_64")]
fn probe() -> Isa {
    use std::arch::is_x86_feature_detected as has;
    let avx2 = has!("avx2") && has!("fma") && has!("f16c");
    let avx512 = avx2 && has!("avx512f") && has!("avx512bw") && has!("avx512vl");
    let bf16 = avx512 && has!("avx512bf16");
    match (avx2, avx512, bf16, bf16 && has!("avx512fp16")) {
        (.., true) => Isa::Avx512Fp16,
        (_, _, true, _) => Isa::Avx512Bf16,
        (_, true, ..) => Isa::Avx512,
        (true, ..) => Isa::Avx2,
        _ => Isa::Portable,
    }
}

#[cfg(not(target_arch = "x86_64"))]
fn probe() -> Isa {
    Isa::Portable
}

/// The best level chosen without being asked for: the hardware's, but at
/// most [`Isa::Avx512Bf16`] (see the module comment on AVX512-FP16).
pub const DEFAULT_MAX: Isa = Isa::Avx512Bf16;

/// The level the kernels should run at: the hardware's best up to
/// [`DEFAULT_MAX`], or what the `DUPLEX_ISA` environment variable asks for
/// (which may lower it, or name the opt-in AVX512-FP16 level). A request
/// above what the CPU supports is clamped; an unknown value is reported once
/// on stderr and ignored. Read once per process.
pub fn detect() -> Isa {
    static DETECTED: OnceLock<Isa> = OnceLock::new();
    *DETECTED.get_or_init(|| resolve(std::env::var("DUPLEX_ISA").ok().as_deref(), hardware()))
}

/// Apply an override string to the hardware level (split out for testing).
fn resolve(request: Option<&str>, hw: Isa) -> Isa {
    let default = hw.min(DEFAULT_MAX);
    match request.map(str::trim).filter(|s| !s.is_empty()) {
        None => default,
        Some(s) => match s.parse::<Isa>() {
            Ok(isa) => isa.min(hw),
            Err(e) => {
                eprintln!("duplex: ignoring DUPLEX_ISA: {e}; using {default}");
                default
            }
        },
    }
}

/// Every level this CPU can run, lowest first (what the tests iterate over).
pub fn supported() -> Vec<Isa> {
    Isa::ALL.into_iter().filter(|&isa| isa <= hardware()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for isa in Isa::ALL {
            assert_eq!(isa.name().parse::<Isa>(), Ok(isa));
            assert_eq!(isa.to_string(), isa.name());
        }
        assert_eq!(" AVX512BF16 ".parse::<Isa>(), Ok(Isa::Avx512Bf16));
        assert_eq!("avx512fp16".parse::<Isa>(), Ok(Isa::Avx512Fp16));
        assert!("sse2".parse::<Isa>().is_err());
    }

    #[test]
    fn override_only_lowers() {
        assert_eq!(resolve(None, Isa::Avx512), Isa::Avx512);
        assert_eq!(resolve(Some(""), Isa::Avx512), Isa::Avx512);
        assert_eq!(resolve(Some("avx2"), Isa::Avx512), Isa::Avx2);
        assert_eq!(resolve(Some("portable"), Isa::Avx512Bf16), Isa::Portable);
        // Asking for more than the hardware has is clamped.
        assert_eq!(resolve(Some("avx512bf16"), Isa::Avx2), Isa::Avx2);
        assert_eq!(resolve(Some("avx512bf16"), Isa::Avx512Fp16), Isa::Avx512Bf16);
        // Unknown values are ignored.
        assert_eq!(resolve(Some("neon"), Isa::Avx512), Isa::Avx512);
        // AVX512-FP16 only when asked for.
        assert_eq!(resolve(None, Isa::Avx512Fp16), Isa::Avx512Bf16);
        assert_eq!(resolve(Some("neon"), Isa::Avx512Fp16), Isa::Avx512Bf16);
        assert_eq!(resolve(Some("avx512fp16"), Isa::Avx512Fp16), Isa::Avx512Fp16);
    }

    #[test]
    fn supported_is_a_prefix_ending_at_hardware() {
        let s = supported();
        assert_eq!(s[0], Isa::Portable);
        assert_eq!(*s.last().unwrap(), hardware());
        assert_eq!(s, Isa::ALL[..s.len()]);
        assert!(detect() <= hardware());
        for isa in Isa::ALL {
            assert!(isa.usable() <= hardware());
        }
    }
}
