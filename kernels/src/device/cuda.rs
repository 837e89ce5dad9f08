//! The CUDA backend of the device layer: cudarc over the driver API, loaded
//! at run time (no CUDA toolkit is needed to build), and the kernels in
//! `kernels/cuda/` compiled by NVRTC when the device opens.
//!
//! - Memory: one `cuMemAlloc` of the whole capacity at open, handed out by an
//!   [`Arena`]; a [`DevicePtr`]'s `addr` is the absolute `CUdeviceptr`.
//! - Streams: non-blocking CUDA streams, indexed by [`StreamId`].
//! - Uploads: `cuMemcpyHtoDAsync`; the source [`HostBytes`] is kept, with an
//!   event recorded after the copy, until that event shows it done.
//! - Staging: host memory page-locked with `cuMemHostRegister`, copied to and
//!   from asynchronously (`cuMemcpy{DtoH,HtoD}Async`), kept alive the same way.
//! - Events: CUDA events with timing, so [`Device::elapsed`] works on any.
//! - Graphs: stream capture (thread-local mode), instantiated once per
//!   shape and then updated in place (`cuGraphExecUpdate`). What a captured
//!   copy or host function needs (its staging, its closure) is kept by the
//!   capture, then by the launch until an event after it completes.
//! - Ops: one NVRTC kernel each, written for clarity first and following the
//!   CPU references operation for operation (see `kernels/cuda/common.cu`).
//!
//! Opening never panics for want of a driver, a GPU or NVRTC: it reports
//! [`DeviceError::Unavailable`], and any other failure [`DeviceError::Backend`].

