//! The GGUF reader on llama.cpp's Q4_K_M file of a tiny DeepSeek-V3 model
//! (`tests/fixtures/tiny-dsv3-q4km`), on files this test writes itself
//! (every metadata type, split parts), and on corrupt files.

use duplex_model::config::{Architecture, ScoringFunc};
use duplex_model::gguf::deepseek2::{self, HfSlice, KvBLayout};
use duplex_model::gguf::vocab::{token_type, GgufVocab};
use duplex_model::gguf::{split_file_name, GgmlType, Gguf, GgufError, GgufPart, Value, ValueType};
use proptest::prelude::*;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

fn fixture_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tiny-dsv3-q4km")
}

fn fixture_path() -> PathBuf {
    fixture_dir().join("model-Q4_K_M.gguf")
}

fn fixture() -> Gguf {
    Gguf::open(&fixture_path()).expect("the fixture opens")
}

use duplex_gguf::writer::Writer;

fn s(x: &str) -> Value {
    Value::String(x.into())
}

/// One value of every type, arrays of several, and arrays of arrays.
fn every_value_type() -> Vec<(&'static str, Value)> {
    vec![
        ("t.u8", Value::U8(200)),
        ("t.i8", Value::I8(-5)),
        ("t.u16", Value::U16(65000)),
        ("t.i16", Value::I16(-30000)),
        ("t.u32", Value::U32(4_000_000_000)),
        ("t.i32", Value::I32(-2_000_000_000)),
        ("t.f32", Value::F32(1.5)),
        ("t.bool", Value::Bool(true)),
        ("t.string", s("héllo ▁ wörld")),
        ("t.u64", Value::U64(u64::MAX)),
        ("t.i64", Value::I64(i64::MIN)),
        ("t.f64", Value::F64(-2.25e300)),
        ("t.arr_i32", Value::Array(ValueType::I32, vec![Value::I32(1), Value::I32(-2), Value::I32(3)])),
        ("t.arr_str", Value::Array(ValueType::String, vec![s("a"), s(""), s("Ġb c")])),
        ("t.arr_bool", Value::Array(ValueType::Bool, vec![Value::Bool(false), Value::Bool(true)])),
        ("t.arr_f64", Value::Array(ValueType::F64, vec![Value::F64(0.5)])),
        ("t.arr_empty", Value::Array(ValueType::U8, vec![])),
        (
            "t.nested",
            Value::Array(
                ValueType::Array,
                vec![
                    Value::Array(ValueType::U16, vec![Value::U16(7), Value::U16(8)]),
                    Value::Array(ValueType::String, vec![s("x")]),
                    Value::Array(ValueType::Array, vec![Value::Array(ValueType::I64, vec![Value::I64(-1)])]),
                ],
            ),
        ),
    ]
}

fn small_writer() -> Writer {
    let mut w = Writer::default().kv("general.architecture", s("test"));
    for (k, v) in every_value_type() {
        w = w.kv(k, v);
    }
    w.tensor("a.f32", &[4, 2], GgmlType::F32.id(), (0..32u8).collect())
        .tensor("b.q4k", &[256, 2], GgmlType::Q4K.id(), vec![7; 288])
        .tensor("c.q2k", &[256], GgmlType::Q2K.id(), vec![9; 84])
        .tensor("d.q8_0", &[64, 3], GgmlType::Q8_0.id(), vec![1; 2 * 3 * 34])
}

fn parse(bytes: Vec<u8>) -> Result<GgufPart, GgufError> {
    GgufPart::from_bytes(Path::new("/virtual/model.gguf"), bytes)
}

fn err_of(bytes: Vec<u8>) -> String {
    match parse(bytes) {
        Ok(_) => panic!("a corrupt file parsed"),
        Err(e) => e.to_string(),
    }
}

// ---------------------------------------------------------------- the fixture

#[test]
fn fixture_metadata_maps_to_the_readme_shape() {
    let g = fixture();
    assert_eq!(g.parts().len(), 1);
    assert_eq!(g.parts()[0].version, 3);
    assert_eq!(g.parts()[0].alignment, 32);
    assert_eq!(g.metadata().str("general.architecture").unwrap(), Some("deepseek2"));
    let c = deepseek2::model_config(&g).unwrap();
    assert_eq!(c.architecture, Architecture::DeepseekV3);
    assert_eq!((c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.vocab_size), (512, 4, 4, 2048));
    assert_eq!(c.moe_layers, vec![false, true, true, true], "the first layer is dense");
    assert_eq!((c.n_routed_experts, c.num_experts_per_tok, c.n_group, c.topk_group, c.n_shared_experts), (16, 4, 4, 2, 1));
    assert_eq!((c.intermediate_size, c.moe_intermediate_size), (1024, 256));
    let m = c.mla().unwrap();
    assert_eq!((m.kv_lora_rank, m.q_lora_rank, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim), (256, Some(256), 64, 64, 64));
    assert_eq!(c.scoring_func, ScoringFunc::Sigmoid);
    assert!(c.norm_topk_prob && c.use_correction_bias && c.rope_interleave && !c.tie_word_embeddings);
    assert_eq!(c.routed_scaling_factor, 2.5);
    assert_eq!((c.rope_theta, c.rms_norm_eps, c.max_position_embeddings), (10000.0, 1e-6, 2048));
    let y = c.rope_scaling.as_ref().unwrap();
    assert_eq!((y.factor, y.original_max_position_embeddings, y.beta_fast, y.beta_slow), (4.0, 512, 32.0, 1.0));
    assert_eq!((y.mscale, y.mscale_all_dim, y.attention_factor), (1.0, 1.0, None), "yarn_log_multiplier 0.1 is mscale_all_dim 1");
    assert_eq!((c.bos_token_id, c.eos_token_ids.clone()), (Some(0), vec![1]));
}

