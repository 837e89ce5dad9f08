//! The grammar that makes a required call well-formed: with `tool_choice:
//! "required"` or a named function the model's output is constrained to
//! one call (or several, with parallel calls) in its own format, each
//! call's arguments to the function's `parameters` schema.
//!
//! The generic format is plain JSON, so its constraint is a JSON schema;
//! the native formats mix markup and JSON, so theirs is a Lark grammar in
//! llguidance's dialect, where `%json {...}` embeds a JSON schema and
//! `<|name|>` (unquoted) is a special token. Markup that is a special
//! token in the model's vocabulary must be written that way (as text it
//! would never match the single token the model emits); markup that is
//! ordinary text is a quoted string.

use serde_json::{json, Value as Json};

use super::{
    Tool, ToolChoice, ToolFormat, DSV3_CALLS_BEGIN, DSV3_CALLS_END, DSV3_CALL_BEGIN, DSV3_CALL_END, DSV3_SEP, HERMES_BEGIN, HERMES_END,
    KIMI_ARGUMENT_BEGIN, KIMI_CALL_BEGIN, KIMI_CALL_END, KIMI_SECTION_BEGIN, KIMI_SECTION_END,
};

/// A constraint for the grammar engine (`duplex-grammar`'s
/// `ConstraintSpec::JsonSchema` and `ConstraintSpec::Lark`).
#[derive(Clone, Debug, PartialEq)]
pub enum ToolConstraint {
    JsonSchema(Json),
    Lark(String),
}

/// The constraint for `choice`: `None` unless a call is required
/// (`"required"`: any of `tools`; a named function: that one). With
/// `parallel` false exactly one call, otherwise one or more. `is_special`
/// says whether a markup string is a special token of the model's
/// vocabulary (`|s| tokenizer.special_token_id(s).is_some()`). The tools
/// are assumed checked by [`super::validate_tools`].
pub fn tool_constraint(
    format: ToolFormat,
    tools: &[Tool],
    choice: &ToolChoice,
    parallel: bool,
    is_special: impl Fn(&str) -> bool,
) -> Option<ToolConstraint> {
    let offered: Vec<&Tool> = match choice {
        ToolChoice::None | ToolChoice::Auto => return None,
        ToolChoice::Required => tools.iter().collect(),
        ToolChoice::Function(name) => tools.iter().filter(|t| &t.function.name == name).collect(),
    };
    if offered.is_empty() {
        return None;
    }
    let marker = |text: &str| if is_special(text) { text.to_string() } else { quoted(text) };
    Some(match format {
        ToolFormat::Generic => ToolConstraint::JsonSchema(generic_schema(&offered, parallel)),
        ToolFormat::Hermes => {
            let mut lark = String::new();
            lark.push_str(&repeat_rule("start", "call", "\"\\n\"", parallel));
            lark.push_str(&format!("call: {} \"\\n\" body \"\\n\" {}\n", marker(HERMES_BEGIN), marker(HERMES_END)));
            lark.push_str(&alternatives("body", offered.len()));
            for (i, tool) in offered.iter().enumerate() {
                lark.push_str(&format!("fn_{i}: %json {}\n", call_object_schema(tool)));
            }
            ToolConstraint::Lark(lark)
        }
        ToolFormat::DeepSeekV3 => {
            let mut lark = format!("start: {} calls {}\n", marker(DSV3_CALLS_BEGIN), marker(DSV3_CALLS_END));
            lark.push_str(&repeat_rule("calls", "call", "\"\\n\"", parallel));
            lark.push_str(&format!("call: {} \"function\" {} body {}\n", marker(DSV3_CALL_BEGIN), marker(DSV3_SEP), marker(DSV3_CALL_END)));
            lark.push_str(&alternatives("body", offered.len()));
            for (i, tool) in offered.iter().enumerate() {
                let head = quoted(&format!("{}\n```json\n", tool.function.name));
                lark.push_str(&format!("fn_{i}: {head} args_{i} \"\\n```\"\n"));
                lark.push_str(&format!("args_{i}: %json {}\n", tool.parameters_schema()));
            }
            ToolConstraint::Lark(lark)
        }
        ToolFormat::KimiK2 => {
            let mut lark = format!("start: {} calls {}\n", marker(KIMI_SECTION_BEGIN), marker(KIMI_SECTION_END));
            lark.push_str(&repeat_rule("calls", "call", "", parallel));
            lark.push_str(&format!("call: {} body {}\n", marker(KIMI_CALL_BEGIN), marker(KIMI_CALL_END)));
            lark.push_str(&alternatives("body", offered.len()));
            for (i, tool) in offered.iter().enumerate() {
                let head = quoted(&format!("functions.{}:", tool.function.name));
                lark.push_str(&format!("fn_{i}: {head} /[0-9]+/ {} args_{i}\n", marker(KIMI_ARGUMENT_BEGIN)));
                lark.push_str(&format!("args_{i}: %json {}\n", tool.parameters_schema()));
            }
            ToolConstraint::Lark(lark)
        }
    })
}

/// The generic format's reply with calls:
/// `{"tool_calls": [{"name": ..., "arguments": {...}}, ...]}`.
fn generic_schema(offered: &[&Tool], parallel: bool) -> Json {
    let items: Vec<Json> = offered.iter().map(|t| call_object_schema(t)).collect();
    let items = if items.len() == 1 { items.into_iter().next().unwrap_or_default() } else { json!({"anyOf": items}) };
    let mut calls = json!({"type": "array", "items": items, "minItems": 1});
    if !parallel {
        calls["maxItems"] = json!(1);
    }
    json!({
        "type": "object",
        "properties": {"tool_calls": calls},
        "required": ["tool_calls"],
        "additionalProperties": false
    })
}

/// `{"name": NAME, "arguments": {...}}` for one tool.
fn call_object_schema(tool: &Tool) -> Json {
    json!({
        "type": "object",
        "properties": {
            "name": {"const": tool.function.name},
            "arguments": tool.parameters_schema()
        },
        "required": ["name", "arguments"],
        "additionalProperties": false
    })
}

/// `rule: item` or, with `many`, `rule: item (separator item)*`.
fn repeat_rule(rule: &str, item: &str, separator: &str, many: bool) -> String {
    match (many, separator.is_empty()) {
        (false, _) => format!("{rule}: {item}\n"),
        (true, true) => format!("{rule}: {item}+\n"),
        (true, false) => format!("{rule}: {item} ({separator} {item})*\n"),
    }
}

/// `rule: fn_0 | fn_1 | ...`.
fn alternatives(rule: &str, n: usize) -> String {
    let names: Vec<String> = (0..n).map(|i| format!("fn_{i}")).collect();
    format!("{rule}: {}\n", names.join(" | "))
}

/// A Lark string literal (JSON's escapes, which llguidance reads).
fn quoted(text: &str) -> String {
    Json::String(text.to_string()).to_string()
}
