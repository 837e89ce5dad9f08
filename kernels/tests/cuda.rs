//! Numerics of the CUDA backend: every op, on random inputs, run on the GPU
//! and on the emulated device (whose ops are the CPU engine's kernels), and
//! compared; plus the device semantics (memory, copies, events, host
//! functions) the pipeline relies on.
//!
//! Without a GPU (no driver, no device, no NVRTC) every test says why it
//! is skipped and passes, except the one that compiles every kernel with
//! NVRTC for the architectures we run on: that needs NVRTC alone (a pip
//! wheel, see `.ci/run`), and fails, saying how to install it, without.

#![cfg(feature = "cuda")]

use duplex_kernels::device::cuda::{compile_kernels, nvrtc_architectures, CudaDevice};
use duplex_kernels::device::emulated::{EmulatedConfig, EmulatedDevice};
use duplex_kernels::device::{download_matrix, download_u32, Device, DeviceError, DevicePtr, DeviceWeight, GqaDims, HostBytes, Matrix, MlaDims, Op, PagedKv, StreamId, StreamKind};
use duplex_kernels::linear::{matmul, WeightView};
use duplex_kernels::router::{route, RouterParams, ScoringFunc};
use duplex_kernels::{Precision, WeightFormat};
use std::io::Write;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

mod common;
use common::Rng;

/// Device memory for the tests (they share one device).
const MEMORY: usize = 256 << 20;

/// The GPU, opened once for all tests; `None`, with the reason printed, when
/// there is none to open. Failures other than "unavailable" (a kernel that
/// does not compile, say) fail the tests.
fn cuda_device() -> Option<Arc<CudaDevice>> {
    static DEVICE: OnceLock<Result<Arc<CudaDevice>, DeviceError>> = OnceLock::new();
    usable(DEVICE.get_or_init(|| CudaDevice::open(0, MEMORY)))
}

/// The opened device, or `None` (saying why) where there is no GPU to use;
/// any other failure to open panics.
fn usable<T: Clone>(opened: &Result<T, DeviceError>) -> Option<T> {
    match opened {
        Ok(device) => Some(device.clone()),
        Err(DeviceError::Unavailable(why)) => {
            // Straight to stderr, past the test harness's capture, so that a
            // skip is visible in an ordinary `cargo test` run; one write, so
            // that lines of tests running in parallel do not interleave. The
            // harness names each test's thread after the test.
            let test = std::thread::current().name().unwrap_or("cuda test").to_string();
            let _ = std::io::stderr().write_all(format!("{test}: skipped: {why}\n").as_bytes());
            None
        }
        Err(e) => panic!("the CUDA device failed to open: {e}"),
    }
}

#[test]
fn only_a_missing_gpu_skips() {
    assert!(usable::<()>(&Err(DeviceError::Unavailable("no CUDA driver".into()))).is_none());
    assert_eq!(usable(&Ok(7)), Some(7));
}

#[test]
#[should_panic(expected = "the CUDA device failed to open: device failure: NVRTC cannot compile")]
fn kernels_that_do_not_compile_fail_instead_of_skipping() {
    usable::<()>(&Err(DeviceError::Backend("NVRTC cannot compile the kernels for sm_90".into())));
}

fn emulated_device() -> Arc<EmulatedDevice> {
    EmulatedDevice::new(EmulatedConfig { memory_bytes: 64 << 20, compute_threads: 2, ..Default::default() }).expect("emulated device")
}

fn f32_bytes(xs: &[f32]) -> Vec<u8> {
    xs.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// One device with a stream and the buffers a test made on it.
struct Bench {
    dev: Arc<dyn Device>,
    stream: StreamId,
    bufs: Vec<DevicePtr>,
}

impl Bench {
    fn new(dev: Arc<dyn Device>) -> Self {
        let stream = dev.create_stream(StreamKind::Compute).expect("stream");
        Bench { dev, stream, bufs: vec![] }
    }

    fn bytes(&mut self, bytes: &[u8]) -> DevicePtr {
        let p = self.dev.alloc(bytes.len()).expect("alloc");
        self.dev.upload(self.stream, &HostBytes::from_vec(bytes.to_vec()), p).expect("upload");
        self.bufs.push(p);
        p
    }

    fn f32s(&mut self, xs: &[f32]) -> DevicePtr {
        self.bytes(&f32_bytes(xs))
    }

    fn u32s(&mut self, xs: &[u32]) -> DevicePtr {
        self.bytes(&xs.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>())
    }

    /// A `rows × cols` matrix of `xs`.
    fn matrix(&mut self, xs: &[f32], rows: usize, cols: usize) -> Matrix {
        assert_eq!(xs.len(), rows * cols);
        self.f32s(xs).matrix(rows, cols)
    }

    fn weight(&mut self, w: &HostWeight) -> DeviceWeight {
        let data = self.bytes(&w.data);
        let scales = if w.scales.is_empty() { DevicePtr { addr: 0, bytes: 0 } } else { self.f32s(&w.scales) };
        DeviceWeight { data, scales, rows: w.rows, cols: w.cols, format: w.format }
    }

    fn launch(&self, op: &Op) {
        self.dev.launch(self.stream, op).unwrap_or_else(|e| panic!("{} failed to launch {op:?}: {e}", self.dev.describe()));
    }

    fn read(&self, out: &Out) -> Vec<f32> {
        match *out {
            Out::F32(m) => download_matrix(&*self.dev, self.stream, m).expect("download"),
            Out::U32(p) => download_u32(&*self.dev, self.stream, p).expect("download").into_iter().map(|x| x as f32).collect(),
        }
    }
}

impl Drop for Bench {
    fn drop(&mut self) {
        // Everything queued is done before the buffers go back.
        if let Ok(done) = self.dev.record(self.stream) {
            let _ = self.dev.synchronize(&done);
        }
        for p in self.bufs.drain(..) {
            let _ = self.dev.free(p);
        }
    }
}

/// What a test reads back after its op.
enum Out {
    F32(Matrix),
    /// u32 values (read as f32 for comparison; they are small).
    U32(DevicePtr),
}

/// Run the op that `build` makes on the GPU and on the emulated device and
/// return what each reads back: `(gpu, emulated)`, one vector per output.
/// `build` must upload the same inputs on both (it is called once for each).
fn run_both(gpu: &Arc<CudaDevice>, build: impl Fn(&mut Bench) -> (Op, Vec<Out>)) -> (Vec<Vec<f32>>, Vec<Vec<f32>>) {
    let run = |dev: Arc<dyn Device>| {
        let mut bench = Bench::new(dev);
        let (op, outs) = build(&mut bench);
        bench.launch(&op);
        outs.iter().map(|o| bench.read(o)).collect::<Vec<_>>()
    };
    (run(gpu.clone()), run(emulated_device()))
}

/// `got` is within `rel` of `want`, relative to each value's magnitude or,
/// for values near zero (sums that cancel), to the root mean square of all.
#[track_caller]
fn assert_close(got: &[f32], want: &[f32], rel: f32, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths differ");
    let rms = (want.iter().map(|w| w * w).sum::<f32>() / want.len().max(1) as f32).sqrt();
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let ok = g == w || (g.is_nan() && w.is_nan()) || (g - w).abs() <= rel * w.abs().max(rms).max(1e-30);
        assert!(ok, "{what}: element {i}: GPU {g}, reference {w} (rel tolerance {rel})");
    }
}

