//! Where a prompt is prefilled: the scheduling policy of §3.3.2 of the
//! cloud-grade-SLO paper. Short prompts are cheap enough for the decode
//! worker to prefill in chunks between decode steps; long ones would stall
//! its batch, so the prefill worker runs them into KV blocks the decode
//! worker lends, and only the block numbers travel. A long prompt runs on
//! every prefill device at once (two-device prefill, DSLP) when nothing has
//! decoded for a while, for throughput; otherwise on one device (SLP), so
//! that decoding keeps its latency. Prefill is first come first served.

use std::fmt;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// The two ways into the decode worker's batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PrefillPath {
    /// Chunked prefill on the decode worker.
    Decode,
    /// AllocateKv, Prefill on the prefill worker, then Decode with the lease.
    Prefill,
}

impl PrefillPath {
    /// For the `path` metric label and `Timings.prefill_path`.
    pub fn as_str(self) -> &'static str {
        match self {
            PrefillPath::Decode => "decode",
            PrefillPath::Prefill => "prefill",
        }
    }
}

/// Prompts of at least `threshold` tokens go to the prefill worker.
pub fn choose(prompt_tokens: usize, threshold: u32) -> PrefillPath {
    if prompt_tokens >= threshold as usize {
        PrefillPath::Prefill
    } else {
        PrefillPath::Decode
    }
}

/// Where one prompt is prefilled.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Route {
    /// In chunks on the decode worker.
    DecodeChunked,
    /// Stream-loading prefill on one of the prefill worker's devices.
    Slp,
    /// Two-device stream-loading prefill on all of the prefill worker's devices.
    Dslp,
}

impl Route {
    /// The `route` label of `duplex_prefill_route_total`.
    pub fn as_str(self) -> &'static str {
        match self {
            Route::DecodeChunked => "decode_chunked",
            Route::Slp => "slp",
            Route::Dslp => "dslp",
        }
    }

    pub fn path(self) -> PrefillPath {
        match self {
            Route::DecodeChunked => PrefillPath::Decode,
            Route::Slp | Route::Dslp => PrefillPath::Prefill,
        }
    }
}

/// Decoding as the router sees it: requests whose token stream from the
/// decode worker is open (chunked prefill included).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DecodeActivity {
    /// This many requests are on the decode worker now.
    Busy(usize),
    /// None is; the last one left this long ago (`None`: none has run
    /// since the router started).
    Idle(Option<Duration>),
}

/// Why a prompt took its route.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reason {
    Short { tokens: usize, max: u32 },
    NoDslp,
    Decoding(usize),
    RecentDecode { ago: Duration, window: Duration },
    DecodeIdle { ago: Option<Duration>, window: Duration },
    /// Long, but all but `new` tokens were in the prefix cache.
    MostlyCached { tokens: usize, new: usize, max: u32 },
}

impl fmt::Display for Reason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Reason::Short { tokens, max } => write!(f, "{tokens} prompt tokens, below prefill_threshold_tokens ({max})"),
            Reason::NoDslp => write!(f, "the prefill worker has no two-device prefill"),
            Reason::Decoding(1) => write!(f, "a request is decoding"),
            Reason::Decoding(n) => write!(f, "{n} requests are decoding"),
            Reason::RecentDecode { ago, window } => write!(f, "a request decoded {:.1} s ago, within dslp_idle_window_seconds ({})", ago.as_secs_f64(), window.as_secs_f64()),
            Reason::DecodeIdle { ago: Some(ago), window } => write!(f, "no request has decoded for {:.1} s (dslp_idle_window_seconds is {})", ago.as_secs_f64(), window.as_secs_f64()),
            Reason::DecodeIdle { ago: None, .. } => write!(f, "no request has decoded since the router started"),
            Reason::MostlyCached { tokens, new, max } => write!(f, "{tokens} prompt tokens, but only {new} not in the prefix cache, below prefill_threshold_tokens ({max})"),
        }
    }
}

/// The policy's settings.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PrefillPolicy {
    /// Prompts shorter than this are chunk-prefilled by the decode worker
    /// (`prefill_threshold_tokens`; the paper's chunked-prefill maximum).
    pub chunked_prefill_max_tokens: u32,
    /// How long nothing must have decoded before a long prompt takes every
    /// prefill device.
    pub dslp_idle_window: Duration,
}

