//! Overrides of a GGUF model's metadata (`override_kv`, llama.cpp's
//! `--override-kv`): DeepSeek's YaRN betas, which llama.cpp ignores for
//! this architecture and a converter may leave out, reach the model's
//! configuration and what it computes, and make it another model to the
//! weight segment; overrides that cannot apply are refused with the reason.

use duplex_kernels::pool::PoolConfig;
use duplex_model::source::ModelSource;
use duplex_model::{BlockTable, Logits, Model, Precision};
use std::path::{Path, PathBuf};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures").join(name)
}

fn logits(source: &ModelSource, tokens: &[u32]) -> Vec<f32> {
    let model = Model::load_source(source, &PoolConfig::single_node(1), &mut |_, _| {}).unwrap();
    let mut pool = model.new_kv_pool(tokens.len().div_ceil(16), 16);
    model.forward(&mut pool, &mut BlockTable::default(), tokens, Precision::F32, Logits::All).unwrap()
}

fn betas(o: &[String]) -> ModelSource {
    ModelSource::locate_with(&fixture("tiny-dsv3-q4km"), o).unwrap()
}

#[test]
fn yarn_betas_are_overridden_and_change_what_the_model_computes() {
    let plain = betas(&[]);
    let (cfg, identity) = plain.config().unwrap();
    let yarn = cfg.rope_scaling.clone().expect("the fixture's model uses YaRN");
    let overrides = ["deepseek2.rope.scaling.yarn_beta_fast=float:4".to_string(), "deepseek2.rope.scaling.yarn_beta_slow=float:2".to_string()];
    let changed = betas(&overrides);
    let (ocfg, oidentity) = changed.config().unwrap();
    let oyarn = ocfg.rope_scaling.clone().unwrap();
    assert_eq!((oyarn.beta_fast, oyarn.beta_slow), (4.0, 2.0));
    assert_ne!((yarn.beta_fast, yarn.beta_slow), (4.0, 2.0), "the fixture already has the overridden betas");
    assert_eq!(oyarn.factor, yarn.factor, "nothing else changes");
    assert_ne!(identity, oidentity, "a model read with overrides is another model to the weight segment");
    // Open and configured alike, the overrides reach the loaded model.
    let (open_cfg, _) = changed.open().unwrap();
    assert_eq!(open_cfg.rope_scaling.unwrap().beta_fast, 4.0);

    let tokens: Vec<u32> = (0..40).map(|i| (i * 37 + 5) % 200).collect();
    let base = logits(&plain, &tokens);
    let moved = logits(&changed, &tokens);
    let d = base.iter().zip(&moved).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
    assert!(d > 1e-3, "other YaRN betas left the logits as they were (max |Δ| {d})");
    // Overriding a beta with the value it has changes nothing.
    let same = betas(&[format!("deepseek2.rope.scaling.yarn_beta_fast=float:{}", yarn.beta_fast)]);
    assert_eq!(logits(&same, &tokens), base);
}

#[test]
fn overrides_that_cannot_apply_are_refused_with_the_reason() {
    let e = ModelSource::locate_with(&fixture("tiny-dsv3-q4km"), &["deepseek2.rope.scaling.yarn_beta_fast=32".into()]).unwrap_err().to_string();
    assert!(e.starts_with("override_kv: ") && e.contains("KEY=TYPE:VALUE"), "{e}");
    let e = ModelSource::locate_with(&fixture("tiny-dsv3"), &["deepseek2.rope.scaling.yarn_beta_fast=float:32".into()]).unwrap_err().to_string();
    assert!(e.contains("is a Hugging Face model") && e.contains("config.json"), "{e}");
    // Without overrides a Hugging Face model is as before.
    assert!(matches!(ModelSource::locate_with(&fixture("tiny-dsv3"), &[]).unwrap(), ModelSource::HuggingFace(_)));
    // An override that makes the metadata wrong is the loader's error, naming the key.
    let e = betas(&["deepseek2.rope.scaling.yarn_beta_fast=float:-1".into()]).config().unwrap_err().to_string();
    assert!(e.contains("yarn_beta_fast") && e.contains("must be positive"), "{e}");
}
