//! The device lease: this worker lends its device to the prefill worker's
//! two-device prefill while it has nothing to decode, and takes it back as
//! soon as a decode request arrives (§3.3.2 of the cloud-grade-SLO paper: a
//! decode request arriving during two-device prefill waits about one
//! layer's work, not the whole prefill).
//!
//! A lease is a server stream (`DeviceLease.LeaseDevice`, onto which
//! `server` maps [`LeaseEvent`]s): its first event grants or refuses it,
//! and a granted lease lasts until the borrower drops the stream, so a
//! prefill worker that is killed (its connection closes) releases it at
//! once. A decode admission that finds a lease sends `revoked` on its
//! stream and waits until the stream is dropped, at most `revoke_wait`;
//! past that it warns and goes on, and the lease is marked abandoned so
//! that later admissions do not wait on it again. One lease at a time, and
//! none while an admission is on its way to the engine or the engine has
//! sequences (the server asks it, after `reserve`, in the same command
//! queue as the admissions, so none can slip in between).

use duplex_kernels::device::Device;
use duplex_telemetry as names;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::UnboundedReceiverStream;
use tokio_stream::Stream;

/// How much device memory this worker can lend.
pub struct Lendable {
    /// Its own device, whose free memory bounds the loan; `None` when its
    /// steps run on the CPU (the device is managed outside this process).
    pub device: Option<Arc<dyn Device>>,
    /// The configured ceiling (`lendable_device_mib`); `None`: no ceiling.
    pub budget_bytes: Option<u64>,
}

impl Lendable {
    pub fn spare_bytes(&self) -> u64 {
        let free = self.device.as_ref().map_or(u64::MAX, |d| d.free_bytes() as u64);
        free.min(self.budget_bytes.unwrap_or(u64::MAX))
    }
}

pub struct DeviceLender {
    state: Mutex<State>,
    lendable: Lendable,
    revoke_wait: Duration,
}

#[derive(Default)]
struct State {
    next_id: u64,
    /// Decode admissions between their arrival and their command reaching
    /// the engine (waits for a revoked lease included).
    admitting: usize,
    holder: Option<Holder>,
}

struct Holder {
    id: u64,
    request_id: String,
    /// `granted` was sent; before that the engine is being asked whether it is idle.
    granted: bool,
    revoked: bool,
    /// Revoked and not given back within `revoke_wait`: admissions no longer wait on it.
    abandoned: bool,
    events: mpsc::UnboundedSender<LeaseEvent>,
    /// Closed (its sender dropped) when the lease ends.
    released: watch::Receiver<()>,
}

/// What a lease's holder is told, in order: `Granted` or `Refused` first,
/// then at most `Revoked`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LeaseEvent {
    /// The device is lent until the stream is dropped.
    Granted,
    /// Not lent; the stream ends.
    Refused { reason: String },
    /// A decode request arrived: give the device back (drop the stream).
    Revoked,
}

