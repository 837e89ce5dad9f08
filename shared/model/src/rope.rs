//! Rotary position embedding tables, with YaRN scaling as DeepSeek-V3 and
//! Kimi-K2 configure it (transformers' `_compute_yarn_parameters`).

use crate::config::ModelConfig;

/// YaRN's magnitude correction `0.1 · mscale · ln(scale) + 1` (1 when not scaling up).
pub fn yarn_get_mscale(scale: f64, mscale: f64) -> f64 {
    if scale <= 1.0 {
        1.0
    } else {
        0.1 * mscale * scale.ln() + 1.0
    }
}

fn find_correction_dim(num_rotations: f64, dim: usize, base: f64, max_pos: usize) -> f64 {
    (dim as f64 * (max_pos as f64 / (num_rotations * 2.0 * std::f64::consts::PI)).ln()) / (2.0 * base.ln())
}

/// The per-frequency inverse frequencies (`dim / 2` of them) and the factor
/// that scales cos and sin (`attention_factor` in transformers).
pub fn inverse_frequencies(cfg: &ModelConfig) -> (Vec<f32>, f32) {
    let dim = cfg.rope_dim();
    let base = cfg.rope_theta;
    // transformers computes `base ** (arange(0, dim, 2) / dim)` in float32.
    let pos_freqs: Vec<f32> = (0..dim / 2).map(|i| (base as f32).powf((2 * i) as f32 / dim as f32)).collect();
    let Some(y) = &cfg.rope_scaling else {
        return (pos_freqs.iter().map(|p| 1.0 / p).collect(), 1.0);
    };
    let attention_factor = if let Some(f) = y.attention_factor {
        f
    } else if y.mscale != 0.0 && y.mscale_all_dim != 0.0 {
        yarn_get_mscale(y.factor, y.mscale) / yarn_get_mscale(y.factor, y.mscale_all_dim)
    } else {
        yarn_get_mscale(y.factor, 1.0)
    };
    let low = find_correction_dim(y.beta_fast, dim, base, y.original_max_position_embeddings).floor().max(0.0);
    let mut high = find_correction_dim(y.beta_slow, dim, base, y.original_max_position_embeddings)
        .ceil()
        .min(dim as f64 - 1.0);
    if low == high {
        high += 0.001; // as transformers: avoid a division by zero in the ramp
    }
    let inv = pos_freqs
        .iter()
        .enumerate()
        .map(|(i, &p)| {
            let ramp = ((i as f32 - low as f32) / (high as f32 - low as f32)).clamp(0.0, 1.0);
            let extrapolation_factor = 1.0 - ramp;
            let extrapolation = 1.0 / p;
            let interpolation = 1.0 / (y.factor as f32 * p);
            interpolation * (1.0 - extrapolation_factor) + extrapolation * extrapolation_factor
        })
        .collect();
    (inv, attention_factor as f32)
}

/// Rotary tables: the inverse frequencies and the cos/sin factor.
#[derive(Clone, Debug)]
pub struct RopeTable {
    inv_freq: Vec<f32>,
    attention_factor: f32,
}

impl RopeTable {
    pub fn new(cfg: &ModelConfig) -> Self {
        let (inv_freq, attention_factor) = inverse_frequencies(cfg);
        RopeTable { inv_freq, attention_factor }
    }

