//! Constrained sampling end to end on the fixture tokenizers: random logits,
//! random sampling settings, the mask applied, until the grammar ends; the
//! text (decoded whole, and streamed) must parse and validate against the
//! schema with an independent validator (`jsonschema`).

use std::path::PathBuf;

use duplex_grammar::{ConstraintSpec, GrammarCompiler, GrammarError, TokenMask};
use duplex_text::sampling::{Sampler, SamplingParams};
use duplex_text::tokenizer::{IncrementalDecoder, Tokenizer};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde_json::{json, Value};

/// Rows past the tokenizer's vocabulary, as the fixtures' padded
/// embeddings have (2112 rows for 2048 tokens).
const PADDING: usize = 64;
/// No schema below needs this many tokens; reaching it is a failure.
const MAX_TOKENS: usize = 3000;

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures")
}

/// Every fixture tokenizer: three `tokenizer.json` kinds (byte-level BPE
/// with and without a prefix space, SentencePiece with byte fallback) and
/// the same three as GGUF metadata builds them.
fn tokenizers() -> Vec<(String, Tokenizer)> {
    let mut all = Vec::new();
    for name in ["tiny-dsv3", "tiny-qwen3moe", "tiny-mixtral"] {
        all.push((name.to_string(), Tokenizer::from_dir(&fixtures().join(name)).unwrap()));
        let gguf = duplex_gguf::Gguf::open(&fixtures().join(format!("{name}-q4km/model-Q4_K_M.gguf"))).unwrap();
        all.push((format!("{name} (GGUF)"), Tokenizer::from_gguf(&gguf).unwrap()));
    }
    all
}

fn schemas() -> Vec<(&'static str, Value)> {
    vec![
        (
            "nested objects, required fields",
            json!({
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 12},
                    "address": {
                        "type": "object",
                        "properties": {
                            "city": {"type": "string", "maxLength": 10},
                            "zip": {"type": "integer", "minimum": 10000, "maximum": 99999}
                        },
                        "required": ["city", "zip"],
                        "additionalProperties": false
                    },
                    "active": {"type": "boolean"}
                },
                "required": ["name", "address"],
                "additionalProperties": false
            }),
        ),
        (
            "arrays with minItems/maxItems",
            json!({
                "type": "object",
                "properties": {
                    "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "minItems": 2, "maxItems": 4},
                    "matrix": {"type": "array", "items": {"type": "array", "items": {"type": "integer"}, "maxItems": 3}, "minItems": 1, "maxItems": 2}
                },
                "required": ["tags", "matrix"],
                "additionalProperties": false
            }),
        ),
        (
            "enums and consts",
            json!({
                "type": "object",
                "properties": {
                    "color": {"enum": ["red", "green", "blue"]},
                    "size": {"enum": [1, 2, 3, "XL", null]},
                    "kind": {"const": "shirt"}
                },
                "required": ["color", "size", "kind"],
                "additionalProperties": false
            }),
        ),
        (
            "numbers with bounds",
            json!({
                "type": "object",
                "properties": {
                    "age": {"type": "integer", "minimum": 0, "maximum": 120},
                    "score": {"type": "number", "minimum": -1.5, "maximum": 2.5},
                    "ratio": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1},
                    "count": {"type": "integer", "minimum": 3}
                },
                "required": ["age", "score", "ratio", "count"],
                "additionalProperties": false
            }),
        ),
        (
            "strings with a pattern and lengths",
            json!({
                "type": "object",
                "properties": {
                    "id": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
                    "note": {"type": "string", "minLength": 2, "maxLength": 8}
                },
                "required": ["id", "note"],
                "additionalProperties": false
            }),
        ),
        (
            "a top-level array of objects",
            json!({
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {"x": {"type": "integer"}, "y": {"type": "boolean"}},
                    "required": ["x"],
                    "additionalProperties": false
                },
                "minItems": 1,
                "maxItems": 3
            }),
        ),
    ]
}

