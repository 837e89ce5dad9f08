//! The comparison behind duplex-grammar's choice of engine: llguidance (what
//! Duplex serves with, through `duplex_grammar`) against outlines-core, on
//! the tiny models' vocabulary and on a 129,280-token one (DeepSeek-V3's
//! size), for a few JSON schemas:
//!
//! - compile time: schema to a ready matcher (outlines-core builds its whole
//!   token index up front; llguidance works lazily);
//! - mask time per token: replaying one valid token sequence, the time to
//!   fill the [`TokenMask`] the sampler applies, min / median / max over
//!   every token of `RUNS` interleaved runs (llguidance, outlines-core,
//!   llguidance, ...);
//! - which schema features each honours: a feature is "yes" when the schema
//!   compiles and every sampled output validates against it (`jsonschema`),
//!   "ignored" when it compiles but some output does not validate, and
//!   "error" when it does not compile.
//!
//! The big vocabulary is synthetic (no model of that size ships with the
//! repository): the 256 byte tokens, every token of the three fixture
//! tokenizers, and concatenations of two of those up to 129,280 ids,
//! written as a byte-level BPE `tokenizer.json` and loaded like any model's.
//!
//! `cargo run -p duplex-grammar --release --example compare_engines`

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use duplex_grammar::{ConstraintSpec, GrammarCompiler, TokenMask};
use duplex_text::sampling::{Sampler, SamplingParams};
use duplex_text::tokenizer::Tokenizer;
use outlines_core::prelude::{Index, Vocabulary};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde_json::{json, Value};

const RUNS: usize = 5;
const BIG_VOCAB: usize = 129_280;
/// Longest replayed sequence.
const MAX_TOKENS: usize = 300;
/// Samples per engine per feature.
const FEATURE_SAMPLES: u64 = 5;

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures")
}

fn main() {
    let tiny = Tokenizer::from_dir(&fixtures().join("tiny-dsv3")).expect("fixture tokenizer");
    let big_dir = std::env::temp_dir().join("duplex-compare-engines-vocab");
    write_synthetic_vocab(&big_dir, BIG_VOCAB);
    let big = Tokenizer::from_dir(&big_dir).expect("synthetic tokenizer");
    assert_eq!(big.vocab_size(), BIG_VOCAB);

    println!("## Mask time per token (µs: min / median / max over {RUNS} interleaved runs), compile time (ms)\n");
    println!("| vocabulary | schema | tokens | llguidance mask | outlines-core mask | llguidance compile | outlines-core compile |");
    println!("|---|---|---|---|---|---|---|");
    for (vocab_name, tok) in [("tiny-dsv3 (2,048)", &tiny), ("synthetic 129,280", &big)] {
        let rows = tok.vocab_size();
        let started = Instant::now();
        let compiler = GrammarCompiler::new(tok, rows).unwrap();
        let llg_setup = started.elapsed();
        let started = Instant::now();
        let vocabulary = outlines_vocabulary(tok);
        let outlines_setup = started.elapsed();
        eprintln!("{vocab_name}: vocabulary set-up llguidance {:.1} ms, outlines-core {:.1} ms", ms(llg_setup), ms(outlines_setup));
        for (schema_name, schema) in bench_schemas() {
            let spec = ConstraintSpec::JsonSchema(schema.clone());
            let llg_compile = median((0..RUNS).map(|_| timed(|| compiler.compile(&spec).unwrap()).1).collect());
            let started = Instant::now();
            let index = outlines_index(&schema, &vocabulary).expect("outlines-core compiles the benchmark schemas");
            let outlines_compile = started.elapsed();

            // One valid sequence, cut where outlines-core's regex (which
            // differs from llguidance's grammar in small ways) stops
            // following it, so that both replay the same tokens.
            let mut ids = sample_llguidance(tok, &compiler, &spec, 7);
            let mut state = index.initial_state();
            let followed = ids.iter().take_while(|&&id| index.next_state(&state, &id).map(|s| state = s).is_some()).count();
            ids.truncate(followed);

            let (mut llg, mut outlines) = (Vec::new(), Vec::new());
            let mut mask = TokenMask::new(rows);
            let stops = tok.eos_token_ids().to_vec();
            for _ in 0..RUNS {
                let mut matcher = compiler.compile(&spec).unwrap();
                for &id in &ids {
                    let ((), t) = timed(|| matcher.fill_mask(&stops, &mut mask).unwrap());
                    llg.push(t);
                    matcher.accept(id).unwrap();
                }
                let mut state = index.initial_state();
                for &id in &ids {
                    let ((), t) = timed(|| outlines_mask(&index, state, &mut mask));
                    outlines.push(t);
                    state = index.next_state(&state, &id).unwrap();
                }
            }
            println!(
                "| {vocab_name} | {schema_name} | {} | {} | {} | {:.2} | {:.1} |",
                ids.len(),
                spread(&mut llg),
                spread(&mut outlines),
                ms(llg_compile),
                ms(outlines_compile)
            );
        }
    }

    println!("\n## Schema features (tiny-dsv3 vocabulary; yes = compiles and {FEATURE_SAMPLES} samples validate)\n");
    println!("| feature | llguidance | outlines-core |");
    println!("|---|---|---|");
    let compiler = GrammarCompiler::new(&tiny, tiny.vocab_size()).unwrap();
    let vocabulary = outlines_vocabulary(&tiny);
    for (feature, schema) in feature_schemas() {
        let validator = jsonschema::validator_for(&schema).expect("feature schemas are valid");
        let valid = |ids: &[u32]| serde_json::from_str::<Value>(&tiny.decode(ids)).is_ok_and(|v| validator.is_valid(&v));
        let spec = ConstraintSpec::JsonSchema(schema.clone());
        let llg = match compiler.compile(&spec) {
            Err(e) => format!("error: {}", first_line(&e.to_string())),
            Ok(_) => verdict((0..FEATURE_SAMPLES).all(|seed| valid(&sample_llguidance(&tiny, &compiler, &spec, seed)))),
        };
        let outlines = match outlines_index(&schema, &vocabulary) {
            Err(e) => format!("error: {}", first_line(&e)),
            Ok(index) => verdict((0..FEATURE_SAMPLES).all(|seed| sample_outlines(&index, seed).is_some_and(|ids| valid(&ids)))),
        };
        println!("| {feature} | {llg} | {outlines} |");
    }
}

