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
//! simulator, a loader that waited for space goes on from then.

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
    /// The allocations, and when the last release happened.
    arena: Mutex<(Arena, Stamp)>,
    freed: Condvar,
}

impl DenseBudget {
    pub fn new(dev: &dyn Device, bytes: usize) -> Result<Self, DeviceError> {
        let base = dev.alloc(bytes)?;
        Ok(DenseBudget { base, arena: Mutex::new((Arena::new(bytes), Stamp::default())), freed: Condvar::new() })
    }

    pub fn capacity(&self) -> usize {
        lock(&self.arena).0.capacity()
    }

    /// `bytes` of the budget, once the unloader has freed enough of it (the
    /// caller has checked that `bytes` fits the budget at all).
    pub fn alloc(&self, bytes: usize, abort: &Abort) -> Result<DevicePtr, Aborted> {
        let (mut offset, mut waited) = (0, false);
        let arena = wait_until(&self.arena, &self.freed, abort, |(a, _)| match a.alloc(bytes) {
            Ok(o) => {
                offset = o;
                true
            }
            Err(_) => {
                waited = true;
                false
            }
        })?;
        // Space freed while this thread waited is space of the latest release.
        if waited {
            arena.1.join();
        }
        Ok(self.base.slice(offset, bytes).expect("the arena lies within the budget"))
    }

    pub fn release(&self, ptr: DevicePtr) {
        // Only pointers this budget handed out come back here.
        let mut arena = lock(&self.arena);
        let _ = arena.0.free((ptr.addr - self.base.addr) as usize);
        arena.1 = Stamp::now();
        drop(arena);
        self.freed.notify_all();
    }

    /// Forget every allocation (after an aborted prompt, once the device is idle).
    pub fn reset(&self) {
        let capacity = self.capacity();
        *lock(&self.arena) = (Arena::new(capacity), Stamp::default());
    }

    pub fn free(self, dev: &dyn Device) -> Result<(), DeviceError> {
        dev.free(self.base)
    }
}
