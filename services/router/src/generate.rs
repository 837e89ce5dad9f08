//! The core: one request through the workers, as a stream of events.
//!
//! Each request runs in its own task, which calls the workers and sends
//! events on a bounded channel; the receiving end is what a front door
//! streams to its client. When the client goes away the receiver is
//! dropped, the task sees `tx.closed()` and drops the run future, and with
//! it the worker stream (which cancels the request on the decode worker).
//! What the request still held (a prefill in flight, a KV lease not yet
//! admitted) is given back after the run, however it ended.

use crate::admission::{Admission, Permit};
use crate::config::RouterConfig;
use crate::error::Error;
use crate::policy::{self, DecodeTracker, PrefillPath, PrefillPolicy, Route};
use crate::request::{GenerationRequest, Prompt, RequestOptions, ServedModel};
use crate::workers::Workers;
use duplex_text::FinishReason;
use duplex_text::tokenizer::IncrementalDecoder;
use duplex_text::StopStrings;
use duplex_proto::worker::{self, DecodeEvent, DecodeRequest, PrefillRequest, PrefillRoute, Prefilled};
use duplex_telemetry as names;
use metrics::{counter, gauge, histogram};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::Streaming;
use tracing::Instrument;

/// Events of one request: tokens, then `Finished`; or an error, then nothing.
pub type EventStream = ReceiverStream<Result<Event, Error>>;

#[derive(Clone, Debug, PartialEq)]
pub enum Event {
    Token(Token),
    Finished(Finished),
}

#[derive(Clone, Debug, PartialEq)]
pub struct Token {
    pub id: u32,
    /// Text that became final with this token (may be empty).
    pub text: String,
    /// Set when the request asked for logprobs.
    pub logprob: Option<f32>,
    pub top_logprobs: Vec<TopLogprob>,
}

