//! What both segment kinds share: names and paths, the per-name lock, the
//! space check, creating a fully reserved temp file, and bounds-checked
//! little-endian header fields.

use crate::IpcError;
use nix::errno::Errno;
use std::fs::File;
use std::io;
use std::path::{Path, PathBuf};

/// Data regions start at a multiple of this, so that every load the kernels
/// make from a segment is as aligned as from a fresh allocation. 4 KiB is the
/// x86-64 page; the layout must not depend on the machine it was built on.
pub const PAGE: usize = 4096;

pub fn align_up(x: usize, to: usize) -> usize {
    x.div_ceil(to) * to
}

pub fn io_err(path: &Path) -> impl FnOnce(io::Error) -> IpcError + '_ {
    move |source| IpcError::Io { path: path.to_path_buf(), source }
}

/// A segment name is one plain file name. A leading dot is refused because
/// temp files being built start with one.
pub fn check_name(name: &str) -> Result<(), IpcError> {
    let bad = |reason: &str| Err(IpcError::BadName { name: name.to_string(), reason: reason.to_string() });
    if name.is_empty() {
        return bad("it is empty");
    }
    if name.contains(['/', '\0']) {
        return bad("it must be a plain file name, without '/'");
    }
    if name.starts_with('.') {
        return bad("it must not start with '.'");
    }
    Ok(())
}

pub fn segment_path(shm_dir: &Path, name: &str) -> Result<PathBuf, IpcError> {
    check_name(name)?;
    Ok(shm_dir.join(name))
}

fn temp_prefix(name: &str) -> String {
    format!(".{name}.tmp")
}

/// Take the exclusive lock `<shm_dir>/<name>.lock`, blocking until it is
/// free. Held while a segment is checked and (re)built, so concurrent
/// starters build it once. Released when the returned file is dropped.
pub fn lock(shm_dir: &Path, name: &str) -> Result<File, IpcError> {
    let (file, path) = open_lock_file(shm_dir, name)?;
    file.lock().map_err(io_err(&path))?;
    Ok(file)
}

/// `<shm_dir>/<name>.lock`, created if missing, not locked yet.
fn open_lock_file(shm_dir: &Path, name: &str) -> Result<(File, PathBuf), IpcError> {
    check_name(name)?;
    std::fs::create_dir_all(shm_dir).map_err(io_err(shm_dir))?;
    let path = shm_dir.join(format!("{name}.lock"));
    let file = File::options().create(true).truncate(false).write(true).open(&path).map_err(io_err(&path))?;
    Ok((file, path))
}

/// Take the lock `<shm_dir>/<name>.lock` for as long as the returned file is
/// kept, waiting at most `wait` for another holder to let go. The KV
/// segment's creator keeps it for the segment's whole life, so "the lock is
/// free" means "its owner is dead": flock locks die with their process, even
/// under `kill -9`, which is what makes it safe to reclaim a segment then.
/// `None` when a live process still holds it after `wait`.
pub fn try_lock_for(shm_dir: &Path, name: &str, wait: std::time::Duration) -> Result<Option<File>, IpcError> {
    let (file, path) = open_lock_file(shm_dir, name)?;
    let deadline = std::time::Instant::now() + wait;
    loop {
        match file.try_lock() {
            Ok(()) => return Ok(Some(file)),
            Err(std::fs::TryLockError::WouldBlock) if std::time::Instant::now() < deadline => {
                std::thread::sleep(std::time::Duration::from_millis(50));
            }
            Err(std::fs::TryLockError::WouldBlock) => return Ok(None),
            Err(std::fs::TryLockError::Error(e)) => return Err(IpcError::Io { path, source: e }),
        }
    }
}

/// Whether a live process holds `<shm_dir>/<name>.lock` (see [`try_lock_for`]).
pub fn is_locked(shm_dir: &Path, name: &str) -> bool {
    let path = shm_dir.join(format!("{name}.lock"));
    match File::options().write(true).open(&path) {
        Ok(file) => matches!(file.try_lock(), Err(std::fs::TryLockError::WouldBlock)),
        Err(_) => false,
    }
}

/// Remove temp files that a builder killed mid-way left behind; they would
/// otherwise hold tmpfs memory until reboot. Call only under [`lock`].
pub fn remove_stale_temps(shm_dir: &Path, name: &str) {
    let prefix = temp_prefix(name);
    if let Ok(entries) = std::fs::read_dir(shm_dir) {
        for entry in entries.flatten() {
            if entry.file_name().to_str().is_some_and(|n| n.starts_with(&prefix)) {
                let _ = std::fs::remove_file(entry.path());
            }
        }
    }
}

/// Remove segment `name` and its lock file; a missing file is not an error.
pub fn remove(shm_dir: &Path, name: &str) -> io::Result<()> {
    check_name(name).map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e.to_string()))?;
    for path in [shm_dir.join(name), shm_dir.join(format!("{name}.lock"))] {
        match std::fs::remove_file(&path) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(e),
            _ => {}
        }
    }
    Ok(())
}

