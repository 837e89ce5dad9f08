//! A pure streaming read, the yardstick for the memory-bound kernels: a GEMV
//! is "fast" when it moves its weights at the rate this loop reads bytes.

use super::isa::Isa;

/// Read every byte of `buf` once and fold it into a checksum, so the loads
/// cannot be optimised away. Run it over a buffer much larger than the
/// last-level cache to measure DRAM read bandwidth; run it on several threads
/// over disjoint parts for the machine total. The checksum depends on the
/// ISA level and is meaningless.
///
/// The buffer is read as [`STREAMS`] interleaved sequential streams (one
/// 64-byte line from each in turn, each into its own accumulator), not one:
/// a single thread's bandwidth is bounded by how many misses it has in
/// flight, and the hardware prefetchers track streams, so several streams
/// move more bytes per second than one (here ~16 GB/s against ~11 GB/s).
/// The GEMV kernels read several rows at once, so this is the fair bar. Like
/// them, each stream also prefetches [`PREFETCH`] bytes ahead, which on this
/// class of machine moves more bytes than the hardware prefetchers alone.
pub fn read_bytes(isa: Isa, buf: &[u8]) -> u64 {
    let done = match isa.usable() {
        Isa::Portable => (0, 0),
        // SAFETY: `usable()` guarantees the features each path enables.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { x86::avx2(buf) },
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 | Isa::Avx512Bf16 | Isa::Avx512Fp16 => unsafe { x86::avx512(buf) },
        #[cfg(not(target_arch = "x86_64"))]
        _ => (0, 0),
    };
    // Whatever the SIMD loop left (all of it on the portable level): plain
    // sequential 64-bit words.
    let rest = &buf[done.0..];
    let mut acc = [0u64; 8];
    let mut chunks = rest.chunks_exact(64);
    for chunk in &mut chunks {
        for (a, word) in acc.iter_mut().zip(chunk.chunks_exact(8)) {
            *a ^= u64::from_le_bytes(word.try_into().unwrap());
        }
    }
    let tail = chunks.remainder().iter().fold(0u64, |h, &b| h.rotate_left(8) ^ b as u64);
    acc.iter().fold(done.1 ^ tail, |h, &a| h.wrapping_add(a))
}

/// Interleaved streams per [`read_bytes`] call.
pub const STREAMS: usize = 8;

/// Software prefetch distance per stream, in bytes.
pub const PREFETCH: usize = 1024;

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{PREFETCH, STREAMS};
    use std::arch::x86_64::*;

    /// Returns (bytes consumed, checksum of them): the first
    /// `STREAMS · part` bytes, `part` a multiple of 64.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn avx512(buf: &[u8]) -> (usize, u64) {
        let part = buf.len() / STREAMS / 64 * 64;
        let p = buf.as_ptr();
        let mut acc = [_mm512_setzero_si512(); STREAMS];
        for i in (0..part).step_by(64) {
            for (s, a) in acc.iter_mut().enumerate() {
                // SAFETY: s · part + i + 64 <= STREAMS · part <= buf.len(); a
                // prefetch past the end is a hint and never faults.
                let v = unsafe {
                    _mm_prefetch(p.wrapping_add(s * part + i + PREFETCH).cast(), _MM_HINT_T0);
                    _mm512_loadu_si512(p.add(s * part + i).cast())
                };
                *a = _mm512_xor_si512(*a, v);
            }
        }
        let all = acc.iter().fold(_mm512_setzero_si512(), |s, &a| _mm512_add_epi64(s, a));
        (STREAMS * part, _mm512_reduce_add_epi64(all) as u64)
    }

    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn avx2(buf: &[u8]) -> (usize, u64) {
        let part = buf.len() / STREAMS / 64 * 64;
        let p = buf.as_ptr();
        let mut acc = [_mm256_setzero_si256(); STREAMS];
        for i in (0..part).step_by(64) {
            for (s, a) in acc.iter_mut().enumerate() {
                // SAFETY: s · part + i + 64 <= STREAMS · part <= buf.len().
                let (lo, hi) = unsafe {
                    _mm_prefetch(p.wrapping_add(s * part + i + PREFETCH).cast(), _MM_HINT_T0);
                    let q = p.add(s * part + i);
                    (_mm256_loadu_si256(q.cast()), _mm256_loadu_si256(q.add(32).cast()))
                };
                *a = _mm256_xor_si256(*a, _mm256_xor_si256(lo, hi));
            }
        }
        let all = acc.iter().fold(_mm256_setzero_si256(), |s, &a| _mm256_add_epi64(s, a));
        let mut lanes = [0u64; 4];
        // SAFETY: `lanes` is 32 bytes.
        unsafe { _mm256_storeu_si256(lanes.as_mut_ptr().cast(), all) };
        (STREAMS * part, lanes.iter().fold(0u64, |s, &l| s.wrapping_add(l)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::isa;

    #[test]
    fn reads_everything() {
        // The checksum must change when any byte changes, at every level and
        // for lengths that exercise the SIMD body and the scalar tail.
        for isa in isa::supported() {
            for len in [0usize, 1, 63, 64, 255, 256, 511, 512, 513, 4096 + 77, 3 * 4096 + 5] {
                let buf: Vec<u8> = (0..len).map(|i| (i * 131 + 7) as u8).collect();
                let base = read_bytes(isa, &buf);
                for pos in [0, len / 3, len.saturating_sub(1)].into_iter().filter(|&p| p < len) {
                    let mut changed = buf.clone();
                    changed[pos] ^= 0x10;
                    assert_ne!(read_bytes(isa, &changed), base, "{isa} len {len} pos {pos}");
                }
            }
        }
    }
}
