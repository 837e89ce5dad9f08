//! [`vector_pairs`](super::vector_pairs)' two products on AMX BF16 tiles
//! (`tdpbf16ps`): the scores and the weighted sums of MLA decode attention.
//!
//! The pairs' layouts are already the tiles': a `tdpbf16ps` operand B is
//! rows of pairs along the summed axis, sixteen columns of four bytes. So
//! the scores of sixteen keys are keys (A: a key a row, sixteen pairs) ×
//! queries (B: `[pairs][16 lanes]`), and come out as `[key][lane]`, the
//! layout the online softmax takes; the weighted sums are probabilities (A:
//! an output a row, its weights of sixteen row pairs, transposed from
//! `[pair][lane]` here) × row pairs (B: sixteen columns of the rows), added
//! to the outputs in place. One `tdpbf16ps` is 16 × 16 × 32 multiply-adds.
//!
//! The kernels are generic over [`Tiles`], so [`ModelTiles`] runs them
//! on every CPU against the vector kernels. The tile unit sums in an order
//! of its own, so [`usable`] holds the CPU's tiles to the vector kernels
//! within f32 rounding of the sums before decode attention takes them.

use super::amx::{TileConfig, Tiles};
use super::vector::QUERY_LANES;

const L: usize = QUERY_LANES;
/// Pairs of a tile row (64 bytes).
const K: usize = 16;

/// Four-byte values without padding, which tiles may load as bytes.
trait Word: Copy {}
impl Word for u32 {}
impl Word for f32 {}

/// The bytes of `words` (tiles load and store bytes).
fn bytes<T: Word>(words: &[T]) -> &[u8] {
    // SAFETY: u32 and f32 (the only `Word`s) have no padding: every byte
    // of the slice is initialised.
    unsafe { std::slice::from_raw_parts(words.as_ptr().cast::<u8>(), std::mem::size_of_val(words)) }
}

fn bytes_mut(words: &mut [f32]) -> &mut [u8] {
    // SAFETY: as `bytes`; any bytes written back make some f32.
    unsafe { std::slice::from_raw_parts_mut(words.as_mut_ptr().cast::<u8>(), std::mem::size_of_val(words)) }
}

/// [`dots_16_pairs`](super::vector_pairs::dots_16_pairs) on tiles:
/// `out[t · 16 + l] = Σ_i qt[i · 16 + l] ⊙ keys[t · d + i]`.
pub fn dots_16_tiles<T: Tiles>(tiles: &mut T, qt: &[u32], keys: &[u32], out: &mut [f32]) {
    let d = qt.len() / L;
    assert!(qt.len() == d * L && d > 0 && keys.len().is_multiple_of(d), "dots_16_tiles: shapes");
    let n = keys.len() / d;
    assert_eq!(out.len(), n * L, "dots_16_tiles: one row of outputs per key");
    let (whole, rest) = (d / K, d % K);
    for t0 in (0..n).step_by(L) {
        let m = (n - t0).min(L);
        // C (tile 0): m keys × 16 lanes. A and B: whole chunks of sixteen
        // pairs (tiles 1, 2), the rest (tiles 3, 4).
        let mut config = TileConfig::new().with(0, m, 4 * L).with(1, m, 4 * K).with(2, K, 4 * L);
        if rest > 0 {
            config = config.with(3, m, 4 * rest).with(4, rest, 4 * L);
        }
        tiles.configure(&config);
        let keys = &keys[t0 * d..(t0 + m) * d];
        for c in 0..whole {
            tiles.load::<1>(&bytes(keys)[4 * K * c..], 4 * d);
            tiles.load::<2>(&bytes(qt)[4 * K * L * c..], 4 * L);
            tiles.dot_bf16::<0, 1, 2>();
        }
        if rest > 0 {
            tiles.load::<3>(&bytes(keys)[4 * K * whole..], 4 * d);
            tiles.load::<4>(&bytes(qt)[4 * K * L * whole..], 4 * L);
            tiles.dot_bf16::<0, 3, 4>();
        }
        tiles.store::<0>(bytes_mut(&mut out[t0 * L..(t0 + m) * L]), 4 * L);
    }
    tiles.release();
}