use super::arena::Arena;
use super::{Device, DeviceError, DevicePtr, DeviceWeight, Event, Graph, GraphExec, GraphLaunch, HostBytes, Matrix, Op, Staging, StreamId, StreamKind};
use std::any::Any;
use crate::router::ScoringFunc;
use crate::{Precision, WeightFormat};
use cudarc::driver::{result as cu, sys, CudaContext, CudaEvent, CudaFunction, CudaStream, DriverError};
use cudarc::nvrtc::{self, Ptx};
use std::collections::{HashMap, VecDeque};
use std::ffi::{c_char, c_void, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

/// The kernel sources, `common.cu` first: one NVRTC program.
const SOURCE: &str = concat!(
    include_str!("../../cuda/common.cu"),
    include_str!("../../cuda/gemm.cu"),
    include_str!("../../cuda/elementwise.cu"),
    include_str!("../../cuda/route.cu"),
    include_str!("../../cuda/mla.cu"),
    include_str!("../../cuda/gqa.cu"),
    include_str!("../../cuda/attention_part.cu"),
    include_str!("../../cuda/kv.cu"),
);

/// Blocks per launch at most; every kernel loops over what is left (grid
/// stride), so this only bounds the grid, never the work.
const MAX_BLOCKS: usize = 65_535;
/// Threads per block of the elementwise and row kernels.
const THREADS: usize = 256;
/// Dynamic shared memory a kernel may use without opting in to more.
const MAX_SHARED_BYTES: usize = 48 * 1024;
/// Rows of `x` one GEMM warp handles (`GEMM_TILE` in gemm.cu).
const GEMM_TILE: usize = 8;
/// The most threads a block may have; the attention kernels need one per
/// output column.
const MAX_BLOCK_THREADS: usize = 1024;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn backend(what: &'static str) -> impl FnOnce(DriverError) -> DeviceError {
    move |e| DeviceError::Backend(format!("{what}: {e}"))
}

/// The compiled kernels, one per op (GEMM one per weight format).
struct Kernels {
    gemm_f32: CudaFunction,
    gemm_bf16: CudaFunction,
    gemm_f16: CudaFunction,
    gemm_fp8: CudaFunction,
    gemm_batched_f32: CudaFunction,
    gemm_batched_bf16: CudaFunction,
    gemm_batched_f16: CudaFunction,
    gemm_batched_fp8: CudaFunction,
    rms_norm: CudaFunction,
    rope: CudaFunction,
    silu_mul: CudaFunction,
    add_rows: CudaFunction,
    round_rows: CudaFunction,
    zero_rows: CudaFunction,
    route: CudaFunction,
    gather_rows: CudaFunction,
    scatter_add_rows: CudaFunction,
    embedding: CudaFunction,
    mla_prefill: CudaFunction,
    mla_decode: CudaFunction,
    gqa_attention: CudaFunction,
    mla_prefill_part: CudaFunction,
    gqa_attention_part: CudaFunction,
    attention_merge: CudaFunction,
    kv_store: CudaFunction,
    kv_gather: CudaFunction,
}

impl Kernels {
    /// Compile [`SOURCE`] for the device and load it.
    fn compile(ctx: &Arc<CudaContext>) -> Result<Self, DeviceError> {
        let (major, minor) = ctx.compute_capability().map_err(backend("reading the compute capability"))?;
        let (image, target) = compile_source(major * 10 + minor)?;
        let module = ctx.load_module(image).map_err(|e| DeviceError::Backend(format!("the driver cannot load the kernels built for {target} (is NVRTC newer than the driver?): {e}")))?;
        let f = |name: &str| module.load_function(name).map_err(|e| DeviceError::Backend(format!("kernel {name} missing from the module: {e}")));
        Ok(Kernels {
            gemm_f32: f("gemm_f32")?,
            gemm_bf16: f("gemm_bf16")?,
            gemm_f16: f("gemm_f16")?,
            gemm_fp8: f("gemm_fp8")?,
            gemm_batched_f32: f("gemm_batched_f32")?,
            gemm_batched_bf16: f("gemm_batched_bf16")?,
            gemm_batched_f16: f("gemm_batched_f16")?,
            gemm_batched_fp8: f("gemm_batched_fp8")?,
            rms_norm: f("rms_norm")?,
            rope: f("rope")?,
            silu_mul: f("silu_mul")?,
            add_rows: f("add_rows")?,
            round_rows: f("round_rows")?,
            zero_rows: f("zero_rows")?,
            route: f("route")?,
            gather_rows: f("gather_rows")?,
            scatter_add_rows: f("scatter_add_rows")?,
            embedding: f("embedding")?,
            mla_prefill: f("mla_prefill")?,
            mla_decode: f("mla_decode")?,
            gqa_attention: f("gqa_attention")?,
            mla_prefill_part: f("mla_prefill_part")?,
            gqa_attention_part: f("gqa_attention_part")?,
            attention_merge: f("attention_merge")?,
            kv_store: f("kv_store")?,
            kv_gather: f("kv_gather")?,
        })
    }
}

/// An NVRTC program, destroyed on drop.
struct Program(nvrtc::sys::nvrtcProgram);

impl Drop for Program {
    fn drop(&mut self) {
        // SAFETY: created by `create_program` and destroyed only here.
        let _ = unsafe { nvrtc::result::destroy_program(self.0) };
    }
}

/// Compile [`SOURCE`] for a device of compute capability `device` (major·10 +
/// minor), returning the image and what it targets. Where this NVRTC knows
/// the device's architecture the result is a CUBIN, which an older driver
/// of the same major version loads as well; otherwise it is PTX for the
/// newest architecture NVRTC knows below the device's, for the driver to
/// finish (PTX for an older architecture runs on newer devices).
fn compile_source(device: i32) -> Result<(Ptx, String), DeviceError> {
    let known = nvrtc_archs();
    let (target, cubin) = if known.is_empty() || known.contains(&device) {
        (format!("sm_{device}"), true)
    } else {
        (format!("compute_{}", known.iter().copied().filter(|&a| a <= device).max().unwrap_or(device)), false)
    };
    let source = CString::new(SOURCE).map_err(|_| DeviceError::Backend("the kernel source contains a NUL byte".into()))?;
    let program = Program(nvrtc::result::create_program(&source, Some(c"duplex_kernels.cu")).map_err(|e| DeviceError::Backend(format!("NVRTC cannot create a program: {e}")))?);
    let options = [
        // Separate roundings for products and sums, as the CPU references
        // have them (see common.cu), and IEEE division and square root.
        "--fmad=false".to_string(),
        "--ftz=false".into(),
        "--prec-div=true".into(),
        "--prec-sqrt=true".into(),
        format!("--gpu-architecture={target}"),
    ];
    // SAFETY: `program` is a live program.
    if let Err(e) = unsafe { nvrtc::result::compile_program(program.0, &options) } {
        // SAFETY: as above.
        let log = unsafe { nvrtc::result::get_program_log(program.0) }.map(|log| c_chars_to_string(&log)).unwrap_or_default();
        return Err(DeviceError::Backend(format!("NVRTC cannot compile the kernels for {target} ({e}):\n{log}")));
    }
    let image = if cubin {
        let mut size = 0usize;
        // SAFETY: `program` is compiled; NVRTC writes one size.
        let sized = unsafe { nvrtc::sys::nvrtcGetCUBINSize(program.0, &mut size) }.result();
        let mut bytes = vec![0u8; size];
        // SAFETY: `bytes` has the room NVRTC asked for.
        let got = sized.and_then(|_| unsafe { nvrtc::sys::nvrtcGetCUBIN(program.0, bytes.as_mut_ptr() as *mut c_char) }.result());
        got.map_err(|e| DeviceError::Backend(format!("NVRTC gives no CUBIN for {target}: {e}")))?;
        Ptx::from_binary(bytes)
    } else {
        // SAFETY: `program` is compiled.
        let ptx = unsafe { nvrtc::result::get_ptx(program.0) }.map_err(|e| DeviceError::Backend(format!("NVRTC gives no PTX for {target}: {e}")))?;
        Ptx::from_src(c_chars_to_string(&ptx))
    };
    Ok((image, target))
}

/// Compile every kernel for `sm_{arch}` (e.g. 90) with this machine's NVRTC,
/// no GPU needed, as [`CudaDevice::open`] would for such a device; returns
/// what it targeted (`sm_90`, or `compute_…` PTX where this NVRTC does not
/// know the architecture). So a kernel that does not compile is caught on
/// machines without a GPU too (tests/cuda.rs, run by .ci/run).
pub fn compile_kernels(arch: i32) -> Result<String, DeviceError> {
    unwind_to_error(|| {
        nvrtc_present()?;
        Ok(compile_source(arch)?.1)
    })
}

/// The real architectures this machine's NVRTC compiles for (e.g. 90 for
/// sm_90; empty if it cannot say).
pub fn nvrtc_architectures() -> Result<Vec<i32>, DeviceError> {
    unwind_to_error(|| {
        nvrtc_present()?;
        Ok(nvrtc_archs())
    })
}

/// Whether NVRTC can be loaded at all.
fn nvrtc_present() -> Result<(), DeviceError> {
    // SAFETY: only tries to load the library (dlopen), calling nothing in it.
    if !unsafe { nvrtc::sys::is_culib_present() } {
        return Err(DeviceError::Unavailable("no NVRTC (libnvrtc not found); the CUDA backend compiles its kernels with it at start-up".into()));
    }
    Ok(())
}

/// A NUL-terminated C string from NVRTC, as text.
fn c_chars_to_string(chars: &[c_char]) -> String {
    let bytes: Vec<u8> = chars.iter().map(|&c| c as u8).take_while(|&b| b != 0).collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

/// The real architectures this NVRTC compiles for (e.g. 90 for sm_90);
/// empty if it cannot say.
fn nvrtc_archs() -> Vec<i32> {
    let mut count = 0i32;
    // SAFETY: NVRTC writes one int through the pointer.
    if unsafe { nvrtc::sys::nvrtcGetNumSupportedArchs(&mut count) }.result().is_err() || count <= 0 {
        return vec![];
    }
    let mut archs = vec![0i32; count as usize];
    // SAFETY: `archs` has room for the `count` ints NVRTC writes.
    if unsafe { nvrtc::sys::nvrtcGetSupportedArchs(archs.as_mut_ptr()) }.result().is_err() {
        return vec![];
    }
    archs
}

/// A paged KV pool's arguments, as `kv.cu`'s kernels take them: the pool,
/// its shape, the sequence's block table and the layer.
fn paged(p: Params, kv: &super::PagedKv, table: &DevicePtr, layer: usize) -> Params {
    p.ptr(kv.pool.addr).u64(kv.blocks()).u64(kv.n_layers).u64(kv.block_size).u64(kv.entry_dim).ptr(table.addr).u64(layer)
}

/// Kernel parameters. Each sits in its own 8-byte slot, and the kernel's
/// signature says how many bytes of it the driver reads; narrower values
/// are stored in the slot's first bytes in native order, which is where a
/// read of their size finds them.
#[derive(Default)]
struct Params(Vec<u64>);

impl Params {
    fn ptr(mut self, addr: u64) -> Self {
        self.0.push(addr);
        self
    }

    fn u64(mut self, v: usize) -> Self {
        self.0.push(v as u64);
        self
    }

    fn narrow(mut self, bytes: [u8; 4]) -> Self {
        let mut slot = [0u8; 8];
        slot[..4].copy_from_slice(&bytes);
        self.0.push(u64::from_ne_bytes(slot));
        self
    }

    fn f32(self, v: f32) -> Self {
        self.narrow(v.to_ne_bytes())
    }

    fn i32(self, v: i32) -> Self {
        self.narrow(v.to_ne_bytes())
    }

    fn flag(self, v: bool) -> Self {
        self.i32(v as i32)
    }

    /// A matrix as the kernels take it: its first element and its stride.
    fn matrix(self, m: &Matrix) -> Self {
        self.ptr(first(m)).u64(m.stride)
    }
}

/// The address of a matrix's first element.
fn first(m: &Matrix) -> u64 {
    m.buf.addr + m.offset as u64 * 4
}

/// Blocks for `items` work items of `per_block` each, at least one.
fn blocks(items: usize, per_block: usize) -> u32 {
    items.div_ceil(per_block.max(1)).clamp(1, MAX_BLOCKS) as u32
}

/// Threads for a block that needs one per column: a whole number of warps,
/// at least `min`.
fn threads_for(columns: usize, min: usize) -> u32 {
    columns.div_ceil(32).saturating_mul(32).clamp(min, MAX_BLOCK_THREADS) as u32
}

/// One stream and the host memory of its uploads still in flight.
struct Stream {
    cuda: Arc<CudaStream>,
    /// Each upload's source, with an event recorded after its copy: kept
    /// until the event completes. In stream order, so completed entries are
    /// always at the front.
    in_flight: Mutex<VecDeque<(CudaEvent, Box<dyn Any + Send + Sync>)>>,
}

impl Stream {
    /// Let go of the sources of uploads that have completed.
    fn release_finished(&self) {
        let mut in_flight = lock(&self.in_flight);
        // An error leaves the entry in place: the copy may still read it.
        while in_flight.front().is_some_and(|(event, _)| matches!(event.try_is_complete(), Ok(true))) {
            in_flight.pop_front();
        }
    }
}

/// A CUDA GPU as a [`Device`].
pub struct CudaDevice {
    ctx: Arc<CudaContext>,
    kernels: Kernels,
    description: String,
    /// The one device allocation the arena hands out (0 when it is empty).
    base: u64,
    arena: Mutex<Arena>,
    streams: Mutex<Vec<Arc<Stream>>>,
    /// Host ranges this device page-locked, by (address, length), with the
    /// bytes' owner kept alive until they are unregistered on drop.
    registered: Mutex<HashMap<(usize, usize), HostBytes>>,
    /// Whether host memory can be registered read-only (it only ever is
    /// read by uploads, and read-only mappings such as a memory-mapped
    /// checkpoint can be registered no other way).
    read_only_register: bool,
    /// Captures in progress.
    captures: Mutex<Captures>,
}

/// Which streams are being captured, and what each capture keeps.
#[derive(Default)]
struct Captures {
    /// Each capturing stream's capture, by the stream it began on.
    origin_of: HashMap<usize, usize>,
    /// Each capture by the stream it began on.
    open: HashMap<usize, CudaCapture>,
}

/// What a capture in progress keeps alive for its graph.
#[derive(Default)]
struct CudaCapture {
    /// Staging buffers its copies use, and its host functions' closures.
    keep: Vec<Box<dyn Any + Send + Sync>>,
    /// Why it failed, if it did: its graph is discarded at its end.
    failure: Option<DeviceError>,
}

/// An event recorded in a capture that began on stream `origin`: it
/// orders that capture's streams, and the host cannot wait for it.
struct CapturedEvent {
    event: CudaEvent,
    origin: usize,
}

/// A captured graph and what it keeps, destroyed on drop.
struct CudaGraph {
    ctx: Arc<CudaContext>,
    graph: sys::CUgraph,
    keep: Vec<Box<dyn Any + Send + Sync>>,
}

// SAFETY: a CUgraph is a handle that any thread may use, one at a time;
// `CudaGraph` is owned and so used by one thread at a time.
unsafe impl Send for CudaGraph {}

impl Drop for CudaGraph {
    fn drop(&mut self) {
        if !self.graph.is_null() && self.ctx.bind_to_thread().is_ok() {
            // SAFETY: made by `cuStreamEndCapture` and destroyed only here;
            // an executable graph made from it does not need it.
            let _ = unsafe { sys::cuGraphDestroy(self.graph) };
        }
    }
}

/// An executable graph, destroyed on drop (the driver lets a launch in
/// flight finish first).
struct CudaExec {
    ctx: Arc<CudaContext>,
    exec: sys::CUgraphExec,
}

// SAFETY: as for `CudaGraph`.
unsafe impl Send for CudaExec {}

impl Drop for CudaExec {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: made by `cuGraphInstantiateWithFlags`, destroyed only here.
            let _ = unsafe { sys::cuGraphExecDestroy(self.exec) };
        }
    }
}

