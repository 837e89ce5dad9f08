//! Tokenizer, chat template and streaming detokenizer for Hugging Face
//! checkpoints.
//!
//! A checkpoint directory spreads its tokenizer state over several files,
//! and real models disagree about which file holds what:
//!
//! * `tokenizer.json` (required, unless `tiktoken.model` stands in): the
//!   `tokenizers` pipeline itself.
//! * `tiktoken.model` (when there is no `tokenizer.json`): Kimi-K2's
//!   tokenizer as published, tiktoken ranks whose special tokens are in
//!   `tokenizer_config.json`; converted to the same pipeline at load time
//!   (see `tiktoken.rs`).
//! * `tokenizer_config.json` (optional): chat template, BOS/EOS token
//!   strings and the `add_bos_token` / `add_eos_token` switches.
//! * `chat_template.jinja` (optional): newer `transformers` releases store
//!   the template here instead of in `tokenizer_config.json`; when present it
//!   wins, as it does in `transformers`.
//! * `generation_config.json` (optional): the ids generation stops on. Chat
//!   models often list several (e.g. end-of-turn *and* end-of-text).
//! * `config.json` (optional): last-resort BOS/EOS ids.
//!
//! [`Tokenizer::from_dir`] merges them once at load time, so the rest of
//! the server asks one object and never re-reads the files. A GGUF model
//! carries the same state in its metadata: [`Tokenizer::from_gguf`] builds
//! the pipeline from that (`gguf.rs`), and [`Tokenizer::from_model_path`]
//! picks between the two by what a `--model` path names.

use std::borrow::Cow;
use std::collections::HashMap;
use std::fs;
use std::path::{Path, PathBuf};

use minijinja::{Environment, Error as JinjaError, ErrorKind as JinjaErrorKind, Value};
use serde_json::Value as Json;

use crate::tools::{TemplateTools, Tool, ToolCall, ToolFormat};

/// Name under which the chat template is registered in the Jinja environment;
/// it shows up in rendering error messages ("... (in chat_template:3)").
const TEMPLATE_NAME: &str = "chat_template";

/// How many prompt ids [`IncrementalDecoder::with_prompt`] keeps as context:
/// enough for decoders that look at the previous token (leading-space
/// handling) without re-decoding a long prompt on every push. Same value as
/// vLLM's initial detokenization offset.
const PROMPT_CONTEXT_IDS: usize = 5;

/// Where [`Tokenizer::encode_chat`] draws its placeholder characters: the
/// supplementary private use area A, which no tokenizer or template gives a
/// meaning and which has no case (templates call `.upper()`, `.strip()`).
const PLACEHOLDERS: std::ops::RangeInclusive<u32> = 0xF_0000..=0xF_FFFD;

/// `\w` of the `regex` crate, which `tokenizers` uses for `single_word`.
fn is_word_char(c: char) -> bool {
    c.is_alphanumeric() || c == '_'
}

/// Errors from loading a tokenizer directory, encoding or rendering a chat
/// template. Every variant carries the file (and where relevant the field)
/// that caused it, because "invalid type" without a path is useless when a
/// checkpoint directory holds five JSON files.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    /// A file could not be read (missing directory, missing `tokenizer.json`,
    /// permissions, ...).
    #[error("cannot read {}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A JSON side file (`tokenizer_config.json`, `generation_config.json`,
    /// `config.json`) is not valid JSON.
    #[error("invalid JSON in {}: {source}", path.display())]
    Json {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    /// `tokenizer.json` is not a tokenizer the `tokenizers` crate understands.
    #[error("cannot load tokenizer from {}: {source}", path.display())]
    Load {
        path: PathBuf,
        #[source]
        source: tokenizers::Error,
    },
    /// `tiktoken.model` is malformed or cannot become a tokenizer (a line
    /// that is not `<base64> <rank>`, a missing rank, an added token that
    /// clashes with a ranked one, ...).
    #[error("cannot load tiktoken tokenizer from {}: {message}", path.display())]
    Tiktoken { path: PathBuf, message: String },
    /// A GGUF file could not be read, or its metadata has a wrong type.
    #[error(transparent)]
    Gguf(#[from] duplex_gguf::GgufError),
    /// A GGUF's tokenizer metadata cannot become a tokenizer: an
    /// unsupported `tokenizer.ggml.model` or `tokenizer.ggml.pre`, a merge
    /// of tokens not in the vocabulary, a token given twice, ...
    #[error("{}: cannot build the tokenizer from its metadata: {message}", path.display())]
    GgufTokenizer { path: PathBuf, message: String },
    /// A field has the wrong type or names a token that does not exist.
    #[error("{}: field `{field}` {message}", path.display())]
    Field {
        path: PathBuf,
        field: &'static str,
        message: String,
    },
    /// The chat template does not compile.
    #[error("invalid chat template in {}: {message}", path.display())]
    TemplateSyntax { path: PathBuf, message: String },
    /// The model ships no chat template, so chat requests cannot be served.
    #[error("no chat template: {looked}")]
    NoChatTemplate { path: PathBuf, looked: String },
    /// Rendering failed, including templates that call `raise_exception`
    /// (the usual way templates reject e.g. a non-alternating conversation);
    /// `reason` is then the template's own message.
    #[error("chat template from {} failed to render: {message}", path.display())]
    TemplateRender { path: PathBuf, message: String, reason: Option<String> },
    /// The `tokenizers` pipeline rejected the input.
    #[error("tokenizer from {} failed to encode text: {source}", path.display())]
    Encode {
        path: PathBuf,
        #[source]
        source: tokenizers::Error,
    },
    /// A request's extra chat-template variables ([`ChatTemplateKwargs`])
    /// are not acceptable: a reserved name, or a special-token string in a
    /// value. The client's fault, so no server path in the message.
    #[error("chat_template_kwargs: {message}")]
    TemplateKwargs { message: String },
}

impl TokenizerError {
    /// The error as a client may see it, without the server's file paths:
    /// for a template that refused the conversation (`raise_exception`, e.g.
    /// Mixtral's "Conversation roles must alternate ...") only the
    /// template's reason; other errors in full.
    pub fn client_message(&self) -> String {
        match self {
            TokenizerError::TemplateRender { reason: Some(reason), .. } => format!("the chat template rejected the messages: {reason}"),
            TokenizerError::TemplateRender { message, .. } => format!("the chat template failed to render: {message}"),
            e => e.to_string(),
        }
    }
}

/// Extra variables for a chat template, as `transformers`'
/// `apply_chat_template(..., **kwargs)` and vLLM's `chat_template_kwargs`
/// request field pass them: e.g. `{"enable_thinking": false}` for Qwen3. A
/// variable not given is undefined in the template (Qwen3's default,
/// thinking on, is "`enable_thinking` undefined").
pub type ChatTemplateKwargs = serde_json::Map<String, Json>;

/// Template variables that [`ChatTemplateKwargs`] may not set: they are the
/// request itself (`messages`, `tools`, `add_generation_prompt`) or the tokenizer's
/// own markers (`bos_token`, `eos_token`), which a client must not replace.
const RESERVED_TEMPLATE_VARIABLES: [&str; 5] = ["messages", "tools", "add_generation_prompt", "bos_token", "eos_token"];

/// One chat turn, as sent by OpenAI-style clients and as seen by the chat
/// template (`message['role']`, `message['content']`, and for tools
/// `message['tool_calls']`, `message['tool_call_id']`, `message['name']`).
/// An assistant turn that only calls tools has empty `content`; templates
/// that want `null` there get it (see [`TemplateTools`]).
#[derive(Clone, Debug, Default, serde::Serialize, serde::Deserialize, PartialEq)]
pub struct ChatMessage {
    pub role: String,
    /// `null` (OpenAI's assistant turn with only calls) reads as empty.
    #[serde(default, deserialize_with = "null_as_empty")]
    pub content: String,
    /// The calls of an assistant turn.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCall>,
    /// The call a `tool` turn answers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    /// The function a `tool` turn answers (or a participant's name).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

impl ChatMessage {
    /// A plain turn: a role and its text.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        ChatMessage { role: role.into(), content: content.into(), ..Default::default() }
    }

    /// An assistant turn that calls tools (after `content`, often empty).
    pub fn assistant_tool_calls(content: impl Into<String>, tool_calls: Vec<ToolCall>) -> Self {
        ChatMessage { role: "assistant".into(), content: content.into(), tool_calls, ..Default::default() }
    }

    /// A tool's result, answering call `tool_call_id`.
    pub fn tool_result(tool_call_id: impl Into<String>, content: impl Into<String>) -> Self {
        ChatMessage { role: "tool".into(), content: content.into(), tool_call_id: Some(tool_call_id.into()), ..Default::default() }
    }
}

fn null_as_empty<'de, D: serde::Deserializer<'de>>(deserializer: D) -> Result<String, D::Error> {
    Ok(<Option<String> as serde::Deserialize>::deserialize(deserializer)?.unwrap_or_default())
}

/// A loaded tokenizer plus everything generation needs from the side files.
pub struct Tokenizer {
    /// Recognises special-token strings as their ids: for trusted text only
    /// (a chat template's own markers, prompts whose client opted in).
    inner: tokenizers::Tokenizer,
    /// The same pipeline with special-token parsing off (`transformers`'
    /// `split_special_tokens=True`): a special-token string typed by a
    /// client is encoded as the plain text it is, so a client cannot forge
    /// turns or end-of-sequence markers. Non-special added tokens (e.g. a
    /// `<think>` the model also reads as text) still match, as there.
    plain: tokenizers::Tokenizer,
    /// The special tokens, and a leftmost-longest matcher over their strings
    /// (the matching the added vocabulary does); `None` without any.
    specials: Vec<SpecialToken>,
    special_matcher: Option<aho_corasick::AhoCorasick>,
    /// The decoder's steps with `ByteFallback` swapped for
    /// [`DecodeStep::LossyBytes`], for SentencePiece-style vocabularies
    /// (Mixtral, Llama); `None` when the decoder has no `ByteFallback`.
    byte_fallback_steps: Option<Vec<DecodeStep>>,
    /// `tokenizer.json` (or `tiktoken.model`) path, kept for error messages.
    tokenizer_path: PathBuf,
    bos_id: Option<u32>,
    /// Union of every EOS id the side files mention, in discovery order.
    eos_ids: Vec<u32>,
    add_bos: bool,
    add_eos: bool,
    /// Strings handed to the chat template as `bos_token` / `eos_token`.
    bos_token: String,
    eos_token: String,
    /// Compiled chat template (registered as [`TEMPLATE_NAME`]), if any.
    chat_env: Option<Environment<'static>>,
    /// File the template came from (or would have come from), for errors.
    template_path: PathBuf,
    /// The template's source, so that placeholders never collide with it.
    template_source: String,
    /// Where a template was looked for, for the error when there is none.
    no_template: String,
    /// What the template does with tools, probed once at load time.
    template_tools: TemplateTools,
}

/// What one source of a tokenizer (a model directory, a GGUF file)
/// resolves, for [`Tokenizer::assemble`] to finish.
pub(crate) struct Sources {
    pub inner: tokenizers::Tokenizer,
    /// The file the pipeline came from, for error messages.
    pub tokenizer_path: PathBuf,
    pub bos_id: Option<u32>,
    /// In order of preference; repeats are dropped.
    pub eos_ids: Vec<u32>,
    /// Wanted; honoured only where the id exists.
    pub add_bos: bool,
    pub add_eos: bool,
    /// The strings handed to the chat template; `None` means the text of
    /// `bos_id` / the first EOS id.
    pub bos_token: Option<String>,
    pub eos_token: Option<String>,
    pub template_path: PathBuf,
    pub template_source: Option<String>,
    /// Where a template was looked for, said when there is none.
    pub no_template: String,
}

/// One step of a decoder pipeline that [`Tokenizer::decode`] runs itself.
#[derive(Clone, Debug)]
enum DecodeStep {
    Builtin(tokenizers::DecoderWrapper),
    /// `ByteFallback` (`<0xE4>` tokens to bytes), but turning a run of bytes
    /// that is not valid UTF-8 into text the lossy way (one U+FFFD per bad
    /// sequence, valid characters kept, as SentencePiece itself does)
    /// instead of `tokenizers`' all-or-nothing (one U+FFFD per byte of the
    /// whole run as soon as any byte is bad). All-or-nothing lets a later
    /// stray byte turn an already complete, already streamed character into
    /// U+FFFD, so a stream could never equal the full decode; lossy decoding
    /// never changes text that a later byte cannot complete. Valid UTF-8
    /// decodes the same either way.
    LossyBytes,
}

/// A special added token, with the options that change how it splits text.
#[derive(Clone, Debug)]
struct SpecialToken {
    content: String,
    id: u32,
    /// Absorbs the whitespace before / after it.
    lstrip: bool,
    rstrip: bool,
    /// Matches only where it is not inside a word.
    single_word: bool,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The inner tokenizer's Debug dumps the whole vocabulary; keep it short.
        f.debug_struct("Tokenizer")
            .field("path", &self.tokenizer_path)
            .field("vocab_size", &self.vocab_size())
            .field("bos_id", &self.bos_id)
            .field("eos_ids", &self.eos_ids)
            .field("add_bos", &self.add_bos)
            .field("add_eos", &self.add_eos)
            .field("has_chat_template", &self.chat_env.is_some())
            .finish()
    }
}

