//! The model's tool-call markup parsed back into OpenAI `tool_calls`, as
//! the text streams in.
//!
//! [`ToolCallParser::push`] takes text deltas and returns events: text for
//! the client ([`ToolEvent::Content`]), a call's start with its id and name
//! ([`ToolEvent::ToolCallStart`]) and its arguments in pieces
//! ([`ToolEvent::ToolCallArguments`]), the shape of OpenAI's streamed
//! `delta.tool_calls`. Text that may be the start of markup is held back
//! until it is known not to be. Markup that turns out malformed is given
//! back as content (as vLLM does) rather than failing the request: the
//! client sees what the model wrote.
//!
//! Arguments stream as they arrive where the markup delimits them
//! (DeepSeek-V3, Kimi-K2); where a call is one JSON object (Hermes, the
//! generic format) the call is sent once the object is complete and
//! parsed, since only then is it known to be a call.

use serde_json::Value as Json;

use super::{
    new_call_id, ToolFormat, DSV3_CALLS_BEGIN, DSV3_CALLS_END, DSV3_CALL_BEGIN, DSV3_CALL_END, DSV3_SEP, HERMES_BEGIN, HERMES_END,
    KIMI_ARGUMENT_BEGIN, KIMI_CALL_BEGIN, KIMI_CALL_END, KIMI_SECTION_BEGIN, KIMI_SECTION_END,
};

/// What the parser makes of the model's text.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ToolEvent {
    /// Text for the client (`delta.content`).
    Content(String),
    /// A call begins: `delta.tool_calls[{index, id, type: "function",
    /// function: {name, arguments: ""}}]`.
    ToolCallStart { index: usize, id: String, name: String },
    /// More of call `index`'s arguments (JSON text):
    /// `delta.tool_calls[{index, function: {arguments: delta}}]`.
    ToolCallArguments { index: usize, delta: String },
}

/// Longest header (a call's type and name, or Kimi's id) the parser waits
/// for before it calls the markup malformed: function names are at most
/// 64 characters.
const MAX_HEADER: usize = 256;

/// DeepSeek-V3 writes the arguments in a fenced JSON block after the name.
const DSV3_FENCE_OPEN: &str = "```json";

/// A streaming parser of one response in one [`ToolFormat`].
#[derive(Debug)]
pub struct ToolCallParser {
    format: ToolFormat,
    parallel: bool,
    state: State,
    /// Text received and not yet turned into events.
    buf: String,
    /// Markup consumed for the unit being parsed (a section's or call's
    /// opening), given back as content if the unit turns out malformed.
    raw: String,
    /// Whitespace held back after content, dropped if a call follows.
    pending_space: String,
    /// Calls started so far (also the next call's index).
    calls: usize,
    /// A call beyond the first with `parallel_tool_calls: false`: parsed,
    /// not sent.
    muted: bool,
    /// Generic format: the reply opened a Markdown code block, whose
    /// closing fence is layout too.
    fenced: bool,
    events: Vec<ToolEvent>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    /// Plain text, looking for the start of markup.
    Text,
    /// Inside a section of calls (DeepSeek-V3, Kimi-K2), between calls.
    Section,
    /// After a call's opening marker, before its arguments.
    Header,
    /// Streaming a call's arguments.
    Arguments,
    /// Inside `<tool_call>...</tool_call>` (Hermes).
    HermesCall,
    /// Generic format, before the first character that is not whitespace.
    GenericStart,
    /// Generic format: a JSON object, held until its first key is known.
    GenericKey,
    /// Generic format: streaming the string of `{"response": "...`.
    GenericResponse,
    /// Generic format: after the response string, the rest of the object.
    GenericResponseEnd,
    /// Generic format: a JSON object held whole until it is complete.
    GenericObject,
    /// Generic format: the model did not answer with JSON; all content.
    Plain,
}

impl ToolCallParser {
    /// A parser for `format`. With `parallel` false (OpenAI's
    /// `parallel_tool_calls: false`) only the first call is reported;
    /// further calls are parsed and dropped.
    pub fn new(format: ToolFormat, parallel: bool) -> Self {
        let state = if format == ToolFormat::Generic { State::GenericStart } else { State::Text };
        ToolCallParser {
            format,
            parallel,
            state,
            buf: String::new(),
            raw: String::new(),
            pending_space: String::new(),
            calls: 0,
            muted: false,
            fenced: false,
            events: Vec::new(),
        }
    }

