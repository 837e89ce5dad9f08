//! The OpenAI API's response bodies, as typed structs: what `openai.rs`
//! sends is exactly what is declared here, so a field cannot go missing or
//! change shape in one code path and not another. Union fields (a choice is
//! a completion's or a chat's, logprobs come in two shapes) are untagged
//! enums, serialized as the variant's own shape.

use crate::generate::{Finished, Token};
use duplex_text::tokenizer::Tokenizer;
use duplex_text::FinishReason;
use serde::Serialize;

/// Why a choice ended, as the API names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ApiFinishReason {
    Stop,
    Length,
    /// The model called tools (chat only).
    ToolCalls,
}

impl From<FinishReason> for ApiFinishReason {
    fn from(r: FinishReason) -> Self {
        match r {
            FinishReason::Stop => ApiFinishReason::Stop,
            FinishReason::Length => ApiFinishReason::Length,
        }
    }
}

/// A whole (non-streamed) response, or one streamed chunk: the envelope is
/// the same, the choices differ.
#[derive(Debug, Serialize)]
pub struct Envelope<C> {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub model: String,
    pub choices: Vec<C>,
    /// Always present in a whole response. In a stream: absent unless the
    /// client asked for usage (`stream_options.include_usage`); then null in
    /// every chunk but the last, which has no choices (as OpenAI sends it).
    #[serde(skip_serializing_if = "UsageField::is_absent")]
    pub usage: UsageField,
}

#[derive(Debug, Serialize)]
#[serde(untagged)]
pub enum UsageField {
    Absent,
    Null(()),
    Present(Usage),
}

impl UsageField {
    fn is_absent(&self) -> bool {
        matches!(self, UsageField::Absent)
    }
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Usage {
    pub prompt_tokens: u32,
    pub completion_tokens: u32,
    pub total_tokens: u32,
}

impl Usage {
    /// The usage of `n` choices of one prompt: the prompt counts once.
    pub fn of<'a>(finished: impl IntoIterator<Item = &'a Finished>) -> Self {
        let mut usage = Usage::default();
        for f in finished {
            usage.prompt_tokens = f.prompt_tokens;
            usage.completion_tokens += f.completion_tokens;
        }
        usage.total_tokens = usage.prompt_tokens + usage.completion_tokens;
        usage
    }
}

/// `/v1/completions`: a whole choice, or a streamed piece of one.
#[derive(Debug, Serialize)]
pub struct CompletionChoice {
    pub index: u32,
    pub text: String,
    pub logprobs: Option<CompletionLogprobs>,
    pub finish_reason: Option<ApiFinishReason>,
}

/// The completions API's logprobs: parallel arrays.
#[derive(Debug, Default, Serialize)]
pub struct CompletionLogprobs {
    pub tokens: Vec<String>,
    pub token_logprobs: Vec<f32>,
    /// One object per token: candidate text to logprob.
    pub top_logprobs: Vec<TopLogprobs>,
    /// Where each token starts in the returned text, in characters.
    pub text_offset: Vec<usize>,
}

/// `/v1/chat/completions`, whole.
#[derive(Debug, Serialize)]
pub struct ChatChoice {
    pub index: u32,
    pub message: ChatMessageOut,
    pub logprobs: Option<ChatLogprobs>,
    pub finish_reason: ApiFinishReason,
}