impl Tokenizer {
    /// Loads `dir/tokenizer.json` (required; without it `dir/tiktoken.model`
    /// with `tokenizer_config.json`'s `added_tokens_decoder`, as Kimi-K2
    /// ships), `dir/tokenizer_config.json`
    /// (optional: `chat_template`, `bos_token`, `eos_token`, `add_bos_token`,
    /// `add_eos_token`; BOS/EOS tokens may be plain strings or AddedToken
    /// objects like `{"content": "..."}`), `dir/generation_config.json`
    /// (optional: `bos_token_id`, `eos_token_id` as an int or a list of ints)
    /// and `dir/config.json` (optional: `bos_token_id` / `eos_token_id`
    /// fallback). EOS ids are the union of all of them.
    ///
    /// The chat template is compiled here, so a broken template fails at
    /// startup rather than on the first chat request.
    pub fn from_dir(dir: &Path) -> Result<Self, TokenizerError> {
        let tc_path = dir.join("tokenizer_config.json");
        let gen_path = dir.join("generation_config.json");
        let cfg_path = dir.join("config.json");
        let tc = read_optional_json(&tc_path)?;
        let gen = read_optional_json(&gen_path)?;
        let cfg = read_optional_json(&cfg_path)?;

        let json_path = dir.join("tokenizer.json");
        let tiktoken_path = dir.join("tiktoken.model");
        // tokenizer.json wins where both exist (it is what transformers'
        // fast tokenizer loads); tiktoken.model only stands in for it, and
        // without either the error names tokenizer.json, the usual file.
        let (tokenizer_path, inner) = if !json_path.exists() && tiktoken_path.exists() {
            let inner = crate::tiktoken::load(&tiktoken_path, tc.as_ref(), &tc_path)?;
            (tiktoken_path, inner)
        } else {
            let bytes = fs::read(&json_path).map_err(|source| TokenizerError::Io {
                path: json_path.clone(),
                source,
            })?;
            let inner = tokenizers::Tokenizer::from_bytes(&bytes).map_err(|source| TokenizerError::Load {
                path: json_path.clone(),
                source,
            })?;
            (json_path, inner)
        };

        // Token strings from tokenizer_config.json, resolved to ids so that a
        // typo surfaces now instead of as a never-matching stop token.
        let resolve = |field: &'static str| -> Result<Option<(String, u32)>, TokenizerError> {
            let Some(text) = token_string(tc.as_ref(), &tc_path, field)? else {
                return Ok(None);
            };
            match inner.token_to_id(&text) {
                Some(id) => Ok(Some((text, id))),
                None => Err(TokenizerError::Field {
                    path: tc_path.clone(),
                    field,
                    message: format!(
                        "names token {text:?}, which is not in {}",
                        tokenizer_path.display()
                    ),
                }),
            }
        };
        let tc_bos = resolve("bos_token")?;
        let tc_eos = resolve("eos_token")?;

        // The tokenizer's own BOS is authoritative for encoding; the model
        // configs are fallbacks for checkpoints that do not say. An explicit
        // `"bos_token": null` does say: no BOS (Qwen: the configs'
        // `bos_token_id` is `<|endoftext|>`, which transformers' tokenizer
        // never adds nor hands the template).
        let no_bos = tc.as_ref().and_then(|j| j.get("bos_token")).is_some_and(Json::is_null);
        let bos_id = match &tc_bos {
            Some((_, id)) => Some(*id),
            None if no_bos => None,
            None => match token_ids(gen.as_ref(), &gen_path, "bos_token_id")?.first() {
                Some(&id) => Some(id),
                None => token_ids(cfg.as_ref(), &cfg_path, "bos_token_id")?
                    .first()
                    .copied(),
            },
        };

        let mut eos_ids = token_ids(gen.as_ref(), &gen_path, "eos_token_id")?;
        eos_ids.extend(token_ids(cfg.as_ref(), &cfg_path, "eos_token_id")?);
        eos_ids.extend(tc_eos.as_ref().map(|(_, id)| *id));

        // Without `add_bos_token`, BOS is added when tokenizer.json's
        // post-processor adds it, as transformers' fast tokenizer does with
        // tokenizer.json alone: DeepSeek's and Mixtral's do, Qwen's
        // (ByteLevel) does not, although Qwen's configs name a
        // `bos_token_id`.
        let post_processor_adds = |bos: u32| {
            inner.encode("a", true).is_ok_and(|enc| enc.get_ids().first() == Some(&bos))
        };
        let add_bos = match optional_bool(tc.as_ref(), &tc_path, "add_bos_token")? {
            Some(add) => add,
            None => bos_id.is_some_and(post_processor_adds),
        };
        let add_eos = optional_bool(tc.as_ref(), &tc_path, "add_eos_token")?.unwrap_or(false);