/// [`weighted_sum_16_pairs`](super::vector_pairs::weighted_sum_16_pairs)
/// on tiles: `out[o] += Σ_j wt[j · 16 + o] ⊙ rows[j]` for the
/// `out.len() / width` (at most 16) outputs of `width` floats.
pub fn weighted_sum_16_tiles<T: Tiles>(tiles: &mut T, wt: &[u32], rows: &[u32], out: &mut [f32], width: usize) {
    assert!(width > 0 && out.len().is_multiple_of(width) && out.len() / width <= L, "weighted_sum_16_tiles: out is not [≤ 16, width]");
    assert!(rows.len().is_multiple_of(width) && wt.len() == rows.len() / width * L, "weighted_sum_16_tiles: one row of weights per row pair");
    let (outputs, pairs) = (out.len() / width, rows.len() / width);
    if outputs == 0 {
        return;
    }
    let mut shape = None;
    for j0 in (0..pairs).step_by(K) {
        let k = (pairs - j0).min(K);
        // A: each output's weights of these row pairs, a row each.
        let mut a = [0u32; L * K];
        for (j, w) in wt[j0 * L..(j0 + k) * L].chunks_exact(L).enumerate() {
            for o in 0..outputs {
                a[o * K + j] = w[o];
            }
        }
        for c0 in (0..width).step_by(L) {
            let n = (width - c0).min(L);
            // C (tile 0): the outputs' columns c0..c0 + n, read and written
            // in place; A (tile 1); B (tile 2): the row pairs' columns.
            if shape != Some((k, n)) {
                tiles.configure(&TileConfig::new().with(0, outputs, 4 * n).with(1, outputs, 4 * k).with(2, k, 4 * n));
                shape = Some((k, n));
            }
            tiles.load::<0>(&bytes(out)[4 * c0..], 4 * width);
            tiles.load::<1>(bytes(&a), 4 * K);
            tiles.load::<2>(&bytes(rows)[4 * (j0 * width + c0)..], 4 * width);
            tiles.dot_bf16::<0, 1, 2>();
            tiles.store::<0>(&mut bytes_mut(out)[4 * c0..], 4 * width);
        }
    }
    tiles.release();
}

/// Whether MLA decode attention runs its pairs on the CPU's BF16 tiles:
/// the CPU has them and Linux permits them, `DUPLEX_AMX` does not turn
/// them off, and they pass a self-check at first use (scores and weighted
/// sums of several shapes on the tiles, each within f32 rounding of the
/// sums of the vector kernels' portable form). Decided once per process;
/// a failed check is said once on stderr.
#[cfg(target_arch = "x86_64")]
pub fn usable() -> bool {
    use std::sync::OnceLock;
    static USABLE: OnceLock<bool> = OnceLock::new();
    *USABLE.get_or_init(|| super::amx::checked_tiles(super::amx::HardwareTiles::for_bf16, self_check, "AMX BF16 tiles turned off, decode attention runs on the vector kernels instead"))
}

#[cfg(not(target_arch = "x86_64"))]
pub fn usable() -> bool {
    false
}

