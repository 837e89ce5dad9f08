//! A simulated accelerator: the [`Device`] interface on a virtual clock.
//!
//! Ops do not compute; each takes the time a [`CostModel`] gives it. The
//! semantics are the real ones, so the engines' scheduling runs unchanged:
//! - each stream is a thread that takes its commands in order and keeps the
//!   virtual time it has reached; a command starts no earlier than the
//!   stream got there, than the enqueuing thread's own virtual time
//!   ([`duplex_kernels::clock`]), and than the events it waits for;
//! - kernels share the device's compute, uploads its host→device link,
//!   downloads its device→host link: each is a timeline of busy intervals,
//!   and a command takes the first gap long enough from when it is ready (so
//!   one stream's kernel can run while another stream still waits). With
//!   two copy engines ([`CostModel::copy_engines`]), copies that compute
//!   streams make (token ids, row lists, a layer's routes and KV entries)
//!   go on a lane of their own rather than queueing behind the weights copy
//!   streams stream in; with one (the emulated device) every copy waits its turn;
//! - events complete at the virtual time their stream reached them; a host
//!   thread that waits for one (`synchronize`, a download) advances its own
//!   virtual time to it; a host function runs with its thread's virtual
//!   time set to the stream's, and the stream goes on from wherever the
//!   function left that time.
//!
//! Memory is an arena with the real capacity (running out fails as a GPU's
//! does), backed only where small data is written: token ids, block tables,
//! the routes a [`Op::Route`] writes. Weight uploads are timed, not copied
//! (a hollow checkpoint has no bytes to copy), and so the values ops read
//! are zeros. The one result the scheduling depends on is routing, so a
//! simulated router chooses `top_k` distinct experts per token uniformly at
//! random (seeded; routing's real skew is not modelled) with weights 1/k.
//!
//! In its *functional* mode ([`SimConfig::functional`]) the device also
//! computes, with the emulated device's kernels over real memory: then its
//! results, routing included, are the real ones, and a run takes the same
//! data-dependent decisions as on the emulated device, which is how tests
//! show that the two run the same schedule. Time stays virtual either way.

use duplex_kernels::clock;
use duplex_kernels::device::arena::Arena;
use duplex_kernels::device::host_ops::{Executor, Memory};
use duplex_kernels::pool::{PoolConfig, ThreadPool};
use duplex_kernels::device::{Device, DeviceError, DevicePtr, Event, HostBytes, Op, Staging, StreamId, StreamKind};
use std::collections::{HashMap, VecDeque};
use std::sync::mpsc::{channel, Sender};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Duration;

/// How long device work takes.
pub trait CostModel: Send + Sync {
    fn op(&self, op: &Op) -> Duration;
    fn h2d(&self, bytes: usize) -> Duration;
    fn d2h(&self, bytes: usize) -> Duration;
    /// Copy engines: 2 gives compute streams' copies a lane of their own.
    fn copy_engines(&self) -> usize {
        2
    }
}

/// Writes at most this long are kept (activations, ids, tables); longer ones
/// are weights, timed only.
const KEPT_WRITE_BYTES: usize = 1 << 20;
const PAGE: u64 = 4096;
/// Busy intervals each timeline remembers; a command ready before the
/// oldest of them can no longer fill a gap there and goes after it.
const REMEMBERED_INTERVALS: usize = 512;

pub struct SimConfig {
    pub name: String,
    pub memory_bytes: usize,
    pub cost: Arc<dyn CostModel>,
    /// Seed of the simulated router's choices.
    pub seed: u64,
    /// Compute as well (memory of `memory_bytes` backs the device).
    pub functional: bool,
}

