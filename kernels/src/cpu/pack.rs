//! Activation layouts for the SIMD GEMV kernels, and 64-byte-aligned scratch.
//!
//! The kernels decode weights into whatever lane order is cheapest (for FP8,
//! the odd and even bytes of a 64-byte load go to different registers), so
//! the activations are rearranged once per call into the same order: per
//! token, per scale block, `ceil(block / chunk)` chunks of `chunk` slots, slot
//! `j` holding column `perm(j)` of that chunk and zero past the block's end.
//! The zero padding is what lets a kernel run a partial chunk at full width:
//! padded lanes contribute `w · 0`. Copying `n × cols` activations is
//! negligible next to the `rows × cols` weights each call streams.

use std::marker::PhantomData;

/// Element types that may live in an [`AlignedBuf`]: plain data for which the
/// all-zero bit pattern is a valid value.
///
/// # Safety
/// Implementors must be `Copy`, have no padding or invalid bit patterns, and
/// an alignment dividing 64.
pub(super) unsafe trait Pod: Copy + 'static {}
// SAFETY: primitive numbers; every bit pattern is valid.
unsafe impl Pod for u16 {}
// SAFETY: as above.
unsafe impl Pod for f32 {}

#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Line([u8; 64]);

/// A zero-initialised buffer whose start is 64-byte aligned, so that full
/// cache-line vector loads from it never straddle two lines.
pub(super) struct AlignedBuf<T: Pod> {
    lines: Vec<Line>,
    len: usize,
    _t: PhantomData<T>,
}

impl<T: Pod> AlignedBuf<T> {
    pub fn zeroed(len: usize) -> Self {
        let bytes = len * std::mem::size_of::<T>();
        Self { lines: vec![Line([0; 64]); bytes.div_ceil(64)], len, _t: PhantomData }
    }

    pub fn as_slice(&self) -> &[T] {
        // SAFETY: the lines hold at least `len * size_of::<T>()` initialised
        // bytes, are suitably aligned (64 is a multiple of T's alignment), and
        // any bit pattern is a valid T (`Pod`).
        unsafe { std::slice::from_raw_parts(self.lines.as_ptr().cast(), self.len) }
    }

    pub fn as_mut_slice(&mut self) -> &mut [T] {
        // SAFETY: as in `as_slice`, and `&mut self` makes the borrow unique.
        unsafe { std::slice::from_raw_parts_mut(self.lines.as_mut_ptr().cast(), self.len) }
    }
}

/// `n` tokens of activations rearranged for one kernel (see module docs).
pub(super) struct Packed<T: Pod> {
    buf: AlignedBuf<T>,
    /// Elements per token.
    stride: usize,
    chunk: usize,
    /// Chunks per scale block.
    cpb: usize,
}

impl<T: Pod> Packed<T> {
    /// Pack `x` (`n` rows of `cols` BF16 values) with column blocks `block`
    /// wide, `chunk` slots per chunk, slot `j` taking column `perm(j)` of its
    /// chunk, each value converted by `conv`.
    pub fn new(
        x: &[u16],
        n: usize,
        cols: usize,
        block: usize,
        chunk: usize,
        perm: impl Fn(usize) -> usize,
        conv: impl Fn(u16) -> T,
    ) -> Self {
        debug_assert!(block > 0 && chunk > 0 && x.len() == n * cols);
        let cpb = block.div_ceil(chunk);
        let stride = cols.div_ceil(block) * cpb * chunk;
        let perm: Vec<usize> = (0..chunk).map(perm).collect();
        let mut buf = AlignedBuf::<T>::zeroed(n * stride);
        let dst = buf.as_mut_slice();
        for (t, xt) in x.chunks_exact(cols.max(1)).take(n).enumerate() {
            for (cb, xb) in xt.chunks(block).enumerate() {
                for (q, xc) in xb.chunks(chunk).enumerate() {
                    let base = t * stride + (cb * cpb + q) * chunk;
                    for (j, &src) in perm.iter().enumerate() {
                        if let Some(&v) = xc.get(src) {
                            dst[base + j] = conv(v);
                        }
                    }
                }
            }
        }
        Self { buf, stride, chunk, cpb }
    }

    #[cfg(test)]
    pub fn chunks_per_block(&self) -> usize {
        self.cpb
    }

    /// Pointer to chunk `q` of block `cb` for token `t`; the following
    /// chunks of the same block follow contiguously.
    #[inline]
    pub fn chunk(&self, t: usize, cb: usize, q: usize) -> *const T {
        let i = t * self.stride + (cb * self.cpb + q) * self.chunk;
        debug_assert!(i + self.chunk <= self.buf.len);
        // SAFETY (of the add): callers pass t < n, cb < column blocks,
        // q < chunks per block, so `i` is inside the buffer.
        unsafe { self.buf.as_slice().as_ptr().add(i) }
    }
}

/// BF16 bits to f32 (exact).
#[inline]
pub(super) fn bf16_to_f32(b: u16) -> f32 {
    f32::from_bits((b as u32) << 16)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_places_and_pads() {
        // 2 tokens, 5 columns, blocks of 3, chunks of 2 reversed.
        let x: Vec<u16> = (1..=10).collect();
        let p = Packed::new(&x, 2, 5, 3, 2, |j| 1 - j, |v| v);
        assert_eq!(p.chunks_per_block(), 2);
        let all = p.buf.as_slice();
        // token 0: block 0 = cols 0..3 -> chunks [1,0] [_,2]; block 1 = cols 3..5 -> [4,3] [pad].
        assert_eq!(&all[..8], &[2, 1, 0, 3, 5, 4, 0, 0]);
        assert_eq!(&all[8..], &[7, 6, 0, 8, 10, 9, 0, 0]);
        assert_eq!(p.chunk(1, 1, 0) as usize % 2, 0);
        assert_eq!(all.as_ptr() as usize % 64, 0);
    }
}
