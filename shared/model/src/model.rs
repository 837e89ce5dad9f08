//! The DeepSeek-V3 transformer: weights and the forward pass.
//!
//! Mirrors transformers' `DeepseekV3ForCausalLM`: embedding, then per layer
//! RMSNorm → MLA attention → residual → RMSNorm → dense MLP or MoE → residual,
//! then the final norm and the LM head. Attention reads and writes the paged
//! latent cache; a one-token step (decode) uses the absorbed form, longer
//! chunks (prefill) the expanded form.

use crate::checkpoint::{Checkpoint, CheckpointError, Linear};
use crate::config::{ConfigError, ModelConfig};
use crate::kv_cache::{BlockTable, KvError, KvPool};
use crate::moe::{route, route_simd, router_params, RouterParams};
use crate::rope::RopeTable;
use duplex_kernels::cpu::{convert::f32_to_bf16, elementwise as simd, gemv::matmul_bf16, isa::Isa, vector::dot_bf16_f32};
use duplex_kernels::elementwise::{rms_norm, rope, silu_mul, softmax};
use duplex_kernels::linear::{dot, matmul, matmul_rows, matmul_t_rows, transpose_rows, OwnedWeight};
use duplex_kernels::mla::{decode_attention, prefill_attention, LatentCache, MlaDims};
use duplex_kernels::moe::{moe_forward, ExpertCall, ExpertWeights, MoeScratch};
use duplex_kernels::parallel_linear::{par_matmul, LinearScratch};
use duplex_kernels::pool::{PoolConfig, ThreadPool};
use duplex_kernels::shared::SharedSlice;
use duplex_kernels::WeightFormat;
use std::path::Path;
use std::sync::Mutex;
use std::time::{Duration, Instant};

pub use duplex_kernels::Precision;

#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
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

/// A sequence's rows within a batch.
struct Segment<'a> {
    table: &'a BlockTable,
    /// Position of its first new token.
    start: usize,
    n: usize,
    /// Index of its first row in the batch.
    row: usize,
}

/// Which rows of logits a forward pass returns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Logits {
    /// One row per input token (teacher forcing).
    All,
    /// Only the row of the last token (generation).
    Last,
}

pub(crate) enum QProj {
    Lora { a: Linear, norm: Vec<f32>, b: Linear },
    Plain(Linear),
}

pub(crate) struct Attention {
    pub(crate) q: QProj,
    pub(crate) kv_a: Linear,
    pub(crate) kv_a_norm: Vec<f32>,
    pub(crate) kv_b: Linear,
    /// Per head, the transpose of its key band of `kv_b` (`[kv_lora, nope]`):
    /// the absorbed query `W_k^T q_nope` is then an ordinary GEMV.
    pub(crate) kv_b_key_t: Vec<OwnedWeight>,
    pub(crate) o: Linear,
}

pub(crate) struct Mlp {
    pub(crate) gate: Linear,
    pub(crate) up: Linear,
    pub(crate) down: Linear,
}

pub(crate) struct Moe {
    pub(crate) router: Linear,
    pub(crate) correction_bias: Option<Vec<f32>>,
    pub(crate) experts: Vec<Mlp>,
    pub(crate) shared: Option<Mlp>,
}

pub(crate) enum Ffn {
    Dense(Mlp),
    Moe(Moe),
}

pub(crate) struct Layer {
    pub(crate) input_norm: Vec<f32>,
    pub(crate) post_attention_norm: Vec<f32>,
    pub(crate) attn: Attention,
    pub(crate) ffn: Ffn,
}

/// Where the BF16 path computes: the worker pool, the SIMD level, and
/// buffers reused across forward passes.
pub struct CpuRuntime {
    pub pool: ThreadPool,
    pub isa: Isa,
    scratch: Mutex<Scratch>,
}

#[derive(Default)]
struct Scratch {
    linear: LinearScratch,
    moe: MoeScratch,
    attention: Vec<f32>,
}

