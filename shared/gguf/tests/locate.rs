//! The model-path convention: which `--model` paths name a GGUF model.

use duplex_gguf::locate;
use std::fs;

#[test]
fn files_directories_and_split_sets_resolve_to_the_file_to_open() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    // An empty directory, a Hugging Face one and a non-GGUF file name no GGUF model.
    assert_eq!(locate(d).unwrap(), None);
    fs::write(d.join("notes.txt"), "x").unwrap();
    assert_eq!(locate(&d.join("notes.txt")).unwrap(), None);
    assert_eq!(locate(&d.join("missing.gguf")).unwrap(), None);

    // One file: the directory and the file both name it.
    fs::write(d.join("m-Q4_K_M.gguf"), "").unwrap();
    assert_eq!(locate(d).unwrap(), Some(d.join("m-Q4_K_M.gguf")));
    assert_eq!(locate(&d.join("m-Q4_K_M.gguf")).unwrap(), Some(d.join("m-Q4_K_M.gguf")));

    // A config.json makes the directory a Hugging Face one.
    fs::write(d.join("config.json"), "{}").unwrap();
    assert_eq!(locate(d).unwrap(), None);
    fs::remove_file(d.join("config.json")).unwrap();

    // A second model is an error listing both, not a guess.
    for no in 1..=3 {
        fs::write(d.join(format!("big-{no:05}-of-00003.gguf")), "").unwrap();
    }
    let e = locate(d).unwrap_err().to_string();
    assert!(e.contains("2 GGUF models") && e.contains("m-Q4_K_M.gguf") && e.contains("big-00001-of-00003.gguf"), "{e}");

    // A split set alone is one model, named by its first part; naming any
    // part names that part (opening it opens them all).
    fs::remove_file(d.join("m-Q4_K_M.gguf")).unwrap();
    assert_eq!(locate(d).unwrap(), Some(d.join("big-00001-of-00003.gguf")));
    assert_eq!(locate(&d.join("big-00002-of-00003.gguf")).unwrap(), Some(d.join("big-00002-of-00003.gguf")));
}