fn compare(gpu: &[Vec<f32>], reference: &[Vec<f32>], rel: f32, what: &str) {
    for (k, (g, r)) in gpu.iter().zip(reference).enumerate() {
        assert_close(g, r, rel, &format!("{what}, output {k}"));
    }
}

fn tolerance(p: Precision) -> f32 {
    match p {
        Precision::F32 => 1e-4,
        Precision::Bf16 => 1e-2,
    }
}

/// A weight in host memory, in its stored format.
struct HostWeight {
    rows: usize,
    cols: usize,
    format: WeightFormat,
    data: Vec<u8>,
    scales: Vec<f32>,
}

impl HostWeight {
    fn random(rng: &mut Rng, rows: usize, cols: usize, format: WeightFormat) -> Self {
        let n = rows * cols;
        let (data, scales) = match format {
            WeightFormat::F32 => (f32_bytes(&rng.f32s(n, -1.0, 1.0)), vec![]),
            WeightFormat::Bf16 => (rng.f32s(n, -1.0, 1.0).iter().flat_map(|&x| half::bf16::from_f32(x).to_le_bytes()).collect(), vec![]),
            WeightFormat::F16 => (rng.f32s(n, -1.0, 1.0).iter().flat_map(|&x| half::f16::from_f32(x).to_le_bytes()).collect(), vec![]),
            WeightFormat::Fp8E4m3 { block } => {
                // Any code but the two NaNs.
                let data = (0..n).map(|_| rng.next() as u8).map(|c| if c & 0x7f == 0x7f { 0x38 } else { c }).collect();
                (data, rng.f32s(rows.div_ceil(block[0]) * cols.div_ceil(block[1]), 0.001, 0.05))
            }
            WeightFormat::Quant(kind) => unreachable!("devices have no {kind} kernels; no test asks for them"),
        };
        HostWeight { rows, cols, format, data, scales }
    }

    fn view(&self) -> WeightView<'_> {
        WeightView { rows: self.rows, cols: self.cols, format: self.format, data: &self.data, scales: &self.scales }
    }
}

const FP8: WeightFormat = WeightFormat::Fp8E4m3 { block: [128, 128] };
const FORMATS: [WeightFormat; 4] = [WeightFormat::F32, WeightFormat::Bf16, WeightFormat::F16, FP8];
const PRECISIONS: [Precision; 2] = [Precision::F32, Precision::Bf16];

#[test]
fn gemm_matches_reference() {
    let Some(gpu) = cuda_device() else { return };
    let mut rng = Rng::new(1);
    // Partial FP8 blocks in both directions, one row, partial GEMM tiles.
    for (rows, cols, n) in [(200, 300, 5), (64, 128, 1), (130, 257, 17)] {
        for format in FORMATS {
            let w = HostWeight::random(&mut rng, rows, cols, format);
            // x is a strided window of a wider matrix, y another.
            let x = rng.f32s(n * (cols + 3), -1.0, 1.0);
            let y0 = rng.f32s(n * (rows + 5), -1.0, 1.0);
            for precision in PRECISIONS {
                for round in [false, true] {
                    let (got, want) = run_both(&gpu, |b| {
                        let w = b.weight(&w);
                        let x = b.matrix(&x, n, cols + 3).columns(2..cols + 2);
                        let y_all = b.matrix(&y0, n, rows + 5);
                        let y = y_all.columns(1..rows + 1);
                        (Op::Gemm { w, x, y, precision, round }, vec![Out::F32(y_all)])
                    });
                    let what = format!("gemm {rows}×{cols} {format:?}, n {n}, {precision:?}, round {round}");
                    compare(&got, &want, tolerance(if round { Precision::Bf16 } else { precision }), &what);
                    if precision == Precision::F32 && !round {
                        // And straight against the scalar reference.
                        let xs: Vec<f32> = (0..n).flat_map(|i| x[i * (cols + 3) + 2..i * (cols + 3) + 2 + cols].iter().copied()).collect();
                        let mut y = vec![0.0; n * rows];
                        matmul(&w.view(), &xs, n, &mut y);
                        let g: Vec<f32> = (0..n).flat_map(|i| got[0][i * (rows + 5) + 1..i * (rows + 5) + 1 + rows].iter().copied()).collect();
                        assert_close(&g, &y, 1e-4, &format!("{what} vs linear::matmul"));
                    }
                }
            }
        }
    }
}

