//! The two front doors. Both turn their requests into one
//! `GenerationRequest` and stream the router's events back in their own shape.

pub mod grpc;
pub mod openai;
