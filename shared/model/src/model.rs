//! A model: its configuration, its weights as named modules, and the CPU
//! placement of the forward program.
//!
//! Loading maps each family's Hugging Face tensor names onto the modules the
//! forward program ([`crate::forward`]) runs: `DeepseekV3ForCausalLM`,
//! `Qwen3MoeForCausalLM` and `MixtralForCausalLM` differ here, in their
//! names and in which blocks they have, and in the attention kind their
//! config selects. The CPU engine runs every module with its weights in
//! place in the host mapping; stream-loading prefill ([`crate::staged`])
//! runs the same modules with their weights copied to a device.

use crate::checkpoint::{Checkpoint, CheckpointError};
use crate::backend::Backend;
use crate::config::{AttentionConfig, Architecture, ConfigError, ModelConfig};
use crate::forward::{ModuleKind, Pass};
use crate::kv_cache::{BlockTable, KvError, KvPool};
use crate::moe::{router_params, RouterParams};
use crate::rope::RopeTable;
use crate::weights::{HostWeight, PerHead, Weights};
use duplex_kernels::device::DeviceError;
use duplex_kernels::linear::OwnedWeight;
use duplex_kernels::pool::PoolConfig;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

pub use crate::cpu::CpuRuntime;

pub use duplex_kernels::Precision;

#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    #[error(transparent)]
    Gguf(#[from] duplex_gguf::GgufError),
    /// Metadata overrides that cannot be applied (malformed, or asked of a
    /// model that is not a GGUF).
    #[error("{0}")]
    Overrides(String),
}

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum ForwardError {
    #[error("token id {id} is out of range for a vocabulary of {vocab}")]
    TokenOutOfRange { id: u32, vocab: usize },
    #[error("position {pos} exceeds the model's maximum of {max} positions")]
    TooLong { pos: usize, max: usize },
    #[error("a sequence in the batch has no new tokens")]
    EmptySequence,
    #[error(transparent)]
    Kv(#[from] KvError),
    #[error("the router chose expert {expert} of {experts}")]
    Routing { expert: usize, experts: usize },
    #[error("a module came without its weight {0}")]
    MissingWeight(String),
    /// Modules given out of order, or a weight of the wrong kind: a
    /// placement's bug, not the request's.
    #[error("malformed module: {0}")]
    BadModule(String),
    #[error("workspace: {0}")]
    Workspace(String),
    #[error(transparent)]
    Device(#[from] DeviceError),
}

impl ForwardError {
    /// Whether the request itself is at fault (a bad token, too long a
    /// prompt), as opposed to the engine or the device.
    pub fn is_bad_input(&self) -> bool {
        matches!(self, ForwardError::TokenOutOfRange { .. } | ForwardError::TooLong { .. } | ForwardError::EmptySequence)
    }
}

/// One sequence's part of a batched forward pass: its cache and new tokens.
pub struct SeqInput<'a> {
    pub table: &'a mut BlockTable,
    pub tokens: &'a [u32],
}

/// Where a forward pass spent its time, summed over layers.
#[derive(Clone, Copy, Debug, Default)]
pub struct ForwardTimings {
    pub attention: Duration,
    /// Dense MLPs and MoE layers.
    pub ffn: Duration,
}

/// Which rows of logits a forward pass returns.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Logits {
    /// One row per input token (teacher forcing).
    All,
    /// Only the row of the last token (generation).
    Last,
}

/// One unit of the model as loaded: what it is and its weights by name.
pub struct Module {
    pub kind: ModuleKind,
    pub weights: Weights<HostWeight>,
}

pub struct Model {
    pub cfg: ModelConfig,
    pub cpu: CpuRuntime,
    /// Every module, in the order a forward pass runs them.
    pub modules: Vec<Module>,
    pub(crate) rope: RopeTable,
    pub(crate) router: RouterParams,
    pub(crate) softmax_scale: f32,
    /// Multi-token-prediction tensors present in the checkpoint and ignored.
    pub skipped_mtp_tensors: usize,
}

/// Loading helpers over one checkpoint.
struct Loader<'a> {
    ck: &'a Checkpoint,
}

