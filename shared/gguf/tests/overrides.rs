//! Metadata overrides (`KEY=TYPE:VALUE`, as llama.cpp's `--override-kv`):
//! parsed, refused with the reason, and applied over a file's metadata.

use duplex_gguf::writer::Writer;
use duplex_gguf::{Gguf, MetadataOverride, Value};

#[test]
fn overrides_parse_print_and_refuse_by_llama_cpps_syntax() {
    let cases = [
        ("deepseek2.rope.scaling.yarn_beta_fast=float:16", "deepseek2.rope.scaling.yarn_beta_fast", Value::F64(16.0)),
        ("a.count=int:-3", "a.count", Value::I64(-3)),
        ("a.flag=bool:false", "a.flag", Value::Bool(false)),
        ("tokenizer.chat_template=str:{{ x }}=y:z", "tokenizer.chat_template", Value::String("{{ x }}=y:z".into())),
    ];
    for (text, key, value) in cases {
        let o: MetadataOverride = text.parse().unwrap();
        assert_eq!((o.key.as_str(), &o.value), (key, &value), "{text}");
        // Printed back, it parses to the same override.
        assert_eq!(o.to_string().parse::<MetadataOverride>().unwrap(), o, "{text}");
    }
    for (text, why) in [
        ("a.b", "no '='"),
        ("a.b=16", "no ':'"),
        ("=float:1", "the key is empty"),
        ("a.b=double:1", "unknown type \"double\""),
        ("a.b=float:fast", "\"fast\" is not a finite number"),
        ("a.b=float:inf", "is not a finite number"),
        ("a.b=int:1.5", "\"1.5\" is not an integer"),
        ("a.b=bool:yes", "\"yes\" is not true or false"),
    ] {
        let e = text.parse::<MetadataOverride>().unwrap_err();
        assert!(e.contains(why) && e.contains("KEY=TYPE:VALUE"), "{text}: {e}");
    }
}

#[test]
fn overrides_replace_or_add_keys_of_the_models_metadata() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.gguf");
    let w = Writer::default().kv("general.architecture", Value::String("deepseek2".into())).kv("x.beta", Value::F32(32.0));
    std::fs::write(&path, w.bytes().0).unwrap();
    let mut g = Gguf::open(&path).unwrap();
    assert_eq!(g.metadata().f64("x.beta").unwrap(), Some(32.0));
    let overrides: Vec<MetadataOverride> = ["x.beta=float:16", "x.new=int:4", "x.beta=float:8"].iter().map(|t| t.parse().unwrap()).collect();
    g.override_metadata(&overrides);
    assert_eq!(g.metadata().f64("x.beta").unwrap(), Some(8.0), "the last override of a key wins");
    assert_eq!(g.metadata().usize("x.new").unwrap(), Some(4));
    assert_eq!(g.metadata().str("general.architecture").unwrap(), Some("deepseek2"));
    // The file is unchanged.
    assert_eq!(Gguf::open(&path).unwrap().metadata().f64("x.beta").unwrap(), Some(32.0));
}
