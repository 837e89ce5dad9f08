//! duplex-text: the request-text side of Duplex, which the router needs
//! and the engine shares: the tokenizer and chat template, sampling
//! parameters and the sampler, stop strings, why a generation finished, the
//! served model's facts from its `config.json` and `generation_config.json`,
//! where the bundled model is, and tool calls in the model's own format
//! (rendered through its chat template, parsed back from its output). It
//! knows nothing of weights or kernels, so the router and the wire protocol
//! build without them.

pub mod sampling;
pub mod stop;
mod gguf;
mod tiktoken;
pub mod tokenizer;
pub mod tools;

pub use stop::StopStrings;

use sampling::SamplingParams;
use std::path::Path;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// A stop token or stop string.
    Stop,
    /// `max_tokens` or the context limit.
    Length,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
        }
    }
}

/// Whether a generation ends with the token just sampled: the one rule both
/// workers apply, each to the tokens it samples (the prefill worker to the
/// first, the decode worker to the rest), so that the worker that samples
/// the last token says so. Stop strings are text, and the router's.
#[derive(Clone, Debug, Default)]
pub struct FinishRule {
    /// Token ids that end generation, EOS included unless the client ignores it.
    pub stop_token_ids: std::collections::HashSet<u32>,
    pub max_tokens: usize,
    /// Positions one sequence may fill.
    pub context_length: usize,
}

impl FinishRule {
    /// Why generation ends with `token`, the `generated`-th token after a
    /// prompt of `prompt_len` tokens, if it does. The context is full when
    /// the token has no position left to be written at.
    pub fn check(&self, prompt_len: usize, generated: usize, token: u32) -> Option<FinishReason> {
        if self.stop_token_ids.contains(&token) {
            Some(FinishReason::Stop)
        } else if generated >= self.max_tokens || prompt_len + generated > self.context_length {
            Some(FinishReason::Length)
        } else {
            None
        }
    }
}

/// The model's recommended sampling defaults from `generation_config.json`
/// (as vLLM applies them): `do_sample: false` means greedy; `temperature`,
/// `top_p`, `top_k` and `repetition_penalty` are taken when present. A missing
/// or unreadable file gives plain defaults. `path` is a model path (see
/// [`duplex_gguf::locate`]): for a GGUF model the file is looked for beside
/// the GGUF file.
pub fn sampling_defaults(path: &Path) -> SamplingParams {
    let mut p = SamplingParams::default();
    let dir = match duplex_gguf::locate(path) {
        Ok(Some(file)) => gguf::parent_dir(&file),
        _ => path.to_path_buf(),
    };
    let Ok(text) = std::fs::read_to_string(dir.join("generation_config.json")) else {
        return p;
    };
    let Ok(json) = serde_json::from_str::<serde_json::Value>(&text) else {
        return p;
    };
    let num = |k: &str| json.get(k).and_then(|v| v.as_f64()).map(|v| v as f32);
    if let Some(t) = num("temperature") {
        p.temperature = t;
    }
    if let Some(t) = num("top_p") {
        p.top_p = t;
    }
    if let Some(k) = json.get("top_k").and_then(|v| v.as_u64()) {
        p.top_k = k as usize;
    }
    if let Some(r) = num("repetition_penalty") {
        p.repetition_penalty = r;
    }
    if json.get("do_sample").and_then(|v| v.as_bool()) == Some(false) {
        p.temperature = 0.0;
    }
    p
}

/// An id or a list of ids, as `eos_token_id` may be either.
pub fn parse_token_ids(v: &serde_json::Value) -> Option<Vec<u32>> {
    match v {
        serde_json::Value::Number(n) => n.as_u64().and_then(|x| u32::try_from(x).ok()).map(|x| vec![x]),
        serde_json::Value::Array(a) => a.iter().map(|x| x.as_u64().and_then(|x| u32::try_from(x).ok())).collect(),
        _ => None,
    }
}

/// What the router needs of a checkpoint's `config.json`: the vocabulary,
/// the context and the end-of-sequence ids. The engine reads the whole file
/// (`duplex_model::ModelConfig`); this reads only these, so that serving
/// text needs no model code.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServedConfig {
    pub vocab_size: usize,
    pub max_position_embeddings: usize,
    pub eos_token_ids: Vec<u32>,
}

#[derive(Debug, thiserror::Error)]
pub enum ServedConfigError {
    #[error("cannot read {path}: {source}")]
    Io { path: String, source: std::io::Error },
    #[error("{path}: {message}")]
    Invalid { path: String, message: String },
    /// A GGUF model's file or metadata (the error names both).
    #[error(transparent)]
    Gguf(#[from] duplex_gguf::GgufError),
}

impl ServedConfig {
    pub fn from_file(path: &Path) -> Result<Self, ServedConfigError> {
        let shown = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|source| ServedConfigError::Io { path: shown.clone(), source })?;
        let invalid = |message: String| ServedConfigError::Invalid { path: shown.clone(), message };
        let json: serde_json::Value = serde_json::from_str(&text).map_err(|e| invalid(e.to_string()))?;
        let count = |key: &str| {
            json.get(key).and_then(|v| v.as_u64()).and_then(|v| usize::try_from(v).ok()).filter(|&v| v > 0).ok_or_else(|| invalid(format!("{key} must be a positive integer")))
        };
        let eos_token_ids = match json.get("eos_token_id") {
            None | Some(serde_json::Value::Null) => vec![],
            Some(v) => parse_token_ids(v).ok_or_else(|| invalid("eos_token_id must be an integer or a list of integers".into()))?,
        };
        Ok(ServedConfig { vocab_size: count("vocab_size")?, max_position_embeddings: count("max_position_embeddings")?, eos_token_ids })
    }

