//! The OpenAI-compatible HTTP API (axum): `/v1/completions`,
//! `/v1/chat/completions` (streamed as server-sent events or not),
//! `/v1/models`, plus `/health` and `/metrics`.
//!
//! Requests and responses follow OpenAI's shapes closely enough for the
//! official clients to work unmodified: unknown fields are ignored, and
//! every error is OpenAI's `{"error": {message, type, param, code}}`.

use super::ApiKey;
use crate::error::Error;
use super::access_log::AccessLog;
use super::openai_response::{
    ApiFinishReason, ChatChoice, FunctionCallOut, FunctionDelta, ToolCallDelta, ToolCallOut, ChatChunkChoice, ChatDelta, ChatLogprobs, ChatMessageOut, CompletionChoice, CompletionLogprobs, Envelope,
    ErrorBody, ErrorDetail, Health, ModelCard, ModelList, TextOffsets, Usage, UsageField,
};
use crate::generate::{count_refused, Event, Finished, Router, Token};
use crate::request::{Prompt, RequestOptions};
use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, FromRequest, Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::Next;
use axum::response::sse::{KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Json;
use duplex_grammar::ConstraintSpec;
use duplex_text::sampling::MAX_LOGPROBS;
use duplex_text::FinishReason;
use duplex_text::tokenizer::{ChatMessage, Tokenizer};
use duplex_text::tools::constraint::{tool_constraint, ToolConstraint};
use duplex_text::tools::parse::{ToolCallParser, ToolEvent};
use duplex_text::tools::{validate_tools, Tool, ToolCall, ToolChoice, ToolFormat};
use duplex_telemetry as names;
use metrics::counter;
use futures::StreamExt;
use metrics_exporter_prometheus::PrometheusHandle;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::convert::Infallible;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

#[derive(Clone)]
struct App {
    router: Arc<Router>,
    metrics: PrometheusHandle,
    started: u64,
}

/// The HTTP API. `api_key`: what `/v1/*` requires (`/health` and
/// `/metrics` stay open, for probes and scrapers). `max_body_bytes`: larger
/// bodies get 413 without being read.
pub fn routes(router: Arc<Router>, metrics: PrometheusHandle, api_key: ApiKey, max_body_bytes: usize, cors: Option<tower_http::cors::CorsLayer>) -> axum::Router {
    let app = App { router, metrics, started: unix_now() };
    let api = axum::Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/models", get(models))
        .fallback(|| async { ApiError::new(StatusCode::NOT_FOUND, "invalid_request_error", "no such endpoint") })
        .layer(axum::middleware::from_fn_with_state(api_key, authorize));
    // Outside the key check: a browser's preflight carries no key.
    let api = match cors {
        Some(cors) => api.layer(cors),
        None => api,
    };
    axum::Router::new()
        .route("/health", get(health))
        .route("/metrics", get(metrics_text))
        .merge(api)
        .layer(DefaultBodyLimit::max(max_body_bytes))
        .with_state(app)
}

/// Lets a request through only with the API key, if the server has one.
async fn authorize(State(key): State<ApiKey>, request: Request, next: Next) -> Response {
    let presented = request.headers().get(header::AUTHORIZATION).map(|v| v.as_bytes());
    match key.check(presented) {
        Ok(()) => next.run(request).await,
        Err(e) => {
            count_refused(&e);
            ApiError::from(e).into_response()
        }
    }
}

// ---------------------------------------------------------------- errors

/// OpenAI's error body, with its HTTP status.
#[derive(Debug)]
pub struct ApiError {
    status: StatusCode,
    kind: &'static str,
    message: String,
    param: Option<String>,
    code: Option<&'static str>,
}

impl ApiError {
    fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> Self {
        ApiError { status, kind, message: message.into(), param: None, code: None }
    }

    fn invalid(param: Option<String>, message: impl Into<String>) -> Self {
        ApiError { param, ..ApiError::new(StatusCode::BAD_REQUEST, "invalid_request_error", message) }
    }

    fn body(&self) -> ErrorBody<'_> {
        ErrorBody { error: ErrorDetail { message: &self.message, kind: self.kind, param: self.param.as_deref(), code: self.code } }
    }
}

impl From<Error> for ApiError {
    fn from(e: Error) -> Self {
        let message = e.to_string();
        match e {
            Error::Invalid { param, .. } => ApiError::invalid(param.map(Into::into), message),
            Error::ModelNotFound { .. } => ApiError {
                param: Some("model".into()),
                code: Some("model_not_found"),
                ..ApiError::new(StatusCode::NOT_FOUND, "invalid_request_error", message)
            },
            Error::Unauthenticated(_) => ApiError {
                code: Some("invalid_api_key"),
                ..ApiError::new(StatusCode::UNAUTHORIZED, "invalid_request_error", message)
            },
            Error::TooLarge(_) => ApiError::new(StatusCode::PAYLOAD_TOO_LARGE, "invalid_request_error", message),
            Error::Overloaded(_) => ApiError::new(StatusCode::TOO_MANY_REQUESTS, "rate_limit_error", message),
            Error::Unavailable(_) => ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "service_unavailable_error", message),
            Error::Internal(_) => ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", message),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut response = (self.status, Json(self.body())).into_response();
        if self.status == StatusCode::UNAUTHORIZED {
            response.headers_mut().insert(header::WWW_AUTHENTICATE, header::HeaderValue::from_static("Bearer"));
        }
        response
    }
}