    /// Feeds the next piece of the model's text; returns what can be said
    /// about the text so far.
    pub fn push(&mut self, text: &str) -> Vec<ToolEvent> {
        self.buf.push_str(text);
        self.run(false);
        std::mem::take(&mut self.events)
    }

    /// The end of the text: everything held back is decided (an unclosed
    /// call whose arguments are complete still counts; markup cut short is
    /// given back as content).
    pub fn finish(&mut self) -> Vec<ToolEvent> {
        self.run(true);
        match self.state {
            State::Text | State::Plain => {
                let rest = std::mem::take(&mut self.buf);
                self.content(&rest);
                if self.calls == 0 {
                    let space = std::mem::take(&mut self.pending_space);
                    self.push_content(space);
                }
            }
            State::Section | State::GenericResponseEnd | State::GenericStart => {
                if self.state == State::GenericStart {
                    let rest = std::mem::take(&mut self.buf);
                    self.push_content(rest);
                }
            }
            State::Header => self.malformed(),
            State::GenericKey | State::GenericObject => {
                self.generic_object(true);
            }
            State::Arguments => {
                // What is held back is the start of the end marker.
                let held = std::mem::take(&mut self.buf);
                let end = self.arguments_end_prefix_len(&held);
                self.arguments(&held[..held.len() - end]);
            }
            State::HermesCall => {
                let inner = std::mem::take(&mut self.buf);
                if !self.hermes_call(&inner) {
                    let raw = format!("{}{inner}", std::mem::take(&mut self.raw));
                    self.push_content(raw);
                }
            }
            State::GenericResponse => {
                // Cut short inside the string: what decoded is the answer.
                let (text, _, _) = decode_json_string(&self.buf, true);
                self.buf.clear();
                self.push_content(text);
            }
        }
        self.state = State::Text;
        std::mem::take(&mut self.events)
    }

    /// Whether the model made any call (`finish_reason: "tool_calls"`).
    pub fn made_calls(&self) -> bool {
        self.calls > 0
    }

    fn run(&mut self, at_end: bool) {
        loop {
            let progressed = match self.state {
                State::Text => self.text(at_end),
                State::Section => self.section(),
                State::Header => self.header(),
                State::Arguments => self.arguments_step(),
                State::HermesCall => self.hermes_step(),
                State::GenericStart => self.generic_start(),
                State::GenericKey => self.generic_key(),
                State::GenericResponse => self.generic_response(),
                State::GenericResponseEnd => self.generic_response_end(),
                State::GenericObject => self.generic_object(false),
                State::Plain => self.plain(at_end),
            };
            if !progressed {
                break;
            }
        }
    }

