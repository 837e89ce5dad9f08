//! Broken checkpoints must fail to load with an error, never a panic, and the
//! error must name the file and/or tensor at fault. Each test copies the
//! bundled fixture into a temporary directory and breaks one thing (the
//! last, every integer of each architecture's config.json in turn).

mod common;

use common::{fixture, read_tensors, write_tensors, Tensor};
use duplex_model::{Logits, Model, Precision};
use safetensors::Dtype;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};

const SHARD1: &str = "model-00001-of-00002.safetensors";
const SHARD2: &str = "model-00002-of-00002.safetensors";
const INDEX: &str = "model.safetensors.index.json";

/// A private, writable copy of the fixture.
struct Ckpt {
    _tmp: tempfile::TempDir,
    dir: PathBuf,
}

fn copy_fixture() -> Ckpt {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("tiny-dsv3");
    std::fs::create_dir(&dir).unwrap();
    for entry in std::fs::read_dir(fixture()).unwrap() {
        let entry = entry.unwrap();
        let name = entry.file_name().into_string().unwrap();
        if !name.starts_with("reference") {
            std::fs::copy(entry.path(), dir.join(&name)).unwrap();
        }
    }
    Ckpt { _tmp: tmp, dir }
}

impl Ckpt {
    fn path(&self, file: &str) -> PathBuf {
        self.dir.join(file)
    }

    /// Rewrite `shard` after letting `edit` change its tensor list.
    fn edit_shard(&self, shard: &str, edit: impl FnOnce(&mut Vec<Tensor>)) {
        let mut tensors = read_tensors(&self.path(shard));
        edit(&mut tensors);
        write_tensors(&self.path(shard), &tensors);
    }

    /// Rewrite a JSON file (config.json, the index) after `edit`.
    fn edit_json(&self, file: &str, edit: impl FnOnce(&mut serde_json::Value)) {
        let path = self.path(file);
        let mut v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        edit(&mut v);
        std::fs::write(&path, serde_json::to_string_pretty(&v).unwrap()).unwrap();
    }

    fn edit_bytes(&self, file: &str, edit: impl FnOnce(&mut Vec<u8>)) {
        let path = self.path(file);
        let mut bytes = std::fs::read(&path).unwrap();
        edit(&mut bytes);
        std::fs::write(&path, bytes).unwrap();
    }

    /// Load, expecting an error; returns its message.
    fn load_err(&self) -> String {
        load_err(&self.dir)
    }
}

/// Load `dir`, expecting an error; returns its message with `dir` itself
/// replaced by `<ckpt>`, so that needles never match the random temp path.
fn load_err(dir: &Path) -> String {
    match catch_unwind(AssertUnwindSafe(|| Model::load(dir, &mut |_, _| {}))) {
        Err(_) => panic!("Model::load panicked instead of returning an error"),
        Ok(Ok(_)) => panic!("Model::load accepted a broken checkpoint"),
        Ok(Err(e)) => {
            let msg = e.to_string().replace(&dir.display().to_string(), "<ckpt>");
            println!("{msg}");
            msg
        }
    }
}

/// Assert that `msg` contains every one of `needles`.
#[track_caller]
fn assert_mentions(msg: &str, needles: &[&str]) {
    for n in needles {
        assert!(msg.contains(n), "error message does not mention {n:?}: {msg}");
    }
}

fn tensor<'a>(tensors: &'a mut [Tensor], name: &str) -> &'a mut Tensor {
    tensors.iter_mut().find(|t| t.name == name).unwrap_or_else(|| panic!("fixture has no {name}"))
}

fn remove(tensors: &mut Vec<Tensor>, name: &str) {
    let before = tensors.len();
    tensors.retain(|t| t.name != name);
    assert_eq!(tensors.len() + 1, before, "fixture has no {name}");
}

// Tensors of the fixture and the shard that holds them.
const L0_Q_A: &str = "model.layers.0.self_attn.q_a_proj.weight"; // shard 1, FP8 [256, 256]
const L0_KV_A: &str = "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"; // shard 1, FP8 [160, 256]
const L0_O_SCALE: &str = "model.layers.0.self_attn.o_proj.weight_scale_inv"; // shard 1, F32 [2, 2]
const L0_NORM: &str = "model.layers.0.input_layernorm.weight"; // shard 1, BF16 [256]
const L3_Q_A: &str = "model.layers.3.self_attn.q_a_proj.weight"; // shard 2, FP8 [256, 256]
const L3_O: &str = "model.layers.3.self_attn.o_proj.weight"; // shard 2

#[test]
fn intact_copy_loads() {
    let c = copy_fixture();
    Model::load(&c.dir, &mut |_, _| {}).unwrap_or_else(|e| panic!("{e}"));
}