#[test]
fn fixture_tensors_have_valid_ranges_and_types() {
    let g = fixture();
    let part = &g.parts()[0];
    assert_eq!(g.tensors().len(), 70);
    let mut census: BTreeMap<&str, usize> = BTreeMap::new();
    let mut sorted: Vec<_> = g.tensors().iter().collect();
    sorted.sort_by_key(|t| t.start);
    let mut end = part.data_start;
    for t in &sorted {
        *census.entry(t.ty.name()).or_default() += 1;
        assert_eq!(t.start, part.data_start + t.offset, "{}", t.name);
        assert!(t.start >= end && t.start - end < part.alignment, "{} is packed after the previous tensor", t.name);
        assert_eq!(t.offset % part.alignment, 0);
        let rows: u64 = t.dims[1..].iter().product();
        assert_eq!(t.n_bytes, t.ty.row_bytes(t.dims[0]).unwrap() * rows, "{}", t.name);
        assert_eq!(t.n_elements, t.dims.iter().product::<u64>());
        assert_eq!(g.raw_bytes(t).len() as u64, t.n_bytes);
        end = t.start + t.n_bytes;
    }
    assert_eq!(end, part.len(), "the last tensor ends the file");
    // What llama-quantize chose for Q4_K_M here (gguf-py's reader agrees).
    assert_eq!(census, BTreeMap::from([("F32", 23), ("Q4_K", 38), ("Q5_0", 4), ("Q6_K", 5)]));
    let out = g.tensor("output.weight").unwrap();
    assert_eq!((out.ty, out.dims.clone(), out.start, out.n_bytes), (GgmlType::Q6K, vec![512, 2048], 66368, 860160));
    let emb = g.tensor("token_embd.weight").unwrap();
    assert_eq!((emb.ty, emb.start, emb.n_bytes, emb.hf_shape()), (GgmlType::Q4K, 928576, 589824, vec![2048, 512]));
    let exps = g.tensor("blk.1.ffn_gate_exps.weight").unwrap();
    assert_eq!(exps.hf_shape(), vec![16, 256, 512], "experts stacked outermost");
    // One expert of the stacked experts is a contiguous run of its rows.
    let raw = g.raw_bytes(exps);
    let each = 256 * GgmlType::Q4K.row_bytes(512).unwrap() as usize;
    assert_eq!(raw.len(), 16 * each);
    for e in 0..16 {
        assert_eq!(g.matrix_of(exps, e).unwrap(), &raw[e * each..(e + 1) * each]);
    }
    let e = g.matrix_of(exps, 16).unwrap_err().to_string();
    assert!(e.contains("blk.1.ffn_gate_exps.weight") && e.contains("matrix 16") && e.contains("16"), "{e}");
    let e = g.matrix_of(emb, 0).unwrap_err().to_string();
    assert!(e.contains("token_embd.weight") && e.contains("not three"), "{e}");
    assert_eq!(g.matrix_of(g.tensor("blk.2.attn_k_b.weight").unwrap(), 3).unwrap().len(), 256 * 2 * 22, "one head: 256 rows of 64 in Q5_0");
    // The norms are F32: their bytes are finite floats (the ranges point at data).
    let norm = g.raw_bytes(g.tensor("output_norm.weight").unwrap());
    assert!(norm.chunks_exact(4).all(|b| f32::from_le_bytes(b.try_into().unwrap()).is_finite()));
    // Every tensor of the fixture is of a type Duplex supports.
    for t in g.tensors() {
        let (info, bytes) = g.supported(&t.name).unwrap();
        assert_eq!(bytes.len() as u64, info.n_bytes);
    }
}

#[test]
fn fixture_names_cover_what_the_deepseek_loader_needs() {
    let g = fixture();
    let c = deepseek2::model_config(&g).unwrap();
    assert_eq!(deepseek2::kv_b_layout(&g).unwrap(), KvBLayout::Split, "the fixture's converter splits kv_b_proj");
    let kb = g.tensor("blk.0.attn_k_b.weight").unwrap();
    assert_eq!((kb.ty, kb.hf_shape()), (GgmlType::Q5_0, vec![4, 256, 64]), "[heads, kv_lora, qk_nope]");
    assert_eq!(g.tensor("blk.0.attn_v_b.weight").unwrap().hf_shape(), vec![4, 64, 256], "[heads, v_head_dim, kv_lora]");
    assert_eq!(deepseek2::hf_name("blk.0.attn_v_b.weight").unwrap().slice, HfSlice::KvBValues);
    let cov = deepseek2::coverage(&c, &g);
    assert!(cov.is_complete(), "{cov:?}");
    assert_eq!(cov.extra, Vec::<String>::new(), "the converter dropped the MTP layer");
    // 3 global + 12 dense-layer + 3 × (14 + 16 × 3) MoE-layer tensors.
    assert_eq!(deepseek2::duplex_tensors(&c).len(), 3 + 12 + 3 * (14 + 48));
}