    /// The marker that opens markup in this format.
    fn opening(&self) -> &'static str {
        match self.format {
            ToolFormat::Hermes => HERMES_BEGIN,
            ToolFormat::DeepSeekV3 => DSV3_CALLS_BEGIN,
            ToolFormat::KimiK2 => KIMI_SECTION_BEGIN,
            ToolFormat::Generic => "",
        }
    }

    fn markers(&self) -> (&'static str, &'static str, &'static str) {
        match self.format {
            ToolFormat::KimiK2 => (KIMI_SECTION_END, KIMI_CALL_BEGIN, KIMI_CALL_END),
            _ => (DSV3_CALLS_END, DSV3_CALL_BEGIN, DSV3_CALL_END),
        }
    }

    fn text(&mut self, at_end: bool) -> bool {
        let opening = self.opening();
        if let Some(at) = self.buf.find(opening) {
            let before: String = self.buf.drain(..at).collect();
            self.content(&before);
            // Whitespace right before a call is layout, not an answer.
            self.pending_space.clear();
            self.buf.drain(..opening.len());
            self.raw = opening.to_string();
            self.state = if self.format == ToolFormat::Hermes { State::HermesCall } else { State::Section };
            return true;
        }
        let keep = if at_end { 0 } else { partial_marker_len(&self.buf, &[opening]) };
        let ready: String = self.buf.drain(..self.buf.len() - keep).collect();
        self.content(&ready);
        false
    }

    /// Sends `text` as content, holding back trailing whitespace (dropped
    /// if a call follows, and after calls unless text follows).
    fn content(&mut self, text: &str) {
        if text.is_empty() {
            return;
        }
        let body = text.trim_end();
        if body.is_empty() {
            self.pending_space.push_str(text);
            return;
        }
        let mut out = std::mem::take(&mut self.pending_space);
        out.push_str(body);
        self.pending_space = text[body.len()..].to_string();
        self.push_content(out);
    }

    fn push_content(&mut self, text: String) {
        if text.is_empty() {
            return;
        }
        if let Some(ToolEvent::Content(last)) = self.events.last_mut() {
            last.push_str(&text);
        } else {
            self.events.push(ToolEvent::Content(text));
        }
    }

    /// Gives the unit being parsed back as content and returns to text.
    fn malformed(&mut self) {
        let mut raw = std::mem::take(&mut self.raw);
        raw.push_str(&std::mem::take(&mut self.buf));
        self.state = if self.format == ToolFormat::Generic { State::Plain } else { State::Text };
        let space = std::mem::take(&mut self.pending_space);
        self.push_content(space);
        self.push_content(raw);
    }

    fn section(&mut self) -> bool {
        let (section_end, call_begin, _) = self.markers();
        let body = self.buf.trim_start();
        if let Some(rest) = body.strip_prefix(call_begin) {
            self.buf = rest.to_string();
            self.raw.push_str(call_begin);
            self.state = State::Header;
            return true;
        }
        if let Some(rest) = body.strip_prefix(section_end) {
            self.buf = rest.to_string();
            self.raw.clear();
            self.state = State::Text;
            return true;
        }
        // DeepSeek-V3's template writes the end of the section and of the
        // turn together; a model may stop after the last call instead.
        if body.is_empty() || call_begin.starts_with(body) || section_end.starts_with(body) {
            return false;
        }
        self.malformed();
        true
    }

    fn header(&mut self) -> bool {
        let end_marker = match self.format {
            ToolFormat::KimiK2 => KIMI_ARGUMENT_BEGIN,
            _ => DSV3_FENCE_OPEN,
        };
        let (_, _, call_end) = self.markers();
        let Some(at) = self.buf.find(end_marker) else {
            let kimi_line_break = self.format == ToolFormat::KimiK2 && self.buf.contains('\n');
            if self.buf.len() > MAX_HEADER || kimi_line_break || self.buf.contains(call_end) {
                self.malformed();
                return true;
            }
            return false;
        };
        // DeepSeek-V3's fence ends its line: wait for what follows it.
        if self.format == ToolFormat::DeepSeekV3 && self.buf.len() == at + end_marker.len() {
            return false;
        }
        let header = self.buf[..at].trim().to_string();
        let parsed = match self.format {
            ToolFormat::KimiK2 => parse_kimi_header(&header),
            _ => parse_dsv3_header(&header).map(|name| (new_call_id(), name)),
        };
        let Some((id, name)) = parsed else {
            self.malformed();
            return true;
        };
        self.buf.drain(..at + end_marker.len());
        if self.format == ToolFormat::DeepSeekV3 {
            // The fence's own line break.
            if self.buf.starts_with('\n') {
                self.buf.remove(0);
            } else if self.buf.starts_with("\r\n") {
                self.buf.drain(..2);
            }
        }
        self.raw.clear();
        self.start_call(id, name);
        self.state = State::Arguments;
        true
    }

    fn start_call(&mut self, id: String, name: String) {
        self.pending_space.clear();
        self.muted = !self.parallel && self.calls > 0;
        if !self.muted {
            self.events.push(ToolEvent::ToolCallStart { index: self.calls, id, name });
            self.calls += 1;
        }
    }

    fn arguments(&mut self, delta: &str) {
        if !delta.is_empty() && !self.muted {
            let index = self.calls - 1;
            match self.events.last_mut() {
                Some(ToolEvent::ToolCallArguments { index: i, delta: d }) if *i == index => d.push_str(delta),
                _ => self.events.push(ToolEvent::ToolCallArguments { index, delta: delta.to_string() }),
            }
        }
    }

    fn arguments_step(&mut self) -> bool {
        let (_, _, call_end) = self.markers();
        if let Some(at) = self.buf.find(call_end) {
            let args: String = self.buf.drain(..at).collect();
            self.buf.drain(..call_end.len());
            let args = match self.format {
                // The closing fence before the end marker.
                ToolFormat::DeepSeekV3 => {
                    let trimmed = args.trim_end();
                    trimmed.strip_suffix("```").map_or(trimmed, str::trim_end).to_string()
                }
                _ => args,
            };
            self.arguments(&args);
            self.state = State::Section;
            return true;
        }
        let hold = self.arguments_end_prefix_len(&self.buf);
        let ready: String = self.buf.drain(..self.buf.len() - hold).collect();
        self.arguments(&ready);
        false
    }

    /// Bytes at the end of `text` that may begin the end of the arguments
    /// (DeepSeek-V3: whitespace, the closing fence, the end marker).
    fn arguments_end_prefix_len(&self, text: &str) -> usize {
        let (_, _, call_end) = self.markers();
        if self.format != ToolFormat::DeepSeekV3 {
            return partial_marker_len(text, &[call_end]);
        }
        let starts_end = |s: &str| {
            let s = s.trim_start();
            let ticks = s.len() - s.trim_start_matches('`').len();
            let rest = &s[ticks..];
            match ticks {
                0 => rest.is_empty() || call_end.starts_with(rest),
                1 | 2 => rest.is_empty(),
                3 => {
                    let rest = rest.trim_start();
                    rest.is_empty() || call_end.starts_with(rest)
                }
                _ => false,
            }
        };
        text.char_indices().map(|(i, _)| i).find(|&i| text.len() - i <= MAX_HEADER && starts_end(&text[i..])).map_or(0, |i| text.len() - i)
    }

    fn hermes_step(&mut self) -> bool {
        let Some(at) = self.buf.find(HERMES_END) else {
            return false;
        };
        let inner: String = self.buf.drain(..at).collect();
        self.buf.drain(..HERMES_END.len());
        if !self.hermes_call(&inner) {
            let raw = format!("{}{inner}{HERMES_END}", std::mem::take(&mut self.raw));
            let space = std::mem::take(&mut self.pending_space);
            self.push_content(space);
            self.push_content(raw);
        }
        self.raw.clear();
        self.state = State::Text;
        true
    }

    /// A call from `{"name": ..., "arguments": ...}`; false if it is not one.
    fn hermes_call(&mut self, inner: &str) -> bool {
        let Ok(Json::Object(call)) = serde_json::from_str::<Json>(inner.trim()) else {
            return false;
        };
        let Some((name, arguments)) = name_and_arguments(&call) else {
            return false;
        };
        self.raw.clear();
        self.start_call(new_call_id(), name);
        self.arguments(&arguments);
        true
    }

    fn plain(&mut self, at_end: bool) -> bool {
        if self.fenced {
            let body = self.buf.trim_start();
            if let Some(rest) = body.strip_prefix("```") {
                self.buf = rest.to_string();
                self.fenced = false;
            } else if !at_end && "```".starts_with(body) {
                return false;
            } else {
                self.fenced = false;
            }
        }
        let rest = std::mem::take(&mut self.buf);
        self.content(&rest);
        false
    }

    fn generic_start(&mut self) -> bool {
        let body = self.buf.trim_start();
        match body.chars().next() {
            None => false,
            // The reply in a Markdown code block: the fences are layout.
            Some('`') if !self.fenced => {
                let Some(line_end) = body.find('\n') else {
                    let may_be_fence = body.len() <= "```json".len() && (body.starts_with("```") || "```".starts_with(body));
                    if !may_be_fence {
                        self.state = State::Plain;
                    }
                    return !may_be_fence;
                };
                let fence = body[..line_end].trim();
                if fence == "```" || fence == "```json" {
                    self.buf = body[line_end + 1..].to_string();
                    self.fenced = true;
                } else {
                    self.state = State::Plain;
                }
                true
            }
            Some('{') => {
                self.buf = body.to_string();
                self.state = State::GenericKey;
                true
            }
            Some(_) => {
                self.state = State::Plain;
                true
            }
        }
    }

    fn generic_key(&mut self) -> bool {
        match first_key(&self.buf) {
            KeyScan::NeedMore => false,
            KeyScan::Key(key, value_at) if key == "response" && self.buf[value_at..].starts_with('"') => {
                self.raw = self.buf[..value_at + 1].to_string();
                self.buf.drain(..value_at + 1);
                self.state = State::GenericResponse;
                true
            }
            KeyScan::Key(_, value_at) if self.buf.len() == value_at => false,
            KeyScan::Key(..) | KeyScan::NotKey => {
                self.state = State::GenericObject;
                true
            }
        }
    }

    fn generic_response(&mut self) -> bool {
        let (text, used, closed) = decode_json_string(&self.buf, false);
        self.buf.drain(..used);
        self.push_content(text);
        if closed {
            self.raw.clear();
            self.state = State::GenericResponseEnd;
            return true;
        }
        false
    }

    /// The rest of `{"response": "..."}`: the closing brace (other keys are
    /// ignored); anything after the object is content.
    fn generic_response_end(&mut self) -> bool {
        let mut scan = JsonScan { depth: 1, ..JsonScan::default() };
        match scan.end(&self.buf) {
            Some(end) => {
                self.buf.drain(..end);
                self.state = State::Plain;
                true
            }
            None => false,
        }
    }

    /// A whole JSON object: calls, an answer, or (anything else) content.
    /// Returns whether it was complete.
    fn generic_object(&mut self, at_end: bool) -> bool {
        let end = JsonScan::default().end(&self.buf).or(at_end.then_some(self.buf.len()));
        let Some(end) = end else {
            return false;
        };
        let object: String = self.buf.drain(..end).collect();
        match serde_json::from_str::<Json>(&object) {
            Ok(Json::Object(map)) => match (map.get("tool_calls"), map.get("response")) {
                (Some(Json::Array(calls)), _) if !calls.is_empty() && calls.iter().all(|c| c.as_object().and_then(name_and_arguments).is_some()) => {
                    for call in calls {
                        if let Some((name, arguments)) = call.as_object().and_then(name_and_arguments) {
                            self.start_call(new_call_id(), name);
                            self.arguments(&arguments);
                        }
                    }
                }
                (_, Some(Json::String(answer))) => self.push_content(answer.clone()),
                _ => self.push_content(object),
            },
            _ => self.push_content(object),
        }
        self.state = State::Plain;
        true
    }
}