#[test]
fn missing_shard_file() {
    let c = copy_fixture();
    std::fs::remove_file(c.path(SHARD2)).unwrap();
    assert_mentions(&c.load_err(), &[SHARD2, INDEX, "missing"]);
}

#[test]
fn tensor_in_index_but_absent_from_its_shard() {
    let c = copy_fixture();
    c.edit_shard(SHARD2, |ts| remove(ts, L3_Q_A));
    assert_mentions(&c.load_err(), &[L3_Q_A, SHARD2]);
}

#[test]
fn tensor_stored_in_two_shards() {
    let c = copy_fixture();
    let dup = read_tensors(&c.path(SHARD1)).into_iter().find(|t| t.name == "model.norm.weight").unwrap();
    c.edit_shard(SHARD2, |ts| ts.push(dup));
    assert_mentions(&c.load_err(), &["model.norm.weight", SHARD1, SHARD2]);
}

#[test]
fn index_points_tensor_at_the_wrong_shard() {
    let c = copy_fixture();
    c.edit_json(INDEX, |v| v["weight_map"][L3_O] = SHARD1.into());
    assert_mentions(&c.load_err(), &[L3_O, SHARD1]);
}

#[test]
fn tensor_missing_from_shard_and_index() {
    let c = copy_fixture();
    c.edit_shard(SHARD2, |ts| remove(ts, L3_Q_A));
    c.edit_json(INDEX, |v| {
        v["weight_map"].as_object_mut().unwrap().remove(L3_Q_A);
    });
    assert_mentions(&c.load_err(), &[L3_Q_A, "missing"]);
}

#[test]
fn transposed_weight() {
    let c = copy_fixture();
    c.edit_shard(SHARD1, |ts| tensor(ts, L0_KV_A).shape = vec![256, 160]);
    assert_mentions(&c.load_err(), &[L0_KV_A, SHARD1, "[256, 160]", "[160, 256]"]);
}

#[test]
fn resized_weight() {
    let c = copy_fixture();
    c.edit_shard(SHARD1, |ts| {
        let t = tensor(ts, L0_Q_A);
        t.shape = vec![255, 256];
        t.data.truncate(255 * 256);
    });
    assert_mentions(&c.load_err(), &[L0_Q_A, SHARD1, "[255, 256]", "[256, 256]"]);
}

#[test]
fn wrong_shape_of_block_scales() {
    let c = copy_fixture();
    c.edit_shard(SHARD1, |ts| tensor(ts, L0_O_SCALE).shape = vec![1, 4]);
    assert_mentions(&c.load_err(), &[L0_O_SCALE, SHARD1, "[1, 4]", "[2, 2]"]);
}

#[test]
fn wrong_shape_of_norm() {
    let c = copy_fixture();
    c.edit_shard(SHARD1, |ts| {
        let t = tensor(ts, L0_NORM);
        t.shape = vec![2, 128];
    });
    assert_mentions(&c.load_err(), &[L0_NORM, SHARD1, "[2, 128]", "[256]"]);
}

#[test]
fn unsupported_weight_dtypes() {
    let cases: [(Dtype, usize, &str); 4] =
        [(Dtype::I32, 4, "I32"), (Dtype::F64, 8, "F64"), (Dtype::F8_E5M2, 1, "F8_E5M2"), (Dtype::U8, 1, "U8")];
    for (dtype, size, name) in cases {
        let c = copy_fixture();
        c.edit_shard(SHARD1, |ts| {
            let t = tensor(ts, L0_Q_A);
            t.dtype = dtype;
            t.data = t.data.iter().flat_map(|&b| vec![b; size]).collect();
        });
        assert_mentions(&c.load_err(), &[L0_Q_A, SHARD1, name]);
    }
}

#[test]
fn unsupported_norm_and_scale_dtypes() {
    // A norm in F64 (8 bytes per element) and block scales in I32.
    let c = copy_fixture();
    c.edit_shard(SHARD1, |ts| {
        let t = tensor(ts, L0_NORM);
        t.dtype = Dtype::F64;
        t.data = vec![0; 256 * 8];
    });
    assert_mentions(&c.load_err(), &[L0_NORM, SHARD1, "F64"]);

    let c = copy_fixture();
    c.edit_shard(SHARD1, |ts| tensor(ts, L0_O_SCALE).dtype = Dtype::I32);
    assert_mentions(&c.load_err(), &[L0_O_SCALE, SHARD1, "I32"]);
}

#[test]
fn fp8_weight_without_block_scales() {
    let c = copy_fixture();
    c.edit_shard(SHARD1, |ts| remove(ts, L0_O_SCALE));
    c.edit_json(INDEX, |v| {
        v["weight_map"].as_object_mut().unwrap().remove(L0_O_SCALE);
    });
    assert_mentions(&c.load_err(), &[L0_O_SCALE]);
}