/// One launch for many small GEMMs (MLA's absorbed decode, per head): row
/// bands of one weight, strided x and y windows, every format and precision.
#[test]
fn gemm_batched_matches_reference() {
    let Some(gpu) = cuda_device() else { return };
    let mut rng = Rng::new(7);
    let (heads, rows, cols) = (3, 256, 200);
    for format in FORMATS {
        let w = HostWeight::random(&mut rng, heads * rows, cols, format);
        let x = rng.f32s(2 * heads * (cols + 3), -1.0, 1.0);
        let y0 = rng.f32s(2 * heads * (rows + 5), -1.0, 1.0);
        let bpe = format.bytes_per_element();
        let scales_step = w.scales.len() / heads * 4;
        for precision in PRECISIONS {
            for round in [false, true] {
                let (got, want) = run_both(&gpu, |b| {
                    let all = b.weight(&w);
                    let first = DeviceWeight { data: all.data.slice(0, rows * cols * bpe).unwrap(), scales: all.scales.slice(0, scales_step).unwrap(), rows, ..all };
                    let x = b.matrix(&x, 2 * heads, cols + 3).columns(2..cols + 2);
                    let y_all = b.matrix(&y0, 2 * heads, rows + 5);
                    let y = y_all.columns(1..rows + 1);
                    // Two rows a batch, x and y moving two rows per batch.
                    let op = Op::GemmBatched { w: first, w_step: rows * cols * bpe, scales_step, x: x.rows(0..2), x_rows: 2, y: y.rows(0..2), y_rows: 2, count: heads, precision, round };
                    (op, vec![Out::F32(y_all)])
                });
                let what = format!("batched gemm {heads} × {rows}×{cols} {format:?}, {precision:?}, round {round}");
                compare(&got, &want, tolerance(if round { Precision::Bf16 } else { precision }), &what);
            }
        }
    }
}

#[test]
fn rms_norm_matches_reference() {
    let Some(gpu) = cuda_device() else { return };
    let mut rng = Rng::new(2);
    let (rows, cols) = (7, 1000);
    let x = rng.f32s(rows * cols, -3.0, 3.0);
    let w = rng.f32s(cols, 0.5, 1.5);
    let out0 = rng.f32s(rows * (cols + 4), -1.0, 1.0);
    for precision in PRECISIONS {
        let (got, want) = run_both(&gpu, |b| {
            let x = b.matrix(&x, rows, cols);
            let weight = b.f32s(&w);
            let out_all = b.matrix(&out0, rows, cols + 4);
            let out = out_all.columns(3..cols + 3);
            (Op::RmsNorm { x, weight, out, eps: 1e-6, precision }, vec![Out::F32(out_all)])
        });
        compare(&got, &want, tolerance(precision), &format!("rms_norm {precision:?}"));
        // In place.
        let (got, want) = run_both(&gpu, |b| {
            let x = b.matrix(&x, rows, cols);
            let weight = b.f32s(&w);
            (Op::RmsNorm { x, weight, out: x, eps: 1e-6, precision }, vec![Out::F32(x)])
        });
        compare(&got, &want, tolerance(precision), &format!("rms_norm in place {precision:?}"));
    }
}

#[test]
fn rope_matches_reference() {
    let Some(gpu) = cuda_device() else { return };
    let mut rng = Rng::new(3);
    let (positions, per, dr) = (5, 3, 64);
    let rows = positions * per - 1; // a partial last position
    let x = rng.f32s(rows * (dr + 8), -2.0, 2.0);
    let angles = rng.f32s(positions * dr / 2, -3.0, 3.0);
    let cos: Vec<f32> = angles.iter().map(|a| a.cos()).collect();
    let sin: Vec<f32> = angles.iter().map(|a| a.sin()).collect();
    for precision in PRECISIONS {
        for interleaved in [false, true] {
            let (got, want) = run_both(&gpu, |b| {
                let all = b.matrix(&x, rows, dr + 8);
                let x = all.columns(8..dr + 8);
                let cos = b.matrix(&cos, positions, dr / 2);
                let sin = b.matrix(&sin, positions, dr / 2);
                (Op::Rope { x, cos, sin, rows_per_position: per, interleaved, precision }, vec![Out::F32(all)])
            });
            // Bit-exact on F32: the same multiplies and adds, unfused.
            let rel = if precision == Precision::F32 { 1e-6 } else { tolerance(precision) };
            compare(&got, &want, rel, &format!("rope {precision:?}, interleaved {interleaved}"));
        }
    }
}

#[test]
fn elementwise_ops_match_reference() {
    let Some(gpu) = cuda_device() else { return };
    let mut rng = Rng::new(4);
    let (rows, cols, wide) = (9, 333, 340);
    let a = rng.f32s(rows * wide, -6.0, 6.0);
    let c = rng.f32s(rows * cols, -2.0, 2.0);
    for precision in PRECISIONS {
        let (got, want) = run_both(&gpu, |b| {
            let all = b.matrix(&a, rows, wide);
            let gate = all.columns(4..cols + 4);
            let up = b.matrix(&c, rows, cols);
            (Op::SiluMul { gate, up, precision }, vec![Out::F32(all)])
        });
        compare(&got, &want, tolerance(precision), &format!("silu_mul {precision:?}"));
        let (got, want) = run_both(&gpu, |b| {
            let all = b.matrix(&a, rows, wide);
            let h = all.columns(7..cols + 7);
            let delta = b.matrix(&c, rows, cols);
            (Op::Add { h, delta, precision }, vec![Out::F32(all)])
        });
        compare(&got, &want, tolerance(precision), &format!("add {precision:?}"));
    }
    let (got, want) = run_both(&gpu, |b| {
        let all = b.matrix(&a, rows, wide);
        (Op::RoundBf16 { x: all.columns(1..cols + 1) }, vec![Out::F32(all)])
    });
    // Rounding is exact: the same bits.
    compare(&got, &want, 0.0, "round_bf16");
    // Ties both ways, the largest values, infinities, NaN, zeros, subnormals.
    let special: Vec<f32> = [0x3f80_8000u32, 0x3f81_8000, 0xbf80_8000, 0xbf81_8000, 0x7f7f_ffff, 0x7f7f_8000, 0x7f80_0000, 0xff80_0000, 0x7fc0_0001, 0x0000_8000, 0x0001_8000, 0x8000_0000, 0, 0x3f80_8001, 0x3f80_7fff, 0x0080_0000]
        .into_iter()
        .map(f32::from_bits)
        .collect();
    let (got, want) = run_both(&gpu, |b| {
        let x = b.matrix(&special, 1, special.len());
        (Op::RoundBf16 { x }, vec![Out::F32(x)])
    });
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<u32>>();
    assert_eq!(bits(&got[0]), bits(&want[0]), "round_bf16 of special values");
    let (got, want) = run_both(&gpu, |b| {
        let all = b.matrix(&a, rows, wide);
        (Op::Zero { x: all.rows(2..7).columns(5..cols) }, vec![Out::F32(all)])
    });
    compare(&got, &want, 0.0, "zero");
}