/// A captured host function's closure: a graph may run it at most once
/// per launch, so it is taken out, not freed, by the call.
type HostSlot = Mutex<Option<HostFn>>;

/// Run `f`, turning a panic into an error: cudarc panics where a library
/// lacks a symbol it expects, which is an unusable installation, not a bug here.
fn unwind_to_error<T>(f: impl FnOnce() -> Result<T, DeviceError>) -> Result<T, DeviceError> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(result) => result,
        Err(panic) => {
            let why = panic.downcast_ref::<String>().cloned().or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string())).unwrap_or_default();
            Err(DeviceError::Unavailable(format!("the CUDA libraries failed to load: {why}")))
        }
    }
}

/// The primary context of GPU `ordinal`, after checking that the driver and
/// NVRTC can be loaded at all (`CudaContext::new` panics without a driver).
fn context(ordinal: usize) -> Result<Arc<CudaContext>, DeviceError> {
    // SAFETY: only tries to load the library (dlopen), calling nothing in it.
    if !unsafe { sys::is_culib_present() } {
        return Err(DeviceError::Unavailable("no CUDA driver (libcuda not found)".into()));
    }
    nvrtc_present()?;
    let count = CudaContext::device_count().map_err(|e| DeviceError::Unavailable(format!("the CUDA driver does not start: {e}")))?;
    if ordinal >= count.max(0) as usize {
        return Err(DeviceError::Unavailable(format!("no GPU {ordinal}: the driver sees {count}")));
    }
    CudaContext::new(ordinal).map_err(|e| DeviceError::Unavailable(format!("cannot open GPU {ordinal}: {e}")))
}

impl CudaDevice {
    /// Open GPU `ordinal` with an arena of `memory_bytes` (rounded down to the
    /// arena's alignment), allocated now.
    pub fn open(ordinal: usize, memory_bytes: usize) -> Result<Arc<CudaDevice>, DeviceError> {
        unwind_to_error(|| Self::open_inner(ordinal, memory_bytes))
    }

    /// Bytes of GPU `ordinal`'s memory free now (to size an arena by).
    pub fn free_memory(ordinal: usize) -> Result<usize, DeviceError> {
        unwind_to_error(|| {
            let ctx = context(ordinal)?;
            let (free, _total) = ctx.mem_get_info().map_err(backend("reading free memory"))?;
            Ok(free)
        })
    }

    fn open_inner(ordinal: usize, memory_bytes: usize) -> Result<Arc<CudaDevice>, DeviceError> {
        let ctx = context(ordinal)?;
        let kernels = Kernels::compile(&ctx)?;
        let name = ctx.name().unwrap_or_else(|_| "unknown GPU".into());
        let (major, minor) = ctx.compute_capability().map_err(backend("reading the compute capability"))?;
        let read_only_register = ctx.attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED).unwrap_or(0) != 0;

