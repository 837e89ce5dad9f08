//! The cost model against hand-computed rooflines, the shipped hardware
//! descriptions, and a quick calibration of this machine.

use duplex_kernels::device::{DevicePtr, DeviceWeight, GqaDims, Matrix, MlaDims, Op, PagedKv};
use duplex_kernels::router::{RouterParams, ScoringFunc};
use duplex_kernels::{Precision, WeightFormat};
use duplex_sim::calibrate::{self, Calibration};
use duplex_sim::cost::{op_work, WorkKind};
use duplex_sim::hardware::{Hardware, RowFractions, BUILTIN};
use std::time::Duration;

const FP8: WeightFormat = WeightFormat::Fp8E4m3 { block: [128, 128] };

fn paper() -> Hardware {
    Hardware::builtin("paper-node").expect("the paper's node is shipped")
}

/// An F32 `rows × cols` matrix in a buffer of its own.
fn matrix(rows: usize, cols: usize) -> Matrix {
    DevicePtr { addr: 0, bytes: rows * cols * 4 }.matrix(rows, cols)
}

fn buffer(bytes: usize) -> DevicePtr {
    DevicePtr { addr: 0, bytes }
}

/// An FP8 weight with 128×128 scale blocks.
fn fp8_weight(rows: usize, cols: usize) -> DeviceWeight {
    DeviceWeight { data: buffer(rows * cols), scales: buffer(rows.div_ceil(128) * cols.div_ceil(128) * 4), rows, cols, format: FP8 }
}

fn gemm(tokens: usize, rows: usize, cols: usize) -> Op {
    Op::Gemm { w: fp8_weight(rows, cols), x: matrix(tokens, cols), y: matrix(tokens, rows), precision: Precision::Bf16, round: false }
}

fn secs(d: Duration) -> f64 {
    d.as_secs_f64()
}

/// Equal to within a nanosecond's rounding (Durations are whole nanoseconds).
fn assert_close(got: f64, want: f64) {
    assert!((got - want).abs() <= 2e-9 + want * 1e-9, "got {got} s, want {want} s");
}

#[test]
fn decode_gemv_is_bandwidth_bound_at_the_effective_bandwidth() {
    let hw = paper();
    let gpu = &hw.devices[0];
    // DeepSeek-V3's gate/up shape: 2048 rows of 7168 FP8 columns, one token.
    let op = gemm(1, 2048, 7168);
    let work = op_work(&op);
    let bytes = (2048 * 7168 + 16 * 56 * 4 + 7168 * 4 + 2048 * 4) as f64;
    assert_eq!(work.bytes, bytes);
    assert_eq!(work.flops, 2.0 * 2048.0 * 7168.0);
    let memory = bytes / (gpu.memory_gb_per_s * 1e9 * gpu.bandwidth_efficiency);
    let compute = work.flops / (gpu.bf16_tflops * 1e12 * gpu.gemm_efficiency);
    assert!(memory > 10.0 * compute, "a GEMV must be far from compute-bound: {memory} vs {compute}");
    assert_close(secs(gpu.op_time(&op)), memory + gpu.launch_us * 1e-6);
    // On the CPU with every core: the machine's read bandwidth at the GEMV fraction.
    let cpu = &hw.cpu;
    let bandwidth = (cpu.cores() as f64 * cpu.core_read_gb_per_s).min(cpu.dram_read_gb_per_s * cpu.read_efficiency) * 1e9 * cpu.gemv_efficiency;
    assert_close(secs(cpu.time(&work, cpu.cores())), bytes / bandwidth);
}

