//! The emulated accelerator keeps a GPU's rules: bounded memory, in-order
//! streams, events that order streams, a paced copy engine, sticky faults,
//! launches checked before they are queued, and CUDA's graph capture.

use duplex_kernels::device::emulated::{EmulatedConfig, EmulatedDevice, Jitter};
use duplex_kernels::device::{self, Device, DeviceError, HostBytes, Op, StreamKind};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

mod common;

fn dev(config: EmulatedConfig) -> Arc<EmulatedDevice> {
    EmulatedDevice::new(config).unwrap()
}

#[test]
fn memory_is_bounded_and_reusable() {
    let d = dev(EmulatedConfig { memory_bytes: 1 << 20, ..Default::default() });
    let a = d.alloc(600 << 10).unwrap();
    match d.alloc(600 << 10) {
        Err(DeviceError::OutOfMemory { capacity, .. }) => assert_eq!(capacity, 1 << 20),
        other => panic!("{other:?}"),
    }
    d.free(a).unwrap();
    d.alloc(600 << 10).unwrap();
    assert!(d.free(a.slice(256, 256).unwrap()).is_err(), "freeing what was never allocated");
}

/// A copy on one stream, then a kernel on another that waits for the copy's
/// event: with random delays in every stream, the kernel always sees the data.
#[test]
fn events_order_streams() {
    for seed in 0..20 {
        let d = dev(EmulatedConfig { jitter: Some(Jitter { seed, max: Duration::from_micros(500) }), ..Default::default() });
        let (copy, compute) = (d.create_stream(StreamKind::Copy).unwrap(), d.create_stream(StreamKind::Compute).unwrap());
        let (src, dst) = (d.alloc(64 * 4).unwrap(), d.alloc(64 * 4).unwrap());
        let xs: Vec<f32> = (0..64).map(|i| i as f32 * 0.5).collect();
        device::upload_f32(&*d, copy, &xs, src).unwrap();
        let copied = d.record(copy).unwrap();
        d.wait_event(compute, &copied).unwrap();
        d.launch(compute, &Op::Zero { x: dst.matrix(8, 8) }).unwrap();
        d.launch(compute, &Op::Add { h: dst.matrix(8, 8), delta: src.matrix(8, 8), precision: duplex_kernels::Precision::F32 }).unwrap();
        let got = device::download_matrix(&*d, compute, dst.matrix(8, 8)).unwrap();
        assert_eq!(got, xs, "seed {seed}");
        let done = d.record(compute).unwrap();
        d.synchronize(&done).unwrap();
        assert!(d.elapsed(&copied, &done).is_ok());
    }
}

#[test]
fn host_functions_run_in_stream_order() {
    let d = dev(EmulatedConfig { jitter: Some(Jitter { seed: 7, max: Duration::from_micros(200) }), ..Default::default() });
    let s = d.create_stream(StreamKind::Compute).unwrap();
    let seen = Arc::new(Mutex::new(vec![]));
    for i in 0..50 {
        let seen = seen.clone();
        d.host_fn(s, Box::new(move || seen.lock().unwrap().push(i))).unwrap();
    }
    d.synchronize(&d.record(s).unwrap()).unwrap();
    assert_eq!(*seen.lock().unwrap(), (0..50).collect::<Vec<_>>());
}

/// 8 MB at 200 MB/s takes at least 40 ms of copy-engine time.
#[test]
fn the_copy_engine_is_paced() {
    let d = dev(EmulatedConfig { memory_bytes: 16 << 20, h2d_bytes_per_second: Some(200e6), ..Default::default() });
    let s = d.create_stream(StreamKind::Copy).unwrap();
    let p = d.alloc(8 << 20).unwrap();
    let started = Instant::now();
    let before = d.record(s).unwrap();
    d.upload(s, &HostBytes::from_vec(vec![1u8; 8 << 20]), p).unwrap();
    let after = d.record(s).unwrap();
    d.synchronize(&after).unwrap();
    let took = d.elapsed(&before, &after).unwrap();
    assert!(took >= Duration::from_millis(40) && started.elapsed() >= took, "{took:?}");
    assert!(d.stats().copy_busy >= Duration::from_millis(40));
    assert_eq!(d.stats().bytes_uploaded, 8 << 20);
}

