//! duplex-grammar: structured output. Turns a client's constraint (a JSON
//! object, a JSON schema, a Lark grammar) into a per-request token matcher
//! over the served tokenizer: at each step it fills a [`TokenMask`] of the
//! ids that keep the output valid, which the sampler applies before it
//! draws (`duplex_text::sampling::Sampler::sample_with_mask`), and it is
//! told the chosen token.
//!
//! # Why llguidance
//!
//! The issue named two engines made for this, llguidance (llama.cpp,
//! vLLM) and outlines-core (TGI, vLLM). `examples/compare_engines.rs`
//! measured both here (dev profile, whose dependencies build at opt-level
//! 2; a 2-core machine shared with other builds, so the maxima are noisy).
//! Mask time per token, min / median / max in µs over every token of 5
//! interleaved replays of one valid output; compile time in ms:
//!
//! | vocabulary | schema | llguidance mask | outlines-core mask | llg compile | outlines compile |
//! |---|---|---|---|---|---|
//! | tiny-dsv3 (2,048) | flat object | 0.2 / 0.3 / 137 | 0.0 / 0.1 / 4 | 0.24 | 4.8 |
//! | tiny-dsv3 (2,048) | nested + array + enum | 0.2 / 0.3 / 149 | 0.0 / 0.1 / 0 | 0.24 | 9.0 |
//! | tiny-dsv3 (2,048) | free-form strings | 0.2 / 0.3 / 50 | 0.0 / 3.7 / 76 | 0.15 | 1.1 |
//! | 129,280 (synthetic) | flat object | 3.6 / 6.7 / 974 | 0.1 / 0.4 / 226 | 0.27 | 827 |
//! | 129,280 (synthetic) | nested + array + enum | 0.5 / 4.7 / 4834 | 0.1 / 0.2 / 13 | 0.28 | 1695 |
//! | 129,280 (synthetic) | array of objects | 0.6 / 4.1 / 5744 | 0.1 / 0.5 / 4209 | 0.22 | 1895 |
//! | 129,280 (synthetic) | free-form strings | 0.4 / 0.5 / 4266 | 0.2 / 197 / 7714 | 0.19 | 189 |
//!
//! Both mask far faster than a decode step (tens of ms for the models
//! Duplex serves), and the masks are computed while the forward pass runs,
//! so mask time alone does not decide. Three things do:
//!
//! - compile time: outlines-core builds its whole token index up front, 0.2
//!   to 1.9 s per schema on a 129K vocabulary, time a request waits before
//!   its first token (and the router spends again to validate it), where
//!   llguidance compiles in under a millisecond and works lazily (its worst
//!   mask, the first of a request, is a few ms);
//! - the mask of free text: outlines-core lists the allowed ids, 129K of
//!   them inside a string, ~0.2 ms to turn into a bitmask each token;
//!   llguidance's masks are bitmasks already (copied whole, ~0.5 µs);
//! - schema features: sampling each feature's schema and validating the
//!   output, outlines-core ignored numeric bounds (`minimum`/`maximum`,
//!   `exclusiveMinimum`/`exclusiveMaximum`: out-of-range output) and
//!   rejected `allOf`; llguidance honoured required, enum, const, numeric
//!   bounds, min/maxItems, min/maxLength, pattern, `format: date`, anyOf,
//!   oneOf, allOf, `$ref` (recursive too), optional properties and type
//!   lists. Neither honoured min/maxProperties; llguidance refuses
//!   `uniqueItems` by name (a 400) rather than ignore it. And llguidance
//!   takes Lark grammars, which tool calls use; outlines-core has regular
//!   expressions only.
//!
//! The engine is llguidance. outlines-core is only a dev-dependency, for
//! that comparison.
//!
//! JSON is generated with fixed separators (`", "` and `": "`, as Python's
//! `json.dumps` writes them, the form models see most) and no other
//! whitespace: llguidance's default of any whitespace between tokens lets a
//! model that is unsure, or has random weights, emit blank lines without
//! end, the failure vLLM's `disable-any-whitespace` exists for. A schema
//! may choose otherwise with llguidance's own `"x-guidance"` key.

use std::sync::Arc;

use llguidance::api::TopLevelGrammar;
use llguidance::{JsonCompileOptions, ParserFactory};
use serde::{Deserialize, Serialize};
use toktrie::{ApproximateTokEnv, TokEnv, TokRxInfo, TokTrie};

