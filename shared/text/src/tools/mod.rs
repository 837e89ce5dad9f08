//! Tool calls in the model's own format: OpenAI's `tools` and `tool_calls`
//! rendered through the chat template, the model's tool-call markup parsed
//! back ([`parse`]), and the grammar that makes a required call well-formed
//! ([`constraint`]).
//!
//! Which format a model speaks is read off its chat template once, at load
//! time, by rendering small probe conversations ([`TemplateTools::probe`]):
//! a template that prints an assistant's `tool_calls` shows its markup
//! (DeepSeek-V3's `<｜tool▁call▁begin｜>`, Kimi-K2's `<|tool_call_begin|>`,
//! Qwen3's and Hermes' `<tool_call>`), and the same probes say whether it
//! wants `content: null` or `""` beside the calls, the arguments as a JSON
//! string or a mapping, whether it prints `tools` at all, tool results and
//! system messages. What a template cannot render is filled in the way
//! llama.cpp does: the tools are described in a system message (with the
//! call syntax), tool results become user messages. A template without any
//! tool syntax (the fixtures', many real ones) gets the [`ToolFormat::Generic`]
//! format: the model answers with a JSON object, `{"tool_calls": [...]}` or
//! `{"response": "..."}`, and past calls are rendered back as that JSON.

pub mod constraint;
pub mod parse;

use minijinja::value::Kwargs;
use minijinja::{Error as JinjaError, ErrorKind as JinjaErrorKind, Value};
use rand::Rng;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value as Json};

use crate::tokenizer::ChatMessage;

/// A tool the client offers, as in OpenAI's `tools` list:
/// `{"type": "function", "function": {"name", "description", "parameters"}}`.
/// Handed to templates as given (the `tools` variable of `transformers`'
/// `apply_chat_template(tools=...)`).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Tool {
    #[serde(rename = "type", default = "function_kind")]
    pub kind: String,
    pub function: FunctionDefinition,
}

/// A function's name, what it does and the JSON schema of its arguments.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct FunctionDefinition {
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    /// A JSON schema; absent means any object.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parameters: Option<Json>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub strict: Option<bool>,
}

impl Tool {
    /// A function tool.
    pub fn function(name: &str, description: Option<&str>, parameters: Option<Json>) -> Self {
        Tool {
            kind: function_kind(),
            function: FunctionDefinition { name: name.into(), description: description.map(Into::into), parameters, strict: None },
        }
    }

    /// The schema of the arguments: `parameters`, or any object.
    pub fn parameters_schema(&self) -> Json {
        self.function.parameters.clone().unwrap_or_else(|| json!({"type": "object"}))
    }
}

/// One call the assistant made, in OpenAI's shape:
/// `{"id", "type": "function", "function": {"name", "arguments"}}`, where
/// `arguments` is JSON text (as OpenAI sends and receives it).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct ToolCall {
    pub id: String,
    #[serde(rename = "type", default = "function_kind")]
    pub kind: String,
    pub function: FunctionCall,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct FunctionCall {
    pub name: String,
    /// The arguments as JSON text.
    pub arguments: String,
}

impl ToolCall {
    pub fn new(id: &str, name: &str, arguments: &str) -> Self {
        ToolCall { id: id.into(), kind: function_kind(), function: FunctionCall { name: name.into(), arguments: arguments.into() } }
    }
}

fn function_kind() -> String {
    "function".into()
}

/// OpenAI's `tool_choice`: `"none"`, `"auto"`, `"required"` or
/// `{"type": "function", "function": {"name": ...}}`.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub enum ToolChoice {
    /// No call: the tools are not shown to the model and its text is not
    /// parsed for calls.
    None,
    /// The model decides; calls are parsed from its text.
    #[default]
    Auto,
    /// At least one call, enforced with a grammar ([`constraint`]).
    Required,
    /// Exactly this function (one call, or several of it when parallel
    /// calls are allowed), enforced with a grammar.
    Function(String),
}

