//! The one internal request type both front doors build, and its
//! validation: every check a client can fail happens here, before any
//! worker sees the request, and names the field to blame.

use crate::config::RouterConfig;
use crate::error::Error;
use duplex_grammar::{ConstraintSpec, GrammarCompiler, GrammarError};
use duplex_text::sampling_defaults;
use duplex_text::sampling::{SamplingError, SamplingParams, MAX_LOGPROBS};
use duplex_text::tools::Tool;
use duplex_text::tokenizer::{ChatMessage, ChatTemplateKwargs, Tokenizer, TokenizerError};
use duplex_text::ServedConfig;
use duplex_proto::worker;
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::Semaphore;

/// What to continue, as the client gave it.
#[derive(Clone, Debug)]
pub enum Prompt {
    /// Plain text: special-token strings in it are text, never special ids;
    /// BOS is added as the tokenizer config says.
    Text(String),
    /// Text whose special-token strings become their ids, for a client that
    /// opted in (it renders its own template); BOS as for `Text`.
    TextWithSpecialTokens(String),
    /// Token ids, used as they are.
    Tokens(Vec<u32>),
    /// Chat messages, rendered with the chat template and the generation
    /// prompt; their contents are plain text. `template_kwargs` are extra
    /// template variables (the client's `chat_template_kwargs`); `tools`
    /// the functions the model is offered.
    Chat { messages: Vec<ChatMessage>, template_kwargs: ChatTemplateKwargs, tools: Vec<Tool> },
}

impl Prompt {
    /// Bytes of client text to tokenize (0 for token ids).
    pub fn text_bytes(&self) -> usize {
        match self {
            Prompt::Text(t) | Prompt::TextWithSpecialTokens(t) => t.len(),
            Prompt::Tokens(_) => 0,
            Prompt::Chat { messages, template_kwargs, tools } => {
                // The kwargs, the tools and past calls are client text the
                // template renders too.
                let kwargs = if template_kwargs.is_empty() { 0 } else { json_len(template_kwargs) };
                let calls = |m: &ChatMessage| if m.tool_calls.is_empty() { 0 } else { json_len(&m.tool_calls) };
                let tools = if tools.is_empty() { 0 } else { json_len(tools) };
                messages.iter().map(|m| m.content.len() + m.role.len() + calls(m)).sum::<usize>() + kwargs + tools
            }
        }
    }

    /// A chat with no template variables.
    pub fn chat(messages: Vec<ChatMessage>) -> Self {
        Prompt::Chat { messages, template_kwargs: ChatTemplateKwargs::new(), tools: vec![] }
    }
}

/// Bytes of `v` as JSON.
fn json_len(v: &impl serde::Serialize) -> usize {
    serde_json::to_vec(v).map_or(0, |v| v.len())
}

/// The roles a chat message may have. `developer` is OpenAI's newer name
/// for `system` and is rendered as one. Anything else is refused rather
/// than left to the template, which drops roles it does not know silently.
const CHAT_ROLES: &str = "system, developer, user, assistant or tool";

/// The client's options in front-door-neutral terms; `None` takes the
/// model's (sampling) or the server's (max_tokens) default.
#[derive(Clone, Debug, Default)]
pub struct RequestOptions {
    pub model: Option<String>,
    pub temperature: Option<f32>,
    pub top_k: Option<u32>,
    pub top_p: Option<f32>,
    pub min_p: Option<f32>,
    pub repetition_penalty: Option<f32>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    pub seed: Option<u64>,
    pub max_tokens: Option<u32>,
    pub stop: Vec<String>,
    pub stop_token_ids: Vec<u32>,
    pub ignore_eos: bool,
    /// Return each chosen token's logprob.
    pub logprobs: bool,
    /// Also return this many most likely tokens per position.
    pub top_logprobs: Option<u32>,
    /// What the output must be (structured output, tool calls).
    pub constraint: Option<ConstraintSpec>,
    /// Special tokens whose text the reply keeps (tool-call markup).
    pub keep_special_tokens: Vec<u32>,
}

