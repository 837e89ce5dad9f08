//! Device memory for staged weights: the experts ring buffer and the budget
//! for everything else.
//!
//! Expert modules are all the same size, so one device allocation cut into
//! fixed slots serves every layer: expert module `k` (counting from the first
//! expert of the prompt) goes to slot `k % len`, and the loader waits until
//! the unloader has released that slot's previous occupant. Nothing is
//! allocated or freed per tensor.
//!
//! Other modules (attention, dense MLPs, router and shared experts, embedding
//! and LM-head chunks) are few and of many sizes: they are carved out of a
//! fixed budget, and the loader blocks until the unloader has freed enough.
//!
//! A release carries the unloader's virtual time ([`Stamp`]): under the
//! simulator, a loader that takes a slot, or space of the budget, goes on
//! from the time its last user released it.

use super::signal::{lock, wait_until, Abort, Aborted};
use duplex_kernels::clock::Stamp;
use duplex_kernels::device::arena::Arena;
use duplex_kernels::device::{Device, DeviceError, DevicePtr};
use std::sync::{Condvar, Mutex};

pub struct ExpertRing {
    buffer: DevicePtr,
    slot_bytes: usize,
    /// The module each slot holds, until the unloader releases it, and when
    /// the slot was last released.
    occupants: Mutex<Vec<(Option<usize>, Stamp)>>,
    released: Condvar,
}

impl ExpertRing {
    /// One allocation of `slots` slots of `slot_bytes`.
    pub fn new(dev: &dyn Device, slots: usize, slot_bytes: usize) -> Result<Self, DeviceError> {
        let slot_bytes = slot_bytes.div_ceil(256) * 256;
        let buffer = dev.alloc(slots * slot_bytes)?;
        Ok(ExpertRing { buffer, slot_bytes, occupants: Mutex::new(vec![(None, Stamp::default()); slots]), released: Condvar::new() })
    }

    pub fn len(&self) -> usize {
        lock(&self.occupants).len()
    }

    pub fn bytes(&self) -> usize {
        self.buffer.bytes
    }

    /// Claim the slot of the `k`-th expert module (module `module`), waiting
    /// until the unloader has released the slot's previous occupant. Returns
    /// the slot and its memory.
    pub fn acquire(&self, k: usize, module: usize, abort: &Abort) -> Result<(usize, DevicePtr), Aborted> {
        let slots = self.len();
        let slot = k % slots;
        let mut occupants = wait_until(&self.occupants, &self.released, abort, |o| o[slot].0.is_none())?;
        occupants[slot].1.join();
        occupants[slot].0 = Some(module);
        let memory = self.buffer.slice(slot * self.slot_bytes, self.slot_bytes).expect("slots lie within the ring");
        Ok((slot, memory))
    }

    /// The slot's module has run: its memory may be loaded again.
    pub fn release(&self, slot: usize) {
        lock(&self.occupants)[slot] = (None, Stamp::now());
        self.released.notify_all();
    }

    pub fn free(self, dev: &dyn Device) -> Result<(), DeviceError> {
        dev.free(self.buffer)
    }
}

pub struct DenseBudget {
    base: DevicePtr,
    arena: Mutex<Space>,
    freed: Condvar,
}

/// The budget's allocations, and the ranges released since, each with when.
struct Space {
    arena: Arena,
    released: Vec<(std::ops::Range<usize>, Stamp)>,
}

impl Space {
    fn new(bytes: usize) -> Space {
        Space { arena: Arena::new(bytes), released: vec![] }
    }

    /// Continue from the releases of the memory at `range`, which is being
    /// handed out again: those are forgotten once it covers them whole.
    fn reuse(&mut self, range: std::ops::Range<usize>) {
        let overlaps = |r: &std::ops::Range<usize>| r.start < range.end && range.start < r.end;
        let stamp = self.released.iter().filter(|(r, _)| overlaps(r)).fold(Stamp::default(), |a, (_, s)| a.max(*s));
        stamp.join();
        self.released.retain(|(r, _)| !(range.start <= r.start && r.end <= range.end));
    }
}

impl DenseBudget {
    pub fn new(dev: &dyn Device, bytes: usize) -> Result<Self, DeviceError> {
        let base = dev.alloc(bytes)?;
        Ok(DenseBudget { base, arena: Mutex::new(Space::new(bytes)), freed: Condvar::new() })
    }

    pub fn capacity(&self) -> usize {
        lock(&self.arena).arena.capacity()
    }

    /// `bytes` of the budget, once the unloader has freed enough of it (the
    /// caller has checked that `bytes` fits the budget at all).
    pub fn alloc(&self, bytes: usize, abort: &Abort) -> Result<DevicePtr, Aborted> {
        let mut offset = 0;
        let mut space = wait_until(&self.arena, &self.freed, abort, |s| match s.arena.alloc(bytes) {
            Ok(o) => {
                offset = o;
                true
            }
            Err(_) => false,
        })?;
        space.reuse(offset..offset + bytes);
        Ok(self.base.slice(offset, bytes).expect("the arena lies within the budget"))
    }

    pub fn release(&self, ptr: DevicePtr) {
        // Only pointers this budget handed out come back here.
        let offset = (ptr.addr - self.base.addr) as usize;
        let mut space = lock(&self.arena);
        let _ = space.arena.free(offset);
        space.released.push((offset..offset + ptr.bytes, Stamp::now()));
        drop(space);
        self.freed.notify_all();
    }

    /// Forget every allocation (after an aborted prompt, once the device is idle).
    pub fn reset(&self) {
        let capacity = self.capacity();
        *lock(&self.arena) = Space::new(capacity);
    }

    pub fn free(self, dev: &dyn Device) -> Result<(), DeviceError> {
        dev.free(self.base)
    }
}