impl<'de> Deserialize<'de> for ToolChoice {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        use serde::de::Error;
        let value = Json::deserialize(deserializer)?;
        match &value {
            Json::String(s) => match s.as_str() {
                "none" => Ok(ToolChoice::None),
                "auto" => Ok(ToolChoice::Auto),
                "required" => Ok(ToolChoice::Required),
                other => Err(D::Error::custom(format!("tool_choice must be \"none\", \"auto\", \"required\" or a function, got {other:?}"))),
            },
            Json::Object(map) => match map.get("function").and_then(|f| f.get("name")).and_then(Json::as_str) {
                Some(name) if map.get("type").is_none_or(|t| t == "function") => Ok(ToolChoice::Function(name.into())),
                _ => Err(D::Error::custom(format!("tool_choice object must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}, got {value}"))),
            },
            _ => Err(D::Error::custom(format!("tool_choice must be a string or an object, got {value}"))),
        }
    }
}

/// A client's tools or tool choice that cannot be served.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("{0}")]
pub struct ToolsError(pub String);

/// Checks what a request asks for before anything is rendered: function
/// names as OpenAI allows them (`[a-zA-Z0-9_-]{1,64}`, also what keeps them
/// out of the markup and the grammars' syntax), no name twice, parameters
/// that are JSON objects, and a named `tool_choice` that names one of the
/// tools.
pub fn validate_tools(tools: &[Tool], choice: &ToolChoice) -> Result<(), ToolsError> {
    let mut seen = std::collections::HashSet::new();
    for (i, tool) in tools.iter().enumerate() {
        if tool.kind != "function" {
            return Err(ToolsError(format!("tools[{i}].type must be \"function\", got {:?}", tool.kind)));
        }
        let name = &tool.function.name;
        let valid = !name.is_empty() && name.len() <= 64 && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-');
        if !valid {
            return Err(ToolsError(format!("tools[{i}].function.name {name:?} must be 1 to 64 of a-z, A-Z, 0-9, '_' and '-'")));
        }
        if !seen.insert(name.as_str()) {
            return Err(ToolsError(format!("tools[{i}].function.name {name:?} is given twice")));
        }
        if tool.function.parameters.as_ref().is_some_and(|p| !p.is_object()) {
            return Err(ToolsError(format!("tools[{i}].function.parameters must be a JSON schema object")));
        }
    }
    match choice {
        ToolChoice::Required if tools.is_empty() => Err(ToolsError("tool_choice \"required\" needs at least one tool".into())),
        ToolChoice::Function(name) if !tools.iter().any(|t| &t.function.name == name) => {
            Err(ToolsError(format!("tool_choice names function {name:?}, which is not in tools")))
        }
        _ => Ok(()),
    }
}

/// How a model writes its tool calls.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ToolFormat {
    /// Qwen3 / Hermes: `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`.
    Hermes,
    /// DeepSeek-V3 and R1: `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\n```json\nARGS\n```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>`.
    DeepSeekV3,
    /// Kimi-K2: `<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>ARGS<|tool_call_end|>...<|tool_calls_section_end|>`.
    KimiK2,
    /// No tool syntax in the template: a JSON object,
    /// `{"tool_calls": [{"name": ..., "arguments": {...}}]}` or
    /// `{"response": "..."}`.
    Generic,
}

impl ToolFormat {
    /// The markup strings of the format, which the model emits as tokens:
    /// the router must decode those that are special tokens (see
    /// [`crate::tokenizer::Tokenizer::tool_markup_ids`]) or the parser never
    /// sees them.
    pub fn markup(self) -> &'static [&'static str] {
        match self {
            ToolFormat::Hermes => &[HERMES_BEGIN, HERMES_END],
            ToolFormat::DeepSeekV3 => &[DSV3_CALLS_BEGIN, DSV3_CALLS_END, DSV3_CALL_BEGIN, DSV3_CALL_END, DSV3_SEP],
            ToolFormat::KimiK2 => &[KIMI_SECTION_BEGIN, KIMI_SECTION_END, KIMI_CALL_BEGIN, KIMI_ARGUMENT_BEGIN, KIMI_CALL_END],
            ToolFormat::Generic => &[],
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            ToolFormat::Hermes => "hermes",
            ToolFormat::DeepSeekV3 => "deepseek_v3",
            ToolFormat::KimiK2 => "kimi_k2",
            ToolFormat::Generic => "generic",
        }
    }
}

