//! The router serving a GGUF model (`--model` naming a `.gguf` file or a
//! directory holding one): its tokenizer and facts come from the GGUF
//! metadata when no tokenizer.json is beside it. The fixture is
//! `tests/fixtures/tiny-dsv3-q4km`, whose tokenizer.json is the same
//! tokenizer, so the ids can be checked against it.

mod common;

use common::{start, MockConfig, TIMEOUT};
use duplex_proto::v1::{generate_request, generate_response, GenerateRequest};
use duplex_router::config::RouterConfig;
use duplex_router::request::ServedModel;
use duplex_text::tokenizer::Tokenizer;
use std::path::{Path, PathBuf};
use tokio::time::timeout;

fn fixture_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tiny-dsv3-q4km")
}

/// A directory holding only the fixture's GGUF (hard-linked, or copied
/// where the file system cannot link), so nothing but its metadata can be
/// the tokenizer.
fn gguf_only_dir() -> tempfile::TempDir {
    let tmp = tempfile::tempdir().unwrap();
    let (from, to) = (fixture_dir().join("model-Q4_K_M.gguf"), tmp.path().join("model-Q4_K_M.gguf"));
    if std::fs::hard_link(&from, &to).is_err() {
        std::fs::copy(&from, &to).unwrap();
    }
    tmp
}

#[test]
fn served_model_loads_a_gguf_file_or_directory() {
    let dir = gguf_only_dir();
    let reference = Tokenizer::from_dir(&fixture_dir()).unwrap();
    for model in [dir.path().to_path_buf(), dir.path().join("model-Q4_K_M.gguf")] {
        let config = RouterConfig { model: model.clone(), ..RouterConfig::default() };
        let served = ServedModel::load(&config).unwrap_or_else(|e| panic!("{}: {e}", model.display()));
        assert!(format!("{:?}", served.tokenizer).contains("model-Q4_K_M.gguf"), "the tokenizer is the GGUF's: {:?}", served.tokenizer);
        assert_eq!((served.vocab_size, served.context_length, served.eos_token_ids.as_slice()), (2048, 2048, [1].as_slice()));
        let text = "Hello, world! 中文 😀";
        assert_eq!(served.tokenizer.encode_text(text).unwrap(), reference.encode_text(text).unwrap());
    }
}

#[tokio::test]
async fn a_gguf_model_serves_text_end_to_end() {
    let dir = gguf_only_dir();
    let reference = Tokenizer::from_dir(&fixture_dir()).unwrap();
    let mut script = reference.encode_raw("Hello there, world").unwrap();
    script.push(1); // EOS
    let model = dir.path().to_path_buf();
    let router = start(MockConfig { script: script.clone(), ..Default::default() }, |c| c.model = model).await;
    let req = GenerateRequest { prompt: Some(generate_request::Prompt::Text("Hi".into())), ..Default::default() };
    let run = async {
        let mut stream = router.grpc_client().await.generate(req).await?.into_inner();
        let mut out = vec![];
        while let Some(msg) = stream.message().await? {
            out.push(msg);
        }
        Ok::<_, tonic::Status>(out)
    };
    let msgs = timeout(TIMEOUT, run).await.expect("Generate timed out").unwrap();
    let ids: Vec<u32> = msgs
        .iter()
        .filter_map(|m| match &m.event {
            Some(generate_response::Event::Token(t)) => Some(t.id),
            _ => None,
        })
        .collect();
    assert_eq!(ids, script);
    let text: String = msgs
        .iter()
        .filter_map(|m| match &m.event {
            Some(generate_response::Event::Token(t)) => Some(t.text.as_str()),
            _ => None,
        })
        .collect();
    assert_eq!(text, "Hello there, world");
    let r = router.mock.record();
    assert_eq!(r.decodes[0].stop_token_ids, [1], "the GGUF's EOS is a stop token");
    assert_eq!(r.decodes[0].prompt, reference.encode_text("Hi").unwrap(), "BOS and ids as the tokenizer.json gives");
    assert_eq!(r.decodes[0].prompt[0], 0, "BOS added to text prompts");
}