/// A JSON body whose every rejection (too large, not UTF-8, malformed, a
/// field of the wrong type) is an OpenAI error naming the field.
struct JsonBody<T>(T);

impl<S: Send + Sync, T: DeserializeOwned> FromRequest<S> for JsonBody<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, ApiError> {
        let mut log = AccessLog::new(req.uri().path());
        let parsed = Self::parse(req, state).await;
        match &parsed {
            Err(e) => {
                counter!(names::REQUESTS, "outcome" => "invalid").increment(1);
                log.finish(e.status.as_u16(), None);
            }
            // The handler logs the request from here.
            Ok(_) => log.forget(),
        }
        parsed
    }
}

impl<T: DeserializeOwned> JsonBody<T> {
    async fn parse<S: Send + Sync>(req: Request, state: &S) -> Result<Self, ApiError> {
        let bytes = Bytes::from_request(req, state).await.map_err(|e| match e.status() {
            StatusCode::PAYLOAD_TOO_LARGE => {
                ApiError::from(Error::TooLarge(format!("the request body is larger than this server accepts (max_request_body_bytes): {}", e.body_text())))
            }
            status => ApiError::new(status, "invalid_request_error", e.body_text()),
        })?;
        let text = std::str::from_utf8(&bytes).map_err(|e| ApiError::invalid(None, format!("the request body is not valid UTF-8: {e}")))?;
        let mut de = serde_json::Deserializer::from_str(text);
        let value = serde_path_to_error::deserialize(&mut de).map_err(|e| {
            let path = e.path().to_string();
            let inner = e.into_inner();
            // A syntax error is the body's; a type error is the field's.
            match (inner.classify(), path.as_str()) {
                (serde_json::error::Category::Data, p) if p != "." => ApiError::invalid(Some(path.clone()), format!("invalid `{path}`: {inner}")),
                _ => ApiError::invalid(None, format!("the request body is not valid JSON: {inner}")),
            }
        })?;
        de.end().map_err(|e| ApiError::invalid(None, format!("the request body is not valid JSON: {e}")))?;
        Ok(JsonBody(value))
    }
}

// ---------------------------------------------------------------- requests

/// The body of both generation endpoints; each reads the fields it knows.
/// Every field is optional (and may be null), and unknown ones are ignored,
/// as OpenAI clients send plenty of them.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct ApiRequest {
    model: Option<String>,
    /// Completions: a string, an array of token ids, or a one-element array of either.
    prompt: Option<Value>,
    /// Chat: messages with string content or an array of text parts.
    messages: Option<Vec<ApiMessage>>,
    max_tokens: Option<u32>,
    max_completion_tokens: Option<u32>,
    temperature: Option<f32>,
    top_p: Option<f32>,
    /// -1 (vLLM's "off") and 0 both disable the filter.
    top_k: Option<i64>,
    min_p: Option<f32>,
    repetition_penalty: Option<f32>,
    presence_penalty: Option<f32>,
    frequency_penalty: Option<f32>,
    seed: Option<u64>,
    /// A string or an array of strings.
    stop: Option<Value>,
    stop_token_ids: Option<Vec<u32>>,
    ignore_eos: Option<bool>,
    /// Completions: how many top logprobs (an integer); chat: a bool.
    logprobs: Option<Value>,
    /// Chat: how many top logprobs.
    top_logprobs: Option<u32>,
    n: Option<u32>,
    best_of: Option<u32>,
    echo: Option<bool>,
    suffix: Option<String>,
    stream: Option<bool>,
    stream_options: Option<StreamOptions>,
    /// Completions: encode special-token strings in `prompt` as the special
    /// tokens (for clients that render their own chat template). Off by
    /// default: a prompt is plain text.
    parse_special_tokens: Option<bool>,
    /// Chat: extra variables for the chat template, as vLLM takes them
    /// (e.g. `{"enable_thinking": false}` for Qwen3). Anything but an
    /// object (or null) is refused by the JSON parser, naming the field.
    chat_template_kwargs: Option<serde_json::Map<String, Value>>,
    /// Not implemented; refused rather than ignored (see `unsupported`).
    /// Chat: functions the model may call.
    tools: Option<Vec<Tool>>,
    /// Chat: `none`, `auto` (the default with tools), `required` or a named
    /// function.
    tool_choice: Option<ToolChoice>,
    /// Chat: whether one reply may hold several calls (default true).
    parallel_tool_calls: Option<bool>,
    /// OpenAI's deprecated function calling: refused, naming `tools`.
    functions: Option<Value>,
    function_call: Option<Value>,
    /// Structured output: `text` (the default), `json_object`, or
    /// `json_schema` with its schema.
    response_format: Option<ResponseFormat>,
}

/// OpenAI's `response_format`.
#[derive(Debug, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum ResponseFormat {
    Text,
    JsonObject,
    JsonSchema { json_schema: JsonSchemaFormat },
}

#[derive(Debug, Deserialize)]
struct JsonSchemaFormat {
    /// OpenAI requires a name; it names the schema for the model and
    /// changes nothing here.
    #[serde(default)]
    #[allow(dead_code)]
    name: Option<String>,
    schema: Option<Value>,
}