        let arena = Arena::new(memory_bytes);
        let base = if arena.capacity() > 0 {
            ctx.bind_to_thread().map_err(backend("binding the CUDA context"))?;
            // SAFETY: a plain allocation; it is freed once, in Drop.
            unsafe { cu::malloc_sync(arena.capacity()) }.map_err(|e| {
                let (free, total) = ctx.mem_get_info().unwrap_or((0, 0));
                DeviceError::Backend(format!("cannot allocate {} bytes on GPU {ordinal} ({free} of {total} free): {e}", arena.capacity()))
            })?
        } else {
            0
        };
        let description = format!("CUDA GPU {ordinal}: {name} (sm_{major}{minor}, {} MiB arena)", arena.capacity() >> 20);
        Ok(Arc::new(CudaDevice {
            ctx,
            kernels,
            description,
            base,
            arena: Mutex::new(arena),
            streams: Mutex::new(vec![]),
            registered: Mutex::new(HashMap::new()),
            read_only_register,
            captures: Mutex::default(),
        }))
    }

    /// Make this device's context current on the calling thread, as every
    /// raw driver call needs.
    fn bind(&self) -> Result<(), DeviceError> {
        self.ctx.bind_to_thread().map_err(backend("binding the CUDA context"))
    }

    fn stream(&self, id: StreamId) -> Result<Arc<Stream>, DeviceError> {
        lock(&self.streams).get(id.0).cloned().ok_or_else(|| DeviceError::Invalid(format!("no stream {}", id.0)))
    }

    fn event(event: &Event) -> Result<&CudaEvent, DeviceError> {
        if event.0.is::<CapturedEvent>() {
            return Err(DeviceError::Invalid("the host cannot wait for an event recorded in a graph capture: it marks no point of any stream's run".into()));
        }
        event.0.downcast_ref::<CudaEvent>().ok_or_else(|| DeviceError::Invalid("an event of another device".into()))
    }

    /// The stream a capture that `stream` is part of began on.
    fn capture_of(&self, stream: StreamId) -> Option<usize> {
        lock(&self.captures).origin_of.get(&stream.0).copied()
    }

    /// Refuse what a capturing stream may not do, failing its capture.
    fn refuse_in_capture(&self, stream: StreamId, what: &str) -> Result<(), DeviceError> {
        let mut captures = lock(&self.captures);
        let Some(origin) = captures.origin_of.get(&stream.0).copied() else {
            return Ok(());
        };
        let e = DeviceError::Invalid(format!("{what} on stream {} while it is captured into a graph", stream.0));
        if let Some(c) = captures.open.get_mut(&origin) {
            c.failure.get_or_insert(e.clone());
        }
        Err(e)
    }

    /// Keep `what` alive for the graph being captured from `origin`.
    fn keep_for_capture(&self, origin: usize, what: Box<dyn Any + Send + Sync>) {
        if let Some(c) = lock(&self.captures).open.get_mut(&origin) {
            c.keep.push(what);
        }
    }

    /// Check that `p` lies in this device's arena and is aligned for
    /// `align`-byte elements: a kernel handed anything else would fault and
    /// take the whole context down with it.
    fn check_ptr(&self, p: &DevicePtr, align: usize, what: &str) -> Result<(), DeviceError> {
        if p.bytes == 0 {
            return Ok(());
        }
        let capacity = lock(&self.arena).capacity() as u64;
        let end = p.addr.checked_add(p.bytes as u64);
        if p.addr < self.base || end.is_none_or(|end| end > self.base + capacity) {
            return Err(DeviceError::Invalid(format!("{what}: {} bytes at {:#x} lie outside this device's memory", p.bytes, p.addr)));
        }
        if !p.addr.is_multiple_of(align as u64) {
            return Err(DeviceError::Invalid(format!("{what}: address {:#x} is not {align}-byte aligned", p.addr)));
        }
        Ok(())
    }

    fn check_matrix(&self, m: &Matrix, what: &str) -> Result<(), DeviceError> {
        self.check_ptr(&m.buf, 4, what)
    }

    fn check_weight(&self, w: &DeviceWeight, what: &str) -> Result<(), DeviceError> {
        w.check(what)?;
        self.check_ptr(&w.data, 1, what)?;
        if matches!(w.format, WeightFormat::Fp8E4m3 { .. }) {
            self.check_ptr(&w.scales, 4, what)?;
        }
        Ok(())
    }

    /// Every buffer an op touches belongs to this device.
    fn check_op(&self, op: &Op) -> Result<(), DeviceError> {
        match op {
            Op::Gemm { w, x, y, .. } => {
                self.check_weight(w, "gemm weight")?;
                self.check_matrix(x, "gemm x")?;
                self.check_matrix(y, "gemm y")
            }
            Op::GemmBatched { w, w_step, scales_step, x, x_rows, y, y_rows, count, .. } => {
                // The first and the last batch bound the rest.
                let last = count.saturating_sub(1);
                self.check_weight(w, "batched gemm weight")?;
                self.check_weight(&w.shifted(last * w_step, last * scales_step), "batched gemm weight, last batch")?;
                self.check_matrix(&x.rows(last * x_rows..last * x_rows + x.rows), "batched gemm x")?;
                self.check_matrix(&y.rows(last * y_rows..last * y_rows + y.rows), "batched gemm y")
            }
            Op::RmsNorm { x, weight, out, .. } => {
                self.check_matrix(x, "rms_norm x")?;
                self.check_ptr(weight, 4, "rms_norm weight")?;
                self.check_matrix(out, "rms_norm out")
            }
            Op::Rope { x, cos, sin, .. } => {
                self.check_matrix(x, "rope x")?;
                self.check_matrix(cos, "rope cos")?;
                self.check_matrix(sin, "rope sin")
            }
            Op::SiluMul { gate, up, .. } => {
                self.check_matrix(gate, "silu gate")?;
                self.check_matrix(up, "silu up")
            }
            Op::Add { h, delta, .. } => {
                self.check_matrix(h, "add h")?;
                self.check_matrix(delta, "add delta")
            }
            Op::RoundBf16 { x } | Op::Zero { x } => self.check_matrix(x, "elementwise"),
            Op::Route { logits, bias, ids, weights, .. } => {
                self.check_matrix(logits, "route logits")?;
                if let Some(b) = bias {
                    self.check_ptr(b, 4, "route bias")?;
                }
                self.check_ptr(ids, 4, "route ids")?;
                self.check_matrix(weights, "route weights")
            }
            Op::GatherRows { src, rows, dst, .. } => {
                self.check_matrix(src, "gather src")?;
                self.check_ptr(rows, 4, "gather rows")?;
                self.check_matrix(dst, "gather dst")
            }
            Op::ScatterAddRows { src, rows, scales, dst, .. } => {
                self.check_matrix(src, "scatter src")?;
                self.check_ptr(rows, 4, "scatter rows")?;
                self.check_ptr(scales, 4, "scatter scales")?;
                self.check_matrix(dst, "scatter dst")
            }
            Op::Embedding { table, ids, out, .. } => {
                self.check_weight(table, "embedding table")?;
                self.check_ptr(ids, 4, "embedding ids")?;
                self.check_matrix(out, "embedding out")
            }
            Op::MlaPrefill { q, kv, latents, out, .. } => {
                self.check_matrix(q, "mla q")?;
                self.check_matrix(kv, "mla kv")?;
                self.check_matrix(latents, "mla latents")?;
                self.check_matrix(out, "mla out")
            }
            Op::MlaDecode { q_latent, q_pe, latents, out, .. } => {
                self.check_matrix(q_latent, "mla q_latent")?;
                self.check_matrix(q_pe, "mla q_pe")?;
                self.check_matrix(latents, "mla latents")?;
                self.check_matrix(out, "mla out")
            }
            Op::GqaAttention { q, k, v, out, .. } => {
                self.check_matrix(q, "gqa q")?;
                self.check_matrix(k, "gqa k")?;
                self.check_matrix(v, "gqa v")?;
                self.check_matrix(out, "gqa out")
            }
            Op::MlaPrefillPart { q, kv, latents, out, lse, .. } => {
                self.check_matrix(q, "mla_part q")?;
                self.check_matrix(kv, "mla_part kv")?;
                self.check_matrix(latents, "mla_part latents")?;
                self.check_matrix(out, "mla_part out")?;
                self.check_matrix(lse, "mla_part lse")
            }
            Op::GqaAttentionPart { q, k, v, out, lse, .. } => {
                self.check_matrix(q, "gqa_part q")?;
                self.check_matrix(k, "gqa_part k")?;
                self.check_matrix(v, "gqa_part v")?;
                self.check_matrix(out, "gqa_part out")?;
                self.check_matrix(lse, "gqa_part lse")
            }
            Op::AttentionMerge { out, lse, part, part_lse, .. } => {
                self.check_matrix(out, "merge out")?;
                self.check_matrix(lse, "merge lse")?;
                self.check_matrix(part, "merge part")?;
                self.check_matrix(part_lse, "merge part_lse")
            }
            Op::KvStore { entries, kv, table, .. } => {
                self.check_matrix(entries, "kv_store entries")?;
                self.check_ptr(&kv.pool, 4, "kv_store pool")?;
                self.check_ptr(table, 4, "kv_store table")
            }
            Op::KvGather { kv, table, out, .. } => {
                self.check_ptr(&kv.pool, 4, "kv_gather pool")?;
                self.check_ptr(table, 4, "kv_gather table")?;
                self.check_matrix(out, "kv_gather out")
            }
        }
    }

    /// Enqueue `f` on `stream` with a 1-D grid.
    fn run(&self, stream: &CudaStream, f: &CudaFunction, grid: u32, block: u32, shared_bytes: usize, mut params: Params) -> Result<(), DeviceError> {
        let mut args: Vec<*mut c_void> = params.0.iter_mut().map(|slot| slot as *mut u64 as *mut c_void).collect();
        // SAFETY: every kernel's parameters are listed in its signature's
        // order by the callers below (pointers and u64 sizes as 8 bytes,
        // floats and flags as 4); the driver copies them before returning,
        // while `params` is alive. The pointers were checked to lie in this
        // device's memory and the shapes by `Op::validate`, and each kernel
        // stays within the shapes it is given.
        unsafe { cu::launch_kernel(f.cu_function(), (grid, 1, 1), (block, 1, 1), shared_bytes as u32, stream.cu_stream(), &mut args) }.map_err(backend("kernel launch"))
    }

    /// An elementwise kernel over a `rows × cols` matrix.
    fn run_elementwise(&self, stream: &CudaStream, f: &CudaFunction, rows: usize, cols: usize, params: Params) -> Result<(), DeviceError> {
        if rows == 0 || cols == 0 {
            return Ok(());
        }
        self.run(stream, f, blocks(rows * cols, THREADS), THREADS as u32, 0, params)
    }

    /// A GEMM kernel (`fs`: one per weight format, F32, BF16, F16, FP8) over
    /// `w`, `x` and `y`, its parameters followed by `more`.
    #[allow(clippy::too_many_arguments)]
    fn gemm(&self, s: &CudaStream, fs: [&CudaFunction; 4], w: &DeviceWeight, x: &Matrix, y: &Matrix, precision: Precision, round: bool, more: Params) -> Result<(), DeviceError> {
        let n = x.rows;
        if n == 0 || w.rows == 0 {
            return Ok(());
        }
        let (f, [b0, b1]) = match w.format {
            WeightFormat::F32 => (fs[0], [1, 1]),
            WeightFormat::Bf16 => (fs[1], [1, 1]),
            WeightFormat::F16 => (fs[2], [1, 1]),
            WeightFormat::Fp8E4m3 { block } => (fs[3], block),
            // `check_op` refused it before anything was queued.
            WeightFormat::Quant(kind) => return Err(DeviceError::Invalid(format!("{kind} weights have no device kernels"))),
        };
        let warps = w.rows * n.div_ceil(GEMM_TILE);
        let mut params = Params::default()
            .ptr(w.data.addr)
            .ptr(w.scales.addr)
            .u64(w.rows)
            .u64(w.cols)
            .u64(b0)
            .u64(b1)
            .matrix(x)
            .matrix(y)
            .u64(n)
            .flag(precision == Precision::Bf16)
            .flag(round);
        params.0.extend(more.0);
        self.run(s, f, blocks(warps, THREADS / 32), THREADS as u32, 0, params)
    }

    fn launch_op(&self, s: &CudaStream, op: &Op) -> Result<(), DeviceError> {
        let k = &self.kernels;
        let bf16 = |p: &Precision| *p == Precision::Bf16;
        match op {
            Op::Gemm { w, x, y, precision, round } => {
                let fs = [&k.gemm_f32, &k.gemm_bf16, &k.gemm_f16, &k.gemm_fp8];
                self.gemm(s, fs, w, x, y, *precision, *round, Params::default())
            }
            Op::GemmBatched { w, w_step, scales_step, x, x_rows, y, y_rows, count, precision, round } => {
                // The grid is one batch's warps; the kernel runs the batches in turn.
                let fs = [&k.gemm_batched_f32, &k.gemm_batched_bf16, &k.gemm_batched_f16, &k.gemm_batched_fp8];
                let batches = Params::default().u64(*count).u64(*w_step).u64(*scales_step).u64(x_rows * x.stride).u64(y_rows * y.stride);
                self.gemm(s, fs, w, x, y, *precision, *round, batches)
            }
            Op::RmsNorm { x, weight, out, eps, precision } => {
                if x.rows == 0 || x.cols == 0 {
                    return Ok(());
                }
                let params = Params::default().matrix(x).ptr(weight.addr).matrix(out).u64(x.rows).u64(x.cols).f32(*eps).flag(bf16(precision));
                self.run(s, &k.rms_norm, blocks(x.rows, 1), THREADS as u32, 0, params)
            }
            Op::Rope { x, cos, sin, rows_per_position, interleaved, precision } => {
                if x.rows == 0 || x.cols == 0 {
                    return Ok(());
                }
                let shared = x.cols * 4;
                if shared > MAX_SHARED_BYTES {
                    return Err(DeviceError::Invalid(format!("rope: rows of {} floats exceed the CUDA kernel's shared memory", x.cols)));
                }
                let params = Params::default()
                    .matrix(x)
                    .u64(x.rows)
                    .u64(x.cols)
                    .matrix(cos)
                    .matrix(sin)
                    .u64(*rows_per_position)
                    .flag(*interleaved)
                    .flag(bf16(precision));
                self.run(s, &k.rope, blocks(x.rows, 1), threads_for(x.cols / 2, 32), shared, params)
            }
            Op::SiluMul { gate, up, precision } => {
                let params = Params::default().matrix(gate).matrix(up).u64(gate.rows).u64(gate.cols).flag(bf16(precision));
                self.run_elementwise(s, &k.silu_mul, gate.rows, gate.cols, params)
            }
            Op::Add { h, delta, precision } => {
                let params = Params::default().matrix(h).matrix(delta).u64(h.rows).u64(h.cols).flag(bf16(precision));
                self.run_elementwise(s, &k.add_rows, h.rows, h.cols, params)
            }
            Op::RoundBf16 { x } => self.run_elementwise(s, &k.round_rows, x.rows, x.cols, Params::default().matrix(x).u64(x.rows).u64(x.cols)),
            Op::Zero { x } => self.run_elementwise(s, &k.zero_rows, x.rows, x.cols, Params::default().matrix(x).u64(x.rows).u64(x.cols)),
            Op::Route { logits, bias, params: p, ids, weights, precision: _ } => {
                // Both precisions choose the same experts; the CPU's BF16
                // path differs only in its vector `exp` (≤ 1e-6 relative).
                if logits.rows == 0 {
                    return Ok(());
                }
                let shared = (3 * p.n_experts + p.n_group) * 4;
                if shared > MAX_SHARED_BYTES {
                    return Err(DeviceError::Invalid(format!("route: {} experts exceed the CUDA kernel's shared memory", p.n_experts)));
                }
                let params = Params::default()
                    .matrix(logits)
                    .u64(logits.rows)
                    .ptr(bias.map_or(0, |b| b.addr))
                    .flag(bias.is_some())
                    .u64(p.n_experts)
                    .u64(p.top_k)
                    .u64(p.n_group)
                    .u64(p.topk_group)
                    .flag(p.norm_topk_prob)
                    .f32(p.routed_scaling_factor)
                    .flag(p.scoring == ScoringFunc::Softmax)
                    .ptr(ids.addr)
                    .matrix(weights);
                self.run(s, &k.route, blocks(logits.rows, 1), threads_for(p.n_experts, 32).min(THREADS as u32), shared, params)
            }
            Op::GatherRows { src, rows, count, dst } => {
                let params = Params::default().matrix(src).u64(src.rows).ptr(rows.addr).u64(*count).matrix(dst).u64(src.cols);
                self.run_elementwise(s, &k.gather_rows, *count, src.cols, params)
            }
            Op::ScatterAddRows { src, rows, scales, count, dst } => {
                let params = Params::default().matrix(src).ptr(rows.addr).ptr(scales.addr).u64(*count).matrix(dst).u64(dst.rows).u64(src.cols);
                self.run_elementwise(s, &k.scatter_add_rows, *count, src.cols, params)
            }
            Op::Embedding { table, first_row, ids, count, out, precision } => {
                // FMT_* in common.cu.
                let (fmt, [b0, b1]) = match table.format {
                    WeightFormat::F32 => (0, [1, 1]),
                    WeightFormat::Bf16 => (1, [1, 1]),
                    WeightFormat::F16 => (2, [1, 1]),
                    WeightFormat::Fp8E4m3 { block } => (3, block),
                    WeightFormat::Quant(kind) => return Err(DeviceError::Invalid(format!("{kind} embedding tables have no device kernels"))),
                };
                let params = Params::default()
                    .ptr(table.data.addr)
                    .ptr(table.scales.addr)
                    .u64(table.rows)
                    .u64(table.cols)
                    .i32(fmt)
                    .u64(b0)
                    .u64(b1)
                    .u64(*first_row)
                    .ptr(ids.addr)
                    .u64(*count)
                    .matrix(out)
                    .flag(bf16(precision));
                self.run_elementwise(s, &k.embedding, *count, table.cols, params)
            }
            Op::MlaPrefill { q, kv, latents, out, start, dims: d, scale, precision } => {
                if q.rows == 0 {
                    return Ok(());
                }
                if d.dv > MAX_BLOCK_THREADS {
                    return Err(DeviceError::Invalid(format!("mla_prefill: value width {} above the CUDA kernel's {MAX_BLOCK_THREADS}", d.dv)));
                }
                let threads = threads_for(d.dv, 128);
                let params = Params::default()
                    .matrix(q)
                    .matrix(kv)
                    .matrix(latents)
                    .matrix(out)
                    .u64(q.rows)
                    .u64(*start)
                    .u64(d.heads)
                    .u64(d.dn)
                    .u64(d.dr)
                    .u64(d.dv)
                    .u64(d.dc)
                    .f32(*scale)
                    .flag(bf16(precision));
                self.run(s, &k.mla_prefill, blocks(q.rows * d.heads, 1), threads, threads as usize * 4, params)
            }
            Op::MlaDecode { q_latent, q_pe, latents, out, scale, precision: _ } => {
                // Both precisions leave the output unrounded, as the CPU's
                // decode attention does (the engine rounds after it).
                let (heads, dc) = (q_latent.rows, q_latent.cols);
                if dc > MAX_BLOCK_THREADS {
                    return Err(DeviceError::Invalid(format!("mla_decode: latent width {dc} above the CUDA kernel's {MAX_BLOCK_THREADS}")));
                }
                let threads = threads_for(dc, 128);
                let params = Params::default()
                    .matrix(q_latent)
                    .matrix(q_pe)
                    .matrix(latents)
                    .u64(latents.rows)
                    .matrix(out)
                    .u64(heads)
                    .u64(dc)
                    .u64(q_pe.cols)
                    .f32(*scale)
                    .flag(false);
                self.run(s, &k.mla_decode, blocks(heads, 1), threads, threads as usize * 4, params)
            }
            Op::GqaAttention { q, k: keys, v, out, start, dims: d, scale, precision } => {
                if q.rows == 0 {
                    return Ok(());
                }
                if d.head_dim > MAX_BLOCK_THREADS {
                    return Err(DeviceError::Invalid(format!("gqa_attention: head width {} above the CUDA kernel's {MAX_BLOCK_THREADS}", d.head_dim)));
                }
                let threads = threads_for(d.head_dim, 128);
                let params = Params::default()
                    .matrix(q)
                    .matrix(keys)
                    .matrix(v)
                    .matrix(out)
                    .u64(q.rows)
                    .u64(*start)
                    .u64(d.heads)
                    .u64(d.kv_heads)
                    .u64(d.head_dim)
                    .f32(*scale)
                    .flag(bf16(precision));
                // Shared memory: a weight per thread, then the query.
                self.run(s, &k.gqa_attention, blocks(q.rows * d.heads, 1), threads, (threads as usize + d.head_dim) * 4, params)
            }
            Op::MlaPrefillPart { q, kv, latents, out, lse, start, key_start, dims: d, scale, precision } => {
                if q.rows == 0 {
                    return Ok(());
                }
                if d.dv > MAX_BLOCK_THREADS {
                    return Err(DeviceError::Invalid(format!("mla_prefill_part: value width {} above the CUDA kernel's {MAX_BLOCK_THREADS}", d.dv)));
                }
                let threads = threads_for(d.dv, 128);
                // Shared memory: a weight per thread, then the query.
                let shared = (threads as usize + d.dn + d.dr) * 4;
                if shared > MAX_SHARED_BYTES {
                    return Err(DeviceError::Invalid(format!("mla_prefill_part: a query of {} floats exceeds the CUDA kernel's shared memory", d.dn + d.dr)));
                }
                let params = Params::default()
                    .matrix(q)
                    .matrix(kv)
                    .matrix(latents)
                    .matrix(out)
                    .matrix(lse)
                    .u64(q.rows)
                    .u64(kv.rows)
                    .u64(*start)
                    .u64(*key_start)
                    .u64(d.heads)
                    .u64(d.dn)
                    .u64(d.dr)
                    .u64(d.dv)
                    .u64(d.dc)
                    .f32(*scale)
                    .flag(bf16(precision));
                self.run(s, &k.mla_prefill_part, blocks(q.rows * d.heads, 1), threads, shared, params)
            }
            Op::GqaAttentionPart { q, k: keys, v, out, lse, start, key_start, dims: d, scale, precision } => {
                if q.rows == 0 {
                    return Ok(());
                }
                if d.head_dim > MAX_BLOCK_THREADS {
                    return Err(DeviceError::Invalid(format!("gqa_attention_part: head width {} above the CUDA kernel's {MAX_BLOCK_THREADS}", d.head_dim)));
                }
                let threads = threads_for(d.head_dim, 128);
                let params = Params::default()
                    .matrix(q)
                    .matrix(keys)
                    .matrix(v)
                    .matrix(out)
                    .matrix(lse)
                    .u64(q.rows)
                    .u64(keys.rows)
                    .u64(*start)
                    .u64(*key_start)
                    .u64(d.heads)
                    .u64(d.kv_heads)
                    .u64(d.head_dim)
                    .f32(*scale)
                    .flag(bf16(precision));
                // Shared memory: a weight per thread, then the query (at most 8 KiB).
                self.run(s, &k.gqa_attention_part, blocks(q.rows * d.heads, 1), threads, (threads as usize + d.head_dim) * 4, params)
            }
            Op::AttentionMerge { out, lse, part, part_lse, heads } => {
                // (Zero-width heads still merge their lse.)
                let d = out.cols / heads;
                if out.rows == 0 {
                    return Ok(());
                }
                let params = Params::default().matrix(out).matrix(lse).matrix(part).matrix(part_lse).u64(out.rows).u64(*heads).u64(d);
                self.run(s, &k.attention_merge, blocks(out.rows * heads, 1), threads_for(d, 32).min(THREADS as u32), 0, params)
            }
            // Block ids past the pool are skipped (store) or read as NaN
            // rows (gather) by the kernels: see kv.cu.
            Op::KvStore { entries, kv, table, layer, start, .. } => {
                let params = paged(Params::default().matrix(entries).u64(entries.rows), kv, table, *layer).u64(*start);
                self.run_elementwise(s, &k.kv_store, entries.rows, kv.entry_dim, params)
            }
            Op::KvGather { kv, table, layer, out, .. } => {
                let params = paged(Params::default(), kv, table, *layer)
                    .matrix(out)
                    .u64(out.rows);
                self.run_elementwise(s, &k.kv_gather, out.rows, kv.entry_dim, params)
            }
        }
    }
}

