//! Structured output end to end: `duplex serve` with the bundled tiny model
//! (random weights: unconstrained, it writes gibberish), asked through the
//! OpenAI API and gRPC for JSON valid against a schema. Every answer must
//! parse and validate, streamed or not, on the decode worker's path and on
//! the prefill worker's (which samples the first token), and a schema the
//! engine cannot compile is a 400 that names the problem.

use duplex_tests::{runtime, serial, v1, within, Options, Server};
use serde_json::{json, Value};

/// Schemas with what clients use: nested objects, arrays with bounds,
/// enums, bounded numbers, required fields.
fn schemas() -> Vec<Value> {
    vec![
        json!({"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0, "maximum": 120}}, "required": ["name", "age"], "additionalProperties": false}),
        json!({"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]}, "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "minItems": 1, "maxItems": 3}}, "required": ["colour", "tags"], "additionalProperties": false}),
        json!({"type": "object", "properties": {"point": {"type": "object", "properties": {"x": {"type": "number", "minimum": -1, "maximum": 1}, "y": {"type": "number", "minimum": -1, "maximum": 1}}, "required": ["x", "y"], "additionalProperties": false}, "ok": {"type": "boolean"}}, "required": ["point", "ok"], "additionalProperties": false}),
        json!({"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 9}, "minItems": 2, "maxItems": 4}),
    ]
}

fn check(schema: &Value, text: &str, what: &str) {
    let value: Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("{what}: not JSON ({e}): {text:?}"));
    let validator = jsonschema::validator_for(schema).unwrap();
    let errors: Vec<String> = validator.iter_errors(&value).map(|e| e.to_string()).collect();
    assert!(errors.is_empty(), "{what}: {text} breaks {schema}: {errors:?}");
}

async fn post(server: &Server, path: &str, body: Value) -> (u16, String) {
    let resp = reqwest::Client::new().post(format!("{}{path}", server.http)).json(&body).send().await.unwrap();
    (resp.status().as_u16(), resp.text().await.unwrap())
}

fn streamed_text(sse: &str, field: impl Fn(&Value) -> Option<String>) -> String {
    sse.lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str::<Value>(d).unwrap())
        .filter_map(|c| c["choices"].get(0).and_then(&field))
        .collect()
}

#[test]
fn json_schemas_hold_streamed_or_not_on_both_paths() {
    let _serial = serial();
    // Prompts of 64 tokens and more go to the prefill worker.
    let server = Server::start(Options { prefill_threshold_tokens: 64, ..Options::default() });
    runtime().block_on(async {
        let long_prompt = "Describe it as JSON, please. ".repeat(20);
        for (i, schema) in schemas().into_iter().enumerate() {
            for (path, prompt) in [("decode", "Describe it as JSON."), ("prefill", long_prompt.as_str())] {
                let format = json!({"type": "json_schema", "json_schema": {"name": "thing", "schema": schema, "strict": true}});
                // Sampled, with a seed per case: the mask must hold for any draw.
                let chat = json!({"messages": [{"role": "user", "content": prompt}], "response_format": format, "max_tokens": 200, "temperature": 1.0, "seed": i});
                let (status, body) = within(120, "chat", post(&server, "/v1/chat/completions", chat.clone())).await;
                assert_eq!(status, 200, "{body}");
                let v: Value = serde_json::from_str(&body).unwrap();
                assert_eq!(v["choices"][0]["finish_reason"], "stop", "{path}, schema {i}: the grammar ended the output: {v}");
                check(&schema, v["choices"][0]["message"]["content"].as_str().unwrap(), &format!("{path} chat, schema {i}"));

                let mut streamed = chat;
                streamed["stream"] = json!(true);
                streamed["seed"] = json!(100 + i);
                let (status, sse) = within(120, "chat stream", post(&server, "/v1/chat/completions", streamed)).await;
                assert_eq!(status, 200, "{sse}");
                let text = streamed_text(&sse, |c| c["delta"]["content"].as_str().map(String::from));
                check(&schema, &text, &format!("{path} streamed chat, schema {i}"));

                let completion = json!({"prompt": prompt, "response_format": format, "max_tokens": 200, "temperature": 0.8, "seed": 200 + i, "stream": true});
                let (status, sse) = within(120, "completion stream", post(&server, "/v1/completions", completion)).await;
                assert_eq!(status, 200, "{sse}");
                check(&schema, &streamed_text(&sse, |c| c["text"].as_str().map(String::from)), &format!("{path} streamed completion, schema {i}"));
            }
        }

        // json_object: any object. Its strings are unbounded, so a draw may
        // run out of tokens mid-string: every output starts an object, and
        // every one that ends is a whole object.
        let mut ended = 0;
        for seed in 0..4 {
            let body = json!({"messages": [{"role": "user", "content": "JSON!"}], "response_format": {"type": "json_object"}, "max_tokens": 300, "temperature": 0.7, "seed": seed});
            let (status, body) = post(&server, "/v1/chat/completions", body).await;
            assert_eq!(status, 200, "{body}");
            let v: Value = serde_json::from_str(&body).unwrap();
            let text = v["choices"][0]["message"]["content"].as_str().unwrap();
            assert!(text.starts_with('{'), "{text}");
            if v["choices"][0]["finish_reason"] == "stop" {
                // Syntax only: random weights write numbers (`6.1E1885`)
                // that a `Value` cannot hold but JSON allows.
                serde_json::from_str::<serde::de::IgnoredAny>(text).unwrap_or_else(|e| panic!("{e}: {text}"));
                ended += 1;
            }
        }
        assert!(ended > 0, "no json_object output ended within 300 tokens");

        // gRPC: the same field.
        let schema = &schemas()[1];
        let mut client = server.grpc_client().await;
        let request = v1::GenerateRequest {
            prompt: Some(v1::generate_request::Prompt::Text("JSON:".into())),
            sampling: Some(v1::SamplingParameters { temperature: Some(1.0), seed: Some(9), ..Default::default() }),
            stopping: Some(v1::StoppingCriteria { max_tokens: 200, ..Default::default() }),
            response_format: Some(v1::ResponseFormat { format: Some(v1::response_format::Format::JsonSchema(schema.to_string())) }),
            ..Default::default()
        };
        let (_, text, finished) = within(120, "grpc", duplex_tests::collect(&mut client, request)).await.unwrap();
        assert_eq!(finished.finish_reason, "stop");
        check(schema, &text, "gRPC");

        // A schema the engine cannot compile: a 400 naming the field and the problem.
        let bad = json!({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frobnicate"}}}});
        let (status, body) = post(&server, "/v1/chat/completions", bad).await;
        assert_eq!(status, 400, "{body}");
        let v: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(v["error"]["param"], "response_format", "{v}");
        assert!(v["error"]["message"].as_str().unwrap().contains("frobnicate"), "{v}");
    });
}
