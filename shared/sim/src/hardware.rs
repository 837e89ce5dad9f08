//! What a machine is, for the simulator: its CPU sockets and its
//! accelerators with their links to the host, read from a TOML description
//! (`deploy/hardware/*.toml`) and checked before anything is predicted.
//!
//! Units are in the key names: bandwidths in `_gb_per_s` (10⁹ bytes/s),
//! FLOP rates in `_tflops` (10¹² FLOP/s, dense: no sparsity), capacity in
//! `_gib`, times in `_us`. Efficiencies are fractions of the peak next to
//! them. An unknown key is an error, so a typo never falls back to a default.

use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// A machine: one CPU (all its sockets) and any number of accelerators.
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Hardware {
    pub name: String,
    /// Where the figures come from, in a sentence or two.
    pub notes: String,
    pub cpu: CpuSpec,
    #[serde(rename = "device", default)]
    pub devices: Vec<DeviceSpec>,
}

/// The host CPU, all sockets together.
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct CpuSpec {
    pub sockets: usize,
    pub cores_per_socket: usize,
    /// DRAM read bandwidth of the whole machine: the theoretical peak
    /// (channels × transfer rate × 8 bytes) or a measured figure, as the
    /// file's comments say.
    pub dram_read_gb_per_s: f64,
    /// The fraction of `dram_read_gb_per_s` a streaming read reaches with
    /// enough threads.
    pub read_efficiency: f64,
    /// What one thread's streaming read reaches. Bandwidth grows with the
    /// threads until the whole machine's is reached (see `CpuSpec::time`).
    pub core_read_gb_per_s: f64,
    /// The fraction of the achieved read bandwidth that weight-streaming
    /// kernels (a batch-1 GEMV, a MoE layer) reach. It is relative to a
    /// measured read, which a well-pipelined kernel can slightly beat, so
    /// it may exceed 1 (up to 1.5).
    pub gemv_efficiency: f64,
    /// Vector-unit peaks of the whole machine (all cores, sustained clock).
    pub f32_tflops: f64,
    pub bf16_tflops: f64,
    /// Matrix-unit (AMX) BF16 peak of the whole machine; 0 when there is none.
    pub amx_bf16_tflops: f64,
    /// The fraction of the peak a compute-bound GEMM reaches.
    pub gemm_efficiency: f64,
    /// How the products' rate depends on their rows (tokens); see [`RowFractions`].
    #[serde(default, skip_serializing_if = "RowFractions::is_empty")]
    pub gemm_row_fractions: RowFractions,
    /// What the CPU's attention kernels reach, whole machine: F32 FMAs over
    /// the F32 cache, a different kernel (and rate) from the products'. One
    /// query row a head (decode), and many (prefill's causal attention over
    /// expanded keys), are different kernels again.
    pub attention_tflops: f64,
    pub prefill_attention_tflops: f64,
    /// Socket-to-socket bandwidth per direction; 0 for one socket.
    pub numa_link_gb_per_s: f64,
}

/// A product kernel's rate against the rows (tokens) it multiplies, as
/// measured: pairs `[rows, fraction]`, each the fraction of the rate that
/// `gemm_efficiency` gives which a product of that many rows reaches.
/// Between two points the fraction is interpolated in log2(rows); beyond
/// the first and last it is held. Empty (the shipped GPUs, which cite one
/// efficiency): every product reaches that rate. A routed expert in a
/// prefill sees only its share of the tokens (512 tokens over 64 experts,
/// top 6: about 48 each), and a CPU kernel widening FP8 weights does that
/// once per weight for all its rows, so few rows can run below the rate
/// (on the 2-core EPYC here: about 0.8 of it at 16 rows, 0.9 at 32).
#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(transparent)]
pub struct RowFractions(pub Vec<[f64; 2]>);

impl RowFractions {
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The fraction a product of `rows` rows reaches.
    pub fn at(&self, rows: usize) -> f64 {
        let points = &self.0;
        let (Some(first), Some(last)) = (points.first(), points.last()) else { return 1.0 };
        let x = (rows.max(1) as f64).log2();
        if x <= first[0].log2() {
            return first[1];
        }
        for pair in points.windows(2) {
            let (x0, x1) = (pair[0][0].log2(), pair[1][0].log2());
            if x <= x1 {
                return pair[0][1] + (pair[1][1] - pair[0][1]) * (x - x0) / (x1 - x0);
            }
        }
        last[1]
    }