/// Both kernels on `tiles` against the portable vector kernels, at shapes
/// with whole and partial chunks of keys, pairs, outputs and columns.
pub fn self_check<T: Tiles>(tiles: &mut T) -> Result<(), String> {
    use super::isa::Isa;
    use super::vector_pairs::{dots_16_pairs, pair, pair_madd, weighted_sum_16_pairs};
    let mut s = 0x2545_f491_4f6c_dd1du64;
    let mut value = move || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        ((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * [0.02f32, 1.0, 40.0][(s % 3) as usize]
    };
    let pairs_of = |value: &mut dyn FnMut() -> f32, n: usize| (0..n).map(|_| pair(value(), value())).collect::<Vec<u32>>();
    // Within f32 rounding of `terms` additions to sums of magnitude `mag`:
    // each product is exact, so that is what any order can differ by.
    let close = |got: f32, want: f32, mag: f32, terms: usize| (got - want).abs() <= mag * f32::EPSILON * (terms as f32 + 2.0);
    let magnitude = |acc: f32, a: u32, b: u32| pair_madd(acc, a & 0x7fff_7fff, b & 0x7fff_7fff);
    for (keys, d) in [(16, 288), (5, 16), (21, 37), (1, 3)] {
        let (qt, k) = (pairs_of(&mut value, d * L), pairs_of(&mut value, d * keys));
        let (mut want, mut got) = (vec![0.0; keys * L], vec![0.0; keys * L]);
        dots_16_pairs(Isa::Portable, &qt, &k, &[], &mut want);
        dots_16_tiles(tiles, &qt, &k, &mut got);
        for t in 0..keys {
            for l in 0..L {
                let mag = (0..d).fold(0.0, |m, i| magnitude(m, qt[i * L + l], k[t * d + i]));
                if !close(got[t * L + l], want[t * L + l], mag, 2 * d) {
                    return Err(format!("scores of {keys} keys of {d} pairs: key {t} lane {l}: {} on the tiles, {} on the vectors", got[t * L + l], want[t * L + l]));
                }
            }
        }
    }
    for (outputs, pairs, width) in [(16, 16, 512), (16, 16, 24), (3, 21, 40), (1, 1, 1)] {
        let (wt, rows) = (pairs_of(&mut value, pairs * L), pairs_of(&mut value, pairs * width));
        let start: Vec<f32> = (0..outputs * width).map(|_| value()).collect();
        let (mut want, mut got) = (start.clone(), start.clone());
        weighted_sum_16_pairs(Isa::Portable, &wt, &rows, &mut want, width);
        weighted_sum_16_tiles(tiles, &wt, &rows, &mut got, width);
        for o in 0..outputs {
            for c in 0..width {
                let mag = (0..pairs).fold(start[o * width + c].abs(), |m, j| magnitude(m, wt[j * L + o], rows[j * width + c]));
                if !close(got[o * width + c], want[o * width + c], mag, 2 * pairs + 1) {
                    return Err(format!("weighted sums of {pairs} row pairs into {outputs} × {width}: output {o} column {c}: {} on the tiles, {} on the vectors", got[o * width + c], want[o * width + c]));
                }
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::amx::ModelTiles;

    #[test]
    fn model_tiles_pass_the_self_check() {
        self_check(&mut ModelTiles::default()).unwrap();
    }

    /// A planted slip (the weights of one row pair given to the next
    /// output) fails the self-check.
    #[test]
    fn a_misplaced_weight_is_caught() {
        struct Slipped(ModelTiles);
        impl Tiles for Slipped {
            fn configure(&mut self, config: &TileConfig) {
                self.0.configure(config)
            }
            fn zero<const T: u8>(&mut self) {
                self.0.zero::<T>()
            }
            fn load<const T: u8>(&mut self, src: &[u8], stride: usize) {
                if T == 1 && src.len() == 4 * L * K {
                    let mut bent = src.to_vec();
                    bent.swap(0, 4 * K);
                    return self.0.load::<T>(&bent, stride);
                }
                self.0.load::<T>(src, stride)
            }
            fn dot_i8<const C: u8, const A: u8, const B: u8>(&mut self) {
                self.0.dot_i8::<C, A, B>()
            }
            fn dot_bf16<const C: u8, const A: u8, const B: u8>(&mut self) {
                self.0.dot_bf16::<C, A, B>()
            }
            fn store<const T: u8>(&mut self, dst: &mut [u8], stride: usize) {
                self.0.store::<T>(dst, stride)
            }
            fn release(&mut self) {
                self.0.release()
            }
        }
        let err = self_check(&mut Slipped(ModelTiles::default())).unwrap_err();
        assert!(err.contains("weighted sums"), "{err}");
    }

    /// On an AMX machine the CPU's tiles pass the check that turns them
    /// on; elsewhere this says why it could not run.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn hardware_tiles_pass_the_self_check() {
        let Some(mut hw) = crate::cpu::amx::HardwareTiles::for_bf16() else {
            eprintln!("skipped: this CPU or kernel gives no AMX BF16 tiles (CPUID, XCR0 or arch_prctl)");
            return;
        };
        self_check(&mut hw).unwrap();
    }
}