fn router(n_experts: usize, top_k: usize, n_group: usize, topk_group: usize, scoring: ScoringFunc, norm_topk_prob: bool) -> RouterParams {
    RouterParams { n_experts, top_k, n_group, topk_group, norm_topk_prob, routed_scaling_factor: 2.5, scoring }
}

#[test]
fn route_matches_reference() {
    let Some(gpu) = cuda_device() else { return };
    let mut rng = Rng::new(5);
    let cases = [
        router(256, 8, 8, 4, ScoringFunc::Sigmoid, true), // DeepSeek-V3's shape
        router(64, 6, 1, 1, ScoringFunc::Softmax, false),
        router(16, 4, 16, 3, ScoringFunc::Sigmoid, true), // one expert a group
        router(32, 2, 4, 4, ScoringFunc::Sigmoid, false), // every group kept
    ];
    let tokens = 11;
    for params in cases {
        let n = params.n_experts;
        // Distinct logits, 0.03 apart and shuffled, so that no two scores are
        // within the GPU's and CPU's `exp` differences of each other.
        let mut logits = Vec::with_capacity(tokens * n);
        for _ in 0..tokens {
            let mut row: Vec<f32> = (0..n).map(|i| -4.0 + 0.03 * i as f32 + rng.f32(0.0, 0.01)).collect();
            for i in (1..n).rev() {
                row.swap(i, rng.below(i + 1));
            }
            logits.extend(row);
        }
        let bias: Vec<f32> = (0..n).map(|i| 0.001 * i as f32).collect();
        for with_bias in [false, true] {
            for precision in PRECISIONS {
                let (got, want) = run_both(&gpu, |b| {
                    let l = b.matrix(&logits, tokens, n);
                    let bias = with_bias.then(|| b.f32s(&bias));
                    let ids = b.u32s(&vec![u32::MAX; tokens * params.top_k]);
                    let weights = b.matrix(&vec![0.0; tokens * params.top_k], tokens, params.top_k);
                    (Op::Route { logits: l, bias, params: params.clone(), ids, weights, precision }, vec![Out::U32(ids), Out::F32(weights)])
                });
                let what = format!("route {params:?}, bias {with_bias}, {precision:?}");
                assert_eq!(got[0], want[0], "{what}: chosen experts");
                assert_close(&got[1], &want[1], 1e-4, &format!("{what}: weights"));
                // And straight against the scalar reference.
                for t in 0..tokens {
                    let r = route(&params, &logits[t * n..(t + 1) * n], with_bias.then_some(&bias[..]));
                    for (j, (e, w)) in r.into_iter().enumerate() {
                        assert_eq!(got[0][t * params.top_k + j], e as f32, "{what}: token {t} pick {j}");
                        assert_close(&[got[1][t * params.top_k + j]], &[w], 1e-4, &what);
                    }
                }
            }
        }
    }
}

#[test]
fn gather_and_scatter_match_reference() {
    let Some(gpu) = cuda_device() else { return };
    let mut rng = Rng::new(6);
    let (rows, cols, count) = (20, 77, 9);
    let table = rng.f32s(rows * (cols + 2), -1.0, 1.0);
    let dst0 = rng.f32s((count + 1) * cols, -1.0, 1.0);
    let mut picks: Vec<u32> = (0..rows as u32).collect();
    for i in (1..rows).rev() {
        picks.swap(i, rng.below(i + 1));
    }
    let picks = &picks[..count];
    let (got, want) = run_both(&gpu, |b| {
        let src = b.matrix(&table, rows, cols + 2).columns(1..cols + 1);
        let idx = b.u32s(picks);
        let dst = b.matrix(&dst0, count + 1, cols);
        (Op::GatherRows { src, rows: idx, count, dst }, vec![Out::F32(dst)])
    });
    compare(&got, &want, 0.0, "gather_rows");

    let scales = rng.f32s(count, -2.0, 2.0);
    let (got, want) = run_both(&gpu, |b| {
        let src = b.matrix(&dst0, count + 1, cols);
        let idx = b.u32s(picks);
        let scales = b.f32s(&scales);
        let all = b.matrix(&table, rows, cols + 2);
        let dst = all.columns(1..cols + 1);
        (Op::ScatterAddRows { src, rows: idx, scales, count, dst }, vec![Out::F32(all)])
    });
    compare(&got, &want, 1e-6, "scatter_add_rows");
}

#[test]
fn embedding_matches_reference() {
    let Some(gpu) = cuda_device() else { return };
    let mut rng = Rng::new(7);
    let (rows, cols, first_row, count) = (150, 260, 100, 12);
    for format in FORMATS {
        let table = HostWeight::random(&mut rng, rows, cols, format);
        // Ids below, inside and past this shard's rows.
        let ids: Vec<u32> = (0..count).map(|_| rng.below(first_row + rows + 50) as u32).collect();
        let out0 = rng.f32s(count * cols, -1.0, 1.0);
        for precision in PRECISIONS {
            let (got, want) = run_both(&gpu, |b| {
                let table = b.weight(&table);
                let ids = b.u32s(&ids);
                let out = b.matrix(&out0, count, cols);
                (Op::Embedding { table, first_row, ids, count, out, precision }, vec![Out::F32(out)])
            });
            // Decoding is exact, and so is its one multiply by the scale.
            compare(&got, &want, 0.0, &format!("embedding {format:?} {precision:?}"));
        }
    }
}

