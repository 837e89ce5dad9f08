//! Virtual time, for the simulator (`duplex simulate`).
//!
//! A simulated run keeps, per thread, the virtual time that thread has
//! reached: a simulated device advances it when the thread waits for the
//! device, a simulated CPU when the thread computes. Real runs never set it,
//! and then every function here is a no-op.
//!
//! Threads also hand work to each other without a device in between (a
//! freed ring slot, a batch of expert inputs). Such a handoff carries a
//! [`Stamp`] of the sender's time, and the receiver joins it, so that in a
//! simulation the receiver cannot act before the sender did. That is the
//! only thing the scheduling code does for the simulator.

use std::cell::Cell;
use std::time::Duration;

thread_local! {
    static NOW: Cell<Option<Duration>> = const { Cell::new(None) };
}

/// This thread's virtual time, or `None` outside a simulation.
pub fn now() -> Option<Duration> {
    NOW.with(Cell::get)
}

/// Start (or, with `None`, leave) virtual time on this thread.
pub fn set(t: Option<Duration>) {
    NOW.with(|now| now.set(t));
}

/// Move this thread's virtual time forward to `t` (never back); a no-op
/// outside a simulation.
pub fn advance_to(t: Duration) {
    NOW.with(|now| {
        if let Some(cur) = now.get() {
            now.set(Some(cur.max(t)));
        }
    });
}

/// The sender's time at a handoff between threads.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Stamp(Option<Duration>);

impl Stamp {
    pub fn now() -> Stamp {
        Stamp(now())
    }

    /// The later of two stamps.
    pub fn max(self, other: Stamp) -> Stamp {
        match (self.0, other.0) {
            (Some(a), Some(b)) => Stamp(Some(a.max(b))),
            (a, b) => Stamp(a.or(b)),
        }
    }

    /// Continue from the sender's time: this thread's virtual time becomes
    /// at least the stamp's (starting it if the thread had none, as a
    /// thread spawned by a simulated one has).
    pub fn join(self) {
        if let Some(t) = self.0 {
            NOW.with(|now| now.set(Some(now.get().map_or(t, |cur| cur.max(t)))));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn real_runs_keep_no_time_and_handoffs_carry_it() {
        assert_eq!(now(), None);
        advance_to(Duration::from_secs(1));
        assert_eq!(now(), None, "advancing outside a simulation starts nothing");
        set(Some(Duration::from_millis(5)));
        advance_to(Duration::from_millis(3));
        assert_eq!(now(), Some(Duration::from_millis(5)), "time never goes back");
        let stamp = Stamp::now();
        let seen = std::thread::spawn(move || {
            assert_eq!(now(), None);
            stamp.join();
            now()
        })
        .join()
        .unwrap();
        assert_eq!(seen, Some(Duration::from_millis(5)));
        set(None);
    }
}
