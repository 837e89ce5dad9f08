//! The device lease (`lease.rs`): granted only when the decode worker is
//! idle and the memory can be spared, one at a time; revoked by a decode
//! admission, which then waits only until the borrower drops the stream, and
//! at most the configured bound; released when the stream is dropped. The
//! last test goes through the gRPC services over the real batcher.

use duplex_decode::batcher::{Batcher, Command, Limits};
use duplex_decode::engine::Engine;
use duplex_decode::kv_alloc::KvAllocator;
use duplex_decode::lease::{DeviceLender, LeaseEvent, LeaseStream, Lendable};
use duplex_decode::server::{DecodeService, LeaseService};
use duplex_kernels::device::emulated::{EmulatedConfig, EmulatedDevice};
use duplex_kernels::device::Device;
use duplex_model::sampling::SamplingParams;
use duplex_model::{KvPool, Model, Precision};
use duplex_proto::stats::StatsCell;
use duplex_proto::worker::decode_worker_server::DecodeWorker;
use duplex_proto::worker::device_lease_event::Event;
use duplex_proto::worker::device_lease_server::DeviceLease;
use duplex_proto::worker::{DecodeRequest, DeviceLeaseRequest};
use std::sync::mpsc::Sender;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio_stream::StreamExt;

fn lender(budget_bytes: Option<u64>, revoke_wait: Duration) -> Arc<DeviceLender> {
    DeviceLender::new(Lendable { device: None, budget_bytes }, revoke_wait)
}

/// The stream's next event, within a second.
async fn next(stream: &mut LeaseStream) -> Option<LeaseEvent> {
    tokio::time::timeout(Duration::from_secs(1), stream.next()).await.expect("an event or the end within 1 s")
}

fn granted(lender: &Arc<DeviceLender>) -> LeaseStream {
    lender.reserve("long", 1 << 20).expect("reserved").grant(0)
}

fn refusal(event: Option<LeaseEvent>) -> String {
    match event {
        Some(LeaseEvent::Refused { reason }) => reason,
        other => panic!("expected a refusal, got {other:?}"),
    }
}

#[tokio::test]
async fn granted_when_idle_and_released_when_the_stream_is_dropped() {
    let lender = lender(None, Duration::from_secs(5));
    let mut stream = granted(&lender);
    assert_eq!(next(&mut stream).await, Some(LeaseEvent::Granted));
    assert!(lender.is_lent());
    // Held: the stream stays open, with nothing more to say.
    assert!(tokio::time::timeout(Duration::from_millis(100), stream.next()).await.is_err(), "no event while nothing happens");
    // One at a time.
    let reason = lender.reserve("other", 1).err().expect("a second lease is refused");
    assert!(reason.contains("already lent") && reason.contains("long"), "{reason}");
    drop(stream);
    assert!(!lender.is_lent(), "dropping the stream ends the lease");
    let mut again = granted(&lender);
    assert_eq!(next(&mut again).await, Some(LeaseEvent::Granted), "lent again once given back");
}

#[tokio::test]
async fn refused_while_sequences_run_or_an_admission_is_on_its_way_or_memory_is_short() {
    let lender = lender(Some(1000), Duration::from_secs(5));
    let mut stream = lender.reserve("long", 10).unwrap().grant(2);
    let reason = refusal(next(&mut stream).await);
    assert!(reason.contains("2 running or queued"), "{reason}");
    assert!(next(&mut stream).await.is_none(), "a refusal ends the stream");
    assert!(!lender.is_lent(), "a refused lease holds nothing");

    let reason = lender.reserve("long", 1001).err().expect("more than the budget");
    assert!(reason.contains("1001 bytes asked, 1000 can be lent"), "{reason}");

    // An admission between its arrival and the engine's queue.
    let admitting = lender.admit().await;
    let reason = lender.reserve("long", 10).err().expect("refused during an admission");
    assert!(reason.contains("being admitted"), "{reason}");
    drop(admitting);
    assert!(lender.reserve("long", 10).is_ok());
}

#[tokio::test]
async fn the_spare_memory_of_a_device_bounds_the_loan() {
    let device: Arc<dyn Device> = EmulatedDevice::new(EmulatedConfig { memory_bytes: 8 << 20, compute_threads: 1, ..Default::default() }).unwrap();
    let used = device.alloc(6 << 20).unwrap();
    let lender = DeviceLender::new(Lendable { device: Some(device.clone()), budget_bytes: None }, Duration::from_secs(1));
    let reason = lender.reserve("long", 4 << 20).err().expect("4 MiB do not fit in the 2 free");
    assert!(reason.contains(&format!("{} bytes asked", 4 << 20)), "{reason}");
    assert!(lender.reserve("long", 1 << 20).is_ok());
    device.free(used).unwrap();
}