/// `name` and `arguments` (as JSON text) of a call object.
fn name_and_arguments(call: &serde_json::Map<String, Json>) -> Option<(String, String)> {
    let name = call.get("name")?.as_str()?.to_string();
    let arguments = match call.get("arguments").or_else(|| call.get("parameters")) {
        None => "{}".to_string(),
        // Some models write the arguments as JSON text already.
        Some(Json::String(text)) => text.clone(),
        Some(value) => serde_json::to_string(value).ok()?,
    };
    Some((name, arguments))
}

/// DeepSeek-V3's `function<｜tool▁sep｜>NAME`: the name.
fn parse_dsv3_header(header: &str) -> Option<String> {
    let (_kind, name) = header.split_once(DSV3_SEP)?;
    let name = name.trim();
    valid_name(name).then(|| name.to_string())
}

/// Kimi-K2's `functions.NAME:IDX`: the id (all of it) and the name.
fn parse_kimi_header(header: &str) -> Option<(String, String)> {
    let (path, index) = header.rsplit_once(':')?;
    if index.is_empty() || !index.chars().all(|c| c.is_ascii_digit()) {
        return None;
    }
    let name = path.strip_prefix("functions.").unwrap_or(path);
    valid_name(name).then(|| (header.to_string(), name.to_string()))
}