/// Where a simulated device's time went.
#[derive(Clone, Debug, Default)]
pub struct SimStats {
    pub compute_busy: Duration,
    pub h2d_busy: Duration,
    pub d2h_busy: Duration,
    /// Copies on compute streams.
    pub inline_copies_busy: Duration,
    pub bytes_uploaded: u64,
    pub bytes_downloaded: u64,
    /// Kernel time per op kind.
    pub per_op: Vec<(&'static str, Duration)>,
}

/// A resource's busy intervals, sorted, disjoint.
#[derive(Default)]
pub(crate) struct Timeline {
    busy: VecDeque<(Duration, Duration)>,
    pub(crate) total: Duration,
}

impl Timeline {
    /// Book `len` at the first gap from `ready` on; returns when it ends.
    pub(crate) fn book(&mut self, ready: Duration, len: Duration) -> Duration {
        self.total += len;
        let mut start = ready;
        let mut at = self.busy.len();
        // The first interval ending after `ready`; every gap before it is too early.
        for (i, &(_, end)) in self.busy.iter().enumerate() {
            if end > ready {
                at = i;
                break;
            }
        }
        while at < self.busy.len() {
            let (b_start, b_end) = self.busy[at];
            if start + len <= b_start {
                break;
            }
            start = start.max(b_end);
            at += 1;
        }
        if !len.is_zero() {
            self.busy.insert(at, (start, start + len));
            if self.busy.len() > REMEMBERED_INTERVALS {
                // Forget the oldest gap: merge the first two intervals.
                let (s, _) = self.busy.pop_front().unwrap();
                self.busy[0].0 = s;
            }
        }
        start + len
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// An event: the virtual time its stream reached it, once it has.
struct EventState {
    at: Mutex<Option<Duration>>,
    done: Condvar,
}

impl EventState {
    fn wait(&self) -> Duration {
        let mut at = lock(&self.at);
        loop {
            if let Some(t) = *at {
                return t;
            }
            at = self.done.wait(at).unwrap_or_else(|e| e.into_inner());
        }
    }
}

enum Work {
    Upload { src: HostBytes, dst: DevicePtr },
    Download { src: DevicePtr, reply: Sender<(Vec<u8>, Duration)> },
    DownloadTo { src: DevicePtr, dst: Arc<Staging>, offset: usize },
    UploadFrom { src: Arc<Staging>, offset: usize, dst: DevicePtr },
    Launch(Box<Op>),
    Record(Arc<EventState>),
    Wait(Arc<EventState>),
    HostFn(Box<dyn FnOnce() + Send>),
}

/// A command and the virtual time its thread enqueued it at.
struct Command {
    work: Work,
    enqueued: Duration,
}

/// What the stream threads share.
struct Inner {
    config: SimConfig,
    /// The functional mode's memory and kernels.
    computed: Option<(Memory, Mutex<Executor>)>,
    /// A fault of the functional mode's kernels, sticky as a GPU's is.
    failure: Mutex<Option<DeviceError>>,
    /// Small data written, by page.
    pages: Mutex<HashMap<u64, Box<[u8]>>>,
    compute: Mutex<Timeline>,
    h2d: Mutex<Timeline>,
    d2h: Mutex<Timeline>,
    inline_copies: Mutex<Timeline>,
    stats: Mutex<SimStats>,
    /// Routes chosen so far (the router's counter-based random stream).
    routed: Mutex<u64>,
}

impl Inner {
    fn write(&self, dst: DevicePtr, bytes: &[u8]) {
        if let Some((memory, _)) = &self.computed {
            // Bounds were checked when the command was enqueued.
            memory.write(dst, bytes).expect("a checked range");
            return;
        }
        let mut pages = lock(&self.pages);
        let mut done = 0;
        while done < bytes.len() {
            let addr = dst.addr + done as u64;
            let (page, within) = (addr / PAGE, (addr % PAGE) as usize);
            let n = (PAGE as usize - within).min(bytes.len() - done);
            let p = pages.entry(page).or_insert_with(|| vec![0; PAGE as usize].into_boxed_slice());
            p[within..within + n].copy_from_slice(&bytes[done..done + n]);
            done += n;
        }
    }

    fn read(&self, src: DevicePtr) -> Vec<u8> {
        if let Some((memory, _)) = &self.computed {
            return memory.bytes(src).expect("a checked range").to_vec();
        }
        let pages = lock(&self.pages);
        let mut out = vec![0; src.bytes];
        let mut done = 0;
        while done < src.bytes {
            let addr = src.addr + done as u64;
            let (page, within) = (addr / PAGE, (addr % PAGE) as usize);
            let n = (PAGE as usize - within).min(src.bytes - done);
            if let Some(p) = pages.get(&page) {
                out[done..done + n].copy_from_slice(&p[within..within + n]);
            }
            done += n;
        }
        out
    }

    /// The simulated router: `top_k` distinct experts per row, uniformly.
    fn route(&self, op: &Op) {
        let Op::Route { logits, params, ids, weights, .. } = op else { return };
        let (n, k, experts) = (logits.rows, params.top_k, params.n_experts.max(1));
        let mut counter = lock(&self.routed);
        let mut chosen = Vec::with_capacity(n * k * 4);
        for _ in 0..n {
            let mut row: Vec<u32> = Vec::with_capacity(k);
            let mut draw = 0u64;
            while row.len() < k.min(experts) {
                let e = (splitmix(self.config.seed ^ (*counter << 20) ^ draw) % experts as u64) as u32;
                draw += 1;
                if !row.contains(&e) {
                    row.push(e);
                }
            }
            *counter += 1;
            chosen.extend(row.iter().flat_map(|e| e.to_le_bytes()));
        }
        drop(counter);
        self.write(ids.slice(0, chosen.len()).unwrap_or(*ids), &chosen);
        let w = 1.0f32 / k.max(1) as f32;
        for r in 0..weights.rows {
            let row: Vec<u8> = (0..weights.cols).flat_map(|_| w.to_le_bytes()).collect();
            if let Ok(dst) = weights.buf.slice((weights.offset + r * weights.stride) * 4, weights.cols * 4) {
                self.write(dst, &row);
            }
        }
    }

    /// Run one command of a `kind` stream from virtual time `at` (when the
    /// stream got there); returns when the stream is done with it.
    fn run(&self, kind: StreamKind, command: Command, at: Duration) -> Duration {
        let ready = at.max(command.enqueued);
        let cost = &self.config.cost;
        match command.work {
            Work::Upload { src, dst } => {
                if dst.bytes <= KEPT_WRITE_BYTES || self.computed.is_some() {
                    self.write(dst, src.as_slice());
                }
                self.upload(kind, ready, dst.bytes)
            }
            Work::UploadFrom { src, offset, dst } => {
                if dst.bytes <= KEPT_WRITE_BYTES || self.computed.is_some() {
                    self.write(dst, &src.lock()[offset..offset + dst.bytes]);
                }
                self.upload(kind, ready, dst.bytes)
            }
            Work::Download { src, reply } => {
                let end = self.download(kind, ready, src);
                let _ = reply.send((self.read(src), end));
                end
            }
            Work::DownloadTo { src, dst, offset } => {
                let end = self.download(kind, ready, src);
                dst.lock()[offset..offset + src.bytes].copy_from_slice(&self.read(src));
                end
            }
            Work::Launch(op) => {
                match &self.computed {
                    Some((memory, executor)) => {
                        if lock(&self.failure).is_none() {
                            if let Err(e) = lock(executor).run(memory, &op) {
                                lock(&self.failure).get_or_insert(e);
                            }
                        }
                    }
                    None => self.route(&op),
                }
                let len = cost.op(&op);
                let mut stats = lock(&self.stats);
                match stats.per_op.iter_mut().find(|(name, _)| *name == op.name()) {
                    Some((_, t)) => *t += len,
                    None => stats.per_op.push((op.name(), len)),
                }
                drop(stats);
                lock(&self.compute).book(ready, len)
            }
            Work::Record(event) => {
                *lock(&event.at) = Some(ready);
                event.done.notify_all();
                ready
            }
            Work::Wait(event) => ready.max(event.wait()),
            Work::HostFn(f) => {
                clock::set(Some(ready));
                f();
                let end = clock::now().unwrap_or(ready);
                clock::set(None);
                end
            }
        }
    }

    fn upload(&self, kind: StreamKind, ready: Duration, bytes: usize) -> Duration {
        lock(&self.stats).bytes_uploaded += bytes as u64;
        lock(self.lane(kind, &self.h2d)).book(ready, self.config.cost.h2d(bytes))
    }

    fn download(&self, kind: StreamKind, ready: Duration, src: DevicePtr) -> Duration {
        lock(&self.stats).bytes_downloaded += src.bytes as u64;
        lock(self.lane(kind, &self.d2h)).book(ready, self.config.cost.d2h(src.bytes))
    }

    /// Where a `kind` stream's copy in the direction of `bulk` goes.
    fn lane<'a>(&'a self, kind: StreamKind, bulk: &'a Mutex<Timeline>) -> &'a Mutex<Timeline> {
        if kind == StreamKind::Copy || self.config.cost.copy_engines() < 2 {
            bulk
        } else {
            &self.inline_copies
        }
    }
}

pub(crate) fn splitmix(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

struct Stream {
    queue: Sender<Command>,
    thread: Option<JoinHandle<()>>,
}

pub struct SimDevice {
    inner: Arc<Inner>,
    arena: Mutex<Arena>,
    streams: Mutex<Vec<Stream>>,
}

impl SimDevice {
    pub fn new(config: SimConfig) -> Arc<SimDevice> {
        let arena = Mutex::new(Arena::new(config.memory_bytes));
        let computed = config.functional.then(|| {
            let pool = ThreadPool::new(&PoolConfig::split(1, 1).expect("one thread"));
            (Memory::new(config.memory_bytes), Mutex::new(Executor::new(pool, duplex_kernels::cpu::isa::detect())))
        });
        let inner = Inner {
            computed,
            failure: Mutex::new(None),
            config,
            pages: Mutex::default(),
            compute: Mutex::default(),
            h2d: Mutex::default(),
            d2h: Mutex::default(),
            inline_copies: Mutex::default(),
            stats: Mutex::default(),
            routed: Mutex::new(0),
        };
        Arc::new(SimDevice { inner: Arc::new(inner), arena, streams: Mutex::new(vec![]) })
    }

    pub fn stats(&self) -> SimStats {
        let mut stats = lock(&self.inner.stats).clone();
        stats.compute_busy = lock(&self.inner.compute).total;
        stats.h2d_busy = lock(&self.inner.h2d).total;
        stats.d2h_busy = lock(&self.inner.d2h).total;
        stats.inline_copies_busy = lock(&self.inner.inline_copies).total;
        stats
    }

    /// An earlier fault, as every later call reports it.
    fn failed(&self) -> Result<(), DeviceError> {
        match &*lock(&self.inner.failure) {
            Some(e) => Err(DeviceError::Backend(format!("an earlier operation failed: {e}"))),
            None => Ok(()),
        }
    }

    fn send(&self, stream: StreamId, work: Work) -> Result<(), DeviceError> {
        self.failed()?;
        let streams = lock(&self.streams);
        let s = streams.get(stream.0).ok_or_else(|| DeviceError::Invalid(format!("no stream {}", stream.0)))?;
        let enqueued = clock::now().unwrap_or_default();
        s.queue.send(Command { work, enqueued }).map_err(|_| DeviceError::Backend(format!("stream {} has stopped", stream.0)))
    }

    fn event(event: &Event) -> Result<Arc<EventState>, DeviceError> {
        event.downcast::<EventState>().ok_or_else(|| DeviceError::Invalid("an event of another device".into()))
    }

    fn check(&self, p: DevicePtr) -> Result<(), DeviceError> {
        match p.addr.checked_add(p.bytes as u64) {
            Some(end) if end <= self.inner.config.memory_bytes as u64 => Ok(()),
            _ => Err(DeviceError::Invalid(format!("{} bytes at {:#x} lie outside the device's {} bytes", p.bytes, p.addr, self.inner.config.memory_bytes))),
        }
    }
}

impl Drop for SimDevice {
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

impl Device for SimDevice {
    fn describe(&self) -> String {
        format!("simulated {} ({} MiB)", self.inner.config.name, self.inner.config.memory_bytes >> 20)
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

    fn create_stream(&self, kind: StreamKind) -> Result<StreamId, DeviceError> {
        let mut streams = lock(&self.streams);
        let id = streams.len();
        let (queue, commands) = channel::<Command>();
        let inner = self.inner.clone();
        let thread = std::thread::Builder::new()
            .name(format!("sim-stream-{id}"))
            .spawn(move || {
                let mut at = Duration::ZERO;
                for command in commands {
                    at = inner.run(kind, command, at);
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
        self.check(dst)?;
        self.send(stream, Work::Upload { src: src.clone(), dst })
    }

    fn download(&self, stream: StreamId, src: DevicePtr) -> Result<Vec<u8>, DeviceError> {
        self.check(src)?;
        let (reply, result) = channel();
        self.send(stream, Work::Download { src, reply })?;
        let (bytes, at) = result.recv().map_err(|_| DeviceError::Backend(format!("stream {} stopped before the download", stream.0)))?;
        clock::advance_to(at);
        self.failed()?;
        Ok(bytes)
    }

    fn download_to(&self, stream: StreamId, src: DevicePtr, dst: &Arc<Staging>, offset: usize) -> Result<(), DeviceError> {
        self.check(src)?;
        if offset.checked_add(src.bytes).is_none_or(|end| end > dst.len()) {
            return Err(DeviceError::Invalid(format!("bytes {offset}+{} of a {}-byte staging buffer", src.bytes, dst.len())));
        }
        self.send(stream, Work::DownloadTo { src, dst: dst.clone(), offset })
    }

    fn upload_from(&self, stream: StreamId, src: &Arc<Staging>, offset: usize, dst: DevicePtr) -> Result<(), DeviceError> {
        self.check(dst)?;
        if offset.checked_add(dst.bytes).is_none_or(|end| end > src.len()) {
            return Err(DeviceError::Invalid(format!("bytes {offset}+{} of a {}-byte staging buffer", dst.bytes, src.len())));
        }
        self.send(stream, Work::UploadFrom { src: src.clone(), offset, dst })
    }

    fn launch(&self, stream: StreamId, op: &Op) -> Result<(), DeviceError> {
        op.validate()?;
        self.send(stream, Work::Launch(Box::new(op.clone())))
    }

    fn record(&self, stream: StreamId) -> Result<Event, DeviceError> {
        let state = Arc::new(EventState { at: Mutex::new(None), done: Condvar::new() });
        self.send(stream, Work::Record(state.clone()))?;
        Ok(Event::new(state))
    }

    fn wait_event(&self, stream: StreamId, event: &Event) -> Result<(), DeviceError> {
        let state = Self::event(event)?;
        self.send(stream, Work::Wait(state))
    }

    /// Whether the event has completed by the asking thread's virtual time
    /// (looking takes no time, so it never moves that time on).
    fn query(&self, event: &Event) -> Result<bool, DeviceError> {
        let at = *lock(&Self::event(event)?.at);
        self.failed()?;
        Ok(match (at, clock::now()) {
            (Some(t), Some(now)) => t <= now,
            (at, _) => at.is_some(),
        })
    }

    fn synchronize(&self, event: &Event) -> Result<(), DeviceError> {
        clock::advance_to(Self::event(event)?.wait());
        self.failed()
    }

    fn elapsed(&self, from: &Event, to: &Event) -> Result<Duration, DeviceError> {
        let (a, b) = (*lock(&Self::event(from)?.at), *lock(&Self::event(to)?.at));
        match (a, b) {
            (Some(a), Some(b)) => Ok(b.saturating_sub(a)),
            _ => Err(DeviceError::Invalid("elapsed time of an event that has not completed".into())),
        }
    }

    fn host_fn(&self, stream: StreamId, f: Box<dyn FnOnce() + Send>) -> Result<(), DeviceError> {
        self.send(stream, Work::HostFn(f))
    }

    fn register_host(&self, _src: &HostBytes) -> Result<(), DeviceError> {
        Ok(())
    }

    fn compute_busy(&self) -> Option<Duration> {
        Some(lock(&self.inner.compute).total)
    }
}

impl CostModel for crate::hardware::DeviceSpec {
    fn op(&self, op: &Op) -> Duration {
        self.op_time(op)
    }

    fn h2d(&self, bytes: usize) -> Duration {
        self.h2d_time(bytes)
    }

    fn d2h(&self, bytes: usize) -> Duration {
        self.d2h_time(bytes)
    }

    fn copy_engines(&self) -> usize {
        self.copy_engines
    }
}
