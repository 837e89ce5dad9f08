//! An accelerator emulated on the CPU, with a GPU's semantics.
//!
//! - Memory: one zeroed region of `memory_bytes`, handed out by an [`Arena`],
//!   so running out of it fails as a GPU's does.
//! - Streams: each is a thread running its commands in order. Events
//!   complete when their stream reaches them; a stream waiting on an event
//!   blocks until it does.
//! - Copy engine: every upload goes through one engine, one at a time, paced
//!   to `h2d_bytes_per_second` when set (PCIe 4.0 x16 moves about 25 GB/s),
//!   so transfer and compute overlap as they would on a real device.
//! - Compute: ops run one at a time on the device's own thread pool.
//! - `jitter` adds a random delay before every command, to shake out
//!   ordering bugs in tests.
//! - Graphs: a capture records what its streams are given instead of
//!   sending it, with CUDA's rules (what may not happen while capturing,
//!   streams joining by events and joined back before the end); launching
//!   the graph sends it all at once, fenced by events on the launching
//!   stream. An executable graph is the recorded shape (each command's
//!   stream and kind), so "updated" means the same shape, as CUDA's update
//!   needs the same topology.
//!
//! A failure inside a stream (an index out of range) is sticky, as a CUDA
//! fault is: every later call reports it.

use super::arena::Arena;
use super::host_ops::{Executor, Memory};
use super::{Device, DeviceError, DevicePtr, Event, Graph, GraphExec, GraphLaunch, HostBytes, Op, Staging, StreamId, StreamKind};
use std::collections::{HashMap, HashSet};
use crate::pool::{PoolConfig, ThreadPool};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{channel, Sender};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

#[derive(Clone, Debug)]
pub struct EmulatedConfig {
    /// Device memory, in bytes.
    pub memory_bytes: usize,
    /// Host→device copy bandwidth limit; `None` copies at memcpy speed.
    pub h2d_bytes_per_second: Option<f64>,
    /// Compute threads; 0 means every core.
    pub compute_threads: usize,
    /// Random delays before each stream command (tests).
    pub jitter: Option<Jitter>,
}

impl Default for EmulatedConfig {
    fn default() -> Self {
        EmulatedConfig { memory_bytes: 256 << 20, h2d_bytes_per_second: None, compute_threads: 0, jitter: None }
    }
}

#[derive(Clone, Copy, Debug)]
pub struct Jitter {
    pub seed: u64,
    /// Each delay is uniform in `0..max`.
    pub max: Duration,
}

/// Busy time and traffic so far.
#[derive(Clone, Debug, Default)]
pub struct EmulatedStats {
    pub bytes_uploaded: u64,
    pub copy_busy: Duration,
    pub compute_busy: Duration,
    /// Kernel time per op kind, in the order kinds first ran.
    pub per_op: Vec<(&'static str, Duration)>,
}

enum Command {
    Upload { src: HostBytes, dst: DevicePtr },
    Download { src: DevicePtr, reply: Sender<Result<Vec<u8>, DeviceError>> },
    DownloadTo { src: DevicePtr, dst: Arc<Staging>, offset: usize },
    UploadFrom { src: Arc<Staging>, offset: usize, dst: DevicePtr },
    Launch(Box<Op>),
    Record(Arc<EventState>),
    Wait(Arc<EventState>),
    HostFn(Box<dyn FnOnce() + Send>),
}

impl Command {
    /// What the command is, for a graph's shape.
    fn kind(&self) -> &'static str {
        match self {
            Command::Upload { .. } => "upload",
            Command::Download { .. } => "download",
            Command::DownloadTo { .. } => "download_to",
            Command::UploadFrom { .. } => "upload_from",
            Command::Launch(op) => op.name(),
            Command::Record(_) => "record",
            Command::Wait(_) => "wait",
            Command::HostFn(_) => "host_fn",
        }
    }
}

/// An emulated event: when its stream reached it.
struct EventState {
    at: Mutex<Option<Instant>>,
    done: Condvar,
    /// Where it was recorded, if in a capture: it then only orders the
    /// capture's streams, and marks no point the host can wait for.
    captured: Option<CapturedAt>,
}