#[test]
fn prefill_gemm_is_compute_bound() {
    let hw = paper();
    let gpu = &hw.devices[0];
    let op = gemm(4096, 2048, 7168);
    let work = op_work(&op);
    let compute = work.flops / (gpu.bf16_tflops * 1e12 * gpu.gemm_efficiency);
    let memory = work.bytes / (gpu.memory_gb_per_s * 1e9 * gpu.bandwidth_efficiency);
    assert!(compute > memory, "4096 tokens must be compute-bound: {compute} vs {memory}");
    assert_close(secs(gpu.op_time(&op)), compute + gpu.launch_us * 1e-6);
    // The F32 path meets the F32 peak instead.
    let Op::Gemm { w, x, y, .. } = op else { unreachable!() };
    let f32_op = Op::Gemm { w, x, y, precision: Precision::F32, round: false };
    assert_close(secs(gpu.op_time(&f32_op)), work.flops / (gpu.f32_tflops * 1e12 * gpu.gemm_efficiency) + gpu.launch_us * 1e-6);
}

/// A measured table of the products' rate against their rows slows the
/// products with few rows, interpolated in log2(rows) and held beyond its
/// ends, and leaves other ops alone.
#[test]
fn products_with_few_rows_run_at_their_measured_fraction() {
    let mut gpu = paper().devices[0].clone();
    let time = |gpu: &duplex_sim::hardware::DeviceSpec, tokens: usize| secs(gpu.op_time(&gemm(tokens, 2048, 7168))) - gpu.launch_us * 1e-6;
    let plain: Vec<f64> = [8, 16, 32, 64, 4096].iter().map(|&n| time(&gpu, n)).collect();
    gpu.gemm_row_fractions = RowFractions(vec![[16.0, 0.25], [64.0, 0.75], [512.0, 1.0]]);
    let at = |n: usize| gpu.gemm_row_fractions.at(n);
    assert_eq!((at(1), at(16), at(32), at(64), at(512), at(4096)), (0.25, 0.25, 0.5, 0.75, 1.0, 1.0));
    // 4096 tokens are compute-bound at the full rate: unchanged. 64 and
    // fewer are compute-bound at this GPU's rate once slowed this much.
    assert_close(time(&gpu, 4096), plain[4]);
    for (i, (n, fraction)) in [(16, 0.25), (32, 0.5), (64, 0.75)].into_iter().enumerate() {
        let work = op_work(&gemm(n, 2048, 7168));
        let compute = work.flops / (gpu.bf16_tflops * 1e12 * gpu.gemm_efficiency * fraction);
        let memory = work.bytes / (gpu.memory_gb_per_s * 1e9 * gpu.bandwidth_efficiency);
        assert_close(time(&gpu, n), compute.max(memory));
        assert!(time(&gpu, n) >= plain[i + 1], "{n} rows");
    }
    // The CPU's products likewise.
    let mut cpu = paper().cpu;
    let before = secs(cpu.time(&op_work(&gemm(16, 2048, 7168)), cpu.cores()));
    cpu.gemm_row_fractions = RowFractions(vec![[16.0, 0.5], [512.0, 1.0]]);
    let after = secs(cpu.time(&op_work(&gemm(16, 2048, 7168)), cpu.cores()));
    assert!(after > before * 1.5, "{before} s, then {after} s");
    // Rows must increase; fractions are in (0, 2].
    let text = include_str!("../../../deploy/hardware/rtx4090-workstation.toml");
    let with = |table: &str| text.replace("gemm_efficiency = 0.70", &format!("gemm_efficiency = 0.70\ngemm_row_fractions = {table}"));
    let hw = Hardware::parse(&with("[[16.0, 0.4], [512.0, 1.0]]"), "rows").expect("a table reads");
    assert_eq!(hw.devices[0].gemm_row_fractions, RowFractions(vec![[16.0, 0.4], [512.0, 1.0]]));
    let e = Hardware::parse(&with("[[512.0, 1.0], [16.0, 0.4]]"), "rows").expect_err("rows must increase").to_string();
    assert!(e.contains("gemm_row_fractions"), "{e}");
    let e = Hardware::parse(&with("[[16.0, 0.0]]"), "rows").expect_err("a zero fraction").to_string();
    assert!(e.contains("gemm_row_fractions"), "{e}");
}