impl ResponseFormat {
    fn constraint(&self) -> Result<Option<ConstraintSpec>, Error> {
        match self {
            ResponseFormat::Text => Ok(None),
            ResponseFormat::JsonObject => Ok(Some(ConstraintSpec::JsonObject)),
            ResponseFormat::JsonSchema { json_schema: JsonSchemaFormat { schema: Some(schema), .. } } => Ok(Some(ConstraintSpec::JsonSchema(schema.clone()))),
            ResponseFormat::JsonSchema { .. } => Err(Error::invalid("response_format", "response_format.json_schema.schema is required for type `json_schema`")),
        }
    }
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct StreamOptions {
    include_usage: Option<bool>,
}

#[derive(Debug, Deserialize)]
struct ApiMessage {
    role: String,
    #[serde(default)]
    content: Option<Value>,
    /// An assistant turn's calls.
    #[serde(default)]
    tool_calls: Option<Vec<ToolCall>>,
    /// The call a `tool` turn answers.
    #[serde(default)]
    tool_call_id: Option<String>,
    #[serde(default)]
    name: Option<String>,
}

/// The most choices one request may ask for (OpenAI's own limit).
const MAX_CHOICES: u32 = 128;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Completion,
    Chat,
}

impl ApiRequest {
    /// The options common to both endpoints; `logprobs` as resolved by the caller.
    fn options(&self, logprobs: bool, top_logprobs: Option<u32>) -> Result<RequestOptions, Error> {
        if let Some(n) = self.n.filter(|n| !(1..=MAX_CHOICES).contains(n)) {
            return Err(Error::invalid("n", format!("n must be between 1 and {MAX_CHOICES}, got {n}")));
        }
        let top_k = match self.top_k {
            None => None,
            Some(-1 | 0) => Some(0),
            Some(k) if k > 0 => Some(u32::try_from(k).unwrap_or(u32::MAX)),
            Some(k) => return Err(Error::invalid("top_k", format!("top_k must be -1 or 0 (off) or positive, got {k}"))),
        };
        let stop = match &self.stop {
            None | Some(Value::Null) => vec![],
            Some(Value::String(s)) => vec![s.clone()],
            Some(Value::Array(items)) => items
                .iter()
                .map(|s| s.as_str().map(String::from))
                .collect::<Option<Vec<_>>>()
                .ok_or_else(|| Error::invalid("stop", "stop must be a string or an array of strings"))?,
            Some(_) => return Err(Error::invalid("stop", "stop must be a string or an array of strings")),
        };
        Ok(RequestOptions {
            model: self.model.clone(),
            temperature: self.temperature,
            top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            repetition_penalty: self.repetition_penalty,
            presence_penalty: self.presence_penalty,
            frequency_penalty: self.frequency_penalty,
            seed: self.seed,
            max_tokens: self.max_completion_tokens.or(self.max_tokens),
            stop,
            stop_token_ids: self.stop_token_ids.clone().unwrap_or_default(),
            ignore_eos: self.ignore_eos.unwrap_or(false),
            logprobs,
            top_logprobs,
            constraint: self.response_format.as_ref().map(ResponseFormat::constraint).transpose()?.flatten(),
            keep_special_tokens: vec![],
        })
    }

    /// Refuses what this server does not implement but a client relies on:
    /// ignoring `tools` or a JSON `response_format` would hand back text the
    /// client cannot use, with a 200.
    fn unsupported(&self) -> Result<(), Error> {
        let set = |v: &Option<Value>| v.as_ref().is_some_and(|v| !v.is_null());
        for (param, value) in [("functions", &self.functions), ("function_call", &self.function_call)] {
            if set(value) {
                return Err(Error::invalid(param, format!("`{param}` (OpenAI's deprecated function calling) is not supported; use `tools` and `tool_choice`")));
            }
        }
        if self.tool_choice.as_ref().is_some_and(|c| !matches!(c, ToolChoice::None | ToolChoice::Auto)) && self.tools.as_ref().is_none_or(Vec::is_empty) {
            return Err(Error::invalid("tool_choice", "tool_choice asks for a call, but the request has no `tools`"));
        }
        Ok(())
    }

    fn include_usage(&self) -> bool {
        self.stream_options.as_ref().and_then(|o| o.include_usage).unwrap_or(false)
    }
}

async fn completions(State(app): State<App>, JsonBody(body): JsonBody<ApiRequest>) -> Response {
    let mut log = AccessLog::new("/v1/completions");
    match completion_request(&body).inspect_err(count_refused) {
        Ok((prompt, opts)) => app.respond(Kind::Completion, prompt, opts, &body, log, None).await,
        Err(e) => refused(e, &mut log),
    }
}

async fn chat_completions(State(app): State<App>, JsonBody(body): JsonBody<ApiRequest>) -> Response {
    let mut log = AccessLog::new("/v1/chat/completions");
    match chat_request(&body, &app.router.model.tokenizer).inspect_err(count_refused) {
        Ok((prompt, opts, tools)) => app.respond(Kind::Chat, prompt, opts, &body, log, tools).await,
        Err(e) => refused(e, &mut log),
    }
}

/// The response to a request refused before it was admitted.
fn refused(e: Error, log: &mut AccessLog) -> Response {
    let e = ApiError::from(e);
    log.finish(e.status.as_u16(), None);
    e.into_response()
}