impl PrefillPolicy {
    /// The route of a prompt of `prompt_tokens` tokens, given whether the
    /// prefill worker can run two-device prefill and what is decoding.
    pub fn route(&self, prompt_tokens: usize, prefill_has_dslp: bool, decode: DecodeActivity) -> (Route, Reason) {
        if choose(prompt_tokens, self.chunked_prefill_max_tokens) == PrefillPath::Decode {
            return (Route::DecodeChunked, Reason::Short { tokens: prompt_tokens, max: self.chunked_prefill_max_tokens });
        }
        if !prefill_has_dslp {
            return (Route::Slp, Reason::NoDslp);
        }
        let window = self.dslp_idle_window;
        match decode {
            DecodeActivity::Busy(n) => (Route::Slp, Reason::Decoding(n)),
            DecodeActivity::Idle(Some(ago)) if ago < window => (Route::Slp, Reason::RecentDecode { ago, window }),
            DecodeActivity::Idle(ago) => (Route::Dslp, Reason::DecodeIdle { ago, window }),
        }
    }

    /// A long prompt's route again once its KV lease says how much of it
    /// the prefix cache holds: chunked on the decode worker when what is
    /// left is short (a chat's next turn), which then finds the same cached
    /// blocks; `None` keeps the route. What a prefill costs is the tokens it
    /// computes, but the cached part is known only from the lease.
    pub fn reroute(&self, prompt_tokens: usize, cached_tokens: usize) -> Option<(Route, Reason)> {
        let new = prompt_tokens.saturating_sub(cached_tokens);
        (choose(new, self.chunked_prefill_max_tokens) == PrefillPath::Decode).then_some((Route::DecodeChunked, Reason::MostlyCached { tokens: prompt_tokens, new, max: self.chunked_prefill_max_tokens }))
    }
}

/// Counts the requests on the decode worker and remembers when the last
/// one left, for the idle window.
#[derive(Debug, Default)]
pub struct DecodeTracker {
    state: Mutex<TrackerState>,
}

#[derive(Debug, Default)]
struct TrackerState {
    decoding: usize,
    last_left: Option<Instant>,
}

impl DecodeTracker {
    /// A request starts on the decode worker; it counts until the guard is
    /// dropped (its stream ended, failed, or was cancelled).
    pub fn begin(&self) -> Decoding<'_> {
        self.lock().decoding += 1;
        Decoding { tracker: self }
    }

    pub fn activity(&self, now: Instant) -> DecodeActivity {
        let state = self.lock();
        match state.decoding {
            0 => DecodeActivity::Idle(state.last_left.map(|t| now.saturating_duration_since(t))),
            n => DecodeActivity::Busy(n),
        }
    }

    fn left(&self, at: Instant) {
        let mut state = self.lock();
        state.decoding -= 1;
        state.last_left = Some(at);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, TrackerState> {
        // The state stays consistent whatever panicked while holding it.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// One request on the decode worker (see [`DecodeTracker::begin`]).
pub struct Decoding<'a> {
    tracker: &'a DecodeTracker,
}

impl Decoding<'_> {
    /// The request left at `at` (a simulated run's clock), not now.
    pub fn end_at(self, at: Instant) {
        self.tracker.left(at);
        std::mem::forget(self);
    }
}

