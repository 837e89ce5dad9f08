//! "This machine", measured: the CPU's read bandwidth and kernel fractions
//! from the same benchmarks as `duplex bench-kernels`, and the repo's
//! emulated accelerator as the one device, so that the simulator can be
//! checked against real runs here (`duplex simulate --calibrate`).
//!
//! Figures are what was achieved, not peaks: each peak is the measured rate
//! and its efficiency 1, except the GEMV fraction, which is the point of
//! measuring it. Every measurement is the best of its passes, the passes
//! interleaved so that a noisy neighbour slows them alike (as bench-kernels
//! does).

use crate::hardware::{CpuSpec, DeviceSpec, Hardware, RowFractions};
use duplex_kernels::cpu::isa::{self, Isa};
use duplex_kernels::device::emulated::{EmulatedConfig, EmulatedDevice};
use crate::cost::op_work;
use duplex_kernels::device::{Device, DeviceError, DevicePtr, HostBytes, Op, StreamKind};
use duplex_kernels::mla::{decode_attention, prefill_attention, LatentCache, MlaDims};
use duplex_kernels::Precision;
use duplex_kernels::linear::matmul;
use duplex_kernels::parallel_linear::{par_matmul, LinearScratch};
use duplex_kernels::pool::{PoolConfig, ThreadPool};
use duplex_kernels::WeightView;
use duplex_toolkit::kernel_bench::{fp8_view, gemv_bandwidth, moe_layer_bandwidth, random_fp8, read_bandwidth};
use std::time::Instant;

const GB: f64 = 1e9;
const TERA: f64 = 1e12;

/// What to calibrate.
#[derive(Clone, Debug)]
pub struct Calibration {
    /// CPU threads (0: every core).
    pub threads: usize,
    /// The emulated device's compute threads (0: as many as the CPU's).
    pub device_threads: usize,
    /// The emulated device's paced upload bandwidth (`bench-slp
    /// --h2d-gb-per-s`); `None`: memcpy speed, which is measured.
    pub emulated_h2d_gb_per_s: Option<f64>,
    /// The emulated device's memory (`bench-slp --device-memory-mib`).
    pub device_memory_mib: usize,
    /// Smaller buffers and one pass: a few seconds, for tests.
    pub quick: bool,
}

impl Default for Calibration {
    fn default() -> Self {
        Calibration { threads: 0, device_threads: 0, emulated_h2d_gb_per_s: None, device_memory_mib: 8192, quick: false }
    }
}

/// The best of each measurement over the passes.
#[derive(Clone, Copy, Debug, Default)]
struct Measured {
    /// Streaming read, bytes/s: one thread, all threads.
    read_one: f64,
    read_all: f64,
    /// Bytes/s of DeepSeek-V3's expert shapes: FP8 GEMV 7168→2048 and
    /// 2048→7168 at batch 1, and a whole MoE layer (8 routed + 1 shared).
    gemv_gate_up: f64,
    gemv_down: f64,
    moe_layer: f64,
    /// FLOP/s of the BF16 path's `par_matmul` (all threads) and of the F32
    /// path's reference `matmul` (one thread), both compute-bound.
    gemm_bf16: f64,
    gemm_f32: f64,
    /// FLOP/s of MLA's absorbed decode attention and of its prefill form's
    /// causal attention (all threads), counted as the cost model counts them.
    attention: f64,
    prefill_attention: f64,
    /// Bytes/s of one thread's memcpy (an unpaced emulated copy).
    memcpy: f64,
}

impl Measured {
    fn keep_best(&mut self, pass: Measured) {
        self.read_one = self.read_one.max(pass.read_one);
        self.read_all = self.read_all.max(pass.read_all);
        self.gemv_gate_up = self.gemv_gate_up.max(pass.gemv_gate_up);
        self.gemv_down = self.gemv_down.max(pass.gemv_down);
        self.moe_layer = self.moe_layer.max(pass.moe_layer);
        self.gemm_bf16 = self.gemm_bf16.max(pass.gemm_bf16);
        self.gemm_f32 = self.gemm_f32.max(pass.gemm_f32);
        self.attention = self.attention.max(pass.attention);
        self.prefill_attention = self.prefill_attention.max(pass.prefill_attention);
        self.memcpy = self.memcpy.max(pass.memcpy);
    }

