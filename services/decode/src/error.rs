//! Why the decode engine refused or ended a request, in its own terms;
//! `server.rs` maps each kind to its gRPC status, once.

/// Each kind is what a caller can do about it: fix the request, retry
/// later, ask again for a lease, or nothing (cancelled, internal).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    /// The request is wrong, or could never run here (a need larger than
    /// the KV pool); retrying will not help.
    #[error("{0}")]
    InvalidArgument(String),
    /// The request id is already in use.
    #[error("{0}")]
    AlreadyExists(String),
    /// Too much is waiting; retry later.
    #[error("{0}")]
    ResourceExhausted(String),
    /// The request relies on state this worker does not have (a lease of
    /// another pool epoch, or none).
    #[error("{0}")]
    FailedPrecondition(String),
    /// Cancelled by the router, or freed before its lease was granted.
    #[error("{0}")]
    Cancelled(String),
    /// This worker failed (a forward pass, the device).
    #[error("{0}")]
    Internal(String),
}
