//! Authentication of the internal router ↔ worker calls. The worker ports
//! are not a public API: anyone on the host who could call them could lease
//! the whole KV pool or cancel other clients' requests. Every internal call
//! carries a per-instance secret as metadata, and the workers refuse calls
//! without it (UNAUTHENTICATED).
//!
//! The secret travels in the environment, never on a command line (which
//! every user of the host can read in `ps`): `duplex serve` makes a random
//! one for its children; a compose deployment gives the same value to all
//! three services.

use std::sync::Arc;
use tonic::metadata::MetadataValue;
use tonic::service::Interceptor;
use tonic::{Request, Status};

/// Environment variable holding the secret.
pub const TOKEN_ENV: &str = "DUPLEX_INTERNAL_TOKEN";
/// Metadata key the secret is sent under: binary metadata, so that any
/// secret an operator chooses can be sent as it is.
pub const METADATA_KEY: &str = "x-duplex-internal-token-bin";

/// The secret from [`TOKEN_ENV`]; `None` when unset or empty.
pub fn token_from_env() -> Option<String> {
    std::env::var(TOKEN_ENV).ok().filter(|t| !t.is_empty())
}

/// A fresh random secret (256 bits, hex).
pub fn new_token() -> String {
    let mut bytes = [0u8; 32];
    getrandom(&mut bytes);
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn getrandom(out: &mut [u8]) {
    use std::io::Read;
    // The kernel's CSPRNG; it cannot run dry.
    std::fs::File::open("/dev/urandom").and_then(|mut f| f.read_exact(out)).expect("/dev/urandom is readable");
}

/// Server side: checks the secret on every call.
#[derive(Clone)]
pub struct CheckToken(Option<Arc<[u8]>>);

impl CheckToken {
    /// `None`: every call is accepted (a worker started by hand, without a
    /// secret, on a trusted network); it says so in its log.
    pub fn new(token: Option<String>) -> Self {
        if token.is_none() {
            tracing::warn!("{TOKEN_ENV} is not set: this worker accepts internal calls from anyone who can reach its port");
        }
        CheckToken(token.map(|t| Arc::from(t.into_bytes())))
    }

    pub fn from_env() -> Self {
        Self::new(token_from_env())
    }
}

/// Equal in time independent of where they differ.
fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

impl Interceptor for CheckToken {
    fn call(&mut self, request: Request<()>) -> Result<Request<()>, Status> {
        let Some(expected) = &self.0 else { return Ok(request) };
        match request.metadata().get_bin(METADATA_KEY).and_then(|v| v.to_bytes().ok()) {
            Some(given) if same(&given, expected) => Ok(request),
            _ => Err(Status::unauthenticated("this is a Duplex worker's internal port; calls need the instance's internal token")),
        }
    }
}

/// Client side: adds the secret to every call.
#[derive(Clone)]
pub struct AddToken(Option<MetadataValue<tonic::metadata::Binary>>);

impl AddToken {
    pub fn new(token: Option<String>) -> Self {
        AddToken(token.map(|t| MetadataValue::from_bytes(t.as_bytes())))
    }

    pub fn from_env() -> Self {
        Self::new(token_from_env())
    }
}

impl Interceptor for AddToken {
    fn call(&mut self, mut request: Request<()>) -> Result<Request<()>, Status> {
        if let Some(token) = &self.0 {
            request.metadata_mut().insert_bin(METADATA_KEY, token.clone());
        }
        Ok(request)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn calls_without_the_right_token_are_refused() {
        let mut check = CheckToken::new(Some("s3cret".into()));
        assert_eq!(check.call(Request::new(())).unwrap_err().code(), tonic::Code::Unauthenticated);
        let mut wrong = Request::new(());
        wrong.metadata_mut().insert_bin(METADATA_KEY, MetadataValue::from_bytes(b"s3creT"));
        assert_eq!(check.call(wrong).unwrap_err().code(), tonic::Code::Unauthenticated);
        let right = AddToken::new(Some("s3cret".into())).call(Request::new(())).unwrap();
        assert!(check.call(right).is_ok());
        assert!(CheckToken::new(None).call(Request::new(())).is_ok());
    }

    #[test]
    fn new_tokens_differ() {
        let (a, b) = (new_token(), new_token());
        assert_eq!(a.len(), 64);
        assert_ne!(a, b);
    }
}
