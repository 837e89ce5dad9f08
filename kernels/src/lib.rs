//! duplex-kernels: the numeric kernels of Duplex.
//!
//! Kernels know nothing of models. They take slices and shapes: weight formats
//! (FP8 E4M3 with block scales, BF16, F16, F32), the linear-layer products over
//! them, fused elementwise ops (RMSNorm, rotary embedding, SiLU·up, softmax),
//! router top-k and MLA attention. Everything has a plain scalar reference;
//! the SIMD variants in `cpu/` are chosen by CPU feature detection. `device/`
//! is the accelerator layer: the same kernel set behind one interface, on an
//! emulated accelerator or (feature `cuda`) a CUDA GPU.

pub mod clock;
pub mod cpu;
pub mod device;
pub mod elementwise;
pub mod fp8;
pub mod gqa;
pub mod linear;
pub mod mla;
pub mod moe;
pub mod parallel_linear;
pub mod pool;
pub mod quant;
pub mod router;
pub mod shared;

pub use linear::{WeightFormat, WeightView};

/// Round an f32 to the nearest BF16 value (ties to even) and back to f32.
#[inline]
pub fn round_bf16(x: f32) -> f32 {
    half::bf16::from_f32(x).to_f32()
}

/// Round every element of `xs` to BF16 precision in place.
pub fn round_bf16_slice(xs: &mut [f32]) {
    for x in xs {
        *x = round_bf16(*x);
    }
}

/// The numeric path of a model, chosen at run time.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum Precision {
    /// Everything in F32: the simple reference.
    F32,
    /// BF16 activations between ops, F32 accumulation; weights used as stored.
    #[default]
    Bf16,
}

impl Precision {
    /// Store `xs` as this precision stores activations.
    pub fn round(self, xs: &mut [f32]) {
        if self == Precision::Bf16 {
            round_bf16_slice(xs);
        }
    }
}

impl std::str::FromStr for Precision {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "f32" => Ok(Precision::F32),
            "bf16" => Ok(Precision::Bf16),
            _ => Err(format!("unknown dtype {s:?}; expected f32 or bf16")),
        }
    }
}