impl Loader<'_> {
    fn matrix(&self, name: &str, rows: usize, cols: usize) -> Result<HostWeight, CheckpointError> {
        Ok(HostWeight::Matrix(self.ck.linear(name, rows, cols)?))
    }

    fn vector(&self, name: &str, len: usize) -> Result<HostWeight, CheckpointError> {
        Ok(HostWeight::Vector(self.ck.vector(name, &[len])?))
    }

    /// A SwiGLU MLP: the tensors `{prefix}.{names}` (gate, up, down) into
    /// `w` under `roles`.
    fn mlp(&self, w: &mut Weights<HostWeight>, roles: [&'static str; 3], prefix: &str, names: [&str; 3], hidden: usize, inter: usize) -> Result<(), CheckpointError> {
        w.push(roles[0], self.matrix(&format!("{prefix}.{}", names[0]), inter, hidden)?);
        w.push(roles[1], self.matrix(&format!("{prefix}.{}", names[1]), inter, hidden)?);
        w.push(roles[2], self.matrix(&format!("{prefix}.{}", names[2]), hidden, inter)?);
        Ok(())
    }
}

const MLP_ROLES: [&str; 3] = ["gate_proj", "up_proj", "down_proj"];
const SHARED_ROLES: [&str; 3] = ["shared_experts.gate_proj", "shared_experts.up_proj", "shared_experts.down_proj"];
const HF_MLP: [&str; 3] = ["gate_proj", "up_proj", "down_proj"];
/// Mixtral's experts: w1 the gate, w3 the up and w2 the down projection.
const MIXTRAL_EXPERT: [&str; 3] = ["w1", "w3", "w2"];

impl Model {
    /// Load the model at `dir` (config.json plus safetensors, or a GGUF: see
    /// [`ModelSource`](crate::source::ModelSource)). `progress(done, total)`
    /// is called as layers load.
    pub fn load(dir: &Path, progress: &mut dyn FnMut(usize, usize)) -> Result<Self, LoadError> {
        Self::load_with(dir, &PoolConfig::all_cores(), progress)
    }

    /// [`Model::load`] with an explicit worker pool shape.
    pub fn load_with(dir: &Path, pool: &PoolConfig, progress: &mut dyn FnMut(usize, usize)) -> Result<Self, LoadError> {
        Self::load_source(&crate::source::ModelSource::locate(dir)?, pool, progress)
    }

    /// Load the model `source` names (with its metadata overrides).
    pub fn load_source(source: &crate::source::ModelSource, pool: &PoolConfig, progress: &mut dyn FnMut(usize, usize)) -> Result<Self, LoadError> {
        let (cfg, ck) = source.open()?;
        Ok(Self::from_checkpoint(cfg, &ck, CpuRuntime::new(pool), progress)?)
    }

    pub fn from_checkpoint(cfg: ModelConfig, ck: &Checkpoint, cpu: CpuRuntime, progress: &mut dyn FnMut(usize, usize)) -> Result<Self, CheckpointError> {
        let d = cfg.hidden_size;
        let ld = Loader { ck };
        let vocab_rows = |name: &str| -> Result<(), CheckpointError> {
            let (rows, file) = ck.rows_of(name)?;
            if rows != cfg.vocab_size {
                return Err(CheckpointError::VocabMismatch { config: cfg.vocab_size, tensor: name.into(), file, rows });
            }
            Ok(())
        };
        vocab_rows("model.embed_tokens.weight")?;
        let embed = ld.matrix("model.embed_tokens", cfg.vocab_size, d)?;
        let lm_head = if ck.contains("lm_head.weight") || !cfg.tie_word_embeddings {
            vocab_rows("lm_head.weight")?;
            ld.matrix("lm_head", cfg.vocab_size, d)?
        } else {
            embed.clone()
        };
        let mut modules = vec![Module { kind: ModuleKind::Embed { first_row: 0 }, weights: Weights::default().with("embed_tokens", embed) }];
        let total = cfg.num_hidden_layers;
        for l in 0..total {
            progress(l, total);
            Self::load_layer(&cfg, &ld, l, &mut modules)?;
        }
        progress(total, total);
        let head = Weights::default().with("lm_head", lm_head).with("norm", ld.vector("model.norm.weight", d)?);
        modules.push(Module { kind: ModuleKind::Head { first_row: 0 }, weights: head });
        let skipped_mtp_tensors = ck
            .tensor_names()
            .filter(|n| {
                n.strip_prefix("model.layers.")
                    .and_then(|r| r.split('.').next())
                    .and_then(|i| i.parse::<usize>().ok())
                    .is_some_and(|i| i >= cfg.num_hidden_layers)
            })
            .count();
        Ok(Model {
            cpu,
            modules,
            rope: RopeTable::new(&cfg),
            router: router_params(&cfg),
            softmax_scale: cfg.softmax_scale(),
            skipped_mtp_tensors,
            cfg,
        })
    }