#[test]
fn mla_prefill_matches_reference() {
    let Some(gpu) = cuda_device() else { return };
    let mut rng = Rng::new(8);
    let dims = MlaDims { heads: 3, dn: 16, dr: 8, dv: 12, dc: 20 };
    for (n, start) in [(5, 4), (1, 0), (3, 300)] {
        let ctx = start + n;
        let q = rng.f32s(n * dims.heads * (dims.dn + dims.dr), -1.0, 1.0);
        let kv = rng.f32s(ctx * dims.heads * (dims.dn + dims.dv), -1.0, 1.0);
        let latents = rng.f32s(ctx * (dims.dc + dims.dr), -1.0, 1.0);
        let out0 = rng.f32s(n * dims.heads * dims.dv, -1.0, 1.0);
        for precision in PRECISIONS {
            let (got, want) = run_both(&gpu, |b| {
                let q = b.matrix(&q, n, dims.heads * (dims.dn + dims.dr));
                let kv = b.matrix(&kv, ctx, dims.heads * (dims.dn + dims.dv));
                let latents = b.matrix(&latents, ctx, dims.dc + dims.dr);
                let out = b.matrix(&out0, n, dims.heads * dims.dv);
                (Op::MlaPrefill { q, kv, latents, out, start, dims, scale: 0.3, precision }, vec![Out::F32(out)])
            });
            compare(&got, &want, tolerance(precision), &format!("mla_prefill n {n} start {start} {precision:?}"));
        }
    }
}

#[test]
fn mla_decode_matches_reference() {
    let Some(gpu) = cuda_device() else { return };
    let mut rng = Rng::new(9);
    for (heads, dc, dr, ctx) in [(4, 40, 8, 37), (2, 512, 64, 300)] {
        let ql = rng.f32s(heads * dc, -1.0, 1.0);
        let qp = rng.f32s(heads * dr, -1.0, 1.0);
        let latents = rng.f32s(ctx * (dc + dr), -1.0, 1.0);
        let out0 = rng.f32s(heads * dc, -1.0, 1.0);
        for precision in PRECISIONS {
            let (got, want) = run_both(&gpu, |b| {
                let q_latent = b.matrix(&ql, heads, dc);
                let q_pe = b.matrix(&qp, heads, dr);
                let latents = b.matrix(&latents, ctx, dc + dr);
                let out = b.matrix(&out0, heads, dc);
                (Op::MlaDecode { q_latent, q_pe, latents, out, scale: 0.1, precision }, vec![Out::F32(out)])
            });
            // Neither precision rounds this op's output.
            compare(&got, &want, 1e-4, &format!("mla_decode {heads}×{dc}, ctx {ctx}, {precision:?}"));
        }
    }
}

#[test]
fn gqa_attention_matches_reference() {
    let Some(gpu) = cuda_device() else { return };
    let mut rng = Rng::new(10);
    // Decode and prefill rows, groups of one, four and eight heads, head
    // widths under and over the 128-thread block, contexts over several
    // chunks of it, and k and v with rows to spare past start + n.
    for (heads, kv_heads, head_dim, n, start, spare) in [(4, 1, 8, 1, 0, 0), (8, 2, 64, 1, 300, 3), (6, 6, 16, 5, 4, 0), (16, 2, 128, 7, 200, 1), (8, 1, 256, 3, 130, 0)] {
        let dims = GqaDims { heads, kv_heads, head_dim };
        let (q_width, kv_width, ctx) = (heads * head_dim, kv_heads * head_dim, start + n + spare);
        // BF16-valued, as the BF16 path's callers provide them.
        let mut bf16s = |len: usize| rng.f32s(len, -1.0, 1.0).into_iter().map(duplex_kernels::round_bf16).collect::<Vec<f32>>();
        let (q, k, v) = (bf16s(n * q_width), bf16s(ctx * kv_width), bf16s(ctx * kv_width));
        let out0 = rng.f32s(n * q_width, -1.0, 1.0);
        for precision in PRECISIONS {
            let (got, want) = run_both(&gpu, |b| {
                let q = b.matrix(&q, n, q_width);
                let k = b.matrix(&k, ctx, kv_width);
                let v = b.matrix(&v, ctx, kv_width);
                let out = b.matrix(&out0, n, q_width);
                (Op::GqaAttention { q, k, v, out, start, dims, scale: 0.125, precision }, vec![Out::F32(out)])
            });
            compare(&got, &want, tolerance(precision), &format!("gqa_attention {heads}/{kv_heads}×{head_dim}, n {n}, start {start}, {precision:?}"));
        }
    }
}