    fn validate(&self) -> Result<(), String> {
        for pair in self.0.windows(2) {
            if pair[1][0] <= pair[0][0] {
                return Err(format!("`gemm_row_fractions` rows must increase: {} then {}", pair[0][0], pair[1][0]));
            }
        }
        for &[rows, share] in &self.0 {
            if !(rows >= 1.0 && rows.is_finite()) {
                return Err(format!("`gemm_row_fractions` rows must be at least 1, got {rows}"));
            }
            fraction("gemm_row_fractions", share, 2.0)?;
        }
        Ok(())
    }
}

/// An accelerator and its link to the host.
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct DeviceSpec {
    pub name: String,
    pub memory_gib: f64,
    /// Dense peaks per data type.
    pub f32_tflops: f64,
    pub bf16_tflops: f64,
    /// FP8 peak, for the description's completeness: no kernel of ours
    /// multiplies in FP8 (FP8 weights are widened first), so the cost model
    /// does not use it. 0 when the device has no FP8 math.
    pub fp8_tflops: f64,
    pub memory_gb_per_s: f64,
    /// The fraction of the peak FLOP rate a compute-bound GEMM reaches.
    pub gemm_efficiency: f64,
    /// How the products' rate depends on their rows (tokens); see [`RowFractions`].
    #[serde(default, skip_serializing_if = "RowFractions::is_empty")]
    pub gemm_row_fractions: RowFractions,
    /// The fraction of the peak a compute-bound attention kernel reaches
    /// (prefill's causal attention; decode's is memory-bound).
    pub attention_efficiency: f64,
    /// The fraction of `memory_gb_per_s` a streaming kernel reaches.
    pub bandwidth_efficiency: f64,
    /// Host→device and device→host link bandwidth, per direction.
    pub h2d_gb_per_s: f64,
    pub d2h_gb_per_s: f64,
    /// The fraction of the link's bandwidth a large pinned copy reaches.
    pub link_efficiency: f64,
    /// Fixed cost of one copy, whatever its size.
    pub link_latency_us: f64,
    /// Fixed cost of one kernel launch.
    pub launch_us: f64,
    /// Whether devices copy to each other directly (else through the host).
    pub peer_to_peer: bool,
    /// Copy engines: with 2, a compute stream's own copies (ids, row lists,
    /// routes) do not queue behind the weights a copy stream streams in;
    /// with 1, every copy takes the one engine in turn.
    pub copy_engines: usize,
}

#[derive(Debug, thiserror::Error)]
pub enum HardwareError {
    #[error("cannot read hardware description {path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("hardware description {origin}: {message}")]
    Parse { origin: String, message: String },
    #[error("hardware description {origin}: {problem}")]
    Invalid { origin: String, problem: String },
}

/// The descriptions shipped in `deploy/hardware/`, by name (the file's stem).
pub const BUILTIN: &[&str] = &["paper-node", "rtx4090-workstation"];

/// The shipped files' text, in `BUILTIN`'s order.
const BUILTIN_TEXT: &[&str] = &[include_str!("../../../deploy/hardware/paper-node.toml"), include_str!("../../../deploy/hardware/rtx4090-workstation.toml")];

impl Hardware {
    /// Read and check a description.
    pub fn load(path: &Path) -> Result<Hardware, HardwareError> {
        let text = std::fs::read_to_string(path).map_err(|source| HardwareError::Io { path: path.to_path_buf(), source })?;
        Hardware::parse(&text, &path.display().to_string())
    }

    /// Parse and check a description's text; `origin` names it in errors.
    pub fn parse(text: &str, origin: &str) -> Result<Hardware, HardwareError> {
        let hw: Hardware = toml::from_str(text).map_err(|e| HardwareError::Parse { origin: origin.to_string(), message: e.to_string() })?;
        hw.validate().map_err(|problem| HardwareError::Invalid { origin: origin.to_string(), problem })?;
        Ok(hw)
    }

    /// A shipped description (see [`BUILTIN`]). The shipped files are
    /// checked by the tests, so a parse failure here is a build defect.
    pub fn builtin(name: &str) -> Option<Hardware> {
        let i = BUILTIN.iter().position(|&b| b == name)?;
        Some(Hardware::parse(BUILTIN_TEXT[i], name).unwrap_or_else(|e| panic!("shipped {e}")))
    }

