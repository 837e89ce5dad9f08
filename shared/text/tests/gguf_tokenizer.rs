//! The tokenizer of a GGUF model, built from its metadata, against the
//! `tokenizer.json` it was converted from: the fixture
//! `tests/fixtures/tiny-dsv3-q4km` holds llama.cpp's GGUF (`tokenizer.ggml.
//! model = gpt2`, `pre = gpt-2`) and the Hugging Face tokenizer files beside
//! it. Also the model-path convention (`from_model_path`: a tokenizer.json
//! beside the GGUF wins), the served facts from GGUF metadata, and clear
//! errors for GGUFs this cannot build (written here by a small GGUF writer).

use duplex_gguf::{Gguf, GgufPart, Value};
use duplex_text::tokenizer::{ChatMessage, IncrementalDecoder, Tokenizer, TokenizerError};
use duplex_text::{check_model_dir, sampling_defaults, ServedConfig};
use std::path::{Path, PathBuf};

fn fixture_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tiny-dsv3-q4km")
}

fn fixture_gguf() -> PathBuf {
    fixture_dir().join("model-Q4_K_M.gguf")
}

fn open_fixture() -> Gguf {
    Gguf::open(&fixture_gguf()).expect("the fixture opens")
}

/// The fixture's tokenizer from its GGUF metadata, and from its
/// tokenizer.json (the reference).
fn both() -> (Tokenizer, Tokenizer) {
    let from_gguf = Tokenizer::from_gguf(&open_fixture()).unwrap_or_else(|e| panic!("from_gguf: {e}"));
    let from_json = Tokenizer::from_dir(&fixture_dir()).unwrap_or_else(|e| panic!("from_dir: {e}"));
    (from_gguf, from_json)
}

fn msg(role: &str, content: &str) -> ChatMessage {
    ChatMessage::new(role, content)
}