#[test]
fn unsupported_quantization_method() {
    let c = copy_fixture();
    c.edit_json("config.json", |v| v["quantization_config"]["quant_method"] = "gptq".into());
    assert_mentions(&c.load_err(), &["config.json", "quant_method", "gptq"]);

    let c = copy_fixture();
    c.edit_json("config.json", |v| v["quantization_config"]["fmt"] = "e5m2".into());
    assert_mentions(&c.load_err(), &["config.json", "fmt", "e5m2"]);
}

#[test]
fn fp8_tensors_without_quantization_config() {
    let c = copy_fixture();
    c.edit_json("config.json", |v| {
        v.as_object_mut().unwrap().remove("quantization_config");
    });
    // embed_tokens and lm_head are BF16; the first FP8 weight loaded is in layer 0.
    assert_mentions(&c.load_err(), &["model.layers.0.", ".weight", SHARD1, "quantization_config"]);
}

#[test]
fn truncated_shard_data() {
    for cut in [1, 100, 100_000] {
        let c = copy_fixture();
        c.edit_bytes(SHARD2, |b| b.truncate(b.len() - cut));
        assert_mentions(&c.load_err(), &[SHARD2]);
    }
}

#[test]
fn truncated_inside_header() {
    for keep in [0, 4, 8, 9, 200] {
        let c = copy_fixture();
        c.edit_bytes(SHARD2, |b| b.truncate(keep));
        assert_mentions(&c.load_err(), &[SHARD2]);
    }
}

#[test]
fn garbage_in_header() {
    // Invalid UTF-8, valid text that is not JSON, and an absurd header length.
    let edits: [fn(&mut Vec<u8>); 4] = [
        |b| b[8..40].fill(0xff),
        |b| b[8..40].fill(b'#'),
        |b| b[..8].copy_from_slice(&u64::MAX.to_le_bytes()),
        |b| {
            let len = b.len() as u64;
            b[..8].copy_from_slice(&len.to_le_bytes())
        },
    ];
    for edit in edits {
        let c = copy_fixture();
        c.edit_bytes(SHARD1, edit);
        assert_mentions(&c.load_err(), &[SHARD1]);
    }
}

#[test]
fn header_offsets_that_overrun_the_data() {
    // Valid JSON whose last tensor claims more bytes than the file holds.
    let c = copy_fixture();
    c.edit_bytes(SHARD2, |b| {
        let n = u64::from_le_bytes(b[..8].try_into().unwrap()) as usize;
        let mut header: serde_json::Value = serde_json::from_slice(&b[8..8 + n]).unwrap();
        let last = header
            .as_object_mut()
            .unwrap()
            .values_mut()
            .filter_map(|info| info.get_mut("data_offsets"))
            .max_by_key(|off| off[1].as_u64().unwrap())
            .unwrap();
        last[1] = (last[1].as_u64().unwrap() + 4096).into();
        let text = serde_json::to_vec(&header).unwrap();
        let mut out = (text.len() as u64).to_le_bytes().to_vec();
        out.extend_from_slice(&text);
        out.extend_from_slice(&b[8 + n..]);
        *b = out;
    });
    assert_mentions(&c.load_err(), &[SHARD2]);
}

#[test]
fn vocab_size_disagrees_with_embedding() {
    let c = copy_fixture();
    c.edit_json("config.json", |v| v["vocab_size"] = 2000.into());
    assert_mentions(&c.load_err(), &["vocab_size", "2000", "model.embed_tokens.weight", "2112", SHARD1]);
}

#[test]
fn lm_head_rows_disagree_with_vocab_size() {
    let c = copy_fixture();
    c.edit_shard(SHARD1, |ts| {
        let t = tensor(ts, "lm_head.weight");
        t.shape = vec![2000, 256];
        t.data.truncate(2000 * 256 * 2);
    });
    assert_mentions(&c.load_err(), &["vocab_size", "lm_head.weight", "2000", "2112", SHARD1]);
}

#[test]
fn untied_model_without_lm_head() {
    let c = copy_fixture();
    c.edit_shard(SHARD1, |ts| remove(ts, "lm_head.weight"));
    c.edit_json(INDEX, |v| {
        v["weight_map"].as_object_mut().unwrap().remove("lm_head.weight");
    });
    assert_mentions(&c.load_err(), &["lm_head.weight"]);
}

#[test]
fn missing_config() {
    let c = copy_fixture();
    std::fs::remove_file(c.path("config.json")).unwrap();
    assert_mentions(&c.load_err(), &["config.json"]);
}