#[derive(Debug, Serialize)]
pub struct ChatMessageOut {
    pub role: &'static str,
    /// Null when the reply is only tool calls, as OpenAI sends it.
    pub content: Option<String>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCallOut>,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ToolCallOut {
    pub id: String,
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub function: FunctionCallOut,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct FunctionCallOut {
    pub name: String,
    /// JSON text, as OpenAI sends it.
    pub arguments: String,
}

/// `/v1/chat/completions`, one streamed piece.
#[derive(Debug, Serialize)]
pub struct ChatChunkChoice {
    pub index: u32,
    pub delta: ChatDelta,
    pub logprobs: Option<ChatLogprobs>,
    pub finish_reason: Option<ApiFinishReason>,
}

#[derive(Debug, Default, Serialize)]
pub struct ChatDelta {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub role: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCallDelta>,
}

/// A piece of a streamed tool call: the first carries its id and name, the
/// following ones pieces of its arguments (OpenAI's streaming shape).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ToolCallDelta {
    pub index: u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    #[serde(rename = "type", skip_serializing_if = "Option::is_none")]
    pub kind: Option<&'static str>,
    pub function: FunctionDelta,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct FunctionDelta {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    pub arguments: String,
}

#[derive(Debug, Default, Serialize)]
pub struct ChatLogprobs {
    pub content: Vec<ChatTokenLogprob>,
}

#[derive(Debug, Serialize)]
pub struct ChatTokenLogprob {
    pub token: String,
    pub logprob: f32,
    pub bytes: Vec<u8>,
    pub top_logprobs: Vec<ChatTopLogprob>,
}

#[derive(Debug, Serialize)]
pub struct ChatTopLogprob {
    pub token: String,
    pub logprob: f32,
    pub bytes: Vec<u8>,
}

impl ChatLogprobs {
    pub fn of(tok: &Tokenizer, tokens: &[Token]) -> Option<Self> {
        if tokens.first().is_none_or(|t| t.logprob.is_none()) {
            return None;
        }
        let content = tokens
            .iter()
            .map(|t| {
                let token = tok.decode(&[t.id]);
                let top_logprobs = t.top_logprobs.iter().map(|p| ChatTopLogprob { token: p.text.clone(), logprob: p.logprob, bytes: p.text.as_bytes().to_vec() }).collect();
                ChatTokenLogprob { bytes: token.as_bytes().to_vec(), token, logprob: t.logprob.unwrap_or(f32::NAN), top_logprobs }
            })
            .collect();
        Some(ChatLogprobs { content })
    }
}

/// One token's candidates as the completions API shows them: an object
/// from each candidate's text to its logprob, in the engine's order (the
/// likeliest first).
#[derive(Debug, Default)]
pub struct TopLogprobs(Vec<(String, f32)>);

impl FromIterator<(String, f32)> for TopLogprobs {
    /// Two candidates can decode to the same text (two byte tokens of one
    /// partial character both read `�`) and an object has each key once: the
    /// text keeps its first place and takes the later logprob, as a JSON map
    /// filled in that order would.
    fn from_iter<I: IntoIterator<Item = (String, f32)>>(candidates: I) -> Self {
        let mut top = TopLogprobs::default();
        for (text, logprob) in candidates {
            match top.0.iter_mut().find(|(t, _)| *t == text) {
                Some(seen) => seen.1 = logprob,
                None => top.0.push((text, logprob)),
            }
        }
        top
    }
}

impl Serialize for TopLogprobs {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_map(self.0.iter().map(|(text, logprob)| (text, logprob)))
    }
}

/// Where each token starts in the returned completion text, in characters,
/// kept across the chunks of a stream.
///
/// A token's own `text` is what became final with it, which is not where it
/// starts: the detokenizer holds back an incomplete UTF-8 sequence (and the
/// stop-string matcher text that may begin a stop string), and releases it
/// with a later token. A token that released nothing therefore starts where
/// the released text ends *plus* what the tokens held back before it will
/// become; its own decoding (`�` for a partial character, its text for a
/// held-back piece) says how long that is. Without this, the token after a
/// held-back one got the held-back one's offset.
#[derive(Debug, Default)]
pub struct TextOffsets {
    /// Characters of text released so far.
    released: usize,
    /// Characters that the held-back tokens since then stand for.
    pending: usize,
}

impl TextOffsets {
    pub fn next(&mut self, tok: &Tokenizer, t: &Token) -> usize {
        let offset = self.released + self.pending;
        if t.text.is_empty() {
            self.pending += tok.decode(&[t.id]).chars().count();
        } else {
            self.released += t.text.chars().count();
            self.pending = 0;
        }
        offset
    }
}

impl CompletionLogprobs {
    /// Logprobs of `tokens`, or None when the request did not ask for them.
    pub fn of(tok: &Tokenizer, tokens: &[Token], offsets: &mut TextOffsets) -> Option<Self> {
        if tokens.first().is_none_or(|t| t.logprob.is_none()) {
            return None;
        }
        let mut lp = CompletionLogprobs::default();
        for t in tokens {
            lp.text_offset.push(offsets.next(tok, t));
            lp.tokens.push(tok.decode(&[t.id]));
            lp.token_logprobs.push(t.logprob.unwrap_or(f32::NAN));
            lp.top_logprobs.push(t.top_logprobs.iter().map(|p| (p.text.clone(), p.logprob)).collect());
        }
        Some(lp)
    }
}

/// `/v1/models`.
#[derive(Debug, Serialize)]
pub struct ModelList {
    pub object: &'static str,
    pub data: Vec<ModelCard>,
}

#[derive(Debug, Serialize)]
pub struct ModelCard {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub owned_by: &'static str,
    /// The longest prompt plus output one request can have here: the
    /// smaller of the context and what the KV pool can hold.
    pub max_model_len: usize,
}

/// OpenAI's error body: `{"error": {...}}`.
#[derive(Debug, Serialize)]
pub struct ErrorBody<'a> {
    pub error: ErrorDetail<'a>,
}

#[derive(Debug, Serialize)]
pub struct ErrorDetail<'a> {
    pub message: &'a str,
    #[serde(rename = "type")]
    pub kind: &'a str,
    /// The request field at fault, when one is.
    pub param: Option<&'a str>,
    pub code: Option<&'a str>,
}

/// `/health` while both workers answer.
#[derive(Debug, Serialize)]
pub struct Health {
    pub status: &'static str,
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn usage_is_absent_null_or_present() {
        let env = |usage| serde_json::to_value(Envelope::<u32> { id: "x".into(), object: "o", created: 1, model: "m".into(), choices: vec![], usage }).unwrap();
        assert!(env(UsageField::Absent).get("usage").is_none());
        assert_eq!(env(UsageField::Null(()))["usage"], json!(null));
        let u = Usage { prompt_tokens: 2, completion_tokens: 3, total_tokens: 5 };
        assert_eq!(env(UsageField::Present(u))["usage"], json!({"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}));
    }

    #[test]
    fn a_tool_call_only_message_has_null_content() {
        let call = ToolCallOut { id: "call_1".into(), kind: "function", function: FunctionCallOut { name: "f".into(), arguments: "{}".into() } };
        let m = serde_json::to_value(ChatMessageOut { role: "assistant", content: None, tool_calls: vec![call] }).unwrap();
        assert_eq!(m, json!({"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}));
        let d = serde_json::to_value(ChatDelta { content: Some("hi".into()), ..Default::default() }).unwrap();
        assert_eq!(d, json!({"content": "hi"}));
        assert_eq!(serde_json::to_value(ApiFinishReason::ToolCalls).unwrap(), json!("tool_calls"));
    }

    #[test]
    fn top_logprobs_are_an_object_in_the_engines_order() {
        let top: TopLogprobs = [("b".to_string(), -0.5), ("a".to_string(), -1.5), ("b".to_string(), -2.0)].into_iter().collect();
        assert_eq!(serde_json::to_string(&top).unwrap(), r#"{"b":-2.0,"a":-1.5}"#);
    }
}