#[test]
fn coverage_reports_missing_extra_and_misshapen_tensors() {
    let g = fixture();
    let mut c = deepseek2::model_config(&g).unwrap();
    // A config asking for one more layer and plain q_proj finds them missing;
    // layer 0's q_a tensors become extra.
    c.num_hidden_layers = 5;
    c.moe_layers.push(true);
    let cov = deepseek2::coverage(&c, &g);
    assert!(cov.missing.contains(&"model.layers.4.self_attn.kv_b_proj.weight".to_string()), "{:?}", cov.missing);
    assert!(cov.missing.contains(&"model.layers.4.mlp.experts.15.down_proj.weight".to_string()));
    let mut c = deepseek2::model_config(&g).unwrap();
    c.intermediate_size = 2048;
    c.attention = duplex_model::config::AttentionConfig::Mla(duplex_model::config::MlaConfig { q_lora_rank: None, ..c.mla().unwrap().clone() });
    let cov = deepseek2::coverage(&c, &g);
    assert!(cov.extra.contains(&"model.layers.0.self_attn.q_a_proj.weight".to_string()), "{:?}", cov.extra);
    assert!(cov.missing.contains(&"model.layers.2.self_attn.q_proj.weight".to_string()));
    assert!(cov.wrong_shape.contains(&("model.layers.0.mlp.up_proj.weight".to_string(), vec![2048, 512], vec![1024, 512])), "{:?}", cov.wrong_shape);
    assert!(!cov.is_complete());
}

#[test]
fn fixture_tokenizer_equals_its_tokenizer_json() {
    let g = fixture();
    let v = GgufVocab::from_metadata(g.metadata()).unwrap();
    assert_eq!((v.model.as_str(), v.pre.as_deref()), ("gpt2", Some("gpt-2")));
    let json: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(fixture_dir().join("tokenizer.json")).unwrap()).unwrap();
    let mut by_id: BTreeMap<u64, String> = BTreeMap::new();
    for (tok, id) in json["model"]["vocab"].as_object().unwrap() {
        by_id.insert(id.as_u64().unwrap(), tok.clone());
    }
    for added in json["added_tokens"].as_array().unwrap() {
        by_id.insert(added["id"].as_u64().unwrap(), added["content"].as_str().unwrap().to_string());
    }
    assert_eq!(by_id.keys().copied().collect::<Vec<_>>(), (0..v.tokens.len() as u64).collect::<Vec<_>>(), "ids are dense");
    assert_eq!(by_id.into_values().collect::<Vec<_>>(), v.tokens, "same token at every id");
    let merges: Vec<String> = json["model"]["merges"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| match m {
            serde_json::Value::String(s) => s.clone(),
            pair => format!("{} {}", pair[0].as_str().unwrap(), pair[1].as_str().unwrap()),
        })
        .collect();
    assert_eq!(merges, v.merges);
    assert_eq!((v.bos_token_id, v.eos_token_id, v.add_bos_token, v.add_eos_token), (Some(0), Some(1), Some(true), Some(false)));
    assert_eq!(v.token_types.len(), v.tokens.len());
    assert!(v.is_control(0) && v.is_control(1) && !v.is_control(500));
    assert_eq!(v.token_types[500], token_type::NORMAL);
    let cfg: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(fixture_dir().join("tokenizer_config.json")).unwrap()).unwrap();
    assert_eq!(v.chat_template.as_deref(), cfg["chat_template"].as_str(), "the template is tokenizer_config.json's");
}

// ---------------------------------------------------------------- written files

#[test]
fn every_metadata_type_reads_back() {
    let (bytes, offsets) = small_writer().bytes();
    let p = parse(bytes).unwrap();
    for (k, v) in every_value_type() {
        assert_eq!(p.metadata.get(k), Some(&v), "{k}");
    }
    assert_eq!(p.metadata.usize("t.u32").unwrap(), Some(4_000_000_000));
    assert!(p.metadata.usize("t.i8").unwrap_err().to_string().contains("t.i8"), "a negative count is an error naming the key");
    assert!(p.metadata.str("t.u8").unwrap_err().to_string().contains("expected a string"));
    assert_eq!(p.metadata.f64("t.f32").unwrap(), Some(1.5));
    assert_eq!(p.tensors.iter().map(|t| t.offset).collect::<Vec<_>>(), offsets);
    assert_eq!(p.tensors[1].n_bytes, 288);
    assert_eq!(p.version, 3);
}

#[test]
fn version_2_and_a_custom_alignment_read() {
    let mut w = small_writer().kv("general.alignment", Value::U32(64));
    w.alignment = 64;
    w.version = 2;
    let (bytes, _) = w.bytes();
    let p = parse(bytes).unwrap();
    assert_eq!((p.version, p.alignment), (2, 64));
    assert_eq!(p.data_start % 64, 0);
    assert!(p.tensors.iter().all(|t| t.start % 64 == 0));
}

#[test]
fn unsupported_types_are_an_error_naming_tensor_and_type_when_asked() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("small.gguf");
    std::fs::write(&path, small_writer().bytes().0).unwrap();
    let g = Gguf::open(&path).unwrap();
    assert_eq!(g.tensor("c.q2k").unwrap().ty, GgmlType::Q2K, "listing it is fine");
    let e = g.supported("c.q2k").unwrap_err().to_string();
    assert!(e.contains("c.q2k") && e.contains("Q2_K") && e.contains("small.gguf") && e.contains("Q4_K"), "{e}");
    assert_eq!(g.supported("b.q4k").unwrap().1, &[7u8; 288][..]);
    assert_eq!(g.supported("a.f32").unwrap().1, &(0..32u8).collect::<Vec<_>>()[..]);
    let e = g.tensor("nope").unwrap_err().to_string();
    assert!(e.contains("nope") && e.contains("small.gguf"), "{e}");
}