#[test]
fn bad_launches_are_refused_and_faults_are_sticky() {
    let d = dev(EmulatedConfig::default());
    let s = d.create_stream(StreamKind::Compute).unwrap();
    let a = d.alloc(64 * 4).unwrap();
    // Shapes and bounds are checked at launch.
    let overrun = Op::Zero { x: a.matrix(9, 8) };
    assert!(matches!(d.launch(s, &overrun), Err(DeviceError::Invalid(_))));
    let aliased = Op::SiluMul { gate: a.matrix(8, 8), up: a.matrix(8, 8), precision: duplex_kernels::Precision::F32 };
    assert!(matches!(d.launch(s, &aliased), Err(DeviceError::Invalid(_))));
    assert!(d.upload(s, &HostBytes::from_vec(vec![0; 10]), a).is_err(), "length mismatch");
    // Row slices of an FP8 weight keep to its scale blocks.
    let (data, scales) = (d.alloc(300 * 128).unwrap(), d.alloc(3 * 4).unwrap());
    let w = duplex_kernels::device::DeviceWeight { data, scales, rows: 300, cols: 128, format: duplex_kernels::WeightFormat::Fp8E4m3 { block: [128, 128] } };
    let tail = w.rows(128..300).unwrap();
    assert_eq!((tail.rows, tail.data.bytes, tail.scales.bytes, tail.scales.addr), (172, 172 * 128, 8, scales.addr + 4));
    assert!(w.rows(64..192).is_err() && w.rows(0..100).is_err() && w.rows(0..301).is_err());
    // An index out of range is data, seen only when the kernel runs: the
    // fault surfaces at the next synchronisation and stays.
    let (rows, dst) = (d.alloc(4).unwrap(), d.alloc(64 * 4).unwrap());
    device::upload_u32(&*d, s, &[99], rows).unwrap();
    d.launch(s, &Op::GatherRows { src: a.matrix(8, 8), rows, count: 1, dst: dst.matrix(8, 8) }).unwrap();
    // The stream may have run it already (recording then fails) or not (waiting then fails).
    let faulted = match d.record(s) {
        Ok(e) => d.synchronize(&e).is_err(),
        Err(_) => true,
    };
    assert!(faulted);
    assert!(d.launch(s, &Op::Zero { x: a.matrix(8, 8) }).is_err(), "faults are sticky");
}

/// Staging round trip, the pattern of hybrid decode's CPU experts: a copy
/// down into staging memory, a host function that reads it and writes an
/// answer beside it, a copy of the answer back up, all queued at once on one
/// stream, with random delays in the stream.
#[test]
fn staging_copies_and_host_functions_keep_stream_order() {
    for seed in 0..10 {
        let d = dev(EmulatedConfig { jitter: Some(Jitter { seed, max: Duration::from_micros(300) }), ..Default::default() });
        let s = d.create_stream(StreamKind::Compute).unwrap();
        let (x, y) = (d.alloc(16 * 4).unwrap(), d.alloc(16 * 4).unwrap());
        let xs: Vec<f32> = (0..16).map(|i| i as f32).collect();
        device::upload_f32(&*d, s, &xs, x).unwrap();
        let staging = d.staging(32 * 4).unwrap();
        d.download_to(s, x, &staging, 0).unwrap();
        let st = staging.clone();
        d.host_fn(s, Box::new(move || {
            let mut bytes = st.lock();
            let (input, output) = bytes.split_at_mut(64);
            for (o, i) in output.chunks_exact_mut(4).zip(input.chunks_exact(4)) {
                o.copy_from_slice(&(2.0 * f32::from_le_bytes(i.try_into().unwrap())).to_le_bytes());
            }
        }))
        .unwrap();
        d.upload_from(s, &staging, 64, y).unwrap();
        let done = d.record(s).unwrap();
        let got = device::download_matrix(&*d, s, y.matrix(1, 16)).unwrap();
        assert_eq!(got, xs.iter().map(|v| 2.0 * v).collect::<Vec<_>>(), "seed {seed}");
        assert!(d.query(&done).unwrap(), "the download came after the event");
    }
}

#[test]
fn staging_ranges_are_checked_and_failures_show_in_query() {
    let d = dev(EmulatedConfig::default());
    let s = d.create_stream(StreamKind::Compute).unwrap();
    let p = d.alloc(64).unwrap();
    let staging = d.staging(48).unwrap();
    assert!(matches!(d.download_to(s, p, &staging, 0), Err(DeviceError::Invalid(_))), "64 bytes into 48");
    assert!(matches!(d.upload_from(s, &staging, 40, p.slice(0, 16).unwrap()), Err(DeviceError::Invalid(_))), "past the end");
    // A stream stuck in a host function: its event is not reached yet.
    let (release, stuck) = std::sync::mpsc::channel::<()>();
    d.host_fn(s, Box::new(move || {
        let _ = stuck.recv();
    }))
    .unwrap();
    let later = d.record(s).unwrap();
    assert!(!d.query(&later).unwrap());
    release.send(()).unwrap();
    d.synchronize(&later).unwrap();
    assert!(d.query(&later).unwrap());
    // A fault on the device shows in `query`, so a host waiting on a stream can stop.
    let bad = device::PagedKv { pool: p, n_layers: 1, block_size: 1, entry_dim: 4 };
    let table = d.alloc(4).unwrap();
    device::upload_u32(&*d, s, &[99], table).unwrap();
    // An event from before the fault: once the fault has happened (the
    // stream runs on by itself), querying any event reports it.
    let before = d.record(s).unwrap();
    d.launch(s, &Op::KvGather { kv: bad, table, blocks: 1, layer: 0, out: d.alloc(16).unwrap().matrix(1, 4) }).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while d.query(&before).is_ok() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(1));
    }
    assert!(d.query(&before).is_err(), "a faulted device reports it");
}

#[test]
fn graphs_run_what_was_captured_when_launched_and_update_per_shape() {
    common::graphs::two_streams_captured_and_launched(&*dev(EmulatedConfig::default()));
    // Random delays on every stream command do not change what runs when.
    for seed in 0..6 {
        common::graphs::two_streams_captured_and_launched(&*dev(EmulatedConfig { jitter: Some(Jitter { seed, max: Duration::from_micros(200) }), ..Default::default() }));
    }
}

#[test]
fn graph_capture_refuses_what_cuda_refuses() {
    common::graphs::capture_rules_are_enforced(&*dev(EmulatedConfig::default()));
}