    /// Layer `l`'s modules: attention, the FFN and (MoE) each routed expert.
    fn load_layer(cfg: &ModelConfig, ld: &Loader, l: usize, modules: &mut Vec<Module>) -> Result<(), CheckpointError> {
        let (d, h) = (cfg.hidden_size, cfg.num_attention_heads);
        let p = format!("model.layers.{l}");
        let a = format!("{p}.self_attn");
        let mut w = Weights::default();
        w.push("input_layernorm", ld.vector(&format!("{p}.input_layernorm.weight"), d)?);
        match &cfg.attention {
            AttentionConfig::Mla(m) => {
                match m.q_lora_rank {
                    Some(r) => {
                        w.push("q_a_proj", ld.matrix(&format!("{a}.q_a_proj"), r, d)?);
                        w.push("q_a_layernorm", ld.vector(&format!("{a}.q_a_layernorm.weight"), r)?);
                        w.push("q_b_proj", ld.matrix(&format!("{a}.q_b_proj"), h * cfg.qk_head_dim(), r)?);
                    }
                    None => w.push("q_proj", ld.matrix(&format!("{a}.q_proj"), h * cfg.qk_head_dim(), d)?),
                }
                w.push("kv_a_proj_with_mqa", ld.matrix(&format!("{a}.kv_a_proj_with_mqa"), cfg.kv_entry_dim(), d)?);
                w.push("kv_a_layernorm", ld.vector(&format!("{a}.kv_a_layernorm.weight"), m.kv_lora_rank)?);
                let dkv = m.qk_nope_head_dim + m.v_head_dim;
                let kv_b = ld.ck.linear(&format!("{a}.kv_b_proj"), h * dkv, m.kv_lora_rank)?;
                // Per head, the transpose of its key band (`[kv_lora, nope]`):
                // the absorbed query `W_k^T q_nope` is then an ordinary GEMV.
                let k_b = format!("{a}.k_b_proj");
                let key_t = if ld.ck.contains(&format!("{k_b}.weight")) {
                    // A GGUF stores these transposes itself (`attn_k_b`), in
                    // its own format: decode reads them as stored, and the
                    // values from `attn_v_b`, as llama.cpp does.
                    let k_b = ld.ck.linear(&k_b, h * m.kv_lora_rank, m.qk_nope_head_dim)?;
                    let (view, rows) = (k_b.view(), m.kv_lora_rank);
                    let per_head = view.format.row_bytes(view.cols) * rows;
                    w.push("v_b_proj", ld.matrix(&format!("{a}.v_b_proj"), h * m.v_head_dim, m.kv_lora_rank)?);
                    PerHead::stored((0..h).map(|head| OwnedWeight { rows, cols: view.cols, format: view.format, data: view.data[head * per_head..(head + 1) * per_head].to_vec(), scales: vec![] }).collect())
                } else {
                    PerHead::key_bands(kv_b.clone(), dkv, m.qk_nope_head_dim)
                };
                w.push("kv_b_proj", HostWeight::Matrix(kv_b));
                w.push("kv_b_proj.key_t", HostWeight::PerHead(Arc::new(key_t)));
                w.push("o_proj", ld.matrix(&format!("{a}.o_proj"), d, h * m.v_head_dim)?);
            }
            AttentionConfig::Gqa(g) => {
                let kv = g.num_key_value_heads * g.head_dim;
                w.push("q_proj", ld.matrix(&format!("{a}.q_proj"), h * g.head_dim, d)?);
                w.push("k_proj", ld.matrix(&format!("{a}.k_proj"), kv, d)?);
                w.push("v_proj", ld.matrix(&format!("{a}.v_proj"), kv, d)?);
                if g.qk_norm {
                    w.push("q_norm", ld.vector(&format!("{a}.q_norm.weight"), g.head_dim)?);
                    w.push("k_norm", ld.vector(&format!("{a}.k_norm.weight"), g.head_dim)?);
                }
                w.push("o_proj", ld.matrix(&format!("{a}.o_proj"), d, h * g.head_dim)?);
            }
        }
        modules.push(Module { kind: ModuleKind::Attention { layer: l }, weights: w });

        // The FFN's norm belongs to the FFN module: a placement that frees
        // the attention weights before the FFN runs still has it.
        let mut w = Weights::default();
        w.push("post_attention_layernorm", ld.vector(&format!("{p}.post_attention_layernorm.weight"), d)?);
        if !cfg.is_moe_layer(l) {
            ld.mlp(&mut w, MLP_ROLES, &format!("{p}.mlp"), HF_MLP, d, cfg.intermediate_size)?;
            modules.push(Module { kind: ModuleKind::Ffn { layer: l }, weights: w });
            return Ok(());
        }
        let (m, expert_names) = match cfg.architecture {
            Architecture::Mixtral => (format!("{p}.block_sparse_moe"), MIXTRAL_EXPERT),
            Architecture::DeepseekV3 | Architecture::Qwen3Moe => (format!("{p}.mlp"), HF_MLP),
        };
        let e = cfg.n_routed_experts;
        w.push("gate", ld.matrix(&format!("{m}.gate"), e, d)?);
        if cfg.use_correction_bias {
            w.push("e_score_correction_bias", ld.vector(&format!("{m}.gate.e_score_correction_bias"), e)?);
        }
        if cfg.n_shared_experts > 0 {
            ld.mlp(&mut w, SHARED_ROLES, &format!("{m}.shared_experts"), HF_MLP, d, cfg.moe_intermediate_size * cfg.n_shared_experts)?;
        }
        modules.push(Module { kind: ModuleKind::Ffn { layer: l }, weights: w });
        for i in 0..e {
            let mut w = Weights::default();
            ld.mlp(&mut w, MLP_ROLES, &format!("{m}.experts.{i}"), expert_names, d, cfg.moe_intermediate_size)?;
            modules.push(Module { kind: ModuleKind::Expert { layer: l, expert: i }, weights: w });
        }
        Ok(())
    }