/// Fail unless `needed` bytes fit in `available`.
pub fn check_fits(needed: u64, available: u64, dir: &Path) -> Result<(), IpcError> {
    if needed > available {
        return Err(IpcError::NoSpace { dir: dir.to_path_buf(), needed, available });
    }
    Ok(())
}

/// Bytes an unprivileged process may still allocate in `dir`'s filesystem.
fn free_space(dir: &Path) -> Result<u64, IpcError> {
    let st = nix::sys::statvfs::statvfs(dir).map_err(|e| IpcError::Io { path: dir.to_path_buf(), source: e.into() })?;
    Ok((st.blocks_available() as u64).saturating_mul(st.fragment_size() as u64))
}

/// A new temp file in `shm_dir` holding `len` reserved (zeroed) bytes, to be
/// filled and then renamed over `<shm_dir>/<name>` with `persist`. Dropped
/// unpersisted, it is deleted.
pub fn create_reserved(shm_dir: &Path, name: &str, len: u64) -> Result<tempfile::NamedTempFile, IpcError> {
    create_reserved_placed(shm_dir, name, len, |_| {})
}

/// [`create_reserved`], calling `place` on the sized but not yet reserved
/// file: a tmpfs allocates pages on the reservation, so a memory policy set
/// on the file must be set before it (see `numa`).
pub fn create_reserved_placed(shm_dir: &Path, name: &str, len: u64, place: impl FnOnce(&File)) -> Result<tempfile::NamedTempFile, IpcError> {
    std::fs::create_dir_all(shm_dir).map_err(io_err(shm_dir))?;
    check_fits(len, free_space(shm_dir)?, shm_dir)?;
    let temp = tempfile::Builder::new().prefix(&temp_prefix(name)).tempfile_in(shm_dir).map_err(io_err(shm_dir))?;
    // Sizing a tmpfs file allocates nothing; it lets `place` map the ranges.
    temp.as_file().set_len(len).map_err(io_err(temp.path()))?;
    place(temp.as_file());
    // Reserve every block now: on a tmpfs that is too small, writing through
    // a mapping would otherwise die of SIGBUS at some later page.
    let off_len = i64::try_from(len).map_err(|_| IpcError::NoSpace { dir: shm_dir.to_path_buf(), needed: len, available: 0 })?;
    match nix::fcntl::posix_fallocate(temp.as_file(), 0, off_len) {
        Ok(()) => {}
        Err(Errno::ENOSPC) => {
            return Err(IpcError::NoSpace { dir: shm_dir.to_path_buf(), needed: len, available: free_space(shm_dir).unwrap_or(0) })
        }
        // A filesystem without fallocate: fall back to a sparse file.
        Err(Errno::EOPNOTSUPP | Errno::EINVAL) => temp.as_file().set_len(len).map_err(io_err(temp.path()))?,
        Err(e) => return Err(IpcError::Io { path: temp.path().to_path_buf(), source: e.into() }),
    }
    Ok(temp)
}

/// Little-endian header fields; `None` when the buffer is too short.
pub fn u32_at(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_le_bytes(b.get(at..at.checked_add(4)?)?.try_into().ok()?))
}

pub fn u64_at(b: &[u8], at: usize) -> Option<u64> {
    Some(u64::from_le_bytes(b.get(at..at.checked_add(8)?)?.try_into().ok()?))
}

/// Human-readable size for error messages.
pub fn human(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = bytes as f64;
    let mut unit = 0;
    while v >= 1024.0 && unit < UNITS.len() - 1 {
        v /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else {
        format!("{v:.1} {}", UNITS[unit])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn check_fits_explains_the_fix() {
        check_fits(1 << 20, 2 << 20, Path::new("/dev/shm")).unwrap();
        let err = check_fits(3 << 30, 64 << 20, Path::new("/dev/shm")).unwrap_err();
        assert!(matches!(err, IpcError::NoSpace { needed, available, .. } if needed == 3 << 30 && available == 64 << 20));
        let msg = err.to_string();
        assert!(msg.contains("--shm-size") && msg.contains("/dev/shm") && msg.contains("3.0 GiB") && msg.contains("64.0 MiB"), "{msg}");
    }

    #[test]
    fn names_are_plain_files() {
        for bad in ["", "a/b", ".hidden", "..", "x\0y"] {
            assert!(matches!(check_name(bad), Err(IpcError::BadName { .. })), "{bad:?}");
        }
        check_name("duplex-weights").unwrap();
    }

    #[test]
    fn header_fields_never_read_out_of_bounds() {
        assert_eq!(u32_at(&[1, 0, 0, 0], 0), Some(1));
        assert_eq!(u32_at(&[1, 0, 0], 0), None);
        assert_eq!(u64_at(&[0; 8], 1), None);
        assert_eq!(u64_at(&[], usize::MAX - 2), None);
    }
}