impl Drop for CudaDevice {
    fn drop(&mut self) {
        // Queued work may still read the arena and registered host memory.
        if self.bind().is_ok() {
            let _ = self.ctx.synchronize();
        }
        for s in lock(&self.streams).iter() {
            lock(&s.in_flight).clear();
        }
        for ((addr, _), _owner) in lock(&self.registered).drain() {
            // SAFETY: `addr` was registered by this device and not since
            // unregistered; `_owner` keeps the memory alive until after this.
            let _ = unsafe { sys::cuMemHostUnregister(addr as *mut c_void) };
        }
        if self.base != 0 {
            // SAFETY: the arena's allocation, freed once; the context has
            // finished all work that used it.
            let _ = unsafe { cu::free_sync(self.base) };
        }
    }
}

/// Run a boxed host closure from `cuLaunchHostFunc`.
extern "C" fn run_host_fn(arg: *mut c_void) {
    // SAFETY: `arg` is the `Box<HostFn>` leaked by `host_fn`, and the driver
    // calls this exactly once for it.
    let f = unsafe { Box::from_raw(arg as *mut HostFn) };
    // Unwinding into the driver's thread would abort the process.
    if catch_unwind(AssertUnwindSafe(f)).is_err() {
        eprintln!("duplex-kernels: a CUDA host function panicked");
    }
}