fn completion_request(body: &ApiRequest) -> Result<(Prompt, RequestOptions), Error> {
    body.unsupported()?;
    if body.tools.as_ref().is_some_and(|t| !t.is_empty()) {
        return Err(Error::invalid("tools", "tools apply to /v1/chat/completions only"));
    }
    if body.echo == Some(true) {
        return Err(Error::invalid("echo", "echo is not supported"));
    }
    if body.best_of.is_some_and(|b| b > 1) {
        return Err(Error::invalid("best_of", "best_of is not supported; it must be 1"));
    }
    if body.suffix.as_ref().is_some_and(|s| !s.is_empty()) {
        return Err(Error::invalid("suffix", "suffix is not supported"));
    }
    // A completion prompt is not rendered with the template: ignoring the
    // variables would give a 200 for a prompt the client did not mean.
    if body.chat_template_kwargs.as_ref().is_some_and(|k| !k.is_empty()) {
        return Err(Error::invalid("chat_template_kwargs", "chat_template_kwargs applies to /v1/chat/completions only: a completion prompt is not rendered with the chat template"));
    }
    let prompt = match completion_prompt(body.prompt.as_ref())? {
        Prompt::Text(text) if body.parse_special_tokens == Some(true) => Prompt::TextWithSpecialTokens(text),
        prompt => prompt,
    };
    let (logprobs, top) = match &body.logprobs {
        None | Some(Value::Null) => (false, None),
        Some(Value::Bool(b)) => (*b, None),
        Some(Value::Number(n)) => match n.as_u64() {
            Some(n) if n as usize <= MAX_LOGPROBS => (true, Some(n as u32)),
            _ => return Err(Error::invalid("logprobs", format!("logprobs must be an integer in 0..={MAX_LOGPROBS}, got {n}"))),
        },
        Some(_) => return Err(Error::invalid("logprobs", "logprobs must be an integer")),
    };
    Ok((prompt, body.options(logprobs, top)?))
}

/// The tools a chat request offers the model and how its reply is read:
/// `None` when it offers none (or `tool_choice` is `none`).
#[derive(Clone, Copy, Debug)]
struct ToolUse {
    format: ToolFormat,
    parallel: bool,
}

fn chat_request(body: &ApiRequest, tok: &Tokenizer) -> Result<(Prompt, RequestOptions, Option<ToolUse>), Error> {
    body.unsupported()?;
    if body.parse_special_tokens.is_some() {
        return Err(Error::invalid("parse_special_tokens", "parse_special_tokens applies to /v1/completions only: chat messages are always plain text"));
    }
    let messages = chat_messages(body.messages.as_deref())?;
    let logprobs = match &body.logprobs {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => return Err(Error::invalid("logprobs", "logprobs must be true or false")),
    };
    let template_kwargs = body.chat_template_kwargs.clone().unwrap_or_default();
    let mut opts = body.options(logprobs, body.top_logprobs)?;
    let mut tools = body.tools.clone().unwrap_or_default();
    let choice = body.tool_choice.clone().unwrap_or_default();
    validate_tools(&tools, &choice).map_err(|e| Error::invalid("tools", e.0))?;
    if choice == ToolChoice::None {
        // As OpenAI: the model is not offered the tools, and says text.
        tools.clear();
    }
    let tool_use = (!tools.is_empty()).then(|| ToolUse { format: tok.template_tools().format, parallel: body.parallel_tool_calls.unwrap_or(true) });
    if let Some(tu) = tool_use {
        // The markup of a call is special tokens in some formats (Kimi-K2's):
        // they must reach the parser as text.
        opts.keep_special_tokens = tok.tool_markup_ids(tu.format);
        // `required` or a named function: the grammar makes the call.
        if let Some(c) = tool_constraint(tu.format, &tools, &choice, tu.parallel, |s| tok.special_token_id(s).is_some()) {
            if opts.constraint.is_some() {
                return Err(Error::invalid("response_format", "response_format cannot be combined with a tool_choice that forces a call"));
            }
            opts.constraint = Some(match c {
                ToolConstraint::JsonSchema(schema) => ConstraintSpec::JsonSchema(schema),
                ToolConstraint::Lark(grammar) => ConstraintSpec::Lark(grammar),
            });
        }
    }
    Ok((Prompt::Chat { messages, template_kwargs, tools }, opts, tool_use))
}

fn completion_prompt(prompt: Option<&Value>) -> Result<Prompt, Error> {
    let bad = || Error::invalid("prompt", "prompt must be a string or an array of token ids");
    match prompt {
        None | Some(Value::Null) => Err(Error::invalid("prompt", "prompt is required")),
        Some(Value::String(s)) => Ok(Prompt::Text(s.clone())),
        Some(Value::Array(items)) if items.iter().all(Value::is_number) => {
            let ids = items.iter().map(|v| v.as_u64().and_then(|id| u32::try_from(id).ok()));
            Ok(Prompt::Tokens(ids.collect::<Option<_>>().ok_or_else(bad)?))
        }
        // A batch of one, as clients that always send batches do.
        Some(Value::Array(items)) if items.len() == 1 => match &items[0] {
            one @ Value::String(_) => completion_prompt(Some(one)),
            one @ Value::Array(ids) if ids.iter().all(Value::is_number) => completion_prompt(Some(one)),
            _ => Err(bad()),
        },
        Some(Value::Array(_)) => Err(Error::invalid("prompt", "batches of prompts are not supported; send one prompt per request")),
        Some(_) => Err(bad()),
    }
}