pub(crate) const HERMES_BEGIN: &str = "<tool_call>";
pub(crate) const HERMES_END: &str = "</tool_call>";
pub(crate) const DSV3_CALLS_BEGIN: &str = "<｜tool▁calls▁begin｜>";
pub(crate) const DSV3_CALLS_END: &str = "<｜tool▁calls▁end｜>";
pub(crate) const DSV3_CALL_BEGIN: &str = "<｜tool▁call▁begin｜>";
pub(crate) const DSV3_CALL_END: &str = "<｜tool▁call▁end｜>";
pub(crate) const DSV3_SEP: &str = "<｜tool▁sep｜>";
pub(crate) const KIMI_SECTION_BEGIN: &str = "<|tool_calls_section_begin|>";
pub(crate) const KIMI_SECTION_END: &str = "<|tool_calls_section_end|>";
pub(crate) const KIMI_CALL_BEGIN: &str = "<|tool_call_begin|>";
pub(crate) const KIMI_ARGUMENT_BEGIN: &str = "<|tool_call_argument_begin|>";
pub(crate) const KIMI_CALL_END: &str = "<|tool_call_end|>";

/// A fresh call id in OpenAI's (and vLLM's) style: `call_` and 24 random
/// letters and digits.
pub fn new_call_id() -> String {
    const ALPHABET: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789";
    let mut rng = rand::thread_rng();
    let tail: String = (0..24).map(|_| ALPHABET[rng.gen_range(0..ALPHABET.len())] as char).collect();
    format!("call_{tail}")
}

/// What a chat template does with tools, found by [`TemplateTools::probe`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TemplateTools {
    pub format: ToolFormat,
    /// Prints the `tools` variable; otherwise the tools are described in a
    /// system message.
    pub renders_tools: bool,
    /// Prints `role: "tool"` messages; otherwise they become user messages.
    pub renders_tool_results: bool,
    /// Accepts a `system` message; otherwise the tool description goes at
    /// the start of the first user message.
    pub renders_system: bool,
    /// An assistant message with calls and no text gets `content: null`
    /// (DeepSeek-V3's template prints the calls only then) rather than `""`
    /// (Qwen3's tests `'</think>' in content`).
    pub null_content: bool,
    /// `arguments` is handed over as a mapping rather than the JSON text
    /// (for templates that only `tojson` it).
    pub object_arguments: bool,
}

/// Names in the probe conversations, unlikely to occur in any template.
const PROBE_FUNCTION: &str = "duplex_probe_function";
const PROBE_ARGUMENT: &str = "duplex_probe_argument";
const PROBE_RESULT: &str = "duplex_probe_result";
const PROBE_SYSTEM: &str = "duplex_probe_system";

