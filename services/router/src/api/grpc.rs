//! The public gRPC API, `duplex.v1.Generation`: proto messages in, one
//! `GenerationRequest` through the router, proto events out.

use super::access_log::AccessLog;
use super::openai_response::Usage;
use crate::error::Error;
use crate::generate::{count_refused, Event, Router};
use crate::request::{Prompt, RequestOptions};
use duplex_grammar::ConstraintSpec;
use duplex_text::tokenizer::ChatMessage;
use duplex_proto::v1::generation_server::Generation;
use duplex_proto::v1::{
    self, generate_request, generate_response, response_format, tokenize_request, GenerateRequest, GenerateResponse, ModelInfoRequest, ModelInfoResponse,
    TokenizeRequest, TokenizeResponse,
};
use futures::{Stream, StreamExt};
use std::pin::Pin;
use std::sync::Arc;
use tonic::{Request, Response, Status};

pub struct GrpcApi {
    router: Arc<Router>,
}

impl GrpcApi {
    pub fn new(router: Arc<Router>) -> Self {
        GrpcApi { router }
    }
}

#[tonic::async_trait]
impl Generation for GrpcApi {
    type GenerateStream = Pin<Box<dyn Stream<Item = Result<GenerateResponse, Status>> + Send>>;

    async fn generate(&self, request: Request<GenerateRequest>) -> Result<Response<Self::GenerateStream>, Status> {
        let r = request.into_inner();
        let prompt = match r.prompt {
            Some(generate_request::Prompt::Text(text)) => Prompt::Text(text),
            Some(generate_request::Prompt::Tokens(t)) => Prompt::Tokens(t.ids),
            Some(generate_request::Prompt::Chat(c)) => chat(c).inspect_err(count_refused)?,
            None => {
                let e = Error::invalid("prompt", "prompt is required: set one of text, tokens or chat");
                count_refused(&e);
                return Err(e.into());
            }
        };
        let mut log = AccessLog::new("grpc Generate");
        let admitted = async {
            let mut opts = options(r.model, r.sampling.unwrap_or_default(), r.stopping.unwrap_or_default());
            opts.constraint = r.response_format.map(constraint).transpose().inspect_err(count_refused)?.flatten();
            let prompt = super::tokenized(&self.router, prompt).await.inspect_err(count_refused)?;
            self.router.admit(&prompt, opts)
        };
        let (req, permit) = admitted.await.map_err(|e| {
            let status = Status::from(e);
            log.finish(status.code(), None);
            status
        })?;
        log.id(&req.public_id);
        let mut events = self.router.generate(req, permit);
        let responses = async_stream::stream! {
            while let Some(event) = events.next().await {
                match event {
                    Ok(Event::Finished(f)) => {
                        let usage = Usage::of([&f]);
                        log.finish(tonic::Code::Ok, Some((usage, Some(&f))));
                        yield Ok(response(Event::Finished(f)));
                    }
                    Ok(event) => yield Ok(response(event)),
                    Err(e) => {
                        let status = Status::from(e);
                        log.finish(status.code(), None);
                        yield Err(status);
                    }
                }
            }
        };
        Ok(Response::new(Box::pin(responses)))
    }

    async fn tokenize(&self, request: Request<TokenizeRequest>) -> Result<Response<TokenizeResponse>, Status> {
        // As Generate would: text and chat contents are plain text.
        let ids = match request.into_inner().input {
            // Empty text is a fine thing to tokenize, unlike to generate from.
            Some(tokenize_request::Input::Text(text)) => {
                self.router.model.check_text_bytes("text", text.len())?;
                super::on_tokenizer_pool(&self.router, text.len(), move |model| {
                    model.tokenizer.encode_text(&text).map_err(|e| Error::invalid("text", e.to_string()))
                })
                .await?
            }
            Some(tokenize_request::Input::Chat(c)) => {
                let prompt = chat(c)?;
                self.router.model.check_size(&prompt)?;
                super::on_tokenizer_pool(&self.router, prompt.text_bytes(), move |model| model.tokenize(&prompt)).await?
            }
            None => return Err(Error::invalid("input", "input is required: set text or chat").into()),
        };
        Ok(Response::new(TokenizeResponse { ids }))
    }

