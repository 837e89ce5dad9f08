//! duplex-kernels: the numeric kernels of Duplex.
//!
//! Kernels know nothing of models. They take slices and shapes: weight formats
//! (FP8 E4M3 with block scales, BF16, F16, F32), the linear-layer products over
//! them, and fused elementwise ops (RMSNorm, rotary embedding, SiLU·up,
//! softmax). Everything here has a plain scalar implementation that serves as
//! the reference for the SIMD variants that come later.

pub mod bench;
pub mod cpu;
pub mod elementwise;
pub mod fp8;
pub mod linear;
pub mod mla;
pub mod moe;
pub mod parallel_linear;
pub mod pool;
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