#[tokio::test]
async fn an_admission_revokes_the_lease_and_waits_only_until_it_is_given_back() {
    let lender = lender(None, Duration::from_secs(5));
    let mut stream = granted(&lender);
    assert_eq!(next(&mut stream).await, Some(LeaseEvent::Granted));
    let started = Instant::now();
    let admission = tokio::spawn({
        let lender = lender.clone();
        async move {
            let _admitting = lender.admit().await;
            Instant::now()
        }
    });
    assert_eq!(next(&mut stream).await, Some(LeaseEvent::Revoked), "the holder is told");
    // The borrower needs a while to stop (its next module); the admission waits.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!admission.is_finished(), "the admission waits for the device");
    let released = Instant::now();
    drop(stream);
    let admitted = tokio::time::timeout(Duration::from_secs(1), admission).await.expect("admitted once given back").unwrap();
    let waited = admitted - started;
    assert!(waited >= Duration::from_millis(300), "waited {waited:?}");
    assert!(admitted - released < Duration::from_millis(200), "admitted {:?} after the release", admitted - released);
    assert!(!lender.is_lent());
}

#[tokio::test]
async fn an_admission_during_the_grant_refuses_it() {
    let lender = lender(None, Duration::from_secs(5));
    let reservation = lender.reserve("long", 1).unwrap();
    let admission = tokio::spawn({
        let lender = lender.clone();
        async move {
            let _admitting = lender.admit().await;
        }
    });
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(!admission.is_finished(), "waits for the reservation");
    let mut stream = reservation.grant(0);
    let reason = refusal(next(&mut stream).await);
    assert!(reason.contains("decode request arrived"), "{reason}");
    tokio::time::timeout(Duration::from_secs(1), admission).await.expect("admitted at the refusal").unwrap();
}

#[tokio::test]
async fn the_wait_is_bounded_and_an_abandoned_lease_is_not_waited_on_again() {
    let lender = lender(None, Duration::from_millis(300));
    let mut stream = granted(&lender);
    assert_eq!(next(&mut stream).await, Some(LeaseEvent::Granted));
    let started = Instant::now();
    drop(lender.admit().await);
    let waited = started.elapsed();
    assert!(waited >= Duration::from_millis(300) && waited < Duration::from_secs(1), "waited {waited:?}");
    assert_eq!(next(&mut stream).await, Some(LeaseEvent::Revoked));
    let started = Instant::now();
    drop(lender.admit().await);
    assert!(started.elapsed() < Duration::from_millis(100), "the next admission does not wait: {:?}", started.elapsed());
    assert!(lender.reserve("other", 1).is_err(), "still held until its stream is dropped");
    drop(stream);
    assert!(lender.reserve("other", 1).is_ok());
}

fn start_batcher() -> Sender<Command> {
    let model = Model::load(std::path::Path::new(duplex_model::BUNDLED_MODEL), &mut |_, _| {}).unwrap();
    let pool = KvPool::new(64, 16, model.cfg.num_hidden_layers, model.cfg.kv_entry_dim());
    let stats = Arc::new(StatsCell::new(1024, "test".into()));
    let limits = Limits { context_length: 1024, lease_timeout: Duration::from_secs(60), max_batch_size: 6, prefill_chunk_tokens: 64, max_waiting_requests: 4 };
    let batcher = Batcher::new(Engine::Cpu(model), KvAllocator::new(pool, 1), limits, Precision::F32, stats);
    let (commands, receiver) = std::sync::mpsc::channel();
    std::thread::spawn(move || batcher.run(receiver));
    commands
}

fn decode_request(id: &str, max_tokens: u32) -> DecodeRequest {
    let sampling = SamplingParams { seed: Some(1), ..SamplingParams::greedy() };
    DecodeRequest { request_id: id.into(), prompt: (100..120).collect(), sampling: Some((&sampling).into()), max_tokens, stop_token_ids: vec![], prefilled: None }
}

