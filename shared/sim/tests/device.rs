//! The simulated accelerator's own semantics: virtual time across streams,
//! events and host waits, and a fault in its functional mode that is an
//! error from then on, never a hang.

use duplex_kernels::clock;
use duplex_kernels::device::{upload_u32, Device, HostBytes, Op, StreamKind};
use duplex_sim::device::{CostModel, SimConfig, SimDevice};
use std::sync::Arc;
use std::time::Duration;

/// Kernels 1 ms; copies 1 GB/s.
struct Fixed;

impl CostModel for Fixed {
    fn op(&self, _: &Op) -> Duration {
        Duration::from_millis(1)
    }
    fn h2d(&self, bytes: usize) -> Duration {
        Duration::from_secs_f64(bytes as f64 / 1e9)
    }
    fn d2h(&self, bytes: usize) -> Duration {
        self.h2d(bytes)
    }
}

fn device(functional: bool) -> Arc<SimDevice> {
    SimDevice::new(SimConfig { name: "test".into(), memory_bytes: 64 << 20, cost: Arc::new(Fixed), seed: 1, functional })
}

#[test]
fn streams_overlap_and_events_order_them_in_virtual_time() {
    let dev = device(false);
    let (copy, compute) = (dev.create_stream(StreamKind::Copy).unwrap(), dev.create_stream(StreamKind::Compute).unwrap());
    let (weights, x) = (dev.alloc(4 << 20).unwrap(), dev.alloc(4096).unwrap());
    let zero = Op::Zero { x: x.matrix(1, 1024) };
    clock::set(Some(Duration::ZERO));
    // 4 MiB at 1 GB/s on the copy stream while three 1 ms kernels run: they overlap.
    dev.upload(copy, &HostBytes::from_vec(vec![0; 4 << 20]), weights).unwrap();
    let loaded = dev.record(copy).unwrap();
    for _ in 0..3 {
        dev.launch(compute, &zero).unwrap();
    }
    let computed = dev.record(compute).unwrap();
    dev.synchronize(&computed).unwrap();
    assert_eq!(clock::now(), Some(Duration::from_millis(3)), "the host waited for the kernels only");
    // A kernel ordered after the upload starts when it ends.
    dev.wait_event(compute, &loaded).unwrap();
    dev.launch(compute, &zero).unwrap();
    let done = dev.record(compute).unwrap();
    dev.synchronize(&done).unwrap();
    let upload = Duration::from_secs_f64((4 << 20) as f64 / 1e9);
    assert_eq!(clock::now(), Some(upload + Duration::from_millis(1)));
    assert_eq!(dev.elapsed(&computed, &done).unwrap(), upload + Duration::from_millis(1) - Duration::from_millis(3));
    let stats = dev.stats();
    assert_eq!((stats.compute_busy, stats.h2d_busy), (Duration::from_millis(4), upload));
    clock::set(None);
}

#[test]
fn a_functional_fault_is_an_error_from_then_on_not_a_hang() {
    let dev = device(true);
    let s = dev.create_stream(StreamKind::Compute).unwrap();
    let (src, dst, rows) = (dev.alloc(4 * 16).unwrap(), dev.alloc(4 * 16).unwrap(), dev.alloc(4).unwrap());
    upload_u32(&*dev, s, &[9], rows).unwrap(); // row 9 of a 4-row matrix
    dev.launch(s, &Op::GatherRows { src: src.matrix(4, 4), rows, count: 1, dst: dst.matrix(4, 4) }).unwrap();
    // The stream may have run it already (recording then fails with the
    // fault) or not (waiting for it then does).
    let err = match dev.record(s) {
        Ok(e) => {
            let err = dev.synchronize(&e).unwrap_err();
            assert!(dev.query(&e).is_err());
            err
        }
        Err(err) => err,
    };
    assert!(err.to_string().contains("row 9"), "{err}");
    assert!(dev.launch(s, &Op::Zero { x: dst.matrix(4, 4) }).is_err(), "later work is refused");
}