/// Write the fixture as `parts` split files (llama-gguf-split's layout: all
/// metadata in the first, split keys in every one, tensors in order).
fn write_split(dir: &Path, parts: usize) -> Vec<PathBuf> {
    let g = fixture();
    let n = g.tensors().len();
    let per = n.div_ceil(parts);
    let mut paths = vec![];
    for i in 0..parts {
        let mut w = Writer::default();
        if i == 0 {
            for k in g.metadata().keys() {
                w = w.kv(k, g.metadata().get(k).unwrap().clone());
            }
        }
        w = w.kv("split.no", Value::U16(i as u16)).kv("split.count", Value::U16(parts as u16)).kv("split.tensors.count", Value::I32(n as i32));
        for t in g.tensors().iter().skip(i * per).take(per) {
            w = w.tensor(&t.name, &t.dims, t.ty.id(), g.raw_bytes(t).to_vec());
        }
        let path = dir.join(format!("tiny-{:05}-of-{parts:05}.gguf", i + 1));
        std::fs::write(&path, w.bytes().0).unwrap();
        paths.push(path);
    }
    paths
}

#[test]
fn split_files_read_as_one_table() {
    let dir = tempfile::tempdir().unwrap();
    let paths = write_split(dir.path(), 3);
    assert_eq!(split_file_name(&paths[1]), Some(("tiny".into(), 2, 3)));
    let whole = fixture();
    // Naming any part opens them all.
    for p in [&paths[0], &paths[2]] {
        let g = Gguf::open(p).unwrap();
        assert_eq!(g.parts().len(), 3);
        assert_eq!(g.path(), paths[0]);
        assert_eq!(g.tensors().len(), whole.tensors().len());
        for t in whole.tensors() {
            let s = g.tensor(&t.name).unwrap();
            assert_eq!((&s.dims, s.ty, s.n_bytes), (&t.dims, t.ty, t.n_bytes));
            assert_eq!(g.raw_bytes(s), whole.raw_bytes(t), "{}", t.name);
        }
        assert_eq!(g.tensor("blk.3.ffn_up_shexp.weight").unwrap().part, 2);
        assert_eq!(deepseek2::model_config(&g).unwrap(), deepseek2::model_config(&whole).unwrap());
        assert!(deepseek2::coverage(&deepseek2::model_config(&g).unwrap(), &g).is_complete());
    }
    // A missing part is an error naming it.
    std::fs::remove_file(&paths[1]).unwrap();
    let e = Gguf::open(&paths[0]).err().unwrap().to_string();
    assert!(e.contains("tiny-00002-of-00003.gguf"), "{e}");
}

#[test]
fn inconsistent_split_keys_are_errors() {
    let dir = tempfile::tempdir().unwrap();
    let paths = write_split(dir.path(), 2);
    // The first part given twice: the second copy claims split.no 0.
    let first = || GgufPart::open(&paths[0]).unwrap();
    let e = Gguf::from_parts(vec![first(), first()]).err().unwrap().to_string();
    assert!(e.contains("split.no 0") && e.contains("00001-of-00002"), "{e}");
    // One part alone is not the model.
    let e = Gguf::from_parts(vec![first()]).err().unwrap().to_string();
    assert!(e.contains("split.count is 2 but 1 part(s)"), "{e}");
    // A wrong tensor total.
    let (bytes, _) = Writer::default()
        .kv("split.no", Value::U16(0))
        .kv("split.count", Value::U16(2))
        .kv("split.tensors.count", Value::I32(5))
        .tensor("x", &[4], 0, vec![0; 16])
        .bytes();
    std::fs::write(&paths[0], bytes).unwrap();
    let e = Gguf::open(&paths[0]).err().unwrap().to_string();
    assert!(e.contains("split.tensors.count is 5"), "{e}");
    // split.count > 1 under a name that does not say where the others are.
    let odd = dir.path().join("model.gguf");
    std::fs::copy(&paths[1], &odd).unwrap();
    let e = Gguf::open(&odd).err().unwrap().to_string();
    assert!(e.contains("model.gguf") && e.contains("split.count is 2"), "{e}");
    // The same tensor in two parts.
    let dup = |no: u16| Writer::default().kv("split.no", Value::U16(no)).kv("split.count", Value::U16(2)).tensor("x", &[4], 0, vec![0; 16]).bytes().0;
    std::fs::write(&paths[0], dup(0)).unwrap();
    std::fs::write(&paths[1], dup(1)).unwrap();
    let e = Gguf::open(&paths[0]).err().unwrap().to_string();
    assert!(e.contains("tensor x") && e.contains("earlier part"), "{e}");
}

/// The fixture rewritten: `kv` edits its metadata (in order), `tensors`
/// its tensor list; written to `dir/name`.
fn rewrite_fixture(
    dir: &Path,
    name: &str,
    kv: impl Fn(&mut Vec<(String, Value)>),
    tensors: impl Fn(&mut Vec<(String, Vec<u64>, u32, Vec<u8>)>),
) -> Gguf {
    rewrite(&fixture(), dir, name, kv, tensors)
}

