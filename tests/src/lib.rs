//! End-to-end tests of the Duplex binaries live in `tests/`; this crate has no library code.
