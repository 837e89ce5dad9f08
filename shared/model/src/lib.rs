//! duplex-model: one correct engine for the DeepSeek-V3 architecture.
//!
//! Loads Hugging Face checkpoints (memory-mapped safetensors, FP8 block-scaled
//! or BF16/F16/F32), runs the forward pass (MLA attention over a paged latent
//! KV cache, group-limited MoE routing), samples tokens and handles the
//! tokenizer and chat template. Numerics live in `duplex-kernels`; this crate
//! knows the model and nothing of SIMD.

pub mod sampling;
pub mod tokenizer;
