//! The device layer: one small, explicit interface to an accelerator.
//!
//! It has what stream-loading prefill (and later the device side of decode)
//! needs, in CUDA's terms: memory from an arena with a hard capacity, streams
//! that run their work in order, asynchronous host→device copies, events
//! that one stream (or the host) can wait for, host callbacks ordered on a
//! stream, and the model's kernel set as [`Op`]s over device memory.
//!
//! Backends:
//! - [`emulated`]: a CPU-backed accelerator with bounded memory, a copy
//!   engine whose bandwidth can be limited, and its own compute threads. It
//!   stands in for a GPU in tests and benchmarks, with the same semantics.
//! - `cuda` (cargo feature `cuda`): cudarc with dynamic loading, kernels in
//!   `kernels/cuda/` compiled by NVRTC at start-up.
//!
//! The third choice a worker has, the plain CPU engine, stages nothing and so
//! needs no device.
//!
//! Activations are F32 on the device; weights are copied in their stored
//! format (FP8 with F32 block scales, BF16, F16, F32) and every op reads
//! them as the CPU kernels do, so results match the CPU engine's.

pub mod arena;
pub mod emulated;
pub mod host_ops;
pub mod traced;
#[cfg(feature = "cuda")]
pub mod cuda;

pub use crate::gqa::GqaDims;
pub use crate::mla::MlaDims;
use crate::router::RouterParams;
use crate::{Precision, WeightFormat};
use std::any::Any;
use std::ops::Range;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

#[derive(Debug, thiserror::Error, Clone, PartialEq)]
pub enum DeviceError {
    #[error("device out of memory: {requested} bytes requested, {free} of {capacity} free (largest free block {largest})")]
    OutOfMemory { requested: usize, free: usize, largest: usize, capacity: usize },
    #[error("invalid device operation: {0}")]
    Invalid(String),
    #[error("no CUDA device: {0}")]
    Unavailable(String),
    #[error("device failure: {0}")]
    Backend(String),
}

/// A range of device memory. `addr` is whatever the backend addresses memory
/// with (an arena offset, a `CUdeviceptr`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct DevicePtr {
    pub addr: u64,
    pub bytes: usize,
}

impl DevicePtr {
    /// The `bytes` bytes at `offset` within this range.
    pub fn slice(self, offset: usize, bytes: usize) -> Result<DevicePtr, DeviceError> {
        match offset.checked_add(bytes) {
            Some(end) if end <= self.bytes => Ok(DevicePtr { addr: self.addr + offset as u64, bytes }),
            _ => Err(DeviceError::Invalid(format!("slice {offset}+{bytes} of a {}-byte buffer", self.bytes))),
        }
    }

    /// The whole range as a contiguous `[rows, cols]` F32 matrix.
    pub fn matrix(self, rows: usize, cols: usize) -> Matrix {
        Matrix { buf: self, offset: 0, rows, cols, stride: cols }
    }
}

/// A row-major F32 matrix in device memory: `rows × cols` floats starting
/// `offset` floats into `buf`, rows `stride` floats apart.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Matrix {
    pub buf: DevicePtr,
    pub offset: usize,
    pub rows: usize,
    pub cols: usize,
    pub stride: usize,
}

impl Matrix {
    /// Columns `cols` of every row.
    pub fn columns(self, cols: Range<usize>) -> Matrix {
        Matrix { offset: self.offset + cols.start, cols: cols.len(), ..self }
    }

    /// Rows `rows`.
    pub fn rows(self, rows: Range<usize>) -> Matrix {
        Matrix { offset: self.offset + rows.start * self.stride, rows: rows.len(), ..self }
    }

    /// The same floats seen as `rows × cols` (it must be contiguous).
    pub fn reshape(self, rows: usize, cols: usize) -> Matrix {
        Matrix { rows, cols, stride: cols, ..self }
    }

    pub fn is_contiguous(&self) -> bool {
        self.stride == self.cols || self.rows <= 1
    }

    /// Float index one past the last element read or written.
    fn end(&self) -> usize {
        if self.rows == 0 || self.cols == 0 {
            self.offset
        } else {
            self.offset + (self.rows - 1) * self.stride + self.cols
        }
    }

    fn check(&self, what: &str) -> Result<(), DeviceError> {
        if self.stride < self.cols && self.rows > 1 {
            return Err(DeviceError::Invalid(format!("{what}: stride {} is below its {} columns", self.stride, self.cols)));
        }
        if self.end().checked_mul(4).is_none_or(|b| b > self.buf.bytes) {
            return Err(DeviceError::Invalid(format!("{what}: a {}×{} matrix (stride {}, offset {}) overruns its {}-byte buffer", self.rows, self.cols, self.stride, self.offset, self.buf.bytes)));
        }
        Ok(())
    }

    /// The device byte range this matrix spans.
    fn span(&self) -> Range<u64> {
        self.buf.addr + self.offset as u64 * 4..self.buf.addr + self.end() as u64 * 4
    }
}

/// A weight matrix in device memory, in its stored format; `scales` holds
/// the FP8 block scales (F32, `[ceil(rows/b0), ceil(cols/b1)]`) and is empty
/// for other formats.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceWeight {
    pub data: DevicePtr,
    pub scales: DevicePtr,
    pub rows: usize,
    pub cols: usize,
    pub format: WeightFormat,
}

impl DeviceWeight {
    /// Rows `rows` of this weight. An FP8 slice must start on a scale block
    /// and end on one (or at the last row).
    pub fn rows(&self, rows: Range<usize>) -> Result<DeviceWeight, DeviceError> {
        if rows.start > rows.end || rows.end > self.rows {
            return Err(DeviceError::Invalid(format!("rows {rows:?} of a {}-row weight", self.rows)));
        }
        let row_bytes = self.format.row_bytes(self.cols);
        let data = self.data.slice(rows.start * row_bytes, rows.len() * row_bytes)?;
        let scales = match self.format {
            WeightFormat::Fp8E4m3 { block } => {
                if !rows.start.is_multiple_of(block[0]) || (!rows.end.is_multiple_of(block[0]) && rows.end != self.rows) {
                    return Err(DeviceError::Invalid(format!("rows {rows:?} split a {}-row FP8 scale block", block[0])));
                }
                let per_row = self.cols.div_ceil(block[1]) * 4;
                let first = rows.start / block[0];
                self.scales.slice(first * per_row, (rows.end.div_ceil(block[0]) - first) * per_row)?
            }
            _ => self.scales,
        };
        Ok(DeviceWeight { data, scales, rows: rows.len(), ..*self })
    }