    /// The facts of whatever a `--model` path names (see
    /// [`duplex_gguf::locate`]): a Hugging Face directory's `config.json`,
    /// or a GGUF model's metadata.
    pub fn from_model_path(path: &Path) -> Result<Self, ServedConfigError> {
        match duplex_gguf::locate(path)? {
            None => Self::from_file(&path.join("config.json")),
            Some(file) => Self::from_gguf(&duplex_gguf::Gguf::open(&file)?),
        }
    }

    /// A GGUF model's facts: the context is `{arch}.context_length` (the
    /// trained one, as `max_position_embeddings` is), the vocabulary
    /// `{arch}.vocab_size` or else the number of tokens, and the EOS ids
    /// `tokenizer.ggml.eos_token_id`, `eot_token_id` and `eom_token_id`.
    pub fn from_gguf(gguf: &duplex_gguf::Gguf) -> Result<Self, ServedConfigError> {
        let md = gguf.metadata();
        let arch_key = "general.architecture";
        let arch = md.require(arch_key, md.str(arch_key)?)?;
        let positive = |key: &str, v: Option<usize>| match v {
            Some(0) => Err(md.error(key, "must be positive".into())),
            v => md.require(key, v),
        };
        let context_key = format!("{arch}.context_length");
        let max_position_embeddings = positive(&context_key, md.usize(&context_key)?)?;
        let vocab = duplex_gguf::vocab::GgufVocab::from_metadata(md)?;
        let vocab_key = format!("{arch}.vocab_size");
        let vocab_size = positive(&vocab_key, md.usize(&vocab_key)?.or(Some(vocab.tokens.len())))?;
        let mut eos_token_ids: Vec<u32> = vocab.eos_token_id.into_iter().collect();
        for id in gguf::end_of_turn_ids(md, vocab.tokens.len())? {
            if !eos_token_ids.contains(&id) {
                eos_token_ids.push(id);
            }
        }
        Ok(ServedConfig { vocab_size, max_position_embeddings, eos_token_ids })
    }
}

/// Every id that ends a generation of the served model: the tokenizer's
/// set (`generation_config.json`'s `eos_token_id`, then `config.json`'s,
/// then `tokenizer_config.json`'s `eos_token`, in that order) and
/// `config`'s, without repeats. Qwen3 lists `[<|im_end|>, <|endoftext|>]`
/// in `generation_config.json` but only `<|im_end|>` in `config.json`;
/// transformers' `generate` stops on both.
pub fn served_eos_token_ids(tokenizer: &tokenizer::Tokenizer, config: &ServedConfig) -> Vec<u32> {
    let mut ids = tokenizer.eos_token_ids().to_vec();
    for &id in &config.eos_token_ids {
        if !ids.contains(&id) {
            ids.push(id);
        }
    }
    ids
}

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

/// A clear error when `dir` is not a model path: neither a Hugging Face
/// directory (with a `config.json`) nor a GGUF model (a `.gguf` file, or a
/// directory holding one GGUF model; see [`duplex_gguf::locate`]). When
/// `dir` is the bundled default, the error says where that was looked for.
pub fn check_model_dir(dir: &std::path::Path) -> Result<(), String> {
    if dir.join("config.json").is_file() {
        return Ok(());
    }
    match duplex_gguf::locate(dir) {
        Ok(Some(_)) => return Ok(()),
        Ok(None) => {}
        Err(e) => return Err(e.to_string()),
    }
    let mut msg = format!(
        "{} is not a model directory (it has no config.json) nor a GGUF model (a .gguf file, or a directory holding one GGUF model)",
        dir.display()
    );
    if dir == std::path::Path::new(BUNDLED_MODEL) {
        let looked: Vec<String> = bundled_model_candidates().iter().map(|p| p.display().to_string()).collect();
        msg.push_str(&format!("; the bundled tiny model was looked for in: {}. Pass --model DIR", looked.join(", ")));
    }
    Err(msg)
}


#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finish_rule_stop_tokens_then_max_tokens_then_context() {
        let rule = FinishRule { stop_token_ids: [1, 9].into(), max_tokens: 3, context_length: 12 };
        assert_eq!(rule.check(4, 1, 9), Some(FinishReason::Stop), "a stop token ends at once");
        assert_eq!(rule.check(4, 3, 1), Some(FinishReason::Stop), "a stop token wins over max_tokens");
        assert_eq!(rule.check(4, 2, 5), None);
        assert_eq!(rule.check(4, 3, 5), Some(FinishReason::Length));
        // 10 prompt tokens: the 2nd generated token would be written at position 11, the last.
        assert_eq!(rule.check(10, 2, 5), None);
        assert_eq!(rule.check(11, 2, 5), Some(FinishReason::Length), "no position left for it");
    }
}