impl TemplateTools {
    /// What the template does with tools, by rendering probe conversations
    /// with `render(messages, tools)` (the template with
    /// `add_generation_prompt` off). A probe that fails to render (templates
    /// raise on what they do not expect) counts as "not supported".
    pub fn probe(render: impl Fn(&Json, Option<&Json>) -> Result<String, JinjaError>) -> Self {
        let user = json!({"role": "user", "content": "Hello"});
        let arguments = format!("{{\"{PROBE_ARGUMENT}\": 1}}");
        // Kimi-K2's template prints the id, not the name: the id is in
        // Kimi's own form, which names the function.
        let id = format!("functions.{PROBE_FUNCTION}:0");
        let call = |content: Json, object_arguments: bool| {
            let arguments = if object_arguments { json!({PROBE_ARGUMENT: 1}) } else { Json::String(arguments.clone()) };
            json!({"role": "assistant", "content": content, "tool_calls": [
                {"id": id, "type": "function", "function": {"name": PROBE_FUNCTION, "arguments": arguments}}
            ]})
        };
        // The first variant that prints both the name and the arguments as
        // they are (not a string quoted again by `tojson`).
        let variants = [(true, false), (false, false), (true, true), (false, true)];
        let mut found = None;
        for (null_content, object_arguments) in variants {
            let content = if null_content { Json::Null } else { Json::String(String::new()) };
            let messages = json!([user, call(content, object_arguments)]);
            let Ok(text) = render(&messages, None) else { continue };
            if text.contains(PROBE_FUNCTION) && text.contains(PROBE_ARGUMENT) && !text.contains(&format!("\\\"{PROBE_ARGUMENT}")) {
                found = Some((null_content, object_arguments, text));
                break;
            }
        }
        let system_messages = json!([{"role": "system", "content": PROBE_SYSTEM}, user]);
        let renders_system = render(&system_messages, None).is_ok_and(|t| t.contains(PROBE_SYSTEM));
        let Some((null_content, object_arguments, call_text)) = found else {
            return TemplateTools { format: ToolFormat::Generic, renders_tools: false, renders_tool_results: false, renders_system, null_content: false, object_arguments: false };
        };
        let format = if call_text.contains(&format!("{DSV3_CALL_BEGIN}function{DSV3_SEP}{PROBE_FUNCTION}")) {
            ToolFormat::DeepSeekV3
        } else if call_text.contains(KIMI_CALL_BEGIN) && call_text.contains(KIMI_ARGUMENT_BEGIN) {
            ToolFormat::KimiK2
        } else if call_text.contains(HERMES_BEGIN) {
            ToolFormat::Hermes
        } else {
            ToolFormat::Generic
        };
        if format == ToolFormat::Generic {
            return TemplateTools { format, renders_tools: false, renders_tool_results: false, renders_system, null_content: false, object_arguments: false };
        }
        let tools = json!([Tool::function(PROBE_FUNCTION, Some("Probe."), Some(json!({"type": "object"})))]);
        let renders_tools = render(&json!([user]), Some(&tools)).is_ok_and(|t| t.contains(PROBE_FUNCTION));
        let content = if null_content { Json::Null } else { Json::String(String::new()) };
        let with_result = json!([user, call(content, object_arguments), {"role": "tool", "tool_call_id": id, "name": PROBE_FUNCTION, "content": PROBE_RESULT}]);
        let renders_tool_results = render(&with_result, None).is_ok_and(|t| t.contains(PROBE_RESULT));
        TemplateTools { format, renders_tools, renders_tool_results, renders_system, null_content, object_arguments }
    }