/// [`rewrite_fixture`] of any GGUF `g`.
fn rewrite(
    g: &Gguf,
    dir: &Path,
    name: &str,
    kv: impl Fn(&mut Vec<(String, Value)>),
    tensors: impl Fn(&mut Vec<(String, Vec<u64>, u32, Vec<u8>)>),
) -> Gguf {
    let mut kvs: Vec<(String, Value)> = g.metadata().keys().map(|k| (k.to_string(), g.metadata().get(k).unwrap().clone())).collect();
    kv(&mut kvs);
    let mut ts: Vec<_> = g.tensors().iter().map(|t| (t.name.clone(), t.dims.clone(), t.ty.id(), g.raw_bytes(t).to_vec())).collect();
    tensors(&mut ts);
    let w = Writer { version: 3, alignment: 32, kvs, tensors: ts };
    let path = dir.join(name);
    std::fs::write(&path, w.bytes().0).unwrap();
    Gguf::open(&path).unwrap()
}

fn set(kvs: &mut Vec<(String, Value)>, key: &str, v: Option<Value>) {
    kvs.retain(|(k, _)| k != key);
    if let Some(v) = v {
        kvs.push((key.into(), v));
    }
}

#[test]
fn the_older_converters_fused_kv_b_and_per_head_widths_map_alike() {
    // Before llama.cpp's MLA support: attn_kv_b as the HF matrix, per-head
    // widths under key_length/value_length, no _mla keys.
    let dir = tempfile::tempdir().unwrap();
    let old = rewrite_fixture(
        dir.path(),
        "old.gguf",
        |kvs| {
            set(kvs, "deepseek2.attention.key_length_mla", None);
            set(kvs, "deepseek2.attention.value_length_mla", None);
            set(kvs, "deepseek2.attention.key_length", Some(Value::U32(128)));
            set(kvs, "deepseek2.attention.value_length", Some(Value::U32(64)));
            set(kvs, "deepseek2.attention.head_count_kv", Some(Value::U32(4)));
        },
        |ts| {
            ts.retain(|t| !t.0.contains("attn_k_b") && !t.0.contains("attn_v_b"));
            for l in 0..4 {
                // [heads · (nope + v), kv_lora] = ggml [256, 512], F32.
                ts.push((format!("blk.{l}.attn_kv_b.weight"), vec![256, 512], 0, vec![0; 256 * 512 * 4]));
            }
        },
    );
    assert_eq!(deepseek2::kv_b_layout(&old).unwrap(), KvBLayout::Fused);
    assert_eq!(deepseek2::model_config(&old).unwrap(), deepseek2::model_config(&fixture()).unwrap());
    let cov = deepseek2::coverage(&deepseek2::model_config(&old).unwrap(), &old);
    assert!(cov.is_complete(), "{cov:?}");
    // A lone half of the split form is not kv_b_proj.
    let half = rewrite_fixture(dir.path(), "half.gguf", |_| {}, |ts| ts.retain(|t| t.0 != "blk.2.attn_v_b.weight"));
    let cov = deepseek2::coverage(&deepseek2::model_config(&half).unwrap(), &half);
    assert_eq!(cov.missing, vec!["model.layers.2.self_attn.kv_b_proj.weight".to_string()]);
}

#[test]
fn counts_beyond_llama_cpps_limits_are_clear_errors() {
    // A corrupt layer or expert count must not size anything: before, a
    // block_count of 0xff000004 (one flipped byte) built a name for every
    // tensor of four billion layers and ran out of memory.
    let dir = tempfile::tempdir().unwrap();
    let qwen = Gguf::open(&fixture_dir().join("../tiny-qwen3moe-q4km/model-Q4_K_M.gguf")).unwrap();
    for (g, arch) in [(fixture(), "deepseek2"), (qwen, "qwen3moe")] {
        for (key, n) in [("block_count", 0xff00_0004u32), ("expert_count", 1025)] {
            let key = format!("{arch}.{key}");
            let bad = rewrite(&g, dir.path(), "counts.gguf", |kvs| set(kvs, &key, Some(Value::U32(n))), |_| {});
            let e = duplex_model::gguf::open(bad.path()).err().unwrap().to_string();
            assert!(e.contains(&key) && e.contains(&format!("is {n}, more than the")) && e.contains("counts.gguf"), "{e}");
        }
    }
}

/// Load `path` the way every process does, then prefill three tokens and
/// decode one: `Ok` or the first error (those of the passes, which refuse
/// the request and not the model, marked "pass:").
fn load_and_run(path: &Path) -> Result<(), String> {
    use duplex_model::{BlockTable, Logits, Model, Precision};
    let source = duplex_model::source::ModelSource::locate(path).map_err(|e| e.to_string())?;
    source.config().map_err(|e| e.to_string())?;
    let model = Model::load_source(&source, &duplex_kernels::pool::PoolConfig::single_node(1), &mut |_, _| {}).map_err(|e| e.to_string())?;
    let (mut kv, mut table) = (model.new_kv_pool(2, 16), BlockTable::default());
    let vocab = model.cfg.vocab_size as u32;
    let pass = |e: duplex_model::model::ForwardError| format!("pass: {e}");
    model.forward(&mut kv, &mut table, &[1, 2, 3].map(|t| t % vocab), Precision::F32, Logits::Last).map_err(pass)?;
    model.forward(&mut kv, &mut table, &[4 % vocab], Precision::Bf16, Logits::Last).map_err(pass)?;
    Ok(())
}