pub use duplex_text::sampling::TokenMask;

/// What a client asked the output to be.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", content = "value", rename_all = "snake_case")]
pub enum ConstraintSpec {
    /// Any JSON object (`response_format: {"type": "json_object"}`).
    JsonObject,
    /// A value valid against this JSON schema.
    JsonSchema(serde_json::Value),
    /// Text of a Lark grammar (llguidance's dialect), e.g. for tool calls.
    Lark(String),
}

#[derive(Debug, thiserror::Error)]
pub enum GrammarError {
    /// The tokenizer cannot be made into the engine's vocabulary.
    #[error("cannot build the grammar engine's vocabulary: {0}")]
    Vocabulary(String),
    /// The client's constraint does not compile; the message names the
    /// problem and goes back to the client as is (HTTP 400).
    #[error("invalid output constraint: {0}")]
    Compile(String),
    /// A token the last mask did not allow was chosen.
    #[error("token {id} breaks the output constraint: {message}")]
    Rejected { id: u32, message: String },
    /// The engine failed while computing a mask (e.g. a grammar too
    /// ambiguous for its per-step limits).
    #[error("the output constraint failed: {0}")]
    Engine(String),
}

/// Builds [`Matcher`]s for one tokenizer. Made once per process (the
/// vocabulary trie takes a moment for a big vocabulary) and cloned freely.
#[derive(Clone)]
pub struct GrammarCompiler {
    factory: Arc<ParserFactory>,
    vocab_rows: usize,
}

impl std::fmt::Debug for GrammarCompiler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GrammarCompiler").field("vocab_rows", &self.vocab_rows).finish()
    }
}

impl GrammarCompiler {
    /// `vocab_rows` is the width of the model's logits row, which may be
    /// more than the tokenizer's vocabulary (padded embeddings): ids with
    /// no token are never allowed.
    pub fn new(tokenizer: &duplex_text::tokenizer::Tokenizer, vocab_rows: usize) -> Result<Self, GrammarError> {
        let end_id = u32::try_from(vocab_rows).map_err(|_| GrammarError::Vocabulary(format!("{vocab_rows} logits rows do not fit token ids")))?;
        if vocab_rows == 0 {
            return Err(GrammarError::Vocabulary("the logits row is empty".into()));
        }
        // One word per logits row (empty for padding: llguidance never
        // allows an empty token), special tokens behind llguidance's marker
        // byte so that they never count as text, and one more id past the
        // row: the grammar's own end of text. Which real ids may end the
        // output is the request's business (its stop tokens), so
        // `Matcher::fill_mask` maps this one end to them.
        let mut words: Vec<Vec<u8>> = (0..end_id)
            .map(|id| match tokenizer.token_bytes(id) {
                Some((text, true)) => [&[TokTrie::SPECIAL_TOKEN_MARKER][..], &text].concat(),
                Some((bytes, false)) => bytes,
                None => Vec::new(),
            })
            .collect();
        words.push(b"\xFF<|duplex_grammar_end|>".to_vec());
        let info = TokRxInfo::new(end_id + 1, end_id);
        let trie = TokTrie::from(&info, &words);
        // The engine tokenizes text only to force tokens and heal prompts,
        // which Duplex does not ask of it; greedy over the trie suffices.
        let env: TokEnv = Arc::new(ApproximateTokEnv::new(trie));
        let mut factory = ParserFactory::new_simple(&env).map_err(|e| GrammarError::Vocabulary(format!("{e:#}")))?;
        // Grammar warnings go to the caller as errors or not at all, never
        // to the worker's stderr.
        factory.quiet();
        Ok(Self { factory: Arc::new(factory), vocab_rows })
    }

    /// The logits row width the masks cover.
    pub fn vocab_rows(&self) -> usize {
        self.vocab_rows
    }