fn valid_name(name: &str) -> bool {
    !name.is_empty() && name.len() <= 64 && name.chars().all(|c| c.is_ascii_alphanumeric() || "_-.".contains(c))
}

/// Bytes at the end of `text` that are the start of one of `markers`
/// (and so must wait for the next piece).
fn partial_marker_len(text: &str, markers: &[&str]) -> usize {
    let mut longest = 0;
    for marker in markers {
        for (i, _) in text.char_indices().rev().take(marker.chars().count()) {
            let tail = &text[i..];
            if tail.len() < marker.len() && marker.starts_with(tail) {
                longest = longest.max(tail.len());
            }
        }
    }
    longest
}

enum KeyScan {
    NeedMore,
    /// The first key and where its value starts (whitespace skipped).
    Key(String, usize),
    NotKey,
}

/// The first key of the JSON object `text` starts with.
fn first_key(text: &str) -> KeyScan {
    let Some(after_brace) = text.strip_prefix('{') else {
        return KeyScan::NotKey;
    };
    let body = after_brace.trim_start();
    let Some(key_text) = body.strip_prefix('"') else {
        return if body.is_empty() { KeyScan::NeedMore } else { KeyScan::NotKey };
    };
    let (key, used, closed) = decode_json_string(key_text, false);
    if !closed {
        return KeyScan::NeedMore;
    }
    let after_key = key_text[used..].trim_start();
    let Some(after_colon) = after_key.strip_prefix(':') else {
        return if after_key.is_empty() { KeyScan::NeedMore } else { KeyScan::NotKey };
    };
    let value = after_colon.trim_start();
    KeyScan::Key(key, text.len() - value.len())
}

