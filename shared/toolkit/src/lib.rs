//! duplex-toolkit: what is built around the engine rather than into it, so
//! that the engine and the kernels carry no tooling:
//! - [`synth`]: synthetic checkpoints in the real Hugging Face layout;
//! - [`reference`]: the numerics gates against transformers' outputs, which
//!   every forward path's tests use;
//! - [`kernel_bench`]: the kernel benchmarks of `duplex bench-kernels`.

pub mod kernel_bench;
pub mod reference;
pub mod synth;
