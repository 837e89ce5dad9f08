//! Hollow checkpoints (`WriteOptions::hollow`): the same files, headers and
//! index as the full checkpoint, sparse shards that take (almost) no disk,
//! and the engine loads them.

use duplex_model::checkpoint::INDEX_FILE;
use duplex_model::{BlockTable, Logits, Model, Precision};
use duplex_toolkit::synth::{self, preset, write_checkpoint, WriteOptions};
use std::os::unix::fs::MetadataExt;
use std::path::Path;

/// Every file of a checkpoint directory, by name, sorted.
fn file_names(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    names.sort();
    names
}

/// A safetensors file's 8-byte length and JSON header.
fn header(path: &Path) -> Vec<u8> {
    let bytes = std::fs::read(path).unwrap();
    let len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    bytes[..8 + len].to_vec()
}

#[test]
fn hollow_checkpoint_has_the_full_ones_layout_takes_no_disk_and_loads() {
    for name in ["tiny", "tiny-qwen3moe-fp8", "tiny-mixtral"] {
        let cfg = preset(name).unwrap();
        let (full, hollow) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let opts = WriteOptions { shard_size: 1 << 20, ..WriteOptions::default() };
        let f = write_checkpoint(&cfg, full.path(), &opts, &mut |_, _| {}).unwrap();
        let h = write_checkpoint(&cfg, hollow.path(), &WriteOptions { hollow: true, ..opts }, &mut |_, _| {}).unwrap();
        assert_eq!((h.tensors, h.shards, h.tensor_bytes, h.file_bytes), (f.tensors, f.shards, f.tensor_bytes, f.file_bytes), "{name}");
        assert!(f.shards > 1, "{name}: sharded");

        let names = file_names(full.path());
        assert_eq!(file_names(hollow.path()), names, "{name}");
        let (mut full_disk, mut hollow_disk, mut headers) = (0, 0, 0);
        for n in &names {
            let (a, b) = (full.path().join(n), hollow.path().join(n));
            if !n.ends_with(".safetensors") {
                // Config, index (same tensor → shard map and total size) and tokenizer.
                assert_eq!(std::fs::read(&a).unwrap(), std::fs::read(&b).unwrap(), "{name}: {n}");
                continue;
            }
            // Same tensor names, shapes, dtypes and offsets, and the same length.
            assert_eq!(header(&a), header(&b), "{name}: {n}");
            let (ma, mb) = (std::fs::metadata(&a).unwrap(), std::fs::metadata(&b).unwrap());
            assert_eq!(ma.len(), mb.len(), "{name}: {n}");
            full_disk += ma.blocks() * 512;
            hollow_disk += mb.blocks() * 512;
            headers += header(&b).len() as u64;
        }
        assert!(std::fs::read(hollow.path().join(INDEX_FILE)).is_ok());
        // The full shards are on disk; the hollow ones hold their headers
        // and at most a few blocks around them.
        assert!(full_disk >= f.tensor_bytes, "{name}: {full_disk} bytes on disk for {} of tensors", f.tensor_bytes);
        assert!(hollow_disk <= headers + h.shards as u64 * 64 * 1024, "{name}: {hollow_disk} bytes on disk, headers {headers}");

        let model = Model::load(hollow.path(), &mut |_, _| {}).unwrap();
        assert_eq!(model.cfg, cfg.model, "{name}");
        assert_eq!(model.activated_bytes_per_token(), Model::load(full.path(), &mut |_, _| {}).unwrap().activated_bytes_per_token());
        // What the docs promise: it runs, and computes zeros.
        let mut pool = model.new_kv_pool(4, 16);
        let logits = model.forward(&mut pool, &mut BlockTable::default(), &[0, 17, 300], Precision::F32, Logits::All).unwrap();
        assert!(logits.iter().all(|&x| x == 0.0), "{name}");
    }
}

/// The disk limit is a limit on disk: a hollow checkpoint is not refused for
/// its apparent size.
#[test]
fn the_size_limit_does_not_apply_to_hollow_checkpoints() {
    let cfg = preset("tiny").unwrap();
    let dir = tempfile::tempdir().unwrap();
    let opts = WriteOptions { max_bytes: Some(1000), ..WriteOptions::default() };
    let err = write_checkpoint(&cfg, &dir.path().join("full"), &opts, &mut |_, _| {}).unwrap_err();
    assert!(matches!(err, synth::SynthError::TooLarge { .. }), "{err}");
    write_checkpoint(&cfg, &dir.path().join("hollow"), &WriteOptions { hollow: true, ..opts }, &mut |_, _| {}).unwrap();
    Model::load(&dir.path().join("hollow"), &mut |_, _| {}).unwrap();
}
