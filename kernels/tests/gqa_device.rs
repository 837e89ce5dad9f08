//! `Op::GqaAttention` on the emulated device computes what the CPU kernel
//! `gqa::gqa_attention` computes, and `validate` refuses inconsistent shapes.

use duplex_kernels::cpu::isa;
use duplex_kernels::device::emulated::{EmulatedConfig, EmulatedDevice};
use duplex_kernels::device::{download_matrix, upload_f32, Device, DeviceError, GqaDims, Matrix, Op, StreamKind};
use duplex_kernels::gqa::{gqa_attention, KvBlocks};
use duplex_kernels::pool::{PoolConfig, ThreadPool};
use duplex_kernels::{round_bf16, Precision};

/// BF16-valued inputs in [-1, 1).
fn inputs(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            round_bf16((s % 2001) as f32 / 1000.0 - 1.0)
        })
        .collect()
}

#[test]
fn emulated_gqa_matches_the_kernel() {
    let dev = EmulatedDevice::new(EmulatedConfig { memory_bytes: 16 << 20, compute_threads: 2, ..Default::default() }).unwrap();
    let s = dev.create_stream(StreamKind::Compute).unwrap();
    let pool = ThreadPool::new(&PoolConfig::single_node(1));
    // Decode (one row, over several split-K parts) and prefill rows; k and
    // v with a row to spare past start + n, which must not be read.
    for (dims, start, n) in [(GqaDims { heads: 8, kv_heads: 2, head_dim: 32 }, 300, 1), (GqaDims { heads: 6, kv_heads: 3, head_dim: 16 }, 9, 40)] {
        let (qw, kw, rows) = (dims.heads * dims.head_dim, dims.kv_heads * dims.head_dim, start + n + 1);
        let (q, k, v) = (inputs(n * qw, 1), inputs(rows * kw, 2), inputs(rows * kw, 3));
        let upload = |xs: &[f32], r: usize, c: usize| -> Matrix {
            let p = dev.alloc(xs.len() * 4).unwrap();
            upload_f32(&*dev, s, xs, p).unwrap();
            p.matrix(r, c)
        };
        let (qm, km, vm) = (upload(&q, n, qw), upload(&k, rows, kw), upload(&v, rows, kw));
        let out = dev.alloc(n * qw * 4).unwrap().matrix(n, qw);
        // The cache as the kernel reads it: entries [k | v].
        let entries: Vec<f32> = (0..start + n).flat_map(|t| k[t * kw..(t + 1) * kw].iter().chain(&v[t * kw..(t + 1) * kw]).copied()).collect();
        let blocks = [entries.as_slice()];
        let cache = KvBlocks { blocks: &blocks, block_size: start + n, kv_heads: dims.kv_heads, head_dim: dims.head_dim };
        for precision in [Precision::F32, Precision::Bf16] {
            dev.launch(s, &Op::GqaAttention { q: qm, k: km, v: vm, out, start, dims, scale: 0.2, precision }).unwrap();
            let got = download_matrix(&*dev, s, out).unwrap();
            let mut want = vec![0.0; n * qw];
            gqa_attention(&pool, isa::detect(), &q, cache, start, dims, 0.2, precision, &mut vec![], &mut want);
            // Bit for bit: the same kernel, whose result does not depend on the threads.
            let same = got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "{dims:?}, start {start}, n {n}, {precision:?}");
        }
    }
}

#[test]
fn bad_gqa_shapes_are_refused() {
    let dev = EmulatedDevice::new(EmulatedConfig { memory_bytes: 1 << 20, compute_threads: 1, ..Default::default() }).unwrap();
    let s = dev.create_stream(StreamKind::Compute).unwrap();
    let dims = GqaDims { heads: 4, kv_heads: 2, head_dim: 8 };
    let buf = |rows: usize, cols: usize| dev.alloc(rows * cols * 4).unwrap().matrix(rows, cols);
    let (q, k, v, out) = (buf(3, 32), buf(10, 16), buf(10, 16), buf(3, 32));
    let op = |q: Matrix, k: Matrix, v: Matrix, out: Matrix, start: usize, dims: GqaDims| Op::GqaAttention { q, k, v, out, start, dims, scale: 1.0, precision: Precision::F32 };
    assert!(op(q, k, v, out, 7, dims).validate().is_ok(), "10 rows of k and v hold positions 0..10");
    let refused = |op: Op, why: &str| assert!(matches!(op.validate(), Err(DeviceError::Invalid(_))), "{why}");
    refused(op(q, k, v, out, 8, dims), "positions up to 11 in 10 rows");
    refused(op(q, k, v, out, 0, GqaDims { kv_heads: 3, ..dims }), "3 kv heads do not divide 4 heads");
    refused(op(q, k, v, out, 0, GqaDims { kv_heads: 0, ..dims }), "no kv heads");
    refused(op(q, k, v, out, 0, GqaDims { head_dim: 16, ..dims }), "q is not heads × head_dim wide");
    refused(op(q, buf(10, 8), v, out, 0, dims), "k is not kv_heads × head_dim wide");
    refused(op(q, k, buf(10, 8), out, 0, dims), "v is not kv_heads × head_dim wide");
    refused(op(q, k, v, buf(2, 32), 0, dims), "out has fewer rows than q");
    refused(op(q, k, v, q, 0, dims), "out is q");
    refused(op(q, k, v, k.reshape(5, 32).rows(0..3), 0, dims), "out overlaps k");
    refused(op(q, k, v, out, usize::MAX, dims), "start + n overflows");
    // launch checks too, before anything is queued.
    assert!(matches!(dev.launch(s, &op(q, k, v, q, 0, dims)), Err(DeviceError::Invalid(_))));
}
