//! Weights by name: every module of a model carries its tensors under the
//! names the forward program asks for, wherever they live (the host mapping,
//! a device ring slot), so no code depends on the order they were listed in.

use crate::checkpoint::{HostTensor, Linear};
use crate::model::ForwardError;
use duplex_kernels::linear::OwnedWeight;

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
    PerHead(Vec<OwnedWeight>),
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
