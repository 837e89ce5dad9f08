//! Set-up every Duplex process shares: its section of the TOML config file,
//! and the signals that shut it down.

use serde::de::DeserializeOwned;
use std::path::Path;

#[derive(Debug, thiserror::Error)]
pub enum ConfigFileError {
    #[error("cannot read config file {path}: {source}")]
    Io { path: String, source: std::io::Error },
    #[error("config file {path}: {message}")]
    Invalid { path: String, message: String },
}

/// Read section `[section]` of the TOML file at `path` into `T` (missing
/// section: `T::default()`). Unknown keys are errors when `T` denies them,
/// and every error names the file and the key.
pub fn load_section<T: DeserializeOwned + Default>(path: &Path, section: &str) -> Result<T, ConfigFileError> {
    let shown = path.display().to_string();
    let text = std::fs::read_to_string(path).map_err(|source| ConfigFileError::Io { path: shown.clone(), source })?;
    let invalid = |message: String| ConfigFileError::Invalid { path: shown.clone(), message };
    let mut table: toml::Table = toml::from_str(&text).map_err(|e| invalid(e.to_string()))?;
    let known = ["router", "prefill", "decode"];
    if let Some(other) = table.keys().find(|k| !known.contains(&k.as_str())) {
        return Err(invalid(format!("unknown section [{other}]; expected one of {known:?}")));
    }
    match table.remove(section) {
        None => Ok(T::default()),
        Some(value) => value.try_into().map_err(|e: toml::de::Error| invalid(format!("[{section}]: {e}"))),
    }
}

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

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, Default, PartialEq, serde::Deserialize)]
    #[serde(default, deny_unknown_fields)]
    struct Section {
        port: u16,
        name: String,
    }

    #[test]
    fn sections_and_errors() {
        let dir = std::env::temp_dir().join(format!("duplex-config-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("c.toml");
        std::fs::write(&file, "[decode]\nport = 7\n[router]\nname = \"x\"\n").unwrap();
        assert_eq!(load_section::<Section>(&file, "decode").unwrap(), Section { port: 7, name: String::new() });
        assert_eq!(load_section::<Section>(&file, "prefill").unwrap(), Section::default());
        std::fs::write(&file, "[decode]\nprot = 7\n").unwrap();
        let e = load_section::<Section>(&file, "decode").unwrap_err().to_string();
        assert!(e.contains("prot") && e.contains("c.toml"), "{e}");
        std::fs::write(&file, "[decoder]\nport = 7\n").unwrap();
        assert!(load_section::<Section>(&file, "decode").unwrap_err().to_string().contains("[decoder]"));
        std::fs::write(&file, "[decode]\nport = \"x\"\n").unwrap();
        assert!(load_section::<Section>(&file, "decode").unwrap_err().to_string().contains("port"));
        assert!(load_section::<Section>(&dir.join("missing.toml"), "decode").is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