    /// The template's inputs for a conversation: the messages as the
    /// template reads them and the `tools` variable (`None`: leave it
    /// undefined). Fills in what the template cannot render (see the module
    /// documentation); `tools` empty means no tool is offered (also
    /// `tool_choice: "none"`), but past calls and results in `messages`
    /// are still rendered.
    pub fn template_inputs(&self, messages: &[ChatMessage], tools: &[Tool]) -> (Json, Option<Json>) {
        let generic = self.format == ToolFormat::Generic;
        let renamed = if self.format == ToolFormat::KimiK2 { kimi_ids(messages) } else { Default::default() };
        let messages: std::borrow::Cow<[ChatMessage]> = if renamed.is_empty() { messages.into() } else { with_kimi_ids(messages, &renamed).into() };
        let messages = &messages[..];
        let mut out: Vec<Json> = Vec::with_capacity(messages.len() + 1);
        // Tool results the template cannot print, gathered into one user
        // message per run (templates that insist on alternating roles).
        let mut results: Vec<String> = Vec::new();
        let flush = |out: &mut Vec<Json>, results: &mut Vec<String>| {
            if !results.is_empty() {
                out.push(json!({"role": "user", "content": results.join("\n\n")}));
                results.clear();
            }
        };
        for (i, m) in messages.iter().enumerate() {
            if m.role == "tool" && (generic || !self.renders_tool_results) {
                results.push(tool_result_text(m, &messages[..i]));
                continue;
            }
            flush(&mut out, &mut results);
            if m.role == "assistant" && !m.tool_calls.is_empty() {
                out.push(if generic { generic_assistant(m) } else { self.native_assistant(m) });
            } else {
                out.push(serde_json::to_value(m).unwrap_or(Json::Null));
            }
        }
        flush(&mut out, &mut results);

        if tools.is_empty() {
            return (Json::Array(out), None);
        }
        if self.renders_tools && !generic {
            return (Json::Array(out), Some(serde_json::to_value(tools).unwrap_or(Json::Null)));
        }
        let description = tools_system_text(self.format, tools);
        match out.first_mut() {
            Some(first) if first["role"] == "system" && self.renders_system => {
                let content = first["content"].as_str().unwrap_or_default();
                first["content"] = Json::String(format!("{content}\n\n{description}"));
            }
            _ if self.renders_system => out.insert(0, json!({"role": "system", "content": description})),
            _ => match out.iter_mut().find(|m| m["role"] == "user") {
                Some(user) => {
                    let content = user["content"].as_str().unwrap_or_default();
                    user["content"] = Json::String(format!("{description}\n\n{content}"));
                }
                None => out.insert(0, json!({"role": "user", "content": description})),
            },
        }
        (Json::Array(out), None)
    }

    /// An assistant message with calls, for a template that prints them.
    fn native_assistant(&self, m: &ChatMessage) -> Json {
        let mut value = serde_json::to_value(m).unwrap_or(Json::Null);
        if self.null_content && m.content.is_empty() {
            value["content"] = Json::Null;
        }
        if self.object_arguments {
            for (i, call) in m.tool_calls.iter().enumerate() {
                // Arguments that are not a JSON object stay text: there is
                // no mapping to give.
                if let Ok(object @ Json::Object(_)) = serde_json::from_str::<Json>(&call.function.arguments) {
                    value["tool_calls"][i]["function"]["arguments"] = object;
                }
            }
        }
        value
    }
}

/// Kimi-K2 reads a call's function from its id, `functions.NAME:IDX`
/// (IDX counting the conversation's calls), and its template prints only
/// the id: ids of another form (a client's `call_...` from elsewhere) are
/// given that form, old id to new, so the results still answer them.
fn kimi_ids(messages: &[ChatMessage]) -> std::collections::HashMap<String, String> {
    let calls = messages.iter().flat_map(|m| m.tool_calls.iter());
    let mut renamed = std::collections::HashMap::new();
    for (index, call) in calls.enumerate() {
        let kimi_form = call.id.strip_prefix("functions.").and_then(|rest| rest.rsplit_once(':')).is_some_and(|(name, idx)| name == call.function.name && !idx.is_empty() && idx.chars().all(|c| c.is_ascii_digit()));
        if !kimi_form {
            renamed.insert(call.id.clone(), format!("functions.{}:{index}", call.function.name));
        }
    }
    renamed
}

fn with_kimi_ids(messages: &[ChatMessage], renamed: &std::collections::HashMap<String, String>) -> Vec<ChatMessage> {
    let rename = |id: &mut String| {
        if let Some(new) = renamed.get(id) {
            *id = new.clone();
        }
    };
    let mut out = messages.to_vec();
    for m in &mut out {
        m.tool_calls.iter_mut().for_each(|c| rename(&mut c.id));
        if let Some(id) = &mut m.tool_call_id {
            rename(id);
        }
    }
    out
}