    /// cos and sin (scaled by the attention factor) of every frequency at `pos`.
    /// As transformers, the angle is computed in float32.
    pub fn cos_sin(&self, pos: usize, cos: &mut [f32], sin: &mut [f32]) {
        for ((c, s), &f) in cos.iter_mut().zip(sin.iter_mut()).zip(&self.inv_freq) {
            let angle = pos as f32 * f;
            *c = angle.cos() * self.attention_factor;
            *s = angle.sin() * self.attention_factor;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Yarn;

    fn cfg(yarn: Option<Yarn>) -> ModelConfig {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/fixtures/tiny-dsv3/config.json");
        let mut c = ModelConfig::from_file(std::path::Path::new(path)).unwrap();
        c.rope_scaling = yarn;
        c
    }

    /// Independent f64 transcription of DeepSeek's `DeepseekV3YarnRotaryEmbedding`.
    fn reference(dim: usize, base: f64, y: &Yarn) -> Vec<f64> {
        let corr = |r: f64| dim as f64 * (y.original_max_position_embeddings as f64 / (r * 2.0 * std::f64::consts::PI)).ln() / (2.0 * base.ln());
        let low = corr(y.beta_fast).floor().max(0.0);
        let mut high = corr(y.beta_slow).ceil().min(dim as f64 - 1.0);
        if low == high {
            high += 0.001;
        }
        (0..dim / 2)
            .map(|i| {
                let extra = 1.0 / base.powf(2.0 * i as f64 / dim as f64);
                let inter = extra / y.factor;
                let mask = 1.0 - ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
                inter * (1.0 - mask) + extra * mask
            })
            .collect()
    }

    fn check(y: Yarn) {
        let c = cfg(Some(y.clone()));
        let (inv, _) = inverse_frequencies(&c);
        let want = reference(c.rope_dim(), c.rope_theta, &y);
        for (g, w) in inv.iter().zip(&want) {
            assert!(((*g as f64) - w).abs() <= 1e-6 * w.abs(), "{g} vs {w}");
        }
    }

    #[test]
    fn yarn_matches_reference_deepseek_v3_style() {
        check(Yarn { factor: 40.0, original_max_position_embeddings: 4096, beta_fast: 32.0, beta_slow: 1.0, mscale: 1.0, mscale_all_dim: 1.0, attention_factor: None });
        check(Yarn { factor: 4.0, original_max_position_embeddings: 256, beta_fast: 32.0, beta_slow: 1.0, mscale: 1.0, mscale_all_dim: 1.0, attention_factor: None });
    }

    #[test]
    fn yarn_with_equal_betas_like_kimi_k2() {
        let y = Yarn { factor: 32.0, original_max_position_embeddings: 4096, beta_fast: 1.0, beta_slow: 1.0, mscale: 1.0, mscale_all_dim: 1.0, attention_factor: None };
        check(y.clone());
        let (inv, _) = inverse_frequencies(&cfg(Some(y)));
        assert!(inv.iter().all(|f| f.is_finite() && *f > 0.0));
    }

    #[test]
    fn yarn_factor_one_and_no_scaling_are_plain_rope() {
        let plain = inverse_frequencies(&cfg(None));
        assert_eq!(plain.1, 1.0);
        assert!((plain.0[0] - 1.0).abs() < 1e-7);
        let y = Yarn { factor: 1.0, original_max_position_embeddings: 256, beta_fast: 32.0, beta_slow: 1.0, mscale: 1.0, mscale_all_dim: 1.0, attention_factor: None };
        let (inv, af) = inverse_frequencies(&cfg(Some(y)));
        assert_eq!(af, 1.0);
        for (a, b) in inv.iter().zip(&plain.0) {
            assert!((a - b).abs() <= 1e-7 * b);
        }
    }

    #[test]
    fn explicit_attention_factor_wins() {
        let y = Yarn { factor: 40.0, original_max_position_embeddings: 4096, beta_fast: 32.0, beta_slow: 1.0, mscale: 1.0, mscale_all_dim: 0.0, attention_factor: Some(1.25) };
        assert_eq!(inverse_frequencies(&cfg(Some(y))).1, 1.25);
    }

    #[test]
    fn softmax_scale_has_mscale_squared() {
        let c = cfg(Some(Yarn { factor: 40.0, original_max_position_embeddings: 4096, beta_fast: 32.0, beta_slow: 1.0, mscale: 1.0, mscale_all_dim: 1.0, attention_factor: None }));
        let m = 0.1 * 40f64.ln() + 1.0;
        let want = (c.qk_head_dim() as f64).powf(-0.5) * m * m;
        assert!((c.softmax_scale() as f64 - want).abs() < 1e-6);
    }
}
