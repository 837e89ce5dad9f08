//! Host-side synchronisation of the SLP threads.
//!
//! A [`Signal`] is the host half of an *event tuple*: the loader (or the
//! model thread) sets it with a value that carries the device event, and the
//! thread downstream blocks on it, then orders its own stream after that
//! device event. [`Abort`] stops every thread of a prompt when one fails, so
//! no wait can outlive the pipeline. A signal also carries the setter's
//! virtual time ([`Stamp`]), so that under the simulator the waiter cannot
//! go on before the setter set it.

use duplex_kernels::clock::Stamp;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::Duration;

/// How often a blocked thread looks at the abort flag. Wake-ups come from
/// `notify_all`; this bound only matters when a thread elsewhere failed.
const ABORT_POLL: Duration = Duration::from_millis(20);

#[derive(Default)]
pub struct Abort(AtomicBool);

impl Abort {
    pub fn raise(&self) {
        self.0.store(true, Ordering::SeqCst);
    }

    pub fn raised(&self) -> bool {
        self.0.load(Ordering::SeqCst)
    }
}

/// The pipeline was stopped while this thread waited.
#[derive(Debug)]
pub struct Aborted;

pub fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Wait on `cv` until `ready` holds for the guarded value, or `abort` is raised.
pub fn wait_until<'a, T>(m: &'a Mutex<T>, cv: &Condvar, abort: &Abort, mut ready: impl FnMut(&mut T) -> bool) -> Result<MutexGuard<'a, T>, Aborted> {
    let mut guard = lock(m);
    loop {
        if ready(&mut guard) {
            return Ok(guard);
        }
        if abort.raised() {
            return Err(Aborted);
        }
        guard = cv.wait_timeout(guard, ABORT_POLL).unwrap_or_else(|e| e.into_inner()).0;
    }
}

/// A value set once by one thread and read by others.
pub struct Signal<T> {
    value: Mutex<Option<(T, Stamp)>>,
    set: Condvar,
}

impl<T: Clone> Signal<T> {
    pub fn new() -> Self {
        Signal { value: Mutex::new(None), set: Condvar::new() }
    }

    pub fn set(&self, value: T) {
        *lock(&self.value) = Some((value, Stamp::now()));
        self.set.notify_all();
    }

    pub fn wait(&self, abort: &Abort) -> Result<T, Aborted> {
        let guard = wait_until(&self.value, &self.set, abort, |v| v.is_some())?;
        let (value, stamp) = guard.clone().expect("ready");
        stamp.join();
        Ok(value)
    }

    /// The value, if it has been set.
    pub fn get(&self) -> Option<T> {
        lock(&self.value).clone().map(|(value, _)| value)
    }
}