    /// This weight with its data and its scales `data_bytes` and `scales_bytes` further on.
    pub fn shifted(&self, data_bytes: usize, scales_bytes: usize) -> DeviceWeight {
        let data = DevicePtr { addr: self.data.addr + data_bytes as u64, ..self.data };
        let scales = DevicePtr { addr: self.scales.addr + scales_bytes as u64, ..self.scales };
        DeviceWeight { data, scales, ..*self }
    }

    pub(crate) fn check(&self, what: &str) -> Result<(), DeviceError> {
        if let WeightFormat::Quant(kind) = self.format {
            // No device kernel reads ggml's blocks: GGUF block-quantized
            // models compute on the CPU placement.
            return Err(DeviceError::Invalid(format!("{what}: {kind} weights have no device kernels; GGUF block-quantized models run on the CPU (device = \"cpu\")")));
        }
        let bytes = self.rows.checked_mul(self.cols).and_then(|n| n.checked_mul(self.format.bytes_per_element()));
        if bytes != Some(self.data.bytes) {
            return Err(DeviceError::Invalid(format!("{what}: a {}×{} {:?} weight needs {:?} bytes, the buffer has {}", self.rows, self.cols, self.format, bytes, self.data.bytes)));
        }
        if let WeightFormat::Fp8E4m3 { block } = self.format {
            if block[0] == 0 || block[1] == 0 {
                return Err(DeviceError::Invalid(format!("{what}: zero FP8 block size")));
            }
            let scales = self.rows.div_ceil(block[0]) * self.cols.div_ceil(block[1]) * 4;
            if self.scales.bytes != scales {
                return Err(DeviceError::Invalid(format!("{what}: {} bytes of scales, {scales} expected", self.scales.bytes)));
            }
        }
        Ok(())
    }
}

/// A paged KV pool in device memory, laid out as the host's `KvPool`: block
/// `b`, layer `l` holds `block_size` entries of `entry_dim` F32 each,
/// starting `((b * n_layers + l) * block_size) * entry_dim` floats into
/// `pool`; position `p` of a sequence is slot `p % block_size` of block
/// `table[p / block_size]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PagedKv {
    pub pool: DevicePtr,
    pub n_layers: usize,
    pub block_size: usize,
    pub entry_dim: usize,
}

impl PagedKv {
    /// Bytes of one block (all its layers), if that fits in a `usize`.
    fn block_bytes(&self) -> Option<usize> {
        self.n_layers.checked_mul(self.block_size)?.checked_mul(self.entry_dim)?.checked_mul(4)
    }

    /// How many blocks the pool holds (0 if its geometry is degenerate).
    pub fn blocks(&self) -> usize {
        self.block_bytes().filter(|&b| b > 0).map_or(0, |b| self.pool.bytes / b)
    }

    /// Float offset into `pool` of slot `slot` of `layer` in block `block`.
    pub fn entry_offset(&self, block: usize, layer: usize, slot: usize) -> usize {
        ((block * self.n_layers + layer) * self.block_size + slot) * self.entry_dim
    }

    /// The pool's geometry is sound, `layer` is one of its layers, and
    /// `positions` fit in a table of `blocks` u32 ids at `table`.
    fn check(&self, table: &DevicePtr, blocks: usize, layer: usize, positions: Range<usize>, what: &str) -> Result<(), DeviceError> {
        let block_bytes = match self.block_bytes() {
            Some(b) if b > 0 => b,
            _ => return Err(DeviceError::Invalid(format!("{what}: a pool of {} layers × {} slots × {} floats has no usable block size", self.n_layers, self.block_size, self.entry_dim))),
        };
        if !self.pool.bytes.is_multiple_of(block_bytes) {
            return Err(DeviceError::Invalid(format!("{what}: a {}-byte pool is not a whole number of {block_bytes}-byte blocks", self.pool.bytes)));
        }
        if layer >= self.n_layers {
            return Err(DeviceError::Invalid(format!("{what}: layer {layer} of a {}-layer pool", self.n_layers)));
        }
        if blocks.checked_mul(4).is_none_or(|b| b > table.bytes) {
            return Err(DeviceError::Invalid(format!("{what}: {blocks} block ids overrun a {}-byte table", table.bytes)));
        }
        if blocks.checked_mul(self.block_size).is_none_or(|cap| positions.end > cap) {
            return Err(DeviceError::Invalid(format!("{what}: positions {positions:?} do not fit in {blocks} blocks of {}", self.block_size)));
        }
        Ok(())
    }

    fn span(&self) -> Range<u64> {
        self.pool.addr..self.pool.addr + self.pool.bytes as u64
    }
}