/// A validated request, ready for the workers.
#[derive(Clone, Debug)]
pub struct GenerationRequest {
    /// The id the workers know the request by (KV leases, Cancel). Never
    /// shown to the client: anyone who knew it could cancel the request.
    pub id: String,
    /// The id the client sees (in response ids), drawn independently.
    pub public_id: String,
    pub prompt: Vec<u32>,
    /// Client values over the model's defaults; `seed` is always set.
    pub sampling: SamplingParams,
    /// Drawn at random when the client gave none, so that both workers
    /// sample the same stream.
    pub seed: u64,
    /// Already capped to what the context and the KV pool can hold.
    pub max_tokens: u32,
    pub stop: Vec<String>,
    /// The client's stop ids plus EOS (unless it ignores EOS).
    pub stop_token_ids: Vec<u32>,
    pub logprobs: bool,
    pub top_logprobs: u32,
    /// Checked: it compiles for this model's vocabulary.
    pub constraint: Option<ConstraintSpec>,
    /// Special tokens whose text the reply keeps (tool-call markup).
    pub keep_special_tokens: Vec<u32>,
    pub arrival: Instant,
}

impl GenerationRequest {
    /// The sampling settings in the worker protocol's terms.
    pub fn worker_sampling(&self) -> worker::Sampling {
        let top_logprobs = (self.top_logprobs > 0).then_some(self.top_logprobs as usize);
        let sampling = worker::Sampling::from(&SamplingParams { seed: Some(self.seed), logprobs: top_logprobs, ..self.sampling.clone() });
        worker::Sampling { constraint: self.constraint.as_ref().map(worker::Constraint::from), ..sampling }
    }
}

