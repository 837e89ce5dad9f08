//! Bounded admission. A request holds a permit from validation until its
//! last event; when all are taken the router says so at once (429 /
//! RESOURCE_EXHAUSTED) rather than queueing without bound. The workers keep
//! their own queues, where waiting is cheap and visible in their stats.

use crate::error::Error;
use std::sync::Arc;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// Held by a request for as long as it is in flight.
pub type Permit = OwnedSemaphorePermit;

pub struct Admission {
    permits: Arc<Semaphore>,
    limit: usize,
}

impl Admission {
    pub fn new(limit: usize) -> Self {
        Admission { permits: Arc::new(Semaphore::new(limit)), limit }
    }

    pub fn try_admit(&self) -> Result<Permit, Error> {
        self.permits.clone().try_acquire_owned().map_err(|_| {
            Error::Overloaded(format!("the server is at capacity ({} requests in flight); retry later", self.limit))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounded_and_released_on_drop() {
        let a = Admission::new(2);
        let p1 = a.try_admit().unwrap();
        let _p2 = a.try_admit().unwrap();
        let e = a.try_admit().unwrap_err();
        assert!(matches!(e, Error::Overloaded(_)) && e.to_string().contains("2 requests"), "{e}");
        drop(p1);
        assert!(a.try_admit().is_ok());
    }
}