/// The kernel set a model needs on a device. `precision` picks the numeric
/// path exactly as the CPU engine's does: `F32` is the reference; `Bf16`
/// rounds inputs (and, where the op says so, outputs) to BF16.
#[derive(Clone, Debug)]
pub enum Op {
    /// `y = x · Wᵀ` (`x` is `[n, cols]`, `y` `[n, rows]`), FP8 post-scaled per
    /// 128-wide block; with `round`, `y` is rounded to BF16.
    Gemm { w: DeviceWeight, x: Matrix, y: Matrix, precision: Precision, round: bool },
    /// `count` products `y_b = x_b · W_bᵀ` in one launch, each as [`Op::Gemm`]:
    /// `w`, `x` and `y` are batch 0's; batch `b`'s weight data and scales lie
    /// `b · w_step` and `b · scales_step` bytes further on, its `x` and `y`
    /// `b · x_rows` and `b · y_rows` rows further down. (MLA's absorbed decode
    /// multiplies one small matrix per attention head: one launch for all
    /// heads instead of one each.)
    GemmBatched { w: DeviceWeight, w_step: usize, scales_step: usize, x: Matrix, x_rows: usize, y: Matrix, y_rows: usize, count: usize, precision: Precision, round: bool },
    /// RMSNorm of each row of `x` into `out` (BF16: rounded in the same pass).
    RmsNorm { x: Matrix, weight: DevicePtr, out: Matrix, eps: f32, precision: Precision },
    /// Rotary embedding in place on each row of `x` (each `dr` wide). Row `r`
    /// is at position `r / rows_per_position`; `cos` and `sin` are
    /// `[positions, dr/2]` tables for those positions.
    Rope { x: Matrix, cos: Matrix, sin: Matrix, rows_per_position: usize, interleaved: bool, precision: Precision },
    /// `gate = silu(gate) · up`, in place (BF16: rounded).
    SiluMul { gate: Matrix, up: Matrix, precision: Precision },
    /// `h += delta` (BF16: rounded).
    Add { h: Matrix, delta: Matrix, precision: Precision },
    /// Round every element to BF16.
    RoundBf16 { x: Matrix },
    /// Set every element to zero.
    Zero { x: Matrix },
    /// Router top-k of each row of `logits` (`[n, n_experts]`): chosen
    /// experts into `ids` (u32, `[n, top_k]`) and their weights into
    /// `weights` (`[n, top_k]`).
    Route { logits: Matrix, bias: Option<DevicePtr>, params: RouterParams, ids: DevicePtr, weights: Matrix, precision: Precision },
    /// `dst[i] = src[rows[i]]` for `count` u32 row indices.
    GatherRows { src: Matrix, rows: DevicePtr, count: usize, dst: Matrix },
    /// `dst[rows[i]] += scales[i] · src[i]` for `count` indices (no two equal).
    ScatterAddRows { src: Matrix, rows: DevicePtr, scales: DevicePtr, count: usize, dst: Matrix },
    /// Rows `first_row..first_row + table.rows` of an embedding table: every
    /// token whose id (u32, `count` of them) falls there gets its row decoded
    /// into `out` (BF16: rounded).
    Embedding { table: DeviceWeight, first_row: usize, ids: DevicePtr, count: usize, out: Matrix, precision: Precision },
    /// MLA in the expanded (prefill) form, causal. `q` is `[n, heads·(dn+dr)]`
    /// for positions `start..start+n`; `kv` is `kv_b_proj` of the context's
    /// latents, `[ctx, heads·(dn+dv)]`; `latents` is `[ctx, dc+dr]` (the rope
    /// key is columns `dc..`); `out` is `[n, heads·dv]` (BF16: rounded).
    MlaPrefill { q: Matrix, kv: Matrix, latents: Matrix, out: Matrix, start: usize, dims: MlaDims, scale: f32, precision: Precision },
    /// MLA in the absorbed (decode) form for one token over `ctx` latents:
    /// `q_latent` `[heads, dc]`, `q_pe` `[heads, dr]`, `latents` `[ctx, dc+dr]`;
    /// `out` `[heads, dc]` is the attention-weighted sum of latents.
    MlaDecode { q_latent: Matrix, q_pe: Matrix, latents: Matrix, out: Matrix, scale: f32, precision: Precision },
    /// Grouped-query attention, causal: `q` is `[n, heads·head_dim]` for
    /// positions `start..start+n`; `k` and `v` are `[ctx, kv_heads·head_dim]`
    /// with `ctx ≥ start + n` (rows past `start + n` are not read); query row
    /// `i` attends to positions `0..=start+i`, head `h` to kv head
    /// `h / (heads / kv_heads)`. `out` is `[n, heads·head_dim]` (BF16: rounded).
    GqaAttention { q: Matrix, k: Matrix, v: Matrix, out: Matrix, start: usize, dims: GqaDims, scale: f32, precision: Precision },
    /// MLA in the expanded form over keys at positions `key_start..key_start + kv.rows`
    /// (`kv` `[rows, heads·(dn+dv)]`, `latents` `[rows, dc+dr]` for the same positions):
    /// query row i (position start + i) attends the keys at positions ≤ start + i.
    /// `out` `[n, heads·dv]` gets the softmax-weighted values over those keys, F32
    /// unrounded whatever the precision, and `lse` `[n, heads]` their log-sum-exp
    /// ln Σ exp(score) (natural log of the scaled scores); a row that sees no key gets
    /// zeros and −∞. With `precision` Bf16 the scores use q and the keys (k_nope,
    /// k_pe) rounded to BF16, as MlaPrefill's BF16 path does; the values are
    /// weighed as given in F32 (as there too). Pieces of one causal attention
    /// merged with [`Op::AttentionMerge`] give that attention (Pass-KV context
    /// parallelism: each rank attends its queries to the keys it holds or receives).
    MlaPrefillPart { q: Matrix, kv: Matrix, latents: Matrix, out: Matrix, lse: Matrix, start: usize, key_start: usize, dims: MlaDims, scale: f32, precision: Precision },
    /// Grouped-query attention likewise: `k` and `v` `[rows, kv_heads·head_dim]` at
    /// positions `key_start..`; `out` `[n, heads·head_dim]` F32, `lse` `[n, heads]`.
    /// BF16 rounds q and the keys, as GqaAttention's BF16 path does.
    GqaAttentionPart { q: Matrix, k: Matrix, v: Matrix, out: Matrix, lse: Matrix, start: usize, key_start: usize, dims: GqaDims, scale: f32, precision: Precision },
    /// Merge a partial attention result into an accumulated one, per row and head
    /// (`out`, `part` `[n, heads·d]`, `lse`, `part_lse` `[n, heads]`): with
    /// m = max(lse, part_lse), a = exp(lse − m), b = exp(part_lse − m):
    /// out = (a·out + b·part) / (a + b), lse = m + ln(a + b); both −∞ leaves the row as is.
    /// A side whose weight is exactly zero contributes nothing (so an
    /// accumulator at −∞ may hold anything, even NaN: it becomes `part`).
    AttentionMerge { out: Matrix, lse: Matrix, part: Matrix, part_lse: Matrix, heads: usize },
    /// Write `entries` (`[n, entry_dim]`) at positions `start..start+n` of
    /// `layer` of the sequence whose blocks are the `blocks` u32 ids at
    /// `table`. A block id past the pool is a fault when the op runs (see
    /// the backends), never a write out of the pool.
    KvStore { entries: Matrix, kv: PagedKv, table: DevicePtr, blocks: usize, layer: usize, start: usize },
    /// Read positions `0..out.rows` of `layer` of that sequence into `out`
    /// (`[len, entry_dim]`, may be a strided view).
    KvGather { kv: PagedKv, table: DevicePtr, blocks: usize, layer: usize, out: Matrix },
}