#[test]
fn malformed_config() {
    let c = copy_fixture();
    c.edit_bytes("config.json", |b| b.truncate(b.len() / 2));
    assert_mentions(&c.load_err(), &["config.json"]);
}

#[test]
fn malformed_index() {
    let edits: [fn(&Ckpt); 4] = [
        |c| c.edit_bytes(INDEX, |b| b.truncate(b.len() / 2)),
        |c| c.edit_json(INDEX, |v| *v = serde_json::json!({ "metadata": {} })),
        |c| c.edit_json(INDEX, |v| v["weight_map"][L3_O] = 7.into()),
        |c| c.edit_json(INDEX, |v| v["weight_map"][L3_O] = "../elsewhere.safetensors".into()),
    ];
    for edit in edits {
        let c = copy_fixture();
        edit(&c);
        assert_mentions(&c.load_err(), &[INDEX]);
    }
}

#[test]
fn no_weights_at_all() {
    let c = copy_fixture();
    for f in [INDEX, SHARD1, SHARD2] {
        std::fs::remove_file(c.path(f)).unwrap();
    }
    assert_mentions(&c.load_err(), &[INDEX, "model.safetensors"]);
}

#[test]
fn single_file_checkpoint_matches_sharded() {
    let c = copy_fixture();
    let mut all = read_tensors(&c.path(SHARD1));
    all.extend(read_tensors(&c.path(SHARD2)));
    for f in [INDEX, SHARD1, SHARD2] {
        std::fs::remove_file(c.path(f)).unwrap();
    }
    write_tensors(&c.path("model.safetensors"), &all);

    let single = common::load(&c.dir);
    let sharded = common::load(&fixture());
    assert_eq!(single.cfg, sharded.cfg);
    assert_eq!(single.skipped_mtp_tensors, sharded.skipped_mtp_tensors);
    let prompt: Vec<u32> = (0..23).map(|i| (i * 37 + 5) % 2112).collect();
    for p in [Precision::F32, Precision::Bf16] {
        let run = |m: &Model| {
            let mut pool = m.new_kv_pool(4, 16);
            m.forward(&mut pool, &mut Default::default(), &prompt, p, Logits::All).unwrap()
        };
        let (a, b) = (run(&single), run(&sharded));
        assert_eq!(a.len(), prompt.len() * 2112);
        assert!(a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()), "{p:?}: logits differ");
    }
}

#[test]
fn every_integer_config_field_at_its_extremes_loads_or_is_an_error() {
    // Each architecture's config.json with one integer field (a count, a
    // width, an id; nested ones too) set to 0, 1, 2^20, u32::MAX or 10^13:
    // the model loads and runs a pass, or one of them is an error; never a
    // panic or an abort on a failed allocation (a num_hidden_layers of 10^13
    // once sized a table before anything was checked).
    let mut failures = vec![];
    for name in ["tiny-dsv3", "tiny-qwen3moe", "tiny-mixtral"] {
        let source = fixture().join("..").join(name);
        let tmp = tempfile::tempdir().unwrap();
        for entry in std::fs::read_dir(&source).unwrap() {
            let entry = entry.unwrap();
            if entry.file_name() != "config.json" {
                std::os::unix::fs::symlink(entry.path(), tmp.path().join(entry.file_name())).unwrap();
            }
        }
        let config: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(source.join("config.json")).unwrap()).unwrap();
        let mut fields: Vec<Vec<String>> = vec![];
        for (key, value) in config.as_object().unwrap() {
            if value.is_u64() {
                fields.push(vec![key.clone()]);
            }
            for (inner, v) in value.as_object().into_iter().flatten() {
                if v.is_u64() {
                    fields.push(vec![key.clone(), inner.clone()]);
                }
            }
        }
        assert!(fields.len() >= 10, "{name}: {fields:?}");
        for field in fields {
            for value in [0u64, 1, 1 << 20, u32::MAX as u64, 10_000_000_000_000] {
                let mut edited = config.clone();
                *field.iter().fold(&mut edited, |v, k| &mut v[k]) = value.into();
                std::fs::write(tmp.path().join("config.json"), edited.to_string()).unwrap();
                let run = || -> Result<(), String> {
                    let m = Model::load(tmp.path(), &mut |_, _| {}).map_err(|e| e.to_string())?;
                    let vocab = m.cfg.vocab_size as u32;
                    let mut pool = m.new_kv_pool(2, 16);
                    m.forward(&mut pool, &mut Default::default(), &[1, 2, 3].map(|t| t % vocab), Precision::Bf16, Logits::Last).map_err(|e| e.to_string())?;
                    Ok(())
                };
                if catch_unwind(AssertUnwindSafe(run)).is_err() {
                    failures.push(format!("{name} {} = {value}: panicked", field.join(".")));
                }
            }
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}