    /// Compiles `spec` into a fresh matcher, at the start of the output.
    /// The router calls this to validate a request before it is queued.
    pub fn compile(&self, spec: &ConstraintSpec) -> Result<Matcher, GrammarError> {
        let grammar = match spec {
            ConstraintSpec::JsonObject => TopLevelGrammar::from_json_schema(json_options(serde_json::json!({"type": "object"}))),
            ConstraintSpec::JsonSchema(schema) => {
                if !(schema.is_object() || schema.is_boolean()) {
                    return Err(GrammarError::Compile(format!("a JSON schema is an object or a boolean, not {schema}")));
                }
                TopLevelGrammar::from_json_schema(json_options(schema.clone()))
            }
            ConstraintSpec::Lark(text) => TopLevelGrammar::from_lark(text.clone()),
        };
        let parser = self.factory.create_parser(grammar).map_err(|e| GrammarError::Compile(format!("{e:#}")))?;
        let inner = Box::new(llguidance::Matcher::new(Ok(parser)));
        if let Some(e) = inner.get_error() {
            return Err(GrammarError::Compile(e));
        }
        Ok(Matcher { inner, vocab_rows: self.vocab_rows, stop_ids: Vec::new(), may_end: false, stopped_by_token: false })
    }
}

/// The separators and whitespace rule of the module comment, unless the
/// schema sets its own.
fn json_options(mut schema: serde_json::Value) -> serde_json::Value {
    if schema.get("x-guidance").is_none() {
        let options = JsonCompileOptions {
            item_separator: ", ".into(),
            key_separator: ": ".into(),
            whitespace_flexible: false,
            ..JsonCompileOptions::default()
        };
        match &mut schema {
            serde_json::Value::Object(_) => options.apply_to(&mut schema),
            // `true` / `false`: the schemas of anything and of nothing.
            serde_json::Value::Bool(true) => {
                schema = serde_json::json!({});
                options.apply_to(&mut schema);
            }
            _ => {}
        }
    }
    schema
}

/// One request's place in its constraint.
pub struct Matcher {
    /// Boxed: it is over a kilobyte, and matchers travel in messages.
    inner: Box<llguidance::Matcher>,
    vocab_rows: usize,
    /// The stop ids of the last [`Matcher::fill_mask`], and whether the
    /// grammar could end there: a stop id accepted then ends the output.
    stop_ids: Vec<u32>,
    may_end: bool,
    stopped_by_token: bool,
}

impl std::fmt::Debug for Matcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Matcher").field("vocab_rows", &self.vocab_rows).field("finished", &self.is_finished()).finish()
    }
}

impl Matcher {
    /// Sets `mask` (resized to the logits row if need be) to the ids that
    /// may come next. `stop_token_ids` (the request's EOS and stop ids) are
    /// allowed exactly where the output may end, and never elsewhere, even
    /// if their text would fit.
    pub fn fill_mask(&mut self, stop_token_ids: &[u32], mask: &mut TokenMask) -> Result<(), GrammarError> {
        if mask.len() != self.vocab_rows {
            *mask = TokenMask::new(self.vocab_rows);
        }
        self.stop_ids.clear();
        self.stop_ids.extend_from_slice(stop_token_ids);
        if self.stopped_by_token {
            mask.clear();
            self.may_end = true;
        } else {
            // A grammar that can take no more text gives only its end.
            let allowed = self.inner.compute_mask_or_eos().map_err(|e| GrammarError::Engine(format!("{e:#}")))?;
            let words = mask.words_mut();
            let n = words.len().min(allowed.as_slice().len());
            words[..n].copy_from_slice(&allowed.as_slice()[..n]);
            // The end id is one past the row: when the row is not a whole
            // number of words its bit lands past `len`, where it is ignored.
            self.may_end = allowed.is_allowed(self.vocab_rows as u32);
        }
        for &id in stop_token_ids {
            if self.may_end {
                mask.allow(id);
            } else {
                mask.forbid(id);
            }
        }
        Ok(())
    }

    /// Advances past the chosen token `id`, which the last mask allowed.
    pub fn accept(&mut self, id: u32) -> Result<(), GrammarError> {
        if self.stop_ids.contains(&id) && self.may_end {
            self.stopped_by_token = true;
            return Ok(());
        }
        if self.stopped_by_token || id as usize >= self.vocab_rows {
            return Err(GrammarError::Rejected { id, message: "the output is already complete".into() });
        }
        self.inner.consume_token(id).map_err(|e| GrammarError::Rejected { id, message: format!("{e:#}") })
    }

    /// The output is complete: a stop token ended it, or the grammar can
    /// take no more text (then only a stop token may follow, and the caller
    /// may end the sequence at once).
    pub fn is_finished(&self) -> bool {
        self.stopped_by_token || self.inner.is_stopped()
    }
}