/// Which work a stream is meant for. Both run anything in order; the
/// emulated device routes copies through its copy engine either way.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StreamKind {
    Compute,
    Copy,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct StreamId(pub usize);

/// A point on a stream's timeline, completed when the stream gets there.
#[derive(Clone)]
pub struct Event(pub(crate) Arc<dyn Any + Send + Sync>);

impl Event {
    /// An event of a backend outside this crate (the simulator's).
    pub fn new(state: Arc<dyn Any + Send + Sync>) -> Event {
        Event(state)
    }

    /// The backend's state of this event, if it is of type `T`.
    pub fn downcast<T: Any + Send + Sync>(&self) -> Option<Arc<T>> {
        self.0.clone().downcast::<T>().ok()
    }
}

impl std::fmt::Debug for Event {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Event")
    }
}

/// Work captured from streams ([`Device::begin_capture`]), to run once
/// with [`Device::launch_graph`]; the backend's own representation.
pub struct Graph(pub(crate) Box<dyn Any + Send>);

/// A graph made executable, kept to run later graphs of the same shape
/// ([`Device::launch_graph`]); the backend's own representation.
pub struct GraphExec(pub(crate) Box<dyn Any + Send>);

impl std::fmt::Debug for Graph {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Graph")
    }
}

impl std::fmt::Debug for GraphExec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("GraphExec")
    }
}

/// How [`Device::launch_graph`] got its executable graph.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GraphLaunch {
    /// Made anew: the first graph of its shape, or one whose shape differs.
    Instantiated,
    /// The kept one, updated in place to the new graph's parameters.
    Updated,
}

/// Host memory a copy reads from. It holds its owner, so the memory stays
/// alive until the asynchronous copy has run.
#[derive(Clone)]
pub struct HostBytes {
    owner: Arc<dyn AsRef<[u8]> + Send + Sync>,
    range: Range<usize>,
}

impl HostBytes {
    /// `range` of `owner`'s bytes.
    pub fn new(owner: Arc<dyn AsRef<[u8]> + Send + Sync>, range: Range<usize>) -> Result<Self, DeviceError> {
        let len = (*owner).as_ref().len();
        if range.start > range.end || range.end > len {
            return Err(DeviceError::Invalid(format!("host range {range:?} of a {len}-byte buffer")));
        }
        Ok(HostBytes { owner, range })
    }

    pub fn from_vec(bytes: Vec<u8>) -> Self {
        let len = bytes.len();
        HostBytes { owner: Arc::new(bytes), range: 0..len }
    }

    pub fn from_f32(xs: &[f32]) -> Self {
        Self::from_vec(xs.iter().flat_map(|x| x.to_le_bytes()).collect())
    }

    pub fn from_u32(xs: &[u32]) -> Self {
        Self::from_vec(xs.iter().flat_map(|x| x.to_le_bytes()).collect())
    }

    pub fn as_slice(&self) -> &[u8] {
        &(*self.owner).as_ref()[self.range.clone()]
    }

    /// All of the owner's bytes (to page-lock a whole mapping once).
    pub fn whole(&self) -> HostBytes {
        HostBytes { owner: self.owner.clone(), range: 0..(*self.owner).as_ref().len() }
    }

    pub fn same_owner(&self, other: &HostBytes) -> bool {
        Arc::ptr_eq(&self.owner, &other.owner)
    }

    pub fn len(&self) -> usize {
        self.range.len()
    }

    pub fn is_empty(&self) -> bool {
        self.range.is_empty()
    }
}

/// Host memory that a stream's copies fill and drain asynchronously,
/// page-locked where that matters (a GPU's copy engines reach it directly).
/// Host code takes its bytes with [`Staging::lock`] only from work ordered
/// after the copies that touch it — a host function later on the same
/// stream, or after an event — because a copy in flight does not take the
/// lock: the stream's order is what keeps them apart.
pub struct Staging {
    bytes: Mutex<Box<[u8]>>,
    /// Where the bytes are (they never move), for a copy engine.
    addr: usize,
    /// Undoes the backend's page-locking when the memory goes.
    unpin: Mutex<Option<Box<dyn FnOnce() + Send>>>,
}

impl Staging {
    /// `len` zeroed bytes of plain host memory.
    pub fn new(len: usize) -> Staging {
        let mut bytes = vec![0u8; len].into_boxed_slice();
        let addr = bytes.as_mut_ptr() as usize;
        Staging { bytes: Mutex::new(bytes), addr, unpin: Mutex::new(None) }
    }

    pub fn len(&self) -> usize {
        self.lock().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The bytes, for host code ordered after the copies that touch them.
    pub fn lock(&self) -> MutexGuard<'_, Box<[u8]>> {
        self.bytes.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The address of byte `offset` of a range of `bytes` (checked), for a backend's copy engine.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn addr(&self, offset: usize, bytes: usize) -> Result<usize, DeviceError> {
        self.check(offset, bytes)?;
        Ok(self.addr + offset)
    }

    fn check(&self, offset: usize, bytes: usize) -> Result<(), DeviceError> {
        let len = self.len();
        match offset.checked_add(bytes) {
            Some(end) if end <= len => Ok(()),
            _ => Err(DeviceError::Invalid(format!("bytes {offset}+{bytes} of a {len}-byte staging buffer"))),
        }
    }

