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

/// The tiny DeepSeek-V3 checkpoint bundled with the sources, where this
/// crate was built: for tests and tools that run inside the source tree. A
/// binary finds it at run time with [`bundled_model`].
pub const BUNDLED_MODEL: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/fixtures/tiny-dsv3");

/// Where the bundled model is looked for, in order: beside the executable
/// (`<dir>/tests/fixtures/tiny-dsv3` or an installed `<dir>/share/duplex/tiny-dsv3`
/// for each of the executable's first few parent directories, which covers
/// `target/{debug,release}/duplex` in a checkout and `bin/duplex` under an
/// install prefix), then above the working directory, then where the
/// sources were at build time.
pub fn bundled_model_candidates() -> Vec<std::path::PathBuf> {
    const PLACES: [&str; 2] = ["tests/fixtures/tiny-dsv3", "share/duplex/tiny-dsv3"];
    let mut roots: Vec<std::path::PathBuf> = vec![];
    if let Ok(exe) = std::env::current_exe() {
        let real = std::fs::canonicalize(&exe).unwrap_or(exe.clone());
        for e in [exe, real] {
            roots.extend(e.ancestors().skip(1).take(5).map(std::path::Path::to_path_buf));
        }
    }
    if let Ok(cwd) = std::env::current_dir() {
        roots.extend(cwd.ancestors().map(std::path::Path::to_path_buf));
    }
    let mut out: Vec<std::path::PathBuf> = roots.iter().flat_map(|r| PLACES.iter().map(move |p| r.join(p))).collect();
    out.push(std::path::PathBuf::from(BUNDLED_MODEL));
    let mut seen = std::collections::HashSet::new();
    out.retain(|p| seen.insert(p.clone()));
    out
}

/// Every command's default model, so that a fresh clone runs without a
/// download: the first of [`bundled_model_candidates`] that holds a
/// `config.json`, or (none does) the build-time path, which
/// [`check_model_dir`] then explains.
pub fn bundled_model() -> std::path::PathBuf {
    bundled_model_candidates().into_iter().find(|p| p.join("config.json").is_file()).unwrap_or_else(|| std::path::PathBuf::from(BUNDLED_MODEL))
}

/// A clear error when `dir` holds no `config.json`, saying where the
/// bundled model was looked for when `dir` is that default.
pub fn check_model_dir(dir: &std::path::Path) -> Result<(), String> {
    if dir.join("config.json").is_file() {
        return Ok(());
    }
    let mut msg = format!("{} is not a model directory (it has no config.json)", dir.display());
    if dir == std::path::Path::new(BUNDLED_MODEL) {
        let looked: Vec<String> = bundled_model_candidates().iter().map(|p| p.display().to_string()).collect();
        msg.push_str(&format!("; the bundled tiny model was looked for in: {}. Pass --model DIR", looked.join(", ")));
    }
    Err(msg)
}

pub use config::ModelConfig;
pub use kv_cache::{BlockTable, KvPool};
pub use model::{ForwardTimings, Logits, Model, Precision, SeqInput};
pub use stop::StopStrings;