fn chat_messages(messages: Option<&[ApiMessage]>) -> Result<Vec<ChatMessage>, Error> {
    let messages = messages.ok_or_else(|| Error::invalid("messages", "messages is required"))?;
    let mut out = Vec::with_capacity(messages.len());
    for (i, m) in messages.iter().enumerate() {
        let content = match &m.content {
            None | Some(Value::Null) => String::new(),
            Some(Value::String(s)) => s.clone(),
            Some(Value::Array(parts)) => {
                let mut texts = vec![];
                for (j, part) in parts.iter().enumerate() {
                    match (part.get("type").and_then(Value::as_str), part.get("text").and_then(Value::as_str)) {
                        (Some("text"), Some(text)) => texts.push(text),
                        (kind, _) => {
                            let kind = kind.unwrap_or("none");
                            let message = format!("messages[{i}].content[{j}]: only parts of type `text` with a string `text` are supported, got type `{kind}`");
                            return Err(Error::invalid("messages", message));
                        }
                    }
                }
                // As vLLM joins text parts.
                texts.join("\n")
            }
            Some(_) => return Err(Error::invalid("messages", format!("messages[{i}].content must be a string or an array of text parts"))),
        };
        out.push(ChatMessage {
            tool_calls: m.tool_calls.clone().unwrap_or_default(),
            tool_call_id: m.tool_call_id.clone(),
            name: m.name.clone(),
            ..ChatMessage::new(m.role.clone(), content)
        });
    }
    Ok(out)
}

// ---------------------------------------------------------------- responses

/// The fixed parts of one response.
struct Reply {
    kind: Kind,
    id: String,
    created: u64,
    model: String,
    include_usage: bool,
    /// How many choices it has (`n`).
    choices: usize,
    /// Chat with tools: the replies are parsed for calls.
    tools: Option<ToolUse>,
}

impl Reply {
    fn envelope<C>(&self, object: &'static str, choices: Vec<C>, usage: UsageField) -> Envelope<C> {
        Envelope { id: self.id.clone(), object, created: self.created, model: self.model.clone(), choices, usage }
    }

    /// A streamed chunk: OpenAI sends `usage: null` in every chunk but the
    /// last when the client asked for usage, and no `usage` otherwise.
    fn chunk<C: Serialize>(&self, choice: C) -> Value {
        let usage = if self.include_usage { UsageField::Null(()) } else { UsageField::Absent };
        let object = if self.kind == Kind::Chat { "chat.completion.chunk" } else { "text_completion" };
        json_value(&self.envelope(object, vec![choice], usage))
    }

    fn usage_chunk(&self, usage: Usage) -> Value {
        let object = if self.kind == Kind::Chat { "chat.completion.chunk" } else { "text_completion" };
        json_value(&self.envelope::<Value>(object, vec![], UsageField::Present(usage)))
    }
}

fn json_value(v: &impl Serialize) -> Value {
    serde_json::to_value(v).expect("response types serialize to JSON")
}

/// One choice's output as it streams: text offsets for the completions
/// API's logprobs, and what a whole response needs at the end.
struct Choice {
    index: u32,
    offsets: TextOffsets,
    /// Reads tool calls out of the text, when the request offered tools.
    parser: Option<ToolCallParser>,
    /// The calls, whole (for a whole response).
    calls: Vec<ToolCallOut>,
    text: String,
    /// Tokens with logprobs, for a whole response.
    tokens: Vec<Token>,
    finished: Option<Finished>,
}

impl Choice {
    fn new(index: usize, tools: Option<ToolUse>) -> Self {
        let parser = tools.map(|t| ToolCallParser::new(t.format, t.parallel));
        Choice { index: index as u32, offsets: TextOffsets::default(), parser, calls: vec![], text: String::new(), tokens: vec![], finished: None }
    }

    /// Splits released text into content and tool-call pieces; `last`
    /// flushes what the parser held back. Without tools it is all content.
    fn read(&mut self, text: &str, last: bool) -> (String, Vec<ToolCallDelta>) {
        let Some(parser) = self.parser.as_mut() else { return (text.to_string(), vec![]) };
        let mut events = parser.push(text);
        if last {
            events.extend(parser.finish());
        }
        let (mut content, mut deltas) = (String::new(), Vec::<ToolCallDelta>::new());
        for event in events {
            match event {
                ToolEvent::Content(c) => content.push_str(&c),
                ToolEvent::ToolCallStart { index, id, name } => {
                    self.calls.push(ToolCallOut { id: id.clone(), kind: "function", function: FunctionCallOut { name: name.clone(), arguments: String::new() } });
                    deltas.push(ToolCallDelta { index: index as u32, id: Some(id), kind: Some("function"), function: FunctionDelta { name: Some(name), arguments: String::new() } });
                }
                ToolEvent::ToolCallArguments { index, delta } => {
                    if let Some(call) = self.calls.get_mut(index) {
                        call.function.arguments.push_str(&delta);
                    }
                    // Pieces of one call in one chunk travel as one delta.
                    match deltas.last_mut().filter(|d| d.index == index as u32) {
                        Some(d) => d.function.arguments.push_str(&delta),
                        None => deltas.push(ToolCallDelta { index: index as u32, id: None, kind: None, function: FunctionDelta { name: None, arguments: delta } }),
                    }
                }
            }
        }
        (content, deltas)
    }

    /// The API's finish reason: `tool_calls` when the reply called tools.
    fn finish_reason(&self, reason: FinishReason) -> ApiFinishReason {
        if self.parser.as_ref().is_some_and(ToolCallParser::made_calls) {
            ApiFinishReason::ToolCalls
        } else {
            reason.into()
        }
    }
}