/// An assistant message with calls in the generic format: the JSON the
/// model was asked to answer with, any text before it kept.
fn generic_assistant(m: &ChatMessage) -> Json {
    let calls: Vec<Json> = m
        .tool_calls
        .iter()
        .map(|c| {
            let arguments = serde_json::from_str::<Json>(&c.function.arguments).unwrap_or_else(|_| Json::String(c.function.arguments.clone()));
            json!({"name": c.function.name, "arguments": arguments})
        })
        .collect();
    let reply = serde_json::to_string(&json!({"tool_calls": calls})).unwrap_or_default();
    let content = if m.content.is_empty() { reply } else { format!("{}\n{reply}", m.content) };
    json!({"role": "assistant", "content": content})
}

/// A tool result as text for a user message: which call it answers (the
/// function's name, from the message or the call it answers) and the result.
fn tool_result_text(m: &ChatMessage, earlier: &[ChatMessage]) -> String {
    let id = m.tool_call_id.as_deref().unwrap_or_default();
    let name = m.name.clone().or_else(|| {
        earlier.iter().rev().flat_map(|e| e.tool_calls.iter()).find(|c| !id.is_empty() && c.id == id).map(|c| c.function.name.clone())
    });
    let mut response = serde_json::Map::new();
    if let Some(name) = name {
        response.insert("name".into(), name.into());
    }
    if !id.is_empty() {
        response.insert("tool_call_id".into(), id.into());
    }
    response.insert("content".into(), m.content.clone().into());
    serde_json::to_string(&json!({"tool_response": response})).unwrap_or_default()
}

/// The system text that offers `tools` to a template that does not print
/// them: the tools as JSON and the exact form of a call in `format`.
pub fn tools_system_text(format: ToolFormat, tools: &[Tool]) -> String {
    let list: Vec<String> = tools.iter().map(|t| serde_json::to_string(t).unwrap_or_default()).collect();
    let list = list.join("\n");
    let example_name = tools.first().map_or("function_name", |t| t.function.name.as_str());
    let syntax = match format {
        ToolFormat::Generic => "To call one or more tools, reply with only a JSON object of this form:\n{\"tool_calls\": [{\"name\": \"<tool name>\", \"arguments\": {<the arguments, as the tool's parameters describe>}}]}\nTo answer without calling a tool, reply with only a JSON object of this form:\n{\"response\": \"<your answer>\"}".to_string(),
        ToolFormat::Hermes => format!("To call a tool, write a JSON object with its name and arguments within {HERMES_BEGIN}{HERMES_END} tags, one per call:\n{HERMES_BEGIN}\n{{\"name\": \"{example_name}\", \"arguments\": {{...}}}}\n{HERMES_END}"),
        ToolFormat::DeepSeekV3 => format!("To call tools, write them in exactly this form, one {DSV3_CALL_BEGIN}...{DSV3_CALL_END} per call:\n{DSV3_CALLS_BEGIN}{DSV3_CALL_BEGIN}function{DSV3_SEP}{example_name}\n```json\n{{...arguments...}}\n```{DSV3_CALL_END}{DSV3_CALLS_END}"),
        ToolFormat::KimiK2 => format!("To call tools, write them in exactly this form, one {KIMI_CALL_BEGIN}...{KIMI_CALL_END} per call, numbering the calls from 0:\n{KIMI_SECTION_BEGIN}{KIMI_CALL_BEGIN}functions.{example_name}:0{KIMI_ARGUMENT_BEGIN}{{...arguments...}}{KIMI_CALL_END}{KIMI_SECTION_END}"),
    };
    format!("# Tools\n\nYou can call the following tools. Each is a JSON object with the tool's name, what it does and the JSON schema of its arguments:\n{list}\n\n{syntax}")
}