#[derive(Clone, Debug, PartialEq)]
pub struct TopLogprob {
    pub id: u32,
    pub logprob: f32,
    pub text: String,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Finished {
    pub reason: FinishReason,
    pub prompt_tokens: u32,
    pub completion_tokens: u32,
    pub timings: Timings,
    /// Text held back until the end that no token carried: empty, since the
    /// worker marks the last token and that token carries the rest.
    pub text: String,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Timings {
    /// In the router and the worker queues before any compute.
    pub queue: Duration,
    pub time_to_first_token: Duration,
    pub mean_time_per_output_token: Duration,
    pub total: Duration,
    pub path: PrefillPath,
}

/// Everything a request handler needs, shared by both front doors.
pub struct Router {
    pub model: ServedModel,
    pub workers: Arc<Workers>,
    admission: Admission,
    policy: PrefillPolicy,
    /// What is decoding, for the policy's idle window.
    decoding: DecodeTracker,
}

impl Router {
    pub fn new(model: ServedModel, workers: Workers, config: &RouterConfig) -> Self {
        Router {
            model,
            workers: Arc::new(workers),
            admission: Admission::new(config.max_pending_requests),
            policy: PrefillPolicy { chunked_prefill_max_tokens: config.prefill_threshold_tokens, dslp_idle_window: config.dslp_idle_window() },
            decoding: DecodeTracker::default(),
        }
    }

    pub fn prefill_threshold(&self) -> u32 {
        self.policy.chunked_prefill_max_tokens
    }

    /// Validates a request against the model and the workers' limits, and
    /// admits it if there is room.
    pub fn admit(&self, prompt: &Prompt, opts: RequestOptions) -> Result<(GenerationRequest, Permit), Error> {
        let readiness = self.workers.readiness();
        let admitted = readiness.limits().and_then(|limits| {
            let req = self.model.request(prompt, opts, &limits)?;
            // Short prompts need only the decode worker, so they are still
            // served while the prefill worker restarts.
            if policy::choose(req.prompt.len(), self.prefill_threshold()) == PrefillPath::Prefill {
                readiness.prefill_ready()?;
            }
            Ok((req, self.admission.try_admit()?))
        });
        match &admitted {
            Ok((req, _)) => counter!(names::PROMPT_TOKENS).increment(req.prompt.len() as u64),
            Err(e) => count_refused(e),
        }
        admitted
    }

    /// Starts an admitted request. Dropping the returned stream cancels it.
    /// Its task runs in a span naming both ids, so that every log line of
    /// the request (worker calls included) carries the id the workers log.
    pub fn generate(self: &Arc<Self>, req: GenerationRequest, permit: Permit) -> EventStream {
        let (tx, rx) = mpsc::channel(32);
        let router = Arc::clone(self);
        let span = tracing::info_span!("request", request_id = %req.id, public_id = %req.public_id);
        let task = async move {
            tracing::debug!(prompt_tokens = req.prompt.len(), max_tokens = req.max_tokens, "started");
            let mut held = Held::Nothing;
            let result = tokio::select! {
                result = router.run(&req, &tx, &mut held) => result,
                () = tx.closed() => Err(Abort::Cancelled),
            };
            router.give_back(&req.id, held).await;
            let outcome = match result {
                Ok(reason) => reason.as_str(),
                Err(Abort::Cancelled) => "cancelled",
                Err(Abort::Failed(e)) => {
                    tracing::warn!("request failed: {e}");
                    let outcome = e.outcome();
                    let _ = tx.send(Err(e)).await;
                    outcome
                }
            };
            tracing::debug!(outcome, "ended");
            counter!(names::REQUESTS, "outcome" => outcome).increment(1);
            drop(permit);
        };
        tokio::spawn(task.instrument(span));
        ReceiverStream::new(rx)
    }

    async fn run(&self, req: &GenerationRequest, tx: &mpsc::Sender<Result<Event, Error>>, held: &mut Held) -> Result<FinishReason, Abort> {
        let router_wait = req.arrival.elapsed();
        let prefill_has_dslp = self.workers.readiness().prefill_has_dslp();
        let (mut route, mut reason) = self.policy.route(req.prompt.len(), prefill_has_dslp, self.decoding.activity(Instant::now()));
        // A long prompt's KV lease, taken before its route is final, and
        // the wait for one given back (time queued all the same).
        let mut leased = None;
        let mut lease_given_back_after = Duration::ZERO;
        if route != Route::DecodeChunked {
            // Held from before the call: AllocateKv may succeed on the
            // worker after this request has given up waiting.
            *held = Held::Lease;
            // The lease holds the whole request (prompt plus max_tokens),
            // so once granted it can always run to its end; the decode
            // worker queues it until that much is free. It starts with the
            // prompt's cached prefix, which the prefill worker skips.
            let kv_wait = Instant::now();
            let lease = self.workers.allocate_kv(&req.id, &req.prompt, req.max_tokens).await?;
            let kv_wait = kv_wait.elapsed();
            match self.policy.reroute(req.prompt.len(), lease.cached_tokens as usize) {
                Some((chunked, why)) => {
                    // The decode worker finds the same cached blocks itself.
                    self.workers.free_kv(&req.id).await?;
                    *held = Held::Nothing;
                    (route, reason) = (chunked, why);
                    lease_given_back_after = kv_wait;
                }
                None => leased = Some((lease, kv_wait)),
            }
        }
        tracing::info!(route = route.as_str(), %reason, "prefill route");
        counter!(names::PREFILL_ROUTE, "route" => route.as_str()).increment(1);
        let path = route.path();
        let mut out = Output::new(&self.model, req, tx, path);
        // Held while the request is on the decode worker.
        let (stream, prefill_queue, _decoding) = match leased {
            None => {
                let decoding = self.decoding.begin();
                (self.workers.decode(decode_request(req, None)).await?, None, decoding)
            }
            Some((lease, kv_wait)) => {
                *held = Held::Prefilling;
                let prefill_req = PrefillRequest {
                    request_id: req.id.clone(),
                    prompt: req.prompt.clone(),
                    sampling: Some(req.worker_sampling()),
                    lease: Some(lease.clone()),
                    max_tokens: req.max_tokens,
                    stop_token_ids: req.stop_token_ids.clone(),
                    route: if route == Route::Dslp { PrefillRoute::Dslp } else { PrefillRoute::Slp }.into(),
                };
                let prefill = self.workers.prefill(prefill_req).await?;
                *held = Held::Lease;
                let first = prefill.first_token.ok_or_else(|| Error::Unavailable("prefill worker failed: its response has no first token".into()))?;
                let queue = router_wait + kv_wait + secs(prefill.queue_seconds);
                if let Some(reason) = out.token("prefill", first.clone()).await? {
                    // Done after one token: the lease is never admitted, and
                    // `give_back` frees it.
                    return out.finish(reason, queue).await;
                }
                let prefilled = Prefilled { lease: Some(lease), first_token: Some(first), prefill_seconds: prefill.prefill_seconds };
                let decoding = self.decoding.begin();
                let stream = self.workers.decode(decode_request(req, Some(prefilled))).await?;
                // Admitted: the lease is the decode worker's now.
                *held = Held::Nothing;
                (stream, Some(queue), decoding)
            }
        };
        let (reason, decode_queue) = out.follow(stream).await?;
        let queue = prefill_queue.unwrap_or(router_wait + lease_given_back_after + decode_queue);
        out.finish(reason, queue).await
    }

    /// Cancels a prefill in flight, then frees a lease not admitted to
    /// decode. In that order: the blocks must not be handed to another
    /// request while the prefill worker may still write into them. Both are
    /// keyed by request id, so calling them for a lease the worker never
    /// made (or already freed) is harmless.
    async fn give_back(&self, request_id: &str, held: Held) {
        if held == Held::Prefilling {
            if let Err(e) = self.workers.cancel_prefill(request_id).await {
                tracing::warn!("cannot cancel the prefill: {e}");
            }
        }
        if held != Held::Nothing {
            if let Err(e) = self.workers.free_kv(request_id).await {
                tracing::warn!("cannot free the KV lease: {e}");
            }
        }
    }
}

/// Counts a request refused before admission (the front doors call this
/// for what they reject themselves, `admit` for the rest).
pub fn count_refused(e: &Error) {
    counter!(names::REQUESTS, "outcome" => e.outcome()).increment(1);
}

/// What a request holds on the workers that it must give back if it ends
/// before the decode worker admits it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Held {
    Nothing,
    /// A KV lease (or an AllocateKv in flight).
    Lease,
    /// A lease the prefill worker is filling.
    Prefilling,
}

/// Why a run ended without finishing.
enum Abort {
    Cancelled,
    Failed(Error),
}

impl From<Error> for Abort {
    fn from(e: Error) -> Self {
        Abort::Failed(e)
    }
}

fn decode_request(req: &GenerationRequest, prefilled: Option<Prefilled>) -> DecodeRequest {
    DecodeRequest {
        request_id: req.id.clone(),
        prompt: req.prompt.clone(),
        sampling: Some(req.worker_sampling()),
        max_tokens: req.max_tokens,
        stop_token_ids: req.stop_token_ids.clone(),
        prefilled,
    }
}

fn secs(s: f64) -> Duration {
    Duration::try_from_secs_f64(s).unwrap_or_default()
}

/// The decode worker's next token, and its queue time (sent with the last).
async fn next_token(stream: &mut Streaming<DecodeEvent>) -> Result<(worker::SampledToken, Duration), Error> {
    match stream.message().await {
        Ok(Some(DecodeEvent { token: Some(token), queue_seconds })) => Ok((token, secs(queue_seconds))),
        Ok(Some(DecodeEvent { token: None, .. })) => Err(Error::Unavailable("decode worker failed: it sent an event without a token".into())),
        Ok(None) => Err(Error::Unavailable("decode worker failed: the token stream ended before its last token".into())),
        Err(status) => Err(Error::from_worker("decode", &status)),
    }
}

/// One request's output: detokenizing, stop strings, counts, timings and
/// the per-token metrics.
struct Output<'a> {
    model: &'a ServedModel,
    req: &'a GenerationRequest,
    tx: &'a mpsc::Sender<Result<Event, Error>>,
    path: PrefillPath,
    decoder: IncrementalDecoder,
    stops: StopStrings,
    /// The text is final: a stop string hit, or everything was flushed.
    text_done: bool,
    generated: u32,
    first_at: Option<Instant>,
    last_at: Option<Instant>,
    gauges: Gauges,
}

