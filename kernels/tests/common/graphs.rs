//! Graph capture as the hybrid decode step uses it, checked the same way on
//! every backend: two streams forked and joined by events, kernels, copies
//! through staging and a host function, launched through an executable
//! graph kept per shape; and the capture rules, each refused.

use duplex_kernels::device::{download_matrix, Device, DeviceError, DevicePtr, GraphExec, GraphLaunch, HostBytes, Op, StreamId, StreamKind};
use duplex_kernels::Precision;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

const N: usize = 256;

struct Buffers {
    x: DevicePtr,
    d: DevicePtr,
    y: DevicePtr,
    z: DevicePtr,
}

/// Capture on `a`, with `b` forked: `x += d` on `a`, copied down, doubled by
/// a host function and copied up into `y`; `z = d` on `b` (and, with
/// `extra`, once more `z += d`: another shape); `b` joined back.
fn capture_step(dev: &dyn Device, (a, b): (StreamId, StreamId), m: &Buffers, staging: &Arc<duplex_kernels::device::Staging>, ran: &Arc<AtomicUsize>, extra: bool) -> duplex_kernels::device::Graph {
    let mat = |p: DevicePtr| p.matrix(1, N);
    dev.begin_capture(a).unwrap();
    dev.wait_event(b, &dev.record(a).unwrap()).unwrap();
    dev.launch(a, &Op::Add { h: mat(m.x), delta: mat(m.d), precision: Precision::F32 }).unwrap();
    dev.download_to(a, m.x, staging, 0).unwrap();
    let (st, ran) = (staging.clone(), ran.clone());
    dev.host_fn(
        a,
        Box::new(move || {
            let mut bytes = st.lock();
            let (input, output) = bytes.split_at_mut(N * 4);
            for (o, i) in output.chunks_exact_mut(4).zip(input.chunks_exact(4)) {
                o.copy_from_slice(&(2.0 * f32::from_le_bytes(i.try_into().unwrap())).to_le_bytes());
            }
            ran.fetch_add(1, Ordering::SeqCst);
        }),
    )
    .unwrap();
    dev.upload_from(a, staging, N * 4, m.y).unwrap();
    dev.launch(b, &Op::Zero { x: mat(m.z) }).unwrap();
    dev.launch(b, &Op::Add { h: mat(m.z), delta: mat(m.d), precision: Precision::F32 }).unwrap();
    if extra {
        dev.launch(b, &Op::Add { h: mat(m.z), delta: mat(m.d), precision: Precision::F32 }).unwrap();
    }
    dev.wait_event(a, &dev.record(b).unwrap()).unwrap();
    dev.end_capture(a).unwrap()
}

