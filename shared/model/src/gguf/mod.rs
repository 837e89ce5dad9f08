//! Models stored as GGUF (llama.cpp's format): what llama.cpp's architecture
//! names, metadata keys and tensor layouts mean for Duplex. The container
//! itself is `duplex-gguf`'s.
//!
//! - [`deepseek2`]: DeepSeek-V2/V3/R1 and Kimi-K2 (`deepseek2`).

pub mod deepseek2;

pub use duplex_gguf::{split_file_name, types, vocab, GgmlType, Gguf, GgufError, GgufPart, Metadata, TensorInfo, Value, ValueType};