    /// Why no device can run this model, if one cannot: the first weight in
    /// a GGUF block format (no device kernel reads ggml's blocks), named.
    pub fn device_refusal(&self) -> Option<String> {
        self.modules.iter().find_map(|m| {
            m.weights.iter().find_map(|(name, w)| match w.matrix().map(|l| l.format) {
                Some(duplex_kernels::WeightFormat::Quant(kind)) => Some(format!(
                    "{name} of {:?} is {kind}: GGUF block-quantized weights have no device kernels yet, so this model runs on the CPU (device = \"cpu\")",
                    m.kind
                )),
                _ => None,
            })
        })
    }

    /// Bytes of weights one decode step reads for one token: every non-expert
    /// weight (attention, dense MLPs, norms, router, shared experts), one
    /// embedding row, the LM head and `num_experts_per_tok` routed experts per
    /// MoE layer (FP8 scales included). Divided into the measured read
    /// bandwidth, it gives the decode roofline.
    pub fn activated_bytes_per_token(&self) -> usize {
        let bytes = |m: &Module| {
            // A GGUF's MLA decode reads its own key and value halves
            // (`kv_b_proj.key_t` as stored, `v_b_proj`), not kv_b_proj,
            // which only prefill reads.
            let gguf_halves = m.weights.find("v_b_proj").is_some();
            m.weights
                .iter()
                .map(|(name, w)| match w {
                    HostWeight::PerHead(heads) if gguf_halves => heads.heads().iter().map(|h| h.data.len()).sum(),
                    _ if gguf_halves && name == "kv_b_proj" => 0,
                    _ => w.stored_bytes(),
                })
                .sum::<usize>()
        };
        self.modules
            .iter()
            .map(|m| match m.kind {
                ModuleKind::Embed { .. } => bytes(m) / self.cfg.vocab_size,
                ModuleKind::Expert { expert: 0, .. } => bytes(m) * self.cfg.num_experts_per_tok,
                ModuleKind::Expert { .. } => 0,
                _ => bytes(m),
            })
            .sum()
    }

    /// A KV pool shaped for this model.
    pub fn new_kv_pool(&self, n_blocks: usize, block_size: usize) -> KvPool {
        KvPool::new(n_blocks, block_size, self.cfg.num_hidden_layers, self.cfg.kv_entry_dim())
    }

