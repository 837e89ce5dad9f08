//! The access log (`api/access_log.rs`): one INFO line on target
//! `duplex_access` per request, with its public id, route, status, tokens
//! in and out, time to first token and duration. In a file of its own: the
//! lines are caught by a process-wide subscriber, which no other test's
//! requests may write to.

mod common;

use common::{start, MockConfig, TIMEOUT};
use serde_json::{json, Value};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tracing::field::{Field, Visit};
use tracing_subscriber::layer::{Context, SubscriberExt};
use tracing_subscriber::Layer;

/// One access log line: its fields by name, as text.
type Line = HashMap<String, String>;

/// Catches the access log's lines.
#[derive(Clone, Default)]
struct AccessLines(Arc<Mutex<Vec<Line>>>);

impl AccessLines {
    /// Installed as the process's subscriber: the router's tasks run on the
    /// test runtime's threads, which a thread-local one would miss.
    fn install() -> Self {
        let lines = AccessLines::default();
        tracing::subscriber::set_global_default(tracing_subscriber::registry().with(lines.clone())).expect("the only subscriber");
        lines
    }

    fn all(&self) -> Vec<Line> {
        self.0.lock().unwrap().clone()
    }

    /// The lines whose `id` is `id`, once there is one (a request is logged
    /// when it ends, which can be just after its response).
    async fn of(&self, id: &str) -> Vec<Line> {
        let wait = async {
            loop {
                let lines: Vec<Line> = self.all().into_iter().filter(|l| l["id"] == id).collect();
                if !lines.is_empty() {
                    return lines;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        };
        tokio::time::timeout(TIMEOUT, wait).await.unwrap_or_else(|_| panic!("no access log line with id {id:?} in {:#?}", self.all()))
    }
}

impl<S: tracing::Subscriber> Layer<S> for AccessLines {
    fn on_event(&self, event: &tracing::Event<'_>, _: Context<'_, S>) {
        if event.metadata().target() != "duplex_access" {
            return;
        }
        let mut line = Line::from([("level".to_string(), event.metadata().level().to_string())]);
        event.record(&mut FieldText(&mut line));
        self.0.lock().unwrap().push(line);
    }
}

struct FieldText<'a>(&'a mut Line);

impl Visit for FieldText<'_> {
    fn record_str(&mut self, field: &Field, value: &str) {
        self.0.insert(field.name().to_string(), value.to_string());
    }

    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        self.0.insert(field.name().to_string(), format!("{value:?}"));
    }
}

fn number(line: &Line, field: &str) -> f64 {
    line[field].parse().unwrap_or_else(|_| panic!("{field} is not a number: {line:?}"))
}

#[tokio::test]
async fn one_line_per_request_with_its_status_and_tokens() {
    let lines = AccessLines::install();
    let router = start(MockConfig::default(), |_| {}).await;

    // Completed: its public id (the response's without "cmpl-"), 200, its usage.
    let resp = router.post("/v1/completions", json!({"prompt": [5, 6, 7], "max_tokens": 4, "ignore_eos": true})).await;
    assert_eq!(resp.status(), 200);
    let v: Value = resp.json().await.unwrap();
    let id = v["id"].as_str().unwrap().strip_prefix("cmpl-").expect("a completion id");
    let completed = lines.of(id).await;
    assert_eq!(completed.len(), 1, "{completed:#?}");
    let line = &completed[0];
    assert_eq!((line["level"].as_str(), line["route"].as_str(), line["status"].as_str()), ("INFO", "/v1/completions", "200"), "{line:?}");
    assert_eq!((line["prompt_tokens"].as_str(), line["completion_tokens"].as_str()), ("3", "4"), "{line:?}");
    assert_eq!((&v["usage"]["prompt_tokens"], &v["usage"]["completion_tokens"]), (&json!(3), &json!(4)), "the response's usage");
    let (ttft, duration) = (number(line, "ttft_ms"), number(line, "duration_ms"));
    assert!(0.0 <= ttft && ttft <= duration, "{line:?}");

    // Refused before admission: no id yet, 400, no tokens, no first token.
    let resp = router.post("/v1/chat/completions", json!({"messages": [{"role": "user", "content": "hi"}], "n": 0})).await;
    assert_eq!(resp.status(), 400);
    let refused = lines.of("").await;
    assert_eq!(refused.len(), 1, "{refused:#?}");
    let line = &refused[0];
    assert_eq!((line["route"].as_str(), line["status"].as_str()), ("/v1/chat/completions", "400"), "{line:?}");
    assert_eq!((line["prompt_tokens"].as_str(), line["completion_tokens"].as_str(), line["ttft_ms"].as_str()), ("0", "0", "-"), "{line:?}");
    assert!(number(line, "duration_ms") >= 0.0, "{line:?}");

    // Nothing else: no second line for either (a request whose log was
    // dropped unfinished would add a 499).
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(lines.all().len(), 2, "{:#?}", lines.all());
}