/// The seed of choice `index` of a request seeded with `seed`: the first
/// choice samples what the same request with `n = 1` would, the others
/// streams of their own (splitmix64, so that seeds s and s + 1 do not share
/// choices).
fn choice_seed(seed: u64, index: usize) -> u64 {
    if index == 0 {
        return seed;
    }
    let mut z = seed ^ (index as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

type ChoiceEvents = std::pin::Pin<Box<dyn futures::Stream<Item = (usize, Result<Event, Error>)> + Send>>;

impl App {
    async fn respond(&self, kind: Kind, prompt: Prompt, opts: RequestOptions, body: &ApiRequest, mut log: AccessLog, tools: Option<ToolUse>) -> Response {
        match self.start(kind, prompt, opts, body, &mut log, tools).await {
            Ok((reply, events)) if body.stream == Some(true) => self.stream(reply, events, log),
            Ok((reply, events)) => self.collect(reply, events, log).await,
            Err(e) => {
                let e = ApiError::from(e);
                log.finish(e.status.as_u16(), None);
                e.into_response()
            }
        }
    }

    /// Admits the request's `n` choices and waits for each one's first
    /// event, so that a request the workers refuse outright gets its own
    /// status rather than a 200 stream that carries an error.
    ///
    /// The first choice starts alone: once it has its first token its
    /// prompt is in the KV cache, and the other choices, started then,
    /// reuse its cached blocks (prefix caching) instead of each prefilling
    /// the prompt again.
    async fn start(&self, kind: Kind, prompt: Prompt, opts: RequestOptions, body: &ApiRequest, log: &mut AccessLog, tools: Option<ToolUse>) -> Result<(Reply, ChoiceEvents), Error> {
        let n = body.n.unwrap_or(1) as usize;
        let prompt = super::tokenized(&self.router, prompt).await.inspect_err(count_refused)?;
        // All admitted or none: a permit dropped here is given back.
        let mut admitted = Vec::with_capacity(n);
        for i in 0..n {
            let opts = RequestOptions { seed: opts.seed.map(|s| choice_seed(s, i)), ..opts.clone() };
            admitted.push(self.router.admit(&prompt, opts)?);
        }
        let first = &admitted[0].0;
        let prefix = if kind == Kind::Chat { "chatcmpl" } else { "cmpl" };
        // The public id, never the one the workers know (see GenerationRequest);
        // the log pairs them for whoever follows a client's report.
        tracing::debug!(public_id = %first.public_id, request_id = %first.id, choices = n, "request admitted");
        log.id(&first.public_id);
        let reply = Reply {
            kind,
            id: format!("{prefix}-{}", first.public_id),
            created: unix_now(),
            model: self.router.model.name.clone(),
            include_usage: body.include_usage(),
            choices: n,
            tools,
        };
        let mut streams: Vec<ChoiceEvents> = Vec::with_capacity(n);
        let mut admitted = admitted.into_iter();
        let (req, permit) = admitted.next().expect("n >= 1");
        streams.push(self.started(0, req, permit).await?);
        let rest = admitted.enumerate().map(|(i, (req, permit))| self.started(i + 1, req, permit));
        streams.extend(futures::future::try_join_all(rest).await?);
        Ok((reply, Box::pin(futures::stream::select_all(streams))))
    }

    /// Starts choice `index` and waits for its first event.
    async fn started(&self, index: usize, req: crate::request::GenerationRequest, permit: crate::admission::Permit) -> Result<ChoiceEvents, Error> {
        let mut events = self.router.generate(req, permit);
        let first = match events.next().await {
            Some(Ok(event)) => event,
            Some(Err(e)) => return Err(e),
            None => return Err(Error::Internal("the request ended without an event".into())),
        };
        Ok(Box::pin(futures::stream::iter([Ok(first)]).chain(events).map(move |e| (index, e))))
    }

    fn stream(&self, reply: Reply, mut events: ChoiceEvents, mut log: AccessLog) -> Response {
        let router = self.router.clone();
        let sse = |v: Value| Ok::<_, Infallible>(axum::response::sse::Event::default().data(v.to_string()));
        let body = async_stream::stream! {
            let tok = &router.model.tokenizer;
            let mut choices: Vec<Choice> = (0..reply.choices).map(|i| Choice::new(i, reply.tools)).collect();
            if reply.kind == Kind::Chat {
                for c in &choices {
                    let delta = ChatDelta { role: Some("assistant"), content: Some(String::new()), ..Default::default() };
                    yield sse(reply.chunk(ChatChunkChoice { index: c.index, delta, logprobs: None, finish_reason: None }));
                }
            }
            let mut open = reply.choices;
            while let Some((i, event)) = events.next().await {
                let c = &mut choices[i];
                match event {
                    Ok(Event::Token(t)) => {
                        // Tokens that complete no text (held back, special)
                        // are worth a chunk only for their logprobs.
                        if t.text.is_empty() && t.logprob.is_none() {
                            c.offsets.next(tok, &t);
                            continue;
                        }
                        yield sse(match reply.kind {
                            Kind::Completion => {
                                let logprobs = CompletionLogprobs::of(tok, std::slice::from_ref(&t), &mut c.offsets);
                                reply.chunk(CompletionChoice { index: c.index, text: t.text, logprobs, finish_reason: None })
                            }
                            Kind::Chat => {
                                let logprobs = ChatLogprobs::of(tok, std::slice::from_ref(&t));
                                let (content, tool_calls) = c.read(&t.text, false);
                                if content.is_empty() && tool_calls.is_empty() && logprobs.is_none() {
                                    continue; // held back by the tool-call parser
                                }
                                let delta = ChatDelta { content: (!content.is_empty()).then_some(content), tool_calls, ..Default::default() };
                                reply.chunk(ChatChunkChoice { index: c.index, delta, logprobs, finish_reason: None })
                            }
                        });
                    }
                    Ok(Event::Finished(f)) => {
                        yield sse(match reply.kind {
                            Kind::Completion => reply.chunk(CompletionChoice { index: c.index, text: f.text.clone(), logprobs: None, finish_reason: Some(f.reason.into()) }),
                            Kind::Chat => {
                                let (content, tool_calls) = c.read(&f.text, true);
                                let delta = ChatDelta { content: (!content.is_empty()).then_some(content), tool_calls, ..Default::default() };
                                reply.chunk(ChatChunkChoice { index: c.index, delta, logprobs: None, finish_reason: Some(c.finish_reason(f.reason)) })
                            }
                        });
                        c.finished = Some(f);
                        open -= 1;
                        if open == 0 {
                            let usage = Usage::of(choices.iter().filter_map(|c| c.finished.as_ref()));
                            if reply.include_usage {
                                yield sse(reply.usage_chunk(usage));
                            }
                            log.finish(200, Some((usage, choices[0].finished.as_ref())));
                            break;
                        }
                    }
                    Err(e) => {
                        let e = ApiError::from(e);
                        log.finish(e.status.as_u16(), None);
                        yield sse(json_value(&e.body()));
                        break;
                    }
                }
            }
            yield Ok(axum::response::sse::Event::default().data("[DONE]"));
        };
        Sse::new(body).keep_alive(KeepAlive::default()).into_response()
    }

    async fn collect(&self, reply: Reply, mut events: ChoiceEvents, mut log: AccessLog) -> Response {
        let mut choices: Vec<Choice> = (0..reply.choices).map(|i| Choice::new(i, reply.tools)).collect();
        let mut open = reply.choices;
        while open > 0 {
            let Some((i, event)) = events.next().await else { break };
            let c = &mut choices[i];
            match event {
                Ok(Event::Token(t)) => {
                    c.text.push_str(&t.text);
                    if t.logprob.is_some() {
                        c.tokens.push(t);
                    }
                }
                Ok(Event::Finished(f)) => {
                    c.text.push_str(&f.text);
                    c.finished = Some(f);
                    open -= 1;
                }
                Err(e) => {
                    let e = ApiError::from(e);
                    log.finish(e.status.as_u16(), None);
                    return e.into_response();
                }
            }
        }
        if open > 0 {
            let e = ApiError::from(Error::Internal("the request ended without finishing".into()));
            log.finish(e.status.as_u16(), None);
            return e.into_response();
        }
        let usage = Usage::of(choices.iter().filter_map(|c| c.finished.as_ref()));
        log.finish(200, Some((usage, choices[0].finished.as_ref())));
        let tok = &self.router.model.tokenizer;
        let reason = |c: &Choice| c.finished.as_ref().map_or(ApiFinishReason::Stop, |f| c.finish_reason(f.reason));
        let body = match reply.kind {
            Kind::Completion => json_value(&reply.envelope(
                "text_completion",
                choices
                    .iter_mut()
                    .map(|c| CompletionChoice {
                        index: c.index,
                        logprobs: CompletionLogprobs::of(tok, &c.tokens, &mut c.offsets),
                        finish_reason: Some(reason(c)),
                        text: std::mem::take(&mut c.text),
                    })
                    .collect(),
                UsageField::Present(usage),
            )),
            Kind::Chat => json_value(&reply.envelope(
                "chat.completion",
                choices
                    .iter_mut()
                    .map(|c| {
                        let text = std::mem::take(&mut c.text);
                        let (content, _) = c.read(&text, true);
                        let tool_calls = std::mem::take(&mut c.calls);
                        // OpenAI: null content for a reply that is only calls.
                        let content = (!content.is_empty() || tool_calls.is_empty()).then_some(content);
                        ChatChoice {
                            index: c.index,
                            logprobs: ChatLogprobs::of(tok, &c.tokens),
                            finish_reason: reason(c),
                            message: ChatMessageOut { role: "assistant", content, tool_calls },
                        }
                    })
                    .collect(),
                UsageField::Present(usage),
            )),
        };
        Json(body).into_response()
    }
}

// ---------------------------------------------------------------- the rest

async fn models(State(app): State<App>) -> Json<ModelList> {
    let router = &app.router;
    let max_model_len = match router.workers.readiness().limits() {
        Ok(limits) => router.model.max_model_len(&limits),
        Err(_) => router.model.context_length,
    };
    let card = ModelCard { id: router.model.name.clone(), object: "model", created: app.started, owned_by: "duplex", max_model_len };
    Json(ModelList { object: "list", data: vec![card] })
}

/// 200 while both workers answer their Stats, 503 otherwise.
async fn health(State(app): State<App>) -> Response {
    match app.router.workers.readiness().check() {
        Ok(()) => Json(Health { status: "ok" }).into_response(),
        Err(e) => ApiError::from(e).into_response(),
    }
}

async fn metrics_text(State(app): State<App>) -> impl IntoResponse {
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], app.metrics.render())
}

