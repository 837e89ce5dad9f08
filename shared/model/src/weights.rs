//! Weights by name: every module of a model carries its tensors under the
//! names the forward program asks for, wherever they live (the host mapping,
//! a device ring slot), so no code depends on the order they were listed in.

use crate::checkpoint::{HostTensor, Linear};
use crate::model::ForwardError;
use duplex_kernels::linear::{transpose_rows, OwnedWeight};
use std::sync::{Arc, OnceLock};

/// A module's weights, each under its name within the module (the
/// checkpoint's name without the layer prefix: `q_a_proj`, `kv_a_layernorm`,
/// `shared_experts.up_proj`, …).
#[derive(Clone, Debug)]
pub struct Weights<W> {
    items: Vec<(&'static str, W)>,
}

impl<W> Default for Weights<W> {
    fn default() -> Self {
        Weights { items: vec![] }
    }
}

impl<W> Weights<W> {
    pub fn push(&mut self, name: &'static str, w: W) {
        self.items.push((name, w));
    }

    pub fn with(mut self, name: &'static str, w: W) -> Self {
        self.push(name, w);
        self
    }

    /// The weight called `name`; its absence is an error naming it.
    pub fn get(&self, name: &str) -> Result<&W, ForwardError> {
        self.find(name).ok_or_else(|| ForwardError::MissingWeight(name.to_string()))
    }

    /// The weight called `{prefix}{name}` (without building the name).
    pub fn get_prefixed(&self, prefix: &str, name: &str) -> Result<&W, ForwardError> {
        self.items
            .iter()
            .find(|(n, _)| n.strip_prefix(prefix) == Some(name))
            .map(|(_, w)| w)
            .ok_or_else(|| ForwardError::MissingWeight(format!("{prefix}{name}")))
    }

    pub fn find(&self, name: &str) -> Option<&W> {
        self.items.iter().find(|(n, _)| *n == name).map(|(_, w)| w)
    }

    pub fn iter(&self) -> impl Iterator<Item = (&'static str, &W)> {
        self.items.iter().map(|(n, w)| (*n, w))
    }

    /// The same names over other weights, dropping those `f` gives none for.
    pub fn filter_map<V>(&self, f: impl FnMut(&W) -> Option<V>) -> Weights<V> {
        let mut f = f;
        Weights { items: self.items.iter().filter_map(|(n, w)| f(w).map(|v| (*n, v))).collect() }
    }

    /// The same names over other weights (what a device made of these).
    pub fn try_map<V, E>(&self, mut f: impl FnMut(&W) -> Result<Option<V>, E>) -> Result<Weights<V>, E> {
        let mut out = Weights { items: Vec::with_capacity(self.items.len()) };
        for (n, w) in &self.items {
            if let Some(v) = f(w)? {
                out.items.push((n, v));
            }
        }
        Ok(out)
    }
}

/// A weight as loaded on the host.
#[derive(Clone, Debug)]
pub enum HostWeight {
    /// A matrix in its stored format, in place in the checkpoint's mapping.
    Matrix(Linear),
    /// A norm weight or a bias, in F32.
    Vector(Vec<f32>),
    /// Derived on the host for the CPU's fast paths and never staged: per
    /// head, the transpose of MLA's key band of `kv_b_proj`.
    PerHead(Arc<PerHead>),
}

/// One weight per head, derived on first use or as stored.
///
/// MLA's transposed key bands are made from `kv_b_proj` when a pass (or the
/// hybrid engine's upload) first asks for them, not at load: loading then
/// reads none of `kv_b_proj` (61 layers of it are 1 GB of DeepSeek-R1's
/// mapping, and the bands 0.5 GB of heap), which a hollow checkpoint for
/// the simulator must not touch and a prefill-only model never needs.
#[derive(Debug)]
pub struct PerHead {
    heads: OnceLock<Vec<OwnedWeight>>,
    /// What makes them: `kv_b_proj`, and each head's `(stride, key rows)`.
    key_bands_of: Option<(Linear, usize, usize)>,
}

impl PerHead {
    /// Weights a checkpoint stores per head (a GGUF's `attn_k_b`).
    pub fn stored(heads: Vec<OwnedWeight>) -> Self {
        PerHead { heads: OnceLock::from(heads), key_bands_of: None }
    }

    /// The transposes of `kv_b`'s key bands: rows `h * stride..h * stride +
    /// key_rows` of head `h`, made on first use.
    pub fn key_bands(kv_b: Linear, stride: usize, key_rows: usize) -> Self {
        PerHead { heads: OnceLock::new(), key_bands_of: Some((kv_b, stride, key_rows)) }
    }

    pub fn heads(&self) -> &[OwnedWeight] {
        self.heads.get_or_init(|| {
            let (kv_b, stride, key_rows) = self.key_bands_of.as_ref().expect("stored heads are set at construction");
            let view = kv_b.view();
            (0..kv_b.rows / stride).map(|h| transpose_rows(&view, h * stride..h * stride + key_rows)).collect()
        })
    }
}

impl HostWeight {
    pub fn matrix(&self) -> Option<&Linear> {
        match self {
            HostWeight::Matrix(l) => Some(l),
            _ => None,
        }
    }

    pub fn vector(&self) -> Option<&[f32]> {
        match self {
            HostWeight::Vector(v) => Some(v),
            _ => None,
        }
    }

    /// Bytes a pass over the weight reads.
    pub fn stored_bytes(&self) -> usize {
        match self {
            HostWeight::Matrix(l) => l.stored_bytes(),
            HostWeight::Vector(v) => v.len() * 4,
            HostWeight::PerHead(_) => 0,
        }
    }

    /// What a device copies, or `None` for host-only weights.
    pub fn host_tensor(&self) -> Option<HostTensor> {
        match self {
            HostWeight::Matrix(l) => Some(l.host_tensor()),
            HostWeight::Vector(v) => Some(HostTensor::vector(v)),
            HostWeight::PerHead(_) => None,
        }
    }
}
