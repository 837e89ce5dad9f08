//! `Op::KvStore` and `Op::KvGather` on the emulated device: a paged KV pool
//! in device memory laid out as the host's `KvPool`, written and read back
//! through block tables; a bad block id is a clear, sticky fault;
//! validation refuses inconsistent shapes.

use duplex_kernels::device::emulated::{EmulatedConfig, EmulatedDevice};
use duplex_kernels::device::{download_matrix, upload_f32, upload_u32, Device, DeviceError, DevicePtr, Op, PagedKv, StreamId, StreamKind};
use std::sync::Arc;

const N_LAYERS: usize = 3;
const BLOCK_SIZE: usize = 4;
const ENTRY_DIM: usize = 5;
const POOL_BLOCKS: usize = 12;

/// xorshift64: reproducible inputs without a dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn f32s(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| (self.next() % 20001) as f32 / 1000.0 - 10.0).collect()
    }
}

/// The host pool's layout, written out independently of the device code:
/// block b, layer l, slot s starts at float ((b·L + l)·B + s)·E.
struct Reference {
    pool: Vec<f32>,
}

impl Reference {
    fn at(block: u32, layer: usize, slot: usize) -> usize {
        ((block as usize * N_LAYERS + layer) * BLOCK_SIZE + slot) * ENTRY_DIM
    }

    fn store(&mut self, table: &[u32], layer: usize, start: usize, entries: &[f32]) {
        for (i, e) in entries.chunks(ENTRY_DIM).enumerate() {
            let p = start + i;
            let at = Self::at(table[p / BLOCK_SIZE], layer, p % BLOCK_SIZE);
            self.pool[at..at + ENTRY_DIM].copy_from_slice(e);
        }
    }

    fn gather(&self, table: &[u32], layer: usize, len: usize) -> Vec<f32> {
        (0..len)
            .flat_map(|p| {
                let at = Self::at(table[p / BLOCK_SIZE], layer, p % BLOCK_SIZE);
                self.pool[at..at + ENTRY_DIM].to_vec()
            })
            .collect()
    }
}

struct Setup {
    dev: Arc<EmulatedDevice>,
    s: StreamId,
    kv: PagedKv,
}

/// A device with a pool of `POOL_BLOCKS` blocks, filled with `initial`.
fn setup(initial: &[f32]) -> Setup {
    let dev = EmulatedDevice::new(EmulatedConfig { memory_bytes: 4 << 20, compute_threads: 1, ..Default::default() }).unwrap();
    let s = dev.create_stream(StreamKind::Compute).unwrap();
    let pool = dev.alloc(initial.len() * 4).unwrap();
    upload_f32(&*dev, s, initial, pool).unwrap();
    Setup { dev, s, kv: PagedKv { pool, n_layers: N_LAYERS, block_size: BLOCK_SIZE, entry_dim: ENTRY_DIM } }
}

impl Setup {
    fn u32s(&self, xs: &[u32]) -> DevicePtr {
        let p = self.dev.alloc(xs.len() * 4).unwrap();
        upload_u32(&*self.dev, self.s, xs, p).unwrap();
        p
    }

    fn f32s(&self, xs: &[f32]) -> DevicePtr {
        let p = self.dev.alloc(xs.len() * 4).unwrap();
        upload_f32(&*self.dev, self.s, xs, p).unwrap();
        p
    }

    fn pool(&self) -> Vec<f32> {
        download_matrix(&*self.dev, self.s, self.kv.pool.matrix(1, self.kv.pool.bytes / 4)).unwrap()
    }
}

fn pool_floats() -> usize {
    POOL_BLOCKS * N_LAYERS * BLOCK_SIZE * ENTRY_DIM
}