/// An event recorded in capture `generation`, after `position` commands captured from `stream`.
#[derive(Clone, Copy)]
struct CapturedAt {
    generation: u64,
    stream: StreamId,
    position: usize,
}

impl EventState {
    fn new(captured: Option<CapturedAt>) -> Arc<EventState> {
        Arc::new(EventState { at: Mutex::new(None), done: Condvar::new(), captured })
    }

    fn wait(&self) -> Instant {
        let mut at = lock(&self.at);
        loop {
            if let Some(t) = *at {
                return t;
            }
            at = self.done.wait(at).unwrap_or_else(|e| e.into_inner());
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// What the stream threads share.
struct Inner {
    config: EmulatedConfig,
    memory: Memory,
    executor: Mutex<Executor>,
    copy_engine: Mutex<()>,
    failure: Mutex<Option<DeviceError>>,
    bytes_uploaded: AtomicU64,
    copy_busy_ns: AtomicU64,
    compute_busy_ns: AtomicU64,
    per_op: Mutex<Vec<(&'static str, Duration)>>,
}

impl Inner {
    fn fail(&self, e: DeviceError) {
        lock(&self.failure).get_or_insert(e);
    }

    fn failed(&self) -> Result<(), DeviceError> {
        match &*lock(&self.failure) {
            Some(e) => Err(DeviceError::Backend(format!("an earlier operation failed: {e}"))),
            None => Ok(()),
        }
    }

    /// A host→device copy through the copy engine, paced to its bandwidth.
    fn upload(&self, src: &[u8], dst: DevicePtr) {
        let _engine = lock(&self.copy_engine);
        let started = Instant::now();
        if let Err(e) = self.memory.write(dst, src) {
            self.fail(e);
        }
        if let Some(rate) = self.config.h2d_bytes_per_second {
            let due = Duration::from_secs_f64(src.len() as f64 / rate);
            if let Some(rest) = due.checked_sub(started.elapsed()) {
                std::thread::sleep(rest);
            }
        }
        self.bytes_uploaded.fetch_add(src.len() as u64, Ordering::Relaxed);
        self.copy_busy_ns.fetch_add(started.elapsed().as_nanos() as u64, Ordering::Relaxed);
    }

    fn execute(&self, command: Command) {
        match command {
            Command::Upload { src, dst } => self.upload(src.as_slice(), dst),
            Command::UploadFrom { src, offset, dst } => {
                let bytes = src.lock();
                self.upload(&bytes[offset..offset + dst.bytes], dst);
            }
            Command::Download { src, reply } => {
                let result = self.failed().and_then(|_| self.memory.bytes(src).map(<[u8]>::to_vec));
                let _ = reply.send(result);
            }
            Command::DownloadTo { src, dst, offset } => {
                // After a failure the bytes would be garbage: leave them, the error is sticky.
                if self.failed().is_ok() {
                    match self.memory.bytes(src) {
                        Ok(bytes) => dst.lock()[offset..offset + src.bytes].copy_from_slice(bytes),
                        Err(e) => self.fail(e),
                    }
                }
            }
            Command::Launch(op) => {
                if self.failed().is_err() {
                    return;
                }
                let mut executor = lock(&self.executor);
                let started = Instant::now();
                if let Err(e) = executor.run(&self.memory, &op) {
                    self.fail(e);
                }
                let took = started.elapsed();
                self.compute_busy_ns.fetch_add(took.as_nanos() as u64, Ordering::Relaxed);
                let mut per_op = lock(&self.per_op);
                match per_op.iter_mut().find(|(name, _)| *name == op.name()) {
                    Some((_, t)) => *t += took,
                    None => per_op.push((op.name(), took)),
                }
            }
            Command::Record(event) => {
                *lock(&event.at) = Some(Instant::now());
                event.done.notify_all();
            }
            Command::Wait(event) => {
                event.wait();
            }
            Command::HostFn(f) => f(),
        }
    }
}

struct Stream {
    queue: Sender<Command>,
    thread: Option<JoinHandle<()>>,
}

/// A capture in progress (one at a time on this device).
struct Capture {
    generation: u64,
    /// The stream it began on, then the streams that joined it.
    members: Vec<StreamId>,
    /// Every captured command with its stream, in the order they came.
    nodes: Vec<(StreamId, Command)>,
    /// Commands captured from each member so far.
    counts: HashMap<StreamId, usize>,
    /// Joined streams with captured work the origin has not waited for.
    unjoined: HashSet<StreamId>,
    /// Why the capture failed, if it did: it is discarded at its end.
    failure: Option<DeviceError>,
}

impl Capture {
    fn origin(&self) -> StreamId {
        self.members[0]
    }

    fn push(&mut self, stream: StreamId, command: Command) {
        if stream != self.origin() {
            self.unjoined.insert(stream);
        }
        self.nodes.push((stream, command));
        *self.counts.entry(stream).or_default() += 1;
    }

    /// Fail the capture (as CUDA invalidates one) and say why.
    fn fail(&mut self, why: String) -> DeviceError {
        let e = DeviceError::Invalid(why);
        self.failure.get_or_insert(e.clone());
        e
    }
}

/// A captured graph: its commands with their streams, in capture order.
struct EmulatedGraph {
    nodes: Vec<(StreamId, Command)>,
}

/// An executable graph: the shape it was made for.
struct EmulatedExec {
    shape: Vec<(StreamId, &'static str)>,
}

pub struct EmulatedDevice {
    inner: Arc<Inner>,
    arena: Mutex<Arena>,
    streams: Mutex<Vec<Stream>>,
    capture: Mutex<Option<Capture>>,
    captures: AtomicU64,
}

impl EmulatedDevice {
    pub fn new(config: EmulatedConfig) -> Result<Arc<Self>, DeviceError> {
        if config.h2d_bytes_per_second.is_some_and(|r| !(r.is_finite() && r > 0.0)) {
            return Err(DeviceError::Invalid(format!("the copy bandwidth must be positive, got {:?}", config.h2d_bytes_per_second)));
        }
        let pool = PoolConfig::split(config.compute_threads, 1).map_err(DeviceError::Invalid)?;
        let executor = Executor::new(ThreadPool::new(&pool), crate::cpu::isa::detect());
        let inner = Inner {
            memory: Memory::new(config.memory_bytes),
            executor: Mutex::new(executor),
            copy_engine: Mutex::new(()),
            failure: Mutex::new(None),
            bytes_uploaded: AtomicU64::new(0),
            copy_busy_ns: AtomicU64::new(0),
            compute_busy_ns: AtomicU64::new(0),
            per_op: Mutex::default(),
            config,
        };
        let arena = Mutex::new(Arena::new(inner.config.memory_bytes));
        Ok(Arc::new(EmulatedDevice { inner: Arc::new(inner), arena, streams: Mutex::new(vec![]), capture: Mutex::new(None), captures: AtomicU64::new(0) }))
    }

    pub fn stats(&self) -> EmulatedStats {
        let i = &self.inner;
        EmulatedStats {
            bytes_uploaded: i.bytes_uploaded.load(Ordering::Relaxed),
            copy_busy: Duration::from_nanos(i.copy_busy_ns.load(Ordering::Relaxed)),
            compute_busy: Duration::from_nanos(i.compute_busy_ns.load(Ordering::Relaxed)),
            per_op: lock(&i.per_op).clone(),
        }
    }

    /// Give `command` to `stream`, or to the capture it is part of.
    fn send(&self, stream: StreamId, command: Command) -> Result<(), DeviceError> {
        self.inner.failed()?;
        if let Some(c) = lock(&self.capture).as_mut().filter(|c| c.members.contains(&stream)) {
            c.push(stream, command);
            return Ok(());
        }
        self.send_now(stream, command)
    }

    /// Refuse what a capturing stream may not do, failing its capture.
    fn refuse_in_capture(&self, stream: StreamId, what: &str) -> Result<(), DeviceError> {
        match lock(&self.capture).as_mut().filter(|c| c.members.contains(&stream)) {
            Some(c) => Err(c.fail(format!("{what} on stream {} while it is captured into a graph", stream.0))),
            None => Ok(()),
        }
    }

    /// Refuse host waits on an event recorded in a capture.
    fn host_waitable(state: &EventState) -> Result<(), DeviceError> {
        match state.captured {
            Some(_) => Err(DeviceError::Invalid("the host cannot wait for an event recorded in a graph capture: it marks no point of any stream's run".into())),
            None => Ok(()),
        }
    }

    fn send_now(&self, stream: StreamId, command: Command) -> Result<(), DeviceError> {
        let streams = lock(&self.streams);
        let s = streams.get(stream.0).ok_or_else(|| DeviceError::Invalid(format!("no stream {}", stream.0)))?;
        s.queue.send(command).map_err(|_| DeviceError::Backend(format!("stream {} has stopped", stream.0)))
    }

    fn event(event: &Event) -> Result<Arc<EventState>, DeviceError> {
        event.0.clone().downcast::<EventState>().map_err(|_| DeviceError::Invalid("an event of another device".into()))
    }
}

impl Drop for EmulatedDevice {
    fn drop(&mut self) {
        let streams: Vec<Stream> = lock(&self.streams).drain(..).collect();
        for mut s in streams {
            drop(s.queue);
            if let Some(t) = s.thread.take() {
                let _ = t.join();
            }
        }
    }
}

impl Device for EmulatedDevice {
    fn describe(&self) -> String {
        let c = &self.inner.config;
        let rate = c.h2d_bytes_per_second.map_or("unlimited".to_string(), |r| format!("{:.1} GB/s", r / 1e9));
        format!("emulated accelerator ({} MiB, host→device {rate})", c.memory_bytes >> 20)
    }

    fn capacity(&self) -> usize {
        lock(&self.arena).capacity()
    }

    fn free_bytes(&self) -> usize {
        lock(&self.arena).free_bytes()
    }

    fn alloc(&self, bytes: usize) -> Result<DevicePtr, DeviceError> {
        let offset = lock(&self.arena).alloc(bytes)?;
        Ok(DevicePtr { addr: offset as u64, bytes })
    }

    fn free(&self, ptr: DevicePtr) -> Result<(), DeviceError> {
        lock(&self.arena).free(ptr.addr as usize)
    }

    fn create_stream(&self, _kind: StreamKind) -> Result<StreamId, DeviceError> {
        let mut streams = lock(&self.streams);
        let id = streams.len();
        let (queue, commands) = channel::<Command>();
        let inner = self.inner.clone();
        let jitter = inner.config.jitter;
        let thread = std::thread::Builder::new()
            .name(format!("emulated-stream-{id}"))
            .spawn(move || {
                // xorshift64*: reproducible delays without a dependency.
                let mut state = jitter.map_or(1, |j| j.seed.wrapping_mul(0x9E37_79B9_7F4A_7C15).wrapping_add(id as u64 + 1)) | 1;
                for command in commands {
                    if let Some(j) = jitter {
                        state ^= state >> 12;
                        state ^= state << 25;
                        state ^= state >> 27;
                        let unit = (state.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 11) as f64 / (1u64 << 53) as f64;
                        std::thread::sleep(j.max.mul_f64(unit));
                    }
                    inner.execute(command);
                }
            })
            .map_err(|e| DeviceError::Backend(format!("cannot start a stream thread: {e}")))?;
        streams.push(Stream { queue, thread: Some(thread) });
        Ok(StreamId(id))
    }

    fn upload(&self, stream: StreamId, src: &HostBytes, dst: DevicePtr) -> Result<(), DeviceError> {
        if src.len() != dst.bytes {
            return Err(DeviceError::Invalid(format!("upload of {} bytes into a {}-byte range", src.len(), dst.bytes)));
        }
        self.inner.memory.bytes(dst)?; // bounds, checked now rather than on the stream
        self.refuse_in_capture(stream, "an upload from host memory a graph would not keep (copy from staging)")?;
        self.send(stream, Command::Upload { src: src.clone(), dst })
    }

    fn download(&self, stream: StreamId, src: DevicePtr) -> Result<Vec<u8>, DeviceError> {
        self.inner.memory.bytes(src)?;
        self.refuse_in_capture(stream, "a download the host waits for")?;
        let (reply, result) = channel();
        self.send(stream, Command::Download { src, reply })?;
        result.recv().map_err(|_| DeviceError::Backend(format!("stream {} stopped before the download", stream.0)))?
    }

    fn download_to(&self, stream: StreamId, src: DevicePtr, dst: &Arc<Staging>, offset: usize) -> Result<(), DeviceError> {
        self.inner.memory.bytes(src)?;
        dst.check(offset, src.bytes)?;
        self.send(stream, Command::DownloadTo { src, dst: dst.clone(), offset })
    }

    fn upload_from(&self, stream: StreamId, src: &Arc<Staging>, offset: usize, dst: DevicePtr) -> Result<(), DeviceError> {
        self.inner.memory.bytes(dst)?;
        src.check(offset, dst.bytes)?;
        self.send(stream, Command::UploadFrom { src: src.clone(), offset, dst })
    }

    fn launch(&self, stream: StreamId, op: &Op) -> Result<(), DeviceError> {
        op.validate()?;
        self.send(stream, Command::Launch(Box::new(op.clone())))
    }

    fn record(&self, stream: StreamId) -> Result<Event, DeviceError> {
        self.inner.failed()?;
        if let Some(c) = lock(&self.capture).as_mut().filter(|c| c.members.contains(&stream)) {
            let at = CapturedAt { generation: c.generation, stream, position: c.counts.get(&stream).copied().unwrap_or(0) + 1 };
            let state = EventState::new(Some(at));
            c.push(stream, Command::Record(state.clone()));
            return Ok(Event(state));
        }
        let state = EventState::new(None);
        self.send_now(stream, Command::Record(state.clone()))?;
        Ok(Event(state))
    }

    /// In a capture, CUDA's rules: waiting on one of its events joins a
    /// stream to it (or, on the origin, joins that event's stream back);
    /// a captured stream may not wait on an event from outside.
    fn wait_event(&self, stream: StreamId, event: &Event) -> Result<(), DeviceError> {
        let state = Self::event(event)?;
        self.inner.failed()?;
        let mut capture = lock(&self.capture);
        let current = capture.as_ref().map(|c| c.generation);
        match (capture.as_mut(), state.captured) {
            (Some(c), Some(at)) if at.generation == c.generation => {
                if !c.members.contains(&stream) {
                    c.members.push(stream);
                } else if stream == c.origin() && at.stream != stream && c.counts.get(&at.stream) == Some(&at.position) {
                    c.unjoined.remove(&at.stream);
                }
                c.push(stream, Command::Wait(state));
                Ok(())
            }
            (Some(c), None) if c.members.contains(&stream) => Err(c.fail(format!("stream {} is captured into a graph and may not wait on an event recorded outside the capture", stream.0))),
            (_, Some(at)) if Some(at.generation) != current => Err(DeviceError::Invalid("an event recorded in a graph capture orders only that capture's streams, and it has ended".into())),
            _ => {
                drop(capture);
                self.send_now(stream, Command::Wait(state))
            }
        }
    }

    fn query(&self, event: &Event) -> Result<bool, DeviceError> {
        let state = Self::event(event)?;
        Self::host_waitable(&state)?;
        let done = lock(&state.at).is_some();
        self.inner.failed().map(|_| done)
    }

    fn synchronize(&self, event: &Event) -> Result<(), DeviceError> {
        let state = Self::event(event)?;
        Self::host_waitable(&state)?;
        state.wait();
        self.inner.failed()
    }

    fn elapsed(&self, from: &Event, to: &Event) -> Result<Duration, DeviceError> {
        let (a, b) = (Self::event(from)?, Self::event(to)?);
        Self::host_waitable(&a)?;
        Self::host_waitable(&b)?;
        let (a, b) = (*lock(&a.at), *lock(&b.at));
        match (a, b) {
            (Some(a), Some(b)) => Ok(b.saturating_duration_since(a)),
            _ => Err(DeviceError::Invalid("elapsed time of an event that has not completed".into())),
        }
    }

    fn host_fn(&self, stream: StreamId, f: Box<dyn FnOnce() + Send>) -> Result<(), DeviceError> {
        self.send(stream, Command::HostFn(f))
    }

    fn register_host(&self, _src: &HostBytes) -> Result<(), DeviceError> {
        Ok(()) // host memory is the device's memory's neighbour: nothing to pin
    }

    fn begin_capture(&self, stream: StreamId) -> Result<(), DeviceError> {
        self.inner.failed()?;
        if stream.0 >= lock(&self.streams).len() {
            return Err(DeviceError::Invalid(format!("no stream {}", stream.0)));
        }
        let mut capture = lock(&self.capture);
        if let Some(c) = capture.as_ref() {
            return Err(DeviceError::Invalid(match c.members.contains(&stream) {
                true => format!("stream {} is already being captured", stream.0),
                false => format!("stream {} is being captured: the emulated device captures one graph at a time", c.origin().0),
            }));
        }
        let generation = self.captures.fetch_add(1, Ordering::Relaxed);
        *capture = Some(Capture { generation, members: vec![stream], nodes: vec![], counts: HashMap::new(), unjoined: HashSet::new(), failure: None });
        Ok(())
    }

    fn end_capture(&self, stream: StreamId) -> Result<Graph, DeviceError> {
        let mut capture = lock(&self.capture);
        let c = match capture.take() {
            Some(c) if c.origin() == stream => c,
            other => {
                let why = match &other {
                    Some(c) => format!("the capture began on stream {}, not {}", c.origin().0, stream.0),
                    None => format!("stream {} is not being captured", stream.0),
                };
                *capture = other;
                return Err(DeviceError::Invalid(why));
            }
        };
        if let Some(e) = c.failure {
            return Err(e);
        }
        if !c.unjoined.is_empty() {
            let mut streams: Vec<usize> = c.unjoined.iter().map(|s| s.0).collect();
            streams.sort();
            return Err(DeviceError::Invalid(format!("streams {streams:?} were not joined back into stream {} before the capture ended", stream.0)));
        }
        Ok(Graph(Box::new(EmulatedGraph { nodes: c.nodes })))
    }

    fn launch_graph(&self, stream: StreamId, graph: Graph, exec: &mut Option<GraphExec>) -> Result<GraphLaunch, DeviceError> {
        self.inner.failed()?;
        let graph = graph.0.downcast::<EmulatedGraph>().map_err(|_| DeviceError::Invalid("a graph of another device".into()))?;
        let mut others: Vec<StreamId> = vec![];
        for &(s, _) in &graph.nodes {
            if s != stream && !others.contains(&s) {
                others.push(s);
            }
        }
        if let Some(c) = lock(&self.capture).as_ref() {
            if let Some(s) = others.iter().chain([&stream]).find(|s| c.members.contains(s)) {
                return Err(DeviceError::Invalid(format!("stream {} is being captured: a graph cannot run on it", s.0)));
            }
        }
        let shape: Vec<(StreamId, &'static str)> = graph.nodes.iter().map(|(s, c)| (*s, c.kind())).collect();
        let kept = exec.as_ref().and_then(|e| e.0.downcast_ref::<EmulatedExec>());
        let launch = match kept {
            Some(e) if e.shape == shape => GraphLaunch::Updated,
            _ => {
                *exec = Some(GraphExec(Box::new(EmulatedExec { shape })));
                GraphLaunch::Instantiated
            }
        };
        // The other streams start when `stream` gets here, and `stream`
        // goes on when they have all finished their part.
        let start = EventState::new(None);
        self.send_now(stream, Command::Record(start.clone()))?;
        for &s in &others {
            self.send_now(s, Command::Wait(start.clone()))?;
        }
        for (s, command) in graph.nodes {
            self.send_now(s, command)?;
        }
        for &s in &others {
            let end = EventState::new(None);
            self.send_now(s, Command::Record(end.clone()))?;
            self.send_now(stream, Command::Wait(end))?;
        }
        Ok(launch)
    }

    fn compute_busy(&self) -> Option<Duration> {
        Some(self.stats().compute_busy)
    }
}
