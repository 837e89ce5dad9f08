//! Stream-loading prefill on a CUDA GPU against the CPU engine and
//! transformers' reference, by the same gates as on the emulated device.
//! Without a GPU (or a driver) it says so and passes: run it on a GPU
//! machine with `cargo test -p duplex-prefill --features cuda --test cuda`.

#![cfg(feature = "cuda")]

use duplex_kernels::device::cuda::CudaDevice;
use duplex_toolkit::reference::{self, max_abs_diff, Bf16Gate, F32_MAX_ABS_DIFF};
use duplex_model::{BlockTable, Logits, Model, Precision};
use duplex_prefill::slp::{SlpConfig, SlpEngine};
use std::path::Path;

#[test]
fn slp_on_cuda_matches_the_cpu_engine_and_reference() {
    let device = match CudaDevice::open(0, 256 << 20) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("slp_on_cuda_matches_the_cpu_engine_and_reference: skipped: {e}");
            return;
        }
    };
    // One checkpoint of each architecture (MLA and the two GQA families).
    for fixture in ["tiny-dsv3", "tiny-qwen3moe", "tiny-mixtral"] {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures").join(fixture);
    let m = Model::load(&dir, &mut |_, _| {}).unwrap();
    for ring_slots in [None, Some(2)] {
        let engine = SlpEngine::new(&m, device.clone(), SlpConfig { ring_slots, dense_budget_bytes: 16 << 20, ..Default::default() }).unwrap();
        for (i, p) in reference::load(&dir).unwrap().iter().enumerate() {
            for precision in [Precision::F32, Precision::Bf16] {
                let mut kv = m.new_kv_pool(64, 16);
                let (logits, report) = engine.run(&m, &mut kv, &mut BlockTable::default(), &p.input_ids, precision, Logits::All, &mut || false).unwrap();
                let want = m.forward(&mut m.new_kv_pool(64, 16), &mut BlockTable::default(), &p.input_ids, precision, Logits::All).unwrap();
                println!("{fixture}, ring {:?}, prompt {i}, {precision:?}: overlap {:.2}, max |Δlogit| vs CPU {:.2e}", report.ring_slots, report.overlap_efficiency(), max_abs_diff(&logits, &want));
                match precision {
                    Precision::F32 => assert!(max_abs_diff(&logits, &want) <= F32_MAX_ABS_DIFF && max_abs_diff(&logits, &p.logits) <= F32_MAX_ABS_DIFF),
                    Precision::Bf16 => {
                        let gate = Bf16Gate::new(p, &logits, m.cfg.vocab_size);
                        assert!(gate.passed(), "{fixture} prompt {i}: {gate}");
                    }
                }
            }
        }
    }
    }
}