type HostFn = Box<dyn FnOnce() + Send>;

/// Run a captured host function's closure, if it is still in its slot.
extern "C" fn run_host_slot(arg: *mut c_void) {
    // SAFETY: `arg` is a `HostSlot` kept alive by the capture and then by
    // the graph's launch until the launch has completed.
    let slot = unsafe { &*(arg as *const HostSlot) };
    let f = lock(slot).take();
    if let Some(f) = f {
        if catch_unwind(AssertUnwindSafe(f)).is_err() {
            eprintln!("duplex-kernels: a CUDA host function panicked");
        }
    }
}

impl Device for CudaDevice {
    fn describe(&self) -> String {
        self.description.clone()
    }

    fn capacity(&self) -> usize {
        lock(&self.arena).capacity()
    }

    fn free_bytes(&self) -> usize {
        lock(&self.arena).free_bytes()
    }

    fn alloc(&self, bytes: usize) -> Result<DevicePtr, DeviceError> {
        let offset = lock(&self.arena).alloc(bytes)?;
        Ok(DevicePtr { addr: self.base + offset as u64, bytes })
    }

    fn free(&self, ptr: DevicePtr) -> Result<(), DeviceError> {
        let offset = ptr.addr.checked_sub(self.base).ok_or_else(|| DeviceError::Invalid(format!("free of {:#x}, below this device's memory", ptr.addr)))?;
        lock(&self.arena).free(offset as usize)
    }