/// The partial attentions against the emulated device's: key ranges before,
/// across and past the queries (rows that see none get zeros and −∞), key
/// counts over several chunks of the block, heads wider than 128 threads.
/// Both devices round the scores' inputs alike and leave the output
/// unrounded, so BF16 agrees as closely as F32 (only the order of sums differs).
#[test]
fn attention_parts_match_reference() {
    let Some(gpu) = cuda_device() else { return };
    let mut rng = Rng::new(20);
    // (n, start, key_start, keys)
    let splits = [(5, 4, 0, 9), (5, 4, 6, 3), (1, 0, 0, 1), (3, 300, 0, 290), (4, 10, 20, 7), (6, 100, 50, 300)];
    for dims in [MlaDims { heads: 3, dn: 16, dr: 8, dv: 12, dc: 20 }, MlaDims { heads: 2, dn: 128, dr: 64, dv: 160, dc: 96 }] {
        let (qw, kvw, lw, ow) = (dims.heads * (dims.dn + dims.dr), dims.heads * (dims.dn + dims.dv), dims.dc + dims.dr, dims.heads * dims.dv);
        for (n, start, key_start, keys) in splits {
            let (q, kv, latents) = (rng.f32s(n * qw, -1.0, 1.0), rng.f32s(keys * kvw, -1.0, 1.0), rng.f32s(keys * lw, -1.0, 1.0));
            let (out0, lse0) = (rng.f32s(n * ow, -1.0, 1.0), rng.f32s(n * dims.heads, -1.0, 1.0));
            for precision in PRECISIONS {
                let (got, want) = run_both(&gpu, |b| {
                    let (q, kv, latents) = (b.matrix(&q, n, qw), b.matrix(&kv, keys, kvw), b.matrix(&latents, keys, lw));
                    let (out, lse) = (b.matrix(&out0, n, ow), b.matrix(&lse0, n, dims.heads));
                    (Op::MlaPrefillPart { q, kv, latents, out, lse, start, key_start, dims, scale: 0.1, precision }, vec![Out::F32(out), Out::F32(lse)])
                });
                compare(&got, &want, 1e-4, &format!("mla_prefill_part {dims:?}, n {n}, start {start}, keys {key_start}+{keys}, {precision:?}"));
            }
        }
    }
    for (heads, kv_heads, head_dim) in [(4, 1, 8), (6, 6, 16), (8, 2, 64), (16, 2, 128), (8, 1, 256)] {
        let dims = GqaDims { heads, kv_heads, head_dim };
        let (qw, kw) = (heads * head_dim, kv_heads * head_dim);
        for (n, start, key_start, keys) in splits {
            let (q, k, v) = (rng.f32s(n * qw, -1.0, 1.0), rng.f32s(keys * kw, -1.0, 1.0), rng.f32s(keys * kw, -1.0, 1.0));
            let (out0, lse0) = (rng.f32s(n * qw, -1.0, 1.0), rng.f32s(n * heads, -1.0, 1.0));
            for precision in PRECISIONS {
                let (got, want) = run_both(&gpu, |b| {
                    let (q, k, v) = (b.matrix(&q, n, qw), b.matrix(&k, keys, kw), b.matrix(&v, keys, kw));
                    let (out, lse) = (b.matrix(&out0, n, qw), b.matrix(&lse0, n, heads));
                    (Op::GqaAttentionPart { q, k, v, out, lse, start, key_start, dims, scale: 0.125, precision }, vec![Out::F32(out), Out::F32(lse)])
                });
                compare(&got, &want, 1e-4, &format!("gqa_attention_part {heads}/{kv_heads}×{head_dim}, n {n}, start {start}, keys {key_start}+{keys}, {precision:?}"));
            }
        }
    }
}

/// The merge against the emulated device's, with −∞ on either side or both
/// (and NaN in an accumulator at −∞, which is replaced or left alone).
#[test]
fn attention_merge_matches_reference() {
    let Some(gpu) = cuda_device() else { return };
    let mut rng = Rng::new(21);
    for (rows, heads, d) in [(7, 3, 16), (2, 1, 300), (33, 4, 128)] {
        let mut out = rng.f32s(rows * heads * d, -1.0, 1.0);
        let part = rng.f32s(rows * heads * d, -1.0, 1.0);
        let mut lse = rng.f32s(rows * heads, -5.0, 5.0);
        let mut part_lse = rng.f32s(rows * heads, -5.0, 5.0);
        for r in 0..rows * heads {
            match rng.below(4) {
                0 => {
                    lse[r] = f32::NEG_INFINITY;
                    out[r * d] = f32::NAN;
                }
                1 => part_lse[r] = f32::NEG_INFINITY,
                2 => (lse[r], part_lse[r]) = (f32::NEG_INFINITY, f32::NEG_INFINITY),
                _ => {}
            }
        }
        let (got, want) = run_both(&gpu, |b| {
            let (o, l) = (b.matrix(&out, rows, heads * d), b.matrix(&lse, rows, heads));
            let (p, pl) = (b.matrix(&part, rows, heads * d), b.matrix(&part_lse, rows, heads));
            (Op::AttentionMerge { out: o, lse: l, part: p, part_lse: pl, heads }, vec![Out::F32(o), Out::F32(l)])
        });
        compare(&got, &want, 1e-5, &format!("attention_merge {rows}×{heads}×{d}"));
    }
}

/// Every kernel compiles with NVRTC for the GPUs we run on: A100 (sm_80),
/// A10/RTX 30 (sm_86), L4/L40/RTX 40 (sm_89), H100/H200 (sm_90), and
/// Blackwell desktop (sm_120) where this NVRTC knows it. No GPU is needed,
/// so this runs everywhere; without NVRTC it fails rather than skips.
#[test]
fn every_kernel_compiles_for_our_architectures() {
    let how = "NVRTC compiles the CUDA kernels and needs no GPU: `python3 -m pip install --target DIR nvidia-cuda-nvrtc-cu12` and put DIR/nvidia/cuda_nvrtc/lib on LD_LIBRARY_PATH (as .ci/run does), or install the CUDA toolkit's NVRTC";
    let known = nvrtc_architectures().unwrap_or_else(|e| panic!("{e}\n{how}"));
    assert!(!known.is_empty(), "this NVRTC does not list the architectures it compiles for");
    for arch in [80, 86, 89, 90, 120] {
        if !known.contains(&arch) {
            assert_eq!(arch, 120, "this NVRTC compiles for {known:?}, not sm_{arch}: too old ({how})");
            eprintln!("every_kernel_compiles_for_our_architectures: this NVRTC ({known:?}) does not know sm_120");
            continue;
        }
        let target = compile_kernels(arch).unwrap_or_else(|e| panic!("sm_{arch}: {e}"));
        assert_eq!(target, format!("sm_{arch}"));
    }
}