impl<'a> Output<'a> {
    fn new(model: &'a ServedModel, req: &'a GenerationRequest, tx: &'a mpsc::Sender<Result<Event, Error>>, path: PrefillPath) -> Self {
        Output {
            decoder: IncrementalDecoder::with_prompt(&model.tokenizer, &req.prompt).keeping(req.keep_special_tokens.clone()),
            stops: StopStrings::new(req.stop.clone()),
            model,
            req,
            tx,
            path,
            text_done: false,
            generated: 0,
            first_at: None,
            last_at: None,
            gauges: Gauges::waiting(),
        }
    }

    async fn send(&self, event: Event) -> Result<(), Abort> {
        self.tx.send(Ok(event)).await.map_err(|_| Abort::Cancelled)
    }

    /// Emits one sampled token (from `worker`, which sampled it). Returns
    /// the finish reason when this token ends the request: a stop string, or
    /// the worker marked it last (a stop token, `max_tokens`, the context).
    /// The last token carries all the text still held back.
    async fn token(&mut self, worker: &str, t: worker::SampledToken) -> Result<Option<FinishReason>, Abort> {
        let finish = t.finish().map_err(|e| Error::Unavailable(format!("{worker} worker failed: {e}")))?;
        let now = Instant::now();
        match self.last_at {
            None => {
                histogram!(names::TIME_TO_FIRST_TOKEN).record(now - self.req.arrival);
                self.first_at = Some(now);
                self.gauges.running();
            }
            Some(prev) => histogram!(names::TIME_PER_OUTPUT_TOKEN).record(now - prev),
        }
        self.last_at = Some(now);
        self.generated += 1;
        counter!(names::GENERATION_TOKENS).increment(1);

        let tok = &self.model.tokenizer;
        let (mut text, hit) = self.stops.push(&self.decoder.push(tok, t.id));
        let mut reason = if hit { Some(FinishReason::Stop) } else { finish };
        if hit {
            self.text_done = true;
        } else if reason.is_some() {
            let (tail, hit) = self.flush();
            text.push_str(&tail);
            if hit {
                reason = Some(FinishReason::Stop);
            }
        }
        let token = Token {
            id: t.id,
            text,
            logprob: self.req.logprobs.then_some(t.logprob),
            top_logprobs: t.top_logprobs.iter().map(|p| TopLogprob { id: p.id, logprob: p.logprob, text: tok.decode(&[p.id]) }).collect(),
        };
        self.send(Event::Token(token)).await?;
        Ok(reason)
    }

