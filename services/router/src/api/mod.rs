//! The two front doors. Both turn their requests into one
//! `GenerationRequest` and stream the router's events back in their own shape.
//! What they share: tokenizing off the async threads, the API key, and the
//! HTTP API's CORS policy.

pub mod access_log;
pub mod grpc;
pub mod listener;
pub mod openai;
pub mod openai_response;

use crate::error::Error;
use crate::generate::Router;
use crate::request::{Prompt, ServedModel};
use axum::http::{HeaderValue, Method};
use std::sync::Arc;
use tower_http::cors::{AllowHeaders, AllowOrigin, CorsLayer};

/// Above this much text, the allocator is asked to give memory back after
/// tokenizing: the tokenizer's scratch memory is ~100x the text and would
/// otherwise stay with the process.
const TRIM_AFTER_BYTES: usize = 64 << 10;

/// Runs `f`, a tokenization of `bytes` bytes of text, on the blocking pool,
/// at most one per core at a time: the async threads, which serve every
/// other request and `/health`, never tokenize. The caller has checked the
/// size (`ServedModel::check_size`) first.
pub async fn on_tokenizer_pool<T: Send + 'static>(
    router: &Arc<Router>,
    bytes: usize,
    f: impl FnOnce(&ServedModel) -> Result<T, Error> + Send + 'static,
) -> Result<T, Error> {
    let _slot = router.model.tokenize_slots.clone().acquire_owned().await.map_err(|_| Error::Internal("the tokenizer pool is closed".into()))?;
    let router = router.clone();
    let result = tokio::task::spawn_blocking(move || {
        let result = f(&router.model);
        if bytes > TRIM_AFTER_BYTES {
            trim_heap();
        }
        result
    })
    .await;
    result.map_err(|e| Error::Internal(format!("tokenizing failed: {e}")))?
}

/// A prompt as token ids: text too long for the context is refused at once,
/// the rest is tokenized on the pool (ids pass as they are).
pub async fn tokenized(router: &Arc<Router>, prompt: Prompt) -> Result<Prompt, Error> {
    if let Prompt::Tokens(_) = prompt {
        return Ok(prompt);
    }
    router.model.check_size(&prompt)?;
    let bytes = prompt.text_bytes();
    // The prompt moves into the closure, so its text is freed before the trim.
    let ids = on_tokenizer_pool(router, bytes, move |model| model.tokenize(&prompt)).await?;
    Ok(Prompt::Tokens(ids))
}

/// Returns freed heap memory to the system (glibc keeps it otherwise).
fn trim_heap() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim has no preconditions; it only releases free memory.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// The configured API key, compared in constant time.
#[derive(Clone)]
pub struct ApiKey(Option<Arc<str>>);

impl ApiKey {
    pub fn new(key: Option<&str>) -> Self {
        ApiKey(key.map(Arc::from))
    }

    /// Checks the value of an `Authorization` header (HTTP) or `authorization`
    /// metadata (gRPC): `Bearer <key>`.
    pub fn check(&self, authorization: Option<&[u8]>) -> Result<(), Error> {
        let Some(key) = &self.0 else { return Ok(()) };
        let presented = authorization.and_then(|v| v.strip_prefix(b"Bearer ").or_else(|| v.strip_prefix(b"bearer ")));
        match presented {
            None => Err(Error::Unauthenticated("this server requires an API key: send `Authorization: Bearer <key>`".into())),
            Some(p) if constant_time_eq(p, key.as_bytes()) => Ok(()),
            Some(_) => Err(Error::Unauthenticated("the API key is not valid".into())),
        }
    }
}

/// The CORS policy of `/v1/*` for `origins` (`cors_allowed_origins`, as
/// `RouterConfig::validate` checks them): none when empty, so responses carry
/// no CORS headers. Preflights are answered before the API key is checked;
/// the headers a preflight asks for are allowed (`Authorization`, and the
/// `x-stainless-*` headers of OpenAI's JavaScript client), and browsers may
/// cache the answer for an hour.
pub fn cors(origins: &[String]) -> Result<Option<CorsLayer>, String> {
    if origins.is_empty() {
        return Ok(None);
    }
    let allow_origin = if origins.iter().any(|o| o == "*") {
        AllowOrigin::any()
    } else {
        let values = origins.iter().map(|o| HeaderValue::from_str(o).map_err(|_| format!("cors_allowed_origins: {o:?} is not a valid header value")));
        AllowOrigin::list(values.collect::<Result<Vec<_>, _>>()?)
    };
    Ok(Some(
        CorsLayer::new()
            .allow_origin(allow_origin)
            .allow_methods([Method::GET, Method::POST])
            .allow_headers(AllowHeaders::mirror_request())
            .max_age(std::time::Duration::from_secs(3600)),
    ))
}

/// Equality that takes as long wherever the first difference is.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn api_key_check() {
        let key = ApiKey::new(Some("s3cret"));
        assert!(key.check(Some(b"Bearer s3cret")).is_ok());
        for bad in [None, Some(&b"Bearer s3cre"[..]), Some(b"s3cret"), Some(b"Bearer s3cret "), Some(b"Basic s3cret")] {
            assert!(matches!(key.check(bad), Err(Error::Unauthenticated(_))), "{bad:?}");
        }
        assert!(ApiKey::new(None).check(None).is_ok());
    }
}
