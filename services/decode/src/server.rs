//! The `DecodeWorker` gRPC service: checks each message, then hands it to the
//! engine thread and relays the answer. Async lives here; compute lives in
//! the batcher. The only place where the worker protocol's messages and
//! `tonic::Status` meet the engine's types.

use crate::batcher::{Admission, Command, Prefilled, SeqEvent};
use crate::error::DecodeError;
use crate::kv_alloc::BlockLease;
use crate::lease::{DeviceLender, LeaseEvent, LeaseStream, Lendable};
use duplex_grammar::{ConstraintSpec, GrammarCompiler};
use duplex_proto::worker::decode_worker_server::DecodeWorker;
use duplex_proto::worker::device_lease_event::Event;
use duplex_proto::worker::device_lease_server::DeviceLease;
use duplex_proto::worker::{
    AllocateKvRequest, CancelRequest, CancelResponse, DecodeEvent, DecodeRequest, DeviceLeaseEvent, DeviceLeaseGranted, DeviceLeaseRefused, DeviceLeaseRequest, DeviceLeaseRevoked,
    FreeKvRequest, FreeKvResponse, KvLease, SampledToken, StatsRequest, WorkerStats,
};
use duplex_proto::stats::StatsCell;
use std::pin::Pin;
use std::sync::mpsc::Sender;
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::{mpsc, oneshot};
use tokio_stream::wrappers::UnboundedReceiverStream;
use tokio_stream::{Stream, StreamExt};
use tonic::{Request, Response, Status};
use tracing::Instrument;

/// Each engine error as the status the router maps for its clients.
pub fn status(e: DecodeError) -> Status {
    let message = e.to_string();
    match e {
        DecodeError::InvalidArgument(_) => Status::invalid_argument(message),
        DecodeError::AlreadyExists(_) => Status::already_exists(message),
        DecodeError::ResourceExhausted(_) => Status::resource_exhausted(message),
        DecodeError::FailedPrecondition(_) => Status::failed_precondition(message),
        DecodeError::Cancelled(_) => Status::cancelled(message),
        DecodeError::Internal(_) => Status::internal(message),
    }
}

/// A sequence's event on the wire: a token (the last with its finish), or
/// the status that ends the stream.
pub fn wire_event(event: SeqEvent) -> Result<DecodeEvent, Status> {
    match event {
        SeqEvent::Token { token, finish } => Ok(DecodeEvent {
            token: Some(SampledToken::sampled(&token, finish.map(|f| f.reason))),
            queue_seconds: finish.map_or(0.0, |f| f.queue.as_secs_f64()),
        }),
        SeqEvent::Failed(e) => Err(status(e)),
    }
}

pub struct DecodeService {
    commands: Sender<Command>,
    stats: Arc<StatsCell>,
    vocab_size: usize,
    context_length: usize,
    /// Compiles structured-output constraints; `None` without a tokenizer.
    grammar: Option<GrammarCompiler>,
    /// Takes back the device, if it is lent, before each admission.
    lender: Arc<DeviceLender>,
}

impl DecodeService {
    /// A service whose device lender has no device and the default wait
    /// (`with_lender` sets the one the `DeviceLease` service shares).
    pub fn new(commands: Sender<Command>, stats: Arc<StatsCell>, vocab_size: usize, context_length: usize) -> Self {
        let lender = DeviceLender::new(Lendable { device: None, budget_bytes: None }, std::time::Duration::from_secs(5));
        DecodeService { commands, stats, vocab_size, context_length, grammar: None, lender }
    }

    pub fn with_lender(self, lender: Arc<DeviceLender>) -> Self {
        DecodeService { lender, ..self }
    }

    /// Accept constrained requests, compiled with `grammar`.
    pub fn with_grammar(self, grammar: Option<GrammarCompiler>) -> Self {
        DecodeService { grammar, ..self }
    }

    fn send(&self, command: Command) -> Result<(), Status> {
        self.commands.send(command).map_err(|_| Status::unavailable("the decode engine has stopped"))
    }

    async fn ask<T>(&self, make: impl FnOnce(oneshot::Sender<T>) -> Command) -> Result<T, Status> {
        let (reply, answer) = oneshot::channel();
        self.send(make(reply))?;
        answer.await.map_err(|_| Status::unavailable("the decode engine has stopped"))
    }