    /// Run `unpin` when the memory goes (a backend that page-locked it).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn on_drop(&self, unpin: Box<dyn FnOnce() + Send>) {
        *self.unpin.lock().unwrap_or_else(|e| e.into_inner()) = Some(unpin);
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        if let Some(unpin) = self.unpin.get_mut().unwrap_or_else(|e| e.into_inner()).take() {
            unpin();
        }
    }
}

impl std::fmt::Debug for Staging {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Staging({} bytes)", self.len())
    }
}

/// An accelerator. Every method is callable from any thread; work on one
/// stream runs in the order it was enqueued, work on different streams in
/// any order unless events order it.
pub trait Device: Send + Sync {
    /// What this device is, for logs.
    fn describe(&self) -> String;
    /// Bytes of device memory this device may use in all.
    fn capacity(&self) -> usize;
    /// Bytes not allocated now.
    fn free_bytes(&self) -> usize;
    fn alloc(&self, bytes: usize) -> Result<DevicePtr, DeviceError>;
    /// Give back an allocation. Work still queued that uses it must have
    /// completed (wait for an event first), as with `cudaFree`.
    fn free(&self, ptr: DevicePtr) -> Result<(), DeviceError>;
    fn create_stream(&self, kind: StreamKind) -> Result<StreamId, DeviceError>;
    /// Copy `src` to `dst` (same length) after the stream's earlier work; returns at once.
    fn upload(&self, stream: StreamId, src: &HostBytes, dst: DevicePtr) -> Result<(), DeviceError>;
    /// Copy `src` back to the host after the stream's earlier work, and wait for it.
    fn download(&self, stream: StreamId, src: DevicePtr) -> Result<Vec<u8>, DeviceError>;
    /// Host memory for [`Device::download_to`] and [`Device::upload_from`],
    /// page-locked where the backend needs that for copies to be asynchronous.
    fn staging(&self, bytes: usize) -> Result<Arc<Staging>, DeviceError> {
        Ok(Arc::new(Staging::new(bytes)))
    }
    /// Copy `src` into `dst` at `offset` after the stream's earlier work;
    /// returns at once (read it from work ordered after this copy).
    fn download_to(&self, stream: StreamId, src: DevicePtr, dst: &Arc<Staging>, offset: usize) -> Result<(), DeviceError>;
    /// Copy `dst.bytes` bytes of `src` at `offset` into `dst` after the
    /// stream's earlier work (a host function may have written them); returns at once.
    fn upload_from(&self, stream: StreamId, src: &Arc<Staging>, offset: usize, dst: DevicePtr) -> Result<(), DeviceError>;
    /// Enqueue a kernel. Shapes and bounds are checked here.
    fn launch(&self, stream: StreamId, op: &Op) -> Result<(), DeviceError>;
    /// An event completed when the stream reaches this point.
    fn record(&self, stream: StreamId) -> Result<Event, DeviceError>;
    /// Make the stream's later work wait until `event` completes.
    fn wait_event(&self, stream: StreamId, event: &Event) -> Result<(), DeviceError>;
    /// Whether `event` has completed; an error if the device has failed
    /// (its streams may then never get there).
    fn query(&self, event: &Event) -> Result<bool, DeviceError>;
    /// Block the calling thread until `event` completes.
    fn synchronize(&self, event: &Event) -> Result<(), DeviceError>;
    /// Time from `from` to `to`, both completed; zero if `to` came first.
    fn elapsed(&self, from: &Event, to: &Event) -> Result<Duration, DeviceError>;
    /// Run `f` on the host when the stream reaches this point; the stream's
    /// later work waits for it.
    fn host_fn(&self, stream: StreamId, f: Box<dyn FnOnce() + Send>) -> Result<(), DeviceError>;
    /// Page-lock `src`'s memory so copies from it run at full speed (a no-op
    /// where that means nothing).
    fn register_host(&self, src: &HostBytes) -> Result<(), DeviceError>;
    /// Record `stream`'s work from now on into a graph instead of running
    /// it (CUDA's stream capture). Another stream joins the capture by
    /// waiting on an event recorded on a capturing stream, and must be
    /// joined back (`stream` waits on an event recorded on it after its
    /// last captured work) before the capture ends. While capturing, no
    /// host call may wait for captured work (`download`, or `query`,
    /// `synchronize` or `elapsed` of an event recorded in the capture), a
    /// capturing stream may not wait on an event from outside it, and
    /// copies come from [`Staging`] only (a graph keeps no [`HostBytes`]).
    /// A capture that fails is discarded by [`Device::end_capture`], which
    /// must be called either way.
    fn begin_capture(&self, stream: StreamId) -> Result<(), DeviceError> {
        let _ = stream;
        Err(DeviceError::Invalid(format!("{} cannot capture graphs", self.describe())))
    }
    /// End the capture begun on `stream`: the recorded work, or why the
    /// capture failed (its work is then discarded and never runs).
    fn end_capture(&self, stream: StreamId) -> Result<Graph, DeviceError> {
        let _ = stream;
        Err(DeviceError::Invalid(format!("{} cannot capture graphs", self.describe())))
    }
    /// Run `graph` on `stream`: after the stream's earlier work, and before
    /// its later work, which waits for the whole graph. It runs through
    /// `exec`, the executable graph kept for work of this shape: updated in
    /// place when `graph` has the shape it was made for (CUDA's
    /// `cuGraphExecUpdate`: cheap), else made anew (instantiated).
    fn launch_graph(&self, stream: StreamId, graph: Graph, exec: &mut Option<GraphExec>) -> Result<GraphLaunch, DeviceError> {
        let _ = (stream, graph, exec);
        Err(DeviceError::Invalid(format!("{} cannot run graphs", self.describe())))
    }
    /// Time the device has spent computing so far, where it keeps count
    /// (the emulated device does; a GPU's overlapping streams have no one
    /// such figure).
    fn compute_busy(&self) -> Option<Duration> {
        None
    }
}