#[test]
fn cpu_bandwidth_grows_with_threads_until_the_machine_saturates() {
    let cpu = paper().cpu;
    let one = cpu.read_bandwidth(1);
    assert_eq!(one, cpu.core_read_gb_per_s * 1e9);
    assert_eq!(cpu.read_bandwidth(2), 2.0 * one);
    let machine = cpu.dram_read_gb_per_s * cpu.read_efficiency * 1e9;
    assert!(cpu.read_bandwidth(cpu.cores()) <= machine);
    assert_eq!(cpu.read_bandwidth(10 * cpu.cores()), cpu.read_bandwidth(cpu.cores()));
    let mut saturated = cpu.clone();
    saturated.core_read_gb_per_s = machine / 1e9;
    assert_eq!(saturated.read_bandwidth(4), machine);
}

#[test]
fn doubling_the_link_halves_an_upload() {
    let mut gpu = paper().devices[0].clone();
    let bytes = 256 << 20;
    let transfer = |g: &duplex_sim::hardware::DeviceSpec| secs(g.h2d_time(bytes)) - g.link_latency_us * 1e-6;
    let before = transfer(&gpu);
    assert_close(before, bytes as f64 / (gpu.h2d_gb_per_s * 1e9 * gpu.link_efficiency));
    gpu.h2d_gb_per_s *= 2.0;
    assert_close(transfer(&gpu), before / 2.0);
    // Downloads use their own direction's figure.
    assert_close(secs(gpu.d2h_time(bytes)) - gpu.link_latency_us * 1e-6, bytes as f64 / (gpu.d2h_gb_per_s * 1e9 * gpu.link_efficiency));
}

/// One op of every variant, with model-like shapes.
fn every_op() -> Vec<Op> {
    let p = Precision::Bf16;
    let mla = MlaDims { heads: 16, dn: 128, dr: 64, dv: 128, dc: 512 };
    let gqa = GqaDims { heads: 32, kv_heads: 4, head_dim: 128 };
    let kv = PagedKv { pool: buffer(8 * 4 * 16 * 576 * 4), n_layers: 4, block_size: 16, entry_dim: 576 };
    let params = RouterParams { n_experts: 64, top_k: 6, n_group: 1, topk_group: 1, norm_topk_prob: true, routed_scaling_factor: 1.0, scoring: ScoringFunc::Sigmoid };
    let (n, d) = (32, 2048);
    vec![
        gemm(n, 1024, d),
        Op::GemmBatched { w: fp8_weight(512, 128), w_step: 512 * 128, scales_step: 16, x: matrix(1, 128), x_rows: 1, y: matrix(1, 512), y_rows: 1, count: 16, precision: p, round: true },
        Op::RmsNorm { x: matrix(n, d), weight: buffer(d * 4), out: matrix(n, d), eps: 1e-6, precision: p },
        Op::Rope { x: matrix(n * 16, 64), cos: matrix(n, 32), sin: matrix(n, 32), rows_per_position: 16, interleaved: true, precision: p },
        Op::SiluMul { gate: matrix(n, 1024), up: matrix(n, 1024), precision: p },
        Op::Add { h: matrix(n, d), delta: matrix(n, d), precision: p },
        Op::RoundBf16 { x: matrix(n, d) },
        Op::Zero { x: matrix(n, d) },
        Op::Route { logits: matrix(n, 64), bias: Some(buffer(64 * 4)), params, ids: buffer(n * 6 * 4), weights: matrix(n, 6), precision: p },
        Op::GatherRows { src: matrix(n, d), rows: buffer(n * 4), count: n, dst: matrix(n, d) },
        Op::ScatterAddRows { src: matrix(n, d), rows: buffer(n * 4), scales: buffer(n * 4), count: n, dst: matrix(n, d) },
        Op::Embedding { table: DeviceWeight { data: buffer(1000 * d * 2), scales: buffer(0), rows: 1000, cols: d, format: WeightFormat::Bf16 }, first_row: 0, ids: buffer(n * 4), count: n, out: matrix(n, d), precision: p },
        Op::MlaPrefill { q: matrix(n, 16 * 192), kv: matrix(64 + n, 16 * 256), latents: matrix(64 + n, 576), out: matrix(n, 16 * 128), start: 64, dims: mla, scale: 0.1, precision: p },
        Op::MlaDecode { q_latent: matrix(16, 512), q_pe: matrix(16, 64), latents: matrix(100, 576), out: matrix(16, 512), scale: 0.1, precision: p },
        Op::GqaAttention { q: matrix(n, 32 * 128), k: matrix(n, 4 * 128), v: matrix(n, 4 * 128), out: matrix(n, 32 * 128), start: 0, dims: gqa, scale: 0.1, precision: p },
        Op::MlaPrefillPart { q: matrix(n, 16 * 192), kv: matrix(n, 16 * 256), latents: matrix(n, 576), out: matrix(n, 16 * 128), lse: matrix(n, 16), start: n, key_start: 0, dims: mla, scale: 0.1, precision: p },
        Op::GqaAttentionPart { q: matrix(n, 32 * 128), k: matrix(n, 4 * 128), v: matrix(n, 4 * 128), out: matrix(n, 32 * 128), lse: matrix(n, 32), start: 0, key_start: 0, dims: gqa, scale: 0.1, precision: p },
        Op::AttentionMerge { out: matrix(n, 32 * 128), lse: matrix(n, 32), part: matrix(n, 32 * 128), part_lse: matrix(n, 32), heads: 32 },
        Op::KvStore { entries: matrix(n, 576), kv, table: buffer(8 * 4), blocks: 8, layer: 1, start: 0 },
        Op::KvGather { kv, table: buffer(8 * 4), blocks: 8, layer: 1, out: matrix(n, 576) },
    ]
}