        let (template_path, template_source) = load_template_source(dir, tc.as_ref(), &tc_path)?;
        let no_template = format!(
            "neither {} has `chat_template` nor does {} exist",
            tc_path.display(),
            dir.join("chat_template.jinja").display()
        );
        Self::assemble(Sources {
            inner,
            tokenizer_path,
            bos_id,
            eos_ids,
            add_bos,
            add_eos,
            bos_token: tc_bos.map(|(s, _)| s),
            eos_token: tc_eos.map(|(s, _)| s),
            template_path,
            template_source,
            no_template,
        })
    }

    /// The tokenizer of a GGUF model, from its metadata alone: see
    /// `gguf.rs` for how `tokenizer.ggml.*` becomes a `tokenizers`
    /// pipeline. BOS and EOS are the metadata's ids; EOS ids are
    /// `eos_token_id`, then `eot_token_id` and `eom_token_id` where given
    /// (llama.cpp ends generation on each). The chat template is
    /// `tokenizer.chat_template`, compiled here as [`Tokenizer::from_dir`]
    /// compiles its own.
    pub fn from_gguf(gguf: &duplex_gguf::Gguf) -> Result<Self, TokenizerError> {
        Self::assemble(crate::gguf::sources(gguf)?)
    }

    /// The tokenizer of whatever a `--model` path names (the convention of
    /// [`duplex_gguf::locate`]): a Hugging Face directory is read by
    /// [`Tokenizer::from_dir`]. For a GGUF model, a `tokenizer.json` (or
    /// `tiktoken.model`) in the GGUF file's directory wins, since it is the
    /// tokenizer as published and carries what GGUF metadata cannot (e.g.
    /// normalizers); without one, the GGUF metadata is the tokenizer
    /// ([`Tokenizer::from_gguf`]).
    pub fn from_model_path(path: &Path) -> Result<Self, TokenizerError> {
        let Some(file) = duplex_gguf::locate(path)? else {
            return Self::from_dir(path);
        };
        let dir = crate::gguf::parent_dir(&file);
        if dir.join("tokenizer.json").is_file() || dir.join("tiktoken.model").is_file() {
            return Self::from_dir(&dir);
        }
        Self::from_gguf(&duplex_gguf::Gguf::open(&file)?)
    }

    /// The part every source shares: token strings for the template,
    /// the BOS/EOS switches made consistent, the template compiled (so a
    /// broken one fails at startup rather than on the first chat request),
    /// and the special-token matcher.
    fn assemble(src: Sources) -> Result<Self, TokenizerError> {
        let Sources { inner, tokenizer_path, bos_id, mut eos_ids, add_bos, add_eos, bos_token, eos_token, template_path, template_source, no_template } = src;
        let mut seen = std::collections::HashSet::new();
        eos_ids.retain(|id| seen.insert(*id));
        // Without a BOS (or an EOS) the switch is moot, so not an error.
        let add_bos = add_bos && bos_id.is_some();
        let add_eos = add_eos && !eos_ids.is_empty();

        let text_of = |id: Option<u32>| id.and_then(|id| inner.id_to_token(id)).unwrap_or_default();
        let bos_token = bos_token.unwrap_or_else(|| text_of(bos_id));
        let eos_token = eos_token.unwrap_or_else(|| text_of(eos_ids.first().copied()));

        let chat_env = template_source
            .clone()
            .map(|src| {
                build_env(src).map_err(|e| TokenizerError::TemplateSyntax {
                    path: template_path.clone(),
                    message: jinja_message(&e),
                })
            })
            .transpose()?;
        let template_source = template_source.unwrap_or_default();

        let mut plain = inner.clone();
        plain.set_encode_special_tokens(true);
        let mut specials: Vec<SpecialToken> = inner
            .get_added_tokens_decoder()
            .into_iter()
            .filter(|(_, t)| t.special && !t.content.is_empty())
            .map(|(id, t)| SpecialToken {
                content: t.content,
                id,
                lstrip: t.lstrip,
                rstrip: t.rstrip,
                single_word: t.single_word,
            })
            .collect();
        specials.sort_by_key(|t| t.id);
        let special_matcher = if specials.is_empty() {
            None
        } else {
            let matcher = aho_corasick::AhoCorasick::builder()
                .match_kind(aho_corasick::MatchKind::LeftmostLongest)
                .build(specials.iter().map(|t| &t.content))
                .map_err(|e| TokenizerError::Field {
                    path: tokenizer_path.clone(),
                    field: "added_tokens",
                    message: format!("cannot build a matcher over the special tokens: {e}"),
                })?;
            Some(matcher)
        };

        let byte_fallback_steps = byte_fallback_steps(inner.get_decoder());
        let template_tools = TemplateTools::probe(|messages, tools| {
            let env = chat_env.as_ref().ok_or_else(|| JinjaError::new(JinjaErrorKind::TemplateNotFound, "no chat template"))?;
            let mut context: std::collections::BTreeMap<&str, Value> = std::collections::BTreeMap::new();
            context.insert("messages", Value::from_serialize(messages));
            if let Some(tools) = tools {
                context.insert("tools", Value::from_serialize(tools));
            }
            context.insert("add_generation_prompt", Value::from(false));
            for (name, token) in [("bos_token", &bos_token), ("eos_token", &eos_token)] {
                if !token.is_empty() {
                    context.insert(name, Value::from(token.as_str()));
                }
            }
            env.get_template(TEMPLATE_NAME)?.render(Value::from(context))
        });

        Ok(Self {
            byte_fallback_steps,
            inner,
            plain,
            specials,
            special_matcher,
            tokenizer_path,
            bos_id,
            eos_ids,
            add_bos,
            add_eos,
            bos_token,
            eos_token,
            chat_env,
            template_path,
            template_source,
            no_template,
            template_tools,
        })
    }

    /// Encode user text for a completion prompt, adding BOS when
    /// `add_bos_token` is set (default: whenever a BOS exists) and EOS when
    /// `add_eos_token` is set.
    ///
    /// The `tokenizer.json` post-processor is deliberately not run: it would
    /// add BOS regardless of `add_bos_token`, and adding it ourselves on top
    /// would double it. Instead BOS is added here exactly once, and not at
    /// all if the text already starts with the BOS token string (a client
    /// that pre-rendered its prompt). This mirrors what `LlamaTokenizerFast`,
    /// which DeepSeek checkpoints name, does with those two switches.
    ///
    /// Special-token strings in `text` become their ids: use this for
    /// trusted text only; [`Tokenizer::encode_text`] is for clients' text.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, TokenizerError> {
        let ids = self.encode_raw(text)?;
        Ok(self.add_bos_eos(ids))
    }

    /// Encode a client's text as [`Tokenizer::encode`] does (BOS and EOS as
    /// configured), but with every special-token string in it encoded as the
    /// plain text it is: a client typing `<|im_end|>` gets the ids of those
    /// characters, never the end-of-turn id (llama.cpp's `parse_special =
    /// false`, `transformers`' `split_special_tokens=True`).
    pub fn encode_text(&self, text: &str) -> Result<Vec<u32>, TokenizerError> {
        let ids = self.encode_with(&self.plain, text)?;
        Ok(self.add_bos_eos(ids))
    }

    fn add_bos_eos(&self, mut ids: Vec<u32>) -> Vec<u32> {
        if let Some(bos) = self.bos_id.filter(|_| self.add_bos) {
            if ids.first() != Some(&bos) {
                ids.insert(0, bos);
            }
        }
        if let Some(&eos) = self.eos_ids.first().filter(|_| self.add_eos) {
            if ids.last() != Some(&eos) {
                ids.push(eos);
            }
        }
        ids
    }

    /// Encode text that already contains its special tokens (e.g. a rendered
    /// chat template): nothing is added, and special-token strings in the
    /// text become their single ids (the added-vocabulary pass always
    /// matches them; only the post-processor is skipped).
    pub fn encode_raw(&self, text: &str) -> Result<Vec<u32>, TokenizerError> {
        self.encode_with(&self.inner, text)
    }

    fn encode_with(&self, tokenizer: &tokenizers::Tokenizer, text: &str) -> Result<Vec<u32>, TokenizerError> {
        tokenizer
            .encode(text, false)
            .map(|enc| enc.get_ids().to_vec())
            .map_err(|source| TokenizerError::Encode {
                path: self.tokenizer_path.clone(),
                source,
            })
    }

    /// Render the chat template with `messages`, `add_generation_prompt`,
    /// `bos_token` and `eos_token`, the variables HF templates rely on.
    ///
    /// The environment matches `transformers` (trim_blocks, lstrip_blocks,
    /// Python string methods, `raise_exception`, `strftime_now`) so that
    /// templates written for Jinja2 render identically.
    pub fn apply_chat_template(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String, TokenizerError> {
        self.apply_chat_template_with(messages, add_generation_prompt, &ChatTemplateKwargs::new())
    }

    /// [`Tokenizer::apply_chat_template`] with extra template variables
    /// (e.g. `{"enable_thinking": false}`), checked by
    /// [`Tokenizer::check_template_kwargs`]. A BOS or EOS token the
    /// tokenizer does not have is left undefined, as in `transformers`.
    pub fn apply_chat_template_with(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        kwargs: &ChatTemplateKwargs,
    ) -> Result<String, TokenizerError> {
        self.apply_chat_template_tools(messages, &[], add_generation_prompt, kwargs)
    }

    /// [`Tokenizer::apply_chat_template_with`] offering `tools` to the
    /// model (the template's `tools` variable, as `transformers`'
    /// `apply_chat_template(tools=...)` passes it, or a system message
    /// describing them where the template does not print them; see
    /// [`crate::tools`]). Past calls and tool results in `messages` are
    /// rendered whether or not tools are offered now.
    pub fn apply_chat_template_tools(
        &self,
        messages: &[ChatMessage],
        tools: &[Tool],
        add_generation_prompt: bool,
        kwargs: &ChatTemplateKwargs,
    ) -> Result<String, TokenizerError> {
        let (messages, tools) = self.template_tools.template_inputs(messages, tools);
        self.render_template(&messages, tools.as_ref(), add_generation_prompt, kwargs)
    }

    /// What the chat template does with tools, and so which tool-call
    /// format the model writes ([`TemplateTools::format`]).
    pub fn template_tools(&self) -> &TemplateTools {
        &self.template_tools
    }

    /// The template rendered with messages (and tools) as the template
    /// reads them.
    fn render_template(
        &self,
        messages: &Json,
        tools: Option<&Json>,
        add_generation_prompt: bool,
        kwargs: &ChatTemplateKwargs,
    ) -> Result<String, TokenizerError> {
        self.check_template_kwargs(kwargs)?;
        let env = self
            .chat_env
            .as_ref()
            .ok_or_else(|| TokenizerError::NoChatTemplate {
                path: self.template_path.clone(),
                looked: self.no_template.clone(),
            })?;
        let render_err = |e: JinjaError| TokenizerError::TemplateRender {
            path: self.template_path.clone(),
            message: jinja_message(&e),
            reason: raised_reason(&e),
        };
        let template = env.get_template(TEMPLATE_NAME).map_err(render_err)?;
        let mut context: std::collections::BTreeMap<&str, Value> =
            kwargs.iter().map(|(k, v)| (k.as_str(), Value::from_serialize(v))).collect();
        context.insert("messages", Value::from_serialize(messages));
        if let Some(tools) = tools {
            context.insert("tools", Value::from_serialize(tools));
        }
        context.insert("add_generation_prompt", Value::from(add_generation_prompt));
        for (name, token) in [("bos_token", &self.bos_token), ("eos_token", &self.eos_token)] {
            if !token.is_empty() {
                context.insert(name, Value::from(token.as_str()));
            }
        }
        template.render(Value::from(context)).map_err(render_err)
    }

    /// Refuses extra template variables that would replace the request or
    /// the tokenizer's markers ([`RESERVED_TEMPLATE_VARIABLES`]), and any
    /// special-token string in them (in a value or a key, at any depth): a
    /// template may print a variable, and [`Tokenizer::encode_chat`] keeps
    /// special-token strings outside the messages special, so a client
    /// could forge a turn through one.
    pub fn check_template_kwargs(&self, kwargs: &ChatTemplateKwargs) -> Result<(), TokenizerError> {
        if let Some(name) = RESERVED_TEMPLATE_VARIABLES.iter().find(|&&name| kwargs.contains_key(name)) {
            return Err(TokenizerError::TemplateKwargs {
                message: format!("`{name}` cannot be set here; it is part of the request or of the tokenizer"),
            });
        }
        let Some(matcher) = &self.special_matcher else {
            return Ok(());
        };
        fn find_special(matcher: &aho_corasick::AhoCorasick, value: &Json) -> Option<usize> {
            let in_text = |s: &str| matcher.find(s).map(|m| m.pattern().as_usize());
            match value {
                Json::String(s) => in_text(s),
                Json::Array(items) => items.iter().find_map(|v| find_special(matcher, v)),
                Json::Object(map) => map.iter().find_map(|(k, v)| in_text(k).or_else(|| find_special(matcher, v))),
                Json::Null | Json::Bool(_) | Json::Number(_) => None,
            }
        }
        for (name, value) in kwargs {
            if let Some(token) = matcher.find(name.as_str()).map(|m| m.pattern().as_usize()).or_else(|| find_special(matcher, value)) {
                return Err(TokenizerError::TemplateKwargs {
                    message: format!("`{name}` contains the special token {:?}, which is not allowed in template variables", self.specials[token].content),
                });
            }
        }
        Ok(())
    }

    /// The ids of a chat: the template rendered with `messages`, where the
    /// template's own markers (`<|im_start|>`, `<｜User｜>`, `<s>`, ...) are
    /// special tokens but the messages' contents are plain text, so that a
    /// client cannot forge a turn by typing the markers. Nothing else is
    /// added (the template writes BOS itself).
    ///
    /// Content without any special-token string (nearly all of it) is
    /// encoded exactly as before: the rendered text in one piece. Otherwise
    /// each special-token string in the contents is swapped for a
    /// placeholder character the template, the contents and the special
    /// tokens do not use; the template is rendered with those; the rendered
    /// text is cut at the special tokens left in it, which are the
    /// template's own (with their lstrip/rstrip/single_word options, as the
    /// added vocabulary cuts); and the pieces between them, placeholders put
    /// back, are encoded with special-token parsing off. The cuts are the
    /// ones the added vocabulary makes, so the ids around the contents are
    /// the same as without the forged strings.
    pub fn encode_chat(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<Vec<u32>, TokenizerError> {
        self.encode_chat_with(messages, add_generation_prompt, &ChatTemplateKwargs::new())
    }

    /// [`Tokenizer::encode_chat`] with extra template variables (e.g.
    /// `{"enable_thinking": false}`); see
    /// [`Tokenizer::apply_chat_template_with`]. Encoded as the rendered
    /// text is: nothing is added (a template that writes BOS, like
    /// Mixtral's, gets exactly one).
    pub fn encode_chat_with(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        kwargs: &ChatTemplateKwargs,
    ) -> Result<Vec<u32>, TokenizerError> {
        self.encode_chat_tools(messages, &[], add_generation_prompt, kwargs)
    }

    /// [`Tokenizer::encode_chat_with`] offering `tools` (see
    /// [`Tokenizer::apply_chat_template_tools`]). Everything the client
    /// wrote is plain text here, tool definitions, call names and
    /// arguments, ids and results included: only the template's own
    /// markers (a past call's `<|tool_call_begin|>` among them) are special
    /// tokens.
    pub fn encode_chat_tools(
        &self,
        messages: &[ChatMessage],
        tools: &[Tool],
        add_generation_prompt: bool,
        kwargs: &ChatTemplateKwargs,
    ) -> Result<Vec<u32>, TokenizerError> {
        let (messages, tools) = self.template_tools.template_inputs(messages, tools);
        let render = |messages: &Json, tools: Option<&Json>| self.render_template(messages, tools, add_generation_prompt, kwargs);
        let Some(matcher) = &self.special_matcher else {
            return self.encode_raw(&render(&messages, tools.as_ref())?);
        };
        let has_special = |value: &Json| any_string(value, &mut |s| matcher.is_match(s));
        if !has_special(&messages) && !tools.as_ref().is_some_and(has_special) {
            return self.encode_raw(&render(&messages, tools.as_ref())?);
        }
        // Checked before choosing placeholders, so that the error names
        // the variable.
        self.check_template_kwargs(kwargs)?;
        let kwargs_text = serde_json::to_string(kwargs).unwrap_or_default();
        let client_text = format!("{messages}{}", tools.as_ref().map(Json::to_string).unwrap_or_default());

        // One placeholder per special token that occurs in some client text.
        let mut placeholder_of: HashMap<usize, char> = HashMap::new();
        let mut candidates = PLACEHOLDERS.filter_map(char::from_u32);
        let in_use = |c: char| {
            client_text.contains(c)
                || self.template_source.contains(c)
                || kwargs_text.contains(c)
                || self.bos_token.contains(c)
                || self.eos_token.contains(c)
                || self.specials.iter().any(|t| t.content.contains(c))
        };
        let mut mask = |text: &str| -> Result<String, TokenizerError> {
            let mut masked = String::with_capacity(text.len());
            let mut last = 0;
            for found in matcher.find_iter(text) {
                let token = found.pattern().as_usize();
                let placeholder = match placeholder_of.get(&token) {
                    Some(&c) => c,
                    None => {
                        let c = candidates.by_ref().find(|&c| !in_use(c)).ok_or_else(|| {
                            TokenizerError::TemplateRender {
                                path: self.template_path.clone(),
                                message: "the messages use every placeholder character".into(),
                                reason: None,
                            }
                        })?;
                        placeholder_of.insert(token, c);
                        c
                    }
                };
                masked.push_str(&text[last..found.start()]);
                masked.push(placeholder);
                last = found.end();
            }
            masked.push_str(&text[last..]);
            Ok(masked)
        };
        let masked_messages = map_strings(&messages, &mut mask)?;
        let masked_tools = tools.as_ref().map(|t| map_strings(t, &mut mask)).transpose()?;
        let rendered = render(&masked_messages, masked_tools.as_ref())?;
        let token_of: HashMap<char, &str> = placeholder_of
            .iter()
            .map(|(&token, &c)| (c, self.specials[token].content.as_str()))
            .collect();

        let mut ids = Vec::new();
        let mut piece_start = 0;
        for (token, start, end) in self.template_markers(matcher, &rendered) {
            self.encode_piece(&rendered[piece_start..start], &token_of, &mut ids)?;
            ids.push(token.id);
            piece_start = end;
        }
        self.encode_piece(&rendered[piece_start..], &token_of, &mut ids)?;
        Ok(ids)
    }

    /// The special tokens in `text` and their byte ranges, widened over the
    /// whitespace they absorb, as `tokenizers`' added vocabulary finds them.
    fn template_markers<'a>(
        &'a self,
        matcher: &aho_corasick::AhoCorasick,
        text: &str,
    ) -> Vec<(&'a SpecialToken, usize, usize)> {
        let mut out = Vec::new();
        let mut covered = 0;
        for found in matcher.find_iter(text) {
            let token = &self.specials[found.pattern().as_usize()];
            let (mut start, mut end) = (found.start(), found.end());
            if token.single_word {
                let word_before = text[..start].chars().next_back().is_some_and(is_word_char);
                let word_after = text[end..].chars().next().is_some_and(is_word_char);
                if word_before || word_after {
                    continue;
                }
            }
            if token.lstrip {
                let trimmed = text[..start].trim_end_matches(char::is_whitespace).len();
                start = trimmed.max(covered);
            }
            if token.rstrip {
                end = text.len() - text[end..].trim_start_matches(char::is_whitespace).len();
            }
            // An rstrip token may have absorbed the start of this match.
            if start < covered {
                continue;
            }
            out.push((token, start, end));
            covered = end;
        }
        out
    }

    /// Encodes one piece of rendered text between markers as plain text,
    /// placeholders put back.
    fn encode_piece(
        &self,
        piece: &str,
        token_of: &HashMap<char, &str>,
        ids: &mut Vec<u32>,
    ) -> Result<(), TokenizerError> {
        if piece.is_empty() {
            return Ok(());
        }
        let text: String = piece
            .chars()
            .fold(String::with_capacity(piece.len()), |mut s, c| {
                match token_of.get(&c) {
                    Some(token) => s.push_str(token),
                    None => s.push(c),
                }
                s
            });
        ids.extend(self.encode_with(&self.plain, &text)?);
        Ok(())
    }

    /// Decode ids to text, skipping special tokens.
    ///
    /// Model embedding tables are padded past the tokenizer (e.g. 2112 rows
    /// for 2048 tokens), so a sampler can produce ids with no token; those
    /// decode to nothing. Bytes that do not form valid UTF-8 become U+FFFD.
    pub fn decode(&self, ids: &[u32]) -> String {
        self.decode_keeping(ids, &[])
    }

    /// [`Tokenizer::decode`], but the special tokens in `keep` are written
    /// out as their text: a tool-using request keeps the tool-call markup
    /// that is special in the model's vocabulary (Kimi-K2's
    /// `<|tool_call_begin|>`, see [`Tokenizer::tool_markup_ids`]) so that
    /// the tool-call parser sees it, while end-of-turn tokens still vanish.
    pub fn decode_keeping(&self, ids: &[u32], keep: &[u32]) -> String {
        let added = self.inner.get_added_vocabulary();
        let Some(steps) = &self.byte_fallback_steps else {
            // `tokenizers` already drops unknown ids; the only remaining
            // failure is a decoder error, which for a response stream is
            // better shown as missing text than as a failed request.
            if keep.is_empty() {
                return self.inner.decode(ids, true).unwrap_or_default();
            }
            let kept: Vec<u32> = ids
                .iter()
                .copied()
                .filter(|id| keep.contains(id) || self.inner.id_to_token(*id).is_some_and(|t| !added.is_special_token(&t)))
                .collect();
            return self.inner.decode(&kept, false).unwrap_or_default();
        };
        // What `tokenizers::Tokenizer::decode` does (unknown ids and special
        // tokens dropped, then the decoder chain), with the lossy byte step.
        let mut tokens: Vec<String> = ids
            .iter()
            .filter_map(|&id| self.inner.id_to_token(id).map(|t| (id, t)))
            .filter(|(id, t)| keep.contains(id) || !added.is_special_token(t))
            .map(|(_, t)| t)
            .collect();
        for step in steps {
            tokens = match step {
                DecodeStep::Builtin(decoder) => match tokenizers::Decoder::decode_chain(decoder, tokens) {
                    Ok(tokens) => tokens,
                    Err(_) => return String::new(),
                },
                DecodeStep::LossyBytes => lossy_byte_fallback(tokens),
            };
        }
        tokens.concat()
    }

    /// The ids of `format`'s markup strings that are special tokens in
    /// this vocabulary, which [`Tokenizer::decode`] would drop: the router
    /// decodes a tool-using request's output with these kept
    /// ([`Tokenizer::decode_keeping`], [`IncrementalDecoder::keeping`]).
    /// Markup that is ordinary text or not a single token needs nothing.
    pub fn tool_markup_ids(&self, format: ToolFormat) -> Vec<u32> {
        format.markup().iter().filter_map(|text| self.special_token_id(text)).collect()
    }

    /// The id of `text` if it is a special token (one that
    /// [`Tokenizer::decode`] drops and a grammar names as `<text>` rather
    /// than as a string).
    pub fn special_token_id(&self, text: &str) -> Option<u32> {
        self.specials.iter().find(|t| t.content == text).map(|t| t.id)
    }

    /// Tokenizer vocabulary size including added tokens. May be smaller than
    /// the model's vocabulary (see [`Tokenizer::decode`]).
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// Bytes of the longest string in the vocabulary, added tokens
    /// included. No token stands for more text than that: byte-level and
    /// SentencePiece vocabularies spell each byte or space with at least one
    /// byte. Bounds how much text a given number of tokens can hold.
    pub fn max_token_bytes(&self) -> usize {
        self.inner
            .get_vocab(true)
            .keys()
            .map(String::len)
            .max()
            .unwrap_or(0)
    }

    /// The BOS id, if the tokenizer or model config defines one.
    pub fn bos_token_id(&self) -> Option<u32> {
        self.bos_id
    }

    /// Every id that ends generation.
    pub fn eos_token_ids(&self) -> &[u32] {
        &self.eos_ids
    }

    /// The raw token string (e.g. `Ġhello` for byte-level BPE), for logprob
    /// display. `None` for ids outside the vocabulary.
    pub fn token_text(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// The bytes token `id` stands for in generated text, and whether it is
    /// a special token (a control marker such as `<|im_end|>`, whose string
    /// is never text). `None` for ids outside the vocabulary. A grammar
    /// engine needs this to know which tokens can spell what.
    ///
    /// Added tokens are their content as written. Otherwise: a byte-level
    /// vocabulary (GPT-2's byte alphabet, as DeepSeek, Qwen, Kimi and GGUF
    /// `gpt2` models use) maps each character back to its byte; a
    /// SentencePiece vocabulary reads `<0xNN>` as byte NN and `▁` as a space.
    /// A decoder that strips the first space of the text (SentencePiece's
    /// `Strip`) is not applied: that space belongs to the prompt's first
    /// token, not to a generated one.
    pub fn token_bytes(&self, id: u32) -> Option<(Vec<u8>, bool)> {
        use tokenizers::DecoderWrapper as D;
        if let Some(added) = self.inner.get_added_vocabulary().get_added_tokens_decoder().get(&id) {
            return Some((added.content.as_bytes().to_vec(), added.special));
        }
        let token = self.inner.id_to_token(id)?;
        let is = |want: fn(&D) -> bool| match self.inner.get_decoder() {
            Some(D::Sequence(seq)) => seq.get_decoders().iter().any(want),
            Some(d) => want(d),
            None => false,
        };
        if is(|d| matches!(d, D::ByteLevel(_))) {
            // GPT-2's alphabet: printable Latin-1 bytes stand for
            // themselves, the other 68 bytes are U+0100.. in byte order.
            let printable = |b: u32| (0x21..=0x7E).contains(&b) || (0xA1..=0xAC).contains(&b) || (0xAE..=0xFF).contains(&b);
            let shifted: Vec<u8> = (0..=255u8).filter(|&b| !printable(u32::from(b))).collect();
            let bytes = token
                .chars()
                .map(|c| match u32::from(c) {
                    b if printable(b) => u8::try_from(b).ok(),
                    b => b.checked_sub(0x100).and_then(|i| shifted.get(i as usize).copied()),
                })
                .collect::<Option<Vec<u8>>>();
            // A token outside the alphabet (possible only in a hand-made
            // vocabulary) is taken as its own text.
            return Some((bytes.unwrap_or_else(|| token.into_bytes()), false));
        }
        if self.byte_fallback_steps.is_some() {
            let byte = (token.len() == 6 && token.starts_with("<0x") && token.ends_with('>')).then(|| u8::from_str_radix(&token[3..5], 16).ok()).flatten();
            if let Some(b) = byte {
                return Some((vec![b], false));
            }
        }
        if is(|d| matches!(d, D::Metaspace(_) | D::Replace(_))) {
            return Some((token.replace('\u{2581}', " ").into_bytes(), false));
        }
        Some((token.into_bytes(), false))
    }
}

/// Streaming detokenizer using the prefix/read-offset algorithm of TGI and
/// vLLM.
///
/// Decoding one token at a time is wrong twice over: byte-level BPE splits
/// multi-byte characters (emoji, CJK) across tokens, and some decoders
/// change a token's text depending on its neighbours (leading spaces). So
/// each push re-decodes a short window `ids[prefix_offset..]` and emits only
/// what it adds beyond `ids[prefix_offset..read_offset]`, and only once the
/// result no longer ends in U+FFFD (an incomplete character). Concatenating
/// all pushes plus [`IncrementalDecoder::finish`] equals
/// [`Tokenizer::decode`] of all pushed ids.
#[derive(Clone, Debug, Default)]
pub struct IncrementalDecoder {
    /// The current window; ids before it have been dropped to keep memory
    /// and re-decoding cost bounded for long generations.
    ids: Vec<u32>,
    /// Special tokens written out rather than dropped
    /// ([`Tokenizer::decode_keeping`]).
    keep: Vec<u32>,
    /// Start of the context whose text has already been emitted.
    prefix_offset: usize,
    /// End of the emitted part of the window.
    read_offset: usize,
}

impl IncrementalDecoder {
    /// A decoder with no context.
    pub fn new() -> Self {
        Self::default()
    }

    /// A decoder seeded with the tail of the prompt as (never emitted)
    /// context, so that decoders which strip or add a leading space on the
    /// first token (SentencePiece-style) space the first generated token as
    /// it would be inside the full text. Byte-level BPE does not need it.
    pub fn with_prompt(tok: &Tokenizer, prompt_ids: &[u32]) -> Self {
        let mut ctx = &prompt_ids[prompt_ids.len().saturating_sub(PROMPT_CONTEXT_IDS)..];
        // A context ending mid-character would make the emitted-text boundary
        // fall inside a character; drop the incomplete tail (at most three
        // ids, as a UTF-8 character has at most three continuation bytes).
        while !ctx.is_empty() && tok.decode(ctx).ends_with('\u{FFFD}') {
            ctx = &ctx[..ctx.len() - 1];
        }
        Self {
            ids: ctx.to_vec(),
            keep: Vec::new(),
            prefix_offset: 0,
            read_offset: ctx.len(),
        }
    }

    /// The decoder writing out the special tokens in `keep` (e.g.
    /// [`Tokenizer::tool_markup_ids`]) instead of dropping them.
    pub fn keeping(mut self, keep: Vec<u32>) -> Self {
        self.keep = keep;
        self
    }

    /// Add one id and return the text it completes ("" when nothing new is
    /// ready yet: an incomplete character, a special token or an id outside
    /// the vocabulary).
    pub fn push(&mut self, tok: &Tokenizer, id: u32) -> String {
        self.ids.push(id);
        self.step(tok, false)
    }

    /// Return whatever was held back (e.g. a truncated character at the end
    /// of generation, which then shows as U+FFFD just as in a full decode).
    pub fn finish(&mut self, tok: &Tokenizer) -> String {
        self.step(tok, true)
    }

    fn step(&mut self, tok: &Tokenizer, flush: bool) -> String {
        let prefix_text = tok.decode_keeping(&self.ids[self.prefix_offset..self.read_offset], &self.keep);
        let new_text = tok.decode_keeping(&self.ids[self.prefix_offset..], &self.keep);
        if new_text.len() <= prefix_text.len() || (!flush && new_text.ends_with('\u{FFFD}')) {
            return String::new();
        }
        // `get` rather than indexing: a decoder that rewrote earlier text
        // could put the old length inside a character; hold back then
        // instead of panicking.
        let Some(delta) = new_text.get(prefix_text.len()..) else {
            return String::new();
        };
        let delta = delta.to_owned();
        // The old read window becomes the new context; everything before it
        // is never looked at again.
        self.ids.drain(..self.read_offset);
        self.prefix_offset = 0;
        self.read_offset = self.ids.len();
        delta
    }
}

/// The decoder's steps with `ByteFallback` made lossy ([`DecodeStep`]), when
/// it has one: alone, or in a top-level `Sequence` (the SentencePiece
/// conversions' `Replace("▁", " "), ByteFallback, Fuse, Strip`).
fn byte_fallback_steps(decoder: Option<&tokenizers::DecoderWrapper>) -> Option<Vec<DecodeStep>> {
    use tokenizers::DecoderWrapper as D;
    let step = |d: &D| match d {
        D::ByteFallback(_) => DecodeStep::LossyBytes,
        other => DecodeStep::Builtin(other.clone()),
    };
    match decoder? {
        D::ByteFallback(_) => Some(vec![DecodeStep::LossyBytes]),
        D::Sequence(seq) if seq.get_decoders().iter().any(|d| matches!(d, D::ByteFallback(_))) => {
            Some(seq.get_decoders().iter().map(step).collect())
        }
        _ => None,
    }
}

/// `ByteFallback`'s step with lossy UTF-8 (see [`DecodeStep::LossyBytes`]):
/// each run of `<0xHH>` tokens becomes one token of its text.
fn lossy_byte_fallback(tokens: Vec<String>) -> Vec<String> {
    let byte_of = |t: &str| {
        (t.len() == 6 && t.starts_with("<0x") && t.ends_with('>')).then(|| u8::from_str_radix(&t[3..5], 16).ok()).flatten()
    };
    let mut out = Vec::with_capacity(tokens.len());
    let mut run: Vec<u8> = Vec::new();
    for token in tokens {
        match byte_of(&token) {
            Some(b) => run.push(b),
            None => {
                if !run.is_empty() {
                    out.push(String::from_utf8_lossy(&run).into_owned());
                    run.clear();
                }
                out.push(token);
            }
        }
    }
    if !run.is_empty() {
        out.push(String::from_utf8_lossy(&run).into_owned());
    }
    out
}

/// Whether `pred` holds for some string in `value`, object keys included.
fn any_string(value: &Json, pred: &mut impl FnMut(&str) -> bool) -> bool {
    match value {
        Json::String(s) => pred(s),
        Json::Array(items) => items.iter().any(|v| any_string(v, pred)),
        Json::Object(map) => map.iter().any(|(k, v)| pred(k) || any_string(v, pred)),
        Json::Null | Json::Bool(_) | Json::Number(_) => false,
    }
}

/// `value` with `f` applied to every string in it, object keys included.
fn map_strings<E>(value: &Json, f: &mut impl FnMut(&str) -> Result<String, E>) -> Result<Json, E> {
    Ok(match value {
        Json::String(s) => Json::String(f(s)?),
        Json::Array(items) => Json::Array(items.iter().map(|v| map_strings(v, f)).collect::<Result<_, E>>()?),
        Json::Object(map) => {
            let mut out = serde_json::Map::with_capacity(map.len());
            for (k, v) in map {
                out.insert(f(k)?, map_strings(v, f)?);
            }
            Json::Object(out)
        }
        other => other.clone(),
    })
}

/// Reads a JSON file that checkpoints may omit: absent is `None`, anything
/// unreadable or malformed is an error naming the file.
fn read_optional_json(path: &Path) -> Result<Option<Json>, TokenizerError> {
    let text = match fs::read_to_string(path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(source) => {
            return Err(TokenizerError::Io {
                path: path.to_owned(),
                source,
            })
        }
    };
    serde_json::from_str(&text)
        .map(Some)
        .map_err(|source| TokenizerError::Json {
            path: path.to_owned(),
            source,
        })
}

/// Field `field` of an optional JSON object; JSON `null` counts as absent
/// because HF writes `"bos_token": null` for tokenizers without one.
fn field<'a>(json: Option<&'a Json>, field: &str) -> Option<&'a Json> {
    json.and_then(|j| j.get(field)).filter(|v| !v.is_null())
}

