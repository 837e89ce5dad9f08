//! Device memory as an arena: one region of fixed capacity, handed out in
//! aligned pieces and taken back, first fit, with neighbours merged on free.
//! Both backends allocate from one of these, so a device's memory use is
//! bounded by construction and allocation never calls the driver.

use super::DeviceError;
use std::collections::BTreeMap;

/// Every allocation starts on this boundary (what CUDA's allocator gives).
pub const ALIGN: usize = 256;

#[derive(Debug)]
pub struct Arena {
    capacity: usize,
    /// Free ranges: offset → length, never adjacent.
    free: BTreeMap<usize, usize>,
    /// Live allocations: offset → length.
    used: BTreeMap<usize, usize>,
}

impl Arena {
    pub fn new(capacity: usize) -> Self {
        let capacity = capacity / ALIGN * ALIGN;
        let mut free = BTreeMap::new();
        if capacity > 0 {
            free.insert(0, capacity);
        }
        Arena { capacity, free, used: BTreeMap::new() }
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    pub fn free_bytes(&self) -> usize {
        self.free.values().sum()
    }

    pub fn largest_free(&self) -> usize {
        self.free.values().copied().max().unwrap_or(0)
    }

    /// The offset of `bytes` fresh bytes (at least one alignment unit).
    pub fn alloc(&mut self, bytes: usize) -> Result<usize, DeviceError> {
        let size = bytes.max(1).div_ceil(ALIGN).saturating_mul(ALIGN);
        let Some((&offset, &len)) = self.free.iter().find(|(_, &len)| len >= size) else {
            return Err(DeviceError::OutOfMemory { requested: bytes, free: self.free_bytes(), largest: self.largest_free(), capacity: self.capacity });
        };
        self.free.remove(&offset);
        if len > size {
            self.free.insert(offset + size, len - size);
        }
        self.used.insert(offset, size);
        Ok(offset)
    }

    /// Give back the allocation at `offset`.
    pub fn free(&mut self, offset: usize) -> Result<(), DeviceError> {
        let Some(mut size) = self.used.remove(&offset) else {
            return Err(DeviceError::Invalid(format!("free of offset {offset}, which is not an allocation")));
        };
        let end = offset + size;
        let mut start = offset;
        if let Some((&prev, &prev_len)) = self.free.range(..offset).next_back() {
            if prev + prev_len == offset {
                self.free.remove(&prev);
                start = prev;
                size += prev_len;
            }
        }
        if let Some(next_len) = self.free.remove(&end) {
            size += next_len;
        }
        self.free.insert(start, size);
        Ok(())
    }

    /// Bytes of the live allocation at `offset`.
    pub fn size_of(&self, offset: usize) -> Option<usize> {
        self.used.get(&offset).copied()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn exhausts_then_refuses_with_numbers() {
        let mut a = Arena::new(4 * ALIGN);
        let x = a.alloc(2 * ALIGN).unwrap();
        let _y = a.alloc(ALIGN + 1).unwrap();
        match a.alloc(ALIGN) {
            Err(DeviceError::OutOfMemory { free: 0, capacity, .. }) => assert_eq!(capacity, 4 * ALIGN),
            other => panic!("{other:?}"),
        }
        a.free(x).unwrap();
        assert_eq!(a.alloc(2 * ALIGN).unwrap(), x);
        assert!(a.free(12345).is_err());
    }

    proptest! {
        /// Random alloc/free sequences never hand out overlapping ranges, and
        /// freeing everything merges back into one free range.
        #[test]
        fn allocations_never_overlap(ops in prop::collection::vec((any::<bool>(), 1usize..5000), 1..200)) {
            let mut a = Arena::new(64 * 1024);
            let mut live: Vec<(usize, usize)> = vec![];
            for (free, bytes) in ops {
                if free && !live.is_empty() {
                    let (off, _) = live.swap_remove(bytes % live.len());
                    a.free(off).unwrap();
                } else if let Ok(off) = a.alloc(bytes) {
                    prop_assert_eq!(off % ALIGN, 0);
                    for &(o, b) in &live {
                        prop_assert!(off + bytes <= o || o + b <= off, "overlap");
                    }
                    live.push((off, bytes));
                }
            }
            for (off, _) in live.drain(..) {
                a.free(off).unwrap();
            }
            prop_assert_eq!(a.free_bytes(), 64 * 1024);
            prop_assert_eq!(a.largest_free(), 64 * 1024);
        }
    }
}
