//! The simulator's parts (`duplex simulate`): predict TTFT and TPOT on
//! hardware we do not have by running the real engines and their scheduling
//! against a modelled clock instead of a measured one.
//!
//! - `hardware`: what a machine is (devices, links, CPU sockets), read
//!   from TOML; the shipped descriptions and this machine's, calibrated.
//! - `cost`: how long an op or a transfer takes on it, a roofline per
//!   level (MoE-Lightning's hierarchical roofline) with calibrated or cited
//!   efficiency factors.
//! - [`device`]: a simulated accelerator: a [`duplex_kernels::device::Device`]
//!   whose ops do not compute but take their modelled time on virtual
//!   timelines, with streams, events, copies and host functions keeping
//!   their real semantics.
//! - [`cpu`]: a simulated CPU pool, the backend the CPU placement's forward
//!   program runs on to time its ops instead of computing them.

/// What a machine is: CPU sockets, devices and links, read from TOML.
pub mod hardware;
/// How long an op or a transfer takes on a machine: a roofline per level.
pub mod cost;
/// This machine's description, measured: CPU kernels and the emulated device.
pub mod calibrate;
/// A simulated accelerator on a virtual clock.
pub mod device;
/// A simulated CPU pool on a virtual clock, for the CPU placement.
pub mod cpu;