    fn create_stream(&self, _kind: StreamKind) -> Result<StreamId, DeviceError> {
        // Copy and compute streams are alike on a GPU: the copy engines
        // pick up copies from any stream.
        let cuda = self.ctx.new_stream().map_err(backend("creating a stream"))?;
        let mut streams = lock(&self.streams);
        streams.push(Arc::new(Stream { cuda, in_flight: Mutex::new(VecDeque::new()) }));
        Ok(StreamId(streams.len() - 1))
    }

    fn upload(&self, stream: StreamId, src: &HostBytes, dst: DevicePtr) -> Result<(), DeviceError> {
        if src.len() != dst.bytes {
            return Err(DeviceError::Invalid(format!("upload of {} bytes into a {}-byte range", src.len(), dst.bytes)));
        }
        self.check_ptr(&dst, 1, "upload")?;
        self.refuse_in_capture(stream, "an upload from host memory a graph would not keep (copy from staging)")?;
        let s = self.stream(stream)?;
        s.release_finished();
        if src.is_empty() {
            return Ok(());
        }
        self.bind()?;
        // SAFETY: `dst` lies in this device's memory (checked); the source
        // stays alive until the copy is done: a clone of `src` is kept below
        // until an event recorded after the copy completes.
        unsafe { cu::memcpy_htod_async(dst.addr, src.as_slice(), s.cuda.cu_stream()) }.map_err(backend("host→device copy"))?;
        let done = s.cuda.record_event(None).map_err(backend("recording an upload's event"))?;
        lock(&s.in_flight).push_back((done, Box::new(src.clone())));
        Ok(())
    }

    fn download(&self, stream: StreamId, src: DevicePtr) -> Result<Vec<u8>, DeviceError> {
        self.check_ptr(&src, 1, "download")?;
        self.refuse_in_capture(stream, "a download the host waits for")?;
        let s = self.stream(stream)?;
        let mut out = vec![0u8; src.bytes];
        if out.is_empty() {
            return Ok(out);
        }
        self.bind()?;
        // SAFETY: `src` lies in this device's memory (checked) and `out` has
        // its length; `out` is not touched until the stream has synchronized.
        unsafe { cu::memcpy_dtoh_async(&mut out, src.addr, s.cuda.cu_stream()) }.map_err(backend("device→host copy"))?;
        if let Err(e) = s.cuda.synchronize() {
            // The copy may not have finished: leak the buffer rather than
            // free it under the copy.
            std::mem::forget(out);
            return Err(DeviceError::Backend(format!("waiting for a device→host copy: {e}")));
        }
        s.release_finished();
        Ok(out)
    }

    /// Page-locked (registered, not copied), so that copies to and from it
    /// are asynchronous; unregistered when it goes.
    fn staging(&self, bytes: usize) -> Result<Arc<Staging>, DeviceError> {
        let staging = Arc::new(Staging::new(bytes));
        if bytes == 0 {
            return Ok(staging);
        }
        self.bind()?;
        let addr = staging.addr(0, bytes)?;
        // SAFETY: the staging's bytes are live host memory that never moves
        // while it lives; it unregisters them (below) before they are freed.
        unsafe { sys::cuMemHostRegister_v2(addr as *mut c_void, bytes, 0) }.result().map_err(|e| DeviceError::Backend(format!("page-locking {bytes} bytes of staging memory: {e}")))?;
        let ctx = self.ctx.clone();
        staging.on_drop(Box::new(move || {
            if ctx.bind_to_thread().is_ok() {
                // SAFETY: registered above, and unregistered only here.
                let _ = unsafe { sys::cuMemHostUnregister(addr as *mut c_void) };
            }
        }));
        Ok(staging)
    }

    fn download_to(&self, stream: StreamId, src: DevicePtr, dst: &Arc<Staging>, offset: usize) -> Result<(), DeviceError> {
        self.check_ptr(&src, 1, "download")?;
        let at = dst.addr(offset, src.bytes)?;
        let s = self.stream(stream)?;
        let capture = self.capture_of(stream);
        if capture.is_none() {
            s.release_finished();
        }
        if src.bytes == 0 {
            return Ok(());
        }
        self.bind()?;
        // SAFETY: `src` lies in this device's memory and the destination
        // range in the staging (both checked); the staging stays alive until
        // an event recorded after the copy completes (kept below), and host
        // code reads it only from work ordered after the copy (its contract).
        unsafe { sys::cuMemcpyDtoHAsync_v2(at as *mut c_void, src.addr, src.bytes, s.cuda.cu_stream()) }.result().map_err(backend("device→host copy"))?;
        self.keep_until_done(&s, capture, Box::new(dst.clone()))
    }

    fn upload_from(&self, stream: StreamId, src: &Arc<Staging>, offset: usize, dst: DevicePtr) -> Result<(), DeviceError> {
        self.check_ptr(&dst, 1, "upload")?;
        let at = src.addr(offset, dst.bytes)?;
        let s = self.stream(stream)?;
        let capture = self.capture_of(stream);
        if capture.is_none() {
            s.release_finished();
        }
        if dst.bytes == 0 {
            return Ok(());
        }
        self.bind()?;
        // SAFETY: as for `download_to`, the other way.
        unsafe { sys::cuMemcpyHtoDAsync_v2(dst.addr, at as *const c_void, dst.bytes, s.cuda.cu_stream()) }.result().map_err(backend("host→device copy"))?;
        self.keep_until_done(&s, capture, Box::new(src.clone()))
    }

    fn launch(&self, stream: StreamId, op: &Op) -> Result<(), DeviceError> {
        op.validate()?;
        self.check_op(op)?;
        let s = self.stream(stream)?;
        self.bind()?;
        self.launch_op(&s.cuda, op)
    }