/// Open CUDA device `ordinal` with `memory_mib` MiB of its memory (0: 90%
/// of what is free), or say why not.
pub fn open_cuda(ordinal: usize, memory_mib: usize) -> Result<Arc<dyn Device>, DeviceError> {
    #[cfg(feature = "cuda")]
    {
        let bytes = match memory_mib {
            0 => cuda::CudaDevice::free_memory(ordinal)? / 10 * 9,
            mib => mib << 20,
        };
        Ok(cuda::CudaDevice::open(ordinal, bytes)?)
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (ordinal, memory_mib);
        Err(DeviceError::Unavailable("this build has no CUDA support (build with the cargo feature `cuda`)".into()))
    }
}

/// Upload F32 values into `dst` (which they must fill).
pub fn upload_f32(device: &dyn Device, stream: StreamId, xs: &[f32], dst: DevicePtr) -> Result<(), DeviceError> {
    device.upload(stream, &HostBytes::from_f32(xs), dst)
}

pub fn upload_u32(device: &dyn Device, stream: StreamId, xs: &[u32], dst: DevicePtr) -> Result<(), DeviceError> {
    device.upload(stream, &HostBytes::from_u32(xs), dst)
}

/// Download a matrix's floats, row by row.
pub fn download_matrix(device: &dyn Device, stream: StreamId, m: Matrix) -> Result<Vec<f32>, DeviceError> {
    m.check("download")?;
    let span = m.span();
    let bytes = device.download(stream, DevicePtr { addr: span.start, bytes: (span.end - span.start) as usize })?;
    let floats: Vec<f32> = bytes.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
    Ok((0..m.rows).flat_map(|r| floats[r * m.stride..r * m.stride + m.cols].iter().copied()).collect())
}

pub fn download_u32(device: &dyn Device, stream: StreamId, src: DevicePtr) -> Result<Vec<u32>, DeviceError> {
    Ok(device.download(stream, src)?.chunks_exact(4).map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect())
}

fn overlaps(a: &Range<u64>, b: &Range<u64>) -> bool {
    a.start < b.end && b.start < a.end
}