/// A special-token field that HF writes either as a plain string or as a
/// serialized `AddedToken` (`{"content": "...", "lstrip": false, ...}`).
fn token_string(
    json: Option<&Json>,
    path: &Path,
    name: &'static str,
) -> Result<Option<String>, TokenizerError> {
    let Some(value) = field(json, name) else {
        return Ok(None);
    };
    let text = match value {
        Json::String(s) => Some(s.as_str()),
        Json::Object(obj) => obj.get("content").and_then(Json::as_str),
        _ => None,
    };
    text.map(|s| Some(s.to_owned()))
        .ok_or_else(|| TokenizerError::Field {
            path: path.to_owned(),
            field: name,
            message: format!("must be a string or an object with a string `content`, got {value}"),
        })
}

/// A token-id field that may be a single id or a list of ids (chat models
/// list several EOS ids in `generation_config.json`).
fn token_ids(
    json: Option<&Json>,
    path: &Path,
    name: &'static str,
) -> Result<Vec<u32>, TokenizerError> {
    let Some(value) = field(json, name) else {
        return Ok(Vec::new());
    };
    let bad = || TokenizerError::Field {
        path: path.to_owned(),
        field: name,
        message: format!("must be a token id or a list of token ids (0..2^32), got {value}"),
    };
    let as_id = |v: &Json| v.as_u64().and_then(|n| u32::try_from(n).ok());
    match value {
        Json::Array(items) => items.iter().map(|v| as_id(v).ok_or_else(bad)).collect(),
        v => as_id(v).map(|id| vec![id]).ok_or_else(bad),
    }
}