#[test]
fn stored_entries_gather_back_as_the_host_pool_holds_them() {
    let mut rng = Rng(0x5eed);
    let initial = rng.f32s(pool_floats());
    let d = setup(&initial);
    let mut reference = Reference { pool: initial };
    // Scattered, non-contiguous block ids; the sequences share no block.
    let tables: [&[u32]; 3] = [&[7, 2, 10], &[0, 11, 5, 3], &[9]];
    let device_tables: Vec<DevicePtr> = tables.iter().map(|t| d.u32s(t)).collect();
    // (sequence, layer, start, n): a prompt with a partial last block, a
    // store that starts mid-block and crosses into the next block, single
    // decode steps, a layer other than 0, and the same positions of
    // another layer (which must not disturb the first).
    let stores = [(0, 0, 0, 9), (0, 2, 0, 9), (1, 1, 0, 6), (1, 1, 6, 5), (1, 1, 11, 1), (2, 0, 1, 2), (0, 0, 9, 1), (2, 2, 0, 4)];
    let mut lens = [[0usize; N_LAYERS]; 3];
    for &(seq, layer, start, n) in &stores {
        let entries = rng.f32s(n * ENTRY_DIM);
        // The entries in a strided view, columns 1.. of a wider matrix.
        let wide: Vec<f32> = entries.chunks(ENTRY_DIM).flat_map(|e| [-1.0].into_iter().chain(e.iter().copied()).chain([-2.0])).collect();
        let m = d.f32s(&wide).matrix(n, ENTRY_DIM + 2).columns(1..ENTRY_DIM + 1);
        let op = Op::KvStore { entries: m, kv: d.kv, table: device_tables[seq], blocks: tables[seq].len(), layer, start };
        d.dev.launch(d.s, &op).unwrap();
        reference.store(tables[seq], layer, start, &entries);
        lens[seq][layer] = lens[seq][layer].max(start + n);
    }
    // The whole pool, untouched entries included, is what the host pool holds.
    assert_eq!(d.pool(), reference.pool, "pool after the stores");
    for (seq, table) in tables.iter().enumerate() {
        for (layer, &len) in lens[seq].iter().enumerate() {
            // Into a strided view, leaving the columns around it alone.
            let buf = d.f32s(&vec![7.0; len.max(1) * (ENTRY_DIM + 1)]);
            let out = buf.matrix(len, ENTRY_DIM + 1).columns(0..ENTRY_DIM);
            d.dev.launch(d.s, &Op::KvGather { kv: d.kv, table: device_tables[seq], blocks: table.len(), layer, out }).unwrap();
            let got = download_matrix(&*d.dev, d.s, out).unwrap();
            assert_eq!(got, reference.gather(table, layer, len), "sequence {seq}, layer {layer}");
            let pad = download_matrix(&*d.dev, d.s, buf.matrix(len, ENTRY_DIM + 1).columns(ENTRY_DIM..ENTRY_DIM + 1)).unwrap();
            assert!(pad.iter().all(|&x| x == 7.0), "the gather wrote outside its view");
        }
    }
}

#[test]
fn a_bad_block_id_is_a_clear_sticky_fault() {
    let initial = Rng(3).f32s(pool_floats());
    let d = setup(&initial);
    // Block 1 is fine, the second entry is past the pool's 12 blocks: a
    // store over both must write neither.
    let table = d.u32s(&[1, POOL_BLOCKS as u32]);
    let entries = d.f32s(&[1.5; 6 * ENTRY_DIM]).matrix(6, ENTRY_DIM);
    // Launching succeeds (block ids are device data); the fault shows at
    // the next synchronization point, and stays.
    d.dev.launch(d.s, &Op::KvStore { entries, kv: d.kv, table, blocks: 2, layer: 1, start: 0 }).unwrap();
    let err = download_matrix(&*d.dev, d.s, d.kv.pool.matrix(1, pool_floats())).unwrap_err();
    let text = err.to_string();
    assert!(matches!(err, DeviceError::Backend(_)), "{err:?}");
    assert!(text.contains("kv_store") && text.contains("block 12") && text.contains("12 blocks"), "unclear error: {text}");
    let again = d.dev.record(d.s).and_then(|e| d.dev.synchronize(&e)).and_then(|_| download_matrix(&*d.dev, d.s, entries)).unwrap_err();
    assert!(again.to_string().contains("block 12"), "the fault is not sticky: {again}");

    // A gather with a bad id fails the same way. (That a failed store
    // writes nothing at all is a unit test in host_ops.rs: after a fault
    // the device's memory can no longer be read through `Device`.)
    let d = setup(&initial);
    let table = d.u32s(&[u32::MAX]);
    let out = d.dev.alloc(BLOCK_SIZE * ENTRY_DIM * 4).unwrap().matrix(BLOCK_SIZE, ENTRY_DIM);
    d.dev.launch(d.s, &Op::KvGather { kv: d.kv, table, blocks: 1, layer: 0, out }).unwrap();
    let err = download_matrix(&*d.dev, d.s, out).unwrap_err();
    assert!(err.to_string().contains("kv_gather") && err.to_string().contains("4294967295"), "unclear error: {err}");
}

