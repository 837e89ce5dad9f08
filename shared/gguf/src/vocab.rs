//! The tokenizer a GGUF carries in its metadata (`tokenizer.ggml.*`,
//! `tokenizer.chat_template`), as plain data: enough for the text crate to
//! build a byte-level BPE tokenizer when no `tokenizer.json` is beside the
//! model.

use super::{GgufError, Metadata};

/// llama.cpp's token types (`tokenizer.ggml.token_type`).
pub mod token_type {
    pub const NORMAL: i32 = 1;
    pub const UNKNOWN: i32 = 2;
    pub const CONTROL: i32 = 3;
    pub const USER_DEFINED: i32 = 4;
    pub const UNUSED: i32 = 5;
    pub const BYTE: i32 = 6;
}

#[derive(Clone, Debug, PartialEq)]
pub struct GgufVocab {
    /// `tokenizer.ggml.model`: `gpt2` (byte-level BPE), `llama` (SentencePiece), ...
    pub model: String,
    /// `tokenizer.ggml.pre`: the pre-tokenizer's name (`deepseek-v3`, `qwen2`, ...).
    pub pre: Option<String>,
    /// Token strings by id.
    pub tokens: Vec<String>,
    /// [`token_type`] by id (empty when the file has none).
    pub token_types: Vec<i32>,
    /// BPE merges, `"left right"`, highest priority first.
    pub merges: Vec<String>,
    pub bos_token_id: Option<u32>,
    pub eos_token_id: Option<u32>,
    pub padding_token_id: Option<u32>,
    pub add_bos_token: Option<bool>,
    pub add_eos_token: Option<bool>,
    pub chat_template: Option<String>,
}

impl GgufVocab {
    pub fn from_metadata(md: &Metadata) -> Result<Self, GgufError> {
        let model_key = "tokenizer.ggml.model";
        let model = md.require(model_key, md.str(model_key)?)?.to_string();
        let strings = |key: &str| -> Result<Vec<String>, GgufError> {
            let Some(items) = md.array(key)? else { return Ok(vec![]) };
            items
                .iter()
                .enumerate()
                .map(|(i, v)| v.as_str().map(str::to_string).ok_or_else(|| md.error(key, format!("element {i} is {:?}, expected a string", v.value_type()))))
                .collect()
        };
        let tokens_key = "tokenizer.ggml.tokens";
        let tokens = strings(tokens_key)?;
        if tokens.is_empty() {
            return Err(md.error(tokens_key, "missing or empty".into()));
        }
        let types_key = "tokenizer.ggml.token_type";
        let token_types: Vec<i32> = match md.array(types_key)? {
            None => vec![],
            Some(items) => items
                .iter()
                .enumerate()
                .map(|(i, v)| match v.as_int().and_then(|x| i32::try_from(x).ok()) {
                    Some(x) => Ok(x),
                    None => Err(md.error(types_key, format!("element {i} is not an i32: {v:?}"))),
                })
                .collect::<Result<_, _>>()?,
        };
        if !token_types.is_empty() && token_types.len() != tokens.len() {
            return Err(md.error(types_key, format!("has {} entries for {} tokens", token_types.len(), tokens.len())));
        }
        let id = |key: &str| -> Result<Option<u32>, GgufError> {
            match md.usize(key)? {
                None => Ok(None),
                Some(i) if i < tokens.len() => Ok(Some(i as u32)),
                Some(i) => Err(md.error(key, format!("token id {i} is outside the vocabulary of {}", tokens.len()))),
            }
        };
        Ok(GgufVocab {
            pre: md.str("tokenizer.ggml.pre")?.map(str::to_string),
            merges: strings("tokenizer.ggml.merges")?,
            bos_token_id: id("tokenizer.ggml.bos_token_id")?,
            eos_token_id: id("tokenizer.ggml.eos_token_id")?,
            padding_token_id: id("tokenizer.ggml.padding_token_id")?,
            add_bos_token: md.bool("tokenizer.ggml.add_bos_token")?,
            add_eos_token: md.bool("tokenizer.ggml.add_eos_token")?,
            chat_template: md.str("tokenizer.chat_template")?.map(str::to_string),
            model,
            tokens,
            token_types,
        })
    }

    /// Whether token `id` is a control token (BOS, EOS, chat markers).
    pub fn is_control(&self, id: u32) -> bool {
        self.token_types.get(id as usize) == Some(&token_type::CONTROL)
    }
}

