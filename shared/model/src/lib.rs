//! duplex-model: one correct engine for the DeepSeek-V3 architecture.
//!
//! Loads Hugging Face checkpoints (memory-mapped safetensors, FP8 block-scaled
//! or BF16/F16/F32), runs the forward pass (MLA attention over a paged latent
//! KV cache, group-limited MoE routing), samples tokens and handles the
//! tokenizer and chat template. Numerics live in `duplex-kernels`; this crate
//! knows the model and nothing of SIMD.

pub mod checkpoint;
pub mod config;
pub mod generation;
pub mod kv_cache;
pub mod model;
pub mod moe;
pub mod reference;
pub mod rope;
pub mod sampling;
pub mod staged;
pub mod stop;
pub mod synth;
pub mod tokenizer;

/// The tiny DeepSeek-V3 checkpoint bundled with the sources: every command's
/// default model, so that a fresh clone runs without a download.
pub const BUNDLED_MODEL: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/fixtures/tiny-dsv3");

pub use config::ModelConfig;
pub use kv_cache::{BlockTable, KvPool};
pub use model::{ForwardTimings, Logits, Model, Precision, SeqInput};
pub use stop::StopStrings;
