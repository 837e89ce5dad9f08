//! The prefill worker's side of the device lease (`DeviceBorrower`), against
//! a stand-in decode worker whose `LeaseDevice` stream the test writes: a
//! grant becomes a loan, a revocation sets its flag while the stream is kept
//! until the loan is dropped, a refusal and an absent decode worker are told
//! apart, and a lease stream that ends (the decode worker gone) counts as
//! revoked.

use duplex_prefill::server::{Borrowed, DeviceBorrower};
use duplex_proto::worker::device_lease_event::Event;
use duplex_proto::worker::device_lease_server::{DeviceLease, DeviceLeaseServer};
use duplex_proto::worker::{DeviceLeaseEvent, DeviceLeaseGranted, DeviceLeaseRefused, DeviceLeaseRequest, DeviceLeaseRevoked};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::mpsc::{unbounded_channel, UnboundedSender};
use tokio_stream::wrappers::UnboundedReceiverStream;
use tokio_stream::{Stream, StreamExt};
use tonic::{Request, Response, Status};

/// Answers one `LeaseDevice` call with the events the test sends, and says
/// when the caller has dropped the stream.
struct StandIn {
    events: Mutex<Option<tokio::sync::mpsc::UnboundedReceiver<DeviceLeaseEvent>>>,
    dropped: Arc<AtomicBool>,
}

struct SetOnDrop(Arc<AtomicBool>);

impl Drop for SetOnDrop {
    fn drop(&mut self) {
        self.0.store(true, Ordering::SeqCst);
    }
}

#[tonic::async_trait]
impl DeviceLease for StandIn {
    type LeaseDeviceStream = Pin<Box<dyn Stream<Item = Result<DeviceLeaseEvent, Status>> + Send>>;

    async fn lease_device(&self, _: Request<DeviceLeaseRequest>) -> Result<Response<Self::LeaseDeviceStream>, Status> {
        let events = self.events.lock().unwrap().take().ok_or_else(|| Status::resource_exhausted("one call per stand-in"))?;
        let on_drop = SetOnDrop(self.dropped.clone());
        Ok(Response::new(Box::pin(UnboundedReceiverStream::new(events).map(move |e| {
            let _held = &on_drop;
            Ok(e)
        }))))
    }
}

/// A stand-in decode worker on a loopback port, the sender of its stream's
/// events, its dropped flag, and a borrower of it.
fn stand_in(rt: &tokio::runtime::Runtime) -> (UnboundedSender<DeviceLeaseEvent>, Arc<AtomicBool>, DeviceBorrower) {
    let (events, receiver) = unbounded_channel();
    let dropped = Arc::new(AtomicBool::new(false));
    let service = DeviceLeaseServer::new(StandIn { events: Mutex::new(Some(receiver)), dropped: dropped.clone() });
    let listener = rt.block_on(tokio::net::TcpListener::bind("127.0.0.1:0")).unwrap();
    let address = listener.local_addr().unwrap();
    rt.spawn(tonic::transport::Server::builder().add_service(service).serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)));
    let borrower = DeviceBorrower::new(&address.to_string(), 1 << 20, rt.handle().clone()).unwrap();
    (events, dropped, borrower)
}

fn event(e: Event) -> DeviceLeaseEvent {
    DeviceLeaseEvent { event: Some(e) }
}

fn wait_until(what: &str, pred: impl Fn() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(2);
    while !pred() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap()
}

#[test]
fn a_grant_is_a_loan_revoked_on_request_and_given_back_when_dropped() {
    let rt = runtime();
    let (events, dropped, borrower) = stand_in(&rt);
    events.send(event(Event::Granted(DeviceLeaseGranted {}))).unwrap();
    let Borrowed::Granted(loan) = borrower.borrow("long") else { panic!("expected a grant") };
    std::thread::sleep(Duration::from_millis(50));
    assert!(!loan.revoked() && !dropped.load(Ordering::SeqCst), "held, not revoked");
    events.send(event(Event::Revoked(DeviceLeaseRevoked {}))).unwrap();
    wait_until("the revocation", || loan.revoked());
    std::thread::sleep(Duration::from_millis(50));
    assert!(!dropped.load(Ordering::SeqCst), "the stream is kept until the run stops and drops the loan");
    drop(loan);
    wait_until("the stream to be dropped", || dropped.load(Ordering::SeqCst));
}

#[test]
fn a_refusal_and_an_absent_decode_worker_are_told_apart() {
    let rt = runtime();
    let (events, _, borrower) = stand_in(&rt);
    events.send(event(Event::Refused(DeviceLeaseRefused { reason: "2 running or queued sequence(s)".into() }))).unwrap();
    match borrower.borrow("long") {
        Borrowed::Refused(reason) => assert_eq!(reason, "2 running or queued sequence(s)"),
        _ => panic!("expected a refusal"),
    }
    // Nothing listens on a port just given back.
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let absent = DeviceBorrower::new(&format!("127.0.0.1:{port}"), 1, rt.handle().clone()).unwrap();
    let started = Instant::now();
    match absent.borrow("long") {
        Borrowed::Unreachable(why) => assert!(!why.is_empty()),
        _ => panic!("expected no answer"),
    }
    assert!(started.elapsed() < Duration::from_secs(3), "bounded: {:?}", started.elapsed());
    let missing = DeviceBorrower::new("unix:/nonexistent/decode.sock", 1, rt.handle().clone()).unwrap();
    assert!(matches!(missing.borrow("long"), Borrowed::Unreachable(_)));
}

#[test]
fn a_lease_stream_that_ends_counts_as_revoked() {
    let rt = runtime();
    let (events, _, borrower) = stand_in(&rt);
    events.send(event(Event::Granted(DeviceLeaseGranted {}))).unwrap();
    let Borrowed::Granted(loan) = borrower.borrow("long") else { panic!("expected a grant") };
    drop(events); // the decode worker's side ends
    wait_until("the loan to be revoked", || loan.revoked());
}