impl CpuRuntime {
    pub fn new(config: &PoolConfig) -> Self {
        CpuRuntime { pool: ThreadPool::new(config), isa: duplex_kernels::cpu::isa::detect(), scratch: Mutex::default() }
    }

    fn scratch(&self) -> std::sync::MutexGuard<'_, Scratch> {
        self.scratch.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A linear layer at precision `p`: the F32 reference in scalar code, the
    /// BF16 path with SIMD kernels on the pool.
    fn linear(&self, w: &Linear, x: &[f32], n: usize, p: Precision) -> Vec<f32> {
        let mut out = vec![0.0; n * w.rows];
        match p {
            Precision::F32 => matmul(&w.view(), x, n, &mut out),
            Precision::Bf16 => {
                par_matmul(&self.pool, self.isa, &w.view(), x, n, &mut out, &mut self.scratch().linear);
                p.round(&mut out);
            }
        }
        out
    }
}

pub struct Model {
    pub cfg: ModelConfig,
    pub cpu: CpuRuntime,
    pub(crate) embed: Linear,
    pub(crate) layers: Vec<Layer>,
    pub(crate) norm: Vec<f32>,
    pub(crate) lm_head: Linear,
    pub(crate) rope: RopeTable,
    pub(crate) router: RouterParams,
    pub(crate) softmax_scale: f32,
    /// Multi-token-prediction tensors present in the checkpoint and ignored.
    pub skipped_mtp_tensors: usize,
}

/// RMSNorm of every row: the scalar reference for F32; on the BF16 path the
/// SIMD kernel at `isa`, which rounds to BF16 in the same pass.
fn norm_rows(isa: Isa, x: &[f32], weight: &[f32], eps: f32, p: Precision) -> Vec<f32> {
    let d = weight.len();
    let mut out = vec![0.0; x.len()];
    match p {
        Precision::F32 => {
            for (o, xi) in out.chunks_mut(d).zip(x.chunks(d)) {
                rms_norm(xi, weight, eps, o);
            }
        }
        Precision::Bf16 => {
            for (o, xi) in out.chunks_mut(d).zip(x.chunks(d)) {
                simd::rms_norm_bf16(isa, xi, weight, eps, o);
            }
        }
    }
    out
}

fn add_residual(h: &mut [f32], delta: &[f32], p: Precision) {
    h.iter_mut().zip(delta).for_each(|(a, b)| *a += b);
    p.round(h);
}

impl Mlp {
    fn load(ck: &Checkpoint, prefix: &str, hidden: usize, inter: usize) -> Result<Self, CheckpointError> {
        Ok(Mlp {
            gate: ck.linear(&format!("{prefix}.gate_proj"), inter, hidden)?,
            up: ck.linear(&format!("{prefix}.up_proj"), inter, hidden)?,
            down: ck.linear(&format!("{prefix}.down_proj"), hidden, inter)?,
        })
    }

    fn weights(&self) -> ExpertWeights<'_> {
        ExpertWeights { gate: self.gate.view(), up: self.up.view(), down: self.down.view() }
    }

    /// The F32 reference: three plain matrix products.
    fn forward_f32(&self, x: &[f32], n: usize) -> Vec<f32> {
        let mut g = vec![0.0; n * self.gate.rows];
        let mut u = vec![0.0; n * self.up.rows];
        let mut y = vec![0.0; n * self.down.rows];
        matmul(&self.gate.view(), x, n, &mut g);
        matmul(&self.up.view(), x, n, &mut u);
        silu_mul(&mut g, &u);
        matmul(&self.down.view(), &g, n, &mut y);
        y
    }

    fn forward(&self, cpu: &CpuRuntime, x: &[f32], n: usize, p: Precision) -> Vec<f32> {
        match p {
            Precision::F32 => self.forward_f32(x, n),
            Precision::Bf16 => {
                let tokens: Vec<(usize, f32)> = (0..n).map(|t| (t, 1.0)).collect();
                run_experts(cpu, &[ExpertCall { weights: self.weights(), tokens: &tokens, node: 0 }], x, self.down.rows)
            }
        }
    }
}

