//! duplex-model: the models Duplex runs, each written once.
//!
//! Loads Hugging Face checkpoints of the DeepSeek-V3, Qwen3-MoE and Mixtral
//! families (memory-mapped safetensors, FP8 block-scaled or BF16/F16/F32)
//! into named modules, runs the one forward program (`forward`: MLA or
//! grouped-query attention over a paged KV cache, dense or MoE FFNs) on a
//! backend (`cpu`, or a device through `staged`) and generates, sampling with the
//! request-text side of `duplex-text` (tokenizer, chat template, sampler,
//! stop strings), re-exported here under its old paths. Numerics live in
//! `duplex-kernels`; this crate knows the model and nothing of SIMD.

pub mod backend;
pub mod checkpoint;
pub mod config;
pub mod cpu;
pub mod device_experts;
pub mod forward;
pub mod gguf;
pub mod generation;
pub mod hybrid;
pub mod kv_cache;
pub mod model;
pub mod moe;
pub mod ranked;
pub mod rope;
pub mod source;
pub mod staged;
pub mod weights;

pub use duplex_text::{bundled_model, bundled_model_candidates, check_model_dir, BUNDLED_MODEL};
pub use config::ModelConfig;
pub use kv_cache::{BlockTable, KvPool};
pub use model::{ForwardTimings, Logits, Model, Precision, SeqInput};
// The request-text side lives in `duplex-text`; here under its old paths.
pub use duplex_text::{sampling, stop, tokenizer, StopStrings};