/// What the workers report about their capacity (from the decode worker's
/// Stats), which bounds what a request may ask.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WorkerLimits {
    /// The decode worker's context length (0: not reported).
    pub context_length: u32,
    /// Tokens the KV pool can ever hold: `kv_blocks_total * kv_block_size`.
    pub kv_tokens: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error(transparent)]
    Tokenizer(#[from] TokenizerError),
    #[error(transparent)]
    Config(#[from] duplex_text::ServedConfigError),
    #[error(transparent)]
    Grammar(#[from] GrammarError),
}

/// The served model, as far as the router needs it: tokenizer, defaults and
/// limits. The router never loads weights.
pub struct ServedModel {
    pub name: String,
    pub tokenizer: Tokenizer,
    /// Sampling defaults from `generation_config.json`.
    pub defaults: SamplingParams,
    /// Rows of the embedding table: every valid input id is below it.
    pub vocab_size: usize,
    /// `max_position_embeddings`.
    pub context_length: usize,
    pub eos_token_ids: Vec<u32>,
    pub default_max_tokens: u32,
    /// Prompts with more bytes of text than this cannot fit the context
    /// and are refused before tokenizing (see `max_prompt_bytes`).
    pub max_prompt_bytes: usize,
    /// Tokenizations running at once, on the blocking pool.
    pub tokenize_slots: Arc<Semaphore>,
    /// Checks output constraints against this vocabulary.
    pub grammar: GrammarCompiler,
}

/// Margin of the prompt-size bound over the longest token: a normaliser
/// may shrink text (NFC composes up to three code points into one).
const NORMALIZATION_MARGIN: usize = 4;

impl ServedModel {
    pub fn load(config: &RouterConfig) -> Result<Self, LoadError> {
        // A Hugging Face directory or a GGUF model (duplex_gguf::locate).
        let path = &config.model;
        let tokenizer = Tokenizer::from_model_path(path)?;
        let model = ServedConfig::from_model_path(path)?;
        let mut eos_token_ids = tokenizer.eos_token_ids().to_vec();
        for id in &model.eos_token_ids {
            if !eos_token_ids.contains(id) {
                eos_token_ids.push(*id);
            }
        }
        let max_prompt_bytes = max_prompt_bytes(model.max_position_embeddings, tokenizer.max_token_bytes());
        // One tokenization per core: more would only take turns, and the
        // async threads must stay free for I/O and /health.
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let grammar = GrammarCompiler::new(&tokenizer, model.vocab_size)?;
        Ok(ServedModel {
            grammar,
            max_prompt_bytes,
            tokenize_slots: Arc::new(Semaphore::new(cores)),
            name: config.served_model_name(),
            defaults: sampling_defaults(path),
            vocab_size: model.vocab_size,
            context_length: model.max_position_embeddings,
            eos_token_ids,
            tokenizer,
            default_max_tokens: config.default_max_tokens,
        })
    }

    /// The longest prompt plus output a request can have.
    pub fn context_length(&self, limits: &WorkerLimits) -> usize {
        match limits.context_length {
            0 => self.context_length,
            n => self.context_length.min(n as usize),
        }
    }

    /// What `/v1/models` reports as `max_model_len`: the longest prompt plus
    /// output one request can have, which the KV pool may bound below the
    /// context.
    pub fn max_model_len(&self, limits: &WorkerLimits) -> usize {
        self.context_length(limits).min(usize::try_from(limits.kv_tokens).unwrap_or(usize::MAX))
    }

    /// Refuses text that cannot fit the context whatever it tokenizes to:
    /// cheap, and done before tokenizing, which costs about a microsecond
    /// and a hundred bytes of memory per byte of text.
    pub fn check_size(&self, prompt: &Prompt) -> Result<(), Error> {
        let param = if let Prompt::Chat { .. } = prompt { "messages" } else { "prompt" };
        self.check_text_bytes(param, prompt.text_bytes())
    }

    /// `check_size` for `bytes` of text in field `param`.
    pub fn check_text_bytes(&self, param: &'static str, bytes: usize) -> Result<(), Error> {
        if bytes > self.max_prompt_bytes {
            let message = format!(
                "`{param}` has {bytes} bytes of text, more than the {} that can fit the context of {} tokens; shorten it",
                self.max_prompt_bytes, self.context_length
            );
            return Err(Error::invalid(param, message));
        }
        Ok(())
    }

    /// Turns a prompt into token ids.
    pub fn tokenize(&self, prompt: &Prompt) -> Result<Vec<u32>, Error> {
        let tok = &self.tokenizer;
        self.check_size(prompt)?;
        let ids = match prompt {
            Prompt::Text(text) | Prompt::TextWithSpecialTokens(text) if text.is_empty() => {
                return Err(Error::invalid("prompt", "prompt must not be empty"))
            }
            Prompt::Text(text) => tok.encode_text(text).map_err(|e| Error::invalid("prompt", e.to_string()))?,
            Prompt::TextWithSpecialTokens(text) => tok.encode(text).map_err(|e| Error::invalid("prompt", e.to_string()))?,
            Prompt::Tokens(ids) => {
                if let Some((i, id)) = ids.iter().enumerate().find(|(_, &id)| id as usize >= self.vocab_size) {
                    let message = format!("prompt token {id} at position {i} is outside the vocabulary (0..{})", self.vocab_size);
                    return Err(Error::invalid("prompt", message));
                }
                ids.clone()
            }
            Prompt::Chat { messages, .. } if messages.is_empty() => return Err(Error::invalid("messages", "messages must not be empty")),
            Prompt::Chat { messages, template_kwargs, tools } => {
                let messages = chat_roles(messages)?;
                tok.encode_chat_tools(&messages, tools, true, template_kwargs).map_err(Error::chat_template)?
            }
        };
        if ids.is_empty() {
            return Err(Error::invalid("prompt", "prompt must not be empty"));
        }
        Ok(ids)
    }

    /// Validates a request and resolves every default.
    pub fn request(&self, prompt: &Prompt, opts: RequestOptions, limits: &WorkerLimits) -> Result<GenerationRequest, Error> {
        let arrival = Instant::now();
        if let Some(asked) = opts.model.filter(|m| !m.is_empty() && *m != self.name) {
            return Err(Error::ModelNotFound { asked, served: self.name.clone() });
        }
        if opts.max_tokens == Some(0) {
            return Err(Error::invalid("max_tokens", "max_tokens must be at least 1"));
        }
        let top_logprobs = opts.top_logprobs.unwrap_or(0);
        if top_logprobs as usize > MAX_LOGPROBS {
            return Err(Error::invalid("top_logprobs", format!("top_logprobs must be at most {MAX_LOGPROBS}, got {top_logprobs}")));
        }
        if opts.stop.iter().any(String::is_empty) {
            return Err(Error::invalid("stop", "stop strings must not be empty"));
        }

        let mut sampling = self.defaults.clone();
        let overrides = [
            (&mut sampling.temperature, opts.temperature),
            (&mut sampling.top_p, opts.top_p),
            (&mut sampling.min_p, opts.min_p),
            (&mut sampling.repetition_penalty, opts.repetition_penalty),
            (&mut sampling.presence_penalty, opts.presence_penalty),
            (&mut sampling.frequency_penalty, opts.frequency_penalty),
        ];
        for (field, value) in overrides {
            if let Some(v) = value {
                *field = v;
            }
        }
        if let Some(k) = opts.top_k {
            sampling.top_k = k as usize;
        }
        let seed = opts.seed.unwrap_or_else(rand::random);
        sampling.seed = Some(seed);
        sampling.logprobs = (top_logprobs > 0).then_some(top_logprobs as usize);
        sampling.validate().map_err(sampling_error)?;

        if let Some(spec) = &opts.constraint {
            // Compiling is cheap (llguidance builds masks lazily, per step,
            // on the worker); what it catches is a schema it cannot take.
            self.grammar.compile(spec).map_err(|e| Error::invalid("response_format", e.to_string()))?;
        }
        let prompt = self.tokenize(prompt)?;
        let context = self.context_length(limits);
        if prompt.len() >= context {
            let message = format!("the prompt has {} tokens; the context length is {context}, which must leave room for at least one generated token", prompt.len());
            return Err(Error::invalid("prompt", message));
        }
        let kv_tokens = usize::try_from(limits.kv_tokens).unwrap_or(usize::MAX);
        if prompt.len() + 1 > kv_tokens {
            let message = format!("the prompt has {} tokens, but the KV cache can hold at most {kv_tokens} tokens of one request (prompt plus output)", prompt.len());
            return Err(Error::invalid("prompt", message));
        }
        // A request may ask for more than fits; it then ends with "length"
        // where the context (or the KV pool) is full.
        let room = (context - prompt.len()).min(kv_tokens - prompt.len());
        let max_tokens = opts.max_tokens.unwrap_or(self.default_max_tokens).min(u32::try_from(room).unwrap_or(u32::MAX));

        let mut stop_token_ids = opts.stop_token_ids;
        if !opts.ignore_eos {
            for &id in &self.eos_token_ids {
                if !stop_token_ids.contains(&id) {
                    stop_token_ids.push(id);
                }
            }
        }
        Ok(GenerationRequest {
            id: uuid::Uuid::new_v4().simple().to_string(),
            public_id: uuid::Uuid::new_v4().simple().to_string(),
            prompt,
            sampling,
            seed,
            max_tokens,
            stop: opts.stop,
            stop_token_ids,
            logprobs: opts.logprobs || top_logprobs > 0,
            top_logprobs,
            constraint: opts.constraint,
            keep_special_tokens: opts.keep_special_tokens,
            arrival,
        })
    }
}

/// The messages with their roles checked, and `developer` renamed `system`.
fn chat_roles(messages: &[ChatMessage]) -> Result<Vec<ChatMessage>, Error> {
    messages
        .iter()
        .enumerate()
        .map(|(i, m)| {
            let role = match m.role.as_str() {
                "system" | "user" | "assistant" | "tool" => m.role.clone(),
                "developer" => "system".into(),
                "function" => {
                    let message = format!("messages[{i}].role `function` (OpenAI's deprecated function calling) is not supported; roles are {CHAT_ROLES}");
                    return Err(Error::invalid("messages", message));
                }
                "" => return Err(Error::invalid("messages", format!("messages[{i}].role must not be empty; roles are {CHAT_ROLES}"))),
                other => return Err(Error::invalid("messages", format!("messages[{i}].role `{other}` is not a role; roles are {CHAT_ROLES} (lower case)"))),
            };
            Ok(ChatMessage { role, ..m.clone() })
        })
        .collect()
}

/// The most bytes of text a prompt of `context_length` tokens can have:
/// no token stands for more bytes than its vocabulary string has (byte-level
/// and SentencePiece strings are at least as long as their text), with a
/// margin for normalisers that shrink text.
fn max_prompt_bytes(context_length: usize, max_token_bytes: usize) -> usize {
    context_length.saturating_mul(max_token_bytes.max(1)).saturating_mul(NORMALIZATION_MARGIN)
}

/// The field a sampling error blames; its message already names it.
fn sampling_error(e: SamplingError) -> Error {
    let param = match e {
        SamplingError::Temperature(_) => "temperature",
        SamplingError::TopP(_) => "top_p",
        SamplingError::MinP(_) => "min_p",
        SamplingError::RepetitionPenalty(_) => "repetition_penalty",
        SamplingError::PresencePenalty(_) => "presence_penalty",
        SamplingError::FrequencyPenalty(_) => "frequency_penalty",
        SamplingError::Logprobs(_) => "top_logprobs",
    };
    Error::invalid(param, e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMITS: WorkerLimits = WorkerLimits { context_length: 0, kv_tokens: 1 << 20 };

    fn model() -> ServedModel {
        ServedModel::load(&RouterConfig::default()).unwrap()
    }

    fn text(s: &str) -> Prompt {
        Prompt::Text(s.into())
    }

    fn invalid_param(r: Result<GenerationRequest, Error>) -> &'static str {
        match r.unwrap_err() {
            Error::Invalid { param: Some(p), .. } => p,
            e => panic!("not an invalid-argument error: {e:?}"),
        }
    }

    #[test]
    fn resolves_defaults_seed_and_eos() {
        let m = model();
        let r = m.request(&text("Hello"), RequestOptions::default(), &LIMITS).unwrap();
        assert_eq!(r.prompt[0], 0, "BOS added");
        // generation_config.json: temperature 0.6, top_p 0.95.
        assert_eq!((r.sampling.temperature, r.sampling.top_p), (0.6, 0.95));
        assert_eq!(r.sampling.seed, Some(r.seed));
        assert_eq!(r.max_tokens, 256);
        assert_eq!(r.stop_token_ids, vec![1]);
        assert!(!r.logprobs);

        let opts = RequestOptions { temperature: Some(0.0), seed: Some(7), stop_token_ids: vec![5, 1], max_tokens: Some(5000), ..Default::default() };
        let r = m.request(&text("Hello"), opts, &LIMITS).unwrap();
        assert_eq!((r.sampling.temperature, r.seed), (0.0, 7));
        assert_eq!(r.stop_token_ids, vec![5, 1]);
        assert_eq!(r.max_tokens as usize, 1024 - r.prompt.len(), "capped to the context");

        let opts = RequestOptions { ignore_eos: true, top_logprobs: Some(3), ..Default::default() };
        let r = m.request(&text("Hello"), opts, &LIMITS).unwrap();
        assert!(r.stop_token_ids.is_empty());
        assert!(r.logprobs);
        assert_eq!(r.worker_sampling().top_logprobs, Some(3));
    }

    #[test]
    fn every_bad_input_names_its_field() {
        let m = model();
        let opts = RequestOptions::default;
        assert_eq!(invalid_param(m.request(&text(""), opts(), &LIMITS)), "prompt");
        assert_eq!(invalid_param(m.request(&Prompt::Tokens(vec![]), opts(), &LIMITS)), "prompt");
        assert_eq!(invalid_param(m.request(&Prompt::Tokens(vec![5, 999_999]), opts(), &LIMITS)), "prompt");
        assert_eq!(invalid_param(m.request(&Prompt::chat(vec![]), opts(), &LIMITS)), "messages");
        assert_eq!(invalid_param(m.request(&Prompt::Tokens(vec![5; 1024]), opts(), &LIMITS)), "prompt");
        let small = WorkerLimits { context_length: 0, kv_tokens: 10 };
        assert_eq!(invalid_param(m.request(&Prompt::Tokens(vec![5; 10]), opts(), &small)), "prompt");
        let bad = [
            (RequestOptions { temperature: Some(-1.0), ..opts() }, "temperature"),
            (RequestOptions { top_p: Some(f32::NAN), ..opts() }, "top_p"),
            (RequestOptions { presence_penalty: Some(3.0), ..opts() }, "presence_penalty"),
            (RequestOptions { top_logprobs: Some(21), ..opts() }, "top_logprobs"),
            (RequestOptions { max_tokens: Some(0), ..opts() }, "max_tokens"),
            (RequestOptions { stop: vec![String::new()], ..opts() }, "stop"),
        ];
        for (o, field) in bad {
            let e = m.request(&text("hi"), o, &LIMITS).unwrap_err();
            assert!(matches!(&e, Error::Invalid { param: Some(p), .. } if *p == field), "{field}: {e:?}");
            assert!(e.to_string().contains(field), "{e}");
        }
        let e = m.request(&text("hi"), RequestOptions { model: Some("gpt-4".into()), ..opts() }, &LIMITS).unwrap_err();
        assert!(matches!(e, Error::ModelNotFound { .. }), "{e:?}");
        assert!(m.request(&text("hi"), RequestOptions { model: Some("tiny-dsv3".into()), ..opts() }, &LIMITS).is_ok());
    }

    #[test]
    fn worker_context_length_caps_the_model() {
        let m = model();
        let limits = WorkerLimits { context_length: 16, kv_tokens: 1 << 20 };
        assert_eq!(invalid_param(m.request(&Prompt::Tokens(vec![5; 16]), RequestOptions::default(), &limits)), "prompt");
        let r = m.request(&Prompt::Tokens(vec![5; 10]), RequestOptions::default(), &limits).unwrap();
        assert_eq!(r.max_tokens, 6);
    }

    #[test]
    fn roles_are_checked_and_developer_is_system() {
        let m = model();
        let chat = |role: &str| Prompt::chat(vec![ChatMessage::new(role, "Be brief."), ChatMessage::new("user", "Hi")]);
        assert_eq!(m.tokenize(&chat("developer")).unwrap(), m.tokenize(&chat("system")).unwrap());
        for role in ["function", "SYSTEM", "", "critic"] {
            let e = m.tokenize(&chat(role)).unwrap_err();
            assert!(matches!(&e, Error::Invalid { param: Some("messages"), .. }), "{role}: {e:?}");
            assert!(e.to_string().contains("messages[0].role") && (role.is_empty() || e.to_string().contains(&format!("`{role}`"))), "{e}");
        }
    }

    #[test]
    fn text_too_long_for_the_context_is_refused_before_tokenizing() {
        let m = model();
        // tiny-dsv3: 1024 positions, longest vocabulary string 74 bytes.
        assert_eq!(m.max_prompt_bytes, 1024 * 74 * NORMALIZATION_MARGIN);
        let big = "a".repeat(m.max_prompt_bytes + 1);
        let e = m.tokenize(&Prompt::Text(big.clone())).unwrap_err();
        assert!(matches!(&e, Error::Invalid { param: Some("prompt"), .. }) && e.to_string().contains("bytes"), "{e:?}");
        let e = m.tokenize(&Prompt::chat(vec![ChatMessage::new("user", big)])).unwrap_err();
        assert!(matches!(&e, Error::Invalid { param: Some("messages"), .. }), "{e:?}");
    }

    #[test]
    fn chat_template_kwargs_count_toward_the_prompt_size() {
        let m = model();
        let messages = vec![ChatMessage::new("user", "Hi")];
        let mut template_kwargs = ChatTemplateKwargs::new();
        template_kwargs.insert("note".into(), serde_json::Value::String("a".repeat(m.max_prompt_bytes)));
        let chat = Prompt::Chat { messages: messages.clone(), template_kwargs, tools: vec![] };
        assert!(chat.text_bytes() > m.max_prompt_bytes);
        let e = m.tokenize(&chat).unwrap_err();
        assert!(matches!(&e, Error::Invalid { param: Some("messages"), .. }) && e.to_string().contains("bytes"), "{e:?}");
        // {"k":1} is 7 bytes of JSON.
        let small = Prompt::Chat { messages, template_kwargs: serde_json::json!({"k": 1}).as_object().unwrap().clone(), tools: vec![] };
        assert_eq!(small.text_bytes(), "user".len() + "Hi".len() + 7);
    }

    #[test]
    fn public_and_worker_ids_differ() {
        let r = model().request(&text("Hello"), RequestOptions::default(), &LIMITS).unwrap();
        assert_ne!(r.id, r.public_id);
        assert!(!r.id.contains(&r.public_id) && !r.public_id.contains(&r.id));
    }

    #[test]
    fn chat_uses_the_template() {
        let m = model();
        let chat = Prompt::chat(vec![ChatMessage::new("user", "Hi there")]);
        let ids = m.tokenize(&chat).unwrap();
        assert_eq!((ids[0], ids[1], *ids.last().unwrap()), (0, 2, 3));
    }
}
