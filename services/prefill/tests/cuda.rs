//! Stream-loading prefill (one device and two) on a CUDA GPU against the CPU engine and
//! transformers' reference, by the same gates as on the emulated device.
//! Without a GPU (or a driver) it says so and passes; any other failure to
//! open the device (kernels that do not compile, say) fails it. Run it on a
//! GPU machine with `cargo test -p duplex-prefill --features cuda --test cuda`.

#![cfg(feature = "cuda")]

use duplex_kernels::device::cuda::CudaDevice;
use duplex_kernels::device::{Device, DeviceError};
use duplex_toolkit::reference::{self, max_abs_diff, Bf16Gate, F32_MAX_ABS_DIFF};
use duplex_model::{BlockTable, Logits, Model, Precision};
use duplex_prefill::dslp::DslpEngine;
use duplex_prefill::slp::{SlpConfig, SlpEngine};
use std::path::Path;
use std::sync::Arc;

/// The opened device, or `None` (saying why) where there is no GPU to use:
/// no driver, no device, no NVRTC. Anything else, such as kernels that do
/// not compile for this GPU, fails the test rather than passing as a skip.
fn usable<T>(opened: Result<T, DeviceError>, test: &str) -> Option<T> {
    match opened {
        Ok(device) => Some(device),
        Err(DeviceError::Unavailable(why)) => {
            eprintln!("{test}: skipped: {why}");
            None
        }
        Err(e) => panic!("{test}: the CUDA device failed to open: {e}"),
    }
}

#[test]
fn only_a_missing_gpu_skips() {
    assert!(usable::<()>(Err(DeviceError::Unavailable("no CUDA driver".into())), "only_a_missing_gpu_skips").is_none());
    assert_eq!(usable(Ok(7), "only_a_missing_gpu_skips"), Some(7));
}

#[test]
#[should_panic(expected = "the CUDA device failed to open: device failure: NVRTC cannot compile")]
fn kernels_that_do_not_compile_fail_instead_of_skipping() {
    usable::<()>(Err(DeviceError::Backend("NVRTC cannot compile the kernels for sm_90".into())), "kernels_that_do_not_compile_fail_instead_of_skipping");
}

#[test]
fn slp_on_cuda_matches_the_cpu_engine_and_reference() {
    let Some(device) = usable(CudaDevice::open(0, 256 << 20), "slp_on_cuda_matches_the_cpu_engine_and_reference") else { return };
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

/// Two-device prefill with CUDA ranks: GPUs 0 and 1, or where there is one
/// GPU, two ranks on it (the exchange still goes through the host), against
/// the CPU engine by the same gates.
#[test]
fn dslp_on_cuda_matches_the_cpu_engine_and_reference() {
    let test = "dslp_on_cuda_matches_the_cpu_engine_and_reference";
    let Some(first) = usable(CudaDevice::open(0, 256 << 20), test) else { return };
    let second = match CudaDevice::open(1, 256 << 20) {
        Ok(d) => d,
        Err(_) => usable(CudaDevice::open(0, 256 << 20), test).expect("GPU 0 opened once already"),
    };
    for fixture in ["tiny-dsv3", "tiny-qwen3moe", "tiny-mixtral"] {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures").join(fixture);
        let m = Model::load(&dir, &mut |_, _| {}).unwrap();
        let devices: Vec<Arc<dyn Device>> = vec![first.clone(), second.clone()];
        let engine = DslpEngine::new(&m, devices, SlpConfig { dense_budget_bytes: 16 << 20, ..Default::default() }).unwrap();
        for (i, p) in reference::load(&dir).unwrap().iter().enumerate() {
            for precision in [Precision::F32, Precision::Bf16] {
                let mut kv = m.new_kv_pool(64, 16);
                let (logits, _) = engine.run(&m, &mut kv, &mut BlockTable::default(), &p.input_ids, precision, Logits::All, &mut || false).unwrap();
                let want = m.forward(&mut m.new_kv_pool(64, 16), &mut BlockTable::default(), &p.input_ids, precision, Logits::All).unwrap();
                println!("{fixture}, prompt {i}, {precision:?}: DSLP max |Δlogit| vs CPU {:.2e}", max_abs_diff(&logits, &want));
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