    /// Weight-streaming kernels' fraction of the read bandwidth: the mean
    /// of the two GEMV shapes and the MoE layer.
    fn gemv_fraction(&self) -> f64 {
        (self.gemv_gate_up + self.gemv_down + self.moe_layer) / (3.0 * self.read_all)
    }
}

/// How a product's rate varies with its rows: the rate at each of `rows`
/// as a fraction of `reference` (the rate at `reference_rows`, which is the
/// description's peak), by `rate_at`, with the reference's own point.
fn row_fractions(rows: &[usize], reference_rows: usize, reference: f64, mut rate_at: impl FnMut(usize) -> f64) -> RowFractions {
    let mut points: Vec<[f64; 2]> = rows.iter().map(|&n| [n as f64, rate_at(n) / reference]).collect();
    points.push([reference_rows as f64, 1.0]);
    points.sort_by(|a, b| a[0].total_cmp(&b[0]));
    RowFractions(points)
}

/// FLOP/s of `n` tokens through an FP8 `rows × cols` weight held at the
/// start of `buf`, by `product`, best of `reps` after a warm-up.
fn gemm_rate(buf: &[u8], rows: usize, cols: usize, n: usize, reps: usize, mut product: impl FnMut(&WeightView, &[f32], &mut [f32])) -> f64 {
    let scales = vec![0.01f32; rows.div_ceil(128) * cols.div_ceil(128)];
    let w = fp8_view(buf, 0, rows, cols, &scales);
    let x: Vec<f32> = (0..n * cols).map(|i| ((i % 29) as f32 - 14.0) / 14.0).collect();
    let mut out = vec![0.0f32; n * rows];
    let rate = best_rate(2.0 * (n * rows * cols) as f64, reps, || product(&w, &x, &mut out));
    std::hint::black_box(&out);
    rate
}

/// FLOP/s of MLA's absorbed decode attention (DeepSeek-V3's 128 heads of
/// 512 + 64 latent dims) over a `ctx`-token F32 cache that stays in cache,
/// best of `reps`; FLOPs as [`op_work`] counts them.
fn attention_rate(pool: &ThreadPool, isa: Isa, ctx: usize, reps: usize) -> f64 {
    let (heads, dc, dr, block) = (128, 512, 64, 16);
    let blocks: Vec<Vec<f32>> = (0..ctx.div_ceil(block)).map(|b| (0..block * (dc + dr)).map(|i| ((b * 31 + i) % 17) as f32 / 17.0 - 0.5).collect()).collect();
    let refs: Vec<&[f32]> = blocks.iter().map(Vec::as_slice).collect();
    let cache = LatentCache { blocks: &refs, block_size: block, dc, dr };
    let (q_latent, q_pe) = (vec![0.01f32; heads * dc], vec![0.01f32; heads * dr]);
    let (mut scratch, mut out) = (vec![], vec![0.0f32; heads * dc]);
    let shaped = |rows: usize, cols: usize| DevicePtr { addr: 0, bytes: rows * cols * 4 }.matrix(rows, cols);
    let op = Op::MlaDecode { q_latent: shaped(heads, dc), q_pe: shaped(heads, dr), latents: shaped(ctx, dc + dr), out: shaped(heads, dc), scale: 0.1, precision: Precision::Bf16 };
    let flops = op_work(&op).flops;
    let rate = best_rate(flops, reps, || decode_attention(pool, isa, LatentCache { blocks: &refs, ..cache }, ctx, &q_latent, &q_pe, 0.1, &mut scratch, &mut out));
    std::hint::black_box(&out);
    rate
}

/// `work` units per second of `run`, best of `reps` after a warm-up.
fn best_rate(work: f64, reps: usize, mut run: impl FnMut()) -> f64 {
    run();
    let mut best = 0.0f64;
    for _ in 0..reps {
        let t0 = Instant::now();
        run();
        best = best.max(work / t0.elapsed().as_secs_f64());
    }
    best
}