#[test]
fn every_integer_key_at_its_extremes_loads_or_is_a_clear_error() {
    // Each architecture's fixture with one integer key (a count, a width,
    // an id) set to 0, 1, 2^20, u32::MAX or u64::MAX: the model loads and
    // runs, or is refused with an error naming the file (or, a context_length
    // of 0 or 1, the passes are refused); never a panic, an
    // abort on a failed allocation or memory exhausted (each once happened:
    // widths whose products overflowed, a feed_forward_length, a
    // block_count).
    let dir = tempfile::tempdir().unwrap();
    let mut failures = vec![];
    for fixture in ["tiny-dsv3-q4km", "tiny-qwen3moe-q4km", "tiny-mixtral-q4km"] {
        let g = Gguf::open(&fixture_dir().join("..").join(fixture).join("model-Q4_K_M.gguf")).unwrap();
        let keys: Vec<String> = g.metadata().keys().filter(|k| g.metadata().get(k).unwrap().as_int().is_some()).map(String::from).collect();
        assert!(keys.len() >= 15, "{fixture}: {keys:?}");
        for key in keys {
            for value in [Value::U32(0), Value::U32(1), Value::U32(1 << 20), Value::U32(u32::MAX), Value::U64(u64::MAX)] {
                let case = format!("{fixture} {key} = {value:?}");
                let g = rewrite(&g, dir.path(), "extreme.gguf", |kvs| set(kvs, &key, Some(value.clone())), |_| {});
                match std::panic::catch_unwind(|| load_and_run(g.path())) {
                    Ok(Err(e)) if !e.contains("extreme.gguf") && !e.starts_with("pass: ") => failures.push(format!("{case}: the error does not name the file: {e}")),
                    Ok(_) => {}
                    Err(_) => failures.push(format!("{case}: panicked")),
                }
            }
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

#[test]
fn yarn_betas_routing_and_tying_come_from_the_metadata() {
    let dir = tempfile::tempdir().unwrap();
    let g = rewrite_fixture(
        dir.path(),
        "edited.gguf",
        |kvs| {
            // Values unlike llama.cpp's defaults, so reading them shows.
            set(kvs, "deepseek2.rope.scaling.yarn_beta_fast", Some(Value::F32(48.0)));
            set(kvs, "deepseek2.rope.scaling.yarn_beta_slow", Some(Value::F32(2.0)));
            set(kvs, "deepseek2.rope.scaling.yarn_log_multiplier", Some(Value::F32(0.0707)));
            set(kvs, "deepseek2.expert_gating_func", None);
            set(kvs, "deepseek2.expert_weights_norm", None);
            set(kvs, "deepseek2.leading_dense_block_count", Some(Value::U32(2)));
        },
        |ts| ts.retain(|t| t.0 != "output.weight" && !t.0.contains("exp_probs_b")),
    );
    let c = deepseek2::model_config(&g).unwrap();
    let y = c.rope_scaling.as_ref().unwrap();
    assert_eq!((y.beta_fast, y.beta_slow), (48.0, 2.0));
    assert!((y.mscale_all_dim - 0.707).abs() < 1e-6 && y.mscale == y.mscale_all_dim, "{y:?}");
    assert_eq!(c.scoring_func, ScoringFunc::Softmax, "no gating key: DeepSeek-V2's softmax");
    assert!(!c.norm_topk_prob && !c.use_correction_bias && c.tie_word_embeddings);
    assert_eq!(c.moe_layers, vec![false, false, true, true]);
    // Without the scaling type there is no YaRN; a type Duplex lacks is an error.
    let plain = rewrite_fixture(dir.path(), "plain.gguf", |kvs| set(kvs, "deepseek2.rope.scaling.type", None), |_| {});
    assert_eq!(deepseek2::model_config(&plain).unwrap().rope_scaling, None);
    let linear = rewrite_fixture(dir.path(), "linear.gguf", |kvs| set(kvs, "deepseek2.rope.scaling.type", Some(s("linear"))), |_| {});
    let e = deepseek2::model_config(&linear).err().unwrap().to_string();
    assert!(e.contains("deepseek2.rope.scaling.type") && e.contains("linear") && e.contains("linear.gguf"), "{e}");
    let bad = rewrite_fixture(dir.path(), "vocab.gguf", |kvs| set(kvs, "deepseek2.vocab_size", Some(Value::U32(4096))), |_| {});
    let e = deepseek2::model_config(&bad).err().unwrap().to_string();
    assert!(e.contains("deepseek2.vocab_size") && e.contains("2048 tokens"), "{e}");
    let groups = rewrite_fixture(dir.path(), "groups.gguf", |kvs| set(kvs, "deepseek2.expert_group_count", Some(Value::U32(3))), |_| {});
    let e = deepseek2::model_config(&groups).err().unwrap().to_string();
    assert!(e.contains("n_group (3)") && e.contains("groups.gguf"), "the engine's own validation runs: {e}");
}

// ---------------------------------------------------------------- corrupt files

#[test]
fn corrupt_headers_are_clear_errors() {
    let (good, _) = small_writer().bytes();
    let mut bad_magic = good.clone();
    bad_magic[..4].copy_from_slice(b"GGUG");
    assert!(err_of(bad_magic).contains("bad magic"));
    let e = err_of(good[..good.len() / 3].to_vec());
    assert!(e.contains("/virtual/model.gguf") && e.contains("file ends inside"), "{e}");
    let mut v1 = good.clone();
    v1[4..8].copy_from_slice(&1u32.to_le_bytes());
    assert!(err_of(v1).contains("version 1"));
    let mut be = good.clone();
    be[4..8].copy_from_slice(&3u32.to_be_bytes());
    assert!(err_of(be).contains("big-endian"));
    let mut huge = good.clone();
    huge[16..24].copy_from_slice(&u64::MAX.to_le_bytes());
    assert!(err_of(huge).contains("metadata"), "a huge key count fails, it does not allocate");

    let w = |f: fn(Writer) -> Writer| err_of(f(Writer::default()).bytes().0);
    let e = w(|w| w.tensor("weird", &[32], 99, vec![0; 64]));
    assert!(e.contains("weird") && e.contains("unknown ggml type id 99"), "{e}");
    let e = w(|w| w.tensor("ragged", &[100, 2], GgmlType::Q4K.id(), vec![0; 288]));
    assert!(e.contains("ragged") && e.contains("not whole Q4_K blocks"), "{e}");
    let e = w(|w| w.tensor("flat", &[], 0, vec![]));
    assert!(e.contains("flat") && e.contains("0 dimensions"), "{e}");
    let e = w(|w| w.tensor("x", &[4], 0, vec![0; 16]).tensor("x", &[4], 0, vec![0; 16]));
    assert!(e.contains("tensor x") && e.contains("twice"), "{e}");
    let e = w(|w| w.kv("k", Value::U8(1)).kv("k", Value::U8(2)));
    assert!(e.contains("metadata key k appears twice"), "{e}");
    let e = w(|w| w.kv("general.alignment", Value::U32(48)));
    assert!(e.contains("general.alignment") && e.contains("power of two"), "{e}");
    let e = w(|w| w.tensor("big", &[u64::MAX, 4], 0, vec![]));
    assert!(e.contains("big") && e.contains("overflow"), "{e}");
    let mut nest = Value::Array(ValueType::U8, vec![]);
    for _ in 0..12 {
        nest = Value::Array(ValueType::Array, vec![nest]);
    }
    let (deep, _) = Writer::default().kv("deep", nest).bytes();
    assert!(err_of(deep).contains("nested deeper"));
    let (mut bad_bool, _) = Writer::default().kv("flag", Value::Bool(true)).bytes();
    let last = bad_bool.iter().rposition(|&b| b == 1).unwrap();
    bad_bool[last] = 7;
    assert!(err_of(bad_bool).contains("bool byte 7"));
}

#[test]
fn lengths_that_name_most_of_a_huge_file_are_errors_not_aborts() {
    // Bounded by the bytes left, a corrupt string length or count can still
    // name most of a 400 GB model. Here sparse files of 1.1 and 8.1 TB: a
    // string of 2^40 bytes, an array of 2^43 u8 values (256 TB as parsed
    // values: more than any address space holds, whatever the overcommit
    // policy), 2^35 tensors: each once aborted the process on its
    // allocation.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("huge.gguf");
    let sparse = |bytes: &[u8], len: u64| {
        std::fs::write(&path, bytes).unwrap();
        std::fs::File::options().write(true).open(&path).unwrap().set_len(len).unwrap();
        Gguf::open(&path).err().expect("parsed").to_string()
    };
    let cases = [("name", s("abcdefgh"), 40, "bytes long"), ("bytes", Value::Array(ValueType::U8, vec![Value::U8(1); 8]), 43, "cannot be allocated")];
    for (key, value, log2, says) in cases {
        let (mut bytes, _) = Writer::default().kv(key, value).bytes();
        // The key's value type, then the string's length or the array's
        // element type and count.
        let mut needle = (key.len() as u64).to_le_bytes().to_vec();
        needle.extend(key.as_bytes());
        let at = bytes.windows(needle.len()).position(|x| x == needle.as_slice()).unwrap() + needle.len() + 4;
        let at = if key == "bytes" { at + 4 } else { at };
        bytes[at..at + 8].copy_from_slice(&(1u64 << log2).to_le_bytes());
        let e = sparse(&bytes, (1 << log2) + (1 << 37));
        assert!(e.contains("huge.gguf") && e.contains(key) && e.contains(&(1u64 << log2).to_string()) && e.contains(says), "{e}");
    }
    // A tensor count of 2^35 (24 bytes each at least: 0.8 TB). Refused when
    // the table cannot be allocated, else at the first tensor's zero
    // dimensions: an error either way.
    let (mut bytes, _) = Writer::default().bytes();
    bytes[8..16].copy_from_slice(&(1u64 << 35).to_le_bytes());
    let e = sparse(&bytes, (1 << 40) + (1 << 37));
    assert!(e.contains("huge.gguf") && (e.contains("the tensor count: a length of 34359738368") || e.contains("0 dimensions")), "{e}");
}

/// Rewrite the offset field of tensor `index` (of the writer's tensors).
fn with_offset(w: &Writer, index: usize, offset: u64) -> Vec<u8> {
    let (mut bytes, _) = w.bytes();
    let name = &w.tensors[index].0;
    // The name is followed by n_dims, the dims, the type and the offset.
    let mut needle = (name.len() as u64).to_le_bytes().to_vec();
    needle.extend(name.as_bytes());
    let at = bytes.windows(needle.len()).position(|x| x == needle.as_slice()).unwrap() + needle.len();
    let at = at + 4 + 8 * w.tensors[index].1.len() + 4;
    bytes[at..at + 8].copy_from_slice(&offset.to_le_bytes());
    bytes
}

#[test]
fn tensor_ranges_past_the_end_overlapping_or_misaligned_are_errors() {
    let w = small_writer();
    let e = err_of(with_offset(&w, 3, 1 << 20));
    assert!(e.contains("d.q8_0") && e.contains("past the end"), "{e}");
    let e = err_of(with_offset(&w, 2, 0));
    assert!(e.contains("overlap") && e.contains("a.f32") && e.contains("c.q2k"), "{e}");
    let e = err_of(with_offset(&w, 1, 8));
    assert!(e.contains("b.q4k") && e.contains("not a multiple of the alignment"), "{e}");
    // Cut one byte of the last tensor (not of the padding after it).
    let (bytes, _) = w.bytes();
    let last_end = parse(bytes.clone()).unwrap().tensors.iter().map(|t| t.start + t.n_bytes).max().unwrap();
    let e = err_of(bytes[..last_end as usize - 1].to_vec());
    assert!(e.contains("d.q8_0") && e.contains("truncated"), "{e}");
    // The fixture truncated anywhere: never a panic, always an error naming it.
    let fixture = std::fs::read(fixture_path()).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("cut.gguf");
    for cut in [0, 3, 7, 23, 1000, 60_000, 66_368, 8_000_000, fixture.len() - 1] {
        std::fs::write(&path, &fixture[..cut]).unwrap();
        let e = Gguf::open(&path).err().unwrap_or_else(|| panic!("cut at {cut} parsed")).to_string();
        assert!(e.contains("cut.gguf"), "{e}");
    }
}

#[test]
fn a_config_from_other_metadata_is_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("small.gguf");
    std::fs::write(&path, small_writer().bytes().0).unwrap();
    let e = deepseek2::model_config(&Gguf::open(&path).unwrap()).err().unwrap().to_string();
    assert!(e.contains("general.architecture") && e.contains("\"test\""), "{e}");
    // deepseek2 without its block count.
    let (bytes, _) = Writer::default().kv("general.architecture", s("deepseek2")).kv("tokenizer.ggml.model", s("gpt2")).kv("tokenizer.ggml.tokens", Value::Array(ValueType::String, vec![s("a")])).bytes();
    std::fs::write(&path, bytes).unwrap();
    let e = deepseek2::model_config(&Gguf::open(&path).unwrap()).err().unwrap().to_string();
    assert!(e.contains("deepseek2.block_count") && e.contains("missing"), "{e}");
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    /// Any truncation or corruption of a small file's bytes is an error
    /// naming the file or a successful parse whose ranges lie in the file.
    #[test]
    fn mutated_files_never_panic(cut in 0usize..2000, flips in proptest::collection::vec((0usize..2000, any::<u8>()), 0..6)) {
        let (mut bytes, _) = small_writer().bytes();
        for (at, b) in flips {
            let n = bytes.len();
            bytes[at % n] = b;
        }
        let cut = cut.min(bytes.len());
        bytes.truncate(if cut == 0 { bytes.len() } else { cut });
        let len = bytes.len() as u64;
        match parse(bytes) {
            Ok(p) => {
                for t in &p.tensors {
                    prop_assert!(t.start + t.n_bytes <= len);
                }
            }
            Err(e) => prop_assert!(e.to_string().contains("/virtual/model.gguf"), "{}", e),
        }
    }

    /// The same for the fixture's header (the tensor data left intact).
    #[test]
    fn mutated_fixture_headers_never_panic(flips in proptest::collection::vec((0usize..66_368, any::<u8>()), 1..4)) {
        let mut bytes = std::fs::read(fixture_path()).unwrap();
        for (at, b) in flips {
            bytes[at] = b;
        }
        if let Err(e) = parse(bytes) {
            prop_assert!(e.to_string().contains("/virtual/model.gguf"), "{}", e);
        }
    }
}

#[test]
fn a_model_with_a_tensor_of_an_unsupported_type_is_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    // I32 has F32's size, so only the type changes.
    let g = rewrite_fixture(dir.path(), "i32.gguf", |_| {}, |ts| ts.iter_mut().filter(|t| t.0 == "output_norm.weight").for_each(|t| t.2 = GgmlType::I32.id()));
    let e = duplex_model::gguf::open(g.path()).err().expect("an I32 norm is refused").to_string();
    assert!(e.contains("output_norm.weight") && e.contains("I32") && e.contains("i32.gguf"), "{e}");
    // And through the loader every process uses.
    let e = duplex_model::Model::load_with(g.path(), &duplex_kernels::pool::PoolConfig::single_node(1), &mut |_, _| {}).err().expect("refused").to_string();
    assert!(e.contains("output_norm.weight") && e.contains("I32"), "{e}");
}

/// Every type the reader calls supported is one the kernels read (a Q5_K_M
/// file's Q5_1 once passed the first and failed the second, with an error
/// that named Q5_1 among the supported types), and every kernel format is
/// one the reader accepts.
#[test]
fn the_readers_supported_types_are_the_kernels_formats() {
    use duplex_kernels::quant::QuantKind;
    for t in duplex_model::gguf::types::DUPLEX_SUPPORTED {
        let kind = QuantKind::from_ggml_type(t.id()).unwrap_or_else(|| panic!("{t} is called supported but no kernel reads it"));
        assert_eq!(kind.name(), t.name());
    }
    for kind in QuantKind::ALL {
        assert!(GgmlType::from_id(kind.ggml_type()).is_some_and(|t| t.is_supported()), "{kind} is read by the kernels but refused by the reader");
    }
}

#[test]
fn another_architecture_is_a_clear_error_naming_the_supported_ones() {
    let dir = tempfile::tempdir().unwrap();
    let g = rewrite_fixture(dir.path(), "gemma.gguf", |kvs| set(kvs, "general.architecture", Some(s("gemma3"))), |_| {});
    let e = duplex_model::gguf::open(g.path()).err().expect("refused").to_string();
    assert!(e.contains("gemma3") && e.contains("deepseek2") && e.contains("qwen3moe") && e.contains("llama"), "{e}");
}
