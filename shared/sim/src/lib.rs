//! The simulator's parts (`duplex simulate`): predict TTFT and TPOT on
//! hardware we do not have by running the real engines and their scheduling
//! against a modelled clock instead of a measured one.
//!
//! - [`hardware`]: what a machine is (devices, links, CPU sockets), read
//!   from TOML; the shipped descriptions in `deploy/hardware/`.
//! - [`cost`]: how long an op or a transfer takes on it, a roofline per
//!   level (MoE-Lightning's hierarchical roofline) with calibrated or cited
//!   efficiency factors.
//! - [`calibrate`]: this machine's description, measured (its CPU kernels
//!   and the emulated device).
//! - [`device`]: a simulated accelerator, a [`duplex_kernels::device::Device`]
//!   whose ops do not compute but take their modelled time on virtual
//!   timelines, with streams, events, copies and host functions keeping
//!   their real semantics.
//! - [`cpu`]: a simulated CPU pool: the backend the CPU placement's forward
//!   program runs on, and the hybrid placement's expert pool, timing ops
//!   instead of computing them.

pub mod calibrate;
pub mod cost;
pub mod cpu;
pub mod device;
pub mod hardware;