/// FLOP/s of MLA's prefill-form causal attention (16 heads of DeepSeek-V3's
/// dims) for `n` queries after `start` cached positions, best of `reps`;
/// FLOPs as [`op_work`] counts them.
fn prefill_attention_rate(pool: &ThreadPool, isa: Isa, start: usize, n: usize, reps: usize) -> f64 {
    let dims = MlaDims { heads: 16, dn: 128, dr: 64, dv: 128, dc: 512 };
    let ctx = start + n;
    let fill = |len: usize| -> Vec<f32> { (0..len).map(|i| ((i % 23) as f32 - 11.0) / 23.0).collect() };
    let q = fill(n * dims.heads * (dims.dn + dims.dr));
    let kv = fill(ctx * dims.heads * (dims.dn + dims.dv));
    let latents = fill(ctx * (dims.dc + dims.dr));
    let mut out = vec![0.0f32; n * dims.heads * dims.dv];
    let shaped = |rows: usize, cols: usize| DevicePtr { addr: 0, bytes: rows * cols * 4 }.matrix(rows, cols);
    let op = Op::MlaPrefill { q: shaped(n, dims.heads * (dims.dn + dims.dr)), kv: shaped(ctx, dims.heads * (dims.dn + dims.dv)), latents: shaped(ctx, dims.dc + dims.dr), out: shaped(n, dims.heads * dims.dv), start, dims, scale: 0.1, precision: Precision::Bf16 };
    let flops = op_work(&op).flops;
    let rate = best_rate(flops, reps, || prefill_attention(pool, isa, &q, &kv, &latents, &mut out, start, dims, 0.1, Precision::Bf16));
    std::hint::black_box(&out);
    rate
}

/// One pass of every CPU measurement.
fn measure_pass(pool: &ThreadPool, isa: Isa, buf: &[u8], copy_to: &mut [u8], quick: bool) -> Measured {
    let mut linear = LinearScratch::default();
    // 2·n FLOP per weight byte: 128 tokens already sit far past any CPU's
    // turning point (~50 FLOP/byte), and the weight (4 MiB) is re-read from cache.
    let tokens = if quick { 128 } else { 512 };
    let gemm_bf16 = gemm_rate(buf, 2048, 2048, tokens, 2, |w, x, out| par_matmul(pool, isa, w, x, x.len() / w.cols, out, &mut linear));
    // The reference is scalar and single-threaded: a smaller product.
    let gemm_f32 = gemm_rate(buf, 512, 2048, if quick { 8 } else { 32 }, 2, |w, x, out| matmul(w, x, x.len() / w.cols, out));
    let t0 = Instant::now();
    copy_to.copy_from_slice(&buf[..copy_to.len()]);
    let memcpy = copy_to.len() as f64 / t0.elapsed().as_secs_f64();
    std::hint::black_box(&copy_to);
    Measured {
        read_one: read_bandwidth(pool, isa, buf, 1, 1),
        read_all: read_bandwidth(pool, isa, buf, pool.threads(), 1),
        gemv_gate_up: gemv_bandwidth(pool, isa, buf, 2048, 7168, 1),
        gemv_down: gemv_bandwidth(pool, isa, buf, 7168, 2048, 1),
        moe_layer: moe_layer_bandwidth(pool, isa, buf, 7168, 2048, 8, 1, 1),
        gemm_bf16,
        gemm_f32,
        attention: attention_rate(pool, isa, if quick { 256 } else { 1024 }, if quick { 3 } else { 10 }),
        prefill_attention: prefill_attention_rate(pool, isa, if quick { 128 } else { 512 }, if quick { 64 } else { 256 }, if quick { 1 } else { 3 }),
        memcpy,
    }
}

/// Bytes/s an emulated device's activation ops move: an `Add` of two
/// `[512, 2048]` matrices (the device copies activations out of its memory
/// and back, on its stream's thread), best of `count`.
fn emulated_op_bandwidth(config: EmulatedConfig, count: usize) -> Result<f64, DeviceError> {
    let device = EmulatedDevice::new(EmulatedConfig { memory_bytes: 16 << 20, ..config })?;
    let stream = device.create_stream(StreamKind::Compute)?;
    let (rows, cols) = (512, 2048);
    let (h, delta) = (device.alloc(rows * cols * 4)?, device.alloc(rows * cols * 4)?);
    let add = Op::Add { h: h.matrix(rows, cols), delta: delta.matrix(rows, cols), precision: Precision::Bf16 };
    let mut best = 0.0f64;
    for _ in 0..count {
        let t0 = Instant::now();
        device.launch(stream, &add)?;
        device.synchronize(&device.record(stream)?)?;
        best = best.max(op_work(&add).bytes / t0.elapsed().as_secs_f64());
    }
    Ok(best)
}