#[test]
fn paged_kv_store_and_gather_match_reference() {
    let Some(gpu) = cuda_device() else { return };
    let mut rng = Rng::new(11);
    // A pool of 10 blocks of 3 layers × 4 slots × 7 floats; entry widths
    // that are not a multiple of a warp, strided entries and outputs.
    let (n_layers, block_size, entry_dim, pool_blocks) = (3, 4, 7, 10);
    let pool0 = rng.f32s(pool_blocks * n_layers * block_size * entry_dim, -1.0, 1.0);
    // Scattered block ids; (table, layer, start, n) stores: a prompt with a
    // partial last block, a store starting mid-block that crosses a block,
    // a decode step, and another layer of the same positions.
    let tables: [&[u32]; 2] = [&[6, 1, 9], &[0, 8, 3, 4]];
    let stores = [(0, 0, 0, 10), (0, 2, 0, 10), (1, 1, 0, 3), (1, 1, 3, 6), (1, 1, 9, 1), (0, 0, 10, 1)];
    let entries: Vec<Vec<f32>> = stores.iter().map(|&(_, _, _, n)| rng.f32s(n * (entry_dim + 1), -1.0, 1.0)).collect();
    let (got, want) = run_both(&gpu, |b| {
        let kv = PagedKv { pool: b.f32s(&pool0), n_layers, block_size, entry_dim };
        let ids: Vec<DevicePtr> = tables.iter().map(|t| b.u32s(t)).collect();
        for (&(t, layer, start, n), e) in stores.iter().zip(&entries) {
            let entries = b.matrix(e, n, entry_dim + 1).columns(1..entry_dim + 1);
            b.launch(&Op::KvStore { entries, kv, table: ids[t], blocks: tables[t].len(), layer, start });
        }
        let out = b.matrix(&vec![0.5; 11 * (entry_dim + 2)], 11, entry_dim + 2);
        b.launch(&Op::KvGather { kv, table: ids[0], blocks: 3, layer: 0, out: out.columns(1..entry_dim + 1) });
        let out1 = b.matrix(&vec![0.5; 10 * entry_dim], 10, entry_dim);
        // The op run_both launches last: layer 1 of the second sequence.
        (Op::KvGather { kv, table: ids[1], blocks: 4, layer: 1, out: out1 }, vec![Out::F32(kv.pool.matrix(1, pool0.len())), Out::F32(out), Out::F32(out1)])
    });
    // Copies: bit for bit.
    compare(&got, &want, 0.0, "paged kv store and gather");
    assert_ne!(got[0], pool0, "the stores changed nothing");
}

/// On the GPU a block id past the pool is never followed: a store skips
/// its entries (and writes the rest), a gather reads its rows as NaN.
#[test]
fn paged_kv_bad_block_ids_stay_inside_the_pool() {
    let Some(gpu) = cuda_device() else { return };
    let mut rng = Rng::new(12);
    let (n_layers, block_size, entry_dim, pool_blocks) = (2, 4, 5, 3);
    let pool0 = rng.f32s(pool_blocks * n_layers * block_size * entry_dim, -1.0, 1.0);
    let mut b = Bench::new(gpu.clone());
    // Guard floats on both sides of the pool, which nothing may touch.
    let all = b.f32s(&[vec![9.0; 64], pool0.clone(), vec![9.0; 64]].concat());
    let pool = all.slice(64 * 4, pool0.len() * 4).unwrap();
    let kv = PagedKv { pool, n_layers, block_size, entry_dim };
    let table = b.u32s(&[2, pool_blocks as u32, u32::MAX]);
    let entries = rng.f32s(12 * entry_dim, -1.0, 1.0);
    let e = b.matrix(&entries, 12, entry_dim);
    b.launch(&Op::KvStore { entries: e, kv, table, blocks: 3, layer: 1, start: 0 });
    let got = b.read(&Out::F32(all.matrix(1, pool0.len() + 128)));
    let mut want = [vec![9.0; 64], pool0.clone(), vec![9.0; 64]].concat();
    // Only block 2, layer 1 (positions 0..4) is written.
    let at = 64 + (2 * n_layers + 1) * block_size * entry_dim;
    want[at..at + block_size * entry_dim].copy_from_slice(&entries[..block_size * entry_dim]);
    assert_eq!(got, want, "a bad block id moved a store outside its block");
    let out = b.matrix(&vec![0.0; 12 * entry_dim], 12, entry_dim);
    b.launch(&Op::KvGather { kv, table, blocks: 3, layer: 1, out });
    let got = b.read(&Out::F32(out));
    assert_eq!(&got[..block_size * entry_dim], &entries[..block_size * entry_dim]);
    assert!(got[block_size * entry_dim..].iter().all(|x| x.is_nan()), "rows of bad blocks are not NaN");
}

#[test]
fn memory_is_a_bounded_arena() {
    let Some(gpu) = cuda_device() else { return };
    assert!(gpu.capacity() <= MEMORY && gpu.capacity() > MEMORY - 4096);
    // Other tests use the device at the same time: only what this test
    // does is checked, and it asks for more than anything could leave free.
    match gpu.alloc(MEMORY + 1) {
        Err(DeviceError::OutOfMemory { capacity, .. }) => assert_eq!(capacity, gpu.capacity()),
        other => panic!("an allocation above capacity gave {other:?}"),
    }
    let p = gpu.alloc(1000).expect("alloc");
    assert!(gpu.free_bytes() <= gpu.capacity() - 1000);
    gpu.free(p).expect("free");
    assert!(gpu.free(p).is_err(), "a double free is refused");
}