fn optional_bool(
    json: Option<&Json>,
    path: &Path,
    name: &'static str,
) -> Result<Option<bool>, TokenizerError> {
    field(json, name)
        .map(|v| {
            v.as_bool().ok_or_else(|| TokenizerError::Field {
                path: path.to_owned(),
                field: name,
                message: format!("must be true or false, got {v}"),
            })
        })
        .transpose()
}

/// Finds the chat template source and the file it came from. Returns the
/// path even without a template so that "no template" errors can name where
/// one was expected.
fn load_template_source(
    dir: &Path,
    tc: Option<&Json>,
    tc_path: &Path,
) -> Result<(PathBuf, Option<String>), TokenizerError> {
    let jinja_path = dir.join("chat_template.jinja");
    match fs::read_to_string(&jinja_path) {
        Ok(src) => return Ok((jinja_path, Some(src))),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(source) => {
            return Err(TokenizerError::Io {
                path: jinja_path,
                source,
            })
        }
    }
    let bad = |value: &Json| TokenizerError::Field {
        path: tc_path.to_owned(),
        field: "chat_template",
        message: format!(
            "must be a string or a list of {{\"name\", \"template\"}} objects, got {value}"
        ),
    };
    let source = match field(tc, "chat_template") {
        None => None,
        Some(Json::String(s)) => Some(s.clone()),
        // Multi-template form: HF uses the one named "default" for plain
        // chat (the others are e.g. "tool_use" or "rag").
        Some(value @ Json::Array(list)) => {
            let named = |name: &str| {
                list.iter()
                    .find(|t| t.get("name").and_then(Json::as_str) == Some(name))
            };
            let entry = named("default")
                .or(list.first())
                .ok_or_else(|| bad(value))?;
            let template = entry.get("template").and_then(Json::as_str);
            Some(template.ok_or_else(|| bad(value))?.to_owned())
        }
        Some(value) => return Err(bad(value)),
    };
    Ok((tc_path.to_owned(), source))
}

