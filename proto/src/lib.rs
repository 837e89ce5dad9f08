//! duplex-proto: the gRPC contracts, generated from `proto/` at build time.
//!
//! - `duplex.v1`: the public API (streaming `Generate`, `Tokenize`,
//!   `ModelInfo`), served by the router.
//! - `duplex.worker.v1`: router ↔ workers (KV leases, prefill, admit and
//!   decode, cancel, stats). Only token ids and block numbers cross it.

pub mod auth;
pub mod convert;
pub mod stats;

pub mod v1 {
    tonic::include_proto!("duplex.v1");
}

pub mod worker {
    tonic::include_proto!("duplex.worker.v1");
}

/// Encoded `FileDescriptorSet` of every proto here, for server reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/duplex_descriptor.bin"));