/// What one constrained generation produced.
struct Output {
    ids: Vec<u32>,
    /// Ended by a stop token (or a grammar that can take no more).
    finished: bool,
    /// The text as a stream would show it: every push, then the flush.
    streamed: String,
}

/// Samples under `spec` from random logits with random settings (seeded)
/// until a stop token or the grammar ends it. `ignore_mask_from`: from
/// that step on, sample as if there were no constraint (to show that the
/// checks below catch broken output).
fn generate(tok: &Tokenizer, compiler: &GrammarCompiler, spec: &ConstraintSpec, seed: u64, ignore_mask_from: Option<usize>) -> Output {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let params = SamplingParams {
        temperature: if rng.gen_bool(0.2) { 0.0 } else { rng.gen_range(0.3..1.5) },
        top_k: if rng.gen_bool(0.3) { rng.gen_range(1..50) } else { 0 },
        top_p: if rng.gen_bool(0.3) { rng.gen_range(0.5..1.0) } else { 1.0 },
        min_p: if rng.gen_bool(0.2) { rng.gen_range(0.0..0.2) } else { 0.0 },
        repetition_penalty: if rng.gen_bool(0.3) { rng.gen_range(1.0..1.5) } else { 1.0 },
        frequency_penalty: if rng.gen_bool(0.2) { rng.gen_range(0.0..1.0) } else { 0.0 },
        seed: Some(seed),
        logprobs: Some(2),
        ..SamplingParams::default()
    };
    let mut sampler = Sampler::new(params, &[]).unwrap();
    let mut matcher = compiler.compile(spec).unwrap();
    let stops = tok.eos_token_ids().to_vec();
    assert!(!stops.is_empty());
    let rows = compiler.vocab_rows();
    let mut mask = TokenMask::new(rows);
    let mut decoder = IncrementalDecoder::new();
    let mut out = Output { ids: Vec::new(), finished: false, streamed: String::new() };
    let scale = rng.gen_range(1.0..4.0);
    for step in 0..MAX_TOKENS {
        let logits: Vec<f32> = (0..rows).map(|_| rng.gen_range(-scale..scale)).collect();
        let constrained = ignore_mask_from.is_none_or(|k| step < k);
        if constrained {
            matcher.fill_mask(&stops, &mut mask).unwrap();
        }
        let token = sampler.sample_with_mask(&logits, constrained.then_some(&mask)).unwrap();
        if constrained {
            assert!(mask.allows(token.id));
            assert!((token.id as usize) < tok.vocab_size(), "padding id {} allowed", token.id);
            matcher.accept(token.id).unwrap();
        }
        if stops.contains(&token.id) {
            out.finished = true;
            break;
        }
        out.ids.push(token.id);
        out.streamed += &decoder.push(tok, token.id);
        if constrained && matcher.is_finished() {
            out.finished = true;
            break;
        }
    }
    out.streamed += &decoder.finish(tok);
    out
}

/// Parses `text` as JSON and checks it against `schema`.
fn check(schema: &Value, text: &str) -> Result<Value, String> {
    let value: Value = serde_json::from_str(text).map_err(|e| format!("not JSON ({e}): {text:?}"))?;
    let validator = jsonschema::validator_for(schema).map_err(|e| format!("bad test schema: {e}"))?;
    let errors: Vec<String> = validator.iter_errors(&value).map(|e| e.to_string()).collect();
    if errors.is_empty() {
        Ok(value)
    } else {
        Err(format!("{text} does not validate: {}", errors.join("; ")))
    }
}

const SEEDS: u64 = 6;

