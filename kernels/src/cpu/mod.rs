//! Explicit SIMD kernels for decode on CPU, one file per concern.
//!
//! Every entry point takes an [`Isa`] level (normally [`isa::detect()`]) and
//! clamps it to what the CPU supports, so they are safe to call with any
//! level; all `unsafe` SIMD code stays inside this module. The portable level
//! is the scalar reference in `crate::linear`, which the tests compare every
//! other level against.
//!
//! - [`isa`]: level detection and the `DUPLEX_ISA` override.
//! - [`gemv`]: FP8/BF16 linear layers with BF16 activations (the hot path),
//!   plus the f32 `dot`/`axpy` used by attention.
//! - [`convert`]: f32 → BF16 rounding of activations.
//! - [`elementwise`]: RMSNorm (optionally rounding to BF16), rotary
//!   embedding, SiLU·up, softmax, and the router's sigmoid scores and top-k.
//! - [`bandwidth`]: a streaming read, to measure what "memory-bound" means here.
//! - [`vector`], [`vector_pairs`]: the blocked scores and weighted sums of
//!   decode attention, in f32 and on BF16 pairs (`vdpbf16ps`).
//! - [`amx`]: AMX tiles: detection, Linux's permission, and the tile
//!   instructions on the CPU or on a model of them (for `quant`'s tile GEMM,
//!   `gemm_amx`'s FP8/BF16 prefill products and [`pairs_amx`]'s decode
//!   attention products).

pub mod amx;
pub mod bandwidth;
pub mod convert;
pub mod elementwise;
#[cfg(target_arch = "x86_64")]
mod elementwise_avx2;
#[cfg(target_arch = "x86_64")]
mod elementwise_avx512;
#[cfg(target_arch = "x86_64")]
mod gemm_amx;
pub mod gemv;
#[cfg(target_arch = "x86_64")]
mod gemv_avx2;
#[cfg(target_arch = "x86_64")]
mod gemv_avx512;
pub mod isa;
pub mod pairs_amx;
#[cfg(target_arch = "x86_64")]
pub(crate) mod kernel;
#[cfg(target_arch = "x86_64")]
mod pack;
pub mod vector;
pub mod vector_pairs;

pub use bandwidth::read_bytes;
pub use convert::f32_to_bf16;
pub use gemv::{axpy_f32, dot_f32, matmul_bf16};
pub use isa::Isa;