fn unix_now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn the_error_body_is_openais() {
        let e = ApiError::invalid(Some("n".into()), "bad n");
        assert_eq!(serde_json::to_string(&e.body()).unwrap(), r#"{"error":{"message":"bad n","type":"invalid_request_error","param":"n","code":null}}"#);
        let e = ApiError::from(Error::Unauthenticated("no key".into()));
        assert_eq!(serde_json::to_value(e.body()).unwrap(), json!({"error": {"message": e.message, "type": "invalid_request_error", "param": null, "code": "invalid_api_key"}}));
    }

    #[test]
    fn prompts_in_every_accepted_shape() {
        let p = |v: Value| completion_prompt(Some(&v));
        assert!(matches!(p(json!("hi")), Ok(Prompt::Text(t)) if t == "hi"));
        assert!(matches!(p(json!([1, 2])), Ok(Prompt::Tokens(t)) if t == [1, 2]));
        assert!(matches!(p(json!(["hi"])), Ok(Prompt::Text(t)) if t == "hi"));
        assert!(matches!(p(json!([[3]])), Ok(Prompt::Tokens(t)) if t == [3]));
        for bad in [json!(["a", "b"]), json!([[1], [2]]), json!([-1]), json!({"x": 1}), json!([[["x"]]])] {
            let e = p(bad.clone()).unwrap_err();
            assert!(matches!(e, Error::Invalid { param: Some("prompt"), .. }), "{bad}: {e:?}");
        }
        assert!(completion_prompt(None).is_err());
    }

    #[test]
    fn chat_content_parts() {
        let msgs: Vec<ApiMessage> = serde_json::from_value(json!([
            {"role": "system", "content": "s"},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {"role": "assistant", "content": null},
        ]))
        .unwrap();
        let out = chat_messages(Some(&msgs)).unwrap();
        assert_eq!(out.iter().map(|m| m.content.as_str()).collect::<Vec<_>>(), ["s", "a\nb", ""]);
        let msgs: Vec<ApiMessage> = serde_json::from_value(json!([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}])).unwrap();
        let e = chat_messages(Some(&msgs)).unwrap_err();
        assert!(e.to_string().contains("image_url"), "{e}");
    }

    #[test]
    fn deprecated_function_calling_and_forced_calls_without_tools_are_refused() {
        let req = |v: Value| serde_json::from_value::<ApiRequest>(v).unwrap();
        let tool = json!({"type": "function", "function": {"name": "f"}});
        let fine = [json!({}), json!({"tools": null}), json!({"tools": []}), json!({"tool_choice": "none"}), json!({"tools": [tool], "tool_choice": "required"})];
        for body in fine {
            assert!(req(body.clone()).unsupported().is_ok(), "{body}");
        }
        let refused = [
            (json!({"tool_choice": "required"}), "tool_choice"),
            (json!({"tool_choice": {"type": "function", "function": {"name": "f"}}}), "tool_choice"),
            (json!({"functions": [{"name": "f"}]}), "functions"),
            (json!({"function_call": {"name": "f"}}), "function_call"),
        ];
        for (body, field) in refused {
            let e = req(body.clone()).unsupported().unwrap_err();
            assert!(matches!(&e, Error::Invalid { param: Some(p), .. } if *p == field), "{body}: {e:?}");
        }
    }

    #[test]
    fn response_formats_become_constraints() {
        let req = |v: Value| serde_json::from_value::<ApiRequest>(v).unwrap();
        let constraint = |v: Value| req(v).options(false, None).map(|o| o.constraint);
        assert_eq!(constraint(json!({})).unwrap(), None);
        assert_eq!(constraint(json!({"response_format": {"type": "text"}})).unwrap(), None);
        assert_eq!(constraint(json!({"response_format": {"type": "json_object"}})).unwrap(), Some(ConstraintSpec::JsonObject));
        let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}}});
        let format = json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": true}}});
        assert_eq!(constraint(format).unwrap(), Some(ConstraintSpec::JsonSchema(schema)));
        let e = constraint(json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}})).unwrap_err();
        assert!(matches!(&e, Error::Invalid { param: Some("response_format"), .. }) && e.to_string().contains("schema"), "{e:?}");
        assert!(serde_json::from_value::<ApiRequest>(json!({"response_format": {"type": "yaml"}})).is_err());
    }

    #[test]
    fn options_check_n_stop_and_top_k() {
        let req = |v: Value| serde_json::from_value::<ApiRequest>(v).unwrap();
        let opts = req(json!({"stop": "x", "top_k": -1, "max_tokens": 5, "max_completion_tokens": 7, "user": "ignored"})).options(false, None).unwrap();
        assert_eq!((opts.stop, opts.top_k, opts.max_tokens), (vec!["x".to_string()], Some(0), Some(7)));
        assert!(req(json!({"n": 2})).options(false, None).is_ok());
        for n in [0, MAX_CHOICES + 1] {
            let e = req(json!({"n": n})).options(false, None).unwrap_err();
            assert!(matches!(e, Error::Invalid { param: Some("n"), .. }), "{e:?}");
        }
        assert!(req(json!({"stop": [1]})).options(false, None).is_err());
        assert!(req(json!({"top_k": -2})).options(false, None).is_err());
    }
}