    /// The text held back by the detokenizer and the stop-string matcher,
    /// once no more tokens will come; and whether it completed a stop string.
    fn flush(&mut self) -> (String, bool) {
        if self.text_done {
            return (String::new(), false);
        }
        self.text_done = true;
        let (mut tail, hit) = self.stops.push(&self.decoder.finish(&self.model.tokenizer));
        if !hit {
            tail.push_str(&self.stops.finish());
        }
        (tail, hit)
    }

    /// Streams the decode worker's tokens until the request ends: the token
    /// it marks last, or a stop string (then dropping the stream cancels the
    /// request on the worker). Returns the finish reason and the worker's
    /// queue time, which comes with its last token (zero after a stop string).
    async fn follow(&mut self, mut stream: Streaming<DecodeEvent>) -> Result<(FinishReason, Duration), Abort> {
        loop {
            let (token, queue) = next_token(&mut stream).await?;
            if let Some(reason) = self.token("decode", token).await? {
                return Ok((reason, queue));
            }
        }
    }

    async fn finish(&mut self, reason: FinishReason, queue: Duration) -> Result<FinishReason, Abort> {
        let (text, _) = self.flush();
        let total = self.req.arrival.elapsed();
        let ttft = self.first_at.map_or(total, |t| t - self.req.arrival);
        let mean_tpot = match (self.first_at, self.last_at) {
            (Some(first), Some(last)) if self.generated > 1 => (last - first) / (self.generated - 1),
            _ => Duration::ZERO,
        };
        histogram!(names::E2E_REQUEST_LATENCY).record(total);
        histogram!(names::REQUEST_QUEUE_TIME).record(queue);
        histogram!(names::REQUEST_PREFILL_TIME, "path" => self.path.as_str()).record(ttft.saturating_sub(queue));
        let finished = Finished {
            reason,
            prompt_tokens: self.req.prompt.len() as u32,
            completion_tokens: self.generated,
            timings: Timings { queue, time_to_first_token: ttft, mean_time_per_output_token: mean_tpot, total, path: self.path },
            text,
        };
        self.send(Event::Finished(finished)).await?;
        Ok(reason)
    }
}

/// Keeps the waiting/running gauges right however a request ends: it is
/// waiting from admission to its first token, then running until dropped.
struct Gauges {
    running: bool,
}

impl Gauges {
    fn waiting() -> Self {
        gauge!(names::REQUESTS_WAITING).increment(1.0);
        Gauges { running: false }
    }

    fn running(&mut self) {
        if !self.running {
            gauge!(names::REQUESTS_WAITING).decrement(1.0);
            gauge!(names::REQUESTS_RUNNING).increment(1.0);
            self.running = true;
        }
    }
}

impl Drop for Gauges {
    fn drop(&mut self) {
        let name = if self.running { names::REQUESTS_RUNNING } else { names::REQUESTS_WAITING };
        gauge!(name).decrement(1.0);
    }
}