    /// Why these figures cannot describe a machine, if they cannot.
    pub fn validate(&self) -> Result<(), String> {
        if self.name.trim().is_empty() {
            return Err("`name` is empty".into());
        }
        self.cpu.validate().map_err(|e| format!("[cpu] {e}"))?;
        for (i, d) in self.devices.iter().enumerate() {
            d.validate().map_err(|e| format!("[[device]] {i} ({:?}): {e}", d.name))?;
        }
        Ok(())
    }
}

/// `value` must be finite and positive.
fn positive(key: &str, value: f64) -> Result<(), String> {
    if value.is_finite() && value > 0.0 {
        Ok(())
    } else {
        Err(format!("`{key}` must be positive, got {value}"))
    }
}

/// `value` must be finite and not negative (0 means "none").
fn non_negative(key: &str, value: f64) -> Result<(), String> {
    if value.is_finite() && value >= 0.0 {
        Ok(())
    } else {
        Err(format!("`{key}` must be zero or positive, got {value}"))
    }
}

/// An efficiency: a fraction in (0, `max`].
fn fraction(key: &str, value: f64, max: f64) -> Result<(), String> {
    if value.is_finite() && value > 0.0 && value <= max {
        Ok(())
    } else {
        Err(format!("`{key}` is a fraction in (0, {max}], got {value}"))
    }
}

impl CpuSpec {
    /// All cores of all sockets.
    pub fn cores(&self) -> usize {
        self.sockets * self.cores_per_socket
    }

    fn validate(&self) -> Result<(), String> {
        if self.sockets == 0 || self.cores_per_socket == 0 {
            return Err(format!("a CPU needs cores: {} socket(s) × {} cores", self.sockets, self.cores_per_socket));
        }
        positive("dram_read_gb_per_s", self.dram_read_gb_per_s)?;
        fraction("read_efficiency", self.read_efficiency, 1.0)?;
        positive("core_read_gb_per_s", self.core_read_gb_per_s)?;
        fraction("gemv_efficiency", self.gemv_efficiency, 1.5)?;
        positive("f32_tflops", self.f32_tflops)?;
        positive("bf16_tflops", self.bf16_tflops)?;
        non_negative("amx_bf16_tflops", self.amx_bf16_tflops)?;
        fraction("gemm_efficiency", self.gemm_efficiency, 1.0)?;
        self.gemm_row_fractions.validate()?;
        positive("attention_tflops", self.attention_tflops)?;
        positive("prefill_attention_tflops", self.prefill_attention_tflops)?;
        non_negative("numa_link_gb_per_s", self.numa_link_gb_per_s)?;
        if self.sockets > 1 && self.numa_link_gb_per_s == 0.0 {
            return Err(format!("{} sockets need a `numa_link_gb_per_s`", self.sockets));
        }
        Ok(())
    }
}

impl DeviceSpec {
    fn validate(&self) -> Result<(), String> {
        if self.name.trim().is_empty() {
            return Err("`name` is empty".into());
        }
        positive("memory_gib", self.memory_gib)?;
        positive("f32_tflops", self.f32_tflops)?;
        positive("bf16_tflops", self.bf16_tflops)?;
        non_negative("fp8_tflops", self.fp8_tflops)?;
        positive("memory_gb_per_s", self.memory_gb_per_s)?;
        fraction("gemm_efficiency", self.gemm_efficiency, 1.0)?;
        self.gemm_row_fractions.validate()?;
        fraction("attention_efficiency", self.attention_efficiency, 1.0)?;
        if !(1..=2).contains(&self.copy_engines) {
            return Err(format!("`copy_engines` is 1 or 2, got {}", self.copy_engines));
        }
        fraction("bandwidth_efficiency", self.bandwidth_efficiency, 1.0)?;
        positive("h2d_gb_per_s", self.h2d_gb_per_s)?;
        positive("d2h_gb_per_s", self.d2h_gb_per_s)?;
        fraction("link_efficiency", self.link_efficiency, 1.0)?;
        non_negative("link_latency_us", self.link_latency_us)?;
        non_negative("launch_us", self.launch_us)
    }
}