/// Builds a Jinja environment that behaves like the one `transformers`
/// renders chat templates with, and compiles `source` into it.
fn build_env(source: String) -> Result<Environment<'static>, JinjaError> {
    let mut env = Environment::new();
    // transformers: ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.set_trim_blocks(true);
    env.set_lstrip_blocks(true);
    // Templates call Python string/dict methods (.strip(), .split(), .items()).
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_function(
        "raise_exception",
        |msg: String| -> Result<Value, JinjaError> {
            Err(JinjaError::new(JinjaErrorKind::InvalidOperation, format!("{RAISED}{msg}")))
        },
    );
    // transformers' own `tojson` (Python's `json.dumps`), not minijinja's.
    env.add_filter("tojson", crate::tools::python_tojson);
    env.add_function("strftime_now", |fmt: String| {
        let secs = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        format_utc(secs, &fmt)
    });
    env.add_template_owned(TEMPLATE_NAME, source)?;
    Ok(env)
}

/// How `raise_exception` marks its message, so that [`raised_reason`] can
/// tell the template's own refusal from minijinja's invalid operations.
const RAISED: &str = "raise_exception: ";

/// The message a template passed to `raise_exception`, if that is what
/// failed (at any depth of the cause chain: a macro or include may raise).
fn raised_reason(e: &JinjaError) -> Option<String> {
    let mut error: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(current) = error {
        if let Some(reason) = current.downcast_ref::<JinjaError>().and_then(JinjaError::detail).and_then(|d| d.strip_prefix(RAISED)) {
            return Some(reason.to_owned());
        }
        error = current.source();
    }
    None
}