    fn admission(&self, r: DecodeRequest, events: crate::batcher::EventSender) -> Result<Admission, Status> {
        if r.request_id.is_empty() {
            return Err(Status::invalid_argument("request_id is empty"));
        }
        if r.prompt.is_empty() {
            return Err(Status::invalid_argument("prompt is empty"));
        }
        if let Some(id) = r.prompt.iter().find(|&&t| t as usize >= self.vocab_size) {
            return Err(Status::invalid_argument(format!("prompt token {id} is outside the vocabulary of {}", self.vocab_size)));
        }
        if r.prompt.len() >= self.context_length {
            return Err(Status::invalid_argument(format!("prompt has {} tokens; the context length is {}", r.prompt.len(), self.context_length)));
        }
        if r.max_tokens == 0 {
            return Err(Status::invalid_argument("max_tokens must be at least 1"));
        }
        let sampling = r.sampling.as_ref().ok_or_else(|| Status::invalid_argument("sampling is missing"))?;
        let prefilled = match r.prefilled {
            None => None,
            Some(p) => {
                let lease = p.lease.ok_or_else(|| Status::invalid_argument("prefilled.lease is missing"))?;
                let first_token = p.first_token.ok_or_else(|| Status::invalid_argument("prefilled.first_token is missing"))?;
                if first_token.id as usize >= self.vocab_size {
                    return Err(Status::invalid_argument(format!("first token {} is outside the vocabulary", first_token.id)));
                }
                if first_token.last {
                    return Err(Status::invalid_argument("prefilled.first_token is marked last: a finished request has nothing to decode"));
                }
                Some(Prefilled { lease: block_lease(lease), first_token: (&first_token).into() })
            }
        };
        // Compiled here, off the engine thread. The router compiled it
        // already, so an error is a client's only if the router is skipped.
        let constraint = match sampling.constraint.as_ref() {
            None => None,
            Some(c) => {
                let spec = ConstraintSpec::try_from(c).map_err(Status::invalid_argument)?;
                let grammar = self.grammar.as_ref().ok_or_else(|| Status::invalid_argument("this decode worker has no tokenizer, so it cannot constrain output"))?;
                Some(grammar.compile(&spec).map_err(|e| Status::invalid_argument(e.to_string()))?)
            }
        };
        Ok(Admission {
            request_id: r.request_id,
            prompt: r.prompt,
            sampling: sampling.into(),
            max_tokens: r.max_tokens as usize,
            stop_token_ids: r.stop_token_ids.into_iter().collect(),
            prefilled,
            constraint,
            events,
            arrived: Instant::now(),
        })
    }
}

#[tonic::async_trait]
impl DecodeWorker for DecodeService {
    async fn allocate_kv(&self, request: Request<AllocateKvRequest>) -> Result<Response<KvLease>, Status> {
        let r = request.into_inner();
        let span = tracing::info_span!("allocate_kv", request_id = %r.request_id, tokens = r.tokens, max_tokens = r.max_tokens);
        async move {
            if r.request_id.is_empty() {
                return Err(Status::invalid_argument("request_id is empty"));
            }
            if !r.prompt.is_empty() && r.prompt.len() != r.tokens as usize {
                return Err(Status::invalid_argument(format!("the prompt has {} token ids but tokens is {}", r.prompt.len(), r.tokens)));
            }
            if let Some(id) = r.prompt.iter().find(|&&t| t as usize >= self.vocab_size) {
                return Err(Status::invalid_argument(format!("prompt token {id} is outside the vocabulary of {}", self.vocab_size)));
            }
            // Waits while the pool is short; if the caller gives up first, the
            // engine notices the dropped reply and lets the place go.
            let lease = self
                .ask(|reply| Command::AllocateKv { request_id: r.request_id, tokens: r.tokens as usize, prompt: r.prompt, max_tokens: r.max_tokens as usize, reply })
                .await?
                .map_err(status)?;
            tracing::debug!(blocks = lease.blocks.len(), "KV lease granted");
            Ok(Response::new(KvLease { pool_epoch: lease.pool_epoch, request_id: lease.request_id, blocks: lease.blocks, cached_tokens: lease.cached_tokens }))
        }
        .instrument(span)
        .await
    }

    async fn free_kv(&self, request: Request<FreeKvRequest>) -> Result<Response<FreeKvResponse>, Status> {
        let request_id = request.into_inner().request_id;
        let span = tracing::info_span!("free_kv", %request_id);
        async move {
            let found = self.ask(|reply| Command::FreeKv { request_id, reply }).await?;
            tracing::debug!(found, "KV lease freed");
            Ok(Response::new(FreeKvResponse {}))
        }
        .instrument(span)
        .await
    }

    type DecodeStream = Pin<Box<dyn Stream<Item = Result<DecodeEvent, Status>> + Send>>;