/// `tojson` as `transformers` defines it for chat templates (Python's
/// `json.dumps(x, ensure_ascii=False, indent=..., separators=...,
/// sort_keys=...)`): `", "` and `": "` between items, keys in the given
/// order, nothing HTML-escaped. minijinja's own `tojson` writes compact
/// JSON with `<`, `>`, `&` and `'` escaped, so Qwen3's and Kimi-K2's
/// `tools | tojson` would not be the text the models were trained on.
pub(crate) fn python_tojson(value: Value, ensure_ascii: Option<bool>, kwargs: Kwargs) -> Result<Value, JinjaError> {
    let ensure_ascii = match ensure_ascii {
        Some(v) => v,
        None => kwargs.get::<Option<bool>>("ensure_ascii")?.unwrap_or(false),
    };
    let indent = match kwargs.get::<Option<Value>>("indent")? {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) => match v.as_str() {
            Some(s) => Some(s.to_owned()),
            None => Some(" ".repeat(usize::try_from(v)?)),
        },
    };
    let sort_keys = kwargs.get::<Option<bool>>("sort_keys")?.unwrap_or(false);
    let separators = kwargs.get::<Option<Vec<String>>>("separators")?;
    kwargs.assert_all_used()?;
    let (item_sep, key_sep) = match separators {
        Some(s) if s.len() == 2 => (s[0].clone(), s[1].clone()),
        Some(_) => return Err(JinjaError::new(JinjaErrorKind::InvalidOperation, "tojson: separators must be two strings")),
        None if indent.is_some() => (",".into(), ": ".into()),
        None => (", ".into(), ": ".into()),
    };
    let json = serde_json::to_value(&value).map_err(|e| JinjaError::new(JinjaErrorKind::InvalidOperation, "tojson: cannot serialize to JSON").with_source(e))?;
    let style = PyJsonStyle { indent, item_sep, key_sep, ensure_ascii, sort_keys };
    let mut out = String::new();
    style.write(&mut out, &json, 0);
    Ok(Value::from_safe_string(out))
}

struct PyJsonStyle {
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
    ensure_ascii: bool,
    sort_keys: bool,
}

impl PyJsonStyle {
    fn write(&self, out: &mut String, value: &Json, depth: usize) {
        match value {
            Json::Array(items) => {
                let items: Vec<(Option<&str>, &Json)> = items.iter().map(|v| (None, v)).collect();
                self.write_items(out, '[', ']', &items, depth);
            }
            Json::Object(map) => {
                let mut items: Vec<(Option<&str>, &Json)> = map.iter().map(|(k, v)| (Some(k.as_str()), v)).collect();
                if self.sort_keys {
                    items.sort_by(|a, b| a.0.cmp(&b.0));
                }
                self.write_items(out, '{', '}', &items, depth);
            }
            Json::String(s) => self.write_string(out, s),
            other => out.push_str(&other.to_string()),
        }
    }

    fn write_items(&self, out: &mut String, open: char, close: char, items: &[(Option<&str>, &Json)], depth: usize) {
        out.push(open);
        if items.is_empty() {
            out.push(close);
            return;
        }
        for (i, (key, value)) in items.iter().enumerate() {
            if i > 0 {
                out.push_str(&self.item_sep);
            }
            if let Some(indent) = &self.indent {
                out.push('\n');
                out.push_str(&indent.repeat(depth + 1));
            }
            if let Some(key) = key {
                self.write_string(out, key);
                out.push_str(&self.key_sep);
            }
            self.write(out, value, depth + 1);
        }
        if let Some(indent) = &self.indent {
            out.push('\n');
            out.push_str(&indent.repeat(depth));
        }
        out.push(close);
    }

    fn write_string(&self, out: &mut String, s: &str) {
        // serde_json escapes exactly what `json.dumps` does (quote,
        // backslash, control characters); `ensure_ascii` adds the rest.
        let quoted = Json::String(s.to_owned()).to_string();
        if !self.ensure_ascii {
            out.push_str(&quoted);
            return;
        }
        for c in quoted.chars() {
            if c.is_ascii() {
                out.push(c);
            } else {
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    out.push_str(&format!("\\u{unit:04x}"));
                }
            }
        }
    }
}
