//! The errors a request can end with, and how each front door reports them:
//! one enum, mapped once to gRPC codes here and to HTTP in `api/openai.rs`.

use duplex_text::tokenizer::TokenizerError;
use tonic::{Code, Status};

#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum Error {
    /// The client sent something wrong; `param` names the field when one is
    /// to blame (OpenAI's `error.param`).
    #[error("{message}")]
    Invalid { param: Option<&'static str>, message: String },
    #[error("the model `{asked}` does not exist; this server serves `{served}`")]
    ModelNotFound { asked: String, served: String },
    /// The server has an API key and the client did not present it.
    #[error("{0}")]
    Unauthenticated(String),
    /// The request is larger than the server accepts (`max_request_body_bytes`).
    #[error("{0}")]
    TooLarge(String),
    /// Admission refused: too many requests in flight, or a worker is full.
    #[error("{0}")]
    Overloaded(String),
    /// A worker is down, not ready, or failed mid-request.
    #[error("{0}")]
    Unavailable(String),
    /// A bug in the router.
    #[error("{0}")]
    Internal(String),
}

impl Error {
    pub fn invalid(param: &'static str, message: impl Into<String>) -> Self {
        Error::Invalid { param: Some(param), message: message.into() }
    }

    /// Rendering or encoding a chat failed: the client's template variables
    /// (`chat_template_kwargs`), or the messages, which a template may reject
    /// (`raise_exception`). The message never shows the server's paths.
    pub fn chat_template(e: TokenizerError) -> Self {
        match e {
            TokenizerError::NoChatTemplate { .. } => Error::invalid("messages", "this model has no chat template; send a plain prompt instead"),
            TokenizerError::TemplateKwargs { .. } => Error::invalid("chat_template_kwargs", e.to_string()),
            e => Error::invalid("messages", e.client_message()),
        }
    }

    /// The `outcome` label of the requests counter for a request that ended
    /// with this error.
    pub fn outcome(&self) -> &'static str {
        match self {
            Error::Invalid { .. } | Error::ModelNotFound { .. } | Error::TooLarge(_) => "invalid",
            Error::Unauthenticated(_) => "unauthenticated",
            Error::Overloaded(_) => "rejected",
            Error::Unavailable(_) | Error::Internal(_) => "error",
        }
    }

    /// A failed call to a worker, as the client should see it. Only the
    /// worker's INVALID_ARGUMENT and RESOURCE_EXHAUSTED are the client's
    /// business; anything else means the worker failed, which the client may
    /// retry (UNAVAILABLE), whatever code the transport happened to produce.
    pub fn from_worker(worker: &str, status: &Status) -> Self {
        let message = status.message();
        match status.code() {
            Code::InvalidArgument | Code::OutOfRange => Error::Invalid { param: None, message: format!("{worker} worker rejected the request: {message}") },
            Code::ResourceExhausted => Error::Overloaded(format!("{worker} worker is at capacity: {message}")),
            code => Error::Unavailable(format!("{worker} worker failed: {message} ({code:?})")),
        }
    }
}

impl From<Error> for Status {
    fn from(e: Error) -> Status {
        let code = match &e {
            Error::Invalid { .. } => Code::InvalidArgument,
            Error::ModelNotFound { .. } => Code::NotFound,
            Error::Unauthenticated(_) => Code::Unauthenticated,
            Error::TooLarge(_) => Code::ResourceExhausted,
            Error::Overloaded(_) => Code::ResourceExhausted,
            Error::Unavailable(_) => Code::Unavailable,
            Error::Internal(_) => Code::Internal,
        };
        Status::new(code, e.to_string())
    }
}
