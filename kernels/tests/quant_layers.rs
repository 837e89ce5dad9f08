//! Linear layers and MoE layers over ggml block-quantized weights (GGUF
//! k-quants): the pool-parallel forms equal the reference, which quantizes
//! each token's activations to 8 bits and takes integer block dot products
//! as llama.cpp does.

use duplex_kernels::cpu::isa;
use duplex_kernels::linear::{matmul, WeightFormat, WeightView};
use duplex_kernels::moe::{moe_forward, ExpertCall, ExpertWeights, MoeScratch};
use duplex_kernels::parallel_linear::{par_matmul, LinearScratch};
use duplex_kernels::pool::{PoolConfig, ThreadPool};
use duplex_kernels::quant::{dequantize_row, QuantKind};

/// A small deterministic generator (xorshift).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn f32(&mut self, lo: f32, hi: f32) -> f32 {
        lo + (hi - lo) * (self.next() >> 40) as f32 / (1u64 << 24) as f32
    }
}

/// `rows × cols` of `kind`: random bytes with moderate f16 block scales
/// where each format keeps them (as real blocks have).
fn quant_matrix(rng: &mut Rng, kind: QuantKind, rows: usize, cols: usize) -> Vec<u8> {
    let bb = kind.block_bytes();
    let mut bytes: Vec<u8> = (0..rows * kind.row_bytes(cols).unwrap()).map(|_| rng.next() as u8).collect();
    for block in bytes.chunks_exact_mut(bb) {
        for &at in kind.f16_offsets() {
            let v = rng.f32(1e-3, 2e-2) * if rng.next() & 1 == 0 { 1.0 } else { -1.0 };
            block[at..at + 2].copy_from_slice(&half::f16::from_f32(v).to_le_bytes());
        }
    }
    bytes
}

/// One projection: its format, bytes and shape.
type Projection = (QuantKind, Vec<u8>, usize, usize);

fn view(kind: QuantKind, rows: usize, cols: usize, data: &[u8]) -> WeightView<'_> {
    WeightView { rows, cols, format: WeightFormat::Quant(kind), data, scales: &[] }
}

fn pools() -> Vec<ThreadPool> {
    vec![ThreadPool::new(&PoolConfig::single_node(1)), ThreadPool::new(&PoolConfig::single_node(3))]
}

#[test]
fn parallel_linear_layers_equal_the_reference_bit_for_bit() {
    let mut rng = Rng(0x5eed);
    let isa = isa::detect();
    for pool in pools() {
        for (kind, rows, cols) in [(QuantKind::Q4K, 70, 512), (QuantKind::Q6K, 33, 256), (QuantKind::Q5K, 16, 768), (QuantKind::Q8_0, 50, 96), (QuantKind::Q5_0, 40, 64), (QuantKind::Q5_1, 24, 96), (QuantKind::Q4_0, 17, 128)] {
            let data = quant_matrix(&mut rng, kind, rows, cols);
            let w = view(kind, rows, cols, &data);
            // 20 tokens take the parallel quantization; 1 and 3 the serial one.
            for n in [1, 3, 20] {
                let x: Vec<f32> = (0..n * cols).map(|_| rng.f32(-2.0, 2.0)).collect();
                let mut want = vec![0.0; n * rows];
                matmul(&w, &x, n, &mut want);
                let mut got = vec![f32::NAN; n * rows];
                par_matmul(&pool, isa, &w, &x, n, &mut got, &mut LinearScratch::default());
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&got), bits(&want), "{kind} {rows}×{cols}, {n} tokens, {} threads", pool.threads());
                // And the reference is the product it claims to be: close
                // to the dequantized weights times the unquantized input.
                let mut row = vec![0.0; cols];
                for r in 0..rows {
                    dequantize_row(kind, &data[r * kind.row_bytes(cols).unwrap()..(r + 1) * kind.row_bytes(cols).unwrap()], &mut row).unwrap();
                    for t in 0..n {
                        let exact: f32 = row.iter().zip(&x[t * cols..(t + 1) * cols]).map(|(a, b)| a * b).sum();
                        let mag: f32 = row.iter().zip(&x[t * cols..(t + 1) * cols]).map(|(a, b)| (a * b).abs()).sum();
                        assert!((want[t * rows + r] - exact).abs() <= 0.02 * mag + 1e-6, "{kind}: {} vs {exact} (magnitude {mag})", want[t * rows + r]);
                    }
                }
            }
        }
    }
}

