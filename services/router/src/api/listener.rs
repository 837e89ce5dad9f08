//! Accepting connections within limits, for both front doors.
//!
//! Every accepted connection holds a slot until it closes, and the accept
//! loop waits for a free slot before it accepts: connections beyond the
//! limit wait in the kernel's backlog instead of using up file descriptors
//! (whose exhaustion stops every accept, `/health` included). A connection
//! must send its first bytes within a deadline, so idle connections that
//! never send a request give their slot back. The HTTP door keeps a few
//! reserve slots for when all regular ones are taken: connections there get
//! one request with a short header deadline and no keep-alive, so that a
//! probe of `/health` is still answered while idle clients hold every
//! regular slot. Accept errors (EMFILE when the descriptor limit is reached
//! anyway) back off instead of spinning, and are logged once a minute.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Sleep;

/// Reserve slots of the HTTP door beyond `max_connections`.
pub const RESERVE_CONNECTIONS: usize = 16;

/// How long a connection in a reserve slot may take to send its request
/// headers.
pub const RESERVE_HEADER_TIMEOUT: Duration = Duration::from_secs(1);

/// Accept errors are logged at most this often.
const ERROR_LOG_INTERVAL: Duration = Duration::from_secs(60);

/// A listener that accepts only while it has a free slot.
pub struct Acceptor {
    listener: TcpListener,
    regular: Arc<Semaphore>,
    reserve: Arc<Semaphore>,
    /// Deadline for the first bytes of a connection in a regular slot.
    first_bytes_timeout: Duration,
    backoff: Duration,
    last_error_log: Option<Instant>,
    errors_since_log: u64,
}

/// One accepted connection and the slot it holds until it is dropped.
pub struct Accepted {
    pub stream: LimitedStream,
    /// It holds a reserve slot: serve one request, quickly, and close.
    pub reserve: bool,
}

impl Acceptor {
    pub fn new(listener: TcpListener, max_connections: usize, reserve: usize, first_bytes_timeout: Duration) -> Self {
        Acceptor {
            listener,
            regular: Arc::new(Semaphore::new(max_connections)),
            reserve: Arc::new(Semaphore::new(reserve)),
            first_bytes_timeout,
            backoff: Duration::ZERO,
            last_error_log: None,
            errors_since_log: 0,
        }
    }

    /// The next connection, once a slot is free.
    pub async fn accept(&mut self) -> Accepted {
        // A regular slot if there is one, else a reserve one, else whichever
        // frees first. (Acquiring is cancel-safe: the loser gives nothing up.)
        let (permit, reserve) = tokio::select! {
            biased;
            Ok(p) = self.regular.clone().acquire_owned() => (p, false),
            Ok(p) = self.reserve.clone().acquire_owned() => (p, true),
        };
        loop {
            match self.listener.accept().await {
                Ok((stream, _)) => {
                    self.backoff = Duration::ZERO;
                    let _ = stream.set_nodelay(true);
                    let deadline = if reserve { RESERVE_HEADER_TIMEOUT } else { self.first_bytes_timeout };
                    return Accepted { stream: LimitedStream::new(stream, permit, deadline), reserve };
                }
                Err(e) if is_connection_error(&e) => continue,
                Err(e) => {
                    self.log_error(&e);
                    // Out of descriptors or memory: waiting is the only cure;
                    // retrying at once would spin.
                    self.backoff = (self.backoff * 2).clamp(Duration::from_millis(5), Duration::from_secs(1));
                    tokio::time::sleep(self.backoff).await;
                }
            }
        }
    }

    fn log_error(&mut self, e: &io::Error) {
        self.errors_since_log += 1;
        if self.last_error_log.is_none_or(|t| t.elapsed() >= ERROR_LOG_INTERVAL) {
            let addr = self.listener.local_addr().map(|a| a.to_string()).unwrap_or_default();
            tracing::error!(
                "accepting connections on {addr} failed {} time(s) since the last report: {e}; backing off (raise the file-descriptor limit or lower max_connections)",
                self.errors_since_log
            );
            self.last_error_log = Some(Instant::now());
            self.errors_since_log = 0;
        }
    }
}

/// Errors of one failed connection rather than of the listener.
fn is_connection_error(e: &io::Error) -> bool {
    matches!(e.kind(), io::ErrorKind::ConnectionRefused | io::ErrorKind::ConnectionAborted | io::ErrorKind::ConnectionReset)
}

/// A TCP stream that holds its connection slot, and fails its reads when
/// the peer sends nothing at all within a deadline of being accepted.
pub struct LimitedStream {
    inner: TcpStream,
    _slot: OwnedSemaphorePermit,
    /// Until the first bytes arrive.
    first_bytes: Option<Pin<Box<Sleep>>>,
}