    async fn model_info(&self, _: Request<ModelInfoRequest>) -> Result<Response<ModelInfoResponse>, Status> {
        let model = &self.router.model;
        let readiness = self.router.workers.readiness();
        let context_length = match readiness.limits() {
            Ok(limits) => model.max_model_len(&limits),
            Err(_) => model.context_length,
        };
        Ok(Response::new(ModelInfoResponse {
            model: model.name.clone(),
            vocab_size: model.vocab_size as u32,
            context_length: context_length as u32,
            prefill_worker_threshold: self.router.prefill_threshold(),
            weights_fingerprint: readiness.decode.map(|s| s.weights_fingerprint).unwrap_or_default(),
        }))
    }
}

fn chat(c: v1::ChatMessages) -> Result<Prompt, Error> {
    let template_kwargs = match c.chat_template_kwargs.trim() {
        "" => Default::default(),
        json => serde_json::from_str(json)
            .map_err(|e| Error::invalid("chat_template_kwargs", format!("chat_template_kwargs must be a JSON object (or empty): {e}")))?,
    };
    let messages = c.messages.into_iter().map(|m| ChatMessage::new(m.role, m.content)).collect();
    Ok(Prompt::Chat { messages, template_kwargs, tools: vec![] })
}

fn constraint(format: v1::ResponseFormat) -> Result<Option<ConstraintSpec>, Error> {
    Ok(match format.format {
        None => None,
        Some(response_format::Format::JsonObject(_)) => Some(ConstraintSpec::JsonObject),
        Some(response_format::Format::JsonSchema(text)) => {
            let schema = serde_json::from_str(&text).map_err(|e| Error::invalid("response_format", format!("response_format.json_schema is not valid JSON: {e}")))?;
            Some(ConstraintSpec::JsonSchema(schema))
        }
        Some(response_format::Format::Lark(grammar)) => Some(ConstraintSpec::Lark(grammar)),
    })
}

fn options(model: String, s: v1::SamplingParameters, stopping: v1::StoppingCriteria) -> RequestOptions {
    RequestOptions {
        model: Some(model),
        temperature: s.temperature,
        top_k: s.top_k,
        top_p: s.top_p,
        min_p: s.min_p,
        repetition_penalty: s.repetition_penalty,
        presence_penalty: s.presence_penalty,
        frequency_penalty: s.frequency_penalty,
        seed: s.seed,
        // 0 is the proto's "unset".
        max_tokens: (stopping.max_tokens > 0).then_some(stopping.max_tokens),
        stop: stopping.stop,
        stop_token_ids: stopping.stop_token_ids,
        ignore_eos: stopping.ignore_eos,
        logprobs: s.logprobs,
        top_logprobs: s.top_logprobs,
        constraint: None,
        keep_special_tokens: vec![],
    }
}

fn response(event: Event) -> GenerateResponse {
    let event = match event {
        Event::Token(t) => generate_response::Event::Token(v1::Token {
            id: t.id,
            text: t.text,
            logprob: t.logprob,
            top_logprobs: t.top_logprobs.into_iter().map(|p| v1::TopLogprob { id: p.id, logprob: p.logprob, text: p.text }).collect(),
        }),
        Event::Finished(f) => generate_response::Event::Finished(v1::Finished {
            text: f.text,
            finish_reason: f.reason.as_str().into(),
            usage: Some(v1::Usage { prompt_tokens: f.prompt_tokens, completion_tokens: f.completion_tokens }),
            timings: Some(v1::Timings {
                queue_seconds: f.timings.queue.as_secs_f64(),
                time_to_first_token_seconds: f.timings.time_to_first_token.as_secs_f64(),
                mean_time_per_output_token_seconds: f.timings.mean_time_per_output_token.as_secs_f64(),
                total_seconds: f.timings.total.as_secs_f64(),
                prefill_path: f.timings.path.as_str().into(),
            }),
        }),
    };
    GenerateResponse { event: Some(event) }
}