fn verdict(all_valid: bool) -> String {
    if all_valid { "yes" } else { "ignored" }.to_string()
}

fn first_line(s: &str) -> String {
    s.lines().next().unwrap_or_default().chars().take(70).collect()
}

fn timed<T>(f: impl FnOnce() -> T) -> (T, Duration) {
    let started = Instant::now();
    let out = f();
    (out, started.elapsed())
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn spread(v: &mut [Duration]) -> String {
    if v.is_empty() {
        return "-".into();
    }
    v.sort();
    let us = |d: Duration| d.as_secs_f64() * 1e6;
    format!("{:.1} / {:.1} / {:.0}", us(v[0]), us(v[v.len() / 2]), us(v[v.len() - 1]))
}

/// outlines-core's vocabulary of `tok`: every non-special token's bytes
/// (the same bytes llguidance gets), less the EOS id, which it adds itself.
fn outlines_vocabulary(tok: &Tokenizer) -> Vocabulary {
    let eos = tok.eos_token_ids()[0];
    let mut vocabulary = Vocabulary::new(eos);
    for id in 0..tok.vocab_size() as u32 {
        if let Some((bytes, false)) = tok.token_bytes(id) {
            if id != eos && !bytes.is_empty() {
                vocabulary.try_insert(bytes, id).unwrap();
            }
        }
    }
    vocabulary
}

/// outlines-core's regex for `schema`, with the single optional space that
/// llguidance's `", "` / `": "` separators put where outlines-core allows
/// whitespace, then its index over the vocabulary.
fn outlines_index(schema: &Value, vocabulary: &Vocabulary) -> Result<Index, String> {
    let regex = outlines_core::json_schema::regex_from_value(schema, Some("[ ]?"), None).map_err(|e| e.to_string())?;
    Index::new(&regex, vocabulary).map_err(|e| e.to_string())
}

/// The mask outlines-core gives for `state`, in the sampler's form.
fn outlines_mask(index: &Index, state: u32, mask: &mut TokenMask) {
    mask.clear();
    if let Some(allowed) = index.allowed_tokens_iter(&state) {
        for &id in allowed {
            mask.allow(id);
        }
    }
}

/// A valid output under llguidance: random logits, temperature 1.
fn sample_llguidance(tok: &Tokenizer, compiler: &GrammarCompiler, spec: &ConstraintSpec, seed: u64) -> Vec<u32> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut sampler = Sampler::new(SamplingParams { seed: Some(seed), ..SamplingParams::default() }, &[]).unwrap();
    let mut matcher = compiler.compile(spec).unwrap();
    let stops = tok.eos_token_ids().to_vec();
    let mut mask = TokenMask::new(compiler.vocab_rows());
    let mut ids = Vec::new();
    while ids.len() < MAX_TOKENS && !matcher.is_finished() {
        matcher.fill_mask(&stops, &mut mask).unwrap();
        let logits: Vec<f32> = (0..compiler.vocab_rows()).map(|_| rng.gen_range(-2.0..2.0)).collect();
        let id = sampler.sample_with_mask(&logits, Some(&mask)).unwrap().id;
        matcher.accept(id).unwrap();
        if stops.contains(&id) {
            break;
        }
        ids.push(id);
    }
    ids
}

