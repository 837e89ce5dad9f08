//! `Op::GemmBatched` on the emulated device: the same as one `Op::Gemm` per
//! batch, for every weight format and precision, with weights taken as row
//! bands of one matrix (MLA's value bands) and as slabs at a padded stride
//! (MLA's per-head key bands); and its launches checked before they queue.

use duplex_kernels::device::emulated::{EmulatedConfig, EmulatedDevice};
use duplex_kernels::device::{self, Device, DevicePtr, DeviceWeight, HostBytes, Matrix, Op, StreamId, StreamKind};
use duplex_kernels::{Precision, WeightFormat};
use std::sync::Arc;

mod common;
use common::Rng;

const FP8: WeightFormat = WeightFormat::Fp8E4m3 { block: [128, 128] };

fn bytes_of(xs: &[f32]) -> Vec<u8> {
    xs.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// A `rows × cols` weight in `format`: its data bytes and F32 scales.
fn weight_bytes(rng: &mut Rng, rows: usize, cols: usize, format: WeightFormat) -> (Vec<u8>, Vec<f32>) {
    let n = rows * cols;
    match format {
        WeightFormat::F32 => (bytes_of(&rng.f32s(n, -1.0, 1.0)), vec![]),
        WeightFormat::Bf16 => (rng.f32s(n, -1.0, 1.0).iter().flat_map(|&x| half::bf16::from_f32(x).to_le_bytes()).collect(), vec![]),
        WeightFormat::F16 => (rng.f32s(n, -1.0, 1.0).iter().flat_map(|&x| half::f16::from_f32(x).to_le_bytes()).collect(), vec![]),
        WeightFormat::Fp8E4m3 { block } => {
            // Any code but the two NaNs.
            let data = (0..n).map(|_| rng.next() as u8).map(|c| if c & 0x7f == 0x7f { 0x38 } else { c }).collect();
            (data, rng.f32s(rows.div_ceil(block[0]) * cols.div_ceil(block[1]), 0.001, 0.05))
        }
        WeightFormat::Quant(kind) => unreachable!("devices have no {kind} kernels; no test asks for them"),
    }
}

fn put(d: &dyn Device, s: StreamId, bytes: Vec<u8>) -> DevicePtr {
    let p = d.alloc(bytes.len().max(4)).unwrap();
    d.upload(s, &HostBytes::from_vec(bytes.clone()), p.slice(0, bytes.len()).unwrap()).unwrap();
    p
}

/// Run `op` and then the equivalent single GEMMs, and compare every output byte.
fn same_as_one_gemm_each(d: &Arc<EmulatedDevice>, s: StreamId, op: Op, out_all: Matrix) {
    let Op::GemmBatched { w, w_step, scales_step, x, x_rows, y, y_rows, count, precision, round } = op.clone() else { unreachable!() };
    d.launch(s, &Op::Zero { x: out_all }).unwrap();
    d.launch(s, &op).unwrap();
    let batched = device::download_matrix(&**d, s, out_all).unwrap();
    d.launch(s, &Op::Zero { x: out_all }).unwrap();
    for b in 0..count {
        let wb = w.shifted(b * w_step, b * scales_step);
        let wb = DeviceWeight { data: DevicePtr { bytes: w.data.bytes, ..wb.data }, scales: DevicePtr { bytes: w.scales.bytes, ..wb.scales }, ..wb };
        d.launch(s, &Op::Gemm { w: wb, x: x.rows(b * x_rows..b * x_rows + x.rows), y: y.rows(b * y_rows..b * y_rows + y.rows), precision, round }).unwrap();
    }
    let single = device::download_matrix(&**d, s, out_all).unwrap();
    assert_eq!(batched, single, "{op:?}");
    assert!(batched.iter().any(|&v| v != 0.0), "the batches wrote nothing");
}

#[test]
fn batched_gemm_equals_one_gemm_per_batch() {
    let d = EmulatedDevice::new(EmulatedConfig { memory_bytes: 64 << 20, compute_threads: 1, ..Default::default() }).unwrap();
    let s = d.create_stream(StreamKind::Compute).unwrap();
    let mut rng = Rng::new(0x5eed);
    for format in [WeightFormat::F32, WeightFormat::Bf16, WeightFormat::F16, FP8] {
        let (heads, rows, cols) = (3, 256, 160);
        // Row bands of one matrix: batch b is rows b·rows.. (scale blocks whole).
        let (data, scales) = weight_bytes(&mut rng, heads * rows, cols, format);
        let (data_p, scales_p) = (put(&*d, s, data.clone()), put(&*d, s, bytes_of(&scales)));
        let bpe = format.bytes_per_element();
        let band_scales = if scales.is_empty() { 0 } else { scales.len() / heads * 4 };
        let w = DeviceWeight { data: data_p.slice(0, rows * cols * bpe).unwrap(), scales: scales_p.slice(0, band_scales).unwrap(), rows, cols, format };
        // x: one row per head inside a wider matrix (a strided window), y likewise.
        let xs = rng.f32s(heads * (cols + 4), -1.0, 1.0);
        let x_all = put(&*d, s, bytes_of(&xs)).matrix(heads, cols + 4);
        let y_all = put(&*d, s, vec![0; heads * (rows + 2) * 4]).matrix(heads, rows + 2);
        for precision in [Precision::F32, Precision::Bf16] {
            for round in [false, true] {
                let op = Op::GemmBatched { w, w_step: rows * cols * bpe, scales_step: band_scales, x: x_all.rows(0..1).columns(1..cols + 1), x_rows: 1, y: y_all.rows(0..1).columns(2..rows + 2), y_rows: 1, count: heads, precision, round };
                same_as_one_gemm_each(&d, s, op, y_all);
            }
        }
        // Slabs at a padded stride, each its own scales after its data (MLA's key bands).
        let (slab_rows, slab_cols) = (64, 128);
        let mut slabs = vec![];
        let mut stride = 0;
        for _ in 0..heads {
            let (data, scales) = weight_bytes(&mut rng, slab_rows, slab_cols, format);
            let mut slab = data;
            slab.resize(slab.len().div_ceil(256) * 256, 0);
            let data_len = slab.len();
            slab.extend(bytes_of(&scales));
            slab.resize(slab.len().div_ceil(256) * 256, 0);
            stride = slab.len();
            slabs.push((slab, data_len, scales.len() * 4));
        }
        let all: Vec<u8> = slabs.iter().flat_map(|(b, ..)| b.iter().copied()).collect();
        let p = put(&*d, s, all);
        let (data_len, scales_len) = (slabs[0].1, slabs[0].2);
        let w = DeviceWeight { data: p.slice(0, slab_rows * slab_cols * bpe).unwrap(), scales: if scales_len == 0 { p.slice(0, 0).unwrap() } else { p.slice(data_len, scales_len).unwrap() }, rows: slab_rows, cols: slab_cols, format };
        let xs = rng.f32s(2 * heads * slab_cols, -1.0, 1.0);
        let x = put(&*d, s, bytes_of(&xs)).matrix(2 * heads, slab_cols);
        let y_all = put(&*d, s, vec![0; 2 * heads * slab_rows * 4]).matrix(2 * heads, slab_rows);
        // Two rows per batch.
        let op = Op::GemmBatched { w, w_step: stride, scales_step: stride, x: x.rows(0..2), x_rows: 2, y: y_all.rows(0..2), y_rows: 2, count: heads, precision: Precision::Bf16, round: true };
        same_as_one_gemm_each(&d, s, op, y_all);
    }
}

#[test]
fn batched_gemm_launches_are_checked() {
    let d = EmulatedDevice::new(EmulatedConfig { memory_bytes: 8 << 20, ..Default::default() }).unwrap();
    let s = d.create_stream(StreamKind::Compute).unwrap();
    let w = DeviceWeight { data: d.alloc(4 * 16 * 8).unwrap(), scales: DevicePtr { addr: 0, bytes: 0 }, rows: 16, cols: 8, format: WeightFormat::F32 };
    let x = d.alloc(4 * 4 * 8).unwrap().matrix(4, 8);
    let y = d.alloc(4 * 4 * 16).unwrap().matrix(4, 16);
    let op = |w_step: usize, x_rows: usize, y: Matrix, y_rows: usize, count: usize| Op::GemmBatched { w, w_step, scales_step: 0, x: x.rows(0..1), x_rows, y, y_rows, count, precision: Precision::F32, round: false };
    d.launch(s, &op(0, 1, y.rows(0..1), 1, 4)).unwrap();
    let bad = |op: Op, why: &str| assert!(d.launch(s, &op).is_err(), "{why}: {op:?}");
    bad(op(0, 1, y.rows(0..1), 1, 0), "no batch");
    bad(op(0, 1, y.rows(0..1), 1, 5), "x and y overrun their buffers");
    bad(op(0, 2, y.rows(0..1), 1, 4), "x overruns its buffer");
    bad(op(0, 1, x.rows(0..1), 1, 4), "y is not W's rows wide");
    bad(op(0, 1, Matrix { cols: 16, stride: 16, ..x.rows(0..1) }, 1, 1), "y overlaps x");
    // A weight batch past the device's memory is a fault when it runs, not a read out of bounds.
    d.launch(s, &op(8 << 20, 1, y.rows(0..1), 1, 4)).unwrap();
    // The stream may already have run it (the fault is sticky: recording
    // then fails), or not yet (waiting for it then fails).
    let faulted = match d.record(s) {
        Ok(done) => d.synchronize(&done).is_err(),
        Err(e) => e.to_string().contains("outside the device"),
    };
    assert!(faulted, "the far batch faults");
}