/// Through the services over the real batcher: the lease is granted while
/// nothing decodes; a Decode call revokes it and reaches the engine only
/// once the stream is dropped; while it decodes, a lease is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn through_the_services_a_decode_call_takes_the_device_back() {
    let commands = start_batcher();
    let lender = lender(None, Duration::from_secs(5));
    let decode = Arc::new(DecodeService::new(commands.clone(), Arc::new(StatsCell::new(1024, "test".into())), 2048, 1024).with_lender(lender.clone()));
    let leases = LeaseService::new(commands, lender.clone());
    let ask = || leases.lease_device(tonic::Request::new(DeviceLeaseRequest { request_id: "long".into(), bytes: 1 << 30 }));
    let mut lease = ask().await.unwrap().into_inner();
    let first = lease.next().await.unwrap().unwrap().event;
    assert!(matches!(first, Some(Event::Granted(_))), "{first:?}");

    let call = tokio::spawn({
        let decode = decode.clone();
        async move { decode.decode(tonic::Request::new(decode_request("short", 64))).await.map(|r| r.into_inner()) }
    });
    let revoked = tokio::time::timeout(Duration::from_secs(1), lease.next()).await.unwrap().unwrap().unwrap().event;
    assert!(matches!(revoked, Some(Event::Revoked(_))), "{revoked:?}");
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(!call.is_finished(), "the Decode call waits for the device");
    drop(lease);
    let mut tokens = tokio::time::timeout(Duration::from_secs(2), call).await.expect("admitted once the lease is dropped").unwrap().unwrap();
    let token = tokio::time::timeout(Duration::from_secs(30), tokens.next()).await.unwrap().unwrap().unwrap();
    assert!(token.token.is_some());

    // Decoding now (64 tokens, read no further): refused.
    let mut refused = ask().await.unwrap().into_inner();
    let event = refused.next().await.unwrap().unwrap().event;
    let Some(Event::Refused(r)) = event else { panic!("expected a refusal, got {event:?}") };
    assert!(r.reason.contains("1 running or queued"), "{}", r.reason);
    drop(tokens);
}

/// A borrower killed mid-lease (its socket closes, with no frame sent):
/// the gRPC server drops the lease's stream, so the lease ends at once and
/// the admission waiting on it goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_borrower_whose_connection_dies_releases_the_lease_at_once() {
    use duplex_proto::worker::device_lease_client::DeviceLeaseClient;
    use duplex_proto::worker::device_lease_server::DeviceLeaseServer;
    use tokio::net::{TcpListener, TcpStream};
    // An engine with nothing to decode.
    let (commands, receiver) = std::sync::mpsc::channel::<Command>();
    std::thread::spawn(move || {
        for command in receiver {
            if let Command::Sequences { reply } = command {
                let _ = reply.send(0);
            }
        }
    });
    let lender = lender(None, Duration::from_secs(5));
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let server_addr = listener.local_addr().unwrap();
    let service = DeviceLeaseServer::new(LeaseService::new(commands, lender.clone()));
    tokio::spawn(tonic::transport::Server::builder().add_service(service).serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)));
    // The borrower's end of the connection: aborting it closes the sockets
    // as a kill -9 of the borrower's process would.
    let proxy = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let proxy_addr = proxy.local_addr().unwrap();
    let link = tokio::spawn(async move {
        let (mut inbound, _) = proxy.accept().await.unwrap();
        let mut outbound = TcpStream::connect(server_addr).await.unwrap();
        let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
    });
    let mut client = DeviceLeaseClient::connect(format!("http://{proxy_addr}")).await.unwrap();
    let mut stream = client.lease_device(DeviceLeaseRequest { request_id: "long".into(), bytes: 1 }).await.unwrap().into_inner();
    let first = stream.message().await.unwrap().and_then(|e| e.event);
    assert!(matches!(first, Some(Event::Granted(_))), "{first:?}");
    assert!(lender.is_lent());
    let admission = tokio::spawn({
        let lender = lender.clone();
        async move {
            let _admitting = lender.admit().await;
        }
    });
    let revoked = tokio::time::timeout(Duration::from_secs(1), stream.message()).await.unwrap().unwrap().and_then(|e| e.event);
    assert!(matches!(revoked, Some(Event::Revoked(_))), "{revoked:?}");
    // The borrower dies instead of dropping the stream.
    let killed = Instant::now();
    link.abort();
    tokio::time::timeout(Duration::from_secs(2), admission).await.expect("the admission goes on once the connection is gone").unwrap();
    assert!(!lender.is_lent());
    eprintln!("lease released {:?} after the borrower's connection closed", killed.elapsed());
    drop(stream);
}