#[test]
fn sampled_output_validates_against_its_schema_on_every_fixture_tokenizer() {
    for (name, tok) in tokenizers() {
        let compiler = GrammarCompiler::new(&tok, tok.vocab_size() + PADDING).unwrap();
        for (what, schema) in schemas() {
            let spec = ConstraintSpec::JsonSchema(schema.clone());
            for seed in 0..SEEDS {
                let out = generate(&tok, &compiler, &spec, seed, None);
                assert!(out.finished, "{name}, {what}, seed {seed}: not finished after {MAX_TOKENS} tokens: {:?}", tok.decode(&out.ids));
                let whole = tok.decode(&out.ids);
                if let Err(e) = check(&schema, &whole) {
                    panic!("{name}, {what}, seed {seed}: {e}");
                }
                assert_eq!(out.streamed, whole, "{name}, {what}, seed {seed}: the stream differs from the whole");
            }
        }
    }
}

#[test]
fn json_object_gives_an_object() {
    for (name, tok) in tokenizers() {
        let compiler = GrammarCompiler::new(&tok, tok.vocab_size() + PADDING).unwrap();
        for seed in 0..SEEDS {
            let out = generate(&tok, &compiler, &ConstraintSpec::JsonObject, seed, None);
            assert!(out.finished, "{name}, seed {seed}: not finished: {:?}", tok.decode(&out.ids));
            // JSON allows numbers like 6.1E1885, which random weights write
            // and `serde_json::Value` cannot hold: check the syntax with
            // `IgnoredAny`, which scans numbers without converting them.
            let text = tok.decode(&out.ids);
            if let Err(e) = serde_json::from_str::<serde::de::IgnoredAny>(&text) {
                panic!("{name}, seed {seed}: not JSON ({e}): {text:?}");
            }
            assert!(text.starts_with('{'), "{name}, seed {seed}: not an object: {text:?}");
        }
    }
}

#[test]
fn ignoring_the_mask_is_caught() {
    // The checks above can fail: the same generation with the mask dropped
    // after a few tokens gives output that does not validate.
    let (name, tok) = tokenizers().remove(0);
    let compiler = GrammarCompiler::new(&tok, tok.vocab_size() + PADDING).unwrap();
    for (what, schema) in schemas() {
        let spec = ConstraintSpec::JsonSchema(schema.clone());
        let failures = (0..SEEDS)
            .filter(|&seed| {
                let out = generate(&tok, &compiler, &spec, seed, Some(3));
                check(&schema, &tok.decode(&out.ids)).is_err()
            })
            .count();
        assert!(failures as u64 >= SEEDS - 1, "{name}, {what}: only {failures} of {SEEDS} unconstrained outputs failed");
    }
}

#[test]
fn stop_tokens_only_where_the_output_may_end_and_padding_never() {
    let tok = Tokenizer::from_dir(&fixtures().join("tiny-qwen3moe")).unwrap();
    let rows = tok.vocab_size() + PADDING;
    let compiler = GrammarCompiler::new(&tok, rows).unwrap();
    let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": false});
    let mut m = compiler.compile(&ConstraintSpec::JsonSchema(schema)).unwrap();
    let stops = tok.eos_token_ids().to_vec();
    let mut mask = TokenMask::new(0);
    m.fill_mask(&stops, &mut mask).unwrap();
    assert_eq!(mask.len(), rows, "the mask is sized to the logits row");
    assert!(stops.iter().all(|&s| !mask.allows(s)), "stop allowed before any output");
    assert!((tok.vocab_size()..rows).all(|id| !mask.allows(id as u32)), "padding allowed");
    // Every special token is a control marker, never text.
    for id in 0..tok.vocab_size() as u32 {
        if let Some((_, true)) = tok.token_bytes(id) {
            assert!(!mask.allows(id), "special token {id} allowed as text");
        }
    }
    for id in tok.encode_raw("{\"a\": 42}").unwrap() {
        assert!(!m.is_finished());
        m.fill_mask(&stops, &mut mask).unwrap();
        assert!(mask.allows(id), "token {id} of the valid text forbidden");
        m.accept(id).unwrap();
    }
    m.fill_mask(&stops, &mut mask).unwrap();
    assert!(stops.iter().all(|&s| mask.allows(s)), "stop forbidden after a complete object");
    assert_eq!(mask.count_allowed(), stops.len(), "only a stop token may follow");
    assert!(m.is_finished(), "nothing can follow the object");
    m.accept(stops[0]).unwrap();
    assert!(m.is_finished());
}

