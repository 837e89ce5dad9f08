//! The numerics gates: a checkpoint's reference outputs from transformers
//! (`reference.json` and `reference_logits.safetensors`, as shipped with the
//! bundled fixture) and the comparisons every forward path must pass.
//!
//! - F32: every logit within 2e-3 of transformers' float32 logits.
//! - BF16: mean |Δlogit| at most twice transformers' own BF16 error, and
//!   top-1 agreement at most 0.05 below transformers' own BF16 agreement.

use safetensors::SafeTensors;
use std::path::Path;

/// The largest |Δlogit| the F32 path may show against transformers.
pub const F32_MAX_ABS_DIFF: f32 = 2e-3;

pub struct ReferencePrompt {
    pub input_ids: Vec<u32>,
    pub greedy: Vec<u32>,
    /// transformers' BF16 model against its F32 model.
    pub bf16_mean_abs_diff: f32,
    pub bf16_top1: f32,
    /// `[input_ids.len(), vocab]` F32 logits.
    pub logits: Vec<f32>,
}

/// The reference prompts of the checkpoint in `dir`.
pub fn load(dir: &Path) -> Result<Vec<ReferencePrompt>, String> {
    let json = std::fs::read_to_string(dir.join("reference.json")).map_err(|e| format!("reference.json: {e}"))?;
    let json: serde_json::Value = serde_json::from_str(&json).map_err(|e| format!("reference.json: {e}"))?;
    let bytes = std::fs::read(dir.join("reference_logits.safetensors")).map_err(|e| format!("reference_logits.safetensors: {e}"))?;
    let st = SafeTensors::deserialize(&bytes).map_err(|e| format!("reference_logits.safetensors: {e}"))?;
    let ids = |v: &serde_json::Value| -> Option<Vec<u32>> { v.as_array()?.iter().map(|x| x.as_u64().map(|x| x as u32)).collect() };
    let prompts = json["prompts"].as_array().ok_or("reference.json has no prompts")?;
    prompts
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let field = |name: &str| p[name].as_f64().map(|x| x as f32).ok_or(format!("prompt {i} has no {name}"));
            let logits = st.tensor(&format!("logits.{i}")).map_err(|e| format!("logits.{i}: {e}"))?;
            Ok(ReferencePrompt {
                input_ids: ids(&p["input_ids"]).ok_or(format!("prompt {i}: input_ids"))?,
                greedy: ids(&p["greedy_continuation"]).ok_or(format!("prompt {i}: greedy_continuation"))?,
                bf16_mean_abs_diff: field("bf16_reference_mean_abs_diff")?,
                bf16_top1: field("bf16_reference_top1_agreement")?,
                logits: logits.data().chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect(),
            })
        })
        .collect()
}

pub fn argmax(row: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in row.iter().enumerate() {
        if v > row[best] {
            best = i;
        }
    }
    best as u32
}

pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

/// How BF16 logits (`[rows, vocab]`) compare with a prompt's reference.
#[derive(Clone, Copy, Debug)]
pub struct Bf16Gate {
    pub mean_abs_diff: f32,
    pub mean_limit: f32,
    pub top1: f32,
    pub top1_floor: f32,
}

impl Bf16Gate {
    pub fn new(p: &ReferencePrompt, got: &[f32], vocab: usize) -> Self {
        let mean_abs_diff = got.iter().zip(&p.logits).map(|(a, b)| (a - b).abs()).sum::<f32>() / got.len().max(1) as f32;
        let rows = got.len() / vocab;
        let agree = (0..rows).filter(|&r| argmax(&got[r * vocab..(r + 1) * vocab]) == argmax(&p.logits[r * vocab..(r + 1) * vocab])).count();
        Bf16Gate { mean_abs_diff, mean_limit: 2.0 * p.bf16_mean_abs_diff, top1: agree as f32 / rows.max(1) as f32, top1_floor: p.bf16_top1 - 0.05 }
    }

    pub fn passed(&self) -> bool {
        self.mean_abs_diff <= self.mean_limit && self.top1 >= self.top1_floor
    }
}

impl std::fmt::Display for Bf16Gate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "bf16 mean |Δlogit| = {:.4} (limit {:.4}), top-1 agreement {:.3} (floor {:.3})", self.mean_abs_diff, self.mean_limit, self.top1, self.top1_floor)
    }
}
