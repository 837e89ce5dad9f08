//! The `PrefillWorker` gRPC service: checks each message, queues it for the
//! engine thread and relays the answer.

use crate::engine::{Command, Job};
use duplex_grammar::{ConstraintSpec, GrammarCompiler};
use duplex_proto::worker::prefill_worker_server::PrefillWorker;
use duplex_proto::worker::{CancelRequest, CancelResponse, PrefillRequest, PrefillResponse, StatsRequest, WorkerStats};
use duplex_proto::stats::StatsCell;
use std::sync::mpsc::Sender;
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::oneshot;
use tonic::{Request, Response, Status};

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

#[tonic::async_trait]
impl PrefillWorker for PrefillService {
    /// Runs the prompt into the lease's blocks and returns the first token.
    /// If the caller goes away, the job is dropped at its next chunk.
    async fn prefill(&self, request: Request<PrefillRequest>) -> Result<Response<PrefillResponse>, Status> {
        let arrived = Instant::now();
        let r = request.into_inner();
        if r.request_id.is_empty() {
            return Err(Status::invalid_argument("request_id is empty"));
        }
        if r.prompt.is_empty() {
            return Err(Status::invalid_argument("prompt is empty"));
        }
        let wire_sampling = r.sampling.as_ref().ok_or_else(|| Status::invalid_argument("sampling is missing"))?;
        let sampling = wire_sampling.into();
        // Compiled here, off the engine thread.
        let constraint = match wire_sampling.constraint.as_ref() {
            None => None,
            Some(c) => {
                let spec = ConstraintSpec::try_from(c).map_err(Status::invalid_argument)?;
                let grammar = self.grammar.as_ref().ok_or_else(|| Status::invalid_argument("this prefill worker has no tokenizer, so it cannot constrain output"))?;
                Some(Box::new(grammar.compile(&spec).map_err(|e| Status::invalid_argument(e.to_string()))?))
            }
        };
        let lease = r.lease.ok_or_else(|| Status::invalid_argument("lease is missing"))?;
        let job = |reply| Command::Prefill(Job { request_id: r.request_id, prompt: r.prompt, sampling, lease, constraint, reply, arrived });
        Ok(Response::new(self.ask(job).await??))
    }

    async fn cancel(&self, request: Request<CancelRequest>) -> Result<Response<CancelResponse>, Status> {
        let request_id = request.into_inner().request_id;
        let found = self.ask(|reply| Command::Cancel { request_id, reply }).await?;
        Ok(Response::new(CancelResponse { found }))
    }

    async fn stats(&self, _: Request<StatsRequest>) -> Result<Response<WorkerStats>, Status> {
        Ok(Response::new(self.stats.snapshot()))
    }
}
