//! duplex-model: one correct engine for the DeepSeek-V3 architecture.
//!
//! Loads Hugging Face checkpoints (memory-mapped safetensors, FP8 block-scaled
//! or BF16/F16/F32), runs the forward pass (MLA attention over a paged latent
//! KV cache, group-limited MoE routing) and generates, sampling with the
//! request-text side of `duplex-text` (tokenizer, chat template, sampler,
//! stop strings), re-exported here under its old paths. Numerics live in
//! `duplex-kernels`; this crate knows the model and nothing of SIMD.

pub mod checkpoint;
pub mod config;
pub mod generation;
pub mod kv_cache;
pub mod model;
pub mod moe;
pub mod rope;
pub mod staged;

pub use duplex_text::{bundled_model, bundled_model_candidates, check_model_dir, BUNDLED_MODEL};
pub use config::ModelConfig;
pub use kv_cache::{BlockTable, KvPool};
pub use model::{ForwardTimings, Logits, Model, Precision, SeqInput};
// The request-text side lives in `duplex-text`; here under its old paths.
pub use duplex_text::{sampling, stop, tokenizer, StopStrings};