    /// Run `tokens` as the continuation of the sequence whose cache is
    /// `table`, append them to the cache, and return logits (`[rows, vocab]`).
    pub fn forward(
        &self,
        pool: &mut KvPool,
        table: &mut BlockTable,
        tokens: &[u32],
        precision: Precision,
        want: Logits,
    ) -> Result<Vec<f32>, ForwardError> {
        if tokens.is_empty() {
            return Ok(vec![]);
        }
        self.forward_batch(pool, &mut [SeqInput { table, tokens }], precision, want, &mut ForwardTimings::default())
    }

    /// Run the new tokens of several sequences as one batch, as continuous
    /// batching does: every weight is read once for all rows, and only
    /// attention is computed per sequence, over its own blocks. Returns the
    /// logits rows of every token (`Logits::All`) or of each sequence's last
    /// token (`Logits::Last`), in order. Adds the time spent in attention and
    /// in the MLP/MoE to `timings`.
    pub fn forward_batch(
        &self,
        pool: &mut KvPool,
        seqs: &mut [SeqInput],
        precision: Precision,
        want: Logits,
        timings: &mut ForwardTimings,
    ) -> Result<Vec<f32>, ForwardError> {
        self.forward_batch_deferred(pool, seqs, precision, want, timings, 0)
    }

    /// The routed experts of one layer, `(index, weights)`, that start at
    /// module `first` and follow one another in [`Model::modules`].
    pub(crate) fn expert_group(&self, first: usize) -> Vec<(usize, &Weights<HostWeight>)> {
        let layer = self.modules.get(first).and_then(|m| m.kind.layer());
        self.modules[first.min(self.modules.len())..]
            .iter()
            .map_while(|x| match x.kind {
                ModuleKind::Expert { layer: l, expert } if Some(l) == layer => Some((expert, &x.weights)),
                _ => None,
            })
            .collect()
    }

    /// [`Model::forward_batch`] with Expert Deferral of `defer` experts per
    /// token ([`Pass::defer_experts`]): the CPU runs them right after the
    /// others (it has nothing to overlap them with), which gives the maths
    /// a hybrid placement overlaps.
    pub fn forward_batch_deferred(
        &self,
        pool: &mut KvPool,
        seqs: &mut [SeqInput],
        precision: Precision,
        want: Logits,
        timings: &mut ForwardTimings,
        defer: usize,
    ) -> Result<Vec<f32>, ForwardError> {
        self.forward_batch_on(self.cpu.backend(), pool, seqs, precision, want, timings, defer)
    }

    /// The CPU placement's program ([`Model::forward_batch_deferred`]) over
    /// any backend that reads the host's weights as they are: the CPU's own,
    /// or a simulated CPU that times the same ops instead of running them.
    #[allow(clippy::too_many_arguments)]
    pub fn forward_batch_on<B: Backend<Weight = HostWeight>>(
        &self,
        backend: B,
        pool: &mut KvPool,
        seqs: &mut [SeqInput],
        precision: Precision,
        want: Logits,
        timings: &mut ForwardTimings,
        defer: usize,
    ) -> Result<Vec<f32>, ForwardError> {
        // The CPU attends one-token steps in the absorbed form, and expands
        // the whole context's keys and values at once for longer chunks.
        let mut pass = Pass::new(self, backend, pool, seqs, precision, want, usize::MAX)?;
        pass.defer_experts(defer);
        pass.shared_experts_with_routed();
        let mut i = 0;
        // The FFN module before a layer's experts: it holds the shared experts.
        let mut ffn = None;
        while i < self.modules.len() {
            let m = &self.modules[i];
            match m.kind {
                // A layer's experts run together (the shared ones too), in
                // one parallel region.
                ModuleKind::Expert { layer, .. } => {
                    let group = self.expert_group(i);
                    i += group.len();
                    pass.run_layer_experts(layer, &group, ffn.take())?;
                    pass.run_deferred(&group)?;
                }
                kind => {
                    if let ModuleKind::Ffn { .. } = kind {
                        ffn = Some(&m.weights);
                    }
                    pass.run(kind, &m.weights, pool)?;
                    i += 1;
                }
            }
        }
        let mut tables: Vec<&mut BlockTable> = seqs.iter_mut().map(|s| &mut *s.table).collect();
        let (logits, _, spent) = pass.finish(&mut tables)?;
        timings.attention += spent.attention;
        timings.ffn += spent.ffn;
        Ok(logits)
    }
}