#[test]
fn every_op_takes_a_finite_positive_time() {
    let hw = paper();
    let ops = every_op();
    assert_eq!(ops.len(), 20, "one of each Op variant");
    for op in &ops {
        let work = op_work(op);
        assert!(work.bytes > 0.0 && work.bytes.is_finite() && work.flops >= 0.0 && work.flops.is_finite(), "{op:?}: {work:?}");
        for t in [hw.devices[0].op_time(op), hw.cpu.time(&work, 8)] {
            assert!(t > Duration::ZERO && t < Duration::from_secs(1), "{op:?}: {t:?}");
        }
    }
}

#[test]
fn causal_attention_counts_the_visible_keys_only() {
    let gqa = GqaDims { heads: 8, kv_heads: 8, head_dim: 64 };
    let attention = |start: usize, n: usize| Op::GqaAttention { q: matrix(n, 512), k: matrix(start + n, 512), v: matrix(start + n, 512), out: matrix(n, 512), start, dims: gqa, scale: 1.0, precision: Precision::Bf16 };
    // 4 queries from position 0 see 1 + 2 + 3 + 4 keys; from position 10, 11 + … + 14.
    assert_eq!(op_work(&attention(0, 4)).flops, 4.0 * 10.0 * 8.0 * 64.0);
    assert_eq!(op_work(&attention(10, 4)).flops, 4.0 * 50.0 * 8.0 * 64.0);
    assert_eq!(op_work(&attention(10, 4)).kind, WorkKind::Attention);
    // A piece holding keys 8..12 gives query 10 three of them, 11 and later four.
    let part = Op::GqaAttentionPart { q: matrix(4, 512), k: matrix(4, 512), v: matrix(4, 512), out: matrix(4, 512), lse: matrix(4, 8), start: 10, key_start: 8, dims: gqa, scale: 1.0, precision: Precision::Bf16 };
    assert_eq!(op_work(&part).flops, 4.0 * (3.0 + 4.0 + 4.0 + 4.0) * 8.0 * 64.0);
}