impl Op {
    /// The op's kind, for traces and cost reports.
    pub fn name(&self) -> &'static str {
        match self {
            Op::Gemm { .. } => "gemm",
            Op::GemmBatched { .. } => "gemm_batched",
            Op::RmsNorm { .. } => "rms_norm",
            Op::Rope { .. } => "rope",
            Op::SiluMul { .. } => "silu_mul",
            Op::Add { .. } => "add",
            Op::RoundBf16 { .. } => "round_bf16",
            Op::Zero { .. } => "zero",
            Op::Route { .. } => "route",
            Op::GatherRows { .. } => "gather_rows",
            Op::ScatterAddRows { .. } => "scatter_add_rows",
            Op::Embedding { .. } => "embedding",
            Op::MlaPrefill { .. } => "mla_prefill",
            Op::MlaDecode { .. } => "mla_decode",
            Op::GqaAttention { .. } => "gqa_attention",
            Op::MlaPrefillPart { .. } => "mla_prefill_part",
            Op::GqaAttentionPart { .. } => "gqa_attention_part",
            Op::AttentionMerge { .. } => "attention_merge",
            Op::KvStore { .. } => "kv_store",
            Op::KvGather { .. } => "kv_gather",
        }
    }

    /// Check shapes and bounds, and that no output overlaps an input it is
    /// not meant to update in place.
    pub fn validate(&self) -> Result<(), DeviceError> {
        let bad = |m: String| Err(DeviceError::Invalid(m));
        let u32s = |p: &DevicePtr, n: usize, what: &str| -> Result<(), DeviceError> {
            if n.checked_mul(4).is_none_or(|b| b > p.bytes) {
                return Err(DeviceError::Invalid(format!("{what}: {n} u32 values overrun a {}-byte buffer", p.bytes)));
            }
            Ok(())
        };
        let disjoint = |out: &Matrix, inputs: &[&Matrix], what: &str| -> Result<(), DeviceError> {
            for i in inputs {
                if overlaps(&out.span(), &i.span()) {
                    return Err(DeviceError::Invalid(format!("{what}: the output overlaps an input")));
                }
            }
            Ok(())
        };
        match self {
            Op::Gemm { w, x, y, .. } => {
                w.check("gemm weight")?;
                x.check("gemm x")?;
                y.check("gemm y")?;
                if x.cols != w.cols || y.cols != w.rows || x.rows != y.rows {
                    return bad(format!("gemm: x {}×{}, W {}×{}, y {}×{}", x.rows, x.cols, w.rows, w.cols, y.rows, y.cols));
                }
                disjoint(y, &[x], "gemm")
            }
            Op::GemmBatched { w, x, x_rows, y, y_rows, count, .. } => {
                w.check("batched gemm weight")?;
                if *count == 0 || x.cols != w.cols || y.cols != w.rows || x.rows != y.rows || *x_rows < x.rows || *y_rows < y.rows {
                    return bad(format!("batched gemm: {count} × (x {}×{} every {x_rows} rows, W {}×{}, y {}×{} every {y_rows} rows)", x.rows, x.cols, w.rows, w.cols, y.rows, y.cols));
                }
                // Every batch's rows, at once: all must lie in their buffers,
                // and no output may overlap an input.
                let all = |m: &Matrix, step: usize| (count - 1).checked_mul(step).and_then(|r| r.checked_add(m.rows)).map(|rows| Matrix { rows, ..*m });
                let (Some(xs), Some(ys)) = (all(x, *x_rows), all(y, *y_rows)) else {
                    return bad(format!("batched gemm: {count} batches overflow"));
                };
                xs.check("batched gemm x")?;
                ys.check("batched gemm y")?;
                disjoint(&ys, &[&xs], "batched gemm")
            }
            Op::RmsNorm { x, weight, out, .. } => {
                x.check("rms_norm x")?;
                out.check("rms_norm out")?;
                if x.rows != out.rows || x.cols != out.cols || weight.bytes != x.cols * 4 {
                    return bad(format!("rms_norm: x {}×{}, out {}×{}, weight {} bytes", x.rows, x.cols, out.rows, out.cols, weight.bytes));
                }
                if x.span() != out.span() {
                    disjoint(out, &[x], "rms_norm")?;
                }
                Ok(())
            }
            Op::Rope { x, cos, sin, rows_per_position, .. } => {
                x.check("rope x")?;
                cos.check("rope cos")?;
                sin.check("rope sin")?;
                let positions = x.rows.div_ceil((*rows_per_position).max(1));
                if *rows_per_position == 0 || x.cols % 2 != 0 || cos.cols * 2 != x.cols || sin.cols != cos.cols || cos.rows < positions || sin.rows < positions {
                    return bad(format!("rope: x {}×{} with {rows_per_position} rows a position, cos {}×{}, sin {}×{}", x.rows, x.cols, cos.rows, cos.cols, sin.rows, sin.cols));
                }
                disjoint(x, &[cos, sin], "rope")
            }
            Op::SiluMul { gate, up, .. } => {
                gate.check("silu gate")?;
                up.check("silu up")?;
                if gate.rows != up.rows || gate.cols != up.cols {
                    return bad("silu_mul: gate and up differ in shape".into());
                }
                disjoint(gate, &[up], "silu_mul")
            }
            Op::Add { h, delta, .. } => {
                h.check("add h")?;
                delta.check("add delta")?;
                if h.rows != delta.rows || h.cols != delta.cols {
                    return bad("add: shapes differ".into());
                }
                disjoint(h, &[delta], "add")
            }
            Op::RoundBf16 { x } | Op::Zero { x } => x.check("elementwise"),
            Op::Route { logits, bias, params, ids, weights, .. } => {
                logits.check("route logits")?;
                weights.check("route weights")?;
                u32s(ids, logits.rows * params.top_k, "route ids")?;
                let groups_ok = params.n_group > 0 && params.n_experts % params.n_group == 0 && params.topk_group >= 1 && params.topk_group <= params.n_group;
                if logits.cols != params.n_experts || weights.rows != logits.rows || weights.cols != params.top_k || params.top_k == 0 || params.top_k > params.n_experts || !groups_ok {
                    return bad(format!("route: logits {}×{} for {} experts, top {} in {} groups ({} kept), weights {}×{}", logits.rows, logits.cols, params.n_experts, params.top_k, params.n_group, params.topk_group, weights.rows, weights.cols));
                }
                if bias.is_some_and(|b| b.bytes != params.n_experts * 4) {
                    return bad("route: the bias is not one F32 per expert".into());
                }
                disjoint(weights, &[logits], "route")
            }
            Op::GatherRows { src, rows, count, dst } => {
                src.check("gather src")?;
                dst.check("gather dst")?;
                u32s(rows, *count, "gather rows")?;
                if dst.rows < *count || dst.cols != src.cols {
                    return bad(format!("gather: {count} rows of width {} into {}×{}", src.cols, dst.rows, dst.cols));
                }
                disjoint(dst, &[src], "gather")
            }
            Op::ScatterAddRows { src, rows, scales, count, dst } => {
                src.check("scatter src")?;
                dst.check("scatter dst")?;
                u32s(rows, *count, "scatter rows")?;
                u32s(scales, *count, "scatter scales")?;
                if src.rows < *count || dst.cols != src.cols {
                    return bad(format!("scatter: {count} rows of width {} into width {}", src.cols, dst.cols));
                }
                disjoint(dst, &[src], "scatter")
            }
            Op::Embedding { table, ids, count, out, .. } => {
                table.check("embedding table")?;
                out.check("embedding out")?;
                u32s(ids, *count, "embedding ids")?;
                if out.rows < *count || out.cols != table.cols {
                    return bad(format!("embedding: {count} rows of width {} into {}×{}", table.cols, out.rows, out.cols));
                }
                Ok(())
            }
            Op::MlaPrefill { q, kv, latents, out, start, dims, .. } => {
                for (m, what) in [(q, "mla q"), (kv, "mla kv"), (latents, "mla latents"), (out, "mla out")] {
                    m.check(what)?;
                }
                let d = dims;
                let ctx = start + q.rows;
                if d.heads == 0 || q.cols != d.heads * (d.dn + d.dr) || kv.cols != d.heads * (d.dn + d.dv) || latents.cols != d.dc + d.dr || kv.rows < ctx || latents.rows < ctx || out.rows != q.rows || out.cols != d.heads * d.dv {
                    return bad(format!("mla_prefill: q {}×{}, kv {}×{}, latents {}×{}, out {}×{} for {d:?} at start {start}", q.rows, q.cols, kv.rows, kv.cols, latents.rows, latents.cols, out.rows, out.cols));
                }
                disjoint(out, &[q, kv, latents], "mla_prefill")
            }
            Op::MlaDecode { q_latent, q_pe, latents, out, .. } => {
                for (m, what) in [(q_latent, "mla q_latent"), (q_pe, "mla q_pe"), (latents, "mla latents"), (out, "mla out")] {
                    m.check(what)?;
                }
                let (heads, dc) = (q_latent.rows, q_latent.cols);
                if heads == 0 || q_pe.rows != heads || latents.cols != dc + q_pe.cols || latents.rows == 0 || out.rows != heads || out.cols != dc {
                    return bad(format!("mla_decode: q_latent {}×{}, q_pe {}×{}, latents {}×{}, out {}×{}", heads, dc, q_pe.rows, q_pe.cols, latents.rows, latents.cols, out.rows, out.cols));
                }
                disjoint(out, &[q_latent, q_pe, latents], "mla_decode")
            }
            Op::GqaAttention { q, k, v, out, start, dims, .. } => {
                for (m, what) in [(q, "gqa q"), (k, "gqa k"), (v, "gqa v"), (out, "gqa out")] {
                    m.check(what)?;
                }
                dims.check().map_err(|e| DeviceError::Invalid(format!("gqa_attention: {e}")))?;
                let (q_width, kv_width) = (dims.heads.checked_mul(dims.head_dim), dims.kv_heads.checked_mul(dims.head_dim));
                let ctx = start.checked_add(q.rows);
                let fits = |m: &Matrix| ctx.is_some_and(|ctx| m.rows >= ctx);
                if q_width != Some(q.cols) || kv_width != Some(k.cols) || kv_width != Some(v.cols) || !fits(k) || !fits(v) || out.rows != q.rows || out.cols != q.cols {
                    return bad(format!("gqa_attention: q {}×{}, k {}×{}, v {}×{}, out {}×{} for {dims:?} at start {start}", q.rows, q.cols, k.rows, k.cols, v.rows, v.cols, out.rows, out.cols));
                }
                disjoint(out, &[q, k, v], "gqa_attention")
            }
            Op::MlaPrefillPart { q, kv, latents, out, lse, start, key_start, dims: d, .. } => {
                for (m, what) in [(q, "mla_part q"), (kv, "mla_part kv"), (latents, "mla_part latents"), (out, "mla_part out"), (lse, "mla_part lse")] {
                    m.check(what)?;
                }
                let width = |a: usize, b: usize| d.heads.checked_mul(a.saturating_add(b));
                let ends = start.checked_add(q.rows).is_some() && key_start.checked_add(kv.rows).is_some();
                if d.heads == 0 || !ends || width(d.dn, d.dr) != Some(q.cols) || width(d.dn, d.dv) != Some(kv.cols) || latents.cols != d.dc.saturating_add(d.dr) || latents.rows != kv.rows || out.rows != q.rows || width(d.dv, 0) != Some(out.cols) || lse.rows != q.rows || lse.cols != d.heads {
                    return bad(format!("mla_prefill_part: q {}×{}, kv {}×{}, latents {}×{}, out {}×{}, lse {}×{} for {d:?}, queries at {start}, keys at {key_start}", q.rows, q.cols, kv.rows, kv.cols, latents.rows, latents.cols, out.rows, out.cols, lse.rows, lse.cols));
                }
                disjoint(out, &[q, kv, latents, lse], "mla_prefill_part")?;
                disjoint(lse, &[q, kv, latents], "mla_prefill_part lse")
            }
            Op::GqaAttentionPart { q, k, v, out, lse, start, key_start, dims, .. } => {
                for (m, what) in [(q, "gqa_part q"), (k, "gqa_part k"), (v, "gqa_part v"), (out, "gqa_part out"), (lse, "gqa_part lse")] {
                    m.check(what)?;
                }
                dims.check().map_err(|e| DeviceError::Invalid(format!("gqa_attention_part: {e}")))?;
                let (q_width, kv_width) = (dims.heads.checked_mul(dims.head_dim), dims.kv_heads.checked_mul(dims.head_dim));
                let ends = start.checked_add(q.rows).is_some() && key_start.checked_add(k.rows).is_some();
                if !ends || q_width != Some(q.cols) || kv_width != Some(k.cols) || kv_width != Some(v.cols) || v.rows != k.rows || out.rows != q.rows || out.cols != q.cols || lse.rows != q.rows || lse.cols != dims.heads {
                    return bad(format!("gqa_attention_part: q {}×{}, k {}×{}, v {}×{}, out {}×{}, lse {}×{} for {dims:?}, queries at {start}, keys at {key_start}", q.rows, q.cols, k.rows, k.cols, v.rows, v.cols, out.rows, out.cols, lse.rows, lse.cols));
                }
                disjoint(out, &[q, k, v, lse], "gqa_attention_part")?;
                disjoint(lse, &[q, k, v], "gqa_attention_part lse")
            }
            Op::AttentionMerge { out, lse, part, part_lse, heads } => {
                for (m, what) in [(out, "merge out"), (lse, "merge lse"), (part, "merge part"), (part_lse, "merge part_lse")] {
                    m.check(what)?;
                }
                if *heads == 0 || !out.cols.is_multiple_of(*heads) || part.rows != out.rows || part.cols != out.cols || lse.rows != out.rows || lse.cols != *heads || part_lse.rows != out.rows || part_lse.cols != *heads {
                    return bad(format!("attention_merge: out {}×{}, part {}×{}, lse {}×{}, part_lse {}×{} for {heads} heads", out.rows, out.cols, part.rows, part.cols, lse.rows, lse.cols, part_lse.rows, part_lse.cols));
                }
                // Both outputs are updated in place; neither may overlap the other or the part.
                disjoint(out, &[lse, part, part_lse], "attention_merge")?;
                disjoint(lse, &[part, part_lse], "attention_merge lse")
            }
            Op::KvStore { entries, kv, table, blocks, layer, start } => {
                entries.check("kv_store entries")?;
                let end = start.checked_add(entries.rows).ok_or_else(|| DeviceError::Invalid(format!("kv_store: {} entries at position {start}", entries.rows)))?;
                kv.check(table, *blocks, *layer, *start..end, "kv_store")?;
                if entries.cols != kv.entry_dim {
                    return bad(format!("kv_store: entries {}×{} for a pool of {}-float entries", entries.rows, entries.cols, kv.entry_dim));
                }
                let table_span = table.addr..table.addr + *blocks as u64 * 4;
                if overlaps(&entries.span(), &table_span) || overlaps(&entries.span(), &kv.span()) || overlaps(&kv.span(), &table_span) {
                    return bad("kv_store: the entries, the block table and the pool must not overlap".into());
                }
                Ok(())
            }
            Op::KvGather { kv, table, blocks, layer, out } => {
                out.check("kv_gather out")?;
                kv.check(table, *blocks, *layer, 0..out.rows, "kv_gather")?;
                if out.cols != kv.entry_dim {
                    return bad(format!("kv_gather: out {}×{} for a pool of {}-float entries", out.rows, out.cols, kv.entry_dim));
                }
                let table_span = table.addr..table.addr + *blocks as u64 * 4;
                if overlaps(&out.span(), &table_span) || overlaps(&out.span(), &kv.span()) {
                    return bad("kv_gather: the output overlaps the block table or the pool".into());
                }
                Ok(())
            }
        }
    }
}