impl DeviceLender {
    pub fn new(lendable: Lendable, revoke_wait: Duration) -> Arc<Self> {
        Arc::new(DeviceLender { state: Mutex::new(State::default()), lendable, revoke_wait })
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // The state is consistent after every statement: a panic elsewhere leaves nothing half done.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The first step of a lease: refused at once when another is held, an
    /// admission is under way or `bytes` cannot be spared; otherwise held
    /// for `request_id` until [`Reservation::grant`] (or its drop).
    pub fn reserve(self: &Arc<Self>, request_id: &str, bytes: u64) -> Result<Reservation, String> {
        let mut state = self.lock();
        if let Some(h) = &state.holder {
            return Err(format!("the device is already lent (to request {})", h.request_id));
        }
        if state.admitting > 0 {
            return Err("a decode request is being admitted".into());
        }
        let spare = self.lendable.spare_bytes();
        if bytes > spare {
            return Err(format!("{bytes} bytes asked, {spare} can be lent"));
        }
        state.next_id += 1;
        let id = state.next_id;
        let (events, receiver) = mpsc::unbounded_channel();
        let (released_tx, released) = watch::channel(());
        state.holder = Some(Holder { id, request_id: request_id.to_string(), granted: false, revoked: false, abandoned: false, events, released });
        Ok(Reservation { events: receiver, release: Release { lender: self.clone(), id, _released: released_tx } })
    }

    /// A decode admission: revokes a lease that is held and waits until it
    /// is given back (at most `revoke_wait`). Until the returned guard is
    /// dropped (once the admission is in the engine's queue), no lease is
    /// granted.
    pub async fn admit(self: &Arc<Self>) -> Admitting {
        let admitting = Admitting::new(self.clone());
        let lease = {
            let mut state = self.lock();
            match state.holder.as_mut().filter(|h| !h.abandoned) {
                None => None,
                Some(h) => {
                    if !h.revoked {
                        h.revoked = true;
                        if h.granted {
                            tracing::info!("a decode request arrived: revoking the device lease of request {}", h.request_id);
                            metrics::counter!(names::DEVICE_LEASE_REVOCATIONS).increment(1);
                            let _ = h.events.send(LeaseEvent::Revoked);
                        }
                    }
                    Some((h.id, h.request_id.clone(), h.released.clone()))
                }
            }
        };
        if let Some((id, request_id, mut released)) = lease {
            let started = Instant::now();
            // `changed` fails once the sender is dropped: the lease has ended.
            let given_back = tokio::time::timeout(self.revoke_wait, async { while released.changed().await.is_ok() {} }).await.is_ok();
            let waited = started.elapsed().as_secs_f64();
            metrics::histogram!(names::DEVICE_LEASE_WAIT).record(waited);
            if given_back {
                tracing::info!("the device lease of request {request_id} was given back after {waited:.3} s");
            } else {
                tracing::warn!("the device lease of request {request_id} was not given back within {:.3} s of its revocation; decoding without waiting for it", self.revoke_wait.as_secs_f64());
                if let Some(h) = self.lock().holder.as_mut().filter(|h| h.id == id) {
                    h.abandoned = true;
                }
            }
        }
        admitting
    }

    /// Whether a lease is held (granted or being granted).
    pub fn is_lent(&self) -> bool {
        self.lock().holder.is_some()
    }
}

/// A decode admission on its way to the engine; no lease is granted meanwhile.
pub struct Admitting(Arc<DeviceLender>);

impl Admitting {
    fn new(lender: Arc<DeviceLender>) -> Self {
        lender.lock().admitting += 1;
        Admitting(lender)
    }
}

impl Drop for Admitting {
    fn drop(&mut self) {
        self.0.lock().admitting -= 1;
    }
}

/// Ends the lease it belongs to when dropped: the holder is cleared and
/// the admissions waiting on it wake.
struct Release {
    lender: Arc<DeviceLender>,
    id: u64,
    _released: watch::Sender<()>,
}

impl Drop for Release {
    fn drop(&mut self) {
        let mut state = self.lender.lock();
        if let Some(holder) = state.holder.take_if(|h| h.id == self.id) {
            if holder.granted {
                tracing::info!("the device lease of request {} ended", holder.request_id);
            }
        }
    }
}

/// A lease reserved while the engine is asked whether it is idle.
pub struct Reservation {
    events: mpsc::UnboundedReceiver<LeaseEvent>,
    release: Release,
}

impl Reservation {
    /// Grant the lease when the engine has no `sequences` running or
    /// queued and no admission revoked it meanwhile; otherwise refuse it.
    pub fn grant(self, sequences: usize) -> LeaseStream {
        let Reservation { events, release } = self;
        let mut state = release.lender.lock();
        let Some(holder) = state.holder.as_mut().filter(|h| h.id == release.id) else {
            drop(state);
            return LeaseStream::refused("the lease ended before it was granted".into());
        };
        let refusal = if holder.revoked {
            Some("a decode request arrived".to_string())
        } else if sequences > 0 {
            Some(format!("{sequences} running or queued sequence(s)"))
        } else {
            None
        };
        match refusal {
            None => {
                holder.granted = true;
                let _ = holder.events.send(LeaseEvent::Granted);
                tracing::info!("device lent to request {}", holder.request_id);
                metrics::counter!(names::DEVICE_LEASES, "outcome" => "granted").increment(1);
                drop(state);
                LeaseStream { events: UnboundedReceiverStream::new(events), _release: Some(release) }
            }
            Some(reason) => {
                drop(state);
                drop(release);
                LeaseStream::refused(reason)
            }
        }
    }
}

/// The lease's events; dropping it ends the lease.
pub struct LeaseStream {
    events: UnboundedReceiverStream<LeaseEvent>,
    _release: Option<Release>,
}

impl LeaseStream {
    /// One `refused` event, then the end.
    pub fn refused(reason: String) -> Self {
        tracing::info!("device lease refused: {reason}");
        metrics::counter!(names::DEVICE_LEASES, "outcome" => "refused").increment(1);
        let (events, receiver) = mpsc::unbounded_channel();
        let _ = events.send(LeaseEvent::Refused { reason });
        LeaseStream { events: UnboundedReceiverStream::new(receiver), _release: None }
    }
}

impl Stream for LeaseStream {
    type Item = LeaseEvent;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        Pin::new(&mut self.events).poll_next(cx)
    }
}