/// Decodes a JSON string's characters from `text` (which starts after the
/// opening quote): the text, the bytes used (the closing quote included)
/// and whether it was closed. An escape cut off at the end waits, unless
/// `at_end`.
fn decode_json_string(text: &str, at_end: bool) -> (String, usize, bool) {
    let mut out = String::new();
    let mut chars = text.char_indices().peekable();
    let mut used = 0;
    while let Some((i, c)) = chars.next() {
        match c {
            '"' => return (out, i + 1, true),
            '\\' => {
                let Some(&(_, e)) = chars.peek() else { break };
                chars.next();
                let simple = match e {
                    '"' => Some('"'),
                    '\\' => Some('\\'),
                    '/' => Some('/'),
                    'b' => Some('\u{8}'),
                    'f' => Some('\u{c}'),
                    'n' => Some('\n'),
                    'r' => Some('\r'),
                    't' => Some('\t'),
                    _ => None,
                };
                if let Some(s) = simple {
                    out.push(s);
                    used = i + 2;
                    continue;
                }
                if e != 'u' {
                    // Not JSON; keep it as written.
                    out.push('\\');
                    out.push(e);
                    used = i + 1 + e.len_utf8();
                    continue;
                }
                let hex = |at: usize| text.get(at..at + 4).and_then(|h| u32::from_str_radix(h, 16).ok());
                let Some(unit) = hex(i + 2) else {
                    if text.len() < i + 6 {
                        break;
                    }
                    out.push('\u{FFFD}');
                    used = i + 2;
                    continue;
                };
                let mut end = i + 6;
                let c = if (0xD800..0xDC00).contains(&unit) {
                    // A high surrogate wants its low half.
                    if text.len() < i + 12 {
                        break;
                    }
                    match (text.get(i + 6..i + 8), hex(i + 8)) {
                        (Some("\\u"), Some(low)) if (0xDC00..0xE000).contains(&low) => {
                            end = i + 12;
                            char::from_u32(0x10000 + ((unit - 0xD800) << 10) + (low - 0xDC00))
                        }
                        _ => None,
                    }
                } else {
                    char::from_u32(unit)
                };
                out.push(c.unwrap_or('\u{FFFD}'));
                used = end;
                while chars.peek().is_some_and(|&(j, _)| j < end) {
                    chars.next();
                }
            }
            c => {
                out.push(c);
                used = i + c.len_utf8();
            }
        }
    }
    if at_end {
        used = text.len();
    }
    (out, used, false)
}

/// Finds where a JSON value that `text` starts with ends, keeping track
/// of strings and nesting.
#[derive(Default)]
struct JsonScan {
    depth: usize,
    in_string: bool,
    escaped: bool,
}

impl JsonScan {
    fn end(&mut self, text: &str) -> Option<usize> {
        for (i, c) in text.char_indices() {
            if self.in_string {
                match c {
                    _ if self.escaped => self.escaped = false,
                    '\\' => self.escaped = true,
                    '"' => self.in_string = false,
                    _ => {}
                }
                continue;
            }
            match c {
                '"' => self.in_string = true,
                '{' | '[' => self.depth += 1,
                '}' | ']' => {
                    self.depth = self.depth.saturating_sub(1);
                    if self.depth == 0 {
                        return Some(i + 1);
                    }
                }
                _ => {}
            }
        }
        None
    }
}
