//! A device that logs what each of its streams is given, around any other
//! device: tests compare two backends' logs to show they were given the
//! same schedule (the simulator's proof that it runs the production one).

use super::{Device, DeviceError, DevicePtr, Event, Graph, GraphExec, GraphLaunch, HostBytes, Op, Staging, StreamId, StreamKind};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

/// One command as a stream was given it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TraceEntry {
    Upload { bytes: usize },
    Download { bytes: usize },
    DownloadTo { bytes: usize },
    UploadFrom { bytes: usize },
    Launch(&'static str),
    /// The stream's next event (they are numbered per stream from 0).
    Record,
    /// A wait for event `record` of stream `stream`.
    Wait { stream: usize, record: usize },
    HostFn,
}

#[derive(Default)]
struct Log {
    /// Per stream, its commands in the order it got them.
    streams: Vec<Vec<TraceEntry>>,
    /// Per stream, events recorded so far.
    records: Vec<usize>,
    /// Each recorded event's name, by its state's address; the event is
    /// kept so that the address is not reused.
    events: HashMap<usize, (Event, (usize, usize))>,
}

impl Log {
    /// Stream `s`'s log, made on first use.
    fn stream(&mut self, s: StreamId) -> &mut Vec<TraceEntry> {
        if self.streams.len() <= s.0 {
            self.streams.resize_with(s.0 + 1, Vec::new);
            self.records.resize(s.0 + 1, 0);
        }
        &mut self.streams[s.0]
    }
}

/// `inner`, with every stream command logged. A command is logged and
/// given to `inner` under one lock, so each stream's log is the order the
/// stream really got them in; only that order is a property of the program
/// (how streams interleave depends on timing), so that is what
/// [`Traced::per_stream`] gives.
pub struct Traced {
    inner: Arc<dyn Device>,
    log: Mutex<Log>,
}

fn address(e: &Event) -> usize {
    Arc::as_ptr(&e.0) as *const () as usize
}

impl Traced {
    pub fn new(inner: Arc<dyn Device>) -> Arc<Traced> {
        Arc::new(Traced { inner, log: Mutex::default() })
    }

    /// Each stream's commands, in order.
    pub fn per_stream(&self) -> Vec<Vec<TraceEntry>> {
        self.lock().streams.clone()
    }

    fn lock(&self) -> MutexGuard<'_, Log> {
        self.log.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Log `entry` on `stream` and run `f` under the same lock.
    fn logged<T>(&self, stream: StreamId, entry: TraceEntry, f: impl FnOnce() -> Result<T, DeviceError>) -> Result<T, DeviceError> {
        let mut log = self.lock();
        log.stream(stream).push(entry);
        f()
    }
}

impl Device for Traced {
    fn describe(&self) -> String {
        format!("traced {}", self.inner.describe())
    }

    fn capacity(&self) -> usize {
        self.inner.capacity()
    }

    fn free_bytes(&self) -> usize {
        self.inner.free_bytes()
    }

    fn alloc(&self, bytes: usize) -> Result<DevicePtr, DeviceError> {
        self.inner.alloc(bytes)
    }

    fn free(&self, ptr: DevicePtr) -> Result<(), DeviceError> {
        self.inner.free(ptr)
    }

    fn create_stream(&self, kind: StreamKind) -> Result<StreamId, DeviceError> {
        self.inner.create_stream(kind)
    }

    fn upload(&self, stream: StreamId, src: &HostBytes, dst: DevicePtr) -> Result<(), DeviceError> {
        self.logged(stream, TraceEntry::Upload { bytes: dst.bytes }, || self.inner.upload(stream, src, dst))
    }

    /// Logged, then run outside the lock: it waits for the stream.
    fn download(&self, stream: StreamId, src: DevicePtr) -> Result<Vec<u8>, DeviceError> {
        self.logged(stream, TraceEntry::Download { bytes: src.bytes }, || Ok(()))?;
        self.inner.download(stream, src)
    }

    fn staging(&self, bytes: usize) -> Result<Arc<Staging>, DeviceError> {
        self.inner.staging(bytes)
    }

    fn download_to(&self, stream: StreamId, src: DevicePtr, dst: &Arc<Staging>, offset: usize) -> Result<(), DeviceError> {
        self.logged(stream, TraceEntry::DownloadTo { bytes: src.bytes }, || self.inner.download_to(stream, src, dst, offset))
    }

    fn upload_from(&self, stream: StreamId, src: &Arc<Staging>, offset: usize, dst: DevicePtr) -> Result<(), DeviceError> {
        self.logged(stream, TraceEntry::UploadFrom { bytes: dst.bytes }, || self.inner.upload_from(stream, src, offset, dst))
    }

    fn launch(&self, stream: StreamId, op: &Op) -> Result<(), DeviceError> {
        self.logged(stream, TraceEntry::Launch(op.name()), || self.inner.launch(stream, op))
    }

    fn record(&self, stream: StreamId) -> Result<Event, DeviceError> {
        let mut log = self.lock();
        let event = self.inner.record(stream)?;
        log.stream(stream).push(TraceEntry::Record);
        let name = (stream.0, log.records[stream.0]);
        log.records[stream.0] += 1;
        log.events.insert(address(&event), (event.clone(), name));
        Ok(event)
    }

    fn wait_event(&self, stream: StreamId, event: &Event) -> Result<(), DeviceError> {
        let name = self.lock().events.get(&address(event)).map(|(_, name)| *name);
        match name {
            Some((s, record)) => self.logged(stream, TraceEntry::Wait { stream: s, record }, || self.inner.wait_event(stream, event)),
            None => Err(DeviceError::Invalid("an event this traced device did not record".into())),
        }
    }

    fn query(&self, event: &Event) -> Result<bool, DeviceError> {
        self.inner.query(event)
    }

    fn synchronize(&self, event: &Event) -> Result<(), DeviceError> {
        self.inner.synchronize(event)
    }

    fn elapsed(&self, from: &Event, to: &Event) -> Result<Duration, DeviceError> {
        self.inner.elapsed(from, to)
    }

    fn host_fn(&self, stream: StreamId, f: Box<dyn FnOnce() + Send>) -> Result<(), DeviceError> {
        self.logged(stream, TraceEntry::HostFn, || self.inner.host_fn(stream, f))
    }

    fn register_host(&self, src: &HostBytes) -> Result<(), DeviceError> {
        self.inner.register_host(src)
    }

    fn compute_busy(&self) -> Option<Duration> {
        self.inner.compute_busy()
    }

    /// Captured work is logged as it is given, as any other.
    fn begin_capture(&self, stream: StreamId) -> Result<(), DeviceError> {
        self.inner.begin_capture(stream)
    }

    fn end_capture(&self, stream: StreamId) -> Result<Graph, DeviceError> {
        self.inner.end_capture(stream)
    }

    fn launch_graph(&self, stream: StreamId, graph: Graph, exec: &mut Option<GraphExec>) -> Result<GraphLaunch, DeviceError> {
        self.inner.launch_graph(stream, graph, exec)
    }
}
