//! What a `--model` path names, opened: a Hugging Face directory
//! (`config.json` beside safetensors) or a GGUF model (see
//! `duplex_gguf::locate` for the convention). Everything that loads a model
//! goes through here, so every process accepts the same paths.

use crate::checkpoint::Checkpoint;
use crate::config::ModelConfig;
use crate::model::LoadError;
use std::path::{Path, PathBuf};

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ModelSource {
    /// A directory with `config.json` and safetensors.
    HuggingFace(PathBuf),
    /// A GGUF file (the part to open, for a split set).
    Gguf(PathBuf),
}

impl ModelSource {
    pub fn locate(path: &Path) -> Result<Self, LoadError> {
        Ok(match duplex_gguf::locate(path)? {
            Some(file) => ModelSource::Gguf(file),
            None => ModelSource::HuggingFace(path.to_path_buf()),
        })
    }

    /// The model's configuration and the bytes it was read from, which
    /// identify it (`config.json`'s, or each GGUF part's name, length and
    /// header), without reading any tensor data.
    pub fn config(&self) -> Result<(ModelConfig, Vec<u8>), LoadError> {
        match self {
            ModelSource::HuggingFace(dir) => {
                let path = dir.join("config.json");
                let bytes = std::fs::read(&path).map_err(|source| crate::config::ConfigError::Io { path: path.display().to_string(), source })?;
                let origin = path.display().to_string();
                let text = std::str::from_utf8(&bytes).map_err(|e| crate::config::ConfigError::Parse { path: origin.clone(), message: e.to_string() })?;
                Ok((ModelConfig::from_json(text, &origin)?, bytes))
            }
            ModelSource::Gguf(file) => {
                let g = duplex_gguf::Gguf::open(file)?;
                let mut identity = b"gguf\0".to_vec();
                for part in g.parts() {
                    let name = part.path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
                    identity.extend_from_slice(name.as_bytes());
                    identity.push(0);
                    identity.extend_from_slice(&part.len().to_le_bytes());
                    identity.extend_from_slice(part.header_bytes());
                }
                Ok((crate::gguf::model_config(&g)?, identity))
            }
        }
    }

    /// The configuration and every tensor, by Hugging Face name.
    pub fn open(&self) -> Result<(ModelConfig, Checkpoint), LoadError> {
        match self {
            ModelSource::HuggingFace(dir) => {
                let cfg = ModelConfig::from_file(&dir.join("config.json"))?;
                let ck = Checkpoint::open(dir, cfg.quantization.as_ref().map(|q| q.weight_block_size))?;
                Ok((cfg, ck))
            }
            ModelSource::Gguf(file) => {
                let m = crate::gguf::open(file)?;
                Ok((m.cfg, m.checkpoint))
            }
        }
    }

    /// The directory beside the model's files (where `tokenizer.json`,
    /// `generation_config.json` and the like are looked for).
    pub fn dir(&self) -> &Path {
        match self {
            ModelSource::HuggingFace(dir) => dir,
            ModelSource::Gguf(file) => file.parent().unwrap_or(Path::new(".")),
        }
    }
}
