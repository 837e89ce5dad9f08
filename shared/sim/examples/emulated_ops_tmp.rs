use duplex_kernels::device::emulated::{EmulatedConfig, EmulatedDevice};
use duplex_kernels::device::{Device, DeviceWeight, Op, StreamKind, HostBytes};
use duplex_kernels::{Precision, WeightFormat};
use duplex_sim::calibrate::{this_machine, Calibration};
use std::time::Instant;
fn main() {
    let hw = this_machine(&Calibration { threads: 2, device_threads: 1, emulated_h2d_gb_per_s: Some(2.0), device_memory_mib: 1024, quick: false }).unwrap();
    let spec = &hw.devices[0];
    let dev = EmulatedDevice::new(EmulatedConfig { memory_bytes: 512 << 20, compute_threads: 1, ..Default::default() }).unwrap();
    let s = dev.create_stream(StreamKind::Compute).unwrap();
    let (rows, cols) = (1536usize, 2048usize);
    let wdata = dev.alloc(rows * cols).unwrap();
    let wscales = dev.alloc(rows.div_ceil(128) * cols.div_ceil(128) * 4).unwrap();
    dev.upload(s, &HostBytes::from_vec(vec![0x38u8; rows*cols]), wdata).unwrap();
    dev.upload(s, &HostBytes::from_f32(&vec![0.01f32; rows.div_ceil(128) * cols.div_ceil(128)]), wscales).unwrap();
    let w = DeviceWeight { data: wdata, scales: wscales, rows, cols, format: WeightFormat::Fp8E4m3 { block: [128, 128] } };
    let n = 48;
    let x = dev.alloc(512 * cols * 4).unwrap().matrix(512, cols);
    let y = dev.alloc(512 * rows * 4).unwrap().matrix(512, rows);
    let ids = dev.alloc(512 * 4).unwrap();
    dev.upload(s, &HostBytes::from_u32(&(0..512u32).collect::<Vec<_>>()), ids).unwrap();
    let sc = dev.alloc(512 * 4).unwrap();
    let ops: Vec<(&str, Op)> = vec![
        ("gemm 48", Op::Gemm { w, x: x.rows(0..n), y: y.rows(0..n), precision: Precision::Bf16, round: true }),
        ("silu 48", Op::SiluMul { gate: y.rows(0..n), up: y.rows(n..2*n), precision: Precision::Bf16 }),
        ("scatter 48", Op::ScatterAddRows { src: y.rows(0..n).reshape(n, rows).columns(0..rows), rows: ids, scales: sc, count: n, dst: dev.alloc(512*rows*4).unwrap().matrix(512, rows) }),
        ("rmsnorm 512", Op::RmsNorm { x, weight: dev.alloc(cols*4).unwrap(), out: dev.alloc(512*cols*4).unwrap().matrix(512, cols), eps: 1e-6, precision: Precision::Bf16 }),
        ("gather 48", Op::GatherRows { src: x, rows: ids, count: n, dst: y.rows(0..n).columns(0..cols.min(rows)).reshape(n, rows) }),
        ("add 512", Op::Add { h: x, delta: x, precision: Precision::Bf16 }),
    ];
    for (name, op) in &ops {
        let _ = op.validate().map_err(|e| println!("{name}: {e}"));
        dev.launch(s, op).ok(); dev.synchronize(&dev.record(s).unwrap()).unwrap();
        let mut best = f64::MAX;
        for _ in 0..10 { let t = Instant::now(); dev.launch(s, op).unwrap(); dev.synchronize(&dev.record(s).unwrap()).unwrap(); best = best.min(t.elapsed().as_secs_f64()); }
        println!("{name}: real {:.1} us, predicted {:.1} us", best*1e6, spec.op_time(op).as_secs_f64()*1e6);
    }
}