/// A minijinja error with its cause chain, since `raise_exception` messages
/// and syntax details are what the operator needs to see.
fn jinja_message(e: &JinjaError) -> String {
    let mut message = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(cause) = source {
        message.push_str(": ");
        message.push_str(&cause.to_string());
        source = cause.source();
    }
    message
}

const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];
const WEEKDAYS: [&str; 7] = [
    "Monday",
    "Tuesday",
    "Wednesday",
    "Thursday",
    "Friday",
    "Saturday",
    "Sunday",
];

/// `strftime` for templates that print today's date (Llama 3 style
/// `strftime_now("%d %b %Y")`). UTC, because a server's local time zone is
/// arbitrary and pulling in a time-zone database for a date line is not
/// worth it. Supports `%Y %y %m %d %e %B %b %A %a %H %M %S %j %%`, with `-`
/// (no padding, as in `%-d`); anything else is copied through.
fn format_utc(unix_secs: u64, fmt: &str) -> String {
    let days = unix_secs / 86_400;
    let secs_of_day = unix_secs % 86_400;
    let (year, month, day) = civil_from_days(days);
    let weekday = ((days + 3) % 7) as usize; // 1970-01-01 was a Thursday.
    let day_of_year = days - days_before_year(year) + 1;

    let mut out = String::with_capacity(fmt.len() + 16);
    let mut chars = fmt.chars().peekable();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let no_pad = chars.next_if_eq(&'-').is_some();
        let num = |n: u64, width: usize| -> Cow<'static, str> {
            if no_pad {
                n.to_string().into()
            } else {
                format!("{n:0width$}").into()
            }
        };
        let piece: Cow<'static, str> = match chars.next() {
            Some('Y') => year.to_string().into(),
            Some('y') => num(year % 100, 2),
            Some('m') => num(month, 2),
            Some('d') => num(day, 2),
            Some('e') => format!("{day:2}").into(),
            Some('j') => num(day_of_year, 3),
            Some('H') => num(secs_of_day / 3600, 2),
            Some('M') => num(secs_of_day / 60 % 60, 2),
            Some('S') => num(secs_of_day % 60, 2),
            Some('B') => MONTHS[month as usize - 1].into(),
            Some('b') => MONTHS[month as usize - 1][..3].into(),
            Some('A') => WEEKDAYS[weekday].into(),
            Some('a') => WEEKDAYS[weekday][..3].into(),
            Some('%') => "%".into(),
            Some(other) => format!("%{}{other}", if no_pad { "-" } else { "" }).into(),
            None => if no_pad { "%-" } else { "%" }.into(),
        };
        out.push_str(&piece);
    }
    out
}

/// Days since 1970-01-01 to (year, month 1..=12, day 1..=31) in the
/// proleptic Gregorian calendar (Howard Hinnant's `civil_from_days`).
fn civil_from_days(days: u64) -> (u64, u64, u64) {
    let z = days + 719_468;
    let era = z / 146_097;
    let doe = z % 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + u64::from(month <= 2);
    (year, month, day)
}

/// Days from 1970-01-01 to January 1st of `year` (`year >= 1970`).
fn days_before_year(year: u64) -> u64 {
    let leaps = |y: u64| y / 4 - y / 100 + y / 400;
    (year - 1970) * 365 + leaps(year - 1) - leaps(1969)
}

#[cfg(test)]
mod tests {
    use super::*;

