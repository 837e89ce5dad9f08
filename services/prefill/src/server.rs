//! The `PrefillWorker` gRPC service: checks each message, queues it for the
//! engine thread and relays the answer. The only place where the worker
//! protocol's messages and `tonic::Status` meet the engine's types.

use crate::engine::{Command, FirstToken, Job, Lease, PrefillError};
use duplex_grammar::{ConstraintSpec, GrammarCompiler};
use duplex_proto::worker::prefill_worker_server::PrefillWorker;
use duplex_proto::worker::{CancelRequest, CancelResponse, PrefillRequest, PrefillResponse, PrefillRoute, SampledToken, StatsRequest, WorkerStats};
use duplex_proto::stats::StatsCell;
use std::sync::mpsc::Sender;
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::oneshot;
use tonic::{Request, Response, Status};
use tracing::Instrument;

pub struct PrefillService {
    commands: Sender<Command>,
    stats: Arc<StatsCell>,
    /// Compiles structured-output constraints; `None` without a tokenizer.
    grammar: Option<GrammarCompiler>,
}

impl PrefillService {
    pub fn new(commands: Sender<Command>, stats: Arc<StatsCell>) -> Self {
        PrefillService { commands, stats, grammar: None }
    }

    /// Accept constrained requests, compiled with `grammar`.
    pub fn with_grammar(self, grammar: Option<GrammarCompiler>) -> Self {
        PrefillService { grammar, ..self }
    }

    async fn ask<T>(&self, make: impl FnOnce(oneshot::Sender<T>) -> Command) -> Result<T, Status> {
        let (reply, answer) = oneshot::channel();
        self.commands.send(make(reply)).map_err(|_| Status::unavailable("the prefill engine has stopped"))?;
        answer.await.map_err(|_| Status::unavailable("the prefill engine has stopped"))
    }
}

/// The engine's answer in the protocol's terms.
fn response(first: FirstToken) -> PrefillResponse {
    PrefillResponse {
        first_token: Some(SampledToken::sampled(&first.token, first.finish)),
        queue_seconds: first.queue.as_secs_f64(),
        prefill_seconds: first.prefill.as_secs_f64(),
    }
}

/// Each engine error as the status the router maps for its clients.
fn status(e: PrefillError) -> Status {
    let message = e.to_string();
    match e {
        PrefillError::InvalidArgument(_) => Status::invalid_argument(message),
        PrefillError::StaleLease(_) => Status::failed_precondition(message),
        PrefillError::PoolUnavailable(_) => Status::unavailable(message),
        PrefillError::Cancelled => Status::cancelled(message),
        PrefillError::Internal(_) => Status::internal(message),
    }
}

#[tonic::async_trait]
impl PrefillWorker for PrefillService {
    /// Runs the prompt into the lease's blocks and returns the first token.
    /// If the caller goes away, the job is dropped at its next chunk.
    async fn prefill(&self, request: Request<PrefillRequest>) -> Result<Response<PrefillResponse>, Status> {
        let arrived = Instant::now();
        let r = request.into_inner();
        let span = tracing::info_span!("prefill", request_id = %r.request_id, prompt_tokens = r.prompt.len(), route = r.route().as_str_name());
        async move {
            if r.request_id.is_empty() {
                return Err(Status::invalid_argument("request_id is empty"));
            }
            if r.prompt.is_empty() {
                return Err(Status::invalid_argument("prompt is empty"));
            }
            if r.max_tokens == 0 {
                return Err(Status::invalid_argument("max_tokens must be at least 1"));
            }
            let route = PrefillRoute::try_from(r.route).map_err(|_| Status::invalid_argument(format!("unknown prefill route {}", r.route)))?;
            let wire_sampling = r.sampling.as_ref().ok_or_else(|| Status::invalid_argument("sampling is missing"))?;
            let sampling = wire_sampling.into();
            // Compiled here, off the engine thread.
            let constraint = match wire_sampling.constraint.as_ref() {
                None => None,
                Some(c) => {
                    let spec = ConstraintSpec::try_from(c).map_err(Status::invalid_argument)?;
                    let grammar = self.grammar.as_ref().ok_or_else(|| Status::invalid_argument("this prefill worker has no tokenizer, so it cannot constrain output"))?;
                    Some(grammar.compile(&spec).map_err(|e| Status::invalid_argument(e.to_string()))?)
                }
            };
            let lease = r.lease.ok_or_else(|| Status::invalid_argument("lease is missing"))?;
            let lease = Lease { pool_epoch: lease.pool_epoch, blocks: lease.blocks, cached_tokens: lease.cached_tokens };
            let job = |reply| {
                let stop_token_ids = r.stop_token_ids.into_iter().collect();
                Command::Prefill(Box::new(Job { request_id: r.request_id, prompt: r.prompt, sampling, lease, constraint, max_tokens: r.max_tokens as usize, stop_token_ids, reply, arrived, dslp_routed: route == PrefillRoute::Dslp }))
            };
            let first = self.ask(job).await?.map_err(status)?;
            Ok(Response::new(response(first)))
        }
        .instrument(span)
        .await
    }

    async fn cancel(&self, request: Request<CancelRequest>) -> Result<Response<CancelResponse>, Status> {
        let request_id = request.into_inner().request_id;
        let span = tracing::info_span!("cancel", %request_id);
        async move {
            let found = self.ask(|reply| Command::Cancel { request_id, reply }).await?;
            tracing::debug!(found, "prefill cancel");
            Ok(Response::new(CancelResponse { found }))
        }
        .instrument(span)
        .await
    }

    async fn stats(&self, _: Request<StatsRequest>) -> Result<Response<WorkerStats>, Status> {
        Ok(Response::new(self.stats.snapshot()))
    }
}
