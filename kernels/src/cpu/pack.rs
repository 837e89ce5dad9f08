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

use std::cell::RefCell;
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

/// Spare buffers per thread. The kernels pack activations and decode tiles
/// on every call; taking a buffer a previous call left behind keeps the
/// allocator off the hot path once each thread has seen its largest call.
const SPARES: usize = 4;

thread_local! {
    static SPARE_LINES: RefCell<Vec<Vec<Line>>> = const { RefCell::new(Vec::new()) };
}

impl<T: Pod> AlignedBuf<T> {
    pub fn zeroed(len: usize) -> Self {
        let n = (len * std::mem::size_of::<T>()).div_ceil(64);
        // The spare with the most room (resizing it allocates only if none is big enough).
        let mut lines = SPARE_LINES
            .with_borrow_mut(|spares| {
                let best = (0..spares.len()).max_by_key(|&i| spares[i].capacity())?;
                Some(spares.swap_remove(best))
            })
            .unwrap_or_default();
        lines.clear();
        lines.resize(n, Line([0; 64]));
        Self { lines, len, _t: PhantomData }
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

impl<T: Pod> Drop for AlignedBuf<T> {
    fn drop(&mut self) {
        let lines = std::mem::take(&mut self.lines);
        if lines.capacity() == 0 {
            return;
        }
        // `try_with`: during thread teardown the spares may be gone already.
        let _ = SPARE_LINES.try_with(|spares| {
            let mut spares = spares.borrow_mut();
            if spares.len() < SPARES {
                spares.push(lines);
            } else if let Some(smallest) = spares.iter_mut().min_by_key(|v| v.capacity()) {
                if smallest.capacity() < lines.capacity() {
                    *smallest = lines;
                }
            }
        });
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
    /// wide and `CHUNK` slots per chunk, each value converted by `conv`.
    /// A chunk is `K` classes of `CHUNK / K` slots: slot `i` of class `c`
    /// holds column `K · i + order[c]` of the chunk.
    #[inline]
    pub fn new<const CHUNK: usize, const K: usize>(
        x: &[u16],
        n: usize,
        cols: usize,
        block: usize,
        order: [usize; K],
        conv: impl Fn(u16) -> T,
    ) -> Self {
        debug_assert!(block > 0 && CHUNK.is_multiple_of(K) && x.len() == n * cols);
        debug_assert!(order.iter().all(|&o| o < K));
        let per_class = CHUNK / K;
        let cpb = block.div_ceil(CHUNK);
        let stride = cols.div_ceil(block) * cpb * CHUNK;
        let mut buf = AlignedBuf::<T>::zeroed(n * stride);
        let dst = buf.as_mut_slice();
        for (t, xt) in x.chunks_exact(cols.max(1)).take(n).enumerate() {
            for (cb, xb) in xt.chunks(block).enumerate() {
                for (q, xc) in xb.chunks(CHUNK).enumerate() {
                    let base = t * stride + (cb * cpb + q) * CHUNK;
                    let out = &mut dst[base..base + CHUNK];
                    match <&[u16; CHUNK]>::try_from(xc) {
                        // The common case, written as a de-interleave of
                        // groups of K so that it compiles to shuffles.
                        Ok(full) => {
                            for (i, group) in full.chunks_exact(K).enumerate() {
                                for (c, &o) in order.iter().enumerate() {
                                    out[c * per_class + i] = conv(group[o]);
                                }
                            }
                        }
                        // The block's last, partial chunk: the rest stays zero.
                        Err(_) => {
                            for (col, &v) in xc.iter().enumerate() {
                                let c = order.iter().position(|&o| o == col % K).unwrap_or(0);
                                out[c * per_class + col / K] = conv(v);
                            }
                        }
                    }
                }
            }
        }
        Self { buf, stride, chunk: CHUNK, cpb }
    }

    /// Every packed element of token `t`, padding included.
    pub fn token(&self, t: usize) -> &[T] {
        &self.buf.as_slice()[t * self.stride..(t + 1) * self.stride]
    }

    /// Every packed element of token `t`, padding included, to change.
    pub fn token_mut(&mut self, t: usize) -> &mut [T] {
        let stride = self.stride;
        &mut self.buf.as_mut_slice()[t * stride..(t + 1) * stride]
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_places_and_pads() {
        // 2 tokens, 5 columns, blocks of 3, chunks of 2 reversed.
        let x: Vec<u16> = (1..=10).collect();
        let p = Packed::new::<2, 2>(&x, 2, 5, 3, [1, 0], |v| v);
        assert_eq!(p.chunks_per_block(), 2);
        let all = p.buf.as_slice();
        // token 0: block 0 = cols 0..3 -> chunks [1,0] [_,2]; block 1 = cols 3..5 -> [4,3] [pad].
        assert_eq!(&all[..8], &[2, 1, 0, 3, 5, 4, 0, 0]);
        assert_eq!(&all[8..], &[7, 6, 0, 8, 10, 9, 0, 0]);
        assert_eq!(p.chunk(1, 1, 0) as usize % 2, 0);
        assert_eq!(all.as_ptr() as usize % 64, 0);
        // Four classes of two in a chunk of 8, with a partial last chunk.
        let x: Vec<u16> = (0..11).collect();
        let p = Packed::new::<8, 4>(&x, 1, 11, 11, [3, 1, 2, 0], |v| v);
        assert_eq!(p.buf.as_slice(), &[3, 7, 1, 5, 2, 6, 0, 4, 0, 0, 9, 0, 10, 0, 8, 0]);
    }
}