/// The emulated device's fixed costs, in µs: one launch (of an op with
/// nothing to do) and one upload (of 4 bytes), each through its stream as
/// the engines issue them, averaged over `count`.
fn emulated_fixed_costs(config: EmulatedConfig, count: usize) -> Result<(f64, f64), DeviceError> {
    let device = EmulatedDevice::new(config)?;
    let stream = device.create_stream(StreamKind::Compute)?;
    let ptr = device.alloc(4)?;
    let zero = Op::Zero { x: ptr.matrix(1, 1) };
    let word = HostBytes::from_vec(vec![0; 4]);
    let per_command = |issue: &dyn Fn() -> Result<(), DeviceError>| -> Result<f64, DeviceError> {
        issue()?;
        device.synchronize(&device.record(stream)?)?;
        let t0 = Instant::now();
        for _ in 0..count {
            issue()?;
        }
        device.synchronize(&device.record(stream)?)?;
        Ok(t0.elapsed().as_secs_f64() * 1e6 / count as f64)
    };
    let launch = per_command(&|| device.launch(stream, &zero))?;
    let upload = per_command(&|| device.upload(stream, &word, ptr))?;
    Ok((launch, upload))
}

/// Measure this machine: its CPU on `threads` threads, and the emulated
/// device with as many compute threads. Takes well under 20 s (a few
/// seconds with `quick`).
pub fn this_machine(c: &Calibration) -> Result<Hardware, DeviceError> {
    let pool = ThreadPool::new(&PoolConfig::split(c.threads, 1).map_err(DeviceError::Invalid)?);
    let isa = isa::detect();
    let threads = pool.threads();
    // Far beyond the last-level cache, and room for one V3 MoE layer (396 MB).
    let (buffer_mib, passes, copy_mib, commands) = if c.quick { (512, 1, 64, 200) } else { (1536, 3, 256, 2000) };
    let buf = random_fp8(&pool, buffer_mib << 20, 1);
    let mut copy_to = vec![1u8; copy_mib << 20];
    let mut best = Measured::default();
    for _ in 0..passes {
        best.keep_best(measure_pass(&pool, isa, &buf, &mut copy_to, c.quick));
    }
    // The emulated device computes with the same kernels on a pool of its
    // own: measured again where that pool is smaller.
    let device_threads = if c.device_threads == 0 { threads } else { c.device_threads.min(threads) };
    // The products' rate at other row counts, against the peak's (a routed
    // expert in a prefill sees few rows; long prompts' dense products many).
    let (reference_rows, other_rows): (usize, &[usize]) = if c.quick { (128, &[16, 512]) } else { (512, &[16, 32, 64, 128, 256, 1024, 2048]) };
    let products = |pool: &ThreadPool, reference: f64| {
        let mut linear = LinearScratch::default();
        row_fractions(other_rows, reference_rows, reference, |n| gemm_rate(&buf, 2048, 2048, n, passes + 1, |w, x, out| par_matmul(pool, isa, w, x, x.len() / w.cols, out, &mut linear)))
    };
    let cpu_rows = products(&pool, best.gemm_bf16);
    let (device_gemm, device_attention, device_rows) = if device_threads == threads {
        (best.gemm_bf16, best.prefill_attention, cpu_rows.clone())
    } else {
        let pool = ThreadPool::new(&PoolConfig::split(device_threads, 1).map_err(DeviceError::Invalid)?);
        let mut linear = LinearScratch::default();
        let gemm = gemm_rate(&buf, 2048, 2048, reference_rows, passes + 1, |w, x, out| par_matmul(&pool, isa, w, x, x.len() / w.cols, out, &mut linear));
        (gemm, prefill_attention_rate(&pool, isa, 512, 256, passes), products(&pool, gemm))
    };
    let device_read = (best.read_one * device_threads as f64).min(best.read_all);
    drop((buf, copy_to, pool));
    let h2d = c.emulated_h2d_gb_per_s.map(|g| g * GB);
    let config = EmulatedConfig { memory_bytes: 1 << 20, h2d_bytes_per_second: h2d, compute_threads: device_threads, jitter: None };
    let op_bandwidth = emulated_op_bandwidth(config.clone(), if c.quick { 3 } else { 10 })?;
    let (launch_us, copy_us) = emulated_fixed_costs(config, commands)?;
    let fraction = best.gemv_fraction();
    let cpu = CpuSpec {
        sockets: 1,
        cores_per_socket: threads,
        dram_read_gb_per_s: best.read_all / GB,
        read_efficiency: 1.0,
        core_read_gb_per_s: best.read_one / GB,
        gemv_efficiency: fraction,
        // The F32 reference runs on one thread: one core's share of the
        // whole is what was measured.
        f32_tflops: best.gemm_f32 * threads as f64 / TERA,
        bf16_tflops: best.gemm_bf16 / TERA,
        // No kernel here uses AMX, whatever the CPU has.
        amx_bf16_tflops: 0.0,
        gemm_efficiency: 1.0,
        gemm_row_fractions: cpu_rows,
        attention_tflops: best.attention / TERA,
        prefill_attention_tflops: best.prefill_attention / TERA,
        numa_link_gb_per_s: 0.0,
    };
    let device = DeviceSpec {
        name: "emulated".into(),
        memory_gib: c.device_memory_mib as f64 / 1024.0,
        // The emulated device computes with the CPU kernels on its own
        // `device_threads`-thread pool: F32 products are the one-thread reference.
        f32_tflops: best.gemm_f32 / TERA,
        bf16_tflops: device_gemm / TERA,
        fp8_tflops: 0.0,
        // What its ops reach moving activations (each copied out of its
        // memory and back, on the stream's thread), or weight streaming if
        // slower still.
        memory_gb_per_s: op_bandwidth.min(device_read * fraction) / GB,
        gemm_efficiency: 1.0,
        gemm_row_fractions: device_rows,
        // Its attention is the CPU's prefill kernel, at its own rate.
        attention_efficiency: (device_attention / device_gemm).min(1.0),
        bandwidth_efficiency: 1.0,
        // Uploads are paced to the given bandwidth exactly, or run at
        // memcpy speed; downloads always run at memcpy speed.
        h2d_gb_per_s: h2d.unwrap_or(best.memcpy) / GB,
        d2h_gb_per_s: best.memcpy / GB,
        link_efficiency: 1.0,
        link_latency_us: copy_us,
        launch_us,
        peer_to_peer: false,
        // Every upload goes through its one paced engine.
        copy_engines: 1,
    };
    let notes = format!(
        "Calibrated by duplex on {threads} thread(s), ISA {}: DRAM read {:.1} GB/s on 1 thread, {:.1} GB/s on {threads}; \
         FP8 GEMV 7168->2048 {:.2}, 2048->7168 {:.2}, V3 MoE layer {:.2} of the read; par_matmul BF16 path {:.1} GFLOP/s, \
         F32 reference {:.2} GFLOP/s (1 thread); MLA decode attention {:.1} GFLOP/s, prefill attention {:.1} GFLOP/s; memcpy {:.1} GB/s; emulated device: launch {:.1} us, copy {:.1} us, \
         uploads {}. Best of {passes} pass(es).",
        isa.name(),
        best.read_one / GB,
        best.read_all / GB,
        best.gemv_gate_up / best.read_all,
        best.gemv_down / best.read_all,
        best.moe_layer / best.read_all,
        best.gemm_bf16 / GB,
        best.gemm_f32 / GB,
        best.attention / GB,
        best.prefill_attention / GB,
        best.memcpy / GB,
        launch_us,
        copy_us,
        c.emulated_h2d_gb_per_s.map_or("at memcpy speed".to_string(), |g| format!("paced to {g} GB/s")),
    );
    let hw = Hardware { name: "this-machine".into(), notes, cpu, devices: vec![device] };
    hw.validate().map_err(|e| DeviceError::Invalid(format!("calibration gave an unusable description: {e}")))?;
    Ok(hw)
}

/// `hw` as a TOML description that [`Hardware::load`] reads back.
pub fn to_toml(hw: &Hardware) -> String {
    let body = toml::to_string(hw).expect("a hardware description is plain TOML");
    format!("# Written by `duplex simulate --calibrate`: measured figures, see `notes`.\n{body}")
}