#[test]
fn a_token_the_mask_forbids_is_rejected() {
    let tok = Tokenizer::from_dir(&fixtures().join("tiny-dsv3")).unwrap();
    let compiler = GrammarCompiler::new(&tok, tok.vocab_size()).unwrap();
    let mut m = compiler.compile(&ConstraintSpec::JsonObject).unwrap();
    let bad = tok.encode_raw("x").unwrap()[0];
    let e = m.accept(bad).unwrap_err();
    assert!(matches!(e, GrammarError::Rejected { id, .. } if id == bad), "{e}");
    // A stop token where the output cannot end is no exception.
    let mut m = compiler.compile(&ConstraintSpec::JsonObject).unwrap();
    let mut mask = TokenMask::new(0);
    m.fill_mask(tok.eos_token_ids(), &mut mask).unwrap();
    assert!(m.accept(tok.eos_token_ids()[0]).is_err());
}

#[test]
fn lark_grammars_constrain_too() {
    let tok = Tokenizer::from_dir(&fixtures().join("tiny-mixtral")).unwrap();
    let compiler = GrammarCompiler::new(&tok, tok.vocab_size() + PADDING).unwrap();
    let spec = ConstraintSpec::Lark(r#"start: "call " NAME "(" NUMBER ")"
NAME: /[a-z]{1,8}/
NUMBER: /[0-9]{1,4}/"#.into());
    for seed in 0..SEEDS {
        let out = generate(&tok, &compiler, &spec, seed, None);
        let text = tok.decode(&out.ids);
        assert!(out.finished, "seed {seed}: {text:?}");
        let rest = text.strip_prefix("call ").unwrap_or_else(|| panic!("{text:?}"));
        let (name, number) = rest.strip_suffix(')').and_then(|r| r.split_once('(')).unwrap_or_else(|| panic!("{text:?}"));
        assert!((1..=8).contains(&name.len()) && name.bytes().all(|b| b.is_ascii_lowercase()), "{text:?}");
        assert!((1..=4).contains(&number.len()) && number.bytes().all(|b| b.is_ascii_digit()), "{text:?}");
    }
}

#[test]
fn uncompilable_constraints_name_the_problem() {
    let tok = Tokenizer::from_dir(&fixtures().join("tiny-dsv3")).unwrap();
    let compiler = GrammarCompiler::new(&tok, tok.vocab_size()).unwrap();
    let cases = [
        (ConstraintSpec::JsonSchema(json!({"type": "frobnicate"})), "frobnicate"),
        (ConstraintSpec::JsonSchema(json!({"$ref": "#/$defs/missing"})), "missing"),
        (ConstraintSpec::JsonSchema(json!({"type": "integer", "minimum": 5, "maximum": 1})), "minimum"),
        (ConstraintSpec::JsonSchema(json!(42)), "42"),
        (ConstraintSpec::Lark("start: (".into()), "start"),
    ];
    for (spec, word) in cases {
        match compiler.compile(&spec) {
            Err(e @ GrammarError::Compile(_)) => {
                let message = e.to_string();
                assert!(message.to_lowercase().contains(word), "{spec:?}: {message:?} does not name {word:?}");
            }
            Err(e) => panic!("{spec:?}: wrong kind of error: {e}"),
            Ok(_) => panic!("{spec:?} compiled"),
        }
    }
}

#[test]
fn constraint_specs_serialize() {
    for spec in [ConstraintSpec::JsonObject, ConstraintSpec::JsonSchema(json!({"type": "string"})), ConstraintSpec::Lark("start: \"a\"".into())] {
        let text = serde_json::to_string(&spec).unwrap();
        assert_eq!(serde_json::from_str::<ConstraintSpec>(&text).unwrap(), spec, "{text}");
    }
}
