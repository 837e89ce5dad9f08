//! Set-up every Duplex process shares: its listeners, and the signals that
//! shut it down. (Its settings: [`crate::config`].)

use std::path::Path;

#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("cannot listen on {addr}: {source}")]
    Listen { addr: String, source: std::io::Error },
    #[error("host {0:?} is neither an IP address nor a name that resolves")]
    Host(String),
    #[error(transparent)]
    Metrics(#[from] crate::TelemetryError),
}

/// Where a worker takes its internal gRPC calls: a TCP port, or a Unix
/// socket when every process is on one host (`duplex serve`): then only
/// processes that may open the socket's directory can even connect.
pub enum Listener {
    Tcp(tokio::net::TcpListener),
    Unix(tokio::net::UnixListener),
}

impl From<tokio::net::TcpListener> for Listener {
    fn from(l: tokio::net::TcpListener) -> Self {
        Listener::Tcp(l)
    }
}

impl std::fmt::Display for Listener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Listener::Tcp(l) => match l.local_addr() {
                Ok(a) => write!(f, "{a}"),
                Err(_) => write!(f, "a TCP port"),
            },
            Listener::Unix(l) => match l.local_addr().ok().and_then(|a| a.as_pathname().map(|p| p.display().to_string())) {
                Some(p) => write!(f, "unix:{p}"),
                None => write!(f, "a Unix socket"),
            },
        }
    }
}

/// Serve `router` on `listener` until `shutdown`.
pub async fn serve_grpc(router: tonic::transport::server::Router, listener: Listener, shutdown: impl std::future::Future<Output = ()> + Send) -> Result<(), tonic::transport::Error> {
    match listener {
        Listener::Tcp(l) => router.serve_with_incoming_shutdown(tokio_stream::wrappers::TcpListenerStream::new(l), shutdown).await,
        Listener::Unix(l) => router.serve_with_incoming_shutdown(tokio_stream::wrappers::UnixListenerStream::new(l), shutdown).await,
    }
}

/// Bind the Unix socket `path`. A socket file left by a dead process is
/// replaced; one that a live process answers on is an error, as a busy TCP
/// port would be.
pub fn bind_unix(path: &Path) -> Result<tokio::net::UnixListener, StartError> {
    let err = |source: std::io::Error| StartError::Listen { addr: format!("unix:{}", path.display()), source };
    if path.exists() {
        if std::os::unix::net::UnixStream::connect(path).is_ok() {
            return Err(err(std::io::Error::new(std::io::ErrorKind::AddrInUse, "a live process listens on it")));
        }
        std::fs::remove_file(path).map_err(err)?;
    }
    tokio::net::UnixListener::bind(path).map_err(err)
}

/// A worker's start: logging, its Prometheus endpoint on `metrics_port` (0:
/// none), and its gRPC listener: `unix_socket` if given, else `host:port`.
pub async fn start_worker(host: &str, port: u16, unix_socket: Option<&Path>, metrics_port: u16) -> Result<Listener, StartError> {
    start_worker_metrics(host, metrics_port).await?;
    match unix_socket {
        Some(path) => Ok(Listener::Unix(bind_unix(path)?)),
        None => {
            let tcp = tokio::net::TcpListener::bind((host, port)).await;
            tcp.map(Listener::Tcp).map_err(|source| StartError::Listen { addr: format!("{host}:{port}"), source })
        }
    }
}

async fn start_worker_metrics(host: &str, metrics_port: u16) -> Result<(), StartError> {
    crate::init_logging();
    if metrics_port != 0 {
        // An IP address (v4 or v6) or a host name.
        let addr = std::net::ToSocketAddrs::to_socket_addrs(&(host, metrics_port)).ok().and_then(|mut a| a.next()).ok_or_else(|| StartError::Host(host.to_string()))?;
        crate::install(Some(addr))?;
    }
    Ok(())
}

/// Resolves on Ctrl-C or SIGTERM (what `docker stop` and the supervisor send).
pub async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(s) => s,
            Err(_) => {
                let _ = ctrl_c.await;
                return;
            }
        };
        tokio::select! {
            _ = ctrl_c => {},
            _ = term.recv() => {},
        }
    }
    #[cfg(not(unix))]
    let _ = ctrl_c.await;
}
