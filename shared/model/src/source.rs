//! What a `--model` path names, opened: a Hugging Face directory
//! (`config.json` beside safetensors) or a GGUF model (see
//! `duplex_gguf::locate` for the convention), with the metadata overrides
//! asked for a GGUF. Everything that loads a model goes through here, so
//! every process accepts the same paths and overrides.

use crate::checkpoint::Checkpoint;
use crate::config::ModelConfig;
use crate::model::LoadError;
pub use duplex_gguf::MetadataOverride;
use std::path::{Path, PathBuf};

#[derive(Clone, Debug, PartialEq)]
pub enum ModelSource {
    /// A directory with `config.json` and safetensors.
    HuggingFace(PathBuf),
    /// A GGUF file (the part to open, for a split set), and overrides of
    /// its metadata (`--override-kv`), applied in order.
    Gguf { file: PathBuf, overrides: Vec<MetadataOverride> },
}

impl ModelSource {
    pub fn locate(path: &Path) -> Result<Self, LoadError> {
        Ok(match duplex_gguf::locate(path)? {
            Some(file) => ModelSource::Gguf { file, overrides: vec![] },
            None => ModelSource::HuggingFace(path.to_path_buf()),
        })
    }

    /// The model at `path` with `overrides` of its GGUF metadata, each
    /// `KEY=TYPE:VALUE` as llama.cpp's `--override-kv`. Overrides of a
    /// Hugging Face model are refused: its config.json is the place.
    pub fn locate_with(path: &Path, overrides: &[String]) -> Result<Self, LoadError> {
        let parsed = Self::parse_overrides(overrides)?;
        match Self::locate(path)? {
            ModelSource::Gguf { file, .. } => Ok(ModelSource::Gguf { file, overrides: parsed }),
            ModelSource::HuggingFace(dir) if parsed.is_empty() => Ok(ModelSource::HuggingFace(dir)),
            ModelSource::HuggingFace(dir) => Err(LoadError::Overrides(format!("override_kv overrides GGUF metadata, but {} is a Hugging Face model: edit its config.json instead", dir.display()))),
        }
    }

    /// `override_kv` entries, parsed (a config checks them with this before
    /// any model is opened).
    pub fn parse_overrides(overrides: &[String]) -> Result<Vec<MetadataOverride>, LoadError> {
        overrides.iter().map(|o| o.parse::<MetadataOverride>()).collect::<Result<Vec<_>, _>>().map_err(|e| LoadError::Overrides(format!("override_kv: {e}")))
    }

    /// The file the configuration comes from, for messages.
    pub fn config_file(&self) -> PathBuf {
        match self {
            ModelSource::HuggingFace(dir) => dir.join("config.json"),
            ModelSource::Gguf { file, .. } => file.clone(),
        }
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
            ModelSource::Gguf { file, overrides } => {
                let mut g = duplex_gguf::Gguf::open(file)?;
                g.override_metadata(overrides);
                let mut identity = b"gguf\0".to_vec();
                for part in g.parts() {
                    let name = part.path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
                    identity.extend_from_slice(name.as_bytes());
                    identity.push(0);
                    identity.extend_from_slice(&part.len().to_le_bytes());
                    identity.extend_from_slice(part.header_bytes());
                }
                // A model read with other overrides is another model.
                for o in overrides {
                    identity.extend_from_slice(format!("override\0{o}\0").as_bytes());
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
            ModelSource::Gguf { file, overrides } => {
                let m = crate::gguf::open_with(file, overrides)?;
                Ok((m.cfg, m.checkpoint))
            }
        }
    }

    /// The directory beside the model's files (where `tokenizer.json`,
    /// `generation_config.json` and the like are looked for).
    pub fn dir(&self) -> &Path {
        match self {
            ModelSource::HuggingFace(dir) => dir,
            ModelSource::Gguf { file, .. } => file.parent().unwrap_or(Path::new(".")),
        }
    }
}