    /// The stream ends after the token marked `last`, or with an error
    /// status. When the caller drops it, the engine notices at its next step
    /// and frees the sequence's blocks.
    async fn decode(&self, request: Request<DecodeRequest>) -> Result<Response<Self::DecodeStream>, Status> {
        let r = request.into_inner();
        let span = tracing::info_span!("decode", request_id = %r.request_id, prompt_tokens = r.prompt.len(), prefilled = r.prefilled.is_some());
        let (events, stream) = mpsc::unbounded_channel();
        let admission = span.in_scope(|| self.admission(r, events).inspect_err(|status| tracing::debug!("refused: {}", status.message())))?;
        // The device first: a lease of it is revoked and given back (or
        // its bounded wait runs out) before the engine sees the sequence.
        let admitting = self.lender.admit().instrument(span.clone()).await;
        self.send(Command::Admit(Box::new(admission)))?;
        drop(admitting);
        span.in_scope(|| tracing::debug!("sent to the engine"));
        Ok(Response::new(Box::pin(UnboundedReceiverStream::new(stream).map(wire_event))))
    }

    async fn cancel(&self, request: Request<CancelRequest>) -> Result<Response<CancelResponse>, Status> {
        let request_id = request.into_inner().request_id;
        let span = tracing::info_span!("cancel", %request_id);
        async move {
            let found = self.ask(|reply| Command::Cancel { request_id, reply }).await?;
            tracing::debug!(found, "decode cancel");
            Ok(Response::new(CancelResponse { found }))
        }
        .instrument(span)
        .await
    }

    /// Fails once the engine thread has ended, so that the router's health
    /// reports this worker down rather than ready for work it cannot do.
    async fn stats(&self, _: Request<StatsRequest>) -> Result<Response<WorkerStats>, Status> {
        if self.stats.engine_stopped.load(std::sync::atomic::Ordering::Relaxed) {
            return Err(Status::unavailable("the decode engine has stopped"));
        }
        Ok(Response::new(self.stats.snapshot()))
    }
}

/// The `DeviceLease` service: lends the device to the prefill worker's
/// two-device prefill (see [`crate::lease`]).
pub struct LeaseService {
    commands: Sender<Command>,
    lender: Arc<DeviceLender>,
}

impl LeaseService {
    pub fn new(commands: Sender<Command>, lender: Arc<DeviceLender>) -> Self {
        LeaseService { commands, lender }
    }
}

#[tonic::async_trait]
impl DeviceLease for LeaseService {
    type LeaseDeviceStream = Pin<Box<dyn Stream<Item = Result<DeviceLeaseEvent, Status>> + Send>>;

    /// The first event grants or refuses; a granted lease lasts until the
    /// caller drops the stream.
    async fn lease_device(&self, request: Request<DeviceLeaseRequest>) -> Result<Response<Self::LeaseDeviceStream>, Status> {
        let r = request.into_inner();
        let span = tracing::info_span!("lease_device", request_id = %r.request_id, bytes = r.bytes);
        async move {
            let stream = match self.lender.reserve(&r.request_id, r.bytes) {
                Err(reason) => LeaseStream::refused(reason),
                Ok(reservation) => {
                    // Asked in the engine's command queue, after every
                    // admission already sent: none is missed.
                    let (reply, answer) = oneshot::channel();
                    self.commands.send(Command::Sequences { reply }).map_err(|_| Status::unavailable("the decode engine has stopped"))?;
                    let sequences = answer.await.map_err(|_| Status::unavailable("the decode engine has stopped"))?;
                    reservation.grant(sequences)
                }
            };
            Ok(Response::new(Box::pin(stream.map(|e| Ok::<_, Status>(lease_event(e)))) as Self::LeaseDeviceStream))
        }
        .instrument(span)
        .await
    }
}

/// A device lease's event as the protocol sends it.
fn lease_event(e: LeaseEvent) -> DeviceLeaseEvent {
    let event = match e {
        LeaseEvent::Granted => Event::Granted(DeviceLeaseGranted {}),
        LeaseEvent::Refused { reason } => Event::Refused(DeviceLeaseRefused { reason }),
        LeaseEvent::Revoked => Event::Revoked(DeviceLeaseRevoked {}),
    };
    DeviceLeaseEvent { event: Some(event) }
}

/// A lease as the router passed it on.
fn block_lease(l: KvLease) -> BlockLease {
    BlockLease { pool_epoch: l.pool_epoch, request_id: l.request_id, blocks: l.blocks, cached_tokens: l.cached_tokens }
}
