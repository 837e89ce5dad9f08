//! Structured output in the batcher, on the bundled tiny model (random
//! weights): several constrained sequences decoding side by side, each
//! with its own schema, produce JSON valid for it, and an unconstrained
//! sequence beside them samples exactly what it samples alone (no mask
//! leaks from one sequence to another).

use duplex_decode::batcher::{Admission, Batcher, Command, Limits, SeqEvent};
use duplex_decode::engine::Engine;
use duplex_decode::kv_alloc::KvAllocator;
use duplex_grammar::{ConstraintSpec, GrammarCompiler};
use duplex_model::sampling::SamplingParams;
use duplex_model::tokenizer::{IncrementalDecoder, Tokenizer};
use duplex_model::{KvPool, Model, Precision};
use duplex_proto::stats::StatsCell;
use serde_json::{json, Value};
use std::path::Path;
use std::sync::mpsc::Sender;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

type Events = UnboundedReceiver<SeqEvent>;

fn start() -> (Sender<Command>, GrammarCompiler, Tokenizer) {
    let path = Path::new(duplex_model::BUNDLED_MODEL);
    let model = Model::load(path, &mut |_, _| {}).unwrap();
    let tokenizer = Tokenizer::from_model_path(path).unwrap();
    let grammar = GrammarCompiler::new(&tokenizer, model.cfg.vocab_size).unwrap();
    let pool = KvPool::new(256, 16, model.cfg.num_hidden_layers, model.cfg.kv_entry_dim());
    let limits = Limits { context_length: 1024, lease_timeout: Duration::from_secs(60), max_batch_size: 8, prefill_chunk_tokens: 64, max_waiting_requests: 8 };
    let batcher = Batcher::new(Engine::Cpu(model), KvAllocator::new(pool, 1), limits, Precision::F32, Arc::new(StatsCell::new(1024, "test".into())));
    let (commands, receiver) = std::sync::mpsc::channel();
    std::thread::spawn(move || batcher.run(receiver));
    (commands, grammar, tokenizer)
}

/// Admits a request of a `prompt_len`-token prompt; `constraint` compiled
/// as the worker's server does.
fn admit(commands: &Sender<Command>, grammar: &GrammarCompiler, tok: &Tokenizer, id: &str, prompt_len: usize, seed: u64, constraint: Option<&ConstraintSpec>) -> Events {
    let (events, receiver) = unbounded_channel();
    let admission = Admission {
        request_id: id.into(),
        prompt: (0..prompt_len as u32).map(|i| 100 + (i * 13 + seed as u32) % 1500).collect(),
        sampling: SamplingParams { temperature: 1.0, top_k: 200, seed: Some(seed), ..SamplingParams::default() },
        max_tokens: 300,
        stop_token_ids: tok.eos_token_ids().iter().copied().collect(),
        prefilled: None,
        constraint: constraint.map(|c| grammar.compile(c).unwrap()),
        events,
        arrived: Instant::now(),
    };
    commands.send(Command::Admit(Box::new(admission))).unwrap();
    receiver
}

/// Every token, then the finish reason.
fn drain(events: &mut Events) -> (Vec<u32>, String) {
    let mut tokens = vec![];
    loop {
        match events.blocking_recv().expect("the stream ends with its last token or an error") {
            SeqEvent::Token { token, finish } => {
                tokens.push(token.id);
                if let Some(f) = finish {
                    return (tokens, f.reason.as_str().to_string());
                }
            }
            SeqEvent::Failed(e) => panic!("stream failed after {tokens:?}: {e}"),
        }
    }
}

fn schemas() -> Vec<Value> {
    vec![
        json!({"type": "object", "properties": {"name": {"type": "string", "maxLength": 10}, "age": {"type": "integer", "minimum": 0, "maximum": 150}}, "required": ["name", "age"], "additionalProperties": false}),
        json!({"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 4}),
        json!({"type": "object", "properties": {"point": {"type": "object", "properties": {"x": {"type": "number", "minimum": -1, "maximum": 1}, "y": {"type": "boolean"}}, "required": ["x", "y"], "additionalProperties": false}}, "required": ["point"], "additionalProperties": false}),
    ]
}

#[test]
fn constrained_sequences_validate_and_leave_their_neighbours_alone() {
    let (commands, grammar, tok) = start();
    let mut alone = admit(&commands, &grammar, &tok, "free", 30, 99, None);
    let (free_alone, _) = drain(&mut alone);

    let specs: Vec<(Value, ConstraintSpec)> = schemas().into_iter().map(|s| (s.clone(), ConstraintSpec::JsonSchema(s))).collect();
    // Prompts of 20 to 100 tokens: the longer take two prefill chunks, and
    // only their last one samples.
    let mut constrained: Vec<Events> = specs.iter().enumerate().map(|(i, (_, spec))| admit(&commands, &grammar, &tok, &format!("c{i}"), 20 + 40 * i, i as u64, Some(spec))).collect();
    let call = ConstraintSpec::Lark("start: \"call \" NAME \"(\" NUMBER \")\"\nNAME: /[a-z]{1,8}/\nNUMBER: /[0-9]{1,4}/".into());
    let mut lark = admit(&commands, &grammar, &tok, "lark", 25, 7, Some(&call));
    let mut free = admit(&commands, &grammar, &tok, "free-again", 30, 99, None);

    for (i, ((schema, _), events)) in specs.iter().zip(&mut constrained).enumerate() {
        let (tokens, reason) = drain(events);
        assert_eq!(reason, "stop", "c{i}: {tokens:?}");
        // Whole, and as the router streams it.
        let ids: Vec<u32> = tokens.iter().copied().filter(|id| !tok.eos_token_ids().contains(id)).collect();
        let text = tok.decode(&ids);
        let mut stream = IncrementalDecoder::new();
        let mut streamed: String = ids.iter().map(|&id| stream.push(&tok, id)).collect();
        streamed += &stream.finish(&tok);
        assert_eq!(streamed, text);
        let value: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("c{i}: not JSON ({e}): {text:?}"));
        let validator = jsonschema::validator_for(schema).unwrap();
        assert!(validator.is_valid(&value), "c{i}: {text} does not validate against {schema}");
    }
    let (tokens, reason) = drain(&mut lark);
    assert_eq!(reason, "stop");
    let text = tok.decode(&tokens);
    let call = text.strip_prefix("call ").and_then(|t| t.strip_suffix(')')).and_then(|t| t.split_once('('));
    assert!(call.is_some_and(|(name, n)| name.bytes().all(|b| b.is_ascii_lowercase()) && n.bytes().all(|b| b.is_ascii_digit())), "lark: {text:?}");

    let (free_beside, _) = drain(&mut free);
    assert_eq!(free_beside, free_alone, "the unconstrained sequence changed beside constrained ones");
    // And it is not constrained itself: random weights do not write JSON.
    assert!(serde_json::from_str::<Value>(&tok.decode(&free_beside)).is_err());
}