impl Drop for Decoding<'_> {
    fn drop(&mut self) {
        self.tracker.left(Instant::now());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_mostly_cached_long_prompt_is_chunked_on_the_decode_worker() {
        assert_eq!(POLICY.reroute(10_000, 9_000), Some((Route::DecodeChunked, Reason::MostlyCached { tokens: 10_000, new: 1_000, max: 2048 })));
        assert_eq!(POLICY.reroute(10_000, 7_952), None, "2,048 new tokens keep the prefill worker");
        assert_eq!(POLICY.reroute(10_000, 0), None);
        let why = POLICY.reroute(5000, 4000).unwrap().1.to_string();
        assert!(why.contains("only 1000 not in the prefix cache"), "{why}");
    }

    #[test]
    fn threshold_is_inclusive() {
        assert_eq!(choose(2047, 2048), PrefillPath::Decode);
        assert_eq!(choose(2048, 2048), PrefillPath::Prefill);
        assert_eq!(choose(1, 0), PrefillPath::Prefill);
    }

    const WINDOW: Duration = Duration::from_secs(300);
    const POLICY: PrefillPolicy = PrefillPolicy { chunked_prefill_max_tokens: 2048, dslp_idle_window: WINDOW };
    const IDLE_LONG: DecodeActivity = DecodeActivity::Idle(Some(Duration::from_secs(301)));

    #[test]
    fn short_prompts_are_chunked_on_the_decode_worker_whatever_else_holds() {
        for (tokens, decode) in [(1, IDLE_LONG), (2047, IDLE_LONG), (2047, DecodeActivity::Idle(None)), (100, DecodeActivity::Busy(3))] {
            for dslp in [false, true] {
                assert_eq!(POLICY.route(tokens, dslp, decode), (Route::DecodeChunked, Reason::Short { tokens, max: 2048 }), "{tokens} {dslp} {decode:?}");
            }
        }
    }

    #[test]
    fn long_prompts_take_dslp_only_after_the_idle_window() {
        assert_eq!(POLICY.route(2048, true, IDLE_LONG), (Route::Dslp, Reason::DecodeIdle { ago: Some(Duration::from_secs(301)), window: WINDOW }));
        assert_eq!(POLICY.route(100_000, true, DecodeActivity::Idle(None)), (Route::Dslp, Reason::DecodeIdle { ago: None, window: WINDOW }));
        // The window is inclusive of its end: exactly 300 s idle is enough.
        assert_eq!(POLICY.route(4096, true, DecodeActivity::Idle(Some(WINDOW))).0, Route::Dslp);
        let recent = Duration::from_secs(299);
        assert_eq!(POLICY.route(4096, true, DecodeActivity::Idle(Some(recent))), (Route::Slp, Reason::RecentDecode { ago: recent, window: WINDOW }));
        assert_eq!(POLICY.route(4096, true, DecodeActivity::Busy(1)), (Route::Slp, Reason::Decoding(1)));
        // A zero window: DSLP whenever nothing decodes right now.
        let eager = PrefillPolicy { dslp_idle_window: Duration::ZERO, ..POLICY };
        assert_eq!(eager.route(4096, true, DecodeActivity::Idle(Some(Duration::ZERO))).0, Route::Dslp);
        assert_eq!(eager.route(4096, true, DecodeActivity::Busy(2)).0, Route::Slp);
    }

    #[test]
    fn a_prefill_worker_without_dslp_gets_long_prompts_on_slp() {
        for decode in [IDLE_LONG, DecodeActivity::Idle(None), DecodeActivity::Busy(4)] {
            assert_eq!(POLICY.route(4096, false, decode), (Route::Slp, Reason::NoDslp));
        }
    }

    #[test]
    fn routes_have_their_labels_and_paths() {
        assert_eq!([Route::DecodeChunked, Route::Slp, Route::Dslp].map(Route::as_str), ["decode_chunked", "slp", "dslp"]);
        assert_eq!([Route::DecodeChunked, Route::Slp, Route::Dslp].map(Route::path), [PrefillPath::Decode, PrefillPath::Prefill, PrefillPath::Prefill]);
    }

    #[test]
    fn reasons_say_why() {
        let text = |r: Reason| r.to_string();
        assert_eq!(text(Reason::Short { tokens: 12, max: 64 }), "12 prompt tokens, below prefill_threshold_tokens (64)");
        assert_eq!(text(Reason::Decoding(1)), "a request is decoding");
        assert_eq!(text(Reason::Decoding(2)), "2 requests are decoding");
        assert_eq!(text(Reason::RecentDecode { ago: Duration::from_millis(1500), window: WINDOW }), "a request decoded 1.5 s ago, within dslp_idle_window_seconds (300)");
        assert_eq!(text(Reason::DecodeIdle { ago: Some(Duration::from_secs(400)), window: WINDOW }), "no request has decoded for 400.0 s (dslp_idle_window_seconds is 300)");
    }

    #[test]
    fn the_tracker_counts_requests_on_the_decode_worker_and_when_the_last_left() {
        let tracker = DecodeTracker::default();
        let t0 = Instant::now();
        assert_eq!(tracker.activity(t0), DecodeActivity::Idle(None));
        let a = tracker.begin();
        let b = tracker.begin();
        assert_eq!(tracker.activity(Instant::now()), DecodeActivity::Busy(2));
        drop(a);
        assert_eq!(tracker.activity(Instant::now()), DecodeActivity::Busy(1));
        drop(b);
        let left = Instant::now();
        let later = left + Duration::from_secs(5);
        match tracker.activity(later) {
            // The last request left just before `left`.
            DecodeActivity::Idle(Some(ago)) => assert!(ago >= Duration::from_secs(5) && ago < Duration::from_secs(6), "{ago:?}"),
            other => panic!("{other:?}"),
        }
        // Through the policy: idle 5 s is within a 300 s window, beyond a 1 s one.
        assert_eq!(POLICY.route(4096, true, tracker.activity(later)).0, Route::Slp);
        let short = PrefillPolicy { dslp_idle_window: Duration::from_secs(1), ..POLICY };
        assert_eq!(short.route(4096, true, tracker.activity(later)).0, Route::Dslp);
    }
}