/// A uniform random walk over outlines-core's index that stops, in a final
/// state, with probability 1/3 or when nothing else is allowed; `None` if it
/// does not finish.
fn sample_outlines(index: &Index, seed: u64) -> Option<Vec<u32>> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut state = index.initial_state();
    let mut ids = Vec::new();
    for _ in 0..MAX_TOKENS {
        let allowed: Vec<u32> = index.allowed_tokens(&state).unwrap_or_default();
        let next: Vec<u32> = allowed.into_iter().filter(|id| index.next_state(&state, id).is_some()).collect();
        if index.is_final_state(&state) && (next.is_empty() || rng.gen_ratio(1, 3)) {
            return Some(ids);
        }
        let &id = next.get(rng.gen_range(0..next.len().max(1)))?;
        state = index.next_state(&state, &id)?;
        ids.push(id);
    }
    None
}

fn bench_schemas() -> Vec<(&'static str, Value)> {
    vec![
        ("flat object", json!({"type": "object", "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"}, "ok": {"type": "boolean"}}, "required": ["name", "age", "ok"], "additionalProperties": false})),
        (
            "nested + array + enum",
            json!({"type": "object", "properties": {
                "user": {"type": "object", "properties": {"id": {"type": "integer"}, "role": {"enum": ["admin", "user", "guest"]}}, "required": ["id", "role"], "additionalProperties": false},
                "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 5}
            }, "required": ["user", "tags"], "additionalProperties": false}),
        ),
        (
            "array of objects",
            json!({"type": "array", "items": {"type": "object", "properties": {"x": {"type": "number"}, "label": {"type": "string", "maxLength": 10}}, "required": ["x", "label"], "additionalProperties": false}, "maxItems": 4}),
        ),
        ("free-form strings", json!({"type": "object", "properties": {"title": {"type": "string"}, "body": {"type": "string"}}, "required": ["title", "body"], "additionalProperties": false})),
    ]
}