#[test]
fn quantized_moe_layers_equal_the_per_token_reference() {
    let mut rng = Rng(0xfeed);
    let isa = isa::detect();
    let (d, inter) = (512, 256);
    // Experts as llama.cpp's Q4_K_M lays them out (Q4_K gate/up, Q6_K or
    // Q4_K down), as its Q5_K_M does where the down rows are not whole
    // k-quant blocks (Q5_1), and of the 32-element formats.
    let kinds = [
        [QuantKind::Q4K, QuantKind::Q4K, QuantKind::Q6K],
        [QuantKind::Q4K, QuantKind::Q4K, QuantKind::Q4K],
        [QuantKind::Q5K, QuantKind::Q5K, QuantKind::Q6K],
        [QuantKind::Q5K, QuantKind::Q5K, QuantKind::Q5_1],
        [QuantKind::Q8_0, QuantKind::Q5_0, QuantKind::Q4_0],
        [QuantKind::Q5_1, QuantKind::Q5_0, QuantKind::Q5_1],
    ];
    let experts: Vec<[Projection; 3]> = kinds
        .iter()
        .map(|&[g, u, dn]| [(g, quant_matrix(&mut rng, g, inter, d), inter, d), (u, quant_matrix(&mut rng, u, inter, d), inter, d), (dn, quant_matrix(&mut rng, dn, d, inter), d, inter)])
        .collect();
    let weights: Vec<ExpertWeights> =
        experts.iter().map(|[g, u, dn]| ExpertWeights { gate: view(g.0, g.2, g.3, &g.1), up: view(u.0, u.2, u.3, &u.1), down: view(dn.0, dn.2, dn.3, &dn.1) }).collect();
    for pool in pools() {
        for n in [1, 6, 40] {
            let x: Vec<f32> = (0..n * d).map(|_| rng.f32(-1.0, 1.0)).collect();
            // Expert e takes the tokens t with t % (e + 1) == 0; the last is "shared" (every token, weight 1).
            let tokens: Vec<Vec<(usize, f32)>> =
                (0..weights.len()).map(|e| if e + 1 == weights.len() { (0..n).map(|t| (t, 1.0)).collect() } else { (0..n).filter(|t| t % (e + 1) == 0).map(|t| (t, 0.3 + 0.2 * e as f32)).collect() }).collect();
            let calls: Vec<ExpertCall> = weights.iter().zip(&tokens).map(|(w, t)| ExpertCall { weights: *w, tokens: t, node: 0 }).collect();
            let mut got = vec![f32::NAN; n * d];
            let mut scratch = MoeScratch::default();
            // Twice on one scratch: the second call must not see the first's state.
            for _ in 0..2 {
                moe_forward(&pool, isa, &calls, &x, d, &mut got, &mut scratch);
            }
            let mut want = vec![0.0f32; n * d];
            for (w, toks) in weights.iter().zip(&tokens) {
                for &(t, weight) in toks {
                    let xt = &x[t * d..(t + 1) * d];
                    let (mut g, mut u, mut y) = (vec![0.0; inter], vec![0.0; inter], vec![0.0; d]);
                    matmul(&w.gate, xt, 1, &mut g);
                    matmul(&w.up, xt, 1, &mut u);
                    duplex_kernels::elementwise::silu_mul(&mut g, &u);
                    matmul(&w.down, &g, 1, &mut y);
                    want[t * d..(t + 1) * d].iter_mut().zip(&y).for_each(|(o, v)| *o += weight * v);
                }
            }
            // The SiLU's SIMD and scalar forms may differ in the last bit,
            // which can move a hidden value across an 8-bit rounding
            // boundary: a quantum of one element, far below this bound,
            // which a wrong token, expert or scale would exceed many times.
            let scale = want.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            for (i, (a, b)) in got.iter().zip(&want).enumerate() {
                assert!((a - b).abs() <= 5e-3 * scale, "{n} tokens, {} threads, element {i}: {a} vs {b} (scale {scale})", pool.threads());
            }
        }
    }
}