#[test]
fn inconsistent_kv_ops_are_refused() {
    let d = setup(&vec![0.0; pool_floats()]);
    // A table of 8 ids, of which the ops use the first 2.
    let table = d.u32s(&[0, 1, 2, 3, 4, 5, 6, 7]);
    let entries = d.f32s(&[0.0; 3 * (ENTRY_DIM + 1)]);
    let store = |m, kv, blocks, layer, start| Op::KvStore { entries: m, kv, table, blocks, layer, start };
    let e = entries.matrix(3, ENTRY_DIM);
    let refused = |op: Op, what: &str, needle: &str| match d.dev.launch(d.s, &op) {
        Err(DeviceError::Invalid(m)) => assert!(m.contains(needle), "{what}: unclear message {m:?}"),
        other => panic!("{what}: {other:?}"),
    };
    // The baseline is accepted: 3 entries at positions 5..8 of 2 blocks of 4.
    d.dev.launch(d.s, &store(e, d.kv, 2, 2, 5)).unwrap();
    refused(store(entries.matrix(3, ENTRY_DIM + 1), d.kv, 2, 0, 0), "entry_dim mismatch", "entries 3×6");
    refused(store(e, d.kv, 2, 0, 6), "positions beyond the table", "do not fit in 2 blocks");
    refused(store(e, d.kv, 9, 0, 0), "a table shorter than its block count", "9 block ids overrun a 32-byte table");
    refused(store(e, d.kv, 2, N_LAYERS, 0), "layer out of range", "layer 3 of a 3-layer pool");
    let ragged = PagedKv { pool: d.kv.pool.slice(0, d.kv.pool.bytes - 4).unwrap(), ..d.kv };
    refused(store(e, ragged, 2, 0, 0), "a pool that is not whole blocks", "whole number");
    refused(store(e, PagedKv { block_size: 0, ..d.kv }, 2, 0, 0), "an empty block", "no usable block size");
    refused(store(table.matrix(1, ENTRY_DIM), d.kv, 2, 0, 0), "entries overlapping the table", "overlap");
    refused(store(e.reshape(12, ENTRY_DIM), d.kv, 2, 0, 0), "entries overrunning their buffer", "overruns");

    let gather = |out, blocks, layer| Op::KvGather { kv: d.kv, table, blocks, layer, out };
    let out = d.dev.alloc(8 * (ENTRY_DIM + 1) * 4).unwrap();
    d.dev.launch(d.s, &gather(out.matrix(8, ENTRY_DIM), 2, 0)).unwrap();
    refused(gather(out.matrix(8, ENTRY_DIM + 1), 2, 0), "out entry_dim mismatch", "out 8×6");
    refused(gather(out.matrix(8, ENTRY_DIM), 1, 0), "positions beyond the table", "do not fit in 1 blocks");
    refused(gather(out.matrix(2, ENTRY_DIM), 2, 5), "layer out of range", "layer 5");
    refused(gather(table.matrix(1, ENTRY_DIM), 2, 0), "out overlapping the table", "overlap");
    refused(gather(d.kv.pool.matrix(2, ENTRY_DIM), 2, 0), "out overlapping the pool", "overlap");
    // Nothing refused reached the stream: it has not failed.
    d.dev.record(d.s).and_then(|e| d.dev.synchronize(&e)).unwrap();
    download_matrix(&*d.dev, d.s, out.matrix(8, ENTRY_DIM)).unwrap();
}