    fn record(&self, stream: StreamId) -> Result<Event, DeviceError> {
        let s = self.stream(stream)?;
        let event = s.cuda.record_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT)).map_err(backend("recording an event"))?;
        Ok(match self.capture_of(stream) {
            Some(origin) => Event(Arc::new(CapturedEvent { event, origin })),
            None => Event(Arc::new(event)),
        })
    }

    /// Waiting on a captured event joins the stream to that capture (the
    /// driver does so too); a captured stream may not wait on an event
    /// from outside its capture.
    fn wait_event(&self, stream: StreamId, event: &Event) -> Result<(), DeviceError> {
        let s = self.stream(stream)?;
        let cuda_event = match event.0.downcast_ref::<CapturedEvent>() {
            Some(captured) => {
                let mut captures = lock(&self.captures);
                if !captures.open.contains_key(&captured.origin) {
                    return Err(DeviceError::Invalid("an event recorded in a graph capture orders only that capture's streams, and it has ended".into()));
                }
                match captures.origin_of.get(&stream.0) {
                    Some(&o) if o != captured.origin => return Err(DeviceError::Invalid(format!("stream {} is in another capture than the event it would wait on", stream.0))),
                    Some(_) => {}
                    None => {
                        captures.origin_of.insert(stream.0, captured.origin);
                    }
                }
                &captured.event
            }
            None => {
                self.refuse_in_capture(stream, "a wait on an event recorded outside the capture")?;
                Self::event(event)?
            }
        };
        s.cuda.wait(cuda_event).map_err(backend("making a stream wait for an event"))
    }

    fn query(&self, event: &Event) -> Result<bool, DeviceError> {
        self.bind()?;
        Self::event(event)?.try_is_complete().map_err(backend("querying an event"))
    }

    fn synchronize(&self, event: &Event) -> Result<(), DeviceError> {
        Self::event(event)?.synchronize().map_err(backend("waiting for an event"))?;
        for s in lock(&self.streams).iter() {
            s.release_finished();
        }
        Ok(())
    }

    fn elapsed(&self, from: &Event, to: &Event) -> Result<Duration, DeviceError> {
        let (a, b) = (Self::event(from)?, Self::event(to)?);
        self.bind()?;
        // SAFETY: both are live events of this process, recorded with timing.
        match unsafe { cu::event::elapsed(a.cu_event(), b.cu_event()) } {
            Ok(ms) => Ok(Duration::from_secs_f64(f64::from(ms.max(0.0)) / 1e3)),
            Err(DriverError(sys::CUresult::CUDA_ERROR_NOT_READY)) => Err(DeviceError::Invalid("elapsed time of an event that has not completed".into())),
            Err(e) => Err(DeviceError::Backend(format!("event timing: {e}"))),
        }
    }

    /// `f` runs on a driver thread, and must not call into CUDA (nor so
    /// into this device): the driver forbids it in host functions.
    fn host_fn(&self, stream: StreamId, f: Box<dyn FnOnce() + Send>) -> Result<(), DeviceError> {
        let s = self.stream(stream)?;
        self.bind()?;
        if let Some(origin) = self.capture_of(stream) {
            // A graph's host node may run more than once: the closure stays
            // with the capture, and each call takes it if it is still there.
            let slot: Box<HostSlot> = Box::new(Mutex::new(Some(f)));
            let arg = &*slot as *const HostSlot as *mut c_void;
            // SAFETY: `arg` points into `slot`, which the capture, then its
            // launch, keeps alive until the graph has run.
            let launched = unsafe { cu::stream::launch_host_function(s.cuda.cu_stream(), run_host_slot, arg) };
            launched.map_err(backend("capturing a host function"))?;
            self.keep_for_capture(origin, slot);
            return Ok(());
        }
        let arg = Box::into_raw(Box::new(f)) as *mut c_void;
        // SAFETY: `run_host_fn` takes back the box leaked above, once.
        let launched = unsafe { cu::stream::launch_host_function(s.cuda.cu_stream(), run_host_fn, arg) };
        if let Err(e) = launched {
            // SAFETY: the driver refused it, so nothing else owns the box.
            drop(unsafe { Box::from_raw(arg as *mut HostFn) });
            return Err(DeviceError::Backend(format!("enqueueing a host function: {e}")));
        }
        Ok(())
    }

    fn register_host(&self, src: &HostBytes) -> Result<(), DeviceError> {
        let bytes = src.as_slice();
        if bytes.is_empty() {
            return Ok(());
        }
        let key = (bytes.as_ptr() as usize, bytes.len());
        let mut registered = lock(&self.registered);
        if registered.contains_key(&key) {
            return Ok(());
        }
        self.bind()?;
        let flags = if self.read_only_register { sys::CU_MEMHOSTREGISTER_READ_ONLY } else { 0 };
        // SAFETY: the range is live host memory; a clone of `src` keeps its
        // owner alive until Drop unregisters it. The driver only pins it.
        match unsafe { sys::cuMemHostRegister_v2(key.0 as *mut c_void, key.1, flags) }.result() {
            Ok(()) => {
                registered.insert(key, src.clone());
                Ok(())
            }
            // Pinned already (by someone else, or as part of another range):
            // page-locked is all that was asked, and it is not ours to unpin.
            Err(DriverError(sys::CUresult::CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED)) => Ok(()),
            Err(e) => Err(DeviceError::Backend(format!("page-locking {} bytes of host memory: {e}", key.1))),
        }
    }

    fn begin_capture(&self, stream: StreamId) -> Result<(), DeviceError> {
        let s = self.stream(stream)?;
        self.bind()?;
        let mut captures = lock(&self.captures);
        if captures.origin_of.contains_key(&stream.0) {
            return Err(DeviceError::Invalid(format!("stream {} is already being captured", stream.0)));
        }
        // Thread-local: only this thread's calls that could implicitly
        // synchronize are refused while it captures (other threads of the
        // worker go on as they were).
        // SAFETY: a live stream of this context.
        unsafe { sys::cuStreamBeginCapture_v2(s.cuda.cu_stream(), sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL) }.result().map_err(backend("beginning a graph capture"))?;
        captures.origin_of.insert(stream.0, stream.0);
        captures.open.insert(stream.0, CudaCapture::default());
        Ok(())
    }

    fn end_capture(&self, stream: StreamId) -> Result<Graph, DeviceError> {
        let s = self.stream(stream)?;
        self.bind()?;
        let capture = {
            let mut captures = lock(&self.captures);
            let Some(capture) = captures.open.remove(&stream.0) else {
                return Err(DeviceError::Invalid(format!("stream {} began no capture", stream.0)));
            };
            captures.origin_of.retain(|_, origin| *origin != stream.0);
            capture
        };
        let mut graph: sys::CUgraph = std::ptr::null_mut();
        // SAFETY: the stream began a capture (above); the driver ends it
        // whatever happened, and hands back the graph or null.
        let ended = unsafe { sys::cuStreamEndCapture(s.cuda.cu_stream(), &mut graph) }.result();
        let graph = CudaGraph { ctx: self.ctx.clone(), graph, keep: capture.keep };
        if let Some(e) = capture.failure {
            return Err(e);
        }
        ended.map_err(|e| match e.0 {
            sys::CUresult::CUDA_ERROR_STREAM_CAPTURE_UNJOINED => DeviceError::Invalid(format!("streams forked from stream {} were not joined back before the capture ended", stream.0)),
            _ => DeviceError::Backend(format!("ending a graph capture: {e}")),
        })?;
        if graph.graph.is_null() {
            return Err(DeviceError::Backend("the driver ended the capture without a graph".into()));
        }
        Ok(Graph(Box::new(graph)))
    }

    fn launch_graph(&self, stream: StreamId, graph: Graph, exec: &mut Option<GraphExec>) -> Result<GraphLaunch, DeviceError> {
        let s = self.stream(stream)?;
        if self.capture_of(stream).is_some() {
            return Err(DeviceError::Invalid(format!("stream {} is being captured: a graph cannot run on it", stream.0)));
        }
        let mut graph = graph.0.downcast::<CudaGraph>().map_err(|_| DeviceError::Invalid("a graph of another device".into()))?;
        self.bind()?;
        let kept = exec.as_ref().and_then(|e| e.0.downcast_ref::<CudaExec>());
        let updated = match kept {
            Some(e) => {
                // SAFETY: zero is a valid value of this plain C struct.
                let mut info: sys::CUgraphExecUpdateResultInfo = unsafe { std::mem::zeroed() };
                // SAFETY: both handles are live; a failed update leaves
                // `e.exec` as it was (it is then replaced below).
                unsafe { sys::cuGraphExecUpdate_v2(e.exec, graph.graph, &mut info) }.result().is_ok()
            }
            None => false,
        };
        let launch = if updated {
            GraphLaunch::Updated
        } else {
            let mut handle: sys::CUgraphExec = std::ptr::null_mut();
            // SAFETY: a live graph; the executable graph is owned by `CudaExec`.
            unsafe { sys::cuGraphInstantiateWithFlags(&mut handle, graph.graph, 0) }.result().map_err(backend("instantiating a graph"))?;
            *exec = Some(GraphExec(Box::new(CudaExec { ctx: self.ctx.clone(), exec: handle })));
            GraphLaunch::Instantiated
        };
        let e = exec.as_ref().and_then(|e| e.0.downcast_ref::<CudaExec>()).expect("made or updated above");
        // SAFETY: a live executable graph and a live stream of this context.
        unsafe { sys::cuGraphLaunch(e.exec, s.cuda.cu_stream()) }.result().map_err(backend("launching a graph"))?;
        // What the captured copies and host functions use stays alive until the launch is done.
        let keep = std::mem::take(&mut graph.keep);
        self.keep_until_done(&s, None, Box::new(keep))?;
        Ok(launch)
    }
}

impl CudaDevice {
    /// Keep `what` (read or written by work just queued on `s`) alive until
    /// that work is done: by the capture, when `s` is being captured, else
    /// until an event recorded now completes.
    fn keep_until_done(&self, s: &Stream, capture: Option<usize>, what: Box<dyn Any + Send + Sync>) -> Result<(), DeviceError> {
        if let Some(origin) = capture {
            self.keep_for_capture(origin, what);
            return Ok(());
        }
        let done = s.cuda.record_event(None).map_err(backend("recording a copy's event"))?;
        lock(&s.in_flight).push_back((done, what));
        Ok(())
    }
}
