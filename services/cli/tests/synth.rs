//! `duplex synth` end to end: checkpoints it writes load and run in the
//! engine, `--plan` reports the real model's sizes, and mistakes are errors.

use std::path::Path;
use std::process::{Command, Output};

fn duplex(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_duplex")).args(args).output().expect("duplex runs")
}

fn ok(out: &Output) -> String {
    assert!(out.status.success(), "stderr: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A failure with a one-line `error:` message, not a panic.
fn err(out: &Output) -> String {
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(out.status.code(), Some(1), "stderr: {stderr}");
    assert!(stderr.starts_with("error:") && !stderr.contains("panicked"), "{stderr}");
    stderr
}

fn path(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// Greedy generation from the checkpoint in `dir` gives `n` tokens, and the
/// teacher-forced logits are finite and not all equal.
fn check_runs(dir: &Path, n: usize) {
    let n_str = n.to_string();
    let json: serde_json::Value = serde_json::from_str(&ok(&duplex(&[
        "generate",
        "--model",
        path(dir),
        "--prompt",
        "Hello world",
        "--temperature",
        "0",
        "--ignore-eos",
        "--max-tokens",
        &n_str,
        "--json",
    ])))
    .unwrap();
    assert_eq!(json["tokens"].as_array().unwrap().len(), n);

    let logits_file = dir.join("logits.safetensors");
    ok(&duplex(&["logits", "--model", path(dir), "--tokens", "0,17,300,1999", "--out", path(&logits_file)]));
    let bytes = std::fs::read(&logits_file).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let logits: Vec<f32> = st.tensor("logits").unwrap().data().chunks_exact(4).map(|b| f32::from_le_bytes(b.try_into().unwrap())).collect();
    assert!(logits.iter().all(|x| x.is_finite()));
    assert!(logits.iter().any(|&x| x != logits[0]));
}

#[test]
fn tiny_preset_loads_generates_and_is_reproducible() {
    let tmp = tempfile::tempdir().unwrap();
    let a = tmp.path().join("a");
    let out = duplex(&["synth", "--preset", "tiny", "--out", path(&a), "--seed", "3", "--shard-size", "4M"]);
    ok(&out);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("wrote") && stderr.contains("501 tensors") && stderr.contains("MB/s"), "{stderr}");
    for f in ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors.index.json"] {
        assert!(a.join(f).is_file(), "{f}");
    }
    check_runs(&a, 6);

    let b = tmp.path().join("b");
    ok(&duplex(&["synth", "--preset", "tiny", "--out", path(&b), "--seed", "3", "--shard-size", "4M"]));
    let shard = "model-00001-of-00004.safetensors";
    assert_eq!(std::fs::read(a.join(shard)).unwrap(), std::fs::read(b.join(shard)).unwrap());
}

#[test]
fn custom_config_with_unaligned_shapes_loads_and_generates() {
    let tmp = tempfile::tempdir().unwrap();
    // Dimensions that are not multiples of 128 (partial FP8 blocks), plain
    // q_proj, greedy softmax routing, tied embeddings, no shared experts and
    // no quantization_config (synth adds the FP8 one it writes).
    let config = serde_json::json!({
        "model_type": "deepseek_v3",
        "vocab_size": 2100, "hidden_size": 192, "intermediate_size": 320, "moe_intermediate_size": 96,
        "num_hidden_layers": 3, "first_k_dense_replace": 1, "num_attention_heads": 3,
        "q_lora_rank": null, "kv_lora_rank": 80, "qk_nope_head_dim": 48, "qk_rope_head_dim": 16, "v_head_dim": 40,
        "n_routed_experts": 6, "n_shared_experts": 0, "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1,
        "scoring_func": "softmax", "topk_method": "greedy", "tie_word_embeddings": true,
        "max_position_embeddings": 512, "bos_token_id": 0, "eos_token_id": 1,
    });
    let config_file = tmp.path().join("custom.json");
    std::fs::write(&config_file, config.to_string()).unwrap();
    let dir = tmp.path().join("ck");
    ok(&duplex(&["synth", "--config", path(&config_file), "--out", path(&dir)]));
    let written: serde_json::Value = serde_json::from_slice(&std::fs::read(dir.join("config.json")).unwrap()).unwrap();
    assert_eq!(written["quantization_config"]["quant_method"], "fp8");
    assert_eq!(written["hidden_size"], 192);
    check_runs(&dir, 4);
}

#[test]
fn qwen3_and_mixtral_presets_load_and_generate() {
    let tmp = tempfile::tempdir().unwrap();
    for preset in ["tiny-qwen3moe-fp8", "tiny-mixtral"] {
        let dir = tmp.path().join(preset);
        ok(&duplex(&["synth", "--preset", preset, "--out", path(&dir)]));
        let written: serde_json::Value = serde_json::from_slice(&std::fs::read(dir.join("config.json")).unwrap()).unwrap();
        assert_eq!(written["quantization_config"]["quant_method"].as_str(), if preset.ends_with("fp8") { Some("fp8") } else { None });
        check_runs(&dir, 4);
    }
    let json: serde_json::Value = serde_json::from_str(&ok(&duplex(&["synth", "--preset", "qwen3-30b-a3b", "--plan", "--json"]))).unwrap();
    assert_eq!(json["bytes_by_dtype"].as_object().unwrap().keys().collect::<Vec<_>>(), ["BF16"]);
}

#[test]
fn plan_reports_deepseek_v3_sizes_and_writing_it_is_refused() {
    let json: serde_json::Value = serde_json::from_str(&ok(&duplex(&["synth", "--preset", "deepseek-v3", "--plan", "--json"]))).unwrap();
    let params = json["params"].as_f64().unwrap();
    assert!((params / 671e9 - 1.0).abs() < 0.02, "{params}");
    let activated = json["activated_bytes_per_token"].as_f64().unwrap();
    assert!((37e9..40e9).contains(&activated), "{activated}");
    assert!((json["activated_params_per_token"].as_f64().unwrap() / 37e9 - 1.0).abs() < 0.05);
    assert!(json["bytes_by_dtype"]["F8_E4M3"].as_f64().unwrap() > 0.95 * json["total_bytes"].as_f64().unwrap());

    let text = ok(&duplex(&["synth", "--preset", "bench", "--plan"]));
    assert!(text.contains("activated per decode token") && text.contains("moe      x8"), "{text}");

    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("v3");
    let e = err(&duplex(&["synth", "--preset", "deepseek-v3", "--out", path(&out)]));
    assert!(e.contains("688.57 GB") && e.contains("--plan"), "{e}");
    assert!(!out.exists());
}

#[test]
fn mistakes_are_clear_errors() {
    let e = err(&duplex(&["synth", "--preset", "huge", "--plan"]));
    assert!(e.contains("unknown preset \"huge\"") && e.contains("tiny, bench, deepseek-v3"), "{e}");

    let tmp = tempfile::tempdir().unwrap();
    let bad = tmp.path().join("bad.json");
    std::fs::write(&bad, r#"{"model_type": "deepseek_v3", "vocab_size": 64}"#).unwrap();
    let e = err(&duplex(&["synth", "--config", path(&bad), "--plan"]));
    assert!(e.contains("bad.json"), "{e}");

    let dir = tmp.path().join("ck");
    ok(&duplex(&["synth", "--preset", "tiny", "--out", path(&dir)]));
    let e = err(&duplex(&["synth", "--preset", "tiny", "--out", path(&dir), "--seed", "1"]));
    assert!(e.contains("already contains a checkpoint") && e.contains("--force"), "{e}");
    ok(&duplex(&["synth", "--preset", "tiny", "--out", path(&dir), "--seed", "1", "--force"]));

    let e = err(&duplex(&["synth", "--preset", "tiny", "--out", path(&dir.join("config.json"))]));
    assert!(e.contains("cannot write"), "{e}");
}

/// `--hollow` writes DeepSeek-R1's published config at its full 671B shape
/// (688 GB of shards, over the default --max-size) in a few MB of disk.
#[test]
fn hollow_writes_deepseek_r1_in_no_disk() {
    use std::os::unix::fs::MetadataExt;
    let config = concat!(env!("CARGO_MANIFEST_DIR"), "/../../deploy/models/deepseek-r1/config.json");
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("r1");
    let out = duplex(&["synth", "--config", config, "--hollow", "--out", path(&dir)]);
    ok(&out);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("wrote a hollow 688."), "{stderr}");
    let (mut apparent, mut disk) = (0, 0);
    for entry in std::fs::read_dir(&dir).unwrap() {
        let meta = entry.unwrap().metadata().unwrap();
        apparent += meta.len();
        disk += meta.blocks() * 512;
    }
    assert!(apparent > 688_000_000_000, "{apparent}");
    assert!(disk < 200_000_000, "{disk} bytes on disk");
    let written: serde_json::Value = serde_json::from_slice(&std::fs::read(dir.join("config.json")).unwrap()).unwrap();
    assert_eq!(written["n_routed_experts"], 256);
}