    const FIXTURE: &str = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../tests/fixtures/tiny-dsv3"
    );
    const BOS: &str = "<｜begin▁of▁sentence｜>";
    const SAMPLES: &[&str] = &[
        "Hello, world! The quick brown fox.",
        "héllo 世界 🙂",
        "  leading spaces and\nnewlines\t",
        "🙂🙂 日本語のテキスト — ok",
    ];

    fn fixture() -> Tokenizer {
        Tokenizer::from_dir(Path::new(FIXTURE)).expect("fixture tokenizer loads")
    }

    fn msg(role: &str, content: &str) -> ChatMessage {
        ChatMessage::new(role, content)
    }

    /// A temp dir holding the fixture's tokenizer.json plus the given files.
    fn dir_with(files: &[(&str, &str)]) -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        fs::copy(
            Path::new(FIXTURE).join("tokenizer.json"),
            dir.path().join("tokenizer.json"),
        )
        .unwrap();
        for (name, text) in files {
            fs::write(dir.path().join(name), text).unwrap();
        }
        dir
    }

    fn stream(tok: &Tokenizer, ids: &[u32]) -> (Vec<String>, String) {
        let mut dec = IncrementalDecoder::new();
        let pieces: Vec<String> = ids.iter().map(|&id| dec.push(tok, id)).collect();
        let tail = dec.finish(tok);
        (pieces, tail)
    }

    #[test]
    fn loads_fixture_metadata() {
        let tok = fixture();
        assert_eq!(tok.vocab_size(), 2048);
        assert_eq!(tok.bos_token_id(), Some(0));
        assert_eq!(tok.eos_token_ids(), &[1]);
        assert_eq!(tok.token_text(0).as_deref(), Some(BOS));
        assert_eq!(tok.token_text(5000), None);
    }

    #[test]
    fn encode_adds_exactly_one_bos() {
        let tok = fixture();
        let ids = tok.encode("Hello world").unwrap();
        assert_eq!(ids[0], 0);
        assert_eq!(ids.iter().filter(|&&id| id == 0).count(), 1);
        assert_eq!(&ids[1..], tok.encode_raw("Hello world").unwrap());
        // Text that already starts with BOS does not get a second one.
        let pre = tok.encode(&format!("{BOS}Hello world")).unwrap();
        assert_eq!(pre, ids);
        // Empty text is just BOS.
        assert_eq!(tok.encode("").unwrap(), vec![0]);
    }

    #[test]
    fn encode_respects_add_bos_token_false() {
        let dir = dir_with(&[(
            "tokenizer_config.json",
            r#"{"add_bos_token": false, "bos_token": {"content": "<｜begin▁of▁sentence｜>"}}"#,
        )]);
        let tok = Tokenizer::from_dir(dir.path()).unwrap();
        assert_eq!(tok.bos_token_id(), Some(0));
        assert_eq!(tok.encode("Hi").unwrap(), tok.encode_raw("Hi").unwrap());
        assert_ne!(tok.encode("Hi").unwrap()[0], 0);
    }

    #[test]
    fn encode_raw_keeps_special_tokens_whole() {
        let tok = fixture();
        let prompt = tok
            .apply_chat_template(&[msg("user", "Hi there")], true)
            .unwrap();
        let ids = tok.encode_raw(&prompt).unwrap();
        assert_eq!(ids[0], 0, "BOS from the template, as one id");
        assert_eq!(ids[1], 2, "<｜User｜> as one id");
        assert_eq!(*ids.last().unwrap(), 3, "<｜Assistant｜> as one id");
        assert_eq!(ids.iter().filter(|&&id| id == 0).count(), 1);
        assert_eq!(&ids[2..ids.len() - 1], tok.encode_raw("Hi there").unwrap());
    }

    #[test]
    fn chat_template_renders_system_user_with_generation_prompt() {
        let tok = fixture();
        let messages = [msg("system", "You are helpful."), msg("user", "Hi")];
        let text = tok.apply_chat_template(&messages, true).unwrap();
        assert_eq!(
            text,
            "<｜begin▁of▁sentence｜>You are helpful.<｜User｜>Hi<｜Assistant｜>"
        );
        let text = tok.apply_chat_template(&messages, false).unwrap();
        assert_eq!(text, "<｜begin▁of▁sentence｜>You are helpful.<｜User｜>Hi");
    }

    #[test]
    fn chat_template_multi_turn() {
        let tok = fixture();
        let messages = [msg("user", "a"), msg("assistant", "b"), msg("user", "c")];
        let text = tok.apply_chat_template(&messages, true).unwrap();
        assert_eq!(
            text,
            "<｜begin▁of▁sentence｜><｜User｜>a<｜Assistant｜>b<｜end▁of▁sentence｜><｜User｜>c<｜Assistant｜>"
        );
    }

    #[test]
    fn round_trip_decode() {
        let tok = fixture();
        for text in SAMPLES {
            let ids = tok.encode(text).unwrap();
            assert_eq!(&tok.decode(&ids), text, "ids {ids:?}");
            assert_eq!(&tok.decode(&tok.encode_raw(text).unwrap()), text);
        }
    }

    #[test]
    fn decode_skips_special_tokens() {
        let tok = fixture();
        let mut ids = tok.encode("Hi").unwrap();
        ids.extend([2, 3, 1]);
        assert_eq!(tok.decode(&ids), "Hi");
    }

    #[test]
    fn incremental_matches_full_decode_without_mid_stream_fffd() {
        let tok = fixture();
        for text in SAMPLES {
            let ids = tok.encode(text).unwrap();
            let (pieces, tail) = stream(&tok, &ids);
            for p in &pieces {
                assert!(!p.contains('\u{FFFD}'), "{text:?}: emitted {p:?}");
            }
            let streamed = pieces.concat() + &tail;
            assert_eq!(streamed, tok.decode(&ids), "{text:?}");
            assert_eq!(&streamed, text);
        }
    }

    #[test]
    fn incremental_holds_back_split_characters() {
        let tok = fixture();
        // Find a sample where some token ends mid-character: there the
        // decoder must emit nothing rather than a replacement character.
        let ids = tok.encode_raw("🙂").unwrap();
        assert!(ids.len() > 1, "fixture should split the emoji: {ids:?}");
        let (pieces, tail) = stream(&tok, &ids);
        assert!(pieces[..ids.len() - 1].iter().all(String::is_empty));
        assert_eq!(pieces.last().unwrap(), "🙂");
        assert_eq!(tail, "");
    }

    #[test]
    fn incremental_finish_flushes_truncated_character() {
        let tok = fixture();
        let ids = tok.encode_raw("a🙂").unwrap();
        let cut = &ids[..ids.len() - 1];
        let (pieces, tail) = stream(&tok, cut);
        assert_eq!(pieces.concat() + &tail, tok.decode(cut));
        assert!(tail.ends_with('\u{FFFD}'));
    }

    #[test]
    fn incremental_with_prompt_context() {
        let tok = fixture();
        let prompt = tok.encode("Once upon a time").unwrap();
        let gen = tok.encode_raw(" there was 世界").unwrap();
        let mut dec = IncrementalDecoder::with_prompt(&tok, &prompt);
        let mut out: String = gen.iter().map(|&id| dec.push(&tok, id)).collect();
        out += &dec.finish(&tok);
        assert_eq!(out, " there was 世界");
    }

    #[test]
    fn padded_vocab_ids_decode_to_nothing() {
        let tok = fixture();
        let padded = [2048, 2050, 2111, u32::MAX];
        assert_eq!(tok.decode(&padded), "");
        let mut ids = tok.encode_raw("ok").unwrap();
        ids.extend(padded);
        assert_eq!(tok.decode(&ids), "ok");
        let (pieces, tail) = stream(&tok, &ids);
        assert_eq!(pieces.concat() + &tail, "ok");
        let mut dec = IncrementalDecoder::new();
        for id in padded {
            assert_eq!(dec.push(&tok, id), "");
        }
        assert_eq!(dec.finish(&tok), "");
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(64))]
        /// Arbitrary id sequences, including ones the model could sample but
        /// the tokenizer does not know (ids up to the padded 2112 rows) and
        /// byte tokens that form invalid UTF-8: the stream still equals the
        /// full decode and nothing panics.
        #[test]
        fn incremental_equals_full_decode_for_any_ids(
            ids in proptest::collection::vec(0u32..2112, 0..48),
        ) {
            let tok = fixture();
            let (pieces, tail) = stream(&tok, &ids);
            proptest::prop_assert_eq!(pieces.concat() + &tail, tok.decode(&ids));
        }
    }

    #[test]
    fn missing_dir_names_tokenizer_json() {
        let err = Tokenizer::from_dir(Path::new("/nonexistent/duplex-model")).unwrap_err();
        assert!(matches!(err, TokenizerError::Io { .. }), "{err:?}");
        assert!(err.to_string().contains("tokenizer.json"), "{err}");
    }

    #[test]
    fn garbage_tokenizer_json_names_file() {
        let dir = tempfile::tempdir().unwrap();
        fs::write(dir.path().join("tokenizer.json"), "{ not a tokenizer").unwrap();
        let err = Tokenizer::from_dir(dir.path()).unwrap_err();
        assert!(matches!(err, TokenizerError::Load { .. }), "{err:?}");
        assert!(err.to_string().contains("tokenizer.json"), "{err}");
    }

    #[test]
    fn garbage_side_files_name_file_and_field() {
        let dir = dir_with(&[("generation_config.json", "{oops")]);
        let err = Tokenizer::from_dir(dir.path()).unwrap_err();
        assert!(err.to_string().contains("generation_config.json"), "{err}");

        let dir = dir_with(&[("generation_config.json", r#"{"eos_token_id": [1, -3]}"#)]);
        let err = Tokenizer::from_dir(dir.path()).unwrap_err().to_string();
        assert!(
            err.contains("generation_config.json") && err.contains("eos_token_id"),
            "{err}"
        );

        let dir = dir_with(&[("tokenizer_config.json", r#"{"eos_token": "<nope>"}"#)]);
        let err = Tokenizer::from_dir(dir.path()).unwrap_err().to_string();
        assert!(
            err.contains("tokenizer_config.json") && err.contains("eos_token"),
            "{err}"
        );
    }

    #[test]
    fn bad_template_names_file() {
        let dir = dir_with(&[(
            "tokenizer_config.json",
            r#"{"chat_template": "{% for m in messages %}{{ m.content }"}"#,
        )]);
        let err = Tokenizer::from_dir(dir.path()).unwrap_err();
        assert!(
            matches!(err, TokenizerError::TemplateSyntax { .. }),
            "{err:?}"
        );
        assert!(err.to_string().contains("tokenizer_config.json"), "{err}");
    }

    #[test]
    fn no_template_is_an_error() {
        let dir = dir_with(&[]);
        let tok = Tokenizer::from_dir(dir.path()).unwrap();
        let err = tok
            .apply_chat_template(&[msg("user", "x")], true)
            .unwrap_err();
        assert!(
            matches!(err, TokenizerError::NoChatTemplate { .. }),
            "{err:?}"
        );
    }

    #[test]
    fn raise_exception_surfaces_as_error() {
        let template = r#"{% if messages[0]['role'] != 'user' %}{{ raise_exception('Conversation must start with user') }}{% endif %}ok"#;
        let config = serde_json::json!({ "chat_template": template }).to_string();
        let dir = dir_with(&[("tokenizer_config.json", &config)]);
        let tok = Tokenizer::from_dir(dir.path()).unwrap();
        assert_eq!(
            tok.apply_chat_template(&[msg("user", "x")], false).unwrap(),
            "ok"
        );
        let err = tok
            .apply_chat_template(&[msg("assistant", "x")], false)
            .unwrap_err();
        assert!(
            matches!(err, TokenizerError::TemplateRender { .. }),
            "{err:?}"
        );
        assert!(
            err.to_string()
                .contains("Conversation must start with user"),
            "{err}"
        );
    }

    #[test]
    fn side_file_fallbacks_and_eos_union() {
        // No tokenizer_config.json: BOS/EOS come from the model configs, and
        // EOS ids from both files are merged without duplicates.
        let dir = dir_with(&[
            ("generation_config.json", r#"{"eos_token_id": [1, 3]}"#),
            ("config.json", r#"{"bos_token_id": 0, "eos_token_id": 1}"#),
        ]);
        let tok = Tokenizer::from_dir(dir.path()).unwrap();
        assert_eq!(tok.bos_token_id(), Some(0));
        assert_eq!(tok.eos_token_ids(), &[1, 3]);
        assert_eq!(tok.encode("x").unwrap()[0], 0);
    }

    #[test]
    fn template_environment_matches_transformers() {
        let template = "{% for m in messages %}\n  {{ m['content'].strip().upper() }}|\n{% endfor %}{{ eos_token }}{{ strftime_now('%Y') | length }}";
        let config = serde_json::json!({
            "chat_template": template,
            "eos_token": "<｜end▁of▁sentence｜>",
        })
        .to_string();
        let dir = dir_with(&[("tokenizer_config.json", &config)]);
        let tok = Tokenizer::from_dir(dir.path()).unwrap();
        let text = tok
            .apply_chat_template(&[msg("user", " a "), msg("user", "b")], false)
            .unwrap();
        // trim_blocks eats the newline after a block tag, lstrip_blocks the
        // indentation before one; the expression line keeps its own.
        assert_eq!(text, "  A|\n  B|\n<｜end▁of▁sentence｜>4");
    }

    #[test]
    fn chat_template_jinja_file_and_template_list() {
        let dir = dir_with(&[(
            "tokenizer_config.json",
            r#"{"chat_template": [{"name": "tool_use", "template": "tools"}, {"name": "default", "template": "plain"}]}"#,
        )]);
        let tok = Tokenizer::from_dir(dir.path()).unwrap();
        assert_eq!(tok.apply_chat_template(&[], false).unwrap(), "plain");

        fs::write(dir.path().join("chat_template.jinja"), "from file").unwrap();
        let tok = Tokenizer::from_dir(dir.path()).unwrap();
        assert_eq!(tok.apply_chat_template(&[], false).unwrap(), "from file");
    }

    #[test]
    fn strftime_formats_utc() {
        // 2024-02-29T13:05:09Z, a Thursday and day 60 of a leap year.
        let t = 1_709_211_909;
        assert_eq!(format_utc(t, "%Y-%m-%d %H:%M:%S"), "2024-02-29 13:05:09");
        assert_eq!(
            format_utc(t, "%d %B %Y / %b %-d %y"),
            "29 February 2024 / Feb 29 24"
        );
        assert_eq!(format_utc(t, "%A %a %j %% %Q"), "Thursday Thu 060 % %Q");
        assert_eq!(format_utc(0, "%Y-%m-%d %A"), "1970-01-01 Thursday");
        assert_eq!(format_utc(951_782_400, "%Y-%m-%d"), "2000-02-29");
        assert_eq!(format_utc(t, "trailing %"), "trailing %");
    }
}