/// Text of every kind a byte-level BPE and its split regex treat apart.
fn corpus() -> Vec<String> {
    let bos = "<｜begin▁of▁sentence｜>";
    let eos = "<｜end▁of▁sentence｜>";
    let mut texts: Vec<String> = [
        "",
        "Hello, world!",
        "The quick brown fox jumps over the lazy dog.",
        "It's, they're, we've, I'm, you'll, he'd, IT'S, WE'VE",
        "0 12 345 6789 1234567890 3.14159 1,000,000 -42 +7e10",
        "!!! ??? ... --- (a) [b] {c} <d> \"q\" 'q' `code` a+b=c; x->y && z || w",
        "trailing spaces   ",
        "   leading spaces",
        "tabs\tand\t\tmore\ttabs",
        "line one\nline two\n\nline four\r\nwindows\rold mac",
        "\n\n\n",
        " ",
        "many     spaces  between   words",
        "  \n  \t \n",
        "中文文本，测试一下。日本語のテキスト、カタカナ。한국어 텍스트",
        "emoji 😀👍🏽 family 👨‍👩‍👧‍👦 flags 🇫🇷🇯🇵",
        "café naïve résumé Ærøskøbing Ελληνικά Русский текст עברית العربية",
        "combining e\u{301} and a\u{308}, zero\u{200b}width",
        "def f(x):\n    return x ** 2  # square\n",
        "mixed123abc ABC123 a1b2c3 __init__ snake_case camelCase",
        "\u{0}\u{1}\u{7f} control bytes",
        "fullwidth ＡＢＣ！ and ideographic space\u{3000}here",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    texts.push(format!("{bos}text after BOS"));
    texts.push(format!("before EOS{eos}"));
    texts.push(format!("<｜User｜>hi<｜Assistant｜>hello{eos}<｜User｜> again"));
    texts.push(format!("half a marker <｜User and {bos}{bos}"));
    texts
}

#[test]
fn the_fixture_says_gpt2_with_the_gpt2_pre_tokenizer() {
    let g = open_fixture();
    let md = g.metadata();
    assert_eq!(md.str("tokenizer.ggml.model").unwrap(), Some("gpt2"));
    assert_eq!(md.str("tokenizer.ggml.pre").unwrap(), Some("gpt-2"));
}

#[test]
fn encodes_every_text_to_the_ids_of_its_tokenizer_json() {
    let (g, j) = both();
    for text in corpus() {
        // Trusted text: special-token strings are their ids.
        assert_eq!(g.encode(&text).unwrap(), j.encode(&text).unwrap(), "encode {text:?}");
        assert_eq!(g.encode_raw(&text).unwrap(), j.encode_raw(&text).unwrap(), "encode_raw {text:?}");
        // Client text: special-token strings are plain text.
        assert_eq!(g.encode_text(&text).unwrap(), j.encode_text(&text).unwrap(), "encode_text {text:?}");
    }
}

#[test]
fn decodes_every_text_as_its_tokenizer_json_does() {
    let (g, j) = both();
    for text in corpus() {
        for ids in [j.encode(&text).unwrap(), j.encode_text(&text).unwrap()] {
            assert_eq!(g.decode(&ids), j.decode(&ids), "decode of {text:?}");
            let mut stream = IncrementalDecoder::new();
            let mut streamed: String = ids.iter().map(|&id| stream.push(&g, id)).collect();
            streamed.push_str(&stream.finish(&g));
            assert_eq!(streamed, j.decode(&ids), "streamed decode of {text:?}");
        }
        // Client text has no special tokens, so it decodes back exactly.
        assert_eq!(g.decode(&g.encode_text(&text).unwrap()), text, "round trip of {text:?}");
    }
}

#[test]
fn every_token_bos_and_eos_are_the_same() {
    let (g, j) = both();
    assert_eq!(g.vocab_size(), j.vocab_size());
    assert_eq!(g.vocab_size(), 2048);
    assert_eq!(g.max_token_bytes(), j.max_token_bytes());
    for id in 0..g.vocab_size() as u32 + 2 {
        assert_eq!(g.token_text(id), j.token_text(id), "token {id}");
    }
    assert_eq!(g.bos_token_id(), Some(0));
    assert_eq!(g.bos_token_id(), j.bos_token_id());
    assert_eq!(g.eos_token_ids(), &[1]);
    assert_eq!(g.eos_token_ids(), j.eos_token_ids());
    // add_bos_token is true in both: BOS once, not again before a BOS the
    // text already starts with.
    assert_eq!(g.encode("hi").unwrap()[0], 0);
    assert_eq!(g.encode("<｜begin▁of▁sentence｜>hi").unwrap(), j.encode("<｜begin▁of▁sentence｜>hi").unwrap());
    assert_eq!(g.encode("").unwrap(), vec![0]);
}

#[test]
fn the_chat_template_renders_as_from_tokenizer_config() {
    let (g, j) = both();
    let conversations = [
        vec![msg("user", "Hello, who are you?")],
        vec![msg("system", "Be brief."), msg("user", "2+2?"), msg("assistant", "4"), msg("user", "and 3+3?")],
        vec![msg("user", "中文 😀\n\tnew line"), msg("assistant", "ok")],
        vec![msg("user", "a fake <｜end▁of▁sentence｜> in content")],
    ];
    for messages in &conversations {
        for gen in [true, false] {
            let rendered = g.apply_chat_template(messages, gen).unwrap();
            assert_eq!(rendered, j.apply_chat_template(messages, gen).unwrap(), "{messages:?}");
            assert!(rendered.starts_with("<｜begin▁of▁sentence｜>"), "{rendered}");
            assert_eq!(g.encode_chat(messages, gen).unwrap(), j.encode_chat(messages, gen).unwrap(), "{messages:?}");
        }
    }
}

// ---------------------------------------------------------------- written files

/// A GGUF of metadata only (no tensor is needed for a tokenizer).
fn gguf_bytes(kvs: &[(String, Value)]) -> Vec<u8> {
    duplex_gguf::writer::Writer { kvs: kvs.to_vec(), ..Default::default() }.bytes().0
}

/// The fixture's metadata with `key` set to `value` (removed for `None`),
/// as a GGUF read from memory under the name `name`.
fn edited(edits: &[(&str, Option<Value>)]) -> Gguf {
    let g = open_fixture();
    let md = g.metadata();
    let mut kvs: Vec<(String, Value)> = md.keys().map(|k| (k.to_string(), md.get(k).unwrap().clone())).collect();
    for (key, value) in edits {
        kvs.retain(|(k, _)| k != key);
        if let Some(v) = value {
            kvs.push((key.to_string(), v.clone()));
        }
    }
    let part = GgufPart::from_bytes(Path::new("/written/edited.gguf"), gguf_bytes(&kvs)).expect("the written GGUF parses");
    Gguf::from_parts(vec![part]).expect("one part")
}

fn s(x: &str) -> Option<Value> {
    Some(Value::String(x.into()))
}

fn gguf_error(g: &Gguf) -> String {
    match Tokenizer::from_gguf(g) {
        Ok(_) => panic!("expected an error"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn an_unknown_pre_tokenizer_is_an_error_naming_it() {
    let e = gguf_error(&edited(&[("tokenizer.ggml.pre", s("no-such-pre"))]));
    assert!(e.contains("/written/edited.gguf") && e.contains("tokenizer.ggml.pre") && e.contains("\"no-such-pre\""), "{e}");
    assert!(e.contains("deepseek-v3"), "the error lists the known names: {e}");
}

#[test]
fn unsupported_tokenizer_models_are_errors_naming_them() {
    // The fixture's vocabulary has no scores, which a SentencePiece one needs.
    let e = gguf_error(&edited(&[("tokenizer.ggml.model", s("llama"))]));
    assert!(e.contains("/written/edited.gguf") && e.contains("tokenizer.ggml.scores") && e.contains("missing"), "{e}");
    let e = gguf_error(&edited(&[("tokenizer.ggml.model", s("bert"))]));
    assert!(e.contains("tokenizer.ggml.model") && e.contains("\"bert\""), "{e}");
    let e = gguf_error(&edited(&[("tokenizer.ggml.model", None)]));
    assert!(e.contains("tokenizer.ggml.model") && e.contains("missing"), "{e}");
}

#[test]
fn malformed_vocabularies_are_errors_naming_the_key() {
    let g = open_fixture();
    let tokens = g.metadata().array("tokenizer.ggml.tokens").unwrap().unwrap().to_vec();
    let mut twice = tokens.clone();
    twice[7] = twice[6].clone();
    let e = gguf_error(&edited(&[("tokenizer.ggml.tokens", Some(Value::Array(duplex_gguf::ValueType::String, twice)))]));
    assert!(e.contains("tokenizer.ggml.tokens") && e.contains("id 6") && e.contains("id 7"), "{e}");
    let merges = vec![Value::String("nospace".into())];
    let e = gguf_error(&edited(&[("tokenizer.ggml.merges", Some(Value::Array(duplex_gguf::ValueType::String, merges)))]));
    assert!(e.contains("tokenizer.ggml.merges") && e.contains("nospace"), "{e}");
    let merges = vec![Value::String("notatoken alsonot".into())];
    let e = gguf_error(&edited(&[("tokenizer.ggml.merges", Some(Value::Array(duplex_gguf::ValueType::String, merges)))]));
    assert!(e.contains("tokenizer.ggml.merges") && e.contains("notatoken"), "{e}");
}

/// Tokens (as text) of `text` under the fixture's vocabulary with
/// pre-tokenizer `pre`.
fn pieces(pre: &str, text: &str) -> Vec<String> {
    let tok = Tokenizer::from_gguf(&edited(&[("tokenizer.ggml.pre", s(pre))])).unwrap_or_else(|e| panic!("{pre}: {e}"));
    let ids = tok.encode_raw(text).unwrap();
    assert_eq!(tok.decode(&ids), text, "{pre}: round trip");
    ids.iter().map(|&id| tok.decode(&[id])).collect()
}

#[test]
fn each_known_pre_tokenizer_splits_as_its_regexes_say() {
    let text = "Hello world 1234567 中文テキスト\n\n  end's";
    for pre in ["default", "gpt-2", "llama3", "llama-bpe", "qwen2", "deepseek-llm", "deepseek-v3", "kimi-k2"] {
        pieces(pre, text);
    }
    let digits = |pre: &str| -> Vec<usize> { pieces(pre, "1234567").iter().map(|p| p.len()).collect() };
    // Qwen2: one digit per piece, so one per token.
    assert_eq!(digits("qwen2"), vec![1; 7]);
    // Llama 3, DeepSeek-V3 and Kimi-K2: runs of at most three digits, so no
    // token spans the 3|4 and 6|7 boundaries.
    for pre in ["llama3", "deepseek-v3", "kimi-k2"] {
        let mut at = 0;
        let mut cuts = vec![];
        for len in digits(pre) {
            at += len;
            cuts.push(at);
        }
        assert!(cuts.contains(&3) && cuts.contains(&6), "{pre}: {cuts:?}");
    }
    // The vocabulary has "0000" and "ypeError" as single tokens: GPT-2's
    // pieces keep them whole, while the three-digit rule splits the first
    // and Kimi-K2's letter-case classes split the second.
    assert_eq!(pieces("gpt-2", "0000").len(), 1);
    for pre in ["llama3", "deepseek-v3", "kimi-k2"] {
        assert!(pieces(pre, "0000").len() > 1, "{pre}");
    }
    assert_eq!(pieces("gpt-2", "ypeError").len(), 1);
    assert!(pieces("kimi-k2", "ypeError").len() > 1);
    // DeepSeek-V3 and Kimi-K2 keep a CJK run apart from the Latin word before it.
    for pre in ["deepseek-v3", "kimi-k2"] {
        let p = pieces(pre, "abc中文");
        let mut at = 0;
        assert!(p.iter().any(|t| {
            at += t.len();
            at == 3
        }), "{pre}: {p:?}");
    }
}

#[test]
fn a_missing_pre_tokenizer_is_llama_cpp_s_default() {
    let a = Tokenizer::from_gguf(&edited(&[("tokenizer.ggml.pre", None)])).unwrap();
    let b = Tokenizer::from_gguf(&edited(&[("tokenizer.ggml.pre", s("default"))])).unwrap();
    for text in corpus() {
        assert_eq!(a.encode_raw(&text).unwrap(), b.encode_raw(&text).unwrap(), "{text:?}");
    }
}

#[test]
fn bos_eos_and_template_come_from_the_metadata() {
    let g = edited(&[
        ("tokenizer.ggml.add_bos_token", Some(Value::Bool(false))),
        ("tokenizer.ggml.eot_token_id", Some(Value::U32(3))),
        ("tokenizer.chat_template", s("{% for m in messages %}[{{ m['content'] }}]{% endfor %}{{ eos_token }}")),
    ]);
    let tok = Tokenizer::from_gguf(&g).unwrap();
    assert_ne!(tok.encode("hi").unwrap()[0], 0, "no BOS when add_bos_token is false");
    assert_eq!(tok.eos_token_ids(), &[1, 3]);
    assert_eq!(tok.apply_chat_template(&[msg("user", "x")], false).unwrap(), "[x]<｜end▁of▁sentence｜>");
    let config = ServedConfig::from_gguf(&g).unwrap();
    assert_eq!(config.eos_token_ids, vec![1, 3]);

    let none = Tokenizer::from_gguf(&edited(&[("tokenizer.chat_template", None)])).unwrap();
    let e = none.apply_chat_template(&[msg("user", "x")], true).unwrap_err();
    assert!(matches!(e, TokenizerError::NoChatTemplate { .. }), "{e:?}");
    assert!(e.to_string().contains("tokenizer.chat_template"), "{e}");

    let broken = Tokenizer::from_gguf(&edited(&[("tokenizer.chat_template", s("{% for %}"))])).unwrap_err();
    assert!(matches!(broken, TokenizerError::TemplateSyntax { .. }), "{broken:?}");

    let e = Tokenizer::from_gguf(&edited(&[("tokenizer.ggml.eot_token_id", Some(Value::U32(99_999)))])).unwrap_err().to_string();
    assert!(e.contains("tokenizer.ggml.eot_token_id") && e.contains("99999"), "{e}");
}

// ---------------------------------------------------------------- model paths

/// A temporary directory holding the fixture's GGUF (hard-linked, or
/// copied where the file system cannot link), and `extra` of the fixture's
/// other files.
fn gguf_dir(extra: &[&str]) -> tempfile::TempDir {
    let tmp = tempfile::tempdir().unwrap();
    let target = tmp.path().join("model-Q4_K_M.gguf");
    if std::fs::hard_link(fixture_gguf(), &target).is_err() {
        std::fs::copy(fixture_gguf(), &target).unwrap();
    }
    for name in extra {
        std::fs::copy(fixture_dir().join(name), tmp.path().join(name)).unwrap();
    }
    tmp
}

/// The file a tokenizer was loaded from, as its Debug output names it.
fn loaded_from(tok: &Tokenizer) -> String {
    format!("{tok:?}")
}

#[test]
fn from_model_path_prefers_a_tokenizer_json_beside_the_gguf() {
    let with = gguf_dir(&["tokenizer.json", "tokenizer_config.json"]);
    for path in [with.path().to_path_buf(), with.path().join("model-Q4_K_M.gguf")] {
        let tok = Tokenizer::from_model_path(&path).unwrap();
        assert!(loaded_from(&tok).contains("tokenizer.json"), "{path:?}: {tok:?}");
    }
    let without = gguf_dir(&[]);
    for path in [without.path().to_path_buf(), without.path().join("model-Q4_K_M.gguf")] {
        let tok = Tokenizer::from_model_path(&path).unwrap();
        assert!(loaded_from(&tok).contains("model-Q4_K_M.gguf"), "{path:?}: {tok:?}");
        assert_eq!(tok.encode("Hello, world!").unwrap(), Tokenizer::from_dir(&fixture_dir()).unwrap().encode("Hello, world!").unwrap());
    }
    // A Hugging Face directory is read as before.
    let hf = Path::new(duplex_text::BUNDLED_MODEL);
    let tok = Tokenizer::from_model_path(hf).unwrap();
    assert!(loaded_from(&tok).contains("tokenizer.json"), "{tok:?}");
    // Two GGUF models in one directory: the error lists them.
    let two = gguf_dir(&[]);
    std::fs::copy(fixture_gguf(), two.path().join("other.gguf")).unwrap();
    let e = Tokenizer::from_model_path(two.path()).unwrap_err().to_string();
    assert!(e.contains("model-Q4_K_M.gguf") && e.contains("other.gguf"), "{e}");
}

#[test]
fn served_config_of_a_gguf_comes_from_its_metadata() {
    let config = ServedConfig::from_model_path(&fixture_gguf()).unwrap();
    assert_eq!(config, ServedConfig { vocab_size: 2048, max_position_embeddings: 2048, eos_token_ids: vec![1] });
    let dir = gguf_dir(&[]);
    assert_eq!(ServedConfig::from_model_path(dir.path()).unwrap(), config);
    // A Hugging Face directory still reads its config.json.
    let hf = Path::new(duplex_text::BUNDLED_MODEL);
    assert_eq!(ServedConfig::from_model_path(hf).unwrap(), ServedConfig::from_file(&hf.join("config.json")).unwrap());
    let e = ServedConfig::from_gguf(&edited(&[("deepseek2.context_length", None)])).unwrap_err().to_string();
    assert!(e.contains("deepseek2.context_length") && e.contains("missing"), "{e}");
}

#[test]
fn check_model_dir_accepts_gguf_models_and_names_both_kinds_when_neither() {
    let dir = gguf_dir(&[]);
    check_model_dir(dir.path()).unwrap();
    check_model_dir(&dir.path().join("model-Q4_K_M.gguf")).unwrap();
    check_model_dir(Path::new(duplex_text::BUNDLED_MODEL)).unwrap();
    let empty = tempfile::tempdir().unwrap();
    let e = check_model_dir(empty.path()).unwrap_err();
    assert!(e.contains("config.json") && e.contains("GGUF"), "{e}");
}

#[test]
fn sampling_defaults_of_a_gguf_read_generation_config_beside_it() {
    let dir = gguf_dir(&[]);
    std::fs::write(dir.path().join("generation_config.json"), r#"{"temperature": 0.25, "top_p": 0.5}"#).unwrap();
    for path in [dir.path().to_path_buf(), dir.path().join("model-Q4_K_M.gguf")] {
        let p = sampling_defaults(&path);
        assert_eq!((p.temperature, p.top_p), (0.25, 0.5), "{path:?}");
    }
}

/// A GGUF's tokenizer metadata written from a `tokenizer.json` and its
/// `tokenizer_config.json`, as llama.cpp's converter writes them: tokens by
/// id, special added tokens as control and the other added tokens as
/// user-defined, the merges as `"left right"`.
fn gguf_from_tokenizer_json(dir: &Path, pre: &str, eos: u32) -> Gguf {
    let kvs = metadata_from_tokenizer_json(dir, "gpt2", eos);
    let mut kvs = kvs;
    kvs.push(("tokenizer.ggml.pre".into(), Value::String(pre.into())));
    kvs.push(("tokenizer.ggml.add_bos_token".into(), Value::Bool(false)));
    let part = GgufPart::from_bytes(&dir.join("written.gguf"), gguf_bytes(&kvs)).unwrap();
    Gguf::from_parts(vec![part]).unwrap()
}

/// The metadata llama.cpp's converter writes for the tokenizer in `dir`
/// (model `gpt2` or `llama`): for `llama`, `<0xXX>` tokens are byte tokens,
/// `<unk>` the unknown token, and the scores rank tokens by id, as
/// SentencePiece BPE models rank their pieces.
fn metadata_from_tokenizer_json(dir: &Path, model: &str, eos: u32) -> Vec<(String, Value)> {
    let read = |name: &str| -> serde_json::Value { serde_json::from_str(&std::fs::read_to_string(dir.join(name)).unwrap()).unwrap() };
    let json = read("tokenizer.json");
    let config = read("tokenizer_config.json");
    let mut tokens: Vec<Option<(String, i32)>> = vec![];
    let mut put = |id: u64, text: &str, ty: i32| {
        let id = id as usize;
        if tokens.len() <= id {
            tokens.resize(id + 1, None);
        }
        tokens[id] = Some((text.to_string(), ty));
    };
    let spm = model == "llama";
    for (text, id) in json["model"]["vocab"].as_object().unwrap() {
        let byte = spm && text.len() == 6 && text.starts_with("<0x") && text.ends_with('>');
        put(id.as_u64().unwrap(), text, if byte { 6 } else { 1 });
    }
    for added in json["added_tokens"].as_array().unwrap() {
        let content = added["content"].as_str().unwrap();
        let ty = match (added["special"].as_bool().unwrap(), content) {
            (true, "<unk>") if spm => 2,
            (true, _) => 3,
            (false, _) => 4,
        };
        put(added["id"].as_u64().unwrap(), content, ty);
    }
    let tokens: Vec<(String, i32)> = tokens.into_iter().map(|t| t.expect("ids are dense")).collect();
    let merges: Vec<Value> = json["model"]["merges"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| match m {
            serde_json::Value::String(s) => Value::String(s.clone()),
            pair => Value::String(format!("{} {}", pair[0].as_str().unwrap(), pair[1].as_str().unwrap())),
        })
        .collect();
    use duplex_gguf::ValueType;
    let mut kvs: Vec<(String, Value)> = vec![
        ("general.architecture".into(), Value::String("test".into())),
        ("test.context_length".into(), Value::U32(4096)),
        ("tokenizer.ggml.model".into(), Value::String(model.into())),
        ("tokenizer.ggml.tokens".into(), Value::Array(ValueType::String, tokens.iter().map(|(t, _)| Value::String(t.clone())).collect())),
        ("tokenizer.ggml.token_type".into(), Value::Array(ValueType::I32, tokens.iter().map(|&(_, ty)| Value::I32(ty)).collect())),
        ("tokenizer.ggml.eos_token_id".into(), Value::U32(eos)),
        ("tokenizer.chat_template".into(), Value::String(config["chat_template"].as_str().unwrap().into())),
    ];
    if spm {
        let scores = (0..tokens.len()).map(|id| Value::F32(-(id as f32))).collect();
        kvs.push(("tokenizer.ggml.scores".into(), Value::Array(ValueType::F32, scores)));
    } else {
        kvs.push(("tokenizer.ggml.merges".into(), Value::Array(ValueType::String, merges)));
    }
    kvs
}

#[test]
fn sentencepiece_vocabulary_encodes_as_mixtrals_tokenizer_json() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tiny-mixtral");
    let mut kvs = metadata_from_tokenizer_json(&dir, "llama", 2);
    kvs.push(("tokenizer.ggml.bos_token_id".into(), Value::U32(1)));
    let part = GgufPart::from_bytes(&dir.join("written.gguf"), gguf_bytes(&kvs)).unwrap();
    let g = Tokenizer::from_gguf(&Gguf::from_parts(vec![part]).unwrap()).unwrap_or_else(|e| panic!("{e}"));
    let j = Tokenizer::from_dir(&dir).unwrap();
    let mut texts = corpus();
    texts.push("<s>[INST] hi [/INST] ok</s> <s>again".into());
    for text in &texts {
        assert_eq!(g.encode(text).unwrap(), j.encode(text).unwrap(), "encode {text:?}");
        assert_eq!(g.encode_text(text).unwrap(), j.encode_text(text).unwrap(), "encode_text {text:?}");
        let ids = j.encode(text).unwrap();
        assert_eq!(g.decode(&ids), j.decode(&ids), "decode {text:?}");
    }
    assert_eq!((g.bos_token_id(), g.encode("hi").unwrap()[0]), (Some(1), 1), "BOS by default");
    let chat = [msg("user", "2+2?"), msg("assistant", "4"), msg("user", "why?")];
    assert_eq!(g.apply_chat_template(&chat, true).unwrap(), j.apply_chat_template(&chat, true).unwrap());
    assert_eq!(g.encode_chat(&chat, true).unwrap(), j.encode_chat(&chat, true).unwrap());
}

#[test]
fn qwen2_pre_tokenizer_encodes_as_qwen3s_tokenizer_json() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tiny-qwen3moe");
    let g = Tokenizer::from_gguf(&gguf_from_tokenizer_json(&dir, "qwen2", 2045)).unwrap_or_else(|e| panic!("{e}"));
    let j = Tokenizer::from_dir(&dir).unwrap();
    let mut texts = corpus();
    texts.push("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\nhmm\n</think>\n\nok<|im_end|><|endoftext|>".into());
    texts.push("not NFC: e\u{301} A\u{30a} \u{212b} ﬁ".into());
    for text in &texts {
        assert_eq!(g.encode(text).unwrap(), j.encode(text).unwrap(), "encode {text:?}");
        assert_eq!(g.encode_text(text).unwrap(), j.encode_text(text).unwrap(), "encode_text {text:?}");
        let ids = j.encode(text).unwrap();
        assert_eq!(g.decode(&ids), j.decode(&ids), "decode {text:?}");
    }
    assert_eq!(g.bos_token_id(), None);
    assert_eq!(g.encode("hi").unwrap(), j.encode("hi").unwrap(), "no BOS");
    let chat = [msg("system", "Be brief."), msg("user", "2+2?"), msg("assistant", "4"), msg("user", "why?")];
    for gen in [true, false] {
        assert_eq!(g.apply_chat_template(&chat, gen).unwrap(), j.apply_chat_template(&chat, gen).unwrap());
        assert_eq!(g.encode_chat(&chat, gen).unwrap(), j.encode_chat(&chat, gen).unwrap());
    }
}

/// GGUF metadata, in order.
type Kvs = Vec<(String, Value)>;

#[test]
fn sentencepiece_switches_and_malformed_scores() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tiny-mixtral");
    let build = |edit: &dyn Fn(&mut Kvs)| {
        let mut kvs = metadata_from_tokenizer_json(&dir, "llama", 2);
        edit(&mut kvs);
        let part = GgufPart::from_bytes(&dir.join("written.gguf"), gguf_bytes(&kvs)).unwrap();
        Tokenizer::from_gguf(&Gguf::from_parts(vec![part]).unwrap())
    };
    let with_prefix = build(&|_| {}).unwrap();
    let without = build(&|kvs| kvs.push(("tokenizer.ggml.add_space_prefix".into(), Value::Bool(false)))).unwrap();
    let text = "Hello world";
    let (a, b) = (with_prefix.encode_raw(text).unwrap(), without.encode_raw(text).unwrap());
    assert_ne!(a, b, "the prefixed space changes the first token");
    assert_eq!((with_prefix.decode(&a), without.decode(&b)), (text.to_string(), text.to_string()));
    // No BOS id: nothing to add, whatever the default says.
    assert_eq!(with_prefix.bos_token_id(), None);
    assert_eq!(with_prefix.encode(text).unwrap(), a);

    let e = build(&|kvs| {
        kvs.retain(|(k, _)| k != "tokenizer.ggml.scores");
        kvs.push(("tokenizer.ggml.scores".into(), Value::Array(duplex_gguf::ValueType::F32, vec![Value::F32(0.0); 3])));
    })
    .unwrap_err()
    .to_string();
    assert!(e.contains("tokenizer.ggml.scores") && e.contains("3 entries"), "{e}");
    let e = build(&|kvs| {
        kvs.retain(|(k, _)| k != "tokenizer.ggml.scores");
        kvs.push(("tokenizer.ggml.scores".into(), Value::String("high".into())));
    })
    .unwrap_err()
    .to_string();
    assert!(e.contains("tokenizer.ggml.scores") && e.contains("expected an array"), "{e}");
}