/// The BF16 expert path: fine-grained parallel experts on the pool, then
/// one rounding of the combined output.
fn run_experts(cpu: &CpuRuntime, calls: &[ExpertCall], x: &[f32], d: usize) -> Vec<f32> {
    let mut out = vec![0.0; x.len()];
    moe_forward(&cpu.pool, cpu.isa, calls, x, d, &mut out, &mut cpu.scratch().moe);
    duplex_kernels::round_bf16_slice(&mut out);
    out
}

impl Moe {
    /// Router logits in F32, as transformers computes them. The BF16 path
    /// takes SIMD dot products for BF16 router weights (exact F32 products,
    /// only the summation order differs); the F32 path keeps the reference.
    fn router_logits(&self, cpu: &CpuRuntime, x: &[f32], n: usize, p: Precision) -> Vec<f32> {
        let w = self.router.view();
        let mut logits = vec![0.0; n * w.rows];
        if p == Precision::Bf16 && w.format == WeightFormat::Bf16 {
            // Spread over the pool by experts: the router's weights (3.7 MB
            // for V3) are streamed once per layer like any other matrix.
            const EXPERTS_PER_TASK: usize = 16;
            let out = SharedSlice::new(&mut logits);
            cpu.pool.parallel_for(w.rows.div_ceil(EXPERTS_PER_TASK), &|task| {
                let experts = task * EXPERTS_PER_TASK..((task + 1) * EXPERTS_PER_TASK).min(w.rows);
                for (i, xi) in x.chunks_exact(w.cols).enumerate() {
                    // SAFETY: the logits of these experts are written by this task only.
                    let out = unsafe { out.slice_mut(i * w.rows + experts.start, experts.len()) };
                    for (r, o) in experts.clone().zip(out) {
                        *o = dot_bf16_f32(cpu.isa, &w.data[2 * r * w.cols..2 * (r + 1) * w.cols], xi);
                    }
                }
            });
        } else {
            matmul(&w, x, n, &mut logits);
        }
        logits
    }

    fn forward(&self, cpu: &CpuRuntime, x: &[f32], n: usize, d: usize, router: &RouterParams, p: Precision) -> Vec<f32> {
        let logits = self.router_logits(cpu, x, n, p);
        let mut assigned: Vec<Vec<(usize, f32)>> = vec![vec![]; self.experts.len()];
        for i in 0..n {
            let row = &logits[i * router.n_experts..(i + 1) * router.n_experts];
            let bias = self.correction_bias.as_deref();
            let chosen = match p {
                Precision::F32 => route(router, row, bias),
                Precision::Bf16 => route_simd(cpu.isa, router, row, bias),
            };
            for (e, w) in chosen {
                assigned[e].push((i, w));
            }
        }
        if p == Precision::Bf16 {
            let all: Vec<(usize, f32)> = (0..n).map(|t| (t, 1.0)).collect();
            let nodes = cpu.pool.nodes();
            let mut calls: Vec<ExpertCall> = self
                .experts
                .iter()
                .zip(&assigned)
                .enumerate()
                .filter(|(_, (_, tokens))| !tokens.is_empty())
                .map(|(e, (mlp, tokens))| ExpertCall { weights: mlp.weights(), tokens, node: e % nodes })
                .collect();
            if let Some(shared) = &self.shared {
                calls.push(ExpertCall { weights: shared.weights(), tokens: &all, node: 0 });
            }
            return run_experts(cpu, &calls, x, d);
        }
        let mut out = match &self.shared {
            Some(shared) => shared.forward_f32(x, n),
            None => vec![0.0; n * d],
        };
        for (expert, tokens) in self.experts.iter().zip(&assigned) {
            if tokens.is_empty() {
                continue;
            }
            let xs: Vec<f32> = tokens.iter().flat_map(|&(i, _)| x[i * d..(i + 1) * d].iter().copied()).collect();
            let ys = expert.forward_f32(&xs, tokens.len());
            for (&(i, w), y) in tokens.iter().zip(ys.chunks(d)) {
                out[i * d..(i + 1) * d].iter_mut().zip(y).for_each(|(o, v)| *o += w * v);
            }
        }
        out
    }
}