/// A captured two-stream step runs only when launched, computes what its
/// work says with the inputs of the time, and relaunches at the same shape
/// by updating the kept executable graph (a new shape instantiates one).
pub fn two_streams_captured_and_launched(dev: &dyn Device) {
    let (a, b) = (dev.create_stream(StreamKind::Compute).unwrap(), dev.create_stream(StreamKind::Compute).unwrap());
    let m = Buffers { x: dev.alloc(N * 4).unwrap(), d: dev.alloc(N * 4).unwrap(), y: dev.alloc(N * 4).unwrap(), z: dev.alloc(N * 4).unwrap() };
    let staging = dev.staging(2 * N * 4).unwrap();
    let ran = Arc::new(AtomicUsize::new(0));
    let mut exec: Option<GraphExec> = None;
    for (round, (extra, expected)) in [(false, GraphLaunch::Instantiated), (false, GraphLaunch::Updated), (true, GraphLaunch::Instantiated), (true, GraphLaunch::Updated)].into_iter().enumerate() {
        let xs: Vec<f32> = (0..N).map(|i| (i + round) as f32).collect();
        let ds: Vec<f32> = (0..N).map(|i| 0.5 * i as f32 - round as f32).collect();
        dev.upload(a, &HostBytes::from_f32(&xs), m.x).unwrap();
        dev.upload(a, &HostBytes::from_f32(&ds), m.d).unwrap();
        dev.upload(a, &HostBytes::from_f32(&[-1.0; N]), m.y).unwrap();
        let before = dev.record(a).unwrap();
        dev.synchronize(&before).unwrap();
        let graph = capture_step(dev, (a, b), &m, &staging, &ran, extra);
        // Captured, not run.
        assert_eq!(ran.load(Ordering::SeqCst), round, "round {round}: the host function ran at capture");
        assert_eq!(download_matrix(dev, a, m.y.matrix(1, N)).unwrap(), vec![-1.0; N], "round {round}: a copy ran at capture");
        let launched = dev.launch_graph(a, graph, &mut exec).unwrap();
        assert_eq!(launched, expected, "round {round}");
        // `a`'s later work waits for the whole graph, `b`'s part included.
        let y = download_matrix(dev, a, m.y.matrix(1, N)).unwrap();
        let z = download_matrix(dev, a, m.z.matrix(1, N)).unwrap();
        assert_eq!(ran.load(Ordering::SeqCst), round + 1);
        for i in 0..N {
            assert_eq!(y[i], 2.0 * (xs[i] + ds[i]), "round {round}, y[{i}]");
            assert_eq!(z[i], if extra { 2.0 * ds[i] } else { ds[i] }, "round {round}, z[{i}]");
        }
    }
    for p in [m.x, m.d, m.y, m.z] {
        dev.free(p).unwrap();
    }
}

fn refused<T: std::fmt::Debug>(r: Result<T, DeviceError>, what: &str) -> String {
    match r {
        Err(DeviceError::Invalid(why)) => why,
        other => panic!("{what}: {other:?}, expected a refusal"),
    }
}

/// What a capture may not do is refused and fails the capture, whose end
/// then says why; the streams work normally afterwards.
pub fn capture_rules_are_enforced(dev: &dyn Device) {
    let (a, b) = (dev.create_stream(StreamKind::Compute).unwrap(), dev.create_stream(StreamKind::Compute).unwrap());
    let p = dev.alloc(N * 4).unwrap();
    let mat = p.matrix(1, N);
    let outside = dev.record(b).unwrap();

    dev.begin_capture(a).unwrap();
    assert!(refused(dev.download(a, p), "a download").contains("captured"));
    assert!(refused(dev.end_capture(a), "the end of a failed capture").contains("download"));

    dev.begin_capture(a).unwrap();
    refused(dev.upload(a, &HostBytes::from_f32(&[0.0; N]), p), "an upload of host bytes");
    refused(dev.end_capture(a), "the end of a failed capture");

    dev.begin_capture(a).unwrap();
    refused(dev.wait_event(a, &outside), "a wait on an event from outside");
    refused(dev.end_capture(a), "the end of a failed capture");

    dev.begin_capture(a).unwrap();
    refused(dev.begin_capture(a), "a second capture of a capturing stream");
    dev.wait_event(b, &dev.record(a).unwrap()).unwrap();
    dev.launch(b, &Op::Zero { x: mat }).unwrap();
    let captured = dev.record(b).unwrap();
    refused(dev.query(&captured), "a query of a captured event");
    refused(dev.synchronize(&captured), "a host wait on a captured event");
    assert!(refused(dev.end_capture(a), "a capture with a stream not joined back").contains("joined"));
    refused(dev.synchronize(&captured), "a host wait on a captured event after its capture");

    // Both streams run normally again.
    dev.upload(b, &HostBytes::from_f32(&[3.0; N]), p).unwrap();
    assert_eq!(download_matrix(dev, b, mat).unwrap(), vec![3.0; N]);
    dev.launch(a, &Op::Zero { x: mat }).unwrap();
    assert_eq!(download_matrix(dev, a, mat).unwrap(), vec![0.0; N]);
    dev.free(p).unwrap();
}