fn feature_schemas() -> Vec<(&'static str, Value)> {
    let obj = |props: Value, required: &[&str]| json!({"type": "object", "properties": props, "required": required, "additionalProperties": false});
    vec![
        ("required + additionalProperties: false", obj(json!({"a": {"type": "integer"}, "b": {"type": "boolean"}}), &["a", "b"])),
        ("enum", obj(json!({"c": {"enum": ["x", "y", 3]}}), &["c"])),
        ("integer minimum/maximum", obj(json!({"n": {"type": "integer", "minimum": 10, "maximum": 20}}), &["n"])),
        ("number exclusiveMinimum/Maximum", obj(json!({"f": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1}}), &["f"])),
        ("array minItems/maxItems", obj(json!({"l": {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 3}}), &["l"])),
        ("string minLength/maxLength", obj(json!({"s": {"type": "string", "minLength": 2, "maxLength": 4}}), &["s"])),
        ("string pattern", obj(json!({"s": {"type": "string", "pattern": "^[a-c]{2}[0-9]$"}}), &["s"])),
        ("format: date", obj(json!({"d": {"type": "string", "format": "date"}}), &["d"])),
        ("anyOf", obj(json!({"v": {"anyOf": [{"type": "integer"}, {"type": "boolean"}]}}), &["v"])),
        ("oneOf (disjoint)", obj(json!({"v": {"oneOf": [{"type": "integer"}, {"type": "string", "maxLength": 3}]}}), &["v"])),
        ("allOf", obj(json!({"v": {"allOf": [{"type": "integer", "minimum": 0}, {"maximum": 5}]}}), &["v"])),
        ("$ref to $defs", json!({"$defs": {"p": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"], "additionalProperties": false}}, "type": "object", "properties": {"a": {"$ref": "#/$defs/p"}}, "required": ["a"], "additionalProperties": false})),
        (
            "recursive $ref",
            json!({"$defs": {"node": {"type": "object", "properties": {"v": {"type": "integer"}, "next": {"anyOf": [{"$ref": "#/$defs/node"}, {"type": "null"}]}}, "required": ["v", "next"], "additionalProperties": false}}, "$ref": "#/$defs/node"}),
        ),
        ("additionalProperties: schema", json!({"type": "object", "additionalProperties": {"type": "integer"}})),
        ("minProperties/maxProperties", json!({"type": "object", "additionalProperties": {"type": "integer"}, "minProperties": 1, "maxProperties": 2})),
        ("uniqueItems", obj(json!({"l": {"type": "array", "items": {"enum": [1, 2, 3]}, "uniqueItems": true, "maxItems": 3}}), &["l"])),
        ("optional properties", obj(json!({"a": {"type": "integer"}, "b": {"type": "integer"}}), &[])),
        ("const", obj(json!({"k": {"const": "fixed"}}), &["k"])),
        ("type list [\"string\", \"null\"]", obj(json!({"v": {"type": ["string", "null"], "maxLength": 3}}), &["v"])),
    ]
}

/// GPT-2's byte alphabet: the character byte `b` is written as in a
/// byte-level `tokenizer.json`.
fn byte_char(b: u8) -> char {
    let printable = |b: u8| (0x21..=0x7E).contains(&b) || (0xA1..=0xAC).contains(&b) || (0xAE..=0xFF).contains(&b);
    if printable(b) {
        char::from(b)
    } else {
        let shifted = (0..b).filter(|&x| !printable(x)).count() as u32;
        char::from_u32(0x100 + shifted).unwrap()
    }
}

/// Writes the synthetic byte-level vocabulary of `size` ids (the last one
/// `<|end|>`, the EOS) as `tokenizer.json` and `tokenizer_config.json`.
fn write_synthetic_vocab(dir: &Path, size: usize) {
    let mut seen: HashSet<Vec<u8>> = HashSet::new();
    let mut tokens: Vec<Vec<u8>> = Vec::new();
    let mut add = |t: Vec<u8>, tokens: &mut Vec<Vec<u8>>| {
        if !t.is_empty() && seen.insert(t.clone()) {
            tokens.push(t);
        }
    };
    for b in 0..=255u8 {
        add(vec![b], &mut tokens);
    }
    let mut pieces = Vec::new();
    for name in ["tiny-dsv3", "tiny-qwen3moe", "tiny-mixtral"] {
        let tok = Tokenizer::from_dir(&fixtures().join(name)).unwrap();
        for id in 0..tok.vocab_size() as u32 {
            if let Some((bytes, false)) = tok.token_bytes(id) {
                pieces.push(bytes.clone());
                add(bytes, &mut tokens);
            }
        }
    }
    let mut rng = ChaCha8Rng::seed_from_u64(129_280);
    while tokens.len() < size - 1 {
        let a = &pieces[rng.gen_range(0..pieces.len())];
        let b = &pieces[rng.gen_range(0..pieces.len())];
        if a.len() + b.len() <= 16 {
            add([a.as_slice(), b.as_slice()].concat(), &mut tokens);
        }
    }
    let vocab: serde_json::Map<String, Value> = tokens.iter().enumerate().map(|(id, t)| (t.iter().map(|&b| byte_char(b)).collect::<String>(), json!(id))).collect();
    let byte_level = json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true});
    let tokenizer = json!({
        "version": "1.0",
        "added_tokens": [{"id": size - 1, "content": "<|end|>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true}],
        "normalizer": null,
        "pre_tokenizer": byte_level,
        "post_processor": null,
        "decoder": byte_level,
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null, "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "vocab": vocab, "merges": []}
    });
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(dir.join("tokenizer.json"), tokenizer.to_string()).unwrap();
    std::fs::write(dir.join("tokenizer_config.json"), json!({"eos_token": "<|end|>"}).to_string()).unwrap();
}