impl LimitedStream {
    fn new(inner: TcpStream, slot: OwnedSemaphorePermit, deadline: Duration) -> Self {
        LimitedStream { inner, _slot: slot, first_bytes: Some(Box::pin(tokio::time::sleep(deadline))) }
    }
}

impl AsyncRead for LimitedStream {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let this = &mut *self;
        match Pin::new(&mut this.inner).poll_read(cx, buf) {
            Poll::Ready(result) => {
                if buf.filled().len() > before {
                    this.first_bytes = None;
                }
                Poll::Ready(result)
            }
            Poll::Pending => {
                let expired = this.first_bytes.as_mut().is_some_and(|deadline| deadline.as_mut().poll(cx).is_ready());
                if expired {
                    Poll::Ready(Err(io::Error::new(io::ErrorKind::TimedOut, "the client sent nothing in time")))
                } else {
                    Poll::Pending
                }
            }
        }
    }
}

impl AsyncWrite for LimitedStream {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }

    fn poll_write_vectored(mut self: Pin<&mut Self>, cx: &mut Context<'_>, bufs: &[io::IoSlice<'_>]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}

impl tonic::transport::server::Connected for LimitedStream {
    type ConnectInfo = tonic::transport::server::TcpConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.inner.connect_info()
    }
}

/// Serves `app` over HTTP/1.1 (and HTTP/2 with prior knowledge) on the
/// connections `acceptor` hands out, until `shutdown`; then waits for the
/// open connections to finish their requests.
///
/// `header_timeout` bounds how long a connection may take to send a
/// request's headers, including the idle time between keep-alive requests,
/// so idle connections give their slot back.
pub async fn serve_http(mut acceptor: Acceptor, app: axum::Router, header_timeout: Duration, shutdown: impl std::future::Future<Output = ()>) {
    use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
    use hyper_util::server::conn::auto::Builder;

    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    let builder = |reserve: bool| {
        let mut b = Builder::new(TokioExecutor::new());
        b.http1()
            .timer(TokioTimer::new())
            .header_read_timeout(if reserve { RESERVE_HEADER_TIMEOUT } else { header_timeout })
            .keep_alive(!reserve);
        b.http2().timer(TokioTimer::new()).keep_alive_interval(Some(header_timeout));
        b
    };
    let (regular, reserve) = (builder(false), builder(true));
    tokio::pin!(shutdown);
    loop {
        let conn = tokio::select! {
            conn = acceptor.accept() => conn,
            () = &mut shutdown => break,
        };
        let service = hyper_util::service::TowerToHyperService::new(app.clone());
        let builder = if conn.reserve { &reserve } else { &regular };
        let connection = builder.serve_connection_with_upgrades(TokioIo::new(conn.stream), service).into_owned();
        let connection = graceful.watch(connection);
        tokio::spawn(async move {
            // Errors here are the client's (it went away, sent garbage or
            // nothing in time); hyper has answered what it could.
            if let Err(e) = connection.await {
                tracing::debug!("HTTP connection ended: {e}");
            }
        });
    }
    drop(acceptor);
    graceful.shutdown().await;
}

/// The connections `acceptor` hands out, as tonic's incoming stream.
pub fn incoming(mut acceptor: Acceptor) -> impl futures::Stream<Item = Result<LimitedStream, io::Error>> {
    async_stream::stream! {
        loop {
            yield Ok(acceptor.accept().await.stream);
        }
    }
}

/// Raises the soft file-descriptor limit to the hard one (as Go's runtime
/// does), and warns when the connection limits could still exhaust it.
pub fn raise_fd_limit(connections: usize) {
    #[cfg(unix)]
    {
        let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
        // SAFETY: getrlimit/setrlimit only read and write the struct given.
        unsafe {
            if libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) != 0 {
                return;
            }
            if limit.rlim_cur < limit.rlim_max {
                let raised = libc::rlimit { rlim_cur: limit.rlim_max, rlim_max: limit.rlim_max };
                if libc::setrlimit(libc::RLIMIT_NOFILE, &raised) == 0 {
                    limit = raised;
                }
            }
        }
        // Worker channels, the log, the model files: a margin for the rest.
        let needed = connections as u64 + 128;
        if limit.rlim_cur < needed {
            tracing::warn!(
                "the file-descriptor limit is {}, but the connection limits allow {connections} connections; lower max_connections or raise the limit (ulimit -n)",
                limit.rlim_cur
            );
        }
    }
}