#[test]
fn shipped_descriptions_load_and_validate() {
    for name in BUILTIN {
        let hw = Hardware::builtin(name).unwrap_or_else(|| panic!("{name} is shipped"));
        assert_eq!(hw.name, *name);
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("../../deploy/hardware/{name}.toml"));
        assert_eq!(Hardware::load(&path).expect("loads from its file"), hw);
    }
    let hw = paper();
    assert_eq!((hw.cpu.sockets, hw.cpu.cores(), hw.devices.len()), (2, 64, 2));
    assert!(!hw.devices[0].peer_to_peer);
    assert!(Hardware::builtin("no-such-machine").is_none());
}

#[test]
fn a_typo_or_a_bad_figure_is_refused_by_name() {
    let text = include_str!("../../../deploy/hardware/rtx4090-workstation.toml");
    let typo = text.replace("dram_read_gb_per_s", "dram_read_gbps");
    let e = Hardware::parse(&typo, "typo.toml").expect_err("an unknown key is an error").to_string();
    assert!(e.contains("dram_read_gbps") && e.contains("typo.toml"), "{e}");
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("zero.toml");
    std::fs::write(&path, text.replace("memory_gb_per_s = 1008.0", "memory_gb_per_s = 0.0")).unwrap();
    let e = Hardware::load(&path).expect_err("a zero bandwidth is an error").to_string();
    assert!(e.contains("memory_gb_per_s") && e.contains("RTX 4090"), "{e}");
    let e = Hardware::parse(&text.replace("link_efficiency = 0.83", "link_efficiency = 1.2"), "eff").expect_err("an efficiency above 1").to_string();
    assert!(e.contains("link_efficiency"), "{e}");
    let e = Hardware::parse(&text.replace("cores_per_socket = 32", "cores_per_socket = 0"), "cores").expect_err("no cores").to_string();
    assert!(e.contains("cores"), "{e}");
}

#[test]
fn quick_calibration_measures_this_machine() {
    let hw = calibrate::this_machine(&Calibration { threads: 0, device_threads: 0, emulated_h2d_gb_per_s: Some(8.0), device_memory_mib: 1024, quick: true }).expect("calibrates");
    println!("{}", calibrate::to_toml(&hw));
    let cpu = &hw.cpu;
    for (what, v) in [("read", cpu.dram_read_gb_per_s), ("core read", cpu.core_read_gb_per_s), ("f32", cpu.f32_tflops), ("bf16", cpu.bf16_tflops)] {
        assert!(v.is_finite() && v > 0.0, "{what}: {v}");
    }
    assert!(cpu.gemv_efficiency > 0.0 && cpu.gemv_efficiency <= 1.5, "gemv_efficiency {}", cpu.gemv_efficiency);
    let device = &hw.devices[0];
    assert_eq!(device.h2d_gb_per_s, 8.0, "uploads are paced to the given bandwidth");
    assert!(device.d2h_gb_per_s > 0.0 && device.launch_us > 0.0 && device.link_latency_us > 0.0);
    // The products' rate at other rows than the peak's, the peak's own at 1.
    for rows in [&cpu.gemm_row_fractions, &device.gemm_row_fractions] {
        let rows: Vec<f64> = rows.0.iter().map(|p| p[0]).collect();
        assert_eq!(rows, [16.0, 128.0, 512.0]);
    }
    assert_eq!(device.gemm_row_fractions.at(128), 1.0);
    // The written file reads back as the same description.
    assert_eq!(Hardware::parse(&calibrate::to_toml(&hw), "calibrated").expect("reads back"), hw);
}

/// `cargo test -p duplex-sim --test cost -- --ignored --nocapture full_calibration`
#[test]
#[ignore = "benchmark: measures this machine with the default sizes and prints the description"]
fn full_calibration_is_quick_enough() {
    let t0 = std::time::Instant::now();
    let hw = calibrate::this_machine(&Calibration::default()).expect("calibrates");
    println!("{}", calibrate::to_toml(&hw));
    let took = t0.elapsed();
    println!("took {took:?}");
    assert!(took < Duration::from_secs(20), "calibration took {took:?}");
}
