//! A slice that several pool tasks write at once, each to its own part.

use std::marker::PhantomData;

/// A mutable slice shared across the tasks of one parallel region. The
/// borrow checker cannot see that tasks write disjoint ranges, so access is
/// `unsafe` and each caller states why its range is its own.
pub struct SharedSlice<'a, T> {
    ptr: *mut T,
    len: usize,
    _borrow: PhantomData<&'a mut [T]>,
}

// SAFETY: access goes through the unsafe methods, whose callers guarantee
// that concurrent accesses are to disjoint ranges (or read-only).
unsafe impl<T: Send> Send for SharedSlice<'_, T> {}
unsafe impl<T: Send> Sync for SharedSlice<'_, T> {}

impl<'a, T> SharedSlice<'a, T> {
    pub fn new(slice: &'a mut [T]) -> Self {
        SharedSlice { ptr: slice.as_mut_ptr(), len: slice.len(), _borrow: PhantomData }
    }

    /// # Safety
    /// No other task may access `start..start + len` while the result lives.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn slice_mut(&self, start: usize, len: usize) -> &mut [T] {
        assert!(start + len <= self.len, "SharedSlice: range out of bounds");
        // SAFETY: in bounds (checked), exclusive by the caller's guarantee.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(start), len) }
    }

    /// # Safety
    /// No task may write `start..start + len` while the result lives.
    pub unsafe fn slice(&self, start: usize, len: usize) -> &[T] {
        assert!(start + len <= self.len, "SharedSlice: range out of bounds");
        // SAFETY: in bounds (checked), no writers by the caller's guarantee.
        unsafe { std::slice::from_raw_parts(self.ptr.add(start), len) }
    }
}