impl Model {
    /// Load `dir` (config.json plus safetensors). `progress(done, total)` is
    /// called as layers load.
    pub fn load(dir: &Path, progress: &mut dyn FnMut(usize, usize)) -> Result<Self, LoadError> {
        Self::load_with(dir, &PoolConfig::all_cores(), progress)
    }

    /// [`Model::load`] with an explicit worker pool shape.
    pub fn load_with(dir: &Path, pool: &PoolConfig, progress: &mut dyn FnMut(usize, usize)) -> Result<Self, LoadError> {
        let cfg = ModelConfig::from_file(&dir.join("config.json"))?;
        let ck = Checkpoint::open(dir, cfg.quantization.as_ref().map(|q| q.weight_block_size))?;
        Ok(Self::from_checkpoint(cfg, &ck, CpuRuntime::new(pool), progress)?)
    }

    pub fn from_checkpoint(cfg: ModelConfig, ck: &Checkpoint, cpu: CpuRuntime, progress: &mut dyn FnMut(usize, usize)) -> Result<Self, CheckpointError> {
        let d = cfg.hidden_size;
        let (vocab_rows, file) = ck.rows_of("model.embed_tokens.weight")?;
        if vocab_rows != cfg.vocab_size {
            return Err(CheckpointError::VocabMismatch { config: cfg.vocab_size, tensor: "model.embed_tokens.weight".into(), file, rows: vocab_rows });
        }
        let embed = ck.linear("model.embed_tokens", cfg.vocab_size, d)?;
        let lm_head = if ck.contains("lm_head.weight") || !cfg.tie_word_embeddings {
            let (rows, file) = ck.rows_of("lm_head.weight")?;
            if rows != cfg.vocab_size {
                return Err(CheckpointError::VocabMismatch { config: cfg.vocab_size, tensor: "lm_head.weight".into(), file, rows });
            }
            ck.linear("lm_head", cfg.vocab_size, d)?
        } else {
            embed.clone()
        };
        let total = cfg.num_hidden_layers;
        let mut layers = Vec::with_capacity(total);
        for l in 0..total {
            progress(l, total);
            layers.push(Self::load_layer(&cfg, ck, l)?);
        }
        progress(total, total);
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
            norm: ck.vector("model.norm.weight", &[d])?,
            embed,
            lm_head,
            layers,
            rope: RopeTable::new(&cfg),
            router: router_params(&cfg),
            softmax_scale: cfg.softmax_scale(),
            skipped_mtp_tensors,
            cfg,
        })
    }

    fn load_layer(cfg: &ModelConfig, ck: &Checkpoint, l: usize) -> Result<Layer, CheckpointError> {
        let d = cfg.hidden_size;
        let h = cfg.num_attention_heads;
        let p = format!("model.layers.{l}");
        let a = format!("{p}.self_attn");
        let q = match cfg.q_lora_rank {
            Some(r) => QProj::Lora {
                a: ck.linear(&format!("{a}.q_a_proj"), r, d)?,
                norm: ck.vector(&format!("{a}.q_a_layernorm.weight"), &[r])?,
                b: ck.linear(&format!("{a}.q_b_proj"), h * cfg.qk_head_dim(), r)?,
            },
            None => QProj::Plain(ck.linear(&format!("{a}.q_proj"), h * cfg.qk_head_dim(), d)?),
        };
        let dkv = cfg.qk_nope_head_dim + cfg.v_head_dim;
        let kv_b = ck.linear(&format!("{a}.kv_b_proj"), h * dkv, cfg.kv_lora_rank)?;
        let kv_b_key_t = (0..h).map(|head| transpose_rows(&kv_b.view(), head * dkv..head * dkv + cfg.qk_nope_head_dim)).collect();
        let attn = Attention {
            q,
            kv_a: ck.linear(&format!("{a}.kv_a_proj_with_mqa"), cfg.kv_entry_dim(), d)?,
            kv_a_norm: ck.vector(&format!("{a}.kv_a_layernorm.weight"), &[cfg.kv_lora_rank])?,
            kv_b,
            kv_b_key_t,
            o: ck.linear(&format!("{a}.o_proj"), d, h * cfg.v_head_dim)?,
        };
        let ffn = if cfg.is_moe_layer(l) {
            let m = format!("{p}.mlp");
            let e = cfg.n_routed_experts;
            let bias_name = format!("{m}.gate.e_score_correction_bias");
            Ffn::Moe(Moe {
                router: ck.linear(&format!("{m}.gate"), e, d)?,
                correction_bias: if cfg.use_correction_bias { Some(ck.vector(&bias_name, &[e])?) } else { None },
                experts: (0..e)
                    .map(|i| Mlp::load(ck, &format!("{m}.experts.{i}"), d, cfg.moe_intermediate_size))
                    .collect::<Result<_, _>>()?,
                shared: if cfg.n_shared_experts > 0 {
                    Some(Mlp::load(ck, &format!("{m}.shared_experts"), d, cfg.moe_intermediate_size * cfg.n_shared_experts)?)
                } else {
                    None
                },
            })
        } else {
            Ffn::Dense(Mlp::load(ck, &format!("{p}.mlp"), d, cfg.intermediate_size)?)
        };
        Ok(Layer {
            input_norm: ck.vector(&format!("{p}.input_layernorm.weight"), &[d])?,
            post_attention_norm: ck.vector(&format!("{p}.post_attention_layernorm.weight"), &[d])?,
            attn,
            ffn,
        })
    }

    /// Bytes of weights one decode step reads for one token: every non-expert
    /// weight (attention, dense MLPs, norms, router), one embedding row, the
    /// LM head, the shared experts and `num_experts_per_tok` routed experts
    /// per MoE layer (FP8 scales included). Divided into the measured read
    /// bandwidth, it gives the decode roofline.
    pub fn activated_bytes_per_token(&self) -> usize {
        let mlp = |m: &Mlp| m.gate.stored_bytes() + m.up.stored_bytes() + m.down.stored_bytes();
        let mut total = self.embed.stored_bytes() / self.cfg.vocab_size + self.lm_head.stored_bytes() + self.norm.len() * 4;
        for layer in &self.layers {
            let a = &layer.attn;
            total += match &a.q {
                QProj::Lora { a, norm, b } => a.stored_bytes() + norm.len() * 4 + b.stored_bytes(),
                QProj::Plain(w) => w.stored_bytes(),
            };
            total += a.kv_a.stored_bytes() + a.kv_a_norm.len() * 4 + a.kv_b.stored_bytes() + a.o.stored_bytes();
            total += (layer.input_norm.len() + layer.post_attention_norm.len()) * 4;
            total += match &layer.ffn {
                Ffn::Dense(m) => mlp(m),
                Ffn::Moe(moe) => {
                    let routed = moe.experts.first().map(mlp).unwrap_or(0) * self.cfg.num_experts_per_tok;
                    moe.router.stored_bytes() + moe.shared.as_ref().map(mlp).unwrap_or(0) + routed
                }
            };
        }
        total
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
        let cfg = &self.cfg;
        let d = cfg.hidden_size;
        for seq in seqs.iter_mut() {
            if seq.tokens.is_empty() {
                return Err(ForwardError::EmptySequence);
            }
            if let Some(&id) = seq.tokens.iter().find(|&&t| t as usize >= cfg.vocab_size) {
                return Err(ForwardError::TokenOutOfRange { id, vocab: cfg.vocab_size });
            }
            let end = seq.table.len + seq.tokens.len();
            if end > cfg.max_position_embeddings {
                return Err(ForwardError::TooLong { pos: end, max: cfg.max_position_embeddings });
            }
            pool.reserve(seq.table, end)?;
        }
        let mut segments = Vec::with_capacity(seqs.len());
        let mut rows = 0;
        for seq in seqs.iter() {
            segments.push(Segment { table: &*seq.table, start: seq.table.len, n: seq.tokens.len(), row: rows });
            rows += seq.tokens.len();
        }

        let mut h = vec![0.0f32; rows * d];
        for (row, &t) in h.chunks_mut(d).zip(seqs.iter().flat_map(|s| s.tokens)) {
            self.embed.view().decode_row(t as usize, row);
        }
        precision.round(&mut h);
        for (l, layer) in self.layers.iter().enumerate() {
            let started = Instant::now();
            let x = norm_rows(self.cpu.isa, &h, &layer.input_norm, cfg.rms_norm_eps, precision);
            let a = self.attention(&layer.attn, l, &x, pool, &segments, precision);
            add_residual(&mut h, &a, precision);
            let attention_done = Instant::now();
            let x = norm_rows(self.cpu.isa, &h, &layer.post_attention_norm, cfg.rms_norm_eps, precision);
            let f = match &layer.ffn {
                Ffn::Dense(mlp) => mlp.forward(&self.cpu, &x, rows, precision),
                Ffn::Moe(moe) => moe.forward(&self.cpu, &x, rows, d, &self.router, precision),
            };
            add_residual(&mut h, &f, precision);
            timings.attention += attention_done - started;
            timings.ffn += attention_done.elapsed();
        }
        let last_rows: Vec<usize> = segments.iter().map(|s| s.row + s.n - 1).collect();
        drop(segments);
        for seq in seqs.iter_mut() {
            seq.table.len += seq.tokens.len();
        }

        let out_rows: Vec<f32> = match want {
            Logits::All => h,
            Logits::Last => last_rows.iter().flat_map(|&r| h[r * d..(r + 1) * d].iter().copied()).collect(),
        };
        let x = norm_rows(self.cpu.isa, &out_rows, &self.norm, cfg.rms_norm_eps, precision);
        let mut logits = vec![0.0; (x.len() / d) * cfg.vocab_size];
        match precision {
            Precision::F32 => matmul(&self.lm_head.view(), &x, x.len() / d, &mut logits),
            // Logits stay F32: the sampler and logprobs want the accumulated values.
            Precision::Bf16 => par_matmul(&self.cpu.pool, self.cpu.isa, &self.lm_head.view(), &x, x.len() / d, &mut logits, &mut self.cpu.scratch().linear),
        }
        Ok(logits)
    }

    /// MLA for `x` (`[rows, hidden]`, the rows of `segments` one after the
    /// other): write the new latents to each sequence's cache, attend
    /// causally within each sequence, project out.
    fn attention(&self, at: &Attention, layer: usize, x: &[f32], pool: &mut KvPool, segments: &[Segment], p: Precision) -> Vec<f32> {
        let cfg = &self.cfg;
        let n = x.len() / cfg.hidden_size;
        let (heads, dn, dr, dv, dc) = (cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank);
        let dq = dn + dr;

        let mut q = match &at.q {
            QProj::Lora { a, norm, b } => {
                let qa = self.cpu.linear(a, x, n, p);
                let qa = norm_rows(self.cpu.isa, &qa, norm, cfg.rms_norm_eps, p);
                self.cpu.linear(b, &qa, n, p)
            }
            QProj::Plain(w) => self.cpu.linear(w, x, n, p),
        };
        let kv = self.cpu.linear(&at.kv_a, x, n, p);
        let (mut cos, mut sin) = (vec![0.0; dr / 2], vec![0.0; dr / 2]);
        let (isa, interleaved, eps) = (self.cpu.isa, cfg.rope_interleave, cfg.rms_norm_eps);
        for seg in segments {
            for i in 0..seg.n {
                let (row, pos) = (seg.row + i, seg.start + i);
                self.rope.cos_sin(pos, &mut cos, &mut sin);
                let kv_i = &kv[row * (dc + dr)..(row + 1) * (dc + dr)];
                let q_row = &mut q[row * heads * dq..(row + 1) * heads * dq];
                let entry = pool.entry_mut(seg.table, layer, pos);
                entry[dc..].copy_from_slice(&kv_i[dc..]);
                match p {
                    Precision::F32 => {
                        for hq in q_row.chunks_mut(dq) {
                            rope(&mut hq[dn..], &cos, &sin, interleaved);
                            p.round(&mut hq[dn..]);
                        }
                        rms_norm(&kv_i[..dc], &at.kv_a_norm, eps, &mut entry[..dc]);
                        rope(&mut entry[dc..], &cos, &sin, interleaved);
                        p.round(entry);
                    }
                    Precision::Bf16 => {
                        for hq in q_row.chunks_mut(dq) {
                            simd::rope(isa, &mut hq[dn..], &cos, &sin, interleaved);
                            p.round(&mut hq[dn..]);
                        }
                        simd::rms_norm_bf16(isa, &kv_i[..dc], &at.kv_a_norm, eps, &mut entry[..dc]);
                        simd::rope(isa, &mut entry[dc..], &cos, &sin, interleaved);
                        p.round(&mut entry[dc..]);
                    }
                }
            }
        }

        let mut out = vec![0.0f32; n * heads * dv];
        for seg in segments {
            let q = &q[seg.row * heads * dq..(seg.row + seg.n) * heads * dq];
            let out = &mut out[seg.row * heads * dv..(seg.row + seg.n) * heads * dv];
            match (seg.n, p) {
                (1, Precision::Bf16) => self.attend_absorbed_bf16(at, layer, q, pool, seg.table, seg.start, out),
                (1, Precision::F32) => self.attend_absorbed_f32(at, layer, q, pool, seg.table, seg.start, out),
                _ => self.attend_expanded(at, layer, q, pool, seg.table, seg.start, out, p),
            }
        }
        self.cpu.linear(&at.o, &out, n, p)
    }

    /// Prefill form: expand every cached latent into per-head keys and values
    /// with `kv_b_proj`, then ordinary causal attention.
    #[allow(clippy::too_many_arguments)]
    fn attend_expanded(&self, at: &Attention, layer: usize, q: &[f32], pool: &KvPool, table: &BlockTable, start: usize, out: &mut [f32], p: Precision) {
        let cfg = &self.cfg;
        let (dc, de) = (cfg.kv_lora_rank, cfg.kv_entry_dim());
        let dims = MlaDims { heads: cfg.num_attention_heads, dn: cfg.qk_nope_head_dim, dr: cfg.qk_rope_head_dim, dv: cfg.v_head_dim, dc };
        let ctx = start + q.len() / (dims.heads * (dims.dn + dims.dr));
        let mut entries = Vec::with_capacity(ctx * de);
        let mut latents = Vec::with_capacity(ctx * dc);
        for t in 0..ctx {
            let e = pool.entry(table, layer, t);
            entries.extend_from_slice(e);
            latents.extend_from_slice(&e[..dc]);
        }
        let kv = self.cpu.linear(&at.kv_b, &latents, ctx, p); // [ctx, heads * (dn + dv)]
        prefill_attention(&self.cpu.pool, self.cpu.isa, q, &kv, &entries, out, start, dims, self.softmax_scale, p);
    }

    /// Decode form: fold `kv_b_proj` into the query (`q_nope · W_k`) and the
    /// output (`W_v · Σ p·c`), so attention runs directly over the cached
    /// latents and per-head keys and values are never materialised.
    #[allow(clippy::too_many_arguments)]
    fn attend_absorbed_f32(&self, at: &Attention, layer: usize, q: &[f32], pool: &KvPool, table: &BlockTable, start: usize, out: &mut [f32]) {
        let cfg = &self.cfg;
        let (heads, dn, dr, dv, dc) = (cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank);
        let (dq, dkv) = (dn + dr, dn + dv);
        let n = q.len() / (heads * dq);
        let kv_b = at.kv_b.view();
        let mut q_latent = vec![0.0f32; dc];
        let mut ctx_latent = vec![0.0f32; dc];
        let mut scores = vec![0.0f32; start + n];
        for i in 0..n {
            let pos = start + i;
            for h in 0..heads {
                let qh = &q[(i * heads + h) * dq..(i * heads + h + 1) * dq];
                matmul_t_rows(&kv_b, h * dkv..h * dkv + dn, &qh[..dn], &mut q_latent);
                for (t, s) in scores[..=pos].iter_mut().enumerate() {
                    let e = pool.entry(table, layer, t);
                    *s = (dot(&q_latent, &e[..dc]) + dot(&qh[dn..], &e[dc..])) * self.softmax_scale;
                }
                softmax(&mut scores[..=pos]);
                ctx_latent.fill(0.0);
                for (t, &w) in scores[..=pos].iter().enumerate() {
                    let c = &pool.entry(table, layer, t)[..dc];
                    ctx_latent.iter_mut().zip(c).for_each(|(a, b)| *a += w * b);
                }
                let o = &mut out[(i * heads + h) * dv..(i * heads + h + 1) * dv];
                matmul_rows(&kv_b, h * dkv + dn..h * dkv + dkv, &ctx_latent, 1, o);
            }
        }
    }

    /// The absorbed form on the BF16 path: per-head GEMVs against the
    /// transposed key bands, the attention kernel over the paged latents, and
    /// per-head GEMVs against the value bands, each spread over the pool.
    #[allow(clippy::too_many_arguments)]
    fn attend_absorbed_bf16(&self, at: &Attention, layer: usize, q: &[f32], pool: &KvPool, table: &BlockTable, start: usize, out: &mut [f32]) {
        let cfg = &self.cfg;
        let (heads, dn, dr, dv, dc) = (cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank);
        let (dq, dkv, ctx) = (dn + dr, dn + dv, start + 1);
        let (cpu, isa) = (&self.cpu, self.cpu.isa);
        let mut q_latent = vec![0.0f32; heads * dc];
        let q_pe: Vec<f32> = q.chunks(dq).flat_map(|h| h[dn..].iter().copied()).collect();
        {
            let ql = SharedSlice::new(&mut q_latent);
            cpu.pool.parallel_for(heads, &|h| {
                let mut x = vec![0u16; dn];
                f32_to_bf16(isa, &q[h * dq..h * dq + dn], &mut x);
                // SAFETY: head h writes only its own row of q_latent.
                let dst = unsafe { ql.slice_mut(h * dc, dc) };
                matmul_bf16(isa, &at.kv_b_key_t[h].view(), 0..dc, &x, 1, dst);
                duplex_kernels::round_bf16_slice(dst);
            });
        }
        let blocks: Vec<&[f32]> = table.blocks[..ctx.div_ceil(pool.block_size())].iter().map(|&b| pool.layer_block(b, layer)).collect();
        let cache = LatentCache { blocks: &blocks, block_size: pool.block_size(), dc, dr };
        let mut ctx_latent = vec![0.0f32; heads * dc];
        {
            let mut scratch = cpu.scratch();
            decode_attention(&cpu.pool, isa, cache, ctx, &q_latent, &q_pe, self.softmax_scale, &mut scratch.attention, &mut ctx_latent);
        }
        duplex_kernels::round_bf16_slice(&mut ctx_latent);
        let mut ctx_bf16 = vec![0u16; heads * dc];
        f32_to_bf16(isa, &ctx_latent, &mut ctx_bf16);
        let kv_b = at.kv_b.view();
        let o = SharedSlice::new(out);
        cpu.pool.parallel_for(heads, &|h| {
            // SAFETY: head h writes only its own output columns.
            let dst = unsafe { o.slice_mut(h * dv, dv) };
            matmul_bf16(isa, &kv_b, h * dkv + dn..h * dkv + dkv, &ctx_bf16[h * dc..(h + 1) * dc], 1, dst);
            duplex_kernels::round_bf16_slice(dst);
        });
    }
}
