//! One INFO line per request, as web servers write them: who (the public
//! id), which route, the status, tokens in and out, time to first token
//! and duration. Written when the request ends, however it ends: a client
//! that goes away mid-stream is logged as status 499 (nginx's "client
//! closed request") when the response is dropped.

use super::openai_response::Usage;
use crate::generate::Finished;
use std::time::Instant;

/// Target of the access log lines, so they can be filtered on their own
/// (`RUST_LOG=duplex_access=info`).
const TARGET: &str = "duplex_access";

/// Status logged for a request whose client went away before its end.
const CLIENT_CLOSED: &str = "499";

pub struct AccessLog {
    route: String,
    started: Instant,
    id: String,
    done: bool,
}

impl AccessLog {
    pub fn new(route: impl Into<String>) -> Self {
        AccessLog { route: route.into(), started: Instant::now(), id: String::new(), done: false }
    }

    /// The request's public id, once it has one (it is admitted).
    pub fn id(&mut self, id: &str) {
        self.id = id.to_string();
    }

    /// Drops this log without a line: another one logs the request.
    pub fn forget(mut self) {
        self.done = true;
    }

    /// Logs the end of the request: `status` as its front door names it (an
    /// HTTP status, a gRPC code), the usage and the first choice's timings
    /// when it generated.
    pub fn finish(&mut self, status: impl std::fmt::Display, generated: Option<(Usage, Option<&Finished>)>) {
        if std::mem::replace(&mut self.done, true) {
            return;
        }
        let (usage, ttft) = match generated {
            Some((usage, finished)) => (usage, finished.map(|f| f.timings.time_to_first_token.as_secs_f64() * 1e3)),
            None => (Usage::default(), None),
        };
        tracing::info!(
            target: TARGET,
            id = %self.id,
            route = %self.route,
            %status,
            prompt_tokens = usage.prompt_tokens,
            completion_tokens = usage.completion_tokens,
            ttft_ms = ttft.map(|t| format!("{t:.1}")).unwrap_or_else(|| "-".into()),
            duration_ms = format!("{:.1}", self.started.elapsed().as_secs_f64() * 1e3),
            "request"
        );
    }
}

impl Drop for AccessLog {
    fn drop(&mut self) {
        self.finish(CLIENT_CLOSED, None);
    }
}