#[test]
fn copies_events_and_host_functions_keep_stream_order() {
    let Some(gpu) = cuda_device() else { return };
    let dev: &dyn Device = &*gpu;
    let (copy, compute) = (dev.create_stream(StreamKind::Copy).unwrap(), dev.create_stream(StreamKind::Compute).unwrap());
    let n = 1 << 20;
    let xs: Vec<f32> = (0..n).map(|i| i as f32).collect();
    let buf = dev.alloc(n * 4).unwrap();
    let src = HostBytes::from_f32(&xs);
    dev.register_host(&src).expect("register");
    dev.register_host(&src).expect("registering twice is fine");
    let t0 = dev.record(copy).unwrap();
    dev.upload(copy, &src, buf).unwrap();
    drop(src); // the device keeps the bytes alive until the copy is done
    let uploaded = dev.record(copy).unwrap();
    // The compute stream adds one to the data only after the copy.
    let ones = dev.alloc(n * 4).unwrap();
    dev.upload(compute, &HostBytes::from_f32(&vec![1.0; n]), ones).unwrap();
    dev.wait_event(compute, &uploaded).unwrap();
    let m = buf.matrix(1, n);
    dev.launch(compute, &Op::Add { h: m, delta: ones.matrix(1, n), precision: Precision::F32 }).unwrap();
    let order = Arc::new(Mutex::new(vec![]));
    let calls = Arc::new(AtomicUsize::new(0));
    for i in 0..3 {
        let (order, calls) = (order.clone(), calls.clone());
        dev.host_fn(compute, Box::new(move || {
            order.lock().unwrap().push(i);
            calls.fetch_add(1, Ordering::SeqCst);
        }))
        .unwrap();
    }
    let done = dev.record(compute).unwrap();
    dev.synchronize(&done).unwrap();
    assert_eq!(*order.lock().unwrap(), vec![0, 1, 2]);
    assert_eq!(calls.load(Ordering::SeqCst), 3);
    assert!(dev.elapsed(&t0, &uploaded).is_ok());
    let got = download_matrix(dev, compute, m).unwrap();
    assert!(got.iter().enumerate().all(|(i, &v)| v == i as f32 + 1.0), "the add ran before the upload finished");
    // A borrowed range of a larger buffer uploads just that range.
    let owner: Arc<dyn AsRef<[u8]> + Send + Sync> = Arc::new(f32_bytes(&[1.0, 2.0, 3.0, 4.0]));
    let part = HostBytes::new(owner, 4..12).unwrap();
    let small = dev.alloc(8).unwrap();
    dev.upload(copy, &part, small).unwrap();
    assert_eq!(download_matrix(dev, copy, small.matrix(1, 2)).unwrap(), vec![2.0, 3.0]);
    dev.free(small).unwrap();
    dev.free(ones).unwrap();
    dev.free(buf).unwrap();
}

/// Hybrid decode's pattern: a copy down into page-locked staging, a host
/// function that reads it and writes an answer beside it, and a copy of the
/// answer back up, queued at once on one stream.
#[test]
fn staging_copies_and_host_functions_keep_stream_order() {
    let Some(gpu) = cuda_device() else { return };
    let dev: &dyn Device = &*gpu;
    let s = dev.create_stream(StreamKind::Compute).unwrap();
    let n = 1 << 16;
    let (x, y) = (dev.alloc(n * 4).unwrap(), dev.alloc(n * 4).unwrap());
    let xs: Vec<f32> = (0..n).map(|i| i as f32).collect();
    dev.upload(s, &HostBytes::from_f32(&xs), x).unwrap();
    let staging = dev.staging(2 * n * 4).expect("page-locked staging");
    dev.download_to(s, x, &staging, 0).unwrap();
    let st = staging.clone();
    dev.host_fn(s, Box::new(move || {
        let mut bytes = st.lock();
        let (input, output) = bytes.split_at_mut(n * 4);
        for (o, i) in output.chunks_exact_mut(4).zip(input.chunks_exact(4)) {
            o.copy_from_slice(&(2.0 * f32::from_le_bytes(i.try_into().unwrap())).to_le_bytes());
        }
    }))
    .unwrap();
    dev.upload_from(s, &staging, n * 4, y).unwrap();
    drop(staging); // the device keeps it alive until the copies are done
    let done = dev.record(s).unwrap();
    let got = download_matrix(dev, s, y.matrix(1, n)).unwrap();
    assert!(got.iter().zip(&xs).all(|(g, x)| *g == 2.0 * x), "the host function or a copy ran out of order");
    assert!(dev.query(&done).unwrap());
    dev.free(x).unwrap();
    dev.free(y).unwrap();
}

#[test]
fn graphs_run_what_was_captured_when_launched_and_update_per_shape() {
    let Some(gpu) = cuda_device() else { return };
    common::graphs::two_streams_captured_and_launched(&*gpu);
}

#[test]
fn graph_capture_refuses_what_the_emulated_device_refuses() {
    let Some(gpu) = cuda_device() else { return };
    common::graphs::capture_rules_are_enforced(&*gpu);
}

#[test]
fn bad_launches_are_refused_before_the_gpu_sees_them() {
    let Some(gpu) = cuda_device() else { return };
    let dev: &dyn Device = &*gpu;
    let s = dev.create_stream(StreamKind::Compute).unwrap();
    let buf = dev.alloc(64).unwrap();
    // A pointer that is not this device's memory.
    let stray = DevicePtr { addr: 16, bytes: 64 };
    assert!(matches!(dev.launch(s, &Op::Zero { x: stray.matrix(4, 4) }), Err(DeviceError::Invalid(_))));
    // A shape that overruns its buffer.
    assert!(matches!(dev.launch(s, &Op::Zero { x: buf.matrix(5, 4) }), Err(DeviceError::Invalid(_))));
    // A misaligned F32 matrix.
    let odd = DevicePtr { addr: buf.addr + 1, bytes: 32 };
    assert!(matches!(dev.launch(s, &Op::Zero { x: odd.matrix(2, 4) }), Err(DeviceError::Invalid(_))));
    dev.launch(s, &Op::Zero { x: buf.matrix(4, 4) }).unwrap();
    assert_eq!(download_matrix(dev, s, buf.matrix(4, 4)).unwrap(), vec![0.0; 16]);
    dev.free(buf).unwrap();
}
